"""Global batches from each process's rows (`process_rows`, `global_batch`,
`check_batch_replicas`).

Which rows of a global batch a process feeds follows from the batch sharding alone: the rows
its addressable devices hold (`process_rows`). Where the mesh splits the batch across
processes those are disjoint blocks; where it replicates the batch across processes (a
`{"tensor": 8}` mesh over two hosts) every such process feeds the same rows, and a loader
that splits the batch per process anyway (grain's `ShardByJaxProcess`) makes the "replicas" of
one global array disagree: each process would train on its own rows without a word. So
`global_batch` compares a fingerprint of every block several processes hold through JAX's
coordination service: on the first batch of every layout (leaf shardings and shapes) a
process feeds, and every `check_every`-th call after (and on request,
`check_batch_replicas`); a difference is a `DistributedError` naming the rows, the processes
and the fix. `recipes/bench/replica_check.py` measures what a check costs.
`fnscale.multihost` re-exports these (as does the package root).
"""
from __future__ import annotations

import hashlib
import itertools
import math
from typing import Any

import jax
from jax.sharding import NamedSharding
import numpy as np

from fnscale._tree import entry_axes as _entry_axes
from fnscale._tree import leaf_shardings as _broadcast_shardings
from fnscale._tree import path_str
from fnscale._errors import DistributedArgumentError, DistributedError, ShardingError
from fnscale.multihost import _agreement
from fnscale.multihost import _coordination as _co

# The k-th check of this process is compared with the k-th of every other. `global_batch`
# checks the first batch of each layout this process feeds (`_layouts`) and every
# `check_every`-th call (`_calls`): the same decisions on every process, which make the same
# calls in the same order.
_check_count = itertools.count()
_calls = itertools.count()
_layouts: set = set()
CHECK_EVERY = 100


def _named(sharding, what: str) -> NamedSharding:
  if not isinstance(sharding, NamedSharding):
    raise ShardingError(
        f"{what}: sharding {sharding!r} is not a NamedSharding; fix: use "
        "fnscale.batch_sharding(mesh) or a NamedSharding.")
  return sharding


def process_rows(sharding, rows: int) -> np.ndarray:
  """The rows of every global batch that this process feeds: those its devices hold.

  A loader reads exactly these rows of each global batch (and nothing else) and hands them,
  in this order, to `global_batch`. Where the mesh splits the batch across processes, each
  process gets its own block; where it replicates the batch across processes (e.g.
  `{"tensor": 8}` over two hosts of 4 devices), every such process gets the same rows and must
  feed the same values.

  Args:
    sharding: the batch's NamedSharding (`fnscale.batch_sharding(mesh)`); its leading dim
      decides.
    rows: the global batch size (rows of every global batch), an int >= 1 that the shards of
      the leading dim divide.

  Returns:
    int64 [k]: sorted global row indices, k = rows / (shards of dim 0) x (distinct shards
    this process holds).

  Raises:
    ShardingError: not a NamedSharding, rows not divisible by the leading dim's shard count,
      or no device of this process in the mesh.

  Examples:
    >>> import fnscale as fs
    >>> fs.process_rows(fs.batch_sharding(fs.make_mesh({"data": 2, "tensor": 4})), 8)
    array([0, 1, 2, 3, 4, 5, 6, 7])
  """
  s = _named(sharding, "process_rows")
  if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
    raise ShardingError(f"process_rows(rows={rows!r}): expected the global batch size, an "
                        "int >= 1.")
  spec = s.spec
  n = math.prod(dict(s.mesh.shape)[a] for a in _entry_axes(spec[0])) if len(spec) else 1
  if rows % n:
    raise ShardingError(
        f"process_rows: a global batch of {rows} rows does not split over the {n} shards of "
        f"mesh axes {_entry_axes(spec[0])}; fix: a global batch that is a multiple of {n}.")
  index_map = s.addressable_devices_indices_map((rows,))
  if not index_map:
    raise ShardingError(
        f"process_rows: this process ({jax.process_index()}) has no device in the "
        "sharding's mesh; fix: build the mesh over jax.devices() (all processes).")
  held = sorted({idx[0].indices(rows)[:2] for idx in index_map.values()})
  return np.concatenate([np.arange(a, b) for a, b in held]).astype(np.int64)


def _leaf_global_shape(path: str, local_shape, sharding) -> tuple[int, ...]:
  """The global shape a process-local leaf stands for under `sharding`."""
  _named(sharding, f"global_batch leaf '{path}'")
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


def global_batch(local, sharding, *, check: bool | None = None,
                 check_every: int = CHECK_EVERY) -> Any:
  """Builds global `jax.Array`s from each process's rows of a batch.

  Every process calls it with the rows `process_rows(sharding, rows)` names, in that order
  (its devices' rows; the same rows on every process that the mesh replicates the batch
  over); the result is one global array per leaf. In a single process it is a sharded
  `device_put`.

  Args:
    local: pytree of process-local numpy (or jax) arrays, e.g. [local_batch, seq] int32.
    sharding: one NamedSharding for every leaf (usually `fnscale.batch_sharding(mesh)`) or
      a pytree of them with `local`'s structure.
    check: compare the blocks several processes hold (`check_batch_replicas`): None (the
      default) on the first batch of each layout (the leaves' shardings, meshes and global
      shapes) this process feeds and on every `check_every`-th call; True now, False never.
      Every process must pass the same values (the check is an exchange between them).
    check_every: with `check=None`, also check every this many calls (an int >= 1; counted
      over all of this process's calls). A check where no block is held by several
      processes costs no exchange; where some are, one round trip through JAX's coordination
      service and a sha256 of those blocks (`recipes/bench/replica_check.py` measures it).

  Returns:
    Pytree of global jax.Arrays; a leaf of local shape [b, ...] on a process holding k of
    the n shards of the leading dim has global shape [b / k * n, ...].

  Raises:
    ShardingError: a leaf whose sharded dims don't split over this process's shards (naming
      the leaf path, size and shard counts), too low a rank, or mismatched structures.
    DistributedError: processes fed different values for rows the mesh replicates across
      them (see `check_batch_replicas`).

  Examples:
    One process holds every row here; in a job of N processes each passes the rows
    `process_rows` names.

    >>> import numpy as np
    >>> import fnscale as fs
    >>> sh = fs.batch_sharding(fs.make_mesh({"data": 8}))
    >>> rows = {"tokens": np.arange(64).reshape(16, 4)}
    >>> batch = fs.global_batch({"tokens": rows["tokens"][fs.process_rows(sh, 16)]}, sh)
    >>> batch["tokens"].shape, batch["tokens"].sharding.spec
    ((16, 4), P('data',))
    >>> batch["tokens"].addressable_shards[1].data.tolist()
    [[8, 9, 10, 11], [12, 13, 14, 15]]
  """
  if check not in (None, True, False):
    raise DistributedArgumentError(f"global_batch(check={check!r}): expected None, True or "
                                   "False.")
  if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
    raise DistributedArgumentError(f"global_batch(check_every={check_every!r}): expected an "
                                   "int >= 1 (calls between replica checks).")
  pairs, treedef = jax.tree_util.tree_flatten_with_path(local)
  shs = _broadcast_shardings(local, sharding, "batch")
  out = []
  for (p, leaf), s in zip(pairs, shs):
    path = path_str(p)
    if not hasattr(leaf, "shape"):
      leaf = np.asarray(leaf)
    gshape = _leaf_global_shape(path, tuple(leaf.shape), s)
    out.append(jax.make_array_from_process_local_data(s, leaf, gshape))
  batch = jax.tree_util.tree_unflatten(treedef, out)
  if _due(check, check_every, treedef, out):
    check_batch_replicas(batch)
  return batch


def _due(check: bool | None, every: int, treedef, leaves) -> bool:
  """Whether this call checks: as `check` says, or (None) on a layout (tree structure,
  leaf shardings and global shapes) not checked before in this process, or on every
  `every`-th call. Every call counts, so every process decides the same."""
  k = next(_calls)
  layout = (treedef, tuple((a.sharding, a.shape) for a in leaves))
  due = check if check is not None else layout not in _layouts or k % every == 0
  if due:
    _layouts.add(layout)
  return due


def _shared_blocks(arr: jax.Array) -> dict[tuple, list[int]]:
  """Blocks of `arr` (index tuples) that devices of more than one process hold, with those
  processes: a function of the sharding alone, the same on every process."""
  owners: dict[tuple, set[int]] = {}
  for d, idx in arr.sharding.devices_indices_map(arr.shape).items():
    key = tuple(sl.indices(n)[:2] for sl, n in zip(idx, arr.shape))
    owners.setdefault(key, set()).add(d.process_index)
  return {k: sorted(v) for k, v in owners.items() if len(v) > 1}


def _fingerprints(batch) -> dict[str, str]:
  """sha256 of this process's copy of every block that several processes hold, keyed by
  "<leaf path> rows a-b" (plus the other dims' ranges where they are split)."""
  facts = {}
  for p, arr in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shared = _shared_blocks(arr)
    if not shared:
      continue
    mine = {tuple(sl.indices(n)[:2] for sl, n in zip(s.index, arr.shape)): s
            for s in arr.addressable_shards}
    for key in sorted(set(shared) & set(mine)):
      where = f"rows {key[0][0]}-{key[0][1]}" if key else "the whole leaf"
      where += "".join(f", dim {d} {a}-{b}" for d, (a, b) in enumerate(key[1:], 1)
                       if (a, b) != (0, arr.shape[d]))
      data = np.ascontiguousarray(np.asarray(mine[key].data))
      facts[f"{path_str(p)} {where}"] = hashlib.sha256(
          data.tobytes() + str(data.dtype).encode()).hexdigest()[:16]
  return facts


def _needs_check(batch) -> bool:
  return any(_shared_blocks(a) for a in jax.tree_util.tree_leaves(batch))


def check_batch_replicas(batch, *, timeout_s: float = _co.DEFAULT_TIMEOUT_S) -> None:
  """Checks that every process holds the same values for the rows the mesh replicates
  across processes.

  Each process hashes its copy of every block of `batch` that devices of several processes
  hold (sha256 of the bytes; one host copy of those blocks) and publishes the fingerprints
  through JAX's coordination service; any two that differ for one block are an error on
  every process. Where no block is held by more than one process (the batch split across
  processes, or a single process) it returns at once without an exchange. `global_batch`
  calls it on the first batch of each layout and every `check_every`-th call; call it at
  any step to check that step's batch. Every process must make the same calls in the same
  order.

  Args:
    batch: pytree of global jax.Arrays (`global_batch`'s result).
    timeout_s: seconds to wait for the other processes' fingerprints.

  Raises:
    DistributedError: processes fed different values for replicated rows (naming the leaf,
      the rows, the processes and the fix: feed `process_rows(sharding, rows)`), or the
      others did not answer within `timeout_s`.
    DistributedArgumentError: a leaf that is not a jax.Array.

  Examples:
    >>> import fnscale as fs, numpy as np
    >>> mesh = fs.make_mesh({"data": 8})
    >>> batch = fs.global_batch({"x": np.ones((16, 4))}, fs.batch_sharding(mesh))
    >>> fs.multihost.check_batch_replicas(batch)  # one process: no replica to compare
    >>> fs.multihost.check_batch_replicas({"x": np.ones(4)})
    Traceback (most recent call last):
    ...
    fnscale.DistributedArgumentError: check_batch_replicas: leaf 'x' is ndarray; expected ...
  """
  for p, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if not isinstance(leaf, jax.Array):
      raise DistributedArgumentError(
          f"check_batch_replicas: leaf '{path_str(p)}' is {type(leaf).__name__}; expected the "
          "global jax.Arrays that fnscale.global_batch returns.")
  if not _needs_check(batch):
    return
  rt = _co.job_runtime("check_batch_replicas")
  if rt is None:
    return
  _, pid, n = rt
  facts = _fingerprints(batch)
  with _co.waiting("batch replica check"):
    got, _, _ = _agreement.exchange(f"rows/{next(_check_count)}", facts, timeout_s)
  missing = [p for p in range(n) if p not in got]
  if missing:
    raise DistributedError(
        f"check_batch_replicas: process(es) {', '.join(map(str, missing))} of {n} did not "
        f"send their batch fingerprints within {timeout_s} s (this is process {pid}); fix: "
        "make every process call global_batch / check_batch_replicas in the same order.")
  bad = _replica_differences(got)
  if bad:
    raise DistributedError(
        "processes fed different values for rows the mesh replicates across them: "
        f"{'; '.join(bad[:6])}{f' (and {len(bad) - 6} more)' if len(bad) > 6 else ''}. Each "
        "global array would hold different data on different processes and every process "
        "would train on its own rows. Fix: feed each process exactly the rows "
        "fnscale.process_rows(sharding, global_rows) names (the same rows on processes the "
        "batch is replicated over), not a per-process split such as grain's "
        "ShardByJaxProcess; or put a data axis across processes in the mesh.")


def _replica_differences(got: dict[int, dict[str, str]]) -> list[str]:
  """One line per block whose fingerprints differ between the processes that hold it."""
  out = []
  blocks = sorted({k for facts in got.values() for k in facts})
  for b in blocks:
    held = {p: facts[b] for p, facts in sorted(got.items()) if b in facts}
    if len(set(held.values())) > 1:
      ref = min(held)
      others = [p for p, h in held.items() if h != held[ref]]
      out.append(f"batch leaf {b}: process(es) {', '.join(map(str, others))} hold other "
                 f"values than process {ref}")
  return out
