"""The Llama's shape: its config (`ModelConfig`), the named sizes (`SIZES`, `model_config`),
the leaves a config's variant has (`variant`) and what a shape costs (`matmul_params`,
`param_count`, `flops_per_token`). `recipes.lm.llama` is the model; it re-exports these as
its module interface.
"""
from __future__ import annotations

from typing import NamedTuple

import fnscale as fs
from recipes.lm import remat as remat_lib
from recipes.lm.layers import RopeScaling, Yarn


class ModelConfig(NamedTuple):
  """Shape of the decoder.

  `heads` query heads share `kv_heads` key/value heads (GQA); head_dim = `head_size` if set,
  else d_model / heads. `rope_theta` is the rotary base (500000 in Llama 3), `rope_scaling`
  Llama 3.1's or YaRN's frequency scaling (None: plain RoPE); `norm_eps` RMSNorm's epsilon.
  `tie_embeddings`: the output layer is the token embedding (no `unembed` leaf); `qkv_bias`:
  biases on the q/k/v projections (Qwen2); `qk_norm`: RMSNorm over head_dim of q and k
  before RoPE (Qwen3). `repeats` > 1: the blocks are stored for a circular
  pipeline of `stages` stages, [stages, repeats, layers / (stages repeats), ...].
  `int8`: the blocks' projections and MLP multiply in int8 (`recipes.lm.int8.dense`; the
  output layer and attention stay in the compute dtype). `unroll`: the layer loop is
  unrolled in the compiled program instead of one `lax.scan` body. `loss_chunk`: tokens per
  chunk of the loss (`fnscale.cross_entropy`'s chunk_size; 0: its default).

  Gemma 2/3's variant: `norm_plus_one`: every RMSNorm scales by (1 + its weight) (the
  weights start at zero); `post_norms`: the attention and MLP outputs are RMSNormed before
  their residual adds (leaves `post_attn_norm`, `post_mlp_norm`); `activation`: the gated
  MLP's, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU's tanh approximation);
  `embed_scale`: the embedding is multiplied by sqrt(d_model) in the compute dtype;
  `attn_scale`: the logits' scale (0: 1/sqrt(head_dim)); `attn_soft_cap`, `logit_soft_cap`:
  attention logits and output logits capped as c tanh(logits / c) (0: not capped);
  `windows`: each layer's sliding window w (query i sees keys i-w+1..i; 0: the whole
  causal prefix), () for none; `local_rope_theta`: the RoPE base of the windowed layers
  (0: `rope_theta` and `rope_scaling`, as the others).
  """
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  d_mlp: int
  seq: int
  vocab: int = 256
  rope_theta: float = 500_000.0
  norm_eps: float = 1e-5
  head_size: int = 0
  rope_scaling: RopeScaling | Yarn | None = None
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  stages: int = 1
  repeats: int = 1
  int8: bool = False
  unroll: bool = False
  loss_chunk: int = 0
  norm_plus_one: bool = False
  post_norms: bool = False
  activation: str = "silu"
  embed_scale: bool = False
  attn_scale: float = 0.0
  attn_soft_cap: float = 0.0
  logit_soft_cap: float = 0.0
  windows: tuple[int, ...] = ()
  local_rope_theta: float = 0.0

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.heads


LLAMA3_VOCAB = 128_256
REMAT_POLICIES = remat_lib.POLICIES  # what `remat=` takes besides True / False
# Llama 3 shapes from Meta's published configurations: "The Llama 3 Herd of Models"
# (arXiv:2407.21783), table 3 (8B: 32 layers, d 4096, FFN 14336, 32 heads, 8 KV heads;
# 70B: 80 layers, d 8192, FFN 28672, 64 heads, 8 KV heads; vocabulary 128256, RoPE base
# 500000), and the Llama 3.2 1B model card / params.json (16 layers, d 2048, FFN 8192, 32
# heads, 8 KV heads; 3B: 28 layers, d 3072, FFN 8192, 24 heads, 8 KV heads), both with tied
# embeddings and Llama 3.1's RoPE scaling at factor 32 (their config.json): 1,235,814,400 and
# 3,212,749,824 params. `llama-tiny` is byte-level. `llama-766m` is the largest of these
# shapes one TPU v5e chip (15.75 GiB HBM) trains with float32 params and AdamW state: Llama
# 3.2 1B's width, MLP and vocabulary at 8 layers, with 16 heads of 128 (the v5e MXU's
# 128 x 128 tiles; 32 heads of 64 run the attention kernel at half width), 766,019,584
# params. At 8 rows of 2048 tokens with full remat it trained at 22.8k tokens/s, 57.9% MFU
# (`python recipes/bench/chip.py --case=llama`); float32 params and AdamW state leave no room
# for less remat at that batch (15.3 of 15.75 GiB).
LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position=8192)
SIZES = {
    "llama-tiny": dict(layers=4, d_model=256, heads=8, kv_heads=2, d_mlp=768, vocab=256),
    "llama-766m": dict(layers=8, d_model=2048, heads=16, kv_heads=8, d_mlp=8192,
                       vocab=LLAMA3_VOCAB, tie_embeddings=True),
    "llama-1b": dict(layers=16, d_model=2048, heads=32, kv_heads=8, d_mlp=8192,
                     vocab=LLAMA3_VOCAB, tie_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama-3b": dict(layers=28, d_model=3072, heads=24, kv_heads=8, d_mlp=8192,
                     vocab=LLAMA3_VOCAB, tie_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama-8b": dict(layers=32, d_model=4096, heads=32, kv_heads=8, d_mlp=14336,
                     vocab=LLAMA3_VOCAB),
    "llama-70b": dict(layers=80, d_model=8192, heads=64, kv_heads=8, d_mlp=28672,
                      vocab=LLAMA3_VOCAB),
}


def model_config(size: str, seq: int, **overrides) -> ModelConfig:
  """The named shape at sequence length `seq`; `overrides` replace fields (e.g. layers=2).

  Raises:
    FnscaleError: an unknown size or override field, or a bad seq.
  """
  return named_config(ModelConfig, SIZES, "Llama", size, seq, overrides)


def named_config(cls, sizes: dict, family: str, size: str, seq: int, overrides: dict):
  """`cls(seq=seq, **sizes[size], **overrides)` after checking the size, the override
  fields and seq (shared by the model families' `model_config`).

  Raises:
    FnscaleError: an unknown size or override field, or a seq that is not an int >= 1.
  """
  if size not in sizes:
    raise fs.InputError(f"model {size!r} is not a known {family} size; expected one of "
                        f"{list(sizes)}")
  bad = sorted(set(overrides) - set(cls._fields))
  if bad:
    raise fs.InputError(f"model_config: unknown fields {bad}; expected some of "
                        f"{list(cls._fields)}")
  if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
    raise fs.InputError(f"model_config: seq={seq!r}, expected an int >= 1")
  return cls(seq=seq, **{**sizes[size], **overrides})


def variant(tree: dict, extra: dict, cfg: ModelConfig) -> dict:
  """`tree` (params or their axes) for cfg's variant: without `unembed` when tied, with the
  bias, q/k norm and post-norm leaves of `extra` when the config has them."""
  out = {k: v for k, v in tree.items() if not (k == "unembed" and cfg.tie_embeddings)}
  names = (("bq", "bk", "bv") if cfg.qkv_bias else ()) + (
      ("q_norm", "k_norm") if cfg.qk_norm else ()) + (
      ("post_attn_norm", "post_mlp_norm") if cfg.post_norms else ())
  out["blocks"] = {**tree["blocks"], **{k: extra[k] for k in names}}
  return out


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: q, k, v, o and the three MLP matrices per block plus
  the output layer; the embedding lookup and norm scales are not matmuls."""
  K = cfg.head_dim
  attn = cfg.d_model * K * (2 * cfg.heads + 2 * cfg.kv_heads)
  return cfg.layers * (attn + 3 * cfg.d_model * cfg.d_mlp) + cfg.d_model * cfg.vocab


def param_count(cfg: ModelConfig) -> int:
  """Every param: matmul weights, the embedding table (once when tied: it is the output
  layer), the RMSNorm scales, q/k/v biases, q/k norm and post-norm scales."""
  K, L = cfg.head_dim, cfg.layers
  extra = (L * K * (cfg.heads + 2 * cfg.kv_heads) if cfg.qkv_bias else 0) + (
      2 * L * K if cfg.qk_norm else 0) + (2 * L * cfg.d_model if cfg.post_norms else 0)
  embed = 0 if cfg.tie_embeddings else cfg.vocab * cfg.d_model
  return matmul_params(cfg) + embed + (2 * L + 1) * cfg.d_model + extra


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): 6 N + 12 layers (heads head_dim) seq
  (`fnscale.analysis.model_flops_per_token`, PaLM appendix B). Remat is not counted (MFU)."""
  return fs.analysis.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                           d_model=cfg.heads * cfg.head_dim, seq=cfg.seq)
