"""The gradients of a batch: one call of the loss, or a microbatch loop (`lax.scan`) run by
XLA's partitioner or per shard under `jax.shard_map`, and the reductions that bring the
gradients to the params' sharding. Part of the train step (`fnscale._step` says the reading
order).

Accumulation over a mesh (`accum_gather`, with `accum_steps > 1` and data axes). The
gradients end in the params' sharding in every mode. Measure the modes with
`fnscale.compile_report(...).collectives` and `.temp_bytes`; `fnscale.analysis.plan` chooses.

- "per_microbatch" (ZeRO-3): params stay sharded and are gathered inside each microbatch, as
  without accumulation (accum x the all-gather traffic); each microbatch's gradient is
  reduced into a float32 accumulator sharded as the params are (accum x the reduce-scatter
  traffic). Per-device memory as at accum 1 plus the sharded accumulator. The loop stays
  with XLA's partitioner, which carries its accumulator in one sharding, never as a partial
  sum, so it reduces every microbatch's gradient before adding it. Gradients all-reduced
  over a data axis (leaves replicated over it: norm scales, biases, an FSDP leaf's shard
  over "data" beside "fsdp") are divided by the weight after the loop (`_divided_inside`),
  so that each all-reduce is only added to its carried sum: on TPU, XLA's while-loop
  all-reduce code motion then moves it after the loop, once a step (4x fewer bytes over
  "data" at accum 4, data=2 x fsdp=4, tests/test_accumulation.py); CPU's compiler keeps it
  in every microbatch (and on Explicit axes moves the params' gathers out of the loop,
  holding them whole: measure on the target).
- "once": for models whose whole params fit on a device. The microbatch loop runs per shard
  under `jax.shard_map` over the data axes; params, cast to the compute dtype, are
  all-gathered once at its entry and stay whole for the loop; every device sums its own
  float32 gradients in a whole-size accumulator, reduce-scattered once after the loop
  (all-reduced over data axes the params are replicated on). Traffic as at accum 1; memory:
  whole compute-dtype params and a whole float32 accumulator per device. The reduce-scatter
  needs the params' shardings: `shard_step` tells the step them, Explicit mesh axes carry
  them in the types. Under a plain `jax.jit` on Auto axes the step cannot know them (Auto
  types carry no sharding), so the whole float32 gradients are all-reduced over the data
  axes (2 (n-1)/n of their bytes sent per device, twice the reduce-scatter's) and then
  sliced to the params' sharding. A loss that closes over an array sharded on Explicit axes
  (which jax can't take into the per-shard loop's shard_map) raises StepError naming it.
- "auto" (the default): "once" where no param is split over a data axis (data parallel:
  the same memory as "per_microbatch", the gradients reduced once), or where whole
  compute-dtype params and a whole float32 accumulator take at most `ONCE_SHARE` (1%) of
  the device's memory (`fnscale.analysis.device_memory`, the memory pre-flight's figure);
  otherwise, and where the device's memory is unknown (CPU), "per_microbatch". The choice
  is said at INFO with its numbers. Under a plain `jax.jit` on Auto axes (param shardings
  unknown) "once". With a `key`, with `frozen` params, and when the loss closes over an
  array sharded on Explicit axes or shards its ops by type (`out_sharding=`,
  `jax.sharding.reshard`, `auto_axes`: jax refuses them where the data axes are Manual; a
  warning says so): "per_microbatch".
"""
from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import jmp
import numpy as np
import optax

from fnscale import _axes
from fnscale import _closure
from fnscale import _compat
from fnscale import _topology
from fnscale import _tree
from fnscale._errors import StepError
from fnscale._loss import (_Config, _for_compute, _known_specs, _loss_key, _ManualTyped,
                           _manual_data_axes, _scaled_loss)
from fnscale._update import _is_float


def _vary(tree, axes: tuple[str, ...]):
  """Marks leaves as varying over `axes` (shard_map's type system) where they are not yet."""
  if not axes:
    return tree

  def f(x):
    varying = _compat.varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(f, tree)


class Same(NamedTuple):
  """An aux value every microbatch and shard computes alike (a model state's count, flag or
  seed): reduced by keeping one (the first microbatch's, the largest over shards), exact,
  where other non-float aux leaves are summed."""
  value: Any


class StatefulAux(NamedTuple):
  """The aux of a loss over a model with state (`fnscale._model_state`): the loss's own and
  the new model state."""
  aux: Any
  model_state: Any


def _check_rowwise(aux, batch, combined: str, aux_of: Callable) -> None:
  """StepError for an aux leaf with a value per row of `batch`, which `combined`
  (accumulation's loop, the data shards' mean) can only average elementwise across unrelated
  rows: a silent wrong value and shape. A leaf is per row where its leading dim is the
  batch's rows and follows them: `aux_of(batch)` (the loss's aux, traced) on twice the rows
  has it twice as long (a BatchNorm's statistics over as many channels as rows don't)."""
  rows = jax.tree.leaves(batch)[0].shape[0]
  same = lambda x: np.ndim(x) and np.shape(x)[0] == rows
  if not any(same(x) for x in jax.tree.leaves(aux)):
    return
  doubled = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2 * rows,) + x.shape[1:], x.dtype),
                         batch)
  parts = aux._asdict() if isinstance(aux, StatefulAux) else {"aux": aux}
  named = [(what, path, x) for what, part in parts.items()
           for path, x in _tree.leaves_with_paths(part)]
  try:
    again = jax.tree.leaves(jax.eval_shape(aux_of, doubled))
  except Exception:  # pylint: disable=broad-except  # untraceable at twice the rows: per row
    again = [None] * len(named)
  for (what, path, x), y in zip(named, again):
    if same(x) and (y is None or np.shape(y)[0] == 2 * rows):
      raise StepError(
          f"{what} leaf '{path}' has shape {tuple(np.shape(x))}, a value per row of the {rows} "
          f"rows the loss sees at a time, and {combined} can only average it elementwise, "
          "not put the rows back; fix: return it reduced to a scalar (jnp.mean, jnp.sum), "
          "or compute it outside the train step (a forward pass of its own).")


def _reduce_aux(aux, axis_name=None, axis=None):
  """Floating leaves averaged, others (counts) summed, `Same` ones kept, over mesh axes or
  an array axis."""
  def f(x):
    if isinstance(x, Same):
      return Same(_keep_one(x.value, axis_name, axis))
    if axis_name is not None:
      x = _vary(x, axis_name)
      return jax.lax.pmean(x, axis_name) if _is_float(x) else jax.lax.psum(x, axis_name)
    return jnp.mean(x, axis=axis) if _is_float(x) else jnp.sum(x, axis=axis)
  return jax.tree.map(f, aux, is_leaf=lambda x: isinstance(x, Same))


def _keep_one(x, axis_name, axis):
  """`x` alike on every shard (the largest, made invariant) or microbatch (the first)."""
  if axis_name is None:
    return jnp.take(x, 0, axis=axis)
  flag = x.dtype == jnp.bool_
  x = jax.lax.pmax(_vary(x.astype(jnp.int32) if flag else x, axis_name), axis_name)
  return x.astype(jnp.bool_) if flag else x


def _leading_dims(batch) -> list[tuple[str, int | None]]:
  out = []
  for p, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(leaf)
    out.append((_tree.path_str(p), shape[0] if shape else None))
  return out


def _check_accum(batch, accum_steps: int) -> int:
  """Checks that every batch leaf has the same leading dim, divisible by accum_steps."""
  dims = _leading_dims(batch)
  if not dims:
    raise StepError("the batch has no array leaves; fix: pass a pytree of arrays.")
  for path, n in dims:
    if n is None:
      raise StepError(
          f"batch leaf '{path}' is a scalar; with accum_steps={accum_steps} every batch leaf "
          "needs a leading batch dimension; fix: give it one or close over it in loss_fn.")
  path0, n0 = dims[0]
  for path, n in dims:
    if n != n0:
      raise StepError(
          f"batch leaf '{path}' has leading dim {n} but '{path0}' has {n0}; with accum_steps="
          f"{accum_steps} every leaf is split along its leading (batch) dim; fix: give all "
          "batch leaves the same batch size.")
    if n % accum_steps:
      raise StepError(
          f"accum_steps={accum_steps} does not divide the batch: leaf '{path}' has leading dim "
          f"{n}; fix: use a batch size that is a multiple of {accum_steps} or another "
          "accum_steps.")
  return n0


def _global_data_axes() -> tuple[str, ...]:
  """Data axes of the ambient mesh (size > 1) that the trace sees whole: Auto or Explicit,
  not manual (inside `jax.shard_map`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in _axes.data_axes(mesh) if a not in manual and mesh.shape[a] > 1)


def _microbatches(batch, accum_steps: int, n: int, axes: tuple[str, ...],
                  own_rows: bool = False):
  """[B, ...] leaves -> [accum_steps, B // accum_steps, ...]; microbatch i holds rows i,
  i + accum_steps, ... so that each keeps a share of every device's rows (no resharding).
  Rows are split over the data axes `axes`; with `own_rows`, on Explicit axes, over the
  data axes the leaf's rows are split over already (a `batch_sharding` that a model's
  `out_sharding` asks for), where it has any."""
  micro = n // accum_steps
  mesh = jax.sharding.get_abstract_mesh()
  ways = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if micro % ways:
    raise StepError(
        f"microbatch size {micro} (batch {n} / accum_steps {accum_steps}) is not divisible "
        f"by the data axes {axes} ({ways} ways); each microbatch is spread over every device; "
        f"fix: use a batch size that is a multiple of {accum_steps * ways}.")

  explicit = not mesh.empty and not mesh.auto_axes  # shardings are part of the types
  # A sequence split over context axes stays split (rows [B, seq, ...]).
  context = () if mesh.empty else tuple(
      a for a in _axes.context_axes(mesh)
      if mesh.shape[a] > 1 and a not in set(getattr(mesh, "manual_axes", ())))

  def split(x):
    x = jnp.swapaxes(x.reshape((micro, accum_steps) + x.shape[1:]), 0, 1)
    rows = _row_axes(x, axes) if own_rows and explicit else axes
    if rows:
      seq = (_tree.spec_entry(context),) if context and x.ndim >= 3 else ()
      spec = PartitionSpec(None, _tree.spec_entry(rows), *seq)
      x = jax.sharding.reshard(x, spec) if explicit else jax.lax.with_sharding_constraint(x, spec)
    return x
  return jax.tree.map(split, batch)


def _row_axes(x, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of `axes` that the rows of `x` ([accum, rows, ...]) are split over in its type,
  or `axes` where none are."""
  spec = getattr(jax.typeof(x), "sharding", None)
  spec = spec.spec if spec is not None else PartitionSpec()
  own = tuple(a for a in _tree.entry_axes(spec[1] if len(spec) > 1 else None) if a in axes)
  return own or axes


def _grad_sum(cfg: _Config, params, micro, scale, step, reduce: bool = True, frozen=None):
  """Gradients, loss and weight of the batch, or of the microbatches `micro` ([accum,
  rows, ...], a `lax.scan`), and aux; reduced once over the manual data axes (if any). With
  `reduce`, the gradients and loss are divided by the summed weight (means, `_normalize`);
  without, they are this shard's sums, for the caller to reduce and divide. A scalar loss
  weighs 1 per call. The float32 accumulator keeps the params' sharding. `frozen` params
  reach the loss undifferentiated."""
  axes = _manual_data_axes()
  params = _vary(params, axes)  # per-shard gradients are local (varying) until reduced
  ls = None if scale is None else jmp.StaticLossScale(scale)
  grad_fn = jax.grad(functools.partial(_scaled_loss, cfg), has_aux=True)
  aux_of = lambda i: lambda b: _scaled_loss(cfg, params, b, ls, _loss_key(cfg, step, i, axes),
                                            frozen)[1][2]  # microbatch i's aux, for a batch b
  floor = None if cfg.ratio is None else cfg.ratio.floor
  if cfg.accum_steps == 1:
    grads, (loss, weight, aux) = grad_fn(params, micro, ls, _loss_key(cfg, step, 0, axes),
                                         frozen)
    if axes and cfg.has_aux:
      _check_rowwise(aux, micro, f"the mean over the data shards ({', '.join(axes)})",
                     aux_of(0))
    out = _reduce(cfg, optax.tree.cast(grads, jnp.float32), loss, weight, aux, axes, reduce)
    return _normalize(*out, floor) if reduce else out
  n = jax.tree.leaves(micro)[0].shape[0]
  # Where the loop's sums are whole (no manual axes), its last microbatch divides them by
  # the weight in the same pass as its add: divided after the loop, every gradient was held
  # twice where the step measures its change (1.67x accum 1's temporaries against 1.25x,
  # CPU fsdp=8, tests/test_accumulation.py). Not those all-reduced over a data axis
  # (`_divided_inside`).
  last_divides = reduce and not axes
  inside = _divided_inside(params) if last_divides else None

  def body(carry, mb_i):
    gsum, lsum, wsum = carry
    mb, i = mb_i
    g, (l, w, a) = grad_fn(params, mb, ls, _loss_key(cfg, step, i, axes), frozen)
    if cfg.has_aux:
      _check_rowwise(a, mb, f"accumulation over {n} microbatches", aux_of(i))
    lsum, wsum = lsum + l, wsum + w
    gsum = optax.tree.add(gsum, optax.tree.cast(g, jnp.float32))
    if last_divides:  # by 1 (exact) before the last microbatch
      d = jnp.where(i == n - 1, _divisor(wsum, floor), 1.0)
      gsum = jax.tree.map(lambda x, div: x / d if div else x, gsum, inside)
    return (_like_params(gsum, params), lsum, wsum), a

  zero = _vary(jnp.zeros((), jnp.float32), axes)
  init = (_like_params(_vary(optax.tree.zeros_like(params, jnp.float32), axes), params),
          zero, zero)
  (gsum, lsum, wsum), auxs = jax.lax.scan(body, init, (micro, jnp.arange(n)))
  aux = _reduce_aux(auxs, axis=0) if cfg.has_aux else None
  if last_divides:
    d = _divisor(wsum, floor)
    gsum = jax.tree.map(lambda x, div: x if div else x / d, gsum, inside)
    return gsum, lsum / d, wsum, aux
  out = _reduce(cfg, gsum, lsum, wsum, aux, axes, reduce)
  return _normalize(*out, floor) if reduce else out


def _divided_inside(params):
  """Per leaf of `params`, whether the partitioner's loop divides its gradient sum by the
  weight inside (in its last microbatch, `_grad_sum`) rather than after the loop: a leaf
  split over every data axis, or all where no data axis splits the batch or the params'
  shardings are unknown. A leaf replicated over a data axis (a norm's scale, a bias; an FSDP
  leaf's shard over "data" beside "fsdp") is divided after the loop: its gradient,
  all-reduced over that axis in each microbatch, is then only added to the carried sum,
  which lets XLA's TPU compiler (while-loop all-reduce code motion) move the all-reduce
  after the loop, one for the step; divided inside, it stays in every microbatch."""
  axes, specs = set(_global_data_axes()), _known_specs(params)
  if not axes or specs is None:
    return jax.tree.map(lambda _: True, params)
  split = [axes <= {a for e in s for a in _tree.entry_axes(e)} for s in specs]
  return jax.tree.unflatten(jax.tree.structure(params), split)


def _reduce(cfg: _Config, grads, loss, weight, aux, axes, reduce_grads: bool = True):
  """The one gradient reduction of the step (after every microbatch), over manual axes:
  sums of gradients, losses and weights (divided once, by `_normalize`)."""
  if axes:
    if reduce_grads:
      grads = jax.lax.psum(_vary(grads, axes), axes)
    loss, weight = jax.lax.psum(_vary((loss, weight), axes), axes)
    aux = _reduce_aux(aux, axis_name=axes) if cfg.has_aux else None
  return grads, loss, weight, aux


def _divisor(weight, floor=None):
  """The summed weight a sum is divided by: 1 for a weight of 0 (every token masked: zero
  gradients and loss, not nan); max(weight, floor) for a loss that clips its count so
  (`_ratio.Ratio.floor`)."""
  return jnp.where(weight == 0, 1.0, weight) if floor is None else jnp.maximum(weight, floor)


def _normalize(grads, loss, weight, aux, floor=None):
  """(grads, loss, weight, aux) with the summed gradients and loss divided once by the
  summed weight (`_divisor`)."""
  w = _divisor(weight, floor)
  return jax.tree.map(lambda g: g / w, grads), loss / w, weight, aux


def _like_params(tree, params):
  """`tree` (shaped like the params) sharded as the params are, where that is known
  (`_known_specs`); manual axes are left out."""
  specs = _known_specs(params)
  if specs is None:
    return tree
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  leaves, treedef = jax.tree.flatten(tree)
  if not jax.sharding.get_abstract_mesh().auto_axes:
    pin = jax.sharding.reshard
  else:
    pin = jax.lax.with_sharding_constraint
  return jax.tree.unflatten(treedef, [pin(x, _tree.filter_spec(s, lambda a: a not in manual))
                                      for x, s in zip(leaves, specs)])


def _scatter(g, spec: PartitionSpec, axes: tuple[str, ...]):
  """Inside a shard_map manual over `axes`: the sum over `axes` of a local gradient, each
  device keeping the block `spec` gives it (a reduce-scatter over the axes that split the
  param, an all-reduce over the others)."""
  used = []
  for dim, entry in enumerate(spec):
    split = tuple(a for a in _tree.entry_axes(entry) if a in axes)
    if split:
      g = jax.lax.psum_scatter(g, split, scatter_dimension=dim, tiled=True)
      used += split
  rest = tuple(a for a in axes if a not in used)
  return jax.lax.psum(g, rest) if rest else g


def _per_shard(cfg: _Config, params, micro, scale, step, axes, specs, frozen=None):
  """The microbatch loop per shard under `jax.shard_map`, manual over the data axes `axes`
  (other axes stay with the partitioner). Params, cast to the compute dtype first, enter
  whole (all-gathered once at entry where `specs`, the params' PartitionSpecs, split them
  over `axes`); every device sums its own microbatches' float32 gradients in a whole-size
  accumulator, reduced once after the loop: reduce-scattered to `specs` (all-reduced over
  axes they replicate). check_vma=False: a Pallas kernel inside (splash attention) has no
  varying-axes type; the gradients are taken inside the body, so no reduction is implied.
  `frozen` params enter whole too.
  """
  if cfg.policy is not None:
    params, frozen = cfg.policy.cast_to_compute((params, frozen))
  # On Explicit axes the types must be whole over `axes`.
  params, frozen = _for_compute(params), _for_compute(frozen)
  treedef = jax.tree.structure(params)
  mspec = jax.tree.map(lambda _: PartitionSpec(None, _tree.spec_entry(axes)), micro)
  gspec = jax.tree.unflatten(treedef, [_tree.filter_spec(s, lambda a: a in axes) for s in specs])

  def local(params, micro, scale, step, frozen):
    grads, loss, weight, aux = _grad_sum(cfg, params, micro, scale, step, False, frozen)
    leaves = [_scatter(g, s, axes) for g, s in zip(jax.tree.leaves(grads), specs)]
    return jax.tree.unflatten(treedef, leaves), loss, weight, aux

  rep = PartitionSpec()
  f = jax.shard_map(local, in_specs=(rep, mspec, rep, rep, rep),
                    out_specs=(gspec, rep, rep, rep), axis_names=set(axes), check_vma=False)
  return f(params, micro, scale, step, frozen)


# accum_gather="auto" runs "once" (whole params on every device) only where a device's whole
# compute-dtype params and whole float32 accumulator take at most this share of its memory
# (`fnscale._topology.device_memory`, the memory pre-flight's figure). Above it, or where the
# device's memory is unknown (CPU), a model with params split over a data axis keeps them
# split ("per_microbatch", FSDP's memory, as MaxText's accumulation always does). At 10%,
# Llama-3-8B's widths x 2 layers on v5p-8, fsdp=4 (8.3 GiB whole, 8.8% of its 94.7 GiB) ran
# "once": 12.13 GiB of temporaries at accum 4 against MaxText's 5.11 GiB
# (recipes/bench/README.md, "Against MaxText").
ONCE_SHARE = 0.01


def _whole_bytes(params, specs, axes, policy) -> int:
  """Bytes per device of the params whole over the data axes `axes`, in the compute dtype,
  and of a float32 accumulator as whole: each leaf divided by the other axes that split it."""
  mesh = jax.sharding.get_abstract_mesh()
  total = 0
  for p, s in zip(jax.tree.leaves(params), specs):
    others = math.prod(mesh.shape[a] for e in s for a in _tree.entry_axes(e) if a not in axes)
    dtype = policy.compute_dtype if policy is not None and _is_float(p) else p.dtype
    total += math.prod(p.shape) * (jnp.dtype(dtype).itemsize + 4) // others
  return total


def _auto_mode(cfg: _Config, params, specs, axes) -> str:
  """"per_shard" or "per_microbatch" for accum_gather="auto" by memory (`ONCE_SHARE`),
  said at INFO: "per_shard" where no leaf is split over a data axis (data parallel, where
  it reduces once at the same memory)."""
  if not any(a in axes for s in specs for e in s for a in _tree.entry_axes(e)):
    return "per_shard"
  mesh = _compat.concrete_mesh()
  memory = None if mesh.empty else _topology.device_memory(mesh.devices.flat[0])
  whole = _whole_bytes(params, specs, axes, cfg.policy)
  once = memory is not None and whole <= ONCE_SHARE * memory
  logging.info(
      "train_step: accum_gather='auto' runs %s: whole compute-dtype params and a whole "
      "float32 accumulator would take %.3g GiB per device, %s",
      "'once'" if once else "'per_microbatch' (params and accumulator stay split)",
      whole / 2**30, "the device's memory unknown (CPU): 'once' only when asked" if memory is None
      else f"{'within' if once else 'over'} {100 * ONCE_SHARE:g}% of its {memory / 2**30:.3g} GiB")
  return "per_shard" if once else "per_microbatch"


def _mode(cfg: _Config, params, specs, axes, frozen=None) -> str:
  """Where the microbatch loop runs: "per_shard" (`_per_shard`: each device sums its own
  microbatches' gradients, reduced once after the loop) or "per_microbatch" (the
  partitioner's loop). "auto" runs per shard unless a `key` is given (whose random bits
  then don't depend on the mesh) or the state has `frozen` params (the per-shard loop would
  hold a frozen base, usually the bulk of the model, whole on every device, and the
  trained params whose reductions it saves are small); `_gradients` also falls back to the
  partitioner's loop where the loss can't run per shard. Why the partitioner's loop reduces
  every microbatch: the loop carries the accumulator in one sharding (split or replicated,
  never a partial sum), so each microbatch's gradient, a sum over every device's rows, is
  reduced before it is added (all-reduced over the axes that replicate the leaf,
  reduce-scattered where the accumulator is split); no sharding of the accumulator avoids
  it. Otherwise "auto" chooses by memory where the params' shardings `specs` are known
  (`_auto_mode`), and runs per shard where they aren't (a plain jit on Auto axes)."""
  if cfg.accum_gather != "auto":
    return "per_shard" if cfg.accum_gather == "once" else "per_microbatch"
  if cfg.key is not None or frozen is not None:
    return "per_microbatch"
  return "per_shard" if specs is None else _auto_mode(cfg, params, specs, axes)


def _gradients(cfg: _Config, params, batch, ls, step, frozen=None):
  """float32 gradients (still loss-scaled) and loss of the whole batch, each summed over
  microbatches and the data axes and divided once by the summed weight (see `train_step`'s
  accum_gather), the weight, and aux. `frozen`: the state's frozen params, for the loss."""
  scale = None if ls is None else ls.loss_scale
  if cfg.accum_steps == 1:
    return _grad_sum(cfg, params, batch, scale, step, frozen=frozen)
  n = _check_accum(batch, cfg.accum_steps)
  axes = _global_data_axes()
  if not axes:
    return _grad_sum(cfg, params, _microbatches(batch, cfg.accum_steps, n, axes), scale,
                     step, frozen=frozen)
  known = _known_specs(params)

  def partitioned():  # the partitioner's loop
    micro = _microbatches(batch, cfg.accum_steps, n, axes, own_rows=True)
    return _grad_sum(cfg, params, micro, scale, step, frozen=frozen)
  if _mode(cfg, params, known, axes, frozen) == "per_microbatch":
    # (Not per shard over only the data axes the params are whole on, which would reduce
    # those once: XLA's partitioner aborts on a table lookup inside such a partly manual
    # loop. The per-shard loop is manual over every data axis.)
    return partitioned()
  # Unknown under a plain jit on Auto axes (Auto types carry no sharding, and the trace
  # never sees its arguments'): P() for every leaf, i.e. the gradients all-reduced whole.
  specs = known or [PartitionSpec()] * len(jax.tree.leaves(params))
  micro = _microbatches(batch, cfg.accum_steps, n, axes)
  floor = None if cfg.ratio is None else cfg.ratio.floor
  per_shard = lambda: _normalize(*_per_shard(cfg, params, micro, scale, step, axes, specs,
                                             frozen), floor)
  return _per_shard_or_partitioned(cfg, per_shard, partitioned)


def _per_shard_or_partitioned(cfg: _Config, per_shard: Callable, partitioned: Callable):
  """`per_shard()`, or where jax can't trace the loss per shard and `accum_gather` is
  "auto", `partitioned()` (the same gradients, said at WARNING): a loss sharding its ops by
  type or constraining them over a data axis (Manual per shard), one closing over an array
  on Explicit axes, a value built once and cached inside the loop, an op without a rule for
  Manual axes. A bug of the loss's own fails in the partitioner's loop too. With "once",
  an fnscale error names the option that works where one is known."""
  try:
    return per_shard()
  except _ManualTyped as e:
    if cfg.accum_gather == "once":
      raise StepError(f"accum_gather='once' runs the loss per shard under jax.shard_map: "
                      f"{str(e).split('; fix:')[0]}; fix: train_step(..., accum_gather="
                      "'per_microbatch') or 'auto'.") from None
    why = ("the loss shards its ops by type or constrains them over a data axis, which jax "
           "refuses per shard")
  except StepError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    closed = (_closure.explicit_closure(e, cfg.loss_fn, "the loss")
              if isinstance(e, (NotImplementedError, ValueError)) else None)
    if closed is not None and cfg.accum_gather == "once":
      raise StepError(closed.message(
          "accum_gather='once' runs the loss per shard under jax.shard_map",
          _closure.FIX + ", or accum_gather='auto' / 'per_microbatch'")) from None
    if cfg.accum_gather == "once":
      raise
    why = closed.describe() if closed is not None else (
        f"the loss failed to trace per shard inside jax.shard_map ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''})")
  logging.warning("train_step: %s; the microbatch loop stays with the partitioner "
                  "(accum_gather='per_microbatch'), which reduces every leaf's gradients in "
                  "every microbatch", why)
  return partitioned()
