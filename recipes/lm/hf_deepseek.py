"""DeepSeek-V3 checkpoints (`model_type` "deepseek_v3") as `recipes/lm/deepseek.py`'s model:
config.json -> ModelConfig, the map from each param leaf to its safetensors key, and
config.json back for an export (`hf_maps` dispatches here).

The first `first_k_dense_replace` layers are the model's `dense` stack, the rest its
`blocks` (their keys start at that layer: `hf.Tensor.first`); each expert's projections
are one key each (`mlp.experts.{expert}.*`, the Hub's layout, which transformers writes too);
the router's `e_score_correction_bias` is the selection bias `router_bias`. The
multi-token-prediction layers a published checkpoint carries past `num_hidden_layers`
(`num_nextn_predict_layers`) are not part of the model and are left unread.
"""
from __future__ import annotations

from fnscale.checkpoint import hf
from recipes.lm import deepseek
from recipes.lm.hf_fields import error, need, rope, rope_fields


def config(c: dict, seq: int) -> deepseek.ModelConfig:
  """The model of a deepseek_v3 config.json `c` for sequences of `seq`. Raises InputError
  naming a field the model can't compute."""
  heads = need(c, "num_attention_heads")
  checks = (("hidden_act", c.get("hidden_act", "silu"), ("silu",)),
            ("attention_bias", bool(c.get("attention_bias")), (False,)),
            ("tie_word_embeddings", bool(c.get("tie_word_embeddings")), (False,)),
            ("scoring_func", c.get("scoring_func", "sigmoid"), ("sigmoid",)),
            ("num_key_value_heads", c.get("num_key_value_heads") or heads, (heads,)))
  for field, value, ok in checks:
    if value not in ok:
      raise error(field, value, f"is not {ok[0]!r}, what fnscale's DeepSeek model computes.")
  theta, scaling = rope(c)
  experts = need(c, "n_routed_experts" if "num_local_experts" not in c else
                 "num_local_experts")  # the Hub says n_routed_experts; transformers 5 both
  return deepseek.ModelConfig(
      layers=need(c, "num_hidden_layers"), dense_layers=int(c.get("first_k_dense_replace", 0)),
      d_model=need(c, "hidden_size"), heads=heads, kv_lora=need(c, "kv_lora_rank"),
      nope=need(c, "qk_nope_head_dim"), rope_dim=need(c, "qk_rope_head_dim"),
      v_dim=need(c, "v_head_dim"), d_mlp=need(c, "intermediate_size"),
      d_ff=need(c, "moe_intermediate_size"), experts=experts,
      k=need(c, "num_experts_per_tok"), seq=seq, vocab=need(c, "vocab_size"),
      q_lora=c.get("q_lora_rank") or 0, shared=int(c.get("n_shared_experts") or 0),
      groups=int(c.get("n_group") or 1), topk_groups=int(c.get("topk_group") or 0),
      routed_scale=float(c.get("routed_scaling_factor", 1.0)),
      normalize=bool(c.get("norm_topk_prob", True)), rope_theta=theta, rope_scaling=scaling,
      rope_interleave=bool(c.get("rope_interleave", True)),
      norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def _attention(cfg: deepseek.ModelConfig, layer: str, first: int) -> dict:
  """An attention stack's tensors (torch Linear weights [out, in] -> fnscale's [in, ...out])."""
  H, K = cfg.heads, cfg.head_dim
  T = lambda key, **kw: hf.Tensor(layer + key, first=(first,), **kw)
  q = ({"wq_a": T("self_attn.q_a_proj.weight", perm=(1, 0)),
        "q_norm": T("self_attn.q_a_layernorm.weight"),
        "wq_b": T("self_attn.q_b_proj.weight", split=((H, K), None), perm=(2, 0, 1))}
       if cfg.q_lora else
       {"wq": T("self_attn.q_proj.weight", split=((H, K), None), perm=(2, 0, 1))})
  return {"attn_norm": T("input_layernorm.weight"), **q,
          "wkv_a": T("self_attn.kv_a_proj_with_mqa.weight", perm=(1, 0)),
          "kv_norm": T("self_attn.kv_a_layernorm.weight"),
          "wkv_b": T("self_attn.kv_b_proj.weight", split=((H, cfg.nope + cfg.v_dim), None),
                     perm=(2, 0, 1)),
          "wo": T("self_attn.o_proj.weight", split=(None, (H, cfg.v_dim)), perm=(1, 2, 0)),
          "mlp_norm": T("post_attention_layernorm.weight")}


def checkpoint_map(cfg: deepseek.ModelConfig, path=None) -> hf.CheckpointMap:
  """The map between the model's params and a DeepSeek-V3 checkpoint's keys; with `path`
  (the checkpoint directory, or its `hf.Index`), the keys of the layers it holds past the
  model's (multi-token prediction) are ignored."""
  mtp_layers = 0
  if path is not None:
    index = path if isinstance(path, hf.Index) else hf.read_index(path)
    held = {int(k.split(".")[2]) for k in index.tensors if k.startswith("model.layers.")}
    mtp_layers = len([i for i in held if i >= cfg.layers])
  layer, n = "model.layers.{layer}.", cfg.dense_layers
  mlp = lambda key, first: hf.Tensor(layer + key, perm=(1, 0), first=first)
  moe = {"router": mlp("mlp.gate.weight", (n,)),
         "router_bias": hf.Tensor(layer + "mlp.gate.e_score_correction_bias", first=(n,)),
         **{f"w_{p}": mlp(f"mlp.experts.{{expert}}.{p}_proj.weight", (n, 0))
            for p in ("gate", "up", "down")},
         **{f"shared_{p}": mlp(f"mlp.shared_experts.{p}_proj.weight", (n,))
            for p in ("gate", "up", "down") if cfg.shared}}
  tensors = {"embed": hf.Tensor("model.embed_tokens.weight"),
             "final_norm": hf.Tensor("model.norm.weight"),
             "unembed": hf.Tensor("lm_head.weight", perm=(1, 0)),
             **{f"blocks/{k}": v for k, v in (_attention(cfg, layer, n) | moe).items()}}
  if n:
    dense = {f"w_{p}": mlp(f"mlp.{p}_proj.weight", (0,)) for p in ("gate", "up", "down")}
    tensors |= {f"dense/{k}": v for k, v in (_attention(cfg, layer, 0) | dense).items()}
  mtp = tuple(f"model.layers.{i}.*" for i in range(cfg.layers, cfg.layers + mtp_layers))
  return hf.CheckpointMap(tensors, ("*rotary_emb.inv_freq",) + mtp)


def hf_config(cfg: deepseek.ModelConfig) -> dict:
  """config.json of a DeepSeek-V3-style model trained here (what DeepseekV3ForCausalLM
  computes with it)."""
  out = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
             hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
             first_k_dense_replace=cfg.dense_layers, num_attention_heads=cfg.heads,
             num_key_value_heads=cfg.heads, q_lora_rank=cfg.q_lora or None,
             kv_lora_rank=cfg.kv_lora, qk_nope_head_dim=cfg.nope,
             qk_rope_head_dim=cfg.rope_dim, v_head_dim=cfg.v_dim,
             intermediate_size=cfg.d_mlp, moe_intermediate_size=cfg.d_ff,
             n_routed_experts=cfg.experts, num_experts_per_tok=cfg.k,
             n_shared_experts=cfg.shared, n_group=cfg.groups,
             topk_group=cfg.topk_groups or cfg.groups, routed_scaling_factor=cfg.routed_scale,
             norm_topk_prob=cfg.normalize, vocab_size=cfg.vocab, hidden_act="silu",
             rms_norm_eps=cfg.norm_eps, rope_interleave=cfg.rope_interleave,
             tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0)
  return out | rope_fields(cfg.rope_theta, cfg.rope_scaling, cfg.seq)
