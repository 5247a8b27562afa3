"""Sharded checkpoints that restore onto any mesh, device count or process count.

Built on orbax-checkpoint (the `checkpoint` extra: `pip install fnscale[checkpoint]`), whose
`CheckpointManager` writes each step into a temporary directory and commits it with an atomic
rename (or a commit file on object stores), from every process at once. A checkpoint records
values, shapes and dtypes, never the mesh: `restore` lays the values out on whatever shardings
the target asks for, so a state saved from 8 devices in 2 processes restores onto 1 device.

Layout of `directory`::

  <step>/                     one committed checkpoint per step (an integer name)
    commit_success.txt        written last, just before the rename: the commit marker
    _CHECKPOINT_METADATA
    state/                    the pytree (orbax OCDBT + zarr, one entry per leaf)
    extra/metadata            the small JSON dict passed as `extra`
  <step>.orbax-checkpoint-tmp/       a save that never finished: never read; orbax clears it
                                     when the same step is saved again
  <step>.corrupt-<unix time>/        a damaged step moved aside by `save`: kept for inspection

A step directory that lacks its commit marker, its metadata or a readable leaf is refused
with a message naming the step and path; `restore(..., step=None)` then falls back to the
newest earlier step that is good. fnscale never overwrites or deletes a damaged checkpoint;
only the `keep` policy of `save` deletes old ones.

All processes of a multi-process job must call `save` and `restore` with the same arguments
(they hold different shards, and orbax synchronises them); `latest_step` and `steps` only read
the directory and may be called from any process. The directory must be visible to every
process (a shared file system or a bucket such as `gs://...`;
`fnscale.distributed.check_shared_directory` checks it), and `restore(step=None)` restores
process 0's newest complete step everywhere.
"""
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from fnscale import _tree
from fnscale.errors import CheckpointError

_STATE = "state"
_EXTRA = "extra"
_COMMIT = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"
_TREE_METADATA = "_METADATA"
_EXTRA_FILE = "metadata"
_INSTALL = "install it with `pip install fnscale[checkpoint]` (orbax-checkpoint)"
_MAX_LISTED = 6


class _Unreadable(Exception):
  """A committed-looking step whose contents can't be read: refused, never used."""


def _orbax():
  """Imports orbax-checkpoint on first use, so fnscale imports without it."""
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise CheckpointError(
        f"fnscale.checkpoint needs orbax-checkpoint, which can't be imported ({e}); "
        f"{_INSTALL}.") from e
  return ocp


def _path(directory):
  """An etils Path: absolute for local paths (orbax requires it), untouched for URLs."""
  from etils import epath  # pylint: disable=import-outside-toplevel  # comes with orbax
  if directory is None or (isinstance(directory, str) and not directory.strip()):
    raise CheckpointError(
        f"checkpoint directory {directory!r} is empty; pass a path such as 'runs/lm/ckpt' "
        "or 'gs://bucket/run/ckpt'.")
  if not isinstance(directory, (str, os.PathLike)):
    raise CheckpointError(
        f"checkpoint directory is {_tree.got(directory)}, expected a str or os.PathLike "
        "path such as 'runs/lm/ckpt' or 'gs://bucket/run/ckpt'.")
  text = os.fspath(directory)
  if "://" not in text:
    text = os.path.abspath(os.path.expanduser(text))
  return epath.Path(text)


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _keys(path) -> tuple[str, ...]:
  """A leaf's path as names; a state that is a single array is stored as `<root>`."""
  return tuple(_key_name(k) for k in path) or ("<root>",)


def _leaf_name(path) -> str:
  """`params.w`, `opt_state.0.mu.w`: the same spelling orbax uses for its own entries."""
  return ".".join(_key_name(k) for k in path) or "<root>"


def _nested(pairs, what: str) -> dict:
  """Nested dicts keyed by path names from (path, leaf) pairs.

  orbax writes nested dicts of arrays; custom pytree nodes (optax NamedTuples, jmp loss
  scales, Flax/Equinox modules) may not survive its internal tree maps, so the tree is saved
  by path and rebuilt from the target's own structure on restore.
  """
  root = {}
  for path, leaf in pairs:
    keys = _keys(path)
    node = root
    for key in keys[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise CheckpointError(f"{what} leaf {_leaf_name(path)} clashes with another leaf named "
                              f"{key}; give the pytree nodes distinct keys.")
    if keys[-1] in node:
      raise CheckpointError(f"{what} leaves share the name {_leaf_name(path)}; give the pytree "
                            "nodes distinct keys.")
    node[keys[-1]] = leaf
  return root


def _pick(tree: dict, path):
  for key in _keys(path):
    tree = tree[key]
  return tree


def _manager(ocp, path, *, keep: int | None = None, read_only: bool = False,
             local: bool = False):
  """orbax's CheckpointManager over `path`: it lists committed step directories (skipping
  unfinished `*.orbax-checkpoint-tmp*` ones), saves atomically and prunes to `keep`.
  `local`: this process alone (orbax's barriers skipped), for reading the listing."""
  me = jax.process_index()
  alone = {"multiprocessing_options": ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me})} if local else {}
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=False, create=not read_only,
      read_only=read_only, **alone)
  return ocp.CheckpointManager(path, options=options, item_handlers={
      _STATE: ocp.StandardCheckpointHandler(), _EXTRA: ocp.JsonCheckpointHandler()})


def _step_dirs(ocp, path) -> dict[int, Any]:
  """Step -> directory for every step orbax lists (committed or damaged, not unfinished).
  Process-local: listing waits for no other process."""
  manager = _manager(ocp, path, read_only=True, local=True)
  try:
    # orbax's standard step name format: the step number itself.
    return {int(s): path / str(int(s)) for s in manager.all_steps(read=True)}
  finally:
    manager.close()


def _problem(step_dir) -> str | None:
  """Why a step directory can't be a complete checkpoint, or None if it looks complete.

  Only reads file names, so every process reaches the same verdict on a shared file system.
  """
  if not (step_dir / _COMMIT).exists():
    return (f"incomplete: its commit marker {_COMMIT} is missing (the save never finished, "
            "or the directory was damaged or copied partially)")
  for rel in (_STEP_METADATA, f"{_STATE}/{_TREE_METADATA}", f"{_EXTRA}/{_EXTRA_FILE}"):
    if not (step_dir / rel).exists():
      return f"corrupt: {rel} is missing"
  return None


def _check_directory(path, *, must_exist: bool):
  if not path.exists():
    if must_exist:
      raise CheckpointError(
          f"checkpoint directory {path} does not exist. Check the path (and that every "
          "process sees it), or start without restoring: fnscale.checkpoint.latest_step "
          "returns None for a directory with no checkpoint.")
    return False
  if not path.is_dir():
    raise CheckpointError(
        f"checkpoint path {path} is a file, not a directory; pass the directory that "
        "holds the step subdirectories.")
  return True


def steps(directory) -> tuple[int, ...]:
  """The steps of the complete checkpoints in `directory`, oldest first.

  Args:
    directory: a local path or an object-store URL (`gs://...`).

  Returns:
    Sorted step numbers whose directories hold a commit marker and metadata; empty when the
    directory doesn't exist or holds none. Unfinished saves and damaged steps are left out.

  Raises:
    CheckpointError: orbax-checkpoint is missing, or `directory` is a file.
  """
  ocp = _orbax()
  path = _path(directory)
  if not _check_directory(path, must_exist=False):
    return ()
  return tuple(s for s, d in sorted(_step_dirs(ocp, path).items()) if _problem(d) is None)


def latest_step(directory) -> int | None:
  """The newest complete checkpoint's step in `directory`, or None if there is none.

  None (not an error) for a missing or empty directory, so a training loop can write
  `start = latest_step(d)` and initialise fresh when it is None. A step listed here can still
  fail the deeper checks of `restore` (an unreadable leaf); `restore(step=None)` then falls
  back to an earlier step.

  Raises:
    CheckpointError: orbax-checkpoint is missing, or `directory` is a file.
  """
  found = steps(directory)
  return found[-1] if found else None


def _check_extra(extra) -> dict:
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


def _check_state(state):
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  if not leaves:
    raise CheckpointError("state has no array leaves; pass the pytree of arrays to save.")
  for path, leaf in leaves:
    name = _leaf_name(path)
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise CheckpointError(
          f"state leaf {name} is an abstract jax.ShapeDtypeStruct; save needs concrete values "
          "(abstract structs are for restore's target).")
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


def _host_local_to_numpy(state):
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


def _move_aside(step_dir, reason: str):
  """Renames a damaged step directory so a new save can use its name; nothing is deleted."""
  stamp = int(time.time())
  target = step_dir.parent / f"{step_dir.name}.corrupt-{stamp}"
  while target.exists():  # never replace an earlier one moved aside in the same second
    stamp += 1
    target = step_dir.parent / f"{step_dir.name}.corrupt-{stamp}"
  logging.warning("checkpoint step %s at %s is %s; moving it to %s and saving a new one.",
                  step_dir.name, step_dir, reason, target)
  step_dir.rename(target)


def _verify_data(ocp, step: int, step_dir, state) -> None:
  """Reads an existing step's arrays back (onto `state`'s shardings), so a step whose data
  files are damaged but whose metadata looks complete is moved aside, not kept forever.

  Only reached when a save meets an existing step: normally after `restore` refused it."""
  try:
    abstract, treedef = _abstract_target(state)
    _restore_step(ocp, step, step_dir, abstract, treedef)  # reads through orbax's manager
  except CheckpointError:
    pass  # a different tree or host-only leaves: the metadata check above decides


def save(directory, step: int, state, *, extra: Mapping[str, Any] | None = None,
         keep: int | None = 3) -> str:
  """Saves a sharded pytree and a small JSON dict as checkpoint `step`, atomically.

  Writes `directory/<step>` through orbax's `CheckpointManager` (synchronously: when `save`
  returns, the checkpoint is committed). Each process writes the shards it holds; process 0
  writes the metadata and `extra` and commits. An interrupted save leaves only a
  `<step>.orbax-checkpoint-tmp` directory that nothing reads.

  Args:
    directory: local path or object-store URL (`gs://...`) seen by every process; created
      if missing.
    step: non-negative int naming the checkpoint (usually the train step).
    state: pytree of `jax.Array`s on any mesh (also numpy arrays / Python numbers), e.g. a
      `fnscale.TrainState` with optax NamedTuple states. Any dtype except typed PRNG keys.
    extra: JSON-serialisable dict stored beside the state (data position, config, ...);
      process 0's copy is the one written.
    keep: how many of the newest step directories to keep; older ones are deleted after the
      save commits. None keeps all.

  Returns:
    The committed step directory, as a string.

  Raises:
    CheckpointError: bad `step`/`keep`/`extra`/leaf (named), a complete checkpoint already
      exists for `step` (never overwritten), orbax-checkpoint is missing, or the write failed.
      A damaged directory already at `step` is moved aside to `<step>.corrupt-<time>` first.
  """
  ocp = _orbax()
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
  step = int(step)
  if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
    raise CheckpointError(f"keep must be a positive int or None (keep all), got {keep!r}.")
  extra = _check_extra(extra)
  _check_state(state)
  if jax.process_count() > 1:
    state = _host_local_to_numpy(state)
  tree = _nested(jax.tree_util.tree_flatten_with_path(state)[0], "state")
  path = _path(directory)
  _check_directory(path, must_exist=False)

  # Every process decides from the same files before any of them changes anything.
  step_dir = path / str(step)
  problem = None
  if step_dir.exists():
    problem = _problem(step_dir)
    if problem is None:
      try:
        _saved_leaves(ocp, step_dir)
        if jax.process_count() == 1:
          _verify_data(ocp, step, step_dir, state)
      except _Unreadable as e:
        problem = str(e)
  if step_dir.exists() and problem is None:
    raise CheckpointError(
        f"a complete checkpoint for step {step} already exists at {step_dir}; fnscale never "
        "overwrites one. Save under a new step, or delete that directory yourself.")
  if problem is not None and jax.process_index() == 0:
    _move_aside(step_dir, problem)
  if jax.process_count() > 1:
    # The manager lists the steps when it starts: nobody may list before the move above.
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(f"fnscale.checkpoint.save.{step}")

  manager = _manager(ocp, path, keep=keep)
  try:
    # force: orbax would otherwise skip, silently, a step lower than one already on disk.
    manager.save(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(tree),
        _EXTRA: ocp.args.JsonSave(extra),
    }), force=True)
    manager.wait_until_finished()
  except Exception as e:  # orbax/tensorstore raise many types; the user needs one.
    raise CheckpointError(f"saving checkpoint step {step} to {path} failed: "
                          f"{type(e).__name__}: {e}") from e
  finally:
    manager.close()
  return os.fspath(step_dir)


def _abstract_target(target):
  """ShapeDtypeStructs with shardings for every target leaf, or a CheckpointError naming it."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  if not leaves:
    raise CheckpointError("target has no leaves; pass the pytree of jax.ShapeDtypeStruct "
                          "(with sharding=) or jax.Array that the checkpoint should fill.")
  out = []
  for path, leaf in leaves:
    name = _leaf_name(path)
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


def _saved_leaves(ocp, step_dir) -> dict[tuple[str, ...], Any]:
  manager = _manager(ocp, step_dir.parent, read_only=True)
  try:
    meta = manager.item_metadata(int(step_dir.name))[_STATE]
    if meta is None:
      raise ValueError("orbax found no tree metadata")
    tree = getattr(meta, "tree", meta)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  except Exception as e:  # any failure to read the metadata makes the step unusable
    raise _Unreadable(f"corrupt: its tree metadata can't be read ({type(e).__name__}: "
                      f"{str(e)[:300]})") from e
  finally:
    manager.close()
  return {_keys(path): m for path, m in flat}


def _check_fit(step: int, step_dir, saved, abstract):
  """Raises a CheckpointError listing leaves whose presence, shape or dtype differ."""
  problems = []
  wanted = {}
  for path, leaf in abstract:
    key = _keys(path)
    wanted[key] = leaf
    if key not in saved:
      problems.append(f"{_leaf_name(path)}: in the target ({leaf.shape} {leaf.dtype}) but not "
                      "in the checkpoint")
      continue
    m = saved[key]
    shape = tuple(getattr(m, "shape", ()) or ())
    dtype = getattr(m, "dtype", None)
    if shape != tuple(leaf.shape) or (dtype is not None and np.dtype(dtype) != leaf.dtype):
      problems.append(f"{_leaf_name(path)}: saved {shape} {dtype}, target expects "
                      f"{tuple(leaf.shape)} {leaf.dtype}")
  for key, m in saved.items():
    if key not in wanted:
      problems.append(f"{'.'.join(key)}: in the checkpoint ({tuple(getattr(m, 'shape', ()))} "
                      f"{getattr(m, 'dtype', None)}) but not in the target")
  if problems:
    more = len(problems) - _MAX_LISTED
    listed = "; ".join(problems[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    raise CheckpointError(
        f"checkpoint step {step} at {step_dir} doesn't fit the target: {listed}. Build the "
        "target from the same model and optimizer config as the saved run (e.g. "
        "jax.eval_shape of its init), or restore a checkpoint of this model.")


def _restore_step(ocp, step: int, step_dir, abstract, treedef):
  saved = _saved_leaves(ocp, step_dir)
  _check_fit(step, step_dir, saved, abstract)
  target = _nested(abstract, "target")
  manager = _manager(ocp, step_dir.parent, read_only=True)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(target),
        _EXTRA: ocp.args.JsonRestore(),
    }))
  except Exception as e:  # tensorstore reports missing/truncated files as ValueError etc.
    raise _Unreadable(f"corrupt: reading it failed ({type(e).__name__}: "
                      f"{str(e)[:300]})") from e
  finally:
    manager.close()
  leaves = [_pick(restored[_STATE], path) for path, _ in abstract]
  return jax.tree_util.tree_unflatten(treedef, leaves), dict(restored[_EXTRA] or {})


def _agreed_latest_step(directory, path) -> int:
  """Several processes: process 0's newest complete step, once every process sees it
  complete (`fnscale.distributed`), so that no process restores a step of its own."""
  from fnscale import distributed  # pylint: disable=import-outside-toplevel

  def problem(step):
    if step is None:
      return None
    step_dir = path / str(step)
    return _problem(step_dir) if step_dir.exists() else f"{step_dir} does not exist"
  step = distributed._agreed_choice(  # pylint: disable=protected-access
      f"the checkpoint step to restore from {path}", lambda: latest_step(directory), problem)
  if step is None:
    raise CheckpointError(
        f"no complete checkpoint in {path} as process 0 sees it. Check the path, or start "
        "fresh when fnscale.checkpoint.latest_step(directory) is None.")
  return step


def restore(directory, target, *, step: int | None = None):
  """Restores checkpoint `step` (default: the newest good one) onto `target`'s shardings.

  Args:
    directory: the directory `save` wrote (local path or `gs://...`).
    target: pytree with the saved state's structure whose leaves are
      `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` or `jax.Array`s (their shardings are
      used; their values are not). Any mesh, device count or process count: the shardings
      decide the layout, e.g. a state saved on 8 devices restores onto `SingleDeviceSharding`.
    step: the step to restore; None means the newest step that passes every check (in a
      multi-process job: process 0's newest complete step, on every process, once every
      process sees it complete).

  Returns:
    `(state, extra)`: `state` has `target`'s structure, with `jax.Array`s on the target
    shardings and values bitwise equal to the saved ones; `extra` is the dict saved with it
    (`{}` if none). The step is not returned: keep it in the state or in `extra`.

  Raises:
    CheckpointError: the directory is missing or holds no checkpoint; `step` doesn't exist or
      is incomplete/corrupt (named, with its path; with step=None such steps are skipped with
      a warning and the newest earlier good step is used, and only if none is good is this
      raised; with several processes, process 0's choice is used without fallback); the
      target doesn't match the saved tree (each differing leaf named with saved
      vs expected shape and dtype); a target leaf lacks a sharding; orbax-checkpoint is missing.
    DistributedError: several processes and step=None: a process that doesn't see process
      0's chosen step complete (named, on every process), or no coordination service.
  """
  ocp = _orbax()
  path = _path(directory)
  if step is None and jax.process_count() > 1:
    step = _agreed_latest_step(directory, path)
  _check_directory(path, must_exist=True)
  abstract, treedef = _abstract_target(target)
  found = _step_dirs(ocp, path)
  if not found:
    raise CheckpointError(
        f"no checkpoint in {path} (no step directories). Check the path, or start fresh when "
        "fnscale.checkpoint.latest_step(directory) is None.")
  if step is not None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
      raise CheckpointError(f"step must be an int or None, got {step!r}.")
    step = int(step)
    if step not in found:
      raise CheckpointError(
          f"no checkpoint for step {step} in {path}; complete steps there: "
          f"{list(steps(directory)) or 'none'}.")
    step_dir = found[step]
    problem = _problem(step_dir)
    try:
      if problem is None:
        return _restore_step(ocp, step, step_dir, abstract, treedef)
    except _Unreadable as e:
      problem = str(e)
    raise CheckpointError(
        f"checkpoint step {step} at {step_dir} is {problem}; refusing it. Restore another "
        f"step (complete ones: {list(steps(directory)) or 'none'}) or step=None for the newest "
        "good one.")

  refused = []
  for candidate in sorted(found, reverse=True):
    step_dir = found[candidate]
    problem = _problem(step_dir)
    if problem is None:
      try:
        return _restore_step(ocp, candidate, step_dir, abstract, treedef)
      except _Unreadable as e:
        if jax.process_count() > 1:
          # Other processes may have read their shards fine; they can't agree on a fallback.
          raise CheckpointError(
              f"checkpoint step {candidate} at {step_dir} is {e}; refusing it. In a "
              "multi-process job pass the previous step explicitly: restore(..., step=N).") from e
        problem = str(e)
    logging.warning("checkpoint step %d at %s is %s; refusing it and trying the previous step.",
                    candidate, step_dir, problem)
    refused.append(f"step {candidate} at {step_dir}: {problem}")
  raise CheckpointError(f"no usable checkpoint in {path}: " + "; ".join(refused) + ".")
