"""fnscale's train step on the chip, beside a plain-JAX peer: tokens/s, MFU, HBM, time split.

  python recipes/bench/chip.py --case=gpt-nano,peer=1          # CPU, tiny: a few seconds
  python recipes/bench/chip.py --topology=v5e:1x1 --case=gpt-small,peer=1,profile=1 \\
      --case=gpt-medium,peer=1 --case=llama,peer=1 --json=chip.json
  python recipes/bench/chip.py --search_splash=16x12x12x1024x64   # splash tiles, TPU

Each `--case=BASE[,KEY=VALUE...]` is one row: a base shape (`BASES`: train_lm's GPT small
and medium, the one-chip Llama `llama-766m`, the Llama 3.2 1B and 3B shapes `llama-1b`,
`llama-3b`, and tiny CPU ones) with levers changed: batch, seq, remat (a policy of
`recipes.lm.remat`), int8 (0/1: `recipes.lm.int8`), unroll (0/1: the layer loop unrolled),
params / mu (float32 or bfloat16: the param dtype of the jmp policy, AdamW's first-moment
dtype), opt (adamw or adafactor: train_lm's `--optimizer`, `recipes.lm.optimizers`),
offload (0/1: the optimizer state in the host's memory between steps, train_lm's
`--optimizer_offload`; fnscale's side only),
loss_chunk (tokens per chunk of the Llama's loss), blocks (splash tiles q/kv/q_bwd/kv_bwd,
e.g. 1024/512/512/512), xla ("maxtext": the XLA flags MaxText sets for v5e,
`MAXTEXT_V5E`), accum (microbatches);
peer=1 times the plain-JAX step too; hand=1 times train_lm's own model under that
hand-written step (`hand_side`: fnscale / by hand is the wrapper's cost, by hand / plain JAX
the model code's; not with accum); attn (xla or splash: every side's attention kernel;
default splash on TPU); profile=1 traces 3 steps of each side and prints their time splits
(`recipes/bench/trace_split.py`); loss_steps=N trains N steps on byte-level text (the
Python standard library's sources) from a fixed init and data order and reports the loss.

The fnscale side is train_lm's: its model (`recipes.lm`), `fnscale.train_step` under a jmp
policy (params in `params`, compute bf16, output f32), `with_kernel` (splash on TPU, XLA's
attention elsewhere) and `shard_step` over a mesh of every device ("fsdp"); the state is
born by `fnscale.init_state`. The peer (`recipes/bench/plain_jax.py`) imports nothing from
fnscale or recipes/lm: its own model code with the same shapes, param names, dtypes,
optimizer and attention kernel (and tiles), plain `value_and_grad`, optax and `jax.jit`
with donation. It has the levers that are plain JAX (remat policies none/full/dots/
qkv_attn, unroll, loss chunk, splash tiles, XLA flags, batch, the param and AdamW moment
dtypes, the optimizer: it runs on the same state with the same optax optimizer); int8,
accumulation and the other remat policies are fnscale-side levers only (a case with one
runs no peer).

Both steps share one state (the same buffers, donated back and forth: one copy in HBM) and
one batch of random tokens, and run alternately in one process: `--rounds` rounds of
`--steps` steps, fnscale first in even rounds, the peer first in odd ones, each group
synchronised; the step time is the median over rounds of a group's time per step.

- tokens/s = batch x seq / step time.
- MFU (PaLM, Chowdhery et al. 2022, appendix B) = (6 N + 12 L d seq) x tokens/s / peak, N
  the matmul weights (`recipes.lm` models' `flops_per_token`), peak the chip's dense bf16
  FLOP/s from fnscale's chip facts (TPU v5e: 197 TFLOP/s per chip); on CPU the host's
  measured matmul rate (`fnscale.analysis.host_matmul_peak`).
- HBM: the compiled program's arguments + outputs - aliased + temporaries
  (`memory_analysis`), per device. (The TPU allocator's `memory_stats` peak leaves the
  program's temporaries out: 1 GiB for a 15.6 GiB program.)

`--aot=v5e:1x1` compiles each case for a described chip here (no TPU needed) and reports
the program's HBM only. `--json=PATH` writes every row.

Measured on one TPU v5e (2026-12-05, JAX 0.10.2, libtpu 0.0.42.1; `--rounds=3 --steps=2
--warmup=1`, one process; splash then with two backward kernels and 512 tiles), fnscale's
step, tokens/s, MFU, program HBM (recipes/bench/chip_v5e.json holds the rows):

| case | tokens/s | MFU | HBM GiB |
|---|---|---|---|
| gpt-small (16 x 1024, no remat) | 93.3k | 29.6% | 15.60 |
| gpt-small,remat=dots,batch=32 (splash's forward run once: 2026-12-06) | 126.8k | 40.2% | 11.59 |
| gpt-medium (32 x 1024, full remat) | 34.2k | 36.7% | 9.84 |
| gpt-medium,remat=qkv,batch=24 | 37.5k | 40.3% | 15.29 |
| gpt-medium,remat=dots,batch=12 | 40.6k | 43.6% | 13.85 |
| llama (8 x 2048, full remat), 64-token loss chunks | 9.6k | 24.4% | 15.32 |
| llama,loss_chunk=1024 | 22.8k | 57.9% | 15.32 |
| llama,mu=bfloat16,remat=qkv_attn,batch=4,loss_chunk=1024 | 23.6k | 59.8% | 13.25 |

Compiled for v5e:1x1 (`--aot=v5e:1x1`), program HBM in GiB of the 15.75 the chip's
compiler allows, Llama 3.2 1B (1236M params) at 2048 tokens a row, full remat, 1024-token
loss chunks: AdamW's float32 state never fits (the compiler refuses 8 rows: 21.3 GiB of
temporaries; with its first moment in bfloat16 19.0 at 8 rows, 16.8 at 2); Adafactor: 12.26 (2 rows), 13.68 (4), 15.14 (6),
16.59 (8, over), and 12.43 at 8 rows with bfloat16 params. AdamW's float32 state in the
host's memory (offload=1, `--case=llama-1b,opt=adamw,offload=1`): 13.76 (4 rows), 13.79 (6),
14.45 (8), the device holding a layer's slice of the moments at a time; on the chip 8 rows
ran 5.4k tokens/s, 22.4% MFU (2026-12-07): the state's trips to the host bound the step. Llama 3.2 3B
(3213M) fits only with Adafactor and bfloat16 params: 14.86 at 2 rows.

Time split of the first three (profile=1): gpt-small matmul 44.7%, attention 21.8%,
elementwise 33.5%; gpt-medium 54.3 / 27.6 / 18.2% (full remat runs the attention forward
twice); llama with 64-token chunks 90.2 / 3.9 / 5.9%, of which 47% in the loss's matmul
loop (its [2048, 128256] weight streamed 256 times a pass). No collectives (one chip),
no idle time. MaxText's v5e XLA flags (`MAXTEXT_V5E`) leave the one-chip programs
unchanged: the optimized HLO of gpt-small and gpt-nano compiled for v5e:1x1 is the same
text with and without them.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from recipes.bench import plain_jax as pj
from recipes.bench import trace_split
from recipes.lm import cli, hardware, models, optimizers
from recipes.lm.options import REMAT_POLICIES

# Base shapes: train_lm's TPU default (GPT small 16 x 1024), GPT medium with remat, the
# Llama sized for one v5e chip, the Llama 3.2 1B and 3B shapes under Adafactor (AdamW's
# state alone outgrows the chip: the module docstring), and tiny ones for a CPU.
BASES = {
    "gpt-small": dict(model="small", batch=16, seq=1024),
    "gpt-medium": dict(model="medium", batch=32, seq=1024, remat="full"),
    "llama": dict(model="llama-766m", batch=8, seq=2048, remat="full"),
    "llama-1b": dict(model="llama-1b", batch=4, seq=2048, remat="full", loss_chunk=1024,
                     opt="adafactor"),
    "llama-3b": dict(model="llama-3b", batch=2, seq=2048, remat="full", loss_chunk=1024,
                     opt="adafactor"),
    "gpt-nano": dict(model="nano", batch=8, seq=64),
    "llama-tiny": dict(model="llama-tiny", batch=4, seq=64, loss_chunk=64),
}

# The XLA flags of MaxText's v5e training scripts (its configs/v5e/*.sh LIBTPU_INIT_ARGS);
# all of them schedule or fuse collectives (data-parallel all-reduce, async all-gather,
# collective fusion and its overlap with compute), so a one-chip step has nothing for them
# to act on: `recipes/bench/chip.py` measures that they change nothing there.
MAXTEXT_V5E = {
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}
_XLA = {"": None, "maxtext": MAXTEXT_V5E}


class Case(NamedTuple):
  """One benchmark row: the shape and the levers (see the module docstring)."""
  label: str
  model: str
  batch: int
  seq: int
  remat: str = "none"
  int8: bool = False
  unroll: bool = False
  params: str = "float32"
  mu: str = "float32"
  opt: str = "adamw"
  offload: bool = False
  loss_chunk: int = 0
  blocks: tuple[int, ...] | None = None
  xla: str = ""
  accum: int = 1
  attn: str = ""
  peer: bool = False
  hand: bool = False
  profile: bool = False
  loss_steps: int = 0

  @property
  def peer_levers(self) -> bool:
    """Whether the plain-JAX peer has every lever this case sets."""
    return (not self.int8 and self.accum == 1 and not self.offload
            and self.remat in ("none", "full", "dots", "qkv_attn"))


def parse_case(text: str) -> Case:
  """`BASE[,KEY=VALUE...]` -> Case. Raises InputError naming a bad base, key or value."""
  base, *pairs = [p.strip() for p in text.split(",") if p.strip()]
  if base not in BASES:
    raise fs.InputError(f"--case={text!r}: unknown base {base!r}; expected one of {list(BASES)}")
  fields = dict(BASES[base])
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or key not in Case._fields or key in ("label", "model"):
      raise fs.InputError(f"--case={text!r}: {pair!r} is not KEY=VALUE with KEY one of "
                          f"{[f for f in Case._fields if f not in ('label', 'model')]}")
    fields[key] = _value(key, value, text)
  case = Case(label=text, **fields)
  if case.attn not in ("", "xla", "splash"):
    raise fs.InputError(f"--case={text!r}: attn={case.attn!r}; expected xla or splash")
  if case.remat not in REMAT_POLICIES:  # before any model is built
    raise fs.InputError(f"--case={text!r}: remat={case.remat!r}; expected one of "
                        f"{list(REMAT_POLICIES)}")
  if case.xla not in _XLA or case.params not in ("float32", "bfloat16") or case.mu not in (
      "float32", "bfloat16") or case.opt not in optimizers.OPTIMIZERS:
    raise fs.InputError(f"--case={text!r}: xla in {list(_XLA)}, params and mu float32 or "
                        f"bfloat16, opt in {list(optimizers.OPTIMIZERS)}")
  return case


def _value(key: str, value: str, text: str):
  kind = type(Case._field_defaults.get(key, 0))  # batch and seq: ints without a default
  try:
    if key == "blocks":
      return tuple(int(v) for v in value.split("/"))
    if kind is bool:
      return bool(int(value))
    if kind is int:
      return int(value)
  except ValueError:
    raise fs.InputError(f"--case={text!r}: {key}={value!r} is not a number") from None
  return value


# ------------------------------------------------------------------------------ set-up


class Env(NamedTuple):
  """Where the cases run: the mesh, the MFU denominator (FLOP/s of all devices and a line
  saying what it is), the attention kernel, and whether the devices are only described
  (ahead-of-time compiles, nothing runs)."""
  mesh: object
  peak: float
  peak_note: str
  attention: str
  aot: bool


def environment(aot: str = "") -> Env:
  """The mesh of every device ("fsdp") and the peak; `aot`: a TPU target to compile for."""
  devices = fs.target_devices(aot) if aot else jax.devices()
  mesh = fs.make_mesh({"fsdp": len(devices)}, devices=devices)
  d = devices[0]
  gen = fs.detect_topology(devices=devices, env={}).generation if d.platform == "tpu" else None
  if gen is not None:
    per = fs.CHIP_FACTS[gen].peak_flops
    note = f"{gen} dense bf16 peak {per / 1e12:.0f} TFLOP/s x {len(devices)} devices"
    return Env(mesh, per * len(devices), note, "splash", bool(aot))
  if d.platform == "cpu":
    host = fs.analysis.host_matmul_peak()
    return Env(mesh, host.flops, f"CPU matmul peak {host.flops / 1e9:.0f} GFLOP/s measured "
               f"(whole host, shared by {len(devices)} devices)", "xla", bool(aot))
  return Env(mesh, float("nan"), f"no peak figure for {d.device_kind!r}", "auto", bool(aot))


def model_of(case: Case):
  """(train_lm's model module, its config) for the case's model, seq and levers."""
  if case.model not in models.MODELS:
    raise fs.InputError(f"model {case.model!r} is not one of train_lm's {list(models.MODELS)}")
  module = models.MODELS[case.model]
  cfg = module.model_config(case.model, case.seq)._replace(int8=case.int8, unroll=case.unroll)
  if "loss_chunk" in cfg._fields:
    cfg = cfg._replace(loss_chunk=case.loss_chunk)
  return module, cfg


def optimizer(case: Case):
  """train_lm's optimizer `case.opt` (`recipes.lm.optimizers`: AdamW, b2 0.95, its first
  moment in `case.mu`, or Adafactor) with weight decay 0.1 and global-norm clipping; the
  learning rate warms up to 6e-4 over a tenth of `case.loss_steps` (else 100 steps) and
  decays to 6e-5 by a cosine."""
  steps = case.loss_steps or 1000
  lr = optax.warmup_cosine_decay_schedule(0.0, 6e-4, steps // 10, steps, 6e-5)
  return optimizers.transformation(case.opt, lr, mu_dtype=case.mu)


def policy(case: Case) -> str:
  return f"params={case.params},compute=bfloat16,output=float32"


class Side(NamedTuple):
  """One compiled step over the shared state: `run(state, batch) -> (state, loss)`, its
  compile seconds and its program's HBM bytes per device."""
  run: object
  compile_s: float
  memory: dict  # program_bytes
  hlo: object  # () -> optimized HLO text

  @property
  def hbm(self) -> float:
    return self.memory["hbm"]


def program_bytes(compiled) -> dict:
  """Per device: "hbm" = arguments + outputs - aliased (donated) + temporaries, and each;
  "host_argument", "host_temp": what the program keeps in the host's memory (an offloaded
  state; activations a remat policy offloads)."""
  m = compiled.memory_analysis()
  parts = {k: float(getattr(m, f"{k}_size_in_bytes")) for k in (
      "argument", "output", "alias", "temp", "host_argument", "host_temp")}
  return {"hbm": parts["argument"] + parts["output"] - parts["alias"] + parts["temp"], **parts}


def tiles_for(case: Case, cfg) -> tuple[int, int, int, int] | None:
  """The splash tiles fnscale's attention runs for this case on a TPU (the case's `blocks`,
  else fnscale's choice for the shape; the peer gets the same), or None where splash can't
  serve the shape (a CPU's tiny sequences)."""
  shape = (case.batch, case.seq, cfg.heads, cfg.head_dim)
  try:
    sel = fs.kernels.kernel_selection(shape, shape, "bfloat16", causal=True,
                                      implementation="splash", platform="tpu",
                                      block_sizes=blocks(case))
  except fs.KernelError:
    return None
  return tuple(sel.block_sizes)


def attention(case: Case, env: Env) -> str:
  """The attention kernel of every side: the case's `attn`, else the platform's."""
  return case.attn or env.attention


def blocks(case: Case) -> fs.kernels.BlockSizes | None:
  return None if case.blocks is None else fs.kernels.BlockSizes(*case.blocks)


def fnscale_side(case: Case, env: Env, state, batch) -> Side:
  """fnscale's step (train_lm's model, train_step, with_kernel, shard_step), compiled."""
  module, cfg = model_of(case)
  loss = functools.partial(module.loss_fn, remat=case.remat, cfg=cfg)
  step = fs.train_step(loss, optimizer(case), policy=policy(case),
                       accum_steps=case.accum)
  step = fs.shard_step(fs.with_kernel(step, attention=attention(case, env), block_sizes=blocks(case)),
                       env.mesh,
                       rules=module.RULES, logical_axes=module.logical_axes(cfg),
                       compiler_options=_XLA[case.xla])
  c = step.compile(state, batch)

  def run(state, batch):
    state, metrics = c(state, batch)
    return state, metrics["loss"]
  return Side(run, c.compile_seconds, program_bytes(c.compiled), c.compiled.as_text)


def peer_side(case: Case, env: Env, state, batch, tiles) -> Side:
  """The plain-JAX step of the same model (recipes/bench/plain_jax.py), compiled for the
  shared state's shardings; it reads and returns (params, opt_state) of that state."""
  module, cfg = model_of(case)
  tokens = case.batch * case.seq
  opts = pj.Options(attention="splash" if attention(case, env) == "splash" else "xla",
                    blocks=tiles or pj.Options().blocks,
                    fused_bwd=fs.kernels.SPLASH_FUSED_BACKWARD, remat=case.remat, unroll=case.unroll,
                    loss_chunk=case.loss_chunk or default_chunk(tokens, cfg.vocab))
  if hasattr(cfg, "kv_heads"):
    loss = functools.partial(pj.llama_loss, theta=cfg.rope_theta, options=opts)
  else:
    loss = functools.partial(pj.gpt_loss, options=opts)
  return _by_hand(pj.train_step(loss, optimizer(case)), case, env, state, batch)


def hand_side(case: Case, env: Env, state, batch) -> Side:
  """train_lm's own model (loss, remat, attention kernel and tiles: the model's choices)
  under the hand-written step of the peer (`plain_jax.train_step`: value_and_grad, optax,
  `jax.jit` with donation): on one device fnscale's side over this one is the wrapper's
  cost alone (on a mesh this side has no logical rules: the partitioner lays it out)."""
  module, cfg = model_of(case)
  loss = functools.partial(module.loss_fn, remat=case.remat, cfg=cfg)
  step = fs.with_kernel(pj.train_step(loss, optimizer(case)), attention=attention(case, env),
                        block_sizes=blocks(case))
  return _by_hand(step, case, env, state, batch)


def _by_hand(step, case: Case, env: Env, state, batch) -> Side:
  """`step((params, opt_state), batch) -> ((params, opt_state), loss)` under `jax.jit`,
  donated and compiled for the shared state's shardings."""
  shardings = jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))
  scalar = jax.sharding.NamedSharding(env.mesh, jax.P())
  jitted = jax.jit(step, donate_argnums=0, out_shardings=(shardings, scalar))
  t0 = time.perf_counter()
  with jax.set_mesh(env.mesh):
    lowered = jitted.trace((state.params, state.opt_state), batch).lower()
  compiled = lowered.compile(_XLA[case.xla])
  compile_s = time.perf_counter() - t0

  def run(state, batch):
    (params, opt_state), loss = compiled((state.params, state.opt_state), batch)
    return state._replace(params=params, opt_state=opt_state), loss
  return Side(run, compile_s, program_bytes(compiled), compiled.as_text)


def default_chunk(tokens: int, vocab: int) -> int:
  """`fnscale.cross_entropy`'s default chunk, for the peer: the most tokens whose float32
  logits stay under 2**23 values but at least 1024, a divisor of `tokens` within half of
  that when there is one."""
  most = min(tokens, max(1024, (1 << 23) // vocab))
  return next((c for c in range(most, most // 2, -1) if tokens % c == 0), most)


# ------------------------------------------------------------------------------ measuring


def random_batch(case: Case, vocab: int, mesh):
  """{"inputs", "targets"}: int32 [batch, seq] random token ids, split over the mesh."""
  ids = jax.random.randint(jax.random.key(1), (case.batch, case.seq + 1), 0, vocab)
  ids = jax.device_put(ids, fs.batch_sharding(mesh))
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def alternate(sides: dict, state, batch, rounds: int, steps: int, warmup: int):
  """Runs the sides in turn on one state (even rounds in `sides` order, odd ones reversed);
  returns (state, {name: [seconds per step of each round]})."""
  names = list(sides)
  for name in names:
    for _ in range(warmup):
      state, loss = sides[name].run(state, batch)
    jax.block_until_ready((state, loss))
  times = {n: [] for n in names}
  for r in range(rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      t0 = time.perf_counter()
      for _ in range(steps):
        state, loss = sides[name].run(state, batch)
      jax.block_until_ready((state, loss))
      times[name].append((time.perf_counter() - t0) / steps)
  return state, times


def figures(side: Side, seconds: list, tokens: int, flops_token: float, env: Env) -> dict:
  """tokens/s, MFU and HBM of one side from its per-step times."""
  step = statistics.median(seconds)
  return {"step_ms": 1e3 * step, "tokens_s": tokens / step,
          "mfu": flops_token * tokens / step / env.peak, "hbm_gib": side.hbm / 2**30,
          "temp_gib": side.memory["temp"] / 2**30,
          "compile_s": side.compile_s, "spread": (max(seconds) - min(seconds)) / step}


def profile(side: Side, state, batch, keep: str = "", steps: int = 3):
  """Traces `steps` steps of `side`; returns (state, trace_split.Split). `keep`: a path
  prefix to copy the trace's XSpace (KEEP.xplane.pb) and the program's HLO to."""
  with tempfile.TemporaryDirectory(prefix="fnscale-trace-") as d:
    jax.profiler.start_trace(d)
    for _ in range(steps):
      state, loss = side.run(state, batch)
    jax.block_until_ready((state, loss))
    jax.profiler.stop_trace()
    xplane = trace_split.find_xplane(d)
    if keep:  # --trace_dir need not exist yet: KEEP.xplane.pb and its HLO, KEEP.hlo.txt
      os.makedirs(os.path.dirname(keep) or ".", exist_ok=True)
      shutil.copyfile(xplane, keep + ".xplane.pb")
      with open(keep + ".hlo.txt", "w", encoding="utf-8") as f:
        f.write(side.hlo())
    return state, trace_split.split(xplane, side.hlo(), runs=steps)


def text_batches(case: Case, steps: int):
  """`steps` batches of byte-level text: windows of the Python standard library's sources at
  positions drawn with a fixed seed (the same for every case)."""
  root = os.path.dirname(os.__file__)
  data, size = [], 0
  for name in sorted(os.listdir(root)):
    if name.endswith(".py") and size < 8 << 20:
      with open(os.path.join(root, name), "rb") as f:
        data.append(f.read())
        size += len(data[-1])
  text = np.frombuffer(b"\n".join(data), np.uint8).astype(np.int32)
  rng = np.random.default_rng(0)
  for _ in range(steps):
    starts = rng.integers(0, len(text) - case.seq - 1, case.batch)
    rows = np.stack([text[s:s + case.seq + 1] for s in starts])
    yield {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def train_losses(side: Side, case: Case, env: Env) -> list[float]:
  """The loss of each of `case.loss_steps` steps of `side` from a fresh init (seed 0)."""
  state, losses = init(case, env), []
  for b in text_batches(case, case.loss_steps):
    state, loss = side.run(state, jax.device_put(b, fs.batch_sharding(env.mesh)))
    losses.append(loss)
  return [float(x) for x in jax.device_get(losses)]


def init(case: Case, env: Env, abstract: bool = False):
  """fnscale's state for the case, born in its shardings (seed 0)."""
  module, cfg = model_of(case)
  return fs.init_state(functools.partial(module.init_params, cfg),
                       optimizer(case), mesh=env.mesh, rules=module.RULES,
                       logical_axes=module.logical_axes(cfg), policy=policy(case),
                       key=jax.random.key(0), abstract=abstract,
                       offload_optimizer=case.offload)


def _file_name(label: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def measure(case: Case, env: Env, rounds: int, steps: int, warmup: int,
            trace_dir: str = "") -> dict:
  """One row: each side's figures (and the split, the losses), as the docstring says."""
  module, cfg = model_of(case)
  tokens = case.batch * case.seq
  row = {"case": case.label, "levers": case._asdict(), "tokens_step": tokens,
         "flops_token": module.flops_per_token(cfg),
         "params": sum(x.size for x in jax.tree.leaves(init(case, env, abstract=True).params))}
  peer = case.peer and case.peer_levers
  if env.aot:
    state = init(case, env, abstract=True)
    spec = jax.ShapeDtypeStruct((case.batch, case.seq), "int32",
                                sharding=fs.batch_sharding(env.mesh))
    batch = {"inputs": spec, "targets": spec}
  else:
    state, batch = init(case, env), random_batch(case, cfg.vocab, env.mesh)
  tiles = row["tiles"] = tiles_for(case, cfg)
  sides = {"fnscale": fnscale_side(case, env, state, batch)}
  if case.hand and case.accum == 1 and not case.offload:  # by hand: the state on the device
    sides["by_hand"] = hand_side(case, env, state, batch)
  if peer:
    sides["plain_jax"] = peer_side(case, env, state, batch, tiles)
  if env.aot:
    return {**row, **{n: {"hbm_gib": s.hbm / 2**30, "compile_s": s.compile_s,
                          "memory": s.memory} for n, s in sides.items()}}
  state, times = alternate(sides, state, batch, rounds, steps, warmup)
  for name, side in sides.items():
    row[name] = figures(side, times[name], tokens, row["flops_token"], env)
  rate = lambda name: row[name]["tokens_s"]
  if peer:
    row["ratio"] = rate("fnscale") / rate("plain_jax")
  if "by_hand" in sides:  # the wrapper's cost, and the model code's against the peer
    row["wrapper"] = rate("fnscale") / rate("by_hand")
    if peer:
      row["model_code"] = rate("by_hand") / rate("plain_jax")
  if case.profile:  # every side's split; fnscale's also as the row's
    for name, side in sides.items():
      keep = os.path.join(trace_dir, f"{_file_name(case.label)}.{name}") if trace_dir else ""
      state, split = profile(side, state, batch, keep)
      row[name]["split"] = {"fractions": split.fractions(), "step_ms": 1e3 * split.step_s,
                            "unmatched": split.unmatched, "line": split.line(),
                            "top": split.top}
    row["split"] = row["fnscale"]["split"]
  del state, batch
  gc.collect()
  if case.loss_steps:  # the same compiled step, from a fresh init on text
    row["losses"] = train_losses(sides["fnscale"], case, env)
  return row


def describe(row: dict) -> str:
  """One line per side: tokens/s, MFU, HBM (and the ratio, the split, the final loss)."""
  out = [f"{row['case']}: {row['tokens_step']} tokens/step, {row['params'] / 1e6:.0f}M params, "
         f"tiles {row.get('tiles')}"]
  for name in ("fnscale", "by_hand", "plain_jax"):
    if name in row and "tokens_s" in row[name]:
      r = row[name]
      out.append(f"  {name:9s} {r['tokens_s'] / 1e3:8.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
                 f"step {r['step_ms']:7.1f} ms  HBM {r['hbm_gib']:5.2f} GiB  "
                 f"compile {r['compile_s']:.1f} s")
    elif name in row:
      out.append(f"  {name:9s} HBM {row[name]['hbm_gib']:5.2f} GiB (compiled only)")
  if "ratio" in row:
    out.append(f"  fnscale / plain JAX tokens/s: {row['ratio']:.3f}")
  if "wrapper" in row:
    out.append(f"  fnscale / same model by hand (the wrapper): {row['wrapper']:.3f}"
               + (f"; by hand / plain JAX (the model code): {row['model_code']:.3f}"
                  if "model_code" in row else ""))
  for name in ("fnscale", "by_hand", "plain_jax"):
    if "split" in row.get(name, {}):
      out.append(f"  split {name}: {row[name]['split']['line']}")
  if "losses" in row:
    tail = row["losses"][-10:]
    out.append(f"  loss after {len(row['losses'])} steps: {statistics.mean(tail):.4f} "
               f"(mean of the last {len(tail)})")
  return "\n".join(out)


# ------------------------------------------------------------------------------ splash tiles


def _splash_grad(shape, tiles, fused: bool):
  """A jitted fwd + bwd of causal splash attention on bf16 q [b, s, h, d], k, v [b, s, kv, d]."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=import-outside-toplevel
  b, h, kv, s, d = shape
  sizes = fs.kernels.splash_block_sizes(fs.kernels.BlockSizes(*tiles), fused)
  kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((s, s))] * h), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1,
                              interpret=jax.devices()[0].platform != "tpu")
  loss = lambda q, k, v: jnp.sum(jax.vmap(kernel)(q, k, v).astype(jnp.float32))
  keys = jax.random.split(jax.random.key(0), 3)
  args = [jax.random.normal(key, (b, n, s, d), jnp.bfloat16)
          for key, n in zip(keys, (h, kv, kv))]
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args


def _time(fn, args, reps: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def search_splash(spec: str) -> dict:
  """Times splash attention fwd + bwd over candidate tiles for shape `BxHxKVxSxD`: first the
  forward tiles (backward 512/512), then the backward tiles and the fused backward kernel
  with the best forward; returns {"shape", "rows": [(tiles, fused, ms or None)], "best"}."""
  b, h, kv, s, d = (int(x) for x in spec.lower().split("x"))
  sizes = [t for t in (512, 1024, 2048) if s % t == 0] or [s]
  fwd = [(q, k) for q in sizes for k in sizes if k <= 1024]
  rows = []

  def attempt(tiles, fused):
    try:
      fn, args = _splash_grad((b, h, kv, s, d), tiles, fused)
      ms = 1e3 * _time(fn, args)
    except Exception as e:  # pylint: disable=broad-except
      print(f"  tiles {tiles} fused={fused}: failed ({type(e).__name__})", flush=True)
      ms = None
    rows.append((tiles, fused, ms))
    if ms is not None:
      print(f"  tiles {tiles} fused={fused}: {ms:.3f} ms", flush=True)
    return ms if ms is not None else float("inf")

  base = min(512, s)
  best_fwd = min(fwd, key=lambda t: attempt((*t, base, base), False))
  bwd = [(q, k) for q in sizes for k in sizes if max(q, k) <= 1024 and (q, k) != (base, base)]
  for q, k in bwd:
    attempt((*best_fwd, q, k), False)
  for q, k in [(base, base), *[t for t in bwd if t[0] == t[1]]]:
    attempt((*best_fwd, q, k), True)
  done = [r for r in rows if r[2] is not None]
  best = min(done, key=lambda r: r[2])
  return {"shape": spec, "rows": rows, "best": best}


# ------------------------------------------------------------------------------ command line


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_multi_string("case", [], "BASE[,KEY=VALUE...] (module docstring), or "
                            "search:BxHxKVxSxD (a splash tile search in this place); "
                            "repeatable, run in order", flag_values=fv)
  flags.DEFINE_integer("rounds", 5, "alternating rounds", flag_values=fv)
  flags.DEFINE_integer("steps", 3, "steps per side per round", flag_values=fv)
  flags.DEFINE_integer("warmup", 2, "steps per side before timing", flag_values=fv)
  flags.DEFINE_string("aot", "", "compile for this TPU target (e.g. v5e:1x1) instead of "
                      "running: HBM only", flag_values=fv)
  flags.DEFINE_multi_string("search_splash", [], "BxHxKVxSxD: time splash tiles for this "
                            "shape (TPU), after the cases; repeatable", flag_values=fv)
  flags.DEFINE_string("json", "", "append each row to this file (JSON lines)", flag_values=fv)
  flags.DEFINE_string("trace_dir", "", "keep each profiled side's trace (CASE.SIDE.xplane.pb) "
                      "and optimized HLO (CASE.SIDE.hlo.txt) here",
                      flag_values=fv)
  flags.DEFINE_float("budget_s", 0.0, "skip the cases left once this many seconds have "
                     "passed (0: none)", flag_values=fv)
  hardware.define_flags(fv)  # train_lm's hardware options


def run(argv: list[str], say=print) -> list[dict]:
  """Parses `argv` and runs each search and case in order; returns the rows."""
  fv = flags.FlagValues()
  _define_flags(fv)
  cli.parse_values(fv, argv)
  topo = hardware.detect(hardware.from_values(fv))
  items = [("search", c.removeprefix("search:")) if c.startswith("search:") else
           ("case", parse_case(c)) for c in fv.case]
  items += [("search", spec) for spec in fv.search_splash]
  t0, rows = time.time(), []
  env = environment(fv.aot)
  say(f"chip.py: jax {_versions()}; {env.peak_note}\n{hardware.describe(topo)}")
  for kind, case in items:
    if fv.budget_s and time.time() - t0 > fv.budget_s:
      say(f"{getattr(case, 'label', case)}: skipped (past --budget_s={fv.budget_s:.0f})")
      continue
    if kind == "search":
      say(f"splash tiles for {case}:")
      rows.append(_write(fv.json, {"search_splash": search_splash(case)}))
      say(f"  best: {rows[-1]['search_splash']['best']}")
      continue
    try:
      row = measure(case, env, fv.rounds, fv.steps, fv.warmup, fv.trace_dir)
    except Exception as e:  # pylint: disable=broad-except  (a failed case: say why, go on)
      if isinstance(e, fs.InputError):
        raise
      row = {"case": case.label, "error": f"{type(e).__name__}: {str(e)[:400]}"}
      say(f"{case.label}: failed: {row['error']}")
    else:
      say(describe(row))
    rows.append(_write(fv.json, {**row, "seconds": time.time() - t0}))
  return rows


def _versions() -> str:
  try:
    import libtpu  # pylint: disable=import-outside-toplevel
    tpu = f", libtpu {getattr(libtpu, '__version__', '?')}"
  except ImportError:
    tpu = ""
  return f"{jax.__version__}{tpu}, {jax.device_count()} x {jax.devices()[0].device_kind}"


def _write(path: str, row: dict) -> dict:
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps(row, default=str) + "\n")
  return row


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    fv = flags.FlagValues()
    _define_flags(fv)
    print(__doc__ + "\nflags:\n" + fv.get_help())
    return 0
  try:
    run(argv, say=lambda s: print(s, flush=True))
  except (fs.FnscaleError, flags.Error) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
