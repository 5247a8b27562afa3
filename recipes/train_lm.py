"""Train a GPT- or Llama-style language model on every device the machine (or pod) has.

  python recipes/train_lm.py                      # CPU: 8 simulated devices, `tiny_gpt2`
  python recipes/train_lm.py --model_config=small --mesh="data=-1,fsdp=4"    # a TPU/GPU host
  python -m recipes.train_lm --steps=50           # the same command, run as a module
  from recipes.train_lm import train_lm           # the same options as keywords, in Python
  train_lm(model_config="tiny_gpt2", dataset="tiny_corpus", epochs=1)

Read top to bottom: `run` decides the run (every default filled in, the mesh built, every
input checked before anything is written), `_run` builds the step, restores and compiles,
`_loop` steps, logs, evaluates and saves, `_finish` ends the run. Each job lives in a module
of `lm/`: options.py (every option), run_setup.py (defaults, mesh, batch), memory.py (rows,
accumulation, remat and optimizer, decided once so that the step fits the device's memory),
startup.py (devices, processes, topology, precision), data.py and batches.py,
checkpoints.py, evaluation.py, progress.py (the progress line and clock), summary.py, rundir.py and run_log.py (what the run directory holds), stalls.py,
finetune.py (LoRA: --lora_rank; DPO:
--objective=dpo, with dpo.py and preference.py); the models are gpt.py, llama.py and
moe.py. fnscale does the distribution. Only process 0 prints and writes files. Rerunning the
same command resumes from the newest good checkpoint, bitwise (in a run directory of other
options: an error).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from typing import Any

import jax

import fnscale as fs
from recipes.lm import batches, checkpoints, cli, data, evaluation, finetune, memory, models
from recipes.lm import profiling, progress, run_log, run_setup, rundir, stalls, startup, stopping
from recipes.lm import emergency, goodput, summary
from recipes.lm.options import Options  # every option: flag, keyword, default, range

MODELS = models.MODELS  # model name -> its module (recipes/lm/models.py)


def train_lm(**options) -> summary.Summary:
  """Trains a model; each keyword is a field of `Options` (the command line's `--name`).

  Returns:
    The run's `Summary`: eval loss (nats/token), bits/byte, steps, tokens/s, paths, state.

  Raises:
    FnscaleError (or a subclass): any bad input, before anything is written or compiled.
  """
  return run(cli.check_options(Options, options))


def run(o: Options, started: float | None = None) -> summary.Summary:
  """Trains per `o` (see `train_lm`); returns the summary with the final state. `started`:
  when the process started (the command line's), the start of its goodput's wall time
  (default: now).

  Raises:
    FnscaleError: bad input; stopping.Interrupted: a Ctrl-C that ended the run at once
      (its text says what is saved).
  """
  # --compile_cache_dir is this run's: the caller's later compiles don't use it.
  with fs.compilation_cache_restored():
    # Devices, processes, compile cache, shutdown; `say` prints on process 0 only.
    t0, say = time.time(), startup.start(o)
    checkpoint_dir = None  # not decided yet
    try:
      # From here on (data, compile, evals, loop, final save), a notice (SIGTERM to any
      # process) stops every process after one step, or within grace_s wherever it is, and
      # a process lost in a collective is named, not left to a runtime error.
      fs.multihost.check_preemption_service()  # the guard needs it: now, not after the compile
      data.check_epochs(o.data.dataset, o.schedule.epochs)
      startup.check_init_from(o.model.init_from)  # a model directory, before its tokenizer
      rundir.check_directory(o.ckpt.run_dir, "--run_dir")  # before the data is read
      emergency.check_options(o.ckpt)
      with fs.multihost.preemption_guard(grace_s=o.ckpt.grace_s) as should_stop, \
          fs.multihost.peer_guard():
        say(f"train_lm: reading the data ({o.data.dataset}) ...")
        setup = run_setup.decide(o, finetune.corpus(o, models.tokenizer(o.model), say), say)
        rundir.check_same_run(setup.o, jax.device_count(),  # not another run's directory
                              models.tokenizer_sha(setup))
        ledger = goodput.ledger(started or t0, setup.o.ckpt.run_dir)  # before its log is cut
        checkpoint_dir = setup.o.ckpt.checkpoint_dir
        if checkpoint_dir:  # one directory every process sees, checked before use
          fs.checkpoint.check_shared_directory(checkpoint_dir)
          checkpoints.remove_unfinished(checkpoint_dir, say)
        local_dir = emergency.prepare(setup, say)  # its copies: this run's, writable
        # One checkpoint manager for the whole run (and one for its emergency copies);
        # leaving the block waits for the last save. orbax's warnings go to RUN_DIR/log.txt.
        with rundir.library_log(setup.o.ckpt.run_dir), \
            checkpoints.manager(setup.o.ckpt) as ckpt, \
            emergency.manager(local_dir, setup.mesh) as local:
          return _run(setup, (ckpt, local), t0, say, should_stop, ledger)
    except KeyboardInterrupt:  # every block above has closed: what is on disk stays
      raise stopping.interrupted(checkpoint_dir) from None


def _step(setup: run_setup.Setup, optimizer, policy) -> tuple[Any, Any]:
  """(the sharded train step, not yet compiled; the jitted eval loss) of the run."""
  o, model = setup.o, setup.model
  if setup.lora is not None:  # adapters trained, the base frozen (finetune.py)
    train_loss, loss_fn, aux, weighted = finetune.losses(setup, setup.lora)
  else:  # packed rows: weighted (padding has none)
    (train_loss, loss_fn, aux), weighted = models.losses(setup), setup.corpus.packed is not None
  step_fn = fs.train_step(train_loss, optimizer, policy=policy,
                          accum_steps=o.step.accum_steps, accum_gather=o.step.accum_gather,
                          has_aux=aux, weighted=weighted,
                          update_norm=o.schedule.update_norm or None)
  kernels = dict(attention=o.model.attention, context=o.step.context,
                 context_order=o.step.context_order)
  # A LoRA state is born in its shardings (the adapters follow the base's): none to derive.
  rules = {} if setup.lora is not None else dict(
      rules=model.RULES, logical_axes=model.logical_axes(setup.cfg))
  step_fn = checkpoints.with_finite_flag(models.with_balancing(step_fn, model, setup.cfg))
  step_fn = fs.shard_step(fs.with_kernel(step_fn, **kernels), setup.mesh, **rules)
  return step_fn, evaluation.eval_loss(loss_fn, policy, kernels)


def _run(setup: run_setup.Setup, managers, t0: float, say, should_stop,
         ledger: goodput.Ledger) -> summary.Summary:
  """Restore, build and compile; then the loop and the end of the run. `managers`: the
  checkpoints' and the emergency copies' fnscale.checkpoint.Manager (the copies': node-local
  peer_copies.Copies with `{process}` in --emergency_dir), each None when off. It
  resumes from the newer of the two (emergency.newest). A run that already holds its last
  step ends after the restore (`checkpoints.finished`): nothing compiled. `ledger` books
  where the time goes (goodput.py), recorded at each progress line and at the end."""
  ckpt, local = managers
  policy = startup.policy(setup.o.model.precision, setup.topo.platform)
  peak = progress.peak_flops(setup.topo)  # before the mesh context: one device's matmul
  with fs.with_mesh(setup.mesh):
    key = jax.random.key(setup.o.data.seed)
    # The state's shapes: the schedule, decided on restoring, shapes none of it.
    opt = run_setup.optimizer(setup.o.step, setup.o.schedule)[0]
    init = (finetune.init(setup, opt, policy, key, setup.lora) if setup.lora is not None
            else models.init(setup, opt, policy, key))
    # grain reads this process's rows (whole rows: `batches.put` splits the sequence over a
    # context axis); fs.global_batch makes one array over every process.
    train_rows, evals = batches.run_batches(setup, fs.batch_sharding(setup.mesh,
                                                                     context_axes=()))
    source = emergency.newest(ckpt, local, say)
    state, start, resumed, saved = checkpoints.resume(setup, source, init, train_rows, say,
                                                      ledger)
    if checkpoints.finished(start, setup.o.schedule.steps, setup.o.log.evaluate_finished):
      _export(setup, state, say)
      return summary.finished(setup, state, start, t0, say)
    setup = run_setup.resumed_schedule(setup, saved, start, say)
    o = setup.o
    optimizer, schedule = run_setup.optimizer(o.step, o.schedule)
    rows = next(train_rows)  # this process's rows, as numpy
    first = batches.put(setup, rows)
    setup, step_fn, eval_loss = _compiled(setup, (optimizer, policy), state, first, ledger,
                                          say)
    job = run_setup.Run(
        setup=setup, t0=t0, start=start, resumed=resumed, batches=train_rows,
        should_stop=should_stop,
        compiled=run_setup.Compiled(step_fn, fs.compile_report(step_fn, state, first),
                                    policy, progress.host_schedule(schedule), peak),
        evals=run_setup.Evals(eval_loss, [batches.put(setup, b) for b in evals],
                              data.baseline(setup.corpus), finetune.params_of(setup.lora)),
        rec=_records(setup, checkpoints.saver(
            setup, ckpt, train_rows, resumed if source is ckpt else None, say, ledger, local),
            start, resumed, say, ledger))
    with contextlib.closing(job.rec.log):  # closed however the run ends (a Ctrl-C too)
      job.rec.log.write(start, ledger.record())  # an earlier start's time, kept past the cut
      summary.describe(job, state)
      batches.say_padding(o.data, o.tune, rows, evals, say)
      ev = (evaluation.evaluate(job, state, 0), 0) if start == 0 else (None, None)
      with stopping.ctrl_c() as ctrl_c:  # the first Ctrl-C: stop after this step, saved
        state, out = _loop(job._replace(ctrl_c=ctrl_c), state, first, ev)
      out = _finish(job, state, out)
      if not out["stopped"]:
        _export(setup, state, say)
      out = dict(out, goodput=ledger.record())
      job.rec.log.write(int(state.step), out["goodput"])
  return summary.summarize(job, state, out)


def _records(setup: run_setup.Setup, saver: checkpoints.Saver, start: int,
             resumed: int | None, say, ledger: goodput.Ledger) -> run_setup.Records:
  """Where the run says, logs, traces and saves (`saver`): a resumed run's log continues
  from its step, a fresh one starts a fresh log."""
  o = setup.o
  log = run_log.run_log(o.ckpt.run_dir, active=jax.process_index() == 0, say=say,
                        tracker=o.log.tracker, config=cli.flat(o),
                        keep_through=-1 if resumed is None else start)
  return run_setup.Records(say, log, profiling.profiler(setup.profile, o.ckpt.run_dir, say=say),
                           saver, ledger)


def _compiled(setup: run_setup.Setup, how: tuple, state, first, ledger, say):
  """(the setup, the train step compiled ahead of time for the first batch (step 0 doesn't
  compile again), the eval loss): the step held against the device's memory and the same on
  every process (a barrier); `how`: (optimizer, jmp policy). A step that doesn't fit where
  train_lm chose what holds more (`_lighter`) is compiled again holding less, said."""
  ledger.enter("compile")
  unrolled = getattr(setup.cfg, "unroll", False)
  say(f"train_lm: compiling the train step of {setup.o.model.model_config} on mesh "
      f"{dict(setup.mesh.shape)}{', the layer loop unrolled' if unrolled else ''} ...")
  step_fn, eval_loss = _step(setup, *how)
  while True:
    try:
      step_fn = memory.compile_step(setup, step_fn, state, first)
      break
    except fs.FitError as e:
      lighter = _lighter(setup)
      if lighter is None:  # what the user gave, or nothing left: the error is theirs
        raise
      setup, what, then = lighter
      say(f"memory: {what} step needs {e.needed / memory.GiB:.2f} GiB per device (XLA's "
          f"peak), more than the device has; {then}")
      step_fn, eval_loss = _step(setup, *how)
  fs.multihost.agree_on_step(step_fn)
  ledger.enter("other")
  return setup, step_fn, eval_loss


def _lighter(setup: run_setup.Setup):
  """(the setup holding less, what held more, what now) where train_lm chose the heavier:
  the scan for a layer loop unrolled by default (`models.unrolled`: the 766M Llama unrolled
  needed 19.5 GiB, the scan 15.0), full remat for --remat's offload_attn
  (`remat.whole_block`: 0.2 GiB more than full for the 766M); None where neither is left."""
  o = setup.o
  if getattr(setup.cfg, "unroll", False) and o.model.unroll is None:
    return (setup._replace(cfg=setup.cfg._replace(unroll=False)),
            "the unrolled layer loop's", "compiling the scan (--nounroll)")
  asked = setup.asked.step.remat_policy if setup.asked is not None else None
  if o.step.remat_policy == "offload_attn" and asked == "auto":
    step = dataclasses.replace(o.step, remat_policy="full")
    return (setup._replace(o=dataclasses.replace(o, step=step)),
            "--remat's offload_attn", "compiling it with --remat_policy=full")
  return None


def _export(setup: run_setup.Setup, state, say) -> None:
  """--export_hf: the params as a Hugging Face checkpoint (a LoRA run's merged weights, and
  its adapters as a PEFT adapter)."""
  if not setup.o.ckpt.export_hf:
    return
  if setup.lora is not None:
    finetune.export(setup, state, setup.lora, say)
  else:
    models.export(setup, state, say)


def _loop(job: run_setup.Run, state, batch, ev: tuple) -> tuple[Any, dict]:
  """The loop from `job.start` to --steps: step, log, evaluate, save. Evals, checkpoints
  and the first step (dispatch warm-up) are left out of the timing (tokens/s, MFU, ETA).
  Returns the state and the run's figures (`eval_loss` and `eval_step`: the last eval's,
  from `ev`, (loss, step) at the start, on). A stop evaluates its step unless a preemption
  notice stopped it (its grace_s is for the save)."""
  o, rec, m, last, stopped, stall = job.setup.o, job.rec, None, {}, None, stalls.Stall()
  clock, t_train, every = progress.clock(), time.time(), o.ckpt.checkpoint_every
  copy_every = o.ckpt.emergency_every  # 0 with --nocheckpoint (emergency.check_options)
  steps, max_stalled = o.schedule.steps, o.schedule.max_stalled_steps
  for step in range(job.start, steps):
    rec.goodput.at_step(step + 1)  # productive, or lost: a step an earlier start trained
    rec.prof.at_step(step, pending=m)
    prev, (state, m) = m, job.compiled.step(state, batch)
    # The previous step's update, read while this one runs (one step stays in flight).
    stall = stalls.check_update(stall, step, prev, max_stalled)
    done = step + 1
    rec.saver.note(done, m)
    # One step in flight on CPU: simulated devices share one pool of host threads, and with
    # several steps queued XLA's CPU collectives can deadlock (no overlap to lose there).
    if job.setup.topo.platform == "cpu":
      jax.block_until_ready((state, m))
    # Every step, on every process (the preemption guard's sync point).
    notice = job.should_stop(step)
    stopped = stopping.reason(done, steps, notice, job.ctrl_c(), o.ckpt.stop_after)
    if stopped or (every and done % every == 0 and done < steps):
      with clock.paused():  # before the next batch is read: the position is this step's
        rec.saver.save(state, done)
    elif copy_every and done % copy_every == 0 and done < steps:
      with clock.paused():
        rec.saver.save(state, done, emergency=True)
    if done < steps and not stopped:
      batch = batches.put(job.setup, next(job.batches))  # while it runs
    clock.start(done, m["loss"])
    if done % o.log.log_every == 0 or done == steps or clock.due(done):
      rec.saver.check()
      last = progress.progress(job, done, m, clock.lap(done))
    if done % o.log.eval_every == 0 and done < steps:
      with clock.paused():
        ev = evaluation.evaluate(job, state, done), done
    if stopped:
      rec.saver.commit()  # the agreed step is on disk before the process exits
      if ev[1] != done and not notice:  # the stop's own loss, its step saved first
        ev = evaluation.evaluate(job, state, done), done
      rec.say(f"stopped at step {done} ({stopped}): "
              f"{stopping.what_is_saved(o.ckpt.checkpoint_dir)}")
      break
  rec.goodput.enter("other")
  rec.prof.close(pending=state)
  stalls.check_update(stall, steps if not stopped else done, m, max_stalled)
  return state, dict(last, train_s=time.time() - t_train, stopped=stopped,
                     eval_loss=ev[0], eval_step=ev[1],
                     **progress.whole_run(job.setup, job.compiled.peak, clock.totals()))


def _finish(job: run_setup.Run, state, out: dict) -> dict:
  """Unless the loop stopped: the final checkpoint, eval and sample, added to `out`."""
  if out["stopped"]:
    return dict(out, sample=None)
  job.rec.saver.save(state, int(state.step))  # written while the eval and the sample run
  out = dict(out, eval_loss=evaluation.evaluate(job, state, int(state.step)),
             eval_step=int(state.step),
             sample=evaluation.sample(job, state) if job.setup.o.log.sample_len > 0 else None)
  job.rec.saver.commit()
  return out


def main(argv: list[str], own_process: bool = False) -> int:
  """The command line (exit status 0 done, 2 bad input, 75 a lost process, 143 stopped by
  SIGTERM, 130 by Ctrl-C). `own_process`: as `python recipes/train_lm.py`, a Ctrl-C that
  ends the run at once ends the process (`cli.options_main`)."""
  # A process of its own: its goodput counts from the process's start (the imports).
  entry = functools.partial(run, started=goodput.process_start()) if own_process else run
  return cli.options_main(argv, Options, entry, __doc__, own_process=own_process)


if __name__ == "__main__":
  sys.exit(main(sys.argv, own_process=True))
