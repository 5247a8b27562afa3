"""Save: a sharded state, its JSON `extra` and the data position as one orbax step, never over
a complete step and never a non-finite state; damaged steps moved aside first."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from absl import logging

from fnscale.checkpoint import _tree as ct
from fnscale.checkpoint._finite import nonfinite_leaves
from fnscale.checkpoint._manager import (
    _DATA, _EXTRA, _META, _STATE, Manager, _Unreadable, _check_data, _grain, _open, _orbax,
    _step_dir, close, wait)
from fnscale.checkpoint._restore import _restore_step
from fnscale.checkpoint._steps import _listed, _problem
from fnscale._errors import CheckpointError, StorageError


class _Default(NamedTuple):
  """A keyword's default that a Manager replaces with its own setting."""
  value: Any

  def __repr__(self):
    return repr(self.value)


_KEEP = _Default(3)


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
