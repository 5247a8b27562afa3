#!/usr/bin/env python3
"""Reads every XLA dump file under a directory with `fnscale.analysis.hlo.summarize` and lists what it
could not read. Exit status 1 if anything was unread.

  XLA_FLAGS=--xla_dump_to=/tmp/hlo python -m pytest -q tests/test_step.py ...
  .ci/hlo_unread.py /tmp/hlo

Every program the tests compile (CPU, and TPU ahead of time) lands in the dump directory as
`*after_optimizations.txt`; a module listed here has an HLO form the reader lacks.
"""
import collections
import pathlib
import sys

from fnscale.analysis import hlo


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(__doc__)
    return 2
  files = sorted(pathlib.Path(argv[1]).rglob("*after_optimizations.txt"))
  unread, kernels = 0, collections.Counter()
  for f in files:
    s = hlo.summarize(f.read_text(encoding="utf-8", errors="replace"))
    kernels.update(k.name for k in s.kernels)
    if s.unread.count:
      unread += 1
      print(f"{f}: {s.unread}")
  print(f"{len(files)} modules, {unread} with unread items; custom kernels listed: "
        + (", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())) or "none"))
  return 1 if unread or not files else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
