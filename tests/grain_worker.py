"""One process of a job that reads recipes/lm/data.py's batches through grain and checkpoints its
data position with fnscale.checkpoint, as tests/test_checkpoint_jobs.py runs it.

  python tests/grain_worker.py --ckpt=DIR --mode=stop --advance=3,5
  python tests/grain_worker.py --ckpt=DIR --mode=resume

Joins the job from the environment `tests/multiprocess.py` sets (or runs alone), builds a
mesh over every device of the job and a grain iterator over this process's rows of each global
batch (`batches.text_batches`, 16 rows of 16 tokens of a fixed random corpus).

stop: process i reads advance[i] batches, saves step 1 (a small sharded state, and its own
position through grain's orbax handler) and prints {"saved": its position, "next": the batch
it would read next}. resume: restores the newest step onto this job's mesh with `data=`
(`batches.resharded_position` when the process count changed) and prints {"restored": its
position, "next": the batch it reads next, "x": the restored state}.
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

GLOBAL_BATCH, SEQ = 16, 16


def main(argv) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--ckpt", required=True)
  p.add_argument("--mode", choices=("stop", "resume"), required=True)
  p.add_argument("--advance", default="3", help="batches each process reads, by process id")
  args = p.parse_args(argv)
  multiprocess.initialize_from_env(timeout_s=60)
  import jax
  from jax.experimental import multihost_utils
  import jax.numpy as jnp
  import numpy as np
  import fnscale as fs
  from recipes.lm import batches, data
  rng = np.random.default_rng(0)
  corpus = data.Corpus(rng.integers(0, 256, 20000).astype(np.uint8),
                       rng.integers(0, 256, 700).astype(np.uint8), 256, 1.0, None, None, "")
  mesh = fs.make_mesh({"data": -1})
  train, _ = batches.text_batches(corpus, fs.batch_sharding(mesh), SEQ, GLOBAL_BATCH, 0, 0)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  state = {"x": jax.jit(lambda: jnp.arange(16.0), out_shardings=sharding)()}
  pid = jax.process_index()
  with fs.checkpoint.manager(args.ckpt) as ckpt:
    if args.mode == "stop":
      for _ in range(int(args.advance.split(",")[pid])):
        next(train)
      fs.checkpoint.save(ckpt, 1, state, data=train)
      out = {"saved": train.get_state()}
    else:
      restored, _ = fs.checkpoint.restore(ckpt, state, data=train,
                                          reshard_data=batches.resharded_position)
      out = {"restored": train.get_state(),
             "x": np.asarray(multihost_utils.process_allgather(restored["x"],
                                                               tiled=True)).tolist()}
  out["next"] = next(train)["inputs"].tolist()
  print(json.dumps({"process": pid, **out}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
