"""Multi-process jobs: join the job, agree, wait, survive preemption, assemble global batches.

One process per host joins one job through JAX's coordination service (`initialize`); every
wait on another process is bounded and a lost or disagreeing peer is a `DistributedError`
naming it, never a hang. `barrier`, `agree_on_step` (every process compiled the same step),
`peer_guard` (a collective that failed because a peer died), `preemption` (a SIGTERM becomes
"save and exit 143" on every process) and `global_batch` (the rows `process_rows` names
as global `jax.Array`s; rows replicated across processes checked to agree) are the parts a
training loop calls.

Layer: imports the core pipeline (`fnscale.*` modules at the package root) only; never
`fnscale.checkpoint`, `fnscale.analysis` or the package root.
"""
from fnscale.multihost._agreement import agree_on_step, barrier
from fnscale.multihost._coordination import DEFAULT_TIMEOUT_S, EXIT_JOB_FAILED
from fnscale.multihost._global_batch import check_batch_replicas, global_batch, process_rows
from fnscale.multihost._peer_loss import DEFAULT_PEER_CHECK_TIMEOUT_S, peer_guard
from fnscale.multihost import _preemption as preemption
from fnscale.multihost._cluster import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DistributedInfo,
    initialize,
)

__all__ = [
    "initialize", "DistributedInfo", "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_SHUTDOWN_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "EXIT_JOB_FAILED",
    "barrier", "agree_on_step", "peer_guard", "DEFAULT_PEER_CHECK_TIMEOUT_S",
    "global_batch", "process_rows", "check_batch_replicas", "preemption",
]
