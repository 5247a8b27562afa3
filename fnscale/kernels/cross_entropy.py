"""Softmax cross-entropy over a large vocabulary without materialising the logits.

The unembedding is applied one vocabulary block at a time with an online logsumexp (the
running max/sum rescaling of Milakov & Gimelshein, 2018, arXiv:1805.02867, as used by flash
attention), and a custom gradient recomputes each block's logits in the backward pass, so
neither pass holds more than [tokens, block_size] logits at once. Under a mesh with a
"tensor" axis the vocabulary is split over it (vocab-parallel cross-entropy as in
Megatron-LM, Shoeybi et al. 2019): each device walks its own vocabulary shard, and the
per-token logsumexp and label logit are combined across the axis, so a vocab-sharded
unembedding is never gathered.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from fnscale import _axes
from fnscale.errors import KernelError
from fnscale.kernels.attention import _call_mesh, _varying_axes

# Default vocabulary block: at most this many float32 logits live at once (64 MiB).
_BLOCK_ELEMENTS = 1 << 24
_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(hidden: jax.Array, unembed: jax.Array, labels: jax.Array, *,
                  where: jax.Array | None = None, block_size: int | None = None,
                  z_loss: float = 0.0, reduction: str = "mean",
                  mesh: jax.sharding.Mesh | None = None,
                  vocab_axes: tuple[str, ...] | None = None) -> jax.Array:
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
    mesh: split the vocabulary over this mesh's "tensor" axis (and tokens over its data
      axes) in a `shard_map`; default: the ambient mesh (`fnscale.with_mesh`), else the
      mesh the arguments' shardings name, else none. Used when vocab is divisible by the
      tensor axis size; `block_size` then counts columns of each device's shard.
    vocab_axes: the mesh axes the unembedding's vocabulary dim is split over (those in the
      mesh, of size > 1 and not manual count); default the mesh's "tensor" axis. A data
      axis here (e.g. "fsdp", for an unembedding stored split by vocabulary under FSDP)
      gathers the hidden states and labels over it instead of the unembedding: each device
      scores every token of its group against its own vocabulary columns (the hidden
      states are d / vocab of the unembedding's size), and its gradient is never reduced
      over that axis.

  Returns:
    float32 scalar, or [tokens] for reduction="none".

  Raises:
    KernelError: shapes, dtypes or arguments that don't fit, naming the bad one.
  """
  tokens, vocab = _check(hidden, unembed, labels, where, block_size, z_loss, reduction,
                         vocab_axes)
  per_token = _per_token(hidden, unembed, labels.astype(jnp.int32), block_size,
                         float(z_loss), _call_mesh(mesh, hidden), vocab_axes)
  if where is not None:
    per_token = jnp.where(where, per_token, 0.0)
  if reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if reduction == "sum":
    return total
  count = tokens if where is None else jnp.maximum(jnp.sum(where), 1)
  return total / count


def _check(hidden, unembed, labels, where, block_size, z_loss, reduction, vocab_axes=None):
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
  if vocab_axes is not None and not (isinstance(vocab_axes, (tuple, list)) and all(
      isinstance(a, str) for a in vocab_axes)):
    raise KernelError(f"cross_entropy(vocab_axes={vocab_axes!r}): expected a tuple of mesh "
                      "axis names, e.g. ('fsdp', 'tensor'), or None.")
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


def _per_token(hidden, unembed, labels, block_size, z_loss, mesh, vocab_axes=None):
  """Per-token loss; vocab-parallel in a shard_map when the vocabulary is split over mesh
  axes (`vocab_axes`, default the tensor axis)."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(getattr(mesh, "abstract_mesh", mesh), "manual_axes", ()))
  wanted = _axes.head_axes(mesh) if vocab_axes is None or mesh.empty else vocab_axes
  vocab_axes = tuple(a for a in wanted if a in mesh.axis_names and mesh.shape[a] > 1
                     and a not in manual) if not mesh.empty else ()
  shards = math.prod(mesh.shape[a] for a in vocab_axes)
  if not vocab_axes or unembed.shape[1] % shards or _varying_axes(hidden):
    # (Inside a shard_map that checks varying axes the plain path is used: XLA partitions it.)
    return _loss(*_stats(hidden, unembed, labels, _block(block_size, hidden, unembed)),
                 z_loss)
  token_axes = tuple(a for a in _axes.data_axes(mesh) if mesh.shape[a] > 1
                     and a not in manual and a not in vocab_axes)
  if hidden.shape[0] % math.prod(mesh.shape[a] for a in token_axes):
    token_axes = ()
  tok = token_axes or None

  def local(hidden, unembed, labels):
    # This device's vocabulary columns start at its index along the vocab axes.
    first = lax.axis_index(vocab_axes) * unembed.shape[1]
    lse, label_logit = _stats(hidden, unembed, labels - first,
                              _block(block_size, hidden, unembed))
    top = lax.pmax(lax.stop_gradient(lse), vocab_axes)  # The result doesn't depend on it.
    lse = top + jnp.log(lax.psum(jnp.exp(lse - top), vocab_axes))
    return _loss(lse, lax.psum(label_logit, vocab_axes), z_loss)

  free = frozenset(a for a in mesh.axis_names if a not in manual)
  return jax.shard_map(local, mesh=mesh, in_specs=(jax.P(tok, None), jax.P(None, vocab_axes),
                                                   jax.P(tok)),
                       out_specs=jax.P(tok), axis_names=free, check_vma=False)(
                           hidden, unembed, labels)


def _block(block_size, hidden, unembed) -> int:
  tokens, vocab = hidden.shape[0], unembed.shape[1]
  if block_size is None:
    return min(vocab, max(128, (_BLOCK_ELEMENTS // max(tokens, 1)) // 128 * 128))
  return min(block_size, vocab)


def _loss(lse, label_logit, z_loss):
  return lse - label_logit + z_loss * lse * lse


def _forward(hidden, unembed, labels, block):
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
  return running_max + jnp.log(running_sum), label_logit


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _stats(hidden, unembed, labels, block):
  """Per token: logsumexp of hidden @ unembed, and the logit at the label (0 if the label
  is outside [0, vocab)), float32 [tokens] each, without materialising the logits."""
  return _forward(hidden, unembed, labels, block)


def _stats_fwd(hidden, unembed, labels, block):
  lse, label_logit = _forward(hidden, unembed, labels, block)
  return (lse, label_logit), (hidden, unembed, labels, lse)


def _stats_bwd(block, residuals, grads) -> tuple[Any, Any, None]:
  hidden, unembed, labels, lse = residuals
  g_lse, g_label = grads
  # d lse / d logits = softmax; d label_logit / d logits = onehot(label).

  def step(start, size, carry):
    d_hidden, d_unembed = carry
    w, logits = _block_logits(hidden, unembed, start, size)
    onehot = (labels[:, None] - start) == jnp.arange(size)[None, :]
    d_logits = jnp.exp(logits - lse[:, None]) * g_lse[:, None] + jnp.where(
        onehot, g_label[:, None], 0.0)
    d_hidden = d_hidden + jnp.dot(d_logits.astype(w.dtype), w.T,
                                  preferred_element_type=jnp.float32)
    d_w = jnp.dot(hidden.T, d_logits.astype(hidden.dtype), preferred_element_type=jnp.float32)
    d_unembed = lax.dynamic_update_slice_in_dim(d_unembed, d_w.astype(d_unembed.dtype),
                                                start, axis=1)
    return d_hidden, d_unembed

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(unembed))
  d_hidden, d_unembed = _walk_vocab(unembed.shape[1], block, step, init)
  return d_hidden.astype(hidden.dtype), d_unembed, None


_stats.defvjp(_stats_fwd, _stats_bwd)
