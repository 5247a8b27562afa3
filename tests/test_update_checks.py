"""Updates that do not train: the step's update_norm / bad_update metrics, and loss-scale
unscaling that is exact at the edges of float32's range (8 CPU devices).

References are hand-known gradients (a linear loss) and numpy differences of the params.
"""
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import fnscale


def _run(loss_fn, params, opt, *, policy=None, loss_scale=None, batch=None, steps=1):
  """`steps` steps on data=8; returns (metrics of the last step, params before, after)."""
  mesh = fnscale.make_mesh("data=8")
  state = fnscale.init_state(params, opt, mesh=mesh, policy=policy, loss_scale=loss_scale)
  before = jax.device_get(state.params)
  step = fnscale.shard_step(fnscale.train_step(loss_fn, opt, policy=policy), mesh)
  batch = {"x": jnp.ones((8, 4), jnp.float32)} if batch is None else batch
  for _ in range(steps):
    state, m = step(state, batch)
  return jax.device_get(m), before, jax.device_get(state.params)


def _linear(params, batch):
  """loss = mean over rows of x . w (in the compute dtype): its gradient is the mean row of
  x, known by hand."""
  return jnp.mean(batch["x"] @ params["w"])


def test_update_norm_is_the_norm_of_the_params_change():
  params = {"w": jnp.arange(4, dtype=jnp.float32) / 3}
  m, before, after = _run(_linear, params, optax.adam(1e-2))
  change = np.asarray(after["w"], np.float64) - np.asarray(before["w"], np.float64)
  np.testing.assert_allclose(float(m["update_norm"]), np.linalg.norm(change), rtol=1e-6)
  assert int(m["bad_update"]) == 0 and int(m["skipped"]) == 0


def test_bfloat16_params_that_round_every_update_away_are_flagged():
  # Gradients are finite and non-zero, the step is not skipped, yet lr * grad is below half
  # a bfloat16 ulp of each param: the params never change.
  params = {"w": jnp.full((4,), 1.0, jnp.float32)}
  policy = "params=bfloat16,compute=bfloat16,output=float32"
  m, before, after = _run(_linear, params, optax.sgd(1e-4), policy=policy, steps=2)
  np.testing.assert_array_equal(after["w"], before["w"])
  assert float(m["grad_norm"]) > 0 and int(m["skipped"]) == 0
  assert float(m["update_norm"]) == 0.0 and int(m["bad_update"]) == 1


def test_non_finite_update_with_finite_loss_is_flagged():
  # sqrt(|w|) at w = 0: a finite loss, an infinite gradient, no loss scale to skip the step.
  params = {"w": jnp.zeros((4,), jnp.float32)}
  m, _, after = _run(lambda p, b: jnp.sum(jnp.sqrt(jnp.abs(p["w"]))), params, optax.sgd(0.1))
  assert np.isfinite(float(m["loss"])) and not np.all(np.isfinite(after["w"]))
  assert not np.isfinite(float(m["update_norm"])) and int(m["bad_update"]) == 1


def test_float16_gradients_that_underflow_without_a_loss_scale_are_flagged():
  # x = 2**-24, float16's smallest subnormal; each row's gradient, 2**-24 / 8, is 0 in
  # float16. The loss itself (also 0 in float16) is finite: nothing else says it.
  params = {"w": jnp.zeros((4,), jnp.float32)}
  policy = "params=float32,compute=float16,output=float32"
  batch = {"x": jnp.full((8, 4), 2.0**-24, jnp.float32)}
  m, _, _ = _run(_linear, params, optax.sgd(1.0), policy=policy, batch=batch,
                 loss_scale=jmp.NoOpLossScale())
  assert float(m["grad_norm"]) == 0.0 and int(m["bad_update"]) == 1
  # With the default dynamic scale (2**15) the same gradient is 2**-24 exactly.
  m, before, after = _run(_linear, params, optax.sgd(1.0), policy=policy, batch=batch)
  np.testing.assert_array_equal(before["w"] - after["w"], np.full(4, 2.0**-24, np.float32))
  assert int(m["bad_update"]) == 0


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_power_of_two_loss_scale_unscales_exactly(compute, dynamic):
  # Gradient 2**-100 (a normal float32 near the bottom of the range, exact in bfloat16):
  # scaled by 2**k it stays finite for every k here; unscaled it must be 2**-100 again
  # (jmp's multiply by 1 / 2**127, a subnormal, gave 0 on a device that flushes them).
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(2.0**90)
  policy = f"params=float32,compute={compute},output=float32"
  step = fnscale.shard_step(fnscale.train_step(_linear, opt, policy=policy), mesh)
  batch = {"x": jnp.full((8, 4), 2.0**-100, jnp.float32)}
  for k in (0, 15, 64, 100, 126, 127):
    scale = jnp.float32(2.0**k)
    ls = jmp.DynamicLossScale(scale) if dynamic else jmp.StaticLossScale(scale)
    state = fnscale.init_state({"w": jnp.ones((4,), jnp.float32)}, opt, mesh=mesh,
                               policy=policy, loss_scale=ls)
    state, m = step(state, batch)
    np.testing.assert_array_equal(jax.device_get(state.params["w"]),
                                  np.full(4, 1 - 2.0**-10, np.float32), err_msg=f"2**{k}")
    assert int(m["skipped"]) == 0 and int(m["bad_update"]) == 0


def test_float16_dynamic_scale_above_float16_range_skips_and_halves():
  # With float16 compute the loss's own cotangent is the scale: 2**16 > 65504 is inf there,
  # so the step is skipped and the scale halved; at 2**15 the gradient 2**-4 is exact.
  params = {"w": jnp.zeros((4,), jnp.float32)}
  policy = "params=float32,compute=float16,output=float32"
  batch = {"x": jnp.full((8, 4), 2.0**-4, jnp.float32)}
  ls = jmp.DynamicLossScale(jnp.float32(2.0**16))
  m, before, after = _run(_linear, params, optax.sgd(1.0), policy=policy, batch=batch,
                          loss_scale=ls)
  assert int(m["skipped"]) == 1 and float(m["loss_scale"]) == 2.0**15
  assert int(m["bad_update"]) == 0  # skipped steps are counted by "skipped", not here
  np.testing.assert_array_equal(after["w"], before["w"])
  m, before, after = _run(_linear, params, optax.sgd(1.0), policy=policy, batch=batch,
                          loss_scale=ls, steps=2)
  assert int(m["skipped"]) == 0
  np.testing.assert_array_equal(before["w"] - after["w"], np.full(4, 2.0**-4, np.float32))


# ----------------------------------------------------------------------------- train_lm's stop


def _metrics(bad, grad_norm=1.0, update_norm=0.0, loss=2.5):
  return {"bad_update": np.int32(bad), "grad_norm": np.float32(grad_norm),
          "update_norm": np.float32(update_norm), "loss": np.float32(loss)}


@pytest.mark.parametrize("grad_norm, update_norm, cause", [
    (0.0, 0.0, r"gradients are zero: they underflow in the compute dtype"),
    (3.0, float("nan"), r"params became non-finite"),
    (3.0, float("inf"), r"params became non-finite"),
    (3.0, 0.0, r"rounded away by the params' dtype"),
])
def test_consecutive_bad_updates_raise_naming_steps_and_cause(grad_norm, update_norm, cause):
  from recipes import harness  # pylint: disable=import-outside-toplevel
  stall = harness.Stall()
  # A good step in between resets the count: steps 5, 6 then 8, 9, 10 (limit 3).
  for done, bad in [(5, 1), (6, 1), (7, 0), (8, 1), (9, 1)]:
    stall = harness.check_update(stall, done, _metrics(bad, grad_norm, update_norm), 3)
  assert stall == harness.Stall(2, 8)
  with pytest.raises(fnscale.StepError, match=r"at 3 consecutive steps 8\.\.10 .*" + cause):
    harness.check_update(stall, 10, _metrics(1, grad_norm, update_norm), 3)
  assert harness.check_update(stall, 10, _metrics(1, grad_norm, update_norm), 0).steps == 3
