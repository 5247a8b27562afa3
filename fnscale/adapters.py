"""Adapters: params and logical axes from framework models, without importing the frameworks.

fnscale needs only a pytree of arrays and, optionally, names per leaf. Flax keeps
partitioning annotations in boxes around the arrays: Linen's `LogicallyPartitioned`
(`nn.with_logical_partitioning`, logical names) and `Partitioned` (`nn.with_partitioning`,
names meant as mesh axes), NNX's `Variable` metadata (`nnx.with_partitioning`: mesh axes,
or logical names when the Variable carries Flax's `sharding_rules`). fnscale reads them by
duck typing, so importing fnscale never imports flax.

`init_state`, `shardings` and `shard_step` read them where params enter: pass
`lambda key: model.init(key, x)["params"]` or an NNX State (`nnx.state(model, nnx.Param)`)
as it is. Logical names are mapped by fnscale's rules. Mesh-axis names (`MeshNames`) were
written for their authors' mesh: on this one a name that is a mesh axis is that axis, a name
the mesh lacks is mapped by the rules as a logical name, and a leaf none of whose names lands
on an axis gets automatic FSDP; each way is logged once at INFO. Fewer names than the array's
rank leave the trailing dimensions unsharded, as in Flax. Linen boxes are taken off (the
state holds their plain arrays: under the step's mesh `model.apply` would otherwise turn each
box into a sharding constraint); NNX Variables stay. While the step is traced, Flax's
logical rules are fnscale's (else Flax's own), each keeping only the mesh axes a constraint
may name there, so `nn.with_logical_constraint` on activations follows the same layout.

`unbox_flax` gives the plain params and the names themselves. Equinox needs no adapter:
`eqx.partition(model, eqx.is_inexact_array)` already gives a params pytree, and logical axes
go by path regex.

Examples:
  A Linen model's boxes go straight into fnscale: logical names through the rules, the mesh
  axis "data" (absent here) through the rules too, as a logical name:

  >>> import fnscale as fs, jax, jax.numpy as jnp, flax.linen as nn
  >>> init = nn.initializers.lecun_normal()
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
  ...     return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("data", None)))(h)
  >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
  >>> shapes = jax.eval_shape(MLP().init, jax.random.key(0), jnp.ones((1, 16)))["params"]
  >>> sh = fs.shardings(shapes, mesh, rules=[("embed", "fsdp"), ("mlp", "tensor"),
  ...                                        ("data", "fsdp")])
  >>> sh["Dense_0"]["kernel"].spec, sh["Dense_1"]["kernel"].spec
  (P('fsdp', 'tensor'), P('fsdp', None))
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fnscale._flax import MeshNames, is_linen_box, is_nnx_variable, names_of

__all__ = ["MeshNames", "unbox_flax"]


def _unbox(x, path: str) -> tuple[Any, Any]:
  if is_linen_box(x):
    return x.value, names_of(x, path)
  if is_nnx_variable(x):
    return x.get_value(), names_of(x, path)
  if isinstance(x, Mapping):
    pairs = {k: _unbox(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
    return {k: p for k, (p, _) in pairs.items()}, {k: a for k, (_, a) in pairs.items()}
  if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
    pairs = [_unbox(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
    return type(x)(p for p, _ in pairs), type(x)(a for _, a in pairs)
  return x, None


def unbox_flax(tree) -> tuple[Any, Any]:
  """Splits a Flax variables tree into plain params and fnscale's names for each leaf.

  Works on Linen variables from `model.init` (or `jax.eval_shape` of it) whose leaves may be
  `nn.LogicallyPartitioned` boxes (from `nn.with_logical_partitioning`: a tuple of logical
  names) or `nn.Partitioned` boxes (from `nn.with_partitioning`: `MeshNames`, mesh axes of
  the authors' mesh), and on an NNX `State` (from `nnx.split`) whose Variables may carry
  `out_sharding`/`sharding_names`/`sharding` metadata (from `nnx.with_partitioning`:
  `MeshNames`, or logical names when the Variable carries Flax's `sharding_rules`). Flax's
  own rules are ignored: fnscale's `rules` map the names. `init_state`, `shardings` and
  `shard_step` read the same boxes themselves; this function is for the names alone or a
  pure dict of an NNX State.

  Args:
    tree: nested mappings (dict, FrozenDict, nnx.State), lists and tuples whose leaves are
      boxes, Variables, arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    `(params, logical_axes)`: `params` has the same nesting with plain dicts and the unboxed
    arrays as leaves (a Linen params dict, or the pure dict `nnx.merge` accepts);
    `logical_axes` has the same structure with a tuple of logical names, a `MeshNames`, or
    None (unannotated: fnscale's automatic FSDP) per leaf; pass it to `fnscale.shardings`,
    `init_state` and `shard_step`.

  Raises:
    ShardingError: an annotation naming a dimension with something other than a str or None
      (or, as mesh axes, a tuple of str).

  Examples:
    Logical names (`with_logical_partitioning`), mesh axes (`with_partitioning`, as
    `MeshNames`) and no annotation (None: fnscale's automatic FSDP):

    >>> import fnscale as fs, jax, jax.numpy as jnp, flax.linen as nn
    >>> kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    >>> bias = nn.with_partitioning(nn.initializers.zeros_init(), ("tensor",))
    >>> variables = jax.eval_shape(nn.Dense(8, kernel_init=kernel, bias_init=bias).init,
    ...                            jax.random.key(0), jnp.ones((1, 4)))
    >>> params, axes = fs.adapters.unbox_flax(variables["params"])
    >>> params["kernel"].shape, axes
    ((4, 8), {'bias': MeshNames('tensor',), 'kernel': ('embed', 'mlp')})
    >>> fs.adapters.unbox_flax({"w": jnp.zeros(3)})[1]
    {'w': None}
  """
  return _unbox(tree, "")
