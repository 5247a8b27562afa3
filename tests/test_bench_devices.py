"""The benchmarks' defaults follow the devices present: on a one-chip machine
`recipes/bench/step.py` measures 1 device (not 1, 2, 4, 8 and then an error), and the
benchmarks of simulated CPU devices (`pipeline.py`, `context.py`) use the 8 CPU devices they
set up even where jax's default devices are a machine's chips, here one (jax.devices()
answers with one device, as on a one-chip TPU VM; the CPU backend keeps its eight)."""
import math
import subprocess
import sys

import jax
import pytest

import fnscale as fs
from recipes.bench import context as cx
from recipes.bench import pipeline as pl
from recipes.bench import step as bm


@pytest.fixture
def one_chip(monkeypatch):
  """jax's default devices: one, as on a one-chip machine; jax.devices("cpu") unchanged."""
  real = jax.devices
  monkeypatch.setattr(jax, "devices", lambda backend=None: real(backend) if backend
                      else real()[:1])
  monkeypatch.setattr(jax, "device_count", lambda backend=None: len(jax.devices(backend)))
  # On a chip, asking for simulated CPU devices does nothing (fs.simulate_cpu_devices's
  # doc), whether or not jax has started.
  monkeypatch.setattr(fs, "simulate_cpu_devices", lambda n: False)


def test_step_bench_device_counts_are_powers_of_two_up_to_the_devices_present():
  # Hand-listed: 1, 2, 4, ... not above the count, then the count itself.
  assert [bm.device_counts(n) for n in (1, 2, 3, 4, 6, 8)] == [
      (1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 4, 6), (1, 2, 4, 8)]


def test_step_bench_defaults_to_one_device_on_one_chip(one_chip):
  cfg = bm.parse_flags(["step.py", "--sizes=", "--overhead="])
  result = bm.run(cfg, say=lambda s: None)
  assert tuple(result["config"]["devices"]) == (1,)


def test_step_bench_refuses_more_devices_than_present_before_running(one_chip):
  cfg = bm.parse_flags(["step.py", "--devices=1,8", "--overhead=nano:data=-1"])
  with pytest.raises(fs.InputError, match=r"--devices=1,8: 1 device\(s\) present; fix: leave "
                     r"--devices out .* or on CPU --max_devices=8"):
    bm.run(cfg, say=lambda s: None)


def test_pipeline_bench_defaults_to_its_simulated_cpu_devices_beside_one_chip(one_chip, capsys):
  assert pl.main(["--microbatches=4", "--layers=4", "--seq=16", "--batch=1"]) == 0
  out = capsys.readouterr().out
  assert "cpu, mesh {'stage': 4, 'data': 2}" in out
  assert out.count("\n| 4 |") == 1


def test_context_bench_defaults_to_its_simulated_cpu_devices_beside_one_chip(one_chip, capsys):
  assert cx.main(["--figures=traffic", "--seq=32", "--batch=2"]) == 0
  out = capsys.readouterr().out
  assert "cpu, mesh {'data': 2, 'context': 4}" in out
  # The ring form: c - 1 = 3 collective-permutes of one K/V block, the HLO's and the hand's.
  assert "| ring | collective-permute | 3 | 3 |" in out


@pytest.mark.slow
def test_step_bench_on_one_device_runs_its_defaults_to_the_end(tmp_path):
  # A whole process with one device (--max_devices=1, as a one-chip machine has one): the
  # default counts and the overhead comparison on the largest of them.
  r = subprocess.run([sys.executable, "recipes/bench/step.py", "--sizes=", "--max_devices=1",
                      "--overhead_rounds=1", "--warmup=0", "--overhead=nano:data=-1"],
                     cwd=bm.__file__.rsplit("/recipes/", 1)[0], capture_output=True, text=True,
                     timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "| nano | data=1 | 1 |" in r.stdout and "error" not in r.stderr


def test_a_round_whose_host_time_read_zero_is_left_out_of_the_cpu_ratio():
  """On the chip a step's CPU seconds can read 0 (below the clock's resolution): the ratio's
  median leaves those rounds out instead of dividing by zero."""
  assert bm._cpu_ratio([(1.0, 2.0), (3.0, 0.0), (2.0, 1.0), (6.0, 2.0)]) == 2.0
  assert math.isnan(bm._cpu_ratio([(1.0, 0.0)]))
