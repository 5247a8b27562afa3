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
averages its devices' batch_stats. A step skipped for non-finite gradients keeps the old
model state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _tree
from fnscale._errors import StepError

_FORM = ("with a model_state in the state, loss_fn(params, batch, ..., *, model_state) must "
         "return (output, new model_state), output being what it returns otherwise (the "
         "loss, or (loss, aux) with has_aux=True)")


def wrap(cfg, model_state):
  """`cfg` (a `_loss._Config`) whose loss passes `model_state` to the user's loss and returns
  the new model state in its aux, in float32 (averaged over microbatches and shards as aux
  floats are, `unwrap` casts it back); `has_aux` set. Raises StepError, when traced, for a
  loss that returns no pair or a new state unlike `model_state`."""
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
    new = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), new)
    if had_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise StepError(f"loss_fn's output is {_tree.got(out)}, expected (loss, aux) with "
                        f"has_aux=True; {_FORM}.")
      return out[0], (out[1], new)
    return out, (None, new)
  return cfg._replace(loss_fn=loss_fn, has_aux=True)


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
  """The step's new model state: `new` (float32, from `wrap`'s aux) in `old`'s dtypes, or
  `old` where the step was `skipped` (int32 1)."""
  def cast(x, o):
    if o.dtype == jnp.bool_:
      x = x > 0.5
    else:
      x = (x if jnp.issubdtype(o.dtype, jnp.inexact) else jnp.round(x)).astype(o.dtype)
    return jnp.where(skipped > 0, o, x)
  return jax.tree.map(cast, new, old)
