"""A Llama-style decoder as a plain pytree and pure functions (same interface as the GPT).

Pre-RMSNorm blocks (Zhang & Sennrich 2019), rotary positions (Su et al. 2021, "RoFormer"),
a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"), grouped-query attention
(Ainslie et al. 2023, "GQA") through `fnscale.attention`, and an output layer untied from the
token embedding, as in Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models"). The
variants of open models are config fields: Llama 3.1/3.2's RoPE frequency scaling and tied
embeddings, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, a head width other than
d_model / heads (recipes/lm/hf_maps.py reads them from a Hugging Face config.json).

Module interface (shared with the GPT in `train_lm.py`): `ModelConfig`, `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`. Blocks are stacked along a leading `layers` axis and run under
`lax.scan`; every param leaf has logical axis names for fnscale's rules.

On a mesh with a `stage` axis of S > 1 devices the blocks run as a pipeline
(`fnscale.parallel.pipeline`): the rule ("layers", "stage") splits the layer stack into S
contiguous stages, and `loss_fn(..., microbatches=M)` cuts the batch into M microbatches
(default S). A config with `repeats` R > 1 stores the blocks as [stages, R, layers / (S R),
...] (`fnscale.parallel.stage_layers`) and runs the circular schedule.

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
from recipes.lm import embedding, int8
from recipes.lm.layers import RopeScaling, rms_norm, rope, rope_frequencies  # noqa: F401
from recipes.lm import remat as remat_lib


class ModelConfig(NamedTuple):
  """Shape of the decoder.

  `heads` query heads share `kv_heads` key/value heads (GQA); head_dim = `head_size` if set,
  else d_model / heads. `rope_theta` is the rotary base (500000 in Llama 3),
  `rope_scaling` Llama 3.1's frequency scaling (None: plain RoPE); `norm_eps` RMSNorm's
  epsilon. `tie_embeddings`: the output layer is the token embedding (no `unembed` leaf);
  `qkv_bias`: biases on the q/k/v projections (Qwen2); `qk_norm`: RMSNorm over head_dim of
  q and k before RoPE (Qwen3). `repeats` > 1: the blocks are stored for a circular
  pipeline of `stages` stages, [stages, repeats, layers / (stages repeats), ...].
  `int8`: the blocks' projections and MLP multiply in int8 (`recipes.lm.int8.dense`; the
  output layer and attention stay in the compute dtype). `unroll`: the layer loop is
  unrolled in the compiled program instead of one `lax.scan` body. `loss_chunk`: tokens per
  chunk of the loss (`fnscale.cross_entropy`'s chunk_size; 0: its default).
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
  rope_scaling: RopeScaling | None = None
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  stages: int = 1
  repeats: int = 1
  int8: bool = False
  unroll: bool = False
  loss_chunk: int = 0

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


def attention_blocks(keys, shape: tuple[int, ...]) -> dict:
  """An attention block's stacked float32 params for shape (layers, d_model, heads,
  kv_heads, head_dim): the pre-norm scale (ones), wq/wk/wv N(0, 0.02) and wo scaled by
  1/sqrt(2 layers) (GPT-2's scheme), from four keys."""
  L, D, H, G, K = shape
  std, res = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  return {"attn_norm": jnp.ones((L, D)), "wq": normal(keys[0], (L, D, H, K), std),
          "wk": normal(keys[1], (L, D, G, K), std), "wv": normal(keys[2], (L, D, G, K), std),
          "wo": normal(keys[3], (L, H, K, D), res)}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """float32 params; block params stacked along a leading `layers` axis for `lax.scan`
  (with `cfg.repeats` > 1 in the circular pipeline's layout, `_stored_blocks`).

  Weights N(0, 0.02), the two residual output projections scaled by 1/sqrt(2 layers)
  (GPT-2's scheme), RMSNorm scales one, biases zero. Tied embeddings: no `unembed`; q/k/v
  biases add `bq`, `bk`, `bv`; q/k norm adds `q_norm`, `k_norm` (scales over head_dim).
  """
  L, D, H, G, K, F = (cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim,
                      cfg.d_mlp)
  ks = jax.random.split(key, 9)
  std, res = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  params = {
      "embed": normal(ks[0], (cfg.vocab, D), std),
      "blocks": {
          **attention_blocks(ks[1:5], (L, D, H, G, K)),
          "mlp_norm": jnp.ones((L, D)),
          "w_gate": normal(ks[5], (L, D, F), std),
          "w_up": normal(ks[6], (L, D, F), std),
          "w_down": normal(ks[7], (L, F, D), res),
      },
      "final_norm": jnp.ones((D,)),
      "unembed": normal(ks[8], (D, cfg.vocab), std),
  }
  extra = {"bq": jnp.zeros((L, H, K)), "bk": jnp.zeros((L, G, K)), "bv": jnp.zeros((L, G, K)),
           "q_norm": jnp.ones((L, K)), "k_norm": jnp.ones((L, K))}
  params = _variant(params, extra, cfg)
  return {**params, "blocks": _stored_blocks(params["blocks"], cfg)}


def _stored_blocks(blocks: dict, cfg: ModelConfig) -> dict:
  """The block stack as stored: [layers, ...], or [stages, repeats, layers per stage, ...]
  for a circular pipeline (`cfg.repeats` > 1)."""
  if cfg.repeats == 1:
    return blocks
  return fs.parallel.stage_layers(blocks, cfg.stages, cfg.repeats)


def _variant(tree: dict, extra: dict, cfg: ModelConfig) -> dict:
  """`tree` (params or their axes) for cfg's variant: without `unembed` when tied, with the
  bias and q/k norm leaves of `extra` when the config has them."""
  out = {k: v for k, v in tree.items() if not (k == "unembed" and cfg.tie_embeddings)}
  names = (("bq", "bk", "bv") if cfg.qkv_bias else ()) + (
      ("q_norm", "k_norm") if cfg.qk_norm else ())
  out["blocks"] = {**tree["blocks"], **{k: extra[k] for k in names}}
  return out


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  names = _variant(_AXES, {"bq": ("layers", "heads", "head_dim"),
                           "bk": ("layers", "kv_heads", "head_dim"),
                           "bv": ("layers", "kv_heads", "head_dim"),
                           "q_norm": ("layers", "norm"), "k_norm": ("layers", "norm")}, cfg)
  staged = ("stage", "repeats") if cfg.repeats > 1 else ()
  return {**names, "blocks": {k: staged + v for k, v in names["blocks"].items()}}


_AXES = {
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


# The weights LoRA adapts (`fnscale.lora`), by name: the layout of one layer's weight ('i' its
# dims contracted with the activations, 'o' those it produces); the stored layer dims lead.
LORA_WEIGHTS = {"wq": "ioo", "wk": "ioo", "wv": "ioo", "wo": "iio", "w_gate": "io",
                "w_up": "io", "w_down": "io"}


def lora_targets(cfg: ModelConfig, names=None) -> tuple:
  """`fnscale.lora.LoraConfig.targets` for the block weights `names` (default every one of
  `LORA_WEIGHTS`): ("blocks/<name>", layout) pairs, with the stored layer dims ([layers],
  or a circular pipeline's [stages, repeats, layers per stage]) as 'l's."""
  stacked = "l" if cfg.repeats == 1 else "lll"
  return tuple((f"blocks/{n}", stacked + LORA_WEIGHTS[n]) for n in (names or LORA_WEIGHTS))


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


# Pipeline stages: a circular layout's "stage" dim over the stage axis, else the layer stack
# split into contiguous stages (as MaxText's ("layers", "stage")); a mesh without "stage"
# skips both rules.
RULES = (
    ("batch", ("replica", "stage", "data", "fsdp")),
    ("stage", "stage"),
    ("layers", "stage"),
    *_largest_first("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    *_largest_first("vocab_out", VOCAB_OUT_AXES),
    ("norm", None),  # RMSNorm scales: small, replicated on purpose
)


def _block(x, p, cfg: ModelConfig, segment_ids=None, positions=None):
  """One pre-norm Llama block. x: [batch, seq, d_model]; segment_ids, positions: None or
  int32 [batch, seq] (packed rows: attention within a segment, RoPE at its positions; a
  context-parallel order: its positions)."""
  # Keep the residual stream split by batch, or GSPMD may follow the FSDP params' sharding.
  x = fs.constrain_batch(x)
  h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
  # q, k, v and the attention output too: on a multi-slice mesh GSPMD otherwise computed the
  # k/v projections and the output projection's backward for both slices' rows (Llama-1B on
  # 2 x v5p-8: HLO matmul FLOPs 1.105 x the traced step's without these, 1.033 with).
  q, k, v = (_project(h, p, name, cfg) for name in ("q", "k", "v"))
  q = fs.constrain_batch(rope(q, cfg.rope_theta, cfg.rope_scaling, positions))
  k = fs.constrain_batch(rope(k, cfg.rope_theta, cfg.rope_scaling, positions))
  q, k, v = (remat_lib.name_qkv(a) for a in (q, k, fs.constrain_batch(v)))
  o = fs.constrain_batch(fs.attention(q, k, v, causal=True, segment_ids=segment_ids))
  mm = _matmul(cfg)
  x = x + mm("bshk,hkd->bsd", o, p["wo"])
  h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  g = jax.nn.silu(mm("bsd,df->bsf", h, p["w_gate"]))
  u = mm("bsd,df->bsf", h, p["w_up"])
  return x + mm("bsf,fd->bsd", g * u, p["w_down"])


def _matmul(cfg: ModelConfig):
  """einsum(subscripts, x, w) for a block's weight: int8 (`recipes.lm.int8.einsum`) when
  `cfg.int8`, else `fnscale.lora.einsum` (a plain einsum, or a LoRA-bound weight's)."""
  return int8.einsum if cfg.int8 else fs.lora.einsum


def _project(h, p, name: str, cfg: ModelConfig):
  """q, k or v [batch, seq, heads, head_dim]: the projection, its bias and its per-head RMSNorm
  where the params have them (Qwen2's biases, Qwen3's q/k norm)."""
  out = _matmul(cfg)("bsd,dhk->bshk", h, p[f"w{name}"])
  if f"b{name}" in p:
    out = out + p[f"b{name}"].astype(out.dtype)
  if f"{name}_norm" in p:
    out = rms_norm(out, p[f"{name}_norm"], cfg.norm_eps)
  return out


def _config_of(params: dict, tokens, cfg: ModelConfig | None) -> ModelConfig:
  """Static shape facts read off the params (so `apply` needs no config argument); RoPE and
  RMSNorm settings from `cfg` (default Llama 3's)."""
  wq, wk = params["blocks"]["wq"], params["blocks"]["wk"]
  (D, H, K), L = wq.shape[-3:], math.prod(wq.shape[:-3])  # [layers, ...] or pipeline-stacked
  base = ModelConfig(0, 0, 0, 0, 0, 0) if cfg is None else cfg
  return base._replace(layers=L, d_model=D, heads=H, kv_heads=wk.shape[-2], head_size=K,
                       d_mlp=params["blocks"]["w_up"].shape[-1], seq=tokens.shape[1],
                       vocab=params["embed"].shape[0])


def hidden(params: dict, tokens: jax.Array, *, remat: bool | str = False,
           cfg: ModelConfig | None = None, rows: dict | None = None,
           microbatches: int | None = None) -> jax.Array:
  """The final hidden states: tokens int32 [batch, seq] -> [batch, seq, d_model] in the
  params' dtype (after the last RMSNorm, before the output layer). `cfg`: the model's RoPE
  (theta, scaling) and RMSNorm epsilon (default Llama 3's); shapes come from the params.
  `rows`: the batch's optional "segment_ids" and "positions", int32 [batch, seq] (packed
  rows, see `_block`; under a context axis positions are required: `embedding.check_positions`).
  On a mesh with a `stage` axis the blocks run as a pipeline of `microbatches` (default: the
  stages, or none for a batch they don't divide, e.g. one row when sampling)."""
  cfg = _config_of(params, tokens, cfg)
  segment_ids, positions = (rows or {}).get("segment_ids"), (rows or {}).get("positions")
  embedding.check_positions(positions)
  x = embedding.lookup(params["embed"], tokens, RULES)  # ids and activations move
  block = remat_lib.checkpointed(lambda x, p, seg, pos: _block(x, p, cfg, seg, pos), remat)

  def layers(ps, carry):  # packed rows' segment ids and positions travel with their rows
    x, seg, pos = carry
    return jax.lax.scan(lambda x, p: (block(x, p, seg, pos), None), x, ps,
                        unroll=cfg.unroll)[0], seg, pos
  blocks, stages, pp = params["blocks"], _stages(), fs.parallel
  # A circular layout: [stages, repeats, layers per stage, d_model, heads, head_dim].
  repeats = blocks["wq"].shape[1] if blocks["wq"].ndim == 6 else 0
  # A batch too small to cut into microbatches (one row, sampling) runs the blocks in order.
  if stages > 1 and (microbatches or tokens.shape[0] % stages == 0):
    staged = blocks if repeats else pp.stage_layers(blocks, stages)
    x = pp.pipeline(layers, microbatches=microbatches or stages, repeats=repeats or 1)(
        staged, (x, segment_ids, positions))[0]
  else:
    x = layers(pp.unstage_layers(blocks, repeats) if repeats else blocks,
               (x, segment_ids, positions))[0]
  return rms_norm(fs.constrain_batch(x), params["final_norm"], cfg.norm_eps)


def _stages() -> int:
  """Devices on the ambient mesh's "stage" axis (1 without one)."""
  return dict(jax.sharding.get_abstract_mesh().shape).get("stage", 1)


# Mesh axes that split the tokens (a batch's rows, a row's sequence) in RULES and the context
# convention: the loss gathers the hidden states over those it splits the vocabulary over.
TOKEN_AXES = ("replica", "stage", "data", "fsdp", "expert", "context")


def vocab_axes(hidden_shape, vocab: int, axes: tuple[str, ...] = VOCAB_OUT_AXES
               ) -> tuple[str, ...]:
  """The loss's vocabulary axes for hidden states [batch, seq, d] on the ambient mesh:
  `axes` (the output layer's storage split), less those that also split the tokens when a device holds more tokens than
  vocabulary rows. Over such an axis the loss gathers either the tokens' hidden states
  (vocab-parallel) or the output layer's shards (the partitioner, before the loss): it
  gathers the smaller. (Llama 3 at 2 x 131,072 tokens over fsdp=2 x context=4: 32,768
  tokens against 16,032 vocabulary rows per device.)"""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return axes
  size = lambda names: math.prod(mesh.shape.get(a, 1) for a in names)
  tokens = math.prod(hidden_shape[:-1]) // size(TOKEN_AXES)
  if tokens <= vocab // size(axes):
    return axes
  return tuple(a for a in axes if a not in TOKEN_AXES)


def output_layer(params: dict) -> jax.Array:
  """The output projection [d_model, vocab]: `unembed`, or the embedding's transpose when
  tied (no `unembed` leaf)."""
  return params["unembed"] if "unembed" in params else params["embed"].T


def apply(params: dict, tokens: jax.Array, *, remat: bool | str = False,
          cfg: ModelConfig | None = None, segment_ids=None, positions=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq] -> float32 [batch, seq, vocab].

  Computes in the dtype of `params` (a precision policy casts them); RMSNorm statistics,
  rotary angles and logits are float32. `remat`: what each block saves for the backward pass,
  a policy of `recipes.lm.remat` (True: "full", nothing inside a block; False: "none",
  everything; "dots": the matmul outputs, ...). `cfg`: as in `hidden`;
  `segment_ids`, `positions`: int32 [batch, seq], `hidden`'s `rows` (packed rows; sampling
  gives positions). On a mesh with a `stage` axis the pipeline runs the stages' default
  microbatches (`loss_fn` takes others).
  """
  x = hidden(params, tokens, remat=remat, cfg=cfg,
             rows=dict(segment_ids=segment_ids, positions=positions))
  return jnp.einsum("bsd,dv->bsv", x, output_layer(params)).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, *, remat: bool | str = False,
            cfg: ModelConfig | None = None, weighted: bool = False,
            microbatches: int | None = None):
  """Mean next-token cross-entropy in nats. batch: {"inputs", "targets"} int32 [batch, seq],
  ids in [0, cfg.vocab): an id outside gives a nan or wrong loss, not an error (jit cannot
  raise on values); check data of your own with `data.check_token_ids(batch, cfg.vocab)`.
  Optional "positions" and "segment_ids" int32 [batch, seq] (packed rows, the context
  shards' order).

  `fnscale.cross_entropy` walks the tokens in chunks and computes the gradients in its
  forward pass (the plain loss's matmul FLOPs, no logits recomputed): the float32
  [batch, seq, vocab] logits never exist, which at Llama 3's 128256-token vocabulary would
  be the step's largest buffer (2 GiB per 4096-token row). Vocab-parallel over the axes
  the output layer is split on (`VOCAB_OUT_AXES`; a tied embedding is split by vocabulary over
  "tensor" only). `cfg`: as in `hidden` (RoPE and RMSNorm settings; default Llama 3's);
  `microbatches`: the pipeline's, on a mesh with a `stage` axis (`hidden`).

  Packed batches add "segment_ids" and "positions"; weighted=True returns (sum of the
  cross-entropy over targets whose batch["weights"] is nonzero, their count) for
  `fnscale.train_step(..., weighted=True)` (weights are 0 or 1: padding and tokens without
  loss are 0)."""
  x = hidden(params, batch["inputs"], remat=remat, cfg=cfg, rows=batch,
             microbatches=microbatches)
  axes = vocab_axes(x.shape, params["unembed"].shape[1]) if "unembed" in params else (
      "tensor",)
  # [batch, seq, d]: the tokens stay where they are, the sequence split too.
  w, targets = output_layer(params).astype(x.dtype), batch["targets"]
  chunk = (cfg.loss_chunk if cfg is not None else 0) or None
  if not weighted:
    return fs.cross_entropy(x, w, targets, vocab_axes=axes, chunk_size=chunk)
  where = batch["weights"] > 0 if "weights" in batch else jnp.ones(targets.shape, bool)
  total = fs.cross_entropy(x, w, targets, where=where, reduction="sum", vocab_axes=axes,
                           chunk_size=chunk)
  return total, jnp.sum(where.astype(jnp.float32))


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: q, k, v, o and the three MLP matrices per block plus
  the output layer; the embedding lookup and norm scales are not matmuls."""
  K = cfg.head_dim
  attn = cfg.d_model * K * (2 * cfg.heads + 2 * cfg.kv_heads)
  return cfg.layers * (attn + 3 * cfg.d_model * cfg.d_mlp) + cfg.d_model * cfg.vocab


def param_count(cfg: ModelConfig) -> int:
  """Every param: matmul weights, the embedding table (once when tied: it is the output
  layer), the RMSNorm scales, q/k/v biases and q/k norm scales."""
  K, L = cfg.head_dim, cfg.layers
  extra = (L * K * (cfg.heads + 2 * cfg.kv_heads) if cfg.qkv_bias else 0) + (
      2 * L * K if cfg.qk_norm else 0)
  embed = 0 if cfg.tie_embeddings else cfg.vocab * cfg.d_model
  return matmul_params(cfg) + embed + (2 * L + 1) * cfg.d_model + extra


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): 6 N + 12 layers (heads head_dim) seq
  (`fnscale.analysis.model_flops_per_token`, PaLM appendix B). Remat is not counted (MFU)."""
  return fs.analysis.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                           d_model=cfg.heads * cfg.head_dim, seq=cfg.seq)
