"""The data loader alone against the main job's consumption: is the loader ever the bottleneck?

  python recipes/bench/loader.py [--corpus=tiny_corpus] [--batches=60] [--steps=30]

1. A token cache of the corpus (bytes, as train_lm's default; `recipes/pretokenize.py`), made
   in a temporary directory.
2. The loader alone: one process reading every row of the default CPU main job's global batch
   (64 rows x 64 tokens, first-fit packing; `recipes/lm/packing.py`) from the cache, one batch
   after another in one thread; tokens/s from the median batch time (after 5 batches of
   warm-up). This process is one host, so the figure is tokens/s per host.
3. The default CPU main job (tiny_gpt2, seq 64, 8 rows per device on 8 simulated devices) on
   the same cache: its whole-run tokens/s (`train_lm`'s summary: every timed step).
Prints both and their ratio (loader / consumption: above 1, the loader keeps up). On a busy
machine both figures drop; the ratio is what to read.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

from recipes import train_lm
from recipes.lm import cache, cli, data, packing

# 8 simulated CPU devices: read when jax's backend starts (first device use), not at import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROWS, SEQ = 64, 64  # the default CPU main job's global batch: 8 rows x 8 devices, seq 64


def loader_tokens_per_s(path: str, batches: int) -> tuple[float, float]:
  """(tokens/s from the median batch time, padding fraction) of the loader alone."""
  sources, _ = packing.open_mixture(path, "")
  it = packing.batches(sources, np.arange(ROWS), ROWS, packing.PackSpec(SEQ), seed=0)
  for _ in range(5):
    next(it)
  times, pad = [], []
  for _ in range(batches):
    t = time.perf_counter()
    b = next(it)
    times.append(time.perf_counter() - t)
    pad.append(packing.padding_fraction(b))
  return ROWS * SEQ / statistics.median(times), float(np.mean(pad))


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--corpus", default="tiny_corpus")
  p.add_argument("--batches", type=cli.number(int, minimum=1), default=60)
  p.add_argument("--steps", type=cli.number(int, minimum=1), default=30)
  args = p.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "cache")
    cache.build(cache.BuildSpec(tuple(data.corpus_files(args.corpus)), path, workers=2,
                                shard_bytes=256 << 10), say=lambda *a: None)
    loader, pad = loader_tokens_per_s(path, args.batches)
    print(f"loader alone: {loader:,.0f} tokens/s per host (median of {args.batches} batches of "
          f"{ROWS} x {SEQ}, one thread; {pad:.1%} padding)", flush=True)
    summary = train_lm.train_lm(dataset=path, steps=args.steps, run_dir=os.path.join(tmp, "r"),
                                checkpoint=False, sample_len=0, eval_every=10**6)
  used = summary.tokens_per_s
  print(f"main job (tiny_gpt2, {summary.global_batch} x {summary.seq}, {summary.devices} "
        f"devices) consumes {used:,.0f} tokens/s")
  print(f"ratio loader / consumption: {loader / used:.1f}x")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
