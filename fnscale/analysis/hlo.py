"""Reading optimized HLO text: collectives and matmul FLOPs, with while-loop trip counts applied.

Pure functions over the text of `jax.stages.Compiled.as_text()` (the partitioned, per-device
program of an SPMD step) or of an XLA dump (`--xla_dump_to`, `*after_optimizations.txt`, which
writes tuple elements as `%param#0` instead of `get-tuple-element` instructions). The module is
split into computations and a call graph; every computation gets the number of times it runs
per step, the product of the `known_trip_count` of the while loops around it (XLA records it
in the loop's `backend_config`). A `lax.scan` over layers or a gradient-accumulation loop
therefore counts its body's matmuls and collectives once per iteration, where XLA's own
`cost_analysis()` counts a loop body once.

Where a loop has no `known_trip_count` (the TPU compiler drops it), the count is read from
its condition `i < N` (`Loop.from_condition`), looking through copies and the one-op fusions
XLA's CPU backend wraps the compare and the counter's increment in.

Matmuls are `dot`, `ragged-dot` (grouped matmuls, `lax.ragged_dot`) and `convolution` ops
(what XLA emits on CPU and TPU, and inside GPU Triton and cuDNN fusions) and the GPU library
calls that replace them: cuBLAS GEMMs (`__cublas$gemm`, `__cublas$lt$matmul`,
`__cublas$lt$matmul$f8`), cuDNN convolutions (forward, backward input, backward filter) and
cuDNN fused attention (`__cudnn$fmha*`).
Custom kernels (Pallas on TPU or GPU, Mosaic GPU, Triton) are listed, not counted
(`Summary.kernels`); grouped matmuls (`ragged-dot` and the kernels XLA and megablox run
for it) are also summed apart, over their whole buffers (`Summary.grouped_flops`). A
`ragged-all-to-all` (sync or async) counts as a collective of the smaller of its operand and
result, and an async `call-start`/`custom-call-start` with its `-update`s and `-done` (TPU
SparseCore offloads) by the computation it calls. Nothing is skipped silently: what could
not be read is returned in
`Summary.unread` (instructions by opcode, among them every opcode whose work is not
counted here, such as `fft`, `triangular-solve`, `cholesky` or `scaled-dot`, and any opcode
not known here; loops without a trip count; collectives whose replica groups were
guessed). Every branch of a `conditional` counts as if it ran.

The TPU compiler writes many reduce-scatters as a fusion whose computation returns a
`dynamic-slice` of an `all-reduce` (libtpu names it `all-reduce-scatter`, its emitter
`AllReduceScatterFusion`): each is counted as the reduce-scatter it runs, (n-1)/n of the
reduced bytes sent, not as its inner all-reduce's 2 (n-1)/n.

Examples:
  Instruction lines without computations read as one computation that runs once; a
  compiled step's `as_text()` is read the same way, whole.

  >>> import fnscale as fs
  >>> hlo = fs.analysis.hlo
  >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
  ...         "rhs_contracting_dims={0}\\n"
  ...         "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%add")
  >>> s = hlo.summarize(text)
  >>> s.matmul_flops, [(c.kind, c.count, c.bytes) for c in s.collectives], s.unread.count
  (8192.0, [('all-reduce', 1, 1024)], 0)
"""
from __future__ import annotations

import collections
import itertools
import math
import re
from typing import NamedTuple

from fnscale import _deprecation
from fnscale._errors import StepError

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Summary",
    "Kernel",
    "Loop",
    "Unread",
    "collectives",
    "flops_ratio",
    "matmul_flops",
    "ring_bytes_sent",
    "summarize",
]

__getattr__ = _deprecation.moved(__name__, {
    "HloSummary": ("fnscale.analysis.hlo:Summary", "fnscale.analysis.hlo.Summary")})

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast", "ragged-all-to-all")


class Collective(NamedTuple):
  """One kind of collective in an optimized HLO module, per device and per step.

  `kind`: one of `COLLECTIVE_KINDS` (async `-start`/`-done` pairs count once, under the base
  kind); `count`: executions per step, each op multiplied by the trip counts of the while
  loops around it; `bytes`: sum of their result sizes in bytes per device per step (for
  reduce-scatter the scattered shard), trip counts applied; `ops`: ops of that kind in the
  module text, each counted once; `bytes_sent`: bytes one device sends per step under ring
  algorithms (`ring_bytes_sent`), trip counts applied.

  Examples:
    An all-reduce over groups of 4 devices (`bytes_sent`: 2 (n-1)/n x 1024 bytes):

    >>> import fnscale as fs
    >>> text = "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%a"
    >>> (c,) = fs.analysis.hlo.collectives(text)
    >>> c, c.kind in fs.analysis.hlo.COLLECTIVE_KINDS
    (Collective(kind='all-reduce', count=1, bytes=1024, ops=1, bytes_sent=1536.0), True)
  """
  kind: str
  count: int
  bytes: int
  ops: int = 0
  bytes_sent: float = 0.0


class Loop(NamedTuple):
  """A while loop: its `body` computation's name and `trip_count` (None where unknown).

  The trip count is XLA's `known_trip_count` where the loop's `backend_config` has one; else
  (`from_condition` True; the TPU compiler drops that config) ceil((N - start) / step) from a
  condition `i < N` on a tuple element against a constant, with `start` the element's
  constant initial value (0 where it is not a constant) and `step` its constant increment in
  the body (1 where the increment is not a constant), as `lax.scan`, `lax.fori_loop` and
  XLA's unrolled windowed-einsum loops lower.

  Examples:
    A `fori_loop` of 5 matmuls: its body's 1024 FLOPs count 5 times.

    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> scan = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ x), x))
    >>> s = fs.analysis.hlo.summarize(scan.lower(jnp.ones((8, 8))).compile().as_text())
    >>> [(loop.trip_count, loop.from_condition) for loop in s.loops], s.matmul_flops
    ([(5, False)], 5120.0)
  """
  body: str
  trip_count: int | None
  from_condition: bool = False


class Kernel(NamedTuple):
  """A custom kernel the program calls (a Pallas kernel on TPU or GPU, Mosaic GPU, Triton);
  its work is in no `Summary` figure.

  `name`: the instruction's name without XLA's `.N` suffix (jax names it after the kernel,
  e.g. `splash_mqa_fwd_residuals`); `target`: the custom-call target (`tpu_custom_call`,
  `__gpu$xla.gpu.triton`, `mosaic_gpu_v2`, ...); `ops`: calls in the module text; `runs`:
  calls per step, trip counts applied; `declared_flops`: FLOPs per step from the kernel's own
  cost estimate (`pallas_call(..., cost_estimate=...)`), None where a call declares none.

  Examples:
    >>> import fnscale as fs
    >>> text = '%k = f32[8,32] custom-call(f32[8,32] %x), custom_call_target="tpu_custom_call"'
    >>> fs.analysis.hlo.summarize(text).kernels
    (Kernel(name='k', target='tpu_custom_call', ops=1, runs=1, declared_flops=None),)
  """
  name: str
  target: str
  ops: int
  runs: int
  declared_flops: float | None = None


class Unread(NamedTuple):
  """What `summarize` could not read; each part is left out of (or guessed in) the figures.

  `ops`: (opcode, instructions) whose FLOPs or bytes count as 0: an op whose work is not
  counted here (`fft`, `triangular-solve`, `cholesky`, `scaled-dot`, ...) or whose opcode is
  not known here, a `dot`/`ragged-dot`/`convolution` whose operand shapes or dimension
  numbers are missing, a `custom-call` to a target not known here (named as
  `custom-call <target>`), a GEMM/cuDNN call whose config lacks what its FLOPs need, a
  collective whose result size can't be read, a device-to-device `send`/`recv` (sizes
  known only at run time), a line in a computation that is not
  an instruction (`unparsed line`); `loops`: bodies of while loops without a known trip count
  (each body counted once); `groups`: (collective kind, instructions) whose replica groups
  were guessed to span every device (a spelling not read here, or text without the module
  header that gives the device count). Instructions are counted once each, in computations
  that run.

  Examples:
    >>> import fnscale as fs
    >>> text = "%f = c64[8,32] fft(c64[8,32] %x), fft_length={32}"
    >>> unread = fs.analysis.hlo.summarize(text).unread
    >>> unread.ops, unread.count, str(unread)
    ((('fft', 1),), 1, '1 fft')
  """
  ops: tuple[tuple[str, int], ...] = ()
  loops: tuple[str, ...] = ()
  groups: tuple[tuple[str, int], ...] = ()

  @property
  def count(self) -> int:
    """Unread instructions + loops without a trip count + collectives with guessed groups."""
    return sum(n for _, n in self.ops) + len(self.loops) + sum(n for _, n in self.groups)

  def __str__(self) -> str:
    parts = [f"{n} {op}" for op, n in self.ops]
    if self.loops:
      parts.append(f"{len(self.loops)} loop(s) without a trip count, counted once: "
                   + ", ".join(self.loops))
    parts += [f"{n} {kind} with guessed replica groups (all devices)" for kind, n in self.groups]
    return "; ".join(parts) if parts else "nothing"


class Summary(NamedTuple):
  """What `summarize` reads from one optimized HLO module; numbers are per device per step.

  `matmul_flops`: 2 x result elements x contracted size summed over every `dot`,
  `ragged-dot` (2 x lhs elements x rhs free elements) and `convolution` and GPU library
  matmul (cuBLAS GEMM, cuDNN convolution and fused attention), loop trip counts applied
  (FLOPs); `matmul_flops_once`: the same with every reachable loop body counted once, as
  XLA's cost analysis does; `collectives`: tuple of `Collective` in `COLLECTIVE_KINDS`
  order; `loops`: every while loop; `num_devices`: devices a collective
  without replica groups spans (the module's replicas x partitions unless given); `groups`:
  (kind, devices per replica group, ring bytes sent per device per step) for each kind and
  group size present (a group size names the mesh axis a collective runs on); `unread`: what
  could not be read (`Unread`; `unread.count == 0` when the figures cover the whole program);
  `kernels`: custom kernels called, whose work no figure includes (`Kernel`);
  `dcn_groups`: the part of `groups` sent across slices (a multi-slice TPU program's
  collectives over the data-center network, their group size the slice count, 2 for a
  collective-permute such as a pipeline's stage-to-stage sends; also in `collectives` and
  `groups`), and `dcn_bytes_sent` its total.
  `grouped_flops`: FLOPs of the grouped matmuls (a mixture of experts' expert matmuls):
  `ragged-dot` ops (also in `matmul_flops`) plus the FLOPs the grouped-matmul kernels
  declare (XLA's TPU `ragged-dot` kernels, Pallas megablox `gmm`/`tgmm`; not in
  `matmul_flops`). Both count every row of their buffers, routed or not: a dropless
  layer's buffers hold the worst case, so this is an upper bound of the work done (the
  kernels skip the rows no group holds).

  Examples:
    A `fori_loop` of 5 matmuls, as compiled for this host:

    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> scan = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ x), x))
    >>> s = fs.analysis.hlo.summarize(scan.lower(jnp.ones((8, 8))).compile().as_text())
    >>> s.matmul_flops, s.matmul_flops_once, s.num_devices, s.unread.count
    (5120.0, 1024.0, 1, 0)
  """
  matmul_flops: float
  matmul_flops_once: float
  collectives: tuple[Collective, ...]
  loops: tuple[Loop, ...]
  num_devices: int
  groups: tuple[tuple[str, int, float], ...] = ()
  unread: Unread = Unread()
  kernels: tuple[Kernel, ...] = ()
  dcn_groups: tuple[tuple[str, int, float], ...] = ()
  grouped_flops: float = 0.0

  @property
  def unknown_trip_counts(self) -> int:
    """While loops without a known trip count (their bodies counted once)."""
    return sum(l.trip_count is None for l in self.loops)

  @property
  def dcn_bytes_sent(self) -> float:
    """Ring bytes sent across slices per device per step (`dcn_groups`' total)."""
    return sum(b for _, _, b in self.dcn_groups)

  def collective(self, kind: str) -> Collective:
    """The entry for `kind`, or a zero one."""
    return next((c for c in self.collectives if c.kind == kind), Collective(kind, 0, 0))


# ----------------------------------------------------------------------------- instructions

_HEAD_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.+)$")
_OP_RE = re.compile(r"\s(?P<op>[a-z][\w\-]*)\((?P<args>.*)$")
# An operand: a name, and in dump files `#k` per tuple level for element k of a tuple value.
_OPERAND_NAME_RE = re.compile(r"%([\w.\-]+(?:#\d+)*)\s*$")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_ARRAY_RE = re.compile(r"\b(pred|[subfc]\d+|bf16|f8e\w+|f4e\w+|f6e\w+)\[([\d,]*)\]")
_CALL_RE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                      r"false_computation)=%?([\w.\-]+)")
_CALL_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_LINE_START_RE = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=")
_DEVICES_RE = re.compile(r"\b(replica_count|num_partitions)=(\d+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
# A computation's last line: "}", or `}, execution_thread="sparsecore"` (TPU SparseCore code).
_END_RE = re.compile(r'^\}(?:,\s*execution_thread="[^"]*")?\s*$')


class _Instr(NamedTuple):
  """One instruction: opcode, result shape text, operands as (name, shape written inline or
  ''), the text inside its parentheses and the attributes after them."""
  op: str
  shape: str
  operands: tuple[tuple[str, str], ...]
  inner: str
  attrs: str


_BRACKET_RE = re.compile(r"[()\[\]{}]")
_SPLIT_RE = re.compile(r"[()\[\]{},]")  # scanned for, not every character


def _split_top(text: str) -> list[str]:
  """`text` split at commas outside (), [] and {} (shape layouts and tuples hold commas)."""
  parts, depth, start = [], 0, 0
  for m in _SPLIT_RE.finditer(text):
    ch = m.group()
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif depth == 0:
      parts.append(text[start:m.start()])
      start = m.start() + 1
  return parts + [text[start:]]


def _close(text: str) -> tuple[str, str]:
  """Text after an opening parenthesis -> (inside up to its matching ')', the rest)."""
  depth = 0
  for m in _BRACKET_RE.finditer(text):
    if m.group() in "([{":
      depth += 1
    elif depth == 0:
      return text[:m.start()], text[m.start() + 1:]
    else:
      depth -= 1
  return text, ""


def _parse(line: str) -> tuple[str, _Instr] | None:
  """(name, instruction) of an instruction line; None for anything else."""
  m = _INSTR_RE.match(line)
  op_m = _OP_RE.search(m.group("rest")) if m else None
  if not op_m:
    return None
  inner, attrs = _close(op_m.group("args"))
  operands = []
  for piece in _split_top(inner):
    piece = _COMMENT_RE.sub("", piece).strip()
    name = _OPERAND_NAME_RE.search(piece)
    if name:
      operands.append((name.group(1), piece[:name.start()].strip()))
  rest = m.group("rest")
  return m.group("name"), _Instr(op_m.group("op"), rest[:op_m.start()].strip(), tuple(operands),
                                 inner, attrs)


def _tuple_elements(shape: str) -> list[str]:
  """The element shapes of a tuple shape `(a, b, /*index=2*/c)`; [shape] for an array."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  inner, _ = _close(shape[1:])
  return [_COMMENT_RE.sub("", p).strip() for p in _split_top(inner) if p.strip()]


def _dtype_bytes(name: str) -> float:
  """Bytes per element of an HLO element type (`f32` 4, `bf16` 2, `s4` 0.5, `pred` 1)."""
  if name == "pred":
    return 1
  if name == "bf16":
    return 2
  m = re.match(r"[subfc](\d+)$", name)
  if m:
    return int(m.group(1)) / 8
  m = re.match(r"f(\d)", name)  # f8e4m3fn, f6e2m3fn, f4e2m1fn
  return int(m.group(1)) / 8 if m else 0


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dims) of every array in an HLO shape (a tuple gives several)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d))
          for t, dims in _ARRAY_RE.findall(shape_text)]


def _shape_bytes(shape_text: str) -> float:
  return sum(math.prod(d) * _dtype_bytes(t) for t, d in _arrays(shape_text))


def _ints(text: str | None) -> list[int]:
  return [int(x) for x in re.findall(r"-?\d+", text or "")]


# ----------------------------------------------------------------------------- replica groups


class _Devices(NamedTuple):
  """The module's device counts: `total` devices an all-device collective spans (the caller's
  `num_devices`, else replicas x partitions), `partitions`, and `known` (False for text
  without a module header and no `num_devices`: an all-device group is then a guess)."""
  total: int
  partitions: int
  known: bool


def _mesh_group(text: str) -> int | None:
  """Devices per group of `mesh[a=2,b=4] {b}` (jax 0.12) or `mesh['a'=2,'b'=4],
  device_ids=([2,4]T(1,0)) {'b'}` (jax 0.10; axis names quoted; `device_ids` orders the
  devices, which does not change the group size); a sub-axis `b:(1)2` counts its size."""
  m = re.match(r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\(.*?\))?\s*\{([^}]*)\}", text)
  if not m:
    return None
  sizes = {k: int(v) for k, v in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", m.group(1))}
  n = 1
  for axis in filter(None, (a.strip() for a in m.group(2).split(","))):
    a = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", axis)
    if not a or (a.group(3) is None and a.group(1) not in sizes):
      return None
    n *= int(a.group(3)) if a.group(3) else sizes[a.group(1)]
  return n


def _listed_group(line: str) -> int | None | str:
  """Devices per replica group as written: "all" (`{}` or no attribute), the size of the
  first listed group `{{0,1},{2,3}}`, m of an iota list `[n,m]<=[...]` (transposed or not),
  the axes of a `mesh[...]` list; None for a spelling not read here."""
  at = line.find("replica_groups=")
  if at < 0:
    return "all"
  text = line[at + len("replica_groups="):]
  if re.match(r"\{\s*\}", text):
    return "all"
  m = re.match(r"\{\{([^}]*)\}", text)
  if m:
    return len(_ints(m.group(1)))
  m = re.match(r"\[(\d+),(\d+)\]<=\[[\d,]+\](?:T\([\d,]+\))?", text)
  if m:
    return int(m.group(2))
  return _mesh_group(text)


def _group_size(kind: str, line: str, dev: _Devices) -> tuple[int, bool]:
  """(devices in one replica group of a collective, whether that was guessed).

  XLA's modes: with a `channel_id` but without `use_global_device_ids=true`, an all-reduce,
  all-gather or reduce-scatter lists replicas and spans every partition of each (cross
  replica and partition); otherwise the listed ids are the group. An empty list spans
  `dev.total` devices: replicas x partitions, exact when either is 1 (every jax program)."""
  n = _listed_group(line)
  if n is None:
    return dev.total, True
  if n == "all":
    return dev.total, not dev.known
  if (kind in ("all-reduce", "all-gather", "reduce-scatter") and "channel_id=" in line
      and "use_global_device_ids=true" not in line):
    return n * dev.partitions, False
  return n, False


def ring_bytes_sent(kind: str, result_bytes: float, group_size: int) -> float:
  """Bytes one device sends for one collective under ring algorithms.

  Args:
    kind: one of `COLLECTIVE_KINDS`.
    result_bytes: the op's result size per device in bytes (for reduce-scatter the shard).
    group_size: devices in the op's replica group (n).

  Returns:
    Bytes: all-reduce 2 (n - 1) / n x result (reduce-scatter then all-gather, Patarasuk &
    Yuan, 2009, "Bandwidth optimal all-reduce algorithms"); all-gather and all-to-all
    (n - 1) / n x result and reduce-scatter (n - 1) x shard, i.e. (n - 1) / n of the array
    reduced (the ring algorithms of Thakur, Rabenseifner & Gropp, 2005, "Optimization of
    Collective Communication Operations in MPICH"); ragged-all-to-all (n - 1) / n of its
    `result_bytes` as `summarize` reads them (the smaller of operand and result: at most
    what a device sends); collective-permute and collective-broadcast the result; 0 for a
    group of one device.

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.hlo.ring_bytes_sent("all-reduce", 1024, 4)  # 2 (n-1)/n x 1024
    1536.0
    >>> fs.analysis.hlo.ring_bytes_sent("all-gather", 1024, 4)  # (n-1)/n x 1024
    768.0

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
  if kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
    return (n - 1) / n * result_bytes
  if kind == "reduce-scatter":
    return (n - 1) * result_bytes
  return float(result_bytes)


# ----------------------------------------------------------------------------- computations


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """Computation name -> its instruction lines, and the entry's name. Instruction lines
  outside any computation (a snippet) form the computation named ''. A computation ends at
  a line that is only "}" (or "}" and its `execution_thread`); lines that don't start an
  instruction continue the one above."""
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
    elif _END_RE.match(line):
      cur = None
    elif comps[cur] and not _LINE_START_RE.match(line):
      # An attribute that spans lines (a Pallas kernel's `frontend_attributes` JSON, whose
      # continuation may start with "}}") belongs to the instruction above.
      comps[cur][-1] += " " + line.strip()
    else:
      comps[cur].append(line)
  return comps, entry


class _Graph(NamedTuple):
  """What `_read_computation` collects from every computation of a module (build one with
  `_graph()`: fresh containers each time)."""
  instrs: dict  # comp -> {name: _Instr}
  roots: dict  # comp -> name of its ROOT instruction
  edges: dict  # comp -> [(callee, factor)]
  whiles: list  # (caller, body, condition, init operand, known trip count)
  dots: dict  # comp -> matmul FLOPs per run
  colls: dict  # comp -> [(kind, result bytes, group size)]
  kernels: dict  # comp -> [(name, target, declared FLOPs or None)]
  unread: dict  # comp -> [opcode]
  guessed: dict  # comp -> [collective kind]
  dcn: dict  # comp -> [(kind, result bytes, slices)]: those of `colls` across slices
  grouped: dict  # comp -> grouped-matmul FLOPs per run (ragged-dot ops, declared by kernels)
  scatters: dict  # (comp, all-reduce name) -> its shard's bytes: a fused reduce-scatter


def _graph() -> _Graph:
  dd = collections.defaultdict
  return _Graph(dd(dict), {}, dd(list), [], dd(float), dd(list), dd(list), dd(list), dd(list),
                dd(list), dd(float), {})


def _index(comps: dict[str, list[str]], g: _Graph) -> None:
  """Parses every computation's lines into `g.instrs` and `g.roots`; lines in a computation
  that are not instructions are unread (outside computations they are the module header or
  the stack-frame tables XLA appends)."""
  for comp, lines in comps.items():
    for line in lines:
      parsed = _parse(line)
      if parsed is None:
        if comp and line.strip() and not line.strip().startswith("//"):
          g.unread[comp].append("unparsed line")
        continue
      name, ins = parsed
      g.instrs[comp][name] = ins
      if line.lstrip().startswith("ROOT"):
        g.roots[comp] = name
    if comp not in g.roots and g.instrs.get(comp):
      g.roots[comp] = next(reversed(g.instrs[comp]))


_VIEWS = ("bitcast", "copy")


def _through(g: _Graph, comp: str, name: str) -> tuple[str, _Instr | None]:
  """(name, instruction) of `name` in `comp`, looking through bitcasts and copies."""
  for _ in range(8):
    ins = g.instrs.get(comp, {}).get(name)
    if ins is None or ins.op not in _VIEWS or len(ins.operands) != 1:
      return name, ins
    name = ins.operands[0][0]
  return name, None


def _sliced_all_reduce(g: _Graph, comp: str, out: str) -> tuple[str, float] | None:
  """(all-reduce name, bytes of the slice) where `out` is a dynamic-slice of an all-reduce
  of `comp` (of one element of a tuple all-reduce), through bitcasts and copies."""
  _, ds = _through(g, comp, out)
  if ds is None or ds.op != "dynamic-slice" or not ds.operands:
    return None
  src, ins = _through(g, comp, ds.operands[0][0].split("#")[0])
  if ins is not None and ins.op == "get-tuple-element" and ins.operands:
    src, ins = _through(g, comp, ins.operands[0][0])
  if ins is None or ins.op != "all-reduce":
    return None
  return src, _shape_bytes(ds.shape)


def _fused_scatters(g: _Graph) -> None:
  """Finds the TPU compiler's fused reduce-scatters (`g.scatters`): a fusion (libtpu names
  its computation `all-reduce-scatter`, its emitter `SingleInputAllReduceScatterFusion`)
  whose computation returns a `dynamic-slice` of an `all-reduce`, or a tuple of slices of
  all-reduces. The device sends a reduce-scatter's bytes for it (`_collective` checks that
  each slice is 1 / n of the array reduced over n devices). An all-reduce sliced outside a
  fusion stays an all-reduce: libtpu runs those with its all-reduce emitters, whole."""
  fused = {c.lstrip("%") for m in g.instrs.values() for ins in m.values()
           if ins.op == "fusion" for c in _CALL_RE.findall(ins.attrs)}
  for comp in fused:
    root = g.roots.get(comp)
    _, top = _through(g, comp, root) if root else (None, None)
    if top is None:
      continue
    outs = [n for n, _ in top.operands] if top.op == "tuple" else [root]
    found = [_sliced_all_reduce(g, comp, o) for o in outs]
    if all(found):
      for src, shard in found:
        g.scatters[(comp, src)] = g.scatters.get((comp, src), 0.0) + shard


def _shape(g: _Graph, comp: str, name: str) -> str:
  """The shape of `name` in `comp`; `x#k` is tuple element k of x's shape."""
  base, *index = name.split("#")
  ins = g.instrs.get(comp, {}).get(base)
  shape = ins.shape if ins else ""
  for k in index:
    elements = _tuple_elements(shape)
    shape = elements[int(k)] if int(k) < len(elements) else ""
  return shape


def _operand_dims(g: _Graph, comp: str, ins: _Instr, i: int) -> tuple[int, ...] | None:
  """Dims of operand i's (first) array: its inline shape, else its definition's."""
  if i >= len(ins.operands):
    return None
  name, inline = ins.operands[i]
  arrays = _arrays(inline or _shape(g, comp, name))
  return arrays[0][1] if arrays else None


# ----------------------------------------------------------------------------- loop counts

_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


def _element(value, k: int):
  """Element k of a traced value: of the computation's parameter, or of a tuple."""
  if value == ("param", 0):
    return ("elem", k)
  if value and value[0] == "tuple" and k < len(value[1]):
    return value[1][k]
  return None


def _value(g: _Graph, comp: str, name: str, args=None, depth: int = 0, memo=None):
  """What instruction `name` of `comp` computes, as far as loop counts need: ("const", v),
  ("param", i), ("elem", k) (element k of the tuple parameter), ("tuple", values),
  ("add" | "compare", direction, operand values...); None otherwise. Copies, bitcasts,
  converts and fusions are looked through (`args`: the values a fusion passes its callee).
  Each (computation, instruction, args) is read once (`memo`): a loop carrying many values
  through fusions and tuples would otherwise be re-read along every path, exponentially
  many in the depth."""
  memo = {} if memo is None else memo
  key = (comp, name, args)
  if key not in memo:
    memo[key] = _read_value(g, comp, name, args, depth, memo)
  return memo[key]


def _read_value(g: _Graph, comp: str, name: str, args, depth: int, memo):
  """`_value`, unmemoized."""
  base, *index = name.split("#")
  ins = g.instrs.get(comp, {}).get(base)
  if ins is None or depth > 16:
    return None
  sub = lambda n: _value(g, comp, n, args, depth + 1, memo)
  operands = [n for n, _ in ins.operands]
  out = None
  if ins.op == "constant" and re.fullmatch(r"[su]\d+\[\]", ins.shape.split("{")[0]):
    out = ("const", int(ins.inner)) if re.fullmatch(r"\s*-?\d+\s*", ins.inner) else None
  elif ins.op == "parameter" and ins.inner.strip().isdigit():
    i = int(ins.inner)
    out = args[i] if args is not None and i < len(args) else ("param", i)
  elif ins.op == "get-tuple-element" and operands:
    k = re.search(r"index=(\d+)", ins.attrs)
    out = _element(sub(operands[0]), int(k.group(1))) if k else None
  elif ins.op in _PASS_THROUGH and len(operands) == 1:
    out = sub(operands[0])
  elif ins.op == "tuple":
    out = ("tuple", tuple(sub(o) for o in operands))
  elif ins.op in ("add", "compare"):
    d = re.search(r"direction=(\w+)", ins.attrs)
    out = (ins.op, d.group(1) if d else None, *(sub(o) for o in operands))
  elif ins.op == "fusion":
    callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
    root = g.roots.get(callee.group(1)) if callee else None
    if root:
      out = _value(g, callee.group(1), root, tuple(sub(o) for o in operands), depth + 1, memo)
  for k in index:
    out = _element(out, int(k))
  return out


def _loop_trips(g: _Graph, caller: str, body: str, cond: str, init: str | None) -> int | None:
  """Trips of a while loop whose condition computes `counter < N` (or `N > counter`) on tuple
  element k against a constant: ceil((N - start) / step), where the body sets element k to
  `counter + step` (step 1 where it is not a constant) and the caller's init tuple gives
  `start` (0 where it is not a constant). XLA unrolls windowed-einsum loops this way: a body
  that does two iterations' work steps its counter by 2."""
  c = _value(g, cond, g.roots[cond]) if cond in g.roots else None
  if not c or c[0] != "compare" or c[1] not in ("LT", "GT") or len(c) != 4:
    return None
  counter, bound = (c[2], c[3]) if c[1] == "LT" else (c[3], c[2])
  if not (counter and counter[0] == "elem" and bound and bound[0] == "const"):
    return None
  k, step = counter[1], 1
  upd = _element(_value(g, body, g.roots[body]) if body in g.roots else None, k)
  if upd and upd[0] == "add" and len(upd) == 4:
    for a, b in ((upd[2], upd[3]), (upd[3], upd[2])):
      if a == ("elem", k) and b and b[0] == "const" and b[1] > 0:
        step = b[1]
  start = _element(_value(g, caller, init), k) if init else None
  start = start[1] if start and start[0] == "const" else 0
  return max(-(-(bound[1] - start) // step), 0)


# ----------------------------------------------------------------------------- matmul FLOPs


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


def _conv_flops(lhs: tuple[int, ...] | None, out: tuple[int, ...] | None,
                attrs: str) -> float | None:
  """FLOPs of a convolution from its input (`lhs`) and output dims and its `dim_labels` and
  `window`: 2 x output elements x input features per group x window taps on the input."""
  labels = re.search(r"dim_labels=(\w+)_\w+->(\w+)", attrs)
  if not lhs or not out or not labels or "f" not in labels.group(1):
    return None
  lhs_l, out_l = labels.group(1), labels.group(2)
  if len(lhs_l) != len(lhs) or len(out_l) != len(out):
    return None
  groups = re.search(r"feature_group_count=(\d+)", attrs)
  k = lhs[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
  spatial = sorted(c for c in lhs_l if c.isdigit())
  window = re.search(r"window=\{([^}]*)\}", attrs)
  taps = _window_taps([lhs[lhs_l.index(c)] for c in spatial],
                      [out[out_l.index(c)] for c in spatial], window.group(1) if window else "")
  return 2.0 * math.prod(out) / math.prod(out[out_l.index(c)] for c in spatial) * taps * k


def _dot_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  """FLOPs of a dot: 2 x result elements x contracted size (None without the shapes)."""
  out, lhs = _arrays(ins.shape), _operand_dims(g, comp, ins, 0)
  if not out or lhs is None:
    return None
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  contract = _ints(m.group(1) if m else "")  # none: an outer product
  if (not m and "lhs_contracting_dims" in ins.attrs) or any(i >= len(lhs) for i in contract):
    return None
  return 2.0 * math.prod(out[0][1]) * math.prod(lhs[i] for i in contract)


_RAGGED_DIMS = ("lhs_batch", "rhs_batch", "lhs_contracting", "rhs_contracting", "lhs_ragged",
                "rhs_group")


def _dim_lists(attrs: str, keys: tuple[str, ...]) -> dict[str, list[int]] | None:
  """`{key}_dims={...}` of each key ([] where absent); None where one is present but not
  spelled as a list of dims."""
  out = {}
  for key in keys:
    m = re.search(rf"\b{key}_dims=\{{([\d,]*)\}}", attrs)
    if not m and f"{key}_dims=" in attrs:
      return None
    out[key] = _ints(m.group(1)) if m else []
  return out


def _ragged_dot_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  """FLOPs of a ragged dot (lhs, rhs, group_sizes): each lhs element meets each element of
  the rhs's free dims (not batch, contracting or group) once, 2 x lhs elements x rhs free
  elements, in each of XLA's three modes. Ragged in an lhs free dim: lhs [m,k], rhs [g,k,n]
  -> [m,n], a row meets its group's [k,n], 2mkn; in the contracting dim: lhs [m,k], rhs
  [k,n] -> [g,m,n], group j multiplies its slice of k, 2mkn in all; in a batch dim: a dot.

  None where an operand's shape or a dimension list can't be read, or the lists don't fit
  the shapes (one ragged lhs dim, paired lhs/rhs dims of one size, the result's rank).
  """
  out, lhs = _arrays(ins.shape), _operand_dims(g, comp, ins, 0)
  rhs, d = _operand_dims(g, comp, ins, 1), _dim_lists(ins.attrs, _RAGGED_DIMS)
  if not out or lhs is None or rhs is None or d is None or len(d["lhs_ragged"]) != 1:
    return None
  pairs = [(a, b) for kind in ("batch", "contracting")
           for a, b in itertools.zip_longest(d[f"lhs_{kind}"], d[f"rhs_{kind}"])]
  rhs_used = [b for _, b in pairs] + d["rhs_group"]
  if (any(a is None or b is None or a >= len(lhs) or b >= len(rhs) or lhs[a] != rhs[b]
          for a, b in pairs)
      or len({a for a, _ in pairs}) != len(pairs) or len(set(rhs_used)) != len(rhs_used)
      or d["lhs_ragged"][0] >= len(lhs) or any(i >= len(rhs) for i in d["rhs_group"])):
    return None
  rhs_free = [n for i, n in enumerate(rhs) if i not in rhs_used]
  # The result: batch, lhs free and rhs free dims, and a leading group dim when k is ragged.
  rank = (len(lhs) - len(d["lhs_contracting"]) + len(rhs_free)
          + (d["lhs_ragged"][0] in d["lhs_contracting"]))
  if len(out[0][1]) != rank:
    return None
  return 2.0 * math.prod(lhs) * math.prod(rhs_free)


# cuBLAS GEMMs (`gemm_backend_config.dot_dimension_numbers` holds the contraction) and cuDNN
# convolutions by which operand or result holds the forward convolution's input and output
# (their `window` and `dim_labels` describe the forward convolution; XLA's cublas_cudnn.cc).
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_CUDNN_CONV = {"__cudnn$convForward": ("operand0", "result"),
               "__cudnn$convBiasActivationForward": ("operand0", "result"),
               "__cudnn$convForwardGraph": ("operand0", "result"),
               "__cudnn$convBackwardInput": ("result", "operand0"),
               "__cudnn$convBackwardFilter": ("operand0", "operand1")}
_FMHA_PREFIX = "__cudnn$fmha"
# Custom kernels: their work is the kernel author's, listed as `Kernel`s.
_KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2",
                   "triton_kernel_call", "triton_kernel_call_ffi")
# Grouped-matmul kernels by name: XLA's TPU lowering of `ragged-dot` (`ragged-dot-none`,
# beside a `ragged-dot-metadata` kernel that computes no product) and Pallas megablox
# (jax.experimental.pallas.ops.tpu.megablox, and MaxText's copy of it: `gmm`, `tgmm`).
_GROUPED_KERNEL_RE = re.compile(r"(ragged-dot-(?!metadata)|t?gmm\b)")
# Targets that do no matmul and no device-to-device traffic: sharding annotations, buffer
# and layout markers, host offload, random bits, sorting and top-k, linear-algebra solvers
# (jax's stable targets, `jax._src.export._export`), host callbacks.
_NO_MATMUL_TARGETS = (
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
    "AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked",
    "ConcatBitcast", "SliceId", "ZeroCrop",  # TPU: this slice's index; a buffer's padding
    "PrepareAsyncCallStart", "PrepareAsyncCallDone",  # TPU: set-up of an async call-start
    "MoveToHost", "MoveToDevice", "PadToStatic", "SliceToDynamic", "LayoutConstraint",
    "TopK", "ApproxTopK", "PartialReduce", "Eigh", "Qr",
    "ProductOfElementaryHouseholderReflectors", "LuDecomposition", "shape_assertion",
    "__cub$DeviceRadixSort", "__cublas$triangularSolve", "__cudnn$norm",
    "__cudnn$convReorderFilter", "__cudnn$convReorderFilterAndBias")
_NO_MATMUL_PREFIXES = ("lapack_", "cusolver_", "hipsolver_", "cusparse_", "cu_threefry",
                       "hip_threefry", "cu_lu_", "hip_lu_", "stablehlo.", "xla_python_",
                       "xla_ffi_python_", "xla_ffi_partitioned_python_")


def _gemm_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  """A cuBLAS GEMM: 2 x result elements x the lhs's contracted size (from the config)."""
  out, lhs = _arrays(ins.shape), _operand_dims(g, comp, ins, 0)
  contract = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
  if not out or lhs is None or not contract or any(i >= len(lhs) for i in _ints(
      contract.group(1))):
    return None
  return 2.0 * math.prod(out[0][1]) * math.prod(lhs[i] for i in _ints(contract.group(1)))


def _cudnn_conv_flops(g: _Graph, comp: str, ins: _Instr, target: str) -> float | None:
  """A cuDNN convolution: the FLOPs of the forward convolution it computes or differentiates
  (backward input and filter do the same multiply-adds)."""
  def dims(where):
    if where == "result":
      arrays = _arrays(ins.shape)
      return arrays[0][1] if arrays else None
    return _operand_dims(g, comp, ins, int(where[-1]))
  lhs_at, out_at = _CUDNN_CONV[target]
  return _conv_flops(dims(lhs_at), dims(out_at), ins.attrs)


def _fmha_flops(g: _Graph, comp: str, ins: _Instr, target: str) -> float | None:
  """cuDNN fused attention (operands q, k, v first, head dim last in jax's layouts): with P
  the scores' elements (`intermediate_tensor_shape`, batch x heads x q len x kv len), the
  forward is Q.K^T and P.V, 2 P (d_qk + d_v); the backward recomputes Q.K^T and forms dV,
  dP, dQ and dK, 2 P (3 d_qk + 2 d_v). A causal mask's skipped half is counted."""
  inter = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]',
                    ins.attrs)
  q, v = _operand_dims(g, comp, ins, 0), _operand_dims(g, comp, ins, 2)
  if not inter or not q or not v:
    return None
  p = math.prod(_ints(inter.group(1)))
  if "Backward" in target:
    return 2.0 * p * (3 * q[-1] + 2 * v[-1])
  return 2.0 * p * (q[-1] + v[-1])


def _custom_call(g: _Graph, comp: str, name: str, ins: _Instr) -> None:
  """Adds a custom call's FLOPs, kernel or unread entry to `g`."""
  t = _TARGET_RE.search(ins.attrs)
  target = t.group(1) if t else ""
  flops = None
  if target in _GEMM_TARGETS:
    flops = _gemm_flops(g, comp, ins)
  elif target in _CUDNN_CONV:
    flops = _cudnn_conv_flops(g, comp, ins, target)
  elif target.startswith(_FMHA_PREFIX):
    flops = _fmha_flops(g, comp, ins, target)
  elif target in _KERNEL_TARGETS:
    declared = re.search(r'"cost_estimate"\s*:\s*\{[^{}]*?"flops"\s*:\s*"?(\d+)', ins.attrs)
    kernel = re.sub(r"\.\d+$", "", name)
    g.kernels[comp].append((kernel, target, float(declared.group(1)) if declared else None))
    if declared and _GROUPED_KERNEL_RE.match(kernel):
      g.grouped[comp] += float(declared.group(1))
    return
  elif target in _NO_MATMUL_TARGETS or target.startswith(_NO_MATMUL_PREFIXES):
    return
  if flops is None:
    g.unread[comp].append(f"custom-call {target}" if target else "custom-call")
  else:
    g.dots[comp] += flops


# ----------------------------------------------------------------------------- reading

# Opcodes that do no matmul and move no device-to-device bytes (XLA's HLO_OPCODE_LIST,
# xla/hlo/ir/hlo_opcode.h, less what is read above or below): any other opcode is unread,
# so work in an op the reader doesn't count (fft, triangular-solve, cholesky, scaled-dot,
# scan's repeated body, collective-reduce's traffic) or an opcode newer than this list is
# never skipped silently. Computations an op calls (fusion, call, while, conditional, async,
# map, reduce and sort comparators) are read themselves.
_NO_COUNTED_WORK = frozenset((
    # elementwise
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bitcast-convert", "cbrt", "ceil", "clamp", "compare", "complex", "convert", "cosine",
    "cosh", "count-leading-zeros", "divide", "erf", "exponential", "exponential-minus-one",
    "floor", "fma", "imag", "is-finite", "log", "log-plus-one", "logistic", "maximum",
    "minimum", "mulhi", "multiply", "negate", "not", "or", "popcnt", "power", "real",
    "reduce-precision", "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt",
    "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine",
    "sinh", "sqrt", "stochastic-convert", "subtract", "tan", "tanh", "xor",
    # data movement within a device
    "bitcast", "broadcast", "concatenate", "copy", "copy-start", "copy-done",
    "dynamic-reshape", "dynamic-slice", "dynamic-update-slice", "gather", "iota", "pad",
    "reshape", "reverse", "scatter", "slice", "transpose",
    # reductions, windows, sorting, normalisation
    "batch-norm-grad", "batch-norm-inference", "batch-norm-training", "map", "reduce",
    "reduce-window", "select-and-scatter", "sort", "topk",
    # random numbers
    "rng", "rng-bit-generator", "rng-get-and-update-state",
    # structure, control flow, scheduling
    "add-dependency", "after-all", "async-done", "async-start", "async-update", "call",
    "conditional", "constant", "domain", "fusion", "get-tuple-element", "opt-barrier",
    "parameter", "tuple", "while",
    # host transfers, device ids, dynamic shapes (a device `send`/`recv` is read below)
    "get-dimension-size", "infeed", "outfeed", "partition-id", "recv-done", "replica-id",
    "send-done", "set-dimension-size"))
# Wrappers that call computations which may hold matmuls: never read as async sugar.
_CALLS_WORK = ("call", "conditional", "fusion", "while")
# An asynchronous call (TPU: a computation run on the SparseCore, `async_execution_thread=
# "sparsecore"`, e.g. a gather offload): the -start names the computation (`to_apply=`), read
# as any called computation; its -update and -done only wait for it.
_ASYNC_CALL = ("call-start", "call-update", "call-done")


def _does_no_counted_work(op: str) -> bool:
  """`op` is in `_NO_COUNTED_WORK`, or is XLA's async spelling of one that calls no
  computation: an async op wrapping a single instruction prints as that instruction's
  `-start`/`-update`/`-done` (TPU: `slice-start`, `slice-done`)."""
  base, _, stage = op.rpartition("-")
  return op in _NO_COUNTED_WORK or (stage in ("start", "update", "done")
                                    and base in _NO_COUNTED_WORK and base not in _CALLS_WORK)



def _collective(g: _Graph, comp: str, ins: _Instr, starts: dict, name: str,
                dev: _Devices) -> None:
  """Adds one collective op (or records an async -start's group) to `g`."""
  op = ins.op
  base = next(c for c in COLLECTIVE_KINDS if op in (c, c + "-start", c + "-done"))
  line = ins.attrs
  if op.endswith("-start"):
    starts[name] = _group_size(base, line, dev) if base != "collective-permute" else (2, False)
    return
  if op.endswith("-done"):
    src = ins.operands[0][0].split("#")[0] if ins.operands else ""
    n, guessed = starts.get(src, (dev.total, not dev.known))
  elif base == "collective-permute":
    n, guessed = 2, False  # a device sends its buffer once
  else:
    n, guessed = _group_size(base, line, dev)
  nbytes = _shape_bytes(ins.shape)
  if not _arrays(ins.shape):
    g.unread[comp].append(op)
    return
  shard = g.scatters.get((comp, name)) if base == "all-reduce" else None
  if shard is not None and math.isclose(shard * n, nbytes):  # a fused reduce-scatter
    base, nbytes = "reduce-scatter", shard
  if guessed:
    g.guessed[comp].append(base)
  g.colls[comp].append((base, nbytes, n))


_RAGGED = ("ragged-all-to-all", "ragged-all-to-all-start", "ragged-all-to-all-done")
# Async calls whose work is the computation they call (`to_apply=` / `called_computations=`
# on the start, read as such): TPU SparseCore offloads of gathers and scatters.
_ASYNC_CALLS = ("call-start", "call-update", "call-done", "custom-call-start",
                "custom-call-update", "custom-call-done")


def _ragged_collective(g: _Graph, comp: str, ins: _Instr, starts: dict, name: str,
                       dev: _Devices) -> None:
  """Adds a ragged all-to-all (or records its async -start) to `g`. Its sizes are known only
  at run time; its bytes are the smaller of its operand (what a device may send) and its
  result (the buffer it may receive into): the dropless exchange sends its whole sorted
  operand one way and fills its whole result on the way back, so that is exact per pair."""
  op = ins.op
  if op.endswith("-done"):
    src = ins.operands[0][0].split("#")[0] if ins.operands else ""
    (n, guessed), sent = starts.get(src, ((dev.total, not dev.known), None))
  else:
    n, guessed = _group_size("all-to-all", ins.attrs, dev)
    dims = _operand_dims(g, comp, ins, 0)
    operand = next(iter(_arrays(ins.operands[0][1] or _shape(g, comp, ins.operands[0][0]))),
                   None) if ins.operands else None
    sent = math.prod(dims) * _dtype_bytes(operand[0]) if dims is not None and operand else None
    if op.endswith("-start"):
      starts[name] = ((n, guessed), sent)
      return
  result = _arrays(ins.shape)
  if sent is None or not result:
    g.unread[comp].append(op)
    return
  got = math.prod(result[-1][1]) * _dtype_bytes(result[-1][0])
  if guessed:
    g.guessed[comp].append("ragged-all-to-all")
  g.colls[comp].append(("ragged-all-to-all", min(sent, got), n))


# A multi-slice TPU program (one program per slice) runs each collective across slices
# (over DCN) as a host-transfer send/recv pair that the megascale runtime carries out; the
# send's attributes name the collective and its slices, e.g.
# `_xla_megascale_transfer_type="ALL_REDUCE"`, `_xla_megascale_target="{1,2}x{0:3}"` (slices
# 1 and 2, chips 0 to 3 of each; libtpu with jax 0.10.2 and 0.12). The recv brings the result
# back: the send alone is the collective, its data (the tuple's first array) its input: the
# result for an all-reduce or all-to-all, one slice's shard of an all-gather's result, the
# whole of a reduce-scatter's input (the result's size times the slices).
# A collective-permute across slices (a pipeline's stage-to-stage send, `lax.ppermute`) is
# `_xla_megascale_transfer_type="ONE_TO_ONE"` with its pairs as the target, each device
# written slice x 100000 + chip (slices from 1), e.g. `_xla_megascale_target={{100000->200000},
# {200000->100000}}`: counted as a collective-permute (each device sends its buffer once).
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}
_MEGASCALE_PAIRS_RE = re.compile(r"_xla_megascale_target=\{((?:\{\d+->\d+\},?)+)\}")
_MEGASCALE_SLICE = 100_000  # a megascale device id: slice x 100000 + chip


def _slice_count(listed: str) -> int | None:
  """Slices in a megascale target's first set: "1,2,3" -> 3, "1:4" -> 4 (inclusive)."""
  n = 0
  for part in listed.split(","):
    ends = _ints(part)
    if len(ends) == 1 and ":" not in part:
      n += 1
    elif len(ends) == 2 and ":" in part and ends[1] >= ends[0]:
      n += ends[1] - ends[0] + 1
    else:
      return None
  return n or None


def _crosses_slices(attrs: str) -> int | None:
  """2 (a permute's group, as `_collective` counts one) where a ONE_TO_ONE target's pairs
  send across slices; None where it lists none that do, or can't be read."""
  m = _MEGASCALE_PAIRS_RE.search(attrs)
  pairs = re.findall(r"(\d+)->(\d+)", m.group(1)) if m else []
  across = any(int(a) // _MEGASCALE_SLICE != int(b) // _MEGASCALE_SLICE for a, b in pairs)
  return 2 if across else None


def _dcn_collective(g: _Graph, comp: str, ins: _Instr) -> None:
  """Adds a megascale send (a collective across slices) to `g`'s collectives, its group the
  slices it spans (2 for a collective-permute); unread where its kind, slices or data can't
  be read."""
  kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', ins.attrs)
  target = re.search(r'_xla_megascale_target="\{([^}]*)\}', ins.attrs)
  data = _arrays(ins.shape)[:1]
  base = _MEGASCALE_KINDS.get(kind.group(1)) if kind else None
  if base == "collective-permute":
    slices = _crosses_slices(ins.attrs)
  else:
    slices = _slice_count(target.group(1)) if target else None
  if base is None or slices is None or not data:
    g.unread[comp].append(f"send {kind.group(1) if kind else 'megascale'}")
    return
  (dtype, dims), = data
  sent = math.prod(dims) * _dtype_bytes(dtype)
  result = {"all-gather": sent * slices, "reduce-scatter": sent / slices}.get(base, sent)
  entry = (base, result, slices)
  g.colls[comp].append(entry)
  g.dcn[comp].append(entry)


def _conv_op_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  out = _arrays(ins.shape)
  return _conv_flops(_operand_dims(g, comp, ins, 0), out[0][1] if out else None, ins.attrs)


# Opcodes counted as matmuls -> their FLOPs (None: not readable).
_MATMUL_OPS = {"dot": _dot_flops, "ragged-dot": _ragged_dot_flops, "convolution": _conv_op_flops}


def _read_computation(comp: str, g: _Graph, dev: _Devices) -> None:
  """Adds one computation's calls, loops, matmuls, kernels and collectives to `g`."""
  starts: dict[str, tuple[int, bool]] = {}
  for name, ins in g.instrs.get(comp, {}).items():
    op = ins.op
    if op == "while":
      t = _TRIP_RE.search(ins.attrs)
      body, cond = (re.search(rf"\b{k}=%?([\w.\-]+)", ins.attrs) for k in ("body", "condition"))
      g.whiles.append((comp, body.group(1) if body else "?", cond.group(1) if cond else "?",
                       ins.operands[0][0] if ins.operands else None,
                       int(t.group(1)) if t else None))
    # An async op's -done (and -update) names the same computation as its -start.
    elif not op.startswith("async-") or op == "async-start":
      g.edges[comp].extend((c, 1) for c in _CALL_RE.findall(ins.attrs))
    for listed in _CALL_LIST_RE.findall(ins.attrs):
      g.edges[comp].extend((c.strip().lstrip("%"), 1) for c in listed.split(",") if c.strip())
    if op in _MATMUL_OPS:
      flops = _MATMUL_OPS[op](g, comp, ins)
      if flops is None:
        g.unread[comp].append(op)
      else:
        g.dots[comp] += flops
        if op == "ragged-dot":
          g.grouped[comp] += flops
    elif op == "custom-call":
      _custom_call(g, comp, name, ins)
    elif op in _RAGGED:
      _ragged_collective(g, comp, ins, starts, name, dev)
    elif op in _ASYNC_CALLS:
      pass  # an async call (TPU: offloaded to a SparseCore): its computation is read itself
    elif op in ("send", "recv", "ragged-all-to-all"):
      if "is_host_transfer=true" not in ins.attrs:  # device traffic of a run-time size
        g.unread[comp].append(op)
      elif _MEGASCALE in ins.attrs and op == "send":  # a collective across slices (DCN)
        _dcn_collective(g, comp, ins)
    elif any(op in (c, c + "-start", c + "-done") for c in COLLECTIVE_KINDS):
      _collective(g, comp, ins, starts, name, dev)
    elif op in _ASYNC_CALL and (op != "call-start" or _CALL_RE.search(ins.attrs)):
      pass  # the computation it runs is read itself (the -start's edge above)
    elif not _does_no_counted_work(op):
      g.unread[comp].append(op)


def _devices(hlo_text: str, num_devices: int | None) -> _Devices:
  header = dict(_DEVICES_RE.findall(hlo_text.split("\n", 1)[0]))
  partitions = int(header.get("num_partitions", 1))
  if num_devices is None:
    return _Devices(int(header.get("replica_count", 1)) * partitions, partitions,
                    hlo_text.startswith("HloModule"))
  return _Devices(int(num_devices), partitions, True)


def summarize(hlo_text: str, num_devices: int | None = None) -> Summary:
  """Matmul FLOPs and collective traffic of one optimized HLO module, loops unrolled by count.

  Args:
    hlo_text: `jax.stages.Compiled.as_text()` (optimized, partitioned HLO: shapes per device),
      an XLA dump's `*after_optimizations.txt`, or instruction lines without computations
      (read as one computation that runs once).
    num_devices: devices a collective without `replica_groups` spans; default the module's
      `replica_count` x `num_partitions` (1 where the text has no module header, and such
      collectives are then listed in `unread.groups`).

  Returns:
    An `Summary` (FLOPs and bytes per device per step), with what could not be read in
    its `unread` field.

  Raises:
    StepError: `hlo_text` is not a string or `num_devices` is below 1.

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> s = fs.analysis.hlo.summarize(text)  # 2 x 8 x 32 x 16
    >>> s.matmul_flops, s.collectives, s.unread.count
    (8192.0, (), 0)
  """
  if not isinstance(hlo_text, str):
    raise StepError(f"hlo_text is a {type(hlo_text).__name__}, expected the str of "
                    "`jax.stages.Compiled.as_text()`")
  if num_devices is not None and int(num_devices) < 1:
    raise StepError(f"num_devices={num_devices}, expected at least 1")
  dev = _devices(hlo_text, num_devices)
  if dev.total < 1:
    raise StepError(f"num_devices={dev.total}, expected at least 1")
  comps, entry = _computations(hlo_text)
  g = _graph()
  _index(comps, g)
  _fused_scatters(g)
  for name in comps:
    _read_computation(name, g, dev)

  loops = []
  for caller, body, cond, init, known in g.whiles:
    trips = _loop_trips(g, caller, body, cond, init) if known is None else None
    loop = Loop(body, known) if known is not None else Loop(body, trips, trips is not None)
    loops.append(loop)
    # An unknown count runs the body once; a count of 0 never runs it.
    body_runs = 1 if loop.trip_count is None else loop.trip_count
    g.edges[caller].extend(((body, body_runs), (cond, (loop.trip_count or 0) + 1)))
  mult = _multiplicities(comps, g.edges, entry)
  unknown = tuple(l.body for l, w in zip(loops, g.whiles) if l.trip_count is None and mult[w[0]])
  return _summary(g, mult, tuple(loops), unknown, dev.total)


def _ring_groups(colls: dict, mult: dict) -> tuple[tuple[str, int, float], ...]:
  """(kind, group size, ring bytes sent per step) of `colls` (comp -> [(kind, bytes, n)])."""
  groups: dict[tuple[str, int], float] = collections.defaultdict(float)
  for c, items in colls.items():
    for kind, nbytes, n in items:
      groups[(kind, n)] += ring_bytes_sent(kind, nbytes, n) * mult[c]
  return tuple((k, n, b) for (k, n), b in sorted(groups.items()) if b)


def _summary(g: _Graph, mult: dict, loops: tuple, unknown: tuple, num_devices: int
             ) -> Summary:
  """The per-step figures of a read module, each computation weighted by its runs."""
  out: dict[str, list] = {}
  for c, items in g.colls.items():
    for kind, nbytes, n in items:
      e = out.setdefault(kind, [0, 0.0, 0, 0.0])
      e[0] += mult[c]
      e[1] += nbytes * mult[c]
      e[2] += 1 if mult[c] else 0
      e[3] += ring_bytes_sent(kind, nbytes, n) * mult[c]
  count = lambda d: tuple(sorted(collections.Counter(
      x for c, xs in d.items() if mult[c] for x in xs).items()))
  kernels: dict[tuple[str, str], list] = {}
  for c, items in g.kernels.items():
    for name, target, declared in items:
      if mult[c]:
        k = kernels.setdefault((name, target), [0, 0, 0.0, True])
        k[0], k[1] = k[0] + 1, k[1] + mult[c]
        k[2] += (declared or 0.0) * mult[c]
        k[3] = k[3] and declared is not None
  return Summary(
      matmul_flops=sum(f * mult[c] for c, f in g.dots.items()),
      matmul_flops_once=sum(f for c, f in g.dots.items() if mult[c]),
      collectives=tuple(Collective(k, int(v[0]), int(v[1]), v[2], float(v[3]))
                        for k in COLLECTIVE_KINDS if (v := out.get(k)) and v[2]),
      loops=loops, num_devices=int(num_devices),
      groups=_ring_groups(g.colls, mult),
      unread=Unread(count(g.unread), unknown, count(g.guessed)),
      dcn_groups=_ring_groups(g.dcn, mult),
      grouped_flops=sum(f * mult[c] for c, f in g.grouped.items()),
      kernels=tuple(Kernel(n, t, v[0], v[1], v[2] if v[3] else None)
                    for (n, t), v in sorted(kernels.items())))


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

  Examples:
    >>> import fnscale as fs
    >>> text = "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%a"
    >>> [(c.kind, c.count, c.bytes, c.ops) for c in fs.analysis.hlo.collectives(text)]
    [('all-reduce', 1, 1024, 1)]
  """
  return summarize(hlo_text, num_devices).collectives


def matmul_flops(hlo_text: str, *, apply_trip_counts: bool = True) -> float:
  """Matmul FLOPs per device per step of an optimized HLO module (`dot`, `ragged-dot`,
  `convolution` and GPU library matmuls, as `summarize`).

  2 x result elements x contracted elements per op; with `apply_trip_counts` each op is
  multiplied by the runs of its computation (while-loop trip counts), else every reachable
  loop body counts once (as XLA's `cost_analysis()` does). Errors as `summarize`.

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> fs.analysis.hlo.matmul_flops(text)  # 2 x 8 x 32 x 16
    8192.0
  """
  s = summarize(hlo_text)
  return s.matmul_flops if apply_trip_counts else s.matmul_flops_once


def flops_ratio(hlo_text: str, model_flops: float) -> float:
  """HLO matmul FLOPs per device per step (`matmul_flops`) / `model_flops` per device.

  With `model_flops` the FLOPs the step's own matmuls need (`fnscale.analysis._cost.jaxpr_matmul_flops`
  of the traced step, remat included), 1.0 says the compiled program does the model's work
  and no more; with PaLM's 6N + attention (`fnscale.analysis.model_flops_per_token` x tokens /
  devices), remat's recomputation shows above 1 and attention inside a Pallas kernel (a
  custom kernel, `Summary.kernels`, not counted here) below.

  Raises:
    StepError: `model_flops` not a positive number, or a bad `hlo_text` (as `summarize`).

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> fs.analysis.hlo.flops_ratio(text, model_flops=8192.0)  # the model's work, no more
    1.0
  """
  if isinstance(model_flops, bool) or not isinstance(model_flops, (int, float)) or not (
      model_flops > 0):
    raise StepError(f"model_flops={model_flops!r}, expected a positive number of FLOPs per "
                    "device per step")
  return summarize(hlo_text).matmul_flops / float(model_flops)
