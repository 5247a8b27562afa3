"""Hugging Face model families as fnscale's models: config.json -> ModelConfig, the map from
each param leaf to its safetensors key and transform, and config.json back for an export.

  m = hf_maps.read("path/to/Llama-3.2-1B", seq=2048)    # HFModel(model, cfg, config)
  abstract = fs.init_state(functools.partial(m.model.init_params, m.cfg), opt, mesh=mesh,
                           rules=m.model.RULES, logical_axes=m.model.logical_axes(m.cfg),
                           key=jax.random.key(0), abstract=True)
  params = fs.checkpoint.hf.load(path, abstract.params, hf_maps.checkpoint_map(m, path))

Families (`model_type`): llama (Llama 2/3/3.1/3.2: tied or untied embeddings), mistral,
qwen2 (Qwen2/2.5: q/k/v biases), qwen3 (per-head q/k RMSNorm) into `llama.py`; gemma2
(Gemma 2: attention and final logit soft-capping, sliding-window layers alternating with
global ones) and gemma3_text (Gemma 3's text models: q/k RMSNorm, five sliding-window layers
to one global, a RoPE base of their own for the local layers) into `llama.py` too, as its
Gemma options (GeGLU, RMSNorm by (1 + weight) before and after attention and the MLP, the
embedding scaled by sqrt(d_model), tied embeddings: `hf_gemma`); gpt2 into `gpt.py`.
Anything a config asks that these models can't compute (a RoPE type, an activation, biases
elsewhere, a sliding window shorter than the sequence where the model has none) is an
InputError naming the config.json field, never a silently different model. mixtral
(Mixtral's routed experts) and qwen3_moe (Qwen3's attention, narrow experts, their weights
renormalised or not) into `moe.py`: the experts' weights are one leaf each per projection,
[layers, experts, ...], read from `{layer}` and `{expert}` keys (the Hub's layout, which
transformers writes too). deepseek_v3 into `deepseek.py` (`hf_deepseek`). RoPE: plain,
"llama3" or "yarn" (`hf_fields.rope`) in every family but gpt2 (Gemma's local layers and
exports: plain).
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, NamedTuple

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.lm import deepseek, gpt, hf_deepseek, hf_gemma, hf_moe, llama, moe
from recipes.lm.hf_fields import check_llama, error, llama_map, need, rope, rope_fields

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILY = ("mixtral", "qwen3_moe", "deepseek_v3")
GEMMA_FAMILY = ("gemma2", "gemma3_text")
FAMILIES = LLAMA_FAMILY + GEMMA_FAMILY + ("gpt2",) + MOE_FAMILY


class HFModel(NamedTuple):
  """A Hugging Face model as fnscale's: the model module, its config, the config.json read."""
  model: ModuleType  # recipes.lm.llama or recipes.lm.gpt
  cfg: Any  # the module's ModelConfig
  config: dict  # config.json as read (the base of an exported config.json)


def apply_fn(m: HFModel):
  """`apply(params, tokens, *, remat=False)` -> float32 logits [batch, seq, vocab] of `m`
  (the model's `apply` with its config: RoPE and RMSNorm settings)."""
  return functools.partial(m.model.apply, cfg=m.cfg)


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
    raise error("quantization_config", "...", "is set: quantized weights are not read; fix: "
                "start from the unquantized checkpoint.")
  if kind in LLAMA_FAMILY:
    return HFModel(llama, _llama_config(c, seq), dict(c))
  if kind in GEMMA_FAMILY:
    return HFModel(llama, hf_gemma.config(c, seq), dict(c))
  if kind == "gpt2":
    return HFModel(gpt, _gpt2_config(c, seq), dict(c))
  if kind == "mixtral":
    return HFModel(moe, hf_moe.mixtral_config(c, seq), dict(c))
  if kind == "qwen3_moe":
    return HFModel(moe, hf_moe.qwen3_moe_config(c, seq), dict(c))
  if kind == "deepseek_v3":
    return HFModel(deepseek, hf_deepseek.config(c, seq), dict(c))
  hint = (" (experts: Mixtral's, Qwen3's and DeepSeek-V3's are in fnscale's models)"
          if kind in ("qwen2_moe",) else hf_gemma.HINTS.get(kind, ""))
  raise error("model_type", kind, f"is not a family fnscale reads{hint}; expected one of "
              f"{list(FAMILIES)}.")


def _llama_config(c: dict, seq: int) -> llama.ModelConfig:
  check_llama(c, seq)
  d, heads = need(c, "hidden_size"), need(c, "num_attention_heads")
  head_dim = c.get("head_dim") or d // heads
  theta, scaling = rope(c)
  return llama.ModelConfig(
      layers=need(c, "num_hidden_layers"), d_model=d, heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads, d_mlp=need(c, "intermediate_size"),
      seq=seq, vocab=need(c, "vocab_size"), rope_theta=theta,
      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      head_size=0 if head_dim == d // heads else head_dim, rope_scaling=scaling,
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      qkv_bias=c["model_type"] == "qwen2", qk_norm=c["model_type"] == "qwen3")


def _gpt2_config(c: dict, seq: int) -> gpt.ModelConfig:
  d = need(c, "n_embd")
  checks = (("activation_function", c.get("activation_function", "gelu_new"),
             ("gelu_new", "gelu_pytorch_tanh"), "GELU's tanh form, what fnscale's GPT computes"),
            ("n_inner", c.get("n_inner") or 4 * d, (4 * d,), "an MLP of 4 x n_embd"),
            ("layer_norm_epsilon", c.get("layer_norm_epsilon", 1e-5), (1e-5,), "1e-5"),
            ("scale_attn_by_inverse_layer_idx", c.get("scale_attn_by_inverse_layer_idx", False),
             (False,), "off"),
            ("tie_word_embeddings", c.get("tie_word_embeddings", True), (True,), "tied"))
  for field, value, ok, what in checks:
    if value not in ok:
      raise error(field, value, f"is not {what}; fnscale's GPT can't express it.")
  positions = need(c, "n_positions")
  if seq > positions:
    raise fs.InputError(f"seq={seq} is longer than config.json's n_positions={positions} "
                        "(GPT-2 has a learned position per token); fix: a shorter --seq.")
  return gpt.ModelConfig(layers=need(c, "n_layer"), d_model=d, heads=need(c, "n_head"),
                         seq=seq, vocab=need(c, "vocab_size"), positions=positions)


# ------------------------------------------------------------------------------------------
# Checkpoint maps: fnscale leaf path -> safetensors key and transform


def checkpoint_map(m: HFModel, path=None) -> hf.CheckpointMap:
  """The map between `m`'s params and its Hugging Face checkpoint's keys; `path` (the
  checkpoint directory, or its `hf.Index`) lets GPT-2 find whether its keys carry the
  "transformer." prefix (the original checkpoints don't)."""
  if m.model is gpt:
    return _gpt2_map(m.cfg, _gpt2_prefix(path))
  if m.model is moe:
    return hf_moe.checkpoint_map(m.cfg, hf_moe.family(m))
  if m.model is deepseek:
    return hf_deepseek.checkpoint_map(m.cfg, path)
  return llama_map(m.cfg)


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
      _gpt2_hf_config(m.cfg) if m.model is gpt else hf_moe.hf_config(m.cfg)
      if m.model is moe else hf_deepseek.hf_config(m.cfg) if m.model is deepseek
      else _llama_hf_config(m.cfg))
  base.pop("torch_dtype", None)
  return {**base, "dtype": "float32"}


def _llama_hf_config(cfg: llama.ModelConfig) -> dict:
  if cfg.post_norms or cfg.norm_plus_one:
    return hf_gemma.hf_config(cfg)
  plain = llama.ModelConfig(0, 0, 0, 0, 0, 0)
  odd = [f for f in hf_gemma.OPTIONS if getattr(cfg, f) != getattr(plain, f)]
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
             rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
             attention_bias=False)
  return out | rope_fields(cfg.rope_theta, cfg.rope_scaling, cfg.seq)


def _gpt2_hf_config(cfg: gpt.ModelConfig) -> dict:
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.d_model,
              n_layer=cfg.layers, n_head=cfg.heads, vocab_size=cfg.vocab,
              n_positions=cfg.positions or cfg.seq, activation_function="gelu_new",
              layer_norm_epsilon=1e-5, tie_word_embeddings=True)


def of_model(model: ModuleType, cfg) -> HFModel:
  """An HFModel for a model trained from scratch (no config.json read): export writes one."""
  return HFModel(model, cfg, {})
