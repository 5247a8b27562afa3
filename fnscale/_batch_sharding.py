"""Batch shardings: the batch over the data axes, the sequence over the context axes.

`batch_sharding` places a batch, `constrain_batch` pins activations inside a model to the
same layout, `check_batch` checks a batch against its sharding before anything is traced.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from fnscale import _axes
from fnscale import _tree
from fnscale._errors import ShardingError
from fnscale._mesh import check_mesh
from fnscale._specs import _as_axes, _check_divisible, _shape_dtype


def batch_sharding(mesh, *, axes=None, context_axes=None) -> NamedSharding:
  """Sharding of a batch: the leading dimension split over `axes` (default the mesh's
  data-like axes under the ambient `fnscale.axis_conventions`), the second (the sequence)
  over `context_axes` (default the mesh's context axes of size > 1: context parallelism,
  for batches of [batch, seq, ...] whose sequence `fnscale.parallel.context.reorder` put in
  the attention's order), the other dimensions replicated.

  Raises:
    MeshError: `mesh` not a Mesh.
    ShardingError: `axes` or `context_axes` not axis names, an axis not in the mesh, an
      axis in both.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    >>> sharding = fs.batch_sharding(mesh)
    >>> sharding.spec
    P(('data', 'fsdp'),)
    >>> x = jax.device_put(jnp.zeros((8, 16)), sharding)
    >>> x.addressable_shards[0].data.shape  # 8 rows over 4 data shards
    (2, 16)
    >>> fs.batch_sharding(fs.make_mesh({"data": 2, "context": 4})).spec  # the sequence too
    P('data', 'context')
  """
  check_mesh(mesh, "batch_sharding", abstract=True)
  axes = _axes.data_axes(mesh) if axes is None else _as_axes(axes, "axes")
  context = (_sequence_axes(mesh) if context_axes is None
             else _as_axes(context_axes, "context_axes"))
  for a, what in [(a, "data-like") for a in axes] + [(a, "context") for a in context]:
    if a not in mesh.axis_names:
      raise ShardingError(
          f"batch axis {a!r} is not in the mesh (axes {tuple(mesh.axis_names)}); fix: pass "
          f"axes that the mesh has, or None for its {what} axes.")
  both = sorted(set(axes) & set(context))
  if both:
    raise ShardingError(
        f"mesh axis {both[0]!r} splits both the batch {axes} and the sequence {context}; a "
        "mesh axis can split one dimension: name it in one of axes= and context_axes=.")
  if not axes and not context:
    return NamedSharding(mesh, PartitionSpec())
  entries = [_tree.spec_entry(axes) if axes else None]
  if context:
    entries.append(_tree.spec_entry(context))
  return NamedSharding(mesh, PartitionSpec(*entries))


def _sequence_axes(mesh) -> tuple[str, ...]:
  """The context axes that split a sequence: in the mesh, of size > 1."""
  return tuple(a for a in _axes.context_axes(mesh) if mesh.shape[a] > 1)


def constrain_batch(tree, *, axes=None):
  """Pins the leading (batch) dim of activations to the data axes of the ambient mesh, and
  the second (the sequence) to its context axes.

  Call it on the residual stream inside a model (e.g. at each block's input). Without it,
  GSPMD may carry an FSDP param's sharding (say, d_model over "fsdp") into the activations
  instead of the batch's, and then every device computes attention for the whole batch: the
  step is correct but does up to N x the attention FLOPs and far more communication (XLA logs
  "Involuntary full rematerialization"). On a mesh with a context axis (of size > 1) the
  sequence dim of arrays of rank >= 2 is split over it too (context parallelism: every
  activation [batch, seq, ...] holds a shard of the sequence). Other dimensions stay
  unconstrained, so tensor parallel layouts are still free. MaxText's activation logical
  constraints ("activation_batch", "activation_length") serve the same end.

  Args:
    tree: arrays (or a pytree of them) of shape [batch, ...] ([batch, seq, ...] under a
      context axis).
    axes: mesh axes for the batch dim; default the mesh's data-like axes.

  Returns:
    The same values, constrained. Outside a mesh (`with_mesh`/`jax.set_mesh`), or for axes that
    are manual (inside `shard_map`), it is the identity. When every mesh axis is Explicit
    (shardings are part of the array types) it is `jax.sharding.reshard` to the data axes on
    the batch dim (and the context axes on the sequence dim), the other dims keeping their
    axes except those.

  Raises:
    ShardingError: `axes` not axis names.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> @fs.with_mesh(fs.make_mesh({"fsdp": 8}))
    ... @jax.jit
    ... def block(x, w):
    ...   return fs.constrain_batch(jnp.tanh(x @ w))
    >>> block(jnp.ones((16, 32)), jnp.ones((32, 32))).sharding.spec
    P('fsdp',)
    >>> x = jnp.ones((16, 32))
    >>> fs.constrain_batch(x) is x  # outside a mesh
    True
  """
  axes = None if axes is None else _as_axes(axes, "axes")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tree
  manual = set(getattr(mesh, "manual_axes", ()))
  axes = tuple(a for a in (_axes.data_axes(mesh) if axes is None else axes) if a not in manual)
  context = tuple(a for a in _sequence_axes(mesh) if a not in manual and a not in axes)
  if not axes and not context:
    return tree
  explicit = not mesh.auto_axes  # every axis Explicit: shardings are part of the types

  def pin(x):
    if jnp.ndim(x) == 0:
      return x
    lead = [axes] + ([context] if context and jnp.ndim(x) >= 2 else [])
    pinned = {a for group in lead for a in group}
    if explicit:  # keep the other dims' axes, minus the pinned ones
      spec = PartitionSpec(*tuple(jax.typeof(x).sharding.spec)[len(lead):])
      rest = list(_tree.filter_spec(spec, lambda a: a not in pinned))
      rest += [None] * (jnp.ndim(x) - len(lead) - len(rest))
      return jax.sharding.reshard(x, PartitionSpec(
          *(_tree.spec_entry(g) for g in lead), *rest))
    spec = PartitionSpec(*(g or None for g in lead),
                         *([PartitionSpec.UNCONSTRAINED] * (jnp.ndim(x) - len(lead))))
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree_util.tree_map(pin, tree)


def check_batch(batch, sharding) -> None:
  """Checks that every leaf of `batch` fits its sharding before anything is traced.

  Args:
    batch: pytree of arrays (or ShapeDtypeStructs); the leading dim is the batch.
    sharding: one NamedSharding for all leaves or a pytree of them.

  Raises:
    ShardingError: "batch not divisible by the data axes", naming the leaf path, its size
      and the mesh axes' product; a scalar leaf under a sharded spec.
  """
  for (path, leaf), s in zip(_tree.leaves_with_paths(batch),
                             _tree.leaf_shardings(batch, sharding, "batch")):
    shape, _ = _shape_dtype(path, leaf)
    if not isinstance(s, NamedSharding):
      continue
    if len(s.spec) > len(shape):
      raise ShardingError(
          f"batch leaf '{path}' has shape {shape} but its sharding {s.spec} needs rank >= "
          f"{len(s.spec)}; fix: give every batch leaf a leading batch dimension.")
    _check_divisible(path, shape, s.spec, dict(s.mesh.shape), batch=True)
