"""The planner's inputs as values: the model's abstract params and what its step needs
(`profile_model`, read off the traced loss by `fnscale.analysis._trace`), and the resolved
target (`hardware`, `forecast_terms`, `calibrate_cpu` for a CPU target's rates).
"""
from __future__ import annotations

import inspect
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jmp

from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _targets
from fnscale.analysis import _trace
from fnscale._errors import PlanError
from fnscale._mesh import make_mesh


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


class Frozen(NamedTuple):
  """A state with frozen params (a LoRA state: `TrainState.frozen`), as the planner sees it:
  the trained params and the frozen ones, abstract."""
  params: object
  frozen: object


def _with_frozen(loss_fn):
  """`loss_fn(params, batch, *, frozen, ...)` as a loss of the pair (params, frozen) whose
  frozen half carries no gradient (`jax.lax.stop_gradient`), for the profile: traced through
  it, frozen weights take their forward and input-gradient matmuls and no weight gradient,
  and keep no residuals for one (the step's own FLOPs and activations)."""
  keywords = [k for k in ("remat", "microbatches") if _trace.takes(loss_fn, k)]

  def loss(pair, batch, **kw):
    return loss_fn(pair[0], batch, frozen=jax.lax.stop_gradient(pair[1]), **kw)
  p = inspect.Parameter
  loss.__signature__ = inspect.Signature(
      [p("pair", p.POSITIONAL_OR_KEYWORD), p("batch", p.POSITIONAL_OR_KEYWORD)]
      + [p(k, p.KEYWORD_ONLY, default=None) for k in keywords])
  return loss


def _lora_profile(hw, tree: Frozen, loss_fn, optimizer, batch, pol,
                  remat_off=False) -> _cost.Profile:
  """The profile of a step that trains `tree.params` beside frozen params: bytes, FLOPs and
  residuals of both, gradients and optimizer state of the trained params only, the frozen
  params' bytes as stored and in the compute dtype (`Profile.frozen_bytes`)."""
  prof = _profile(hw, (tree.params, tree.frozen), _with_frozen(loss_fn), optimizer, batch,
                  pol, remat_off)
  nbytes = _trace._nbytes  # pylint: disable=protected-access
  frozen = _trace.in_compute_dtype(tree.frozen, pol.compute_dtype if pol is not None else None)
  return prof._replace(grad_bytes=nbytes(tree.params),
                       opt_bytes=nbytes(jax.eval_shape(optimizer.init, tree.params)),
                       update_reduced_bytes=_trace.update_reduced_bytes(optimizer, tree.params),
                       frozen_bytes=nbytes(tree.frozen), frozen_compute_bytes=nbytes(frozen))


def abstract_params(state_or_init, key):
  """Abstract params from a TrainState, an init function or a params pytree."""
  sds = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  if hasattr(state_or_init, "params") and hasattr(state_or_init, "opt_state"):
    if getattr(state_or_init, "frozen", None) is not None:
      return Frozen(sds(state_or_init.params), sds(state_or_init.frozen))
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


def check_args(loss_fn, optimizer, batch, verify, max_tensor, headroom, tokens=None):
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


def _profile(hw, params, loss_fn, optimizer, batch, pol, remat_off=False) -> _cost.Profile:
  """`fnscale.analysis._trace.profile` traced as the loss will run on `hw`: on one described target
  device (kernels choose as they will there); on an accelerator without described devices,
  on one host device with the Pallas kernels in interpret mode standing in for the target's
  flash kernel (nothing runs; the residuals are the kernel's, not the XLA reference's
  [rows, heads, seq, seq] probabilities); on CPU, on one host device."""
  described = hw.devices is not None and hw.kind != "cpu"
  devices = list(hw.devices)[:1] if described else jax.devices()[:1]
  with jax.set_mesh(make_mesh({"data": 1}, devices=devices)):
    return _trace.profile(params, loss_fn, optimizer, batch,
                          pol.compute_dtype if pol is not None else None,
                          interpret=not described and hw.kind != "cpu",
                          tiled=hw.kind == "tpu", remat_off=remat_off)


def resolve(target, cpu_rates):
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
  return resolve(target, cpu_rates)


def forecast_terms(target, cpu_rates: tuple[float, float] | None = None, *,
                   unrolled: bool = False) -> _forecast.Terms:
  """The forecast's efficiency terms that `plan` and `predict` use for `target` by default
  (the terms `plan_summary` reports): a generation's one-chip fit on one chip, where there
  is one, else `FORECAST_TERMS`, fitted on pods. `target`, `cpu_rates` as for `plan`;
  `unrolled`: for a step whose layer loop is unrolled rather than a `lax.scan` (its own
  one-chip fit; pods as the scan): pass them as `predict(..., terms=...)`, the profile
  traced on the scan.

  Raises:
    TopologyError: an unknown target name.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.forecast_terms("v5e-1").matmul, fs.analysis.forecast_terms("v5e-1").memory
    (0.7969, 1.6792)
    >>> fs.analysis.forecast_terms("v5e-8") == fs.analysis.FORECAST_TERMS
    True
    >>> fs.analysis.forecast_terms("v5e-1", unrolled=True).memory
    1.1375
  """
  return _forecast.terms_for(resolve(target, cpu_rates), unrolled)


def profile_model(state_or_init, loss_fn, optimizer, batch, target, *, policy=None, key=None,
                  cpu_rates: tuple[float, float] | None = None,
                  remat_off=False) -> _cost.Profile:
  """What one training step of `loss_fn` needs, traced as it will run on `target` (nothing
  runs): params, bytes, model FLOPs per row (attention counted over the whole score matrix),
  activation residuals per row, layers. The arguments are `plan`'s (`remat_off`: its
  `PlanOptions.remat_off`).

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
  check_args(loss_fn, optimizer, batch, 0, 1, 1.0)
  hw = resolve(target, cpu_rates)
  pol = jmp.get_policy(policy) if isinstance(policy, str) else policy
  return step_profile(hw, abstract_params(state_or_init, key), loss_fn, optimizer, batch, pol,
                      remat_off)


def step_profile(hw, params, loss_fn, optimizer, batch, pol, remat_off=False) -> _cost.Profile:
  """The profile of the step on resolved `hw`: of a `Frozen` pair's step (`_lora_profile`)
  or of plain params' (`_profile`); `remat_off`: `PlanOptions.remat_off`.

  Raises:
    PlanError: a `remat_off` for a loss without a `remat` keyword."""
  if remat_off is not False and not _trace.takes(loss_fn, "remat"):
    raise PlanError(f"remat_off={remat_off!r} for a loss without a `remat` keyword; give the "
                    "loss one (e.g. `remat=False` naming the checkpoint policy), or leave "
                    "remat_off out")
  if isinstance(params, Frozen):
    return _lora_profile(hw, params, loss_fn, optimizer, batch, pol, remat_off)
  return _profile(hw, params, loss_fn, optimizer, batch, pol, remat_off)
