"""Two processes given one process_id are named on every process in seconds (real processes
on 127.0.0.1, each joining with `fnscale.initialize` from the launcher's environment)."""
import os
import pathlib
import re
import socket
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

from fnscale.multihost import _rollcall  # pylint: disable=g-import-not-at-top,wrong-import-position
from fnscale import DistributedArgumentError, DistributedError  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.multiprocess

# Joins, prints its place, exits; a DistributedError goes to stderr with status 75. JAX's own
# join timeout (60 s) is far above the bound, so only the roll call can end a process in time.
JOIN = """
import sys, fnscale
from fnscale import DistributedError
try:
  info = fnscale.initialize(timeout_s=60)
except DistributedError as e:
  print(f"fnscale.DistributedError: {e}", file=sys.stderr, flush=True)
  sys.exit(75)
print(f"joined {info.process_id} of {info.num_processes}", flush=True)
"""
BOUND_S = 30  # seconds from a process's start (python and jax imports included, loaded host)
JOB_TIMEOUT_S = 90


def _run(num_processes, ids, env=None):
  overrides = {i: {"JAX_PROCESS_ID": str(pid)} for i, pid in enumerate(ids) if pid != i}
  return mp.run(["-c", JOIN], num_processes, 1, JOB_TIMEOUT_S, env=env,
                process_env=overrides)


@pytest.mark.parametrize("ids,dup", [((0, 1, 1), 1),
                                     pytest.param((0, 0), 0, marks=pytest.mark.slow),
                                     pytest.param((1, 0, 1), 1, marks=pytest.mark.slow)])
def test_a_process_id_given_twice_ends_every_process_named(ids, dup):
  results = _run(len(ids), ids)
  messages = set()
  for r in results:
    print(f"process {r.process_id}: status {r.returncode} after {r.elapsed_s:.1f} s")
    assert r.returncode == 75, mp.describe(results)
    m = re.search(r"fnscale\.DistributedError: (.*)", r.stderr)
    assert m and f"process_id {dup} was given to 2 processes" in m.group(1), mp.describe(results)
    assert "newer incarnation" not in r.stderr and "joined" not in r.stdout
    assert r.elapsed_s < BOUND_S, mp.describe(results)
    messages.add(m.group(1))
  assert len(messages) == 1, messages  # the same text everywhere, both pids named
  assert len(re.findall(r"pid \d+", messages.pop())) == 2


@pytest.mark.slow  # the quick tier's time: every quick multi-process test launches through the roll call
def test_a_normal_launch_joins_with_the_roll_call():
  results = _run(3, (0, 1, 2))
  for r in results:
    assert r.returncode == 0, mp.describe(results)
    assert f"joined {r.process_id} of 3" in r.stdout


def test_roll_call_switched_off_is_skipped(monkeypatch):
  monkeypatch.setenv(_rollcall.ENV_PORT, "off")
  start = time.monotonic()
  # Process 0 of 2 with nobody else: with the roll call on it would wait ROLL_WAIT_S.
  assert _rollcall.check("127.0.0.1:1", 2, 0, 60) == 60
  assert time.monotonic() - start < 1


def test_a_bad_port_setting_is_named(monkeypatch):
  monkeypatch.setenv(_rollcall.ENV_PORT, "70000")
  with pytest.raises(DistributedArgumentError, match=r"FNSCALE_ROLLCALL_PORT='70000'"):
    _rollcall.check("127.0.0.1:1234", 2, 1, 5)


def test_a_foreign_listener_on_the_port_is_ignored(monkeypatch):
  """Another program holds the roll call's port and answers something else: process 1 joins
  as if there were no roll call, without waiting."""
  with socket.socket() as other, socket.socket() as coordinator:
    other.bind(("127.0.0.1", 0))
    other.listen()
    coordinator.bind(("127.0.0.1", 0))
    coordinator.listen()

    def serve():
      conn, _ = other.accept()
      with conn:
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setenv(_rollcall.ENV_PORT, str(other.getsockname()[1]))
    address = f"127.0.0.1:{coordinator.getsockname()[1]}"
    assert _rollcall.check(address, 2, 1, 60) > 57
    thread.join(5)


def test_latecomers_are_still_checked(monkeypatch):
  """Process 0 stops waiting for the roll after ROLL_WAIT_S and joins; a process that
  announces itself later still learns whether its id is taken, at once."""
  monkeypatch.setattr(_rollcall, "ROLL_WAIT_S", 0.5)
  address = f"127.0.0.1:{mp.free_port()}"
  assert _rollcall.check(address, 3, 0, 30) > 28  # nobody came: joins after 0.5 s
  start = time.monotonic()
  assert _rollcall.check(address, 3, 1, 30) > 28  # a late process 1: fine
  with pytest.raises(DistributedError, match=r"process_id 1 was given to 2 processes"):
    _rollcall.check(address, 3, 1, 30)  # a second late process 1
  with pytest.raises(DistributedError, match=r"process_id 0 was given to 2 processes"):
    _rollcall.check(address, 3, 0, 30)  # a late second process 0
  assert time.monotonic() - start < 3


def test_a_different_process_count_is_named_too():
  address = f"127.0.0.1:{mp.free_port()}"
  errors = {}

  def process_0():
    try:
      _rollcall.check(address, 2, 0, 30)
    except DistributedError as e:
      errors[0] = str(e)
  thread = threading.Thread(target=process_0)
  thread.start()
  with pytest.raises(DistributedError) as e:
    _rollcall.check(address, 3, 1, 30)
  thread.join(10)
  assert str(e.value).startswith("process 1 (host ") and errors[0] == str(e.value)
  assert "was started for a 3-process job, process 0 for a 2-process job" in errors[0]
