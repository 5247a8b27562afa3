"""Trains a byte-level BPE tokenizer offline and writes a Hugging Face `tokenizer.json`.

  python recipes/train_tokenizer.py --out=/tmp/tok/tokenizer.json     # tiny_corpus, 4096
  python recipes/train_tokenizer.py --data='corpus/*.txt' --vocab_size=8192 --out=tok.json
  python recipes/train_lm.py --tokenizer=/tmp/tok/tokenizer.json

Byte-level BPE as GPT-2 uses it (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners", sec. 2.2): the base alphabet is the 256 byte values, so any text encodes
and decodes back exactly with no unknown token, and merges of frequent pairs are learned on
the corpus. The `tokenizers` library does the training; this file picks the files and checks
the result. The corpus is named as train_lm's --dataset is (`recipes.lm.data.corpus_files`:
'tiny_corpus', 'stdlib', a file, directory or glob); the default, 'tiny_corpus' (about 1 MB
of standard-library modules), is on every machine, no download.
"""
from __future__ import annotations

import os
import sys

from absl import flags

from fnscale import FnscaleError, InputError
from recipes.lm.data import corpus_files, text_files  # noqa: F401  (one definition)
from recipes.lm import cli

END_OF_TEXT = "<|endoftext|>"  # the one special token: separates documents
MIN_VOCAB = 256 + 1  # every byte, plus END_OF_TEXT


def _check_args(files, vocab_size, out_path) -> None:
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
    raise InputError(f"vocab_size={vocab_size!r}: expected an int >= {MIN_VOCAB} (256 bytes "
                       f"+ {END_OF_TEXT}); e.g. 4096")
  if isinstance(files, (str, bytes)) or not files:
    raise InputError(f"files={files!r}: expected a non-empty list of paths; use "
                       "corpus_files(spec) for a directory or glob")
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise InputError(f"corpus file(s) not found: {missing[:3]}; pass existing text files")
  if (not isinstance(out_path, (str, os.PathLike)) or os.path.isdir(out_path)
      or os.fspath(out_path).endswith(("/", os.sep))):
    raise InputError(f"out_path={out_path!r}: expected a file path such as tok/tokenizer.json")


def _text(path) -> str:
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def train_tokenizer(files: list[str], vocab_size: int, out_path: str) -> str:
  """Trains a byte-level BPE with `vocab_size` tokens on `files` and writes it to `out_path`.

  Args:
    files: paths of UTF-8 text files (bytes that are not UTF-8 are read as U+FFFD).
    vocab_size: tokens in the result: 256 bytes, `<|endoftext|>` and the learned merges.
    out_path: where the Hugging Face `tokenizer.json` goes (parent directories are made).

  Returns:
    `out_path`, a file `tokenizers.Tokenizer.from_file` loads.

  Raises:
    InputError: a bad argument, or a corpus too small to learn `vocab_size` tokens.
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
  # Read here, not by tok.train (which stops at the first byte that isn't UTF-8, as a
  # standard library's test data holds): bytes are decoded as train_lm decodes them.
  tok.train_from_iterator((_text(f) for f in files), trainer)
  got = tok.get_vocab_size()
  if got != vocab_size:
    raise InputError(f"the corpus ({len(files)} files) gave only {got} tokens, not "
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
    files = text_files(flags.FLAGS.data)
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
  flags.DEFINE_string("data", "tiny_corpus", "corpus: 'tiny_corpus', 'stdlib', a text "
                      "file, directory or glob (as train_lm's --dataset)")
  flags.DEFINE_integer("vocab_size", 4096, "tokens in the vocabulary (>= 257)")
  flags.DEFINE_string("out", "tokenizer.json", "where to write the tokenizer.json")
  sys.exit(cli.absl_run(main))
