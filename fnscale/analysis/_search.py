"""The planner's search: the candidate meshes for a model on a target, and their ranking.

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
sends. Each gets an analytic estimate (`fnscale.analysis._cost`) and a forecast
(`fnscale.analysis._forecast`); rows are ranked by the forecast (`rank_key`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fnscale import _deprecation
from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _targets
from fnscale.kernels._context_attention import FORMS
from fnscale.parallel import _pipeline
from fnscale._mesh import MeshAxes

# Context parallelism is a candidate when each shard keeps at least this many tokens of a
# row: shorter shards make the per-shard matmuls small, and at sequences this short a batch
# split (data, fsdp) serves (MaxText's long-context configs split 32k-token rows and up).
CONTEXT_MIN_TOKENS = 4096
# The share of a device's memory limit (`Hardware.memory_limit`: the allocator's limit,
# `fnscale.CHIP_FACTS`' `hbm_limit`) an estimate may fill: it tracks XLA's peak within about
# 5% for GPT and Llama steps of 86M-8B params (`recipes/bench/memory.py`), so 5% is kept for
# its error.
HEADROOM = 0.95


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
    >>> opts = fs.analysis.PlanOptions(verify=1)
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts)
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
  `microbatches=`); with a context axis, `context` its attention form
  (`with_kernel(context=...)`) and `context_why` why that one (`context_form`).
  `step_s`, `tokens_s`, `mfu` are the forecast's; `bound_mfu` the roofline's (compiled where
  compiled).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> opts = fs.analysis.PlanOptions(verify=0)
    >>> row = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts).rows[0]
    >>> row.fits, row.remat, row.accum_steps, row.compiled, row.stages, row.bubble
    (True, False, 1, None, 1, 0.0)
    >>> 0 < row.mfu <= row.bound_mfu  # the forecast under its roofline
    True
  """
  axes: MeshAxes
  remat: bool
  accum_steps: int
  estimate: _cost.Estimate
  compiled: CompileCheck | None
  fits: bool
  forecast: _forecast.Forecast | None = None
  accum_gather: str = "auto"
  microbatches: int = 1
  context: str = "all_gather"
  context_why: str = ""

  accum = _deprecation.renamed_field("Candidate", "accum", "accum_steps")

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
  """(accum_steps, accum_gather, estimate, fits): the fewest accumulation steps whose
  estimate fits `cap` bytes (or, none fitting, the steps and mode that need the fewest
  bytes: the float32 accumulator can outweigh the activations it saves); at those steps "once" where it fits
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


def rank_key(c: Candidate):
  """Fits first, then forecast step time; ties go to less work (executed compute, so no
  remat before remat), then less communication per compute (slack if overlap is
  imperfect), then fewer bytes."""
  comm = c.compiled.comm_s if c.compiled else c.estimate.comm_total_s
  return (not c.fits, round(c.step_s, 9), c.estimate.compute_s, comm,
          c.compiled.bytes if c.compiled else c.estimate.bytes)


def why(rows: list[Candidate]) -> str:
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
          "more accumulation steps" if nxt.accum_steps > best.accum_steps else "more compute"))
    text += (f"; next best {mesh_str(nxt.axes)} remat={nxt.remat} accum={nxt.accum_steps}: "
             f"{cause}")
  return text + (f"; context form {best.context_why}" if best.context_why else "")


def mesh_str(axes: MeshAxes) -> str:
  """"data=2 fsdp=4 | replica=2": ICI axes, then DCN axes after a bar.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.mesh_str(fs.MeshAxes({"data": 2, "fsdp": 4}, {"replica": 2}))
    'data=2 fsdp=4 | replica=2'
  """
  ici = " ".join(f"{k}={v}" for k, v in axes.ici.items())
  return ici + ("".join(f" | {k}={v}" for k, v in axes.dcn.items()) if axes.dcn else "")


def _refusal(prof, form: str, c: int, t: int) -> str | None:
  """Why attention's context `form` can't run on a context axis of c beside a tensor axis of
  t (as `fnscale.kernels._context_attention.selection` refuses it), or None."""
  if form == "ring" and t > 1 and (not prof.heads or prof.heads % t or prof.kv_heads % t):
    return f"ring: heads {prof.heads} and kv heads {prof.kv_heads} don't divide over tensor={t}"
  if form == "ulysses":
    split = prof.heads % t == 0 and prof.kv_heads % t == 0  # else tensor doesn't split heads
    per = prof.heads // t if split else prof.heads
    if not per or per % c:
      return f"ulysses: {per} heads don't divide over context={c}"
  return None


def context_form(prof, hw, axes: MeshAxes, remat: bool, accum_steps: int, gather: str,
                 microbatches: int = 1):
  """(form, estimate, why) of attention over the mesh's context axis: of the forms
  (`fnscale.parallel.context.FORMS`) that can run, the one whose estimate is quickest
  (then least communication); ("all_gather", its estimate, "") without a context axis."""
  c, t = axes.ici.get("context", 1) * axes.dcn.get("context", 1), axes.ici.get("tensor", 1)
  cost = lambda form: _cost.estimate(prof, hw, axes.ici, axes.dcn, remat, accum_steps, gather,
                                     microbatches, context=form)
  if c == 1:
    return "all_gather", cost("all_gather"), ""
  refused = {f: _refusal(prof, f, c, t) for f in FORMS}
  ests = {f: cost(f) for f in FORMS if refused[f] is None}
  best = min(ests, key=lambda f: (round(ests[f].step_s, 9), ests[f].comm_total_s))
  traffic = lambda f: _cost.context_traffic(prof, f, c, t, remat)
  others = ", ".join(f"{f} {traffic(f) / traffic(best):.2f}x" for f in ests if f != best)
  why = f"{best}, the quickest estimate" + (
      f" (the others' context traffic against its: {others})" if others else "")
  why += "".join(f"; {r}" for r in refused.values() if r)
  return best, ests[best], why


def candidates(prof, hw, cap, max_tensor, accums, pipelined: bool,
               terms=None) -> list[Candidate]:
  """Every mesh, remat and accumulation (and pipeline) candidate, estimated and forecast
  with `terms` (default `_forecast.terms_for(hw)`)."""
  rows = []
  remats = (False, True) if prof.has_remat else (False,)
  for axes in _meshes(hw, prof.rows, max_tensor, experts=prof.experts, tokens=prof.tokens_row):
    for remat in remats:
      steps, gather, est, fits = _best_accum(prof, hw, axes, remat, cap, accums)
      if est is not None:
        form, est, how = context_form(prof, hw, axes, remat, steps, gather)
        fc = _forecast.forecast(prof, hw, est, axes.dcn, terms=terms)
        rows.append(Candidate(axes, remat, steps, est, None, fits, fc, gather, context=form,
                              context_why=how))
  for axes in _stage_meshes(prof, hw, max_tensor) if pipelined else ():
    m = _microbatches(prof, axes)
    for remat in remats if m else ():  # one step: the pipeline's microbatches bound memory
      est = _cost.estimate(prof, hw, axes.ici, axes.dcn, remat, 1, microbatches=m)
      fc = _forecast.forecast(prof, hw, est, axes.dcn, terms=terms)
      rows.append(Candidate(axes, remat, 1, est, None, est.bytes <= cap, fc, microbatches=m))
  return rows
