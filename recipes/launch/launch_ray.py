"""Runs a recipe as one JAX process per host of a Ray cluster, and restarts the whole job from
its newest checkpoint after a preemption or a lost host.

  # a TPU pod slice (Ray's TPU resources: one process per TPU host, the slice's hosts together)
  python recipes/launch/launch_ray.py --address=auto --tpu=v5p:2x2x4 -- \\
      recipes/train_lm.py --model_config=small --mesh=fsdp=-1
  # a GPU cluster: one process per node with all its GPUs
  python recipes/launch/launch_ray.py --address=auto --hosts=4 --gpus_per_host=8 -- \\
      recipes/train_lm.py --model_config=medium --mesh="data=-1,fsdp=8" --precision=bf16
  # this machine: a throwaway 2-node Ray cluster, 4 simulated CPU devices per process
  python recipes/launch/launch_ray.py --local_nodes=2 --devices_per_process=4 -- \\
      recipes/train_lm.py --model_config=nano --steps=40

Placement: the job's hosts are reserved together as one Ray placement group, one bundle per
host (TPU: `ray.util.tpu.slice_placement_group`, which claims a slice through its head host's
`TPU-<type>-head` resource and places a bundle of the host's chips on every host of that slice;
CPU/GPU: `--hosts` bundles of `--cpus_per_host` / `--gpus_per_host`, strategy STRICT_SPREAD, so
each lands on its own node). A Ray actor per bundle starts the command there, in `--cwd` (the
launcher's directory by default: the code must be at the same path on every host), with
JAX_COORDINATOR_ADDRESS (process 0's host and a free port there), JAX_NUM_PROCESSES and
JAX_PROCESS_ID (on TPU, the host's worker id in the slice), so `fnscale.initialize()` joins.
Process 0's output is streamed; the others' last lines are kept and shown when one fails.

Supervision, by the exit statuses recipes/train_lm.py and fnscale define:
  0 everywhere         done.
  143 (preempted; the job saved a checkpoint), 75 (a process was lost or the job could not
  form), a process ended by a signal, or a host lost (its Ray actor died)
                       stop every process and start the whole job again on a fresh
                       reservation after a backoff (`--backoff_s`, doubling, at most
                       `--max_backoff_s`), up to `--max_restarts` times; it resumes from the
                       newest checkpoint. Each restart is one line with the cause and the step.
  2 (bad input) or any other status (an uncaught error)
                       stop every process, no restart: a configuration error doesn't heal.
The cause is read from the processes that ended on their own (not those the launcher stopped):
a lost one (host gone, or ended by a signal) before 143, before 75, before anything else, since
what a lost host leaves in its peers (an uncaught collective error) is a symptom. After a 143
the other processes get `--grace_s` to finish saving on their own; otherwise they are stopped
at once (SIGTERM, SIGKILL after a few seconds). The launcher's own exit status is the cause's
(75 for a lost host or a signal), 124 after `--timeout_s`, 130 when interrupted.

`launch(argv, hosts, ...)` is the same as a function. Needs `pip install "fnscale[ray]"`.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple, Sequence

from absl import flags

from recipes.launch import launch_local, ray_cluster
# The supervision rule, shared with launch_local.py (one definition).
from recipes.launch.launch_local import (EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_PREEMPTED, Exit,
                                         Verdict, cause_of, classify)

EXIT_TIMEOUT = 124
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL when stopping processes that can't save anything
POLL_S = 0.2  # how often the launcher asks each host for its process's status
HOST_TIMEOUT_S = 60.0  # a host that doesn't answer a poll for this long is lost
KEEP_LINES = 2000  # lines of output each host keeps for the failure report
TAIL_LINES = 20
_TPU_WORKER_LABEL = "ray.io/tpu-worker-id"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PREFIX = "launch_ray: "


class Hosts(NamedTuple):
  """The hosts of a job: `count` Ray nodes holding `bundle` each, or a TPU slice.

  Build with `nodes(...)` or `tpu_slice(...)`. `bundle` is Ray resources per host
  ({"CPU": 8, "GPU": 8}); for a TPU slice, `tpu` is (generation, topology), e.g.
  ("v5p", "2x2x4"), and Ray derives the host count and each host's chips from it.
  """
  count: int
  bundle: dict
  tpu: tuple[str, str] | None = None


def nodes(count: int, cpus: float = 1, gpus: float = 0) -> Hosts:
  """`count` CPU/GPU hosts, each reserving `cpus` CPUs and `gpus` GPUs of its own Ray node.

  Raises:
    ValueError: a count below 1 or negative resources.
  """
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"hosts={count!r}, expected a positive int (Ray nodes, one process each)")
  if cpus < 0 or gpus < 0 or cpus + gpus <= 0:
    raise ValueError(f"cpus_per_host={cpus!r}, gpus_per_host={gpus!r}: expected resources "
                     ">= 0, not both 0 (a bundle must reserve something on its node)")
  bundle = {"CPU": cpus}
  if gpus:
    bundle["GPU"] = gpus
  return Hosts(count, bundle)


def tpu_slice(spec: str) -> Hosts:
  """A TPU slice named `generation:topology`, e.g. "v5p:2x2x4" or "v6e:4x4".

  Raises:
    ValueError: not of that form.
  """
  version, sep, topology = spec.partition(":")
  dims = topology.lower().split("x")
  if not sep or not version or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(f"tpu={spec!r}, expected generation:topology such as 'v5p:2x2x4' or "
                     "'v6e:4x4' (the slice's chip grid)")
  return Hosts(0, {}, (version.lower(), topology.lower()))


class Restart(NamedTuple):
  """One restart: its number (1, 2, ...), the cause (`cause_of` the attempt), every
  process's return code in that attempt (None: host lost), and the checkpoint step it resumes
  from (None: no checkpoint yet, or the launcher doesn't know where they are)."""
  number: int
  cause: Exit
  why: str
  returncodes: tuple[int | None, ...]
  resume_step: int | None
  delay_s: float


class Outcome(NamedTuple):
  """A launch's end: exit status, its restarts, and `[(returncode, output tail), ...]` per
  process of the last attempt (returncode None where the host was lost)."""
  returncode: int
  restarts: tuple[Restart, ...]
  results: list[tuple[int | None, str]]


class Command(NamedTuple):
  """What every host of a job runs: `argv` in `cwd` (the same path on every host), with `env`
  added to the host's environment and `devices` simulated CPU devices (None: its own)."""
  argv: list[str]
  devices: int | None
  env: dict[str, str]
  cwd: str


class HostProcess:
  """One process of the job on one host; the launcher runs it as a Ray actor there.

  Starts the command in its own session (so stopping it reaches its children), keeps its last
  `KEEP_LINES` lines of output (stdout and stderr interleaved), reports its status.
  """

  def __init__(self):
    self._proc = self._reader = None
    self._lines = collections.deque(maxlen=KEEP_LINES)
    self._count = 0  # lines read so far; `poll(since)` indexes by it
    self._lock = threading.Lock()

  def describe(self) -> dict:
    """This host: its Ray node id, a free port on it, its TPU worker id (or None)."""
    import ray  # pylint: disable=import-outside-toplevel
    ctx = ray.get_runtime_context()
    worker = ctx.get_node_labels().get(_TPU_WORKER_LABEL)
    return {"node_id": ctx.get_node_id(), "port": launch_local.free_port(),
            "tpu_worker_id": int(worker) if worker else None}

  def start(self, c: Command, process_id: int, num_processes: int,
            coordinator: tuple[str, int]) -> int:
    """Starts `c.argv` (a leading `*.py` runs under this host's Python) as process
    `process_id` of `num_processes`, with `coordinator` (process 0's host, port) and
    `c.devices` simulated CPU devices (None: the host's own), in this host's environment
    updated by `c.env`, in `c.cwd`; returns its pid."""
    host, port = coordinator
    child = launch_local.child_env(process_id, num_processes, c.devices, port,
                                   base={**os.environ, **c.env}, host=host)
    self._proc = subprocess.Popen(
        launch_local.command(c.argv), env=child, cwd=c.cwd, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        start_new_session=True)  # its own process group: stopped with all its children
    self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
    self._reader.start()
    return self._proc.pid

  def _read(self, pipe):
    for line in iter(pipe.readline, ""):
      with self._lock:
        self._lines.append(line)
        self._count += 1
    pipe.close()

  def poll(self, since: int | None = None) -> tuple[int | None, list[str], int]:
    """(return code or None while running, the lines numbered `since` on (none if None), the
    number of lines read so far)."""
    rc = self._proc.poll()
    with self._lock:
      if since is None:
        return rc, [], self._count
      first = self._count - len(self._lines)
      return rc, list(self._lines)[max(0, since - first):], self._count

  def stop(self, wait_s: float, grace_s: float) -> tuple[int, bool]:
    """Waits up to `wait_s` for the process to end on its own, then SIGTERM to its process
    group and SIGKILL after `grace_s`; returns (its return code, whether it ended on its own)."""
    own = True
    try:
      self._proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
      own = False
      launch_local.stop([self._proc], grace_s)
    self._reader.join(timeout=5)  # its last lines, for the final poll and the report
    return self._proc.returncode, own

  def tail(self, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of output."""
    with self._lock:
      return "".join(list(self._lines)[-lines:])


def _import_ray():
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("launch_ray needs Ray; install it with pip install 'fnscale[ray]' "
                      "(or pip install ray)") from e
  return ray


class _Reservation(NamedTuple):
  """Every host of one attempt, reserved at once: the placement group (one bundle per host),
  how to release it, the host count and what each host's actor takes from its bundle."""
  pg: object
  release: Callable[[], None]
  count: int
  actor_options: dict


def _reserve(ray, hosts: Hosts, timeout_s: float) -> _Reservation:
  """Reserves the job's hosts together (gang-scheduled).

  Raises:
    TimeoutError: the cluster didn't provide them within `timeout_s` (names what it has).
    ValueError: a TPU generation or topology Ray doesn't know.
  """
  # pylint: disable=import-outside-toplevel
  from ray.util.placement_group import placement_group, remove_placement_group
  if hosts.tpu:
    from ray.util import tpu
    version, topology = hosts.tpu
    handle = tpu.slice_placement_group(topology, version, head_reservation_timeout_s=timeout_s)
    pg, release, count = handle.placement_group, handle.shutdown, handle.num_hosts
    options = {"num_cpus": 0, "resources": {"TPU": handle.devices_per_host}}
    what = f"a TPU {version} {topology} slice ({count} hosts of {handle.bundle_resources})"
  else:
    pg = placement_group([dict(hosts.bundle)] * hosts.count, strategy="STRICT_SPREAD")
    release, count = (lambda: remove_placement_group(pg)), hosts.count
    options = {"num_cpus": hosts.bundle.get("CPU", 0), "num_gpus": hosts.bundle.get("GPU", 0),
               "resources": {k: v for k, v in hosts.bundle.items() if k not in ("CPU", "GPU")}}
    what = f"{count} hosts of {hosts.bundle}, each on its own node"
  ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
  if not ready:
    release()
    raise TimeoutError(f"the cluster did not provide {what} within {timeout_s:g} s; it has "
                       f"{_alive_nodes(ray)} nodes, resources {ray.cluster_resources()}, "
                       f"available {ray.available_resources()}")
  if hosts.tpu:
    handle.release_head_pgs()  # the slice's bundles now hold it
  return _Reservation(pg, release, count, options)


def _alive_nodes(ray) -> int:
  return sum(1 for n in ray.nodes() if n.get("Alive"))


class _Job(NamedTuple):
  """A started attempt: the actors in process-id order, where each runs, their pids."""
  actors: list
  places: list[dict]
  pids: list[int]


def _process_order(places: list[dict]) -> list[int]:
  """Bundle indices in process-id order: TPU hosts by their worker id in the slice (what the
  TPU runtime expects), other hosts in bundle order."""
  ids = [p["tpu_worker_id"] for p in places]
  if all(i is not None for i in ids) and sorted(ids) == list(range(len(ids))):
    return sorted(range(len(ids)), key=ids.__getitem__)
  return list(range(len(places)))


def _start(ray, reservation: _Reservation, c: Command) -> _Job:
  """An actor in each bundle; the command started on every host with its place in the job."""
  # pylint: disable=import-outside-toplevel
  from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
  # The actor's class comes from this repository, at the same path on every host.
  path = os.pathsep.join(
      [_REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
  host = ray.remote(HostProcess)
  actors = [host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(reservation.pg, i),
                         runtime_env={"env_vars": {"PYTHONPATH": path}},
                         **reservation.actor_options).remote()
            for i in range(reservation.count)]
  try:
    places = ray.get([a.describe.remote() for a in actors], timeout=HOST_TIMEOUT_S)
    # Each node's address as the cluster knows it (`ray start --node-ip-address`).
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    places = [{**p, "ip": ips[p["node_id"]], "node": p["node_id"][:8]} for p in places]
    order = _process_order(places)
    actors, places = [actors[i] for i in order], [places[i] for i in order]
    n, coordinator = len(actors), places[0]
    where = (coordinator["ip"], coordinator["port"])
    pids = ray.get([a.start.remote(c, i, n, where)
                    for i, a in enumerate(actors)], timeout=HOST_TIMEOUT_S)
  except BaseException:
    for a in actors:
      ray.kill(a)
    raise
  return _Job(actors, places, pids)


class _Deadline(Exception):
  """The launch's `timeout_s` passed."""


def _lost(e: Exception, process_id) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"host of process {process_id} lost: {type(e).__name__}: {first[:200]}"


def _poll(ray, actors, seen: int) -> tuple[list[Exit | None], list[str], int]:
  """Every process's state (None: running) and process 0's lines from number `seen` on."""
  refs = [a.poll.remote(seen if i == 0 else None) for i, a in enumerate(actors)]
  states, lines = [], []
  for i, ref in enumerate(refs):
    try:
      rc, new, count = ray.get(ref, timeout=HOST_TIMEOUT_S)
    except ray.exceptions.RayError as e:  # the actor or its node died, or it stopped answering
      states.append(Exit(i, None, _lost(e, i)))
      continue
    if i == 0:
      lines, seen = new, count
    states.append(None if rc is None else Exit(i, rc))
  return states, lines, seen


def _watch(ray, actors, stream, deadline: float | None) -> tuple[list[Exit], int]:
  """Streams process 0's output until every process exits 0 or one fails; returns the
  processes that have ended by then and the number of process 0's lines streamed.

  Raises:
    _Deadline: `deadline` (time.monotonic()) passed first.
  """
  seen = 0
  while True:
    states, lines, seen = _poll(ray, actors, seen)
    for line in lines:
      stream(line)
    ended = [e for e in states if e is not None]
    if len(ended) == len(states) or any(e.lost or e.returncode != 0 for e in ended):
      return ended, seen
    if deadline is not None and time.monotonic() > deadline:
      raise _Deadline()
    time.sleep(POLL_S)


def _stop_all(ray, actors, wait_s: float, grace_s: float) -> tuple[list, list[Exit]]:
  """Every process ended (`HostProcess.stop`, on all hosts at once): (return codes, None for a
  lost host; the exits of those that ended on their own or were lost)."""
  refs = [a.stop.remote(wait_s, grace_s) for a in actors]
  codes, own = [], []
  for i, ref in enumerate(refs):
    try:
      code, by_itself = ray.get(ref, timeout=wait_s + grace_s + HOST_TIMEOUT_S)
    except ray.exceptions.RayError as e:
      codes.append(None)
      own.append(Exit(i, None, _lost(e, i)))
      continue
    codes.append(code)
    if by_itself:
      own.append(Exit(i, code))
  return codes, own


def _results(ray, actors, codes) -> list[tuple[int | None, str]]:
  out = []
  for a, code in zip(actors, codes):
    try:
      out.append((code, ray.get(a.tail.remote(), timeout=HOST_TIMEOUT_S)))
    except ray.exceptions.RayError as e:
      out.append((code, f"(output lost with its host: {type(e).__name__})\n"))
  return out


class _Launch(NamedTuple):
  """A launch's settings, checked and defaulted (`launch`), built once."""
  command: Command
  hosts: Hosts
  grace_s: float
  placement_timeout_s: float
  max_restarts: int
  backoff: tuple[float, float]  # (backoff_s, max_backoff_s)
  checkpoint_dir: str | None
  stream: Callable[[str], None]  # process 0's lines and (through `say`) the launcher's
  say: Callable[[str], None]  # one line of the launcher's, prefixed
  deadline: float | None  # time.monotonic() of the timeout


def _attempt(ray, o: _Launch, number: int) -> tuple[Exit | None, list]:
  """One run of the whole job on a fresh reservation: (the failure that explains its end,
  `cause_of`, or None; `[(returncode, output tail), ...]` per process).

  Every process has ended when it returns or raises: after a 143 the others get `grace_s` to
  finish saving on their own; after another failure they are stopped at once; on the deadline
  or an interrupt every process gets SIGTERM (a preemption notice: it saves) and `grace_s`.
  """
  say, stream = o.say, o.stream
  left = float("inf") if o.deadline is None else max(1.0, o.deadline - time.monotonic())
  reservation = _reserve(ray, o.hosts, min(o.placement_timeout_s, left))
  try:
    job = _start(ray, reservation, o.command)
    say(f"attempt {number}: " + ", ".join(
        f"process {i} pid {pid} on {p['ip']} (node {p['node']})" for i, (p, pid) in enumerate(
            zip(job.places, job.pids))) + f"; coordinator {job.places[0]['ip']}:"
        f"{job.places[0]['port']}")
    wait_s, grace_s, seen = 0.0, o.grace_s, None
    try:
      ended, seen = _watch(ray, job.actors, stream, o.deadline)
      preempted = any(e.returncode == EXIT_PREEMPTED for e in ended)
      wait_s, grace_s = (o.grace_s if preempted else 0.0), STOP_GRACE_S
    finally:
      codes, own = _stop_all(ray, job.actors, wait_s, grace_s)
      if seen is not None:  # process 0's last lines
        with contextlib.suppress(ray.exceptions.RayError):
          for line in ray.get(job.actors[0].poll.remote(seen), timeout=HOST_TIMEOUT_S)[1]:
            stream(line)
      results = _results(ray, job.actors, codes)
      for a in job.actors:
        ray.kill(a)
  finally:
    reservation.release()
  return cause_of(own), results


def _recipe_dirs(argv: Sequence[str], cwd: str) -> tuple[str | None, str | None]:
  """Where recipes/train_lm.py run as `argv` keeps its checkpoints and its emergency copies
  (its own flags and defaults; None where off); both None for another command or flags it
  refuses. Imports the recipe (and jax): called only after a failure."""
  if not argv or os.path.basename(argv[0]) != "train_lm.py":
    return None, None
  # pylint: disable=import-outside-toplevel
  from recipes import train_lm
  from recipes.lm import checkpoints, cli, emergency, rundir
  try:
    o = cli.parse_flags(train_lm.Options, ["train_lm", *argv[1:]])
  except ValueError:  # FnscaleError: the job exits 2 and isn't restarted anyway
    return None, None
  c = o.ckpt
  if not (c.run_dir or c.checkpoint_dir):  # train_lm's default: per model and vocabulary
    # The platform's default model, a tokenizer's vocabulary: known only where it runs.
    if o.model.model_config is None or o.model.tokenizer:
      return None, None
    c = dataclasses.replace(c, run_dir=rundir.default_run_dir(o.model.model_config,
                                                              o.data.dataset, "", 256))
  place = lambda d: None if not d else d if "://" in d else os.path.join(cwd, d)
  return place(checkpoints.directory(c)), place(emergency.directory(c) if c.run_dir else "")


def _recipe_checkpoint_dir(argv: Sequence[str], cwd: str) -> str | None:
  """Where recipes/train_lm.py run as `argv` keeps its checkpoints (`_recipe_dirs`)."""
  return _recipe_dirs(argv, cwd)[0]


def _resumed_from(o: "_Launch") -> tuple[int | None, str | None]:
  """(step, directory) a restart resumes from: the newer of the job's newest checkpoint and
  train_lm's newest emergency copy, as train_lm picks (recipes/lm/emergency.py)."""
  directory = o.checkpoint_dir or _recipe_checkpoint_dir(o.command.argv, o.command.cwd)
  step = _newest_step(directory)
  copies = _recipe_dirs(o.command.argv, o.command.cwd)[1]
  copy = _newest_step(copies)
  if copy is not None and (step is None or copy > step):
    return copy, copies
  return step, directory


def _newest_step(directory: str | None) -> int | None:
  """`fnscale.checkpoint.latest_step(directory)`; None without a directory or a checkpoint."""
  if not directory:
    return None
  from fnscale import checkpoint  # pylint: disable=import-outside-toplevel
  try:
    return checkpoint.latest_step(directory)
  except ValueError:  # CheckpointError: orbax missing, a file where the directory should be
    return None


def _resume_words(step: int | None, directory: str | None) -> str:
  if step is not None:
    return f"resuming from step {step} ({directory})"
  if directory:
    return f"starting from step 0 (no checkpoint in {directory} yet)"
  return "resuming from its newest checkpoint (where is unknown here: pass --checkpoint_dir)"


def _supervise(ray, o: _Launch) -> Outcome:
  """Attempts until one ends well, fails for good, or restarts run out (module docstring)."""
  restarts: list[Restart] = []
  say, max_restarts = o.say, o.max_restarts
  while True:
    try:
      cause, results = _attempt(ray, o, len(restarts) + 1)
    except TimeoutError as e:  # the hosts weren't there
      if not restarts:  # never were: the cluster can't hold this job as asked
        say(f"{e}; not starting (check --hosts / --tpu and the cluster)")
        return Outcome(EXIT_BAD_INPUT, (), [])
      cause, results = Exit(None, None, f"hosts not available: {e}"), []
    except ray.exceptions.RayError as e:  # a host went while the job started
      cause, results = Exit(None, None, _lost(e, "a process")), []
    except _Deadline:
      say("timeout (timeout_s) reached; every process stopped")
      return Outcome(EXIT_TIMEOUT, tuple(restarts), [])
    if cause is None:
      say(f"every process exited with 0 ({len(restarts)} restarts)")
      return Outcome(0, tuple(restarts), results)
    verdict = classify(cause)
    if cause.process_id and results:  # process 0's output was streamed already
      say(f"process {cause.process_id}'s last lines:\n" + "\n".join(
          f"  | {line}" for line in results[cause.process_id][1].splitlines()))
    if not verdict.restart or len(restarts) >= max_restarts:
      say(f"{verdict.why}; " + ("not restarting: a configuration error doesn't heal"
                                if not verdict.restart else
                                f"giving up after {len(restarts)} restarts "
                                f"(max_restarts={max_restarts})"))
      return Outcome(verdict.status, tuple(restarts), results)
    delay = min(o.backoff[1], o.backoff[0] * 2 ** len(restarts))
    step, directory = _resumed_from(o)
    codes = tuple(code for code, _ in results)
    say(f"restart {len(restarts) + 1} of {max_restarts} in {delay:g} s: {verdict.why} "
        f"(exit statuses {', '.join('lost' if c is None else str(c) for c in codes)}); "
        + _resume_words(step, directory))
    restarts.append(Restart(len(restarts) + 1, cause, verdict.why, codes, step, delay))
    if o.deadline is not None and time.monotonic() + delay > o.deadline:
      say("timeout (timeout_s) reached; every process stopped")
      return Outcome(EXIT_TIMEOUT, tuple(restarts), results)
    time.sleep(delay)


def _check(name: str, value, *, positive: bool, optional: bool = False, integer: bool = False):
  if optional and value is None:
    return
  kinds = (int,) if integer else (int, float)
  if isinstance(value, bool) or not isinstance(value, kinds) or (
      value <= 0 if positive else value < 0):
    raise ValueError(f"launch_ray: {name}={value!r}, expected a "
                     f"{'positive' if positive else 'non-negative'} "
                     f"{'int' if integer else 'number'}" + (" or None" if optional else ""))


class Options(NamedTuple):
  """`launch`'s keywords (`launch_ray.py`'s flags of the same names).

  `address`: the Ray cluster ("auto", "host:port"); None: ray.init's default (RAY_ADDRESS, a
  running local cluster, or a new one-node cluster). Not used if Ray is initialised.
  `devices_per_process`: simulated CPU devices per process (testing on CPUs); None: each
  host's real devices. `max_restarts`: restarts after a preemption or a lost host before
  giving up. `backoff_s`, `max_backoff_s`: seconds before restart k (k = 1, 2, ...):
  backoff_s x 2^(k-1), at most max_backoff_s. `grace_s`: seconds the other processes get to
  finish saving after one exits 143, and every process gets after the SIGTERM sent on the
  timeout or an interrupt. `timeout_s`: wall-clock limit of the whole launch, restarts
  included (None: none). `placement_timeout_s`: seconds to wait for the hosts of an attempt;
  the first attempt failing that is a configuration error (status 2), a later one counts as
  a restart. `checkpoint_dir`: where the job's checkpoints are, for the step a restart
  resumes from; default: recipes/train_lm.py's own (from its flags), else unknown. `env`:
  extra environment for every process. `cwd`: the processes' working directory (default
  this one's); the same path on every host. `stream`: called with each line of process 0's
  output and of the launcher's reports (default: print).
  """
  address: str | None = None
  devices_per_process: int | None = None
  max_restarts: int = 3
  backoff_s: float = 10.0
  max_backoff_s: float = 300.0
  grace_s: float = 30.0
  timeout_s: float | None = None
  placement_timeout_s: float = 600.0
  checkpoint_dir: str | None = None
  env: dict[str, str] | None = None
  cwd: str | None = None
  stream: Callable[[str], None] | None = None


def _check_options(o: Options) -> None:
  _check("devices_per_process", o.devices_per_process, positive=True, optional=True,
         integer=True)
  _check("max_restarts", o.max_restarts, positive=False, integer=True)
  for name in ("backoff_s", "max_backoff_s", "grace_s", "placement_timeout_s"):
    _check(name, getattr(o, name), positive=name != "backoff_s")
  _check("timeout_s", o.timeout_s, positive=True, optional=True)


def launch(argv: Sequence[str], hosts: Hosts, **options) -> Outcome:
  """Runs `argv` as one JAX process per host on a Ray cluster and supervises it.

  Args:
    argv: the command; a leading `*.py` path runs under each host's Python.
    hosts: `nodes(count, cpus, gpus)` or `tpu_slice("v5p:2x2x4")`.
    **options: the fields of `Options` (address, devices_per_process, max_restarts,
      backoff_s, max_backoff_s, grace_s, timeout_s, placement_timeout_s, checkpoint_dir, env,
      cwd, stream).

  Returns:
    An `Outcome`: exit status 0 done, the cause's status after a failure that isn't
    restarted or after the last restart (143, 75, 2, ...), 124 on the timeout.

  Raises:
    ValueError: bad arguments or an empty command.
    TypeError: a keyword that is not a field of `Options`.
    ImportError: Ray isn't installed.
    KeyboardInterrupt: after SIGTERM to every process and their end, when interrupted.
  """
  o = Options(**options)
  launch_local.command(argv)  # raises on an empty command
  if not isinstance(hosts, Hosts):
    raise ValueError(f"launch_ray: hosts={hosts!r}, expected nodes(...) or tpu_slice(...)")
  _check_options(o)
  ray = _import_ray()
  stream = o.stream or (lambda line: print(line, end="", flush=True))
  own = not ray.is_initialized()
  if own:
    ray.init(address=o.address, logging_level="warning", log_to_driver=False)
  command = Command(list(argv), o.devices_per_process, dict(o.env or {}),
                    os.path.abspath(o.cwd or os.getcwd()))
  try:
    return _supervise(ray, _Launch(
        command, hosts, o.grace_s, o.placement_timeout_s, o.max_restarts,
        (o.backoff_s, o.max_backoff_s), o.checkpoint_dir, stream,
        lambda text: stream(f"{_PREFIX}{text}\n"),
        None if o.timeout_s is None else time.monotonic() + o.timeout_s))
  finally:
    if own:
      ray.shutdown()


def _define_flags(fv: flags.FlagValues) -> None:
  define = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}
  for name, default, kind, help_ in (
      ("address", "", str, "Ray cluster address ('auto', host:port); default: ray.init's"),
      ("hosts", 0, int, "CPU/GPU hosts (Ray nodes), one process each; default --local_nodes"),
      ("cpus_per_host", 1.0, float, "CPUs each host's bundle reserves"),
      ("gpus_per_host", 0.0, float, "GPUs each host's bundle reserves"),
      ("tpu", "", str, "a TPU slice generation:topology, e.g. v5p:2x2x4 (instead of --hosts)"),
      ("devices_per_process", 0, int, "simulated CPU devices per process (0: real devices)"),
      ("max_restarts", 3, int, "restarts after a preemption or a lost host"),
      ("backoff_s", 10.0, float, "seconds before the first restart (doubling after)"),
      ("max_backoff_s", 300.0, float, "longest wait before a restart"),
      ("grace_s", 30.0, float, "seconds to finish saving after a process exits 143"),
      ("timeout_s", 0.0, float, "stop everything after this many seconds (0: never)"),
      ("placement_timeout_s", 600.0, float, "seconds to wait for the hosts of an attempt"),
      ("checkpoint_dir", "", str, "the job's checkpoints (default: train_lm's own)"),
      ("cwd", "", str, "the processes' working directory (default: this one)"),
      ("local_nodes", 0, int, "start a Ray cluster of this many nodes on 127.0.0.1 first")):
    define[kind](name, default, help_, flag_values=fv)


# The int flags with a lower bound: (name, least value, what that value means).
_LEAST = (("max_restarts", 0, "never restart"),
          ("devices_per_process", 0, ""),
          ("local_nodes", 0, "no local cluster"))


def _hosts(fv: flags.FlagValues) -> Hosts:
  if fv.tpu:
    if fv.hosts:
      raise ValueError("launch_ray: --tpu and --hosts both given; a TPU slice's hosts come "
                       "from its topology: give one of them")
    return tpu_slice(fv.tpu)
  return nodes(fv.hosts or fv.local_nodes, fv.cpus_per_host, fv.gpus_per_host)


def main(argv: list[str]) -> int:
  """`launch_ray.py [flags] -- RECIPE [recipe flags]`; returns the exit status."""
  try:
    parsed = launch_local.launcher_flags(argv, _define_flags, __doc__, _LEAST)
    if parsed is None:
      return 0
    fv, rest = parsed
    if not rest:
      raise ValueError("launch_ray: no command; usage: launch_ray.py --address=auto "
                       "--hosts=4 -- recipes/train_lm.py [flags]")
    hosts = _hosts(fv)
  except (flags.Error, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT

  def on_term(signum, frame):  # the launcher preempted: every process gets the notice
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, on_term)
  kwargs = dict(devices_per_process=fv.devices_per_process or None,
                max_restarts=fv.max_restarts, backoff_s=fv.backoff_s,
                max_backoff_s=fv.max_backoff_s, grace_s=fv.grace_s,
                timeout_s=fv.timeout_s or None, placement_timeout_s=fv.placement_timeout_s,
                checkpoint_dir=fv.checkpoint_dir or None, cwd=fv.cwd or None)
  try:
    with (ray_cluster.local_cluster(fv.local_nodes) if fv.local_nodes else
          contextlib.nullcontext(fv.address or None)) as address:
      return launch(rest, hosts, address=address, **kwargs).returncode
  except KeyboardInterrupt:
    print(f"{_PREFIX}interrupted; every process stopped", file=sys.stderr)
    return 130
  except (ValueError, ImportError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
  sys.exit(main(sys.argv))
