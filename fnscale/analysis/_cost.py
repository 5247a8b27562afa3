"""The planner's analytic model: what one training step needs, and what it costs on a mesh.

`profile` reads the model off its own traced program (no model description needed): FLOPs
of every `dot_general` in the jaxpr of `value_and_grad(loss)` (scan bodies times their
length), traced with `fnscale.attention`'s XLA reference so that attention counts whatever
kernel serves it on the target (a Pallas kernel's FLOPs are not visible in a jaxpr unless it
declares a `cost_estimate`; jax's splash attention declares none), and activation bytes as
the residuals `jax.vjp` keeps, per batch row, traced as the loss runs on the target. `estimate`
turns a profile into per-device bytes and step time for one mesh, following "How to Scale
Your Model" (Austin et al., 2025; jax-ml.github.io/scaling-book), parts 3 "Sharded
Matmuls" and 5 "Training":

- FSDP (ZeRO-3, Rajbhandari et al. 2020): per microbatch every device all-gathers the
  compute-dtype weights twice (forward, and again in the backward pass) and reduce-scatters
  the gradients once; an all-gather or reduce-scatter of V bytes over an axis of n devices
  moves V (n-1)/n per device. With accumulation in `train_step`'s accum_gather="once" the
  whole compute-dtype params are gathered once per step and the gradients reduce-scattered
  once, at the memory of whole params and a whole float32 accumulator per device.
- Data parallel: one gradient all-reduce per step, 2 V (n-1)/n per device (Patarasuk &
  Yuan 2009); one per microbatch with accum_gather="per_microbatch" accumulation ("auto",
  the default, reduces once as "once" does where nothing is split over fsdp).
- Tensor parallel (Megatron, Shoeybi et al. 2019): per layer two all-reduces of the
  residual stream forward and two backward (two more forward with remat).
- Context parallel (the sequence split c ways, `fnscale.parallel.context`): every
  device holds 1/c of each row's activations and does 1/c of its work (balanced by the
  zigzag order); attention all-gathers K and V over the axis forward ((c-1)/c of their
  bytes; again in the backward pass with remat) and reduce-scatters their gradients (the
  same bytes). Params are split over the axis as over "fsdp" (MaxText's "embed" rule, and
  `recipes/lm/llama.py`'s): their gathers and the gradients' reduce-scatter run over the
  fsdp x context group, whose collectives drive both axes' links.
- Axis bandwidth: an axis laid over k torus dimensions uses 2 k links per device on a ring
  with wrap-around, k without (one direction idles at the ends); through a switch (NVSwitch)
  one link's rate; DCN axes the per-chip DCN rate.
- Overlap assumption (written down because it decides the ranking): on TPU and GPU, XLA's
  async collectives and latency-hiding scheduler overlap all communication with compute,
  so step = max(compute, communication) (the scaling book's roofline); on simulated CPU
  devices the same cores copy and compute, so step = compute + communication.
- Bytes per device (`Estimate`): params and optimizer state (split as the params are); the
  backward's gradients of the trained params (not of frozen ones, e.g. a LoRA base) in the
  compute dtype, the float32 accumulator beside them with accumulation; the compute-dtype
  weights in flight (two layers gathered under FSDP, else a whole cast copy of the params
  stored in another dtype than the compute dtype); activations: the residuals
  `jax.vjp` keeps, in the tiles a TPU holds them in on a TPU target (`tiled_nbytes`), and
  under remat the checkpoints plus the share of one recomputed layer XLA keeps
  (`REMAT_LIVE`). Set against XLA's peak by `recipes/bench/memory.py`.
- Memory traffic at HBM bandwidth, added to compute (the vector work that moves it runs
  between the matmuls): `memory_traffic`. It matters where the optimizer update is
  replicated (data parallel), and on CPU, where memory is slow.
- Attention: the score and value matmuls, 4 B T S H Q FLOPs forward per layer (B rows, T
  queries, S keys, H heads of Q dims; twice that backward), counted over the whole score
  matrix as PaLM's MFU does. A kernel (splash, cuDNN, Pallas flash) under a causal mask
  skips the blocks above the diagonal, so the program executes about half of that
  (`CAUSAL_SAVING`; exactly (T+1)/2T of the scores are unmasked, and whole diagonal blocks
  run, so the executed share is slightly above one half); the XLA reference computes it all.
- Matmuls at the device's peak: predicted MFU is therefore an upper bound (the roofline);
  `fnscale.analysis._forecast` adds the efficiency terms it leaves out.
- Pipeline stages (a "stage" axis of S devices, M microbatches, `fnscale.parallel.pipeline`):
  the layer stack (the longest `lax.scan`'s params and FLOPs) is split S ways and runs
  M + S - 1 iterations for M microbatches' work (the bubble, (S-1)/(M+S-1), executes too);
  each iteration sends one microbatch's residual stream to the next stage, plus S - 1 sends
  of M/S microbatches before and after the loop, forward and backward; FSDP gathers a
  stage's weights (and reduce-scatters its gradients) in every iteration. Outside the stack
  the stage axis splits the batch like a data axis (its gradients reduced over it too).
- Mixture of experts (`fnscale.parallel.moe`): a grouped matmul (`ragged_dot`) costs
  2 x routed rows x k x n, so the model's FLOPs are the active params' (traced on one
  device, its rows are exactly the routed copies). On an `expert` axis of e devices the
  expert weights (the forward grouped matmuls' rhs), their optimizer state and gradients
  are split e ways more; the other params are replicated over it, their gradients
  all-reduced over it as over a data axis; each MoE layer all-to-alls its token copies to
  the experts' devices and back, forward and backward (and again under remat), (e-1)/e of
  them leaving the device; and the dropless receive buffers hold the worst case, e x
  min(k, E/e) / k times the routed copies, so the grouped matmuls' activations grow by that
  factor (GShard, Lepikhin et al. 2020; MaxText's dropless buffers).
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
from fnscale import _step
from fnscale.analysis._targets import Hardware
from fnscale.kernels._attention import CAUSAL_SCOPE, SCOPE, with_kernel
from fnscale.parallel._experts import with_experts

# Share of causal attention's score-matrix FLOPs a kernel skips (see the module docstring).
CAUSAL_SAVING = 0.5


class Profile(NamedTuple):
  """What one step needs, read from the traced loss. Bytes and FLOPs; `*_row` per batch row.

  `params`: param count; `param_bytes`, `opt_bytes` (optimizer state), `compute_bytes`
  (params in the compute dtype), `grad_bytes` (gradients, param dtype); `flops_row`: model
  FLOPs per row (matmuls of forward + backward, no remat); `flops_row_remat`: with remat's
  recomputation; `act_row` / `act_row_remat`: activation residuals per row without / with
  remat; `layers`: length of the longest `lax.scan` (1 without); `stream_row`: bytes of that
  scan's carry per row (the residual stream a tensor-parallel layer all-reduces); `rows`:
  the global batch; `has_remat`: the loss takes `remat=`; `attn_row` / `attn_row_remat`:
  the attention score and value FLOPs inside `flops_row` / `flops_row_remat` (over the whole
  score matrix); `causal_share`: the fraction of those from causal calls; `attn_kernel`:
  attention runs in a kernel on the target (so a causal mask saves work);
  `tokens_row`: elements of one row of the batch's first leaf (its sequence length, for a
  language model's [rows, seq] tokens); `uncounted`: Pallas kernels that declare no
  `cost_estimate` (their FLOPs are missing); `act_row_stream` / `act_row_remat_stream`: the
  part of `act_row` / `act_row_remat` shaped like the residual stream (last dim the scan
  carry's), which tensor parallelism replicates; it splits the rest (heads, MLP columns);
  the layer stack a pipeline splits into stages, the `lax.scan` over the most bytes:
  `stack_layers` its length, `stack_bytes` the compute-dtype bytes it runs over (the
  layers' params), `stack_stream_row` its carry's bytes per row (the residual stream a
  stage sends on), `stack_flops_row` the part of `flops_row` in it and its transpose.
  Mixture of experts (0 without): `experts` per layer, `expert_k` experts per token,
  `expert_params` expert weights (all layers), `exchange_row` bytes per row of one
  all-to-all pass (the routed copies of every MoE layer, compute dtype), `expert_act_row`
  the grouped matmuls' inputs and outputs per row (residuals a dropless buffer scales).
  `kv_row`: bytes of the keys and values every attention call of the forward pass takes,
  per row (what context parallelism's all-gather form gathers).
  `act_row_layer`: one layer's residuals per row without remat (the layer scan's stacked
  residuals over its length: what remat recomputes at once); `act_row_head`: the residuals
  outside the layer scan per row (embedding, final norm, output layer); 0 where unknown.
  On a TPU target every residual figure counts the tiles a TPU holds (`tiled_nbytes`).
  Frozen params (a LoRA base: no gradient, no optimizer state; 0 without):
  `frozen_bytes` / `frozen_compute_bytes`, their part of `param_bytes` / `compute_bytes`.
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
  attn_row: float = 0.0
  attn_row_remat: float = 0.0
  causal_share: float = 0.0
  attn_kernel: bool = False
  tokens_row: int = 1
  uncounted: tuple[str, ...] = ()
  act_row_stream: float = 0.0
  act_row_remat_stream: float = 0.0
  stack_layers: int = 0
  stack_bytes: float = 0.0
  stack_stream_row: float = 0.0
  stack_flops_row: float = 0.0
  experts: int = 0
  expert_k: int = 0
  expert_params: int = 0
  exchange_row: float = 0.0
  expert_act_row: float = 0.0
  kv_row: float = 0.0
  act_row_layer: float = 0.0
  act_row_head: float = 0.0
  frozen_bytes: float = 0.0
  frozen_compute_bytes: float = 0.0

  @property
  def expert_share(self) -> float:
    """The fraction of the params (and so of their bytes, state and gradients) that are
    expert weights, split over an expert axis."""
    return self.expert_params / self.params if self.params else 0.0

  @property
  def trained_bytes(self) -> float:
    """Bytes of the trained params as stored (what the optimizer update reads and writes)."""
    return self.param_bytes - self.frozen_bytes

  @property
  def trained_compute_bytes(self) -> float:
    """Bytes of the trained params in the compute dtype: the backward's gradients."""
    return self.compute_bytes - self.frozen_compute_bytes

  @property
  def cast_bytes(self) -> float:
    """Bytes of the compute-dtype copy of the params stored in another dtype, trained and
    frozen apart (a LoRA base stored in the compute dtype needs none; its adapters do)."""
    parts = ((self.trained_compute_bytes, self.trained_bytes),
             (self.frozen_compute_bytes, self.frozen_bytes))
    return sum(c for c, stored in parts if c < stored)


def _nbytes(tree) -> float:
  return float(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _sub_jaxprs(eqn):
  return jcore.jaxprs_in_params(eqn.params)


class FlopCount(NamedTuple):
  """FLOPs of a jaxpr. `total`: every `dot_general` (2 x output elements x contracted size)
  and every `pallas_call`'s declared `cost_estimate`; `attention`, `causal`: the dots under
  `fnscale.attention`'s named scope (causal calls); `scoped_kernels`: Pallas calls under that
  scope (the attention ran in a kernel); `uncounted`: names of Pallas calls that declare no
  cost (their FLOPs are in no figure)."""
  total: float = 0.0
  attention: float = 0.0
  causal: float = 0.0
  scoped_kernels: int = 0
  uncounted: tuple[str, ...] = ()

  def __add__(self, o):
    return FlopCount(self.total + o.total, self.attention + o.attention, self.causal + o.causal,
                     self.scoped_kernels + o.scoped_kernels,
                     tuple(dict.fromkeys(self.uncounted + o.uncounted)))

  def times(self, k: float) -> "FlopCount":
    return self._replace(total=k * self.total, attention=k * self.attention,
                         causal=k * self.causal, scoped_kernels=int(k) * self.scoped_kernels)


def _eqn_flops(eqn, outer: str) -> FlopCount:
  """One equation's FlopCount (sub-jaxprs: scan bodies times `length`, a cond's costliest
  branch, every other body once). `outer`: the name scopes of the equations around this
  jaxpr (a `jit` or `custom_vjp` body's names start afresh)."""
  name = eqn.primitive.name
  scope = outer + "/" + _compat.name_scopes(eqn)
  in_attention = SCOPE in scope
  if name == "dot_general":
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[i] for i in _compat.dot_contracting_dims(eqn))
    f = 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    return FlopCount(f, f if in_attention else 0.0, f if CAUSAL_SCOPE in scope else 0.0)
  if name == "ragged_dot_general":
    f = _ragged_flops(eqn)
    return FlopCount(f, f if in_attention else 0.0, f if CAUSAL_SCOPE in scope else 0.0)
  if name == "pallas_call":
    kernel = _compat.kernel_cost(eqn)
    uncounted = () if kernel.flops else (kernel.name,)
    return FlopCount(kernel.flops or 0.0, 0.0, 0.0, int(in_attention), uncounted)
  subs = [count_flops(j, scope) for j in _sub_jaxprs(eqn)]
  if not subs:
    return FlopCount()
  if name == "cond":
    return max(subs, key=lambda c: c.total)
  total = sum(subs, FlopCount())
  return total.times(_compat.scan_parts(eqn).length) if name == "scan" else total


def _ragged_flops(eqn) -> float:
  """A grouped matmul: each lhs element meets each element of the rhs's free dims (not
  contracted, batch or group) once, 2 x lhs elements x rhs free elements: 2 m k n for
  rows [m, k] against groups [g, k, n] (each row one group's matrix) and for the weight
  gradient alike."""
  d = _compat.ragged_dot_dims(eqn)
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  used = set(d.rhs_contracting + d.rhs_batch + d.rhs_group)
  return 2.0 * math.prod(lhs) * math.prod(n for i, n in enumerate(rhs) if i not in used)


class _Experts(NamedTuple):
  """What a traced loss's forward grouped matmuls say (see `Profile`)."""
  experts: int = 0
  k: int = 0
  params: int = 0
  exchange_row: float = 0.0
  act_row: float = 0.0


def _forward_grouped(jaxpr, mult: int = 1, outer: str = ""):
  """(lhs aval, rhs aval, out aval, runs) of every forward grouped matmul (a
  `ragged_dot_general` against groups, outside the backward's `transpose`), scan bodies
  times their length."""
  for eqn in jaxpr.eqns:
    scope = outer + "/" + _compat.name_scopes(eqn)
    if eqn.primitive.name == "ragged_dot_general":
      if _compat.ragged_dot_dims(eqn).rhs_group and "transpose(" not in scope:
        yield eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval, mult
      continue
    runs = mult * (_compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1)
    for j in _sub_jaxprs(eqn):
      yield from _forward_grouped(j, runs, scope)


def _experts(jaxpr, width: int, tokens_row: int) -> _Experts:
  """The expert facts of a value-and-grad jaxpr traced on one row (`_Experts`)."""
  found = list(_forward_grouped(jaxpr))
  if not found:
    return _Experts()
  size = lambda a: math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
  rows = max(lhs.shape[0] for lhs, _, _, _ in found)
  return _Experts(
      experts=max(rhs.shape[0] for _, rhs, _, _ in found),
      k=max(1, round(rows / max(tokens_row, 1))),
      params=sum(math.prod(rhs.shape) * n for _, rhs, _, n in found),
      exchange_row=sum(size(out) * n for _, _, out, n in found if out.shape[-1] == width),
      act_row=sum((size(lhs) + size(out)) * n for lhs, _, out, n in found))


def count_flops(jaxpr, outer: str = "") -> FlopCount:
  """The `FlopCount` of a jaxpr (see `FlopCount`); `outer`: enclosing name scopes."""
  return sum((_eqn_flops(e, outer) for e in jaxpr.eqns), FlopCount())


def jaxpr_matmul_flops(jaxpr) -> float:
  """2 x output elements x contracted size over every `dot_general`, scan bodies times their
  `length`, the largest branch of a `cond`; a `pallas_call` counts its `cost_estimate`
  FLOPs where it declares one (`count_flops(jaxpr).total`)."""
  return count_flops(jaxpr).total


def attention_kv_bytes(jaxpr, outer: str = "") -> float:
  """Bytes of the keys and values of every attention call in a forward jaxpr traced with
  `fnscale.attention`'s XLA reference: the smaller operand of each `dot_general` under its
  scope (jax.nn's attention contracts q with k, k no larger under grouped-query attention,
  then the probabilities with v, v the smaller while the queries outnumber head_dim), scan
  bodies times their length."""
  total = 0.0
  for eqn in jaxpr.eqns:
    scope = outer + "/" + _compat.name_scopes(eqn)
    if eqn.primitive.name == "dot_general" and SCOPE in scope:
      total += min(math.prod(v.aval.shape) * jnp.dtype(v.aval.dtype).itemsize
                   for v in eqn.invars[:2])
      continue
    inner = sum(attention_kv_bytes(j, scope) for j in _sub_jaxprs(eqn))
    total += inner * (_compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1)
  return total


def _kv_row(loss_fn, params, batch, remat) -> float:
  """`attention_kv_bytes` of the loss's forward pass on one row."""
  f = functools.partial(loss_fn, remat=remat) if remat is not None else loss_fn
  jaxpr = jax.make_jaxpr(with_kernel(f, attention="xla"))(params, _rows(batch, 1)).jaxpr
  return attention_kv_bytes(jaxpr)


def _longest_scan(jaxpr, best=None):
  """(length, carry avals) of the longest `scan` over stacked inputs in the jaxpr (a scan
  over layers), nested ones included. Loops that only count (`fori_loop`s, e.g. the loss's
  walk over token chunks, longer than the layers at long sequences) take no stacked
  inputs and are left out."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and _compat.scan_parts(eqn).xs:
      scan = _compat.scan_parts(eqn)
      n, carry = scan.length, [v.aval for v in scan.carry]
      if best is None or n > best[0]:
        best = (n, carry)
    for j in _sub_jaxprs(eqn):
      best = _longest_scan(j, best)
  return best


def _stack_scan(jaxpr, limit: float, best=None):
  """(bytes scanned over, length, carry avals) of the first scan over the most bytes up to
  `limit` (the params' bytes: a layer stack's forward scan, not its transpose, which runs
  over residuals too), nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      scan = _compat.scan_parts(eqn)
      xs = _nbytes([v.aval for v in scan.xs])
      if xs <= limit and (best is None or xs > best[0]):
        best = (xs, scan.length, [v.aval for v in scan.carry])
    for j in _sub_jaxprs(eqn):
      best = _stack_scan(j, limit, best)
  return best


def _stack_flops(jaxpr, length: int, nbytes: float) -> float:
  """FLOPs of the scans of `length` iterations over at least `nbytes` (the layer stack's
  forward scan, and its transpose, which runs over the params and residuals)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    scan = _compat.scan_parts(eqn) if eqn.primitive.name == "scan" else None
    if scan and scan.length == length and _nbytes([v.aval for v in scan.xs]) >= nbytes:
      total += _eqn_flops(eqn, "").total
    else:
      total += sum(_stack_flops(j, length, nbytes) for j in _sub_jaxprs(eqn))
  return total


def takes_remat(loss_fn) -> bool:
  """Whether `loss_fn` accepts a `remat` keyword (then the planner chooses it)."""
  return takes(loss_fn, "remat")


def takes(loss_fn, keyword: str) -> bool:
  """Whether `loss_fn` accepts `keyword` (`remat`, `microbatches`: the planner chooses it)."""
  try:
    return keyword in inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):
    return False


def _rows(batch, n: int):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + tuple(x.shape[1:]), x.dtype), batch)


def _as_run(loss_fn, remat, interpret):
  """The loss as the target runs it: `remat` bound (None: the loss takes none), the Pallas
  kernels in interpret mode if `interpret` (`profile`)."""
  f = functools.partial(loss_fn, remat=remat) if remat is not None else loss_fn
  return with_kernel(f, interpret=True) if interpret else f


def _traced(loss_fn, params, batch, remat, interpret):
  """(FlopCount with the reference attention and grouped matmuls, Pallas kernels under the
  attention scope as the loss runs, the reference jaxpr) of the loss's value and gradient on
  one row."""
  f = functools.partial(loss_fn, remat=remat) if remat is not None else loss_fn
  grad = lambda fn: jax.make_jaxpr(jax.value_and_grad(fn))(params, _rows(batch, 1)).jaxpr
  # The references: XLA attention, and experts' grouped matmuls as `ragged_dot` (2 x routed
  # rows x k x n; a kernel's declared cost or the tiled form's padding would be the
  # buffers').
  reference = grad(with_kernel(with_experts(f, grouped_matmul="ragged_dot"), attention="xla"))
  kernels = count_flops(grad(_as_run(loss_fn, remat, interpret))).scoped_kernels
  return count_flops(reference), kernels, reference


# TPU memory holds an array in tiles whose minor dimension has 128 lanes. XLA lays out most
# arrays so that little is padded (it may make another dim minor), but an array in a
# kernel's layout, such as the [rows, heads, seq, head_dim] operands of splash attention, keeps
# head_dim minor: at head_dim 64 it takes twice its bytes.
TPU_LANES = 128


def tiled_nbytes(aval) -> float:
  """Bytes of `aval` as a TPU holds it: dims of size 1 dropped, then a minor dim under
  `TPU_LANES` rounded up to it where the dim before it has at least that many elements (the
  kernel-operand case above; a smaller minor pair is laid out the other way round)."""
  shape = [n for n in aval.shape if n != 1]
  if len(shape) > 1 and shape[-1] < TPU_LANES <= shape[-2]:
    shape[-1] = TPU_LANES
  return float(math.prod(shape) * jnp.dtype(aval.dtype).itemsize)


class Residuals(NamedTuple):
  """Bytes per batch row of what `jax.vjp` keeps for the backward pass (`_residuals`):
  `total`; `stream`: those shaped like the residual stream (last dim the scan carry's width,
  replicated by tensor parallelism); `stack`: those stacked over the layer scan (leading dim
  the layer count, the rows second), the rest being the model's head and embedding."""
  total: float
  stream: float
  stack: float


def _inputs_read(jaxpr) -> list[bool]:
  """Which of `jaxpr`'s inputs its equations or outputs read. A call whose body is a jaxpr
  of the call's own operands (a jit, a kernel's pass) reads an operand only where its body
  does: a kernel's backward takes the reference's primals for forward mode over it, and
  reads none of them in reverse mode (XLA drops them)."""
  read = {id(v) for v in jaxpr.outvars}
  for eqn in jaxpr.eqns:
    body = eqn.params.get("jaxpr")
    body = getattr(body, "jaxpr", body)
    if isinstance(body, jcore.Jaxpr) and len(body.invars) == len(eqn.invars):
      read.update(id(v) for v, r in zip(eqn.invars, _inputs_read(body)) if r)
    else:
      read.update(id(v) for v in eqn.invars)
  return [id(v) in read for v in jaxpr.invars]


def _saved(f, params, rows) -> list:
  """The residuals of `jax.vjp(f)` at (params, rows) that its backward pass reads."""
  vjp = jax.eval_shape(lambda p, b: jax.vjp(lambda p: f(p, b), p)[1], params, rows)
  leaves, tree = jax.tree.flatten(vjp)
  out = jax.eval_shape(f, params, rows)
  backward = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(tree, res)(ct))(leaves, out)
  return [leaf if read else None
          for leaf, read in zip(leaves, _inputs_read(backward.jaxpr)[:len(leaves)])]


def _residuals(loss_fn, params, batch, remat, width, interpret, layers: int = 0,
               tiled: bool = False) -> Residuals:
  """The `Residuals` per row of the loss run as `_as_run` runs it (those its backward pass
  reads, `_saved`): traced on one row and on two, a leaf's bytes on two less on one
  (`tiled`: in TPU tiles, `tiled_nbytes`)."""
  f = _as_run(loss_fn, remat, interpret)
  size = tiled_nbytes if tiled else (lambda x: _nbytes([x]))
  one, two = (_saved(f, params, _rows(batch, n)) for n in (1, 2))
  per_row = [(size(b) - size(a), a, b) for a, b in zip(one, two) if a is not None]
  stacked = lambda a, b: (layers > 1 and a.ndim > 1 and a.shape[0] == b.shape[0] == layers
                          and a.shape[1] != b.shape[1])
  return Residuals(
      sum(d for d, _, _ in per_row),
      sum(d for d, _, x in per_row if width and x.shape and x.shape[-1] == width),
      sum(d for d, a, b in per_row if stacked(a, b)))


def in_compute_dtype(tree, compute_dtype):
  """Abstract `tree` as the step computes with it: floating leaves in `compute_dtype` (None:
  as stored), others as they are."""
  cast = lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype) if (
      compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)) else x
  return jax.tree.map(cast, tree)


def profile(params, loss_fn, optimizer, batch, compute_dtype=None,
            interpret: bool = False, tiled: bool = False) -> Profile:
  """Traces `loss_fn` on one and two abstract rows (nothing runs). `params`: abstract params
  in their stored dtype; `compute_dtype`: the policy's compute dtype (None: as stored).
  Call it inside `jax.set_mesh` of one target device so kernels choose as they will there.
  FLOPs are counted with `fnscale.attention`'s XLA reference (`with_kernel(attention="xla")`),
  residual bytes with the kernels the loss chooses; `interpret`: with the Pallas kernels in
  interpret mode (`with_kernel(interpret=True)`: on a host standing in for an accelerator);
  `tiled`: residual bytes as a TPU holds them (`tiled_nbytes`)."""
  cparams = in_compute_dtype(params, compute_dtype)
  remat = takes_remat(loss_fn)
  c0, kernels, jx = _traced(loss_fn, cparams, batch, False if remat else None, interpret)
  c1 = _traced(loss_fn, cparams, batch, True, interpret)[0] if remat else c0
  scan = _longest_scan(jx)
  stack = _stack_scan(jx, _nbytes(cparams)) or (0.0, 0, [])
  layers = scan[0] if scan else 1
  stream_row = _nbytes(scan[1]) if scan else 0.0  # traced with one row
  width = scan[1][0].shape[-1] if scan and scan[1] and scan[1][0].shape else 0
  res = functools.partial(_residuals, loss_fn, cparams, batch, width=width,
                          interpret=interpret, layers=layers, tiled=tiled)
  a0 = res(False if remat else None)
  a1 = res(True) if remat else a0
  opt = jax.eval_shape(optimizer.init, params)
  first = jax.tree.leaves(batch)[0]
  moe = _experts(jx, width, math.prod(first.shape[1:]))
  return Profile(
      params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
      param_bytes=_nbytes(params), opt_bytes=_nbytes(opt), compute_bytes=_nbytes(cparams),
      grad_bytes=_nbytes(params), flops_row=c0.total, flops_row_remat=c1.total,
      act_row=a0.total, act_row_remat=a1.total, layers=layers, stream_row=stream_row,
      rows=int(first.shape[0]), has_remat=remat, attn_row=c0.attention,
      attn_row_remat=c1.attention, causal_share=c0.causal / c0.attention if c0.attention else 0.0,
      attn_kernel=kernels > 0, tokens_row=math.prod(first.shape[1:]),
      uncounted=c0.uncounted + tuple(k for k in c1.uncounted if k not in c0.uncounted),
      act_row_stream=a0.stream, act_row_remat_stream=a1.stream,
      act_row_layer=a0.stack / layers, act_row_head=a0.total - a0.stack,
      stack_layers=stack[1], stack_bytes=stack[0], stack_stream_row=_nbytes(stack[2]),
      stack_flops_row=_stack_flops(jx, stack[1], stack[0]) if stack[1] else 0.0,
      experts=moe.experts, expert_k=moe.k, expert_params=moe.params,
      exchange_row=moe.exchange_row, expert_act_row=moe.act_row,
      kv_row=_kv_row(loss_fn, cparams, batch, False if remat else None))


class Estimate(NamedTuple):
  """One candidate's predicted cost. Bytes per device; seconds per step.

  `params`, `opt`, `grads` (with the accumulator), `weights` (gathered compute-dtype weights
  in flight), `acts` (activations): the parts of `bytes`; `compute_s` at peak; `comm_s`:
  axis name -> seconds of its collectives; `step_s` per the overlap assumption; `mfu`:
  model FLOPs / (step x devices x peak), an upper bound; `comm_ratio`: communication /
  compute time; `memory_s`: the memory traffic's seconds (`memory_traffic`), part of
  `compute_s`; `recompute_s`: remat's recomputation at peak, part of `compute_s`.
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
  recompute_s: float = 0.0

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


def executed_flops_row(prof: Profile, remat: bool) -> tuple[float, float]:
  """(FLOPs per row the program executes, of which remat's recomputation). Model FLOPs
  (`flops_row`, `flops_row_remat` with remat) less what a causal attention kernel skips
  (`CAUSAL_SAVING` of the causal calls' attention, only where a kernel serves them)."""
  def run(r):
    attn = prof.attn_row_remat if r else prof.attn_row
    skipped = attn * prof.causal_share * CAUSAL_SAVING if prof.attn_kernel else 0.0
    return (prof.flops_row_remat if r else prof.flops_row) - skipped
  return run(remat), (run(True) - run(False) if remat else 0.0)


# The share of one layer's residuals live at the peak of its recomputed backward pass under
# remat: XLA fuses the elementwise ones into the backward's kernels instead of keeping them.
# Fitted on XLA:TPU's peak memory of compiled steps (GPT small and medium at 8-32 rows of
# 1024 tokens, Llama-3.2-1B, on v5e: 0.33-0.53 per program); `recipes/bench/memory.py`
# measures it.
REMAT_LIVE = 0.4


def act_per_row(prof: Profile, remat: bool, tensor: int) -> tuple[float, float]:
  """(live activation bytes, activation bytes written and read) per row of a microbatch on
  one device of a `tensor`-way tensor-parallel group: residuals shaped like the residual
  stream are replicated over the group, the rest split. Without remat both are the
  residuals. With remat the live ones are the checkpoints and, at the peak, the larger of
  the head's residuals (its backward runs first) and the `REMAT_LIVE` share of one layer's
  recomputed ones (each layer's backward); the traffic is the checkpoints' plus every
  residual's again (`memory_traffic`)."""
  split = lambda total, stream: stream + (total - stream) / tensor
  full = split(prof.act_row, prof.act_row_stream)
  if not remat:
    return full, full
  kept = split(prof.act_row_remat, prof.act_row_remat_stream)
  share = full / prof.act_row if prof.act_row else 1.0  # the head and a layer split alike
  layer = prof.act_row_layer * share or full / max(prof.layers, 1)
  head = prof.act_row_head * share
  return kept - head + max(head, REMAT_LIVE * layer), kept + full


def memory_traffic(prof: Profile, remat: bool, rows_mb: float, accum: int,
                   shard: int, tensor: int = 1) -> float:
  """Bytes one device moves through HBM per step outside its matmuls.

  The optimizer update reads the trained params (not frozen ones), gradients and optimizer
  state and writes params and state once per step (the device's 1/`shard`). Activations, per
  row of each of `accum` microbatches of `rows_mb` rows: without remat, the forward pass
  writes the residuals and the backward reads them (2 x `act_row`). Remat keeps only the
  checkpoints between blocks (written and read: 2 x `act_row_remat`), but recomputation
  writes the same intermediates again and the backward reads them (2 x `act_row` more):
  remat never moves fewer bytes. `rows_mb` counts the rows of the device's tensor-parallel
  group (`act_per_row`).
  """
  update = (2 * prof.trained_bytes + prof.grad_bytes + 2 * prof.opt_bytes) / shard
  return update + 2 * act_per_row(prof, remat, tensor)[1] * rows_mb * accum


class _Stages(NamedTuple):
  """A candidate's pipeline as the estimate costs it: `stages` S (1: none), `microbatches`
  M, `bytes_share` / `flops_share` of the params / FLOPs in the layer stack (0 without
  stages), `iters` (M + S - 1) / M (the loop's iterations per microbatch's work)."""
  stages: int
  microbatches: int
  bytes_share: float
  flops_share: float
  iters: float

  def keep(self, nbytes: float) -> float:
    """Of a param-shaped tree's bytes, those one stage holds (the stack split S ways)."""
    return nbytes * (1 - self.bytes_share + self.bytes_share / self.stages)


def _stages(prof: Profile, ici: dict, dcn: dict, microbatches: int) -> _Stages:
  s = ici.get("stage", 1) * dcn.get("stage", 1)
  if s == 1:
    return _Stages(1, 1, 0.0, 0.0, 1.0)
  return _Stages(s, microbatches, prof.stack_bytes / prof.compute_bytes if prof.compute_bytes
                 else 0.0, prof.stack_flops_row / prof.flops_row if prof.flops_row else 0.0,
                 (microbatches + s - 1) / microbatches)


def _stage_comm(prof: Profile, pp: _Stages, rows_mb: float, f: int, t: int) -> tuple:
  """Bytes per device per step of a pipeline: (the stage axis's sends, FSDP's gathers and
  reduce-scatters, the stack's in every iteration and the rest once). `rows_mb`: a
  device's rows outside the pipeline (the stage axis splits the batch there)."""
  s, m = pp.stages, pp.microbatches
  one = rows_mb * s / m * prof.stack_stream_row  # one microbatch of a device's stream
  sends = 2 * (m + s - 1 + 2 * (s - 1) * m / s) * one
  stack_c, stack_g = prof.compute_bytes * pp.bytes_share, prof.grad_bytes * pp.bytes_share
  gathers = ((m + s - 1) * (2 * stack_c + stack_g) / s
             + 2 * (prof.compute_bytes - stack_c) + prof.grad_bytes - stack_g)
  return sends, (f - 1) / f * gathers / t


def buffer_factor(prof: Profile, e: int) -> float:
  """How many times the routed copies a dropless layer's receive buffer holds on an expert
  axis of `e` devices: e x min(k, experts / e) / k (1 without experts or axis)."""
  if e <= 1 or not prof.experts or not prof.expert_k:
    return 1.0
  return e * min(prof.expert_k, prof.experts / e) / prof.expert_k


def _split(prof: Profile, shard: int, e: int) -> float:
  """Per-device share of the params' bytes (or state, gradients): the expert weights split
  over `shard` x `e` devices, the rest over `shard`."""
  x = prof.expert_share
  return (1 - x) / shard + x / (shard * e)


def estimate(prof: Profile, hw: Hardware, ici: dict, dcn: dict, remat: bool,
             accum: int, gather: str = "auto", microbatches: int = 1) -> Estimate:
  """Per-device bytes and step time of one candidate (see the module docstring for the
  formulas and the overlap assumption). `ici`/`dcn`: axis -> size ("data", "fsdp",
  "tensor", "stage", "expert", "context"; "replica" or "stage" across slices); the global
  batch must divide over the data axes (the expert and stage axes among them) and `accum`.
  `gather`: `train_step`'s accum_gather, costed as it compiles: "auto" is "once" where
  nothing is split over fsdp or context, or where whole compute-dtype params and a whole
  accumulator take at most `fnscale._step.ONCE_SHARE` of the device's memory (not on CPU,
  whose memory the step doesn't know), else "per_microbatch"; "per_microbatch" keeps
  params and the float32 accumulator sharded and gathers / reduce-scatters over fsdp in
  every microbatch, and reduces over the data and DCN axes in every microbatch too (the
  accumulator is sharded as the params, so whole over those axes); "once" (with accum > 1)
  holds whole compute-dtype params and a whole float32 accumulator (split by tensor only),
  gathers and reduces once per step. `microbatches`: the pipeline's, with a "stage" axis
  (accum 1). A context axis splits each row's activations and work, and the params with
  fsdp (one group)."""
  d, f, t, c = (ici.get(a, 1) for a in ("data", "fsdp", "tensor", "context"))
  e = ici.get("expert", 1)
  whole = (prof.compute_bytes + prof.grad_bytes) / t  # "once"'s whole params and accumulator
  auto_once = f * c == 1 or (hw.kind != "cpu" and whole <= _step.ONCE_SHARE * hw.memory_limit)
  once = accum > 1 and (gather == "once" or gather == "auto" and auto_once)
  r = math.prod(dcn.values()) if dcn else 1
  pp = _stages(prof, ici, dcn, microbatches)
  n = hw.num_devices
  shard = f * c * t  # params split over the fsdp x context group and tensor
  # This device's share of params, state and gradients: the expert weights split over the
  # expert axis too, the layer stack over the pipeline stages.
  share = pp.keep(_split(prof, shard, e))
  rows_mb = prof.rows / (r * d * f * e * ici.get("stage", 1)) / accum
  rows_act = rows_mb / c  # a row's activations and work are split over context
  moe_acts = prof.expert_act_row * (buffer_factor(prof, e) - 1) * rows_act * pp.iters
  layer_w = prof.compute_bytes * _split(prof, shard, e) * shard / max(prof.layers, 1) / t
  io = 2 * prof.stack_stream_row * rows_act * pp.stages if pp.stages > 1 else 0.0  # stage 0's
  # The backward's gradients (of the trained params only) are in the compute dtype (the cast
  # to the params' dtype fuses into the update), beside a float32 accumulator with
  # accumulation; without FSDP the weights stored in another dtype are cast whole.
  parts = dict(params=prof.param_bytes * share, opt=prof.opt_bytes * share,
               grads=(prof.trained_compute_bytes + (prof.grad_bytes if accum > 1 else 0.0))
               * share,
               weights=2 * layer_w if f * c > 1 else prof.cast_bytes * share * shard / t,
               acts=act_per_row(prof, remat, t)[0] * rows_act * pp.iters + moe_acts + io)
  if once and f * c > 1:  # the whole accumulator beside the reduced shard; whole params
    parts.update(grads=prof.grad_bytes * share * shard / t + prof.grad_bytes * share,
                 weights=prof.compute_bytes * share * shard / t)
  model_flops = prof.flops_row * prof.rows
  memory = memory_traffic(prof, remat, rows_act * pp.iters, accum, 1 / share, t) / hw.links.hbm
  bubble = 1 - pp.flops_share + pp.flops_share * pp.iters
  run, recompute = (x * bubble * prof.rows / n / hw.peak_flops
                    for x in executed_flops_row(prof, remat))
  compute = run + memory
  bw = axis_bandwidth(hw, {k: v for k, v in ici.items() if v > 1}, dcn)
  comm = _comm(prof, bw, (d, f, t, e, c), dcn, (remat, accum, once, rows_mb), pp)
  total = sum(comm.values())
  step = max(compute, total) if hw.overlap else compute + total
  return Estimate(**parts, compute_s=compute, comm_s=comm, step_s=step,
                  mfu=model_flops / (step * n * hw.peak_flops) if step else 0.0,
                  memory_s=memory, recompute_s=recompute)


def _comm(prof: Profile, bw: dict, sizes: tuple, dcn: dict, run: tuple, pp: _Stages) -> dict:
  """Seconds of each axis's collectives per step (`estimate`'s). `sizes`: (data, fsdp,
  tensor, expert, context); `run`: (remat, accum, once, rows per device per microbatch);
  `pp`: the pipeline (`_stages`). Params' collectives over fsdp and context are one group,
  named "fsdp+context" when both split them ("context", with the K/V traffic, when only it
  does)."""
  (d, f, t, e, c), (remat, accum, once, rows_mb) = sizes, run
  reductions = 1 if once else accum
  frac = lambda k: (k - 1) / k
  split = _split(prof, f * c * t, e)
  share = pp.keep(split)
  rows_act = rows_mb / c * pp.iters  # tokens of a device's rows, per microbatch's work
  comm = {}
  group = [a for a, n in (("fsdp", f), ("context", c)) if n > 1]
  if group:  # a collective over both axes drives both axes' links
    per_step = prof.compute_bytes + prof.grad_bytes if once else accum * (
        2 * prof.compute_bytes + prof.grad_bytes)
    comm["+".join(group)] = frac(f * c) * per_step * split * f * c / sum(bw[a] for a in group)
  if pp.stages > 1:  # the stack's FSDP gathers run in every iteration
    sends, gathers = _stage_comm(prof, pp, rows_mb / c, f * c, t)
    if group:
      comm["+".join(group)] = gathers / sum(bw[a] for a in group)
    # Outside the stack the stage axis is a data axis: its gradients are reduced over it.
    rest = 2 * frac(pp.stages) * prof.grad_bytes * (1 - pp.bytes_share) / (f * c * t)
    comm["stage"] = (sends + rest) / bw["stage"]
  if d > 1:
    comm["data"] = reductions * 2 * frac(d) * prof.grad_bytes * share / bw["data"]
  if t > 1:
    per_layer = (6 if remat else 4) * 2 * frac(t) * prof.stream_row * rows_act
    comm["tensor"] = accum * prof.layers * per_layer / bw["tensor"]
  if e > 1:  # the other params' gradients all-reduced; each layer's copies to and fro
    rest = pp.keep((1 - prof.expert_share) / (f * c * t))
    passes = 6 if remat else 4  # dispatch + combine, forward, backward (and recomputed)
    comm["expert"] = (reductions * 2 * frac(e) * prof.grad_bytes * rest + accum * passes
                      * frac(e) * prof.exchange_row * rows_act) / bw["expert"]
  if c > 1:  # K/V gathered forward (again with remat), their gradients reduce-scattered
    comm["context"] = comm.get("context", 0.0) + (
        (3 if remat else 2) * frac(c) * prof.kv_row * rows_mb * pp.iters * accum / t
        / bw["context"])
  for a, k in dcn.items():
    if k > 1 and a != "stage":
      comm[a] = reductions * 2 * frac(k) * prof.grad_bytes * share / bw[a]
  return comm
