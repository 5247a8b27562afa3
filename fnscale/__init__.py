"""fnscale: a single-device JAX train step as one SPMD program on every chip.

Pure functions compose in one direction: topology -> mesh -> shardings -> compiled step.
"""
from fnscale.errors import (
    CheckpointError,
    CloudError,
    DistributedError,
    FnscaleError,
    KernelError,
    MeshError,
    ShardingError,
    StepError,
    TopologyError,
)
# The pipeline, in order: topology -> mesh -> shardings -> compiled step.
from fnscale.topology import (Topology, detect_topology, parse_accelerator_type, parse_shape,
                              simulate_cpu_devices)
from fnscale.mesh import MeshAxes, make_mesh, parallelism, parse_axes, with_mesh
from fnscale.sharding import (
    ShardPlan,
    batch_sharding,
    check_batch,
    check_shardings,
    constrain_batch,
    data_axes,
    logical_to_spec,
    opt_state_shardings,
    shard_plan,
    sharding_report,
    shardings,
)
from fnscale.step import (
    Collective,
    CompileReport,
    LossScale,
    TrainState,
    compilation_cache,
    compile_report,
    fast_compile_options,
    format_report,
    init_state,
    shard_step,
    state_shardings,
    train_step,
)
from fnscale.kernels import attention, cross_entropy, kernel_plan, with_kernel
# Around the pipeline: multi-host, accounting, checks, checkpoints, cloud, adapters.
from fnscale.distributed import DistributedInfo, barrier, global_batch, initialize, peer_guard
from fnscale import hlo
from fnscale.flops import measure_matmul_peak, mfu, model_flops_per_token, peak_flops
from fnscale.invariance import InvarianceReport, check_mesh_invariance
from fnscale import checkpoint
from fnscale.cloud import shutdown_at_exit
from fnscale.adapters import unbox_flax

__all__ = [
    "Collective",
    "CompileReport",
    "LossScale",
    "TrainState",
    "compilation_cache",
    "compile_report",
    "fast_compile_options",
    "format_report",
    "init_state",
    "shard_step",
    "state_shardings",
    "train_step",
    "unbox_flax",
    "measure_matmul_peak",
    "mfu",
    "model_flops_per_token",
    "peak_flops",
    "checkpoint",
    "hlo",
    "shutdown_at_exit",
    "attention",
    "cross_entropy",
    "kernel_plan",
    "with_kernel",
    "MeshAxes",
    "Topology",
    "detect_topology",
    "make_mesh",
    "parallelism",
    "parse_accelerator_type",
    "parse_axes",
    "parse_shape",
    "simulate_cpu_devices",
    "with_mesh",
    "CheckpointError",
    "CloudError",
    "DistributedError",
    "FnscaleError",
    "KernelError",
    "MeshError",
    "ShardingError",
    "StepError",
    "TopologyError",
    "ShardPlan",
    "batch_sharding",
    "check_batch",
    "check_shardings",
    "constrain_batch",
    "data_axes",
    "logical_to_spec",
    "opt_state_shardings",
    "shard_plan",
    "sharding_report",
    "shardings",
    "DistributedInfo",
    "barrier",
    "global_batch",
    "initialize",
    "peer_guard",
    "InvarianceReport",
    "check_mesh_invariance",
]
