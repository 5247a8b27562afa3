"""Adapters: params and logical axes from framework models, without importing the frameworks.

fnscale needs only a pytree of arrays and, optionally, logical axis names per leaf. Flax
keeps partitioning annotations in boxes around the arrays: Linen's `LogicallyPartitioned`
(`nn.with_logical_partitioning`) and `Partitioned` (`nn.with_partitioning`), NNX's
`Variable` metadata (`nnx.with_partitioning`). `unbox_flax` reads them by duck typing, so
importing fnscale never imports flax. Equinox needs no adapter: `eqx.partition(model,
eqx.is_inexact_array)` already gives a params pytree, and logical axes go by path regex.

Examples:
  A Linen layer's logical annotations become fnscale's logical axes, mapped by fnscale's
  rules:

  >>> import fnscale as fs, jax, jax.numpy as jnp, flax.linen as nn
  >>> kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  >>> variables = jax.eval_shape(nn.Dense(8, kernel_init=kernel).init, jax.random.key(0),
  ...                            jnp.ones((1, 4)))
  >>> params, axes = fs.adapters.unbox_flax(variables["params"])
  >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
  >>> fs.shardings(params, mesh, rules=[("embed", "fsdp"), ("mlp", "tensor")],
  ...              logical_axes=axes)["kernel"].spec
  P('fsdp', 'tensor')
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.sharding import PartitionSpec

from fnscale._errors import ShardingError

__all__ = ["unbox_flax"]


def _is_linen_box(x) -> bool:
  # flax.core.meta.Partitioned and its subclass flax.linen.LogicallyPartitioned.
  return hasattr(x, "names") and hasattr(x, "unbox") and hasattr(x, "value")


def _is_nnx_variable(x) -> bool:
  return hasattr(x, "get_metadata") and hasattr(x, "get_value")


def _checked_names(names, path: str):
  names = tuple(names)
  if not all(n is None or isinstance(n, str) for n in names):
    raise ShardingError(
        f"leaf '{path}': partitioning annotation {names!r} must name each dimension with a "
        "str or None; fix: annotate e.g. ('embed', 'mlp'), and write a dimension sharded "
        "over several axes as one logical name with a rule mapping it to a tuple of mesh axes.")
  return names


def _unbox(x, path: str) -> tuple[Any, Any]:
  if _is_linen_box(x):
    names = _checked_names(x.names, path)
    # LogicallyPartitioned (it has `rules`) holds logical names; Partitioned holds mesh axes.
    return x.value, names if hasattr(x, "rules") else PartitionSpec(*names)
  if _is_nnx_variable(x):
    meta = x.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return x.get_value(), None if not names else _checked_names(names, path)
  if isinstance(x, Mapping):
    pairs = {k: _unbox(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
    return {k: p for k, (p, _) in pairs.items()}, {k: a for k, (_, a) in pairs.items()}
  if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
    pairs = [_unbox(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
    return type(x)(p for p, _ in pairs), type(x)(a for _, a in pairs)
  return x, None


def unbox_flax(tree) -> tuple[Any, Any]:
  """Splits a Flax variables tree into plain params and fnscale logical axes.

  Works on Linen variables from `model.init` (or `jax.eval_shape` of it) whose leaves may be
  `nn.LogicallyPartitioned` boxes (from `nn.with_logical_partitioning`, names are logical
  axes) or `nn.Partitioned` boxes (from `nn.with_partitioning`, names are mesh axes, kept
  as an explicit `PartitionSpec`), and on an NNX `State` (from `nnx.split`) whose Variables
  may carry `out_sharding` metadata (from `nnx.with_partitioning`; names are logical axes).
  Flax's own rules inside boxes are ignored: fnscale's `rules` map the names.

  Args:
    tree: nested mappings (dict, FrozenDict, nnx.State), lists and tuples whose leaves are
      boxes, Variables, arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    `(params, logical_axes)`: `params` has the same nesting with plain dicts and the unboxed
    arrays as leaves (a Linen params dict, or the pure dict `nnx.merge` accepts);
    `logical_axes` has the same structure with a tuple of names, a PartitionSpec, or None
    (unannotated: fnscale's automatic FSDP) per leaf; pass it to `fnscale.shardings`,
    `init_state` and `shard_step`.

  Raises:
    ShardingError: an annotation naming a dimension with something other than a str or None.

  Examples:
    Logical names (`with_logical_partitioning`), mesh axes (`with_partitioning`, kept as a
    PartitionSpec) and no annotation (None: fnscale's automatic FSDP):

    >>> import fnscale as fs, jax, jax.numpy as jnp, flax.linen as nn
    >>> kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    >>> bias = nn.with_partitioning(nn.initializers.zeros_init(), ("tensor",))
    >>> variables = jax.eval_shape(nn.Dense(8, kernel_init=kernel, bias_init=bias).init,
    ...                            jax.random.key(0), jnp.ones((1, 4)))
    >>> params, axes = fs.adapters.unbox_flax(variables["params"])
    >>> params["kernel"].shape, axes
    ((4, 8), {'bias': P('tensor',), 'kernel': ('embed', 'mlp')})
    >>> fs.adapters.unbox_flax({"w": jnp.zeros(3)})[1]
    {'w': None}
  """
  return _unbox(tree, "")
