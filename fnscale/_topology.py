"""Topology: what hardware this job runs on, and where each fact came from.

`detect_topology` asks, first that answers: an explicit override string, the TPU
environment variables a Cloud TPU VM or GKE sets, the Cloud TPU metadata service, and
finally the devices (`jax.devices()` or libtpu's described devices). The result is an
immutable `Topology` value; the precedence and its reasons are in `detect_topology`.

The chip facts (`CHIP_FACTS`, one row per TPU generation or NVIDIA GPU) are the only
place fnscale states a chip's published figures; the topology, the planner's targets, MFU and
the recipes all read them there. Peak FLOP/s are dense bf16 per chip; each row's `source`
names where each of its figures comes from:

- Google Cloud's "TPU versions" pages (v2, v3, v4, v5e, v5p, v6e Trillium, TPU7x Ironwood):
  peak, HBM, HBM bandwidth; DCN per chip from the v5p page (50 Gbps per chip) and the v6e page
  (NIC per 8-chip host: v5e 2 x 100 Gbps, v6e 4 x 200 Gbps, i.e. 25 and 100 Gbps per chip).
  v4 has no published per-chip DCN figure: taken as v5e's (an assumption its row says).
- ICI, one direction per link: "How to Scale Your Model" (Austin et al., 2025, Google
  DeepMind; jax-ml.github.io/scaling-book, part 2 "TPUs", table of ICI bandwidths). A 2-D
  torus chip has 4 ports, a 3-D torus chip 6.
- NVIDIA's data sheets (A100, H100 SXM, H100 PCIe, H200, B200): peak, HBM, HBM bandwidth;
  H100/H200 SXM: NVLink 900 GB/s per GPU both directions, 450 GB/s one way to the NVSwitch;
  between nodes one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100/H200 data sheets), 5e10 B/s.
- libtpu's topology names ("v5p:2x2x2", "tpu7x:2x2x1"), as
  `jax.experimental.topologies.get_topology_desc` takes them.
"""
import dataclasses
import glob
import importlib.util
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from absl import logging

from fnscale import _metadata
from fnscale._errors import TopologyError

GiB = 2**30


class ChipFacts(NamedTuple):
  """Published facts of one chip: a TPU generation or an NVIDIA GPU. Figures are per chip.

  Attributes:
    platform: "tpu" or "gpu".
    peak_flops: peak dense bf16 FLOP/s.
    hbm_bytes: HBM, bytes (published).
    hbm_bandwidth: HBM bytes/s, or None (no figure here).
    ici_link: bytes/s one way per ICI link (on GPUs: per GPU to the NVSwitch), or None.
    dcn: bytes/s per chip across slices (on GPUs: between nodes), or None.
    torus_dims: the ICI torus: 2 (v2, v3, v5e, v6e) or 3 (v4, v5p, v7); 0 where links go
      through a switch (NVSwitch: every axis gets `ici_link` whatever its shape).
    chips_per_host: chips attached to one host VM in a multi-host slice (GPUs per node),
      or None (no fixed figure).
    cores_per_chip: TensorCores per chip (1 on GPUs).
    type_counts: "cores" if accelerator types like `v5p-128` count TensorCores, "chips" if
      they count chips (`v5litepod-16`, `v6e-16`); None on GPUs.
    device_kinds: TPU: the exact `jax.Device.device_kind` strings this generation reports;
      GPU: a substring of it ("H100" in "NVIDIA H100 80GB HBM3"; the first row that matches,
      in table order, wins).
    libtpu_name: the generation in libtpu's topology names ("v5p" in "v5p:2x2x2"); None on
      GPUs.
    source: where each figure of the row comes from.
    hbm_limit: the bytes a program may hold: the allocator's limit (jax
      `Device.memory_stats()["bytes_limit"]`), below `hbm_bytes` by what the runtime keeps.
    limit_source: where `hbm_limit` comes from (measured, or how it is derived).

  Examples:
    `fnscale.CHIP_FACTS` holds one row per chip, by generation ("v5e") or GPU name ("H100"):

    >>> import fnscale as fs
    >>> v5e = fs.CHIP_FACTS["v5e"]
    >>> v5e.peak_flops / 1e12, v5e.hbm_bytes / 2**30, v5e.torus_dims, v5e.device_kinds
    (197.0, 16.0, 2, ('TPU v5 lite', 'TPU v5e'))
    >>> v5e.hbm_limit / 2**30  # what a program may hold of the 16 GiB
    15.748046875
  """
  platform: str
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float | None
  ici_link: float | None
  dcn: float | None
  torus_dims: int
  chips_per_host: int | None
  cores_per_chip: int
  type_counts: str | None
  device_kinds: tuple[str, ...]
  libtpu_name: str | None
  source: str
  hbm_limit: int
  limit_source: str


# The allocator's limit (`memory_stats()["bytes_limit"]`) measured on one v5e chip (jax
# 0.10.2, libtpu 0.0.42.1, 2026-12-06): 15.75 GiB of its 16; the runtime keeps 258 MiB.
V5E_LIMIT = 16_909_336_576
# TPUs not measured here are taken to keep v5e's reserve per chip.
_TPU_RESERVE = 16 * GiB - V5E_LIMIT


def _tpu_row(kinds, peak, hbm, *, torus, cores, counts, hbm_bw=None, ici=None, dcn=None,
             libtpu, source, limit=None) -> ChipFacts:
  why = ("bytes_limit measured on a v5e chip" if limit else
         f"HBM less v5e's measured runtime reserve ({_TPU_RESERVE // 2**20} MiB), not measured")
  return ChipFacts("tpu", peak, hbm, hbm_bw, ici, dcn, torus, 4, cores, counts, kinds, libtpu,
                   source, limit or hbm - _TPU_RESERVE, why)


def _gpu_row(kind, peak, hbm, *, hbm_bw=None, ici=None, dcn=None, per_node=None,
             source) -> ChipFacts:
  # Not measured: the published memory, as a job that raises XLA_PYTHON_CLIENT_MEM_FRACTION
  # towards 1 gets (JAX's default 0.75 leaves the program less).
  return ChipFacts("gpu", peak, hbm, hbm_bw, ici, dcn, 0, per_node, 1, None, (kind,), None,
                   source, hbm, "published HBM, not measured")


_ICI = "ICI: How to Scale Your Model, part 2"
# Rows: device kinds, peak dense bf16 FLOP/s, HBM bytes; then torus dims, TensorCores per
# chip, what accelerator types count, HBM B/s, ICI B/s one way per link, DCN B/s per chip.
# GPUs are matched by a substring of `device_kind`, first row first: "H100 PCIe" before "H100".
CHIP_FACTS: Mapping[str, ChipFacts] = types.MappingProxyType({
    "v2": _tpu_row(("TPU v2",), 45e12, 16 * GiB, torus=2, cores=2, counts="cores",
                   libtpu="v2", source="Cloud TPU v2 page"),
    "v3": _tpu_row(("TPU v3",), 123e12, 32 * GiB, torus=2, cores=2, counts="cores",
                   libtpu="v3", source="Cloud TPU v3 page"),
    "v4": _tpu_row(("TPU v4",), 275e12, 32 * GiB, torus=3, cores=2, counts="cores",
                   hbm_bw=1.2e12, ici=4.5e10, dcn=25e9 / 8, libtpu="v4",
                   source=f"Cloud TPU v4 page; {_ICI}; DCN: none published, taken as v5e's"),
    "v5e": _tpu_row(("TPU v5 lite", "TPU v5e"), 197e12, 16 * GiB, torus=2, cores=1,
                    counts="chips", hbm_bw=8.19e11, ici=4.5e10, dcn=25e9 / 8, libtpu="v5e",
                    limit=V5E_LIMIT,
                    source=f"Cloud TPU v5e page; {_ICI}; DCN: Cloud TPU v6e page"),
    "v5p": _tpu_row(("TPU v5", "TPU v5p"), 459e12, 95 * GiB, torus=3, cores=2,
                    counts="cores", hbm_bw=2.765e12, ici=9e10, dcn=50e9 / 8, libtpu="v5p",
                    source=f"Cloud TPU v5p page (DCN: 50 Gbps per chip); {_ICI}"),
    "v6e": _tpu_row(("TPU v6 lite", "TPU v6e"), 918e12, 32 * GiB, torus=2, cores=1,
                    counts="chips", hbm_bw=1.64e12, ici=9e10, dcn=100e9 / 8, libtpu="v6e",
                    source=f"Cloud TPU v6e page (DCN: 4 x 200 Gbps per 8-chip host); {_ICI}"),
    "v7": _tpu_row(("TPU7x", "TPU v7"), 2307e12, 192 * GiB, torus=3, cores=2,
                   counts="cores", libtpu="tpu7x", source="Cloud TPU7x (Ironwood) page"),
    "H100 PCIe": _gpu_row("H100 PCIe", 756e12, 80 * 10**9,
                          source="NVIDIA H100 data sheet (PCIe)"),
    "H200": _gpu_row("H200", 989e12, 141 * 10**9, hbm_bw=4.8e12, ici=4.5e11, dcn=5e10,
                     per_node=8, source="NVIDIA H200 product page; DGX H200 data sheet"),
    "H100": _gpu_row("H100", 989e12, 80 * 10**9, hbm_bw=3.35e12, ici=4.5e11, dcn=5e10,
                     per_node=8, source="NVIDIA H100 (SXM) data sheet; DGX H100 data sheet"),
    "A100": _gpu_row("A100", 312e12, 80 * 10**9, source="NVIDIA A100 data sheet"),
    "B200": _gpu_row("B200", 2250e12, 180 * 10**9, source="NVIDIA B200 data sheet"),
})
# The TPU generations, in `CHIP_FACTS` order ("v2" ... "v7").
TPU_GENERATIONS = tuple(k for k, f in CHIP_FACTS.items() if f.platform == "tpu")

# Accelerator-type prefixes as Cloud TPU spells them, mapped to the generation key above. A
# prefix alone ("tpu7x", as GKE's TPU_ACCELERATOR_TYPE for Ironwood) names only the generation.
_TYPE_PREFIXES = {"v2": "v2", "v3": "v3", "v4": "v4", "v5litepod": "v5e", "v5e": "v5e",
                  "v5p": "v5p", "v6e": "v6e", "tpu7x": "v7", "v7": "v7"}
# In "GEN:GRID" also libtpu's own topology names: "v5:2x2x1" is a v5p (as MaxText spells it).
_GRID_PREFIXES = {**_TYPE_PREFIXES, "v5": "v5p"}


def tpu_prefix_generation(prefix: str) -> str | None:
  """The generation an accelerator-type prefix names ("v5litepod" -> "v5e"), or None."""
  return _TYPE_PREFIXES.get(prefix)


@dataclasses.dataclass(frozen=True)
class Topology:
  """The hardware a job runs on. An immutable value; `sources` says where each fact came from.

  Attributes:
    platform: "tpu", "gpu" or "cpu".
    device_kind: `jax.Device.device_kind` of the devices, e.g. "TPU v5", "NVIDIA H200".
    generation: TPU generation key of `CHIP_FACTS` ("v5p"), or None off TPU.
    num_devices: JAX devices in the whole job, all slices and processes.
    num_processes: processes (hosts) in the job.
    num_slices: TPU slices joined over DCN (1 on a single slice or off TPU).
    devices_per_process: JAX devices attached to each process.
    chip_grid: physical chips of one slice per torus dimension, e.g. (2, 4, 8); () unknown.
      Three dimensions on 3-D torus generations (v4, v5p, TPU7x: a v5p-8 is (2, 2, 1)), two
      on 2-D ones (v2, v3, v5e, v6e: a v5litepod-8 is (2, 4)), whichever source gave it.
    num_chips: chips in one slice: the product of `chip_grid`, else the accelerator type's
      count, else 0 (unknown, or not a TPU).
    cores_per_chip: TensorCores per chip (1 off TPU).
    accelerator_type: Cloud TPU accelerator type such as "v5p-128", or None.
    process_index: this process's index in the job.
    slice_index: this process's slice.
    peak_flops_per_device: peak dense bf16 FLOP/s of one JAX device, or None if unknown.
    hbm_bytes_per_device: accelerator memory of one JAX device in bytes, or None.
    sources: field name -> where it came from ("override", "env:TPU_ACCELERATOR_TYPE",
      "metadata:instance/attributes/accelerator-type", "jax.devices()", "devices" for devices
      passed in, "facts table").
    set_aside: "" when every source agreed; else what the environment or the metadata said
      that the devices present contradict (the variable, its layout, the devices' count)
      and that the topology was built from the devices instead (`detect_topology`).

  Examples:
    >>> import fnscale as fs
    >>> topo = fs.detect_topology()  # 8 simulated CPU devices
    >>> print(topo)
    cpu 'cpu' (no accelerator type): 8 devices = 1 slice(s) x chip grid ?,
    1 process(es) x 8 devices, peak ? bf16 per device
    >>> topo.devices_per_slice, topo.peak_flops_per_device  # no published peak for a CPU
    (8, None)
  """
  platform: str
  device_kind: str
  generation: str | None
  num_devices: int
  num_processes: int
  num_slices: int
  devices_per_process: int
  chip_grid: tuple[int, ...]
  num_chips: int
  cores_per_chip: int
  accelerator_type: str | None
  process_index: int
  slice_index: int
  peak_flops_per_device: float | None
  hbm_bytes_per_device: int | None
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
  set_aside: str = dataclasses.field(default="", compare=False)

  @property
  def devices_per_slice(self) -> int:
    return self.num_devices // max(self.num_slices, 1)

  def __str__(self) -> str:
    grid = "x".join(map(str, self.chip_grid)) or "?"
    peak = f"{self.peak_flops_per_device / 1e12:.0f} TFLOP/s" if self.peak_flops_per_device else "?"
    accel = self.accelerator_type or "no accelerator type"
    return (f"{self.platform} {self.device_kind!r} ({accel}): "
            f"{self.num_devices} devices = {self.num_slices} slice(s) x chip grid {grid}, "
            f"{self.num_processes} process(es) x {self.devices_per_process} devices, "
            f"peak {peak} bf16 per device")


Facts = dict[str, tuple[Any, str]]  # field -> (value, where it came from)


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
    TopologyError: not a str, an unknown generation or a malformed count.
  """
  _check_type("accelerator_type", accelerator_type, str, "a str such as 'v5p-128'")
  m = re.fullmatch(r"\s*([a-z0-9]+)-(\d+)\s*", accelerator_type)
  if not m or m.group(1) not in _TYPE_PREFIXES:
    known = ", ".join(f"{p}-N" for p in _TYPE_PREFIXES)
    raise TopologyError(
        f"unknown accelerator type {accelerator_type!r}: expected one of {known} (e.g. "
        "'v5p-128', 'v5litepod-16'); fix TPU_ACCELERATOR_TYPE or the override.")
  generation = _TYPE_PREFIXES[m.group(1)]
  count = int(m.group(2))
  facts = CHIP_FACTS[generation]
  per_chip = facts.cores_per_chip if facts.type_counts == "cores" else 1
  if count <= 0 or count % per_chip:
    raise TopologyError(
        f"accelerator type {accelerator_type!r}: {count} {facts.type_counts} is not a whole "
        f"number of {generation} chips ({per_chip} per chip).")
  return generation, count // per_chip


def _type_or_generation(name: str) -> tuple[str, int | None]:
  """(generation, chips) of an accelerator type; a generation alone ("tpu7x") gives no count."""
  if name.strip() in _TYPE_PREFIXES:
    return _TYPE_PREFIXES[name.strip()], None
  return parse_accelerator_type(name)


def generation_of(device_kind: str) -> str | None:
  """The `CHIP_FACTS` key for a TPU `device_kind` ("TPU v5" -> "v5p"), or None.

  Raises:
    TopologyError: `device_kind` is not a str.
  """
  _check_type("device_kind", device_kind, str, "a str such as 'TPU v5'")
  return next((gen for gen in TPU_GENERATIONS
               if device_kind in CHIP_FACTS[gen].device_kinds), None)


def gpu_facts(device_kind: str) -> ChipFacts | None:
  """The `CHIP_FACTS` row of an NVIDIA `device_kind` such as "NVIDIA H100 80GB HBM3", or None.

  Raises:
    TopologyError: `device_kind` is not a str.
  """
  _check_type("device_kind", device_kind, str, "a str such as 'NVIDIA H200'")
  return next((f for f in CHIP_FACTS.values()
               if f.platform == "gpu" and f.device_kinds[0] in device_kind), None)



def device_memory(device) -> float | None:
  """Bytes a step may use on `device` (a `jax.Device`): the runtime's limit on an attached
  accelerator (`memory_stats()["bytes_limit"]`, e.g. 15.75 GiB on a 16 GiB TPU v5e); that
  limit per device from `fnscale.CHIP_FACTS` (`hbm_limit`: measured, or derived as its
  `limit_source` says) for a TPU described for an ahead-of-time compile or a GPU without
  memory statistics; None on CPU, whose memory has no limit worth holding a step to (pass
  one to `check_fit` or `compile_fitting` to test).

  Examples:
    >>> import fnscale as fs, jax
    >>> fs.analysis.device_memory(jax.devices()[0]) is None  # CPU: no limit
    True
    >>> v5e = fs.target_devices("v5e-8")[0]  # described (the tpu extra): the table's limit
    >>> fs.analysis.device_memory(v5e) / 2**30
    15.748046875
  """
  if device.platform == "cpu":
    return None
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # described devices have no statistics
    stats = {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  if device.platform == "tpu":
    gen = generation_of(device.device_kind)
    if gen is None:
      return None
    # A chip's JAX devices share its HBM: a megacore chip (v4, v5p) is one device, other
    # chips one per TensorCore (as the planner's targets count them).
    facts = CHIP_FACTS[gen]
    return float(facts.hbm_limit // (1 if gen in ("v4", "v5p") else facts.cores_per_chip))
  facts = gpu_facts(device.device_kind)
  return float(facts.hbm_limit) if facts else None


def _check_type(name: str, value, types_, expected: str, error=TopologyError) -> None:
  """Raises `error` naming the argument, what it got and what it expects."""
  if isinstance(value, bool) or not isinstance(value, types_):
    raise error(f"{name}={value!r} ({type(value).__name__}): expected {expected}.")


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


def standard_grid(generation: str, chips: int) -> tuple[int, ...]:
  """The chip grid Google Cloud provisions for a slice of `chips` chips, e.g. ("v5p", 64) ->
  (4, 4, 4) for a v5p-128. Per Google's per-generation topology tables, each doubling of a
  slice doubles its smallest torus dimension (the last among equals): 3-D generations go
  2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; 2-D ones 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, ...

  Raises:
    TopologyError: an unknown generation, or a chip count that isn't such a slice.
  """
  _check_type("generation", generation, str, f"one of {sorted(TPU_GENERATIONS)}")
  _check_type("chips", chips, int, "a positive int")
  if generation not in TPU_GENERATIONS:
    raise TopologyError(f"generation={generation!r}: expected one of {sorted(TPU_GENERATIONS)}.")
  grid = [1, 1] if CHIP_FACTS[generation].torus_dims == 2 else [2, 2, 1]
  if chips == 2 and len(grid) == 2:
    grid = [1, 2]
  while math.prod(grid) < chips:
    i = max(k for k, d in enumerate(grid) if d == min(grid))
    grid[i] *= 2
  if math.prod(grid) != chips:
    raise TopologyError(
        f"{chips} {generation} chips is not a standard slice (a power of two, at least "
        f"{math.prod([2, 2, 1]) if len(grid) == 3 else 1}); give the grid, e.g. "
        f"'{generation}:{'x'.join(map(str, grid))}'.")
  return tuple(grid)


def libtpu_topology_name(generation: str, grid) -> str:
  """libtpu's name of a slice of `generation` with chip grid `grid`: ("v7", (2, 2, 1)) ->
  "tpu7x:2x2x1", as `jax.experimental.topologies.get_topology_desc` takes it."""
  return f"{CHIP_FACTS[generation].libtpu_name}:{'x'.join(map(str, grid))}"


def target_devices(target: str) -> list:
  """libtpu's described devices of a TPU target, for ahead-of-time compiles and plans from a
  machine without that TPU: "v5p-128", "v5p:4x4x4" (libtpu's spelling), "2x v5p-128" (two
  slices over DCN). Devices are laid out as Google provisions them: v4 as megacore (one
  device per chip, as JAX runs it), v5e/v6e slices of 8 chips on one host, 4 chips per host
  otherwise (libtpu's default).

  Returns:
    A list of `jax.Device` (platform "tpu"), to pass as `devices=` to `detect_topology` and
    `make_mesh`.

  Raises:
    TopologyError: a target that names no TPU generation, or libtpu is not installed
      (`pip install "fnscale[tpu]"`).

  Examples:
    Two v5p-8 slices, described here (no TPU needed; the tpu extra):

    >>> import fnscale as fs
    >>> devices = fs.target_devices("2x v5p-8")
    >>> len(devices), devices[0].platform, sorted({d.slice_index for d in devices})
    (8, 'tpu', [0, 1])
  """
  _check_type("target", target, str, "a str such as 'v5p-128', 'v5p:4x4x4' or '2x v5p-128'")
  facts = _override_facts(target)
  slices = facts.get("num_slices", (1,))[0]
  if "accelerator_type" in facts:
    generation, chips = parse_accelerator_type(facts["accelerator_type"][0])
    grid = standard_grid(generation, chips)
  elif "generation" in facts:
    generation, grid = facts["generation"][0], _slice_grid(facts["chip_grid"][0], None)
  else:
    raise TopologyError(f"target {target!r} names no TPU generation: write e.g. 'v5p-128', "
                        "'v5p:4x4x4' or '2x v5p-128'.")
  if importlib.util.find_spec("libtpu") is None:
    raise TopologyError(
        f"describing the TPU target {target!r} without the hardware needs libtpu, which is not "
        "installed: pip install \"fnscale[tpu]\" (or \"jax[tpu]\"), then run again.")
  import jax  # deferred: loads libtpu
  from jax.experimental import topologies
  kw = {"num_slices": slices} if slices > 1 else {}
  if generation == "v4":
    kw["chip_config_name"] = "megacore"
  if generation in ("v5e", "v6e") and math.prod(grid) <= 8:
    kw["chips_per_host_bounds"] = tuple(grid) + (1,) * (3 - len(grid))
  name = libtpu_topology_name(generation, grid)
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices)
  except jax.errors.JaxRuntimeError as e:
    raise TopologyError(
        f"libtpu could not describe {name!r} {kw} for target {target!r}: {e}. If another "
        "process on this machine holds libtpu (its lockfile), set ALLOW_MULTIPLE_LIBTPU_LOAD=1."
    ) from None


# --- sources: each returns Facts; detect_topology merges them, first that answers wins ------

# Layout variables, most specific first: (chips per unit, units per slice). libtpu runs one
# process per TPU_PROCESS_BOUNDS cell; TPU_HOST_BOUNDS is the per-host spelling of the same.
_BOUNDS = (("TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS"),
           ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS"))


def _lookup(kv: Mapping[str, str], prefix: str, short_names: bool):
  """get(NAME) -> (value, source) or (None, None). `tpu-env` metadata writes some keys with
  the TPU_ prefix (TPU_ACCELERATOR_TYPE) and some without (ACCELERATOR_TYPE): read both."""
  def get(name):
    keys = (name, name.removeprefix("TPU_")) if short_names else (name,)
    for key in keys:
      value = kv.get(key)
      if value is not None and str(value).strip() and not _is_libtpu_note(str(value)):
        return str(value).strip(), prefix + key
    return None, None
  return get


def _is_libtpu_note(value: str) -> bool:
  """libtpu, initialised on a machine without TPU metadata (ahead-of-time compiles for a
  described TPU), writes its warning into the variable it couldn't fill, e.g.
  TPU_WORKER_ID='WARNING: could not determine TPU worker number, ...': no value, so unset
  (every process the job starts afterwards inherits it)."""
  return value.lstrip().startswith("WARNING:")


def _as_ints(value: str, source: str, sep: str, minimum: int) -> tuple[int, ...]:
  try:
    out = tuple(int(x) for x in value.split(sep))
  except ValueError:
    out = ()
  if not out or min(out) < minimum:
    raise TopologyError(f"{source}={value!r} is not {sep!r}-separated integers >= {minimum}; "
                        "fix or unset it.")
  return out


def _layout_facts(get) -> Facts:
  """The slice layout one source states: its bounds (a pair, both given) before its
  TPU_TOPOLOGY, which a host carved out of a bigger slice keeps from the whole slice."""
  for per_name, bounds_name in _BOUNDS:
    (per, per_src), (bounds, bounds_src) = get(per_name), get(bounds_name)
    if per and bounds:
      a, b = _as_ints(per, per_src, ",", 1), _as_ints(bounds, bounds_src, ",", 1)
      if len(a) != len(b):
        raise TopologyError(f"{per_src}={per!r} and {bounds_src}={bounds!r} have different "
                            "ranks; they must be comma-separated lists of the same length.")
      return {"chip_grid": (tuple(x * y for x, y in zip(a, b)), f"{per_src}*{bounds_src}"),
              "processes_per_slice": (math.prod(b), bounds_src)}
  topology, src = get("TPU_TOPOLOGY")
  return {"chip_grid": (parse_shape(topology), src)} if topology else {}


def _kv_facts(get) -> Facts:
  """Facts from TPU environment variables, or from the same keys in `tpu-env` metadata."""
  facts = _layout_facts(get)
  for field, name, minimum in (("worker_id", "TPU_WORKER_ID", 0),
                               ("num_slices", "MEGASCALE_NUM_SLICES", 1),
                               ("slice_index", "MEGASCALE_SLICE_ID", 0)):
    value, src = get(name)
    if value is not None:
      facts[field] = (_as_ints(value, src, ",", minimum)[0], src)
  acc, src = get("TPU_ACCELERATOR_TYPE")
  if acc:
    facts["accelerator_type"] = (acc, src)
  for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):  # JAX's hosts of one slice
    hosts, src = get(name)
    if hosts and "processes_per_slice" not in facts:
      facts["processes_per_slice"] = (len([h for h in hosts.split(",") if h.strip()]), src)
  return facts


def _env_facts(env: Mapping[str, str]) -> Facts:
  return _kv_facts(_lookup(env, "env:", short_names=False))


def _metadata_facts(timeout_s: float, url: str) -> Facts:
  get = lambda path: _metadata.get("instance/attributes/" + path, timeout_s=timeout_s, url=url)
  facts: Facts = {}
  acc, worker = get("accelerator-type"), get("agent-worker-number")
  if acc:
    facts["accelerator_type"] = (acc, "metadata:instance/attributes/accelerator-type")
  if worker and worker.isdigit():
    facts["worker_id"] = (int(worker), "metadata:instance/attributes/agent-worker-number")
  # The slice's hosts, as JAX's Cloud TPU cluster reads them: "name:id:ip" triples or names.
  hosts = [h for h in (get("worker-network-endpoints") or "").split(",") if h.strip()]
  if hosts:
    facts["processes_per_slice"] = (len(hosts),
                                    "metadata:instance/attributes/worker-network-endpoints")
  # Lines such as "TOPOLOGY: '2x4x8'", "TPU_WORKER_ID: '0'", "MEGASCALE_SLICE_ID: '1'".
  kv = dict(re.findall(r"^\s*([A-Z_]+)\s*:\s*'?([^'\n]*)'?\s*$", get("tpu-env") or "", re.M))
  get_kv = _lookup(kv, "metadata:instance/attributes/tpu-env:", short_names=True)
  return {**_kv_facts(get_kv), **facts}


def _device_facts(devices: list, src: str) -> Facts:
  """Facts the devices show; described devices (a topology description) count their own
  processes and slices, which need not be this machine's."""
  import jax  # deferred: detection from env/metadata needs no backend
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  me = jax.process_index() if jax.process_index() in by_process else min(by_process)
  slice_of = lambda d: getattr(d, "slice_index", 0) or 0
  slices = sorted({slice_of(d) for d in devices})
  d0, procs = devices[0], src + " process_index"
  facts: Facts = {
      "platform": (d0.platform, src), "device_kind": (d0.device_kind, src),
      "num_devices": (len(devices), src), "num_processes": (len(by_process), procs),
      "devices_per_process": (len(by_process[me]), procs),
      "process_index": (me, "jax.process_index()"),
      "num_slices": (len(slices), src + " slice_index"),
      "slice_index": (slice_of(by_process[me][0]), src + " slice_index"),
      "processes_per_slice": (max(len(by_process) // len(slices), 1), procs),
  }
  if d0.platform == "tpu" and getattr(d0, "coords", None) is not None:
    grid = _coords_grid([tuple(d.coords) for d in devices if slice_of(d) == slices[0]])
    if grid:
      facts["chip_grid"] = (grid, src + " coords")
    facts["devices_per_chip"] = (max(getattr(d, "core_on_chip", 0) for d in devices) + 1,
                                 src + " core_on_chip")
  return facts


def _coords_grid(coords: list[tuple[int, ...]]) -> tuple[int, ...]:
  """The box the chips' coordinates span, e.g. (2, 2, 1); () where the chips don't fill it
  (some chips of a host, such as TPU_VISIBLE_CHIPS=0,3 of a 2x2: no grid to name). A part
  of a host need not start at the origin: one chip at (1, 1, 0) is a 1x1x1 grid."""
  chips = set(coords)
  grid = tuple(max(c[i] for c in chips) - min(c[i] for c in chips) + 1
               for i in range(len(coords[0])))
  return grid if math.prod(grid) == len(chips) else ()


def _override_facts(override: str) -> Facts:
  text = override.strip()
  if not text:
    raise TopologyError(
        f"topology override {override!r} is empty: expected a chip grid such as '2x4x8', "
        "'v5p:2x4x8', slices first as '2x4x4x8', an accelerator type such as 'v5p-128', or "
        "slices of one as '2x v5p-128'.")
  facts: Facts = {}
  m = re.fullmatch(r"(\d+)\s*x\s*([a-z]\S*)", text)  # "2x v5p-128": two slices over DCN
  if m:
    facts["num_slices"] = (_as_ints(m.group(1), "override slices", ",", 1)[0], "override")
    text = m.group(2)
  if re.fullmatch(r"[a-z0-9]+-\d+", text):
    parse_accelerator_type(text)  # validates
    return {**facts, "accelerator_type": (text, "override")}
  if ":" in text:
    gen, _, text = text.partition(":")
    if gen.strip() not in _GRID_PREFIXES:
      raise TopologyError(
          f"topology override {override!r} names an unknown TPU generation {gen!r}: expected "
          f"one of {sorted(_GRID_PREFIXES)} before ':', e.g. 'v5p:2x4x8'.")
    facts["generation"] = (_GRID_PREFIXES[gen.strip()], "override")
  dims = parse_shape(text)
  if len(dims) == 4:
    facts["num_slices"] = (dims[0], "override")
    dims = dims[1:]
  return {**facts, "chip_grid": (dims, "override")}


def _tpu_device_files() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _on_tpu_vm(env: Mapping[str, str]) -> bool:
  """Whether asking the metadata service is worth it: never on a laptop or in CI. A server
  named by GCE_METADATA_HOST is asked; else a TPU VM's (its device files), unless
  TPU_SKIP_MDS_QUERY is set. (`import jax` sets TPU_SKIP_MDS_QUERY=1 on every machine
  without TPU chips, so it can't veto a server the user named.)"""
  if env.get("GCE_METADATA_HOST"):
    return True
  return not env.get("TPU_SKIP_MDS_QUERY") and _tpu_device_files()


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


# --- merge ---------------------------------------------------------------------------------

def detect_topology(override: str | None = None, *, devices=None,
                    env: Mapping[str, str] | None = None,
                    metadata_timeout_s: float = 1.0) -> Topology:
  """Detects the hardware this process belongs to, or describes a target's devices.

  Each fact comes from the first source that states it, in this order (the reason for each
  step after the dash):

  1. `override` - the caller says what to plan for; nothing on the machine can know better.
  2. The environment (`env`) - a launcher (GKE, a queued resource, a user) sets it for this
     process, and libtpu reads it before anything else. Within it, the layout of one slice
     comes from, first present:
     a. TPU_CHIPS_PER_PROCESS_BOUNDS x TPU_PROCESS_BOUNDS - exactly the grid libtpu runs,
        one process per cell (the names libtpu and multi-process launchers use);
     b. TPU_CHIPS_PER_HOST_BOUNDS x TPU_HOST_BOUNDS - the per-host spelling of the same;
        a bounds variable counts only with its partner;
     c. TPU_TOPOLOGY - the slice as provisioned: a host carved out of a bigger slice (GKE,
        or one host of a pod run alone) keeps it while the bounds say what runs.
     Also TPU_ACCELERATOR_TYPE, TPU_WORKER_ID, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID,
     and the hosts of one slice (TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES, as JAX).
  3. The Cloud TPU metadata service - the VM as provisioned; libtpu and JAX consult it only
     for what the environment lacks. `accelerator-type`, `agent-worker-number`, and the
     `tpu-env` lines (keys with or without TPU_: ACCELERATOR_TYPE / TPU_ACCELERATOR_TYPE,
     WORKER_ID / TPU_WORKER_ID, the layout in the order a-c, MEGASCALE_*). Asked only on
     what looks like a TPU VM (`/dev/accel*`, `/dev/vfio/N`, or `GCE_METADATA_HOST`).
  4. The devices - what libtpu actually built. Last for the layout because before
     `jax.distributed.initialize` a process may see only its own; they fill every fact the
     sources above leave out, and the device count checks those sources.

  Where the environment or the metadata disagrees with the devices present - a layout or
  accelerator type of more (or fewer) devices, or another TPU generation - the devices are
  the truth: a VM's or node's variables describe its whole host while a job may get part
  of it (one chip of a v5e/v6e host in a notebook or container, GKE's `google.com/tpu: 1`
  on a bigger node, TPU_VISIBLE_CHIPS, several processes per host). The topology is then
  built from the override and the devices alone, `Topology.set_aside` says which variable
  said what, and one INFO line is logged. Only an override the caller typed that
  contradicts the devices is refused.

  The generation comes from an override's "GEN:", else the devices' `device_kind`, else the
  accelerator type (which may name the generation alone, as "tpu7x", taking the count from
  the layout). `process_index` is worker id + slice id x processes per slice (as JAX's
  Cloud TPU cluster computes it); without a worker id, `jax.process_index()`.

  Args:
    override: "4x4", "2x4x8", "v5p:2x4x8" / "v5:2x2x1" (libtpu's names), slices first as
      "2x4x4x8", an accelerator type "v5p-128", or "2x v5p-128" (two slices).
    devices: the devices to describe (default `jax.devices()`), e.g. libtpu's described
      devices `jax.experimental.topologies.get_topology_desc(...).devices` of a target pod.
    env: environment to read (default `os.environ`).
    metadata_timeout_s: per-request timeout of the metadata service, seconds (> 0);
      unreachable means "no answer", never an error.

  Returns:
    A `Topology`; `topology.sources` names where each fact came from.

  Raises:
    TopologyError: an argument of the wrong type; malformed override or environment values;
      an unknown accelerator type; or an override whose generation or device count
      disagrees with the devices (the message gives the devices' own layout as the fix).

  Examples:
    On 8 simulated CPU devices (`simulate_cpu_devices(8)`):

    >>> import fnscale as fs
    >>> topo = fs.detect_topology()
    >>> topo.platform, topo.num_devices, topo.num_slices, topo.num_processes
    ('cpu', 8, 1, 1)
    >>> topo.sources["num_devices"]
    'jax.devices()'

    An override wins over what the devices show: here 2 slices of 1x2x2 chips.

    >>> two = fs.detect_topology("2x1x2x2")
    >>> two.num_slices, two.chip_grid, two.sources["chip_grid"]
    (2, (1, 2, 2), 'override')

    Variables describing a whole 2x2 host while one device is present: the device decides.

    >>> import jax
    >>> one = fs.detect_topology(devices=jax.devices()[:1], env={
    ...     "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,1"})
    >>> one.num_devices, one.set_aside.partition(" says ")[0]
    (1, 'env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS')
  """
  import jax
  _check_detect_args(override, env, metadata_timeout_s)
  env = os.environ if env is None else env
  src = "jax.devices()" if devices is None else "devices"
  devices = check_devices(jax.devices() if devices is None else devices)
  typed = _override_facts(override) if override is not None else {}
  said = _merged(_env_facts(env), _metadata_facts(metadata_timeout_s, _metadata.base_url(env))
                 if _on_tpu_vm(env) else {})
  seen = _device_facts(devices, src)
  facts = _merged(typed, said, seen)
  topo = _topology(facts)
  problem = _disagreement(topo, facts)
  if problem and problem[0] != "override":
    # The environment or the metadata said it: the devices present are the truth.
    facts = _merged(typed, seen)
    topo = _topology(facts)
    topo = dataclasses.replace(topo, set_aside=_set_aside_note(problem[1], topo))
    logging.info("topology: %s", topo.set_aside)
    problem = _disagreement(topo, facts)
  if problem:
    raise TopologyError(f"{problem[1]}; fix: {_override_fix(seen)}")
  logging.debug("detected topology %s from %s", topo, dict(topo.sources))
  return topo


def _merged(*sources: Facts) -> Facts:
  """The facts of `sources`, the first that states each one winning."""
  facts: Facts = {}
  for new in sources:
    for k, v in new.items():
      facts.setdefault(k, v)
  return facts


def _check_detect_args(override, env, metadata_timeout_s) -> None:
  if override is not None:
    _check_type("override", override, str, "None or a str such as 'v5p-128' or '2x4x8'")
  if env is not None:
    _check_type("env", env, Mapping, "None or a mapping of environment variables")
  _check_type("metadata_timeout_s", metadata_timeout_s, (int, float), "a number of seconds > 0")
  if metadata_timeout_s <= 0:
    raise TopologyError(f"metadata_timeout_s={metadata_timeout_s!r}: expected seconds > 0.")


def _topology(facts: Facts) -> Topology:
  """The merged facts as a `Topology` (unchecked: `_disagreement` checks it)."""
  value = lambda k, default=None: facts[k][0] if k in facts else default
  sources = {k: s for k, (_, s) in facts.items()}
  generation, acc_chips = _generation(facts, sources)
  grid = _slice_grid(value("chip_grid", ()), generation)
  platform, devices_per_chip = value("platform"), value("devices_per_chip", 1)
  peak, hbm = _per_device(platform, generation, value("device_kind"), devices_per_chip)
  if peak is not None:
    sources["peak_flops_per_device"] = sources["hbm_bytes_per_device"] = "facts table"
  if not grid and acc_chips:
    sources["chip_grid"] = "unknown (accelerator type gives only the chip count)"
  if grid or acc_chips:
    sources["num_chips"] = sources["chip_grid"] if grid else sources["accelerator_type"]
  process_index, sources["process_index"] = _process_index(facts)
  tpu = CHIP_FACTS[generation] if platform == "tpu" and generation in TPU_GENERATIONS else None
  return Topology(
      platform=platform, device_kind=value("device_kind"), generation=generation,
      num_devices=value("num_devices"), num_processes=value("num_processes"),
      num_slices=value("num_slices"), devices_per_process=value("devices_per_process"),
      chip_grid=grid, num_chips=math.prod(grid) if grid else (acc_chips or 0),
      cores_per_chip=tpu.cores_per_chip if tpu else 1,
      accelerator_type=value("accelerator_type"), process_index=process_index,
      slice_index=value("slice_index"), peak_flops_per_device=peak, hbm_bytes_per_device=hbm,
      sources=types.MappingProxyType({k: sources[k] for k in _FIELDS if k in sources}))


_FIELDS = tuple(f.name for f in dataclasses.fields(Topology)
                if f.name not in ("sources", "set_aside"))


def _generation(facts: Facts, sources: dict[str, str]) -> tuple[str | None, int | None]:
  """(generation, chips per slice from the accelerator type or None); records the source."""
  acc = facts.get("accelerator_type", (None,))[0]
  acc_gen, acc_chips = _type_or_generation(acc) if acc else (None, None)
  if "generation" in facts:
    return facts["generation"][0], acc_chips
  dev_gen = _device_generation(facts)
  generation = dev_gen or acc_gen
  if generation:
    sources["generation"] = (facts["device_kind"][1] + " device_kind" if dev_gen
                             else facts["accelerator_type"][1])
  return generation, acc_chips


def _slice_grid(grid: tuple[int, ...], generation: str | None) -> tuple[int, ...]:
  """One spelling per slice: 3 dims on 3-D torus generations (v4, v5p, TPU7x), and a
  trailing 1 dropped on 2-D ones (v2, v3, v5e, v6e), whichever source gave the grid."""
  grid = tuple(grid)
  dims = CHIP_FACTS[generation].torus_dims if generation in TPU_GENERATIONS else None
  if dims == 2 and len(grid) == 3 and grid[-1] == 1:
    return grid[:2]
  if dims == 3 and 0 < len(grid) < 3:
    return grid + (1,) * (3 - len(grid))
  return grid


def _process_index(facts: Facts) -> tuple[int, str]:
  """Worker id within the slice + slice id x processes per slice, as JAX's Cloud TPU
  cluster computes the job-wide index; without a worker id, what jax says."""
  if "worker_id" not in facts:
    return facts["process_index"]
  (worker, wsrc), (slice_id, ssrc) = facts["worker_id"], facts["slice_index"]
  if slice_id == 0:
    return worker, wsrc
  per, psrc = facts["processes_per_slice"]
  return worker + slice_id * per, f"{wsrc} + {ssrc} x {psrc}"


def _per_device(platform, generation, device_kind, devices_per_chip):
  """(peak bf16 FLOP/s, HBM bytes) of one device from the facts tables, or (None, None)."""
  tpu = CHIP_FACTS[generation] if generation in TPU_GENERATIONS else None
  if tpu and platform == "tpu":
    return tpu.peak_flops / devices_per_chip, tpu.hbm_bytes // devices_per_chip
  g = gpu_facts(device_kind) if platform == "gpu" else None
  return (g.peak_flops, g.hbm_bytes) if g else (None, None)


def _device_generation(facts: Facts) -> str | None:
  return generation_of(facts["device_kind"][0]) if facts["platform"][0] == "tpu" else None


def _disagreement(topo: Topology, facts: Facts) -> tuple[str, str] | None:
  """(the source that disagrees with the devices, what it says), or None: a generation
  other than the TPU devices', or a layout (chips x slices) of another device count."""
  return _other_generation(topo, facts) or _other_count(topo, facts)


def _other_generation(topo: Topology, facts: Facts) -> tuple[str, str] | None:
  dev_gen = _device_generation(facts)
  for field in ("generation", "accelerator_type"):
    if field not in facts or not dev_gen:
      continue
    value, where = facts[field]
    gen = value if field == "generation" else _type_or_generation(value)[0]
    if gen != dev_gen:
      what = f"{value!r}" if field == "accelerator_type" else f"generation {value!r}"
      return where, (f"{'topology override' if where == 'override' else where} {what} is a "
                     f"{gen}, but the devices are {topo.device_kind!r} ({dev_gen})")
  return None


def _other_count(topo: Topology, facts: Facts) -> tuple[str, str] | None:
  if not topo.num_chips:
    return None
  per_chip = facts.get("devices_per_chip", (1,))[0] if topo.platform == "tpu" else 1
  expected = topo.num_chips * per_chip * topo.num_slices  # off TPU a grid is devices
  # The sources of the chips and of the slices, but for the devices' own (never at fault).
  said = list(dict.fromkeys(
      where for where in (facts["chip_grid" if topo.chip_grid else "accelerator_type"][1],
                          facts["num_slices"][1])
      if not where.startswith(facts["num_devices"][1])))
  if expected == topo.num_devices or not said:
    return None
  many = "device is" if topo.num_devices == 1 else "devices are"
  return next((where for where in said if where != "override"), "override"), (
      f"topology from {' and '.join(said)} say{'s' * (len(said) == 1)} {topo.num_slices} "
      f"slice(s) x {'x'.join(map(str, topo.chip_grid)) or topo.num_chips} = {expected} "
      f"devices, but {topo.num_devices} {topo.platform} {many} present")


def _set_aside_note(said: str, topo: Topology) -> str:
  grid = "x".join(map(str, topo.chip_grid)) or "?"
  return (f"{said.removeprefix('topology from ')}: topology from the devices present (chip "
          f"grid {grid}), the TPU_* variables and the metadata set aside")


def _override_fix(seen: Facts) -> str:
  """How to write an override the devices agree with, or to leave it out."""
  n, platform, slices = seen["num_devices"][0], seen["platform"][0], seen["num_slices"][0]
  gen = _device_generation(seen)
  grid = seen.get("chip_grid", ((),))[0]
  if gen and grid:
    mine = f"{gen}:{'x'.join(map(str, _slice_grid(grid, gen)))}"
    mine = f"'{slices}x {mine}'" if slices > 1 else f"'{mine}'"
  else:
    mine = f"a layout of {n} {platform} device(s) such as '{n}'"
  return (f"leave the override out (the devices give the topology), give theirs ({mine}), "
          "or run on the hardware it describes")
