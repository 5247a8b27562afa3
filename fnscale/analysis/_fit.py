"""Memory pre-flight: a compiled step held against its devices' memory before it runs.

A step whose buffers exceed a device's HBM fails at its first call (or in XLA's compile, with
a RESOURCE_EXHAUSTED status and a figure, but no fix). `compile_fitting` compiles a step and
compares XLA's peak bytes per device (`step_bytes`) with the device's memory
(`device_memory`): a step that does not fit raises a `FitError` naming the bytes it needs,
the bytes there are and the options that would fit, each with the planner's estimate
(`fnscale.analysis.fit_options`: remat, accumulation steps, rows per device, on the
same mesh). Nothing runs on the device.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from fnscale import _compat
from fnscale import _deprecation
from fnscale._topology import device_memory
from fnscale._errors import FitError

__all__ = ["FitOption", "check_fit", "compile_fitting", "device_memory", "step_bytes"]

GiB = 2**30


class FitOption(NamedTuple):
  """One way to run a step on a fixed mesh (`fnscale.analysis.fit_options`): `remat`,
  `accum_steps`, `rows` (per data-parallel device per step), `bytes` (per device, the
  planner's estimate) and `tokens_s` (the forecast's tokens/s of the job).

  Examples:
    >>> import fnscale as fs
    >>> option = fs.analysis.FitOption(remat=True, accum_steps=2, rows=16, bytes=12e9,
    ...                                tokens_s=4e4)
    >>> fs.analysis.check_fit(20 * 2**30, 16 * 2**30, options=[option])
    Traceback (most recent call last):
    ...
    fnscale.FitError: the step needs 20.00 GiB ... fix: remat=True, accum_steps=2, 16 rows per device: 11.18 GiB (the planner's estimates)
  """
  remat: bool
  accum_steps: int
  rows: int
  bytes: float
  tokens_s: float

  accum = _deprecation.renamed_field("FitOption", "accum", "accum_steps")


def _platform(compiled) -> str:
  """The platform a `jax.stages.Compiled` runs on (its first input's devices; the default
  backend for a program without inputs)."""
  shardings = jax.tree.leaves(compiled.input_shardings)
  return next(iter(shardings[0].device_set)).platform if shardings else jax.default_backend()


def step_bytes(compiled) -> float:
  """XLA's peak bytes per device of a compiled program (`jax.stages.Compiled` or a
  `fnscale.CompiledStep`): `memory_analysis().peak_memory_in_bytes`, the most its buffers
  hold at once (the figure XLA:TPU's own out-of-memory check uses); on CPU, whose peak
  leaves the temporaries out, where a backend reports none, and for a program holding
  buffers in the host's memory (whose peak counts them), the device's arguments + outputs +
  temporaries - aliased (an upper bound: temporaries never live together count together).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x @ x.T).lower(jnp.ones((256, 128))).compile()
    >>> fs.analysis.step_bytes(compiled) >= (256 * 128 + 256 * 256) * 4  # argument + output
    True
  """
  compiled = getattr(compiled, "compiled", compiled)
  m = compiled.memory_analysis()
  peak = float(getattr(m, "peak_memory_in_bytes", 0) or 0)
  # A program with buffers in the host's memory (an offloaded optimizer state): XLA's peak
  # counts those too (the 1B Llama's offloaded step: 23.0 GiB, 12.7 of them on the chip).
  host = sum(float(getattr(m, f"host_{k}_size_in_bytes", 0) or 0) for k in ("argument", "temp"))
  if peak and _platform(compiled) != "cpu" and not host:
    return peak
  return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def _size(nbytes: float) -> str:
  return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"


def _describe(o: FitOption) -> str:
  return (f"remat={o.remat}, accum_steps={o.accum_steps}, {o.rows} rows per device: "
          f"{_size(o.bytes)}")


def _error(needed: float, limit: float | None, options: Sequence[FitOption],
           what: str) -> FitError:
  options = tuple(options)
  fix = ("; ".join(_describe(o) for o in options[:4]) + " (the planner's estimates)"
         if options else "a smaller batch per device, remat or gradient accumulation (no "
         "option on this mesh fits by the planner's estimate: more devices, or a smaller model)")
  has = f"the device has {_size(limit)}" if limit else "XLA found it too big"
  return FitError(f"{what} needs {_size(needed)} per device and {has}; fix: {fix}",
                  needed=needed, limit=limit, options=options)


def check_fit(needed: float, limit: float | None, options: Sequence[FitOption] = (),
              what: str = "the step") -> None:
  """Raises `FitError` if `needed` bytes per device exceed `limit` (None: no limit).

  Args:
    needed: bytes per device (`step_bytes`, or XLA's out-of-memory figure).
    limit: the device's bytes (`device_memory`), or None.
    options: what would fit (`fit_options`), best first; the first four are named.
    what: the thing that needs the bytes, for the message.

  Raises:
    FitError: `needed` > `limit`; its message and fields (`needed`, `limit`, `options`)
      give the bytes, the memory and the options.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.check_fit(10 * 2**30, 16 * 2**30)  # fits: nothing happens
    >>> fs.analysis.check_fit(20 * 2**30, 16 * 2**30)
    Traceback (most recent call last):
    ...
    fnscale.FitError: the step needs 20.00 GiB per device and the device has 16.00 GiB; fix: ...
  """
  if limit is not None and needed > limit:
    raise _error(needed, limit, options, what)


def compile_fitting(step, state, batch, *, limit: float | None = None,
                    options: Sequence[FitOption] | Callable[[], Sequence[FitOption]] = ()):
  """Compiles `step` (a `fnscale.shard_step` result) for `(state, batch)` and checks that it
  fits the memory of its mesh's devices before anything runs.

  Args:
    step: a `fnscale.ShardedStep`.
    state, batch: as for `step.compile` (arrays or `jax.ShapeDtypeStruct`s).
    limit: bytes per device; default `device_memory` of the mesh's first device (none on
      CPU: then nothing is checked unless a limit is given).
    options: what would fit (`fit_options`), or a function returning them, called only
      for the error.

  Returns:
    The `fnscale.CompiledStep`.

  Raises:
    FitError: XLA's peak bytes per device (`step_bytes`) exceed `limit`, or XLA refused the
      program as too big for the device while compiling (then `needed` is the figure XLA
      gives, arguments and temporaries).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, optax
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"]) ** 2)
    >>> mesh = fs.make_mesh({"data": 8})
    >>> state = fs.init_state({"w": jnp.ones((64, 64))}, optax.sgd(0.1), mesh=mesh)
    >>> step = fs.shard_step(fs.train_step(loss, optax.sgd(0.1)), mesh)
    >>> fs.analysis.compile_fitting(step, state, {"x": jnp.ones((16, 64))}, limit=1024)
    Traceback (most recent call last):
    ...
    fnscale.FitError: the step needs ... per device and the device has 0.00 MiB; fix: ...
  """
  if limit is None:
    limit = device_memory(step.mesh.devices.flat[0])
  get = options if callable(options) else (lambda: options)
  try:
    compiled = step.compile(state, batch)
  except jax.errors.JaxRuntimeError as e:
    if not _compat.is_oom_error(str(e)):
      raise
    raise _error(_compat.oom_bytes(str(e)), limit, get(), "the step") from None
  needed = step_bytes(compiled)
  if limit is not None and needed > limit:
    raise _error(needed, limit, get(), "the step")
  return compiled
