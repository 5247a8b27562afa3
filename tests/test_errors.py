"""Errors by kind: bad input is a ValueError, a failed environment is not; one type per
mistake wherever it is made."""
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
