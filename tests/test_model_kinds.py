"""The params a user already has, passed to `init_state` as that framework's users hold them:
an Equinox model split by `eqx.partition` (a callable pytree of arrays: params, not an init
function), and haiku-style params (a dict from a plain init function, a plain loss). Each
trains over a mesh as the same loss does on one device with plain optax; an Equinox static
field holding a jax array, and a callable with no arrays, stop with a StepError naming them.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

eqx = pytest.importorskip("equinox", reason="equinox is a test extra: pip install -e '.[test]'")

VOCAB, EMBED, WIDTH, SEQ, BATCH, STEPS = 32, 16, 32, 4, 16, 3
RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
MESHES = ({"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2})


def _batches():
  rng = np.random.default_rng(0)
  return [{"tokens": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
           "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)}
          for _ in range(STEPS)]


def _one_device(params, loss_fn):
  """Plain optax on one device: the reference losses and params."""
  opt = optax.adam(1e-2)
  opt_state, losses = opt.init(params), []
  for batch in _batches():
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params


def _sharded(init_fn_or_params, loss_fn, axes, accum, logical_axes, key=None):
  mesh = fs.make_mesh(axes)
  opt = optax.adam(1e-2)
  state = fs.init_state(init_fn_or_params, opt, mesh=mesh, rules=RULES,
                        logical_axes=logical_axes, key=key)
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum), mesh)
  losses = []
  for batch in _batches():
    state, metrics = step(state, fs.global_batch(batch, fs.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return losses, state.params


def _assert_trains_like_one_device(got, want, axes):
  (losses, params), (ref_losses, ref_params) = got, want
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  specs = [tuple(x.sharding.spec) for x in jax.tree.leaves(params)]
  for axis in axes:  # the rules split the params over every model axis of the mesh
    if axis != "data":
      assert any(axis in str(s) for s in specs), (axis, specs)


# Equinox, as its users write it: eqx.nn layers, the model called per example and vmapped.
class TokenMLP(eqx.Module):
  embed: eqx.nn.Embedding
  mlp: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(VOCAB, EMBED, key=k1)
    self.mlp = eqx.nn.MLP(EMBED, EMBED, WIDTH, depth=1, activation=jax.nn.gelu, key=k2)
    self.head = eqx.nn.Linear(EMBED, VOCAB, key=k3)

  def __call__(self, tokens):  # [seq] -> [seq, vocab]
    return jax.vmap(lambda t: self.head(self.mlp(self.embed(t))))(tokens)


# Equinox's Linear weight is [out, in].
EQX_AXES = ((r"^embed/weight$", ("vocab", "embed")),
            (r"^mlp/layers/0/weight$", ("mlp", "embed")),
            (r"^mlp/layers/1/weight$", ("embed", "mlp")),
            (r"^head/weight$", ("vocab", "embed")))
EQX_PARAMS, EQX_STATIC = eqx.partition(TokenMLP(jax.random.key(0)), eqx.is_inexact_array)


def eqx_loss(params, batch):
  model = eqx.combine(params, EQX_STATIC)
  logits = jax.vmap(model)(batch["tokens"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def eqx_init(key):
  return eqx.partition(TokenMLP(key), eqx.is_inexact_array)[0]


@functools.cache
def _eqx_reference():
  return _one_device(EQX_PARAMS, eqx_loss)


def test_an_equinox_module_of_arrays_is_params_not_an_init_function():
  # The partitioned module is callable (as every Equinox module is): it was called as an
  # init function, a raw TypeError from TokenMLP.__call__.
  state = fs.init_state(EQX_PARAMS, optax.adam(1e-2), mesh=fs.make_mesh({"fsdp": 8}),
                        abstract=True)
  assert isinstance(state.params, TokenMLP)
  assert state.params.mlp.layers[0].weight.shape == (WIDTH, EMBED)


def test_an_equinox_model_trains_like_one_device():
  axes = {"data": 2, "fsdp": 2, "tensor": 2}
  _assert_trains_like_one_device(_sharded(EQX_PARAMS, eqx_loss, axes, 2, EQX_AXES),
                                 _eqx_reference(), axes)


@pytest.mark.slow
@pytest.mark.parametrize("accum", (1, 2))
@pytest.mark.parametrize("axes", MESHES, ids=str)
@pytest.mark.parametrize("given", ("params", "init_fn"))
def test_an_equinox_model_trains_like_one_device_on_every_mesh(given, axes, accum):
  arg, key = (EQX_PARAMS, None) if given == "params" else (eqx_init, jax.random.key(0))
  _assert_trains_like_one_device(_sharded(arg, eqx_loss, axes, accum, EQX_AXES, key),
                                 _eqx_reference(), axes)


def test_a_whole_equinox_model_is_refused_naming_the_partition():
  # Unpartitioned, the model holds its activation function as a leaf.
  with pytest.raises(fs.StepError, match=r"params leaf 'mlp/activation' is a \w+, expected an "
                     r"array; .*eqx.partition\(model, eqx.is_inexact_array\)"):
    fs.init_state(TokenMLP(jax.random.key(0)), optax.adam(1e-2),
                  mesh=fs.make_mesh({"fsdp": 8}), abstract=True)


def test_a_callable_pytree_without_arrays_is_refused_and_the_fix_works():
  mesh = fs.make_mesh({"fsdp": 8})
  jitted = eqx.filter_jit(eqx_init)  # an Equinox module wrapping the init function
  with pytest.raises(fs.StepError, match=r"callable _JitWrapper pytree with no array leaves.*"
                     r"fix: .*`lambda key: init\(key\)`"):
    fs.init_state(jitted, optax.adam(1e-2), mesh=mesh, key=jax.random.key(0), abstract=True)
  state = fs.init_state(lambda key: jitted(key), optax.adam(1e-2), mesh=mesh,
                        key=jax.random.key(0), abstract=True)
  assert isinstance(state.params, TokenMLP)
  # A partial is a function, whatever it holds.
  state = fs.init_state(jax.tree_util.Partial(eqx_init, jax.random.key(0)),
                        optax.adam(1e-2), mesh=mesh, abstract=True)
  assert isinstance(state.params, TokenMLP)


class Scaled(eqx.Module):
  weight: jax.Array
  scale: object = eqx.field(static=True)

  def __call__(self, x):
    return x @ self.weight * jnp.asarray(self.scale)


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_a_jax_array_in_a_static_field_is_named_with_the_fix():
  mesh = fs.make_mesh({"fsdp": 8})

  def init(key):
    return eqx.partition(Scaled(jax.random.normal(key, (8, 8)), jnp.ones(8)),
                         eqx.is_inexact_array)[0]

  # Traced, the static array was a leaked tracer (a later step called with the wrong
  # inputs); passed directly, jax's "checking equality of metadata fields".
  for arg, key in ((init, jax.random.key(0)), (init(jax.random.key(0)), None)):
    with pytest.raises(fs.StepError, match=r"params field Scaled.scale is a static field "
                       r"holding a jax array.*fix: make it a normal field.*numpy array"):
      fs.init_state(arg, optax.sgd(0.1), mesh=mesh, key=key)
  # The fix: a numpy array in the static field trains.
  params = Scaled(jnp.ones((8, 8)), np.full(8, 0.5, np.float32))
  opt = optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh)
  loss = lambda p, b: jnp.mean(p(b["x"]) ** 2)
  state, metrics = fs.shard_step(fs.train_step(loss, opt), mesh)(state, {"x": jnp.ones((8, 8))})
  assert float(metrics["loss"]) == pytest.approx(16.0)  # (8 * 1 * 0.5) ** 2


# haiku-style: params a dict of dicts from a plain init function, the loss a plain function.
HK_AXES = ((r"^embed/embeddings$", ("vocab", "embed")),
           (r"^mlp/~/linear_0/w$", ("embed", "mlp")),
           (r"^mlp/~/linear_1/w$", ("mlp", "embed")),
           (r"^head/w$", ("embed", "vocab")))


def hk_init(key):
  k = jax.random.split(key, 4)
  dense = lambda k, n, m: {"w": jax.random.normal(k, (n, m)) / np.sqrt(n), "b": jnp.zeros(m)}
  return {"embed": {"embeddings": jax.random.normal(k[0], (VOCAB, EMBED))},
          "mlp/~/linear_0": dense(k[1], EMBED, WIDTH),
          "mlp/~/linear_1": dense(k[2], WIDTH, EMBED), "head": dense(k[3], EMBED, VOCAB)}


def hk_loss(params, batch):
  linear = lambda p, x: x @ p["w"] + p["b"]
  h = params["embed"]["embeddings"][batch["tokens"]]
  h = linear(params["mlp/~/linear_1"], jax.nn.gelu(linear(params["mlp/~/linear_0"], h)))
  logits = linear(params["head"], h)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


@functools.cache
def _hk_reference():
  return _one_device(hk_init(jax.random.key(0)), hk_loss)


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_haiku_style_params_train_like_one_device():
  axes = {"fsdp": 8}
  _assert_trains_like_one_device(
      _sharded(hk_init, hk_loss, axes, 1, HK_AXES, jax.random.key(0)), _hk_reference(), axes)


@pytest.mark.slow
@pytest.mark.parametrize("accum", (1, 2))
@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_haiku_style_params_train_like_one_device_on_every_mesh(axes, accum):
  _assert_trains_like_one_device(
      _sharded(hk_init, hk_loss, axes, accum, HK_AXES, jax.random.key(0)), _hk_reference(),
      axes)


def test_a_flax_struct_with_call_is_params():
  struct = pytest.importorskip("flax.struct")

  class Affine(struct.PyTreeNode):
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
      return x @ self.w + self.b

  state = fs.init_state(Affine(jnp.ones((8, 2)), jnp.zeros(2)), optax.sgd(0.1),
                        mesh=fs.make_mesh({"fsdp": 8}), abstract=True)
  assert isinstance(state.params, Affine) and state.params.w.shape == (8, 2)


def test_params_that_cant_be_trained_are_named_with_the_fix():
  # Equinox's `eqx.is_array` filter keeps an int array in the params; jax's grad refused it
  # naming no leaf.
  class Indexed(eqx.Module):
    idx: jax.Array
    w: jax.Array

    def __call__(self, x):
      return x[:, self.idx] @ self.w

  model = Indexed(jnp.arange(3), jnp.ones((3, 4)))
  params, static = eqx.partition(model, eqx.is_array)
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  loss = lambda p, b: jnp.mean(eqx.combine(p, static)(b["x"]) ** 2)
  state = fs.init_state(params, opt, mesh=mesh)
  with pytest.raises(fs.StepError, match=r"params leaf 'idx' is int32\[3\].*"
                     r"eqx\.is_inexact_array"):
    fs.shard_step(fs.train_step(loss, opt), mesh).compile(state, {"x": np.ones((8, 5))})


def test_a_loss_returning_a_pair_without_has_aux_names_it():
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  state = fs.init_state({"w": jnp.ones((4, 2))}, opt, mesh=mesh)
  loss = lambda p, b: (jnp.mean(b["x"] @ p["w"]), {"n": 1.0})
  with pytest.raises(fs.StepError, match=r"returned a tuple of 2.*has_aux=True"):
    fs.shard_step(fs.train_step(loss, opt), mesh).compile(state, {"x": np.ones((8, 4))})


def test_an_nnx_split_keeping_its_rng_keys_is_named_with_the_fix():
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

  _, state = nnx.split(Net(nnx.Rngs(0)))  # no filter: the Rngs' key and count come along
  with pytest.raises(fs.StepError, match=r"'drop/rngs/(count|key)' is an NNX Rng\w+, not an "
                     r"nnx\.Param.*fix: .*nnx\.split\(model, nnx\.Param, \.\.\.\)"):
    fs.init_state(state, optax.sgd(0.1), mesh=fs.make_mesh({"fsdp": 8}))


def test_a_whole_nnx_module_holding_batch_stats_is_refused_and_its_params_train():
  """An nnx.Module passed whole (a pytree: its Params, a BatchNorm's BatchStats) was taken
  as params: AdamW's weight decay then shrank the running variance and BatchNorm never
  updated it. Refused naming the BatchStat and the split; the split's Params train as
  plain optax does on one device (the BatchNorm on its running statistics)."""
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(8, 16, rngs=rngs)
      self.bn = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)

    def __call__(self, x):
      return self.bn(self.up(x))

  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.adamw(1e-2, weight_decay=0.5)
  model = Net(nnx.Rngs(0))
  for whole in (model, nnx.split(model)[1]):
    with pytest.raises(fs.StepError, match=r"params leaf 'bn/mean' is an NNX BatchStat, not "
                       r"an nnx\.Param: the optimizer would train it"):
      fs.init_state(whole, opt, mesh=mesh)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
  loss = lambda p, b: jnp.mean(nnx.merge(graphdef, p, rest)(b["x"]) ** 2)
  step = fs.shard_step(fs.train_step(loss, opt), mesh)
  state, m = step(fs.init_state(params, opt, mesh=mesh), {"x": x})
  want, grads = jax.value_and_grad(loss)(params, {"x": x})
  updates, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state.params["up"]["kernel"][...]), np.asarray(
      optax.apply_updates(params, updates)["up"]["kernel"][...]), rtol=1e-5, atol=1e-6)


def test_an_init_function_returning_a_whole_equinox_model_names_the_leaf():
  with pytest.raises(fs.StepError, match=r"init_fn returned a \w+ at params leaf "
                     r"'mlp/activation', expected arrays; fix: .*eqx\.partition"):
    fs.init_state(lambda key: TokenMLP(key), optax.adam(1e-2), mesh=fs.make_mesh({"fsdp": 8}),
                  key=jax.random.key(0), abstract=True)


@pytest.mark.parametrize("seed", [0, 1.5])
def test_a_seed_given_as_init_states_key_names_the_fix(seed):
  with pytest.raises(fs.StepError, match=rf"key is an? \w+ \({seed}\), expected a PRNG key "
                     rf"for init_fn; fix: key=jax\.random\.key\({seed}\)"):
    fs.init_state(eqx_init, optax.adam(1e-2), mesh=fs.make_mesh({"fsdp": 8}), key=seed)
