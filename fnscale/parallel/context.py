"""Context parallelism: a sequence split over the `context` mesh axis.

A mesh with a `context` axis (`fnscale.make_mesh({"data": 2, "context": 4})`, or across
slices as a DCN axis) splits every activation [batch, seq, ...] along its sequence:
`fnscale.batch_sharding` and `fnscale.constrain_batch` put the sequence dim over it,
`fnscale.attention` attends a split sequence (an all-gather of K/V by default, a ring of
K/V blocks: `fnscale.with_kernel(..., context="ring")`, or Ulysses' all-to-all of sequence
shards for head shards: `context="ulysses"`), and `fnscale.cross_entropy` scores
[batch, seq, d] hidden states where they are. Parameters are split over it like over
"fsdp" where the rules say so (`recipes/lm/llama.py`'s "embed" rule), as MaxText does.

The shards hold the sequence in one declared order, so that causal attention costs every
shard the same: `reorder_batch` applies it once to a batch (tokens, targets, positions,
segment ids: every leaf of rank >= 2 along its second dim, adding positions where the batch
has none), before `fnscale.global_batch`; `restore` undoes it (e.g. for per-token outputs);
`with_kernel(..., context_order=...)` tells attention the same order (Ulysses attends
the whole sequence on each device, so needs no order for balance, but takes any). Orders: "zigzag"
(default; shard i holds chunks i and 2c-1-i of 2c), "striped" (token t on shard t mod c),
"contiguous" (unbalanced). `shard_work` counts each shard's causal attention work.

Beside the other axes: a pipeline's `stage` axis (`fnscale.parallel.pipeline`: each stage
attends its microbatches' split sequences) and an `expert` axis (`fnscale.parallel.moe`:
the dropless layer routes each shard's piece of every row; the capacity path, whose capacity
is per whole sequence, refuses a context axis) compose with it.

Examples:
  >>> import numpy as np, fnscale as fs
  >>> x = np.arange(8)[None]
  >>> fs.parallel.context.reorder(x, 2, "zigzag")
  array([[0, 1, 6, 7, 2, 3, 4, 5]])
  >>> fs.parallel.context.restore(fs.parallel.context.reorder(x, 2, "striped"), 2, "striped")
  array([[0, 1, 2, 3, 4, 5, 6, 7]])
  >>> fs.parallel.context.shard_work(8, 2, "contiguous").tolist(), \\
  ...     fs.parallel.context.shard_work(8, 2, "zigzag").tolist()
  ([10, 26], [18, 18])
  >>> fs.parallel.context.ORDERS, fs.parallel.context.FORMS
  (('zigzag', 'striped', 'contiguous'), ('all_gather', 'ring', 'ulysses'))
"""
from __future__ import annotations

import math

import numpy as np

from fnscale import _axes
from fnscale._errors import ShardingError
from fnscale.kernels._context_attention import (FORMS, ORDERS, positions, reorder, restore,
                                               ring_cases, shard_work)

__all__ = ["FORMS", "ORDERS", "positions", "reorder", "reorder_batch", "restore",
           "ring_cases", "shard_work", "shards", "segment_positions"]


def shards(mesh) -> int:
  """How many pieces the sequence is split into on `mesh`: the product of its context axes'
  sizes (1 without one).

  Examples:
    >>> import fnscale as fs
    >>> fs.parallel.context.shards(fs.make_mesh({"data": 2, "context": 4}))
    4
    >>> fs.parallel.context.shards(fs.make_mesh({"data": 8}))
    1
  """
  return math.prod(mesh.shape[a] for a in _axes.context_axes(mesh))


def segment_positions(segment_ids) -> np.ndarray:
  """int32 positions [batch, seq] that restart at 0 where the segment id changes (packed
  sequences' RoPE positions), from segment ids [batch, seq] in sequence order.

  Examples:
    Three documents packed in one row:

    >>> import fnscale as fs
    >>> fs.parallel.context.segment_positions([[1, 1, 1, 2, 2, 3, 3, 3]])
    array([[0, 1, 2, 0, 1, 0, 1, 2]], dtype=int32)
  """
  ids = np.asarray(segment_ids)
  index = np.broadcast_to(np.arange(ids.shape[-1]), ids.shape)
  starts = np.concatenate([np.ones(ids.shape[:-1] + (1,), bool),
                           ids[..., 1:] != ids[..., :-1]], axis=-1)
  return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=-1)).astype(np.int32)


def reorder_batch(batch: dict, mesh_or_shards, order: str = "zigzag", *,
                  positions_key: str = "positions",
                  segments_key: str = "segment_ids") -> dict:
  """A batch in the order the context shards hold it: every leaf of rank >= 2 reordered
  along its second (sequence) dim, with `positions_key` added first when absent (each
  token's place in its row, restarting per segment when `segments_key` is present), so
  that positional encodings see where each token was. Leaves of rank < 2 are unchanged.
  Host (numpy) batches stay numpy. With one shard the batch is returned as it is, positions
  added.

  Args:
    batch: a dict of arrays [batch, seq, ...] (numpy or jax) in sequence order.
    mesh_or_shards: the mesh (its context axes' total size) or that size.
    order: "zigzag", "striped" or "contiguous" (the same as `with_kernel`'s
      `context_order`).

  Raises:
    ShardingError: a batch that isn't a dict, leaves whose sequence lengths differ.
    KernelError: an unknown order, a sequence the order can't split.

  Examples:
    Two context shards in zigzag order: shard 0 holds chunks 0 and 3 of 4, shard 1 chunks
    1 and 2; the positions say where each token was.

    >>> import fnscale as fs, numpy as np
    >>> batch = {"inputs": np.arange(8)[None], "targets": np.arange(1, 9)[None]}
    >>> out = fs.parallel.context.reorder_batch(batch, 2)
    >>> out["inputs"].tolist(), out["positions"].tolist()
    ([[0, 1, 6, 7, 2, 3, 4, 5]], [[0, 1, 6, 7, 2, 3, 4, 5]])
  """
  if not isinstance(batch, dict):
    raise ShardingError(f"reorder_batch: batch is a {type(batch).__name__}, expected a dict "
                        "such as {'inputs': [batch, seq], 'targets': [batch, seq]}.")
  c = mesh_or_shards if isinstance(mesh_or_shards, int) else shards(mesh_or_shards)
  seqs = {k: x.shape[:2] for k, x in batch.items() if np.ndim(x) >= 2}
  if len(set(seqs.values())) > 1:
    raise ShardingError(f"reorder_batch: leaves disagree on [batch, seq]: {seqs}; every "
                        "leaf of rank >= 2 must be [batch, seq, ...].")
  out = dict(batch)
  if positions_key not in out and seqs:
    shape = next(iter(seqs.values()))
    ids = out.get(segments_key)
    out[positions_key] = (segment_positions(ids) if ids is not None else np.broadcast_to(
        np.arange(shape[1], dtype=np.int32), shape).copy())
  if c == 1:
    return out
  return {k: reorder(x, c, order) if np.ndim(x) >= 2 else x for k, x in out.items()}
