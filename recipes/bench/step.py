"""Benchmark fnscale's compiled train step: compile time, step time, MFU, memory, collectives.

  python recipes/bench/step.py                  # CPU: nano/tiny/wide x 1,2,4,8 devices (minutes)
  python recipes/bench/step.py --sizes=small    # on a TPU VM: x 1, 2, 4, ... up to its chips
  python recipes/bench/step.py --sizes=small --meshes="fsdp=-1" --devices=8 --steps=20
  python recipes/bench/step.py --full --json=bench.json

For each model size (the GPT-style byte model of `recipes/train_lm.py`, plus `wide`: 2 layers of
width 512) and each mesh spec and device count, one row:

- compile: seconds of `Lowered.compile` for the fnscale step, cold (first compile, the
  persistent cache in a fresh temporary directory is empty) and warm (after
  `jax.clear_caches()`, a new `shard_step` whose compile is served from the persistent
  cache; the row says whether jax reported a cache hit);
- step time: median and 10th / 90th percentile of `--steps` synchronized steps
  (`block_until_ready` on the new state and metrics) after `--warmup` steps; tokens/s;
- MFU (PaLM, Chowdhery et al. 2022, appendix B): model FLOPs per step
  `(6 N + 12 L d_model seq) * tokens` (N: matmul weights, blocks plus the tied output layer;
  `fnscale.analysis.model_flops_per_token`) / step time / (devices x peak FLOP/s per device). On
  CPU the peak is a 2048x2048 float32 matmul's rate on this machine
  (`fnscale.analysis.host_matmul_peak`: measured once and cached, the run says when); the
  simulated devices share the host's cores, so devices x peak per device = that one rate.
- FLOPs cross-check: XLA's cost analysis of the compiled step (per device for an SPMD
  program, so multiplied by the device count), and the matmul FLOPs read from the optimized HLO
  with each while loop's trip count applied (`fnscale.analysis.hlo.summarize`; XLA's cost analysis
  counts a loop body once, and the layers run under `lax.scan`);
- memory per device (XLA memory analysis): arguments (state + batch), temporaries, peak;
  params per device from the shardings;
- collectives: what `fnscale.compile_report` lists (runs per step with loop trip counts
  applied, ops in the module text, result bytes per device), and the bytes each device sends
  per step with loop trip counts applied (`fnscale.analysis.hlo.ring_bytes_sent`, ring
  algorithms: all-reduce 2(n-1)/n x size, all-gather (n-1)/n x result, reduce-scatter
  (n-1) x shard), next to the textbook volume for the mesh: data parallel gradient all-reduce
  2(n-1)/n x gradient bytes; FSDP all-gather of params forward and backward plus a
  reduce-scatter of gradients, 3(n-1)/n x param bytes; tensor parallel (Megatron, Shoeybi et
  al. 2019) 2 all-reduces of [batch, seq, d_model] activations forward and 2 backward per
  layer plus 2 for the vocab-parallel embedding / output layer.

Overhead: the fnscale step (`shard_step(train_step(loss, adamw))`) against a hand-written
`jax.jit` step of the same model with the same shardings, optimizer and donation, alternated
in one process (A B, B A, ... per round) and the median of the per-round time ratios.

CPU numbers are relative (simulated devices share two cores); absolute MFU needs an
accelerator. The tables are markdown; `--json` writes every number.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

from absl import flags
from absl import logging

import fnscale as fs
from recipes.lm import cli, hardware

HERE = os.path.dirname(os.path.abspath(__file__))

# Extra sizes beside train_lm's: wider than tiny, shallow enough to run quickly on a CPU.
EXTRA_SIZES = {"wide": dict(layers=2, d_model=512, heads=8)}


def _train_lm():
  """The recipe model (one implementation: train_lm's params, loss, rules, logical axes)."""
  from recipes.lm import gpt  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  return gpt


def model_config(size: str, seq: int):
  tl = _train_lm()
  if size in EXTRA_SIZES:
    return tl.ModelConfig(seq=seq, **EXTRA_SIZES[size])
  if size not in tl.SIZES:
    raise fs.InputError(f"model size {size!r} is not known; expected one of "
                          f"{list(tl.SIZES) + list(EXTRA_SIZES)}")
  return tl.model_config(size, seq)


def model_flops_per_step(cfg, batch: int) -> float:
  return _train_lm().flops_per_token(cfg) * batch * cfg.seq


# ------------------------------------------------------------------------------ theory


def _shard_ways(sharding, axes) -> int:
  mesh = sharding.mesh.shape
  used = set()
  for e in sharding.spec:
    if e is None:
      continue
    used.update(e if isinstance(e, tuple) else (e,))
  return math.prod(mesh[a] for a in axes if a in used)


def theory_bytes(params, cfg, batch: int, mesh) -> dict[str, float]:
  """Textbook bytes one device sends per step for this mesh and these param shardings.

  Per param leaf of B bytes per tensor-parallel shard: sharded f ways over the FSDP-like data
  axes -> 3 (f - 1) / f x B (all-gather forward and backward, reduce-scatter of the gradient);
  its gradient shard replicated r ways over the other data axes -> 2 (r - 1) / r x B / f (ring
  all-reduce). Tensor axis of size t -> (4 layers + 2) all-reduces of the local activations
  [batch / data ways, seq, d_model] float32 at 2 (t - 1) / t each.
  """
  jax = sys.modules["jax"]
  daxes = fs.data_axes(mesh)
  other = tuple(a for a in mesh.axis_names if a not in daxes)
  dp = fsdp = 0.0
  for x in jax.tree.leaves(params):
    s = x.sharding
    full = x.size * x.dtype.itemsize
    local_t = full / _shard_ways(s, other)
    f = _shard_ways(s, daxes)
    r = math.prod(mesh.shape[a] for a in daxes) // f
    fsdp += 3 * (f - 1) / f * local_t
    dp += 2 * (r - 1) / r * local_t / f
  t = mesh.shape.get("tensor", 1)
  dways = math.prod(mesh.shape[a] for a in daxes)
  act = batch / dways * cfg.seq * cfg.d_model * 4
  tp = (4 * cfg.layers + 2) * 2 * (t - 1) / t * act if t > 1 else 0.0
  return {"dp": dp, "fsdp": fsdp, "tp": tp, "total": dp + fsdp + tp}


# ------------------------------------------------------------------------------ measuring


@contextlib.contextmanager
def persistent_cache(directory: str):
  """jax's persistent compilation cache in `directory` (every program cached: thresholds 0),
  restoring the previous settings afterwards."""
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  with fs.compilation_cache_restored():
    jax.config.update("jax_enable_compilation_cache", True)
    fs.compilation_cache(directory)  # thresholds 0: even sub-second programs cached
    yield


_EVENTS = collections.Counter()
_LISTENING = []


def _listen():
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  if not _LISTENING:
    jax.monitoring.register_event_listener(lambda name, **kw: _EVENTS.update([name]))
    _LISTENING.append(True)


def _percentile(xs, q):
  xs = sorted(xs)
  if len(xs) == 1:
    return xs[0]
  pos = (len(xs) - 1) * q
  lo = int(math.floor(pos))
  hi = min(lo + 1, len(xs) - 1)
  return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _block(tree):
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  return jax.block_until_ready(tree)


@dataclasses.dataclass
class Row:
  """One benchmarked (model, mesh, devices). Seconds, bytes per device, FLOPs per step."""
  size: str
  params: int
  mesh: str
  devices: int
  batch: int
  seq: int
  compile_cold_s: float
  compile_warm_s: float
  warm_from_cache: bool
  step_s: float
  step_p10_s: float
  step_p90_s: float
  tokens_per_s: float
  model_flops: float
  mfu: float | None
  xla_flops: float | None
  xla_flops_per_device: float | None
  hlo_dot_flops: float
  hlo_dot_flops_once: float
  loops: list
  param_bytes: int
  param_bytes_total: int
  argument_bytes: int | None
  temp_bytes: int | None
  peak_bytes: int | None
  report_collectives: dict
  collectives: dict
  wire_bytes: float
  theory: dict
  loss: float


def _state_and_batch(cfg, mesh, optimizer, batch: int, seed: int = 0):
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  tl = _train_lm()
  state = fs.init_state(functools.partial(tl.init_params, cfg), optimizer, mesh=mesh,
                        rules=tl.RULES, logical_axes=tl.logical_axes(cfg),
                        key=jax.random.key(seed))
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, cfg.seq + 1), 0, cfg.vocab,
                              jnp.int32)
  bsh = fs.batch_sharding(mesh)
  b = {"inputs": jax.device_put(tokens[:, :-1], bsh),
       "targets": jax.device_put(tokens[:, 1:], bsh)}
  return state, b


def _optimizer():
  import optax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  return optax.adamw(1e-3, weight_decay=0.1)


def _fnscale_step(cfg, mesh, optimizer, mode="auto"):
  tl = _train_lm()
  return fs.shard_step(fs.train_step(tl.loss_fn, optimizer), mesh, rules=tl.RULES,
                       logical_axes=tl.logical_axes(cfg), mode=mode)


def split_spec(spec: str) -> tuple[str, str]:
  """'fsdp=-1@shard_map' -> ('fsdp=-1', 'shard_map'); no '@': mode 'auto'."""
  axes, _, mode = spec.partition("@")
  return axes, mode or "auto"


def _mesh(spec: str, devices: int):
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  if devices > jax.device_count():
    raise fs.MeshError(f"{devices} devices requested, {jax.device_count()} available; "
                       "pass --max_devices (CPU) or fewer --devices")
  return fs.make_mesh(spec, devices=jax.devices()[:devices])


def mesh_name(mesh) -> str:
  return ",".join(f"{k}={v}" for k, v in mesh.shape.items())


class Timed(NamedTuple):
  """`measure`'s keywords: steps of `batch` rows x `seq` tokens, `warmup` untimed, then
  `steps` timed; `peak_per_device`: FLOP/s of one device, the MFU denominator (None: none)."""
  batch: int
  seq: int
  steps: int
  warmup: int
  peak_per_device: float | None


def _compiled(cfg, mesh, optimizer, mode: str, state, b):
  """(the compiled step, its cold compile seconds, a warm compile's seconds, whether the
  warm one read the persistent cache): the warm one has no in-memory executable left and a
  new shard_step."""
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  step = _fnscale_step(cfg, mesh, optimizer, mode).compile(state, b)
  jax.clear_caches()
  hits = _EVENTS["/jax/compilation_cache/cache_hits"]
  warm = _fnscale_step(cfg, mesh, optimizer, mode).compile(state, b).compile_seconds
  return step, step.compile_seconds, warm, _EVENTS["/jax/compilation_cache/cache_hits"] > hits


def _timed(step, state, b, warmup: int, steps: int):
  """(state, last metrics, seconds of each timed step) after `warmup` untimed steps."""
  for _ in range(warmup):
    state, m = _block(step(state, b))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = _block(step(state, b))
    times.append(time.perf_counter() - t0)
  return state, m, times


def measure(size: str, mesh_spec: str, devices: int, **options) -> Row:
  """Benchmarks one (model size, mesh spec, device count); see the module docstring.
  `options`: the fields of `Timed`, as keywords.

  Needs the persistent compilation cache on (`persistent_cache`) for the warm compile.

  Raises:
    InputError (a subclass): a bad size, mesh or batch for the mesh.
    TypeError: a missing keyword of `Timed`, or an unknown one.
  """
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  batch, seq, steps, warmup, peak_per_device = Timed(**options)
  _listen()
  cfg = model_config(size, seq)
  axes, mode = split_spec(mesh_spec)
  mesh = _mesh(axes, devices)
  optimizer = _optimizer()
  with fs.with_mesh(mesh):
    state, b = _state_and_batch(cfg, mesh, optimizer, batch)
    step, cold, warm, from_cache = _compiled(cfg, mesh, optimizer, mode, state, b)
    report = fs.compile_report(step, state, b)
    counts = fs.analysis.hlo.summarize(step.compiled.as_text() or "", devices)
    state, m, times = _timed(step, state, b, warmup, steps)
  med = statistics.median(times)
  flops = model_flops_per_step(cfg, batch)
  param_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(state.params))
  param_total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  return Row(
      size=size, params=sum(x.size for x in jax.tree.leaves(state.params)),
      mesh=mesh_name(mesh) + ("" if mode == "auto" else f" ({mode})"), devices=devices,
      batch=batch, seq=seq,
      compile_cold_s=cold, compile_warm_s=warm, warm_from_cache=bool(from_cache),
      step_s=med, step_p10_s=_percentile(times, 0.1), step_p90_s=_percentile(times, 0.9),
      tokens_per_s=batch * seq / med, model_flops=flops,
      mfu=fs.analysis.mfu(flops, med, devices, peak_per_device) if peak_per_device else None,
      xla_flops=report.flops * devices if report.flops is not None else None,
      xla_flops_per_device=report.flops,
      hlo_dot_flops=counts.matmul_flops * devices,
      hlo_dot_flops_once=counts.matmul_flops_once * devices,
      loops=[list(l) for l in counts.loops],
      param_bytes=int(param_bytes), param_bytes_total=int(param_total),
      argument_bytes=report.argument_bytes, temp_bytes=report.temp_bytes,
      peak_bytes=report.peak_bytes,
      report_collectives={c.kind: [c.count, c.bytes, c.ops] for c in report.collectives},
      collectives={c.kind: [c.count, c.bytes, c.bytes_sent] for c in counts.collectives},
      wire_bytes=sum(c.bytes_sent for c in counts.collectives),
      theory=theory_bytes(state.params, cfg, batch, mesh), loss=float(m["loss"]))


class Overhead(NamedTuple):
  """fnscale step vs a hand-written jax.jit step; seconds are medians over rounds, ratios
  medians of the per-round ratios (wall-clock; `cpu_ratio`: the process's CPU seconds, which
  other jobs on a shared machine disturb less)."""
  size: str
  mesh: str
  rounds: int
  fnscale_s: float
  program_s: float
  jit_s: float
  ratio: float
  program_ratio: float
  ratio_p10: float
  ratio_p90: float
  max_param_diff: float
  cpu_ratio: float
  metrics_jit_s: float  # the hand-written step computing fnscale's metrics too
  metrics_cpu_ratio: float  # its CPU seconds / the plain jax.jit step's
  program_vs_metrics_cpu: float  # fnscale's executable / it, CPU seconds


def _hand_step(loss_fn, optimizer, state, batch, mesh, metrics: bool = False):
  """A hand-written `jax.jit` train step with `state`'s shardings and donation, compiled.
  With `metrics`, it also computes what fnscale's step reports beside the loss for float32
  params, written out here: the gradients' global norm and whether it is non-finite while
  the loss is finite (the norm of the change is measured only where asked or where the
  params are narrower than float32)."""
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import optax  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  def hand(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    if not metrics:
      return new, opt_state, loss
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree.leaves(grads)))
    return new, opt_state, (loss, norm, jnp.isfinite(loss) & ~jnp.isfinite(norm))

  psh = jax.tree.map(lambda x: x.sharding, state.params)
  osh = jax.tree.map(lambda x: x.sharding, state.opt_state)
  bsh = jax.tree.map(lambda x: x.sharding, batch)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(hand, in_shardings=(psh, osh, bsh), out_shardings=(psh, osh, rep),
                 donate_argnums=(0, 1)).lower(state.params, state.opt_state, batch).compile()


def _alternate(runners: list, rounds: int, warmup: int) -> list[list[tuple[float, float]]]:
  """(wall, CPU) seconds of each of `runners` in each of `rounds`, after `warmup` untimed
  rounds; round i runs them in an order rotated by i and reversed every other round, so no
  runner always runs first or after the same one."""
  for _ in range(warmup):
    for run in runners:
      run()
  times = [[] for _ in runners]
  n = len(runners)
  for i in range(rounds):
    order = [(i + k) % n for k in range(n)][::-1 if i % 2 else 1]
    for k in order:
      times[k].append(runners[k]())
  return times


def _cpu_ratio(pairs: list[tuple[float, float]]) -> float:
  """The median of the rounds' CPU-second ratios x / y; rounds where y read 0 s are left out
  (on an accelerator a step's host work can be under the clock's resolution); nan if all."""
  ratios = [x / y for x, y in pairs if y > 0]
  return statistics.median(ratios) if ratios else float("nan")


class Alternated(NamedTuple):
  """`overhead`'s keywords: steps of `batch` rows x `seq` tokens, `warmup` untimed rounds,
  then `rounds` timed ones."""
  batch: int
  seq: int
  rounds: int
  warmup: int


def _runner(step, state: list):
  """A function that runs one synchronized `step(*state)` (its outputs: the new `state`,
  then metrics), threads the new state through, and returns its (wall, CPU) seconds; the
  state stays readable as `run.state`."""

  def run():
    t0, c0 = time.perf_counter(), time.process_time()
    out = _block(step(*state))
    state[:] = out[:len(state)]
    return time.perf_counter() - t0, time.process_time() - c0
  run.state = state
  return run


def overhead(size: str, mesh_spec: str, devices: int, **options) -> Overhead:
  """Alternates the fnscale step (A), its executable without fnscale's per-call checks (C),
  a hand-written `jax.jit` step of the same model, shardings, optimizer and donation (B) and
  that step computing fnscale's metrics too (D), one synchronized step each per round;
  returns the medians of the per-round ratios (A / B: fnscale's overhead; D / B: what its
  metrics cost; C / D: its program beside the same computation written by hand). All start
  from the same params; `max_param_diff` is the largest |difference| of A's and B's params
  afterwards (same math). `options`: the fields of `Alternated`, as keywords.
  """
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  batch, seq, rounds, warmup = Alternated(**options)
  tl = _train_lm()
  cfg = model_config(size, seq)
  axes, mode = split_spec(mesh_spec)
  mesh = _mesh(axes, devices)
  optimizer = _optimizer()
  with fs.with_mesh(mesh):
    states = [_state_and_batch(cfg, mesh, optimizer, batch) for _ in range(4)]
    b = states[0][1]
    fn_step = _fnscale_step(cfg, mesh, optimizer, mode).compile(states[0][0], b)
    hand = [_hand_step(tl.loss_fn, optimizer, s, b, mesh, metrics=m)
            for s, m in ((states[2][0], False), (states[3][0], True))]
    runners = [_runner(lambda st: fn_step(st, b), [states[0][0]]),
               _runner(lambda st: fn_step.compiled(st, b), [states[1][0]]),
               *[_runner(lambda p, o, h=h: h(p, o, b), [s.params, s.opt_state])
                 for h, (s, _) in zip(hand, states[2:])]]
    ta, tc, tb, td = _alternate(runners, rounds, warmup)
    diff = max(float(abs(x - y).max()) for x, y in
               zip(jax.tree.leaves(runners[0].state[0].params),
                   jax.tree.leaves(runners[2].state[0])))
  wall = lambda xs, ys: [x[0] / y[0] for x, y in zip(xs, ys)]
  cpu = lambda xs, ys: _cpu_ratio([(x[1], y[1]) for x, y in zip(xs, ys)])
  median = lambda xs: statistics.median(x[0] for x in xs)
  ratios = wall(ta, tb)
  return Overhead(size, mesh_name(mesh) + ("" if mode == "auto" else f" ({mode})"), rounds,
                  median(ta), median(tc), median(tb), statistics.median(ratios),
                  statistics.median(wall(tc, tb)), _percentile(ratios, 0.1),
                  _percentile(ratios, 0.9), diff, cpu(ta, tb), median(td), cpu(td, tb),
                  cpu(tc, td))


# ------------------------------------------------------------------------------ output


def _b(n) -> str:
  if n is None:
    return "n/a"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _f(x) -> str:
  if x is None:
    return "n/a"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.2f}{unit}"
  return f"{x:.0f}"


# The HLO's matmuls and the model formula count the same products (the formula counts causal
# attention in full, as the XLA attention does), so they agree exactly; 0.1% leaves room only
# for rounding, not for a replicated or missing matmul.
FLOP_TOLERANCE = 1e-3


def flop_check(row: Row) -> tuple[bool, str]:
  """Whether the model formula and the compiled program's matmul FLOPs (per device x devices,
  loop trip counts applied) agree within `FLOP_TOLERANCE`, and a sentence saying why not."""
  ratio = row.hlo_dot_flops / row.model_flops
  ok = abs(ratio - 1) <= FLOP_TOLERANCE
  why = f"{row.size} on {row.mesh} x{row.devices}: HLO matmul FLOPs / model FLOPs = {ratio:.3f}"
  if ok:
    return ok, why
  cfg = model_config(row.size, row.seq)
  attn = 12.0 * cfg.layers * cfg.d_model * cfg.seq
  share = attn / (attn + 6.0 * _train_lm().matmul_params(cfg))
  if ratio > 1:
    why += (f"; the program multiplies more than the model: some matmuls run on several "
            f"devices instead of being split. Attention is {100 * share:.0f}% of the model "
            f"FLOPs; the {100 * (ratio - 1):.0f}% extra equals attention computed "
            f"{1 + (ratio - 1) / share:.2f} times (e.g. activations that lost their batch "
            "sharding: see fnscale.constrain_batch)")
  else:
    why += "; the compiled program multiplies less than the formula counts"
  return ok, why


def _step_table(rows: list[Row]) -> list[str]:
  """Compile, step time, MFU and FLOP columns, one row per benchmark row."""
  out = ["### Step", "",
          "| model | params | mesh | dev | compile cold s | warm s (cache) | step ms median "
          "[p10, p90] | tokens/s | MFU | model FLOPs/step | HLO matmul FLOPs | XLA cost "
          "analysis (loops once) |",
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    out.append(
        f"| {r.size} | {r.params / 1e6:.2f}M | {r.mesh} | {r.devices} | {r.compile_cold_s:.2f} "
        f"| {r.compile_warm_s:.2f} ({'hit' if r.warm_from_cache else 'MISS'}) "
        f"| {1e3 * r.step_s:.1f} [{1e3 * r.step_p10_s:.1f}, {1e3 * r.step_p90_s:.1f}] "
        f"| {r.tokens_per_s:,.0f} | {'n/a' if r.mfu is None else f'{100 * r.mfu:.1f}%'} "
        f"| {_f(r.model_flops)} | {_f(r.hlo_dot_flops)} ({r.hlo_dot_flops / r.model_flops:.2f}x)"
        f" | {_f(r.xla_flops)} |")
  return out


def _memory_table(rows: list[Row]) -> list[str]:
  """Per-device memory and collectives against the textbook volume."""
  out = ["### Memory and collectives per device", "",
          "| model | mesh | dev | params/dev | (of total) | arguments | temporaries | peak "
          "| collectives per step (runs [ops in the program], result bytes) | sent per step "
          "| textbook "
          "(dp / fsdp / tp) |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
  for r in rows:
    coll = ", ".join(f"{k} {v[0]} [{v[2]}] ({_b(v[1])})"
                     for k, v in r.report_collectives.items()) or "none"
    t = r.theory
    parts = " / ".join(_b(t[k]) for k in ("dp", "fsdp", "tp"))
    out.append(
        f"| {r.size} | {r.mesh} | {r.devices} | {_b(r.param_bytes)} "
        f"| 1/{r.param_bytes_total / r.param_bytes:.2f} | {_b(r.argument_bytes)} "
        f"| {_b(r.temp_bytes)} | {_b(r.peak_bytes)} | {coll} | {_b(r.wire_bytes)} "
        f"| {_b(t['total'])} ({parts}) |")
  return out


def _flop_notes(rows: list[Row]) -> list[str]:
  """The model-vs-HLO FLOP check and what XLA's cost analysis counts."""
  out = ["### FLOP cross-check", ""]
  bad = []
  for r in rows:
    ok, why = flop_check(r)
    if not ok:
      bad.append(why)
  worst = max(rows, key=lambda r: abs(r.hlo_dot_flops / r.model_flops - 1)) if rows else None
  if worst is not None:
    out.append(f"- Model FLOPs (6 N + 12 L d seq per token, PaLM appendix B) vs the matmul "
               f"FLOPs in the optimized HLO (per device x devices, loop trip counts applied): "
               f"largest difference {100 * (worst.hlo_dot_flops / worst.model_flops - 1):+.1f}% "
               f"({worst.size}, {worst.mesh}); tolerance {100 * FLOP_TOLERANCE:.1f}%.")
  out.extend(f"- {w}." for w in bad)
  out.append(
      "- XLA's cost analysis is per device for an SPMD program (the column is x devices) and "
      "counts each while-loop body once: the layers run under `lax.scan`, so it misses "
      "(layers - 1) of every block's forward and backward and is not comparable as is. With "
      "the loop bodies counted once the HLO matmuls give "
      + ", ".join(f"{r.size}/{r.mesh}/{r.devices}: {_f(r.hlo_dot_flops_once)} of XLA's "
                  f"{_f(r.xla_flops)}" for r in rows[:3])
      + "; the rest of XLA's count is elementwise work the model formula leaves out (LayerNorm, "
      "softmax, GELU, cross-entropy, AdamW's ~10 FLOPs per param).")
  return out


def _overhead_table(overheads: list[Overhead]) -> list[str]:
  """fnscale's step against the hand-written jax.jit one."""
  out = ["### Overhead: fnscale step vs hand-written jax.jit step", "",
         "| model | mesh | rounds | fnscale ms | its executable alone ms | jax.jit ms "
         "| ratio median [p10, p90] | executable alone / jax.jit | CPU s ratio "
         "| jax.jit + metrics ms | its CPU s / jax.jit | executable / it, CPU s "
         "| max param diff |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for o in overheads:
    out.append(f"| {o.size} | {o.mesh} | {o.rounds} | {1e3 * o.fnscale_s:.2f} "
               f"| {1e3 * o.program_s:.2f} | {1e3 * o.jit_s:.2f} "
               f"| {o.ratio:.3f} [{o.ratio_p10:.3f}, {o.ratio_p90:.3f}] "
               f"| {o.program_ratio:.3f} | {o.cpu_ratio:.3f} | {1e3 * o.metrics_jit_s:.2f} "
               f"| {o.metrics_cpu_ratio:.3f} | {o.program_vs_metrics_cpu:.3f} "
               f"| {o.max_param_diff:.1e} |")
  out += ["", "fnscale = `shard_step(train_step(loss, adamw))` called as users call it; its "
          "executable alone = the same compiled program called without fnscale's per-call "
          "input checks (structure, shape, dtype and sharding of every state and batch leaf, "
          "which move a misplaced input instead of recompiling); jax.jit = a hand-written "
          "step with the same shardings, optimizer and donation, returning the loss only; "
          "jax.jit + metrics = the same step computing, by hand, what fnscale's step reports "
          "beside the loss for float32 params (gradient norm, its stall flag): the "
          "cost of those metrics, and fnscale's program beside the same computation. CPU s: "
          "the process's CPU seconds per step, which other jobs on a shared machine disturb "
          "less than wall-clock time."]
  return out


def tables(rows: list[Row], overheads: list[Overhead], *, peak_note: str, header: str) -> str:
  """The benchmark's markdown: header, peak note, then the step, memory, FLOP and overhead
  sections (the last only when `overheads` is not empty)."""
  out = [header, "", peak_note, ""] + _step_table(rows) + [""] + _memory_table(rows) + [""]
  out += _flop_notes(rows)
  if overheads:
    out += [""] + _overhead_table(overheads)
  return "\n".join(out)


# ------------------------------------------------------------------------------ flags, main


@dataclasses.dataclass(frozen=True)
class Config:
  sizes: tuple = ("nano", "tiny", "wide")
  meshes: tuple = ("data=-1", "fsdp=-1", "fsdp=-1@shard_map")
  devices: tuple = ()  # () : `device_counts` of the devices present
  steps: int = 4
  warmup: int = 1
  batch: int = 8
  seq: int = 128
  overhead: tuple = ("nano:data=-1", "tiny:fsdp=-1")
  overhead_rounds: int = 30
  max_devices: int = 8
  json: str = ""
  full: bool = False
  hardware: hardware.Hardware = hardware.Hardware()  # --topology, --mesh_shape, --tpu


FULL = dict(sizes=("nano", "tiny", "wide", "small"),
            meshes=("data=-1", "fsdp=-1", "fsdp=-1@shard_map", "data=-1,tensor=2",
                    "fsdp=-1,tensor=2"), steps=20, warmup=3, batch=16, overhead_rounds=200)


def _define_flags(fv):
  d = Config()
  flags.DEFINE_list("sizes", list(d.sizes), "model sizes: train_lm's nano, tiny, small, medium, "
                    "or wide (2 layers x 512)", flag_values=fv)
  flags.DEFINE_multi_string("meshes", list(d.meshes), "mesh specs (repeat the flag), e.g. "
                            "--meshes=fsdp=-1 --meshes=data=2,tensor=2; '@shard_map' picks "
                            "shard_step's mode (default auto)", flag_values=fv)
  flags.DEFINE_list("devices", [str(x) for x in d.devices], "device counts (default 1, 2, "
                    "4, ... up to the devices present: --max_devices simulated on CPU); a "
                    "mesh that needs other sizes than a count is skipped", flag_values=fv)
  flags.DEFINE_integer("steps", d.steps, "timed steps per row", flag_values=fv)
  flags.DEFINE_integer("warmup", d.warmup, "untimed steps before timing", flag_values=fv)
  flags.DEFINE_integer("batch", d.batch, "global batch (rows), the same on every mesh",
                       flag_values=fv)
  flags.DEFINE_integer("seq", d.seq, "sequence length (bytes)", flag_values=fv)
  flags.DEFINE_multi_string("overhead", list(d.overhead), "SIZE:MESH pairs for the overhead "
                            "comparison at the largest device count (empty: none)",
                            flag_values=fv)
  flags.DEFINE_integer("overhead_rounds", d.overhead_rounds, "A/B rounds of the overhead "
                       "comparison", flag_values=fv)
  flags.DEFINE_integer("max_devices", d.max_devices, "simulated CPU devices", flag_values=fv)
  flags.DEFINE_string("json", d.json, "also write every number to this JSON file",
                      flag_values=fv)
  flags.DEFINE_boolean("full", d.full, f"more sizes, steps and rounds: {FULL}", flag_values=fv)
  hardware.define_flags(fv)  # train_lm's hardware options


def parse_flags(argv) -> Config:
  fv = flags.FlagValues()
  _define_flags(fv)
  cli.parse_values(fv, argv)
  given = {n for n in fv if fv[n].present}
  kw = dict(sizes=tuple(fv.sizes), meshes=tuple(fv.meshes),
            devices=tuple(int(x) for x in fv.devices), steps=fv.steps, warmup=fv.warmup,
            batch=fv.batch, seq=fv.seq, overhead=tuple(o for o in fv.overhead if o),
            overhead_rounds=fv.overhead_rounds, max_devices=fv.max_devices, json=fv.json,
            full=fv.full, hardware=hardware.from_values(fv))
  if fv.full:
    kw.update({k: v for k, v in FULL.items() if k not in given})
  cfg = Config(**kw)
  if (cfg.steps < 1 or cfg.warmup < 0 or cfg.batch < 1 or cfg.seq < 1
      or min(cfg.devices, default=1) < 1):
    raise fs.InputError(f"--steps={cfg.steps}, --warmup={cfg.warmup}, --batch={cfg.batch}, "
                          f"--seq={cfg.seq}, --devices={cfg.devices}: expected steps >= 1, "
                          "warmup >= 0, batch, seq and devices >= 1")
  return cfg


def device_counts(present: int) -> tuple:
  """The default device counts: 1, 2, 4, ... up to `present`, and `present` itself."""
  counts = [1 << i for i in range(present.bit_length()) if 1 << i <= present]
  return tuple(counts + ([present] if counts[-1] != present else []))


def _counts(cfg: Config, present: int) -> tuple:
  """`cfg.devices`, or the default counts; refuses counts beyond the devices present before
  anything runs (the overhead rows run on the largest)."""
  if not cfg.devices:
    return device_counts(present)
  if max(cfg.devices) > present:
    raise fs.InputError(
        f"--devices={','.join(map(str, cfg.devices))}: {present} device(s) present; fix: "
        f"leave --devices out (1, 2, 4, ... up to the devices present), give counts up to "
        f"{present}, or on CPU --max_devices={max(cfg.devices)} (simulated devices).")
  return cfg.devices


def _machine() -> str:
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
  d = jax.devices()[0]
  return (f"fnscale benchmark: jax {jax.__version__}, {jax.device_count()} x {d.platform} "
          f"({d.device_kind}), {os.cpu_count()} host cores, load average "
          f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)")


def _peak(topo: fs.Topology, platform: str) -> tuple[float | None, str]:
  """(the host's measured matmul FLOP/s on CPU, else None; the note saying what the MFU
  denominator is)."""
  if platform == "cpu":
    host = fs.analysis.host_matmul_peak()  # measured once per machine, cached
    return host.flops, (
        f"Peak FLOP/s (MFU denominator): a 2048x2048 float32 matmul, {host.flops / 1e9:.0f} "
        f"GFLOP/s for the whole host (fs.analysis.host_matmul_peak, measured {host.measured}"
        f"{', cached in ' + host.path if host.path else ''}); the simulated devices share "
        "it (devices x peak per device = that rate). CPU numbers are relative.")
  per = topo.peak_flops_per_device
  return None, (f"Peak FLOP/s per device: {per / 1e12:.0f} TFLOP/s (bf16 facts table)" if per
                else "Peak FLOP/s unknown for this device kind: MFU not reported")


def _rows(cfg: Config, topo: fs.Topology, peak_host: float | None, say):
  """(a `measure` row per size, mesh and device count; why each one skipped was)."""
  rows, skipped = [], []
  for size in cfg.sizes:
    for spec in cfg.meshes:
      for n in cfg.devices:
        if n == 1 and spec != cfg.meshes[0]:
          continue  # on one device every mesh is the same program
        per_device = peak_host / n if peak_host else topo.peak_flops_per_device
        try:
          row = measure(size, spec, n, batch=cfg.batch, seq=cfg.seq, steps=cfg.steps,
                        warmup=cfg.warmup, peak_per_device=per_device)
        except fs.FnscaleError as e:
          skipped.append(f"{size} {spec} on {n} devices: {e}")
          logging.info("skipped %s %s x%d: %s", size, spec, n, e)
          continue
        rows.append(row)
        say(f"# {row.size} {row.mesh}: step {1e3 * row.step_s:.1f} ms, compile "
            f"{row.compile_cold_s:.2f} s cold / {row.compile_warm_s:.2f} s warm")
  return rows, skipped


def run(cfg: Config, *, say=print) -> dict:
  """Runs the benchmark per `cfg`; returns {"rows", "overhead", "peak", "text"}."""
  fs.simulate_cpu_devices(cfg.max_devices)
  import jax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  cfg = dataclasses.replace(cfg, devices=_counts(cfg, jax.device_count()))
  topo = hardware.detect(cfg.hardware)
  peak_host, note = _peak(topo, jax.devices()[0].platform)
  with tempfile.TemporaryDirectory(prefix="fnscale-bench-cache-") as cache, \
      persistent_cache(cache):
    rows, skipped = _rows(cfg, topo, peak_host, say)
    overheads = []
    n = max(cfg.devices)
    for pair in cfg.overhead:
      size, _, spec = pair.partition(":")
      rounds = cfg.overhead_rounds
      overheads.append(overhead(size, spec or "fsdp=-1", n, batch=cfg.batch, seq=cfg.seq,
                                rounds=rounds, warmup=max(cfg.warmup, 2)))
      say(f"# overhead {size}: {overheads[-1].ratio:.3f}")
  text = tables(rows, overheads, peak_note=note,
                header=_machine() + "\n" + hardware.describe(topo))
  if skipped:
    text += "\n\nSkipped (the mesh does not fit):\n" + "\n".join(f"- {s}" for s in skipped)
  result = {"rows": [dataclasses.asdict(r) for r in rows],
            "overhead": [o._asdict() for o in overheads], "peak_flops_host": peak_host,
            "skipped": skipped, "text": text, "config": dataclasses.asdict(cfg)}
  if cfg.json:
    with open(cfg.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1, default=str)
  return result


def main(argv) -> int:
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    fv = flags.FlagValues()
    _define_flags(fv)
    print(__doc__ + "\nflags:\n" + fv.get_help())
    return 0
  try:
    cfg = parse_flags(argv)
    result = run(cfg, say=lambda s: print(s, file=sys.stderr, flush=True))
  except fs.FnscaleError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  print(result["text"], flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
