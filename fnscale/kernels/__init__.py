"""Kernels: attention on Pallas/cuDNN with a reasoned fallback, blockwise cross-entropy,
grouped matmul (ragged_dot or megablox) for experts."""
from fnscale.kernels.attention import (
    IMPLEMENTATIONS,
    BlockSizes,
    KernelChoice,
    KernelSelection,
    attention,
    kernel_selection,
    with_kernel,
)
from fnscale.kernels.cross_entropy import cross_entropy
from fnscale.kernels.grouped_matmul import (
    GMM_IMPLEMENTATIONS,
    GmmSelection,
    gmm_selection,
    grouped_matmul,
)

__all__ = [
    "IMPLEMENTATIONS",
    "BlockSizes",
    "KernelChoice",
    "KernelSelection",
    "attention",
    "GMM_IMPLEMENTATIONS",
    "GmmSelection",
    "cross_entropy",
    "gmm_selection",
    "grouped_matmul",
    "kernel_selection",
    "with_kernel",
]
