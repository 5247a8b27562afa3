"""Chip facts: each TPU generation's and NVIDIA GPU's published figures, and their names.

`CHIP_FACTS` (one row per TPU generation or NVIDIA GPU) is the only place fnscale states a
chip's published figures; the topology, the planner's targets, MFU and the recipes all read
them here, with the names that point at a row: a `device_kind`, an accelerator type
("v5p-128"), libtpu's topology names, and the chip grid Google provisions for a slice. Peak
FLOP/s are dense bf16 per chip; each row's `source` names where each of its figures comes
from:

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
- The host link (`host_link`): measured on one v5e (`V5E_HOST_LINK`); no other chip's.
- libtpu's topology names ("v5p:2x2x2", "tpu7x:2x2x1"), as
  `jax.experimental.topologies.get_topology_desc` takes them.
"""
import math
import re
import types
from collections.abc import Mapping
from typing import NamedTuple

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
    host_link: bytes/s one way between the chip and its host's memory (offloaded buffers'
      trips), measured; None where not measured.

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
  host_link: float | None = None


# The allocator's limit (`memory_stats()["bytes_limit"]`) measured on one v5e chip (jax
# 0.10.2, libtpu 0.0.42.1, 2026-12-06): 15.75 GiB of its 16; the runtime keeps 258 MiB.
V5E_LIMIT = 16_909_336_576
# Host link of one v5e chip (jax 0.10.2, libtpu 0.0.42.1, 2026-12-07): the 766M Llama's step
# that offloads every weight matmul's output (recipes/lm/remat.py's offload_dots) moved 5.5
# GiB to the host in its forward pass and back in its backward in 1.386 s, bound by the link
# (recipes/bench/chip_v5e.json, rows_2026_12_07e): 2 x 5.9e9 B / 1.386 s, one way at a time.
V5E_HOST_LINK = 8.5e9
# TPUs not measured here are taken to keep v5e's reserve per chip.
_TPU_RESERVE = 16 * GiB - V5E_LIMIT


def _tpu_row(kinds, peak, hbm, *, torus, cores, counts, hbm_bw=None, ici=None, dcn=None,
             libtpu, source, limit=None, host=None) -> ChipFacts:
  why = ("bytes_limit measured on a v5e chip" if limit else
         f"HBM less v5e's measured runtime reserve ({_TPU_RESERVE // 2**20} MiB), not measured")
  return ChipFacts("tpu", peak, hbm, hbm_bw, ici, dcn, torus, 4, cores, counts, kinds, libtpu,
                   source, limit or hbm - _TPU_RESERVE, why, host)


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
                    limit=V5E_LIMIT, host=V5E_HOST_LINK,
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
