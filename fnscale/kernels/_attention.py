"""Attention that runs the fastest kernel the platform has, or says why it can't.

`attention` dispatches one call to the TPU Pallas splash-attention kernel, the cuDNN flash
attention, the Pallas Triton attention or the XLA reference (`jax.nn.dot_product_attention`).
`kernel_selection` is the pure decision behind it: what would run and why. `with_kernel` scopes a
choice to one call of a function (and so to its trace), like `jax.set_mesh` scopes a mesh.
Two of fnscale's ambient values are read here besides the arguments (all five are declared in
`fnscale._context`): the mesh and the kernel choice (`KERNEL_CHOICE`); the axis conventions
(`fnscale.axis_conventions`) decide which mesh axes split batch and heads.

Under a mesh a kernel runs inside `jax.shard_map` over the mesh axes that shard batch (the
data-like axes of the ambient `fnscale.axis_conventions`: by default "replica", "data",
"fsdp") and heads (by default "tensor"; Levanter's "model", MaxText's tensor axes), so XLA
never has to partition a custom call it can't (Mosaic kernels can't be partitioned
automatically at all). The mesh is the one passed, else the ambient one (`with_mesh` /
`jax.set_mesh`, also when set only inside the trace), else the one q's sharding names (a
jitted call whose arguments carry `NamedSharding`s, also over a TPU topology description).
Sequence and head_dim stay whole inside each shard, unless the mesh has a context axis:
then the sequence is split over it and attention runs in one of the context forms of
`fnscale.parallel.context` (all-gathered K/V or a ring of K/V blocks,
`with_kernel(..., context=...)`), the kernel inside each shard chosen there.

Kernels: splash attention (Pallas TPU, jax.experimental.pallas.ops.tpu.splash_attention),
flash attention (Dao et al., 2022, arXiv:2205.14135) through cuDNN and Pallas/Triton
(jax.experimental.pallas.ops.gpu.attention); grouped-query attention (Ainslie et al., 2023,
arXiv:2305.13245).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

from absl import logging
import jax
import jax.numpy as jnp

from fnscale import _autodiff
from fnscale import _context
from fnscale._context import KernelChoice
from fnscale._errors import KernelError
from fnscale.kernels import _context_attention as context_attention
from fnscale.kernels._per_device import per_device
from fnscale.kernels._attention_call import (
    _auto_candidates, _block_sizes, _call_mesh, _cannot_serve, _check_block_sizes,
    _check_shapes, _check_soft_cap, _context_call, _describe_call, _normalise_window,
    _segment_arrays)
from fnscale.kernels._attention_kernels import (
    CAUSAL_SCOPE, IMPLEMENTATIONS, RESIDUALS, SCOPE, _KERNELS, BlockSizes, _xla,
    from_splash_layout, splash_layout)

__all__ = ["IMPLEMENTATIONS", "SCOPE", "CAUSAL_SCOPE", "RESIDUALS", "BlockSizes",
           "KernelSelection", "attention", "kernel_selection", "with_kernel"]


class KernelSelection(NamedTuple):
  """What `attention` runs for a call, and why.

  Attributes:
    implementation: the implementation that runs: "xla", "splash", "cudnn" or "pallas_gpu".
    requested: what was asked for after applying `with_kernel` ("auto" or a name).
    reason: why this implementation; for a fallback, why each preferred kernel can't serve.
    fallback: True when "auto" wanted a kernel for this platform but none could serve.
    block_sizes: the kernel's tiles (None for "xla" and "cudnn").
    interpret: whether a Pallas kernel runs in interpret mode (CPU testing).
    platform: the platform the decision was made for ("tpu", "cuda", "rocm", "cpu").
    batch_axes: mesh axes the kernel's shard_map splits batch over (empty: none).
    head_axes: mesh axes the kernel's shard_map splits heads over (empty: none).
    context: under a context axis, how the split sequence is attended
      (a `ContextSelection`, `fnscale.kernels._context_attention`); None without one.

  Examples:
    >>> import fnscale as fs
    >>> sel = fs.kernels.kernel_selection((2, 1024, 8, 128), (2, 1024, 2, 128), causal=True)
    >>> sel.implementation, sel.fallback, sel.platform, sel.block_sizes
    ('xla', False, 'cpu', None)
    >>> print(sel.reason)
    no attention kernel for platform 'cpu'; use with_kernel(..., interpret=True) to run the
    Pallas kernels on CPU
  """
  implementation: str
  requested: str
  reason: str
  fallback: bool
  block_sizes: BlockSizes | None
  interpret: bool
  platform: str
  batch_axes: tuple[str, ...] = ()
  head_axes: tuple[str, ...] = ()
  context: Any = None


def with_kernel(fn: Callable[..., Any] | None = None, *, attention: str = "auto",
                interpret: bool = False, context: str = "all_gather",
                context_order: str = "zigzag",
                block_sizes: BlockSizes | None = None) -> Callable[..., Any]:
  """Returns `fn` with a kernel choice in force during each of its calls.

  During a call of the returned function (and so while jax traces it), every
  `fnscale.attention(..., implementation="auto")` inside behaves as if called with
  `implementation=attention`; the choice is held in a thread-local jax user context
  (`fnscale._context.KERNEL_CHOICE`) set before and reset after the call, so two
  differently wrapped functions in one program each keep their own, and it is part of
  `jax.jit`'s cache key: a jitted function called under another choice is traced again. It
  composes with `fnscale.with_mesh` / `jax.set_mesh` in either order, inside or outside
  `jax.jit`.

  Caches that are not jax's own don't see the choice: a `shard_step`'d step keeps its first
  executable, so wrap the step it compiles, `shard_step(with_kernel(step, ...), mesh)`.

  Args:
    fn: the function to wrap (a loss function, a train step, a `shard_step`'d step). When
      omitted, returns a decorator.
    attention: "auto" (best kernel for the platform, else the XLA reference), or one of
      "xla", "splash", "cudnn", "pallas_gpu" to force it (`KernelError` where it can't
      serve a call).
    interpret: run the Pallas kernels ("splash", "pallas_gpu") in interpret mode, which
      works on any platform (slowly); for tests on CPU.
    context: under a mesh with a context axis (the sequence split over it), "all_gather"
      (each shard gathers K/V), "ring" (K/V blocks passed round the axis) or "ulysses"
      (an all-to-all trades sequence shards for head shards around attention; heads must
      divide over the axis); see `fnscale.parallel.context`.
    context_order: the order the context shards hold the sequence in, as the batch was put
      by `fnscale.parallel.context.reorder`: "zigzag" (default), "striped" or "contiguous".
    block_sizes: the kernel tiles (`BlockSizes`) of every attention call inside that gives
      none itself (default: chosen per call: splash's measured tiles for the shape, else
      the largest tile that divides the sequence); tiles that don't divide a call's
      sequence make it fall back (or raise, where a kernel was forced) saying so.

  Returns:
    A function with `fn`'s signature and result.

  Raises:
    KernelError: `attention`, `context` or `context_order` is not a known value,
      `interpret` is not a bool, `block_sizes` not a `BlockSizes` of positive ints, or
      `fn` is not callable.

  Examples:
    >>> import fnscale as fs
    >>> def which(shape):
    ...   return fs.kernels.kernel_selection(shape, shape).implementation
    >>> which((2, 128, 4, 64))  # on CPU
    'xla'
    >>> fs.with_kernel(which, attention="splash", interpret=True)((2, 128, 4, 64))
    'splash'
    >>> blocks = fs.kernels.BlockSizes(256, 512)
    >>> sel = fs.with_kernel(fs.kernels.kernel_selection, block_sizes=blocks)
    >>> sel((2, 1024, 4, 64), (2, 1024, 4, 64), platform="tpu").block_sizes[:2]
    (256, 512)
  """
  if attention not in IMPLEMENTATIONS:
    raise KernelError(
        f"with_kernel(attention={attention!r}): expected one of {IMPLEMENTATIONS}.")
  if not isinstance(interpret, bool):
    raise KernelError(f"with_kernel(interpret={interpret!r}): expected True or False.")
  if context not in context_attention.FORMS or context_order not in context_attention.ORDERS:
    raise KernelError(
        f"with_kernel(context={context!r}, context_order={context_order!r}): expected "
        f"context in {context_attention.FORMS} and context_order in "
        f"{context_attention.ORDERS}.")
  if block_sizes is not None:
    block_sizes = _check_block_sizes(block_sizes, "with_kernel")
  if fn is None:
    return functools.partial(with_kernel, attention=attention, interpret=interpret,
                             context=context, context_order=context_order,
                             block_sizes=block_sizes)
  if not callable(fn):
    raise KernelError(
        f"with_kernel(fn={fn!r}): expected a function to wrap, got {type(fn).__name__}.")
  choice = KernelChoice(attention, interpret, context, context_order, block_sizes)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _context.KERNEL_CHOICE(choice):
      return fn(*args, **kwargs)

  return wrapped


def kernel_selection(q_shape: Sequence[int] | jax.Array, k_shape: Sequence[int],
                     dtype: Any = jnp.float32, *,
                     causal: bool = False, segment_ids: Any = None,
                     sliding_window: int | tuple[int, int] | None = None,
                     soft_cap: float | None = None,
                     implementation: str = "auto", block_sizes: BlockSizes | None = None,
                     platform: str | None = None, interpret: bool | None = None,
                     mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
                     ) -> KernelSelection:
  """Decides which attention implementation serves a call, without running it.

  Args:
    q_shape: query shape [batch, q_seq, heads, head_dim], or q itself (an array or tracer:
      then the manual axes it varies over inside a `shard_map` count too).
    k_shape: key (and value) shape [batch, kv_seq, kv_heads, head_dim]; kv_heads divides
      heads (grouped-query / multi-query attention).
    dtype: the dtype of q, k and v.
    causal: causal masking (query i sees keys j <= i).
    segment_ids: None, an int array (or anything with `.shape`) [batch, seq] shared by
      queries and keys, or a pair (q_segment_ids [batch, q_seq], kv_segment_ids
      [batch, kv_seq]). Only the structure matters here.
    sliding_window: None, an int w (query i sees keys i-w..i+w) or a pair (left, right),
      as `jax.nn.dot_product_attention`'s `local_window_size`.
    soft_cap: None, or a positive float c: the logits capped as c tanh(logits / c) (served
      by splash and the XLA reference; not by cudnn, pallas_gpu or a context axis).
    implementation: "auto" or a name in `IMPLEMENTATIONS`. "auto" takes the choice of an
      enclosing `with_kernel`, then tries splash on TPU, cudnn then pallas_gpu on NVIDIA
      GPUs, splash then pallas_gpu in interpret mode, else "xla".
    block_sizes: override the kernel tiles (`BlockSizes`); default: splash's measured
      tiles for the shape (`fnscale.kernels._splash_tiles`), else the largest tile that
      divides the sequence (splash 512/256/128, pallas_gpu 128/64/32/16).
    platform: "tpu", "cuda", "rocm", "gpu" or "cpu"; default: the mesh's, else jax's
      default backend.
    interpret: Pallas interpret mode; default: the enclosing `with_kernel`'s (else False).
    mesh: the mesh to shard the kernel over; default: the context mesh
      (`jax.sharding.get_abstract_mesh()`), none outside one. With no mesh at all on a
      platform with several devices the Pallas kernels can't serve (XLA can't partition
      their custom calls): "auto" falls back. Inside a `jax.shard_map` that checks varying
      axes (check_vma=True, as `shard_step(mode="shard_map")`'s) they serve.

  Returns:
    A `KernelSelection`.

  Raises:
    KernelError: bad shapes or arguments, or a forced implementation that can't serve the
      call (the message names the reason).

  Examples:
    Splash on a TPU; here on CPU, the Pallas kernel in interpret mode or the XLA reference:

    >>> import fnscale as fs
    >>> q = (2, 1024, 8, 128)  # [batch, seq, heads, head_dim]
    >>> fs.kernels.kernel_selection(q, q, platform="tpu").reason
    'splash serves this call'
    >>> fs.kernels.kernel_selection(q, q, interpret=True).implementation
    'splash'
    >>> fs.kernels.kernel_selection(q, q, implementation="cudnn")
    Traceback (most recent call last):
    ...
    fnscale.KernelError: ...cudnn...
  """
  call, requested, note = _describe_call(
      q_shape, k_shape, dtype, causal, segment_ids, sliding_window,
      implementation, block_sizes, platform, interpret, mesh, soft_cap)
  select = functools.partial(KernelSelection, requested=requested, interpret=call.interpret,
                           platform=call.platform)
  if call.context_axes:  # the sequence is split: one of the context forms
    if call.soft_cap is not None:
      raise KernelError(
          f"attention(soft_cap={call.soft_cap}) over a sequence split on "
          f"{call.context_axes}: the context forms don't cap logits; fix: a mesh without a "
          "context axis, or no soft_cap.")
    cp = context_attention.selection(_context_call(call, requested))
    return select(cp.kernel, reason=cp.reason, fallback=False, block_sizes=None,
                batch_axes=cp.batch_axes, head_axes=cp.head_axes, context=cp)
  if requested == "xla":
    return select("xla", reason="the xla reference was requested", fallback=False,
                block_sizes=None)
  candidates = (_auto_candidates(call.platform, call.interpret) if requested == "auto"
                else (requested,))
  reasons = []
  for name in candidates:
    why = _cannot_serve(name, call)
    if why is None:
      axes = call.batch_axes + call.head_axes
      reason = (f"{name} serves this call"
                + (" (interpret mode)" if call.interpret and name != "cudnn" else "")
                + (f" inside shard_map over {axes}" if axes else "") + note
                + (f"; skipped {'; '.join(reasons)}" if reasons else ""))
      return select(name, fallback=False, block_sizes=_block_sizes(name, call), reason=reason,
                  batch_axes=call.batch_axes, head_axes=call.head_axes)
    if requested != "auto":
      raise KernelError(
          f"attention(implementation={name!r}) can't serve this call: {why}. Use "
          "implementation='auto' to fall back to the xla reference, or change the call.")
    reasons.append(f"{name}: {why}")
  if reasons:
    return select("xla", reason="; ".join(reasons), fallback=True, block_sizes=None)
  return select("xla", fallback=False, block_sizes=None,
              reason=(f"no attention kernel for platform {call.platform!r}; use "
                      "with_kernel(..., interpret=True) to run the Pallas kernels on CPU"
                      + note))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              segment_ids: Any = None, sliding_window: int | tuple[int, int] | None = None,
              scale: float | None = None, soft_cap: float | None = None,
              implementation: str = "auto",
              block_sizes: BlockSizes | None = None,
              mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  """Scaled dot-product attention on the best kernel that can serve the call.

  softmax(scale * q k^T + mask) v per head, with kv head `h // (heads // kv_heads)` serving
  query head h. "auto" falls back to the XLA reference when a kernel can't serve the call
  (platform, dtype, head_dim or sequence length not a multiple of its tile, mask kind,
  heads not divisible by the "tensor" mesh axis) and logs the reason once per distinct
  reason; `kernel_selection` reports the same decision without running anything.

  Args:
    q: queries [batch, q_seq, heads, head_dim], float32/bfloat16/float16.
    k: keys [batch, kv_seq, kv_heads, head_dim], same dtype; kv_heads divides heads.
    v: values, the shape and dtype of `k`.
    causal: causal masking (query i sees keys j <= i; top-left aligned).
    segment_ids: None, int [batch, seq] shared by queries and keys (q_seq == kv_seq), or a
      pair (q_segment_ids [batch, q_seq], kv_segment_ids [batch, kv_seq]); a query sees
      only keys with its segment id (packed sequences).
    sliding_window: None, int w (query i sees keys i-w..i+w) or a pair (left, right), as
      `jax.nn.dot_product_attention`'s `local_window_size`; with `causal`, right is 0.
    scale: logit scale; default 1/sqrt(head_dim).
    soft_cap: None, or a positive float c: the scaled logits become c tanh(logits / c)
      before the mask (Gemma 2's attention logit soft-capping); splash and the XLA
      reference serve it.
    implementation: "auto" (see `kernel_selection`), "xla", "splash", "cudnn" or "pallas_gpu".
    block_sizes: kernel tiles (`BlockSizes`); default chosen from the shapes.
    mesh: shard the kernel over this mesh (a `Mesh`, also over TPU topology-description
      devices, or an `AbstractMesh`); default: the context mesh (`jax.set_mesh` /
      `fnscale.with_mesh`), else the mesh of q's `NamedSharding` (under `jax.jit`, the
      arguments' shardings), else none. A mesh with a context axis (size > 1) splits the
      sequence: q, k, v and segment_ids come in the order `with_kernel`'s
      `context_order` names (`fnscale.parallel.context.reorder_batch`), self-attention
      only, no sliding window.

  Returns:
    [batch, q_seq, heads, head_dim] in q's dtype.

  Raises:
    KernelError: bad shapes, dtypes or arguments, or a forced implementation that can't
      serve the call (the message names the reason).

  Examples:
    On CPU "auto" runs the XLA reference (`kernel_selection` says which and why):

    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 128, 4, 64))
    >>> @jax.jit
    ... def check(q, k, v):
    ...   out = fs.attention(q, k, v, causal=True)
    ...   return out, jnp.abs(out - jax.nn.dot_product_attention(q, k, v, is_causal=True)).max()
    >>> out, error = check(q, k, v)
    >>> out.shape, out.dtype, bool(error < 1e-5)
    ((2, 128, 4, 64), dtype('float32'), True)
    >>> fs.kernels.kernel_selection(q.shape, k.shape).implementation
    'xla'
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise KernelError(f"attention: {name} must be an array, got {type(x).__name__}.")
  _check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise KernelError(
        f"attention: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be one floating "
        "dtype; cast them to the same one.")
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  elif not isinstance(scale, (int, float)) or not scale > 0:
    raise KernelError(f"attention(scale={scale!r}): expected a positive Python float.")
  if soft_cap is not None:
    soft_cap = _check_soft_cap(soft_cap)
  with jax.named_scope(CAUSAL_SCOPE if causal else SCOPE):
    return _attend(q, k, v, causal, segment_ids, sliding_window, float(scale), implementation,
                   block_sizes, mesh, soft_cap)


def _attend(q, k, v, causal, segment_ids, sliding_window, scale, implementation,
            block_sizes, mesh, soft_cap=None):
  """`attention` after its argument checks: choose the implementation and run it."""
  mesh = _call_mesh(mesh, q)
  selection = kernel_selection(
      q, k.shape, q.dtype, causal=causal, segment_ids=segment_ids,
      sliding_window=sliding_window, soft_cap=soft_cap, implementation=implementation,
      block_sizes=block_sizes, mesh=mesh)
  if selection.fallback:
    _log_fallback(selection.reason)
  q_ids, kv_ids = _segment_arrays(segment_ids, q.shape, k.shape)
  window = _normalise_window(sliding_window)
  if selection.context is not None:
    return context_attention.attend(q, k, v, q_ids, kv_ids, selection.context, mesh,
                                    causal=causal, scale=scale)
  if selection.implementation == "xla":
    return _xla(q, k, v, q_ids, kv_ids, causal=causal, window=window, scale=scale,
                soft_cap=soft_cap)
  kernel = functools.partial(_KERNELS[selection.implementation], causal=causal, window=window,
                             scale=scale, blocks=selection.block_sizes,
                             interpret=selection.interpret, soft_cap=soft_cap)
  reference = functools.partial(_xla, causal=causal, window=window, scale=scale,
                                soft_cap=soft_cap)
  splash = selection.implementation == "splash"
  if splash:  # its layout outside the kernel's primitive: see splash_layout
    dtype, (q, k, v) = q.dtype, splash_layout(q, k, v, scale)
    reference = from_splash_layout(reference)
  if selection.batch_axes or selection.head_axes:
    kernel = functools.partial(_sharded, kernel, selection, mesh=mesh, heads_major=splash)
  # The kernels differentiate only in reverse mode; forward mode takes the reference's JVP.
  # Around the shard_map: inside one that checks varying axes (shard_step's), the kernel
  # and its own shard_map run where no type is checked (_compat.kernel_call).
  out = _autodiff.reverse_only(
      kernel, reference, f"fnscale.attention's {selection.implementation} kernel",
      "the XLA reference")(q, k, v, q_ids, kv_ids)
  return jnp.swapaxes(out, 1, 2).astype(dtype) if splash else out


@functools.lru_cache(maxsize=None)
def _log_fallback(reason: str) -> None:
  # Cached only so that each distinct reason is logged once; it holds no decision.
  logging.warning("fnscale.attention falls back to the xla reference: %s", reason)


def _sharded(kernel, selection: KernelSelection, q, k, v, q_ids, kv_ids, mesh,
             heads_major: bool = False):
  """Runs `kernel` per shard: batch over selection.batch_axes, heads over its head_axes
  (q, k, v [batch, seq, heads, head_dim], or `splash_layout`'s where `heads_major`)."""
  batch = selection.batch_axes or None
  heads = selection.head_axes or None
  qkv_spec = jax.P(batch, heads, None, None) if heads_major else jax.P(batch, None, heads, None)
  kv_spec = qkv_spec if k.ndim == 4 else jax.P(batch, None, None)
  ids_spec = jax.P(batch, None)
  args, specs = [q, k, v], [qkv_spec, kv_spec, kv_spec]
  shared = q_ids is not None and q_ids is kv_ids
  if q_ids is not None:
    args.append(q_ids)
    specs.append(ids_spec)
    if not shared:
      args.append(kv_ids)
      specs.append(ids_spec)

  def body(q, k, v, *ids):
    if not ids:
      return kernel(q, k, v, None, None)
    return kernel(q, k, v, ids[0], ids[0] if shared else ids[1])

  return per_device(body, args, specs, qkv_spec, mesh, like=q)
