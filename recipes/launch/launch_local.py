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
(SIGTERM first, so a recipe can checkpoint; SIGKILL after a grace period). The exit status is
non-zero if any child failed.

`launch(argv, num_processes, devices_per_process, timeout_s=...)` is the same as a function.
"""
from __future__ import annotations

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
  """SIGTERM then, after `grace_s`, SIGKILL to each still-running child's process group."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    try:
      os.killpg(p.pid, signal.SIGTERM)
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
  stopping children.
  """
  timeout_s: float | None = None
  env: dict[str, str] | None = None
  cwd: str | None = None
  stream: Callable[[str], None] | None = None
  grace_s: float = GRACE_S


def launch(argv: Sequence[str], num_processes: int, devices_per_process: int,
           **options) -> list[tuple[int, str]]:
  """Runs `argv` as `num_processes` processes of one JAX job on this machine.

  Args:
    argv: the command; a leading `*.py` path runs under this Python interpreter.
    num_processes: processes to start (ids 0..N-1), all with the same command.
    devices_per_process: simulated CPU devices of each process.
    **options: the fields of `Options` (timeout_s, env, cwd, stream, grace_s).

  Returns:
    `[(returncode, output), ...]` per process in id order; output is stdout and stderr
    interleaved. When one child fails, the others are stopped and show a negative
    (signal) return code.

  Raises:
    ValueError: a bad count or an empty command.
    TypeError: a keyword that is not a field of `Options`.
    KeyboardInterrupt: after stopping every child, when interrupted.
  """
  o = Options(**options)
  for name, v in (("num_processes", num_processes), ("devices_per_process", devices_per_process)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"launch: {name}={v!r}, expected a positive int")
  cmd = command(argv)
  stream = o.stream or (lambda line: print(line, end="", flush=True))
  port = free_port()
  procs, outputs, readers = [], [[] for _ in range(num_processes)], []

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
    deadline = None if o.timeout_s is None else time.monotonic() + o.timeout_s
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        break
      if any(c not in (None, 0) for c in codes):
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        stream(f"launch_local: process {failed[0]} exited with {codes[failed[0]]}; "
               "stopping the others\n")
        stop(procs, o.grace_s)
        break
      if deadline is not None and time.monotonic() > deadline:
        stream(f"launch_local: timeout after {o.timeout_s} s; stopping every process\n")
        stop(procs, o.grace_s)
        break
      time.sleep(0.05)
  except BaseException:
    stop(procs, o.grace_s)
    raise
  finally:
    for t in readers:
      t.join(timeout=5)
  return [(p.returncode, "".join(out)) for p, out in zip(procs, outputs)]


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("num_processes", 2, "processes to start", flag_values=fv)
  flags.DEFINE_integer("devices_per_process", 4, "simulated CPU devices per process",
                       flag_values=fv)
  flags.DEFINE_float("timeout_s", None, "stop every process after this many seconds",
                     flag_values=fv)


def launcher_flags(argv: list[str], define_flags, doc: str):
  """A launcher's command line: `(flag values, the command after "--")`, or None after
  printing `doc` and the flags for `--help` (asked before the "--").

  Raises:
    absl.flags.Error: an unknown or malformed flag.
  """
  fv = flags.FlagValues()
  define_flags(fv)
  ours = list(argv[1:argv.index("--")] if "--" in argv else argv[1:])
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in ours):
    print(doc.strip() + "\n\nflags:\n" + fv.get_help(include_special_flags=False))
    return None
  return fv, fv(list(argv))[1:]


def main(argv: list[str]) -> int:
  """`launch_local.py [flags] -- RECIPE [recipe flags]`; returns the exit status."""
  try:
    parsed = launcher_flags(argv, _define_flags, __doc__)
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
    results = launch(rest, fv.num_processes, fv.devices_per_process, timeout_s=fv.timeout_s)
  except KeyboardInterrupt:
    print("launch_local: interrupted; every process stopped", file=sys.stderr)
    return 130
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  bad = [(i, rc, out) for i, (rc, out) in enumerate(results) if rc != 0]
  for i, rc, out in bad:
    if i != 0:
      tail = "".join(out.splitlines(keepends=True)[-20:])
      print(f"--- process {i} exited with {rc}; its last lines:\n{tail}", file=sys.stderr)
  if bad:
    print(f"launch_local: {len(bad)} of {len(results)} processes failed: "
          + ", ".join(f"process {i} ({rc})" for i, rc, _ in bad), file=sys.stderr)
    # The status of the child that failed on its own (2: bad input, 143: preempted), not
    # of those stopped because of it.
    own = [rc for _, rc, _ in bad if rc > 0]
    return own[0] if own else 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
