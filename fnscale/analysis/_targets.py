"""Planning targets: what a pod is made of, from a `Topology` or a name such as "v5p-128".

The link bandwidths below belong beside the chip facts in `fnscale/topology.py` (`TPU_FACTS`,
`GPU_FACTS`); they live here until the two tables merge. Figures are per chip (per GPU):

- ICI, one direction per link: "How to Scale Your Model" (Austin et al., 2025, Google
  DeepMind; jax-ml.github.io/scaling-book, part 2 "TPUs", table of ICI bandwidths): v4 and v5e
  4.5e10 B/s, v5p and v6e 9e10 B/s. A 2-D torus chip has 4 ports, a 3-D torus chip 6.
- DCN per chip: Google Cloud "TPU v5p" page (50 Gbps per chip); "TPU v6e" page (NIC per
  8-chip host: v5e 2 x 100 Gbps, v6e 4 x 200 Gbps, i.e. 25 and 100 Gbps per chip). v4 has no
  published per-chip figure: taken as v5e's (an assumption, flagged in `sources`).
- HBM bandwidth per chip: the Cloud TPU pages (v4 1200 GB/s, v5e 819 GB/s, v5p 2765 GB/s,
  v6e 1640 GB/s); NVIDIA data sheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
- NVIDIA H100/H200 SXM: NVLink 900 GB/s per GPU both directions (NVIDIA H200 product page),
  450 GB/s one way to the NVSwitch; between nodes one 400 Gb/s ConnectX-7 NIC per GPU
  (NVIDIA DGX H200 data sheet), 5e10 B/s.
"""
from __future__ import annotations

import functools
import math
import re
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from fnscale import topology as _topology
from fnscale.errors import TopologyError


class LinkFacts(NamedTuple):
  """Interconnect and memory bandwidth of one chip kind. `ici_link`: bytes/s one way per ICI
  (or NVLink) link; `dcn`: bytes/s per chip across slices (or nodes); `hbm`: HBM bytes/s per
  chip; `switched`: links go through a switch (NVSwitch: every axis gets `ici_link` whatever
  its shape) rather than a torus."""
  ici_link: float
  dcn: float
  hbm: float
  switched: bool = False
  source: str = ""


LINK_FACTS: Mapping[str, LinkFacts] = types.MappingProxyType({
    "v4": LinkFacts(4.5e10, 25e9 / 8, 1.2e12, source="ICI: scaling book; DCN: assumed as v5e"),
    "v5e": LinkFacts(4.5e10, 25e9 / 8, 8.19e11, source="scaling book; Cloud TPU v6e page"),
    "v5p": LinkFacts(9e10, 50e9 / 8, 2.765e12, source="scaling book; Cloud TPU v5p page"),
    "v6e": LinkFacts(9e10, 100e9 / 8, 1.64e12, source="scaling book; Cloud TPU v6e page"),
    "H100": LinkFacts(4.5e11, 5e10, 3.35e12, True, "NVIDIA H100 / DGX data sheets"),
    "H200": LinkFacts(4.5e11, 5e10, 4.8e12, True, "NVIDIA H200 / DGX H200 data sheets"),
})

# Names libtpu's `get_topology_desc` knows, per generation key of `TPU_FACTS`.
_LIBTPU_NAMES = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}
_PREFIXES = {"v4": "v4", "v5e": "v5e", "v5litepod": "v5e", "v5p": "v5p", "v6e": "v6e"}
GPUS_PER_NODE = 8


class Hardware(NamedTuple):
  """One planning target. Figures are per JAX device.

  `name`: as given; `kind`: "tpu", "gpu" or "cpu"; `generation`: key of `LINK_FACTS` (None
  on CPU); `num_slices`; `devices_per_slice`; `chip_grid`: torus shape of one slice (() off
  TPU); `wrap`: torus wrap-around links on every grid dimension (full-pod shapes and v5p
  cubes); `peak_flops` (FLOP/s), `hbm_bytes`; `links`: `LinkFacts` (on CPU `ici_link` is the
  measured memory-copy rate of the whole host); `devices`: described devices for an
  ahead-of-time compile (None where there are none); `overlap`: whether collectives overlap
  compute (async collectives on TPU/GPU; not on simulated CPU devices); `no_devices`: why
  `devices` is None (libtpu's error, or a GPU target), "" where there are devices.
  """
  name: str
  kind: str
  generation: str | None
  num_slices: int
  devices_per_slice: int
  chip_grid: tuple[int, ...]
  wrap: bool
  peak_flops: float
  hbm_bytes: float
  links: LinkFacts
  devices: Any = None
  overlap: bool = True
  no_devices: str = ""

  @property
  def num_devices(self) -> int:
    return self.num_slices * self.devices_per_slice

  @property
  def chips(self) -> int:
    """Chips (GPUs) of the target: TPU slices count their chip grid, whatever the number of
    JAX devices per chip; elsewhere a device is a chip."""
    return math.prod(self.chip_grid) * self.num_slices if self.chip_grid else self.num_devices


def known_targets() -> list[str]:
  """Example target names `resolve` accepts (any power-of-two chip count works)."""
  return ["v5e-16", "v5e-256", "v6e-16", "v6e-256", "v5p-8", "v5p-128", "v4-128",
          "2x v5p-128", "2x v6e-256", "8x h200", "16x h100", "v5p:4x4x4", "cpu"]


def _wrap(generation: str, grid: tuple[int, ...]) -> bool:
  """Wrap-around links: v5p/v4 slices of whole 4x4x4 cubes; v5e/v6e full 16x16 pods."""
  if generation in ("v4", "v5p"):
    return all(g % 4 == 0 for g in grid)
  return tuple(grid) == (16, 16)


def _tpu(name: str, generation: str, chips: int | None, grid: tuple[int, ...] | None,
         slices: int) -> Hardware:
  facts = _topology.TPU_FACTS[generation]
  grid = grid or _topology.standard_grid(generation, chips)  # the one slice-shape rule
  devices, why = _describe(generation, grid, slices)
  per_slice = len(devices) // slices if devices else math.prod(grid)
  # A megacore chip (v4, v5p) is one JAX device; cores_per_chip devices otherwise.
  chips_per_device = math.prod(grid) / per_slice
  return Hardware(name, "tpu", generation, slices, per_slice, tuple(grid),
                  _wrap(generation, grid), facts.peak_flops * chips_per_device,
                  facts.hbm_bytes * chips_per_device, LINK_FACTS[generation], devices,
                  no_devices=why)


def _describe(generation: str, grid: tuple[int, ...], slices: int):
  """(libtpu's described devices for an ahead-of-time compile, "") or (None, why not): the
  planner still plans without them, and says why it could not compile."""
  name = f"{_LIBTPU_NAMES[generation]}:{'x'.join(map(str, grid))}"
  try:
    return list(_described(name, slices)), ""
  except Exception as e:  # pylint: disable=broad-except  # any libtpu failure is reported
    text = " ".join(str(e).split())[:400] or "(no message)"
    return None, (f"libtpu could not describe the devices of {name}"
                  + (f" x {slices} slices" if slices > 1 else "")
                  + f": {type(e).__name__}: {text}")


@functools.lru_cache(maxsize=64)  # a big topology takes libtpu a while; failures raise
def _described(name: str, slices: int) -> tuple:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return tuple(topologies.get_topology_desc(
      platform="tpu", topology_name=name,
      **({"num_slices": slices} if slices > 1 else {})).devices)


def _gpu(name: str, kind: str, count: int) -> Hardware:
  facts = next(v for k, v in _topology.GPU_FACTS.items() if k.lower() == kind.lower())
  nodes = max(count // GPUS_PER_NODE, 1)
  return Hardware(name, "gpu", kind.upper(), nodes, count // nodes, (), False,
                  facts.peak_flops, facts.hbm_bytes, LINK_FACTS[kind.upper()],
                  no_devices=("jax describes no GPU devices for ahead-of-time compiles (only "
                              "TPUs, through libtpu)"))


def cpu_hardware(matmul_flops: float, copy_bytes_per_s: float, devices=None) -> Hardware:
  """Simulated CPU devices: they share the host's cores, so each device gets 1/n of the
  measured matmul rate and of the measured memory-copy rate (`fnscale.analysis.plan.calibrate_cpu`)
  for collectives and memory traffic alike, and collectives do not overlap compute."""
  import jax  # pylint: disable=g-import-not-at-top
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  return Hardware("cpu", "cpu", None, 1, n, (), False, matmul_flops / n, float("inf"),
                  LinkFacts(copy_bytes_per_s / n, copy_bytes_per_s / n, copy_bytes_per_s / n,
                            True, "measured on this host"), devices, overlap=False)


_TPU_RE = re.compile(r"^(?P<gen>v\d\w*?|tpu7x)(?:-(?P<count>\d+)|:(?P<grid>\d+(?:x\d+)*))$")


def resolve(target, cpu_rates: tuple[float, float] | None = None) -> Hardware:
  """A `Hardware` from a `fnscale.Topology` or a name.

  Names: "v5p-128" (Cloud TPU accelerator type: v4/v5p count TensorCores, v5e/v6e chips),
  "v5p:4x4x4" (generation and chip grid), "2x v5p-128" (two slices over DCN), "8x h200" or
  "16x h100" (GPUs; 8 per NVLink node), "cpu" (this host's devices; needs `cpu_rates` =
  (matmul FLOP/s, copy bytes/s)).

  Raises:
    TopologyError: an unknown name (the message lists known ones) or a wrong type.
  """
  if isinstance(target, _topology.Topology):
    return _from_topology(target, cpu_rates)
  if not isinstance(target, str):
    raise TopologyError(f"target is a {type(target).__name__}, expected a fnscale.Topology or "
                        f"a name such as {known_targets()}")
  text = target.strip().lower()
  m = re.match(r"^(\d+)\s*x\s+(.+)$", text)
  count, rest = (int(m.group(1)), m.group(2).strip()) if m else (1, text)
  if rest == "cpu" and cpu_rates is not None:
    return cpu_hardware(*cpu_rates)
  if rest in ("h100", "h200"):
    return _gpu(target, rest, count)
  t = _TPU_RE.match(rest)
  gen = _PREFIXES.get(t.group("gen")) if t else None
  if gen is not None:
    if t.group("grid"):
      return _tpu(target, gen, None, tuple(int(g) for g in t.group("grid").split("x")), count)
    try:
      _, chips = _topology.parse_accelerator_type(rest)
    except TopologyError:
      chips = 0
    if chips and chips & (chips - 1) == 0:
      return _tpu(target, gen, chips, None, count)
  raise TopologyError(f"target {target!r} is not known; expected a fnscale.Topology or a name "
                      f"like {known_targets()} (\"cpu\" needs cpu_rates)")


def _from_topology(topo, cpu_rates) -> Hardware:
  if topo.platform == "cpu":
    if cpu_rates is None:
      raise TopologyError("planning for CPU devices needs measured rates: pass "
                          "cpu_rates=fnscale.analysis.plan.calibrate_cpu()")
    return cpu_hardware(*cpu_rates)
  if topo.platform == "gpu":
    kind = next((k for k in ("H200", "H100") if k in topo.device_kind), None)
    if kind is None:
      raise TopologyError(f"no link facts for GPU {topo.device_kind!r}; known: H100, H200")
    return _gpu(str(topo), kind, topo.num_devices)
  if topo.generation not in _LIBTPU_NAMES or not topo.chip_grid:
    raise TopologyError(f"topology {topo} has no chip grid or a generation without link "
                        f"facts; known: {sorted(_LIBTPU_NAMES)}")
  return _tpu(str(topo), topo.generation, None, tuple(topo.chip_grid), topo.num_slices)
