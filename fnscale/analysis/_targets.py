"""Planning targets: what a pod is made of, from a `Topology` or a name such as "v5p-128".

Every figure of a chip (peak FLOP/s, HBM, HBM/ICI/DCN bandwidths, torus, GPUs per node, the
libtpu name) is read from `fnscale.CHIP_FACTS`, which names its sources; a target
is planned for only where that table has link figures (TPU v4, v5e, v5p, v6e; H100, H200).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

from fnscale import _topology
from fnscale._errors import TopologyError


class LinkFacts(NamedTuple):
  """Interconnect and memory bandwidth of one chip kind, as the planner charges them.
  `ici_link`: bytes/s one way per ICI (or NVLink) link; `dcn`: bytes/s per chip across slices
  (or nodes); `hbm`: HBM bytes/s per chip; `switched`: links go through a switch (NVSwitch:
  every axis gets `ici_link` whatever its shape) rather than a torus; `source`: where the
  figures come from (a `CHIP_FACTS` row's, or "measured on this host")."""
  ici_link: float
  dcn: float
  hbm: float
  switched: bool = False
  source: str = ""


def link_facts(chip: str) -> LinkFacts | None:
  """The `LinkFacts` of a `CHIP_FACTS` key ("v5p", "H100"), or None where the table has no
  link figures for it."""
  f = _topology.CHIP_FACTS.get(chip)
  if f is None or None in (f.ici_link, f.dcn, f.hbm_bandwidth):
    return None
  return LinkFacts(f.ici_link, f.dcn, f.hbm_bandwidth, f.torus_dims == 0, f.source)


# The chips the planner has link figures for (`CHIP_FACTS` keys): TPU generations, and GPUs
# by their lower-case target names ("h100").
_PLANNED = tuple(k for k in _topology.CHIP_FACTS if link_facts(k) is not None)
_TPUS = tuple(k for k in _PLANNED if k in _topology.TPU_GENERATIONS)
_GPUS = {k.lower(): k for k in _PLANNED if k not in _TPUS}


class Hardware(NamedTuple):
  """One planning target. Figures are per JAX device.

  `name`: as given; `kind`: "tpu", "gpu" or "cpu"; `generation`: key of
  `fnscale.CHIP_FACTS` (None on CPU); `num_slices`; `devices_per_slice`;
  `chip_grid`: torus shape of one slice (() off TPU); `wrap`: torus wrap-around links on
  every grid dimension (full-pod shapes and v5p cubes); `peak_flops` (FLOP/s),
  `hbm_bytes` (published); `links`: `LinkFacts` (on CPU `ici_link` is the measured
  memory-copy rate of the whole host); `devices`: described devices for an ahead-of-time
  compile (None where there are none); `overlap`: whether collectives overlap compute
  (async collectives on TPU/GPU; not on simulated CPU devices); `no_devices`: why `devices`
  is None (libtpu's error, or a GPU target), "" where there are devices; `hbm_limit`: the
  bytes a program may hold (the allocator's limit, `fnscale.CHIP_FACTS`' `hbm_limit`; None:
  `hbm_bytes`) and `limit_source` where it comes from.
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
  hbm_limit: float | None = None
  limit_source: str = ""

  @property
  def memory_limit(self) -> float:
    """Bytes a program may hold per device: `hbm_limit`, or `hbm_bytes` where none is given."""
    return self.hbm_bytes if self.hbm_limit is None else self.hbm_limit

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
  facts = _topology.CHIP_FACTS[generation]
  grid = grid or _topology.standard_grid(generation, chips)  # the one slice-shape rule
  devices, why = _describe(generation, grid, slices)
  per_slice = len(devices) // slices if devices else math.prod(grid)
  # A megacore chip (v4, v5p) is one JAX device; cores_per_chip devices otherwise.
  chips_per_device = math.prod(grid) / per_slice
  return Hardware(name, "tpu", generation, slices, per_slice, tuple(grid),
                  _wrap(generation, grid), facts.peak_flops * chips_per_device,
                  facts.hbm_bytes * chips_per_device, link_facts(generation), devices,
                  no_devices=why, hbm_limit=facts.hbm_limit * chips_per_device,
                  limit_source=facts.limit_source)


def _describe(generation: str, grid: tuple[int, ...], slices: int):
  """(libtpu's described devices for an ahead-of-time compile, "") or (None, why not): the
  planner still plans without them, and says why it could not compile."""
  name = _topology.libtpu_topology_name(generation, grid)
  try:
    return list(_described(generation, tuple(grid), slices)), ""
  except Exception as e:  # pylint: disable=broad-except  # any libtpu failure is reported
    text = " ".join(str(e).split())[:400] or "(no message)"
    return None, (f"libtpu could not describe the devices of {name}"
                  + (f" x {slices} slices" if slices > 1 else "")
                  + f": {type(e).__name__}: {text}")


@functools.lru_cache(maxsize=64)  # a big topology takes libtpu a while; failures raise
def _described(generation: str, grid: tuple[int, ...], slices: int) -> tuple:
  """`fnscale.target_devices` of the slice: the one description of a target's
  devices (v4 as megacore, the host bounds libtpu needs for one chip or one host)."""
  spec = f"{generation}:{'x'.join(map(str, grid))}"
  return tuple(_topology.target_devices(f"{slices}x {spec}" if slices > 1 else spec))


def _gpu(name: str, kind: str, count: int) -> Hardware:
  facts = _topology.CHIP_FACTS[kind]
  nodes = max(count // facts.chips_per_host, 1)
  return Hardware(name, "gpu", kind, nodes, count // nodes, (), False,
                  facts.peak_flops, facts.hbm_bytes, link_facts(kind),
                  no_devices=("jax describes no GPU devices for ahead-of-time compiles (only "
                              "TPUs, through libtpu)"),
                  hbm_limit=facts.hbm_limit, limit_source=facts.limit_source)


def cpu_hardware(matmul_flops: float, copy_bytes_per_s: float, devices=None) -> Hardware:
  """Simulated CPU devices: they share the host's cores, so each device gets 1/n of the
  measured matmul rate and of the measured memory-copy rate (`fnscale.analysis.calibrate_cpu`)
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
  if rest in _GPUS:
    return _gpu(target, _GPUS[rest], count)
  t = _TPU_RE.match(rest)
  gen = _topology.tpu_prefix_generation(t.group("gen")) if t else None
  if gen in _TPUS:
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
                          "cpu_rates=fnscale.analysis.calibrate_cpu()")
    import jax  # pylint: disable=g-import-not-at-top
    # A topology of some of the devices (detect_topology(devices=...)) plans for those.
    return cpu_hardware(*cpu_rates, devices=jax.devices("cpu")[:topo.num_devices])
  if topo.platform == "gpu":
    facts = _topology.gpu_facts(topo.device_kind)
    kind = next((k for k in _GPUS.values() if _topology.CHIP_FACTS[k] is facts), None)
    if kind is None:
      raise TopologyError(f"no link facts for GPU {topo.device_kind!r}; known: "
                          f"{', '.join(_GPUS.values())}")
    return _gpu(str(topo), kind, topo.num_devices)
  if topo.generation not in _TPUS or not topo.chip_grid:
    raise TopologyError(f"topology {topo} has no chip grid or a generation without link "
                        f"facts; known: {sorted(_TPUS)}")
  return _tpu(str(topo), topo.generation, None, tuple(topo.chip_grid), topo.num_slices)
