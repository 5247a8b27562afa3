"""Parallelism beyond data, FSDP and tensor: each mode a mesh axis plus pure functions.

The home of sequence (`context`), expert (`expert`) and pipeline (`stage`) parallelism.

Layer: imports the core pipeline and `fnscale.kernels`; never `fnscale.multihost`,
`fnscale.checkpoint`, `fnscale.analysis` or the package root.
"""
from fnscale.parallel import context, _experts as experts, _pipeline as pipeline

__all__ = ["context", "experts", "pipeline"]
