"""Pytree helpers shared by fnscale's modules: one spelling of leaf paths, per-leaf shardings,
abstract values and byte/number formatting.

Leaf paths are '/'-joined pytree keys: `{"blocks": [{"attn": {"wq": w}}]}` gives
`blocks/0/attn/wq`; attribute keys (NamedTuple fields, dataclass fields) give their name.
"""
from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec
import numpy as np

from fnscale._errors import FnscaleError, ShardingError


def path_str(path) -> str:
  """A pytree key path as 'a/0/b' (dict keys, sequence indices and attribute names):
  `jax.tree_util.keystr`'s simple spelling, '/'-joined (the same on jax 0.10 and 0.12)."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def leaves_with_paths(tree) -> list[tuple[str, Any]]:
  """(path string, leaf) for every leaf of `tree`, in flattening order."""
  return [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_shardings(tree, shardings, what: str, error: type[FnscaleError] = ShardingError
                   ) -> list:
  """One sharding per leaf of `tree` from `shardings`: a single `jax.sharding.Sharding`, or a
  pytree prefix of `tree` whose every leaf is a Sharding covering the subtree below it.

  Raises:
    `error`: a non-Sharding where a sharding was expected, or a structure that is not a
      prefix of the tree's (the message names `what`).
  """
  out = []

  def f(s, sub):
    if not isinstance(s, jax.sharding.Sharding):
      raise error(f"the {what} shardings hold a {type(s).__name__} where a "
                  "jax.sharding.Sharding was expected; fix: pass NamedShardings.")
    out.extend([s] * len(jax.tree_util.tree_leaves(sub)))

  try:
    jax.tree.map(f, shardings, tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  except (ValueError, TypeError) as e:
    raise error(
        f"the {what} shardings don't match the {what}'s structure ({e}); fix: pass one "
        f"NamedSharding, or a pytree of them with the {what}'s structure or a prefix of it "
        "(one sharding covers a subtree).") from None
  return out


def aval(leaf) -> tuple[tuple[int, ...], np.dtype]:
  """(shape, canonical dtype) of an array, ShapeDtypeStruct or Python/numpy scalar."""
  shape = tuple(int(d) for d in np.shape(leaf))
  dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
  return shape, np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def abstract(tree, flat_shardings: list):
  """`tree` as `jax.ShapeDtypeStruct`s, leaf i carrying `flat_shardings[i]`."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return jax.tree_util.tree_unflatten(treedef, [
      jax.ShapeDtypeStruct(*aval(x), sharding=s) for x, s in zip(leaves, flat_shardings)])


def entry_axes(entry) -> tuple[str, ...]:
  """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def spec_entry(axes: tuple[str, ...]):
  """The PartitionSpec entry for mesh axes: None, one name, or a tuple of names."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def filter_spec(spec: PartitionSpec, keep: Callable[[str], bool]) -> PartitionSpec:
  """`spec` with only the mesh axes for which `keep(axis)` holds, entry by entry (an entry
  left with none, or `UNCONSTRAINED`, becomes None): the one filter of specs, e.g. to the
  manual axes of a `jax.shard_map`, or without the axes a value is gathered over."""
  return PartitionSpec(*(spec_entry(tuple(a for a in entry_axes(e) if keep(a)))
                         for e in spec))


def nbytes(shape, dtype) -> int:
  return int(math.prod(shape)) * np.dtype(dtype).itemsize


def fmt_bytes(n) -> str:
  """Bytes in binary units ('1.5 MiB'); 'n/a' for None."""
  if n is None:
    return "n/a"
  n = int(n)
  if abs(n) < 1024:
    return f"{n} B"
  x = float(n)
  for unit in ("KiB", "MiB", "GiB", "TiB"):
    x /= 1024
    if abs(x) < 1024 or unit == "TiB":
      break
  return f"{x:.1f} {unit}"


def fmt_num(x) -> str:
  """A count in SI units ('1.25 G'); 'n/a' for None."""
  if x is None:
    return "n/a"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {unit}"
  return f"{x:.0f}"


def type_name(x) -> str:
  return type(x).__name__


def got(x) -> str:
  """'a str ('data=8')': what a caller passed, for error messages (repr cut at 60 chars); an
  array (or a traced one) by its dtype and shape: 'a float32[] array'."""
  if isinstance(x, jax.Array):  # a tracer is one too
    return f"a {x.dtype}{list(x.shape)} array"
  r, name = repr(x), type_name(x)
  article = "an" if name[0].lower() in "aeiou" else "a"
  return f"{article} {name} ({r if len(r) <= 60 else r[:57] + '...'})"


def check_int(value, name: str, error: type[FnscaleError], *, minimum: int | None = None,
              allow_none: bool = False) -> None:
  """Raises `error` naming `name` unless `value` is an int (not a bool) >= `minimum`."""
  if value is None and allow_none:
    return
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  if not ok or (minimum is not None and value < minimum):
    want = "an int" + (f" >= {minimum}" if minimum is not None else "")
    want += " or None" if allow_none else ""
    raise error(f"{name}={value!r} ({type_name(value)}), expected {want}.")



def static_arrays(tree) -> list[str]:
  """'Class.field' for each jax array (or tracer) that a node of `tree` keeps in its pytree
  metadata rather than as a leaf (an Equinox `eqx.field(static=True)`, a flax struct's
  `pytree_node=False`): jax compares metadata with `==`, which an array can't answer, so any
  jit over such a tree fails with a message that names no field. numpy arrays compare fine."""
  found = []

  def arrays(x) -> list:
    if isinstance(x, jax.Array):
      return [x]
    if isinstance(x, (tuple, list)):
      return [a for v in x for a in arrays(v)]
    if isinstance(x, dict):
      return [a for v in x.values() for a in arrays(v)]
    return []

  def visit(node):
    children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    data = treedef.node_data()
    if data is None:
      return
    held = {id(a) for a in arrays(data[1])}
    if held:
      fields = vars(node) if hasattr(node, "__dict__") else {}
      names = [k for k, v in fields.items() if held & {id(a) for a in arrays(v)}]
      found.extend(f"{type_name(node)}.{k}" for k in names or ["<metadata>"])
    for child in children:
      visit(child)

  visit(tree)
  return found
