"""The unigram and bigram levels of a corpus: what a language model trained on it must beat.

  python recipes/baseline.py                          # stdlib, bytes
  python recipes/baseline.py --dataset=tiny_corpus
  python recipes/baseline.py --dataset=DIR --tokenizer=runs/tok/tokenizer.json

Splits and tokenizes the corpus exactly as `train_lm.py` does (`data.load`), fits add-one
smoothed unigram and bigram counts on the training split and prints their mean loss on the
held-out split in nats per token (`train_lm`'s eval loss) and bits per byte.
"""
from __future__ import annotations

import math
import sys

from absl import flags

from fnscale.errors import FnscaleError
from recipes.lm import cli, data
from recipes.lm.options import CORPORA

def describe(dataset: str, tokenizer: str = "") -> str:
  """The corpus and its two baselines as lines of text. Raises FnscaleError on a bad corpus."""
  corpus = data.load(dataset, tokenizer)
  b = data.baseline(corpus)
  bpb = lambda nats: nats * corpus.tokens_per_byte / math.log(2)
  return (f"{corpus.describe}\n"
          f"held out: {len(corpus.eval):,} tokens; fitted on {len(corpus.train):,} training "
          "tokens, add-one smoothed\n"
          f"unigram: {b.unigram:.4f} nats/token, {bpb(b.unigram):.4f} bits/byte\n"
          f"bigram:  {b.bigram:.4f} nats/token, {bpb(b.bigram):.4f} bits/byte")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}; flags are written --name=value",
          file=sys.stderr)
    return 2
  try:
    print(describe(flags.FLAGS.dataset, flags.FLAGS.tokenizer))
  except FnscaleError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  flags.DEFINE_string("dataset", "stdlib", f"corpus: {list(CORPORA)}, a file, directory "
                      "or glob (as train_lm's --dataset)")
  flags.DEFINE_string("tokenizer", "", "a Hugging Face tokenizer.json; default: bytes (as "
                      "train_lm's --tokenizer)")
  sys.exit(cli.absl_run(main))
