"""Reading optimized HLO text: collectives and matmul FLOPs, with while-loop trip counts applied.

Pure functions over the text of `jax.stages.Compiled.as_text()` (the partitioned, per-device
program of an SPMD step). The module is split into computations and a call graph; every
computation gets the number of times it runs per step, the product of the `known_trip_count`
of the while loops around it (XLA records it in the loop's `backend_config`). A `lax.scan`
over layers or a gradient-accumulation loop therefore counts its body's matmuls and
collectives once per iteration, where XLA's own `cost_analysis()` counts a loop body once.

Where a loop has no `known_trip_count` (the TPU compiler drops it), the count is read from
its condition `i < N` (`Loop.from_condition`). Limits: a loop whose count is found neither
way counts once (`HloSummary.unknown_trip_counts`); every branch of a `conditional` counts
as if it ran; matmuls are `dot` and `convolution` ops (what XLA emits on CPU and TPU);
library calls such as cuBLAS `custom-call`s on GPU are not counted.
"""
from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

from fnscale.errors import StepError

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "HloSummary",
    "Loop",
    "collectives",
    "flops_ratio",
    "matmul_flops",
    "ring_bytes_sent",
    "summarize",
]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast")


class Collective(NamedTuple):
  """One kind of collective in an optimized HLO module, per device and per step.

  `kind`: one of `COLLECTIVE_KINDS` (async `-start`/`-done` pairs count once, under the base
  kind); `count`: executions per step, each op multiplied by the trip counts of the while
  loops around it; `bytes`: sum of their result sizes in bytes per device per step (for
  reduce-scatter the scattered shard), trip counts applied; `ops`: ops of that kind in the
  module text, each counted once; `bytes_sent`: bytes one device sends per step under ring
  algorithms (`ring_bytes_sent`), trip counts applied.
  """
  kind: str
  count: int
  bytes: int
  ops: int = 0
  bytes_sent: float = 0.0


class Loop(NamedTuple):
  """A while loop: its `body` computation's name and `trip_count` (None where unknown).

  The trip count is XLA's `known_trip_count` where the loop's `backend_config` has one; else
  (`from_condition` True; the TPU compiler drops that config) N from a condition
  `i < N` on a tuple element against a constant, assuming the counter starts at 0 and steps
  by 1, as `lax.scan` and `lax.fori_loop(0, N, ...)` lower.
  """
  body: str
  trip_count: int | None
  from_condition: bool = False


class HloSummary(NamedTuple):
  """What `summarize` reads from one optimized HLO module; numbers are per device per step.

  `matmul_flops`: 2 x result elements x contracted size summed over every `dot` and
  `convolution`, loop trip counts applied (FLOPs); `matmul_flops_once`: the same with every
  reachable loop body counted once, as XLA's cost analysis does; `collectives`: tuple of
  `Collective` in `COLLECTIVE_KINDS` order; `loops`: every while loop; `num_devices`: devices
  a collective without replica groups spans (the module's replicas x partitions unless given);
  `groups`: (kind, devices per replica group, ring bytes sent per device per step) for each
  kind and group size present (a group size names the mesh axis a collective runs on).
  """
  matmul_flops: float
  matmul_flops_once: float
  collectives: tuple[Collective, ...]
  loops: tuple[Loop, ...]
  num_devices: int
  groups: tuple[tuple[str, int, float], ...] = ()

  @property
  def unknown_trip_counts(self) -> int:
    """While loops without a known trip count (their bodies counted once)."""
    return sum(l.trip_count is None for l in self.loops)

  def collective(self, kind: str) -> Collective:
    """The entry for `kind`, or a zero one."""
    return next((c for c in self.collectives if c.kind == kind), Collective(kind, 0, 0))


_HEAD_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.+)$")
_OP_RE = re.compile(r"\s(?P<op>[a-z][\w\-]*)\((?P<args>.*)$")
_ARRAY_RE = re.compile(r"\b(pred|[subfc]\d+|bf16|f8e\w+|f4e\w+)\[([\d,]*)\]")
_CALL_RE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                      r"false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY_RE = re.compile(r"\bbody=%?([\w.\-]+)")
_COND_RE = re.compile(r"\bcondition=%?([\w.\-]+)")
_OPERAND_RE = re.compile(r"((?:[\w\[\],{}:()]+\s+)?)%([\w.\-]+)")
_LINE_START_RE = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=")
_DEVICES_RE = re.compile(r"\b(replica_count|num_partitions)=(\d+)")


def _dtype_bytes(name: str) -> float:
  """Bytes per element of an HLO element type (`f32` 4, `bf16` 2, `s4` 0.5, `pred` 1)."""
  if name == "pred":
    return 1
  if name == "bf16":
    return 2
  m = re.match(r"[subfc](\d+)$", name)
  if m:
    return int(m.group(1)) / 8
  m = re.match(r"f(\d)", name)  # f8e4m3fn, f4e2m1fn
  return int(m.group(1)) / 8 if m else 0


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dims) of every array in an HLO shape (a tuple gives several)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d))
          for t, dims in _ARRAY_RE.findall(shape_text)]


def _shape_bytes(shape_text: str) -> float:
  return sum(math.prod(d) * _dtype_bytes(t) for t, d in _arrays(shape_text))


def _group_size(line: str, num_devices: int) -> int:
  """Devices in one replica group of a collective (all of them where no groups are given)."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  return num_devices


def ring_bytes_sent(kind: str, result_bytes: float, group_size: int) -> float:
  """Bytes one device sends for one collective under ring algorithms.

  Args:
    kind: one of `COLLECTIVE_KINDS`.
    result_bytes: the op's result size per device in bytes (for reduce-scatter the shard).
    group_size: devices in the op's replica group (n).

  Returns:
    Bytes: all-reduce 2 (n - 1) / n x result (reduce-scatter then all-gather, Patarasuk &
    Yuan, 2009, "Bandwidth optimal all-reduce algorithms"); all-gather and all-to-all
    (n - 1) / n x result; reduce-scatter (n - 1) x shard; collective-permute and
    collective-broadcast the result; 0 for a group of one device.

  Raises:
    StepError: an unknown `kind`.
  """
  if kind not in COLLECTIVE_KINDS:
    raise StepError(f"collective kind {kind!r} is not known; expected one of "
                    f"{list(COLLECTIVE_KINDS)}")
  n = group_size
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2 * (n - 1) / n * result_bytes
  if kind in ("all-gather", "all-to-all"):
    return (n - 1) / n * result_bytes
  if kind == "reduce-scatter":
    return (n - 1) * result_bytes
  return float(result_bytes)


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """Computation name -> its instruction lines, and the entry's name. Instruction lines
  outside any computation (a snippet) form the computation named ''. A computation ends at
  a line that is only "}"; lines that don't start an instruction continue the one above."""
  comps: dict[str, list[str]] = {"": []}
  entry, cur = None, None
  for line in text.splitlines():
    if cur is None:
      m = _HEAD_RE.match(line)
      if m and not line.startswith("HloModule"):
        cur = m.group("name")
        comps[cur] = []
        if line.startswith("ENTRY"):
          entry = cur
      else:
        comps[""].append(line)
    elif line.strip() == "}":
      cur = None
    elif comps[cur] and not _LINE_START_RE.match(line):
      # An attribute that spans lines (a Pallas kernel's `frontend_attributes` JSON, whose
      # continuation may start with "}}") belongs to the instruction above.
      comps[cur][-1] += " " + line.strip()
    else:
      comps[cur].append(line)
  return comps, entry


def _operands(args: str) -> list[str]:
  """Operand names of an instruction: the %names before its closing parenthesis."""
  return re.findall(r"%([\w.\-]+)", args.split(")")[0])


def _tuple_index(defs: dict, name: str) -> int | None:
  """k where `name` is `get-tuple-element(param), index=k`."""
  d = defs.get(name)
  m = re.search(r"index=(\d+)", d[2]) if d and d[0] == "get-tuple-element" else None
  return int(m.group(1)) if m else None


def _loop_trips(cond: str, body: str, init: str | None, caller: str, defs: dict,
                consts: dict) -> int | None:
  """Trips of a while loop whose condition's ROOT is `compare(counter, N), direction=LT`
  (or `N > counter`) on tuple element k: ceil((N - start) / step), where the body's ROOT
  tuple sets element k to `counter + step` and the caller's init tuple gives `start` (0 where
  it is not a constant). XLA unrolls windowed-einsum loops this way: a body that does two
  iterations' work steps its counter by 2."""
  cdefs, root = defs.get(cond, {}), defs.get(cond, {}).get("ROOT")
  if not root or root[0] != "compare":
    return None
  names, direction = _operands(root[1]), re.search(r"direction=(\w+)", root[2])
  if len(names) != 2 or not direction or direction.group(1) not in ("LT", "GT"):
    return None
  counter, bound = names if direction.group(1) == "LT" else names[::-1]
  k = _tuple_index(cdefs, counter)
  if bound not in consts.get(cond, {}) or k is None:
    return None
  step, bdefs = 1, defs.get(body, {})
  broot = bdefs.get("ROOT")
  if broot and broot[0] == "tuple" and k < len(_operands(broot[1])):
    upd = bdefs.get(_operands(broot[1])[k])
    if upd and upd[0] == "add":
      a, b = (_operands(upd[1]) + [None, None])[:2]
      c = next((consts[body][x] for x in (a, b) if x in consts.get(body, {})), None)
      other = b if a in consts.get(body, {}) else a
      if c and c > 0 and _tuple_index(bdefs, other) == k:
        step = c
  start, tup = 0, defs.get(caller, {}).get(init or "")
  if tup and tup[0] == "tuple" and k < len(_operands(tup[1])):
    start = consts.get(caller, {}).get(_operands(tup[1])[k], 0)
  return max(-(-(consts[cond][bound] - start) // step), 0)


def _taps(size_in: int, size_out: int, window: int, pad_lo: int, stride: int, lhs_dilate: int,
          rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dim whose tap reads the input rather
  than padding or a dilation hole (XLA's convolution semantics)."""
  last, count = (size_in - 1) * lhs_dilate, 0
  for w in range(window):
    off = w * rhs_dilate - pad_lo
    if lhs_dilate == 1:
      lo = max(0, -(off // stride))  # ceil(-off / stride)
      hi = min(size_out - 1, (last - off) // stride)
      count += max(0, hi - lo + 1)
    else:
      count += sum(1 for o in range(size_out)
                   if 0 <= o * stride + off <= last and (o * stride + off) % lhs_dilate == 0)
  return count


def _window_taps(size_in: list[int], size_out: list[int], window: str) -> float:
  """Product over spatial dims of the taps landing on input (`_taps`), from the text of a
  convolution's `window={size=.. pad=.. stride=.. lhs_dilate=.. rhs_dilate=..}`.

  XLA on TPU writes some dots as convolutions whose window slides over zero padding (a
  batch or head dim as a spatial dim, `pad=31_31` around a window of 32): only the taps on
  the input multiply, so counting the whole window would overstate such a dot 32 times.
  """
  fields = dict(re.findall(r"(\w+)=([-\d_x]+)", window))
  nd = len(size_in)
  per_dim = lambda name, default: ([int(v) for v in fields[name].split("x")]
                                   if name in fields else [default] * nd)
  sizes, strides = per_dim("size", 1), per_dim("stride", 1)
  lhs_d, rhs_d = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
  pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
          else [0] * nd)
  return float(math.prod(_taps(size_in[i], size_out[i], sizes[i], pads[i], strides[i], lhs_d[i],
                               rhs_d[i]) for i in range(nd)))


def _matmul_flops(op: str, line: str, shape: str, args: str, shapes: dict[str, str]) -> float:
  """FLOPs of one dot or convolution: 2 x result elements x multiply-adds per element."""
  out = _arrays(shape)
  operands = _OPERAND_RE.findall(args)
  if not out or not operands:
    return 0.0
  lhs = _arrays(operands[0][0] or shapes.get(operands[0][1], ""))
  if not lhs:
    return 0.0
  lhs_dims = lhs[0][1]
  if op == "dot":
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    k = math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
  else:  # convolution: input features per group x window taps that land on the input
    labels = re.search(r"dim_labels=(\w+)_\w+->(\w+)", line)
    if not labels or "f" not in labels.group(1):
      return 0.0
    lhs_l, out_l = labels.group(1), labels.group(2)
    groups = re.search(r"feature_group_count=(\d+)", line)
    k = lhs_dims[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
    spatial = sorted(c for c in lhs_l if c.isdigit())
    window = re.search(r"window=\{([^}]*)\}", line)
    taps = _window_taps([lhs_dims[lhs_l.index(c)] for c in spatial],
                        [out[0][1][out_l.index(c)] for c in spatial],
                        window.group(1) if window else "")
    return 2.0 * math.prod(out[0][1]) / math.prod(
        out[0][1][out_l.index(c)] for c in spatial) * taps * k
  return 2.0 * math.prod(out[0][1]) * k


class _Graph(NamedTuple):
  """What `_read_computation` collects from every computation of a module (build one with
  `_graph()`: fresh containers each time)."""
  edges: dict  # comp -> [(callee, factor)]
  whiles: list  # (caller, body, condition, init operand, known trip count)
  defs: dict  # comp -> instr -> (op, args, line); "ROOT" -> the root's
  consts: dict  # comp -> instr -> integer scalar constant
  dots: dict  # comp -> matmul FLOPs per run
  colls: dict  # comp -> [(kind, result bytes, group size)]


def _graph() -> _Graph:
  dd = collections.defaultdict
  return _Graph(dd(list), [], dd(dict), dd(dict), dd(float), dd(list))


def _read_computation(name: str, lines: list[str], num_devices: int, g: _Graph) -> None:
  """Adds one computation's instructions, calls, loops, dots and collectives to `g`."""
  shapes: dict[str, str] = {}
  starts: dict[str, int] = {}
  for line in lines:
    m = _INSTR_RE.match(line)
    op_m = _OP_RE.search(m.group("rest")) if m else None
    if not op_m:
      continue
    rest = m.group("rest")
    shape, op, args = rest[:op_m.start()], op_m.group("op"), op_m.group("args")
    shapes[m.group("name")] = shape
    g.defs[name][m.group("name")] = (op, args, line)
    if line.lstrip().startswith("ROOT"):
      g.defs[name]["ROOT"] = (op, args, line)
    if op == "constant" and re.match(r"\s*[su](32|64)\[\]", shape):
      g.consts[name][m.group("name")] = int(args.split(")")[0])
    if op == "while":
      t = _TRIP_RE.search(line)
      body, cond = _BODY_RE.search(line), _COND_RE.search(line)
      g.whiles.append((name, body.group(1) if body else "?", cond.group(1) if cond else "?",
                       (_operands(args) or [None])[0], int(t.group(1)) if t else None))
    # An async op's -done (and -update) names the same computation as its -start.
    elif not op.startswith("async-") or op == "async-start":
      g.edges[name].extend((c, 1) for c in _CALL_RE.findall(line))
    branches = _BRANCHES_RE.search(line)
    if branches:
      g.edges[name].extend((c.strip().lstrip("%"), 1) for c in branches.group(1).split(","))
    if op in ("dot", "convolution"):
      g.dots[name] += _matmul_flops(op, line, shape, args, shapes)
      continue
    base = next((c for c in COLLECTIVE_KINDS if op in (c, c + "-start", c + "-done")), None)
    if base is None:
      continue
    if op.endswith("-start"):
      starts[m.group("name")] = _group_size(line, num_devices)
      continue
    if op.endswith("-done"):
      src = re.search(r"%([\w.\-]+)", args)
      n = starts.get(src.group(1), num_devices) if src else num_devices
    elif base in ("collective-permute", "collective-broadcast"):
      n = 2  # a device sends its buffer once
    else:
      n = _group_size(line, num_devices)
    g.colls[name].append((base, _shape_bytes(shape), n))


def summarize(hlo_text: str, num_devices: int | None = None) -> HloSummary:
  """Matmul FLOPs and collective traffic of one optimized HLO module, loops unrolled by count.

  Args:
    hlo_text: `jax.stages.Compiled.as_text()` (optimized, partitioned HLO: shapes per device),
      or instruction lines without computations (read as one computation that runs once).
    num_devices: devices a collective without `replica_groups` spans; default the module's
      `replica_count` x `num_partitions` (1 where the text has no module header).

  Returns:
    An `HloSummary` (FLOPs and bytes per device per step).

  Raises:
    StepError: `hlo_text` is not a string or `num_devices` is below 1.
  """
  if not isinstance(hlo_text, str):
    raise StepError(f"hlo_text is a {type(hlo_text).__name__}, expected the str of "
                    "`jax.stages.Compiled.as_text()`")
  if num_devices is None:
    header = dict(_DEVICES_RE.findall(hlo_text.split("\n", 1)[0]))
    num_devices = int(header.get("replica_count", 1)) * int(header.get("num_partitions", 1))
  if int(num_devices) < 1:
    raise StepError(f"num_devices={num_devices}, expected at least 1")
  comps, entry = _computations(hlo_text)

  g = _graph()
  for name, lines in comps.items():
    _read_computation(name, lines, int(num_devices), g)
  edges, defs, consts, dots, colls = g.edges, g.defs, g.consts, g.dots, g.colls

  loops = []
  for caller, body, cond, init, known in g.whiles:
    trips = _loop_trips(cond, body, init, caller, defs, consts) if known is None else None
    loop = Loop(body, known) if known is not None else Loop(body, trips, trips is not None)
    loops.append(loop)
    # An unknown count runs the body once; a count of 0 never runs it.
    body_runs = 1 if loop.trip_count is None else loop.trip_count
    edges[caller].extend(((body, body_runs), (cond, (loop.trip_count or 0) + 1)))

  mult = _multiplicities(comps, edges, entry)
  out: dict[str, list] = {}
  groups: dict[tuple[str, int], float] = collections.defaultdict(float)
  for c, items in colls.items():
    for kind, nbytes, n in items:
      groups[(kind, n)] += ring_bytes_sent(kind, nbytes, n) * mult[c]
      e = out.setdefault(kind, [0, 0.0, 0, 0.0])
      e[0] += mult[c]
      e[1] += nbytes * mult[c]
      e[2] += 1 if mult[c] else 0
      e[3] += ring_bytes_sent(kind, nbytes, n) * mult[c]
  return HloSummary(
      matmul_flops=sum(f * mult[c] for c, f in dots.items()),
      matmul_flops_once=sum(f for c, f in dots.items() if mult[c]),
      collectives=tuple(Collective(k, int(v[0]), int(v[1]), v[2], float(v[3]))
                        for k in COLLECTIVE_KINDS if (v := out.get(k)) and v[2]),
      loops=tuple(loops), num_devices=int(num_devices),
      groups=tuple((k, n, b) for (k, n), b in sorted(groups.items()) if b))


def _multiplicities(comps: dict, edges: dict, entry: str | None) -> dict[str, int]:
  """How many times each computation runs per execution of the module (0: never called).

  Roots (run once): the ENTRY computation, or where the text has none every computation no
  other one calls, and the '' snippet computation. Called computations accumulate caller
  count x edge factor in topological order (HLO call graphs are acyclic).
  """
  called = {c for es in edges.values() for c, _ in es}
  roots = [entry] if entry is not None else [c for c in comps if c and c not in called]
  mult: dict[str, int] = collections.defaultdict(int)
  for r in roots + [""]:
    mult[r] = 1
  indegree: dict[str, int] = collections.defaultdict(int)
  for es in edges.values():
    for c, _ in es:
      indegree[c] += 1
  ready = [c for c in comps if indegree[c] == 0]
  while ready:
    c = ready.pop()
    for child, factor in edges.get(c, ()):
      mult[child] += mult[c] * factor
      indegree[child] -= 1
      if indegree[child] == 0:
        ready.append(child)
  return mult


def collectives(hlo_text: str, num_devices: int | None = None) -> tuple[Collective, ...]:
  """The collectives of an optimized HLO module, executions and bytes per device per step.

  Each op counts once per run of its computation (while-loop trip counts applied); async
  pairs count at their `-done` op, whose result is the collective's output. Returns one
  `Collective` per kind present, in `COLLECTIVE_KINDS` order. Args and errors as `summarize`.
  """
  return summarize(hlo_text, num_devices).collectives


def matmul_flops(hlo_text: str, *, apply_trip_counts: bool = True) -> float:
  """Matmul FLOPs per device per step of an optimized HLO module (`dot` and `convolution`).

  2 x result elements x contracted elements per op; with `apply_trip_counts` each op is
  multiplied by the runs of its computation (while-loop trip counts), else every reachable
  loop body counts once (as XLA's `cost_analysis()` does). Errors as `summarize`.
  """
  s = summarize(hlo_text)
  return s.matmul_flops if apply_trip_counts else s.matmul_flops_once


def flops_ratio(hlo_text: str, model_flops: float) -> float:
  """HLO matmul FLOPs per device per step (`matmul_flops`) / `model_flops` per device.

  With `model_flops` the FLOPs the step's own matmuls need (`fnscale._cost.jaxpr_matmul_flops`
  of the traced step, remat included), 1.0 says the compiled program does the model's work
  and no more; with PaLM's 6N + attention (`fnscale.flops.model_flops_per_token` x tokens /
  devices), remat's recomputation shows above 1 and attention inside a Pallas kernel (a
  custom call, not counted here) below.

  Raises:
    StepError: `model_flops` not a positive number, or a bad `hlo_text` (as `summarize`).
  """
  if isinstance(model_flops, bool) or not isinstance(model_flops, (int, float)) or not (
      model_flops > 0):
    raise StepError(f"model_flops={model_flops!r}, expected a positive number of FLOPs per "
                    "device per step")
  return summarize(hlo_text).matmul_flops / float(model_flops)
