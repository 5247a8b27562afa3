"""Kernels: attention on Pallas/cuDNN with a reasoned fallback, blockwise cross-entropy,
grouped matmul (ragged_dot or megablox) for experts, an int8 matmul that quantizes its
activations inside (Pallas TPU).

`fnscale.attention`, `fnscale.cross_entropy` and `fnscale.with_kernel` (the pipeline's names)
run them; this namespace says what runs and why: `kernel_selection` (a `KernelSelection`:
attention's implementation, `IMPLEMENTATIONS`, with its `BlockSizes`), `gmm_selection` (a
`GmmSelection` among `GMM_IMPLEMENTATIONS`) and the ambient `KernelChoice` that
`with_kernel` sets; `RESIDUALS`, the checkpoint name of the attention kernel's output and
logsumexp (a remat policy that saves it spares the forward kernel's rerun); and
`grouped_matmul`, the experts' matmul; `int8_matmul`, an int8 matmul quantizing its
activations in the kernel (chosen by `int8_selection` among `INT8_IMPLEMENTATIONS`;
`quantize_rows` its quantization, `vmem_footprint` its tiles' VMEM); `splash_block_sizes`,
the splash tiles attention runs for a `BlockSizes` (with the fused backward kernel when
`SPLASH_FUSED_BACKWARD`).

Under `jax.default_matmul_precision`, a kernel on bfloat16 or float16 operands runs at the
default precision (its products are exact in the float32 accumulator, and Mosaic lowers no
"highest" bfloat16 dot); a float32 kernel and the caller's own matmuls keep the setting.

Layer: imports the core pipeline only; never `fnscale.parallel`, `fnscale.multihost`,
`fnscale.checkpoint`, `fnscale.analysis` or the package root.

Examples:
  What attention runs on this host, and on a TPU:

  >>> import fnscale as fs
  >>> fs.kernels.IMPLEMENTATIONS
  ('auto', 'xla', 'splash', 'cudnn', 'pallas_gpu')
  >>> q = (2, 1024, 8, 128)  # [batch, seq, heads, head_dim]
  >>> fs.kernels.kernel_selection(q, q).implementation, fs.kernels.kernel_selection(
  ...     q, q, platform="tpu").implementation
  ('xla', 'splash')

  The splash tiles attention runs for 512-row query and 1024-row key tiles, with one fused
  backward kernel:

  >>> sizes = fs.kernels.splash_block_sizes(fs.kernels.BlockSizes(512, 1024))
  >>> sizes.use_fused_bwd_kernel == fs.kernels.SPLASH_FUSED_BACKWARD == True
  True

  A remat policy that keeps attention's residuals:

  >>> import jax
  >>> policy = jax.checkpoint_policies.save_only_these_names(fs.kernels.RESIDUALS)
"""
from fnscale import _deprecation
from fnscale._context import KernelChoice
from fnscale.kernels._attention import (IMPLEMENTATIONS, RESIDUALS, BlockSizes, KernelSelection,
                                       kernel_selection)
from fnscale.kernels._grouped_matmul import (GMM_IMPLEMENTATIONS, GmmSelection, gmm_selection,
                                             grouped_matmul)
from fnscale.kernels._int8_matmul import (INT8_IMPLEMENTATIONS, Int8Selection, int8_matmul,
                                          int8_selection, quantize_rows, vmem_footprint)
from fnscale.kernels._splash_tiles import SPLASH_FUSED_BACKWARD, splash_block_sizes

__all__ = [
    "IMPLEMENTATIONS", "BlockSizes", "KernelChoice", "KernelSelection", "kernel_selection",
    "RESIDUALS",
    "GMM_IMPLEMENTATIONS", "GmmSelection", "gmm_selection", "grouped_matmul",
    "SPLASH_FUSED_BACKWARD", "splash_block_sizes",
    "INT8_IMPLEMENTATIONS", "Int8Selection", "int8_matmul", "int8_selection", "quantize_rows",
    "vmem_footprint",
]

_ROOT = "fnscale.{0} (the pipeline's name)"
__getattr__ = _deprecation.moved(__name__, {
    "attention": ("fnscale:attention", _ROOT.format("attention")),
    "cross_entropy": ("fnscale:cross_entropy", _ROOT.format("cross_entropy")),
    "with_kernel": ("fnscale:with_kernel", _ROOT.format("with_kernel")),
    "context_attention": ("fnscale.kernels._context_attention",
                          "fnscale.parallel.context (its orders, forms and reorderings)"),
})
