"""recipes/lm/llama.py: published param counts, a float64 numpy reference forward, RoPE and GQA
properties, and a few training steps on simulated CPU devices."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

from recipes.lm import llama

SMALL = llama.ModelConfig(layers=2, d_model=32, heads=4, kv_heads=2, d_mlp=48, seq=8,
                          vocab=19, rope_theta=10_000.0)


def _count(cfg):
  shapes = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("size,published", [
    # Meta's safetensors totals for Meta-Llama-3-8B and -70B (model cards: 8.03B, 70.6B) and
    # Llama-3.2-1B and -3B (tied embeddings).
    ("llama-1b", 1_235_814_400),
    ("llama-3b", 3_212_749_824),
    ("llama-8b", 8_030_261_248),
    ("llama-70b", 70_553_706_496),
])
def test_param_count_matches_the_published_llama3_count(size, published):
  cfg = llama.model_config(size, 8192)
  assert _count(cfg) == published
  assert llama.param_count(cfg) == published


def _np_forward(params, tokens, cfg):
  """Independent float64 reference: explicit per-head loops, kv heads repeated by index."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  H, G, K = cfg.heads, cfg.kv_heads, cfg.head_dim
  B, S = tokens.shape

  def norm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

  def rot(x):  # x [S, K]
    out = np.empty_like(x)
    for pos in range(S):
      for i in range(K // 2):
        a = pos * cfg.rope_theta ** (-2.0 * i / K)
        c, s = math.cos(a), math.sin(a)
        out[pos, i] = x[pos, i] * c - x[pos, i + K // 2] * s
        out[pos, i + K // 2] = x[pos, i] * s + x[pos, i + K // 2] * c
    return out

  x = p["embed"][tokens]
  for l in range(cfg.layers):
    blk = {k: v[l] for k, v in p["blocks"].items()}
    h = norm(x, blk["attn_norm"])
    o = np.zeros((B, S, H, K))
    for b in range(B):
      for hd in range(H):
        g = hd // (H // G)
        q = rot(h[b] @ blk["wq"][:, hd]); k = rot(h[b] @ blk["wk"][:, g])
        v = h[b] @ blk["wv"][:, g]
        s = q @ k.T / math.sqrt(K)
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True)); w /= w.sum(-1, keepdims=True)
        o[b, :, hd] = w @ v
    x = x + np.einsum("bshk,hkd->bsd", o, blk["wo"])
    h = norm(x, blk["mlp_norm"])
    gate = h @ blk["w_gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ blk["w_up"])) @ blk["w_down"]
  return norm(x, p["final_norm"]) @ p["unembed"]


def test_forward_matches_float64_numpy_reference():
  params = llama.init_params(SMALL, jax.random.key(1))
  # Non-trivial norm scales, so a norm that ignores its scale would show.
  params["blocks"]["attn_norm"] = params["blocks"]["attn_norm"] * 1.5
  tokens = np.array(jax.random.randint(jax.random.key(2), (2, SMALL.seq), 0, SMALL.vocab))
  got = llama.apply(params, jnp.asarray(tokens), cfg=SMALL)
  want = _np_forward(params, tokens, SMALL)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
  remat = llama.apply(params, jnp.asarray(tokens), remat=True, cfg=SMALL)
  np.testing.assert_allclose(np.asarray(remat), want, rtol=2e-4, atol=2e-5)


@pytest.mark.slow  # the one-device reference check stays quick
def test_loss_is_the_cross_entropy_of_the_reference_logits_under_a_mesh():
  # loss_fn (fnscale.cross_entropy over the hidden states) equals softmax cross-entropy of
  # the float64 reference logits, and its gradient optax's on the materialised logits, on
  # a data x FSDP x tensor mesh (vocab-parallel over "tensor").
  cfg = SMALL._replace(rope_theta=500_000.0, vocab=20)  # loss_fn's default theta
  params = llama.init_params(cfg, jax.random.key(6))
  tokens = np.array(jax.random.randint(jax.random.key(7), (4, cfg.seq), 0, cfg.vocab))
  targets = np.roll(tokens, -1, axis=1)
  logits = _np_forward(params, tokens, cfg)
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  want = np.mean(lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
  batch = {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(targets)}
  def plain(p, b):
    logits = llama.apply(p, b["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()
  with fs.with_mesh(fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
    got, grads = jax.jit(jax.value_and_grad(llama.loss_fn))(params, batch)
  ref_grads = jax.jit(jax.grad(plain))(params, batch)  # one device: no mesh is set
  np.testing.assert_allclose(float(got), want, rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads, ref_grads)


def test_loss_never_holds_the_float32_logits():
  # 16,384 tokens x a 16,384-token vocabulary: the float32 [batch, seq, vocab] logits are
  # 1 GiB, the model's own activations a few MiB. A loss that builds them (optax over
  # `apply`: the same value and FLOPs) needs them as a temporary of the gradient, so the
  # compiled temporaries reach 1 GiB; walked in chunks (`fs.cross_entropy`) they stay below.
  B, S, V = 256, 64, 16384
  cfg = llama.model_config("llama-tiny", S, layers=1, d_model=64, heads=4, kv_heads=2,
                           d_mlp=128, vocab=V)
  params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
  batch = {k: jax.ShapeDtypeStruct((B, S), jnp.int32) for k in ("inputs", "targets")}
  compiled = jax.jit(jax.value_and_grad(llama.loss_fn)).lower(params, batch).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < B * S * V * 4


def test_rope_keeps_norms_and_scores_depend_on_relative_position():
  x = jax.random.normal(jax.random.key(3), (1, 16, 2, 8))
  r = llama.rope(x, 10_000.0)
  np.testing.assert_allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(r[:, 0], x[:, 0], rtol=1e-6)  # position 0 is not rotated
  # The same q and k vectors at every position: q_i . k_j depends on i - j only.
  q = jnp.broadcast_to(x[:, :1, :1], (1, 16, 1, 8))
  k = jnp.broadcast_to(x[:, 1:2, :1], (1, 16, 1, 8))
  s = np.einsum("bqhk,bshk->qs", llama.rope(q, 100.0), llama.rope(k, 100.0))
  np.testing.assert_allclose(s[3, 1], s[10, 8], rtol=1e-4)
  np.testing.assert_allclose(s[5, 5], s[0, 0], rtol=1e-4)
  assert abs(s[3, 1] - s[3, 2]) > 1e-3  # and it does depend on the offset


def test_gqa_equals_multi_head_attention_with_repeated_kv_weights():
  params = llama.init_params(SMALL, jax.random.key(4))
  rep = dict(params, blocks=dict(params["blocks"]))
  group = SMALL.heads // SMALL.kv_heads
  for w in ("wk", "wv"):  # kv head g serves query heads g*group .. (g+1)*group-1
    rep["blocks"][w] = jnp.repeat(params["blocks"][w], group, axis=2)
  tokens = jax.random.randint(jax.random.key(5), (2, SMALL.seq), 0, SMALL.vocab)
  np.testing.assert_allclose(llama.apply(params, tokens), llama.apply(rep, tokens),
                             rtol=1e-5, atol=1e-6)


def test_flops_per_token_is_the_hand_count():
  cfg = llama.model_config("llama-8b", 4096)
  # q,o: 4096x4096 each; k,v: 4096x1024 each; MLP 3 x 4096x14336; output 4096x128256.
  n = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256
  assert llama.matmul_params(cfg) == n
  assert llama.flops_per_token(cfg) == 6 * n + 12 * 32 * 4096 * 4096


def test_unknown_size_names_the_known_ones():
  with pytest.raises(fs.FnscaleError, match="llama-8b"):
    llama.model_config("llama-9b", 128)


@pytest.mark.slow
def test_a_few_steps_lower_the_loss_on_cpu_mesh():
  cfg = llama.model_config("llama-tiny", 32, layers=1, d_model=64, d_mlp=128)
  mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
  opt = optax.adam(3e-3)
  state = fs.init_state(lambda k: llama.init_params(cfg, k), opt, mesh=mesh, rules=llama.RULES,
                        logical_axes=llama.logical_axes(cfg), key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(llama.loss_fn, opt), mesh,
                       rules=llama.RULES, logical_axes=llama.logical_axes(cfg))
  # A repeating byte pattern the model can learn in a few steps.
  row = np.arange(33) % 7 + 97
  batch = {"inputs": np.tile(row[:-1], (8, 1)).astype(np.int32),
           "targets": np.tile(row[1:], (8, 1)).astype(np.int32)}
  losses = []
  for _ in range(8):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[0] == pytest.approx(math.log(256), rel=0.05)
  assert losses[-1] < 0.6 * losses[0]


def test_the_loss_splits_the_vocabulary_over_token_axes_only_where_tokens_are_fewer():
  """Per device, gathering hidden states costs tokens x d, gathering the output layer's
  shards vocab x d: Llama 3's 128,256 rows over fsdp=2 x context=4 are 16,032 per device."""
  mesh = fs.make_mesh({"fsdp": 2, "context": 4})
  with fs.with_mesh(mesh):
    # 2 rows x 131,072 tokens: 32,768 a device, more than 16,032: the weight is gathered.
    assert llama.vocab_axes((2, 131072, 4096), 128256) == ("tensor",)
    # 2 rows x 32,768: 8,192 a device: the tokens are gathered, the vocabulary split.
    assert llama.vocab_axes((2, 32768, 4096), 128256) == llama.VOCAB_OUT_AXES
    assert llama.vocab_axes((2, 64128, 4096), 128256) == llama.VOCAB_OUT_AXES  # equal: 16,032
  assert llama.vocab_axes((2, 131072, 4096), 128256) == llama.VOCAB_OUT_AXES  # no mesh


_GEMMA = dict(norm_plus_one=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
              attn_soft_cap=2.0, logit_soft_cap=3.0, qk_norm=True, local_rope_theta=100.0)


def test_gemma_layers_through_pipeline_stages_equal_one_device():
  # Local and global layers (window 4 of 16 tokens, their own RoPE base) in 2 stages of 2
  # layers: each stage runs the (local, global) group; the logits are the unpipelined ones.
  # Windows that differ between the stages' shares can't be one program: named.
  cfg = llama.ModelConfig(4, 32, 4, 2, 48, 16, vocab=64, windows=(4, 0) * 2, **_GEMMA)
  params = llama.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape),
                        params)  # norms away from their zero init
  tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, 64)
  run = jax.jit(functools.partial(llama.apply, cfg=cfg))
  want = run(params, tokens)
  with fs.with_mesh(fs.make_mesh({"stage": 2, "data": 4})):
    np.testing.assert_allclose(run(params, tokens), want, atol=1e-5, rtol=1e-5)
    odd = cfg._replace(layers=6, windows=(4, 0) * 3)
    shapes = jax.eval_shape(functools.partial(llama.init_params, odd), jax.random.key(0))
    with pytest.raises(fs.InputError, match=r"windows=\(4, 0, 4, 0, 4, 0\).* 3 layers"):
      jax.eval_shape(functools.partial(llama.apply, cfg=odd), shapes, tokens)


def test_gemma_loss_is_the_cross_entropy_of_its_capped_logits():
  # The loss (chunked, never holding the logits) scores the soft-capped logits `apply`
  # returns, not the uncapped ones; a windows tuple that doesn't fit the layers is named.
  cfg = llama.ModelConfig(2, 32, 4, 2, 48, 16, vocab=64, windows=(4, 0), **_GEMMA)
  params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape),
                        llama.init_params(cfg, jax.random.key(0)))
  tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 64)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  logits = llama.apply(params, batch["inputs"], cfg=cfg)
  assert float(jnp.abs(logits).max()) <= 3.0
  want = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  np.testing.assert_allclose(llama.loss_fn(params, batch, cfg=cfg), want, rtol=1e-5)
  with pytest.raises(fs.InputError, match=r"windows=\(4,\) for 2 layers"):
    llama.loss_fn(params, batch, cfg=cfg._replace(windows=(4,)))
