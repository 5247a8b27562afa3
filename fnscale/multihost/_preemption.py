"""Preemption: a notice (SIGTERM) becomes "save at step N and stop" on every process.

Spot and preemptible Cloud TPU VMs, GKE and SLURM announce the end of a job with SIGTERM a
little ahead (about 30 s on Cloud TPU and GKE's default grace period; under SLURM what
`--signal` asks for), delivered to the hosts at slightly different moments. The job has to
agree on one step everywhere, save it once and exit before the machines go.

  fnscale.initialize(config=flags)
  with preemption.preemption_guard() as should_stop, checkpoint.manager(directory) as ckpt:
    for step in range(start, steps):
      state, metrics = train(state, batch)
      if should_stop(step):                     # True on every process at the same step
        checkpoint.save(ckpt, step + 1, state)  # after a save still in flight has committed
        checkpoint.wait(ckpt)                   # committed before the process exits
        sys.exit(preemption.EXIT_PREEMPTED)    # 143: "preempted, restart me"

How it decides (jax 0.10.2, checked on CPU/gloo):
  * several processes: `jax.distributed.initialize` installs JAX's preemption notifier (a
    SIGTERM handler) in every process; the process that gets the notice publishes it through
    the coordination service, every process's sync manager reports its step, and
    `jax.experimental.multihost_utils.reached_preemption_sync_point(step)` is True on all of
    them at the same step (the largest step any process had reached, plus one). The notice
    reaches every process even when only one got the signal.
  * one process: a Python SIGTERM handler; `should_stop` is True at the next step.
  * a notice while the job waits instead of training: a watcher thread sees it (JAX's
    notice key in the coordination service, or the signal through `signal.set_wakeup_fd`)
    and, if the main thread is blocked in an fnscale wait (`barrier`, the check after
    `shard_step` compiles), ends the process at once with a `DistributedError` message and
    status 143, telling the others (they stop too: the agreed step can no longer be
    reached). Anywhere else (compiling, a slow data loader, a periodic checkpoint save) the
    job gets `grace_s` seconds from the notice to reach the agreed step and save it, after
    which the watcher ends it the same way. `initialize` ends at once on a notice while the
    job forms. Stopping, each process says so through the coordination service and waits
    a moment for the others to say so too; one that doesn't (frozen, killed) is named in
    the message as lost. Checkpoints are written atomically (`fnscale.checkpoint`), so an ended save
    leaves only a temporary directory that is never read: nothing half-written.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Callable, Iterator, NamedTuple

from absl import logging
import jax

from fnscale import _deprecation
from fnscale import _compat
from fnscale.multihost import _coordination as _co
from fnscale._errors import DistributedArgumentError, DistributedError

# 128 + SIGTERM, what a shell reports for a process ended by SIGTERM: schedulers (GKE Jobs,
# SLURM --requeue, a restart loop) treat it as "preempted", not "finished".
EXIT_PREEMPTED = 143
# From the notice to the end of the process at most (Cloud TPU and GKE give about 30 s).
DEFAULT_GRACE_S = 20.0
# Where JAX's preemption sync manager publishes a notice: the time it came.
_NOTICE_KEY = _compat.PREEMPTION_NOTICE_KEY
# Where a process that stopped without the agreed step says so (its id), and where each
# process that leaves for that reason checks out.
_ABORT_KEY = "fnscale/preemption/abort"
_LEFT_DIR = "fnscale/preemption/left/"
_LEAVE_S = 2.0
_POLL_S = 0.1


class _Guard(NamedTuple):
  """Shared between the main thread and the watcher."""
  notice: threading.Event  # a notice came (to this process or, several processes, any)
  stopping: threading.Event  # should_stop said True: the agreed save is under way
  closed: threading.Event
  noticed_at: list  # [time.monotonic() of the notice]


def _sync_point(step: int) -> bool:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.reached_preemption_sync_point(step))


def _leave(text: str, client=None, pid: int = 0, n: int = 1) -> None:
  """Ends this process with `text` and status 143. In a job, first says so (the others stop
  too) and waits, at most `_LEAVE_S`, until every process is leaving: the coordinator
  (process 0) going first would abort the others from C++ before they could say why. A
  process that doesn't leave in that time is named as lost (frozen, killed or gone)."""
  if client is not None:
    silent = _check_out(client, pid, n)
    if silent:
      named = (f"process{'es' if len(silent) > 1 else ''} {', '.join(map(str, silent))}")
      text = (f"lost {named} of {n}: no answer within {_LEAVE_S:g} s when process {pid} "
              f"stopped (frozen, killed, or its host is gone). {text} Fix: look at the log "
              f"of {named} for why it stopped, then restart every process (resume from the "
              "last checkpoint).")
  _co.exit_with(DistributedError(text), EXIT_PREEMPTED)


def _check_out(client, pid: int, n: int) -> list[int]:
  """Says through the coordination service that this process stops, then waits at most
  `_LEAVE_S` for every other process to say so too; returns those that didn't (the
  coordinator, process 0, when the service itself doesn't answer). Bounded even then: the
  calls run in a helper thread."""
  left: list[set] = []

  def check_out():
    client.key_value_set(_ABORT_KEY, str(pid), allow_overwrite=True)
    client.key_value_set(f"{_LEFT_DIR}{pid}", "1", allow_overwrite=True)
    deadline = time.monotonic() + _LEAVE_S
    while True:
      left[:] = [{int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(_LEFT_DIR)}]
      if len(left[0]) >= n or time.monotonic() > deadline:
        return
      time.sleep(_POLL_S / 2)

  helper = threading.Thread(target=check_out, daemon=True)
  helper.start()
  helper.join(_LEAVE_S + 2)
  if pid == 0:
    time.sleep(_POLL_S * 5)  # the others exit first
  if not left:
    return [0] if pid else []
  return sorted(set(range(n)) - left[0])


def _aborted_by(client) -> int | None:
  try:
    return int(client.key_value_try_get(_ABORT_KEY))
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND: nobody gave up)
    return None


def _after_notice(g: _Guard, grace_s: float, pid: int, n: int, client) -> None:
  """Ends this process when the notice can't lead to the agreed save: the main thread waits
  at an fnscale barrier, another process gave up, or `grace_s` passed."""
  while not g.closed.wait(_POLL_S):
    at = _co.WAIT["at"]
    if at is not None and not g.stopping.is_set():
      _leave(f"preemption notice while process {pid} waited at '{at}': the job can't reach "
             "a step to save, so it stops now without saving (resume from the last "
             f"checkpoint). Exiting with status {EXIT_PREEMPTED}.", client, pid, n)
    other = _aborted_by(client) if client is not None else None
    if other is not None and other != pid:
      _leave(f"preemption notice: process {other} stopped without saving (it was waiting "
             f"when the notice came), so process {pid} stops too (resume from the last "
             f"checkpoint). Exiting with status {EXIT_PREEMPTED}.", client, pid, n)
    if time.monotonic() - g.noticed_at[0] > grace_s:
      doing = "saving the agreed step" if g.stopping.is_set() else "reaching the agreed step"
      _leave(f"preemption notice {grace_s:g} s ago and process {pid} is still {doing} "
             "(a long compile, data wait or save); stopping now (an unfinished checkpoint "
             "stays a temporary directory that is never read). Exiting with status "
             f"{EXIT_PREEMPTED}; raise grace_s if the platform gives more time.", client, pid,
             n)


def _watch_service(g: _Guard, grace_s: float, client, pid: int, n: int) -> None:
  """Several processes: waits for JAX's notice key (set wherever the signal came)."""
  while not g.closed.is_set():
    other = _aborted_by(client)
    if other is not None:
      g.noticed_at[0] = time.monotonic()
      break
    try:
      client.blocking_key_value_get(_NOTICE_KEY, int(_POLL_S * 2000))
    except Exception:  # pylint: disable=broad-except  (no notice within the slice)
      continue
    g.noticed_at[0] = time.monotonic()
    break
  if g.closed.is_set():
    return
  g.notice.set()
  logging.warning("preemption notice: every process stops at the next agreed step")
  _after_notice(g, grace_s, pid, n, client)


def _sigterm_in_pipe(read_fd: int) -> bool | None:
  """Whether the signal wake-up pipe delivered a SIGTERM within a poll; None once the pipe
  is closed (its guard ended)."""
  try:
    ready, _, _ = select.select([read_fd], [], [], _POLL_S * 5)
    return signal.SIGTERM in (os.read(read_fd, 64) if ready else b"")
  except (OSError, ValueError):
    return None


def _watch_signal(g: _Guard, grace_s: float, read_fd: int) -> None:
  """One process: waits for SIGTERM through the signal wake-up pipe."""
  while not g.closed.is_set():
    got = _sigterm_in_pipe(read_fd)
    if got is None:
      return
    if got:
      if g.notice.is_set():
        _leave(f"a second SIGTERM: stopping now without saving. Exiting with status "
               f"{EXIT_PREEMPTED}.")
      g.noticed_at[0] = time.monotonic()
      g.notice.set()
      logging.warning("preemption notice (SIGTERM): stopping at the next step")
      threading.Thread(target=_after_notice, args=(g, grace_s, 0, 1, None),
                       daemon=True).start()


@contextlib.contextmanager
def _signal_pipe(g: _Guard, watch: Callable[[int], None], restore_handler: Callable[[], bool]):
  """A SIGTERM handler that records the notice, and a wake-up pipe that `watch(read_fd)`, in
  a thread, reads even while the main thread is inside C++ (compiling, waiting). On exit the
  old handler comes back where `restore_handler()` says so."""
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
  old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  watcher = threading.Thread(target=watch, args=(read_fd,), daemon=True)
  watcher.start()
  try:
    yield
  finally:
    g.closed.set()
    signal.set_wakeup_fd(old_fd)
    if restore_handler():
      signal.signal(signal.SIGTERM, old_handler)
    _close_after(watcher, read_fd, write_fd)


def _close_after(watcher: threading.Thread, read_fd: int, write_fd: int) -> None:
  """Wakes the watcher, waits for it to end, then closes the pipe. Closed under a watcher
  still in select(), the descriptor numbers go to the next files opened, and its read takes
  their first bytes (a metrics file read back with its first line cut)."""
  with contextlib.suppress(OSError):
    os.write(write_fd, b"\0")  # not a SIGTERM: the watcher sees `closed` and returns
  watcher.join(timeout=_POLL_S * 20)
  if not watcher.is_alive():  # else leave the pipe open: two descriptors, not wrong reads
    os.close(write_fd)
    os.close(read_fd)


def check_preemption_service() -> None:
  """Raises unless `preemption_guard` can work here: in a multi-process job it needs JAX's
  preemption service. Call it right after `fnscale.initialize` to learn that at start-up,
  not after the compile (the guard itself calls it too).

  Raises:
    DistributedError: several processes but the service is off (`jax_enable_preemption_service`
      false, e.g. from JAX_ENABLE_PREEMPTION_SERVICE=false in the environment).

  Examples:
    >>> import fnscale as fs
    >>> fs.multihost.check_preemption_service()  # one process: a Python handler serves
  """
  if _co.runtime() is None:
    return
  if not _compat.distributed_state().preemption_sync:
    env = os.environ.get("JAX_ENABLE_PREEMPTION_SERVICE")
    raise DistributedError(
        "preemption_guard needs JAX's preemption service in a multi-process job, and it is "
        "off (jax.config.jax_enable_preemption_service="
        f"{jax.config.jax_enable_preemption_service}, environment variable "
        f"JAX_ENABLE_PREEMPTION_SERVICE={env!r}); fix: unset JAX_ENABLE_PREEMPTION_SERVICE "
        "(or set it to true), or jax.config.update('jax_enable_preemption_service', True) "
        "before fnscale.initialize.")


@contextlib.contextmanager
def preemption_guard(*, grace_s: float = DEFAULT_GRACE_S) -> Iterator[Callable[[int], bool]]:
  """Turns a preemption notice into "save at step N and stop" on every process.

  Enter it after `fnscale.initialize`, in the main thread, around the training loop, and
  call the yielded `should_stop(step)` after every step with that step's index (every
  process, every step, the same indices everywhere, as JAX's sync point requires). It
  returns True on every process at the same step once any process got a notice: save a
  checkpoint for that step and exit with `EXIT_PREEMPTED`. It costs one check of a local
  flag per step (measured by `recipes/bench/preemption.py`).

  A notice while the main thread waits at an fnscale barrier ends the process at once, and
  if the agreed step isn't saved within `grace_s` seconds of the notice the process ends
  then (see the module docstring): a `DistributedError` message on stderr and status 143.

  Args:
    grace_s: seconds from the notice to the end of the process at most; keep it below what
      the platform gives (Cloud TPU and GKE: about 30 s; SLURM: the time in `--signal`).

  Yields:
    `should_stop(step: int) -> bool`.

  Raises:
    DistributedArgumentError: `grace_s` not a positive number; entered outside the main
      thread; a step that is not an int.
    DistributedError: several processes but JAX's coordination service is not up
      (`fnscale.initialize` was not called) or its preemption service is off
      (`jax_enable_preemption_service`).

  Examples:
    One process: a SIGTERM makes `should_stop` True at the next step.

    >>> import fnscale as fs, os, signal, time
    >>> with fs.multihost.preemption_guard(grace_s=20) as should_stop:
    ...   os.kill(os.getpid(), signal.SIGTERM)  # the notice: this process keeps running
    ...   for step in range(10_000):  # the training loop
    ...     time.sleep(0.001)
    ...     if should_stop(step):
    ...       break  # save step + 1, then exit with fs.multihost.EXIT_PREEMPTED (143)
    >>> step < 10_000
    True
  """
  if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s <= 0:
    raise DistributedArgumentError(f"preemption_guard grace_s={grace_s!r}, expected a positive "
                                   "number of seconds below the platform's notice (about 30 s).")
  if threading.current_thread() is not threading.main_thread():
    raise DistributedArgumentError("preemption_guard must be entered in the main thread "
                                   "(Python sets signal handlers only there); fix: wrap the "
                                   "training loop of the main thread.")
  g = _Guard(threading.Event(), threading.Event(), threading.Event(), [0.0])
  rt = _co.job_runtime("preemption_guard")
  check_preemption_service()

  def should_stop(step: int) -> bool:
    if isinstance(step, bool) or not isinstance(step, int):
      raise DistributedArgumentError(f"should_stop(step={step!r}): expected the int index of "
                                     "the step just done, the same on every process.")
    stop = _sync_point(step) if rt is not None else g.notice.is_set()
    if stop and not g.stopping.is_set():
      g.stopping.set()
      logging.warning("preemption: every process stops after step %d", step)
    return stop

  if rt is not None:
    client, pid, n = rt
    watcher = threading.Thread(target=_watch_service, args=(g, grace_s, client, pid, n),
                               daemon=True)
    watcher.start()
    try:
      yield should_stop
    finally:
      # Joined, not left running: a daemon thread inside a jaxlib call while Python shuts
      # down aborts the process ("FATAL: exception not rethrown").
      g.closed.set()
      watcher.join(timeout=5)
    return
  with _signal_pipe(g, lambda read_fd: _watch_signal(g, grace_s, read_fd), lambda: True):
    yield should_stop


@contextlib.contextmanager
def _sigterm_ends_join(describe: Callable[[], str]):
  """While `jax.distributed.initialize` blocks (the job forming), SIGTERM ends the process
  at once with `describe()`'s message and status 143. JAX's own notifier takes SIGTERM over
  when the join succeeds; without it (service off or failure) the old handler comes back."""
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set from the main thread
    return
  g = _Guard(threading.Event(), threading.Event(), threading.Event(), [0.0])

  def watch(read_fd):
    while not g.closed.is_set():
      got = _sigterm_in_pipe(read_fd)
      if got is None:
        return
      if got and not g.closed.is_set():
        _leave(describe())

  with _signal_pipe(g, watch, lambda: not _compat.distributed_state().preemption_sync):
    yield


__getattr__ = _deprecation.moved(__name__, {
    "check_service": ("fnscale.multihost:check_preemption_service",
                      "fnscale.multihost.check_preemption_service")})
