"""fnscale.flops.measure_matmul_peak: the best of several runs, so load at start-up can't
inflate MFU."""
import time

import pytest

import fnscale as fs
from fnscale import flops


def test_matmul_peak_is_the_fastest_run_not_the_median(monkeypatch):
  # Three timed runs of 2 s, 0.5 s and 4 s (a busy machine slows some of them): the peak is
  # 2 n^3 / 0.5 s. A median (2 s) or a mean would report a quarter of that or less.
  ticks = iter([0.0, 2.0, 10.0, 10.5, 20.0, 24.0])
  real = time.perf_counter
  calls = []

  def clock():
    calls.append(1)
    return next(ticks)

  jax_warm = flops.measure_matmul_peak(n=8, repeats=1)  # compile outside the fake clock
  assert jax_warm > 0
  monkeypatch.setattr(flops.time, "perf_counter", clock)
  try:
    peak = flops.measure_matmul_peak(n=8, repeats=3)
  finally:
    monkeypatch.setattr(flops.time, "perf_counter", real)
  assert len(calls) == 6
  assert peak == 2 * 8**3 / 0.5


@pytest.mark.parametrize("kw", [dict(n=0), dict(repeats=0), dict(n=2.5), dict(repeats=True)])
def test_matmul_peak_bad_arguments_are_named(kw):
  name, value = next(iter(kw.items()))
  with pytest.raises(fs.FnscaleError, match=rf"{name}={value!r}.*both must be ints >= 1"):
    flops.measure_matmul_peak(**kw)
