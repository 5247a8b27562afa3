"""The plumbing of `train_lm.py` that a user rarely edits: options as flags and keywords,
device start-up, topology checks, precision, the MFU denominator, the start-up report, step
timing, progress and summary (recorded through run_log.py). Checkpoints: checkpoints.py."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, NamedTuple

from absl import flags
import jax
import numpy as np
import optax

import fnscale as fs
from fnscale.errors import did_you_mean
from fnscale.analysis import flops
from fnscale import mesh as fs_mesh
from fnscale import sharding
from fnscale.analysis import report as fs_report
from recipes.lm import checkpoints as ck, cli, data, gpt, hardware, run_log as rl


def option(default, help_: str):
  """A field of an options dataclass: its default and its `--help` line (numbers' ranges:
  the class's `RANGES`, {name: cli.check_range's bounds})."""
  return dataclasses.field(default=default, metadata={"help": help_})


def check_options(cls, options: dict):
  """`cls(**options)` after checking each name, type (an int is a float; a bool is no int)
  and range.

  Raises:
    FnscaleError: an unknown name (the message lists the known ones), a wrong type or a
      number out of its range (the message names the option and the range).
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
  return _check_ranges(cls(**options))


def _check_ranges(o):
  """`o` (an options dataclass) after checking each number against its range (the class's
  `RANGES`; floats must be finite) and each word against its `CHOICES`."""
  ranges, choices = getattr(type(o), "RANGES", {}), getattr(type(o), "CHOICES", {})
  for f in dataclasses.fields(o):
    value = getattr(o, f.name)
    if f.name in choices and value not in choices[f.name]:
      raise fs.InputError(f"--{f.name}={value!r}: expected one of {list(choices[f.name])}"
                          + did_you_mean(value, choices[f.name]))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      problem = cli.check_range(value, **ranges.get(f.name, {}))
      if problem:
        raise fs.InputError(f"--{f.name}={value!r} {problem}: {f.metadata['help']}")
  return o


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
  return _check_ranges(cls(**{f.name: fv[f.name].value for f in dataclasses.fields(cls)}))


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
    request = fs.cloud.shutdown_at_exit(o.shutdown_delay_s, o.shutdown_dry_run)
    say(f"shutdown at exit ({o.shutdown_delay_s:g} s after the end"
        + (", dry run" if o.shutdown_dry_run else "") + f"): {fs.cloud.describe(request)}")
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
    status = cli.report(e)
    if isinstance(e, fs.DistributedError) and str(e).startswith("lost "):
      # Python's own exit would wait for the lost process at JAX's shutdown barrier.
      sys.stdout.flush()
      os._exit(fs.multihost.EXIT_JOB_FAILED)  # pylint: disable=protected-access
    return status
  return 143 if summary.stopped == "SIGTERM" else 0


def make_mesh(axes, dcn: str, topo, say, devices=None):
  """`fs.make_mesh(axes, dcn=dcn)` over `devices` (default `jax.devices()`); over several TPU
  slices without `dcn` (and without a `MeshAxes` of its own), data parallel across the
  slices: `replica` = the slice count, the `axes` within each slice, said by `say`; unless
  `axes` has a "stage" axis of the slice count: make_mesh lays the pipeline stages across
  the slices."""
  devices = jax.devices() if devices is None else devices
  _check_axis_names(axes, dcn)
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
  stages = not isinstance(axes, fs.MeshAxes) and fs_mesh.parse_axes(axes).get("stage") == slices
  if not dcn and slices > 1 and not isinstance(axes, fs.MeshAxes) and not stages:
    dcn = f"replica={slices}"
    say(f"mesh: the devices span {slices} TPU slices and --dcn is not set: data parallel "
        f"across the slices (--dcn={dcn}), the --mesh axes within each slice")
  return fs.make_mesh(axes, dcn=dcn or None, topology=topo, devices=devices)


def _check_axis_names(axes, dcn: str) -> None:
  """The --mesh and --dcn axes are ones fnscale's conventions know, refused before anything
  is written (a typo of "fsdp" would train with its devices holding copies)."""
  if not isinstance(axes, fs.MeshAxes):
    fs_mesh.check_axis_names(fs_mesh.parse_axes(axes, what="--mesh"), "--mesh")
    fs_mesh.check_axis_names(fs_mesh.parse_axes(dcn or {}, what="--dcn"), "--dcn")


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


class Peak(NamedTuple):
  """The MFU denominator: the FLOP/s of all devices together (None: unknown), and a line
  saying what it is."""
  flops: float | None
  about: str


def peak_flops(topo) -> Peak:
  """The MFU denominator of the hardware `topo` (on CPU: this host's measured matmul peak)."""
  if topo.platform == "cpu":  # measured once per machine (in CPU seconds: load can't lower it)
    host = flops.host_matmul_peak()
    peak = host.flops * jax.process_count()
    kept = f"cached in {host.path}; delete it to measure again" if host.path else "not cached"
    return Peak(peak, f"CPU matmul peak {peak / 1e9:.0f} GFLOP/s, measured "
                f"{'now' if host.fresh else host.measured} (the best of 3 x 10 runs, per "
                f"CPU-second x {flops.usable_cores()} cores: other jobs on the machine lower "
                f"the MFU, not the peak{_load_average()}; {kept}), shared by all "
                f"{jax.device_count()} simulated devices (one host's cores)")
  if topo.peak_flops_per_device:
    return Peak(topo.peak_flops_per_device * jax.device_count(),
                f"{topo.peak_flops_per_device / 1e12:.0f} TFLOP/s bf16 peak x "
                f"{jax.device_count()} devices")
  return Peak(None, "unknown peak FLOP/s for this device kind; MFU not reported")


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


def check_pipeline(microbatches: int, model, mesh) -> None:
  """Raises FnscaleError for a pipeline that can't run as asked: --microbatches below 0 or
  without a "stage" axis to cut, or either with a model whose layers don't run as stages
  (its `loss_fn` takes no `microbatches`): a "stage" axis would only split the batch."""
  stages = mesh.shape.get("stage", 1)
  staged = "microbatches" in inspect.signature(model.loss_fn).parameters
  if microbatches < 0 or (microbatches and stages == 1) or ((microbatches or stages > 1)
                                                            and not staged):
    raise fs.InputError(
        f"--microbatches={microbatches} on mesh {dict(mesh.shape)}: pipeline stages need a "
        "model whose layers run as stages (--model_config=llama-*; this one's don't) and a "
        "mesh with a 'stage' axis, e.g. --mesh=data=2,stage=4; fix: a Llama model, or no "
        "stage axis and no --microbatches.")


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
# The start-up report, step timing, progress lines. `r` is train_lm's `Run`.
# ------------------------------------------------------------------------------------------------


def default_run_dir(model: str, dataset: str, tokenizer: str, vocab: int) -> str:
  """`runs/<model>-<dataset>`, plus `-vocab<V>` with a tokenizer: runs of another model,
  corpus or vocabulary get their own directories instead of resuming each other's
  checkpoints. A dataset path or glob counts by its last plain name ("~/src/**/*.py": src)."""
  plain = re.split(r"[*?\[]", dataset or "stdlib", maxsplit=1)[0]
  name = os.path.splitext(os.path.basename(os.path.normpath(os.path.expanduser(plain))))[0]
  name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data"
  return os.path.join("runs", f"{model}-{name}" + (f"-vocab{vocab}" if tokenizer else ""))


# The options that define a run: what its checkpoints hold and the order it reads the data.
DEFINING = ("model_config", "init_from", "tokenizer", "dataset", "seq", "seed", "global_batch")


def check_same_run(o, devices: int) -> None:
  """Refuses to resume the run recorded in `o.run_dir`'s run.json ("start": its options, with
  every default filled in) when a defining option differs (`DEFINING`). The global batch
  counts only on as many devices as the recorded run: on other hardware the default batch
  follows the devices (resuming there is said by `checkpoints.restore_or_init`).

  Raises:
    InputError: naming each differing option (this run's value and the recorded one) and
      the fix.
  """
  path = os.path.join(o.run_dir, rl.RUN_FILE)
  if not os.path.isfile(path):
    return
  with open(path, encoding="utf-8") as f:
    start = json.load(f).get("start", {})
  then = start.get("options", {})
  names = DEFINING if start.get("devices") == devices else DEFINING[:-1]
  diff = [f"{k}={getattr(o, k)!r} (the run's: {then[k]!r})" for k in names
          if k in then and then[k] != getattr(o, k)]
  if diff:
    raise fs.InputError(
        f"--run_dir={o.run_dir} holds a run with other options: {', '.join(diff)}; its "
        "checkpoints and data order are that run's. Fix: give this run a new --run_dir, or "
        "the run's options to resume it.")


class Setup(NamedTuple):
  """A run as train_lm's options decide it (`train_lm._setup`): the options with every
  default filled in (checked), the hardware, mesh, model and data."""
  o: Any  # train_lm.Options
  topo: fs.Topology
  mesh: jax.sharding.Mesh
  model: Any  # the model's module: gpt or llama
  cfg: Any  # its ModelConfig
  profile: rl.ProfileWindow | None  # --profile_steps
  corpus: data.Corpus


class Run(NamedTuple):
  """What train_lm's loop and its reports share, built once when the step has compiled."""
  s: Setup
  say: Callable[..., None]  # print, on process 0 only
  t0: float  # when the run started (time.time())
  baseline: data.Baseline  # the held-out losses to beat (bigram, unigram)
  policy: Any  # the jmp policy (None: float32)
  schedule: Callable[[int], float]  # the learning rate at a step
  peak: Peak  # the MFU denominator
  step: Callable  # the compiled step: (state, batch) -> (state, metrics)
  report: Any  # its fs.compile_report
  batches: Any  # this process's batch iterator (each checkpoint saves its position)
  eval_loss: Callable  # eval_loss(params, batch) -> mean loss (jitted)
  eval_batches: list  # the held-out global batches of every eval
  start: int  # the first step this call trains
  resumed: int | None  # the step it resumed from (None: a fresh run)
  log: rl.RunLog  # metrics.jsonl and TensorBoard
  prof: rl.Profiler  # the --profile_steps trace
  saver: ck.Saver  # checkpoint saves, each after the finiteness check
  should_stop: Callable[[int], bool]  # the preemption guard's check


def put(s: Setup, rows: dict):
  """This process's rows as global arrays over run `s`'s mesh; under a context axis first
  in the order its shards hold the sequence, with the positions the model then needs
  (`fnscale.parallel.context.reorder_batch`)."""
  if fs.parallel.context.shards(s.mesh) > 1:
    rows = fs.parallel.context.reorder_batch(rows, s.mesh, s.o.context_order)
  return fs.global_batch(rows, fs.batch_sharding(s.mesh))


def flops_per_step(s: Setup) -> float:
  """Model FLOPs per step (MFU's numerator, times the step's time)."""
  return s.model.flops_per_token(s.cfg) * s.o.global_batch * s.cfg.seq


def param_count(state) -> int:
  """The number of parameters of a train state."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))


def bits_per_byte(r, loss: float) -> float:
  """A loss in nats per token of run `r`'s corpus, in bits per byte of text."""
  return loss * r.s.corpus.tokens_per_byte / math.log(2)


def describe(r, state) -> None:
  """The start-up lines and the "start" and "data" records of run.json of run `r`, about to
  train `state`."""
  s, o, c, seq, say = r.s, r.s.o, r.s.cfg, r.s.cfg.seq, r.say
  n_params = param_count(state)
  dp = int(np.prod([s.mesh.shape[a] for a in sharding.data_axes(s.mesh)]))
  say(f"fnscale train_lm: model {o.model_config} ({c.layers} layers, d_model {c.d_model}, "
      f"{c.heads} heads, seq {seq}, vocab {c.vocab}), {n_params / 1e6:.2f}M params")
  say(hardware.describe(s.topo))
  say(fs_mesh.describe(s.mesh))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  say("train state: " + fs.sharding_report(state, shardings).splitlines()[-1].strip())
  axes = sharding.data_axes(s.mesh)
  split = fs.parallel.context.shards(s.mesh)
  say(f"batch: {o.global_batch} rows x {seq} tokens = {o.global_batch * seq} tokens/step "
      f"({o.global_batch // dp} per data-parallel device x {dp} over {axes})"
      + (f", each row split {split} ways over the context axis ({seq // split} tokens per "
         "device)"
         if split > 1 else "")
      + (f", {o.accum_steps} accumulation steps" if o.accum_steps > 1 else ""))
  say(f"data: {s.corpus.describe}; held-out bigram baseline {r.baseline.bigram:.4f} "
      "nats/token (recipes/baseline.py)")
  say(f"schedule: {o.steps} steps, peak lr {o.lr:g}, warmup {o.warmup_steps}, cosine to "
      f"{o.lr * o.min_lr_ratio:g}; precision {o.precision}"
      + (f" ({r.policy})" if r.policy is not None else " (float32)"))
  say("compile: " + str(r.report).replace("\n", "\n  "))
  say(f"MFU denominator: {r.peak.about}")
  rl.write_run_record(o.run_dir, "start", dict(
      step=int(state.step), options=dataclasses.asdict(o), params=n_params, seq=seq,
      global_batch=o.global_batch, mesh=dict(s.mesh.shape), devices=jax.device_count(),
      processes=jax.process_count(), compile_s=r.report.compile_seconds,
      resumed_from=r.resumed, peak_flops=r.peak.flops, flops_per_step=flops_per_step(r.s),
      xla_warnings=list(r.report.xla_warnings)), active=jax.process_index() == 0)
  rl.write_run_record(o.run_dir, "data", dict(
      dataset=o.dataset, tokenizer=o.tokenizer, unigram_loss=r.baseline.unigram,
      bigram_loss=r.baseline.bigram), active=jax.process_index() == 0)


def evaluate(r, state, step: int) -> float:
  """The held-out loss (nats/token) of `state` at `step` of run `r`, said and logged."""
  # All devices finish each eval program (not just the one a scalar is read from).
  value = float(np.mean([float(jax.block_until_ready(r.eval_loss(state.params, b)))
                         for b in r.eval_batches]))
  bpb = bits_per_byte(r, value)
  r.say(f"eval  step {step:>6}: loss {value:.4f} nats/token, {bpb:.4f} bits/byte")
  r.log.write(step, {"eval/loss": value, "eval/bits_per_byte": bpb})
  return value


def sample(r, state) -> str:
  """`--sample_len` tokens that `state`'s model of run `r` writes after `--prompt`, said."""
  o, c, t = r.s.o, r.s.corpus, time.time()
  apply = functools.partial(r.s.model.apply, cfg=r.s.cfg)
  text = c.decode(gpt.generate(apply, state.params, c.encode(o.prompt or "\n"),
                               gpt.Sampling(o.sample_len, r.s.cfg.seq, o.temperature, o.seed,
                                            o.attention)))
  r.say(f"sample ({o.sample_len} tokens, temperature {o.temperature}, "
        f"{time.time() - t:.1f} s):\n{'-' * 60}\n{o.prompt}{text}\n{'-' * 60}")
  return text


EARLY_ETA_STEPS = 3  # a first progress line (with its ETA) this many timed steps in


class Timing(NamedTuple):
  """The timed steps so far (`seconds`, `steps`) and where the open window began."""
  mark_s: float
  mark_step: int
  seconds: float = 0.0
  steps: int = 0


def lap(t: Timing, done: int) -> tuple[Timing, float | None]:
  """Closes the window at step `done` (counted in the totals unless it holds no step: then
  it only timed a progress line), opens the next one now. Returns the new timing and the
  window's seconds per step (None for an empty window)."""
  now, n = time.time(), done - t.mark_step
  if n <= 0:
    return t._replace(mark_s=now), None
  return Timing(now, done, t.seconds + now - t.mark_s, t.steps + n), (now - t.mark_s) / n


def paused(t: Timing | None, seconds: float) -> Timing | None:
  """`t` with `seconds` (a save's) left out of its open window."""
  return None if t is None else t._replace(mark_s=t.mark_s + seconds)


def whole_run(r, t: Timing | None) -> dict:
  """tokens/s and MFU of run `r` over every timed step (None when fewer than two steps ran)."""
  if t is None or t.steps == 0 or t.seconds <= 0:
    return dict(tokens_per_s=None, mfu=None)
  per_s = t.steps / t.seconds
  return dict(tokens_per_s=r.s.o.global_batch * r.s.cfg.seq * per_s,
              mfu=flops_per_step(r.s) * per_s / r.peak.flops if r.peak.flops else None)


def progress(r, done: int, m, dt) -> dict:
  """One progress line of run `r` at step `done` with metrics `m` (loss, lr, tokens/s, MFU
  and its denominator, ETA) and its record in `r.log`. `dt`: seconds per step (None: not
  measured yet).

  Raises:
    StepError: a non-finite loss.
  """
  s, peak, loss = r.s, r.peak.flops, float(m["loss"])
  tok_s = s.o.global_batch * s.cfg.seq / dt if dt else None
  mfu = flops_per_step(r.s) / dt / peak if dt and peak else None
  # The lr that step `done`'s update used (the schedule counts updates from 0: the first
  # of a warmup from 0, as in MaxText and GPT-3's recipe, moves nothing).
  metrics = {"train/loss": loss, "train/lr": float(r.schedule(done - 1)),
             "perf/tokens_per_s": tok_s, "perf/mfu": mfu}
  line = rl.progress_line(done, s.o.steps, metrics, dt)
  r.say(line + (f"  (MFU of {peak_name(s.topo, peak)})" if mfu is not None else ""))
  r.log.write(done, {**metrics, "train/grad_norm": float(m["grad_norm"]),
                     "train/update_norm": float(m["update_norm"])})
  if "aux" in m:  # a mixture of experts: its load
    _say_load(r, done, s.model.load_metrics(m["aux"]))
  if not np.isfinite(loss):
    raise fs.StepError(f"loss is {loss} at step {done}; lower lr or use precision=float32")
  return dict(loss=loss, tokens_per_s=tok_s, mfu=mfu)


def _say_load(r, done: int, load: dict) -> None:
  """A mixture of experts' load at step `done`: one line, and its record in the run's log."""
  r.say(f"  experts: busiest {load['moe/load_max_over_mean']:.2f}x the mean load, balance "
        f"loss {load['moe/load_balance_loss']:.4f}, cross-entropy "
        f"{load['moe/cross_entropy']:.4f}, {load['moe/dropped']:.0f} copies dropped")
  r.log.write(done, load)


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


def summarize(r, state, out: dict) -> "Summary":
  """The Summary of run `r` that ended with `state`; `out`: the loop's figures (train_lm's
  `_train`, `_finish`). Said in one line and recorded as the "summary" of run.json."""
  s, ev = r.s, out["eval_loss"]
  summary = Summary(
      final_step=int(state.step), start_step=r.start, resumed_from=r.resumed,
      stopped=out["stopped"], loss=out.get("loss"), eval_loss=ev,
      bits_per_byte=None if ev is None else bits_per_byte(r, ev),
      bigram_loss=r.baseline.bigram, tokens_per_s=out["tokens_per_s"], mfu=out["mfu"],
      compile_s=r.report.compile_seconds, train_s=out["train_s"], wall_s=time.time() - r.t0,
      params=param_count(state), global_batch=s.o.global_batch, seq=s.cfg.seq,
      mesh=dict(s.mesh.shape), devices=jax.device_count(), processes=jax.process_count(),
      sample=out["sample"], run_dir=s.o.run_dir, state=state,
      checkpoint_dir=s.o.checkpoint_dir or None,
      metrics=os.path.join(s.o.run_dir, rl.METRICS_FILE))
  rl.write_run_record(s.o.run_dir, "summary", summary.record(),
                      active=jax.process_index() == 0)
  base = (f" (bigram baseline {summary.bigram_loss:.4f})"
          if summary.bigram_loss is not None else "")
  r.say(f"done: step {summary.final_step}, last eval loss {summary.eval_loss:.4f} nats/token"
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
