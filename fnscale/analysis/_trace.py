"""What one training step needs, read off the loss's own traced program: `profile`.

No model description is needed: FLOPs of every `dot_general` in the jaxpr of
`value_and_grad(loss)` (scan bodies times their length), traced with `fnscale.attention`'s
XLA reference so that attention counts whatever kernel serves it on the target (a Pallas
kernel's FLOPs are not visible in a jaxpr unless it declares a `cost_estimate`; jax's splash
attention declares none), and activation bytes as the residuals `jax.vjp` keeps, per batch
row, traced as the loss runs on the target. `fnscale.analysis._cost` turns the `Profile` into
bytes and step time on a mesh.
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
from fnscale.kernels._attention import CAUSAL_SCOPE, SCOPE, with_kernel
from fnscale.parallel._experts import with_experts

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
  per row (what context parallelism's all-gather form gathers); `q_row` of its queries (and
  so of its outputs; what the Ulysses form exchanges beside K/V); `heads`, `kv_heads`: the
  attention calls' (the gcd over them; 0 where unknown); `head_dim` their heads' dims (the
  gcd; 0 where unknown).
  `act_row_layer`: one layer's residuals per row without remat or policy (the layer scan's
  stacked residuals over its length: what remat recomputes at once); `act_row_head`: the
  residuals outside the layer scan per row (embedding, final norm, output layer); 0 where
  unknown.
  On a TPU target every residual figure counts the tiles a TPU holds (`tiled_nbytes`).
  Frozen params (a LoRA base: no gradient, no optimizer state; 0 without):
  `frozen_bytes` / `frozen_compute_bytes`, their part of `param_bytes` / `compute_bytes`.
  `update_reduced_bytes`: bytes the optimizer update's reductions read (`reduced_bytes` of
  `optimizer.update` traced on the trained params): each is a pass over param-sized arrays
  that the update's fused elementwise pass can't share.
  `act_row_moved`: where remat off runs a checkpoint policy (`plan`'s `remat_off`), the
  residuals per row of the loss without one (what the step writes and reads: the policy
  recomputes the rest), `act_row` holding the policy's; 0: `act_row`. `remat_off`: the
  loss's `remat=` that `act_row` was traced with (False: none).
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
  q_row: float = 0.0
  heads: int = 0
  kv_heads: int = 0
  head_dim: int = 0
  act_row_layer: float = 0.0
  act_row_head: float = 0.0
  frozen_bytes: float = 0.0
  frozen_compute_bytes: float = 0.0
  update_reduced_bytes: float = 0.0
  act_row_moved: float = 0.0
  remat_off: object = False

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


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                         "argmin", "reduce_and", "reduce_or"})


def reduced_bytes(jaxpr) -> float:
  """Bytes of the arrays reduced in `jaxpr`, each array once however many reductions read it
  (sub-jaxprs included, a scan's body times its length). A reduction's result is needed
  before the elementwise work that uses it, so XLA reads what it reduces in a pass of its
  own, one pass for sibling reductions of one array (a multi-output fusion): the global-norm
  clip's sum of squares of the gradients; Adafactor's row and column statistics of g^2 (one
  pass) and its update's RMS (clipped at 1). So AdamW's update reads the gradients once more
  and Adafactor's three times more than its elementwise pass; on one v5e chip (libtpu
  0.0.42.1) the compiled update of a [8, 2048, 8192] float32 param (`optax.apply_updates`
  included) accesses 8.0 x its bytes under AdamW and 6.0 x under Adafactor (its
  `cost_analysis()` "bytes accessed"), as that pass (7 and 3) and these reductions count."""
  total, seen = 0.0, set()
  for eqn in jaxpr.eqns:
    x = eqn.invars[0] if eqn.invars else None
    if eqn.primitive.name in _REDUCTIONS and isinstance(x, jcore.Var) and x not in seen:
      seen.add(x)
      total += _nbytes([x.aval])
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    total += times * sum(reduced_bytes(j) for j in _sub_jaxprs(eqn))
  return total


def update_reduced_bytes(optimizer, params) -> float:
  """`reduced_bytes` of `optimizer.update(grads, state, params)` traced on abstract `params`
  (gradients shaped and typed as the params; nothing runs)."""
  state = jax.eval_shape(optimizer.init, params)
  return reduced_bytes(jax.make_jaxpr(optimizer.update)(params, state, params).jaxpr)


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


def attention_queries(jaxpr, tokens: int, outer: str = "") -> tuple[float, int, int, int]:
  """(bytes, heads, kv heads, head dim) of the queries of every attention call in a forward
  jaxpr of one row of `tokens` traced as `attention_kv_bytes` is: each call's q k^T `dot_general`
  (its result, the scores, larger than either operand) contracts q [tokens, heads, d] with
  k [tokens, kv_heads, d] over d; bytes summed (scan bodies times their length), heads and d
  the gcd over calls (0 without attention)."""
  total, heads, kv, dim = 0.0, 0, 0, 0
  for eqn in jaxpr.eqns:
    scope = outer + "/" + _compat.name_scopes(eqn)
    if eqn.primitive.name == "dot_general" and SCOPE in scope:
      q, k = (v.aval for v in eqn.invars[:2])
      if math.prod(eqn.outvars[0].aval.shape) > max(math.prod(q.shape), math.prod(k.shape)):
        d = math.prod(q.shape[i] for i in eqn.params["dimension_numbers"][0][0])
        total += math.prod(q.shape) * jnp.dtype(q.dtype).itemsize
        heads = math.gcd(heads, math.prod(q.shape) // (tokens * d))
        kv = math.gcd(kv, math.prod(k.shape) // (tokens * d))
        dim = math.gcd(dim, d)
      continue
    for j in _sub_jaxprs(eqn):
      b, h, g, e = attention_queries(j, tokens, scope)
      total += b * (_compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1)
      heads, kv, dim = math.gcd(heads, h), math.gcd(kv, g), math.gcd(dim, e)
  return total, heads, kv, dim


def _attention_row(loss_fn, params, batch, remat) -> tuple[float, float, int, int, int]:
  """(K/V bytes, query bytes, heads, kv heads, head dim) of the loss's attention calls in its
  forward pass on one row (`attention_kv_bytes`, `attention_queries`)."""
  f = functools.partial(loss_fn, remat=remat) if remat is not None else loss_fn
  jaxpr = jax.make_jaxpr(with_kernel(f, attention="xla"))(params, _rows(batch, 1)).jaxpr
  tokens = math.prod(jax.tree.leaves(batch)[0].shape[1:])
  return (attention_kv_bytes(jaxpr), *attention_queries(jaxpr, tokens))


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
            interpret: bool = False, tiled: bool = False, remat_off=False) -> Profile:
  """Traces `loss_fn` on one and two abstract rows (nothing runs). `params`: abstract params
  in their stored dtype; `compute_dtype`: the policy's compute dtype (None: as stored).
  Call it inside `jax.set_mesh` of one target device so kernels choose as they will there.
  FLOPs are counted with `fnscale.attention`'s XLA reference (`with_kernel(attention="xla")`),
  residual bytes with the kernels the loss chooses; `interpret`: with the Pallas kernels in
  interpret mode (`with_kernel(interpret=True)`: on a host standing in for an accelerator);
  `tiled`: residual bytes as a TPU holds them (`tiled_nbytes`); `remat_off`: the loss's
  `remat=` without remat (`PlanOptions.remat_off`)."""
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
  policy = remat and remat_off is not False  # remat off keeps what a policy keeps
  a0 = res(remat_off if policy else False if remat else None)
  a1 = res(True) if remat else a0
  every = res(False) if policy else a0  # what remat recomputes, and the traffic
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
      act_row_layer=every.stack / layers, act_row_head=every.total - every.stack,
      stack_layers=stack[1], stack_bytes=stack[0], stack_stream_row=_nbytes(stack[2]),
      stack_flops_row=_stack_flops(jx, stack[1], stack[0]) if stack[1] else 0.0,
      experts=moe.experts, expert_k=moe.k, expert_params=moe.params,
      exchange_row=moe.exchange_row, expert_act_row=moe.act_row,
      update_reduced_bytes=update_reduced_bytes(optimizer, params),
      act_row_moved=every.total if policy else 0.0,
      remat_off=remat_off if policy else False,
      **dict(zip(("kv_row", "q_row", "heads", "kv_heads", "head_dim"),
                 _attention_row(loss_fn, cparams, batch, False if remat else None))))
