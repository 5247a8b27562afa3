"""What `fnscale.global_batch`'s replica check costs per call, checked and not.

  python recipes/launch/launch_local.py --num_processes=2 --devices_per_process=4 -- \\
      recipes/bench/replica_check.py                       # 2 processes: the exchange
  python recipes/bench/replica_check.py                    # 1 process: nothing to compare

A token batch of `--rows` x `--seq` int32 (train_lm's shape: 16 x 1024 by default) is
built with `global_batch` on two meshes over every device: `tensor=N`, which replicates the
batch across processes (every block is compared: a sha256 of this process's copy and one
round trip through JAX's coordination service), and `data=N`, which splits it (nothing held
by two processes: no exchange). `--rounds` rounds each time `--calls` calls with
`check=True`, with `check=False` and with the default (`check=None`: the layout checked
once already, then every `check_every`-th call, 100), in rotating order. Printed per mesh:
the median per-call time of each arm and the check's cost (checked - unchecked) and the
default's (default - unchecked).
"""
from __future__ import annotations

import statistics
import sys
import time

import fnscale as fs
from recipes.lm import cli


def _arm(rows, sharding, check: bool | None, calls: int) -> float:
  """Seconds per `global_batch` call, the global array made ready each time."""
  t0 = time.perf_counter()
  for _ in range(calls):
    fs.global_batch({"tokens": rows}, sharding, check=check)["tokens"].block_until_ready()
  return (time.perf_counter() - t0) / calls


ARMS = (True, False, None)  # checked, unchecked, the default


def measure(axis: str, args) -> dict:
  """Median seconds per call of each arm on a mesh of one `axis` over every device."""
  import jax
  import numpy as np
  sharding = fs.batch_sharding(fs.make_mesh({axis: jax.device_count()}))
  whole = np.random.default_rng(0).integers(0, 50_000, (args.rows, args.seq), np.int32)
  rows = whole[fs.process_rows(sharding, args.rows)]
  times = {arm: [] for arm in ARMS}
  for r in range(args.rounds):
    for arm in ARMS[r % 3:] + ARMS[:r % 3]:
      times[arm].append(_arm(rows, sharding, arm, args.calls))
  return {arm: statistics.median(t) for arm, t in times.items()}


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=cli.number(int, minimum=1), default=16)
  ap.add_argument("--seq", type=cli.number(int, minimum=1), default=1024)
  ap.add_argument("--calls", type=cli.number(int, minimum=1), default=100)
  ap.add_argument("--rounds", type=cli.number(int, minimum=1), default=9)
  args = ap.parse_args(argv)
  info = fs.initialize(config=vars(args))
  if not info.initialized:
    fs.simulate_cpu_devices(8)
  import jax
  lines = []
  for axis, what in (("tensor", "replicated across processes"), ("data", "split")):
    t = measure(axis, args)
    lines.append(f"{axis}={jax.device_count()} ({what}), ms per call (medians): checked "
                 f"{t[True] * 1e3:.3f}, unchecked {t[False] * 1e3:.3f}, default "
                 f"{t[None] * 1e3:.3f}; a check costs {(t[True] - t[False]) * 1e3:.3f} ms, "
                 f"the default {(t[None] - t[False]) * 1e3:.3f} ms per call")
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices, batch "
          f"{args.rows} x {args.seq} int32, {args.rounds} rounds x {args.calls} calls")
    print("\n".join(lines), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
