"""recipes/launch/launch_ray.py: one JAX process per host on a Ray cluster, supervised by exit status.

The jobs run on a Ray cluster of two `ray start` nodes on this machine standing for two hosts
(`ray_cluster.local_cluster`), with 4 simulated CPU devices per process, through the
launcher's command line as a user runs it; this process never imports Ray. Without Ray (the
`ray` extra) those tests are skipped with the reason. The supervision rule, the placement
order and the flags are checked without a cluster.
"""
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import fnscale as fs

from recipes.launch import launch_local
from recipes.launch import launch_ray
from recipes.launch import ray_cluster
from recipes import train_lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCHER = str(ROOT / "recipes" / "launch" / "launch_ray.py")
STEPS = 16
LAUNCH_TIMEOUT_S = 600  # the launcher's own bound (--timeout_s), restarts included
CPU_HOSTS = ("--hosts=2", "--devices_per_process=4")  # 2 hosts x 4 simulated CPU devices

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed: pip install -e '.[ray]' (CI installs it)")
E = launch_ray.Exit


@pytest.mark.parametrize("exit_, restart, status, words", [
    (E(1, 143), True, 143, "process 1 exited with 143 (preempted)"),
    (E(0, 75), True, 75, "lost or failed process"),
    (E(1, -signal.SIGKILL), True, 75, "ended by SIGKILL"),
    (E(1, None, "host of process 1 lost: ActorDiedError"), True, 75, "host of process 1 lost"),
    (E(0, 2), False, 2, "bad input"),
    (E(1, 1), False, 1, "uncaught error"),
    (E(0, 3), False, 3, "exited with 3"),
])
def test_supervision_rule(exit_, restart, status, words):
  # The launcher doesn't import fnscale (jax): its statuses are fnscale's.
  assert launch_ray.EXIT_PREEMPTED == fs.multihost.EXIT_PREEMPTED
  assert launch_ray.EXIT_JOB_FAILED == fs.multihost.EXIT_JOB_FAILED
  verdict = launch_ray.classify(exit_)
  assert (verdict.restart, verdict.status) == (restart, status)
  assert words in verdict.why


@pytest.mark.parametrize("exits, cause", [
    ([E(0, 1), E(1, -9)], E(1, -9)),  # a peer's collective error is a symptom of the kill
    ([E(0, 1), E(1, None, "host lost")], E(1, None, "host lost")),
    ([E(0, 143), E(1, 143)], E(0, 143)),
    ([E(0, 2), E(1, 143)], E(1, 143)),
    ([E(0, 75), E(1, 1)], E(0, 75)),
    ([E(0, 2), E(1, 2)], E(0, 2)),
    ([E(0, 0), E(1, 3)], E(1, 3)),
    ([E(0, 0), E(1, 0)], None),
    ([], None),  # every process was stopped by the launcher
])
def test_cause_is_the_root_failure_not_its_symptoms(exits, cause):
  assert launch_ray.cause_of(exits) == cause


def test_tpu_hosts_take_their_worker_id_as_process_id():
  places = [{"tpu_worker_id": w} for w in (2, 0, 3, 1)]
  assert launch_ray._process_order(places) == [1, 3, 0, 2]  # bundle of worker 0 first
  # Not a TPU slice (or ids that aren't 0..N-1): bundle order.
  assert launch_ray._process_order([{"tpu_worker_id": None}] * 3) == [0, 1, 2]
  assert launch_ray._process_order([{"tpu_worker_id": w} for w in (0, 0)]) == [0, 1]


def test_a_misspelt_launcher_keyword_is_named_before_anything_starts(tmp_path):
  """The launchers' keywords are the fields of their `Options`: a misspelt one is a TypeError
  naming it, raised before any process starts (and, for launch_ray, before Ray is needed)."""
  script = tmp_path / "ran.py"
  script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
  with pytest.raises(TypeError, match="'timeout'"):
    launch_local.launch([str(script)], 1, 1, timeout=5)
  with pytest.raises(TypeError, match="'max_restart'"):
    launch_ray.launch([str(script)], launch_ray.nodes(1), max_restart=1)
  assert not (tmp_path / "ran").exists()
  # The control: the keywords spelt right start the process.
  assert launch_local.launch([str(script)], 1, 1, timeout_s=60, stream=lambda line: None)[0][0] == 0
  assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("argv, message", [
    (["--tpu=v5p", "--", "x.py"], "expected generation:topology"),
    (["--tpu=v5p:2x2x4", "--hosts=2", "--", "x.py"], "--tpu and --hosts both given"),
    (["--hosts=0", "--", "x.py"], "hosts=0, expected a positive int"),
    (["--hosts=2", "--gpus_per_host=-1", "--", "x.py"], "expected resources >= 0"),
    (["--hosts=2"], "no command"),
    (["--hosts=2", "--max_restarts=x", "--", "x.py"], "max_restarts"),
])
def test_bad_launcher_flags_are_one_line_and_status_2(argv, message, capsys):
  assert launch_ray.main(["launch_ray", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_restart_reads_train_lms_checkpoint_directory(tmp_path):
  """The step a restart resumes from is read where train_lm itself keeps checkpoints."""
  cwd, d = str(tmp_path), launch_ray._recipe_checkpoint_dir
  assert d(["recipes/train_lm.py", "--run_dir=r"], cwd) == os.path.join(cwd, "r", "checkpoints")
  assert d(["recipes/train_lm.py", "--checkpoint_dir=/c"], cwd) == "/c"
  assert d(["recipes/train_lm.py", "--checkpoint_dir=gs://b/c"], cwd) == "gs://b/c"
  assert d(["recipes/train_lm.py", "--nocheckpoint"], cwd) is None
  assert d(["recipes/train_lm.py", "--no_such_flag"], cwd) is None
  assert d(["other.py", "--run_dir=r"], cwd) is None
  # The emergency copies, which a restart resumes from when they are newer.
  both = launch_ray._recipe_dirs
  assert both(["recipes/train_lm.py", "--run_dir=r", "--emergency_every=10"], cwd) == (
      os.path.join(cwd, "r", "checkpoints"), os.path.join(cwd, "r", "emergency"))
  assert both(["recipes/train_lm.py", "--run_dir=r", "--emergency_every=10",
               "--emergency_dir=/local/e"], cwd)[1] == "/local/e"
  assert both(["recipes/train_lm.py", "--run_dir=r"], cwd)[1] is None


def test_restart_names_the_newer_of_checkpoint_and_emergency_copy(tmp_path):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  run = tmp_path / "r"
  fs.checkpoint.save(run / "checkpoints", 3, {"w": jnp.zeros(2)})
  o = launch_ray._Launch(
      launch_ray.Command(["recipes/train_lm.py", "--run_dir=r", "--emergency_every=2"], None,
                         {}, str(tmp_path)), launch_ray.nodes(1), 1.0, 1.0, 1, (1.0, 1.0), None,
      print, print, None)
  assert launch_ray._resumed_from(o) == (3, str(run / "checkpoints"))
  fs.checkpoint.save(run / "emergency", 4, {"w": jnp.zeros(2)})
  assert launch_ray._resumed_from(o) == (4, str(run / "emergency"))


@pytest.fixture(scope="module")
def cluster():
  """Two Ray nodes on this machine: two hosts of one CPU each."""
  if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed: pip install -e '.[ray]'")
  with ray_cluster.local_cluster(2) as address:
    yield address


def _options(work, run_dir):
  """train_lm's options for every run here (checkpoints only at the end and on SIGTERM)."""
  return dict(model_config="nano", mesh="data=-1,fsdp=2", seq=32, global_batch=16, steps=STEPS,
              dataset=str(work / "corpus.txt"), run_dir=str(run_dir), eval_batches=1,
              log_every=1, sample_len=0, checkpoint_every=0,
              compile_cache_dir=str(work / "cache"))


def _launch(address, recipe, on_line=None, *flags_, hosts=CPU_HOSTS):
  """The launcher's command line: (exit status, its output lines); `on_line(line)` sees each
  line as it arrives."""
  proc = subprocess.Popen(
      [sys.executable, LAUNCHER, f"--address={address}", *hosts, "--backoff_s=0.5",
       "--grace_s=60", f"--timeout_s={LAUNCH_TIMEOUT_S}", *flags_, "--", *recipe],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
      start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if on_line:
        on_line(line)
    return proc.wait(timeout=60), lines
  finally:
    if proc.poll() is None:  # a failed assertion: SIGTERM, and the launcher stops its job
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout=120)


def _train_lm(work, run_dir, *extra):
  return ["recipes/train_lm.py", *[f"--{k}={v}" for k, v in _options(work, run_dir).items()],
          *extra]


_ATTEMPT = re.compile(r"attempt \d+: process 0 pid (\d+) on \S+ \(node (\w+)\), "
                      r"process 1 pid (\d+) on \S+ \(node (\w+)\)")


def _attempts(lines):
  """Per "attempt" line: (pid of process 0, pid of process 1, Ray node of each)."""
  return [(int(m[1]), int(m[3]), m[2], m[4]) for m in map(_ATTEMPT.search, lines) if m]


@pytest.fixture(scope="module")
def uninterrupted(cluster, work):
  run_dir = work / "uninterrupted"
  rc, lines = _launch(cluster, _train_lm(work, run_dir))
  return rc, lines, run_dir


@pytest.mark.slow
@needs_ray
@pytest.mark.multiprocess
def test_train_lm_runs_to_the_end_one_process_per_host(uninterrupted):
  rc, lines, run_dir = uninterrupted
  out = "".join(lines)
  assert rc == 0, out[-5000:]
  (attempt,) = _attempts(lines)
  assert attempt[2] != attempt[3], "both processes on one Ray node"
  assert "2 process(es) x 4 devices" in out  # JAX joined both processes
  assert f"done: step {STEPS}" in out and "launch_ray: restart" not in out
  assert "every process exited with 0 (0 restarts)" in lines[-1]
  summary = json.loads((run_dir / "run.json").read_text())["summary"]
  assert (summary["processes"], summary["devices"], summary["final_step"]) == (2, 8, STEPS)


@pytest.mark.slow
@needs_ray
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_preempted_then_lost_process_restarts_and_ends_bitwise_equal(cluster, work,
                                                                    uninterrupted, tmp_path):
  """SIGTERM to process 1 at the first step: the job saves and exits 143, the launcher starts
  it again; kill -9 of process 1 at the first step after resuming: restarted again (the lost
  process path), from the same checkpoint. The end state is bitwise the uninterrupted one's."""
  run_dir, attempts, sent = work / "restarted", [], []

  def on_line(line):
    attempts.extend(_attempts([line]))
    if re.match(r"step\s+\d+/", line) and len(sent) < min(len(attempts), 2):
      sig = signal.SIGTERM if not sent else signal.SIGKILL
      os.kill(attempts[-1][1], sig)
      sent.append(sig)

  rc, lines = _launch(cluster, _train_lm(work, run_dir), on_line, "--max_restarts=3")
  out = "".join(lines)
  assert rc == 0 and sent == [signal.SIGTERM, signal.SIGKILL], out[-8000:]
  assert len(attempts) == 3
  stopped = int(re.search(r"stopped at step (\d+) \(SIGTERM\)", out)[1])
  # No periodic checkpoints: both restarts resume from what the SIGTERM saved.
  assert [int(s) for s in re.findall(r"resumed from step (\d+)", out)] == [stopped, stopped]
  restarts = [ln for ln in lines if ln.startswith("launch_ray: restart")]
  assert len(restarts) == 2, restarts
  assert re.search(r"restart 1 of 3 .*: process \d exited with 143 \(preempted\) \(exit "
                   rf"statuses 143, 143\); resuming from step {stopped} ", restarts[0])
  assert re.search(r"restart 2 of 3 .*: process 1 was ended by SIGKILL \(lost process\) "
                   rf"\(exit statuses \S+, -9\); resuming from step {stopped} ", restarts[1])
  # Bitwise: the uninterrupted run's final state through train_lm itself (it resumes at the
  # last step and trains no more; its records go elsewhere), this run's restored onto it.
  reference = train_lm.train_lm(**_options(work, tmp_path), checkpoint_dir=str(
      uninterrupted[2] / "checkpoints")).state
  state, _ = fs.checkpoint.restore(run_dir / "checkpoints", reference)
  assert int(state.step) == int(reference.step) == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(reference.params))


@pytest.mark.slow
@needs_ray
@pytest.mark.multiprocess
def test_bad_flag_exits_2_without_restart(cluster, work, tmp_path):
  rc, lines = _launch(cluster, _train_lm(work, tmp_path, "--no_such_flag=1"), None,
                      "--max_restarts=3")
  out = "".join(lines)
  assert rc == 2, out[-5000:]
  assert len(_attempts(lines)) == 1 and "restart " not in out
  assert "error: Unknown command line flag 'no_such_flag'" in out  # process 0's own line
  assert "exited with 2 (bad input or configuration); not restarting" in lines[-1]


@pytest.mark.slow
@needs_ray
@pytest.mark.multiprocess
def test_tpu_slice_one_process_per_host_in_worker_order(tmp_path):
  """Two Ray nodes that say they are the two hosts of a TPU v4 2x2x2 slice (the variables GKE
  sets; Ray derives the slice's labels and its head resource from them, and reads no metadata
  server): the launcher reserves the slice through Ray's TPU resources and gives each host's
  process the host's worker id as its process id, whatever order the nodes started in."""
  script = tmp_path / "where.py"
  script.write_text("import json, os\n"
                    f"with open(os.path.join({str(tmp_path)!r}, os.environ['JAX_PROCESS_ID']),"
                    " 'w') as f:\n  json.dump(dict(os.environ), f)\n")
  env = [{"TPU_NAME": "slice-a", "TPU_WORKER_ID": str(w), "TPU_ACCELERATOR_TYPE": "v4-16",
          "TPU_TOPOLOGY": "2x2x2"} for w in (1, 0)]  # the head node is worker 1
  resources = [{"TPU": 4}, {"TPU": 4, "TPU-v4-16-head": 1}]
  with ray_cluster.local_cluster(2, node_resources=resources, node_env=env) as address:
    rc, lines = _launch(address, [str(script)], hosts=("--tpu=v4:2x2x2",))
  assert rc == 0, "".join(lines)[-5000:]
  seen = [json.loads((tmp_path / str(i)).read_text()) for i in range(2)]
  assert [e["TPU_WORKER_ID"] for e in seen] == ["0", "1"]
  assert {e["JAX_NUM_PROCESSES"] for e in seen} == {"2"}
  assert len({e["JAX_COORDINATOR_ADDRESS"] for e in seen}) == 1
  assert not any("xla_force_host_platform_device_count=4" in e.get("XLA_FLAGS", "")
                 for e in seen)  # real devices: no simulated count
  (attempt,) = _attempts(lines)
  assert attempt[2] != attempt[3]  # one process per host
