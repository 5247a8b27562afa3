"""Arguments of the wrong type get the module's fnscale error, naming the argument, what it
got and what it expects (never a raw AttributeError / TypeError, never silently accepted)."""
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import fnscale as fs
from fnscale import checkpoint as ckpt
from fnscale import _sharding as fsh

MESH_FIX = "; fix: fnscale.make_mesh(...), e.g. fnscale.make_mesh({'data': -1})."


@pytest.fixture(scope="module")
def mesh():
  return fs.make_mesh({"fsdp": 8})


def _loss(p, b):
  return jnp.mean(b["x"] @ p["w"])


def _raises(error, message):
  return pytest.raises(error, match="^" + re.escape(message) + "$")


def test_sharding_arguments(mesh):
  tree = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
  with _raises(fs.MeshError, "batch_sharding: mesh is a str ('data=8'), expected a "
               "jax.sharding.Mesh or AbstractMesh" + MESH_FIX):
    fs.batch_sharding("data=8")
  with _raises(fs.ShardingError, "axes is an int (3), expected a mesh axis name, a tuple of "
               "names or None; fix: e.g. 'fsdp' or ('data', 'fsdp')."):
    fs.batch_sharding(mesh, axes=3)
  with _raises(fs.ShardingError, "min_shard_bytes=-1 (int), expected an int >= 0."):
    fs.sharding_layout(tree, mesh, min_shard_bytes=-1)
  with _raises(fs.ShardingError, "min_shard_bytes=1.5 (float), expected an int >= 0."):
    fs.shardings(tree, mesh, min_shard_bytes=1.5)
  with _raises(fs.ShardingError,
               "max_replicated_bytes='1' (str), expected an int >= 0 or None."):
    fs.shardings(tree, mesh, max_replicated_bytes="1")
  with _raises(fs.ShardingError, "rules is a str ('embed'), expected a sequence of "
               "(logical_name, mesh_axes) pairs or a mapping; fix: e.g. (('embed', 'fsdp'), "
               "('mlp', 'tensor'))."):
    fs.shardings(tree, mesh, rules="embed")
  with _raises(fs.ShardingError, "fsdp_axis is an int (3), expected a mesh axis name, a "
               "tuple of names or None; fix: e.g. 'fsdp' or ('data', 'fsdp')."):
    fs.shardings(tree, mesh, fsdp_axis=3)
  with _raises(fs.MeshError, "logical_to_spec: mesh is a dict ({'fsdp': 8}), expected a "
               "jax.sharding.Mesh or AbstractMesh" + MESH_FIX):
    fs.logical_to_spec(("embed",), (), {"fsdp": 8})
  with _raises(fs.ShardingError, "axes is a float (1.0), expected a mesh axis name, a tuple "
               "of names or None; fix: e.g. 'fsdp' or ('data', 'fsdp')."):
    fs.constrain_batch(jnp.ones((8, 2)), axes=1.0)


def test_step_state_and_compile_arguments(mesh):
  opt = optax.sgd(0.1)
  with _raises(fs.StepError, "loss_fn is a str ('loss'), expected a callable "
               "loss_fn(params, batch) -> loss."):
    fs.train_step("loss", opt)
  with _raises(fs.StepError, "accum_steps=2.0 (float), expected an int >= 1."):
    fs.train_step(_loss, opt, accum_steps=2.0)
  with _raises(fs.StepError, "has_aux is an int (1), expected a bool."):
    fs.train_step(_loss, opt, has_aux=1)
  params = {"w": jnp.ones((64, 4))}
  with _raises(fs.MeshError, "init_state: mesh is a str ('data=8'), expected a "
               "jax.sharding.Mesh" + MESH_FIX):
    fs.init_state(params, opt, mesh="data=8")
  with _raises(fs.StepError, "sharding_options is a dict ({'fsdp': 'x'}), expected a dict "
               "with keys among ('fsdp_axis', 'min_shard_bytes', 'max_replicated_bytes')."):
    fs.init_state(params, opt, mesh=mesh, sharding_options={"fsdp": "x"})
  with _raises(fs.StepError, "abstract is a str ('yes'), expected a bool."):
    fs.init_state(params, opt, mesh=mesh, abstract="yes")
  with _raises(fs.StepError, "state is a dict ({'a': 1}), expected fnscale.TrainState; fix: "
               "build it with fnscale.init_state."):
    fs.state_shardings({"a": 1}, mesh)
  step = fs.train_step(_loss, opt)
  with _raises(fs.StepError, "donate is a str ('yes'), expected a bool."):
    fs.shard_step(step, mesh, donate="yes")
  with _raises(fs.StepError, "optimizer is a str ('adam'), expected an "
               "optax.GradientTransformation or None."):
    fs.shard_step(step, mesh, optimizer="adam")
  with _raises(fs.StepError, "compiler_options is a list ([('a', 1)]), expected a dict of "
               "XLA option names to values."):
    fs.shard_step(step, mesh, compiler_options=[("a", 1)])
  with _raises(fs.StepError, "example is a list ([1, 2]), expected (state, batch)."):
    fs.shard_step(step, mesh, example=[1, 2])


def test_report_and_checkpoint_arguments(tmp_path):
  with _raises(fs.StepError, "step is an int (3), expected a step function, a ShardedStep or "
               "a CompiledStep."):
    fs.compile_report(3, None, None)
  with _raises(fs.StepError, "compiler_options is a str ('O3'), expected a dict."):
    fs.compile_report(lambda x: x, jnp.ones(2), None, compiler_options="O3")
  with _raises(fs.StepError, "report is a str ('x'), expected a CompileReport."):
    fs.analysis.format_report("x")
  with _raises(fs.StepError, "compilation cache directory is an int (3), expected a "
               "non-empty path."):
    fs.compilation_cache(3)
  with _raises(fs.StepError, "min_entry_size_bytes=-1 (int), expected an int >= 0."):
    fs.compilation_cache(str(tmp_path), min_entry_size_bytes=-1)
  with _raises(fs.CheckpointError, "checkpoint directory is an int (3), expected a str or "
               "os.PathLike path such as 'runs/lm/ckpt' or 'gs://bucket/run/ckpt', or a "
               "fnscale.checkpoint.Manager."):
    ckpt.latest_step(3)
