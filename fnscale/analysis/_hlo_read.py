"""One computation read instruction by instruction: each opcode to the reader that counts its
work (loops, matmul FLOPs, custom calls, collectives), and the opcodes that do no counted work.
"""
from __future__ import annotations

from fnscale.analysis._hlo_collectives import (COLLECTIVE_KINDS, _RAGGED, _Devices,
                                               _collective, _ragged_collective, _transfer)
from fnscale.analysis._hlo_flops import _MATMUL_OPS
from fnscale.analysis._hlo_kernels import _custom_call
from fnscale.analysis._hlo_loops import _record_while
from fnscale.analysis._hlo_text import _CALL_LIST_RE, _CALL_RE, _Graph

# Opcodes that do no matmul and move no device-to-device bytes (XLA's HLO_OPCODE_LIST,
# xla/hlo/ir/hlo_opcode.h, less those `_read_computation` hands to a reader): any other
# opcode is unread, so work in an op the reader doesn't count (fft, triangular-solve,
# cholesky, scaled-dot, scan's repeated body, collective-reduce's traffic) or an opcode newer
# than this list is never skipped silently. Computations an op calls (fusion, call, while,
# conditional, async, map, reduce and sort comparators) are read themselves.
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
    # host transfers, device ids, dynamic shapes (a `send`/`recv` is read by `_transfer`)
    "get-dimension-size", "infeed", "outfeed", "partition-id", "recv-done", "replica-id",
    "send-done", "set-dimension-size"))
# Wrappers that call computations which may hold matmuls: never read as async sugar.
_CALLS_WORK = ("call", "conditional", "fusion", "while")


def _does_no_counted_work(op: str) -> bool:
  """`op` is in `_NO_COUNTED_WORK`, or is XLA's async spelling of one that calls no
  computation: an async op wrapping a single instruction prints as that instruction's
  `-start`/`-update`/`-done` (TPU: `slice-start`, `slice-done`)."""
  base, _, stage = op.rpartition("-")
  return op in _NO_COUNTED_WORK or (stage in ("start", "update", "done")
                                    and base in _NO_COUNTED_WORK and base not in _CALLS_WORK)


# Async calls whose work is the computation they call (`to_apply=` / `called_computations=`
# on the start, read as any called computation; the -update and -done only wait for it): TPU
# SparseCore offloads of gathers and scatters (`async_execution_thread="sparsecore"`).
_ASYNC_CALLS = ("call-start", "call-update", "call-done", "custom-call-start",
                "custom-call-update", "custom-call-done")


def _read_computation(comp: str, g: _Graph, dev: _Devices) -> None:
  """Adds one computation's calls, loops, matmuls, kernels and collectives to `g`."""
  starts: dict[str, tuple[int, bool]] = {}
  for name, ins in g.instrs.get(comp, {}).items():
    op = ins.op
    if op == "while":
      _record_while(g, comp, ins)
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
    elif op in ("send", "recv"):
      _transfer(g, comp, ins)
    elif any(op in (c, c + "-start", c + "-done") for c in COLLECTIVE_KINDS):
      _collective(g, comp, ins, starts, name, dev)
    elif not _does_no_counted_work(op):
      g.unread[comp].append(op)
