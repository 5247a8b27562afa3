"""Gradient accumulation reduces the gradient once per step, after the microbatches, and
gathers FSDP params once per step unless accum_gather="per_microbatch" says otherwise.

Collectives are read from the compiled program (`compile_report`); the reference is the
hand count: the gradient all-reduce carries the params' bytes (f32), once per step.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from recipes import bench_accumulation as bench

D, M, L, B = 64, 256, 2, 256
PARAM_BYTES = L * 2 * D * M * 4  # f32 w1 [D, M] and w2 [M, D] per layer


# The residual MLP of recipes/bench_accumulation.py, smaller.
_init = functools.partial(bench.init_mlp, d=D, m=M, layers=L)
_loss = bench.mlp_loss


@functools.lru_cache(maxsize=None)
def _report(devices, accum, gather):
  mesh = fs.make_mesh({"fsdp": 8}, devices=list(devices) if devices else None)
  opt = optax.sgd(0.1)
  state = fs.init_state(_init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((B, D), jnp.float32)}
  step = fs.train_step(_loss, opt, accum_steps=accum, accum_gather=gather)
  return fs.compile_report(fs.shard_step(step, mesh), state, batch)


def test_gradient_reduced_once_after_the_microbatches_cpu():
  one, four = _report(None, 1, "once"), _report(None, 4, "once")
  ar1, ar4 = one.collective("all-reduce"), four.collective("all-reduce")
  # The gradients (PARAM_BYTES) plus the f32 loss: no per-microbatch reduction.
  assert PARAM_BYTES <= ar4.bytes <= PARAM_BYTES + 16
  assert ar4.bytes <= ar1.bytes and ar4.count <= ar1.count
  # Params gathered once per step, as without accumulation.
  assert four.collective("all-gather").bytes == one.collective("all-gather").bytes


def test_per_microbatch_is_the_documented_trade_off_cpu():
  # GSPMD partitions the loop body: the gradient is reduced inside it, every microbatch.
  per = _report(None, 4, "per_microbatch").collective("all-reduce")
  once = _report(None, 4, "once").collective("all-reduce")
  assert per.count >= 4 * once.count


@pytest.mark.tpu
def test_accumulation_collectives_tpu_v5p(tpu_devices):
  devices = tuple(tpu_devices("v5p:2x2x2"))
  one, four = _report(devices, 1, "once"), _report(devices, 4, "once")
  per = _report(devices, 4, "per_microbatch")
  assert PARAM_BYTES <= four.collective("all-reduce").bytes <= PARAM_BYTES + 16
  ag1, ag4, agp = (r.collective("all-gather") for r in (one, four, per))
  assert ag1.bytes > 0 and ag4.bytes == ag1.bytes and ag4.count == ag1.count
  assert agp.count == 4 * ag1.count  # params re-gathered in every microbatch
  assert per.collective("all-reduce").count >= 4 * four.collective("all-reduce").count


@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
def test_accumulated_step_equals_full_batch_step(gather):
  mesh = fs.make_mesh("data=2,fsdp=4")
  opt = optax.sgd(0.5)
  batch = {"x": jax.random.normal(jax.random.key(3), (64, D))}
  out = {}
  for accum in (1, 4):
    state = fs.init_state(_init, opt, mesh=mesh, key=jax.random.key(0))
    step = fs.shard_step(fs.train_step(_loss, opt, accum_steps=accum, accum_gather=gather),
                         mesh)
    state, metrics = step(state, batch)
    out[accum] = (jax.device_get(state.params), float(metrics["loss"]))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
               out[4][0], out[1][0])
  assert out[4][1] == pytest.approx(out[1][1], rel=1e-5)


def test_accum_gather_is_checked():
  with pytest.raises(fs.StepError, match=r"^accum_gather='twice', expected one of \('once', "
                     r"'per_microbatch'\)\.$"):
    fs.train_step(_loss, optax.sgd(0.1), accum_gather="twice")
