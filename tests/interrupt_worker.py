"""`python recipes/train_lm.py FLAGS...` with a Ctrl-C (SIGINT to itself) at one moment of
the run, for tests/test_train_lm.py:

  python tests/interrupt_worker.py MOMENT FLAGS...      (from the repository root)

MOMENT is one of `MOMENTS`. The signal comes from inside the run, at the moment named, not
after a sleep: the process runs train_lm.py as its `__main__` (as the command does, ending
the process the same way) with one of its functions wrapped to send it. For "compile" the
signal comes while XLA compiles the train step (from a thread, 0.3 s into the compile:
the main thread is inside XLA then). The worker appends to the file HOOK_FILE names (an
environment variable) whether the KeyboardInterrupt came out of the compile itself, and
"teardown" if the process ends through the interpreter's teardown (its atexit handlers).
"""
import atexit
import os
import runpy
import signal
import sys
import threading
import time

import jax

import fnscale as fs
from recipes.lm import evaluation, data, memory, stalls, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _note(line: str) -> None:
  with open(os.environ["HOOK_FILE"], "a", encoding="utf-8") as f:
    f.write(line + "\n")


def _ctrl_c() -> None:
  os.kill(os.getpid(), signal.SIGINT)


def _before(module, name: str, calls: int = 1) -> None:
  """Ctrl-C as the `calls`-th call of `module.name` starts (its later calls run as they are)."""
  original, count = getattr(module, name), [0]

  def wrapped(*args, **kwargs):
    count[0] += 1
    if count[0] == calls:
      _ctrl_c()
    return original(*args, **kwargs)
  setattr(module, name, wrapped)


def _after_the_first_save() -> None:
  """Ctrl-C as soon as the first checkpoint save has started (orbax writes it meanwhile)."""
  original = fs.checkpoint.save

  def wrapped(*args, **kwargs):
    out = original(*args, **kwargs)
    _ctrl_c()
    return out
  fs.checkpoint.save = wrapped


def _inside_the_compile() -> None:
  """Ctrl-C 0.3 s into the train step's compile (`memory.compile_step`)."""
  compile_step, lowered_compile = memory.compile_step, jax.stages.Lowered.compile
  armed = threading.Event()

  def in_compile(self, *args, **kwargs):
    if not armed.is_set():
      return lowered_compile(self, *args, **kwargs)
    armed.clear()
    threading.Timer(0.3, _ctrl_c).start()
    t0 = time.time()
    try:
      return lowered_compile(self, *args, **kwargs)
    except KeyboardInterrupt:
      _note(f"KeyboardInterrupt out of the compile after {time.time() - t0:.2f} s")
      raise

  def step(*args, **kwargs):
    armed.set()
    return compile_step(*args, **kwargs)
  jax.stages.Lowered.compile = in_compile
  memory.compile_step = step


MOMENTS = {
    "data": lambda: _before(data, "read_bytes"),  # reading the corpus
    "tokenizing": lambda: _before(tokens, "_encode"),  # encoding it (none kept yet)
    "compile": _inside_the_compile,
    "eval": lambda: _before(evaluation, "evaluate"),  # the eval of step 0, before the loop
    "first step": lambda: _before(stalls, "check_update"),  # the first step dispatched
    "sample": lambda: _before(evaluation, "sample"),  # the final sample (the save in flight)
    "save": _after_the_first_save,
}


def main(moment: str, flags: list[str]) -> None:
  MOMENTS[moment]()
  atexit.register(_note, "teardown")
  path = os.path.join(ROOT, "recipes", "train_lm.py")
  sys.argv = [path, *flags]
  runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
