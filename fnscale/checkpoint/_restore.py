"""Restore: a step onto the target's shardings (any mesh, device or process count), the
newest good step by default, with the data position of each process."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from fnscale.multihost import _agreement
from fnscale.multihost import _coordination
from fnscale.checkpoint import _tree as ct
from fnscale.checkpoint._manager import (
    _DATA, _EXTRA, _POSITION_FILE, _STATE, Manager, _Unreadable, _check_data, _grain, _open,
    _orbax, _step_dir, _step_meta)
from fnscale.checkpoint._steps import (
    _listed, _problem, _saved_leaves, _uncommitted, latest_step, steps)
from fnscale._errors import CheckpointError


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
