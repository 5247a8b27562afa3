"""fnscale: a single-device JAX train step as one SPMD program on every chip.

Pure functions compose in one direction: topology -> mesh -> shardings -> compiled step.
Tools around the pipeline are submodules: `fnscale.analysis.hlo`, `fnscale.analysis.flops`,
`fnscale.checkpoint`, `fnscale.cloud`, `fnscale.adapters`, `fnscale.analysis.invariance`, ...
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
    MeshError,
    PlanError,
    RuntimeFailure,
    ShardingError,
    StepError,
    StorageError,
    TopologyError,
)
# The pipeline, in order: topology -> mesh -> shardings -> compiled step.
from fnscale._topology import Topology, detect_topology, simulate_cpu_devices
from fnscale._mesh import MeshAxes, make_mesh, parallelism, with_mesh
from fnscale._axes import AxisConventions, axis_conventions
from fnscale._axes import FNSCALE as FNSCALE_AXES, LEVANTER as LEVANTER_AXES, MAXTEXT as MAXTEXT_AXES
from fnscale._sharding import batch_sharding, constrain_batch, sharding_layout, shardings
from fnscale._step import TrainState, train_step
from fnscale._state import init_state, state_shardings
from fnscale._compile import shard_step
from fnscale.analysis._report import CompileReport, compile_report, sharding_report
from fnscale.kernels import attention, cross_entropy, with_kernel
from fnscale.multihost import barrier, global_batch, initialize, process_rows
# The layers above the pipeline, reached as namespaces (`fs.checkpoint.save`, ...).
from fnscale import adapters, analysis, checkpoint, cloud, kernels, multihost, parallel
# Short names for the analysis tools (`fs.hlo` is `fs.analysis.hlo`).
from fnscale.analysis import _flops as flops, hlo, _invariance as invariance, _plan as plan, _report as report

__all__ = [
    "FnscaleError", "InputError", "RuntimeFailure",
    "CheckpointError", "CloudError", "DistributedArgumentError", "DistributedError",
    "ExpertError", "KernelError", "MeshError", "PlanError", "ShardingError", "StepError", "StorageError",
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
