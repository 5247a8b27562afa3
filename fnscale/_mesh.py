"""Mesh: named device axes over the topology, and `with_mesh` to scope one.

Axes within a slice ride the ICI (inter-chip interconnect); axes across slices ride the DCN
(data-centre network). On TPU, devices are ordered by `mesh_utils.create_device_mesh` (one
slice) or `create_hybrid_device_mesh` (several), which map mesh axes onto physical torus
dimensions so each ICI axis runs over neighbouring chips (where they return a tray's fixed
ring for a mesh of several axes, fnscale orders the chips by coordinates instead: see
`_on_torus`); elsewhere in device-id order. On GPU/CPU a DCN group spans processes
(`process_is_granule`), as across nodes of a cluster.
"""
import contextlib
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from fnscale import _deprecation
from fnscale import _axes
from fnscale import _compat
from fnscale import _tree
from fnscale._errors import MeshError, did_you_mean
from fnscale._topology import Topology, check_devices

AxesLike = Mapping[str, int] | str | Sequence[tuple[str, int]]


class MeshAxes(NamedTuple):
  """Axis sizes within a slice (`ici`) and across slices (`dcn`); -1 means "the rest".

  Examples:
    >>> import fnscale as fs
    >>> axes = fs.MeshAxes(ici={"fsdp": -1, "tensor": 2}, dcn={})
    >>> dict(fs.make_mesh(axes).shape)
    {'fsdp': 4, 'tensor': 2}
  """
  ici: dict[str, int]
  dcn: dict[str, int]


PRESETS = ("data", "fsdp", "tensor", "hybrid")


def parallelism(strategy: str, topology: Topology | None = None, *,
                tensor: int | None = None) -> MeshAxes:
  """Expands a named parallelism strategy into mesh axes for a topology.

  Strategies:
    "data": pure data parallel; every device a replica. Across slices the axis "replica".
    "fsdp": fully sharded data parallel (ZeRO-3) within a slice; "replica" across slices.
    "tensor": tensor parallel of size `tensor` (default: the devices of one process, which
      share the fastest links) with "fsdp" over the rest.
    "hybrid": "fsdp" within a slice and "replica" (data parallel) across slices, as in
      MaxText's hybrid sharding.

  Returns:
    `MeshAxes(ici, dcn)`: plain dicts you can print, edit and pass to `make_mesh`.

  Raises:
    MeshError: unknown strategy, a topology that isn't a `Topology`, or a tensor size that
      isn't a positive int.

  Examples:
    >>> import fnscale as fs
    >>> fs.parallelism("tensor", tensor=2)
    MeshAxes(ici={'fsdp': -1, 'tensor': 2}, dcn={})

    Two slices (here described by an override over the 8 devices): data parallel across them.

    >>> fs.parallelism("hybrid", fs.detect_topology("2x1x2x2"))
    MeshAxes(ici={'fsdp': -1}, dcn={'replica': 2})
  """
  if not isinstance(strategy, str):
    raise MeshError(f"strategy={strategy!r} ({type(strategy).__name__}): expected one of "
                    f"{PRESETS}.")
  if topology is not None and not isinstance(topology, Topology):
    raise MeshError(f"topology={topology!r} ({type(topology).__name__}): expected None or a "
                    "fnscale.Topology (from fs.detect_topology).")
  if strategy not in PRESETS:
    raise MeshError(f"unknown parallelism strategy {strategy!r}: expected one of {PRESETS}, "
                    "or give axes explicitly such as {'data': -1, 'tensor': 2}.")
  slices = topology.num_slices if topology is not None else 1
  dcn = {"replica": slices} if slices > 1 else {}
  if strategy == "data":
    return MeshAxes({"data": -1}, dcn)
  if strategy in ("fsdp", "hybrid"):
    return MeshAxes({"fsdp": -1}, dcn)
  if tensor is None:
    tensor = topology.devices_per_process if topology is not None else jax.local_device_count()
  if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
    raise MeshError(f"tensor parallel size tensor={tensor!r} ({type(tensor).__name__}) must "
                    "be a positive int.")
  return MeshAxes({"fsdp": -1, "tensor": tensor}, dcn)


def parse_axes(axes: AxesLike, *, what: str = "axes") -> dict[str, int]:
  """Normalises `{"data": -1, "tensor": 2}`, `"data=-1,tensor=2"` or pairs to an ordered dict
  {name: size}, a size of -1 taking the devices left over (as `make_mesh` reads it).

  Args:
    axes: a mapping name -> size, a "name=size,..." string (spaces and empty entries
      allowed) or (name, size) pairs.
    what: how messages name `axes`, e.g. "--mesh".

  Raises:
    MeshError: malformed string, duplicate names, non-int or invalid sizes, two -1s.

  Examples:
    >>> import fnscale as fs
    >>> fs.parse_axes("data=-1, fsdp=2")
    {'data': -1, 'fsdp': 2}
    >>> fs.parse_axes("data=2,data=4", what="--mesh")
    Traceback (most recent call last):
    ...
    fnscale.MeshError: --mesh name 'data' appears twice in 'data=2,data=4': each axis ...
  """
  if isinstance(axes, str):
    pairs = []
    for part in filter(None, (p.strip() for p in axes.split(","))):
      m = re.fullmatch(r"([A-Za-z_][\w]*)\s*=\s*(-?\d+)", part)
      if not m:
        raise MeshError(f"{what} entry {part!r} in {axes!r} is not NAME=SIZE: write e.g. "
                        "'data=-1,fsdp=4,tensor=2'.")
      pairs.append((m.group(1), int(m.group(2))))
  elif isinstance(axes, Mapping):
    pairs = list(axes.items())
  else:
    try:
      pairs = [(n, s) for n, s in axes]
    except (TypeError, ValueError):
      raise MeshError(f"{what} {axes!r} ({type(axes).__name__}) must be a mapping name -> "
                      "size, a 'name=size,...' string or (name, size) pairs.") from None
  out: dict[str, int] = {}
  for name, size in pairs:
    if not isinstance(name, str) or not name:
      raise MeshError(f"{what} name {name!r} ({type(name).__name__}) must be a non-empty "
                      "string.")
    if name in out:
      raise MeshError(f"{what} name {name!r} appears twice in {axes!r}: each axis once.")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (
        size < 1 and size != -1):
      raise MeshError(f"{what} {name!r} has size {size!r} ({type(size).__name__}): expected "
                      "a positive int or -1 (the devices left over).")
    out[name] = int(size)
  if list(out.values()).count(-1) > 1:
    raise MeshError(f"{what} {axes!r} has more than one -1; at most one axis per group can "
                    "take the devices left over: give the others explicit sizes.")
  return out


def _resolve(sizes: dict[str, int], total: int, what: str, unit: str = "devices") -> dict[str, int]:
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if total % known:
      raise MeshError(f"{what} {sizes} can't fill {total} {unit}: the fixed sizes multiply to "
                      f"{known}, which doesn't divide {total}; pick sizes whose product "
                      "divides it.")
    return {n: (total // known if s == -1 else s) for n, s in sizes.items()}
  if known != total:
    raise MeshError(f"{what} {sizes} multiply to {known} {unit} but there are {total}; make "
                    f"the product {total} or use -1 for one axis.")
  return sizes


def make_mesh(axes: AxesLike | MeshAxes, *, dcn: AxesLike | None = None,
              topology: Topology | None = None, devices: Sequence[jax.Device] | None = None,
              axis_types: str | Sequence[AxisType] = "auto") -> Mesh:
  """Builds a `jax.sharding.Mesh` with named axes.

  Args:
    axes: axis sizes within a slice (ICI), e.g. `{"data": -1, "fsdp": 4, "tensor": 2}`,
      `"data=-1,fsdp=4,tensor=2"`, a preset name ("data", "fsdp", "tensor", "hybrid"; see
      `parallelism`), or a `MeshAxes`. -1 takes the devices left over.
    dcn: axis sizes across slices (TPU multi-slice) or processes (GPU/CPU), e.g.
      `{"replica": 2}` or `{"stage": 2}` (pipeline stages across slices). DCN axes come
      first (outermost) in the mesh. Not given, on devices of several TPU slices, a
      pipeline axis ("stage") in `axes` as large as the slice count runs across the slices
      (`make_mesh({"stage": 2, "fsdp": -1})` on 2 slices is `make_mesh({"fsdp": -1},
      dcn={"stage": 2})`); within a slice where asked (give `dcn`, e.g. `{"replica": 2}`).
    topology: used by presets; otherwise the devices themselves give the physical layout.
    devices: devices to place (default `jax.devices()`); may be TPU devices from
      `jax.experimental.topologies` for ahead-of-time compilation.
    axis_types: "auto" (default: sharding propagation, what `with_sharding_constraint`
      code expects), "explicit" (sharding-in-types), or one `jax.sharding.AxisType` per axis.

  Returns:
    A Mesh with axis names in order DCN axes, then ICI axes.

  Raises:
    MeshError: malformed or duplicate axes, an axis in both groups, sizes that don't match
      the device count (the message gives both counts), devices of several TPU slices
      without DCN axes (the message gives the slice count and a `dcn=` that fits), an axis
      name the ambient axis conventions don't know (the closest one named), unknown axis
      types, or an argument
      of the wrong type (devices that aren't `jax.Device`s, a topology that isn't a
      `Topology`).

  Examples:
    On 8 devices, -1 takes what the other axes leave:

    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": -1, "tensor": 2})
    >>> dict(mesh.shape)
    {'data': 4, 'tensor': 2}
    >>> fs.make_mesh("data=2,fsdp=4").axis_names
    ('data', 'fsdp')
    >>> dict(fs.make_mesh("fsdp").shape)  # a preset (see `parallelism`)
    {'fsdp': 8}
  """
  if topology is not None and not isinstance(topology, Topology):
    raise MeshError(f"topology={topology!r} ({type(topology).__name__}): expected None or a "
                    "fnscale.Topology (from fs.detect_topology).")
  if isinstance(axes, str) and axes.strip() in PRESETS:
    axes = parallelism(axes.strip(), topology)
  if isinstance(axes, MeshAxes):
    if dcn is not None:
      raise MeshError("pass dcn either inside MeshAxes or as dcn=, not both.")
    axes, dcn = axes.ici, axes.dcn
  ici = parse_axes(axes, what="ICI axes")
  dcn_axes = parse_axes(dcn or {}, what="DCN axes")
  both = sorted(set(ici) & set(dcn_axes))
  if both:
    raise MeshError(f"axis {both[0]!r} is in both the ICI axes {ici} and the DCN axes "
                    f"{dcn_axes}; an axis runs either within a slice or across slices: rename "
                    "one (e.g. 'replica' across slices, 'data' within).")
  if not ici and not dcn_axes:
    raise MeshError("no mesh axes given: pass e.g. {'data': -1}.")
  check_axis_names(ici, "ICI axes")
  check_axis_names(dcn_axes, "DCN axes")
  devices = check_devices(jax.devices() if devices is None else devices, "devices", MeshError)
  n = len(devices)
  if not dcn_axes:
    ici, dcn_axes = _stage_across_slices(devices, ici)
  if not dcn_axes:
    _check_one_slice(devices, ici)
  groups = _granules(devices) if dcn_axes else [devices]
  unit = "slices" if getattr(devices[0], "slice_index", None) is not None else "processes"
  dcn_sizes = _resolve(dcn_axes, len(groups), "DCN axes", unit) if dcn_axes else {}
  num_groups = math.prod(dcn_sizes.values()) if dcn_sizes else 1
  if num_groups != len(groups) and dcn_axes:
    raise MeshError(f"DCN axes {dcn_sizes} give {num_groups} groups but the devices form "
                    f"{len(groups)} slices/processes.")
  ici_sizes = _resolve(ici, n // num_groups, "ICI axes")
  names = tuple(dcn_sizes) + tuple(ici_sizes)
  types_ = _axis_types(axis_types, len(names))
  ici_shape = [1] * len(dcn_sizes) + list(ici_sizes.values())
  dcn_shape = list(dcn_sizes.values()) + [1] * len(ici_sizes)
  try:
    grid = _device_grid(devices, ici_shape, dcn_shape if dcn_sizes else None)
  except (ValueError, AssertionError, NotImplementedError) as e:
    shape = dict(zip(names, map(int, np.multiply(ici_shape, dcn_shape))))
    raise MeshError(f"can't lay mesh {shape} "
                    f"onto {n} {devices[0].platform} devices: {e}") from None
  return Mesh(grid, names, axis_types=types_)


def check_axis_names(names, what: str = "mesh axes") -> None:
  """Every name is one the ambient axis conventions give a meaning (`fnscale.axis_conventions`):
  another, e.g. "dta" for "data", would split neither the batch nor any param, its devices
  silently holding copies.

  Raises:
    MeshError: naming the axis, the known names, the closest one and the fix.

  Examples:
    >>> import fnscale as fs
    >>> fs.check_axis_names(["data", "fsdp"])  # known: returns None
    >>> fs.check_axis_names(["data", "fsdpp"], what="--mesh")
    Traceback (most recent call last):
    ...
    fnscale.MeshError: --mesh: axis 'fsdpp' is not one ... did you mean 'fsdp'? ...
  """
  known = sorted(_axes.current().names())
  for name in names:
    if name not in known:
      raise MeshError(
          f"{what}: axis {name!r} is not one the axis conventions give a meaning {known}"
          f"{did_you_mean(name, known)} (no batch split, rule or "
          "FSDP would use it: its devices would hold copies); fix: a known name, or declare "
          "yours around the whole job: with fs.axis_conventions(fs.AxisConventions(...)).")


def _stage_across_slices(devices, ici: dict) -> tuple[dict, dict]:
  """(ICI axes, DCN axes) for devices of several TPU slices given no DCN axes: a pipeline
  axis (`AxisConventions.stage`) of the slice count's size runs across the slices, where
  stages send only activations over the DCN; else the axes unchanged."""
  slices = {d.slice_index for d in devices if getattr(d, "slice_index", None) is not None}
  axis = next((a for a in _axes.current().stage if a in ici), None)
  if len(slices) < 2 or axis is None or ici[axis] != len(slices):
    return ici, {}
  return {k: v for k, v in ici.items() if k != axis}, {axis: ici[axis]}


def _check_one_slice(devices, ici: dict) -> None:
  """Refuses ICI-only axes over devices of several TPU slices: ICI ends at a slice's edge."""
  slices = sorted({d.slice_index for d in devices
                   if getattr(d, "slice_index", None) is not None})
  if len(slices) < 2:
    return
  k = len(slices)
  raise MeshError(
      f"the {len(devices)} devices span {k} TPU slices (slice_index {slices}), but no DCN "
      f"axes were given: the ICI axes {ici} run over the inter-chip links of one slice "
      f"({len(devices) // k} devices) and an ICI axis can't cross slices; fix: add an axis "
      f"across the slices, e.g. make_mesh({ici}, dcn={{'replica': {k}}}) (or "
      "dcn={'replica': -1}: data parallel across slices; train_lm.py: "
      f"--dcn=replica={k}), or pipeline stages across them with an ICI axis 'stage' of size "
      f"{k}, which make_mesh then lays across the slices.")


def _granules(devices) -> list[list]:
  """Devices grouped by slice (TPU multi-slice) or else by process."""
  key = (lambda d: d.slice_index) if getattr(devices[0], "slice_index", None) is not None \
      else (lambda d: d.process_index)
  out: dict[int, list] = {}
  for d in devices:
    out.setdefault(key(d), []).append(d)
  return [out[k] for k in sorted(out)]


def _device_grid(devices, ici_shape, dcn_shape) -> np.ndarray:
  tpu = devices[0].platform == "tpu" and getattr(devices[0], "coords", None) is not None
  if dcn_shape is not None:
    grid = mesh_utils.create_hybrid_device_mesh(
        ici_shape, dcn_shape, devices,
        process_is_granule=getattr(devices[0], "slice_index", None) is None,
        allow_split_physical_axes=True)
    return _on_torus(grid, ici_shape) if tpu else grid
  if tpu:
    try:
      grid = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    except AssertionError as e:
      if not _compat.is_megacore_error(e):
        raise
      grid = _per_core_grid(devices, ici_shape)
    return _on_torus(grid, ici_shape)
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return np.array(ordered, dtype=object).reshape(ici_shape)


def _on_torus(grid: np.ndarray, ici_shape) -> np.ndarray:
  """`mesh_utils`' TPU order, slice by slice, unless it puts the chips of an ICI axis off a box
  of neighbouring chips where an order by physical coordinates keeps every axis on one.

  mesh_utils lays most meshes out on the torus, but for some whole trays it returns one fixed
  ring reshaped to any mesh shape (v5e/v6e 2x2 and 2x4; in jax 0.12, which recognises v5p by
  its device kind "TPU v5" where 0.10.2 did not, the v5p 2x2x2 cube too): right for a mesh
  with one axis (a ring of neighbours, kept), but the outer axes of a multi-axis mesh then
  pair chips two hops apart.
  """
  # DCN axes come first and have ICI size 1: the axes before the first ICI one > 1 index
  # the slices (or are of size 1).
  first = next((i for i, s in enumerate(ici_shape) if s > 1), len(ici_shape))
  if first == grid.ndim:
    return grid  # one chip per slice: no ICI axis to lay out
  blocks = [b if _axes_on_boxes(b) else _coordinate_order(b)
            for b in grid.reshape((-1,) + grid.shape[first:])]
  return np.stack(blocks).reshape(grid.shape)


def _coordinate_order(block: np.ndarray) -> np.ndarray:
  """The block's devices sorted by torus coordinates (each priority of the physical
  dimensions in turn, x fastest first; a chip's cores adjacent), reshaped to the block's
  shape: the first such order that puts every axis on a box, else the block unchanged."""
  dims = len(block.flat[0].coords)
  for major in itertools.permutations(reversed(range(dims))):
    ordered = sorted(block.flat, key=lambda d: ([d.coords[k] for k in major],
                                                getattr(d, "core_on_chip", 0)))
    candidate = np.array(ordered, dtype=object).reshape(block.shape)
    if _axes_on_boxes(candidate):
      return candidate
  return block


def _axes_on_boxes(block: np.ndarray) -> bool:
  """Whether along every axis each line of devices covers a box of consecutive torus
  coordinates (a sub-torus: every chip's neighbours along the axis are one hop away)."""
  for i, size in enumerate(block.shape):
    for line in np.moveaxis(block, i, -1).reshape(-1, size):
      coords = {tuple(d.coords) for d in line}
      spans = [{c[k] for c in coords} for k in range(len(line[0].coords))]
      if (len(coords) != math.prod(map(len, spans))
          or any(max(s) - min(s) + 1 != len(s) for s in spans)):
        return False
  return True


def _per_core_grid(devices, shape) -> np.ndarray:
  """TPU v4/v5p devices exposed one per TensorCore (not megacore), which mesh_utils refuses:
  lay out chips with mesh_utils, then split each chip into its cores along the last axis so a
  chip's cores stay adjacent."""
  cores = max(d.core_on_chip for d in devices) + 1
  if shape[-1] % cores:
    raise ValueError(f"the last mesh axis ({shape[-1]}) must be a multiple of the {cores} cores "
                     "per chip when TPU cores are separate devices")
  chips = [d for d in devices if d.core_on_chip == 0]
  by_chip = {tuple(d.coords): [] for d in chips}
  for d in sorted(devices, key=lambda d: d.core_on_chip):
    by_chip[tuple(d.coords)].append(d)
  chip_grid = mesh_utils.create_device_mesh(list(shape[:-1]) + [shape[-1] // cores], chips,
                                            allow_split_physical_axes=True)
  out = np.empty(chip_grid.shape + (cores,), dtype=object)
  for idx, chip in np.ndenumerate(chip_grid):
    out[idx] = np.array(by_chip[tuple(chip.coords)], dtype=object)
  return out.reshape(shape)


def _axis_types(axis_types, n: int) -> tuple[AxisType, ...]:
  if isinstance(axis_types, str):
    names = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
    if axis_types.lower() not in names:
      raise MeshError(f"axis_types {axis_types!r}: expected 'auto', 'explicit' or a sequence "
                      "of jax.sharding.AxisType.")
    return (names[axis_types.lower()],) * n
  types_ = tuple(axis_types) if isinstance(axis_types, Sequence) else None
  if types_ is None or len(types_) != n or not all(isinstance(t, AxisType) for t in types_):
    raise MeshError(f"axis_types {axis_types!r}: expected {n} jax.sharding.AxisType values, "
                    "one per mesh axis.")
  return types_


@contextlib.contextmanager
def with_mesh(mesh: Mesh):
  """Makes `mesh` the ambient mesh (`jax.set_mesh`), as a context manager or a wrapper.

  `with with_mesh(mesh): ...` scopes a block; `with_mesh(mesh)(fn)` returns a function with
  `fn`'s signature that runs each call under the mesh. Traced code (the train step, sharding
  constraints, `constrain_batch`, kernels) reads it with `jax.sharding.get_abstract_mesh()`.
  The mesh is one of the five ambient values fnscale reads, all listed in `fnscale._context`
  (the others: the axis conventions of `axis_conventions`, the kernel choice of
  `with_kernel`, the params' specs `shard_step` sets while it traces). Like the kernel
  choice it is jax's thread-local state and part of `jax.jit`'s cache key. A mesh over
  described devices (an ahead-of-time target) is set as an abstract mesh: traced code sees
  it, while eager operations keep running on this machine's devices.

  Raises:
    MeshError: if `mesh` is not a `jax.sharding.Mesh`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 8})
    >>> with fs.with_mesh(mesh):
    ...   print(dict(jax.sharding.get_abstract_mesh().shape))
    {'data': 8}

    As a wrapper around a jitted function, whose batch rows `constrain_batch` splits:

    >>> @fs.with_mesh(mesh)
    ... @jax.jit
    ... def double(x):
    ...   return fs.constrain_batch(x * 2)
    >>> y = double(jnp.ones((8, 4)))
    >>> y.sharding.spec, y.addressable_shards[0].data.shape
    (P('data',), (1, 4))
  """
  check_mesh(mesh, "with_mesh")
  with contextlib.ExitStack() as stack:
    if not _runs_here(mesh):
      # A described target (AOT for a TPU from this machine): traced code sees its abstract
      # mesh, while eager ops keep running on this machine's devices.
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
      yield mesh
      return
    try:
      stack.enter_context(jax.set_mesh(mesh))
    except ValueError:
      # Inside a jit trace jax.set_mesh is refused; the abstract mesh is what traced code reads.
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
    yield mesh


def _runs_here(mesh: Mesh) -> bool:
  """Whether the mesh's devices belong to this process's runtime (not a topology description
  from `jax.experimental.topologies`, whose devices can compile but not run)."""
  first = mesh.devices.flat[0]
  try:
    return first in jax.devices(first.platform)
  except RuntimeError:  # no backend for that platform here: a described target
    return False


def check_mesh(mesh, fn: str, *, arg: str = "mesh", abstract: bool = False) -> None:
  """The one check of a mesh argument, for every function that takes one.

  Args:
    mesh: the value passed.
    fn: the function it was passed to, as messages name it ("shard_step").
    arg: the argument's name ("mesh", "meshes[1]").
    abstract: a `jax.sharding.AbstractMesh` is accepted too (shardings and specs can be
      derived over one; nothing can be placed on it).

  Raises:
    MeshError: naming `fn`, `arg` and what was passed, e.g. "batch_sharding: mesh is a str
      ('data=8'), expected a jax.sharding.Mesh; fix: fnscale.make_mesh(...), ...".
  """
  kinds = (Mesh, jax.sharding.AbstractMesh) if abstract else Mesh
  if not isinstance(mesh, kinds):
    what = "a jax.sharding.Mesh" + (" or AbstractMesh" if abstract else "")
    raise MeshError(f"{fn}: {arg} is {_tree.got(mesh)}, expected {what}; fix: "
                    "fnscale.make_mesh(...), e.g. fnscale.make_mesh({'data': -1}).")


def describe_mesh(mesh: Mesh) -> str:
  """The mesh in words: its shape and device count, then one line per axis: name, size, axis
  type, and the links it runs over (ICI / local, across processes, or DCN across slices).

  Raises:
    MeshError: if `mesh` is not a `jax.sharding.Mesh`.

  Examples:
    >>> import fnscale as fs
    >>> print(fs.describe_mesh(fs.make_mesh({"data": 4, "tensor": 2})))
    Mesh {'data': 4, 'tensor': 2} over 8 devices
      data       size    4  Auto     ICI / local
      tensor     size    2  Auto     ICI / local
  """
  check_mesh(mesh, "describe_mesh")
  lines = []
  devs = mesh.devices
  for i, name in enumerate(mesh.axis_names):
    moved = np.moveaxis(devs, i, -1).reshape(-1, devs.shape[i])
    row = moved[0]
    slices = {getattr(d, "slice_index", 0) or 0 for d in row}
    procs = {d.process_index for d in row}
    link = "DCN (across slices)" if len(slices) > 1 else (
        "across processes" if len(procs) > 1 else "ICI / local")
    lines.append(f"  {name:<10} size {devs.shape[i]:>4}  {mesh.axis_types[i].name:<8} {link}")
  return f"Mesh {dict(mesh.shape)} over {devs.size} devices\n" + "\n".join(lines)


__getattr__ = _deprecation.moved(__name__, {
    "describe": ("fnscale:describe_mesh", "fnscale.describe_mesh")})
