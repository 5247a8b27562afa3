"""The one definition of fnscale's mesh-axis conventions.

Every module that asks "which axes split the batch?" or "which axes split attention heads?"
reads it here, so the batch sharding, the activation constraint and the attention kernel's
`shard_map` specs always agree. The conventions are a value (`AxisConventions`) with presets
for fnscale's own axis names, MaxText's and Levanter's; `axis_conventions(preset)` makes one
the ambient convention for a block (`fnscale._context.AXIS_CONVENTIONS`), the way
`jax.set_mesh` makes a mesh ambient.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from fnscale import _context
from fnscale._errors import MeshError


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
    stage: the pipeline axes (`fnscale.parallel.pipeline`): a stacked layer dim's stages
      are split over the first present; outside the pipeline they split the batch like a
      data axis (list them in `data` too), and a mesh with several TPU slices lays one
      across the slices by default (`fnscale.make_mesh`).
    expert: the expert-parallel axes: a mixture-of-experts layer
      (`fnscale.parallel.moe`) splits its experts over the first one present and
      exchanges tokens over it. An expert axis also splits the batch (it is in `data`), as
      in MaxText, so the layers around the experts stay data parallel over it.
    context: the context-parallel axes: activations are split along the sequence (a batch's
      second dim) over those present (`batch_sharding`, `constrain_batch`, attention's
      all-gather or ring forms, `cross_entropy`'s tokens).

  Examples:
    The presets: fnscale's own (the default), MaxText's and Levanter's axis names.

    >>> import fnscale as fs
    >>> fs.FNSCALE_AXES.data, fs.FNSCALE_AXES.head
    (('replica', 'stage', 'data', 'fsdp', 'expert'), ('tensor',))
    >>> fs.MAXTEXT_AXES.context, fs.LEVANTER_AXES.data, fs.LEVANTER_AXES.head
    (('context',), ('replica', 'data'), ('model',))
    >>> mine = fs.AxisConventions(data=("dp",), replica=("dp",), head=("tp",))
    >>> with fs.axis_conventions(mine):
    ...   fs.batch_sharding(fs.make_mesh({"dp": 4, "tp": 2})).spec
    P('dp',)
  """
  data: tuple[str, ...]
  replica: tuple[str, ...]
  head: tuple[str, ...]
  other: tuple[str, ...] = ()
  stage: tuple[str, ...] = ()
  expert: tuple[str, ...] = ()
  context: tuple[str, ...] = ()

  def names(self) -> frozenset[str]:
    """Every axis name this convention knows."""
    return frozenset(self.data + self.replica + self.head + self.other + self.stage
                     + self.expert + self.context)


# fnscale's names. "replica": data parallel across slices (DCN); "data": data parallel within
# a slice; "fsdp": fully sharded data parallel (ZeRO-3), which also splits the batch;
# "tensor": Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM"); "stage":
# pipeline stages, which outside the pipeline split the batch (as MaxText's "stage" does);
# "expert": expert parallelism (Lepikhin et al. 2020, "GShard"), which also splits the batch;
# "context": context parallelism, the sequence split (Liu et al. 2023, "Ring Attention").
FNSCALE = AxisConventions(data=("replica", "stage", "data", "fsdp", "expert"),
                          replica=("replica", "data"), head=("tensor",), stage=("stage",),
                          expert=("expert",), context=("context",))

# MaxText's mesh axes (configs/base.yml): the input batch is split over data, stage, fsdp,
# fsdp_transpose and expert; heads over the tensor axes its "heads" rule names; context
# splits the sequence (its "activation_length" rule), as sequence once did.
MAXTEXT = AxisConventions(
    data=("data", "stage", "fsdp", "fsdp_transpose", "expert"), replica=("data",),
    head=("tensor", "tensor_transpose", "tensor_sequence", "autoregressive"),
    other=("sequence", "context_autoregressive"), stage=("stage",), expert=("expert",),
    context=("context",))

# Levanter's mesh axes: the batch over replica and data, params (FSDP) over data, heads and
# MLP width over "model".
LEVANTER = AxisConventions(data=("replica", "data"), replica=("replica",), head=("model",))

PRESETS = {"fnscale": FNSCALE, "maxtext": MAXTEXT, "levanter": LEVANTER}

# Names some preset gives a meaning: a rule naming one of them on a mesh without it is a
# choice (rules written for several meshes), not a typo.
KNOWN_AXES = frozenset().union(*(c.names() for c in PRESETS.values()))

# The axis automatic FSDP shards unannotated params over by default.
FSDP_AXIS = "fsdp"

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

  Examples:
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"replica": 2, "data": 4})
    >>> fs.batch_sharding(mesh).spec  # fnscale's names: replica and data split the batch
    P(('replica', 'data'),)
    >>> with fs.axis_conventions("maxtext"):  # MaxText's "data" only
    ...   fs.batch_sharding(mesh).spec
    P('data',)
  """
  token = _context.AXIS_CONVENTIONS.set(as_conventions(conventions))
  try:
    yield current()
  finally:
    _context.AXIS_CONVENTIONS.reset(token)


def current() -> AxisConventions:
  """The ambient conventions (`FNSCALE` unless inside `axis_conventions`)."""
  active = _context.AXIS_CONVENTIONS.get()
  return FNSCALE if active is None else active


def data_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes that split the batch under the ambient axis conventions
  (`fnscale.axis_conventions`), in mesh order; axes of size 1 are kept (harmless).

  Examples:
    >>> import fnscale as fs
    >>> fs.data_axes(fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    ('data', 'fsdp')
    >>> with fs.axis_conventions(fs.LEVANTER_AXES):
    ...   fs.data_axes(fs.make_mesh({"data": 4, "model": 2}))
    ('data',)
  """
  data = current().data
  return tuple(a for a in mesh.axis_names if a in data)


def stage_axis(mesh) -> str | None:
  """The mesh's pipeline axis (the first of the conventions' stage axes it has), or None."""
  return next((a for a in current().stage if a in mesh.axis_names), None)


def context_axes(mesh) -> tuple[str, ...]:
  """The mesh's context-parallel (sequence-splitting) axes in mesh order."""
  context = current().context
  return tuple(a for a in mesh.axis_names if a in context)


def head_axes(mesh) -> tuple[str, ...]:
  """The mesh's head (tensor-parallel) axes in mesh order."""
  head = current().head
  return tuple(a for a in mesh.axis_names if a in head)


def expert_axis(mesh) -> str | None:
  """The mesh's expert-parallel axis (the convention's first one the mesh has), or None."""
  return next((a for a in current().expert if a in mesh.axis_names), None)
