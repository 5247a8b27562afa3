"""A model's state beside its params: what its forward pass updates rather than trains (a
BatchNorm's running statistics: Flax Linen's `batch_stats` collection, NNX's BatchStats, an
Equinox `eqx.nn.State`), held in `TrainState.model_state` (`init_state(...,
model_state=...)`).

The step passes it to the loss as its `model_state` keyword; the loss returns `(output, new
model state)`, `output` being what it returns otherwise (the loss; `(loss, aux)` with
`has_aux`; `(sum, weight)` with `weighted`). The new state rides the step's aux: without
accumulation, on Auto axes, the loss sees the whole batch and a BatchNorm its statistics
(a synchronised BatchNorm). With accumulation every microbatch starts from the state's
model state (a BatchNorm normalising it by its own rows) and their new ones are averaged,
as are the data shards' where the loss runs per shard (each shard's rows then normalised
apart: `train_step`'s accum_gather): a running mean moves as one update from the batch's
mean, a running variance by the microbatches' mean variance, as flax's ImageNet example
averages its devices' batch_stats; other leaves (a count, a flag) are kept as computed,
exact. Under accumulation "auto" gathers per microbatch, so that a BatchNorm sees whole
microbatches. A step skipped for non-finite gradients keeps the old model state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _tree
from fnscale._accumulate import Same, StatefulAux
from fnscale._errors import StepError

_FORM = ("with a model_state in the state, loss_fn(params, batch, ..., *, model_state) must "
         "return (output, new model_state), output being what it returns otherwise (the "
         "loss, or (loss, aux) with has_aux=True)")


def wrap(cfg, model_state):
  """`cfg` (a `_loss._Config`) whose loss passes `model_state` to the user's loss and returns
  the new model state in its aux (`StatefulAux`: floats in float32, averaged over
  microbatches and shards as aux floats are; other leaves kept whole, `Same`; `unwrap`
  restores the dtypes); `has_aux` set, "auto" accumulation per microbatch. Raises
  StepError, when traced, for a loss that returns no pair or a new state unlike
  `model_state`."""
  user, had_aux = cfg.loss_fn, cfg.has_aux

  def loss_fn(params, batch, *rest, **kw):
    # Rebuilt where the loss runs: NNX Variables made at the step's level refuse updates
    # from inside its gradient's trace.
    fresh = jax.tree.map(lambda x: x, model_state)
    out = user(params, batch, *rest, model_state=fresh, **kw)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise StepError(f"loss_fn returned {_tree.got(out)}; {_FORM}.")
    out, new = out
    _check_like(new, model_state)
    new = jax.tree.map(_combinable, new)
    if had_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise StepError(f"loss_fn's output is {_tree.got(out)}, expected (loss, aux) with "
                        f"has_aux=True; {_FORM}.")
      return out[0], StatefulAux(out[1], new)
    return out, StatefulAux(None, new)
  # A BatchNorm normalises the rows its loss call sees: under "auto", whole microbatches
  # (a device's rows alone, "once", can be a handful: its statistics noise).
  gather = "per_microbatch" if cfg.accum_gather == "auto" else cfg.accum_gather
  return cfg._replace(loss_fn=loss_fn, has_aux=True, accum_gather=gather)


def _combinable(x):
  """A new model state's leaf as the step combines it: a float averaged in float32, any
  other (a count, a flag, a seed) kept whole (`Same`)."""
  x = jnp.asarray(x)
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.inexact) else Same(x)


def _check_like(new, old) -> None:
  """StepError unless `new` has `old`'s structure and leaf shapes."""
  shapes = lambda t: [np.shape(x) for x in jax.tree.leaves(t)]
  if jax.tree.structure(new) != jax.tree.structure(old):
    raise StepError(
        f"loss_fn's new model_state has the structure {jax.tree.structure(new)}, and the "
        f"state's model_state {jax.tree.structure(old)}; {_FORM}, the new state like the "
        "one it was given (Linen: the `batch_stats` of `apply(..., mutable=['batch_stats'])`'s "
        "updates; NNX: nnx.state(model, nnx.BatchStat) after the call).")
  if shapes(new) != shapes(old):
    bad = next(p for (p, x), y in zip(_tree.leaves_with_paths(new), jax.tree.leaves(old))
               if np.shape(x) != np.shape(y))
    raise StepError(f"loss_fn's new model_state leaf '{bad}' changed shape; {_FORM}, the new "
                    "state like the one it was given.")


def unwrap(old, new, skipped):
  """The step's new model state: `new` (from `wrap`'s aux) in `old`'s dtypes, or `old`
  where the step was `skipped` (int32 1)."""
  def cast(x, o):
    x = x.value if isinstance(x, Same) else x.astype(o.dtype)
    return jnp.where(skipped > 0, o, x)
  return jax.tree.map(cast, new, old, is_leaf=lambda x: isinstance(x, Same))


def hint(message: str) -> str:
  """The fix for a step whose tracing failed with `message` (the error's type and text) over
  a model state, or ''."""
  if "unexpected keyword argument 'model_state'" in message:
    return ("fix: the state has a model_state (init_state(..., model_state=...)): the loss "
            "takes it, `def loss_fn(params, batch, *, model_state)`, and returns (output, "
            "new model_state)")
  if "argument: 'model_state'" in message:
    return ("fix: the loss takes a model_state: give the state one, "
            "fs.init_state(..., model_state=...)")
  if "TraceContextError" in message and "BatchStat" in message:
    return ("fix: a BatchStat the model updates is the state's model_state: `graphdef, "
            "params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)`, "
            "init_state(params, ..., model_state=stats), and the loss returns (loss, "
            "nnx.state(model, nnx.BatchStat)) (recipes/examples/README.md)")
  return ""
