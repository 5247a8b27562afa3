"""Where a step's time goes: a JAX profiler trace read without TensorBoard.

`jax.profiler.start_trace(dir)` / `stop_trace()` write `dir/plugins/profile/<run>/<host>
.xplane.pb` (an XSpace protobuf; jax 0.10 also writes `<host>.trace.json.gz` beside it).
`jax.profiler.ProfileData.from_file` reads the XSpace: a TPU's plane ("/device:TPU:0") has
a line "XLA Ops" whose events are the executed HLO instructions (named as in the compiled
module's text) and a line "XLA Modules" with one event per program run. On CPU the executed
instructions are host-thread events carrying an `hlo_op` stat.

`split(xplane_path, hlo_text, runs)` sorts each executed instruction into a category by the
optimized HLO (`compiled.as_text()`), what it computes rather than how the trace viewer
groups it:

- "matmul": a convolution or dot, or a fusion whose computation holds one;
- "attention": a Pallas/Mosaic kernel (`tpu_custom_call`; the splash attention kernels);
- "collective": all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute and
  their async starts and dones;
- "elementwise": every other fusion, copy, transpose, reduce, scatter/gather...;
- "idle": the rest of the traced steps' wall time (the device waiting on the host or a
  transfer).

Example (CPU):
  >>> import jax, jax.numpy as jnp, tempfile
  >>> f = jax.jit(lambda a: jnp.tanh(a @ a))
  >>> a = jnp.ones((256, 256)); _ = f(a).block_until_ready()
  >>> d = tempfile.mkdtemp()
  >>> jax.profiler.start_trace(d); _ = f(a).block_until_ready(); jax.profiler.stop_trace()
  >>> s = split(find_xplane(d), f.lower(a).compile().as_text(), runs=1)
  >>> s.seconds["matmul"] > 0
  True
"""
from __future__ import annotations

import glob
import os
import re
from typing import NamedTuple

import jax

CATEGORIES = ("matmul", "attention", "elementwise", "collective", "idle")
# Ops whose trace events span the ops they run (a loop's event covers its body's): not
# counted themselves.
_CONTROL = ("while", "conditional", "call")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_EVENT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")


class Split(NamedTuple):
  """Seconds per step in each of `CATEGORIES`, the step's wall time (seconds), the
  fraction of busy device time whose instruction the HLO did not name (0 when all did), and
  the instructions that took longest: (name, category, seconds per step), longest first."""
  seconds: dict
  step_s: float
  unmatched: float
  top: tuple = ()

  def fractions(self) -> dict:
    """Each category's share of the step time."""
    return {k: v / self.step_s for k, v in self.seconds.items()} if self.step_s else {}

  def line(self) -> str:
    """One line: `matmul 61.2% | attention 9.8% | ...` and the step time."""
    parts = " | ".join(f"{k} {100 * v:.1f}%" for k, v in self.fractions().items())
    return f"{parts} (step {1e3 * self.step_s:.1f} ms)"


def find_xplane(log_dir: str) -> str:
  """The newest `*.xplane.pb` under `log_dir` (a `jax.profiler.trace` directory)."""
  found = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
  if not found:
    raise FileNotFoundError(f"no *.xplane.pb under {log_dir}/plugins/profile")
  return max(found, key=os.path.getmtime)


def categories(hlo_text: str) -> dict[str, str]:
  """Instruction name -> category for every instruction of an optimized HLO module."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    head = _HEAD.match(line)
    if head and "=" not in line.split("{")[0]:
      current = comps.setdefault(head.group(1), [])
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      current.append((m.group(1), m.group(2), line))
  matmul_comps = _computations_with_dots(comps)
  out = {}
  for instrs in comps.values():
    for name, op, line in instrs:
      out[name] = _category(op, line, matmul_comps)
  return out


def _computations_with_dots(comps: dict) -> set[str]:
  """Computations that hold a convolution or dot, directly or through a called one."""
  direct = {c for c, instrs in comps.items() if any(op in ("convolution", "dot")
                                                    for _, op, _ in instrs)}
  calls = {c: {m for _, _, line in instrs for m in _CALLS.findall(line)}
           for c, instrs in comps.items()}
  found, changed = set(direct), True
  while changed:
    changed = False
    for c, called in calls.items():
      if c not in found and called & found:
        found.add(c)
        changed = True
  return found


def _category(op: str, line: str, matmul_comps: set[str]) -> str:
  if op in _CONTROL:
    return "control"
  base = op.removesuffix("-start").removesuffix("-done")
  if base in _COLLECTIVES:
    return "collective"
  if op in ("convolution", "dot"):
    return "matmul"
  if op == "custom-call" and "tpu_custom_call" in line:
    return "attention"
  if op == "fusion" and set(_CALLS.findall(line)) & matmul_comps:
    return "matmul"
  return "elementwise"


def op_name(event_name: str) -> str:
  """The HLO instruction name of a trace event: a TPU's "XLA Ops" events are named by the
  instruction's whole text ("%fusion.285 = s32[2,8]{...} fusion(...), kind=kLoop, ..."),
  a CPU's by the bare name."""
  m = _EVENT.match(event_name)
  return m.group(1) if m else event_name


def _device_events(data):
  """(op name, start ns, duration ns) of executed HLO ops, and the module runs' wall span
  (ns) on the first device plane that has them; else (CPU) host events with an hlo_op. The
  device's "Async XLA Ops" line (copies and slices in flight beside the compute) is left
  out: its spans overlap the ops that run."""
  for plane in data.planes:
    if not plane.name.startswith("/device:") or "CUSTOM" in plane.name:
      continue
    lines = {line.name: list(line.events) for line in plane.lines}
    if "XLA Ops" in lines:
      ops = [(op_name(e.name), e.start_ns, e.duration_ns) for e in lines["XLA Ops"]]
      mods = lines.get("XLA Modules") or []
      return ops, [(e.start_ns, e.start_ns + e.duration_ns) for e in mods]
  ops = []
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        if "hlo_op" in stats:
          ops.append((str(stats["hlo_op"]), e.start_ns, e.duration_ns))
  return ops, []


def _union_ns(intervals) -> float:
  """Total length of the union of (start, end) intervals."""
  total, end = 0.0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def split(trace, hlo_text: str, runs: int) -> Split:
  """The per-step split of the `runs` program runs traced in `trace` (an .xplane.pb path or
  a `jax.profiler.ProfileData`; see the module docstring); `hlo_text`: the optimized HLO of
  the traced program."""
  data = (trace if isinstance(trace, jax.profiler.ProfileData)
          else jax.profiler.ProfileData.from_file(trace))
  ops, modules = _device_events(data)
  names = categories(hlo_text)
  busy = {k: [] for k in CATEGORIES[:-1]}
  unmatched, total, per_op = 0.0, 0.0, {}
  for name, start, dur in ops:
    key = names.get(name)
    if key == "control":
      continue
    if key is None:
      unmatched += dur
      key = "elementwise"
    busy[key].append((start, start + dur))
    total += dur
    per_op[(name, key)] = per_op.get((name, key), 0.0) + dur
  seconds = {k: _union_ns(v) * 1e-9 / runs for k, v in busy.items()}
  spans = modules or [(s, s + d) for _, s, d in ops]
  wall = (max(b for _, b in spans) - min(a for a, _ in spans)) * 1e-9 / runs if spans else 0.0
  seconds["idle"] = max(0.0, wall - sum(seconds.values()))
  top = sorted(((n, k, d * 1e-9 / runs) for (n, k), d in per_op.items()), key=lambda t: -t[2])
  return Split(seconds, wall, unmatched / total if total else 0.0, tuple(top[:15]))
