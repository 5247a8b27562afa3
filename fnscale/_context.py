"""The ambient values fnscale reads, all declared here (none elsewhere).

fnscale's functions take what they need as arguments, except five values that are read
where a step is traced, each set by a scoped wrapper and reset when its scope ends:

- the mesh: the mesh traced code shards over. Set by `fnscale.with_mesh` (or the user's own
  `jax.set_mesh` / `jax.sharding.use_abstract_mesh`); jax's own context, read with
  `jax.sharding.get_abstract_mesh()` (and `fnscale._compat.concrete_mesh()`).
- `AXIS_CONVENTIONS`: which mesh axes split the batch and the attention heads (an
  `fnscale.AxisConventions`; None: fnscale's own, `fnscale._axes.FNSCALE`). Set by
  `fnscale.axis_conventions`; a `contextvars.ContextVar`.
- `KERNEL_CHOICE`: what `fnscale.attention(implementation="auto")` runs, and Pallas interpret
  mode (a `KernelChoice`). Set by `fnscale.with_kernel` for each call of the function it
  wraps; a jax user context (`jax.make_user_context`).
- `EXPERT_CHOICE`: how `fnscale.parallel.moe(exchange="auto")` exchanges tokens and
  runs its grouped matmuls (an `ExpertChoice`). Set by `fnscale.parallel.with_experts`
  for each call of the function it wraps; a jax user context.
- `PARAM_SPECS`: the params' PartitionSpecs while `fnscale.shard_step` traces a step
  ((treedef, specs), or None), so that gradient accumulators keep the params' sharding. Set
  by `fnscale._loss.param_specs`, which `shard_step` enters; a jax user context.

Threads and asyncio (jax 0.10.2 and 0.12): a new thread starts with none of them set. The
mesh, `KERNEL_CHOICE`, `EXPERT_CHOICE` and `PARAM_SPECS` are jax's thread-local state: while
set, every asyncio task running on that thread sees them. `AXIS_CONVENTIONS` is copied into
each asyncio task when the task is created, so one task's `axis_conventions` is not seen by
another. jit: the mesh, `KERNEL_CHOICE`, `EXPERT_CHOICE` and `PARAM_SPECS` are part of
`jax.jit`'s cache key (a function traced under one value is traced again under another);
`AXIS_CONVENTIONS` is not, so enter `axis_conventions` around building and compiling a step,
not between calls of one jitted function. `tests/test_ambient.py` checks each of these.
"""
from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax


class KernelChoice(NamedTuple):
  """The kernel choice `fnscale.with_kernel` makes visible to the calls inside it.

  Attributes:
    attention: what `attention(implementation="auto")` runs: "auto" (the best kernel for
      the platform) or one of `fnscale.kernels.IMPLEMENTATIONS`.
    interpret: run the Pallas kernels in interpret mode (any platform; for tests on CPU).
    context, context_order: the form ("all_gather", "ring" or "ulysses") and the order
      ("zigzag", "striped" or "contiguous") of attention under a context axis
      (`fnscale.parallel.context`).
    block_sizes: the kernel tiles (`fnscale.kernels.BlockSizes`) of every attention call
      that gives none itself; None: chosen per call from its shapes.

  Examples:
    >>> import fnscale as fs
    >>> c = fs.kernels.KernelChoice()  # outside any with_kernel: each call decides
    >>> c.attention, c.context, c.block_sizes
    ('auto', 'all_gather', None)
    >>> fs.kernels.KernelChoice(attention="xla")._replace(context="ring").context
    'ring'
  """
  attention: str = "auto"
  interpret: bool = False
  context: str = "all_gather"
  context_order: str = "zigzag"
  block_sizes: Any = None


class ExpertChoice(NamedTuple):
  """The choice `fnscale.parallel.with_experts` makes visible to the `moe` calls
  inside it: the exchange ("auto", "ragged", "gather_experts", "all_gather",
  "all_to_all"), the grouped matmul ("auto", "ragged_dot", "megablox") and Pallas
  interpret mode.

  Examples:
    >>> import fnscale as fs
    >>> fs.parallel.ExpertChoice()  # outside any with_experts: the layer decides
    ExpertChoice(exchange='auto', grouped_matmul='auto', interpret=False)
  """
  exchange: str = "auto"
  grouped_matmul: str = "auto"
  interpret: bool = False


AXIS_CONVENTIONS: contextvars.ContextVar = contextvars.ContextVar(
    "fnscale_axis_conventions", default=None)
KERNEL_CHOICE = jax.make_user_context(KernelChoice())
EXPERT_CHOICE = jax.make_user_context(ExpertChoice())
PARAM_SPECS = jax.make_user_context(None)
