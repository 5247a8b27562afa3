"""What the Hugging Face families share: config.json fields read or refused with an
InputError naming the field (`need`, `error`), the RoPE settings (`rope`), the checks of a
Llama-style config (`check_llama`) and the Llama's checkpoint map (`llama_map`: the Llama,
Mistral, Qwen and Gemma families', and the MoE families' attention). Used by `hf_maps` and
the families' modules."""
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
         ) -> tuple[float, layers.RopeScaling | None]:
  """(theta, scaling) from `rope_theta` + `rope_scaling` (config.json as published) or
  `rope_parameters` (as transformers 5 writes it)."""
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or params
  theta = float(c.get("rope_theta") or params.get("rope_theta") or default_theta)
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise error("rope_scaling.rope_type", kind, "is not implemented: fnscale's models have "
                "'default' and 'llama3' RoPE; fix: pick a checkpoint with one of those, or "
                "add the frequency rule to recipes/lm/layers.py's rope_frequencies.")
  try:
    return theta, layers.RopeScaling(
        float(scaling["factor"]), float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
  except KeyError as e:
    raise error(f"rope_scaling.{e.args[0]}", None, "is missing: llama3 RoPE needs factor, "
                "low_freq_factor, high_freq_factor, original_max_position_embeddings.") from None


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
