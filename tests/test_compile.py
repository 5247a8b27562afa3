"""fnscale.shard_step: the compiled step is a declared value, and the step itself is never
inspected (a user's wrapper compiles the same program as the bare step)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnscale
import fnscale as fs
from fnscale import _compile as fcompile


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)


def _setup(opt):
  mesh = fnscale.make_mesh({"fsdp": 8})
  params = {"w": jnp.ones((256, 64)) * 0.01, "b": jnp.zeros((64,))}
  state = fnscale.init_state(params, opt, mesh=mesh)
  batch = {"x": jnp.ones((16, 256))}
  return mesh, state, batch


def _program(lowered) -> str:
  # The module is named after the function (jit_step vs jit__lambda_); nothing else may differ.
  return re.sub(r"@jit_\w+", "@jit_f", lowered.as_text())


@pytest.mark.parametrize("make_opt", [lambda: optax.adam(1e-2),
                                      lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8)])
def test_wrapped_step_compiles_the_same_program(make_opt):
  opt = make_opt()
  mesh, state, batch = _setup(opt)
  bare = fnscale.train_step(_loss, opt)
  wrapped = lambda s, b: bare(s, b)  # no functools.wraps: nothing to read off it
  a = fnscale.shard_step(bare, mesh, donate=False)
  b = fnscale.shard_step(wrapped, mesh, donate=False)
  sa, sb = a.shardings(state, batch), b.shardings(state, batch)
  assert sa == sb
  # The optimizer state keeps the shardings init_state gave it (read off its arrays).
  own = jax.tree.map(lambda x: x.sharding, state.opt_state)
  assert jax.tree.leaves(sa[0].opt_state) == jax.tree.leaves(own)
  assert _program(a.lower(state, batch)) == _program(b.lower(state, batch))
  # Both run and give bitwise the same params.
  (s1, m1), (s2, m2) = a(state, batch), b(state, batch)
  jax.tree.map(np.testing.assert_array_equal, s1.params, s2.params)
  assert float(m1["loss"]) == float(m2["loss"])


def test_adafactor_factored_state_is_born_sharded():
  # v_row / v_col have the params' tree structure but not their shapes: they can't take the
  # params' specs (it used to be a raw ValueError from jax.jit's out_shardings).
  opt = optax.adafactor(1e-2, min_dim_size_to_factor=8)
  mesh, state, _ = _setup(opt)
  factored = state.opt_state[0]
  assert factored.v_row["w"].shape == (256,) or factored.v_row["w"].shape == (64,)
  for leaf in jax.tree.leaves(factored):
    assert len(leaf.sharding.spec) <= leaf.ndim
  assert state.params["w"].sharding.spec == P("fsdp", None)


def test_steps_are_declared_values_not_function_attributes():
  opt = optax.sgd(0.1)
  mesh, state, batch = _setup(opt)
  step = fnscale.train_step(_loss, opt)
  for name in ("optimizer", "policy", "accum_steps", "has_aux", "loss_fn"):
    assert not hasattr(step, name)
  sharded = fnscale.shard_step(step, mesh, donate=False)
  assert isinstance(sharded, fcompile.ShardedStep) and sharded.mesh is mesh
  with pytest.raises(dataclasses.FrozenInstanceError):
    sharded.mode = "shard_map"  # type: ignore[misc]
  compiled = sharded.compile(state, batch)
  assert isinstance(compiled, fcompile.CompiledStep)
  assert compiled.mesh is mesh and compiled.mode == "auto"
  assert compiled.state_shardings.params["w"] == NamedSharding(mesh, P("fsdp", None))
  assert compiled.batch_shardings["x"] == NamedSharding(mesh, P("fsdp"))
  # compile_report takes the compiled value directly: its executable, not a new compile.
  report = fnscale.compile_report(compiled, state, batch)
  assert report.compile_seconds == compiled.compile_seconds
  assert report.mesh_shape == {"fsdp": 8}
  # ... and a plain function is compiled with jax.jit.
  plain = fs.compile_report(lambda x, y: x @ y, jnp.ones((8, 4)), jnp.ones((4, 8)))
  assert plain.matmul_flops == 2 * 8 * 8 * 4 and plain.num_devices == 1


def test_with_kernel_and_with_mesh_compose_around_a_plain_step():
  opt = optax.sgd(0.1)
  mesh, state, batch = _setup(opt)
  step = fnscale.with_kernel(fnscale.with_mesh(mesh)(fnscale.train_step(_loss, opt)),
                             attention="xla")
  new, metrics = fnscale.shard_step(step, mesh, donate=False)(state, batch)
  ref = float(_loss(jax.device_get(state.params), jax.device_get(batch)))
  # float32 sums of 256 products in another order (8 shards, then a reduction): ~1e-5.
  assert float(metrics["loss"]) == pytest.approx(ref, rel=3e-5)
  assert int(new.step) == 1
