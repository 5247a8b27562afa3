"""Join the multi-process job: `initialize`, `DistributedInfo` and launch detection.

`initialize` wraps `jax.distributed.initialize` (JAX's coordination service: one process runs
the coordinator, every process connects to it), bounding every wait and turning failures
into `DistributedError`s that say what was expected; a malformed argument is a
`DistributedArgumentError` (bad input). It runs the start-up agreement (versions, local
devices and the caller's config, `fnscale.multihost._agreement`) once the job has formed.
"""
from __future__ import annotations

import math
import numbers
import os
import socket
import threading
import time
from typing import Any, Mapping, NamedTuple

from absl import logging
import jax
import numpy as np

from fnscale.multihost import _agreement as _ag
from fnscale import _compat
from fnscale.multihost import _coordination as _co
from fnscale.multihost import _rollcall
from fnscale.multihost import _preemption as preemption
from fnscale.multihost._coordination import DEFAULT_TIMEOUT_S, EXIT_JOB_FAILED
from fnscale._errors import DistributedArgumentError, DistributedError, FnscaleError

DEFAULT_HEARTBEAT_TIMEOUT_S = 100
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
# JAX's own join deadline runs this much past fnscale's, so fnscale's message comes first.
_JOIN_GRACE_S = 10


class DistributedInfo(NamedTuple):
  """Where this process stands: `process_id` of `num_processes`, the coordinator's
  "host:port" (None when single-process) and whether JAX's distributed runtime is up.

  Examples:
    A process started without a launcher is a job of one:

    >>> import fnscale as fs
    >>> fs.initialize()
    DistributedInfo(process_id=0, num_processes=1, coordinator_address=None, initialized=False)
  """
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
  from fnscale import _metadata, _topology as topology  # pylint: disable=g-import-not-at-top
  from fnscale._errors import TopologyError  # pylint: disable=g-import-not-at-top
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
  JAX_PROCESS_ID, the variables `recipes/launch/launch_local.py` (or a user's own launcher) sets."""
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


def _already_joined(coordinator_address, num_processes, process_id) -> DistributedInfo:
  """The running job's info when it matches what is asked (None asks nothing)."""
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


def _reach_coordinator(address, num_processes, process_id, where, timeout_s,
                       asked_timeout_s) -> float:
  """Waits until process 0's coordinator accepts connections; returns the seconds left.
  JAX ends the process (a fatal log, not an exception) when it can't reach the coordinator
  in time; probing first turns the common case into a clear error."""
  waited = _wait_for_coordinator(address, timeout_s)
  if waited is None:
    raise DistributedError(
        f"could not form the multi-process job: expected {num_processes} processes, this "
        f"one as process {process_id}, but the coordinator {where} (process 0) didn't "
        f"accept connections within {asked_timeout_s} s; fix: start process 0 with the same "
        "coordinator_address, make sure its host and port are reachable from here, or "
        "raise timeout_s.")
  return max(1.0, timeout_s - waited)


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

  Before joining, a roll call (`fnscale.multihost._rollcall`: process 0 listens at the coordinator's
  port + 1, `FNSCALE_ROLLCALL_PORT` moves it, "off" skips it) names a `process_id` given to
  two processes, on every process, within seconds.

  A SIGTERM (preemption notice) while the job forms ends the process at once: the message
  on stderr, status 143 (`fnscale.multihost.EXIT_PREEMPTED`).

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

  Examples:
    A single-process script runs unchanged: with no launcher in sight nothing is joined.

    >>> import fnscale as fs
    >>> fs.initialize()
    DistributedInfo(process_id=0, num_processes=1, coordinator_address=None, initialized=False)
  """
  timeouts = {"timeout_s": timeout_s, "heartbeat_timeout_s": heartbeat_timeout_s,
              "shutdown_timeout_s": shutdown_timeout_s}
  coordinator_address, num_processes, process_id = _from_env(
      coordinator_address, num_processes, process_id)
  num_processes, process_id = _plain_int(num_processes), _plain_int(process_id)
  _check_args(coordinator_address, num_processes, process_id, timeouts)
  config_facts = _ag.check_config(config)
  asked_timeout_s = timeout_s
  if jax.distributed.is_initialized():
    return _already_joined(coordinator_address, num_processes, process_id)
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
    timeout_s = _reach_coordinator(coordinator_address, num_processes, process_id, where,
                                   timeout_s, asked_timeout_s)
  info = _join(coordinator_address, num_processes, process_id, where, timeout_s,
               asked_timeout_s, dict(local_device_ids=local_device_ids,
                                     cluster_detection_method=method,
                                     heartbeat_timeout_seconds=max(1, math.ceil(
                                         heartbeat_timeout_s)),
                                     shutdown_timeout_seconds=max(1, math.ceil(
                                         shutdown_timeout_s))))
  _ag.agree_at_start(config_facts, asked_timeout_s)
  return info

