"""fnscale.analysis.compile_fitting and check_fit: a compiled step held against its devices'
memory before it runs, and the planner's options that would fit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.analysis import _trace
from fnscale.analysis import fit_options, profile_model
from fnscale import FitError

from recipes.lm import gpt

GiB = 2**30
RATES = (1e10, 1e9)  # CPU cost-model rates: only the options' order depends on them


def test_tpu_tiles_pad_a_kernel_operands_head_dim_and_drop_unit_dims():
  """What XLA:TPU's buffer assignment held for GPT small's step (12 layers, 8 rows of 1024
  tokens, 12 heads of 64): the splash operands bf16[12,8,12,1024,64] in 288 MiB (head_dim
  in 128 lanes), bf16[12,8,1024,12,64] in 144 MiB (laid out the other way round) and
  f32[12,8,1024,1] in 384 KiB."""
  sds = jax.ShapeDtypeStruct
  mib = 2**20
  assert _trace.tiled_nbytes(sds((12, 8, 12, 1024, 64), jnp.bfloat16)) == 288 * mib
  assert _trace.tiled_nbytes(sds((12, 8, 1024, 12, 64), jnp.bfloat16)) == 144 * mib
  assert _trace.tiled_nbytes(sds((12, 8, 1024, 1), jnp.float32)) == 384 * 1024
  assert _trace.tiled_nbytes(sds((8, 1024, 3072), jnp.bfloat16)) == 48 * mib


def test_step_bytes_counts_what_is_live_by_hand():
  x = jnp.ones((256, 256))  # 256 KiB
  # tanh(x @ x) @ x: the argument, one temporary and the output.
  compiled = jax.jit(lambda x: jnp.tanh(x @ x) @ x).lower(x).compile()
  assert fs.analysis.step_bytes(compiled) == 3 * 2**18
  # A donated argument's buffer is the output's.
  plus = jax.jit(lambda x: x + 1, donate_argnums=0).lower(x).compile()
  assert fs.analysis.step_bytes(plus) == 2**18


def test_check_names_the_bytes_the_memory_and_each_option():
  opts = (fs.analysis.FitOption(True, 1, 16, 5.7 * GiB, 3e4),
          fs.analysis.FitOption(False, 8, 16, 10.3 * GiB, 5e4))
  fs.analysis.check_fit(10 * GiB, 16 * GiB, opts)  # fits: nothing to say
  fs.analysis.check_fit(99 * GiB, None, opts)  # no limit (CPU)
  with pytest.raises(fs.PlanError) as e:
    fs.analysis.check_fit(40.43 * GiB, 15.75 * GiB, opts)
  assert type(e.value) is FitError and isinstance(e.value, ValueError)
  assert (e.value.needed, e.value.limit, e.value.options) == (40.43 * GiB, 15.75 * GiB, opts)
  assert str(e.value) == (
      "the step needs 40.43 GiB per device and the device has 15.75 GiB; fix: remat=True, "
      "accum_steps=1, 16 rows per device: 5.70 GiB; remat=False, accum_steps=8, 16 rows per "
      "device: 10.30 GiB (the planner's estimates)")
  with pytest.raises(FitError, match="no option on this mesh fits"):
    fs.analysis.check_fit(2 * GiB, GiB)


class _Device:  # what fs.analysis.device_memory reads of a jax.Device
  def __init__(self, platform, kind, stats=None):
    self.platform, self.device_kind, self._stats = platform, kind, stats

  def memory_stats(self):
    if self._stats is None:
      raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")
    return self._stats


# `memory_stats()["bytes_limit"]` measured on one TPU v5e chip (jax 0.10.2, libtpu 0.0.42.1).
V5E_BYTES_LIMIT = 16_909_336_576


def test_device_memory_is_the_runtimes_limit_else_the_chips_measured_limit():
  assert fs.analysis.device_memory(jax.devices()[0]) is None  # CPU: no limit
  # A v5e chip attached: its runtime's limit (the 16 GiB chip gives a program 15.75 GiB).
  assert fs.analysis.device_memory(_Device("tpu", "TPU v5 lite", {"bytes_limit": 15.75 * GiB})) == (
      15.75 * GiB)
  # Described for an ahead-of-time compile: no statistics; the limit a v5e chip measured,
  # and for a v5p (not measured) its 95 GiB less the 258 MiB the v5e runtime keeps.
  assert fs.analysis.device_memory(_Device("tpu", "TPU v5 lite")) == V5E_BYTES_LIMIT
  assert fs.analysis.device_memory(_Device("tpu", "TPU v5")) == 95 * GiB - 258 * 2**20
  assert fs.analysis.device_memory(_Device("gpu", "NVIDIA H100 80GB HBM3", {})) == 80e9


def _nano(seq=32):
  cfg = gpt.ModelConfig(layers=2, d_model=64, heads=4, seq=seq)
  return cfg, functools.partial(gpt.init_params, cfg), functools.partial(gpt.loss_fn, cfg=cfg)


def _batch(rows, seq):
  return {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("inputs", "targets")}


def test_fit_options_keep_what_the_user_fixed_and_fit_the_limit():
  cfg, init, loss = _nano()
  prof = profile_model(init, loss, optax.adamw(1e-3), _batch(64, cfg.seq), "cpu",
                       cpu_rates=RATES)
  axes = fs.MeshAxes({"data": 8}, {})  # 8 rows per device
  est = lambda o: fs.analysis.predict(prof._replace(rows=o.rows * 8), "cpu", axes, remat=o.remat,
                                  accum_steps=o.accum_steps, cpu_rates=RATES).estimate.bytes
  plain = est(fs.analysis.FitOption(False, 1, 8, 0, 0))
  limit = plain * 0.7
  opts = fit_options(prof, "cpu", axes, limit, cpu_rates=RATES)
  assert opts and all(o.bytes <= limit and o.bytes == est(o) and o.rows == 8 for o in opts)
  assert {o.remat for o in opts} == {False, True}  # each with the fewest steps that fit
  assert [o.tokens_s for o in opts] == sorted((o.tokens_s for o in opts), reverse=True)
  fixed = fit_options(prof, "cpu", axes, limit, remat=False, cpu_rates=RATES)
  assert [o.remat for o in fixed] == [False] and fixed[0].accum_steps > 1
  # 8 rows fixed and no accumulation: only remat, where it fits; fewer rows only if free.
  assert all(o.remat for o in fit_options(prof, "cpu", axes, limit, accum_steps=1, rows=8,
                                          cpu_rates=RATES))
  halved = fit_options(prof, "cpu", axes, limit, remat=False, accum_steps=1, cpu_rates=RATES)
  assert halved and all(o.rows < 8 for o in halved)
  # Less than the params and optimizer state: nothing fits.
  assert fit_options(prof, "cpu", axes, prof.param_bytes, cpu_rates=RATES) == ()


def test_fit_options_forecast_each_option_as_predict_does_for_the_target():
  """On one v5e chip the options' tokens/s are `predict`'s there, with the chip's own
  forecast terms (`forecast_terms`); they were forecast with the pods' terms."""
  cfg, init, loss = _nano()
  prof = profile_model(init, loss, optax.adamw(1e-3), _batch(64, cfg.seq), "cpu",
                       cpu_rates=RATES)
  one = fs.MeshAxes({"data": 1}, {})
  opts = fit_options(prof, "v5e-1", one, 2**40)
  assert opts and all(o.tokens_s == fs.analysis.predict(
      prof._replace(rows=o.rows), "v5e-1", one, remat=o.remat,
      accum_steps=o.accum_steps).tokens_s for o in opts)


@pytest.mark.slow  # check_fit's and fit_options' quick tests cover the refusal
def test_a_step_over_the_limit_is_refused_before_it_runs_and_its_fix_fits_and_runs():
  """On CPU with a limit given: the plain step's XLA bytes exceed it (FitError naming the
  planner's options, estimated within 90% of the limit, as train_lm asks); the first option
  compiles within the limit and trains."""
  cfg, init, loss = _nano()
  opt, rows = optax.adamw(1e-3), 64
  mesh = fs.make_mesh({"data": 8})
  state = fs.init_state(init, opt, mesh=mesh, rules=gpt.RULES,
                        logical_axes=gpt.logical_axes(cfg), key=jax.random.key(0))
  step = lambda remat, accum: fs.shard_step(
      fs.train_step(functools.partial(loss, remat=remat), opt, accum_steps=accum), mesh,
      rules=gpt.RULES, logical_axes=gpt.logical_axes(cfg))
  batch = _batch(rows, cfg.seq)
  plain = fs.analysis.compile_fitting(step(False, 1), state, batch)  # CPU: no limit, compiles
  limit = fs.analysis.step_bytes(plain) * 0.6
  prof = profile_model(init, loss, opt, batch, "cpu", cpu_rates=RATES)
  options = lambda: fit_options(prof, "cpu", fs.MeshAxes({"data": 8}, {}), 0.9 * limit,
                                cpu_rates=RATES)
  with pytest.raises(FitError) as e:
    fs.analysis.compile_fitting(step(False, 1), state, batch, limit=limit, options=options)
  assert e.value.needed == fs.analysis.step_bytes(plain) and e.value.limit == limit
  best = e.value.options[0]
  assert f"has {limit / 2**20:.2f} MiB" in str(e.value)
  assert f"remat={best.remat}, accum_steps={best.accum_steps}" in str(e.value)
  fixed = fs.analysis.compile_fitting(step(best.remat, best.accum_steps), state, batch, limit=limit)
  assert fs.analysis.step_bytes(fixed) <= limit
  data = np.random.default_rng(0).integers(0, cfg.vocab, (rows, cfg.seq + 1), dtype=np.int32)
  real = fs.global_batch({"inputs": data[:, :-1], "targets": data[:, 1:]},
                         fs.batch_sharding(mesh))
  _, metrics = fixed(state, real)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.tpu
def test_xla_refusing_a_program_as_too_big_is_a_fit_error_with_the_options(tpu_devices):
  """Compiled for one v5e chip, 2048 rows of 1024 tokens overflow its HBM in XLA's own
  compile: a FitError with XLA's figure and the options the planner finds, never the raw
  RESOURCE_EXHAUSTED."""
  del tpu_devices  # skips without libtpu
  devices = fs.target_devices("v5e:1x1")
  cfg, init, loss = _nano(1024)
  opt, batch = optax.adamw(1e-3), _batch(2048, 1024)
  mesh = fs.make_mesh({"data": 1}, devices=devices)
  state = fs.init_state(init, opt, mesh=mesh, rules=gpt.RULES,
                        logical_axes=gpt.logical_axes(cfg), key=jax.random.key(0),
                        abstract=True)
  step = fs.shard_step(fs.train_step(loss, opt), mesh, rules=gpt.RULES,
                       logical_axes=gpt.logical_axes(cfg))
  prof = profile_model(init, loss, opt, batch, "v5e:1x1")
  limit = 16_909_336_576  # what a v5e chip's allocator allows, measured (jax 0.10.2)
  options = lambda: fit_options(prof, "v5e:1x1", fs.MeshAxes({"data": 1}, {}), limit,
                                rows=2048)
  with pytest.raises(FitError) as e:
    fs.analysis.compile_fitting(step, state, batch, options=options)
  assert e.value.limit == limit and e.value.needed > limit
  assert e.value.options and all(o.rows == 2048 and o.bytes <= limit
                                 for o in e.value.options)
  assert "RESOURCE_EXHAUSTED" not in str(e.value)
