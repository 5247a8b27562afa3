"""Shardings: logical axis rules -> PartitionSpecs, automatic FSDP, batch shardings.

A parameter's dimensions carry *logical* names ("embed", "mlp", "heads", "vocab", ...). An
ordered rule set maps each logical name to one mesh axis, several, or none; `logical_to_spec`
turns the names of one array into a `PartitionSpec` for a given mesh. Leaves without logical
names get an automatic FSDP policy (shard the largest dimension divisible by the fsdp axis),
as in ZeRO-3 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models") and PyTorch FSDP; the logical-rule scheme follows GSPMD (Xu et al., 2021)
as used by T5X/MaxText.

Leaf paths are '/'-joined pytree keys (`fnscale._tree.path_str`). Path patterns in
`logical_axes` are matched with `re.search` against that string. The optimizer state's
shardings come from `fnscale.state_shardings`, the readable table in `fnscale.sharding_report`.
"""
from __future__ import annotations

from collections.abc import Mapping
import math
import re
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from fnscale import _axes
from fnscale import _flax
from fnscale._axes import data_axes  # noqa: F401  (public here: the batch dim's axes)
from fnscale import _tree
from fnscale._errors import ShardingError, did_you_mean
from fnscale._mesh import check_mesh

# Leaves smaller than this many bytes stay replicated under auto-FSDP: gathering a tiny
# bias or norm scale costs a collective's latency and saves almost no memory.
DEFAULT_MIN_SHARD_BYTES = 1 << 14

# Why a leaf got its sharding (the `reason` field of `LeafSharding`).
RULES = "rules"  # from the user's logical axes and rules
EXPLICIT = "explicit"  # the user gave a PartitionSpec
AUTO_FSDP = "auto-fsdp"  # no logical axes; largest divisible dim sharded over fsdp
SMALL = "replicated:small"  # no logical axes; under min_shard_bytes
INDIVISIBLE = "replicated:indivisible"  # no logical axes; no dim divisible by fsdp size
NO_FSDP = "replicated:no-fsdp-axis"  # no logical axes; the mesh has no fsdp axis > 1
SCALAR = "replicated:scalar"  # rank 0
MESH_NAMES = "mesh-names"  # Flax metadata naming axes of this mesh (`MeshNames`)


class LeafSharding(NamedTuple):
  """How one leaf is sharded.

  Fields: `path` ('/'-joined keys), `shape`, `dtype`, `logical_axes` (tuple of names, a
  PartitionSpec, or None), `spec` (PartitionSpec), `sharding` (NamedSharding),
  `global_bytes` and `device_bytes` (bytes of the whole array and of one device's shard),
  `reason` (one of RULES, EXPLICIT, MESH_NAMES, AUTO_FSDP, SMALL, INDIVISIBLE, NO_FSDP,
  SCALAR) and
  `note` (free text, e.g. a dimension that fell through to replicated).
  """
  path: str
  shape: tuple[int, ...]
  dtype: Any
  logical_axes: Any
  spec: PartitionSpec
  sharding: NamedSharding
  global_bytes: int
  device_bytes: int
  reason: str
  note: str = ""


class ShardingLayout(NamedTuple):
  """The shardings of a pytree and how each was chosen.

  `shardings` is a pytree of NamedSharding with the tree's structure; `leaves` the
  `LeafSharding`s in flattening order; `mesh` the mesh.
  """
  shardings: Any
  leaves: tuple[LeafSharding, ...]
  mesh: Any


# ----------------------------------------------------------------------------- checks


def _where(path: str) -> str:
  return f"leaf '{path}'" if path else "array"


def _shape_dtype(path: str, leaf) -> tuple[tuple[int, ...], np.dtype]:
  if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
    raise ShardingError(
        f"{_where(path)} is a PRNG key array ({leaf.dtype}), not a param to shard or train; "
        "fix: leave keys out of the params (Flax NNX: nnx.split(model, nnx.Param, ...) or "
        "nnx.state(model, nnx.Param)) and give the loss its key with "
        "train_step(..., key=...).")
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)
  if isinstance(leaf, (bool, int, float, complex, np.generic)):
    return (), np.result_type(leaf)
  raise ShardingError(
      f"{_where(path)} is a {type(leaf).__name__}, expected an array or "
      "jax.ShapeDtypeStruct; fix: pass arrays (or jax.eval_shape(...) output) as leaves.")


def _as_axes(value, name: str) -> tuple[str, ...]:
  """A mesh axis argument (None, a name or a sequence of names) as a tuple of names."""
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
    return tuple(value)
  raise ShardingError(f"{name} is {_tree.got(value)}, expected a mesh axis name, a tuple of "
                      "names or None; fix: e.g. 'fsdp' or ('data', 'fsdp').")


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


def _check_divisible(path: str, shape, spec: PartitionSpec, sizes: dict[str, int], *,
                     batch: bool = False) -> None:
  for d, entry in enumerate(spec):
    axes = _tree.entry_axes(entry)
    n = math.prod(sizes[a] for a in axes)
    if n > 1 and shape[d] % n:
      detail = " x ".join(f"{a}={sizes[a]}" for a in axes)
      if batch:
        raise ShardingError(
            f"batch not divisible by the data axes: leaf '{path}' dimension {d} has size "
            f"{shape[d]}, but mesh axes {axes} ({detail}) split it {n} ways; fix: use a "
            f"batch size that is a multiple of {n}.")
      raise ShardingError(
          f"{_where(path)}: dimension {d} has size {shape[d]}, not divisible by mesh axes "
          f"{axes} ({detail} = {n}); fix: choose mesh axis sizes that divide {shape[d]}, "
          "pad the dimension, or map its logical name to other axes (or None).")


def check_spec(path: str, spec: PartitionSpec, shape, sizes: dict[str, int]) -> None:
  """Checks an explicit PartitionSpec against a leaf's shape and the mesh's axis sizes.

  Raises:
    ShardingError: more entries than the rank, an axis not in the mesh, one mesh axis on two
      dimensions, or a dimension not divisible by its axes (naming `path`).
  """
  if shape is not None and len(spec) > len(shape):
    raise ShardingError(
        f"{_where(path)}: PartitionSpec {spec} has {len(spec)} entries but the array has rank "
        f"{len(shape)} (shape {tuple(shape)}); fix: give at most one entry per dimension.")
  used: dict[str, int] = {}
  for d, entry in enumerate(spec):
    for a in _tree.entry_axes(entry):
      if a not in sizes:
        raise ShardingError(
            f"{_where(path)}: PartitionSpec {spec} names mesh axis {a!r}, which is not in the "
            f"mesh (axes {tuple(sizes)}); fix: use only the mesh's axes or build the mesh "
            f"with an axis {a!r}.")
      if a in used:
        raise ShardingError(
            f"{_where(path)}: PartitionSpec {spec} binds mesh axis {a!r} to dimensions "
            f"{used[a]} and {d}; a mesh axis can shard only one dimension of an array; fix: "
            f"use {a!r} once (e.g. replace one entry with None or another axis).")
      used[a] = d
  if shape is not None:
    _check_divisible(path, shape, spec, sizes)


# ----------------------------------------------------------------------------- rules


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


# ----------------------------------------------------------------------------- auto-FSDP


def auto_spec(shape, dtype, sizes, fsdp_axes, min_shard_bytes) -> tuple[PartitionSpec, str]:
  """Automatic FSDP: the largest dimension divisible by the fsdp axes' size (ties: the
  earlier one) is sharded over them; returns (spec, reason)."""
  if not shape:
    return PartitionSpec(), SCALAR
  if _tree.nbytes(shape, dtype) < min_shard_bytes:
    return PartitionSpec(), SMALL
  present = tuple(a for a in fsdp_axes if a in sizes)
  n = math.prod(sizes[a] for a in present) if present else 1
  if n <= 1:
    return PartitionSpec(), NO_FSDP
  best = None
  for d, size in enumerate(shape):
    if size % n == 0 and (best is None or size > shape[best]):
      best = d
  if best is None:
    return PartitionSpec(), INDIVISIBLE
  entries = [None] * len(shape)
  entries[best] = _tree.spec_entry(present)
  return PartitionSpec(*entries), AUTO_FSDP


def _leaf_sharding(path, leaf, axes, mesh, rules, fsdp_axes, min_shard_bytes) -> LeafSharding:
  sizes = dict(mesh.shape)
  shape, dtype = _shape_dtype(path, leaf)
  note = ""
  if axes is None:
    spec, reason = auto_spec(shape, dtype, sizes, fsdp_axes, min_shard_bytes)
  elif isinstance(axes, _flax.MeshNames):
    notes: list[str] = []
    spec, how = mesh_names_spec(axes, rules, mesh, shape=shape, path=path, _notes=notes)
    reason = RULES if how == "rules" else MESH_NAMES
    if how is None:
      spec, reason = auto_spec(shape, dtype, sizes, fsdp_axes, min_shard_bytes)
      notes = [f"its Flax names {tuple(axes)} name no axis of this mesh and no rule maps them"]
    note = "; ".join(notes)
  else:
    notes: list[str] = []
    if isinstance(axes, list):
      axes = tuple(axes)
    spec = logical_to_spec(axes, rules, mesh, shape=shape, path=path, _notes=notes)
    reason = EXPLICIT if isinstance(axes, PartitionSpec) else RULES
    if not shape:
      reason = SCALAR if not any(spec) else reason
    note = "; ".join(notes)
  sharding = NamedSharding(mesh, spec)
  return LeafSharding(path, shape, dtype, axes, spec, sharding, _tree.nbytes(shape, dtype),
                      _tree.nbytes(sharding.shard_shape(shape), dtype), reason, note)


def _known_axes() -> frozenset[str]:
  """Axis names a convention gives a meaning; one of them missing from a mesh is a choice (a
  data-parallel mesh has no "fsdp"), any other missing name is likely a typo."""
  return _axes.KNOWN_AXES | _axes.current().names()


def _check_layout_args(mesh, rules, fsdp_axis, min_shard_bytes, max_replicated_bytes) -> tuple:
  check_mesh(mesh, "sharding_layout", abstract=True)
  fsdp_axes = _as_axes(fsdp_axis, "fsdp_axis")
  _tree.check_int(min_shard_bytes, "min_shard_bytes", ShardingError, minimum=0)
  _tree.check_int(max_replicated_bytes, "max_replicated_bytes", ShardingError, minimum=0,
                  allow_none=True)
  known = _known_axes()
  unknown = [a for a in fsdp_axes if a not in mesh.axis_names and a not in known]
  if unknown:
    raise ShardingError(
        f"fsdp_axis {fsdp_axis!r} names {unknown[0]!r}, which is not an axis of the mesh (axes "
        f"{tuple(mesh.axis_names)}){did_you_mean(unknown[0], tuple(mesh.axis_names))}; automatic "
        "leaves would silently stay replicated; fix: name a mesh axis (e.g. "
        "fsdp_axis='fsdp') or pass None to replicate them on purpose.")
  absent = set()
  for i, (name, axes) in enumerate(normalize_rules(rules)):
    typo = [a for a in axes if a not in mesh.axis_names and a not in known]
    if typo:
      raise ShardingError(
          f"rule {i} ({name!r}, {axes!r}) names mesh axis {typo[0]!r}, which the mesh (axes "
          f"{tuple(mesh.axis_names)}) doesn't have and no axis convention gives a meaning"
          f"{did_you_mean(typo[0], tuple(mesh.axis_names) + tuple(sorted(known)))}; fix: name a "
          "mesh axis (a rule naming a conventional axis this mesh lacks, e.g. 'tensor' on an "
          "fsdp-only mesh, is skipped: rules written for several meshes).")
    absent.update(a for a in axes if a not in mesh.axis_names)
  if absent:  # once per call, however many rules name them
    logging.info("rules naming mesh axes %s are skipped: the mesh (axes %s) doesn't have them "
                 "(rules written for several meshes)", sorted(absent), tuple(mesh.axis_names))
  return fsdp_axes


def sharding_layout(tree, mesh, rules=(), *, logical_axes=None, fsdp_axis="fsdp",
                    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
                    max_replicated_bytes: int | None = None) -> ShardingLayout:
  """Like `shardings`, but also returns how each leaf's sharding was chosen (a
  `ShardingLayout`).

  See `shardings` for the arguments and errors.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 256), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
    >>> layout = fs.sharding_layout(params, fs.make_mesh({"fsdp": 8}))
    >>> for leaf in layout.leaves:
    ...   print(leaf.path, leaf.spec, leaf.reason, leaf.device_bytes)
    b P() replicated:small 1024
    w P('fsdp', None) auto-fsdp 131072
  """
  fsdp_axes = _check_layout_args(mesh, rules, fsdp_axis, min_shard_bytes, max_replicated_bytes)
  tree, flax_names = _flax.read(tree)  # Linen boxes off; their names and NNX metadata read
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [_tree.path_str(p) for p, _ in pairs]
  leaf_axes = leaf_logical_axes(tree, paths, logical_axes)
  if flax_names is not None:  # the caller's logical axes first, then the model's own
    leaf_axes = [a if a is not None else f for a, f in zip(leaf_axes, flax_names)]
  leaves = tuple(
      _leaf_sharding(p, leaf, axes, mesh, rules, fsdp_axes, min_shard_bytes)
      for p, (_, leaf), axes in zip(paths, pairs, leaf_axes))
  if flax_names is not None:
    _log_flax_names(leaves, flax_names, mesh)
  _guard_replicated(leaves, mesh, rules, fsdp_axes, min_shard_bytes, max_replicated_bytes)
  return ShardingLayout(jax.tree_util.tree_unflatten(treedef, [lp.sharding for lp in leaves]),
                        leaves, mesh)


def _log_flax_names(leaves, flax_names, mesh) -> None:
  """One INFO line per way the Flax metadata was taken, with a count and an example."""
  kinds: dict[str, list[LeafSharding]] = {}
  for lp, names in zip(leaves, flax_names):
    if names is None or lp.logical_axes is not names:
      continue  # no metadata, or the caller's logical axes won
    kind = ("logical names mapped by the rules" if not isinstance(names, _flax.MeshNames)
            else "names of this mesh's axes, taken as those axes" if lp.reason == MESH_NAMES
            else "names this mesh lacks, mapped by the rules as logical names"
            if lp.reason == RULES else
            "names of no axis of this mesh and no rule: automatic FSDP instead")
    kinds.setdefault(kind, []).append(lp)
  for kind, lps in kinds.items():
    lp = lps[0]
    logging.info("%d leaves carry Flax sharding metadata with %s on mesh %s (e.g. '%s' %s -> "
                 "%s)", len(lps), kind, dict(mesh.shape), lp.path, tuple(lp.logical_axes),
                 lp.spec)


def _why_replicated(lp: LeafSharding, fsdp_size: int) -> str:
  if lp.reason == INDIVISIBLE:
    return f"no dimension divisible by the fsdp size {fsdp_size}"
  if lp.reason == NO_FSDP:
    return "no logical axes and no fsdp axis in the mesh"
  if lp.reason == EXPLICIT:
    return f"its PartitionSpec {lp.spec} replicates it"
  return lp.note or f"its logical axes {lp.logical_axes} map to no mesh axis"


def _suspect(lp: LeafSharding, ruled: set) -> bool:
  """Whether a replicated leaf looks like a mistake: automatic FSDP found no divisible dim,
  or no rule names any of its logical names. (A name some rule maps to an axis this mesh
  lacks is rules written for several meshes: a bias over "mlp" -> "tensor" on an fsdp-only
  mesh.)"""
  if lp.reason == INDIVISIBLE:
    return True
  if lp.reason != RULES or not lp.note:
    return False
  return not any(n in ruled for n in lp.logical_axes or () if n)


def _guard_replicated(leaves, mesh, rules, fsdp_axes, min_shard_bytes,
                      max_replicated_bytes) -> None:
  """Every whole-array-on-every-device leaf of at least `min_shard_bytes` counts against
  `max_replicated_bytes`, whatever made it replicated; likely mistakes are logged."""
  sizes = dict(mesh.shape)
  n = math.prod(sizes[a] for a in fsdp_axes if a in sizes)
  big = [lp for lp in leaves if lp.shape and lp.global_bytes >= max(min_shard_bytes, 1)
         and lp.device_bytes == lp.global_bytes and math.prod(sizes.values()) > 1]
  total = sum(lp.global_bytes for lp in big)
  listing = ", ".join(f"{lp.path} {lp.shape} ({lp.global_bytes} B) [{_why_replicated(lp, n)}]"
                      for lp in big)
  if max_replicated_bytes is not None and total > max_replicated_bytes:
    raise ShardingError(
        f"{len(big)} leaves ({total} bytes) stay replicated on every device: {listing}; that "
        f"exceeds max_replicated_bytes={max_replicated_bytes}; fix: give them logical axes "
        "and rules that name mesh axes, pad a dimension to a multiple of the fsdp size, "
        "choose an fsdp size that divides one of their dimensions, or raise "
        "max_replicated_bytes.")
  # On a data-parallel mesh (every axis of size > 1 splits only the batch) replicated params
  # are the design, not a likely mistake: nothing to warn about (typo'd axes are refused).
  replica = _axes.current().replica
  shards_params = any(size > 1 and a not in replica for a, size in sizes.items())
  ruled = {name for name, _ in normalize_rules(rules)}
  suspect = [lp for lp in big if _suspect(lp, ruled)]
  if suspect and shards_params:
    logging.warning("%d leaves (%d bytes) stay replicated on every device: %s", len(suspect),
                    sum(lp.global_bytes for lp in suspect),
                    ", ".join(f"{lp.path} {lp.shape} ({lp.global_bytes} B) "
                              f"[{_why_replicated(lp, n)}]" for lp in suspect))


def shardings(tree, mesh, rules=(), *, logical_axes=None, fsdp_axis="fsdp",
              min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
              max_replicated_bytes: int | None = None):
  """A pytree of NamedSharding for `tree` (params, or any state) on `mesh`.

  Args:
    tree: pytree whose leaves are arrays or `jax.ShapeDtypeStruct`s (e.g. from
      `jax.eval_shape(init_fn, key)`), possibly in Flax Linen boxes or NNX Variables: their
      names are the leaves' logical axes or `MeshNames` where `logical_axes` gives none
      (`fnscale.adapters`), and the shardings have the tree's structure without Linen boxes.
    mesh: the `jax.sharding.Mesh`.
    rules: ordered (logical_name, mesh_axis | tuple | None) pairs; see `logical_to_spec`.
    logical_axes: per-leaf logical axes, either a pytree with `tree`'s structure whose
      leaves are tuples of names (or None for "automatic", or a PartitionSpec for explicit
      mesh axes), or a sequence of (path_regex, names) pairs matched with `re.search`
      against each leaf's '/'-joined path (first match wins; unmatched leaves are automatic).
    fsdp_axis: mesh axis name (or tuple of names) that automatic leaves are sharded over;
      a name that is neither a mesh axis nor one a preset of `fnscale.AxisConventions`
      (fnscale's, MaxText's, Levanter's) or the ambient conventions know is an error (a typo
      would replicate every automatic leaf).
    min_shard_bytes: automatic leaves smaller than this stay replicated (int >= 0, bytes).
    max_replicated_bytes: every leaf of at least `min_shard_bytes` that ends up whole on
      every device counts against this limit (bytes), whatever made it replicated: no
      dimension divisible by the fsdp size, no fsdp axis, logical names that no rule maps
      (or whose rules name axes the mesh lacks), or a replicating PartitionSpec; over the
      limit, raise naming each leaf and why. None: no limit. Likely mistakes (indivisible
      leaves, leaves none of whose logical names any rule maps) are logged as warnings
      either way on a mesh with an axis other than replica/data (on a data-parallel mesh
      replicated params are the design). A rule naming an axis that is neither in the mesh
      nor one a convention gives a meaning is an error (a typo: it names the closest
      axis); a rule naming a conventional axis this mesh lacks is skipped, said once per call
      at INFO (rules written for several meshes).

  Returns:
    A pytree of NamedSharding with `tree`'s structure.

  Raises:
    MeshError: `mesh` not a Mesh.
    ShardingError: an argument of the wrong type (named), malformed rules (even when no
      leaf uses them), a rule or fsdp_axis naming an axis neither in the mesh nor
      conventional (with the closest name), a non-array leaf, logical axes not
      matching the tree or a leaf's rank, malformed specs, an indivisible dimension, or too
      many replicated bytes.

  Examples:
    Logical axes and rules (MaxText's scheme): "embed" over fsdp, "mlp" over tensor.

    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
    >>> rules = (("embed", "fsdp"), ("mlp", "tensor"))
    >>> params = {"w_in": jnp.zeros((64, 256)), "w_out": jnp.zeros((256, 64))}
    >>> axes = {"w_in": ("embed", "mlp"), "w_out": ("mlp", "embed")}
    >>> shardings = fs.shardings(params, mesh, rules, logical_axes=axes)
    >>> shardings["w_in"].spec, shardings["w_out"].spec
    (P('fsdp', 'tensor'), P('tensor', 'fsdp'))
    >>> jax.device_put(params, shardings)["w_in"].addressable_shards[0].data.shape
    (16, 128)
  """
  check_mesh(mesh, "shardings", abstract=True)
  return sharding_layout(tree, mesh, rules, logical_axes=logical_axes, fsdp_axis=fsdp_axis,
                         min_shard_bytes=min_shard_bytes,
                         max_replicated_bytes=max_replicated_bytes).shardings


def layout_of(tree, shardings_tree, *, logical_axes=None) -> ShardingLayout:
  """A `ShardingLayout` describing given shardings (reason "sharded" or "replicated").

  Raises:
    ShardingError: shardings that don't match the tree, a non-array leaf.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [_tree.path_str(p) for p, _ in pairs]
  shs = _tree.leaf_shardings(tree, shardings_tree, "tree")
  axes = leaf_logical_axes(tree, paths, logical_axes)
  leaves = []
  for path, (_, leaf), s, ax in zip(paths, pairs, shs, axes):
    shape, dtype = _shape_dtype(path, leaf)
    spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    gb = _tree.nbytes(shape, dtype)
    db = _tree.nbytes(s.shard_shape(shape), dtype)
    leaves.append(LeafSharding(path, shape, dtype, ax, spec, s, gb, db,
                              "sharded" if db < gb else "replicated"))
  mesh = next((s.mesh for s in shs if isinstance(s, NamedSharding)), None)
  return ShardingLayout(jax.tree_util.tree_unflatten(treedef, shs), tuple(leaves), mesh)


# ----------------------------------------------------------------------------- batches


def batch_sharding(mesh, *, axes=None, context_axes=None) -> NamedSharding:
  """Sharding of a batch: the leading dimension split over `axes` (default the mesh's
  data-like axes under the ambient `fnscale.axis_conventions`), the second (the sequence)
  over `context_axes` (default the mesh's context axes of size > 1: context parallelism,
  for batches of [batch, seq, ...] whose sequence `fnscale.parallel.context.reorder` put in
  the attention's order), the other dimensions replicated.

  Raises:
    MeshError: `mesh` not a Mesh.
    ShardingError: `axes` or `context_axes` not axis names, an axis not in the mesh, an
      axis in both.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    >>> sharding = fs.batch_sharding(mesh)
    >>> sharding.spec
    P(('data', 'fsdp'),)
    >>> x = jax.device_put(jnp.zeros((8, 16)), sharding)
    >>> x.addressable_shards[0].data.shape  # 8 rows over 4 data shards
    (2, 16)
    >>> fs.batch_sharding(fs.make_mesh({"data": 2, "context": 4})).spec  # the sequence too
    P('data', 'context')
  """
  check_mesh(mesh, "batch_sharding", abstract=True)
  axes = _axes.data_axes(mesh) if axes is None else _as_axes(axes, "axes")
  context = (_sequence_axes(mesh) if context_axes is None
             else _as_axes(context_axes, "context_axes"))
  for a, what in [(a, "data-like") for a in axes] + [(a, "context") for a in context]:
    if a not in mesh.axis_names:
      raise ShardingError(
          f"batch axis {a!r} is not in the mesh (axes {tuple(mesh.axis_names)}); fix: pass "
          f"axes that the mesh has, or None for its {what} axes.")
  both = sorted(set(axes) & set(context))
  if both:
    raise ShardingError(
        f"mesh axis {both[0]!r} splits both the batch {axes} and the sequence {context}; a "
        "mesh axis can split one dimension: name it in one of axes= and context_axes=.")
  if not axes and not context:
    return NamedSharding(mesh, PartitionSpec())
  entries = [_tree.spec_entry(axes) if axes else None]
  if context:
    entries.append(_tree.spec_entry(context))
  return NamedSharding(mesh, PartitionSpec(*entries))


def _sequence_axes(mesh) -> tuple[str, ...]:
  """The context axes that split a sequence: in the mesh, of size > 1."""
  return tuple(a for a in _axes.context_axes(mesh) if mesh.shape[a] > 1)


def constrain_batch(tree, *, axes=None):
  """Pins the leading (batch) dim of activations to the data axes of the ambient mesh, and
  the second (the sequence) to its context axes.

  Call it on the residual stream inside a model (e.g. at each block's input). Without it,
  GSPMD may carry an FSDP param's sharding (say, d_model over "fsdp") into the activations
  instead of the batch's, and then every device computes attention for the whole batch: the
  step is correct but does up to N x the attention FLOPs and far more communication (XLA logs
  "Involuntary full rematerialization"). On a mesh with a context axis (of size > 1) the
  sequence dim of arrays of rank >= 2 is split over it too (context parallelism: every
  activation [batch, seq, ...] holds a shard of the sequence). Other dimensions stay
  unconstrained, so tensor parallel layouts are still free. MaxText's activation logical
  constraints ("activation_batch", "activation_length") serve the same end.

  Args:
    tree: arrays (or a pytree of them) of shape [batch, ...] ([batch, seq, ...] under a
      context axis).
    axes: mesh axes for the batch dim; default the mesh's data-like axes.

  Returns:
    The same values, constrained. Outside a mesh (`with_mesh`/`jax.set_mesh`), or for axes that
    are manual (inside `shard_map`), it is the identity. When every mesh axis is Explicit
    (shardings are part of the array types) it is `jax.sharding.reshard` to the data axes on
    the batch dim (and the context axes on the sequence dim), the other dims keeping their
    axes except those.

  Raises:
    ShardingError: `axes` not axis names.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> @fs.with_mesh(fs.make_mesh({"fsdp": 8}))
    ... @jax.jit
    ... def block(x, w):
    ...   return fs.constrain_batch(jnp.tanh(x @ w))
    >>> block(jnp.ones((16, 32)), jnp.ones((32, 32))).sharding.spec
    P('fsdp',)
    >>> x = jnp.ones((16, 32))
    >>> fs.constrain_batch(x) is x  # outside a mesh
    True
  """
  axes = None if axes is None else _as_axes(axes, "axes")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tree
  manual = set(getattr(mesh, "manual_axes", ()))
  axes = tuple(a for a in (_axes.data_axes(mesh) if axes is None else axes) if a not in manual)
  context = tuple(a for a in _sequence_axes(mesh) if a not in manual and a not in axes)
  if not axes and not context:
    return tree
  explicit = not mesh.auto_axes  # every axis Explicit: shardings are part of the types

  def pin(x):
    if jnp.ndim(x) == 0:
      return x
    lead = [axes] + ([context] if context and jnp.ndim(x) >= 2 else [])
    pinned = {a for group in lead for a in group}
    if explicit:  # keep the other dims' axes, minus the pinned ones
      spec = PartitionSpec(*tuple(jax.typeof(x).sharding.spec)[len(lead):])
      rest = list(_tree.filter_spec(spec, lambda a: a not in pinned))
      rest += [None] * (jnp.ndim(x) - len(lead) - len(rest))
      return jax.sharding.reshard(x, PartitionSpec(
          *(_tree.spec_entry(g) for g in lead), *rest))
    spec = PartitionSpec(*(g or None for g in lead),
                         *([PartitionSpec.UNCONSTRAINED] * (jnp.ndim(x) - len(lead))))
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree_util.tree_map(pin, tree)


def check_batch(batch, sharding) -> None:
  """Checks that every leaf of `batch` fits its sharding before anything is traced.

  Args:
    batch: pytree of arrays (or ShapeDtypeStructs); the leading dim is the batch.
    sharding: one NamedSharding for all leaves or a pytree of them.

  Raises:
    ShardingError: "batch not divisible by the data axes", naming the leaf path, its size
      and the mesh axes' product; a scalar leaf under a sharded spec.
  """
  for (path, leaf), s in zip(_tree.leaves_with_paths(batch),
                             _tree.leaf_shardings(batch, sharding, "batch")):
    shape, _ = _shape_dtype(path, leaf)
    if not isinstance(s, NamedSharding):
      continue
    if len(s.spec) > len(shape):
      raise ShardingError(
          f"batch leaf '{path}' has shape {shape} but its sharding {s.spec} needs rank >= "
          f"{len(s.spec)}; fix: give every batch leaf a leading batch dimension.")
    _check_divisible(path, shape, s.spec, dict(s.mesh.shape), batch=True)


def check_shardings(tree, shardings_tree, *, what: str = "state") -> None:
  """Checks that `tree` matches `shardings_tree` in structure, rank and divisibility.

  Raises:
    ShardingError: naming the first leaf path that doesn't fit.
  """
  for (path, leaf), s in zip(_tree.leaves_with_paths(tree),
                             _tree.leaf_shardings(tree, shardings_tree, what)):
    shape, _ = _shape_dtype(path, leaf)
    if not isinstance(s, NamedSharding):
      continue
    try:
      check_spec(path, s.spec, shape, dict(s.mesh.shape))
    except ShardingError as e:
      raise ShardingError(f"{what} {e}") from None
