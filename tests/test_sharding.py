"""Logical rules, auto-FSDP, optimizer-state shardings, batch shardings and the report."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fnscale as fs
from fnscale import _sharding as fsh
from fnscale import _state as fst

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
  n = math.prod(shape)
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names),
                       devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def dp_fsdp():
  return _mesh((2, 4), ("data", "fsdp"))


@pytest.fixture(scope="module")
def three_d():
  return _mesh((2, 2, 2), ("data", "fsdp", "tensor"))


RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
         ("mlp", "fsdp"), ("heads", "tensor"), ("vocab", "tensor"), ("vocab", "fsdp"))


# ------------------------------------------------------------------------- logical_to_spec


def test_first_usable_rule_wins(three_d, dp_fsdp):
  # Both "mlp" rules are usable on the 3-D mesh: the first one wins.
  assert fsh.logical_to_spec(("embed", "mlp"), RULES, three_d) == P("fsdp", "tensor")
  # Without a tensor axis the first "mlp" rule is skipped and the second applies, but fsdp
  # already shards "embed", so "mlp" is replicated: one axis never serves two dims.
  assert fsh.logical_to_spec(("embed", "mlp"), RULES, dp_fsdp) == P("fsdp", None)
  # Rule order, not dimension order, decides who gets fsdp: the "embed" rule comes first.
  assert fsh.logical_to_spec(("mlp", "embed"), RULES, dp_fsdp) == P(None, "fsdp")
  assert fsh.logical_to_spec(("mlp",), RULES, dp_fsdp) == P("fsdp")


def test_multi_axis_rule_and_partially_absent_axes(dp_fsdp):
  assert fsh.logical_to_spec(("batch", None), RULES, dp_fsdp) == P(("data", "fsdp"), None)
  rules = (("batch", ("data", "tensor")), ("batch", "data"))
  # ("data", "tensor") names an axis absent from the mesh: skipped as a whole.
  assert fsh.logical_to_spec(("batch",), rules, dp_fsdp) == P("data")


def test_none_rule_replicates_and_stops_search(dp_fsdp):
  rules = (("embed", None), ("embed", "fsdp"))
  assert fsh.logical_to_spec(("embed",), rules, dp_fsdp) == P(None)
  # Unknown logical names and None entries are replicated.
  assert fsh.logical_to_spec(("layers", None), RULES, dp_fsdp) == P(None, None)


def test_axis_never_reused_falls_through_to_next_rule(dp_fsdp):
  rules = (("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "data"))
  assert fsh.logical_to_spec(("embed", "mlp"), rules, dp_fsdp) == P("fsdp", "data")
  assert fsh.logical_to_spec(("mlp", "embed"), rules, dp_fsdp) == P("data", "fsdp")
  # No alternative: the second dim is replicated and the layout says why.
  layout = fs.sharding_layout({"w": jnp.zeros((8, 8))}, dp_fsdp, rules[:2],
                            logical_axes={"w": ("mlp", "embed")})
  (leaf,) = layout.leaves
  assert leaf.spec == P(None, "fsdp")
  assert "dim 0 (mlp) replicated: fsdp already shards dim 1" in leaf.note


def test_the_rule_order_decides_as_in_flax(dp_fsdp):
  # The same two rules in both orders on an ("embed", "mlp") array: the earlier rule claims
  # fsdp (flax.linen.logical_to_mesh_axes gives the same; test_rules_flax compares widely).
  assert fsh.logical_to_spec(("embed", "mlp"), (("mlp", "fsdp"), ("embed", "fsdp")),
                             dp_fsdp) == P(None, "fsdp")
  assert fsh.logical_to_spec(("embed", "mlp"), (("embed", "fsdp"), ("mlp", "fsdp")),
                             dp_fsdp) == P("fsdp", None)
  # A rule to None claims its dimension: a later rule for the name doesn't apply.
  assert fsh.logical_to_spec(("embed",), (("embed", None), ("embed", "fsdp")),
                             dp_fsdp) == P(None)


def test_one_logical_name_on_two_dims_is_an_error(dp_fsdp):
  with pytest.raises(fs.ShardingError) as e:
    fs.shardings({"w": jnp.zeros((8, 8))}, dp_fsdp, (("embed", "fsdp"),),
                 logical_axes={"w": ("embed", "embed")})
  assert str(e.value) == (
      "leaf 'w': logical axes ('embed', 'embed') name 'embed' on two dimensions; a logical "
      "name can label one dimension of an array (as in flax); fix: give the dimensions "
      "distinct names, e.g. ('embed', 'embed_out').")


def test_mapping_rules(dp_fsdp):
  assert fsh.logical_to_spec(("embed", "batch"), {"embed": "fsdp", "batch": "data"},
                            dp_fsdp) == P("fsdp", "data")


def test_size_one_mesh_unchanged():
  mesh = _mesh((1, 1, 1), ("data", "fsdp", "tensor"))
  spec = fsh.logical_to_spec(("embed", "mlp"), RULES, mesh, shape=(6, 10))
  assert spec == P("fsdp", "tensor")
  s = fs.shardings({"w": jnp.ones((6, 10))}, mesh, RULES,
                   logical_axes={"w": ("embed", "mlp")})
  x = jax.device_put(jnp.ones((6, 10)), s["w"])
  assert x.sharding.shard_shape(x.shape) == (6, 10)
  # A mesh with no rule axes at all: everything replicated, same rules.
  mesh1 = _mesh((1,), ("data",))
  assert fsh.logical_to_spec(("embed", "mlp"), RULES, mesh1, shape=(6, 10)) == P(None, None)


def test_explicit_partition_spec_validated(dp_fsdp):
  assert fsh.logical_to_spec(P("fsdp", None), RULES, dp_fsdp, shape=(8, 3)) == P("fsdp", None)
  with pytest.raises(fs.ShardingError, match=r"leaf 'a/w'.*3 entries but the array has rank 2"):
    fsh.logical_to_spec(P("data", "fsdp", None), RULES, dp_fsdp, shape=(8, 8), path="a/w")
  with pytest.raises(fs.ShardingError,
                     match=r"leaf 'a/w'.*mesh axis 'tensor', which is not in the mesh"):
    fsh.logical_to_spec(P("tensor"), RULES, dp_fsdp, shape=(8,), path="a/w")
  with pytest.raises(fs.ShardingError,
                     match=r"leaf 'a/w'.*binds mesh axis 'fsdp' to dimensions 0 and 1"):
    fsh.logical_to_spec(P("fsdp", "fsdp"), RULES, dp_fsdp, shape=(8, 8), path="a/w")
  with pytest.raises(fs.ShardingError, match=r"binds mesh axis 'data' to dimensions 0 and 1"):
    fsh.logical_to_spec(P(("data", "fsdp"), "data"), RULES, dp_fsdp, shape=(8, 8))


def test_same_axis_for_two_dims_in_explicit_leaf_names_path(dp_fsdp):
  params = {"blocks": [{"attn": {"wq": jnp.zeros((8, 8))}}]}
  with pytest.raises(fs.ShardingError,
                     match=r"leaf 'blocks/0/attn/wq'.*mesh axis 'fsdp' to dimensions 0 and 1"):
    fs.shardings(params, dp_fsdp, RULES, logical_axes=[("wq", P("fsdp", "fsdp"))])


def test_bad_rules(dp_fsdp):
  with pytest.raises(fs.ShardingError, match=r"rule 0 \('batch'\) names mesh axis 'data' twice"):
    fsh.logical_to_spec(("batch",), (("batch", ("data", "data")),), dp_fsdp)
  with pytest.raises(fs.ShardingError, match=r"rule 1 is \('embed',\)"):
    fsh.logical_to_spec(("embed",), (("mlp", "fsdp"), ("embed",)), dp_fsdp)
  with pytest.raises(fs.ShardingError, match=r"rule 0 \('embed'\) maps to 3"):
    fsh.logical_to_spec(("embed",), (("embed", 3),), dp_fsdp)


def test_rank_mismatch_and_bad_logical_axes(dp_fsdp):
  with pytest.raises(fs.ShardingError, match=r"leaf 'w'.*3 names but the array has rank 2"):
    fsh.logical_to_spec(("embed", "mlp", None), RULES, dp_fsdp, shape=(4, 4), path="w")
  # Fewer names than the rank: the trailing dimensions unsharded, as Flax and jax read it.
  assert fsh.logical_to_spec(("embed", "mlp"), RULES, dp_fsdp, shape=(4, 4, 4)) == \
      fsh.logical_to_spec(("embed", "mlp", None), RULES, dp_fsdp, shape=(4, 4, 4))
  with pytest.raises(fs.ShardingError, match=r"must be a tuple of names"):
    fsh.logical_to_spec("embed", RULES, dp_fsdp)


def test_indivisible_dimension_message(dp_fsdp):
  with pytest.raises(fs.ShardingError) as e:
    fs.shardings({"emb": jnp.zeros((10, 6))}, dp_fsdp, RULES,
                 logical_axes={"emb": ("embed", None)})
  msg = str(e.value)
  assert "leaf 'emb'" in msg and "dimension 0 has size 10" in msg
  assert "('fsdp',) (fsdp=4 = 4)" in msg and "fix:" in msg


# ------------------------------------------------------------------------- shardings


def test_auto_fsdp_picks_largest_divisible_dim(dp_fsdp):
  params = {
      "a": jax.ShapeDtypeStruct((12, 64), jnp.float32),  # both divisible: 64 is larger
      "b": jax.ShapeDtypeStruct((64, 30), jnp.float32),  # 30 not divisible by 4
      "c": jax.ShapeDtypeStruct((64, 64), jnp.float32),  # tie: the earlier dim
      "d": jax.ShapeDtypeStruct((2, 3, 256), jnp.bfloat16),
  }
  layout = fs.sharding_layout(params, dp_fsdp, min_shard_bytes=0)
  specs = {lp.path: lp.spec for lp in layout.leaves}
  assert specs == {"a": P(None, "fsdp"), "b": P("fsdp", None), "c": P("fsdp", None),
                   "d": P(None, None, "fsdp")}
  assert all(lp.reason == fsh.AUTO_FSDP for lp in layout.leaves)
  assert layout.shardings["a"] == NamedSharding(dp_fsdp, P(None, "fsdp"))
  # fsdp over several axes (ZeRO-3 over all 8 devices).
  s = fs.shardings(params, dp_fsdp, fsdp_axis=("data", "fsdp"), min_shard_bytes=0)
  assert s["a"].spec == P(None, ("data", "fsdp")) and s["b"].spec == P(("data", "fsdp"), None)


def test_small_leaves_replicated_scalars_and_no_fsdp_axis(dp_fsdp):
  params = {"bias": jnp.zeros((64,)), "w": jnp.zeros((64, 64)), "step": jnp.zeros(())}
  layout = fs.sharding_layout(params, dp_fsdp, min_shard_bytes=1024)
  got = {lp.path: (lp.spec, lp.reason) for lp in layout.leaves}
  assert got == {"bias": (P(), fsh.SMALL), "step": (P(), fsh.SCALAR),
                 "w": (P("fsdp", None), fsh.AUTO_FSDP)}
  dp = _mesh((8,), ("data",))
  layout = fs.sharding_layout(params, dp, min_shard_bytes=1024)
  assert {lp.path: lp.reason for lp in layout.leaves}["w"] == fsh.NO_FSDP


def test_indivisible_large_leaf_reported_and_tolerance(dp_fsdp):
  params = {"odd": jnp.zeros((63, 127)), "ok": jnp.zeros((64, 64)), "tiny": jnp.zeros((3,))}
  layout = fs.sharding_layout(params, dp_fsdp, min_shard_bytes=1024, max_replicated_bytes=10**6)
  got = {lp.path: lp.reason for lp in layout.leaves}
  assert got == {"odd": fsh.INDIVISIBLE, "ok": fsh.AUTO_FSDP, "tiny": fsh.SMALL}
  report = fs.sharding_report(params, layout)
  assert "replicated:indivisible" in report
  assert "large leaves replicated because no dimension divides the fsdp size: 1" in report
  nbytes = 63 * 127 * 4
  with pytest.raises(fs.ShardingError) as e:
    fs.shardings(params, dp_fsdp, min_shard_bytes=1024, max_replicated_bytes=nbytes - 1)
  msg = str(e.value)
  assert f"odd (63, 127) ({nbytes} B)" in msg
  assert f"exceeds max_replicated_bytes={nbytes - 1}" in msg and "fsdp size 4" in msg
  # Exactly at the limit is allowed.
  fs.shardings(params, dp_fsdp, min_shard_bytes=1024, max_replicated_bytes=nbytes)


def test_logical_axes_tree_and_patterns_agree(three_d):
  params = {"embed": jnp.zeros((16, 8)),
            "blocks": [{"wi": jnp.zeros((8, 32)), "wo": jnp.zeros((32, 8))} for _ in range(2)],
            "norm": jnp.zeros((8,))}
  tree_axes = {"embed": ("vocab", "embed"),
               "blocks": [{"wi": ("embed", "mlp"), "wo": ("mlp", "embed")}] * 2,
               "norm": None}
  patterns = [(r"^embed$", ("vocab", "embed")), (r"blocks/\d+/wi", ("embed", "mlp")),
              (r"/wo$", ("mlp", "embed")), (r"wo", ("embed", "embed"))]  # last never used
  a = fs.shardings(params, three_d, RULES, logical_axes=tree_axes, min_shard_bytes=0)
  b = fs.shardings(params, three_d, RULES, logical_axes=patterns, min_shard_bytes=0)
  assert a == b
  assert a["embed"].spec == P("tensor", "fsdp")
  assert a["blocks"][1]["wi"].spec == P("fsdp", "tensor")
  assert a["blocks"][0]["wo"].spec == P("tensor", "fsdp")
  assert a["norm"].spec == P("fsdp")  # unmatched: auto-FSDP


def test_bad_logical_axes_inputs(dp_fsdp):
  params = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4,))}
  with pytest.raises(fs.ShardingError, match=r"params' structure.*\['a', 'b'\]"):
    fs.shardings(params, dp_fsdp, RULES, logical_axes={"a": ("embed", None)})
  with pytest.raises(fs.ShardingError, match=r"pattern '\[' is not a valid regular expression"):
    fs.shardings(params, dp_fsdp, RULES, logical_axes=[("[", ("embed", None))])
  with pytest.raises(fs.ShardingError, match=r"leaf 'a' is a str"):
    fs.shardings({"a": "x"}, dp_fsdp)


def test_per_device_bytes_match_placed_arrays(three_d):
  params = {"w": jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8), "b": jnp.ones((8,))}
  layout = fs.sharding_layout(params, three_d, RULES, logical_axes={"w": ("vocab", "embed"),
                                                             "b": None})
  placed = jax.device_put(params, layout.shardings)
  for lp in layout.leaves:
    arr = placed[lp.path]
    shard_bytes = {s.data.nbytes for s in arr.addressable_shards}
    assert shard_bytes == {lp.device_bytes}
    assert lp.global_bytes == arr.nbytes
  np.testing.assert_array_equal(placed["w"], params["w"])


# ------------------------------------------------------------------------- optimizer state


def test_opt_state_follows_params_adamw(dp_fsdp):
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,)), "e": jnp.zeros((8, 64))}
  param_sh = fs.shardings(params, dp_fsdp, RULES, logical_axes={"w": None, "b": None,
                                                                 "e": ("embed", None)},
                          min_shard_bytes=1024)
  opt = optax.adamw(1e-3)
  abstract = jax.eval_shape(opt.init, params)
  sh = fst.opt_state_shardings(opt, abstract, param_sh, dp_fsdp)
  adam = sh[0]
  assert adam.mu == param_sh and adam.nu == param_sh
  assert adam.count.spec == P()
  assert param_sh["w"].spec == P("fsdp", None) and param_sh["b"].spec == P()
  # The shardings are usable as out_shardings: the state is born sharded.
  state = jax.jit(opt.init, out_shardings=sh)(params)
  assert state[0].mu["w"].sharding == param_sh["w"]
  assert state[0].count.sharding.spec == P()


def test_opt_state_structural_fallback(dp_fsdp):
  params = {"w": jnp.zeros((64, 32))}

  def init(p):  # Indexes its params, so optax's placeholder trick can't run it.
    return {"trace": {"w": jnp.zeros_like(p["w"])}, "count": jnp.zeros((), jnp.int32)}

  opt = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  param_sh = fs.shardings(params, dp_fsdp, min_shard_bytes=0)
  sh = fst.opt_state_shardings(opt, init(params), param_sh, dp_fsdp)
  assert sh["trace"] == param_sh and sh["count"].spec == P()


# ------------------------------------------------------------------------- batches


def test_data_axes_and_batch_sharding(three_d):
  assert fs.data_axes(three_d) == ("data", "fsdp")
  assert fs.data_axes(_mesh((4, 2), ("fsdp", "data"))) == ("fsdp", "data")
  assert fs.data_axes(_mesh((8,), ("tensor",))) == ()
  assert fs.batch_sharding(three_d) == NamedSharding(three_d, P(("data", "fsdp")))
  assert fs.batch_sharding(three_d, axes="data").spec == P("data")
  assert fs.batch_sharding(_mesh((8,), ("tensor",))).spec == P()
  with pytest.raises(fs.ShardingError, match=r"batch axis 'pipe' is not in the mesh"):
    fs.batch_sharding(three_d, axes=("data", "pipe"))


def test_check_batch(three_d):
  s = fs.batch_sharding(three_d)
  fsh.check_batch({"x": np.zeros((8, 3)), "y": np.zeros((4,))}, s)
  with pytest.raises(fs.ShardingError) as e:
    fsh.check_batch({"x": np.zeros((8, 3)), "y": np.zeros((6,))}, s)
  msg = str(e.value)
  assert msg.startswith("batch not divisible by the data axes: leaf 'y'")
  assert "size 6" in msg and "('data', 'fsdp') (data=2 x fsdp=2) split it 4 ways" in msg
  with pytest.raises(fs.ShardingError, match=r"batch leaf 'z' has shape \(\) .* rank >= 1"):
    fsh.check_batch({"z": np.float32(1.0)}, s)


def test_check_shardings(dp_fsdp):
  sh = {"w": NamedSharding(dp_fsdp, P("fsdp"))}
  fsh.check_shardings({"w": jnp.zeros((8, 2))}, sh)
  with pytest.raises(fs.ShardingError, match=r"state leaf 'w': dimension 0 has size 6"):
    fsh.check_shardings({"w": jnp.zeros((6, 2))}, sh)
  with pytest.raises(fs.ShardingError, match=r"don't match the state's structure"):
    fsh.check_shardings({"w": jnp.zeros((8, 2)), "v": jnp.zeros(())}, sh)


# ------------------------------------------------------------------------- report


def test_report_contents(three_d):
  params = {"emb": jnp.zeros((16, 8)), "w": jnp.zeros((64, 64)),
            "bias": jnp.zeros((8,), jnp.bfloat16), "odd": jnp.zeros((33, 33))}
  axes = {"emb": ("vocab", "embed"), "w": None, "bias": None, "odd": None}
  layout = fs.sharding_layout(params, three_d, RULES, logical_axes=axes, min_shard_bytes=1024)
  text = fs.sharding_report(params, layout)
  lines = text.splitlines()
  assert lines[0].split() == ["path", "shape", "dtype", "logical", "axes", "spec", "global",
                              "per", "device", "how"]
  row = {ln.split()[0]: ln for ln in lines[2:2 + 4]}
  assert "(vocab, embed)" in row["emb"] and "P('tensor', 'fsdp')" in row["emb"]
  assert "512 B" in row["emb"] and "128 B" in row["emb"] and "rules" in row["emb"]
  assert "P('fsdp', None)" in row["w"] and "16.0 KiB" in row["w"] and "8.0 KiB" in row["w"]
  assert "auto-fsdp" in row["w"]
  assert "bfloat16" in row["bias"] and "replicated:small" in row["bias"]
  assert "replicated:indivisible" in row["odd"]
  total = 16 * 8 * 4 + 64 * 64 * 4 + 8 * 2 + 33 * 33 * 4
  per_dev = 16 * 8 * 4 // 4 + 64 * 64 * 4 // 2 + 8 * 2 + 33 * 33 * 4
  assert sum(lp.global_bytes for lp in layout.leaves) == total
  assert sum(lp.device_bytes for lp in layout.leaves) == per_dev
  assert f"total: {total / 1024:.1f} KiB" in text
  assert f"per device: {per_dev / 1024:.1f} KiB" in text
  assert "replicated: 2 leaves" in text
  # From a plain shardings tree: same specs, reason inferred, logical axes if given.
  text2 = fs.sharding_report(params, layout.shardings, logical_axes=axes)
  assert "(vocab, embed)" in text2 and "sharded" in text2 and "replicated" in text2
  assert f"per device: {per_dev / 1024:.1f} KiB" in text2


def test_replica_axis_is_data_like():
  mesh = _mesh((2, 4), ("replica", "fsdp"))
  assert fs.data_axes(mesh) == ("replica", "fsdp")
  assert fs.batch_sharding(mesh).spec == P(("replica", "fsdp"))


def test_report_names_the_mesh(dp_fsdp):
  text = fs.sharding_report({"w": jnp.zeros((8, 8))}, fs.sharding_layout({"w": jnp.zeros((8, 8))},
                                                                     dp_fsdp))
  assert "mesh: data=2 fsdp=4 (8 devices)" in text


@pytest.mark.tpu
def test_shardings_on_a_tpu_topology_compile(tpu_devices):
  """Shardings for a TPU mesh built on this CPU machine compile into a TPU executable."""
  mesh = jax.sharding.Mesh(np.array(tpu_devices("v5e:2x2")).reshape(2, 2), ("data", "fsdp"),
                           axis_types=(AUTO, AUTO))
  params = {"w": jax.ShapeDtypeStruct((256, 128), jnp.float32),
            "b": jax.ShapeDtypeStruct((128,), jnp.float32)}
  layout = fs.sharding_layout(params, mesh, min_shard_bytes=1024)
  assert layout.shardings["w"].spec == P("fsdp", None) and layout.shardings["b"].spec == P()
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, layout.shardings)
  compiled = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p),
                     out_shardings=layout.shardings).trace(abstract).lower().compile()
  mem = compiled.memory_analysis()
  # One device holds half of w (fsdp=2) and all of b, for the argument.
  assert mem.argument_size_in_bytes == 256 * 128 * 4 // 2 + 128 * 4


def test_constrain_batch_pins_activations_to_data_axes():
  mesh = fs.make_mesh("data=2,fsdp=2,tensor=2")
  x = jnp.ones((8, 4, 16))
  assert fs.constrain_batch(x) is x  # no ambient mesh: identity

  @jax.jit
  def f(x, w):
    return fs.constrain_batch(x @ w)

  w = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("fsdp", "tensor")))
  with fs.with_mesh(mesh):
    text = f.lower(x, w).as_text()
    out = f(x, w)
  assert "sharding_constraint" in text
  assert out.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(out, np.full((8, 4, 16), 16.0))

  # Inside shard_map the manual data axes are left alone.
  def per_shard(x):
    return fs.constrain_batch(x) * 2
  with fs.with_mesh(mesh):
    y = jax.shard_map(per_shard, mesh=mesh, in_specs=P(("data", "fsdp")),
                      out_specs=P(("data", "fsdp")), axis_names={"data", "fsdp"})(x)
  np.testing.assert_allclose(y, 2 * np.ones((8, 4, 16)))


# ------------------------------------------------------------------------- replicated leaves

BIG = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}  # 64 MiB, never allocated
BIG_BYTES = 4096 * 4096 * 4


def _fsdp8():
  return _mesh((8,), ("fsdp",))


def test_rule_with_a_mistyped_axis_is_refused_with_the_closest_name():
  with pytest.raises(fs.ShardingError) as e:
    fs.sharding_layout(BIG, _fsdp8(), (("embed", "fsdp_"),),
                       logical_axes={"w": ("embed", "mlp")}, max_replicated_bytes=1 << 20)
  assert str(e.value).startswith(
      "rule 0 ('embed', ('fsdp_',)) names mesh axis 'fsdp_', which the mesh (axes "
      "('fsdp',)) doesn't have and no axis convention gives a meaning; did you mean 'fsdp'?")


def test_rule_naming_a_conventional_axis_the_mesh_lacks_is_said_once(caplog):
  # "tensor" on an fsdp-only mesh: rules written for several meshes, not a typo.
  rules = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"))
  with caplog.at_level("INFO"):
    layout = fs.sharding_layout(BIG, _fsdp8(), rules, logical_axes={"w": ("embed", "mlp")})
  assert layout.leaves[0].spec == P("fsdp", None)
  said = [r for r in caplog.records if "axes ['tensor'] are skipped" in r.getMessage()]
  assert len(said) == 1 and said[0].levelname == "INFO"


def test_unmapped_logical_name_is_logged_without_a_limit(caplog):
  with caplog.at_level("WARNING"):
    layout = fs.sharding_layout(BIG, _fsdp8(), (("embed", "fsdp"),),
                              logical_axes={"w": ("mlp", "heads")})
  assert layout.leaves[0].spec == P(None, None)
  assert (f"1 leaves ({BIG_BYTES} bytes) stay replicated on every device: w (4096, 4096) "
          f"({BIG_BYTES} B) [dim 0 (mlp) replicated: no rule names 'mlp'; dim 1 (heads) "
          "replicated: no rule names 'heads']") in caplog.text


@pytest.mark.parametrize("names, shape, warned", [
    (("data",), (8,), False), (("replica", "data"), (2, 4), False),
    (("data", "fsdp"), (4, 2), True), (("data", "tensor"), (4, 2), True)])
def test_replicated_params_are_warned_only_where_an_axis_could_shard_them(caplog, names, shape,
                                                                         warned):
  """gpt-style rules on a data-parallel mesh: every param replicated, by design, so silent;
  with an fsdp or tensor axis the same leaf ('embed' over fsdp, 'mlp' over tensor, neither
  usable for a 'vocab' x 'heads' leaf) is a likely mistake and is logged."""
  rules = (("embed", "fsdp"), ("mlp", "tensor"))
  with caplog.at_level("WARNING"):
    fs.sharding_layout(BIG, _mesh(shape, names), rules, logical_axes={"w": ("vocab", "heads")})
  assert ("stay replicated on every device: w (4096, 4096)" in caplog.text) == warned


@pytest.mark.parametrize("axes, rules, warned", [
    # rules written for several meshes: "mlp" -> tensor, absent here; deliberate, silent
    (("layers", "mlp"), (("embed", "fsdp"), ("mlp", "tensor")), False),
    # no rule names any of its dims: likely forgotten rules
    (("layers", "hidden"), (("embed", "fsdp"), ("mlp", "tensor")), True)])
def test_replicated_leaf_is_logged_only_when_it_looks_like_a_mistake(caplog, axes, rules,
                                                                      warned):
  with caplog.at_level("WARNING"):
    layout = fs.sharding_layout(BIG, _fsdp8(), rules, logical_axes={"w": axes})
  assert layout.leaves[0].spec == P(None, None)
  logged = [r.getMessage() for r in caplog.records]
  assert logged == ([f"1 leaves ({BIG_BYTES} bytes) stay replicated on every device: w (4096, "
                     f"4096) ({BIG_BYTES} B) [dim 0 (layers) replicated: no rule names "
                     "'layers'; dim 1 (hidden) replicated: no rule names 'hidden']"]
                    if warned else [])


def test_two_devices_are_enough_to_count_a_replicated_leaf():
  with pytest.raises(fs.ShardingError, match=r"^1 leaves \(67108864 bytes\) stay replicated"):
    fs.sharding_layout(BIG, _mesh((2,), ("fsdp",)), logical_axes={"w": ("mlp", "heads")},
                       max_replicated_bytes=0)
  # One device: nothing is replicated across devices, so nothing counts.
  fs.sharding_layout(BIG, _mesh((1,), ("fsdp",)), logical_axes={"w": ("mlp", "heads")},
                     max_replicated_bytes=0)


def test_fsdp_axis_not_in_the_mesh_is_an_error():
  with pytest.raises(fs.ShardingError, match=re.escape(
      "fsdp_axis 'zero' names 'zero', which is not an axis of the mesh (axes ('fsdp',)); "
      "automatic leaves would silently stay replicated; fix: name a mesh axis (e.g. "
      "fsdp_axis='fsdp') or pass None to replicate them on purpose.")):
    fs.sharding_layout(BIG, _fsdp8(), fsdp_axis="zero", max_replicated_bytes=1 << 20)
  # The conventional name on a mesh without it is a choice (data parallel), counted.
  with pytest.raises(fs.ShardingError, match=r"w \(4096, 4096\) \(67108864 B\) \[no logical "
                     r"axes and no fsdp axis in the mesh\]"):
    fs.sharding_layout(BIG, _mesh((8,), ("data",)), max_replicated_bytes=1 << 20)
  assert fs.sharding_layout(BIG, _mesh((8,), ("data",))).leaves[0].reason == fsh.NO_FSDP


def test_malformed_rules_fail_even_when_no_leaf_uses_them():
  with pytest.raises(fs.ShardingError, match=re.escape(
      "rule 0 is 'embed', expected (logical_name, mesh_axis | (mesh_axes...) | None)")):
    fs.shardings(BIG, _fsdp8(), rules=("embed",))
  with pytest.raises(fs.ShardingError, match=re.escape("rule 1 ('mlp') maps to 3")):
    fs.shardings(BIG, _fsdp8(), rules=(("embed", "fsdp"), ("mlp", 3)))


def test_every_replicated_leaf_counts_against_the_limit(caplog):
  mesh = _fsdp8()
  tree = {"explicit": jax.ShapeDtypeStruct((64, 64), jnp.float32),   # 16 KiB, P()
          "none_rule": jax.ShapeDtypeStruct((64, 64), jnp.float32),  # ("vocab", None)
          "odd": jax.ShapeDtypeStruct((63, 65), jnp.float32),        # indivisible
          "small": jax.ShapeDtypeStruct((4,), jnp.float32)}          # under min_shard_bytes
  axes = {"explicit": P(), "none_rule": ("vocab", None), "odd": None, "small": None}
  total = 2 * 64 * 64 * 4 + 63 * 65 * 4
  kw = dict(logical_axes=axes, min_shard_bytes=1024)
  fs.sharding_layout(tree, mesh, (("vocab", None),), max_replicated_bytes=total, **kw)
  with pytest.raises(fs.ShardingError, match=re.escape(f"3 leaves ({total} bytes)")) as e:
    fs.sharding_layout(tree, mesh, (("vocab", None),), max_replicated_bytes=total - 1, **kw)
  assert "explicit (64, 64) (16384 B) [its PartitionSpec P() replicates it]" in str(
      e.value)
  assert "none_rule (64, 64) (16384 B) [its logical axes ('vocab', None) map to no mesh axis]" in (
      str(e.value))
  assert "small" not in str(e.value)
  # The leaves are listed in flattening order, comma-separated.
  assert ("replicated on every device: explicit (64, 64) (16384 B) [its PartitionSpec P() "
          "replicates it], none_rule (64, 64) (16384 B) [its logical axes ('vocab', None) map "
          "to no mesh axis], odd (63, 65) (16380 B) [no dimension divisible by the fsdp size "
          "8]; that exceeds") in str(e.value)
  # A rule mapping to None is deliberate: no warning for it, only for the indivisible leaf.
  caplog.clear()
  with caplog.at_level("WARNING"):
    fs.sharding_layout(tree, mesh, (("vocab", None),), **kw)
  assert "odd (63, 65)" in caplog.text and "none_rule" not in caplog.text


# ------------------------------------------------------------------------- batch checks in full


def test_check_batch_messages_in_full(three_d):
  s = fs.batch_sharding(three_d)  # batch dim over data x fsdp = 4 ways
  with pytest.raises(fs.ShardingError) as e:
    fsh.check_batch({"x": np.zeros((6, 3))}, s)
  assert str(e.value) == (
      "batch not divisible by the data axes: leaf 'x' dimension 0 has size 6, but mesh axes "
      "('data', 'fsdp') (data=2 x fsdp=2) split it 4 ways; fix: use a batch size that is a "
      "multiple of 4.")
  with pytest.raises(fs.ShardingError) as e:
    fsh.check_batch({"z": np.float32(1.0)}, s)
  assert str(e.value) == (
      "batch leaf 'z' has shape () but its sharding P(('data', 'fsdp'),) needs rank >= 1; "
      "fix: give every batch leaf a leading batch dimension.")
  # A spec as long as the rank fits; one entry per dim is all it needs.
  fsh.check_batch({"x": np.zeros((4,))}, s)
  s2 = NamedSharding(three_d, P("data", "tensor"))
  fsh.check_batch({"x": np.zeros((2, 2))}, s2)
  with pytest.raises(fs.ShardingError, match=r"leaf 'x' dimension 1 has size 3, but mesh axes "
                     r"\('tensor',\) \(tensor=2\) split it 2 ways"):
    fsh.check_batch({"x": np.zeros((2, 3))}, s2)


def test_check_batch_skips_non_named_shardings_only(three_d):
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  named = fs.batch_sharding(three_d)
  # A single-device leaf has nothing to divide; the next leaf is still checked.
  fsh.check_batch({"a": np.zeros((3,)), "b": np.zeros((8,))}, {"a": one, "b": named})
  with pytest.raises(fs.ShardingError, match=r"leaf 'b' dimension 0 has size 6"):
    fsh.check_batch({"a": np.zeros((3,)), "b": np.zeros((6,))}, {"a": one, "b": named})


def test_check_batch_structure_mismatch_names_the_batch(three_d):
  s = fs.batch_sharding(three_d)
  with pytest.raises(fs.ShardingError, match=r"^the batch shardings don't match the batch's "
                     r"structure \("):
    fsh.check_batch({"x": np.zeros((8,)), "y": np.zeros((8,))}, {"x": s})


def test_check_shardings_names_what_and_skips_non_named(dp_fsdp):
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  sh = {"a": one, "w": NamedSharding(dp_fsdp, P("fsdp"))}
  with pytest.raises(fs.ShardingError) as e:
    fsh.check_shardings({"a": jnp.zeros((3,)), "w": jnp.zeros((6, 2))}, sh, what="params")
  assert str(e.value) == (
      "params leaf 'w': dimension 0 has size 6, not divisible by mesh axes ('fsdp',) "
      "(fsdp=4 = 4); fix: choose mesh axis sizes that divide 6, pad the dimension, or map "
      "its logical name to other axes (or None).")
  fsh.check_shardings({"a": jnp.zeros((3,)), "w": jnp.zeros((8, 2))}, sh)


# ------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("call,message", [
    (lambda m: fs.shardings({"w": jnp.zeros((8,))}, m, fsdp_axis=3),
     "fsdp_axis is an int (3), expected a mesh axis name, a tuple of names or None; fix: e.g. "
     "'fsdp' or ('data', 'fsdp')."),
    (lambda m: fs.shardings({"w": jnp.zeros((8,))}, m, min_shard_bytes=-1),
     "min_shard_bytes=-1 (int), expected an int >= 0."),
    (lambda m: fs.shardings({"w": jnp.zeros((8,))}, m, max_replicated_bytes=-1),
     "max_replicated_bytes=-1 (int), expected an int >= 0 or None."),
    (lambda m: fs.shardings({"w": jnp.zeros((8,))}, m, rules="embed"),
     "rules is a str ('embed'), expected a sequence of (logical_name, mesh_axes) pairs or a "
     "mapping; fix: e.g. (('embed', 'fsdp'), ('mlp', 'tensor'))."),
    (lambda m: fs.batch_sharding(m, axes=3),
     "axes is an int (3), expected a mesh axis name, a tuple of names or None; fix: e.g. "
     "'fsdp' or ('data', 'fsdp')."),
    (lambda m: fs.constrain_batch(jnp.zeros((8,)), axes=3),
     "axes is an int (3), expected a mesh axis name, a tuple of names or None; fix: e.g. "
     "'fsdp' or ('data', 'fsdp')."),
    (lambda m: fs.batch_sharding(m, axes=["data", "pipe"]),
     "batch axis 'pipe' is not in the mesh (axes ('data', 'fsdp')); fix: pass axes that the "
     "mesh has, or None for its data-like axes."),
    (lambda m: fsh.logical_to_spec(("embed", 3), RULES, m, path="w"),
     "leaf 'w': logical axes ('embed', 3) must be a tuple of names (str or None), one per "
     "dimension, or a PartitionSpec; fix: e.g. ('embed', 'mlp')."),
    (lambda m: fsh.logical_to_spec(("embed", None, None), RULES, m, shape=(8, 8)),
     "array: logical axes ('embed', None, None) have 3 names but the array has rank 2 (shape "
     "(8, 8)); fix: give at most one name (or None) per dimension."),
    (lambda m: fsh.logical_to_spec(("embed",), (("embed", ["fsdp", "fsdp"]),), m),
     "rule 0 ('embed') names mesh axis 'fsdp' twice in ('fsdp', 'fsdp'); a mesh axis can "
     "split one dimension only once; fix: list each axis once."),
    (lambda m: fsh.logical_to_spec(P("tensor"), RULES, m),
     "array: PartitionSpec P('tensor',) names mesh axis 'tensor', which is not in the mesh "
     "(axes ('data', 'fsdp')); fix: use only the mesh's axes or build the mesh with an axis "
     "'tensor'."),
    (lambda m: fsh.logical_to_spec(P("fsdp", None, None), RULES, m, shape=(8, 8)),
     "array: PartitionSpec P('fsdp', None, None) has 3 entries but the array has rank 2 "
     "(shape (8, 8)); fix: give at most one entry per dimension."),
    (lambda m: fsh.logical_to_spec(P("fsdp", "fsdp"), RULES, m, path="w"),
     "leaf 'w': PartitionSpec P('fsdp', 'fsdp') binds mesh axis 'fsdp' to dimensions 0 and 1; "
     "a mesh axis can shard only one dimension of an array; fix: use 'fsdp' once (e.g. "
     "replace one entry with None or another axis)."),
    (lambda m: fs.shardings({"a": object()}, m),
     "leaf 'a' is a object, expected an array or jax.ShapeDtypeStruct; fix: pass arrays (or "
     "jax.eval_shape(...) output) as leaves."),
    (lambda m: fs.shardings({"a": jnp.zeros((4,))}, m, logical_axes=[("(", ("embed",))]),
     "logical_axes pattern '(' is not a valid regular expression (missing ), unterminated "
     "subpattern at position 0); fix: escape special characters, e.g. "
     "r'blocks/\\d+/attn/wq'."),
])
def test_error_messages_in_full(dp_fsdp, call, message):
  with pytest.raises(fs.ShardingError) as e:
    call(dp_fsdp)
  assert str(e.value) == message


def test_pairs_with_non_name_axes_are_not_patterns(dp_fsdp):
  # [("a", (1, 2))] is not a (path_regex, names) list (1 and 2 aren't names), so it is taken
  # as a pytree, which doesn't match the params.
  with pytest.raises(fs.ShardingError, match=r"^logical_axes must be a pytree with the "
                     r"params' structure .*params leaf paths: \['a'\]\.$"):
    fs.shardings({"a": jnp.zeros((4,))}, dp_fsdp, logical_axes=[("a", (1, 2))])
  # Patterns whose names hold None are patterns.
  s = fs.shardings({"a": jnp.zeros((4, 4))}, dp_fsdp, RULES,
                   logical_axes=[("a", (None, "embed"))])
  assert s["a"].spec == P(None, "fsdp")


def test_tree_mismatch_message_lists_eight_leaf_paths(dp_fsdp):
  params = {f"p{i}": jnp.zeros((4,)) for i in range(9)}
  with pytest.raises(fs.ShardingError) as e:
    fs.shardings(params, dp_fsdp, logical_axes={"p0": None})
  msg = str(e.value)
  assert msg.startswith("logical_axes must be a pytree with the params' structure (a tuple of "
                        "names or None per leaf) or a sequence of (path_regex, names) pairs; "
                        "the tree didn't match: ")
  assert msg.endswith("; params leaf paths: ['p0', 'p1', 'p2', 'p3', 'p4', 'p5', 'p6', 'p7'] "
                      "....")
  # Eight leaves: all listed, nothing left out.
  del params["p8"]
  with pytest.raises(fs.ShardingError) as e:
    fs.shardings(params, dp_fsdp, logical_axes={"p0": None})
  assert str(e.value).endswith("'p5', 'p6', 'p7'].")


def test_automatic_leaves_carry_no_note(dp_fsdp):
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((4,))}
  layout = fs.sharding_layout(params, dp_fsdp, min_shard_bytes=1024)
  assert [(lp.reason, lp.note) for lp in layout.leaves] == [(fsh.SMALL, ""), (fsh.AUTO_FSDP, "")]
  # The report shows a note in parentheses after the reason; none here.
  assert "auto-fsdp (" not in fs.sharding_report(params, layout)


def test_rule_forms(dp_fsdp):
  assert fsh.normalize_rules(None) == ()
  assert fsh.normalize_rules([["embed", ["data", "fsdp"]], ("mlp", None), ("vocab", "fsdp")]) == (
      ("embed", ("data", "fsdp")), ("mlp", ()), ("vocab", ("fsdp",)))
  assert fsh.normalize_rules({"embed": "fsdp"}) == (("embed", ("fsdp",)),)
  # Without a shape, an explicit spec is checked against the mesh only.
  assert fsh.logical_to_spec(P("data", "fsdp", None), RULES, dp_fsdp) == P("data", "fsdp", None)
  assert fsh.logical_to_spec(["embed", None], RULES, dp_fsdp) == P("fsdp", None)


def test_python_scalars_and_lists_of_names_in_plans(dp_fsdp):
  layout = fs.sharding_layout({"lr": 0.5, "flag": True, "w": jnp.zeros((8, 4))}, dp_fsdp, RULES,
                            logical_axes={"lr": None, "flag": (), "w": ["embed", None]})
  got = {lp.path: (lp.shape, lp.dtype, lp.spec, lp.reason) for lp in layout.leaves}
  assert got == {"lr": ((), np.dtype("float64"), P(), fsh.SCALAR),
                 "flag": ((), np.dtype("bool"), P(), fsh.SCALAR),
                 "w": ((8, 4), np.dtype("float32"), P("fsdp", None), fsh.RULES)}
  assert layout.leaves[2].logical_axes == ("embed", None)  # the list, as a tuple


def test_notes_say_why_a_dim_is_replicated(dp_fsdp):
  notes = []
  rules = (("embed", "tensor"), ("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "data"),
           ("heads", "pipe"), ("heads", ("data", "pipe")), ("vocab", "data"))
  spec = fsh.logical_to_spec(("embed", "heads", "layers", "mlp", "vocab"), rules, dp_fsdp,
                             _notes=notes)
  assert spec == P("fsdp", None, None, "data", None)
  assert notes == [
      "dim 1 (heads) replicated: its rules name mesh axes ['pipe', 'pipe'] that the mesh "
      "doesn't have",
      "dim 2 (layers) replicated: no rule names 'layers'",
      "dim 4 (vocab) replicated: data already shards dim 3"]


def test_auto_fsdp_boundaries(dp_fsdp):
  # Exactly min_shard_bytes is sharded; one byte less stays replicated.
  assert fsh.auto_spec((16, 4), np.float32, {"fsdp": 4}, ("fsdp",), 256) == (
      P("fsdp", None), fsh.AUTO_FSDP)
  assert fsh.auto_spec((16, 4), np.float32, {"fsdp": 4}, ("fsdp",), 257) == (P(), fsh.SMALL)
  # Only the fsdp axes present in the mesh count: data x fsdp = 8 here, so 4 doesn't qualify.
  assert fsh.auto_spec((4, 8), np.float32, {"data": 2, "fsdp": 4}, ("data", "fsdp", "pipe"),
                       0) == (P(None, ("data", "fsdp")), fsh.AUTO_FSDP)
  assert fsh.auto_spec((8, 3), np.float32, {"fsdp": 1}, ("fsdp",), 0) == (P(), fsh.NO_FSDP)
  assert fsh.auto_spec((8, 3), np.float32, {"fsdp": 2}, (), 0) == (P(), fsh.NO_FSDP)
  assert fsh.auto_spec((3, 5), np.float32, {"fsdp": 2}, ("fsdp",), 0) == (P(), fsh.INDIVISIBLE)
  # The later of two divisible dims wins only when strictly larger.
  assert fsh.auto_spec((4, 12, 12), np.float32, {"fsdp": 4}, ("fsdp",), 0) == (
      P(None, "fsdp", None), fsh.AUTO_FSDP)


def test_layout_of_reports_given_shardings(dp_fsdp):
  tree = {"a": jnp.zeros((8, 2)), "b": jnp.zeros((3,)), "c": jnp.zeros((4,))}
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shs = {"a": NamedSharding(dp_fsdp, P("fsdp")), "b": NamedSharding(dp_fsdp, P()), "c": one}
  layout = fsh.layout_of(tree, shs, logical_axes={"a": ("embed", None), "b": None, "c": None})
  got = {lp.path: (lp.spec, lp.global_bytes, lp.device_bytes, lp.reason, lp.logical_axes)
         for lp in layout.leaves}
  assert got == {"a": (P("fsdp"), 64, 16, "sharded", ("embed", None)),
                 "b": (P(), 12, 12, "replicated", None),
                 "c": (P(), 16, 16, "replicated", None)}
  assert [(lp.shape, lp.dtype) for lp in layout.leaves] == [((8, 2), np.dtype("float32")),
                                                          ((3,), np.dtype("float32")),
                                                          ((4,), np.dtype("float32"))]
  assert layout.mesh is dp_fsdp and layout.shardings == shs
  assert fsh.layout_of({"c": jnp.zeros((4,))}, one).mesh is None


def test_one_device_mesh_counts_nothing_as_replicated():
  mesh = _mesh((1,), ("fsdp",))
  layout = fs.sharding_layout(BIG, mesh, max_replicated_bytes=0)
  assert layout.leaves[0].device_bytes == layout.leaves[0].global_bytes == BIG_BYTES
  # With 8 devices the same leaf (here unshardable: fsdp_axis=None) is counted.
  with pytest.raises(fs.ShardingError, match=r"^1 leaves \(67108864 bytes\) stay replicated"):
    fs.sharding_layout(BIG, _fsdp8(), fsdp_axis=None, max_replicated_bytes=0)


def test_constrain_batch_with_explicit_axes_reshards():
  mesh = fs.make_mesh("data=2,fsdp=2,tensor=2", axis_types="explicit")
  x = jax.device_put(jnp.ones((8, 4, 16)), NamedSharding(mesh, P(None, "fsdp", "tensor")))
  with fs.with_mesh(mesh):
    y = jax.jit(fs.constrain_batch)(x)
    z = jax.jit(lambda x: fs.constrain_batch(x, axes="data"))(x)
    s = jax.jit(fs.constrain_batch)(jnp.float32(2.0))
  # The batch dim takes data x fsdp; fsdp leaves dim 1, tensor stays on dim 2.
  assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
  assert z.sharding.spec == P("data", "fsdp", "tensor")
  assert s == 2.0
  np.testing.assert_array_equal(y, np.ones((8, 4, 16)))
