"""Tiny models for fnscale's tests: plain-pytree params, `loss(params, batch)`, logical axes.

Dependency-free (jax only) so any test can import them. Widths are multiples of 8 so every
sharded dimension divides the 8 simulated devices in every test mesh.

- MLP: x [batch, d_in] -> tanh hidden [batch, d_hidden] -> y_hat [batch, d_out]; mean squared
  error against y.
- Transformer: a pre-norm decoder-only LM (token + learned position embeddings, causal
  multi-head attention, GELU MLP, final norm, untied unembedding); batch {"tokens": int32
  [batch, seq + 1]}; mean next-token cross-entropy, aux {"accuracy": float32 scalar}.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fnscale as fs

# Logical-axis rules for the test meshes ("data", "fsdp", "tensor"); a rule naming an axis
# a mesh lacks is skipped, so the same rules serve every mesh.
RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
)


class MLPConfig(NamedTuple):
  d_in: int = 16
  d_hidden: int = 64
  d_out: int = 8


class TransformerConfig(NamedTuple):
  vocab: int = 64
  seq: int = 8
  d_model: int = 32
  heads: int = 4
  head_dim: int = 8
  d_mlp: int = 64
  layers: int = 2


MLP = MLPConfig()
TRANSFORMER = TransformerConfig()


# ----------------------------------------------------------------------------- MLP


def mlp_init(key, cfg: MLPConfig = MLP):
  """Params {"w1": f32[d_in, d_hidden], "b1": f32[d_hidden], "w2": f32[d_hidden, d_out],
  "b2": f32[d_out]}."""
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (cfg.d_in, cfg.d_hidden), jnp.float32) / cfg.d_in**0.5,
      "b1": jnp.zeros((cfg.d_hidden,), jnp.float32),
      "w2": jax.random.normal(k2, (cfg.d_hidden, cfg.d_out), jnp.float32) / cfg.d_hidden**0.5,
      "b2": jnp.zeros((cfg.d_out,), jnp.float32),
  }


def mlp_logical_axes(cfg: MLPConfig = MLP):
  del cfg
  return {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed"), "b2": (None,)}


def mlp_loss(params, batch):
  """Mean squared error; batch {"x": [B, d_in], "y": [B, d_out]}."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  y_hat = h @ params["w2"] + params["b2"]
  return jnp.mean(jnp.square(y_hat.astype(jnp.float32) - batch["y"].astype(jnp.float32)))


def mlp_batch(key, batch_size: int, cfg: MLPConfig = MLP):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (batch_size, cfg.d_in), jnp.float32),
          "y": jax.random.normal(ky, (batch_size, cfg.d_out), jnp.float32)}


# ----------------------------------------------------------------------------- transformer


def transformer_init(key, cfg: TransformerConfig = TRANSFORMER):
  """Params: "embed" [vocab, d_model], "pos" [seq, d_model], "blocks" (a list of dicts with
  "ln1"/"ln2" [d_model], "wq"/"wk"/"wv" [d_model, heads, head_dim], "wo" [heads, head_dim,
  d_model], "w_in" [d_model, d_mlp], "w_out" [d_mlp, d_model]), "ln_f" [d_model] and
  "unembed" [d_model, vocab]; all float32."""
  keys = iter(jax.random.split(key, 3 + 6 * cfg.layers))
  d, h, dh, f = cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_mlp

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / fan_in**0.5

  blocks = []
  for _ in range(cfg.layers):
    blocks.append({
        "ln1": jnp.ones((d,), jnp.float32),
        "wq": normal((d, h, dh), d),
        "wk": normal((d, h, dh), d),
        "wv": normal((d, h, dh), d),
        "wo": normal((h, dh, d), h * dh),
        "ln2": jnp.ones((d,), jnp.float32),
        "w_in": normal((d, f), d),
        "w_out": normal((f, d), f),
    })
  return {
      "embed": normal((cfg.vocab, d), 1.0),
      "pos": normal((cfg.seq, d), 1.0) * 0.1,
      "blocks": blocks,
      "ln_f": jnp.ones((d,), jnp.float32),
      "unembed": normal((d, cfg.vocab), d),
  }


def transformer_logical_axes(cfg: TransformerConfig = TRANSFORMER):
  block = {
      "ln1": (None,), "ln2": (None,),
      "wq": ("embed", "heads", None), "wk": ("embed", "heads", None),
      "wv": ("embed", "heads", None), "wo": ("heads", None, "embed"),
      "w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"),
  }
  return {
      "embed": ("vocab", "embed"),
      "pos": (None, "embed"),
      "blocks": [dict(block) for _ in range(cfg.layers)],
      "ln_f": (None,),
      "unembed": ("embed", "vocab"),
  }


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def transformer_logits(params, tokens):
  """tokens int32 [B, S] -> logits float32 [B, S, vocab]."""
  x = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
  s = tokens.shape[1]
  causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
  for blk in params["blocks"]:
    # Keep the residual stream split by batch, not by the FSDP params' embed dim.
    x = fs.constrain_batch(x)
    y = _rms_norm(x, blk["ln1"])
    q = jnp.einsum("bsd,dhk->bshk", y, blk["wq"])
    k = jnp.einsum("bsd,dhk->bshk", y, blk["wk"])
    v = jnp.einsum("bsd,dhk->bshk", y, blk["wv"])
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k).astype(jnp.float32) / q.shape[-1]**0.5
    scores = jnp.where(causal, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    att = jnp.einsum("bhqt,bthk->bqhk", probs, v)
    x = x + jnp.einsum("bqhk,hkd->bqd", att, blk["wo"])
    y = _rms_norm(x, blk["ln2"])
    x = x + jax.nn.gelu(y @ blk["w_in"]) @ blk["w_out"]
  x = _rms_norm(x, params["ln_f"])
  return (x @ params["unembed"]).astype(jnp.float32)


def transformer_loss(params, batch):
  """Mean next-token cross-entropy and {"accuracy"}; batch {"tokens": int32 [B, seq + 1]}."""
  tokens = batch["tokens"]
  logits = transformer_logits(params, tokens[:, :-1])
  targets = tokens[:, 1:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
  return jnp.mean(nll), {"accuracy": accuracy}


def transformer_batch(key, batch_size: int, cfg: TransformerConfig = TRANSFORMER):
  return {"tokens": jax.random.randint(key, (batch_size, cfg.seq + 1), 0, cfg.vocab,
                                       jnp.int32)}
