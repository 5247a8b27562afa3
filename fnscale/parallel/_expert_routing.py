"""The router: each token's top-k experts and their combine weights (`route`, a `Routing`)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  """A router's decision for T tokens over E experts.

  Attributes:
    logits: float32 [T, E].
    probs: float32 [T, E], softmax of the logits.
    experts: int32 [T, k], each token's experts, most probable first (ties: lower index).
    weights: float32 [T, k], their combine weights (the probs, renormalised to sum to 1
      over the k when `normalize`).

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


def route(x: jax.Array, router: jax.Array, k: int, *, normalize: bool = True) -> Routing:
  """Top-k routing in float32.

  Args:
    x: [T, D] tokens (any float dtype; cast to float32).
    router: [D, E] router weights.
    k: experts per token, 1 <= k <= E.
    normalize: renormalise the k weights to sum to 1 (Mixtral); False keeps the softmax
      probabilities (DeepSeek-V2, Switch).

  Returns:
    A `Routing`.

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> router = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])  # [D=2, E=3]
    >>> route = jax.jit(fs.parallel.route, static_argnames=("k", "normalize"))
    >>> r = route(np.array([[1.0, 0.0], [0.0, 1.0]]), router, k=2, normalize=False)
    >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
    ([[0, 1], [1, 0]], [0.665, 0.245])
  """
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(logits, probs, experts.astype(jnp.int32), weights)
