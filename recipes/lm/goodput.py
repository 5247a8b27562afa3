"""Goodput: the share of a run's wall time that trained steps, and where the rest went.

  ledger = goodput.ledger(started, run_dir)   # time goes to "startup" from `started` on
  ledger.enter("compile")                     # from now on, to "compile"
  with ledger.during("checkpoint"): ...       # to "checkpoint" inside, then back
  ledger.at_step(done)                        # the loop's step `done`: productive, or lost
  log.write(step, ledger.record())            # the cumulative record, in metrics.jsonl

Every second from the process's start (`process_start`: imports, devices, data, mesh) goes
to exactly one of `PHASES`, so they sum to the wall time. `productive`: the loop's time on
steps no earlier start of the same run directory trained; `lost`: its time on steps an
earlier start had trained (as its metrics.jsonl shows), redone because they came after the
checkpoint this start restored; `checkpoint`: restores and saves (what the loop waits
for); `eval`: evaluations and the sample; `other`: the rest (start-up lines, the log, the
summary, an export). A record ("goodput/..." scalars) holds the seconds of each summed over
every start of the run directory (a restarted run goes on from the last record of the one
before), the productive and lost step counts, and the furthest step any start trained; the
time a start ran after its last record (a kill) and the time between starts are not seen.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, ContextManager, NamedTuple

from recipes.lm import run_log

PHASES = ("productive", "startup", "compile", "checkpoint", "eval", "lost", "other")
TAG = "goodput/"
WALL = TAG + "wall_s"  # the sum of the phases' seconds
_WORDS = dict(startup="start-up", compile="compile", checkpoint="checkpoints",
              eval="eval/sample", lost="lost", other="other")


def process_start() -> float | None:
  """When this process started (time.time() seconds; Linux's /proc, to 10 ms), so that the
  interpreter's start and the imports count; None where /proc can't say."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start, clock ticks
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None
  return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Ledger(NamedTuple):
  """Where a run's time goes (`ledger`). `enter(phase)`: from now on, to `phase`.
  `during(phase)`: a context whose time goes to `phase`, then back to the phase before.
  `at_step(done)`: the loop's step `done` begins ("lost" if an earlier start trained it,
  else "productive"). `record()`: the cumulative "goodput/..." scalars now."""
  enter: Callable[[str], None]
  during: Callable[[str], ContextManager]
  at_step: Callable[[int], None]
  record: Callable[[], dict]


def ledger(started: float, run_dir: str | None = None) -> Ledger:
  """A `Ledger` whose time went to "startup" from `started` (time.time()) on, carrying on
  from the last goodput record of `run_dir`'s metrics.jsonl (an earlier start's), if any."""
  before, redo = earlier(run_dir)
  spent, now, count = dict.fromkeys(PHASES, 0.0), [started, "startup"], dict(
      steps=0, lost_steps=0, trained_through=redo)

  def enter(phase: str) -> None:
    if phase not in PHASES:
      raise ValueError(f"phase {phase!r}: expected one of {PHASES}")
    t = time.time()
    spent[now[1]] += t - now[0]
    now[:] = [t, phase]

  @contextlib.contextmanager
  def during(phase: str):
    was = now[1]
    enter(phase)
    try:
      yield
    finally:
      enter(was)

  def at_step(done: int) -> None:
    lost = done <= redo
    enter("lost" if lost else "productive")
    count["lost_steps" if lost else "steps"] += 1
    count["trained_through"] = max(count["trained_through"], done)

  def record() -> dict:
    enter(now[1])  # the open phase's time so far
    out = {f"{TAG}{p}_s": before.get(f"{TAG}{p}_s", 0.0) + spent[p] for p in PHASES}
    out[WALL] = sum(out.values())
    out[TAG + "fraction"] = out[TAG + "productive_s"] / out[WALL] if out[WALL] > 0 else 0.0
    for k in ("steps", "lost_steps"):
      out[TAG + k] = before.get(TAG + k, 0) + count[k]
    out[TAG + "trained_through"] = count["trained_through"]
    out[TAG + "starts"] = before.get(TAG + "starts", 0) + 1
    return out

  return Ledger(enter, during, at_step, record)


def earlier(run_dir: str | None) -> tuple[dict, int]:
  """(the last goodput record of `run_dir`'s metrics.jsonl, {} if none; the furthest step an
  earlier start trained: the larger of that record's and of the train records'), read before
  a resumed run's log drops the records after its checkpoint."""
  path = os.path.join(run_dir, run_log.METRICS_FILE) if run_dir else ""
  if not path or not os.path.isfile(path):
    return {}, 0
  last, trained = {}, 0
  for rec in run_log.records(path):
    if WALL in rec:
      last = rec
    if "train/loss" in rec:
      trained = max(trained, int(rec.get("step", 0)))
  return last, max(trained, int(last.get(TAG + "trained_through", 0)))


def line(record: dict) -> str:
  """'goodput 87.3% of 412 s: start-up 5.1%, compile 3.2%, ...' of a `record()`."""
  wall = record[WALL]
  share = lambda p: record[f"{TAG}{p}_s"] / wall if wall > 0 else 0.0
  lost = int(record[TAG + "lost_steps"])
  starts = int(record[TAG + "starts"])
  return (f"goodput {record[TAG + 'fraction']:.1%} of {wall:.0f} s"
          + (f" over {starts} starts" if starts > 1 else "") + ": "
          + ", ".join(f"{_WORDS[p]} {share(p):.1%}"
                      + (f" ({lost} steps redone)" if p == "lost" and lost else "")
                      for p in PHASES[1:])
          + f" ({int(record[TAG + 'steps'])} steps trained)")
