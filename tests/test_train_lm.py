"""recipes/train_lm.py and recipes/launch_local.py end to end, on simulated CPU devices.

Runs go through the recipe's public entry points (`main(argv)` for exit codes and messages,
`run(parse_flags(argv))` for the summary and final state) with the `nano` model and a few
steps; a shared persistent compilation cache keeps repeated compiles cheap.
"""
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from recipes import data
from recipes import gpt
from recipes import harness
from recipes import launch_local
from recipes import train_lm

ROOT = pathlib.Path(__file__).resolve().parents[1]

STEPS = 6


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  """A small text corpus (the first stdlib files, ~300 KB) and a shared compile cache."""
  d = tmp_path_factory.mktemp("train_lm")
  text = bytearray()
  for f in data.corpus_files(None):
    text += pathlib.Path(f).read_bytes()
    if len(text) > 300_000:
      break
  (d / "corpus.txt").write_bytes(bytes(text))
  return d


def _argv(work, run_dir, *extra):
  return ["train_lm", "--model_config=nano", "--mesh=data=-1,fsdp=2", "--seq=32",
          "--global_batch=16",
          f"--steps={STEPS}",
          f"--dataset={work / 'corpus.txt'}", f"--run_dir={run_dir}", "--eval_batches=1",
          "--log_every=1", "--sample_len=0", f"--compile_cache_dir={work / 'cache'}",
          *extra]


def _run(argv):
  return train_lm.run(harness.parse_flags(train_lm.Options, argv))


def _params(summary):
  return jax.tree.map(np.asarray, jax.device_get(summary.state.params))


def _assert_equal_trees(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _records(run_dir, event):
  lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.parametrize("size, layers, d_model", [("small", 12, 768), ("medium", 24, 1024)])
def test_model_sizes_and_logical_axes(size, layers, d_model):
  cfg = gpt.model_config(size, 1024)
  shapes = jax.eval_shape(functools.partial(gpt.init_params, cfg), jax.random.key(0))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  # GPT-2 blocks: 12 d^2 weights + 13 d biases and norms; tied byte embedding, 1024 positions.
  assert n == layers * (12 * d_model**2 + 13 * d_model) + (256 + 1024 + 2) * d_model
  axes = gpt.logical_axes(cfg)
  ranks = jax.tree.map(lambda x: x.ndim, shapes)
  names = jax.tree.map(len, axes, is_leaf=lambda x: isinstance(x, tuple))
  assert ranks == names  # every param has one logical name per dimension


@pytest.fixture(scope="module")
def uninterrupted(work):
  """6 steps without a stop, on a data=4,fsdp=2 mesh (FSDP-sharded params)."""
  run_dir = work / "uninterrupted"
  return _run(_argv(work, run_dir, "--nocheckpoint", "--sample_len=24")), run_dir


def test_nano_run_trains_and_writes_metrics(uninterrupted):
  summary, run_dir = uninterrupted
  train = _records(run_dir, "train")
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  losses = [r["loss"] for r in train]
  assert all(np.isfinite(losses))
  assert losses[0] > 5.0  # about ln(256) = 5.55 at init
  assert losses[-1] < losses[0] - 0.5
  evals = _records(run_dir, "eval")
  assert [r["step"] for r in evals][0] == 0 and evals[-1]["step"] == STEPS
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
  assert evals[-1]["bits_per_byte"] == pytest.approx(evals[-1]["eval_loss"] / np.log(2))
  assert summary.final_step == STEPS and summary.mesh == {"data": 4, "fsdp": 2}
  assert summary.tokens_per_s > 0 and 0 < summary.mfu < 1
  assert len(summary.sample.encode("utf-8", errors="replace")) >= 24
  assert _records(run_dir, "summary")[0]["eval_loss"] == summary.eval_loss


def test_stop_and_resume_is_bitwise_equal(work, uninterrupted, capsys):
  run_dir = work / "resumed"
  argv = _argv(work, run_dir, "--checkpoint_every=3", "--stop_after=3")
  first = _run(argv)
  assert first.stopped == "--stop_after=3" and first.final_step == 3
  assert (run_dir / "checkpoints" / "3").is_dir()
  second = _run(argv)  # the same command resumes
  assert second.resumed_from == 3 and second.final_step == STEPS
  assert "resumed from step 3" in capsys.readouterr().out
  _assert_equal_trees(_params(second), _params(uninterrupted[0]))
  # The data position is the step: the resumed run logged exactly the missing steps.
  assert [r["step"] for r in _records(run_dir, "train")] == list(range(1, STEPS + 1))
  assert [r["loss"] for r in _records(run_dir, "train")] == [
      r["loss"] for r in _records(uninterrupted[1], "train")]


def test_sigterm_saves_a_checkpoint_and_stops(work):
  """A preemption notice (SIGTERM) mid-run: checkpoint at the next step, exit 143."""
  run_dir = work / "sigterm"
  metrics = run_dir / "metrics.jsonl"

  def preempt():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if metrics.exists() and '"event": "train"' in metrics.read_text():
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.05)

  thread = threading.Thread(target=preempt, daemon=True)
  thread.start()
  previous = signal.getsignal(signal.SIGTERM)
  assert train_lm.main(_argv(work, run_dir, "--steps=100000", "--checkpoint_every=0")) == 143
  thread.join()
  assert signal.getsignal(signal.SIGTERM) is previous  # the handler is uninstalled
  summary = _records(run_dir, "summary")[-1]
  assert summary["stopped"] == "SIGTERM" and 0 < summary["final_step"] < 100000
  assert (run_dir / "checkpoints" / str(summary["final_step"]) / "commit_success.txt").exists()


def _checkpointed_at_3(work, name):
  """A run dir holding only the step-3 checkpoint of the resume test."""
  src = work / "resumed" / "checkpoints" / "3"
  if not src.is_dir():
    pytest.skip("needs test_stop_and_resume_is_bitwise_equal's checkpoint")
  run_dir = work / name
  shutil.copytree(src, run_dir / "checkpoints" / "3")
  return run_dir


def test_resume_onto_a_different_mesh(work, uninterrupted):
  run_dir = _checkpointed_at_3(work, "other_mesh")
  summary = _run(_argv(work, run_dir, "--mesh=data=2,fsdp=4"))
  assert summary.resumed_from == 3 and summary.mesh == {"data": 2, "fsdp": 4}
  # Same math, other reduction order: equal up to float rounding.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               _params(summary), _params(uninterrupted[0]))


def test_resume_onto_4_devices_in_a_subprocess(work, uninterrupted):
  run_dir = _checkpointed_at_3(work, "four_devices")
  cmd = [sys.executable, str(ROOT / "recipes" / "train_lm.py"), "--devices=4",
         *_argv(work, run_dir)[1:]]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "resumed from step 3" in out.stdout
  assert "over 4 devices" in out.stdout
  final = _records(run_dir, "summary")[-1]
  assert final["devices"] == 4 and final["final_step"] == STEPS
  assert final["eval_loss"] == pytest.approx(uninterrupted[0].eval_loss, rel=1e-4)


def test_corrupt_checkpoint_is_refused_and_kept(work, uninterrupted, capsys):
  run_dir = _checkpointed_at_3(work, "corrupt")
  bad = run_dir / "checkpoints" / "6"
  shutil.copytree(run_dir / "checkpoints" / "3", bad)
  (bad / "commit_success.txt").unlink()  # a save that never finished
  summary = _run(_argv(work, run_dir))
  out = capsys.readouterr().out
  assert "refused step(s) [6]" in out and "resumed from step 3" in out
  assert summary.resumed_from == 3 and summary.final_step == STEPS
  _assert_equal_trees(_params(summary), _params(uninterrupted[0]))
  # The damaged directory is kept (moved aside), never overwritten.
  kept = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("6.corrupt")]
  assert len(kept) == 1 and not (kept[0] / "commit_success.txt").exists()
  assert (run_dir / "checkpoints" / "6" / "commit_success.txt").exists()


def test_no_good_checkpoint_is_an_error(work, capsys):
  run_dir = work / "all_corrupt"
  (run_dir / "checkpoints" / "3").mkdir(parents=True)  # empty: no marker, no metadata
  assert train_lm.main(_argv(work, run_dir)) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: no usable checkpoint") and "step 3" in err[-1]
  assert "Traceback" not in "\n".join(err)
  assert os.listdir(run_dir / "checkpoints" / "3") == []  # untouched


@pytest.mark.multiprocess
def test_launcher_two_processes_match_one(work, uninterrupted):
  run_dir = work / "two_processes"
  argv = [str(ROOT / "recipes" / "train_lm.py"),
          *_argv(work, run_dir, "--nocheckpoint", "--sample_len=8")[1:]]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  results = launch_local.launch(argv, 2, 4, timeout_s=300, env=env, stream=lambda line: None)
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i}:\n{out[-3000:]}"
  assert "2 process(es) x 4 devices" in results[0][1]
  assert "eval  step" not in results[1][1]  # only process 0 prints
  two, one = _records(run_dir, "summary")[-1], uninterrupted[0]
  assert two["processes"] == 2 and two["devices"] == 8 and two["sample"]
  assert two["loss"] == pytest.approx(one.loss, rel=1e-5)
  assert two["eval_loss"] == pytest.approx(one.eval_loss, rel=1e-5)


def test_launcher_stops_everyone_when_one_fails(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text("import os, sys, time\n"
                    "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                    "  sys.exit(3)\n"
                    "print('waiting', os.environ['JAX_NUM_PROCESSES'], flush=True)\n"
                    "time.sleep(60)\n")
  lines = []
  results = launch_local.launch([str(script)], 2, 1, timeout_s=30, stream=lines.append,
                                grace_s=2)
  assert results[1][0] == 3
  assert results[0][0] < 0  # stopped by a signal, well before its 60 s sleep ended
  assert any("process 1 exited with 3" in line for line in lines)
  assert launch_local.main(["launch_local", "--num_processes=2", "--devices_per_process=1",
                            "--timeout_s=30", "--", str(script)]) == 3


def test_launcher_child_environment():
  env = launch_local.child_env(1, 2, 4, 1234, base={"XLA_FLAGS": "--xla_foo=1 "
                                                   "--xla_force_host_platform_device_count=8"})
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
  assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == (
      "127.0.0.1:1234", "2", "1")
  with pytest.raises(ValueError, match="num_processes=0"):
    launch_local.launch(["x.py"], 0, 4)


@pytest.mark.parametrize("case, extra, message", [
    ("missing data", ["--dataset={tmp}/nope.txt"], "no such file, directory or glob match"),
    ("empty corpus", ["--dataset={tmp}/empty.txt"], "the corpus is empty"),
    ("empty directory", ["--dataset={tmp}/emptydir"], "directory has no files"),
    ("seq longer than data", ["--dataset={tmp}/short.txt", "--seq=64"],
     "--seq=64 is longer than the data"),
    ("mesh too big", ["--mesh=data=3"], "data"),
    ("mesh shape mismatch", ["--mesh_shape=2x2x4"],
     "mesh_shape='2x2x4': topology from override says 1 slice(s) x 2x2x4 = 16 devices, but 8 "
     "cpu devices are present"),
    ("batch not dividing", ["--global_batch=12"],
     "global batch 12 does not divide over the data axes"),
    ("unknown model", ["--model_config=huge"], "model_config='huge' is not a known GPT size"),
    ("bad flag value", ["--steps=many"], "steps"),
    ("bad precision", ["--precision=float12"], "is not a jmp policy"),
    ("zero seq", ["--seq=0"], "seq=0, batch_size=4, global_batch=16, accum_steps=1: each must "
     "be >= 1"),
    ("zero batch", ["--global_batch=0"], "global_batch=0, accum_steps=1: each must be >= 1"),
    ("zero lr", ["--lr=0"], "lr=0.0, log_every=1, eval_every=1: expected lr > 0 and intervals "
     ">= 1"),
])
def test_bad_input_is_one_clear_line(work, tmp_path, capsys, case, extra, message):
  del case
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "emptydir").mkdir()
  (tmp_path / "short.txt").write_bytes(b"x" * 100)
  extra = [e.format(tmp=tmp_path) for e in extra]
  assert train_lm.main(_argv(work, tmp_path / "run", *extra)) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last
  assert not (tmp_path / "run" / "checkpoints").exists()  # nothing written
