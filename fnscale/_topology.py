"""Topology: what hardware this job runs on, and where each fact came from.

`detect_topology` asks, first that answers: an explicit override string, the TPU
environment variables a Cloud TPU VM or GKE sets, the Cloud TPU metadata service, and
finally the devices (`jax.devices()` or libtpu's described devices). The result is an
immutable `Topology` value; the precedence and its reasons are in `detect_topology`.

Read this file first; its parts, each with one job:

- `_chips.py`: the chip facts (`CHIP_FACTS`: peak FLOP/s, HBM, links, the allocator's limit
  per TPU generation or NVIDIA GPU, with their sources), the names that point at a row
  (device kinds, accelerator types, libtpu's topology names), a slice's standard grid, and
  `device_memory`.
- `_override.py`: the strings a caller writes (an override, a target) as facts, and
  `target_devices`, a TPU target's described devices.
- `_sources.py`: the environment, the metadata service and the devices, each as facts.
- `_machine.py`: this machine without a backend: accelerator device files
  (`has_accelerator`), `quiet_libtpu`, `simulate_cpu_devices`, `check_devices`.

This file holds `Topology` and `detect_topology`, which merges the sources' facts and
checks them against the devices.
"""
import dataclasses
import math
import os
import types
from collections.abc import Mapping

from absl import logging

from fnscale import _metadata
from fnscale._chips import (CHIP_FACTS, TPU_GENERATIONS, ChipFacts, GiB,  # noqa: F401
                            _check_type, _slice_grid, _type_or_generation, device_memory,
                            generation_of, gpu_facts, libtpu_topology_name,
                            parse_accelerator_type, standard_grid, tpu_prefix_generation)
from fnscale._errors import TopologyError
from fnscale._machine import (QUIET_LIBTPU_ENV, check_devices, has_accelerator,  # noqa: F401
                              quiet_libtpu, simulate_cpu_devices)
from fnscale._override import Facts, _override_facts, parse_shape, target_devices  # noqa: F401
from fnscale._sources import _device_facts, _env_facts, _metadata_facts, _on_tpu_vm


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
