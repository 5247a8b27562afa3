"""Mixture-of-experts decoders as plain pytrees and pure functions (the Llama interface).

Llama-style blocks (`recipes/lm/llama.py`: pre-RMSNorm, rotary positions, grouped-query
attention through `fnscale.attention`) whose feed-forward is a routed mixture of SwiGLU
experts (`fnscale.parallel.moe`), in two styles:

- Mixtral (Jiang et al. 2024, "Mixtral of Experts"): 8 experts as wide as a dense MLP, 2 per
  token, their weights renormalised over the two.
- Qwen3-MoE (Qwen team 2025, "Qwen3 Technical Report"): Mixtral's layer with many narrow
  experts (128 of width 768, 8 per token in Qwen3-30B-A3B), their weights renormalised or
  not (`norm_topk_prob`), and Qwen3's attention: an RMSNorm over each head of q and k
  (`qk_norm`) and a head size of its own (`head_size`).
- DeepSeekMoE (Dai et al. 2024, "DeepSeekMoE"; DeepSeek-V2): many fine-grained experts
  (a quarter of the width or less), 6 per token with their softmax weights as they are,
  plus shared experts that every token passes through. Attention here is grouped-query,
  not DeepSeek-V2's multi-head latent attention, and every layer is an MoE layer (DeepSeek
  makes its first one dense).

Module interface (shared with `gpt.py` and `llama.py`): `ModelConfig`, `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`; and `loss_and_aux(params, batch, *, remat)`, the training objective
(cross-entropy plus the router losses) with the layers' expert load for the run's metrics
(`HAS_AUX`; `load_metrics` reads them). Expert weights carry the logical axis "expert" (rule
("expert", "expert"): the mesh's expert axis) besides "embed" (FSDP) and "mlp" (tensor).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fnscale as fs
from recipes.lm import embedding, layers, llama

HAS_AUX = True  # `loss_and_aux` returns the expert load beside the loss


class ModelConfig(NamedTuple):
  """Shape of the decoder.

  `experts` routed experts of hidden width `d_ff`, `k` of them per token; `shared` shared
  experts (each `d_ff` wide, run as one SwiGLU of width shared x d_ff) every token passes
  through; `capacity_factor` None for the dropless layer; `normalize` renormalises the k
  routing weights (Mixtral) or keeps the softmax's (DeepSeek); `balance_coef` and `z_coef`
  weigh the load-balance loss and the router z-loss in the training loss. head_dim =
  `head_size` if set, else d_model / heads; `qk_norm`: RMSNorm over head_dim of q and k
  before RoPE (Qwen3-MoE); `rope_scaling` as the Llama's (`layers.rope`).
  """
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  d_ff: int
  experts: int
  k: int
  seq: int
  vocab: int = 256
  shared: int = 0
  capacity_factor: float | None = None
  normalize: bool = True
  balance_coef: float = 0.01
  z_coef: float = 0.0
  rope_theta: float = 1_000_000.0
  norm_eps: float = 1e-5
  head_size: int = 0
  qk_norm: bool = False
  rope_scaling: layers.RopeScaling | layers.Yarn | None = None

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.heads


# Mixtral-8x7B from Mistral's published config (32 layers, d 4096, 32 heads, 8 KV heads,
# expert FFN 14336, 8 experts, 2 per token, vocabulary 32000, RoPE base 1e6,
# router_aux_loss_coef 0.02). DeepSeekMoE-16B's routed part (arXiv:2401.06066 table; its HF
# config: 28 layers, d 2048, 16 heads, 64 experts of width 1408, 6 per token, 2 shared,
# vocabulary 102400, aux loss 0.001), with grouped-query attention in place of its own.
# Qwen3-30B-A3B from its config.json (48 layers, d 2048, 32 heads of 128, 4 KV heads, 128
# experts of width 768, 8 per token renormalised, vocabulary 151936, RoPE base 1e6, aux loss
# 0.001: x k here, as Mixtral's, `hf_maps`). The tiny ones are byte-level, for a CPU.
SIZES = {
    "moe-tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=128, experts=8, k=2),
    "moe-deepseek-tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=32, experts=16,
                              k=4, shared=1, normalize=False),
    "moe-mixtral-8x7b": dict(layers=32, d_model=4096, heads=32, kv_heads=8, d_ff=14336,
                             experts=8, k=2, vocab=32_000, balance_coef=0.02),
    "moe-qwen3-tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=32, experts=16,
                           k=4, head_size=32, qk_norm=True, balance_coef=0.004),
    "moe-qwen3-30b-a3b": dict(layers=48, d_model=2048, heads=32, kv_heads=4, d_ff=768,
                              experts=128, k=8, head_size=128, qk_norm=True, vocab=151_936,
                              balance_coef=0.008, norm_eps=1e-6),
    "moe-deepseek-16b": dict(layers=28, d_model=2048, heads=16, kv_heads=16, d_ff=1408,
                             experts=64, k=6, shared=2, vocab=102_400, normalize=False,
                             balance_coef=0.001, rope_theta=10_000.0),
}


def model_config(size: str, seq: int, **overrides) -> ModelConfig:
  """The named shape at sequence length `seq`; `overrides` replace fields (e.g. layers=2).

  Raises:
    FnscaleError: an unknown size or override field, a bad seq, or experts / k / capacity
      that can't work (`fnscale.ExpertError`).
  """
  cfg = llama.named_config(ModelConfig, SIZES, "MoE", size, seq, overrides)
  if not 1 <= cfg.k <= cfg.experts:
    raise fs.ExpertError(f"model_config: k={cfg.k} experts per token with {cfg.experts} "
                         "experts; expected 1 <= k <= experts; fix: lower k.")
  if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
    raise fs.ExpertError(f"model_config: capacity_factor={cfg.capacity_factor!r}; expected "
                         "> 0, or None for the dropless layer.")
  return cfg


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """float32 params; block params stacked along a leading `layers` axis for `lax.scan`.

  Weights N(0, 0.02), residual output projections (attention's and the experts' down
  projections) scaled by 1/sqrt(2 layers), RMSNorm scales one.
  """
  L, D, H, G, K, F, E = (cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim,
                         cfg.d_ff, cfg.experts)
  ks = jax.random.split(key, 13)
  std, res = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  blocks = {
      **llama.attention_blocks(ks[1:5], (L, D, H, G, K)),
      "mlp_norm": jnp.ones((L, D)),
      "router": normal(ks[5], (L, D, E), std),
      "w_gate": normal(ks[6], (L, E, D, F), std),
      "w_up": normal(ks[7], (L, E, D, F), std),
      "w_down": normal(ks[8], (L, E, F, D), res),
  }
  if cfg.qk_norm:
    blocks.update(q_norm=jnp.ones((L, K)), k_norm=jnp.ones((L, K)))
  if cfg.shared:
    S = cfg.shared * F
    blocks.update(shared_gate=normal(ks[9], (L, D, S), std),
                  shared_up=normal(ks[10], (L, D, S), std),
                  shared_down=normal(ks[11], (L, S, D), res))
  return {"embed": normal(ks[0], (cfg.vocab, D), std), "blocks": blocks,
          "final_norm": jnp.ones((D,)), "unembed": normal(ks[12], (D, cfg.vocab), std)}


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  blocks = {
      "attn_norm": ("layers", "norm"),
      "wq": ("layers", "embed", "heads", "head_dim"),
      "wk": ("layers", "embed", "kv_heads", "head_dim"),
      "wv": ("layers", "embed", "kv_heads", "head_dim"),
      "wo": ("layers", "heads", "head_dim", "embed"),
      "mlp_norm": ("layers", "norm"),
      "router": ("layers", "embed", None),
      "w_gate": ("layers", "expert", "embed", "mlp"),
      "w_up": ("layers", "expert", "embed", "mlp"),
      "w_down": ("layers", "expert", "mlp", "embed"),
  }
  if cfg.qk_norm:
    blocks.update(q_norm=("layers", "norm"), k_norm=("layers", "norm"))
  if cfg.shared:
    blocks.update(shared_gate=("layers", "embed", "mlp"), shared_up=("layers", "embed", "mlp"),
                  shared_down=("layers", "mlp", "embed"))
  return {"embed": ("vocab", "embed"), "blocks": blocks, "final_norm": ("norm",),
          "unembed": (None, "vocab_out")}


# Llama's rules plus the experts: split over the mesh's "expert" axis, and the batch over it
# too, so attention and the other layers are data parallel there; their weights (and the
# expert weights' d_model on an fsdp axis) are FSDP-sharded over fsdp and expert together,
# as MaxText's "embed" rule does: each expert device holds a share of them, not a replica.
# The output layer is split by vocabulary over every one of fsdp, expert and tensor the
# mesh has (`fnscale.cross_entropy(..., vocab_axes=VOCAB_OUT_AXES)`). A rule naming an
# axis the mesh lacks is skipped, so each list runs from the most axes to the fewest.
# A "context" axis (the sequence split) holds params split as fsdp does (as in llama.py).
VOCAB_OUT_AXES = ("fsdp", "expert", "context", "tensor")
_largest_first = lambda name, axes: tuple(
    (name, c) for n in range(len(axes), 0, -1) for c in itertools.combinations(axes, n))
RULES = ((("batch", ("replica", "data", "fsdp", "expert")), ("expert", "expert"))
         + _largest_first("embed", ("fsdp", "expert", "context"))
         + _largest_first("vocab_out", VOCAB_OUT_AXES)
         + tuple(r for r in llama.RULES if r[0] not in ("batch", "embed", "vocab_out")))


def _moe(h, p, cfg: ModelConfig):
  """The feed-forward: routed experts (+ shared ones). h: [batch, seq, d_model]."""
  out, aux = fs.parallel.moe(h, {k: p[k] for k in ("router", "w_gate", "w_up", "w_down")}, cfg.k,
                         capacity_factor=cfg.capacity_factor, normalize=cfg.normalize)
  if cfg.shared:
    g = jax.nn.silu(jnp.einsum("bsd,df->bsf", h, p["shared_gate"]))
    u = jnp.einsum("bsd,df->bsf", h, p["shared_up"])
    out = out + jnp.einsum("bsf,fd->bsd", g * u, p["shared_down"])
  return out, aux


def _block(x, p, cfg: ModelConfig, segment_ids=None, positions=None):
  """One pre-norm block with an MoE feed-forward: x [batch, seq, d] -> (x, MoEAux).
  `segment_ids`, `positions`: None or int32 [batch, seq] (as `llama._block`)."""
  x = fs.constrain_batch(x)
  h = layers.rms_norm(x, p["attn_norm"], cfg.norm_eps)
  rope = lambda y: layers.rope(y, cfg.rope_theta, cfg.rope_scaling, positions=positions)

  def project(name):  # q, k or v [batch, seq, heads, head_dim], Qwen3's per-head norm
    out = jnp.einsum("bsd,dhk->bshk", h, p[f"w{name}"])
    norm = p.get(f"{name}_norm")
    return out if norm is None else layers.rms_norm(out, norm, cfg.norm_eps)
  q = fs.constrain_batch(rope(project("q")))
  k = fs.constrain_batch(rope(project("k")))
  v = fs.constrain_batch(project("v"))
  o = fs.constrain_batch(fs.attention(q, k, v, causal=True, segment_ids=segment_ids))
  x = x + jnp.einsum("bshk,hkd->bsd", o, p["wo"])
  out, aux = _moe(layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, cfg)
  return x + out, aux


_ROUTING = ("k", "capacity_factor", "normalize", "balance_coef", "z_coef", "rope_theta",
            "norm_eps")


def _config_of(params: dict, tokens, cfg: ModelConfig | None) -> ModelConfig:
  """The config of a call: `cfg` (its seq set to the tokens'), else the shapes read off the
  params with the routing choices (k, capacity, ...) of the one size in `SIZES` of those
  shapes (the interface's `apply(params, tokens)` has no config argument).

  Raises:
    InputError: no cfg and no size (or several that route differently) of these shapes.
  """
  if cfg is not None:
    return cfg._replace(seq=tokens.shape[1])
  b = params["blocks"]
  L, D, H, K = b["wq"].shape
  E, F = b["w_gate"].shape[1], b["w_gate"].shape[-1]
  shape = dict(d_model=D, heads=H, kv_heads=b["wk"].shape[2], d_ff=F, experts=E,
               shared=b["shared_gate"].shape[-1] // F if "shared_gate" in b else 0,
               head_size=0 if K == D // H else K, qk_norm="q_norm" in b)
  fields = ModelConfig._field_defaults
  sizes = [{**fields, **s} for s in SIZES.values()
           if all({**fields, **s}[k] == v for k, v in shape.items())]
  routes = {tuple(s[k] for k in _ROUTING) for s in sizes}
  if len(routes) != 1:
    raise fs.InputError(
        f"moe: params of shape {shape} match {len(sizes)} sizes of SIZES with "
        f"{len(routes)} routings; fix: pass cfg= (a ModelConfig) to say how they route.")
  return ModelConfig(layers=L, seq=tokens.shape[1], vocab=params["unembed"].shape[-1],
                     **shape, **dict(zip(_ROUTING, routes.pop())))


def hidden(params: dict, tokens: jax.Array, *, remat: bool = False,
           cfg: ModelConfig | None = None, segment_ids=None,
           positions=None) -> tuple[jax.Array, dict]:
  """(final hidden states [batch, seq, d_model] after the last RMSNorm, per-layer aux:
  `MoEAux` fields stacked over layers). `segment_ids`, `positions`: int32 [batch, seq]
  (as llama's; positions are required under a context axis: `embedding.check_positions`)."""
  cfg = _config_of(params, tokens, cfg)
  embedding.check_positions(positions)
  x = embedding.lookup(params["embed"], tokens, RULES)
  block = lambda x, p: _block(x, p, cfg, segment_ids, positions)
  block = jax.checkpoint(block) if remat else block
  x, aux = jax.lax.scan(block, x, params["blocks"])
  return layers.rms_norm(fs.constrain_batch(x), params["final_norm"], cfg.norm_eps), aux


def apply(params: dict, tokens: jax.Array, *, remat: bool = False,
          cfg: ModelConfig | None = None, segment_ids=None, positions=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq] -> float32 [batch, seq, vocab]. `cfg`:
  the routing choices (default: those of the size of these shapes, `_config_of`);
  `segment_ids`, `positions`: as `hidden`."""
  x, _ = hidden(params, tokens, remat=remat, cfg=cfg, segment_ids=segment_ids,
                positions=positions)
  return jnp.einsum("bsd,dv->bsv", x, params["unembed"]).astype(jnp.float32)


def loss_and_aux(params: dict, batch: dict, *, remat: bool = False,
                 cfg: ModelConfig | None = None) -> tuple[jax.Array, dict]:
  """(training loss, aux): mean next-token cross-entropy (nats) + balance_coef x the layers'
  mean load-balance loss + z_coef x their mean router z-loss; aux: "cross_entropy",
  "load_balance_loss", "router_z_loss" (float32, layer means), "tokens_per_expert" (int32
  [layers, experts], copies routed), "dropped" (int32). `cfg`: as `apply`'s."""
  cfg = _config_of(params, batch["inputs"], cfg)
  x, aux = hidden(params, batch["inputs"], remat=remat, cfg=cfg,
                  segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
  return objective(x, params["unembed"], batch["targets"], aux, cfg.balance_coef, cfg.z_coef)


def objective(x, unembed, targets, aux, balance_coef: float, z_coef: float = 0.0):
  """`loss_and_aux`'s (loss, aux) from the final hidden states x [batch, seq, d], the output
  layer and the layers' stacked `MoEAux` (shared with `recipes.lm.deepseek`)."""
  ce = fs.cross_entropy(x, unembed.astype(x.dtype), targets,
                        vocab_axes=llama.vocab_axes(x.shape, unembed.shape[1], VOCAB_OUT_AXES))
  balance, z = jnp.mean(aux.load_balance_loss), jnp.mean(aux.router_z_loss)
  loss = ce + balance_coef * balance + z_coef * z
  return loss, {"cross_entropy": ce, "load_balance_loss": balance, "router_z_loss": z,
                "tokens_per_expert": aux.tokens_per_expert, "dropped": jnp.sum(aux.dropped)}


def loss_fn(params: dict, batch: dict, *, remat: bool = False,
            cfg: ModelConfig | None = None) -> jax.Array:
  """Mean next-token cross-entropy in nats (what evals report; the training objective adds
  the router losses: `loss_and_aux`). batch: {"inputs", "targets"} int32 [batch, seq], and
  optional "positions", "segment_ids" (int32 [batch, seq]: the context shards' order,
  `fnscale.parallel.context.reorder_batch`; packed rows' documents)."""
  return loss_and_aux(params, batch, remat=remat, cfg=cfg)[1]["cross_entropy"]


def load_metrics(aux: dict) -> dict:
  """The expert load of a step's `loss_and_aux` aux (summed over its shards and
  microbatches), as floats for a run's log: the busiest expert's copies over the mean
  (1.0: balanced; the worst layer), the balance and z losses, copies dropped."""
  load = np.asarray(aux["tokens_per_expert"], np.float64)
  ratio = load.max(-1) / np.maximum(load.mean(-1), 1e-9)
  return {"moe/load_max_over_mean": float(ratio.max()), **{
      f"moe/{k}": float(aux[k]) for k in ("load_balance_loss", "router_z_loss", "dropped",
                                          "cross_entropy")}}


def active_matmul_params(cfg: ModelConfig) -> int:
  """Weights a token multiplies: attention's q, k, v, o, the router, its k routed experts
  and the shared ones (three matrices each) per block, plus the output layer."""
  K = cfg.head_dim
  attn = cfg.d_model * K * (2 * cfg.heads + 2 * cfg.kv_heads)
  ffn = 3 * cfg.d_model * cfg.d_ff * (cfg.k + cfg.shared) + cfg.d_model * cfg.experts
  return cfg.layers * (attn + ffn) + cfg.d_model * cfg.vocab


def matmul_params(cfg: ModelConfig) -> int:
  """Every matmul weight, all experts' included (what the optimizer holds)."""
  extra = 3 * cfg.d_model * cfg.d_ff * (cfg.experts - cfg.k)
  return active_matmul_params(cfg) + cfg.layers * extra


def param_count(cfg: ModelConfig) -> int:
  """Every param: matmul weights, the embedding table and the RMSNorm scales (Qwen3's q
  and k norms: head_dim each per layer)."""
  qk = 2 * cfg.layers * cfg.head_dim if cfg.qk_norm else 0
  return (matmul_params(cfg) + cfg.vocab * cfg.d_model + (2 * cfg.layers + 1) * cfg.d_model
          + qk)


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token from the active params: 6 x active + 12 layers (heads
  head_dim) seq (`fnscale.analysis.model_flops_per_token`, PaLM appendix B); the
  experts a token doesn't visit cost it nothing. Remat is not counted (MFU)."""
  return fs.analysis.model_flops_per_token(params=active_matmul_params(cfg), layers=cfg.layers,
                                           d_model=cfg.heads * cfg.head_dim, seq=cfg.seq)
