"""Train a GPT- or Llama-style language model on every device the machine (or pod) has.

  python recipes/train_lm.py                      # CPU: 8 simulated devices, `tiny_gpt2`
  python recipes/train_lm.py --model_config=small --mesh="data=-1,fsdp=4"    # a TPU/GPU host
  from recipes.train_lm import train_lm           # the same options as keywords, in Python
  train_lm(model_config="tiny_gpt2", dataset="tiny_corpus", epochs=1)

Read top to bottom: set-up, run, loop. Options: `options.py`; models: `gpt.py`, `llama.py`;
data: `data.py`; plumbing: `harness.py`, `checkpoints.py`, `run_log.py` (all in `lm/`); fnscale
does the distribution. Only process 0 prints and writes files. Rerunning the same command
resumes from the newest good checkpoint, bitwise (in a run directory of other options: an
error).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax

if not __package__:  # run as a script: import `recipes` from the repository root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fnscale as fs  # noqa: E402  pylint: disable=wrong-import-position
from fnscale import mesh as fs_mesh, sharding  # noqa: E402
from fnscale.multihost import preemption  # noqa: E402
from recipes.lm import checkpoints as ck, data, harness as h, models, packing  # noqa: E402
from recipes.lm import hardware, run_log as rl  # noqa: E402
from recipes.lm.options import Options  # noqa: E402  (every option: flag, default, range)

MODELS = models.MODELS  # model name -> its module (recipes/lm/models.py)


def train_lm(**options) -> h.Summary:
  """Trains a model; each keyword is a field of `Options` (the command line's `--name`).

  Returns:
    The run's `Summary`: eval loss (nats/token), bits/byte, steps, tokens/s, paths, state.

  Raises:
    FnscaleError (or a subclass): any bad input, before anything is written or compiled.
  """
  return run(h.check_options(Options, options))


# CPU: the whole default run in ~2-3 minutes on 2 cores (README, "The main job").
_CPU = dict(model="tiny_gpt2", seq=64, batch_size=8, steps=200, mesh="data=-1")
_ACCEL = dict(model="small", seq=1024, batch_size=16, steps=5000, mesh="fsdp=-1")
_LR = {"nano": 3e-3, "tiny_gpt2": 3e-3, "tiny": 3e-3, "llama-tiny": 3e-3, "small": 6e-4,
       "medium": 3e-4, "moe-tiny": 3e-3, "moe-deepseek-tiny": 3e-3}


def _setup(o: Options, corpus: data.Corpus, say) -> h.Setup:
  """Defaults, mesh, batch and schedule. Raises FnscaleError on any bad value."""
  topo = hardware.detect(o)
  d = _CPU if topo.platform == "cpu" else _ACCEL
  size, seq = o.model_config or d["model"], d["seq"] if o.seq is None else o.seq
  model, cfg, name = models.choose(o, size, seq, corpus)
  per_device = d["batch_size"] if o.batch_size is None else o.batch_size
  if o.mesh == "auto":  # the planner sees the global batch: every device a data-parallel one
    batch = per_device * jax.device_count() if o.global_batch is None else o.global_batch
    axes, remat, accum, gather = h.plan_mesh(model, cfg, topo, batch, o.precision, say)
    if accum > o.accum_steps:
      o = dataclasses.replace(o, accum_steps=accum, accum_gather=gather)
    o = dataclasses.replace(o, remat=o.remat or remat, global_batch=batch)
  else:
    axes = fs_mesh.parse_axes(o.mesh or d["mesh"], what="--mesh")
  mesh = h.make_mesh(axes, o.dcn, topo, say)  # across TPU slices: replica=slices by default
  dp = math.prod(mesh.shape[a] for a in sharding.data_axes(mesh))
  batch = per_device * dp if o.global_batch is None else o.global_batch
  h.check_batch(seq, per_device, batch, o.accum_steps, mesh)
  h.check_pipeline(o.microbatches, model, mesh)
  if corpus.packed is not None:
    packing.check_spec(packing.spec(o, seq), corpus.packed[0])
  data.check_fits(corpus, seq)
  steps = data.steps_for(corpus, seq, batch, o.epochs, o.steps)
  steps = d["steps"] if steps is None else steps
  lr = _LR.get(size, 3e-4) if o.lr is None else o.lr
  warmup = min(500, max(1, steps // 20)) if o.warmup_steps is None else o.warmup_steps
  log_every = max(1, steps // 25) if o.log_every is None else o.log_every
  eval_every = max(1, steps // 5) if o.eval_every is None else o.eval_every
  profile = rl.parse_profile_steps(o.profile_steps, steps)
  run_dir = o.run_dir or h.default_run_dir(name, o.dataset, models.tokenizer(o), corpus.vocab)
  ckpt = ck.directory(dataclasses.replace(o, run_dir=run_dir))
  return h.Setup(dataclasses.replace(
      o, model_config=name, seq=seq, batch_size=per_device, global_batch=batch, steps=steps,
      lr=lr, warmup_steps=warmup, log_every=log_every, eval_every=eval_every, run_dir=run_dir,
      checkpoint_dir=ckpt), topo, mesh, model, cfg, profile, corpus)


def run(o: Options) -> h.Summary:
  """Trains per `o` (see `train_lm`); returns the summary with the final state."""
  # --compile_cache_dir is this run's: the caller's later compiles don't use it.
  with fs.report.compilation_cache_restored():
    # Devices, processes, compile cache, shutdown; `say` prints on process 0 only.
    t0, say = time.time(), h.start(o)
    # From here on (data, compile, evals, loop, final save), a notice (SIGTERM to any
    # process) stops every process after one step, or within grace_s wherever it is, and a
    # process lost in a collective is named, not left to a runtime error.
    preemption.check_service()  # the guard needs it: say so now, not after the compile
    data.check_epochs(o.dataset, o.epochs)
    with preemption.preemption_guard(grace_s=o.grace_s) as should_stop, \
        fs.multihost.peer_guard():
      s = _setup(o, data.load(o.dataset, models.tokenizer(o)), say)
      h.check_same_run(s.o, jax.device_count())  # not another run's directory
      if s.o.checkpoint_dir:  # one directory every process sees, checked before anything opens it
        fs.checkpoint.check_shared_directory(s.o.checkpoint_dir)
      # One checkpoint manager for the whole run; leaving the block waits for the last save.
      # orbax's warnings go to RUN_DIR/log.txt, not the console.
      with h.library_log(s.o.run_dir), (
          fs.checkpoint.manager(s.o.checkpoint_dir, keep=s.o.checkpoint_keep)
          if s.o.checkpoint_dir else contextlib.nullcontext()) as ckpt:
        return _run(s, ckpt, t0, say, should_stop)


def _run(s: h.Setup, ckpt, t0: float, say, should_stop) -> h.Summary:
  """The run of `run`, with `ckpt` (a fnscale.checkpoint.Manager, or None: no checkpoints)."""
  o, model, axes, base = s.o, s.model, s.model.logical_axes(s.cfg), data.baseline(s.corpus)
  policy, (optimizer, schedule) = h.policy(o.precision, s.topo.platform), h.optimizer(o)
  train_loss, loss_fn, aux = models.losses(s)  # packed rows: weighted (padding has none)
  step_fn = fs.train_step(train_loss, optimizer, policy=policy, accum_steps=o.accum_steps,
                          accum_gather=o.accum_gather, has_aux=aux,
                          weighted=s.corpus.packed is not None)
  kernels = dict(attention=o.attention, context=o.context, context_order=o.context_order)
  step_fn = fs.shard_step(fs.with_kernel(ck.with_finite_flag(step_fn), **kernels),
                          s.mesh, rules=model.RULES, logical_axes=axes)
  cast = policy.cast_to_compute if policy is not None else (lambda p: p)
  eval_loss = jax.jit(fs.with_kernel(lambda p, b: packing.mean(loss_fn(cast(p), b)),
                                     **kernels))
  peak = h.peak_flops(s.topo)  # before the mesh context: one device's matmul
  with fs.with_mesh(s.mesh):
    init = models.init(s, optimizer, policy, jax.random.key(o.seed))
    # grain reads this process's rows (whole rows: `h.put` splits the sequence over a context
    # axis); fs.global_batch makes one array over every process.
    batches, evals = data.run_batches(s, fs.batch_sharding(s.mesh, context_axes=()))
    state, start, resumed = ck.resume(s, ckpt, init, batches, say)
    eval_batches = [h.put(s, b) for b in evals]
    rows = next(batches)  # this process's rows, as numpy
    first = h.put(s, rows)
    step_fn = step_fn.compile(state, first)  # ahead of time: step 0 doesn't compile again
    fs.multihost.agree_on_step(step_fn)  # every process compiled the same step (a barrier)
    r = h.Run(s=s, say=say, t0=t0, baseline=base, policy=policy, schedule=schedule, peak=peak,
              step=step_fn, report=fs.compile_report(step_fn, state, first), batches=batches,
              eval_loss=eval_loss, eval_batches=eval_batches, start=start, resumed=resumed,
              log=rl.run_log(o.run_dir, active=jax.process_index() == 0, say=say),
              prof=rl.profiler(s.profile, o.run_dir, say=say),
              saver=ck.saver(s, ckpt, batches, resumed, say), should_stop=should_stop)
    h.describe(r, state)
    packing.say_padding(o, rows, evals, say)
    ev = h.evaluate(r, state, 0) if start == 0 else None
    state, out = _train(r, state, first)
    out = _finish(r, state, dict(out, eval_loss=ev))
    if o.export_hf and not out["stopped"]:
      models.export(s, state, say)
    r.log.close()
  return h.summarize(r, state, out)


def _train(r: h.Run, state, batch) -> tuple[Any, dict]:
  """The loop from `r.start` to `o.steps`: progress lines, evals, checkpoints, profile, stops.
  Evals and checkpoints are left out of the timing (tokens/s, MFU, ETA); so is the first
  step, which includes dispatch warm-up. Returns the state and the run's figures."""
  o, m, last, stopped, timing, stall = r.s.o, None, {}, None, None, h.Stall()
  t_train, every = time.time(), o.checkpoint_every
  # A notice (SIGTERM) to any process: every process stops after the same step and saves it.
  for step in range(r.start, o.steps):
    r.prof.at_step(step, pending=m)
    prev, (state, m) = m, r.step(state, batch)
    # The previous step's update, read while this one runs (one step stays in flight).
    stall = h.check_update(stall, step, prev, o.max_stalled_steps)
    done = step + 1
    r.saver.note(done, m)
    # One step in flight on CPU: simulated devices share one pool of host threads, and with
    # several steps queued XLA's CPU collectives can deadlock (no overlap to lose there).
    if r.s.topo.platform == "cpu":
      jax.block_until_ready((state, m))
    sigterm = r.should_stop(step)  # every step, on every process (JAX's sync point)
    if done < o.steps and (sigterm or done == o.stop_after):
      stopped = "SIGTERM" if sigterm else f"--stop_after={o.stop_after}"
    if stopped or (every and done % every == 0 and done < o.steps):
      t_save = time.time()
      r.saver.save(state, done)  # before the next batch is read: the position is this step's
      timing = h.paused(timing, time.time() - t_save)  # the save's time stays out
    if done < o.steps and not stopped:
      batch = h.put(r.s, next(r.batches))  # while it runs
    if timing is None:
      jax.block_until_ready(m["loss"])
      timing, early = h.Timing(time.time(), done), done + h.EARLY_ETA_STEPS
    if done % o.log_every == 0 or done == o.steps or done == early:
      r.saver.check()
      timing, dt = h.lap(timing, done)
      last = h.progress(r, done, m, dt)
    if done % o.eval_every == 0 and done < o.steps:  # its time stays out of the timing
      timing = h.lap(timing, done)[0]
      h.evaluate(r, state, done)
      timing = timing._replace(mark_s=time.time())
    if stopped:
      r.saver.commit()  # the agreed step is on disk before the process exits
      r.say(f"stopped at step {done} ({stopped}); rerun the same command to resume")
      break
  r.prof.close(pending=state)
  h.check_update(stall, o.steps if not stopped else done, m, o.max_stalled_steps)
  return state, dict(last, train_s=time.time() - t_train, stopped=stopped,
                     **h.whole_run(r, timing))


def _finish(r: h.Run, state, out: dict) -> dict:
  """Unless the loop stopped: the final checkpoint, eval and sample, added to `out`."""
  if out["stopped"]:
    return dict(out, sample=None)
  r.saver.save(state, int(state.step))  # written while the eval and the sample run
  out = dict(out, eval_loss=h.evaluate(r, state, int(state.step)),
             sample=h.sample(r, state) if r.s.o.sample_len > 0 else None)
  r.saver.commit()
  return out


def main(argv: list[str]) -> int:
  """The command line (exit status 0 done, 2 bad input, 143 stopped by SIGTERM)."""
  return h.main(argv, Options, run, __doc__)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
