"""Gradient accumulation: when gradients are reduced and what stays sharded is a declared choice.

"once": the microbatch loop runs per shard, params gathered once, a whole-size accumulator,
every leaf's gradient reduced once after the loop (reduce-scattered where the leaf is
split). "per_microbatch": params stay sharded and are gathered inside each microbatch; the
float32 accumulator is sharded as the params are, so each microbatch's gradient is reduced
into it (FSDP's memory). "auto" (the default): "once" where no param is split over a data
axis, or where whole params and accumulator fit the stated share of the device's memory;
else "per_microbatch". Memory and collectives are read from the compiled program
(`fs.analysis.hlo.summarize`, memory analysis) and set against hand counts of the model's
float32 param bytes P.
"""
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import _accumulate
from fnscale import _topology
from fnscale.analysis import hlo
from recipes.bench import accumulation as bench

L = 2
POLICY = "params=float32,compute=bfloat16,output=float32"


def _param_bytes(d, m):
  return L * 2 * d * m * 4  # f32 w1 [d, m] and w2 [m, d] per layer


@functools.lru_cache(maxsize=None)
def _compiled(target, axes, accum, gather, d=256, m=1024, rows=64, policy=POLICY,
              update_norm=None):
  """(CompiledStep, its HLO summary) of the residual MLP's step; target "cpu" or a TPU."""
  devices = None if target == "cpu" else fs.target_devices(target)
  mesh = fs.make_mesh(dict(axes), devices=devices)
  opt = optax.sgd(0.1)
  init = functools.partial(bench.init_mlp, d=d, m=m, layers=L)
  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((rows, d), jnp.float32)}
  kw = {} if gather is None else {"accum_gather": gather}
  step = fs.train_step(bench.mlp_loss, opt, accum_steps=accum, policy=policy,
                       update_norm=update_norm, **kw)
  compiled = fs.shard_step(step, mesh).compile(state, batch)
  return compiled, hlo.summarize(compiled.compiled.as_text())


def _temp(c) -> int:
  return c.compiled.memory_analysis().temp_size_in_bytes


def _sent(summary, kind, group) -> float:
  """Ring bytes sent per device per step by `kind` collectives over groups of `group`."""
  return sum(b for k, n, b in summary.groups if k == kind and n == group)


CASES = [("cpu", (("fsdp", 8),)), ("cpu", (("data", 2), ("fsdp", 4)))]
TPU_CASES = [("v5p-8", (("fsdp", 4),)), ("v5p:2x2x2", (("data", 2), ("fsdp", 4)))]


def _check_per_microbatch_memory(target, axes):
  # per_microbatch keeps FSDP's memory: over accum 1 it adds the float32 accumulator sharded
  # as the params (P / fsdp) and the partitioner's per-microbatch buffers, never a
  # whole-size accumulator (P alone); "once" (and the default) hold whole params and a whole
  # accumulator. Measured: 0.18 P (fsdp=8), 0.3 P (v5p-8), 0.72 P (data=2,fsdp=4).
  p = _param_bytes(256, 1024)
  one, _ = _compiled(target, axes, 1, None)
  four, _ = _compiled(target, axes, 4, "per_microbatch")
  assert _temp(four) - _temp(one) < p, (_temp(four) / p, _temp(one) / p)


def _check_once(target, axes):
  p = _param_bytes(256, 1024)
  sizes = dict(axes)
  n, f, d = sizes.get("data", 1) * sizes["fsdp"], sizes["fsdp"], sizes.get("data", 1)
  once, s = _compiled(target, axes, 4, "once")
  # Whole bfloat16 params and a whole float32 accumulator on every device: 1.5 P at least.
  assert _temp(once) >= 1.5 * p
  # Params gathered once per step (one all-gather per leaf), as whole compute-dtype (or,
  # where XLA moves the cast after the gather, float32) params over the fsdp devices (or
  # every data device: jax 0.10.2's partitioner gathers the shard_map's input over both).
  ag = s.collective("all-gather")
  assert ag.count == 4
  assert ag.bytes_sent in [pytest.approx((g - 1) / g * p / k) for g in (f, n) for k in (1, 2)]
  # Gradients reduce-scattered once over fsdp (float32, (f-1)/f P) and the fsdp shards
  # all-reduced once over data: 2 (d-1)/d P/f. No whole-size all-reduce.
  rs = s.collective("reduce-scatter")
  assert rs.count == 4 and rs.bytes_sent == pytest.approx((f - 1) / f * p)
  other = sum(b for k, g, b in s.groups if k == "all-reduce" and (g != d or d == 1))
  assert other <= 128  # scalars alone (loss, weight, norms): no gradient-size all-reduce
  if d > 1:
    assert _sent(s, "all-reduce", d) == pytest.approx(2 * (d - 1) / d * p / f, abs=64)


def _check_data_axis(target, axes):
  # data=2,fsdp=4: "once" sends the float32 fsdp shard over "data" once, 2 x 1/2 x P/4.
  # per_microbatch's accumulator is sharded as the params, whole over "data": each
  # microbatch's gradient is all-reduced over "data" before its add. Its sum is divided by
  # the weight after the loop, so that all-reduce is only added to the carried sum: libtpu
  # moves it after the loop (the float32 shard once, as "once"; divided in the loop's last
  # microbatch it stayed in every one, 4x); CPU's compiler keeps it in every microbatch:
  # 4 x 2 (d-1)/d x at most the float32 fsdp shard (P/4) and at least the bfloat16 one
  # split 8 ways (XLA may reduce before the cast, over pieces).
  p = _param_bytes(256, 1024)
  _, per = _compiled(target, axes, 4, "per_microbatch")
  _, once = _compiled(target, axes, 4, "once")
  assert _sent(once, "all-reduce", 2) == pytest.approx(2 * 0.5 * p / 4, abs=64)
  if target == "cpu":
    assert 4 * (p / 2 / 8) <= _sent(per, "all-reduce", 2) <= 4 * p / 4 + 64
  else:
    assert _sent(per, "all-reduce", 2) == pytest.approx(2 * 0.5 * p / 4, abs=64)


@functools.lru_cache(maxsize=None)
def _plain_jit(axis_types):
  """HLO summary of the "once" step (accum 4) traced by a plain `jax.jit`, no shard_step."""
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types=axis_types)
  opt = optax.sgd(0.1)
  init = functools.partial(bench.init_mlp, d=256, m=1024, layers=L)
  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=rows)}
  step = fs.train_step(bench.mlp_loss, opt, accum_steps=4, policy=POLICY, accum_gather="once")
  with fs.with_mesh(mesh):
    return hlo.summarize(jax.jit(step).lower(state, batch).compile().as_text())


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_once_in_a_plain_jit_reduce_scatters_where_the_shardings_are_known(axis_types):
  # data=2,fsdp=4, f32 params P. Params gathered once over fsdp either way (bf16 or f32).
  p = _param_bytes(256, 1024)
  s = _plain_jit(axis_types)
  ag = s.collective("all-gather")
  assert ag.count == 4 and ag.bytes_sent in [pytest.approx(3 / 4 * p / k) for k in (1, 2)]
  rs = s.collective("reduce-scatter")
  if axis_types == "auto":
    # The trace knows no param sharding: every whole f32 gradient all-reduced over all 8
    # devices once, 2 x 7/8 x P sent; the update then takes its slice.
    assert rs.count == 0
    assert _sent(s, "all-reduce", 8) == pytest.approx(2 * 7 / 8 * p, abs=64)
  else:
    # Explicit types carry the shardings: as under shard_step, reduce-scattered over fsdp
    # (3/4 P) and the f32 fsdp shards all-reduced over data (2 x 1/2 x P/4).
    assert rs.count == 4 and rs.bytes_sent == pytest.approx(3 / 4 * p)
    assert _sent(s, "all-reduce", 2) == pytest.approx(2 * 0.5 * p / 4, abs=64)
    assert _sent(s, "all-reduce", 8) <= 64  # scalars


@pytest.mark.parametrize("target, axes", CASES)
def test_per_microbatch_keeps_the_accumulator_sharded_cpu(target, axes):
  _check_per_microbatch_memory(target, axes)


@pytest.mark.parametrize("target, axes", CASES)
def test_once_gathers_once_and_reduce_scatters_cpu(target, axes):
  _check_once(target, axes)


@pytest.mark.parametrize("axes", [CASES[1][1], (("fsdp", 4), ("tensor", 2)),
                                  pytest.param(CASES[0][1], marks=pytest.mark.slow)])
def test_default_keeps_fsdp_memory_where_the_device_memory_is_unknown(axes, caplog):
  # CPU (no device memory known), params split over fsdp, 1024 rows (XLA gathers weights):
  # the default's temporaries stay within 1.5x of accum 1's, under the whole bfloat16
  # params and float32 accumulator "once" holds (1.5 P, hand count).
  p = _param_bytes(256, 1024)
  one, _ = _compiled("cpu", axes, 1, None, rows=1024)
  with caplog.at_level("INFO"):  # compiled afresh (not from the cache), so it says its choice
    default, s = _compiled.__wrapped__("cpu", axes, 4, None, rows=1024)
  # The choice is said as what it is: no share of an unknown memory.
  assert "runs 'per_microbatch'" in caplog.text and "memory unknown (CPU)" in caplog.text
  assert _temp(default) <= 1.5 * _temp(one), (_temp(default), _temp(one))
  assert _temp(default) < 1.5 * p
  assert s.collective("all-gather").count == 4 * 4  # each weight in each microbatch


def test_data_axis_reductions_per_mode_cpu():
  _check_data_axis("cpu", (("data", 2), ("fsdp", 4)))


@pytest.mark.tpu
@pytest.mark.parametrize("target, axes", TPU_CASES)
def test_accumulation_modes_on_a_described_tpu(target, axes, tpu_devices):
  del tpu_devices  # skips without libtpu
  _check_per_microbatch_memory(target, axes)
  _check_once(target, axes)
  if "data" in dict(axes):
    _check_data_axis(target, axes)


@pytest.mark.slow
@pytest.mark.tpu
def test_per_microbatch_gathers_params_in_every_microbatch_tpu(tpu_devices):
  # With rows enough that XLA gathers the weights (rather than moving activations),
  # per_microbatch gathers them in every microbatch: accum x the all-gathers of accum 1.
  del tpu_devices
  axes = (("fsdp", 8),)
  _, one = _compiled("v5p:2x2x2", axes, 1, None, 64, 256, 256)
  _, four = _compiled("v5p:2x2x2", axes, 4, "per_microbatch", 64, 256, 256)
  _, once = _compiled("v5p:2x2x2", axes, 4, "once", 64, 256, 256)
  ag1, ag4, ago = (s.collective("all-gather") for s in (one, four, once))
  assert ag1.count > 0 and ag4.count == 4 * ag1.count
  assert ago.count == ag1.count


@pytest.mark.parametrize("mesh_spec, gather", [
    ("data=2,fsdp=4", "once"),
    *(pytest.param(m, g, marks=pytest.mark.slow) for m, g in [
        ("data=2,fsdp=4", "per_microbatch"), ("data=8", "per_microbatch"), ("data=8", "once")]),
])
def test_accumulated_step_equals_full_batch_step(mesh_spec, gather):
  mesh = fs.make_mesh(mesh_spec)
  opt = optax.sgd(0.5)
  init = functools.partial(bench.init_mlp, d=64, m=256, layers=L)
  batch = {"x": jax.random.normal(jax.random.key(3), (64, 64))}
  out = {}
  for accum in (1, 4):
    state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0))
    step = fs.shard_step(fs.train_step(bench.mlp_loss, opt, accum_steps=accum,
                                       accum_gather=gather), mesh)
    state, metrics = step(state, batch)
    out[accum] = (jax.device_get(state.params), float(metrics["loss"]))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
               out[4][0], out[1][0])
  assert out[4][1] == pytest.approx(out[1][1], rel=1e-5)


@pytest.mark.slow
def test_accumulated_step_equals_full_batch_step_in_a_plain_jit():
  # Traced outside shard_step (no param shardings known): the same params.
  mesh = fs.make_mesh("data=2,fsdp=4")
  opt = optax.sgd(0.5)
  init = functools.partial(bench.init_mlp, d=64, m=256, layers=L)
  batch = {"x": jax.random.normal(jax.random.key(3), (64, 64))}
  got = []
  for accum, gather in ((1, "per_microbatch"), (4, "per_microbatch"), (4, "once")):
    state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0))
    step = fs.train_step(bench.mlp_loss, opt, accum_steps=accum, accum_gather=gather)
    with fs.with_mesh(mesh):
      got.append(jax.device_get(jax.jit(step)(state, batch)[0].params))
  for other in got[1:]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
                 other, got[0])


def _attention_loss(params, batch):
  x = batch["x"]
  q = jnp.einsum("bse,ehd->bshd", x, params["wq"].astype(x.dtype))
  y = jnp.einsum("bshd,hde->bse", fs.attention(q, q, q, causal=True),
                 params["wo"].astype(x.dtype))
  return jnp.mean((y.astype(jnp.float32) - x.astype(jnp.float32)) ** 2)


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("gather", ["per_microbatch", "once"])
def test_splash_stays_on_under_accumulation_tpu(gather, tpu_devices):
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, devices=tpu_devices("v5p:2x2x2"))
  opt = optax.sgd(0.1)

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"wq": jax.random.normal(k1, (256, 2, 128)) * 0.1,
            "wo": jax.random.normal(k2, (2, 128, 256)) * 0.1}

  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((16, 256, 256), jnp.bfloat16)}
  step = fs.with_kernel(fs.train_step(_attention_loss, opt, accum_steps=2,
                                      accum_gather=gather), attention="splash")
  with fs.with_mesh(mesh):
    text = fs.shard_step(step, mesh).compile(state, batch).compiled.as_text()
  assert 'custom_call_target="tpu_custom_call"' in text


def test_accum_gather_is_checked():
  with pytest.raises(fs.StepError, match=r"^accum_gather='twice', expected one of "
                     r"\('auto', 'per_microbatch', 'once'\)\.$"):
    fs.train_step(bench.mlp_loss, optax.sgd(0.1), accum_gather="twice")


# ------------------------------------------------- the default, leaf by leaf (accum_gather)


def _mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "b1": jnp.zeros((256,)),
          "w2": jax.random.normal(k2, (256, 64)) * 0.1, "b2": jnp.full((64,), 0.1)}


def _mlp(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - b["x"]) ** 2)


MLP_BATCH = {"x": jax.random.normal(jax.random.key(1), (64, 64))}
MLP_BYTES = 4 * (64 * 256 + 256 + 256 * 64 + 64)  # float32 params P
# Megatron's split of the MLP over "tensor": w1 by columns, b1 with them, w2 by rows.
MLP_AXES = {"w1": (None, "mlp"), "b1": ("mlp",), "w2": ("mlp", None), "b2": (None,)}


@functools.lru_cache(maxsize=None)
def _mlp_step(axes, axis_types, gather, accum=4):
  """(HLO summary, params after one SGD step, loss) of the MLP's step on `axes`."""
  mesh = fs.make_mesh(dict(axes), axis_types=axis_types)
  opt = optax.sgd(0.1)
  tensor = "tensor" in dict(axes)
  state = fs.init_state(_mlp_init, opt, mesh=mesh, key=jax.random.key(0),
                        rules=(("mlp", "tensor"),) if tensor else (),
                        logical_axes=MLP_AXES if tensor else None)
  step = fs.train_step(_mlp, opt, accum_steps=accum, accum_gather=gather)
  compiled = fs.shard_step(step, mesh).compile(state, MLP_BATCH)
  new, metrics = compiled(state, MLP_BATCH)
  return (hlo.summarize(compiled.compiled.as_text()), jax.device_get(new.params),
          float(metrics["loss"]))


def _mlp_reference():
  """One SGD step on one device over the whole batch."""
  params = _mlp_init(jax.random.key(0))
  loss, grads = jax.value_and_grad(_mlp)(params, MLP_BATCH)
  return jax.tree.map(lambda p, g: np.asarray(p) - 0.1 * np.asarray(g), params, grads), loss


def _equals_reference(params, loss):
  ref, ref_loss = _mlp_reference()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), params,
               ref)
  assert loss == pytest.approx(float(ref_loss), rel=1e-5)


@pytest.mark.parametrize("axis_types", [pytest.param("auto", marks=pytest.mark.slow),
                                        "explicit"])
def test_default_reduces_replicated_params_once_on_a_data_parallel_mesh(axis_types):
  # data=8, every param replicated: each device sums its microbatches' gradients and one
  # all-reduce of the float32 gradients (and the loss and weight scalars, fused in) sends
  # 2 (n-1)/n of their bytes; per_microbatch sends that in every microbatch.
  axes = (("data", 8),)
  summary, params, loss = _mlp_step(axes, axis_types, "auto")
  ring = 2 * 7 / 8
  assert summary.collective("all-reduce").count == 1
  assert summary.collective("all-reduce").bytes_sent == pytest.approx(ring * MLP_BYTES, abs=64)
  assert [c.kind for c in summary.collectives if c.count] == ["all-reduce"]
  per, per_params, _ = _mlp_step(axes, axis_types, "per_microbatch")
  assert per.collective("all-reduce").count == 4
  assert per.collective("all-reduce").bytes_sent == pytest.approx(
      4 * ring * MLP_BYTES, abs=64)
  _equals_reference(params, loss)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), params,
               per_params)


def test_default_on_a_data_and_tensor_mesh_reduces_over_data_once():
  # data=2 x tensor=4, params split over "tensor" only (whole over "data"): the loop runs
  # per data shard and the gradients (each device's tensor shard: w1, b1, w2 a quarter,
  # b2 whole) are all-reduced over "data" once; per_microbatch does it in each microbatch.
  axes = (("data", 2), ("tensor", 4))
  local = 4 * ((64 * 256 + 256 + 256 * 64) / 4 + 64)
  summary, params, loss = _mlp_step(axes, "auto", "auto")
  per, _, _ = _mlp_step(axes, "auto", "per_microbatch")
  over_data = lambda s: sum(b for k, g, b in s.groups if k == "all-reduce" and g == 2)
  assert over_data(summary) == pytest.approx(2 * 0.5 * local, abs=64)
  assert over_data(per) == pytest.approx(4 * 2 * 0.5 * local, abs=64)
  _equals_reference(params, loss)


# A tree of FSDP-split leaves (w1, w2: float32, 512 KiB each, over 16 KiB so split over
# "fsdp") and replicated ones (b1, b2: under 16 KiB), sized so that a TPU's tiles divide
# each shard (128 lanes).
def _tree_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (256, 512)) * 0.05, "b1": jnp.zeros((512,)),
          "w2": jax.random.normal(k2, (512, 256)) * 0.05, "b2": jnp.full((256,), 0.1)}


TREE_SPLIT, TREE_REPLICATED = 2 * 256 * 512 * 4, (512 + 256) * 4  # float32 bytes
TREE_BATCH = {"x": jax.random.normal(jax.random.key(2), (64, 256))}


@functools.lru_cache(maxsize=None)
def _tree_step(target, axis_types, gather, accum=4, rows=64, memory=None):
  """(HLO summary, compiled step, state) of the tree's step on data=2 x fsdp=4; `memory`:
  the bytes the device is said to have (default: what fnscale reads, none on CPU)."""
  if memory is not None:
    with mock.patch.object(_topology, "device_memory", lambda device: memory):
      return _tree_step.__wrapped__(target, axis_types, gather, accum, rows)
  devices = None if target == "cpu" else fs.target_devices(target)
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, devices=devices, axis_types=axis_types)
  opt = optax.sgd(0.1)
  state = fs.init_state(_tree_init, opt, mesh=mesh, key=jax.random.key(0),
                        abstract=target != "cpu")
  batch = {"x": jax.ShapeDtypeStruct((rows, 256), jnp.float32)}
  step = fs.train_step(_mlp, opt, accum_steps=accum,
                       **({"accum_gather": gather} if gather else {}))
  compiled = fs.shard_step(step, mesh).compile(state, batch)
  return hlo.summarize(compiled.compiled.as_text()), compiled, state


def _check_reduced_once(summary):
  """Every leaf's gradient reduced once per step (hand count, ring bytes: all-reduce
  2 (n-1)/n S, reduce-scatter and all-gather (n-1)/n S; d=2, f=4, n=8): w1 and w2
  reduce-scattered over fsdp, their float32 shards all-reduced over data, b1 and b2 (with
  the loss and weight scalars) all-reduced over all 8 devices; params gathered once over
  fsdp (float32, or bfloat16 where the TPU compiler casts before gathering for its matmuls).
  Nothing else but a few scalars (the update's norms)."""
  d, f, n = 2, 4, 8
  groups = {(k, g): b for k, g, b in summary.groups}
  assert groups.pop(("reduce-scatter", f)) == (f - 1) / f * TREE_SPLIT
  assert groups.pop(("all-reduce", d)) == 2 * (d - 1) / d * TREE_SPLIT / f
  assert groups.pop(("all-reduce", n)) == pytest.approx(
      2 * (n - 1) / n * TREE_REPLICATED, abs=16)
  assert groups.pop(("all-gather", f)) in ((f - 1) / f * TREE_SPLIT, (f - 1) / f * TREE_SPLIT / 2)
  assert sum(groups.values()) <= 64, groups  # scalars
  counts = {c.kind: c.count for c in summary.collectives}
  # One per split leaf (libtpu may reduce-scatter both in one fusion).
  assert counts["reduce-scatter"] in (1, 2) and counts["all-gather"] == 2


# What "auto" holds whole to run "once", hand counted: every float32 param (8 bytes an
# element: the param and its float32 accumulator; no policy, so computed in float32).
TREE_WHOLE = 2 * (TREE_SPLIT + TREE_REPLICATED)


def _check_tree_step(compiled, state):
  new, metrics = compiled(state, TREE_BATCH)
  ref = _tree_init(jax.random.key(0))
  loss, grads = jax.value_and_grad(_mlp)(ref, TREE_BATCH)
  jax.tree.map(lambda a, p, g: np.testing.assert_allclose(a, p - 0.1 * g, rtol=2e-5, atol=1e-6),
               jax.device_get(new.params), ref, grads)
  assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_default_runs_once_where_whole_params_fit_the_stated_share_of_memory(axis_types):
  # A device said to hold the whole params and accumulator in ONCE_SHARE of its memory: the
  # per-shard loop, every leaf reduced once; one SGD step equals the one-device step.
  memory = TREE_WHOLE / _accumulate.ONCE_SHARE * 1.01
  summary, compiled, state = _tree_step("cpu", axis_types, None, memory=memory)
  _check_reduced_once(summary)
  _check_tree_step(compiled, state)


@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_default_keeps_fsdp_params_split_where_whole_ones_dont_fit(axis_types):
  # Just over the share, or memory unknown (CPU): the partitioner's loop (per_microbatch),
  # which gathers in every microbatch (the weights' all-gathers run 4 times), and holds no
  # whole-size accumulator. One SGD step equals the one-device step. (On Explicit axes
  # CPU's compiler moves the gathers out of the loop: the memory is checked on a described
  # TPU, test_default_keeps_fsdp_memory_on_a_described_tpu.)
  memory = TREE_WHOLE / _accumulate.ONCE_SHARE * 0.99
  for summary, compiled, state in (_tree_step("cpu", axis_types, None, memory=memory),
                                   _tree_step("cpu", axis_types, None)):
    if axis_types == "auto":
      ag = summary.collective("all-gather")  # the two weights' in each of 4 microbatches
      assert ag.ops >= 2 and ag.count >= 4 * 2
      assert compiled.compiled.memory_analysis().temp_size_in_bytes < TREE_SPLIT
    _check_tree_step(compiled, state)


def test_default_keeps_fsdp_params_split_where_whole_ones_take_under_a_tenth_of_memory():
  # Whole params and accumulator at 8.8% of the device's memory, as Llama-3-8B's widths x 2
  # layers (8.3 GiB) on a v5p (94.7 GiB), where "once" held 2.37x MaxText's accumulation's
  # temporaries (recipes/bench/README.md, "Against MaxText"): the partitioner's loop, the
  # weights gathered in each of the 4 microbatches, no whole-size accumulator.
  summary, compiled, state = _tree_step("cpu", "auto", None, memory=TREE_WHOLE / 0.088)
  assert summary.collective("all-gather").count >= 4 * 2
  assert compiled.compiled.memory_analysis().temp_size_in_bytes < TREE_SPLIT
  _check_tree_step(compiled, state)


@pytest.mark.parametrize("update_norm", [None, True])
def test_default_keeps_fsdp_memory_at_few_rows_per_device(update_norm):
  # The 64 MiB float32 MLP, fsdp=8, 64 rows (8 a device: XLA keeps the weights split and
  # moves the rows), accum 4 by default on CPU. Unmeasured (the default for float32 params)
  # accum 1 writes the params in place, and accum 4 holds the float32 accumulator's shard
  # (P / 8) besides: within 1.5x of accum 1's temporaries plus it. Measured, every new
  # param waits for the change's norm, in accum 1 too: within 1.5x of accum 1's. There the
  # summed gradients divided by the weight after the loop were held twice (1.67x).
  axes, p = (("fsdp", 8),), _param_bytes(1024, 4096)
  one, _ = _compiled("cpu", axes, 1, None, d=1024, m=4096, rows=64, policy=None,
                     update_norm=update_norm)
  default, _ = _compiled("cpu", axes, 4, None, d=1024, m=4096, rows=64, policy=None,
                         update_norm=update_norm)
  bound = 1.5 * _temp(one) + (p / 8 if update_norm is None else 0)
  assert _temp(default) <= bound, (_temp(default), _temp(one))


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_default_keeps_fsdp_memory_on_a_described_tpu(axis_types, tpu_devices):
  # v5p-8, fsdp=4, the 64 MiB MLP, 1024 rows, a device said to have 512 MiB (whole bf16
  # params and f32 accumulator, 96 MiB, over its 10%): the default gathers the weights and
  # reduce-scatters their gradients in every microbatch (4 x accum 1's), all-reduces
  # nothing but scalars, and its temporaries stay within 1.5x of accum 1's plus the float32
  # accumulator's shard (P / 4, which accum 1 doesn't have; "once" holds 96 MiB whole: 99
  # MiB of temporaries).
  del tpu_devices
  mesh = fs.make_mesh({"fsdp": 4}, axis_types=axis_types, devices=fs.target_devices("v5p-8"))
  opt = optax.sgd(0.1)
  init = functools.partial(bench.init_mlp, d=1024, m=4096, layers=L)
  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  got = {}
  with mock.patch.object(_topology, "device_memory", lambda device: 2**29):
    for accum in (1, 4):
      step = fs.train_step(bench.mlp_loss, opt, accum_steps=accum, policy=POLICY)
      c = fs.shard_step(step, mesh).compile(state, batch)
      got[accum] = (_temp(c), hlo.summarize(c.compiled.as_text()))
  assert got[4][0] <= 1.5 * got[1][0] + _param_bytes(1024, 4096) / 4, (got[4][0], got[1][0])
  for kind in ("all-gather", "reduce-scatter"):
    one, four = (got[a][1].collective(kind).count for a in (1, 4))
    assert one > 0 and four == 4 * one, (kind, one, four)
  assert got[4][1].collective("all-reduce").bytes_sent <= 64  # scalars


@pytest.mark.tpu
@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_default_reduces_every_leaf_once_on_a_described_tpu(axis_types, tpu_devices):
  del tpu_devices  # skips without libtpu
  _check_reduced_once(_tree_step("v5p:2x2x2", axis_types, None)[0])


@pytest.mark.tpu
def test_accum_1_on_a_described_tpu_sends_what_the_default_sends_at_accum_4(tpu_devices):
  # Without accumulation, with rows enough that XLA moves the weights (not activations),
  # libtpu reduce-scatters w1 and w2 in one fused all-reduce-scatter (an all-reduce and a
  # slice inside a fusion): counted as the reduce-scatter it is, the same hand count as the
  # default's per-shard loop at accum 4 (read as an all-reduce it was twice the bytes).
  del tpu_devices
  _check_reduced_once(_tree_step("v5p:2x2x2", "auto", None, accum=1, rows=2048)[0])


def test_default_with_a_key_keeps_the_partitioners_loop():
  # A key's random bits stay the same under any mesh only in the partitioner's loop.
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  state = fs.init_state(_mlp_init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  loss = lambda p, b, k: _mlp(p, b) + 0 * jax.random.uniform(k)
  step = fs.train_step(loss, opt, accum_steps=4, key=jax.random.key(3))
  text = fs.shard_step(step, mesh).compile(state, MLP_BATCH).compiled.as_text()
  assert hlo.summarize(text).collective("all-reduce").count == 4


def _constrained_mlp(p, b):
  """The MLP with its hidden activations pinned to the batch's rows, as a user writes it
  for a data-parallel mesh: a constraint naming "data"."""
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  h = jax.lax.with_sharding_constraint(h, jax.sharding.PartitionSpec("data"))
  return jnp.mean((h @ p["w2"] + p["b2"] - b["x"]) ** 2)


def test_a_constraint_on_a_data_axis_runs_with_the_partitioners_loop(caplog, monkeypatch):
  # The per-shard loop makes the data axes Manual, where jax refuses the constraint: "auto"
  # (on a device whose memory holds whole params: the per-shard loop) keeps the loop with
  # the partitioner (said once), "once" names the option that works.
  monkeypatch.setattr(_topology, "device_memory", lambda device: 2**40)
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  opt = optax.sgd(0.1)
  state = fs.init_state(_mlp_init, opt, mesh=mesh, key=jax.random.key(0))
  with caplog.at_level("WARNING"):
    step = fs.shard_step(fs.train_step(_constrained_mlp, opt, accum_steps=4), mesh)
    new, metrics = step(state, MLP_BATCH)
  _equals_reference(jax.device_get(new.params), float(metrics["loss"]))
  assert "constrains them over a data axis" in caplog.text
  once = fs.shard_step(fs.train_step(_constrained_mlp, opt, accum_steps=4,
                                     accum_gather="once"), mesh)
  with pytest.raises(fs.StepError, match=r"sharding constraint in the loss.*"
                     r"accum_gather='per_microbatch'"):
    once.compile(state, MLP_BATCH)


# ----------------------------------------------------- a Linen model on an FSDP mesh (CPU)


def test_default_keeps_a_linen_models_fsdp_memory_and_trains_like_one_device():
  # A Linen MLP whose kernels its authors split over "fsdp" (nn.with_partitioning), fsdp=8,
  # 1024 rows, accum 4 by default: temporaries within 1.5x of accum 1's and under the whole
  # float32 params and accumulator (8 bytes a param, hand count); one SGD step equals one
  # device's on the whole batch.
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.lecun_normal()
      h = nn.Dense(512, kernel_init=nn.with_partitioning(init, (None, "fsdp")))(x)
      return nn.Dense(128, kernel_init=nn.with_partitioning(init, ("fsdp", None)))(nn.relu(h))

  model = MLP()
  loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["x"]) ** 2)
  init = lambda key: model.init(key, jnp.zeros((1, 128)))["params"]
  batch = {"x": jax.random.normal(jax.random.key(1), (1024, 128))}
  mesh, opt = fs.make_mesh({"fsdp": 8}), optax.sgd(0.1)
  got = {}
  for accum in (1, 4):
    state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0))
    compiled = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum), mesh).compile(
        state, batch)
    new, metrics = compiled(state, batch)
    got[accum] = (_temp(compiled), jax.device_get(new.params), float(metrics["loss"]))
  whole = 8 * (128 * 512 + 512 + 512 * 128 + 128)
  assert got[4][0] <= 1.5 * got[1][0] and got[4][0] < whole, (got[4][0], got[1][0], whole)
  params = nn.unbox(init(jax.random.key(0)))
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  jax.tree.map(lambda a, p, g: np.testing.assert_allclose(a, p - 0.1 * g, rtol=2e-5, atol=1e-6),
               got[4][1], params, grads)
  assert got[4][2] == pytest.approx(float(loss), rel=1e-5)


def test_jax_still_refuses_reduced_params_beside_batch_sharded_rows():
  # Why the partitioner's loop leaves replicated leaves' all-reduces to the compiler's code
  # motion (TPU's moves them after the loop, CPU's keeps them in every microbatch): on
  # Explicit axes a param resharded to `reduced` would come back from grad `unreduced` (a
  # partial sum the loop could carry and reduce once on any backend), but an elementwise op
  # of it with rows split over the same axis (a norm's scale, a bias) is refused. When this
  # fails, jax accepts it: carry replicated leaves' gradients unreduced in
  # `_accumulate._grad_sum`.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((8, 4)), jax.P("data", None))
    scale = jax.device_put(jnp.ones(4), jax.P())

    def loss(s, x):
      return jnp.sum(x * jax.reshard(s, jax.P(reduced={"data"})))
    with pytest.raises(Exception, match="another input is reduced on"):
      jax.jit(jax.grad(loss)).trace(scale, x)


def _loop_all_reduces(text: str, body: str) -> list[str]:
  """Result types of the all-reduce ops written in the while body computation `body` of an
  optimized HLO module (not those in computations it calls: a fusion's all-reduce-scatter is
  a reduce-scatter, counted as such)."""
  ops, inside = [], False
  for line in text.splitlines():
    if not inside:
      inside = line.startswith((f"%{body} ", f"{body} ")) and line.rstrip().endswith("{")
      continue
    if line.startswith("}"):
      break
    m = re.search(r"= (.+?) all-reduce(?:-start)?\(", line)
    if m:
      ops.append(m.group(1))
  return ops


@pytest.mark.tpu
def test_per_microbatch_reduces_replicated_leaves_once_after_the_loop_tpu(tpu_devices):
  # The tree on v5p-8, fsdp=4, accum 4, 256 rows: w1 and w2 split over fsdp, b1 and b2
  # replicated. The loop's sum of b2's gradient is divided by the weight after the loop, so
  # its all-reduce is only added to the carried sum and libtpu moves it after the loop: one
  # all-reduce of b2 (float32, 2 x 3/4 x 1 KiB sent) and scalars; none of a gradient in the
  # loop's body. Divided inside the loop (in its last microbatch), b2 was all-reduced in
  # every microbatch, 4x the bytes. (At 16 rows a device XLA moves the rows rather than the
  # weights: b1's gradient is computed split like w1's columns and all-gathered.)
  del tpu_devices  # skips without libtpu
  mesh = fs.make_mesh({"fsdp": 4}, devices=fs.target_devices("v5p-8"))
  opt = optax.sgd(0.1)
  state = fs.init_state(_tree_init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
  step = fs.train_step(_mlp, opt, accum_steps=4, accum_gather="per_microbatch")
  text = fs.shard_step(step, mesh).compile(state, batch).compiled.as_text()
  s = hlo.summarize(text)
  (loop,) = [l for l in s.loops if l.trip_count == 4]
  in_loop = _loop_all_reduces(text, loop.body)
  gradients = [t for t in in_loop if re.search(r"\[\d", t)]  # a shape with dims: no scalar
  assert not gradients, in_loop
  assert _sent(s, "all-reduce", 4) == pytest.approx(2 * 3 / 4 * 256 * 4, abs=64)


def _masked_sums(p, b):
  """A token loss as (sum, count) over the rows `b["mask"]` keeps (weighted=True)."""
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  err = jnp.mean((h @ p["w2"] + p["b2"] - b["x"]) ** 2, axis=-1)
  return jnp.sum(err * b["mask"]), jnp.sum(b["mask"])


@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_per_microbatch_divides_replicated_leaves_after_the_loop_exactly(axis_types):
  # 8 simulated devices, data=2 x fsdp=4, accum 4: b1 and b2 (replicated) are divided by
  # the count of kept rows after the loop, w1 and w2 (split) in its last microbatch; the
  # microbatches keep different counts (rows i, i + 4, ...). Every param as one SGD step
  # of the whole batch's mean over kept rows on one device (jax alone).
  mesh = fs.make_mesh({"data": 2, "fsdp": 4}, axis_types=axis_types)
  opt = optax.sgd(0.1)
  rows = np.arange(64)
  batch = {"x": TREE_BATCH["x"],
           "mask": jnp.asarray(((rows % 7 != 0) & (rows < 50)).astype(np.float32))}
  state = fs.init_state(_tree_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(_masked_sums, opt, accum_steps=4, weighted=True,
                                     accum_gather="per_microbatch"), mesh)
  new, metrics = step(state, batch)
  ref = _tree_init(jax.random.key(0))
  mean = lambda p: (lambda s, c: s / c)(*_masked_sums(p, batch))
  loss, grads = jax.value_and_grad(mean)(ref)
  jax.tree.map(lambda a, p, g: np.testing.assert_allclose(a, p - 0.1 * g, rtol=2e-5, atol=1e-6),
               jax.device_get(new.params), ref, grads)
  assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
