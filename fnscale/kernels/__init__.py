"""Kernels: attention on Pallas/cuDNN with a reasoned fallback, blockwise cross-entropy."""
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

__all__ = [
    "IMPLEMENTATIONS",
    "BlockSizes",
    "KernelChoice",
    "KernelSelection",
    "attention",
    "cross_entropy",
    "kernel_selection",
    "with_kernel",
]
