"""Runs a recipe as N processes on this machine, the way it runs on the hosts of a pod.

  python recipes/launch/launch_local.py --num_processes=2 --devices_per_process=4 -- \\
      recipes/train_lm.py --steps=200

Every process gets the same command and these environment variables, which
`fnscale.initialize` / the recipes read (`jax.distributed` on 127.0.0.1, a free port):

  JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>   process 0 runs the coordination service
  JAX_NUM_PROCESSES=<N>  JAX_PROCESS_ID=<i>
  XLA_FLAGS=... --xla_force_host_platform_device_count=<devices_per_process>
  JAX_PLATFORMS=cpu                          (unless already set)

so the job sees N x devices_per_process simulated CPU devices and CPU collectives (gloo) carry
the traffic between processes. Process 0's output is streamed; the others' is kept and shown
(the tail) when one fails. Any child failing, the timeout, Ctrl-C or SIGTERM stops every child
(SIGTERM first, so a recipe can checkpoint; SIGKILL after a grace period; at once where a
child was ended by a signal, which no save can complete without).

Supervision, the Ray launcher's rule (`classify`): a process preempted (143), lost (75) or
ended by a signal (kill -9, the OOM killer) stops the others and the whole job starts again at
once on a fresh coordinator port, up to `--max_restarts` times, each restart said in one line
when its cause is seen; recipes/train_lm.py resumes from its newest save (persistent or
emergency copy). Bad input (2) or an uncaught error is not restarted. The exit status is the
cause's (75 for a process ended by a signal, as the Ray launcher's); after the last restart,
or on a failure that isn't restarted, the launcher's one line about it is the last, an
`error:` line.

`launch(argv, num_processes, devices_per_process, timeout_s=...)` is the same as a function
(`supervise` also returns the restarts).
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple, Sequence

from absl import flags

_COUNT_FLAG = "--xla_force_host_platform_device_count="
GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping children
MAX_RESTARTS = 3  # the Ray launcher's default too
_PREFIX = "launch_local: "
EXIT_PREEMPTED = 143  # fnscale.multihost.EXIT_PREEMPTED (not imported: no jax here)
EXIT_JOB_FAILED = 75  # fnscale.multihost.EXIT_JOB_FAILED
EXIT_BAD_INPUT = 2


class Exit(NamedTuple):
  """How one process of an attempt ended: `returncode` (negative: a signal; None: unknown, its
  host was lost, `lost` says how). `process_id` None: the job's hosts couldn't be reserved."""
  process_id: int | None
  returncode: int | None
  lost: str = ""


class Verdict(NamedTuple):
  """What an attempt's first failure means: restart or not, why (words), exit status."""
  restart: bool
  why: str
  status: int


def cause_of(exits: Sequence[Exit]) -> Exit | None:
  """The failure that explains an attempt's end, among the processes that ended on their own
  (not those the launcher stopped): a lost process (its host gone, or ended by a signal the
  launcher didn't send) before a preemption (143), before a lost peer (75), before anything
  else (2, an uncaught error): what a lost host leaves in its peers is a symptom. Lowest process
  id among equals; None if none failed."""
  def rank(e: Exit):
    lost = bool(e.lost) or (e.returncode is not None and e.returncode < 0)
    order = 0 if lost else 1 if e.returncode == EXIT_PREEMPTED else (
        2 if e.returncode == EXIT_JOB_FAILED else 3)
    return order, e.process_id
  failed = [e for e in exits if e.lost or e.returncode != 0]
  return min(failed, key=rank) if failed else None


def classify(e: Exit) -> Verdict:
  """The supervision rule for the failure that ended an attempt (`cause_of`): restart after
  a preemption (143), a lost process (75) or a process ended by a signal (a kill -9, an OOM
  kill); not after bad input (2) or an uncaught error, which a restart doesn't heal."""
  rc = e.returncode
  if e.lost:
    return Verdict(True, e.lost, EXIT_JOB_FAILED)
  if rc == EXIT_PREEMPTED:
    return Verdict(True, f"process {e.process_id} exited with 143 (preempted)", EXIT_PREEMPTED)
  if rc == EXIT_JOB_FAILED:
    return Verdict(True, f"process {e.process_id} exited with 75 (lost or failed process)",
                   EXIT_JOB_FAILED)
  if rc is not None and rc < 0:
    name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
    return Verdict(True, f"process {e.process_id} was ended by {name} (lost process)",
                   EXIT_JOB_FAILED)
  if rc == EXIT_BAD_INPUT:
    return Verdict(False, f"process {e.process_id} exited with 2 (bad input or configuration)",
                   EXIT_BAD_INPUT)
  return Verdict(False, f"process {e.process_id} exited with {rc} (an uncaught error)",
                 rc if rc else 1)




def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, devices_per_process: int | None, port: int,
              base: dict[str, str] | None = None, *, host: str = "127.0.0.1") -> dict[str, str]:
  """Environment of child `process_id`: coordinator (`host:port`, process 0's), process count
  and id, and `devices_per_process` simulated CPU devices (None: the host's real devices)."""
  env = dict(os.environ if base is None else base)
  if devices_per_process is not None:
    xla = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(xla + [f"{_COUNT_FLAG}{devices_per_process}"])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.setdefault("JAX_PLATFORMS", "cpu")
  env["JAX_COORDINATOR_ADDRESS"] = f"{host}:{port}"
  env["JAX_NUM_PROCESSES"] = str(num_processes)
  env["JAX_PROCESS_ID"] = str(process_id)
  env["PYTHONUNBUFFERED"] = "1"
  return env


def command(argv: Sequence[str]) -> list[str]:
  """`argv` as a process's command line: a leading `*.py` runs under this interpreter."""
  argv = list(argv)
  if not argv:
    raise ValueError("launch: empty command; give a recipe, e.g. ['recipes/train_lm.py']")
  return [sys.executable] + argv if argv[0].endswith(".py") else argv


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
  """SIGTERM then, after `grace_s`, SIGKILL to each still-running child's process group
  (`grace_s` 0: SIGKILL at once)."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    try:
      os.killpg(p.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  for p in alive:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


class Options(NamedTuple):
  """`launch`'s keywords: how it runs and stops the children.

  `timeout_s`: wall-clock limit for the whole job in seconds (None: none); on expiry every
  child is stopped and reported with return code -SIGTERM or -SIGKILL. `env`: the base
  environment (default this process's). `cwd`: the children's working directory. `stream`:
  called with each line of process 0's output as it arrives (default: print it; pass
  `lambda line: None` to stay quiet). `grace_s`: seconds between SIGTERM and SIGKILL when
  stopping children. `max_restarts`: how many times the whole job starts again after a
  process is preempted, lost or killed (`classify`); 0: never. `timeout_s` spans them all.
  """
  timeout_s: float | None = None
  env: dict[str, str] | None = None
  cwd: str | None = None
  stream: Callable[[str], None] | None = None
  grace_s: float = GRACE_S
  max_restarts: int = MAX_RESTARTS


class Outcome(NamedTuple):
  """`supervise`'s result: `[(returncode, output), ...]` per process of the last attempt, the
  restarts made, and why the last attempt failed (`Verdict`; None when every process exited
  with 0)."""
  results: list[tuple[int, str]]
  restarts: int
  failure: Verdict | None


def launch(argv: Sequence[str], num_processes: int, devices_per_process: int,
           **options) -> list[tuple[int, str]]:
  """Runs `argv` as `num_processes` processes of one JAX job on this machine, supervised.

  Args:
    argv: the command; a leading `*.py` path runs under this Python interpreter.
    num_processes: processes to start (ids 0..N-1), all with the same command.
    devices_per_process: simulated CPU devices of each process.
    **options: the fields of `Options` (timeout_s, env, cwd, stream, grace_s, max_restarts).

  Returns:
    `[(returncode, output), ...]` per process of the last attempt, in id order; output is
    stdout and stderr interleaved. When one child fails, the others are stopped and show a
    negative (signal) return code, and the failure is streamed in one line (`final`).

  Raises:
    ValueError: a bad count or an empty command.
    TypeError: a keyword that is not a field of `Options`.
    KeyboardInterrupt: after stopping every child, when interrupted.
  """
  outcome = supervise(argv, num_processes, devices_per_process, **options)
  if outcome.failure is not None:
    stream = options.get("stream") or (lambda line: print(line, end="", flush=True))
    stream(f"{_PREFIX}{final(outcome, Options(**options).max_restarts)}\n")
  return outcome.results


def supervise(argv: Sequence[str], num_processes: int, devices_per_process: int,
              **options) -> Outcome:
  """`launch`, returning the `Outcome` (the restarts and the last failure, if any); each
  restart is streamed in one line, the last failure is left to the caller to say (`final`;
  launch_local.py's `error:` line)."""
  o = Options(**options)
  for name, v, least in (("num_processes", num_processes, 1),
                         ("devices_per_process", devices_per_process, 1),
                         ("max_restarts", o.max_restarts, 0)):
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
      raise ValueError(f"launch: {name}={v!r}, expected an int >= {least}")
  cmd = command(argv)
  stream = o.stream or (lambda line: print(line, end="", flush=True))
  deadline = None if o.timeout_s is None else time.monotonic() + o.timeout_s
  restarts = 0
  while True:
    # A restart is said once, when its cause is seen; the last failure is the Outcome's.
    cause, results = _attempt(cmd, num_processes, devices_per_process, o, stream, deadline,
                              functools.partial(_restart_line, restarts=restarts,
                                                max_restarts=o.max_restarts))
    if cause is None:
      return Outcome(results, restarts, None)
    verdict = classify(cause)
    if not verdict.restart or restarts >= o.max_restarts:
      return Outcome(results, restarts, verdict)
    restarts += 1


def _restart_line(cause: Exit, killed: bool, restarts: int, max_restarts: int) -> str | None:
  """The one line that says attempt `restarts` + 1 is restarted for `cause` (its peers
  stopped at once where `killed`), or None when it isn't (`final` says why)."""
  verdict = classify(cause)
  if not verdict.restart or restarts >= max_restarts:
    return None
  return (f"{_PREFIX}restart {restarts + 1} of {max_restarts}: {verdict.why}; stopping the "
          "others" + (" at once (no save completes without it)" if killed else "")
          + ", then the job starts again and resumes from its newest save\n")


def final(outcome: Outcome, max_restarts: int) -> str:
  """What ended a supervised job that failed (`outcome.failure`), in words: the cause and
  why it wasn't restarted."""
  v = outcome.failure
  return v.why + ("; not restarted: a restart doesn't heal it" if not v.restart else
                  f"; gave up after {outcome.restarts} restart(s) (max_restarts={max_restarts})")


def _attempt(cmd: list[str], num_processes: int, devices_per_process: int, o: Options, stream,
             deadline: float | None, says) -> tuple[Exit | None, list[tuple[int, str]]]:
  """One start of the whole job: (the failure that ended it, `cause_of` those that ended on
  their own, or None; `[(returncode, output), ...]`). Every child has ended when it returns;
  the timeout ends the supervision (its cause is not restarted). `says(cause, killed)`: the
  line streamed before the others are stopped, or None."""
  port = free_port()
  procs, outputs, readers, cause = [], [[] for _ in range(num_processes)], [], None

  def read(i, pipe):
    for line in iter(pipe.readline, ""):
      outputs[i].append(line)
      if i == 0:
        stream(line)
    pipe.close()

  try:
    for i in range(num_processes):
      p = subprocess.Popen(
          cmd, env=child_env(i, num_processes, devices_per_process, port, o.env), cwd=o.cwd,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
          start_new_session=True)  # its own process group: stopped with all its children
      procs.append(p)
      t = threading.Thread(target=read, args=(i, p.stdout), daemon=True)
      t.start()
      readers.append(t)
    stream(f"{_PREFIX}started " + ", ".join(f"process {i} pid {p.pid}"
                                             for i, p in enumerate(procs)) + "\n")
    while True:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
        # Those that ended on their own: what a lost process leaves in its peers is a symptom.
        cause = cause_of([Exit(i, c) for i, c in enumerate(codes) if c is not None])
        if cause is not None:
          # A process ended by a signal can't take part in a save: its peers would only wait
          # for it (and read the SIGTERM as a preemption), so they stop at once.
          killed = cause.returncode is not None and cause.returncode < 0
          line = says(cause, killed)
          if line:
            stream(line)
          stop(procs, 0.0 if killed else o.grace_s)
        break
      if deadline is not None and time.monotonic() > deadline:
        stream(f"{_PREFIX}timeout after {o.timeout_s} s; stopping every process\n")
        stop(procs, o.grace_s)
        break
      time.sleep(0.05)
  except BaseException:
    stop(procs, o.grace_s)
    raise
  finally:
    for t in readers:
      t.join(timeout=5)
  return cause, [(p.returncode, "".join(out)) for p, out in zip(procs, outputs)]


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("num_processes", 2, "processes to start", flag_values=fv)
  flags.DEFINE_integer("devices_per_process", 4, "simulated CPU devices per process",
                       flag_values=fv)
  flags.DEFINE_float("timeout_s", None, "stop every process after this many seconds, "
                     "restarts included", flag_values=fv)
  flags.DEFINE_integer("max_restarts", MAX_RESTARTS, "restarts after a process is preempted, "
                       "lost or killed", flag_values=fv)


def launcher_flags(argv: list[str], define_flags, doc: str, least: Sequence = ()):
  """A launcher's command line: `(flag values, the command after "--")`, or None after
  printing `doc` and the flags for `--help` (asked before the "--"). `least`: (name, the
  least value, what it means or "") of each int flag with a lower bound.

  Raises:
    absl.flags.Error: an unknown or malformed flag, or one below its least value (as
      `--name=value: expected ...; fix: ...`).
  """
  fv = flags.FlagValues()
  define_flags(fv)
  ours = list(argv[1:argv.index("--")] if "--" in argv else argv[1:])
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in ours):
    print(doc.strip() + "\n\nflags:\n" + fv.get_help(include_special_flags=False))
    return None
  rest = fv(list(argv))[1:]
  for name, low, meaning in least:
    flag = fv[name]
    if flag.value < low:
      raise flags.IllegalFlagValueError(
          f"--{name}={flag.value}: expected an int >= {low} ({flag.help}); fix: "
          f"--{name}={low}{f' ({meaning})' if meaning else ''} or more, or leave it out "
          f"for the default {flag.default}")
  return fv, rest


# launch_local.py's int flags: (name, least value, what that value means).
_LEAST = (("num_processes", 1, ""), ("devices_per_process", 1, ""),
          ("max_restarts", 0, "never restart"))


def main(argv: list[str]) -> int:
  """`launch_local.py [flags] -- RECIPE [recipe flags]`; returns the exit status."""
  try:
    parsed = launcher_flags(argv, _define_flags, __doc__, _LEAST)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if parsed is None:
    return 0
  fv, rest = parsed
  if not rest:
    print("error: no command; usage: launch_local.py --num_processes=2 "
          "--devices_per_process=4 -- recipes/train_lm.py [flags]", file=sys.stderr)
    return 2

  # SIGTERM (a preemption) reaches the children as SIGTERM too, so they can checkpoint.
  def on_term(signum, frame):
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, on_term)
  try:
    outcome = supervise(rest, fv.num_processes, fv.devices_per_process,
                        timeout_s=fv.timeout_s, max_restarts=fv.max_restarts)
  except KeyboardInterrupt:
    print("launch_local: interrupted; every process stopped", file=sys.stderr)
    return 130
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  results = outcome.results
  bad = [(i, rc, out) for i, (rc, out) in enumerate(results) if rc != 0]
  for i, rc, out in bad:
    if i != 0:
      tail = "".join(out.splitlines(keepends=True)[-20:])
      print(f"--- process {i} exited with {rc}; its last lines:\n{tail}", file=sys.stderr)
  if not bad:
    return 0
  failed = ", ".join(f"process {i} ({rc})" for i, rc, _ in bad)
  if outcome.failure is None:  # the timeout: every process was stopped
    print(f"error: launch_local: timeout after {fv.timeout_s} s ({failed}); raise "
          "--timeout_s", file=sys.stderr)
    return 1
  # The status of the child that failed on its own (2: bad input, 143: preempted, 75: lost
  # or killed), not of those stopped because of it.
  print(f"error: launch_local: {outcome.failure.why} ({failed}); " + (
      f"gave up after {outcome.restarts} restart(s): raise --max_restarts, or find what "
      "ends the process in its lines above" if outcome.failure.restart else
      "not restarted: fix what its lines above say"), file=sys.stderr)
  return outcome.failure.status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
