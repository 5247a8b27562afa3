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

Read this file first; its parts, each with one job:

- `_rules.py`: logical axis rules -> one array's PartitionSpec (`logical_to_spec`), Flax
  metadata meant as mesh axes, and each leaf's logical axes from a tree or path patterns.
- `_specs.py`: a leaf's shape and dtype, and a PartitionSpec checked against a leaf and a
  mesh (`check_spec`, `check_shardings`).
- `_batch_sharding.py`: the batch's sharding (`batch_sharding`), activations pinned to it
  (`constrain_batch`), and `check_batch`.

This file holds a tree's shardings (`shardings`, `sharding_layout`, `layout_of`): rules where
a leaf has logical names, automatic FSDP (`auto_spec`) where it has none, and the guard on
what stays replicated.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from absl import logging
import jax
from jax.sharding import NamedSharding, PartitionSpec

from fnscale import _axes
from fnscale import _flax
from fnscale._axes import data_axes  # noqa: F401  (public here: the batch dim's axes)
from fnscale import _tree
from fnscale._batch_sharding import batch_sharding, check_batch, constrain_batch  # noqa: F401
from fnscale._errors import ShardingError, did_you_mean
from fnscale._mesh import check_mesh
from fnscale._rules import leaf_logical_axes, logical_to_spec, mesh_names_spec, normalize_rules
from fnscale._specs import _as_axes, _shape_dtype, check_shardings, check_spec  # noqa: F401

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
