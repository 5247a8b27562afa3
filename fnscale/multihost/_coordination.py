"""JAX's coordination service as fnscale's multi-process code uses it: the runtime (client,
process id, process count), where each process is waiting (for messages that name where the
others are, and for the preemption watcher), and leaving from a helper thread with a message.
Shared by `fnscale.multihost`, `fnscale.multihost.preemption_guard` and the agreement checks
(`fnscale.multihost._agreement`)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import jax

from fnscale import _compat
from fnscale import _compiler
from fnscale.multihost import _liveness
from fnscale._errors import DistributedError

# Exit status when the job can't form or continue (EX_TEMPFAIL: restarting may succeed).
EXIT_JOB_FAILED = 75
DEFAULT_TIMEOUT_S = 300  # seconds any wait for the other processes lasts at most
# fnscale's entries in the coordination service's key-value store live under this prefix.
KEY = "fnscale"
# What the main thread is blocked in ("at": a barrier's name, or None) and since when
# (time.monotonic()); the preemption watcher (fnscale.multihost._preemption) reads it.
WAIT: dict[str, Any] = {"at": None, "since": 0.0}


def runtime():
  """(client, process_id, num_processes) of JAX's distributed runtime, or None when this is
  a single process or the runtime isn't up."""
  st = _compat.distributed_state()
  if st.client is None or (st.num_processes or 1) == 1:
    return None
  return st.client, int(st.process_id), int(st.num_processes)


def job_runtime(what: str):
  """`runtime()`, or a DistributedError when this is one of several processes (libtpu runs
  a pod slice across hosts on its own) but JAX's coordination service is not up: `what`
  needs it, and falling back to per-process behaviour would be silently wrong."""
  rt = runtime()
  if rt is None and jax.process_count() > 1:
    raise DistributedError(
        f"{what} needs JAX's coordination service, but this is process "
        f"{jax.process_index()} of {jax.process_count()} and jax.distributed was never "
        "initialised (no barriers, agreement checks, preemption sync or lost-process checks "
        "work without it); fix: call fnscale.initialize() first thing in every process, "
        "before any other jax call (it joins from the environment, the Cloud TPU metadata "
        "service, SLURM or Open MPI).")
  return rt


@contextlib.contextmanager
def waiting(what: str):
  """Marks the main thread as blocked in `what` (the preemption watcher ends the process at
  once on a notice then) and tells the others where this process is (barrier timeouts)."""
  rt = runtime()
  if rt is not None:
    client, pid, _ = rt
    say_where(client, pid, what, left=False)
  WAIT["at"], WAIT["since"] = what, time.monotonic()
  try:
    yield
  finally:
    WAIT["at"] = None
    if rt is not None:
      say_where(client, pid, what, left=True)


def say_where(client, pid: int, what: str, *, left: bool) -> None:
  with contextlib.suppress(Exception):  # only for messages: never fail a wait over it
    client.key_value_set(f"{KEY}/where/{pid}",
                         json.dumps({"at": what, "t": time.time(), "left": left}),
                         allow_overwrite=True)


def where_others(client, pid: int, n: int, name: str) -> list[str]:
  """Where each other process last said it was (`waiting` records every fnscale wait)."""
  try:
    where = {int(k.rsplit("/", 1)[1]): json.loads(v)
             for k, v in client.key_value_dir_get(f"{KEY}/where/")}
  except Exception:  # pylint: disable=broad-except
    return []
  out = []
  for p in range(n):
    w = where.get(p)
    if p == pid or (w and w["at"] == name and not w["left"]):
      continue
    if w and not w["left"]:
      out.append(f"process {p} is waiting at '{w['at']}' instead: the processes reached "
                 "different barriers")
    elif w:
      out.append(f"process {p} has not arrived (last heard from {time.time() - w['t']:.0f} s "
                 f"ago, leaving '{w['at']}')")
    else:
      out.append(f"process {p} has not arrived (no fnscale wait heard from it yet)")
  return out


def notice_given(client, timeout_s: float = 1.0) -> bool:
  """Whether JAX's preemption sync manager published a notice (a SIGTERM to any process of
  the job). Bounded: the coordinator may be the frozen process, so the read runs in a helper
  thread and no answer within `timeout_s` counts as no notice."""
  got: list[bool] = []

  def read():
    with contextlib.suppress(Exception):  # NOT_FOUND: no notice
      client.key_value_try_get(_compat.PREEMPTION_NOTICE_KEY)
      got.append(True)

  helper = threading.Thread(target=read, daemon=True)
  helper.start()
  helper.join(timeout_s)
  return bool(got)


# (processes that arrived, ids of those that didn't) from a barrier's timeout error text.
barrier_absentees = _compat.barrier_absentees


def exit_with(error: DistributedError, status: int = EXIT_JOB_FAILED) -> None:
  """Ends this process from a helper thread (the main thread is blocked inside JAX's C++
  code, where no Python exception can reach it): the error on stderr, then `status`. A
  compile capturing stderr (`fnscale._compiler`) gives it back first, or the message would
  be lost in the capture file."""
  text = f"{type(error).__module__}.{type(error).__name__}: {error}"
  try:
    _compiler.release_stderr()
    _liveness.leave()  # on purpose: the others must not report this process lost
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
  finally:
    os._exit(status)  # pylint: disable=protected-access

