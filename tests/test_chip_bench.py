"""The chip benchmark's peer and its CPU path: the plain-JAX step (recipes/bench/plain_jax.py)
trains as fnscale's step does, and `recipes/bench/chip.py` runs a tiny case end to end."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from recipes.bench import chip
from recipes.bench import plain_jax as pj
from recipes.lm import gpt, llama

GPT_CFG = gpt.ModelConfig(layers=2, d_model=32, heads=2, seq=16)
LLAMA_CFG = llama.ModelConfig(layers=2, d_model=32, heads=4, kv_heads=2, d_mlp=64, seq=16,
                              vocab=256, tie_embeddings=True)


def _batch(seq, rows=8):
  ids = np.random.default_rng(0).integers(0, 256, (rows, seq + 1)).astype(np.int32)
  return {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}


def _losses_fnscale(module, cfg, params, batch, steps):
  opt = optax.adamw(1e-2)
  step = jax.jit(fs.train_step(functools.partial(module.loss_fn, cfg=cfg), opt))
  state = fs.TrainState(params, opt.init(params), jnp.zeros((), jnp.int32))
  out = []
  for _ in range(steps):
    state, m = step(state, batch)
    out.append(float(m["loss"]))
  return out


def _losses_peer(loss_fn, params, batch, steps):
  opt = optax.adamw(1e-2)
  step = jax.jit(pj.train_step(loss_fn, opt, compute_dtype=jnp.float32))
  state, out = (params, opt.init(params)), []
  for _ in range(steps):
    state, loss = step(state, batch)
    out.append(float(loss))
  return out


@pytest.mark.parametrize("which", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_the_plain_jax_step_trains_as_fnscales_from_the_same_init_and_data(which):
  """Three float32 steps of each from one init: the same loss at every step. The second and
  third losses follow the gradients (a peer with a wrong RoPE, attention scale, bias, loss
  chunking or chunked-loss gradient differs by far more than 1e-5)."""
  if which == "gpt":
    module, cfg, loss = gpt, GPT_CFG, functools.partial(pj.gpt_loss, options=pj.Options())
  else:  # the peer's chunked loss (4 chunks of 32 tokens) against fnscale.cross_entropy
    module, cfg = llama, LLAMA_CFG
    loss = functools.partial(pj.llama_loss, options=pj.Options(loss_chunk=32))
  params = module.init_params(cfg, jax.random.key(0))
  batch = _batch(cfg.seq)
  want = _losses_fnscale(module, cfg, params, batch, 3)
  got = _losses_peer(loss, params, batch, 3)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  assert want[2] < want[0] - 0.05  # the steps moved the params


def test_the_peers_init_has_the_models_tree_and_shapes():
  for mine, theirs in ((pj.init_gpt(pj.GPT(2, 32, 2, 16, 256), jax.random.key(0)),
                        gpt.init_params(GPT_CFG, jax.random.key(0))),
                       (pj.init_llama(pj.Llama(2, 32, 4, 2, 64, 16, 256), jax.random.key(0)),
                        llama.init_params(LLAMA_CFG, jax.random.key(0)))):
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert jax.tree.map(jnp.shape, mine) == jax.tree.map(jnp.shape, theirs)


@pytest.mark.slow
def test_a_tiny_case_runs_both_steps_alternately_with_the_palm_mfu():
  """gpt-nano on the CPU devices: both sides timed, tokens/s = tokens / step time, and the
  MFU over the hand count of PaLM's formula: N = 2 layers x 12 x 64^2 + 256 x 64 matmul
  weights, 6 N + 12 x 2 x 64 x 64 FLOPs per token."""
  env = chip.environment()
  row = chip.measure(chip.parse_case("gpt-nano,batch=8,peer=1"), env, rounds=2, steps=1,
                     warmup=1)
  per_token = 6 * (2 * 12 * 64**2 + 256 * 64) + 12 * 2 * 64 * 64
  assert row["flops_token"] == per_token
  for side in ("fnscale", "plain_jax"):
    r = row[side]
    assert r["tokens_s"] == pytest.approx(8 * 64 / (r["step_ms"] / 1e3))
    assert r["mfu"] == pytest.approx(per_token * r["tokens_s"] / env.peak)
    assert 0 < r["hbm_gib"] < 1
  assert row["ratio"] == pytest.approx(row["fnscale"]["tokens_s"] / row["plain_jax"]["tokens_s"])


@pytest.mark.parametrize("text,why", [
    ("gpt-huge", "unknown base"), ("gpt-nano,batch=x", "not a number"),
    ("gpt-nano,model=small", "not KEY=VALUE"), ("gpt-nano,xla=fast", "xla in")])
def test_a_bad_case_is_refused_naming_it(text, why):
  with pytest.raises(fs.InputError, match=why):
    chip.parse_case(text)


def test_case_levers_parse_and_say_whether_the_peer_has_them():
  c = chip.parse_case("llama,remat=dots,blocks=1024/512/512/512,int8=1,loss_chunk=512")
  assert (c.model, c.batch, c.seq, c.remat, c.blocks, c.int8, c.loss_chunk) == (
      "llama-766m", 8, 2048, "dots", (1024, 512, 512, 512), True, 512)
  assert not c.peer_levers  # int8 is fnscale's alone
  assert chip.parse_case("gpt-medium,remat=qkv_attn").peer_levers
