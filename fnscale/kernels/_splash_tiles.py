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
(`SPLASH_FUSED_BACKWARD`); other tiles moved the kernel's time by under 5%. Inside GPT small's
whole step (`chip.py --case=gpt-small,remat=dots,batch=32,blocks=...`, 2026-12-07), the
sequence as one tile (1024) ran 128.4k tokens/s against 126.6k for 512 tiles and 124.4k for
256/512/512/1024: the table keeps 1024 for that shape.
"""
from __future__ import annotations

from typing import NamedTuple

SPLASH_FUSED_BACKWARD = True


class Tiles(NamedTuple):
  """Query and key/value rows per tile: forward, then the backward kernels'."""
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int


# (query length, key length, head_dim) -> Tiles, measured on TPU v5e (the table above).
MEASURED: dict[tuple[int, int, int], Tiles] = {
    (2048, 2048, 128): Tiles(512, 1024, 1024, 1024),
    (1024, 1024, 64): Tiles(1024, 1024, 1024, 1024),
}


def measured(q_len: int, kv_len: int, head_dim: int) -> Tiles | None:
  """The measured tiles for this shape, or None (not measured)."""
  return MEASURED.get((q_len, kv_len, head_dim))


def splash_block_sizes(block_sizes, fused_backward: bool | None = None):
  """jax's splash-attention tiles (`jax.experimental.pallas.ops.tpu.splash_attention.
  BlockSizes`) that `fnscale.attention` runs for `block_sizes` (anything with block_q,
  block_kv, block_q_bwd, block_kv_bwd, e.g. `fnscale.kernels.BlockSizes`): the backward
  tiles the forward's where None, and the fused backward kernel (dq, dk and dv in one pass:
  no dq tiles) when `fused_backward` (default `SPLASH_FUSED_BACKWARD`, measured faster).

  Raises:
    ImportError: jax's Pallas TPU ops can't be imported here.

  Examples:
    >>> import fnscale as fs
    >>> sizes = fs.kernels.splash_block_sizes(fs.kernels.BlockSizes(512, 1024))
    >>> sizes.block_q, sizes.block_kv, sizes.block_kv_dkv, sizes.use_fused_bwd_kernel
    (512, 1024, 1024, True)
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  fused = SPLASH_FUSED_BACKWARD if fused_backward is None else fused_backward
  bq, bkv = block_sizes.block_q, block_sizes.block_kv
  bq_bwd, bkv_bwd = block_sizes.block_q_bwd or bq, block_sizes.block_kv_bwd or bkv
  return splash.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq_bwd,
      block_kv_dkv=bkv_bwd, block_kv_dkv_compute=bkv_bwd,
      block_q_dq=None if fused else bq_bwd, block_kv_dq=None if fused else bkv_bwd,
      use_fused_bwd_kernel=fused)
