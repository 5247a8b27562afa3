"""What a model block keeps for its backward pass: the rematerialisation policies of train_lm's
models (`jax.checkpoint` with a policy from `jax.checkpoint_policies`), and which one a run's
options resolve to (`remat_policy`).

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
- "offload_dots": "dots", with the saved weight-matmul outputs moved to the host's memory
  (`offload_dot_with_no_batch_dims`) and back for the backward pass (the 766M Llama at 8 x
  2048 moves 5.5 GiB each way a step: 30.0% MFU on one v5e, bound by the host link).
- "offload_attn": "full", but the attention kernel's output and statistics go to the host's
  memory and back rather than being recomputed: it pays where the forward pass hides their
  trip (`attention_offload`; --remat's policy on a TPU there). On one v5e
  (recipes/bench/README.md) the 766M Llama at 8 x 2048 (0.5 GiB each way a step) ran 61.1%
  MFU against full's 59.5% in 0.2 GiB more of the chip; GPT medium at 32 x 1024 (3.0 GiB
  each way: heads of 64 held as 128 lanes) 32.6% against 39.5%, bound by the host link.
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
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import fnscale as fs
from recipes.lm import int8
from recipes.lm.options import PLATFORM_DEFAULTS, REMAT_POLICIES as POLICIES, StepOptions

WHOLE_BLOCK = ("offload_attn", "full")  # the policies that recompute every matmul of a block
QKV = "qkv"  # the q, k and v projections (after RoPE)
ATTENTION = fs.kernels.RESIDUALS  # the attention kernel's output and logsumexp


def _saved_else(saved, otherwise):
  """`saved`'s residuals kept on the device, the rest as `otherwise` says (offloaded or
  recomputed). `save_from_both_policies` can't: it takes only yes/no policies."""
  return lambda prim, *args, **params: (saved(prim, *args, **params)
                                        or otherwise(prim, *args, **params))


def _policy(name: str):
  cp = jax.checkpoint_policies
  both = lambda *names: cp.save_only_these_names(*names)
  return {
      "dots": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                         both(ATTENTION, int8.OUTPUT)),
      "qkv_attn": both(QKV, ATTENTION),
      "qkv": both(QKV),
      "offload_dots": _saved_else(both(ATTENTION, int8.OUTPUT),
                                  cp.offload_dot_with_no_batch_dims("device", "pinned_host")),
      "offload_attn": cp.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=[ATTENTION],
          offload_src="device", offload_dst="pinned_host"),
      "full": cp.nothing_saveable,
  }[name]


# Under whole-block remat a step's forward pass is about a quarter of its time: the forward,
# its recomputation in the backward pass and the backward's two matmuls per forward one.
FORWARD_SHARE = 0.25
LANES = 128  # a TPU tile's minor dim: a head of 64 is held (and offloaded) as 128


def attention_bytes(cfg, tokens: float, compute_bytes: int) -> float:
  """Bytes offload_attn moves to the host (and back) for `tokens` tokens of model `cfg`
  (`layers`, `heads`, `head_dim`): per layer, token and query head, the kernel's output
  (head_dim rounded up to `LANES`, `compute_bytes` each) and its float32 logsumexp. Compiled
  for one v5e: 0.508 GiB for the 766M Llama at 8 x 2048, 3.047 GiB for GPT medium at 32 x
  1024, as XLA's host buffers."""
  return cfg.layers * tokens * cfg.heads * (-(-cfg.head_dim // LANES) * LANES
                                            * compute_bytes + 4)


def attention_offload(cfg, tokens_s: float, devices: int, compute_bytes: int,
                      link: float) -> float:
  """The time the attention residuals' trip to the host takes (one way, `attention_bytes` per
  device over the host `link`, bytes/s) over the forward pass's (`FORWARD_SHARE` of a
  full-remat step at `tokens_s`, the job's tokens/s over `devices`): offload_attn pays where
  it is at most 1, the forward pass hiding the trip out and the longer backward the trip
  back. Against one v5e's rows (recipes/bench/chip_v5e.json, link 8.5 GB/s): 0.37 for the
  766M Llama at 8 x 2048 (offload_attn 61.1% MFU, full 59.5%), 1.7 for GPT medium at 32 x
  1024 (32.6%, 39.5%), 0.73 for the Llama 3.2 1B at 8 x 2048, bf16 params (49.9%, 48.7%;
  forecast 0.79 and offload_attn chosen before it ran).

  Example:
    >>> from recipes.lm import llama
    >>> cfg = llama.model_config("llama-766m", 2048)
    >>> round(attention_offload(cfg, 23.5e3, 1, 2, 8.5e9), 2)
    0.37
  """
  per_token = attention_bytes(cfg, 1, compute_bytes) / devices
  return per_token / link / (FORWARD_SHARE / tokens_s)


def whole_block(model, cfg, topo, devices: int, policy, say, rate) -> str:
  """--remat's policy where --remat_policy is auto: offload_attn (said) on a TPU whose host
  link (`fs.CHIP_FACTS`' `host_link`) carries the attention residuals out in the forward
  pass's time by the forecast (`attention_offload` at most 1), else full. `model`, `cfg`:
  the run's model module and config; `devices`: the mesh's; `policy`: the jmp policy (None:
  float32); `rate()`: (the job's tokens/s under full remat, its global rows a step), or None
  without a forecast."""
  link = getattr(fs.CHIP_FACTS.get(topo.generation or ""), "host_link", None)
  forecast = (topo.platform == "tpu" and link and "offload_attn" in getattr(
      model, "REMAT_POLICIES", ()) and rate())
  if not forecast:
    return "full"
  width = np.dtype(policy.compute_dtype if policy else np.float32).itemsize
  share = attention_offload(cfg, forecast[0], devices, width, link)
  if share > 1:
    return "full"
  step_bytes = attention_bytes(cfg, forecast[1] * cfg.seq, width) / devices
  say(f"remat: offload_attn: the attention kernel's output goes to the host and back "
      f"({step_bytes / 2**30:.2f} GiB a step per device) in {share:.0%} of the forward "
      "pass's time by the forecast, rather than running again (--remat_policy=full "
      "recomputes it)")
  return "offload_attn"


def remat_policy(step: StepOptions, platform: str) -> str:
  """--remat_policy, auto resolved: full with --remat (`whole_block` may then choose
  offload_attn), else the platform's default (`options.PLATFORM_DEFAULTS`)."""
  if step.remat_policy != "auto":
    return step.remat_policy
  if step.remat:
    return "full"
  return PLATFORM_DEFAULTS["cpu" if platform == "cpu" else "accelerator"]["remat_policy"]


def remat_off(model, keep: str):
  """`fnscale.analysis.PlanOptions.remat_off` for a run whose blocks keep `keep` without
  remat (--remat_policy resolved, `remat_policy`): the policy's name where it keeps part of
  each block and `model` (a module of recipes/lm) takes policies by name, else False."""
  partial = keep not in ("none",) + WHOLE_BLOCK
  return keep if partial and keep in getattr(model, "REMAT_POLICIES", ()) else False


def block_policy(step: StepOptions) -> str:
  """The policy of a step whose --remat_policy is resolved (`remat_policy`): --remat's where
  set (full where unresolved), else --remat_policy."""
  if step.remat and step.remat_policy not in WHOLE_BLOCK:
    return "full"
  return step.remat_policy


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
