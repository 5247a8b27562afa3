"""Hugging Face model families as fnscale's models: config.json -> ModelConfig, the map from
each param leaf to its safetensors key and transform, and config.json back for an export.

  m = hf_maps.read("path/to/Llama-3.2-1B", seq=2048)    # HFModel(model, cfg, config)
  abstract = fs.init_state(functools.partial(m.model.init_params, m.cfg), opt, mesh=mesh,
                           rules=m.model.RULES, logical_axes=m.model.logical_axes(m.cfg),
                           key=jax.random.key(0), abstract=True)
  params = fs.checkpoint.hf.load(path, abstract.params, hf_maps.checkpoint_map(m, path))

Families (`model_type`): llama (Llama 2/3/3.1/3.2: plain or "llama3" RoPE, tied or untied
embeddings), mistral, qwen2 (Qwen2/2.5: q/k/v biases), qwen3 (per-head q/k RMSNorm) into
`llama.py`; gemma2 (Gemma 2: attention and final logit soft-capping, sliding-window layers
alternating with global ones) and gemma3_text (Gemma 3's text models: q/k RMSNorm, five
sliding-window layers to one global, a RoPE base of their own for the local layers) into
`llama.py` too, as its Gemma options (GeGLU, RMSNorm by (1 + weight) before and after
attention and the MLP, the embedding scaled by sqrt(d_model), tied embeddings); gpt2 into
`gpt.py`. Anything a config asks that these models can't compute (a RoPE type, an
activation, biases elsewhere, a sliding window shorter than the sequence where the model has
none) is an InputError naming the config.json field, never a silently different model. mixtral
(Mixtral's routed experts) into `moe.py`: its experts' weights are one leaf each per
projection, [layers, experts, ...], read from `{layer}` and `{expert}` keys.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, NamedTuple

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.lm import gpt, layers, llama, moe

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
GEMMA_FAMILY = ("gemma2", "gemma3_text")
FAMILIES = LLAMA_FAMILY + GEMMA_FAMILY + ("gpt2", "mixtral")
_GEMMA_HINTS = {
    "gemma": " (Gemma 1: not read; Gemma 2 and 3 are)",
    "gemma3": " (a multimodal Gemma 3: its text model's config, model_type gemma3_text, as "
              "gemma-3-1b has, is read; the vision tower is not)"}


class HFModel(NamedTuple):
  """A Hugging Face model as fnscale's: the model module, its config, the config.json read."""
  model: ModuleType  # recipes.lm.llama or recipes.lm.gpt
  cfg: Any  # the module's ModelConfig
  config: dict  # config.json as read (the base of an exported config.json)


def apply_fn(m: HFModel):
  """`apply(params, tokens, *, remat=False)` -> float32 logits [batch, seq, vocab] of `m`
  (the model's `apply` with its config: RoPE and RMSNorm settings)."""
  return functools.partial(m.model.apply, cfg=m.cfg)


def _error(field: str, value, why: str) -> fs.InputError:
  return fs.InputError(f"config.json: {field}={value!r} {why}")


def _need(c: dict, field: str):
  if c.get(field) is None:
    raise _error(field, None, "is missing; fix: a complete Hugging Face config.json has it.")
  return c[field]


def read(path, seq: int) -> HFModel:
  """The model of the Hugging Face directory `path` (its config.json) for sequences of `seq`.

  Raises:
    InputError: a config the models can't express (the field named), a bad seq.
    CheckpointError: no config.json.
  """
  return from_config(hf.read_config(path), seq)


def from_config(c: dict, seq: int) -> HFModel:
  """`read` for a config.json already read (a dict)."""
  if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
    raise fs.InputError(f"seq={seq!r}, expected an int >= 1")
  kind = c.get("model_type")
  if c.get("quantization_config"):
    raise _error("quantization_config", "...", "is set: quantized weights are not read; fix: "
                 "start from the unquantized checkpoint.")
  if kind in LLAMA_FAMILY:
    return HFModel(llama, _llama_config(c, seq), dict(c))
  if kind in GEMMA_FAMILY:
    return HFModel(llama, _gemma_config(c, seq), dict(c))
  if kind == "gpt2":
    return HFModel(gpt, _gpt2_config(c, seq), dict(c))
  if kind == "mixtral":
    return HFModel(moe, _mixtral_config(c, seq), dict(c))
  hint = (" (experts: only Mixtral's are in fnscale's models)" if kind in (
      "qwen2_moe", "qwen3_moe") else _GEMMA_HINTS.get(kind, ""))
  raise _error("model_type", kind, f"is not a family fnscale reads{hint}; expected one of "
               f"{list(FAMILIES)}.")


def _rope(c: dict, default_theta: float = 10_000.0) -> tuple[float, layers.RopeScaling | None]:
  """(theta, scaling) from `rope_theta` + `rope_scaling` (config.json as published) or
  `rope_parameters` (as transformers 5 writes it)."""
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or params
  theta = float(c.get("rope_theta") or params.get("rope_theta") or default_theta)
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise _error("rope_scaling.rope_type", kind, "is not implemented: fnscale's Llama has "
                 "'default' and 'llama3' RoPE; fix: pick a checkpoint with one of those, or "
                 "add the frequency rule to recipes/lm/layers.py's rope_frequencies.")
  try:
    return theta, layers.RopeScaling(
        float(scaling["factor"]), float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
  except KeyError as e:
    raise _error(f"rope_scaling.{e.args[0]}", None, "is missing: llama3 RoPE needs factor, "
                 "low_freq_factor, high_freq_factor, original_max_position_embeddings.") from None


def _check_llama(c: dict, seq: int) -> None:
  kind = c["model_type"]
  if c.get("hidden_act", "silu") != "silu":
    raise _error("hidden_act", c["hidden_act"], "is not silu, the SwiGLU activation "
                 "fnscale's Llama computes.")
  if c.get("mlp_bias"):
    raise _error("mlp_bias", True, "needs MLP biases, which fnscale's Llama doesn't have.")
  if c.get("attention_bias") and kind != "qwen2":
    raise _error("attention_bias", True, "puts a bias on the attention output projection too, "
                 "which fnscale's Llama doesn't have.")
  window = c.get("sliding_window")
  uses_window = c.get("use_sliding_window", kind == "mistral")
  if uses_window and window is not None and seq > window:
    raise _error("sliding_window", window, f"is shorter than seq={seq}: fnscale's attention "
                 f"sees the whole sequence; fix: --seq <= {window} (identical there).")


def _llama_config(c: dict, seq: int) -> llama.ModelConfig:
  _check_llama(c, seq)
  d, heads = _need(c, "hidden_size"), _need(c, "num_attention_heads")
  head_dim = c.get("head_dim") or d // heads
  theta, scaling = _rope(c)
  return llama.ModelConfig(
      layers=_need(c, "num_hidden_layers"), d_model=d, heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_mlp=_need(c, "intermediate_size"),
      seq=seq, vocab=_need(c, "vocab_size"), rope_theta=theta,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      head_size=0 if head_dim == d // heads else head_dim, rope_scaling=scaling,
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      qkv_bias=c["model_type"] == "qwen2", qk_norm=c["model_type"] == "qwen3")


def _gemma_config(c: dict, seq: int) -> llama.ModelConfig:
  """Gemma 2 / Gemma 3 text as the Llama's Gemma options; fields a config.json leaves out
  take transformers' defaults for its model_type (Gemma 2: logits capped at 50 and 30)."""
  gemma2 = c["model_type"] == "gemma2"
  act = c.get("hidden_activation", "gelu_pytorch_tanh")
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    raise _error("hidden_activation", act, "is not GELU's tanh approximation "
                 "(gelu_pytorch_tanh), the GeGLU fnscale's Gemma computes.")
  for field in ("attention_bias", "use_bidirectional_attention"):
    if c.get(field):
      raise _error(field, c[field], "is not in fnscale's Gemma (causal attention, no biases); "
                   "fix: a decoder checkpoint without it.")
  L, heads = _need(c, "num_hidden_layers"), _need(c, "num_attention_heads")
  kinds = c.get("layer_types") or [
      "sliding_attention" if (i + 1) % (2 if gemma2 else c.get("sliding_window_pattern", 6))
      else "full_attention" for i in range(L)]
  if len(kinds) != L or set(kinds) - {"sliding_attention", "full_attention"}:
    raise _error("layer_types", kinds, f"is not {L} of 'sliding_attention' and "
                 "'full_attention' (one per layer).")
  window = c.get("sliding_window")
  if "sliding_attention" in kinds and (not isinstance(window, int) or window < 1):
    raise _error("sliding_window", window, "is not a positive int, and layer_types has "
                 "sliding_attention layers.")
  rope = c.get("rope_parameters") or {}
  nested = "full_attention" in rope or "sliding_attention" in rope
  theta, scaling = _rope({"rope_parameters": rope.get("full_attention")} if nested else c,
                         10_000.0 if gemma2 else 1_000_000.0)
  local = (rope.get("sliding_attention") or {}) if nested else {}
  if local.get("rope_type", "default") != "default":
    raise _error("rope_parameters.sliding_attention.rope_type", local["rope_type"],
                 "is not 'default', the plain RoPE fnscale's local layers have.")
  local_theta = 0.0 if gemma2 else float(
      local.get("rope_theta") or c.get("rope_local_base_freq") or 10_000.0)
  caps = {f: c.get(f, default if gemma2 else None) for f, default in (
      ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
  return llama.ModelConfig(
      layers=L, d_model=_need(c, "hidden_size"), heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_mlp=_need(c, "intermediate_size"),
      seq=seq, vocab=_need(c, "vocab_size"), rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)), head_size=c.get("head_dim") or 256,
      tie_embeddings=bool(c.get("tie_word_embeddings", True)), qk_norm=not gemma2,
      norm_plus_one=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
      attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
      attn_soft_cap=float(caps["attn_logit_softcapping"] or 0.0),
      logit_soft_cap=float(caps["final_logit_softcapping"] or 0.0),
      windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
      local_rope_theta=local_theta)


def _mixtral_config(c: dict, seq: int) -> moe.ModelConfig:
  """Mixtral as `moe.py`'s model: Llama attention, top-k routed SwiGLU experts with their
  weights renormalised (transformers' MixtralTopKRouter). HF's load-balance loss is k times
  fnscale's (it counts each token's k copies over tokens, not over copies), so
  `router_aux_loss_coef` x k weighs the same loss. Router jitter (training noise) is not
  applied."""
  _check_llama(c, seq)
  d, heads = _need(c, "hidden_size"), _need(c, "num_attention_heads")
  if (c.get("head_dim") or d // heads) != d // heads:
    raise _error("head_dim", c["head_dim"], f"is not hidden_size / num_attention_heads = "
                 f"{d // heads}, the head size fnscale's MoE model has.")
  if c.get("tie_word_embeddings"):
    raise _error("tie_word_embeddings", True, "ties the output layer to the embedding; "
                 "fnscale's MoE model has its own output layer.")
  theta, scaling = _rope(c)
  if scaling is not None:
    raise _error("rope_scaling", "llama3", "is not in fnscale's MoE model (plain RoPE).")
  k = _need(c, "num_experts_per_tok")
  return moe.ModelConfig(
      layers=_need(c, "num_hidden_layers"), d_model=d, heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_ff=_need(c, "intermediate_size"),
      experts=_need(c, "num_local_experts"), k=k, seq=seq, vocab=_need(c, "vocab_size"),
      balance_coef=float(c.get("router_aux_loss_coef", 0.0)) * k, rope_theta=theta,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def _gpt2_config(c: dict, seq: int) -> gpt.ModelConfig:
  d = _need(c, "n_embd")
  checks = (("activation_function", c.get("activation_function", "gelu_new"),
             ("gelu_new", "gelu_pytorch_tanh"), "GELU's tanh form, what fnscale's GPT computes"),
            ("n_inner", c.get("n_inner") or 4 * d, (4 * d,), "an MLP of 4 x n_embd"),
            ("layer_norm_epsilon", c.get("layer_norm_epsilon", 1e-5), (1e-5,), "1e-5"),
            ("scale_attn_by_inverse_layer_idx", c.get("scale_attn_by_inverse_layer_idx", False),
             (False,), "off"),
            ("tie_word_embeddings", c.get("tie_word_embeddings", True), (True,), "tied"))
  for field, value, ok, what in checks:
    if value not in ok:
      raise _error(field, value, f"is not {what}; fnscale's GPT can't express it.")
  positions = _need(c, "n_positions")
  if seq > positions:
    raise fs.InputError(f"seq={seq} is longer than config.json's n_positions={positions} "
                        "(GPT-2 has a learned position per token); fix: a shorter --seq.")
  return gpt.ModelConfig(layers=_need(c, "n_layer"), d_model=d, heads=_need(c, "n_head"),
                         seq=seq, vocab=_need(c, "vocab_size"), positions=positions)


# ------------------------------------------------------------------------------------------
# Checkpoint maps: fnscale leaf path -> safetensors key and transform


def checkpoint_map(m: HFModel, path=None) -> hf.CheckpointMap:
  """The map between `m`'s params and its Hugging Face checkpoint's keys; `path` (the
  checkpoint directory, or its `hf.Index`) lets GPT-2 find whether its keys carry the
  "transformer." prefix (the original checkpoints don't)."""
  if m.model is gpt:
    return _gpt2_map(m.cfg, _gpt2_prefix(path))
  if m.model is moe:
    return _mixtral_map(m.cfg)
  return _llama_map(m.cfg)


def _llama_map(cfg: llama.ModelConfig) -> hf.CheckpointMap:
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


def _mixtral_map(cfg: moe.ModelConfig) -> hf.CheckpointMap:
  """Llama's attention and norms; the router (`block_sparse_moe.gate`, [experts, d]) and each
  expert's w1 (gate), w3 (up) and w2 (down), torch [out, in], stacked [layers, experts]."""
  attention = _llama_map(llama.ModelConfig(cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads,
                                           cfg.d_ff, cfg.seq, cfg.vocab))
  moe_key = "model.layers.{layer}.block_sparse_moe."
  expert = moe_key + "experts.{expert}."
  tensors = {k: v for k, v in attention.tensors.items()
             if k not in ("blocks/w_gate", "blocks/w_up", "blocks/w_down")}
  tensors.update({
      "blocks/router": hf.Tensor(moe_key + "gate.weight", perm=(1, 0)),
      "blocks/w_gate": hf.Tensor(expert + "w1.weight", perm=(1, 0)),
      "blocks/w_up": hf.Tensor(expert + "w3.weight", perm=(1, 0)),
      "blocks/w_down": hf.Tensor(expert + "w2.weight", perm=(1, 0))})
  return hf.CheckpointMap(tensors, attention.ignore)


def _gpt2_prefix(path) -> str:
  if path is None:
    return "transformer."
  index = path if isinstance(path, hf.Index) else hf.read_index(path)
  return "" if "wte.weight" in index.tensors else "transformer."


def _gpt2_map(cfg: gpt.ModelConfig, prefix: str = "transformer.") -> hf.CheckpointMap:
  H, K = cfg.heads, cfg.head_dim
  T = lambda key, **kw: hf.Tensor(prefix + key, **kw)
  ln = lambda name: {"scale": T(name + ".weight"), "bias": T(name + ".bias")}
  # GPT-2's Conv1D weights are already [in, out]; c_attn's out is [3 (q, k, v), heads, dim].
  tensors = {"wte": T("wte.weight"), "wpe": T("wpe.weight"), "ln_f": ln("ln_f")}
  h = "h.{layer}."
  blocks = {
      "ln1": ln(h + "ln_1"), "ln2": ln(h + "ln_2"),
      "attn": {"w_qkv": T(h + "attn.c_attn.weight", split=(None, (3, H, K))),
               "b_qkv": T(h + "attn.c_attn.bias", split=((3, H, K),)),
               "w_out": T(h + "attn.c_proj.weight", split=((H, K), None)),
               "b_out": T(h + "attn.c_proj.bias")},
      "mlp": {"w_fc": T(h + "mlp.c_fc.weight"), "b_fc": T(h + "mlp.c_fc.bias"),
              "w_proj": T(h + "mlp.c_proj.weight"), "b_proj": T(h + "mlp.c_proj.bias")},
  }
  flat = dict(_flatten({**tensors, "blocks": blocks}))
  # The causal-mask buffers the original GPT-2 checkpoints store (no params).
  return hf.CheckpointMap(flat, ("*attn.bias", "*attn.masked_bias"))


def _flatten(tree: dict, prefix: str = ""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, f"{prefix}{k}/")
    else:
      yield f"{prefix}{k}", v


# ------------------------------------------------------------------------------------------
# config.json for an export


def to_config(m: HFModel) -> dict:
  """config.json for `m`'s params: the config it was read from (when it was), else one
  written from `m.cfg`, weights in float32 (`dtype`)."""
  base = dict(m.config) if m.config else (
      _gpt2_hf_config(m.cfg) if m.model is gpt else _mixtral_hf_config(m.cfg)
      if m.model is moe else _llama_hf_config(m.cfg))
  base.pop("torch_dtype", None)
  return {**base, "dtype": "float32"}


def _llama_hf_config(cfg: llama.ModelConfig) -> dict:
  if cfg.post_norms or cfg.norm_plus_one:
    return _gemma_hf_config(cfg)
  plain = llama.ModelConfig(0, 0, 0, 0, 0, 0)
  odd = [f for f in _GEMMA_OPTIONS if getattr(cfg, f) != getattr(plain, f)]
  if odd or any(cfg.windows):
    field = odd[0] if odd else "windows"
    raise fs.InputError(
        f"export: ModelConfig.{field}={getattr(cfg, field)!r} without Gemma's norms "
        "(post_norms, norm_plus_one) is neither a Llama, Qwen nor Gemma config.json; fix: "
        "export a model with all of Gemma's options, or none.")
  kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM"}[kind]
  out = dict(architectures=[arch], model_type=kind, hidden_size=cfg.d_model,
             num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
             num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.d_mlp,
             head_dim=cfg.head_dim, vocab_size=cfg.vocab, hidden_act="silu",
             rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
             max_position_embeddings=max(cfg.seq, 2048),
             tie_word_embeddings=cfg.tie_embeddings, attention_bias=False)
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    out["rope_scaling"] = dict(rope_type="llama3", factor=s.factor,
                               low_freq_factor=s.low_freq_factor,
                               high_freq_factor=s.high_freq_factor,
                               original_max_position_embeddings=s.original_max_position)
    out["max_position_embeddings"] = max(cfg.seq, int(s.original_max_position * s.factor))
  return out


_GEMMA_OPTIONS = ("activation", "embed_scale", "attn_scale", "attn_soft_cap", "logit_soft_cap",
                  "local_rope_theta")


def _gemma_hf_config(cfg: llama.ModelConfig) -> dict:
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


def _mixtral_hf_config(cfg: moe.ModelConfig) -> dict:
  """config.json of a Mixtral-style model trained here (`moe.py`, no shared experts, the
  weights renormalised over the k: what MixtralForCausalLM computes)."""
  if cfg.shared or not cfg.normalize or cfg.capacity_factor is not None:
    raise fs.InputError(
        "export: a Mixtral config.json can't say shared experts, unnormalised routing "
        f"weights or a capacity (shared={cfg.shared}, normalize={cfg.normalize}, "
        f"capacity_factor={cfg.capacity_factor}); fix: export a Mixtral-style model.")
  return dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
              hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
              num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
              intermediate_size=cfg.d_ff, num_local_experts=cfg.experts,
              num_experts_per_tok=cfg.k, vocab_size=cfg.vocab, hidden_act="silu",
              rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
              max_position_embeddings=max(cfg.seq, 2048), tie_word_embeddings=False,
              router_aux_loss_coef=cfg.balance_coef / cfg.k, router_jitter_noise=0.0,
              sliding_window=None)


def _gpt2_hf_config(cfg: gpt.ModelConfig) -> dict:
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.d_model,
              n_layer=cfg.layers, n_head=cfg.heads, vocab_size=cfg.vocab,
              n_positions=cfg.positions or cfg.seq, activation_function="gelu_new",
              layer_norm_epsilon=1e-5, tie_word_embeddings=True)


def of_model(model: ModuleType, cfg) -> HFModel:
  """An HFModel for a model trained from scratch (no config.json read): export writes one."""
  return HFModel(model, cfg, {})
