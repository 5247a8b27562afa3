"""Global batches from each process's rows (`global_batch`).

Each process feeds only its own rows; `global_batch` turns them into global `jax.Array`s
(`jax.make_array_from_process_local_data`), working out each leaf's global shape from its
sharding and naming a leaf whose rows don't split over this process's shards.
`fnscale.multihost` re-exports `global_batch` (as does the package root).
"""
from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding
import numpy as np

from fnscale._tree import entry_axes as _entry_axes
from fnscale._tree import leaf_shardings as _broadcast_shardings
from fnscale._tree import path_str
from fnscale.errors import ShardingError


def _leaf_global_shape(path: str, local_shape, sharding) -> tuple[int, ...]:
  """The global shape a process-local leaf stands for under `sharding`."""
  if not isinstance(sharding, NamedSharding):
    raise ShardingError(
        f"global_batch leaf '{path}': sharding {sharding!r} is not a NamedSharding; fix: "
        "use fnscale.batch_sharding(mesh) or a NamedSharding.")
  spec = sharding.spec
  if len(spec) > len(local_shape):
    raise ShardingError(
        f"global_batch leaf '{path}' has shape {tuple(local_shape)} but its sharding "
        f"{spec} needs rank >= {len(spec)}; fix: give the leaf a leading batch dimension.")
  sizes = dict(sharding.mesh.shape)
  counts = [math.prod(sizes[a] for a in _entry_axes(e)) for e in spec]
  probe = tuple(counts) + (1,) * (len(local_shape) - len(spec))
  index_map = sharding.addressable_devices_indices_map(probe)
  if not index_map:
    raise ShardingError(
        f"global_batch leaf '{path}': this process ({jax.process_index()}) has no device in "
        "the sharding's mesh; fix: build the mesh over jax.devices() (all processes).")
  global_shape = list(local_shape)
  for d, n in enumerate(counts):
    if n == 1:
      continue
    # Distinct shards of dim d this process holds; its local rows split evenly over them.
    held = len({(idx[d].start or 0) for idx in index_map.values()})
    if local_shape[d] % held:
      axes = _entry_axes(spec[d])
      raise ShardingError(
          f"batch not divisible by the data axes: process-local leaf '{path}' dimension {d} "
          f"has size {local_shape[d]}, but this process holds {held} of the {n} shards of "
          f"mesh axes {axes}; fix: give each process a multiple of {held} rows "
          f"(global batch a multiple of {n}).")
    global_shape[d] = local_shape[d] // held * n
  return tuple(global_shape)


def global_batch(local, sharding) -> Any:
  """Builds global `jax.Array`s from each process's part of a batch.

  Every process calls it with its own rows (the leading dims it holds under `sharding`);
  the result is one global array per leaf whose leading dim is the concatenation over
  processes in mesh order. In a single process it is a sharded `device_put`.

  Args:
    local: pytree of process-local numpy (or jax) arrays, e.g. [local_batch, seq] int32.
    sharding: one NamedSharding for every leaf (usually `fnscale.batch_sharding(mesh)`) or
      a pytree of them with `local`'s structure.

  Returns:
    Pytree of global jax.Arrays; a leaf of local shape [b, ...] on a process holding k of
    the n shards of the leading dim has global shape [b / k * n, ...].

  Raises:
    ShardingError: a leaf whose sharded dims don't split over this process's shards (naming
      the leaf path, size and shard counts), too low a rank, or mismatched structures.

  Examples:
    One process holds every row here; in a job of N processes each passes its 16 / N rows.

    >>> import numpy as np
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 8})
    >>> rows = {"tokens": np.arange(64).reshape(16, 4)}
    >>> batch = fs.global_batch(rows, fs.batch_sharding(mesh))
    >>> batch["tokens"].shape, batch["tokens"].sharding.spec
    ((16, 4), P('data',))
    >>> batch["tokens"].addressable_shards[1].data.tolist()
    [[8, 9, 10, 11], [12, 13, 14, 15]]
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(local)
  shs = _broadcast_shardings(local, sharding, "batch")
  out = []
  for (p, leaf), s in zip(pairs, shs):
    path = path_str(p)
    if not hasattr(leaf, "shape"):
      leaf = np.asarray(leaf)
    gshape = _leaf_global_shape(path, tuple(leaf.shape), s)
    out.append(jax.make_array_from_process_local_data(s, leaf, gshape))
  return jax.tree_util.tree_unflatten(treedef, out)
