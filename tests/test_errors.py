"""Errors by kind: bad input is a ValueError, a failed environment is not; one type per
mistake wherever it is made."""
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import fnscale as fs
from fnscale import _errors as errors

INPUT = ("TopologyError", "MeshError", "ShardingError", "StepError", "KernelError",
         "CheckpointError", "PlanError", "DistributedArgumentError", "ExpertError")
RUNTIME = ("DistributedError", "CloudError", "StorageError")


def test_every_error_is_exported_with_its_kind():
  for name in INPUT + RUNTIME:
    assert getattr(fs, name) is getattr(errors, name) and name in fs.__all__
  assert fs.PlanError is fs.PlanError
  for name in INPUT:
    assert issubclass(getattr(fs, name), (fs.InputError, ValueError, fs.FnscaleError))
    assert not issubclass(getattr(fs, name), RuntimeError)
  for name in RUNTIME:
    cls = getattr(fs, name)
    assert issubclass(cls, fs.RuntimeFailure) and issubclass(cls, fs.FnscaleError)
    assert not issubclass(cls, ValueError)


def _loss(p, b):
  return jnp.mean(b["x"] @ p["w"])


def test_a_bad_mesh_is_a_mesh_error_from_every_entry_point():
  opt = optax.sgd(0.1)
  params = {"w": jnp.ones((8, 4))}
  mesh = fs.make_mesh({"data": 8})
  state = fs.init_state(params, opt, mesh=mesh)
  calls = {
      "make_mesh": lambda: fs.make_mesh({"data": 16}),
      "with_mesh": lambda: fs.with_mesh("data=8").__enter__(),
      "shardings": lambda: fs.shardings(params, "data=8"),
      "sharding_layout": lambda: fs.sharding_layout(params, {"data": 8}),
      "batch_sharding": lambda: fs.batch_sharding(None),
      "init_state": lambda: fs.init_state(params, opt, mesh="data=8"),
      "state_shardings": lambda: fs.state_shardings(state, ["data"]),
      "shard_step": lambda: fs.shard_step(fs.train_step(_loss, opt), "data=8"),
  }
  for name, call in calls.items():
    with pytest.raises(fs.MeshError) as e:
      call()
      pytest.fail(f"{name} raised nothing")
    assert type(e.value) is fs.MeshError, name
    assert isinstance(e.value, ValueError), name  # an `except ValueError` still catches it
    if name != "make_mesh":  # one check of a mesh argument: it names the function called
      assert str(e.value).startswith(f"{name}: mesh is "), (name, str(e.value))


def test_a_failed_write_is_a_storage_error_not_a_value_error(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  (tmp_path / "f").write_text("a file where the checkpoint directory should go")
  with pytest.raises(fs.StorageError, match=r"checkpoint directory .*f/ckpt failed: "
                     "NotADirectoryError"):
    try:
      fs.checkpoint.save(tmp_path / "f" / "ckpt", 1, {"w": jnp.ones(3)})
    except ValueError:  # a caller's handler for bad arguments must not see it
      pytest.fail("a storage failure was caught as a ValueError")
  with pytest.raises(ValueError):  # a bad argument still is one
    fs.checkpoint.save(tmp_path / "ok", -1, {"w": jnp.ones(3)})


def test_bad_arguments_to_flops_are_input_errors():
  with pytest.raises(fs.InputError, match="layers=-1"):
    fs.analysis.model_flops_per_token(params=10, layers=-1, d_model=4, seq=8)


# A failure inside the model while the step traces: the StepError says where (the user's
# line, not jax's, flax's or fnscale's), gives the model's message whole, chains it, and
# names a fix only when one is known.
def _trace(loss, params, batch):
  opt = optax.sgd(0.1)
  mesh = fs.make_mesh({"data": 8})
  step = fs.shard_step(fs.train_step(loss, opt), mesh, donate=False)
  with pytest.raises(fs.StepError) as e:
    step(fs.init_state(params, opt, mesh=mesh), batch)
  return e.value


def test_a_linen_shape_error_names_the_models_line():
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8)(x)
      return nn.Dense(1)(x)

  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))
  loss = lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)
  err = _trace(loss, params, {"x": jnp.ones((8, 5)), "y": jnp.ones((8, 1))})
  # Before: flax's ScopeParamShapeError came through raw.
  assert re.search(r"tracing the step failed for batch \{'x': float32\[8, 5\], 'y': "
                   r"float32\[8, 1\]\} in \S*test_errors\.py:\d+, in __call__ "
                   r"\(`x = nn\.Dense\(8\)\(x\)`\): ScopeParamShapeError: For parameter "
                   r"\"kernel\" in \"/Dense_0\".* expected to generate shape \(5, 8\), but the "
                   r"existing parameter it received has shape \(4, 8\)", str(err)), str(err)
  assert "fix:" not in str(err)  # no fix is known: the model and the batch disagree
  assert type(err.__cause__).__name__ == "ScopeParamShapeError"


def test_a_pytree_mismatch_keeps_its_key_path():
  def loss(p, b):
    shifts = {"w": jnp.ones(4), "b": {"bias": 0.0}}  # the params' "b" holds "offset"
    shifted = jax.tree.map(lambda w, s: w + s, p, shifts)
    return jnp.mean(b["x"] @ shifted["w"]) + shifted["b"]["bias"]

  err = _trace(loss, {"w": jnp.ones(4), "b": {"offset": jnp.zeros(())}},
               {"x": jnp.ones((8, 4))})
  # Before: only the message's first line, without the key path that follows it.
  assert re.search(r"failed for batch \{'x': float32\[8, 4\]\} in \S*test_errors\.py:\d+, "
                   r"in loss \(`shifted = jax\.tree\.map\(.*`\): ValueError: ", str(err))
  assert str(err.__cause__) in str(err) and "\n" in str(err.__cause__)
  assert "['b']" in str(err).split("\n", 1)[1] and "offset" in str(err)  # past line one
  assert "fix:" not in str(err)


def test_a_python_error_in_the_loss_gets_no_batch_fix():
  def scale(x, factor):
    return x * factor

  def loss(p, b):
    # The factor is forgotten.
    return jnp.mean(scale(b["x"] @ p["w"]))

  err = _trace(loss, {"w": jnp.ones((4, 2))}, {"x": jnp.ones((8, 4))})
  # Before: "...: TypeError: ...; fix: give the batch the shapes and dtypes the loss
  # expects", a wrong fix.
  assert re.search(r"in \S*test_errors\.py:\d+, in loss \(`return jnp\.mean\(scale\(b\[\"x\"\] "
                   r"@ p\[\"w\"\]\)\)`\): TypeError: .*scale\(\) missing 1 required positional "
                   r"argument: 'factor'$", str(err)), str(err)
  assert isinstance(err.__cause__, TypeError)


def test_a_batch_that_traced_before_and_fails_now_names_the_changed_leaf():
  opt = optax.sgd(0.1)
  mesh = fs.make_mesh({"data": 8})
  state = fs.init_state({"w": jnp.ones((4, 2))}, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(_loss, opt), mesh, donate=False)
  step(state, {"x": jnp.ones((8, 4))})
  with pytest.raises(fs.StepError, match=r"failed for batch \{'x': float32\[8, 5\]\} in "
                     r"\S*test_errors\.py:\d+, in _loss .*TypeError: dot_general .*; fix: this "
                     r"step traced for batch \{'x': float32\[8, 4\]\}; batch leaf 'x' is "
                     r"float32\[8, 5\] where it was float32\[8, 4\]: give the batch"):
    step(state, {"x": jnp.ones((8, 5))})


def test_an_fnscale_error_inside_the_step_passes_through():
  opt = optax.sgd(0.1)
  mesh = fs.make_mesh({"data": 8})
  loss = lambda p, b: b["x"] @ p["w"]  # not a scalar: train_step's own check, while tracing
  step = fs.shard_step(fs.train_step(loss, opt), mesh)
  with pytest.raises(fs.StepError, match="scalar") as e:
    step(fs.init_state({"w": jnp.ones((4, 2))}, opt, mesh=mesh), {"x": jnp.ones((8, 4))})
  assert "tracing the step" not in str(e.value)
