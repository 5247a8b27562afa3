"""The optimizer state in pinned host memory (`init_state(..., offload_optimizer=True)`): the
same numbers as on the device, the state where it was asked to be, and the device's memory
relieved of it in a program compiled for a TPU v5e chip."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs


def _mlp(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 4)) * 0.3}


def _mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


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
  if "pinned_host" not in {m.kind for m in jax.devices()[0].addressable_memories()}:
    pytest.skip("this backend has no pinned host memory")
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


D, LAYERS = 1024, 8


def _deep_loss(params, batch):
  x = batch["x"]
  for i in range(LAYERS):
    x = jnp.tanh(x @ params[f"w{i}"])
  return jnp.mean(x ** 2)


def _hbm(memory) -> int:
  """Device bytes of a compiled program: its arguments and temporaries on the device."""
  return memory.argument_size_in_bytes + memory.temp_size_in_bytes


@pytest.mark.tpu
def test_offload_moves_the_state_out_of_a_v5e_chips_memory(tpu_devices):
  mesh = fs.make_mesh({"fsdp": 1}, devices=fs.target_devices("v5e:1x1"))
  init = lambda: {f"w{i}": jnp.zeros((D, D)) for i in range(LAYERS)}
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  batch = {"x": jax.ShapeDtypeStruct((64, D), jnp.float32)}
  compiled = {}
  for offload in (False, True):
    state = fs.init_state(init, optimizer, mesh=mesh, abstract=True,
                          offload_optimizer=offload)
    compiled[offload] = fs.shard_step(fs.train_step(_deep_loss, optimizer), mesh).compile(
        state, batch).compiled
  moments = 2 * 4 * D * D * LAYERS  # AdamW's two float32 moments, by hand
  on, off = (compiled[k].memory_analysis() for k in (False, True))
  assert off.host_argument_size_in_bytes >= moments
  assert on.host_argument_size_in_bytes == 0
  # Most of the state leaves the device: what stays is a few params' moments in flight.
  assert _hbm(on) - _hbm(off) > 0.55 * moments, (_hbm(on), _hbm(off), moments)
  kinds = lambda c: {s.memory_kind for s in jax.tree.leaves(c.output_shardings[0].opt_state)}
  assert kinds(compiled[True]) == {"pinned_host"} and kinds(compiled[False]) == {"device"}
  params = lambda c: {s.memory_kind for s in jax.tree.leaves(c.output_shardings[0].params)}
  assert params(compiled[True]) == {"device"}
