"""Meshes with Explicit axis types (jax.make_mesh's default) work like Auto ones."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnscale as fs
from fnscale.analysis import _report as freport

LR = 0.1


def _params():
  return {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 1000,
          "b": jnp.ones((32,))}


def _loss(p, b):
  x = fs.constrain_batch(b["x"])
  return jnp.mean((x @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2)


def _batch():
  return {"x": jax.random.normal(jax.random.key(0), (16, 64))}


def _reference():
  """One SGD step with jax.grad on one device, in float64 numpy for the update."""
  p, b = _params(), _batch()
  loss = lambda q: jnp.mean((b["x"] @ q["w"]) ** 2) + jnp.sum(q["b"] ** 2)
  g = jax.grad(loss)(p)
  return {k: np.asarray(p[k], np.float64) - LR * np.asarray(g[k], np.float64) for k in p}


MESHES = {
    "jax.make_mesh": lambda: jax.make_mesh((2, 4), ("data", "fsdp")),
    "fs explicit": lambda: fs.make_mesh({"data": 8, "fsdp": 1}, axis_types="explicit"),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("accum,mode", [(1, "auto"), (2, "auto"), (2, "shard_map")])
def test_step_on_an_explicit_mesh(mesh_name, accum, mode):
  mesh = MESHES[mesh_name]()
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  opt = optax.sgd(LR)
  state = fs.init_state(_params(), opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(_loss, opt, accum_steps=accum), mesh, mode=mode)
  compiled = step.compile(state, _batch())
  state, metrics = compiled(state, _batch())
  ref = _reference()
  for k in ref:
    np.testing.assert_allclose(np.asarray(state.params[k]), ref[k], rtol=2e-6, atol=1e-7)
  report = freport.report_from_compiled(compiled.compiled, compiled.compile_seconds,
                                        compiled.mesh)
  assert report.num_devices == 8


def test_constrain_batch_reshards_under_explicit_axes():
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "fsdp")))
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: fs.constrain_batch(x * 2))(x)
  # The batch dim takes the data axes; the fsdp axis leaves the feature dim it held.
  assert y.sharding.spec == P(("data", "fsdp"), None)
  np.testing.assert_array_equal(np.asarray(y), 2.0)


def test_shardings_state_and_reports_on_an_explicit_mesh():
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  opt = optax.adam(1e-3)
  params = {"w": jnp.ones((64, 64)), "b": jnp.ones((32,))}
  assert fs.shardings(params, mesh)["w"].spec == P("fsdp", None)
  assert fs.batch_sharding(mesh).spec == P(("data", "fsdp"))
  abstract = fs.init_state(params, opt, mesh=mesh, abstract=True)
  assert fs.state_shardings(abstract, mesh, optimizer=opt).opt_state[0].mu["w"].spec == P(
      "fsdp", None)
  assert "P('fsdp', None)" in fs.sharding_report(params, fs.sharding_layout(params, mesh))
  report = fs.compile_report(fs.shard_step(fs.train_step(_loss, opt), mesh), abstract,
                             {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)})
  assert report.mesh_shape == {"data": 2, "fsdp": 4}


def test_checkpoint_round_trip_on_an_explicit_mesh(tmp_path):
  from fnscale import checkpoint  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  state = fs.init_state(_params(), optax.sgd(LR), mesh=mesh)
  checkpoint.save(tmp_path, 0, state)
  restored, _ = checkpoint.restore(tmp_path, state)
  assert restored.params["w"].sharding == state.params["w"].sharding
  np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.asarray(_params()["w"]))


def _fsdp_params(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "w2": jax.random.normal(k2, (256, 8))}


def _plain_loss(p, b):
  # No constraint, no gathering: the user's loss as written for one device.
  return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]) ** 2)


@pytest.mark.parametrize("accum,gather", [
    (1, "per_microbatch"), pytest.param(2, "per_microbatch", marks=pytest.mark.slow),
    (2, "once")])
def test_fsdp_params_on_explicit_axes_give_the_auto_mesh_losses_and_grads(accum, gather):
  # w1 is born split over "fsdp" on its 256 dim and the batch over ("data", "fsdp"): on
  # Explicit axes `x @ w1` alone would be an illegally sharded result
  # (f32[16@(data,fsdp),256@fsdp]); the step gathers the weight for compute, as GSPMD does
  # on Auto axes.
  batch = {"x": jax.random.normal(jax.random.key(1), (16, 64))}
  out = {}
  for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))
    opt = optax.sgd(LR)
    state = fs.init_state(_fsdp_params, opt, mesh=mesh, key=jax.random.key(0))
    assert state.params["w1"].sharding.spec == P(None, "fsdp")
    step = fs.shard_step(fs.train_step(_plain_loss, opt, accum_steps=accum,
                                       accum_gather=gather), mesh)
    new, metrics = step(state, batch)
    out[kind] = (float(metrics["loss"]), float(metrics["grad_norm"]),
                 jax.device_get(new.params))
  (auto_loss, auto_norm, auto_p), (loss, norm, params) = out.values()
  ref_loss, ref_grads = jax.value_and_grad(_plain_loss)(_fsdp_params(jax.random.key(0)), batch)
  assert loss == pytest.approx(auto_loss, rel=1e-6) and loss == pytest.approx(
      float(ref_loss), rel=1e-5)
  assert norm == pytest.approx(auto_norm, rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params,
               auto_p)
  ref = jax.tree.map(lambda p, g: p - LR * g, _fsdp_params(jax.random.key(0)), ref_grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params,
               jax.device_get(ref))


@pytest.mark.tpu
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_abstract_state_inside_with_mesh_of_a_tpu_target(axis_types, tpu_devices):
  # Under with_mesh of described devices (which hold no arrays) even a constant can't run
  # on Explicit axes: init_state(abstract=True) only traces, and the step compiles from it.
  del tpu_devices  # (skips without libtpu)
  mesh = fs.make_mesh({"data": 2, "fsdp": 2}, devices=fs.target_devices("v5p-8"),
                      axis_types=axis_types)
  key, params = jax.random.key(0), {"w": jnp.ones((1024, 256)), "b": jnp.zeros((256,))}
  init = lambda k: {"w": jax.random.normal(k, (1024, 256)), "b": jnp.zeros((256,))}
  opt = optax.adamw(1e-3)
  small = _params()
  with fs.with_mesh(mesh):
    for source, kwargs in ((init, dict(key=key)), (params, {}),
                           (init, dict(key=key, policy="params=float32,compute=float16"))):
      state = fs.init_state(source, opt, mesh=mesh, abstract=True, **kwargs)
      assert isinstance(state.params["w"], jax.ShapeDtypeStruct)
      assert state.params["w"].sharding.spec == P("fsdp", None)
      assert state.opt_state[0].mu["w"].sharding.spec == P("fsdp", None)
      assert (state.step.shape, state.step.dtype) == ((), jnp.int32)
    # The float16 policy's dynamic loss scale, abstract too.
    assert state.loss_scale.scale.shape == () and state.loss_scale.scale.sharding.spec == P()
    report = fs.compile_report(fs.shard_step(fs.train_step(_loss, opt), mesh),
                               fs.init_state(small, opt, mesh=mesh, abstract=True),
                               {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)})
    assert report.mesh_shape == {"data": 2, "fsdp": 2}
    # Arrays there can't be: an fnscale error naming the fix, not an AttributeError.
    with pytest.raises(fs.MeshError, match=r"described ones .* fix: init_state\(\.\.\., "
                                           r"abstract=True\)"):
      fs.init_state(small, opt, mesh=mesh)


def _dense_moe(x, params, top):
  """A loop over every expert for the fixed routing `top` [tokens, k] (one-hot gates)."""
  t = x.reshape(-1, x.shape[-1])
  probs = jax.nn.softmax(t @ params["router"], axis=-1)
  w = jnp.take_along_axis(probs, top, axis=-1)
  gate = jnp.einsum("tk,tke->te", w / w.sum(-1, keepdims=True),
                    jax.nn.one_hot(top, params["router"].shape[1]))
  out = jnp.zeros_like(t)
  for e in range(params["router"].shape[1]):
    h = jax.nn.silu(t @ params["w_gate"][e]) * (t @ params["w_up"][e])
    out = out + gate[:, e:e + 1] * (h @ params["w_down"][e])
  return out.reshape(x.shape)


@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4},
                                  pytest.param({"data": 4, "tensor": 2},
                                               marks=pytest.mark.slow)])
def test_expert_layer_on_explicit_axes(axes):
  # Its shard_map takes each argument by the spec it names: on Explicit axes they are
  # resharded to it first (jax refused the arrays' own shardings there).
  d, e, f = 8, 8, 16
  ks = jax.random.split(jax.random.key(0), 5)
  params = {"router": jax.random.normal(ks[0], (d, e)),
            "w_gate": 0.4 * jax.random.normal(ks[1], (e, d, f)),
            "w_up": 0.4 * jax.random.normal(ks[2], (e, d, f)),
            "w_down": 0.4 * jax.random.normal(ks[3], (e, f, d))}
  x = jax.random.normal(ks[4], (8, 4, d))
  top = jnp.argsort(-(x.reshape(-1, d) @ params["router"]), axis=-1, stable=True)[:, :2]
  mesh = fs.make_mesh(axes, axis_types="explicit")
  layer = lambda x: fs.parallel.moe(x, params, k=2, exchange="ragged", interpret=True)[0]
  loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x))))
  with fs.with_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    value, grad = jax.jit(jax.value_and_grad(loss(layer)))(sharded)
  want, want_grad = jax.value_and_grad(loss(lambda x: _dense_moe(x, params, top)))(x)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, atol=1e-5)
