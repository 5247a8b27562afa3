"""Draws a run's loss (train and eval), tokens/s and MFU against steps to a PNG.

  python recipes/plot_run.py RUN_DIR                  # -> RUN_DIR/metrics.png
  python recipes/plot_run.py RUN_DIR --out=run.png

Reads `RUN_DIR/metrics.jsonl` as `run_log.py` writes it (one JSON object per line: "step"
and scalars named "train/loss", "eval/loss", "perf/tokens_per_s", "perf/mfu"); lines
without those are skipped. Works while the run is still writing. The corpus's bigram baseline,
when `train_lm` recorded it in `RUN_DIR/run.json`, is a dashed line in the loss panel.
"""
from __future__ import annotations

import json
import numbers
import os
import sys

from absl import flags

from fnscale import FnscaleError, InputError
from recipes.lm import run_log
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


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("error: expected one RUN_DIR: python recipes/plot_run.py RUN_DIR [--out=PNG]",
          file=sys.stderr)
    return 2
  try:
    print(plot_run(argv[1], flags.FLAGS.out))
  except FnscaleError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "the PNG's path; default RUN_DIR/metrics.png")
  sys.exit(cli.absl_run(main))
