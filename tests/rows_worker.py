"""One process of a job that feeds global batches on several meshes, as tests/test_rows.py
runs it (2 processes x 4 CPU devices).

  python tests/rows_worker.py

For each mesh of MESHES: the rows `fnscale.process_rows` names for a 16-row batch, the global
batch built from exactly those rows of one fixed array (`fnscale.global_batch(..., check=True)`:
the replicated blocks' fingerprints are compared across processes), and that global array
gathered back. Then the batch split per process (process i's i-th half, as grain's
`ShardByJaxProcess` does) on a mesh that replicates the batch across processes, with the
default check (a layout not fed before is checked): it must raise. Then, on a new layout
checked with the right rows, each process feeds the batch rolled by its own offset (same
shape, other rows) with `check_every=4` until the check raises. Prints one JSON line per
case.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess  # tests/multiprocess.py: the job's place in the environment

ROWS = 16
MESHES = ({"data": 2, "tensor": 4}, {"tensor": 8}, {"fsdp": 8}, {"tensor": 4, "data": 2})


def main() -> int:
  multiprocess.initialize_from_env(timeout_s=60)
  import jax
  from jax.experimental import multihost_utils
  import numpy as np
  import fnscale as fs
  whole = np.arange(ROWS * 3, dtype=np.int32).reshape(ROWS, 3)
  for axes in MESHES:
    sh = fs.batch_sharding(fs.make_mesh(axes))
    rows = fs.process_rows(sh, ROWS)
    batch = fs.global_batch({"x": whole[rows]}, sh, check=True)
    back = multihost_utils.process_allgather(batch["x"], tiled=True)
    print(json.dumps({"mesh": axes, "rows": rows.tolist(), "shape": list(batch["x"].shape),
                      "equal": bool(np.array_equal(np.asarray(back), whole))}), flush=True)
  sh = fs.batch_sharding(fs.make_mesh({"tensor": 8}))
  i, n = jax.process_index(), jax.process_count()
  try:
    fs.global_batch({"x": whole[i * ROWS // n:(i + 1) * ROWS // n]}, sh)
    print(json.dumps({"halves": "no error"}), flush=True)
  except fs.DistributedError as e:
    print(json.dumps({"halves": str(e)}), flush=True)
  wide = np.arange(ROWS * 5, dtype=np.int32).reshape(ROWS, 5)  # a layout not fed before
  fs.global_batch({"x": wide}, sh, check_every=4)  # checked: right rows
  rolled = np.roll(wide, i * ROWS // n, axis=0)
  for calls in range(1, 9):
    try:
      fs.global_batch({"x": rolled}, sh, check_every=4)
    except fs.DistributedError as e:
      print(json.dumps({"rolled": calls, "error": str(e)}), flush=True)
      break
  else:
    print(json.dumps({"rolled": 8, "error": None}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
