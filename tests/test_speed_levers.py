"""The models' speed levers: remat policies, int8 matmuls, the unrolled layer loop, the loss
chunk. Each computes the model's own function (checked against the plain model) and does
what its name says (checked on what it saves, or on the program it lowers to)."""
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src.ad_checkpoint import saved_residuals

import fnscale as fs
from recipes.lm import checkpoints, gpt, int8, llama, remat, startup

CFG = llama.ModelConfig(layers=2, d_model=32, heads=4, kv_heads=2, d_mlp=64, seq=16, vocab=64)


def _batch(cfg, rows=2):
  ids = np.random.default_rng(0).integers(0, cfg.vocab, (rows, cfg.seq + 1)).astype(np.int32)
  return {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}


@functools.lru_cache(maxsize=None)
def _grads(policy, cfg=CFG):
  params = llama.init_params(cfg, jax.random.key(0))
  return jax.jit(jax.value_and_grad(functools.partial(llama.loss_fn, remat=policy, cfg=cfg)))(
      params, _batch(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots", "qkv_attn", "qkv", "offload_dots",
                                    "offload_attn", True])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(policy):
  (loss, grads), (want, want_grads) = _grads(policy), _grads("none")
  assert float(loss) == pytest.approx(float(want), rel=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy", remat.POLICIES)
def test_every_remat_policy_traces_a_gradient(policy):
  """Each name --remat_policy offers takes a gradient: "offload_dots" once combined its
  offload policy with a yes/no one through `save_from_both_policies`, which raises on
  anything but booleans, so choosing it failed at the first step."""
  params = jax.eval_shape(functools.partial(llama.init_params, CFG), jax.random.key(0))
  grads = jax.eval_shape(jax.grad(functools.partial(llama.loss_fn, remat=policy, cfg=CFG)),
                         params, _batch(CFG))
  assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, params)


@pytest.mark.tpu
@pytest.mark.parametrize("target, axes", [
    ("v5e:1x1", {"data": 1}), pytest.param("v5e:2x2", {"fsdp": 4}, marks=pytest.mark.slow)])
def test_offload_attn_holds_the_attention_kernels_output_in_the_hosts_memory(tpu_devices,
                                                                            target, axes):
  """Compiled for a v5e, where the attention is the splash kernel: "offload_attn" holds each
  layer's attention output (bf16 [rows, seq, heads, head_dim], a head of 64 held as 128
  lanes) and logsumexp (float32 [rows, heads, seq]) in the host's memory, a device's rows'
  worth on each, as `remat.attention_bytes` counts; "full" holds nothing there. On 4 devices
  the kernel runs per shard (a shard_map), whose output no policy saw."""
  del tpu_devices  # skips without libtpu
  devices = fs.target_devices(target)
  mesh = fs.make_mesh(axes, devices=devices)
  cfg = llama.model_config("llama-tiny", 1024, vocab=512, layers=2, d_model=256, heads=4,
                           kv_heads=2, d_mlp=512)
  rows, policy, opt = 4, startup.policy("auto", "tpu"), optax.adamw(1e-3)
  kw = dict(rules=llama.RULES, logical_axes=llama.logical_axes(cfg))
  state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                        policy=policy, key=jax.random.key(0), abstract=True, **kw)
  batch = {k: jax.ShapeDtypeStruct((rows, 1024), jnp.int32) for k in ("inputs", "targets")}
  held = {}
  for name in ("full", "offload_attn"):
    loss = functools.partial(llama.loss_fn, cfg=cfg, remat=name)
    step = fs.shard_step(fs.with_kernel(fs.train_step(loss, opt, policy=policy),
                                        attention="splash"), mesh, **kw)
    held[name] = step.compile(state, batch).compiled.memory_analysis().host_temp_size_in_bytes
  row = 1024 * cfg.heads * (128 * 2 + 4)  # (4 devices: the statistics padded, +2%)
  want = cfg.layers * rows // len(devices) * row
  assert held["full"] == 0 and held["offload_attn"] == pytest.approx(want, rel=0.02), held
  counted = remat.attention_bytes(cfg, rows * 1024, 2) / len(devices)
  assert held["offload_attn"] == pytest.approx(counted, rel=0.02)


@pytest.mark.tpu
def test_the_finite_flag_costs_the_compiled_step_no_bytes(tpu_devices):
  """train_lm's per-step finiteness flag over the new state (`checkpoints.with_finite_flag`),
  compiled for a v5e: the step's bytes accessed in HBM as without it. A reduction of each
  leaf alone made XLA split AdamW's update of a param and its moments in two, the second
  reading the new moments again (a 766M Llama: 6.3 GB a step, 1% of its step)."""
  del tpu_devices  # skips without libtpu
  mesh = fs.make_mesh({"data": 1}, devices=fs.target_devices("v5e:1x1"))
  cfg = llama.model_config("llama-tiny", 256, vocab=512, layers=2, d_model=512, heads=4,
                           kv_heads=2, d_mlp=1024)
  policy, opt = startup.policy("auto", "tpu"), optax.adamw(1e-3)
  kw = dict(rules=llama.RULES, logical_axes=llama.logical_axes(cfg))
  state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                        policy=policy, key=jax.random.key(0), abstract=True, **kw)
  batch = {k: jax.ShapeDtypeStruct((4, 256), jnp.int32) for k in ("inputs", "targets")}
  step = fs.train_step(functools.partial(llama.loss_fn, cfg=cfg), opt, policy=policy)
  cost = []
  for flagged in (step, checkpoints.with_finite_flag(step)):
    compiled = fs.shard_step(flagged, mesh, **kw).compile(state, batch).compiled
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    cost.append(analysis["bytes accessed"])
  assert cost[1] <= cost[0] * 1.001, cost  # before: 1.046x


def _saved_bytes(policy) -> int:
  params = llama.init_params(CFG, jax.random.key(0))["blocks"]
  one = jax.tree.map(lambda a: a[0], params)
  x = jnp.ones((2, CFG.seq, CFG.d_model))
  block = remat.checkpointed(lambda x, p: llama._block(x, p, CFG), policy)
  return sum(a.size * a.dtype.itemsize for a, why in saved_residuals(
      lambda x, p: block(x, p).sum(), x, one) if "argument" not in why)


def test_the_policies_save_less_in_the_order_of_their_documentation():
  """none > dots > qkv_attn >= qkv > full in bytes saved per block (arguments aside; off
  a TPU the attention has no kernel residuals, so qkv_attn saves what qkv does); full saves
  only constants: a mapping that swapped two policies fails the order."""
  sizes = [_saved_bytes(p) for p in ("none", "dots", "qkv_attn", "qkv", "full")]
  assert sizes[0] > sizes[1] > sizes[2] >= sizes[3] > 100 * sizes[4], sizes
  # "qkv" saves exactly q, k and v: [2, 16, 4 + 2 + 2 heads, 8] float32.
  assert sizes[3] == 2 * 16 * (4 + 2 + 2) * 8 * 4 + sizes[4]


def test_an_unknown_remat_policy_is_refused_with_the_names():
  with pytest.raises(fs.InputError, match="'dotz' is not a remat policy.*dots"):
    remat.checkpointed(lambda x: x, "dotz")


def test_int8_dense_is_close_to_the_float_matmul_forward_and_input_gradient():
  """Per-row / per-column int8 (127 levels): relative error well under 2% on Gaussian data;
  the weight gradient is the float one exactly. A scale over the wrong axis or no rounding
  to int8 at all would fail the first or the jaxpr check below."""
  x = jax.random.normal(jax.random.key(0), (64, 128))
  w = jax.random.normal(jax.random.key(1), (128, 96)) * 0.05
  g = jax.random.normal(jax.random.key(2), (64, 96))
  y, dx, dw = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(int8.dense, x, w)))(
      x, w, g)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(y, x @ w) < 0.02 and rel(dx, g @ w.T) < 0.02
  assert rel(y, x @ w) > 1e-4  # it did round
  np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-5)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: int8.dense(x, w).sum(), (0, 1)))(x, w))
  assert jaxpr.count("preferred_element_type=int32") == 2  # forward and input gradient


@pytest.mark.slow
def test_int8_dense_contracts_several_dims_as_tensordot():
  x = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))
  w = jax.random.normal(jax.random.key(1), (4, 8, 16))
  got = int8.dense(x, w, 2)
  assert got.shape == (2, 5, 16)
  want = jnp.tensordot(x, w, 2)
  assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 0.03


@pytest.mark.slow
@pytest.mark.parametrize("module,cfg", [(llama, CFG), (gpt, gpt.ModelConfig(2, 32, 2, 16, 64))])
def test_the_int8_and_unrolled_models_train_the_same_function(module, cfg):
  params = module.init_params(cfg, jax.random.key(0))
  loss = lambda c: float(jax.jit(functools.partial(module.loss_fn, cfg=c))(params, _batch(cfg)))
  base = loss(cfg)
  assert loss(cfg._replace(unroll=True)) == pytest.approx(base, rel=1e-6)
  assert loss(cfg._replace(int8=True)) == pytest.approx(base, rel=2e-3)
  assert loss(cfg._replace(int8=True)) != base


@pytest.mark.slow
def test_the_loss_chunk_reaches_the_cross_entropy():
  """loss_chunk=8 walks the 32 tokens in 4 chunks (a loop of length 4 beside the layers' 2;
  the default chunk, at least 1024 tokens, takes all 32 at once: length 1); same loss."""
  params = llama.init_params(CFG, jax.random.key(0))
  f = lambda c: functools.partial(llama.loss_fn, cfg=c)
  chunked = CFG._replace(loss_chunk=8)
  assert float(f(chunked)(params, _batch(CFG))) == pytest.approx(
      float(f(CFG)(params, _batch(CFG))), rel=1e-6)
  lengths = lambda c: set(re.findall(r"length=(\d+)", str(jax.make_jaxpr(
      jax.value_and_grad(f(c)))(params, _batch(CFG)))))
  assert lengths(chunked) == {"2", "4"} and lengths(CFG) == {"1", "2"}


def test_the_one_chip_llama_has_the_params_its_name_says():
  """llama-766m by hand: 8 layers x (q, o 2048 x 2048; k, v 2048 x 1024; three MLP matrices
  2048 x 8192; two norms) + the tied 128256 x 2048 embedding + the final norm."""
  cfg = llama.model_config("llama-766m", 2048)
  per_layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 8192 + 2 * 2048
  assert llama.param_count(cfg) == 8 * per_layer + 128256 * 2048 + 2048 == 766_019_584
  assert cfg.head_dim == 128 and cfg.tie_embeddings


def test_train_lms_remat_policy_defaults_by_platform_and_remat_means_full():
  from recipes.lm import cli, models, moe, options  # pylint: disable=import-outside-toplevel
  o = options.Options().step
  assert remat.remat_policy(o, "cpu") == "none" and remat.remat_policy(o, "tpu") == "dots"
  on = options.Options.of(remat=True).step
  assert [remat.remat_policy(on, p) for p in ("tpu", "gpu", "cpu")] == ["full"] * 3
  # --remat with --remat_policy=offload_attn (recomputing whole blocks too) keeps the policy.
  both = dataclasses.replace(on, remat_policy="offload_attn")
  assert models.remat_of(both, llama) == "offload_attn" and models.remat_of(both, moe) is True
  assert remat.remat_policy(options.Options.of(remat_policy="qkv").step, "cpu") == "qkv"
  with pytest.raises(fs.InputError, match="remat_policy='dot'.*did you mean 'dots'"):
    cli.check_options(options.Options, {"remat_policy": "dot"})
  # A model whose blocks recompute whole or not at all (moe) gets on/off from the policy.
  for policy, want in (("full", True), ("offload_attn", True), ("dots", False),
                       ("none", False)):
    o = options.Options.of(remat_policy=policy).step
    assert models.remat_of(o, moe) is want and models.remat_of(o, llama) == policy


@pytest.mark.parametrize("module", [remat, int8], ids=lambda m: m.__name__)
def test_the_lever_modules_examples_run(module):
  import doctest  # pylint: disable=import-outside-toplevel
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_the_int8_matmul_benchmark_times_each_part_and_its_parts_compute_the_matmul(capsys):
  """recipes/bench/int8_matmul.py on this host: a row per shape with every part timed, and
  each part computes what its name says (numpy: x @ w, and int8.dense within 2%)."""
  from recipes.bench import int8_matmul  # pylint: disable=import-outside-toplevel
  assert int8_matmul.main(["--shapes=64x32x48", "--reps=1"]) == 0
  row = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 64x32x48 |")]
  cells = row[0].strip("|").split("|")
  assert len(cells) == 13 and all(float(c) > 0 for c in cells[1:7])
  assert cells[7:9] == [" n/a "] * 2  # the kernel: a TPU's (its own tests: test_int8_kernel)
  x, w = (np.random.default_rng(i).normal(size=s).astype(np.float32) for i, s in
          enumerate(((64, 32), (32, 48))))
  run = {k: f for k, (f, _) in int8_matmul.parts(64, 32, 48).items()}
  want = x @ w
  np.testing.assert_allclose(run["bf16 fwd"](x, w), want, rtol=1e-5, atol=1e-5)
  got = np.asarray(run["int8.dense fwd"](x, w))
  assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
  # fwd+bwd computes the forward too (its result kept, so that XLA can't drop its matmul)
  # and both gradients.
  g = np.random.default_rng(2).normal(size=(64, 48)).astype(np.float32)
  y, (dx, dw) = run["bf16 fwd+bwd"](x, w, g)
  for a, b in ((y, want), (dx, g @ w.T), (dw, x.T @ g)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  with pytest.raises(fs.InputError, match="'64x32' is not MxKxN"):
    int8_matmul.main(["--shapes=64x32"])


@pytest.mark.parametrize("generation,says", [("v5e", True), ("v5p", False)])
def test_int8_on_a_chip_where_it_runs_slower_says_so(monkeypatch, generation, says):
  """--int8 asked for on a v5e (where it measured 0.70-1.02x bfloat16): one note saying so and
  where the reason is; elsewhere nothing."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from recipes.lm import data, hardware, memory, run_setup  # pylint: disable=import-outside-toplevel
  from recipes.lm.options import Options  # pylint: disable=import-outside-toplevel

  class Decided(Exception):
    pass
  topo = dataclasses.replace(fs.detect_topology(), generation=generation)
  monkeypatch.setattr(hardware, "detect", lambda o: topo)
  monkeypatch.setattr(memory, "choose", lambda *a, **k: (_ for _ in ()).throw(Decided()))
  corpus = data.Corpus(np.zeros(4000, np.uint8), np.zeros(400, np.uint8), 256, 1.0, None, None,
                       "")
  said = []
  with pytest.raises(Decided):
    run_setup.decide(Options.of(model_config="nano", int8=True, mesh="data=-1"), corpus,
                     said.append)
  notes = [s for s in said if s.startswith("note: --int8")]
  assert len(notes) == int(says)
  if says:
    assert "TPU v5e" in notes[0] and "'--int8 by part'" in notes[0]
    # The section named is there.
    bench = os.path.join(os.path.dirname(__file__), "..", "recipes", "bench", "README.md")
    with open(bench, encoding="utf-8") as f:
      assert "**`--int8` by part**" in f.read()
