"""train_lm's options: each one's flag `--name`, keyword of `train_lm`, default, `--help`
line and, for a number, its range (`Options.RANGES`, checked by `harness.check_options` and
`harness.parse_flags` before anything runs)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from fnscale.kernels import context_attention
from fnscale.kernels.attention import IMPLEMENTATIONS
from fnscale.multihost import preemption
from fnscale.step import ACCUM_GATHER
from recipes.lm import data, models, packing
from recipes.lm import hardware, harness
from recipes.lm.harness import option

_POSITIVE = ("seq", "batch_size", "global_batch", "epochs", "steps", "accum_steps", "devices",
             "pack_bins", "checkpoint_keep", "log_every", "eval_every", "eval_batches")
_NON_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "max_stalled_steps",
                 "microbatches", "seed", "checkpoint_every", "stop_after", "sample_len",
                 "temperature", "shutdown_delay_s", "num_processes")


@dataclasses.dataclass(frozen=True)
class Options(hardware.Hardware):
  """Every option: a flag `--name` and a keyword of `train_lm`. None: the platform default.
  The hardware options (`--topology`, `--mesh_shape`, `--tpu`) are `hardware.Hardware`'s,
  shared with the benchmarks."""
  # option -> its range (cli.check_range's minimum / above / maximum)
  RANGES: ClassVar[dict] = {**dict.fromkeys(_POSITIVE, dict(minimum=1)),
                            **dict.fromkeys(_NON_NEGATIVE, dict(minimum=0)),
                            "lr": dict(above=0), "grace_s": dict(above=0),
                            "min_lr_ratio": dict(minimum=0, maximum=1),
                            "process_id": dict(minimum=-1)}
  # option -> the values it takes (a word of --help is no substitute for a check)
  CHOICES: ClassVar[dict] = {"packing": packing.PACKINGS, "long_docs": packing.LONG_DOCS,
                             "accum_gather": ACCUM_GATHER,
                             "attention": IMPLEMENTATIONS,
                             "context": context_attention.FORMS,
                             "context_order": context_attention.ORDERS}
  model_config: str | None = option(None, f"model, one of {list(models.MODELS)}; default "
                                  "tiny_gpt2 on CPU, small on TPU/GPU")
  dataset: str = option("stdlib", f"corpus: {list(data.CORPORA)}, a file, directory or glob; "
                        "or token caches (recipes/pretokenize.py): DIR, 'DIR:0.7,DIR2:0.3' "
                        "or a JSON file of weights")
  packing: str = option("first_fit", "token caches: packing of documents into rows, "
                        "first_fit or best_fit")
  pack_bins: int = option(8, "token caches: rows packed at once per row stream")
  long_docs: str = option("split", "token caches: a document longer than a row is split "
                          "into pieces, truncate-d, or an error")
  tokenizer: str = option("", "a Hugging Face tokenizer.json; default: bytes (vocab 256)")
  init_from: str = option("", "a Hugging Face model directory (config.json, safetensors, "
                          "tokenizer.json): continue training its model and weights with "
                          "its tokenizer (instead of --model_config, --tokenizer)")
  export_hf: str = option("", "at the end, write the params as a Hugging Face checkpoint "
                          "(safetensors, config.json, tokenizer) to this directory")
  seq: int | None = option(None, "sequence length in tokens; default 64 on CPU, 1024 TPU/GPU")
  batch_size: int | None = option(None, "rows per data-parallel device; default 8 CPU, 16 TPU")
  global_batch: int | None = option(None, "global batch in rows (instead of batch_size)")
  epochs: int | None = option(None, "passes over the training split (instead of steps)")
  steps: int | None = option(None, "train steps; default 200 on CPU, 5000 on TPU/GPU")
  lr: float | None = option(None, "peak lr of the warmup + cosine schedule; default by size")
  warmup_steps: int | None = option(None, "linear warmup steps; default steps / 20, <= 500")
  min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak")
  weight_decay: float = option(0.1, "AdamW weight decay on weight matrices and embeddings")
  grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
  max_stalled_steps: int = option(20, "stop with an error after this many consecutive steps "
                                  "that left the params unchanged or non-finite, or were "
                                  "skipped for non-finite gradients (float16's loss "
                                  "scale), although the loss was finite (0: never)")
  accum_steps: int = option(1, "gradient accumulation micro-steps per step (splits the batch)")
  accum_gather: str = option("auto", "with accum_steps > 1: 'auto' (reduce once where the "
                             "params are replicated over the data axes, else as "
                             "per_microbatch), 'per_microbatch' (params stay sharded) or "
                             "'once' (whole params on each device)")
  precision: str = option("auto", f"jmp policy, e.g. '{harness.MIXED}', 'float32', 'bfloat16'; "
                        "auto: float32 on CPU, bfloat16 compute elsewhere")
  attention: str = option("auto", "attention: auto, xla, splash, cudnn, pallas_gpu")
  context: str = option("all_gather", "attention over a sequence split by a 'context' mesh "
                        "axis (--mesh=data=2,context=4): all_gather (K/V gathered) or ring")
  context_order: str = option("zigzag", "the order the context shards hold the sequence "
                              "in: zigzag (balanced causal work), striped or contiguous")
  remat: bool = option(False, "recompute each block's activations in the backward pass")
  microbatches: int = option(0, "pipeline microbatches on a mesh with a 'stage' axis "
                             "(Llama models: their layers run as stages); default: the "
                             "stages")
  mesh: str = option("", "mesh axes in a slice, e.g. 'data=-1,fsdp=2,tensor=2' (-1: the "
                     "rest); 'auto': fnscale.analysis.plan's choice of mesh, remat and "
                     "accumulation for this machine; default data=-1 on CPU, fsdp=-1 on "
                     "TPU/GPU")
  dcn: str = option("", "mesh axes across slices (TPU multi-slice), e.g. 'replica=2'; "
                    "default replica=<slices> when the devices span several slices")
  devices: int | None = option(None, "simulated CPU devices (CPU-only machines); default 8")
  seed: int = option(0, "seed of the params init, the data order and sampling")
  run_dir: str = option("", "directory of metrics.jsonl, TensorBoard events, run.json, "
                        "log.txt and checkpoints; default runs/<model>-<dataset> (plus "
                        "-vocab<V> with a tokenizer)")
  profile_steps: str = option("", "START:STOP: JAX profiler trace of these steps into run_dir")
  checkpoint: bool = option(True, "save checkpoints and resume from the newest good one")
  checkpoint_dir: str = option("", "checkpoints (path or gs://...); default RUN_DIR/checkpoints")
  checkpoint_every: int = option(200, "save every this many steps (0: at the end and SIGTERM)")
  checkpoint_keep: int = option(3, "how many checkpoints to keep")
  stop_after: int = option(0, "stop after this step as if preempted (checkpoint saved); 0: off")
  grace_s: float = option(preemption.DEFAULT_GRACE_S, "seconds from a preemption notice "
                          "(SIGTERM) to the end of the process, the final save included; "
                          "keep below the platform's notice (about 30 s on Cloud TPU, GKE)")
  log_every: int | None = option(None, "steps between progress lines; default 25 lines a run")
  eval_every: int | None = option(None, "steps between evals; default 5 evals a run")
  eval_batches: int = option(4, "global batches of held-out text per eval")
  sample_len: int = option(200, "tokens to generate at the end (0: none)")
  prompt: str = option("def ", "prompt of the generated sample")
  temperature: float = option(0.8, "sampling temperature of the sample (0: greedy)")
  compile_cache_dir: str = option("", "persistent XLA compilation cache directory")
  shutdown_at_exit: bool = option(False, "delete this Cloud TPU VM when the job ends")
  shutdown_delay_s: float = option(60.0, "seconds before that shutdown (a sentinel cancels it)")
  shutdown_dry_run: bool = option(False, "print the shutdown request instead of sending it")
  coordinator_address: str = option("", "multi-process: host:port of process 0; default: env "
                                  "JAX_COORDINATOR_ADDRESS or auto-detected (pods, SLURM)")
  num_processes: int = option(0, "multi-process: process count (env JAX_NUM_PROCESSES)")
  process_id: int = option(-1, "multi-process: this process's id (env JAX_PROCESS_ID)")
