"""What fnscale's multi-host checks cost: the preemption check per step, the start-up and
compiled-step agreement.

  python recipes/bench/preemption.py                       # 1 process, 8 simulated devices
  python recipes/launch/launch_local.py --num_processes=2 --devices_per_process=4 -- \\
      recipes/bench/preemption.py                          # 2 processes (JAX's sync point)

A small MLP train step (`shard_step(train_step(...))`, FSDP over every device) runs `--rounds`
rounds; each round times `--steps` steps with `should_stop(step)` after every step and
`--steps` steps without, in alternating order (A B, B A, ...), each step ending in
`float(loss)` as a training loop's logging would. Printed: the median per-step time of each
arm and the median of the per-round ratios (with / without), and the per-call time of
`should_stop` alone. `fnscale.initialize` and `fnscale.multihost.agree_on_step` log the
time their agreement checks took ("check: X ms of work, Y ms waiting for the others") on stderr.
"""
from __future__ import annotations

import statistics
import sys
import time


import fnscale as fs
from recipes.lm import cli


def _model(width: int):
  import jax
  import jax.numpy as jnp

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (width, 4 * width)) / width**0.5,
            "w2": jax.random.normal(k2, (4 * width, width)) / (4 * width)**0.5}

  def loss(p, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["x"]) ** 2)
  return init, loss


def _rounds(step, state, batch, args, should_stop):
  """Times `args.rounds` rounds of `args.steps` steps with and without `should_stop`, in
  alternating order: ({True: per-step times with, False: without}, per-round ratios, the
  step count), or None where a preemption stopped the run."""
  times = {True: [], False: []}
  ratios = []
  counter = 0
  for r in range(args.rounds):
    per = {}
    for check in ((True, False) if r % 2 == 0 else (False, True)):
      t0 = time.perf_counter()
      for _ in range(args.steps):
        state, metrics = step(state, batch)
        float(metrics["loss"])
        if check and should_stop(counter):
          return None
        counter += 1  # the same step indices on every process, in both arms
      per[check] = (time.perf_counter() - t0) / args.steps
      times[check].append(per[check])
    ratios.append(per[True] / per[False])
  return times, ratios, counter


def _call_us(should_stop, first: int, n: int = 2000) -> float:
  """Microseconds per call of `should_stop` alone, over `n` step indices from `first`."""
  t0 = time.perf_counter()
  for i in range(first, first + n):
    should_stop(i)
  return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--width", type=cli.number(int, minimum=1), default=256)
  ap.add_argument("--batch", type=cli.number(int, minimum=1), default=256)
  ap.add_argument("--steps", type=cli.number(int, minimum=1), default=50)
  ap.add_argument("--rounds", type=cli.number(int, minimum=1), default=8)
  args = ap.parse_args(argv)
  from absl import logging
  logging.set_verbosity(logging.INFO)
  info = fs.initialize(config=vars(args))
  if not info.initialized:
    fs.simulate_cpu_devices(8)
  import jax
  import numpy as np
  import optax
  init, loss = _model(args.width)
  mesh = fs.make_mesh({"fsdp": jax.device_count()})
  opt = optax.sgd(1e-3)
  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss, opt), mesh)
  rows = args.batch // jax.process_count()
  x = np.random.default_rng(jax.process_index()).normal(size=(rows, args.width))
  batch = fs.global_batch({"x": x.astype(np.float32)}, fs.batch_sharding(mesh))
  step = step.compile(state, batch)  # compile once, then check every process compiled it
  fs.multihost.agree_on_step(step)
  with fs.multihost.preemption_guard() as should_stop:
    timed = _rounds(step, state, batch, args, should_stop)
    if timed is None:
      return fs.multihost.EXIT_PREEMPTED
    times, ratios, counter = timed
    call_us = _call_us(should_stop, counter)
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices, "
          f"{args.rounds} rounds x {args.steps} steps: step with should_stop "
          f"{statistics.median(times[True]) * 1e3:.2f} ms, without "
          f"{statistics.median(times[False]) * 1e3:.2f} ms (medians); ratio with/without "
          f"median {statistics.median(ratios):.4f} (per round {min(ratios):.3f}.."
          f"{max(ratios):.3f}); should_stop alone {call_us:.2f} us per call")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
