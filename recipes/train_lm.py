"""Train a GPT-style byte-level language model on every device the machine (or pod) has.

  python recipes/train_lm.py                      # CPU: 8 simulated devices, `tiny` model
  python recipes/train_lm.py --model=small --mesh="data=-1,fsdp=4"   # a TPU/GPU host or pod

The model is a GPT-2-style decoder written in plain JAX (Radford et al. 2019, "Language Models
are Unsupervised Multitask Learners"): pre-LayerNorm blocks, learned positions, GELU MLP and an
output layer tied to the token embedding. Params are a plain pytree; every leaf carries logical
axis names that fnscale's rules map onto the mesh. Tokens are bytes (vocabulary 256), so any text
works without a tokenizer; the default corpus is the source of the running interpreter's standard
library, which every machine with Python has.

fnscale does the distribution: topology detection, mesh, shardings, the compiled SPMD step, the
global batch assembled from each process's own rows, sharded checkpoints and multi-host
start-up. Everything else (model, data, loop) lives in this file, so it can be copied and edited.

Only process 0 prints and writes files. Rerunning the same command resumes from the newest good
checkpoint in `--run_dir`: the data position is the step number, so a resumed run ends with
bitwise the same params as one that was never stopped.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import signal
import sys
import sysconfig
import time
from typing import Any, NamedTuple

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from fnscale import mesh as fnscale_mesh

# ------------------------------------------------------------------------------------------------
# Model: a GPT-2-style decoder as a plain pytree and pure functions.
# ------------------------------------------------------------------------------------------------

VOCAB = 256  # bytes


class ModelConfig(NamedTuple):
  """Shape of the decoder. d_mlp is 4 * d_model as in GPT-2."""
  layers: int
  d_model: int
  heads: int
  seq: int
  vocab: int = VOCAB

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def d_mlp(self) -> int:
    return 4 * self.d_model


# GPT-2 small and medium shapes (Radford et al. 2019); with a byte vocabulary their embedding
# tables are tiny, so `small` has 86M params rather than GPT-2's 124M (50257-token vocabulary).
SIZES = {
    "nano": dict(layers=2, d_model=64, heads=4),
    "tiny": dict(layers=4, d_model=256, heads=4),
    "small": dict(layers=12, d_model=768, heads=12),
    "medium": dict(layers=24, d_model=1024, heads=16),
}


def model_config(size: str, seq: int) -> ModelConfig:
  if size not in SIZES:
    raise fs.FnscaleError(f"--model={size!r} is not a known size; expected one of {list(SIZES)}")
  cfg = ModelConfig(seq=seq, **SIZES[size])
  return cfg


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Returns float32 params; block params are stacked along a leading `layers` axis for scan.

  Init follows GPT-2: N(0, 0.02) weights, residual output projections scaled by
  1/sqrt(2 * layers), zero biases, unit LayerNorm scales.
  """
  L, D, H, K, F = cfg.layers, cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_mlp
  ks = jax.random.split(key, 6)
  std, res_std = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  ln = lambda: {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))}
  return {
      "wte": normal(ks[0], (cfg.vocab, D), std),
      "wpe": normal(ks[1], (cfg.seq, D), std),
      "blocks": {
          "ln1": ln(),
          "attn": {
              "w_qkv": normal(ks[2], (L, D, 3, H, K), std),
              "b_qkv": jnp.zeros((L, 3, H, K)),
              "w_out": normal(ks[3], (L, H, K, D), res_std),
              "b_out": jnp.zeros((L, D)),
          },
          "ln2": ln(),
          "mlp": {
              "w_fc": normal(ks[4], (L, D, F), std),
              "b_fc": jnp.zeros((L, F)),
              "w_proj": normal(ks[5], (L, F, D), res_std),
              "b_proj": jnp.zeros((L, D)),
          },
      },
      "ln_f": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
  }


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  del cfg
  ln = {"scale": ("layers", "norm"), "bias": ("layers", "norm")}
  return {
      "wte": ("vocab", "embed"),
      "wpe": ("position", "embed"),
      "blocks": {
          "ln1": ln,
          "attn": {
              "w_qkv": ("layers", "embed", "qkv", "heads", "head_dim"),
              "b_qkv": ("layers", "qkv", "heads", "head_dim"),
              "w_out": ("layers", "heads", "head_dim", "embed"),
              "b_out": ("layers", "norm"),
          },
          "ln2": ln,
          "mlp": {
              "w_fc": ("layers", "embed", "mlp"),
              "b_fc": ("layers", "mlp"),
              "w_proj": ("layers", "mlp", "embed"),
              "b_proj": ("layers", "norm"),
          },
      },
      "ln_f": {"scale": ("norm",), "bias": ("norm",)},
  }


# Logical axis -> mesh axes. "embed" over fsdp gives ZeRO-3-style sharded params and optimizer
# state; heads/mlp/vocab over tensor give Megatron-style tensor parallelism (Shoeybi et al. 2019).
RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def _layer_norm(x, p, eps=1e-5):
  # Statistics in float32 whatever the compute dtype, for stability under bfloat16.
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _block(x, p):
  """One pre-LN transformer block. x: [batch, seq, d_model]."""
  # Keep the residual stream split by batch; otherwise GSPMD may follow the FSDP params'
  # d_model sharding and run attention for the whole batch on every device.
  x = fs.constrain_batch(x)
  h = _layer_norm(x, p["ln1"])
  a = p["attn"]
  qkv = jnp.einsum("bsd,dthk->tbshk", h, a["w_qkv"]) + a["b_qkv"][:, None, None]
  o = fs.attention(qkv[0], qkv[1], qkv[2], causal=True)
  x = x + jnp.einsum("bshk,hkd->bsd", o, a["w_out"]) + a["b_out"]
  h = _layer_norm(x, p["ln2"])
  m = p["mlp"]
  h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, m["w_fc"]) + m["b_fc"])
  return x + jnp.einsum("bsf,fd->bsd", h, m["w_proj"]) + m["b_proj"]


def apply(params: dict, tokens: jax.Array, *, remat: bool = False) -> jax.Array:
  """Next-byte logits. tokens: int32 [batch, seq <= cfg.seq] -> float32 [batch, seq, vocab].

  Computes in the dtype of `params` (a precision policy casts them); LayerNorm statistics and
  logits are float32. Blocks run under `lax.scan` over the stacked layer axis (one compiled
  block whatever the depth); `remat=True` recomputes each block's activations in the backward
  pass (`jax.checkpoint`) to trade FLOPs for memory.
  """
  seq = tokens.shape[1]
  x = params["wte"][tokens] + params["wpe"][:seq]
  block = jax.checkpoint(_block) if remat else _block
  x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
  x = _layer_norm(x, params["ln_f"])
  return jnp.einsum("bsd,vd->bsv", x, params["wte"]).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, *, remat: bool = False) -> jax.Array:
  """Mean next-byte cross-entropy in nats. batch: {"inputs", "targets"} int32 [batch, seq]."""
  logits = apply(params, batch["inputs"], remat=remat)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: 12 d^2 per block (qkv, out, 2 MLP) plus the tied
  output layer; embedding lookups and positions are not matmuls."""
  return cfg.layers * 12 * cfg.d_model**2 + cfg.vocab * cfg.d_model


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): `fs.model_flops_per_token` (PaLM appendix
  B) for this model. Remat's recomputation is not counted (MFU, not hardware utilisation)."""
  return fs.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                  d_model=cfg.d_model, seq=cfg.seq)


# ------------------------------------------------------------------------------------------------
# Data: bytes of a text corpus, a deterministic held-out split, rows indexed by step.
# ------------------------------------------------------------------------------------------------


def _default_corpus_files() -> list[str]:
  stdlib = sysconfig.get_paths()["stdlib"]
  files = glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
  skip = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
  return sorted(f for f in files if not any(s in f for s in skip))


def corpus_files(spec: str | None) -> list[str]:
  """Files of the corpus: the stdlib's .py files by default, else a file, directory or glob.

  Raises:
    FnscaleError: nothing at `spec`.
  """
  if not spec:
    files = _default_corpus_files()
    if not files:
      raise fs.FnscaleError(
          f"no .py files under the standard library ({sysconfig.get_paths()['stdlib']}); "
          "pass --data=PATH (a text file, directory or glob)")
    return files
  if os.path.isfile(spec):
    return [spec]
  if os.path.isdir(spec):
    files = [os.path.join(d, f) for d, _, fs_ in os.walk(spec) for f in fs_]
  else:
    files = glob.glob(os.path.expanduser(spec), recursive=True)
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    kind = ("directory has no files" if os.path.isdir(spec)
            else "no such file, directory or glob match")
    raise fs.FnscaleError(f"--data={spec!r}: {kind}; pass a text file, a directory or a glob")
  return files


def load_corpus(spec: str | None) -> np.ndarray:
  """All bytes of the corpus as uint8 [n], files in sorted order joined by newlines.

  Raises:
    FnscaleError: missing or empty corpus.
  """
  parts = []
  for f in corpus_files(spec):
    with open(f, "rb") as fh:
      data = fh.read()
    if data:
      parts.append(data)
  if not parts:
    raise fs.FnscaleError(f"--data={spec!r}: the corpus is empty (0 bytes); "
                          "pass a non-empty text file, directory or glob")
  return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


EVAL_EVERY_NTH_CHUNK = 20  # 5% held out


def split_corpus(corpus: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic train/eval split: every 20th chunk (64 KiB, or 1/20 of a small corpus).

  Interleaved chunks make the held-out text representative of the whole corpus.

  Raises:
    FnscaleError: either split is shorter than seq + 1 bytes.
  """
  chunk = max(1, min(65536, len(corpus) // EVAL_EVERY_NTH_CHUNK))
  pieces = [corpus[i:i + chunk] for i in range(0, len(corpus), chunk)]
  is_eval = lambda i: i % EVAL_EVERY_NTH_CHUNK == EVAL_EVERY_NTH_CHUNK - 1
  train = np.concatenate([c for i, c in enumerate(pieces) if not is_eval(i)])
  evals = np.concatenate([c for i, c in enumerate(pieces) if is_eval(i)] or [corpus[:0]])
  short = min(len(train), len(evals))
  if short < seq + 1:
    raise fs.FnscaleError(
        f"--seq={seq} is longer than the data: the corpus has {len(corpus)} bytes, of which "
        f"{len(train)} train and {len(evals)} held out (every {EVAL_EVERY_NTH_CHUNK}th chunk); "
        f"each split needs at least seq + 1 = {seq + 1} bytes. Use a smaller --seq or more data")
  return train, evals


def _windows(data: np.ndarray, starts: np.ndarray, seq: int) -> dict:
  idx = starts[:, None] + np.arange(seq + 1)[None, :]
  rows = data[idx].astype(np.int32)
  return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def batch_starts(n: int, seq: int, global_batch: int, seed: int, step: int) -> np.ndarray:
  """Window starts of every row of the global batch at `step`: int64 [global_batch].

  A pure function of (seed, step), so every process agrees on the global batch and the data
  position of a run is just its step number.
  """
  rng = np.random.default_rng([seed, step])
  return rng.integers(0, n - seq, size=global_batch)


def local_rows(sharding, global_batch: int) -> np.ndarray:
  """Rows of the global batch that this process's devices hold, in order."""
  index_map = sharding.addressable_devices_indices_map((global_batch, 1))
  rows = set()
  for idx in index_map.values():
    rows.update(range(*idx[0].indices(global_batch)))
  return np.array(sorted(rows), dtype=np.int64)


def local_batch(data: np.ndarray, seq: int, global_batch: int, seed: int, step: int,
                rows: np.ndarray) -> dict:
  """This process's rows of the global batch at `step`: {"inputs", "targets"} int32."""
  starts = batch_starts(len(data), seq, global_batch, seed, step)[rows]
  return _windows(data, starts, seq)


# ------------------------------------------------------------------------------------------------
# Generation: sampling with a sliding window, one jitted loop.
# ------------------------------------------------------------------------------------------------


def generate(params: dict, prompt: bytes, length: int, *, seq: int, temperature: float,
             seed: int, attention: str = "auto") -> bytes:
  """Continues `prompt` by `length` bytes: greedy when temperature == 0, else sampled.

  Each new byte is predicted from the last `seq` bytes (a sliding window; a byte model this
  small needs no KV cache), all in one jitted `lax.fori_loop`. Every process must call it
  (params may be sharded across processes); all get the same bytes.
  """
  prompt = (prompt or b"\n")[-seq:]
  p = len(prompt)
  total = max(seq, p + length)
  buf = np.zeros((1, total), np.int32)
  buf[0, :p] = np.frombuffer(prompt, np.uint8)
  mesh = jax.tree.leaves(params)[0].sharding.mesh

  def _run(params):
    def body(pos, carry):
      tokens, key = carry
      start = jnp.clip(pos - seq, 0, total - seq)
      window = jax.lax.dynamic_slice(tokens, (0, start), (1, seq))
      logits = apply(params, window)[0]
      logits = jax.lax.dynamic_index_in_dim(logits, pos - 1 - start, keepdims=False)
      key, sub = jax.random.split(key)
      if temperature > 0:
        nxt = jax.random.categorical(sub, logits / temperature)
      else:
        nxt = jnp.argmax(logits)
      return tokens.at[0, pos].set(nxt.astype(jnp.int32)), key

    init = (jnp.asarray(buf), jax.random.key(seed))
    return jax.lax.fori_loop(p, p + length, body, init)[0]

  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  run = jax.jit(fs.with_kernel(_run, attention=attention), out_shardings=replicated)
  out = np.asarray(run(params).addressable_data(0))
  return out[0, p:p + length].astype(np.uint8).tobytes()


# ------------------------------------------------------------------------------------------------
# Configuration: absl flags -> an immutable Config.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on; None means "the default for this platform" (see _resolve)."""
  model: str | None = None
  seq: int | None = None
  per_device_batch: int | None = None
  batch: int | None = None
  steps: int | None = None
  lr: float | None = None
  warmup_steps: int | None = None
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  accum_steps: int = 1
  precision: str = "auto"
  attention: str = "auto"
  remat: bool = False
  mesh: str = ""
  mesh_shape: str = ""
  dcn: str = ""
  topology: str = ""
  devices: int | None = None
  data: str = ""
  seed: int = 0
  run_dir: str = "runs/train_lm"
  checkpoint: bool = True
  checkpoint_dir: str = ""
  checkpoint_every: int = 200
  checkpoint_keep: int = 3
  stop_after: int = 0
  log_every: int | None = None
  eval_every: int | None = None
  eval_batches: int = 4
  sample_len: int = 200
  prompt: str = "def "
  temperature: float = 0.8
  compile_cache_dir: str = ""
  shutdown_at_exit: bool = False
  shutdown_delay_s: float = 60.0
  shutdown_dry_run: bool = False
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1


_HELP = {
    "model": f"model size, one of {list(SIZES)}; default tiny on CPU, small on TPU/GPU",
    "seq": "sequence length in bytes; default 128 on CPU, 1024 on TPU/GPU",
    "per_device_batch": "rows per data-parallel device (global batch = this x data-parallel "
                        "devices, as in Levanter); default 4 on CPU, 16 on TPU/GPU",
    "batch": "global batch in rows (overrides --per_device_batch)",
    "steps": "train steps; default 500 on CPU, 5000 on TPU/GPU",
    "lr": "peak learning rate of the warmup + cosine schedule; default by model size",
    "warmup_steps": "linear warmup steps; default steps / 20, at most 500",
    "min_lr_ratio": "final learning rate as a fraction of the peak",
    "weight_decay": "AdamW weight decay on weight matrices and embeddings",
    "grad_clip": "clip the global gradient norm to this (0: off)",
    "accum_steps": "gradient accumulation micro-steps per step (the global batch is split)",
    "precision": "jmp policy, e.g. 'params=float32,compute=bfloat16,output=float32', or "
                 "'float32' / 'bfloat16'; auto: float32 on CPU, bfloat16 compute elsewhere",
    "attention": "attention implementation: auto, xla, splash, cudnn, pallas_gpu",
    "remat": "recompute each block's activations in the backward pass (saves memory)",
    "mesh": "mesh axes within a slice, e.g. 'data=-1,fsdp=2,tensor=2' (-1: the rest); "
            "default 'data=-1' on CPU (fastest for the tiny model), 'fsdp=-1' on TPU/GPU",
    "mesh_shape": "sizes of the --mesh axes in order, e.g. '2x4' (overrides their sizes)",
    "dcn": "mesh axes across slices (TPU multi-slice), e.g. 'replica=2'",
    "topology": "hardware override for topology detection, e.g. 'v5p:2x2x2' or 'v5p-16'",
    "devices": "simulated CPU devices (set before jax starts; CPU-only machines); default 8",
    "data": "text corpus: a file, directory or glob; default the Python stdlib's .py files",
    "seed": "seed of the params init, the data order and sampling",
    "run_dir": "directory for metrics.jsonl and (by default) checkpoints",
    "checkpoint": "save checkpoints and resume from the newest good one",
    "checkpoint_dir": "checkpoint directory (a path or gs://...); default RUN_DIR/checkpoints",
    "checkpoint_every": "save every this many steps (0: only at the end and on SIGTERM)",
    "checkpoint_keep": "how many checkpoints to keep",
    "stop_after": "stop after this step as if preempted (checkpoint saved); 0: off",
    "log_every": "steps between progress lines; default about 25 lines per run",
    "eval_every": "steps between evals; default about 5 evals per run",
    "eval_batches": "global batches of held-out text per eval",
    "sample_len": "bytes to generate at the end (0: none)",
    "prompt": "prompt of the generated sample",
    "temperature": "sampling temperature of the sample (0: greedy)",
    "compile_cache_dir": "persistent XLA compilation cache directory (empty: off)",
    "shutdown_at_exit": "on a Cloud TPU VM, delete the VM (or its queued resource) when the "
                        "job ends (fnscale.shutdown_at_exit)",
    "shutdown_delay_s": "seconds to wait before the shutdown (a sentinel file cancels it)",
    "shutdown_dry_run": "print the shutdown request instead of sending it",
    "coordinator_address": "multi-process: host:port of process 0 (env "
                           "JAX_COORDINATOR_ADDRESS); empty: auto-detect (pods, SLURM)",
    "num_processes": "multi-process: number of processes (env JAX_NUM_PROCESSES)",
    "process_id": "multi-process: this process's id (env JAX_PROCESS_ID)",
}


def _given(value, default):
  """A flag's value, or the platform default when it was not given (None); 0 is a value."""
  return default if value is None else value


def _define_flags(fv: flags.FlagValues) -> None:
  for f in dataclasses.fields(Config):
    default, kind = f.default, f.type.replace(" | None", "")
    if kind == "bool":
      flags.DEFINE_boolean(f.name, default, _HELP[f.name], flag_values=fv)
    elif kind == "int":
      flags.DEFINE_integer(f.name, default, _HELP[f.name], flag_values=fv)
    elif kind == "float":
      flags.DEFINE_float(f.name, default, _HELP[f.name], flag_values=fv)
    else:
      flags.DEFINE_string(f.name, default, _HELP[f.name], flag_values=fv)


def parse_flags(argv: list[str]) -> Config:
  """absl flags (argv[0] is the program name) -> Config. Raises FnscaleError on a bad flag."""
  fv = flags.FlagValues()
  _define_flags(fv)
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    raise fs.FnscaleError(f"{e}; see --help") from None
  if len(rest) > 1:
    raise fs.FnscaleError(f"unexpected arguments {rest[1:]}; flags are written --name=value")
  return Config(**{f.name: fv[f.name].value for f in dataclasses.fields(Config)})


def _env_int(name: str, default: int) -> int:
  try:
    return int(os.environ.get(name, default))
  except ValueError:
    raise fs.FnscaleError(f"environment variable {name}={os.environ[name]!r} is not an int")


# ------------------------------------------------------------------------------------------------
# The run.
# ------------------------------------------------------------------------------------------------

_ACCEL_DEFAULTS = dict(model="small", seq=1024, per_device_batch=16, steps=5000, mesh="fsdp=-1")
_CPU_DEFAULTS = dict(model="tiny", seq=128, per_device_batch=4, steps=500, mesh="data=-1")
_LR = {"nano": 3e-3, "tiny": 3e-3, "small": 6e-4, "medium": 3e-4}
_MIXED = "params=float32,compute=bfloat16,output=float32"


def _cpu_device_count(cfg: Config) -> int:
  if cfg.devices is not None:
    return cfg.devices
  m = [f for f in os.environ.get("XLA_FLAGS", "").split()
       if f.startswith("--xla_force_host_platform_device_count=")]
  if m:
    return int(m[-1].split("=", 1)[1])
  if os.environ.get("JAX_NUM_CPU_DEVICES"):
    return _env_int("JAX_NUM_CPU_DEVICES", 8)
  return 8


def _setup_devices(cfg: Config) -> None:
  """Simulated CPU devices and multi-process start-up; before anything touches a device."""
  fs.simulate_cpu_devices(_cpu_device_count(cfg))
  if cfg.compile_cache_dir:
    fs.compilation_cache(cfg.compile_cache_dir)
  # Flags not given come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
  # (launch_local.py) or the pod/SLURM environment; one process is a no-op.
  fs.initialize(cfg.coordinator_address or None, cfg.num_processes or None,
                cfg.process_id if cfg.process_id >= 0 else None)


def _policy(precision: str, platform: str):
  import jmp  # pylint: disable=import-outside-toplevel
  if precision == "auto":
    precision = "float32" if platform == "cpu" else _MIXED
  elif precision in ("bfloat16", "bf16"):
    precision = _MIXED
  if precision in ("float32", "f32"):
    return None
  try:
    return jmp.get_policy(precision)
  except ValueError as e:
    raise fs.FnscaleError(f"--precision={precision!r} is not a jmp policy ({e}); write e.g. "
                          f"'{_MIXED}', 'float32' or 'bfloat16'") from None


def _optimizer(cfg: Config, steps: int, lr: float, warmup: int):
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
      end_value=lr * cfg.min_lr_ratio)
  # Decay weight matrices and embeddings ("w*" leaves), not biases or LayerNorm params.
  decay = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: str(getattr(path[-1], "key", "")).startswith("w"), params)
  chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  chain.append(optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                           mask=decay))
  return optax.chain(*chain), schedule


def _mesh_axes(cfg: Config, default: str) -> dict[str, int]:
  axes = fs.parse_axes(cfg.mesh or default, what="--mesh")
  if cfg.mesh_shape:
    sizes = fs.parse_shape(cfg.mesh_shape)
    if len(sizes) != len(axes):
      raise fs.MeshError(f"--mesh_shape={cfg.mesh_shape!r} has {len(sizes)} sizes but --mesh="
                         f"{cfg.mesh or default!r} has {len(axes)} axes {list(axes)}; give one "
                         "size per axis")
    axes = dict(zip(axes, sizes))
  return axes


def _fmt_time(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


class _Preempted:
  """SIGTERM (a preemption notice) sets `requested`; the loop checkpoints and stops."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: no handler
      self._old = None
    return self

  def _handle(self, signum, frame):
    del frame
    if self.requested:  # a second SIGTERM: stop now, without a checkpoint
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def run(cfg: Config) -> dict[str, Any]:
  """Trains per `cfg`; returns a summary dict (see the end) and the final state.

  Raises:
    FnscaleError (or a subclass): any bad input, before anything is traced.
  """
  t_start = time.time()
  _setup_devices(cfg)
  main_process = jax.process_index() == 0
  say = (lambda *a: print(*a, flush=True)) if main_process else (lambda *a: None)
  if cfg.shutdown_at_exit:
    plan = fs.shutdown_at_exit(cfg.shutdown_delay_s, cfg.shutdown_dry_run)
    say(f"shutdown at exit ({cfg.shutdown_delay_s:g} s after the end"
        + (", dry run" if cfg.shutdown_dry_run else "") + f"): {fs.cloud.describe(plan)}")

  topo = fs.detect_topology(override=cfg.topology or None)
  defaults = _CPU_DEFAULTS if topo.platform == "cpu" else _ACCEL_DEFAULTS
  size = cfg.model or defaults["model"]
  seq = _given(cfg.seq, defaults["seq"])
  steps = cfg.steps if cfg.steps is not None else defaults["steps"]
  if seq < 1 or steps < 0 or cfg.accum_steps < 1:
    raise fs.FnscaleError(f"--seq={seq}, --steps={steps}, --accum_steps={cfg.accum_steps}: "
                          "expected seq >= 1, steps >= 0, accum_steps >= 1")
  mcfg = model_config(size, seq)
  mesh = fs.make_mesh(_mesh_axes(cfg, defaults["mesh"]), dcn=cfg.dcn or None, topology=topo)
  dp_axes = fs.data_axes(mesh)
  dp = math.prod(mesh.shape[a] for a in dp_axes)
  per_device = _given(cfg.per_device_batch, defaults["per_device_batch"])
  global_batch = _given(cfg.batch, per_device * dp)
  if per_device < 1 or global_batch < 1:
    raise fs.FnscaleError(f"--per_device_batch={per_device}, --batch={global_batch}: both must "
                          "be >= 1")
  if global_batch % (dp * cfg.accum_steps):
    raise fs.ShardingError(
        f"global batch {global_batch} does not divide over the data axes: the mesh "
        f"{dict(mesh.shape)} splits the batch {dp} ways over {dp_axes}"
        + (f" in each of {cfg.accum_steps} accumulation steps" if cfg.accum_steps > 1 else "")
        + f"; use --batch a multiple of {dp * cfg.accum_steps} (or --per_device_batch)")
  lr = _given(cfg.lr, _LR[size])
  warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(500, max(1, steps // 20))
  log_every = _given(cfg.log_every, max(1, steps // 25))
  eval_every = _given(cfg.eval_every, max(1, steps // 5))
  if lr <= 0 or log_every < 1 or eval_every < 1:
    raise fs.FnscaleError(f"--lr={lr}, --log_every={log_every}, --eval_every={eval_every}: "
                          "expected lr > 0 and intervals >= 1")

  # Data: every process reads the corpus; each builds only its own rows of each batch.
  t = time.time()
  corpus = load_corpus(cfg.data or None)
  train_data, eval_data = split_corpus(corpus, seq)
  t_data = time.time() - t

  policy = _policy(cfg.precision, topo.platform)
  optimizer, schedule = _optimizer(cfg, steps, lr, warmup)
  axes = logical_axes(mcfg)
  loss = functools.partial(loss_fn, remat=cfg.remat)
  step_fn = fs.train_step(loss, optimizer, policy=policy, accum_steps=cfg.accum_steps)
  step_fn = fs.shard_step(fs.with_kernel(step_fn, attention=cfg.attention), mesh, rules=RULES,
                          logical_axes=axes)
  bsh = fs.batch_sharding(mesh)
  rows = local_rows(bsh, global_batch)

  def batch_at(step):
    return fs.global_batch(local_batch(train_data, seq, global_batch, cfg.seed, step, rows), bsh)

  eval_batches = [
      fs.global_batch(local_batch(eval_data, seq, global_batch, cfg.seed + 1, i, rows), bsh)
      for i in range(cfg.eval_batches)]

  def _eval_loss(params, batch):
    if policy is not None:
      params = policy.cast_to_compute(params)
    return loss_fn(params, batch)

  eval_loss = jax.jit(fs.with_kernel(_eval_loss, attention=cfg.attention))
  one_host_cpu = topo.platform == "cpu"

  if topo.platform == "cpu":
    peak_total = fs.measure_matmul_peak() * jax.process_count()
    peak_note = (f"MFU denominator: measured CPU matmul peak {peak_total / 1e9:.0f} GFLOP/s, "
                 f"shared by all {jax.device_count()} simulated devices (one host's cores)")
  elif topo.peak_flops_per_device:
    peak_total = topo.peak_flops_per_device * jax.device_count()
    peak_note = (f"MFU denominator: {topo.peak_flops_per_device / 1e12:.0f} TFLOP/s bf16 peak x "
                 f"{jax.device_count()} devices")
  else:
    peak_total = None
    peak_note = "MFU: unknown peak FLOP/s for this device kind; MFU not reported"

  with fs.with_mesh(mesh):
    init_fn = functools.partial(init_params, mcfg)
    init = functools.partial(fs.init_state, init_fn, optimizer, mesh=mesh, rules=RULES,
                             logical_axes=axes, policy=policy, key=jax.random.key(cfg.seed))
    # Resume from the newest good checkpoint (a damaged newer one is refused and kept).
    ckpt_dir = cfg.checkpoint_dir or os.path.join(cfg.run_dir, "checkpoints")
    start, resumed = 0, None
    on_disk = _step_dirs_on_disk(ckpt_dir) if cfg.checkpoint else []
    if on_disk:
      state, extra = fs.checkpoint.restore(ckpt_dir, init(abstract=True))
      start = resumed = int(extra["step"])
      refused = [s for s in on_disk if s > start]
      if refused:
        say(f"checkpoint: refused step(s) {refused} in {ckpt_dir} (incomplete or corrupt; "
            "left as they are); resuming from the newest good one")
      _check_resume(extra, cfg, corpus, global_batch, say)
    else:
      state = init()

    # Start summary.
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    say(f"fnscale train_lm: model {size} ({mcfg.layers} layers, d_model {mcfg.d_model}, "
        f"{mcfg.heads} heads, seq {seq}), {n_params / 1e6:.2f}M params")
    say(f"topology: {topo}")
    say(fnscale_mesh.describe(mesh))
    report = fs.sharding_report(state, jax.tree.map(lambda x: x.sharding, state))
    say("train state: " + report.splitlines()[-1].strip())
    say(f"batch: {global_batch} rows x {seq} bytes = {global_batch * seq} tokens/step "
        f"({global_batch // dp} per data-parallel device x {dp} over {dp_axes})"
        + (f", {cfg.accum_steps} accumulation steps" if cfg.accum_steps > 1 else ""))
    say(f"data: {cfg.data or 'Python standard library (' + sysconfig.get_paths()['stdlib'] + ')'}"
        f": {len(corpus) / 1e6:.1f} MB, {len(train_data) / 1e6:.1f} MB train, "
        f"{len(eval_data) / 1e6:.2f} MB held out (read in {t_data:.1f} s)")
    say(f"schedule: {steps} steps, peak lr {lr:g}, warmup {warmup}, cosine to "
        f"{lr * cfg.min_lr_ratio:g}; precision {cfg.precision}"
        + (f" ({policy})" if policy is not None else " (float32)"))
    if resumed is not None:
      say(f"resumed from step {resumed} ({ckpt_dir})")

    first = batch_at(start)
    step_fn = step_fn.compile(state, first)  # ahead of time: step 0 doesn't compile again
    creport = fs.compile_report(step_fn, state, first)
    t_compile = creport.compile_seconds
    say("compile: " + str(creport).replace("\n", "\n  "))
    say(peak_note)

    flops_step = flops_per_token(mcfg) * global_batch * seq

    metrics_file = None
    if main_process:
      os.makedirs(cfg.run_dir, exist_ok=True)
      metrics_file = open(os.path.join(cfg.run_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def record(**kv):
      if metrics_file is not None:
        metrics_file.write(json.dumps(kv) + "\n")
        metrics_file.flush()

    def evaluate(step):
      # All devices finish each eval program (not just the one a scalar is read from).
      losses = [float(jax.block_until_ready(eval_loss(state.params, b))) for b in eval_batches]
      value = float(np.mean(losses))
      say(f"eval  step {step:>6}: loss {value:.4f} nats/byte, {value / math.log(2):.4f} "
          "bits/byte")
      record(event="eval", step=step, eval_loss=value, bits_per_byte=value / math.log(2),
             time=time.time() - t_start)
      return value

    record(event="start", step=start, model=size, params=n_params, seq=seq,
           global_batch=global_batch, mesh=dict(mesh.shape), devices=jax.device_count(),
           processes=jax.process_count(), compile_s=t_compile, resumed_from=resumed,
           peak_flops=peak_total, flops_per_step=flops_step)

    last_saved = resumed
    eval_value = None
    if start == 0:
      eval_value = evaluate(0)

    def save(step):
      nonlocal last_saved
      if not cfg.checkpoint or last_saved == step:
        return
      t = time.time()
      fs.checkpoint.save(ckpt_dir, step, state,
                         extra={"step": step, "seed": cfg.seed, "model": size, "seq": seq,
                                "global_batch": global_batch, "corpus_bytes": len(corpus)},
                         keep=cfg.checkpoint_keep)
      last_saved = step
      say(f"checkpoint: saved step {step} in {time.time() - t:.1f} s ({ckpt_dir})")

    loss_value, tok_s, mfu, stopped = None, None, None, None
    t_train = time.time()
    t_mark, step_mark = None, start
    batch = first
    with _Preempted() as preempt:
      for step in range(start, steps):
        state, m = step_fn(state, batch)
        done = step + 1
        if one_host_cpu:
          # Simulated devices share one pool of host threads: with several steps in flight,
          # threads can all be held by steps waiting for inputs while a straggler device
          # of the current step waits for a thread, and XLA's CPU collectives deadlock.
          # One step in flight costs little on CPU (no host/device overlap to lose).
          jax.block_until_ready((state, m))
        if done < steps:
          batch = batch_at(done)  # built while the device runs this step
        if t_mark is None:  # the first step's time includes dispatch warm-up: start after it
          jax.block_until_ready(m["loss"])
          t_mark, step_mark = time.time(), done
        if done % log_every == 0 or done == steps:
          loss_value = float(m["loss"])
          now = time.time()
          if done > step_mark:
            dt = (now - t_mark) / (done - step_mark)
            tok_s = global_batch * seq / dt
            mfu = flops_step / dt / peak_total if peak_total else None
            eta = dt * (steps - done)
          else:
            dt, eta = None, None
          t_mark, step_mark = now, done
          say(f"step {done:>6}/{steps}  loss {loss_value:.4f}  lr {float(schedule(done)):.2e}"
              + (f"  {tok_s:,.0f} tok/s" if tok_s else "")
              + (f"  MFU {100 * mfu:.1f}%" if mfu is not None else "")
              + (f"  ETA {_fmt_time(eta)}" if eta is not None else ""))
          record(event="train", step=done, loss=loss_value, grad_norm=float(m["grad_norm"]),
                 lr=float(schedule(done)), tokens_per_s=tok_s, mfu=mfu,
                 time=time.time() - t_start)
          if not np.isfinite(loss_value):
            raise fs.StepError(f"loss is {loss_value} at step {done}; lower --lr or use "
                               "--precision=float32")
        paused = False
        if done % eval_every == 0 and done < steps:
          eval_value, paused = evaluate(done), True
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < steps:
          save(done)
          paused = True
        if paused:  # keep eval and checkpoint time out of tokens/s
          t_mark, step_mark = time.time(), done
        stop_signal = preempt.requested
        if jax.process_count() > 1 and done % log_every == 0:
          stop_signal = _any_process(stop_signal)
        if (cfg.stop_after and done == cfg.stop_after and done < steps) or (
            stop_signal and done < steps):
          stopped = "SIGTERM" if stop_signal else f"--stop_after={cfg.stop_after}"
          save(done)
          say(f"stopped at step {done} ({stopped}); rerun the same command to resume")
          break
    train_s = time.time() - t_train
    final_step = int(state.step)

    sample = None
    if not stopped:
      if last_saved != final_step:
        save(final_step)
      eval_value = evaluate(final_step)
      if cfg.sample_len > 0:
        t = time.time()
        sample = generate(state.params, cfg.prompt.encode(), cfg.sample_len, seq=seq,
                          temperature=cfg.temperature, seed=cfg.seed, attention=cfg.attention)
        say(f"sample ({cfg.sample_len} bytes, temperature {cfg.temperature}, "
            f"{time.time() - t:.1f} s):\n{'-' * 60}\n"
            f"{(cfg.prompt.encode() + sample).decode('utf-8', errors='replace')}\n{'-' * 60}")

    summary = dict(
        final_step=final_step, start_step=start, resumed_from=resumed, stopped=stopped,
        loss=loss_value, eval_loss=eval_value,
        bits_per_byte=None if eval_value is None else eval_value / math.log(2),
        tokens_per_s=tok_s, mfu=mfu, compile_s=t_compile, train_s=train_s,
        wall_s=time.time() - t_start, params=n_params, global_batch=global_batch, seq=seq,
        mesh=dict(mesh.shape), devices=jax.device_count(), processes=jax.process_count(),
        sample=None if sample is None else sample.decode("utf-8", errors="replace"))
    record(event="summary", **summary)
    if metrics_file is not None:
      metrics_file.close()
    say(f"done: step {final_step}, last eval loss {eval_value:.4f} nats/byte, "
        f"{train_s:.0f} s training, {summary['wall_s']:.0f} s total"
        if eval_value is not None else f"done: step {final_step}")
  summary["state"] = state
  return summary


def _step_dirs_on_disk(directory: str) -> list[int]:
  """Integer step directories present (good or not); [] for a missing directory."""
  if "://" in directory or not os.path.isdir(directory):
    return list(fs.checkpoint.steps(directory)) if "://" in directory else []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and os.path.isdir(os.path.join(directory, d)))


def _check_resume(extra, cfg, corpus, global_batch, say):
  """A resumed run continues the same data order only with the same seed, corpus and batch."""
  changed = [f"{k} {extra.get(k)} -> {v}" for k, v in
             (("seed", cfg.seed), ("corpus_bytes", len(corpus)), ("global_batch", global_batch))
             if extra.get(k) is not None and extra.get(k) != v]
  if changed:
    say("warning: resuming with a different " + ", ".join(changed) +
        "; the data order differs from the original run")


def main(argv: list[str]) -> int:
  """Command-line entry point: parse flags, run, report errors in one line. Returns the exit
  status (0 done, 2 bad input or a refused checkpoint, 143 stopped by SIGTERM)."""
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    fv = flags.FlagValues()
    _define_flags(fv)
    print(__doc__ + "\nflags:\n" + fv.get_help())
    return 0
  try:
    summary = run(parse_flags(argv))
  except fs.FnscaleError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  return 143 if summary["stopped"] == "SIGTERM" else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
