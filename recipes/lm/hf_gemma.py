"""Gemma 2 and Gemma 3 text checkpoints (`model_type` gemma2, gemma3_text) as the Llama's
Gemma options (`recipes/lm/llama.py`): config.json -> ModelConfig (`config`) and back for an
export (`hf_config`); the params' names are the Llama's (`hf_maps`) with Gemma's norms."""
from __future__ import annotations

import fnscale as fs
from recipes.lm import llama
from recipes.lm.hf_fields import error, need, rope


HINTS = {
    "gemma": " (Gemma 1: not read; Gemma 2 and 3 are)",
    "gemma3": " (a multimodal Gemma 3: its text model's config, model_type gemma3_text, as "
              "gemma-3-1b has, is read; the vision tower is not)"}



def config(c: dict, seq: int) -> llama.ModelConfig:
  """Gemma 2 / Gemma 3 text as the Llama's Gemma options; fields a config.json leaves out
  take transformers' defaults for its model_type (Gemma 2: logits capped at 50 and 30)."""
  gemma2 = c["model_type"] == "gemma2"
  act = c.get("hidden_activation", "gelu_pytorch_tanh")
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    raise error("hidden_activation", act, "is not GELU's tanh approximation "
                "(gelu_pytorch_tanh), the GeGLU fnscale's Gemma computes.")
  for field in ("attention_bias", "use_bidirectional_attention"):
    if c.get(field):
      raise error(field, c[field], "is not in fnscale's Gemma (causal attention, no biases); "
                  "fix: a decoder checkpoint without it.")
  L, heads = need(c, "num_hidden_layers"), need(c, "num_attention_heads")
  kinds = c.get("layer_types") or [
      "sliding_attention" if (i + 1) % (2 if gemma2 else c.get("sliding_window_pattern", 6))
      else "full_attention" for i in range(L)]
  if len(kinds) != L or set(kinds) - {"sliding_attention", "full_attention"}:
    raise error("layer_types", kinds, f"is not {L} of 'sliding_attention' and "
                "'full_attention' (one per layer).")
  window = c.get("sliding_window")
  if "sliding_attention" in kinds and (not isinstance(window, int) or window < 1):
    raise error("sliding_window", window, "is not a positive int, and layer_types has "
                "sliding_attention layers.")
  by_kind = c.get("rope_parameters") or {}
  nested = "full_attention" in by_kind or "sliding_attention" in by_kind
  theta, scaling = rope({"rope_parameters": by_kind.get("full_attention")} if nested else c,
                         10_000.0 if gemma2 else 1_000_000.0)
  local = (by_kind.get("sliding_attention") or {}) if nested else {}
  if local.get("rope_type", "default") != "default":
    raise error("rope_parameters.sliding_attention.rope_type", local["rope_type"],
                "is not 'default', the plain RoPE fnscale's local layers have.")
  local_theta = 0.0 if gemma2 else float(
      local.get("rope_theta") or c.get("rope_local_base_freq") or 10_000.0)
  caps = {f: c.get(f, default if gemma2 else None) for f, default in (
      ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
  return llama.ModelConfig(
      layers=L, d_model=need(c, "hidden_size"), heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_mlp=need(c, "intermediate_size"),
      seq=seq, vocab=need(c, "vocab_size"), rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)), head_size=c.get("head_dim") or 256,
      tie_embeddings=bool(c.get("tie_word_embeddings", True)), qk_norm=not gemma2,
      norm_plus_one=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
      attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
      attn_soft_cap=float(caps["attn_logit_softcapping"] or 0.0),
      logit_soft_cap=float(caps["final_logit_softcapping"] or 0.0),
      windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
      local_rope_theta=local_theta)


OPTIONS = ("activation", "embed_scale", "attn_scale", "attn_soft_cap", "logit_soft_cap",
                  "local_rope_theta")


def hf_config(cfg: llama.ModelConfig) -> dict:
  """config.json of a Gemma 2 (no q/k norm) or Gemma 3 text model (q/k norm) trained here."""
  wanted = dict(norm_plus_one=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
                qkv_bias=False, rope_scaling=None)
  for field, value in wanted.items():
    if getattr(cfg, field) != value:
      raise fs.InputError(f"export: ModelConfig.{field}={getattr(cfg, field)!r}, not "
                          f"Gemma's {value!r}; a Gemma config.json can't say it. Fix: export "
                          "a model with all of Gemma's options.")
  windows = cfg.windows or (0,) * cfg.layers
  if len(set(w for w in windows if w)) > 1:
    raise fs.InputError(f"export: ModelConfig.windows={windows} has several window sizes; "
                        "a Gemma config.json has one sliding_window.")
  kind = "gemma3_text" if cfg.qk_norm else "gemma2"
  if kind == "gemma2" and cfg.local_rope_theta not in (0.0, cfg.rope_theta):
    raise fs.InputError(f"export: ModelConfig.local_rope_theta={cfg.local_rope_theta} in a "
                        "model without q/k norm (Gemma 2): its config.json has one RoPE base; "
                        "fix: local_rope_theta=0, or qk_norm (Gemma 3).")
  scalar = (cfg.attn_scale or cfg.head_dim ** -0.5) ** -2
  out = dict(architectures=["Gemma3ForCausalLM" if cfg.qk_norm else "Gemma2ForCausalLM"],
             model_type=kind, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
             num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
             intermediate_size=cfg.d_mlp, head_dim=cfg.head_dim, vocab_size=cfg.vocab,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=cfg.norm_eps,
             max_position_embeddings=max(cfg.seq, 2048),
             tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
             query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6
             else scalar,
             attn_logit_softcapping=cfg.attn_soft_cap or None,
             final_logit_softcapping=cfg.logit_soft_cap or None,
             sliding_window=max(windows) or None,
             layer_types=["sliding_attention" if w else "full_attention" for w in windows])
  default = dict(rope_type="default", rope_theta=cfg.rope_theta)
  if kind == "gemma2":
    return {**out, "rope_parameters": default}
  local = dict(rope_type="default", rope_theta=cfg.local_rope_theta or cfg.rope_theta)
  return {**out, "rope_parameters": {"full_attention": default, "sliding_attention": local}}
