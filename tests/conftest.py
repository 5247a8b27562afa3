"""Simulated devices must be set before jax initialises its backend.

Two ways to run the suite:
- the CPU tiers (`python -m pytest -q`, `-m slow`): every process on 8 simulated CPU devices
  (JAX_PLATFORMS=cpu), compiled with XLA's quicker CPU options (below);
- the chip tier (`python -m pytest -q -m chip` on a TPU VM): only the `test_chip*.py`
  modules, in one process on JAX's default platform, the TPU, with its CPU backend beside it;
  nothing of this file's CPU set-up applies (tests/test_chip.py says what the tier checks).
  Where the machine has no accelerator, it runs as the CPU tiers do and its tests skip.
"""
import os
import pathlib
import re
import subprocess
import sys

# Compiling dominates the suite's time: XLA's CPU backend without its LLVM optimisations
# compiles about twice as fast (fnscale.analysis.report.fast_compile_options, here for every
# program and, through the environment, every process the tests start). The optimized HLO, and
# so every FLOP, byte and sharding the tests count, is unchanged; the programs run slower.
_FAST = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Where XLA still has its older CPU code generator (jax 0.10; later XLAs dropped the flag),
# programs compile in about 0.6x the time with it. Matmul FLOPs, collectives and shardings
# are unchanged, temporaries within 0.1% (a GPT and a Llama step on 8 devices, both ways);
# elementwise ops fuse differently, and scatters become while loops (it has no scatter
# kernel): a test that counts loops compiles with `default_cpu_codegen` (below).
_EMITTERS = "xla_cpu_use_fusion_emitters"
_LEGACY_EMITTERS = f" --{_EMITTERS}=false"
_CHIP_MODULES = "test_chip*.py"  # the chip tier's modules, collected alone under -m chip


def _xla_accepts(flags: str) -> bool:
  """Whether this jaxlib's XLA takes `flags` in XLA_FLAGS: it ends the process on one it
  doesn't know, so a child process tries (about a second, once per run)."""
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                     capture_output=True, timeout=300, check=False)
  return r.returncode == 0


def _chip_tier(markexpr: str) -> bool:
  """Whether a `-m` expression asks for the chip tier: it names `chip`, not as `not chip`."""
  words = re.findall(r"\w+", markexpr or "")
  return any(w == "chip" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def _simulated_cpu_devices() -> None:
  """The CPU tiers' environment, for this process (jax imported, no backend started yet)
  and every process the tests start."""
  import jax  # pylint: disable=import-outside-toplevel
  chosen = _EMITTERS in os.environ.get("XLA_FLAGS", "")  # the user's choice stands
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST
      + ("" if chosen or not _xla_accepts(_LEGACY_EMITTERS) else _LEGACY_EMITTERS)
  ).strip()
  if not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")  # jax read the variable at its import
  # Several test processes may load libtpu (for TPU ahead-of-time compiles) at once; its
  # machine-wide lock would otherwise fail all but the first.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# Without a TPU, libtpu (loaded for those compiles) prints host-lookup warnings unless told
# this is one host; importing fnscale changes no environment variable, so ask for it here.
# (On a TPU VM it does nothing.)
import fnscale.topology  # noqa: E402  pylint: disable=wrong-import-position
fnscale.topology.quiet_libtpu()


import pytest


# Every program the tests compile (jit calls and ahead-of-time compiles, CPU and TPU) is read
# by `fnscale.analysis.hlo.summarize` as it is compiled, and a test whose programs hold anything the
# reader could not read fails at teardown: the suite's programs are the reader's corpus, at
# no extra compile. `MeshComputation.compile` is the one place every jit and AOT compile
# passes (private jax, jax 0.10 and 0.12 alike; tests only).
_UNREAD: list = []  # (program, fnscale.analysis.hlo.Unread or the error reading it) of the running test


def _read_every_compile():
  import functools  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import pxla  # pylint: disable=import-outside-toplevel
  from fnscale.analysis import hlo  # pylint: disable=import-outside-toplevel
  compile_ = pxla.MeshComputation.compile

  @functools.wraps(compile_)
  def compile_and_read(self, *args, **kwargs):
    executable = compile_(self, *args, **kwargs)
    try:
      unread = hlo.summarize(executable.as_text() or "").unread
    except Exception as e:  # pylint: disable=broad-except
      _UNREAD.append((self._name, f"not read ({type(e).__name__}: {e})"))
    else:
      if unread.count:
        _UNREAD.append((self._name, unread))
    return executable
  pxla.MeshComputation.compile = compile_and_read


_read_every_compile()


@pytest.fixture(autouse=True)
def hlo_read_in_full(request):
  """Fails a test whose compiled programs `fnscale.analysis.hlo.summarize` could not read in full;
  `@pytest.mark.hlo_unread_loops` allows loops whose trip count is data (none to read)."""
  yield
  # Programs compiled since the last test's end, so a module fixture's count to its first test.
  unread, _UNREAD[:] = list(_UNREAD), []
  data_loops = request.node.get_closest_marker("hlo_unread_loops") is not None
  found = [(name, u._replace(loops=()) if data_loops and not isinstance(u, str) else u)
           for name, u in unread]
  found = [f"{name}: {u}" for name, u in found if isinstance(u, str) or u.count]
  assert not found, "HLO the reader could not read:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def work(tmp_path_factory, request):
  """A module's working directory with a small text corpus (`corpus.txt`: the first stdlib
  files, ~300 KB) for recipe runs, which also put their shared compile cache there."""
  from recipes.lm import data  # pylint: disable=import-outside-toplevel
  d = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
  text = bytearray()
  for f in data.corpus_files(None):
    text += pathlib.Path(f).read_bytes()
    if len(text) > 300_000:
      break
  (d / "corpus.txt").write_bytes(bytes(text))
  return d


@pytest.fixture(scope="session")
def tpu_devices():
  """`tpu_devices(name, **kw)`: libtpu's described devices for a TPU topology such as
  "v5p:2x2x2" (ahead-of-time compiles on a machine without a TPU). Skips only when libtpu is
  not installed; any other failure (a jax or libtpu upgrade that breaks the call) fails."""
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu not installed; install fnscale[tpu]")
  from jax.experimental import topologies

  def get(name, **kw):
    return topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices

  return get


_ON_THE_CHIP = pytest.StashKey[bool]()


def pytest_configure(config):
  """The chip tier where asked for on a machine with an accelerator, else the CPU tiers."""
  chip = _chip_tier(config.option.markexpr) and fnscale.topology.has_accelerator()
  config.stash[_ON_THE_CHIP] = chip
  if not chip:
    _simulated_cpu_devices()


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
  """A test that asks for libtpu's described devices (`tpu_devices`) is a `tpu` test: the
  marker selects (or leaves out) exactly what needs the tpu extra."""
  for item in items:
    if "tpu_devices" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("tpu"):
      item.add_marker(pytest.mark.tpu)


def pytest_ignore_collect(collection_path, config):
  """Under -m chip, only the chip tier's modules: the others expect 8 simulated devices."""
  if (_chip_tier(config.option.markexpr) and collection_path.suffix == ".py"
      and not collection_path.match(_CHIP_MODULES)):
    return True
  return None


@pytest.fixture(scope="session")
def default_cpu_codegen():
  """Compiler options that give a program XLA's default CPU code generator, for a test that
  counts what the older one changes (its scatter loops); {} where the suite runs the
  default."""
  return {_EMITTERS: True} if _LEGACY_EMITTERS.strip() in os.environ.get("XLA_FLAGS", "") \
      else {}


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
  """Runs the test under each of XLA's sharding propagations: Shardy (jax's default) and
  GSPMD (`jax_use_shardy_partitioner` off); `parametrize(..., indirect=True)` picks one."""
  import jax
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", before)


def pytest_terminal_summary(terminalreporter, config):
  """The random order's seed under the results, also with -q (which hides pytest-randomly's
  header line): `--randomly-seed=N` repeats the order."""
  seed = getattr(config.option, "randomly_seed", None)
  if isinstance(seed, int):
    terminalreporter.write_line(f"random order: --randomly-seed={seed} repeats it "
                                "(-p no:randomly keeps file order)")
