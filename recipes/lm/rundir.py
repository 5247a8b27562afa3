"""Where a run lives: its directory by default (`default_run_dir`), the check that a
directory holds this run and not another (`check_same_run`), and the file the libraries'
log records go to instead of the console (`library_log`). What goes into the directory:
`run_log.py` (metrics.jsonl, TensorBoard, run.json), `checkpoints.py`."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import jax

import fnscale as fs
from recipes.lm import run_log


def default_run_dir(model: str, dataset: str, tokenizer: str, vocab: int) -> str:
  """`runs/<model>-<dataset>`, plus `-vocab<V>` with a tokenizer: runs of another model,
  corpus or vocabulary get their own directories instead of resuming each other's
  checkpoints. A dataset path or glob counts by its last plain name ("~/src/**/*.py": src)."""
  plain = re.split(r"[*?\[]", dataset or "stdlib", maxsplit=1)[0]
  name = os.path.splitext(os.path.basename(os.path.normpath(os.path.expanduser(plain))))[0]
  name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data"
  return os.path.join("runs", f"{model}-{name}" + (f"-vocab{vocab}" if tokenizer else ""))


# The options that define a run: what its checkpoints hold and the order it reads the data.
DEFINING = ("model_config", "init_from", "tokenizer", "dataset", "seq", "seed", "global_batch")


def check_same_run(o, devices: int) -> None:
  """Refuses to resume the run recorded in `o.run_dir`'s run.json ("start": its options, with
  every default filled in) when a defining option differs (`DEFINING`). The global batch
  counts only on as many devices as the recorded run: on other hardware the default batch
  follows the devices (resuming there is said by `checkpoints.restore_or_init`).

  Raises:
    InputError: naming each differing option (this run's value and the recorded one) and
      the fix.
  """
  path = os.path.join(o.run_dir, run_log.RUN_FILE)
  if not os.path.isfile(path):
    return
  with open(path, encoding="utf-8") as f:
    start = json.load(f).get("start", {})
  then = start.get("options", {})
  names = DEFINING if start.get("devices") == devices else DEFINING[:-1]
  diff = [f"{k}={getattr(o, k)!r} (the run's: {then[k]!r})" for k in names
          if k in then and then[k] != getattr(o, k)]
  if diff:
    raise fs.InputError(
        f"--run_dir={o.run_dir} holds a run with other options: {', '.join(diff)}; its "
        "checkpoints and data order are that run's. Fix: give this run a new --run_dir, or "
        "the run's options to resume it.")


LOG_FILE = "log.txt"


_ORBAX = os.sep + "orbax" + os.sep


@contextlib.contextmanager
def library_log(run_dir: str):
  """While open, orbax's absl log records ("Given directory is read only=...", "`read` option
  is deprecated" on every resume) go to `run_dir/log.txt` (`log.<i>.txt` on process i > 0),
  made on the first record, instead of the console; other libraries' records pass as before.
  """
  i = jax.process_index()
  handler = logging.FileHandler(os.path.join(run_dir, LOG_FILE if i == 0 else f"log.{i}.txt"),
                                encoding="utf-8", delay=True)
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
    yield
  finally:
    logger.removeFilter(to_file)
    handler.close()
