"""The train step: a pure `(state, batch) -> (state, metrics)` from a loss and an optimizer.

`train_step` builds the step: jmp mixed precision (Micikevicius et al., 2018, "Mixed
Precision Training"), dynamic loss scaling with non-finite steps skipped, gradient
accumulation over microbatches with `lax.scan`. Inside `jax.shard_map` over data axes the
step runs per shard and `pmean`s gradients, loss and aux over those axes (the data-parallel
all-reduce of Goyal et al., 2017, "Accurate, Large Minibatch SGD"). The state is built by
`fnscale.init_state`, the step compiled by `fnscale.shard_step`.

Leaf paths in messages are '/'-joined pytree keys (`params/blocks/0/wq`).

Loss scaling. With a dynamic `LossScale` in the state (float16 compute, see `init_state`) a
step whose gradients are not finite leaves params and optimizer state unchanged, lowers the
scale and reports `skipped` 1; jmp's `adjust` raises the scale after `period` finite steps.

Random keys. With `key`, the loss is called as `loss_fn(params, batch, key)`, the key folded
(`jax.random.fold_in`) by the state's step, the microbatch index (0 without accumulation) and,
when the microbatch loop runs per shard (under `shard_step(mode="shard_map")`, or with
`accum_gather="once"`), the shard's position over the data axes: distinct for each, and
reproducible. Otherwise the loss sees the whole global batch and one key per microbatch, so
its random bits (jax's partitionable threefry) are the same under any mesh. "auto" keeps the
loop with the partitioner when a key is given, for that reason.

Accumulation over a mesh (`accum_gather`, with `accum_steps > 1` and data axes). The
gradients end in the params' sharding in every mode. Measure the modes with
`fnscale.compile_report(...).collectives` and `.temp_bytes`; `fnscale.analysis.plan` chooses.

- "per_microbatch" (ZeRO-3): params stay sharded and are gathered inside each microbatch, as
  without accumulation (accum x the all-gather traffic); each microbatch's gradient is
  reduced into a float32 accumulator sharded as the params are (accum x the reduction
  traffic, replicated leaves included). Per-device memory as at accum 1 plus the sharded
  accumulator. The loop stays with XLA's partitioner, which carries its accumulator in one
  sharding, never as a partial sum, so it reduces every microbatch's gradient before adding
  it (on TPU, XLA's while-loop all-reduce code motion moves some of those all-reduces out of
  the loop; CPU's compiler doesn't, and on Explicit axes it moves the params' gathers out of
  the loop, holding them whole: measure on the target).
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
  compute-dtype params and a whole float32 accumulator take at most `ONCE_SHARE` (10%) of
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
import dataclasses
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
from fnscale import _context
from fnscale import _lookups
from fnscale import _ratio
from fnscale import _topology
from fnscale import _tree
from fnscale._errors import StepError

__all__ = ["LossScale", "TrainState", "train_step"]


class TrainState(NamedTuple):
  """The training state, an immutable pytree.

  Fields:
    params: the model's params (any pytree of arrays), in the policy's param dtype.
    opt_state: the optax optimizer state.
    step: int32 scalar, the number of steps taken (skipped float16 steps included).
    loss_scale: a `LossScale` when loss scaling is used, else None (an empty subtree).
    frozen: params the loss reads but the step never trains (a LoRA's base model,
      `fnscale.lora`): any pytree of arrays, or None. The step takes no gradient of them and
      the optimizer holds no state for them; `train_step` passes them to the loss as its
      `frozen` keyword, cast to the compute dtype, and returns them unchanged.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> state = fs.init_state({"w": jnp.zeros((64, 8))}, optax.adam(1e-3),
    ...                       mesh=fs.make_mesh({"fsdp": 8}))
    >>> type(state).__name__, int(state.step), state.loss_scale
    ('TrainState', 0, None)
    >>> state.params["w"].shape, state.opt_state[0].mu["w"].shape
    ((64, 8), (64, 8))
  """
  params: Any
  opt_state: Any
  step: Any
  loss_scale: Any = None
  frozen: Any = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scale", "counter"],
                   meta_fields=["dynamic", "period", "factor", "min_scale", "compute"])
@dataclasses.dataclass(frozen=True)
class LossScale:
  """Loss-scale state in a `TrainState`: jmp's loss scale as a plain pytree value.

  The step rebuilds `jmp.DynamicLossScale` / `jmp.StaticLossScale` from it and uses their
  `scale`, `unscale` and `adjust` (jmp's classes check their leaves' dtypes when built,
  which breaks when jax's own machinery rebuilds them around shardings or placeholders).

  Fields: `scale` (float32 scalar), `counter` (int32 scalar, finite steps since the last
  change); static: `dynamic` (False: a fixed scale), `period` (finite steps before the scale
  grows), `factor` (growth / shrink factor), `min_scale`, `compute` (the compute dtype of
  the policy that asked for it, "float16", or None for a loss scale given explicitly: the
  step checks that it computes in that dtype too).

  Examples:
    `init_state` gives a float16 policy a dynamic scale of 2**15:

    >>> import fnscale as fs, jax.numpy as jnp, optax
    >>> state = fs.init_state({"w": jnp.zeros(4)}, optax.sgd(0.1), policy="compute=float16",
    ...                       mesh=fs.make_mesh({"data": 8}))
    >>> ls = state.loss_scale
    >>> type(ls).__name__, float(ls.scale), int(ls.counter), ls.dynamic, ls.compute
    ('LossScale', 32768.0, 0, True, 'float16')
  """
  scale: Any
  counter: Any
  dynamic: bool = True
  period: int = 2000
  factor: int = 2
  min_scale: float = 1.0
  compute: str | None = None


def _to_jmp(ls: LossScale):
  if ls.dynamic:
    return jmp.DynamicLossScale(ls.scale, ls.counter, ls.period, ls.factor,
                                jnp.asarray(ls.min_scale, jnp.float32))
  return jmp.StaticLossScale(ls.scale)


def as_loss_scale(loss_scale) -> LossScale | None:
  if loss_scale is None or isinstance(loss_scale, LossScale):
    return loss_scale
  if isinstance(loss_scale, jmp.NoOpLossScale):  # no scaling, chosen: a fixed scale of 1
    return LossScale(jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32), False)
  if isinstance(loss_scale, jmp.DynamicLossScale):
    return LossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32),
                     jnp.asarray(loss_scale.counter, jnp.int32), True, loss_scale.period,
                     loss_scale.factor, float(loss_scale.min_loss_scale))
  if isinstance(loss_scale, jmp.StaticLossScale):
    return LossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32),
                     jnp.zeros((), jnp.int32), False)
  raise StepError(f"loss_scale is a {type(loss_scale).__name__}, expected a jmp loss scale "
                  "(e.g. jmp.DynamicLossScale(jnp.float32(2**15))), a fnscale LossScale or None.")



def as_policy(policy) -> jmp.Policy | None:
  if policy is None or isinstance(policy, jmp.Policy):
    return policy
  if isinstance(policy, str):
    try:
      return jmp.get_policy(policy)
    except Exception as e:  # jmp raises ValueError/KeyError for unknown names.
      raise StepError(
          f"policy {policy!r} is not a jmp policy string ({e}); fix: e.g. "
          "'params=float32,compute=bfloat16,output=float32'.") from None
  raise StepError(
      f"policy is a {type(policy).__name__}, expected a jmp.Policy, a jmp policy string or "
      "None; fix: jmp.get_policy('params=float32,compute=bfloat16,output=float32').")


def check_optimizer(optimizer) -> None:
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise StepError(
        f"optimizer is a {type(optimizer).__name__}, expected an optax.GradientTransformation "
        "(with .init and .update); fix: e.g. optax.adamw(3e-4).")



def _manual_data_axes() -> tuple[str, ...]:
  """Data axes that the current trace runs per shard over (inside `jax.shard_map`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in _axes.data_axes(mesh) if a in manual)


def _vary(tree, axes: tuple[str, ...]):
  """Marks leaves as varying over `axes` (shard_map's type system) where they are not yet."""
  if not axes:
    return tree

  def f(x):
    varying = _compat.varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(f, tree)


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _reduce_aux(aux, axis_name=None, axis=None):
  """Floating leaves averaged, others (counts) summed, over mesh axes or an array axis."""
  def f(x):
    if axis_name is not None:
      x = _vary(x, axis_name)
      return jax.lax.pmean(x, axis_name) if _is_float(x) else jax.lax.psum(x, axis_name)
    return jnp.mean(x, axis=axis) if _is_float(x) else jnp.sum(x, axis=axis)
  return jax.tree.map(f, aux)


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


def default_loss_scale(policy, loss_scale) -> LossScale | None:
  """`loss_scale` as a `LossScale`, or jmp's dynamic scaling from 2**15 for float16 compute."""
  if loss_scale is not None:
    return as_loss_scale(loss_scale)
  if _computes_float16(policy):
    return LossScale(jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32),
                     compute="float16")
  return None


def _computes_float16(policy) -> bool:
  return policy is not None and jnp.dtype(policy.compute_dtype) == jnp.float16


def _check_precision(cfg: "_Config", state) -> None:
  """The step and the state agree on float16: a float16 step needs the state's loss scale
  (init_state gives one for a float16 policy), and a state built for float16 compute
  needs a float16 step."""
  ls, step16 = state.loss_scale, _computes_float16(cfg.policy)
  if step16 and ls is None:
    raise StepError(
        "train_step computes in float16 (its policy) but the state has no loss scale, and "
        "float16 gradients underflow without one; fix: give fs.init_state the same policy "
        "(policy=...), which adds jmp's dynamic loss scale to the state, or a loss_scale= "
        "(jmp.NoOpLossScale() trains unscaled on purpose).")
  if ls is not None and getattr(ls, "compute", None) == "float16" and not step16:
    what = "no policy" if cfg.policy is None else (
        f"a policy computing in {jnp.dtype(cfg.policy.compute_dtype).name}")
    raise StepError(
        "the state was built for float16 compute (fs.init_state's policy gave it a dynamic "
        f"loss scale) but train_step has {what}; fix: give fs.train_step the same policy "
        "(policy=...), or build the state without the float16 policy.")


# ----------------------------------------------------------------------------- train_step


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
      raise StepError(f"loss_fn returned a {type(out).__name__}; with has_aux=True it must "
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
  floor = None if cfg.ratio is None else cfg.ratio.floor
  if cfg.accum_steps == 1:
    grads, (loss, weight, aux) = grad_fn(params, micro, ls, _loss_key(cfg, step, 0, axes),
                                         frozen)
    out = _reduce(cfg, optax.tree.cast(grads, jnp.float32), loss, weight, aux, axes, reduce)
    return _normalize(*out, floor) if reduce else out
  n = jax.tree.leaves(micro)[0].shape[0]
  # Where the loop's sums are whole (no manual axes), its last microbatch divides them by
  # the weight in the same pass as its add: divided after the loop, every gradient would
  # be held twice (measured: 1.67x accum 1's temporaries against 1.25x, CPU fsdp=8).
  last_divides = reduce and not axes

  def body(carry, mb_i):
    gsum, lsum, wsum = carry
    mb, i = mb_i
    g, (l, w, a) = grad_fn(params, mb, ls, _loss_key(cfg, step, i, axes), frozen)
    lsum, wsum = lsum + l, wsum + w
    gsum = optax.tree.add(gsum, optax.tree.cast(g, jnp.float32))
    if last_divides:  # by 1 (exact) before the last microbatch
      d = jnp.where(i == n - 1, _divisor(wsum, floor), 1.0)
      gsum = jax.tree.map(lambda x: x / d, gsum)
    return (_like_params(gsum, params), lsum, wsum), a

  zero = _vary(jnp.zeros((), jnp.float32), axes)
  init = (_like_params(_vary(optax.tree.zeros_like(params, jnp.float32), axes), params),
          zero, zero)
  (gsum, lsum, wsum), auxs = jax.lax.scan(body, init, (micro, jnp.arange(n)))
  aux = _reduce_aux(auxs, axis=0) if cfg.has_aux else None
  if last_divides:
    return gsum, lsum / _divisor(wsum, floor), wsum, aux
  out = _reduce(cfg, gsum, lsum, wsum, aux, axes, reduce)
  return _normalize(*out, floor) if reduce else out


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
# (`fnscale._topology.device_memory`, the memory pre-flight's figure); the rest is for
# activations, optimizer state and the compiler. Above it, or where the device's memory is
# unknown (CPU), a model with params split over a data axis keeps them split
# ("per_microbatch", FSDP's memory).
ONCE_SHARE = 0.1


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


def _unscale(grads, ls):
  """Gradients divided by the loss scale: exact for a power-of-two scale wherever the
  result is a normal float32 (jmp multiplies by 1 / scale, which is 0 on a device that
  flushes subnormals once the scale reaches 2**127, and inexact for other scales)."""
  if ls is None:
    return grads
  return jax.tree.map(lambda g: g / ls.loss_scale, grads)


def _measures_change(cfg: _Config, params) -> bool:
  """Whether the step measures the change it applies (`train_step`'s update_norm): asked
  for, or by default where an update can be lost unseen: a trained param narrower than
  float32 (its rounding swallows small updates) or float16 compute (its gradients
  underflow to 0)."""
  if cfg.update_norm is not None:
    return cfg.update_norm
  return _computes_float16(cfg.policy) or any(
      _is_float(p) and jnp.finfo(p.dtype).bits < 32 for p in jax.tree.leaves(params))


def _update(cfg: _Config, state, grads, ls):
  """The optimizer update; with a dynamic loss scale, a non-finite step is skipped.
  Returns the new state, `skipped`, and the float32 norms of `grads` (float32, unscaled)
  and of the change applied to the params (the update after rounding to the param dtype;
  None where not measured, `_measures_change`).

  Both norms come from sums over each leaf (`_square_sums`), taken before the new
  params are written: the change is computed from the old params and the updates, and the
  new params read the change's norm (`_apply`), which orders that reduction first. The
  new params then take the old params' (donated) buffers in place. Measured afterwards as
  new - old, the old params would have to outlive the update: XLA copies every param
  first, then reads old and new again. Either way the change is a pass over the updates
  of its own (XLA fuses the updates into the params' write): 1.7% of a Llama 766M step on
  TPU v5e (recipes/bench/chip.py, hand=1). The gradients' norm costs nothing beside
  optax's global-norm clipping, which sums the same squares."""
  params = state.params
  cast = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  updates, opt_state = cfg.optimizer.update(cast, state.opt_state, params)
  skipped = jnp.zeros((), jnp.int32)
  new_ls = state.loss_scale
  finite = None
  if isinstance(ls, jmp.DynamicLossScale):
    finite = jmp.all_finite(cast)
    opt_state = jmp.select_tree(finite, opt_state, state.opt_state)
    ls = ls.adjust(finite)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    new_ls = dataclasses.replace(state.loss_scale, scale=ls.loss_scale,
                                 counter=jnp.asarray(ls.counter, jnp.int32))
  zero = jnp.zeros((), jnp.float32)
  if not _measures_change(cfg, params):
    grad_norm = jnp.sqrt(sum((_square_sums(g) for g in jax.tree.leaves(grads)), zero))
    new_params = jax.tree.map(lambda p, u: _apply(p, u, finite), params, updates)
    return (state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                           loss_scale=new_ls), skipped, grad_norm, None)
  sums = [_square_sums(g, _applied(p, u, finite)) for g, p, u in
          zip(jax.tree.leaves(grads), jax.tree.leaves(params), jax.tree.leaves(updates))]
  grad_norm = jnp.sqrt(sum((g for g, _ in sums), zero))
  update_norm = jnp.sqrt(sum((c for _, c in sums), zero))
  new_params = jax.tree.map(lambda p, u: _apply(p, u, finite, update_norm), params, updates)
  new_state = state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                             loss_scale=new_ls)
  return new_state, skipped, grad_norm, update_norm


def _apply(p, u, finite, update_norm=None):
  """`p` updated by `u` as optax applies it (p + u in p's dtype); `p` itself where a
  dynamic loss scale skips the step (`finite` False). Also `p` where `update_norm` < 0,
  which never holds (a norm is not negative, NaN compares False): the select makes the
  update read the norm, so XLA reduces the old params before overwriting them."""
  new = optax.apply_updates(p, u)
  keep = None if update_norm is None else update_norm < 0
  if finite is not None:
    keep = jnp.logical_not(finite) if keep is None else keep | jnp.logical_not(finite)
  return new if keep is None else jnp.where(keep, p, new)


def _applied(p, u, finite):
  """The change `_apply` makes to `p`, in float32: p + u rounded to p's dtype explicitly
  (XLA may otherwise keep the excess precision of a float32 sum that it rounds,
  xla_allow_excess_precision), minus p; a float32 leaf is its own rounding. 0 where the
  step is skipped; a 0-d 0 for a non-floating leaf."""
  if not _is_float(p):
    return jnp.zeros((), jnp.float32)
  new = optax.apply_updates(p, u).astype(jnp.float32)
  if p.dtype != jnp.float32:
    info = jnp.finfo(p.dtype)
    new = jax.lax.reduce_precision(new, info.nexp, info.nmant)
  change = new - p.astype(jnp.float32)
  return change if finite is None else jnp.where(finite, change, 0.0)


def _square_sums(g, c=None):
  """(sum of g**2, sum of c**2) in float32; sum of g**2 alone without `c`. Two sums, not
  one variadic reduce over both: GSPMD partitions a variadic reduce of sharded operands by
  gathering them first."""
  g = jnp.asarray(g, jnp.float32)
  if c is None:
    return jnp.sum(g * g)
  c = jnp.asarray(c, jnp.float32)
  return jnp.sum(g * g), jnp.sum(c * c)


def _check_trainable(params) -> None:
  """Every params leaf is differentiated: a float array. An integer array or a PRNG key
  among them (Equinox's `eqx.is_array` filter, NNX's split without a filter, which keeps
  the Rngs' keys and counts) would fail jax's grad naming no leaf."""
  for path, leaf in _tree.leaves_with_paths(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      raise StepError(
          f"params leaf '{path}' is {dtype}{list(getattr(leaf, 'shape', ()))}: train_step "
          "differentiates every params leaf, which needs float arrays; fix: keep only the "
          "trainable float arrays in the params (Equinox: eqx.partition(model, "
          "eqx.is_inexact_array); Flax NNX: nnx.split(model, nnx.Param, ...) or "
          "nnx.state(model, nnx.Param)), the rest in what the loss closes over or the batch.")


def _check_opt_state(cfg: _Config, state) -> None:
  """The state's optimizer state has the structure and shapes that the step's optimizer
  gives the params (traced abstractly, no arrays made): a state built with another
  optimizer would otherwise fail deep inside optax naming neither
  ("'EmptyState' object has no attribute 'mu'")."""
  want = jax.eval_shape(cfg.optimizer.init, state.params)
  shapes = lambda t: [np.shape(x) for x in jax.tree.leaves(t)]
  have_def, want_def = jax.tree.structure(state.opt_state), jax.tree.structure(want)
  if have_def == want_def and shapes(state.opt_state) == shapes(want):
    return
  raise StepError(
      f"the state's opt_state is {_opt_kinds(state.opt_state)}, but train_step's optimizer "
      f"makes {_opt_kinds(want)} for these params: the state was built with another "
      "optimizer (or other params); fix: give fs.init_state the optimizer given to "
      "fs.train_step (or restore a checkpoint saved with it).")


def _opt_kinds(opt_state) -> str:
  """'(ScaleByAdamState, EmptyState)': the optimizer state's named parts, for errors."""
  is_part = lambda x: isinstance(x, tuple) and hasattr(x, "_fields")
  parts = jax.tree.leaves(opt_state, is_leaf=is_part)
  names = [type(x).__name__ for x in parts if is_part(x)]
  n = len(jax.tree.leaves(opt_state))
  return f"({', '.join(names)}) with {n} array{'s' * (n != 1)}"


def _step(cfg: _Config, state, batch):
  if not isinstance(state, TrainState):
    raise StepError(f"state is a {type(state).__name__}, expected fnscale.TrainState; fix: "
                    "build it with fnscale.init_state.")
  _check_precision(cfg, state)
  _check_trainable(state.params)
  _check_opt_state(cfg, state)
  ls = _to_jmp(state.loss_scale) if state.loss_scale is not None else None
  cfg = _find_ratio(cfg, state, batch)
  try:
    grads, loss, weight, aux = _gradients(cfg, state.params, batch, ls, state.step,
                                          state.frozen)
  except _NotScalar as e:
    raise _whole_batch(cfg, state, batch, e) from None
  grads = _unscale(grads, ls)
  new_state, skipped, grad_norm, update_norm = _update(cfg, state, grads, ls)
  # Training that does not move: a finite loss, a step not skipped, and no (or a non-finite)
  # change to the params; where the change isn't measured, non-finite gradients (a norm of
  # 0 is no proof: the squares of gradients under 1e-19 underflow).
  moved = ~jnp.isfinite(grad_norm) if update_norm is None else (
      (update_norm == 0) | ~jnp.isfinite(update_norm))
  bad = jnp.isfinite(loss) & (skipped == 0) & moved
  metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": skipped,
             "bad_update": bad.astype(jnp.int32)}
  if update_norm is not None:
    metrics["update_norm"] = update_norm
  if cfg.weighted:
    metrics["weight"] = weight
  if cfg.has_aux:
    metrics["aux"] = aux
  if new_state.loss_scale is not None:
    metrics["loss_scale"] = jnp.asarray(new_state.loss_scale.scale, jnp.float32)
  return new_state, metrics


ACCUM_GATHER = ("auto", "per_microbatch", "once")


def train_step(loss_fn: Callable, optimizer, *, policy=None, accum_steps: int = 1,
               has_aux: bool = False, accum_gather: str = "auto",
               weighted: bool = False, key=None, update_norm: bool | None = None
               ) -> Callable:
  """Builds a pure train step `step(state, batch) -> (state, metrics)`.

  Under `shard_step` on Auto axes, a params table the loss looks up in (`table[tokens]`, an
  `Embed`) whose looked-up rows are split over a data axis is gathered over the data axes
  before the loss (`fnscale._lookups`), as FSDP gathers any weight it uses.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss` (a scalar), or `-> (loss, aux)` with
      `has_aux=True`; `loss_fn(params, batch, key)` when `key` is given; with the
      keyword `frozen=` (the state's frozen params, cast to the compute dtype, never
      differentiated) when the state has them (`TrainState.frozen`, `fnscale.lora`). A scalar loss
      should be a mean over the batch: the step averages the means of the microbatches
      and shards. Where they hold different numbers of tokens, a loss that divides a sum
      over the batch by a count of it (`jnp.sum(nll * mask) / jnp.sum(mask)`,
      `jnp.mean(nll, where=mask)`, a count clipped by `jnp.maximum(., c)`, plus terms
      that don't depend on the batch) is read from its jaxpr as (sum, count) and run as
      `weighted` runs it, when accum_steps > 1 or it runs per shard: the whole batch's
      mean (an info line says so). Other divisions by a count of the batch raise
      StepError naming `weighted`.
    optimizer: an `optax.GradientTransformation`.
    policy: a `jmp.Policy` or policy string, e.g.
      'params=float32,compute=bfloat16,output=float32': params and floating batch leaves
      are cast to the compute dtype for the loss, the loss to the output dtype, then to
      float32; params and gradients stay in the param dtype. None: no casts.
    accum_steps: microbatches per step: the batch (leading dim B, divisible by it) split into
      microbatches of B / accum_steps rows (microbatch i holds rows i, i + accum_steps, ...,
      so each stays spread over the data axes), run with `lax.scan`, their gradients summed
      in float32 before one optimizer update.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    accum_gather: one of `fnscale.ACCUM_GATHER`: with accum_steps > 1 under a mesh with data
      axes, when gradients are reduced over the data axes: "once" once per step (whole params
      and a whole float32 accumulator per device), "per_microbatch" in every microbatch
      (memory as at accum 1, ZeRO-3), "auto" (default) "once" where whole params and
      accumulator fit 10% of the device's memory (`fnscale._step.ONCE_SHARE`) or no param
      is split over a data axis, else "per_microbatch" (also with a `key`, or a loss
      closing over an Explicit-sharded array or sharding its ops by type). The modes'
      traffic and memory: this module's docstring.
    weighted: `loss_fn`'s loss is `(sum, weight)`, two scalars: the loss summed over its
      batch's tokens and their count or total weight (e.g. `(jnp.sum(nll * mask),
      jnp.sum(mask))`). The step sums both over microbatches and shards and divides once:
      the loss and gradients of the whole batch's weighted mean, whatever the mesh or
      accum_steps; a total weight of 0 gives zero loss and gradients.
    key: a `jax.random.key` or None: the loss is then `loss_fn(params, batch, key)`, `key`
      folded by the step, the microbatch and (per shard) the shard: distinct for each and
      reproducible (the module docstring says when they depend on the mesh).
    update_norm: measure the change the step applies to the params ("update_norm" in the
      metrics): True, False, or None (default) where an update can be lost unseen: a
      trained param narrower than float32 (bfloat16 or float16 params, whose rounding can
      swallow an update) or float16 compute (whose gradients can underflow to 0). It is a
      pass over the updates of its own: 1.7% of a Llama 766M step on TPU v5e.

  Returns:
    `step(state: TrainState, batch) -> (TrainState, metrics)`, a plain function. `metrics`:
    "loss" (float32, the mean loss), "grad_norm" (float32, of the unscaled gradients),
    "skipped" (int32, 1 when non-finite gradients skipped the step), "bad_update" (int32, 1
    when a finite, unskipped step left the params unchanged or non-finite, or, where the
    change isn't measured, had non-finite gradients: training has stalled if it stays 1); where measured "update_norm" (float32, of the change to the params after
    rounding to their dtype); with `weighted` "weight" (float32, the batch's total weight);
    with `has_aux` "aux" (floating leaves averaged over microbatches and shards, integer
    leaves summed); with a loss scale in the state "loss_scale" (float32).

  Raises:
    StepError: at construction, a non-callable loss_fn, a non-optax optimizer, a bad
      policy, accum_steps, accum_gather or key; when traced, a batch whose leaves' leading
      dims differ or are not divisible by accum_steps (naming the leaf), a non-scalar loss
      (or, with `weighted`, not two scalars; named by its shape on the whole batch), a
      state that is not a TrainState, one whose opt_state another optimizer made, a float16
      policy with a state that has no loss scale (or the reverse); with
      accum_gather="once", a loss closing over an array sharded on Explicit axes or
      sharding its ops by type; a loss run on parts of the batch that divides by a count
      of the batch in a way that can't be summed (naming `weighted`); a loss whose typed
      shardings (`out_sharding=`) jax refuses on this mesh (Auto axes, an axis the mesh
      lacks, batch axes other than the model's), naming the mesh or option that works.

  Examples:
    Least squares on one device: the loss, then the same batch again after one SGD step (the
    gradient is -2 per weight, so each weight moves to 0.2).

    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> opt = optax.sgd(0.1)
    >>> params = {"w": jnp.zeros((4, 1))}
    >>> state = fs.TrainState(params, opt.init(params), jnp.zeros((), jnp.int32))
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1))}
    >>> step = jax.jit(fs.train_step(loss_fn, opt))
    >>> state, metrics = step(state, batch)
    >>> print(f"{metrics['loss']:.4f}", state.params["w"].ravel(), int(state.step))
    1.0000 [0.2 0.2 0.2 0.2] 1
    >>> print(f"{step(state, batch)[1]['loss']:.4f}")
    0.0400
    >>> sorted(metrics)
    ['bad_update', 'grad_norm', 'loss', 'skipped']

    Four microbatches of two rows, reduced once per step:

    >>> fs.ACCUM_GATHER
    ('auto', 'per_microbatch', 'once')
    >>> step4 = jax.jit(fs.train_step(loss_fn, opt, accum_steps=4, accum_gather="once"))
    >>> print(f"{step4(state, batch)[1]['loss']:.4f}")
    0.0400
  """
  if not callable(loss_fn):
    raise StepError(f"loss_fn is {_tree.got(loss_fn)}, expected a callable "
                    "loss_fn(params, batch) -> loss.")
  check_optimizer(optimizer)
  _tree.check_int(accum_steps, "accum_steps", StepError, minimum=1)
  if not isinstance(has_aux, bool):
    raise StepError(f"has_aux is {_tree.got(has_aux)}, expected a bool.")
  if accum_gather not in ACCUM_GATHER:
    raise StepError(f"accum_gather={accum_gather!r}, expected one of {ACCUM_GATHER}.")
  if not isinstance(weighted, bool):
    raise StepError(f"weighted is {_tree.got(weighted)}, expected a bool.")
  if key is not None and not (isinstance(key, jax.Array)
                              and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                              and key.ndim == 0):
    raise StepError(f"key is {_tree.got(key)}, expected one jax.random.key(seed) (a "
                    "typed key array of shape ()) or None.")
  if update_norm is not None and not isinstance(update_norm, bool):
    raise StepError(f"update_norm is {_tree.got(update_norm)}, expected True, False or None.")
  cfg = _Config(loss_fn, optimizer, as_policy(policy), int(accum_steps), has_aux,
                accum_gather, weighted, key, update_norm=update_norm)

  def step(state, batch):
    return _step(cfg, state, batch)
  return step
