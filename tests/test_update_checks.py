"""Updates that do not train: the step's update_norm / bad_update / skipped metrics, loss
scaling at the edges of float32's range, and train_lm's stop after consecutive steps that
did not train (8 CPU devices).

References are hand-known gradients (a linear loss) and numpy differences of the params.
"""
import re

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import fnscale


def _run(loss_fn, params, opt, *, policy=None, loss_scale=None, batch=None, steps=1,
         update_norm=True):
  """`steps` steps on data=8, measuring the change by default; returns (metrics of the last
  step, params before, after)."""
  mesh = fnscale.make_mesh("data=8")
  state = fnscale.init_state(params, opt, mesh=mesh, policy=policy, loss_scale=loss_scale)
  before = jax.device_get(state.params)
  step = fnscale.shard_step(
      fnscale.train_step(loss_fn, opt, policy=policy, update_norm=update_norm), mesh)
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


BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"


def test_the_change_is_measured_by_default_only_where_params_are_narrower_than_float32():
  # float32 params: no update_norm (a pass of its own over the updates), the SGD step as by
  # hand (the gradient of the linear loss is the mean row of x, 1 per weight).
  params = {"w": jnp.full((4,), 1.0, jnp.float32)}
  m, before, after = _run(_linear, params, optax.sgd(0.25), update_norm=None)
  assert "update_norm" not in m and int(m["bad_update"]) == 0 and float(m["grad_norm"]) == 2.0
  np.testing.assert_array_equal(after["w"], before["w"] - 0.25)
  # bfloat16 params, whose rounding can swallow an update: measured, unless turned off.
  m, before, after = _run(_linear, params, optax.sgd(0.25), policy=BF16_PARAMS,
                          update_norm=None)
  change = after["w"].astype(np.float32) - before["w"].astype(np.float32)
  np.testing.assert_allclose(float(m["update_norm"]), np.linalg.norm(change), rtol=1e-6)
  m, _, _ = _run(_linear, params, optax.sgd(0.25), policy=BF16_PARAMS, update_norm=False)
  assert "update_norm" not in m and int(m["bad_update"]) == 0


def test_an_unmeasured_change_is_bad_where_the_gradients_are_non_finite():
  # float32 params and compute, the change unmeasured: sqrt at 0, a finite loss with an inf
  # gradient, is bad; a gradient of 2**-100, whose square underflows (grad_norm 0), moves
  # the params by lr x 2**-100 and is not.
  params = {"w": jnp.full((4,), 1.0, jnp.float32)}
  root = lambda p, b: jnp.sum(jnp.sqrt(p["w"])) + 0.0 * jnp.mean(b["x"])
  m, _, after = _run(root, {"w": jnp.zeros((4,), jnp.float32)}, optax.sgd(1.0),
                     update_norm=None)
  assert float(m["loss"]) == 0.0 and float(m["grad_norm"]) == np.inf
  assert int(m["bad_update"]) == 1 and not np.any(np.isfinite(after["w"]))
  m, before, after = _run(_linear, params, optax.sgd(2.0**90), update_norm=None,
                          batch={"x": jnp.full((8, 4), 2.0**-100, jnp.float32)})
  assert float(m["grad_norm"]) == 0.0 and int(m["bad_update"]) == 0
  np.testing.assert_array_equal(after["w"], before["w"] - 2.0**-10)


def test_update_norm_is_a_bool_or_none():
  with pytest.raises(fnscale.StepError, match=r"update_norm is .*'yes'.* True, False or None"):
    fnscale.train_step(_linear, optax.sgd(0.1), update_norm="yes")


def test_bfloat16_params_that_round_every_update_away_are_flagged():
  # Gradients are finite and non-zero, the step is not skipped, yet lr * grad is below half
  # a bfloat16 ulp of each param: the params never change.
  params = {"w": jnp.full((4,), 1.0, jnp.float32)}
  policy = "params=bfloat16,compute=bfloat16,output=float32"
  m, before, after = _run(_linear, params, optax.sgd(1e-4), policy=policy, steps=2)
  np.testing.assert_array_equal(after["w"], before["w"])
  assert float(m["grad_norm"]) > 0 and int(m["skipped"]) == 0
  assert float(m["update_norm"]) == 0.0 and int(m["bad_update"]) == 1


def test_update_norm_counts_only_what_survives_rounding_to_bfloat16():
  # bfloat16 params of 1.0 (ulp below 1: 2**-8) moved by sgd(1e-2) x gradients 1, 1e-3,
  # 0.5, 0: the first and third change (by a rounded amount), the second rounds away, the
  # fourth gets no update. update_norm is the norm of the rounded change, not of lr x grad;
  # grad_norm that of the float32 gradients.
  x = np.array([1.0, 1e-3, 0.5, 0.0], np.float32)
  params = {"w": jnp.ones((4,), jnp.float32)}
  policy = "params=bfloat16,compute=float32,output=float32"
  batch = {"x": jnp.asarray(np.tile(x, (8, 1)))}
  m, before, after = _run(_linear, params, optax.sgd(1e-2), policy=policy, batch=batch)
  change = np.asarray(after["w"], np.float64) - np.asarray(before["w"], np.float64)
  assert list(change != 0) == [True, False, True, False]
  np.testing.assert_allclose(float(m["update_norm"]), np.linalg.norm(change), rtol=1e-6)
  assert abs(float(m["update_norm"]) - np.linalg.norm(1e-2 * x)) > 1e-4  # rounding shows
  np.testing.assert_allclose(float(m["grad_norm"]), np.linalg.norm(x), rtol=1e-6)
  assert int(m["bad_update"]) == 0 and int(m["skipped"]) == 0


@pytest.mark.parametrize("update_norm", [True, None])
def test_params_are_updated_in_place_without_copies(update_norm):
  # The change is measured before the new params overwrite the old (donated) buffers: the
  # compiled step copies no param (measured as new - old it copied every one first).
  # Unmeasured (the default for float32 params), the CPU compiler copies the 0-d one.
  def loss_fn(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w"]) @ params["v"] + params["b"])

  mesh = fnscale.make_mesh("data=8")
  opt = optax.adamw(1e-3)
  params = {"w": jnp.ones((4, 16)) / 4, "v": jnp.ones((16,)), "b": jnp.zeros(())}
  state = fnscale.init_state(params, opt, mesh=mesh)
  step = fnscale.shard_step(fnscale.train_step(loss_fn, opt, update_norm=update_norm), mesh)
  hlo = step.compile(state, {"x": jnp.ones((8, 4))}).compiled.as_text()
  names = re.findall(r"(%[\w.-]+) = (\w+\[[\d,]*\])[^\n]*parameter\(\d+\)[^\n]*"
                     r"op_name=\"state\.params", hlo)
  assert len(names) == 3, hlo
  copied = [t for n, t in names if re.search(rf" copy\({re.escape(n)}\)", hlo)]
  assert copied in ([], ["f32[]"] if update_norm is None else []), (copied, hlo)


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


def _scaled_sum(params, batch):
  """loss = g * sum(w), g the batch's (constant) mean: the gradient is g for each w, taken
  whole (no sum over rows or shards that could overflow on the way)."""
  return jnp.mean(batch["g"]) * jnp.sum(params["w"])


@pytest.mark.parametrize("dynamic", [False, True])
def test_scaled_gradient_past_float32_range_is_skipped_or_flagged(dynamic):
  # At scale 2**127 a gradient of 1.5 scales to 1.5 * 2**127, below float32's largest
  # (2 - 2**-23) * 2**127, and is applied exactly; a gradient of 2 scales to 2**128: inf.
  from recipes.lm import stalls  # pylint: disable=import-outside-toplevel
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(2.0**-4)
  step = fnscale.shard_step(fnscale.train_step(_scaled_sum, opt, update_norm=True), mesh)

  def run(g, steps=1):
    scale = jnp.float32(2.0**127)
    ls = jmp.DynamicLossScale(scale) if dynamic else jmp.StaticLossScale(scale)
    state = fnscale.init_state({"w": jnp.ones((4,), jnp.float32)}, opt, mesh=mesh,
                               loss_scale=ls)
    for _ in range(steps):
      state, m = step(state, {"g": jnp.full((8,), g, jnp.float32)})
    return jax.device_get(m), jax.device_get(state.params["w"])

  m, w = run(1.5)
  np.testing.assert_array_equal(w, np.full(4, 1 - 1.5 / 16, np.float32))
  assert float(m["grad_norm"]) == 3.0 and int(m["skipped"]) == 0 and int(m["bad_update"]) == 0
  m, w = run(2.0)
  assert float(m["loss"]) == 8.0  # the unscaled loss is finite
  if dynamic:  # skipped: params unchanged, the scale halved; at 2**126 it fits and applies
    assert int(m["skipped"]) == 1 and int(m["bad_update"]) == 0
    assert float(m["loss_scale"]) == 2.0**126
    np.testing.assert_array_equal(w, np.ones(4, np.float32))
    m, w = run(2.0, steps=2)
    assert int(m["skipped"]) == 0
    np.testing.assert_array_equal(w, np.full(4, 1 - 2 / 16, np.float32))
  else:  # a static scale applies the inf: flagged, and train_lm's stop names it
    assert int(m["skipped"]) == 0 and int(m["bad_update"]) == 1
    assert float(m["update_norm"]) == np.inf and np.all(w == -np.inf)
    with pytest.raises(fnscale.StepError, match=r"likely cause: the params became non-finite"):
      stalls.check_update(stalls.Stall(), 1, m, 1)


# ----------------------------------------------------------------------------- train_lm's stop


def _metrics(bad, grad_norm=1.0, update_norm=0.0, loss=2.5, skipped=0, loss_scale=None):
  m = {"bad_update": np.int32(bad), "grad_norm": np.float32(grad_norm), "skipped":
       np.int32(skipped), "update_norm": np.float32(update_norm), "loss": np.float32(loss)}
  return m if loss_scale is None else dict(m, loss_scale=np.float32(loss_scale))


@pytest.mark.parametrize("grad_norm, update_norm, cause", [
    (0.0, 0.0, r"gradients are zero: they underflow in the compute dtype"),
    (3.0, float("nan"), r"params became non-finite"),
    (3.0, float("inf"), r"params became non-finite"),
    (3.0, 0.0, r"rounded away by the params' dtype"),
])
def test_consecutive_bad_updates_raise_naming_steps_and_cause(grad_norm, update_norm, cause):
  from recipes.lm import stalls  # pylint: disable=import-outside-toplevel
  stall = stalls.Stall()
  # A good step in between resets the count: steps 5, 6 then 8, 9, 10 (limit 3).
  for done, bad in [(5, 1), (6, 1), (7, 0), (8, 1), (9, 1)]:
    stall = stalls.check_update(stall, done, _metrics(bad, grad_norm, update_norm), 3)
  assert stall == stalls.Stall(2, 8)
  with pytest.raises(fnscale.StepError, match=r"at 3 consecutive steps 8\.\.10 .*" + cause):
    stalls.check_update(stall, 10, _metrics(1, grad_norm, update_norm), 3)
  assert stalls.check_update(stall, 10, _metrics(1, grad_norm, update_norm), 0).steps == 3


def _skip(loss=2.5):  # a step a dynamic scale at its floor skipped: params unchanged
  return _metrics(0, grad_norm=np.inf, update_norm=0.0, loss=loss, skipped=1, loss_scale=1.0)


def test_skipped_steps_with_a_finite_loss_count_toward_the_stop():
  from recipes.lm import stalls  # pylint: disable=import-outside-toplevel
  # Step 2's skip has a NaN loss (the non-finite check's to stop): it resets the count, as
  # the good step 4 does; skips and bad updates in a row count together: 5, 6, 7 (limit 3).
  seq = [(1, _skip()), (2, _skip(np.nan)), (3, _skip()), (4, _metrics(0, update_norm=0.1)),
         (5, _skip()), (6, _metrics(1, 3.0, 0.0))]
  stall = stalls.Stall()
  counts = []
  for done, m in seq:
    stall = stalls.check_update(stall, done, m, 3)
    counts.append(stall.steps)
  assert counts == [1, 0, 1, 0, 1, 2] and stall == stalls.Stall(2, 5)
  with pytest.raises(fnscale.StepError, match=r"at 3 consecutive steps 5\.\.7 .*grad_norm inf, "
                     r"update_norm 0, loss_scale 1\); likely cause: the updates were skipped: "
                     r"their gradients were non-finite .*overflow the compute dtype"):
    stalls.check_update(stall, 7, _skip(), 3)


def _run_each(loss_fn, w, steps, policy="params=float32,compute=float16,output=float32",
              update_norm=None):
  """`steps` steps on data=8 from params {"w": w} (float16 compute: init_state's default
  dynamic scale, 2**15); returns each step's metrics and the params before and after."""
  mesh = fnscale.make_mesh("data=8")
  opt = optax.sgd(2.0**-30)
  state = fnscale.init_state({"w": jnp.asarray(w, jnp.float32)}, opt, mesh=mesh,
                             policy=policy)
  before = jax.device_get(state.params["w"])
  step = fnscale.shard_step(
      fnscale.train_step(loss_fn, opt, policy=policy, update_norm=update_norm), mesh)
  ms = []
  for _ in range(steps):
    state, m = step(state, {"x": jnp.ones((8, 4), jnp.float32)})
    ms.append(jax.device_get(m))
  return ms, before, jax.device_get(state.params["w"])


def _stop_at(ms, limit):
  """(step, message) where train_lm's check stops these metrics (steps from 1), or (None, None)."""
  from recipes.lm import stalls  # pylint: disable=import-outside-toplevel
  stall = stalls.Stall()
  for done, m in enumerate(ms, 1):
    try:
      stall = stalls.check_update(stall, done, m, limit)
    except fnscale.StepError as e:
      return done, str(e)
  return None, None


def test_float16_run_that_skips_every_step_stops_at_the_default_limit():
  # loss = mean(x / w) = 4096 at x = 1, w = 2**-12: finite in float16, but its gradient,
  # -2**22 per element (float32), overflows float16 (max 65504) at every scale down to the
  # dynamic scale's floor, 1: every step is skipped while the scale halves 2**15 -> 1.
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  limit = train_lm.Options().schedule.max_stalled_steps
  loss_fn = lambda p, b: jnp.mean(b["x"] / p["w"])
  ms, before, after = _run_each(loss_fn, np.full(4, 2.0**-12), limit)
  assert [float(m["loss"]) for m in ms] == [4096.0] * limit
  assert [int(m["skipped"]) for m in ms] == [1] * limit
  assert [int(m["bad_update"]) for m in ms] == [0] * limit  # the metric alone says nothing
  assert [float(m["loss_scale"]) for m in ms] == [2.0**max(14 - i, 0) for i in range(limit)]
  np.testing.assert_array_equal(after, before)
  done, message = _stop_at(ms, limit)
  assert done == limit and re.search(
      rf"at {limit} consecutive steps 1\.\.{limit} .*loss 4096, grad_norm inf, update_norm 0, "
      r"loss_scale 1\); likely cause: the updates were skipped.*precision=float32", message)
  # The advice holds: in float32 the gradient is finite, -2**22 per element.
  ms, _, _ = _run_each(loss_fn, np.full(4, 2.0**-12), 1, policy=None)
  assert float(ms[0]["grad_norm"]) == 2.0**23 and int(ms[0]["skipped"]) == 0


def test_float16_dynamic_scale_that_halves_to_a_working_scale_does_not_stop():
  # loss = sum(w * 2**15) = 4 at w = 2**-15; its gradient 2**15 times a scale s fits float16
  # only at s = 1: the default scale 2**15 is skipped and halved 15 times, then step 16
  # applies -2**-30 * 2**15 = -2**-15, taking w to 0. train_lm's default limit lets it.
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  ms, _, after = _run_each(lambda p, b: jnp.sum(p["w"] * 2.0**15), np.full(4, 2.0**-15), 16)
  assert [int(m["skipped"]) for m in ms] == [1] * 15 + [0]
  assert float(ms[-1]["loss_scale"]) == 1.0 and int(ms[-1]["bad_update"]) == 0
  np.testing.assert_array_equal(after, np.zeros(4, np.float32))
  assert train_lm.Options().schedule.max_stalled_steps > 15
  assert _stop_at(ms, train_lm.Options().schedule.max_stalled_steps) == (None, None)
  assert _stop_at(ms, 15)[0] == 15  # a limit at the halvings' count stops it
