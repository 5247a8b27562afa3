"""Grouped matmul: rows of lhs in consecutive groups, each group times its own rhs matrix.

The expert feed-forward's matmul (`fnscale.parallel.moe`): tokens sorted by expert,
`out[rows of group g] = lhs[rows of group g] @ rhs[g]`, rows past the last group zero.
Three implementations, `gmm_selection` choosing (and saying why) as `kernel_selection` does for
attention:

- "megablox": the TPU Pallas kernel (`jax.experimental.pallas.ops.tpu.megablox`; Gale et
  al. 2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"), whose tiles
  visit only the rows each group holds, forward and backward.
- "ragged_dot": `jax.lax.ragged_dot`, XLA's `ragged-dot` where the backend has one (TPU,
  GPU). On a TPU its weight gradient is a masked convolution over every row for every
  group; where the backend has none (XLA:CPU) jax computes it as one dense matmul against
  every group's matrix, masked: groups x the work.
- "tiled": the megablox schedule in plain XLA ops: rows in tiles (`TILE`, or less where
  groups are small: the largest power of two <= rows / (2 groups), at least 8), each
  (tile, group) pair that meets one batched-matmul item (tiles + groups - 1 items at most),
  each item gathering its group's matrix; at most (rows + groups x tile) x k x n
  multiply-adds, on any backend. Its backward is jax's (gathers and their scatter-add
  transposes).

"auto": megablox on a TPU where it can serve, ragged_dot on GPUs, tiled elsewhere (CPU).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _autodiff
from fnscale._errors import KernelError
from fnscale.kernels._per_device import explicit_free_axes, free_axes, per_device

GMM_IMPLEMENTATIONS = ("auto", "ragged_dot", "megablox", "tiled")
TILE = 128  # the largest row tile of the "tiled" implementation
_MEGABLOX_DTYPES = ("float32", "bfloat16")
# Candidate tiles, largest first: the largest that divides the dimension wins.
_M_TILES = (512, 256, 128, 64, 32, 16, 8)
_KN_TILES = (1024, 512, 256, 128, 64, 32, 16, 8)


class GmmSelection(NamedTuple):
  """What `grouped_matmul` runs, and why.

  Attributes:
    implementation: "ragged_dot", "megablox" or "tiled".
    requested: "auto" or the name asked for.
    reason: why; for a fallback, why megablox can't serve.
    platform: the platform decided for ("tpu", "cuda", "cpu", ...).
    interpret: megablox runs in Pallas interpret mode (any platform, slowly; for tests).
    tiling: megablox's (m, k, n) tiles (None for the others).

  Examples:
    >>> import fnscale as fs
    >>> sel = fs.kernels.gmm_selection((512, 256), (4, 256, 512), platform="tpu")
    >>> sel.implementation, sel.tiling, sel.reason
    ('megablox', (512, 256, 512), 'megablox serves this call')
  """
  implementation: str
  requested: str
  reason: str
  platform: str
  interpret: bool = False
  tiling: tuple[int, int, int] | None = None


def _largest_divisor(n: int, candidates: Sequence[int]) -> int | None:
  return next((c for c in candidates if n % c == 0), None)


def gmm_selection(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dtype=jnp.float32, *,
             implementation: str = "auto", platform: str | None = None,
             interpret: bool = False) -> GmmSelection:
  """Decides how a grouped matmul runs, without running it (see the module docstring).

  "megablox" serves a TPU (or any platform with `interpret=True`), float32/bfloat16, and
  shapes whose m (rows), k and n tile by multiples of 8 (of 128 for k and n on a TPU).

  Args:
    lhs_shape: [m, k] (rows sorted by group).
    rhs_shape: [groups, k, n].
    dtype: the operands' dtype.
    implementation: "auto" or a name in `GMM_IMPLEMENTATIONS`.
    platform: default jax's default backend.
    interpret: run megablox in Pallas interpret mode.

  Returns:
    A `GmmSelection`.

  Raises:
    KernelError: bad shapes or implementation, or megablox asked for where it can't serve.

  Examples:
    >>> import fnscale as fs
    >>> fs.kernels.gmm_selection((512, 256), (4, 256, 512)).implementation  # XLA:CPU
    'tiled'
    >>> fs.kernels.GMM_IMPLEMENTATIONS
    ('auto', 'ragged_dot', 'megablox', 'tiled')
  """
  lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
  if len(lhs_shape) != 2 or len(rhs_shape) != 3 or lhs_shape[1] != rhs_shape[1]:
    raise KernelError(
        f"grouped_matmul: lhs {lhs_shape} and rhs {rhs_shape}; expected lhs [m, k] and rhs "
        "[groups, k, n] with the same k.")
  if implementation not in GMM_IMPLEMENTATIONS:
    raise KernelError(f"grouped_matmul(implementation={implementation!r}): expected one of "
                      f"{GMM_IMPLEMENTATIONS}.")
  platform = (platform or jax.default_backend()).lower()
  if implementation in ("ragged_dot", "tiled"):
    return GmmSelection(implementation, implementation, f"{implementation} was requested",
                        platform)
  if implementation == "auto" and platform != "tpu":
    if platform in ("cuda", "rocm", "gpu"):
      return GmmSelection("ragged_dot", "auto", "ragged_dot: XLA's ragged-dot on GPUs",
                          platform)
    return GmmSelection("tiled", "auto", f"tiled: XLA:{platform.upper()} has no ragged-dot "
                        "(jax computes ragged_dot there as a dense matmul against every "
                        "group)", platform)
  why, tiling = _megablox_cannot_serve(lhs_shape, rhs_shape, np.dtype(dtype).name, platform,
                                       interpret and implementation == "megablox")
  if why is None:
    how = " (interpret mode)" if platform != "tpu" else ""
    return GmmSelection("megablox", implementation, f"megablox serves this call{how}",
                        platform, platform != "tpu", tiling)
  if implementation == "megablox":
    raise KernelError(f"grouped_matmul(implementation='megablox') can't serve this call: "
                      f"{why}; use implementation='ragged_dot' (or 'auto').")
  return GmmSelection("ragged_dot", "auto", f"ragged_dot (megablox: {why})", platform)


def _megablox_cannot_serve(lhs_shape, rhs_shape, dtype: str, platform: str, interpret: bool):
  """(why megablox can't serve, or None; its tiling)."""
  if platform != "tpu" and not interpret:
    return (f"needs platform tpu, this is {platform}; with interpret=True it runs in "
            "interpret mode anywhere"), None
  if dtype not in _MEGABLOX_DTYPES:
    return f"dtype {dtype} not in {_MEGABLOX_DTYPES}", None
  (m, k), n = lhs_shape, rhs_shape[2]
  lane = 8 if interpret else 128
  tiles = (_largest_divisor(m, _M_TILES),
           *(_largest_divisor(d, tuple(t for t in _KN_TILES if t >= lane)) for d in (k, n)))
  if None in tiles:
    return (f"rows {m} must be a multiple of 8 and k {k}, n {n} multiples of {lane}"), None
  return None, tiles


def _tile(m: int, groups: int) -> int:
  """The "tiled" implementation's row tile for m rows in `groups` groups."""
  return min(TILE, 2 ** max(3, math.floor(math.log2(max(m // (2 * groups), 1)))))


def _tiled(lhs, rhs, group_sizes, tile: int | None = None):
  """The "tiled" grouped matmul (module docstring). Work item w is (tile t_w, group g_w):
  groups in order, each over the tiles its rows touch; its rows outside g_w are zeroed."""
  (m, k), (groups, _, n) = lhs.shape, rhs.shape
  tile = tile or _tile(m, groups)
  tiles = math.ceil(m / tile)
  items = tiles + groups - 1
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  first = starts // tile
  spans = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
  begin = jnp.cumsum(spans) - spans  # each group's first work item
  w = jnp.arange(items)
  # Each item's group: how many groups end at or before it ([items, groups] compares, not
  # jnp.searchsorted, which jax 0.12 builds from an operation its custom calls can't hold).
  g = jnp.clip(jnp.sum(begin + spans <= w[:, None], axis=1), 0, groups - 1)
  t = jnp.clip(first[g] + w - begin[g], 0, tiles - 1)
  rows = t[:, None] * tile + jnp.arange(tile)  # [items, tile]
  keep = (rows >= starts[g][:, None]) & (rows < ends[g][:, None]) & (w < jnp.sum(spans))[:, None]
  x = jnp.pad(lhs, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, k)[t]
  x = jnp.where(keep[..., None], x, jnp.zeros((), lhs.dtype))
  y = jnp.einsum("wtk,wkn->wtn", x, rhs[g], preferred_element_type=jnp.float32)
  out = jax.ops.segment_sum(y, t, num_segments=tiles, indices_are_sorted=True)
  return out.reshape(tiles * tile, n)[:m].astype(lhs.dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto", interpret: bool = False,
                   platform: str | None = None, zero_padding: bool = True) -> jax.Array:
  """`out[r] = lhs[r] @ rhs[g(r)]` where row r lies in group g(r); rows past the groups 0
  (unless `zero_padding=False`).

  Groups are consecutive: group g holds rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])).

  Args:
    lhs: [m, k], rows sorted by group.
    rhs: [groups, k, n], the lhs's dtype.
    group_sizes: int32 [groups]; their sum may be below m (the rest is padding).
    implementation, interpret, platform: see `gmm_selection`.
    zero_padding: False leaves the rows past the groups unspecified where the kernel
      doesn't write them (megablox): no masking select, which in a fused backward pass
      keeps XLA from writing its results over the operands' buffers. The caller then masks
      those rows itself (as `fnscale.parallel.moe` does once around its whole FFN).

  Returns:
    [m, n] in lhs's dtype (float32 accumulation).

  Raises:
    KernelError: see `gmm_selection`.

  Examples:
    Rows 0, 1-2 and 3 in groups of sizes 1, 2 and 0 (row 3 is past the groups: zero):

    >>> import fnscale as fs, jax, numpy as np
    >>> x, w = np.ones((4, 2), np.float32), np.stack([np.eye(2), 2 * np.eye(2)]).astype(np.float32)
    >>> jax.jit(fs.kernels.grouped_matmul)(x, w, np.array([1, 2], np.int32))[:, 0].tolist()
    [1.0, 2.0, 2.0, 0.0]
  """
  plan = gmm_selection(lhs.shape, rhs.shape, lhs.dtype, implementation=implementation,
                  platform=platform, interpret=interpret)
  group_sizes = group_sizes.astype(jnp.int32)
  if plan.implementation == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
  tiled = _whole(lambda lhs, rhs, sizes: _tiled(lhs, rhs.astype(lhs.dtype), sizes))
  if plan.implementation == "tiled":
    return tiled(lhs, rhs, group_sizes)
  # megablox differentiates only in reverse mode; forward mode takes the tiled form's JVP
  # (plain XLA ops, which jax also batches: its ragged_dot has no batching rule).
  return _autodiff.reverse_only(
      _whole(functools.partial(_megablox, tiling=plan.tiling, interpret=plan.interpret,
                               zero_padding=zero_padding), pallas=True),
      tiled, "the megablox grouped matmul", "the tiled grouped matmul")(lhs, rhs, group_sizes)


def _whole(fn, pallas: bool = False):
  """`fn(lhs, rhs, group_sizes)` run whole on every device in a shard_map (its result split
  as lhs is) on Explicit mesh axes and, for a Pallas call (`pallas`), on any free axis of
  more than one device: a Pallas call runs only where every axis is manual (XLA can't
  partition it), and the tiled form's gathers of rows have no sharding rule on Explicit
  axes. A group's rows may lie anywhere, so a device needs them all; on Auto axes the
  partitioner decides the same for the tiled form."""
  mesh = jax.sharding.get_abstract_mesh()
  split = pallas and any(mesh.shape[a] > 1 for a in free_axes(None))
  if not (explicit_free_axes() or split):
    return fn
  rep = jax.P()
  return lambda lhs, rhs, sizes: per_device(fn, (lhs, rhs, sizes), (rep, rep, rep), rep,
                                            None, like=lhs)


def _megablox(lhs, rhs, group_sizes, *, tiling, interpret, zero_padding):
  # Pallas is imported only when the kernel runs: it is heavy and most calls never need it.
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
  gmm = lambda lhs: megablox.gmm(lhs, rhs.astype(lhs.dtype), group_sizes, lhs.dtype, tiling,
                                 None, None, False, interpret)
  if not zero_padding:
    return gmm(lhs)
  # Rows past the groups: zero, as ragged_dot leaves them, in the output and in lhs's
  # gradient (the kernel writes neither: the selects drop what it left there).
  rows = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]
  zero = jnp.zeros((), lhs.dtype)
  return jnp.where(rows, gmm(jnp.where(rows, lhs, zero)), zero)
