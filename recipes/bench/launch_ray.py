"""Measures recipes/launch/launch_ray.py on this machine against recipes/launch/launch_local.py.

  python recipes/bench/launch_ray.py --repeats=2

On a local Ray cluster of 2 nodes (`ray_cluster.local_cluster`), the same train_lm job (nano,
2 processes x 4 simulated CPU devices, a warm compilation cache) is started by each launcher:
  * time to the first step: from the launch call to process 0's first `step` line, and for
    launch_ray the part of it before the processes start (placement group, actors);
  * time from a kill to training again: `kill -9` of process 1 at its first step (the lost
    process path), then SIGTERM to process 1 (the preemption path: the job saves first), each
    to process 0's first `step` line after the restart, with the launcher's own lines in
    between (noticed and stopped, processes started).
Prints one line per measurement and the load average; `--json=PATH` also writes them.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time

from recipes.lm import data
from recipes.launch import launch_local, launch_ray, ray_cluster
from recipes.lm import cli

_STEP = re.compile(r"step\s+\d+/")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipe(work: str, run_dir: str, steps: int) -> list[str]:
  return ["recipes/train_lm.py", "--model_config=nano", "--mesh=data=-1,fsdp=2", "--seq=32",
          "--global_batch=16", f"--steps={steps}", f"--dataset={work}/corpus.txt",
          f"--run_dir={run_dir}", "--eval_batches=1", "--log_every=1", "--sample_len=0",
          "--checkpoint_every=0", f"--compile_cache_dir={work}/cache"]


_MARKS = {"step": _STEP, "attempt": re.compile(r"launch_ray: attempt"),
          "restart": re.compile(r"launch_ray: restart")}


class _Clock:
  """Stream callback: when (s since it was made) lines of each kind in `_MARKS` arrived;
  `act(line, now)` may react to a line (send a signal)."""

  def __init__(self, act=None):
    self.t0, self.seen, self.act = time.monotonic(), {}, act

  def __call__(self, line: str):
    now = time.monotonic() - self.t0
    for name, pat in _MARKS.items():
      if pat.match(line):
        self.seen.setdefault(name, []).append(now)
    if self.act:
      self.act(line, now)


def _first_step(work: str, which: str, i: int, address: str) -> dict:
  clock = _Clock()
  run_dir = os.path.join(work, f"{which}{i}")
  if which == "local":
    results = launch_local.launch(_recipe(work, run_dir, 4), 2, 4, timeout_s=900, cwd=_REPO,
                                  env=dict(os.environ, PYTHONPATH=_REPO), stream=clock)
    ok = all(rc == 0 for rc, _ in results)
  else:
    out = launch_ray.launch(_recipe(work, run_dir, 4), launch_ray.nodes(2), address=address,
                            devices_per_process=4, timeout_s=900, stream=clock, cwd=_REPO)
    ok = out.returncode == 0
  return {"launcher": which, "ok": ok, "first_step_s": clock.seen["step"][0],
          "processes_started_s": clock.seen.get("attempt", [None])[0]}


def _pid_of_process_1(line: str) -> int | None:
  m = re.search(r"attempt \d+: .*process 1 pid (\d+)", line)
  return int(m[1]) if m else None


def _kill_to_training(work: str, sig: int, address: str) -> dict:
  """Signal process 1 at the job's first step; times from then to training again."""
  state = {"pid": None, "sent": None}

  def act(line, now):
    if line.startswith("launch_ray: "):
      print(f"{now:8.2f} s  {line}", end="", flush=True)
    state["pid"] = _pid_of_process_1(line) or state["pid"]
    if state["sent"] is None and _STEP.match(line):
      os.kill(state["pid"], sig)
      state["sent"] = now

  clock = _Clock(act)
  out = launch_ray.launch(_recipe(work, os.path.join(work, f"kill{sig}"), 40),
                          launch_ray.nodes(2), address=address, devices_per_process=4,
                          timeout_s=900, backoff_s=0.0, stream=clock, cwd=_REPO)
  t = state["sent"]
  after = lambda name, t0: next(x for x in clock.seen[name] if x > t0)  # noqa: E731
  restart = after("restart", t)  # steps before it are the old attempt's last ones
  ok = out.returncode == 0 and len(out.restarts) == 1
  return {"signal": signal.Signals(sig).name, "ok": ok, "restart_line_s": restart - t,
          "processes_started_s": after("attempt", restart) - t,
          "training_again_s": after("step", restart) - t}


def main(argv: list[str]) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--repeats", type=cli.number(int, minimum=1), default=2,
                      help="first-step measurements per launcher")
  parser.add_argument("--json", default="", help="also write the measurements here")
  fv = parser.parse_args(argv[1:])
  with tempfile.TemporaryDirectory(prefix="bench_launch_ray-") as work:
    rows = _measure(work, fv.repeats)
  load = open("/proc/loadavg").read().split()[:3]
  for row in rows:
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()))
  print(f"load average {' '.join(load)} (2 cores)")
  if fv.json:
    with open(fv.json, "w") as f:
      json.dump({"rows": rows, "loadavg": load}, f, indent=1)
  return 0 if all(r.get("ok", True) for r in rows) else 1


def _measure(work: str, repeats: int) -> list[dict]:
  text = bytearray()
  for path in data.corpus_files(None):  # the first standard-library files, ~300 KB
    with open(path, "rb") as f:
      text += f.read()
    if len(text) > 300_000:
      break
  with open(os.path.join(work, "corpus.txt"), "wb") as f:
    f.write(bytes(text))
  rows, t0 = [], time.monotonic()
  with ray_cluster.local_cluster(2) as address:
    rows.append({"cluster_start_s": time.monotonic() - t0})
    _first_step(work, "local", -1, address)  # fills the compilation cache
    for i in range(repeats):
      for which in (("local", "ray") if i % 2 == 0 else ("ray", "local")):
        rows.append(_first_step(work, which, i, address))
    for sig in (signal.SIGKILL, signal.SIGTERM):
      rows.append(_kill_to_training(work, sig, address))
  return rows


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv))
