"""Multi-process jobs on 127.0.0.1 with JAX's distributed runtime: same numbers, clean failures.

Every job runs tests/mp_worker.py in N processes of M simulated CPU devices
(tests/multiprocess.py). The reference is the same training in this pytest process on 1 x 8
devices. Jobs are shared between tests through module fixtures to keep the file short.
"""
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import time

import jax
import numpy as np
import pytest

import fnscale as fs
from fnscale import checkpoint

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mp_worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.multiprocess

WORKER = str(pathlib.Path(mp_worker.__file__))
STEPS = 4
LOST_STEPS = 8  # the lost-process job's length; the reference covers every step of it
TOL = 1e-6
JOB_TIMEOUT_S = 240


def _events(stdout: str) -> list[dict]:
  return mp.records(stdout)


def _losses(stdout: str) -> list[float]:
  return [e["loss"] for e in _events(stdout) if e["event"] == "step"]


def _max_diff(a: dict, b: dict) -> float:
  assert sorted(a) == sorted(b)
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _train(out, num_processes, devices, *args, timeout_s=JOB_TIMEOUT_S):
  results = mp.run([WORKER, f"--out={out}", f"--steps={STEPS}", *args], num_processes,
                   devices, timeout_s)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  return results


@pytest.fixture(scope="module")
def reference():
  """1 process x 8 devices, in this process: losses and params after each of LOST_STEPS."""
  mesh, _, step, init = mp_worker.build("data=2,fsdp=4")
  import models  # pylint: disable=g-import-not-at-top
  cfg = models.TRANSFORMER
  state = init()
  bs = fs.batch_sharding(mesh)
  losses, params = [], {0: mp_worker.gathered_params(state.params)}
  for s in range(LOST_STEPS):
    batch = fs.global_batch({"tokens": mp_worker.global_tokens(s, 16, cfg.seq, cfg.vocab)}, bs)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    params[s + 1] = mp_worker.gathered_params(state.params)
  return {"losses": losses, "params": params, "mesh": mesh, "state": state}


@pytest.fixture(scope="module")
def run_2x4(tmp_path_factory):
  out = tmp_path_factory.mktemp("run_2x4")
  return out, _train(out, 2, 4, "--ckpt_every=2")


@pytest.fixture(scope="module")
def run_4x2(tmp_path_factory):
  out = tmp_path_factory.mktemp("run_4x2")
  return out, _train(out, 4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["run_2x4", "run_4x2"])
def test_layouts_match_one_process(layout, reference, request):
  out, results = request.getfixturevalue(layout)
  for r in results:
    start = _events(r.stdout)[0]
    assert start["devices"] == 8 and start["mesh"] == {"data": 2, "fsdp": 4}
    np.testing.assert_allclose(_losses(r.stdout), reference["losses"][:STEPS], rtol=0,
                               atol=TOL)
    # The worker calls agree_on_step after compiling; it shows in every log.
    assert re.search(r"barrier compiled step \w+ passed", r.stderr), r.stderr[-3000:]
  # Only process 0 wrote the log and the params.
  logged = [json.loads(ln)["loss"] for ln in (out / "losses.jsonl").read_text().splitlines()]
  assert logged == _losses(results[0].stdout)
  final = dict(np.load(out / "params.npz"))
  diff = _max_diff(final, reference["params"][STEPS])
  print(f"{layout}: largest |param - 1x8 param| = {diff:.3g}")
  assert diff <= TOL
  assert _max_diff(final, reference["params"][0]) > 1e-3  # it did train


@pytest.mark.slow
def test_elastic_restore_2x4_checkpoint_into_1x8_and_1x2(run_2x4, reference, tmp_path):
  out, _ = run_2x4
  ckpt = out / "ckpt"
  assert checkpoint.latest_step(ckpt) == STEPS
  written = dict(np.load(out / "params.npz"))
  # 1 x 8: this process, target = a fresh state on the 1 x 8 mesh.
  state, extra = checkpoint.restore(ckpt, reference["state"])
  assert extra == {"step": STEPS} and int(state.step) == STEPS
  assert state.params["embed"].sharding.mesh.devices.size == 8
  assert _max_diff(mp_worker.gathered_params(state.params), written) == 0.0
  # 1 x 2: a process with 2 devices restores the same checkpoint.
  sub = tmp_path / "restore_1x2"
  sub.mkdir()
  os.symlink(ckpt, sub / "ckpt")
  (r,) = mp.run([WORKER, f"--out={sub}", "--mesh=data=1,fsdp=2", "--restore_only"], 1, 2,
                JOB_TIMEOUT_S)
  assert r.returncode == 0, mp.describe([r])
  assert _events(r.stdout)[0]["devices"] == 2
  assert _max_diff(dict(np.load(sub / "restored.npz")), written) == 0.0


# A preemption notice is SIGTERM; the job must have saved and exited within this many
# seconds of the last notice (Cloud TPU gives about 30 s).
PREEMPT_BOUND_S = 10


@pytest.mark.slow
@pytest.mark.parametrize("notices", [
    ((1, 0.0),),  # only process 1 gets the notice
    ((0, 0.0), (1, 0.4)),  # both, at different moments
], ids=["one_process", "staggered"])
def test_preempted_job_saves_one_step_everywhere_and_resumes_bitwise(run_2x4, tmp_path,
                                                                    notices):
  out = tmp_path / "preempt"
  args = [WORKER, f"--out={out}", f"--steps={STEPS}", "--slow_after=0", "--sleep_s=0.5"]
  with mp.job(args, 2, 4) as job:
    mp.wait_for_output(job, 1, r'"step": 0,', JOB_TIMEOUT_S)
    t0 = time.monotonic()
    for pid, delay in notices:
      time.sleep(max(0.0, t0 + delay - time.monotonic()))
      mp.signal_process(job, pid, signal.SIGTERM)
    last_notice = time.monotonic()
    results = mp.wait(job, 120)
  assert all(r.returncode == fs.multihost.EXIT_PREEMPTED for r in results), mp.describe(results)
  for r, p in zip(results, job.processes):
    took = p.started + r.elapsed_s - last_notice
    print(f"process {r.process_id} exited {took:.1f} s after the last notice")
    assert took < PREEMPT_BOUND_S, mp.describe(results)
  stops = [[e for e in _events(r.stdout) if e["event"] == "preempted"] for r in results]
  saves = [[e for e in _events(r.stdout) if e["event"] == "checkpoint"] for r in results]
  assert len(stops[0]) == 1 and stops[0] == stops[1], mp.describe(results)  # one step
  stop = stops[0][0]["step"]
  assert [[e["step"] for e in saved] for saved in saves] == [[stop], [stop]]  # saved once
  assert 0 < stop < STEPS and checkpoint.steps(out / "ckpt") == (stop,)
  if len(notices) == 1:
    return  # resuming from the agreed step is the same for both cases: checked once, below
  resumed = _train(out, 2, 4)
  assert _events(resumed[0].stdout)[1] == {"event": "restored", "step": stop,
                                           "extra": {"step": stop}}
  final = dict(np.load(out / "params.npz"))
  uninterrupted = dict(np.load(run_2x4[0] / "params.npz"))
  assert _max_diff(final, uninterrupted) == 0.0


@pytest.mark.slow
def test_notice_while_waiting_at_a_barrier_ends_every_process(tmp_path):
  """Process 0 waits at a barrier while process 1 is held back (a slow host); SIGTERM to
  process 1 alone: both end within seconds, not at the barrier's timeout, saving nothing."""
  out = tmp_path / "held"
  args = [WORKER, f"--out={out}", f"--steps={STEPS}", "--hold=1", "--hold_s=120"]
  with mp.job(args, 2, 4) as job:
    mp.wait_for_output(job, 0, r'"event": "waiting"', JOB_TIMEOUT_S)
    mp.wait_for_output(job, 1, r'"event": "holding"', JOB_TIMEOUT_S)
    time.sleep(1.0)  # process 0 is inside the barrier now
    mp.signal_process(job, 1, signal.SIGTERM)
    noticed = time.monotonic()
    results = mp.wait(job, 60)
  for r, p in zip(results, job.processes):
    took = p.started + r.elapsed_s - noticed
    print(f"process {r.process_id} exited {took:.1f} s after the notice")
    assert r.returncode == fs.multihost.EXIT_PREEMPTED, mp.describe(results)
    assert took < PREEMPT_BOUND_S, mp.describe(results)
  assert ("fnscale.DistributedError: preemption notice while process 0 waited at "
          "'ready': the job can't reach a step to save" in results[0].stderr), mp.describe(
              results)
  assert ("fnscale.DistributedError: preemption notice: process 0 stopped without "
          "saving" in results[1].stderr), mp.describe(results)
  assert not checkpoint.steps(out / "ckpt")
  assert all(not [e for e in _events(r.stdout) if e["event"] == "step"] for r in results)


@pytest.mark.slow
def test_lost_process_ends_the_others_with_a_named_error(reference, tmp_path):
  """kill -9 of process 1 mid-run: process 0's next collective fails (or blocks) and
  peer_guard names the lost process within its check-in time (2 s here) plus a step:
  fnscale's error and status 75, long before JAX's own heartbeat abort (30 s here)."""
  out = tmp_path / "lost"
  peer_check_s, heartbeat_s = 2, 30
  args = [WORKER, f"--out={out}", f"--steps={LOST_STEPS}", "--ckpt_every=1", "--slow_after=2",
          "--sleep_s=1", f"--heartbeat_s={heartbeat_s}", f"--peer_check_s={peer_check_s}",
          "--async_ckpt=0"]  # synchronous saves: each "checkpoint" event is a committed step
  with mp.job(args, 2, 4) as job:
    mp.wait_for_output(job, 0, r'"event": "checkpoint", "step": 3', JOB_TIMEOUT_S)
    killed_at = time.monotonic()
    mp.signal_process(job, 1, signal.SIGKILL)
    results = mp.wait(job, 90)
  survivor = results[0]
  took = survivor.elapsed_s - (killed_at - job.processes[0].started)
  print(f"peer_guard: survivor exited {took:.1f} s after the kill, status "
        f"{survivor.returncode}")
  assert results[1].returncode == -signal.SIGKILL, mp.describe(results)
  assert survivor.returncode == 75, mp.describe(results)
  # jax 0.10.2: the collective fails and process 1 misses the check-in; jax 0.12: the
  # collective blocks and process 1's signs of life stop.
  assert re.search(r"fnscale\.DistributedError: lost process 1 of 2: (a collective "
                   r"failed in process 0 .* did not check in within|process 1 gave no sign "
                   r"of life for) 2(\.0)? s", survivor.stderr), mp.describe(results)
  assert "Fix: look at the log of process 1" in survivor.stderr
  assert "stopped sending heartbeats" not in survivor.stderr  # not JAX's own abort
  # The design: the next step's collective fails at once, then a 2-s check-in.
  assert took < peer_check_s + 6, mp.describe(results)
  # The newest complete checkpoint loads and equals the 1-process reference at that step.
  last = checkpoint.latest_step(out / "ckpt")
  assert last is not None and 3 <= last < LOST_STEPS
  state, extra = checkpoint.restore(out / "ckpt", reference["state"])
  assert extra == {"step": last} and int(state.step) == last
  assert _max_diff(mp_worker.gathered_params(state.params), reference["params"][last]) <= TOL


@pytest.mark.slow
def test_process_that_never_starts_fails_the_others_in_time(tmp_path):
  timeout_s = 8
  results = mp.run([WORKER, f"--out={tmp_path}", f"--init_timeout_s={timeout_s}"], 3, 1,
                   JOB_TIMEOUT_S, process_ids=[0, 1])
  for r in results:
    assert r.returncode == 75, mp.describe(results)
    formed = ("fnscale.DistributedError: could not form the multi-process job within "
              f"{timeout_s} s: expected 3 processes")
    # Process 0 holds the roll call first: on a loaded machine a peer can spend its whole
    # timeout reaching the coordinator, and ends with that error instead (named, in time).
    unreached = ("fnscale.DistributedError: could not form the multi-process job: "
                 f"expected 3 processes, this one as process {r.process_id}, but the "
                 "coordinator 127.0.0.1:")
    assert (formed in r.stderr and f"this process ({r.process_id}) is in" in r.stderr) or (
        r.process_id and unreached in r.stderr), mp.describe(results)
    assert not _events(r.stdout)  # never got as far as training


@pytest.mark.slow  # the quick tier's time: a harness check, not fnscale's
def test_harness_kills_a_hung_job(tmp_path):
  t0 = time.monotonic()
  (r,) = mp.run(["-c", "import time; print('up', flush=True); time.sleep(600)"], 1, 1, 3)
  assert r.timed_out and r.returncode is None and "up" in r.stdout
  assert time.monotonic() - t0 < 30


def test_records_survive_another_library_writing_mid_line():
  """What a worker printed while Gloo wrote from its own thread: a record after
  foreign text on its line, foreign text after a record, and lines without one."""
  out = ('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks'
         ' is : 1\n[Gloo] Rank {"info": [0, 2, "127.0.0.1:56065", true], "total": 3}0\n is '
         'connected to 1 peer ranks.\n{"event": "step", "loss": 1.5}[Gloo] {x\n'
         '{"a": {"b": [1]}}\n[1, 2]\n')
  assert mp.records(out) == [{"info": [0, 2, "127.0.0.1:56065", True], "total": 3},
                             {"event": "step", "loss": 1.5}, {"a": {"b": [1]}}]


def test_per_process_checkpoint_directories_are_refused_before_training(tmp_path):
  """Each process given its own directory (per-host disks): every process ends with a
  DistributedError naming the process that can't see process 0's token, before any step."""
  results = mp.run([WORKER, f"--steps={STEPS}", "--mesh=data=2,fsdp=2", "--batch=8"], 2, 2,
                   JOB_TIMEOUT_S, process_args={
      0: [f"--out={tmp_path / 'host0'}"], 1: [f"--out={tmp_path / 'host1'}"]})
  for r in results:
    assert r.returncode == 75, mp.describe(results)
    m = re.search(r"fnscale\.DistributedError: directory \S+ is not shared by the 2 "
                  r"processes: process 0 wrote \.fnscale-shared-check-\w+ there, and process 1 "
                  r"\(host [^)]+\) doesn't see it \((\S+) does not exist here\)", r.stderr)
    assert m, mp.describe(results)
    assert m[1].startswith(str(tmp_path / "host1" / "ckpt")), m[1]
    assert "fix: use a bucket (gs://BUCKET/PATH) or a shared file system" in r.stderr
    assert not [e for e in _events(r.stdout) if e["event"] == "step"]
  # Process 0 cleaned up its token; nothing else was written.
  assert os.listdir(tmp_path / "host0" / "ckpt") == []


_RESTORE = """
import json, sys
sys.path.insert(0, {tests!r})
import multiprocess
multiprocess.initialize_from_env(timeout_s=60, heartbeat_timeout_s=30)
import jax, numpy as np
import fnscale as fs
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = fs.make_mesh({{"data": -1}})
target = {{"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}}
out = {{}}
for name, directory in (("shared", {shared!r}), ("own", sys.argv[1])):
  try:
    state, extra = fs.checkpoint.restore(directory, target)
    out[name] = {{"extra": extra, "w": np.asarray(state["w"]).tolist()}}
  except fs.FnscaleError as e:
    out[name] = {{"error": f"{{type(e).__name__}}: {{e}}"}}
print(json.dumps(out), flush=True)
"""


def test_restore_agrees_on_process_0s_step(tmp_path):
  """One shared directory: every process restores process 0's newest step. Directories that
  differ (process 1's newest step is incomplete there): not each its own newest good step,
  but an error on every process naming the process that can't use process 0's choice."""
  shared = tmp_path / "shared"
  for step in (2, 4):
    checkpoint.save(shared, step, {"w": np.arange(8, dtype=np.float32) * step},
                    extra={"step": step})
  own = {p: tmp_path / f"host{p}" for p in (0, 1)}
  for d in own.values():
    shutil.copytree(shared, d)
  (own[1] / "4" / "commit_success.txt").unlink()  # step 4 never committed on host 1
  assert checkpoint.latest_step(own[1]) == 2
  script = tmp_path / "restore.py"
  script.write_text(_RESTORE.format(tests=str(pathlib.Path(__file__).parent),
                                    shared=str(shared)))
  results = mp.run([script], 2, 2, JOB_TIMEOUT_S,
                   process_args={p: [str(d)] for p, d in own.items()})
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  outs = [mp.records(r.stdout)[-1] for r in results]
  for p, out in enumerate(outs):
    assert out["shared"] == {"extra": {"step": 4}, "w": (np.arange(8) * 4.0).tolist()}, out
    assert out["own"]["error"].startswith(
        f"DistributedError: the checkpoint step to restore from {own[p]}: process 0 chose 4, "
        f"which not every process can use (process 1: step 4 at {own[1] / '4'} is incomplete: "
        "orbax's commit marker is missing"), out
