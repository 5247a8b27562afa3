"""Profiling a window of a run's steps, `--profile_steps=START:STOP`: a jax profiler trace
of those steps in the run directory, for TensorBoard's Profile tab or ui.perfetto.dev.

  prof = profiler(parse_profile_steps("10:15", steps), run_dir)    # Profiler(at_step, close)
"""
from __future__ import annotations

from collections.abc import Callable
import os
import re
from typing import NamedTuple

from fnscale import InputError


class ProfileWindow(NamedTuple):
  """Steps `start` (included) to `stop` (excluded), numbered as a loop `for step in
  range(steps)` numbers them: step 0 is the first step run."""
  start: int
  stop: int


def parse_profile_steps(spec: str | None, steps: int | None = None) -> ProfileWindow | None:
  """Parses `START:STOP` ("10:15" traces 5 steps); None or "" means no profile.

  Args:
    spec: the flag's value.
    steps: the run's total steps, if known: STOP may not exceed it.

  Raises:
    InputError: `spec` is not two ints 0 <= START < STOP (<= steps).
  """
  if spec is None or spec == "":
    return None
  m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec) if isinstance(spec, str) else None
  start, stop = (int(m[1]), int(m[2])) if m else (None, None)
  if m is None or start >= stop or (steps is not None and stop > steps):
    limit = f" <= {steps} (the run's steps)" if steps is not None else ""
    raise InputError(f"--profile_steps={spec!r}: expected START:STOP, two ints with "
                       f"0 <= START < STOP{limit}, e.g. 10:15 to trace steps 10 to 14")
  return ProfileWindow(start, stop)


class Profiler(NamedTuple):
  """`at_step(step, pending=None)` before each step; `close(steps_done, pending=None)` after
  the loop (it stops a trace the loop ended inside).

  Both return the trace directory when they stopped a trace, else None. `pending` (any
  pytree of arrays, e.g. the last step's outputs) is waited for before a trace stops, so the
  device work of the last traced step is inside the trace.
  """
  at_step: Callable[..., str | None]
  close: Callable[..., str | None]


def _trace_dirs(log_dir: str) -> set[str]:
  root = os.path.join(log_dir, "plugins", "profile")
  return {os.path.join(root, d) for d in os.listdir(root)} if os.path.isdir(root) else set()


def profiler(window: ProfileWindow | None, log_dir: str, *,
             say: Callable[[str], None] = print) -> Profiler:
  """Records a JAX profiler trace of `window`'s steps into `log_dir`.

  The trace (`<host>.xplane.pb`, plus `perfetto_trace.json.gz` for ui.perfetto.dev) lands in
  `log_dir/plugins/profile/<time>/`, where TensorBoard's Profile tab finds it
  (`tensorboard --logdir log_dir`, with the tensorboard-plugin-profile package). A run
  resumed inside the window traces from its first step. `say` gets one line at the start and
  one naming the trace directory at the end.

  Raises:
    InputError: `window` is not a ProfileWindow or None (use parse_profile_steps).
  """
  import jax  # pylint: disable=import-outside-toplevel
  if window is not None and not isinstance(window, ProfileWindow):
    raise InputError(f"profile window {window!r}: expected a ProfileWindow or None; build "
                       "it with parse_profile_steps('START:STOP')")
  running = []  # while tracing: (first traced step, trace dirs that existed before)

  def stop(step, pending):
    first, before = running.pop()
    jax.block_until_ready(pending)
    jax.profiler.stop_trace()
    new = sorted(_trace_dirs(log_dir) - before)
    where = new[-1] if new else os.path.join(log_dir, "plugins", "profile")
    say(f"profile: steps {first}..{step - 1} traced to {where} (view: tensorboard --logdir "
        f"{log_dir}, Profile tab; or perfetto_trace.json.gz at ui.perfetto.dev)")
    return where

  def at_step(step: int, pending=None) -> str | None:
    if window is None:
      return None
    if not running and window.start <= step < window.stop:
      before = _trace_dirs(log_dir)
      os.makedirs(log_dir, exist_ok=True)
      jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
      running.append((step, before))
      say(f"profile: tracing steps {step}..{window.stop - 1} into {log_dir}")
    elif running and step >= window.stop:
      return stop(step, pending)
    return None

  def close(step: int | None = None, pending=None) -> str | None:
    return stop(window.stop if step is None else step, pending) if running else None

  return Profiler(at_step=at_step, close=close)
