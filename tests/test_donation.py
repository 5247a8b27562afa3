"""A donated state never deletes a buffer the caller still holds, and never donates one
buffer twice: each way a buffer can be shared is safe or a StepError naming the leaves."""
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnscale as fs


def _loss(p, b):
  return jnp.mean(b["x"] @ p["big"]) + jnp.sum(p["small"])


def _params():
  return {"big": jnp.ones((1024, 64)), "small": jnp.ones((32,))}


def _batch():
  return {"x": jnp.ones((8, 1024))}


def _assert_alive(tree, value=1.0):
  for leaf in jax.tree.leaves(tree):
    assert not leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(leaf), np.full(leaf.shape, value, np.float32))


@pytest.mark.parametrize("axes", [{"fsdp": 8}, {"data": 8}])
def test_callers_params_survive_a_donating_step(axes):
  # fsdp: 'small' stays replicated, so device_put used to hand the caller's own buffer to
  # the state; data: every leaf is replicated and every one used to be deleted.
  mesh = fs.make_mesh(axes)
  opt = optax.sgd(0.1)
  p0 = _params()
  state = fs.init_state(p0, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(_loss, opt), mesh)
  state, _ = step(state, _batch())
  state, _ = step(state, _batch())
  _assert_alive(p0)
  assert int(state.step) == 2


def test_params_already_in_their_shardings_are_copied():
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  p0 = jax.device_put(_params(), NamedSharding(mesh, P()))  # exactly the target sharding
  state = fs.init_state(p0, opt, mesh=mesh)
  for mine, theirs in zip(jax.tree.leaves(state.params), jax.tree.leaves(p0)):
    assert mine is not theirs
    assert (mine.addressable_shards[0].data.unsafe_buffer_pointer()
            != theirs.addressable_shards[0].data.unsafe_buffer_pointer())
  fs.shard_step(fs.train_step(_loss, opt), mesh)(state, _batch())
  _assert_alive(p0)


def test_callers_loss_scale_survives():
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  scale = jax.device_put(jnp.float32(2.0**10), NamedSharding(mesh, P()))
  state = fs.init_state(_params(), opt, mesh=mesh,
                        loss_scale=jmp.DynamicLossScale(scale))
  fs.shard_step(fs.train_step(_loss, opt), mesh)(state, _batch())
  assert not scale.is_deleted() and float(scale) == 2.0**10


def test_optimizer_state_holding_the_params_gets_its_own_buffers():
  # Slow weights / EMA-style states keep a copy of the params: jax.jit would forward the
  # params' own buffers into the optimizer state, and donation would donate them twice.
  def init(params):
    return {"slow": params}

  def update(updates, state, params=None):
    return updates, {"slow": optax.tree.add(state["slow"], updates)}

  opt = optax.GradientTransformation(init, update)
  mesh = fs.make_mesh({"data": 8})
  state = fs.init_state(_params(), opt, mesh=mesh)
  ptr = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
  for p, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)):
    assert ptr(p) != ptr(s)
  state, _ = fs.shard_step(fs.train_step(_loss, opt), mesh)(state, _batch())
  assert int(state.step) == 1


def _manual_state(mesh, params, opt):
  rep = NamedSharding(mesh, P())
  return fs.TrainState(params, opt.init(params), jax.device_put(jnp.int32(0), rep))


def test_two_state_leaves_sharing_a_buffer_is_named():
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  w = jax.device_put(jnp.ones((32,)), NamedSharding(mesh, P()))
  params = {"big": jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, P())),
            "small": w, "tied": w}
  state = _manual_state(mesh, params, opt)
  loss = lambda p, b: _loss(p, b) + jnp.sum(p["tied"])
  with pytest.raises(fs.StepError, match=r"state leaves 'params/small' and 'params/tied' share "
                     r"one device buffer.*fix: give 'params/tied' its own copy \(jnp.copy\).*"
                     r"donate=False"):
    fs.shard_step(fs.train_step(loss, opt), mesh)(state, _batch())
  assert not w.is_deleted()  # refused before anything ran
  _, metrics = fs.shard_step(fs.train_step(loss, opt), mesh, donate=False)(state, _batch())
  assert float(metrics["loss"]) == pytest.approx(1024.0 + 64.0)


def test_state_buffer_passed_in_the_batch_is_named():
  mesh = fs.make_mesh({"data": 8})
  rep = NamedSharding(mesh, P())
  opt = optax.sgd(0.1)
  t = jax.device_put(jnp.ones((8, 32)), rep)
  params = {"big": jax.device_put(jnp.ones((1024, 64)), rep),
            "small": jax.device_put(jnp.ones((32,)), rep), "t": t}
  state = _manual_state(mesh, params, opt)
  loss = lambda p, b: _loss(p, b) + jnp.sum(b["t"] * p["t"])
  # A replicated batch: the same array can be a state leaf and a batch leaf as it is.
  step = fs.shard_step(fs.train_step(loss, opt), mesh, batch_sharding=rep)
  with pytest.raises(fs.StepError, match=r"batch leaf 't' is the buffer of state leaf "
                     r"'params/t', which the step donates.*jnp.copy.*donate=False"):
    step(state, {"x": jnp.ones((8, 1024)), "t": t})
  assert not t.is_deleted()
  state, metrics = step(state, {"x": jnp.ones((8, 1024)), "t": jnp.copy(t)})
  assert float(metrics["loss"]) == pytest.approx(1024.0 + 32.0 + 256.0)
  assert t.is_deleted()  # it was a leaf of the state the caller handed over: consumed
