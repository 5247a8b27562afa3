"""The chip benchmark's peer and its CPU path: the plain-JAX step (recipes/bench/plain_jax.py)
trains as fnscale's step does, and `recipes/bench/chip.py` runs a tiny case end to end."""
import functools
import pathlib

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
  shapes = lambda f, cfg: jax.eval_shape(functools.partial(f, cfg), jax.random.key(0))
  for mine, theirs in ((shapes(pj.init_gpt, pj.GPT(2, 32, 2, 16, 256)),
                        shapes(gpt.init_params, GPT_CFG)),
                       (shapes(pj.init_llama, pj.Llama(2, 32, 4, 2, 64, 16, 256)),
                        shapes(llama.init_params, LLAMA_CFG))):
    assert mine == theirs  # same tree, shapes and dtypes


@pytest.mark.slow
def test_a_tiny_case_runs_both_steps_alternately_with_the_palm_mfu():
  """gpt-nano on the CPU devices: the three sides timed, tokens/s = tokens / step time, and the
  MFU over the hand count of PaLM's formula: N = 2 layers x 12 x 64^2 + 256 x 64 matmul
  weights, 6 N + 12 x 2 x 64 x 64 FLOPs per token."""
  env = chip.environment()
  row = chip.measure(chip.parse_case("gpt-nano,batch=8,peer=1,hand=1"), env, rounds=2,
                     steps=1, warmup=1)
  per_token = 6 * (2 * 12 * 64**2 + 256 * 64) + 12 * 2 * 64 * 64
  assert row["flops_token"] == per_token
  for side in ("fnscale", "by_hand", "plain_jax"):
    r = row[side]
    assert r["tokens_s"] == pytest.approx(8 * 64 / (r["step_ms"] / 1e3))
    assert r["mfu"] == pytest.approx(per_token * r["tokens_s"] / env.peak)
    assert 0 < r["hbm_gib"] < 1
  rate = lambda n: row[n]["tokens_s"]
  assert row["ratio"] == pytest.approx(rate("fnscale") / rate("plain_jax"))
  # hand=1: the wrapper's cost and the model code's, apart.
  assert row["wrapper"] == pytest.approx(rate("fnscale") / rate("by_hand"))
  assert row["model_code"] == pytest.approx(rate("by_hand") / rate("plain_jax"))


@pytest.mark.slow
def test_the_hand_side_is_train_lms_model_under_a_plain_jit_step():
  """hand=1: train_lm's own GPT under the hand-written step makes the same step as
  fnscale's from the same state (loss, params after it)."""
  env = chip.environment()
  case = chip.parse_case("gpt-nano,batch=8,hand=1")
  module, cfg = chip.model_of(case)
  batch = chip.random_batch(case, cfg.vocab, env.mesh)
  out = {}
  for name, side in (("fnscale", chip.fnscale_side), ("by_hand", chip.hand_side)):
    state = chip.init(case, env)
    compiled = side(case, env, state, batch)
    new, loss = compiled.run(state, batch)
    out[name] = jax.device_get((loss, new.params))
  np.testing.assert_allclose(out["fnscale"][0], out["by_hand"][0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               out["fnscale"][1], out["by_hand"][1])


@pytest.mark.slow
def test_profile_splits_every_side_and_keeps_its_trace_and_program(tmp_path):
  """profile=1 traces each side (fnscale, the peer) on its own: both splits hold the model's
  matmuls, and --trace_dir keeps each side's XSpace and the optimized HLO it ran."""
  env = chip.environment()
  row = chip.measure(chip.parse_case("gpt-nano,batch=8,peer=1,profile=1,attn=xla"), env,
                     rounds=1, steps=1, warmup=1, trace_dir=str(tmp_path))
  for side in ("fnscale", "plain_jax"):
    split = row[side]["split"]
    assert split["step_ms"] > 0 and split["fractions"]["matmul"] > 0
    prefix = tmp_path / f"gpt-nano_batch_8_peer_1_profile_1_attn_xla.{side}"
    assert pathlib.Path(f"{prefix}.xplane.pb").stat().st_size > 0
    assert pathlib.Path(f"{prefix}.hlo.txt").read_text().startswith("HloModule")
  assert row["split"] == row["fnscale"]["split"]
  assert "split plain_jax:" in chip.describe(row)


@pytest.mark.parametrize("text,why", [
    ("gpt-huge", "unknown base"), ("gpt-nano,batch=x", "not a number"),
    ("gpt-nano,model=small", "not KEY=VALUE"), ("gpt-nano,xla=fast", "xla in"),
    ("gpt-nano,attn=flash", "expected xla or splash")])
def test_a_bad_case_is_refused_naming_it(text, why):
  with pytest.raises(fs.InputError, match=why):
    chip.parse_case(text)


def test_case_levers_parse_and_say_whether_the_peer_has_them():
  c = chip.parse_case("llama,remat=dots,blocks=1024/512/512/512,int8=1,loss_chunk=512")
  assert (c.model, c.batch, c.seq, c.remat, c.blocks, c.int8, c.loss_chunk) == (
      "llama-766m", 8, 2048, "dots", (1024, 512, 512, 512), True, 512)
  assert not c.peer_levers  # int8 is fnscale's alone
  assert chip.parse_case("gpt-medium,remat=qkv_attn").peer_levers


# A TPU-like optimized module: a convolution fusion, a loop fusion, the splash kernel, an
# async all-gather, a while loop (whose event spans its body's) and a copy.
_HLO = """HloModule jit_step, is_scheduled=true

%fc.1 (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %convolution.9 = bf16[8,8]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%fc.2 (p0.1: bf16[8,8]) -> bf16[8,8] {
  %p0.1 = bf16[8,8]{1,0} parameter(0)
  ROOT %tanh.1 = bf16[8,8]{1,0} tanh(%p0.1)
}

ENTRY %main.3 (a: bf16[8,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %fusion.1 = bf16[8,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%fc.1
  %fusion.2 = bf16[8,8]{1,0} fusion(%fusion.1), kind=kLoop, calls=%fc.2
  %splash_mha_fwd.3 = bf16[8,8]{1,0} custom-call(%fusion.2), custom_call_target="tpu_custom_call"
  %all-gather-start.4 = (bf16[8,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%a), dimensions={0}
  %while.5 = (s32[], bf16[8,8]{1,0}) while(%t), condition=%cond, body=%body
  ROOT %copy.6 = bf16[8,8]{1,0} copy(%splash_mha_fwd.3)
}
"""


def _trace(events, module_ps):
  """An XSpace as a TPU writes it: per op, its instruction's text as the event name."""
  meta = "".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}\n'
                 for i, (n, _, _) in enumerate(events, 1))
  ops = "".join(f"events {{ metadata_id: {i} offset_ps: {t} duration_ps: {d} }}\n"
                for i, (_, t, d) in enumerate(events, 1))
  text = (f'planes {{ id: 1 name: "/device:TPU:0"\n'
          f'lines {{ id: 1 name: "XLA Modules" timestamp_ns: 0\n'
          f'events {{ metadata_id: 99 offset_ps: 0 duration_ps: {module_ps} }} }}\n'
          f'lines {{ id: 2 name: "XLA Ops" timestamp_ns: 0\n{ops}}}\n{meta}'
          f'event_metadata {{ key: 99 value {{ id: 99 name: "jit_step(1)" }} }} }}\n')
  return jax.profiler.ProfileData.from_text_proto(text)


def test_the_trace_split_sorts_a_tpus_ops_by_what_their_hlo_computes():
  """Times in ps of one 100 us step: the convolution fusion 40 (matmul), the tanh fusion 10,
  the copy 5 (elementwise), the splash kernel 20 (attention), the all-gather 5 (collective);
  the while loop's event spans its body (the convolution) and counts nothing itself; 20 us
  with no op is idle; the root's event name starts with ROOT. A split that read the fusion
  by its kind, counted the loop, or missed the kernel would give other shares."""
  from recipes.bench import trace_split
  text = lambda name: next(line.strip() for line in _HLO.splitlines() if f"%{name} =" in line)
  us = 1_000_000  # ps
  events = [(text("fusion.1"), 0, 40 * us), (text("while.5"), 0, 40 * us),
            (text("fusion.2"), 40 * us, 10 * us), (text("splash_mha_fwd.3"), 50 * us, 20 * us),
            (text("all-gather-start.4"), 70 * us, 5 * us), (text("copy.6"), 75 * us, 5 * us)]
  s = trace_split.split(_trace([(n.replace('"', '\\"'), t, d) for n, t, d in events],
                               100 * us), _HLO, runs=1)
  assert s.step_s == pytest.approx(100e-6)
  assert {k: round(v * 1e6, 3) for k, v in s.seconds.items()} == {
      "matmul": 40, "attention": 20, "elementwise": 15, "collective": 5, "idle": 20}
  assert s.unmatched == 0 and s.top[0] == ("fusion.1", "matmul", pytest.approx(40e-6))


@pytest.mark.slow
def test_the_trace_splits_example_runs_on_a_cpu_trace():
  import doctest  # pylint: disable=import-outside-toplevel
  from recipes.bench import trace_split
  result = doctest.testmod(trace_split)
  assert result.attempted > 0 and result.failed == 0
