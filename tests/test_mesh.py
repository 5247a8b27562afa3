"""Meshes on 8 simulated CPU devices and on real TPU device sets (ahead of time, no TPU)."""
import itertools
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import fnscale as fs


@pytest.mark.parametrize("axes,shape", [
    ({"data": 8}, {"data": 8}),
    ({"data": -1}, {"data": 8}),
    ({"data": 2, "fsdp": -1}, {"data": 2, "fsdp": 4}),
    ("data=-1,fsdp=2,tensor=2", {"data": 2, "fsdp": 2, "tensor": 2}),
    ([("fsdp", 4), ("tensor", 2)], {"fsdp": 4, "tensor": 2}),
])
def test_meshes_on_cpu(axes, shape):
  mesh = fs.make_mesh(axes)
  assert dict(mesh.shape) == shape
  assert mesh.axis_names == tuple(shape)
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  # Off TPU, devices are laid out in id order.
  assert [d.id for d in mesh.devices.flat] == list(range(8))


def test_explicit_axis_types():
  mesh = fs.make_mesh("data=2,tensor=4", axis_types="explicit")
  assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
  mesh = fs.make_mesh("data=2,tensor=4", axis_types=(AxisType.Auto, AxisType.Explicit))
  assert mesh.axis_types == (AxisType.Auto, AxisType.Explicit)
  with pytest.raises(fs.MeshError, match="expected 2 jax.sharding.AxisType"):
    fs.make_mesh("data=2,tensor=4", axis_types=(AxisType.Auto,))
  with pytest.raises(fs.MeshError, match="axis_types 'manual'"):
    fs.make_mesh("data=8", axis_types="manual")


def test_subset_of_devices():
  mesh = fs.make_mesh({"data": -1}, devices=jax.devices()[:2])
  assert dict(mesh.shape) == {"data": 2}
  # Another mesh's 2-D device array is a device sequence too.
  other = fs.make_mesh({"data": 2, "tensor": 4})
  mesh = fs.make_mesh({"fsdp": -1}, devices=other.devices)
  assert dict(mesh.shape) == {"fsdp": 8}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("axes,pattern", [
    ("data=-1,fsdp=-1", "more than one -1"),
    ("data=3,fsdp=2", r"multiply to 6 devices but there are 8"),
    ("data=3,fsdp=-1", r"fixed sizes multiply to 3, which doesn't divide 8"),
    ("data=2,data=4", "'data' appears twice"),
    ("data=0,fsdp=-1", "has size 0"),
    ("data=-2,fsdp=-1", "has size -2"),
    ("data:2", "is not NAME=SIZE"),
    ({"data": 2.0, "fsdp": 4}, "has size 2.0"),
    ({}, "no mesh axes"),
    ("pipeline", "is not NAME=SIZE"),
])
def test_bad_axes(axes, pattern):
  with pytest.raises(fs.MeshError, match=pattern):
    fs.make_mesh(axes)


def test_axis_in_both_ici_and_dcn():
  with pytest.raises(fs.MeshError, match="axis 'data' is in both the ICI axes"):
    fs.make_mesh({"data": -1}, dcn={"data": 1})


def test_presets_are_plain_axes():
  topo = fs.detect_topology(env={})
  assert fs.parallelism("data", topo) == fs.MeshAxes({"data": -1}, {})
  assert fs.parallelism("fsdp", topo) == fs.MeshAxes({"fsdp": -1}, {})
  assert fs.parallelism("tensor", topo, tensor=2) == fs.MeshAxes({"fsdp": -1, "tensor": 2}, {})
  assert dict(fs.make_mesh("hybrid", topology=topo).shape) == {"fsdp": 8}
  assert dict(fs.make_mesh(fs.parallelism("tensor", topo, tensor=4)).shape) == {
      "fsdp": 2, "tensor": 4}
  with pytest.raises(fs.MeshError, match="unknown parallelism strategy 'pipe'"):
    fs.parallelism("pipe", topo)
  with pytest.raises(fs.MeshError, match=r"tensor parallel size tensor=0 \(int\) must be a positive int"):
    fs.parallelism("tensor", topo, tensor=0)


def test_with_mesh_context_and_wrapper():
  mesh = fs.make_mesh("data=2,tensor=4")
  assert jax.sharding.get_abstract_mesh().empty
  with fs.with_mesh(mesh) as m:
    assert m is mesh
    assert dict(jax.sharding.get_abstract_mesh().shape) == {"data": 2, "tensor": 4}
  assert jax.sharding.get_abstract_mesh().empty

  @fs.with_mesh(mesh)
  def names(x):
    return jax.sharding.get_abstract_mesh().axis_names, x + 1

  assert names(1) == (("data", "tensor"), 2)
  assert names(2) == (("data", "tensor"), 3)  # reusable
  assert jax.sharding.get_abstract_mesh().empty

  # Traced under jit (wrapper inside jit), the wrapped function sees the mesh too.
  out = jax.jit(fs.with_mesh(mesh)(lambda x: x * jax.sharding.get_abstract_mesh().size))(2.0)
  assert out == 16.0

  with pytest.raises(fs.MeshError, match="with_mesh: mesh is a dict"):
    with fs.with_mesh({"data": 8}):
      pass


# --- TPU device sets, compiled for without a TPU ------------------------------------------

def _torus_distance(a, b, grid):
  """Hops between two chips on a torus with wraparound (a ring of 2 has one hop)."""
  return sum(min(abs(x - y), n - abs(x - y)) for x, y, n in zip(a, b, grid))


def _assert_ici_neighbours(mesh, axis, grid):
  i = mesh.axis_names.index(axis)
  rows = np.moveaxis(mesh.devices, i, -1).reshape(-1, mesh.devices.shape[i])
  for row in rows:
    for a, b in zip(row, row[1:]):
      assert _slice(a) == _slice(b), f"ICI axis {axis} crosses slices"
    coords = {tuple(d.coords) for d in row}
    spans = [sorted({c[k] for c in coords}) for k in range(3)]
    # The chips of one axis form a box of contiguous coordinates: a sub-torus.
    assert len(coords) == np.prod([len(s) for s in spans]), f"axis {axis}: {coords} not a box"
    for s in spans:
      assert s == list(range(s[0], s[0] + len(s))), f"axis {axis}: {s} not contiguous"
    if sum(len(s) > 1 for s in spans) == 1:
      # Along one physical dimension, consecutive chips are one hop apart (two cores of one
      # chip zero hops).
      for a, b in zip(row, row[1:]):
        hops = _torus_distance(a.coords, b.coords, grid)
        assert hops <= 1, f"axis {axis}: {a.coords} -> {b.coords} is {hops} hops"


def _slice(d):
  return getattr(d, "slice_index", 0)


@pytest.mark.tpu
@pytest.mark.parametrize("name,axes", [
    ("v4:2x2x4", {"data": 4, "fsdp": 2, "tensor": 4}),
    ("v5e:4x4", {"data": 4, "tensor": 4}),
    ("v5p:2x2x2", {"data": 2, "fsdp": 2, "tensor": 2}),
    ("v6e:4x4", {"fsdp": 4, "tensor": 4}),
])
def test_tpu_ici_axes_follow_the_torus(tpu_devices, name, axes):
  devices = tpu_devices(name)
  grid = tuple(max(d.coords[k] for d in devices) + 1 for k in range(3))
  mesh = fs.make_mesh(axes, devices=devices)
  assert dict(mesh.shape) == axes
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  for axis in axes:
    _assert_ici_neighbours(mesh, axis, grid)


@pytest.mark.tpu
def test_tpu_naive_order_would_not_follow_the_torus(tpu_devices):
  # The check above can fail: a shuffled order puts far-apart chips on one axis.
  devices = tpu_devices("v5e:4x4")
  order = np.random.default_rng(0).permutation(16)
  naive = jax.sharding.Mesh(np.array(devices)[order].reshape(4, 4), ("data", "tensor"))
  with pytest.raises(AssertionError, match="axis tensor"):
    _assert_ici_neighbours(naive, "tensor", (4, 4, 1))


@pytest.mark.tpu
def test_tpu_multislice_dcn_axes_cross_slices(tpu_devices):
  devices = tpu_devices("v5p:2x2x2", num_slices=2)
  topo = fs.detect_topology(devices=devices, env={})
  assert topo.num_slices == 2
  axes = fs.parallelism("hybrid", topo)
  assert axes == fs.MeshAxes({"fsdp": -1}, {"replica": 2})
  mesh = fs.make_mesh(axes, devices=devices)
  assert dict(mesh.shape) == {"replica": 2, "fsdp": 8}
  # Along the DCN axis every step changes slice; along the ICI axis none does.
  for j in range(8):
    assert {_slice(d) for d in mesh.devices[:, j]} == {0, 1}
  for i in range(2):
    assert {_slice(d) for d in mesh.devices[i]} == {i}
  _assert_ici_neighbours(mesh, "fsdp", (2, 2, 2))

  mesh = fs.make_mesh({"data": 2, "tensor": 4}, dcn={"replica": -1}, devices=devices)
  assert dict(mesh.shape) == {"replica": 2, "data": 2, "tensor": 4}
  for axis in ("data", "tensor"):
    _assert_ici_neighbours(mesh, axis, (2, 2, 2))
  with pytest.raises(fs.MeshError, match=r"DCN axes \{'replica': 3\} multiply to 3 slices but "
                                         r"there are 2"):
    fs.make_mesh({"fsdp": -1}, dcn={"replica": 3}, devices=devices)


@pytest.mark.tpu
@pytest.mark.parametrize("target,slices", [("2x v5p-8", 2), ("4x v5p-8", 4)])
def test_multislice_without_dcn_names_the_slices_and_the_fix(tpu_devices, target, slices):
  devices = fs.target_devices(target)  # v5p-8: 4 chips (one device each) a slice
  for axes in ({"fsdp": -1}, "data=-1", {"data": 2, "tensor": -1}):
    with pytest.raises(fs.MeshError) as e:
      fs.make_mesh(axes, devices=devices)
    msg = str(e.value)
    assert msg.startswith(f"the {4 * slices} devices span {slices} TPU slices (slice_index "
                          f"{list(range(slices))}), but no DCN axes were given"), msg
    assert "an ICI axis can't cross slices" in msg and "(4 devices)" in msg
    assert f"dcn={{'replica': {slices}}}" in msg and f"--dcn=replica={slices}" in msg
    assert "jax_devices" not in msg  # no device dump
  # The fix it names works: one slice per row, FSDP within each slice.
  mesh = fs.make_mesh({"fsdp": -1}, dcn={"replica": slices}, devices=devices)
  assert dict(mesh.shape) == {"replica": slices, "fsdp": 4}
  assert [{_slice(d) for d in row} for row in mesh.devices] == [{i} for i in range(slices)]
  # The devices of one slice need no DCN axis.
  one = [d for d in devices if _slice(d) == slices - 1]
  assert dict(fs.make_mesh({"fsdp": -1}, devices=one).shape) == {"fsdp": 4}


def _cube(kind):
  """A 2x2x2 cube of one-core chips with device kind `kind`, listed in id order."""
  return [_Dev(i, "tpu", coords=(i % 2, i // 2 % 2, i // 4), core_on_chip=0, device_kind=kind)
          for i in range(8)]


@pytest.mark.parametrize("kind", ["TPU v5p", "TPU v5"])
def test_tpu_tray_ring_reshaped_to_several_axes_is_laid_on_the_torus(kind):
  # mesh_utils orders a whole v5p cube as one ring and reshapes it to any mesh shape ("TPU
  # v5p" in every supported jax; "TPU v5", what libtpu reports, from jax 0.12): for (2, 2, 2)
  # two of its axes would pair chips two hops apart. fnscale keeps every axis on neighbours.
  from jax.experimental import mesh_utils
  from fnscale._mesh import _device_grid
  devs = _cube(kind)
  for shape in ([2, 2, 2], [2, 4], [4, 2]):
    grid = _device_grid(devs, shape, None)
    assert grid.shape == tuple(shape) and sorted(d.id for d in grid.flat) == list(range(8))
    names = "abc"[:len(shape)]
    for axis in names:
      _assert_ici_neighbours(_Laid(grid, tuple(names)), axis, (2, 2, 2))
  # One chip: itself.
  assert _ids(_device_grid(devs[:1], [1], None)) == [0]
  # One axis: mesh_utils' order, whatever it is (in jax 0.12 a ring: 8 one-hop steps).
  line = _device_grid(devs, [8], None)
  assert _ids(line) == _ids(mesh_utils.create_device_mesh([8], devs,
                                                          allow_split_physical_axes=True))


class _Laid(NamedTuple):
  """What `_assert_ici_neighbours` reads of a mesh, for stand-in devices."""
  devices: np.ndarray
  axis_names: tuple[str, ...]


@pytest.mark.tpu
@pytest.mark.parametrize("name,axes", [
    ("v5e:2x2", {"data": 2, "tensor": 2}),
    ("v5e:2x4", {"data": 2, "tensor": 4}),
    ("v6e:2x4", {"fsdp": 4, "tensor": 2}),
    ("v5p:2x2x2", {"fsdp": 4, "tensor": 2}),
])
def test_tpu_tray_meshes_of_several_axes_follow_the_torus(tpu_devices, name, axes):
  # Trays for which mesh_utils returns one ring reshaped (v5e/v6e in jax 0.10.2 and 0.12,
  # v5p in 0.12): each axis of a two-axis mesh still runs over neighbouring chips.
  devices = tpu_devices(name)
  grid = tuple(max(d.coords[k] for d in devices) + 1 for k in range(3))
  mesh = fs.make_mesh(axes, devices=devices)
  assert dict(mesh.shape) == axes
  for axis in axes:
    _assert_ici_neighbours(mesh, axis, grid)


@pytest.mark.tpu
def test_tpu_meshes_mesh_utils_lays_on_the_torus_keep_its_order(tpu_devices):
  # Where mesh_utils' order already follows the torus, or no order can put every axis on a
  # box (8 x 2 on a 4x4 grid), fnscale's mesh is exactly mesh_utils'.
  from jax.experimental import mesh_utils
  for name, shape in [("v5e:4x4", [4, 4]), ("v5e:4x4", [8, 2]), ("v5e:2x4", [8]),
                      ("v5p:4x4x4", [4, 4, 4])]:
    devices = tpu_devices(name)
    names = ("data", "fsdp", "tensor")[:len(shape)]
    mesh = fs.make_mesh(dict(zip(names, shape)), devices=devices)
    want = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in want.flat], (name, shape)


def test_dcn_over_processes_on_cpu():
  # One process: a DCN group of 1; its axis comes first.
  mesh = fs.make_mesh({"fsdp": -1}, dcn={"replica": 1})
  assert mesh.axis_names == ("replica", "fsdp") and mesh.devices.shape == (1, 8)
  with pytest.raises(fs.MeshError, match=r"multiply to 2 processes but there are 1"):
    fs.make_mesh({"fsdp": -1}, dcn={"replica": 2})


def test_no_devices():
  with pytest.raises(fs.MeshError, match=r"devices has an empty sequence: expected a non-empty "
                                         r"sequence of jax.Device"):
    fs.make_mesh({"data": -1}, devices=[])


# --- wrong types: an fnscale error naming the argument, what it got and what it expects ----

@pytest.mark.parametrize("call,pattern", [
    (lambda: fs.make_mesh({"data": 2}, devices=[1, 2]),
     r"devices has element 1 \(int\): expected a non-empty sequence of jax.Device, e.g. "
     r"jax.devices\(\)"),
    (lambda: fs.make_mesh({"data": 2}, devices="tpu"),
     r"devices='tpu' \(str\): expected a non-empty sequence of jax.Device"),
    (lambda: fs.make_mesh({"data": 2}, devices=8),
     r"devices=8 \(int\): expected a non-empty sequence of jax.Device"),
    (lambda: fs.make_mesh({"data": -1}, topology="v5p-8"),
     r"topology='v5p-8' \(str\): expected None or a fnscale.Topology"),
    (lambda: fs.make_mesh(8), r"ICI axes 8 \(int\) must be a mapping name -> size"),
    (lambda: fs.make_mesh(None), r"ICI axes None \(NoneType\) must be a mapping"),
    (lambda: fs.make_mesh({"data": -1}, dcn=2), r"DCN axes 2 \(int\) must be a mapping"),
    (lambda: fs.make_mesh({1: 8}), r"ICI axes name 1 \(int\) must be a non-empty string"),
    (lambda: fs.make_mesh({"data": "8"}), r"ICI axes 'data' has size '8' \(str\): expected a "
                                          r"positive int or -1"),
    (lambda: fs.make_mesh({"data": True}), r"ICI axes 'data' has size True \(bool\)"),
    (lambda: fs.make_mesh({"data": 8}, axis_types=1),
     r"axis_types 1: expected 1 jax.sharding.AxisType values"),
    (lambda: fs.parallelism(["data"]), r"strategy=\['data'\] \(list\): expected one of "
                                       r"\('data', 'fsdp', 'tensor', 'hybrid'\)"),
    (lambda: fs.parallelism("data", {"num_slices": 2}),
     r"topology=\{'num_slices': 2\} \(dict\): expected None or a fnscale.Topology"),
    (lambda: fs.parallelism("tensor", None, tensor=True),
     r"tensor parallel size tensor=True \(bool\) must be a positive int"),
    (lambda: fs.parallelism("tensor", None, tensor=2.0),
     r"tensor parallel size tensor=2.0 \(float\) must be a positive int"),
    (lambda: fs.describe_mesh("mesh"),
     r"describe_mesh: mesh is a str \('mesh'\), expected a jax.sharding.Mesh"),
])
def test_wrong_types_are_mesh_errors(call, pattern):
  with pytest.raises(fs.MeshError, match=pattern):
    call()


def test_with_mesh_sets_the_concrete_mesh():
  from jax.sharding import PartitionSpec as P
  # Inside with_mesh a bare PartitionSpec places arrays on this machine's mesh (jax.set_mesh),
  # also for a mesh of one device.
  for mesh in (fs.make_mesh("data=8"), fs.make_mesh("data=1", devices=jax.devices()[:1])):
    with fs.with_mesh(mesh):
      x = jax.device_put(jax.numpy.zeros(8), P("data"))
    assert x.sharding == jax.sharding.NamedSharding(mesh, P("data"))


def test_with_mesh_wrong_type_names_it():
  with pytest.raises(fs.MeshError, match=r"with_mesh: mesh is a dict \(\{'data': 8\}\), "
                                         r"expected a jax.sharding.Mesh; fix: fnscale.make_mesh"):
    with fs.with_mesh({"data": 8}):
      pass


# --- topology-description devices: a TPU program compiled ahead of time on this CPU ---------

@pytest.mark.tpu
def test_described_devices_mesh_inside_and_outside_with_mesh(tpu_devices):
  from jax.sharding import NamedSharding, PartitionSpec as P
  devices = tpu_devices("v5p:2x2x2")
  mesh = fs.make_mesh({"data": 4, "tensor": 2}, devices=devices)
  assert dict(mesh.shape) == {"data": 4, "tensor": 2} and mesh.devices.flat[0].platform == "tpu"
  x = jax.ShapeDtypeStruct((8, 128), jax.numpy.float32, sharding=NamedSharding(mesh, P("data")))
  f = lambda x: jax.lax.with_sharding_constraint(x * 2, P("data", "tensor"))
  want = NamedSharding(mesh, P("data", "tensor"))
  with fs.with_mesh(mesh):  # the context form
    inner = fs.make_mesh({"fsdp": -1}, devices=devices)  # make_mesh inside a scope
    compiled = jax.jit(f).lower(x).compile()
    # Eager work (a PRNG key, a small array) still runs on this machine's devices: the
    # described devices can compile but not run (jax.set_mesh over them broke eager ops).
    assert float(jax.numpy.ones(3).sum()) == 3.0
    assert jax.random.key_data(jax.random.key(0)).shape == (2,)
    assert jax.sharding.get_abstract_mesh().shape == {"data": 4, "tensor": 2}
  assert dict(inner.shape) == {"fsdp": 8}
  assert compiled.output_shardings.is_equivalent_to(want, 2)
  compiled = jax.jit(fs.with_mesh(mesh)(f)).lower(x).compile()  # the wrapper form
  assert compiled.output_shardings.is_equivalent_to(want, 2)
  # Outside any scope, concrete shardings name the mesh themselves.
  g = jax.jit(lambda x: x * 2, out_shardings=want)
  assert g.lower(x).compile().output_shardings.is_equivalent_to(want, 2)
  assert jax.sharding.get_abstract_mesh().empty


# --- presets on multi-slice topologies and their error messages -----------------------------

def test_presets_across_slices_and_tensor_default():
  import dataclasses
  one = fs.detect_topology(env={})
  two = dataclasses.replace(one, num_slices=2, devices_per_process=4)
  assert fs.parallelism("data", two) == fs.MeshAxes({"data": -1}, {"replica": 2})
  assert fs.parallelism("fsdp", two) == fs.MeshAxes({"fsdp": -1}, {"replica": 2})
  assert fs.parallelism("hybrid", two) == fs.MeshAxes({"fsdp": -1}, {"replica": 2})
  # Tensor parallel defaults to one process's devices: 4 on this topology, and without a
  # topology the 8 local (simulated) devices of this process.
  assert fs.parallelism("tensor", two) == fs.MeshAxes({"fsdp": -1, "tensor": 4},
                                                      {"replica": 2})
  assert fs.parallelism("tensor") == fs.MeshAxes({"fsdp": -1, "tensor": 8}, {})
  assert fs.parallelism("tensor", two, tensor=1) == fs.MeshAxes({"fsdp": -1, "tensor": 1},
                                                                {"replica": 2})


@pytest.mark.parametrize("call,message", [
    (lambda: fs.parallelism("pipe"),
     "unknown parallelism strategy 'pipe': expected one of ('data', 'fsdp', 'tensor', "
     "'hybrid'), or give axes explicitly such as {'data': -1, 'tensor': 2}."),
    (lambda: fs.parallelism(3),
     "strategy=3 (int): expected one of ('data', 'fsdp', 'tensor', 'hybrid')."),
    (lambda: fs.parallelism("data", "v5p-8"),
     "topology='v5p-8' (str): expected None or a fnscale.Topology (from "
     "fs.detect_topology)."),
    (lambda: fs.parallelism("tensor", tensor=-2),
     "tensor parallel size tensor=-2 (int) must be a positive int."),
    (lambda: fs.make_mesh({"data": -1}, topology="v5p-8"),
     "topology='v5p-8' (str): expected None or a fnscale.Topology (from "
     "fs.detect_topology)."),
    (lambda: fs.make_mesh(fs.MeshAxes({"data": -1}, {}), dcn={"replica": 1}),
     "pass dcn either inside MeshAxes or as dcn=, not both."),
    (lambda: fs.make_mesh("data=3,fsdp=-1"),
     "ICI axes {'data': 3, 'fsdp': -1} can't fill 8 devices: the fixed sizes multiply to 3, "
     "which doesn't divide 8; pick sizes whose product divides it."),
    (lambda: fs.make_mesh("data=3,fsdp=2"),
     "ICI axes {'data': 3, 'fsdp': 2} multiply to 6 devices but there are 8; make the "
     "product 8 or use -1 for one axis."),
    (lambda: fs.make_mesh("data=2,data=4"),
     "ICI axes name 'data' appears twice in 'data=2,data=4': each axis once."),
    (lambda: fs.make_mesh("data=-1,fsdp=-1"),
     "ICI axes 'data=-1,fsdp=-1' has more than one -1; at most one axis per group can take "
     "the devices left over: give the others explicit sizes."),
    (lambda: fs.make_mesh({"data": -1}, dcn="replica=x"),
     "DCN axes entry 'replica=x' in 'replica=x' is not NAME=SIZE: write e.g. "
     "'data=-1,fsdp=4,tensor=2'."),
    (lambda: fs.make_mesh({"": 8}),
     "ICI axes name '' (str) must be a non-empty string."),
    (lambda: fs.make_mesh({"data": 0}),
     "ICI axes 'data' has size 0 (int): expected a positive int or -1 (the devices left "
     "over)."),
    (lambda: fs.make_mesh({"data": -1}, dcn={"data": 1}),
     "axis 'data' is in both the ICI axes {'data': -1} and the DCN axes {'data': 1}; an axis "
     "runs either within a slice or across slices: rename one (e.g. 'replica' across "
     "slices, 'data' within)."),
    (lambda: fs.make_mesh({"fsdp": -1}, dcn={"replica": 2}),
     "DCN axes {'replica': 2} multiply to 2 processes but there are 1; make the product 1 "
     "or use -1 for one axis."),
    (lambda: fs.make_mesh("data=8", axis_types="manual"),
     "axis_types 'manual': expected 'auto', 'explicit' or a sequence of "
     "jax.sharding.AxisType."),
    (lambda: fs.make_mesh("data=8", axis_types=["auto"]),
     "axis_types ['auto']: expected 1 jax.sharding.AxisType values, one per mesh axis."),
])
def test_error_messages_in_full(call, message):
  with pytest.raises(fs.MeshError) as e:
    call()
  assert str(e.value) == message


def test_parse_axes_forms():
  assert fs.parse_axes(" data = -1 , fsdp=2,, tensor=2 ") == {"data": -1, "fsdp": 2, "tensor": 2}
  assert list(fs.parse_axes("tensor=2,data=-1")) == ["tensor", "data"]  # order kept
  assert fs.parse_axes({"data": np.int64(4)}) == {"data": 4}
  assert type(fs.parse_axes({"data": np.int64(4)})["data"]) is int
  assert fs.parse_axes([("data", -1)]) == {"data": -1}
  assert fs.parse_axes("") == {}
  assert fs.parse_axes("Data=2,TP=-1") == {"Data": 2, "TP": -1}  # names are identifiers
  with pytest.raises(fs.MeshError) as e:
    fs.parse_axes("data")
  assert str(e.value) == ("axes entry 'data' in 'data' is not NAME=SIZE: write e.g. "
                          "'data=-1,fsdp=4,tensor=2'.")


def test_make_mesh_preset_uses_the_topology():
  import dataclasses
  topo = dataclasses.replace(fs.detect_topology(env={}), devices_per_process=4)
  # "tensor" defaults to one process's devices: 4 here, so fsdp takes the other 2.
  assert dict(fs.make_mesh("tensor", topology=topo).shape) == {"fsdp": 2, "tensor": 4}
  assert dict(fs.make_mesh(" tensor ").shape) == {"fsdp": 1, "tensor": 8}


def test_devices_in_any_order_are_laid_out_by_id():
  mesh = fs.make_mesh({"data": 2, "tensor": -1}, devices=jax.devices()[::-1])
  assert [d.id for d in mesh.devices.flat] == list(range(8))


def test_one_device_with_a_dcn_axis():
  mesh = fs.make_mesh({"data": 1}, dcn={"replica": 1}, devices=jax.devices()[:1])
  assert dict(mesh.shape) == {"replica": 1, "data": 1}


def test_explicit_axis_types_are_case_insensitive():
  mesh = fs.make_mesh("data=2,tensor=4", axis_types="Explicit")
  assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
  assert fs.make_mesh("data=8", axis_types="AUTO").axis_types == (AxisType.Auto,)
  assert fs.make_mesh("data=8", axis_types=[AxisType.Explicit]).axis_types == (
      AxisType.Explicit,)
  with pytest.raises(fs.MeshError, match="expected 1 jax.sharding.AxisType"):
    fs.make_mesh("data=8", axis_types=(AxisType.Auto, AxisType.Auto))


# --- device layout with stand-in devices (no TPU, no second process) -------------------------

class _Dev:
  """A stand-in for a jax.Device: the attributes the layout code reads."""

  def __init__(self, id, platform="cpu", process_index=0, **kw):
    self.id, self.platform, self.process_index = id, platform, process_index
    self.device_kind = {"cpu": "cpu", "tpu": "TPU v4"}[platform]
    self.__dict__.update(kw)

  def __repr__(self):
    return f"Dev({self.id})"


def _ids(grid):
  return np.vectorize(lambda d: d.id)(grid).tolist()


def test_granules_group_by_slice_else_process():
  from fnscale._mesh import _granules
  # Two processes, listed out of order: grouped by process, ascending, order kept within.
  devs = [_Dev(i, process_index=p) for i, p in [(5, 1), (0, 0), (4, 1), (1, 0), (6, 2)]]
  assert [[d.id for d in g] for g in _granules(devs)] == [[0, 1], [5, 4], [6]]
  # Devices with a slice index (TPU multi-slice): grouped by slice, whatever the process.
  devs = [_Dev(i, process_index=i % 2, slice_index=s) for i, s in [(0, 1), (1, 1), (2, 0),
                                                                    (3, 0)]]
  assert [[d.id for d in g] for g in _granules(devs)] == [[2, 3], [0, 1]]


def test_off_tpu_devices_are_laid_out_in_process_then_id_order():
  from fnscale._mesh import _device_grid
  devs = [_Dev(i, process_index=1 - i // 4) for i in range(8)][::-1]
  # Process 0 holds ids 4..7, process 1 ids 0..3.
  assert _ids(_device_grid(devs, [2, 4], None)) == [[4, 5, 6, 7], [0, 1, 2, 3]]
  assert _ids(_device_grid(devs, [8], None)) == [4, 5, 6, 7, 0, 1, 2, 3]


def test_devices_without_coordinates_are_laid_out_in_id_order():
  from fnscale._mesh import _device_grid
  devs = [_Dev(i, "tpu") for i in range(4)][::-1]  # a TPU device set that gives no coords
  assert _ids(_device_grid(devs, [2, 2], None)) == [[0, 1], [2, 3]]


def test_dcn_axis_over_processes_puts_each_process_on_one_row():
  from fnscale._mesh import _device_grid
  devs = [_Dev(i, process_index=i // 4) for i in range(8)]
  grid = _device_grid(devs, [1, 4], [2, 1])
  assert grid.shape == (2, 4)
  assert [{d.process_index for d in row} for row in grid] == [{0}, {1}]


def _v4_per_core(chips_x, chips_y):
  """TPU v4 chips on a chips_x x chips_y x 1 grid, each exposed as 2 devices (one per core)."""
  out = []
  for y in range(chips_y):
    for x in range(chips_x):
      for core in range(2):
        out.append(_Dev(len(out), "tpu", coords=(x, y, 0), core_on_chip=core))
  return out


def test_tpu_cores_as_devices_keep_a_chip_s_cores_adjacent():
  from fnscale._mesh import _device_grid
  devs = _v4_per_core(2, 2)
  grid = _device_grid(devs, [2, 4], None)
  assert grid.shape == (2, 4)
  assert sorted(d.id for d in grid.flat) == list(range(8))
  for row in grid:
    # [chip a core 0, chip a core 1, chip b core 0, chip b core 1], chips a, b one hop apart.
    assert [d.core_on_chip for d in row] == [0, 1, 0, 1]
    assert row[0].coords == row[1].coords and row[2].coords == row[3].coords
    assert _torus_distance(row[0].coords, row[2].coords, (2, 2, 1)) == 1
  # A 3-D mesh: the chips fill the leading axes, the last axis still a chip's two cores.
  grid = _device_grid(devs, [2, 2, 2], None)
  assert sorted(d.id for d in grid.flat) == list(range(8))
  assert all(row[0].coords == row[1].coords and [d.core_on_chip for d in row] == [0, 1]
             for row in grid.reshape(4, 2))
  # One chip per row: each row is a chip's two cores.
  grid = _device_grid(devs, [4, 2], None)
  assert [len({tuple(d.coords) for d in row}) for row in grid] == [1, 1, 1, 1]
  assert sorted(tuple(row[0].coords) for row in grid) == [(0, 0, 0), (0, 1, 0), (1, 0, 0),
                                                          (1, 1, 0)]


def test_tpu_cores_as_devices_need_the_last_axis_a_multiple_of_the_cores():
  from fnscale._mesh import _device_grid
  with pytest.raises(ValueError) as e:
    _device_grid(_v4_per_core(2, 2), [8, 1], None)
  assert str(e.value) == ("the last mesh axis (1) must be a multiple of the 2 cores per chip "
                          "when TPU cores are separate devices")
  with pytest.raises(ValueError, match=r"the last mesh axis \(3\) must be a multiple of the 2"):
    _device_grid(_v4_per_core(3, 1), [2, 3], None)


def test_tpu_chips_in_a_line_split_into_a_square():
  from fnscale._mesh import _device_grid
  # 4 one-core chips in a row (4x1x1): a 2x2 mesh splits the physical axis in two.
  devs = [_Dev(i, "tpu", coords=(i, 0, 0), core_on_chip=0) for i in range(4)][::-1]
  grid = _device_grid(devs, [2, 2], None)
  assert sorted(d.id for d in grid.flat) == [0, 1, 2, 3]
  for row in grid:  # each row two neighbouring chips of the line (no wraparound: 4 chips)
    assert abs(row[0].coords[0] - row[1].coords[0]) == 1
  # The same with two cores per chip: 8 devices, the chips split as above.
  devs = [_Dev(2 * x + c, "tpu", coords=(x, 0, 0), core_on_chip=c) for x in range(4)
          for c in range(2)]
  grid = _device_grid(devs, [2, 4], None)
  assert sorted(d.id for d in grid.flat) == list(range(8))
  for row in grid:
    assert [d.core_on_chip for d in row] == [0, 1, 0, 1]
    assert row[0].coords == row[1].coords and row[2].coords == row[3].coords
    assert abs(row[0].coords[0] - row[2].coords[0]) == 1


def test_tpu_layout_errors_other_than_megacore_propagate():
  from fnscale._mesh import _device_grid
  # Three chips of a 2x2 grid leave a hole: mesh_utils' own error, not a per-core retry.
  devs = [_Dev(i, "tpu", coords=(i % 2, i // 2, 0), core_on_chip=0) for i in range(3)]
  with pytest.raises(AssertionError, match="dims=\\(2, 2, 1\\)"):
    _device_grid(devs, [3], None)


def test_make_mesh_over_slices_names_slices(monkeypatch):
  import fnscale._mesh as fm
  # Two slices of 4 one-core chips each, 2 processes per slice (stand-ins let through the
  # jax.Device check): the DCN axis runs across slices, not processes.
  monkeypatch.setattr(fm, "check_devices", lambda d, name, error: list(d))
  devs = [_Dev(8 * s + i, "tpu", process_index=2 * s + i // 2, slice_index=s,
               coords=(i % 2, i // 2, 0), core_on_chip=0) for s in range(2) for i in range(4)]
  mesh = fs.make_mesh({"fsdp": -1}, dcn={"replica": -1}, devices=devs)
  assert dict(mesh.shape) == {"replica": 2, "fsdp": 4}
  assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
  with pytest.raises(fs.MeshError) as e:
    fs.make_mesh({"fsdp": -1}, dcn={"replica": 4}, devices=devs)
  assert str(e.value) == ("DCN axes {'replica': 4} multiply to 4 slices but there are 2; make "
                          "the product 2 or use -1 for one axis.")
  with pytest.raises(fs.MeshError) as e:
    fs.make_mesh({"fsdp": 3, "tensor": -1}, dcn={"replica": 2}, devices=devs)
  assert str(e.value) == ("ICI axes {'fsdp': 3, 'tensor': -1} can't fill 4 devices: the fixed "
                          "sizes multiply to 3, which doesn't divide 4; pick sizes whose "
                          "product divides it.")


def test_make_mesh_names_the_layout_that_failed(monkeypatch):
  import fnscale._mesh as fm
  monkeypatch.setattr(fm, "check_devices", lambda d, name, error: list(d))
  with pytest.raises(fs.MeshError) as e:
    fs.make_mesh({"data": 2, "tensor": 3}, devices=_v4_per_core(3, 1))
  assert str(e.value) == ("can't lay mesh {'data': 2, 'tensor': 3} onto 6 tpu devices: the "
                          "last mesh axis (3) must be a multiple of the 2 cores per chip when "
                          "TPU cores are separate devices")


# --- describe ---------------------------------------------------------------------------------

def test_describe_a_local_mesh():
  mesh = fs.make_mesh("data=2,tensor=4", axis_types=(AxisType.Auto, AxisType.Explicit))
  assert fs.describe_mesh(mesh) == (
      "Mesh {'data': 2, 'tensor': 4} over 8 devices\n"
      "  data       size    2  Auto     ICI / local\n"
      "  tensor     size    4  Explicit ICI / local")


def test_describe_names_axes_across_slices_and_processes():
  # 2 slices x 2 processes per slice x 2 devices per process.
  devs = [_Dev(i, process_index=i // 2, slice_index=i // 4) for i in range(8)]
  mesh = jax.sharding.Mesh(np.array(devs, dtype=object).reshape(2, 2, 2),
                           ("replica", "fsdp", "tensor"))
  assert fs.describe_mesh(mesh).splitlines() == [
      "Mesh {'replica': 2, 'fsdp': 2, 'tensor': 2} over 8 devices",
      "  replica    size    2  Auto     DCN (across slices)",
      "  fsdp       size    2  Auto     across processes",
      "  tensor     size    2  Auto     ICI / local"]
  # Slice 0 reported as slice_index 0 (or None off TPU) counts as one slice.
  devs = [_Dev(i, process_index=i // 4, slice_index=None if i < 4 else 0) for i in range(8)]
  mesh = jax.sharding.Mesh(np.array(devs, dtype=object).reshape(4, 2), ("data", "tensor"))
  assert fs.describe_mesh(mesh).splitlines()[1:] == [
      "  data       size    4  Auto     across processes",
      "  tensor     size    2  Auto     ICI / local"]


def test_an_axis_no_convention_knows_is_refused_naming_the_closest():
  """{"dta": 8} used to build a mesh whose batch sharding was P(): every device a copy."""
  with pytest.raises(fs.MeshError, match=r"ICI axes: axis 'dta' .*; did you mean 'data'\?"):
    fs.make_mesh({"dta": 8})
  with pytest.raises(fs.MeshError, match=r"DCN axes: axis 'replika' .*did you mean 'replica'"):
    fs.make_mesh({"data": -1}, dcn={"replika": 1})
  with pytest.raises(fs.MeshError, match=r"axis .zz. is not one [^;]*\] \(no batch"):
    fs.make_mesh({"zz": 8})  # nothing close: no suggestion
  mine = fs.AxisConventions(data=("dp",), replica=("dp",), head=("tp",))
  with fs.axis_conventions(mine):  # a declared name is fine, and splits the batch
    assert fs.batch_sharding(fs.make_mesh({"dp": 4, "tp": 2})).spec == P("dp")
