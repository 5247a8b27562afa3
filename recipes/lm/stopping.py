"""How a run stops before its last step, losing nothing it saved: a preemption notice
(SIGTERM, `fnscale.multihost.preemption_guard`), Ctrl-C (SIGINT) and --stop_after each stop every
process after the same step, which is saved (`reason`).

Ctrl-C while the loop runs (`ctrl_c`) is a request like a notice: the first stops after the
step under way and saves it ("rerun the same command to resume"); with several processes it
goes through the same notice, so every process stops at the same step. A second Ctrl-C stops
at once (`KeyboardInterrupt`): what is on disk stays (a save in flight either commits or
stays a temporary directory that is never read). Outside the loop (start-up, data, compile,
the final save) Ctrl-C is Python's `KeyboardInterrupt`: nothing trained is left unsaved.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
from typing import Callable, Iterator

import jax

from recipes.lm.cli import CTRL_C


@contextlib.contextmanager
def ctrl_c() -> Iterator[Callable[[], bool]]:
  """While open, Ctrl-C (SIGINT) asks the loop to stop (the module docstring); yields
  `asked()`: whether one came. In a thread other than the main one, Python can't set a
  handler: Ctrl-C stays `KeyboardInterrupt`, `asked()` False."""
  if threading.current_thread() is not threading.main_thread():
    yield lambda: False
    return
  count = [0]

  def on_sigint(signum, frame):  # pylint: disable=unused-argument
    count[0] += 1
    if count[0] > 1:
      raise KeyboardInterrupt
    # A raw write: a print here could land inside another print of the main thread.
    if jax.process_index() == 0:
      os.write(_stderr_fd(), b"\nCtrl-C: stopping after this step and saving it (Ctrl-C "
               b"again stops at once; what is saved is kept)\n")
    if jax.process_count() > 1:  # every process stops at the same step: through the notice
      os.kill(os.getpid(), signal.SIGTERM)

  previous = signal.signal(signal.SIGINT, on_sigint)
  try:
    yield lambda: count[0] > 0
  finally:
    signal.signal(signal.SIGINT, previous)


def _stderr_fd() -> int:
  try:
    return sys.stderr.fileno()
  except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced by a non-file
    return 2


def reason(done: int, steps: int, notice: bool, ctrl_c_asked: bool,
           stop_after: int) -> str | None:
  """Why every process stops after step `done` of `steps` (None: it goes on): `notice`, the
  preemption guard's `should_stop` (True on every process at the same step), says
  "SIGTERM", or "Ctrl-C" when it followed a Ctrl-C; one process stops at a Ctrl-C itself;
  `stop_after` (0: off) stops after that step. The last step is no stop."""
  if done >= steps:
    return None
  if notice or (ctrl_c_asked and jax.process_count() == 1):
    return CTRL_C if ctrl_c_asked else "SIGTERM"
  return f"--stop_after={stop_after}" if done == stop_after else None
