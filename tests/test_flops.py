"""fnscale.analysis's FLOP counts (fnscale.analysis._flops) against hand counts and a controlled clock."""
import dataclasses
import itertools
import json
import math

import pytest

import fnscale as fs
from fnscale.analysis import _flops as flops
from fnscale import FnscaleError


def test_model_flops_per_token_by_hand():
  # GPT-2 small at seq 1024: 12 layers, d 768, 12 d^2 per block + a 50257 x 768 output layer.
  n = 12 * 12 * 768**2 + 50257 * 768
  assert n == 123_532_032
  assert flops.model_flops_per_token(params=n, layers=12, d_model=768, seq=1024) == (
      741_192_192 + 113_246_208)
  # Each term alone: 6 per weight; 12 per layer, width and position.
  assert flops.model_flops_per_token(params=1, layers=0, d_model=0, seq=0) == 6.0
  assert flops.model_flops_per_token(params=0, layers=1, d_model=1, seq=1) == 12.0
  assert flops.model_flops_per_token(params=0, layers=2, d_model=3, seq=5) == 360.0
  assert flops.model_flops_per_token(params=0, layers=0, d_model=0, seq=0) == 0.0


@pytest.mark.parametrize("name", ["params", "layers", "d_model", "seq"])
@pytest.mark.parametrize("bad", [-1, 2.0, True, "8", None])
def test_model_flops_per_token_rejects_each_bad_argument(name, bad):
  kw = {**dict(params=1, layers=1, d_model=1, seq=1), name: bad}
  with pytest.raises(fs.FnscaleError, match=rf"model_flops_per_token: {name}={bad!r}, "
                     r"expected an int >= 0\."):
    flops.model_flops_per_token(**kw)


def test_mfu_by_hand():
  # 1.2e15 FLOPs per step in 2 s on 4 devices of 300 TFLOP/s: 6e14 / 1.2e15 = 50%.
  assert flops.mfu(1.2e15, 2.0, 4, 300e12) == pytest.approx(0.5, rel=1e-12)
  assert flops.mfu(1e9, 0.5, 2, 1e9) == pytest.approx(1.0, rel=1e-12)
  assert flops.mfu(3e9, 1.0, 1, 1e9) == pytest.approx(3.0, rel=1e-12)


@pytest.mark.parametrize("args", [(1e9, 0, 1, 1e9), (1e9, -1.0, 1, 1e9), (1e9, 1.0, 0, 1e9),
                                  (1e9, 1.0, 1, 0), (1e9, 1.0, 1, -5.0), (1e9, 1.0, 1, None)])
def test_mfu_rejects_non_positive_inputs(args):
  with pytest.raises(fs.FnscaleError, match=(
      rf"mfu: step_seconds={args[1]}, num_devices={args[2]}, "
      rf"peak_flops_per_device={args[3]}; all must be positive\.")):
    flops.mfu(*args)


def test_mfu_accepts_the_smallest_valid_inputs():
  assert flops.mfu(1.0, 1e-9, 1, 1e-9) == pytest.approx(1e18)


def test_peak_flops_reads_the_topology():
  topo = fs.detect_topology(env={})
  assert topo.platform == "cpu" and flops.peak_flops(topo) is None
  assert flops.peak_flops() is None  # default: this machine's topology (CPU: no figure)
  v5p = dataclasses.replace(topo, peak_flops_per_device=229.5e12)
  assert flops.peak_flops(v5p) == 229.5e12


def test_measure_matmul_peak_is_2n3_over_the_fastest_time(monkeypatch):
  # A clock whose synchronized runs take 1, 4 and 2 s (after the warm-up). Load only ever slows
  # a run, so the fastest (1 s) is the peak; a median (2 s) or mean would report less.
  ticks = itertools.chain([0.0, 1.0, 10.0, 14.0, 20.0, 22.0], itertools.repeat(100.0))
  monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
  assert flops.measure_matmul_peak(n=8, repeats=3) == 2.0 * 8**3 / 1.0
  # The smallest valid call: one 1x1 product timed once (4 s on this clock).
  ticks = itertools.chain([0.0, 4.0], itertools.repeat(100.0))
  assert flops.measure_matmul_peak(n=1, repeats=1) == 2.0 / 4.0


def test_measure_matmul_peak_on_the_cpu_clock_counts_cpu_seconds_times_cores(monkeypatch):
  # A loaded host: each run takes 5 s of wall time but 2, 1.5 and 3 CPU-seconds of this
  # process (the rest went to other jobs). The CPU clock's peak is the fastest run's rate per
  # CPU-second times the 4 usable cores; the wall clock would read 2 n^3 / 5 s.
  cpu = itertools.chain([0.0, 2.0, 10.0, 11.5, 20.0, 23.0], itertools.repeat(100.0))
  wall = itertools.count(0.0, 5.0)
  monkeypatch.setattr(flops.time, "process_time", lambda: next(cpu))
  monkeypatch.setattr(flops.time, "perf_counter", lambda: next(wall))
  monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
  assert flops.measure_matmul_peak(n=8, repeats=3, clock="cpu") == 2.0 * 8**3 * 4 / 1.5
  assert flops.measure_matmul_peak(n=8, repeats=3) == 2.0 * 8**3 / 5.0
  with pytest.raises(FnscaleError, match="clock='gpu'; expected 'wall' or 'cpu'"):
    flops.measure_matmul_peak(n=8, clock="gpu")


def test_measure_matmul_peak_places_its_operand_as_asked(monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  placed = []
  real = flops.jax.device_put
  monkeypatch.setattr(flops.jax, "device_put",
                      lambda x, device: placed.append((x.shape, x.dtype, device)) or
                      real(x, device))
  flops.measure_matmul_peak(n=4, repeats=1)  # default: this process's first device
  flops.measure_matmul_peak(n=4, repeats=1, dtype=jnp.bfloat16, device=jax.devices()[3])
  assert placed == [((4, 4), jnp.float32, jax.local_devices()[0]),
                    ((4, 4), jnp.bfloat16, jax.devices()[3])]


def test_measure_matmul_peak_defaults_time_ten_2048_matmuls(monkeypatch):
  # A stand-in for the compiled matmul records what it is given; the clock starts at 7 s and
  # each tick is 0.5 s, so a run's time is a difference of readings (not a sum: 14.5 s, ...).
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  runs = []

  class _Result:
    def block_until_ready(self):
      return self

  monkeypatch.setattr(flops.jax, "jit", lambda fn: lambda a: runs.append((a.shape, a.dtype))
                      or _Result())
  ticks = itertools.count(7.0, 0.5)
  monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
  rate = flops.measure_matmul_peak()
  assert runs == [((2048, 2048), jnp.float32)] * 11  # one warm-up, then 10 timed runs
  assert rate == 2.0 * 2048**3 / 0.5


def test_measure_matmul_peak_runs_the_matmul():
  rate = flops.measure_matmul_peak(n=64, repeats=1)
  assert math.isfinite(rate) and rate > 0


@pytest.mark.parametrize("kw", [dict(n=0), dict(repeats=0), dict(n=-3, repeats=2), dict(n=2.5),
                                dict(repeats=True), dict(n=True), dict(repeats=2.5)])
def test_measure_matmul_peak_rejects_sizes_below_one(kw):
  full = {**dict(n=8, repeats=1), **kw}
  with pytest.raises(fs.FnscaleError, match=rf"measure_matmul_peak: n={full['n']!r}, "
                     rf"repeats={full['repeats']!r}; both must be ints >= 1\."):
    flops.measure_matmul_peak(**full)


def test_host_matmul_peak_is_the_best_measurement_kept_once_per_machine(tmp_path, monkeypatch):
  runs = iter([150e9, 490e9, 280e9, 999e9])  # three runs on a loaded machine, then a fourth
  calls = []
  measure = lambda: calls.append(1) or next(runs)
  first = flops.host_matmul_peak(str(tmp_path), measure=measure)
  assert first.flops == 490e9 and first.fresh and len(calls) == 3  # the best of 3 rounds
  assert first.path == str(tmp_path / "cpu_peak.json")
  again = flops.host_matmul_peak(str(tmp_path), measure=measure)  # another run: read back
  assert (again.flops, again.measured, again.fresh, len(calls)) == (490e9, first.measured,
                                                                    False, 3)
  # Another machine (here: fewer usable cores) measures its own and keeps both.
  monkeypatch.setattr(flops, "usable_cores", lambda: 1)
  other = flops.host_matmul_peak(str(tmp_path), rounds=1, measure=measure)
  assert other.flops == 999e9 and other.fresh and len(calls) == 4
  assert len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2
  # A cache that can't be written: measured, said so (path None).
  blocked = tmp_path / "file"
  blocked.write_text("")
  alone = flops.host_matmul_peak(str(blocked), rounds=1, measure=lambda: 7e9)
  assert (alone.flops, alone.path, alone.fresh) == (7e9, None, True)
  with pytest.raises(fs.InputError, match="rounds=0"):
    flops.host_matmul_peak(str(tmp_path), rounds=0)
