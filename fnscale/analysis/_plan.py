"""fnscale.analysis.plan: choose the mesh, remat and gradient accumulation for a model on a target pod.

The planner in four parts, read in this order: its inputs as values (`fnscale.analysis._model`:
the model's profile, the resolved target), the search over meshes, remat, accumulation and
pipeline stages (`fnscale.analysis._search`), each candidate costed by the analytic model
(`fnscale.analysis._cost`: per-device bytes against `HEADROOM` of the device's memory limit,
the bytes a program may hold there; step time from compute at peak and each collective over
its axis's links: a roofline, whose MFU is an upper bound) and the forecast
(`fnscale.analysis._forecast`: the roofline plus efficiency terms fitted on measured runs),
and the best few compiled for the target's described devices (`fnscale.analysis._verify`).
This module puts them together (`plan`, `predict`, `fit_options`); the answer, a `Plan`,
and its table are `fnscale.analysis._table`'s.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jmp

from fnscale import _deprecation
from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _model
from fnscale.analysis import _search
from fnscale.analysis import _table
from fnscale.analysis import _trace
from fnscale.analysis import _verify
from fnscale.analysis._fit import FitOption
from fnscale.analysis._model import calibrate_cpu, forecast_terms, hardware, profile_model
from fnscale.analysis._search import HEADROOM, Candidate, CompileCheck, mesh_str
from fnscale.analysis._table import Plan, format_plan, plan_summary
from fnscale.analysis._verify import cannot_verify
from fnscale._errors import PlanError
from fnscale._mesh import MeshAxes

__all__ = ["Candidate", "CompileCheck", "FORECAST_TERMS", "FitOption", "ForecastTerms", "Plan",
           "PlanError", "PlanOptions", "calibrate_cpu", "cannot_verify", "data_parallel", "fit_options",
           "forecast_terms", "format_plan", "hardware", "mesh_str", "plan", "predict",
           "profile_model", "plan_summary"]

# The accumulation steps `fit_options` tries by default.
ACCUM_STEPS = (1, 2, 4, 8, 16, 32, 64)
ForecastTerms = _forecast.Terms  # the forecast's efficiency terms (fnscale.analysis._forecast)
FORECAST_TERMS = _forecast.FITTED  # their fitted values


def predict(prof: _cost.Profile, target, axes: MeshAxes, *, remat: bool = False,
            accum_steps: int | None = None, accum_gather: str = "auto",
            headroom: float = HEADROOM, cpu_rates: tuple[float, float] | None = None,
            terms: _forecast.Terms | None = None, microbatches: int = 1,
            accum: int | None = None) -> Candidate:
  """The roofline estimate and the forecast of one configuration, as `plan` makes them for
  its rows (nothing is compiled).

  Args:
    prof: `profile_model(...)` of the step (its `rows` is the global batch; use
      `prof._replace(rows=n)` for another batch of the same sequences).
    target: as for `plan`.
    axes: the mesh (`fnscale.MeshAxes`; ICI "data"/"fsdp"/"expert"/"tensor"/"stage", DCN
      "replica"/"stage").
    remat, accum_steps: remat on/off and accumulation steps (default 1; `accum`: their
      deprecated spelling).
    accum_gather: `fnscale.train_step`'s accumulation mode ("auto", "per_microbatch" or
      "once").
    headroom: the share of the device's memory limit (`hardware(target).memory_limit`, the
      allocator's) an estimate may fill for `fits`.
    terms: the forecast's efficiency terms (default the fitted ones for the target:
      `forecast_terms(target)`).
    microbatches: the pipeline's, with a "stage" axis (then accum_steps 1).

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
    >>> row = fs.analysis.predict(prof, "v5p-8", fs.MeshAxes({"fsdp": 4}, {}),
    ...                            accum_steps=2)
    >>> row.fits, row.accum_steps, row.compiled, row.step_s > 0
    (True, 2, None, True)
  """
  steps = _deprecation.renamed_keyword("predict", "accum", "accum_steps", accum, accum_steps)
  return _predict(prof, _model.resolve(target, cpu_rates), axes, remat,
                  1 if steps is None else steps, accum_gather, headroom, terms, microbatches)


def _predict(prof, hw, axes, remat, accum_steps, accum_gather="auto", headroom=HEADROOM,
             terms=None, microbatches=1) -> Candidate:
  """`predict` on a resolved target."""
  ici = {k: v for k, v in axes.ici.items() if v > 1}
  if math.prod(axes.ici.values()) * math.prod(axes.dcn.values() or [1]) != hw.num_devices:
    raise PlanError(f"axes {mesh_str(axes)} cover {math.prod(axes.ici.values())} x "
                    f"{math.prod(axes.dcn.values() or [1])} devices; {hw.name} has "
                    f"{hw.num_devices} ({hw.num_slices} slice(s)): fix the axis sizes")
  split = data_parallel(axes)
  if prof.rows % (split * accum_steps):
    raise PlanError(f"a batch of {prof.rows} rows does not split over {split} data-parallel "
                    f"devices x accum_steps={accum_steps}: use a multiple of "
                    f"{split * accum_steps} rows")
  est = _cost.estimate(prof, hw, ici, dict(axes.dcn), remat, accum_steps, accum_gather,
                       microbatches)
  return Candidate(axes, remat, accum_steps, est, None, est.bytes <= hw.memory_limit * headroom,
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
                remat: bool | None = None, accum_steps: int | tuple[int, ...] | None = None,
                rows: int | None = None, accum_gather: str = "auto",
                cpu_rates: tuple[float, float] | None = None,
                accum: int | None = None) -> tuple[FitOption, ...]:
  """The configurations of a step on `axes` whose estimated bytes per device are at most
  `limit`, fastest first (the forecast's tokens/s): remat off and on, each with the fewest
  accumulation steps that fit and divide the rows, at the most rows per device that any
  fits: `prof.rows / data_parallel(axes)`, else each halving of it. `remat`, `rows` and an
  int `accum_steps` fix that choice (the user's); `accum_gather` is the step's
  (`fnscale.train_step`). Nothing is compiled.

  Args:
    prof: `profile_model(...)` of the step (its `rows`: the global batch).
    target, cpu_rates: as for `plan`.
    axes: the mesh (`fnscale.MeshAxes`), fixed.
    limit: bytes per device (e.g. `fnscale.analysis.device_memory`).
    accum_steps: an int (fixed), or the steps to try (default `ACCUM_STEPS`); `accum`: the
      deprecated spelling of a fixed one.

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
    >>> [(o.remat, o.accum_steps, o.rows)
    ...  for o in fs.analysis.fit_options(prof, "h100", one, 17.5e6)]
    [(False, 1, 32)]
  """
  if accum is not None and not isinstance(accum_steps, int):
    accum_steps = None  # the old call's steps to try, overridden by its fixed `accum`
  tried = _tried(_deprecation.renamed_keyword("fit_options", "accum", "accum_steps", accum,
                                              accum_steps), ACCUM_STEPS)
  hw = _model.resolve(target, cpu_rates)
  split = data_parallel(axes)
  top = prof.rows // split if rows is None else rows
  remats = ((False, True) if prof.has_remat else (False,)) if remat is None else (remat,)
  for r in [top >> k for k in range(top.bit_length()) if top % (1 << k) == 0][
      :None if rows is None else 1]:
    out = []
    for rm in remats:
      for a in [a for a in tried if r % a == 0]:
        c = _predict(prof._replace(rows=r * split), hw, axes, rm, a, accum_gather)
        if c.estimate.bytes <= limit:
          out.append(FitOption(rm, a, r, c.estimate.bytes, c.tokens_s))
          break
    if out:
      return tuple(sorted(out, key=lambda o: -o.tokens_s))
  return ()


def _tried(accum_steps, default: tuple[int, ...]) -> tuple[int, ...]:
  """The accumulation steps a search tries: an int's alone, else the given ones (None: the
  default)."""
  if accum_steps is None:
    return default
  return (accum_steps,) if isinstance(accum_steps, int) else tuple(accum_steps)


class PlanOptions(NamedTuple):
  """What `plan` takes besides the model and the target, each with its default: how the step
  runs (`policy`, `rules`, `logical_axes`, `key`) and how the search runs (`verify`,
  `max_tensor`, `accum_steps`, `headroom`, `cpu_rates`, `tokens`).

  Fields:
    policy: the jmp policy (or string) the step will use; its compute dtype sizes the
      gathered weights and activations.
    rules, logical_axes: sharding rules, as for `fnscale.init_state`.
    key: the PRNG key an init function is traced with (default `jax.random.key(0)`).
    verify: how many of the best candidates to compile for the target's described TPU
      devices (libtpu); None (default): 3 where the devices can be described, else none
      (the plan says why); 0: none.
    max_tensor: largest tensor-parallel axis.
    accum_steps: accumulation steps to try (the fewest that fits is kept); an int fixes
      them.
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
    unrolled: the loss runs its layers unrolled, not as a `lax.scan` (train_lm's TPU default
      where remat is off): on one chip the forecast takes that loop's terms
      (`forecast_terms(target, unrolled=True)`: the scan's left GPT small's unrolled step 6-9
      points under the chip's measured MFU). The profile and compiles are the loss's own.
    remat_off: what the loss's `remat=` keyword gets in the candidates without remat
      (default False): a checkpoint policy the loss takes by name (train_lm's models:
      "dots" keeps the matmul outputs) is held to what it keeps, and compiled so; the
      forecast's activation traffic stays the loss's without one (`remat=False`), as the
      chip's terms were fitted and as the policy writes and reads the rest again when it
      recomputes it (`Profile.act_row_moved`).

  Examples:
    >>> import fnscale as fs
    >>> o = fs.analysis.PlanOptions(verify=0, tokens=2e12)
    >>> o.verify, o.max_tensor, o.accum_steps, o.headroom
    (0, 8, (1, 2, 4, 8, 16, 32), 0.95)
  """
  policy: object = None
  rules: tuple = ()
  logical_axes: object = None
  key: object = None
  verify: int | None = None
  max_tensor: int = 8
  accum_steps: tuple[int, ...] | int = (1, 2, 4, 8, 16, 32)
  headroom: float = HEADROOM
  cpu_rates: tuple[float, float] | None = None
  tokens: float | None = None
  unrolled: bool = False
  remat_off: object = False


def plan(state_or_init, loss_fn, optimizer, batch, target,
         options: PlanOptions = PlanOptions()) -> Plan:
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
    options: a `PlanOptions` (the step's policy and sharding rules; what to verify, the
      search's bounds, the memory headroom, a token budget): its defaults where not given.

  Returns:
    A `Plan` (ranked `rows`, chosen `axes`/`remat`/`accum_steps`/`accum_gather`/`microbatches`,
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
    >>> opts = fs.analysis.PlanOptions(verify=0)
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts)
    >>> len(p.rows), all(row.fits for row in p.rows), type(p.axes).__name__
    (6, True, 'MeshAxes')
  """
  if not isinstance(options, PlanOptions):
    raise PlanError(f"options is a {type(options).__name__}, expected a "
                    "fnscale.analysis.PlanOptions, e.g. PlanOptions(verify=0)")
  o = options
  _model.check_args(loss_fn, optimizer, batch, o.verify, o.max_tensor, o.headroom, o.tokens)
  hw = _model.resolve(target, o.cpu_rates)
  n_verify, note = _verify.verification(hw, o.verify)
  params = _model.abstract_params(state_or_init, o.key)
  pol = jmp.get_policy(o.policy) if isinstance(o.policy, str) else o.policy
  prof = _model.step_profile(hw, params, loss_fn, optimizer, batch, pol, o.remat_off)
  cap = hw.memory_limit * o.headroom
  terms = _forecast.terms_for(hw, o.unrolled)
  rows = _search.candidates(prof, hw, cap, o.max_tensor, _tried(o.accum_steps, ()),
                            _trace.takes(loss_fn, "microbatches"), terms)
  if not rows or not any(r.fits for r in rows):
    raise _table.no_fit_error(rows, hw, o.headroom) if rows else PlanError(
        f"no mesh of {hw.num_devices} devices splits a batch of {prof.rows} rows; use a "
        "global batch divisible by the device count")
  rows.sort(key=_search.rank_key)
  if n_verify:
    ctx = (params, loss_fn, optimizer, batch, o.policy, o.rules, o.logical_axes, prof, terms)
    _verify.verify_best(rows, hw, ctx, n_verify)
    done = sum(r.compiled is not None for r in rows)
    note = (f"compiled {done} candidate(s) for {hw.name}'s described devices (the best "
            f"{n_verify} that fit, and any XLA found too big)")
  best = rows[0]
  return Plan(tuple(rows), best.axes, best.remat, best.accum_steps, _search.why(rows), hw,
              prof, note, o.tokens, best.accum_gather, best.microbatches, o.headroom,
              o.unrolled)


__getattr__ = _deprecation.moved(__name__, {
    "summary": ("fnscale.analysis:plan_summary", "fnscale.analysis.plan_summary")})
