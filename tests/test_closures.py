"""A loss, step or pipeline stage that closes over an array sharded on the mesh, run inside
fnscale's own shard_maps (shard_step(mode="shard_map"), the per-shard microbatch loop of
accum_gather "auto" and "once", a pipeline's stages): the one-device params whatever the
route and axis type, or, where jax can't take the array into a shard_map (Explicit axes), a
StepError naming it and the fix, never a raw jax error."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnscale as fs
from fnscale import _closure

LR = 0.1
RNG = np.random.default_rng(0)
PARAMS = {"w": RNG.normal(size=(32, 64)).astype(np.float32) / 8}  # 8 KiB: replicated
BATCH = {"x": RNG.normal(size=(16, 32)).astype(np.float32),
         "y": RNG.normal(size=(16, 64)).astype(np.float32)}
TABLE = RNG.normal(size=(64, 64)).astype(np.float32) / 8
OTHERS = {"rep": RNG.normal(size=(64,)).astype(np.float32),
          "cols": RNG.normal(size=(64, 64)).astype(np.float32) / 8}


def _loss(frozen):
  def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"]) @ frozen["table"]
    if "cols" in frozen:
      h = h @ frozen["cols"] + frozen["rep"]
    return jnp.mean((h - batch["y"]) ** 2)
  return loss_fn


def _reference(frozen_np):
  """One SGD step on one device: jax.grad of the whole batch, numpy arrays closed over."""
  grads = jax.grad(_loss(frozen_np))(PARAMS, BATCH)
  return {k: PARAMS[k] - LR * np.asarray(grads[k]) for k in PARAMS}


def _run(mesh, frozen, mode, accum, gather):
  opt = optax.sgd(LR)
  state = fs.init_state(PARAMS, opt, mesh=mesh)
  step = fs.train_step(_loss(frozen), opt, accum_steps=accum, accum_gather=gather)
  new, _ = fs.shard_step(step, mesh, mode=mode)(state, BATCH)
  return jax.device_get(new.params)


ROUTES = [("auto", 1, "auto"), ("auto", 2, "auto"), ("auto", 2, "per_microbatch"),
          ("auto", 2, "once"), ("shard_map", 1, "auto"), ("shard_map", 2, "auto")]
# Routes whose loss runs inside fnscale's shard_map: jax can't close over Explicit arrays
# there. ("auto", 2, "auto") runs per shard too, and keeps the loop with the partitioner.
REFUSED = {("auto", 2, "once"), ("shard_map", 1, "auto"), ("shard_map", 2, "auto")}


# Quick: every Explicit route (refusals are cheap), the Auto routes through a shard_map.
CASES = [("explicit", r) for r in ROUTES] + [
    ("auto", r) if r in REFUSED else pytest.param("auto", r, marks=pytest.mark.slow)
    for r in ROUTES]


@pytest.mark.parametrize("axis_types, route", CASES,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v)
def test_a_loss_closing_over_an_fsdp_split_table(axis_types, route, caplog):
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types=axis_types)
  table = jax.device_put(TABLE, NamedSharding(mesh, P("fsdp", None)))
  if axis_types == "explicit" and route in REFUSED:
    with pytest.raises(fs.StepError, match=r"closes over 'frozen/table' \(f32\[64@fsdp,64\]"
                       r".*sharded on Explicit mesh axes.*fix: give that array Auto axis "
                       r"types"):
      _run(mesh, {"table": table}, *route)
    return
  with caplog.at_level(logging.WARNING):
    got = _run(mesh, {"table": table}, *route)
  np.testing.assert_allclose(got["w"], _reference({"table": TABLE})["w"], rtol=1e-5,
                             atol=1e-6)
  # The per-shard loop that can't take the table says so and leaves it to the partitioner.
  said = "stays with the partitioner" in caplog.text
  assert said == (axis_types == "explicit" and route == ("auto", 2, "auto")), caplog.text


@pytest.mark.parametrize("axis_types", [pytest.param("auto", marks=pytest.mark.slow),
                                        "explicit"])
def test_a_pytree_of_replicated_split_and_tensor_split_arrays(axis_types):
  # A mesh with an axis the shard_maps leave to the partitioner ("tensor"): on Explicit
  # axes jax refuses the closure in its other form (a mesh mismatch ValueError).
  mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, axis_types=axis_types)
  specs = {"table": P("fsdp", None), "rep": P(), "cols": P(None, "tensor")}
  arrays = {"table": TABLE, **OTHERS}
  frozen = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}
  ref = _reference(arrays)["w"]
  for route in [("auto", 2, "auto"), ("auto", 2, "once"), ("shard_map", 1, "auto")]:
    if axis_types == "explicit" and route in REFUSED:
      with pytest.raises(fs.StepError) as err:
        _run(mesh, frozen, *route)
      for name in ("'frozen/table'", "'frozen/rep'", "'frozen/cols'"):
        assert name in str(err.value)
      continue
    np.testing.assert_allclose(_run(mesh, frozen, *route)["w"], ref, rtol=1e-5, atol=1e-6)


def test_shard_map_mode_on_explicit_axes_gathers_fsdp_split_params():
  # Without any closure: params split over "fsdp" enter the per-shard step whole.
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types="explicit")
  params = {"w": RNG.normal(size=(64, 64)).astype(np.float32) / 8}  # 16 KiB: split
  opt = optax.sgd(LR)
  state = fs.init_state(params, opt, mesh=mesh)
  assert state.params["w"].sharding.spec == P("fsdp", None)
  loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w"][:32]) - b["y"]) ** 2)
  new, _ = fs.shard_step(fs.train_step(loss, opt), mesh, mode="shard_map")(state, BATCH)
  grads = jax.grad(loss)(params, BATCH)
  np.testing.assert_allclose(np.asarray(new.params["w"]), params["w"] - LR * grads["w"],
                             rtol=1e-5, atol=1e-6)
  assert new.params["w"].sharding.spec == P("fsdp", None)


@pytest.mark.parametrize("axis_types", [pytest.param("auto", marks=pytest.mark.slow),
                                        "explicit"])
def test_a_pipeline_stage_closing_over_a_sharded_array(axis_types):
  mesh = fs.make_mesh({"stage": 4, "data": 2}, axis_types=axis_types)
  scale = RNG.normal(size=(16, 16)).astype(np.float32) / 4
  shared = jax.device_put(scale, NamedSharding(mesh, P("data", None)))

  def stack(f):
    return lambda ws, x: jax.lax.scan(lambda x, w: (jnp.tanh(x @ w @ f), None), x, ws)[0]

  ws = jax.random.normal(jax.random.key(0), (8, 16, 16)) / 4
  x = jax.random.normal(jax.random.key(1), (32, 16))
  piped = jax.jit(fs.parallel.pipeline(stack(shared), microbatches=8))
  with fs.with_mesh(mesh):
    if axis_types == "explicit":
      with pytest.raises(fs.StepError, match=r"stage_fn closes over 'f' \(float32\[16@data,"
                         r"16\]\).*fix: give that array Auto axis types"):
        piped(fs.parallel.stage_layers(ws, stages=4), x)
      return
    y = piped(fs.parallel.stage_layers(ws, stages=4), x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(stack(scale)(ws, x)), atol=1e-5)


def test_closed_arrays_are_found_through_partials_globals_and_settings():
  mesh = fs.make_mesh({"data": 8}, axis_types="explicit")
  a = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data")))
  b = jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P()))
  auto = jax.device_put(np.ones((8,), np.float32),
                        NamedSharding(fs.make_mesh({"data": 8}, axis_types="auto"), P()))

  def inner(x, scale):
    return x * scale + a.sum()  # `a` through the closure of a function it calls

  def outer(x):
    return inner(x, b) + auto.sum()  # `auto` is not on Explicit axes: not named

  wrapped = jax.tree_util.Partial(outer)  # a partial, as wrappers give
  names = [n for n, _ in _closure.closed_arrays(wrapped)]
  assert sorted(names) == ["a", "b"]
  # Not an error of this kind: nothing to name.
  assert _closure.explicit_closure(ValueError("shapes differ"), outer) is None
