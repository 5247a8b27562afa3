"""Tokenizes text, JSONL or Parquet sources once into a token cache that train_lm reads.

  python recipes/pretokenize.py --sources=tiny_corpus --out=/tmp/cache/code     # bytes
  python recipes/pretokenize.py --sources='web/*.jsonl,gs://bucket/more' \\
      --tokenizer=tok/tokenizer.json --out=/tmp/cache/web --workers=8
  python recipes/pretokenize.py --sources=chats.jsonl --chat --tokenizer=HF_DIR --out=/tmp/sft
  python recipes/train_lm.py --dataset=/tmp/cache/web:0.7,/tmp/cache/code:0.3

Sources: files, directories or globs, comma-separated, local or gs:// (etils' epath over
fsspec); "tiny_corpus" and "stdlib" name train_lm's bundled corpora. A text file is one
document, a JSONL line or Parquet row one document (its --field, default "text"; with --chat
"messages", rendered with the tokenizer's chat template, loss weight 1 on assistant turns).
Shards are tokenized in --workers processes; rerun the same command after a crash or a kill
and only the missing shards are tokenized. Output: ArrayRecord shards and manifest.json
(`recipes/lm/cache.py`). Exit status 0 done, 2 bad input (one `error:` line).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import NamedTuple

import fnscale as fs
from recipes.lm import cache, cli, data
from recipes.lm.options import CORPORA


@dataclasses.dataclass(frozen=True)
class Options:
  """The command's flags."""
  sources: str = cli.option("tiny_corpus", "comma-separated files, directories or globs (local "
                          "or gs://), or 'tiny_corpus' / 'stdlib'")
  out: str = cli.option("", "the cache directory to write (local)")
  tokenizer: str = cli.option("bytes", "'bytes', a Hugging Face tokenizer.json, or a directory "
                            "holding one (a Hugging Face checkpoint)")
  chat: bool = cli.option(False, "records are conversations (`messages`): chat template, "
                        "loss on assistant turns only")
  chat_template: str = cli.option("", "a Jinja chat template file (default: the tokenizer's)")
  field: str = cli.option("", "record field of the documents; default 'text' ('messages' "
                        "with --chat)")
  workers: int = cli.option(max(1, (os.cpu_count() or 1)), "tokenizing processes")
  shard_mb: float = cli.option(64.0, "source megabytes per shard")


def spec(o: Options) -> cache.BuildSpec:
  """The build of options `o`. Raises InputError on a bad value."""
  if not o.out:
    raise fs.InputError("--out is required: the directory the cache goes to")
  if o.shard_mb <= 0:
    raise fs.InputError(f"--shard_mb={o.shard_mb}: expected > 0")
  sources = []
  for s in filter(None, (x.strip() for x in o.sources.split(","))):
    sources += data.corpus_files(s) if s in CORPORA else [s]
  if not sources:
    raise fs.InputError(f"--sources={o.sources!r}: no source named")
  return cache.BuildSpec(tuple(sources), o.out, o.tokenizer, o.chat, o.chat_template,
                         o.field, o.workers, int(o.shard_mb * (1 << 20)))


class Done(NamedTuple):
  """What `run` returns to `cli.options_main`: the manifest (never stopped by a signal)."""
  manifest: dict
  stopped: str | None = None


def run(o: Options) -> Done:
  """Builds the cache of options `o` and prints what it holds and this run's speed."""
  manifest = cache.build(spec(o))
  r = manifest["run"]
  rate = (f", {r['tokens'] / r['seconds']:,.0f} tokens/s with {cache.processes(r['workers'])}"
          if r["seconds"] > 0 and r["tokens"] else "")
  print(f"cache: {manifest['docs']} documents, {manifest['tokens']} tokens "
        f"({manifest['loss_tokens']} with loss weight) in {len(manifest['shards'])} shards, "
        f"tokenizer {manifest['tokenizer']['name']} (vocab {manifest['tokenizer']['vocab']}); "
        f"this run: {r['shards']} shards, {r['tokens']} tokens in {r['seconds']:.1f} s{rate}")
  return Done(manifest)


def main(argv: list[str]) -> int:
  """The command line (exit status 0 done, 2 bad input: one `error:` line)."""
  return cli.options_main(argv, Options, run, __doc__)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
