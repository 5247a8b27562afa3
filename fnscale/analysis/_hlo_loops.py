"""While loops' trip counts and how many times each computation runs per step.

A loop's count is XLA's `known_trip_count` where its `backend_config` has one, else read from
its condition `i < N` (`_loop_trips`, looking through copies and the one-op fusions XLA's CPU
backend wraps the compare and the increment in); `_multiplicities` then weights every
computation by the loops around it. Read by `fnscale.analysis.hlo.summarize`.
"""
from __future__ import annotations

import collections
import re

from fnscale.analysis._hlo_text import _Graph, _Instr

_TRIP_RE = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')

_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


def _record_while(g: _Graph, comp: str, ins: _Instr) -> None:
  """Adds a while loop of `comp` to `g.whiles`: (caller, body, condition, init operand, known
  trip count or None); `hlo.summarize` counts its trips once every computation is read."""
  t = _TRIP_RE.search(ins.attrs)
  body, cond = (re.search(rf"\b{k}=%?([\w.\-]+)", ins.attrs) for k in ("body", "condition"))
  g.whiles.append((comp, body.group(1) if body else "?", cond.group(1) if cond else "?",
                   ins.operands[0][0] if ins.operands else None,
                   int(t.group(1)) if t else None))


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
