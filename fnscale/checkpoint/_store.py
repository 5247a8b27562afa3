"""Checkpoints at pod scale: one orbax CheckpointManager per run, saves that overlap training,
restore onto any mesh, and never a bad state kept over a good one.

Built on orbax-checkpoint (the `checkpoint` extra: `pip install fnscale[checkpoint]`). A run
opens its checkpoint directory once and keeps the value for its whole length:

  with fs.checkpoint.manager(directory, keep=3) as ckpt:
    if fs.checkpoint.latest_step(ckpt) is not None:
      state, extra = fs.checkpoint.restore(ckpt, abstract_state, data=batches)
    for step in range(start, steps):
      state, metrics = train(state, next(batches))
      if (step + 1) % every == 0:
        fs.checkpoint.save(ckpt, step + 1, state, extra={"lr": lr}, data=batches)
  # leaving the block waits until the last save is committed

What a save blocks: `save` returns once the state is known to be finite, any earlier save of
the same manager has committed, and orbax has copied the arrays off the devices into host
memory; orbax writes and commits them in a background thread while the loop trains. `wait`
(or leaving the `with` block, or `close`) returns when the last save is committed.
`save(directory, ...)` with a path instead of a manager saves synchronously.

What fnscale adds to orbax's manager:
  * never overwrite: saving a step that is already complete raises CheckpointError.
  * damaged steps: a step whose commit marker, metadata or arrays can't be read is refused by
    `restore` (named, with its path), which falls back to the newest earlier good step; a save
    first moves damaged steps aside to `<step>.corrupt-<unix time>` (kept for inspection,
    never deleted), so rotation can't delete them and a new save can use the name.
  * never a non-finite state: `save` refuses a state with a NaN or inf in any floating leaf
    (naming the leaf) unless `allow_nonfinite=True`. Each step's metadata records whether its
    state was finite; `restore(step=None)` and `latest_step` pass over non-finite steps, and
    rotation (orbax's LatestN and EveryNSteps preservation policies) always also keeps the
    newest finite step.
  * data positions: `data=` (a grain iterator) saves its position per process through grain's
    own orbax handler (`grain.checkpoint`), so each process resumes its own position; a job
    restored with another process count says how positions map (`reshard_data`).
  * any mesh, device count or process count on restore: a checkpoint records values, shapes
    and dtypes, never the mesh; the target's shardings decide the layout.

Every process of a multi-process job calls `manager`, `save`, `restore` and `close` with the
same arguments, in the same order (they hold different shards, and orbax's manager
synchronises the processes when it opens, saves and restores); `latest_step` and `steps` on a
directory only read it and may be called from any process alone. The directory must be
visible to every process (a shared file system or a bucket such as `gs://...`;
`fnscale.checkpoint.check_shared_directory` checks it), and `restore(step=None)` restores
process 0's newest complete step everywhere.

Layout (orbax's; fnscale reads it only through orbax's API):

  <step>/                          one committed checkpoint per step: state/ (the arrays,
                                   OCDBT), extra/ (the JSON `extra`), data/ (grain's positions)
  <step>.orbax-checkpoint-tmp*/    a save that never finished: never read
  <step>.corrupt-<unix time>/      a damaged step moved aside: kept for inspection
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fnscale.multihost import _agreement
from fnscale.multihost import _coordination
from fnscale.checkpoint import _tree as ct
from fnscale import _tree
from fnscale._errors import CheckpointError, DistributedError, StorageError

_STATE, _EXTRA, _DATA = "state", "extra", "data"
_META = "fnscale"  # fnscale's entry in orbax's custom step metadata
_INSTALL = "install it with `pip install fnscale[checkpoint]` (orbax-checkpoint)"
# grain's handler writes one file per process in the data item: process_<i>-of-<n>.json.
_POSITION_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")


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


def _grain():
  """grain (for data positions) or None where it isn't installed."""
  try:
    import grain  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return grain


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
        "path such as 'runs/lm/ckpt' or 'gs://bucket/run/ckpt', or a fnscale.checkpoint."
        "Manager.")
  text = os.fspath(directory)
  if "://" not in text:
    text = os.path.abspath(os.path.expanduser(text))
  return epath.Path(text)


def _check_directory(path, *, must_exist: bool) -> bool:
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


# ------------------------------------------------------------------------------------------
# The manager: orbax's, opened once per run, with fnscale's rotation rule.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _NewestFinite:
  """An orbax preservation policy: keep the newest step whose state was finite, whatever the
  other policies say. `finite` is the Manager's own map of verdicts (step -> finite), read
  from the steps' metadata when it opened and added to at each save; unknown steps count as
  finite."""
  finite: dict

  def should_preserve(self, checkpoints, *, context=None):
    del context
    newest = max((c.step for c in checkpoints if self.finite.get(c.step, True)), default=None)
    return [c.step == newest for c in checkpoints]


def _orbax_manager(ocp, path, *, read_only: bool, async_save: bool = False,
                   preservation=None, local: bool = False):
  """`local`: this process alone (orbax's cross-process barriers skipped), for listing only:
  reading which steps exist waits for no other process."""
  me = jax.process_index()
  alone = {"multiprocessing_options": ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me})} if local else {}
  handlers = {_STATE: ocp.StandardCheckpointHandler(), _EXTRA: ocp.JsonCheckpointHandler()}
  grain = _grain()
  if grain is not None:
    handlers[_DATA] = grain.checkpoint.CheckpointHandler()
  options = ocp.CheckpointManagerOptions(
      enable_async_checkpointing=async_save, read_only=read_only, create=not read_only,
      save_interval_steps=0 if read_only else 1, preservation_policy=preservation, **alone)
  return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


class Manager(NamedTuple):
  """A run's checkpoint directory, open for the whole run (see `manager`).

  `orbax` is the `orbax.checkpoint.CheckpointManager` itself (its `all_steps`, `latest_step`,
  `is_saving_in_progress`, `reached_preemption` ... are there for direct use). `checked`: the
  steps this manager wrote or found complete (a save doesn't check them again); `finite`:
  whether each step's state was finite, as far as this manager knows (what rotation keeps).
  Use it in a `with` block, or call `close` at the end: both wait for the last save (the
  block doesn't when it ends in a DistributedError: the job lost a process, and the save's
  cross-process commit can't finish).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d, fs.checkpoint.manager(d, keep=2) as ckpt:
    ...   for step in (1, 2, 3):
    ...     _ = fs.checkpoint.save(ckpt, step, state)  # in the background
    ...   fs.checkpoint.wait(ckpt)
    ...   type(ckpt).__name__, ckpt.orbax.all_steps(), ckpt.finite
    ('Manager', [2, 3], {1: True, 2: True, 3: True})
  """
  directory: Any  # etils.epath.Path
  orbax: Any  # orbax.checkpoint.CheckpointManager
  async_save: bool
  read_only: bool
  checked: set
  finite: dict

  def __enter__(self) -> "Manager":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None and issubclass(exc_type, DistributedError):
      # A lost or disagreeing process: a save in flight can't finish its cross-process
      # commit, and waiting would hang until JAX's heartbeat ends the process. Left as an
      # unfinished temporary directory, it is never read.
      return
    close(self)


def manager(directory, *, keep: int | None = 3, keep_period: int | None = None,
            async_save: bool = True, read_only: bool = False) -> Manager:
  """Opens `directory` for a run: one orbax `CheckpointManager`, kept until `close`.

  Args:
    directory: local path or object-store URL (`gs://...`) seen by every process; created if
      missing (unless `read_only`).
    keep: how many of the newest steps rotation keeps (orbax's `LatestN`); None keeps all.
      The newest finite step is always kept as well.
    keep_period: also keep every step divisible by this (orbax's `EveryNSteps`); None: off.
    async_save: `save` returns once the arrays are in host memory and orbax writes them in a
      background thread (False: `save` returns when the step is committed).
    read_only: only restore and list (nothing is created, moved or deleted).

  Returns:
    A `Manager`; use it as a context manager, or `close` it.

  Raises:
    CheckpointError: a bad option (named), `directory` is a file (or, read-only, missing),
      orbax-checkpoint is missing.

  Examples:
    Keep the newest 2 steps, and every 10th:

    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   with fs.checkpoint.manager(d, keep=2, keep_period=10) as ckpt:
    ...     for step in (10, 11, 12, 13):
    ...       _ = fs.checkpoint.save(ckpt, step, state)
    ...   fs.checkpoint.steps(d)  # the block waited for the last save
    (10, 12, 13)
  """
  ocp = _orbax()
  ct.check_count(keep, "keep")
  ct.check_count(keep_period, "keep_period")
  path = _path(directory)
  _check_directory(path, must_exist=read_only)
  # Every process must see this same directory: the multi-host agreement belongs here.
  if read_only:
    return Manager(path, _orbax_manager(ocp, path, read_only=True), False, True, set(), {})
  finite = {}  # filled below, from the steps on disk; rotation reads it at every save
  policies = [ocp.checkpoint_managers.LatestN(keep)]
  if keep_period:
    policies.append(ocp.checkpoint_managers.EveryNSteps(keep_period))
  policies.append(_NewestFinite(finite))
  try:
    orbax_manager = _orbax_manager(
        ocp, path, read_only=False, async_save=bool(async_save),
        preservation=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
  except OSError as e:  # the directory can't be created (a file in the way, permissions)
    raise StorageError(f"opening checkpoint directory {path} failed: "
                       f"{type(e).__name__}: {e}") from e
  for step in orbax_manager.all_steps():
    verdict = _step_meta(orbax_manager, step).get("finite")
    if isinstance(verdict, bool):
      finite[step] = verdict
  return Manager(path, orbax_manager, bool(async_save), False, set(), finite)


def wait(ckpt: Manager) -> None:
  """Blocks until every save of `ckpt` is committed.

  Raises:
    StorageError: a background write failed (the step stays an unfinished temporary
      directory that is never read); not a `ValueError`.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d, fs.checkpoint.manager(d) as ckpt:
    ...   _ = fs.checkpoint.save(ckpt, 1, state)
    ...   fs.checkpoint.wait(ckpt)  # committed from here on
    ...   fs.checkpoint.latest_step(d)
    1
  """
  _require_manager(ckpt, "wait")
  try:
    ckpt.orbax.wait_until_finished()
    ckpt.orbax.check_for_errors()
  except Exception as e:  # orbax/tensorstore raise many types; the user needs one.
    raise StorageError(f"a checkpoint save to {ckpt.directory} failed: "
                       f"{type(e).__name__}: {e}") from e


def close(ckpt: Manager) -> None:
  """Waits for the last save (see `wait`), then closes orbax's manager (what leaving a
  `with` block does).

  Raises:
    StorageError: as `wait`. CheckpointError: `ckpt` is not a `Manager`.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   ckpt = fs.checkpoint.manager(d)
    ...   _ = fs.checkpoint.save(ckpt, 5, state)
    ...   fs.checkpoint.close(ckpt)
    ...   fs.checkpoint.steps(d)
    (5,)
  """
  _require_manager(ckpt, "close")
  try:
    wait(ckpt)
  finally:
    ckpt.orbax.close()


def _require_manager(ckpt, what: str) -> None:
  if not isinstance(ckpt, Manager):
    raise CheckpointError(f"{what} takes the Manager that fnscale.checkpoint.manager(...) "
                          f"returned, got {_tree.got(ckpt)}.")


def _open(where, *, read_only: bool, must_exist: bool = True, keep: int | None = None,
          local: bool = False):
  """`(Manager, opened_here)` for a Manager or a directory (`local`: see `_orbax_manager`)."""
  if isinstance(where, Manager):
    return where, False
  if read_only:
    path = _path(where)
    if not _check_directory(path, must_exist=must_exist):
      return None, False
    if local:
      orbax = _orbax_manager(_orbax(), path, read_only=True, local=True)
      return Manager(path, orbax, False, True, set(), {}), True
  return manager(where, keep=keep, async_save=False, read_only=read_only), True


# ------------------------------------------------------------------------------------------
# What is on disk: listing and checking steps through orbax's API.
# ------------------------------------------------------------------------------------------


def _step_dir(ckpt: Manager, step: int):
  ocp = _orbax()
  return ocp.step.build_step_path(ckpt.directory, ocp.step.standard_name_format(), step)


def _step_meta(orbax_manager, step: int) -> dict:
  """fnscale's entry in a step's custom metadata ({} when absent or unreadable)."""
  try:
    custom = orbax_manager.metadata(step).custom_metadata or {}
  except Exception:  # pylint: disable=broad-except  (a damaged step: checked elsewhere)
    return {}
  return dict(custom.get(_META) or {})


def _uncommitted(ckpt: Manager, step: int) -> str | None:
  """Why `step` isn't a committed step directory, or None: files only, no orbax call (which
  could wait for the other processes)."""
  ocp = _orbax()
  step_dir = _step_dir(ckpt, step)
  if not step_dir.exists():
    return "gone: its directory no longer exists"
  marker = ocp.path.atomicity.CommitFileTemporaryPath  # checks orbax's commit marker
  if not (ocp.step.is_checkpoint_finalized(step_dir)
          and ocp.step.is_checkpoint_finalized(step_dir, temporary_path_cls=marker)):
    return ("incomplete: orbax's commit marker is missing (the save never finished, or the "
            "directory was damaged or copied partially)")
  return None


def _problem(ckpt: Manager, step: int) -> str | None:
  """Why `step` can't be a complete checkpoint, or None if it looks complete.

  Reads orbax's markers and metadata, not the arrays, so every process reaches the same
  verdict on a shared file system."""
  ocp = _orbax()
  problem = _uncommitted(ckpt, step)
  if problem:
    return problem
  try:
    if ckpt.orbax.metadata(step).commit_timestamp_nsecs is None:
      return "corrupt: orbax's step metadata is missing"
    ckpt.orbax.restore(step, args=ocp.args.Composite(**{_EXTRA: ocp.args.JsonRestore()}))
  except Exception as e:  # pylint: disable=broad-except  (any failure makes it unusable)
    return f"corrupt: its extra JSON can't be read ({type(e).__name__}: {str(e)[:200]})"
  try:
    _saved_leaves(ckpt, step)
  except _Unreadable as e:
    return str(e)
  return None


def _listed(ckpt: Manager) -> list[int]:
  """Every step orbax lists on disk now (complete or damaged; unfinished saves are not
  listed), after a save in flight has committed."""
  if not ckpt.read_only:
    wait(ckpt)
  ckpt.orbax.reload()
  return sorted(int(s) for s in ckpt.orbax.all_steps())


def steps(where, *, complete: bool = True) -> tuple[int, ...]:
  """The steps of the checkpoints in `where`, oldest first.

  Args:
    where: a `Manager` or a directory (local path or `gs://...`).
    complete: True: only steps that pass the checks of orbax's commit marker and metadata
      (finite or not); False: every step directory orbax lists, damaged ones included.

  Returns:
    Sorted step numbers; empty when the directory doesn't exist or holds none. Unfinished
    saves are never listed.

  Raises:
    CheckpointError: orbax-checkpoint is missing, or `where` is a file.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   for step in (100, 200):
    ...     _ = fs.checkpoint.save(d, step, state)
    ...   fs.checkpoint.steps(d), fs.checkpoint.steps(d + "/missing")
    ((100, 200), ())
  """
  ckpt, opened = _open(where, read_only=True, must_exist=False, local=True)
  if ckpt is None:
    return ()
  try:
    found = _listed(ckpt)
    return tuple(s for s in found if not complete or _problem(ckpt, s) is None)
  finally:
    if opened:
      ckpt.orbax.close()


def latest_step(where) -> int | None:
  """The newest complete checkpoint with a finite state in `where`, or None if there is none.

  None (not an error) for a missing or empty directory, so a training loop can write
  `start = latest_step(d)` and initialise fresh when it is None. This is the step
  `restore(step=None)` tries first; it can still fail the deeper checks of `restore` (an
  unreadable leaf), which then falls back to an earlier step.

  Raises:
    CheckpointError: orbax-checkpoint is missing, or `where` is a file.

  Examples:
    A non-finite state (saved for inspection) is passed over:

    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = fs.checkpoint.save(d, 1, {"w": jnp.ones(2)})
    ...   _ = fs.checkpoint.save(d, 2, {"w": jnp.array([1.0, jnp.nan])}, allow_nonfinite=True)
    ...   fs.checkpoint.latest_step(d), fs.checkpoint.latest_step(d + "/missing")
    (1, None)
  """
  def usable(ckpt, s):
    complete = _problem(ckpt, s) is None
    return s if complete and _step_meta(ckpt.orbax, s).get("finite") is not False else None

  return _newest(where, usable)


def last_save_seconds(where) -> tuple[int, float] | None:
  """`(step, seconds)`: how long the newest complete step took to save, from the start of its
  save to its commit (orbax's step metadata timestamps; for an async save this includes the
  background write). None when there is no complete step.

  Raises:
    CheckpointError: orbax-checkpoint is missing, or `where` is a file.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, tempfile
    >>> state = {"w": jnp.arange(4.0)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = fs.checkpoint.save(d, 7, state)
    ...   step, seconds = fs.checkpoint.last_save_seconds(d)
    >>> step, seconds > 0
    (7, True)
  """
  def save_seconds(ckpt, s):
    meta = ckpt.orbax.metadata(s)
    if meta.init_timestamp_nsecs and meta.commit_timestamp_nsecs:
      return s, (meta.commit_timestamp_nsecs - meta.init_timestamp_nsecs) / 1e9
    return None

  return _newest(where, save_seconds)


def _newest(where, pick):
  """The first `pick(ckpt, step)` that is not None over the listed steps of `where`, newest
  first; None when there is none (or no directory). Opens orbax's manager process-locally."""
  ckpt, opened = _open(where, read_only=True, must_exist=False, local=True)
  if ckpt is None:
    return None
  try:
    return next((r for r in (pick(ckpt, s) for s in reversed(_listed(ckpt))) if r is not None),
                None)
  finally:
    if opened:
      ckpt.orbax.close()


# ------------------------------------------------------------------------------------------
# Finiteness: known before any save.
# ------------------------------------------------------------------------------------------


def _leaf_finite(x) -> jax.Array:
  # max(|x|) is NaN or inf exactly when some element is (XLA's max propagates NaN): a float
  # max-reduction, which XLA's CPU backend ran 5-6x faster than all(isfinite(x)), a
  # reduction over bools (256 MiB on 8 simulated devices, fused after a step).
  x = jnp.asarray(x)
  if jnp.iscomplexobj(x):  # |x| of two large finite parts can overflow: each part alone
    return _leaf_finite(x.real) & _leaf_finite(x.imag)
  return jnp.isfinite(jnp.max(jnp.abs(x))) if x.size else jnp.array(True)


def all_finite(tree) -> jax.Array:
  """Whether every floating leaf of `tree` holds only finite values: a bool scalar array.

  Traceable: inside a jitted step (over the new state and the loss) it is one read of each
  leaf, which XLA can fuse with the step's own outputs. Integer and bool leaves count as
  finite.

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> finite = jax.jit(fs.checkpoint.all_finite)  # as inside a step
    >>> finite({"w": np.ones(2), "step": np.int32(7)}), finite({"w": np.array([1.0, np.inf])})
    (Array(True, dtype=bool), Array(False, dtype=bool))
  """
  flags = [_leaf_finite(x) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


@jax.jit
def _finite_per_leaf(arrays):
  return jnp.stack([_leaf_finite(x) for x in arrays])


def _to_host(x) -> np.ndarray:
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def nonfinite_leaves(tree) -> list[str]:
  """The names (`params.w`, orbax's spelling) of the floating leaves of `tree` that hold a NaN
  or an inf, in tree order; [] when all are finite. The reduction runs where the arrays are
  (one small program per device set); one bool per leaf comes back to the host.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> tree = {"params": {"b": jnp.zeros(2), "w": jnp.array([1.0, jnp.nan])}}
    >>> fs.checkpoint.nonfinite_leaves(tree)
    ['params.w']
  """
  names, groups, bad = [], {}, set()
  for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
    names.append(ct.leaf_name(path))
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
      continue
    if isinstance(leaf, jax.Array):
      groups.setdefault(frozenset(leaf.sharding.device_set), []).append((i, leaf))
    elif not np.all(np.isfinite(np.asarray(leaf))):
      bad.add(i)
  for group in groups.values():
    flags = _to_host(_finite_per_leaf([x for _, x in group]))
    bad.update(i for (i, _), ok in zip(group, flags) if not ok)
  return [names[i] for i in sorted(bad)]


# ------------------------------------------------------------------------------------------
# Save.
# ------------------------------------------------------------------------------------------


class _Default(NamedTuple):
  """A keyword's default that a Manager replaces with its own setting."""
  value: Any

  def __repr__(self):
    return repr(self.value)


_KEEP = _Default(3)


def _check_data(data) -> None:
  if _grain() is None:
    raise CheckpointError("data= saves a grain iterator's position and needs grain; install "
                          "it with `pip install grain`.")
  if not (callable(getattr(data, "get_state", None))
          and callable(getattr(data, "set_state", None))):
    raise CheckpointError(
        f"data is {_tree.got(data)}; expected a grain iterator (iter(grain.MapDataset ... "
        ".to_iter_dataset()) or a grain.DataLoader's iterator), whose get_state/set_state give "
        "its position.")


def save(where, step: int, state, *, extra: Mapping[str, Any] | None = None, data=None,
         allow_nonfinite: bool = False, keep: int | None = _KEEP) -> str:
  """Saves a sharded pytree, a small JSON dict and a data position as checkpoint `step`.

  With a `Manager` that saves asynchronously (the default), returns once the arrays are in
  host memory; the step is committed in the background (`wait` for it). With a directory, a
  manager is opened for this one save, which is committed when `save` returns. Each process
  writes the shards it holds; process 0 writes the metadata and `extra` and commits. An
  interrupted save leaves only a `<step>.orbax-checkpoint-tmp*` directory that nothing reads.

  Args:
    where: a `Manager` (a run's loop) or a directory (local path or `gs://...`) seen by every
      process, created if missing.
    step: non-negative int naming the checkpoint (usually the train step).
    state: pytree of `jax.Array`s on any mesh (also numpy arrays / Python numbers), e.g. a
      `fnscale.TrainState` with optax NamedTuple states. Any dtype except typed PRNG keys.
    extra: JSON-serialisable dict stored beside the state (config, ...); process 0's copy is
      the one written.
    data: a grain iterator: each process saves its own position (grain's orbax handler), at
      the moment of this call: save before reading the next batch.
    allow_nonfinite: save a state holding NaN or inf anyway (kept for inspection; recorded
      as non-finite, passed over by `restore(step=None)` and `latest_step`).
    keep: with a directory, how many of the newest steps to keep (None: all); a Manager
      rotates as `manager(...)` was told, and this must be left out.

  Returns:
    The step directory, as a string (committed once `wait` returns, or at once for a directory).

  Raises:
    CheckpointError: bad `step`/`keep`/`extra`/`data`/leaf (named); a leaf holds NaN or inf
      (named; the state is not saved); a complete checkpoint already exists for `step` (never
      overwritten); orbax-checkpoint is missing. Damaged step directories are moved aside to
      `<step>.corrupt-<time>` first.
    StorageError: the write failed, or the previous save of this manager did (not a
      `ValueError`).

  Examples:
    A state split over 8 devices, with its learning rate, saved to a directory:

    >>> import fnscale as fs, jax, numpy as np, tempfile
    >>> w = np.ones((8, 4), np.float32)
    >>> state = {"w": jax.device_put(w, fs.shardings(w, fs.make_mesh({"fsdp": 8})))}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   path = fs.checkpoint.save(d, 100, state, extra={"lr": 1e-3})
    ...   path.endswith("/100"), fs.checkpoint.steps(d)
    (True, (100,))
  """
  step = ct.check_step(step)
  extra = ct.check_extra(extra)
  ct.check_state(state)
  if isinstance(where, Manager):
    if not isinstance(keep, _Default):
      raise CheckpointError("keep= belongs to the Manager (fnscale.checkpoint.manager(..., "
                            "keep=N)); leave it out when saving through one.")
    if where.read_only:
      raise CheckpointError(f"the manager of {where.directory} is read-only; open it with "
                            "read_only=False to save.")
  keep = ct.check_count(keep.value if isinstance(keep, _Default) else keep, "keep")
  if data is not None:
    _check_data(data)
  bad = nonfinite_leaves(state)
  if bad and not allow_nonfinite:
    more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
    raise CheckpointError(
        f"not saving step {step}: state leaf {bad[0]} holds NaN or inf{more}; a checkpoint of "
        "it could only resume into the same failure. Fix the cause (e.g. a lower learning "
        "rate) and resume from the last good step, or pass allow_nonfinite=True to keep it "
        "for inspection.")
  ckpt, opened = _open(where, read_only=False, keep=keep)
  try:
    return _save(ckpt, step, state, extra, data, finite=not bad)
  finally:
    if opened:
      close(ckpt)


def _save(ckpt: Manager, step: int, state, extra: dict, data, *, finite: bool) -> str:
  ocp = _orbax()
  if jax.process_count() > 1:
    state = ct.host_local_to_numpy(state)
  tree = ct.nested(jax.tree_util.tree_flatten_with_path(state)[0], "state")
  _clear_damaged(ckpt, step, state)  # after the save in flight has committed
  items = {_STATE: ocp.args.StandardSave(tree), _EXTRA: ocp.args.JsonSave(extra)}
  if data is not None:
    items[_DATA] = _grain().checkpoint.CheckpointSave(data)
  meta = {"finite": finite, "processes": jax.process_count(), "data": data is not None}
  ckpt.finite[step] = finite  # before orbax's save decides what rotation deletes
  try:
    # force: orbax would otherwise skip, silently, a step lower than one already on disk.
    ckpt.orbax.save(step, args=ocp.args.Composite(**items), force=True,
                    custom_metadata={_META: meta})
  except Exception as e:  # orbax/tensorstore raise many types; the user needs one.
    raise StorageError(f"saving checkpoint step {step} to {ckpt.directory} failed: "
                       f"{type(e).__name__}: {e}") from e
  ckpt.checked.add(step)
  if not ckpt.async_save:
    wait(ckpt)
  return os.fspath(_step_dir(ckpt, step))


def _clear_damaged(ckpt: Manager, step: int, state) -> None:
  """Refuses to overwrite a complete `step`; moves damaged steps aside, so that orbax's
  rotation can't delete them and the new save can use the name. Every process decides from
  the same files before any of them changes anything."""
  problems = {}
  for s in _listed(ckpt):
    if s in ckpt.checked and s != step:
      continue
    problem = _problem(ckpt, s)
    if problem is None and s == step and jax.process_count() == 1:
      problem = _unreadable_arrays(ckpt, s, state)
    if problem is not None:
      problems[s] = problem
      continue
    if s == step:
      raise CheckpointError(
          f"a complete checkpoint for step {step} already exists at {_step_dir(ckpt, step)}; "
          "fnscale never overwrites one. Save under a new step, or delete that directory "
          "yourself.")
    ckpt.checked.add(s)
  if problems and jax.process_index() == 0:
    for s, problem in problems.items():
      _move_aside(_step_dir(ckpt, s), problem)
  if jax.process_count() > 1:
    # Nobody lists the steps again before process 0 has moved them.
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(f"fnscale.checkpoint.save.{step}")
  if problems or jax.process_count() > 1:
    ckpt.orbax.reload()


def _move_aside(step_dir, reason: str) -> None:
  """Renames a damaged step directory so a new save can use its name; nothing is deleted."""
  stamp = int(time.time())
  target = step_dir.parent / f"{step_dir.name}.corrupt-{stamp}"
  while target.exists():  # never replace an earlier one moved aside in the same second
    stamp += 1
    target = step_dir.parent / f"{step_dir.name}.corrupt-{stamp}"
  logging.warning("checkpoint step %s at %s is %s; moving it to %s (kept, never deleted).",
                  step_dir.name, step_dir, reason, target)
  step_dir.rename(target)


def _unreadable_arrays(ckpt: Manager, step: int, state) -> str | None:
  """Reads an existing step's arrays back (onto `state`'s shardings), so a step whose array
  files are damaged but whose metadata looks complete is moved aside, not kept forever.
  Only reached when a save meets an existing step: normally after `restore` refused it."""
  try:
    abstract, treedef = ct.abstract_target(state)
    _restore_step(ckpt, step, abstract, treedef)
  except CheckpointError:
    return None  # a different tree or host-only leaves: the metadata checks decide
  except _Unreadable as e:
    return str(e)
  return None


# ------------------------------------------------------------------------------------------
# Restore.
# ------------------------------------------------------------------------------------------


def _saved_leaves(ckpt: Manager, step: int) -> dict[tuple[str, ...], Any]:
  try:
    meta = ckpt.orbax.item_metadata(step)[_STATE]
    if meta is None:
      raise ValueError("orbax found no tree metadata")
    flat = jax.tree_util.tree_flatten_with_path(getattr(meta, "tree", meta))[0]
  except Exception as e:  # any failure to read the metadata makes the step unusable
    raise _Unreadable(f"corrupt: its tree metadata can't be read ({type(e).__name__}: "
                      f"{str(e)[:300]})") from e
  return {ct.keys(path): m for path, m in flat}


def _saved_positions(item_dir, count: int) -> list:
  """Every process's saved data position, by process index (grain's JSON files)."""
  found = {}
  for f in item_dir.iterdir():
    m = _POSITION_FILE.search(f.name)
    if m and int(m.group(2)) == count:
      found[int(m.group(1))] = json.loads(f.read_text())
  if sorted(found) != list(range(count)):
    raise _Unreadable(f"corrupt: its data positions are incomplete (processes {sorted(found)} "
                      f"of {count})")
  return [found[i] for i in range(count)]


def _position_plan(ckpt: Manager, step: int, data, reshard, items: dict):
  """Adds grain's restore to `items` (same process count) or returns the position `reshard`
  gives for this process (another count)."""
  meta = _step_meta(ckpt.orbax, step)
  if not meta.get("data"):
    raise CheckpointError(
        f"checkpoint step {step} at {_step_dir(ckpt, step)} holds no data position (saved "
        "without data=); restore it without data= and position the iterator yourself.")
  saved, now = meta.get("processes"), jax.process_count()
  if saved == now:
    items[_DATA] = _grain().checkpoint.CheckpointRestore(data)
    return None
  if reshard is None:
    raise CheckpointError(
        f"checkpoint step {step} was saved by {saved} processes and this job has {now}: its "
        "data positions are per process. Pass reshard_data=fn(saved_positions, "
        "process_index, process_count) -> position (recipes/lm/data.py: resharded_position), or "
        f"resume with {saved} processes.")
  return reshard(_saved_positions(_step_dir(ckpt, step) / _DATA, saved), jax.process_index(),
                 now)


def _set_position(data, position) -> None:
  grain = _grain()
  if not isinstance(data, grain.DatasetIterator):  # a DataLoader's iterator takes JSON bytes
    position = json.dumps(position).encode()
  data.set_state(position)
  if callable(getattr(data, "start_prefetch", None)):
    data.start_prefetch()  # as grain's own handler does after restoring


def _restore_step(ckpt: Manager, step: int, abstract, treedef, data=None, reshard=None):
  ocp = _orbax()
  ct.check_fit(step, _step_dir(ckpt, step), _saved_leaves(ckpt, step), abstract)
  items = {_STATE: ocp.args.StandardRestore(ct.nested(abstract, "target")),
           _EXTRA: ocp.args.JsonRestore()}
  position = None if data is None else _position_plan(ckpt, step, data, reshard, items)
  try:
    restored = ckpt.orbax.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # tensorstore reports missing/truncated files as ValueError etc.
    raise _Unreadable(f"corrupt: reading it failed ({type(e).__name__}: "
                      f"{str(e)[:300]})") from e
  if position is not None:
    _set_position(data, position)
  leaves = [ct.pick(restored[_STATE], path) for path, _ in abstract]
  return jax.tree_util.tree_unflatten(treedef, leaves), dict(restored[_EXTRA] or {})


def restore(where, target, *, step: int | None = None, data=None,
            reshard_data: Callable[[list, int, int], Any] | None = None):
  """Restores checkpoint `step` (default: the newest good one) onto `target`'s shardings.

  Args:
    where: a `Manager` (a save in flight is committed first) or the directory `save` wrote.
    target: pytree with the saved state's structure whose leaves are
      `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` or `jax.Array`s (their shardings are
      used; their values are not). Any mesh, device count or process count: the shardings
      decide the layout, e.g. a state saved on 8 devices restores onto `SingleDeviceSharding`.
    step: the step to restore; None means the newest step that passes every check and whose
      state was finite (in a multi-process job: process 0's choice, on every process, once
      every process sees it complete; no fallback).
    data: a grain iterator to put at the position this process saved (in place).
    reshard_data: for a job with another process count than the saved one:
      `fn(saved_positions: list (one per saved process, by index), process_index,
      process_count) -> this process's position`. Only the data pipeline knows how positions
      map; without it, a changed process count with `data` is refused.

  Returns:
    `(state, extra)`: `state` has `target`'s structure, with `jax.Array`s on the target
    shardings and values bitwise equal to the saved ones; `extra` is the dict saved with it
    (`{}` if none). The step is not returned: keep it in the state or in `extra`.

  Raises:
    CheckpointError: the directory is missing or holds no checkpoint; `step` doesn't exist or
      is incomplete/corrupt (named, with its path; with step=None such steps, and non-finite
      ones, are passed over with a warning for the newest earlier good step, and only if none
      is good is this raised); the target doesn't match the saved tree (each differing leaf
      named with saved vs expected shape and dtype); a target leaf lacks a sharding; `data`
      given but the step holds no position, or another process count without
      `reshard_data`; orbax-checkpoint is missing.
    DistributedError: several processes and step=None: a process that doesn't see process
      0's chosen step complete (named, on every process), or no coordination service.

  Examples:
    Saved from 8 devices, restored onto one:

    >>> import fnscale as fs, jax, numpy as np, tempfile
    >>> values = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    >>> w = jax.device_put(values, fs.shardings(values, fs.make_mesh({"fsdp": 8})))
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = fs.checkpoint.save(d, 1, {"w": w}, extra={"note": "hi"})
    ...   state, extra = fs.checkpoint.restore(d, {"w": jax.ShapeDtypeStruct((8, 2), "float32",
    ...                                                                     sharding=one)})
    >>> state["w"].sharding == one, bool((state["w"] == values).all()), extra
    (True, True, {'note': 'hi'})
  """
  if step is None and jax.process_count() > 1:  # the agreement needs the service: say so first
    _coordination.job_runtime(f"the checkpoint step to restore from {where}")
  abstract, treedef = ct.abstract_target(target)
  step = ct.check_step(step, allow_none=True)
  if data is not None:
    _check_data(data)
  ckpt, opened = _open(where, read_only=True)
  try:
    found = _listed(ckpt)  # after a save in flight has committed
    if not found:
      raise CheckpointError(
          f"no checkpoint in {ckpt.directory} (no step directories). Check the path, or start "
          "fresh when fnscale.checkpoint.latest_step(directory) is None.")
    reading = (abstract, treedef, data, reshard_data)
    if step is None and jax.process_count() > 1:
      step = _agreed_latest_step(ckpt)
    if step is not None:
      return _restore_named(ckpt, step, found, reading)
    return _restore_newest(ckpt, found, reading)
  finally:
    if opened:
      ckpt.orbax.close()


def _agreed_latest_step(ckpt: Manager) -> int:
  """Several processes: process 0's newest complete finite step, once every process sees it
  complete (`fnscale.multihost._agreement`), so that no process restores a step of its own."""
  # Every process lists and reads through orbax (whose calls synchronise the processes);
  # only then is process 0's answer checked, from the files alone, everywhere.
  mine = latest_step(ckpt)

  def unusable(step):
    problem = None if step is None else _uncommitted(ckpt, step)
    return problem and f"step {step} at {_step_dir(ckpt, step)} is {problem}"
  step = _agreement.agreed_choice(
      f"the checkpoint step to restore from {ckpt.directory}", lambda: mine, unusable)
  if step is None:
    raise CheckpointError(
        f"no complete checkpoint in {ckpt.directory} as process 0 sees it. Check the path, or "
        "start fresh when fnscale.checkpoint.latest_step(directory) is None.")
  return step


def _restore_named(ckpt: Manager, step: int, found: list[int], reading):
  if step not in found:
    raise CheckpointError(
        f"no checkpoint for step {step} in {ckpt.directory}; complete steps there: "
        f"{list(steps(ckpt)) or 'none'}.")
  problem = _problem(ckpt, step)
  try:
    if problem is None:
      return _restore_step(ckpt, step, *reading)
  except _Unreadable as e:
    problem = str(e)
  raise CheckpointError(
      f"checkpoint step {step} at {_step_dir(ckpt, step)} is {problem}; refusing it. Restore "
      f"another step (complete ones: {list(steps(ckpt)) or 'none'}) or step=None for the "
      "newest good one.")


def _restore_newest(ckpt: Manager, found: list[int], reading):
  refused = []
  for candidate in reversed(found):
    step_dir = _step_dir(ckpt, candidate)
    problem = _problem(ckpt, candidate)
    if problem is None and _step_meta(ckpt.orbax, candidate).get("finite") is False:
      problem = "non-finite: its state holds NaN or inf (saved with allow_nonfinite=True)"
    if problem is None:
      # Every process must restore the same step: the multi-host agreement belongs here.
      try:
        return _restore_step(ckpt, candidate, *reading)
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
  raise CheckpointError(f"no usable checkpoint in {ckpt.directory}: " + "; ".join(refused) + ".")
