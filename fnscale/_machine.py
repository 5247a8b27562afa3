"""This machine: its accelerator device files, libtpu's start-up environment, simulated CPU
devices, and the check that a value is a list of devices. None of it starts a jax backend.
"""
import glob
import importlib.util
import os
import types
from collections.abc import Mapping

from fnscale._errors import TopologyError


def check_devices(devices, name: str = "devices", error=TopologyError) -> list:
  """The devices as a non-empty list of `jax.Device` (real ones or libtpu's described ones).

  Raises:
    `error` (TopologyError by default): not a sequence of `jax.Device`, or empty.
  """
  import jax  # deferred: importing this module starts no backend
  expected = ("a non-empty sequence of jax.Device, e.g. jax.devices() or "
              "jax.experimental.topologies.get_topology_desc(...).devices")
  if isinstance(devices, (str, bytes, Mapping)) or not hasattr(devices, "__iter__"):
    raise error(f"{name}={devices!r} ({type(devices).__name__}): expected {expected}.")
  devices = list(getattr(devices, "flat", devices))  # a mesh's device array counts too
  bad = [d for d in devices if not isinstance(d, jax.Device)]
  if bad or not devices:
    got = f"element {bad[0]!r} ({type(bad[0]).__name__})" if bad else "an empty sequence"
    raise error(f"{name} has {got}: expected {expected}.")
  return devices


def _tpu_device_files() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def has_accelerator() -> bool:
  """Whether this machine shows a TPU (`/dev/accel*`, `/dev/vfio/N`) or NVIDIA GPU device
  file, without starting a jax backend."""
  return _tpu_device_files() or bool(glob.glob("/dev/nvidia[0-9]*"))


# libtpu, loaded on a machine without a TPU (jax's first backend start, or a topology
# description for an ahead-of-time compile), prints "Failed to find host bounds ..." and an
# "E0000 ... unexpected worker hostname" error with a stack trace, because it can't look up
# its hosts. One host with one process of its own is what such a machine is.
QUIET_LIBTPU_ENV = types.MappingProxyType({"TPU_WORKER_HOSTNAMES": "localhost",
                                           "TPU_PROCESS_BOUNDS": "1,1,1"})
_LIBTPU_LAYOUT_VARS = ("TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_WORKER_HOSTNAMES",
                       "TPU_PROCESS_ADDRESSES", "TPU_HOST_BOUNDS", "TPU_PROCESS_BOUNDS")


def quiet_libtpu(env: dict[str, str] | None = None) -> dict[str, str]:
  """Sets `QUIET_LIBTPU_ENV` in `env` (default `os.environ`) when libtpu is installed but
  this machine has no TPU device files and no TPU layout variable is set: libtpu then loads
  without its host-lookup warnings. Call it at start-up, before libtpu loads (the first jax
  computation or topology description); the recipes and the tests do. `import fnscale`
  changes no environment variable. A lone TPU_PROCESS_BOUNDS fixes no layout in
  `detect_topology` (bounds count only in pairs), so detection is unaffected.

  Returns:
    The variables it set ({} when it did nothing).

  Examples:
    >>> import fnscale as fs
    >>> fs.quiet_libtpu({"TPU_ACCELERATOR_TYPE": "v5p-8"})  # a TPU layout: nothing to quiet
    {}
    >>> env = {}
    >>> set(fs.quiet_libtpu(env)) <= set(env)  # what it set (if anything) is in env
    True
  """
  env = os.environ if env is None else env
  if (_tpu_device_files() or any(env.get(v) for v in _LIBTPU_LAYOUT_VARS)
      or importlib.util.find_spec("libtpu") is None):
    return {}
  for k, v in QUIET_LIBTPU_ENV.items():
    env[k] = v
  return dict(QUIET_LIBTPU_ENV)


def simulate_cpu_devices(n: int) -> bool:
  """On a machine without an accelerator, makes jax expose `n` simulated CPU devices.

  Call it before the first jax computation (recipes call it at start-up). It sets
  `jax_platforms="cpu"` (unless `JAX_PLATFORMS` is set) so jax doesn't probe for a TPU,
  `jax_num_cpu_devices=n`, and raises XLA's CPU collective timeouts to 900 s (devices that
  share two cores can be far apart). On a TPU or GPU machine it does nothing.

  Returns:
    True if CPU devices were configured, False if an accelerator is present.

  Raises:
    TopologyError: `n` is not a positive int, or jax already started with another count.

  Examples:
    >>> import fnscale as fs
    >>> fs.simulate_cpu_devices(8)  # first thing, before any jax computation
    True
    >>> import jax
    >>> jax.device_count(), jax.devices()[0].platform
    (8, 'cpu')
  """
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise TopologyError(f"simulated device count n={n!r} ({type(n).__name__}) must be a "
                        "positive int, e.g. 8.")
  if has_accelerator():
    return False
  flags_ = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags_:
    # Simulated devices share the host's cores: on a busy machine one device can reach a
    # collective long after the others, and XLA's default 40 s limit would abort the run.
    # (Read when the CPU backend starts, so this must come before the first computation.)
    os.environ["XLA_FLAGS"] = (flags_ + " --xla_cpu_collective_call_terminate_timeout_seconds="
                               "900 --xla_cpu_collective_timeout_seconds=900").strip()
  import jax
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    if jax.device_count() != n:
      raise TopologyError(
          f"jax already started with {jax.device_count()} devices, so {n} simulated devices "
          "can't be set: call simulate_cpu_devices before the first jax computation.") from None
  return True
