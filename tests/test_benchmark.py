"""Smoke test of recipes/benchmark.py and fnscale.flops: the smallest model on 2 devices."""
import os
import sys

import jax
import pytest

import fnscale as fs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes"))
import benchmark as bm  # pylint: disable=g-import-not-at-top,wrong-import-position
import train_lm as tl  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_model_flops_match_train_lm_and_count():
  # nano by hand: 6 * (2 * 12 * 64^2 + 256 * 64) + 12 * 2 * 64 * 128.
  nano = tl.model_config("nano", 128)
  assert tl.flops_per_token(nano) == 6 * 114688 + 196608
  assert bm.model_flops_per_step(nano, 4) == 4 * 128 * (6 * 114688 + 196608)
  assert fs.model_flops_per_token(params=2 * 12 * 64**2 + 256 * 64, layers=2, d_model=64,
                                  seq=128) == 6 * 114688 + 196608
  with pytest.raises(fs.FnscaleError, match="layers=-1"):
    fs.model_flops_per_token(params=1, layers=-1, d_model=1, seq=1)
  assert fs.mfu(1e9, 0.5, 2, 1e9) == pytest.approx(1.0)
  with pytest.raises(fs.FnscaleError, match="step_seconds=0"):
    fs.mfu(1e9, 0, 2, 1e9)


def test_benchmark_rows_and_tables(tmp_path):
  n = 2
  peak = 1e9
  with bm.persistent_cache(str(tmp_path / "cache")):
    rows = [bm.measure("nano", spec, n, batch=4, seq=32, steps=2, warmup=1,
                       peak_per_device=peak) for spec in ("fsdp=-1", "fsdp=-1@shard_map")]
    over = bm.overhead("nano", "data=-1", n, batch=4, seq=32, rounds=4, warmup=1)
  assert jax.config.jax_compilation_cache_dir != str(tmp_path / "cache")  # restored
  auto, smap = rows
  cfg = tl.model_config("nano", 32)
  for r in rows:
    assert r.devices == n and r.step_s > 0 and r.compile_cold_s > 0
    assert r.warm_from_cache, "the warm compile must come from the persistent cache"
    assert r.step_p10_s <= r.step_s <= r.step_p90_s
    assert r.tokens_per_s == pytest.approx(4 * 32 / r.step_s)
    assert r.model_flops == pytest.approx(tl.flops_per_token(cfg) * 4 * 32)
    assert r.mfu == pytest.approx(r.model_flops / r.step_s / (n * peak))
    # XLA's per-device cost analysis, scaled by the device count.
    assert r.xla_flops == pytest.approx(r.xla_flops_per_device * n)
    # FSDP: params per device about 1/N of the total (small LayerNorm leaves stay replicated).
    assert r.param_bytes_total / r.param_bytes == pytest.approx(n, rel=0.05)
    assert r.theory["fsdp"] > 0 and r.wire_bytes > 0 and r.peak_bytes > 0
    # compile_report and the benchmark read the HLO with the same trip-count-aware reader.
    assert {k: v[:2] for k, v in r.report_collectives.items()} == {
        k: v[:2] for k, v in r.collectives.items()}
  # shard_map runs exactly the model's matmuls; auto is either within tolerance or explained.
  assert smap.hlo_dot_flops == pytest.approx(smap.model_flops, rel=1e-6)
  ok, why = bm.flop_check(auto)
  text = bm.tables(rows, [over], peak_note="peak: test", header="test")
  assert ok or ("explained" in why and why in text)
  for field in ("compile cold s", "warm s (cache)", "step ms median", "tokens/s", "MFU",
                "model FLOPs/step", "HLO matmul FLOPs", "XLA cost analysis", "params/dev",
                "temporaries", "sent per step", "textbook", "ratio median"):
    assert field in text
  assert over.max_param_diff < 1e-5 and over.ratio > 0 and over.program_ratio > 0


def test_bad_size_and_flags():
  with pytest.raises(fs.FnscaleError, match="'huge'"):
    bm.model_config("huge", 32)
  with pytest.raises(fs.FnscaleError, match="--steps=0"):
    bm.parse_flags(["benchmark", "--steps=0"])
  with pytest.raises(fs.MeshError, match="16 devices requested"):
    bm._mesh("data=-1", 16)
