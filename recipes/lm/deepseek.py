"""A DeepSeek-V3-style decoder (DeepSeek-AI 2024, arXiv:2412.19437) as plain pytrees and pure
functions (the MoE models' interface: `recipes/lm/moe.py`).

- Multi-head latent attention (MLA, DeepSeek-V2 section 2.1): keys and values come from one
  low-rank latent per token, `c = RMSNorm(h W_kv_a)` of `kv_lora` dims, expanded per head
  (`W_kv_b`: a no-position key part and the value); a separate `rope_dim`-wide key part with
  rotary positions is shared by every head; queries go through their own latent of `q_lora`
  dims (0: one projection). Values are `v_dim` wide, keys `nope + rope_dim`: the values are
  zero-padded to the key width for `fnscale.attention` and the padding cut after (exact).
- The first `dense_layers` blocks have a SwiGLU MLP of `d_mlp`; the rest route each token to
  `k` of `experts` experts of width `d_ff` by sigmoid affinity, limited to the `topk_groups`
  best of `groups` expert groups, weights renormalised and scaled by `routed_scale`, plus
  `shared` always-on experts (`fnscale.parallel.Scoring`).
- Auxiliary-loss-free balancing: each MoE layer has a selection bias per expert
  (`router_bias`, which only steers the choice, so its gradient is zero) that moves by
  `bias_rate` towards the mean load after every step (`update_bias`, on the step's
  `tokens_per_expert`); `balance_coef` (0 by default) adds the usual balance loss on top.

Rotary dimensions are read in DeepSeek's interleaved pairs when `rope_interleave` (its
checkpoints'), scaled by `rope_scaling` when set (DeepSeek-V3's is YaRN's, factor 40): the
softmax scale 1/sqrt(nope + rope_dim) is then multiplied by mscale(factor, mscale_all_dim)^2
as DeepSeek's reference does (`softmax_scale`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fnscale as fs
from recipes.lm import embedding, layers, llama, moe

HAS_AUX = True  # `loss_and_aux` returns the expert load beside the loss


class ModelConfig(NamedTuple):
  """Shape of the decoder (module docstring); `vocab` output classes, `seq` tokens a row."""
  layers: int
  dense_layers: int
  d_model: int
  heads: int
  kv_lora: int
  nope: int
  rope_dim: int
  v_dim: int
  d_mlp: int
  d_ff: int
  experts: int
  k: int
  seq: int
  vocab: int = 256
  q_lora: int = 0
  shared: int = 1
  groups: int = 1
  topk_groups: int = 0
  routed_scale: float = 1.0
  normalize: bool = True
  bias_rate: float = 0.001
  balance_coef: float = 0.0
  rope_theta: float = 10_000.0
  rope_interleave: bool = True
  norm_eps: float = 1e-6
  rope_scaling: layers.RopeScaling | layers.Yarn | None = None

  @property
  def head_dim(self) -> int:  # the key and query width
    return self.nope + self.rope_dim

  @property
  def kv_heads(self) -> int:  # every head has its own expanded key and value
    return self.heads


# The tiny one is byte-level and trains on a CPU, its bias moving 10x DeepSeek-V3's 0.001 a
# step (a run of a few hundred steps balances within it). DeepSeek-V3's own shape (its config.json:
# 61 layers, the first 3 dense, d 7168, 128 heads, q latent 1536, kv latent 512, 128 + 64
# key dims, 128 value dims, MLP 18432, 256 experts of 2048 in 8 groups, 4 groups a token, 8
# experts a token, 1 shared, scale 2.5, vocabulary 129280) is for planning.
SIZES = {
    "deepseek-tiny": dict(layers=3, dense_layers=1, d_model=64, heads=4, q_lora=32, kv_lora=32,
                          nope=16, rope_dim=8, v_dim=16, d_mlp=128, d_ff=32, experts=8, k=2,
                          groups=4, topk_groups=2, routed_scale=2.5, bias_rate=0.01),
    "deepseek-v3": dict(layers=61, dense_layers=3, d_model=7168, heads=128, q_lora=1536,
                        kv_lora=512, nope=128, rope_dim=64, v_dim=128, d_mlp=18432, d_ff=2048,
                        experts=256, k=8, groups=8, topk_groups=4, routed_scale=2.5,
                        vocab=129_280),
}


def model_config(size: str, seq: int, **overrides) -> ModelConfig:
  """The named shape at sequence length `seq`; `overrides` replace fields.

  Raises:
    FnscaleError: an unknown size or field, a bad seq, or experts / groups / k that can't
      route (`fnscale.ExpertError`).
  """
  cfg = llama.named_config(ModelConfig, SIZES, "DeepSeek", size, seq, overrides)
  if not (1 <= cfg.k <= cfg.experts and cfg.experts % cfg.groups == 0
          and 0 <= cfg.topk_groups <= cfg.groups and 0 <= cfg.dense_layers < cfg.layers):
    raise fs.ExpertError(
        f"model_config: k={cfg.k} of experts={cfg.experts} in groups={cfg.groups} "
        f"(topk_groups={cfg.topk_groups}), dense_layers={cfg.dense_layers} of {cfg.layers}; "
        "expected 1 <= k <= experts, groups dividing experts, topk_groups <= groups and at "
        "least one MoE layer.")
  return cfg


def _attention_params(keys, cfg: ModelConfig, n: int, res: float) -> dict:
  D, H, Q, C, R = cfg.d_model, cfg.heads, cfg.q_lora, cfg.kv_lora, cfg.rope_dim
  normal = lambda k, shape, s=0.02: s * jax.random.normal(k, shape, jnp.float32)
  q = ({"wq_a": normal(keys[0], (n, D, Q)), "q_norm": jnp.ones((n, Q)),
        "wq_b": normal(keys[1], (n, Q, H, cfg.head_dim))} if Q
       else {"wq": normal(keys[0], (n, D, H, cfg.head_dim))})
  return {"attn_norm": jnp.ones((n, D)), **q, "wkv_a": normal(keys[2], (n, D, C + R)),
          "kv_norm": jnp.ones((n, C)), "wkv_b": normal(keys[3], (n, C, H, cfg.nope + cfg.v_dim)),
          "wo": normal(keys[4], (n, H, cfg.v_dim, D), res), "mlp_norm": jnp.ones((n, D))}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """float32 params: `dense` (the first `dense_layers` blocks) and `blocks` (the MoE ones),
  each stacked along a leading layers axis for `lax.scan`. Weights N(0, 0.02), residual
  output projections by 1/sqrt(2 layers), norms one, the selection bias zero."""
  ld, lm, D, E, F = cfg.dense_layers, cfg.layers - cfg.dense_layers, cfg.d_model, cfg.experts, cfg.d_ff
  ks = iter(jax.random.split(key, 24))
  res = 0.02 / math.sqrt(2 * cfg.layers)
  normal = lambda shape, s=0.02: s * jax.random.normal(next(ks), shape, jnp.float32)
  S = cfg.shared * F
  blocks = {**_attention_params([next(ks) for _ in range(5)], cfg, lm, res),
            "router": normal((lm, D, E)), "router_bias": jnp.zeros((lm, E)),
            "w_gate": normal((lm, E, D, F)), "w_up": normal((lm, E, D, F)),
            "w_down": normal((lm, E, F, D), res)}
  if S:
    blocks.update(shared_gate=normal((lm, D, S)), shared_up=normal((lm, D, S)),
                  shared_down=normal((lm, S, D), res))
  out = {"embed": normal((cfg.vocab, D)), "blocks": blocks, "final_norm": jnp.ones((D,)),
         "unembed": normal((D, cfg.vocab))}
  if ld:
    out["dense"] = {**_attention_params([next(ks) for _ in range(5)], cfg, ld, res),
                    "w_gate": normal((ld, D, cfg.d_mlp)), "w_up": normal((ld, D, cfg.d_mlp)),
                    "w_down": normal((ld, cfg.d_mlp, D), res)}
  return out


_ATTENTION_AXES = {
    "attn_norm": ("layers", "norm"), "wq": ("layers", "embed", "heads", "head_dim"),
    "wq_a": ("layers", "embed", None), "q_norm": ("layers", None),
    "wq_b": ("layers", None, "heads", "head_dim"), "wkv_a": ("layers", "embed", None),
    "kv_norm": ("layers", None), "wkv_b": ("layers", None, "heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"), "mlp_norm": ("layers", "norm")}


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`): the MoE models' rules
  (`moe.RULES`: experts over "expert", "embed" FSDP, heads and MLP widths tensor-split)."""
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  experts = {"router": ("layers", "embed", None), "router_bias": ("layers", None),
             "w_gate": ("layers", "expert", "embed", "mlp"),
             "w_up": ("layers", "expert", "embed", "mlp"),
             "w_down": ("layers", "expert", "mlp", "embed"),
             "shared_gate": ("layers", "embed", "mlp"), "shared_up": ("layers", "embed", "mlp"),
             "shared_down": ("layers", "mlp", "embed")}
  mlp = {k: v for k, v in experts.items() if k.startswith("shared")}
  named = {**_ATTENTION_AXES, **experts}
  out = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "unembed": (None, "vocab_out"),
         "blocks": {k: named[k] for k in params["blocks"]}}
  if "dense" in params:
    dense = {**_ATTENTION_AXES, **{k.replace("shared_", "w_"): v for k, v in mlp.items()}}
    out["dense"] = {k: dense[k] for k in params["dense"]}
  return out


RULES = moe.RULES
VOCAB_OUT_AXES = moe.VOCAB_OUT_AXES


def _rope(x, cfg: ModelConfig, positions):
  """Rotary positions on x [..., rope_dim], its pairs read interleaved (x0, x1), (x2, x3)...
  when `cfg.rope_interleave` (DeepSeek's layout: rotated as `layers.rope`'s halves after
  taking the even then the odd dims, which is what its checkpoints' rotation computes)."""
  if cfg.rope_interleave:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  return layers.rope(x, cfg.rope_theta, cfg.rope_scaling, positions=positions)


def softmax_scale(cfg: ModelConfig) -> float:
  """The attention logits' scale: 1/sqrt(head_dim), times mscale(factor, mscale_all_dim)^2
  under YaRN with mscale_all_dim given (the no-position dims get YaRN's magnitude correction
  too). DeepSeek-V3 (factor 40, mscale_all_dim 1): 1.3689 / sqrt(192)."""
  s = cfg.rope_scaling
  mscale = (layers.yarn_mscale(s.factor, s.mscale_all_dim)
            if isinstance(s, layers.Yarn) and s.mscale_all_dim else 1.0)
  return 1.0 / math.sqrt(cfg.head_dim) * mscale ** 2


def _mla(x, p, cfg: ModelConfig, segment_ids, positions):
  """Multi-head latent attention: x [batch, seq, d] -> [batch, seq, d] (module docstring)."""
  eps, H = cfg.norm_eps, cfg.heads
  h = layers.rms_norm(x, p["attn_norm"], eps)
  if cfg.q_lora:
    q_latent = layers.rms_norm(jnp.einsum("bsd,dq->bsq", h, p["wq_a"]), p["q_norm"], eps)
    q = jnp.einsum("bsq,qhk->bshk", q_latent, p["wq_b"])
  else:
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"])
  latent, k_rot = jnp.split(jnp.einsum("bsd,dc->bsc", h, p["wkv_a"]), [cfg.kv_lora], axis=-1)
  kv = jnp.einsum("bsc,chk->bshk", layers.rms_norm(latent, p["kv_norm"], eps), p["wkv_b"])
  k_nope, v = jnp.split(kv, [cfg.nope], axis=-1)
  k_rot = jnp.broadcast_to(_rope(k_rot[:, :, None], cfg, positions), (*k_nope.shape[:3],
                                                                      cfg.rope_dim))
  q = jnp.concatenate([q[..., :cfg.nope], _rope(q[..., cfg.nope:], cfg, positions)], -1)
  k = jnp.concatenate([k_nope, k_rot], -1)
  pad = cfg.head_dim - cfg.v_dim  # values zero-padded to the key width: the same output
  v = jnp.pad(v, ((0, 0),) * 3 + ((0, pad),)) if pad > 0 else v
  o = fs.attention(*(fs.constrain_batch(a) for a in (q, k, v)), causal=True,
                   segment_ids=segment_ids, scale=softmax_scale(cfg))[..., :cfg.v_dim]
  return x + jnp.einsum("bshk,hkd->bsd", fs.constrain_batch(o), p["wo"])


def _swiglu(h, gate, up, down):
  g = jax.nn.silu(jnp.einsum("bsd,df->bsf", h, gate))
  return jnp.einsum("bsf,fd->bsd", g * jnp.einsum("bsd,df->bsf", h, up), down)


def _dense_block(x, p, cfg: ModelConfig, segment_ids=None, positions=None):
  x = _mla(fs.constrain_batch(x), p, cfg, segment_ids, positions)
  h = layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  return x + _swiglu(h, p["w_gate"], p["w_up"], p["w_down"])


def _moe_block(x, p, cfg: ModelConfig, segment_ids=None, positions=None):
  x = _mla(fs.constrain_batch(x), p, cfg, segment_ids, positions)
  h = layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  scoring = fs.parallel.Scoring("sigmoid", cfg.groups, cfg.topk_groups, cfg.routed_scale)
  routed = {k: p[k] for k in ("router", "router_bias", "w_gate", "w_up", "w_down")}
  out, aux = fs.parallel.moe(h, routed, cfg.k, normalize=cfg.normalize, scoring=scoring)
  if cfg.shared:
    out = out + _swiglu(h, p["shared_gate"], p["shared_up"], p["shared_down"])
  return x + out, aux


def hidden(params: dict, tokens: jax.Array, *, remat: bool = False, cfg: ModelConfig,
           segment_ids=None, positions=None) -> tuple[jax.Array, object]:
  """(final hidden states [batch, seq, d_model] after the last RMSNorm, the MoE layers'
  `MoEAux` stacked over them). `segment_ids`, `positions`: int32 [batch, seq] (as llama's)."""
  cfg = cfg._replace(seq=tokens.shape[1])
  embedding.check_positions(positions)
  x = embedding.lookup(params["embed"], tokens, RULES)
  wrap = jax.checkpoint if remat else (lambda f: f)
  dense = wrap(lambda x, p: (_dense_block(x, p, cfg, segment_ids, positions), None))
  block = wrap(lambda x, p: _moe_block(x, p, cfg, segment_ids, positions))
  if "dense" in params:
    x, _ = jax.lax.scan(dense, x, params["dense"])
  x, aux = jax.lax.scan(block, x, params["blocks"])
  return layers.rms_norm(fs.constrain_batch(x), params["final_norm"], cfg.norm_eps), aux


def apply(params: dict, tokens: jax.Array, *, remat: bool = False, cfg: ModelConfig,
          segment_ids=None, positions=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq] -> float32 [batch, seq, vocab]."""
  x, _ = hidden(params, tokens, remat=remat, cfg=cfg, segment_ids=segment_ids,
                positions=positions)
  return jnp.einsum("bsd,dv->bsv", x, params["unembed"]).astype(jnp.float32)


def loss_and_aux(params: dict, batch: dict, *, remat: bool = False,
                 cfg: ModelConfig) -> tuple[jax.Array, dict]:
  """(training loss, aux) as `moe.loss_and_aux`: cross-entropy (+ balance_coef x the mean
  balance loss), and the MoE layers' load for the run's metrics and `update_bias`."""
  x, aux = hidden(params, batch["inputs"], remat=remat, cfg=cfg,
                  segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
  return moe.objective(x, params["unembed"], batch["targets"], aux, cfg.balance_coef)


def loss_fn(params: dict, batch: dict, *, remat: bool = False, cfg: ModelConfig) -> jax.Array:
  """Mean next-token cross-entropy in nats (batch as `moe.loss_fn`'s)."""
  return loss_and_aux(params, batch, remat=remat, cfg=cfg)[1]["cross_entropy"]


def update_bias(params: dict, aux: dict, cfg: ModelConfig) -> dict:
  """The params after a step's auxiliary-loss-free balancing: each MoE layer's `router_bias`
  moved by `cfg.bias_rate` towards the mean load of the step's `tokens_per_expert`
  (`fnscale.parallel.update_router_bias`); nothing else changes."""
  old = params["blocks"]["router_bias"]
  bias = fs.parallel.update_router_bias(old, aux["tokens_per_expert"], cfg.bias_rate)
  return {**params, "blocks": {**params["blocks"], "router_bias": bias.astype(old.dtype)}}


load_metrics = moe.load_metrics


def active_matmul_params(cfg: ModelConfig) -> int:
  """Weights a token multiplies: MLA's projections, the dense MLPs, the router, its k routed
  and the shared experts, and the output layer."""
  D, H, C, Q = cfg.d_model, cfg.heads, cfg.kv_lora, cfg.q_lora
  q = D * Q + Q * H * cfg.head_dim if Q else D * H * cfg.head_dim
  attn = q + D * (C + cfg.rope_dim) + C * H * (cfg.nope + cfg.v_dim) + H * cfg.v_dim * D
  dense = 3 * D * cfg.d_mlp
  routed = 3 * D * cfg.d_ff * (cfg.k + cfg.shared) + D * cfg.experts
  moe_layers = cfg.layers - cfg.dense_layers
  return cfg.layers * attn + cfg.dense_layers * dense + moe_layers * routed + D * cfg.vocab


def matmul_params(cfg: ModelConfig) -> int:
  """Every matmul weight, all experts' included (what the optimizer holds)."""
  extra = 3 * cfg.d_model * cfg.d_ff * (cfg.experts - cfg.k)
  return active_matmul_params(cfg) + (cfg.layers - cfg.dense_layers) * extra


def param_count(cfg: ModelConfig) -> int:
  """Every param, counted off the init's shapes."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token: 6 x active + 12 layers (heads head_dim) seq (PaLM appendix B,
  `fnscale.analysis.model_flops_per_token`)."""
  return fs.analysis.model_flops_per_token(params=active_matmul_params(cfg), layers=cfg.layers,
                                           d_model=cfg.heads * cfg.head_dim, seq=cfg.seq)
