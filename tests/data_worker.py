"""One process of a job that reads packed global batches from a token cache, as
tests/test_packing.py runs it (2 processes x 4 CPU devices).

  python tests/data_worker.py --cache=DIR --mesh=data=2,fsdp=4 --steps=3 [--ckpt=DIR
      --stop_after=2 | --ckpt=DIR --resume]

Each process reads only the rows its devices hold (`fnscale.process_rows`) through
`recipes/lm/packing.py`, builds the global batch (`fnscale.global_batch`) and gathers it back
whole; process 0 prints each step's whole batch as one JSON line. --stop_after saves the data
position (and a small sharded state) at that step and exits; --resume restores it first
(`packing.resharded_position` when the process count changed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess  # tests/multiprocess.py: the job's place in the environment

ROWS, SEQ = 8, 32


def main(argv) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--cache", required=True)
  p.add_argument("--mesh", default="data=2,fsdp=4")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--ckpt", default="")
  p.add_argument("--stop_after", type=int, default=0)
  p.add_argument("--resume", action="store_true")
  args = p.parse_args(argv)
  multiprocess.initialize_from_env(timeout_s=60)
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  import numpy as np
  import fnscale as fs
  from recipes.lm import packing
  mesh = fs.make_mesh(fs.parse_axes(args.mesh, what="--mesh"))
  bsh = fs.batch_sharding(mesh)
  sources, _ = packing.open_mixture(args.cache, "")
  it = packing.batches(sources, fs.process_rows(bsh, ROWS), ROWS, packing.PackSpec(SEQ), 0)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"x": jax.jit(lambda: jnp.arange(4.0), out_shardings=sharding)()}
  start = 0
  with fs.checkpoint.manager(args.ckpt) if args.ckpt else _null() as ckpt:
    if args.resume:
      _, extra = fs.checkpoint.restore(ckpt, state, data=it,
                                       reshard_data=packing.resharded_position)
      start = extra["step"]
    for step in range(start, args.steps):
      if args.stop_after and step == args.stop_after:
        fs.checkpoint.save(ckpt, step, state, data=it, extra={"step": step})
        break
      batch = fs.global_batch(next(it), bsh)
      whole = multihost_utils.process_allgather(batch, tiled=True)
      if jax.process_index() == 0:
        print(json.dumps({"step": step, **{k: np.asarray(v).tolist() for k, v in
                                           whole.items()}}), flush=True)
  return 0


def _null():
  import contextlib
  return contextlib.nullcontext()


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
