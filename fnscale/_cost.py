"""The planner's analytic model: what one training step needs, and what it costs on a mesh.

`profile` reads the model off its own traced program (no model description needed): FLOPs
of every `dot_general` in the jaxpr of `value_and_grad(loss)` (scan bodies times their
length), and activation bytes as the residuals `jax.vjp` keeps, per batch row. `estimate`
turns a profile into per-device bytes and step time for one mesh, following "How to Scale
Your Model" (Austin et al., 2025; jax-ml.github.io/scaling-book), parts 3 "Sharded
Matmuls" and 5 "Training":

- FSDP (ZeRO-3, Rajbhandari et al. 2020): per microbatch every device all-gathers the
  compute-dtype weights twice (forward, and again in the backward pass) and reduce-scatters
  the gradients once; an all-gather or reduce-scatter of V bytes over an axis of n devices
  moves V (n-1)/n per device.
- Data parallel: one gradient all-reduce per step, 2 V (n-1)/n per device (Patarasuk &
  Yuan 2009).
- Tensor parallel (Megatron, Shoeybi et al. 2019): per layer two all-reduces of the
  residual stream forward and two backward (two more forward with remat).
- Axis bandwidth: an axis laid over k torus dimensions uses 2 k links per device on a ring
  with wrap-around, k without (one direction idles at the ends); through a switch (NVSwitch)
  one link's rate; DCN axes the per-chip DCN rate.
- Overlap assumption (written down because it decides the ranking): on TPU and GPU, XLA's
  async collectives and latency-hiding scheduler overlap all communication with compute,
  so step = max(compute, communication) (the scaling book's roofline); on simulated CPU
  devices the same cores copy and compute, so step = compute + communication.
- Memory traffic at HBM bandwidth, added to compute (the vector work that moves it runs
  between the matmuls): the optimizer update reads params, gradients and optimizer state
  and writes params and state once per step; activations are written forward and read
  backward once per row. It matters where the optimizer update is replicated (data
  parallel), and on CPU, where memory is slow.
- Matmuls at the device's peak: predicted MFU is therefore an upper bound.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from fnscale import _compat
from fnscale._targets import Hardware


class Profile(NamedTuple):
  """What one step needs, read from the traced loss. Bytes and FLOPs; `*_row` per batch row.

  `params`: param count; `param_bytes`, `opt_bytes` (optimizer state), `compute_bytes`
  (params in the compute dtype), `grad_bytes` (gradients, param dtype); `flops_row`: model
  FLOPs per row (matmuls of forward + backward, no remat); `flops_row_remat`: with remat's
  recomputation; `act_row` / `act_row_remat`: activation residuals per row without / with
  remat; `layers`: length of the longest `lax.scan` (1 without); `stream_row`: bytes of that
  scan's carry per row (the residual stream a tensor-parallel layer all-reduces); `rows`:
  the global batch; `has_remat`: the loss takes `remat=`.
  """
  params: int
  param_bytes: float
  opt_bytes: float
  compute_bytes: float
  grad_bytes: float
  flops_row: float
  flops_row_remat: float
  act_row: float
  act_row_remat: float
  layers: int
  stream_row: float
  rows: int
  has_remat: bool


def _nbytes(tree) -> float:
  return float(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _sub_jaxprs(eqn):
  return jcore.jaxprs_in_params(eqn.params)


def jaxpr_matmul_flops(jaxpr) -> float:
  """2 x output elements x contracted size over every `dot_general`, scan bodies times their
  `length`, the largest branch of a `cond`; a `pallas_call` counts its `cost_estimate`
  FLOPs where it declares one (kernels such as splash attention do)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lc, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
    elif name == "pallas_call":
      cost = eqn.params.get("cost_estimate")
      total += float(getattr(cost, "flops", 0) or 0)
    else:
      subs = [jaxpr_matmul_flops(j) for j in _sub_jaxprs(eqn)]
      if subs:
        mult = _compat.scan_parts(eqn).length if name == "scan" else 1
        total += mult * (max(subs) if name == "cond" else sum(subs))
  return total


def _longest_scan(jaxpr, best=None):
  """(length, carry avals) of the longest `scan` in the jaxpr, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      scan = _compat.scan_parts(eqn)
      n, carry = scan.length, [v.aval for v in scan.carry]
      if best is None or n > best[0]:
        best = (n, carry)
    for j in _sub_jaxprs(eqn):
      best = _longest_scan(j, best)
  return best


def takes_remat(loss_fn) -> bool:
  """Whether `loss_fn` accepts a `remat` keyword (then the planner chooses it)."""
  try:
    return "remat" in inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):
    return False


def _rows(batch, n: int):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + tuple(x.shape[1:]), x.dtype), batch)


def _one(loss_fn, params, batch, remat):
  """(FLOPs per row, residual bytes per row, jaxpr) of the loss's value and gradient."""
  f = functools.partial(loss_fn, remat=remat) if remat is not None else loss_fn
  jx = jax.make_jaxpr(jax.value_and_grad(f))(params, _rows(batch, 1))
  vjp = lambda p, b: jax.vjp(lambda p: f(p, b), p)[1]
  r1, r2 = (_nbytes(jax.eval_shape(vjp, params, _rows(batch, n))) for n in (1, 2))
  return jaxpr_matmul_flops(jx.jaxpr), r2 - r1, jx.jaxpr


def profile(params, loss_fn, optimizer, batch, compute_dtype=None) -> Profile:
  """Traces `loss_fn` on one and two abstract rows (nothing runs). `params`: abstract params
  in their stored dtype; `compute_dtype`: the policy's compute dtype (None: as stored).
  Call it inside `jax.set_mesh` of one target device so kernels choose as they will there."""
  cast = (lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype)
          if compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x)
  cparams = jax.tree.map(cast, params)
  remat = takes_remat(loss_fn)
  f0, a0, jx = _one(loss_fn, cparams, batch, False if remat else None)
  f1, a1, _ = _one(loss_fn, cparams, batch, True) if remat else (f0, a0, None)
  scan = _longest_scan(jx)
  layers = scan[0] if scan else 1
  stream_row = _nbytes(scan[1]) if scan else 0.0  # traced with one row
  opt = jax.eval_shape(optimizer.init, params)
  return Profile(
      params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
      param_bytes=_nbytes(params), opt_bytes=_nbytes(opt), compute_bytes=_nbytes(cparams),
      grad_bytes=_nbytes(params), flops_row=f0, flops_row_remat=f1, act_row=a0,
      act_row_remat=a1, layers=layers, stream_row=stream_row,
      rows=int(jax.tree.leaves(batch)[0].shape[0]), has_remat=remat)


class Estimate(NamedTuple):
  """One candidate's predicted cost. Bytes per device; seconds per step.

  `params`, `opt`, `grads` (with the accumulator), `weights` (gathered compute-dtype weights
  in flight), `acts` (activations): the parts of `bytes`; `compute_s` at peak; `comm_s`:
  axis name -> seconds of its collectives; `step_s` per the overlap assumption; `mfu`:
  model FLOPs / (step x devices x peak), an upper bound; `comm_ratio`: communication /
  compute time.
  """
  params: float
  opt: float
  grads: float
  weights: float
  acts: float
  compute_s: float
  comm_s: dict
  step_s: float
  mfu: float
  memory_s: float = 0.0

  @property
  def bytes(self) -> float:
    return self.params + self.opt + self.grads + self.weights + self.acts

  @property
  def comm_total_s(self) -> float:
    return sum(self.comm_s.values())

  @property
  def comm_ratio(self) -> float:
    return self.comm_total_s / self.compute_s if self.compute_s else math.inf


def axis_bandwidth(hw: Hardware, ici: dict, dcn: dict) -> dict:
  """Bytes/s per device for a collective on each mesh axis.

  ICI axes are laid on the torus largest first, each taking whole grid dimensions where its
  size allows (as `mesh_utils.create_device_mesh` does); an axis over k dimensions drives 2k
  links with wrap-around, k without. Switched links (NVSwitch, CPU copies): one link's rate.
  DCN axes: the per-chip DCN rate.
  """
  bw = {a: hw.links.dcn for a in dcn}
  if hw.links.switched or not hw.chip_grid:
    return {**bw, **{a: hw.links.ici_link for a in ici}}
  free = sorted((g for g in hw.chip_grid if g > 1), reverse=True)
  for a in sorted(ici, key=ici.get, reverse=True):
    n, dims, whole = ici[a], 0, True
    for g in list(free):
      if n > 1 and n % g == 0:
        free.remove(g)
        n //= g
        dims += 1
    if n > 1:  # part of a dimension: no wrap-around on that ring
      g = next((g for g in free if g % n == 0), None)
      if g is not None:
        free[free.index(g)] = g // n
      dims, whole = dims + 1, False
    bw[a] = max(dims, 1) * hw.links.ici_link * (2 if hw.wrap and whole else 1)
  return bw


def estimate(prof: Profile, hw: Hardware, ici: dict, dcn: dict, remat: bool,
             accum: int) -> Estimate:
  """Per-device bytes and step time of one candidate (see the module docstring for the
  formulas and the overlap assumption). `ici`/`dcn`: axis -> size ("data", "fsdp",
  "tensor"; "replica" across slices); the global batch must divide over the data axes and
  `accum`."""
  d, f, t = ici.get("data", 1), ici.get("fsdp", 1), ici.get("tensor", 1)
  r = math.prod(dcn.values()) if dcn else 1
  n = hw.num_devices
  shard = f * t
  rows_mb = prof.rows / (r * d * f) / accum
  frac = lambda k: (k - 1) / k
  layer_w = prof.compute_bytes / max(prof.layers, 1) / t
  act_row = prof.act_row_remat + prof.act_row / max(prof.layers, 1) if remat else prof.act_row
  parts = dict(params=prof.param_bytes / shard, opt=prof.opt_bytes / shard,
               grads=prof.grad_bytes / shard * (2 if accum > 1 else 1),
               weights=2 * layer_w if f > 1 else prof.compute_bytes / t,
               acts=act_row * rows_mb)  # not split by tensor: the residual stream isn't
  model_flops = prof.flops_row * prof.rows
  update = (2 * prof.param_bytes + prof.grad_bytes + 2 * prof.opt_bytes) / shard
  memory = (update + 2 * act_row * rows_mb * accum) / hw.links.hbm
  compute = (prof.flops_row_remat if remat else prof.flops_row) * prof.rows / n / hw.peak_flops
  compute += memory
  bw = axis_bandwidth(hw, {k: v for k, v in ici.items() if v > 1}, dcn)
  comm = {}
  if f > 1:
    comm["fsdp"] = accum * frac(f) * (2 * prof.compute_bytes + prof.grad_bytes) / t / bw["fsdp"]
  if d > 1:
    comm["data"] = 2 * frac(d) * prof.grad_bytes / shard / bw["data"]
  if t > 1:
    per_layer = (6 if remat else 4) * 2 * frac(t) * prof.stream_row * rows_mb
    comm["tensor"] = accum * prof.layers * per_layer / bw["tensor"]
  for a, k in dcn.items():
    if k > 1:
      comm[a] = 2 * frac(k) * prof.grad_bytes / shard / bw[a]
  total = sum(comm.values())
  step = max(compute, total) if hw.overlap else compute + total
  return Estimate(**parts, compute_s=compute, comm_s=comm, step_s=step,
                  mfu=model_flops / (step * n * hw.peak_flops) if step else 0.0,
                  memory_s=memory)
