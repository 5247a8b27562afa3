"""Flax NNX, Flax Linen and Equinox models trained through fnscale match each framework's own
single-device training, and their params come out sharded as their annotations ask.

Each recipe trains 5 steps on an 8-device mesh (fsdp=4, tensor=2) through `fs.train_step` +
`fs.shard_step`; the reference is the same model trained on one device the framework's own
way (nnx.Optimizer + nnx.jit, Linen TrainState + jax.jit, eqx.filter_jit), with its loss
written here rather than taken from the recipe. The NNX and Equinox sharding tests read
the params `fs.init_state` places (`train(0)`); Linen's, the trained ones.
"""
import functools
import importlib.util
import pathlib
import sys

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import fnscale as fs

flax = pytest.importorskip("flax", reason="flax is a test extra: pip install -e '.[test]'")
eqx = pytest.importorskip("equinox", reason="equinox is a test extra: pip install -e '.[test]'")
from flax import nnx  # pylint: disable=g-import-not-at-top
import flax.linen as nn  # pylint: disable=g-import-not-at-top
from flax.training import train_state  # pylint: disable=g-import-not-at-top

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "recipes" / "examples"
MESH = "fsdp=4,tensor=2"
STEPS = 5


@functools.lru_cache(maxsize=None)
def _recipe(name):  # one module per recipe: its classes are the ones its params were built with
  spec = importlib.util.spec_from_file_location(f"fnscale_recipe_{name}", RECIPES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (Equinox modules) look their module up there
  spec.loader.exec_module(module)
  return module


def _xent(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _batches(r):
  data = r.corpus()
  one = jax.devices()[0]
  return [jax.device_put(r.get_batch(data, i), one) for i in range(STEPS)]


def _is_axes(a):
  return a is None or isinstance(a, tuple)  # one leaf's logical axes


def _spec(x):
  return x.sharding.spec


def _assert_close_trees(got, want):
  # Per leaf, the relative norm of the difference: Adam maps a gradient that is ~0 up to
  # float rounding to a full-size step of either sign, so single elements may differ by up
  # to lr * steps between two correct programs; a wrong update moves whole leaves.
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
  for (path, g), (_, w) in zip(got_flat, want_flat):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, jax.tree_util.keystr(path)
    assert np.linalg.norm(g - w) <= 1e-4 * np.linalg.norm(w) + 1e-6, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- Flax NNX


@pytest.fixture(scope="module")
def nnx_run():
  r = _recipe("embed_flax_nnx")
  return r, r.train(STEPS, MESH)


@pytest.fixture(scope="module")
def nnx_placed():
  """The recipe's params as `fs.init_state` places them (no step: `train(0)`). The step
  keeps its state's shardings (the Linen test, tests/test_step.py)."""
  r = _recipe("embed_flax_nnx")
  return r, r.train(0, MESH)


@pytest.mark.slow
def test_nnx_matches_single_device_training(nnx_run):
  r, (losses, params) = nnx_run
  model = r.ByteLM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    loss_fn = lambda m: _xent(m(batch["tokens"][:, :-1]), batch["tokens"])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  want = [float(step(model, optimizer, b)) for b in _batches(r)]
  assert len(model.head.kernel[...].devices()) == 1
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.5  # it learns
  _assert_close_trees(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_nnx_params_sharded_as_annotated(nnx_placed):
  r, (_, params) = nnx_placed
  assert _spec(params["blocks"][0]["up"]["kernel"]) == P("fsdp", "tensor")  # (embed, mlp)
  assert _spec(params["blocks"][1]["down"]["kernel"]) == P("tensor", "fsdp")  # (mlp, embed)
  assert _spec(params["blocks"][0]["q"]["kernel"]) == P("fsdp", "tensor")  # (embed, heads)
  assert _spec(params["embed"]["embedding"]) == P("tensor", "fsdp")  # (vocab, embed)
  assert _spec(params["blocks"][0]["up"]["bias"]) == P()  # unannotated, small: replicated
  assert _spec(params["pos"]) == P("fsdp", None)  # unannotated [64, 64]: automatic FSDP
  # Every annotated leaf as flax itself resolves the annotation under the same rules.
  state = nnx.state(nnx.eval_shape(lambda: r.ByteLM(nnx.Rngs(0))))
  with nnx.logical_axis_rules(r.RULES):
    flax_specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  _, axes = fs.adapters.unbox_flax(state)
  checked = 0
  for (path, names), spec, x in zip(
      jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)[0],
      jax.tree.leaves(flax_specs), jax.tree.leaves(params)):
    if names is not None:
      assert _spec(x) == spec, jax.tree_util.keystr(path)
      checked += 1
  assert checked == r.LAYERS * 6 + 2  # six kernels per block, embedding and head


# ----------------------------------------------------------------------------- Flax Linen


@pytest.fixture(scope="module")
def linen_run():
  r = _recipe("embed_flax_linen")
  return r, r.train(STEPS, MESH)


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_linen_matches_single_device_training(linen_run):
  r, (losses, params) = linen_run
  variables = r.ByteLM().init(jax.random.key(0), np.zeros((1, r.SEQ), np.int32))
  state = train_state.TrainState.create(apply_fn=r.ByteLM().apply,
                                        params=nn.unbox(variables)["params"],
                                        tx=optax.adam(3e-3))

  @jax.jit
  def step(state, batch):
    def loss_fn(p):
      return _xent(state.apply_fn({"params": p}, batch["tokens"][:, :-1]), batch["tokens"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  want = []
  for b in _batches(r):
    state, loss = step(state, b)
    want.append(float(loss))
  assert len(state.params["head"]["kernel"].devices()) == 1
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.5
  _assert_close_trees(params, state.params)


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_linen_params_sharded_as_annotated(linen_run):
  r, (_, params) = linen_run
  # Dense kernel annotated ("embed", "mlp") under (("embed", "fsdp"), ("mlp", "tensor")).
  assert _spec(params["block_0"]["up"]["kernel"]) == P("fsdp", "tensor")
  assert _spec(params["block_1"]["o"]["kernel"]) == P("tensor", "fsdp")  # (heads, embed)
  assert _spec(params["head"]["kernel"]) == P("fsdp", "tensor")  # (embed, vocab)
  assert _spec(params["pos"]) == P(None, "fsdp")  # (None, embed)
  assert _spec(params["ln_f"]["scale"]) == P()  # unannotated, small
  # fnscale reads exactly the names flax reports, and maps them as flax's own
  # nn.logical_to_mesh_axes does under the same rules.
  variables = jax.eval_shape(r.init_variables, jax.random.key(0))
  flax_names = nn.get_partition_spec(variables)["params"]
  _, axes = fs.adapters.unbox_flax(variables["params"])
  is_boxed = lambda x: isinstance(x, nn.LogicallyPartitioned)
  boxed = jax.tree.leaves(variables["params"], is_leaf=is_boxed)
  n = 0
  for box, names, spec, x in zip(boxed, jax.tree.leaves(axes, is_leaf=_is_axes),
                                 jax.tree.leaves(flax_names), jax.tree.leaves(params)):
    if is_boxed(box):
      assert names == tuple(spec)
      assert _spec(x) == nn.logical_to_mesh_axes(spec, r.RULES)
      n += 1
    else:
      assert names is None
  assert n == r.LAYERS * 6 + 3  # six kernels per block, embedding, positions and head


# ----------------------------------------------------------------------------- Equinox


@pytest.fixture(scope="module")
def eqx_run():
  r = _recipe("embed_equinox")
  return r, r.train(STEPS, MESH)


@pytest.fixture(scope="module")
def eqx_placed():
  """As `nnx_placed`, for the Equinox recipe."""
  r = _recipe("embed_equinox")
  return r, r.train(0, MESH)


@pytest.mark.slow
def test_equinox_matches_single_device_training(eqx_run):
  r, (losses, params) = eqx_run
  model = r.ByteLM(jax.random.key(0))
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, opt_state, batch):
    loss_fn = lambda m: _xent(m(batch["tokens"][:, :-1]), batch["tokens"])
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  want = []
  for b in _batches(r):
    model, opt_state, loss = step(model, opt_state, b)
    want.append(float(loss))
  assert len(model.head.weight.devices()) == 1
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.5
  _assert_close_trees(params, eqx.filter(model, eqx.is_inexact_array))


def test_equinox_params_sharded_by_path_rules(eqx_placed):
  _, (_, params) = eqx_placed
  block = params.blocks[0]
  assert _spec(block.up.weight) == P("tensor", "fsdp")  # [out, in] = (mlp, embed)
  assert _spec(block.down.weight) == P("fsdp", "tensor")  # (embed, mlp)
  assert _spec(params.blocks[1].q.weight) == P("tensor", "fsdp")  # (heads, embed)
  assert _spec(block.o.weight) == P("fsdp", "tensor")  # (embed, heads)
  assert _spec(params.embed.weight) == P("tensor", "fsdp")  # (vocab, embed)
  assert _spec(params.head.weight) == P("tensor", "fsdp")  # (vocab, embed)
  assert _spec(params.pos) == P("fsdp", None)  # no rule, [64, 64]: automatic FSDP
  assert _spec(block.up.bias) == P()  # no rule, small: replicated


# ----------------------------------------------------------------------------- unbox_flax


def test_unbox_flax_reads_each_kind_of_box():
  key = jax.random.key(0)
  mesh_axes = nn.with_partitioning(nn.initializers.ones, ("fsdp", None))(key, (4, 2))
  logical = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))(key, (4, 2))
  nnx_var = nnx.Param(np.ones((4,)), out_sharding=("embed",), eager_sharding=False)
  tree = {"a": mesh_axes, "b": logical, "c": {"d": np.zeros(3), "e": [nnx_var, np.ones(2)]}}
  params, axes = fs.adapters.unbox_flax(tree)
  assert axes == {"a": fs.adapters.MeshNames(("fsdp", None)), "b": ("embed", "mlp"),
                  "c": {"d": None, "e": [fs.adapters.MeshNames(("embed",)), None]}}
  assert isinstance(axes["a"], fs.adapters.MeshNames)
  assert not isinstance(axes["b"], fs.adapters.MeshNames)
  assert jax.tree.structure(params) == jax.tree.structure(
      {"a": 0, "b": 0, "c": {"d": 0, "e": [0, 0]}})
  np.testing.assert_array_equal(params["c"]["e"][0], np.ones(4))
  # The axes drive fnscale's shardings directly.
  mesh = fs.make_mesh(MESH)
  sh = fs.shardings(params, mesh, (("embed", "fsdp"), ("mlp", "tensor")), logical_axes=axes)
  assert sh["a"].spec == P("fsdp", None) and sh["b"].spec == P("fsdp", "tensor")
  assert sh["c"]["e"][0].spec == P("fsdp")


def test_unbox_flax_rejects_bad_names():
  box = nn.LogicallyPartitioned(np.ones((4, 2)), (("fsdp", "tensor"), None))
  with pytest.raises(fs.ShardingError, match=r"leaf 'block/w'.*\(\('fsdp', 'tensor'\), None\)"
                     r".*str or None.*fix"):
    fs.adapters.unbox_flax({"block": {"w": box}})
