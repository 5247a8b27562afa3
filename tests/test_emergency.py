"""Emergency copies (recipes/lm/emergency.py, --emergency_every): a job whose process is killed
(-9) is restarted by launch_local and resumes from the newest copy, losing at most
--emergency_every steps, its loss curve bitwise the uninterrupted run's; started again on
fewer processes, it keeps its global batch and reads the same rows; bad emergency
directories are `error:` lines that leave the checkpoints as they were."""
import json
import os
import pathlib
import re
import shutil
import signal

import pytest

import fnscale as fs
from recipes import train_lm
from recipes.launch import launch_local

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _argv(work, run_dir, *extra, steps=6):
  return ["--model_config=nano", "--mesh=data=-1,fsdp=2", "--seq=32", "--global_batch=16",
          f"--steps={steps}", f"--dataset={work / 'corpus.txt'}", f"--run_dir={run_dir}",
          "--eval_batches=1", "--eval_every=1000", "--log_every=1", "--sample_len=0",
          f"--compile_cache_dir={work / 'cache'}", *extra]


def _losses(run_dir):
  """[(step, train loss)] of run_dir's metrics.jsonl, as written (full float precision)."""
  lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
  return [(r["step"], r["train/loss"]) for r in map(json.loads, lines) if "train/loss" in r]


STEPS, EVERY, KILL_AT = 20, 10, 14
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _job(work, run_dir, stream, num_processes=4, max_restarts=2):
  """train_lm as `num_processes` processes x 2 devices under launch_local, the batch left to
  the default (8 rows a device: 64 on 8 devices), an emergency copy every 10 steps and the
  persistent saves every 200 (none before the end)."""
  recipe = [str(ROOT / "recipes" / "train_lm.py"),
            *[a for a in _argv(work, run_dir, f"--emergency_every={EVERY}", steps=STEPS)
              if not a.startswith("--global_batch")]]
  return launch_local.supervise(recipe, num_processes, 2, timeout_s=900, env=ENV,
                                stream=stream, max_restarts=max_restarts)


def _killer(lines: list, process: int, at: int, steps: int):
  """A launcher stream that keeps each line in `lines` and kills (-9) `process` when process 0
  reports step `at` of `steps`."""
  pids = {}

  def watch(line):
    lines.append(line)
    if re.match(r"launch_local: started (.*)", line) and not pids:
      pids.update((int(i), int(p)) for i, p in re.findall(r"process (\d+) pid (\d+)", line))
    if process in pids and re.match(rf"step\s+{at}/{steps}\b", line):
      os.kill(pids.pop(process), signal.SIGKILL)
  return watch


def _killed(work, run_dir, max_restarts):
  """`_job` on 4 processes, process 2 killed (-9) when process 0 reports step 14: (outcome,
  what process 0 and the launcher said)."""
  lines = []
  watch = _killer(lines, 2, KILL_AT, STEPS)

  return _job(work, run_dir, watch, max_restarts=max_restarts), "".join(lines)


@pytest.fixture(scope="module")
def whole(work):
  run_dir = work / "whole"
  out = _job(work, run_dir, lambda line: None)
  assert [rc for rc, _ in out.results] == [0] * 4, out.results[0][1][-3000:]
  assert [s for s, _ in _losses(run_dir)] == list(range(1, STEPS + 1))
  return run_dir


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_killed_mid_run_costs_at_most_the_emergency_interval(work, whole):
  """Process 2 of 4 is killed (-9) at step 14: launch_local stops the others and starts the
  job again; it resumes from the copy of step 10, so the work lost is the steps trained
  after it (<= 10), and every step's loss equals the uninterrupted run's, bit for bit."""
  out, text = _killed(work, work / "killed", max_restarts=2)
  assert [rc for rc, _ in out.results] == [0] * 4 and out.restarts == 1, text[-4000:]
  assert "launch_local: restart 1 of 2: process 2 was ended by SIGKILL" in text, text[-4000:]
  first, second = text.split("launch_local: restart 1 of 2")
  resumed = re.search(r"resuming from the emergency copy of step (\d+)", second)
  assert resumed and int(resumed[1]) == EVERY, second[:3000]
  trained = max(int(s) for s in re.findall(r"^step\s+(\d+)/", first, re.M))
  assert KILL_AT <= trained and trained - int(resumed[1]) <= EVERY  # the work lost
  assert re.search(r"lost [\d.]+% \(\d+ steps redone\)", second)  # goodput books it
  assert _losses(work / "killed") == _losses(whole)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_job_that_lost_a_process_continues_on_fewer(work, whole):
  """The same kill with no restart left; the job is started again on 2 processes x 2
  devices. It resumes from the copy of step 10 onto the new mesh, keeps the global batch of
  64 rows (16 a device instead of 8) and reads the same rows: step 11's loss, from the same
  params and rows, equals the uninterrupted run's up to reduction order (other rows would
  differ by ~1e-2), and so does the last."""
  run_dir = work / "fewer"
  out, text = _killed(work, run_dir, max_restarts=0)
  assert out.failure.status == launch_local.EXIT_JOB_FAILED and out.restarts == 0
  lines = []
  out = _job(work, run_dir, lines.append, num_processes=2, max_restarts=0)
  text = "".join(lines)
  assert [rc for rc, _ in out.results] == [0] * 2, text[-4000:]
  assert (f"train_lm: {run_dir} was trained with global batch 64 on 8 devices; keeping it on "
          "these 4 (by default 32)") in text, text[:4000]
  assert "resuming from the emergency copy of step 10" in text
  summary = json.loads((run_dir / "run.json").read_text())["summary"]
  assert summary["processes"] == 2 and summary["devices"] == 4
  mine, theirs = dict(_losses(run_dir)), dict(_losses(whole))
  assert sorted(mine) == list(range(1, STEPS + 1))
  assert [mine[s] for s in range(1, 11)] == [theirs[s] for s in range(1, 11)]
  assert mine[11] == pytest.approx(theirs[11], rel=1e-5)
  assert mine[STEPS] == pytest.approx(theirs[STEPS], rel=1e-3)


@pytest.fixture(scope="module")
def saved_at_5(work):
  """A run stopped at step 5 of 6: a checkpoint of step 5, emergency copies of steps 2, 4."""
  run_dir = work / "saved_at_5"
  assert train_lm.main(["train_lm", *_argv(work, run_dir, "--emergency_every=2",
                                           "--stop_after=5")]) == 0
  assert sorted(os.listdir(run_dir / "emergency")) == ["2", "4", "owner.json"]
  return run_dir


def _copy(template, run_dir):
  shutil.copytree(template, run_dir)
  return run_dir


def _steps(run_dir):
  return fs.checkpoint.steps(pathlib.Path(run_dir) / "checkpoints")


@pytest.mark.slow
def test_an_unwritable_emergency_dir_is_an_error_and_the_checkpoints_stay(work, saved_at_5,
                                                                          tmp_path, capsys):
  run_dir = _copy(saved_at_5, tmp_path / "run")
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  bad = blocker / "emergency"  # under a file: nothing can be made there (as root too)
  rc = train_lm.main(["train_lm", *_argv(work, run_dir, "--emergency_every=2",
                                         f"--emergency_dir={bad}")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and err[-1].startswith(f"error: --emergency_dir={bad} can't be written "
                                        "(NotADirectoryError"), err
  assert "--emergency_every=0" in err[-1] and f"{run_dir / 'checkpoints'} are untouched" in err[-1]
  assert _steps(run_dir) == (5,)
  # The file itself, for a fresh run: named as a file, and nothing said to be kept.
  rc = train_lm.main(["train_lm", *_argv(work, tmp_path / "fresh", "--emergency_every=2",
                                         f"--emergency_dir={blocker}")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and err[-1].startswith(f"error: --emergency_dir={blocker} is a file, not a "
                                        "directory;"), err
  assert err[-1].endswith("nothing was saved"), err
  # Node-local ({process} given): the fix is said for that form. An empty checkpoint
  # directory (as a refused start may leave) holds nothing said to be kept.
  (tmp_path / "fresh" / "checkpoints").mkdir(parents=True, exist_ok=True)
  rc = train_lm.main(["train_lm", *_argv(work, tmp_path / "fresh", "--emergency_every=2",
                                         f"--emergency_dir={blocker}/{{process}}")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and f"--emergency_dir={blocker}/0 can't be written" in err[-1], err
  assert "a local disk's path on each host, with {process} in it" in err[-1], err
  assert "shared file system" not in err[-1], err
  assert err[-1].endswith("nothing was saved"), err
  # A bucket: the copies are for a fast file system; nothing is made locally in its name.
  rc = train_lm.main(["train_lm", *_argv(work, run_dir, "--emergency_every=2",
                                         "--emergency_dir=gs://bucket/e")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and err[-1].startswith("error: --emergency_dir=gs://bucket/e: emergency "
                                        "copies are for a fast file system path"), err
  assert not pathlib.Path("gs:").exists() and _steps(run_dir) == (5,)


@pytest.mark.slow
def test_another_runs_copies_are_refused(work, saved_at_5, tmp_path, capsys):
  """Two runs given one --emergency_dir: the second would resume from the first's state."""
  shared = _copy(saved_at_5 / "emergency", tmp_path / "shared")
  run_dir = tmp_path / "mine"
  rc = train_lm.main(["train_lm", *_argv(work, run_dir, "--emergency_every=2",
                                         f"--emergency_dir={shared}")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2, err
  assert err[-1].startswith(f"error: --emergency_dir={shared} holds the emergency copies of "
                            f"another run (steps [2, 4]; run_dir '{saved_at_5}' (this run: "
                            f"'{run_dir}')): this run would resume from that run's state. "
                            "Fix: give this run its own --emergency_dir"), err[-1]
  assert not (run_dir / "checkpoints").exists()
  assert sorted(os.listdir(shared)) == ["2", "4", "owner.json"]


@pytest.mark.slow
def test_the_newer_of_checkpoint_and_copy_is_resumed_and_named(work, saved_at_5, tmp_path,
                                                               capsys):
  """The checkpoint of step 5 is newer than the copy of step 4: it is taken. Without it (a
  crash before it was written), the copy of step 4. Either run ends as one that never
  stopped."""
  whole = tmp_path / "whole"
  assert train_lm.main(["train_lm", *_argv(work, whole, "--nocheckpoint")]) == 0
  run_dir = _copy(saved_at_5, tmp_path / "run")
  assert train_lm.main(["train_lm", *_argv(work, run_dir, "--emergency_every=2")]) == 0
  out = capsys.readouterr().out
  assert ("the newest checkpoint (step 5) is not older than the newest emergency copy (step "
          f"4, {run_dir / 'emergency'}): resuming from the checkpoint") in out
  assert f"resumed from step 5 ({run_dir / 'checkpoints'})" in out
  assert _losses(run_dir) == _losses(whole)
  crashed = _copy(saved_at_5, tmp_path / "crashed")
  shutil.rmtree(crashed / "checkpoints" / "5")
  assert train_lm.main(["train_lm", *_argv(work, crashed, "--emergency_every=2")]) == 0
  out = capsys.readouterr().out
  assert (f"resuming from the emergency copy of step 4 ({crashed / 'emergency'}); there is no "
          "checkpoint") in out
  assert f"resumed from step 4 ({crashed / 'emergency'})" in out
  assert _losses(crashed) == _losses(whole)


def test_the_step_resumed_is_the_newest_the_local_copies_give_whole():
  """Process i's directory holds its own shards and a replica of process (i+1) % n's: a step
  is whole when each process's shards are in its own directory or its peer's, counted by
  hand."""
  from recipes.lm.peer_copies import complete_step
  assert complete_step([{10, 20}, {10, 20}]) == 20
  assert complete_step([{10, 20}, set()]) == 20  # process 1's from process 0's replica
  assert complete_step([{10, 20}, set(), {10}]) == 10  # 20: process 2's only on process 2
  assert complete_step([{10}, {20}, set()]) is None  # process 2's own and replica both gone
  assert complete_step([{20}, set(), set()]) is None  # two hosts lost, side by side
  assert complete_step([{10, 20}, {20}, set(), {10, 20}]) == 20
  assert complete_step([set(), set()]) is None and complete_step([{4}]) == 4


LOCAL_STEPS, LOCAL_EVERY, LOCAL_KILL_AT = 8, 4, 7


def _local_job(work, run_dir, local, stream, max_restarts):
  """train_lm as 2 processes x 2 devices under launch_local, an emergency copy every 4 steps
  in each process's own directory `local`/<process index> (`{process}`: one machine stands
  for two hosts' local disks)."""
  recipe = [str(ROOT / "recipes" / "train_lm.py"),
            *[a for a in _argv(work, run_dir, f"--emergency_every={LOCAL_EVERY}",
                               f"--emergency_dir={local}/{{process}}", steps=LOCAL_STEPS)
              if not a.startswith("--global_batch")]]
  return launch_local.supervise(recipe, 2, 2, timeout_s=300, env=ENV, stream=stream,
                                max_restarts=max_restarts)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_hosts_shards_come_back_from_its_peers_replica(work, tmp_path):
  """Process 1 of 2 is killed (-9) at step 7 and its local directory deleted (its host
  lost); the restart resumes from the copy of step 4, process 1's shards and data position
  from the replica process 0 keeps. The steps trained again (5 to 7, from the restored state
  and rows) have bitwise the losses the run had before the kill, and it goes on to the end."""
  run_dir, local, lines = tmp_path / "run", tmp_path / "local", []
  kill = _killer(lines, 1, LOCAL_KILL_AT, LOCAL_STEPS)

  def watch(line):
    kill(line)
    if line.startswith("launch_local: restart 1 of 1"):  # before the job starts again
      shutil.copy(run_dir / "metrics.jsonl", tmp_path / "before.jsonl")
      assert sorted(os.listdir(local / "1")) == [str(LOCAL_EVERY), "owner.json"]
      shutil.rmtree(local / "1")

  out = _local_job(work, run_dir, local, watch, 1)
  text = "".join(lines)
  assert [rc for rc, _ in out.results] == [0, 0] and out.restarts == 1, text[-4000:]
  second = text.split("launch_local: restart 1 of 1")[1]
  assert (f"resuming from the emergency copy of step {LOCAL_EVERY} ({local}/{{process}}: "
          "process 1's shards from process 0's replica); there is no checkpoint"
          ) in second, second[:3000]
  (tmp_path / "before").mkdir()
  shutil.move(tmp_path / "before.jsonl", tmp_path / "before" / "metrics.jsonl")
  before, after = dict(_losses(tmp_path / "before")), dict(_losses(run_dir))
  assert sorted(after) == list(range(1, LOCAL_STEPS + 1))
  assert LOCAL_KILL_AT in before and all(after[s] == before[s] for s in before), (before, after)


class _Position:
  """A data iterator's position, as grain's iterators give it (`get_state`/`set_state`)."""

  def __init__(self, state):
    self.state = state

  def get_state(self):
    return dict(self.state)

  def set_state(self, state):
    self.state = state


def test_node_local_copies_give_back_every_shard_and_pass_over_another_mesh(tmp_path):
  """One process's copies in its own directory: the newest 2 kept; restored onto the same
  mesh, each leaf (an fsdp-sharded f32, a replicated bf16) equals the saved values bit for
  bit in the same sharding, with the data position; on another mesh they are passed over."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from recipes.lm import peer_copies
  mesh = fs.make_mesh({"data": 4, "fsdp": 2})
  w = np.arange(64, dtype=np.float32).reshape(16, 4) / 7
  b = (np.arange(6, dtype=np.float32) / 3).astype(jnp.bfloat16)
  state = {"w": jax.device_put(w, NamedSharding(mesh, P("fsdp"))),
           "b": jax.device_put(b, NamedSharding(mesh, P()))}
  where = str(tmp_path / "{process}")
  copies = peer_copies.Copies(where, mesh, keep=2)
  for step in (2, 4, 6):
    copies.save(step, state, _Position({"batch": step}), {"step": step})
  copies.close()
  assert sorted(os.listdir(tmp_path / "0")) == ["4", "6"]
  again = peer_copies.Copies(where, mesh, keep=2)
  assert again.latest_step() == 6
  data = _Position({})
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  got, extra, lost = again.restore(6, target, data)
  assert extra == {"step": 6} and data.state == {"batch": 6} and lost == []
  assert got["w"].sharding == state["w"].sharding and got["b"].dtype == jnp.bfloat16
  assert np.array_equal(np.asarray(got["w"]), w)
  assert np.asarray(got["b"]).tobytes() == b.tobytes()
  other = peer_copies.Copies(where, fs.make_mesh({"fsdp": 8}), keep=2)
  assert other.latest_step() is None and other.foreign == [4, 6]
