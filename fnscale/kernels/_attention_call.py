"""One attention call described and checked (`_Call`: shapes, dtype, mask, the mesh axes a
kernel would split it over), and which kernels can serve it, with what tiles."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _axes
from fnscale import _compat
from fnscale import _context
from fnscale._errors import KernelError
from fnscale.kernels import _context_attention as context_attention, _splash_tiles
from fnscale.kernels._attention_kernels import (
    _DTYPES, _GPU_BLOCKS, _GPU_BWD_BLOCKS, _SPLASH_BLOCKS, IMPLEMENTATIONS, BlockSizes)


class _Call(NamedTuple):
  q_shape: tuple[int, ...]
  k_shape: tuple[int, ...]
  dtype: str
  causal: bool
  segments: str | None  # None, "shared" or "pair"
  window: tuple[int, int] | None
  block_sizes: BlockSizes | None
  platform: str
  interpret: bool
  axis_sizes: dict[str, int]
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  unseen_devices: int  # Devices the inputs may span with no mesh in sight (0: a mesh is).
  context_axes: tuple[str, ...] = ()  # Free mesh axes (size > 1) splitting the sequence.
  soft_cap: float | None = None  # Logits capped as c tanh(logits / c).


def _describe_call(q_shape, k_shape, dtype, causal, segment_ids, sliding_window,
                   implementation, block_sizes, platform, interpret, mesh, soft_cap=None):
  """Checks kernel_selection's arguments; returns (_Call, requested name, unsharded note)."""
  q_shape, k_shape = tuple(getattr(q_shape, "shape", q_shape)), tuple(k_shape)
  _check_shapes(q_shape, k_shape, k_shape)
  if implementation not in IMPLEMENTATIONS:
    raise KernelError(
        f"attention(implementation={implementation!r}): expected one of {IMPLEMENTATIONS}.")
  window = _normalise_window(sliding_window)
  choice = _context.KERNEL_CHOICE.value
  block_sizes = (choice.block_sizes if block_sizes is None
                 else _check_block_sizes(block_sizes, "attention"))
  segments = _segment_structure(segment_ids, q_shape, k_shape)
  requested = choice.attention if implementation == "auto" else implementation
  interpret = choice.interpret if interpret is None else bool(interpret)
  # A kernel's shard_map needs a concrete mesh when the program is lowered: from the jit
  # boundary, or from the arguments' shardings (attention passes that mesh in). A mesh set
  # only inside a trace whose inputs carry none can't lower one: the kernel runs unsharded.
  shardable = mesh is not None or _concrete_mesh_known()
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  batch_axes, head_axes = _kernel_axes(mesh) if shardable else ((), ())
  note = ("" if shardable or mesh.empty else
          "; not sharded: the mesh was set inside the trace and the inputs carry no "
          "sharding; set it around the jitted call, shard the inputs or pass mesh=")
  # Unsharded, the program compiles where its inputs live: jax's default backend.
  platform = _platform(platform, mesh if shardable else None)
  # No mesh a shard_map can use (e.g. shardings given only as jit's in_shardings): the
  # inputs may be split over every device of the platform the program runs on.
  unseen = (jax.device_count() if (not shardable or mesh.empty)
            and platform == _platform(None, None) else 0)
  context = _context_axes(mesh) if shardable else ()
  call = _Call(q_shape, k_shape, np.dtype(dtype).name, causal, segments, window,
               block_sizes, platform, interpret, _axis_sizes(mesh), batch_axes, head_axes,
               unseen, context, None if soft_cap is None else _check_soft_cap(soft_cap))
  return call, requested, note


def _context_call(call: _Call, requested: str) -> context_attention.ContextCall:
  choice = _context.KERNEL_CHOICE.value
  return context_attention.ContextCall(
      call.q_shape, call.k_shape, call.dtype, call.causal, call.window,
      requested, choice.context, choice.context_order, call.platform, call.interpret,
      call.axis_sizes, call.context_axes, call.batch_axes, call.head_axes)


def _check_shapes(q_shape, k_shape, v_shape) -> None:
  for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
    if len(shape) != 4:
      raise KernelError(
          f"attention: {name} has shape {shape}; expected [batch, seq, heads, head_dim].")
  if k_shape != v_shape:
    raise KernelError(f"attention: k shape {k_shape} and v shape {v_shape} must be equal.")
  (b, _, h, d), (kb, _, kh, kd) = q_shape, k_shape
  if kb != b or kd != d:
    raise KernelError(
        f"attention: q {q_shape} and k {k_shape} must share batch and head_dim.")
  if kh < 1 or h % kh:
    raise KernelError(
        f"attention: kv heads {kh} (k {k_shape}) must divide q heads {h} (q {q_shape}) for "
        "grouped-query attention.")


def _normalise_window(window) -> tuple[int, int] | None:
  if window is None:
    return None
  given = window
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (int(window), int(window))
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0
                 for w in window)):
    raise KernelError(
        f"attention(sliding_window={given!r}): expected a non-negative int or a pair "
        "(left, right) of them.")
  return int(window[0]), int(window[1])


def _check_soft_cap(cap) -> float:
  if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating)) or not cap > 0:
    raise KernelError(f"attention(soft_cap={cap!r}): expected None or a positive float "
                      "(logits become soft_cap * tanh(logits / soft_cap)).")
  return float(cap)


def _check_block_sizes(blocks, where: str) -> BlockSizes:
  if not isinstance(blocks, BlockSizes):
    raise KernelError(
        f"{where}(block_sizes={blocks!r}): expected fnscale.kernels.BlockSizes(block_q, "
        "block_kv).")
  for field, value in blocks._asdict().items():
    if value is not None and (not isinstance(value, int) or value <= 0):
      raise KernelError(
          f"{where}: BlockSizes.{field}={value!r}; expected a positive int.")
  return blocks


def _segment_structure(segment_ids, q_shape, k_shape) -> str | None:
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise KernelError(
          f"attention: segment_ids is a sequence of {len(segment_ids)}; expected one array "
          "or a pair (q_segment_ids, kv_segment_ids).")
    q_ids, kv_ids = segment_ids
    expected = ((q_shape[0], q_shape[1]), (k_shape[0], k_shape[1]))
  else:
    q_ids = kv_ids = segment_ids
    expected = ((q_shape[0], q_shape[1]),) * 2
    if q_shape[1] != k_shape[1]:
      raise KernelError(
          f"attention: one segment_ids array needs q_seq == kv_seq, got {q_shape[1]} and "
          f"{k_shape[1]}; pass a pair (q_segment_ids, kv_segment_ids).")
  for name, ids, shape in (("q", q_ids, expected[0]), ("kv", kv_ids, expected[1])):
    if tuple(getattr(ids, "shape", ())) != shape:
      raise KernelError(
          f"attention: {name} segment_ids shape {getattr(ids, 'shape', type(ids))}; "
          f"expected [batch, seq] = {shape}.")
    if hasattr(ids, "dtype") and not jnp.issubdtype(ids.dtype, jnp.integer):
      raise KernelError(
          f"attention: {name} segment_ids dtype {ids.dtype}; expected an integer dtype.")
  return "shared" if q_ids is kv_ids else "pair"


def _segment_arrays(segment_ids, q_shape, k_shape):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_ids, kv_ids = segment_ids
    if q_ids is kv_ids:
      q_ids = kv_ids = jnp.asarray(q_ids, jnp.int32)
      return q_ids, kv_ids
    return jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)
  ids = jnp.asarray(segment_ids, jnp.int32)
  return ids, ids


def _platform(platform: str | None, mesh) -> str:
  if platform is None:
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
  platform = platform.lower()
  if platform == "gpu":
    try:
      version = _compat.platform_version(jax.devices("gpu")[0]).lower()
      platform = "rocm" if "rocm" in version else "cuda"
    except RuntimeError:
      platform = "cuda"
  return platform


def _concrete_mesh_known() -> bool:
  return not _compat.concrete_mesh().empty


def _call_mesh(mesh, q):
  """The mesh attention's kernel shards over: `mesh`, else None (kernel_selection reads the
  context) when a concrete mesh is in force, else the mesh q's sharding names."""
  if mesh is not None:
    return mesh
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and _concrete_mesh_known():
    return None
  sharding = getattr(jax.typeof(q), "sharding", None)
  named = getattr(sharding, "mesh", None)
  if named is None or named.empty:
    return None  # No mesh at all, or one set inside the trace only (kernel_selection says so).
  # Inputs sharded over a mesh: their jit lowers with it, so shard_map can use it.
  return named if context.empty else context


def _varying_axes(x) -> tuple[str, ...]:
  """Manual mesh axes x varies over inside a checked shard_map (jax's varying type)."""
  return tuple(sorted(_compat.varying_axes(x)))


def _axis_sizes(mesh) -> dict[str, int]:
  if mesh is None or mesh.empty:
    return {}
  return dict(mesh.shape)


def _kernel_axes(mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Mesh axes (not already manual, size > 1) a kernel's shard_map splits batch and heads."""
  if mesh is None or mesh.empty:
    return (), ()
  manual = set(getattr(getattr(mesh, "abstract_mesh", mesh), "manual_axes", ()))
  free = [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]
  return (tuple(a for a in _axes.data_axes(mesh) if a in free),
          tuple(a for a in _axes.head_axes(mesh) if a in free))


def _context_axes(mesh) -> tuple[str, ...]:
  """Mesh axes (not manual, size > 1) that split the sequence (context parallelism)."""
  if mesh is None or mesh.empty:
    return ()
  manual = set(getattr(getattr(mesh, "abstract_mesh", mesh), "manual_axes", ()))
  return tuple(a for a in _axes.context_axes(mesh) if a not in manual and mesh.shape[a] > 1)


def _auto_candidates(platform: str, interpret: bool) -> tuple[str, ...]:
  if platform == "tpu":
    return ("splash",)
  if platform == "cuda":
    return ("cudnn", "pallas_gpu")
  if platform == "rocm":
    return ("pallas_gpu",)
  if interpret:
    return ("splash", "pallas_gpu")
  return ()


def _largest_divisor(n: int, candidates: Sequence[int]) -> int | None:
  return next((c for c in candidates if n % c == 0), None)


def _cannot_serve(name: str, call: _Call) -> str | None:
  """Why kernel `name` can't serve `call`, or None when it can: where it runs first (platform,
  devices, dtype, mesh), then the shapes and masks the kernel takes."""
  return _placement_problem(name, call) or _SHAPE_PROBLEMS[name](call)


def _placement_problem(name: str, call: _Call) -> str | None:
  (b, _, h, _), (_, _, kh, _) = call.q_shape, call.k_shape
  interpretable = name in ("splash", "pallas_gpu") and call.interpret
  home = {"splash": ("tpu",), "cudnn": ("cuda",), "pallas_gpu": ("cuda", "rocm")}[name]
  if call.platform not in home and not interpretable:
    hint = ("" if name == "cudnn" else
            "; with_kernel(..., interpret=True) runs it in interpret mode anywhere")
    return f"needs platform {'/'.join(home)}, this is {call.platform}{hint}"
  if name != "cudnn" and not call.interpret and call.unseen_devices > 1:
    # A Mosaic/Triton custom call can't be partitioned by XLA (cuDNN's has rules).
    return (f"no mesh in sight while the inputs may be split over {call.unseen_devices} "
            "devices, and XLA can't partition this kernel: set the mesh with "
            "fnscale.with_mesh, give the arguments NamedShardings or pass mesh=")
  if call.dtype not in _DTYPES[name]:
    return f"dtype {call.dtype} not in {_DTYPES[name]}"
  size = lambda axes: math.prod(call.axis_sizes[a] for a in axes)
  if call.batch_axes and b % size(call.batch_axes):
    return (f"batch {b} not divisible by mesh axes {call.batch_axes} "
            f"(size {size(call.batch_axes)})")
  if call.head_axes and (h % size(call.head_axes) or kh % size(call.head_axes)):
    return (f"heads {h} and kv heads {kh} must be divisible by mesh axes {call.head_axes} "
            f"(size {size(call.head_axes)})")
  return None


def _splash_problem(call: _Call) -> str | None:
  t, s, blocks = call.q_shape[1], call.k_shape[1], call.block_sizes
  if blocks is not None:
    if t % blocks.block_q or s % blocks.block_kv or blocks.block_kv % 128:
      return (f"block_sizes {tuple(blocks[:2])} must divide sequence lengths ({t}, {s}) "
              "and block_kv be a multiple of 128")
  elif _largest_divisor(t, _SPLASH_BLOCKS) is None or _largest_divisor(
      s, _SPLASH_BLOCKS) is None:
    return f"sequence lengths ({t}, {s}) must be multiples of 128"
  return None


def _pallas_gpu_problem(call: _Call) -> str | None:
  t, s, blocks = call.q_shape[1], call.k_shape[1], call.block_sizes
  if call.window is not None:
    return "sliding_window is not supported by the Pallas Triton attention"
  if call.soft_cap is not None:
    return "soft_cap is not supported by the Pallas Triton attention"
  if call.segments == "pair":
    return "needs one segment_ids array shared by queries and keys"
  if t != s:
    return f"needs q_seq == kv_seq, got {t} and {s}"
  if blocks is not None:
    if any(t % x for x in blocks if x is not None):
      return f"block_sizes {tuple(blocks)} must divide sequence length {t}"
  elif _largest_divisor(t, _GPU_BWD_BLOCKS) is None:
    return f"sequence length {t} must be a multiple of 16"
  return None


def _cudnn_problem(call: _Call) -> str | None:
  d = call.q_shape[3]
  max_d = 256 if _hopper_or_later() else 128
  if d % 8 or d > max_d:
    return f"head_dim {d} must be a multiple of 8 and <= {max_d}"
  if call.segments is not None:
    return "segment_ids are not supported by the cuDNN path"
  if call.soft_cap is not None:
    return "soft_cap is not supported by the cuDNN path"
  if call.window is not None and not call.causal and call.window[1] != 0:
    return "a sliding_window with a right side needs causal=True on cuDNN"
  return None


_SHAPE_PROBLEMS = {"splash": _splash_problem, "pallas_gpu": _pallas_gpu_problem,
                   "cudnn": _cudnn_problem}


def _hopper_or_later() -> bool:
  try:
    capability = jax.devices("gpu")[0].compute_capability
    return float(capability) >= 9.0
  except (RuntimeError, AttributeError, ValueError, IndexError):
    return False


def _block_sizes(name: str, call: _Call) -> BlockSizes | None:
  if name == "cudnn":
    return None
  t, s = call.q_shape[1], call.k_shape[1]
  given = call.block_sizes
  if name == "splash":
    tiles = None if given else _splash_tiles.measured(t, s, call.q_shape[3])
    if tiles is not None:
      return BlockSizes(*tiles)
    bq = given.block_q if given else _largest_divisor(t, _SPLASH_BLOCKS)
    bkv = given.block_kv if given else _largest_divisor(s, _SPLASH_BLOCKS)
    return BlockSizes(bq, bkv, (given and given.block_q_bwd) or bq,
                      (given and given.block_kv_bwd) or bkv)
  bq = given.block_q if given else _largest_divisor(t, _GPU_BLOCKS)
  bkv = given.block_kv if given else _largest_divisor(s, _GPU_BLOCKS)
  # The Triton backward needs as many q tiles as kv tiles; one backward tile serves both.
  bwd = (given and (given.block_q_bwd or given.block_kv_bwd)) or _largest_divisor(
      t, _GPU_BWD_BLOCKS)
  return BlockSizes(bq, bkv, bwd, bwd)
