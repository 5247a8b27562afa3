"""recipes/train_lm.py and recipes/launch/launch_local.py end to end, on simulated CPU devices.

Runs go through the recipe's public entry points (`main(argv)` for exit codes and messages,
`run(parse_flags(argv))` and `train_lm(**options)` for the summary and final state) with the
`nano` model and a few steps; a shared persistent compilation cache keeps repeated compiles
cheap. Every test builds what it needs through module fixtures, so each passes alone, with -k
and in any order.
"""
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import optax
import pytest
import tokenizers

import fnscale as fs

from recipes.lm import data
from recipes.lm import embedding, gpt, llama, models, moe, remat
from recipes.lm import options
from recipes.lm.options import Options
from recipes.lm import cli, evaluation, goodput, memory, progress, run_setup, rundir, stopping
from recipes.lm import summary as run_summary
from recipes.launch import launch_local
from recipes import plot_run
from recipes import train_lm
from recipes import train_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]

STEPS = 6


# Every run here measures the change each step applies (--update_norm), which the checks of
# the warmup's first step and of stalled runs read.
def _argv(work, run_dir, *extra):
  return ["train_lm", "--model_config=nano", "--mesh=data=-1,fsdp=2", "--seq=32",
          "--global_batch=16", "--update_norm",
          f"--steps={STEPS}",
          f"--dataset={work / 'corpus.txt'}", f"--run_dir={run_dir}", "--eval_batches=1",
          "--log_every=1", "--sample_len=0", f"--compile_cache_dir={work / 'cache'}",
          *extra]


def _kwargs(work, run_dir, **extra):
  """`_argv`'s options as train_lm() keywords."""
  return {**dict(model_config="nano", mesh="data=-1,fsdp=2", seq=32, global_batch=16,
                 steps=STEPS, dataset=str(work / "corpus.txt"), run_dir=str(run_dir),
                 eval_batches=1, log_every=1, sample_len=0, update_norm=True,
                 compile_cache_dir=str(work / "cache")), **extra}


def _run(argv):
  return train_lm.run(cli.parse_flags(train_lm.Options, argv))


def _params(summary):
  return jax.tree.map(np.asarray, jax.device_get(summary.state.params))


def _assert_equal_trees(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _records(run_dir, tag):
  """The metrics.jsonl records that carry `tag` (e.g. "train/loss"), in order."""
  lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if tag in r]


def _summary(run_dir):
  """The "summary" record of run.json (the last run in `run_dir`)."""
  return json.loads((pathlib.Path(run_dir) / "run.json").read_text())["summary"]


@pytest.mark.parametrize("size, layers, d_model", [("small", 12, 768), ("medium", 24, 1024),
                                                   ("tiny_gpt2", 4, 128)])
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
  before = jax.config.jax_compilation_cache_dir
  summary = _run(_argv(work, run_dir, "--nocheckpoint", "--sample_len=24"))
  # The run's --compile_cache_dir is its own: the caller's later compiles don't use it.
  assert jax.config.jax_compilation_cache_dir == before != str(work / "cache")
  return summary, run_dir


def test_nano_run_trains_and_writes_metrics(work, uninterrupted):
  summary, run_dir = uninterrupted
  train = _records(run_dir, "train/loss")
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  losses = [r["train/loss"] for r in train]
  assert all(np.isfinite(losses))
  assert losses[0] > 5.0  # about ln(256) = 5.55 at init
  assert losses[-1] < losses[0] - 0.5
  # Each step logs the lr its update used: the one-step warmup from 0 moves nothing at step 1,
  # step 2 runs at the peak, then the cosine decays (a log one step ahead showed the peak
  # beside an update of 0).
  lrs, norms = [r["train/lr"] for r in train], [r["train/update_norm"] for r in train]
  assert lrs[0] == 0.0 and norms[0] == 0.0 and norms[1] > 0
  assert lrs[1] == max(lrs) and lrs[1:] == sorted(lrs[1:], reverse=True)
  evals = _records(run_dir, "eval/loss")
  assert [r["step"] for r in evals][0] == 0 and evals[-1]["step"] == STEPS
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  assert evals[-1]["eval/bits_per_byte"] == pytest.approx(evals[-1]["eval/loss"] / np.log(2))
  assert summary.final_step == STEPS and summary.mesh == {"data": 4, "fsdp": 2}
  assert summary.tokens_per_s > 0 and 0 < summary.mfu < 1
  assert len(summary.sample.encode("utf-8", errors="replace")) >= 24
  assert _summary(run_dir)["eval_loss"] == summary.eval_loss
  # The corpus's bigram level, in the summary and run.json (plot_run draws it).
  base = data.baseline(data.load(str(work / "corpus.txt")))
  assert summary.bigram_loss == base.bigram and 2.0 < base.bigram < base.unigram
  record = json.loads((run_dir / "run.json").read_text())["data"]
  assert (record["bigram_loss"], record["unigram_loss"]) == (base.bigram, base.unigram)


@pytest.mark.slow
def test_llama_tiny_trains_by_name(work, tmp_path):
  """--model_config=llama-tiny builds the Llama module's model (its param names, its count
  by hand) and a few steps lower the loss from about ln(256)."""
  run_dir = tmp_path / "run"
  summary = _run(_argv(work, run_dir, "--model_config=llama-tiny", "--seq=16", "--steps=4",
                       "--nocheckpoint"))
  p = summary.state.params
  assert p["embed"].shape == (256, 256) and p["unembed"].shape == (256, 256)
  # 4 blocks of d 256, 8 heads of 32 (2 kv heads: k, v 256 x 64), SwiGLU mlp 768, 2 norms.
  per_block = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256
  assert summary.params == 4 * per_block + 2 * 256 * 256 + 256
  losses = [r["train/loss"] for r in _records(run_dir, "train/loss")]
  assert losses[0] == pytest.approx(np.log(256), abs=0.3) and losses[-1] < losses[0] - 0.3


@pytest.mark.slow
def test_mesh_auto_runs_on_the_planners_mesh(work, tmp_path, capsys):
  """--mesh=auto on 8 simulated devices: the run's mesh is the row the planner printed as
  chosen, over all 8 devices, and it trains."""
  summary = _run(_argv(work, tmp_path / "run", "--mesh=auto", "--steps=2", "--nocheckpoint"))
  out = capsys.readouterr().out
  chosen = re.search(r"chosen: ([a-z]+=\d+(?: [a-z]+=\d+)*), remat=(\w+), accum=(\d+)", out)
  assert chosen, out[-3000:]
  want = {k: int(v) for k, v in (kv.split("=") for kv in chosen[1].split())}
  assert {k: v for k, v in summary.mesh.items() if v > 1} == {k: v for k, v in want.items()
                                                             if v > 1}
  assert int(np.prod(list(summary.mesh.values()))) == 8
  assert summary.final_step == 2 and np.isfinite(summary.loss)


@pytest.mark.tpu
@pytest.mark.parametrize("target,slices", [("2x v5p-8", 2),  # 4 slices: slow (time)
                                           pytest.param("4x v5p-8", 4, marks=pytest.mark.slow)])
def test_without_dcn_a_multislice_run_is_data_parallel_across_slices(
    work, monkeypatch, tpu_devices, target, slices):
  """train_lm's set-up on the devices of several v5p-8 slices (described by libtpu): no
  --dcn gives replica = the slice count, said in a start-up line; --dcn still wins."""
  devices = fs.target_devices(target)
  monkeypatch.setattr(jax, "devices", lambda *a: devices)  # the job's devices, as on the pod
  corpus = data.load(str(work / "corpus.txt"), "")
  for mesh_flag, dcn, shape in (("", "", {"replica": slices, "fsdp": 4}),
                                ("data=2,tensor=-1", "", {"replica": slices, "data": 2,
                                                          "tensor": 2}),
                                ("fsdp=-1", f"data={slices}", {"data": slices, "fsdp": 4})):
    said = []
    o = cli.check_options(train_lm.Options, dict(
        dataset=str(work / "corpus.txt"), model_config="nano", seq=32, topology=target,
        mesh=mesh_flag, dcn=dcn, steps=2))
    s = run_setup.decide(o, corpus, said.append)
    assert dict(s.mesh.shape) == shape and s.topo.num_slices == slices
    outer = s.mesh.devices.reshape(slices, -1)
    assert [{d.slice_index for d in row} for row in outer] == [{i} for i in range(slices)]
    default = [line for line in said if line.startswith("mesh: the devices span")]
    assert default == ([] if dcn else [
        f"mesh: the devices span {slices} TPU slices and --dcn is not set: data parallel "
        f"across the slices (--dcn=replica={slices}), the --mesh axes within each slice"])


def _xla_warnings(mesh_spec, size="nano"):
  """XLA's partitioner warnings for train_lm's step of `size` (the model's RULES, AdamW) on
  `mesh_spec`, compiled from abstract inputs with the persistent compile cache off (a cached
  program is not partitioned again, so it would warn about nothing)."""
  import optax  # pylint: disable=import-outside-toplevel
  model = train_lm.MODELS[size]
  mesh = fs.make_mesh(fs.parse_axes(mesh_spec))
  cfg = model.model_config(size, 32)
  opt, axes = optax.adamw(1e-3), model.logical_axes(cfg)
  rows = jax.ShapeDtypeStruct((16, 32), np.int32)
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(model.init_params, cfg), opt, mesh=mesh,
                          rules=model.RULES, logical_axes=axes, key=jax.random.key(0),
                          abstract=True)
    step = fs.shard_step(fs.train_step(model.loss_fn, opt), mesh, rules=model.RULES,
                         logical_axes=axes)
    return fs.compile_report(step, state, {"inputs": rows, "targets": rows}).xla_warnings


@pytest.fixture(name="no_compile_cache")
def _no_compile_cache():
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", before)


# Meshes the README and the recipe's docstring name, on 8 devices.
README_MESHES = ["data=2,fsdp=4", "data=-1,fsdp=2,tensor=2", "data=-1,fsdp=8"]


@pytest.mark.parametrize("size, mesh_spec, partitioner", [
    ("nano", "data=2,fsdp=4", "shardy"),
    pytest.param("nano", "data=2,fsdp=4", "gspmd", marks=pytest.mark.slow),
    ("llama-tiny", "data=2,fsdp=4", "shardy")] + [
    pytest.param(size, m, "shardy", marks=pytest.mark.slow)  # the other meshes: repeats
    for size, m in [("nano", README_MESHES[1]), ("nano", README_MESHES[2]),
                    ("llama-tiny", "data=-1,fsdp=2,tensor=2")]], indirect=["partitioner"])
def test_default_rules_draw_no_partitioner_warnings(size, mesh_spec, partitioner,
                                                    no_compile_cache):
  assert _xla_warnings(mesh_spec, size) == ()


@pytest.mark.parametrize("partitioner", ["gspmd"], indirect=True)
def test_plain_embedding_lookup_draws_no_warning(monkeypatch, partitioner, no_compile_cache):
  """With the table lookup left to the partitioner (`table[tokens]`, no shard_map), the same
  step on data=2,fsdp=4 drew XLA's involuntary rematerialization under GSPMD propagation
  (the table split over fsdp on its model dim, the token ids too): train_step now gathers
  the table over the data axes before the loss, as FSDP does any weight."""
  monkeypatch.setattr(embedding, "lookup", lambda table, tokens, rules: table[tokens])
  assert _xla_warnings("data=2,fsdp=4") == ()


def test_plot_run_draws_what_train_lm_wrote(uninterrupted, tmp_path):
  """plot_run reads the run dir train_lm wrote: a 700x800 PNG; TensorBoard events and
  run.json's start record (the options) are there too."""
  import matplotlib.image  # pylint: disable=import-outside-toplevel
  _, run_dir = uninterrupted
  out = plot_run.plot_run(str(run_dir), str(tmp_path / "run.png"))
  assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert matplotlib.image.imread(out).shape[:2] == (800, 700)
  assert list(run_dir.glob("events.out.tfevents.*"))
  start = json.loads((run_dir / "run.json").read_text())["start"]
  assert start["options"]["model_config"] == "nano" and start["step"] == 0


@pytest.fixture(scope="module")
def stopped_at_3(work):
  """The first half of a stopped run: 3 of 6 steps, a checkpoint (with the data iterator's
  state) at step 3. Tests copy its run dir before resuming from it."""
  run_dir = work / "stopped_at_3"
  summary = _run(_argv(work, run_dir, "--checkpoint_every=3", "--stop_after=3"))
  return summary, run_dir


@pytest.mark.slow
def test_stop_and_resume_is_bitwise_equal(work, stopped_at_3, uninterrupted, capsys):
  first, template = stopped_at_3
  assert first.stopped == "--stop_after=3" and first.final_step == 3
  assert (template / "checkpoints" / "3").is_dir()
  run_dir = work / "resumed"
  shutil.copytree(template, run_dir)
  argv = _argv(work, run_dir, "--checkpoint_every=3", "--stop_after=3")
  second = _run(argv)  # the same command resumes
  assert second.resumed_from == 3 and second.final_step == STEPS
  assert "resumed from step 3" in capsys.readouterr().out
  _assert_equal_trees(_params(second), _params(uninterrupted[0]))
  # The data iterator resumed where it stopped: the resumed run logged exactly the missing
  # steps, with the uninterrupted run's losses.
  assert [r["step"] for r in _records(run_dir, "train/loss")] == list(range(1, STEPS + 1))
  assert [r["train/loss"] for r in _records(run_dir, "train/loss")] == [
      r["train/loss"] for r in _records(uninterrupted[1], "train/loss")]


def test_summary_speed_is_the_whole_runs(uninterrupted):
  """Summary.tokens_per_s and mfu cover every timed step (steps 2..6: the first includes
  dispatch warm-up), not the last window: from the progress records (one step each, log_every
  1), steps / the sum of each window's seconds."""
  summary, run_dir = uninterrupted
  records = _records(run_dir, "perf/tokens_per_s")
  assert [r["step"] for r in records] == list(range(2, STEPS + 1))
  whole = lambda tag: len(records) / sum(1 / r[tag] for r in records)
  assert summary.tokens_per_s == pytest.approx(whole("perf/tokens_per_s"), rel=1e-9)
  assert summary.mfu == pytest.approx(whole("perf/mfu"), rel=1e-9)
  assert summary.tokens_per_s != records[-1]["perf/tokens_per_s"]


def test_goodput_splits_the_runs_wall_time(uninterrupted):
  """The goodput record at the end splits the wall time the summary measured (from the same
  start, read after the record is written) into phases that sum to it; the productive time
  holds every step window the progress lines timed, the compile phase XLA's compile."""
  summary, run_dir = uninterrupted
  records = _records(run_dir, "goodput/wall_s")
  final = records[-1]
  assert final == {"step": STEPS, **summary.goodput}
  phases = [final[f"goodput/{p}_s"] for p in goodput.PHASES]
  assert sum(phases) == pytest.approx(final["goodput/wall_s"], rel=1e-12) and min(phases) >= 0
  assert summary.wall_s - max(0.5, 0.05 * summary.wall_s) <= final["goodput/wall_s"] \
      <= summary.wall_s
  timed = sum(16 * 32 / r["perf/tokens_per_s"] for r in _records(run_dir, "perf/tokens_per_s"))
  assert timed <= final["goodput/productive_s"] * (1 + 1e-9)
  assert final["goodput/compile_s"] >= summary.compile_s > 0 and final["goodput/eval_s"] > 0
  assert final["goodput/fraction"] == final["goodput/productive_s"] / final["goodput/wall_s"]
  assert (final["goodput/steps"], final["goodput/lost_steps"], final["goodput/lost_s"],
          final["goodput/starts"]) == (STEPS, 0, 0.0, 1)
  # One record when the log opens (step 0), one a progress line, one at the end; the time
  # only grows.
  assert [r["step"] for r in records] == [0, *range(1, STEPS + 1), STEPS]
  walls = [r["goodput/wall_s"] for r in records]
  assert walls == sorted(walls)


def test_plot_run_draws_the_goodput_records(uninterrupted, tmp_path):
  """The goodput figure's lines are the run's records: per phase, at each step's last
  record, its seconds over the wall seconds."""
  _, run_dir = uninterrupted
  last = {r["step"]: r for r in _records(run_dir, "goodput/wall_s")}
  lines = plot_run.goodput_figure(str(run_dir)).axes[0].get_lines()
  assert [ln.get_label() for ln in lines] == list(goodput.PHASES)
  for ln in lines:
    assert list(ln.get_xdata()) == sorted(last)
    assert list(ln.get_ydata()) == [100 * last[s][f"goodput/{ln.get_label()}_s"]
                                    / last[s]["goodput/wall_s"] for s in sorted(last)]
  out = plot_run.plot_goodput(str(run_dir), str(tmp_path / "goodput.png"))
  assert pathlib.Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_restart_counts_the_steps_it_redoes_as_lost_work(work, tmp_path, capsys):
  """A run that trained 6 steps, whose saves of steps 4 and 6 were lost (a crash before they
  reached the disk), resumes from step 2: the steps its first start's metrics.jsonl shows
  trained after step 2 are redone, and their time is lost work; no step adds productive
  time, and the record carries both starts' time."""
  run_dir = tmp_path / "run"
  argv = _argv(work, run_dir, "--checkpoint_every=2")
  first = _run(argv)
  before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  for step in (4, 6):
    shutil.rmtree(run_dir / "checkpoints" / str(step))
  capsys.readouterr()
  t = time.time()
  second = _run(argv)
  wall = time.time() - t
  assert second.resumed_from == 2
  # The hand count: steps each start trained, from the two metrics files.
  trained = {r["step"] for r in before if "train/loss" in r}
  again = {r["step"] for r in _records(run_dir, "train/loss") if r["step"] > 2}
  g, g1 = second.goodput, first.goodput
  assert (g["goodput/lost_steps"], g["goodput/steps"], g["goodput/starts"]) == (
      len(trained & again), len(trained | again), 2) == (4, 6, 2)
  assert g["goodput/productive_s"] == g1["goodput/productive_s"]
  # The redone steps the second start's progress lines timed (3 is its warm-up) are lost.
  redone = [r for r in _records(run_dir, "perf/tokens_per_s") if r["step"] > 3]
  assert g["goodput/lost_s"] >= sum(16 * 32 / r["perf/tokens_per_s"] for r in redone) > 0
  assert all(g[f"goodput/{p}_s"] >= g1[f"goodput/{p}_s"] for p in goodput.PHASES)
  # This start's share: from its call to its last record (not the summary after it).
  assert wall - max(1.0, 0.1 * wall) <= g["goodput/wall_s"] - g1["goodput/wall_s"] <= wall
  said = capsys.readouterr().out
  assert f"the whole run: goodput {g['goodput/fraction']:.1%} of {g['goodput/wall_s']:.0f} s " \
      "over 2 starts: " in said and "(4 steps redone)" in said
  assert f"{second.wall_s:.0f} s total this start; metrics in" in said


def test_the_closing_lines_say_whose_time_is_whose(uninterrupted):
  """One start: its wall time is the run's, unlabelled. Several: the summary's wall time is
  this start's and the goodput's the whole run's, each said (before: "24 s total" beside
  "goodput ... of 45 s over 2 starts", neither labelled)."""
  summary, run_dir = uninterrupted
  first, good = run_summary.closing_lines(summary, "lm")
  assert first.endswith(f"{summary.wall_s:.0f} s total; metrics in {run_dir / 'metrics.jsonl'}")
  assert good.startswith(f"goodput {summary.goodput['goodput/fraction']:.1%} of ")
  again = summary._replace(wall_s=24.2, goodput={**summary.goodput, "goodput/starts": 2,
                                                 "goodput/wall_s": 45.4})
  first, good = run_summary.closing_lines(again, "lm")
  assert first.endswith(f"24 s total this start; metrics in {run_dir / 'metrics.jsonl'}")
  assert good.startswith("the whole run: goodput ") and " of 45 s over 2 starts: " in good


@pytest.mark.slow
def test_default_run_dirs_are_per_model_and_a_foreign_one_is_refused(work, tmp_path, monkeypatch,
                                                                       capfd):
  """The README's order of commands: runs of other models don't share a default run
  directory; a run pointed at another model's checkpoints is one error line naming the
  directory and the fix, without orbax's warnings (they go to RUN_DIR/log.txt). The first
  progress line comes 3 timed steps in, with an ETA, whatever log_every is."""
  monkeypatch.chdir(tmp_path)
  common = [a for a in _argv(work, "unused", "--log_every=5", "--checkpoint_every=3")
            if not a.startswith("--run_dir")]
  assert train_lm.main(common) == 0
  out = capfd.readouterr().out
  assert re.search(r"^step +4/6 .* ETA \d+m\d\ds", out, re.M)
  assert [r["step"] for r in _records(tmp_path / "runs" / "nano-corpus", "train/loss")] == [
      4, 5, 6]
  assert train_lm.main(common + ["--model_config=llama-tiny", "--steps=3"]) == 0
  assert (tmp_path / "runs" / "llama-tiny-corpus" / "checkpoints" / "3").is_dir()
  capfd.readouterr()
  foreign = tmp_path / "runs" / "llama-tiny-corpus"
  assert train_lm.main(common + [f"--run_dir={foreign}"]) == 2  # resuming with nano: refused
  err = capfd.readouterr().err  # by the options run.json remembers
  assert err.startswith(f"error: --run_dir={foreign} holds a run with other options: "), err
  assert "model_config" in err and "give this run a new --run_dir" in err
  assert len(err.strip().splitlines()) == 1, err
  (foreign / "run.json").unlink()  # and without them, by the checkpoints themselves
  assert train_lm.main(common + [f"--run_dir={foreign}"]) == 2
  err = capfd.readouterr().err
  assert err.startswith(f"error: --run_dir={foreign} (this run: model nano, seq 32, vocab 256) "
                        f"can't resume from the checkpoints already in {foreign}/checkpoints "
                        "(steps [3]): checkpoint step 3 at ")
  assert "doesn't fit the target" in err and "--run_dir=NEW_DIR" in err
  assert len(err.strip().splitlines()) == 1, err  # no "WARNING:absl ..." lines before it


def test_orbax_warnings_go_to_the_run_log_and_others_to_the_console(tmp_path, caplog):
  """While `library_log` is open, orbax's absl warnings (here: opening a checkpoint directory
  read-only) go to RUN_DIR/log.txt and reach no other handler (the console's); another absl
  warning still does, and nothing is routed after the block."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  fs.checkpoint.save(tmp_path / "ckpt", 1, {"x": np.ones(3, np.float32)})
  run_dir = tmp_path / "run"
  caplog.clear()
  with rundir.library_log(str(run_dir)):
    assert fs.checkpoint.steps(tmp_path / "ckpt") == (1,)
    absl_logging.warning("a warning of the run itself")
  passed_on = caplog.text
  log = (run_dir / "log.txt").read_text()
  assert "Given directory is read only" in log and f"{os.sep}orbax{os.sep}" in log
  assert "Given directory is read only" not in passed_on
  assert "a warning of the run itself" in passed_on and "a warning of the run itself" not in log
  fs.checkpoint.steps(tmp_path / "ckpt")
  assert "Given directory is read only" in caplog.text


XLA_LINE = ("W1205 17:24:59.622298    2817 spmd_partitioner.cc:656] [SPMD] Involuntary full "
            "rematerialization.")


def test_xla_lines_go_to_the_run_log_and_python_lines_to_the_console(tmp_path, capfd):
  """XLA's C++ code writes its log straight to file descriptor 2, and fnscale's compile
  hands the lines it captured back through sys.stderr: while `library_log` is open both go
  to RUN_DIR/log.txt; Python's own stderr lines still reach the console. An empty log is
  removed, with the run dir the block made."""
  run_dir = tmp_path / "run"
  with rundir.library_log(str(run_dir)):
    os.write(2, (XLA_LINE + " (from C++)\n").encode())
    print(XLA_LINE + " (handed back)", file=sys.stderr)
    print("error: a line of the run itself", file=sys.stderr)
  err = capfd.readouterr().err
  assert err.splitlines() == ["error: a line of the run itself"]
  assert (run_dir / "log.txt").read_text().splitlines() == [
      XLA_LINE + " (from C++)", XLA_LINE + " (handed back)"]
  os.write(2, b"after\n")  # descriptor 2 is the console's again
  assert capfd.readouterr().err == "after\n"
  with rundir.library_log(str(tmp_path / "quiet")):
    print("nothing from XLA", file=sys.stderr)
  assert not (tmp_path / "quiet").exists()


def test_the_run_directory_line_names_the_log_as_written_only_on_warnings(tmp_path):
  """The start-up line names the files of the run directory; log.txt is there only when a
  library or XLA warned (an empty one is removed), and the line says so."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  with rundir.library_log(str(run_dir)):
    pass  # nothing warned
  assert not (run_dir / "log.txt").exists()
  line = run_summary.where(str(run_dir), "", "tensorboard")
  assert re.findall(r"\b[\w.]+\.(?:jsonl|json|txt)\b", line) == [
      "metrics.jsonl", "run.json", "log.txt"], line
  assert "log.txt (only when the libraries or XLA warn)" in line


def test_function_and_command_line_give_the_same_run(work, uninterrupted):
  """train_lm(**keywords) and the flags are one set of options: the same run, bitwise."""
  run_dir = work / "function"
  summary = train_lm.train_lm(**_kwargs(work, run_dir, checkpoint=False, sample_len=24))
  one, one_dir = uninterrupted
  assert summary.eval_loss == one.eval_loss and summary.loss == one.loss
  assert summary.sample == one.sample and summary.final_step == STEPS
  _assert_equal_trees(_params(summary), _params(one))
  assert [r["train/loss"] for r in _records(run_dir, "train/loss")] == [
      r["train/loss"] for r in _records(one_dir, "train/loss")]
  assert summary.metrics == str(run_dir / "metrics.jsonl") and summary.checkpoint_dir is None
  assert summary.run_dir == str(run_dir)
  text = repr(summary)  # printable: the summary without the (large) state
  assert f"eval_loss={one.eval_loss!r}" in text and "TrainState" not in text


# Options that change the program or the mesh but not the math: the first two steps' losses
# and gradient norms (before and after one update at the peak lr; the schedule's warmup is one
# step for 2 and for 6 steps) match the uninterrupted float32 run's.
SUCCESS_PATHS = [
    ("accum_steps", ["--accum_steps=2"], 1e-5, "2 accumulation steps"),
    ("remat", ["--remat"], 1e-5, "params"),
    ("attention", ["--attention=xla"], 1e-5, "params"),
    ("topology", ["--topology=v5p:2x2x2"], 1e-5, "chip grid 2x2x2"),
    ("mesh_shape", ["--mesh_shape=2x4"], 1e-5, "chip grid 2x4"),
    ("precision", ["--precision=bf16"], 3e-2, "p=full,c=bf16,o=full"),
    ("profile_steps", ["--profile_steps=1:2"], 0, "profile: steps 1..1 traced to"),
    # The finite flag reads the host-held moments apart from the params (another memory
    # space: `all_finite(like=)`), so XLA fuses the step otherwise: the loss agrees to an ulp.
    ("optimizer_offload", ["--optimizer_offload"], 1e-6,
     "the optimizer state in the host's memory"),
]


# Each option's feature has its own tests in the library's files (accumulation, remat,
# kernels, precision, offload): the run through train_lm repeats them, so those are slow.
_SLOW_PATHS = ("accum_steps", "remat", "attention", "precision", "topology", "profile_steps",
               "optimizer_offload")


@pytest.mark.parametrize("case, extra, rtol, said", [
    pytest.param(*c, marks=pytest.mark.slow) if c[0] in _SLOW_PATHS else c
    for c in SUCCESS_PATHS], ids=[c[0] for c in SUCCESS_PATHS])
def test_option_success_paths(work, uninterrupted, capsys, case, extra, rtol, said):
  run_dir = work / f"option_{case}"
  summary = _run(_argv(work, run_dir, "--steps=2", "--nocheckpoint", *extra))
  assert summary.final_step == 2 and summary.mesh == {"data": 4, "fsdp": 2}
  assert said in capsys.readouterr().out
  got, want = _records(run_dir, "train/loss"), _records(uninterrupted[1], "train/loss")[:2]
  for key in ("train/loss", "train/grad_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=rtol)
  if case == "profile_steps":  # the trace of step 1 is on disk where TensorBoard looks
    assert list((run_dir / "plugins" / "profile").glob("*/*.xplane.pb"))
  if case == "precision":  # bfloat16 compute really ran: not the float32 numbers
    assert [r["train/loss"] for r in got] != [r["train/loss"] for r in want]


@pytest.mark.slow
def test_epochs_count_passes_over_the_training_split(work, tmp_path):
  # 4000 bytes: 20 chunks of 200, the 20th held out -> 3800 train bytes -> (3800 - 1) // 32 =
  # 118 windows of 33 bytes -> 7 global batches of 16 per epoch (the rest dropped).
  (tmp_path / "c.txt").write_bytes(bytes(range(32, 132)) * 40)
  summary = train_lm.train_lm(**_kwargs(work, tmp_path / "run", dataset=str(tmp_path / "c.txt"),
                                        epochs=2, steps=None, checkpoint=False))
  assert summary.final_step == 14
  assert [r["step"] for r in _records(tmp_path / "run", "train/loss")] == list(range(1, 15))


@pytest.mark.slow
def test_tokenizer_vocabulary_flows_into_the_model(work, tmp_path):
  """A BPE tokenizer.json trained by recipes/train_tokenizer.py: the embedding has its
  vocabulary, the loss at init is ln(vocab), and bits/byte = nats/token x tokens/byte / ln 2."""
  text = (work / "corpus.txt").read_bytes()
  train_tokenizer.train_tokenizer([str(work / "corpus.txt")], 400, str(tmp_path / "tokenizer.json"))
  tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  vocab = tok.get_vocab_size()
  assert vocab == 400
  run_dir = tmp_path / "run"
  summary = train_lm.train_lm(**_kwargs(work, run_dir, tokenizer=str(tmp_path / "tokenizer.json"),
                                        steps=2, checkpoint=False, sample_len=8))
  assert summary.state.params["wte"].shape == (vocab, 64)
  first = _records(run_dir, "eval/loss")[0]
  assert first["eval/loss"] == pytest.approx(np.log(vocab), rel=0.03)
  _, held = data.split(text)
  per_byte = len(tok.encode(held.decode("utf-8", errors="replace")).ids) / len(held)
  assert summary.bits_per_byte == pytest.approx(summary.eval_loss * per_byte / np.log(2), rel=0.02)
  assert per_byte < 0.8  # merges happened: fewer tokens than bytes
  assert isinstance(summary.sample, str) and summary.sample


@pytest.mark.slow
def test_pruned_tokenizer_trains_with_a_vocabulary_of_its_largest_id(work, tmp_path, capsys):
  """A tokenizer.json of 298 entries with ids up to 299: the model gets 300 rows (said at
  start-up) and a finite loss near ln(300) at step 0 (out-of-range ids gave nan)."""
  import test_data  # pylint: disable=import-outside-toplevel
  test_data.pruned_tokenizer(tmp_path / "tok.json")
  (tmp_path / "c.txt").write_text(" ".join(f"w{i}" for i in range(1, 300)) * 40)
  summary = train_lm.train_lm(**_kwargs(work, tmp_path / "run", tokenizer=str(tmp_path / "tok.json"),
                                        dataset=str(tmp_path / "c.txt"), steps=1,
                                        checkpoint=False))
  assert summary.state.params["wte"].shape[0] == 300
  assert "vocab 300: ids up to 299, though the tokenizer holds 298" in capsys.readouterr().out
  first = _records(tmp_path / "run", "eval/loss")[0]["eval/loss"]
  assert first == pytest.approx(np.log(300), rel=0.05)


_COMPILES_IN_PROGRESS = []  # what the listener below saw while a progress line ran
_IN_PROGRESS = [False]
_LISTENING = []  # jax.monitoring keeps a listener for the process: registered once


def _count_compiles_in_progress(event: str, duration: float, **kw) -> None:
  del duration, kw
  if _IN_PROGRESS[0] and event == "/jax/core/compile/backend_compile_duration":
    _COMPILES_IN_PROGRESS.append(event)


def test_a_progress_line_compiles_nothing(work, tmp_path, monkeypatch):
  """The loop's progress lines run no compile, the first one included: the lr's eager
  schedule compiled 12 ops one by one there (0.7 s on a TPU VM's host with one step in
  flight: the 766M Llama's steps 5..10 ran at 52% MFU against 61%); it is now one program
  on the host's CPU, compiled before the loop (`progress.host_schedule`), its values
  optax's."""
  real = progress.progress

  def watched(*args, **kwargs):
    _IN_PROGRESS[0] = True
    try:
      return real(*args, **kwargs)
    finally:
      _IN_PROGRESS[0] = False
  monkeypatch.setattr(progress, "progress", watched)
  if _count_compiles_in_progress not in _LISTENING:
    jax.monitoring.register_event_duration_secs_listener(_count_compiles_in_progress)
    _LISTENING.append(_count_compiles_in_progress)
  _COMPILES_IN_PROGRESS.clear()
  summary = train_lm.train_lm(**_kwargs(work, tmp_path / "run", steps=4))
  assert summary.final_step == 4 and _COMPILES_IN_PROGRESS == []
  assert len(_records(tmp_path / "run", "train/lr")) == 4
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=3, decay_steps=20,
                                                end_value=1e-4)
  at = progress.host_schedule(schedule)
  np.testing.assert_allclose([at(k) for k in range(25)], [float(schedule(k)) for k in range(25)],
                             rtol=1e-6)


@pytest.mark.slow
def test_stalled_updates_stop_the_run_with_the_cause(work, tmp_path):
  # lr 1e-45 is a float32 subnormal, 0 on a device that flushes them: finite loss and
  # gradients, params that never move; the run names it at the 3rd such step, not at the end.
  with pytest.raises(fs.StepError, match=r"training stalled: .* at 3 consecutive steps 1\.\.3 "
                     r"although the loss was finite .*grad_norm [0-9.]+, update_norm 0\); .*"
                     r"the learning rate is 0"):
    train_lm.train_lm(**_kwargs(work, tmp_path / "run", lr=1e-45, max_stalled_steps=3,
                                checkpoint=False))
  # The metrics of the stalled steps were written: update_norm 0 beside a finite loss.
  records = _records(tmp_path / "run", "train/update_norm")
  assert [r["train/update_norm"] for r in records] == [0.0] * len(records) and records


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops(work):
  """A preemption notice (SIGTERM) mid-run: checkpoint at the next step, exit 143."""
  run_dir = work / "sigterm"
  metrics = run_dir / "metrics.jsonl"

  def preempt():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if metrics.exists() and '"train/loss"' in metrics.read_text():
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.05)

  thread = threading.Thread(target=preempt, daemon=True)
  thread.start()
  previous = signal.getsignal(signal.SIGTERM)
  assert train_lm.main(_argv(work, run_dir, "--steps=100000", "--checkpoint_every=0",
                              "--eval_every=1")) == 143
  thread.join()
  assert signal.getsignal(signal.SIGTERM) is previous  # the handler is uninstalled
  summary = _summary(run_dir)
  assert summary["stopped"] == "SIGTERM" and 0 < summary["final_step"] < 100000
  assert (run_dir / "checkpoints" / str(summary["final_step"]) / "commit_success.txt").exists()
  # The summary's eval loss is the run's last eval, not the one at step 0, with its step (a
  # notice leaves no time to evaluate the stopped step: grace_s is for the save).
  evals = _records(run_dir, "eval/loss")
  assert len(evals) > 1 and summary["eval_loss"] == evals[-1]["eval/loss"]
  assert summary["eval_step"] == evals[-1]["step"] <= summary["final_step"]


def _interrupt_after(metrics: pathlib.Path, records: int, signum=signal.SIGINT):
  """A thread that sends `signum` to this process once `metrics` holds `records` train
  records (the loop is running)."""
  def send():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if metrics.exists() and metrics.read_text().count('"train/loss"') >= records:
        os.kill(os.getpid(), signum)
        return
      time.sleep(0.02)
  thread = threading.Thread(target=send, daemon=True)
  thread.start()
  return thread


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_the_rerun_continues_its_log(work, capfd):
  """Ctrl-C mid-run stops after the step under way, saved (exit 130, no traceback); the same
  command resumes from it and the log holds every step once; with nothing saved the rerun
  says so and starts a fresh log."""
  run_dir, steps = work / "ctrl_c", 40
  argv = _argv(work, run_dir, f"--steps={steps}", "--checkpoint_every=0", "--eval_every=3")
  previous = signal.getsignal(signal.SIGINT)
  thread = _interrupt_after(run_dir / "metrics.jsonl", 4)
  assert train_lm.main(argv) == 130
  thread.join()
  assert signal.getsignal(signal.SIGINT) is previous  # the handler is uninstalled
  out = capfd.readouterr()
  stopped = _summary(run_dir)
  done = stopped["final_step"]
  assert stopped["stopped"] == "Ctrl-C" and 4 <= done < steps, stopped
  assert (f"stopped at step {done} (Ctrl-C): step {done} is saved in {run_dir / 'checkpoints'}; "
          "rerun the same command to resume") in out.out
  assert "Ctrl-C: stopping after this step and saving it" in out.err
  assert "Traceback" not in out.err
  assert (run_dir / "checkpoints" / str(done) / "commit_success.txt").exists()
  # One process's Ctrl-C is no preemption notice: the stopped step is evaluated.
  last = _records(run_dir, "eval/loss")[-1]
  assert (stopped["eval_loss"], stopped["eval_step"]) == (last["eval/loss"], done) == (
      stopped["eval_loss"], last["step"])

  assert train_lm.main(argv) == 0  # the same command: resumes
  resumed = _summary(run_dir)
  assert (resumed["resumed_from"], resumed["final_step"]) == (done, steps)
  for tag in ("train/loss", "eval/loss"):
    logged = [r["step"] for r in _records(run_dir, tag)]
    assert logged == sorted(set(logged)), (tag, logged)  # each step once, in order
  assert [r["step"] for r in _records(run_dir, "train/loss")] == list(range(1, steps + 1))

  shutil.rmtree(run_dir / "checkpoints")  # an earlier start that saved nothing
  capfd.readouterr()
  assert train_lm.main(_argv(work, run_dir, "--steps=3")) == 0
  said = capfd.readouterr().out
  assert "holds an earlier start of this run that saved no checkpoint" in said
  assert "(this run starts afresh: a fresh log)" in said
  assert [r["step"] for r in _records(run_dir, "train/loss")] == [1, 2, 3]


def test_a_second_ctrl_c_stops_at_once_and_the_command_line_says_so_in_one_line(capsys):
  # The handler before is given back after (Python's default_int_handler, or SIG_IGN in a
  # process started in the background).
  before = signal.getsignal(signal.SIGINT)
  with stopping.ctrl_c() as asked:
    assert not asked()
    os.kill(os.getpid(), signal.SIGINT)  # the first: a request the loop reads
    time.sleep(0.01)
    assert asked()
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)  # the second: at once
      time.sleep(1)
  assert signal.getsignal(signal.SIGINT) is before

  def interrupted(o):
    raise KeyboardInterrupt
  assert cli.options_main(["train_lm"], train_lm.Options, interrupted, "") == 130
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [
      "stopped by Ctrl-C: what was saved is kept; rerun the same command to resume"]


# Ctrl-C at each moment of a run (tests/interrupt_worker.py sends it from inside the run):
# the moment, its flags, and the step then saved (None: nothing yet).
CTRL_C_MOMENTS = [
    ("data", [], None),  # reading the corpus
    ("tokenizing", ["--tokenizer={tmp}/tokenizer.json"], None),  # its ids not kept yet
    ("compile", ["--compile_cache_dir="], None),  # compiled afresh: the signal lands inside XLA
    ("eval", [], None),  # step 0's eval, before the loop
    ("first step", [], 1),  # in the loop: a request; the step under way is saved
    ("sample", ["--sample_len=8"], STEPS),  # the final sample, the final save in flight
    ("save", [], STEPS),  # the final save being written
]


@pytest.mark.slow
@pytest.mark.parametrize("moment, extra, saved", CTRL_C_MOMENTS,
                         ids=[m[0] for m in CTRL_C_MOMENTS])
def test_ctrl_c_at_any_moment_exits_130_with_one_line_saying_what_is_saved(work, tmp_path, moment,
                                                                         extra, saved):
  """`python recipes/train_lm.py` stopped by Ctrl-C at `moment`: exit 130, one line (no
  traceback) that says which step is saved, and that step committed on disk. Interrupted
  outside the loop, the process ends without the interpreter's teardown: a compile that
  Ctrl-C cut short goes on in XLA's own thread, and tearing the runtime down under it
  crashed the process on a TPU (SIGSEGV in PjRtLoadedExecutable::Create)."""
  run_dir, hook, ckpt = tmp_path / "run", tmp_path / "hook", tmp_path / "run" / "checkpoints"
  env = dict(os.environ, PYTHONPATH=str(ROOT), HOOK_FILE=str(hook))
  if moment == "tokenizing":  # a cache of token ids of its own: the corpus is encoded
    train_tokenizer.train_tokenizer([str(work / "corpus.txt")], 300,
                                    str(tmp_path / "tokenizer.json"))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
  cmd = [sys.executable, str(ROOT / "tests" / "interrupt_worker.py"), moment,
         *_argv(work, run_dir, *(e.format(tmp=tmp_path) for e in extra))[1:]]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert out.returncode == 130, out.stdout[-2000:] + out.stderr[-2000:]
  err = [line for line in out.stderr.splitlines() if line.strip()]
  notes = hook.read_text().splitlines() if hook.exists() else []
  if saved is None:
    assert err == ["stopped by Ctrl-C: nothing was saved yet; rerunning the same command "
                   "starts afresh"]
    assert fs.checkpoint.steps(str(ckpt)) == ()
  else:
    said = f"step {saved} is saved in {ckpt}; rerun the same command to resume"
    if moment == "first step":
      assert err == ["Ctrl-C: stopping after this step and saving it (Ctrl-C again stops at "
                     "once; what is saved is kept)"]
      assert f"stopped at step 1 (Ctrl-C): {said}" in out.stdout
    else:
      assert err == [f"stopped by Ctrl-C: {said}"]
    assert fs.checkpoint.steps(str(ckpt))[-1] == saved
  if moment == "compile":
    assert notes and notes[0].startswith("KeyboardInterrupt out of the compile"), notes
  assert ("teardown" in notes) == (moment == "first step"), notes  # the loop's stop: none


@pytest.mark.slow
def test_a_save_cut_short_is_removed_and_the_run_resumes_from_the_last_complete_one(
    work, stopped_at_3, capsys):
  """A second Ctrl-C (or a kill) while orbax writes a step leaves
  `<step>.orbax-checkpoint-tmp-<time>`, which nothing reads: the next run removes it, says
  so, and resumes from the newest complete step."""
  run_dir = _checkpointed_at_3(work, stopped_at_3, "cut_short")
  cut = run_dir / "checkpoints" / "5.orbax-checkpoint-tmp-1796546995"
  shutil.copytree(run_dir / "checkpoints" / "3", cut)
  (cut / "commit_success.txt").unlink(missing_ok=True)
  summary = _run(_argv(work, run_dir))
  out = capsys.readouterr().out
  assert (f"checkpoint: removed 1 unfinished save(s) of step(s) [5] in {run_dir / 'checkpoints'}"
          in out), out
  assert summary.resumed_from == 3 and summary.final_step == STEPS
  assert not cut.exists()
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["3", str(STEPS)]


@pytest.mark.parametrize("done, notice, ctrl_c, stop_after, why", [
    (3, False, False, 0, None), (3, True, False, 0, "SIGTERM"), (3, True, True, 0, "Ctrl-C"),
    (3, False, True, 0, "Ctrl-C"),  # one process: its own Ctrl-C
    (3, False, False, 3, "--stop_after=3"), (3, False, False, 4, None),
    (10, True, True, 10, None)])  # the last step: no stop, the run ends
def test_why_a_run_stops(done, notice, ctrl_c, stop_after, why):
  assert stopping.reason(done, 10, notice, ctrl_c, stop_after) == why


@pytest.fixture(scope="module")
def stopped_between_evals(work):
  """6 steps stopped by --stop_after=3, evaluating every 2 steps (the last eval before the
  stop: step 2's). Returns the summary, the run dir, the compiled step (what
  `memory.compile_step` returned) and what the run said."""
  run_dir, compiled, said, compile_step = work / "between_evals", [], io.StringIO(), \
      memory.compile_step

  def kept(*args, **kwargs):
    compiled.append(compile_step(*args, **kwargs))
    return compiled[-1]
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(said):
    patch.setattr(memory, "compile_step", kept)
    summary = _run(_argv(work, run_dir, "--eval_every=2", "--stop_after=3",
                         "--checkpoint_every=0"))
  return summary, run_dir, compiled[0], said.getvalue()


def test_the_summary_gives_the_compiled_steps_peak_memory(stopped_between_evals):
  """The memory line is the compiled step's peak from XLA's memory analysis (on CPU,
  arguments + outputs + temporaries - aliased), not the runtime's count of live arrays."""
  summary, run_dir, step, said = stopped_between_evals
  m = step.compiled.memory_analysis()
  want = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)
  assert summary.step_bytes == want and m.temp_size_in_bytes > 0
  record = json.loads((run_dir / "run.json").read_text())["device_memory"]
  assert record == dict(step_peak_bytes=want, bytes_limit=None, runtime_peak_bytes_in_use=None)
  assert [line for line in said.splitlines() if line.startswith("device memory")] == [
      f"device memory: the step's peak {want / 2**20:.2f} MiB per device (XLA's memory "
      "analysis of the compiled step: arguments + outputs + temporaries - aliased)"]


def test_on_a_chip_the_runtimes_count_is_labelled_beside_the_steps_peak(monkeypatch, tmp_path):
  """Where the runtime counts its own peak (TPU, GPU), the line gives the step's peak first and
  the runtime's count named as what it is (what a v5e run printed: 0.99 GiB "in use" beside a
  10.7 GiB step)."""
  GiB = 2**30
  monkeypatch.setattr(memory, "limit", lambda mesh: 15.75 * GiB)
  monkeypatch.setattr(run_summary, "runtime_peak", lambda: int(0.99 * GiB))
  said = []
  s = types.SimpleNamespace(o=train_lm.Options.of(run_dir=str(tmp_path)), mesh=None,
                            topo=types.SimpleNamespace(platform="tpu"))
  run_summary.say_memory(s, int(10.7 * GiB), said.append)
  assert said == [
      "device memory: the step's peak 10.70 GiB per device (XLA's memory analysis of the "
      "compiled step) of 15.75 GiB; the runtime's peak_bytes_in_use counter, which leaves the "
      "step's temporaries out, read 0.99 GiB"]


def test_a_stop_evaluates_its_step_and_the_summary_names_it(stopped_between_evals):
  """A stop by --stop_after between evals evaluates the stopped step (step 3, not step 2's
  loss), and the summary's line names the step of the loss it quotes."""
  summary, run_dir, _, said = stopped_between_evals
  assert (summary.stopped, summary.final_step) == ("--stop_after=3", 3)
  evals = {r["step"]: r["eval/loss"] for r in _records(run_dir, "eval/loss")}
  assert sorted(evals) == [0, 2, 3] and evals[3] != evals[2]
  assert (summary.eval_step, summary.eval_loss) == (3, evals[3])
  assert (_summary(run_dir)["eval_step"], _summary(run_dir)["eval_loss"]) == (3, evals[3])
  assert (f"stopped: step 3 (--stop_after=3), eval loss {evals[3]:.4f} nats/token at step 3 "
          f"(bigram baseline {summary.bigram_loss:.4f}), ") in said


@pytest.fixture(scope="module")
def finished_at_4(work):
  """A finished 4-step run, checkpointed at its last step."""
  run_dir = work / "finished_at_4"
  return _run(_argv(work, run_dir, "--steps=4")), run_dir


def test_rerunning_a_finished_run_ends_without_compiling(work, finished_at_4, monkeypatch,
                                                         capsys):
  """The same command on a run that holds its last step says so and ends: no compile, eval or
  sample; its summary quotes the run's last eval with its step. --evaluate_finished asks for
  them again."""
  first, template = finished_at_4
  run_dir = work / "rerun_finished"
  shutil.copytree(template, run_dir)

  def refused(*args, **kwargs):
    raise AssertionError("a finished run compiled, evaluated or sampled")
  monkeypatch.setattr(memory, "compile_step", refused)
  monkeypatch.setattr(evaluation, "evaluate", refused)
  monkeypatch.setattr(evaluation, "sample", refused)
  capsys.readouterr()
  again = _run(_argv(work, run_dir, "--steps=4", "--sample_len=8"))
  said = capsys.readouterr().out
  assert "already holds step 4 of 4: nothing left to train; ending here, nothing compiled" \
      in said
  assert (again.final_step, again.stopped, again.sample, again.step_bytes) == (4, None, None,
                                                                               None)
  _assert_equal_trees(_params(again), _params(first))
  last = _records(run_dir, "eval/loss")[-1]
  assert (again.eval_step, again.eval_loss) == (last["step"], last["eval/loss"]) == (
      4, first.eval_loss)
  assert f"done: step 4, eval loss {first.eval_loss:.4f} nats/token" in said
  assert _summary(run_dir) == _summary(template)  # the run's own record stays

  monkeypatch.undo()
  asked = _run(_argv(work, run_dir, "--steps=4", "--sample_len=8", "--evaluate_finished"))
  said = capsys.readouterr().out
  assert "eval  step      4" in said and asked.sample is not None
  assert asked.eval_loss == first.eval_loss


def _lr(count, peak, warmup, length, end_ratio=0.1):
  """optax's warmup + cosine lr for update `count`, by hand."""
  if count < warmup:
    return peak * count / warmup
  t = min(count - warmup, length - warmup) / (length - warmup)
  return peak * end_ratio + peak * (1 - end_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def test_more_steps_keep_the_runs_schedule_unless_it_is_stretched(work, finished_at_4, capsys):
  """--steps=6 on a finished 4-step run keeps its schedule (steps 5-6 at its final lr, no
  jump) and says so with the other choice; --schedule_steps=6 stretches it over 6 steps."""
  _, template = finished_at_4
  peak = 3e-3  # nano's
  lrs = lambda run_dir: {r["step"]: r["train/lr"] for r in _records(run_dir, "train/lr")}
  assert [lrs(template)[s] for s in range(1, 5)] == pytest.approx(
      [_lr(c, peak, 1, 4) for c in range(4)], rel=1e-6)
  capsys.readouterr()
  for name, extra, length in (("kept", (), 4), ("stretched", ("--schedule_steps=6",), 6)):
    run_dir = work / f"schedule_{name}"
    shutil.copytree(template, run_dir)
    summary = _run(_argv(work, run_dir, "--steps=6", *extra))
    said = capsys.readouterr().out
    assert summary.resumed_from == 4 and summary.final_step == 6
    assert [lrs(run_dir)[s] for s in (5, 6)] == pytest.approx(
        [_lr(c, peak, 1, length) for c in (4, 5)], rel=1e-6), name
    lr5 = (f"{_lr(4, peak, 1, 4):.3g}", f"{_lr(4, peak, 1, 6):.3g}")
    if name == "kept":
      assert ("schedule: the run's checkpoint was trained under a 4-step schedule, kept for "
              f"--steps=6: steps 5-6 train at its final lr {peak * 0.1:.3g} "
              f"(--schedule_steps=6 stretches it over the run instead: lr {lr5[0]} at step 5 "
              f"would become {lr5[1]})") in said
    else:
      assert ("schedule: --schedule_steps=6 replaces the run's 4-step schedule: the lr at "
              f"step 5 is {lr5[1]}, where the run's schedule has {lr5[0]}") in said


@pytest.mark.slow
def test_a_resumed_run_keeps_its_peak_lr_unless_another_is_given(work, tmp_path, capsys):
  """A run stopped at step 2 of 4 under --lr=1e-3 resumes at 1e-3 without --lr (the model's
  default 3e-3 made the lr jump, said nowhere); --lr=2e-3 given on resuming is used and said,
  with the lr the run's schedule had at that step (optax's schedule by hand: `_lr`)."""
  template = tmp_path / "stopped"
  _run(_argv(work, template, "--steps=4", "--lr=1e-3", "--stop_after=2"))
  lrs = lambda run_dir: {r["step"]: r["train/lr"] for r in _records(run_dir, "train/lr")}
  capsys.readouterr()
  for name, extra, peak in (("kept", (), 1e-3), ("given", ("--lr=2e-3",), 2e-3)):
    run_dir = tmp_path / name
    shutil.copytree(template, run_dir)
    summary = _run(_argv(work, run_dir, "--steps=4", *extra))
    said = capsys.readouterr().out
    assert summary.resumed_from == 2 and summary.final_step == 4
    assert [lrs(run_dir)[s] for s in (3, 4)] == pytest.approx(
        [_lr(c, peak, 1, 4) for c in (2, 3)], rel=1e-6), name
    line = (f"schedule: --lr=0.002 replaces the run's peak lr 0.001: the lr at step 3 is "
            f"{_lr(2, 2e-3, 1, 4):.3g}, where the run's schedule has {_lr(2, 1e-3, 1, 4):.3g}")
    assert (line in said) == (name == "given"), said


def _checkpointed_at_3(work, stopped_at_3, name):
  """A new run dir holding only the step-3 checkpoint of the `stopped_at_3` run."""
  src = stopped_at_3[1] / "checkpoints" / "3"
  run_dir = work / name
  shutil.copytree(src, run_dir / "checkpoints" / "3")
  return run_dir


@pytest.mark.slow
def test_resume_onto_a_different_mesh(work, stopped_at_3, uninterrupted):
  run_dir = _checkpointed_at_3(work, stopped_at_3, "other_mesh")
  summary = _run(_argv(work, run_dir, "--mesh=data=2,fsdp=4"))
  assert summary.resumed_from == 3 and summary.mesh == {"data": 2, "fsdp": 4}
  # Same math, other reduction order: equal up to float rounding.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               _params(summary), _params(uninterrupted[0]))


@pytest.mark.slow
def test_resume_onto_4_devices_in_a_subprocess(work, stopped_at_3, uninterrupted):
  run_dir = _checkpointed_at_3(work, stopped_at_3, "four_devices")
  cmd = [sys.executable, str(ROOT / "recipes" / "train_lm.py"), "--devices=4",
         *_argv(work, run_dir)[1:]]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "resumed from step 3" in out.stdout
  assert "over 4 devices" in out.stdout
  final = _summary(run_dir)
  assert final["devices"] == 4 and final["final_step"] == STEPS
  assert final["eval_loss"] == pytest.approx(uninterrupted[0].eval_loss, rel=1e-4)


@pytest.mark.slow
def test_corrupt_checkpoint_is_refused_and_kept(work, stopped_at_3, uninterrupted, capsys):
  run_dir = _checkpointed_at_3(work, stopped_at_3, "corrupt")
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


@pytest.mark.slow
def test_nonfinite_run_stops_and_keeps_the_last_good_checkpoint(work, capsys):
  """lr=1e30 after one warmup step: step 2's update takes the params to ~1e30 (finite) and
  step 3's loss and params are NaN. With a checkpoint every 2 steps, keep=3 and progress
  every 10, the run stops before saving step 4, naming step 3 and the checkpoint of step 2;
  nothing later is written, and the rerun resumes from step 2 and stops the same way."""
  run_dir = work / "nonfinite"
  options = _kwargs(work, run_dir, steps=10, lr=1e30, warmup_steps=1, checkpoint_every=2,
                    log_every=10, checkpoint_keep=3)
  named = (r"went non-finite \(NaN or inf\) at step 3; the run stops and saves no step from "
           r"it on; the last good checkpoint is step 2 in .*nonfinite/checkpoints")
  with pytest.raises(fs.StepError, match=named):
    train_lm.train_lm(**options)
  ckpt = run_dir / "checkpoints"
  assert sorted(os.listdir(ckpt)) == ["2"] and fs.checkpoint.steps(ckpt) == (2,)
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  params = ocp.StandardCheckpointer().restore(ckpt / "2" / "state")["params"]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
  assert max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(params)) > 1e20
  capsys.readouterr()
  with pytest.raises(fs.StepError, match=named):
    train_lm.train_lm(**options)
  assert "resumed from step 2" in capsys.readouterr().out
  assert fs.checkpoint.steps(ckpt) == (2,)


@pytest.mark.slow
def test_a_save_slower_than_the_preemption_window_is_said_at_start_up(work, stopped_at_3,
                                                                      capsys):
  run_dir = _checkpointed_at_3(work, stopped_at_3, "save_window")
  _run(_argv(work, run_dir, "--steps=4", "--grace_s=0.001"))
  out = capsys.readouterr().out
  said = re.search(r"warning: a checkpoint save takes ~[\d.]+ s here \(step 3\); after a "
                   r"preemption notice .* but grace_s is 0.001 s: raise grace_s", out)
  assert said and out.index(said.group(0)) < out.index("step      4/4"), out


@pytest.mark.slow
def test_a_save_slower_than_the_preemption_window_is_said_in_a_fresh_run(work, tmp_path,
                                                                         capsys):
  # No checkpoint to time at start-up: the run says it once its saves are timed (from the
  # second on, the first's time holding one-off compiles), before the third is written,
  # and only once. A check that runs only at start-up never says it in a fresh run.
  _run(_argv(work, tmp_path / "run", "--checkpoint_every=1", "--grace_s=0.001"))
  out = capsys.readouterr().out
  said = re.findall(r"warning: a checkpoint save takes ~[\d.]+ s here \(step 2\); .* but "
                    r"grace_s is 0.001 s: raise grace_s", out)
  assert len(said) == 1 and "checkpoint save takes" not in out.split(said[0])[1], out
  assert out.index(said[0]) < out.index("checkpoint: step 3 saving"), out


def test_no_good_checkpoint_is_an_error(work, capsys):
  run_dir = work / "all_corrupt"
  (run_dir / "checkpoints" / "3").mkdir(parents=True)  # empty: no marker, no metadata
  assert train_lm.main(_argv(work, run_dir)) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith(f"error: --run_dir={run_dir} (this run: model nano, seq 32, vocab "
                            f"256) can't resume from the checkpoints already in {run_dir}")
  assert "no usable checkpoint" in err[-1] and "step 3" in err[-1]
  assert "--run_dir=NEW_DIR" in err[-1] and f"remove {run_dir / 'checkpoints'}" in err[-1]
  assert "Traceback" not in "\n".join(err)
  assert os.listdir(run_dir / "checkpoints" / "3") == []  # untouched


@pytest.mark.slow
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
  two, one = _summary(run_dir), uninterrupted[0]
  assert two["processes"] == 2 and two["devices"] == 8 and two["sample"]
  assert two["loss"] == pytest.approx(one.loss, rel=1e-5)
  assert two["eval_loss"] == pytest.approx(one.eval_loss, rel=1e-5)
  # Two processes on one machine share its cores: the MFU denominator is the one-process
  # run's, not twice it.
  start = lambda d: json.loads((d / "run.json").read_text())["start"]
  assert start(run_dir)["peak_flops"] == start(uninterrupted[1])["peak_flops"] > 0
  assert "simulated devices (one host's cores, 2 processes)" in results[0][1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_processes_with_different_options_are_named_at_start(work, tmp_path):
  """Two processes of one job, process 1 started with another model: both stop at start-up
  (before any compile) with a message naming the process and the option that differs."""
  port = launch_local.free_port()
  procs = []
  for pid, size in enumerate(["nano", "tiny_gpt2"]):
    argv = _argv(work, tmp_path / "run", "--nocheckpoint", f"--model_config={size}")[1:]
    env = launch_local.child_env(pid, 2, 4, port, dict(os.environ, PYTHONPATH=str(ROOT)))
    procs.append(subprocess.Popen([sys.executable, str(ROOT / "recipes" / "train_lm.py"), *argv],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  t = time.monotonic()
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert time.monotonic() - t < 60
  for p, out in zip(procs, outs):
    assert p.returncode == 2, out[-2000:]  # an `error:` line, as bad input
    assert "process 1 has --model_config=tiny_gpt2, process 0 --model_config=nano" in out
    assert "process_id" not in out  # per-process options are not compared
    assert "compile:" not in out  # named before anything compiled


@pytest.mark.slow
def test_preemption_service_off_is_named_at_start(work, tmp_path):
  """JAX_ENABLE_PREEMPTION_SERVICE=false in a two-process job: the guard of the training loop
  cannot work; both processes say so at start-up (before any compile), naming the variable."""
  port = launch_local.free_port()
  procs = []
  for pid in range(2):
    argv = _argv(work, tmp_path / "run", "--nocheckpoint")[1:]
    env = launch_local.child_env(pid, 2, 4, port, dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_ENABLE_PREEMPTION_SERVICE="false"))
    procs.append(subprocess.Popen([sys.executable, str(ROOT / "recipes" / "train_lm.py"), *argv],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  outs = [p.communicate(timeout=120)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 2, out[-2000:]
    assert ("preemption service in a multi-process job, and it is off (jax.config."
            "jax_enable_preemption_service=False, environment variable "
            "JAX_ENABLE_PREEMPTION_SERVICE='false')") in out, out[-2000:]
    assert "compile:" not in out  # named before anything compiled


@pytest.mark.multiprocess
@pytest.mark.slow  # the quick tier's time: test_multihost's refusal of per-process directories stays quick
def test_per_host_checkpoint_directories_stop_the_job_before_training(work, tmp_path):
  """The default run_dir on every host, each on its own disk (here: each process in its own
  working directory): both stop at start-up, naming process 1 and a shared directory."""
  port = launch_local.free_port()
  procs = []
  for pid in (0, 1):
    (tmp_path / f"host{pid}").mkdir()
    argv = [a for a in _argv(work, "") if not a.startswith("--run_dir")][1:]  # the default
    env = launch_local.child_env(pid, 2, 2, port, dict(os.environ, PYTHONPATH=str(ROOT)))
    procs.append(subprocess.Popen([sys.executable, str(ROOT / "recipes" / "train_lm.py"), *argv],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=tmp_path / f"host{pid}"))
  outs = [p.communicate(timeout=180)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 2, out[-2000:]  # an `error:` line
    assert re.search(r"error: directory runs/nano-corpus/checkpoints is not shared by the 2 "
                     r"processes: process 0 wrote \.fnscale-shared-check-\w+ there, and process "
                     r"1 \(host [^)]+\) doesn't see it \(\S*host1/runs/nano-corpus/checkpoints/",
                     out), out[-2000:]
    assert "fix: use a bucket (gs://BUCKET/PATH)" in out
    assert "compile:" not in out  # stopped before anything compiled or trained
  assert os.listdir(tmp_path / "host0" / "runs" / "nano-corpus" / "checkpoints") == []


PEER_CHECK_S = fs.multihost.DEFAULT_PEER_CHECK_TIMEOUT_S


@pytest.mark.multiprocess
@pytest.mark.parametrize("point,mark,grace_s", [
    # process 0's start-up lines end just before "compile:"
    pytest.param("start-up eval", r"\ncompile: ", 5, marks=pytest.mark.slow),
    # grace_s above peer_guard's check: the lost peer is seen before the grace ends
    pytest.param("loop", r"\nstep +2/", 3 * PEER_CHECK_S, marks=pytest.mark.slow),
    pytest.param("final save and eval", rf"\nstep +{STEPS}/", 5, marks=pytest.mark.slow),
])
def test_notice_with_a_frozen_peer_ends_the_run_with_the_lost_process_named(work, tmp_path,
                                                                          point, mark,
                                                                          grace_s):
  """2 processes x 2 devices: process 1 frozen (SIGSTOP) at `point`, then a SIGTERM to
  process 0, whose next collective can't finish: it ends as preempted (143) with fnscale's
  lost-process error, not a runtime error from the collective, when the grace ends or
  peer_guard's check sees process 1 silent (the first of the two: either way 143)."""
  sys.path.insert(0, str(ROOT / "tests"))
  import multiprocess as mp  # pylint: disable=import-outside-toplevel
  argv = [str(ROOT / "recipes" / "train_lm.py"),
          *_argv(work, tmp_path / "run", f"--grace_s={grace_s}")[1:]]
  with mp.job(argv, 2, 2) as job:
    mp.wait_for_output(job, 0, mark, 300)
    mp.signal_process(job, 1, signal.SIGSTOP)
    time.sleep(1.0)  # process 0 reaches a collective that waits for process 1
    mp.signal_process(job, 0, signal.SIGTERM)
    noticed = time.monotonic()
    while job.processes[0].popen.poll() is None and time.monotonic() < noticed + 60:
      time.sleep(0.05)  # process 0 only: the frozen process 1 never ends by itself
    took = time.monotonic() - noticed
    results = mp.wait(job, 0)  # kills process 1
  r0 = results[0]
  print(f"{point}: process 0 exited {took:.1f} s after the notice (grace_s {grace_s})")
  assert r0.returncode == 143, mp.describe(results)
  # The notice is honoured within the grace (or peer_guard's check) and 5 s to exit.
  assert took < min(grace_s, PEER_CHECK_S) + 5, mp.describe(results)
  if grace_s > PEER_CHECK_S:  # peer_guard's check ended it
    assert re.search(r"fnscale\.DistributedError: lost process 1 of 2: process 1 gave "
                     rf"no sign of life for {PEER_CHECK_S} s while process 0 ran inside "
                     "peer_guard after a preemption notice", r0.stderr), mp.describe(results)
  else:
    assert re.search(r"fnscale\.DistributedError: lost process 1 of 2: (no answer "
                     r"within \d+ s when process 0 stopped \(frozen, killed, or its host is "
                     r"gone\)|process 1 gave no sign of life)", r0.stderr), mp.describe(results)
  assert "Fix: look at the log of process 1" in r0.stderr
  assert "Traceback" not in r0.stderr and "DEADLINE_EXCEEDED" not in r0.stderr


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


NO_TPU = r"tpu=True but no TPU was found: cpu .*8 devices.*Run on a TPU VM"
BAD_INPUT = [  # (case, flags, keywords, fnscale error class, what the message must say)
    ("missing data", ["--dataset={tmp}/nope.txt"], dict(dataset="{tmp}/nope.txt"),
     fs.FnscaleError, r"dataset='.*nope.txt': no such file, directory or glob match, and not "
     r"a named corpus \['stdlib', 'tiny_corpus'\]"),
    ("empty corpus", ["--dataset={tmp}/empty.txt"], dict(dataset="{tmp}/empty.txt"),
     fs.FnscaleError, r"dataset='.*empty.txt': the corpus is empty \(0 bytes\)"),
    ("empty directory", ["--dataset={tmp}/emptydir"], dict(dataset="{tmp}/emptydir"),
     fs.FnscaleError, r"dataset='.*emptydir': directory has no files"),
    ("seq longer than data", ["--dataset={tmp}/short.txt", "--seq=64"],
     dict(dataset="{tmp}/short.txt", seq=64), fs.FnscaleError,
     r"seq=64 is longer than the data: 95 tokens train and 5 held out .* at least seq \+ 1 = "
     r"65 tokens"),
    ("mesh too big", ["--mesh=data=3"], dict(mesh="data=3"), fs.MeshError,
     r"ICI axes \{'data': 3\} multiply to 3 devices but there are 8"),
    ("mesh shape mismatch", ["--mesh_shape=2x2x4"], dict(mesh_shape="2x2x4"), fs.TopologyError,
     r"mesh_shape='2x2x4': topology from override says 1 slice\(s\) x 2x2x4 = 16 devices, but "
     r"8 cpu devices are present"),
    ("batch not dividing", ["--global_batch=12"], dict(global_batch=12), fs.ShardingError,
     r"global batch 12 does not divide over the data axes: .* splits the batch 8 ways .* "
     r"multiple of 8"),
    ("unknown model", ["--model_config=huge"], dict(model_config="huge"), fs.FnscaleError,
     r"model_config='huge' is not a known model; expected one of \['nano', 'tiny_gpt2', "
     r"'tiny', 'small', 'medium', 'llama-tiny', 'llama-766m', 'llama-1b', 'llama-3b', 'llama-8b', "
     r"'llama-70b', "
     r"'moe-tiny', 'moe-deepseek-tiny', 'moe-mixtral-8x7b', 'moe-qwen3-tiny', "
     r"'moe-qwen3-30b-a3b', 'moe-deepseek-16b', 'deepseek-tiny', 'deepseek-v3'\]"),
    ("bad precision", ["--precision=float12"], dict(precision="float12"), fs.FnscaleError,
     r"precision='float12' is not a jmp policy"),
    ("zero seq", ["--seq=0"], dict(seq=0), fs.FnscaleError,
     r"--seq=0 must be >= 1: sequence length in tokens"),
    ("zero batch", ["--global_batch=0"], dict(global_batch=0), fs.FnscaleError,
     r"--global_batch=0 must be >= 1: global batch in rows"),
    ("zero lr", ["--lr=0"], dict(lr=0.0), fs.FnscaleError, r"--lr=0.0 must be > 0: peak lr"),
    ("infinite lr", ["--lr=inf"], dict(lr=float("inf")), fs.FnscaleError,
     r"--lr=inf is not finite: peak lr"),
    ("negative stall limit", ["--max_stalled_steps=-1"], dict(max_stalled_steps=-1),
     fs.FnscaleError, r"--max_stalled_steps=-1 must be >= 0: stop with an error"),
    ("zero epochs", ["--epochs=0"], dict(epochs=0), fs.FnscaleError,
     r"--epochs=0 must be >= 1: passes over the training split"),
    ("negative checkpoint interval", ["--checkpoint_every=-1"], dict(checkpoint_every=-1),
     fs.InputError, r"--checkpoint_every=-1 must be >= 0: save every this many steps"),
    ("min lr ratio above 1", ["--min_lr_ratio=1.5"], dict(min_lr_ratio=1.5), fs.InputError,
     r"--min_lr_ratio=1.5 must be <= 1: final learning rate as a fraction of the peak"),
    ("mistyped mesh axis", ["--mesh=data=2,fsdpp=4"], dict(mesh="data=2,fsdpp=4"),
     fs.InputError, r"--mesh: axis 'fsdpp' is not one the axis conventions give a meaning .*; did "
     r"you mean 'fsdp'\?"),
    ("mistyped context form", ["--context=rnig"], dict(context="rnig"), fs.InputError,
     r"--context='rnig': expected one of \['all_gather', 'ring', 'ulysses'\]; did you mean "
     r"'ring'\?"),
    ("mistyped packing", ["--packing=bestfit"], dict(packing="bestfit"), fs.InputError,
     r"--packing='bestfit': expected one of \['first_fit', 'best_fit'\]; did you mean "
     r"'best_fit'\?"),
    ("unknown accum_gather", ["--accum_gather=never"], dict(accum_gather="never"),
     fs.InputError, r"--accum_gather='never': expected one of \['auto', 'per_microbatch', "
     r"'once'\]$"),
    ("epochs and steps", ["--epochs=1"], dict(epochs=1), fs.FnscaleError,
     r"--epochs=1 and --steps=6: give one of them"),
    # The same rule for every pair of options that ask for one thing two ways.
    ("global batch and batch size", ["--batch_size=4"], dict(batch_size=4), fs.InputError,
     r"--global_batch=16 and --batch_size=4: give one of them \(--global_batch: global batch"),
    ("init_from and model_config", ["--init_from={tmp}/emptydir"],
     dict(init_from="{tmp}/emptydir"), fs.InputError,
     r"--init_from='.*emptydir' and --model_config='nano': give one of them"),
    # --init_from is checked as a model directory before its tokenizer is looked for.
    ("init_from missing", ["--init_from={tmp}/no_such_dir", "--model_config="],
     dict(init_from="{tmp}/no_such_dir", model_config=None), fs.InputError,
     r"--init_from=.*no_such_dir: no such directory; expected a Hugging Face model directory"),
    ("init_from without config.json", ["--init_from={tmp}/emptydir", "--model_config="],
     dict(init_from="{tmp}/emptydir", model_config=None), fs.InputError,
     r"--init_from=.*emptydir: no config.json; expected a Hugging Face model directory"),
    ("token caches that don't exist", ["--dataset={tmp}/cod:0.7,{tmp}/doc:0.3"],
     dict(dataset="{tmp}/cod:0.7,{tmp}/doc:0.3"), fs.InputError,
     r"dataset '.*cod': no such directory \(a token cache is a directory"),
    ("no TPU", ["--tpu"], dict(tpu=True), fs.TopologyError, NO_TPU),
    ("bad profile window", ["--profile_steps=4:9"], dict(profile_steps="4:9"), fs.FnscaleError,
     r"--profile_steps='4:9': expected START:STOP, two ints with 0 <= START < STOP <= 6"),
    ("run_dir a file", ["--run_dir={tmp}/short.txt"], dict(run_dir="{tmp}/short.txt"),
     fs.InputError, r"--run_dir=.*short.txt: .*short.txt is a file, not a directory; fix: give "
     r"a directory"),
    ("missing tokenizer", ["--tokenizer={tmp}/nope.json"], dict(tokenizer="{tmp}/nope.json"),
     fs.FnscaleError, r"tokenizer='.*nope.json': no such file; pass a Hugging Face "
     r"tokenizer.json"),
    # Emergency options that would save nothing were ignored unsaid.
    ("emergency dir without interval", ["--emergency_dir={tmp}/e"],
     dict(emergency_dir="{tmp}/e"), fs.InputError,
     r"--emergency_dir=.*/e without --emergency_every: no emergency copies are saved; fix: "
     r"add --emergency_every=N to save one every N steps there \(e.g. 10\), or leave "
     r"--emergency_dir out$"),
    ("emergency copies without checkpoints", ["--emergency_every=2", "--nocheckpoint"],
     dict(emergency_every=2, checkpoint=False), fs.InputError,
     r"--emergency_every=2 with --nocheckpoint: .*; fix: drop --nocheckpoint, or leave "
     r"--emergency_every out$"),
]


def _bad_files(tmp_path):
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "emptydir").mkdir()
  (tmp_path / "short.txt").write_bytes(b"x" * 100)
  run_dir = tmp_path / "run"  # an existing run: bad input must leave it as it is
  (run_dir / "checkpoints").mkdir(parents=True)
  (run_dir / "metrics.jsonl").write_text('{"event": "start"}\n')
  return run_dir


def _listing(run_dir):
  return sorted((str(p.relative_to(run_dir)), p.read_bytes() if p.is_file() else None)
                for p in run_dir.rglob("*"))


@pytest.mark.parametrize("case, extra, kw, error, message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_one_clear_line(work, tmp_path, capsys, case, extra, kw, error, message):
  del case, kw, error
  run_dir = _bad_files(tmp_path)
  before = _listing(run_dir)
  extra = [e.format(tmp=tmp_path) for e in extra]
  assert train_lm.main(_argv(work, run_dir, *extra)) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: ") and re.search(message, last), last
  assert _listing(run_dir) == before  # nothing written


def test_a_run_refused_at_compile_leaves_no_directory_behind(work, tmp_path, capsys):
  # cudnn attention can't run on CPU: found when the step compiles, after the checkpoint
  # manager opened (which makes the directory).
  run_dir = tmp_path / "new" / "run"
  assert train_lm.main(_argv(work, run_dir, "--attention=cudnn")) == 2
  assert "can't serve this call: needs platform cuda" in capsys.readouterr().err
  assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("case, extra, kw, error, message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_to_the_function_is_an_fnscale_error(work, tmp_path, case, extra, kw, error,
                                                       message):
  del case, extra
  run_dir = _bad_files(tmp_path)
  before = _listing(run_dir)
  kw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kw.items()}
  with pytest.raises(error, match=message):
    train_lm.train_lm(**{**_kwargs(work, run_dir), **kw})
  assert _listing(run_dir) == before  # nothing written


@pytest.mark.parametrize("kw, message", [
    (dict(steps="10"), r"option steps='10': expected int or None, got str"),
    (dict(remat=1), r"option remat=1: expected bool or None, got int"),
    (dict(seq=True), r"option seq=True: expected int or None, got bool"),
    (dict(modle_config="nano"), r"unknown option modle_config='nano'; did you mean "
     r"'model_config'\?; known options: \[.*'model_config'"),
])
def test_wrong_option_names_and_types_are_named(work, tmp_path, kw, message):
  with pytest.raises(fs.FnscaleError, match=message):
    train_lm.train_lm(**{**_kwargs(work, tmp_path / "run"), **kw})
  assert not (tmp_path / "run").exists()


def test_a_run_dir_of_other_options_is_refused(work, tmp_path, uninterrupted):
  # The uninterrupted run's record (seq 32, global batch 16 on 8 devices), in a fresh dir.
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  shutil.copy(uninterrupted[1] / "run.json", run_dir / "run.json")
  before = _listing(run_dir)
  with pytest.raises(fs.InputError, match=re.escape(
      f"--run_dir={run_dir} holds a run with other options: seq=16 (the run's: 32), "
      "global_batch=8 (the run's: 16); its checkpoints and data order are that run's. Fix: "
      "give this run a new --run_dir")):
    train_lm.train_lm(**_kwargs(work, run_dir, seq=16, global_batch=8))
  assert _listing(run_dir) == before  # nothing written
  # The same options resume; on other hardware the default global batch may differ.
  recorded = json.loads((run_dir / "run.json").read_text())["start"]["options"]
  same = cli.check_options(train_lm.Options, {k: v for k, v in recorded.items()
                                                  if k in rundir.DEFINING + ("run_dir",)})
  rundir.check_same_run(same, 8)
  other = dataclasses.replace(same, step=dataclasses.replace(same.step, global_batch=32))
  rundir.check_same_run(other, 4)
  with pytest.raises(fs.InputError, match=r"global_batch=32 \(the run's: 16\)"):
    rundir.check_same_run(other, 8)


def test_a_run_resumed_on_other_devices_keeps_its_recorded_global_batch(work, tmp_path):
  """A run directory whose run.json records global batch 24 on 16 devices, resumed on these
  8 with the batch left to the default (8 rows a device: 64): the one set-up keeps 24, 3 rows
  a device, and says so once; a batch given, or the same device count, is the user's."""
  corpus = data.load(str(work / "corpus.txt"), "")
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "run.json").write_text(json.dumps(
      {"start": {"devices": 16, "options": {"global_batch": 24}}}))
  decide = lambda **kw: run_setup.decide(cli.check_options(train_lm.Options, dict(
      dataset=str(work / "corpus.txt"), model_config="nano", seq=32, mesh="data=-1,fsdp=2",
      run_dir=str(run_dir), steps=2, **kw)), corpus, said.append)
  said = []
  s = decide()
  assert (s.o.step.global_batch, s.o.step.batch_size) == (24, 3)
  assert [line for line in said if "keeping it" in line] == [
      f"train_lm: {run_dir} was trained with global batch 24 on 16 devices; keeping it on "
      "these 8 (by default 64): rows per device and accumulation follow, the data order "
      "stays (--global_batch sets another)"]
  said.clear()
  assert decide(global_batch=16).o.step.global_batch == 16 and not said
  (run_dir / "run.json").write_text(json.dumps(
      {"start": {"devices": 8, "options": {"global_batch": 24}}}))
  assert decide().o.step.global_batch == 64 and not said


def test_cpu_mfu_denominator_is_the_machines_cached_peak(uninterrupted, capsys):
  # The run divided by this machine's cached peak: read back now, not measured again.
  start = json.loads((uninterrupted[1] / "run.json").read_text())["start"]
  host = fs.analysis.host_matmul_peak()
  assert not host.fresh and start["peak_flops"] == host.flops
  peak = progress.peak_flops(fs.detect_topology())
  assert peak.flops == host.flops and f"cached in {host.path}" in peak.about
  assert f"{host.flops / 1e9:.0f} GFLOP/s, measured {host.measured}" in peak.about


def test_a_checkpoint_without_tokenizer_json_is_read_as_bytes_when_asked(tmp_path):
  """train_lm exports a byte-level model without a tokenizer.json: reading it back needs a
  way to say bytes (--tokenizer=bytes), and the error without it names that way."""
  from recipes.lm import models  # pylint: disable=import-outside-toplevel
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(fs.InputError, match="or --tokenizer=bytes for a byte-level model"):
    models.tokenizer(Options.of(init_from=str(tmp_path)).model)
  assert models.tokenizer(Options.of(init_from=str(tmp_path), tokenizer="bytes").model) == ""
  assert models.tokenizer(Options.of(tokenizer="bytes").model) == ""
  (tmp_path / "tokenizer.json").write_text("{}")
  assert models.tokenizer(Options.of(init_from=str(tmp_path)).model) == str(
      tmp_path / "tokenizer.json")


@pytest.mark.parametrize("platform, flags, want", [
    ("tpu", {}, True), ("tpu", dict(remat=True), False), ("tpu", dict(remat_policy="full"),
                                                         False),
    ("tpu", dict(remat_policy="qkv_attn"), True), ("tpu", dict(unroll=False), False),
    ("tpu", dict(remat_policy="offload_attn"), False),
    ("gpu", {}, False), ("cpu", {}, False), ("cpu", dict(unroll=True), True)])
def test_the_layer_loop_unrolls_by_default_on_a_tpu_unless_remat_is_full(platform, flags, want):
  """Measured on a v5e: GPT small's step unrolled ran 1.23x the scan's tokens/s; the Llama
  under full remat unrolled outgrew the chip. --unroll / --nounroll decide where given."""
  o = Options.of(**flags)
  step = dataclasses.replace(o.step, remat_policy=remat.remat_policy(o.step, platform))
  for name in ("small", "llama-tiny"):
    module = gpt if name in gpt.SIZES else llama
    cfg = models.unrolled(o.model, step, module.model_config(name, 64), name, platform)
    assert cfg.unroll is want, name
  moe_cfg = moe.model_config("moe-tiny", 64)  # no unrolled loop: left as it is, or an error
  assert models.unrolled(Options.of().model, step, moe_cfg, "moe-tiny", platform) == moe_cfg
  with pytest.raises(fs.InputError, match="--unroll: moe-tiny has no unrolled layer loop"):
    models.unrolled(Options.of(unroll=True).model, step, moe_cfg, "moe-tiny", platform)


def test_an_unrolled_loop_that_does_not_fit_is_compiled_as_the_scan(work, uninterrupted,
                                                                     tmp_path, monkeypatch,
                                                                     capsys):
  """The layer loop unrolled by default (here as on a TPU) whose step the compiled check
  refuses (here: every unrolled one, as the 766M Llama's 19.5 GiB on the chip) is compiled
  again as the scan and said: the run equals the scan's run bitwise. An --unroll the user
  gave stays theirs: the refusal is the run's error."""
  summary, _ = uninterrupted
  check = memory.compile_step

  def refuse_unrolled(setup, step, state, batch):
    if setup.cfg.unroll:
      raise fs.FitError("the step needs 20.00 GiB", needed=20 * 2**30, limit=15.75 * 2**30)
    return check(setup, step, state, batch)
  as_on_a_tpu = models.unrolled
  monkeypatch.setattr(memory, "compile_step", refuse_unrolled)
  monkeypatch.setattr(models, "unrolled", lambda mo, step, cfg, name, _: as_on_a_tpu(
      mo, step, cfg, name, "tpu"))
  got = _run(_argv(work, tmp_path / "auto", "--nocheckpoint", "--sample_len=24"))
  out = capsys.readouterr().out
  assert "on mesh {'data': 4, 'fsdp': 2}, the layer loop unrolled ..." in out
  assert ("memory: the unrolled layer loop's step needs 20.00 GiB per device (XLA's peak), "
          "more than the device has; compiling the scan (--nounroll)") in out
  _assert_equal_trees(_params(got), _params(summary))
  with pytest.raises(fs.FitError, match="20.00 GiB"):
    _run(_argv(work, tmp_path / "asked", "--nocheckpoint", "--unroll"))


def test_remats_offload_attn_that_does_not_fit_is_compiled_recomputing_the_attention(
    work, tmp_path, monkeypatch, capsys):
  """--remat's policy chosen by the forecast (`remat.whole_block`: offload_attn, the
  attention's output to the host, 0.2 GiB more of the chip than full for the 766M Llama;
  here as on a TPU) whose step the compiled check refuses is compiled again under full
  remat and said: the run equals --remat_policy=full's bitwise. A --remat_policy=offload_attn
  the user gave stays theirs: the refusal is the run's error."""
  check = memory.compile_step

  def refuse_offload(setup, step, state, batch):
    if setup.o.step.remat_policy == "offload_attn":
      raise fs.FitError("the step needs 20.00 GiB", needed=20 * 2**30, limit=15.75 * 2**30)
    return check(setup, step, state, batch)
  monkeypatch.setattr(memory, "compile_step", refuse_offload)
  monkeypatch.setattr(remat, "whole_block", lambda *a: "offload_attn")
  got = _run(_argv(work, tmp_path / "auto", "--nocheckpoint", "--remat"))
  assert ("memory: --remat's offload_attn step needs 20.00 GiB per device (XLA's peak), more "
          "than the device has; compiling it with --remat_policy=full") in capsys.readouterr().out
  want = _run(_argv(work, tmp_path / "full", "--nocheckpoint", "--remat_policy=full"))
  _assert_equal_trees(_params(got), _params(want))
  with pytest.raises(fs.FitError, match="20.00 GiB"):
    _run(_argv(work, tmp_path / "asked", "--nocheckpoint", "--remat_policy=offload_attn"))


@pytest.mark.slow
def test_the_export_holds_the_tokenizer_the_run_trained_with(work, tmp_path):
  """--export_hf writes the run's own tokenizer: --tokenizer=tok/my_bpe.json, not the other
  tokenizer.json beside it (it copied that folder's); a run on a token cache without
  --tokenizer, the cache's copy (it wrote none). Read back by the tokenizers library."""
  tokenizers = pytest.importorskip("tokenizers")
  from recipes import train_tokenizer as tt  # pylint: disable=import-outside-toplevel
  from recipes.lm import cache  # pylint: disable=import-outside-toplevel
  text = str(work / "corpus.txt")
  mine = tt.train_tokenizer([text], 300, str(tmp_path / "tok" / "my_bpe.json"))
  tt.train_tokenizer([text], 280, str(tmp_path / "tok" / "tokenizer.json"))  # another one
  src = tmp_path / "docs.jsonl"
  src.write_text("".join(json.dumps({"text": line}) + "\n"
                         for line in open(text, encoding="utf-8").read().split("\n\n")[:400]))
  cache.build(cache.BuildSpec((str(src),), str(tmp_path / "cache"), tokenizer=mine),
              say=lambda *a: None)
  want = tokenizers.Tokenizer.from_file(mine).to_str()
  for name, extra in (("text", dict(tokenizer=mine)), ("cache", dict(dataset=str(tmp_path / "cache")))):
    out = tmp_path / f"export-{name}"
    train_lm.train_lm(**_kwargs(work, tmp_path / name, steps=1, checkpoint=False,
                                export_hf=str(out), **extra))
    assert tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).to_str() == want, name


def test_tokenizer_bytes_on_a_cache_made_with_another_tokenizer_is_refused(work, tmp_path):
  """--tokenizer=bytes names a tokenizer: on a token cache made with a BPE it is refused as
  any other tokenizer is (it trained a model of the BPE's vocabulary on its ids, silently);
  on a cache of bytes it reads it; without --tokenizer the cache's own serves."""
  from recipes import train_tokenizer as tt  # pylint: disable=import-outside-toplevel
  from recipes.lm import cache, finetune  # pylint: disable=import-outside-toplevel
  src = tmp_path / "docs.jsonl"
  src.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(200)))
  bpe = tt.train_tokenizer([str(work / "corpus.txt")], 300, str(tmp_path / "tok.json"))
  for name, tok in (("bpe", bpe), ("bytes", "bytes")):
    cache.build(cache.BuildSpec((str(src),), str(tmp_path / name), tokenizer=tok),
                say=lambda *a: None)
  # models.tokenizer gives "" for --tokenizer=bytes and for none: what train_lm passes.
  corpus = lambda name, **kw: finetune.corpus(Options.of(dataset=str(tmp_path / name), **kw), "")
  with pytest.raises(fs.InputError, match=r"was tokenized with .*tok\.json.* not this run's "
                     r"tokenizer 'bytes'"):
    corpus("bpe", tokenizer="bytes")
  assert corpus("bpe").vocab == 300 and corpus("bytes", tokenizer="bytes").vocab == 256


@pytest.mark.slow
def test_a_tokenizer_changed_under_the_same_name_is_refused_on_resuming(work, tmp_path):
  """run.json records the hash of the tokenizer a run trained with: the same --tokenizer path
  holding another tokenizer (of the same vocabulary) is refused, naming both hashes, before
  anything compiles (it resumed with a warning about the corpus's token count)."""
  from recipes import train_tokenizer as tt  # pylint: disable=import-outside-toplevel
  tok = str(tmp_path / "tok.json")
  tt.train_tokenizer([str(work / "corpus.txt")], 300, tok)
  first = json.loads(pathlib.Path(tok).read_text())
  run = lambda steps: train_lm.train_lm(**_kwargs(work, tmp_path / "run", tokenizer=tok,
                                                  steps=steps))
  run(1)
  other = tmp_path / "other.txt"
  other.write_text(" ".join(f"zq{i} xv{i}" for i in range(3000)))
  tt.train_tokenizer([str(other)], 300, tok)
  assert json.loads(pathlib.Path(tok).read_text()) != first
  with pytest.raises(fs.InputError, match=r"was trained with another tokenizer under the same "
                     r"name \(--tokenizer='.*tok\.json': sha256 \w+, the run's \w+\)"):
    run(2)
