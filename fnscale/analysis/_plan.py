"""fnscale.analysis.plan: choose the mesh, remat and gradient accumulation for a model on a target pod.

Candidates are the factorisations of one slice's devices into data x fsdp x context x
tensor (tensor up to `max_tensor`, the size ICI neighbours serve well; context, the sequence
split, where the sequence is long: at least `CONTEXT_MIN_TOKENS` tokens per shard, and the
zigzag order's 2c chunks divide it), and x expert for a mixture of experts (an expert axis
dividing its expert count: `fnscale.parallel.moe`), data parallel ("replica") across
slices, remat on/off, and the fewest accumulation steps that fit; for a loss that takes
`microbatches` (a pipelined model, `fnscale.parallel.pipeline`), pipeline stages too: across
the slices of a multi-slice target, and within a slice for a very large model (its
compute-dtype weights larger than one device's memory limit), with as many microbatches (up
to 8 per stage) as every device's rows split into, costed with the bubble and the stage
sends. Each gets an analytic estimate (`fnscale.analysis._cost`: per-device bytes against
`HEADROOM` of the device's memory limit, the bytes a program may hold there; step time
from compute at peak and each collective over its axis's links: a roofline, whose MFU is an
upper bound) and a forecast (`fnscale.analysis._forecast`: the roofline plus efficiency
terms fitted on measured runs); rows are ranked by the forecast. The best few are compiled
ahead of time for the target's described
devices (TPU targets, through libtpu, from any machine): XLA's per-device memory must fit
HBM, its collectives are set beside the estimate, a disagreement over 25% is flagged, and
the ranking uses the compiled figures where it has them. A plan that could not compile says
so (`Plan.verification`); asking for compiles where none can be made is a `PlanError`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jmp

from fnscale import _deprecation
from fnscale import _compat
from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _targets
from fnscale.analysis import _fit
from fnscale.analysis._fit import FitOption
from fnscale import _compile
from fnscale.analysis import hlo as _hlo
from fnscale.parallel import _pipeline
from fnscale import _state
from fnscale import _step
from fnscale._errors import PlanError
from fnscale._mesh import MeshAxes, make_mesh

__all__ = ["Candidate", "CompileCheck", "FORECAST_TERMS", "FitOption", "ForecastTerms", "Plan",
           "PlanError", "calibrate_cpu", "cannot_verify", "data_parallel", "fit_options",
           "forecast_terms", "format_plan", "hardware", "mesh_str", "plan", "predict",
           "profile_model", "plan_summary"]

DISAGREE = 0.25  # relative disagreement between estimate and compile that gets flagged
# Context parallelism is a candidate when each shard keeps at least this many tokens of a
# row: shorter shards make the per-shard matmuls small, and at sequences this short a batch
# split (data, fsdp) serves (MaxText's long-context configs split 32k-token rows and up).
CONTEXT_MIN_TOKENS = 4096
# The share of a device's memory limit (`Hardware.memory_limit`: the allocator's limit,
# `fnscale.CHIP_FACTS`' `hbm_limit`) an estimate may fill: it tracks XLA's peak within about
# 5% for GPT and Llama steps of 86M-8B params (`recipes/bench/memory.py`), so 5% is kept for
# its error.
HEADROOM = 0.95
ForecastTerms = _forecast.Terms  # the forecast's efficiency terms (fnscale.analysis._forecast)
FORECAST_TERMS = _forecast.FITTED  # their fitted values


class CompileCheck(NamedTuple):
  """What an ahead-of-time compile for the target says about one candidate.

  `bytes`: XLA's peak bytes per device (`fnscale.analysis.step_bytes`);
  `matmul_flops`: HLO matmul FLOPs per device per step (`fnscale.analysis.hlo`); `comm_s`: its
  collectives' ring bytes over the bandwidth of the axis whose size matches each replica
  group; `step_s`, `mfu`: the estimate's with compiled communication and FLOPs; `seconds`:
  compile wall time; `flags`: disagreements over 25% ("memory", "comm").

  Examples:
    The best candidate compiled for a v5p-8's described devices (the tpu extra):

    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=1)
    >>> check = p.rows[0].compiled
    >>> type(check).__name__, check.bytes > 0, check.matmul_flops > 0, check.seconds > 0
    ('CompileCheck', True, True, True)
  """
  bytes: float
  matmul_flops: float
  comm_s: float
  step_s: float
  mfu: float
  seconds: float
  flags: tuple[str, ...]


class Candidate(NamedTuple):
  """One row of the plan: mesh axes, remat, accumulation steps, estimate (the roofline),
  compile (or None), `fits` (XLA's peak against the device's memory limit,
  `fnscale.analysis.hardware(target).memory_limit`, where compiled, else the estimate against
  the limit x headroom), `forecast` (`fnscale.analysis._forecast.Forecast`, with the
  compiled communication where compiled), `accum_gather` (`train_step`'s mode, costed and
  compiled as chosen) and `microbatches` (the pipeline's, with a "stage" axis: the loss's
  `microbatches=`).
  `step_s`, `tokens_s`, `mfu` are the forecast's; `bound_mfu` the roofline's (compiled where
  compiled).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> row = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=0).rows[0]
    >>> row.fits, row.remat, row.accum, row.compiled, row.stages, row.bubble
    (True, False, 1, None, 1, 0.0)
    >>> 0 < row.mfu <= row.bound_mfu  # the forecast under its roofline
    True
  """
  axes: MeshAxes
  remat: bool
  accum: int
  estimate: _cost.Estimate
  compiled: CompileCheck | None
  fits: bool
  forecast: _forecast.Forecast | None = None
  accum_gather: str = "auto"
  microbatches: int = 1

  @property
  def stages(self) -> int:
    """Pipeline stages (the "stage" axis within and across slices; 1: no pipeline)."""
    return self.axes.ici.get("stage", 1) * self.axes.dcn.get("stage", 1)

  @property
  def bubble(self) -> float:
    """The pipeline's idle share of iterations, (S - 1) / (M + S - 1); 0 without stages."""
    return _pipeline.bubble_fraction(self.stages, self.microbatches)

  @property
  def step_s(self) -> float:
    if self.forecast is not None:
      return self.forecast.step_s
    return self.compiled.step_s if self.compiled else self.estimate.step_s

  @property
  def mfu(self) -> float:
    return self.forecast.mfu if self.forecast is not None else self.bound_mfu

  @property
  def bound_mfu(self) -> float:
    return self.compiled.mfu if self.compiled else self.estimate.mfu

  @property
  def tokens_s(self) -> float:
    return self.forecast.tokens_s if self.forecast is not None else math.nan


class Plan(NamedTuple):
  """The planner's answer: `rows` ranked best first (fitting rows by step time, then those
  that don't fit); the chosen `axes` (a `MeshAxes` for `fnscale.make_mesh`), `remat`,
  `accum` and `accum_gather` (for `fnscale.train_step`); `why` the winner won; `hardware`
  the resolved target; `profile` what the model needs per step; `verification` what was
  compiled, or why nothing was; `tokens` the token budget the table's days and chip-hours
  are for (None: not shown); `microbatches` the pipeline's (with a "stage" axis in `axes`);
  `headroom` the share of the memory limit an estimate may fill. `str(plan)` is the table
  (`format_plan`).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=0)
    >>> p.axes == p.rows[0].axes, p.remat, p.accum, p.accum_gather, p.verification
    (True, False, 1, 'auto', 'not verified: verify=0')
    >>> p.hardware.num_devices, p.profile.rows
    (4, 64)
  """
  rows: tuple[Candidate, ...]
  axes: MeshAxes
  remat: bool
  accum: int
  why: str
  hardware: _targets.Hardware
  profile: _cost.Profile
  verification: str = ""
  tokens: float | None = None
  accum_gather: str = "auto"
  microbatches: int = 1
  headroom: float = HEADROOM

  def __str__(self) -> str:
    return format_plan(self)


def calibrate_cpu(n: int = 1024, mib: int = 64, repeats: int = 5) -> tuple[float, float]:
  """Measured (matmul FLOP/s, memory-copy bytes/s) of this host's first device: the CPU cost
  model's rates. Matmul: `fnscale.analysis.measure_matmul_peak(n)` (float32). Copy: the median
  time of `x + 1` over a `mib` MiB float32 array, counting the bytes written.

  Examples:
    >>> import fnscale as fs
    >>> matmul_flops, copy_bytes = fs.analysis.calibrate_cpu(n=128, mib=1, repeats=2)
    >>> matmul_flops > 0 and copy_bytes > 0  # per second, on this host
    True
  """
  from fnscale.analysis import _flops as flops  # pylint: disable=g-import-not-at-top
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


class _Frozen(NamedTuple):
  """A state with frozen params (a LoRA state: `TrainState.frozen`), as the planner sees it:
  the trained params and the frozen ones, abstract."""
  params: object
  frozen: object


def _with_frozen(loss_fn):
  """`loss_fn(params, batch, *, frozen, ...)` as a loss of the pair (params, frozen) whose
  frozen half carries no gradient (`jax.lax.stop_gradient`), for the profile: traced through
  it, frozen weights take their forward and input-gradient matmuls and no weight gradient,
  and keep no residuals for one (the step's own FLOPs and activations)."""
  keywords = [k for k in ("remat", "microbatches") if _cost.takes(loss_fn, k)]

  def loss(pair, batch, **kw):
    return loss_fn(pair[0], batch, frozen=jax.lax.stop_gradient(pair[1]), **kw)
  p = inspect.Parameter
  loss.__signature__ = inspect.Signature(
      [p("pair", p.POSITIONAL_OR_KEYWORD), p("batch", p.POSITIONAL_OR_KEYWORD)]
      + [p(k, p.KEYWORD_ONLY, default=None) for k in keywords])
  return loss


def _lora_profile(hw, tree: _Frozen, loss_fn, optimizer, batch, pol) -> _cost.Profile:
  """The profile of a step that trains `tree.params` beside frozen params: bytes, FLOPs and
  residuals of both, gradients and optimizer state of the trained params only, the frozen
  params' bytes as stored and in the compute dtype (`Profile.frozen_bytes`)."""
  prof = _profile(hw, (tree.params, tree.frozen), _with_frozen(loss_fn), optimizer, batch,
                  pol)
  nbytes = _cost._nbytes  # pylint: disable=protected-access
  frozen = _cost.in_compute_dtype(tree.frozen, pol.compute_dtype if pol is not None else None)
  return prof._replace(grad_bytes=nbytes(tree.params),
                       opt_bytes=nbytes(jax.eval_shape(optimizer.init, tree.params)),
                       frozen_bytes=nbytes(tree.frozen), frozen_compute_bytes=nbytes(frozen))


def _abstract_state(params, optimizer, mesh, rules, logical_axes, policy):
  """The abstract TrainState `_verify` compiles: born in its shardings by `rules` and
  `logical_axes`; for a `_Frozen` tree, the frozen params so (the axes are theirs) and the
  trained params by automatic FSDP, with the optimizer state theirs alone."""
  zeros = lambda t: (lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t))
  if not isinstance(params, _Frozen):
    return _state.init_state(zeros(params), optimizer, mesh=mesh, rules=rules,
                             logical_axes=logical_axes, policy=policy, abstract=True)
  frozen = _state.init_state(zeros(params.frozen), optimizer, mesh=mesh, rules=rules,
                             logical_axes=logical_axes, abstract=True).params
  state = _state.init_state(zeros(params.params), optimizer, mesh=mesh, policy=policy,
                            abstract=True)
  return state._replace(frozen=frozen)


def _abstract_params(state_or_init, key):
  """Abstract params from a TrainState, an init function or a params pytree."""
  sds = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  if hasattr(state_or_init, "params") and hasattr(state_or_init, "opt_state"):
    if getattr(state_or_init, "frozen", None) is not None:
      return _Frozen(sds(state_or_init.params), sds(state_or_init.frozen))
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


def _context_sizes(n: int, tokens: int) -> list[int]:
  """Context sizes worth trying for rows of `tokens`: 1, and every c dividing `n` whose
  zigzag chunks (2c) divide the row and whose shards keep `CONTEXT_MIN_TOKENS`."""
  return [c for c in _divisors(n) if c == 1 or (
      tokens % (2 * c) == 0 and tokens // c >= CONTEXT_MIN_TOKENS)]


def _meshes(hw: _targets.Hardware, rows: int, max_tensor: int, stage: int = 1,
            dcn: dict | None = None, experts: int = 0, tokens: int = 1) -> list[MeshAxes]:
  """data x fsdp x expert x context x tensor factorisations of one slice (tensor <=
  max_tensor; expert dividing the model's `experts`, none without; context where rows of
  `tokens` are long: `_context_sizes`) beside an ICI `stage` axis of that size, "replica" across slices
  (or the `dcn` axes given), keeping those whose data axes (the expert axis among them)
  divide the global batch."""
  n = hw.devices_per_slice // stage
  if dcn is None:
    dcn = {"replica": hw.num_slices} if hw.num_slices > 1 else {}
  out = []
  for t in (k for k in _divisors(n) if k <= max_tensor):
    for e in (k for k in _divisors(n // t) if k == 1 or (experts and experts % k == 0)):
      for c in _context_sizes(n // t // e, tokens):
        for f in _divisors(n // t // e // c):
          d = n // t // e // c // f
          if rows % (d * f * e * stage * hw.num_slices):
            continue
          ici = {k: v for k, v in (("stage", stage), ("data", d), ("fsdp", f), ("expert", e),
                                   ("context", c), ("tensor", t)) if v > 1}
          out.append(MeshAxes(ici or {"data": 1}, dict(dcn)))
  return out


def _stage_meshes(prof, hw: _targets.Hardware, max_tensor: int) -> list[MeshAxes]:
  """Pipeline meshes: stages across the slices of a multi-slice target (all of them, or a
  divisor with "replica" over the rest); within a slice (2, 4 or 8 stages) where the model's
  compute-dtype weights exceed one device's HBM. Stages divide the layer stack."""
  out, k = [], hw.num_slices
  for s in (s for s in _divisors(k)[1:] if prof.stack_layers % s == 0):
    dcn = {"stage": s, **({"replica": k // s} if k > s else {})}
    out += _meshes(hw, prof.rows, max_tensor, dcn=dcn, experts=prof.experts, tokens=prof.tokens_row)
  if prof.compute_bytes > hw.memory_limit:
    for s in (2, 4, 8):
      if hw.devices_per_slice % s == 0 and prof.stack_layers % s == 0:
        out += _meshes(hw, prof.rows, max_tensor, stage=s, experts=prof.experts, tokens=prof.tokens_row)
  return out


def _microbatches(prof, axes: MeshAxes) -> int | None:
  """The most microbatches (8, 4, 2 or 1 per stage) into which every device's rows split;
  None where a device holds no whole row per stage's microbatch."""
  stages = axes.ici.get("stage", 1) * axes.dcn.get("stage", 1)
  split = math.prod(axes.dcn.values() or [1]) * math.prod(
      v for k, v in axes.ici.items() if k in ("stage", "data", "fsdp"))
  rows = prof.rows // split
  return next((k * stages for k in (8, 4, 2, 1) if rows and rows % k == 0), None)


def _best_accum(prof, hw, axes, remat, cap, accums):
  """(accum, accum_gather, estimate, fits): the fewest accumulation steps whose estimate fits
  `cap` bytes (or, none fitting, the steps and mode that need the fewest bytes: the float32
  accumulator can outweigh the activations it saves); at those steps "once" where it fits
  and is no slower (it moves params and gradients once per step: less communication, more
  slack when overlap is imperfect), else "per_microbatch" (FSDP's memory); "auto" without
  accumulation."""
  rows_dev = prof.rows // (math.prod(axes.dcn.values() or [1]) * axes.ici.get("data", 1)
                           * axes.ici.get("fsdp", 1) * axes.ici.get("expert", 1))
  least = None
  for a in (a for a in accums if rows_dev % a == 0):
    modes = ("per_microbatch", "once") if a > 1 else ("auto",)
    ests = [(g, _cost.estimate(prof, hw, axes.ici, axes.dcn, remat, a, g)) for g in modes]
    fit = [((round(e.step_s, 9), e.comm_total_s), g, e) for g, e in ests if e.bytes <= cap]
    if fit:
      _, gather, best = min(fit, key=lambda x: x[0])
      return a, gather, best, True
    gather, est = min(ests, key=lambda x: x[1].bytes)
    if least is None or est.bytes < least[2].bytes:
      least = (a, gather, est)
  return (*least, False) if least else (1, "auto", None, False)


def _compiled_comm(summary, hw, axes: MeshAxes) -> dict:
  """Seconds of the compiled collectives by mesh axis: each replica group's ring bytes over
  the bandwidth of the mesh axis of that size, the bytes sent across slices
  (`summary.dcn_groups`) on the DCN axes and the rest on the ICI axes; collective-permutes
  go to the "stage" axis there (a pipeline's sends), else (XLA's windowed einsums) to the
  slowest axis, as do groups no single axis matches."""
  ici = {k: v for k, v in axes.ici.items() if v > 1}
  bw = _cost.axis_bandwidth(hw, ici, axes.dcn)
  across = {(kind, n): b for kind, n, b in summary.dcn_groups}
  out = {}
  for kind, n, sent in summary.groups:
    for sizes, part in ((axes.dcn, across.get((kind, n), 0.0)),
                        (ici, sent - across.get((kind, n), 0.0))):
      if not part:
        continue
      slowest = min(sizes, key=bw.get, default=None)
      axis = next((a for a, k in sizes.items() if k == n), None)
      if kind == "collective-permute":  # a pipeline's stage sends, else windowed einsums
        axis = "stage" if "stage" in sizes else slowest
      elif axis is None:
        axis = slowest
      rate = bw[axis] if axis else min(bw.values(), default=hw.links.ici_link)
      out[axis or "ici"] = out.get(axis or "ici", 0.0) + part / rate
  return out


def _verify(cand: Candidate, hw, ctx) -> Candidate:
  """Compiles the candidate for the target's described devices; returns it with `compiled`
  and the forecast redone with the compiled communication. The program is the one the cost
  model costs: the same loss (remat as the row), policy, accumulation steps and mode
  (`cand.accum_gather`), and the kernels `fnscale.attention` chooses on the
  target's devices (the profile was traced on one)."""
  params, loss_fn, optimizer, batch, policy, rules, logical_axes, prof = ctx
  mesh = make_mesh(cand.axes, devices=hw.devices)
  state = _abstract_state(params, optimizer, mesh, rules, logical_axes, policy)
  loss = functools.partial(loss_fn, remat=cand.remat) if prof.has_remat else loss_fn
  if cand.stages > 1:
    loss = functools.partial(loss, microbatches=cand.microbatches)
  step = _step.train_step(loss, optimizer, policy=policy, accum_steps=cand.accum,
                          accum_gather=cand.accum_gather)
  t0 = time.perf_counter()
  try:
    compiled = _compile.shard_step(step, mesh, rules=rules, logical_axes=logical_axes).compile(
        state, batch)
  except jax.errors.JaxRuntimeError as e:  # XLA refuses a program that overflows HBM
    if not _compat.is_oom_error(str(e)):
      raise
    need = _compat.oom_bytes(str(e))
    c = CompileCheck(need, 0.0, 0.0, math.inf, 0.0, time.perf_counter() - t0, ("memory",))
    return cand._replace(compiled=c, fits=False)
  seconds = time.perf_counter() - t0
  summary = _hlo.summarize(compiled.compiled.as_text() or "")
  est = cand.estimate
  by_axis = _compiled_comm(summary, hw, cand.axes)
  comm = sum(by_axis.values())
  compute = max(est.compute_s, summary.matmul_flops / hw.peak_flops)
  step_s = max(compute, comm) if hw.overlap else compute + comm
  nbytes = _fit.step_bytes(compiled)
  flags = tuple(name for name, got, want in (("memory", nbytes, est.bytes),
                                             ("comm", comm, est.comm_total_s))
                if want and abs(got / want - 1) > DISAGREE)
  mfu = prof.flops_row * prof.rows / (step_s * hw.num_devices * hw.peak_flops)
  c = CompileCheck(nbytes, summary.matmul_flops, comm, step_s, mfu, seconds, flags)
  fc = _forecast.forecast(prof, hw, est._replace(compute_s=compute), cand.axes.dcn, by_axis)
  # XLA's peak is the step's footprint, not an estimate of it: held to the allocator's limit,
  # not to the headroom kept for the estimate's error.
  return cand._replace(compiled=c, fits=nbytes <= hw.memory_limit, forecast=fc)


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
  """Fits first, then forecast step time; ties go to less work (executed compute, so no
  remat before remat), then less communication per compute (slack if overlap is
  imperfect), then fewer bytes."""
  comm = c.compiled.comm_s if c.compiled else c.estimate.comm_total_s
  return (not c.fits, round(c.step_s, 9), c.estimate.compute_s, comm,
          c.compiled.bytes if c.compiled else c.estimate.bytes)


def _why(rows: list[Candidate]) -> str:
  best = rows[0]
  src = "compiled" if best.compiled else "estimated"
  fit = sum(r.fits for r in rows)
  text = (f"lowest forecast step time ({best.step_s * 1e3:.4g} ms, MFU {best.mfu:.0%}; "
          f"{src} roofline {best.bound_mfu:.0%}) of the {fit} candidates that fit")
  nxt = next((r for r in rows[1:] if r.fits), None)
  if nxt is not None:
    comm = lambda r: (r.compiled.comm_s if r.compiled else r.estimate.comm_total_s)
    if nxt.step_s <= best.step_s * 1.005:
      cause = ("same step time, but more work (remat recomputation)" if nxt.remat and
               not best.remat else
               f"same step time, but communication/compute "
               f"{comm(nxt) / nxt.estimate.compute_s:.2f} vs "
               f"{comm(best) / best.estimate.compute_s:.2f}: more slack if overlap is "
               "imperfect")
    else:
      cause = ("{:.0%} slower: ".format(nxt.step_s / best.step_s - 1) + (
          "more communication" if comm(nxt) > comm(best) * 1.05 else
          "remat recomputation" if nxt.remat and not best.remat else
          "more accumulation steps" if nxt.accum > best.accum else "more compute"))
    text += f"; next best {mesh_str(nxt.axes)} remat={nxt.remat} accum={nxt.accum}: {cause}"
  return text


def mesh_str(axes: MeshAxes) -> str:
  """"data=2 fsdp=4 | replica=2": ICI axes, then DCN axes after a bar.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.mesh_str(fs.MeshAxes({"data": 2, "fsdp": 4}, {"replica": 2}))
    'data=2 fsdp=4 | replica=2'
  """
  ici = " ".join(f"{k}={v}" for k, v in axes.ici.items())
  return ici + ("".join(f" | {k}={v}" for k, v in axes.dcn.items()) if axes.dcn else "")


def _candidates(prof, hw, cap, max_tensor, accums, pipelined: bool) -> list[Candidate]:
  rows = []
  remats = (False, True) if prof.has_remat else (False,)
  for axes in _meshes(hw, prof.rows, max_tensor, experts=prof.experts, tokens=prof.tokens_row):
    for remat in remats:
      accum, gather, est, fits = _best_accum(prof, hw, axes, remat, cap, accums)
      if est is not None:
        fc = _forecast.forecast(prof, hw, est, axes.dcn)
        rows.append(Candidate(axes, remat, accum, est, None, fits, fc, gather))
  for axes in _stage_meshes(prof, hw, max_tensor) if pipelined else ():
    m = _microbatches(prof, axes)
    for remat in remats if m else ():  # one step: the pipeline's microbatches bound memory
      est = _cost.estimate(prof, hw, axes.ici, axes.dcn, remat, 1, microbatches=m)
      fc = _forecast.forecast(prof, hw, est, axes.dcn)
      rows.append(Candidate(axes, remat, 1, est, None, est.bytes <= cap, fc, microbatches=m))
  return rows


def _no_fit_error(rows, hw, headroom) -> PlanError:
  low = min(rows, key=lambda r: r.estimate.bytes)
  return PlanError(
      f"the model fits nowhere on {hw.name}: the smallest candidate ({mesh_str(low.axes)}, "
      f"remat={low.remat}, accum={low.accum}) needs {_gib(low.estimate.bytes)} per device, "
      f"and the target has {_usable(hw, headroom)}; fix: a target with more devices or "
      "slices, a smaller global batch, or a smaller model.")


def _gib(b: float) -> str:
  return f"{b / 2**30:.2f} GiB"


def _usable(hw, headroom: float) -> str:
  """What an estimate may fill per device, and why: "14.96 GiB usable per device (95% of the
  15.75 GiB a program may hold of 16.00 GiB HBM: bytes_limit measured on a v5e chip; ...)"."""
  return (f"{_gib(hw.memory_limit * headroom)} usable per device ({headroom:.0%} of the "
          f"{_gib(hw.memory_limit)} a program may hold of {_gib(hw.hbm_bytes)} HBM: "
          f"{hw.limit_source or 'the HBM'}; the rest is the estimate's error margin)")


def _check_args(loss_fn, optimizer, batch, verify, max_tensor, headroom, tokens=None):
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
    if v is None and name == "verify":
      continue
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise PlanError(f"{name}={v!r}, expected an int >= {lo}" + (
          " (or None: compile where the target's devices can be described)"
          if name == "verify" else ""))
  if not 0 < headroom <= 1:
    raise PlanError(f"headroom={headroom!r}, expected a fraction of the device's memory limit "
                    "in (0, 1]")
  if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, (int, float))
                             or not tokens > 0):
    raise PlanError(f"tokens={tokens!r}, expected a positive token budget such as 2e12")


def _verification(hw, verify: int | None) -> tuple[int, str]:
  """(candidates to compile, why none are) for `verify` on `hw`.

  Raises:
    PlanError: `verify` > 0 where no program can be compiled for the target (no described
      TPU devices: libtpu's reason; a GPU or CPU target).
  """
  if verify == 0:
    return 0, "not verified: verify=0"
  if hw.kind == "tpu" and hw.devices is not None:
    return (3 if verify is None else verify), ""
  why = hw.no_devices or ("a CPU target is not compiled ahead of time: time its candidates "
                          "instead (recipes/plan.py --measure)")
  if verify:
    raise PlanError(
        f"verify={verify} asks for ahead-of-time compiles for {hw.name}, but {why.rstrip('.')}. "
        "Fix: "
        + ("install libtpu (pip install 'fnscale[tpu]') and check the target name, or "
           if hw.kind == "tpu" else "") + "pass verify=0 to plan without compiling.")
  return 0, f"not verified: {why}"


def cannot_verify(target, cpu_rates: tuple[float, float] | None = None) -> str:
  """Why `plan(..., verify=N)` could not compile candidates for `target` ("" if it can):
  libtpu's error for a TPU target it can't describe, or that the target is a GPU or CPU.
  `cpu_rates` as for `plan` (measured when None and the target is "cpu").

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.cannot_verify("8x h200")
    'jax describes no GPU devices for ahead-of-time compiles (only TPUs, through libtpu)'
  """
  hw = _resolve(target, cpu_rates)
  try:
    _verification(hw, 1)
  except PlanError:
    return _verification(hw, None)[1].removeprefix("not verified: ")
  return ""


def _profile(hw, params, loss_fn, optimizer, batch, pol) -> _cost.Profile:
  """`fnscale.analysis._cost.profile` traced as the loss will run on `hw`: on one described target
  device (kernels choose as they will there); on an accelerator without described devices,
  on one host device with the Pallas kernels in interpret mode standing in for the target's
  flash kernel (nothing runs; the residuals are the kernel's, not the XLA reference's
  [rows, heads, seq, seq] probabilities); on CPU, on one host device."""
  described = hw.devices is not None and hw.kind != "cpu"
  devices = list(hw.devices)[:1] if described else jax.devices()[:1]
  with jax.set_mesh(make_mesh({"data": 1}, devices=devices)):
    return _cost.profile(params, loss_fn, optimizer, batch,
                         pol.compute_dtype if pol is not None else None,
                         interpret=not described and hw.kind != "cpu",
                         tiled=hw.kind == "tpu")


def _resolve(target, cpu_rates):
  on_cpu = target == "cpu" or getattr(target, "platform", None) == "cpu"
  return _targets.resolve(target, calibrate_cpu() if on_cpu and cpu_rates is None else cpu_rates)


def hardware(target, cpu_rates: tuple[float, float] | None = None) -> _targets.Hardware:
  """The target `plan` plans for: devices (per slice, slices), chips, peak FLOP/s and HBM per
  device, link bandwidths, described devices. `target`, `cpu_rates` as for `plan`.

  Raises:
    TopologyError: an unknown target name.

  Examples:
    >>> import fnscale as fs
    >>> hw = fs.analysis.hardware("2x v5p-8")
    >>> hw.num_slices, hw.num_devices, hw.peak_flops / 1e12, hw.hbm_bytes / 2**30
    (2, 8, 459.0, 95.0)
  """
  return _resolve(target, cpu_rates)


def forecast_terms(target, cpu_rates: tuple[float, float] | None = None) -> ForecastTerms:
  """The forecast's efficiency terms that `plan` and `predict` use for `target` by default
  (the terms `plan_summary` reports): a generation's one-chip fit on one chip, where there
  is one, else `FORECAST_TERMS`, fitted on pods. `target`, `cpu_rates` as for `plan`.

  Raises:
    TopologyError: an unknown target name.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.forecast_terms("v5e-1").matmul, fs.analysis.forecast_terms("v5e-1").memory
    (0.8264, 2.0998)
    >>> fs.analysis.forecast_terms("v5e-8") == fs.analysis.FORECAST_TERMS
    True
  """
  return _forecast.terms_for(_resolve(target, cpu_rates))


def profile_model(state_or_init, loss_fn, optimizer, batch, target, *, policy=None, key=None,
                  cpu_rates: tuple[float, float] | None = None) -> _cost.Profile:
  """What one training step of `loss_fn` needs, traced as it will run on `target` (nothing
  runs): params, bytes, model FLOPs per row (attention counted over the whole score matrix),
  activation residuals per row, layers. The arguments are `plan`'s.

  Raises:
    PlanError: bad arguments. TopologyError: an unknown target.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> prof = fs.analysis.profile_model(init, loss, optax.adam(1e-3), batch, "v5p-8")
    >>> prof.params, prof.rows, prof.flops_row  # 2 x 256 x 256 FLOPs a row, forward and back
    (65536, 64, 262144.0)
  """
  _check_args(loss_fn, optimizer, batch, 0, 1, 1.0)
  hw = _resolve(target, cpu_rates)
  pol = jmp.get_policy(policy) if isinstance(policy, str) else policy
  params = _abstract_params(state_or_init, key)
  if isinstance(params, _Frozen):
    return _lora_profile(hw, params, loss_fn, optimizer, batch, pol)
  return _profile(hw, params, loss_fn, optimizer, batch, pol)


def predict(prof: _cost.Profile, target, axes: MeshAxes, *, remat: bool = False,
            accum: int = 1, accum_gather: str = "auto", headroom: float = HEADROOM,
            cpu_rates: tuple[float, float] | None = None,
            terms: _forecast.Terms | None = None, microbatches: int = 1) -> Candidate:
  """The roofline estimate and the forecast of one configuration, as `plan` makes them for
  its rows (nothing is compiled).

  Args:
    prof: `profile_model(...)` of the step (its `rows` is the global batch; use
      `prof._replace(rows=n)` for another batch of the same sequences).
    target: as for `plan`.
    axes: the mesh (`fnscale.MeshAxes`; ICI "data"/"fsdp"/"expert"/"tensor"/"stage", DCN
      "replica"/"stage").
    remat, accum: remat on/off and accumulation steps.
    accum_gather: `fnscale.train_step`'s accumulation mode ("auto", "per_microbatch" or
      "once").
    headroom: the share of the device's memory limit (`hardware(target).memory_limit`, the
      allocator's) an estimate may fill for `fits`.
    terms: the forecast's efficiency terms (default the fitted ones for the target:
      `forecast_terms(target)`).
    microbatches: the pipeline's, with a "stage" axis (then accum 1).

  Returns:
    A `Candidate` (`estimate`, `forecast`, `fits`; `compiled` None).

  Raises:
    PlanError: axes that don't cover the target's devices or split the batch.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> prof = fs.analysis.profile_model(init, loss, optax.adam(1e-3), batch, "v5p-8")
    >>> row = fs.analysis.predict(prof, "v5p-8", fs.MeshAxes({"fsdp": 4}, {}), accum=2)
    >>> row.fits, row.accum, row.compiled, row.step_s > 0
    (True, 2, None, True)
  """
  return _predict(prof, _resolve(target, cpu_rates), axes, remat, accum, accum_gather,
                  headroom, terms, microbatches)


def _predict(prof, hw, axes, remat, accum, accum_gather="auto", headroom=HEADROOM,
             terms=_forecast.FITTED, microbatches=1) -> Candidate:
  """`predict` on a resolved target."""
  ici = {k: v for k, v in axes.ici.items() if v > 1}
  if math.prod(axes.ici.values()) * math.prod(axes.dcn.values() or [1]) != hw.num_devices:
    raise PlanError(f"axes {mesh_str(axes)} cover {math.prod(axes.ici.values())} x "
                    f"{math.prod(axes.dcn.values() or [1])} devices; {hw.name} has "
                    f"{hw.num_devices} ({hw.num_slices} slice(s)): fix the axis sizes")
  split = data_parallel(axes)
  if prof.rows % (split * accum):
    raise PlanError(f"a batch of {prof.rows} rows does not split over {split} data-parallel "
                    f"devices x accum={accum}: use a multiple of {split * accum} rows")
  est = _cost.estimate(prof, hw, ici, dict(axes.dcn), remat, accum, accum_gather,
                       microbatches)
  return Candidate(axes, remat, accum, est, None, est.bytes <= hw.memory_limit * headroom,
                   _forecast.forecast(prof, hw, est, axes.dcn, terms=terms), accum_gather,
                   microbatches)


def data_parallel(axes: MeshAxes) -> int:
  """Devices that split a batch's rows on `axes`: the DCN axes, "data", "fsdp", "expert" and
  "stage" (`estimate`'s data axes).

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.data_parallel(fs.MeshAxes({"fsdp": 4, "tensor": 2}, {"replica": 2}))
    8
  """
  return math.prod(axes.dcn.values() or [1]) * math.prod(
      axes.ici.get(a, 1) for a in ("data", "fsdp", "expert", "stage"))


def fit_options(prof: _cost.Profile, target, axes: MeshAxes, limit: float, *,
                remat: bool | None = None, accum: int | None = None, rows: int | None = None,
                accum_steps=(1, 2, 4, 8, 16, 32, 64), accum_gather: str = "auto",
                cpu_rates: tuple[float, float] | None = None) -> tuple[FitOption, ...]:
  """The configurations of a step on `axes` whose estimated bytes per device are at most
  `limit`, fastest first (the forecast's tokens/s): remat off and on, each with the fewest
  of `accum_steps` that fit and divide the rows, at the most rows per device that any fits:
  `prof.rows / data_parallel(axes)`, else each halving of it. `remat`, `accum`, `rows` fix
  that choice (the user's); `accum_gather` is the step's (`fnscale.train_step`). Nothing is
  compiled.

  Args:
    prof: `profile_model(...)` of the step (its `rows`: the global batch).
    target, cpu_rates: as for `plan`.
    axes: the mesh (`fnscale.MeshAxes`), fixed.
    limit: bytes per device (e.g. `fnscale.analysis.device_memory`).

  Returns:
    A tuple of `FitOption`s, empty where nothing fits.

  Examples:
    A matmul step with Adam on one H100: 4 MiB of float32 weights, Adam's two moments and
    the gradients (16 MiB), and 16 KiB of activations a row. 17.5 MB hold 32 of the 64
    rows (accumulation would add a float32 accumulator: more, not less).

    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> def loss_fn(params, batch):
    ...   return jnp.mean(jnp.tanh(batch["x"] @ params["w"]) ** 2)
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 1024), jnp.float32)}
    >>> prof = fs.analysis.profile_model({"w": jnp.zeros((1024, 1024))}, loss_fn,
    ...                                  optax.adam(1e-3), batch, "h100")
    >>> one = fs.MeshAxes({"data": 1}, {})
    >>> [(o.remat, o.accum, o.rows) for o in fs.analysis.fit_options(prof, "h100", one, 17.5e6)]
    [(False, 1, 32)]
  """
  hw = _resolve(target, cpu_rates)
  split = data_parallel(axes)
  top = prof.rows // split if rows is None else rows
  remats = ((False, True) if prof.has_remat else (False,)) if remat is None else (remat,)
  for r in [top >> k for k in range(top.bit_length()) if top % (1 << k) == 0][
      :None if rows is None else 1]:
    out = []
    for rm in remats:
      for a in [a for a in (accum_steps if accum is None else (accum,)) if r % a == 0]:
        c = _predict(prof._replace(rows=r * split), hw, axes, rm, a, accum_gather)
        if c.estimate.bytes <= limit:
          out.append(FitOption(rm, a, r, c.estimate.bytes, c.tokens_s))
          break
    if out:
      return tuple(sorted(out, key=lambda o: -o.tokens_s))
  return ()


def plan(state_or_init, loss_fn, optimizer, batch, target, *, policy=None, rules=(),
         logical_axes=None, key=None, verify: int | None = None, max_tensor: int = 8,
         accum_steps=(1, 2, 4, 8, 16, 32), headroom: float = HEADROOM,
         cpu_rates: tuple[float, float] | None = None, tokens: float | None = None) -> Plan:
  """Ranks meshes, remat and accumulation for training on `target`; compiles the best few.

  Args:
    state_or_init: a `TrainState` (abstract or not), `init_fn(key) -> params`, or params.
      A state with frozen params (`TrainState.frozen`, e.g. `fnscale.lora.init_state(...,
      abstract=True)`) is planned as it trains: `loss_fn` takes them as its `frozen`
      keyword, they hold no gradient or optimizer state and take no weight gradient (their
      forward and input-gradient matmuls count), and the compiled candidates place them by
      `rules` / `logical_axes` (theirs) and the trained params by automatic FSDP.
    loss_fn: `loss_fn(params, batch) -> loss`; if it takes a `remat` keyword, remat on/off
      are candidates (e.g. `recipes/lm/llama.py`'s `loss_fn(params, batch, *, remat)`); if it
      takes `microbatches`, meshes with a "stage" axis are too: the loss must then run its
      layer stack as a pipeline over the mesh's stage axis with that many microbatches
      (`fnscale.parallel.pipeline`; llama's does, its rules splitting the stack's "layers"
      over "stage").
    optimizer: the optax optimizer (its state counts against memory).
    batch: the global batch, arrays or `jax.ShapeDtypeStruct`s, leading dim = rows.
    target: a `fnscale.Topology` or a name: "v5p-128", "v6e-256", "v5p:4x4x4", "2x v5p-128"
      (two slices), "8x h200", "cpu" (this host's devices), e.g. `fnscale.detect_topology()`
      for the machine the job runs on (`train_lm.py --mesh=auto`).
    policy: the jmp policy (or string) the step will use; its compute dtype sizes the
      gathered weights and activations.
    rules, logical_axes: sharding rules, as for `fnscale.init_state`.
    verify: how many of the best candidates to compile for the target's described TPU
      devices (libtpu); None (default): 3 where the devices can be described, else none
      (the plan says why); 0: none.
    max_tensor: largest tensor-parallel axis.
    accum_steps: accumulation steps to try (the fewest that fits is kept).
    headroom: the share of the device's memory limit an estimate may fill: the limit is the
      bytes a program may hold (the allocator's: `hardware(target).memory_limit`, 15.75 GiB
      measured on a 16 GiB v5e; how other chips' is derived: `fnscale.CHIP_FACTS`'
      `limit_source`); the default 0.95 keeps 5% for the estimate's error (it tracks XLA's
      peak within about 5% for GPT and Llama steps of 86M-8B params,
      `recipes/bench/memory.py`; small models and other shapes stray further); a compiled
      candidate is held to the limit itself.
    cpu_rates: (matmul FLOP/s, copy bytes/s) for CPU targets; default `calibrate_cpu()`.
    tokens: a token budget (e.g. 2e12); the table then gives each row's days and chip-hours
      to train on it at the forecast's tokens/s.

  Returns:
    A `Plan` (ranked `rows`, chosen `axes`/`remat`/`accum`/`accum_gather`/`microbatches`,
    `why`, `verification`);
    `print(plan)` shows the table.

  Raises:
    PlanError: bad arguments; a model that fits nowhere (the message gives the smallest
      per-device memory any candidate needs, the target's usable memory and where its
      limit comes from); `verify` > 0 where no program can be compiled for the target (the
      message gives libtpu's reason).
    TopologyError: an unknown target name (the message lists known ones).

  Examples:
    A 256 x 256 linear model on a v5p-8 (4 devices): every factorisation of the devices fits.

    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=0)
    >>> len(p.rows), all(row.fits for row in p.rows), type(p.axes).__name__
    (6, True, 'MeshAxes')
  """
  _check_args(loss_fn, optimizer, batch, verify, max_tensor, headroom, tokens)
  hw = _resolve(target, cpu_rates)
  n_verify, note = _verification(hw, verify)
  params = _abstract_params(state_or_init, key)
  pol = jmp.get_policy(policy) if isinstance(policy, str) else policy
  prof = (_lora_profile if isinstance(params, _Frozen) else _profile)(
      hw, params, loss_fn, optimizer, batch, pol)
  cap = hw.memory_limit * headroom
  rows = _candidates(prof, hw, cap, max_tensor, tuple(accum_steps),
                     _cost.takes(loss_fn, "microbatches"))
  if not rows or not any(r.fits for r in rows):
    raise _no_fit_error(rows, hw, headroom) if rows else PlanError(
        f"no mesh of {hw.num_devices} devices splits a batch of {prof.rows} rows; use a "
        "global batch divisible by the device count")
  rows.sort(key=_rank_key)
  if n_verify:
    ctx = (params, loss_fn, optimizer, batch, policy, rules, logical_axes, prof)
    _verify_best(rows, hw, ctx, n_verify)
    done = sum(r.compiled is not None for r in rows)
    note = (f"compiled {done} candidate(s) for {hw.name}'s described devices (the best "
            f"{n_verify} that fit, and any XLA found too big)")
  best = rows[0]
  return Plan(tuple(rows), best.axes, best.remat, best.accum, _why(rows), hw, prof, note,
              tokens, best.accum_gather, best.microbatches, headroom)


def _count(n: float) -> str:
  """A count in 3 significant digits and the unit that keeps it above 1: 834k, 1.24B."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:.0f}"


def _hardware_line(p: Plan) -> str:
  hw, prof = p.hardware, p.profile
  gib = lambda b: f"{b / 2**30:.1f}"
  batch = (f"{_count(prof.params)} params, batch {prof.rows} rows of {prof.tokens_row} "
           "tokens")
  if prof.experts:
    batch += (f"; a mixture of {prof.experts} experts, {prof.expert_k} per token "
              f"({_count(prof.expert_params)} expert params)")
  if hw.kind == "cpu":
    n = hw.num_devices
    return (f"plan for {hw.name}: {n} simulated devices sharing this host (measured for the "
            f"host: {hw.peak_flops * n / 1e9:.1f} GFLOP/s matmul, {hw.links.hbm * n / 1e9:.2f} "
            f"GB/s memory copy; 1/{n} each; memory not limited); {batch}")
  return (f"plan for {hw.name}: {hw.num_devices} devices ({hw.num_slices} slice(s)), "
          f"{gib(hw.hbm_bytes)} GiB HBM and {hw.peak_flops / 1e12:.0f} TFLOP/s per device; "
          f"{batch}")


def _budget(p: Plan, r: Candidate) -> tuple[str, str]:
  """(days, chip-hours) to train on `p.tokens` at the row's forecast tokens/s."""
  if not p.tokens or not r.tokens_s > 0:
    return "-", "-"
  seconds = p.tokens / r.tokens_s
  return f"{seconds / 86400:,.1f}", f"{seconds / 3600 * p.hardware.chips:,.0f}"


def format_plan(p: Plan, top: int = 12) -> str:
  """The plan as a table: mesh, remat, accumulation, GiB/device (estimate; compiled) vs HBM,
  the forecast (step time, tokens/s, MFU) beside the roofline's MFU bound, communication /
  compute, days and chip-hours for `p.tokens` (when given), verified (and flags); then what
  was compiled, kernels whose FLOPs are not counted, the memory an estimate may fill (the
  device's limit, where it comes from, and the headroom kept), and why the winner won.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=0)
    >>> lines = fs.analysis.format_plan(p, top=2).splitlines()
    >>> lines[1].split()[:5], lines[-1].startswith("chosen: " + fs.analysis.mesh_str(p.axes))
    (['#', 'mesh', 'remat', 'accum', 'pipeline'], True)
  """
  budget = ("days", "chip-h") if p.tokens else ()
  cols = ("#", "mesh", "remat", "accum", "pipeline", "GiB/dev est", "compiled", "fits",
          "step ms",
          "tokens/s", "MFU", "bound", "comm/comp", *budget, "verified")
  lines = []
  for i, r in enumerate(p.rows[:top]):
    c = r.compiled
    accum = f"{r.accum} once" if r.accum_gather == "once" and r.accum > 1 else str(r.accum)
    pipe = f"M={r.microbatches} bubble {r.bubble:.2f}" if r.stages > 1 else "-"
    lines.append((str(i + 1), mesh_str(r.axes), "on" if r.remat else "off", accum, pipe,
                  f"{r.estimate.bytes / 2**30:.1f}", f"{c.bytes / 2**30:.1f}" if c else "-",
                  "yes" if r.fits else "NO", f"{r.step_s * 1e3:.4g}", f"{r.tokens_s:,.0f}",
                  f"{r.mfu:.0%}", f"{r.bound_mfu:.0%}",
                  f"{(c.comm_s / r.estimate.compute_s if c else r.estimate.comm_ratio):.2f}",
                  *(_budget(p, r) if p.tokens else ()),
                  (f"yes {c.seconds:.0f}s" + (" FLAG:" + ",".join(c.flags) if c.flags else ""))
                  if c else "no"))
  widths = [max(len(x) for x in col) for col in zip(cols, *lines)]
  fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths))
  more = f"\n... {len(p.rows) - top} more" if len(p.rows) > top else ""
  notes = [f"for {p.tokens:.3g} tokens: days and chip-hours at the forecast tokens/s"
           if p.tokens else "", p.verification]
  if p.hardware.kind != "cpu":
    notes.append(f"memory: estimates held to {_usable(p.hardware, p.headroom)}")
  if p.profile.uncounted:
    notes.append("FLOPs not counted (Pallas kernels without a cost_estimate): "
                 + ", ".join(p.profile.uncounted))
  return "\n".join([_hardware_line(p), fmt(cols), *map(fmt, lines)]) + more + "".join(
      f"\n{n}" for n in notes if n) + (
          f"\nchosen: {mesh_str(p.axes)}, remat={p.remat}, accum={p.accum}"
          + (f", accum_gather={p.accum_gather}" if p.accum > 1 else "")
          + (f", microbatches={p.microbatches} (bubble {p.rows[0].bubble:.2f})"
             if p.rows[0].stages > 1 else "") + f": {p.why}")


def _dot_flops_row(prof: _cost.Profile, remat: bool) -> float:
  """Matmul FLOPs per row an HLO reader sees as dots: the model's, less the attention a
  kernel (a custom call) computes."""
  attn = (prof.attn_row_remat if remat else prof.attn_row) if prof.attn_kernel else 0.0
  return (prof.flops_row_remat if remat else prof.flops_row) - attn


def plan_summary(p: Plan) -> dict:
  """The plan as plain data (for JSON): target facts, the chosen row and every row's
  estimate beside its compile (bytes, memory ratio compiled / estimated, step, comm; HLO
  matmul FLOPs over the traced step's dots with this row's remat, and without remat; attention
  in a kernel is not a dot) and its forecast (step, tokens/s, MFU; days and chip-hours for
  `p.tokens`).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", verify=0)
    >>> s = fs.analysis.plan_summary(p)
    >>> s["target"], s["devices"], s["chosen"] == fs.analysis.mesh_str(p.axes), len(s["rows"])
    ('v5p-8', 4, True, 6)
  """
  rows, prof, n = [], p.profile, p.hardware.num_devices
  for r in p.rows:
    c, e, f = r.compiled, r.estimate, r.forecast
    program = _dot_flops_row(prof, r.remat) * prof.rows / n
    plain = _dot_flops_row(prof, False) * prof.rows / n
    rows.append(dict(
        mesh=mesh_str(r.axes), remat=r.remat, accum=r.accum, accum_gather=r.accum_gather,
        microbatches=r.microbatches, bubble=r.bubble, fits=r.fits,
        est_bytes=e.bytes, est_step_s=e.step_s, est_mfu=e.mfu, est_comm_s=e.comm_total_s,
        compute_s=e.compute_s, compiled_bytes=c.bytes if c else None,
        memory_ratio=c.bytes / e.bytes if c else None, compiled_comm_s=c.comm_s if c else None,
        compiled_step_s=c.step_s if c else None, compiled_mfu=c.mfu if c else None,
        hlo_matmul_flops=c.matmul_flops if c else None, compile_s=c.seconds if c else None,
        flags=list(c.flags) if c else None,
        hlo_over_traced_no_remat=c.matmul_flops / plain if c else None,
        hlo_over_program=c.matmul_flops / program if c else None,
        forecast_step_s=f.step_s if f else None, forecast_tokens_s=f.tokens_s if f else None,
        forecast_mfu=f.mfu if f else None, bound_mfu=r.bound_mfu,
        days=p.tokens / f.tokens_s / 86400 if p.tokens and f else None,
        chip_hours=p.tokens / f.tokens_s / 3600 * p.hardware.chips if p.tokens and f else None))
  hw = p.hardware
  return dict(target=hw.name, devices=hw.num_devices, chips=hw.chips, hbm_bytes=hw.hbm_bytes,
              memory_limit=hw.memory_limit, limit_source=hw.limit_source, headroom=p.headroom,
              peak_flops=hw.peak_flops, chosen=mesh_str(p.axes), remat=p.remat, accum=p.accum,
              accum_gather=p.accum_gather, microbatches=p.microbatches,
              why=p.why, verification=p.verification, tokens=p.tokens,
              uncounted_kernels=list(prof.uncounted), forecast_terms=_forecast.terms_for(hw)._asdict(),
              model_flops_per_device=prof.flops_row * prof.rows / hw.num_devices, rows=rows)


__getattr__ = _deprecation.moved(__name__, {
    "summary": ("fnscale.analysis:plan_summary", "fnscale.analysis.plan_summary")})
