"""The router: each token's top-k experts and their combine weights (`route`, a `Routing`),
scored by a softmax (Mixtral, DeepSeek-V2) or, with a `Scoring`, DeepSeek-V3's sigmoid
affinities, selection bias and group-limited choice."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


SCORES = ("softmax", "sigmoid")


class Scoring(NamedTuple):
  """How the router scores experts and chooses among them (the default: Mixtral's).

  DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, section 2.1.2): each expert's affinity is
  the sigmoid of its logit; a per-expert `bias` (the `router_bias` param of `moe`) is added
  for choosing only, which is how its auxiliary-loss-free balancing steers load (the bias
  moves between steps, outside the gradient: `update_router_bias`); the experts are cut into
  `groups` and each token chooses among the `topk_groups` groups whose two best biased
  affinities sum highest; the k affinities chosen are renormalised (`normalize`) and
  multiplied by `scale` (its routed_scaling_factor).

  Attributes:
    score: "softmax" or "sigmoid" (`SCORES`).
    groups: expert groups, dividing E (1: no group limit).
    topk_groups: groups a token may choose from, 1..groups (0: all).
    scale: the combine weights' factor.

  Examples:
    DeepSeek-V3's router (256 experts in 8 groups, 4 groups a token, weights x 2.5) in a
    layer: `fs.parallel.moe(x, params, 8, scoring=v3)`, its params with a "router_bias".

    >>> import fnscale as fs
    >>> v3 = fs.parallel.Scoring("sigmoid", groups=8, topk_groups=4, scale=2.5)
    >>> v3.score, v3.groups
    ('sigmoid', 8)
  """
  score: str = "softmax"
  groups: int = 1
  topk_groups: int = 0
  scale: float = 1.0


class Routing(NamedTuple):
  """A router's decision for T tokens over E experts.

  Attributes:
    logits: float32 [T, E].
    probs: float32 [T, E], softmax of the logits (sigmoid scoring: the affinities
      normalised to sum to 1 per token, as DeepSeek-V3's balance loss takes them).
    experts: int32 [T, k], each token's experts, most probable first (ties: lower index).
    weights: float32 [T, k], their combine weights (the probs, or sigmoid's affinities,
      renormalised to sum to 1 over the k when `normalize`, times `Scoring.scale`).

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> router = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])  # [D=2, E=3]
    >>> route = jax.jit(fs.parallel.route, static_argnames=("k", "normalize"))
    >>> r = route(np.array([[1.0, 0.0], [0.0, 1.0]]), router, k=2)
    >>> r.experts.tolist(), r.weights.sum(axis=-1).tolist()
    ([[0, 1], [1, 0]], [1.0, 1.0])
  """
  logits: jax.Array
  probs: jax.Array
  experts: jax.Array
  weights: jax.Array


def route(x: jax.Array, router: jax.Array, k: int, *, normalize: bool = True,
          scoring: Scoring = Scoring(), bias: jax.Array | None = None) -> Routing:
  """Top-k routing in float32.

  Args:
    x: [T, D] tokens (any float dtype; cast to float32).
    router: [D, E] router weights.
    k: experts per token, 1 <= k <= E.
    normalize: renormalise the k weights to sum to 1 (Mixtral); False keeps the softmax
      probabilities (DeepSeek-V2, Switch).
    scoring: how experts are scored and chosen (`Scoring`: DeepSeek-V3's sigmoid, groups).
    bias: None or float32 [E], added to the scores for choosing only (DeepSeek-V3).

  Returns:
    A `Routing`.

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> router = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])  # [D=2, E=3]
    >>> route = jax.jit(fs.parallel.route, static_argnames=("k", "normalize"))
    >>> r = route(np.array([[1.0, 0.0], [0.0, 1.0]]), router, k=2, normalize=False)
    >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
    ([[0, 1], [1, 0]], [0.665, 0.245])

    DeepSeek-V3's: a bias that steers the choice, not the weights:

    >>> v3 = fs.parallel.Scoring(score="sigmoid")
    >>> r = fs.parallel.route(np.array([[1.0, 0.0]]), router, k=1, scoring=v3,
    ...                       bias=np.array([0.0, 0.0, 1.0]))
    >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
    ([[2]], [1.0])
  """
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  if scoring.score == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  else:
    scores = probs = jax.nn.softmax(logits, axis=-1)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if scoring.groups > 1 and 0 < scoring.topk_groups < scoring.groups:
    choice = _within_groups(choice, scoring.groups, scoring.topk_groups)
  _, experts = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if normalize:  # DeepSeek-V3 divides by the sum + 1e-20; a softmax's k never sum to 0
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (
        1e-20 if scoring.score == "sigmoid" else 0.0))
  if scoring.scale != 1.0:
    weights = weights * scoring.scale
  return Routing(logits, probs, experts.astype(jnp.int32), weights)


def _within_groups(choice: jax.Array, groups: int, keep: int) -> jax.Array:
  """`choice` [T, E] with the experts outside each token's `keep` best groups at -inf; a
  group's worth is the sum of its two best choices (one for a group of one)."""
  t, e = choice.shape
  grouped = choice.reshape(t, groups, e // groups)
  worth = jnp.sum(jax.lax.top_k(grouped, min(2, e // groups))[0], axis=-1)  # [T, groups]
  _, best = jax.lax.top_k(worth, keep)
  kept = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], best].set(True)
  return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, e)


def update_router_bias(bias: jax.Array, tokens_per_expert: jax.Array,
                       rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free balancing step: each expert's selection bias moves by
  `rate` towards the mean load, up where the expert took fewer token copies than the mean
  and down where more (arXiv:2412.19437, eq. 16's update; its rate was 0.001).

  Args:
    bias: float32 [..., E] (e.g. [layers, E] for stacked layers).
    tokens_per_expert: [..., E] the copies each expert took in the step (`MoEAux`).
    rate: the update speed (DeepSeek-V3's gamma).

  Returns:
    float32 [..., E].

  Examples:
    >>> import fnscale as fs, numpy as np
    >>> fs.parallel.update_router_bias(np.zeros(3), np.array([6, 2, 4]), 0.5).tolist()
    [-0.5, 0.5, 0.0]
  """
  load = jnp.asarray(tokens_per_expert, jnp.float32)
  return (jnp.asarray(bias, jnp.float32)
          + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load))
