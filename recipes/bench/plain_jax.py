"""A plain-JAX language-model train step: the peer `chip.py` times fnscale's step against.

Written without fnscale or recipes/lm (jax, optax and jax's splash kernel only), the way a
JAX user would write it by hand: a GPT-2-style and a Llama-style decoder with the same shapes,
param names and maths as train_lm's models, float32 params cast to the compute dtype inside
the loss, `lax.scan` over the stacked layers with an optional `jax.checkpoint` policy, splash
attention on TPU (jax.nn.dot_product_attention elsewhere), for a large vocabulary a
cross-entropy walked in token chunks that computes its gradients in the forward pass, and
optax's AdamW. One mesh axis, "fsdp": the batch is split over it; the params keep whatever
sharding they come in (the step is compiled for its arguments' shardings).

  params = init_gpt(GPT(layers=2, d_model=64, heads=4, seq=32, vocab=256), jax.random.key(0))
  step = jax.jit(train_step(functools.partial(gpt_loss, options=Options()), optax.adamw(1e-3)),
                 donate_argnums=0)
  (params, opt_state), loss = step((params, opt_state), {"inputs": x, "targets": y})
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

SPLASH_RESIDUALS = "plain_attention"


class GPT(NamedTuple):
  """GPT-2 shapes (4 d_model MLP, learned positions, tied output layer)."""
  layers: int
  d_model: int
  heads: int
  seq: int
  vocab: int


class Llama(NamedTuple):
  """Llama shapes (grouped-query attention, SwiGLU MLP, RoPE; tied output layer if `tied`)."""
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  d_mlp: int
  seq: int
  vocab: int
  rope_theta: float = 500_000.0
  tied: bool = True


class Options(NamedTuple):
  """How the step computes: `attention` "splash" or "xla"; `blocks`: splash's (block_q,
  block_kv, block_q_bwd, block_kv_bwd); `fused_bwd`: splash's fused backward kernel;
  `remat`: "none", "full", "dots" (matmul outputs and attention residuals saved) or
  "qkv_attn"; `unroll` the layer loop; `loss_chunk`: tokens per chunk of the chunked
  cross-entropy (0: whole logits)."""
  attention: str = "xla"
  blocks: tuple[int, int, int, int] = (512, 512, 512, 512)
  fused_bwd: bool = True
  remat: str = "none"
  unroll: bool = False
  loss_chunk: int = 0


# ------------------------------------------------------------------------------ init


def _normal(key, shape, std):
  return std * jax.random.normal(key, shape, jnp.float32)


def init_gpt(c: GPT, key) -> dict:
  """float32 params, blocks stacked on a leading layer axis; N(0, 0.02), residual outputs
  scaled by 1/sqrt(2 layers)."""
  L, D, H, F = c.layers, c.d_model, c.heads, 4 * c.d_model
  K, ks, res = D // H, jax.random.split(key, 6), 0.02 / math.sqrt(2 * c.layers)
  ln = lambda: {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))}
  return {"wte": _normal(ks[0], (c.vocab, D), 0.02), "wpe": _normal(ks[1], (c.seq, D), 0.02),
          "blocks": {"ln1": ln(), "ln2": ln(),
                     "attn": {"w_qkv": _normal(ks[2], (L, D, 3, H, K), 0.02),
                              "b_qkv": jnp.zeros((L, 3, H, K)),
                              "w_out": _normal(ks[3], (L, H, K, D), res),
                              "b_out": jnp.zeros((L, D))},
                     "mlp": {"w_fc": _normal(ks[4], (L, D, F), 0.02), "b_fc": jnp.zeros((L, F)),
                             "w_proj": _normal(ks[5], (L, F, D), res),
                             "b_proj": jnp.zeros((L, D))}},
          "ln_f": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))}}


def init_llama(c: Llama, key) -> dict:
  """float32 params as `init_gpt`'s scheme; RMSNorm scales one."""
  L, D, H, G, F = c.layers, c.d_model, c.heads, c.kv_heads, c.d_mlp
  K, ks, res = D // H, jax.random.split(key, 9), 0.02 / math.sqrt(2 * c.layers)
  params = {"embed": _normal(ks[0], (c.vocab, D), 0.02), "final_norm": jnp.ones((D,)),
            "blocks": {"attn_norm": jnp.ones((L, D)), "mlp_norm": jnp.ones((L, D)),
                       "wq": _normal(ks[1], (L, D, H, K), 0.02),
                       "wk": _normal(ks[2], (L, D, G, K), 0.02),
                       "wv": _normal(ks[3], (L, D, G, K), 0.02),
                       "wo": _normal(ks[4], (L, H, K, D), res),
                       "w_gate": _normal(ks[5], (L, D, F), 0.02),
                       "w_up": _normal(ks[6], (L, D, F), 0.02),
                       "w_down": _normal(ks[7], (L, F, D), res)}}
  if not c.tied:
    params["unembed"] = _normal(ks[8], (D, c.vocab), 0.02)
  return params


# ------------------------------------------------------------------------------ layers


def _layer_norm(x, p, eps=1e-5):
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + eps)
  return (y * p["scale"] + p["bias"]).astype(x.dtype)


def _rms_norm(x, scale, eps=1e-5):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, theta):
  """Rotate-half RoPE on [batch, seq, heads, head_dim], angles in float32."""
  seq, half = x.shape[1], x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  ang = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def _splash(q, k, v, blocks, fused: bool):
  """Causal splash attention on [batch, seq, heads, head_dim] (k, v may have fewer heads)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  _, s, h, d = q.shape
  bq, bkv, bq_bwd, bkv_bwd = blocks
  sizes = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq_bwd,
                        block_kv_dkv=bkv_bwd, block_kv_dkv_compute=bkv_bwd,
                        block_q_dq=None if fused else bq_bwd,
                        block_kv_dq=None if fused else bkv_bwd, use_fused_bwd_kernel=fused)
  kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((s, s))] * h), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1,
                              residual_checkpoint_name=SPLASH_RESIDUALS)
  t = lambda a: jnp.swapaxes(a, 1, 2)
  out = jax.vmap(kernel)(t(q * jnp.asarray(d ** -0.5, q.dtype)), t(k), t(v))
  return t(out).astype(q.dtype)


def attention(q, k, v, options: Options):
  """Causal attention, [batch, seq, heads, head_dim] -> same. Splash runs per device's rows
  (a shard_map over "fsdp" when the ambient mesh has it)."""
  if options.attention != "splash":
    if k.shape[2] != q.shape[2]:
      k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  run = functools.partial(_splash, blocks=options.blocks, fused=options.fused_bwd)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "fsdp" not in mesh.axis_names or mesh.shape["fsdp"] == 1:
    return run(q, k, v)
  spec = jax.P("fsdp")
  return jax.shard_map(run, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)


def _remat(block, name: str):
  cp = jax.checkpoint_policies
  if name == "none":
    return block
  policy = {"full": cp.nothing_saveable,
            "dots": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                               cp.save_only_these_names(SPLASH_RESIDUALS)),
            "qkv_attn": cp.save_only_these_names("q_k_v", SPLASH_RESIDUALS)}[name]
  return jax.checkpoint(block, policy=policy, prevent_cse=False)


def _layers(block, x, blocks, options: Options):
  block = _remat(block, options.remat)
  return jax.lax.scan(lambda x, p: (block(x, p), None), x, blocks, unroll=options.unroll)[0]


# ------------------------------------------------------------------------------ models


def _gpt_block(x, p, options: Options):
  h = _layer_norm(x, p["ln1"])
  a = p["attn"]
  qkv = jnp.einsum("bsd,dthk->tbshk", h, a["w_qkv"]) + a["b_qkv"][:, None, None]
  q, k, v = (jax.ad_checkpoint.checkpoint_name(t, "q_k_v") for t in (qkv[0], qkv[1], qkv[2]))
  x = x + jnp.einsum("bshk,hkd->bsd", attention(q, k, v, options), a["w_out"]) + a["b_out"]
  h = _layer_norm(x, p["ln2"])
  m = p["mlp"]
  h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, m["w_fc"]) + m["b_fc"])
  return x + jnp.einsum("bsf,fd->bsd", h, m["w_proj"]) + m["b_proj"]


def gpt_loss(params, batch, *, options: Options = Options()):
  """Mean next-token cross-entropy (nats) of the GPT; batch {"inputs", "targets"} int32
  [batch, seq]; params in the compute dtype."""
  tokens = batch["inputs"]
  x = params["wte"][tokens] + params["wpe"][:tokens.shape[1]]
  x = _layers(lambda x, p: _gpt_block(x, p, options), x, params["blocks"], options)
  x = _layer_norm(x, params["ln_f"])
  logits = jnp.einsum("bsd,vd->bsv", x, params["wte"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _llama_block(x, p, theta, options: Options):
  h = _rms_norm(x, p["attn_norm"])
  name = lambda t: jax.ad_checkpoint.checkpoint_name(t, "q_k_v")
  q = name(_rope(jnp.einsum("bsd,dhk->bshk", h, p["wq"]), theta))
  k = name(_rope(jnp.einsum("bsd,dhk->bshk", h, p["wk"]), theta))
  v = name(jnp.einsum("bsd,dhk->bshk", h, p["wv"]))
  x = x + jnp.einsum("bshk,hkd->bsd", attention(q, k, v, options), p["wo"])
  h = _rms_norm(x, p["mlp_norm"])
  g = jax.nn.silu(jnp.einsum("bsd,df->bsf", h, p["w_gate"]))
  return x + jnp.einsum("bsf,fd->bsd", g * jnp.einsum("bsd,df->bsf", h, p["w_up"]),
                        p["w_down"])


def llama_loss(params, batch, *, theta: float = 500_000.0, options: Options = Options()):
  """Mean next-token cross-entropy (nats) of the Llama; as `gpt_loss`."""
  x = params["embed"][batch["inputs"]]
  x = _layers(lambda x, p: _llama_block(x, p, theta, options), x, params["blocks"], options)
  x = _rms_norm(x, params["final_norm"])
  w = params["unembed"] if "unembed" in params else params["embed"].T
  h, labels = x.reshape(-1, x.shape[-1]), batch["targets"].reshape(-1)
  if not options.loss_chunk:
    logits = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return chunked_cross_entropy(h, w.astype(h.dtype), labels, options.loss_chunk)


# ------------------------------------------------------------------------------ loss


def _chunk_grads(h, w, labels, chunk: int):
  """(mean loss, d loss / d h, d loss / d w) walking the [tokens, d] rows `chunk` at a time:
  one [chunk, vocab] float32 logits block at once."""
  n, scale = h.shape[0], 1.0 / h.shape[0]

  def body(carry, xs):
    loss, dw = carry
    hc, yc = xs
    logits = jnp.dot(hc, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
    d = (jnp.exp(logits - lse[:, None]) - jax.nn.one_hot(yc, w.shape[1])) * scale
    dh = jnp.dot(d.astype(hc.dtype), w.T, preferred_element_type=jnp.float32)
    dw = dw + jnp.dot(hc.T, d.astype(hc.dtype), preferred_element_type=jnp.float32)
    return (loss + jnp.sum(lse - picked), dw), dh.astype(hc.dtype)

  xs = (h.reshape(n // chunk, chunk, -1), labels.reshape(n // chunk, chunk))
  (loss, dw), dh = jax.lax.scan(body, (jnp.zeros((), jnp.float32),
                                       jnp.zeros(w.shape, jnp.float32)), xs)
  return loss * scale, dh.reshape(h.shape), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_cross_entropy(h, w, labels, chunk: int):
  """Mean cross-entropy of softmax(h @ w) against `labels` without the whole logits: h
  [tokens, d], w [d, vocab], labels int [tokens]; tokens divisible by `chunk`."""
  return _chunk_grads(h, w, labels, chunk)[0]


def _ce_fwd(h, w, labels, chunk):
  loss, dh, dw = _chunk_grads(h, w, labels, chunk)
  return loss, (dh, dw, labels)


def _ce_bwd(chunk, residuals, g):
  del chunk
  dh, dw, labels = residuals
  zero = jnp.zeros(labels.shape, jax.dtypes.float0)
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), zero


chunked_cross_entropy.defvjp(_ce_fwd, _ce_bwd)


# ------------------------------------------------------------------------------ step


def train_step(loss_fn, optimizer, compute_dtype=jnp.bfloat16):
  """step((params, opt_state), batch) -> ((params, opt_state), loss): float32 params cast to
  `compute_dtype` for `loss_fn(params, batch)`, float32 gradients, one optax update."""
  def cast(p):
    return jax.tree.map(lambda a: a.astype(compute_dtype)
                        if jnp.issubdtype(a.dtype, jnp.floating) else a, p)

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cast(p), batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss.astype(jnp.float32)
  return step
