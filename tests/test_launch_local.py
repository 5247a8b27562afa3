"""recipes/launch/launch_local.py supervises its job: a process killed (-9) or lost stops the
others and the whole job starts again, up to --max_restarts times, each restart said in one
line; after the last, an `error:` line. The children here are plain scripts (no jax): they
count their own starts in files, as a hand count of the attempts."""
import os
import pathlib
import signal
import time

import pytest

from recipes.launch import launch_local

# Process 1 kills itself (SIGKILL, as a host dying) on its first KILLS starts; process 0 waits
# to be stopped in those attempts and exits 0 in the next.
_CHILD = """\
import os, pathlib, signal, sys, time
d, kills = pathlib.Path(sys.argv[1]), int(sys.argv[2])
pid = os.environ["JAX_PROCESS_ID"]
n = len(list(d.glob(f"start-{pid}-*")))
(d / f"start-{pid}-{n}").touch()
if n >= kills:
  print("done", pid, n, flush=True)
  sys.exit(0)
if pid == "1":
  time.sleep(0.3)
  os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _starts(d: pathlib.Path, pid: int) -> int:
  return len(list(d.glob(f"start-{pid}-*")))


@pytest.fixture
def child(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  return script


def test_a_killed_process_restarts_the_whole_job(child, tmp_path):
  lines = []
  outcome = launch_local.supervise([str(child), str(tmp_path), "2"], 2, 1, timeout_s=60,
                                   grace_s=2, max_restarts=3, stream=lines.append)
  assert [rc for rc, _ in outcome.results] == [0, 0]
  assert outcome.restarts == 2 and outcome.failure is None
  assert (_starts(tmp_path, 0), _starts(tmp_path, 1)) == (3, 3)  # 1 start + 2 restarts each
  # Each restart in one line of the launcher's, said when the kill is seen.
  said = [ln for ln in lines if ln.startswith("launch_local: ")
          and not ln.startswith("launch_local: started")]
  assert len(said) == 2, lines
  for k, line in enumerate(said, 1):
    assert line.startswith(f"launch_local: restart {k} of 3: process 1 was ended by SIGKILL "
                           "(lost process); stopping the others at once (no save completes "
                           "without it), then the job starts again"), line
  assert "done 0 2" in outcome.results[0][1]


def test_the_last_restart_gives_up_with_an_error_line(child, tmp_path, capsys):
  rc = launch_local.main(["launch_local", "--num_processes=2", "--devices_per_process=1",
                          "--max_restarts=1", "--timeout_s=60", "--",
                          str(child), str(tmp_path), "5"])
  assert rc == launch_local.EXIT_JOB_FAILED
  assert (_starts(tmp_path, 0), _starts(tmp_path, 1)) == (2, 2)
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: launch_local: process 1 was ended by SIGKILL (lost "
                            "process) (process 0 (-9), process 1 (-9)); gave up after 1 "
                            "restart(s): raise --max_restarts"), err[-1]


def test_bad_input_is_not_restarted(tmp_path):
  script = tmp_path / "bad.py"
  script.write_text("import os, sys\n"
                    "open(os.path.join(sys.argv[1], 'start-' + os.environ['JAX_PROCESS_ID'] + "
                    "'-' + str(os.getpid())), 'w').close()\n"
                    "sys.exit(2)\n")
  outcome = launch_local.supervise([str(script), str(tmp_path)], 2, 1, timeout_s=60,
                                   max_restarts=3, stream=lambda line: None)
  assert outcome.restarts == 0 and outcome.failure.status == 2
  assert (_starts(tmp_path, 0), _starts(tmp_path, 1)) == (1, 1)


def test_bad_input_under_the_launcher_is_one_launcher_line(tmp_path, capsys):
  # Both processes refuse their flags (exit 2), as a recipe does: besides its start, the
  # launcher says so once, in its error: line (before: also "exited with 2; stopping the
  # others" and "...; not restarting" on stdout).
  script = tmp_path / "bad.py"
  script.write_text("import sys\nprint('error: --steps=-1 must be >= 1', file=sys.stderr)\n"
                    "sys.exit(2)\n")
  assert launch_local.main(["launch_local", "--num_processes=2", "--devices_per_process=1",
                            "--timeout_s=60", "--", str(script)]) == 2
  out = capsys.readouterr()
  ours = [ln for ln in (out.out + out.err).splitlines()
          if "launch_local: " in ln and "launch_local: started" not in ln]
  assert len(ours) == 1 and ours[0].startswith(
      "error: launch_local: process 0 exited with 2 (bad input or configuration) "), ours
  assert out.err.strip().splitlines()[-1] == ours[0]


def test_launch_says_a_failure_it_doesnt_restart_in_one_line(tmp_path):
  script = tmp_path / "bad.py"
  script.write_text("import sys\nsys.exit(3)\n")
  lines = []
  results = launch_local.launch([str(script)], 2, 1, timeout_s=60, stream=lines.append)
  assert results[0][0] == 3, results
  said = [ln for ln in lines if not ln.startswith("launch_local: started")]
  assert said == ["launch_local: process 0 exited with 3 (an uncaught error); not "
                  "restarted: a restart doesn't heal it\n"], lines


@pytest.mark.parametrize("launcher, flag, expected", [
    ("local", "--max_restarts=-1",
     "error: --max_restarts=-1: expected an int >= 0 (restarts after a process is preempted, "
     "lost or killed); fix: --max_restarts=0 (never restart) or more, or leave it out for the "
     "default 3"),
    ("local", "--num_processes=0",
     "error: --num_processes=0: expected an int >= 1 (processes to start); fix: "
     "--num_processes=1 or more, or leave it out for the default 2"),
    ("ray", "--max_restarts=-1",
     "error: --max_restarts=-1: expected an int >= 0 (restarts after a preemption or a lost "
     "host); fix: --max_restarts=0 (never restart) or more, or leave it out for the default 3"),
])
def test_a_count_below_its_least_is_said_as_the_flag_given(launcher, flag, expected, capsys):
  # As every other bad flag of the recipes: `--flag=value: expected ...; fix` (before:
  # "launch: max_restarts=-1, expected an int >= 0", a keyword's words for a flag).
  from recipes.launch import launch_ray  # pylint: disable=import-outside-toplevel
  main, ours = ((launch_local.main, [flag]) if launcher == "local" else
                (launch_ray.main, ["--hosts=2", flag]))
  assert main([f"launch_{launcher}", *ours, "--", "x.py"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [expected]


def test_max_restarts_below_zero_is_refused():
  with pytest.raises(ValueError, match=r"max_restarts=-1, expected an int >= 0"):
    launch_local.supervise(["x.py"], 1, 1, max_restarts=-1)


def test_a_killed_processs_peers_are_stopped_at_once_not_after_the_grace(tmp_path):
  # Process 0 answers SIGTERM by "saving" for 30 s, as a recipe would at a preemption; its
  # peer killed (-9), no save can complete, so the launcher kills it at once instead of
  # waiting out its 20 s grace. (Before: SIGTERM, the 20 s grace, then SIGKILL.)
  script = tmp_path / "child.py"
  script.write_text(
      "import os, signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda *_: time.sleep(30))\n"
      "if os.environ['JAX_PROCESS_ID'] == '1':\n"
      "  time.sleep(0.3)\n"
      "  os.kill(os.getpid(), signal.SIGKILL)\n"
      "time.sleep(60)\n")
  lines = []
  start = time.monotonic()
  outcome = launch_local.supervise([str(script)], 2, 1, timeout_s=60, grace_s=20,
                                   max_restarts=0, stream=lines.append)
  assert time.monotonic() - start < 10, lines
  assert [rc for rc, _ in outcome.results] == [-signal.SIGKILL] * 2
