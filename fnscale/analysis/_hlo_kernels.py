"""Custom calls: custom kernels (Pallas, Mosaic GPU, Triton), listed and not counted; GPU
library matmuls, counted (`_hlo_flops`); and the targets known to do no matmul and move no
device-to-device bytes. Anything else is unread. Read by `fnscale.analysis._hlo_read`.
"""
from __future__ import annotations

import re

from fnscale.analysis._hlo_flops import (_CUDNN_CONV, _FMHA_PREFIX, _GEMM_TARGETS,
                                         _cudnn_conv_flops, _fmha_flops, _gemm_flops)
from fnscale.analysis._hlo_text import _Graph, _Instr

_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
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
    # TPU: the start and done of an async collective fusion, around the collective it runs
    # (an all-gather of FSDP weights: counted as itself).
    "AsyncCollectiveStart", "AsyncCollectiveDone",
    "MoveToHost", "MoveToDevice", "PadToStatic", "SliceToDynamic", "LayoutConstraint",
    "TopK", "ApproxTopK", "PartialReduce", "Eigh", "Qr",
    "ProductOfElementaryHouseholderReflectors", "LuDecomposition", "shape_assertion",
    "__cub$DeviceRadixSort", "__cublas$triangularSolve", "__cudnn$norm",
    "__cudnn$convReorderFilter", "__cudnn$convReorderFilterAndBias")
_NO_MATMUL_PREFIXES = ("lapack_", "cusolver_", "hipsolver_", "cusparse_", "cu_threefry",
                       "hip_threefry", "cu_lu_", "hip_lu_", "stablehlo.", "xla_python_",
                       "xla_ffi_python_", "xla_ffi_partitioned_python_")


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


def _kernel_runs(kernels: dict, mult: dict) -> list[tuple[str, str, int, int, float | None]]:
  """(name, target, ops, runs, declared FLOPs or None) per step of each kernel in `kernels`
  (comp -> [(name, target, declared)]) that runs, sorted; the declared FLOPs are None unless
  every call declares them."""
  out: dict[tuple[str, str], list] = {}
  for c, items in kernels.items():
    for name, target, declared in items:
      if mult[c]:
        k = out.setdefault((name, target), [0, 0, 0.0, True])
        k[0], k[1] = k[0] + 1, k[1] + mult[c]
        k[2] += (declared or 0.0) * mult[c]
        k[3] = k[3] and declared is not None
  return [(n, t, v[0], v[1], v[2] if v[3] else None) for (n, t), v in sorted(out.items())]
