"""fnscale.checkpoint in multi-process jobs on 127.0.0.1 (tests/multiprocess.py, 2 processes x 4
CPU devices): a preemption notice while an async save is still being written, and grain data
positions per process across a stop and a resume with the same or another process count."""
import pathlib
import signal
import sys
import time

import numpy as np
import pytest

import fnscale as fs
from fnscale import checkpoint

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mp_worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.multiprocess

WORKER = str(pathlib.Path(mp_worker.__file__))
GRAIN_WORKER = str(pathlib.Path(__file__).resolve().parent / "grain_worker.py")
JOB_TIMEOUT_S = 240
TOL = 1e-6


def _events(stdout: str) -> list[dict]:
  return mp.records(stdout)


def _reference(steps: int):
  """The 1 x 8 reference in this process: params (gathered, by path) after each step, and the
  final state (a restore target on the 1 x 8 mesh)."""
  import models  # pylint: disable=import-outside-toplevel
  mesh, _, step, init = mp_worker.build("data=2,fsdp=4")
  state, bs, params = init(), fs.batch_sharding(mesh), {}
  for s in range(steps):
    tokens = mp_worker.global_tokens(s, 16, models.TRANSFORMER.seq, models.TRANSFORMER.vocab)
    state, _ = step(state, fs.global_batch({"tokens": tokens}, bs))
    params[s + 1] = mp_worker.gathered_params(state.params)
  return params, state


@pytest.mark.slow
def test_sigterm_while_an_async_save_is_in_flight_leaves_a_restorable_step(tmp_path):
  """Every save's commit takes 9 s more (3 s before each of its three renames: slow storage):
  SIGTERM to process 1 right after step 2's save began. The agreed step's save waits for the
  save in flight, is committed itself, and both processes exit 143 within grace_s; every
  saved step restores, equal to 1 x 8."""
  out, grace_s = tmp_path / "job", 40
  args = [WORKER, f"--out={out}", "--steps=8", "--ckpt_every=2", "--slow_commit_s=3",
          "--slow_after=0", "--sleep_s=0.2", f"--grace_s={grace_s}"]
  with mp.job(args, 2, 4) as job:
    mp.wait_for_output(job, 0, r'"event": "checkpoint", "step": 2,', JOB_TIMEOUT_S)
    mp.signal_process(job, 1, signal.SIGTERM)
    noticed = time.monotonic()
    results = mp.wait(job, 120)
  assert all(r.returncode == fs.multihost.EXIT_PREEMPTED for r in results), mp.describe(results)
  for r, p in zip(results, job.processes):
    took = p.started + r.elapsed_s - noticed
    print(f"process {r.process_id} exited {took:.1f} s after the notice")
    assert took < grace_s, mp.describe(results)
  events = [_events(r.stdout) for r in results]
  stops = [[e["step"] for e in ev if e["event"] == "preempted"] for ev in events]
  assert len(stops[0]) == 1 and stops[0] == stops[1], mp.describe(results)
  stop = stops[0][0]
  final = [e for e in events[0] if e["event"] == "checkpoint" and e["step"] == stop]
  assert final and final[0]["previous_in_flight"], mp.describe(results)  # step 2 still writing
  # The notice may reach the loop a few steps later on a loaded machine (step 4 saved too):
  # the saves are every ckpt_every steps then the agreed step, the newest 3 kept (keep=3).
  saved = checkpoint.steps(out / "ckpt")
  assert 2 < stop < 8 and saved == ((*range(2, stop, 2), stop)[-3:]), (saved, stop)
  params, target = _reference(stop)
  for step in saved:
    state, extra = checkpoint.restore(out / "ckpt", target, step=step)
    assert extra == {"step": step} and int(state.step) == step
    got = mp_worker.gathered_params(state.params)
    assert max(float(np.max(np.abs(got[k] - params[step][k]))) for k in got) <= TOL


@pytest.mark.slow
def test_a_lost_process_with_an_async_save_in_flight_ends_the_job_in_seconds(tmp_path):
  """kill -9 of process 1 while step 3's save is being written (commits slowed by 9 s): the
  survivor's loop fails, peer_guard names the lost process and leaving the manager's block
  doesn't wait for a commit that needs the dead process: status 75 well before JAX's
  heartbeat abort (30 s). The newest committed step restores, equal to 1 x 8."""
  out, heartbeat_s = tmp_path / "lost", 30
  args = [WORKER, f"--out={out}", "--steps=8", "--ckpt_every=1", "--slow_commit_s=3",
          "--slow_after=2", "--sleep_s=1", f"--heartbeat_s={heartbeat_s}", "--peer_check_s=2"]
  with mp.job(args, 2, 4) as job:
    mp.wait_for_output(job, 0, r'"event": "checkpoint", "step": 3,', JOB_TIMEOUT_S)
    killed = time.monotonic()
    mp.signal_process(job, 1, signal.SIGKILL)
    results = mp.wait(job, 90)
  survivor = results[0]
  took = job.processes[0].started + survivor.elapsed_s - killed
  print(f"survivor exited {took:.1f} s after the kill, status {survivor.returncode}")
  assert survivor.returncode == 75 and "lost process 1 of 2" in survivor.stderr, (
      mp.describe(results))
  assert took < heartbeat_s - 5, mp.describe(results)
  last = checkpoint.latest_step(out / "ckpt")
  assert last is not None and 1 <= last <= 3
  params, target = _reference(last)
  state, _ = checkpoint.restore(out / "ckpt", target)
  got = mp_worker.gathered_params(state.params)
  assert int(state.step) == last
  assert max(float(np.max(np.abs(got[k] - params[last][k]))) for k in got) <= TOL


def _grain_job(directory, processes: int, mode: str, advance: str = "0"):
  results = mp.run([GRAIN_WORKER, f"--ckpt={directory}", f"--mode={mode}",
                    f"--advance={advance}"], processes, 8 // processes, JOB_TIMEOUT_S)
  return results, {e["process"]: e for r in results for e in _events(r.stdout)}


@pytest.mark.slow
def test_grain_positions_per_process_survive_a_two_process_stop_and_resume(tmp_path):
  stopped, saved = _grain_job(tmp_path / "ckpt", 2, "stop", "3,5")
  assert all(r.returncode == 0 for r in stopped), mp.describe(stopped)
  assert saved[0]["saved"] == {"next_index": 3} and saved[1]["saved"] == {"next_index": 5}
  resumed, got = _grain_job(tmp_path / "ckpt", 2, "resume")
  assert all(r.returncode == 0 for r in resumed), mp.describe(resumed)
  for pid in (0, 1):  # each process at its own position, reading the batch it would have read
    assert got[pid]["restored"] == saved[pid]["saved"]
    assert got[pid]["next"] == saved[pid]["next"]
    assert got[pid]["x"] == list(np.arange(16.0))


@pytest.mark.slow
def test_two_process_positions_resume_in_one_process(tmp_path):
  stopped, saved = _grain_job(tmp_path / "even", 2, "stop", "4,4")
  assert all(r.returncode == 0 for r in stopped), mp.describe(stopped)
  (resumed,), got = _grain_job(tmp_path / "even", 1, "resume")
  assert resumed.returncode == 0, mp.describe([resumed])
  assert got[0]["restored"] == saved[0]["saved"] == saved[1]["saved"] == {"next_index": 4}
  # One process reads the whole global batch: the windows the two read between them.
  assert sorted(got[0]["next"]) == sorted(saved[0]["next"] + saved[1]["next"])
  assert got[0]["x"] == list(np.arange(16.0))

  stopped, _ = _grain_job(tmp_path / "uneven", 2, "stop", "3,5")
  assert all(r.returncode == 0 for r in stopped), mp.describe(stopped)
  (refused,), _ = _grain_job(tmp_path / "uneven", 1, "resume")
  assert refused.returncode != 0
  assert "the 2 saved data positions differ" in refused.stderr, mp.describe([refused])
