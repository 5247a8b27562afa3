"""Train a GPT- or Llama-style language model on every device the machine (or pod) has.

  python recipes/train_lm.py                      # CPU: 8 simulated devices, `tiny_gpt2`
  python recipes/train_lm.py --model_config=small --mesh="data=-1,fsdp=4"    # a TPU/GPU host
  from recipes.train_lm import train_lm           # the same options as keywords, in Python
  train_lm(model_config="tiny_gpt2", dataset="tiny_corpus", epochs=1)

Read top to bottom: options, set-up, run, loop. Models: `gpt.py`, `llama.py`; data: `data.py`;
plumbing: `harness.py`, `run_log.py`; fnscale does the distribution. Only process 0 prints and
writes files. Rerunning the same command resumes from the newest good checkpoint, bitwise.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import numpy as np

if not __package__:  # run as a script: import `recipes` from the repository root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fnscale as fs  # noqa: E402  pylint: disable=wrong-import-position
from fnscale import mesh as fs_mesh, sharding  # noqa: E402
from fnscale.multihost import preemption  # noqa: E402
from recipes.lm import data, gpt, harness as h, hf_maps, llama, run_log as rl  # noqa: E402

# Model name -> its module (one interface: model_config, init_params, RULES, loss_fn, ...).
MODELS = {name: module for module in (gpt, llama) for name in module.SIZES}


@dataclasses.dataclass(frozen=True)
class Options:
  """Every option: a flag `--name` and a keyword of `train_lm`. None: the platform default."""
  model_config: str | None = h.option(None, f"model, one of {list(MODELS)}; default "
                                    "tiny_gpt2 on CPU, small on TPU/GPU")
  dataset: str = h.option("stdlib", f"corpus: {list(data.CORPORA)}, a file, directory or glob")
  tokenizer: str = h.option("", "a Hugging Face tokenizer.json; default: bytes (vocab 256)")
  init_from: str = h.option("", "a Hugging Face model directory (config.json, safetensors, "
                            "tokenizer.json): continue training its model and weights with "
                            "its tokenizer (instead of --model_config, --tokenizer)")
  export_hf: str = h.option("", "at the end, write the params as a Hugging Face checkpoint "
                            "(safetensors, config.json, tokenizer) to this directory")
  seq: int | None = h.option(None, "sequence length in tokens; default 64 on CPU, 1024 TPU/GPU")
  batch_size: int | None = h.option(None, "rows per data-parallel device; default 8 CPU, 16 TPU")
  global_batch: int | None = h.option(None, "global batch in rows (instead of batch_size)")
  epochs: int | None = h.option(None, "passes over the training split (instead of steps)")
  steps: int | None = h.option(None, "train steps; default 200 on CPU, 5000 on TPU/GPU")
  lr: float | None = h.option(None, "peak lr of the warmup + cosine schedule; default by size")
  warmup_steps: int | None = h.option(None, "linear warmup steps; default steps / 20, <= 500")
  min_lr_ratio: float = h.option(0.1, "final learning rate as a fraction of the peak")
  weight_decay: float = h.option(0.1, "AdamW weight decay on weight matrices and embeddings")
  grad_clip: float = h.option(1.0, "clip the global gradient norm to this (0: off)")
  max_stalled_steps: int = h.option(20, "stop with an error after this many consecutive steps "
                                    "that left the params unchanged or non-finite, or were "
                                    "skipped for non-finite gradients (float16's loss "
                                    "scale), although the loss was finite (0: never)")
  accum_steps: int = h.option(1, "gradient accumulation micro-steps per step (splits the batch)")
  accum_gather: str = h.option("per_microbatch", "with accum_steps > 1: 'per_microbatch' "
                               "(params stay sharded) or 'once' (whole params on each device)")
  precision: str = h.option("auto", f"jmp policy, e.g. '{h.MIXED}', 'float32', 'bfloat16'; "
                          "auto: float32 on CPU, bfloat16 compute elsewhere")
  attention: str = h.option("auto", "attention: auto, xla, splash, cudnn, pallas_gpu")
  context: str = h.option("all_gather", "attention over a sequence split by a 'context' mesh "
                          "axis (--mesh=data=2,context=4): all_gather (K/V gathered) or ring")
  context_order: str = h.option("zigzag", "the order the context shards hold the sequence "
                                "in: zigzag (balanced causal work), striped or contiguous")
  remat: bool = h.option(False, "recompute each block's activations in the backward pass")
  tpu: bool | None = h.option(None, "True: require a TPU; default: whatever devices there are")
  mesh: str = h.option("", "mesh axes in a slice, e.g. 'data=-1,fsdp=2,tensor=2' (-1: the "
                       "rest); 'auto': fnscale.analysis.plan's choice of mesh, remat and accumulation "
                       "for this machine; default data=-1 on CPU, fsdp=-1 on TPU/GPU")
  mesh_shape: str = h.option("", "topology override: chip grid '2x4x8', slices first '2x4x4x8'")
  dcn: str = h.option("", "mesh axes across slices (TPU multi-slice), e.g. 'replica=2'; "
                      "default replica=<slices> when the devices span several slices")
  topology: str = h.option("", "hardware override, e.g. 'v5p:2x2x2' or 'v5p-16'")
  devices: int | None = h.option(None, "simulated CPU devices (CPU-only machines); default 8")
  seed: int = h.option(0, "seed of the params init, the data order and sampling")
  run_dir: str = h.option("", "directory of metrics.jsonl, TensorBoard events, run.json, "
                          "log.txt and checkpoints; default runs/<model>-<dataset> (plus "
                          "-vocab<V> with a tokenizer)")
  profile_steps: str = h.option("", "START:STOP: JAX profiler trace of these steps into run_dir")
  checkpoint: bool = h.option(True, "save checkpoints and resume from the newest good one")
  checkpoint_dir: str = h.option("", "checkpoints (path or gs://...); default RUN_DIR/checkpoints")
  checkpoint_every: int = h.option(200, "save every this many steps (0: at the end and SIGTERM)")
  checkpoint_keep: int = h.option(3, "how many checkpoints to keep")
  stop_after: int = h.option(0, "stop after this step as if preempted (checkpoint saved); 0: off")
  grace_s: float = h.option(preemption.DEFAULT_GRACE_S, "seconds from a preemption notice "
                            "(SIGTERM) to the end of the process, the final save included; "
                            "keep below the platform's notice (about 30 s on Cloud TPU, GKE)")
  log_every: int | None = h.option(None, "steps between progress lines; default 25 lines a run")
  eval_every: int | None = h.option(None, "steps between evals; default 5 evals a run")
  eval_batches: int = h.option(4, "global batches of held-out text per eval")
  sample_len: int = h.option(200, "tokens to generate at the end (0: none)")
  prompt: str = h.option("def ", "prompt of the generated sample")
  temperature: float = h.option(0.8, "sampling temperature of the sample (0: greedy)")
  compile_cache_dir: str = h.option("", "persistent XLA compilation cache directory")
  shutdown_at_exit: bool = h.option(False, "delete this Cloud TPU VM when the job ends")
  shutdown_delay_s: float = h.option(60.0, "seconds before that shutdown (a sentinel cancels it)")
  shutdown_dry_run: bool = h.option(False, "print the shutdown request instead of sending it")
  coordinator_address: str = h.option("", "multi-process: host:port of process 0; default: env "
                                    "JAX_COORDINATOR_ADDRESS or auto-detected (pods, SLURM)")
  num_processes: int = h.option(0, "multi-process: process count (env JAX_NUM_PROCESSES)")
  process_id: int = h.option(-1, "multi-process: this process's id (env JAX_PROCESS_ID)")


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
       "medium": 3e-4}


class Setup(NamedTuple):
  """A run: its options with every default filled in (checked), the hardware, mesh, model."""
  o: Options
  topo: Any
  mesh: Any
  model: Any  # the module of the model: gpt or llama
  cfg: Any  # its ModelConfig
  profile: rl.ProfileWindow | None


def _setup(o: Options, corpus: data.Corpus, say) -> Setup:
  """Defaults, mesh, batch and schedule. Raises FnscaleError on any bad value."""
  topo = h.topology(o.mesh_shape, o.topology, o.tpu)
  d = _CPU if topo.platform == "cpu" else _ACCEL
  size, seq = o.model_config or d["model"], d["seq"] if o.seq is None else o.seq
  model, cfg = _model(o, size, seq, corpus)
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
  data.check_fits(corpus, seq)
  steps = data.steps_for(corpus, seq, batch, o.epochs, o.steps)
  steps = d["steps"] if steps is None else steps
  lr = _LR.get(size, 3e-4) if o.lr is None else o.lr
  warmup = min(500, max(1, steps // 20)) if o.warmup_steps is None else o.warmup_steps
  log_every = max(1, steps // 25) if o.log_every is None else o.log_every
  eval_every = max(1, steps // 5) if o.eval_every is None else o.eval_every
  if lr <= 0 or log_every < 1 or eval_every < 1 or o.max_stalled_steps < 0:
    raise fs.InputError(f"lr={lr}, log_every={log_every}, eval_every={eval_every}, "
                        f"max_stalled_steps={o.max_stalled_steps}: expected lr > 0, "
                        "intervals >= 1 and max_stalled_steps >= 0")
  profile = rl.parse_profile_steps(o.profile_steps, steps)
  size = _hf_name(o.init_from) if o.init_from else size
  run_dir = o.run_dir or h.default_run_dir(size, o.dataset, _tokenizer(o), corpus.vocab)
  ckpt = checkpoint_directory(dataclasses.replace(o, run_dir=run_dir))
  return Setup(dataclasses.replace(
      o, model_config=size, seq=seq, batch_size=per_device, global_batch=batch, steps=steps,
      lr=lr, warmup_steps=warmup, log_every=log_every, eval_every=eval_every, run_dir=run_dir,
      checkpoint_dir=ckpt), topo, mesh, model, cfg, profile)


def _model(o: Options, size: str, seq: int, corpus: data.Corpus):
  """(model module, its config): --init_from's config.json, else the named size with the
  corpus's vocabulary."""
  if not o.init_from:
    if size not in MODELS:
      raise fs.InputError(f"model_config={size!r} is not a known model; expected one of "
                          f"{list(MODELS)}")
    return MODELS[size], MODELS[size].model_config(size, seq)._replace(vocab=corpus.vocab)
  if o.model_config:
    raise fs.InputError(f"--model_config={o.model_config} with --init_from={o.init_from}: "
                        "the checkpoint's config.json chooses the model; leave one out")
  m = hf_maps.read(o.init_from, seq)
  if corpus.vocab > m.cfg.vocab:
    raise fs.InputError(f"the tokenizer has {corpus.vocab} ids and {o.init_from}'s model "
                        f"{m.cfg.vocab}; fix: use the checkpoint's own tokenizer.json")
  return m.model, m.cfg


def _hf_name(path: str) -> str:
  """A run name for a Hugging Face directory: its last path component."""
  return os.path.basename(os.path.normpath(path.split("://")[-1])) or "hf"


def _tokenizer(o: Options) -> str:
  """--tokenizer, else --init_from's tokenizer.json (its model's ids)."""
  if o.tokenizer or not o.init_from:
    return o.tokenizer
  path = os.path.join(o.init_from, "tokenizer.json")
  if not os.path.isfile(path):
    raise fs.InputError(f"--init_from={o.init_from} has no tokenizer.json; fix: pass the "
                        "model's tokenizer with --tokenizer=PATH/tokenizer.json")
  return path


def checkpoint_directory(o: Options) -> str:
  """Where a run with options `o` (its `run_dir` filled in: `harness.default_run_dir`) keeps
  its checkpoints ("" with --nocheckpoint)."""
  return (o.checkpoint_dir or os.path.join(o.run_dir, "checkpoints")) if o.checkpoint else ""


def run(o: Options) -> h.Summary:
  """Trains per `o` (see `train_lm`); returns the summary with the final state."""
  # --compile_cache_dir is this run's: the caller's later compiles don't use it.
  with fs.report.compilation_cache_restored():
    # Devices, processes, compile cache, shutdown; `say` prints on process 0 only.
    t0, say = time.time(), h.start(o)
    # From here to the end (data, compile, start-up eval, loop, evals, final save), a notice
    # (SIGTERM to any process) stops every process after one step, or within grace_s
    # wherever it is, and a process lost in a collective is named, not left to a runtime
    # error.
    preemption.check_service()  # the guard needs it: say so now, not after the compile
    with preemption.preemption_guard(grace_s=o.grace_s) as should_stop, \
        fs.multihost.peer_guard():
      return _start(o, t0, say, should_stop)


def _start(o: Options, t0: float, say, should_stop) -> h.Summary:
  """`run` after start-up: data, setup, the run's checkpoint manager."""
  corpus = data.load(o.dataset, _tokenizer(o))
  s = _setup(o, corpus, say)
  if s.o.checkpoint_dir:  # one directory every process sees, checked before anything opens it
    fs.checkpoint.check_shared_directory(s.o.checkpoint_dir)
  # One checkpoint manager for the whole run; leaving the block waits for the last save.
  # orbax's warnings go to RUN_DIR/log.txt, not the console.
  with h.library_log(s.o.run_dir), (
      fs.checkpoint.manager(s.o.checkpoint_dir, keep=s.o.checkpoint_keep)
      if s.o.checkpoint_dir else contextlib.nullcontext()) as ckpt:
    return _run(s, corpus, ckpt, t0, say, should_stop)


def _with_finite_flag(step):
  """The step, plus one metric: whether its loss and new state are all finite (XLA fuses the
  check into the step; the loop reads it before any save)."""
  def step_with_flag(state, batch):
    state, metrics = step(state, batch)
    return state, {**metrics, "finite": fs.checkpoint.all_finite((state, metrics["loss"]))}
  return step_with_flag


def _run(s: Setup, corpus, ckpt, t0: float, say, should_stop) -> h.Summary:
  """The run of `run`, with `ckpt` (a fnscale.checkpoint.Manager, or None: no checkpoints);
  `should_stop(step)`: the preemption guard's check."""
  o, base = s.o, data.baseline(corpus)
  policy, (optimizer, schedule) = h.policy(o.precision, s.topo.platform), h.optimizer(s.o)
  model, axes = s.model, s.model.logical_axes(s.cfg)
  step_fn = fs.train_step(functools.partial(model.loss_fn, remat=o.remat, cfg=s.cfg), optimizer,
                          policy=policy, accum_steps=o.accum_steps,
                          accum_gather=o.accum_gather)
  kernels = dict(attention=o.attention, context=o.context, context_order=o.context_order)
  step_fn = fs.shard_step(fs.with_kernel(_with_finite_flag(step_fn), **kernels),
                          s.mesh, rules=model.RULES, logical_axes=axes)
  cast = policy.cast_to_compute if policy is not None else (lambda p: p)
  eval_loss = jax.jit(fs.with_kernel(lambda p, b: model.loss_fn(cast(p), b, cfg=s.cfg),
                                     **kernels))
  peak, peak_note = h.peak_flops(s.topo)  # before the mesh context: one device's matmul
  with fs.with_mesh(s.mesh):
    kw = dict(mesh=s.mesh, rules=model.RULES, logical_axes=axes, policy=policy)
    init = functools.partial(fs.init_state, functools.partial(model.init_params, s.cfg),
                             optimizer, key=jax.random.key(o.seed), **kw)
    if o.init_from:
      init = _from_hf(s, init, functools.partial(fs.init_state, optimizer=optimizer, **kw))
    # grain reads this process's rows; fs.global_batch makes one array over every process.
    batches, evals = data.batches(corpus, fs.batch_sharding(s.mesh, context_axes=()),
                                  s.cfg.seq, o.global_batch, o.seed, o.eval_batches)
    state, start, extra = _resume(s, ckpt, init, batches, corpus, say)
    resumed = None if extra is None else start
    h.say_save_window(ckpt, o.grace_s, say)
    if ckpt is not None:  # compiles save's finiteness check now, not in a preemption window
      fs.checkpoint.nonfinite_leaves(state)
    eval_batches = [_put(s, b) for b in evals]
    first = _put(s, next(batches))
    step_fn = step_fn.compile(state, first)  # ahead of time: step 0 doesn't compile again
    fs.multihost.agree_on_step(step_fn)  # every process compiled the same step (a barrier)
    report = fs.compile_report(step_fn, state, first)
    log = rl.run_log(o.run_dir, active=jax.process_index() == 0, say=say)
    n_params = h.describe(s, state, (corpus.describe, base), report, policy, (peak, peak_note),
                          _flops_step(s), resumed, say)

    def evaluate(state, step):
      # All devices finish each eval program (not just the one a scalar is read from).
      value = float(np.mean([float(jax.block_until_ready(eval_loss(state.params, b)))
                             for b in eval_batches]))
      bpb = value * corpus.tokens_per_byte / math.log(2)
      say(f"eval  step {step:>6}: loss {value:.4f} nats/token, {bpb:.4f} bits/byte")
      log.write(step, {"eval/loss": value, "eval/bits_per_byte": bpb})
      return value

    guard = _checkpointing(s, ckpt, corpus, batches, resumed, say)
    ev = evaluate(state, 0) if start == 0 else None
    prof = rl.profiler(s.profile, o.run_dir, say=say)
    state, last, stopped = _train(s, state, step_fn, batches, first, start, schedule, peak,
                                  say, (log, prof), evaluate, guard, should_stop)
    out = _finish(s, state, corpus, last, ev, stopped, resumed, start, evaluate, guard, say)
    if o.export_hf and not stopped:
      _export_hf(s, state, say)
    log.close()
  return h.summarize(dict(out, bigram_loss=base.bigram), s, state, report, n_params, t0, say)


def _from_hf(s: Setup, init, init_with):
  """`init` whose fresh state holds --init_from's weights, read into their shardings
  (`fnscale.checkpoint.hf.load`; `init_with(params)` builds the state around them); its
  abstract state is `init`'s."""
  def make(abstract: bool = False):
    shapes = init(abstract=True)
    if abstract:
      return shapes
    m = hf_maps.HFModel(s.model, s.cfg, {})
    params = fs.checkpoint.hf.load(s.o.init_from, shapes.params,
                                   hf_maps.checkpoint_map(m, s.o.init_from))
    return init_with(params)
  return make


def _export_hf(s: Setup, state, say) -> None:
  """Writes the params as a Hugging Face checkpoint to --export_hf (every process calls it;
  process 0 writes), with --init_from's config.json and tokenizer files when it has them."""
  t, o = time.time(), s.o
  m = (hf_maps.read(o.init_from, s.cfg.seq) if o.init_from else
       hf_maps.of_model(s.model, s.cfg))
  tok = _tokenizer(o)
  fs.checkpoint.hf.export(o.export_hf, state.params,
                          hf_maps.checkpoint_map(m, o.init_from or None),
                          config=hf_maps.to_config(m),
                          tokenizer_from=os.path.dirname(os.path.abspath(tok)) if tok else None)
  say(f"exported a Hugging Face checkpoint to {o.export_hf} ({time.time() - t:.1f} s)")


def _put(s: Setup, batch: dict):
  """This process's rows as global arrays; under a context axis first put in the order its
  shards hold the sequence (with the positions the model then needs)."""
  if fs.parallel.context.shards(s.mesh) > 1:
    batch = fs.parallel.context.reorder_batch(batch, s.mesh, s.o.context_order)
  return fs.global_batch(batch, fs.batch_sharding(s.mesh))


def _resume(s: Setup, ckpt, init, batches, corpus: data.Corpus, say):
  """(state, start step, checkpoint extra or None): the newest good checkpoint of `ckpt`
  (the run's manager, or None), with `batches` at each process's saved position, else a
  fresh init."""
  o = s.o
  state, start, extra = h.restore_or_init(ckpt, init, batches, dict(
      seed=o.seed, corpus_tokens=len(corpus.train), global_batch=o.global_batch), say,
      data.resharded_position, f"--run_dir={o.run_dir} (this run: model {o.model_config}, "
      f"seq {s.cfg.seq}, vocab {s.cfg.vocab})")
  if start >= o.steps:
    say(f"{o.run_dir} already holds step {start} of {o.steps}: nothing left to train (pass "
        "--run_dir=NEW_DIR or more --steps for another run)")
  return state, start, extra


class Guard(NamedTuple):
  """What stands between a step and its checkpoint (`_checkpointing`)."""
  note: Any  # note(step, metrics): keep the step's on-device finiteness flag
  check: Any  # check(): StepError naming the first non-finite step and the last good save
  save: Any  # save(state, step): check(), then save step (once) with the data position
  commit: Any  # commit(): wait until the last save is committed


def _checkpointing(s: Setup, ckpt, corpus, batches, resumed: int | None, say) -> Guard:
  """The loop's checkpoint side: a non-finite loss or state is never saved (the flags of the
  steps since the last check are read before every save and progress line), saves go through
  `ckpt` asynchronously with the data iterator's position, and a save that can't fit the
  preemption window is said as soon as its time is known (at start-up from the last run's
  save; in the run from its second save: the first one's time includes one-off compiles)."""
  flags, last_saved, warned, saves = [], resumed, False, 0

  def check():
    bad = h.first_nonfinite(flags)
    if bad is not None:
      commit()  # the last good save is on disk before the run stops
      raise h.nonfinite_error(bad, last_saved, s.o.checkpoint_dir, s.o.lr)

  def save(state, step: int):
    nonlocal last_saved, warned, saves
    check()
    if ckpt is None or step == last_saved:
      return
    if saves >= 2 and not warned:  # the first save's time includes one-off compiles
      warned = h.say_save_window(ckpt, s.o.grace_s, say)
    t = time.time()
    # Before the next batch is read: the iterator's position is this step's.
    fs.checkpoint.save(ckpt, step, state, data=batches, extra=dict(
        step=step, seed=s.o.seed, model=s.o.model_config, seq=s.cfg.seq, vocab=s.cfg.vocab,
        global_batch=s.o.global_batch, corpus_tokens=len(corpus.train)))
    last_saved, saves = step, saves + 1
    say(f"checkpoint: step {step} saving in the background (the loop waited "
        f"{time.time() - t:.2f} s; {s.o.checkpoint_dir})")

  def commit():
    if ckpt is not None:
      fs.checkpoint.wait(ckpt)

  return Guard(lambda step, m: flags.append((step, m["finite"])), check, save, commit)


def _flops_step(s: Setup) -> float:
  return s.model.flops_per_token(s.cfg) * s.o.global_batch * s.cfg.seq


class _Timing(NamedTuple):
  """The timed steps so far (`seconds`, `steps`) and where the open window began."""
  mark_s: float
  mark_step: int
  seconds: float = 0.0
  steps: int = 0


def _lap(t: _Timing, done: int) -> tuple[_Timing, float | None]:
  """Closes the window at step `done` (counted in the totals unless it holds no step: then
  it only timed a progress line), opens the next one now. Returns the new timing and the
  window's seconds per step (None for an empty window)."""
  now, n = time.time(), done - t.mark_step
  if n <= 0:
    return t._replace(mark_s=now), None
  return _Timing(now, done, t.seconds + now - t.mark_s, t.steps + n), (now - t.mark_s) / n


EARLY_ETA_STEPS = 3  # a first progress line (with its ETA) this many timed steps in


def _train(s: Setup, state, step_fn, batches, batch, start, schedule, peak, say, log_prof,
           evaluate, guard: Guard, should_stop):
  """The loop from `start` to `s.o.steps`: progress lines, evals, checkpoints, profile, stops.
  `log_prof`: (run_log.RunLog, run_log.Profiler); `should_stop`: the preemption guard's.
  Evals and checkpoints are left out of the timing (tokens/s, MFU, ETA); so is the first
  step, which includes dispatch warm-up."""
  (log, prof), m, o = log_prof, None, s.o
  last, timing, stopped, t_train, stall = {}, None, None, time.time(), h.Stall()
  every = o.checkpoint_every
  # A notice (SIGTERM) to any process: every process stops after the same step and saves it.
  for step in range(start, o.steps):
    prof.at_step(step, pending=m)
    prev, (state, m) = m, step_fn(state, batch)
    # The previous step's update, read while this one runs (one step stays in flight).
    stall = h.check_update(stall, step, prev, o.max_stalled_steps)
    done = step + 1
    guard.note(done, m)
    # One step in flight on CPU: simulated devices share one pool of host threads, and with
    # several steps queued XLA's CPU collectives can deadlock (no overlap to lose there).
    if s.topo.platform == "cpu":
      jax.block_until_ready((state, m))
    sigterm = should_stop(step)  # every step, on every process (JAX's sync point)
    if done < o.steps and (sigterm or done == o.stop_after):
      stopped = "SIGTERM" if sigterm else f"--stop_after={o.stop_after}"
    if stopped or (every and done % every == 0 and done < o.steps):
      t_save = time.time()
      guard.save(state, done)  # before the next batch is read: the position is this step's
      if timing is not None:  # the save's time stays out of the timing
        timing = timing._replace(mark_s=timing.mark_s + time.time() - t_save)
    if done < o.steps and not stopped:
      batch = _put(s, next(batches))  # while it runs
    if timing is None:
      jax.block_until_ready(m["loss"])
      timing, early = _Timing(time.time(), done), done + EARLY_ETA_STEPS
    if done % o.log_every == 0 or done == o.steps or done == early:
      guard.check()
      timing, dt = _lap(timing, done)
      last = h.progress(s, done, m, dt, float(schedule(done)), _flops_step(s), peak, say, log)
    if done % o.eval_every == 0 and done < o.steps:  # its time stays out of the timing
      timing = _lap(timing, done)[0]
      evaluate(state, done)
      timing = timing._replace(mark_s=time.time())
    if stopped:
      guard.commit()  # the agreed step is on disk before the process exits
      say(f"stopped at step {done} ({stopped}); rerun the same command to resume")
      break
  prof.close(pending=state)
  h.check_update(stall, o.steps if not stopped else done, m, o.max_stalled_steps)
  return state, dict(last, train_s=time.time() - t_train, **_whole_run(s, timing, peak)), stopped


def _whole_run(s: Setup, timing: _Timing | None, peak) -> dict:
  """tokens/s and MFU over every timed step (None when fewer than two steps ran)."""
  if timing is None or timing.steps == 0 or timing.seconds <= 0:
    return dict(tokens_per_s=None, mfu=None)
  per_s = timing.steps / timing.seconds
  return dict(tokens_per_s=s.o.global_batch * s.cfg.seq * per_s,
              mfu=_flops_step(s) * per_s / peak if peak else None)


def _finish(s: Setup, state, corpus, last, ev, stopped, resumed, start, evaluate,
            guard: Guard, say) -> dict:
  """Final checkpoint, eval and sample (unless stopped); the summary's run fields."""
  final_step, sample = int(state.step), None
  if not stopped:
    guard.save(state, final_step)  # written while the eval and the sample run
    ev = evaluate(state, final_step)
    if s.o.sample_len > 0:
      t = time.time()
      sample = corpus.decode(gpt.generate(
          functools.partial(s.model.apply, cfg=s.cfg), state.params, corpus.encode(s.o.prompt or "\n"), s.o.sample_len,
          seq=s.cfg.seq, temperature=s.o.temperature, seed=s.o.seed, attention=s.o.attention))
      say(f"sample ({s.o.sample_len} tokens, temperature {s.o.temperature}, "
          f"{time.time() - t:.1f} s):\n{'-' * 60}\n{s.o.prompt}{sample}\n{'-' * 60}")
    guard.commit()
  return dict(final_step=final_step, start_step=start, resumed_from=resumed, stopped=stopped,
              loss=last.get("loss"), eval_loss=ev, tokens_per_s=last["tokens_per_s"],
              mfu=last["mfu"], train_s=last["train_s"], global_batch=s.o.global_batch,
              seq=s.cfg.seq, mesh=dict(s.mesh.shape), devices=jax.device_count(),
              bits_per_byte=None if ev is None else ev * corpus.tokens_per_byte / math.log(2),
              processes=jax.process_count(), sample=sample)


def main(argv: list[str]) -> int:
  """The command line (exit status 0 done, 2 bad input, 143 stopped by SIGTERM)."""
  return h.main(argv, Options, run, __doc__)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
