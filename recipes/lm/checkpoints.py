"""A run's checkpoints, as `train_lm.py` keeps them: resume from the newest good one (with the
data iterator where it was), save only finite states (each with the data position), and say
when a save can't fit the preemption window. A state's frozen params (a LoRA run's base,
`TrainState.frozen`) are never saved: they are the run's input (--init_from, or the seed),
named in each checkpoint's extra by where they came from and their fingerprint
(`fnscale.checkpoint.fingerprint`), and taken from a fresh init on resume after checking that
fingerprint. `s` is train_lm's `run_setup.Setup`; `ckpt` a
`fnscale.checkpoint.Manager`, or None when checkpoints are off."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from typing import Callable, NamedTuple

import jax

import fnscale as fs
from recipes.lm import batches, peer_copies, run_log, rundir
from recipes.lm.options import CheckpointOptions, ScheduleOptions


def directory(c: CheckpointOptions) -> str:
  """Where a run with train_lm's checkpoint options `c` (its `run_dir` filled in:
  `rundir.default_run_dir`) keeps its checkpoints ("" with --nocheckpoint)."""
  return (c.checkpoint_dir or os.path.join(c.run_dir, "checkpoints")) if c.checkpoint else ""


@contextlib.contextmanager
def manager(c: CheckpointOptions):
  """A context of the run's one checkpoint manager (`fnscale.checkpoint.manager` over
  `c.checkpoint_dir`, keeping `c.checkpoint_keep`), or of None with checkpoints off;
  leaving it waits for the last save. A run that fails before its first save (refused at
  compile, say) leaves no directory it made: those still empty are removed."""
  if not c.checkpoint_dir:
    yield None
    return
  made = rundir.missing_directories(c.checkpoint_dir)
  try:
    with fs.checkpoint.manager(c.checkpoint_dir, keep=c.checkpoint_keep) as ckpt:
      yield ckpt
  except BaseException:
    rundir.remove_empty(made)
    raise


# orbax's name for a save under way: `<step>.orbax-checkpoint-tmp-<time>` until it commits.
_UNFINISHED = re.compile(r"(\d+)\.orbax-checkpoint-tmp")


def remove_unfinished(directory: str, say) -> list[str]:
  """Removes the saves in `directory` that never finished (a process ended while orbax wrote
  them: a second Ctrl-C, a kill), saying so; nothing reads them, and left there they would
  stay for good. Process 0 removes them, before this run's manager opens (no save of its
  own is under way); local directories only. Returns the names removed."""
  if "://" in directory or jax.process_index() != 0 or not os.path.isdir(directory):
    return []
  gone = sorted(n for n in os.listdir(directory) if _UNFINISHED.match(n))
  for name in gone:
    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  if gone:
    steps = sorted({int(_UNFINISHED.match(n)[1]) for n in gone})
    say(f"checkpoint: removed {len(gone)} unfinished save(s) of step(s) {steps} in "
        f"{directory} (a run ended while writing them); the complete steps are kept")
  return gone


def with_finite_flag(step):
  """The step, plus one metric: whether its loss and new state are all finite (XLA fuses the
  check into the step's update, each param read with its moments: `like`; the loop reads it
  before any save). Frozen params, which the step never changes, are not read."""
  def step_with_flag(state, batch):
    state, metrics = step(state, batch)
    kept = state._replace(frozen=None)
    return state, {**metrics, "finite": fs.checkpoint.all_finite((kept, metrics["loss"]),
                                                                 like=kept.params)}
  return step_with_flag


def resume(s, ckpt, init, train_rows, say, ledger=None):
  """(state, start step, the step resumed from or None, the schedule the checkpoint saved
  or None): the newest good checkpoint of `ckpt`, with `train_rows` at each process's saved
  position, else a fresh `init()`. Says whether a save fits the preemption window and
  compiles the save's finiteness check, unless the run is finished (`finished`). The
  restore's time goes to `ledger`'s "checkpoint", the compile's to its "compile"."""
  o = s.o
  state, start, extra = restore_or_init(ckpt, init, train_rows, dict(
      seed=o.data.seed, corpus_tokens=len(s.corpus.train),
      global_batch=o.step.global_batch), say,
      f"--run_dir={o.ckpt.run_dir} (this run: model {o.model.model_config}, seq {s.cfg.seq}, "
      f"vocab {s.cfg.vocab})", booked(ledger, "checkpoint"))
  saved = None if extra is None else extra.get("schedule")
  if start >= o.schedule.steps:
    say(f"{o.ckpt.run_dir} already holds step {start} of {o.schedule.steps}: nothing left to "
        "train"
        + ("; evaluating and sampling it again (--evaluate_finished)" if o.log.evaluate_finished
           else "; ending here, nothing compiled (--evaluate_finished evaluates and samples "
           "it again)")
        + "; more --steps extend it (its lr schedule kept unless --schedule_steps is given), "
        "--run_dir=NEW_DIR starts another run")
    if finished(start, o.schedule.steps, o.log.evaluate_finished):
      return state, start, start, saved
  if extra is None and os.path.isfile(os.path.join(o.ckpt.run_dir, run_log.RUN_FILE)):
    say(f"{o.ckpt.run_dir} holds an earlier start of this run that saved no checkpoint"
        + (f" ({o.ckpt.checkpoint_dir})" if o.ckpt.checkpoint_dir else " (--nocheckpoint)")
        + ": this run starts at step 0")
  say_save_window(ckpt, o.ckpt.grace_s, say)
  if ckpt is not None:  # compiles save's finiteness check now, not in a preemption window
    with booked(ledger, "compile")():
      fs.checkpoint.nonfinite_leaves(state)
  return state, start, None if extra is None else start, saved


def finished(start: int, steps: int, evaluate_finished: bool) -> bool:
  """Whether a run of `steps` (--steps) resumed at `start` ends without a step, an eval or
  a sample: it holds its last step and --evaluate_finished is off."""
  return start >= steps and not evaluate_finished


def booked(ledger, phase: str):
  """A context maker whose time goes to `ledger`'s `phase` (goodput.py); none without one."""
  return (lambda: ledger.during(phase)) if ledger is not None else contextlib.nullcontext


def restore_or_init(ckpt, init, train_rows, expect: dict, say, run: str = "",
                    restoring=contextlib.nullcontext):
  """`(state, start_step, extra)`: the newest good checkpoint of `ckpt` (a damaged or
  non-finite newer step is refused and left as it is; node-local copies,
  `peer_copies.Copies`: the newest step they give whole), with the data iterator
  `train_rows` put at the position each process saved (`batches.resharded_position` maps
  positions saved by another process count); or `(init(), 0, None)` when there is none (or
  `ckpt` is None).
  Warns when `extra` differs from `expect` (seed, corpus, batch: the data order would
  differ). `restoring`: a context maker around the restore (a goodput phase: `booked`).

  Raises:
    CheckpointError: no checkpoint there can be resumed (another model's, or all damaged);
      the message names `run` (this run's directory and model) and how to start afresh.
  """
  node_local = isinstance(ckpt, peer_copies.Copies)  # the one step the processes agree on
  listed = ((ckpt.latest_step(),) if node_local else
            fs.checkpoint.steps(ckpt, complete=False) if ckpt is not None else ())
  listed = tuple(step for step in listed if step is not None)
  if not listed:
    return init(), 0, None
  target = init(abstract=True)
  try:
    with restoring():  # the time the restore takes (a goodput phase)
      if node_local:
        state, extra, _ = ckpt.restore(listed[0], target._replace(frozen=None), train_rows)
      else:
        state, extra = fs.checkpoint.restore(ckpt, target._replace(frozen=None),
                                             data=train_rows,
                                             reshard_data=batches.resharded_position)
  except fs.CheckpointError as e:
    raise fs.CheckpointError(
        f"{run or ckpt.directory} can't resume from the checkpoints already in "
        f"{ckpt.directory} (steps {list(listed)}): {e} To keep them and start this run "
        "afresh, give it another directory (--run_dir=NEW_DIR, or --checkpoint_dir); to start "
        f"over in this one, remove {ckpt.directory} first.") from None
  if target.frozen is not None:
    state = state._replace(frozen=frozen_params(init, extra, ckpt.directory))
  start = int(extra["step"])
  refused = [d for d in listed if d > start]
  if refused:
    say(f"checkpoint: refused step(s) {refused} in {ckpt.directory} (incomplete, corrupt or "
        "non-finite; left as they are); resuming from the newest good one")
  changed = [f"{k} {extra.get(k)} -> {v}" for k, v in expect.items()
             if extra.get(k) not in (None, v)]
  if changed:
    say("warning: resuming with a different " + ", ".join(changed) + "; the data order "
        "differs from the original run")
  say(f"resumed from step {start} ({ckpt.directory})")
  return state, start, extra


def frozen_params(init, extra: dict, directory: str):
  """The frozen params of a fresh `init()`, checked against the fingerprint the checkpoint's
  `extra` recorded of those it was trained beside.

  Raises:
    CheckpointError: they differ (another base model), naming both and the fix.
  """
  frozen = init().frozen
  saved = (extra.get("frozen") or {}).get("fingerprint")
  got = fs.checkpoint.fingerprint(frozen)
  if saved is not None and saved != got:
    raise fs.CheckpointError(
        f"the checkpoints in {directory} were trained beside frozen params "
        f"{extra['frozen'].get('source')!r} of fingerprint {saved}, but this run's are "
        f"fingerprint {got}: another base model. Fix: resume with the same --init_from (and "
        "--precision) as the saved run, or start afresh in another --run_dir")
  return frozen


def say_save_window(ckpt, grace_s: float, say) -> bool:
  """Says so when a checkpoint save can't fit the preemption window, from the newest step's
  save time (orbax's step metadata; None `ckpt` or no step yet: nothing to say). After a
  notice the final save may first wait for one in flight: two saves must fit in `grace_s`.
  Returns whether it said so."""
  if not isinstance(ckpt, fs.checkpoint.Manager):  # none, or node-local copies
    return False
  last = fs.checkpoint.last_save_seconds(ckpt)
  if last is None or 2 * last[1] <= grace_s:
    return False
  step, seconds = last
  say(f"warning: a checkpoint save takes ~{seconds:.1f} s here (step {step}); after a "
      "preemption notice the final save may first wait for one in flight, "
      f"~{2 * seconds:.0f} s in all, but grace_s is {grace_s:g} s: raise grace_s (within the "
      "platform's notice) or checkpoint more often (checkpoint_every), so that less is lost "
      "when the final save can't finish")
  return True


class Saver(NamedTuple):
  """What stands between a step and its checkpoint (`saver`)."""
  note: Callable  # note(step, metrics): keep the step's on-device finiteness flag
  check: Callable  # check(): StepError naming the first non-finite step and the last good save
  save: Callable  # save(state, step, emergency=False): check(), then save step (once) with
  # the data position, to the checkpoints or (emergency=True) to the emergency copies
  commit: Callable  # commit(): wait until the last save is committed


def saver(s, ckpt, train_rows, resumed: int | None, say, ledger=None, local=None) -> Saver:
  """The loop's checkpoint side: a non-finite loss or state is never saved (the flags of the
  steps since the last check are read before every save and progress line), saves go through
  `ckpt` (or the emergency copies' manager `local`, emergency.py) asynchronously with the
  data iterator's position, and a save that can't fit the preemption window is said as soon
  as its time is known (at start-up from the last run's save; in the run from its second
  save: the first one's time includes one-off compiles). `resumed`: the step `ckpt` holds
  already. The time the loop waits on saves and commits goes to `ledger`'s "checkpoint"
  (goodput.py)."""
  flags, last_saved, warned, saves, frozen = [], resumed, False, 0, {}
  copies = []  # the steps of the emergency copies saved
  waiting = booked(ledger, "checkpoint")

  def check():
    bad = first_nonfinite(flags)
    if bad is not None:
      commit()  # the last good save is on disk before the run stops
      raise nonfinite_error(bad, last_saved, s.o.ckpt.checkpoint_dir, s.o.schedule.lr)

  def save(state, step: int, emergency: bool = False):
    check()
    if emergency:
      if local is not None and step not in copies[-1:]:
        with waiting():
          save_copy(state, step)
      return
    if ckpt is None or step == last_saved:
      return
    with waiting():
      write(state, step)

  def save_copy(state, step: int):
    t = time.time()
    peer_copies.save(local, step, state._replace(frozen=None), train_rows,
                     record(s, state, step, frozen))
    copies.append(step)
    if len(copies) == 1:  # said once: they come every few steps
      say(f"checkpoint: emergency copy of step {step} saving in the background (the loop "
          f"waited {time.time() - t:.2f} s; one every {s.o.ckpt.emergency_every} steps in "
          f"{local.directory})")

  def write(state, step: int):
    nonlocal last_saved, warned, saves
    if saves >= 2 and not warned:  # the first save's time includes one-off compiles
      warned = say_save_window(ckpt, s.o.ckpt.grace_s, say)
    t = time.time()
    # Before the next batch is read: the iterator's position is this step's.
    fs.checkpoint.save(ckpt, step, state._replace(frozen=None), data=train_rows,
                       extra=record(s, state, step, frozen))
    last_saved, saves = step, saves + 1
    say(f"checkpoint: step {step} saving in the background (the loop waited "
        f"{time.time() - t:.2f} s; {s.o.ckpt.checkpoint_dir})")

  def commit():
    if ckpt is not None:
      with waiting():
        fs.checkpoint.wait(ckpt)

  return Saver(lambda step, m: flags.append((step, m["finite"])), check, save, commit)


def record(s, state, step: int, frozen: dict) -> dict:
  """What a checkpoint of run `s` records beside its state at `step`: what fixes the state's
  shapes and the data order, the lr schedule, and for a frozen base its source and
  fingerprint (`frozen`, filled in at the first save: they never change)."""
  if state.frozen is not None and not frozen:
    frozen.update(source=s.o.model.init_from or f"fresh, seed {s.o.data.seed}",
                  fingerprint=fs.checkpoint.fingerprint(state.frozen))
  return dict(
      step=step, seed=s.o.data.seed, model=s.o.model.model_config, seq=s.cfg.seq,
      vocab=s.cfg.vocab, global_batch=s.o.step.global_batch,
      corpus_tokens=len(s.corpus.train), schedule=schedule_record(s.o.schedule),
      **({"frozen": dict(frozen)} if frozen else {}))


def schedule_record(sched: ScheduleOptions) -> dict:
  """What a checkpoint records of the lr schedule of train_lm's schedule options, read back
  on resuming (`run_setup.resumed_schedule`): the options that follow the run's length, and
  its peak lr."""
  return dict(steps=sched.schedule_steps, warmup_steps=sched.warmup_steps, lr=sched.lr)


def first_nonfinite(flags: list) -> int | None:
  """The first step of `flags` ([(step, on-device bool: its loss and state were finite)])
  whose flag is False, or None; reads them all in one transfer and empties the list."""
  if not flags:
    return None
  values = jax.device_get([f for _, f in flags])
  steps = [s for s, _ in flags]
  flags.clear()
  return next((s for s, ok in zip(steps, values) if not ok), None)


def nonfinite_error(bad: int, last_good: int | None, ckpt_dir: str, lr: float):
  """The StepError that stops a run whose loss or state went non-finite at step `bad`."""
  if ckpt_dir and last_good is not None:
    good = (f"the last good checkpoint is step {last_good} in {ckpt_dir} (rerunning resumes "
            "from it)")
  else:
    good = "there is no good checkpoint of this run" if ckpt_dir else "checkpoints are off"
  return fs.StepError(
      f"the loss or the train state went non-finite (NaN or inf) at step {bad}; the run stops "
      f"and saves no step from it on; {good}. Lower lr (peak {lr:g}), raise warmup_steps, or "
      "use precision=float32")
