"""Preference data for DPO: (prompt, chosen, rejected) rows from JSONL or Parquet, rendered
by the chat template, packed into rows of whole pairs.

A row of the file: {"prompt": ..., "chosen": ..., "rejected": ...}. The prompt is a string
(one user turn) or a list of {"role", "content"} messages; each response is a string (one
assistant turn) or a list of messages (the turns that answer the prompt). Each side is the
conversation prompt + response rendered by `chat.py` (the tokenizer's chat template, or
--chat_template); its loss weights are 1 on the response's assistant turns only (an
assistant turn inside the prompt is context, not preference). Pairs are packed as whole
units, in order, into rows of `seq` tokens: pair k of a row is segment 2k - 1 (its chosen
side) then 2k (its rejected side), each with its own positions from 0, so attention never
crosses sides or pairs; a row holds at most `pairs` pairs (the loss's static bound), a pair
longer than a row is an error naming it. Every 20th pair is held out for evaluation.

Batches mirror `batches.text_batches` (grain, each process reading its rows of every global
batch; positions saved with checkpoints).
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import grain
import numpy as np

import fnscale as fs
from recipes.lm import chat, data, shards, tokens

HELD_EVERY = 20  # pair i is held out when i % HELD_EVERY == HELD_EVERY - 1
FIELDS = ("prompt", "chosen", "rejected")


class Pair(NamedTuple):
  """One tokenized pair: ids int32 [n] and weights uint8 [n] of each side."""
  chosen: np.ndarray
  chosen_weights: np.ndarray
  rejected: np.ndarray
  rejected_weights: np.ndarray


def read_rows(path: str) -> list[tuple[str, dict]]:
  """(where, record) of every record of a .jsonl / .json (one JSON object a line) or
  .parquet file.

  Raises:
    InputError: a missing file, another extension, a line that is not a JSON object.
  """
  if not os.path.isfile(path):
    raise fs.InputError(f"--dataset={path}: no such preference file; fix: a .jsonl or "
                        ".parquet file of {\"prompt\", \"chosen\", \"rejected\"} rows")
  kind = shards.kind_of(path)
  if kind == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
  if kind != "jsonl":
    raise fs.InputError(f"--dataset={path}: preference data is read from .jsonl or .parquet "
                        "files; fix: write one JSON object per line")
  out = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise fs.InputError(f"{path} line {i} is not JSON ({e.msg}); fix the line") from None
      if not isinstance(record, dict):
        raise fs.InputError(f"{path} line {i} is a {type(record).__name__}, expected an "
                            "object with prompt, chosen and rejected")
      out.append((f"{path} line {i}", record))
  return out


def _messages(value, role: str, field: str, where: str) -> list:
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  if isinstance(value, dict) and "role" in value:
    return [value]
  if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m
                                               for m in value):
    return list(value)
  raise fs.InputError(f"{where}: {field!r} is {str(value)[:60]!r}; expected a string or a "
                      "list of {\"role\": ..., \"content\": ...} messages")


def _side(prompt: list, response: list, template, tok, where: str):
  """ids and weights of prompt + response, weight only on the response's assistant turns."""
  pieces = chat.pieces(prompt + response, template, where)
  skip = sum(m["role"] == "assistant" for m in prompt)
  weighted = [i for i, (_, w) in enumerate(pieces) if w]
  keep = set(weighted[skip:])
  if not keep:
    raise fs.InputError(f"{where}: the response has no assistant turn to score; fix: "
                        "a response with the assistant's reply")
  texts = [t for t, _ in pieces]
  if tok is None:
    encoded = shards.encode_texts(texts, shards.BYTES)
  else:
    encoded = [np.asarray(e.ids, np.int32)
               for e in tok.encode_batch(texts, add_special_tokens=False)]
  ids = np.concatenate(encoded).astype(np.int32)
  weights = np.concatenate([np.full(len(e), int(i in keep), np.uint8)
                            for i, e in enumerate(encoded)])
  return ids, weights


def _check_fields(record: dict, where: str) -> None:
  missing = [f for f in FIELDS if record.get(f) in (None, "", [])]
  if missing:
    raise fs.InputError(f"{where}: a preference row without {' and '.join(map(repr, missing))}"
                        f" (it has {sorted(record)}); fix: every row needs \"prompt\", "
                        "\"chosen\" (the preferred response) and \"rejected\"")


def tokenize(record: dict, template, tok, where: str) -> Pair:
  """One record as a `Pair`.

  Raises:
    InputError: a missing field (named, with the fix), or a field that is not a string or
      messages; ShardError (from the template) as InputError.
  """
  _check_fields(record, where)
  prompt = _messages(record["prompt"], "user", "prompt", where)
  try:
    sides = [_side(prompt, _messages(record[f], "assistant", f, where), template, tok,
                   f"{where} ({f})") for f in ("chosen", "rejected")]
  except shards.ShardError as e:
    raise fs.InputError(str(e)) from None
  return Pair(*sides[0], *sides[1])


def _segment(ids, weights, seg: int) -> dict:
  n = len(ids) - 1
  return {"inputs": ids[:-1], "targets": ids[1:], "weights": weights[1:].astype(np.float32),
          "segment_ids": np.full(n, seg, np.int32), "positions": np.arange(n, dtype=np.int32)}


def pack(pairs: list, seq: int, max_pairs: int, names: list | None = None) -> list[dict]:
  """Whole pairs into rows of `seq` tokens, in order (a row closes when the next pair
  doesn't fit or it holds `max_pairs`); padding has segment id 0 and weight 0.

  Raises:
    InputError: a pair whose two sides need more than `seq` tokens (named, with the fix).
  """
  rows, cur, used, k = [], [], 0, 0
  for i, p in enumerate(pairs):
    need = len(p.chosen) + len(p.rejected) - 2
    if need > seq:
      raise fs.InputError(f"{names[i] if names else f'pair {i}'}: "
                          f"its chosen and rejected sides take {need} tokens, more than a row "
                          f"of --seq={seq}; fix: a longer --seq, or drop or shorten the pair")
    if cur and (used + need > seq or k == max_pairs):
      rows.append(_row(cur, seq))
      cur, used, k = [], 0, 0
    k += 1
    cur += [_segment(p.chosen, p.chosen_weights, 2 * k - 1),
            _segment(p.rejected, p.rejected_weights, 2 * k)]
    used += need
  if cur:
    rows.append(_row(cur, seq))
  return rows


def _row(segments: list, seq: int) -> dict:
  out = {}
  for key in segments[0]:
    x = np.concatenate([s[key] for s in segments])
    out[key] = np.pad(x, (0, seq - len(x)))
  return out


def load(path: str, tokenizer: str, template_file: str) -> tuple[list, list]:
  """The preference file at `path` tokenized: ((train pairs, their names), (held-out pairs,
  their names)), every `HELD_EVERY`th pair held out (at least one).

  Raises:
    InputError: see `read_rows` and `tokenize`; a chat template that can't be found.
  """
  records = read_rows(path)
  for where, r in records:  # every row's fields first: before the template and tokenizer
    _check_fields(r, where)
  try:
    template = chat.load_template(tokenizer or shards.BYTES, template_file)
    tok = shards.load_tokenizer(tokenizer) if tokenizer else None
  except shards.ShardError as e:
    raise fs.InputError(str(e)) from None
  pairs = [(tokenize(r, template, tok, where), where) for where, r in records]
  if not pairs:
    raise fs.InputError(f"--dataset={path} holds no preference rows")
  held = [p for i, p in enumerate(pairs) if i % HELD_EVERY == HELD_EVERY - 1] or pairs[-1:]
  train = [p for i, p in enumerate(pairs) if i % HELD_EVERY != HELD_EVERY - 1] or pairs
  return train, held


def corpus(path: str, tokenizer: str, template_file: str) -> data.Corpus:
  """A `data.Corpus` of the preference file: `preference` (train, held-out) pairs with their
  names, packed once the row length is known (`run_batches`); `train` / `eval` every pair's
  tokens end to end (the counts and baselines a run reports)."""
  train, held = load(path, tokenizer, template_file)
  tok = shards.load_tokenizer(tokenizer) if tokenizer else None
  vocab = tokens.vocabulary(tok)[0] if tok is not None else 256
  ends = lambda ps: np.concatenate([np.concatenate([p.chosen, p.rejected]) for p, _ in ps])
  encode = (lambda s: tok.encode(s).ids) if tok is not None else (lambda s: list(s.encode()))
  decode = tok.decode if tok is not None else (
      lambda ids: bytes(ids).decode("utf-8", errors="replace"))
  n = sum(len(p.chosen) + len(p.rejected) for p, _ in train + held)
  return data.Corpus(ends(train), ends(held), vocab, 1.0, encode, decode,
                     f"{path}: {len(train) + len(held)} preference pairs ({len(held)} held "
                     f"out), {n:,} tokens", preference=(train, held))


def rows(pairs: list, seq: int, max_pairs: int) -> list[dict]:
  """`pack` of (pair, name) pairs."""
  return pack([p for p, _ in pairs], seq, max_pairs, [w for _, w in pairs])


def batches(packed: list, index: int, count: int, global_batch: int, seed: int,
            held: bool = False):
  """This process's rows (process `index` of `count`, as `batches.process_shard` gives) of
  each global batch of `packed` rows, shuffled from `seed` and repeated forever: a grain
  iterator (its position saved with checkpoints), or for `held` a grain MapDataset."""
  local = global_batch // count
  ds = grain.MapDataset.source(packed).shuffle(seed=seed + int(held)).repeat(None)
  ds = ds[index::count].batch(local, drop_remainder=True)
  if held:
    return ds
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))
