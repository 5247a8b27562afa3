"""What a model block keeps for its backward pass: the rematerialisation policies of train_lm's
models (`jax.checkpoint` with a policy from `jax.checkpoint_policies`).

A block's activations are either saved in the forward pass (memory) or recomputed in the
backward pass (FLOPs). The policies, from most memory to least:

- "none" (or False): save everything; no recomputation.
- "dots": save the outputs of the block's weight matmuls (q/k/v, output projection, MLP:
  `dots_with_no_batch_dims_saveable`) and the attention kernel's output and statistics
  (named `ATTENTION`), and the int8 matmuls' outputs (named `int8.OUTPUT`: a custom_vjp's
  product is no dot the policy sees): only norms, activation functions and RoPE are
  recomputed.
- "qkv_attn": save the q/k/v projections (named `QKV`) and the attention output: the output
  projection and the MLP are recomputed.
- "qkv": save only the q/k/v projections: attention, output projection and MLP recomputed.
- "offload_dots": "dots", with the saved matmul outputs moved to the host's memory
  (`offload_dot_with_no_batch_dims`) and back for the backward pass.
- "full" (or True): save only the block's input; the whole block runs again.

Example:
  >>> import jax, jax.numpy as jnp
  >>> block = lambda x, w: jnp.tanh(x @ w) @ w
  >>> g = jax.grad(lambda x, w: checkpointed(block, "dots")(x, w).sum())
  >>> g(jnp.ones((2, 4)), jnp.eye(4) * 0.5).shape
  (2, 4)
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

import fnscale as fs
from recipes.lm import int8
from recipes.lm.options import REMAT_POLICIES as POLICIES

QKV = "qkv"  # the q, k and v projections (after RoPE)
ATTENTION = fs.kernels.RESIDUALS  # the attention kernel's output and logsumexp


def _policy(name: str):
  cp = jax.checkpoint_policies
  both = lambda *names: cp.save_only_these_names(*names)
  return {
      "dots": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                         both(ATTENTION, int8.OUTPUT)),
      "qkv_attn": both(QKV, ATTENTION),
      "qkv": both(QKV),
      "offload_dots": cp.save_from_both_policies(
          cp.offload_dot_with_no_batch_dims("device", "pinned_host"), both(ATTENTION)),
      "full": cp.nothing_saveable,
  }[name]


def policy_name(remat: bool | str) -> str:
  """The policy's name for a `remat` argument: False -> "none", True -> "full", a name as is.

  Raises:
    InputError: a name not in `POLICIES`.
  """
  if isinstance(remat, bool):
    return "full" if remat else "none"
  if remat not in POLICIES:
    raise fs.InputError(f"remat={remat!r} is not a remat policy; expected one of "
                        f"{list(POLICIES)} (or True / False)")
  return remat


def checkpointed(block: Callable, remat: bool | str) -> Callable:
  """`block` under `jax.checkpoint` with the policy `remat` names (as is for "none").

  `prevent_cse=False`: the blocks run under `lax.scan`, which already keeps XLA from merging
  the recomputation into the forward pass (jax's `checkpoint` docs), and the barriers would
  only cost time.
  """
  name = policy_name(remat)
  if name == "none":
    return block
  return jax.checkpoint(block, policy=_policy(name), prevent_cse=False)


def name_qkv(x: jax.Array) -> jax.Array:
  """`x` (a q, k or v projection) named `QKV` for the policies that save it."""
  return checkpoint_name(x, QKV)
