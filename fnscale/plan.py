"""fs.plan: choose the mesh, remat and gradient accumulation for a model on a target pod.

Candidates are the factorisations of one slice's devices into data x fsdp x tensor (tensor
up to `max_tensor`, the size ICI neighbours serve well), data parallel ("replica") across
slices, remat on/off, and the fewest accumulation steps that fit. Each gets an analytic
estimate (`fnscale._cost`: per-device bytes against HBM, step time from compute at peak and
each collective over its axis's links); the best few are compiled ahead of time for the
target's described devices (TPU targets, through libtpu, from any machine): XLA's per-device
memory must fit HBM, its collectives are set beside the estimate, a disagreement over 25% is
flagged, and the ranking uses the compiled figures where it has them.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jmp

from fnscale import _cost
from fnscale import _targets
from fnscale import hlo as _hlo
from fnscale.errors import PlanError
from fnscale.mesh import MeshAxes

__all__ = ["Candidate", "Compiled", "Plan", "PlanError", "calibrate_cpu", "format_plan",
           "mesh_str", "plan", "summary"]

DISAGREE = 0.25  # relative disagreement between estimate and compile that gets flagged


class Compiled(NamedTuple):
  """What an ahead-of-time compile for the target says about one candidate.

  `bytes`: XLA's per-device footprint (arguments + outputs + temporaries - aliased);
  `matmul_flops`: HLO matmul FLOPs per device per step (`fnscale.hlo`); `comm_s`: its
  collectives' ring bytes over the bandwidth of the axis whose size matches each replica
  group; `step_s`, `mfu`: the estimate's with compiled communication and FLOPs; `seconds`:
  compile wall time; `flags`: disagreements over 25% ("memory", "comm").
  """
  bytes: float
  matmul_flops: float
  comm_s: float
  step_s: float
  mfu: float
  seconds: float
  flags: tuple[str, ...]


class Candidate(NamedTuple):
  """One row of the plan: mesh axes, remat, accumulation steps, estimate, compile (or None),
  `fits` (per the compile where present, else the estimate, against HBM x headroom) and
  `accum_gather` (`train_step`'s mode, costed and compiled as chosen)."""
  axes: MeshAxes
  remat: bool
  accum: int
  estimate: _cost.Estimate
  compiled: Compiled | None
  fits: bool
  accum_gather: str = "per_microbatch"

  @property
  def step_s(self) -> float:
    return self.compiled.step_s if self.compiled else self.estimate.step_s

  @property
  def mfu(self) -> float:
    return self.compiled.mfu if self.compiled else self.estimate.mfu


class Plan(NamedTuple):
  """The planner's answer: `rows` ranked best first (fitting rows by step time, then those
  that don't fit); the chosen `axes` (a `MeshAxes` for `fnscale.make_mesh`), `remat`,
  `accum` and `accum_gather` (for `fnscale.train_step`); `why` the winner won; `hardware`
  the resolved target; `profile` what the model needs per step. `str(plan)` is the table
  (`format_plan`)."""
  rows: tuple[Candidate, ...]
  axes: MeshAxes
  remat: bool
  accum: int
  why: str
  hardware: _targets.Hardware
  profile: _cost.Profile
  accum_gather: str = "per_microbatch"

  def __str__(self) -> str:
    return format_plan(self)


def calibrate_cpu(n: int = 1024, mib: int = 64, repeats: int = 5) -> tuple[float, float]:
  """Measured (matmul FLOP/s, memory-copy bytes/s) of this host's first device: the CPU cost
  model's rates. Matmul: `fnscale.flops.measure_matmul_peak(n)` (float32). Copy: the median
  time of `x + 1` over a `mib` MiB float32 array, counting the bytes written."""
  from fnscale import flops  # pylint: disable=g-import-not-at-top
  rate = flops.measure_matmul_peak(n, repeats=repeats)
  x = jnp.zeros((mib * 2**18,), jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  f(x).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return rate, x.nbytes / statistics.median(times)


def _abstract_params(state_or_init, key):
  """Abstract params from a TrainState, an init function or a params pytree."""
  sds = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  if hasattr(state_or_init, "params") and hasattr(state_or_init, "opt_state"):
    return sds(state_or_init.params)
  if callable(state_or_init):
    key = jax.random.key(0) if key is None else key
    try:
      return jax.eval_shape(state_or_init, key)
    except TypeError:
      return jax.eval_shape(state_or_init)
  leaves = jax.tree.leaves(state_or_init)
  if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
    raise PlanError(f"state_or_init is a {type(state_or_init).__name__}, expected a "
                    "TrainState, an init function init_fn(key) -> params or a pytree of arrays")
  return sds(state_or_init)


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _meshes(hw: _targets.Hardware, rows: int, max_tensor: int) -> list[MeshAxes]:
  """data x fsdp x tensor factorisations of one slice (tensor <= max_tensor), "replica"
  across slices, keeping those whose data axes divide the global batch."""
  n = hw.devices_per_slice
  dcn = {"replica": hw.num_slices} if hw.num_slices > 1 else {}
  out = []
  for t in (k for k in _divisors(n) if k <= max_tensor):
    for f in _divisors(n // t):
      d = n // t // f
      if rows % (d * f * hw.num_slices):
        continue
      ici = {k: v for k, v in (("data", d), ("fsdp", f), ("tensor", t)) if v > 1}
      out.append(MeshAxes(ici or {"data": 1}, dict(dcn)))
  return out


def _best_accum(prof, hw, axes, remat, cap, accums):
  """(accum, accum_gather, estimate, fits): the fewest accumulation steps whose estimate fits
  `cap` bytes (or the most, not fitting); at those steps "once" where it fits and is no
  slower (it moves params and gradients once per step: less communication, more slack when
  overlap is imperfect), else "per_microbatch"."""
  rows_dev = prof.rows // (math.prod(axes.dcn.values() or [1]) * axes.ici.get("data", 1)
                           * axes.ici.get("fsdp", 1))
  est = None
  for a in (a for a in accums if rows_dev % a == 0):
    modes = ("per_microbatch", "once") if a > 1 else ("per_microbatch",)
    ests = [(g, _cost.estimate(prof, hw, axes.ici, axes.dcn, remat, a, g)) for g in modes]
    fit = [((round(e.step_s, 9), e.comm_total_s), g, e) for g, e in ests if e.bytes <= cap]
    if fit:
      _, gather, best = min(fit, key=lambda x: x[0])
      return a, gather, best, True
    last, est = a, ests[0][1]
  return (last, "per_microbatch", est, False) if est is not None else (
      1, "per_microbatch", None, False)


def _compiled_comm_s(summary, hw, axes: MeshAxes) -> float:
  """Seconds of the compiled collectives: each replica group's ring bytes over the bandwidth
  of the mesh axis of that size (DCN axes first); collective-permutes (XLA's windowed
  einsums) and groups no single axis matches over the slowest ICI axis."""
  ici = {k: v for k, v in axes.ici.items() if v > 1}
  bw = _cost.axis_bandwidth(hw, ici, axes.dcn)
  sizes = {**{a: axes.dcn[a] for a in axes.dcn}, **ici}
  slowest = min((bw[a] for a in ici), default=min(bw.values(), default=hw.links.ici_link))
  total = 0.0
  for kind, n, sent in summary.groups:
    axis = next((a for a, k in sizes.items() if k == n), None)
    total += sent / (bw[axis] if axis and kind != "collective-permute" else slowest)
  return total


def _oom_bytes(message: str) -> float:
  """Bytes XLA said it needed in an out-of-HBM error ("... required for HLO temporaries
  (18.35G) exceeds ..."), or inf where the message gives none."""
  m = re.search(r"\(([\d.]+)([KMGT])\) exceeds", message)
  return float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024 if m else math.inf


def _verify(cand: Candidate, hw, ctx) -> Candidate:
  """Compiles the candidate for the target's described devices; returns it with `compiled`."""
  import fnscale as fs  # pylint: disable=g-import-not-at-top
  params, loss_fn, optimizer, batch, policy, rules, logical_axes, prof, cap = ctx
  mesh = fs.make_mesh(cand.axes, devices=hw.devices)
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
  state = fs.init_state(zeros, optimizer, mesh=mesh, rules=rules, logical_axes=logical_axes,
                        policy=policy, abstract=True)
  loss = functools.partial(loss_fn, remat=cand.remat) if prof.has_remat else loss_fn
  step = fs.train_step(loss, optimizer, policy=policy, accum_steps=cand.accum,
                       accum_gather=cand.accum_gather)
  t0 = time.perf_counter()
  try:
    compiled = fs.shard_step(step, mesh, rules=rules, logical_axes=logical_axes).compile(
        state, batch)
  except jax.errors.JaxRuntimeError as e:  # XLA refuses a program that overflows HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    need = _oom_bytes(str(e))
    c = Compiled(need, 0.0, 0.0, math.inf, 0.0, time.perf_counter() - t0, ("memory",))
    return cand._replace(compiled=c, fits=False)
  seconds = time.perf_counter() - t0
  report = fs.compile_report(compiled, state, batch)
  summary = _hlo.summarize(compiled.compiled.as_text() or "")
  est = cand.estimate
  comm = _compiled_comm_s(summary, hw, cand.axes)
  compute = max(est.compute_s, summary.matmul_flops / hw.peak_flops)
  step_s = max(compute, comm) if hw.overlap else compute + comm
  nbytes = float(report.peak_bytes or 0)
  flags = tuple(name for name, got, want in (("memory", nbytes, est.bytes),
                                             ("comm", comm, est.comm_total_s))
                if want and abs(got / want - 1) > DISAGREE)
  mfu = prof.flops_row * prof.rows / (step_s * hw.num_devices * hw.peak_flops)
  c = Compiled(nbytes, summary.matmul_flops, comm, step_s, mfu, seconds, flags)
  return cand._replace(compiled=c, fits=nbytes <= cap)


def _verify_best(rows: list, hw, ctx, verify: int) -> None:
  """Compiles, best first, until the top `verify` rows that fit are all compiled, then leaves
  `rows` ranked. At most verify + 2 compiles: a candidate XLA finds too big for HBM, or whose
  compiled figures rank it lower, makes room for the next."""
  for _ in range(verify + 2):
    rows.sort(key=_rank_key)
    todo = next((i for i, r in enumerate(rows[:verify]) if r.fits and r.compiled is None), None)
    if todo is None:
      break
    rows[todo] = _verify(rows[todo], hw, ctx)
  rows.sort(key=_rank_key)


def _rank_key(c: Candidate):
  """Fits first, then step time; ties (compute-bound rows) go to less communication per
  compute (slack if overlap is imperfect), then fewer bytes."""
  comm = c.compiled.comm_s if c.compiled else c.estimate.comm_total_s
  return (not c.fits, round(c.step_s, 9), c.estimate.compute_s, comm,
          c.compiled.bytes if c.compiled else c.estimate.bytes)


def _why(rows: list[Candidate]) -> str:
  best = rows[0]
  src = "compiled" if best.compiled else "predicted"
  fit = sum(r.fits for r in rows)
  text = (f"lowest {src} step time ({best.step_s * 1e3:.4g} ms, MFU {best.mfu:.0%}) of the "
          f"{fit} candidates that fit")
  nxt = next((r for r in rows[1:] if r.fits), None)
  if nxt is not None:
    comm = lambda r: (r.compiled.comm_s if r.compiled else r.estimate.comm_total_s)
    if nxt.step_s <= best.step_s * 1.005:
      cause = (f"same step time, but communication/compute {comm(nxt) / nxt.estimate.compute_s:.2f}"
               f" vs {comm(best) / best.estimate.compute_s:.2f}: more slack if overlap is "
               "imperfect")
    else:
      cause = ("{:.0%} slower: ".format(nxt.step_s / best.step_s - 1) + (
          "more communication" if comm(nxt) > comm(best) * 1.05 else
          "remat recomputation" if nxt.remat and not best.remat else
          "more accumulation steps" if nxt.accum > best.accum else "more compute"))
    text += f"; next best {mesh_str(nxt.axes)} remat={nxt.remat} accum={nxt.accum}: {cause}"
  return text


def mesh_str(axes: MeshAxes) -> str:
  """"data=2 fsdp=4 | replica=2": ICI axes, then DCN axes after a bar."""
  ici = " ".join(f"{k}={v}" for k, v in axes.ici.items())
  return ici + ("".join(f" | {k}={v}" for k, v in axes.dcn.items()) if axes.dcn else "")


def _candidates(prof, hw, cap, max_tensor, accums) -> list[Candidate]:
  rows = []
  for axes in _meshes(hw, prof.rows, max_tensor):
    for remat in ((False, True) if prof.has_remat else (False,)):
      accum, gather, est, fits = _best_accum(prof, hw, axes, remat, cap, accums)
      if est is not None:
        rows.append(Candidate(axes, remat, accum, est, None, fits, gather))
  return rows


def _no_fit_error(rows, hw, cap) -> PlanError:
  low = min(rows, key=lambda r: r.estimate.bytes)
  gib = lambda b: f"{b / 2**30:.1f} GiB"
  return PlanError(
      f"the model fits nowhere on {hw.name}: the smallest candidate ({mesh_str(low.axes)}, "
      f"remat={low.remat}, accum={low.accum}) needs {gib(low.estimate.bytes)} per device, and "
      f"the target has {gib(hw.hbm_bytes)} of HBM per device ({gib(cap)} usable); fix: a "
      "target with more devices or slices, a smaller global batch, or a smaller model.")


def _check_args(loss_fn, optimizer, batch, verify, max_tensor, headroom):
  if not callable(loss_fn):
    raise PlanError(f"loss_fn is a {type(loss_fn).__name__}, expected loss_fn(params, batch)")
  if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
    raise PlanError(f"optimizer is a {type(optimizer).__name__}, expected an optax "
                    "GradientTransformation")
  leaves = jax.tree.leaves(batch)
  if not leaves or not all(getattr(x, "ndim", 0) >= 1 for x in leaves):
    raise PlanError("batch must be a pytree of arrays or jax.ShapeDtypeStructs with a "
                    "leading batch dim, e.g. {'inputs': ShapeDtypeStruct((256, 4096), int32)}")
  for name, v, lo in (("verify", verify, 0), ("max_tensor", max_tensor, 1)):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise PlanError(f"{name}={v!r}, expected an int >= {lo}")
  if not 0 < headroom <= 1:
    raise PlanError(f"headroom={headroom!r}, expected a fraction of HBM in (0, 1]")


def plan(state_or_init, loss_fn, optimizer, batch, target, *, policy=None, rules=(),
         logical_axes=None, key=None, verify: int = 3, max_tensor: int = 8,
         accum_steps=(1, 2, 4, 8, 16, 32), headroom: float = 0.8,
         cpu_rates: tuple[float, float] | None = None) -> Plan:
  """Ranks meshes, remat and accumulation for training on `target`; compiles the best few.

  Args:
    state_or_init: a `TrainState` (abstract or not), `init_fn(key) -> params`, or params.
    loss_fn: `loss_fn(params, batch) -> loss`; if it takes a `remat` keyword, remat on/off
      are candidates (e.g. `recipes/llama.py`'s `loss_fn(params, batch, *, remat)`).
    optimizer: the optax optimizer (its state counts against memory).
    batch: the global batch, arrays or `jax.ShapeDtypeStruct`s, leading dim = rows.
    target: a `fnscale.Topology` or a name: "v5p-128", "v6e-256", "v5p:4x4x4", "2x v5p-128"
      (two slices), "8x h200", "cpu" (this host's devices), e.g. `fnscale.detect_topology()`
      for the machine the job runs on (`train_lm.py --mesh=auto`).
    policy: the jmp policy (or string) the step will use; its compute dtype sizes the
      gathered weights and activations.
    rules, logical_axes: sharding rules, as for `fnscale.init_state`.
    verify: how many of the best candidates to compile for the target (TPU targets, whose
      devices libtpu describes; 0 for none).
    max_tensor: largest tensor-parallel axis.
    accum_steps: accumulation steps to try (the fewest that fits is kept).
    headroom: usable fraction of HBM for the estimate (XLA's compiled footprint ran up to
      13% above the estimate for Llama-8B on v5p-128; 0.8 keeps such a plan inside HBM).
    cpu_rates: (matmul FLOP/s, copy bytes/s) for CPU targets; default `calibrate_cpu()`.

  Returns:
    A `Plan` (ranked `rows`, chosen `axes`/`remat`/`accum`/`accum_gather`, `why`);
    `print(plan)` shows the table.

  Raises:
    PlanError: bad arguments, or a model that fits nowhere (the message gives the smallest
      per-device memory any candidate needs and the target's HBM).
    TopologyError: an unknown target name (the message lists known ones).
  """
  _check_args(loss_fn, optimizer, batch, verify, max_tensor, headroom)
  on_cpu = target == "cpu" or getattr(target, "platform", None) == "cpu"
  hw = _targets.resolve(target, calibrate_cpu() if on_cpu and cpu_rates is None else cpu_rates)
  params = _abstract_params(state_or_init, key)
  pol = jmp.get_policy(policy) if isinstance(policy, str) else policy
  import fnscale as fs  # pylint: disable=g-import-not-at-top
  one = fs.make_mesh({"data": 1}, devices=list(hw.devices)[:1]) if hw.devices else None
  with (jax.set_mesh(one) if one is not None else contextlib.nullcontext()):
    prof = _cost.profile(params, loss_fn, optimizer, batch,
                         pol.compute_dtype if pol is not None else None)
  cap = hw.hbm_bytes * headroom
  rows = _candidates(prof, hw, cap, max_tensor, tuple(accum_steps))
  if not rows or not any(r.fits for r in rows):
    raise _no_fit_error(rows, hw, cap) if rows else PlanError(
        f"no mesh of {hw.num_devices} devices splits a batch of {prof.rows} rows; use a "
        "global batch divisible by the device count")
  rows.sort(key=_rank_key)
  if hw.kind == "tpu" and hw.devices is not None and verify:
    ctx = (params, loss_fn, optimizer, batch, policy, rules, logical_axes, prof, cap)
    _verify_best(rows, hw, ctx, verify)
  best = rows[0]
  return Plan(tuple(rows), best.axes, best.remat, best.accum, _why(rows), hw, prof,
              best.accum_gather)


def format_plan(p: Plan, top: int = 12) -> str:
  """The plan as a table: mesh, remat, accumulation, GiB/device (estimate; compiled) vs HBM,
  predicted step time, MFU, communication/compute, verified (and flags), then why."""
  hw = p.hardware
  gib = lambda b: f"{b / 2**30:.1f}"
  head = (f"plan for {hw.name}: {hw.num_devices} devices ({hw.num_slices} slice(s)), "
          f"{gib(hw.hbm_bytes)} GiB HBM and {hw.peak_flops / 1e12:.0f} TFLOP/s per device; "
          f"{p.profile.params / 1e9:.3g}B params, batch {p.profile.rows} rows")
  cols = ("#", "mesh", "remat", "accum", "GiB/dev est", "compiled", "fits", "step ms",
          "MFU", "comm/comp", "verified")
  lines = []
  for i, r in enumerate(p.rows[:top]):
    c = r.compiled
    accum = f"{r.accum} once" if r.accum_gather == "once" and r.accum > 1 else str(r.accum)
    lines.append((str(i + 1), mesh_str(r.axes), "on" if r.remat else "off", accum,
                  gib(r.estimate.bytes), gib(c.bytes) if c else "-", "yes" if r.fits else "NO",
                  f"{r.step_s * 1e3:.4g}", f"{r.mfu:.0%}",
                  f"{(c.comm_s / r.estimate.compute_s if c else r.estimate.comm_ratio):.2f}",
                  (f"yes {c.seconds:.0f}s" + (" FLAG:" + ",".join(c.flags) if c.flags else ""))
                  if c else "no"))
  widths = [max(len(x) for x in col) for col in zip(cols, *lines)]
  fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths))
  more = f"\n... {len(p.rows) - top} more" if len(p.rows) > top else ""
  return "\n".join([head, fmt(cols), *map(fmt, lines)]) + more + (
      f"\nchosen: {mesh_str(p.axes)}, remat={p.remat}, accum={p.accum}"
      + (f", accum_gather={p.accum_gather}" if p.accum > 1 else "") + f": {p.why}")


def summary(p: Plan) -> dict:
  """The plan as plain data (for JSON): target facts, the chosen row and every row's
  estimate beside its compile (bytes, memory ratio compiled / estimated, step, comm; HLO
  matmul FLOPs over the traced step's with this row's remat, and without remat)."""
  rows, prof, n = [], p.profile, p.hardware.num_devices
  for r in p.rows:
    c, e = r.compiled, r.estimate
    program = (prof.flops_row_remat if r.remat else prof.flops_row) * prof.rows / n
    rows.append(dict(
        mesh=mesh_str(r.axes), remat=r.remat, accum=r.accum, accum_gather=r.accum_gather,
        fits=r.fits,
        est_bytes=e.bytes, est_step_s=e.step_s, est_mfu=e.mfu, est_comm_s=e.comm_total_s,
        compute_s=e.compute_s, compiled_bytes=c.bytes if c else None,
        memory_ratio=c.bytes / e.bytes if c else None, compiled_comm_s=c.comm_s if c else None,
        compiled_step_s=c.step_s if c else None, compiled_mfu=c.mfu if c else None,
        hlo_matmul_flops=c.matmul_flops if c else None, compile_s=c.seconds if c else None,
        flags=list(c.flags) if c else None,
        hlo_over_traced_no_remat=c.matmul_flops / (prof.flops_row * prof.rows / n) if c else None,
        hlo_over_program=c.matmul_flops / program if c else None))
  hw = p.hardware
  return dict(target=hw.name, devices=hw.num_devices, hbm_bytes=hw.hbm_bytes,
              peak_flops=hw.peak_flops, chosen=mesh_str(p.axes), remat=p.remat, accum=p.accum,
              accum_gather=p.accum_gather,
              why=p.why, model_flops_per_device=p.profile.flops_row * p.profile.rows
              / hw.num_devices, rows=rows)
