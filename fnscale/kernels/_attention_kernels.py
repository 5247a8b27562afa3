"""The attention kernels `attention` runs (the TPU Pallas splash attention, the Pallas Triton
attention, cuDNN's flash attention, the XLA reference), their tiles (`BlockSizes`) and the
dtypes each takes; the scopes a traced program's attention runs under."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fnscale.kernels import _context_attention as context_attention, _splash_tiles

IMPLEMENTATIONS = ("auto", "xla", "splash", "cudnn", "pallas_gpu")
# Every call's work runs under this `jax.named_scope` ("..._causal" for a causal mask), so a
# traced program's attention can be told from its other matmuls (`fnscale.analysis._trace`).
SCOPE = "fnscale_attention"
CAUSAL_SCOPE = SCOPE + "_causal"
# The splash kernel's output and logsumexp carry this `checkpoint_name`: a remat policy that
# saves it (`jax.checkpoint_policies.save_only_these_names`) spares the forward kernel's rerun.
RESIDUALS = SCOPE + "_residuals"
# Candidate block sizes, largest first: the largest that divides the sequence wins.
_SPLASH_BLOCKS = (512, 256, 128)
_GPU_BLOCKS = (128, 64, 32, 16)
_GPU_BWD_BLOCKS = (32, 16)
_DTYPES = {
    "splash": ("float32", "bfloat16"),
    "pallas_gpu": ("float32", "bfloat16", "float16"),
    "cudnn": ("bfloat16", "float16"),
}


class BlockSizes(NamedTuple):
  """Tile sizes of a kernel, in tokens.

  Attributes:
    block_q: query rows per forward tile; must divide the query length.
    block_kv: key/value rows per forward tile; must divide the key length.
    block_q_bwd: query rows per backward tile (None: the kernel's default for the shape).
    block_kv_bwd: key/value rows per backward tile (None: the kernel's default).

  Examples:
    The splash kernel's tiles for a 1024-token call on a TPU, and tiles asked for:

    >>> import fnscale as fs
    >>> q = (2, 1024, 8, 128)  # [batch, seq, heads, head_dim]
    >>> fs.kernels.kernel_selection(q, q, platform="tpu").block_sizes
    BlockSizes(block_q=512, block_kv=512, block_q_bwd=512, block_kv_bwd=512)
    >>> blocks = fs.kernels.BlockSizes(256, 128)
    >>> fs.kernels.kernel_selection(q, q, platform="tpu", block_sizes=blocks).block_sizes[:2]
    (256, 128)
  """
  block_q: int
  block_kv: int
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None


def _xla(q, k, v, q_ids, kv_ids, *, causal, window, scale, soft_cap=None):
  if soft_cap is not None:
    return _xla_capped(q, k, v, q_ids, kv_ids, causal, window, scale, soft_cap)
  mask = None
  if q_ids is not None:
    mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                      local_window_size=window, implementation="xla")


def _xla_capped(q, k, v, q_ids, kv_ids, causal, window, scale, cap):
  """The reference with logits soft-capped, cap * tanh(logits / cap) before the mask
  (Gemma 2), which `jax.nn.dot_product_attention` has no argument for: logits and softmax
  in float32, kv head h // (heads // kv_heads) for query head h."""
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  logits = cap * jnp.tanh(logits * scale / cap)
  rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  mask = jnp.ones((1, t, s), bool)
  if causal:
    mask &= cols <= rows
  if window is not None:
    mask &= (cols >= rows - window[0]) & (cols <= rows + window[1])
  if q_ids is not None:
    mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])
  logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d).astype(q.dtype)


def splash_layout(q, k, v, scale):
  """q (scaled), k and v [batch, seq, heads, head_dim] as splash takes them: heads-major
  [batch, heads, seq, head_dim], a single k/v head dropped ([batch, seq, head_dim]: MQA).
  Done outside the kernel's primitive (`_autodiff.reverse_only`), so that the kernel's
  residuals are its own arguments and the output and logsumexp it names: under
  `jax.checkpoint` a policy saving `RESIDUALS` spares the forward kernel's rerun."""
  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if kh.shape[1] == 1:
    kh, vh = kh[:, 0], vh[:, 0]
  return qh, kh, vh


def from_splash_layout(reference):
  """`reference` (the XLA attention on [batch, seq, heads, head_dim], scale left to its
  caller) as a function of `splash_layout`'s arrays: the same function the splash kernel
  computes of them, for `reverse_only`'s forward-mode derivatives."""
  def run(qh, kh, vh, q_ids, kv_ids):
    back = lambda a: jnp.swapaxes(a, 1, 2) if a.ndim == 4 else a[:, :, None]
    return jnp.swapaxes(reference(back(qh), back(kh), back(vh), q_ids, kv_ids, scale=1.0), 1, 2)
  return run


def _splash(qh, kh, vh, q_ids, kv_ids, *, causal, window, scale, blocks, interpret,
            soft_cap=None):
  """Splash over `splash_layout`'s arrays (q already scaled: `scale` is unused); the
  output heads-major, [batch, heads, seq, head_dim]."""
  del scale
  # Pallas is imported only when a kernel runs: it is heavy and most calls never need it.
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  _, h, t, _ = qh.shape
  s = kh.shape[-2]
  if window is not None:
    mask = splash.LocalMask((t, s), (window[0], 0 if causal else window[1]), offset=0)
  elif causal:
    mask = splash.CausalMask((t, s))
  else:
    mask = splash.FullMask((t, s))
  sizes = _splash_tiles.splash_block_sizes(blocks)
  make = splash.make_splash_mqa if kh.ndim == 3 else splash.make_splash_mha
  kernel = make(splash.MultiHeadMask([mask] * h), block_sizes=sizes, head_shards=1,
                q_seq_shards=1, residual_checkpoint_name=RESIDUALS, interpret=interpret,
                attn_logits_soft_cap=soft_cap)
  if q_ids is None:
    return jax.vmap(kernel)(qh, kh, vh).astype(qh.dtype)
  run = lambda q, k, v, a, b: kernel(q, k, v, splash.SegmentIds(a, b))
  return jax.vmap(run)(qh, kh, vh, q_ids, kv_ids).astype(qh.dtype)


def _pallas_gpu(q, k, v, q_ids, kv_ids, *, causal, window, scale, blocks, interpret,
                soft_cap=None):
  del window, kv_ids, soft_cap  # Checked by _cannot_serve.
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  group = q.shape[2] // k.shape[2]
  if group > 1:  # The Triton kernel wants as many kv heads as q heads.
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  sizes = gpu_attention.BlockSizes(
      block_q=blocks.block_q, block_k=blocks.block_kv, block_q_dkv=blocks.block_q_bwd,
      block_kv_dkv=blocks.block_kv_bwd, block_q_dq=blocks.block_q_bwd,
      block_kv_dq=blocks.block_kv_bwd)
  return gpu_attention.mha(q, k, v, q_ids, sm_scale=scale, causal=causal,
                           block_sizes=sizes, interpret=interpret).astype(q.dtype)


def _cudnn(q, k, v, q_ids, kv_ids, *, causal, window, scale, blocks, interpret,
           soft_cap=None):
  del q_ids, kv_ids, blocks, interpret, soft_cap  # Checked by _cannot_serve.
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                      local_window_size=window, implementation="cudnn")


_KERNELS = {"splash": _splash, "pallas_gpu": _pallas_gpu, "cudnn": _cudnn}
