"""Reading documents and writing one tokenized shard: the work of `recipes/pretokenize.py`'s
processes (`cache.py` plans the shards and writes the manifest).

Sources are read through etils' `epath` (local paths, and `gs://` through fsspec's GCS file
system): a text file (any other extension) is one document; `.jsonl` / `.json` lines are one
document each (the `text` field, or `messages` for chat); `.parquet` rows likewise (pyarrow).
A shard is one `Task`: a group of text files, a byte range of a JSONL file (lines that start
inside it) or a range of a Parquet file's row groups, so a big file splits over many processes.

A shard is an ArrayRecord file (`group_size:1`: one record is read without its neighbours),
one record per document: its token ids as little-endian int32, then for chat one uint8 loss
weight per token (1 on assistant tokens). It is written under a temporary name and renamed
when complete, then its counts go to `<shard>.json`: a shard is done iff that file exists.

This module imports no jax (the tokenizing processes start fast); its errors are
`ShardError` (a ValueError), which `cache.py` turns into fnscale errors.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterator, NamedTuple

import numpy as np

TEXT_KEY, CHAT_KEY = "text", "messages"
BYTES = "bytes"  # the built-in tokenizer: UTF-8 bytes, vocabulary 256


class ShardError(ValueError):
  """Bad input met while reading or tokenizing a source (the message names it)."""


class Task(NamedTuple):
  """The input of one shard: `paths` (several text files, else one file), its `kind`
  ("text", "jsonl" or "parquet") and the range [start, stop) of bytes (JSONL) or row groups
  (Parquet) it covers (0, 0 for text files: whole)."""
  paths: tuple[str, ...]
  kind: str
  start: int = 0
  stop: int = 0


class Tokenizer(NamedTuple):
  """What tokenizes: `spec` ("bytes", or a tokenizer.json / a directory holding one) and,
  for chat data, `chat(messages, tok=, where=) -> (ids, weights)`, a conversation's ids and
  loss weights (`chat.tokenize` with its template; a module-level function or a
  `functools.partial` of one, so it reaches the tokenizing processes)."""
  spec: str
  chat: Callable | None = None


def kind_of(path: str) -> str:
  ext = os.path.splitext(path)[1].lower()
  return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(ext, "text")


def _epath(path: str):
  from etils import epath  # pylint: disable=import-outside-toplevel
  return epath.Path(path)


def _jsonl_records(path: str, start: int, stop: int) -> Iterator[tuple[int, dict]]:
  """(byte offset, parsed line) of the lines of `path` that start in [start, stop); bytes
  that aren't UTF-8 read as U+FFFD, as in text files."""
  with _epath(path).open("rb") as f:
    if start > 0:
      f.seek(start - 1)
      f.readline()  # the line that began before `start` is the previous shard's
    while (at := f.tell()) < stop:
      line = f.readline()
      if not line:
        return
      if not line.strip():
        continue
      try:
        yield at, json.loads(line.decode("utf-8", errors="replace"))
      except json.JSONDecodeError as e:
        raise ShardError(f"{path}: the line at byte {at} is not JSON ({e.msg}); fix the "
                         "line or remove it") from None


def _parquet_records(path: str, start: int, stop: int, key: str) -> Iterator[tuple[int, dict]]:
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  with _epath(path).open("rb") as f:
    pf = pq.ParquetFile(f)
    if key not in pf.schema_arrow.names:
      raise ShardError(f"{path}: no column {key!r} (columns {pf.schema_arrow.names}); fix: "
                       "--field=NAME of the column that holds the documents")
    for g in range(start, stop):
      for i, value in enumerate(pf.read_row_group(g, columns=[key]).column(0).to_pylist()):
        yield g * 1_000_000 + i, {key: value}


def documents(task: Task, key: str) -> Iterator[tuple[str, object]]:
  """(where, document) of each document of a task: where names it ("FILE" or "FILE, byte
  N"); the document is a str for text, or the `key` field's value of each record (a str,
  or for chat a list of messages)."""
  if task.kind == "text":
    for p in task.paths:
      yield p, _epath(p).read_bytes().decode("utf-8", errors="replace")
    return
  path = task.paths[0]
  records = (_jsonl_records(path, task.start, task.stop) if task.kind == "jsonl" else
             _parquet_records(path, task.start, task.stop, key))
  for at, rec in records:
    where = f"byte {at}" if task.kind == "jsonl" else f"row {at}"
    if not isinstance(rec, dict) or key not in rec:
      raise ShardError(f"{path}: the record at {where} has no {key!r} field (keys "
                       f"{sorted(rec) if isinstance(rec, dict) else type(rec).__name__}); "
                       "fix: --field=NAME of the field that holds the documents")
    yield f"{path}, {where}", rec[key]


def tokenizer_file(spec: str) -> str:
  """The tokenizer.json a spec names: the file, or DIR/tokenizer.json (a Hugging Face
  checkpoint's directory)."""
  p = _epath(spec)
  return os.fspath(p / "tokenizer.json") if p.is_dir() else spec


def tokenizer_identity(spec: str) -> dict:
  """{"name", "sha256", "vocab"}: the same for the same tokenizer wherever its file lies
  (the hash is of the library's own serialisation, not of the file's formatting)."""
  if spec == BYTES:
    return {"name": BYTES, "sha256": BYTES, "vocab": 256}
  tok = load_tokenizer(spec)
  ids = tok.get_vocab(with_added_tokens=True).values()
  vocab = max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
  text = tok.to_str()
  return {"name": spec, "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
          "vocab": vocab}


def load_tokenizer(spec: str):
  import tokenizers  # pylint: disable=import-outside-toplevel
  path = tokenizer_file(spec)
  try:
    return tokenizers.Tokenizer.from_str(_epath(path).read_text())
  except FileNotFoundError:
    raise ShardError(f"tokenizer={spec!r}: no such file ({path}); pass a Hugging Face "
                     "tokenizer.json, a directory holding one, or 'bytes'") from None
  except Exception as e:  # pylint: disable=broad-except  (the library raises plain Exception)
    raise ShardError(f"tokenizer={spec!r} is not a readable tokenizer.json: {e}") from None


def encode_texts(texts: list[str], spec: str, tok=None) -> list[np.ndarray]:
  """int32 ids of each text: UTF-8 bytes for "bytes", else the tokenizer's `encode_batch`
  with its own special tokens (e.g. a BOS its post-processor adds)."""
  if spec == BYTES:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]
  return [np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)]


def record(ids: np.ndarray, weights: np.ndarray | None = None) -> bytes:
  """A document as one record: int32 ids, then (chat) one uint8 weight per id."""
  out = np.asarray(ids, "<i4").tobytes()
  return out if weights is None else out + np.asarray(weights, np.uint8).tobytes()


def unrecord(data: bytes, weighted: bool) -> tuple[np.ndarray, np.ndarray | None]:
  """(ids int32 [n], weights uint8 [n] or None) of a record."""
  if not weighted:
    return np.frombuffer(data, "<i4").astype(np.int32), None
  n = len(data) // 5
  return (np.frombuffer(data, "<i4", count=n).astype(np.int32),
          np.frombuffer(data, np.uint8, offset=4 * n))


def write_shard(task: Task, out: str, tokenizer: Tokenizer, key: str) -> dict:
  """Tokenizes the documents of `task` into the ArrayRecord file `out` (under a temporary
  name, renamed when complete) and writes its counts to `out + ".json"` (last: the mark
  that the shard is done). Returns the counts: {"docs", "tokens", "loss_tokens",
  "max_doc_tokens"}."""
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per process
  from array_record.python import array_record_module as ar  # pylint: disable=import-outside-toplevel
  tok = None if tokenizer.spec == BYTES else load_tokenizer(tokenizer.spec)
  chat = key == CHAT_KEY
  tmp = out + ".tmp"
  writer = ar.ArrayRecordWriter(tmp, "group_size:1")
  counts = {"docs": 0, "tokens": 0, "loss_tokens": 0, "max_doc_tokens": 0}
  try:
    batch = []
    for where, doc in documents(task, key):
      batch.append((where, doc))
      if len(batch) == 256:
        _add(counts, _write(writer, batch, tokenizer, tok, chat))
        batch = []
    _add(counts, _write(writer, batch, tokenizer, tok, chat))
  finally:
    writer.close()
  os.replace(tmp, out)
  with open(out + ".json.tmp", "w") as f:
    json.dump(counts, f)
  os.replace(out + ".json.tmp", out + ".json")
  return counts


def _add(counts: dict, got: dict) -> None:
  for k, v in got.items():
    counts[k] = max(counts[k], v) if k.startswith("max_") else counts[k] + v


def _write(writer, batch: list, tokenizer: Tokenizer, tok, chat: bool) -> dict:
  if not batch:
    return {}
  if chat:
    rows = [tokenizer.chat(m, tok=tok, where=where) for where, m in batch]
  else:
    for where, doc in batch:
      if not isinstance(doc, str):
        raise ShardError(f"{where}: the document is {type(doc).__name__}, not text "
                         f"({str(doc)[:60]!r}); fix: --field=NAME of a text field (or --chat "
                         "for conversations in `messages`)")
    rows = [(ids, None) for ids in encode_texts([d for _, d in batch], tokenizer.spec, tok)]
  for ids, weights in rows:
    writer.write(record(ids, weights))
  return {"docs": len(rows), "tokens": sum(len(i) for i, _ in rows),
          "loss_tokens": sum(int(w.sum()) if w is not None else len(i) for i, w in rows),
          "max_doc_tokens": max(len(i) for i, _ in rows)}
