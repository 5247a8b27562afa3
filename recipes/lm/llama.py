"""A Llama-style decoder as a plain pytree and pure functions (same interface as the GPT).

Pre-RMSNorm blocks (Zhang & Sennrich 2019), rotary positions (Su et al. 2021, "RoFormer"),
a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"), grouped-query attention
(Ainslie et al. 2023, "GQA") through `fnscale.attention`, and an output layer untied from the
token embedding, as in Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models").

Module interface (shared with the GPT in `train_lm.py`): `ModelConfig`, `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`. Blocks are stacked along a leading `layers` axis and run under
`lax.scan`; every param leaf has logical axis names for fnscale's rules.

On a mesh with a `context` axis the sequence is split over it (context parallelism): the
batch comes in the shards' order (`fnscale.parallel.context.reorder_batch`, which adds the
"positions" RoPE needs), activations keep the split, attention runs in a context form and
the loss scores each shard's tokens where they are; params are split over the axis as over
"fsdp".
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fnscale as fs
from fnscale.analysis import flops
from recipes.lm import gpt


class ModelConfig(NamedTuple):
  """Shape of the decoder.

  `heads` query heads share `kv_heads` key/value heads (GQA); head_dim = d_model / heads.
  `rope_theta` is the rotary base (500000 in Llama 3); `norm_eps` RMSNorm's epsilon.
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

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


LLAMA3_VOCAB = 128_256
# Llama 3 shapes from Meta's published configurations: "The Llama 3 Herd of Models"
# (arXiv:2407.21783), table 3 (8B: 32 layers, d 4096, FFN 14336, 32 heads, 8 KV heads;
# 70B: 80 layers, d 8192, FFN 28672, 64 heads, 8 KV heads; vocabulary 128256, RoPE base
# 500000), and the Llama 3.2 1B model card / params.json (16 layers, d 2048, FFN 8192, 32
# heads, 8 KV heads). Meta ties the 1B's embeddings; here every size has an untied output
# layer, so `llama-1b` holds 1.50B params rather than 1.24B. `llama-tiny` is byte-level.
SIZES = {
    "llama-tiny": dict(layers=4, d_model=256, heads=8, kv_heads=2, d_mlp=768, vocab=256),
    "llama-1b": dict(layers=16, d_model=2048, heads=32, kv_heads=8, d_mlp=8192,
                     vocab=LLAMA3_VOCAB),
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
  if size not in SIZES:
    raise fs.InputError(f"model {size!r} is not a known Llama size; expected one of "
                          f"{list(SIZES)}")
  bad = sorted(set(overrides) - set(ModelConfig._fields))
  if bad:
    raise fs.InputError(f"model_config: unknown fields {bad}; expected some of "
                          f"{list(ModelConfig._fields)}")
  if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
    raise fs.InputError(f"model_config: seq={seq!r}, expected an int >= 1")
  return ModelConfig(seq=seq, **{**SIZES[size], **overrides})


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """float32 params; block params stacked along a leading `layers` axis for `lax.scan`.

  Weights N(0, 0.02), the two residual output projections scaled by 1/sqrt(2 layers)
  (GPT-2's scheme), RMSNorm scales one.
  """
  L, D, H, G, K, F = (cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim,
                      cfg.d_mlp)
  ks = jax.random.split(key, 9)
  std, res = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  return {
      "embed": normal(ks[0], (cfg.vocab, D), std),
      "blocks": {
          "attn_norm": jnp.ones((L, D)),
          "wq": normal(ks[1], (L, D, H, K), std),
          "wk": normal(ks[2], (L, D, G, K), std),
          "wv": normal(ks[3], (L, D, G, K), std),
          "wo": normal(ks[4], (L, H, K, D), res),
          "mlp_norm": jnp.ones((L, D)),
          "w_gate": normal(ks[5], (L, D, F), std),
          "w_up": normal(ks[6], (L, D, F), std),
          "w_down": normal(ks[7], (L, F, D), res),
      },
      "final_norm": jnp.ones((D,)),
      "unembed": normal(ks[8], (D, cfg.vocab), std),
  }


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  del cfg
  return {
      "embed": ("vocab", "embed"),
      "blocks": {
          "attn_norm": ("layers", "norm"),
          "wq": ("layers", "embed", "heads", "head_dim"),
          "wk": ("layers", "embed", "kv_heads", "head_dim"),
          "wv": ("layers", "embed", "kv_heads", "head_dim"),
          "wo": ("layers", "heads", "head_dim", "embed"),
          "mlp_norm": ("layers", "norm"),
          "w_gate": ("layers", "embed", "mlp"),
          "w_up": ("layers", "embed", "mlp"),
          "w_down": ("layers", "mlp", "embed"),
      },
      "final_norm": ("norm",),
      "unembed": (None, "vocab_out"),
  }


# Logical axis -> mesh axes: "embed" over fsdp shards params and optimizer state (ZeRO-3);
# heads, kv heads, mlp and vocab over tensor are Megatron-style tensor parallelism. The
# output layer is stored split by vocabulary over fsdp and tensor ("vocab_out"): the loss
# (`fnscale.cross_entropy(..., vocab_axes=VOCAB_OUT_AXES)`) then gathers the hidden states
# over fsdp, not the [d, vocab] weight, and never reduces its gradient over fsdp.
# A "context" axis (the sequence split) holds params split as "fsdp" does (MaxText's "embed"
# rule names both): its devices see different tokens, so their gradients are reduced over it
# anyway, and replicated params would hold c times the memory. Rules naming an axis the mesh
# lacks are skipped, so the combinations come largest first.
VOCAB_OUT_AXES = ("fsdp", "context", "tensor")


def _largest_first(name: str, axes: tuple[str, ...]) -> tuple:
  """(name, combination) rules for every non-empty combination of `axes`, largest first."""
  combos = [tuple(a for i, a in enumerate(axes) if mask >> i & 1)
            for mask in range(2 ** len(axes) - 1, 0, -1)]
  return tuple((name, c) for c in sorted(combos, key=len, reverse=True))


RULES = (
    ("batch", ("replica", "data", "fsdp")),
    *_largest_first("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    *_largest_first("vocab_out", VOCAB_OUT_AXES),
    ("norm", None),  # RMSNorm scales: small, replicated on purpose
)


def rms_norm(x, scale, eps: float = 1e-5):
  """x / rms(x) * scale over the last axis, statistics in float32 (x's dtype out)."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, theta: float, positions=None):
  """Rotary positions on x [batch, seq, heads, head_dim]: pair i with i + head_dim/2 and
  rotate the pair at position p by p * theta^(-2i/head_dim) (the "rotate half" layout).
  `positions`: int [batch, seq], each token's position (default 0..seq-1 in every row; a
  reordered or packed sequence gives its own)."""
  seq, half = x.shape[1], x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if positions is None:
    positions = jnp.arange(seq)[None]
  ang = positions.astype(jnp.float32)[..., None] * freq  # [batch or 1, seq, half]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def _block(x, p, cfg: ModelConfig, positions=None, segment_ids=None):
  """One pre-norm Llama block. x: [batch, seq, d_model]; positions and segment ids
  [batch, seq] (None: 0..seq-1, one sequence per row)."""
  # Keep the residual stream split by batch, or GSPMD may follow the FSDP params' sharding.
  x = fs.constrain_batch(x)
  h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
  # q, k, v and the attention output too: on a multi-slice mesh GSPMD otherwise computed the
  # k/v projections and the output projection's backward for both slices' rows (Llama-1B on
  # 2 x v5p-8: HLO matmul FLOPs 1.105 x the traced step's without these, 1.033 with).
  q = fs.constrain_batch(rope(jnp.einsum("bsd,dhk->bshk", h, p["wq"]), cfg.rope_theta,
                              positions))
  k = fs.constrain_batch(rope(jnp.einsum("bsd,dhk->bshk", h, p["wk"]), cfg.rope_theta,
                              positions))
  v = fs.constrain_batch(jnp.einsum("bsd,dhk->bshk", h, p["wv"]))
  o = fs.constrain_batch(fs.attention(q, k, v, causal=True, segment_ids=segment_ids))
  x = x + jnp.einsum("bshk,hkd->bsd", o, p["wo"])
  h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  g = jax.nn.silu(jnp.einsum("bsd,df->bsf", h, p["w_gate"]))
  u = jnp.einsum("bsd,df->bsf", h, p["w_up"])
  return x + jnp.einsum("bsf,fd->bsd", g * u, p["w_down"])


def _config_of(params: dict, tokens) -> ModelConfig:
  """Static shape facts read off the params (so `apply` needs no config argument)."""
  wq, wk = params["blocks"]["wq"], params["blocks"]["wk"]
  L, D, H, K = wq.shape
  return ModelConfig(layers=L, d_model=D, heads=H, kv_heads=wk.shape[2],
                     d_mlp=params["blocks"]["w_up"].shape[-1], seq=tokens.shape[1],
                     vocab=params["unembed"].shape[-1])


def hidden(params: dict, tokens: jax.Array, *, remat: bool = False,
           rope_theta: float = 500_000.0, positions=None, segment_ids=None) -> jax.Array:
  """The final hidden states: tokens int32 [batch, seq] -> [batch, seq, d_model] in the
  params' dtype (after the last RMSNorm, before the output layer). `positions`,
  `segment_ids`: int [batch, seq] (packed rows, a context-parallel order); under a context
  axis positions are required (`gpt.check_positions`)."""
  cfg = _config_of(params, tokens)._replace(rope_theta=rope_theta)
  gpt.check_positions(positions)
  x = gpt.embed_lookup(params["embed"], tokens)  # ids and activations move, not the table
  block = lambda x, p: _block(x, p, cfg, positions, segment_ids)
  block = jax.checkpoint(block) if remat else block
  x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
  return rms_norm(fs.constrain_batch(x), params["final_norm"], cfg.norm_eps)


def apply(params: dict, tokens: jax.Array, *, remat: bool = False,
          rope_theta: float = 500_000.0, positions=None, segment_ids=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq] -> float32 [batch, seq, vocab].

  Computes in the dtype of `params` (a precision policy casts them); RMSNorm statistics,
  rotary angles and logits are float32. `remat=True` recomputes each block's activations in
  the backward pass (`jax.checkpoint`, nothing saved inside a block).
  """
  x = hidden(params, tokens, remat=remat, rope_theta=rope_theta, positions=positions,
             segment_ids=segment_ids)
  return jnp.einsum("bsd,dv->bsv", x, params["unembed"]).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, *, remat: bool = False) -> jax.Array:
  """Mean next-token cross-entropy in nats. batch: {"inputs", "targets"} int32 [batch, seq],
  ids in [0, cfg.vocab): an id outside gives a nan or wrong loss, not an error (jit cannot
  raise on values); check data of your own with `data.check_token_ids(batch, cfg.vocab)`.
  Optional "positions" and "segment_ids" int32 [batch, seq] (packed rows, the context
  shards' order).

  `fnscale.cross_entropy` walks the tokens in chunks and computes the gradients in its
  forward pass (the plain loss's matmul FLOPs, no logits recomputed): the float32
  [batch, seq, vocab] logits never exist, which at Llama 3's 128256-token vocabulary would
  be the step's largest buffer (2 GiB per 4096-token row). Vocab-parallel over the axes
  the output layer is split on (`VOCAB_OUT_AXES`)."""
  x = hidden(params, batch["inputs"], remat=remat, positions=batch.get("positions"),
             segment_ids=batch.get("segment_ids"))
  # [batch, seq, d]: the tokens stay where they are, the sequence split too.
  return fs.cross_entropy(x, params["unembed"].astype(x.dtype), batch["targets"],
                          vocab_axes=VOCAB_OUT_AXES)


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: q, k, v, o and the three MLP matrices per block plus
  the output layer; the embedding lookup and norm scales are not matmuls."""
  K = cfg.head_dim
  attn = cfg.d_model * K * (2 * cfg.heads + 2 * cfg.kv_heads)
  return cfg.layers * (attn + 3 * cfg.d_model * cfg.d_mlp) + cfg.d_model * cfg.vocab


def param_count(cfg: ModelConfig) -> int:
  """Every param: matmul weights, the embedding table and the RMSNorm scales."""
  return matmul_params(cfg) + cfg.vocab * cfg.d_model + (2 * cfg.layers + 1) * cfg.d_model


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): 6 N + 12 layers (heads head_dim) seq
  (`fnscale.analysis.flops.model_flops_per_token`, PaLM appendix B). Remat is not counted (MFU)."""
  return flops.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                     d_model=cfg.heads * cfg.head_dim, seq=cfg.seq)
