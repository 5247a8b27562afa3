"""The data of `train_lm.py`: a text corpus as tokens, a held-out split, the rows of each batch."""
from __future__ import annotations

import glob
import os
import sysconfig
from typing import Callable, NamedTuple

import numpy as np

import fnscale as fs

CORPORA = ("stdlib", "tiny_corpus")


class Corpus(NamedTuple):
  """Token ids of the train and held-out splits and how to read them back.

  train, eval: uint8 (bytes) or int32 (tokenizer ids) [n]. vocab: vocabulary size.
  tokens_per_byte: held-out tokens per byte of held-out text (1 for bytes), to turn a loss per
  token into a loss per byte. encode/decode: str <-> list of ids. describe: one line.
  """
  train: np.ndarray
  eval: np.ndarray
  vocab: int
  tokens_per_byte: float
  encode: Callable[[str], list]
  decode: Callable[[list], str]
  describe: str


def load(dataset: str, tokenizer: str = "") -> Corpus:
  """Reads, splits and tokenizes `dataset` (a name in CORPORA, a file, directory or glob).

  Raises:
    FnscaleError: missing or empty corpus, unknown name.
  """
  raw = load_corpus(None if dataset == "stdlib" else dataset)
  train, evals = split_corpus(raw)
  return Corpus(train, evals, 256, 1.0, lambda t: list(t.encode()),
                lambda ids: bytes(ids).decode("utf-8", errors="replace"),
                f"{dataset}: {len(raw) / 1e6:.1f} MB, {len(train) / 1e6:.1f} MB train, "
                f"{len(evals) / 1e6:.2f} MB held out")


def check_fits(corpus: Corpus, seq: int) -> None:
  short = min(len(corpus.train), len(corpus.eval))
  if short < seq + 1:
    raise fs.FnscaleError(
        f"--seq={seq} is longer than the data: {len(corpus.train)} tokens train and "
        f"{len(corpus.eval)} held out (every {EVAL_EVERY_NTH_CHUNK}th chunk); each split needs "
        f"at least seq + 1 = {seq + 1} tokens. Use a smaller --seq or more data")


def steps_for(corpus, seq, global_batch, epochs, steps, steps_given) -> int:
  if steps < 0:
    raise fs.FnscaleError(f"steps={steps}: expected >= 0")
  return steps


class _Batches:
  def __init__(self, corpus, bsh, seq, global_batch, seed, step):
    self.args = corpus, bsh, seq, global_batch, seed
    self.rows = local_rows(bsh, global_batch)
    self.step = step

  def get_state(self):
    return {"step": self.step}

  def __next__(self):
    corpus, bsh, seq, global_batch, seed = self.args
    b = fs.global_batch(local_batch(corpus.train, seq, global_batch, seed, self.step, self.rows), bsh)
    self.step += 1
    return b


def batches(corpus, mesh, seq, global_batch, seed, eval_batches, state):
  bsh = fs.batch_sharding(mesh)
  it = _Batches(corpus, bsh, seq, global_batch, seed, (state or {"step": 0})["step"])
  rows = it.rows
  evals = [fs.global_batch(local_batch(corpus.eval, seq, global_batch, seed + 1, i, rows), bsh)
           for i in range(eval_batches)]
  return it, evals


def _default_corpus_files() -> list[str]:
  stdlib = sysconfig.get_paths()["stdlib"]
  files = glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
  skip = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
  return sorted(f for f in files if not any(s in f for s in skip))


def corpus_files(spec: str | None) -> list[str]:
  """Files of the corpus: the stdlib's .py files by default, else a file, directory or glob.

  Raises:
    FnscaleError: nothing at `spec`.
  """
  if not spec:
    files = _default_corpus_files()
    if not files:
      raise fs.FnscaleError(
          f"no .py files under the standard library ({sysconfig.get_paths()['stdlib']}); "
          "pass --data=PATH (a text file, directory or glob)")
    return files
  if os.path.isfile(spec):
    return [spec]
  if os.path.isdir(spec):
    files = [os.path.join(d, f) for d, _, fs_ in os.walk(spec) for f in fs_]
  else:
    files = glob.glob(os.path.expanduser(spec), recursive=True)
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    kind = ("directory has no files" if os.path.isdir(spec)
            else "no such file, directory or glob match")
    raise fs.FnscaleError(f"--data={spec!r}: {kind}; pass a text file, a directory or a glob")
  return files


def load_corpus(spec: str | None) -> np.ndarray:
  """All bytes of the corpus as uint8 [n], files in sorted order joined by newlines.

  Raises:
    FnscaleError: missing or empty corpus.
  """
  parts = []
  for f in corpus_files(spec):
    with open(f, "rb") as fh:
      data = fh.read()
    if data:
      parts.append(data)
  if not parts:
    raise fs.FnscaleError(f"--data={spec!r}: the corpus is empty (0 bytes); "
                          "pass a non-empty text file, directory or glob")
  return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


EVAL_EVERY_NTH_CHUNK = 20  # 5% held out


def split_corpus(corpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic train/eval split: every 20th chunk (64 KiB, or 1/20 of a small corpus).

  Interleaved chunks make the held-out text representative of the whole corpus.

  Raises:
    FnscaleError: either split is shorter than seq + 1 bytes.
  """
  chunk = max(1, min(65536, len(corpus) // EVAL_EVERY_NTH_CHUNK))
  pieces = [corpus[i:i + chunk] for i in range(0, len(corpus), chunk)]
  is_eval = lambda i: i % EVAL_EVERY_NTH_CHUNK == EVAL_EVERY_NTH_CHUNK - 1
  train = np.concatenate([c for i, c in enumerate(pieces) if not is_eval(i)])
  evals = np.concatenate([c for i, c in enumerate(pieces) if is_eval(i)] or [corpus[:0]])
  return train, evals


def _windows(data: np.ndarray, starts: np.ndarray, seq: int) -> dict:
  idx = starts[:, None] + np.arange(seq + 1)[None, :]
  rows = data[idx].astype(np.int32)
  return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def batch_starts(n: int, seq: int, global_batch: int, seed: int, step: int) -> np.ndarray:
  """Window starts of every row of the global batch at `step`: int64 [global_batch].

  A pure function of (seed, step), so every process agrees on the global batch and the data
  position of a run is just its step number.
  """
  rng = np.random.default_rng([seed, step])
  return rng.integers(0, n - seq, size=global_batch)


def local_rows(sharding, global_batch: int) -> np.ndarray:
  """Rows of the global batch that this process's devices hold, in order."""
  index_map = sharding.addressable_devices_indices_map((global_batch, 1))
  rows = set()
  for idx in index_map.values():
    rows.update(range(*idx[0].indices(global_batch)))
  return np.array(sorted(rows), dtype=np.int64)


def local_batch(data: np.ndarray, seq: int, global_batch: int, seed: int, step: int,
                rows: np.ndarray) -> dict:
  """This process's rows of the global batch at `step`: {"inputs", "targets"} int32."""
  starts = batch_starts(len(data), seq, global_batch, seed, step)[rows]
  return _windows(data, starts, seq)
