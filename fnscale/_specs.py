"""Spec checks: a leaf's shape and dtype, and a PartitionSpec checked against a leaf and a mesh.

What every sharding path checks the same way: `check_spec` (an explicit spec: rank, axes of
the mesh, one axis per dimension, divisibility) and `check_shardings` (a whole tree against
its shardings), each naming the leaf's path in its error.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from fnscale import _tree
from fnscale._errors import ShardingError


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
