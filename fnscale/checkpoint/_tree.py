"""Pytrees as fnscale.checkpoint stores them: leaves by name, targets, and the checks of what a
user passes to save and restore. Names are orbax's spelling (`params.w`, `opt_state.0.mu.w`).

orbax writes nested dicts of arrays; custom pytree nodes (optax NamedTuples, jmp loss scales,
Flax/Equinox modules) may not survive its internal tree maps, so a tree is saved by leaf name
and rebuilt from the target's own structure on restore.
"""
import json
from collections.abc import Mapping

import jax
import numpy as np

from fnscale._errors import CheckpointError

MAX_LISTED = 6


def check_step(step, *, allow_none: bool = False) -> int | None:
  """A checkpoint step: a non-negative int (None too where `allow_none`)."""
  if step is None and allow_none:
    return None
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise CheckpointError(f"step must be a non-negative int{' or None' if allow_none else ''}, "
                          f"got {step!r}.")
  return int(step)


def check_count(value, name: str) -> int | None:
  """`keep`-like options: a positive int or None."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise CheckpointError(f"{name} must be a positive int or None (keep all), got {value!r}.")
  return value


def key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def keys(path) -> tuple[str, ...]:
  """A leaf's path as names; a state that is a single array is stored as `<root>`."""
  return tuple(key_name(k) for k in path) or ("<root>",)


def leaf_name(path) -> str:
  """`params.w`, `opt_state.0.mu.w`: the same spelling orbax uses for its own entries."""
  return ".".join(key_name(k) for k in path) or "<root>"


def nested(pairs, what: str) -> dict:
  """Nested dicts keyed by path names from (path, leaf) pairs (see the module docstring)."""
  root = {}
  for path, leaf in pairs:
    names = keys(path)
    node = root
    for key in names[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise CheckpointError(f"{what} leaf {leaf_name(path)} clashes with another leaf named "
                              f"{key}; give the pytree nodes distinct keys.")
    if names[-1] in node:
      raise CheckpointError(f"{what} leaves share the name {leaf_name(path)}; give the pytree "
                            "nodes distinct keys.")
    node[names[-1]] = leaf
  return root


def pick(tree: dict, path):
  for key in keys(path):
    tree = tree[key]
  return tree


def check_extra(extra) -> dict:
  if extra is None:
    return {}
  if not isinstance(extra, Mapping):
    raise CheckpointError(
        f"extra must be a dict of JSON values (e.g. {{'data_position': 1234}}), got "
        f"{type(extra).__name__}.")
  for key, value in extra.items():
    if not isinstance(key, str):
      raise CheckpointError(f"extra key {key!r} is {type(key).__name__}; JSON keys must be str.")
    try:
      json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
      raise CheckpointError(
          f"extra[{key!r}] = {value!r} ({type(value).__name__}) is not JSON-serialisable ({e}); "
          "store plain numbers, strings, lists and dicts (convert arrays with .tolist() or "
          "int()).") from e
  return dict(extra)


def check_state(state):
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  if not leaves:
    raise CheckpointError("state has no array leaves; pass the pytree of arrays to save.")
  for path, leaf in leaves:
    name = leaf_name(path)
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise CheckpointError(
          f"state leaf {name} is an abstract jax.ShapeDtypeStruct; save needs concrete values "
          "(abstract structs are for restore's target).")
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise CheckpointError(
          f"state leaf {name} has been deleted (donated to a jitted step?); save the state a "
          "step returned before passing it to the next step.")
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
      dtype = getattr(leaf, "dtype", None)
      if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise CheckpointError(
            f"state leaf {name} is a typed PRNG key array ({dtype}); save "
            "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data.")
      continue
    raise CheckpointError(
        f"state leaf {name} is a {type(leaf).__name__}; checkpoints hold arrays and numbers "
        "only. Put other values into `extra` (JSON) or mark them static in your pytree.")


def host_local_to_numpy(state):
  """In a multi-process job, arrays held by one process only become host values.

  orbax refuses to save a process-local jax.Array (e.g. `jnp.int32(step)` made outside jit)
  when there are several processes; as a numpy value it is written once, by process 0, like
  any other host value, so every process must hold the same value.
  """
  def convert(leaf):
    if (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
        and len(leaf.sharding.device_set) < jax.device_count()):
      return np.asarray(leaf)
    return leaf
  return jax.tree.map(convert, state)


def abstract_target(target):
  """ShapeDtypeStructs with shardings for every target leaf, or a CheckpointError naming it."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  if not leaves:
    raise CheckpointError("target has no leaves; pass the pytree of jax.ShapeDtypeStruct "
                          "(with sharding=) or jax.Array that the checkpoint should fill.")
  out = []
  for path, leaf in leaves:
    name = leaf_name(path)
    if isinstance(leaf, jax.Array):
      leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      raise CheckpointError(
          f"target leaf {name} is a {type(leaf).__name__}; expected jax.ShapeDtypeStruct("
          "shape, dtype, sharding=...) or a jax.Array whose sharding is used. Build the target "
          "with jax.eval_shape(init) plus fnscale.shardings(...).")
    if leaf.sharding is None:
      raise CheckpointError(
          f"target leaf {name} ({leaf.shape} {leaf.dtype}) has no sharding; give every "
          "ShapeDtypeStruct a sharding= (NamedSharding(mesh, PartitionSpec()) replicates it).")
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise CheckpointError(
          f"target leaf {name} is a typed PRNG key ({leaf.dtype}); checkpoints hold "
          "jax.random.key_data(key) instead.")
    out.append((path, leaf))
  return out, treedef


def check_fit(step: int, step_dir, saved, abstract):
  """Raises a CheckpointError listing leaves whose presence, shape or dtype differ."""
  problems = []
  wanted = {}
  for path, leaf in abstract:
    key = keys(path)
    wanted[key] = leaf
    if key not in saved:
      problems.append(f"{leaf_name(path)}: in the target ({leaf.shape} {leaf.dtype}) but not "
                      "in the checkpoint")
      continue
    m = saved[key]
    shape = tuple(getattr(m, "shape", ()) or ())
    dtype = getattr(m, "dtype", None)
    if shape != tuple(leaf.shape) or (dtype is not None and np.dtype(dtype) != leaf.dtype):
      problems.append(f"{leaf_name(path)}: saved {shape} {dtype}, target expects "
                      f"{tuple(leaf.shape)} {leaf.dtype}")
  for key, m in saved.items():
    if key not in wanted:
      problems.append(f"{'.'.join(key)}: in the checkpoint ({tuple(getattr(m, 'shape', ()))} "
                      f"{getattr(m, 'dtype', None)}) but not in the target")
  if problems:
    more = len(problems) - MAX_LISTED
    listed = "; ".join(problems[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    raise CheckpointError(
        f"checkpoint step {step} at {step_dir} doesn't fit the target: {listed}. Build the "
        "target from the same model and optimizer config as the saved run (e.g. "
        "jax.eval_shape of its init), or restore a checkpoint of this model.")
