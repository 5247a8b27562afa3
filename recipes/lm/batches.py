"""train_lm's batches: windows of a text corpus through grain (`text_batches`), or packed
rows of token caches (`packing.batches`), this process's rows of each global batch
(`run_batches`), put on the mesh as global arrays (`put`); the steps an --epochs count makes
(`steps_for`) and a saved position on another process count (`resharded_position`).

The split is cut into windows of seq + 1 tokens, shuffled from the seed (a new order each
epoch), repeated for the epochs asked, sliced so each process reads only the rows its devices
hold, and batched. Each process's iterator position goes into each checkpoint
(`fnscale.checkpoint.save(..., data=iterator)`, grain's own orbax handler), so a resumed run
reads exactly what the uninterrupted one would, with the same or another process count.
"""
from __future__ import annotations

import functools

import grain
import numpy as np

import fnscale as fs
from recipes.lm import packing, preference
from recipes.lm.data import Corpus
from recipes.lm.options import DataOptions, FinetuneOptions


def _window(tokens: np.ndarray, seq: int, i: int) -> np.ndarray:
  return tokens[i * seq:i * seq + seq + 1]


def _inputs_targets(rows: np.ndarray) -> dict:
  rows = rows.astype(np.int32)
  return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def windows(tokens: np.ndarray, seq: int, seed: int, epochs: int | None) -> grain.MapDataset:
  """Windows of seq + 1 tokens (consecutive windows share one token: inputs and targets),
  shuffled from `seed` with a new order each epoch, repeated `epochs` times (None: forever)."""
  n = (len(tokens) - 1) // seq
  ds = grain.MapDataset.range(n).map(functools.partial(_window, tokens, seq))
  return ds.shuffle(seed=seed).repeat(epochs)


def steps_for(corpus: Corpus, seq: int, global_batch: int, epochs: int | None,
              steps: int | None) -> int | None:
  """Train steps: `steps`, or the global batches grain makes of `epochs` passes over the train
  split; None when neither is given (the caller's default).

  Raises:
    FnscaleError: both given, epochs < 1, steps < 0, or epochs too short for one batch.
  """
  if epochs is not None and epochs < 1:
    raise fs.InputError(f"epochs={epochs}: expected >= 1 passes over the training split "
                          "(or give steps instead)")
  if steps is not None and steps < 0:
    raise fs.InputError(f"steps={steps}: expected >= 0")
  if epochs is not None and steps is not None:
    raise fs.InputError(f"epochs={epochs} and steps={steps}: give one of them")
  if epochs is None:
    return steps
  n = len(windows(corpus.train, seq, 0, epochs).batch(global_batch, drop_remainder=True))
  if n < 1:
    raise fs.InputError(
        f"epochs={epochs} makes no step: the training split has "
        f"{(len(corpus.train) - 1) // seq} windows of seq + 1 = {seq + 1} tokens, fewer than "
        f"one global batch of {global_batch} rows; use more epochs, a smaller batch or seq")
  return n


def process_shard(sharding, global_batch: int) -> tuple[int, int]:
  """`(index, count)`: this process holds rows [index * n, (index + 1) * n) of every global
  batch, n = global_batch / count (processes sharing rows, as over a tensor axis, share an
  index). Raises ShardingError when its rows are not one contiguous block."""
  rows = set()
  for idx in sharding.addressable_devices_indices_map((global_batch, 1)).values():
    rows.update(range(*idx[0].indices(global_batch)))
  rows = sorted(rows)
  if rows != list(range(rows[0], rows[0] + len(rows))) or global_batch % len(rows):
    raise fs.ShardingError(f"this process holds rows {rows[:4]}... of the global batch of "
                           f"{global_batch}: not one contiguous block; order the mesh's "
                           "devices by process")
  return rows[0] // len(rows), global_batch // len(rows)


def text_batches(corpus: Corpus, sharding, seq: int, global_batch: int, seed: int,
            eval_batches: int):
  """`(train, evals)`: a grain iterator over this process's rows of each training batch
  ({"inputs", "targets"} int32 [global_batch / count, seq]; `get_state()` / `set_state()`
  give its position: `fnscale.checkpoint` saves and restores it), and `eval_batches`
  held-out batches likewise.
  """
  index, count = process_shard(sharding, global_batch)
  local = global_batch // count
  shard = lambda ds: ds[index::count].batch(local, drop_remainder=True).map(_inputs_targets)
  # One reader thread a little ahead is plenty for windows; more would take the CPU's cores.
  read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
  train = iter(shard(windows(corpus.train, seq, seed, None)).to_iter_dataset(read))
  held = shard(windows(corpus.eval, seq, seed + 1, None))
  return train, [held[i] for i in range(eval_batches)]


def resharded_position(saved: list, index: int, count: int) -> dict:
  """The position of process `index` of `count` in a job resumed with another process count
  than the one that saved `saved` (one position per saved process):
  `fnscale.checkpoint.restore(..., data=train, reshard_data=resharded_position)`.

  `text_batches` gives process i of n the batches of its slice [i::n] of one window order,
  global_batch / n rows each, so batch k of every slicing covers the same windows, global
  batch k, and a job's processes all stand at the same k. Each new process starts at batch k
  of its own slice: the saved position itself.

  Raises:
    FnscaleError: the saved positions differ (not a job of `text_batches`).
  """
  if saved and isinstance(saved[0], dict) and "rows" in saved[0]:  # packed rows' positions
    return packing.resharded_position(saved, index, count)
  del index, count  # every process of the new job starts at the same global batch
  if any(p != saved[0] for p in saved[1:]):
    raise fs.FnscaleError(
        f"the {len(saved)} saved data positions differ ({saved[:4]}): they don't stand at one "
        f"global batch, so they can't be mapped onto another process count; resume with "
        f"{len(saved)} processes")
  return saved[0]


def run_batches(s, sharding) -> tuple:
  """(train iterator, eval batches) of train_lm's run `s` (its `run_setup.Setup`), this
  process's rows under `sharding`: packed rows of token caches (`packing.batches`, the rows
  `fnscale.process_rows` names), else windows of text (`batches`)."""
  seq, batch, seed, n_eval = (s.cfg.seq, s.o.step.global_batch, s.o.data.seed,
                               s.o.log.eval_batches)
  if s.corpus.preference is not None:  # DPO: whole pairs packed into rows
    return _preference_batches(s, sharding)
  if s.corpus.packed is None:
    return text_batches(s.corpus, sharding, seq, batch, seed, n_eval)
  spec, rows = pack_spec(s.o.data, seq), fs.process_rows(sharding, batch)
  sources = s.corpus.packed[0]
  train = packing.batches(sources, rows, batch, spec, seed)
  held = packing.batches(sources, rows, batch, spec, seed, held=True)
  return train, [next(held) for _ in range(n_eval)]


def _preference_batches(s, sharding) -> tuple:
  """`run_batches` of preference pairs (`preference.py`): whole pairs packed into rows of
  seq tokens, at most --dpo_pairs a row."""
  (train, held), batch, seed = s.corpus.preference, s.o.step.global_batch, s.o.data.seed
  index, count = process_shard(sharding, batch)
  pack = lambda pairs: preference.rows(pairs, s.cfg.seq, s.o.tune.dpo_pairs)
  held_rows = preference.batches(pack(held), index, count, batch, seed, True)
  return (preference.batches(pack(train), index, count, batch, seed),
          [held_rows[i] for i in range(s.o.log.eval_batches)])


def pack_spec(d: DataOptions, seq: int) -> packing.PackSpec:
  """train_lm's data options `d` (--packing, --pack_bins, --long_docs) at `seq` tokens a
  row."""
  return packing.PackSpec(seq, d.packing, d.pack_bins, d.long_docs)


def put(s, rows: dict):
  """This process's rows as global arrays over run `s`'s mesh (a `run_setup.Setup`); under
  a context axis first in the order its shards hold the sequence, with the positions the
  model then needs (`fnscale.parallel.context.reorder_batch`)."""
  if fs.parallel.context.shards(s.mesh) > 1:
    rows = fs.parallel.context.reorder_batch(rows, s.mesh, s.o.step.context_order)
  return fs.global_batch(rows, fs.batch_sharding(s.mesh))


def say_padding(d: DataOptions, tune: FinetuneOptions, first: dict, evals: list,
                say) -> None:
  """With token caches (`d`: the run's data options; `tune`: its fine-tuning options): the
  padding in this process's rows of the first train batch and in the eval batches (text
  windows have none: nothing said)."""
  if "segment_ids" not in first:
    return
  if tune.objective == "dpo":
    say(f"preference pairs packed whole, at most {tune.dpo_pairs} a row: "
        f"{packing.padding_fraction(first):.1%} padding in this process's rows of the first "
        "batch")
    return
  held = np.mean([packing.padding_fraction(b) for b in evals] or [0])
  say(f"packing ({d.packing}, {d.pack_bins} bins, long documents: {d.long_docs}): "
      f"{packing.padding_fraction(first):.1%} padding in this process's rows of the first "
      f"batch, {held:.1%} in the eval batches")
