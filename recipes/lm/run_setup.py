"""What one run of train_lm is, decided and checked before anything is written: the options
with every default filled in, the hardware, the mesh, the model and the data (`Setup`, from
`decide`), the optimizer, and what the loop shares once the step has compiled (`Run`)."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax

import fnscale as fs
from recipes.lm import batches, checkpoints, data, finetune, hardware, int8, memory, models
from recipes.lm import optimizers, packing, profiling, progress, run_log, rundir, startup
from recipes.lm.options import Options, ScheduleOptions, StepOptions, log_defaults
from recipes.lm.options import platform_default, schedule_defaults
from recipes.lm.remat import remat_policy


class Setup(NamedTuple):
  """A run as train_lm's options decide it (`decide`): the options with every default filled
  in (checked), the hardware, mesh, model and data."""
  o: Options
  topo: fs.Topology
  mesh: jax.sharding.Mesh
  model: Any  # the model's module: gpt, llama or moe
  cfg: Any  # its ModelConfig
  profile: profiling.ProfileWindow | None  # --profile_steps
  corpus: data.Corpus
  lora: Any = None  # the fnscale.lora.LoraConfig of --lora_rank (None: full fine-tuning)
  asked: Options | None = None  # the options as given, before any default was filled in


def decide(o: Options, corpus: data.Corpus, say) -> Setup:
  """The run options `o` ask for on these devices over `corpus`: every default filled in
  (`options.PLATFORM_DEFAULTS`, `options.schedule_defaults`, `options.log_defaults`), the
  mesh built, every size checked; a run resumed on another device count with its batch left
  to the default keeps the global batch its run.json records (`_kept_batch`), said. Raises
  FnscaleError on any bad value, before anything is written."""
  if o.step.optimizer == "adafactor" and o.step.mu_dtype is not None:
    raise fs.InputError(f"--mu_dtype={o.step.mu_dtype} with --optimizer=adafactor: Adafactor "
                        "keeps no first moment; fix: drop --mu_dtype, or --optimizer=adamw")
  asked, topo = o, hardware.detect(o.hardware)
  size = platform_default(o.model, "model_config", topo.platform)
  seq = platform_default(o.data, "seq", topo.platform)
  model, cfg, name = models.choose(o.model, size, seq, corpus, dataset=o.data.dataset,
                                   lora_rank=o.tune.lora_rank)
  if o.model.int8 and topo.generation in int8.SLOWER_ON:
    say(f"note: --int8 trained at 0.70x bfloat16's tokens/s on a TPU {topo.generation} for GPT "
        "small, 0.81x for GPT medium, 1.02x for the 766M Llama (why: recipes/bench/README.md, "
        "'--int8 by part')")
  run_log.check_tracker(o.log.tracker)
  lora = finetune.lora_config(o.tune, model, cfg, o.model.model_config)
  if o.tune.objective == "dpo":
    finetune.dpo_config(o.tune)
  run_dir = o.ckpt.run_dir or rundir.default_run_dir(
      name, o.data.dataset, models.tokenizer(o.model), corpus.vocab)
  o, kept = _kept_batch(o, run_dir)  # before the mesh: --mesh=auto plans for the batch
  mesh, planned = _mesh(o, model, cfg, topo, say, lora)
  if kept:
    _say_kept(kept, run_dir, platform_default(o.step, "batch_size", topo.platform), mesh, say)
  # Rows, accumulation, remat and optimizer, decided here once: what the user gave, the rest
  # what fits the device's memory. The options hold them from here on.
  step = memory.choose(o.step, o.model.precision, memory.Model(model, cfg, name, lora), topo,
                       mesh, platform_default(o.step, "batch_size", topo.platform), say,
                       planned)
  o = dataclasses.replace(o, step=dataclasses.replace(o.step, **step._asdict()))
  cfg = models.unrolled(o.model, o.step, cfg, name, topo.platform)
  check_batch(seq, step.batch_size, step.global_batch, step.accum_steps, mesh)
  check_pipeline(o.step.microbatches, model, mesh)
  if corpus.packed is not None:
    packing.check_spec(batches.pack_spec(o.data, seq), corpus.packed[0])
  data.check_fits(corpus, seq)
  steps = batches.steps_for(corpus, seq, step.global_batch, o.schedule.epochs,
                            o.schedule.steps)
  if steps is None:
    steps = platform_default(o.schedule, "steps", topo.platform)
  profile = profiling.parse_profile_steps(o.log.profile_steps, steps)
  ckpt = dataclasses.replace(o.ckpt, run_dir=run_dir)
  o = dataclasses.replace(
      o, model=dataclasses.replace(o.model, model_config=name),
      data=dataclasses.replace(o.data, seq=seq),
      schedule=schedule_defaults(o.schedule, size, steps), log=log_defaults(o.log, steps),
      ckpt=dataclasses.replace(ckpt, checkpoint_dir=checkpoints.directory(ckpt)))
  return Setup(o, topo, mesh, model, cfg, profile, corpus, lora, asked)


def _kept_batch(o: Options, run_dir: str) -> tuple[Options, tuple[int, int] | None]:
  """(`o`, (global batch, devices) its run directory records) for a run resumed on another
  device count (a restart on fewer hosts) with its batch left to the default: `o` asks for
  the recorded global batch, so the rows per device and the accumulation follow
  (`memory.choose`) and the data order stays. Else (`o`, None)."""
  if o.step.global_batch or o.step.batch_size:
    return o, None
  kept = rundir.recorded_batch(run_dir, jax.device_count())
  if kept is None:
    return o, None
  return dataclasses.replace(o, step=dataclasses.replace(o.step, global_batch=kept[0])), kept


def _say_kept(kept: tuple[int, int], run_dir: str, per_device: int, mesh, say) -> None:
  """Says that the recorded global batch `kept` (`_kept_batch`) is kept, where the default
  (`per_device` rows on each of `mesh`'s data-parallel devices) would differ."""
  default = per_device * int(np.prod([mesh.shape[a] for a in fs.data_axes(mesh)]))
  if default != kept[0]:
    say(f"train_lm: {run_dir} was trained with global batch {kept[0]} on {kept[1]} devices; "
        f"keeping it on these {jax.device_count()} (by default {default}): rows per device "
        "and accumulation follow, the data order stays (--global_batch sets another)")


def _mesh(o: Options, model, cfg, topo, say, lora=None) -> tuple[Any, memory.Planned | None]:
  """(mesh, None): the --mesh and --dcn axes (each parsed once); or with --mesh=auto (mesh,
  the planner's row): its mesh, remat and accumulation for the global batch, every device a
  data-parallel one (its table is said; `memory.choose` takes the row as what was asked)."""
  dcn = startup.mesh_axes(o.hardware.dcn, "--dcn")
  if o.hardware.mesh != "auto":
    axes = startup.mesh_axes(platform_default(o.hardware, "mesh", topo.platform), "--mesh")
    return startup.make_mesh(axes, dcn, topo, say), None
  per_device = platform_default(o.step, "batch_size", topo.platform)
  batch = (per_device * jax.device_count() if o.step.global_batch is None
           else o.step.global_batch)
  planned_opt = optimizers.transformation(o.step.optimizer or "adamw", 1e-3,
                                          mu_dtype=o.step.mu_dtype or "float32")
  keep = remat_policy(dataclasses.replace(o.step, remat=False), topo.platform)
  (axes, remat, steps, gather, context), table = startup.plan_mesh(
      model, cfg, topo, batch, o.model.precision, planned_opt, lora, keep)
  say("mesh=auto: " + table)
  return (startup.make_mesh(axes, dcn, topo, say),
          memory.Planned(batch, remat, steps, gather, context))


def optimizer(step: StepOptions, sched: ScheduleOptions):
  """(optax transformation, lr schedule) for train_lm's step and schedule options:
  `step.optimizer` (AdamW, its first moment in `step.mu_dtype`, or Adafactor:
  `recipes.lm.optimizers`) with global-norm clipping; linear warmup then cosine decay over
  `sched.schedule_steps` (GPT-3's recipe), the final lr after it. The schedule shapes no
  state: a state restored under one schedule trains under another."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, sched.lr, warmup_steps=sched.warmup_steps,
      decay_steps=max(sched.schedule_steps, sched.warmup_steps + 1),
      end_value=sched.lr * sched.min_lr_ratio)
  return optimizers.transformation(step.optimizer or "adamw", schedule,
                                   mu_dtype=step.mu_dtype or "float32",
                                   weight_decay=sched.weight_decay,
                                   grad_clip=sched.grad_clip), schedule


def resumed_schedule(s: Setup, saved: dict | None, start: int, say) -> Setup:
  """`s` with the lr schedule of a run resumed at step `start` from a checkpoint whose
  schedule was `saved` (`checkpoints.schedule_record`; None: a fresh run, or a checkpoint
  that records none). The run's own schedule is kept unless --schedule_steps is given (a
  length apart from --steps, as MaxText's learning_rate_schedule_steps): more --steps then
  train on at its final lr, so the lr never jumps mid-run and the Adam moments go on at the
  lr they were trained at; stretching is asked for by name. So is another peak lr (--lr; the
  run's is kept otherwise). Says what happens where the run's schedule and this one's differ."""
  step, now = s.o.step, s.o.schedule
  asked = None if s.asked is None else s.asked.schedule
  if not start or start >= now.steps:  # a fresh run, or one with no step left to train
    return s
  if saved is None:
    say(f"schedule: the checkpoint records no schedule; steps {start + 1}-{now.steps} train "
        f"under this run's {now.schedule_steps}-step schedule")
    return s
  run = dataclasses.replace(now, lr=saved.get("lr", now.lr), schedule_steps=saved["steps"],
                            warmup_steps=saved["warmup_steps"])
  if asked is None or asked.lr is None:
    now = dataclasses.replace(now, lr=run.lr)
  kept = dataclasses.replace(run, lr=now.lr, warmup_steps=(
      run.warmup_steps if asked is None or asked.warmup_steps is None else now.warmup_steps))
  lr_at = lambda sched: float(optimizer(step, sched)[1](start))
  if now.lr != run.lr:
    say(f"schedule: --lr={now.lr:g} replaces the run's peak lr {run.lr:g}: the lr at step "
        f"{start + 1} is {lr_at(kept):.3g}, where the run's schedule has {lr_at(run):.3g}")
  if asked is None or asked.schedule_steps is None:
    if kept.schedule_steps != now.steps:
      say(f"schedule: the run's checkpoint was trained under a {kept.schedule_steps}-step "
          f"schedule, kept for --steps={now.steps}"
          + (f": steps {kept.schedule_steps + 1}-{now.steps} train at its final lr "
             f"{kept.lr * kept.min_lr_ratio:.3g}" if now.steps > kept.schedule_steps else "")
          + f" (--schedule_steps={now.steps} stretches it over the run instead: lr "
          f"{lr_at(kept):.3g} at step {start + 1} would become {lr_at(now):.3g})")
    return s._replace(o=dataclasses.replace(s.o, schedule=kept))
  if now.schedule_steps != saved["steps"]:
    say(f"schedule: --schedule_steps={now.schedule_steps} replaces the run's "
        f"{saved['steps']}-step schedule: the lr at step {start + 1} is "
        f"{lr_at(now):.3g}, where the run's schedule has {lr_at(kept):.3g}")
  return s._replace(o=dataclasses.replace(s.o, schedule=now))


def check_batch(seq: int, per_device: int, batch: int, accum_steps: int, mesh) -> None:
  """Raises FnscaleError for sizes < 1, ShardingError for a global `batch` that doesn't split
  over `mesh`'s data axes in each of `accum_steps` steps (the message gives a multiple)."""
  if seq < 1 or per_device < 1 or batch < 1 or accum_steps < 1:
    raise fs.InputError(f"seq={seq}, batch_size={per_device}, global_batch={batch}, "
                          f"accum_steps={accum_steps}: each must be >= 1")
  dp = int(np.prod([mesh.shape[a] for a in fs.data_axes(mesh)]))
  if batch % (dp * accum_steps):
    raise fs.ShardingError(
        f"global batch {batch} does not divide over the data axes: the mesh {dict(mesh.shape)}"
        f" splits the batch {dp} ways over {fs.data_axes(mesh)}"
        + (f" in each of {accum_steps} accumulation steps" if accum_steps > 1 else "")
        + f"; use a global_batch that is a multiple of {dp * accum_steps} (or batch_size)")


def check_pipeline(microbatches: int, model, mesh) -> None:
  """Raises FnscaleError for a pipeline that can't run as asked: --microbatches below 0 or
  without a "stage" axis to cut, or either with a model whose layers don't run as stages
  (its `loss_fn` takes no `microbatches`): a "stage" axis would only split the batch."""
  stages = mesh.shape.get("stage", 1)
  staged = "microbatches" in inspect.signature(model.loss_fn).parameters
  if microbatches < 0 or (microbatches and stages == 1) or ((microbatches or stages > 1)
                                                            and not staged):
    given = ([f"--microbatches={microbatches}"] if microbatches else []) + (
        [f"a 'stage' axis of {stages}"] if stages > 1 else [])
    raise fs.InputError(
        f"{' and '.join(given)} on mesh {dict(mesh.shape)}: pipeline stages need a model "
        "whose layers run as stages (--model_config=llama-*"
        + ("" if staged else "; this one's don't") + ") and a mesh with a 'stage' axis, "
        "e.g. --mesh=data=2,stage=4; fix: a Llama model, or no stage axis and no "
        "--microbatches.")


class Compiled(NamedTuple):
  """The run's compiled step and what describes it."""
  step: Callable  # the compiled step: (state, batch) -> (state, metrics)
  report: Any  # its fs.compile_report
  policy: Any  # the jmp policy (None: float32)
  schedule: Callable[[int], float]  # the learning rate at a step
  peak: progress.Peak  # the MFU denominator


class Evals(NamedTuple):
  """What the run's evals and its sample read."""
  loss: Callable  # loss(params, batch) -> mean loss (jitted)
  batches: list  # the held-out global batches of every eval
  baseline: data.Baseline  # the held-out losses to beat (bigram, unigram)
  params_of: Callable = lambda state: state.params  # the params evaluated and sampled


class Records(NamedTuple):
  """Where the run says, logs, traces and saves what it does and books its time."""
  say: Callable[..., None]  # print, on process 0 only
  log: run_log.RunLog  # metrics.jsonl and TensorBoard
  prof: profiling.Profiler  # the --profile_steps trace
  saver: checkpoints.Saver  # checkpoint saves, each after the finiteness check
  goodput: Any  # the goodput.Ledger that books where the run's time goes


class Run(NamedTuple):
  """What train_lm's loop and its reports share, built once when the step has compiled."""
  setup: Setup
  t0: float  # when the run started (time.time())
  start: int  # the first step this call trains
  resumed: int | None  # the step it resumed from (None: a fresh run)
  batches: Any  # this process's batch iterator (each checkpoint saves its position)
  should_stop: Callable[[int], bool]  # the preemption guard's check
  compiled: Compiled
  evals: Evals
  rec: Records
  ctrl_c: Callable[[], bool] = lambda: False  # whether a Ctrl-C asked the loop to stop
