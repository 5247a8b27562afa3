"""Flax's sharding metadata, read by duck typing (fnscale never imports flax).

Linen keeps a param's partitioning in a box around it: `Partitioned` (`nn.with_partitioning`,
names meant as mesh axes) and its subclass `LogicallyPartitioned`
(`nn.with_logical_partitioning`, logical names). NNX keeps it in a `Variable`'s metadata
(`out_sharding`, `sharding_names` or `sharding`, from `nnx.with_partitioning`), as mesh axes
unless the Variable also carries Flax's logical rules (`sharding_rules`).

Names meant as mesh axes were written for their authors' mesh, so they become `MeshNames`,
resolved against the mesh at hand (`fnscale.logical_to_spec`). Logical names stay a tuple,
mapped by fnscale's rules. Linen boxes are taken off the params (`strip`): under a global mesh
`model.apply` turns every box it meets into a sharding constraint, which fails on a mesh
without the box's axes. NNX Variables stay: `nnx.merge` applies no constraint.

A layer that unboxes its own box (flax's DenseGeneral and MultiHeadDotProductAttention
initialize their kernels flat) still meets Flax's constraint: Flax's apply runs that init
again to check shapes. Where the mesh lacks an axis the box names, `with_box_axes` traces
again on the mesh with that axis of size 1 (it splits nothing; the state stays on the mesh).

While a step is traced, `rules_scope` hands Flax the rules in use (fnscale's, else Flax's own),
each rule keeping only the mesh axes a sharding constraint may name there (present and Auto;
not the manual ones inside `shard_map`), so a model's `nn.with_logical_constraint` on
activations constrains them as the params are laid out.
"""
from __future__ import annotations

import contextlib
import os
import sys

from absl import logging
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fnscale import _compat
from fnscale import _tree
from fnscale._errors import FnscaleError, ShardingError


class MeshNames(tuple):
  """A param's names from Flax metadata meant as mesh axes, one entry per leading dimension
  (a str, None, or a tuple of mesh axes).

  On a mesh (`fnscale.logical_to_spec`): a name that is an axis of the mesh is that axis; a
  name the mesh lacks is a logical name, mapped by the rules; an entry that is a tuple keeps
  the axes the mesh has. A leaf none of whose names lands on an axis of the mesh gets
  automatic FSDP, as an unannotated leaf. Fewer names than dimensions leave the trailing ones
  unsharded, as in Flax.

  Examples:
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 2, "fsdp": 4})
    >>> fs.logical_to_spec(fs.adapters.MeshNames((None, "data")), (), mesh, shape=(8, 8, 2))
    P(None, 'data', None)
    >>> fs.logical_to_spec(fs.adapters.MeshNames(("embed", "tensor")), [("embed", "fsdp")], mesh)
    P('fsdp', None)
  """

  def __repr__(self):
    return f"MeshNames{tuple.__repr__(self)}"


def is_linen_box(x) -> bool:
  # flax.core.meta.Partitioned and its subclass flax.linen.LogicallyPartitioned.
  return hasattr(x, "names") and hasattr(x, "unbox") and hasattr(x, "value")


def is_nnx_variable(x) -> bool:
  return hasattr(x, "get_metadata") and hasattr(x, "get_value")


def is_box(x) -> bool:
  return is_linen_box(x) or is_nnx_variable(x)


def check_only_params(tree, error: type[FnscaleError]) -> None:
  """Raises `error` naming the first NNX Variable of `tree` (params) that isn't an
  `nnx.Param` (a BatchNorm's BatchStat, an Rngs' key or count, a Cache): a whole module or
  `nnx.split(model)`'s state holds them, and the optimizer would train them (weight decay
  shrinking a running variance); a BatchStat belongs in the state's `model_state`."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
    kinds = [c.__name__ for c in type(x).__mro__]
    if is_nnx_variable(x) and "Param" not in kinds:
      fix = ("pass the Params only and the BatchStats as the model state: `graphdef, params, "
             "stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)`, "
             "init_state(params, ..., model_state=stats), the loss merging them and "
             "returning (loss, nnx.state(model, nnx.BatchStat))" if "BatchStat" in kinds else
             "pass the Params only, `graphdef, params, rest = nnx.split(model, nnx.Param, "
             "...)`, with `nnx.merge(graphdef, params, rest)` in the loss")
      raise error(
          f"params leaf '{_tree.path_str(path)}' is an NNX {kinds[0]}, not an nnx.Param: "
          f"the optimizer would train it as a param; fix: {fix} "
          "(recipes/examples/README.md, Flax NNX).")


def _entries(names, path: str, *, mesh_axes: bool) -> tuple:
  if isinstance(names, PartitionSpec) or hasattr(names, "spec"):  # a spec or NamedSharding
    names = getattr(names, "spec", names)
  names = tuple(names)
  ok = lambda n: n is None or isinstance(n, str) or (
      mesh_axes and isinstance(n, tuple) and all(isinstance(a, str) for a in n))
  if not all(ok(n) for n in names):
    raise ShardingError(
        f"leaf '{path}': partitioning annotation {names!r} must name each dimension with a "
        "str or None"
        + (" (or, as mesh axes, a tuple of them)" if mesh_axes else "")
        + "; fix: annotate e.g. ('embed', 'mlp'), and write a dimension sharded over several "
        "axes as one logical name with a rule mapping it to a tuple of mesh axes.")
  return MeshNames(names) if mesh_axes else names


def names_of(x, path: str):
  """A box's or Variable's names: a tuple of logical names, `MeshNames`, or None (none).

  Raises:
    ShardingError: names that are not str or None (or tuples of str, as mesh axes).
  """
  if is_linen_box(x):
    # LogicallyPartitioned (it has `rules`) holds logical names; Partitioned mesh axes.
    return _entries(x.names, path, mesh_axes=not hasattr(x, "rules"))
  if is_nnx_variable(x):
    meta = x.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
      return None
    return _entries(names, path, mesh_axes=not meta.get("sharding_rules"))
  return None


def read(tree):
  """`(strip(tree), names)`: `names` one entry per leaf of the stripped tree in flattening
  order (`names_of` its box or Variable, else None), or None when `tree` holds no Flax box
  or Variable (nothing to read: the caller's tree as it is).

  Raises:
    ShardingError: from `names_of`, naming the leaf.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
  if not any(is_box(x) for _, x in pairs):
    return tree, None
  names, items = [], []
  for path, x in pairs:
    n = names_of(x, _tree.path_str(path))
    item = x.value if is_linen_box(x) else x
    names += [n] * len(jax.tree_util.tree_leaves(item))
    items.append(item)
  return jax.tree_util.tree_unflatten(treedef, items), names


def strip(tree):
  """`tree` with every Linen box replaced by its value (NNX Variables kept)."""
  return jax.tree_util.tree_map(lambda x: x.value if is_linen_box(x) else x, tree,
                                is_leaf=is_linen_box)


def has_linen_boxes(tree) -> bool:
  return any(is_linen_box(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_linen_box))


class _MeshRules(tuple):
  """Rules as Flax reads them, each keeping only the axes of the mesh in scope when Flax reads
  them that a sharding constraint may name (present and Auto: inside `shard_map` the manual
  axes are left out); a rule left with none is dropped (its name falls to Flax's fallback:
  unsharded)."""

  def __iter__(self):
    mesh = jax.sharding.get_abstract_mesh()
    usable = set() if mesh.empty else set(mesh.auto_axes)
    for name, axes in tuple.__iter__(self):
      if not axes:
        yield name, None
        continue
      kept = tuple(a for a in axes if a in usable)
      if kept:
        yield name, kept[0] if len(kept) == 1 else kept

  def __len__(self):
    return sum(1 for _ in self)

  def __bool__(self):
    return len(self) > 0


def _flax_pairs(rules) -> tuple:
  """Flax's rules, (name, mesh axis | tuple of them | None) pairs, as (name, (axes...))."""
  out = []
  for name, axes in rules:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    if not isinstance(name, str) or not all(isinstance(a, str) for a in axes):
      raise ValueError(name)
    out.append((name, axes))
  return tuple(out)


def rules_scope(rules):
  """Flax's logical axis rules while a step is traced: `rules` (fnscale's, normalized:
  (name, (axes...)) pairs), else Flax's own rules in effect, as `_MeshRules`; a null context
  where flax isn't imported or there are no rules."""
  spmd = sys.modules.get("flax.core.spmd")
  if spmd is None or not hasattr(spmd, "logical_axis_rules"):
    return contextlib.nullcontext()
  if not rules:
    try:
      rules = _flax_pairs(spmd.get_logical_axis_rules() or ())
    except (TypeError, ValueError):  # Flax's own rules in a form fnscale doesn't read
      return contextlib.nullcontext()
  if not rules:
    return contextlib.nullcontext()
  return spmd.logical_axis_rules(_MeshRules(rules))


def _raised_in_flax_unbox(e: BaseException) -> bool:
  tb = e.__traceback__
  while tb is not None:
    code = tb.tb_frame.f_code
    if code.co_name == "unbox" and f"flax{os.sep}core" in code.co_filename:
      return True
    tb = tb.tb_next
  return False


def missing_axis(e: BaseException) -> str | None:
  """The mesh axis named by a sharding constraint Flax made of a Linen box when tracing
  failed because the mesh in scope lacks it (jax: "Resource axis: data of P(None, 'data') is
  not found in mesh"), else None."""
  if not isinstance(e, ValueError) or not _raised_in_flax_unbox(e):
    return None
  found = _compat.MISSING_AXIS.search(str(e))
  return found.group(1) if found else None


def _with_unit_axes(names: tuple):
  """The mesh in scope with a size-1 Auto axis appended for each of `names` (the same devices
  in the same order): a Mesh, or an AbstractMesh where only an abstract one is in scope."""
  mesh = _compat.concrete_mesh()
  if mesh.empty:  # `jax.sharding.use_abstract_mesh`
    mesh = jax.sharding.get_abstract_mesh()
    return jax.sharding.AbstractMesh(
        tuple(mesh.axis_sizes) + (1,) * len(names), tuple(mesh.axis_names) + names,
        axis_types=tuple(mesh.axis_types) + (AxisType.Auto,) * len(names))
  return Mesh(mesh.devices.reshape(mesh.devices.shape + (1,) * len(names)),
              tuple(mesh.axis_names) + names,
              axis_types=tuple(mesh.axis_types) + (AxisType.Auto,) * len(names))


def _in_scope(mesh):
  if mesh is None:
    return contextlib.nullcontext()
  return jax.set_mesh(mesh) if isinstance(mesh, Mesh) else jax.sharding.use_abstract_mesh(mesh)


def on_mesh(x, mesh):
  """`x` (a NamedSharding, or an array carrying one) on `mesh` where `mesh` is its mesh with
  size-1 axes appended (`with_box_axes`'s: nothing moves), else `x` as it is. Under such a
  mesh jax 0.10 refuses to mix a value typed on the mesh without them (`fold_in` of a key)."""
  s = x if isinstance(x, NamedSharding) else getattr(x, "sharding", None)
  if not (isinstance(mesh, Mesh) and isinstance(s, NamedSharding)
          and mesh.axis_names[:len(s.mesh.axis_names)] == s.mesh.axis_names
          and list(mesh.devices.flat) == list(s.mesh.devices.flat)):
    return x
  moved = NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
  return moved if x is s else jax.device_put(x, moved)


_MAX_UNIT_AXES = 8


def with_box_axes(trace, what: str):
  """`trace(None)` under the mesh in scope or, where it fails in a sharding constraint Flax
  made of a Linen box on an axis that mesh lacks, `trace(mesh)` under `mesh`: that mesh with a
  size-1 Auto axis appended for each such axis (at most `_MAX_UNIT_AXES`), said once at INFO;
  `trace` puts its inputs on it (`on_mesh`). A size-1 axis splits nothing: the constraint,
  which Flax only makes to check shapes (DenseGeneral's flat kernel init, run again by apply),
  constrains nothing, and outputs keep the shardings they name. Not on a mesh with Explicit
  axes (the arrays' types name the mesh, which must be the one in scope). Where jax refuses
  the added axes themselves (jax 0.10's `fold_in` of a key closed over on the mesh without
  them), the first failure is raised; any other failure as it is."""
  added, mesh, first = (), None, None
  while True:
    try:
      with _in_scope(mesh):
        out = trace(mesh)
      break
    except FnscaleError:  # fnscale's own word on the model (it may quote the mesh's axes)
      raise
    except Exception as e:  # pylint: disable=broad-except
      name = missing_axis(e)
      if (first is not None and not _raised_in_flax_unbox(e)
          and any(f"'{a}': 1" in str(e) for a in added)):  # jax refused the added axes
        logging.info("%s: tracing again with size-1 mesh axes %s failed (%s)", what, added,
                     str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise first from None
      if (name is None or name in added or len(added) == _MAX_UNIT_AXES
          or jax.sharding.get_abstract_mesh().explicit_axes):
        raise
      first = first or e
      added += (name,)
      mesh = _with_unit_axes(added)
  if added:
    logging.info(
        "%s: traced under the mesh with size-1 axes %s added (they split nothing): the "
        "model's Linen boxes (nn.with_partitioning) name them, and Flax turns a box the "
        "model unboxes itself (DenseGeneral's flat kernel init, run again by apply to check "
        "shapes) into a sharding constraint on its names; the state stays on the mesh given",
        what, added)
  return out


def constraint_failure(e: BaseException, *, init: bool = False) -> str | None:
  """What to say when tracing failed in a sharding constraint Flax made of a Linen box
  (under a mesh, `Partitioned.unbox` is `with_sharding_constraint` on the box's names): in
  the step (`init=False`), a box the model unboxes in its own code (DenseGeneral and
  MultiHeadDotProductAttention initialize their kernels flat and unbox them, and Flax's
  apply runs that init again to check shapes); in `init_state`'s init function under an
  ambient mesh (`init=True`). None for any other failure."""
  if not isinstance(e, ValueError) or not _raised_in_flax_unbox(e):
    return None
  text = str(e)
  head = ("tracing the init function failed in a sharding constraint Flax made of a Linen "
          "box under the ambient mesh" if init else
          "tracing the step failed in a sharding constraint Flax made of a Linen box "
          "(nn.with_partitioning) that the model unboxes in its own code: DenseGeneral and "
          "MultiHeadDotProductAttention initialize their kernels flat and unbox them, Flax's "
          "apply runs that init again to check shapes, and under the step's mesh the box "
          "becomes jax.lax.with_sharding_constraint on its names")
  missing = _compat.MISSING_AXIS.search(text)
  if init:
    fix = ("call init_state outside the mesh context (`with fs.with_mesh(...)`, "
           "`jax.set_mesh`): it lays the params out from the names itself")
  elif missing:
    fix = (f"give the mesh an Auto axis {missing.group(1)!r} of size 1 (it splits nothing): "
           f"jax.sharding.Mesh(mesh.devices[..., None], mesh.axis_names + "
           f"({missing.group(1)!r},), axis_types=mesh.axis_types + "
           "(jax.sharding.AxisType.Auto,))")
  elif "can only refer to Auto axes" in text:
    fix = ("train_step(..., accum_gather='per_microbatch'): the per-shard microbatch loop "
           "makes the data axes manual, and a constraint can't name a manual axis")
  elif "only valid for values of rank" in text:
    fix = ("give the box at most one name per dimension of the flat 2-D kernel the layer "
           "initializes (e.g. (None, 'data')): fnscale and Flax leave the trailing dimensions "
           "of the full kernel unsharded")
  else:
    fix = "box the kernel with nn.with_logical_partitioning and map its names by the rules"
  return (f"{head} (fnscale lays the params out from the names itself, but can't take this "
          f"constraint out): {text.splitlines()[0]}; fix: {fix}"
          + ("" if init else "; or box the kernel with nn.with_logical_partitioning (Flax "
             "then maps its names through the rules, on the axes the mesh has)") + ".")
