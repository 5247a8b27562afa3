"""Recording a training run: scalars to metrics.jsonl and TensorBoard (or Weights & Biases),
a profiler window and progress lines.

  log = run_log(run_dir)                                   # RunLog(write, close)
  log.write(step, {"train/loss": 2.31, "perf/tokens_per_s": 4471.0, "perf/mfu": 0.327})
  prof = profiler(parse_profile_steps("10:15", steps), run_dir)    # Profiler(at_step, close)
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
  say(f"run_log: {len(gone)} records of steps {min(gone)}..{max(gone)} dropped from {path} "
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
# Profiling a window of steps: --profile_steps=START:STOP
# ------------------------------------------------------------------------------------------------


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
