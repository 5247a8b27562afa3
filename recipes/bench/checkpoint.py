"""How long a checkpoint save keeps a training loop waiting: synchronous against async saves.

  python recipes/bench/checkpoint.py                         # 1 GiB and 256 MiB, 8 devices
  python recipes/bench/checkpoint.py --sizes_mib=1024 --rounds=3 --dir=/tmp/ckpt

For each state size: float32 arrays of random values (incompressible, like trained weights)
FSDP-sharded over 8 simulated CPU devices, and a loop of
jitted steps that read and write the whole state (donated, as a train step's). Each round
times, in alternating order, the loop alone and the loop with one save at its first step,
through a synchronous manager (the step is committed when `save` returns) and an async one
(`save` returns once the arrays are in host memory; orbax writes them while the loop runs).
The loop runs long enough to cover a whole save. Printed per size (medians over rounds):

  * save call: how long `fnscale.checkpoint.save` kept the loop (finiteness check, copy off
    the devices; for the synchronous save also the write and commit);
  * loop blocked: the loop's time with the save minus without it (the call, plus what the
    background write takes from the loop: on a CPU it shares the cores);
  * commit: from the call to the step being committed (orbax's start-to-commit time).

Last column: a step's time with `fnscale.checkpoint.all_finite` of the new state fused into it
(what `train_lm` adds to each step) over the same step without, for a step that only streams
the state: the flag's worst case. The warm-up round (first save of each manager, compiles) is
not counted. Directories are
created under --dir (default: a temporary directory) and deleted at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time


import fnscale as fs
from recipes.lm import cli

LEAVES = 8  # the state is this many equal arrays [rows, 4096] float32


def _state(size_mib: int, mesh):
  """`LEAVES` float32 arrays of `size_mib` MiB in all, sharded over every device, and a
  jitted step that rewrites each (donating the state)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  rows = size_mib * 2**20 // (4 * 4096 * LEAVES)
  sharding = NamedSharding(mesh, P("fsdp"))
  # Random values: a constant array would compress to nothing and make writes look free.
  keys = jax.random.split(jax.random.key(0), LEAVES)
  make = jax.jit(lambda: {f"w{i}": jax.random.normal(keys[i], (rows, 4096), jnp.float32)
                          for i in range(LEAVES)}, out_shardings=sharding)
  # A sign flip keeps the values random (x * 0.5 + 1 would converge to a constant).
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * -1.0, s), donate_argnums=0)
  return make(), step


def _flag_cost(state, steps: int, rounds: int):
  """(state, median step time with `all_finite` of the new state fused into the step / without):
  what train_lm's finiteness flag costs a step that only streams the state (its worst case)."""
  import jax
  plain = jax.jit(lambda s: jax.tree.map(lambda x: x * -1.0, s), donate_argnums=0)
  flagged = jax.jit(lambda s: (lambda n: (n, fs.checkpoint.all_finite(n)))(plain(s)),
                    donate_argnums=0)
  state = plain(state)
  state, _ = flagged(state)  # compiled outside the timings
  ratios = []
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
      state = jax.block_until_ready(plain(state))
    base = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
      state, ok = jax.block_until_ready(flagged(state))
    ratios.append((time.perf_counter() - t) / base)
  return state, statistics.median(ratios)


def _loop(state, step, steps: int, ckpt=None, at: int = 0):
  """Runs `steps` steps (one save at step `at` through `ckpt`); returns (state, loop s,
  save call s, commit s)."""
  import jax
  t0 = time.perf_counter()
  call = commit = 0.0
  for i in range(steps):
    if ckpt is not None and i == 0:
      t = time.perf_counter()
      fs.checkpoint.save(ckpt, at, state)
      call = time.perf_counter() - t
    state = jax.block_until_ready(step(state))
  loop = time.perf_counter() - t0
  if ckpt is not None:
    fs.checkpoint.wait(ckpt)
    commit = fs.checkpoint.last_save_seconds(ckpt)[1]
  return state, loop, call, commit


def _measure(size_mib: int, rounds: int, root: str, mesh) -> dict:
  state, step = _state(size_mib, mesh)
  fs.checkpoint.nonfinite_leaves(state)  # compiled outside the timings
  managers = {mode: fs.checkpoint.manager(os.path.join(root, f"{size_mib}-{mode}"), keep=1,
                                          async_save=mode == "async")
              for mode in ("sync", "async")}
  got = {k: [] for k in ("base", "sync_loop", "sync_call", "async_loop", "async_call",
                         "async_commit")}
  try:
    state, one_step, _, _ = _loop(state, step, 1)  # warm-up: compiles, first saves
    state, _, _, sync_commit = _loop(state, step, 1, managers["sync"], at=0)
    state, _, _, _ = _loop(state, step, 1, managers["async"], at=0)
    steps = max(3, int(2 * sync_commit / one_step) + 1)  # the loop outlasts a whole save
    for r in range(1, rounds + 1):
      for arm in ("base", "sync", "async") if r % 2 else ("async", "sync", "base"):
        state, loop, call, commit = _loop(state, step, steps, managers.get(arm), at=r)
        got["base" if arm == "base" else f"{arm}_loop"].append(loop)
        if arm != "base":
          got[f"{arm}_call"].append(call)
        if arm == "async":
          got["async_commit"].append(commit)
    state, flag_ratio = _flag_cost(state, steps, rounds)
  finally:
    for m in managers.values():
      fs.checkpoint.close(m)
  med = {k: statistics.median(v) for k, v in got.items()}
  return dict(size_mib=size_mib, steps=steps, step_s=med["base"] / steps,
              sync_blocked_s=med["sync_loop"] - med["base"], sync_call_s=med["sync_call"],
              async_call_s=med["async_call"], async_blocked_s=med["async_loop"] - med["base"],
              async_commit_s=med["async_commit"], finite_flag_step_ratio=flag_ratio)


def _table(rows: list[dict]) -> str:
  lines = ["state      steps  sync: save call  loop blocked | async: save call  loop blocked"
           "  commit | call ratio  blocked ratio | step with finite flag"]
  for r in rows:
    lines.append(
        f"{r['size_mib']:>5} MiB  {r['steps']:>5}  {r['sync_call_s']:>13.2f} s "
        f"{r['sync_blocked_s']:>11.2f} s | {r['async_call_s']:>14.2f} s "
        f"{r['async_blocked_s']:>11.2f} s {r['async_commit_s']:>5.1f} s | "
        f"{r['async_call_s'] / r['sync_call_s']:>9.1%}  "
        f"{r['async_blocked_s'] / r['sync_blocked_s']:>12.1%} | "
        f"{r['finite_flag_step_ratio']:>9.3f} x")
  return "\n".join(lines)


def _sizes(text: str) -> list[int]:
  try:
    sizes = [int(s) for s in text.split(",")]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise fs.InputError(f"--sizes_mib={text!r}: expected positive ints, comma-separated")
  return sizes


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes_mib", default="1024,256", help="state sizes, MiB, comma-separated")
  p.add_argument("--rounds", type=cli.number(int, minimum=1), default=3)
  p.add_argument("--devices", type=cli.number(int, minimum=1), default=8)
  p.add_argument("--dir", default="", help="where checkpoints go (default: a temp directory)")
  args = p.parse_args(argv)
  sizes = _sizes(args.sizes_mib)
  fs.simulate_cpu_devices(args.devices)
  mesh = fs.make_mesh({"fsdp": -1})
  root = tempfile.mkdtemp(prefix="fnscale-bench-ckpt-", dir=args.dir or None)
  try:
    rows = []
    for size in sizes:
      rows.append(_measure(size, args.rounds, root, mesh))
      print(json.dumps(rows[-1]), flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f"{mesh.devices.size} devices, load average {os.getloadavg()[0]:.1f}; medians of "
        f"{args.rounds} rounds\n" + _table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
