"""The goodput of a run that loses a process without warning: recipes/train_lm.py under
recipes/launch/launch_local.py (`--num_processes` x `--devices_per_process` simulated CPU
devices, an emergency copy every `--emergency_every` steps), process `--kill_process` killed
(-9) when process 0 reports step `--kill_at`. launch_local restarts the whole job, which
resumes from the newest copy; its last lines are the run's summary and its goodput over both
starts (the steps redone counted as lost).

  python recipes/bench/crash.py --run_dir=runs/crashed              # the default run
  python recipes/bench/crash.py --run_dir=runs/crashed --kill_at=8 -- --steps=30

Arguments after `--` go to train_lm. `--kill_at` must be a step process 0 reports (a
progress line: every --log_every steps, 8 for the default 200).
"""
from __future__ import annotations

import os
import re
import signal
import sys

from recipes.launch import launch_local
from recipes.lm import cli

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--run_dir", default="runs/crashed", help="train_lm's --run_dir")
  parser.add_argument("--kill_at", type=cli.number(int, minimum=1), default=104,
                      help="kill when process 0 reports this step")
  parser.add_argument("--kill_process", type=cli.number(int, minimum=1), default=2,
                      help="the process killed (not 0: its output is the one streamed)")
  parser.add_argument("--emergency_every", type=cli.number(int, minimum=1), default=10,
                      help="train_lm's --emergency_every")
  parser.add_argument("--num_processes", type=cli.number(int, minimum=2), default=4)
  parser.add_argument("--devices_per_process", type=cli.number(int, minimum=1), default=2)
  parser.add_argument("train_lm", nargs="*", help="train_lm's flags, after --")
  a = parser.parse_args(argv[1:])
  if a.kill_process >= a.num_processes:
    raise cli.InputError(f"--kill_process={a.kill_process}: expected one of the "
                         f"{a.num_processes} processes' ids 1..{a.num_processes - 1}")
  recipe = [os.path.join(_REPO, "recipes", "train_lm.py"), f"--run_dir={a.run_dir}",
            f"--emergency_every={a.emergency_every}", *a.train_lm]
  pids, killed = {}, []

  def watch(line: str) -> None:
    print(line, end="", flush=True)
    if not killed and line.startswith("launch_local: started"):
      pids.update((int(i), int(p)) for i, p in re.findall(r"process (\d+) pid (\d+)", line))
    if not killed and re.match(rf"step\s+{a.kill_at}/", line):
      os.kill(pids[a.kill_process], signal.SIGKILL)
      killed.append(a.kill_at)

  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
  outcome = launch_local.supervise(recipe, a.num_processes, a.devices_per_process, env=env,
                                   stream=watch, max_restarts=1)
  if not killed:
    raise cli.InputError(f"--kill_at={a.kill_at}: process 0 never reported that step; give "
                         "one of its progress lines' steps (every --log_every steps)")
  if outcome.failure is not None:
    print(f"error: crash: {launch_local.final(outcome, 1)}", file=sys.stderr)
    return outcome.failure.status
  print(f"crash: process {a.kill_process} killed (-9) at step {a.kill_at}; "
        f"{outcome.restarts} restart")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv))
