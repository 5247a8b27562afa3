"""How a run stops before its last step, losing nothing it saved: a preemption notice
(SIGTERM, `fnscale.multihost.preemption_guard`), Ctrl-C (SIGINT) and --stop_after each stop every
process after the same step, which is saved (`reason`).

Ctrl-C while the loop runs (`ctrl_c`) is a request like a notice: the first stops after the
step under way and saves it ("rerun the same command to resume"); with several processes it
goes through the same notice, so every process stops at the same step. A second Ctrl-C stops
at once (`KeyboardInterrupt`): what is on disk stays (a save in flight either commits or
stays a temporary directory, which the next run removes: `checkpoints.remove_unfinished`).
Outside the loop (start-up, data, compile, the first eval, the final save and sample) Ctrl-C
is Python's `KeyboardInterrupt`: nothing trained is left unsaved. A run a Ctrl-C ends at once
ends as `Interrupted`, whose text says which step is saved (`what_is_saved`, which the
loop's stop line says too).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
from typing import Callable, Iterator

import jax

import fnscale as fs
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


class Interrupted(KeyboardInterrupt):
  """A Ctrl-C that ended a run at once; `str()` is the end of the line that says so: what is
  saved and what rerunning does (`cli.options_main` prints it)."""


def interrupted(checkpoint_dir: str | None) -> Interrupted:
  """The `Interrupted` of a run whose checkpoints go to `checkpoint_dir` (`what_is_saved`)."""
  return Interrupted(what_is_saved(checkpoint_dir))


def what_is_saved(checkpoint_dir: str | None) -> str:
  """What a run that stops now leaves, and what rerunning it does: read from the disk, once
  the run's checkpoint manager has closed (a save in flight then committed, or stays
  unfinished and is not counted). `checkpoint_dir`: "" checkpoints off, None not decided
  yet (nothing saved)."""
  if checkpoint_dir == "":
    return ("checkpoints are off (--nocheckpoint): nothing was saved; rerunning the same "
            "command starts afresh")
  saved = _complete_steps(checkpoint_dir) if checkpoint_dir else ()
  if not saved:
    return "nothing was saved yet; rerunning the same command starts afresh"
  return f"step {saved[-1]} is saved in {checkpoint_dir}; rerun the same command to resume"


def _complete_steps(directory: str) -> tuple[int, ...]:
  """`fs.checkpoint.steps(directory)`, without orbax's notice that it lists read-only (once
  the run's library log has closed it would reach the console)."""
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    return fs.checkpoint.steps(directory)
  finally:
    absl.setLevel(level)
