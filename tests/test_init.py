"""fs.init_state born sharded, and fs.constrain_batch, against independent references.

Public API only. Expected PartitionSpecs are written by hand from the rules; memory comes from
the arrays' addressable shards and from the compiled init programs themselves; FLOPs from a
hand count of the model's matmuls.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import compiler as jax_compiler  # to read the init programs' memory (test only)
from jax.sharding import PartitionSpec as P

import fnscale as fs

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
         ("vocab", "tensor"))
V, D, F, BIG = 64, 32, 64, 1024


def _init(key):
  ks = jax.random.split(key, 4)
  return {"emb": jax.random.normal(ks[0], (V, D)),
          "w_in": jax.random.normal(ks[1], (D, F)),
          "w_out": jax.random.normal(ks[2], (F, D)),
          "norm": jnp.ones((D,)),
          "big": jax.random.normal(ks[3], (BIG, BIG))}   # 4 MiB


AXES = {"emb": ("vocab", "embed"), "w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"),
        "norm": ("norm",), "big": ("embed", "mlp")}

# By hand from RULES: embed -> fsdp, mlp -> tensor, vocab -> tensor, norm has no rule.
SPECS = {
    "data=2,fsdp=2,tensor=2": {"emb": P("tensor", "fsdp"), "w_in": P("fsdp", "tensor"),
                               "w_out": P("tensor", "fsdp"), "norm": P(),
                               "big": P("fsdp", "tensor")},
    "fsdp=8": {"emb": P(None, "fsdp"), "w_in": P("fsdp", None), "w_out": P(None, "fsdp"),
               "norm": P(), "big": P("fsdp", None)},
}


def _norm(spec, ndim):
  """A PartitionSpec padded with None to `ndim` entries (P("x") == P("x", None))."""
  return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("mesh_spec", sorted(SPECS))
def test_init_state_places_every_leaf_as_the_rules_say(mesh_spec):
  mesh = fs.make_mesh(mesh_spec)
  state = fs.init_state(_init, optax.adam(1e-3), mesh=mesh, rules=RULES, logical_axes=AXES,
                        key=jax.random.key(0))
  adam = state.opt_state[0]
  for name, spec in SPECS[mesh_spec].items():
    for where, leaf in (("params", state.params[name]), ("mu", adam.mu[name]),
                        ("nu", adam.nu[name])):
      assert _norm(leaf.sharding.spec, leaf.ndim) == _norm(spec, leaf.ndim), (name, where)
  assert state.step.sharding.is_fully_replicated and adam.count.sharding.is_fully_replicated
  # The values are those of the same init run on one device.
  ref = jax.device_get(jax.jit(_init)(jax.random.key(0)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               jax.device_get(state.params), ref)


# jax 0.10.2's device_put(x, replicated, may_alias=False) from a one-device array kept x's
# buffer as the device-0 shard, so donating the state deleted the caller's replicated leaves.
def test_init_state_from_concrete_params_copies_them_into_place():
  mesh = fs.make_mesh("fsdp=8")
  host = jax.device_get(jax.jit(_init)(jax.random.key(0)))
  params = jax.tree.map(jnp.asarray, host)  # on one device
  opt = optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh, rules=RULES, logical_axes=AXES)
  for name, spec in SPECS["fsdp=8"].items():
    leaf = state.params[name]
    assert _norm(leaf.sharding.spec, leaf.ndim) == _norm(spec, leaf.ndim), name
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), host)
  # A donating step consumes the state's buffers, not the caller's arrays.
  step = fs.shard_step(fs.train_step(lambda p, b: jnp.sum(p["w_in"] * b["x"]), opt), mesh,
                       rules=RULES, logical_axes=AXES)
  state, _ = step(state, {"x": jnp.ones((8, D, F))})
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), host)


def test_no_device_ever_holds_a_whole_large_leaf(monkeypatch):
  """The init programs' own memory: no output or temporary the size of the 4 MiB leaf."""
  stats = []
  real = jax_compiler.compile_or_get_cached

  def record(*args, **kwargs):
    executable = real(*args, **kwargs)
    stats.append(executable.get_compiled_memory_stats())
    return executable

  monkeypatch.setattr(jax_compiler, "compile_or_get_cached", record)
  mesh = fs.make_mesh("fsdp=8")
  state = fs.init_state(_init, optax.adam(1e-3), mesh=mesh, rules=RULES, logical_axes=AXES,
                        key=jax.random.key(0))
  monkeypatch.undo()
  leaf_bytes = BIG * BIG * 4
  # Each device holds 1/8 of the leaf and of both Adam moments, nothing more.
  for leaf in (state.params["big"], state.opt_state[0].mu["big"], state.opt_state[0].nu["big"]):
    shards = leaf.addressable_shards
    assert len(shards) == 8 and {s.data.nbytes for s in shards} == {leaf_bytes // 8}
  # The programs that built them (params, then the optimizer state) never made the whole leaf
  # on one device: per-device outputs are shards, temporaries stay below one leaf.
  assert stats, "init_state compiled nothing: it did not build the state in a jit program"
  for s in stats:
    assert s.output_size_in_bytes < leaf_bytes, s
    assert s.temp_size_in_bytes < leaf_bytes // 2, s
  big_programs = [s for s in stats if s.output_size_in_bytes >= leaf_bytes // 8]
  assert big_programs  # the params program (and the moments') output a shard of big


# ---------------------------------------------------------------------------- constrain_batch

B, S, H, K, L = 16, 16, 2, 8, 1
CB_AXES = {"emb": ("vocab", "embed"), "w_qkv": ("layers", "embed", None, "heads", "head_dim"),
           "w_out": ("layers", "heads", "head_dim", "embed")}


def _cb_init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"emb": 0.1 * jax.random.normal(k1, (V, 2 * D)),
          "w_qkv": 0.1 * jax.random.normal(k2, (L, 2 * D, 3, H, K)),
          "w_out": 0.1 * jax.random.normal(k3, (L, H, K, 2 * D))}


def _cb_loss(constrain):
  """An attention-only decoder over a `lax.scan` of layers; FSDP shards every d_model."""
  pin = fs.constrain_batch if constrain else (lambda x: x)

  def block(x, p):
    x = pin(x)
    q, k, v = jnp.einsum("bsd,dthk->tbshk", x, p["w_qkv"])
    w = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k), -1)
    return x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", w, v), p["w_out"]), None

  def loss(params, batch):
    x = params["emb"][batch["inputs"]]
    x, _ = jax.lax.scan(block, x, {"w_qkv": params["w_qkv"], "w_out": params["w_out"]})
    logp = jax.nn.log_softmax(jnp.einsum("bsd,vd->bsv", x, params["emb"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))

  return loss


def test_constrain_batch_avoids_n_times_the_attention_work():
  n, d = 8, 2 * D
  mesh = fs.make_mesh(f"fsdp={n}")
  tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, V)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  opt = optax.sgd(0.1)
  per_device = {}
  with fs.with_mesh(mesh):
    state = fs.init_state(_cb_init, opt, mesh=mesh, rules=RULES, logical_axes=CB_AXES,
                          key=jax.random.key(0))
    for constrain in (True, False):
      step = fs.shard_step(fs.train_step(_cb_loss(constrain), opt), mesh, rules=RULES,
                           logical_axes=CB_AXES, donate=False).compile(state, batch)
      per_device[constrain] = fs.compile_report(step, state, batch).matmul_flops
  # Per token, forward: q/k/v 2 d 3HK and output 2 HK d per layer, scores and weighted values
  # 2 * 2 S HK per layer, the tied output layer 2 d V; backward twice that.
  proj = L * (2 * d * 3 * H * K + 2 * H * K * d) + 2 * d * V
  attention = L * 2 * 2 * S * H * K
  model = 3 * B * S * (proj + attention)
  assert per_device[True] == model / n  # every matmul split over the 8 devices
  # Without it GSPMD follows the params' d_model sharding into the scan's carry and every
  # device computes attention for the whole batch (measured: 8x the attention work).
  assert per_device[False] >= model / n + 3 * B * S * attention * (n - 1) / n / 2
