"""The plumbing of `train_lm.py` that a user rarely edits: options as flags and keywords,
device start-up, topology checks, precision, the MFU denominator, resume, the start-up
report, progress and summary (recorded through run_log.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
import time
from typing import Any, NamedTuple

from absl import flags
import jax
import numpy as np
import optax

import fnscale as fs
from fnscale.analysis import flops
from fnscale import mesh as fs_mesh
from fnscale import sharding
from fnscale.analysis import report as fs_report
from recipes.lm import run_log as rl


def option(default, help_: str):
  """A field of an options dataclass: its default and its `--help` line."""
  return dataclasses.field(default=default, metadata={"help": help_})


def check_options(cls, options: dict):
  """`cls(**options)` after checking each name and type (an int is a float; a bool is no int).

  Raises:
    FnscaleError: an unknown name (the message lists the known ones) or a wrong type.
  """
  known = {f.name: f for f in dataclasses.fields(cls)}
  for name, value in options.items():
    if name not in known:
      raise fs.InputError(f"unknown option {name}={value!r}; known options: {sorted(known)}")
    kind = known[name].type.split(" | ")
    types = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}[kind[0]]
    if not ((value is None and "None" in kind) or (
        isinstance(value, types) and (kind[0] == "bool" or not isinstance(value, bool)))):
      raise fs.InputError(f"option {name}={value!r}: expected {' or '.join(kind)}, got "
                            f"{type(value).__name__}")
  return cls(**options)


def _flag_values(cls) -> flags.FlagValues:
  fv = flags.FlagValues()
  define = {"bool": flags.DEFINE_boolean, "int": flags.DEFINE_integer,
            "float": flags.DEFINE_float, "str": flags.DEFINE_string}
  for f in dataclasses.fields(cls):
    define[f.type.split(" | ")[0]](f.name, f.default, f.metadata["help"], flag_values=fv)
  return fv


def parse_flags(cls, argv: list[str]):
  """absl flags (argv[0] is the program name) -> `cls`. Raises FnscaleError on a bad flag."""
  fv = _flag_values(cls)
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    raise fs.InputError(f"{e}; see --help") from None
  if len(rest) > 1:
    raise fs.InputError(f"unexpected arguments {rest[1:]}; flags are written --name=value")
  return cls(**{f.name: fv[f.name].value for f in dataclasses.fields(cls)})


# Options that may differ between the processes of one job.
PER_PROCESS = ("coordinator_address", "num_processes", "process_id")


def start(o):
  """Simulated CPU devices, compile cache, multi-process start-up and the shutdown at exit of
  a run with options `o`, before anything touches a device. Returns `say`, a print on process 0.
  """
  count = o.devices
  if count is None:  # keep a device count the environment already asks for
    flag = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_force_host_platform_device_count=")]
    count = flag[-1].split("=", 1)[1] if flag else os.environ.get("JAX_NUM_CPU_DEVICES", "8")
    if not str(count).isdigit():
      raise fs.InputError(f"simulated device count {count!r} (XLA_FLAGS / "
                            "JAX_NUM_CPU_DEVICES) is not an int")
  fs.topology.quiet_libtpu()  # libtpu's host-lookup warnings on a machine without a TPU
  fs.simulate_cpu_devices(int(count))
  if o.compile_cache_dir:
    fs_report.compilation_cache(o.compile_cache_dir)
  # Values not given come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
  # (launch_local.py) or the pod/SLURM environment; one process is a no-op.
  # Every process checks the others ran with the same options (fields that differ per
  # process left out), so a mismatch is named at start-up, not found as a hang later.
  fs.initialize(o.coordinator_address or None, o.num_processes or None,
                o.process_id if o.process_id >= 0 else None, config={
                    k: v for k, v in dataclasses.asdict(o).items() if k not in PER_PROCESS})
  say = (lambda *a: print(*a, flush=True)) if jax.process_index() == 0 else (lambda *a: None)
  if o.shutdown_at_exit:
    plan = fs.cloud.shutdown_at_exit(o.shutdown_delay_s, o.shutdown_dry_run)
    say(f"shutdown at exit ({o.shutdown_delay_s:g} s after the end"
        + (", dry run" if o.shutdown_dry_run else "") + f"): {fs.cloud.describe(plan)}")
  return say


LOG_FILE = "log.txt"
_ORBAX = os.sep + "orbax" + os.sep


@contextlib.contextmanager
def library_log(run_dir: str):
  """While open, orbax's absl log records ("Given directory is read only=...", "`read` option
  is deprecated" on every resume) go to `run_dir/log.txt` (`log.<i>.txt` on process i > 0),
  made on the first record, instead of the console; other libraries' records pass as before.
  """
  i = jax.process_index()
  handler = logging.FileHandler(os.path.join(run_dir, LOG_FILE if i == 0 else f"log.{i}.txt"),
                                encoding="utf-8", delay=True)
  handler.setFormatter(logging.Formatter(
      "%(asctime)s %(levelname)s %(name)s %(pathname)s:%(lineno)d] %(message)s"))

  def to_file(record: logging.LogRecord) -> bool:
    if _ORBAX not in record.pathname:
      return True
    os.makedirs(run_dir, exist_ok=True)
    handler.handle(record)
    return False  # not passed on to the console's handlers

  logger = logging.getLogger("absl")  # absl.logging's records, orbax's among them
  logger.addFilter(to_file)
  try:
    yield
  finally:
    logger.removeFilter(to_file)
    handler.close()


def main(argv: list[str], cls, run, doc: str) -> int:
  """Command-line entry: `--help`, flags -> `cls`, `run`, bad input as one `error:` line.
  Exit status 0 done, 2 bad input or a refused checkpoint, 75 a lost process, 143 stopped
  by SIGTERM."""
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(doc + "\nflags:\n" + _flag_values(cls).get_help())
    return 0
  try:
    summary = run(parse_flags(cls, argv))
  except fs.FnscaleError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    if isinstance(e, fs.DistributedError) and str(e).startswith("lost "):
      # Python's own exit would wait for the lost process at JAX's shutdown barrier.
      sys.stdout.flush()
      os._exit(fs.multihost.EXIT_JOB_FAILED)  # pylint: disable=protected-access
    return 2
  return 143 if summary.stopped == "SIGTERM" else 0


def topology(mesh_shape: str, override: str, tpu: bool | None):
  """`fs.detect_topology` with the seed-style `mesh_shape` ("2x4x8") or a hardware override.

  Raises:
    TopologyError: both overrides given, one that doesn't match the devices, or tpu=True
      where no TPU was found (the message says what was).
  """
  if mesh_shape and override:
    raise fs.TopologyError(f"mesh_shape={mesh_shape!r} and topology={override!r} both "
                           "override the detected hardware; give one of them")
  try:
    topo = fs.detect_topology(override=(mesh_shape or override) or None)
  except fs.TopologyError as e:
    raise fs.TopologyError(f"mesh_shape={mesh_shape!r}: {e}" if mesh_shape else str(e)) from None
  if tpu and topo.platform != "tpu":
    raise fs.TopologyError(f"tpu=True but no TPU was found: {topo}. Run on a TPU VM with "
                           "jax[tpu] installed, or leave tpu unset to use these devices")
  return topo


def make_mesh(axes, dcn: str, topo, say, devices=None):
  """`fs.make_mesh(axes, dcn=dcn)` over `devices` (default `jax.devices()`); over several TPU
  slices without `dcn` (and without a `MeshAxes` of its own), data parallel across the
  slices: `replica` = the slice count, the `axes` within each slice, said by `say`; unless
  `axes` has a "stage" axis of the slice count: make_mesh lays the pipeline stages across
  the slices."""
  devices = jax.devices() if devices is None else devices
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
  stages = not isinstance(axes, fs.MeshAxes) and fs_mesh.parse_axes(axes).get("stage") == slices
  if not dcn and slices > 1 and not isinstance(axes, fs.MeshAxes) and not stages:
    dcn = f"replica={slices}"
    say(f"mesh: the devices span {slices} TPU slices and --dcn is not set: data parallel "
        f"across the slices (--dcn={dcn}), the --mesh axes within each slice")
  return fs.make_mesh(axes, dcn=dcn or None, topology=topo, devices=devices)


MIXED = "params=float32,compute=bfloat16,output=float32"


def policy(precision: str, platform: str):
  """A jmp policy (None: float32). auto: float32 on CPU, bfloat16 compute elsewhere."""
  import jmp  # pylint: disable=import-outside-toplevel
  precision = {"auto": "float32" if platform == "cpu" else MIXED, "bfloat16": MIXED,
               "bf16": MIXED, "f32": "float32"}.get(precision, precision)
  if precision == "float32":
    return None
  try:
    return jmp.get_policy(precision)
  except ValueError as e:
    raise fs.InputError(f"precision={precision!r} is not a jmp policy ({e}); write e.g. "
                          f"'{MIXED}', 'float32' or 'bfloat16'") from None


@functools.cache
def _host_matmul_peak() -> float:
  # Measured once per process, in CPU seconds: other jobs on the machine take wall time from
  # the measurement, not CPU time, so they can't lower the peak (and so inflate the MFU).
  return flops.measure_matmul_peak(clock="cpu")


def peak_flops(topo) -> tuple[float | None, str]:
  """The MFU denominator (FLOP/s of all devices together) and a line saying what it is."""
  if topo.platform == "cpu":
    peak = _host_matmul_peak() * jax.process_count()
    return peak, (f"measured CPU matmul peak {peak / 1e9:.0f} GFLOP/s (the fastest of 10 "
                  f"runs, per CPU-second x {flops.usable_cores()} cores: other jobs on the "
                  f"machine lower the MFU, not the peak{_load_average()}), shared by all "
                  f"{jax.device_count()} simulated devices (one host's cores)")
  if topo.peak_flops_per_device:
    return topo.peak_flops_per_device * jax.device_count(), (
        f"{topo.peak_flops_per_device / 1e12:.0f} TFLOP/s bf16 peak x {jax.device_count()} "
        "devices")
  return None, "unknown peak FLOP/s for this device kind; MFU not reported"


def _load_average() -> str:
  return f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""


def peak_name(topo, peak: float) -> str:
  """The MFU denominator in a few words, e.g. 'measured CPU peak 281 GFLOP/s'."""
  what = "measured CPU peak" if topo.platform == "cpu" else "bf16 peak"
  if peak < 1e13:
    return f"{what} {peak / 1e9:,.0f} GFLOP/s"
  return f"{what} {peak / 1e12:,.0f} TFLOP/s"


def optimizer(o):
  """(optax transformation, lr schedule) for train_lm options `o`: AdamW with global-norm
  clipping; linear warmup then cosine decay (GPT-3's recipe)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, o.lr, warmup_steps=o.warmup_steps, decay_steps=max(o.steps, o.warmup_steps + 1),
      end_value=o.lr * o.min_lr_ratio)
  # Decay weight matrices and embeddings ("w*" leaves), not biases or LayerNorm params.
  decay = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: str(getattr(path[-1], "key", "")).startswith("w"), params)
  chain = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  chain.append(optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=o.weight_decay,
                           mask=decay))
  return optax.chain(*chain), schedule


def check_batch(seq: int, per_device: int, batch: int, accum_steps: int, mesh) -> None:
  """Raises FnscaleError for sizes < 1, ShardingError for a global `batch` that doesn't split
  over `mesh`'s data axes in each of `accum_steps` steps (the message gives a multiple)."""
  if seq < 1 or per_device < 1 or batch < 1 or accum_steps < 1:
    raise fs.InputError(f"seq={seq}, batch_size={per_device}, global_batch={batch}, "
                          f"accum_steps={accum_steps}: each must be >= 1")
  dp = int(np.prod([mesh.shape[a] for a in sharding.data_axes(mesh)]))
  if batch % (dp * accum_steps):
    raise fs.ShardingError(
        f"global batch {batch} does not divide over the data axes: the mesh {dict(mesh.shape)}"
        f" splits the batch {dp} ways over {sharding.data_axes(mesh)}"
        + (f" in each of {accum_steps} accumulation steps" if accum_steps > 1 else "")
        + f"; use a global_batch that is a multiple of {dp * accum_steps} (or batch_size)")


def check_microbatches(microbatches: int, model, mesh) -> None:
  """Raises FnscaleError for --microbatches without a pipeline to cut: below 0, a model whose
  loss takes none, or a mesh without a "stage" axis."""
  if microbatches < 0 or microbatches and (
      "microbatches" not in inspect.signature(model.loss_fn).parameters
      or mesh.shape.get("stage", 1) == 1):
    raise fs.InputError(
        f"--microbatches={microbatches}: pipeline microbatches need a model whose layers run as "
        "pipeline stages (--model_config=llama-*) and a mesh with a 'stage' axis, e.g. "
        f"--mesh=data=2,stage=4 (mesh here: {dict(mesh.shape)}); fix: add the stage axis, "
        "or leave --microbatches out.")


def plan_mesh(model, cfg, topo, global_batch: int, precision: str, say):
  """`--mesh=auto`: fnscale.analysis.plan's choice for this machine (`topo`), this model's abstract
  params and the global batch; prints the top of the table and why the winner won.

  Returns:
    (MeshAxes, remat: bool, accum_steps: int, accum_gather: str) of the chosen row.

  Raises:
    PlanError (an FnscaleError): the model fits no mesh of these devices.
  """
  from fnscale.analysis import plan  # pylint: disable=import-outside-toplevel
  rows = jax.ShapeDtypeStruct((global_batch, cfg.seq), np.int32)
  p = plan.plan(functools.partial(model.init_params, cfg), model.loss_fn,
                optax.adamw(1e-3), {"inputs": rows, "targets": rows}, topo,
                policy=policy(precision, topo.platform), rules=model.RULES,
                logical_axes=model.logical_axes(cfg), key=jax.random.key(0))
  say("mesh=auto: " + plan.format_plan(p, top=6).replace("\n", "\n  "))
  return p.axes, p.remat, p.accum, p.accum_gather


# ------------------------------------------------------------------------------------------------
# Resume, start-up report, progress, summary.
# ------------------------------------------------------------------------------------------------


def default_run_dir(model: str, dataset: str, tokenizer: str, vocab: int) -> str:
  """`runs/<model>-<dataset>`, plus `-vocab<V>` with a tokenizer: runs of another model,
  corpus or vocabulary get their own directories instead of resuming each other's
  checkpoints. A dataset path or glob counts by its last plain name ("~/src/**/*.py": src)."""
  plain = re.split(r"[*?\[]", dataset or "stdlib", maxsplit=1)[0]
  name = os.path.splitext(os.path.basename(os.path.normpath(os.path.expanduser(plain))))[0]
  name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data"
  return os.path.join("runs", f"{model}-{name}" + (f"-vocab{vocab}" if tokenizer else ""))


def restore_or_init(ckpt, init, batches, expect: dict, say, reshard=None, run: str = ""):
  """`(state, start_step, extra)`: the newest good checkpoint of `ckpt` (a
  `fnscale.checkpoint.Manager`; a damaged or non-finite newer step is refused and left as it
  is), with the data iterator `batches` put at the position each process saved (`reshard`
  maps positions saved by another process count); or `(init(), 0, None)` when there is none
  (or `ckpt` is None). Warns when `extra` differs from `expect` (seed, corpus, batch: the data
  order would differ).

  Raises:
    CheckpointError: no checkpoint there can be resumed (another model's, or all damaged);
      the message names `run` (this run's directory and model) and how to start afresh.
  """
  listed = fs.checkpoint.steps(ckpt, complete=False) if ckpt is not None else ()
  if not listed:
    return init(), 0, None
  try:
    state, extra = fs.checkpoint.restore(ckpt, init(abstract=True), data=batches,
                                         reshard_data=reshard)
  except fs.CheckpointError as e:
    raise fs.CheckpointError(
        f"{run or ckpt.directory} can't resume from the checkpoints already in "
        f"{ckpt.directory} (steps {list(listed)}): {e} To keep them and start this run "
        "afresh, give it another directory (--run_dir=NEW_DIR, or --checkpoint_dir); to start "
        f"over in this one, remove {ckpt.directory} first.") from None
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


def say_save_window(ckpt, grace_s: float, say) -> bool:
  """Says so when a checkpoint save can't fit the preemption window, from the newest step's
  save time (orbax's step metadata; None `ckpt` or no step yet: nothing to say). After a
  notice the final save may first wait for one in flight: two saves must fit in `grace_s`.
  Returns whether it said so."""
  last = fs.checkpoint.last_save_seconds(ckpt) if ckpt is not None else None
  if last is None or 2 * last[1] <= grace_s:
    return False
  step, seconds = last
  say(f"warning: a checkpoint save takes ~{seconds:.1f} s here (step {step}); after a "
      "preemption notice the final save may first wait for one in flight, "
      f"~{2 * seconds:.0f} s in all, but grace_s is {grace_s:g} s: raise grace_s (within the "
      "platform's notice) or checkpoint more often (checkpoint_every), so that less is lost "
      "when the final save can't finish")
  return True


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


def describe(s, state, corpus, report, pol, peak, flops_step, resumed, say) -> int:
  """The start-up lines and the "start" and "data" records of run.json of a run set up as
  `s`; `corpus` is (its description, its data.Baseline), `peak` is `peak_flops`'s pair.
  Returns the param count."""
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  c, seq = s.cfg, s.cfg.seq
  dp = int(np.prod([s.mesh.shape[a] for a in sharding.data_axes(s.mesh)]))
  say(f"fnscale train_lm: model {s.o.model_config} ({c.layers} layers, d_model {c.d_model}, "
      f"{c.heads} heads, seq {seq}, vocab {c.vocab}), {n_params / 1e6:.2f}M params")
  say(f"topology: {s.topo}")
  say(fs_mesh.describe(s.mesh))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  say("train state: " + fs.sharding_report(state, shardings).splitlines()[-1].strip())
  axes = sharding.data_axes(s.mesh)
  say(f"batch: {s.o.global_batch} rows x {seq} tokens = {s.o.global_batch * seq} tokens/step "
      f"({s.o.global_batch // dp} per data-parallel device x {dp} over {axes})"
      + (f", {s.o.accum_steps} accumulation steps" if s.o.accum_steps > 1 else ""))
  say(f"data: {corpus[0]}; held-out bigram baseline {corpus[1].bigram:.4f} nats/token "
      "(recipes/baseline.py)")
  say(f"schedule: {s.o.steps} steps, peak lr {s.o.lr:g}, warmup {s.o.warmup_steps}, cosine to "
      f"{s.o.lr * s.o.min_lr_ratio:g}; precision {s.o.precision}"
      + (f" ({pol})" if pol is not None else " (float32)"))
  say("compile: " + str(report).replace("\n", "\n  "))
  say(f"MFU denominator: {peak[1]}")
  rl.write_run_record(s.o.run_dir, "start", dict(
      step=int(state.step), options=dataclasses.asdict(s.o), params=n_params, seq=seq,
      global_batch=s.o.global_batch, mesh=dict(s.mesh.shape), devices=jax.device_count(),
      processes=jax.process_count(), compile_s=report.compile_seconds, resumed_from=resumed,
      peak_flops=peak[0], flops_per_step=flops_step, xla_warnings=list(report.xla_warnings)),
      active=jax.process_index() == 0)
  rl.write_run_record(s.o.run_dir, "data", dict(
      dataset=s.o.dataset, tokenizer=s.o.tokenizer, unigram_loss=corpus[1].unigram,
      bigram_loss=corpus[1].bigram), active=jax.process_index() == 0)
  return n_params


def progress(s, done: int, m, dt, lr: float, flops_step: float, peak, say, log) -> dict:
  """One progress line (loss, lr, tokens/s, MFU and its denominator, ETA) and its record in
  `log` (a run_log.RunLog). `dt`: seconds per step (None: not measured yet).

  Raises:
    StepError: a non-finite loss.
  """
  loss = float(m["loss"])
  tok_s = s.o.global_batch * s.cfg.seq / dt if dt else None
  mfu = flops_step / dt / peak if dt and peak else None
  metrics = {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tok_s, "perf/mfu": mfu}
  line = rl.progress_line(done, s.o.steps, metrics, dt)
  say(line + (f"  (MFU of {peak_name(s.topo, peak)})" if mfu is not None else ""))
  log.write(done, {**metrics, "train/grad_norm": float(m["grad_norm"]),
                   "train/update_norm": float(m["update_norm"])})
  if not np.isfinite(loss):
    raise fs.StepError(f"loss is {loss} at step {done}; lower lr or use precision=float32")
  return dict(loss=loss, tokens_per_s=tok_s, mfu=mfu)


class Stall(NamedTuple):
  """Consecutive steps that did not train (`did_not_train`): how many, and the first."""
  steps: int = 0
  first: int = 0


def did_not_train(m) -> bool:
  """Whether step metrics `m` show a finite loss with no update that trained: a "bad_update"
  (params unchanged or non-finite) or a step a dynamic loss scale skipped (non-finite
  gradients). A non-finite loss is not counted: the non-finite check stops that run."""
  bad, skipped, loss = jax.device_get((m["bad_update"], m["skipped"], m["loss"]))
  # Skips count whatever the scale. A dynamic scale halves per skip, so k skips in a row
  # lower it 2**k: from float16's default 2**15 to its floor, 1, within 15. train_lm's
  # default limit, 20, leaves that room and 5 halvings more for a scale that grew; gradients
  # still non-finite after 20 halvings (a millionfold) are no scale still being found.
  # Counting only skips at the floor would wait out the halving from wherever the scale
  # grew to, and needs each step's scale before it.
  return bool(int(bad) or (int(skipped) and np.isfinite(loss)))


def check_update(stall: Stall, done: int, m, limit: int) -> Stall:
  """Counts step `done`'s metrics `m` into `stall`; `limit` consecutive steps that did not
  train (`did_not_train`) raise. limit 0: never.

  Raises:
    StepError: naming the steps, the norms and the likely cause.
  """
  if m is None or not did_not_train(m):
    return Stall()
  stall = Stall(stall.steps + 1, stall.first if stall.steps else done)
  if limit and stall.steps >= limit:
    grad, update = float(m["grad_norm"]), float(m["update_norm"])
    scale = f", loss_scale {float(m['loss_scale']):g}" if "loss_scale" in m else ""
    raise fs.StepError(
        f"training stalled: the update was skipped, changed nothing or made the params "
        f"non-finite at {stall.steps} consecutive steps {stall.first}..{done} although the "
        f"loss was finite (at step {done}: loss {float(m['loss']):.4g}, grad_norm {grad:.3g}, "
        f"update_norm {update:.3g}{scale}); likely cause: {_stall_cause(m, grad, update)}; "
        "--max_stalled_steps=0 turns this check off")
  return stall


def _stall_cause(m, grad: float, update: float) -> str:
  if int(m["skipped"]):
    return ("the updates were skipped: their gradients were non-finite and halving the "
            "dynamic loss scale did not make them finite, so the scaled gradients overflow "
            "the compute dtype (float16 holds at most 65504) even at the scale's floor, or "
            "are non-finite at any scale (e.g. sqrt's at 0); use precision=float32 (or "
            "bfloat16 compute, float32's range); if loss_scale is still falling from a high "
            "start, raise --max_stalled_steps")
  if not np.isfinite(update):
    return ("the params became non-finite: the gradients or the optimizer's update "
            "overflowed (a static loss scale too large for the compute dtype applies them "
            "as inf); lower lr or the static scale, or use precision=float32")
  if grad == 0:
    return ("the gradients are zero: they underflow in the compute dtype or the loss does "
            "not depend on the params; use precision=float32 (or float16 with its loss scale)")
  return ("each update is rounded away by the params' dtype (bfloat16 params hold ~3 "
          "significant digits) or the learning rate is 0; keep params in float32 (e.g. "
          "precision='params=float32,compute=bfloat16,output=float32') or raise lr")


def summarize(fields: dict, s, state, report, n_params: int, t0: float, say) -> "Summary":
  """The run's Summary from `fields` (train_lm's _finish), said in one line and recorded as
  the "summary" of run.json."""
  summary = Summary(**fields, compile_s=report.compile_seconds, wall_s=time.time() - t0,
                    params=n_params, run_dir=s.o.run_dir, state=state,
                    checkpoint_dir=s.o.checkpoint_dir or None,
                    metrics=os.path.join(s.o.run_dir, rl.METRICS_FILE))
  rl.write_run_record(s.o.run_dir, "summary", summary.record(),
                      active=jax.process_index() == 0)
  base = (f" (bigram baseline {summary.bigram_loss:.4f})"
          if summary.bigram_loss is not None else "")
  say(f"done: step {summary.final_step}, last eval loss {summary.eval_loss:.4f} nats/token"
      f"{base}, {summary.train_s:.0f} s training, {summary.wall_s:.0f} s total"
      if summary.eval_loss is not None else f"done: step {summary.final_step}")
  return summary


class Summary(NamedTuple):
  """What `train_lm` returns; its printed form leaves out the final `state`.

  `loss` is the last progress line's train loss; `eval_loss` the final eval's held-out loss
  and `bigram_loss` the corpus's add-one smoothed bigram model's on the whole held-out split
  (the level to beat, `data.baseline`), both in nats per token. `tokens_per_s` and `mfu` are
  whole-run figures: every timed step this call ran (each step after its first; evals,
  checkpoints and the sample left out), not the last progress window; None when fewer than
  two steps ran.
  """
  final_step: int
  start_step: int
  resumed_from: int | None
  stopped: str | None
  loss: float | None
  eval_loss: float | None
  bits_per_byte: float | None
  bigram_loss: float | None
  tokens_per_s: float | None
  mfu: float | None
  compile_s: float
  train_s: float
  wall_s: float
  params: int
  global_batch: int
  seq: int
  mesh: dict
  devices: int
  processes: int
  sample: str | None
  run_dir: str
  metrics: str
  checkpoint_dir: str | None
  state: Any = None

  def __repr__(self):
    return "Summary(" + ", ".join(f"{k}={v!r}" for k, v in self.record().items()) + ")"

  def record(self) -> dict:
    return {k: v for k, v in self._asdict().items() if k != "state"}
