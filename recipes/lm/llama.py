"""A Llama-style decoder as a plain pytree and pure functions (same interface as the GPT).

Pre-RMSNorm blocks (Zhang & Sennrich 2019), rotary positions (Su et al. 2021, "RoFormer"),
a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"), grouped-query attention
(Ainslie et al. 2023, "GQA") through `fnscale.attention`, and an output layer untied from the
token embedding, as in Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models"). The
variants of open models are config fields: Llama 3.1/3.2's RoPE frequency scaling and tied
embeddings, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, a head width other than
d_model / heads, and Gemma 2/3's (Gemma Team 2024, arXiv:2408.00118; 2025,
arXiv:2503.19786): RMSNorm by (1 + weight) before and after attention and the MLP, a GeGLU
MLP, the embedding scaled by sqrt(d_model), logit soft-capping, and sliding-window layers
among global ones with their own RoPE base (recipes/lm/hf_maps.py reads them from a Hugging
Face config.json).
This module holds the params and the computation; the shape, sizes and costs are in
`llama_config`, the layout on a mesh in `llama_layout` (both re-exported here).

Module interface (shared with the GPT in `train_lm.py`): `ModelConfig`, `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`. Blocks are stacked along a leading `layers` axis and run under
`lax.scan`; every param leaf has logical axis names for fnscale's rules. Layers of different
kinds (`cfg.windows`: a sliding window or none) scan as groups of one period of their
pattern (Gemma 2: a local and a global layer; Gemma 3: five local, one global), each layer
of a group with its own static window (which the splash kernel's mask needs), the layers
past the last whole period after the scan.

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

import jax
import jax.numpy as jnp

import fnscale as fs
from recipes.lm import embedding, int8
from recipes.lm.layers import RopeScaling, rms_norm, rope, rope_frequencies  # noqa: F401
from recipes.lm import remat as remat_lib
# The rest of the module interface, by job: the shape and its costs, the layout on a mesh.
from recipes.lm.llama_config import (  # noqa: F401
    LLAMA3_VOCAB, LLAMA32_ROPE, REMAT_POLICIES, SIZES, ModelConfig, flops_per_token,
    matmul_params, model_config, named_config, param_count, variant)
from recipes.lm.llama_layout import (  # noqa: F401
    LORA_WEIGHTS, RULES, TOKEN_AXES, VOCAB_OUT_AXES, logical_axes, lora_targets, vocab_axes)


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
  (GPT-2's scheme), RMSNorm scales one (zero with `norm_plus_one`), biases zero. Tied
  embeddings: no `unembed`; q/k/v biases add `bq`, `bk`, `bv`; q/k norm adds `q_norm`,
  `k_norm` (scales over head_dim); post norms add `post_attn_norm`, `post_mlp_norm`.
  """
  L, D, H, G, K, F = (cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim,
                      cfg.d_mlp)
  ks = jax.random.split(key, 9)
  std, res = 0.02, 0.02 / math.sqrt(2 * L)
  norm = jnp.zeros if cfg.norm_plus_one else jnp.ones  # the scale is (1 + weight)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  params = {
      "embed": normal(ks[0], (cfg.vocab, D), std),
      "blocks": {
          **attention_blocks(ks[1:5], (L, D, H, G, K)),
          "attn_norm": norm((L, D)),
          "mlp_norm": norm((L, D)),
          "w_gate": normal(ks[5], (L, D, F), std),
          "w_up": normal(ks[6], (L, D, F), std),
          "w_down": normal(ks[7], (L, F, D), res),
      },
      "final_norm": norm((D,)),
      "unembed": normal(ks[8], (D, cfg.vocab), std),
  }
  extra = {"bq": jnp.zeros((L, H, K)), "bk": jnp.zeros((L, G, K)), "bv": jnp.zeros((L, G, K)),
           "q_norm": norm((L, K)), "k_norm": norm((L, K)),
           "post_attn_norm": norm((L, D)), "post_mlp_norm": norm((L, D))}
  params = variant(params, extra, cfg)
  return {**params, "blocks": _stored_blocks(params["blocks"], cfg)}


def _stored_blocks(blocks: dict, cfg: ModelConfig) -> dict:
  """The block stack as stored: [layers, ...], or [stages, repeats, layers per stage, ...]
  for a circular pipeline (`cfg.repeats` > 1)."""
  if cfg.repeats == 1:
    return blocks
  return fs.parallel.stage_layers(blocks, cfg.stages, cfg.repeats)


def _norm(x, scale, cfg: ModelConfig):
  return rms_norm(x, scale, cfg.norm_eps, 1.0 if cfg.norm_plus_one else 0.0)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _block(x, p, cfg: ModelConfig, segment_ids=None, positions=None, window: int = 0):
  """One pre-norm Llama block. x: [batch, seq, d_model]; segment_ids, positions: None or
  int32 [batch, seq] (packed rows: attention within a segment, RoPE at its positions; a
  context-parallel order: its positions); window: the layer's sliding window (0: none)."""
  # Keep the residual stream split by batch, or GSPMD may follow the FSDP params' sharding.
  x = fs.constrain_batch(x)
  h = _norm(x, p["attn_norm"], cfg)
  # q, k, v and the attention output too: on a multi-slice mesh GSPMD otherwise computed the
  # k/v projections and the output projection's backward for both slices' rows (Llama-1B on
  # 2 x v5p-8: HLO matmul FLOPs 1.105 x the traced step's without these, 1.033 with).
  q, k, v = (_project(h, p, name, cfg) for name in ("q", "k", "v"))
  theta, scaling = ((cfg.local_rope_theta, None) if window and cfg.local_rope_theta
                    else (cfg.rope_theta, cfg.rope_scaling))
  q = fs.constrain_batch(rope(q, theta, scaling, positions))
  k = fs.constrain_batch(rope(k, theta, scaling, positions))
  q, k, v = (remat_lib.name_qkv(a) for a in (q, k, fs.constrain_batch(v)))
  o = fs.constrain_batch(fs.attention(
      q, k, v, causal=True, segment_ids=segment_ids,
      sliding_window=(window - 1, 0) if window else None, scale=cfg.attn_scale or None,
      soft_cap=cfg.attn_soft_cap or None))
  mm = _matmul(cfg)
  x = x + _post_norm(mm("bshk,hkd->bsd", o, p["wo"]), p, "post_attn_norm", cfg)
  h = _norm(x, p["mlp_norm"], cfg)
  g = _ACTIVATIONS[cfg.activation](mm("bsd,df->bsf", h, p["w_gate"]))
  u = mm("bsd,df->bsf", h, p["w_up"])
  return x + _post_norm(mm("bsf,fd->bsd", g * u, p["w_down"]), p, "post_mlp_norm", cfg)


def _post_norm(y, p, name: str, cfg: ModelConfig):
  return _norm(y, p[name], cfg) if name in p else y


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
    out = _norm(out, p[f"{name}_norm"], cfg)
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
  (theta, scaling), RMSNorm epsilon and variant options (Gemma's; default Llama 3's); shapes
  come from the params.
  `rows`: the batch's optional "segment_ids" and "positions", int32 [batch, seq] (packed
  rows, see `_block`; under a context axis positions are required: `embedding.check_positions`).
  On a mesh with a `stage` axis the blocks run as a pipeline of `microbatches` (default: the
  stages, or none for a batch they don't divide, e.g. one row when sampling)."""
  cfg = _config_of(params, tokens, cfg)
  segment_ids, positions = (rows or {}).get("segment_ids"), (rows or {}).get("positions")
  embedding.check_positions(positions)
  x = embedding.lookup(params["embed"], tokens, RULES)  # ids and activations move
  if cfg.embed_scale:  # in the compute dtype, as Gemma's reference
    x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
  block = {w: remat_lib.checkpointed(
      lambda x, p, seg, pos, w=w: _block(x, p, cfg, seg, pos, w), remat)
      for w in set(cfg.windows or (0,))}

  def layers(ps, carry):  # packed rows' segment ids and positions travel with their rows
    x, seg, pos = carry
    return _scan_layers(ps, x, block, _pattern(cfg, ps), seg, pos, cfg.unroll), seg, pos
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
  return _norm(fs.constrain_batch(x), params["final_norm"], cfg)


def _pattern(cfg: ModelConfig, ps: dict) -> tuple[int, ...]:
  """The windows of the n layers of `ps` (all of them, or a pipeline stage's share):
  every share must have the same, as one program runs them all."""
  n, L = ps["wq"].shape[0], cfg.layers
  windows = cfg.windows or (0,) * L
  if len(windows) != L or not all(isinstance(w, int) and w >= 0 for w in windows):
    raise fs.InputError(f"ModelConfig.windows={windows} for {L} layers; expected one int "
                        ">= 0 per layer (0: no window).")
  if windows != windows[:n] * (L // n):
    raise fs.InputError(
        f"ModelConfig.windows={windows}: a pipeline's every {n} layers run one program, "
        "and these shares' windows differ; fix: stages (and repeats) whose layers per "
        "share are a multiple of the windows' period.")
  return windows[:n]


def _scan_layers(ps: dict, x, block: dict, windows: tuple[int, ...], seg, pos, unroll):
  """x through the stacked layers `ps` [n, ...], layer i by block[windows[i]]: one scan
  over the layers when they are of one kind, else over groups of one period of `windows`
  (each layer of a group with its static window), the layers past the last whole period
  after it."""
  n = len(windows)
  period = next(p for p in range(1, n + 1)
                if all(windows[i] == windows[i % p] for i in range(n)))
  if period == 1:
    return jax.lax.scan(lambda x, p: (block[windows[0]](x, p, seg, pos), None), x, ps,
                        unroll=unroll)[0]
  groups = n // period
  take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)

  def group(x, g):
    for j in range(period):
      x = block[windows[j]](x, take(g, j), seg, pos)
    return x, None
  stacked = jax.tree.map(
      lambda a: a[:groups * period].reshape(groups, period, *a.shape[1:]), ps)
  x = jax.lax.scan(group, x, stacked, unroll=unroll)[0]
  for i in range(groups * period, n):
    x = block[windows[i]](x, take(ps, i), seg, pos)
  return x


def _stages() -> int:
  """Devices on the ambient mesh's "stage" axis (1 without one)."""
  return dict(jax.sharding.get_abstract_mesh().shape).get("stage", 1)


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
  # Gemma 2's final soft-capping, in float32 (transformers caps in the params' dtype).
  logits = jnp.einsum("bsd,dv->bsv", x, output_layer(params)).astype(jnp.float32)
  cap = cfg.logit_soft_cap if cfg is not None else 0.0
  return cap * jnp.tanh(logits / cap) if cap else logits


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
  cap = (cfg.logit_soft_cap if cfg is not None else 0.0) or None
  if not weighted:
    return fs.cross_entropy(x, w, targets, vocab_axes=axes, chunk_size=chunk, soft_cap=cap)
  where = batch["weights"] > 0 if "weights" in batch else jnp.ones(targets.shape, bool)
  total = fs.cross_entropy(x, w, targets, where=where, reduction="sum", vocab_axes=axes,
                           chunk_size=chunk, soft_cap=cap)
  return total, jnp.sum(where.astype(jnp.float32))
