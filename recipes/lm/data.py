"""The data of `train_lm.py`: a text corpus as tokens, a held-out split, the baseline to beat.

Corpora (`dataset=`): "stdlib", every .py file of the running interpreter's standard library
(about 30 MB on CPython 3.11); "tiny_corpus", the fixed list of standard-library modules in
`TINY_CORPUS` (about 1 MB, the same files on every machine with that Python version, read
offline); or a text file, a directory or a glob. Tokens are bytes (vocabulary 256) unless a
Hugging Face `tokenizer.json` is given.

Batches of a corpus: `batches.py`.

A token cache (`recipes/pretokenize.py`) or a weighted mixture of caches ("web:0.7,code:0.3",
or a JSON file of weights) is read through `packing.py` instead: documents packed into rows
with segment ids, positions and loss weights, every process reading only its rows
(`fnscale.process_rows`), positions per row (`packing.resharded_position`). `load` tells
the two apart (`is_packed`).
"""
from __future__ import annotations

import glob
import os
import sysconfig
from typing import Callable, NamedTuple

import numpy as np

import fnscale as fs
from recipes.lm import cache, packing, shards, tokens
from recipes.lm.options import CORPORA

# Standard-library modules of `tiny_corpus`: general-purpose pure-Python code, about 1 MB.
TINY_CORPUS = (
    "argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
    "json/decoder.py", "json/encoder.py", "logging/__init__.py", "os.py", "pathlib.py",
    "shutil.py", "string.py", "subprocess.py", "textwrap.py", "typing.py", "random.py",
    "heapq.py", "enum.py", "contextlib.py", "tempfile.py", "threading.py", "copy.py")

EVAL_EVERY_NTH_CHUNK = 20  # 5% held out


class Corpus(NamedTuple):
  """Token ids of the train and held-out splits, and how to read them back.

  train, eval: uint8 (bytes) or int32 (tokenizer ids) [n]. vocab: vocabulary size.
  tokens_per_byte: held-out tokens per byte of held-out text (1 for bytes): loss per token x
  this = loss per byte, comparable across tokenizers. encode/decode: str <-> list of ids.
  """
  train: np.ndarray
  eval: np.ndarray
  vocab: int
  tokens_per_byte: float
  encode: Callable[[str], list]
  decode: Callable[[list], str]
  describe: str
  # A token cache or mixture: (packing.Source list, the run's tokenizer); None for text.
  packed: tuple | None = None
  # DPO's preference pairs: (train, held out), each [(preference.Pair, its name)]; None else.
  preference: tuple | None = None


def corpus_files(spec: str | None) -> list[str]:
  """Files of a corpus: the stdlib's .py files (None or "stdlib"), `TINY_CORPUS`, else a file,
  directory or glob, sorted.

  Raises:
    FnscaleError: nothing at `spec` (the message lists the named corpora).
  """
  stdlib = sysconfig.get_paths()["stdlib"]
  if spec in (None, "", "stdlib"):
    files = glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
    skip = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
    files = [f for f in files if not any(s in f for s in skip)]
  elif spec == "tiny_corpus":
    files = [os.path.join(stdlib, f) for f in TINY_CORPUS]
  elif os.path.isfile(spec):
    return [spec]
  elif os.path.isdir(spec):
    files = [os.path.join(d, f) for d, _, names in os.walk(spec) for f in names]
  else:
    files = glob.glob(os.path.expanduser(spec), recursive=True)
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    kind = ("directory has no files" if os.path.isdir(spec or "") else
            f"no such file, directory or glob match, and not a named corpus {list(CORPORA)}")
    raise fs.InputError(f"dataset={spec!r}: {kind}; pass a named corpus, a text file, a "
                          "directory or a glob")
  return files


RECORDS = (".jsonl", ".parquet")  # files of records: a token cache's sources, not text


def text_files(spec: str | None) -> list[str]:
  """`corpus_files(spec)`, every one read as text.

  Raises:
    InputError: as corpus_files; a JSONL or Parquet file (its markup or compressed bytes
      would be trained on), naming `recipes/pretokenize.py`, which reads their records.
  """
  files = corpus_files(spec)
  records = [f for f in files if f.lower().endswith(RECORDS)]
  if records:
    raise fs.InputError(
        f"dataset={spec!r}: {records[:3]} hold records (JSONL/Parquet), not text; fix: make a "
        f"token cache of their text field, python recipes/pretokenize.py --sources={spec} "
        "--out=DIR (with --tokenizer=...), and pass --dataset=DIR")
  return files


def read_bytes(spec: str | None) -> bytes:
  """All bytes of the corpus (`text_files`), files in sorted order joined by newlines.

  Raises:
    FnscaleError: missing or empty corpus, or files of records.
  """
  parts = []
  for f in text_files(spec):
    with open(f, "rb") as fh:
      parts.append(fh.read())
  text = b"\n".join(p for p in parts if p)
  if not text:
    raise fs.InputError(f"dataset={spec!r}: the corpus is empty (0 bytes); pass a non-empty "
                          "text file, directory or glob")
  return text


def split(text: bytes) -> tuple[bytes, bytes]:
  """Deterministic train/held-out split: every 20th chunk (64 KiB, or 1/20 of a small corpus)
  is held out; interleaved chunks make the held-out text representative of the whole."""
  chunk = max(1, min(65536, len(text) // EVAL_EVERY_NTH_CHUNK))
  pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
  held = lambda i: i % EVAL_EVERY_NTH_CHUNK == EVAL_EVERY_NTH_CHUNK - 1
  return (b"".join(c for i, c in enumerate(pieces) if not held(i)),
          b"".join(c for i, c in enumerate(pieces) if held(i)))


def is_packed(dataset: str) -> bool:
  """Whether `dataset` names token caches (a cache directory, a mixture of them with
  weights, or a JSON file of weights) rather than text."""
  if not dataset or dataset in CORPORA:
    return False
  if dataset.endswith(".json") and os.path.isfile(dataset):
    return True
  try:
    parts = packing.parse_mixture(dataset)
  except fs.InputError:
    return True  # weights that don't parse: packing's error says which
  return len(parts) > 1 or any(w != 1.0 for _, w in parts) or cache.is_cache(parts[0][0])


def load(dataset: str, tokenizer: str = "", say: Callable[[str], None] | None = None
         ) -> Corpus:
  """Reads, splits and tokenizes a corpus (see the module docstring); or opens token caches
  (`is_packed`: `load_packed`). Token ids of a tokenizer are kept per machine
  (`tokens.ids`): the next run with the same text and tokenizer reads them back.

  Args:
    dataset: a name in CORPORA, a file, a directory or a glob.
    tokenizer: path of a Hugging Face `tokenizer.json` (the `tokenizers` library); "" = bytes.
    say: where the tokenizing's progress goes (None: nowhere).

  Raises:
    FnscaleError: a missing, empty or unknown corpus; a missing or unreadable tokenizer.
  """
  if is_packed(dataset):
    return load_packed(dataset, tokenizer)
  text = read_bytes(dataset)
  train, held = split(text)
  line = (f"{dataset}: {len(text) / 1e6:.2f} MB, {len(train) / 1e6:.2f} MB train, "
          f"{len(held) / 1e6:.3f} MB held out")
  if not tokenizer:
    as_ids = lambda b: np.frombuffer(b, np.uint8)
    return Corpus(as_ids(train), as_ids(held), 256, 1.0, lambda s: list(s.encode()),
                  lambda ids: bytes(ids).decode("utf-8", errors="replace"), line + ", bytes")
  tok = tokens.read(tokenizer)
  train_ids, eval_ids = tokens.ids((train, held), tok, f"{dataset} with {tokenizer}",
                                  say or (lambda line: None))
  vocab, said = tokens.vocabulary(tok)
  for name, split_ids in (("training", train_ids), ("held-out", eval_ids)):
    check_token_ids(split_ids, vocab, f"tokenizer={tokenizer!r}'s {name} split")
  return Corpus(train_ids, eval_ids, vocab, len(eval_ids) / max(1, len(held)),
                lambda s: tok.encode(s).ids, tok.decode,
                f"{line}, tokenizer {tokenizer} ({said}, "
                f"{len(eval_ids) / max(1, len(held)):.3f} tokens/byte)")


def check_token_ids(ids, vocab: int, what: str = "token ids") -> None:
  """Raises FnscaleError unless every id in `ids` (an int array, or a batch dict of them:
  `{"inputs", "targets"}`) is in [0, vocab). Inside a jitted loss an out-of-range id is no
  error: the embedding lookup returns nan (or a clamped row) and the loss is nan or wrong.
  Call it on the host before feeding `gpt.loss_fn` / `llama.loss_fn` data of your own."""
  leaves = ids.values() if isinstance(ids, dict) else [ids]
  for leaf in leaves:
    a = np.asarray(leaf)
    if a.size == 0:
      continue
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab:
      bad = hi if hi >= vocab else lo
      raise fs.InputError(
          f"{what}: token id {bad} is outside the model's vocabulary of {vocab} (ids 0.."
          f"{vocab - 1}; largest id {hi}, smallest {lo}); fix: a vocab of at least {hi + 1} "
          "(ModelConfig.vocab) or ids remapped into range")


class Baseline(NamedTuple):
  """Held-out loss in nats per token of two count models fitted on the training split."""
  unigram: float  # add-one smoothed token frequencies
  bigram: float  # add-one smoothed P(token | previous token)


def baseline(corpus: Corpus) -> Baseline:
  """The unigram and bigram levels a language model of `corpus` should beat: counts from the
  training split, add-one (Laplace) smoothing over the vocabulary, mean negative log
  likelihood over the held-out split (each held-out token after the first, given the one
  before it, for the bigram). Units: nats per token, as `train_lm`'s eval loss."""
  train, held, v = corpus.train.astype(np.int64), corpus.eval.astype(np.int64), corpus.vocab
  uni = np.bincount(train, minlength=v)
  unigram = -np.mean(np.log((uni[held] + 1) / (len(train) + v)))
  pairs, queries = train[:-1] * v + train[1:], held[:-1] * v + held[1:]
  if v * v <= 1 << 24:  # a dense table of pair counts (bytes: 65,536 entries)
    seen = np.bincount(pairs, minlength=v * v)[queries]
  else:  # large vocabularies: count only the pairs that occur
    keys, counts = np.unique(pairs, return_counts=True)
    at = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
    seen = np.where(keys[at] == queries, counts[at], 0)
  before = np.bincount(train[:-1], minlength=v)[held[:-1]]
  bigram = -np.mean(np.log((seen + 1) / (before + v)))
  return Baseline(float(unigram), float(bigram))


def check_fits(corpus: Corpus, seq: int) -> None:
  """Raises FnscaleError when a split is shorter than one window (seq + 1 tokens)."""
  if min(len(corpus.train), len(corpus.eval)) < seq + 1:
    raise fs.InputError(
        f"seq={seq} is longer than the data: {len(corpus.train)} tokens train and "
        f"{len(corpus.eval)} held out ("
        + ("the caches' held-out documents" if corpus.packed is not None
           else f"every {EVAL_EVERY_NTH_CHUNK}th chunk") + "); each split needs "
        f"at least seq + 1 = {seq + 1} tokens. Use a smaller seq or more data")


# Tokens (at most) and documents of each split read for the baseline and the run's identity.
SAMPLE_TOKENS, SAMPLE_DOCS = 1 << 20, 2000


def load_packed(dataset: str, tokenizer: str = "") -> Corpus:
  """Opens the caches of `dataset` (`packing.open_mixture`: tokenizer checked). The Corpus's
  train / eval arrays are the first ~1M tokens of the mixture's training and held-out
  documents, at most 2000 (for the baseline); tokens_per_byte is the caches' tokens per source byte
  (JSONL and Parquet sources count their markup too: bits/byte reads a little low there).

  Raises:
    InputError: see `packing.open_mixture`.
  """
  sources, tok_spec = packing.open_mixture(dataset, tokenizer)
  m = [s.cache.manifest for s in sources]
  # At most one pass: each split's documents once (or the first SAMPLE_DOCS).
  sample = lambda held: _sample(packing.documents(sources, 0, held),
                                sum(getattr(packing.doc_split(s.cache.manifest["docs"]),
                                            "held" if held else "train") for s in sources))
  per_byte = (sum(x["tokens"] for x in m) /
              max(1, sum(s["bytes"] for x in m for s in x["sources"])))
  if tok_spec == shards.BYTES:
    encode, decode = (lambda s: list(s.encode()),
                      lambda ids: bytes(ids).decode("utf-8", errors="replace"))
  else:
    tok = shards.load_tokenizer(tok_spec)
    encode, decode = (lambda s: tok.encode(s).ids), tok.decode
  vocab = m[0]["tokenizer"]["vocab"]
  what = ", ".join(f"{s.cache.path} ({s.weight:.0%}, {x['tokens']:,} tokens, {x['kind']})"
                   for s, x in zip(sources, m))
  return Corpus(sample(False), sample(True), vocab, per_byte, encode, decode,
                f"token caches: {what}; tokenizer {m[0]['tokenizer']['name']} (vocab {vocab})",
                (sources, tok_spec))


def _sample(docs, limit: int) -> np.ndarray:
  out, n = [], 0
  for i in range(min(limit, SAMPLE_DOCS)):
    ids = docs[i]["ids"]
    out.append(ids)
    n += len(ids)
    if n >= SAMPLE_TOKENS:
      break
  return np.concatenate(out).astype(np.int32)


def check_epochs(dataset: str, epochs: int | None) -> None:
  """Raises InputError for --epochs with token caches (read as an endless mixture)."""
  if epochs is not None and is_packed(dataset):
    raise fs.InputError(f"epochs={epochs}: token caches are read as an endless mixture; "
                        "give --steps instead")
