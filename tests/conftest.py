"""Simulated devices must be set before jax initialises its backend."""
import os

# Compiling dominates the suite's time: XLA's CPU backend without its LLVM optimisations
# compiles about twice as fast (fnscale.report.fast_compile_options, here for every program
# and, through the environment, every process the tests start). The optimized HLO, and so
# every FLOP, byte and sharding the tests count, is unchanged; the programs run slower.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes may load libtpu (for TPU ahead-of-time compiles) at once; its
# machine-wide lock would otherwise fail all but the first.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


import pytest


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
