"""What the Hugging Face families share: config.json fields read or refused with an
InputError naming the field (`need`, `error`), the RoPE settings (`rope`; `rope_fields` for
an export), the checks of a Llama-style config (`check_llama`) and the Llama's checkpoint map
(`llama_map`: the Llama, Mistral, Qwen and Gemma families', and the MoE families'
attention). Used by `hf_maps` and the families' modules."""
from __future__ import annotations

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.lm import layers, llama


def error(field: str, value, why: str) -> fs.InputError:
  """An InputError saying config.json's `field` = `value` and why it can't be read."""
  return fs.InputError(f"config.json: {field}={value!r} {why}")


def need(c: dict, field: str):
  """config.json's `field`; an InputError naming it when it is missing."""
  if c.get(field) is None:
    raise error(field, None, "is missing; fix: a complete Hugging Face config.json has it.")
  return c[field]


def rope(c: dict, default_theta: float = 10_000.0
         ) -> tuple[float, layers.RopeScaling | layers.Yarn | None]:
  """(theta, scaling) from `rope_theta` + `rope_scaling` (config.json as published) or
  `rope_parameters` (as transformers 5 writes it), read as transformers reads them."""
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or params
  theta = float(c.get("rope_theta") or params.get("rope_theta") or default_theta)
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if kind == "default":
    return theta, None
  if kind not in ("llama3", "yarn"):
    raise error("rope_scaling.rope_type", kind, "is not implemented: fnscale's models have "
                "'default', 'llama3' and 'yarn' RoPE; fix: pick a checkpoint with one of "
                "those, or add the frequency rule to recipes/lm/layers.py's rope_frequencies.")
  try:
    if kind == "yarn":
      return theta, _yarn(c, scaling)
    return theta, layers.RopeScaling(
        float(scaling["factor"]), float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
  except KeyError as e:
    needs = ("factor, original_max_position_embeddings (or max_position_embeddings)"
             if kind == "yarn" else "factor, low_freq_factor, high_freq_factor, "
             "original_max_position_embeddings")
    raise error(f"rope_scaling.{e.args[0]}", None, f"is missing: {kind} RoPE needs "
                f"{needs}.") from None


def _yarn(c: dict, s: dict) -> layers.Yarn:
  """YaRN's fields; as transformers: a top-level original_max_position_embeddings first, then
  the scaling's, then max_position_embeddings; no factor: max_position / original."""
  original = (c.get("original_max_position_embeddings")
              or s.get("original_max_position_embeddings") or c.get("max_position_embeddings"))
  if not original:
    raise KeyError("original_max_position_embeddings")
  factor = s.get("factor") or c.get("max_position_embeddings", 0) / original
  if not factor:
    raise KeyError("factor")
  return layers.Yarn(
      float(factor), int(original), float(s.get("beta_fast") or 32.0),
      float(s.get("beta_slow") or 1.0), float(s.get("mscale") or 0.0),
      float(s.get("mscale_all_dim") or 0.0), float(s.get("attention_factor") or 0.0),
      bool(s.get("truncate", True)))


def rope_fields(theta: float, scaling: layers.RopeScaling | layers.Yarn | None,
                seq: int) -> dict:
  """config.json's RoPE fields for an export (what `rope` reads back as the same): rope_theta,
  rope_scaling when scaled, and max_position_embeddings covering `seq` (and the scaled
  length: original x factor)."""
  out = dict(rope_theta=theta, max_position_embeddings=max(seq, 2048))
  if scaling is None:
    return out
  if isinstance(scaling, layers.Yarn):
    given = dict(mscale=scaling.mscale, mscale_all_dim=scaling.mscale_all_dim,
                 attention_factor=scaling.attention_factor)
    s = dict(rope_type="yarn", factor=scaling.factor, beta_fast=scaling.beta_fast,
             beta_slow=scaling.beta_slow, **{k: v for k, v in given.items() if v},
             **({} if scaling.truncate else {"truncate": False}))
  else:
    s = dict(rope_type="llama3", factor=scaling.factor,
             low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
  s["original_max_position_embeddings"] = scaling.original_max_position
  return dict(out, rope_scaling=s, max_position_embeddings=max(
      seq, int(scaling.original_max_position * scaling.factor)))


def check_llama(c: dict, seq: int) -> None:
  """InputError on a Llama-style config field the models can't compute."""
  kind = c["model_type"]
  if c.get("hidden_act", "silu") != "silu":
    raise error("hidden_act", c["hidden_act"], "is not silu, the SwiGLU activation "
                "fnscale's Llama computes.")
  if c.get("mlp_bias"):
    raise error("mlp_bias", True, "needs MLP biases, which fnscale's Llama doesn't have.")
  if c.get("attention_bias") and kind != "qwen2":
    raise error("attention_bias", True, "puts a bias on the attention output projection too, "
                "which fnscale's Llama doesn't have.")
  window = c.get("sliding_window")
  uses_window = c.get("use_sliding_window", kind == "mistral")
  if uses_window and window is not None and seq > window:
    raise error("sliding_window", window, f"is shorter than seq={seq}: fnscale's attention "
                f"sees the whole sequence; fix: --seq <= {window} (identical there).")


def llama_map(cfg: llama.ModelConfig) -> hf.CheckpointMap:
  """The Llama family's map: each param leaf's safetensors key and transform."""
  H, G, K = cfg.heads, cfg.kv_heads, cfg.head_dim
  layer = "model.layers.{layer}."
  T = lambda key, **kw: hf.Tensor(layer + key, **kw)
  # torch Linear weights are [out, in]; fnscale's are [in, ...out] with heads split.
  blocks = {
      "attn_norm": T("input_layernorm.weight"),
      "wq": T("self_attn.q_proj.weight", split=((H, K), None), perm=(2, 0, 1)),
      "wk": T("self_attn.k_proj.weight", split=((G, K), None), perm=(2, 0, 1)),
      "wv": T("self_attn.v_proj.weight", split=((G, K), None), perm=(2, 0, 1)),
      "wo": T("self_attn.o_proj.weight", split=(None, (H, K)), perm=(1, 2, 0)),
      "mlp_norm": T("post_attention_layernorm.weight"),
      "w_gate": T("mlp.gate_proj.weight", perm=(1, 0)),
      "w_up": T("mlp.up_proj.weight", perm=(1, 0)),
      "w_down": T("mlp.down_proj.weight", perm=(1, 0)),
  }
  if cfg.qkv_bias:
    blocks |= {f"b{n}": T(f"self_attn.{n}_proj.bias", split=((h, K),))
               for n, h in (("q", H), ("k", G), ("v", G))}
  if cfg.qk_norm:
    blocks |= {f"{n}_norm": T(f"self_attn.{n}_norm.weight") for n in ("q", "k")}
  if cfg.post_norms:  # Gemma's post_attention_layernorm follows attention, not precedes MLP
    blocks |= {"post_attn_norm": T("post_attention_layernorm.weight"),
               "mlp_norm": T("pre_feedforward_layernorm.weight"),
               "post_mlp_norm": T("post_feedforward_layernorm.weight")}
  tensors = {f"blocks/{k}": v for k, v in blocks.items()}
  tensors |= {"embed": hf.Tensor("model.embed_tokens.weight"),
              "final_norm": hf.Tensor("model.norm.weight")}
  if not cfg.tie_embeddings:  # tied: an lm_head.weight in the files is an error (unused)
    tensors["unembed"] = hf.Tensor("lm_head.weight", perm=(1, 0))
  return hf.CheckpointMap(tensors, ("*rotary_emb.inv_freq",))
