"""Signs of life between the processes of a job, read while the main thread may be blocked.

A collective whose peer process died either fails at once (jax 0.10.2's gloo all-gather:
"Connection closed by peer") or blocks (jax 0.12's gloo; NCCL on GPUs) until JAX's
coordination service misses the dead process's heartbeats and ends every process from C++,
`heartbeat_timeout_s` later, without saying why in Python. `watch` covers the second case:
a thread publishes a counter under `fnscale/alive/<process id>` in the coordination
service's key-value store four times per `timeout_s` and reads everyone's; a process whose
counter has not moved for `timeout_s` seconds is lost.

A process ending on purpose (a normal end of the watched block, or fnscale's own exit with a
message: `leave`) writes "left" instead, so no one reports it lost. One that raises out of
the block doesn't: it is gone, and the others say so.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from fnscale import _compat

_DIR = "fnscale/alive/"
_LEFT = "left"
# This process published signs of life (only then do others judge it, and only then is its
# client surely connected: a half-formed one aborts the process when called).
_PUBLISHED = threading.Event()
# This process is ending on purpose: its watcher publishes no more counters (the lock keeps
# a counter from landing after "left").
_LEAVING = threading.Event()
_PUBLISH = threading.Lock()


def _publish(client, pid: int, value: str) -> None:
  with _PUBLISH:
    if value == _LEFT or not _LEAVING.is_set():
      client.key_value_set(f"{_DIR}{pid}", value, allow_overwrite=True)
      _PUBLISHED.set()


def _entries(client) -> dict[int, str]:
  return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(_DIR)}


def leave() -> None:
  """Marks this process as ending on purpose (fnscale's own exits call it)."""
  _LEAVING.set()
  if not _PUBLISHED.is_set():
    return  # no one judges this process (and its client may not be connected yet)
  st = _compat.distributed_state()
  if st.client is not None:
    with contextlib.suppress(Exception):  # the coordination service may be gone already
      _publish(st.client, st.process_id, _LEFT)


def silent(heard: dict[int, tuple[str, float]], values: dict[int, str], now: float,
           timeout_s: float) -> list[int]:
  """Updates `heard` ({process: (value, time it last changed)}) with the `values` just read
  and returns the processes whose value has not changed for more than `timeout_s`, in
  order; processes that left are not judged."""
  for p, v in values.items():
    if p not in heard or heard[p][0] != v:
      heard[p] = (v, now)
  return sorted(p for p, (v, t) in heard.items() if v != _LEFT and now - t > timeout_s)


@contextlib.contextmanager
def watch(client, pid: int, timeout_s: float, on_lost: Callable[[list[int]], None]):
  """While the block runs, publishes this process's signs of life and calls `on_lost(ids)`,
  once, from a helper thread, when other processes that published stop for `timeout_s`
  seconds ([0], the coordinator, when the key-value store can't be reached that long).
  Processes that never entered a `watch`, or left theirs, are not judged."""
  closed = threading.Event()

  def run():
    heard: dict[int, tuple[str, float]] = {}
    reached, count = time.monotonic(), 0
    while not closed.is_set():
      now = time.monotonic()
      try:
        _publish(client, pid, str(count))
        values = _entries(client)
        reached, count = now, count + 1
      except Exception:  # pylint: disable=broad-except  (the store is unreachable)
        if now - reached > timeout_s and not closed.is_set():
          on_lost([0])
          return
        values = {}
      values.pop(pid, None)
      lost = silent(heard, values, now, timeout_s)
      if lost and not closed.is_set():
        on_lost(lost)
        return
      closed.wait(timeout_s / 4)

  thread = threading.Thread(target=run, daemon=True, name="fnscale-liveness")
  thread.start()
  ended = False
  try:
    yield
    ended = True
  finally:
    closed.set()
    # Joined, not left running: a daemon thread inside a jaxlib call while Python shuts down
    # aborts the process.
    thread.join(timeout=timeout_s / 4 + 5)
    if ended:
      with contextlib.suppress(Exception):
        _publish(client, pid, _LEFT)
