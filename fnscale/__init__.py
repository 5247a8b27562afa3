"""fnscale: a single-device JAX train step as one SPMD program on every chip.

Pure functions compose in one direction: topology -> mesh -> shardings -> compiled step.
Tools around the pipeline are submodules: `fnscale.analysis.hlo`, `fnscale.analysis.flops`,
`fnscale.checkpoint`, `fnscale.cloud`, `fnscale.adapters`, `fnscale.lora`, `fnscale.analysis.invariance`, ...
"""
from fnscale.errors import (
    CheckpointError,
    CloudError,
    DistributedArgumentError,
    DistributedError,
    ExpertError,
    FnscaleError,
    InputError,
    KernelError,
    LoraError,
    MeshError,
    PlanError,
    RuntimeFailure,
    ShardingError,
    StepError,
    StorageError,
    TopologyError,
)
# The pipeline, in order: topology -> mesh -> shardings -> compiled step.
from fnscale.topology import Topology, detect_topology, simulate_cpu_devices
from fnscale.mesh import MeshAxes, make_mesh, parallelism, with_mesh
from fnscale._axes import AxisConventions, axis_conventions
from fnscale._axes import FNSCALE as FNSCALE_AXES, LEVANTER as LEVANTER_AXES, MAXTEXT as MAXTEXT_AXES
from fnscale.sharding import batch_sharding, constrain_batch, sharding_layout, shardings
from fnscale.step import TrainState, train_step
from fnscale.state import init_state, state_shardings
from fnscale.compile import shard_step
from fnscale.analysis.report import CompileReport, compile_report, sharding_report
from fnscale.kernels import attention, cross_entropy, with_kernel
from fnscale.multihost import barrier, global_batch, initialize, process_rows
# The layers above the pipeline, reached as namespaces (`fs.checkpoint.save`, ...).
from fnscale import adapters, analysis, checkpoint, cloud, kernels, lora, multihost, parallel
# Short names for the analysis tools (`fs.hlo` is `fs.analysis.hlo`).
from fnscale.analysis import flops, hlo, invariance, plan, report

__all__ = [
    "FnscaleError", "InputError", "RuntimeFailure",
    "CheckpointError", "CloudError", "DistributedArgumentError", "DistributedError",
    "ExpertError", "KernelError", "LoraError", "MeshError", "PlanError", "ShardingError", "StepError", "StorageError",
    "TopologyError",
    "Topology", "detect_topology", "simulate_cpu_devices",
    "MeshAxes", "make_mesh", "parallelism", "with_mesh", "AxisConventions", "axis_conventions",
    "FNSCALE_AXES", "LEVANTER_AXES", "MAXTEXT_AXES",
    "batch_sharding", "constrain_batch", "sharding_layout", "sharding_report", "shardings",
    "TrainState", "train_step",
    "init_state", "state_shardings",
    "shard_step",
    "CompileReport", "compile_report",
    "attention", "cross_entropy", "with_kernel",
    "barrier", "global_batch", "initialize", "process_rows",
]
