"""The optimizer state in pinned host memory (`init_state(..., offload_optimizer=True)`): the
same numbers as on the device, the state where it was asked to be, and the device's memory
relieved of it in a program compiled for a TPU v5e chip."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import _offload


def _mlp(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 4)) * 0.3}


def _mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _needs_pinned_host():
  if "pinned_host" not in {m.kind for m in jax.devices()[0].addressable_memories()}:
    pytest.skip("this backend has no pinned host memory")


def _three_steps(optimizer, offload, policy=None):
  mesh = fs.make_mesh({"fsdp": 8})
  state = fs.init_state(_mlp, optimizer, mesh=mesh, key=jax.random.key(0), policy=policy,
                        offload_optimizer=offload)
  step = fs.shard_step(fs.train_step(_mlp_loss, optimizer, policy=policy), mesh)
  batch = {"x": jax.random.normal(jax.random.key(1), (16, 16)),
           "y": jax.random.normal(jax.random.key(2), (16, 4))}
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, state


ADAMW = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


@pytest.mark.parametrize("optimizer, policy", [
    (ADAMW, None), (optax.adafactor(1e-2, min_dim_size_to_factor=8), None),
    (optax.adam(1e-2), "compute=float16")], ids=["adamw", "adafactor", "adam-float16"])
def test_offloaded_state_trains_as_on_the_device(optimizer, policy):
  """The loss, params and state after 3 steps equal the same run's on the device: with a
  global-norm clip, a factored state, and float16's dynamic loss scale."""
  _needs_pinned_host()
  want_losses, want = _three_steps(optimizer, offload=False, policy=policy)
  losses, got = _three_steps(optimizer, offload=True, policy=policy)
  assert losses == want_losses
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The new state went back to the host, each leaf equal to the device run's.
  for a, b in zip(jax.tree.leaves(want.opt_state), jax.tree.leaves(got.opt_state)):
    assert b.sharding.memory_kind == "pinned_host" and a.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert {p.sharding.memory_kind for p in jax.tree.leaves(got.params)} == {"device"}


def test_offload_optimizer_is_a_bool():
  with pytest.raises(fs.StepError, match="offload_optimizer is"):
    fs.init_state({"w": jnp.zeros(4)}, optax.sgd(0.1), mesh=fs.make_mesh({"data": 8}),
                  offload_optimizer="yes")


LAYERS, D, VOCAB = 4, 512, 4096


def _stack():
  return {"blocks": {"w": jnp.zeros((LAYERS, D, D)), "scale": jnp.ones((LAYERS, D))},
          "embed": jnp.zeros((VOCAB, D))}


def _stack_loss(params, batch):
  def block(x, p):
    return jnp.tanh(x @ p["w"]) * p["scale"], None
  x, _ = jax.lax.scan(block, params["embed"][batch["tokens"]], params["blocks"])
  return jnp.mean((x @ params["embed"].T) ** 2)


def _hbm(memory) -> int:
  """Device bytes of a compiled program: its arguments and temporaries on the device."""
  return memory.argument_size_in_bytes + memory.temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.tpu
def test_offload_moves_the_state_out_of_a_v5e_chips_memory(tpu_devices, monkeypatch):
  """Compiled for one v5e chip, the step with the state offloaded holds most of AdamW's two
  float32 moments (8 bytes a param, by hand) less on the device (94% of them at a 0.5 GiB
  model with 64 MiB slices; here, slices of 1 MiB, 80%): each param's state comes in a
  slice of its leading axis (a layer, rows of the embedding) at a time."""
  del tpu_devices  # skips without libtpu
  monkeypatch.setattr(_offload, "SLICE_BYTES", 2**20)  # slices of 1 MiB: 8 of a layer
  mesh = fs.make_mesh({"fsdp": 1}, devices=fs.target_devices("v5e:1x1"))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  batch = {"tokens": jax.ShapeDtypeStruct((8, 128), jnp.int32)}
  compiled = {}
  for offload in (False, True):
    state = fs.init_state(_stack, optimizer, mesh=mesh, abstract=True,
                          offload_optimizer=offload)
    compiled[offload] = fs.shard_step(fs.train_step(_stack_loss, optimizer), mesh).compile(
        state, batch).compiled
  moments = 2 * 4 * (LAYERS * D * D + LAYERS * D + VOCAB * D)
  on, off = (compiled[k].memory_analysis() for k in (False, True))
  assert on.host_argument_size_in_bytes == 0
  assert off.host_argument_size_in_bytes >= moments
  assert _hbm(on) - _hbm(off) > 0.75 * moments, (_hbm(on), _hbm(off), moments)
  # The figure the memory pre-flight's compiled check reads drops as much (XLA's peak counts
  # the host's buffers too: the offloaded step looked larger than the one on the device).
  held = [fs.analysis.step_bytes(compiled[k]) for k in (False, True)]
  assert held[0] - held[1] > 0.75 * moments, (held, moments)
  kinds = lambda c, part: {s.memory_kind for s in jax.tree.leaves(
      getattr(c.output_shardings[0], part))}
  assert kinds(compiled[True], "opt_state") == {"pinned_host"}
  assert kinds(compiled[False], "opt_state") == {"device"}
  assert kinds(compiled[True], "params") == {"device"}
  # Each new slice of the state is written over its old one: no copy of a whole leaf runs on
  # the host (a loop's fresh output buffer cost one per leaf at ~0.3 GB/s, 8.6 s of a 1B
  # Llama's 9.8 s step on a v5e).
  assert 'custom_call_target="HostExecute"' not in compiled[True].as_text()


@pytest.mark.tpu
@pytest.mark.parametrize("rows", [3000, 264], ids=["12-slices-of-250", "a-short-axis"])
def test_rows_that_do_not_split_in_whole_tiles_compile_for_a_v5e(tpu_devices, monkeypatch,
                                                                rows):
  """An embedding's float32 state of `rows` x 512, sliced over its old one in host memory:
  slices of 250 rows (3000 in 12) and of one row (264, a short leading axis sliced at each
  index, as a layer stack's) aborted XLA's compile for a v5e (SIGABRT: the process, no
  error). Slices are now whole TPU tiles of 8 rows: the step compiles, runs nothing on the
  host, keeps the state there and holds less on the device than the step without offload."""
  del tpu_devices  # skips without libtpu
  monkeypatch.setattr(_offload, "SLICE_BYTES", 2**20)
  mesh = fs.make_mesh({"fsdp": 1}, devices=fs.target_devices("v5e:1x1"))
  optimizer = optax.adamw(1e-3)
  init = lambda: {**_stack(), "embed": jnp.zeros((rows, D))}
  batch = {"tokens": jax.ShapeDtypeStruct((8, 128), jnp.int32)}
  compiled = {}
  for offload in (False, True):
    state = fs.init_state(init, optimizer, mesh=mesh, abstract=True, offload_optimizer=offload)
    compiled[offload] = fs.shard_step(fs.train_step(_stack_loss, optimizer), mesh).compile(
        state, batch).compiled
  assert 'custom_call_target="HostExecute"' not in compiled[True].as_text()
  on, off = (compiled[k].memory_analysis() for k in (False, True))
  moments = 2 * 4 * (LAYERS * D * D + LAYERS * D + rows * D)  # AdamW's, by hand
  assert off.host_argument_size_in_bytes >= moments and _hbm(off) < _hbm(on)


@pytest.mark.tpu
def test_an_fsdp_split_embeddings_state_is_updated_on_the_devices_of_a_v5e_2x2(tpu_devices,
                                                                              monkeypatch):
  """Compiled for a v5e:2x2 at fsdp=4, the embedding's rows split over the 4 chips: the
  update runs on the devices, nothing on the host (slices of runs of rows cut across the
  chips, and XLA ran 2 host computations gathering them)."""
  del tpu_devices  # skips without libtpu
  monkeypatch.setattr(_offload, "SLICE_BYTES", 2**20)
  mesh = fs.make_mesh({"fsdp": 4}, devices=fs.target_devices("v5e:2x2"))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  state = fs.init_state(_stack, optimizer, mesh=mesh, abstract=True, offload_optimizer=True)
  assert state.opt_state[1][0].mu["embed"].sharding.spec == jax.sharding.PartitionSpec(
      "fsdp", None)
  batch = {"tokens": jax.ShapeDtypeStruct((8, 128), jnp.int32)}
  compiled = fs.shard_step(fs.train_step(_stack_loss, optimizer), mesh).compile(
      state, batch).compiled
  assert 'custom_call_target="HostExecute"' not in compiled.as_text()


@pytest.mark.parametrize("slice_bytes", [256, 64], ids=["first-leaf-whole", "every-leaf"])
def test_a_state_offloaded_by_slices_trains_as_on_the_device(monkeypatch, slice_bytes):
  """Each param's state a slice of its leading axis at a time (slices of 256 bytes: all but
  the first leaf, b1's; of 64: every leaf, the first's update also carrying the step count
  shared by all): the numbers of the device's run, to float rounding (XLA fuses the sliced
  update apart)."""
  _needs_pinned_host()
  want_losses, want = _three_steps(ADAMW, offload=False)
  monkeypatch.setattr(_offload, "SLICE_BYTES", slice_bytes)
  losses, got = _three_steps(ADAMW, offload=True)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves((want.params, want.opt_state)),
                  jax.tree.leaves((got.params, got.opt_state))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def _table(key):
  return {"embed": jax.random.normal(key, (256, 16)), "w": jnp.ones((16, 4)) * 0.1}


def _table_loss(params, batch):
  return jnp.mean((params["embed"][batch["tokens"]] @ params["w"] - 1.0) ** 2)


def test_rows_split_over_the_devices_are_sliced_in_each_devices_shard(monkeypatch):
  """An embedding's state whose rows FSDP splits over the 8 devices (P('fsdp', None)) is
  sliced every n-th row, 32 rows a slice (4 on each device, from its own shard), and trains
  to the device run's numbers; compiled for a v5e:2x2 at fsdp=4, runs of rows cut across
  devices and XLA ran their update on the host, gathering (tests/test_offload.py's v5e
  test)."""
  _needs_pinned_host()
  monkeypatch.setattr(_offload, "SLICE_BYTES", 4096)
  assert _offload._chunks((256, 16), [4, 4], 8) == (8, True)  # pylint: disable=protected-access
  mesh = fs.make_mesh({"fsdp": 8})
  batch = {"tokens": jax.random.randint(jax.random.key(1), (8, 16), 0, 256)}
  runs = []
  for offload in (False, True):
    state = fs.init_state(_table, ADAMW, mesh=mesh, key=jax.random.key(0),
                          offload_optimizer=offload)
    assert state.params["embed"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    step = fs.shard_step(fs.train_step(_table_loss, ADAMW), mesh)
    losses = []
    for _ in range(3):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    runs.append((losses, state))
  (want_losses, want), (losses, got) = runs
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves((want.params, want.opt_state)),
                  jax.tree.leaves((got.params, got.opt_state))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def llama_v5e(tpu_devices):
  """(topology, mesh, a Llama, its float32 params' bytes P) on one described v5e chip: 0.4B
  params (1.6 GB), whose step at 1 row of 32 tokens holds about P of params, P of gradients
  and AdamW's 2 P of moments."""
  del tpu_devices  # skips without libtpu
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  devices = fs.target_devices("v5e:1x1")
  cfg = llama.model_config("llama-tiny", 32, layers=4, d_model=2048, heads=16, kv_heads=4,
                           d_mlp=8192, vocab=32768)
  shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
  return (fs.detect_topology(devices=devices), fs.make_mesh({"data": 1}, devices=devices),
          (llama, cfg), 4 * sum(x.size for x in jax.tree.leaves(shapes)))


@pytest.mark.slow
def test_the_preflight_offloads_the_state_where_adamw_fits_no_other_way(llama_v5e,
                                                                        monkeypatch):
  """By a hand count AdamW's step holds 4 P, with its first moment in bfloat16 3.5 P, with
  the state on the host 2 P and a few slices of 64 MiB; a choice must fit 90% of the
  device. At 2.6 P only the offloaded state fits: chosen and said; --nooptimizer_offload
  leaves Adafactor; at 4.5 P nothing changes. (Remat's policy pinned: what the attention
  keeps is `remat.whole_block`'s, tests/test_train_memory.py.)"""
  from recipes.lm import memory  # pylint: disable=import-outside-toplevel
  from recipes.lm.options import Options  # pylint: disable=import-outside-toplevel
  topo, mesh, (module, cfg), P = llama_v5e

  def choose(cap, **options):
    monkeypatch.setattr(memory, "limit", lambda mesh: cap * P)
    said = []
    step = memory.choose(Options.of(batch_size=1, remat=True, remat_policy="full",
                                    accum_steps=1, **options).step,
                         "float32", memory.Model(module, cfg, "llama"), topo, mesh, 1,
                         said.append)
    return (step.optimizer, step.mu_dtype, step.optimizer_offload), said
  assert choose(4.5) == (("adamw", "float32", False), [])
  chosen, said = choose(2.6)
  assert chosen == ("adamw", "float32", True)
  assert len(said) == 1 and "--optimizer_offload (" in said[0]
  assert "0.44x Adafactor's tokens/s" in said[0]  # its cost in speed, said
  assert choose(2.6, optimizer_offload=False)[0] == ("adafactor", None, False)


def _coupled(lr):
  """An optimizer whose update reads every param's state (a global mean of them), written as
  an optax user writes one."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del params
    state = jax.tree.map(lambda s, g: 0.9 * s + 0.1 * g, state, grads)
    total = sum(jnp.mean(jnp.abs(s)) for s in jax.tree.leaves(state))
    return jax.tree.map(lambda s: -lr * s / (1e-3 + total), state), state
  return optax.GradientTransformation(init, update)


def test_an_update_reading_every_params_state_gets_it_whole():
  """Brought in a param at a time, the others' state would read as zeros: the update's jaxpr
  shows the coupling, and the state comes to the device whole (the device run's numbers)."""
  _needs_pinned_host()
  want_losses, want = _three_steps(_coupled(1e-2), offload=False)
  losses, got = _three_steps(_coupled(1e-2), offload=True)
  assert losses == want_losses
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
