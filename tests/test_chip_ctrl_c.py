"""The chip tier: Ctrl-C while the main job compiles its step on the chip.

A Ctrl-C that lands inside XLA's compile raises KeyboardInterrupt in Python at once while
XLA goes on compiling in a thread of its own; tearing the runtime down under that compile
crashed the process on a TPU (SIGSEGV in `PjRtLoadedExecutable::Create`, a core dump) after
its "stopped by Ctrl-C" line. The job must end with exit status 130 and its one line, before
the interpreter's teardown. On the CPU the same moment is
`tests/test_train_lm.py::test_ctrl_c_at_any_moment_exits_130_with_one_line_saying_what_is_saved`.

The job runs in a process of its own, which needs the chip to itself: run this module in a
pytest process that has not opened the chip,

    python -m pytest -q -m chip tests/test_chip_ctrl_c.py

(under the whole `-m chip` tier, run after tests/test_chip.py in the same process, it skips
saying so). About a minute on one TPU v5e chip.
"""
import os
import subprocess
import sys

import pytest

from fnscale import _compat, _topology

pytestmark = pytest.mark.chip
_HOW = "on a TPU VM: python -m pytest -q -m chip tests/test_chip_ctrl_c.py"
if not _topology.has_accelerator():  # no device file: no backend need start to know
  pytest.skip(f"the chip tier runs on a TPU; this machine has none ({_HOW})",
              allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ctrl_c_while_the_main_job_compiles_on_the_chip_exits_130_without_a_crash(tmp_path):
  if os.environ.get("JAX_PLATFORMS") == "cpu":  # the CPU tiers on a TPU VM
    pytest.skip(f"the chip tier runs on a TPU; these tiers force the CPU ({_HOW})")
  if _compat.backends_initialized():
    pytest.skip(f"this pytest process holds the chip already, and the job needs it ({_HOW})")
  run_dir, hook = tmp_path / "run", tmp_path / "hook"
  # The command's defaults on a chip (GPT-2 small, seq 1024, the stdlib corpus): the step
  # compiles for tens of seconds, and the signal comes 0.3 s into it.
  cmd = [sys.executable, os.path.join(ROOT, "tests", "interrupt_worker.py"), "compile",
         f"--run_dir={run_dir}", "--steps=20", "--compile_cache_dir=", "--sample_len=0"]
  # The project first, then what the VM's own path holds (where its jax may be installed).
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, PYTHONPATH=path, HOOK_FILE=str(hook))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
  tail = out.stdout[-2000:] + out.stderr[-3000:]
  assert out.returncode == 130, f"exit status {out.returncode} (-11: SIGSEGV)\n{tail}"
  for crash in ("Segmentation fault", "Fatal Python error", "SIGSEGV", "core dumped",
                "Traceback"):
    assert crash not in out.stderr, tail
  said = [line for line in out.stderr.splitlines() if line.startswith("stopped by Ctrl-C")]
  assert said == ["stopped by Ctrl-C: nothing was saved yet; rerunning the same command "
                  "starts afresh"], tail
  assert out.stderr.strip().splitlines()[-1] == said[0], tail
  notes = hook.read_text().splitlines() if hook.exists() else []
  assert notes and notes[0].startswith("KeyboardInterrupt out of the compile"), notes
  assert "teardown" not in notes, notes
