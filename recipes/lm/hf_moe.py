"""Mixtral and Qwen3-MoE checkpoints (`model_type` mixtral, qwen3_moe) as `recipes/lm/moe.py`'s
model: config.json -> ModelConfig (`mixtral_config`, `qwen3_moe_config`), the map of the
router and experts' keys (`checkpoint_map`, over the Llama's attention map) and config.json
back for an export (`hf_config`)."""
from __future__ import annotations

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.lm import llama, moe
from recipes.lm.hf_fields import check_llama, error, llama_map, need, rope, rope_fields


def _checked(c: dict, seq: int) -> dict:
  """The RoPE fields of an MoE family's config (`rope_theta`, `rope_scaling`), after the
  checks both families share (a Llama's attention, an output layer of its own)."""
  check_llama(c, seq)
  if c.get("tie_word_embeddings"):
    raise error("tie_word_embeddings", True, "ties the output layer to the embedding; "
                "fnscale's MoE model has its own output layer.")
  return dict(zip(("rope_theta", "rope_scaling"), rope(c)))


def mixtral_config(c: dict, seq: int) -> moe.ModelConfig:
  """Mixtral as `moe.py`'s model: Llama attention, top-k routed SwiGLU experts with their
  weights renormalised (transformers' MixtralTopKRouter). HF's load-balance loss is k times
  fnscale's (it counts each token's k copies over tokens, not over copies), so
  `router_aux_loss_coef` x k weighs the same loss. Router jitter (training noise) is not
  applied."""
  rope_cfg = _checked(c, seq)
  d, heads = need(c, "hidden_size"), need(c, "num_attention_heads")
  if (c.get("head_dim") or d // heads) != d // heads:
    raise error("head_dim", c["head_dim"], f"is not hidden_size / num_attention_heads = "
                f"{d // heads}, the head size fnscale's MoE model has.")
  k = need(c, "num_experts_per_tok")
  return moe.ModelConfig(
      layers=need(c, "num_hidden_layers"), d_model=d, heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_ff=need(c, "intermediate_size"),
      experts=need(c, "num_local_experts"), k=k, seq=seq, vocab=need(c, "vocab_size"),
      balance_coef=float(c.get("router_aux_loss_coef", 0.0)) * k, **rope_cfg,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def qwen3_moe_config(c: dict, seq: int) -> moe.ModelConfig:
  """Qwen3-MoE as `moe.py`'s model: Qwen3's attention (q/k RMSNorm per head, its own head
  size), top-k of the softmax over experts, renormalised when `norm_topk_prob`
  (transformers' Qwen3MoeSparseMoeBlock). Every layer must be an MoE layer (the model has no
  dense ones) and the load-balance coefficient is HF's x k (as Mixtral's)."""
  rope_cfg = _checked(c, seq)
  if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
    field = "mlp_only_layers" if c.get("mlp_only_layers") else "decoder_sparse_step"
    raise error(field, c.get(field), "makes some layers dense MLPs; fnscale's MoE model "
                "routes every layer (decoder_sparse_step=1, mlp_only_layers=[]).")
  d, heads, k = need(c, "hidden_size"), need(c, "num_attention_heads"), need(
      c, "num_experts_per_tok")
  head_dim = c.get("head_dim") or d // heads
  return moe.ModelConfig(
      layers=need(c, "num_hidden_layers"), d_model=d, heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_ff=need(c, "moe_intermediate_size"),
      # The Hub's config.json says num_experts; transformers 5 writes num_local_experts.
      experts=need(c, "num_experts" if "num_local_experts" not in c else "num_local_experts"),
      k=k, seq=seq, vocab=need(c, "vocab_size"), normalize=bool(c.get("norm_topk_prob", False)),
      balance_coef=float(c.get("router_aux_loss_coef", 0.0)) * k, **rope_cfg,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      head_size=0 if head_dim == d // heads else head_dim, qk_norm=True)


def family(m) -> str:
  """The family of an MoE model: its config.json's, else Qwen3-MoE's where the model has
  Qwen3's q/k norms, Mixtral's where not."""
  return m.config.get("model_type") or ("qwen3_moe" if m.cfg.qk_norm else "mixtral")


# An MoE family's router and experts: (the MLP's key, the router's, the experts' gate, up and
# down projections), each torch [out, in].
_MOE_KEYS = {"mixtral": ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
             "qwen3_moe": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")}


def checkpoint_map(cfg: moe.ModelConfig, kind: str) -> hf.CheckpointMap:
  """Llama's attention and norms (Qwen3's q/k norms where the model has them); the router
  ([experts, d]) and each expert's gate, up and down projections, stacked [layers,
  experts]."""
  attention = llama_map(llama.ModelConfig(
      cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.d_ff, cfg.seq, cfg.vocab,
      head_size=cfg.head_size, qk_norm=cfg.qk_norm))
  mlp, router, gate, up, down = _MOE_KEYS[kind]
  moe_key = "model.layers.{layer}." + mlp
  expert = moe_key + "experts.{expert}."
  tensors = {k: v for k, v in attention.tensors.items()
             if k not in ("blocks/w_gate", "blocks/w_up", "blocks/w_down")}
  tensors.update({
      "blocks/router": hf.Tensor(moe_key + router + ".weight", perm=(1, 0)),
      "blocks/w_gate": hf.Tensor(expert + gate + ".weight", perm=(1, 0)),
      "blocks/w_up": hf.Tensor(expert + up + ".weight", perm=(1, 0)),
      "blocks/w_down": hf.Tensor(expert + down + ".weight", perm=(1, 0))})
  return hf.CheckpointMap(tensors, attention.ignore)


def hf_config(cfg: moe.ModelConfig) -> dict:
  """config.json of an MoE model trained here (`moe.py`, no shared experts, no capacity):
  Qwen3-MoE's where the model has Qwen3's q/k norms (its routing weights renormalised or
  not), else Mixtral's (renormalised: what MixtralForCausalLM computes)."""
  family = "Qwen3-MoE" if cfg.qk_norm else "Mixtral"
  if cfg.shared or cfg.capacity_factor is not None or not (cfg.normalize or cfg.qk_norm):
    raise fs.InputError(
        f"export: a {family} config.json can't say shared experts, a capacity"
        f"{'' if cfg.qk_norm else ' or unnormalised routing weights'} (shared={cfg.shared}, "
        f"normalize={cfg.normalize}, capacity_factor={cfg.capacity_factor}); fix: export a "
        "Mixtral- or Qwen3-MoE-style model.")
  common = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                num_experts_per_tok=cfg.k, vocab_size=cfg.vocab, hidden_act="silu",
                rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                router_aux_loss_coef=cfg.balance_coef / cfg.k, sliding_window=None,
                **rope_fields(cfg.rope_theta, cfg.rope_scaling, cfg.seq))
  if cfg.qk_norm:
    return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                head_dim=cfg.head_dim, moe_intermediate_size=cfg.d_ff,
                intermediate_size=cfg.d_ff, num_experts=cfg.experts,
                norm_topk_prob=cfg.normalize, decoder_sparse_step=1, mlp_only_layers=[],
                attention_bias=False, use_sliding_window=False)
  return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
              intermediate_size=cfg.d_ff, num_local_experts=cfg.experts,
              router_jitter_noise=0.0)
