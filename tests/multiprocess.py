"""Runs a multi-process JAX job on this machine: N processes on 127.0.0.1, M CPU devices each.

Each process is an ordinary Python program (a script path or `-m module` plus arguments) that
finds its place in the job in the environment `recipes/launch/launch_local.py` gives (its `child_env`:
JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES, JAX_PROCESS_ID, XLA_FLAGS
with M simulated CPU devices, JAX_PLATFORMS=cpu) and passes them to `fnscale.initialize`
(`initialize_from_env` does it). Launcher variables of an enclosing job (SLURM, Open MPI, TPU
pod) are removed, and the repository is put on PYTHONPATH.

`launch_local.launch` runs a recipe and stops every process once one fails; this harness
keeps each process's own fate (which one exited, how, when), can start only some of the
processes, signal one of them, and wait for a line of output: what failure tests need.

Every process runs in its own session (process group), so `kill` reaches its children too;
output goes to files (no pipe can fill up and block a child), readable while it runs. Every
wait is bounded, and `run` and `job` kill whatever is left when they return or raise.

No pytest here: recipes and scripts can use it as well as tests.

  results = run([worker, "--steps=4"], num_processes=2, devices_per_process=4, timeout_s=120)
  assert all(r.returncode == 0 for r in results), describe(results)
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# Variables through which a parent's own cluster job would leak into the children.
_LAUNCHER_VARS = ("JAX_NUM_CPU_DEVICES", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NPROCS",
                  "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                  "MEGASCALE_NUM_SLICES", ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
_REPO = pathlib.Path(__file__).resolve().parents[1]
_POLL_S = 0.05


def _launch_local():
  """recipes/launch/launch_local.py (a script, not a package), loaded from its path."""
  spec = importlib.util.spec_from_file_location(
      "fnscale_recipes_launch_local", _REPO / "recipes" / "launch" / "launch_local.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_LAUNCH = _launch_local()


class Process(NamedTuple):
  """One started process: its id in the job, the Popen handle and its output files."""
  process_id: int
  popen: subprocess.Popen
  stdout_path: pathlib.Path
  stderr_path: pathlib.Path
  started: float  # time.monotonic() at start


class Job(NamedTuple):
  """A started job: its processes (in process-id order), coordinator and log directory."""
  processes: tuple[Process, ...]
  coordinator_address: str
  num_processes: int
  log_dir: pathlib.Path


class Result(NamedTuple):
  """How one process ended. `returncode` is negative (-signal) when a signal ended it and
  None when it was still running at the deadline (then it was killed; `timed_out` is True).
  `elapsed_s` is seconds from its start until its exit was observed."""
  process_id: int
  returncode: int | None
  stdout: str
  stderr: str
  elapsed_s: float
  timed_out: bool


free_port = _LAUNCH.free_port


def child_env(coordinator_port: int, num_processes: int, process_id: int,
              devices_per_process: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of process `process_id`: launch_local's (coordinator on 127.0.0.1,
  process count and id, M simulated CPU devices) over this process's environment without
  launcher variables, with the repository on PYTHONPATH; `env` wins over all of it."""
  base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
  base["PYTHONPATH"] = os.pathsep.join(
      [str(_REPO)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
  out = _LAUNCH.child_env(process_id, num_processes, devices_per_process, coordinator_port,
                          base)
  out["JAX_PLATFORMS"] = "cpu"
  out.update(env or {})
  return out


def start(argv: Sequence[str], num_processes: int, devices_per_process: int, *,
          process_ids: Sequence[int] | None = None, port: int | None = None,
          env: Mapping[str, str] | None = None, log_dir: str | os.PathLike | None = None,
          cwd: str | os.PathLike | None = None,
          process_args: Mapping[int, Sequence[str]] | None = None,
          process_env: Mapping[int, Mapping[str, str]] | None = None) -> Job:
  """Starts the processes of a job and returns at once.

  Args:
    argv: the program each process runs after the Python interpreter, e.g.
      `["tests/mp_worker.py", "--steps=4"]` or `["-m", "pkg.main"]`.
    num_processes: N, the job's size (what each process is told).
    devices_per_process: M simulated CPU devices per process.
    process_ids: which of 0..N-1 to start (default all); leave some out to model a process
      that never starts.
    port: the coordinator's port on 127.0.0.1 (default: a free one).
    env: extra environment for every process (wins over the defaults).
    log_dir: where `<id>.stdout` / `<id>.stderr` go (default: a new temporary directory).
    cwd: working directory of the processes (default: the repository root).
    process_args: extra arguments for some processes, by id (a job whose processes were
      started with different command lines).
    process_env: extra environment for some processes, by id (wins over `env`); e.g. another
      XLA_FLAGS device count.

  Returns:
    A `Job`; pass it to `wait` and `kill` (or use `job` / `run`, which always clean up).

  Raises:
    ValueError: sizes that aren't positive or ids outside 0..N-1.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(f"num_processes={num_processes} and devices_per_process="
                     f"{devices_per_process} must be positive.")
  ids = list(range(num_processes) if process_ids is None else process_ids)
  if any(not 0 <= i < num_processes for i in ids) or len(set(ids)) != len(ids):
    raise ValueError(f"process_ids={ids} must be distinct ids in [0, {num_processes}).")
  port = port or free_port()
  address = f"127.0.0.1:{port}"
  logs = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="fnscale-job-"))
  logs.mkdir(parents=True, exist_ok=True)
  procs = []
  try:
    for i in ids:
      out_path, err_path = logs / f"{i}.stdout", logs / f"{i}.stderr"
      with open(out_path, "wb") as out, open(err_path, "wb") as err:
        extra = list((process_args or {}).get(i, ()))
        penv = {**(env or {}), **(process_env or {}).get(i, {})}
        popen = subprocess.Popen(
            [sys.executable, *map(str, argv), *extra], stdout=out, stderr=err,
            stdin=subprocess.DEVNULL, cwd=str(cwd or _REPO), start_new_session=True,
            env=child_env(port, num_processes, i, devices_per_process, penv))
      procs.append(Process(i, popen, out_path, err_path, time.monotonic()))
  except BaseException:
    kill(Job(tuple(procs), address, num_processes, logs))
    raise
  return Job(tuple(procs), address, num_processes, logs)


def _read(path: pathlib.Path) -> str:
  try:
    return path.read_bytes().decode("utf-8", errors="replace")
  except FileNotFoundError:
    return ""


def output(job: Job, process_id: int) -> tuple[str, str]:
  """(stdout, stderr) of one process so far."""
  p = _process(job, process_id)
  return _read(p.stdout_path), _read(p.stderr_path)


def _process(job: Job, process_id: int) -> Process:
  for p in job.processes:
    if p.process_id == process_id:
      return p
  raise ValueError(f"process {process_id} was not started in this job "
                   f"(started: {[p.process_id for p in job.processes]}).")


def wait_for_output(job: Job, process_id: int, pattern: str, timeout_s: float, *,
                    stream: str = "stdout") -> re.Match:
  """Waits until `pattern` (a regex) appears in a process's output; returns the match.

  Raises:
    TimeoutError: not seen within `timeout_s`, or the process exited without printing it
      (the message holds the output's tail).
  """
  p = _process(job, process_id)
  path = p.stdout_path if stream == "stdout" else p.stderr_path
  deadline = time.monotonic() + timeout_s
  while True:
    m = re.search(pattern, _read(path))
    if m:
      return m
    exited = p.popen.poll() is not None
    if exited or time.monotonic() > deadline:
      out, err = output(job, process_id)
      why = f"exited with {p.popen.returncode}" if exited else f"not within {timeout_s} s"
      raise TimeoutError(f"process {process_id}: {pattern!r} never appeared ({why}).\n"
                         f"--- stdout tail\n{out[-2000:]}\n--- stderr tail\n{err[-4000:]}")
    time.sleep(_POLL_S)


def signal_process(job: Job, process_id: int, sig: int = signal.SIGKILL) -> None:
  """Sends `sig` to one process's whole group (it runs in its own session)."""
  p = _process(job, process_id)
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(p.popen.pid, sig)


def kill(job: Job, sig: int = signal.SIGKILL) -> None:
  """Sends `sig` to every process group of the job that is still running, and for SIGKILL
  reaps them (bounded: a killed process is gone at once)."""
  for p in job.processes:
    if p.popen.poll() is None:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.popen.pid, sig)
  if sig == signal.SIGKILL:
    for p in job.processes:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.popen.wait(timeout=10)


def wait(job: Job, timeout_s: float) -> list[Result]:
  """Waits up to `timeout_s` seconds for every process, then kills those still running.

  Returns:
    One `Result` per started process, in start order. Exit times are observed by polling
    every 50 ms, so `elapsed_s` is accurate to about that.
  """
  deadline = time.monotonic() + timeout_s
  ended: dict[int, float] = {}
  while len(ended) < len(job.processes) and time.monotonic() < deadline:
    for p in job.processes:
      if p.process_id not in ended and p.popen.poll() is not None:
        ended[p.process_id] = time.monotonic() - p.started
    time.sleep(_POLL_S)
  late = [p for p in job.processes if p.process_id not in ended and p.popen.poll() is None]
  for p in job.processes:  # exited between the last poll and the deadline
    if p.process_id not in ended and p not in late:
      ended[p.process_id] = time.monotonic() - p.started
  kill(job)
  out = []
  for p in job.processes:
    stdout, stderr = output(job, p.process_id)
    timed_out = p in late
    out.append(Result(p.process_id, None if timed_out else p.popen.returncode, stdout, stderr,
                      ended.get(p.process_id, time.monotonic() - p.started), timed_out))
  return out


@contextlib.contextmanager
def job(argv: Sequence[str], num_processes: int, devices_per_process: int,
        **kwargs) -> Iterator[Job]:
  """`start` as a context manager: every process group is killed when the block ends,
  whether it returns or raises."""
  j = start(argv, num_processes, devices_per_process, **kwargs)
  try:
    yield j
  finally:
    kill(j)


def run(argv: Sequence[str], num_processes: int, devices_per_process: int, timeout_s: float,
        **kwargs) -> list[Result]:
  """Starts a job, waits at most `timeout_s` seconds for it, kills what is left.

  Keyword arguments are those of `start`. Returns one `Result` per process.
  """
  with job(argv, num_processes, devices_per_process, **kwargs) as j:
    return wait(j, timeout_s)


def records(text: str) -> list[dict]:
  """The JSON objects printed in `text`, one per line, in order.

  Another library can write into the same stream at the same moment (Gloo's C++ lines, from
  a thread of its own, land mid-line), so a record is found wherever on its line it starts
  and whatever follows it; a line without one is skipped.
  """
  found, decoder = [], json.JSONDecoder()
  for line in text.splitlines():
    start = line.find("{")
    while start >= 0:
      try:
        value, _ = decoder.raw_decode(line, start)
      except json.JSONDecodeError:
        start = line.find("{", start + 1)
        continue
      if isinstance(value, dict):
        found.append(value)
      break
  return found


def describe(results: Sequence[Result], tail: int = 3000) -> str:
  """A readable account of each process's end and the tail of its output, for assertions."""
  parts = []
  for r in results:
    state = "still running at the deadline (killed)" if r.timed_out else f"rc={r.returncode}"
    parts.append(f"=== process {r.process_id}: {state} after {r.elapsed_s:.1f} s\n"
                 f"--- stdout\n{r.stdout[-tail:]}\n--- stderr\n{r.stderr[-tail:]}")
  return "\n".join(parts)


def initialize_from_env(**kwargs):
  """In a child: `fnscale.initialize` with the place the launcher put in the environment.

  Keyword arguments (timeouts, config) go to `fnscale.initialize`. Without the variables, a single
  process (no-op initialise).
  """
  import fnscale  # pylint: disable=import-outside-toplevel
  # The launcher drops TPU layout variables: libtpu, if a TPU target loads it, stays quiet.
  fnscale.quiet_libtpu()
  return fnscale.initialize(**kwargs)  # reads the JAX_* variables the launcher set
