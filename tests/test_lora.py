"""LoRA (fnscale.lora) against independent references: merged weights against numpy's W +
scale A B, the factored product and its gradients against the merged weight's, a tiny Llama
trained with LoRA on 8 devices (data=2, fsdp=4) against one device, the placed state's bytes
against a hand count, and bad input refused with the fix."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from recipes.lm import llama

LLAMA_TARGETS = (("blocks/w(q|k|v)", "lioo"), ("blocks/wo", "liio"),
                 ("blocks/w_(gate|up|down)", "lio"))


# ------------------------------------------------------------------------------ bad input


BASE = {"embed": jnp.zeros((32, 16)), "blocks": {"wq": jnp.zeros((2, 16, 4, 8)),
                                                 "norm": jnp.zeros((2, 16)),
                                                 "step": jnp.zeros((2, 16, 4), jnp.int32)}}


@pytest.mark.parametrize("targets, words", [
    (("blocks/wk",), ["'blocks/wk' matches no leaf", "did you mean 'blocks/wq'"]),
    (("blocks/wq",), ["shape [2, 16, 4, 8]", "give its layout", "'llio'"]),
    ((("blocks/wq", "lio"),), ["layout 'lio'", "one letter per dim"]),
    ((("blocks/wq", "ilio"),), ["stacked 'l's first"]),
    ((("blocks/wq", "liii"),), ["at least one 'i' and one 'o'"]),
    (("blocks/step",), ["int32", "float matmul weights only"]),
    ((), ["targets is empty"]),
    (("blocks/(wq",), ["not a regex"]),
])
def test_targets_that_cannot_work_are_refused_with_the_fix(targets, words):
  with pytest.raises(fs.LoraError) as e:
    fs.lora.targets(BASE, fs.lora.LoraConfig(rank=2, targets=targets))
  for w in words:
    assert w in str(e.value)


@pytest.mark.parametrize("field, value", [("rank", 0), ("rank", 2.0), ("alpha", 0.0),
                                          ("alpha", float("nan")), ("dropout", 1.0)])
def test_bad_config_fields_are_named(field, value):
  cfg = fs.lora.LoraConfig(targets=("embed",))._replace(**{field: value})
  with pytest.raises(fs.LoraError, match=field):
    fs.lora.targets(BASE, cfg)


def test_adapters_of_another_rank_or_base_are_refused():
  cfg = fs.lora.LoraConfig(rank=2, targets=("embed",))
  adapters = fs.lora.init(BASE, cfg, jax.random.key(0))
  with pytest.raises(fs.LoraError, match=r"'embed/a'.*\[32, 3\].*\[32, 2\]"):
    fs.lora.merge(BASE, adapters, cfg._replace(rank=3))
  with pytest.raises(fs.LoraError, match="'blocks/wq/a'"):
    fs.lora.merge(BASE, adapters, cfg._replace(targets=("embed", ("blocks/wq", "lioo"))))


def test_a_lora_weight_used_as_an_array_names_the_fix():
  cfg = fs.lora.LoraConfig(rank=2, targets=("embed",))
  bound = fs.lora.bind(BASE, fs.lora.init(BASE, cfg, jax.random.key(0)), cfg)
  with pytest.raises(fs.LoraError, match="fs.lora.einsum"):
    jnp.ones((3, 32)) @ bound["embed"]
  with pytest.raises(fs.LoraError, match="layout 'io'"):  # W's input dim used as an output
    fs.lora.einsum("bf,df->bd", jnp.ones((3, 16)), bound["embed"])


def test_dropout_needs_a_key_and_the_factored_form():
  cfg = fs.lora.LoraConfig(rank=2, dropout=0.1, targets=("embed",))
  with pytest.raises(fs.LoraError, match="merged=True"):
    fs.lora.with_lora(lambda p, b: 0.0, cfg, merged=True)
  loss = fs.lora.with_lora(lambda p, b: 0.0, cfg)
  with pytest.raises(fs.LoraError, match="needs a key"):
    loss(fs.lora.init(BASE, cfg, jax.random.key(0)), {}, frozen=BASE)


# ------------------------------------------------------------------------------- numerics


def _random(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=s).astype(np.float32) for s in shapes]


def test_merge_is_w_plus_scale_a_b_in_every_layout():
  # Equinox/PyTorch [out, in] ("oi") and a stacked query weight [layers, d, heads, hd].
  w_oi, w_q = _random([(6, 5), (3, 5, 2, 4)])
  base = {"lin": w_oi, "wq": w_q}
  cfg = fs.lora.LoraConfig(rank=2, alpha=3.0, targets=(("lin", "oi"), ("wq", "lioo")))
  a1, b1, a2, b2 = _random([(5, 2), (2, 6), (3, 5, 2), (3, 2, 2, 4)], seed=1)
  adapters = {"lin": {"a": a1, "b": b1}, "wq": {"a": a2, "b": b2}}
  out = fs.lora.merge(jax.tree.map(jnp.asarray, base), adapters, cfg)
  s = 3.0 / 2
  np.testing.assert_allclose(out["lin"], w_oi + s * (a1 @ b1).T, rtol=1e-6, atol=1e-6)
  want = np.stack([w_q[l] + s * (a2[l] @ b2[l].reshape(2, 8)).reshape(5, 2, 4)
                   for l in range(3)])
  np.testing.assert_allclose(out["wq"], want, rtol=1e-6, atol=1e-6)


def test_factored_einsum_and_its_gradients_equal_the_merged_weights():
  # wo-like [layers, heads, hd, d] ("liio") used inside a scan, as the model does.
  w, x = _random([(3, 2, 4, 6), (5, 7, 2, 4)])
  cfg = fs.lora.LoraConfig(rank=2, alpha=5.0, targets=(("wo", "liio"),))
  a, b = _random([(3, 2, 4, 2), (3, 2, 6)], seed=2)
  base, adapters = {"wo": jnp.asarray(w)}, {"wo": {"a": jnp.asarray(a), "b": jnp.asarray(b)}}

  def run(adapters, form):
    p = form(base, adapters, cfg)
    body = lambda h, wl: (h + fs.lora.einsum("bshk,hkd->bsd", x, wl).sum() * h, None)
    y = jax.lax.scan(body, jnp.ones(()), p["wo"])[0]
    return y

  merged = lambda b_, ad, c: {"wo": fs.lora.merge(b_, ad, c)["wo"]}
  y1, g1 = jax.value_and_grad(run)(adapters, fs.lora.bind)
  y2, g2 = jax.value_and_grad(run)(adapters, merged)
  np.testing.assert_allclose(y1, y2, rtol=1e-5)
  for k in ("a", "b"):
    np.testing.assert_allclose(g1["wo"][k], g2["wo"][k], rtol=1e-4, atol=1e-5)


def test_train_step_moves_only_the_adapters_down_the_merged_models_gradient():
  import models  # pylint: disable=import-outside-toplevel  # tests/models.py
  base = models.mlp_init(jax.random.key(0))
  cfg = fs.lora.LoraConfig(rank=2, alpha=4.0, targets=("w1", "w2"))
  adapters = {k: {"a": v["a"], "b": v["b"] + 0.1}
              for k, v in fs.lora.init(base, cfg, jax.random.key(1)).items()}
  batch = models.mlp_batch(jax.random.key(2), 8)
  # The reference: jax.grad of the model's loss at W + scale A B, one SGD step by hand.
  grads = jax.jit(jax.grad(lambda ad: models.mlp_loss(fs.lora.merge(base, ad, cfg), batch)))(
      adapters)
  want = jax.tree.map(lambda p, g: p - 0.5 * g, adapters, grads)
  opt = optax.sgd(0.5)
  for accum in (1,):  # (accum_steps > 1: the slow tier's meshes)
    state = fs.TrainState(adapters, opt.init(adapters), jnp.zeros((), jnp.int32), None, base)
    step = jax.jit(fs.train_step(fs.lora.with_lora(models.mlp_loss, cfg, merged=True), opt,
                                 accum_steps=accum))
    new, m = step(state, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 new.params, want)
    assert float(m["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
    for x, y in zip(jax.tree.leaves(new.frozen), jax.tree.leaves(base)):
      np.testing.assert_array_equal(x, y)
  adam = optax.adam(1e-3)
  slots = jax.tree.leaves(adam.init(adapters))
  assert sum(x.size for x in slots) == 1 + 2 * sum(x.size for x in jax.tree.leaves(adapters))


# ----------------------------------------------------------------- a tiny Llama, trained

CFG = llama.model_config("llama-tiny", 16, layers=2, d_model=64, heads=4, kv_heads=2,
                         d_mlp=128, vocab=128)
LORA = fs.lora.LoraConfig(rank=4, alpha=8.0, targets=LLAMA_TARGETS)
OPT = optax.adamw(1e-2)


def _batch(seed, rows=16):
  tokens = np.random.default_rng(seed).integers(0, CFG.vocab, (rows, CFG.seq + 1), np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.cache
def _base_and_adapters():
  """Base params and adapters with a nonzero B (so the adapters change the forward pass)."""
  base = llama.init_params(CFG, jax.random.key(0))
  adapters = fs.lora.init(base, LORA, jax.random.key(1))
  adapters = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.05 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if str(p[-1]) == "['b']" else x, adapters)
  return base, adapters


def _losses(state, step, steps=3):
  out = []
  for i in range(steps):
    state, m = step(state, _batch(i))
    out.append(float(m["loss"]))
  return np.array(out), state


def _loss(params, batch):
  return llama.loss_fn(params, batch, cfg=CFG)


@pytest.fixture(scope="module")
def one_device():
  """Losses of 3 adamw steps on one device (plain jit, no mesh) and the state after them."""
  base, adapters = _base_and_adapters()
  state = fs.TrainState(adapters, OPT.init(adapters), jnp.zeros((), jnp.int32), None, base)
  step = jax.jit(fs.train_step(fs.lora.with_lora(_loss, LORA), OPT))
  return _losses(state, step) + (base,)


def _placed(mesh):
  base, adapters = _base_and_adapters()
  placed = fs.init_state(base, optax.sgd(0.0), mesh=mesh, rules=llama.RULES,
                         logical_axes=llama.logical_axes(CFG)).params
  state = fs.lora.init_state(placed, LORA, OPT, key=jax.random.key(1))
  sh = jax.tree.map(lambda x: x.sharding, state.params)
  return state._replace(params=jax.device_put(adapters, sh))


@pytest.mark.slow
def test_lora_on_8_devices_trains_as_on_one(one_device):
  want, after, base = one_device
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  state = _placed(mesh)
  assert state.params["blocks"]["wq"]["a"].sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp", None)  # A follows W's input dim ("embed" over fsdp)
  step = fs.shard_step(fs.train_step(fs.lora.with_lora(_loss, LORA), OPT), mesh)
  got, state = _losses(state, step)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  assert not np.allclose(got[0], got[-1])  # it trains
  # The base is returned as it came, and only the adapters have optimizer state.
  for x, y in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  mu = state.opt_state[0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(state.params)
  np.testing.assert_allclose(np.asarray(state.params["blocks"]["w_up"]["b"]),
                             np.asarray(after.params["blocks"]["w_up"]["b"]), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("axes, accum", [({"data": 2, "fsdp": 4}, 2),
                                         ({"data": 2, "fsdp": 2, "tensor": 2}, 2)])
def test_lora_trains_alike_under_other_meshes_and_accumulation(one_device, axes, accum):
  want = one_device[0]
  mesh = fs.make_mesh(axes)
  step = fs.shard_step(fs.train_step(fs.lora.with_lora(_loss, LORA), OPT,
                                     accum_steps=accum), mesh)
  got, _ = _losses(_placed(mesh), step)
  np.testing.assert_allclose(got, want, rtol=2e-5)


def _device_bytes(tree) -> int:
  """The most bytes one device holds of `tree`'s placed arrays."""
  per = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      per[s.device] = per.get(s.device, 0) + s.data.nbytes
  return max(per.values())


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_the_placed_lora_state_holds_the_bf16_base_and_adapters_with_two_slots():
  mesh = fs.make_mesh({"fsdp": 8})
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=256, heads=8, kv_heads=2,
                           d_mlp=512, vocab=256)
  base = fs.init_state(functools.partial(llama.init_params, cfg), optax.sgd(0.0),
                       mesh=mesh, rules=llama.RULES, logical_axes=llama.logical_axes(cfg),
                       key=jax.random.key(0), abstract=False).params
  state = fs.lora.init_state(base, LORA, optax.adam(1e-3), key=jax.random.key(1),
                             base_dtype=jnp.bfloat16)
  # Hand counts: every param in bfloat16; per layer, rank (in + out) float32 per target.
  L, D, F, K = cfg.layers, cfg.d_model, cfg.d_mlp, cfg.head_dim
  qkv_out = (cfg.heads + 2 * cfg.kv_heads) * K
  params = llama.param_count(cfg)
  adapter = L * LORA.rank * ((3 * D + qkv_out) + (cfg.heads * K + D) + 2 * (D + F) + (F + D))
  assert sum(x.size for x in jax.tree.leaves(state.params)) == adapter
  want = (2 * params + 4 * adapter * (1 + 2)) / 8  # adam: two float32 slots
  got = _device_bytes((state.params, state.opt_state, state.frozen))
  assert got <= 1.05 * want, (got, want)
  full = fs.init_state(base, optax.adam(1e-3), mesh=mesh, rules=llama.RULES,
                       logical_axes=llama.logical_axes(cfg))
  assert got < 0.25 * _device_bytes((full.params, full.opt_state))


# ----------------------------------------------------------------------- other frameworks


@pytest.mark.slow
def test_an_equinox_model_runs_with_merged_adapters():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(6, 3, 8, depth=2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  cfg = fs.lora.LoraConfig(rank=2, alpha=4.0, targets=((r"layers/\d+/weight", "oi"),))
  assert [t.path for t in fs.lora.targets(params, cfg)] == [
      "layers/0/weight", "layers/1/weight", "layers/2/weight"]
  adapters = jax.tree.map(lambda x: x + 0.3, fs.lora.init(params, cfg, jax.random.key(1)))
  x = np.linspace(-1, 1, 6).astype(np.float32)
  y = eqx.combine(fs.lora.merge(params, adapters, cfg), static)(jnp.asarray(x))
  h = x  # numpy: each Linear's weight [out, in] plus 2 (A B)^T, ReLU between
  for i, layer in enumerate(model.layers):
    ad = adapters["layers"][str(i)]["weight"]
    w = np.asarray(layer.weight) + 2.0 * (np.asarray(ad["a"]) @ np.asarray(ad["b"])).T
    h = w @ h + np.asarray(layer.bias)
    h = np.maximum(h, 0) if i < 2 else h
  np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_flax_linen_params_tree_takes_adapters_where_its_kernels_are():
  nn = pytest.importorskip("flax.linen")
  model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
  params = model.init(jax.random.key(0), jnp.ones((1, 6)))
  cfg = fs.lora.LoraConfig(rank=2, targets=(r"params/layers_\d/kernel",))
  adapters = jax.tree.map(lambda x: x + 0.1, fs.lora.init(params, cfg, jax.random.key(1)))
  merged = fs.lora.merge(params, adapters, cfg)
  x = jnp.linspace(-1, 1, 12).reshape(2, 6)
  bound = fs.lora.bind(params, adapters, cfg)["params"]
  h = jax.nn.relu(fs.lora.einsum("bi,io->bo", x, bound["layers_0"]["kernel"])
                  + bound["layers_0"]["bias"])
  want = fs.lora.einsum("bi,io->bo", h, bound["layers_2"]["kernel"]) + bound["layers_2"]["bias"]
  np.testing.assert_allclose(model.apply(merged, x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("axis_types, mode, accum", [("explicit", "auto", 2),
                                                     ("auto", "shard_map", 1)])
def test_merged_lora_trains_alike_on_explicit_axes_and_per_shard(axis_types, mode, accum):
  import models  # pylint: disable=import-outside-toplevel  # tests/models.py
  mlp = models.MLPConfig(d_in=64, d_hidden=256, d_out=8)
  params = models.mlp_init(jax.random.key(0), mlp)
  cfg = fs.lora.LoraConfig(rank=2, targets=("w1", "w2"))
  loss = fs.lora.with_lora(models.mlp_loss, cfg, merged=True)
  opt = optax.adam(1e-2)
  batches = [models.mlp_batch(jax.random.key(i), 16, mlp) for i in range(3)]

  def run(state, step):
    out = []
    for b in batches:
      state, m = step(state, b)
      out.append(float(m["loss"]))
    return out
  adapters = fs.lora.init(params, cfg, jax.random.key(1))
  one = fs.TrainState(adapters, opt.init(adapters), jnp.zeros((), jnp.int32), None, params)
  want = run(one, jax.jit(fs.train_step(loss, opt)))
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types=axis_types)
  placed = fs.init_state(params, optax.sgd(0.0), mesh=mesh, rules=models.RULES,
                         logical_axes=models.mlp_logical_axes()).params
  assert placed["w1"].sharding.spec[0] == "fsdp"
  state = fs.lora.init_state(placed, cfg, opt, key=jax.random.key(1))
  step = fs.shard_step(fs.train_step(loss, opt, accum_steps=accum), mesh, mode=mode)
  np.testing.assert_allclose(run(state, step), want, rtol=2e-5)


def test_dropout_zeroes_adapter_inputs_and_keeps_their_mean():
  # Inverted dropout on the adapters' inputs: each key drops some of x's entries from the
  # low-rank path (not from x W), and the mean over keys is the undropped product.
  w, x = _random([(3, 6, 4), (5, 6)])
  cfg = fs.lora.LoraConfig(rank=2, alpha=2.0, dropout=0.5, targets=("w",))  # stacked "lio"
  a, b = _random([(3, 6, 2), (3, 2, 4)], seed=3)
  base, ad = {"w": jnp.asarray(w)}, {"w": {"a": jnp.asarray(a), "b": jnp.asarray(b)}}

  def y(key):
    bound = fs.lora.bind(base, ad, cfg, key)["w"]
    assert bound.key.shape == (3,)  # one key per stacked layer
    return jax.lax.map(lambda wl: fs.lora.einsum("bd,df->bf", x, wl), bound)
  keys = jax.random.split(jax.random.key(0), 2000)
  ys = jax.jit(jax.vmap(y))(keys)
  plain = np.einsum("bd,ldf->lbf", x, w)
  full = plain + np.einsum("bd,ldr,lrf->lbf", x, a, b)
  assert not np.allclose(ys[0], full, atol=1e-3)  # one key drops some inputs
  err = np.abs(np.mean(ys, axis=0) - full) / (np.std(ys, axis=0) / np.sqrt(len(keys)))
  assert err.max() < 5  # within 5 standard errors of the mean everywhere
  # A key with dropout 0 is no dropout: exactly the merged weights' product.
  exact = jax.lax.map(lambda wl: fs.lora.einsum("bd,df->bf", x, wl),
                      fs.lora.bind(base, ad, cfg._replace(dropout=0.0), keys[0])["w"])
  np.testing.assert_allclose(exact, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["targets", "init", "merge", "einsum", "init_state"])
def test_the_examples_of_fnscale_lora_run(name):
  from test_doctests import run_examples  # pylint: disable=import-outside-toplevel
  results, report = run_examples(getattr(fs.lora, name), f"fnscale.lora.{name}")
  assert results.attempted > 0 and results.failed == 0, report


def test_the_examples_of_the_checkpoint_fingerprint_run():
  from test_doctests import run_examples  # pylint: disable=import-outside-toplevel
  results, report = run_examples(fs.checkpoint.fingerprint, "fnscale.checkpoint.fingerprint")
  assert results.attempted > 0 and results.failed == 0, report


def test_a_fingerprint_is_the_same_on_any_mesh_and_changes_with_any_element():
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  tree = {"w": jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8).astype(jnp.bfloat16),
          "n": jnp.arange(5, dtype=jnp.int32)}
  one = fs.checkpoint.fingerprint(tree)
  mesh = fs.make_mesh({"fsdp": 8})
  placed = {"w": jax.device_put(tree["w"], NamedSharding(mesh, P("fsdp", None))),
            "n": jax.device_put(tree["n"], NamedSharding(mesh, P()))}
  assert fs.checkpoint.fingerprint(placed) == one
  for other in ({**tree, "w": tree["w"].at[63, 7].set(0)},      # one element
                {**tree, "w": tree["w"].astype(jnp.float32)},   # the dtype
                {**tree, "w": tree["w"].reshape(8, 64)},        # the shape
                {"v": tree["w"], "n": tree["n"]}):              # a path
    assert fs.checkpoint.fingerprint(other) != one


def test_the_compiled_lora_step_computes_no_weight_gradient_of_the_frozen_base():
  # The HLO's matmul FLOPs of a LoRA step, every block matmul adapted: each frozen matmul
  # weight's forward and input gradient (4 N, the output layer's too), the adapters' 6 N,
  # attention's 12 layers heads head_dim seq per token: what train_lm's MFU counts
  # (recipes/lm/finetune.py). A step that formed the base's weight gradients would be 6 N.
  import types  # pylint: disable=import-outside-toplevel
  from recipes.lm import finetune, options  # pylint: disable=import-outside-toplevel
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=32, heads=4, kv_heads=2,
                           d_mlp=64, vocab=40)
  lora = fs.lora.LoraConfig(rank=4, targets=llama.lora_targets(cfg))
  mesh = fs.make_mesh({"data": 1}, devices=jax.devices()[:1])
  base = fs.init_state(lambda k: llama.init_params(cfg, k), optax.sgd(0.0), mesh=mesh,
                       key=jax.random.key(0), abstract=True).params
  state = fs.lora.init_state(base, lora, OPT, key=jax.random.key(1), abstract=True)
  rows = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  step = fs.shard_step(fs.train_step(fs.lora.with_lora(
      functools.partial(llama.loss_fn, cfg=cfg), lora), OPT), mesh)
  got = fs.analysis.hlo.summarize(step.compile(state, {"inputs": rows, "targets": rows})
                         .compiled.as_text()).matmul_flops
  n, tokens = llama.matmul_params(cfg), 4 * 16
  adapters = sum(x.size for x in jax.tree.leaves(state.params))
  attn = 12 * cfg.layers * cfg.heads * cfg.head_dim * 16
  assert got == tokens * (4 * n + 6 * adapters + attn)
  setup = types.SimpleNamespace(cfg=cfg, model=llama, o=options.Options())  # --objective=lm
  assert got == tokens * finetune.flops_per_token(setup, lora)
