"""Text to token ids with a Hugging Face `tokenizer.json` (the `tokenizers` library): the
tokenizer read (`read`) and the vocabulary a model needs for it (`vocabulary`), and a
corpus's ids, kept per machine so that only the first run pays for them (`ids`)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from typing import Callable

import numpy as np

import fnscale as fs


def read(path: str):
  import tokenizers  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(path):
    raise fs.InputError(f"tokenizer={path!r}: no such file; pass a Hugging Face "
                          "tokenizer.json (or leave it empty for bytes)")
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  (the library raises plain Exception)
    raise fs.InputError(f"tokenizer={path!r} is not a readable tokenizer.json: {e}") from None


def vocabulary(tok) -> tuple[int, str]:
  """The model vocabulary a `tokenizers.Tokenizer` needs, its largest id + 1 (added tokens
  included), and how to say it. `get_vocab_size()` counts entries: less than that for a
  pruned vocabulary that kept its original ids, whose largest ids would index past the
  embedding (a nan loss)."""
  ids = tok.get_vocab(with_added_tokens=True).values()
  size = tok.get_vocab_size(with_added_tokens=True)
  vocab = max(max(ids, default=-1) + 1, size)
  if vocab == size:
    return vocab, f"vocab {vocab}"
  return vocab, (f"vocab {vocab}: ids up to {vocab - 1}, though the tokenizer holds {size} "
                 "entries (ids not contiguous)")


def cache_dir() -> str:
  """Where token ids are kept: `$XDG_CACHE_HOME/fnscale/tokens` (`~/.cache/...`)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fnscale", "tokens")


def ids(texts: tuple[bytes, ...], tok, what: str, say: Callable[[str], None]
        ) -> list[np.ndarray]:
  """int32 ids of each of `texts` by `tok` (a `tokenizers.Tokenizer`): read back from
  `cache_dir()` when these texts were tokenized by this tokenizer (its serialised
  form) and tokenizers version before, else encoded (BPE over the stdlib corpus takes about
  a minute on 2 cores), `say`ing how far it is every 10 s, and kept there (written whole,
  then renamed). `what` names the texts and tokenizer in those lines."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  key = hashlib.sha256()
  for part in (*texts, tok.to_str().encode(), tokenizers.__version__.encode()):
    key.update(hashlib.sha256(part).digest())
  path = os.path.join(cache_dir(), key.hexdigest()[:32] + ".npz")
  with contextlib.suppress(OSError, ValueError, KeyError):
    with np.load(path) as kept:
      out = [kept[f"ids{i}"] for i in range(len(texts))]
    say(f"data: the token ids of {what} read from {path}")
    return out
  total, t0 = sum(map(len, texts)), time.time()
  say(f"data: tokenizing {what} ({total / 1e6:.1f} MB; kept in {cache_dir()} for the "
      "next run)")
  done, last, out = [0], [t0], []

  def progress(n: int) -> None:
    done[0] += n
    if time.time() - last[0] >= 10:
      last[0] = time.time()
      say(f"data: tokenized {done[0] / 1e6:.1f} of {total / 1e6:.1f} MB "
          f"({done[0] / total:.0%}, {last[0] - t0:.0f} s)")
  for text in texts:
    out.append(_encode(text, tok, progress))
  try:
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **{f"ids{i}": a for i, a in enumerate(out)})
    os.replace(tmp, path)
  except OSError as e:
    say(f"data: the token ids are not kept ({path}: {e})")
  say(f"data: tokenized {total / 1e6:.1f} MB in {time.time() - t0:.0f} s")
  return out


def _encode(text: bytes, tok, progress: Callable[[int], None]) -> np.ndarray:
  """int32 ids of `text`, encoded a few MB at a time (the tokenizer's encodings of a whole
  corpus at once take gigabytes), `progress(bytes)` after each."""
  chunks, out = _text_chunks(text), []
  for i in range(0, len(chunks), 64):  # 64 chunks of ~64 KiB
    batch = chunks[i:i + 64]
    out += [np.asarray(e.ids, np.int32) for e in tok.encode_batch(batch)]
    progress(sum(len(c.encode("utf-8", errors="replace")) for c in batch))
  return np.concatenate(out) if out else np.zeros(0, np.int32)


def _text_chunks(b: bytes, size: int = 1 << 16) -> list[str]:
  """Text of `b` in pieces cut at line ends (for parallel encoding without splitting words)."""
  lines, out, n = b.decode("utf-8", errors="replace").splitlines(keepends=True), [], 0
  for line in lines:
    if not out or n >= size:
      out.append("")
      n = 0
    out[-1] += line
    n += len(line)
  return out
