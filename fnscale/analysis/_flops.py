"""FLOP accounting: transformer FLOPs per token, peak FLOP/s, model FLOPs utilisation (MFU).

MFU follows PaLM (Chowdhery et al., 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B): the FLOPs the model needs per token (forward and backward, no rematerialisation)
times tokens per second, over the hardware's peak FLOP/s. Recomputation and other work the
compiled program adds on top are not credited, so MFU compares setups fairly.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fnscale._errors import InputError

__all__ = ["HostPeak", "host_matmul_peak", "measure_matmul_peak", "mfu", "model_flops_per_token",
           "peak_flops", "usable_cores"]


def model_flops_per_token(*, params: int, layers: int, d_model: int, seq: int) -> float:
  """Training FLOPs per token of a decoder-only transformer, forward + backward.

  `6 * params + 12 * layers * d_model * seq` (PaLM, appendix B): each matmul weight costs 2
  FLOPs per token forward and 4 backward (input and weight gradients); attention's
  `Q K^T` and `A V` cost `2 * 2 * seq * d_model` per token and layer forward, three times that
  with the backward. Causal masking is not subtracted (XLA computes the whole score matrix).

  Args:
    params: weights that multiply activations (blocks plus an output layer, tied or not);
      embedding lookups and learned positions are not matmuls and are left out.
    layers, d_model, seq: the transformer's depth, width and sequence length (tokens).

  Returns:
    FLOPs per token (float).

  Raises:
    InputError: a negative or non-integer argument.

  Examples:
    GPT-2 small (124M matmul params, 12 layers of width 768) over 1024-token rows:

    >>> import fnscale as fs
    >>> fs.analysis.model_flops_per_token(params=124_000_000, layers=12, d_model=768, seq=1024)
    857246208.0
  """
  for name, v in (("params", params), ("layers", layers), ("d_model", d_model), ("seq", seq)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise InputError(f"model_flops_per_token: {name}={v!r}, expected an int >= 0.")
  return 6.0 * params + 12.0 * layers * d_model * seq


def peak_flops(topology=None) -> float | None:
  """Peak dense bf16 FLOP/s of one device from the topology's facts table, or None.

  Args:
    topology: a `fnscale.Topology` (default `fnscale.detect_topology()`).

  Returns:
    FLOP/s per JAX device (a TPU chip with two cores counts per core), or None on CPU and
    for device kinds fnscale has no figure for (use `measure_matmul_peak` there).

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.peak_flops(fs.detect_topology()) is None  # CPU: no vendor figure
    True
    >>> v5e = fs.detect_topology("v5e-8", devices=fs.target_devices("v5e-8"), env={})
    >>> fs.analysis.peak_flops(v5e) / 1e12  # TFLOP/s per chip (the tpu extra describes it)
    197.0
  """
  if topology is None:
    from fnscale._topology import detect_topology  # pylint: disable=g-import-not-at-top
    topology = detect_topology()
  return topology.peak_flops_per_device


def measure_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 10,
                        device=None, clock: str = "wall") -> float:
  """Measured FLOP/s of an `n x n` matmul on one device: `2 n^3` / the fastest of `repeats`.

  The MFU denominator on CPU, where no vendor peak applies. XLA's CPU matmul uses every core
  of the host, so on simulated CPU devices this is the whole host's rate, shared by all of
  them. Each run is synchronized, after one warm-up. The fastest run (not the median) is the
  peak: other work on the machine only ever slows a run down, so the best of several is the
  figure least disturbed by load at the moment of measuring (as `timeit` advises).

  With `clock="cpu"` each run is timed in this process's CPU seconds (all its threads,
  `time.process_time`) and the rate per CPU-second is multiplied by the cores the process may
  run on: the host's peak as if nothing else ran. Other jobs take wall time from a run, not
  CPU time, so under load the wall-clock figure reads low (and an MFU over it high, since a
  training step's many threads win a larger share of the cores than one matmul's); the CPU
  clock keeps the peak, and load then lowers the MFU instead.

  Args:
    n: matrix side (FLOPs per run: 2 n^3).
    dtype: element type (float32: XLA's CPU bfloat16 matmul is slower).
    repeats: timed runs; the fastest counts.
    device: where to run (default the first local device).
    clock: "wall" (seconds elapsed) or "cpu" (CPU seconds x usable cores; for CPU devices).

  Returns:
    FLOP/s (float).

  Raises:
    InputError: n or repeats below 1, or an unknown clock.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.measure_matmul_peak(n=128, repeats=2) > 1e6  # FLOP/s of this host
    True
  """
  if isinstance(n, bool) or isinstance(repeats, bool) or not isinstance(n, int) or (
      not isinstance(repeats, int)) or n < 1 or repeats < 1:
    raise InputError(f"measure_matmul_peak: n={n!r}, repeats={repeats!r}; both must be "
                       "ints >= 1.")
  if clock not in ("wall", "cpu"):
    raise InputError(f"measure_matmul_peak: clock={clock!r}; expected 'wall' or 'cpu'.")
  timer = time.perf_counter if clock == "wall" else time.process_time
  device = device or jax.local_devices()[0]
  x = jax.device_put(jnp.ones((n, n), dtype), device)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t = timer()
    f(x).block_until_ready()
    best = min(best, timer() - t)
  cores = 1 if clock == "wall" else usable_cores()
  return 2.0 * n**3 * cores / max(best, 1e-12)


class HostPeak(NamedTuple):
  """A CPU host's matmul peak: `flops` (FLOP/s, the whole host), `measured` (when, ISO 8601
  UTC), `path` (the cache file holding it; None: not cached) and `fresh` (measured by this
  call).

  Examples:
    >>> import fnscale as fs, tempfile
    >>> with tempfile.TemporaryDirectory() as cache:
    ...   peak = fs.analysis.host_matmul_peak(cache, measure=lambda: 5e10)
    >>> type(peak).__name__, peak.flops, peak.fresh, peak.path.endswith("cpu_peak.json")
    ('HostPeak', 50000000000.0, True, True)
  """
  flops: float
  measured: str
  path: str | None
  fresh: bool


def _cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fnscale")


def _machine_key() -> str:
  """What the peak belongs to: the host, its CPU model, the cores this process may use and the
  jax version (its XLA compiles the matmul)."""
  model = ""
  if os.path.isfile("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), "")
  return f"{platform.node()} | {model or platform.processor()} | {usable_cores()} cores | " \
         f"jax {jax.__version__}"


def host_matmul_peak(cache_dir: str | None = None, *, rounds: int = 3,
                     measure: Callable[[], float] | None = None) -> HostPeak:
  """This CPU host's matmul peak, measured once per machine and kept on disk: a stable MFU
  denominator for CPU runs (a peak measured per run varies with the load of the moment).

  The measurement is the best of `rounds` calls of `measure_matmul_peak(clock="cpu")` (each
  the fastest of 10 runs, in CPU seconds x usable cores), written to `cache_dir/cpu_peak.json`
  under a key naming the host, CPU model, usable cores and jax version; later calls on the
  same machine read it back. A cache that can't be written leaves the figure measured, not
  cached (`path` None).

  Args:
    cache_dir: where the cache file lives (default `$XDG_CACHE_HOME/fnscale`, else
      `~/.cache/fnscale`).
    rounds: measurements whose best is kept (>= 1).
    measure: the measurement (default `measure_matmul_peak(clock="cpu")`), FLOP/s.

  Returns:
    A `HostPeak`.

  Raises:
    InputError: rounds below 1.

  Examples:
    Measured once (here a stand-in measurement), then read back from the cache:

    >>> import fnscale as fs, tempfile
    >>> with tempfile.TemporaryDirectory() as cache:
    ...   first = fs.analysis.host_matmul_peak(cache, rounds=2, measure=lambda: 5e10)
    ...   again = fs.analysis.host_matmul_peak(cache, measure=lambda: 1.0)
    >>> first.fresh, again.flops, again.fresh
    (True, 50000000000.0, False)
  """
  if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
    raise InputError(f"host_matmul_peak: rounds={rounds!r}, expected an int >= 1.")
  path = os.path.join(cache_dir or _cache_dir(), "cpu_peak.json")
  key, known = _machine_key(), {}
  try:
    with open(path, encoding="utf-8") as f:
      known = json.load(f)
  except (OSError, ValueError):
    pass  # no cache yet, or an unreadable one: measured afresh below
  got = known.get(key) if isinstance(known, dict) else None
  if isinstance(got, dict) and isinstance(got.get("flops"), (int, float)) and got["flops"] > 0:
    return HostPeak(float(got["flops"]), str(got.get("measured", "")), path, False)
  measure = measure or (lambda: measure_matmul_peak(clock="cpu"))
  peak = max(measure() for _ in range(rounds))
  when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + f".{os.getpid()}.tmp", "w", encoding="utf-8") as f:
      json.dump({**(known if isinstance(known, dict) else {}),
                 key: {"flops": peak, "measured": when}}, f, indent=1)
    os.replace(path + f".{os.getpid()}.tmp", path)
  except OSError:
    return HostPeak(peak, when, None, True)
  return HostPeak(peak, when, path, True)


def usable_cores() -> int:
  """The CPU cores this process may run on: its affinity mask where the OS has one (Linux),
  else `os.cpu_count()`.

  Examples:
    >>> import fnscale as fs, os
    >>> 1 <= fs.analysis.usable_cores() <= os.cpu_count()
    True
  """
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def mfu(flops_per_step: float, step_seconds: float, num_devices: int,
        peak_flops_per_device: float) -> float:
  """Model FLOPs utilisation: `flops_per_step / step_seconds / (num_devices * peak)`.

  Args:
    flops_per_step: model FLOPs of one step (e.g. `model_flops_per_token * tokens`).
    step_seconds: wall time of one step.
    num_devices: devices running the step.
    peak_flops_per_device: peak FLOP/s of one device.

  Returns:
    A fraction (0.4 means 40%).

  Raises:
    InputError: a non-positive time, device count or peak.

  Examples:
    4e14 model FLOPs in half a second on 4 devices of 1 PFLOP/s each:

    >>> import fnscale as fs
    >>> fs.analysis.mfu(4e14, step_seconds=0.5, num_devices=4, peak_flops_per_device=1e15)
    0.2
  """
  if step_seconds <= 0 or num_devices < 1 or not peak_flops_per_device or (
      peak_flops_per_device <= 0):
    raise InputError(
        f"mfu: step_seconds={step_seconds}, num_devices={num_devices}, "
        f"peak_flops_per_device={peak_flops_per_device}; all must be positive.")
  return flops_per_step / step_seconds / (num_devices * peak_flops_per_device)
