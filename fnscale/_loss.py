"""The user's loss as the step calls it: params and batch cast to the compute dtype, tables
gathered over data axes, the key folded, the loss read as (sum, count) where its mean over
microbatches or shards would differ from the whole batch's, and the errors that name what
to change. Part of the train step (`fnscale._step` says the reading order).

Random keys. With `key`, the loss is called as `loss_fn(params, batch, key)`, the key folded
(`jax.random.fold_in`) by the state's step, the microbatch index (0 without accumulation) and,
when the microbatch loop runs per shard (under `shard_step(mode="shard_map")`, or with
`accum_gather="once"`), the shard's position over the data axes: distinct for each, and
reproducible. Otherwise the loss sees the whole global batch and one key per microbatch, so
its random bits (jax's partitionable threefry) are the same under any mesh. "auto" keeps the
loop with the partitioner when a key is given, for that reason.
"""
from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import jmp
import numpy as np

from fnscale import _axes
from fnscale import _compat
from fnscale import _context
from fnscale import _lookups
from fnscale import _ratio
from fnscale import _tree
from fnscale._errors import StepError


def _manual_data_axes() -> tuple[str, ...]:
  """Data axes that the current trace runs per shard over (inside `jax.shard_map`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in _axes.data_axes(mesh) if a in manual)


class _Config(NamedTuple):
  """What `train_step` was built with (checked), closed over by the step."""
  loss_fn: Callable
  optimizer: Any
  policy: jmp.Policy | None
  accum_steps: int
  has_aux: bool
  accum_gather: str = "auto"
  weighted: bool = False
  key: Any = None  # the base PRNG key of `loss_fn(params, batch, key)`, or None
  ratio: Any = None  # a scalar loss read as (sum, count): `_ratio.Ratio` (see `_find_ratio`)
  update_norm: bool | None = None  # see train_step


def _call_loss(cfg: _Config, params, batch, key, frozen):
  """`loss_fn`'s output for params and batch cast to the compute dtype."""
  if cfg.policy is not None:
    params, frozen = cfg.policy.cast_to_compute((params, frozen))
    batch = cfg.policy.cast_to_compute(batch)
  rest = (key,) if cfg.key is not None else ()
  kwargs = {} if frozen is None else {"frozen": _for_compute(frozen)}
  try:
    params = _tables_gathered(cfg, _for_compute(params), (batch,) + rest, kwargs)
    return cfg.loss_fn(params, batch, *rest, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    refusal = _compat.typed_refusal(e)
    error = None if refusal is None else _typed_error(refusal)
    if error is None:
      raise
    raise error from None


class _ManualTyped(StepError):
  """The loss shards its ops by type over an axis that is Manual where it runs (inside a
  `jax.shard_map`): `_gradients` runs it with the partitioner's loop instead."""


def _typed_error(r: _compat.TypedRefusal) -> StepError | None:
  """The StepError for jax's refusal `r` of a loss's sharding in types (`out_sharding=`,
  `jax.sharding.reshard`), naming the mesh or option that works; None where fnscale can't
  say (an axis missing from an Auto mesh: no sharding in types involved)."""
  mesh = jax.sharding.get_abstract_mesh()
  shape = dict(mesh.shape)
  daxes = _axes.data_axes(mesh) if not mesh.empty else ()
  jaxsays = f"(jax: {r.text})"
  if r.kind == "manual" and (r.axis is None or r.axis in daxes):
    return _ManualTyped(
        f"the loss shards its ops by type (out_sharding= or jax.sharding.reshard over mesh "
        f"axis {r.axis or 'of the data axes'!r}) and runs per shard inside jax.shard_map, "
        f"where the data axes {daxes} are Manual, which jax refuses {jaxsays}; fix: "
        "shard_step(..., mode='auto') and train_step(..., accum_gather='per_microbatch'), "
        "which run the loss on the whole global batch")
  if r.kind == "constraint" and set(daxes) & set(getattr(mesh, "manual_axes", ())):
    return _ManualTyped(
        f"a sharding constraint in the loss (jax.lax.with_sharding_constraint, a Flax box or "
        f"nn.with_logical_constraint) names a data axis of {daxes}, and the loss runs per "
        f"shard inside jax.shard_map, where those axes are Manual {jaxsays}; fix: "
        "shard_step(..., mode='auto') and train_step(..., accum_gather='per_microbatch'), "
        "which run the loss on the whole global batch")
  if r.kind == "auto":
    return StepError(
        f"the loss shards its ops by type (out_sharding= or jax.sharding.reshard over mesh "
        f"axis {r.axis!r}), which jax allows only on Explicit mesh axes, and mesh {shape} "
        f"has Auto axes {jaxsays}; fix: fs.make_mesh({shape}, axis_types='explicit')")
  if r.kind in ("manual", "constraint") or mesh.empty or not getattr(
      mesh, "explicit_axes", ()):
    return None  # a shard_map of the loss's own, or an Auto mesh
  others = {a: n for a, n in shape.items() if a not in daxes}
  if r.kind == "missing":
    return StepError(
        f"the loss shards its ops by type over mesh axis {r.axis!r}, which mesh {shape} "
        f"doesn't have {jaxsays}; fix: a mesh with the model's axes, e.g. "
        f"fs.make_mesh({ {r.axis: -1, **others} }, axis_types='explicit'), or out_sharding= "
        "naming this mesh's axes")
  return StepError(
      f"the loss's ops, sharded by type, disagree with the batch, whose rows fnscale splits "
      f"over the mesh's data axes {daxes} of mesh {shape} {jaxsays}; fix: a mesh whose data "
      f"axes are the ones the model's out_sharding= splits the batch over (e.g. "
      f"fs.make_mesh({ {'data': -1, **others} }, axis_types='explicit') for a model that "
      "names 'data'), or shard_step(..., batch_sharding=jax.NamedSharding(mesh, P(<those "
      "axes>)))")


def _loss_aux(cfg: _Config, out):
  if cfg.has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise StepError(f"loss_fn returned {_tree.got(out)}; with has_aux=True it must "
                      "return (loss, aux).")
    return out
  if isinstance(out, (tuple, list)) and not cfg.weighted:
    raise StepError(
        f"loss_fn returned a {type(out).__name__} of {len(out)}, expected a scalar loss; fix: "
        "train_step(..., has_aux=True) for (loss, aux), or weighted=True for (sum, weight).")
  return out, None


def _scaled_loss(cfg: _Config, params, batch, loss_scale, key=None, frozen=None):
  """What is differentiated: the loss (a mean; with `weighted` or a `ratio`, the sum) in
  float32, scaled when a loss scale is used; and (loss or sum, weight, aux) with weight 1
  for a mean. `frozen`: the state's frozen params (None: the loss takes no `frozen`
  keyword)."""
  if cfg.ratio is None:
    loss, aux = _loss_aux(cfg, _call_loss(cfg, params, batch, key, frozen))
    loss, weight = _split_weighted(cfg, loss)
  else:
    out, loss, weight = _split_ratio(cfg, params, batch, key, frozen)
    aux = _loss_aux(cfg, out)[1]
    weight = jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
  if cfg.policy is not None:
    loss = cfg.policy.cast_to_output(loss)
  loss = jnp.asarray(loss).astype(jnp.float32)
  scaled = loss_scale.scale(loss) if loss_scale is not None else loss
  return scaled, (loss, weight, aux)


def _ratio_args(cfg: _Config, params, batch, key, frozen):
  """The loss's arguments and each flat leaf's dependence for `_ratio` (params: P; batch and
  key: B; frozen params, the same in every part of the batch: none)."""
  n = [len(jax.tree.leaves(x)) for x in (params, batch, key, frozen)]
  ins = [_ratio.P] * n[0] + [_ratio.B] * (n[1] + n[2]) + [0] * n[3]
  return functools.partial(_call_loss, cfg), (params, batch, key, frozen), ins


def _split_ratio(cfg: _Config, params, batch, key, frozen):
  fn, args, ins = _ratio_args(cfg, params, batch, key, frozen)
  try:
    return _ratio.split(fn, args, ins, cfg.ratio)
  except _ratio.Unsplittable as e:
    raise StepError(f"{e}; fix: {_RATIO_FIX}.") from None


_RATIO_FIX = (
    "return (sum, weight) from loss_fn and pass train_step(..., weighted=True), e.g. "
    "(jnp.sum(nll * mask), jnp.sum(mask)) for jnp.sum(nll * mask) / jnp.sum(mask): the step "
    "sums both over microbatches and shards and divides once")


def _find_ratio(cfg: _Config, state, batch) -> _Config:
  """`cfg` with its `ratio` where the loss runs on parts of the batch (accum_steps > 1, or
  per shard) and is a batch sum over a batch count (a token-normalized mean): averaging the
  parts' means would differ from the batch's mean, so the step sums (sum, count) as
  `weighted` does. The loss is traced once on the whole batch here, before any loop.

  Raises:
    StepError: the loss divides by a count of the batch in a way that can't be split.
  """
  if cfg.weighted or (cfg.accum_steps == 1 and not _manual_data_axes()):
    return cfg
  key = _loss_key(cfg, state.step, 0, _manual_data_axes())
  fn, args, ins = _ratio_args(cfg, state.params, batch, key, state.frozen)
  try:
    ratio = _ratio.find(fn, args, ins)
  except _ratio.Unsplittable as e:
    raise StepError(
        f"{e}, and train_step runs it on parts of the batch (accum_steps={cfg.accum_steps}"
        f"{', per shard' if _manual_data_axes() else ''}), whose means averaged are not the "
        f"batch's mean; fix: {_RATIO_FIX}.") from None
  if ratio is None:
    return cfg
  logging.info("train_step: the loss is a sum over a count of the batch's tokens (a masked "
               "mean); both are summed over microbatches and shards and divided once, as "
               "weighted=True does%s", "" if ratio.floor is None else
               f" (the total count clipped at {ratio.floor:g}, as the loss clips it)")
  return cfg._replace(ratio=ratio)


class _NotScalar(StepError):
  """A loss that is not a scalar (weighted: not two scalars). Raised where the loss ran on a
  microbatch or one device's shard; `_step` retells it with the whole batch's shapes."""


def _whole_batch(cfg: _Config, state, batch, error: _NotScalar) -> StepError:
  """`error` with the loss's output on the whole batch, as the user wrote the loss for it
  (inside the loop it sees a microbatch, per shard a device's rows: shapes like (4, 1) for
  a 64-row batch); `error`'s own message if the whole batch's loss can't be traced."""
  def loss(params, batch, key, frozen):
    out = _loss_aux(cfg, _call_loss(cfg, params, batch, key, frozen))[0]
    return _split_weighted(cfg, out, " on the whole batch")
  try:
    jax.eval_shape(loss, state.params, batch, _loss_key(cfg, state.step, 0, ()), state.frozen)
  except _NotScalar as e:
    error = e
  except Exception:  # pylint: disable=broad-except  # traced only in the loop's context
    pass
  return StepError(str(error))  # (not the private class, in the user's traceback)


def _split_weighted(cfg: _Config, loss, where: str = ""):
  """(loss, weight): a scalar loss has weight 1; `weighted` losses are (sum, weight).
  `where`: where the loss ran, for the error (" on the whole batch")."""
  if cfg.weighted:
    if not (isinstance(loss, tuple) and len(loss) == 2
            and all(np.ndim(x) == 0 for x in loss)):
      raise _NotScalar(
          f"loss_fn returned {_tree.got(loss)}{where} as its loss; with weighted=True it must "
          "be (sum, weight), two scalars: the loss summed over the batch's tokens or examples "
          "and their count (e.g. (jnp.sum(nll * mask), jnp.sum(mask))).")
    loss, weight = loss
    return loss, jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
  if not jnp.issubdtype(jnp.result_type(loss), jnp.inexact):
    raise StepError(
        f"loss_fn returned a loss of dtype {jnp.result_type(loss)}, expected a float: an "
        "integer's gradient is zero, so nothing would train; fix: a float loss (e.g. "
        "a cross-entropy; a count or accuracy goes in aux, has_aux=True).")
  if np.ndim(loss) != 0:
    raise _NotScalar(
        f"loss_fn returned a loss of shape {np.shape(loss)}{where}, expected a scalar; fix: "
        "take the mean over the batch (or pass has_aux=True if it returns (loss, aux), or "
        "weighted=True if it returns (sum, weight)).")
  return loss, jnp.ones((), jnp.float32)


def _loss_key(cfg: _Config, step, index, axes: tuple[str, ...]):
  """The key of one loss call: the base key folded by the step, the microbatch index and,
  per shard under `jax.shard_map`, the shard's position over the data axes `axes`."""
  if cfg.key is None:
    return None
  key = jax.random.fold_in(jax.random.fold_in(cfg.key, step), index)
  return jax.random.fold_in(key, jax.lax.axis_index(axes)) if axes else key


def _for_compute(params):
  """Params as the loss computes with them: on Explicit data axes each leaf is gathered over
  those axes first (FSDP stores weights split and gathers them for use; the partitioner does
  it on Auto axes). Without it a weight split over "fsdp" meeting a batch split over "fsdp"
  would put one axis on two dims of a result, which jax refuses (ShardingTypeError). Its
  gradient is the reverse: a reduce-scatter back to the stored sharding."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return params
  explicit = set(getattr(mesh, "explicit_axes", ())) & set(_axes.current().data)
  if not explicit:
    return params

  def gather(x):
    spec = getattr(jax.typeof(x), "sharding", None)
    spec = spec.spec if spec is not None else PartitionSpec()
    kept = _tree.filter_spec(spec, lambda a: a not in explicit)
    return jax.sharding.reshard(x, kept) if kept != PartitionSpec(*spec) else x
  return jax.tree.map(gather, params)


def _tables_gathered(cfg: _Config, params, args: tuple, kwargs: dict):
  """On Auto data axes, with the params' shardings known (`shard_step`): the tables the
  loss looks up in gathered over the data axes that split their other dims
  (`fnscale._lookups`), else `params`."""
  specs = _known_specs(params)
  mesh = jax.sharding.get_abstract_mesh()
  if specs is None or mesh.empty:
    return params
  axes = set(_axes.current().data) & set(mesh.auto_axes) - set(mesh.manual_axes)
  # Every traced value an argument (none closed over) for the second trace.
  loss = lambda p, a, kw: cfg.loss_fn(p, *a, **kw)
  return _lookups.gather_tables(loss, params, (args, kwargs), specs, axes) if axes else params


def param_specs(params, shardings: list):
  """A context in which the traced step knows the params' shardings (`shard_step` enters it
  while lowering; `shardings`: one per leaf of `params`, in order): gradient accumulators
  and reduced gradients are pinned to them. It sets `fnscale._context.PARAM_SPECS`."""
  treedef = jax.tree.structure(params)
  return _context.PARAM_SPECS((treedef, tuple(s.spec for s in shardings)))


def _known_specs(params) -> list | None:
  """The params' PartitionSpecs, one per leaf, where known: from the array types on Explicit
  axes, else from `param_specs`; None when unknown (a step traced outside `shard_step`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  if not mesh.auto_axes:  # every axis Explicit: the params' types carry their shardings
    return [jax.typeof(p).sharding.spec for p in jax.tree.leaves(params)]
  known = _context.PARAM_SPECS.value
  if known is None or known[0] != jax.tree.structure(params):
    return None
  return list(known[1])
