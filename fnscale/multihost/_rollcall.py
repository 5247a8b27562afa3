"""A roll call before the join: two processes given one `process_id` are named in seconds.

JAX's coordination service can't say it: with ids 0, 1, 1 the second process 1 replaces the
first ("ALREADY_EXISTS ... newer incarnation"), which aborts from C++, and the others wait out
the join timeout saying not every process registered. So before `jax.distributed.initialize`
process 0 listens on the coordinator's host at the coordinator's port + 1, every other process
connects there and sends one JSON line (its id, host, pid and process count), and process 0
answers every connection with the whole roll once it holds `num_processes` entries (or after
`ROLL_WAIT_S`). Each process then raises the same `DistributedError` for an id given twice (or
a process count that differs). A second process with id 0 finds the port taken and announces
itself to the first instead.

The port: `FNSCALE_ROLLCALL_PORT` (an integer) overrides the coordinator port + 1; "off" skips
the roll call (e.g. when only the coordinator port is open between hosts). It never stops a
job from forming: a process that can't reach the roll call falls through to JAX's join as soon
as the coordinator port accepts connections (process 0 has moved on); process 0 waits at most
`ROLL_WAIT_S` for the roll, then answers latecomers from a daemon thread until `timeout_s`
(a latecomer whose id is taken learns it; the others have joined by then). Anything on the
port that doesn't speak this protocol is ignored (a process waits at most
`ROLL_WAIT_S` + 5 s for its answer).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

from absl import logging

from fnscale._errors import DistributedArgumentError, DistributedError

ENV_PORT = "FNSCALE_ROLLCALL_PORT"
ROLL_WAIT_S = 10.0  # process 0's wait for the whole roll before joining anyway
_MAGIC = "fnscale-rollcall-1"
_LINE_BYTES = 4096
_POLL_S = 0.1


def _port(coordinator_address: str) -> int | None:
  """The roll call's TCP port, or None when it is switched off."""
  setting = os.environ.get(ENV_PORT, "").strip().lower()
  if setting in ("off", "none", "false", "0"):
    return None
  if setting:
    if not setting.isdigit() or not 0 < int(setting) < 65536:
      raise DistributedArgumentError(
          f"{ENV_PORT}={setting!r}, expected a TCP port in [1, 65535] or 'off'; fix: set the "
          "same value on every process, or unset it.")
    return int(setting)
  port = int(coordinator_address.rpartition(":")[2]) + 1
  return port if port < 65536 else None


def _send(conn: socket.socket, message: dict) -> None:
  try:
    conn.sendall((json.dumps(message) + "\n").encode())
  except OSError:
    pass


def _read(conn: socket.socket, timeout_s: float) -> dict | None:
  """One JSON line of this protocol from `conn`, or None (timeout, garbage, closed)."""
  conn.settimeout(max(0.05, timeout_s))
  data = b""
  try:
    while b"\n" not in data and len(data) < _LINE_BYTES:
      chunk = conn.recv(_LINE_BYTES)
      if not chunk:
        break
      data += chunk
    message = json.loads(data.split(b"\n")[0])
  except (OSError, ValueError):
    return None
  return message if isinstance(message, dict) and message.get("magic") == _MAGIC else None


def _listen(host: str, port: int) -> socket.socket | str | None:
  """A listening socket on `host:port`; "taken" when another process holds it; None when
  this host can't listen there (the coordinator address isn't one of its own)."""
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  # A port left in TIME_WAIT by an earlier connection is free to listen on; a second
  # listener still gets EADDRINUSE on Linux (SO_REUSEADDR is not SO_REUSEPORT).
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
    sock.listen(128)
    return sock
  except OSError as e:
    sock.close()
    return "taken" if e.errno == errno.EADDRINUSE else None


def _accept_one(listener: socket.socket, me: dict, deadline: float):
  """(entry, connection) of the next process that announces itself, or None at `deadline`."""
  while time.monotonic() < deadline:
    listener.settimeout(max(0.05, min(_POLL_S * 5, deadline - time.monotonic())))
    try:
      conn, _ = listener.accept()
    except (socket.timeout, OSError):
      continue
    entry = _read(conn, min(2.0, max(0.05, deadline - time.monotonic())))
    if entry is None or entry.get("job") != me["job"]:
      conn.close()  # not a process of this job
      continue
    return entry, conn
  return None


def _latecomers(listener: socket.socket, me: dict, roll: list, until: float) -> None:
  """Answers processes that announce themselves after the roll closed (daemon thread)."""
  try:
    while True:
      got = _accept_one(listener, me, until)
      if got is None:
        return
      roll = roll + [got[0]]  # so a second latecomer with one id is caught too
      _send(got[1], {"magic": _MAGIC, "roll": roll})
      got[1].close()
  finally:
    listener.close()


def _gather(listener: socket.socket, me: dict, num_processes: int, wait_s: float,
            timeout_s: float) -> list:
  """Process 0: collects the roll (this process first), answers everyone with it."""
  roll, conns = [me], []
  deadline = time.monotonic() + wait_s
  while len(roll) < num_processes:
    got = _accept_one(listener, me, deadline)
    if got is None:
      logging.info("roll call: %d of %d processes announced within %.0f s; joining anyway",
                   len(roll), num_processes, wait_s)
      break
    roll.append(got[0])
    conns.append(got[1])
  for conn in conns:
    _send(conn, {"magic": _MAGIC, "roll": roll})
    conn.close()
  if _problem(roll, me) is None:
    threading.Thread(target=_latecomers, args=(listener, me, roll, time.monotonic() + timeout_s),
                     name="fnscale-rollcall", daemon=True).start()
  else:
    listener.close()
  return roll


def _coordinator_up(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=0.5):
      return True
  except OSError:
    return False


def _announce(host: str, port: int, coordinator_port: int, me: dict, timeout_s: float,
              wait_for_coordinator: bool) -> list | None:
  """Any process but the listening one: sends its entry, returns the roll (None: no answer
  in time, or process 0 already moved on)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      conn = socket.create_connection((host, port), timeout=1.0)
    except OSError:
      if wait_for_coordinator and _coordinator_up(host, coordinator_port):
        return None  # process 0 joined JAX without a roll call reachable from here
      time.sleep(_POLL_S)
      continue
    with conn:
      _send(conn, me)
      answer = _read(conn, min(deadline - time.monotonic(), ROLL_WAIT_S + 5.0))
    roll = answer.get("roll") if answer else None
    return roll if isinstance(roll, list) else None
  return None


def _problem(roll: list, me: dict) -> str | None:
  """What is wrong with the roll (the same text on every process), or None."""
  def who(e):
    return f"host {e.get('host')} pid {e.get('pid')}"
  counts = {}
  for e in roll:
    counts.setdefault(e.get("process_id"), []).append(e)
  n = roll[0].get("num_processes")  # process 0's (the roll starts with it): one text for all
  for pid, entries in sorted(counts.items(), key=lambda kv: str(kv[0])):
    if len(entries) > 1:
      return (f"process_id {pid} was given to {len(entries)} processes "
              f"({', '.join(map(who, entries))}) of the {n}-process job at {me['job']}; fix: "
              f"give each process its own process_id in [0, {n}) (JAX_PROCESS_ID, or the "
              "launcher's rank).")
  other = [e for e in roll if e.get("num_processes") != n]
  if other:
    e = other[0]
    return (f"process {e.get('process_id')} ({who(e)}) was started for a "
            f"{e.get('num_processes')}-process job, process 0 for a {n}-process job at "
            f"{me['job']}; fix: give every process the same num_processes.")
  return None


def check(coordinator_address: str | None, num_processes: int | None,
          process_id: int | None, timeout_s: float) -> float:
  """The roll call (see the module docstring) before joining with `timeout_s` seconds;
  returns the seconds left of them (at least 1).

  Raises:
    DistributedError: a process_id given to several processes, or processes started with
      different process counts (the same message on every process that took part); a bad
      `FNSCALE_ROLLCALL_PORT`.
  """
  if coordinator_address is None or num_processes is None or process_id is None:
    return timeout_s
  port = _port(coordinator_address)
  if port is None:
    return timeout_s
  start = time.monotonic()
  host, _, coordinator_port = coordinator_address.rpartition(":")
  host = host.strip("[]")
  me = {"magic": _MAGIC, "job": coordinator_address, "process_id": process_id,
        "num_processes": num_processes, "host": socket.gethostname(), "pid": os.getpid()}
  listener = _listen(host, port) if process_id == 0 else "taken"
  if isinstance(listener, socket.socket):
    roll = _gather(listener, me, num_processes, min(ROLL_WAIT_S, timeout_s), timeout_s)
  elif listener == "taken":
    # Another process 0 may hold the port: announce to it, but never wait for the
    # coordinator, which this process itself would start.
    roll = _announce(host, port, int(coordinator_port), me,
                     timeout_s if process_id else min(ROLL_WAIT_S + 5.0, timeout_s),
                     wait_for_coordinator=bool(process_id))
  else:
    roll = None
  problem = _problem(roll, me) if roll else None
  if problem is not None:
    raise DistributedError(problem)
  return max(1.0, timeout_s - (time.monotonic() - start))
