"""The planner's forecast: its formula by hand, and its fit to MaxText's published v5p runs."""

import math

import pytest

from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _targets
from recipes.bench import forecast_fit as ff

# MaxText's v5p table, github.com/AI-Hypercomputer/maxtext, MaxText/configs/v5p/README.md at
# commit 76bd53b0f44caf989c88189afadeb1062f9254f0 (unchanged at e591f30cb, now
# src/maxtext/configs/tpu/v5p/README.md): model, hardware, MFU (percent). The run's
# configuration beside it, from 32b.sh ... 1024b.sh of the same commit: per_device_batch_size,
# ici_tensor_parallelism, remat_policy (FSDP over the rest of a slice, sequence 2048).
V5P_TABLE = [
    (32, "1x v5p-128", 71.47, 8, 4, "minimal"), (32, "2x v5p-128", 69.43, 8, 4, "minimal"),
    (64, "1x v5p-128", 70.31, 4, 4, "minimal"), (64, "2x v5p-128", 67.26, 4, 4, "minimal"),
    (128, "1x v5p-256", 68.68, 2, 8, "minimal"), (128, "2x v5p-256", 66.34, 2, 8, "minimal"),
    (128, "1x v5p-512", 68.83, 2, 8, "minimal"), (128, "2x v5p-512", 59.66, 2, 8, "minimal"),
    (256, "1x v5p-1024", 67.09, 2, 8, "minimal"), (256, "2x v5p-1024", 62.99, 2, 8, "minimal"),
    (512, "1x v5p-1024", 63.99, 2, 16, "full"), (512, "2x v5p-1024", 61.45, 2, 16, "full"),
    (1024, "1x v5p-2048", 55.35, 2, 16, "full"), (1024, "2x v5p-2048", 51.55, 2, 16, "full"),
    (1024, "1x v5p-4096", 64.80, 2, 16, "full"), (1024, "2x v5p-4096", 60.83, 2, 16, "full"),
]


# The two-slice rows are `slow`: the single-slice rows run the same fit on every model size.
@pytest.mark.parametrize("scale,target,mfu,batch,tensor,remat", [
    pytest.param(*row, marks=pytest.mark.slow) if row[1].startswith("2x") else row
    for row in V5P_TABLE])
def test_the_fit_is_within_5_points_of_every_run_of_maxtexts_v5p_table(
    scale, target, mfu, batch, tensor, remat):
  run = ff.Run("v5p", f"{scale}B", ff.scaled(scale), target.removeprefix("1x "), batch, 2048,
               tensor, remat, mfu, "2023")
  got = ff.predict_run(run)
  assert abs(got.mfu - mfu) <= 5.0, (target, scale, got.mfu)
  assert got.mfu < got.bound  # the forecast stays below the roofline


def test_the_recipe_fits_on_the_v5p_table_and_checks_on_the_rest():
  assert [(r.target, r.mfu) for r in ff.FIT_RUNS] == [
      (t.removeprefix("1x "), m) for _, t, m, *_ in V5P_TABLE]
  assert {r.table for r in ff.FIT_RUNS} == {"v5p"}
  assert not {r.table for r in ff.HELD_OUT_RUNS} & {"v5p"}


@pytest.mark.parametrize("scale,params_b", [(16, 16), (32, 32), (64, 64), (128, 128),
                                            (256, 256), (512, 512), (1024, 1024)])
def test_maxtexts_scaled_shapes_have_the_sizes_the_tables_name(scale, params_b):
  """global_parameter_scale 32 is MaxText's "32B": 2 x 16 layers, d 2560 x 4, 8 x 4 heads of
  256, MLP 8192 x 4. Each size's params (q, k, v, o, two MLP matrices per layer, the tied
  embedding) land within 10% of the name."""
  s = ff.scaled(scale)
  if scale == 32:
    assert s == ff.Shape(layers=32, d_model=10240, heads=32, d_mlp=32768)
  hq = s.heads * s.head_dim
  params = s.layers * (4 * s.d_model * hq + 2 * s.d_model * s.d_mlp) + s.vocab * s.d_model
  assert params / 1e9 == pytest.approx(params_b, rel=0.1)


def _profile(**kw):
  base = dict(params=10**9, param_bytes=4e9, opt_bytes=8e9, compute_bytes=2e9, grad_bytes=4e9,
              flops_row=6e12, flops_row_remat=8e12, act_row=1e9, act_row_remat=1e8,
              layers=10, stream_row=1e6, rows=64, has_remat=True, attn_row=1.2e12,
              attn_row_remat=1.6e12, causal_share=1.0, attn_kernel=True, tokens_row=1000)
  return _cost.Profile(**{**base, **kw})


def test_the_forecast_by_hand():
  prof = _profile()
  hw = _targets.Hardware("t", "tpu", "v5p", 2, 8, (2, 2, 2), False, 1e14, 95 * 2**30,
                         _targets.LinkFacts(1e11, 1e10, 1e12))
  terms = _forecast.Terms(matmul=0.5, exposed=0.25, per_doubling=0.1)
  for remat in (False, True):
    est = _cost.estimate(prof, hw, {"fsdp": 8}, {"replica": 2}, remat, 2)
    # Executed FLOPs: the kernel skips half of the causal attention (with remat's too).
    run = (8e12 - 0.8e12) if remat else (6e12 - 0.6e12)
    recompute = (8e12 - 0.8e12) - (6e12 - 0.6e12) if remat else 0.0
    n = 16
    first = (run - recompute) * 64 / n / 1e14
    assert est.recompute_s == pytest.approx(recompute * 64 / n / 1e14)
    late = max(0.25 * est.comm_s["fsdp"], est.recompute_s / 0.5)
    want = (first / 0.5 + est.memory_s + late) * (1 + 0.1 * math.log2(2))
    f = _forecast.forecast(prof, hw, est, {"replica": 2}, terms=terms)
    assert f.step_s == pytest.approx(max(want, est.step_s))
    assert f.tokens_s == pytest.approx(64 * 1000 / f.step_s)
    assert f.mfu == pytest.approx(6e12 * 64 / (f.step_s * n * 1e14))


def test_the_forecast_is_never_faster_than_the_roofline():
  prof = _profile()
  hw = _targets.Hardware("t", "tpu", "v5p", 1, 8, (2, 2, 2), False, 1e14, 95 * 2**30,
                         _targets.LinkFacts(1e6, 1e10, 1e12))  # collectives dominate
  est = _cost.estimate(prof, hw, {"fsdp": 8}, {}, False, 1)
  f = _forecast.forecast(prof, hw, est, {}, terms=_forecast.Terms(1.0, 0.0, 0.0))
  assert est.step_s > est.compute_s and f.step_s == est.step_s


def test_on_cpu_the_forecast_is_the_measured_cost_model():
  prof = _profile(attn_kernel=False)
  hw = _targets.cpu_hardware(1e11, 1e10, devices=list(range(8)))
  est = _cost.estimate(prof, hw, {"fsdp": 8}, {}, True, 1)
  assert _forecast.forecast(prof, hw, est, {}).step_s == est.step_s
