"""Params the loss indexes (table lookups), gathered over the data axes before the loss.

A token-embedding table whose model dim is split over a data axis (FSDP's "embed" over
"fsdp"), looked up with token ids split over the same axis (`table[tokens]`: Linen's and
NNX's `Embed`, Equinox's `Embedding`, `jnp.take`), would put one mesh axis on two dims of the
lookup's result; XLA's partitioner then replicates that [batch, seq, d] result on every
device ("[SPMD] Involuntary full rematerialization"), whatever the model constrains after
it. `train_step` gathers such a table over those axes before the loss, as FSDP gathers any
weight it uses (the table moves forward, its gradient is reduce-scattered back). The
tables are found by tracing the loss to a jaxpr and following each `gather`'s operand back to
a params leaf; a table split only on its indexed dim (vocab) is left split.
"""
from __future__ import annotations

from collections.abc import Callable

import jax

from fnscale import _compat
from fnscale import _tree

# Primitives whose output is their first operand's values: a table passes through them.
_SAME = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint",
                   "reshard", "pvary", "optimization_barrier"})


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      jaxpr = getattr(v, "jaxpr", v)  # a ClosedJaxpr's, or a Jaxpr
      if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
        yield jaxpr


def _walk(jaxpr, origin: dict, found: dict) -> None:
  """Adds to `found` (leaf index -> operand dims the gathers index) each gather whose
  operand is `origin`'s leaf; `origin` maps this jaxpr's vars to leaf indices."""
  get = lambda v: origin.get(v) if type(v).__name__ != "Literal" else None
  for eqn in jaxpr.eqns:
    src = get(eqn.invars[0]) if eqn.invars else None
    name = eqn.primitive.name
    if name == "gather" and src is not None:
      # Dims it slices (a batched `x[i]` also "indexes" a dim it takes whole, at 0).
      shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
      found.setdefault(src, set()).update(d for d in range(len(shape)) if sizes[d] < shape[d])
    elif name in _SAME and src is not None:
      origin[eqn.outvars[0]] = src
    if "shard_map" in name or "pmap" in name:
      continue  # a lookup per shard (manual axes) is local: nothing for the partitioner
    for sub in _subjaxprs(eqn):
      # Operands pass positionally (jit, custom_vjp, remat, scan); cond's skip the index.
      outer = list(eqn.invars[len(eqn.invars) - len(sub.invars):])
      if name == "scan":  # its xs enter sliced (stacked layers): not the leaf itself
        parts = _compat.scan_parts(eqn)
        del outer[len(parts.consts) + len(parts.carry):]
      inner = {v: get(o) for v, o in zip(sub.invars, outer) if get(o) is not None}
      if inner:
        _walk(sub, inner, found)


def indexed(fn: Callable, params, *args) -> dict[int, set[int]]:
  """{params leaf index: the dims a gather indexes it on} for `fn(params, *args)`."""
  closed = jax.make_jaxpr(fn)(params, *args)
  n = len(jax.tree.leaves(params))
  found: dict[int, set[int]] = {}
  _walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[:n])}, found)
  return found


def gather_tables(fn: Callable, params, args: tuple, specs: list, axes: set):
  """`params` with each leaf that `fn(params, *args)` looks up in, and whose other dims
  (those not indexed) are split over `axes` (the Auto data axes), constrained whole over
  `axes`. `specs`: the params' PartitionSpecs, one per leaf."""
  split = lambda spec, dims: any(set(_tree.entry_axes(e)) & axes
                                 for d, e in enumerate(spec) if d not in dims)
  if not any(split(s, ()) for s in specs):
    return params  # nothing split over the data axes: no lookup to fix, no second trace
  tables = {i: dims for i, dims in indexed(fn, params, *args).items()
            if split(specs[i], dims)}
  if not tables:
    return params
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [
      jax.lax.with_sharding_constraint(x, _tree.filter_spec(specs[i], lambda a: a not in axes))
      if i in tables else x for i, x in enumerate(leaves)])
