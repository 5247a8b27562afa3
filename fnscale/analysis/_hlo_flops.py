"""Matmul FLOPs of one instruction: `dot`, `ragged-dot`, `convolution` and the GPU library
calls that replace them (cuBLAS GEMMs, cuDNN convolutions and fused attention).

Each reader returns FLOPs per run of its computation, or None where a shape or a dimension
list can't be read (the op is then unread). Read by `fnscale.analysis._hlo_read`.
"""
from __future__ import annotations

import itertools
import math
import re

from fnscale.analysis._hlo_text import _Graph, _Instr, _arrays, _ints, _operand_dims

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


def _contracted(g: _Graph, comp: str, ins: _Instr, contract: list[int] | None) -> float | None:
  """2 x result elements x the sizes of the lhs's `contract` dims: a dot's or a GEMM's FLOPs
  (None without the shapes or the contracted dims)."""
  out, lhs = _arrays(ins.shape), _operand_dims(g, comp, ins, 0)
  if not out or lhs is None or contract is None or any(i >= len(lhs) for i in contract):
    return None
  return 2.0 * math.prod(out[0][1]) * math.prod(lhs[i] for i in contract)


def _dot_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  """FLOPs of a dot: 2 x result elements x contracted size (None without the shapes)."""
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  if not m and "lhs_contracting_dims" in ins.attrs:
    return None
  return _contracted(g, comp, ins, _ints(m.group(1) if m else ""))  # none: an outer product


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


def _gemm_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  """A cuBLAS GEMM: 2 x result elements x the lhs's contracted size (from the config)."""
  m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
  return _contracted(g, comp, ins, _ints(m.group(1)) if m else None)


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


def _conv_op_flops(g: _Graph, comp: str, ins: _Instr) -> float | None:
  out = _arrays(ins.shape)
  return _conv_flops(_operand_dims(g, comp, ins, 0), out[0][1] if out else None, ins.attrs)


# Opcodes counted as matmuls -> their FLOPs (None: not readable).
_MATMUL_OPS = {"dot": _dot_flops, "ragged-dot": _ragged_dot_flops, "convolution": _conv_op_flops}
