"""Splash attention's tiles and backward kernel as measured on a TPU: what `attention` runs.

`recipes/bench/chip.py --search_splash=BxHxKVxSxD` times the causal splash kernel, forward
and backward, over candidate tiles and both backward kernels for a shape on the chip it runs
on and prints the fastest; `MEASURED` holds the results that differ from the default rule (a
shape not in the table takes the largest of 512, 256 and 128 that divides the sequence,
forward and backward alike).

Measured on one TPU v5e (JAX 0.10.2, libtpu 0.0.42.1, bf16, causal, fwd + bwd):

| q x kv heads, seq, head_dim | two backward kernels, 512 tiles | fused backward, best tiles |
|---|---|---|
| 16 x 12 x 12, 1024, 64 (GPT small) | 5.20 ms | 4.08 ms (512 tiles) |
| 8 x 16 x 8, 2048, 128 (llama-766m) | 8.20 ms | 6.43 ms (q 512, kv 1024, bwd 1024) |

The fused backward kernel (dq, dk and dv in one pass over the blocks: `BlockSizes(
use_fused_bwd_kernel=True)`) was 22% faster at both shapes, so it is the default
(`FUSED_BACKWARD`); other tiles moved the time by under 5%.
"""
from __future__ import annotations

from typing import NamedTuple

FUSED_BACKWARD = True


class Tiles(NamedTuple):
  """Query and key/value rows per tile: forward, then the backward kernels'."""
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int


# (query length, key length, head_dim) -> Tiles, measured on TPU v5e (the table above).
MEASURED: dict[tuple[int, int, int], Tiles] = {
    (2048, 2048, 128): Tiles(512, 1024, 1024, 1024),
}


def measured(q_len: int, kv_len: int, head_dim: int) -> Tiles | None:
  """The measured tiles for this shape, or None (not measured)."""
  return MEASURED.get((q_len, kv_len, head_dim))


def kernel_block_sizes(splash, tiles, fused: bool | None = None):
  """jax's `splash.BlockSizes` for `tiles` (anything with block_q, block_kv, block_q_bwd,
  block_kv_bwd): with the fused backward kernel (no dq tiles) when `fused` (default
  `FUSED_BACKWARD`)."""
  fused = FUSED_BACKWARD if fused is None else fused
  return splash.BlockSizes(
      block_q=tiles.block_q, block_kv=tiles.block_kv, block_kv_compute=tiles.block_kv,
      block_q_dkv=tiles.block_q_bwd, block_kv_dkv=tiles.block_kv_bwd,
      block_kv_dkv_compute=tiles.block_kv_bwd,
      block_q_dq=None if fused else tiles.block_q_bwd,
      block_kv_dq=None if fused else tiles.block_kv_bwd, use_fused_bwd_kernel=fused)
