"""Draws a run's loss (train and eval), tokens/s and MFU against steps to a PNG, and where
its wall time went (its goodput) to another.

  python recipes/plot_run.py RUN_DIR                  # -> RUN_DIR/metrics.png, goodput.png
  python recipes/plot_run.py RUN_DIR --out=run.png --goodput_out=goodput.png

Reads `RUN_DIR/metrics.jsonl` as `run_log.py` writes it (one JSON object per line: "step"
and scalars named "train/loss", "eval/loss", "perf/tokens_per_s", "perf/mfu"); lines
without those are skipped. Works while the run is still writing. The corpus's bigram baseline,
when `train_lm` recorded it in `RUN_DIR/run.json`, is a dashed line in the loss panel. The
goodput figure draws train_lm's goodput records ("goodput/<phase>_s" over "goodput/wall_s",
`recipes/lm/goodput.py`): each phase's share of the wall time so far against the step.
"""
from __future__ import annotations

import json
import numbers
import os
import sys

from absl import flags

from fnscale import FnscaleError, InputError
from recipes.lm import goodput, run_log
from recipes.lm.run_log import METRICS_FILE, RUN_FILE
from recipes.lm import cli

# (panel title, y label, scale, tags drawn in it)
PANELS = (("loss", "nats per token", 1.0, ("train/loss", "eval/loss")),
          ("throughput", "tokens/s", 1.0, ("perf/tokens_per_s",)),
          ("MFU", "% of peak", 100.0, ("perf/mfu",)))
TAGS = tuple(t for _, _, _, tags in PANELS for t in tags)


def read_metrics(path: str) -> dict[str, tuple[list[int], list[float]]]:
  """Per known tag present: (steps ascending, values); a repeated step keeps its last value
  (a resumed run writes again the steps after its checkpoint)."""
  series: dict[str, dict[int, float]] = {}
  for rec in run_log.records(path):
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
      continue
    for tag in TAGS:
      value = rec.get(tag)
      if isinstance(value, numbers.Real) and not isinstance(value, bool):
        series.setdefault(tag, {})[step] = float(value)
  return {tag: (sorted(pts), [pts[s] for s in sorted(pts)]) for tag, pts in series.items()}


def read_baseline(run_dir: str) -> float | None:
  """The bigram baseline (nats/token) in `run_dir/run.json`'s "data" record; None when the
  file, the record or the number is missing or unreadable (the plot goes on without it)."""
  try:
    with open(os.path.join(run_dir, RUN_FILE), encoding="utf-8") as f:
      value = json.load(f).get("data", {}).get("bigram_loss")
  except (OSError, ValueError, AttributeError):
    return None
  return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) \
      else None


def _metrics_path(run_dir) -> str:
  if not isinstance(run_dir, (str, os.PathLike)) or not os.path.isdir(run_dir):
    raise InputError(f"run directory {run_dir!r} does not exist; pass the --run_dir of a "
                       "training run")
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.isfile(path) or os.path.getsize(path) == 0:
    raise InputError(f"{path} is missing or empty: {run_dir!r} has no metrics yet; pass "
                       "the run directory of a run that has logged a step")
  return path


def plot_run(run_dir: str, out: str | None = None) -> str:
  """Plots `run_dir/metrics.jsonl` to a 700x800-pixel PNG; returns its path.

  Three panels share the step axis: train and eval loss (and the bigram baseline, dashed,
  when run.json has it), tokens/s, and MFU in percent. A metric the run has not logged leaves
  its panel empty with a note.

  Args:
    run_dir: a run directory holding metrics.jsonl.
    out: the PNG's path; default `run_dir/metrics.png`.

  Raises:
    InputError: `run_dir` missing, its metrics.jsonl missing, empty, malformed or without
      any of the plotted metrics.
  """
  path = _metrics_path(run_dir)
  series = read_metrics(path)
  if not series:
    raise InputError(f"{path} has none of {', '.join(TAGS)}; write them with run_log.py")
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  fig = Figure(figsize=(7, 8), dpi=100, layout="constrained")  # Agg canvas, no pyplot state
  axes = fig.subplots(len(PANELS), 1, sharex=True)
  baseline = read_baseline(run_dir)
  if baseline is not None and ("train/loss" in series or "eval/loss" in series):
    axes[0].axhline(baseline, color="gray", linestyle="--", label="bigram baseline")
  for ax, (title, ylabel, scale, tags) in zip(axes, PANELS):
    for tag in tags:
      if tag in series:
        steps, values = series[tag]
        ax.plot(steps, [v * scale for v in values], marker="o" if tag.startswith("eval/")
                else None, markersize=3, label=tag)
    if any(t in series for t in tags):
      ax.legend(loc="best", fontsize="small")
    else:
      ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if title != "loss":
      ax.set_ylim(bottom=0)  # from zero, so timing noise doesn't look like a trend
    ax.set_title(title, fontsize="medium")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[-1].set_xlabel("step")
  fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
  out = os.fspath(out) if out is not None else os.path.join(run_dir, "metrics.png")
  fig.savefig(out, format="png")
  return out


def read_goodput(path: str) -> dict[str, tuple[list[int], list[float]]]:
  """Per phase of `goodput.PHASES`: (steps ascending, % of the wall time) of the goodput
  records in the metrics.jsonl at `path`; a repeated step keeps its last record (a restart
  writes its first again, carrying the earlier starts); {} when there are none."""
  by_step = {r["step"]: r for r in run_log.records(path)
             if goodput.WALL in r and isinstance(r.get("step"), int) and r[goodput.WALL] > 0}
  steps = sorted(by_step)
  return {p: (steps, [100 * by_step[s][f"{goodput.TAG}{p}_s"] / by_step[s][goodput.WALL]
                      for s in steps]) for p in goodput.PHASES} if steps else {}


def goodput_figure(run_dir: str):
  """The goodput figure of `run_dir` (a matplotlib Figure, 700x450 pixels): one line per
  phase (`read_goodput`), titled by the last record's summary line.

  Raises:
    InputError: `run_dir` or its metrics missing, or no goodput record in them.
  """
  path = _metrics_path(run_dir)
  series = read_goodput(path)
  if not series:
    raise InputError(f"{path} has no goodput records ({goodput.WALL}); train_lm writes them "
                     "at each progress line")
  last = [r for r in run_log.records(path) if goodput.WALL in r][-1]
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
  ax = fig.subplots()
  for phase, (steps, shares) in series.items():
    ax.plot(steps, shares, label=phase, linewidth=2.5 if phase == "productive" else 1.2)
  ax.set_ylim(0, 100)
  ax.set_xlabel("step")
  ax.set_ylabel("% of the wall time so far")
  ax.legend(loc="best", fontsize="small")
  ax.grid(alpha=0.3)
  ax.set_title(goodput.line(last).split(": ", 1)[0], fontsize="medium")
  fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
  return fig


def plot_goodput(run_dir: str, out: str | None = None) -> str:
  """Draws `goodput_figure(run_dir)` to a PNG at `out` (default `run_dir/goodput.png`);
  returns its path. Raises as `goodput_figure`."""
  out = os.fspath(out) if out is not None else os.path.join(run_dir, "goodput.png")
  goodput_figure(run_dir).savefig(out, format="png")
  return out


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("error: expected one RUN_DIR: python recipes/plot_run.py RUN_DIR [--out=PNG] "
          "[--goodput_out=PNG]", file=sys.stderr)
    return 2
  try:
    print(plot_run(argv[1], flags.FLAGS.out))
    if read_goodput(_metrics_path(argv[1])):  # a run of train_lm's (other logs have none)
      print(plot_goodput(argv[1], flags.FLAGS.goodput_out))
  except FnscaleError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "the PNG's path; default RUN_DIR/metrics.png")
  flags.DEFINE_string("goodput_out", None, "the goodput PNG's path; default RUN_DIR/goodput.png")
  sys.exit(cli.absl_run(main))
