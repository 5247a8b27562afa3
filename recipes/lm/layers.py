"""The Llama family's position-wise layers: RMSNorm (Zhang & Sennrich 2019) and rotary
positions (Su et al. 2021, "RoFormer") with Llama 3.1's frequency scaling, shared by the
Llama (`recipes.lm.llama`, which also exports them) and the mixture of experts
(`recipes.lm.moe`)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RopeScaling(NamedTuple):
  """Llama 3.1's RoPE frequency scaling (`rope_type: "llama3"` in a Hugging Face config):
  wavelengths above original_max_position / low_freq_factor are stretched by `factor`,
  those below original_max_position / high_freq_factor kept, the band between blended."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


def rms_norm(x, scale, eps: float = 1e-5, offset: float = 0.0):
  """x / rms(x) * (offset + scale) over the last axis, statistics and scale in float32
  (x's dtype out); Gemma's norms have offset 1."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32)
  return (y * (scale + offset if offset else scale)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> np.ndarray:
  """RoPE's inverse frequencies theta^(-2i/head_dim), i < head_dim / 2, float32 [head_dim/2]
  (computed in float64, then rounded), with Llama 3.1's scaling when given: wavelength
  2 pi / f above original / low_freq_factor -> f / factor; below original /
  high_freq_factor -> f; between, (1 - s) f / factor + s f with s = (original / wavelength -
  low) / (high - low) (Meta's llama-models reference, `apply_scaling`)."""
  half = head_dim // 2
  freq = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
  if scaling is not None:
    c, lo, hi = (scaling.original_max_position, scaling.low_freq_factor,
                 scaling.high_freq_factor)
    wavelength = 2 * math.pi / freq
    smooth = (c / wavelength - lo) / (hi - lo)
    blend = (1 - smooth) * freq / scaling.factor + smooth * freq
    freq = np.where(wavelength < c / hi, freq,
                    np.where(wavelength > c / lo, freq / scaling.factor, blend))
  return freq.astype(np.float32)


def rope(x, theta: float, scaling: RopeScaling | None = None, positions=None):
  """Rotary positions on x [batch, seq, heads, head_dim]: pair i with i + head_dim/2 and
  rotate the pair at position p by p * `rope_frequencies(...)[i]` (the "rotate half"
  layout). `positions`: None (0..seq-1 in every row) or int [batch, seq], each token's
  position (packed rows: from 0 in each document; a sequence reordered over a context axis:
  its own)."""
  seq, half = x.shape[1], x.shape[-1] // 2
  freq = jnp.asarray(rope_frequencies(x.shape[-1], theta, scaling))
  pos = (jnp.arange(seq, dtype=jnp.float32)[None] if positions is None
         else positions.astype(jnp.float32))  # [batch or 1, seq]
  ang = pos[..., None] * freq  # [batch or 1, seq, half]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)
