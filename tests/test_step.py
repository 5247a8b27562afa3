"""Tests for the step: train_step, init_state, shard_step, compile_report (8 CPU devices)."""
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale
import fnscale as fs
import models

STEPS = 10
BATCH = 32
MESHES = ("data=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "fsdp=8")
MODELS = {
    "mlp": (models.mlp_init, models.mlp_loss, models.mlp_logical_axes, models.mlp_batch, False),
    "transformer": (models.transformer_init, models.transformer_loss,
                    models.transformer_logical_axes, models.transformer_batch, True),
}


def _optimizer():
  return optax.adamw(1e-2, weight_decay=1e-4)


def _batches(model, n=STEPS, batch_size=BATCH):
  make = MODELS[model][3]
  return [make(jax.random.key(100 + i), batch_size) for i in range(n)]


@functools.lru_cache(maxsize=None)
def _reference_losses(model):
  """A plain single-device jax.jit step, written without fnscale."""
  init, loss_fn, _, _, has_aux = MODELS[model]
  opt = _optimizer()
  dev = jax.devices()[0]
  params = jax.device_put(init(jax.random.key(0)), dev)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    f = (lambda p: loss_fn(p, batch)[0]) if has_aux else (lambda p: loss_fn(p, batch))
    loss, grads = jax.value_and_grad(f)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for batch in _batches(model):
    params, opt_state, loss = step(params, opt_state, jax.device_put(batch, dev))
    losses.append(float(loss))
  return np.array(losses), jax.device_get(params)


@functools.lru_cache(maxsize=None)
def _trained(model, mesh_axes):
  """10 steps of the fnscale step on `mesh_axes`: (losses, compiled step, final state)."""
  init, loss_fn, logical, _, has_aux = MODELS[model]
  mesh = fnscale.make_mesh(mesh_axes)
  opt = _optimizer()
  state = fnscale.init_state(init, opt, mesh=mesh, rules=models.RULES,
                             logical_axes=logical(), key=jax.random.key(0))
  step = fnscale.train_step(loss_fn, opt, has_aux=has_aux)
  batches = _batches(model)
  compiled = fnscale.shard_step(step, mesh, rules=models.RULES, logical_axes=logical(),
                                example=(state, batches[0]))
  losses = []
  for batch in batches:
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses), compiled, state


def _state_device_bytes(state):
  """Per-device bytes of every state leaf's addressable shards: {device: bytes}."""
  per = {}
  for leaf in jax.tree_util.tree_leaves(state):
    for shard in leaf.addressable_shards:
      per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return per


# ----------------------------------------------------------------------------- equivalence


# The MLP on every mesh and the transformer on the one with every kind of axis run quick;
# the transformer's other meshes are slow.
EQUIVALENCE = [pytest.param(model, mesh, marks=() if model == "mlp" or mesh == MESHES[2]
                            else pytest.mark.slow) for model in sorted(MODELS) for mesh in MESHES
               if model == "mlp" or mesh != "data=8"]  # data=8: the MLP's, quick


@pytest.mark.parametrize("model, mesh_axes", EQUIVALENCE)
def test_sharded_losses_equal_single_device(model, mesh_axes):
  ref, ref_params = _reference_losses(model)
  losses, _, state = _trained(model, mesh_axes)
  assert losses.shape == (STEPS,)
  np.testing.assert_allclose(losses, ref, rtol=1e-5)
  assert losses[-1] < losses[0]  # it trains
  assert int(state.step) == STEPS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               jax.device_get(state.params), ref_params)


def test_fsdp_state_bytes_per_device():
  n = 8
  init, loss_fn, logical, _, has_aux = MODELS["transformer"]
  opt = _optimizer()

  def placed(mesh_axes):
    mesh = fnscale.make_mesh(mesh_axes)
    return mesh, fnscale.init_state(init, opt, mesh=mesh, rules=models.RULES,
                                    logical_axes=logical(), key=jax.random.key(0))
  mesh, state = placed("fsdp=8")
  batch = _batches("transformer", 1)[0]
  compiled = fnscale.shard_step(fnscale.train_step(loss_fn, opt, has_aux=has_aux), mesh,
                                rules=models.RULES, logical_axes=logical(),
                                example=(state, batch))
  state, _ = compiled(state, batch)  # the state a step gives back, in the step's shardings
  total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  replicated = sum(x.nbytes for x in jax.tree_util.tree_leaves(state)
                   if x.sharding.is_fully_replicated)
  assert replicated < 0.05 * total  # the test means something: most bytes are sharded
  bound = 1.05 * total / n + replicated
  per = _state_device_bytes(state)
  assert len(per) == n
  assert max(per.values()) <= bound, (per, total, replicated)
  # The compiled program's arguments per device: the state shard plus the batch shard.
  batch_per_device = sum(x.nbytes for x in jax.tree_util.tree_leaves(batch)) // n
  report = fnscale.compile_report(compiled, state, batch)
  assert report.argument_bytes - batch_per_device <= bound, (report, bound)
  # Pure data parallelism holds the whole state on every device.
  _, dp_state = placed("data=8")
  assert max(_state_device_bytes(dp_state).values()) == total


# ----------------------------------------------------------------------------- train_step


def _mlp_with_aux(params, batch):
  loss = models.mlp_loss(params, batch)
  return loss, {"mse": loss, "rows": jnp.asarray(batch["x"].shape[0], jnp.int32)}


@pytest.mark.slow
def test_accumulation_equals_full_batch_step():
  mesh = fnscale.make_mesh("data=2,fsdp=4")
  opt = _optimizer()
  kw = dict(mesh=mesh, rules=models.RULES, logical_axes=models.mlp_logical_axes(),
            key=jax.random.key(0))
  batch = models.mlp_batch(jax.random.key(7), 64)
  out = {}
  for accum in (1, 4):
    state = fnscale.init_state(models.mlp_init, opt, **kw)
    step = fnscale.train_step(_mlp_with_aux, opt, accum_steps=accum, has_aux=True)
    sharded = fnscale.shard_step(step, mesh, rules=models.RULES,
                                 logical_axes=models.mlp_logical_axes())
    state, metrics = sharded(state, batch)
    out[accum] = (jax.device_get(state.params), jax.device_get(metrics))
  (p1, m1), (p4, m4) = out[1], out[4]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p4, p1)
  for k in ("loss", "grad_norm"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5)
  np.testing.assert_allclose(m4["aux"]["mse"], m1["aux"]["mse"], rtol=1e-5)
  assert int(m4["aux"]["rows"]) == int(m1["aux"]["rows"]) == 64  # counts are summed


def test_accumulation_keeps_microbatches_spread_over_devices():
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fnscale.train_step(models.mlp_loss, opt, accum_steps=4)
  sharded = fnscale.shard_step(step, mesh)
  text = sharded.lower(state, models.mlp_batch(jax.random.key(1), 64)).as_text()
  # The microbatches [4, 16, ...] are constrained to keep rows split over "data" ...
  assert re.search(r'sharding_constraint %\w+ <@mesh, \[\{\}, \{"data"\}, \{\}\]> : '
                   r'tensor<4x16x16xf32>', text)
  # ... and so the split needs no data movement.
  report = fnscale.compile_report(sharded, state, models.mlp_batch(jax.random.key(1), 64))
  assert report.collective("all-gather").count == 0
  assert report.collective("all-to-all").count == 0


def test_bf16_compute_keeps_float32_params():
  mesh = fnscale.make_mesh("data=8")
  opt = _optimizer()
  policy = "params=float32,compute=bfloat16,output=float32"
  seen = []

  def loss_fn(params, batch):
    seen.append((params["w1"].dtype, batch["x"].dtype))
    return models.mlp_loss(params, batch)

  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0),
                             policy=policy)
  assert state.loss_scale is None
  step = fnscale.train_step(loss_fn, opt, policy=policy)
  sharded = fnscale.shard_step(step, mesh)
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  ref = float(models.mlp_loss(models.mlp_init(jax.random.key(0)), batch))
  state, metrics = sharded(state, batch)
  assert seen[0] == (jnp.bfloat16, jnp.bfloat16)
  for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state)):
    assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype
  assert metrics["loss"].dtype == jnp.float32
  np.testing.assert_allclose(float(metrics["loss"]), ref, rtol=2e-2)


def test_float16_inf_gradient_skips_step():
  mesh = fnscale.make_mesh("data=8")
  opt = _optimizer()
  policy = "params=float32,compute=float16,output=float32"
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0),
                             policy=policy)
  assert isinstance(state.loss_scale, fs.LossScale) and state.loss_scale.dynamic
  scale0 = float(state.loss_scale.scale)
  assert scale0 == 2.0**15
  step = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt, policy=policy), mesh)
  good = models.mlp_batch(jax.random.key(1), BATCH)
  bad = {"x": good["x"].at[3, 0].set(jnp.inf), "y": good["y"]}
  params0 = jax.device_get(state.params)
  opt0 = jax.device_get(state.opt_state)
  state, metrics = step(state, bad)
  assert int(metrics["skipped"]) == 1
  assert not np.isfinite(float(metrics["grad_norm"]))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params0)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.opt_state), opt0)
  assert float(state.loss_scale.scale) == scale0 / 2
  assert float(metrics["loss_scale"]) == scale0 / 2
  assert int(state.step) == 1
  skipped = int(metrics["skipped"])
  state, metrics = step(state, good)
  skipped += int(metrics["skipped"])
  assert skipped == 1 and int(metrics["skipped"]) == 0
  assert np.isfinite(float(metrics["loss"]))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b),
                         jax.device_get(state.params), params0)
  assert all(jax.tree_util.tree_leaves(changed))


# ----------------------------------------------------------------------------- compile report


@pytest.mark.tpu
@pytest.mark.slow
def test_aot_compile_for_tpu_v5p(tpu_devices):
  devices = tpu_devices("v5p:2x2x2")  # skips only when libtpu is absent
  assert len(devices) == 8
  mesh = fnscale.make_mesh("data=2,fsdp=4", devices=devices)
  opt = _optimizer()
  abstract = fnscale.init_state(models.transformer_init, opt, mesh=mesh, rules=models.RULES,
                                logical_axes=models.transformer_logical_axes(),
                                key=jax.random.key(0), abstract=True)
  assert isinstance(abstract.params["embed"], jax.ShapeDtypeStruct)
  batch = jax.eval_shape(lambda: models.transformer_batch(jax.random.key(0), BATCH))
  step = fnscale.train_step(models.transformer_loss, opt, has_aux=True,
                            policy="params=float32,compute=bfloat16,output=float32")
  compiled = fnscale.shard_step(step, mesh, rules=models.RULES,
                                logical_axes=models.transformer_logical_axes()).compile(
                                    abstract, batch)
  report = fnscale.compile_report(compiled, abstract, batch)
  assert report.platform == "tpu" and report.num_devices == 8
  # The donated state is aliased (TPU pads small arrays to its tiles, so bytes exceed the
  # logical per-device sizes: only the relation is checked).
  assert report.argument_bytes > 0 and report.temp_bytes > 0
  assert 0 < report.alias_bytes <= report.argument_bytes
  assert report.collective("all-gather").count > 0
  assert "tpu x8" in str(report)


# ----------------------------------------------------------------------------- shard_map


@pytest.mark.slow
def test_shard_map_mode_matches_auto():
  mesh = fnscale.make_mesh("data=2,fsdp=2,tensor=2")
  opt = _optimizer()
  logical = models.transformer_logical_axes()
  batches = _batches("transformer", 5)
  params, metrics = {}, {}
  for mode in ("auto", "shard_map"):
    state = fnscale.init_state(models.transformer_init, opt, mesh=mesh, rules=models.RULES,
                               logical_axes=logical, key=jax.random.key(0))
    step = fnscale.train_step(models.transformer_loss, opt, has_aux=True, accum_steps=2)
    sharded = fnscale.shard_step(step, mesh, rules=models.RULES, logical_axes=logical,
                                 mode=mode)
    for batch in batches:
      state, m = sharded(state, batch)
    params[mode], metrics[mode] = jax.device_get(state.params), jax.device_get(m)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               params["shard_map"], params["auto"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
               metrics["shard_map"], metrics["auto"])


# ----------------------------------------------------------------------------- AOT reuse


class _CompileCounter:
  """Counts backend compiles through jax's monitoring events."""

  def __init__(self):
    self.count = 0

  def __call__(self, event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1


def test_aot_step_never_compiles_again():
  mesh = fnscale.make_mesh("data=2,fsdp=4")
  opt = _optimizer()
  traces = []

  def loss_fn(params, batch):
    traces.append(1)
    return models.mlp_loss(params, batch)

  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  abstract_batch = jax.eval_shape(lambda: batch)
  compiled = fnscale.shard_step(fnscale.train_step(loss_fn, opt), mesh).compile(
      abstract_state, abstract_batch)
  assert compiled.compile_seconds > 0
  n_traces = len(traces)
  counter = _CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter)
  try:
    state, _ = compiled(state, batch)            # step 0: no compile
    state, _ = compiled(state, jax.device_get(batch))   # host numpy batch: moved, not compiled
    replicated = jax.device_put(batch, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    state, _ = compiled(state, replicated)       # other sharding: resharded
    before = counter.count
    state, metrics = compiled(state, replicated)
    assert counter.count == before  # the reshard is cached and the step never recompiles
    assert int(state.step) == 4 and np.isfinite(float(metrics["loss"]))
  finally:
    jax.monitoring.unregister_event_duration_listener(counter)
  assert len(traces) == n_traces
  with pytest.raises(fnscale.StepError, match=r"batch leaf 'x'.*float32\[16, 16\].*"
                     r"compiled for float32\[32, 16\]"):
    compiled(state, models.mlp_batch(jax.random.key(1), 16))


def test_lazy_step_compiles_once():
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  sharded = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh)
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  counter = _CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter)
  try:
    state, _ = sharded(state, batch)
    first = counter.count
    for _ in range(3):
      state, _ = sharded(state, batch)
  finally:
    jax.monitoring.unregister_event_duration_listener(counter)
  assert first >= 1 and counter.count == first


# ----------------------------------------------------------------------------- options


def test_fast_compile_gives_same_step():
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(0.1)
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  out = []
  for fast in (False, True):
    state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
    compiled = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh,
                                  fast_compile=fast).compile(state, batch)
    new, metrics = compiled(state, batch)
    out.append((float(metrics["loss"]), jax.device_get(new.params)))
  np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               out[1][1], out[0][1])
  # The options reach XLA's compiler: an unknown one is refused by it, by name.
  step = fnscale.train_step(models.mlp_loss, opt)
  sharded = fnscale.shard_step(step, mesh, fast_compile=True,
                               compiler_options={"xla_not_an_option": 1})
  assert sharded.compiler_options == {"xla_backend_optimization_level": 0,
                                      "xla_llvm_disable_expensive_passes": True,
                                      "xla_not_an_option": 1}
  with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: "
                     "'xla_not_an_option'"):
    sharded.compile(state, batch)


def test_persistent_compilation_cache(tmp_path):
  old = {k: jax.config.values[k] for k in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes")}
  from jax.experimental.compilation_cache import compilation_cache as cc
  try:
    fs.compilation_cache(str(tmp_path))
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25).lower(jnp.ones((7, 3))).compile()
    assert any(os.scandir(tmp_path)), "nothing was written to the cache directory"
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    cc.reset_cache()
  with pytest.raises(fnscale.StepError, match="directory"):
    fs.compilation_cache("")


def test_compilation_cache_restored_puts_the_settings_back(tmp_path):
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")
  before = {k: jax.config.values[k] for k in names}
  with fs.compilation_cache_restored():
    jax.config.update("jax_enable_compilation_cache", not before["jax_enable_compilation_cache"])
    fs.compilation_cache(str(tmp_path), min_compile_time_s=2.5, min_entry_size_bytes=7)
    assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path)
  assert {k: jax.config.values[k] for k in names} == before
  with pytest.raises(RuntimeError, match="inside"):  # restored on an error too
    with fs.compilation_cache_restored():
      fs.compilation_cache(str(tmp_path))
      raise RuntimeError("inside")
  assert {k: jax.config.values[k] for k in names} == before


# ----------------------------------------------------------------------------- bad input


def test_batch_not_divisible_by_data_axes():
  mesh = fnscale.make_mesh("data=2,fsdp=4")
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  sharded = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh)
  with pytest.raises(fnscale.ShardingError,
                     match=r"leaf 'x'.*size 12.*\('data', 'fsdp'\).*multiple of 8"):
    sharded(state, models.mlp_batch(jax.random.key(1), 12))


def test_state_not_matching_compiled_shardings():
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  compiled = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh,
                                donate=False).compile(state, batch)
  wrong_shape = state._replace(params={**state.params, "w1": jnp.zeros((16, 32))})
  with pytest.raises(fnscale.StepError,
                     match=r"state leaf 'params/w1'.*float32\[16, 32\].*float32\[16, 64\]"):
    compiled(wrong_shape, batch)
  wrong_dtype = state._replace(params={**state.params, "b2": state.params["b2"].astype(
      jnp.bfloat16)})
  with pytest.raises(fnscale.StepError, match=r"state leaf 'params/b2'.*bfloat16"):
    compiled(wrong_dtype, batch)
  missing = state._replace(params={k: v for k, v in state.params.items() if k != "b1"})
  with pytest.raises(fnscale.StepError, match="structure"):
    compiled(missing, batch)
  # Explicit shardings that don't fit the state: the leaf path and the axis.
  bad = fnscale.state_shardings(state, mesh)._replace(params={
      **jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                     state.params),
      "b2": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))})
  with pytest.raises(fnscale.ShardingError, match=r"state leaf 'params/b2'.*2 entries.*rank 1"):
    fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh,
                       state_shardings=bad)(state, batch)


def test_accum_steps_not_dividing_batch():
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fnscale.train_step(models.mlp_loss, opt, accum_steps=3)
  with pytest.raises(fnscale.StepError, match=r"accum_steps=3.*leaf 'x'.*32"):
    fnscale.shard_step(step, mesh)(state, models.mlp_batch(jax.random.key(1), BATCH))
  # Divisible, but then the microbatch (32 / 8 = 4 rows) can't spread over 8 devices.
  step = fnscale.train_step(models.mlp_loss, opt, accum_steps=8)
  with pytest.raises(fnscale.StepError, match=r"microbatch size 4.*\('data',\).*multiple of 64"):
    fnscale.shard_step(step, mesh)(state, models.mlp_batch(jax.random.key(1), BATCH))


def test_bad_arguments():
  opt = optax.sgd(0.1)
  with pytest.raises(fnscale.StepError, match="accum_steps=0"):
    fnscale.train_step(models.mlp_loss, opt, accum_steps=0)
  with pytest.raises(fnscale.StepError, match="'params=float32,compute=bfloat17'"):
    fnscale.train_step(models.mlp_loss, opt, policy="params=float32,compute=bfloat17")
  with pytest.raises(fnscale.StepError, match="optax.GradientTransformation"):
    fnscale.train_step(models.mlp_loss, object())
  mesh = fnscale.make_mesh("data=8")
  step = fnscale.train_step(models.mlp_loss, opt)
  with pytest.raises(fnscale.StepError, match="mode='pmap'"):
    fnscale.shard_step(step, mesh, mode="pmap")
  with pytest.raises(fnscale.MeshError, match="expected a jax.sharding.Mesh"):
    fnscale.shard_step(step, "data=8")
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  with pytest.raises(fnscale.StepError, match="scalar"):
    bad_loss = fnscale.train_step(lambda p, b: models.mlp_loss(p, b) * jnp.ones(3), opt)
    fnscale.shard_step(bad_loss, mesh)(state, models.mlp_batch(jax.random.key(1), BATCH))


def test_reusing_a_donated_state_is_a_clear_error():
  opt = optax.sgd(0.1)
  mesh = fnscale.make_mesh("data=8")
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  step = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh)
  new_state, _ = step(state, batch)
  # Without the check the runtime would be handed a deleted buffer (it crashes).
  with pytest.raises(fnscale.StepError, match=r"state leaf .params/\w+. was donated .*`"
                     r"state, metrics = step\(state, batch\)"):
    step(state, batch)
  step(new_state, batch)  # the returned state works


def test_lazy_step_names_a_batch_the_loss_cannot_take(caplog):
  opt = optax.sgd(0.1)
  mesh = fnscale.make_mesh("data=8")
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fnscale.shard_step(fnscale.train_step(models.mlp_loss, opt), mesh, donate=False)
  batch = models.mlp_batch(jax.random.key(1), BATCH)
  bad = dict(batch, x=jnp.ones((BATCH, batch["x"].shape[1] + 1)))
  # Where the loss failed and jax's message; no fix: nothing says which of the two is wrong.
  with pytest.raises(fnscale.StepError, match=r"tracing the step failed for batch .*'x': "
                     r"float32\[32, 17\].* in \S*models\.py:\d+, in mlp_loss .*TypeError: "
                     r"dot_general requires contracting dimensions to have the same shape, got "
                     r"\(17,\) and \(16,\)\.$"):
    step(state, bad)
  step(state, batch)
  with caplog.at_level("WARNING"):
    step(state, models.mlp_batch(jax.random.key(1), 2 * BATCH))
  assert "compiling again for new input shapes" in caplog.text
