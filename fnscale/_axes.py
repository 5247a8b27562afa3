"""The one definition of fnscale's mesh-axis conventions.

Every module that asks "which axes split the batch?" or "which axes split attention heads?"
reads it here, so the batch sharding, the activation constraint and the attention kernel's
`shard_map` specs always agree. The conventions are a value (`AxisConventions`) with presets
for fnscale's own axis names, MaxText's and Levanter's; `axis_conventions(preset)` makes one
the ambient convention for a block, the way `jax.set_mesh` makes a mesh ambient.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

from fnscale.errors import MeshError


class AxisConventions(NamedTuple):
  """What each mesh axis name means to fnscale.

  Fields (tuples of mesh axis names; a name absent from a mesh is ignored):
    data: the data-like axes, outermost first: a batch's leading dim is split over those
      present (`batch_sharding`, `constrain_batch`, the attention kernel's batch split).
    replica: the data-like axes that split only the batch: params are whole on each of their
      groups (a mesh whose axes > 1 are all of these is data parallel: replicated params are
      expected there, not warned about).
    head: the tensor-parallel axes that split attention heads (the attention kernel's
      `shard_map` splits heads over those present) and the vocabulary in `cross_entropy`.
    other: further names the convention gives a meaning (sequence, ...), so rules naming
      them aren't flagged as typos on a mesh without them.
    context: the context-parallel axes: activations are split along the sequence (a batch's
      second dim) over those present (`batch_sharding`, `constrain_batch`, attention's
      all-gather or ring forms, `cross_entropy`'s tokens).
  """
  data: tuple[str, ...]
  replica: tuple[str, ...]
  head: tuple[str, ...]
  other: tuple[str, ...] = ()
  context: tuple[str, ...] = ()

  def names(self) -> frozenset[str]:
    """Every axis name this convention knows."""
    return frozenset(self.data + self.replica + self.head + self.other + self.context)


# fnscale's names. "replica": data parallel across slices (DCN); "data": data parallel within
# a slice; "fsdp": fully sharded data parallel (ZeRO-3), which also splits the batch;
# "tensor": Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM");
# "context": context parallelism, the sequence split (Liu et al. 2023, "Ring Attention").
FNSCALE = AxisConventions(data=("replica", "data", "fsdp"), replica=("replica", "data"),
                          head=("tensor",), context=("context",))

# MaxText's mesh axes (configs/base.yml): the input batch is split over data, stage, fsdp,
# fsdp_transpose and expert; heads over the tensor axes its "heads" rule names; context
# splits the sequence (its "activation_length" rule), as sequence once did.
MAXTEXT = AxisConventions(
    data=("data", "stage", "fsdp", "fsdp_transpose", "expert"), replica=("data",),
    head=("tensor", "tensor_transpose", "tensor_sequence", "autoregressive"),
    other=("sequence", "context_autoregressive"), context=("context",))

# Levanter's mesh axes: the batch over replica and data, params (FSDP) over data, heads and
# MLP width over "model".
LEVANTER = AxisConventions(data=("replica", "data"), replica=("replica",), head=("model",))

PRESETS = {"fnscale": FNSCALE, "maxtext": MAXTEXT, "levanter": LEVANTER}

# Names some preset gives a meaning: a rule naming one of them on a mesh without it is a
# choice (rules written for several meshes), not a typo.
KNOWN_AXES = frozenset().union(*(c.names() for c in PRESETS.values()))

# The axis automatic FSDP shards unannotated params over by default.
FSDP_AXIS = "fsdp"

_ACTIVE: contextvars.ContextVar[AxisConventions] = contextvars.ContextVar(
    "fnscale_axis_conventions", default=FNSCALE)


def as_conventions(value) -> AxisConventions:
  """An `AxisConventions` from itself or a preset name ("fnscale", "maxtext", "levanter").

  Raises:
    MeshError: anything else, or fields that are not tuples of axis names.
  """
  if isinstance(value, str) and value in PRESETS:
    return PRESETS[value]
  if isinstance(value, AxisConventions) and all(
      isinstance(f, tuple) and all(isinstance(a, str) for a in f) for f in value):
    return value
  raise MeshError(
      f"axis conventions {value!r:.200} ({type(value).__name__}), expected an "
      f"fnscale.AxisConventions of tuples of axis names or a preset name in {sorted(PRESETS)}; "
      "fix: e.g. fnscale.axis_conventions('maxtext') or AxisConventions(data=('data',), "
      "replica=('data',), head=('model',)).")


@contextlib.contextmanager
def axis_conventions(conventions):
  """Makes `conventions` (an `AxisConventions` or a preset name) the ambient convention.

  `with fnscale.axis_conventions("levanter"): ...` around building, compiling and calling a
  step (read when a step is traced, like the ambient mesh): batches split over Levanter's
  replica and data axes, attention heads over "model".

  Raises:
    MeshError: a value that is neither (see `as_conventions`).
  """
  token = _ACTIVE.set(as_conventions(conventions))
  try:
    yield _ACTIVE.get()
  finally:
    _ACTIVE.reset(token)


def current() -> AxisConventions:
  """The ambient conventions (`FNSCALE` unless inside `axis_conventions`)."""
  return _ACTIVE.get()


def data_axes(mesh) -> tuple[str, ...]:
  """The mesh's data-like axes in mesh order (axes of size 1 are kept: harmless)."""
  data = current().data
  return tuple(a for a in mesh.axis_names if a in data)


def context_axes(mesh) -> tuple[str, ...]:
  """The mesh's context-parallel (sequence-splitting) axes in mesh order."""
  context = current().context
  return tuple(a for a in mesh.axis_names if a in context)


def head_axes(mesh) -> tuple[str, ...]:
  """The mesh's head (tensor-parallel) axes in mesh order."""
  head = current().head
  return tuple(a for a in mesh.axis_names if a in head)
