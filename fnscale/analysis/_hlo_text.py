"""Optimized HLO text -> instructions and computations: the parsing every HLO reader shares.

`_computations` splits a module into computations (instruction lines by computation name);
`_index` parses each line into an `_Instr` (opcode, result shape, operands, attributes) in a
`_Graph`, the container the readers of loops (`_hlo_loops`), matmul FLOPs (`_hlo_flops`),
custom kernels (`_hlo_kernels`) and collectives (`_hlo_collectives`) fill; `_arrays`,
`_shape_bytes` and `_operand_dims` read shapes. `fnscale.analysis.hlo` says what the text is.
"""
from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

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
_LINE_START_RE = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=")
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
  """What `_hlo_read._read_computation` collects from every computation of a module (build
  one with `_graph()`: fresh containers each time)."""
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

