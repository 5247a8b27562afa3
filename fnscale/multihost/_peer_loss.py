"""Lost peers: `peer_guard` names a process that died instead of leaving a hang or a bare
collective error.

How a job ends when a process dies (measured with jax 0.10.2 and 0.12, CPU/gloo collectives):
  * with jax 0.10.2 the survivors' next collective usually fails at once ("Gloo AllGather
    failed: ... Connection closed by peer"); inside `peer_guard` that becomes a
    `DistributedError` naming the processes that no longer answer;
  * with jax 0.12 (and NCCL) it blocks instead; inside `peer_guard` a helper thread sees the
    dead process's signs of life stop (`fnscale.multihost._liveness`) and ends each survivor with the
    same kind of `DistributedError` and status 75 (143 once a preemption notice came: the
    lost process was most likely preempted too), `timeout_s` after;
  * a survivor blocked elsewhere is ended by JAX itself, from C++, `heartbeat_timeout_s`
    after the last heartbeat of the dead process: SIGABRT (exit status 134 / -6) with
    "Terminating process because the JAX distributed service detected fatal errors ...
    The following tasks are unhealthy (stopped sending heartbeats): <ids>" on stderr.
    jaxlib offers no working Python hook for that moment, so fnscale can't raise there.

`fnscale.multihost` re-exports `peer_guard` and `DEFAULT_PEER_CHECK_TIMEOUT_S`.
"""
from __future__ import annotations

import contextlib

import jax

from fnscale import _compat
from fnscale.multihost import _coordination as _co
from fnscale.multihost import _liveness
from fnscale.multihost import _preemption as preemption
from fnscale.multihost._coordination import EXIT_JOB_FAILED
from fnscale._errors import DistributedArgumentError, DistributedError

# Seconds `peer_guard` gives the other processes to check in (and to show signs of life).
DEFAULT_PEER_CHECK_TIMEOUT_S = 10
_LOST_FIX = (" The job can't go on: every collective needs every process. Fix: look at the "
             "log of {named} for why it stopped (killed, out of memory, preempted, crashed), "
             "then restart every process; resume from the last checkpoint "
             "(fnscale.checkpoint.latest_step).")


def _processes(ids: list[int]) -> str:
  return ("an unknown process" if ids == [-1] else
          f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}")


def _lost_processes(timeout_s: float) -> tuple[list[int], str]:
  """Which processes don't reach a bounded check-in barrier: (ids, the runtime's words)."""
  st = _compat.distributed_state()
  try:
    st.client.wait_at_barrier("fnscale:peer-check", max(1, int(timeout_s * 1000)))
  except Exception as e:  # pylint: disable=broad-except
    _, missing = _co.barrier_absentees(str(e))
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return missing or [-1], first
  return [], ""


@contextlib.contextmanager
def peer_guard(*, timeout_s: float = DEFAULT_PEER_CHECK_TIMEOUT_S):
  """Turns a collective that fails because another process died into a `DistributedError`.

  Wrap the training loop (where step results are read, e.g. `float(metrics["loss"])`):

    with fnscale.peer_guard(timeout_s=10):
      for batch in batches:
        state, metrics = step(state, batch)
        print(float(metrics["loss"]))

  When the block raises a runtime error from JAX (a failed all-reduce, an unreachable
  coordination service) in a multi-process job, every surviving process checks in at a
  barrier for at most `timeout_s` seconds; those that don't arrive are named. Errors of
  other kinds, or when every process checks in, pass through unchanged. A collective that
  blocks on the dead process instead of failing (jax 0.12's gloo, NCCL) is covered by a
  helper thread (`fnscale.multihost._liveness`): every process inside `peer_guard` shows signs of life
  in the coordination service, and one silent for `timeout_s` seconds ends the others with
  the same error on stderr and status 75 (`EXIT_JOB_FAILED`), or 143
  (`fnscale.multihost.EXIT_PREEMPTED`) once a preemption notice came to any process (the
  lost process is then most likely preempted too). In one process it does nothing.

  Keep `timeout_s` below `initialize`'s `heartbeat_timeout_s`: once the coordination service
  notices the missing heartbeats, JAX ends every process at once from C++ (see
  `fnscale.multihost._peer_loss`), before this check can report.

  Raises:
    DistributedArgumentError: a timeout that isn't a positive number.
    DistributedError: "lost process(es) [1] of 2 ...", chained from the runtime's error; or,
      on entry, several processes without JAX's coordination service (`fnscale.initialize`
      was not called).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> with fs.multihost.peer_guard(timeout_s=10):  # one process: nothing to watch
    ...   float(jnp.ones(4).sum())
    4.0
  """
  if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
    raise DistributedArgumentError(
        f"peer_guard timeout_s={timeout_s!r}, expected a positive number of seconds below "
        "initialize's heartbeat_timeout_s.")
  rt = _co.job_runtime("peer_guard")

  def silent(missing):  # from the watcher thread: the main thread may be blocked in C++
    # After a preemption notice a lost peer is most likely that preemption: the job was
    # preempted (status 143, "restart me"), not broken.
    preempted = _co.notice_given(rt[0])
    _co.exit_with(DistributedError(
        f"lost {_processes(missing)} of {rt[2]}: {_processes(missing)} gave no sign of life "
        f"for {timeout_s} s while process {rt[1]} ran inside peer_guard"
        f"{' after a preemption notice' if preempted else ''} (a collective waiting "
        "for a lost process blocks instead of failing), so process "
        f"{rt[1]} stops now, before JAX's coordination service would abort it."
        + _LOST_FIX.format(named=_processes(missing))),
        preemption.EXIT_PREEMPTED if preempted else EXIT_JOB_FAILED)

  try:
    with _liveness.watch(*rt[:2], timeout_s, silent) if rt else contextlib.nullcontext():
      yield
  except Exception as e:  # pylint: disable=broad-except
    if (isinstance(e, DistributedError) or not jax.distributed.is_initialized()
        or not _compat.is_peer_failure(f"{type(e).__name__} {e}")):
      raise
    st = _compat.distributed_state()
    if (st.num_processes or 1) == 1:
      raise
    missing, words = _lost_processes(timeout_s)
    if not missing:
      raise
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    named = _processes(missing)
    raise DistributedError(
        f"lost {named} of {st.num_processes}: a collective failed in process "
        f"{st.process_id} ({type(e).__name__}: {first}) and {named} did not check in within "
        f"{timeout_s} s ({words})." + _LOST_FIX.format(named=named)) from e
