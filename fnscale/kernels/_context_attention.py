"""Attention over a sequence split across a `context` mesh axis (context parallelism).

Each of the c devices of a context axis holds T = S / c tokens of every sequence, in the
order `reorder` puts them in (one definition, applied once by the data path to tokens,
targets, positions and segment ids; `restore` undoes it). Attention then runs in a
`jax.shard_map` in one of three forms, chosen by `fnscale.with_kernel(..., context=...)`:

- "all_gather" (the default, as in MaxText): each device all-gathers K and V over the
  context axis ((c-1)/c x 2 x B x S x kv_heads x head_dim x bytes sent per layer forward;
  their gradients are reduce-scattered backward) and attends its T queries to all S keys.
- "ring" (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889):
  K/V blocks pass round the axis with c-1 `ppermute`s while each device merges its blocks
  with an online softmax (Milakov & Gimelshein 2018); the backward pass (a `custom_vjp`)
  passes the blocks round again with their dK/dV accumulators (c permutes of dK/dV). No
  device ever holds more than one remote block.
- "ulysses" (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509; MaxText's
  context_parallel_strategy="ulysses"): an all-to-all over the context axis trades each
  device's T tokens of every head for all S tokens of h/c heads; each device attends its
  heads over the whole sequence and a second all-to-all trades the output back. Each sends
  (c-1)/c of its q, k, v and output shards per layer forward (as many backward), a volume
  that does not grow with c. Heads must divide over the axis. With fewer kv heads than
  the axis (GQA, MQA) each kv head is repeated c / gcd(kv_heads, c) times before the
  exchange, so every device receives the kv heads its query heads use (MaxText instead
  requires kv heads divisible by the axis).

Causal load balance: under a causal mask the later tokens see more keys, so contiguous
shards do unequal work (the last (2c-1)/c of the mean). The "zigzag" order (each shard holds
chunk i and chunk 2c-1-i of 2c chunks; MaxText's "dual chunk swap", Megatron-LM's
context-parallel layout) and the "striped" order (token t on shard t mod c; Brandon et al.
2023, "Striped Attention", arXiv:2311.09431) give every shard the same unmasked
query-key pairs (`shard_work`).

Per shard, the TPU splash kernel runs where it can (its block-sparse mask skips masked
tiles): the all-gather and Ulysses forms build one kernel for the whole [S, S] mask with
the queries' places in the sequence as its q sequence, split by query rows over the context
axis as the kernel allows (`q_seq_shards`; Ulysses holds every row and doesn't split it);
the ring form calls its forward and backward block kernels
(`fnscale._compat.splash_block_forward/backward`) with a mask that is the same for every
pair of shards of one case (diagonal, earlier or later shard). Elsewhere the XLA reference:
jax's cuDNN and Pallas GPU attention can't take a shard's mask (its causal diagonal is
offset by the shard's place, and the ring needs each block's logsumexp).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from fnscale import _autodiff
from fnscale import _compat
from fnscale._errors import KernelError
from fnscale.kernels._per_device import per_device

FORMS = ("all_gather", "ring", "ulysses")
ORDERS = ("zigzag", "striped", "contiguous")
# The splash kernel's tiles, largest first (block_kv must be a multiple of 128 lanes).
SPLASH_TILES = (512, 256, 128)
SPLASH_DTYPES = ("float32", "bfloat16")
# Fill for masked logits before the softmax (finite: no inf - inf).
_MASKED = -0.7 * float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- the order


def chunks(order: str, shards: int) -> int:
  """Pieces of the sequence the order deals out: 2 per shard for zigzag, else 1 (striped
  deals single tokens but needs the length divisible by the shards)."""
  return 2 * shards if order == "zigzag" else shards


def check_order(order: str, seq: int, shards: int, what: str = "sequence") -> None:
  """Raises KernelError unless `order` is known and `seq` splits into its pieces."""
  if order not in ORDERS:
    raise KernelError(f"context order {order!r}: expected one of {ORDERS}.")
  n = chunks(order, shards)
  if seq % n:
    fix = (f"a {what} length that is a multiple of {n}" + (
        f" (zigzag: 2 chunks x {shards} shards), or order='striped' (a multiple of {shards})"
        if order == "zigzag" else ""))
    raise KernelError(
        f"{what} of {seq} tokens can't be split over {shards} context shards in the "
        f"{order!r} order; fix: {fix}, or a context axis whose size divides it.")


def reorder(x, shards: int, order: str, axis: int = 1):
  """`x` (numpy or jax) with its `axis` in the order the context shards hold it: shard s
  holds the s-th run of length/shards elements. zigzag: chunks s and 2c-1-s of 2c equal
  chunks; striped: elements s, s+c, s+2c, ...; contiguous: unchanged.

  Raises:
    KernelError: an unknown order, a length it can't split.

  Examples:
    >>> import fnscale as fs, numpy as np
    >>> x = np.arange(8)[None]  # [batch, seq]
    >>> fs.parallel.context.reorder(x, 2, "zigzag"), fs.parallel.context.reorder(x, 2, "striped")
    (array([[0, 1, 6, 7, 2, 3, 4, 5]]), array([[0, 2, 4, 6, 1, 3, 5, 7]]))
  """
  check_order(order, x.shape[axis], shards)
  xp = np if isinstance(x, np.ndarray) else jnp
  y = xp.moveaxis(x, axis, 0)
  n, rest = y.shape[0], y.shape[1:]
  if order == "zigzag":
    y = y.reshape(2, shards, n // (2 * shards), *rest)
    y = xp.stack([y[0], y[1][::-1]], axis=1)
  elif order == "striped":
    y = xp.swapaxes(y.reshape(n // shards, shards, *rest), 0, 1)
  return xp.moveaxis(y.reshape(n, *rest), 0, axis)


def restore(x, shards: int, order: str, axis: int = 1):
  """The inverse of `reorder`: `x`'s `axis` back in sequence order (per-token outputs of a
  context-parallel model, e.g. its logits, back where the tokens were).

  Raises:
    KernelError: an unknown order, a length it can't split.

  Examples:
    >>> import fnscale as fs, numpy as np
    >>> held = np.array([[0, 1, 6, 7, 2, 3, 4, 5]])  # as two zigzag shards hold it
    >>> fs.parallel.context.restore(held, 2, "zigzag")
    array([[0, 1, 2, 3, 4, 5, 6, 7]])
  """
  check_order(order, x.shape[axis], shards)
  xp = np if isinstance(x, np.ndarray) else jnp
  y = xp.moveaxis(x, axis, 0)
  n, rest = y.shape[0], y.shape[1:]
  if order == "zigzag":
    y = y.reshape(shards, 2, n // (2 * shards), *rest)
    y = xp.concatenate([y[:, 0], y[::-1, 1]], axis=0)
  elif order == "striped":
    y = xp.swapaxes(y.reshape(shards, n // shards, *rest), 0, 1)
  return xp.moveaxis(y.reshape(n, *rest), 0, axis)


def positions(seq: int, shards: int, order: str) -> np.ndarray:
  """int32 [shards, seq / shards]: the place in the sequence of each token a shard holds.

  Examples:
    >>> import fnscale as fs
    >>> fs.parallel.context.positions(8, 2, "zigzag")
    array([[0, 1, 6, 7],
           [2, 3, 4, 5]], dtype=int32)
  """
  return reorder(np.arange(seq, dtype=np.int32), shards, order, axis=0).reshape(shards, -1)


# ------------------------------------------------------------------------ the selection


class ContextSelection(NamedTuple):
  """How attention runs over a sequence split on `axes` (`shards` devices in all).

  `form`: "all_gather", "ring" or "ulysses"; `order`: the order the shards hold the sequence in;
  `kernel`: what attends within a shard, "splash" or "xla"; `tile`: the splash tile (tokens;
  None for xla); `interpret`: Pallas interpret mode; `batch_axes`, `head_axes`: the other
  mesh axes the shard_map splits batch and heads over; `reason`: why this kernel.
  """
  form: str
  order: str
  axes: tuple[str, ...]
  shards: int
  kernel: str
  reason: str
  tile: int | None = None
  interpret: bool = False
  batch_axes: tuple[str, ...] = ()
  head_axes: tuple[str, ...] = ()


class ContextCall(NamedTuple):
  """What `selection` decides from: global shapes, dtype name, mask, kernel request, mesh."""
  q_shape: tuple[int, ...]
  k_shape: tuple[int, ...]
  dtype: str
  causal: bool
  window: tuple[int, int] | None
  requested: str
  form: str
  order: str
  platform: str
  interpret: bool
  axis_sizes: dict
  axes: tuple[str, ...]
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]


def selection(call: ContextCall) -> ContextSelection:
  """The context form of a call (see `ContextSelection`); checks it before anything is traced.

  Raises:
    KernelError: a form or order not known; a sliding window; q and kv lengths that differ;
      a sequence the order can't split over the shards; a ring whose heads or kv heads the
      head axes can't split; Ulysses heads the context axes can't split; a requested
      kernel that can't take a split sequence.
  """
  c = math.prod(call.axis_sizes[a] for a in call.axes)
  (b, s, h, _), kh = call.q_shape, call.k_shape[2]
  if call.form not in FORMS:
    raise KernelError(f"with_kernel(context={call.form!r}): expected one of {FORMS}.")
  if call.window is not None:
    raise KernelError(
        f"attention(sliding_window={call.window}) over a sequence split on {call.axes}: not "
        "supported; fix: a mesh without a context axis, or no sliding window.")
  if call.k_shape[1] != s:
    raise KernelError(
        f"attention over a sequence split on {call.axes} needs q_seq == kv_seq (self-"
        f"attention), got {s} and {call.k_shape[1]}; fix: a mesh without a context axis.")
  check_order(call.order, s, c)
  size = lambda axes: math.prod(call.axis_sizes[a] for a in axes)
  heads = call.head_axes
  if heads and (h % size(heads) or kh % size(heads)):
    if call.form == "ring":
      raise KernelError(
          f"context='ring': heads {h} and kv heads {kh} must be divisible by the head axes "
          f"{heads} (size {size(heads)}), which split them in the ring's shard_map; fix: a "
          "tensor axis that divides both, or context='all_gather'.")
    heads = ()
  if call.form == "ulysses":
    check_ulysses_heads(h // size(heads), c, call.axes, heads)
  batch = call.batch_axes if b % size(call.batch_axes) == 0 else ()
  kernel, tile, why = _kernel(call, c)
  return ContextSelection(call.form, call.order, call.axes, c, kernel, why, tile, call.interpret,
                     batch, heads)


def check_ulysses_heads(heads: int, c: int, axes, head_axes=()) -> None:
  """Raises KernelError unless Ulysses can deal `heads` (per head-axes shard) out over the
  c devices of the context `axes`."""
  if heads % c:
    split = f" per {head_axes} shard" if head_axes else ""
    raise KernelError(
        f"context='ulysses': {heads} heads{split} can't be dealt out over the context axes "
        f"{axes} ({c} devices), whose all-to-all gives each device heads / {c} of them; fix: "
        f"a context axis whose size divides {heads}, or context='all_gather' or 'ring'.")


def kv_repeats(kv_heads: int, c: int) -> int:
  """Times Ulysses repeats each kv head so that the c devices each receive whole kv heads,
  those their query heads use: c / gcd(kv_heads, c) (1 when c divides kv_heads). With
  heads divisible by c this also divides the GQA group, so the repeats stay in groups.

  Examples:
    >>> from fnscale.kernels import _context_attention as ca
    >>> ca.kv_repeats(8, 4), ca.kv_repeats(2, 8), ca.kv_repeats(6, 4), ca.kv_repeats(1, 4)
    (1, 4, 2, 4)
  """
  return c // math.gcd(kv_heads, c)


def _kernel(call: ContextCall, c: int) -> tuple[str, int | None, str]:
  """(kernel within a shard, splash tile, why)."""
  where = f"{call.form} over {call.axes} ({c} shards, {call.order} order)"
  if call.requested in ("cudnn", "pallas_gpu"):
    raise KernelError(
        f"attention(implementation={call.requested!r}) can't take a sequence split over "
        f"{call.axes}: {_NOT_GPU}; fix: with_kernel(attention='auto') or 'xla' (or 'splash' "
        "on TPU), or a mesh without a context axis.")
  if call.requested == "xla":
    return "xla", None, f"xla reference {where}: requested"
  why = _splash_refusal(call, c)
  if why is None:
    tile = _tile(call, c)
    return "splash", tile, f"splash {where}, tile {tile}" + (
        " (interpret mode)" if call.interpret else "")
  if call.requested == "splash":
    raise KernelError(f"attention(implementation='splash') can't serve {where}: {why}.")
  gpu = f"; cudnn, pallas_gpu: {_NOT_GPU}" if call.platform in ("cuda", "rocm") else ""
  return "xla", None, f"xla reference {where}: splash: {why}{gpu}"


_NOT_GPU = ("a shard's causal mask is offset by its place in the sequence and the ring "
            "merges blocks by their logsumexp, which neither jax's cuDNN attention nor the "
            "Pallas Triton kernel takes or returns")


def _splash_refusal(call: ContextCall, c: int) -> str | None:
  """Why splash can't attend within the shards, or None."""
  if call.platform != "tpu" and not call.interpret:
    return (f"needs platform tpu, this is {call.platform}; with_kernel(..., interpret=True) "
            "runs it in interpret mode anywhere")
  if call.dtype not in SPLASH_DTYPES:
    return f"dtype {call.dtype} not in {SPLASH_DTYPES}"
  if _tile(call, c) is None:
    return (f"a shard's {_piece(call, c)}-token pieces must be a multiple of "
            f"{SPLASH_TILES[-1]}")
  return None


def _piece(call: ContextCall, c: int) -> int:
  """Tokens of the smallest piece a splash call sees: half a shard in the zigzag ring."""
  t = call.q_shape[1] // c
  if call.form == "ulysses":  # each device attends the whole sequence
    return call.q_shape[1]
  return t // 2 if call.form == "ring" and call.order == "zigzag" and call.causal else t


def _tile(call: ContextCall, c: int) -> int | None:
  piece = _piece(call, c)
  return next((b for b in SPLASH_TILES if piece % b == 0), None)


# ----------------------------------------------------------------------------- running


def attend(q, k, v, q_ids, kv_ids, p: ContextSelection, mesh, *, causal: bool, scale: float):
  """Attention of global q, k, v [batch, seq, heads, head_dim] (seq in `p.order`) with
  optional int32 segment ids [batch, seq], run per shard as `p` says. Returns q's shape."""
  qkv = jax.P(p.batch_axes or None, p.axes, p.head_axes or None, None)
  ids = jax.P(p.batch_axes or None, p.axes)
  body = {"ring": _ring, "ulysses": _ulysses}.get(p.form, _all_gather)
  args, specs = [q, k, v], [qkv] * 3
  for x in (q_ids, kv_ids):
    if x is not None:
      args.append(x)
      specs.append(ids)
  has_ids = q_ids is not None
  extra = _splash_whole(p, q.shape, k.shape[2], mesh, causal) if (
      p.form == "all_gather" and p.kernel == "splash") else None
  if extra is not None:
    args.append(extra[0])
    specs.append(extra[1])

  run = lambda q, k, v, q_i, kv_i, kernel: body(q, k, v, q_i, kv_i, p, causal, scale, kernel)
  if p.form == "ring" or p.kernel == "splash":  # reverse-mode only: forward mode by XLA's
    xla = p._replace(kernel="xla")
    run = _autodiff.reverse_only(
        run, lambda q, k, v, q_i, kv_i, _: _all_gather(q, k, v, q_i, kv_i, xla, causal, scale,
                                                       None),
        f"context attention's {p.form} form ({p.kernel})",
        "the all-gather form with the XLA kernel")

  def local(q, k, v, *rest):
    q_i, kv_i = (rest[0], rest[1]) if has_ids else (None, None)
    return run(q, k, v, q_i, kv_i, rest[-1] if extra is not None else None)

  return per_device(local, args, specs, qkv, mesh, like=q)


def _shard_positions(p: ContextSelection, t: int) -> tuple[jax.Array, jax.Array]:
  """(this shard's tokens' places [t], every stored token's place [S]) in the sequence."""
  table = jnp.asarray(positions(t * p.shards, p.shards, p.order))
  mine = lax.dynamic_index_in_dim(table, lax.axis_index(p.axes), keepdims=False)
  return mine, table.reshape(-1)


def _all_gather(q, k, v, q_ids, kv_ids, p: ContextSelection, causal, scale, kernel):
  """The all-gather form on one shard: q [b, t, h, d] against all of K/V."""
  gather = lambda x: lax.all_gather(x, p.axes, axis=1, tiled=True)
  k, v = gather(k), gather(v)
  kv_ids = None if kv_ids is None else gather(kv_ids)
  if p.kernel == "splash":
    return _splash_gathered(q, k, v, q_ids, kv_ids, p, scale, kernel)
  mine, every = _shard_positions(p, q.shape[1])
  return _xla_masked(q, k, v, mine, every, q_ids, kv_ids, causal, scale)


def _xla_masked(q, k, v, q_places, kv_places, q_ids, kv_ids, causal, scale):
  """XLA's attention of q against k, v with the causal mask of the tokens' places in the
  sequence ([q len], [kv len]) and, given ids, the segment mask."""
  mask = (q_places[:, None] >= kv_places[None, :])[None, None] if causal else None
  if q_ids is not None:
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    mask = same if mask is None else mask & same
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def _ulysses(q, k, v, q_ids, kv_ids, p: ContextSelection, causal, scale, kernel):
  """The Ulysses form on one shard: q [b, t, h, d], k, v [b, t, kh, d] of its t tokens
  traded for all S tokens of h / c heads (and the kv heads they use), attended, and traded
  back."""
  del kernel  # one kernel, the same on every device: built here
  c = p.shards
  r = kv_repeats(k.shape[2], c)
  k, v = (x if r == 1 else jnp.repeat(x, r, axis=2) for x in (k, v))
  # Shard s's tokens are the s-th run of the stored order: concatenated by shard they are
  # the whole sequence in that order.
  to_heads = lambda x: lax.all_to_all(x, p.axes, 2, 1, tiled=True)
  q, k, v = to_heads(q), to_heads(k), to_heads(v)
  gather = lambda x: None if x is None else lax.all_gather(x, p.axes, axis=1, tiled=True)
  q_ids, kv_ids = gather(q_ids), gather(kv_ids)
  if p.kernel == "splash":
    kernel = _whole_kernel(q.shape[1], c, p.order, q.shape[2], k.shape[2], p.tile, causal,
                           p.interpret, rows_split=1)
    out = _splash_gathered(q, k, v, q_ids, kv_ids, p, scale, kernel)
  else:
    every = jnp.asarray(positions(q.shape[1], c, p.order).reshape(-1))
    out = _xla_masked(q, k, v, every, every, q_ids, kv_ids, causal, scale)
  return lax.all_to_all(out, p.axes, 1, 2, tiled=True)


# ----------------------------------------------------------------------------- splash


def _splash_lib():
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel, splash_attention_mask as mask)
  return kernel, mask


def _blocks(tile: int, q_len: int, kv_len: int):
  splash, _ = _splash_lib()
  bq, bkv = min(tile, q_len), min(tile, kv_len)
  return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                           block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                           block_kv_dq=bkv)


def _ordered_causal(seq: int, shards: int, order: str):
  """Splash's causal mask over the stored order: row r is the token at place
  positions(...)[r] of the sequence, columns in sequence order."""
  _, masks = _splash_lib()
  mask = masks.CausalMask((seq, seq))
  mask.q_sequence = positions(seq, shards, order).reshape(-1)
  return mask


def _whole_kernel(seq: int, shards: int, order: str, heads: int, kv_heads: int, tile: int,
                  causal: bool, interpret: bool, rows_split: int | None = None):
  """The splash kernel for the whole [seq, seq] mask (rows in the stored order of
  `shards`), its mask split by query rows into `rows_split` (default `shards`). Built in
  the trace (its metadata arrays are the program's constants); the costly part, the mask's
  block metadata in numpy, jax caches by mask."""
  splash, masks = _splash_lib()
  mask = _ordered_causal(seq, shards, order) if causal else masks.FullMask((seq, seq))
  make = splash.make_splash_mqa if kv_heads == 1 else splash.make_splash_mha
  return make(masks.MultiHeadMask([mask] * heads), block_sizes=_blocks(tile, seq, seq),
              head_shards=1, q_seq_shards=rows_split or shards, interpret=interpret)


def _splash_whole(p: ContextSelection, q_shape, kv_heads: int, mesh, causal: bool):
  """(kernel, its shard_map spec): the mask metadata split by query rows over p.axes."""
  heads = q_shape[2] // math.prod(_sizes(mesh, p.head_axes)) if p.head_axes else q_shape[2]
  kh = kv_heads // math.prod(_sizes(mesh, p.head_axes)) if p.head_axes else kv_heads
  kernel = _whole_kernel(q_shape[1], p.shards, p.order, heads, kh, p.tile, causal,
                         p.interpret)
  target = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  spec = kernel.manual_sharding_spec(jax.NamedSharding(target, jax.P(None, p.axes)))
  return kernel, spec


def _sizes(mesh, axes):
  target = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  return [target.shape[a] for a in axes]


def _splash_gathered(q, k, v, q_ids, kv_ids, p: ContextSelection, scale, kernel):
  """Splash for a shard's queries (stored order) against all keys put in sequence order."""
  k, v = restore(k, p.shards, p.order), restore(v, p.shards, p.order)
  kv_ids = None if kv_ids is None else restore(kv_ids, p.shards, p.order)
  return run_splash(kernel, q, k, v, q_ids, kv_ids, scale)


def run_splash(kernel, q, k, v, q_ids, kv_ids, scale):
  """A splash `kernel` over [batch, seq, heads, head_dim] q, k, v (one k/v head: MQA) with
  segment ids or None. Splash takes [heads, seq, head_dim] per example and no scale: q is
  scaled up front and the batch is a vmap."""
  splash, _ = _splash_lib()
  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if kh.shape[1] == 1:
    kh, vh = kh[:, 0], vh[:, 0]
  if q_ids is None:
    out = jax.vmap(kernel)(qh, kh, vh)
  else:
    out = jax.vmap(lambda q, k, v, a, b: kernel(q, k, v, splash.SegmentIds(a, b)))(
        qh, kh, vh, q_ids, kv_ids)
  return jnp.swapaxes(out, 1, 2).astype(q.dtype)


# ----------------------------------------------------------------------------- the ring


class _Case(NamedTuple):
  """One ring step's work: query rows and key columns ("all", "front" or "back" half of the
  shard) and the mask between them ("causal": row >= column in the shard's own order,
  "strict": row > column, "full", or "skip": nothing to do)."""
  rows: str
  cols: str
  mask: str


def ring_cases(order: str, causal: bool) -> dict[str, _Case]:
  """The block each step computes: "diagonal" (a shard's own K/V), "earlier" (K/V of a
  shard before this one in the stored order) and "later". Within one case the mask is the
  same for every pair of shards (tested against the positions), so a kernel with a static
  mask serves it and masked halves are never computed. Each case names the query rows
  ("all", "front" or "back" half), the key columns and the mask ("full", "causal",
  "strict" or "skip").

  Examples:
    Zigzag: an earlier shard's front chunk is before both of ours, so only its front half is
    attended, unmasked:

    >>> import fnscale as fs
    >>> cases = fs.parallel.context.ring_cases("zigzag", causal=True)
    >>> for name, case in cases.items():
    ...   print(name, tuple(case))
    diagonal ('all', 'all', 'causal')
    earlier ('all', 'front', 'full')
    later ('back', 'all', 'full')
  """
  if not causal:
    full = _Case("all", "all", "full")
    return {"diagonal": full, "earlier": full, "later": full}
  diagonal = _Case("all", "all", "causal")
  if order == "zigzag":  # earlier shard: only its front chunk is before both of ours
    return {"diagonal": diagonal, "earlier": _Case("all", "front", "full"),
            "later": _Case("back", "all", "full")}
  if order == "striped":  # token t*c + i sees t'*c + j: t >= t' for j < i, t > t' for j > i
    return {"diagonal": diagonal, "earlier": _Case("all", "all", "causal"),
            "later": _Case("all", "all", "strict")}
  return {"diagonal": diagonal, "earlier": _Case("all", "all", "full"),
          "later": _Case("all", "all", "skip")}


def _part(x, which: str, axis: int = 1):
  n = x.shape[axis]
  if which == "all":
    return x
  start = 0 if which == "front" else n // 2
  return lax.slice_in_dim(x, start, start + n // 2, axis=axis)


def _place(part, which: str, n: int, axis: int, fill):
  """`part` (a half or all of a shard's rows) in a full-length array, `fill` elsewhere."""
  if which == "all":
    return part
  pad = [(0, 0)] * part.ndim
  pad[axis] = (0, n - part.shape[axis]) if which == "front" else (n - part.shape[axis], 0)
  return jnp.pad(part, pad, constant_values=fill)


def _xla_logits(q, k, q_ids, kv_ids, mask: str, scale):
  """Masked float32 logits [b, kv_heads, group, t, s] of q [b, t, h, d], k [b, s, kh, d]."""
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                      preferred_element_type=jnp.float32) * scale
  keep = jnp.ones((t, s), bool)
  if mask in ("causal", "strict"):
    keep = jnp.tril(keep, 0 if mask == "causal" else -1)
  keep = keep[None, None, None]
  if q_ids is not None:
    keep = keep & (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]
  return jnp.where(keep, logits, _MASKED), keep


def _xla_block(q, k, v, q_ids, kv_ids, mask: str, scale):
  """(out float32 [b, t, h, d], logsumexp float32 [b, h, t]; -inf for rows that see no
  key) of one block."""
  b, t, h, d = q.shape
  logits, keep = _xla_logits(q, k, q_ids, kv_ids, mask, scale)
  top = jnp.max(logits, axis=-1, keepdims=True)
  w = jnp.where(keep, jnp.exp(logits - top), 0.0)
  total = jnp.sum(w, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", w, v.astype(jnp.float32))
  out = out / jnp.maximum(jnp.moveaxis(total, -1, 1), 1e-30)[..., None]
  lse = jnp.where(total > 0, top[..., 0] + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
  return out.reshape(b, t, h, d), lse.reshape(b, h, t)


def _xla_block_grads(q, k, v, q_ids, kv_ids, mask: str, scale, lse, d_out, di):
  """(dq, dk, dv) float32 of one block given the merged logsumexp [b, h, t], the output's
  cotangent d_out [b, t, h, d] and di = rowsum(out * d_out) [b, h, t]."""
  b, t, h, d = q.shape
  kh = k.shape[2]
  logits, keep = _xla_logits(q, k, q_ids, kv_ids, mask, scale)
  lse = lse.reshape(b, kh, h // kh, t)[..., None]
  prob = jnp.where(keep & jnp.isfinite(lse), jnp.exp(logits - jnp.where(
      jnp.isfinite(lse), lse, 0.0)), 0.0)
  do = d_out.astype(jnp.float32).reshape(b, t, kh, h // kh, d)
  dv = jnp.einsum("bkgts,btkgd->bskd", prob, do)
  dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(jnp.float32))
  ds = prob * (dp - di.reshape(b, kh, h // kh, t)[..., None]) * scale
  dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)).reshape(b, t, h, d)
  dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(jnp.float32).reshape(b, t, kh, -1, d))
  return dq, dk, dv


def _block_kernel(mask: str, rows: int, cols: int, heads: int, kv_heads: int, tile: int,
                  interpret: bool):
  """The splash kernel of one ring case's block (built in the trace, as `_whole_kernel`)."""
  splash, masks = _splash_lib()
  shape = (rows, cols)
  m = {"causal": lambda: masks.CausalMask(shape), "strict": lambda: masks.CausalMask(
      shape, offset=-1), "full": lambda: masks.FullMask(shape)}[mask]()
  make = splash.make_splash_mqa if kv_heads == 1 else splash.make_splash_mha
  return make(masks.MultiHeadMask([m] * heads), block_sizes=_blocks(tile, rows, cols),
              head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_operands(q, k, v, q_ids, kv_ids, scale):
  splash, _ = _splash_lib()
  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if kh.shape[1] == 1:
    kh, vh = kh[:, 0], vh[:, 0]
  ids = None if q_ids is None else splash.SegmentIds(q_ids, kv_ids)
  return qh, kh, vh, ids


def _splash_block(q, k, v, q_ids, kv_ids, mask: str, scale, p: ContextSelection):
  kernel = _block_kernel(mask, q.shape[1], k.shape[1], q.shape[2], k.shape[2], p.tile,
                         p.interpret)
  qh, kh, vh, ids = _splash_operands(q, k, v, q_ids, kv_ids, scale)
  out, lse = jax.vmap(lambda q, k, v, i: _compat.splash_block_forward(kernel, q, k, v, i))(
      qh, kh, vh, ids)
  return jnp.swapaxes(out, 1, 2).astype(jnp.float32), lse.astype(jnp.float32)


def _splash_block_grads(q, k, v, q_ids, kv_ids, mask, scale, lse, d_out, out,
                        p: ContextSelection):
  kernel = _block_kernel(mask, q.shape[1], k.shape[1], q.shape[2], k.shape[2], p.tile,
                         p.interpret)
  qh, kh, vh, ids = _splash_operands(q, k, v, q_ids, kv_ids, scale)
  oh, doh = jnp.swapaxes(out, 1, 2).astype(q.dtype), jnp.swapaxes(d_out, 1, 2).astype(q.dtype)
  dq, dk, dv = jax.vmap(lambda *a: _compat.splash_block_backward(kernel, *a))(
      qh, kh, vh, ids, oh, lse, doh)
  if k.shape[2] == 1:
    dk, dv = dk[:, None], dv[:, None]
  f = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)
  return f(dq) * scale, f(dk), f(dv)


def _merge(acc, block):
  """Online softmax: two (out [b, t, h, d], lse [b, h, t]) partial results as one."""
  (o1, l1), (o2, l2) = acc, block
  lse = jnp.logaddexp(l1, l2)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w = lambda l: jnp.moveaxis(jnp.exp(l - safe), 1, 2)[..., None]
  return o1 * w(l1) + o2 * w(l2), lse


class _Ring(NamedTuple):
  """The ring's static facts (a custom_vjp's non-differentiable argument)."""
  sel: ContextSelection
  causal: bool
  scale: float


def _later_steps(ring: _Ring, fn, mine, step):
  """fn(case) for ring step `step` >= 1, which holds the K/V of shard (mine - step) mod c:
  the "earlier" case when that shard precedes this one, else "later"."""
  cases = ring_cases(ring.sel.order, ring.causal)
  theirs = (mine - step) % ring.sel.shards
  return lax.cond(theirs < mine, lambda: fn(cases["earlier"], theirs),
                  lambda: fn(cases["later"], theirs))


def _ids_of(every_id, shard, t: int):
  """Shard `shard`'s kv segment ids from all of them [b, S] (None without segments)."""
  return None if every_id is None else lax.dynamic_slice_in_dim(every_id, shard * t, t, 1)


def _ring_forward(q, k, v, q_ids, kv_ids, ring: _Ring):
  """(out [b, t, h, d] in q's dtype, lse [b, h, t]) of this shard's queries: its own block,
  then c - 1 steps that each receive the previous shard's K/V (a loop: one compiled step,
  one collective-permute per step)."""
  p = ring.sel
  t, mine = q.shape[1], lax.axis_index(p.axes)
  every_id = None if kv_ids is None else lax.all_gather(kv_ids, p.axes, axis=1, tiled=True)
  empty = (jnp.zeros(q.shape, jnp.float32),
           jnp.full((q.shape[0], q.shape[2], t), -jnp.inf, jnp.float32))
  acc = _merge(empty, _case_forward(ring_cases(p.order, ring.causal)["diagonal"], q, k, v,
                                    q_ids, kv_ids, ring))

  def step(i, carry):
    kv, acc = carry
    kv = _pass_on(kv, p)
    block = _later_steps(ring, lambda case, theirs: _case_forward(
        case, q, kv[0], kv[1], q_ids, _ids_of(every_id, theirs, t), ring), mine, i)
    return kv, _merge(acc, block)

  _, (out, lse) = lax.fori_loop(1, p.shards, step, (jnp.stack([k, v]), acc))
  return out.astype(q.dtype), lse


def _pass_on(x, p: ContextSelection):
  """x to the next shard of the ring (shard i's goes to i + 1)."""
  return lax.ppermute(x, p.axes, [(i, (i + 1) % p.shards) for i in range(p.shards)])


def _case_forward(case: _Case, q, k, v, q_ids, kv_ids, ring: _Ring):
  b, t, h, d = q.shape
  if case.mask == "skip":
    return jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32)
  qs, q_i = _part(q, case.rows), None if q_ids is None else _part(q_ids, case.rows)
  ks, vs = _part(k, case.cols), _part(v, case.cols)
  kv_i = None if kv_ids is None else _part(kv_ids, case.cols)
  block = _splash_block if ring.sel.kernel == "splash" else _xla_block
  extra = (ring.sel,) if ring.sel.kernel == "splash" else ()
  out, lse = block(qs, ks, vs, q_i, kv_i, case.mask, ring.scale, *extra)
  return (_place(out, case.rows, t, 1, 0.0), _place(lse, case.rows, t, 2, -jnp.inf))


def _case_grads(case: _Case, q, k, v, q_ids, kv_ids, ring: _Ring, out, lse, d_out, di):
  """(dq [b, t, h, d], dk, dv [b, t, kh, d]) float32 of one case's block."""
  zero = lambda x: jnp.zeros(x.shape, jnp.float32)
  if case.mask == "skip":
    return zero(q), zero(k), zero(v)
  r, c_ = case.rows, case.cols
  rows = lambda x, axis=1: None if x is None else _part(x, r, axis)
  cols = lambda x: None if x is None else _part(x, c_)
  if ring.sel.kernel == "splash":
    dq, dk, dv = _splash_block_grads(rows(q), cols(k), cols(v), rows(q_ids), cols(kv_ids),
                                     case.mask, ring.scale, rows(lse, 2), rows(d_out),
                                     rows(out), ring.sel)
  else:
    dq, dk, dv = _xla_block_grads(rows(q), cols(k), cols(v), rows(q_ids), cols(kv_ids),
                                  case.mask, ring.scale, rows(lse, 2), rows(d_out),
                                  rows(di, 2))
  t = q.shape[1]
  return (_place(dq, r, t, 1, 0.0), _place(dk, c_, t, 1, 0.0), _place(dv, c_, t, 1, 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_attention(q, k, v, q_ids, kv_ids, ring: _Ring):
  return _ring_forward(q, k, v, q_ids, kv_ids, ring)[0]


def _ring_attention_fwd(q, k, v, q_ids, kv_ids, ring: _Ring):
  out, lse = _ring_forward(q, k, v, q_ids, kv_ids, ring)
  return out, (q, k, v, q_ids, kv_ids, out, lse)


def _ring_attention_bwd(ring: _Ring, res, d_out):
  """The ring again: each shard adds its queries' share to the K/V block it holds and
  passes the block on with its dK/dV accumulator; after the last step one more pass brings
  every accumulator home (c - 1 permutes of K/V, c of dK/dV)."""
  q, k, v, q_ids, kv_ids, out, lse = res
  p = ring.sel
  t, mine = q.shape[1], lax.axis_index(p.axes)
  every_id = None if kv_ids is None else lax.all_gather(kv_ids, p.axes, axis=1, tiled=True)
  di = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
  grads = lambda case, k, v, ids: _case_grads(case, q, k, v, q_ids, ids, ring, out, lse,
                                              d_out, di)
  dq, dk, dv = grads(ring_cases(p.order, ring.causal)["diagonal"], k, v, kv_ids)

  def step(i, carry):
    kv, dkv, dq = carry
    kv, dkv = _pass_on(kv, p), _pass_on(dkv, p)
    g = _later_steps(ring, lambda case, theirs: grads(
        case, kv[0], kv[1], _ids_of(every_id, theirs, t)), mine, i)
    return kv, dkv + jnp.stack(g[1:]), dq + g[0]

  _, dkv, dq = lax.fori_loop(1, p.shards, step, (jnp.stack([k, v]), jnp.stack([dk, dv]), dq))
  dkv = _pass_on(dkv, p)
  return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _ring(q, k, v, q_ids, kv_ids, p: ContextSelection, causal, scale, kernel):
  del kernel  # The ring builds one kernel per case (`_block_kernel`).
  return _ring_attention(q, k, v, q_ids, kv_ids, _Ring(p, causal, scale))


# ----------------------------------------------------------------------------- balance


def shard_work(seq: int, shards: int, order: str, segment_ids=None) -> np.ndarray:
  """Unmasked query-key pairs of causal attention each shard computes, int64 [shards]:
  per stored token, the tokens at or before its place (of its segment, when `segment_ids`
  [seq] in sequence order is given). Load balance is max / mean.

  Examples:
    >>> import fnscale as fs
    >>> fs.parallel.context.shard_work(8, 2, "striped").tolist()
    [16, 20]
    >>> fs.parallel.context.shard_work(8, 2, "contiguous", segment_ids=[0] * 4 + [1] * 4).tolist()
    [10, 10]
  """
  place = positions(seq, shards, order)
  if segment_ids is None:
    return (place + 1).sum(axis=1, dtype=np.int64)
  ids = np.asarray(segment_ids)
  start = np.array([np.argmax(ids == ids[i]) for i in range(seq)])  # segment's first token
  return (place - start[place] + 1).sum(axis=1, dtype=np.int64)
