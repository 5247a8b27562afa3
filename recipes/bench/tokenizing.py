"""Tokenizing speed of `recipes/pretokenize.py`: tokens/s per core on the bundled corpus.

  python recipes/bench/tokenizing.py [--corpus=tiny_corpus] [--vocab_size=4096]

Trains a byte-level BPE tokenizer on the corpus (`recipes/train_tokenizer.py`), then builds a
token cache of the corpus with it in 1 process and in 2 processes (shards of 64 KiB so both
get work), and with the byte tokenizer in 1 process; prints tokens/s and tokens/s per process
(each process uses one core: TOKENIZERS_PARALLELISM=false) for each. Process start-up and
shard writing are included: the command's own speed, not the tokenizer's alone.
"""
from __future__ import annotations

import os
import sys
import tempfile

from recipes import train_tokenizer
from recipes.lm import cache, cli, data


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--corpus", default="tiny_corpus")
  p.add_argument("--vocab_size", type=int, default=4096)
  args = p.parse_args(argv)
  files = data.corpus_files(args.corpus)
  mb = sum(os.path.getsize(f) for f in files) / 1e6
  with tempfile.TemporaryDirectory() as tmp:
    tok = train_tokenizer.train_tokenizer(files, args.vocab_size, os.path.join(tmp, "tok.json"))
    print(f"corpus {args.corpus}: {len(files)} files, {mb:.2f} MB", flush=True)
    for name, spec, workers in (("bpe", tok, 1), ("bpe", tok, 2), ("bytes", "bytes", 1)):
      m = cache.build(cache.BuildSpec(tuple(files), os.path.join(tmp, f"{name}{workers}"), spec,
                                      workers=workers, shard_bytes=64 << 10),
                      say=lambda *a: None)
      run = m["run"]
      rate = run["tokens"] / run["seconds"]
      print(f"{name:5s} (vocab {m['tokenizer']['vocab']}), {workers} process(es): "
            f"{run['tokens']:,} tokens in {run['seconds']:.2f} s = {rate:,.0f} tokens/s, "
            f"{rate / workers:,.0f} tokens/s per core", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
