"""Collectives: replica-group sizes, ring bytes sent, the TPU compiler's fused reduce-scatters,
ragged all-to-alls and a multi-slice program's collectives across slices (over DCN).

Each op is recorded in a `_Graph` as (kind, result bytes per device, devices per group);
`fnscale.analysis.hlo.summarize` weights them by their computations' runs.
"""
from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

from fnscale._errors import StepError
from fnscale.analysis._hlo_text import (_CALL_RE, _Graph, _Instr, _arrays, _dtype_bytes, _ints,
                                        _operand_dims, _shape, _shape_bytes, _through)

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast", "ragged-all-to-all")
_DEVICES_RE = re.compile(r"\b(replica_count|num_partitions)=(\d+)")


class _Devices(NamedTuple):
  """The module's device counts: `total` devices an all-device collective spans (the caller's
  `num_devices`, else replicas x partitions), `partitions`, and `known` (False for text
  without a module header and no `num_devices`: an all-device group is then a guess)."""
  total: int
  partitions: int
  known: bool


def _devices(hlo_text: str, num_devices: int | None) -> _Devices:
  """The device counts of a module from its header line (`replica_count`, `num_partitions`)
  and the caller's `num_devices`."""
  header = dict(_DEVICES_RE.findall(hlo_text.split("\n", 1)[0]))
  partitions = int(header.get("num_partitions", 1))
  if num_devices is None:
    return _Devices(int(header.get("replica_count", 1)) * partitions, partitions,
                    hlo_text.startswith("HloModule"))
  return _Devices(int(num_devices), partitions, True)


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


def _start_of(ins: _Instr, starts: dict, missing):
  """What `starts` holds for the async -start an async -done waits on (its operand)."""
  src = ins.operands[0][0].split("#")[0] if ins.operands else ""
  return starts.get(src, missing)


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
    n, guessed = _start_of(ins, starts, (dev.total, not dev.known))
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


def _ragged_collective(g: _Graph, comp: str, ins: _Instr, starts: dict, name: str,
                       dev: _Devices) -> None:
  """Adds a ragged all-to-all (or records its async -start) to `g`. Its sizes are known only
  at run time; its bytes are the smaller of its operand (what a device may send) and its
  result (the buffer it may receive into): the dropless exchange sends its whole sorted
  operand one way and fills its whole result on the way back, so that is exact per pair."""
  op = ins.op
  if op.endswith("-done"):
    (n, guessed), sent = _start_of(ins, starts, ((dev.total, not dev.known), None))
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
# An all-to-all across slices (Ulysses attention over a DCN context axis) may list its
# groups of devices instead, e.g. `_xla_megascale_target={{100000,200000},{100001,200001}}`:
# its group is the slices of the first.
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}
_MEGASCALE_PAIRS_RE = re.compile(r"_xla_megascale_target=\{((?:\{\d+->\d+\},?)+)\}")
_MEGASCALE_GROUPS_RE = re.compile(r"_xla_megascale_target=\{\{([\d,]+)\}")
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
  groups = _MEGASCALE_GROUPS_RE.search(ins.attrs)
  if base == "collective-permute":
    slices = _crosses_slices(ins.attrs)
  elif target:
    slices = _slice_count(target.group(1))
  else:  # groups of device ids: the slices of the first
    slices = len({i // _MEGASCALE_SLICE for i in _ints(groups.group(1))}) if groups else None
  if base is None or slices is None or not data:
    g.unread[comp].append(f"send {kind.group(1) if kind else 'megascale'}")
    return
  (dtype, dims), = data
  sent = math.prod(dims) * _dtype_bytes(dtype)
  result = {"all-gather": sent * slices, "reduce-scatter": sent / slices}.get(base, sent)
  entry = (base, result, slices)
  g.colls[comp].append(entry)
  g.dcn[comp].append(entry)


def _transfer(g: _Graph, comp: str, ins: _Instr) -> None:
  """A `send` or `recv`: a device-to-device one moves bytes known only at run time (unread);
  a megascale host-transfer send is a collective across slices; other host transfers move
  no device-to-device bytes."""
  if "is_host_transfer=true" not in ins.attrs:
    g.unread[comp].append(ins.op)
  elif _MEGASCALE in ins.attrs and ins.op == "send":
    _dcn_collective(g, comp, ins)


def _per_kind(colls: dict, mult: dict) -> list[tuple[str, int, int, int, float]]:
  """(kind, executions, result bytes, ops, ring bytes sent) per step of each kind in `colls`
  (comp -> [(kind, bytes, n)]) that runs, in `COLLECTIVE_KINDS` order, each op weighted by
  its computation's runs `mult`."""
  out: dict[str, list] = {}
  for c, items in colls.items():
    for kind, nbytes, n in items:
      e = out.setdefault(kind, [0, 0.0, 0, 0.0])
      e[0] += mult[c]
      e[1] += nbytes * mult[c]
      e[2] += 1 if mult[c] else 0
      e[3] += ring_bytes_sent(kind, nbytes, n) * mult[c]
  return [(k, int(v[0]), int(v[1]), v[2], float(v[3]))
          for k in COLLECTIVE_KINDS if (v := out.get(k)) and v[2]]


def _ring_groups(colls: dict, mult: dict) -> tuple[tuple[str, int, float], ...]:
  """(kind, group size, ring bytes sent per step) of `colls` (comp -> [(kind, bytes, n)])."""
  groups: dict[tuple[str, int], float] = collections.defaultdict(float)
  for c, items in colls.items():
    for kind, nbytes, n in items:
      groups[(kind, n)] += ring_bytes_sent(kind, nbytes, n) * mult[c]
  return tuple((k, n, b) for (k, n), b in sorted(groups.items()) if b)
