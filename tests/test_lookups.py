"""Table lookups under FSDP: a token-embedding table split over "fsdp" on its model dim, looked
up with token ids split over the same axis, made XLA replicate the lookup's result on every
device ("[SPMD] Involuntary full rematerialization") in Linen, NNX and Equinox models alike,
whatever the model constrained after it. `train_step` gathers such a table over the data
axes before the loss: no warning, the same training as on one device.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import _lookups

VOCAB, D, HEADS, MLP, SEQ, BATCH = 64, 32, 2, 64, 8, 8
# README's rules: the table's "embed" dim over fsdp, its vocab dim unsplit.
RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"))
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
REMAT = "Involuntary full rematerialization"


def _attention(q, k, v):  # [batch, seq, heads, d_head], causal
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _batches(n=2):
  rng = np.random.default_rng(0)
  return [{"tokens": rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)}
          for _ in range(n)]


def _xent(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _check(init_fn, loss_fn, logical_axes, accum=1):
  """Compiles on MESH without XLA's warning; trains like one device with plain optax."""
  mesh, opt = fs.make_mesh(MESH), optax.sgd(0.5)
  state = fs.init_state(init_fn, opt, mesh=mesh, rules=RULES, logical_axes=logical_axes,
                        key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum), mesh, donate=False)
  batches = _batches()
  compiled = step.compile(state, fs.global_batch(batches[0], fs.batch_sharding(mesh)))
  assert not [w for w in compiled.xla_warnings if REMAT in w], compiled.xla_warnings
  params = init_fn(jax.random.key(0))
  opt_state = opt.init(params)
  one_device = jax.jit(jax.value_and_grad(loss_fn))
  for batch in batches:
    state, metrics = compiled(state, fs.global_batch(batch, fs.batch_sharding(mesh)))
    loss, grads = one_device(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  return state


@pytest.mark.slow  # the plain-table lookups beside it stay quick
def test_a_linen_embedding_under_fsdp_compiles_without_replicating():
  nn = pytest.importorskip("flax.linen")
  part = nn.with_logical_partitioning

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(VOCAB, D, embedding_init=part(nn.initializers.normal(0.02),
                                                 ("vocab", "embed")))(tokens)
      dense = lambda n, names: nn.Dense(n, kernel_init=part(nn.initializers.lecun_normal(),
                                                            names))
      heads = lambda t: t.reshape(*t.shape[:2], HEADS, D // HEADS)
      h = nn.LayerNorm()(x)
      a = _attention(*(heads(dense(D, ("embed", "heads"))(h)) for _ in range(3)))
      x = x + dense(D, ("heads", "embed"))(a.reshape(x.shape))
      x = x + dense(D, ("mlp", "embed"))(nn.gelu(dense(MLP, ("embed", "mlp"))(x)))
      return dense(VOCAB, ("embed", "vocab"))(x)

  model = LM()
  init = lambda key: fs.adapters.unbox_flax(
      model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"])[0]
  _, axes = fs.adapters.unbox_flax(
      jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"])
  loss = lambda p, b: _xent(model.apply({"params": p}, b["tokens"][:, :-1]), b["tokens"])
  state = _check(init, loss, axes)
  # The table stays stored split: only the loss's copy is gathered.
  assert state.params["Embed_0"]["embedding"].sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp")


@pytest.mark.slow
def test_an_nnx_embedding_under_fsdp_compiles_without_replicating():
  nnx = pytest.importorskip("flax.nnx")
  part = lambda names, init=nnx.initializers.lecun_normal(): nnx.with_partitioning(
      init, names, eager_sharding=False)

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(VOCAB, D, embedding_init=part(("vocab", "embed"),
                                                           nnx.initializers.normal(0.02)),
                             rngs=rngs)
      self.qkv = nnx.List([nnx.Linear(D, D, kernel_init=part(("embed", "heads")), rngs=rngs)
                           for _ in range(3)])
      self.o = nnx.Linear(D, D, kernel_init=part(("heads", "embed")), rngs=rngs)
      self.up = nnx.Linear(D, MLP, kernel_init=part(("embed", "mlp")), rngs=rngs)
      self.down = nnx.Linear(MLP, D, kernel_init=part(("mlp", "embed")), rngs=rngs)
      self.head = nnx.Linear(D, VOCAB, kernel_init=part(("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      heads = lambda t: t.reshape(*t.shape[:2], HEADS, D // HEADS)
      a = _attention(*(heads(f(x)) for f in self.qkv))
      x = x + self.o(a.reshape(x.shape))
      x = x + self.down(jax.nn.gelu(self.up(x)))
      return self.head(x)

  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(nnx.Rngs(0))), nnx.Param)
  _, axes = fs.adapters.unbox_flax(abstract)
  init = lambda key: fs.adapters.unbox_flax(nnx.split(LM(nnx.Rngs(key)), nnx.Param)[1])[0]
  loss = lambda p, b: _xent(nnx.merge(graphdef, p)(b["tokens"][:, :-1]), b["tokens"])
  _check(init, loss, axes)


@pytest.mark.slow
def test_an_equinox_embedding_under_fsdp_compiles_without_replicating():
  eqx = pytest.importorskip("equinox")

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 4)
      self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
      self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k[1])
      self.mlp = eqx.nn.MLP(D, D, MLP, depth=1, activation=jax.nn.gelu, key=k[2])
      self.head = eqx.nn.Linear(D, VOCAB, key=k[3])

    def __call__(self, tokens):  # one sequence [seq] -> [seq, vocab]
      x = jax.vmap(self.embed)(tokens)
      mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
      x = x + self.attn(x, x, x, mask=mask)
      x = x + jax.vmap(self.mlp)(x)
      return jax.vmap(self.head)(x)

  # Linear weights are [out, in].
  axes = ((r"^embed/weight$", ("vocab", "embed")),
          (r"^attn/(query|key|value)_proj/weight$", ("heads", "embed")),
          (r"^attn/output_proj/weight$", ("embed", "heads")),
          (r"^mlp/layers/0/weight$", ("mlp", "embed")),
          (r"^mlp/layers/1/weight$", ("embed", "mlp")),
          (r"^head/weight$", ("vocab", "embed")))
  _, static = eqx.partition(LM(jax.random.key(0)), eqx.is_inexact_array)
  init = lambda key: eqx.partition(LM(key), eqx.is_inexact_array)[0]
  loss = lambda p, b: _xent(jax.vmap(eqx.combine(p, static))(b["tokens"][:, :-1]),
                            b["tokens"])
  _check(init, loss, axes)


def test_only_looked_up_tables_split_off_their_indexed_dim_are_gathered():
  params = {"table": jnp.ones((VOCAB, D)), "w": jnp.ones((D, D)), "rows": jnp.ones((VOCAB, D))}

  def loss(p, tokens):
    x = jnp.take(p["table"], tokens, axis=0).astype(jnp.bfloat16)  # a lookup
    y = jax.vmap(jax.vmap(lambda t: p["rows"].astype(jnp.bfloat16)[t]))(tokens)  # per token
    return jnp.mean((x @ p["w"].astype(jnp.bfloat16)) * y)

  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  # Leaves in flattening order: rows, table, w; each looked-up table indexed on dim 0.
  assert _lookups.indexed(loss, params, tokens) == {0: {0}, 1: {0}}
  mesh = fs.make_mesh(MESH)
  P = jax.sharding.PartitionSpec
  specs = [P("fsdp", None), P(None, "fsdp"), P("fsdp", None)]  # rows split on vocab only

  def constrained(p):
    out = _lookups.gather_tables(loss, p, (tokens,), specs, {"data", "fsdp"})
    return {k: out[k] is p[k] for k in out}  # untouched leaves are the same tracers

  with jax.set_mesh(mesh):
    kept = jax.eval_shape(lambda p: (constrained(p), 0)[1], params) is not None
    seen = {}
    jax.make_jaxpr(lambda p: seen.update(constrained(p)) or 0)(params)
  assert kept and seen == {"rows": True, "table": False, "w": True}


def test_a_lookup_per_shard_is_left_split():
  # Inside a shard_map (manual axes) the lookup is local: the table must not be gathered.
  P = jax.sharding.PartitionSpec
  mesh = fs.make_mesh(MESH)
  rows = ("data", "fsdp")
  local = jax.shard_map(lambda t, i: t[i], mesh=mesh, in_specs=(P(None, "tensor"), P(rows)),
                        out_specs=P(rows, None, "tensor"), check_vma=False)
  loss = lambda p, tokens: jnp.mean(local(p["table"], tokens))
  assert _lookups.indexed(loss, {"table": jnp.ones((VOCAB, D))},
                          jnp.zeros((BATCH, SEQ), jnp.int32)) == {}


def test_a_lookup_in_a_scanned_layer_follows_the_table_not_the_stack():
  params = {"table": jnp.ones((VOCAB, D)), "stack": jnp.ones((3, VOCAB, D))}

  def loss(p, tokens):
    def layer(x, table_i):  # a per-layer table from the stack, and the shared table
      return x + table_i[tokens] + p["table"][tokens], None
    return jnp.mean(jax.lax.scan(layer, jnp.zeros((BATCH, SEQ, D)), p["stack"])[0])

  # The stack's slices are looked up, the stack itself is not: only the table is found.
  assert _lookups.indexed(loss, params, jnp.zeros((BATCH, SEQ), jnp.int32)) == {1: {0}}
