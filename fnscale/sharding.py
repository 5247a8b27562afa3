"""Shardings: logical axis rules, automatic FSDP, optimizer state, batches and a report.

A parameter's dimensions carry *logical* names ("embed", "mlp", "heads", "vocab", ...). An
ordered rule set maps each logical name to one mesh axis, several, or none; `logical_to_spec`
turns the names of one array into a `PartitionSpec` for a given mesh. Leaves without logical
names get an automatic FSDP policy (shard the largest dimension divisible by the fsdp axis),
as in ZeRO-3 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models") and PyTorch FSDP; the logical-rule scheme follows GSPMD (Xu et al., 2021)
as used by T5X/MaxText.

Leaf paths are written '/'-joined from the pytree keys: `{"blocks": [{"attn": {"wq": w}}]}`
gives `blocks/0/attn/wq`; attribute keys give their name. Path patterns in `logical_axes`
are matched with `re.search` against that string.
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
import optax

from fnscale.errors import ShardingError

# Leaves smaller than this many bytes stay replicated under auto-FSDP: gathering a tiny
# bias or norm scale costs a collective's latency and saves almost no memory.
DEFAULT_MIN_SHARD_BYTES = 1 << 14

_DATA_AXIS_NAMES = ("replica", "data", "fsdp")  # "replica": data parallel across slices

# Why a leaf got its sharding (the `reason` field of `LeafPlan`).
RULES = "rules"  # from the user's logical axes and rules
EXPLICIT = "explicit"  # the user gave a PartitionSpec
AUTO_FSDP = "auto-fsdp"  # no logical axes; largest divisible dim sharded over fsdp
SMALL = "replicated:small"  # no logical axes; under min_shard_bytes
INDIVISIBLE = "replicated:indivisible"  # no logical axes; no dim divisible by fsdp size
NO_FSDP = "replicated:no-fsdp-axis"  # no logical axes; the mesh has no fsdp axis > 1
SCALAR = "replicated:scalar"  # rank 0


class LeafPlan(NamedTuple):
  """How one leaf is sharded.

  Fields: `path` ('/'-joined keys), `shape`, `dtype`, `logical_axes` (tuple of names, a
  PartitionSpec, or None), `spec` (PartitionSpec), `sharding` (NamedSharding),
  `global_bytes` and `device_bytes` (bytes of the whole array and of one device's shard),
  `reason` (one of RULES, EXPLICIT, AUTO_FSDP, SMALL, INDIVISIBLE, NO_FSDP, SCALAR) and
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


class ShardPlan(NamedTuple):
  """The shardings of a pytree and how each was chosen.

  `shardings` is a pytree of NamedSharding with the tree's structure; `leaves` the
  `LeafPlan`s in flattening order; `mesh` the mesh.
  """
  shardings: Any
  leaves: tuple[LeafPlan, ...]
  mesh: Any


# ----------------------------------------------------------------------------- helpers


def path_str(path) -> str:
  """A pytree key path as 'a/0/b' (dict keys, sequence indices and attribute names)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def _where(path: str) -> str:
  return f"leaf '{path}'" if path else "array"


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)


def _entry_axes(entry) -> tuple[str, ...]:
  """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _spec_entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _shape_dtype(path: str, leaf) -> tuple[tuple[int, ...], np.dtype]:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)
  if isinstance(leaf, (bool, int, float, complex, np.generic)):
    return (), np.result_type(leaf)
  raise ShardingError(
      f"{_where(path)} is a {type(leaf).__name__}, expected an array or "
      "jax.ShapeDtypeStruct; fix: pass arrays (or jax.eval_shape(...) output) as leaves.")


def _nbytes(shape, dtype) -> int:
  return int(math.prod(shape)) * np.dtype(dtype).itemsize


def _normalize_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """Rules as ((logical_name, (mesh_axis, ...)), ...); () means 'replicate this dim'."""
  if rules is None:
    return ()
  if isinstance(rules, Mapping):
    rules = tuple(rules.items())
  out = []
  for i, rule in enumerate(rules):
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2
        or not isinstance(rule[0], str)):
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
    if len(set(axes)) != len(axes):
      raise ShardingError(
          f"rule {i} ({name!r}) names mesh axis {_dup(axes)!r} twice in {axes}; a mesh axis "
          "can split one dimension only once; fix: list each axis once.")
    out.append((name, axes))
  return tuple(out)


def _dup(axes):
  seen = set()
  for a in axes:
    if a in seen:
      return a
    seen.add(a)
  return None


def _check_divisible(path: str, shape, spec: PartitionSpec, sizes: dict[str, int], *,
                     batch: bool = False) -> None:
  for d, entry in enumerate(spec):
    axes = _entry_axes(entry)
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


def _check_explicit(path: str, spec: PartitionSpec, shape, sizes: dict[str, int]) -> None:
  if shape is not None and len(spec) > len(shape):
    raise ShardingError(
        f"{_where(path)}: PartitionSpec {spec} has {len(spec)} entries but the array has rank "
        f"{len(shape)} (shape {tuple(shape)}); fix: give at most one entry per dimension.")
  used: dict[str, int] = {}
  for d, entry in enumerate(spec):
    for a in _entry_axes(entry):
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


# ----------------------------------------------------------------------------- public API


def data_axes(mesh) -> tuple[str, ...]:
  """The mesh's data-like axes in mesh order: "replica" (data parallel across slices), "data"
  and "fsdp". A batch's leading dim splits over them; axes of size 1 are kept (harmless)."""
  return tuple(a for a in mesh.axis_names if a in _DATA_AXIS_NAMES)


def logical_to_spec(logical_axes, rules, mesh, *, shape=None, path: str = "",
                    _notes: list | None = None) -> PartitionSpec:
  """Resolves one array's logical axis names to a PartitionSpec on `mesh`.

  Args:
    logical_axes: a tuple with one logical name (str) or None per dimension, or a
      `PartitionSpec` (taken as explicit mesh axes and only validated).
    rules: ordered (logical_name, mesh_axis | tuple of mesh axes | None) pairs, or a mapping.
      For each dimension the first rule for its name whose mesh axes are all in the mesh and
      none already bound to another dimension of this array wins; a rule naming an axis
      absent from the mesh is skipped (so size-1 or smaller meshes work unchanged); an axis
      of size 1 counts as present (the rule wins and shards nothing: leave the axis out of
      the mesh to let a later rule apply); a rule mapping to None replicates the dimension.
      A name without a usable rule is replicated.
    mesh: a `jax.sharding.Mesh` (or AbstractMesh).
    shape: optional global shape; when given, the rank must match and each sharded
      dimension must be divisible by the product of its mesh axes' sizes.
    path: the leaf's path, used in error messages.

  Returns:
    A PartitionSpec with one entry per dimension.

  Raises:
    ShardingError: malformed rules; rank mismatch; an explicit spec longer than the rank,
      naming axes not in the mesh, or binding one mesh axis to two dimensions; a dimension
      not divisible by its mesh axes.
  """
  sizes = _mesh_sizes(mesh)
  if isinstance(logical_axes, PartitionSpec):
    _check_explicit(path, logical_axes, shape, sizes)
    return logical_axes
  if isinstance(logical_axes, str) or not isinstance(logical_axes, (tuple, list)) or not all(
      n is None or isinstance(n, str) for n in logical_axes):
    raise ShardingError(
        f"{_where(path)}: logical axes {logical_axes!r} must be a tuple of names (str or "
        "None), one per dimension, or a PartitionSpec; fix: e.g. ('embed', 'mlp').")
  if shape is not None and len(logical_axes) != len(shape):
    raise ShardingError(
        f"{_where(path)}: logical axes {tuple(logical_axes)} have {len(logical_axes)} names but "
        f"the array has rank {len(shape)} (shape {tuple(shape)}); fix: give one name (or None) "
        "per dimension.")
  norm = _normalize_rules(rules)
  used: dict[str, int] = {}
  entries = []
  for d, name in enumerate(logical_axes):
    chosen: tuple[str, ...] = ()
    if name is not None:
      skipped = []
      for rule_name, axes in norm:
        if rule_name != name:
          continue
        if any(a not in sizes for a in axes):
          continue  # absent from this mesh: try the next rule
        taken = [a for a in axes if a in used]
        if taken:
          skipped.append((axes, taken[0]))
          continue
        chosen = axes
        break
      else:
        if skipped and _notes is not None:
          axes, a = skipped[0]
          _notes.append(f"dim {d} ({name}) replicated: {a} already shards dim {used[a]}")
    for a in chosen:
      used[a] = d
    entries.append(_spec_entry(chosen))
  spec = PartitionSpec(*entries)
  if shape is not None:
    _check_divisible(path, shape, spec, sizes)
  return spec


def _is_axes_leaf(x) -> bool:
  return x is None or isinstance(x, PartitionSpec) or (
      isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))


def _is_pattern_list(logical_axes) -> bool:
  return isinstance(logical_axes, (list, tuple)) and len(logical_axes) > 0 and all(
      isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str)
      and isinstance(e[1], (tuple, PartitionSpec)) and not isinstance(e[1], str)
      and _is_axes_leaf(tuple(e[1]) if isinstance(e[1], list) else e[1])
      for e in logical_axes)


def _leaf_logical_axes(tree, paths: list[str], logical_axes) -> list:
  """Per-leaf logical axes (tuple, PartitionSpec or None) in flattening order."""
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
    out = []
    for p in paths:
      out.append(next((axes for rx, axes in compiled if rx.search(p)), None))
    return out
  treedef = jax.tree_util.tree_structure(tree)
  try:
    return list(treedef.flatten_up_to(logical_axes))
  except (ValueError, TypeError) as e:
    raise ShardingError(
        "logical_axes must be a pytree with the params' structure (a tuple of names or None "
        "per leaf) or a sequence of (path_regex, names) pairs; the tree didn't match: "
        f"{e}; params leaf paths: {paths[:8]}{' ...' if n > 8 else ''}.") from None


def _fsdp_axes(fsdp_axis) -> tuple[str, ...]:
  if fsdp_axis is None:
    return ()
  if isinstance(fsdp_axis, str):
    return (fsdp_axis,)
  return tuple(fsdp_axis)


def _auto_spec(shape, dtype, sizes, fsdp_axes, min_shard_bytes) -> tuple[PartitionSpec, str]:
  if not shape:
    return PartitionSpec(), SCALAR
  if _nbytes(shape, dtype) < min_shard_bytes:
    return PartitionSpec(), SMALL
  present = tuple(a for a in fsdp_axes if a in sizes)
  n = math.prod(sizes[a] for a in present) if present else 1
  if n <= 1:
    return PartitionSpec(), NO_FSDP
  # The largest divisible dimension; ties go to the earlier one.
  best = None
  for d, size in enumerate(shape):
    if size % n == 0 and (best is None or size > shape[best]):
      best = d
  if best is None:
    return PartitionSpec(), INDIVISIBLE
  entries = [None] * len(shape)
  entries[best] = _spec_entry(present)
  return PartitionSpec(*entries), AUTO_FSDP


def _leaf_plan(path, leaf, axes, mesh, rules, fsdp_axes, min_shard_bytes) -> LeafPlan:
  sizes = _mesh_sizes(mesh)
  shape, dtype = _shape_dtype(path, leaf)
  note = ""
  if axes is None:
    spec, reason = _auto_spec(shape, dtype, sizes, fsdp_axes, min_shard_bytes)
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
  shard_shape = sharding.shard_shape(shape)
  return LeafPlan(path, shape, dtype, axes, spec, sharding, _nbytes(shape, dtype),
                  _nbytes(shard_shape, dtype), reason, note)


def shard_plan(tree, mesh, rules=(), *, logical_axes=None, fsdp_axis="fsdp",
               min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
               max_replicated_bytes: int | None = None) -> ShardPlan:
  """Like `shardings`, but also returns how each leaf's sharding was chosen (a `ShardPlan`).

  See `shardings` for the arguments and errors.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [path_str(p) for p, _ in pairs]
  leaf_axes = _leaf_logical_axes(tree, paths, logical_axes)
  fsdp_axes = _fsdp_axes(fsdp_axis)
  plans = tuple(
      _leaf_plan(p, leaf, axes, mesh, rules, fsdp_axes, min_shard_bytes)
      for p, (_, leaf), axes in zip(paths, pairs, leaf_axes))
  bad = [lp for lp in plans if lp.reason == INDIVISIBLE]
  if bad:
    total = sum(lp.global_bytes for lp in bad)
    listing = ", ".join(f"{lp.path} {lp.shape} ({lp.global_bytes} B)" for lp in bad)
    n = math.prod(_mesh_sizes(mesh)[a] for a in fsdp_axes if a in _mesh_sizes(mesh))
    msg = (f"{len(bad)} leaves ({total} bytes) have no dimension divisible by the fsdp size "
           f"{n} and stay replicated on every device: {listing}")
    if max_replicated_bytes is not None and total > max_replicated_bytes:
      raise ShardingError(
          f"{msg}; that exceeds max_replicated_bytes={max_replicated_bytes}; fix: give them "
          "logical axes and rules, pad a dimension to a multiple of the fsdp size, choose "
          "an fsdp size that divides one of their dimensions, or raise max_replicated_bytes.")
    logging.warning("%s", msg)
  return ShardPlan(jax.tree_util.tree_unflatten(treedef, [lp.sharding for lp in plans]),
                   plans, mesh)


def shardings(tree, mesh, rules=(), *, logical_axes=None, fsdp_axis="fsdp",
              min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
              max_replicated_bytes: int | None = None):
  """A pytree of NamedSharding for `tree` (params, or any state) on `mesh`.

  Args:
    tree: pytree whose leaves are arrays or `jax.ShapeDtypeStruct`s (e.g. from
      `jax.eval_shape(init_fn, key)`).
    mesh: the `jax.sharding.Mesh`.
    rules: ordered (logical_name, mesh_axis | tuple | None) pairs; see `logical_to_spec`.
    logical_axes: per-leaf logical axes, either a pytree with `tree`'s structure whose
      leaves are tuples of names (or None for "automatic", or a PartitionSpec for explicit
      mesh axes), or a sequence of (path_regex, names) pairs matched with `re.search`
      against each leaf's '/'-joined path (first match wins; unmatched leaves are automatic).
    fsdp_axis: mesh axis name (or tuple of names) that automatic leaves are sharded over.
    min_shard_bytes: automatic leaves smaller than this stay replicated.
    max_replicated_bytes: automatic leaves of at least `min_shard_bytes` with no dimension
      divisible by the fsdp size are replicated and listed in a warning and the report; if
      their total bytes exceed this limit, raise instead. None: no limit.

  Returns:
    A pytree of NamedSharding with `tree`'s structure.

  Raises:
    ShardingError: a non-array leaf, logical axes not matching the tree or a leaf's rank,
      malformed rules or specs, an indivisible dimension, or too many replicated bytes.
  """
  return shard_plan(tree, mesh, rules, logical_axes=logical_axes, fsdp_axis=fsdp_axis,
                    min_shard_bytes=min_shard_bytes,
                    max_replicated_bytes=max_replicated_bytes).shardings


def _replicated_or_auto(mesh, leaf, fsdp_axis, min_shard_bytes) -> NamedSharding:
  shape, dtype = _shape_dtype("", leaf)
  spec, _ = _auto_spec(shape, dtype, _mesh_sizes(mesh), _fsdp_axes(fsdp_axis), min_shard_bytes)
  return NamedSharding(mesh, spec)


def opt_state_shardings(optimizer, opt_state, param_shardings, mesh, *, fsdp_axis="fsdp",
                        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES):
  """Shardings for an optax optimizer state that follow the params' shardings.

  Every copy of the params tree inside the state (Adam's mu and nu, momentum traces, ...)
  gets `param_shardings`; other leaves (step counts, scalars) are replicated; other
  non-scalar leaves (e.g. factored statistics) get the automatic FSDP policy (`fsdp_axis`,
  `min_shard_bytes`, as in `shardings`). Param copies are found with optax's
  `tree_utils.tree_map_params`; if the optimizer's init can't run on its placeholder, any
  subtree with the params' structure counts as a copy.

  Args:
    optimizer: an `optax.GradientTransformation` (or anything with `.init`).
    opt_state: the optimizer state, concrete or abstract (`jax.eval_shape(opt.init, params)`).
    param_shardings: pytree of NamedSharding with the params' structure.
    mesh: the mesh.

  Returns:
    A pytree of NamedSharding with `opt_state`'s structure.

  Raises:
    ShardingError: the state's param-shaped subtrees don't match `param_shardings`.
  """
  def non_param(leaf):
    return _replicated_or_auto(mesh, leaf, fsdp_axis, min_shard_bytes)

  try:
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, s: s, opt_state, param_shardings,
        transform_non_params=non_param,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  except Exception as e:  # The optimizer's init couldn't run on a placeholder.
    logging.info("tree_map_params failed (%s); matching params by structure", e)
  return _structural_opt_shardings(opt_state, param_shardings, mesh, fsdp_axis,
                                   min_shard_bytes)


def _structural_opt_shardings(opt_state, param_shardings, mesh, fsdp_axis, min_shard_bytes):
  """Fallback: any subtree with the params' structure gets the param shardings."""
  ptree = jax.tree_util.tree_structure(param_shardings)

  def is_params(x):
    try:
      return jax.tree_util.tree_structure(x) == ptree and ptree.num_leaves > 0
    except Exception:  # pylint: disable=broad-except
      return False

  def f(x):
    if is_params(x):
      return param_shardings
    return _replicated_or_auto(mesh, x, fsdp_axis, min_shard_bytes)

  out = jax.tree_util.tree_map(f, opt_state, is_leaf=is_params)
  if jax.tree_util.tree_structure(
      out, is_leaf=lambda s: isinstance(s, NamedSharding)) != jax.tree_util.tree_structure(
          opt_state):
    raise ShardingError(
        "could not match the optimizer state to the params' shardings; fix: pass an "
        "optax optimizer whose state holds copies of the params tree, or give shardings for "
        "the state directly.")
  return out


def batch_sharding(mesh, *, axes=None) -> NamedSharding:
  """Sharding of a batch: the leading dimension split over `axes` (default `data_axes(mesh)`),
  the other dimensions replicated.

  Raises:
    ShardingError: an axis not in the mesh.
  """
  axes = data_axes(mesh) if axes is None else _fsdp_axes(axes)
  for a in axes:
    if a not in mesh.axis_names:
      raise ShardingError(
          f"batch axis {a!r} is not in the mesh (axes {tuple(mesh.axis_names)}); fix: pass "
          "axes that the mesh has, or None for its data-like axes.")
  return NamedSharding(mesh, PartitionSpec(_spec_entry(axes)) if axes else PartitionSpec())


def constrain_batch(tree, *, axes=None):
  """Pins the leading (batch) dim of activations to the data axes of the ambient mesh.

  Call it on the residual stream inside a model (e.g. at each block's input). Without it,
  GSPMD may carry an FSDP param's sharding (say, d_model over "fsdp") into the activations
  instead of the batch's, and then every device computes attention for the whole batch: the
  step is correct but does up to N x the attention FLOPs and far more communication (XLA logs
  "Involuntary full rematerialization"). Other dimensions stay unconstrained, so tensor
  parallel layouts are still free. MaxText's activation logical constraints serve the same end.

  Args:
    tree: arrays (or a pytree of them) of shape [batch, ...].
    axes: mesh axes for the batch dim; default `data_axes(mesh)`.

  Returns:
    The same values, constrained. Outside a mesh (`with_mesh`/`jax.set_mesh`), or for axes that
    are manual (inside `shard_map`), it is the identity.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tree
  manual = set(getattr(mesh, "manual_axes", ()))
  axes = tuple(a for a in (data_axes(mesh) if axes is None else axes) if a not in manual)
  if not axes:
    return tree

  def pin(x):
    if jnp.ndim(x) == 0:
      return x
    spec = PartitionSpec(axes, *([PartitionSpec.UNCONSTRAINED] * (jnp.ndim(x) - 1)))
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree_util.tree_map(pin, tree)


def _broadcast_shardings(tree, sharding, what: str) -> list:
  n = jax.tree_util.tree_structure(tree).num_leaves
  if isinstance(sharding, jax.sharding.Sharding):
    return [sharding] * n
  treedef = jax.tree_util.tree_structure(tree)
  try:
    return list(treedef.flatten_up_to(sharding))
  except (ValueError, TypeError) as e:
    raise ShardingError(
        f"the {what} shardings don't match the {what}'s structure ({e}); fix: pass one "
        "NamedSharding or a pytree of them with the same structure.") from None


def check_batch(batch, sharding) -> None:
  """Checks that every leaf of `batch` fits its sharding before anything is traced.

  Args:
    batch: pytree of arrays (or ShapeDtypeStructs); the leading dim is the batch.
    sharding: one NamedSharding for all leaves or a pytree of them.

  Raises:
    ShardingError: "batch not divisible by the data axes", naming the leaf path, its size
      and the mesh axes' product; a scalar leaf under a sharded spec.
  """
  pairs, _ = jax.tree_util.tree_flatten_with_path(batch)
  for (p, leaf), s in zip(pairs, _broadcast_shardings(batch, sharding, "batch")):
    path = path_str(p)
    shape, _ = _shape_dtype(path, leaf)
    spec = s.spec
    sizes = _mesh_sizes(s.mesh)
    if len(spec) > len(shape):
      raise ShardingError(
          f"batch leaf '{path}' has shape {shape} but its sharding {spec} needs rank >= "
          f"{len(spec)}; fix: give every batch leaf a leading batch dimension.")
    _check_divisible(path, shape, spec, sizes, batch=True)


def check_shardings(tree, shardings_tree, *, what: str = "state") -> None:
  """Checks that `tree` matches `shardings_tree` in structure, rank and divisibility.

  Raises:
    ShardingError: naming the first leaf path that doesn't fit.
  """
  pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
  for (p, leaf), s in zip(pairs, _broadcast_shardings(tree, shardings_tree, what)):
    path = path_str(p)
    shape, _ = _shape_dtype(path, leaf)
    if not isinstance(s, NamedSharding):
      continue
    try:
      _check_explicit(path, s.spec, shape, _mesh_sizes(s.mesh))
    except ShardingError as e:
      raise ShardingError(f"{what} {e}") from None


def _fmt_bytes(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def _fmt_axes(axes) -> str:
  if axes is None:
    return "-"
  if isinstance(axes, PartitionSpec):
    return f"spec{tuple(axes)}"
  return "(" + ", ".join("None" if a is None else a for a in axes) + ")"


def _fmt_spec(spec: PartitionSpec) -> str:
  return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


def sharding_report(tree, shardings_or_plan, *, logical_axes=None) -> str:
  """A readable table: per leaf its path, shape, dtype, logical axes, PartitionSpec,
  global and per-device bytes and how the sharding was chosen; then totals.

  Args:
    tree: the pytree the shardings are for (arrays or ShapeDtypeStructs).
    shardings_or_plan: a `ShardPlan` (from `shard_plan`; gives the reason column) or a pytree
      of NamedSharding (reason inferred: "sharded" or "replicated").
    logical_axes: as in `shardings`, shown in the logical-axes column when the second
      argument is a plain shardings tree.

  Returns:
    Multi-line text. Per-device bytes are one device's shard (jax's `shard_shape`).
  """
  pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = [path_str(p) for p, _ in pairs]
  if isinstance(shardings_or_plan, ShardPlan):
    plans = list(shardings_or_plan.leaves)
    if len(plans) != len(pairs):
      raise ShardingError(
          f"the plan has {len(plans)} leaves but the tree has {len(pairs)}; fix: report on "
          "the tree the plan was made for.")
  else:
    shs = _broadcast_shardings(tree, shardings_or_plan, "tree")
    axes = _leaf_logical_axes(tree, paths, logical_axes)
    plans = []
    for path, (_, leaf), s, ax in zip(paths, pairs, shs, axes):
      shape, dtype = _shape_dtype(path, leaf)
      spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
      gb = _nbytes(shape, dtype)
      db = _nbytes(s.shard_shape(shape), dtype)
      reason = "sharded" if db < gb else "replicated"
      plans.append(LeafPlan(path, shape, dtype, ax, spec, s, gb, db, reason))
  mesh = next((lp.sharding.mesh for lp in plans if isinstance(lp.sharding, NamedSharding)), None)
  header = ("path", "shape", "dtype", "logical axes", "spec", "global", "per device", "how")
  rows = [(lp.path or "<root>", "x".join(map(str, lp.shape)) or "scalar", str(lp.dtype),
           _fmt_axes(lp.logical_axes), _fmt_spec(lp.spec), _fmt_bytes(lp.global_bytes),
           _fmt_bytes(lp.device_bytes), lp.reason + (f" ({lp.note})" if lp.note else ""))
          for lp in plans]
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
  lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  total = sum(lp.global_bytes for lp in plans)
  per_dev = sum(lp.device_bytes for lp in plans)
  repl = [lp for lp in plans if lp.device_bytes == lp.global_bytes and lp.global_bytes]
  indiv = [lp for lp in plans if lp.reason == INDIVISIBLE]
  lines.append("")
  if mesh is not None:
    lines.append("mesh: " + " ".join(f"{a}={n}" for a, n in _mesh_sizes(mesh).items())
                 + f" ({math.prod(_mesh_sizes(mesh).values())} devices)")
  lines.append(f"leaves: {len(plans)}  total: {_fmt_bytes(total)}  per device: "
               f"{_fmt_bytes(per_dev)}  replicated: {len(repl)} leaves "
               f"({_fmt_bytes(sum(lp.global_bytes for lp in repl))})")
  if indiv:
    lines.append(f"large leaves replicated because no dimension divides the fsdp size: "
                 f"{len(indiv)} ({_fmt_bytes(sum(lp.global_bytes for lp in indiv))}): "
                 + ", ".join(lp.path for lp in indiv))
  return "\n".join(lines)
