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
]
