"""Direct preference optimization of a LoRA-adapted model against its own frozen base.

DPO (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly
a Reward Model", arXiv:2305.18290, eq. 7) trains a policy pi on pairs (x, y_w, y_l), y_w
preferred, by the logistic loss of the margin

  h = beta [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))],

where ref is the model before training. With LoRA the reference is the frozen base itself:
the same params with the adapters left out (`TrainState.frozen`), so no second copy of the
model is held; its log-probabilities take one more forward pass, and no backward pass.

Noisy preferences (a fraction eps of the labels flipped), `label_smoothing` = eps:
  "sigmoid": -(1 - eps) log sigma(h) - eps log sigma(-h), conservative DPO (cDPO: Mitchell,
    2023, "A note on DPO with noisy preferences and relationship to IPO"), DPO itself at 0;
  "robust": (-(1 - eps) log sigma(h) + eps log sigma(-h)) / (1 - 2 eps), an unbiased
    estimate of the clean-label loss (rDPO: Chowdhury et al., 2024, "Provably Robust DPO:
    Aligning Language Models with Noisy Feedback", arXiv:2403.00409, eq. 8).

Batches are packed preference rows (`recipes/lm/preference.py`): pair k of a row is its
segments 2k - 1 (prompt + chosen) and 2k (prompt + rejected), with the loss weights on the
responses' tokens; a sequence's log-probability is the sum of its weighted tokens' log-probs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fnscale as fs

LOSSES = ("sigmoid", "robust")


class DPOConfig(NamedTuple):
  """beta (the KL penalty's inverse temperature, > 0), label_smoothing (eps in [0, 0.5)),
  loss (one of LOSSES) and pairs (the most pairs a packed row holds)."""
  beta: float = 0.1
  label_smoothing: float = 0.0
  loss: str = "sigmoid"
  pairs: int = 8


def check(config: DPOConfig) -> DPOConfig:
  """Raises InputError naming a bad field."""
  if not config.beta > 0:
    raise fs.InputError(f"--dpo_beta={config.beta}: expected > 0 (e.g. 0.1)")
  if not 0 <= config.label_smoothing < 0.5:
    raise fs.InputError(f"--dpo_label_smoothing={config.label_smoothing}: expected in "
                        "[0, 0.5) (the fraction of flipped labels)")
  if config.loss not in LOSSES:
    raise fs.InputError(f"--dpo_loss={config.loss!r}: expected one of {list(LOSSES)}")
  return config


def preference_loss(chosen, rejected, ref_chosen, ref_rejected, config: DPOConfig):
  """Per-pair DPO losses and implicit rewards.

  Args:
    chosen, rejected: the policy's log-probabilities of the preferred and the other
      response, float [...] (sums over the responses' tokens).
    ref_chosen, ref_rejected: the reference's, same shape (no gradient flows to them).
    config: beta, label_smoothing and loss.

  Returns:
    (losses, chosen_rewards, rejected_rewards), float32 of the inputs' shape; rewards are
    beta (log pi - log ref).
  """
  ref_chosen, ref_rejected = jax.lax.stop_gradient((ref_chosen, ref_rejected))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  r_w = config.beta * (f32(chosen) - f32(ref_chosen))
  r_l = config.beta * (f32(rejected) - f32(ref_rejected))
  h, eps = r_w - r_l, config.label_smoothing
  if config.loss == "robust":
    losses = (-(1 - eps) * jax.nn.log_sigmoid(h) + eps * jax.nn.log_sigmoid(-h)) / (1 - 2 * eps)
  else:
    losses = -(1 - eps) * jax.nn.log_sigmoid(h) - eps * jax.nn.log_sigmoid(-h)
  return losses, r_w, r_l


def token_logps(model, params, batch: dict, *, cfg, remat: bool = False):
  """log p(target) of every token of packed rows, 0 where `weights` is 0: float32 [batch,
  seq], through the model's own hidden states and `fs.cross_entropy` (per-token)."""
  x = model.hidden(params, batch["inputs"], remat=remat, cfg=cfg, rows=batch)
  out = model.output_layer(params)
  axes = (model.vocab_axes(x.shape, params["unembed"].shape[1]) if "unembed" in params
          else ("tensor",))
  where = batch["weights"] > 0
  nll = fs.cross_entropy(x, out.astype(x.dtype), batch["targets"], where=where,
                         reduction="none", vocab_axes=axes)
  return -nll


def pair_logps(logps, segment_ids, pairs: int):
  """(chosen, rejected, present): per-pair sums of `logps` [batch, seq] over segments 2k - 1
  and 2k, float32 [batch, pairs] each, and whether pair k is in the row (bool)."""
  onehot = (segment_ids[..., None] == jnp.arange(1, 2 * pairs + 1)).astype(jnp.float32)
  sums = jnp.einsum("bs,bsk->bk", logps.astype(jnp.float32), onehot)
  present = jnp.sum(onehot, axis=1)[:, 0::2] > 0
  return sums[:, 0::2], sums[:, 1::2], present


def pair_loss(logps, policy, reference, batch: dict, config: DPOConfig, remat: bool = False):
  """((sum of the batch's pairs' losses, pair count), aux) of `policy` params (bound LoRA
  params, `fnscale.lora.bind`) against `reference` params (the frozen base), their token
  log-probabilities by `logps(params, batch, remat=)` (`token_logps` of the model): aux
  {"chosen_reward", "rejected_reward", "reward_accuracy", "reward_margin"}, means over the
  batch's pairs."""
  pol = pair_logps(logps(policy, batch, remat=remat), batch["segment_ids"], config.pairs)
  ref = pair_logps(logps(reference, batch), batch["segment_ids"], config.pairs)
  losses, r_w, r_l = preference_loss(pol[0], pol[1], ref[0], ref[1], config)
  present = pol[2].astype(jnp.float32)
  n = jnp.sum(present)
  mean = lambda x: jnp.sum(x * present) / jnp.maximum(n, 1.0)
  aux = {"chosen_reward": mean(r_w), "rejected_reward": mean(r_l),
         "reward_accuracy": mean((r_w > r_l).astype(jnp.float32)),
         "reward_margin": mean(r_w - r_l)}
  return (jnp.sum(losses * present), n), aux


def loss_fn(model, lora: fs.lora.LoraConfig, config: DPOConfig, *, cfg):
  """The DPO train loss of a LoRA state, as `fnscale.train_step(..., weighted=True,
  has_aux=True)` calls it: `loss(adapters, batch, key=None, *, frozen, remat=False)` ->
  `pair_loss` of the adapted model against `frozen` (the base, without adapters)."""
  check(config)
  logps = functools.partial(token_logps, model, cfg=cfg)

  def loss(adapters, batch, key=None, *, frozen, remat: bool = False):
    return pair_loss(logps, fs.lora.bind(frozen, adapters, lora, key), frozen, batch, config,
                     remat=remat)
  return loss


def eval_loss_fn(model, config: DPOConfig, *, cfg):
  """`loss(bound, batch) -> (sum, count)`: `pair_loss` of bound LoRA params (`fnscale.lora.bind`)
  against their own base (each `LoraWeight` read as its frozen weight)."""
  base = lambda t: jax.tree.map(lambda x: x.w if isinstance(x, fs.lora.LoraWeight) else x, t,
                                is_leaf=lambda x: isinstance(x, fs.lora.LoraWeight))
  logps = functools.partial(token_logps, model, cfg=cfg)
  return lambda bound, batch: pair_loss(logps, bound, base(bound), batch, config)[0]
