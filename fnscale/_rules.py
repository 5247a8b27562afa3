"""Logical axis rules: one array's logical names resolved to a PartitionSpec on a mesh.

An ordered rule set maps each logical name ("embed", "mlp", "heads", ...) to one mesh axis,
several, or none; `logical_to_spec` resolves one array's names rule by rule as
`flax.linen.logical_to_mesh_axes` does, `mesh_names_spec` reads Flax metadata meant as mesh
axes, and `leaf_logical_axes` gives each leaf of a tree its names (a pytree of them or
(path_regex, names) pairs). The scheme follows GSPMD (Xu et al., 2021) as used by
T5X/MaxText.
"""
from __future__ import annotations

from collections.abc import Mapping
import math
import re

import jax
from jax.sharding import PartitionSpec

from fnscale import _flax
from fnscale import _tree
from fnscale._errors import ShardingError
from fnscale._mesh import check_mesh
from fnscale._specs import _check_divisible, _where, check_spec


def normalize_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """Rules as ((logical_name, (mesh_axis, ...)), ...); () means 'replicate this dim'.

  Raises:
    ShardingError: `rules` not a sequence of pairs or a mapping; a pair that is not
      (str, axis | tuple of axes | None); one mesh axis twice in a rule (naming the rule).
  """
  if rules is None:
    return ()
  if isinstance(rules, Mapping):
    rules = tuple(rules.items())
  if isinstance(rules, str) or not isinstance(rules, (tuple, list)):
    raise ShardingError(
        f"rules is {_tree.got(rules)}, expected a sequence of (logical_name, mesh_axes) pairs "
        "or a mapping; fix: e.g. (('embed', 'fsdp'), ('mlp', 'tensor')).")
  return tuple(_rule(i, rule) for i, rule in enumerate(rules))


def _rule(i: int, rule) -> tuple[str, tuple[str, ...]]:
  if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
    raise ShardingError(
        f"rule {i} is {rule!r}, expected (logical_name, mesh_axis | (mesh_axes...) | None); "
        "fix: write rules like (('embed', 'fsdp'), ('mlp', 'tensor'), ('batch', "
        "('data', 'fsdp'))).")
  name, axes = rule
  if axes is None:
    axes = ()
  elif isinstance(axes, str):
    axes = (axes,)
  elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
    axes = tuple(axes)
  else:
    raise ShardingError(
        f"rule {i} ({name!r}) maps to {axes!r}, expected a mesh axis name, a tuple of "
        "names, or None; fix: e.g. ('batch', ('data', 'fsdp')).")
  dup = next((a for j, a in enumerate(axes) if a in axes[:j]), None)
  if dup is not None:
    raise ShardingError(
        f"rule {i} ({name!r}) names mesh axis {dup!r} twice in {axes}; a mesh axis "
        "can split one dimension only once; fix: list each axis once.")
  return name, axes


def logical_to_spec(logical_axes, rules, mesh, *, shape=None, path: str = "",
                    _notes: list | None = None) -> PartitionSpec:
  """Resolves one array's logical axis names to a PartitionSpec on `mesh`.

  Args:
    logical_axes: a tuple with one logical name (str) or None per leading dimension (fewer
      names than the rank leave the trailing dimensions unsharded, as in Flax and jax), a
      `PartitionSpec` (taken as explicit mesh axes and only validated), or
      `fnscale.adapters.MeshNames` (Flax metadata meant as mesh axes: an axis of this mesh
      where it is one, else a logical name for the rules).
    rules: ordered (logical_name, mesh_axis | tuple of mesh axes | None) pairs, or a mapping.
      Resolved rule by rule, as `flax.linen.logical_to_mesh_axes` and MaxText do: going
      down the list, a rule claims the dimension carrying its name when that dimension is
      still unclaimed and none of the rule's mesh axes shards another dimension yet (so an
      earlier rule gets its mesh axis first, whatever the dimension order). A rule naming an
      axis absent from the mesh is skipped (so size-1 or smaller meshes work unchanged; with
      every axis present the result is flax's); an axis of size 1 counts as present (the
      rule wins and shards nothing: leave the axis out of the mesh to let a later rule
      apply); a rule mapping to None claims the dimension and replicates it. A name without
      a usable rule is replicated.
    mesh: a `jax.sharding.Mesh` (or AbstractMesh).
    shape: optional global shape; when given, the rank must match and each sharded
      dimension must be divisible by the product of its mesh axes' sizes.
    path: the leaf's path, used in error messages.

  Returns:
    A PartitionSpec with one entry per dimension.

  Raises:
    MeshError: a mesh that isn't one.
    ShardingError: malformed rules; more names than the rank; one logical name on two
      dimensions; an explicit spec longer than the rank, naming axes not in the mesh, or
      binding one mesh axis to two dimensions; a dimension not divisible by its mesh axes.

  Examples:
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
    >>> rules = [("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor")]
    >>> fs.logical_to_spec(("embed", "mlp"), rules, mesh)
    P('fsdp', 'tensor')
    >>> fs.logical_to_spec(("vocab", "mlp"), rules, mesh)  # tensor went to vocab first
    P('tensor', None)
  """
  check_mesh(mesh, "logical_to_spec", abstract=True)
  sizes = dict(mesh.shape)
  if isinstance(logical_axes, _flax.MeshNames):
    return mesh_names_spec(logical_axes, rules, mesh, shape=shape, path=path)[0]
  if isinstance(logical_axes, PartitionSpec):
    check_spec(path, logical_axes, shape, sizes)
    return logical_axes
  if isinstance(logical_axes, str) or not isinstance(logical_axes, (tuple, list)) or not all(
      n is None or isinstance(n, str) for n in logical_axes):
    raise ShardingError(
        f"{_where(path)}: logical axes {logical_axes!r} must be a tuple of names (str or "
        "None), one per dimension, or a PartitionSpec; fix: e.g. ('embed', 'mlp').")
  if shape is not None and len(logical_axes) > len(shape):
    raise ShardingError(
        f"{_where(path)}: logical axes {tuple(logical_axes)} have {len(logical_axes)} names but "
        f"the array has rank {len(shape)} (shape {tuple(shape)}); fix: give at most one name "
        "(or None) per dimension.")
  # Fewer names than dimensions: the trailing ones unsharded (Flax's and jax's reading).
  names = tuple(logical_axes) + (None,) * (len(shape) - len(logical_axes) if shape else 0)
  dup = next((n for i, n in enumerate(names) if n is not None and n in names[:i]), None)
  if dup is not None:
    raise ShardingError(
        f"{_where(path)}: logical axes {names} name {dup!r} on two dimensions; a logical name "
        "can label one dimension of an array (as in flax); fix: give the dimensions distinct "
        "names, e.g. ('embed', 'embed_out').")
  chosen = _resolve(names, normalize_rules(rules), sizes, _notes)
  spec = PartitionSpec(*(_tree.spec_entry(axes) for axes in chosen))
  if shape is not None:
    _check_divisible(path, shape, spec, sizes)
  return spec


def mesh_names_spec(names, rules, mesh, *, shape=None, path: str = "",
                    _notes: list | None = None) -> tuple[PartitionSpec, str | None]:
  """`(spec, how)` for `MeshNames` (Flax metadata meant as mesh axes) on `mesh`: a name
  that is an axis of the mesh is that axis, a name the mesh lacks a logical name mapped by
  `rules` (those whose axes are still free), a tuple entry the axes of it the mesh has;
  trailing dimensions without a name unsharded. `how` is "rules" when a rule placed a
  dimension, else "mesh"; None when names were given but none landed on an axis of this mesh
  (the caller's automatic FSDP then decides).

  A dimension not divisible by its axes is left unsharded (the names were written for
  another mesh). `how` is None also when only axes of size 1 were named.

  Raises:
    ShardingError: more names than the rank, one mesh axis on two dimensions.
  """
  sizes = dict(mesh.shape)
  if shape is not None and len(names) > len(shape):
    raise ShardingError(
        f"{_where(path)}: Flax names {tuple(names)} have {len(names)} entries but the array "
        f"has rank {len(shape)} (shape {tuple(shape)}); fix: give at most one name (or None) "
        "per dimension.")
  names = tuple(names) + (None,) * (len(shape) - len(names) if shape is not None else 0)
  direct = [tuple(a for a in n if a in sizes) if isinstance(n, tuple)
            else (n,) if n in sizes else () for n in names]
  used = {a for axes in direct for a in axes}
  logical = tuple(n if isinstance(n, str) and n not in sizes else None for n in names)
  free = [(r, axes) for r, axes in normalize_rules(rules) if not set(axes) & used]
  ruled = _resolve(logical, free, sizes, _notes)
  chosen = [d or r for d, r in zip(direct, ruled)]
  for i, axes in enumerate(chosen):  # names written for another mesh or shape: a hint
    n = math.prod(sizes[a] for a in axes)
    if shape is not None and shape[i] % n:
      chosen[i] = ()
      if _notes is not None:
        _notes.append(f"dim {i} ({names[i]}) unsharded: size {shape[i]} not divisible by "
                      f"{axes} ({n})")
  spec = PartitionSpec(*(_tree.spec_entry(axes) for axes in chosen))
  check_spec(path, spec, shape, sizes)
  if any(names) and not any(sizes[a] > 1 for axes in chosen for a in axes):
    return spec, None  # nothing split here (axes of size 1 split nothing)
  return spec, "rules" if any(ruled) else "mesh"


def _resolve(names, norm, sizes, notes) -> list[tuple[str, ...]]:
  """Each dimension's mesh axes, rule by rule as `flax.linen.logical_to_mesh_axes` resolves
  them: in rule order, a rule claims its dimension when the dimension is still unclaimed
  and none of its mesh axes is bound yet; rules naming an axis absent from the mesh are
  skipped. Why a named dimension stayed replicated goes to `notes`."""
  chosen: list[tuple[str, ...] | None] = [None] * len(names)
  used: dict[str, int] = {}
  taken, absent = {}, {}  # dim -> first blocking axis / each skipped rule's first absent axis
  for rule_name, axes in norm:
    if rule_name not in names:
      continue
    d = names.index(rule_name)
    if chosen[d] is not None:
      continue
    missing = [a for a in axes if a not in sizes]
    bound = [a for a in axes if a in used]
    if missing:
      absent.setdefault(d, []).append(missing[0])
    elif bound:
      taken.setdefault(d, bound[0])
    else:
      chosen[d] = axes
      used.update((a, d) for a in axes)
  for d, name in enumerate(names):
    if notes is None or name is None or chosen[d] is not None:
      continue
    if d in taken:
      notes.append(f"dim {d} ({name}) replicated: {taken[d]} already shards dim "
                   f"{used[taken[d]]}")
    elif d in absent:
      notes.append(f"dim {d} ({name}) replicated: its rules name mesh axes "
                   f"{absent[d]} that the mesh doesn't have")
    else:
      notes.append(f"dim {d} ({name}) replicated: no rule names {name!r}")
  return [axes or () for axes in chosen]


def _is_axes_leaf(x) -> bool:
  return x is None or isinstance(x, (PartitionSpec, _flax.MeshNames)) or (
      isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))


def _is_pattern_list(logical_axes) -> bool:
  return isinstance(logical_axes, (list, tuple)) and len(logical_axes) > 0 and all(
      isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str)
      and isinstance(e[1], (tuple, PartitionSpec)) and not isinstance(e[1], str)
      and _is_axes_leaf(tuple(e[1]) if isinstance(e[1], list) else e[1])
      for e in logical_axes)


def leaf_logical_axes(tree, paths: list[str], logical_axes) -> list:
  """Per-leaf logical axes (tuple, PartitionSpec or None) in flattening order, from a pytree
  with `tree`'s structure or a sequence of (path_regex, names) pairs.

  Raises:
    ShardingError: an invalid regex, or a tree that doesn't match (listing leaf paths).
  """
  n = len(paths)
  if logical_axes is None:
    return [None] * n
  if _is_pattern_list(logical_axes):
    compiled = []
    for pattern, axes in logical_axes:
      try:
        compiled.append((re.compile(pattern), axes))
      except re.error as e:
        raise ShardingError(
            f"logical_axes pattern {pattern!r} is not a valid regular expression ({e}); fix: "
            "escape special characters, e.g. r'blocks/\\d+/attn/wq'.") from None
    return [next((axes for rx, axes in compiled if rx.search(p)), None) for p in paths]
  treedef = jax.tree_util.tree_structure(tree)
  try:
    return list(treedef.flatten_up_to(logical_axes))
  except (ValueError, TypeError) as e:
    raise ShardingError(
        "logical_axes must be a pytree with the params' structure (a tuple of names or None "
        "per leaf) or a sequence of (path_regex, names) pairs; the tree didn't match: "
        f"{e}; params leaf paths: {paths[:8]}{' ...' if n > 8 else ''}.") from None
