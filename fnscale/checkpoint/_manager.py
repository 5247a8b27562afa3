"""The checkpoint manager: orbax's CheckpointManager, opened once per run, with fnscale's
rotation rule (the newest finite step is always kept), and the names and checks every other
part of `fnscale.checkpoint` shares (the items of a step, orbax and grain imported on first
use, the directory as orbax wants it)."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, NamedTuple

import jax

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
