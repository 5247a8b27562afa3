"""Training batches from token caches: a weighted mixture of caches, documents packed into
rows with segment ids and positions, every process reading only its rows.

Documents: each cache's documents are split into a training part and a held-out part (every
20th document, at least one), shuffled from the seed with a new order each epoch and repeated
(`grain.MapDataset`), then mixed by weight (`grain.MapDataset.mix`: deterministic, so step k's
documents are a function of the seed alone).

Rows: global row r of every batch is its own stream: the mixture's documents r, r + R,
r + 2R, ... (R = the global batch's rows), cut into pieces of at most seq + 1 tokens (a
longer document is split, truncated or refused: `PackSpec.long_docs`), each piece giving
seq-or-fewer (input, target) pairs, packed into rows of seq pairs by grain's first-fit or
best-fit packing (`grain.experimental.FirstFitPackIterDataset` / `BestFitPackIterDataset`),
which numbers the pieces of a row 1, 2, ... (`segment_ids`; 0 is padding) and counts
`positions` from 0 in each. A target is always the next token of the same document, so the
loss never predicts across a boundary; the model's attention masks across segments.

Processes: a process builds the streams of the rows its devices hold (`fnscale.process_rows`)
and nothing else; row r is the same whatever the process count or mesh, so global batch k is
the one-process run's, row for row. Its position (`get_state`) is one entry per row, so a
run saved by 2 processes resumes on 1 (or 4) with the same rows (`resharded_position`).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import grain
import jax.numpy as jnp
import numpy as np

import fnscale as fs
from recipes.lm import cache as cache_lib
from recipes.lm import shards
from recipes.lm.options import LONG_DOCS, PACKINGS

HELD_OUT_EVERY = 20  # every 20th document of each cache is held out (at least one)


class PackSpec(NamedTuple):
  """How rows are packed: `seq` (input, target) pairs per row; `packing` "first_fit" or
  "best_fit"; `bins` rows packed at once per stream (more: less padding); `long_docs`: a
  document longer than seq + 1 tokens is "split" into pieces, "truncate"d to its first piece,
  or an "error"."""
  seq: int
  packing: str = "first_fit"
  bins: int = 8
  long_docs: str = "split"


class Source(NamedTuple):
  """One cache of a mixture and its weight (the fraction of documents drawn from it)."""
  cache: cache_lib.Cache
  weight: float


class DocSplit(NamedTuple):
  """How a cache's documents divide: `n` documents, every `every`-th held out."""
  n: int
  every: int

  @property
  def held(self) -> int:
    return self.n // self.every

  @property
  def train(self) -> int:
    return self.n - self.held


def parse_mixture(spec: str) -> list[tuple[str, float]]:
  """(cache path, weight) of each source of `--dataset`: "PATH", "PATH:W,PATH:W,...", or a
  JSON file {"PATH": W, ...} (a file ending .json is always read as one). A source without
  a weight weighs 1 ("a:0.7,b": 0.7 and 1); weights are normalised by `open_mixture`.

  Raises:
    InputError: a weight that doesn't parse, is negative or not finite, weights summing to
      zero, or a source named twice.
  """
  if spec.endswith(".json") and os.path.isfile(spec):
    with open(spec) as f:
      try:
        table = json.load(f)
      except json.JSONDecodeError as e:
        raise fs.InputError(f"dataset={spec!r}: not JSON ({e}); expected {{\"PATH\": weight, "
                            "...}") from None
    if not isinstance(table, dict):
      raise fs.InputError(f"dataset={spec!r}: expected a JSON object {{\"PATH\": weight}}")
    items = [(str(k), v) for k, v in table.items()]
  else:
    items = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
      path, sep, tail = part.rpartition(":")
      if not sep or "/" in tail:  # no weight ("gs://b/c" has a ':' but no weight)
        items.append((part, 1.0))
      else:
        items.append((path, tail))
  return _checked_weights(spec, items)


def _checked_weights(spec: str, items) -> list[tuple[str, float]]:
  out = []
  for path, w in items:
    try:
      w = float(w)
    except (TypeError, ValueError):
      w = None
    if w is None or not math.isfinite(w) or w < 0:
      raise fs.InputError(f"dataset={spec!r}: the weight of {path!r} is not a number >= 0; "
                          "fix: write PATH:WEIGHT,PATH:WEIGHT (e.g. web:0.7,code:0.3)")
    out.append((path, w))
  paths = [p for p, _ in out]
  if len(set(paths)) != len(paths):
    raise fs.InputError(f"dataset={spec!r}: a source is named twice; name each once")
  if not out or sum(w for _, w in out) <= 0:
    raise fs.InputError(f"dataset={spec!r}: the weights sum to zero; fix: give at least one "
                        "source a weight > 0")
  return [(p, w) for p, w in out if w > 0]


def open_mixture(spec: str, tokenizer: str) -> tuple[list[Source], str]:
  """The sources of `--dataset` opened (`cache.open_cache`) with weights summing to 1, and
  the tokenizer the run uses (checked against every cache: `cache.check_tokenizer`).

  Raises:
    InputError: see `parse_mixture`, `cache.open_cache`, `cache.check_tokenizer`; caches of
      different kinds (chat and text) or tokenizers mixed.
  """
  pairs = parse_mixture(spec)
  caches = [cache_lib.open_cache(p) for p, _ in pairs]
  run_tok = cache_lib.check_tokenizer(caches[0], tokenizer)
  for c in caches[1:]:
    if c.manifest["tokenizer"]["sha256"] != caches[0].manifest["tokenizer"]["sha256"]:
      raise fs.InputError(f"dataset={spec!r}: {c.path} and {caches[0].path} were tokenized "
                          "with different tokenizers; fix: remake one with the other's")
    cache_lib.check_tokenizer(c, tokenizer)
  kinds = {c.manifest["kind"] for c in caches}
  if len(kinds) > 1:
    raise fs.InputError(f"dataset={spec!r} mixes chat and text caches; fix: one kind per run")
  total = sum(w for _, w in pairs)
  return [Source(c, w / total) for c, (_, w) in zip(caches, pairs)], run_tok


def doc_split(n: int) -> DocSplit:
  return DocSplit(n, min(HELD_OUT_EVERY, max(n, 1)))


def _doc_index(split: DocSplit, i: int, held: bool) -> int:
  """The cache index of the i-th training (or held-out) document: held out are those with
  index % every == every - 1."""
  e = split.every
  return i * e + e - 1 if held else (i // (e - 1)) * e + i % (e - 1) if e > 1 else i


def _reader(c: cache_lib.Cache, held: bool):
  """A MapDataset of one cache's training (or held-out) documents: {"ids", "weights"}."""
  src = grain.sources.ArrayRecordDataSource(list(c.shard_paths))
  split = doc_split(len(src))
  n = split.held if held else split.train
  if n < 1:
    raise fs.InputError(f"dataset {c.path!r} has {split.n} documents: too few to hold one out "
                        "for evals (at least 2 needed)")
  weighted = c.weighted

  def read(i: int) -> dict:
    ids, w = shards.unrecord(src[_doc_index(split, i, held)], weighted)
    return {"ids": ids, "weights": w}
  return grain.MapDataset.range(n).map(read)


def documents(sources: list[Source], seed: int, held: bool = False) -> grain.MapDataset:
  """The mixture's documents in order (infinite): each cache's shuffled from the seed, a
  new order each epoch, mixed by weight."""
  parts = [_reader(s.cache, held).shuffle(seed=seed + 7919 * i).repeat(None)
           for i, s in enumerate(sources)]
  if len(parts) == 1:
    return parts[0]
  return grain.MapDataset.mix(parts, [s.weight for s in sources])


class _Pieces(grain.experimental.FlatMapTransform):
  """A document as pieces of at most seq + 1 tokens (consecutive pieces share one token),
  each {"inputs", "targets", "weights"}: the pairs (token, next token) and the loss weight
  of each target. Pieces with nothing to predict (one token, or all weights 0) are dropped."""

  def __init__(self, spec: PackSpec, max_fan_out: int):
    self.spec, self.max_fan_out = spec, max_fan_out

  def flat_map(self, doc: dict) -> list[dict]:
    ids, w = doc["ids"], doc["weights"]
    seq, n = self.spec.seq, len(doc["ids"])
    if n - 1 > seq and self.spec.long_docs == "error":
      raise fs.InputError(
          f"a document of {n} tokens is longer than a row ({seq} + 1 tokens) and "
          "--long_docs=error; fix: --long_docs=split (pieces, each its own segment) or "
          "truncate, or a longer --seq")
    starts = range(0, max(n - 1, 0), seq)
    if self.spec.long_docs == "truncate":
      starts = starts[:1]
    if len(starts) > self.max_fan_out:
      starts = starts[:self.max_fan_out]
    out = []
    for a in starts:
      m = min(seq, n - 1 - a)  # pairs in this piece
      piece_w = np.ones(m, np.float32) if w is None else w[a + 1:a + 1 + m].astype(np.float32)
      if piece_w.any():
        out.append({"inputs": ids[a:a + m], "targets": ids[a + 1:a + 1 + m],
                    "weights": piece_w})
    return out


def _as_batch_row(row: dict) -> dict:
  """grain's packed row -> the model's keys: inputs, targets, weights, segment_ids, positions."""
  return {"inputs": row["inputs"], "targets": row["targets"], "weights": row["weights"],
          "segment_ids": row["inputs_segment_ids"], "positions": row["inputs_positions"]}


def row_stream(docs: grain.MapDataset, row: int, rows: int, spec: PackSpec,
               seed: int) -> grain.IterDataset:
  """Global row `row` of every batch: documents row, row + rows, ... packed (see the module
  docstring). Read synchronously (a whole batch's streams are read ahead together)."""
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  ds = docs[row::rows].to_iter_dataset(read)
  # A split document gives at most this many pieces at once; longer ones lose their tail
  # (10,000 rows of text: a document of 10,000 x seq tokens).
  ds = grain.experimental.FlatMapIterDataset(ds, _Pieces(spec, 10_000))
  pack = (grain.experimental.FirstFitPackIterDataset if spec.packing == "first_fit" else
          grain.experimental.BestFitPackIterDataset)
  length = {"inputs": spec.seq, "targets": spec.seq, "weights": spec.seq}
  ds = pack(ds, length_struct=length, num_packing_bins=spec.bins, seed=seed * 1_000_003 + row)
  return ds.map(_as_batch_row)


class _Rows(grain.IterDataset):
  """This process's rows of each global batch, stacked: one stream per global row (grain's
  extension point for a transformation; `_RowsIterator` keeps one position per row)."""

  def __init__(self, streams: dict[int, grain.IterDataset]):
    super().__init__(list(streams.values()))
    self._rows = tuple(streams)

  def __iter__(self):
    return _RowsIterator(self._rows, [iter(p) for p in self._parents])

  def __str__(self) -> str:
    return f"_Rows({len(self._rows)} rows)"


class _RowsIterator(grain.DatasetIterator):
  """Stacks one element of each row stream; its position is {"rows": {row: position}}."""

  def __init__(self, rows: tuple[int, ...], parents: list):
    super().__init__(parents)
    self._row_ids = rows

  def __next__(self) -> dict:
    got = [next(p) for p in self._parents]
    return {k: np.stack([g[k] for g in got]) for k in got[0]}

  def get_state(self) -> dict:
    return {"rows": {str(r): p.get_state() for r, p in zip(self._row_ids, self._parents)}}

  def set_state(self, state: dict) -> None:
    saved = state["rows"]
    missing = [r for r in self._row_ids if str(r) not in saved]
    if missing:
      raise fs.InputError(
          f"the saved data position has no rows {missing[:6]} (it holds rows "
          f"{sorted(map(int, saved))[:6]}...): it was saved by a run with another global batch "
          "size; fix: resume with the run's --global_batch")
    for r, p in zip(self._row_ids, self._parents):
      p.set_state(saved[str(r)])


def batches(sources: list[Source], rows: np.ndarray, global_rows: int, spec: PackSpec,
            seed: int, held: bool = False):
  """An iterator over the `rows` (`fnscale.process_rows`) of each global batch of
  `global_rows` rows: {"inputs", "targets", "segment_ids", "positions": int32 [len(rows),
  seq], "weights": float32 [len(rows), seq]} (weights 0 on padding and on tokens without
  loss). `get_state()` / `set_state()` give its position (per row); a thread reads up to two
  batches ahead.

  Raises:
    InputError: a bad spec (and, while iterating, a document over the row with
      long_docs="error").
  """
  check_spec(spec)
  docs = documents(sources, seed + (1 if held else 0), held)
  streams = {int(r): row_stream(docs, int(r), global_rows, spec, seed) for r in rows}
  return iter(_Rows(streams))


def check_spec(spec: PackSpec, sources: list[Source] = ()) -> None:
  """Raises InputError for a bad spec, or for long_docs="error" with a cache whose longest
  document (its manifest's max_doc_tokens) is longer than a row: before anything is read."""
  for s in sources:
    longest = s.cache.manifest.get("max_doc_tokens", 0)
    if spec.long_docs == "error" and longest - 1 > spec.seq:
      raise fs.InputError(
          f"{s.cache.path} holds a document of {longest} tokens, longer than a row "
          f"({spec.seq} + 1 tokens), and --long_docs=error; fix: --long_docs=split (pieces, "
          "each its own segment) or truncate, or a --seq of at least "
          f"{longest - 1}")
  if spec.packing not in PACKINGS or spec.long_docs not in LONG_DOCS or spec.bins < 1:
    raise fs.InputError(f"packing={spec.packing!r}, long_docs={spec.long_docs!r}, pack_bins="
                        f"{spec.bins}: expected packing in {PACKINGS}, long_docs in "
                        f"{LONG_DOCS}, pack_bins >= 1")
  if spec.seq < 1:
    raise fs.InputError(f"seq={spec.seq}: expected >= 1")


def resharded_position(saved: list, index: int, count: int) -> dict:
  """The position of process `index` of `count` in a job resumed with another process count
  than the one that saved `saved` (one position per saved process): every saved row's
  position, from which each process takes its own rows (`fnscale.checkpoint.restore(...,
  reshard_data=resharded_position)`).

  Raises:
    InputError: two processes saved different positions for one row.
  """
  del index, count  # each process picks its rows in set_state
  merged: dict[str, Any] = {}
  for p in saved:
    for r, st in p["rows"].items():
      if r in merged and merged[r] != st:
        raise fs.InputError(f"the saved data positions of row {r} differ between processes; "
                            "the checkpoint's data position is damaged: resume with the same "
                            "process count or from another step")
      merged[r] = st
  return {"rows": merged}


def padding_fraction(batch: dict) -> float:
  """Fraction of a batch's (input, target) slots that are padding (segment id 0)."""
  seg = np.asarray(batch["segment_ids"])
  return float(np.mean(seg == 0))


def mean(loss):
  """A loss as a mean: a weighted loss's (sum, weight) divided (a padding-only batch: 0);
  a plain mean as it is."""
  if isinstance(loss, tuple):
    total, weight = loss
    return total / jnp.maximum(weight, 1.0)
  return loss
