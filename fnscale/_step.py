"""The train step: a pure `(state, batch) -> (state, metrics)` from a loss and an optimizer.

`train_step` builds the step: jmp mixed precision (Micikevicius et al., 2018, "Mixed
Precision Training"), dynamic loss scaling with non-finite steps skipped, gradient
accumulation over microbatches with `lax.scan`. Inside `jax.shard_map` over data axes the
step runs per shard and `pmean`s gradients, loss and aux over those axes (the data-parallel
all-reduce of Goyal et al., 2017, "Accurate, Large Minibatch SGD"). The state is built by
`fnscale.init_state`, the step compiled by `fnscale.shard_step`.

The step in four files, read in this order: this one (the state, the checks, the step
itself), `_loss.py` (the user's loss called on params in the compute dtype: its key, its
(sum, count) form, its errors), `_accumulate.py` (the microbatch loop, where it runs and how
its gradients are reduced: the `accum_gather` modes), `_update.py` (the optimizer update and
the norms it reports).

Leaf paths in messages are '/'-joined pytree keys (`params/blocks/0/wq`).

Loss scaling. With a dynamic `LossScale` in the state (float16 compute, see `init_state`) a
step whose gradients are not finite leaves params and optimizer state unchanged, lowers the
scale and reports `skipped` 1; jmp's `adjust` raises the scale after `period` finite steps.
"""
from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from fnscale import _flax
from fnscale import _model_state
from fnscale import _tree
from fnscale._accumulate import _gradients
from fnscale._errors import StepError
from fnscale._loss import _Config, _find_ratio, _NotScalar, _whole_batch
from fnscale._update import _computes_float16, _unscale, _update

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
    model_state: what the model's forward pass updates rather than trains (a BatchNorm's
      running statistics: Linen's `batch_stats`, NNX BatchStats, an `eqx.nn.State`), any
      pytree of arrays, or None: `train_step` passes it to the loss as its `model_state`
      keyword (as stored, no cast) and keeps the new one the loss returns beside its
      output (`fnscale._model_state` says how microbatches and shards combine).

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
  model_state: Any = None


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


def default_loss_scale(policy, loss_scale) -> LossScale | None:
  """`loss_scale` as a `LossScale`, or jmp's dynamic scaling from 2**15 for float16 compute."""
  if loss_scale is not None:
    return as_loss_scale(loss_scale)
  if _computes_float16(policy):
    return LossScale(jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32),
                     compute="float16")
  return None


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


def _check_trainable(params) -> None:
  """Every params leaf is differentiated: a float array. An integer array or a PRNG key
  among them (Equinox's `eqx.is_array` filter, NNX's split without a filter, which keeps
  the Rngs' keys and counts) would fail jax's grad naming no leaf; an NNX Variable other
  than a Param (a BatchStat) would be trained (`_flax.check_only_params`)."""
  _flax.check_only_params(params, StepError)
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
  has_aux, stateful = cfg.has_aux, state.model_state is not None
  if stateful:
    cfg = _model_state.wrap(cfg, state.model_state)
  cfg = _find_ratio(cfg, state, batch)
  try:
    grads, loss, weight, aux = _gradients(cfg, state.params, batch, ls, state.step,
                                          state.frozen)
  except _NotScalar as e:
    raise _whole_batch(cfg, state, batch, e) from None
  grads = _unscale(grads, ls)
  new_state, skipped, grad_norm, update_norm = _update(cfg, state, grads, ls)
  if stateful:
    aux, new = aux.aux, aux.model_state
    new_state = new_state._replace(model_state=_model_state.unwrap(state.model_state, new,
                                                                   skipped))
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
  if has_aux:
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
      differentiated) when the state has them (`TrainState.frozen`, `fnscale.lora`); with
      the keyword `model_state=` when the state has one (`TrainState.model_state`, a
      BatchNorm's statistics), returning `(output, new model state)`. A scalar loss
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
      accumulator fit 1% of the device's memory (`fnscale.analysis.device_memory`) or no param
      is split over a data axis, else "per_microbatch" (also with a `key`, a model state,
      or a loss closing over an Explicit-sharded array or sharding its ops by type). The modes'
      traffic and memory: recipes/bench/README.md, "Gradient accumulation".
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
    change isn't measured, had a non-finite gradient norm (a non-finite gradient, or a
    norm past float32's range, ~1.8e19): training has stalled if it stays 1);
    where measured "update_norm" (float32, of the change to the params after rounding to
    their dtype); with `weighted` "weight" (float32, the batch's total weight);
    with `has_aux` "aux" (floating leaves averaged over microbatches and shards, integer
    leaves summed; a leaf with a value per row, whole without accumulation, is refused
    with it); with a loss scale in the state "loss_scale" (float32).

  Raises:
    StepError: at construction, a non-callable loss_fn, a non-optax optimizer, a bad
      policy, accum_steps, accum_gather or key; when traced, a batch whose leaves' leading
      dims differ or are not divisible by accum_steps (naming the leaf), a non-scalar loss
      (or, with `weighted`, not two scalars; named by its shape on the whole batch), an
      integer loss, an aux leaf with a value per row under accumulation, params that can't
      be trained (an integer leaf, an NNX Variable other than a Param), a
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
