"""The train step: a pure `(state, batch) -> (state, metrics)` and one compiled SPMD program.

- `train_step` builds the step from a loss function and an optax optimizer: jmp mixed
  precision (Micikevicius et al., 2018, "Mixed Precision Training"), dynamic loss scaling
  with non-finite steps skipped, gradient accumulation over microbatches with `lax.scan`.
- `init_state` builds params and optimizer state directly in their shardings
  (`jax.eval_shape` -> shardings -> `jax.jit(..., out_shardings=...)`), so a model bigger than
  one device never lives on one device.
- `shard_step` compiles the step once, ahead of time, as one SPMD program (`jax.jit` with
  in/out shardings and a donated state; GSPMD, Xu et al., 2021), or with the loss per shard
  under `jax.shard_map` and gradients `pmean`'d over the data axes (the data-parallel
  all-reduce of Goyal et al., 2017, "Accurate, Large Minibatch SGD").
- `compile_report` reads compile time, FLOPs, per-device bytes and the collectives from the
  compiled executable itself (collectives and matmul FLOPs from its optimized HLO with
  while-loop trip counts applied, `fnscale.hlo`).

Leaf paths in messages are '/'-joined pytree keys (`params/blocks/0/wq`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
import hashlib
import math
import time
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import jmp
import numpy as np
import optax

from fnscale import hlo as _hlo
from fnscale import sharding as _sh
from fnscale.distributed import agree_on_step
from fnscale.errors import FnscaleError, ShardingError, StepError
from fnscale.hlo import Collective

# The HLO reader lives in fnscale.hlo; this name stays for existing callers.
collectives_in_hlo = _hlo.collectives

__all__ = [
    "Collective",
    "CompileReport",
    "LossScale",
    "TrainState",
    "compilation_cache",
    "compile_report",
    "fast_compile_options",
    "format_report",
    "init_state",
    "shard_step",
    "state_shardings",
    "train_step",
]

_MODES = ("auto", "shard_map")


class TrainState(NamedTuple):
  """The training state, an immutable pytree.

  Fields:
    params: the model's params (any pytree of arrays), in the policy's param dtype.
    opt_state: the optax optimizer state.
    step: int32 scalar, the number of steps taken (skipped float16 steps included).
    loss_scale: a `LossScale` when loss scaling is used, else None (an empty subtree).
  """
  params: Any
  opt_state: Any
  step: Any
  loss_scale: Any = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scale", "counter"],
                   meta_fields=["dynamic", "period", "factor", "min_scale"])
@dataclasses.dataclass(frozen=True)
class LossScale:
  """Loss-scale state in a `TrainState`: jmp's loss scale as a plain pytree value.

  The step rebuilds `jmp.DynamicLossScale` / `jmp.StaticLossScale` from it and uses their
  `scale`, `unscale` and `adjust` (jmp's classes check their leaves' dtypes when built,
  which breaks when jax's own machinery rebuilds them around shardings or placeholders).

  Fields: `scale` (float32 scalar), `counter` (int32 scalar, finite steps since the last
  change); static: `dynamic` (False: a fixed scale), `period` (finite steps before the scale
  grows), `factor` (growth / shrink factor), `min_scale`.
  """
  scale: Any
  counter: Any
  dynamic: bool = True
  period: int = 2000
  factor: int = 2
  min_scale: float = 1.0


def _to_jmp(ls: LossScale):
  if ls.dynamic:
    return jmp.DynamicLossScale(ls.scale, ls.counter, ls.period, ls.factor,
                                jnp.asarray(ls.min_scale, jnp.float32))
  return jmp.StaticLossScale(ls.scale)


def _as_loss_scale(loss_scale) -> LossScale | None:
  if loss_scale is None or isinstance(loss_scale, (LossScale, jmp.NoOpLossScale)):
    return None if isinstance(loss_scale, jmp.NoOpLossScale) else loss_scale
  if isinstance(loss_scale, jmp.DynamicLossScale):
    return LossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32),
                     jnp.asarray(loss_scale.counter, jnp.int32), True, loss_scale.period,
                     loss_scale.factor, float(loss_scale.min_loss_scale))
  if isinstance(loss_scale, jmp.StaticLossScale):
    return LossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32),
                     jnp.zeros((), jnp.int32), False)
  raise StepError(f"loss_scale is a {type(loss_scale).__name__}, expected a jmp loss scale "
                  "(e.g. jmp.DynamicLossScale(jnp.float32(2**15))), a fnscale LossScale or None.")


# ----------------------------------------------------------------------------- helpers


def _path(p) -> str:
  return _sh.path_str(p)


def _as_policy(policy) -> jmp.Policy | None:
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


def _check_optimizer(optimizer) -> None:
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise StepError(
        f"optimizer is a {type(optimizer).__name__}, expected an optax.GradientTransformation "
        "(with .init and .update); fix: e.g. optax.adamw(3e-4).")


def _replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _mesh_data_axes(mesh) -> tuple[str, ...]:
  return _sh.data_axes(mesh)


def _manual_data_axes() -> tuple[str, ...]:
  """Data axes that the current trace runs per shard over (inside `jax.shard_map`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in _sh.data_axes(mesh) if a in manual)


def _vary(tree, axes: tuple[str, ...]):
  """Marks leaves as varying over `axes` (shard_map's type system) where they are not yet."""
  if not axes:
    return tree

  def f(x):
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older: aval.vma
    varying = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
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
    out.append((_path(p), shape[0] if shape else None))
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


def _microbatches(batch, accum_steps: int, n: int):
  """[B, ...] leaves -> [accum_steps, B // accum_steps, ...]; microbatch i holds rows i,
  i + accum_steps, ... so that each keeps a share of every device's rows (no resharding)."""
  micro = n // accum_steps
  mesh = jax.sharding.get_abstract_mesh()
  axes = ()
  if not mesh.empty:
    auto = set(mesh.auto_axes)
    axes = tuple(a for a in _sh.data_axes(mesh) if a in auto and mesh.shape[a] > 1)
  ways = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if micro % ways:
    raise StepError(
        f"microbatch size {micro} (batch {n} / accum_steps {accum_steps}) is not divisible "
        f"by the data axes {axes} ({ways} ways); each microbatch is spread over every device; "
        f"fix: use a batch size that is a multiple of {accum_steps * ways}.")

  def split(x):
    x = jnp.swapaxes(x.reshape((micro, accum_steps) + x.shape[1:]), 0, 1)
    if axes:
      spec = PartitionSpec(None, axes if len(axes) > 1 else axes[0])
      x = jax.lax.with_sharding_constraint(x, spec)
    return x
  return jax.tree.map(split, batch)


# ----------------------------------------------------------------------------- train_step


def train_step(loss_fn: Callable, optimizer, *, policy=None, accum_steps: int = 1,
               has_aux: bool = False) -> Callable:
  """Builds a pure train step `step(state, batch) -> (state, metrics)`.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss` (a scalar), or `-> (loss, aux)` with
      `has_aux=True`. The loss should be a mean over the batch: with accumulation the
      microbatch gradients are averaged.
    optimizer: an `optax.GradientTransformation`.
    policy: a `jmp.Policy` or policy string, e.g.
      'params=float32,compute=bfloat16,output=float32': params (and gradients) stay in the
      param dtype; params and floating batch leaves are cast to the compute dtype for the
      loss; the loss is cast to the output dtype, then to float32. None: no casts.
    accum_steps: split the batch (leading dim B, which must be divisible by it) into this
      many microbatches of B / accum_steps rows, run them with `lax.scan` and sum their
      gradients in float32 before one optimizer update. Microbatch i holds rows
      i, i + accum_steps, ..., so under a mesh (the step traced inside `jax.set_mesh`, as
      `shard_step` does) every microbatch stays spread over the data axes.
    has_aux: whether `loss_fn` returns `(loss, aux)`.

  Returns:
    `step(state: TrainState, batch) -> (TrainState, metrics)`; metrics is a dict with
    "loss" (float32, the mean loss), "grad_norm" (float32, `optax.tree.norm` of the
    unscaled gradients), "skipped" (int32, 1 if this step was skipped because its
    gradients were not finite, else 0; sum it for a count), "aux" (with `has_aux`; floating
    leaves averaged over microbatches and shards, integer leaves summed) and "loss_scale"
    (float32, when the state has a loss scale). With a dynamic `LossScale` in the state
    (float16 compute, see `init_state`) a step with non-finite gradients leaves params and
    optimizer state unchanged and lowers the scale. Inside `jax.shard_map` over data axes
    (`shard_step(mode="shard_map")`) the step runs per shard and `pmean`s gradients,
    loss and aux over those axes. The function carries attributes `loss_fn`, `optimizer`,
    `policy`, `accum_steps`, `has_aux`.

  Raises:
    StepError: at construction, a non-callable loss_fn, a non-optax optimizer, a bad
      policy or accum_steps; when traced, a batch whose leaves' leading dims differ or are
      not divisible by accum_steps (naming the leaf), a non-scalar loss, a state that is not
      a TrainState.
  """
  if not callable(loss_fn):
    raise StepError(f"loss_fn is a {type(loss_fn).__name__}, expected a callable "
                    "loss_fn(params, batch) -> loss.")
  _check_optimizer(optimizer)
  policy = _as_policy(policy)
  if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
    raise StepError(f"accum_steps={accum_steps!r}, expected a positive int; fix: e.g. 1 or 4.")

  def scaled_loss(params, batch, loss_scale):
    if policy is not None:
      params = policy.cast_to_compute(params)
      batch = policy.cast_to_compute(batch)
    out = loss_fn(params, batch)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise StepError(f"loss_fn returned a {type(out).__name__}; with has_aux=True it must "
                        "return (loss, aux).")
      loss, aux = out
    else:
      loss, aux = out, None
    if np.ndim(loss) != 0:
      raise StepError(
          f"loss_fn returned a loss of shape {np.shape(loss)}, expected a scalar; fix: take "
          "the mean over the batch (or pass has_aux=True if it returns (loss, aux)).")
    if policy is not None:
      loss = policy.cast_to_output(loss)
    loss = jnp.asarray(loss).astype(jnp.float32)
    scaled = loss_scale.scale(loss) if loss_scale is not None else loss
    return scaled, (loss, aux)

  grad_fn = jax.grad(scaled_loss, has_aux=True)

  def step(state, batch):
    if not isinstance(state, TrainState):
      raise StepError(f"state is a {type(state).__name__}, expected fnscale.TrainState; fix: "
                      "build it with fnscale.init_state.")
    n = _check_accum(batch, accum_steps) if accum_steps > 1 else None
    axes = _manual_data_axes()
    params = state.params
    ls = _to_jmp(state.loss_scale) if state.loss_scale is not None else None
    # Per-shard gradients are local (varying) values, reduced explicitly below.
    params_v = _vary(params, axes)
    if accum_steps == 1:
      grads, (loss, aux) = grad_fn(params_v, batch, ls)
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    else:
      micro = _microbatches(batch, accum_steps, n)

      def body(carry, mb):
        gsum, lsum = carry
        g, (l, a) = grad_fn(params_v, mb, ls)
        gsum = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), gsum, g)
        return (gsum, lsum + l), a

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params_v)
      init = (_vary(zeros, axes), _vary(jnp.zeros((), jnp.float32), axes))
      (gsum, lsum), auxs = jax.lax.scan(body, init, micro)
      grads = jax.tree.map(lambda g: g / accum_steps, gsum)
      loss = lsum / accum_steps
      aux = _reduce_aux(auxs, axis=0) if has_aux else None
    if axes:
      grads = jax.lax.pmean(_vary(grads, axes), axes)
      loss = jax.lax.pmean(_vary(loss, axes), axes)
      if has_aux:
        aux = _reduce_aux(aux, axis_name=axes)
    if ls is not None:
      grads = ls.unscale(grads)
    grad_norm = optax.tree.norm(grads)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    skipped = jnp.zeros((), jnp.int32)
    if isinstance(ls, jmp.DynamicLossScale):
      finite = jmp.all_finite(grads)
      new_params, opt_state = jmp.select_tree(
          finite, (new_params, opt_state), (params, state.opt_state))
      ls = ls.adjust(finite)
      skipped = jnp.logical_not(finite).astype(jnp.int32)
    metrics = {"loss": loss, "grad_norm": grad_norm.astype(jnp.float32), "skipped": skipped}
    if has_aux:
      metrics["aux"] = aux
    if ls is not None:
      metrics["loss_scale"] = jnp.asarray(ls.loss_scale, jnp.float32)
    new_ls = None
    if ls is not None:
      new_ls = dataclasses.replace(state.loss_scale, scale=ls.loss_scale,
                                   counter=jnp.asarray(getattr(ls, "counter",
                                                               state.loss_scale.counter),
                                                       jnp.int32))
    new_state = TrainState(new_params, opt_state, state.step + 1, new_ls)
    return new_state, metrics

  step.loss_fn = loss_fn
  step.optimizer = optimizer
  step.policy = policy
  step.accum_steps = accum_steps
  step.has_aux = has_aux
  return step


# ----------------------------------------------------------------------------- shardings


def state_shardings(state, mesh, rules=(), *, logical_axes=None, optimizer=None,
                    sharding_options: Mapping | None = None) -> TrainState:
  """Shardings for a `TrainState` (concrete or abstract): params by `fnscale.shardings`
  (logical rules, else automatic FSDP), optimizer state following the params
  (`fnscale.opt_state_shardings`; by structure when `optimizer` is None), step and loss
  scale replicated.

  Args:
    state: a TrainState of arrays or ShapeDtypeStructs.
    mesh: the mesh.
    rules, logical_axes: as in `fnscale.shardings`.
    optimizer: the optax optimizer (lets optax find the param-shaped parts of its state).
    sharding_options: extra keyword arguments for `fnscale.shardings` (`fsdp_axis`,
      `min_shard_bytes`, `max_replicated_bytes`).

  Returns:
    A TrainState whose leaves are NamedShardings.

  Raises:
    StepError: state is not a TrainState. ShardingError: from `fnscale.shardings`.
  """
  if not isinstance(state, TrainState):
    raise StepError(f"state is a {type(state).__name__}, expected fnscale.TrainState.")
  opts = dict(sharding_options or {})
  psh = _sh.shardings(state.params, mesh, rules, logical_axes=logical_axes, **opts)
  osh = _sh.opt_state_shardings(optimizer, state.opt_state, psh, mesh)
  rep = _replicated(mesh)
  return TrainState(psh, osh, rep, jax.tree.map(lambda _: rep, state.loss_scale))


_derive_state_shardings = state_shardings  # shard_step's argument shadows the name


def _default_loss_scale(policy, loss_scale) -> LossScale | None:
  if loss_scale is not None:
    return _as_loss_scale(loss_scale)
  if policy is not None and jnp.dtype(policy.compute_dtype) == jnp.float16:
    return LossScale(jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32))
  return None


def init_state(init_fn_or_params, optimizer, *, mesh, rules=(), logical_axes=None,
               policy=None, key=None, loss_scale=None,
               sharding_options: Mapping | None = None,
               abstract: bool = False) -> TrainState:
  """Builds a `TrainState` born in its shardings (no device ever holds the whole model).

  A function is traced with `jax.eval_shape`, its output's shardings derived
  (`state_shardings`), and it runs under `jax.jit(..., out_shardings=...)`; the optimizer
  state is initialised the same way. Concrete params are `jax.device_put` into their
  shardings (a copy: the step may donate the state without deleting the caller's arrays).

  Args:
    init_fn_or_params: `init_fn(key) -> params` (or `init_fn()` when `key` is None), or a
      pytree of arrays.
    optimizer: an `optax.GradientTransformation`.
    mesh: the `jax.sharding.Mesh`.
    rules, logical_axes, sharding_options: as in `state_shardings`.
    policy: a jmp policy (or string): params are cast to its param dtype; float16 compute
      adds a dynamic `LossScale` (jmp's dynamic scaling from 2**15) to the state.
    key: a PRNG key for `init_fn`.
    loss_scale: a jmp loss scale (or `LossScale`) for the state, overriding the policy's
      default; `jmp.NoOpLossScale()` means none.
    abstract: return `jax.ShapeDtypeStruct`s with their shardings instead of arrays;
      nothing is allocated or run (for `shard_step(...).compile`, `compile_report` on a mesh
      of devices that aren't here, or checkpoint restore targets).

  Returns:
    TrainState(params, opt_state, step=int32 0, loss_scale), every leaf a jax.Array sharded
    as `state_shardings(...)` says (or its ShapeDtypeStruct with `abstract=True`).

  Raises:
    StepError: a bad optimizer, policy or loss_scale, or params that are not arrays.
    ShardingError: from the shardings (rules, logical axes, indivisible dimensions).
  """
  _check_optimizer(optimizer)
  policy = _as_policy(policy)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise StepError(f"mesh is a {type(mesh).__name__}, expected a jax.sharding.Mesh; fix: "
                    "fnscale.make_mesh(...).")
  loss_scale = _default_loss_scale(policy, loss_scale)
  cast = policy.cast_to_param if policy is not None else (lambda t: t)
  opts = dict(sharding_options or {})

  if callable(init_fn_or_params):
    init_fn = init_fn_or_params
    args = () if key is None else (key,)
    make = lambda *a: cast(init_fn(*a))
    shapes = jax.eval_shape(make, *args)
    psh = _sh.shardings(shapes, mesh, rules, logical_axes=logical_axes, **opts)
    params = _sds(shapes, psh) if abstract else jax.jit(make, out_shardings=psh)(*args)
  else:
    params = init_fn_or_params
    for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise StepError(
            f"params leaf '{_path(p)}' is a {type(leaf).__name__}, expected an array; fix: "
            "pass arrays (jnp/np) or an init function.")
    params = cast(params)
    psh = _sh.shardings(params, mesh, rules, logical_axes=logical_axes, **opts)
    params = (jax.eval_shape(lambda p: p, params) if abstract
              else jax.device_put(params, psh, may_alias=False))
    if abstract:
      params = _sds(params, psh)
  abstract_opt = jax.eval_shape(optimizer.init, params)
  osh = _sh.opt_state_shardings(optimizer, abstract_opt, psh, mesh)
  rep = _replicated(mesh)
  step = jnp.zeros((), jnp.int32)
  if abstract:
    return TrainState(params, _sds(abstract_opt, osh), _sds(step, rep),
                      _sds(jax.eval_shape(lambda t: t, loss_scale), rep))
  opt_state = jax.jit(optimizer.init, out_shardings=osh)(params)
  step = jax.device_put(step, rep)
  if loss_scale is not None:
    loss_scale = jax.device_put(loss_scale, rep)
  return TrainState(params, opt_state, step, loss_scale)


def _sds(tree, shardings_tree):
  """ShapeDtypeStructs of `tree` with `shardings_tree` (one sharding or a matching tree)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  shs = _flat_shardings(tree, shardings_tree, "state")
  return jax.tree_util.tree_unflatten(treedef, [
      jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s) for x, s in zip(leaves, shs)])


# ----------------------------------------------------------------------------- shard_step


def fast_compile_options() -> dict[str, Any]:
  """XLA compile options that turn most backend optimisations off, for quick debug compiles.

  `xla_backend_optimization_level=0` and `xla_llvm_disable_expensive_passes=True` (XLA
  DebugOptions, accepted by `jax.stages.Lowered.compile(compiler_options=...)`). They cut
  compile time of large programs roughly in half on the CPU backend; the program runs slower.
  Not for production steps.
  """
  return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compilation_cache(directory: str, *, min_compile_time_s: float = 0.0,
                      min_entry_size_bytes: int = 0) -> None:
  """Turns on JAX's persistent compilation cache in `directory` (a local path or gs://...).

  Sets `jax_compilation_cache_dir`, `jax_persistent_cache_min_compile_time_secs` and
  `jax_persistent_cache_min_entry_size_bytes` (defaults 0: cache every program, even small
  ones) and resets jax's cache object so the new directory takes effect. This is jax's own
  process-wide configuration; in multi-process jobs only process 0 writes entries.

  Raises:
    StepError: an empty directory or negative thresholds.
  """
  if not isinstance(directory, str) or not directory:
    raise StepError(f"compilation cache directory {directory!r}, expected a non-empty path.")
  if min_compile_time_s < 0 or min_entry_size_bytes < 0:
    raise StepError(f"min_compile_time_s={min_compile_time_s}, min_entry_size_bytes="
                    f"{min_entry_size_bytes}; expected values >= 0.")
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
  cc.reset_cache()


def _flat_shardings(tree, shardings_tree, what: str) -> list:
  """One sharding per leaf of `tree` from a pytree prefix of shardings (a sharding at a
  prefix leaf covers every leaf below it)."""
  out = []

  def f(s, sub):
    if not isinstance(s, jax.sharding.Sharding):
      raise StepError(f"the {what} shardings hold a {type(s).__name__} where a "
                      "jax.sharding.Sharding was expected.")
    out.extend([s] * len(jax.tree_util.tree_leaves(sub)))

  try:
    jax.tree.map(f, shardings_tree, tree,
                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  except (ValueError, TypeError) as e:
    raise StepError(
        f"the {what} shardings don't match the {what}'s structure: {e}; fix: pass shardings "
        f"with the {what}'s structure or a prefix of it (one sharding covers a subtree)."
    ) from None
  return out


def _check_state_fits(state, flat) -> None:
  """Rank and divisibility of every state leaf under its sharding, naming the leaf path."""
  pairs, _ = jax.tree_util.tree_flatten_with_path(state)
  for (p, leaf), s in zip(pairs, flat):
    if isinstance(s, NamedSharding):
      try:
        # pylint: disable-next=protected-access
        _sh._check_explicit(_path(p), s.spec, _aval(leaf)[0], dict(s.mesh.shape))
      except ShardingError as e:
        raise ShardingError(f"state {e}") from None


def _aval(leaf) -> tuple[tuple[int, ...], np.dtype]:
  shape = tuple(int(d) for d in np.shape(leaf))
  dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
  return shape, np.dtype(jax.dtypes.canonicalize_dtype(dtype))


class _Signature(NamedTuple):
  """What a compiled step was built for: structures, per-leaf (path, shape, dtype, sharding)."""
  state_def: Any
  batch_def: Any
  state_leaves: tuple
  batch_leaves: tuple


def _signature(state, batch, state_sh, batch_sh) -> _Signature:
  def leaves(tree, shs, what):
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for (p, leaf), s in zip(pairs, shs):
      out.append((f"{what} leaf '{_path(p)}'",) + _aval(leaf) + (s,))
    return treedef, tuple(out)
  sdef, sl = leaves(state, state_sh, "state")
  bdef, bl = leaves(batch, batch_sh, "batch")
  return _Signature(sdef, bdef, sl, bl)


def _same_sharding(actual, expected, ndim: int) -> bool:
  if actual == expected:
    return True
  try:
    return actual.is_equivalent_to(expected, ndim)
  except Exception:  # pylint: disable=broad-except
    return False


def _conform(tree, treedef, expected, what: str):
  """Checks `tree` against a compiled signature; reshards leaves placed differently."""
  # Fast path, taken every step: the previous step's outputs fit exactly. Paths and
  # messages are only built when something doesn't.
  leaves, got_def = jax.tree_util.tree_flatten(tree)
  if got_def == treedef and all(
      isinstance(leaf, jax.Array) and leaf.shape == shape and leaf.dtype == dtype
      and (leaf.sharding is s or leaf.sharding == s) and not leaf.is_deleted()
      for leaf, (_, shape, dtype, s) in zip(leaves, expected)):
    return tree
  pairs, got_def = jax.tree_util.tree_flatten_with_path(tree)
  for p, leaf in pairs:
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      # Calling a donated buffer crashes the runtime; say what happened instead.
      raise StepError(
          f"{what} leaf '{_path(p)}' was donated to an earlier call of this step (its buffer "
          f"is gone); fix: use the state the step returns, `state, metrics = step(state, "
          f"batch)`, or build the step with donate=False.")
  if got_def != treedef:
    raise StepError(
        f"the {what} has structure {got_def} but the step was compiled for {treedef}; fix: "
        f"pass a {what} with the same pytree structure (or compile again for the new one).")
  out, moved = [], []
  for (p, leaf), (name, shape, dtype, s) in zip(pairs, expected):
    gshape, gdtype = _aval(leaf)
    if gshape != shape or gdtype != dtype:
      raise StepError(
          f"{name}: got {gdtype}{list(gshape)}, the step was compiled for {dtype}{list(shape)}; "
          f"fix: pass a {what} of the compiled shapes and dtypes or compile the step again "
          "for the new ones.")
    if isinstance(leaf, jax.Array) and _same_sharding(leaf.sharding, s, len(shape)):
      out.append(leaf)
    else:
      out.append(jax.device_put(leaf, s))
      moved.append(name)
  if moved:
    log = logging.warning if what == "state" else logging.info
    log("resharded %d %s leaves to the compiled shardings (e.g. %s)", len(moved), what,
        moved[0])
  return jax.tree_util.tree_unflatten(treedef, out)


def _abstract(tree, shs):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out = []
  for leaf, s in zip(leaves, shs):
    shape, dtype = _aval(leaf)
    out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=s))
  return jax.tree_util.tree_unflatten(treedef, out)


def _strip_spec(spec: PartitionSpec, keep: tuple[str, ...]) -> PartitionSpec:
  """Only the mesh axes in `keep` (shard_map's manual axes) of each spec entry."""
  entries = []
  for e in spec:
    axes = tuple(a for a in _sh._entry_axes(e) if a in keep)  # pylint: disable=protected-access
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*entries)


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def shard_step(step: Callable, mesh, *, rules=(), logical_axes=None, state_shardings=None,
               batch_sharding=None, donate: bool = True, mode: str = "auto", example=None,
               sharding_options: Mapping | None = None,
               compiler_options: Mapping | None = None,
               fast_compile: bool = False) -> Callable:
  """Compiles `step(state, batch) -> (state, metrics)` as one SPMD program over `mesh`.

  The step is lowered and compiled ahead of time from abstract inputs
  (`jax.ShapeDtypeStruct` with shardings), every process waits at
  `fnscale.distributed.agree_on_step("compiled step ...")` (a barrier that also checks that
  every process compiled the same program), and calls run the kept executable, so step 0
  never compiles again. Shardings: `state_shardings` if given, else derived from the state
  (`fnscale.step.state_shardings`: params by rules / automatic FSDP, optimizer state
  following them, scalars replicated) with the same arguments `init_state` takes, so a state
  from `init_state` is used in place; the batch's leading dim is split over the mesh's data
  axes (`fnscale.batch_sharding`) unless `batch_sharding` is given; rank-0 batch leaves are
  replicated. The state is donated (its buffers reused for the new state) when `donate`.

  Args:
    step: the step, e.g. from `train_step` (possibly wrapped, e.g. by `with_kernel`).
    mesh: the `jax.sharding.Mesh` (Auto axis types; a mesh over
      `jax.experimental.topologies` devices compiles for hardware that isn't here).
    rules, logical_axes, sharding_options: as in `init_state`.
    state_shardings: a TrainState of NamedShardings (or a prefix) to use instead.
    batch_sharding: a NamedSharding for every batch leaf, or a pytree of them.
    donate: donate the state argument.
    mode: "auto": `jax.jit` with in/out shardings, XLA's sharding propagation (GSPMD)
      partitions the step. "shard_map": the step runs per shard under `jax.shard_map`, manual
      over the mesh's data axes (other axes stay automatic), with the batch split over them
      and the state replicated over them (FSDP-sharded leaves are all-gathered at entry);
      `train_step` steps `pmean` gradients, loss and aux over those axes and give the same
      params as "auto" (up to float rounding).
    example: `(state, batch)` (arrays or ShapeDtypeStructs): compile now and return the
      compiled step (same as `shard_step(...).compile(state, batch)`).
    compiler_options: XLA compile options (DebugOptions names) for `Lowered.compile`.
    fast_compile: add `fast_compile_options()` (debugging only: slower programs).

  Returns:
    `sharded(state, batch) -> (state, metrics)`. The first call for a given set of input
    shapes and dtypes compiles (as `jax.jit` would) and later calls reuse the executable.
    Attributes: `lower(state, batch)` -> `jax.stages.Lowered`; `compile(state, batch)` ->
    a compiled step that only ever runs its one executable; `shardings(state, batch)` ->
    (state shardings, batch shardings); `step`, `mesh`, `mode`, `donate`,
    `compiler_options`. A compiled step
    has attributes `compiled` (`jax.stages.Compiled`), `lowered`, `compile_seconds`,
    `state_shardings`, `batch_shardings`, `mesh`. Batch or state leaves placed differently
    from the compiled shardings (numpy arrays, other meshes) are moved there with
    `jax.device_put` (a transfer, never a new compile; a warning for the state); leaves of
    other shapes, dtypes or structure raise StepError. In multi-process jobs build batches
    with `fnscale.global_batch`.

  Raises:
    StepError: a bad step, mesh, mode or option; a state or batch that doesn't match the
      compiled step (naming the leaf path, expected and got).
    ShardingError: a batch leaf not divisible by the data axes, a state leaf that doesn't
      fit its sharding (naming the leaf path and axes).
  """
  if not callable(step):
    raise StepError(f"step is a {type(step).__name__}, expected a callable step(state, batch).")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise StepError(f"mesh is a {type(mesh).__name__}, expected a jax.sharding.Mesh; fix: "
                    "fnscale.make_mesh(...).")
  if mode not in _MODES:
    raise StepError(f"mode={mode!r}, expected one of {_MODES}.")
  options = dict(compiler_options or {})
  if fast_compile:
    options = {**fast_compile_options(), **options}
  optimizer = getattr(step, "optimizer", None)
  daxes = _mesh_data_axes(mesh)

  def shardings_for(state, batch):
    if state_shardings is None:
      ssh = _derive_state_shardings(state, mesh, rules, logical_axes=logical_axes,
                                    optimizer=optimizer, sharding_options=sharding_options)
    else:
      ssh = state_shardings
    state_flat = _flat_shardings(state, ssh, "state")
    _check_state_fits(state, state_flat)
    if batch_sharding is None:
      bs = _sh.batch_sharding(mesh)
      batch_flat = [bs if np.ndim(x) else _replicated(mesh)
                    for x in jax.tree_util.tree_leaves(batch)]
    else:
      batch_flat = _flat_shardings(batch, batch_sharding, "batch")
    bdef = jax.tree_util.tree_structure(batch)
    bsh = jax.tree_util.tree_unflatten(bdef, batch_flat)
    _sh.check_batch(batch, bsh)
    return ssh, state_flat, bsh, batch_flat

  def body_fn(state_def, batch_def, batch_flat):
    if mode == "auto" or not daxes:
      if mode == "shard_map":
        logging.info("shard_step: mesh %s has no data axes; mode='shard_map' runs as 'auto'",
                     dict(mesh.shape))
      return step
    batch_specs = jax.tree_util.tree_unflatten(
        batch_def, [_strip_spec(s.spec, daxes) for s in batch_flat])
    return jax.shard_map(step, mesh=mesh, in_specs=(PartitionSpec(), batch_specs),
                         out_specs=(PartitionSpec(), PartitionSpec()),
                         axis_names=set(daxes), check_vma=True)

  def lower(state, batch):
    ssh, state_flat, bsh, batch_flat = shardings_for(state, batch)
    sdef = jax.tree_util.tree_structure(state)
    bdef = jax.tree_util.tree_structure(batch)
    jitted = jax.jit(body_fn(sdef, bdef, batch_flat), in_shardings=(ssh, bsh),
                     out_shardings=(ssh, _replicated(mesh)),
                     donate_argnums=(0,) if donate else ())
    with jax.set_mesh(mesh):
      return jitted.lower(_abstract(state, state_flat), _abstract(batch, batch_flat))

  def compile_(state, batch):
    ssh, state_flat, bsh, batch_flat = shardings_for(state, batch)
    sig = _signature(state, batch, state_flat, batch_flat)
    try:
      lowered = lower(state, batch)
    except FnscaleError:
      raise
    except (TypeError, ValueError) as e:  # the user's step doesn't trace for these shapes
      shapes = ", ".join(f"'{name.split(chr(39))[1]}': {dt}{list(shape)}"
                         for name, shape, dt, _ in sig.batch_leaves)
      raise StepError(
          f"tracing the step failed for batch {{{shapes}}}: {type(e).__name__}: "
          f"{str(e).splitlines()[0]}; fix: give the batch the shapes and dtypes the loss "
          "expects.") from e
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    seconds = time.perf_counter() - t0
    name = f"compiled step {_digest(lowered.as_text())}"
    logging.info("shard_step: %s in %.2f s on mesh %s (mode %s)", name, seconds,
                 dict(mesh.shape), mode)
    # Every process compiled the same program, or a DistributedError says what differs.
    agree_on_step(name, lowered.as_text(), state, batch, mesh, options)

    def compiled_step(state, batch):
      state = _conform(state, sig.state_def, sig.state_leaves, "state")
      batch = _conform(batch, sig.batch_def, sig.batch_leaves, "batch")
      return compiled(state, batch)

    compiled_step.compiled = compiled
    compiled_step.lowered = lowered
    compiled_step.compile_seconds = seconds
    compiled_step.state_shardings = ssh
    compiled_step.batch_shardings = bsh
    compiled_step.mesh = mesh
    compiled_step.mode = mode
    compiled_step.step = step
    return compiled_step

  # Executables by input shapes/dtypes, like jax.jit's own cache.
  cache: dict[Any, Callable] = {}

  def sharded(state, batch):
    key = (jax.tree_util.tree_structure(state), jax.tree_util.tree_structure(batch),
           tuple(_aval(x) for x in jax.tree_util.tree_leaves(state)),
           tuple(_aval(x) for x in jax.tree_util.tree_leaves(batch)))
    fn = cache.get(key)
    if fn is None:
      if cache:
        logging.warning(
            "shard_step: compiling again for new input shapes/dtypes (executable %d); call "
            "step.compile(state, batch) to pin one and get an error instead", len(cache) + 1)
      fn = cache[key] = compile_(state, batch)
    return fn(state, batch)

  sharded.lower = lower
  sharded.compile = compile_
  sharded.shardings = lambda state, batch: shardings_for(state, batch)[::2]
  sharded.step = step
  sharded.mesh = mesh
  sharded.mode = mode
  sharded.donate = donate
  sharded.compiler_options = options
  functools.update_wrapper(sharded, step, assigned=("__doc__", "__name__", "__qualname__"),
                           updated=())
  if example is not None:
    if not (isinstance(example, tuple) and len(example) == 2):
      raise StepError(f"example is a {type(example).__name__}, expected (state, batch).")
    return compile_(*example)
  return sharded


# ----------------------------------------------------------------------------- compile report


class CompileReport(NamedTuple):
  """What XLA says about one compiled step. Bytes are per device.

  Fields: `compile_seconds` (wall time of `Lowered.compile`), `flops`, `transcendentals`
  and `bytes_accessed` (XLA cost analysis of the partitioned, per-device program; None where
  the backend gives none; it counts each while-loop body once, so a `lax.scan` over layers
  or gradient-accumulation microbatches is under-counted), `argument_bytes`, `output_bytes`,
  `temp_bytes`, `alias_bytes` (arguments whose buffers the outputs reuse, e.g. a donated
  state) and `generated_code_bytes` (memory analysis; None where unavailable), `collectives`
  (tuple of `fnscale.hlo.Collective`: executions, result bytes and ring bytes sent per device
  per step, loop trip counts applied), `platform`, `num_devices`, `mesh_shape` (dict axis ->
  size, or None), `matmul_flops` (FLOPs of the `dot`/`convolution` ops of the optimized HLO
  per device per step, loop trip counts applied; `fnscale.hlo.summarize`).
  """
  compile_seconds: float
  flops: float | None
  transcendentals: float | None
  bytes_accessed: float | None
  argument_bytes: int | None
  output_bytes: int | None
  temp_bytes: int | None
  alias_bytes: int | None
  generated_code_bytes: int | None
  collectives: tuple[Collective, ...]
  platform: str
  num_devices: int
  mesh_shape: dict | None
  matmul_flops: float | None = None

  @property
  def peak_bytes(self) -> int | None:
    """arguments + outputs + temporaries - aliased: the step's per-device footprint."""
    parts = (self.argument_bytes, self.output_bytes, self.temp_bytes)
    if any(p is None for p in parts):
      return None
    return sum(parts) - (self.alias_bytes or 0)

  def collective(self, kind: str) -> Collective:
    """The entry for `kind`, or a zero-count one."""
    return next((c for c in self.collectives if c.kind == kind), Collective(kind, 0, 0))

  def __str__(self) -> str:
    return format_report(self)


def _cost(compiled) -> dict:
  try:
    cost = compiled.cost_analysis()
  except Exception as e:  # pylint: disable=broad-except
    logging.info("cost analysis unavailable: %s", e)
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def _memory(compiled):
  try:
    return compiled.memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    logging.info("memory analysis unavailable: %s", e)
    return None


def report_from_compiled(compiled, compile_seconds: float, mesh=None) -> CompileReport:
  """A `CompileReport` from a `jax.stages.Compiled` and its measured compile time."""
  cost = _cost(compiled)
  mem = _memory(compiled)

  def m(name):
    v = getattr(mem, name, None) if mem is not None else None
    return int(v) if v is not None else None

  def c(name):
    v = cost.get(name)
    return float(v) if v is not None else None

  hlo = _hlo.summarize(compiled.as_text() or "")
  devices = None
  try:
    devices = compiled.input_shardings[0]
    devices = jax.tree_util.tree_leaves(devices)[0].device_set if devices else None
  except Exception:  # pylint: disable=broad-except
    devices = None
  if mesh is not None:
    platform, num = mesh.devices.flat[0].platform, mesh.devices.size
  elif devices:
    platform, num = next(iter(devices)).platform, len(devices)
  else:
    platform, num = jax.default_backend(), 1
  return CompileReport(
      compile_seconds=float(compile_seconds), flops=c("flops"),
      transcendentals=c("transcendentals"), bytes_accessed=c("bytes accessed"),
      argument_bytes=m("argument_size_in_bytes"), output_bytes=m("output_size_in_bytes"),
      temp_bytes=m("temp_size_in_bytes"), alias_bytes=m("alias_size_in_bytes"),
      generated_code_bytes=m("generated_code_size_in_bytes"),
      collectives=hlo.collectives, platform=platform, num_devices=int(num),
      mesh_shape=dict(mesh.shape) if mesh is not None else None,
      matmul_flops=hlo.matmul_flops)


def compile_report(step: Callable, state, batch, *,
                   compiler_options: Mapping | None = None,
                   fast_compile: bool = False) -> CompileReport:
  """Compiles `step` for `(state, batch)` and reports what XLA made of it.

  Args:
    step: a compiled step (`shard_step(...).compile(...)`: its executable and compile time
      are reused), a `shard_step` result or anything with `.lower` (`jax.jit`), or a plain
      function (wrapped in `jax.jit`).
    state, batch: arrays or `jax.ShapeDtypeStruct`s (abstract inputs never touch a device,
      so this works for a mesh of `jax.experimental.topologies` devices, e.g. a TPU pod
      compiled on a CPU machine).
    compiler_options, fast_compile: as in `shard_step`, added to a `shard_step` result's own
      options (ignored for a compiled step).

  Returns:
    A `CompileReport` (a NamedTuple; `str(report)` / `format_report(report)` is a readable
    summary). FLOPs and bytes are per device.

  Raises:
    StepError / ShardingError: as `shard_step` does for inputs that don't fit.
  """
  if not callable(step):
    raise StepError(f"step is a {type(step).__name__}, expected a step function.")
  mesh = getattr(step, "mesh", None)
  if getattr(step, "compiled", None) is not None:
    return report_from_compiled(step.compiled, step.compile_seconds, mesh)
  options = dict(getattr(step, "compiler_options", None) or {})
  if fast_compile:
    options.update(fast_compile_options())
  options.update(compiler_options or {})
  if hasattr(step, "lower"):
    lowered = step.lower(state, batch)
  else:
    lowered = jax.jit(step).lower(state, batch)
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=options or None)
  return report_from_compiled(compiled, time.perf_counter() - t0, mesh)


def _fmt_bytes(n) -> str:
  if n is None:
    return "n/a"
  return _sh._fmt_bytes(int(n))  # pylint: disable=protected-access


def _fmt_num(x) -> str:
  if x is None:
    return "n/a"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {unit}"
  return f"{x:.0f}"


def format_report(report: CompileReport) -> str:
  """Readable multi-line text for a `CompileReport`."""
  mesh = (" mesh " + ",".join(f"{k}={v}" for k, v in report.mesh_shape.items())
          if report.mesh_shape else "")
  lines = [
      f"compiled step: {report.platform} x{report.num_devices}{mesh}",
      f"  compile time      {report.compile_seconds:.2f} s",
      f"  FLOPs per device  {_fmt_num(report.flops)}  (XLA cost analysis, loop bodies once; "
      f"transcendentals {_fmt_num(report.transcendentals)}, bytes accessed "
      f"{_fmt_bytes(report.bytes_accessed)})",
      f"  matmul FLOPs/dev  {_fmt_num(report.matmul_flops)}  (HLO dot/convolution, loop "
      "trip counts applied)",
      "  memory per device",
      f"    arguments       {_fmt_bytes(report.argument_bytes)}",
      f"    outputs         {_fmt_bytes(report.output_bytes)}",
      f"    temporaries     {_fmt_bytes(report.temp_bytes)}",
      f"    aliased         {_fmt_bytes(report.alias_bytes)}",
      f"    peak (a+o+t-al) {_fmt_bytes(report.peak_bytes)}",
  ]
  if report.collectives:
    lines.append("  collectives per step (runs [ops in program], result / ring-sent bytes "
                 "per device)")
    for c in report.collectives:
      lines.append(f"    {c.kind:<20} {c.count:>4} [{c.ops}]  {_fmt_bytes(c.bytes)} / "
                   f"{_fmt_bytes(c.bytes_sent)}")
  else:
    lines.append("  collectives: none")
  return "\n".join(lines)
