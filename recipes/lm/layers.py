"""The Llama family's position-wise layers: RMSNorm (Zhang & Sennrich 2019) and rotary
positions (Su et al. 2021, "RoFormer") with Llama 3.1's or YaRN's (Peng et al. 2023,
arXiv:2309.00071) frequency scaling, shared by the Llama (`recipes.lm.llama`, which also
exports them), the mixture of experts (`recipes.lm.moe`) and DeepSeek
(`recipes.lm.deepseek`)."""
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


class Yarn(NamedTuple):
  """YaRN's RoPE scaling (`rope_type: "yarn"`, its fields as a Hugging Face config names
  them): dims turning fewer than `beta_slow` times over original_max_position are
  interpolated (f / factor), more than `beta_fast` times kept, the band between blended;
  cos and sin are multiplied by `attention_scale`. 0 marks mscale, mscale_all_dim and
  attention_factor the config doesn't give. DeepSeek-V3: Yarn(40, 4096, mscale=1,
  mscale_all_dim=1)."""
  factor: float
  original_max_position: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float = 0.0
  truncate: bool = True

  @property
  def attention_scale(self) -> float:
    """The factor on cos and sin: `attention_factor` if given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are given, else mscale(factor) (the paper's
    0.1 ln(factor) + 1)."""
    if self.attention_factor:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return (yarn_mscale(self.factor, self.mscale)
              / yarn_mscale(self.factor, self.mscale_all_dim))
    return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rms_norm(x, scale, eps: float = 1e-5, offset: float = 0.0):
  """x / rms(x) * (offset + scale) over the last axis, statistics and scale in float32
  (x's dtype out); Gemma's norms have offset 1."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32)
  return (y * (scale + offset if offset else scale)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | Yarn | None = None) -> np.ndarray:
  """RoPE's inverse frequencies theta^(-2i/head_dim), i < head_dim / 2, float32 [head_dim/2]
  (computed in float64, then rounded), with Llama 3.1's or YaRN's scaling when given.

  Llama 3.1's: wavelength 2 pi / f above original / low_freq_factor -> f / factor; below
  original / high_freq_factor -> f; between, (1 - s) f / factor + s f with s = (original /
  wavelength - low) / (high - low) (Meta's llama-models reference, `apply_scaling`).
  YaRN's: r_i = clip((i - lo) / (hi - lo), 0, 1) -> r_i f / factor + (1 - r_i) f, where
  lo, hi are the dims turning beta_fast and beta_slow times over original_max_position
  (head_dim ln(original / (2 pi beta)) / (2 ln theta), floored and ceiled when `truncate`,
  clipped to [0, head_dim - 1]): transformers' `_compute_yarn_parameters`.
  """
  half = head_dim // 2
  freq = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
  if isinstance(scaling, Yarn):
    dim = lambda beta: head_dim * math.log(scaling.original_max_position / (2 * math.pi * beta)
                                           ) / (2 * math.log(theta))
    lo, hi = dim(scaling.beta_fast), dim(scaling.beta_slow)
    if scaling.truncate:
      lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    ramp = np.clip((np.arange(half) - lo) / ((hi - lo) or 0.001), 0, 1)
    freq = ramp * freq / scaling.factor + (1 - ramp) * freq
  elif scaling is not None:
    c, lo, hi = (scaling.original_max_position, scaling.low_freq_factor,
                 scaling.high_freq_factor)
    wavelength = 2 * math.pi / freq
    smooth = (c / wavelength - lo) / (hi - lo)
    blend = (1 - smooth) * freq / scaling.factor + smooth * freq
    freq = np.where(wavelength < c / hi, freq,
                    np.where(wavelength > c / lo, freq / scaling.factor, blend))
  return freq.astype(np.float32)


def rope(x, theta: float, scaling: RopeScaling | Yarn | None = None, positions=None):
  """Rotary positions on x [batch, seq, heads, head_dim]: pair i with i + head_dim/2 and
  rotate the pair at position p by p * `rope_frequencies(...)[i]` (the "rotate half"
  layout), cos and sin times YaRN's `attention_scale` when `scaling` is YaRN's. `positions`:
  None (0..seq-1 in every row) or int [batch, seq], each token's position (packed rows: from
  0 in each document; a sequence reordered over a context axis: its own)."""
  seq, half = x.shape[1], x.shape[-1] // 2
  freq = jnp.asarray(rope_frequencies(x.shape[-1], theta, scaling))
  pos = (jnp.arange(seq, dtype=jnp.float32)[None] if positions is None
         else positions.astype(jnp.float32))  # [batch or 1, seq]
  ang = pos[..., None] * freq  # [batch or 1, seq, half]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  if isinstance(scaling, Yarn) and scaling.attention_scale != 1.0:
    cos, sin = cos * scaling.attention_scale, sin * scaling.attention_scale
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)
