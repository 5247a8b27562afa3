"""Parallelism beyond data, FSDP and tensor: each mode a mesh axis plus pure functions.

- pipeline (the `stage` axis): `pipeline(stage_fn, microbatches=M)` runs a stack of layers
  as stages over the axis; `stage_layers` / `unstage_layers` lay stacked params out for it;
  `Schedule`, `bubble_fraction` and `schedules_in` describe a compiled schedule;
- experts (the `expert` axis): `moe` is a mixture-of-experts feed-forward whose experts are
  split over the axis, from `route`'s `Routing` to the `MoEAux` auxiliaries; `with_experts`
  chooses how tokens are exchanged (`EXCHANGES`, `exchange_selection`) and grouped;
- `context` (the `context` axis): the vocabulary of sequence parallelism, the order of a
  row's tokens over the axis (`context.reorder_batch`, `context.restore`, ...).

Layer: imports the core pipeline and `fnscale.kernels`; never `fnscale.multihost`,
`fnscale.checkpoint`, `fnscale.analysis` or the package root.

Examples:
  The modes as mesh axes: a pipeline's bubble, an expert layer's capacity, a context split.

  >>> import fnscale as fs
  >>> round(fs.parallel.bubble_fraction(stages=4, microbatches=16), 3)
  0.158
  >>> fs.parallel.capacity(1.0, seq=4096, k=2, num_experts=8)
  1024
  >>> fs.parallel.context.shards(fs.make_mesh({"data": 2, "context": 4}))
  4
"""
from fnscale import _deprecation
from fnscale.parallel import context
from fnscale.parallel._experts import (EXCHANGES, ExchangeSelection, ExpertChoice, MoEAux,
                                       Routing, Scoring, capacity, exchange_selection, moe,
                                       route, update_router_bias, with_experts)
from fnscale.parallel._pipeline import (Schedule, bubble_fraction, pipeline, schedules_in,
                                        stage_layers, unstage_layers)

__all__ = [
    "pipeline", "stage_layers", "unstage_layers", "Schedule", "bubble_fraction", "schedules_in",
    "moe", "route", "Routing", "Scoring", "update_router_bias", "MoEAux", "capacity",
    "with_experts", "ExpertChoice",
    "EXCHANGES", "ExchangeSelection", "exchange_selection",
    "context",
]

__getattr__ = _deprecation.moved(__name__, {
    "experts": ("fnscale.parallel._experts", "fnscale.parallel.moe, .route, .with_experts, "
                "... (fnscale.parallel)"),
})
