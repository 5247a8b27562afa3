"""A Flax NNX model that shards its ops by type (`out_sharding=`, `jax.sharding.reshard`:
sharding in types, Explicit mesh axes), wrapped as is, with accumulation (8 CPU devices).

It trains as on one device where its ops can run; elsewhere the step stops with an fnscale
error naming the mesh or option that works, never jax's own.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fnscale as fs

LR = 0.1


class MLP(nnx.Module):
  """Its activations' batch dim split over the mesh axis "data", as the model says."""

  def __init__(self, din, dh, dout, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(din, dh, rngs=rngs)
    self.down = nnx.Param(jax.random.normal(rngs.params(), (dh, dout)) * 0.1)

  def __call__(self, x):
    x = jax.sharding.reshard(x, P("data", None))
    h = nnx.relu(self.up(x, out_sharding=P("data", None)))
    return jnp.einsum("bh,ho->bo", h, self.down[...], out_sharding=P("data", None))


GRAPHDEF, PARAMS = nnx.split(MLP(16, 32, 4, rngs=nnx.Rngs(0)), nnx.Param)


def loss_fn(params, batch):
  model = nnx.merge(GRAPHDEF, params)
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch():
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(32, 16)).astype(np.float32),
          "y": rng.normal(size=(32, 4)).astype(np.float32)}


def _reference(steps=2):
  """`steps` SGD steps on one device (a one-device Explicit mesh with the model's axis)."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:1])
  opt, params, losses = optax.sgd(LR), PARAMS, []
  with jax.set_mesh(mesh):
    step = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(p, b))
    for _ in range(steps):
      loss, grads = step(params, _batch())
      params = optax.apply_updates(params, opt.update(grads, opt.init(params))[0])
      losses.append(float(loss))
  return losses, jax.device_get(params)


def _train(mesh, accum, gather="auto", steps=2, **kw):
  opt = optax.sgd(LR)
  state = fs.init_state(PARAMS, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum, accum_gather=gather),
                       mesh, **kw)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, _batch())
    losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params)


def _check(got, ref):
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got[1],
               ref[1])


@pytest.mark.parametrize("accum,gather", [(1, "auto"), (2, "auto"), (2, "per_microbatch")])
def test_trains_as_on_one_device_on_its_explicit_mesh(accum, gather, caplog):
  # accum_gather="auto" would run the loss per shard (inside jax.shard_map, the data axis
  # Manual), where jax refuses its typed ops: it keeps the partitioner's loop, and says so.
  got = _train(fs.make_mesh({"data": 8}, axis_types="explicit"), accum, gather)
  _check(got, _reference())
  assert ("shards its ops by type" in caplog.text) == ((accum, gather) == (2, "auto"))


def test_a_batch_sharding_that_the_model_names_with_accumulation():
  # FSDP over "fsdp" and the batch split over "data" alone, as the model's ops split it: the
  # microbatches keep that split.
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types="explicit")
  got = _train(mesh, 2, batch_sharding=NamedSharding(mesh, P("data")))
  _check(got, _reference())


def _error(mesh, accum=2, gather="auto", **kw) -> str:
  opt = optax.sgd(LR)
  state = fs.init_state(PARAMS, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum, accum_gather=gather),
                       mesh, **kw)
  with pytest.raises(fs.StepError) as e:
    step.compile(state, _batch())
  return str(e.value)


def test_once_names_per_microbatch():
  msg = _error(fs.make_mesh({"data": 8}, axis_types="explicit"), gather="once")
  assert "accum_gather='once' runs the loss per shard" in msg
  assert "fix: train_step(..., accum_gather='per_microbatch')" in msg


def test_per_shard_step_names_mode_auto():
  msg = _error(fs.make_mesh({"data": 8}, axis_types="explicit"), accum=1, mode="shard_map")
  assert "Manual" in msg and "shard_step(..., mode='auto')" in msg


@pytest.mark.parametrize("accum", [1, 2])
def test_an_auto_mesh_names_explicit_axes(accum):
  msg = _error(fs.make_mesh({"data": 8}), accum)
  assert "has Auto axes" in msg
  assert "fix: fs.make_mesh({'data': 8}, axis_types='explicit')" in msg  # the mesh above


def test_a_mesh_without_the_models_axis_names_one_with_it():
  msg = _error(fs.make_mesh({"fsdp": 8}, axis_types="explicit"), 1)
  assert "over mesh axis 'data', which mesh {'fsdp': 8} doesn't have" in msg
  assert "fs.make_mesh({'data': -1}, axis_types='explicit')" in msg


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_batch_axes_other_than_the_models_name_the_mesh_or_batch_sharding(axes):
  # fnscale splits rows over ("data", "fsdp"); the model's ops over "data": jax's
  # ShardingTypeError becomes a StepError naming what works (the two tests above).
  msg = _error(fs.make_mesh(axes, axis_types="explicit"), 2)
  assert "incompatible shardings" in msg and "('data', 'fsdp')" in msg
  others = {a: n for a, n in axes.items() if a not in ("data", "fsdp")}
  assert f"fs.make_mesh({ {'data': -1, **others} }, axis_types='explicit')" in msg
  assert "batch_sharding=jax.NamedSharding(mesh, P(<those axes>))" in msg


class TokenModel(nnx.Module):
  """An embedding lookup under `jax.sharding.auto_axes` (a gather has no typed sharding
  rule), then a typed projection."""

  def __init__(self, vocab, dim, *, rngs: nnx.Rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)))
    self.out = nnx.Linear(dim, 1, rngs=rngs)

  def __call__(self, tokens):
    lookup = jax.sharding.auto_axes(lambda t, i: t[i], out_sharding=P("data", None, None))
    return self.out(lookup(self.table[...], tokens), out_sharding=P("data", None, None))


def test_an_auto_axes_lookup_with_accumulation():
  # Per shard, jax refuses auto_axes with a NotImplementedError ("Going from Manual
  # AxisType ..."): "auto" keeps the partitioner's loop here too.
  graphdef, params = nnx.split(TokenModel(16, 8, rngs=nnx.Rngs(0)), nnx.Param)

  def lm_loss(params, batch):
    pred = nnx.merge(graphdef, params)(batch["tokens"])[..., 0]
    return jnp.mean((pred - batch["y"]) ** 2)
  rng = np.random.default_rng(1)
  batch = {"tokens": rng.integers(0, 16, (16, 4)), "y": rng.normal(size=(16, 4)).astype(
      np.float32)}
  _check_one_sgd_step(lm_loss, params, batch, 2)


def test_a_masked_mean_with_accumulation_on_its_explicit_mesh():
  # The masked mean is read as (sum, count) under Explicit types too: the whole batch's mean.
  def masked(params, batch):
    err = jnp.sum((nnx.merge(GRAPHDEF, params)(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1)
  batch = dict(_batch(), mask=np.where(np.arange(32) % 8 < 2, 1.0, 0.0).astype(np.float32))
  _check_one_sgd_step(masked, PARAMS, batch, 4)


def _check_one_sgd_step(loss_fn, params, batch, accum_steps):
  """One SGD step wrapped on an Explicit {"data": 8} mesh equals one on one device."""
  one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                      devices=jax.devices()[:1])
  with jax.set_mesh(one):
    ref_loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    ref = jax.device_get(jax.tree.map(lambda p, g: p - LR * g, params, grads))
  mesh = fs.make_mesh({"data": 8}, axis_types="explicit")
  opt = optax.sgd(LR)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum_steps), mesh)
  state, metrics = step(fs.init_state(params, opt, mesh=mesh), batch)
  _check(([float(metrics["loss"])], jax.device_get(state.params)), ([float(ref_loss)], ref))
