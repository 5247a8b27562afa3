"""Token ids into a model: the token-embedding lookup of a table split over the mesh, and the
positions a sequence split over a "context" axis needs (the GPT, Llama and MoE models')."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import fnscale as fs


def lookup(table: jax.Array, tokens: jax.Array, rules) -> jax.Array:
  """`table[tokens]` ([vocab, d] at int [batch, seq] -> [batch, seq, d]), batch-split, with
  only token ids and activations crossing devices: the table is never gathered.

  `rules`: the model's logical rules (`recipes.lm.gpt.RULES`, llama's, moe's), which split the
  table ("vocab", "embed"): d over the FSDP-like axes (fsdp, expert, context), vocab over
  "tensor". Under a mesh the lookup runs in a `jax.shard_map` over the axes the trace sees
  whole. Each device all-gathers the token ids of the devices that hold the table's other
  columns (and other tokens: int32, over d's axes that split the batch rows, along the
  rows; over those that split the sequence, along it), looks them up in its own
  [vocab / tensor, d / ...] block (ids outside the block give 0, summed over "tensor"), and
  all-to-alls turn the result back into this device's tokens with every column, the minor
  axis of d first. The backward pass is the same in reverse: all-to-alls of the
  activations' gradient and a local scatter-add into the table's block. Left to the
  partitioner (`table[tokens]`, one mesh axis on two dims of the gather), jax 0.10.2's GSPMD
  replicates the output ("[SPMD] Involuntary full rematerialization"); gathering the table's
  d first (what FSDP does for a weight) moves the whole table forward and its whole gradient
  backward. Inside a `shard_map` that is manual over the data axes the ids are already local
  and the table whole there: a plain lookup.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return table[tokens]
  manual = set(mesh.manual_axes)
  free = lambda names: tuple(a for a in names if a in mesh.axis_names and a not in manual
                             and mesh.shape[a] > 1)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  rows = free(fs.data_axes(mesh))  # the batch's axes (with "stage", if any)
  if tokens.shape[0] % size(rows):
    rows = ()
  seq = free(("context",))  # a sequence split over it stays split
  if tokens.shape[1] % size(seq):
    seq = ()
  spec = fs.logical_to_spec(("vocab", "embed"), rules, mesh)
  runs = _column_runs(free(_axes_of(spec[1])), rows, seq, table.shape[1], mesh.shape)
  # Vocabulary blocks are summed over their axes: never over axes that split the tokens.
  vocab = tuple(a for a in free(_axes_of(spec[0])) if a not in rows + seq)
  if table.shape[0] % size(vocab):
    vocab = ()
  if not rows and not vocab:
    return fs.constrain_batch(table[tokens])

  def local(table, tokens):
    for axes, dim in sorted(runs, key=lambda r: size(r[0])):  # the smaller gather first
      tokens = jax.lax.all_gather(tokens, axes, axis=dim, tiled=True)
    if vocab:  # this device's vocabulary rows start at its index along "tensor"
      ids = tokens - jax.lax.axis_index(vocab) * table.shape[0]
      inside = (ids >= 0) & (ids < table.shape[0])
      x = jnp.where(inside[..., None], table[jnp.clip(ids, 0, table.shape[0] - 1)], 0)
      x = jax.lax.psum(x, vocab)
    else:
      x = table[tokens]
    for axes, dim in reversed(runs):  # [.., tokens x n, .., d / n] -> [.., tokens, .., d]
      x = jax.lax.all_to_all(x, axes, split_axis=dim, concat_axis=2, tiled=True)
    return x

  columns = tuple(a for axes, _ in runs for a in axes)
  table_spec, token_spec = P(_spec(vocab), _spec(columns)), P(_spec(rows), _spec(seq))
  if set(free(mesh.axis_names)) & set(getattr(mesh, "explicit_axes", ())):
    # Explicit axes: shard_map takes only arrays already split as its specs say.
    table = jax.sharding.reshard(table, table_spec)
    tokens = jax.sharding.reshard(tokens, token_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, token_spec),
                       out_specs=P(_spec(rows), _spec(seq), None), axis_names=frozenset(
                           free(mesh.axis_names)), check_vma=True)(table, tokens)


def _column_runs(columns: tuple[str, ...], rows: tuple[str, ...], seq: tuple[str, ...],
                 width: int, sizes) -> tuple:
  """The table's column (d) axes as runs of (axes, token dim): consecutive axes that split
  the batch rows (dim 0) or the sequence (dim 1), at most one run per dim, their sizes'
  product dividing `width` (d). The columns from the first axis that fits none of these on
  are whole inside the lookup (gathered on entry)."""
  runs: list[tuple[tuple[str, ...], int]] = []
  split = 1
  for a in columns:
    dim = 0 if a in rows else 1 if a in seq else None
    split *= sizes[a]
    if (dim is None or width % split
        or (runs and runs[-1][1] != dim and any(d == dim for _, d in runs))):
      break
    if runs and runs[-1][1] == dim:
      runs[-1] = (runs[-1][0] + (a,), dim)
    else:
      runs.append(((a,), dim))
  return tuple(runs)


def _axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(axes: tuple[str, ...]):
  """A PartitionSpec entry for mesh axes: None, one name, or a tuple."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def check_positions(positions) -> None:
  """Under a mesh whose "context" axis splits the sequence, a model must be given each
  token's position: the shards hold the sequence reordered, so 0..seq-1 would be wrong.

  Raises:
    FnscaleError: no positions under a context axis of size > 1.
  """
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1 if mesh.empty else fs.parallel.context.shards(mesh)
  if positions is None and shards > 1:
    raise fs.InputError(
        f"the mesh splits the sequence over its context axes ({shards} shards) and the "
        "batch has no 'positions'; fix: pass the batch through "
        "fnscale.parallel.context.reorder_batch(batch, mesh, order) (it adds them) before "
        "fnscale.global_batch.")
