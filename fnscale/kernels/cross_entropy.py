"""Softmax cross-entropy over a large vocabulary without materialising the logits.

The unembedding is applied one vocabulary block at a time with an online logsumexp (the
running max/sum rescaling of Milakov & Gimelshein, 2018, arXiv:1805.02867, as used by flash
attention), and a custom gradient recomputes each block's logits in the backward pass, so
neither pass holds more than [tokens, block_size] logits at once.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from fnscale.errors import KernelError

# Default vocabulary block: at most this many float32 logits live at once (64 MiB).
_BLOCK_ELEMENTS = 1 << 24
_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(hidden: jax.Array, unembed: jax.Array, labels: jax.Array, *,
                  where: jax.Array | None = None, block_size: int | None = None,
                  z_loss: float = 0.0, reduction: str = "mean") -> jax.Array:
  """Cross-entropy of `softmax(hidden @ unembed)` against integer labels, blockwise.

  Equals `optax.softmax_cross_entropy_with_integer_labels(hidden @ unembed, labels)`
  (then reduced), value and gradients with respect to `hidden` and `unembed`, but the
  [tokens, vocab] logits are never materialised: the forward and the backward pass each
  walk the vocabulary in blocks of `block_size` columns, holding [tokens, block_size]
  float32 logits at a time, and the backward recomputes them.

  Args:
    hidden: final hidden states [tokens, d], float (bfloat16 or float32).
    unembed: output projection [d, vocab], float.
    labels: target ids [tokens], integer in [0, vocab) (ids outside give a loss of
      logsumexp, as if the label logit were 0; they are not checked inside jit).
    where: optional bool [tokens]; False marks padding, which adds no loss or gradient.
    block_size: vocabulary columns per block; default: the largest multiple of 128 that
      keeps a block's logits under 2**24 float32 values (64 MiB), at most vocab.
    z_loss: weight of the auxiliary `z_loss * logsumexp**2` term (PaLM, Chowdhery et al.,
      2022, arXiv:2204.02311) added per token; 0 disables it.
    reduction: "mean" (over tokens where `where` is True), "sum", or "none" (per-token
      [tokens], zero where masked).

  Returns:
    float32 scalar, or [tokens] for reduction="none".

  Raises:
    KernelError: shapes, dtypes or arguments that don't fit, naming the bad one.
  """
  tokens, vocab = _check(hidden, unembed, labels, where, block_size, z_loss, reduction)
  if block_size is None:
    block_size = min(vocab, max(128, (_BLOCK_ELEMENTS // max(tokens, 1)) // 128 * 128))
  per_token = _blockwise(hidden, unembed, labels.astype(jnp.int32), block_size,
                         float(z_loss))
  if where is not None:
    per_token = jnp.where(where, per_token, 0.0)
  if reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if reduction == "sum":
    return total
  count = tokens if where is None else jnp.maximum(jnp.sum(where), 1)
  return total / count


def _check(hidden, unembed, labels, where, block_size, z_loss, reduction):
  for name, x in (("hidden", hidden), ("unembed", unembed), ("labels", labels)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise KernelError(f"cross_entropy: {name} must be an array, got {type(x).__name__}.")
  if hidden.ndim != 2 or unembed.ndim != 2 or hidden.shape[1] != unembed.shape[0]:
    raise KernelError(
        f"cross_entropy: hidden {hidden.shape} and unembed {unembed.shape} must be "
        "[tokens, d] and [d, vocab]; reshape hidden to [tokens, d] first.")
  tokens, vocab = hidden.shape[0], unembed.shape[1]
  if not (jnp.issubdtype(hidden.dtype, jnp.floating)
          and jnp.issubdtype(unembed.dtype, jnp.floating)):
    raise KernelError(
        f"cross_entropy: hidden {hidden.dtype} and unembed {unembed.dtype} must be floating.")
  if labels.shape != (tokens,) or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise KernelError(
        f"cross_entropy: labels {labels.shape} {labels.dtype}; expected integer "
        f"[tokens] = ({tokens},).")
  if where is not None and (getattr(where, "shape", None) != (tokens,)
                            or getattr(where, "dtype", None) != jnp.bool_):
    raise KernelError(
        f"cross_entropy: where {getattr(where, 'shape', type(where))} "
        f"{getattr(where, 'dtype', '')}; expected bool [tokens] = ({tokens},).")
  if block_size is not None and (not isinstance(block_size, int) or isinstance(
      block_size, bool) or not 0 < block_size <= vocab):
    raise KernelError(
        f"cross_entropy(block_size={block_size!r}): expected an int in [1, vocab={vocab}].")
  if not isinstance(z_loss, (int, float)) or z_loss < 0:
    raise KernelError(f"cross_entropy(z_loss={z_loss!r}): expected a float >= 0.")
  if reduction not in _REDUCTIONS:
    raise KernelError(
        f"cross_entropy(reduction={reduction!r}): expected one of {_REDUCTIONS}.")
  return tokens, vocab


def _walk_vocab(vocab: int, block: int, step, carry):
  """Runs step(start, size, carry) over [0, vocab) in blocks; a last short block if needed."""
  full = vocab // block
  carry = lax.fori_loop(0, full, lambda i, c: step(i * block, block, c), carry)
  if vocab % block:
    carry = step(full * block, vocab % block, carry)
  return carry


def _block_logits(hidden, unembed, start, size):
  w = lax.dynamic_slice_in_dim(unembed, start, size, axis=1)
  return w, jnp.dot(hidden, w, preferred_element_type=jnp.float32)


def _forward(hidden, unembed, labels, block, z_loss):
  tokens = hidden.shape[0]

  def step(start, size, carry):
    running_max, running_sum, label_logit = carry
    _, logits = _block_logits(hidden, unembed, start, size)
    new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
    running_sum = (running_sum * jnp.exp(running_max - new_max)
                   + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=-1))
    offset = labels - start
    inside = (offset >= 0) & (offset < size)
    picked = jnp.take_along_axis(logits, jnp.clip(offset, 0, size - 1)[:, None], axis=1)
    label_logit = label_logit + jnp.where(inside, picked[:, 0], 0.0)
    return new_max, running_sum, label_logit

  init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32),
          jnp.zeros((tokens,), jnp.float32))
  running_max, running_sum, label_logit = _walk_vocab(unembed.shape[1], block, step, init)
  lse = running_max + jnp.log(running_sum)
  return lse - label_logit + z_loss * lse * lse, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blockwise(hidden, unembed, labels, block, z_loss):
  return _forward(hidden, unembed, labels, block, z_loss)[0]


def _blockwise_fwd(hidden, unembed, labels, block, z_loss):
  loss, lse = _forward(hidden, unembed, labels, block, z_loss)
  return loss, (hidden, unembed, labels, lse)


def _blockwise_bwd(block, z_loss, residuals, g) -> tuple[Any, Any, None]:
  hidden, unembed, labels, lse = residuals
  # d loss / d logits = softmax * (1 + 2 z lse) - onehot(label), per token times g.
  softmax_coef = (g * (1.0 + 2.0 * z_loss * lse))[:, None]

  def step(start, size, carry):
    d_hidden, d_unembed = carry
    w, logits = _block_logits(hidden, unembed, start, size)
    onehot = (labels[:, None] - start) == jnp.arange(size)[None, :]
    d_logits = jnp.exp(logits - lse[:, None]) * softmax_coef - jnp.where(
        onehot, g[:, None], 0.0)
    d_hidden = d_hidden + jnp.dot(d_logits.astype(w.dtype), w.T,
                                  preferred_element_type=jnp.float32)
    d_w = jnp.dot(hidden.T, d_logits.astype(hidden.dtype), preferred_element_type=jnp.float32)
    d_unembed = lax.dynamic_update_slice_in_dim(d_unembed, d_w.astype(d_unembed.dtype),
                                                start, axis=1)
    return d_hidden, d_unembed

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(unembed))
  d_hidden, d_unembed = _walk_vocab(unembed.shape[1], block, step, init)
  return d_hidden.astype(hidden.dtype), d_unembed, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
