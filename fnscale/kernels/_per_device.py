"""A kernel's `jax.shard_map`: the one way the kernels run per device over a mesh.

Every kernel (attention's Pallas kernels, the context forms, the blockwise cross-entropy)
runs in a shard_map over the mesh axes not already manual, unchecked (`check_vma=False`:
a Pallas call's output types say nothing of varying axes). On Explicit axes, where
shardings are part of the array types, jax refuses an argument whose sharding is not the
spec it enters by: each is resharded to it first (`jax.sharding.reshard`), as the
partitioner would on Auto axes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax


def free_axes(mesh) -> frozenset:
  """The axes of `mesh` (None: the context mesh) that are not manual where this runs."""
  context = jax.sharding.get_abstract_mesh()
  manual = set(context.manual_axes) if not context.empty else set()
  target = mesh if mesh is not None else context
  return frozenset(a for a in target.axis_names if a not in manual)


def explicit_free_axes(mesh=None) -> frozenset:
  """The free axes of `mesh` (None: the context mesh) that are Explicit."""
  target = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  return frozenset(getattr(target, "explicit_axes", ())) & free_axes(mesh)


def per_device(fn: Callable, args: Sequence, in_specs, out_specs, mesh, *,
               like=None) -> object:
  """`fn(*args)` in a shard_map over `mesh`'s free axes (`mesh` None: the context mesh),
  arguments entering by `in_specs` and results leaving by `out_specs` (PartitionSpecs
  over those axes), varying types unchecked. `like`: on Explicit axes the (one) result is
  resharded to this array's sharding, the type the function's reference gives it."""
  free, explicit = free_axes(mesh), bool(explicit_free_axes(mesh))
  if explicit:
    args = [jax.sharding.reshard(x, s) for x, s in zip(args, in_specs)]
  out = jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                      axis_names=free, check_vma=False)(*args)
  if explicit and like is not None:
    out = jax.sharding.reshard(out, jax.typeof(like).sharding.spec)
  return out
