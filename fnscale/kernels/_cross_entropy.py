"""Softmax cross-entropy over a large vocabulary without materialising the logits.

The tokens are taken a chunk at a time: a chunk's logits over the whole vocabulary, their
logsumexp and its loss, and, when a gradient is asked for, the gradients with respect to
the chunk's hidden states and (summed over chunks) the unembedding, all in the forward
pass. No pass holds more than [chunk, vocab] float32 logits, and the backward pass only
scales the stored gradients by the incoming cotangent, which is exact because a scalar
loss is linear in its per-token terms: 6 x tokens x d x vocab matmul FLOPs in all (the
logits and one matmul per gradient), as for the plain loss. Per-token losses
(reduction="none") take an arbitrary cotangent per token, so their backward pass recomputes
each chunk's logits instead (8 x tokens x d x vocab).

Under a mesh with a "tensor" axis the vocabulary is split over it (vocab-parallel
cross-entropy as in Megatron-LM, Shoeybi et al. 2019): each device scores its chunk against
its own vocabulary shard, and per token only the shards' max, sum of exponentials and label
logit cross devices, so a vocab-sharded unembedding is never gathered. Hidden states of
[batch, seq, d] keep their sequence split over a context axis (context parallelism): each
device scores its own tokens, and only per-token statistics and the unembedding's
gradient cross it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from fnscale import _autodiff
from fnscale import _axes
from fnscale._errors import KernelError
from fnscale.kernels._per_device import per_device
from fnscale.kernels._attention_call import _call_mesh, _varying_axes

# Default chunk: at most this many float32 logits live at once (32 MiB). A chunk also holds
# the [d, vocab] float32 gradient accumulator, so the chunk is kept at half the logits the
# vocabulary-blocked loss this replaced used: compiled temporaries no larger than before.
_CHUNK_ELEMENTS = 1 << 23
# ... but never fewer tokens than this: each chunk's three matmuls stream the whole [d, vocab]
# unembedding, 2 FLOPs per weight per token, so a chunk of C tokens does C FLOPs per byte of
# bf16 weight; below a chip's FLOP/s over its HBM bytes/s (TPU v5e 240, H100 295) the loss
# waits on memory. At Llama 3's 128256-token vocabulary the 2**23 budget alone gives 64-token
# chunks: recipes/bench/chip.py's one-chip Llama (llama-766m, 8 x 2048 tokens) ran 9.6k
# tokens/s with them and 22.8k with 1024-token chunks, at the same peak HBM.
_MIN_CHUNK_TOKENS = 1024
_REDUCTIONS = ("mean", "sum", "none")
_NAME = "fnscale.cross_entropy"
_FORWARD = "the JVP of its chunked forward pass"


def cross_entropy(hidden: jax.Array, unembed: jax.Array, labels: jax.Array, *,
                  where: jax.Array | None = None, chunk_size: int | None = None,
                  z_loss: float = 0.0, reduction: str = "mean",
                  mesh: jax.sharding.Mesh | None = None,
                  vocab_axes: tuple[str, ...] | None = None,
                  block_size: int | None = None, soft_cap: float | None = None) -> jax.Array:
  """Cross-entropy of `softmax(hidden @ unembed)` against integer labels, chunk by chunk.

  Equals `optax.softmax_cross_entropy_with_integer_labels(hidden @ unembed, labels)`
  (then reduced), value and gradients with respect to `hidden` and `unembed`, but the
  [tokens, vocab] logits are never materialised: the tokens are walked in chunks of
  `chunk_size`, holding [chunk_size, vocab] float32 logits at a time. For "mean" and "sum"
  the gradients are computed in the forward pass and the backward pass scales them (6 x
  tokens x d x vocab matmul FLOPs, as the plain loss); "none" recomputes each chunk's
  logits in the backward pass (8 x tokens x d x vocab).

  Args:
    hidden: final hidden states [tokens, d] or [batch, seq, d], float (bfloat16 or
      float32). Under a mesh, [batch, seq, d] keeps the sequence split over the context
      axes (`fnscale.constrain_batch`'s layout): tokens are never gathered over them
      unless `vocab_axes` names one.
    unembed: output projection [d, vocab], float.
    labels: target ids [tokens] ([batch, seq] for 3-d hidden states), integer in
      [0, vocab) (ids outside give a loss of logsumexp, as if the label logit were 0; they
      are not checked inside jit).
    where: optional bool, the labels' shape; False marks padding, which adds no loss or
      gradient.
    chunk_size: tokens per chunk (of each device's tokens under a mesh); default: the
      largest that keeps a chunk's logits under 2**23 float32 values (32 MiB) but at least
      1024 tokens (fewer leave the chunk's matmuls waiting on the unembedding's bytes),
      preferring a divisor of the tokens (no shorter last chunk) down to half of that, at
      most tokens.
    z_loss: weight of the auxiliary `z_loss * logsumexp**2` term (PaLM, Chowdhery et al.,
      2022, arXiv:2204.02311) added per token; 0 disables it.
    reduction: "mean" (over tokens where `where` is True), "sum", or "none" (per-token,
      the labels' shape, zero where masked).
    mesh: split the vocabulary over this mesh's "tensor" axis and tokens over its data
      axes (and, for [batch, seq, d], the sequence over its context axes) in a
      `shard_map`; default: the ambient mesh (`fnscale.with_mesh`), else the mesh the
      arguments' shardings name, else none. The vocabulary is split when it is divisible
      by the vocab axes' size; a token dim when divisible by its axes' size.
    vocab_axes: the mesh axes the unembedding's vocabulary dim is split over (those in the
      mesh, of size > 1 and not manual count); default the mesh's "tensor" axis. A data
      or context axis here (e.g. "fsdp", for an unembedding stored split by vocabulary
      under FSDP) gathers the hidden states and labels over it instead of the unembedding:
      each device
      scores every token of its group against its own vocabulary columns (the hidden
      states are d / vocab of the unembedding's size), the hidden states' gradient is
      reduce-scattered back over it, and the unembedding's is never reduced over it.
    block_size: removed (it counted vocabulary columns when the loss walked the
      vocabulary); raises KernelError naming `chunk_size`.
    soft_cap: None, or a positive float c: the logits are c tanh(logits / c) (Gemma 2's
      final logit soft-capping), value and gradients.

  Returns:
    float32 scalar, or the labels' shape for reduction="none".

  Raises:
    KernelError: shapes, dtypes or arguments that don't fit, naming the bad one.

  Examples:
    64 tokens in chunks of 16, against optax's loss on the whole [64, 1000] logits:

    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> hidden = jax.random.normal(jax.random.key(0), (64, 32))
    >>> unembed = jax.random.normal(jax.random.key(1), (32, 1000))
    >>> labels = jnp.arange(64) * 7
    >>> @jax.jit
    ... def both(hidden, unembed, labels):
    ...   logits = hidden @ unembed
    ...   return (fs.cross_entropy(hidden, unembed, labels, chunk_size=16),
    ...           optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())
    >>> loss, reference = both(hidden, unembed, labels)
    >>> loss.shape, loss.dtype, bool(jnp.allclose(loss, reference, rtol=1e-5))
    ((), dtype('float32'), True)
  """
  tokens, _ = _check(hidden, unembed, labels, where, chunk_size, z_loss, reduction,
                     vocab_axes, block_size, soft_cap)
  shape = labels.shape
  if hidden.ndim == 2:  # one form inside: [batch, seq, d], here seq 1
    hidden, labels = hidden[:, None], labels[:, None]
    where = None if where is None else where[:, None]
  layout = _layout(hidden, unembed, mesh, vocab_axes, chunk_size, float(z_loss))._replace(
      soft_cap=float(soft_cap or 0.0))
  labels = labels.astype(jnp.int32)
  # Both forms differentiate only in reverse mode (custom_vjp); forward mode takes the JVP
  # of the same chunked walk, which jax differentiates forward without materialising logits.
  plain = lambda h, u, y: _run_loss(layout, h, u, y)[0]
  if reduction == "none":
    per_token = _autodiff.reverse_only(lambda h, u, y: _per_token(h, u, y, layout), plain,
                                       _NAME, _FORWARD)(hidden, unembed, labels)
    per_token = per_token if where is None else jnp.where(where, per_token, 0.0)
    return per_token.reshape(shape)
  # A fixed mean's denominator goes into the per-token weights, so a plain `grad` of the
  # loss scales the gradients computed in the forward pass by exactly 1. A masked mean
  # divides the kernel's sum by the count outside it: a sum over tokens over a count of
  # them, which `train_step` sums exactly over microbatches and shards.
  mask = jnp.ones(labels.shape, jnp.float32) if where is None else where.astype(jnp.float32)
  if reduction == "mean" and where is None:
    mask = mask / tokens
  total = _autodiff.reverse_only(lambda h, u, y, w: _weighted_sum(h, u, y, w, layout),
                                 lambda h, u, y, w: jnp.sum(w * plain(h, u, y)), _NAME,
                                 _FORWARD)(hidden, unembed, labels, mask)
  if reduction == "mean" and where is not None:
    return total / jnp.maximum(jnp.sum(mask), 1.0)
  return total


def _check(hidden, unembed, labels, where, chunk_size, z_loss, reduction, vocab_axes=None,
           block_size=None, soft_cap=None):
  for name, x in (("hidden", hidden), ("unembed", unembed), ("labels", labels)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise KernelError(f"cross_entropy: {name} must be an array, got {type(x).__name__}.")
  if hidden.ndim not in (2, 3) or unembed.ndim != 2 or hidden.shape[-1] != unembed.shape[0]:
    raise KernelError(
        f"cross_entropy: hidden {hidden.shape} and unembed {unembed.shape} must be "
        "[tokens, d] or [batch, seq, d], and [d, vocab]; reshape hidden first.")
  token_shape, vocab = tuple(hidden.shape[:-1]), unembed.shape[1]
  tokens = math.prod(token_shape)
  if not (jnp.issubdtype(hidden.dtype, jnp.floating)
          and jnp.issubdtype(unembed.dtype, jnp.floating)):
    raise KernelError(
        f"cross_entropy: hidden {hidden.dtype} and unembed {unembed.dtype} must be floating.")
  dims = "[tokens]" if hidden.ndim == 2 else "[batch, seq]"
  if labels.shape != token_shape or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise KernelError(
        f"cross_entropy: labels {labels.shape} {labels.dtype}; expected integer "
        f"{dims} = {token_shape}.")
  if where is not None and (getattr(where, "shape", None) != token_shape
                            or getattr(where, "dtype", None) != jnp.bool_):
    raise KernelError(
        f"cross_entropy: where {getattr(where, 'shape', type(where))} "
        f"{getattr(where, 'dtype', '')}; expected bool {dims} = {token_shape}.")
  if block_size is not None:
    raise KernelError(
        f"cross_entropy(block_size={block_size!r}): the loss walks tokens, not vocabulary "
        "columns, since its gradient is computed in the forward pass; pass "
        "chunk_size=<tokens per chunk> (a chunk holds chunk_size x vocab float32 logits), "
        "or nothing for the default.")
  if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(
      chunk_size, bool) or not 0 < chunk_size <= max(tokens, 1)):
    raise KernelError(
        f"cross_entropy(chunk_size={chunk_size!r}): expected an int in [1, tokens={tokens}].")
  if not isinstance(z_loss, (int, float)) or z_loss < 0:
    raise KernelError(f"cross_entropy(z_loss={z_loss!r}): expected a float >= 0.")
  if vocab_axes is not None and not (isinstance(vocab_axes, (tuple, list)) and all(
      isinstance(a, str) for a in vocab_axes)):
    raise KernelError(f"cross_entropy(vocab_axes={vocab_axes!r}): expected a tuple of mesh "
                      "axis names, e.g. ('fsdp', 'tensor'), or None.")
  if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(
      soft_cap, (int, float)) or not soft_cap > 0):
    raise KernelError(f"cross_entropy(soft_cap={soft_cap!r}): expected None or a positive "
                      "float (logits become soft_cap * tanh(logits / soft_cap)).")
  if reduction not in _REDUCTIONS:
    raise KernelError(
        f"cross_entropy(reduction={reduction!r}): expected one of {_REDUCTIONS}.")
  return tokens, vocab


class _Layout(NamedTuple):
  """How the loss runs: on whole arrays (`mesh` None) or per device in a shard_map over
  `mesh`, hidden states [batch, seq, d] split over `batch_axes` (dim 0) and `seq_axes`
  (dim 1), vocabulary over `vocab_axes`; the hidden states' gradient is reduce-scattered
  over `scatter_batch` / `scatter_seq` (vocab axes the caller's dim 0 / dim 1 arrive split
  over) and summed over the other vocab axes."""
  mesh: Any
  batch_axes: tuple[str, ...]
  seq_axes: tuple[str, ...]
  vocab_axes: tuple[str, ...]
  scatter_batch: tuple[str, ...]
  scatter_seq: tuple[str, ...]
  chunk_size: int | None
  z_loss: float
  soft_cap: float = 0.0  # 0: logits uncapped

  @property
  def token_axes(self) -> tuple[str, ...]:
    return self.batch_axes + self.seq_axes

  @property
  def scatter_axes(self) -> tuple[str, ...]:
    return self.scatter_batch + self.scatter_seq


def _layout(hidden, unembed, mesh, vocab_axes, chunk_size, z_loss) -> _Layout:
  plain = _Layout(None, (), (), (), (), (), chunk_size, z_loss)
  mesh = _call_mesh(mesh, hidden)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or _varying_axes(hidden):
    # (Inside a shard_map that checks varying axes the arrays are already per device.)
    return plain
  manual = set(getattr(getattr(mesh, "abstract_mesh", mesh), "manual_axes", ()))
  free = lambda a: a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  wanted = _axes.head_axes(mesh) if vocab_axes is None else vocab_axes
  vocab = tuple(a for a in wanted if free(a))
  if unembed.shape[1] % size(vocab):
    vocab = ()
  split = []
  for dim, conventional in ((0, _axes.data_axes(mesh)), (1, _axes.context_axes(mesh))):
    tok = tuple(a for a in conventional if free(a) and a not in vocab)
    tok = tok if hidden.shape[dim] % size(tok) == 0 else ()
    # Vocab axes the caller's dim arrives split over (the batch convention): its gradient
    # goes back split, in the convention's axis order.
    scatter = tuple(a for a in vocab if a in conventional)
    order = [a for a in conventional if a in tok or a in scatter]
    if (hidden.shape[dim] // size(tok)) % size(scatter) or order != list(tok + scatter):
      scatter = ()
    split.append((tok, scatter))
  (tok_b, scat_b), (tok_s, scat_s) = split
  if not vocab and not tok_b and not tok_s:
    return plain
  return _Layout(mesh, tok_b, tok_s, vocab, scat_b, scat_s, chunk_size, z_loss)


def _chunk(chunk_size, tokens, vocab) -> int:
  """Tokens per chunk: the given size, else the largest under the logits budget, a divisor
  of `tokens` if one lies within half of it (no second, shorter loop body)."""
  if chunk_size is not None:
    return min(chunk_size, tokens)
  most = min(tokens, max(_MIN_CHUNK_TOKENS, _CHUNK_ELEMENTS // max(vocab, 1)))
  return next((c for c in range(most, most // 2, -1) if tokens % c == 0), most)


def _walk_tokens(tokens: int, chunk: int, step, carry):
  """Runs step(start, size, carry) over [0, tokens) in chunks; a last short one if needed."""
  full = tokens // chunk
  carry = lax.fori_loop(0, full, lambda i, c: step(i * chunk, chunk, c), carry)
  if tokens % chunk:
    carry = step(full * chunk, tokens % chunk, carry)
  return carry


def _first_column(unembed, vocab_axes):
  """Global index of this device's first vocabulary column."""
  return lax.axis_index(vocab_axes) * unembed.shape[1] if vocab_axes else 0


def _logits(h, unembed, cap: float):
  """A chunk's float32 logits [C, V_local], soft-capped (cap tanh(logits / cap)) if cap."""
  logits = jnp.dot(h, unembed, preferred_element_type=jnp.float32)
  return cap * jnp.tanh(logits / cap) if cap else logits


def _chunk_stats(h, unembed, labels, first, vocab_axes, cap=0.0):
  """One chunk: logits [C, V_local] float32, and per token the logsumexp over the whole
  vocabulary and the label's logit (0 outside [0, vocab)), [C] each."""
  logits = _logits(h, unembed, cap)
  size = unembed.shape[1]
  top = jnp.max(logits, axis=-1)
  total = jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
  offset = labels - first
  picked = jnp.take_along_axis(logits, jnp.clip(offset, 0, size - 1)[:, None], axis=1)[:, 0]
  label_logit = jnp.where((offset >= 0) & (offset < size), picked, 0.0)
  if vocab_axes:  # Each shard's max, sum and label logit, in one collective.
    tops, totals, label_logits = lax.all_gather(
        jnp.stack([top, total, label_logit]), vocab_axes, axis=1)
    top = jnp.max(tops, axis=0)
    total = jnp.sum(totals * jnp.exp(tops - top), axis=0)
    label_logit = jnp.sum(label_logits, axis=0)
  return logits, top + jnp.log(total), label_logit


def _loss(lse, label_logit, z_loss):
  return lse - label_logit + z_loss * lse * lse


def _local_loss(hidden, unembed, labels, layout):
  """Per-token loss and logsumexp, float32 [batch, seq] each, on this device's arrays."""
  shape = labels.shape
  hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
  first = _first_column(unembed, layout.vocab_axes)

  def step(start, size, carry):
    h, y = (lax.dynamic_slice_in_dim(x, start, size) for x in (hidden, labels))
    _, lse, label_logit = _chunk_stats(h, unembed, y, first, layout.vocab_axes,
                                       layout.soft_cap)
    return tuple(lax.dynamic_update_slice_in_dim(c, x, start, 0) for c, x in zip(
        carry, (_loss(lse, label_logit, layout.z_loss), lse)))

  tokens = hidden.shape[0]
  chunk = _chunk(layout.chunk_size, tokens, unembed.shape[1])
  init = _zeros_varying_as((tokens,), jnp.float32, hidden, unembed, labels)
  loss, lse = _walk_tokens(tokens, chunk, step, (init, init))
  return loss.reshape(shape), lse.reshape(shape)


def _zeros_varying_as(shape, dtype, *arrays):
  """Zeros typed as varying over every manual axis one of `arrays` varies over: a loop's
  carry that per-device data updates (inside a shard_map that checks varying axes its
  type must be that from the start)."""
  axes = tuple(sorted(set().union(*(_varying_axes(x) for x in arrays))))
  zeros = jnp.zeros(shape, dtype)
  return lax.pcast(zeros, axes, to="varying") if axes else zeros


def _local_grads(hidden, unembed, labels, g, lse, layout):
  """Per-token loss [batch, seq], and the gradients of sum_t g_t loss_t with respect to
  hidden (its dtype) and unembed (its dtype), on this device's arrays. `lse` (saved by a
  forward pass) spares recomputing each chunk's statistics; None computes them."""
  shape, hidden_shape = labels.shape, hidden.shape
  hidden, labels, g = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), g.reshape(-1)
  lse = None if lse is None else lse.reshape(-1)
  first, vocab_axes = _first_column(unembed, layout.vocab_axes), layout.vocab_axes
  size, cap = unembed.shape[1], layout.soft_cap

  def step(start, rows, carry):
    loss, d_hidden, d_unembed = carry
    h, y, g_c = (lax.dynamic_slice_in_dim(x, start, rows) for x in (hidden, labels, g))
    if lse is None:
      logits, lse_c, label_logit = _chunk_stats(h, unembed, y, first, vocab_axes, cap)
      loss = lax.dynamic_update_slice_in_dim(
          loss, _loss(lse_c, label_logit, layout.z_loss), start, 0)
    else:
      lse_c = lax.dynamic_slice_in_dim(lse, start, rows)
      logits = _logits(h, unembed, cap)
    # d loss / d logits = softmax (1 + 2 z_loss lse) - onehot(label), scaled by g.
    onehot = (y - first)[:, None] == jnp.arange(size)[None, :]
    d_logits = (jnp.exp(logits - lse_c[:, None]) * (g_c * (1 + 2 * layout.z_loss * lse_c))[
        :, None] - jnp.where(onehot, g_c[:, None], 0.0))
    if cap:  # through the cap: d (c tanh(z / c)) / dz = 1 - tanh(z / c)^2
      d_logits = d_logits * (1 - jnp.square(logits / cap))
    d_h = jnp.dot(d_logits.astype(unembed.dtype), unembed.T,
                  preferred_element_type=jnp.float32)
    d_unembed = d_unembed + lax.dot_general(
        h, d_logits.astype(h.dtype), (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    d_hidden = lax.dynamic_update_slice_in_dim(d_hidden, d_h.astype(hidden.dtype), start, 0)
    return loss, d_hidden, d_unembed

  tokens = hidden.shape[0]
  data = (hidden, unembed, labels, g) + (() if lse is None else (lse,))
  init = (_zeros_varying_as((tokens,), jnp.float32, *data),
          _zeros_varying_as(hidden.shape, hidden.dtype, *data),
          _zeros_varying_as(unembed.shape, jnp.float32, *data))
  loss, d_hidden, d_unembed = _walk_tokens(
      tokens, _chunk(layout.chunk_size, tokens, size), step, init)
  summed = tuple(a for a in vocab_axes if a not in layout.scatter_axes)
  d_hidden = d_hidden.reshape(hidden_shape)
  for dim, axes in ((0, layout.scatter_batch), (1, layout.scatter_seq)):
    if axes:  # Back to the caller's token split: a reduce-scatter.
      d_hidden = lax.psum_scatter(d_hidden, axes, scatter_dimension=dim, tiled=True)
  if summed:
    d_hidden = lax.psum(d_hidden, summed)
  d_unembed = d_unembed.astype(unembed.dtype)
  if layout.token_axes:
    d_unembed = lax.psum(d_unembed, layout.token_axes)
  return loss.reshape(shape), d_hidden, d_unembed


def _run(layout, fn, args, in_specs, out_specs):
  """fn(*args) on whole arrays, or per device in a shard_map over the layout's mesh."""
  if layout.mesh is None:
    return fn(*args)
  return per_device(fn, args, in_specs, out_specs, layout.mesh)


def _specs(layout):
  """PartitionSpecs: per token, hidden states, unembedding, scattered hidden gradient."""
  b, s = layout.batch_axes or None, layout.seq_axes or None
  vocab = layout.vocab_axes or None
  back_b = (layout.batch_axes + layout.scatter_batch) or None
  back_s = (layout.seq_axes + layout.scatter_seq) or None
  return jax.P(b, s), jax.P(b, s, None), jax.P(None, vocab), jax.P(back_b, back_s, None)


def _run_loss(layout, hidden, unembed, labels):
  per_token, rows, columns, _ = _specs(layout)
  return _run(layout, lambda h, u, y: _local_loss(h, u, y, layout), (hidden, unembed, labels),
              (rows, columns, per_token), (per_token, per_token))


def _run_grads(layout, hidden, unembed, labels, g, lse=None):
  per_token, rows, columns, back = _specs(layout)
  if lse is None:
    fn = lambda h, u, y, g: _local_grads(h, u, y, g, None, layout)
    args, specs = (hidden, unembed, labels, g), (rows, columns, per_token, per_token)
  else:
    fn = lambda h, u, y, g, lse: _local_grads(h, u, y, g, lse, layout)
    args = (hidden, unembed, labels, g, lse)
    specs = (rows, columns, per_token, per_token, per_token)
  return _run(layout, fn, args, specs, (per_token, back, columns))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted_sum(hidden, unembed, labels, weights, layout):
  """sum_t weights_t loss_t, float32 scalar. Its forward pass for a gradient computes the
  gradient too (the loss is linear in the per-token terms); the backward pass scales it."""
  return jnp.sum(weights * _run_loss(layout, hidden, unembed, labels)[0])


def _weighted_sum_fwd(hidden, unembed, labels, weights, layout):
  loss, d_hidden, d_unembed = _run_grads(layout, hidden, unembed, labels, weights)
  return jnp.sum(weights * loss), (loss, d_hidden, d_unembed)


def _weighted_sum_bwd(layout, residuals, g) -> tuple[Any, Any, None, Any]:
  del layout
  loss, d_hidden, d_unembed = residuals
  scale = lambda x: (g * x.astype(jnp.float32)).astype(x.dtype)
  return scale(d_hidden), scale(d_unembed), None, g * loss


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _per_token(hidden, unembed, labels, layout):
  """Per-token loss, float32 [tokens]; the backward pass recomputes each chunk's logits."""
  return _run_loss(layout, hidden, unembed, labels)[0]


def _per_token_fwd(hidden, unembed, labels, layout):
  loss, lse = _run_loss(layout, hidden, unembed, labels)
  return loss, (hidden, unembed, labels, lse)


def _per_token_bwd(layout, residuals, g) -> tuple[Any, Any, None]:
  hidden, unembed, labels, lse = residuals
  _, d_hidden, d_unembed = _run_grads(layout, hidden, unembed, labels, g, lse)
  return d_hidden, d_unembed, None


_per_token.defvjp(_per_token_fwd, _per_token_bwd)
