"""fnscale.multihost.preemption_guard in one process: SIGTERM becomes should_stop, and a notice the loop can't
honour in time (or one while the job forms) ends the process with status 143 and a message.
The multi-process cases (one notice, staggered notices, a notice at a barrier) are in
tests/test_multihost.py."""
import os
import re
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fnscale as fs

REPO = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.Popen:
  """A Python child (no `timeout` wrapper: its status is the child's own); callers bound
  every wait and kill its group."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
  env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


def _reap(p: subprocess.Popen) -> None:
  if p.poll() is None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def test_sigterm_makes_should_stop_true_and_the_handler_comes_back():
  before = signal.getsignal(signal.SIGTERM)
  with fs.multihost.preemption_guard(grace_s=60) as should_stop:
    assert should_stop(0) is False
    os.kill(os.getpid(), signal.SIGTERM)  # without the guard this would end pytest
    deadline = time.monotonic() + 10
    step = 1
    while not should_stop(step) and time.monotonic() < deadline:
      time.sleep(0.05)
      step += 1
    assert should_stop(step) is True
  assert signal.getsignal(signal.SIGTERM) == before


def test_bad_arguments_are_named():
  with pytest.raises(fs.DistributedArgumentError,
                     match=r"grace_s=0, expected a positive number"):
    with fs.multihost.preemption_guard(grace_s=0):
      pass
  with fs.multihost.preemption_guard() as should_stop:
    with pytest.raises(fs.DistributedArgumentError,
                       match=r"should_stop\(step='3'\): expected the int"):
      should_stop("3")
  raised = []

  def enter():  # Python sets signal handlers only in the main thread
    try:
      with fs.multihost.preemption_guard():
        pass
    except fs.FnscaleError as e:
      raised.append(e)

  worker = threading.Thread(target=enter)
  worker.start()
  worker.join()
  assert (len(raised) == 1 and isinstance(raised[0], fs.InputError)
          and "must be entered in the main thread" in str(raised[0])), raised


def test_a_notice_the_loop_does_not_honour_ends_the_process_after_grace():
  """The main thread is busy (a compile, a data wait) when SIGTERM comes: the watcher ends the
  process grace_s later, with the message and status 143."""
  p = _python("""
      import os, signal, sys, time
      import fnscale as fs
      with fs.multihost.preemption_guard(grace_s=1) as should_stop:
        print("in", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(60)  # never reaches should_stop
      print("not ended", flush=True)
      """)
  try:
    out, err = p.communicate(timeout=150)
  finally:
    _reap(p)
  assert p.returncode == fs.multihost.EXIT_PREEMPTED, (out, err[-3000:])
  assert out == "in\n"
  # grace_s=1: the watcher ends it a second after the notice (more when the machine is busy).
  assert re.search(r"fnscale\.DistributedError: preemption notice (\d+) s ago and "
                   r"process 0 is still reaching the agreed step", err), err[-3000:]
  assert 1 <= int(re.search(r"preemption notice (\d+) s ago", err).group(1)) <= 10


@pytest.mark.slow
def test_a_notice_while_the_job_forms_ends_initialize_at_once():
  """Process 0 of 2 waits for a process that never comes; SIGTERM ends it within seconds,
  not at the 120-s join timeout."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  p = _python(f"""
      from absl import logging
      logging.set_verbosity(logging.INFO)
      import fnscale as fs
      fs.initialize("127.0.0.1:{port}", 2, 0, timeout_s=120)
      print("joined", flush=True)
      """)
  try:
    deadline = time.monotonic() + 150
    seen = ""
    while "joining a 2-process job" not in seen and time.monotonic() < deadline:
      time.sleep(0.2)
      seen += os.read(p.stderr.fileno(), 1 << 16).decode(errors="replace")
    assert "joining a 2-process job" in seen, seen[-3000:]
    time.sleep(1.0)  # inside jax.distributed.initialize now
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
  finally:
    _reap(p)
  assert p.returncode == fs.multihost.EXIT_PREEMPTED, (out, (seen + err)[-3000:])
  assert ("fnscale.DistributedError: preemption notice (SIGTERM) while the 2-process job "
          f"was forming at 127.0.0.1:{port} (this is process 0): stopping now") in seen + err
  assert "joined" not in out
  print(f"initialize ended {took:.1f} s after SIGTERM")
  assert took < 10


def test_a_notice_during_a_compile_reaches_stderr():
  """While a compile captures file descriptor 2 (for XLA's warnings), the watcher thread ends
  the process: fnscale's line, and what XLA had written so far, still reach stderr. The
  stand-in for XLA writes to fd 2 from below Python, as XLA's C++ logging does, then blocks
  like a long compile."""
  p = _python("""
      import os, signal, time
      import fnscale as fs
      from fnscale import _compiler

      class Lowered:  # XLA's side of a compile: a C++ log line on fd 2, then a long compile
        def as_text(self):
          return "module @m {}"
        def compile(self, compiler_options=None):
          os.write(2, b"W0101 00:00:00.000000 1 spmd.cc:1] xla line before the notice\\n")
          os.kill(os.getpid(), signal.SIGTERM)
          time.sleep(60)

      with fs.multihost.preemption_guard(grace_s=0.5):
        _compiler.compile_lowered(Lowered())
      """)
  try:
    out, err = p.communicate(timeout=150)
  finally:
    _reap(p)
  assert p.returncode == fs.multihost.EXIT_PREEMPTED, (out, err[-3000:])
  assert "xla line before the notice" in err
  assert re.search(r"fnscale\.DistributedError: preemption notice 0.5 s ago and process "
                   r"0 is still reaching the agreed step \(a long compile", err), err[-3000:]


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_another_thread_ending_the_process_during_a_compile_reaches_stderr():
  """A thread that ends the process with a message (`exit_with`, as a lost peer does) while a
  compile captures fd 2: the message and XLA's lines so far reach stderr."""
  p = _python("""
      import os, sys, threading, time
      from fnscale import _compiler
      from fnscale.multihost import _coordination
      from fnscale import DistributedError
      started = threading.Event()

      class Lowered:
        def as_text(self):
          return "module @m {}"
        def compile(self, compiler_options=None):
          os.write(2, b"W0101 00:00:00.000000 1 spmd.cc:1] partitioner warning\\n")
          started.set()
          time.sleep(60)

      def leave():
        started.wait()
        _coordination.exit_with(DistributedError("lost process 1 of 2: peer gone"), 75)
      threading.Thread(target=leave, daemon=True).start()
      _compiler.compile_lowered(Lowered())
      """)
  try:
    out, err = p.communicate(timeout=150)
  finally:
    _reap(p)
  assert p.returncode == 75, (out, err[-3000:])
  assert "partitioner warning" in err
  assert "fnscale.DistributedError: lost process 1 of 2: peer gone" in err


def test_the_capture_gives_the_descriptor_back_and_reads_xla_lines(capfd):
  """In a process that goes on, the capture returns XLA's lines, echoes them, and leaves fd 2
  as it was."""
  from fnscale import _compiler  # pylint: disable=import-outside-toplevel

  class Lowered:
    def as_text(self):
      return "module @capture_test {}"

    def compile(self, compiler_options=None):
      os.write(2, b"W0101 00:00:00.000000 1 spmd.cc:1] involuntary full remat\n")
      return "compiled"

  compiled, _, warnings, from_cache, reused = _compiler.compile_lowered(Lowered())
  assert not from_cache and not reused
  assert (compiled, warnings) == ("compiled", ("involuntary full remat",))
  _compiler.release_stderr()  # nothing captured now: a no-op
  os.write(2, b"after\n")
  assert capfd.readouterr().err.endswith("involuntary full remat\nafter\n")


def test_a_guard_ends_its_watcher_before_its_pipe_is_closed(tmp_path):
  # A watcher left in select() on a closed pipe reads from the next file given its descriptor
  # number: a metrics file read back right after a run lost its first 64 bytes that way.
  text = "".join(f'{{"step": {i}, "loss": {i / 7}}}\n' for i in range(50))
  (tmp_path / "m.jsonl").write_text(text)
  threads = threading.active_count()
  for _ in range(20):
    with fs.multihost.preemption_guard() as should_stop:
      should_stop(0)
    assert threading.active_count() == threads  # the watcher ended with the guard
    assert (tmp_path / "m.jsonl").read_text() == text
