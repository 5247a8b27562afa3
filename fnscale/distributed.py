"""Multi-process helpers: join the job, wait for every process, assemble global batches.

`initialize` wraps `jax.distributed.initialize` (JAX's coordination service: one process runs
the coordinator, every process connects to it), bounding every wait and turning failures
into `DistributedError`s that say what was expected. Processes that disagree are named in
seconds: `initialize` compares versions, local devices and the caller's config, and
`agree_on_step` (the barrier a job calls after `shard_step(...).compile`) compares what each
compiled, both through the coordination service's key-value store. `barrier` is a bounded
wait on that service. `peer_guard` turns a collective that failed because another process
died into a `DistributedError` naming it. `global_batch` turns each process's slice of a batch into
global `jax.Array`s (`jax.make_array_from_process_local_data`).

How a job ends when a process dies (measured with jax 0.10.2 and 0.12, CPU/gloo collectives):
  * with jax 0.10.2 the survivors' next collective usually fails at once ("Gloo all-gather
    failed ... Connection closed by peer"); inside `peer_guard` that becomes a
    `DistributedError` naming the processes that no longer answer;
  * with jax 0.12 (and NCCL) it blocks instead; inside `peer_guard` a helper thread sees the
    dead process's signs of life stop (`fnscale._liveness`) and ends each survivor with the
    same kind of `DistributedError` and status 75, `timeout_s` after;
  * a survivor blocked elsewhere is ended by JAX itself, from C++, `heartbeat_timeout_s`
    after the last heartbeat of the dead process: SIGABRT (exit status 134 / -6) with
    "Terminating process because the JAX distributed service detected fatal errors ...
    The following tasks are unhealthy (stopped sending heartbeats): <ids>" on stderr.
    jaxlib offers no working Python hook for that moment, so fnscale can't raise there.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import numbers
import os
import re
import socket
import threading
import time
from importlib import metadata
import pathlib
from typing import Any, Mapping, NamedTuple

from absl import logging
import jax
from jax.sharding import NamedSharding
import numpy as np

from fnscale import _agreement as _ag
from fnscale import _compat
from fnscale import _coordination as _co
from fnscale import _liveness
from fnscale import _rollcall
from fnscale import checkpoint
from fnscale import compile as _compile
from fnscale import preemption
from fnscale._coordination import DEFAULT_TIMEOUT_S, EXIT_JOB_FAILED
from fnscale.errors import DistributedArgumentError, DistributedError, FnscaleError
from fnscale.errors import ShardingError
from fnscale._tree import entry_axes as _entry_axes
from fnscale._tree import leaf_shardings as _broadcast_shardings
from fnscale._tree import path_str

DEFAULT_HEARTBEAT_TIMEOUT_S = 100
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
DEFAULT_PEER_CHECK_TIMEOUT_S = 10
# JAX's own join deadline runs this much past fnscale's, so fnscale's message comes first.
_JOIN_GRACE_S = 10


class DistributedInfo(NamedTuple):
  """Where this process stands: `process_id` of `num_processes`, the coordinator's
  "host:port" (None when single-process) and whether JAX's distributed runtime is up."""
  process_id: int
  num_processes: int
  coordinator_address: str | None
  initialized: bool


def _int_env(name: str) -> int:
  try:
    return int(os.environ.get(name, "0") or 0)
  except ValueError:
    return 0


def _multiprocess_env() -> str | None:
  """The launcher that says this is a multi-process job, judged from the environment only
  (no network calls), or None."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  if os.environ.get("SLURM_JOB_ID") and max(_int_env("SLURM_NTASKS"),
                                             _int_env("SLURM_NPROCS")) > 1:
    return "SLURM"
  if os.environ.get("OMPI_MCA_orte_hnp_uri") and _int_env("OMPI_COMM_WORLD_SIZE") > 1:
    return "Open MPI"
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([h for h in hosts.split(",") if h.strip()]) > 1:
    return "TPU pod (TPU_WORKER_HOSTNAMES)"
  if _int_env("MEGASCALE_NUM_SLICES") > 1:
    return "multi-slice TPU (MEGASCALE_NUM_SLICES)"
  return None


def _metadata_launcher(timeout_s: float = 2.0) -> str | None:
  """A Cloud TPU VM whose metadata service lists several workers (the hosts of a multi-host
  slice, or of several slices), read as fnscale's topology detection reads it; None
  elsewhere. Asked only on a TPU VM or where GCE_METADATA_HOST names a server. (`gcloud
  compute tpus tpu-vm create` VMs keep the worker id and hosts there, not in the environment.)
  """
  from fnscale import _metadata, topology  # pylint: disable=g-import-not-at-top
  from fnscale.errors import TopologyError  # pylint: disable=g-import-not-at-top
  if not topology._on_tpu_vm(os.environ):  # pylint: disable=protected-access
    return None
  try:
    facts = topology._metadata_facts(  # pylint: disable=protected-access
        timeout_s, _metadata.base_url())
  except TopologyError as e:
    raise DistributedError(f"can't tell from the Cloud TPU metadata service whether this is "
                           f"one of several hosts: {e}") from None
  (per, src), (slices, _) = (facts.get("processes_per_slice", (1, "")),
                             facts.get("num_slices", (1, "")))
  if per * slices < 2:
    return None
  return (f"Cloud TPU VM: {per} worker(s) per slice in {src.removeprefix('metadata:')}"
          + (f" x {slices} slices" if slices > 1 else ""))


def _detect(coordinator_address, num_processes, process_id, method, launcher, timeout_s):
  """JAX's own cluster detection, as `jax.distributed.initialize` runs it for what it isn't
  given (Cloud TPU VMs and GKE, SLURM, Open MPI, ...): (coordinator, processes, this id, the
  coordinator as messages name it, seconds left of `timeout_s`)."""
  if None not in (coordinator_address, num_processes, process_id) or method == "deactivate":
    return (coordinator_address, num_processes, process_id,
            coordinator_address or f"auto-detected ({launcher})", timeout_s)
  t0 = time.monotonic()
  try:
    coordinator_address, num_processes, process_id = _compat.detect_cluster(
        coordinator_address, num_processes, process_id, method, max(1, math.ceil(timeout_s)))
  except FnscaleError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"JAX's cluster detection failed for this multi-process launch ({launcher}): "
        f"{type(e).__name__}: {first}; fix: pass coordinator_address, num_processes and "
        "process_id to fnscale.initialize (or set JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES and JAX_PROCESS_ID).") from e
  unknown = [k for k, v in (("coordinator_address", coordinator_address),
                            ("num_processes", num_processes), ("process_id", process_id))
             if v is None]
  if unknown:
    raise DistributedError(
        f"this looks like a multi-process launch ({launcher}), but JAX's cluster detection "
        f"could not tell {', '.join(unknown)}; fix: pass them to fnscale.initialize (or set "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID).")
  return (coordinator_address, num_processes, process_id,
          f"{coordinator_address} (found through {launcher})",
          max(1.0, timeout_s - (time.monotonic() - t0)))


def _from_env(coordinator_address, num_processes, process_id):
  """Fills arguments not given from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
  JAX_PROCESS_ID, the variables `recipes/launch_local.py` (or a user's own launcher) sets."""
  def env_int(name, value):
    if value is not None or not os.environ.get(name):
      return value
    try:
      return int(os.environ[name])
    except ValueError:
      raise DistributedArgumentError(f"{name}={os.environ[name]!r} is not an integer; fix: set "
                                     "it to a whole number or unset it.") from None
  if coordinator_address is None:
    coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  return (coordinator_address, env_int("JAX_NUM_PROCESSES", num_processes),
          env_int("JAX_PROCESS_ID", process_id))


def _state_info() -> DistributedInfo:
  st = _compat.distributed_state()
  return DistributedInfo(int(st.process_id), int(st.num_processes or 1),
                         st.coordinator_address, True)


def _backends_initialized() -> bool:
  return _compat.backends_initialized()


def _plain_int(value):
  """An integer of another type (numpy's np.int64, from a launcher's arithmetic) as the int
  it is; anything else (bools included) unchanged, for `_check_args` to name."""
  if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
    return int(value)
  return value


def _check_args(coordinator_address, num_processes, process_id, timeouts) -> None:
  if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
    raise DistributedArgumentError(
        f"num_processes={num_processes!r}, expected a positive int; fix: pass the number of "
        "processes in the job.")
  if process_id is not None:
    if isinstance(process_id, bool) or not isinstance(process_id, int) or process_id < 0 or (
        num_processes is not None and process_id >= num_processes):
      raise DistributedArgumentError(
          f"process_id={process_id!r}, expected an int in [0, {num_processes}); fix: number "
          "the processes 0..num_processes-1, one id each.")
  if coordinator_address is not None:
    host, sep, port = str(coordinator_address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise DistributedArgumentError(
          f"coordinator_address={coordinator_address!r}, expected 'host:port' (e.g. "
          "'10.0.0.1:1234'); fix: give process 0's address and a free port.")
  for name, value in timeouts.items():
    if not isinstance(value, (int, float)) or value <= 0:
      raise DistributedArgumentError(
          f"{name}={value!r}, expected a positive number of seconds.")


def _wait_for_coordinator(address: str, timeout_s: float) -> float | None:
  """Seconds until `address` accepted a TCP connection, or None if it didn't in time."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  start = time.monotonic()
  while True:
    left = timeout_s - (time.monotonic() - start)
    if left <= 0:
      return None
    try:
      with socket.create_connection((host, int(port)), timeout=min(1.0, left)):
        return time.monotonic() - start
    except OSError:
      time.sleep(min(0.2, max(0.0, timeout_s - (time.monotonic() - start))))




def _join_timed_out(num_processes, process_id, where, timeout_s) -> None:
  _co.exit_with(DistributedError(
      f"could not form the multi-process job within {timeout_s:g} s: expected "
      f"{num_processes or 'auto-detected'} processes at coordinator {where}; this process "
      f"({process_id if process_id is not None else '?'}) is in, but not all "
      f"{num_processes or ''} processes registered (JAX's coordination service doesn't say "
      "which are missing: those whose logs lack this message never joined); fix: start every "
      "process of the job with the same coordinator_address and num_processes and a distinct "
      "process_id, or raise timeout_s if some start slowly. Exiting with status "
      f"{EXIT_JOB_FAILED}."))


def _join(coordinator_address, num_processes, process_id, where, timeout_s, asked_timeout_s,
          jax_args) -> DistributedInfo:
  """`jax.distributed.initialize`, bounded by a watchdog; failures as DistributedErrors."""
  logging.info("fnscale.initialize: joining a %s-process job at %s as process %s; waiting at "
               "most %s s (JAX ends the process if the job can't form in time)",
               num_processes or "detected", where,
               process_id if process_id is not None else "detected", timeout_s)
  # When process 0 is up but some process never registers, JAX ends every waiting process
  # from C++ (a fatal log, no exception). A watchdog thread ends it first, with a clear
  # message, after timeout_s; JAX's own deadline is set a little later.
  watchdog = threading.Timer(timeout_s, _join_timed_out, args=(
      num_processes, process_id, where, asked_timeout_s))
  watchdog.daemon = True
  watchdog.start()
  try:
    with preemption._sigterm_ends_join(lambda: (  # pylint: disable=protected-access
        f"preemption notice (SIGTERM) while the {num_processes or 'detected'}-process job "
        f"was forming at {where} (this is process {process_id}): stopping now, nothing has "
        f"run. Exiting with status {preemption.EXIT_PREEMPTED}.")):
      jax.distributed.initialize(
          coordinator_address=coordinator_address, num_processes=num_processes,
          process_id=process_id,
          initialization_timeout=max(1, math.ceil(timeout_s)) + _JOIN_GRACE_S, **jax_args)
  except Exception as e:  # pylint: disable=broad-except
    watchdog.cancel()
    # Leave no half-built client behind, so a retry starts clean.
    try:
      jax.distributed.shutdown()
    except Exception:  # pylint: disable=broad-except
      pass
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"could not form the multi-process job: expected {num_processes or 'auto-detected'} "
        f"processes, this one as process {process_id if process_id is not None else '?'}, "
        f"coordinator {where}, within {timeout_s} s ({type(e).__name__}: {first}); fix: start "
        "every process with the same coordinator_address and num_processes and distinct "
        "process_id, make sure process 0 is running and its port is reachable and free, or "
        "raise timeout_s.") from e
  watchdog.cancel()
  info = _state_info()
  logging.info("fnscale.initialize: process %d of %d, coordinator %s", info.process_id,
               info.num_processes, info.coordinator_address)
  return info


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               cluster_detection_method: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S,
               heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
               config: Mapping[str, Any] | None = None) -> DistributedInfo:
  """Joins this process to a multi-process JAX job (`jax.distributed.initialize`).

  Call it first, before anything touches jax devices. Either give `coordinator_address`
  ("host:port" of process 0), `num_processes` and `process_id` (each not given is read from
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` when set), or nothing and
  let JAX's cluster detection supply them (Cloud TPU VMs and GKE, SLURM, Open MPI; or pass
  `cluster_detection_method`).

  With no argument it joins whenever this process is one of several: the environment shows
  a launcher (`JAX_COORDINATOR_ADDRESS`, SLURM with several tasks, Open MPI with several
  ranks, `TPU_WORKER_HOSTNAMES` with several hosts, `MEGASCALE_NUM_SLICES` > 1), or, on a
  Cloud TPU VM, the metadata service lists several workers (`worker-network-endpoints`,
  `tpu-env`), as `gcloud compute tpus tpu-vm create` VMs have it; JAX's Cloud TPU detection
  then names worker 0 as the coordinator. It is a no-op when `num_processes == 1`, or when
  none of those shows several processes (so a single-host script runs unchanged), and when
  the runtime is already up with the same arguments (idempotent).

  Args:
    coordinator_address: "host:port" of process 0's coordination service.
    num_processes: processes in the job.
    process_id: this process's id in [0, num_processes).
    local_device_ids: restrict this process to these local devices.
    cluster_detection_method: passed to JAX ("slurm", "ompi", "mpi4py", "deactivate"...).
    timeout_s: seconds to wait for every process to connect (bounded; JAX retries within it).
      If process 0 is up but not every process registers in time, JAX would end this
      process from C++ without a word on who is missing; fnscale ends it first: the
      `DistributedError` text on stderr and exit status 75 (`EXIT_JOB_FAILED`).
    heartbeat_timeout_s: seconds without a heartbeat after which a process counts as dead;
      JAX then ends every other process (SIGABRT, a fatal log naming the dead process).
    shutdown_timeout_s: seconds a finishing process waits for the others at exit.
    config: what else must agree across processes, e.g. a recipe's flags
      (`{"model": "nano", "steps": 20}`); values are compared as `str(value)`.

  Once joined, every process publishes its jax, jaxlib, libtpu and fnscale versions (and a
  digest of fnscale's source files), its local device count and kind and `config` through
  JAX's coordination service, and all compare: a difference is a `DistributedError` on
  every process naming it ("process 1 has --model=tiny, process 0 --model=nano").

  Before joining, a roll call (`fnscale._rollcall`: process 0 listens at the coordinator's
  port + 1, `FNSCALE_ROLLCALL_PORT` moves it, "off" skips it) names a `process_id` given to
  two processes, on every process, within seconds.

  A SIGTERM (preemption notice) while the job forms ends the process at once: the message
  on stderr, status 143 (`fnscale.preemption.EXIT_PREEMPTED`).

  Returns:
    A `DistributedInfo`.

  Raises:
    DistributedArgumentError: a malformed `num_processes`, `process_id` or
      `coordinator_address` (given or read from the `JAX_*` variables), a timeout that isn't a
      positive number of seconds, or a `config` that isn't a mapping of str names.
    DistributedError: already initialised with different arguments; called
      after jax initialised its backend; the job couldn't form within `timeout_s` (the
      message names the expected process count, the coordinator and the fix; JAX 0.10.2
      can't tell which processes are missing before all joined); a `process_id` given to
      several processes (named with their hosts and pids); or processes that disagree on
      versions, devices or `config`.
  """
  timeouts = {"timeout_s": timeout_s, "heartbeat_timeout_s": heartbeat_timeout_s,
              "shutdown_timeout_s": shutdown_timeout_s}
  coordinator_address, num_processes, process_id = _from_env(
      coordinator_address, num_processes, process_id)
  num_processes, process_id = _plain_int(num_processes), _plain_int(process_id)
  _check_args(coordinator_address, num_processes, process_id, timeouts)
  config_facts = _check_config(config)
  asked_timeout_s = timeout_s
  if jax.distributed.is_initialized():
    info = _state_info()
    asked = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    have = info._asdict()
    diff = {k: v for k, v in asked.items() if v is not None and v != have[k]}
    if diff:
      raise DistributedError(
          f"jax.distributed is already initialised as process {info.process_id} of "
          f"{info.num_processes} (coordinator {info.coordinator_address}), but now asked for "
          f"{diff}; fix: call fnscale.initialize once per process with the same arguments.")
    logging.info("fnscale.initialize: already initialised (%s)", info)
    return info
  if num_processes == 1:
    logging.info("fnscale.initialize: num_processes=1, nothing to do")
    return DistributedInfo(0, 1, None, False)
  explicit = any(v is not None for v in (coordinator_address, num_processes, process_id,
                                          cluster_detection_method))
  launcher, method = _multiprocess_env(), cluster_detection_method
  if not explicit and launcher is None:
    launcher, method = _metadata_launcher(), "gcetpu"
  if not explicit and launcher is None:
    logging.info("fnscale.initialize: no multi-process launcher detected; single process")
    return DistributedInfo(0, 1, None, False)
  if _backends_initialized():
    raise DistributedError(
        "fnscale.initialize was called after jax initialised its backend (some earlier call "
        "used jax devices or ran a computation), so this process can't join the "
        f"{num_processes or 'detected'}-process job at {coordinator_address or 'auto'}; fix: "
        "call fnscale.initialize at the very start of the program, before any other jax use.")
  coordinator_address, num_processes, process_id, where, timeout_s = _detect(
      coordinator_address, num_processes, process_id, method,
      launcher or f"cluster_detection_method={method!r}", timeout_s)
  timeout_s = _rollcall.check(coordinator_address, num_processes, process_id, timeout_s)
  if coordinator_address is not None and process_id:
    # JAX ends the process (a fatal log, not an exception) when it can't reach the
    # coordinator in time; probing first turns the common case into a clear error.
    waited = _wait_for_coordinator(coordinator_address, timeout_s)
    if waited is None:
      raise DistributedError(
          f"could not form the multi-process job: expected {num_processes} processes, this "
          f"one as process {process_id}, but the coordinator {where} (process 0) didn't "
          f"accept connections within {asked_timeout_s} s; fix: start process 0 with the same "
          "coordinator_address, make sure its host and port are reachable from here, or "
          "raise timeout_s.")
    timeout_s = max(1.0, timeout_s - waited)
  info = _join(coordinator_address, num_processes, process_id, where, timeout_s,
               asked_timeout_s, dict(local_device_ids=local_device_ids,
                                     cluster_detection_method=method,
                                     heartbeat_timeout_seconds=max(1, math.ceil(
                                         heartbeat_timeout_s)),
                                     shutdown_timeout_seconds=max(1, math.ceil(
                                         shutdown_timeout_s))))
  _agree_at_start(config_facts, asked_timeout_s)
  return info


def barrier(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Blocks until every process reaches the barrier `name`, for at most `timeout_s` seconds.

  A no-op in a single process. Uses the distributed runtime's bounded `wait_at_barrier`.

  Raises:
    DistributedArgumentError: an empty or non-str name, or a timeout that isn't positive.
    DistributedError: not every process arrived in time; or several processes without JAX's
      coordination service (`fnscale.initialize` was not called).
  """
  if not isinstance(name, str) or not name:
    raise DistributedArgumentError(f"barrier name {name!r}, expected a non-empty string.")
  if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
    raise DistributedArgumentError(
        f"barrier timeout_s={timeout_s!r}, expected a positive number.")
  if _co.job_runtime(f"barrier({name!r})") is None:
    logging.debug("barrier %s: single process", name)
    return
  st = _compat.distributed_state()
  if (st.num_processes or 1) == 1:
    return
  try:
    with _co.waiting(name):
      st.client.wait_at_barrier(f"fnscale:{name}", max(1, int(timeout_s * 1000)))
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    arrived, missing = _co.barrier_absentees(str(e))
    who = (f"{arrived} of {st.num_processes} arrived; missing: processes "
           f"{', '.join(map(str, missing))}; " if missing else "")
    where = _co.where_others(st.client, st.process_id, st.num_processes, name)
    raise DistributedError(
        f"barrier {name!r}: not all {st.num_processes} processes arrived within {timeout_s} s "
        f"({who}{''.join(w + '; ' for w in where)}this is process {st.process_id}; {first}); "
        f"fix: make every process call barrier({name!r}) in the same order, check that none "
        "crashed or hangs, or raise timeout_s.") from e
  logging.info("barrier %s passed", name)


def agree_on_step(compiled, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """The barrier after a step compiles: every process checks that all compiled the same.

  Call it on every process after `shard_step(...).compile(state, batch)`, before the first
  step (`recipes/train_lm.py` does). Compiling itself never waits for other processes, so a
  report or a plan made on one process alone doesn't block; this is the one place where
  the processes meet after compiling. Each process publishes the step's fingerprint
  through JAX's coordination service (a hash of the lowered program, the mesh, the compiler
  options, and every state and batch leaf's path, shape and dtype) and compares everyone's
  as they arrive; when all agree, all go on (the exchange is the barrier). Like `barrier`,
  every process makes the same calls in the same order: the k-th call of each process is
  compared with the k-th of every other. In one process it returns at once.

  Args:
    compiled: the `fnscale.compile.CompiledStep` (`shard_step(...).compile(state, batch)`).
    timeout_s: seconds to wait for every process's fingerprint.

  Raises:
    DistributedArgumentError: `compiled` is no CompiledStep.
    DistributedError: within moments of the first differing fingerprint, on every process,
      naming the processes and what differs ("process 1: params/w (64, 64) float32, process
      0: (32, 32) float32"); a process that didn't arrive in `timeout_s` (where it last was
      and whether its heartbeats still come); or several processes without JAX's
      coordination service (`fnscale.initialize`).
  """
  if not isinstance(compiled, _compile.CompiledStep):
    raise DistributedArgumentError(
        f"agree_on_step(compiled={type(compiled).__name__}): expected the CompiledStep that "
        "shard_step(...).compile(state, batch) returns; fix: step = step.compile(state, "
        "batch), then fnscale.distributed.agree_on_step(step) on every process.")
  text = compiled.lowered.as_text()
  name = f"compiled step {hashlib.sha256(text.encode()).hexdigest()[:12]}"
  rt = _co.job_runtime(f"agree_on_step ({name})")
  if rt is None:
    return
  client, pid, n = rt
  t0 = time.perf_counter()
  sig = compiled.signature
  state, batch = (jax.tree_util.tree_unflatten(
      treedef, [jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype, _ in leaves])
                  for treedef, leaves in ((sig.state_def, sig.state_leaves),
                                          (sig.batch_def, sig.batch_leaves)))
  facts = _step_facts(text, state, batch, compiled.mesh, compiled.compiler_options)
  with _co.waiting(name):
    got, diffs, waited = _ag.exchange(f"step/{next(_agree_count)}", facts, timeout_s)
  if diffs:
    raise _ag.disagreement(f"the step they compiled ({name})", diffs, _ag.late(got, n))
  missing = [p for p in range(n) if p not in got]
  if missing:
    where = _co.where_others(client, pid, n, name)
    raise DistributedError(
        f"{name}: process(es) {', '.join(map(str, missing))} of {n} did not finish compiling "
        f"the step within {timeout_s} s ({'; '.join(where) or 'no word from them'}; this is "
        f"process {pid}); fix: check their logs (crashed, hung, preempted), make every "
        "process call agree_on_step after compiling, or raise timeout_s for very long "
        "compiles.")
  logging.info("barrier %s passed: all %d processes compiled the same program (check: %.1f "
               "ms of work, %.1f ms waiting for the others)", name, n,
               1000 * (time.perf_counter() - t0 - waited), 1000 * waited)


def check_shared_directory(directory, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Checks that every process sees the same `directory` (a checkpoint directory must be one).

  Process 0 creates the directory if needed and writes a file named by a fresh random token
  into it; every process looks for that file under `directory` as it resolves the path
  there, all compare what they found through JAX's coordination service, and process 0
  removes the file. Call it on every process at start-up, before training: per-host disks
  (the default `runs/...` on each TPU VM) would otherwise leave the commit marker of each
  save on process 0's disk only, and a restart would restore on process 0 alone. In one
  process it returns at once.

  Args:
    directory: a local path or an object-store URL (`gs://...`), the same string on every
      process.
    timeout_s: seconds to wait for process 0's token and every process's answer.

  Raises:
    DistributedError: on every process, naming each process that doesn't see process 0's
      file and the path it looked at, with the fix (a bucket, `gs://...`, or a shared file
      system mounted at the same path everywhere); or several processes without JAX's
      coordination service (`fnscale.initialize`).
  """
  rt = _co.job_runtime(f"check_shared_directory({directory!r})")
  if rt is None:
    return
  client, pid, n = rt
  path = checkpoint._path(directory)  # pylint: disable=protected-access  # as save sees it
  what = f"the shared-directory check of {directory}"
  token = _ag.from_process_0(what, lambda: _write_token(path),
                             f"token/{next(_ag.choice_count)}", timeout_s)
  if token.startswith("error:"):
    raise DistributedError(f"{what}: process 0 could not write to {path}: {token[6:]}; fix: "
                           "give a directory every process can write (gs://... or a shared "
                           "file system).")
  # Equal entries from every process that sees it: only a difference ends the wait early.
  found = {"sees": "yes"} if (path / token).exists() else {
      "sees": "no", "host": socket.gethostname(), "looked_at": str(path / token)}
  with _co.waiting(what):
    got, _, _ = _ag.exchange(f"shared/{token}", found, timeout_s)
  if pid == 0:
    with contextlib.suppress(OSError):
      (path / token).unlink()
  blind = {p: e for p, e in sorted(got.items()) if e["sees"] != "yes"}
  missing = [p for p in range(n) if p not in got]
  if blind or missing:
    named = [f"process {p} (host {e['host']}) doesn't see it ({e['looked_at']} does not "
             "exist here)" for p, e in blind.items()]
    named += [f"process {p} did not answer within {timeout_s} s" for p in missing]
    raise DistributedError(
        f"directory {directory} is not shared by the {n} processes: process 0 wrote {token} "
        f"there, and {'; '.join(named)}. Checkpoints need one directory every process reads "
        "and writes (per-host local disks, such as the default runs/... on each TPU VM, are "
        "not); fix: use a bucket (gs://BUCKET/PATH) or a shared file system (NFS, Filestore) "
        "mounted at the same path on every host.")
  logging.info("%s: all %d processes see it", what, n)


def _write_token(path) -> str:
  """On process 0: a fresh token file in `path` (created if missing); its name, or
  "error:..." when it can't be written."""
  import secrets  # pylint: disable=g-import-not-at-top
  name = f".fnscale-shared-check-{secrets.token_hex(8)}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(name)
  except OSError as e:
    return f"error:{type(e).__name__}: {e}"
  return name






def _agree_at_start(config: dict[str, str], timeout_s: float) -> None:
  """Right after joining: versions, local devices and `config` must agree everywhere."""
  rt = _co.runtime()
  if rt is None:
    return
  _, pid, n = rt
  jax.local_devices()  # starts the backend, as the program's first jax call would anyway
  t0 = time.perf_counter()
  with _co.waiting("start-up check"):
    got, diffs, waited = _ag.exchange("start", _start_facts(config), timeout_s)
  if diffs:
    raise _ag.disagreement("their set-up", diffs, _ag.late(got, n))
  missing = [p for p in range(n) if p not in got]
  if missing:
    raise DistributedError(
        f"process(es) {', '.join(map(str, missing))} of {n} joined the job but did not report "
        f"their versions and devices within {timeout_s} s (this is process {pid}); fix: check "
        "their logs, or raise timeout_s.")
  logging.info("fnscale.initialize: all %d processes agree on versions, devices and config "
               "(check: %.1f ms of work, %.1f ms waiting for the others)", n,
               1000 * (time.perf_counter() - t0 - waited), 1000 * waited)




# ------------------------------------------------------------- agreement between processes
# (fnscale._agreement: one JSON entry per process in the coordination service, compared)

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# The k-th agree_on_step call of this process is compared with the k-th of every other.
_agree_count = itertools.count()










def _source_digest() -> str:
  """sha256 of fnscale's own source files (names and bytes): differs for a stale checkout."""
  h = hashlib.sha256()
  for f in sorted(_PACKAGE_DIR.rglob("*.py")):
    h.update(f.relative_to(_PACKAGE_DIR).as_posix().encode() + b"\0" + f.read_bytes())
  return h.hexdigest()[:12]


def _versions() -> dict[str, str]:
  """The versions every process must share: jax and jaxlib (as imported), libtpu and
  fnscale (as installed, "absent" if not) and a digest of fnscale's source."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
  for name in ("libtpu", "fnscale"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "absent"
  out["fnscale_source"] = _source_digest()
  return out


def _check_config(config) -> dict[str, str]:
  if config is None:
    return {}
  if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
    raise DistributedArgumentError(
        f"config={config!r:.200}, expected a mapping of str names to values (e.g. a recipe's "
        "flags); fix: pass dict(flag=value, ...) or None.")
  return {f"--{k}": str(v) for k, v in config.items()}


def _start_facts(config: dict[str, str]) -> dict[str, str]:
  """What must agree before anything runs: versions, local devices and the caller's config."""
  devices = jax.local_devices()
  kinds = sorted({d.device_kind for d in devices})
  return {**_versions(), "local_device_count": str(len(devices)),
          "device_kind": ",".join(kinds) or "none", **config}


def _leaf_text(leaf) -> str:
  shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
  dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
  return f"{shape} {np.dtype(dtype).name}"


def _step_facts(program_text: str, state, batch, mesh, compiler_options) -> dict[str, str]:
  """A compiled step's fingerprint: program hash, mesh, compiler options, leaf shapes."""
  kinds = sorted({getattr(d, "device_kind", "?") for d in mesh.devices.flat})
  facts = {
      "program": hashlib.sha256(program_text.encode()).hexdigest()[:16],
      "mesh": ",".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({'/'.join(kinds)})",
      "compiler_options": json.dumps(
          sorted((str(k), str(v)) for k, v in dict(compiler_options or {}).items())),
  }
  for prefix, tree in (("state:", state), ("batch:", batch)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      facts[prefix + path_str(path)] = _leaf_text(leaf)
  return facts














# Runtime failures of a collective or of the coordination service (gloo over TCP on CPU,
# NCCL/ICI elsewhere) that can mean another process is gone.
_PEER_FAILURE = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|socket closed|unavailable|"
    r"deadline_exceeded|coordination service|heartbeat|peer", re.IGNORECASE)


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
  helper thread (`fnscale._liveness`): every process inside `peer_guard` shows signs of life
  in the coordination service, and one silent for `timeout_s` seconds ends the others with
  the same error on stderr and status 75 (`EXIT_JOB_FAILED`), or 143
  (`fnscale.preemption.EXIT_PREEMPTED`) once a preemption notice came to any process (the
  lost process is then most likely preempted too). In one process it does nothing.

  Keep `timeout_s` below `initialize`'s `heartbeat_timeout_s`: once the coordination service
  notices the missing heartbeats, JAX ends every process at once from C++ (see the module
  docstring), before this check can report.

  Raises:
    DistributedArgumentError: a timeout that isn't a positive number.
    DistributedError: "lost process(es) [1] of 2 ...", chained from the runtime's error; or,
      on entry, several processes without JAX's coordination service (`fnscale.initialize`
      was not called).
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
        or not _PEER_FAILURE.search(f"{type(e).__name__} {e}")):
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


_LOST_FIX = (" The job can't go on: every collective needs every process. Fix: look at the "
             "log of {named} for why it stopped (killed, out of memory, preempted, crashed), "
             "then restart every process; resume from the last checkpoint "
             "(fnscale.checkpoint.latest_step).")


def _processes(ids: list[int]) -> str:
  return ("an unknown process" if ids == [-1] else
          f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}")


def _leaf_global_shape(path: str, local_shape, sharding) -> tuple[int, ...]:
  """The global shape a process-local leaf stands for under `sharding`."""
  if not isinstance(sharding, NamedSharding):
    raise ShardingError(
        f"global_batch leaf '{path}': sharding {sharding!r} is not a NamedSharding; fix: "
        "use fnscale.batch_sharding(mesh) or a NamedSharding.")
  spec = sharding.spec
  if len(spec) > len(local_shape):
    raise ShardingError(
        f"global_batch leaf '{path}' has shape {tuple(local_shape)} but its sharding "
        f"{spec} needs rank >= {len(spec)}; fix: give the leaf a leading batch dimension.")
  sizes = dict(sharding.mesh.shape)
  counts = [math.prod(sizes[a] for a in _entry_axes(e)) for e in spec]
  probe = tuple(counts) + (1,) * (len(local_shape) - len(spec))
  index_map = sharding.addressable_devices_indices_map(probe)
  if not index_map:
    raise ShardingError(
        f"global_batch leaf '{path}': this process ({jax.process_index()}) has no device in "
        "the sharding's mesh; fix: build the mesh over jax.devices() (all processes).")
  global_shape = list(local_shape)
  for d, n in enumerate(counts):
    if n == 1:
      continue
    # Distinct shards of dim d this process holds; its local rows split evenly over them.
    held = len({(idx[d].start or 0) for idx in index_map.values()})
    if local_shape[d] % held:
      axes = _entry_axes(spec[d])
      raise ShardingError(
          f"batch not divisible by the data axes: process-local leaf '{path}' dimension {d} "
          f"has size {local_shape[d]}, but this process holds {held} of the {n} shards of "
          f"mesh axes {axes}; fix: give each process a multiple of {held} rows "
          f"(global batch a multiple of {n}).")
    global_shape[d] = local_shape[d] // held * n
  return tuple(global_shape)


def global_batch(local, sharding) -> Any:
  """Builds global `jax.Array`s from each process's part of a batch.

  Every process calls it with its own rows (the leading dims it holds under `sharding`);
  the result is one global array per leaf whose leading dim is the concatenation over
  processes in mesh order. In a single process it is a sharded `device_put`.

  Args:
    local: pytree of process-local numpy (or jax) arrays, e.g. [local_batch, seq] int32.
    sharding: one NamedSharding for every leaf (usually `fnscale.batch_sharding(mesh)`) or
      a pytree of them with `local`'s structure.

  Returns:
    Pytree of global jax.Arrays; a leaf of local shape [b, ...] on a process holding k of
    the n shards of the leading dim has global shape [b / k * n, ...].

  Raises:
    ShardingError: a leaf whose sharded dims don't split over this process's shards (naming
      the leaf path, size and shard counts), too low a rank, or mismatched structures.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(local)
  shs = _broadcast_shardings(local, sharding, "batch")
  out = []
  for (p, leaf), s in zip(pairs, shs):
    path = path_str(p)
    if not hasattr(leaf, "shape"):
      leaf = np.asarray(leaf)
    gshape = _leaf_global_shape(path, tuple(leaf.shape), s)
    out.append(jax.make_array_from_process_local_data(s, leaf, gshape))
  return jax.tree_util.tree_unflatten(treedef, out)
