"""Analysis: what a compiled step costs, and which mesh a model should use on a target.

`hlo` reads an optimized HLO module (matmul FLOPs with loop trip counts, each collective's
runs and bytes, what crosses slices); `flops` counts model FLOPs and measures a CPU peak;
`report` turns a compiled step into a `CompileReport`; `plan` ranks meshes, remat and
accumulation for a model on a described target and verifies the best by compiling for it;
`invariance` checks that a step computes the same thing on several meshes; `fit` holds a
compiled step against its devices' memory before it runs, naming what would fit.

Layer: the top of the library; imports the core pipeline, `fnscale.kernels` and
`fnscale.parallel`; never `fnscale.multihost`, `fnscale.checkpoint` or the package root.
"""
from fnscale.analysis import fit, flops, hlo, invariance, plan, report

__all__ = ["fit", "flops", "hlo", "invariance", "plan", "report"]
