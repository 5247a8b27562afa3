"""Flax models keep their sharding metadata (Linen boxes, NNX Variable metadata) and train
through fnscale as README's first step wraps them, on meshes their authors never named.

Each model is written as its framework's users write it: Linen with `nn.with_partitioning`
over the authors' own mesh axes, with `nn.with_logical_partitioning` and
`nn.with_logical_constraint` on activations (DenseGeneral and MultiHeadDotProductAttention
box rank-3 kernels with two names); NNX with `nnx.with_partitioning` over mesh axes. The
init function or State goes straight into `fs.init_state`, the loss calls `model.apply` or
`nnx.merge`. The reference is the same loss trained on one device with plain jax and optax.
"""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import fnscale as fs

nn = pytest.importorskip("flax.linen", reason="flax is a test extra")
from flax import nnx  # pylint: disable=g-import-not-at-top

MESHES = ({"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2},
          {"data": 8})
RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
         ("heads", "tensor"))
STEPS = 3
OPT = optax.sgd(0.1)


def _batches():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(STEPS, 16, 4, 16)).astype(np.float32)
  return [{"x": x[i], "y": np.sin(x[i, :, :, :1])} for i in range(STEPS)]


def _reference(loss_fn, params):
  """Losses and params of `loss_fn` trained on one device with plain jax and optax."""
  params = jax.device_put(params, jax.devices()[0])
  opt_state = OPT.init(params)
  grad = jax.jit(jax.value_and_grad(loss_fn))
  losses = []
  for b in _batches():
    loss, g = grad(params, b)
    updates, opt_state = OPT.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params


def _fnscale(loss_fn, init, mesh_axes, accum, rules=(), **options):
  mesh = mesh_axes if isinstance(mesh_axes, jax.sharding.Mesh) else fs.make_mesh(mesh_axes)
  state = fs.init_state(init, OPT, mesh=mesh, rules=rules, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss_fn, OPT, accum_steps=accum, **options), mesh,
                       rules=rules)
  losses = []
  for b in _batches():
    state, metrics = step(state, fs.global_batch(b, fs.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return losses, state.params


def _check(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got[1],
               want[1])


def _specs(params):
  return jax.tree.map(lambda x: x.sharding.spec, params)


# ----------------------------------------------------------------------------- Linen


class MeshAxesMLP(nn.Module):
  """Boxes over the authors' own mesh {"data": 8}: outputs of the first layer, inputs of
  the second split over "data"."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "data")))(x)
    h = nn.Dense(16, kernel_init=nn.with_partitioning(init, ("data", None)))(nn.relu(h))
    return nn.Dense(1)(h)


class LogicalBlock(nn.Module):
  """Logical names throughout, activations constrained as Linen users do."""

  @nn.compact
  def __call__(self, x):  # [batch, length, embed]
    init = nn.initializers.lecun_normal()
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    a = nn.MultiHeadDotProductAttention(
        num_heads=8, qkv_features=16,
        kernel_init=nn.with_logical_partitioning(init, ("embed", "heads")))(x)
    x = nn.with_logical_constraint(x + a, ("batch", "length", "embed"))
    h = nn.DenseGeneral((2, 8), kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp", None))
    return nn.DenseGeneral(1, axis=(-2, -1))(h)


def _linen(model):
  x0 = np.zeros((1, 4, 16), np.float32)

  def loss_fn(params, batch):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

  init = lambda key: model.init(key, x0)["params"]
  return loss_fn, init, nn.unbox(init(jax.random.key(0)))


@pytest.fixture(scope="module")
def mesh_axes_mlp():
  loss_fn, init, params = _linen(MeshAxesMLP())
  return loss_fn, init, _reference(loss_fn, params)


@pytest.fixture(scope="module")
def logical_block():
  loss_fn, init, params = _linen(LogicalBlock())
  return loss_fn, init, _reference(loss_fn, params)


@pytest.mark.parametrize("mesh_axes,accum", [(MESHES[0], 2), (MESHES[2], 1)])
def test_linen_mesh_axis_boxes_train_on_any_mesh(mesh_axes_mlp, mesh_axes, accum):
  loss_fn, init, want = mesh_axes_mlp
  got = _fnscale(loss_fn, init, mesh_axes, accum)
  _check(got, want)
  specs = _specs(got[1])
  assert not any(isinstance(x, nn.Partitioned) for x in jax.tree.leaves(
      got[1], is_leaf=lambda x: isinstance(x, nn.Partitioned)))  # plain arrays in the state
  if "data" in mesh_axes:  # the names the mesh has, as those axes
    assert specs["Dense_0"]["kernel"] == P(None, "data")
    assert specs["Dense_1"]["kernel"] == P("data", None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_axes", MESHES)
@pytest.mark.parametrize("accum", [1, 2])
def test_linen_mesh_axis_boxes_every_mesh(mesh_axes_mlp, mesh_axes, accum):
  test_linen_mesh_axis_boxes_train_on_any_mesh(mesh_axes_mlp, mesh_axes, accum)


def test_linen_mesh_axis_boxes_missing_from_mesh_follow_rules(mesh_axes_mlp):
  # "data" on an fsdp-only mesh: a rule maps it as a logical name; without one, automatic
  # FSDP decides (these kernels are small: replicated).
  loss_fn, init, want = mesh_axes_mlp
  mesh = fs.make_mesh({"fsdp": 8})
  shapes = jax.eval_shape(init, jax.random.key(0))
  assert fs.shardings(shapes, mesh, [("data", "fsdp")])["Dense_0"]["kernel"].spec == P(
      None, "fsdp")
  assert fs.shardings(shapes, mesh)["Dense_0"]["kernel"].spec == P()
  got = _fnscale(loss_fn, init, {"fsdp": 8}, 1, rules=[("data", "fsdp")])
  _check(got, want)
  assert _specs(got[1])["Dense_1"]["kernel"] == P("fsdp", None)


@pytest.mark.parametrize("mesh_axes,accum", [(MESHES[2], 2), (MESHES[1], 1)])
def test_linen_logical_boxes_and_constraints(logical_block, mesh_axes, accum):
  loss_fn, init, want = logical_block
  got = _fnscale(loss_fn, init, mesh_axes, accum, rules=RULES)
  _check(got, want)
  specs = _specs(got[1])
  tensor = "tensor" if "tensor" in mesh_axes else None
  # Two names on rank-3 kernels: the trailing dimension unsharded, as in Flax.
  assert specs["DenseGeneral_0"]["kernel"] == P("fsdp", tensor, None)
  assert specs["MultiHeadDotProductAttention_0"]["query"]["kernel"] == P("fsdp", tensor, None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_axes", MESHES[:3])
@pytest.mark.parametrize("accum", [1, 2])
def test_linen_logical_boxes_every_mesh(logical_block, mesh_axes, accum):
  test_linen_logical_boxes_and_constraints(logical_block, mesh_axes, accum)


def test_flax_rules_of_the_caller_are_kept_to_the_mesh(logical_block):
  # No fnscale rules: Flax's own rules in effect drive the constraints, on the axes the mesh
  # has ("tensor" absent) and not the manual ones of the per-shard microbatch loop.
  loss_fn, init, want = logical_block
  with nn.logical_axis_rules(RULES):
    got = _fnscale(loss_fn, init, {"data": 2, "fsdp": 4}, 2)
  _check(got, want)


def test_activation_constraints_follow_the_rules_on_the_mesh(logical_block):
  # Under shard_step, nn.with_logical_constraint constrains activations by fnscale's rules
  # (only the axes this mesh has): the batch over ("data", "fsdp"), "mlp" over tensor.
  loss_fn, init, _ = logical_block
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  state = fs.init_state(init, OPT, mesh=mesh, rules=RULES, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss_fn, OPT), mesh, rules=RULES)
  text = step.lower(state, _batches()[0]).as_text()
  assert '[{"data", "fsdp"}, {}, {}]> : tensor<16x4x16xf32>' in text


def test_a_state_built_with_boxes_runs_on_their_arrays(mesh_axes_mlp, caplog):
  # A TrainState built by hand from model.init's boxes: the step lays it out from their
  # names, runs on their arrays (no constraint from model.apply) and returns a plain state,
  # which the same executable takes again.
  loss_fn, init, want = mesh_axes_mlp
  boxed = init(jax.random.key(0))
  state = fs.TrainState(boxed, OPT.init(boxed), jnp.zeros((), jnp.int32), None)
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  assert fs.state_shardings(state, mesh).params["Dense_0"]["kernel"].spec == P(None, "data")
  step = fs.shard_step(fs.train_step(loss_fn, OPT), mesh)
  losses = []
  for b in _batches():
    state, metrics = step(state, fs.global_batch(b, fs.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  _check((losses, state.params), want)
  assert _specs(state.params)["Dense_0"]["kernel"] == P(None, "data")
  assert jax.tree.structure(state.params) == jax.tree.structure(nn.unbox(boxed))
  assert not [r for r in caplog.records if "compiling again" in r.getMessage()]


class FlatKernelBlock(nn.Module):
  """Boxes over the authors' own mesh {"data": 4, "model": 2} on layers that unbox their own
  kernels: flax's MultiHeadDotProductAttention and DenseGeneral initialize them flat and
  unbox them, Flax's apply runs that init again to check shapes, and under a mesh each box
  becomes a sharding constraint on its names."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    a = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=16, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
    h = nn.DenseGeneral((2, 8), kernel_init=nn.with_partitioning(init, (None, "data")))(x + a)
    return nn.DenseGeneral(1, axis=(-2, -1))(nn.relu(h))


@pytest.fixture(scope="module")
def flat_kernel_block():
  loss_fn, init, params = _linen(FlatKernelBlock())
  return loss_fn, init, _reference(loss_fn, params)


@pytest.mark.parametrize("mesh_axes,added", [(MESHES[0], "('model', 'data')"),
                                             (MESHES[2], "('model',)")])
def test_boxes_on_axes_the_mesh_lacks_in_layers_that_unbox_them(flat_kernel_block, mesh_axes,
                                                                added, caplog):
  # The step is traced on the mesh with a size-1 axis for each name it lacks (said once),
  # compiled for the state on the caller's mesh, and its executable taken again.
  loss_fn, init, want = flat_kernel_block
  caplog.set_level("INFO")
  got = _fnscale(loss_fn, init, mesh_axes, 1)
  _check(got, want)
  said = [r.getMessage() for r in caplog.records if "size-1 axes" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith(f"shard_step: traced under the mesh with "
                                               f"size-1 axes {added} added"), said
  assert not [r for r in caplog.records if "compiling again" in r.getMessage()]
  assert {leaf.sharding.mesh for leaf in jax.tree.leaves(got[1])} == {fs.make_mesh(mesh_axes)}
  if "data" in mesh_axes:
    assert _specs(got[1])["DenseGeneral_0"]["kernel"] == P(None, "data", None)


def test_init_state_under_a_mesh_without_the_boxes_axes(flat_kernel_block):
  # The init function is traced under the ambient mesh with the axes it lacks, of size 1.
  _, init, _ = flat_kernel_block
  mesh = fs.make_mesh({"fsdp": 8})
  with fs.with_mesh(mesh):
    key = jax.random.key(0)  # a key made under the mesh lives on it
    state = fs.init_state(init, OPT, mesh=mesh, key=key)
    abstract = fs.init_state(init, OPT, mesh=mesh, key=key, abstract=True)
  want = nn.unbox(init(jax.random.key(0)))
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), state.params, want)
  assert {leaf.sharding.mesh for leaf in jax.tree.leaves(state)} == {mesh}
  assert jax.tree.map(lambda x: x.sharding, abstract) == jax.tree.map(lambda x: x.sharding,
                                                                      state)


class DropoutBlock(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.5, deterministic=False)(FlatKernelBlock()(x))


@pytest.mark.slow  # the other Linen metadata steps stay quick
def test_a_key_made_under_the_mesh_trains_or_names_the_axis_to_add():
  # jax 0.10 refuses to fold a key that lives on the caller's mesh into one traced on the
  # mesh with size-1 axes (train_step's dropout key, made under the mesh): then the error
  # names the axes to add, and with them the step trains as it does where jax allows it.
  model = DropoutBlock()
  x0 = np.zeros((1, 4, 16), np.float32)

  def loss_fn(params, batch, key):
    y = model.apply({"params": params}, batch["x"], rngs={"dropout": key})
    return jnp.mean((y - batch["y"]) ** 2)

  def run(mesh):
    with fs.with_mesh(mesh):
      key = jax.random.key(1)
    return _fnscale(loss_fn, lambda k: model.init(k, x0)["params"], mesh, 1, key=key)

  mesh = fs.make_mesh({"fsdp": 8})
  try:
    got = run(mesh)
  except fs.StepError as e:
    assert ("fix: give the mesh an Auto axis 'model' of size 1 (it splits nothing): "
            "jax.sharding.Mesh(mesh.devices[..., None], mesh.axis_names + ('model',), "
            "axis_types=mesh.axis_types + (jax.sharding.AxisType.Auto,))") in str(e), e
    got = None
  for name in ("model", "data"):  # the fix, for each axis the error names in turn
    mesh = jax.sharding.Mesh(mesh.devices[..., None], mesh.axis_names + (name,),
                             axis_types=mesh.axis_types + (jax.sharding.AxisType.Auto,))
  want = run(mesh)
  if got is not None:
    _check(got, want)


def test_box_constraints_that_cant_hold_name_the_fix(flat_kernel_block):
  # A box on an axis the per-shard microbatch loop makes manual: "auto" runs the loop with
  # the partitioner (as per_microbatch does); "once" names that option.
  loss_fn, init, want = flat_kernel_block
  with pytest.raises(fs.StepError, match=r"sharding constraint in the loss.*fix:.*"
                     r"accum_gather='per_microbatch'"):
    _fnscale(loss_fn, init, {"data": 2, "fsdp": 4}, 2, accum_gather="once")
  got = _fnscale(loss_fn, init, {"data": 2, "fsdp": 4}, 2)
  _check(got, want)
  assert _specs(got[1])["DenseGeneral_0"]["kernel"] == P(None, "data", None)
  # Names of the full kernel on the flat one it is initialized as: at most one per dimension.

  class FullNames(nn.Module):

    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "data", None))
      return nn.DenseGeneral((2, 8), kernel_init=init)(x)

  model = FullNames()
  mesh = fs.make_mesh({"fsdp": 8})
  params = model.init(jax.random.key(0), np.zeros((1, 4, 16), np.float32))["params"]
  state = fs.init_state(params, OPT, mesh=mesh)
  step = fs.shard_step(fs.train_step(
      lambda p, b: jnp.mean(model.apply({"params": p}, b["x"]) ** 2), OPT), mesh)
  with pytest.raises(fs.StepError, match=r"Linen box.*fix: give the box at most one name per "
                     r"dimension of the flat 2-D kernel"):
    step.compile(state, _batches()[0])


# ----------------------------------------------------------------------------- NNX


class NnxMLP(nnx.Module):
  """Metadata over the authors' own mesh axes {"fsdp": 4, "tensor": 2}."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")),
                         rngs=rngs)
    self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")),
                           rngs=rngs)
    self.out = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.down(nnx.relu(self.up(x)))))


@pytest.fixture(scope="module")
def nnx_mlp():
  with jax.set_mesh(fs.make_mesh({"fsdp": 4, "tensor": 2})):  # eager sharding needs a mesh
    graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

  want = _reference(loss_fn, nnx.to_pure_dict(params))
  return loss_fn, params, want


@pytest.mark.parametrize("mesh_axes,accum", [(MESHES[2], 2), (MESHES[0], 1)])
def test_nnx_mesh_axis_metadata(nnx_mlp, mesh_axes, accum):
  loss_fn, params, want = nnx_mlp
  got = _fnscale(loss_fn, params, mesh_axes, accum)
  _check((got[0], nnx.to_pure_dict(got[1])), want)
  specs = nnx.to_pure_dict(_specs(got[1]))
  tensor = "tensor" if "tensor" in mesh_axes else None
  assert specs["up"]["kernel"] == P("fsdp", tensor)
  assert specs["down"]["kernel"] == P(tensor, "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_axes", MESHES)
@pytest.mark.parametrize("accum", [1, 2])
def test_nnx_mesh_axis_metadata_every_mesh(nnx_mlp, mesh_axes, accum):
  if mesh_axes == {"data": 8}:  # no axis of the metadata: automatic FSDP (small: replicated)
    loss_fn, params, want = nnx_mlp
    got = _fnscale(loss_fn, params, mesh_axes, accum)
    _check((got[0], nnx.to_pure_dict(got[1])), want)
    return
  test_nnx_mesh_axis_metadata(nnx_mlp, mesh_axes, accum)


def test_nnx_names_are_mesh_axes_unless_flax_rules_mark_them_logical():
  mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
  rules = [("embed", "tensor")]
  # Mesh axes where the mesh has them ("fsdp"), the rules for the others ("embed").
  v = nnx.Param(np.zeros((16, 8)), out_sharding=("embed", "fsdp"), eager_sharding=False)
  assert fs.shardings({"w": v}, mesh, rules)["w"].get_value().spec == P("tensor", "fsdp")
  # Flax's own rules metadata marks the names logical: fnscale's rules map them all.
  v = nnx.Param(np.zeros((16, 8)), out_sharding=("embed", "fsdp"),
                sharding_rules=(("embed", "fsdp"),), eager_sharding=False)
  assert fs.shardings({"w": v}, mesh, rules)["w"].get_value().spec == P("tensor", None)


# ----------------------------------------------------------------------------- names


def test_short_and_long_names():
  mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
  assert fs.logical_to_spec(("embed",), RULES, mesh, shape=(8, 8, 2)) == P("fsdp", None, None)
  with pytest.raises(fs.ShardingError, match=r"leaf 'w'.*3 names but the array has rank 2"
                     r".*fix: give at most one name"):
    fs.logical_to_spec(("embed", "mlp", None), RULES, mesh, shape=(8, 8), path="w")
  box = nn.with_partitioning(nn.initializers.ones, ("fsdp", None, "tensor"))(
      jax.random.key(0), (8, 8))
  with pytest.raises(fs.ShardingError, match=r"leaf 'w'.*3 entries but the array has rank 2"):
    fs.shardings({"w": box}, mesh)
