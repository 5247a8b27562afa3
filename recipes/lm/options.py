"""train_lm's options: each one's flag `--name`, keyword of `train_lm`, default, `--help`
line and, for a number, its range (`Options.RANGES`), for a word, its values
(`Options.CHOICES`), all checked by `cli.check_options` (keywords) and `cli.parse_flags`
(flags) before anything runs; and the defaults that follow the hardware and the run's length,
in one place (`PLATFORM_DEFAULTS`, `schedule_defaults`, `log_defaults`). The options are held
in groups by job (`Options.hardware`, `.model`, `.data`, `.step`, `.schedule`, `.ckpt`,
`.log`, `.tune`), each a small frozen dataclass; flags and keywords stay flat. Nothing here
runs: the words an option takes are defined here and used by the modules that act on them.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import fnscale as fs
from recipes.lm.cli import build, group, option

CORPORA = ("stdlib", "tiny_corpus")  # named corpora (data.py reads them)
PACKINGS = ("first_fit", "best_fit")  # token caches: grain's packing of documents into rows
LONG_DOCS = ("split", "truncate", "error")  # a document longer than a row
MIXED = "params=float32,compute=bfloat16,output=float32"  # --precision=bfloat16
# What each block keeps for its backward pass (recipes/lm/remat.py says what each saves).
REMAT_POLICIES = ("none", "dots", "qkv_attn", "qkv", "offload_dots", "offload_attn", "full")
OBJECTIVES = ("lm", "dpo")  # next-token cross-entropy; preference pairs (recipes/lm/dpo.py)
DPO_LOSSES = ("sigmoid", "robust")  # DPO / cDPO; rDPO (recipes/lm/dpo.py)
TRACKERS = ("tensorboard", "wandb")  # where scalars go besides metrics.jsonl (run_log.py)
OPTIMIZERS = ("adamw", "adafactor")  # optax's (optimizers.py says what each keeps)
MU_DTYPES = ("float32", "bfloat16")  # AdamW's first-moment dtype

# The defaults that follow the hardware ("cpu", or "accelerator": TPU or GPU). CPU: the whole
# default run in ~2-3 minutes on 2 cores (README, "The main job"). Accelerators: GPT small at
# 32 rows of 1024 tokens keeping its matmul outputs ("dots"), 120k tokens/s on one TPU v5e
# where 16 rows keeping everything (what fits without remat) ran 93k (recipes/bench/chip.py).
PLATFORM_DEFAULTS = {
    "cpu": dict(model_config="tiny_gpt2", seq=64, batch_size=8, steps=200, mesh="data=-1",
                remat_policy="none"),
    "accelerator": dict(model_config="small", seq=1024, batch_size=32, steps=5000,
                        mesh="fsdp=-1", remat_policy="dots")}
# Peak learning rate by model; other models 3e-4.
LR = {"nano": 3e-3, "tiny_gpt2": 3e-3, "tiny": 3e-3, "llama-tiny": 3e-3, "small": 6e-4,
      "medium": 3e-4, "moe-tiny": 3e-3, "moe-deepseek-tiny": 3e-3, "moe-qwen3-tiny": 3e-3,
      "deepseek-tiny": 3e-3}
DEFAULT_LR = 3e-4


def _by_platform(name: str) -> str:
  """'default X on CPU, Y on TPU/GPU' for option `name`'s `PLATFORM_DEFAULTS`."""
  cpu, accel = PLATFORM_DEFAULTS["cpu"][name], PLATFORM_DEFAULTS["accelerator"][name]
  return f"default {cpu} on CPU, {accel} on TPU/GPU"


_POSITIVE = ("seq", "batch_size", "global_batch", "epochs", "steps", "schedule_steps",
             "accum_steps", "devices", "pack_bins", "checkpoint_keep", "log_every", "eval_every",
             "eval_batches")
_NON_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "max_stalled_steps",
                 "microbatches", "seed", "checkpoint_every", "stop_after", "sample_len",
                 "temperature", "shutdown_delay_s", "num_processes", "lora_rank",
                 "dpo_label_smoothing", "emergency_every")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The options that say what hardware a recipe runs on, train_lm's and the benchmarks'
  (`recipes.lm.hardware` adds them to a benchmark's flags and detects the topology)."""
  mesh_shape: str = option("", "topology override: chip grid '2x4x8', slices first '2x4x4x8'")
  topology: str = option("", "hardware override, e.g. 'v5p:2x2x2' or 'v5p-16'")
  tpu: bool | None = option(None, "True: require a TPU; default: whatever devices there are")


@dataclasses.dataclass(frozen=True)
class HardwareOptions(Hardware):
  """train_lm's machine: the hardware (`Hardware`'s), the mesh over it, the job's processes
  and the shutdown at its end (`startup.start`)."""
  mesh: str = option("", "mesh axes in a slice, e.g. 'data=-1,fsdp=2,tensor=2' (-1: the "
                     "rest); 'auto': fnscale.analysis.plan's choice of mesh, remat and "
                     f"accumulation for this machine; {_by_platform('mesh')}")
  dcn: str = option("", "mesh axes across slices (TPU multi-slice), e.g. 'replica=2'; "
                    "default replica=<slices> when the devices span several slices")
  devices: int | None = option(None, "simulated CPU devices (CPU-only machines); default 8")
  coordinator_address: str = option("", "multi-process: host:port of process 0; default: env "
                                  "JAX_COORDINATOR_ADDRESS or auto-detected (pods, SLURM)")
  num_processes: int = option(0, "multi-process: process count (env JAX_NUM_PROCESSES)")
  process_id: int = option(-1, "multi-process: this process's id (env JAX_PROCESS_ID)")
  shutdown_at_exit: bool = option(False, "delete this Cloud TPU VM when the job ends")
  shutdown_delay_s: float = option(60.0, "seconds before that shutdown (a sentinel cancels it)")
  shutdown_dry_run: bool = option(False, "print the shutdown request instead of sending it")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """Which model, its tokenizer and how it computes (precision, kernels, int8, unrolling)."""
  model_config: str | None = option(None, "model: a name of recipes/lm/models.py (nano, "
                                    "tiny_gpt2, tiny, small, medium, llama-tiny, llama-1b, "
                                    f"moe-tiny, ...); {_by_platform('model_config')}")
  init_from: str = option("", "a Hugging Face model directory (config.json, safetensors, "
                          "tokenizer.json): continue training its model and weights with "
                          "its tokenizer (instead of --model_config; --tokenizer replaces "
                          "its tokenizer.json)")
  tokenizer: str = option("", "a Hugging Face tokenizer.json, or 'bytes' (UTF-8 bytes, vocab "
                          "256); default: bytes, or --init_from's tokenizer.json")
  precision: str = option("auto", f"jmp policy, e.g. '{MIXED}', 'float32', 'bfloat16' "
                        "(or 'bf16', 'f32'); auto: float32 on CPU, bfloat16 compute elsewhere")
  attention: str = option("auto", "attention: auto, xla, splash, cudnn, pallas_gpu")
  int8: bool = option(False, "the blocks' projections and MLP multiply in int8 "
                      "(recipes/lm/int8.py: per-channel, straight-through gradients; gpt and "
                      "llama models)")
  unroll: bool | None = option(None, "the layer loop unrolled, not one lax.scan body: faster, "
                               "more memory, a longer compile (gpt, llama); default: on a TPU "
                               "unless remat is full, the scan where unrolled doesn't fit")


@dataclasses.dataclass(frozen=True)
class DataOptions:
  """What the run reads and in what order: the corpus, its packing into rows, the row
  length and the seed (of the params init, the data order and sampling)."""
  dataset: str = option("stdlib", f"corpus: {list(CORPORA)}, a file, directory or glob; "
                        "or token caches (recipes/pretokenize.py): DIR, 'DIR:0.7,DIR2:0.3' "
                        "or a JSON file of weights")
  packing: str = option("first_fit", "token caches: packing of documents into rows, "
                        "first_fit or best_fit")
  pack_bins: int = option(8, "token caches: rows packed at once per row stream")
  long_docs: str = option("split", "token caches: a document longer than a row is split "
                          "into pieces, truncate-d, or an error")
  seq: int | None = option(None, f"sequence length in tokens; {_by_platform('seq')}")
  seed: int = option(0, "seed of the params init, the data order and sampling")


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How each step runs: rows, accumulation, remat, optimizer state, attention over a
  context axis, pipeline microbatches; what the user left open is decided once by the memory
  pre-flight (`memory.choose`) and only read after."""
  batch_size: int | None = option(None, "rows per data-parallel device; "
                                  + _by_platform("batch_size"))
  global_batch: int | None = option(None, "global batch in rows (instead of batch_size)")
  accum_steps: int | None = option(None, "gradient accumulation micro-steps per step (splits "
                                   "the batch); default 1, or what fits the device's memory")
  accum_gather: str = option("auto", "with accum_steps > 1: 'auto' ('once' where whole params "
                             "and accumulator fit 1% of device memory, else 'per_microbatch'), "
                             "'per_microbatch' (params stay sharded, gradients reduced every "
                             "microbatch) or 'once' (whole params, gradients reduced once)")
  remat: bool | None = option(None, "recompute each block's activations in the backward "
                             "pass (--remat_policy=full); default off, or on where that is "
                             "what fits the device's memory")
  remat_policy: str = option("auto", "what each block keeps for its backward pass "
                             f"(recipes/lm/remat.py): {', '.join(REMAT_POLICIES)}; auto: "
                             f"{_by_platform('remat_policy')}; with --remat full, or "
                             "offload_attn on a TPU whose host link hides it")
  optimizer: str | None = option(None, "adamw (first and second moments: 2 floats per "
                                 "param) or adafactor (the second moment factored over each "
                                 "matrix's rows and columns, no first moment: about 0); "
                                 "default adamw, or what fits the device's memory "
                                 "(recipes/lm/optimizers.py)")
  mu_dtype: str | None = option(None, "AdamW's first-moment dtype, float32 or bfloat16 "
                                "(half its bytes); default float32, or what fits")
  optimizer_offload: bool | None = option(
      None, "keep the optimizer state in the host's memory between steps, each param's share "
      "brought to the device for its update (the same numbers; the device holds a few "
      "params' state at a time, host transfers each step); default off, or on where that "
      "is what fits")
  context: str = option("all_gather", "attention over a sequence split by a 'context' mesh "
                        "axis (--mesh=data=2,context=4): all_gather (K/V gathered), ring "
                        "or ulysses (all-to-all: heads over the axis)")
  context_order: str = option("zigzag", "the order the context shards hold the sequence "
                              "in: zigzag (balanced causal work), striped or contiguous")
  microbatches: int = option(0, "pipeline microbatches on a mesh with a 'stage' axis "
                             "(Llama models: their layers run as stages); default: the stages")


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
  """How long the run trains and how each update is made: the run's length, the lr
  schedule, weight decay, clipping and the stall checks."""
  epochs: int | None = option(None, "passes over the training split (instead of steps)")
  steps: int | None = option(None, f"train steps; {_by_platform('steps')}")
  lr: float | None = option(None, "peak lr of the warmup + cosine schedule; default by model "
                            f"(e.g. tiny_gpt2 {LR['tiny_gpt2']:g}, small {LR['small']:g})")
  schedule_steps: int | None = option(
      None, "length of the lr schedule in steps (past it the lr stays at its final value); "
      "default --steps, and on resuming the schedule the run's checkpoint was trained under: "
      "more --steps keep it, --schedule_steps=STEPS stretches it over the longer run")
  warmup_steps: int | None = option(None, "linear warmup steps; default schedule_steps / 20, "
                                    "<= 500")
  min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak")
  weight_decay: float = option(0.1, "decoupled weight decay (lr x decay x param) on weight "
                               "matrices and embeddings")
  grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
  max_stalled_steps: int = option(20, "stop with an error after this many consecutive steps "
                                  "whose gradients were non-finite (or, where the change is "
                                  "measured, --update_norm or bfloat16 params, that left the "
                                  "params unchanged or non-finite), or were skipped (float16's "
                                  "loss scale), although the loss was finite (0: never)")
  update_norm: bool = option(False, "measure the change each step applies to the params "
                             "(train/update_norm; a stall check then sees an update rounded "
                             "away or an lr of 0): a pass over the updates, 1.7% of a step; "
                             "always measured with bfloat16 params")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """What the run keeps: its directory, its checkpoints and emergency copies, the preemption
  grace, the exports at the end and the compile cache."""
  run_dir: str = option("", "directory of metrics.jsonl, TensorBoard events, run.json, "
                        "log.txt and checkpoints; default runs/<model>-<dataset> (plus "
                        "-vocab<V> with a tokenizer)")
  checkpoint: bool = option(True, "save checkpoints and resume from the newest good one")
  checkpoint_dir: str = option("", "checkpoints (path or gs://...); default RUN_DIR/checkpoints")
  checkpoint_every: int = option(200, "save every this many steps (0: at the end and SIGTERM)")
  checkpoint_keep: int = option(3, "how many checkpoints to keep")
  # Emergency copies (recipes/lm/emergency.py): a restart resumes from the newer of them and
  # the checkpoints.
  emergency_every: int = option(0, "also save an emergency copy every this many steps to "
                                "--emergency_dir, the newest 2 kept (0: off)")
  emergency_dir: str = option("", "emergency copies (a fast disk every process sees; with "
                              "{process} in it, each process's own local disk, holding its "
                              "shards and a peer's); default RUN_DIR/emergency")
  stop_after: int = option(0, "stop after this step as if preempted (checkpoint saved); 0: off")
  grace_s: float = option(fs.multihost.DEFAULT_GRACE_S, "seconds from a preemption notice "
                          "(SIGTERM) to the end of the process, the final save included; "
                          "keep below the platform's notice (about 30 s on Cloud TPU, GKE)")
  export_hf: str = option("", "at the end, write the params as a Hugging Face checkpoint "
                          "(safetensors, config.json, tokenizer) to this directory")
  export_adapter: str = option("", "with --lora_rank: also write the adapters as a Hugging "
                               "Face PEFT adapter here; default EXPORT_HF/adapter")
  compile_cache_dir: str = option("", "persistent XLA compilation cache directory")


@dataclasses.dataclass(frozen=True)
class LogOptions:
  """What the run reports: the tracker, progress lines, evals, the profile and the final
  sample."""
  tracker: str = option("tensorboard", "where scalars go besides metrics.jsonl: "
                        "tensorboard (event files in run_dir) or wandb (Weights & Biases; "
                        "WANDB_MODE=offline works without a network)")
  profile_steps: str = option("", "START:STOP: JAX profiler trace of these steps into run_dir")
  log_every: int | None = option(None, "steps between progress lines; default 25 lines a run")
  eval_every: int | None = option(None, "steps between evals; default 5 evals a run")
  eval_batches: int = option(4, "global batches of held-out text per eval")
  sample_len: int = option(200, "tokens to generate at the end (0: none)")
  evaluate_finished: bool = option(False, "rerunning a run that holds its last step: compile, "
                                   "evaluate and sample its final state again (default: say "
                                   "so and end)")
  prompt: str = option("def ", "prompt of the generated sample")
  temperature: float = option(0.8, "sampling temperature of the sample (0: greedy)")


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
  """Fine-tuning: the objective (next-token or DPO), LoRA adapters, DPO's loss."""
  objective: str = option("lm", "lm: next-token loss on --dataset; dpo: preference pairs "
                          "(DPO) from a JSONL/Parquet file of prompt, chosen, rejected rows, "
                          "the frozen base as the reference (needs --lora_rank)")
  lora_rank: int = option(0, "LoRA rank: train low-rank adapters of the model's matmul "
                          "weights, the base frozen (0: full fine-tuning)")
  lora_alpha: float | None = option(None, "LoRA alpha: adapters add alpha / rank x A B; "
                                    "default 2 x rank")
  lora_dropout: float = option(0.0, "LoRA dropout on the adapted weights' inputs")
  lora_targets: str = option("", "LoRA targets: the model's weight names (wq,wk,wv,wo,"
                             "w_gate,w_up,w_down) or regexes over its leaf paths, "
                             "comma-separated; default all of them")
  chat_template: str = option("", "--objective=dpo: a Jinja chat template file; default the "
                              "tokenizer's")
  dpo_beta: float = option(0.1, "DPO's beta (the reference KL penalty's inverse temperature)")
  dpo_label_smoothing: float = option(0.0, "DPO's label smoothing, the fraction of flipped "
                                      "preferences in [0, 0.5): cDPO (sigmoid) or rDPO")
  dpo_loss: str = option("sigmoid", "DPO loss: sigmoid (DPO, cDPO) or robust (rDPO)")
  dpo_pairs: int = option(8, "--objective=dpo: at most this many pairs packed in a row")


@dataclasses.dataclass(frozen=True)
class Options:
  """Every option of train_lm, in groups by job: each option a flag `--name` and a keyword of
  `train_lm`, flat (`cli.leaves`; `Options.of(seq=64)` builds one from them), read in its
  group (`o.data.seq`). None: the platform default."""
  # option -> its range (cli.check_range's minimum / above / maximum)
  RANGES: ClassVar[dict] = {**dict.fromkeys(_POSITIVE, dict(minimum=1)),
                            **dict.fromkeys(_NON_NEGATIVE, dict(minimum=0)),
                            "lr": dict(above=0), "grace_s": dict(above=0),
                            "min_lr_ratio": dict(minimum=0, maximum=1),
                            "lora_alpha": dict(above=0), "dpo_beta": dict(above=0),
                            "lora_dropout": dict(minimum=0, maximum=0.99),
                            "dpo_pairs": dict(minimum=1),
                            "process_id": dict(minimum=-1)}
  # Options that ask for one thing two ways: a run takes one of each pair (`cli`).
  EXCLUSIVE: ClassVar[tuple] = (("global_batch", "batch_size"), ("epochs", "steps"),
                                ("init_from", "model_config"), ("mesh_shape", "topology"))
  # option -> the values it takes (a word of --help is no substitute for a check)
  CHOICES: ClassVar[dict] = {"packing": PACKINGS, "long_docs": LONG_DOCS,
                             "accum_gather": fs.ACCUM_GATHER,
                             "attention": fs.kernels.IMPLEMENTATIONS,
                             "context": fs.parallel.context.FORMS,
                             "context_order": fs.parallel.context.ORDERS,
                             "objective": OBJECTIVES, "dpo_loss": DPO_LOSSES,
                             "tracker": TRACKERS, "remat_policy": ("auto",) + REMAT_POLICIES,
                             "optimizer": OPTIMIZERS, "mu_dtype": MU_DTYPES}
  hardware: HardwareOptions = group(HardwareOptions)
  model: ModelOptions = group(ModelOptions)
  data: DataOptions = group(DataOptions)
  step: StepOptions = group(StepOptions)
  schedule: ScheduleOptions = group(ScheduleOptions)
  ckpt: CheckpointOptions = group(CheckpointOptions)
  log: LogOptions = group(LogOptions)
  tune: FinetuneOptions = group(FinetuneOptions)

  @classmethod
  def of(cls, **options) -> "Options":
    """The options named (flat, as `train_lm`'s keywords), the others their defaults;
    unchecked (`cli.check_options` checks them)."""
    return build(cls, options)


def platform_default(group, name: str, platform: str):
  """Option `name` of `group` (the group of `Options` that holds it), or its default on
  `platform` ("cpu": CPU, else TPU/GPU) where not given (None or "")."""
  given = getattr(group, name)
  if given not in (None, ""):
    return given
  return PLATFORM_DEFAULTS["cpu" if platform == "cpu" else "accelerator"][name]


def schedule_defaults(s: ScheduleOptions, model: str, steps: int) -> ScheduleOptions:
  """`s` with `steps` and the options that follow the run's length and model filled in
  where not given: peak lr by model (`LR`), a schedule of `steps`, warmup a twentieth of the
  schedule (at most 500 steps)."""
  length = steps if s.schedule_steps is None else s.schedule_steps
  return dataclasses.replace(
      s, steps=steps, lr=LR.get(model, DEFAULT_LR) if s.lr is None else s.lr,
      schedule_steps=length, warmup_steps=warmup_default(length) if s.warmup_steps is None
      else s.warmup_steps)


def log_defaults(log: LogOptions, steps: int) -> LogOptions:
  """`log` with the reports that follow the run's length filled in where not given: 25
  progress lines and 5 evals a run of `steps`."""
  return dataclasses.replace(
      log, log_every=max(1, steps // 25) if log.log_every is None else log.log_every,
      eval_every=max(1, steps // 5) if log.eval_every is None else log.eval_every)


def warmup_default(schedule_steps: int) -> int:
  """--warmup_steps where not given: a twentieth of the schedule, 1 to 500 steps."""
  return min(500, max(1, schedule_steps // 20))
