"""The progress line and the clock: each line's loss, lr, tokens/s, MFU and ETA (`progress`),
timed by the loop's `Clock` (the first step, evals and saves left out), over the MFU
denominator of the hardware (`peak_flops`). `r` is train_lm's `run_setup.Run`."""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

import fnscale as fs
from recipes.lm import finetune, run_log


class Peak(NamedTuple):
  """The MFU denominator: the FLOP/s of all devices together (None: unknown), and a line
  saying what it is."""
  flops: float | None
  about: str


def peak_flops(topo) -> Peak:
  """The MFU denominator of the hardware `topo` (on CPU: the measured matmul peak of each
  host the job's processes run on, counted once per host: processes on one machine, as
  launch_local.py starts them, share its cores). Every process calls it (on CPU with several
  processes, a collective)."""
  if topo.platform == "cpu":  # measured once per machine (in CPU seconds: load can't lower it)
    host = fs.analysis.host_matmul_peak()
    peak, hosts = hosts_peak(host.flops)
    kept = f"cached in {host.path}; delete it to measure again" if host.path else "not cached"
    return Peak(peak, f"CPU matmul peak {peak / 1e9:.0f} GFLOP/s, measured "
                f"{'now' if host.fresh else host.measured} (the best of 3 x 10 runs, per "
                f"CPU-second x {fs.analysis.usable_cores()} cores: other jobs on the machine lower "
                f"the MFU, not the peak{_load_average()}; {kept}), shared by all "
                f"{jax.device_count()} simulated devices ("
                + ("one host's cores" if hosts == 1 else f"{hosts} hosts' cores")
                + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")
                + ")")
  if topo.peak_flops_per_device:
    return Peak(topo.peak_flops_per_device * jax.device_count(),
                f"{topo.peak_flops_per_device / 1e12:.0f} TFLOP/s bf16 peak x "
                f"{jax.device_count()} devices")
  return Peak(None, "unknown peak FLOP/s for this device kind; MFU not reported")


def hosts_peak(host_flops: float) -> tuple[float, int]:
  """(the sum of `host_flops` over the job's hosts, each counted once; the host count): every
  process gives its host's name (a 31-bit hash) and peak, and processes of one host count as
  one."""
  if jax.process_count() == 1:
    return host_flops, 1
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  name = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:4], "little")
  names, peaks = multihost_utils.process_allgather(
      (np.int32(name >> 1), np.float32(host_flops)))
  by_host = dict(zip(np.asarray(names).tolist(), np.asarray(peaks).tolist()))
  by_host[name >> 1] = host_flops  # this host's as measured, not rounded to float32
  return float(sum(by_host.values())), len(by_host)


def _load_average() -> str:
  return f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""


def peak_name(topo, peak: float) -> str:
  """The MFU denominator in a few words, e.g. 'measured CPU peak 281 GFLOP/s'."""
  what = "measured CPU peak" if topo.platform == "cpu" else "bf16 peak"
  if peak < 1e13:
    return f"{what} {peak / 1e9:,.0f} GFLOP/s"
  return f"{what} {peak / 1e12:,.0f} TFLOP/s"


def flops_per_step(s) -> float:
  """Model FLOPs per step of run `s` (a `run_setup.Setup`): MFU's numerator, times the
  step's time."""
  if s.lora is not None:  # frozen weights: forward and input gradient only
    return finetune.flops_per_token(s, s.lora) * s.o.step.global_batch * s.cfg.seq
  return s.model.flops_per_token(s.cfg) * s.o.step.global_batch * s.cfg.seq


EARLY_ETA_STEPS = 3  # a first progress line (with its ETA) this many timed steps in


class Timing(NamedTuple):
  """The timed steps so far (`seconds`, `steps`) and where the open window began."""
  mark_s: float
  mark_step: int
  seconds: float = 0.0
  steps: int = 0


def lap(t: Timing, done: int) -> tuple[Timing, float | None]:
  """Closes the window at step `done` (counted in the totals unless it holds no step: then
  it only timed a progress line), opens the next one now. Returns the new timing and the
  window's seconds per step (None for an empty window)."""
  now, n = time.time(), done - t.mark_step
  if n <= 0:
    return t._replace(mark_s=now), None
  return Timing(now, done, t.seconds + now - t.mark_s, t.steps + n), (now - t.mark_s) / n


class Clock(NamedTuple):
  """The loop's clock, from `clock()`: the steps it times and their seconds, the first step
  (dispatch warm-up), evals and checkpoint saves left out.

  `start(done, pending)`: after each step; the first call waits for `pending` (the first
  step's outputs) and starts timing there. `lap(done)`: seconds per step since the last lap
  (None: no step timed yet), for a progress line. `paused()`: a context whose time stays out
  (an eval, a save). `due(done)`: whether step `done` is the early progress line's
  (`EARLY_ETA_STEPS` timed steps in: a first ETA). `totals()`: the `Timing` so far (None
  before the first step).
  """
  start: Callable[[int, Any], None]
  lap: Callable[[int], float | None]
  paused: Callable[[], Any]
  due: Callable[[int], bool]
  totals: Callable[[], Timing | None]


def clock() -> Clock:
  """A `Clock` that has timed nothing yet."""
  timing, early = [None], [None]

  def start(done: int, pending) -> None:
    if timing[0] is None:
      jax.block_until_ready(pending)
      timing[0], early[0] = Timing(time.time(), done), done + EARLY_ETA_STEPS

  def lap_(done: int) -> float | None:
    if timing[0] is None:
      return None
    timing[0], dt = lap(timing[0], done)
    return dt

  @contextlib.contextmanager
  def paused():
    began = time.time()
    try:
      yield
    finally:
      if timing[0] is not None:
        timing[0] = timing[0]._replace(mark_s=timing[0].mark_s + time.time() - began)

  return Clock(start, lap_, paused, lambda done: done == early[0], lambda: timing[0])


def whole_run(s, peak: Peak, t: Timing | None) -> dict:
  """tokens/s and MFU of run `s` (a `run_setup.Setup`) against `peak` over every timed step
  (None when fewer than two steps ran)."""
  if t is None or t.steps == 0 or t.seconds <= 0:
    return dict(tokens_per_s=None, mfu=None)
  per_s = t.steps / t.seconds
  return dict(tokens_per_s=s.o.step.global_batch * s.cfg.seq * per_s,
              mfu=flops_per_step(s) * per_s / peak.flops if peak.flops else None)


def host_schedule(schedule) -> Callable[[int], float]:
  """`schedule` (an optax schedule) as a function on the host's CPU, compiled now: called
  eagerly inside the loop, its ops compiled one by one at the first progress line (0.7 s on
  a TPU VM's host, the chip idle meanwhile) and, on an accelerator, queued behind the
  running step."""
  try:
    cpu = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS without cpu
    cpu = None
  with jax.default_device(cpu):
    lr = jax.jit(schedule)
    lr(0)

  def at(step: int) -> float:
    with jax.default_device(cpu):
      return float(lr(step))
  return at


def progress(r, done: int, m, dt) -> dict:
  """One progress line of run `r` at step `done` with metrics `m` (loss, lr, tokens/s, MFU
  and its denominator, ETA) and its record in `r.rec.log`, and the run's goodput record
  there (`r.rec.goodput`). `dt`: seconds per step (None: not measured yet).

  Raises:
    StepError: a non-finite loss.
  """
  s, rec, peak, loss = r.setup, r.rec, r.compiled.peak.flops, float(m["loss"])
  tok_s = s.o.step.global_batch * s.cfg.seq / dt if dt else None
  mfu = flops_per_step(s) / dt / peak if dt and peak else None
  # The lr that step `done`'s update used (the schedule counts updates from 0: the first
  # of a warmup from 0, as in MaxText and GPT-3's recipe, moves nothing).
  metrics = {"train/loss": loss, "train/lr": r.compiled.schedule(done - 1),
             "perf/tokens_per_s": tok_s, "perf/mfu": mfu}
  line = run_log.progress_line(done, s.o.schedule.steps, metrics, dt)
  rec.say(line + (f"  (MFU of {peak_name(s.topo, peak)})" if mfu is not None else ""))
  optional = {f"train/{k}": float(m[k]) for k in ("update_norm", "loss_scale") if k in m}
  rec.log.write(done, {**metrics, "train/grad_norm": float(m["grad_norm"]), **optional})
  rec.log.write(done, rec.goodput.record())  # a kill loses only the time since
  if "aux" in m and s.o.tune.objective == "dpo":  # DPO's implicit rewards
    _say_rewards(rec, done, m["aux"])
  elif "aux" in m:  # a mixture of experts: its load
    _say_load(rec, done, s.model.load_metrics(m["aux"]))
  if not np.isfinite(loss):
    raise fs.StepError(f"loss is {loss} at step {done}; lower lr or use precision=float32")
  return dict(loss=loss, tokens_per_s=tok_s, mfu=mfu)


def _say_rewards(rec, done: int, aux: dict) -> None:
  """DPO's implicit rewards at step `done` (beta x log-ratio to the reference, means over the
  batch's pairs): one line, and their record in the run's log (`rec`: `run_setup.Records`)."""
  got = {f"dpo/{k}": float(v) for k, v in aux.items()}
  rec.say(f"  dpo: reward accuracy {got['dpo/reward_accuracy']:.2f}, margin "
        f"{got['dpo/reward_margin']:.4f} (chosen {got['dpo/chosen_reward']:.4f}, rejected "
        f"{got['dpo/rejected_reward']:.4f})")
  rec.log.write(done, got)


def _say_load(rec, done: int, load: dict) -> None:
  """A mixture of experts' load at step `done`: one line, and its record in the run's log
  (`rec`: `run_setup.Records`)."""
  rec.say(f"  experts: busiest {load['moe/load_max_over_mean']:.2f}x the mean load, balance "
        f"loss {load['moe/load_balance_loss']:.4f}, cross-entropy "
        f"{load['moe/cross_entropy']:.4f}, {load['moe/dropped']:.0f} copies dropped")
  rec.log.write(done, load)
