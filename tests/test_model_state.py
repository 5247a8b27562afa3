"""A model's state beside its params (`TrainState.model_state`): a BatchNorm's running
statistics as each framework's users hold them (Flax Linen's `batch_stats`, NNX BatchStats,
an Equinox `eqx.nn.State`), trained over a mesh as the same model trains on one device with
its framework's own step: the losses, the params and the running statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

STEPS, ROWS, WIDTH = 3, 32, 8
MESHES = ({"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 4})


def _batches():
  rng = np.random.default_rng(0)
  return [{"x": (rng.normal(size=(ROWS, WIDTH)) * 2 + 1).astype(np.float32),
           "y": rng.normal(size=(ROWS,)).astype(np.float32)} for _ in range(STEPS)]


def _trained(params, model_state, loss_fn, axes, accum_steps=1, **step_kw):
  """(losses, state) of fnscale's step on `axes` over `_batches()`, AdamW."""
  mesh, opt = fs.make_mesh(axes), optax.adamw(1e-2)
  state = fs.init_state(params, opt, mesh=mesh, model_state=model_state)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum_steps, **step_kw), mesh)
  losses = []
  for batch in _batches():
    state, metrics = step(state, fs.global_batch(batch, fs.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return losses, state


def _close(got, want, rtol=2e-5, atol=2e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ Flax Linen

nn = pytest.importorskip("flax.linen")


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    # No bias before the norm: its gradient is zero, rounding noise that AdamW amplifies.
    x = nn.Dense(16, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(1)(nn.relu(x))[:, 0]


def _linen_loss(params, batch, *, model_state):
  out, updates = LinenNet().apply({"params": params, "batch_stats": model_state}, batch["x"],
                                  train=True, mutable=["batch_stats"])
  return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]


def _linen_start():
  variables = LinenNet().init(jax.random.key(0), _batches()[0]["x"], train=False)
  return variables["params"], variables["batch_stats"]


def _linen_reference():
  """Flax's own way on one device: `apply(..., mutable=["batch_stats"])` under jax.jit with
  plain optax, the new statistics kept each step."""
  params, stats = _linen_start()
  opt = optax.adamw(1e-2)
  opt_state, losses = opt.init(params), []
  grad = jax.jit(jax.value_and_grad(lambda p, s, b: _linen_loss(p, b, model_state=s),
                                    has_aux=True))
  for batch in _batches():
    (loss, stats), grads = grad(params, stats, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params, stats


@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_a_linen_batchnorm_trains_like_flaxs_own_step_on_one_device(axes):
  want_losses, want_params, want_stats = _linen_reference()
  losses, state = _trained(*_linen_start(), _linen_loss, axes)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  _close(state.params, want_params)
  _close(state.model_state, want_stats)
  assert jax.tree.structure(state.model_state) == jax.tree.structure(want_stats)


@pytest.mark.parametrize("accum_gather", ["once", "per_microbatch"])
def test_under_accumulation_the_running_mean_moves_by_the_whole_batchs_mean(accum_gather):
  """Every microbatch starts from the state's statistics and their new ones are averaged:
  the running mean moves by the whole batch's mean, as one update of momentum 0.9 does;
  the running variance by the microbatches' mean variance, at most the batch's. With
  has_aux the loss's own aux comes back beside them."""
  params, stats = _linen_start()

  def with_aux(params, batch, *, model_state):
    loss, new = _linen_loss(params, batch, model_state=model_state)
    return (loss, {"rows": jnp.sum(jnp.ones_like(batch["y"]), dtype=jnp.int32)}), new
  mesh, opt = fs.make_mesh({"data": 2, "fsdp": 4}), optax.sgd(0.0)
  state = fs.init_state(params, opt, mesh=mesh, model_state=stats)
  step = fs.shard_step(fs.train_step(with_aux, opt, has_aux=True, accum_steps=2,
                                     accum_gather=accum_gather), mesh)
  batch = _batches()[0]
  state, metrics = step(state, fs.global_batch(batch, fs.batch_sharding(mesh)))
  assert int(metrics["aux"]["rows"]) == ROWS
  h = np.asarray(batch["x"], np.float64) @ np.asarray(params["Dense_0"]["kernel"], np.float64)
  old = jax.tree.map(np.asarray, stats)["BatchNorm_0"]
  got = state.model_state["BatchNorm_0"]
  np.testing.assert_allclose(got["mean"], 0.9 * old["mean"] + 0.1 * h.mean(0), rtol=1e-5,
                             atol=1e-6)
  assert np.all(np.asarray(got["var"]) <= 0.9 * old["var"] + 0.1 * h.var(0) + 1e-5)
  assert np.all(np.asarray(got["var"]) > 0.9 * old["var"])


@pytest.mark.parametrize("axes, accum_steps, accum_gather", [
    ({"data": 8}, 1, "auto"), ({"data": 8}, 2, "once"), ({"data": 2, "fsdp": 4}, 2, "auto")])
def test_integer_and_flag_leaves_of_the_model_state_come_back_exact(axes, accum_steps,
                                                                    accum_gather):
  """A count past float32's 2**24, a uint32 seed the loss returns as it is, a flag: kept as
  the loss computed them (every microbatch and shard alike), never through a float."""
  start = {"count": jnp.int32(2**24 + 1), "seed": jnp.uint32(3_000_000_001),
           "first": jnp.bool_(True)}

  def loss_fn(params, batch, *, model_state):
    loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
    return loss, {"count": model_state["count"] + 1, "seed": model_state["seed"],
                  "first": jnp.logical_and(model_state["first"], False)}
  mesh, opt = fs.make_mesh(axes), optax.sgd(0.1)
  state = fs.init_state({"w": jnp.ones((WIDTH, 1))}, opt, mesh=mesh, model_state=start)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum_steps,
                                     accum_gather=accum_gather), mesh)
  batch = fs.global_batch({"x": _batches()[0]["x"]}, fs.batch_sharding(mesh))
  for n in (1, 2):
    state, _ = step(state, batch)
    assert int(state.model_state["count"]) == 2**24 + 1 + n
  assert int(state.model_state["seed"]) == 3_000_000_001
  assert state.model_state["seed"].dtype == jnp.uint32 and not bool(state.model_state["first"])


def test_a_typed_key_in_the_model_state_is_refused_naming_its_bits():
  with pytest.raises(fs.StepError, match=r"model_state leaf 'rng' is a typed PRNG key .*fix: "
                     r"its bits, jax\.random\.key_data\(key\)"):
    fs.init_state({"w": jnp.ones((2, 2))}, optax.sgd(0.1), mesh=fs.make_mesh({"data": 8}),
                  model_state={"rng": jax.random.key(0)})


def test_accumulation_left_to_auto_gives_a_batchnorm_whole_microbatches():
  """On a data mesh "auto" would run the loss per shard (a device's 2 rows of a 16-row
  microbatch, statistics of noise); with a model state it gathers per microbatch: the same
  step as accum_gather="per_microbatch"."""
  got = _trained(*_linen_start(), _linen_loss, {"data": 8}, accum_steps=2)
  want = _trained(*_linen_start(), _linen_loss, {"data": 8}, accum_steps=2,
                  accum_gather="per_microbatch")
  np.testing.assert_array_equal(got[0], want[0])
  _close(got[1].model_state, want[1].model_state, rtol=0, atol=0)


def test_a_step_skipped_for_non_finite_gradients_keeps_the_old_model_state():
  """float16 compute with a dynamic loss scale: a loss whose scaled gradients overflow skips
  the step (params unchanged), and the running statistics stay as they were too."""
  params, stats = _linen_start()
  policy = "params=float32,compute=float16,output=float32"
  huge = lambda p, b, *, model_state: (lambda out: (out[0] * 1e4, out[1]))(
      _linen_loss(p, b, model_state=model_state))
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh, model_state=stats, policy=policy)
  step = fs.shard_step(fs.train_step(huge, opt, policy=policy), mesh)
  new, metrics = step(state, fs.global_batch(_batches()[0], fs.batch_sharding(mesh)))
  assert int(metrics["skipped"]) == 1
  _close(new.params, params, rtol=0, atol=0)
  _close(new.model_state, stats, rtol=0, atol=0)
  assert new.model_state["BatchNorm_0"]["mean"].dtype == jnp.float32


def test_a_loss_without_the_new_model_state_is_named_with_the_form():
  params, stats = _linen_start()
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh, model_state=stats)
  batch = fs.global_batch(_batches()[0], fs.batch_sharding(mesh))
  alone = lambda p, b, *, model_state: _linen_loss(p, b, model_state=model_state)[0]
  with pytest.raises(fs.StepError, match=r"loss_fn returned .*; with a model_state in the "
                     r"state, loss_fn\(params, batch, \.\.\., \*, model_state\) must return "
                     r"\(output, new model_state\)"):
    fs.shard_step(fs.train_step(alone, opt), mesh)(state, batch)
  whole = lambda p, b, *, model_state: (_linen_loss(p, b, model_state=model_state)[0],
                                        {"batch_stats": model_state})
  with pytest.raises(fs.StepError, match=r"new model_state has the structure .*batch_stats"):
    fs.shard_step(fs.train_step(whole, opt), mesh)(state, batch)
  with pytest.raises(fs.StepError, match=r"model_state leaf 'BatchNorm_0/mean' is a str"):
    fs.init_state(params, opt, mesh=mesh, model_state={"BatchNorm_0": {"mean": "zeros"}})
  # A loss without the keyword; a state without the model state the loss takes.
  plain = lambda p, b: jnp.mean(b["y"] * 0 + jnp.sum(p["Dense_1"]["bias"]))
  with pytest.raises(fs.StepError, match=r"unexpected keyword argument 'model_state'.*fix: "
                     r"the state has a model_state .*`def loss_fn\(params, batch, \*, "
                     r"model_state\)`"):
    fs.shard_step(fs.train_step(plain, opt), mesh)(state, batch)
  with pytest.raises(fs.StepError, match=r"'model_state'.*fix: the loss takes a model_state: "
                     r"give the state one, fs\.init_state\(\.\.\., model_state=\.\.\.\)"):
    fs.shard_step(fs.train_step(_linen_loss, opt), mesh)(fs.init_state(params, opt, mesh=mesh),
                                                         batch)
  # A per-row aux beside the model state is named as the loss's own aux.
  rows = lambda p, b, *, model_state: (lambda out: ((out[0], {"err": b["y"]}), out[1]))(
      _linen_loss(p, b, model_state=model_state))
  with pytest.raises(fs.StepError, match=r"aux leaf 'err' has shape \(16,\)"):
    fs.shard_step(fs.train_step(rows, opt, has_aux=True, accum_steps=2), mesh)(state, batch)


def test_the_model_state_is_saved_and_restored_with_the_state(tmp_path):
  params, stats = _linen_start()
  _, state = _trained(params, stats, _linen_loss, {"fsdp": 8})
  fs.checkpoint.save(str(tmp_path / "ckpt"), STEPS, state)
  target = fs.init_state(params, optax.adamw(1e-2), mesh=fs.make_mesh({"data": 8}),
                         model_state=stats, abstract=True)
  restored, _ = fs.checkpoint.restore(str(tmp_path / "ckpt"), target)
  _close(restored.model_state, state.model_state, rtol=0, atol=0)
  assert restored.model_state["BatchNorm_0"]["var"].sharding.spec == jax.sharding.PartitionSpec()


# -------------------------------------------------------------------------------- Flax NNX

def test_an_nnx_batchnorm_trains_like_nnxs_own_step_on_one_device():
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(WIDTH, 16, use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
      self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.bn(self.up(x))))[:, 0]

  # NNX's own step: nnx.Optimizer over the Params, nnx.jit, the BatchStats updated in place.
  model = Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  want = [float(nnx_step(model, optimizer, b["x"], b["y"])) for b in _batches()]
  # The BatchStats closed over rather than given as the model state: named with the fix.
  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
  closed = lambda p, b: jnp.mean((nnx.merge(graphdef, p, rest)(b["x"]) - b["y"]) ** 2)
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  with pytest.raises(fs.StepError, match=r"TraceContextError.*BatchStat.*fix: a BatchStat the "
                     r"model updates is the state's model_state"):
    fs.shard_step(fs.train_step(closed, opt), mesh)(fs.init_state(params, opt, mesh=mesh),
                                                    _batches()[0])
  graphdef, params, stats, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)

  def loss_fn(params, batch, *, model_state):
    m = nnx.merge(graphdef, params, model_state, rest)
    loss = jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
    return loss, nnx.state(m, nnx.BatchStat)
  losses, state = _trained(params, stats, loss_fn, {"fsdp": 8})
  np.testing.assert_allclose(losses, want, rtol=2e-5)
  _close(state.params["up"]["kernel"][...], model.up.kernel[...])
  _close(state.model_state["bn"]["mean"][...], model.bn.mean[...])
  _close(state.model_state["bn"]["var"][...], model.bn.var[...])


# -------------------------------------------------------------------------------- Equinox

def test_an_equinox_batchnorm_trains_like_equinoxs_own_step_on_one_device():
  eqx = pytest.importorskip("equinox")

  class Net(eqx.Module):
    up: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
      a, b = jax.random.split(key)
      self.up = eqx.nn.Linear(WIDTH, 16, use_bias=False, key=a)
      self.bn = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.9, mode="ema")
      self.out = eqx.nn.Linear(16, 1, key=b)

    def __call__(self, x, state):
      h, state = self.bn(self.up(x), state)
      return self.out(jax.nn.relu(h))[0], state

  model, start = eqx.nn.make_with_state(Net)(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, batch, *, model_state):
    run = jax.vmap(eqx.combine(params, static), axis_name="batch", in_axes=(0, None),
                   out_axes=(0, None))
    out, new = run(batch["x"], model_state)
    return jnp.mean((out - batch["y"]) ** 2), new

  # Equinox's own way on one device: eqx.filter_jit, the state threaded through the calls.
  opt = optax.adamw(1e-2)
  p, s, opt_state, want = params, start, opt.init(params), []
  grad = eqx.filter_jit(eqx.filter_value_and_grad(
      lambda p, s, b: loss_fn(p, b, model_state=s), has_aux=True))
  for batch in _batches():
    (loss, s), grads = grad(p, s, batch)
    updates, opt_state = opt.update(grads, opt_state, p)
    p = eqx.apply_updates(p, updates)
    want.append(float(loss))
  losses, state = _trained(params, start, loss_fn, {"data": 2, "fsdp": 4})
  np.testing.assert_allclose(losses, want, rtol=2e-5)
  _close(state.params, p)
  _close(state.model_state, s)
  assert jax.tree.structure(state.model_state) == jax.tree.structure(s)
