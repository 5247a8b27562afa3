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

from fnscale.distributed import DistributedInfo, barrier, global_batch, initialize
from fnscale.sharding import (
    ShardPlan,
    batch_sharding,
    check_batch,
    check_shardings,
    data_axes,
    logical_to_spec,
    opt_state_shardings,
    shard_plan,
    sharding_report,
    shardings,
)

__all__ = [
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
]
