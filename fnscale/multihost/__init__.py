"""Multi-process jobs: join the job, agree, wait, survive preemption, assemble global batches.

One process per host joins one job through JAX's coordination service (`fnscale.initialize`);
every wait on another process is bounded and a lost or disagreeing peer is a
`DistributedError` naming it, never a hang. `fnscale.barrier`, `agree_on_step` (every process
compiled the same step), `peer_guard` (a collective that failed because a peer died),
`preemption_guard` (a SIGTERM becomes "save and exit 143" on every process) and
`fnscale.global_batch` (the rows `fnscale.process_rows` names as global `jax.Array`s; rows
replicated across processes checked to agree) are the parts a training loop calls. The four
a single-process loop calls too (`initialize`, `barrier`, `global_batch`, `process_rows`) are
the package root's names; this namespace holds the rest.

Layer: imports the core pipeline (`fnscale.*` modules at the package root) only; never
`fnscale.checkpoint`, `fnscale.analysis` or the package root.

Examples:
  The exit statuses a launcher reads (`recipes/launch`: 143 and 75 restart the job from its
  newest checkpoint) and the default bounds, in seconds, of every wait:

  >>> import fnscale as fs
  >>> fs.multihost.EXIT_PREEMPTED, fs.multihost.EXIT_JOB_FAILED
  (143, 75)
  >>> (fs.multihost.DEFAULT_TIMEOUT_S, fs.multihost.DEFAULT_HEARTBEAT_TIMEOUT_S,
  ...  fs.multihost.DEFAULT_SHUTDOWN_TIMEOUT_S, fs.multihost.DEFAULT_PEER_CHECK_TIMEOUT_S,
  ...  fs.multihost.DEFAULT_GRACE_S)
  (300, 100, 300, 10, 20.0)
"""
from fnscale import _deprecation
from fnscale.multihost._agreement import agree_on_step
from fnscale.multihost._cluster import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DistributedInfo,
)
from fnscale.multihost._coordination import DEFAULT_TIMEOUT_S, EXIT_JOB_FAILED
from fnscale.multihost._global_batch import check_batch_replicas
from fnscale.multihost._peer_loss import DEFAULT_PEER_CHECK_TIMEOUT_S, peer_guard
from fnscale.multihost._preemption import (DEFAULT_GRACE_S, EXIT_PREEMPTED,
                                           check_preemption_service, preemption_guard)

__all__ = [
    "DistributedInfo", "DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S", "EXIT_JOB_FAILED",
    "agree_on_step", "peer_guard", "DEFAULT_PEER_CHECK_TIMEOUT_S", "check_batch_replicas",
    "preemption_guard", "check_preemption_service", "EXIT_PREEMPTED", "DEFAULT_GRACE_S",
]

_ROOT = "fnscale.{0} (a single-process loop calls it too: the package root's name)"
__getattr__ = _deprecation.moved(__name__, {
    "initialize": ("fnscale:initialize", _ROOT.format("initialize")),
    "barrier": ("fnscale:barrier", _ROOT.format("barrier")),
    "global_batch": ("fnscale:global_batch", _ROOT.format("global_batch")),
    "process_rows": ("fnscale:process_rows", _ROOT.format("process_rows")),
    "cluster": ("fnscale.multihost._cluster", "fnscale.initialize, "
                "fnscale.multihost.DistributedInfo"),
    "preemption": ("fnscale.multihost._preemption", "fnscale.multihost.preemption_guard, "
                   ".check_preemption_service, .EXIT_PREEMPTED, .DEFAULT_GRACE_S"),
})
