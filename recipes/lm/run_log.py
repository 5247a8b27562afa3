"""Recording a training run: scalars to metrics.jsonl and TensorBoard (or Weights & Biases),
read back (`records`), and progress lines (a profiler window: `profiling`).

  log = run_log(run_dir)                                   # RunLog(write, close)
  log.write(step, {"train/loss": 2.31, "perf/tokens_per_s": 4471.0, "perf/mfu": 0.327})
  print(progress_line(step, steps, {"train/loss": 2.31}, seconds_per_step=0.9), flush=True)

Scalars are named "<group>/<name>" ("train/loss", "eval/loss", "perf/tokens_per_s",
"perf/mfu"), the names TensorBoard groups by and `plot_run.py` reads. Values like a
GradientTransformation's: small NamedTuples of functions, no objects with methods to extend.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import hashlib
import json
import numbers
import os
import re
import time
from typing import Any, NamedTuple

from fnscale import InputError

METRICS_FILE = "metrics.jsonl"


class RunLog(NamedTuple):
  """Where a run's scalars go. `write(step, metrics)` appends one record; `close()` flushes."""
  write: Callable[[int, Mapping[str, Any]], None]
  close: Callable[[], None]


def _scalars(step, metrics) -> dict[str, float]:
  """Checks a record: `step` an int >= 0, `metrics` str -> real number (None dropped)."""
  if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
    raise InputError(f"step={step!r}: expected an int >= 0 (the number of steps done)")
  if not isinstance(metrics, Mapping):
    raise InputError(f"metrics={metrics!r}: expected a dict such as {{'train/loss': 2.3}}")
  out = {}
  for tag, value in metrics.items():
    if value is None:
      continue  # e.g. tokens/s before the first timed step
    if getattr(value, "shape", None) == ():
      value = value.item()  # a 0-d numpy or jax array
    if not isinstance(tag, str) or isinstance(value, bool) or not isinstance(
        value, numbers.Real):
      raise InputError(f"metric {tag!r}={value!r}: expected a str name and a real number "
                         "(int, float or 0-d array); pass float(x) for other values")
    out[tag] = float(value)
  return out


def _drop_after(path: str, keep_through: int, say: Callable[[str], None]) -> list[int]:
  """Rewrites the metrics file `path` without its records of steps after `keep_through`
  (all of them for -1), saying what went, and returns their steps; a missing file or one
  with no such record is left as it is. Written whole then renamed: a reader never sees half
  a file."""
  if not os.path.isfile(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  steps = [json.loads(line).get("step", -1) for line in lines]
  gone = [s for s in steps if s > keep_through]
  if not gone:
    return []
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(line for line, s in zip(lines, steps) if s <= keep_through)
  os.replace(path + ".tmp", path)
  which = f"step {gone[0]}" if min(gone) == max(gone) else f"steps {min(gone)}..{max(gone)}"
  say(f"run_log: {len(gone)} records of {which} dropped from {path} "
      + ("(this run starts afresh: a fresh log)" if keep_through < 0 else
         f"(this run continues from step {keep_through}: no step is logged twice)"))
  return gone


def _tensorboard(run_dir: str, say: Callable[[str], None], purge_step: int | None):
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  except ImportError:
    say(f"run_log: tensorboardX is not installed, so metrics go to {METRICS_FILE} only "
        "(pip install tensorboardX for TensorBoard event files)")
    return None
  # tensorboardX names event files by the second and host: a writer reopened within the same
  # second (a quick resume) would overwrite the first file. A ns suffix keeps them apart, in
  # time order (TensorBoard reads a directory's event files in name order).
  # purge_step: TensorBoard hides the earlier events of that step on (a resumed run's).
  return SummaryWriter(logdir=run_dir, filename_suffix=f".{time.time_ns()}",
                       purge_step=purge_step)


def check_tracker(tracker: str) -> None:
  """Raises InputError for a tracker that can't record here: "wandb" without the wandb
  package (before a run writes anything)."""
  if tracker == "wandb":
    try:
      import wandb  # pylint: disable=import-outside-toplevel,unused-import  # noqa: F401
    except ImportError:
      raise InputError("--tracker=wandb needs the wandb package, which can't be imported; "
                       "fix: pip install 'fnscale[wandb]' (WANDB_MODE=offline records "
                       "without a network), or --tracker=tensorboard") from None


class _Tracker(NamedTuple):
  """Where scalars go besides metrics.jsonl: add(step, scalars), close()."""
  add: Callable[[int, dict], None]
  close: Callable[[], None]


def _tensorboard_tracker(run_dir: str, say, purge_step: int | None) -> _Tracker | None:
  tb = _tensorboard(run_dir, say, purge_step)
  if tb is None:
    return None

  def add(step: int, scalars: dict) -> None:
    for tag, value in scalars.items():
      tb.add_scalar(tag, value, global_step=step)
    tb.flush()
  return _Tracker(add, tb.close)


def _wandb_tracker(run_dir: str, config: Mapping[str, Any] | None) -> _Tracker:
  """A Weights & Biases run in `run_dir/wandb` (WANDB_MODE=offline: no network; `wandb
  sync` uploads it later), named after the run directory, resumed under the same id when the
  run resumes; `config` is its config. Project: WANDB_PROJECT, default "fnscale"."""
  check_tracker("wandb")
  import wandb  # pylint: disable=import-outside-toplevel
  name = os.path.basename(os.path.normpath(run_dir)) or "run"
  run_id = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:40] + "-" + hashlib.sha256(
      os.path.abspath(run_dir).encode()).hexdigest()[:8]
  run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fnscale"), name=name, id=run_id,
                   dir=run_dir, config=dict(config or {}), resume="allow")
  return _Tracker(lambda step, scalars: run.log(scalars, step=step), run.finish)


def run_log(run_dir: str, *, active: bool = True,
            say: Callable[[str], None] = print, tracker: str = "tensorboard",
            config: Mapping[str, Any] | None = None, keep_through: int | None = None
            ) -> RunLog:
  """Opens a run's metric outputs in `run_dir` (made if missing; appended to).

  Each `write(step, metrics)` appends one JSON object `{"step": step, tag: value, ...}` as a
  line of `run_dir/metrics.jsonl` and the same scalars to the tracker: TensorBoard event
  files in `run_dir` (`tensorboard --logdir run_dir`; when tensorboardX is installed), or a
  Weights & Biases run (`tracker="wandb"`, with `config` as its config). All are flushed on
  every write, so a run can be watched while it trains.

  Args:
    run_dir: the run's directory.
    active: False gives a log that records nothing (processes other than the first).
    say: where the line about a missing tensorboardX, or about dropped records, goes.
    tracker: "tensorboard", "wandb" or "none" (metrics.jsonl only).
    config: the run's options, for the W&B run's config.
    keep_through: None appends to what is there; a step k keeps only the records of steps
      up to k and hides TensorBoard's later events: a run that resumes from step k (-1:
      starts afresh) logs no step twice.

  Raises:
    InputError: tracker="wandb" without the wandb package (`check_tracker`); from `write`,
      a step that is not an int >= 0, a value that is not a real number, or a write after
      `close`.
  """
  if not active:
    return RunLog(write=lambda step, metrics: None, close=lambda: None)
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, METRICS_FILE)
  gone = [] if keep_through is None else _drop_after(path, keep_through, say)
  if gone and tracker == "wandb":
    say(f"run_log: the W&B run keeps the points it got for steps {min(gone)}..{max(gone)} "
        "before this resume (W&B takes no step below its last one), so it shows this run's "
        f"only from step {max(gone) + 1}; {METRICS_FILE} and TensorBoard hold this run's")
  jsonl = open(path, "a", encoding="utf-8")
  purge = None if keep_through is None else keep_through + 1
  tb = (_wandb_tracker(run_dir, config) if tracker == "wandb" else
        _tensorboard_tracker(run_dir, say, purge) if tracker == "tensorboard" else None)

  def write(step: int, metrics: Mapping[str, Any]) -> None:
    scalars = _scalars(step, metrics)
    if jsonl.closed:
      raise InputError(f"run_log({run_dir!r}) is closed; write before close()")
    jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
    jsonl.flush()
    if tb is not None:
      tb.add(int(step), scalars)

  def close() -> None:
    jsonl.close()
    if tb is not None:
      tb.close()

  return RunLog(write=write, close=close)


RUN_FILE = "run.json"


def records(path: str) -> list[dict]:
  """The JSON objects of a metrics.jsonl at `path` (as `run_log` writes it), in order; a last
  line that doesn't parse is left out (mid-write while a run goes on, or cut by a kill).

  Raises:
    InputError: naming the path and line of any other line that is not JSON.
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  out = []
  for i, line in enumerate(lines):
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break
      raise InputError(f"{path}:{i + 1}: not a JSON line ({e}); metrics.jsonl holds one "
                       "JSON object per line") from None
    if isinstance(rec, dict):
      out.append(rec)
  return out


def write_run_record(run_dir: str, name: str, record: Mapping[str, Any], *,
                     active: bool = True) -> str | None:
  """Sets `name` (e.g. "start", "summary") to `record` in `run_dir/run.json`: the run's
  records that are not scalars against steps (options, mesh, paths). A resumed run replaces
  the previous run's record of the same name. Written whole then renamed, so a reader never
  sees half a file. Returns the path (None when not `active`).

  Raises:
    InputError: `record` is not a dict of JSON values (str keys; numbers, str, lists, dicts).
  """
  if not active:
    return None
  path = os.path.join(run_dir, RUN_FILE)
  runs = {}
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      runs = json.load(f)
  try:
    text = json.dumps({**runs, name: dict(record)}, indent=1)
  except (TypeError, ValueError) as e:
    raise InputError(f"run record {name!r}: {e}; pass JSON values (use float(x), str(x))") \
        from None
  os.makedirs(run_dir, exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
  return path


# ------------------------------------------------------------------------------------------------
# Progress lines: one plain line each (no carriage returns), so terminals and pod logs agree.
# ------------------------------------------------------------------------------------------------

_FORMATS = {"train/loss": "loss {:.4f}", "train/lr": "lr {:.2e}",
            "perf/tokens_per_s": "{:,.0f} tok/s", "perf/mfu": "MFU {:.1%}"}


def format_duration(seconds: float) -> str:
  """`5m48s` under an hour, `1h01m` from an hour on (negative counts as 0)."""
  s = int(max(seconds, 0))
  return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_line(step: int, total: int, metrics: Mapping[str, Any] | None = None,
                  seconds_per_step: float | None = None) -> str:
  """`step    120/500  loss 2.3320  4,471 tok/s  MFU 32.7%  ETA 5m48s`.

  Known tags have fixed formats (loss, lr, tok/s, MFU as a percent of a 0..1 fraction);
  other tags print as `name value` with 4 significant digits; None values are left out. ETA
  is `seconds_per_step * (total - step)` when `seconds_per_step` is given.
  """
  parts = [f"step {step:>6}/{total}"]
  for tag, value in (metrics or {}).items():
    if value is not None:
      fmt = _FORMATS.get(tag, tag.rsplit("/", 1)[-1] + " {:.4g}")
      parts.append(fmt.format(float(value)))
  if seconds_per_step is not None:
    parts.append(f"ETA {format_duration(seconds_per_step * (total - step))}")
  return "  ".join(parts)
