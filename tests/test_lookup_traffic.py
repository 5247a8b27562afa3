"""The token-embedding lookup (`recipes/lm/embedding.py:lookup`, Llama's too) moves token ids and
activations between devices, never the table: the collectives of compiled programs
(`fs.analysis.hlo.summarize`, bytes per device per step) against hand counts of the shapes below.

The table is stored as the models' rules put it: d over "fsdp" (and, for the MoE and
context rules, over "expert" and "context" too), replicated over "data". A lookup that
gathered it (FSDP's treatment of a weight) or reduced its whole gradient would
move V x D x 4 bytes; what may move is the ids, the activations (all-to-alls over "fsdp")
and, over "data", the gradient of each device's own [V, D / fsdp] block.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import optax
import pytest

import fnscale as fs
from fnscale.analysis import hlo
from recipes.lm import embedding, gpt, llama

B, T, D = 16, 32, 64
F32 = I32 = 4


def _sizes(mesh_spec):
  sizes = dict(kv.split("=") for kv in mesh_spec.split(","))
  return int(sizes.get("data", 1)), int(sizes["fsdp"])


def _lookup_summary(mesh_spec, vocab):
  mesh = fs.make_mesh(mesh_spec)
  rows = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)

  def loss(table, tokens):
    return jnp.mean(jnp.square(embedding.lookup(table, tokens, gpt.RULES)))

  table = jax.ShapeDtypeStruct((vocab, D), jnp.float32,
                               sharding=NamedSharding(mesh, P(None, "fsdp")))
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P(rows)))
  with fs.with_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss)).lower(table, tokens).compile()
  return hlo.summarize(compiled.as_text())


@pytest.mark.parametrize("mesh_spec", ["data=2,fsdp=4", "fsdp=8"])
def test_lookup_moves_ids_and_activations_not_the_table(mesh_spec, partitioner):
  del partitioner
  V = 4096  # the table, 1 MiB of float32, outweighs the 128 KiB of activations
  d, f = _sizes(mesh_spec)
  s = _lookup_summary(mesh_spec, V)
  # Forward: the fsdp group's ids gathered, int32 [B / d, T]; an all-to-all turns the
  # looked-up [B / d, T, D / f] into this device's rows [B / (d f), T, D]; the backward pass
  # is one all-to-all of the same size back.
  ag, a2a = s.collective("all-gather"), s.collective("all-to-all")
  assert (ag.count, ag.bytes) == (1, B // d * T * I32)
  assert (a2a.count, a2a.bytes) == (2, 2 * B // (d * f) * T * D * F32)
  # The loss (4 bytes over all devices) and, with d > 1, the table block's gradient
  # [V, D / f] summed over "data" (pairs of devices), a 1/f of the table: the largest
  # collective there may be. The whole table would be V x D x 4 in one collective.
  ar = s.collective("all-reduce")
  block = V * D // f * F32
  assert ar.bytes == 4 + (block if d > 1 else 0)
  data_pairs = sum(b for k, n, b in s.groups if k == "all-reduce" and n == 2)
  assert data_pairs == (2 * (d - 1) / d * block if d > 1 else 0)
  assert s.collective("reduce-scatter").count == 0
  assert s.collective("collective-permute").count == 0


def test_llama_step_moves_no_table():
  # The whole llama step (sgd, fsdp=4 x data=2): the lookup's traffic is as above, and no
  # collective kind carries the embedding table or its whole gradient.
  V = 16384  # 4 MiB of float32 table; the unembedding is as large, split by vocabulary
  d, f = 2, 4
  table = V * D * F32
  cfg = llama.model_config("llama-tiny", T, layers=1, d_model=D, heads=4, kv_heads=2,
                           d_mlp=128, vocab=V)
  mesh = fs.make_mesh(f"data={d},fsdp={f}")
  opt = optax.sgd(0.1)
  axes = llama.logical_axes(cfg)
  state = fs.init_state(lambda k: llama.init_params(cfg, k), opt, mesh=mesh,
                        rules=llama.RULES, logical_axes=axes, key=jax.random.key(0),
                        abstract=True)
  batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("inputs", "targets")}
  step = fs.shard_step(fs.train_step(llama.loss_fn, opt), mesh, rules=llama.RULES,
                       logical_axes=axes)
  s = hlo.summarize(step.compile(state, batch).compiled.as_text())
  a2a = s.collective("all-to-all")
  assert (a2a.count, a2a.bytes) == (2, 2 * B // (d * f) * T * D * F32)
  # Everything else is small here: the block weights (36,864 float32 = 144 KiB) gathered
  # forward and backward and their gradients reduced, ids, the hidden states the
  # vocab-parallel loss gathers over fsdp ([B / d, T, D] float32 = 64 KiB) and per-token loss
  # statistics: under 512 KiB per kind. Over "data" the embedding's and the unembedding's
  # own fsdp blocks (table / f each) are all-reduced, as any param replicated over "data".
  other = 512 * 1024
  assert s.collective("all-gather").bytes < other
  assert s.collective("reduce-scatter").bytes < other
  assert s.collective("all-reduce").bytes < 2 * table // f + other


@pytest.mark.parametrize("mesh_spec, model, ids, a2a", [
    # The MoE rules split d over fsdp and expert, which both split the rows: the ids of all
    # 8 devices' rows gathered, int32 [B, T]; one all-to-all each way of this device's
    # [B / 8, T, D].
    ("fsdp=2,expert=4", "moe", B * T * I32, 2 * B // 8 * T * D * F32),
    # Llama's split d over fsdp (rows) and context (the sequence): the rows gathered over
    # fsdp ([B, T / 4]), then the sequence over context ([B, T]); the all-to-all over
    # context gives [B, T / 4, D / 2], the one over fsdp [B / 2, T / 4, D]; both each way.
    ("fsdp=2,context=4", "llama", B * T // 4 * I32 + B * T * I32,
     2 * 2 * B * T // 4 * D // 2 * F32),
    # d split the other way round (context major): the same ids and activations move.
    ("fsdp=2,context=4", "context-major", B * T // 4 * I32 + B * T * I32,
     2 * 2 * B * T // 4 * D // 2 * F32),
])
def test_lookup_over_every_column_axis_moves_ids_not_the_table(mesh_spec, model, ids, a2a):
  # The table split as the model's rules split it, over every FSDP-like axis: value and
  # gradient as table[tokens] on one device; only ids and activations move.
  from recipes.lm import moe  # pylint: disable=import-outside-toplevel
  rules = {"moe": moe.RULES, "llama": llama.RULES,
           "context-major": (("embed", ("context", "fsdp")),) + llama.RULES}[model]
  V = 512
  table = jax.random.normal(jax.random.key(0), (V, D))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
  cot = jax.random.normal(jax.random.key(2), (B, T, D))
  loss = lambda t, x, r=None: jnp.sum(embedding.lookup(t, x, gpt.RULES if r is None else r) * cot)
  want = jax.value_and_grad(lambda t: jnp.sum(t[tokens] * cot))(table)
  mesh = fs.make_mesh(mesh_spec)
  spec = fs.logical_to_spec(("vocab", "embed"), rules, mesh)
  with fs.with_mesh(mesh):
    args = (jax.device_put(table, NamedSharding(mesh, spec)),
            jax.device_put(tokens, fs.batch_sharding(mesh)))
    fn = jax.jit(jax.value_and_grad(lambda t, x: loss(t, x, rules)))
    got = fn(*args)
    s = hlo.summarize(fn.lower(*args).compile().as_text())
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)
  assert s.collective("all-gather").bytes == ids
  assert s.collective("all-to-all").bytes == a2a
  assert s.collective("all-reduce").bytes <= 8  # the loss; never the table's gradient


def test_a_vocabulary_split_over_a_token_axis_still_looks_up_each_token():
  # Rules that split the vocabulary over "data", which also splits the rows: the blocks of
  # different devices hold different tokens, so they are never summed over it; the values
  # and gradients stay table[tokens]'s.
  rules = (("vocab", "data"),) + llama.RULES
  mesh = fs.make_mesh("data=2,fsdp=4")
  table = jax.random.normal(jax.random.key(0), (512, D))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 512)
  cot = jax.random.normal(jax.random.key(2), (B, T, D))
  spec = fs.logical_to_spec(("vocab", "embed"), rules, mesh)
  assert spec == P("data", "fsdp")
  with fs.with_mesh(mesh):
    loss = lambda t, x: jnp.sum(embedding.lookup(t, x, rules) * cot)
    got = jax.jit(jax.value_and_grad(loss))(jax.device_put(table, NamedSharding(mesh, spec)),
                                            jax.device_put(tokens, fs.batch_sharding(mesh)))
  want = jax.value_and_grad(lambda t: jnp.sum(t[tokens] * cot))(table)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)
