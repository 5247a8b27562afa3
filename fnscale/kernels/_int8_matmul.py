"""An int8 matmul that quantizes its activations in the kernel: y = q(x) @ qw * s_x * s_w.

For AQT-style int8 training (per-row activation scales, per-column weight scales, int32
accumulation) on a TPU, where the int8 MXU rate is twice bf16's (v5e: 394 vs 197 TOP/s) but
quantizing x in XLA is a pass of its own over x (a max per row, then divide, round, cast)
that XLA does not fuse into the int8 dot. The Pallas kernel (`jax.experimental.pallas`,
Mosaic) takes x [M, K] in its float dtype and the weights already in int8 with their float32
scales; grid step (i, j) holds x's rows [i bm, (i + 1) bm) whole ([bm, K] in VMEM):

- at j = 0 it quantizes them into a VMEM scratch, 32 rows at a time (a row's m = max |x|
  over K, s = m / 127, round(x * 127 / m) clipped to +-127: `quantize_rows`);
- every j it multiplies that int8 tile by qw's columns [j bn, (j + 1) bn) (int32
  accumulation) and writes y = acc * s_x * s_w in x's dtype.

So x is read once and never written quantized; qw's column tiles stream past it, M / bm
times in all. `tiles` (bm, bn) default to the largest that divide M and N (bn a multiple of
128 up to 2048) and whose VMEM footprint (`vmem_footprint`) fits 3/4 of `vmem_bytes`, bm
first (each qw byte read serves 2 bm products: bm >= 256 keeps v5e's MXU fed from HBM).

`int8_selection` decides whether the kernel serves a call (a TPU, or any platform in
interpret mode; M a multiple of 32 and K, N of 128 with tiles that fit), and says why not.
Under a mesh with free axes the kernel runs per device (`jax.shard_map`), x's rows split
over the data axes that divide them (its tiles chosen for a device's rows), qw and the
scales whole.

Examples:
  >>> import fnscale as fs, jax.numpy as jnp
  >>> sel = fs.kernels.int8_selection((16384, 1024), (1024, 4096), platform="tpu")
  >>> sel.implementation, sel.tiles
  ('pallas', (512, 2048))
  >>> fs.kernels.int8_selection((32768, 768), (768, 2304), platform="tpu").tiles
  (512, 1152)
  >>> fs.kernels.int8_selection((100, 1024), (1024, 4096), platform="tpu").reason
  'xla (the kernel: rows 100 must be a multiple of 32 and k 1024, n 4096 of 128)'
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from fnscale import _axes
from fnscale._errors import KernelError
from fnscale.kernels._attention_call import _platform
from fnscale.kernels._per_device import explicit_free_axes, free_axes, per_device

INT8_IMPLEMENTATIONS = ("auto", "pallas", "xla")
LEVELS = 127.0  # symmetric int8: values in [-127, 127]
VMEM_BYTES = 32 * 2**20  # the kernel's VMEM limit (v5e: 128 MiB VMEM, 16 MiB scoped default)
_BM = (512, 256, 128, 64, 32)  # row tiles, largest first (the largest that fits wins)
_BN_MAX = 2048  # column tiles: multiples of 128 up to this, largest first (a grid step
# costs ~0.35 us besides its work: GPT small's 2304 columns take 1152, not 256)
_CHUNK = 32  # rows quantized at once (int8's native (32, 128) tile; bounds float32 temps)


class Int8Selection(NamedTuple):
  """What runs an int8 matmul, and why.

  Attributes:
    implementation: "pallas" (the kernel) or "xla" (quantize, then `lax.dot_general`).
    requested: "auto" or the name asked for.
    reason: why; for the fallback, why the kernel can't serve.
    platform: the platform decided for ("tpu", "cpu", ...).
    interpret: the kernel runs in Pallas interpret mode (any platform, slowly; for tests).
    tiles: the kernel's (bm, bn) (None for "xla").

  Examples:
    >>> import fnscale as fs
    >>> sel = fs.kernels.int8_selection((16384, 2048), (2048, 8192), platform="tpu")
    >>> sel.implementation, sel.tiles, sel.reason
    ('pallas', (512, 1024), 'the kernel serves this call')
  """
  implementation: str
  requested: str
  reason: str
  platform: str
  interpret: bool = False
  tiles: tuple[int, int] | None = None


def vmem_footprint(bm: int, bn: int, k: int, itemsize: int = 2) -> int:
  """Bytes of VMEM the kernel holds at tiles (bm, bn) over width k, x of `itemsize` bytes:
  x's tile and qw's double-buffered, the int8 tile and its scales, the output tile
  double-buffered with its int32 and float32 products, one chunk's float32 temporaries.

  Examples:
    >>> import fnscale as fs
    >>> fs.kernels.vmem_footprint(512, 1024, 2048) / 2**20  # MiB: fits 3/4 of 32
    16.0625
  """
  x, q, s = 2 * bm * k * itemsize, bm * k, bm * 128 * 4  # a [bm, 1] scale pads to 128 lanes
  w, sw = 2 * k * bn, 2 * 8 * bn * 4
  out = 2 * bm * bn * itemsize + 2 * bm * bn * 4
  return x + q + s + w + sw + out + 3 * min(bm, _CHUNK) * k * 4


def _tiles(m: int, k: int, n: int, itemsize: int, vmem_bytes: int):
  fits = lambda bm, bn: vmem_footprint(bm, bn, k, itemsize) <= vmem_bytes * 3 // 4
  columns = range(min(n, _BN_MAX) // 128 * 128, 0, -128)
  return next(((bm, bn) for bm in _BM if m % bm == 0 for bn in columns
               if n % bn == 0 and fits(bm, bn)), None)


def int8_selection(x_shape: Sequence[int], w_shape: Sequence[int], dtype=jnp.bfloat16, *,
                   implementation: str = "auto", platform: str | None = None,
                   interpret: bool = False, tiles: tuple[int, int] | None = None,
                   vmem_bytes: int = VMEM_BYTES) -> Int8Selection:
  """Decides how `x [M, K] @ w [K, N]` through int8 runs, without running it.

  The kernel serves a TPU (or any platform with `interpret=True`), x float32 or bfloat16,
  M a multiple of 32 and K, N multiples of 128, with `tiles` (default: chosen, see the module
  docstring) that divide M and N and fit `vmem_bytes`. Platform None: the context mesh's
  devices', else jax's default backend.

  Returns:
    An `Int8Selection`.

  Raises:
    KernelError: bad shapes or implementation, or "pallas" asked for where it can't serve.

  Examples:
    >>> import fnscale as fs
    >>> fs.kernels.int8_selection((256, 128), (128, 256)).implementation  # XLA:CPU
    'xla'
    >>> fs.kernels.int8_selection((256, 128), (128, 256), interpret=True).tiles
    (256, 256)
    >>> fs.kernels.INT8_IMPLEMENTATIONS
    ('auto', 'pallas', 'xla')
  """
  x_shape, w_shape = tuple(x_shape), tuple(w_shape)
  if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[0]:
    raise KernelError(f"int8 matmul: x {x_shape} and w {w_shape}; expected x [m, k] and w "
                      "[k, n] with the same k.")
  if implementation not in INT8_IMPLEMENTATIONS:
    raise KernelError(f"int8 matmul(implementation={implementation!r}): expected one of "
                      f"{INT8_IMPLEMENTATIONS}.")
  platform = _platform(platform, jax.sharding.get_abstract_mesh())
  if implementation == "xla":
    return Int8Selection("xla", "xla", "xla was requested", platform)
  why, tiles = _cannot_serve(x_shape, w_shape, jnp.dtype(dtype), platform, interpret, tiles,
                             vmem_bytes)
  if why is None:
    how = " (interpret mode)" if platform != "tpu" else ""
    return Int8Selection("pallas", implementation, f"the kernel serves this call{how}",
                         platform, platform != "tpu", tiles)
  if implementation == "pallas":
    raise KernelError(f"int8 matmul(implementation='pallas') can't serve x {x_shape} @ w "
                      f"{w_shape}: {why}; use implementation='xla' (or 'auto').")
  return Int8Selection("xla", implementation, f"xla (the kernel: {why})", platform)


def _cannot_serve(x_shape, w_shape, dtype, platform, interpret, tiles, vmem_bytes):
  """(why the kernel can't serve, or None; its tiles)."""
  if platform != "tpu" and not interpret:
    return (f"needs platform tpu, this is {platform}; with interpret=True it runs in "
            "interpret mode anywhere"), None
  if dtype.name not in ("float32", "bfloat16"):
    return f"x's dtype {dtype.name} is not float32 or bfloat16", None
  (m, k), n = x_shape, w_shape[1]
  if m % _CHUNK or k % 128 or n % 128:
    return f"rows {m} must be a multiple of {_CHUNK} and k {k}, n {n} of 128", None
  if tiles is None:
    tiles = _tiles(m, k, n, dtype.itemsize, vmem_bytes)
    if tiles is None:
      return f"no tiles of rows {m} x columns {n} fit {vmem_bytes} bytes of VMEM at k {k}", None
  bm, bn = tiles
  if m % bm or n % bn or bm % _CHUNK or bn % 128:
    return (f"tiles {tiles} must divide ({m}, {n}) with bm a multiple of {_CHUNK} and bn "
            "of 128"), None
  return None, tuple(tiles)


def quantize_rows(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(int8 q, float32 s [rows, 1]) of a [rows, k]: with m = max |a| over k, s = m / 127
  and q = round(a * (127 / m)) (half to even) clipped to +-127 (s = 1, q = 0 where m = 0),
  so a ~= q * s. The kernel's quantization, also the XLA path's (one definition). One
  division per row, then products: a TPU has no divide unit (and XLA would rewrite a
  division by a broadcast row value into a product by its reciprocal anyway).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> q, s = fs.kernels.quantize_rows(jnp.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]]))
    >>> q.tolist(), s[:, 0].tolist()
    ([[127, -64, 32], [0, 0, 0]], [0.007874015718698502, 1.0])
  """
  a = a.astype(jnp.float32)
  m = jnp.max(jnp.abs(a), axis=1, keepdims=True)
  s = jnp.where(m > 0, m / LEVELS, 1.0)
  inv = jnp.where(m > 0, LEVELS / m, 1.0)
  return jnp.clip(jnp.round(a * inv), -LEVELS, LEVELS).astype(jnp.int8), s


def _kernel(x_ref, w_ref, sw_ref, o_ref, q_ref, s_ref):
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  @pl.when(pl.program_id(1) == 0)
  def _():
    def quantize(c, carry):
      rows = pl.ds(pl.multiple_of(c * _CHUNK, _CHUNK), _CHUNK)
      q_ref[rows, :], s_ref[rows, :] = quantize_rows(x_ref[rows, :])
      return carry
    lax.fori_loop(0, q_ref.shape[0] // _CHUNK, quantize, 0)

  acc = jnp.dot(q_ref[...], w_ref[...], preferred_element_type=jnp.int32)
  o_ref[...] = (acc.astype(jnp.float32) * s_ref[...] * sw_ref[...]).astype(o_ref.dtype)


def _call(x, qw, sw, *, tiles, interpret, vmem_bytes):
  # Pallas is imported only when the kernel runs: it is heavy and most calls never need it.
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  (m, k), n = x.shape, qw.shape[1]
  bm, bn = tiles
  return pl.pallas_call(
      _kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(m // bm, n // bn),
      in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, bn), lambda i, j: (0, j)),
                pl.BlockSpec((1, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      scratch_shapes=[pltpu.VMEM((bm, k), jnp.int8), pltpu.VMEM((bm, 1), jnp.float32)],
      # j runs in order on one core: the int8 tile made at j = 0 serves the row's every j.
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=vmem_bytes),
      interpret=interpret,
      name="fnscale_int8_matmul",
  )(x, qw, sw.reshape(1, n).astype(jnp.float32))


def int8_matmul(x: jax.Array, qw: jax.Array, sw: jax.Array, *,
                tiles: tuple[int, int] | None = None, interpret: bool = False,
                vmem_bytes: int = VMEM_BYTES) -> jax.Array:
  """`(q(x) @ qw) * s_x * sw` in x's dtype, x quantized per row inside the kernel.

  Args:
    x: [M, K] float32 or bfloat16.
    qw: int8 [K, N], the weights quantized per column (`qw * sw ~= w`).
    sw: float32 [N], their scales.
    tiles: (bm, bn); None: chosen (module docstring).
    interpret: Pallas interpret mode (any platform; for tests).
    vmem_bytes: the kernel's VMEM limit.

  Returns:
    [M, N] in x's dtype: the int32 products of q(x) and qw, times x's row scales and sw.

  Raises:
    KernelError: shapes or tiles the kernel can't serve (`int8_selection` says which).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> x = jnp.ones((32, 128)).at[:, 0].set(-2.0)
    >>> qw, sw = jnp.ones((128, 128), jnp.int8), jnp.full((128,), 0.5)
    >>> # Row scale 2/127: -2 -> -127, each 1 -> 63.5 -> 64 (half to even), so the row's
    >>> # float product 62.5 comes out as (127 * 64 - 127) * 2/127 * 0.5:
    >>> fs.kernels.int8_matmul(x, qw, sw, interpret=True)[0, :2].tolist()
    [63.0, 63.0]
  """
  if qw.dtype != jnp.int8:
    raise KernelError(f"int8_matmul: qw has dtype {qw.dtype}; expected int8 (quantize the "
                      "weights per column first: q = round(w / s), s = max |w| / 127)")
  if sw.shape != qw.shape[1:]:
    raise KernelError(f"int8_matmul: sw has shape {sw.shape}; expected qw's columns "
                      f"{qw.shape[1:]}")
  mesh = jax.sharding.get_abstract_mesh()
  split = explicit_free_axes() or any(mesh.shape[a] > 1 for a in free_axes(None))
  rows, share = _row_split(mesh, x.shape[0]) if split else (jax.P(), 1)
  sel = int8_selection((x.shape[0] // share, x.shape[1]), qw.shape, x.dtype,
                       interpret=interpret, tiles=tiles, vmem_bytes=vmem_bytes)
  if sel.implementation != "pallas":  # int8_matmul is the kernel: it has no XLA path
    raise KernelError(f"int8_matmul can't serve x {x.shape} @ qw {qw.shape}: {sel.reason}; "
                      "where fs.kernels.int8_selection(...) picks 'xla', quantize the rows "
                      "(fs.kernels.quantize_rows) and multiply in XLA (jax.lax.dot with "
                      "preferred_element_type=jnp.int32)")
  run = functools.partial(_call, tiles=sel.tiles, interpret=interpret,
                          vmem_bytes=vmem_bytes)
  if not split:
    return run(x, qw, sw)
  return per_device(run, (x, qw, sw), (rows, jax.P(), jax.P()), rows, None, like=x)


def _row_split(mesh, m: int):
  """(x's spec, devices per row split): rows over the free data axes where each device's
  share is still a whole number of 32-row chunks, else whole on every device."""
  free = free_axes(None)
  axes = tuple(a for a in _axes.data_axes(mesh) if a in free and mesh.shape[a] > 1)
  size = math.prod(mesh.shape[a] for a in axes)
  return (jax.P(axes), size) if axes and m % (size * _CHUNK) == 0 else (jax.P(), 1)

