"""Int8 matmuls for training: symmetric per-channel quantization with straight-through gradients.

TPU v5e multiplies int8 at twice its bf16 rate (394 vs 197 TOP/s per chip). `dense(x, w, n)`
computes `x @ w` (the last n dims of x against the first n of w) as

  forward        y  = (q(x) @ q(w)) * s_x * s_w      x per row (token), w per output column
  input grad     dx = (q(g) @ q(w)^T) * s_g * s_w'   g per row, w per input row
  weight grad    dw = x^T @ g                        in x's dtype, float32 accumulation

where q(a) = round(a / s) in int8, s = max|a| / 127 over the contracted dim (the scale of
each row or column), and the int8 products accumulate in int32 (`lax.dot_general`'s
`preferred_element_type`). The gradients treat the rounding as the identity
(straight-through: Bengio et al. 2013; Jacob et al. 2018 for per-channel int8 training); the
weight gradient stays in bf16 because it sums over every token, where int8's rounding of
rows would add up. Two of a layer's three matmuls run in int8.

On a TPU both int8 matmuls run as `fs.kernels.int8_matmul`, which quantizes the activations
(x, and g for the input gradient) tile by tile inside the kernel: XLA would quantize them in
a pass of its own, unfused into the int8 dot, costing more than the int8 rate saves. Only the
weights are quantized in XLA (K x N values, not M x K). `fs.kernels.int8_selection` decides
(the kernel where the shapes tile, else XLA's quantize and `lax.dot_general`, which a TPU
run logs once per shape). The output is named `OUTPUT`, for remat policies to save: a
policy sees no dot inside the custom_vjp, and "dots" without the name reran the forward's
quantize and int8 product in the backward pass.

Example:
  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.key(0), (8, 64))
  >>> w = jax.random.normal(jax.random.key(1), (64, 32))
  >>> err = jnp.abs(dense(x, w) - x @ w).max() / jnp.abs(x @ w).max()
  >>> bool(err < 0.02)
  True
"""
from __future__ import annotations

import functools
import math

from absl import logging
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax import lax

import fnscale as fs

# The checkpoint name of a dense's output: a remat policy that saves it spares the forward's
# rerun (its product, the kernel's or XLA's inside the custom_vjp, is no dot a policy sees).
OUTPUT = "int8_dense"

# TPU generations where `--int8` did not pay at train_lm's widths, so the main job says so
# when asked for it there: on v5e, with the kernel, GPT small trained at 0.70x bfloat16's
# tokens/s, GPT medium 0.81x, the 766M Llama 1.02x; a matmul's forward + backward gains at
# most 1.28x, and the kernel's output leaves unfused the layouts and bias adds XLA fuses into
# its own dots (recipes/bench/README.md, '`--int8` by part').
SLOWER_ON = ("v5e",)


def quantize(a: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(int8 values, float32 scales) of a 2-d array, symmetric, one scale per slice along the
  other axis: `a ~= q * s` with s = max|a| / 127 over `axis` (kept as a size-1 dim); the
  kernel's own quantization (`fs.kernels.quantize_rows`)."""
  if axis == 1:
    return fs.kernels.quantize_rows(a)
  q, s = fs.kernels.quantize_rows(a.T)
  return q.T, s.T


def _int8_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [m, k] @ b [k, n] in float32 through int8: a quantized per row, b per column."""
  qa, sa = quantize(a, 1)
  qb, sb = quantize(b, 0)
  y = lax.dot_general(qa, qb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  return y.astype(jnp.float32) * sa * sb


@functools.lru_cache(maxsize=None)
def _say(what: str, reason: str) -> None:
  # Cached only so that each shape is named once; it holds no decision.
  logging.warning("int8 matmul %s runs on %s: its quantize of the activations is an XLA "
                  "pass of its own", what, reason)


def _selection(a: jax.Array, b: jax.Array, how: tuple) -> fs.kernels.Int8Selection:
  """What runs a [m, k] @ b [k, n] for `how` (implementation, interpret, tiles)."""
  implementation, interpret, tiles = how
  return fs.kernels.int8_selection(a.shape, b.shape, a.dtype, implementation=implementation,
                                   interpret=interpret, tiles=tiles)


def _product(a: jax.Array, b: jax.Array, how: tuple) -> jax.Array:
  """a [m, k] @ b [k, n] through int8 in a's dtype: the kernel where `_selection` says it
  serves, else XLA."""
  sel, interpret = _selection(a, b, how), how[1]
  if sel.implementation == "xla":
    if sel.requested != "xla" and (sel.platform == "tpu" or interpret):
      _say(f"{a.shape} @ {b.shape}", sel.reason)
    return _int8_matmul(a, b).astype(a.dtype)
  qb, sb = quantize(b, 0)  # the kernel chooses tiles for a device's rows under a mesh
  return fs.kernels.int8_matmul(a, qb, sb[0], tiles=how[2], interpret=sel.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, how: tuple) -> jax.Array:
  return _product(x, w, how)


def _matmul_fwd(x, w, how):
  return _matmul(x, w, how), (x, w)


def _matmul_bwd(how, residuals, g):
  x, w = residuals
  dx = _product(g, w.T, how).astype(x.dtype)
  dw = lax.dot_general(x, g.astype(x.dtype), (((0,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32).astype(w.dtype)
  return dx, dw


# optimize_remat: under jax.checkpoint the residuals (x, w) are taken without rerunning the
# forward's product.
_matmul.defvjp(_matmul_fwd, _matmul_bwd, optimize_remat=True)


def dense(x: jax.Array, w: jax.Array, contract: int = 1, *, implementation: str = "auto",
          interpret: bool = False, tiles: tuple[int, int] | None = None) -> jax.Array:
  """`jnp.tensordot(x, w, contract)` with int8 forward and input-gradient matmuls (above).

  Args:
    x: activations [..., c_1..c_n] (bfloat16 or float32).
    w: weights [c_1..c_n, o_1..o_m], cast to x's dtype.
    contract: n, the trailing dims of x contracted with the leading dims of w.
    implementation: "auto" (the kernel on a TPU where it serves, else XLA), "pallas" or
      "xla" (`fs.kernels.int8_selection`).
    interpret: the kernel in Pallas interpret mode (any platform; for tests).
    tiles: the kernel's (bm, bn); None: its choice.

  Returns:
    [..., o_1..o_m] in x's dtype, named `OUTPUT` for remat policies.

  Raises:
    KernelError: implementation="pallas" for a shape the kernel can't serve.
  """
  lead, inner, out = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:], w.shape[contract:]
  x2 = x.reshape(-1, math.prod(inner))
  w2 = w.astype(x.dtype).reshape(math.prod(inner), math.prod(out))
  how = (implementation, interpret, None if tiles is None else tuple(tiles))
  y = checkpoint_name(_matmul(x2, w2, how), OUTPUT)
  return y.reshape(*lead, *out)


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`jnp.einsum(subscripts, x, w)` through `dense`, for a weight w whose leading dims are
  contracted with x's trailing ones and whose other dims follow x's in the output
  ("bsd,dhk->bshk", "bshk,hkd->bsd").

  Raises:
    ValueError: subscripts of another form (or a w that is no array, e.g. a LoRA-bound one).
  """
  lhs, _, out = subscripts.partition("->")
  xs, ws = lhs.split(",")
  n = len(xs) - len(xs.rstrip(ws))  # x's trailing dims that w has
  if (not isinstance(w, jax.Array) or n == 0 or ws[:n] != xs[len(xs) - n:]
      or out != xs[:len(xs) - n] + ws[n:]):
    raise ValueError(f"int8 einsum {subscripts!r} on {type(w).__name__}: expected a weight "
                     "array contracted over its leading dims, e.g. 'bsd,dhk->bshk'")
  return dense(x, w, n)
