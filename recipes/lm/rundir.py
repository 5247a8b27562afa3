"""Where a run lives: its directory by default (`default_run_dir`), the check that a
directory holds this run and not another (`check_same_run`), and the file the libraries'
log goes to instead of the console (`library_log`). What goes into the directory:
`run_log.py` (metrics.jsonl, TensorBoard, run.json), `checkpoints.py`."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys

import jax

import fnscale as fs
from recipes.lm import cli, run_log


def default_run_dir(model: str, dataset: str, tokenizer: str, vocab: int) -> str:
  """`runs/<model>-<dataset>`, plus `-vocab<V>` with a tokenizer: runs of another model,
  corpus or vocabulary get their own directories instead of resuming each other's
  checkpoints. A dataset path or glob counts by its last plain name ("~/src/**/*.py": src)."""
  plain = re.split(r"[*?\[]", dataset or "stdlib", maxsplit=1)[0]
  name = os.path.splitext(os.path.basename(os.path.normpath(os.path.expanduser(plain))))[0]
  name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data"
  return os.path.join("runs", f"{model}-{name}" + (f"-vocab{vocab}" if tokenizer else ""))


# The options that define a run: what its checkpoints hold and the order it reads the data.
DEFINING = ("model_config", "init_from", "tokenizer", "dataset", "seq", "seed", "optimizer",
            "mu_dtype", "global_batch")


def check_same_run(o, devices: int, tokenizer_sha: str | None = None) -> None:
  """Refuses to resume the run recorded in `o.ckpt.run_dir`'s run.json ("start": its options,
  with every default filled in) when a defining option differs (`DEFINING`), or its
  tokenizer's file changed under the same name (`tokenizer_sha`: `models.tokenizer_sha`). The
  global batch counts only on as many devices as the recorded run: on other hardware the
  default batch follows the devices (resuming there is said by `checkpoints.restore_or_init`).

  Raises:
    InputError: naming each differing option (this run's value and the recorded one) and
      the fix; a `run_dir` (or a folder above it) that is a file.
  """
  check_directory(o.ckpt.run_dir, "--run_dir")
  start = recorded_start(o.ckpt.run_dir)
  then, now = start.get("options", {}), cli.flat(o)
  names = DEFINING if start.get("devices") == devices else DEFINING[:-1]
  diff = [f"{k}={now[k]!r} (the run's: {then[k]!r})" for k in names
          if k in then and then[k] != now[k]]
  if diff:
    raise fs.InputError(
        f"--run_dir={o.ckpt.run_dir} holds a run with other options: {', '.join(diff)}; its "
        "checkpoints and data order are that run's. Fix: give this run a new --run_dir, or "
        "the run's options to resume it: " + " ".join(
            f"--{k}={then[k]}" for k in names if k in then and then[k] != now[k]))
  was = start.get("tokenizer_sha256")
  if was and tokenizer_sha and was != tokenizer_sha:
    raise fs.InputError(
        f"--run_dir={o.ckpt.run_dir} was trained with another tokenizer under the same name "
        f"(--tokenizer={now.get('tokenizer')!r}: sha256 {tokenizer_sha}, the run's {was}): "
        "its ids would mean other tokens. Fix: put the run's tokenizer back, or give this run "
        "a new --run_dir")


def recorded_start(run_dir: str) -> dict:
  """The "start" record of `run_dir`'s run.json (its options with every default filled in,
  its devices...), {} when there is none."""
  path = os.path.join(run_dir, run_log.RUN_FILE)
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f).get("start", {})


def recorded_batch(run_dir: str, devices: int) -> tuple[int, int] | None:
  """(global batch, devices) of the run recorded in `run_dir` when it ran on another device
  count than `devices` (a restart on fewer or more hosts); None when none is recorded or it
  ran on as many."""
  start = recorded_start(run_dir)
  batch = start.get("options", {}).get("global_batch")
  if not batch or start.get("devices") in (None, devices):
    return None
  return batch, start["devices"]


def check_directory(path: str, flag: str) -> None:
  """Raises InputError when local `path`, or the nearest of the folders above it that exists,
  is a file: nothing could be made or written there."""
  if not path or "://" in path:
    return
  existing = os.path.abspath(path)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise fs.InputError(
        f"{flag}={path}: {existing} is a file, not a directory; fix: give a directory (made "
        "if missing) where no file is, or move the file away")


LOG_FILE = "log.txt"


_ORBAX = os.sep + "orbax" + os.sep
# A line XLA's C++ code logs: "W1205 17:24:59.622298    2817 spmd_partitioner.cc:656] ...".
_XLA_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")


def log_path(run_dir: str) -> str:
  """This process's library log: `run_dir/log.txt` (`log.<i>.txt` on process i > 0)."""
  i = jax.process_index()
  return os.path.join(run_dir, LOG_FILE if i == 0 else f"log.{i}.txt")


@contextlib.contextmanager
def library_log(run_dir: str):
  """While open, the libraries' log goes to `log_path(run_dir)` instead of the console:
  orbax's absl records ("Given directory is read only=...", "`read` option is deprecated" on
  every resume) and what XLA's C++ code logs (the partitioner's warnings, written straight
  to file descriptor 2; fnscale's compile report lists a step's anyway). Python's own stderr
  (`error:` lines, other libraries' records, tracebacks) still reaches the console. A log
  left empty is removed, and the directories this made for it that are left empty.
  """
  made = missing_directories(run_dir)
  handler = logging.FileHandler(log_path(run_dir), encoding="utf-8", delay=True)
  handler.setFormatter(logging.Formatter(
      "%(asctime)s %(levelname)s %(name)s %(pathname)s:%(lineno)d] %(message)s"))

  def to_file(record: logging.LogRecord) -> bool:
    if _ORBAX not in record.pathname:
      return True
    os.makedirs(run_dir, exist_ok=True)
    handler.handle(record)
    return False  # not passed on to the console's handlers

  logger = logging.getLogger("absl")  # absl.logging's records, orbax's among them
  logger.addFilter(to_file)
  try:
    with _xla_to(log_path(run_dir)):
      yield
  finally:
    logger.removeFilter(to_file)
    handler.close()
    with contextlib.suppress(OSError):
      if os.path.getsize(log_path(run_dir)) == 0:
        os.remove(log_path(run_dir))
    remove_empty(made)


@contextlib.contextmanager
def _xla_to(path: str):
  """File descriptor 2 (where C++ code writes) appends to `path`; `sys.stderr` becomes a
  `_Stderr` that keeps Python's lines on the console."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  sys.stderr.flush()
  console_fd, log_fd = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  previous = sys.stderr
  try:
    redirected = previous.fileno() == 2  # else a capture of its own: keep writing to it
  except (AttributeError, ValueError, io.UnsupportedOperation):
    redirected = False
  console = (open(console_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                 closefd=False) if redirected else previous)
  with open(log_fd, "a", buffering=1, encoding="utf-8", errors="backslashreplace") as log:
    os.dup2(log_fd, 2)
    sys.stderr = _Stderr(console, log)
    try:
      yield
    finally:
      sys.stderr.flush()
      sys.stderr = previous
      os.dup2(console_fd, 2)
      os.close(console_fd)


class _Stderr(io.TextIOBase):
  """sys.stderr while file descriptor 2 goes to the log: XLA's lines handed back through it
  (fnscale's compile captures them and writes them back) go to the log too, every other
  line to the console."""

  def __init__(self, console, log):
    super().__init__()
    self._console, self._log, self._pending = console, log, ""

  def write(self, s: str) -> int:
    *lines, self._pending = (self._pending + s).split("\n")
    for line in lines:
      (self._log if _XLA_LINE.match(line) else self._console).write(line + "\n")
    return len(s)

  def flush(self) -> None:
    if self._pending:
      self._console.write(self._pending)
      self._pending = ""
    self._console.flush()
    self._log.flush()

  def fileno(self) -> int:
    return self._console.fileno()

  def writable(self) -> bool:
    return True

  def isatty(self) -> bool:
    return self._console.isatty()


def missing_directories(path: str) -> list[str]:
  """The local directories that making `path` creates, innermost first (none for gs://)."""
  missing, path = [], os.path.abspath(path) if "://" not in path else ""
  while path and not os.path.exists(path):
    missing.append(path)
    path = os.path.dirname(path)
  return missing


def remove_empty(directories: list[str]) -> None:
  """Removes each of `directories` (innermost first) that is empty; the others stay."""
  for d in directories:
    with contextlib.suppress(OSError):
      os.rmdir(d)
