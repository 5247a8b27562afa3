"""A GPT-2-style decoder as a plain pytree and pure functions (the model of `train_lm.py`).

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners": pre-LayerNorm
blocks, learned positions, GELU MLP and an output layer tied to the token embedding. Every param
carries logical axis names that fnscale's rules map onto the mesh.

The model-module interface `train_lm.py` relies on (a Llama module offers the same names):
`ModelConfig` (a NamedTuple with at least `layers, d_model, heads, seq, vocab`), `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`; a batch is {"inputs", "targets"}: int32 [batch, seq], plus optional
"segment_ids" and "positions" (int32 [batch, seq]: packed rows, `packing.py`, or the order of
a sequence split over a "context" mesh axis, `fnscale.parallel.context.reorder_batch`) and
"weights" (float32 [batch, seq], the loss weight of each target).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from recipes.lm import embedding, int8, remat as remat_lib

VOCAB = 256  # bytes; a tokenizer's vocabulary replaces it (`cfg._replace(vocab=n)`)
REMAT_POLICIES = remat_lib.POLICIES  # what `remat=` takes besides True / False


class ModelConfig(NamedTuple):
  """Shape of the decoder. d_mlp is 4 * d_model as in GPT-2. `positions`: rows of the learned
  position table (GPT-2's n_positions, 1024); 0: `seq`. `int8`: the blocks' projections and
  MLP multiply in int8 (`recipes.lm.int8.dense`); `unroll`: the layer loop unrolled instead of
  one `lax.scan` body."""
  layers: int
  d_model: int
  heads: int
  seq: int
  vocab: int = VOCAB
  positions: int = 0
  int8: bool = False
  unroll: bool = False

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def d_mlp(self) -> int:
    return 4 * self.d_model


# GPT-2 small and medium shapes (Radford et al. 2019); with a byte vocabulary their embedding
# tables are tiny, so `small` has 86M params rather than GPT-2's 124M (50257-token vocabulary).
# `tiny_gpt2` is the same layout at a size that trains in minutes on a 2-core CPU.
SIZES = {
    "nano": dict(layers=2, d_model=64, heads=4),
    "tiny_gpt2": dict(layers=4, d_model=128, heads=4),
    "tiny": dict(layers=4, d_model=256, heads=4),
    "small": dict(layers=12, d_model=768, heads=12),
    "medium": dict(layers=24, d_model=1024, heads=16),
}


def model_config(size: str, seq: int) -> ModelConfig:
  """The config of a named size at sequence length `seq` (tokens).

  Raises:
    FnscaleError: an unknown size (the message lists the known ones).
  """
  if size not in SIZES:
    raise fs.InputError(f"model_config={size!r} is not a known GPT size; expected one of "
                          f"{list(SIZES)}")
  return ModelConfig(seq=seq, **SIZES[size])


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Returns float32 params; block params are stacked along a leading `layers` axis for scan.

  Init follows GPT-2: N(0, 0.02) weights, residual output projections scaled by
  1/sqrt(2 * layers), zero biases, unit LayerNorm scales.
  """
  L, D, H, K, F = cfg.layers, cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_mlp
  ks = jax.random.split(key, 6)
  std, res_std = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  ln = lambda: {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))}
  return {
      "wte": normal(ks[0], (cfg.vocab, D), std),
      "wpe": normal(ks[1], (cfg.positions or cfg.seq, D), std),
      "blocks": {
          "ln1": ln(),
          "attn": {
              "w_qkv": normal(ks[2], (L, D, 3, H, K), std),
              "b_qkv": jnp.zeros((L, 3, H, K)),
              "w_out": normal(ks[3], (L, H, K, D), res_std),
              "b_out": jnp.zeros((L, D)),
          },
          "ln2": ln(),
          "mlp": {
              "w_fc": normal(ks[4], (L, D, F), std),
              "b_fc": jnp.zeros((L, F)),
              "w_proj": normal(ks[5], (L, F, D), res_std),
              "b_proj": jnp.zeros((L, D)),
          },
      },
      "ln_f": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
  }


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  del cfg
  ln = {"scale": ("layers", "norm"), "bias": ("layers", "norm")}
  return {
      "wte": ("vocab", "embed"),
      "wpe": ("position", "embed"),
      "blocks": {
          "ln1": ln,
          "attn": {
              "w_qkv": ("layers", "embed", "qkv", "heads", "head_dim"),
              "b_qkv": ("layers", "qkv", "heads", "head_dim"),
              "w_out": ("layers", "heads", "head_dim", "embed"),
              "b_out": ("layers", "norm"),
          },
          "ln2": ln,
          "mlp": {
              "w_fc": ("layers", "embed", "mlp"),
              "b_fc": ("layers", "mlp"),
              "w_proj": ("layers", "mlp", "embed"),
              "b_proj": ("layers", "norm"),
          },
      },
      "ln_f": {"scale": ("norm",), "bias": ("norm",)},
  }


# Logical axis -> mesh axes. "embed" over fsdp gives ZeRO-3-style sharded params and optimizer
# state; heads/mlp/vocab over tensor give Megatron-style tensor parallelism (Shoeybi et al. 2019).
# Under a "context" axis (the sequence split) params are split over it as over fsdp.
RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp", "context")),
    ("embed", "fsdp"),
    ("embed", "context"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def _layer_norm(x, p, eps=1e-5):
  # Statistics in float32 whatever the compute dtype, for stability under bfloat16.
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _block(x, p, segment_ids=None, int8_matmuls: bool = False):
  """One pre-LN transformer block. x: [batch, seq, d_model]; segment_ids: None or int32
  [batch, seq] (a token attends only within its segment); int8_matmuls: the four weight
  matmuls in int8 (`recipes.lm.int8.dense`)."""
  # Keep the residual stream split by batch; otherwise GSPMD may follow the FSDP params'
  # d_model sharding and run attention for the whole batch on every device.
  x = fs.constrain_batch(x)
  h = _layer_norm(x, p["ln1"])
  a = p["attn"]
  if int8_matmuls:
    qkv = jnp.moveaxis(int8.dense(h, a["w_qkv"]), 2, 0) + a["b_qkv"][:, None, None]
  else:
    qkv = jnp.einsum("bsd,dthk->tbshk", h, a["w_qkv"]) + a["b_qkv"][:, None, None]
  q, k, v = (remat_lib.name_qkv(t) for t in (qkv[0], qkv[1], qkv[2]))
  o = fs.attention(q, k, v, causal=True, segment_ids=segment_ids)
  mm = int8.dense if int8_matmuls else jnp.tensordot
  x = x + mm(o, a["w_out"], 2) + a["b_out"]
  h = _layer_norm(x, p["ln2"])
  m = p["mlp"]
  h = jax.nn.gelu(mm(h, m["w_fc"], 1) + m["b_fc"])
  return x + mm(h, m["w_proj"], 1) + m["b_proj"]


def apply(params: dict, tokens: jax.Array, *, remat: bool | str = False,
          cfg: ModelConfig | None = None, segment_ids=None, positions=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq <= cfg.seq] -> float32 [batch, seq, vocab].

  Packed rows: `segment_ids` (int32 [batch, seq]) keep attention inside each document and
  `positions` (int32 [batch, seq], from 0 in each document) index the learned positions; by
  default one document per row, positions 0..seq-1.

  Computes in the dtype of `params` (a precision policy casts them); LayerNorm statistics and
  logits are float32. Blocks run under `lax.scan` over the stacked layer axis (one compiled
  block whatever the depth); `remat` trades FLOPs for memory: what each block saves for the
  backward pass, a policy of `recipes.lm.remat` (True: "full", recompute the whole block;
  False: "none"; "dots": keep the matmul outputs, ...). `cfg`: its `int8` and `unroll`
  choices (default neither); GPT-2's shapes come from the params. `positions`,
  `segment_ids`: int [batch, seq] (default 0..seq-1, one sequence per row); positions are
  required under a context axis (`embedding.check_positions`).
  """
  seq = tokens.shape[1]
  embedding.check_positions(positions)
  pos = params["wpe"][:seq] if positions is None else jnp.take(params["wpe"], positions, 0)
  x = embedding.lookup(params["wte"], tokens, RULES) + pos
  block = functools.partial(_block, segment_ids=segment_ids,
                            int8_matmuls=cfg is not None and cfg.int8)
  block = remat_lib.checkpointed(block, remat)
  x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"],
                      unroll=cfg is not None and cfg.unroll)
  x = _layer_norm(x, params["ln_f"])
  return jnp.einsum("bsd,vd->bsv", x, params["wte"]).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, *, remat: bool | str = False,
            cfg: ModelConfig | None = None, weighted: bool = False):
  """Mean next-token cross-entropy in nats. batch: {"inputs", "targets"} int32 [batch, seq],
  ids in [0, cfg.vocab): an id outside gives a nan or wrong loss, not an error (jit cannot
  raise on values); check data of your own with `data.check_token_ids(batch, cfg.vocab)`.
  Packed batches add "segment_ids" and "positions" (see `apply`).

  weighted=True (for `fnscale.train_step(..., weighted=True)`): returns (sum over targets of
  weight x cross-entropy, sum of weights) with batch["weights"] (float32 [batch, seq]; 0 on
  padding and on targets without loss; default all 1), so the step divides by the weight of
  the whole batch, whatever the mesh or accumulation."""
  logits = apply(params, batch["inputs"], remat=remat, cfg=cfg,
                 segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  if not weighted:
    return ce.mean()
  w = batch.get("weights", jnp.ones(ce.shape, jnp.float32)).astype(jnp.float32)
  return jnp.sum(ce * w), jnp.sum(w)


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: 12 d^2 per block (qkv, out, 2 MLP) plus the tied
  output layer; embedding lookups and positions are not matmuls."""
  return cfg.layers * 12 * cfg.d_model**2 + cfg.vocab * cfg.d_model


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): `fnscale.analysis.model_flops_per_token`
  (PaLM appendix B) for this model. Remat's recomputation is not counted (MFU, not hardware
  utilisation)."""
  return fs.analysis.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                           d_model=cfg.d_model, seq=cfg.seq)
