"""What is on disk: listing and checking steps through orbax's API (`steps`, `latest_step`,
`last_save_seconds`), and why a step can't be used."""
from __future__ import annotations

from typing import Any

import jax

from fnscale.checkpoint import _tree as ct
from fnscale.checkpoint._manager import (
    _EXTRA, _STATE, Manager, _Unreadable, _open, _orbax, _step_dir, _step_meta, wait)


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
