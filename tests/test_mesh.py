"""Meshes on 8 simulated CPU devices and on real TPU device sets (ahead of time, no TPU)."""
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import fnscale as fs
from fnscale.mesh import describe


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

  with pytest.raises(fs.MeshError, match="needs a jax.sharding.Mesh"):
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
    (lambda: describe("mesh"), r"describe needs a jax.sharding.Mesh .*got mesh='mesh' \(str\)"),
])
def test_wrong_types_are_mesh_errors(call, pattern):
  with pytest.raises(fs.MeshError, match=pattern):
    call()


def test_with_mesh_wrong_type_names_it():
  with pytest.raises(fs.MeshError, match=r"with_mesh needs a jax.sharding.Mesh \(from "
                                         r"fnscale.make_mesh\), got mesh=\{'data': 8\} \(dict\)"):
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
