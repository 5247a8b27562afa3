"""Weighted `(sum, weight)` losses and the loss's PRNG key (8 CPU devices).

References are written without fnscale: a single-device jax.grad of the whole batch's
weighted mean, and hand-made masks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale
import models

ROWS, LR = 64, 0.5  # 4 microbatches x 8 shards x 2 rows


def _masked_batch(seed: int):
  """An MLP batch with a token mask over the outputs: rows hold 0 .. d_out tokens, so
  microbatches and shards hold different numbers (some none)."""
  b = models.mlp_batch(jax.random.key(seed), ROWS)
  d_out = b["y"].shape[1]
  rng = np.random.default_rng(seed)
  counts = rng.integers(0, d_out + 1, ROWS)
  counts[:8] = 0  # microbatches 0..3, two rows each: whole shards of one microbatch empty
  counts[8:16] = d_out
  mask = (np.arange(d_out)[None, :] < counts[:, None]).astype(np.float32)
  return dict(b, mask=jnp.asarray(mask))


def _sq_err(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.square(h @ params["w2"] + params["b2"] - batch["y"]) * batch["mask"]


def _sum_weight(params, batch):
  return jnp.sum(_sq_err(params, batch)), jnp.sum(batch["mask"])


def _mean(params, batch):  # the same loss as a per-call mean: biased under uneven masks
  s, w = _sum_weight(params, batch)
  return s / jnp.maximum(w, 1.0)


def _reference(batch):
  """One SGD step on one device over the whole batch: (loss, new params)."""
  params = models.mlp_init(jax.random.key(0))
  loss, grads = jax.value_and_grad(lambda p: _sum_weight(p, batch)[0] / jnp.sum(
      batch["mask"]))(params)
  return float(loss), jax.tree.map(lambda p, g: p - LR * g, params, grads)


def _one_step(loss_fn, batch, mesh_axes, mode="auto", accum=4, gather="per_microbatch",
              weighted=True, update_norm=None):
  mesh = fnscale.make_mesh(mesh_axes)
  opt = optax.sgd(LR)
  kw = dict(rules=models.RULES, logical_axes=models.mlp_logical_axes())
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0), **kw)
  step = fnscale.train_step(loss_fn, opt, accum_steps=accum, accum_gather=gather,
                            weighted=weighted, update_norm=update_norm)
  state, m = fnscale.shard_step(step, mesh, mode=mode, **kw)(state, batch)
  return jax.device_get(m), jax.device_get(state.params)


@pytest.mark.parametrize("mesh_axes,mode,gather", [
    ("data=8", "shard_map", "per_microbatch"),  # 4 microbatches x 8 shards, per shard
    ("data=8", "auto", "per_microbatch"),
    ("fsdp=8", "auto", "once"),
])
def test_weighted_loss_equals_single_device_whole_batch(mesh_axes, mode, gather):
  batch = _masked_batch(1)
  ref_loss, ref_params = _reference(batch)
  m, params = _one_step(_sum_weight, batch, mesh_axes, mode, gather=gather)
  assert float(m["weight"]) == float(np.sum(batch["mask"]))
  np.testing.assert_allclose(float(m["loss"]), ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, ref_params)


def _sum_weight_aux(params, batch):
  """`((sum, weight), aux)`: aux counts the call's tokens as an int and as a float."""
  tokens = jnp.sum(batch["mask"])
  return _sum_weight(params, batch), {"tokens": tokens.astype(jnp.int32), "mean_tokens": tokens}


@pytest.mark.parametrize("mesh_axes,mode,gather,calls", [
    ("data=8", "shard_map", "per_microbatch", 32),  # 4 microbatches x 8 shards, per shard
    ("data=8", "auto", "per_microbatch", 4),  # the loss sees each whole microbatch
    ("fsdp=8", "auto", "once", 32),  # its microbatch loop runs per shard
])
def test_weighted_loss_with_aux(mesh_axes, mode, gather, calls):
  # The loss and params as without aux (one device's whole-batch mean); aux's int leaf is
  # summed over the loss's calls (the batch's tokens), its float leaf averaged over them.
  batch = _masked_batch(5)
  ref_loss, ref_params = _reference(batch)
  mesh = fnscale.make_mesh(mesh_axes)
  opt = optax.sgd(LR)
  kw = dict(rules=models.RULES, logical_axes=models.mlp_logical_axes())
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0), **kw)
  step = fnscale.train_step(_sum_weight_aux, opt, accum_steps=4, accum_gather=gather,
                            weighted=True, has_aux=True)
  state, m = fnscale.shard_step(step, mesh, mode=mode, **kw)(state, batch)
  m, params = jax.device_get((m, state.params))
  tokens = int(np.sum(batch["mask"]))
  assert float(m["weight"]) == tokens and int(m["aux"]["tokens"]) == tokens
  assert m["aux"]["tokens"].dtype == np.int32
  np.testing.assert_allclose(float(m["aux"]["mean_tokens"]), tokens / calls, rtol=1e-6)
  np.testing.assert_allclose(float(m["loss"]), ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, ref_params)


def test_masked_mean_loss_per_shard_equals_single_device_whole_batch():
  # The same loss written as a per-call mean, sum / max(count, 1), run on 32 parts of the
  # batch (4 microbatches x 8 shards, some parts with no tokens): the step reads it as
  # (sum, count) and gives the whole batch's mean, not the mean of the parts' means.
  batch = _masked_batch(2)
  ref_loss, ref_params = _reference(batch)
  m, params = _one_step(_mean, batch, "data=8", "shard_map", weighted=False)
  np.testing.assert_allclose(float(m["loss"]), ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, ref_params)


def test_weighted_loss_with_no_tokens_is_zero_not_nan():
  batch = _masked_batch(3)
  batch = dict(batch, mask=jnp.zeros_like(batch["mask"]))
  m, params = _one_step(_sum_weight, batch, "data=8", accum=2, update_norm=True)
  assert float(m["loss"]) == 0.0 and float(m["weight"]) == 0.0
  assert int(m["bad_update"]) == 1  # nothing to learn from: the params did not move
  jax.tree.map(np.testing.assert_array_equal, params,
               jax.device_get(models.mlp_init(jax.random.key(0))))


def test_weighted_loss_must_be_two_scalars():
  with pytest.raises(fnscale.StepError, match=r"weighted=True.*\(sum, weight\)"):
    _one_step(lambda p, b: jnp.sum(_sq_err(p, b)), _masked_batch(4), "data=8", accum=1)


# ----------------------------------------------------------------------------- PRNG key


def _dropout_run(mesh_axes, mode, steps=2, accum=2, gather="per_microbatch"):
  """Runs `steps` steps of a dropout loss; returns (masks seen: a list of bool arrays,
  final params)."""
  seen = []

  def loss_fn(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, (batch["x"].shape[0], params["w1"].shape[1]))
    jax.debug.callback(lambda k: seen.append(np.asarray(k)), keep)
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) * keep * 2.0
    return jnp.mean(jnp.square(h @ params["w2"] + params["b2"] - batch["y"]))

  mesh = fnscale.make_mesh(mesh_axes)
  opt = optax.sgd(0.1)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fnscale.shard_step(
      fnscale.train_step(loss_fn, opt, accum_steps=accum, accum_gather=gather,
                         key=jax.random.key(42)),
      mesh, mode=mode)
  for i in range(steps):
    state, _ = step(state, models.mlp_batch(jax.random.key(10 + i), 32))
  jax.effects_barrier()
  return seen, jax.device_get(state.params)


def _distinct(masks) -> int:
  return len({m.tobytes() for m in masks})


def test_dropout_masks_differ_by_step_microbatch_and_shard():
  seen, _ = _dropout_run("data=8", "shard_map")
  assert len(seen) == 2 * 2 * 8  # steps x microbatches x shards, each [2 rows, hidden]
  assert _distinct(seen) == len(seen)
  seen, _ = _dropout_run("data=8", "auto", accum=4)
  assert len(seen) == 2 * 4 and _distinct(seen) == len(seen)  # one global mask each


def test_once_gather_dropout_masks_differ_by_microbatch_and_shard():
  # accum_gather="once" runs the microbatch loop per shard under jax.shard_map, also in the
  # default mode: each call sees its shard's 2 rows (32 / 2 microbatches / 8) and its own key.
  seen, _ = _dropout_run("data=8", "auto", gather="once")
  assert len(seen) == 2 * 2 * 8 and {m.shape for m in seen} == {(2, models.MLP.d_hidden)}
  assert _distinct(seen) == len(seen)


@pytest.mark.slow
def test_dropout_run_is_bitwise_reproducible():
  for mode in ("shard_map", "auto"):
    seen1, p1 = _dropout_run("data=8", mode)
    seen2, p2 = _dropout_run("data=8", mode)
    assert sorted(m.tobytes() for m in seen1) == sorted(m.tobytes() for m in seen2)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_auto_mode_dropout_is_the_same_under_any_mesh():
  _, p8 = _dropout_run("data=8", "auto")
  _, p2 = _dropout_run("data=2,fsdp=4", "auto")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p8, p2)


def test_key_must_be_a_typed_key():
  with pytest.raises(fnscale.StepError, match="key is .*jax.random.key"):
    fnscale.train_step(lambda p, b, k: 0.0, optax.sgd(0.1), key=jax.random.PRNGKey(0))
