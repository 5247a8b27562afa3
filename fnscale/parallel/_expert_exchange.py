"""The expert layer on one shard: token copies sorted by expert, the SwiGLU experts as grouped
matmuls, and the exchanges that carry copies to their experts' shard and back ("ragged",
"all_gather", the capacity path's all_to_all), with gradients that gather rather than
scatter-add."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fnscale import _autodiff
from fnscale import _compat
from fnscale.kernels._grouped_matmul import grouped_matmul
from fnscale.parallel._expert_routing import Routing


# What the one log line says when forward-mode autodiff meets the layer's custom_vjps.
_NAME = "the expert layer's token permutations and exchange"
_FORWARD = "the JVP of its plain gathers and exchanges"


# ----------------------------------------------------------------------------- helpers


@jax.custom_vjp
def _permute_rows(x, order, inverse):
  """x[order] for a permutation `order` (`inverse` its inverse): its gradient is a gather
  by the inverse, not a scatter-add (scatters are slow on accelerators)."""
  return x[order]


def _permute_fwd(x, order, inverse):
  return x[order], (order, inverse)


def _permute_bwd(res, g):
  order, inverse = res
  return g[inverse], None, None


_permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _permute(x, order, inverse):
  """`_permute_rows` with forward-mode autodiff (the plain gather's JVP)."""
  return _autodiff.reverse_only(_permute_rows, lambda x, order, _: x[order], _NAME,
                                _FORWARD)(x, order, inverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_rows(x, order, inverse, k: int):
  """x[order // k]: token copies in sorted order (copy i of token t is row t k + i before the
  sort), without materialising the k copies; the gradient sums each token's k copies'
  cotangents, a gather by the inverse and a sum (no scatter-add)."""
  return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
  return x[order // k], inverse


def _dispatch_bwd(k, inverse, g):
  return g[inverse].reshape(-1, k, g.shape[-1]).sum(1), None, None


_dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


def _dispatch(x, order, inverse, k: int):
  """`_dispatch_rows` with forward-mode autodiff (the plain gather's JVP)."""
  return _autodiff.reverse_only(lambda x, o, i: _dispatch_rows(x, o, i, k),
                                lambda x, o, _: x[o // k], _NAME, _FORWARD)(x, order, inverse)


def _sort(keys):
  """(stable order sorting `keys`, its inverse)."""
  order = jnp.argsort(keys, stable=True)
  return order, jnp.argsort(order, stable=True)


def _psum(x, axes):
  return jax.lax.psum(x, axes) if axes else x


@jax.custom_jvp
def _padding_without_gradient(x, rows):
  """x, whose rows where `rows` is False get no tangent (nor cotangent): no copy of x."""
  del rows
  return x


@_padding_without_gradient.defjvp
def _padding_without_gradient_jvp(primals, tangents):
  x, rows = primals
  return x, jnp.where(rows, tangents[0], jnp.zeros((), tangents[0].dtype))


def _ffn(xs, w, group_sizes, gmm, tensor):
  """SwiGLU experts over sorted rows: silu(x Wg) * (x Wu) Wd, rows past the groups zero.
  With `tensor` axes the hidden width is split: the down projection's partial sums are
  all-reduced over them. The padding rows are zeroed once, in the output and in the
  input's gradient, not after each grouped matmul (which megablox leaves unwritten there):
  without a mask in them XLA's fused backward of silu and the product writes its results
  over its operands' buffers."""
  rows = (jnp.arange(xs.shape[0]) < jnp.sum(group_sizes))[:, None]
  mm = functools.partial(grouped_matmul, group_sizes=group_sizes,
                         implementation=gmm.implementation, interpret=gmm.interpret,
                         platform=gmm.platform, zero_padding=False)
  xs = _padding_without_gradient(xs, rows)
  h = jax.nn.silu(mm(xs, w["w_gate"])) * mm(xs, w["w_up"])
  y = _psum(mm(h, w["w_down"]), tensor)
  return jnp.where(rows, y, jnp.zeros((), y.dtype))


def _combine(y, weights):
  """[T * k, D] expert outputs in token order -> [T, D], weighted: the product in y's dtype,
  summed in float32 (a product and a sum, not a matmul: no FLOPs beyond the model's 6 x
  active params are counted)."""
  t, k = weights.shape
  y = y.reshape(t, k, -1) * weights[..., None].astype(y.dtype)
  return jnp.sum(y, axis=1, dtype=jnp.float32)


class _Gmm(NamedTuple):
  """The grouped matmul's choice (`fnscale.kernels.gmm_selection`'s fields it runs with)."""
  implementation: str
  interpret: bool
  platform: str


class _Ctx(NamedTuple):
  """Static facts of one call inside the shard_map body."""
  k: int
  experts: int
  ax: str | None  # the expert axis (None: experts not split)
  n: int  # its size
  tokens: tuple[str, ...]  # axes splitting the tokens
  shards: int  # ways they split them
  tensor: tuple[str, ...]  # axes splitting each expert's hidden width
  fsdp: tuple[str, ...]  # axes the weights' d_model is stored split over (FSDP)
  exchange: str
  gmm: _Gmm
  interpret: bool
  cap: int | None  # capacity per expert per sequence (None: dropless)


# ----------------------------------------------------------------------------- dropless


def _local(x, r: Routing, w, c: _Ctx):
  """Every expert on this device: sort copies by expert, grouped matmuls, unsort."""
  flat = r.experts.reshape(-1)
  order, inverse = _sort(flat)
  xs = _dispatch(x, order, inverse, c.k)
  sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
  ys = _ffn(xs, w, sizes, c.gmm, c.tensor)
  return _combine(_permute(ys, inverse, order), r.weights)


def _exclusive_cumsum(v, axis=0):
  return jnp.cumsum(v, axis=axis) - v


def _ragged_exchange(operand, output, offsets, sizes, out_offsets, recv, c: _Ctx):
  """`jax.lax.ragged_all_to_all` over the expert axis, or its stand-in with `interpret`."""
  if not c.interpret or c.gmm.platform in ("tpu", "cuda", "rocm"):
    return jax.lax.ragged_all_to_all(operand, output, offsets, sizes, out_offsets, recv,
                                     axis_name=c.ax)
  # The stand-in: every shard's operand gathered, each sender's slice placed where
  # ragged_all_to_all would write it (its `output_offsets` as seen by the receiver).
  everything = jax.lax.all_gather(operand, c.ax)
  from_offsets = jax.lax.all_to_all(offsets, c.ax, 0, 0, tiled=True)
  to_offsets = jax.lax.all_to_all(out_offsets, c.ax, 0, 0, tiled=True)
  rows = jnp.arange(output.shape[0])
  for s in range(c.n):
    inside = (rows >= to_offsets[s]) & (rows < to_offsets[s] + recv[s])
    src = jnp.clip(from_offsets[s] + rows - to_offsets[s], 0, operand.shape[0] - 1)
    output = jnp.where(inside[:, None], everything[s][src], output)
  return output


class _Slices(NamedTuple):
  """One ragged exchange's slices (`jax.lax.ragged_all_to_all`'s arguments), int32 [n]:
  where each destination's rows start in the operand, how many, where they land in the
  destination's buffer, and how many rows arrive from each source."""
  offsets: jax.Array
  sizes: jax.Array
  out_offsets: jax.Array
  recv: jax.Array




def _vary_over(x, axes):
  """x marked varying over the manual `axes` (where it isn't yet)."""
  missing = tuple(a for a in axes if a not in _compat.varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _exchange(c: _Ctx, rows: int, x, there: _Slices):
  """x's slices sent per `there` into [rows, D] buffers (typed as varying over the token
  axes, which they do: an invariant buffer would make the layer's gradients all-reduce
  their cotangents over the expert axis)."""
  return _vary_over(_ragged_exchange(x, _vary_over(jnp.zeros((rows, x.shape[1]), x.dtype),
                                                   c.tokens), *there, c), c.tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_rows(c: _Ctx, rows: int, x, there: _Slices, back: _Slices):
  """x's slices sent per `there` into [rows, D] buffers; the gradient returns by `back`
  (the same rows the other way), one ragged all-to-all each way (jax's own transpose would
  all-reduce the zero buffer's cotangent over the expert axis)."""
  del back  # the way back, for the gradient
  return _exchange(c, rows, x, there)


def _send_fwd(c, rows, x, there, back):
  return _exchange(c, rows, x, there), (x.shape[0], back)


def _send_bwd(c, rows, res, g):
  del rows
  size, back = res
  g = _ragged_exchange(g, _vary_over(jnp.zeros((size, g.shape[1]), g.dtype), c.tokens),
                       *back, c)
  return _vary_over(g, c.tokens), None, None  # x's type: varying over the token axes


_send_rows.defvjp(_send_fwd, _send_bwd)


def _send(c: _Ctx, rows: int, x, there: _Slices, back: _Slices):
  """`_send_rows` with forward-mode autodiff (the exchange's own JVP)."""
  return _autodiff.reverse_only(lambda x, t, b: _send_rows(c, rows, x, t, b),
                                lambda x, t, _: _exchange(c, rows, x, t), _NAME,
                                _FORWARD)(x, there, back)


def _ragged(x, r: Routing, w, c: _Ctx):
  """Dropless over the expert axis by ragged all-to-all: each shard sends its copies,
  sorted by expert, to the shards holding their experts and gets their outputs back."""
  e_local, me = c.experts // c.n, jax.lax.axis_index(c.ax)
  flat = r.experts.reshape(-1)
  order, inverse = _sort(flat)
  xs = _dispatch(x, order, inverse, c.k)
  sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
  every = jax.lax.all_gather(sizes, c.ax)  # [n, E]: what each shard routes to each expert
  sent = every.reshape(c.n, c.n, e_local).sum(-1)  # sent[s, j]: rows shard s sends shard j
  go = _Slices(_exclusive_cumsum(sent[me]), sent[me], _exclusive_cumsum(sent, 0)[me],
               sent[:, me])
  ret = _Slices(_exclusive_cumsum(sent[:, me]), sent[:, me],
                _exclusive_cumsum(sent, 1)[:, me], sent[me])
  buffer = c.n * x.shape[0] * min(c.k, e_local)
  got = _send(c, buffer, xs, go, ret)
  # Received: from each source in turn, its rows for my experts, by local expert.
  local = jax.lax.dynamic_slice_in_dim(every, me * e_local, e_local, axis=1)  # [n, E_l]
  keys = jnp.repeat(jnp.tile(jnp.arange(e_local), c.n), local.reshape(-1),
                    total_repeat_length=buffer)
  keys = jnp.where(jnp.arange(buffer) < jnp.sum(local), keys, e_local)
  lorder, linverse = _sort(keys)
  ys = _ffn(_permute(got, lorder, linverse), w, local.sum(0).astype(jnp.int32), c.gmm,
            c.tensor)
  back = _send(c, xs.shape[0], _permute(ys, linverse, lorder), ret, go)
  return _combine(_permute(back, inverse, order), r.weights)


def _gathered(x, r: Routing, w, c: _Ctx):
  """Dropless over the expert axis by all-gather: each shard runs its experts over the
  copies its group routed to them; a reduce-scatter sums each token's outputs home."""
  e_local, me = c.experts // c.n, jax.lax.axis_index(c.ax)
  xg = jax.lax.all_gather(x, c.ax, tiled=True)
  eg = jax.lax.all_gather(r.experts, c.ax, tiled=True).reshape(-1)
  wg = jax.lax.all_gather(r.weights, c.ax, tiled=True)
  keys = jnp.where(eg // e_local == me, eg % e_local, e_local)
  order, inverse = _sort(keys)
  rows = xg.shape[0] * min(c.k, e_local)  # every copy for my experts sorts first
  xs = _dispatch(xg, order, inverse, c.k)[:rows]
  sizes = jnp.bincount(keys, length=e_local + 1)[:e_local].astype(jnp.int32)
  ys = _ffn(xs, w, sizes, c.gmm, c.tensor)
  ys = jnp.pad(ys, ((0, eg.shape[0] - rows), (0, 0)))
  out = _combine(_permute(ys, inverse, order), wg)
  return jax.lax.psum_scatter(out, c.ax, scatter_dimension=0, tiled=True)


# ----------------------------------------------------------------------------- capacity


def _positions(experts, seq: int, num_experts: int):
  """1-based position of each token copy in its expert's queue within its sequence, in
  token order (copies of one token in choice order). experts: [rows * seq, k]."""
  rows = experts.shape[0] // seq
  onehot = jax.nn.one_hot(experts.reshape(rows, -1), num_experts, dtype=jnp.int32)
  pos = jnp.cumsum(onehot, axis=1) * onehot  # [rows, seq * k, E]
  return pos.sum(-1).reshape(experts.shape)


def _capacity(x, r: Routing, w, c: _Ctx, seq: int):
  """Capacity path: copies past an expert's capacity per sequence are dropped; experts run
  as a batched matmul over [experts, rows x capacity] buffers, exchanged by all_to_all."""
  t, d = x.shape
  rows = t // seq
  pos = _positions(r.experts, seq, c.experts)
  kept = pos <= c.cap
  slot = (jnp.arange(t)[:, None] // seq) * c.cap + pos - 1  # [T, k]
  slot = jnp.where(kept, slot, rows * c.cap)  # out of range: dropped by the scatter
  xs = jnp.zeros((c.experts, rows * c.cap, d), x.dtype)
  xs = xs.at[r.experts, slot].set(jnp.broadcast_to(x[:, None], (t, c.k, d)), mode="drop")
  if c.n > 1:  # [E, S, D] -> [E_l, n * S, D]: my experts' slots from every shard
    xs = jax.lax.all_to_all(xs, c.ax, 0, 1, tiled=True)
  h = jax.nn.silu(jnp.einsum("esd,edf->esf", xs, w["w_gate"])) * jnp.einsum(
      "esd,edf->esf", xs, w["w_up"])
  ys = _psum(jnp.einsum("esf,efd->esd", h, w["w_down"]), c.tensor)
  if c.n > 1:
    ys = jax.lax.all_to_all(ys, c.ax, 1, 0, tiled=True)
  y = ys.at[r.experts, slot].get(mode="fill", fill_value=0)  # [T, k, D]
  out = _combine(y.reshape(t * c.k, d), r.weights * kept)
  return out, jnp.sum(~kept).astype(jnp.int32)
