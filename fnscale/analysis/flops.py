"""FLOP accounting: transformer FLOPs per token, peak FLOP/s, model FLOPs utilisation (MFU).

MFU follows PaLM (Chowdhery et al., 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B): the FLOPs the model needs per token (forward and backward, no rematerialisation)
times tokens per second, over the hardware's peak FLOP/s. Recomputation and other work the
compiled program adds on top are not credited, so MFU compares setups fairly.
"""
from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp

from fnscale.errors import InputError

__all__ = ["measure_matmul_peak", "mfu", "model_flops_per_token", "peak_flops", "usable_cores"]


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
  """
  if topology is None:
    from fnscale.topology import detect_topology  # pylint: disable=g-import-not-at-top
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


def usable_cores() -> int:
  """The CPU cores this process may run on: its affinity mask where the OS has one (Linux),
  else `os.cpu_count()`."""
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
  """
  if step_seconds <= 0 or num_devices < 1 or not peak_flops_per_device or (
      peak_flops_per_device <= 0):
    raise InputError(
        f"mfu: step_seconds={step_seconds}, num_devices={num_devices}, "
        f"peak_flops_per_device={peak_flops_per_device}; all must be positive.")
  return flops_per_step / step_seconds / (num_devices * peak_flops_per_device)
