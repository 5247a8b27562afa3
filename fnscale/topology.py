"""Topology: what hardware this job runs on, and where each fact came from.

`detect_topology` asks, first that answers: an explicit override string, the TPU
environment variables a Cloud TPU VM or GKE sets, the Cloud TPU metadata service, and
finally `jax.devices()`. The result is an immutable `Topology` value.

Chip facts (`TPU_FACTS`, `GPU_FACTS`) are the vendors' published figures: Google Cloud's
"TPU versions" pages (v2, v3, v4, v5e, v5p, v6e Trillium, TPU7x Ironwood) and NVIDIA's data
sheets (A100, H100 SXM, H100 PCIe, H200, B200). Peak FLOP/s are dense bf16 per chip.
"""
import dataclasses
import glob
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from absl import logging

from fnscale import _metadata
from fnscale.errors import TopologyError

GiB = 2**30


class TpuFacts(NamedTuple):
  """Published facts of one TPU generation.

  Attributes:
    cores_per_chip: TensorCores per chip.
    chips_per_host: chips attached to one host VM in a multi-host slice.
    hbm_bytes: HBM per chip, bytes.
    peak_flops: peak dense bf16 FLOP/s per chip.
    torus_dims: 2 for a 2-D torus (v2, v3, v5e, v6e), 3 for a 3-D torus (v4, v5p, v7).
    type_counts: "cores" if accelerator types like `v5p-128` count TensorCores, "chips" if
      they count chips (`v5litepod-16`, `v6e-16`).
    device_kinds: `jax.Device.device_kind` strings this generation reports.
  """
  cores_per_chip: int
  chips_per_host: int
  hbm_bytes: int
  peak_flops: float
  torus_dims: int
  type_counts: str
  device_kinds: tuple[str, ...]


TPU_FACTS: Mapping[str, TpuFacts] = types.MappingProxyType({
    "v2": TpuFacts(2, 4, 16 * GiB, 45e12, 2, "cores", ("TPU v2",)),
    "v3": TpuFacts(2, 4, 32 * GiB, 123e12, 2, "cores", ("TPU v3",)),
    "v4": TpuFacts(2, 4, 32 * GiB, 275e12, 3, "cores", ("TPU v4",)),
    "v5e": TpuFacts(1, 4, 16 * GiB, 197e12, 2, "chips", ("TPU v5 lite", "TPU v5e")),
    "v5p": TpuFacts(2, 4, 95 * GiB, 459e12, 3, "cores", ("TPU v5", "TPU v5p")),
    "v6e": TpuFacts(1, 4, 32 * GiB, 918e12, 2, "chips", ("TPU v6 lite", "TPU v6e")),
    "v7": TpuFacts(2, 4, 192 * GiB, 2307e12, 3, "cores", ("TPU7x", "TPU v7")),
})

# Accelerator-type prefixes as Cloud TPU spells them, mapped to the generation key above.
_TYPE_PREFIXES = {"v2": "v2", "v3": "v3", "v4": "v4", "v5litepod": "v5e", "v5e": "v5e",
                  "v5p": "v5p", "v6e": "v6e", "tpu7x": "v7", "v7": "v7"}


class GpuFacts(NamedTuple):
  """Published facts of one NVIDIA GPU: HBM bytes and peak dense bf16 FLOP/s."""
  hbm_bytes: int
  peak_flops: float


# Keyed by a substring of `device_kind` (e.g. "NVIDIA H100 80GB HBM3"); the first match wins,
# so the more specific names come first.
GPU_FACTS: Mapping[str, GpuFacts] = types.MappingProxyType({
    "H100 PCIe": GpuFacts(80 * 10**9, 756e12),
    "H200": GpuFacts(141 * 10**9, 989e12),
    "H100": GpuFacts(80 * 10**9, 989e12),
    "A100": GpuFacts(80 * 10**9, 312e12),
    "B200": GpuFacts(180 * 10**9, 2250e12),
})


@dataclasses.dataclass(frozen=True)
class Topology:
  """The hardware a job runs on. An immutable value; `sources` says where each fact came from.

  Attributes:
    platform: "tpu", "gpu" or "cpu".
    device_kind: `jax.Device.device_kind` of the devices, e.g. "TPU v5", "NVIDIA H200".
    generation: TPU generation key of `TPU_FACTS` ("v5p"), or None off TPU.
    num_devices: JAX devices in the whole job, all slices and processes.
    num_processes: processes (hosts) in the job.
    num_slices: TPU slices joined over DCN (1 on a single slice or off TPU).
    devices_per_process: JAX devices attached to each process.
    chip_grid: physical chips of one slice per torus dimension, e.g. (2, 4, 8); () unknown.
    cores_per_chip: TensorCores per chip (1 off TPU).
    accelerator_type: Cloud TPU accelerator type such as "v5p-128", or None.
    process_index: this process's index in the job.
    slice_index: this process's slice.
    peak_flops_per_device: peak dense bf16 FLOP/s of one JAX device, or None if unknown.
    hbm_bytes_per_device: accelerator memory of one JAX device in bytes, or None.
    sources: field name -> where it came from ("override", "env:TPU_ACCELERATOR_TYPE",
      "metadata:instance/attributes/accelerator-type", "jax.devices()", "facts table").
  """
  platform: str
  device_kind: str
  generation: str | None
  num_devices: int
  num_processes: int
  num_slices: int
  devices_per_process: int
  chip_grid: tuple[int, ...]
  cores_per_chip: int
  accelerator_type: str | None
  process_index: int
  slice_index: int
  peak_flops_per_device: float | None
  hbm_bytes_per_device: int | None
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def num_chips(self) -> int:
    """Chips in one slice per `chip_grid` (0 if unknown)."""
    return math.prod(self.chip_grid) if self.chip_grid else 0

  @property
  def devices_per_slice(self) -> int:
    return self.num_devices // max(self.num_slices, 1)

  def __str__(self) -> str:
    grid = "x".join(map(str, self.chip_grid)) or "?"
    peak = f"{self.peak_flops_per_device / 1e12:.0f} TFLOP/s" if self.peak_flops_per_device else "?"
    return (f"{self.platform} {self.device_kind!r} ({self.accelerator_type or 'no accelerator type'}): "
            f"{self.num_devices} devices = {self.num_slices} slice(s) x chip grid {grid}, "
            f"{self.num_processes} process(es) x {self.devices_per_process} devices, "
            f"peak {peak} bf16 per device")


def parse_shape(shape: str) -> tuple[int, ...]:
  """Parses a chip-grid string such as "4x4" or "2x4x8" into a tuple of positive ints.

  Raises:
    TopologyError: if the string is not 1-4 positive integers joined by "x".
  """
  if not isinstance(shape, str) or not re.fullmatch(r"\s*\d+(\s*x\s*\d+){0,3}\s*", shape):
    raise TopologyError(
        f"shape {shape!r} is not a chip grid: expected positive integers joined by 'x', such "
        "as '4x4', '2x4x8', or '2x4x4x8' (slices first); fix the string.")
  dims = tuple(int(d) for d in shape.replace(" ", "").split("x"))
  if any(d <= 0 for d in dims):
    raise TopologyError(
        f"shape {shape!r} has a zero or negative dimension {dims}: every dimension must be >= 1.")
  return dims


def parse_accelerator_type(accelerator_type: str) -> tuple[str, int]:
  """Splits a Cloud TPU accelerator type into (generation, chips), e.g. "v5p-128" -> ("v5p", 64).

  Raises:
    TopologyError: for an unknown generation or a malformed count.
  """
  m = re.fullmatch(r"\s*([a-z0-9]+)-(\d+)\s*", accelerator_type or "")
  if not m or m.group(1) not in _TYPE_PREFIXES:
    known = ", ".join(f"{p}-N" for p in _TYPE_PREFIXES)
    raise TopologyError(
        f"unknown accelerator type {accelerator_type!r}: expected one of {known} (e.g. "
        "'v5p-128', 'v5litepod-16'); fix TPU_ACCELERATOR_TYPE or the override.")
  generation = _TYPE_PREFIXES[m.group(1)]
  count = int(m.group(2))
  facts = TPU_FACTS[generation]
  per_chip = facts.cores_per_chip if facts.type_counts == "cores" else 1
  if count <= 0 or count % per_chip:
    raise TopologyError(
        f"accelerator type {accelerator_type!r}: {count} {facts.type_counts} is not a whole "
        f"number of {generation} chips ({per_chip} per chip).")
  return generation, count // per_chip


def generation_of(device_kind: str) -> str | None:
  """The `TPU_FACTS` key for a TPU `device_kind`, or None."""
  for gen, facts in TPU_FACTS.items():
    if device_kind in facts.device_kinds:
      return gen
  return None


def gpu_facts(device_kind: str) -> GpuFacts | None:
  """Facts for an NVIDIA `device_kind` such as "NVIDIA H100 80GB HBM3", or None."""
  for name, facts in GPU_FACTS.items():
    if name in device_kind:
      return facts
  return None


def _grid_from_bounds(chips_per_host: str, host_bounds: str) -> tuple[int, ...]:
  a = [int(x) for x in chips_per_host.split(",")]
  b = [int(x) for x in host_bounds.split(",")]
  if len(a) != len(b):
    raise TopologyError(
        f"TPU_CHIPS_PER_HOST_BOUNDS={chips_per_host!r} and TPU_HOST_BOUNDS={host_bounds!r} have "
        "different ranks; they must be comma-separated lists of the same length.")
  grid = tuple(x * y for x, y in zip(a, b))
  while len(grid) > 2 and grid[-1] == 1:  # "2,2,1" is a 2-D 2x2 slice
    grid = grid[:-1]
  return grid


def _tpu_env_facts(env: Mapping[str, str], prefix: str,
                   source: str = "env:") -> dict[str, tuple[Any, str]]:
  """Facts from TPU environment variables (or the `tpu-env` metadata attribute's keys)."""
  facts: dict[str, tuple[Any, str]] = {}

  def get(name):
    return env.get(prefix + name)

  src = lambda name: source + prefix + name
  if get("ACCELERATOR_TYPE"):
    facts["accelerator_type"] = (get("ACCELERATOR_TYPE").strip(), src("ACCELERATOR_TYPE"))
  if get("TOPOLOGY"):
    facts["chip_grid"] = (parse_shape(get("TOPOLOGY")), src("TOPOLOGY"))
  elif get("CHIPS_PER_HOST_BOUNDS") and get("HOST_BOUNDS"):
    facts["chip_grid"] = (_grid_from_bounds(get("CHIPS_PER_HOST_BOUNDS"), get("HOST_BOUNDS")),
                          src("CHIPS_PER_HOST_BOUNDS") + "*HOST_BOUNDS")
  if get("WORKER_ID"):
    facts["process_index"] = (int(get("WORKER_ID")), src("WORKER_ID"))
  return facts


def _megascale_facts(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
  facts = {}
  if env.get("MEGASCALE_NUM_SLICES"):
    facts["num_slices"] = (int(env["MEGASCALE_NUM_SLICES"]), "env:MEGASCALE_NUM_SLICES")
  if env.get("MEGASCALE_SLICE_ID"):
    facts["slice_index"] = (int(env["MEGASCALE_SLICE_ID"]), "env:MEGASCALE_SLICE_ID")
  return facts


def _on_tpu_vm(env: Mapping[str, str]) -> bool:
  """Whether asking the metadata service is worth it: never on a laptop or in CI."""
  if env.get("TPU_SKIP_MDS_QUERY"):
    return False
  if env.get("GCE_METADATA_HOST"):
    return True
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))  # TPU device files


def has_accelerator() -> bool:
  """Whether this machine shows a TPU (`/dev/accel*`, `/dev/vfio/N`) or NVIDIA GPU device
  file, without starting a jax backend."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or
              glob.glob("/dev/nvidia[0-9]*"))


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
  """
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise TopologyError(f"simulated device count {n!r} must be a positive int, e.g. 8.")
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


def _metadata_facts(timeout_s: float, url: str) -> dict[str, tuple[Any, str]]:
  facts: dict[str, tuple[Any, str]] = {}
  get = lambda path: _metadata.get(path, timeout_s=timeout_s, url=url)
  acc = get("instance/attributes/accelerator-type")
  if acc:
    facts["accelerator_type"] = (acc, "metadata:instance/attributes/accelerator-type")
  tpu_env = get("instance/attributes/tpu-env")
  if tpu_env:  # lines like "TOPOLOGY: '2x4x8'"
    kv = dict(re.findall(r"^\s*([A-Z_]+)\s*:\s*'?([^'\n]*)'?\s*$", tpu_env, re.M))
    for k, v in _tpu_env_facts(kv, "", "metadata:instance/attributes/tpu-env:").items():
      facts.setdefault(k, v)
  worker = get("instance/attributes/agent-worker-number")
  if worker and worker.isdigit():
    facts.setdefault("process_index",
                     (int(worker), "metadata:instance/attributes/agent-worker-number"))
  return facts


def _device_facts(devices) -> dict[str, tuple[Any, str]]:
  import jax  # deferred: detection from env/metadata needs no backend
  src = "jax.devices()"
  d0 = devices[0]
  facts: dict[str, tuple[Any, str]] = {
      "platform": (d0.platform, src),
      "device_kind": (d0.device_kind, src),
      "num_devices": (len(devices), src),
      "num_processes": (jax.process_count(), "jax.process_count()"),
      "process_index": (jax.process_index(), "jax.process_index()"),
  }
  slices = {getattr(d, "slice_index", 0) or 0 for d in devices}
  facts["num_slices"] = (len(slices), src + " slice_index")
  local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
  facts["devices_per_process"] = (len(local), src)
  facts["slice_index"] = (getattr(local[0], "slice_index", 0) or 0, src + " slice_index")
  if d0.platform == "tpu" and getattr(d0, "coords", None) is not None:
    first = [d for d in devices if (getattr(d, "slice_index", 0) or 0) == min(slices)]
    coords = [tuple(d.coords) for d in first]
    grid = tuple(max(c[i] for c in coords) + 1 for i in range(len(coords[0])))
    while len(grid) > 2 and grid[-1] == 1:
      grid = grid[:-1]
    facts["chip_grid"] = (grid, src + " coords")
    cores = max(getattr(d, "core_on_chip", 0) for d in devices) + 1
    facts["devices_per_chip"] = (cores, src + " core_on_chip")
  return facts


def detect_topology(override: str | None = None, *, devices=None, env: Mapping[str, str] | None = None,
                    metadata_timeout_s: float = 1.0) -> Topology:
  """Detects the hardware this process belongs to.

  Args:
    override: an explicit description taking precedence over every other source: a chip
      grid "4x4" / "2x4x8", slices first as "SxAxBxC" (4 numbers), optionally prefixed with a
      generation as "v5p:2x4x8", or an accelerator type "v5p-128".
    devices: the devices to describe (default `jax.devices()`).
    env: environment to read (default `os.environ`).
    metadata_timeout_s: per-request timeout of the Cloud TPU metadata service, seconds. The
      service is only asked on what looks like a TPU VM (`/dev/accel*`, `/dev/vfio/N`, or
      `GCE_METADATA_HOST` set); unreachable means "no answer", never an error.

  Returns:
    A `Topology`; `topology.sources` names where each fact came from.

  Raises:
    TopologyError: malformed override or environment values, an unknown accelerator type,
      or an override / environment whose device count disagrees with the devices present.
  """
  import jax
  env = os.environ if env is None else env
  facts: dict[str, tuple[Any, str]] = {}

  def merge(new):
    for k, v in new.items():
      facts.setdefault(k, v)

  if override is not None:
    merge(_override_facts(override))
  merge(_tpu_env_facts(env, "TPU_"))
  merge(_megascale_facts(env))
  if _on_tpu_vm(env):
    merge(_metadata_facts(metadata_timeout_s, _metadata.base_url(env)))
  devices = list(jax.devices() if devices is None else devices)
  dev = _device_facts(devices)
  merge(dev)

  value = lambda k, default=None: facts[k][0] if k in facts else default
  sources = {k: s for k, (_, s) in facts.items()}
  acc = value("accelerator_type")
  generation = generation_of(value("device_kind")) if value("platform") == "tpu" else None
  acc_chips = None
  if acc:
    acc_gen, acc_chips = parse_accelerator_type(acc)
    generation = generation or acc_gen
  if "generation" in facts:
    generation = value("generation")
    sources["generation"] = facts["generation"][1]
  chip_grid = value("chip_grid", ())
  if not chip_grid and acc_chips:
    sources["chip_grid"] = "unknown (accelerator type gives only the chip count)"
  num_slices = value("num_slices", 1)

  platform = value("platform")
  tpu = TPU_FACTS.get(generation) if generation else None
  devices_per_chip = value("devices_per_chip", 1)
  if tpu and platform == "tpu":
    peak = tpu.peak_flops / devices_per_chip
    hbm = tpu.hbm_bytes // devices_per_chip
    sources["peak_flops_per_device"] = sources["hbm_bytes_per_device"] = "facts table"
  elif platform == "gpu" and gpu_facts(value("device_kind")):
    g = gpu_facts(value("device_kind"))
    peak, hbm = g.peak_flops, g.hbm_bytes
    sources["peak_flops_per_device"] = sources["hbm_bytes_per_device"] = "facts table"
  else:
    peak = hbm = None

  topo = Topology(
      platform=platform,
      device_kind=value("device_kind"),
      generation=generation,
      num_devices=value("num_devices"),
      num_processes=value("num_processes", 1),
      num_slices=num_slices,
      devices_per_process=value("devices_per_process"),
      chip_grid=tuple(chip_grid),
      cores_per_chip=tpu.cores_per_chip if tpu else 1,
      accelerator_type=acc,
      process_index=value("process_index", 0),
      slice_index=value("slice_index", 0),
      peak_flops_per_device=peak,
      hbm_bytes_per_device=hbm,
      sources=types.MappingProxyType(sources),
  )
  _check_consistent(topo, devices_per_chip, acc_chips, len(devices))
  logging.debug("detected topology %s from %s", topo, dict(sources))
  return topo


def _override_facts(override: str) -> dict[str, tuple[Any, str]]:
  if not isinstance(override, str) or not override.strip():
    raise TopologyError(
        f"topology override {override!r} is empty: expected a chip grid such as '2x4x8', "
        "'v5p:2x4x8', slices first as '2x4x4x8', or an accelerator type such as 'v5p-128'.")
  text = override.strip()
  facts: dict[str, tuple[Any, str]] = {}
  if re.fullmatch(r"[a-z0-9]+-\d+", text):
    parse_accelerator_type(text)  # validates
    facts["accelerator_type"] = (text, "override")
    return facts
  if ":" in text:
    gen, _, text = text.partition(":")
    gen = _TYPE_PREFIXES.get(gen.strip())
    if gen is None:
      raise TopologyError(
          f"topology override {override!r} names an unknown TPU generation: expected one of "
          f"{sorted(TPU_FACTS)} before ':', e.g. 'v5p:2x4x8'.")
    facts["generation"] = (gen, "override")
  dims = parse_shape(text)
  if len(dims) == 4:
    facts["num_slices"] = (dims[0], "override")
    dims = dims[1:]
  facts["chip_grid"] = (dims, "override")
  return facts


def _check_consistent(topo: Topology, devices_per_chip: int, acc_chips: int | None,
                      present: int) -> None:
  """The chip count implied by an override or the environment must match the devices present."""
  if not topo.chip_grid and not acc_chips:
    return
  chips = topo.num_chips or acc_chips
  if topo.platform == "tpu":
    expected = chips * devices_per_chip * topo.num_slices
  else:  # off TPU a grid describes devices directly (e.g. simulated CPU devices)
    expected = chips * topo.num_slices
  if expected != present:
    where = topo.sources.get("chip_grid") or topo.sources.get("accelerator_type")
    raise TopologyError(
        f"topology from {where} says {topo.num_slices} slice(s) x "
        f"{'x'.join(map(str, topo.chip_grid)) or chips} = {expected} devices, but "
        f"{present} {topo.platform} devices are present; fix the override (or the TPU_* "
        "environment variables) to match, or run on the hardware it describes.")
