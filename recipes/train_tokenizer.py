"""Trains a byte-level BPE tokenizer offline and writes a Hugging Face `tokenizer.json`.

  python recipes/train_tokenizer.py --out=/tmp/tok/tokenizer.json     # stdlib modules, 4096
  python recipes/train_tokenizer.py --data='corpus/*.txt' --vocab_size=8192 --out=tok.json
  python recipes/train_lm.py --tokenizer=/tmp/tok/tokenizer.json

Byte-level BPE as GPT-2 uses it (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners", sec. 2.2): the base alphabet is the 256 byte values, so any text encodes
and decodes back exactly with no unknown token, and merges of frequent pairs are learned on
the corpus. The `tokenizers` library does the training; this file picks the files and checks
the result. The default corpus is the top-level modules of the running Python's standard
library (`<stdlib>/*.py`, about 170 files and 4.7 MB on Python 3.11): on every machine, no
download.
"""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

from absl import app
from absl import flags

from fnscale.errors import FnscaleError

END_OF_TEXT = "<|endoftext|>"  # the one special token: separates documents
MIN_VOCAB = 256 + 1  # every byte, plus END_OF_TEXT


def default_files() -> list[str]:
  """The default corpus: the standard library's top-level modules, sorted by path."""
  return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def corpus_files(spec: str | None) -> list[str]:
  """The files of a corpus given as a file, a directory (walked) or a glob; None: the default.

  Raises:
    FnscaleError: nothing matches `spec`.
  """
  if not spec:
    files = default_files()
  elif os.path.isfile(spec):
    files = [spec]
  elif os.path.isdir(spec):
    files = [os.path.join(d, f) for d, _, names in os.walk(spec) for f in names]
  else:
    files = glob.glob(os.path.expanduser(spec), recursive=True)
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    raise FnscaleError(f"--data={spec!r}: no file, directory or glob match; pass a text file, "
                       "a directory of text files or a glob such as 'corpus/*.txt'")
  return files


def _check_args(files, vocab_size, out_path) -> None:
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
    raise FnscaleError(f"vocab_size={vocab_size!r}: expected an int >= {MIN_VOCAB} (256 bytes "
                       f"+ {END_OF_TEXT}); e.g. 4096")
  if isinstance(files, (str, bytes)) or not files:
    raise FnscaleError(f"files={files!r}: expected a non-empty list of paths; use "
                       "corpus_files(spec) for a directory or glob")
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise FnscaleError(f"corpus file(s) not found: {missing[:3]}; pass existing text files")
  if not isinstance(out_path, (str, os.PathLike)) or os.path.isdir(out_path):
    raise FnscaleError(f"out_path={out_path!r}: expected a file path such as tok/tokenizer.json")


def train_tokenizer(files: list[str], vocab_size: int, out_path: str) -> str:
  """Trains a byte-level BPE with `vocab_size` tokens on `files` and writes it to `out_path`.

  Args:
    files: paths of UTF-8 text files (bytes that are not UTF-8 are read as U+FFFD).
    vocab_size: tokens in the result: 256 bytes, `<|endoftext|>` and the learned merges.
    out_path: where the Hugging Face `tokenizer.json` goes (parent directories are made).

  Returns:
    `out_path`, a file `tokenizers.Tokenizer.from_file` loads.

  Raises:
    FnscaleError: a bad argument, or a corpus too small to learn `vocab_size` tokens.
  """
  _check_args(files, vocab_size, out_path)
  # Imported here: `tokenizers` is an extra, and corpus_files needs none of it.
  from tokenizers import (  # pylint: disable=import-outside-toplevel
      Tokenizer, decoders, models, pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  # add_prefix_space=False keeps decode(encode(text)) == text exactly.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train([os.fspath(f) for f in files], trainer)
  got = tok.get_vocab_size()
  if got != vocab_size:
    raise FnscaleError(f"the corpus ({len(files)} files) gave only {got} tokens, not "
                       f"vocab_size={vocab_size}: pass a smaller --vocab_size or more text")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  tok.save(os.fspath(out_path))
  return os.fspath(out_path)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}; use --data, --vocab_size, --out",
          file=sys.stderr)
    return 2
  try:
    files = corpus_files(flags.FLAGS.data)
    path = train_tokenizer(files, flags.FLAGS.vocab_size, flags.FLAGS.out)
  except FnscaleError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  mb = sum(os.path.getsize(f) for f in files) / 1e6
  print(f"tokenizer: {flags.FLAGS.vocab_size} tokens, byte-level BPE trained on "
        f"{len(files)} files ({mb:.1f} MB) -> {path}")
  return 0


if __name__ == "__main__":
  # Defined here, not at import, so tests and train_lm can import this module.
  flags.DEFINE_string("data", None, "corpus: a text file, directory or glob; default the "
                      "standard library's top-level modules")
  flags.DEFINE_integer("vocab_size", 4096, "tokens in the vocabulary (>= 257)")
  flags.DEFINE_string("out", "tokenizer.json", "where to write the tokenizer.json")
  app.run(main)
