"""The one definition of fnscale's mesh-axis conventions.

Every module that asks "which axes split the batch?" or "which axes split attention heads?"
reads it here, so the batch sharding, the activation constraint and the attention kernel's
`shard_map` specs always agree.
"""
from __future__ import annotations

# Data-like axes, outermost first: a batch's leading dim is split over those present.
# "replica": data parallel across slices (DCN); "data": data parallel within a slice;
# "fsdp": fully sharded data parallel (ZeRO-3), which also splits the batch.
DATA_AXES = ("replica", "data", "fsdp")

# The data-like axes that split only the batch: params are whole on each of their groups.
REPLICA_AXES = ("replica", "data")

# Model-parallel axis that splits attention heads (and MLP width) in Megatron-style tensor
# parallelism (Shoeybi et al. 2019, "Megatron-LM").
HEAD_AXES = ("tensor",)

# The axis automatic FSDP shards unannotated params over.
FSDP_AXIS = "fsdp"


def data_axes(mesh) -> tuple[str, ...]:
  """The mesh's data-like axes in mesh order (axes of size 1 are kept: harmless)."""
  return tuple(a for a in mesh.axis_names if a in DATA_AXES)


def head_axes(mesh) -> tuple[str, ...]:
  """The mesh's head (tensor-parallel) axes in mesh order."""
  return tuple(a for a in mesh.axis_names if a in HEAD_AXES)
