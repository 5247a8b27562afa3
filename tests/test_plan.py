"""fnscale.plan: targets, the cost model against hand counts, errors, and a plan verified by
an ahead-of-time compile for v5p:2x2x2."""

import jax
import jax.numpy as jnp
import optax
import pytest

import fnscale as fs
from fnscale import _cost
from fnscale import _targets
from fnscale.plan import PlanError, mesh_str, plan, summary

from recipes import llama

GiB = 2**30


def _batch(rows, seq):
  return {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("inputs", "targets")}


def test_unknown_target_lists_the_known_ones():
  with pytest.raises(fs.TopologyError, match=r"v5p-128.*8x h200"):
    _targets.resolve("v9x-12")
  with pytest.raises(fs.TopologyError, match="Topology or a name"):
    _targets.resolve(128)


@pytest.mark.parametrize("chips,dims,grid", [
    # Cloud TPU configuration tables: v5p 2x2x1, 2x2x2, 2x4x4, 4x4x4, 4x4x8; v6e 4x8, 16x16.
    (4, 3, (2, 2, 1)), (8, 3, (2, 2, 2)), (32, 3, (2, 4, 4)), (64, 3, (4, 4, 4)),
    (128, 3, (4, 4, 8)), (32, 2, (4, 8)), (256, 2, (16, 16)),
])
def test_slice_shapes_follow_the_cloud_tpu_tables(chips, dims, grid):
  assert _targets.grid_for(chips, dims) == grid


def test_gpu_and_multi_slice_targets():
  h = _targets.resolve("16x h200")
  assert (h.kind, h.num_slices, h.devices_per_slice, h.hbm_bytes) == ("gpu", 2, 8, 141e9)
  assert h.peak_flops == 989e12


def test_axis_bandwidth_counts_torus_dimensions_and_wrap():
  v5p = _targets.Hardware("v5p-128", "tpu", "v5p", 1, 64, (4, 4, 4), True, 459e12, 95 * GiB,
                          _targets.LINK_FACTS["v5p"])
  # fsdp over the whole 4x4x4 cube: 3 dimensions, both directions of each ring.
  assert _cost.axis_bandwidth(v5p, {"fsdp": 64}, {}) == {"fsdp": 3 * 2 * 9e10}
  bw = _cost.axis_bandwidth(v5p, {"fsdp": 16, "tensor": 4}, {"replica": 2})
  assert bw == {"fsdp": 2 * 2 * 9e10, "tensor": 2 * 9e10, "replica": 50e9 / 8}
  # v5e 4x4 has no wrap-around links: one direction's worth per dimension; a part of a
  # dimension (2 of 4) has no ring either.
  v5e = v5p._replace(generation="v5e", chip_grid=(4, 4), wrap=False, devices_per_slice=16,
                     links=_targets.LINK_FACTS["v5e"])
  assert _cost.axis_bandwidth(v5e, {"fsdp": 8, "tensor": 2}, {}) == {
      "fsdp": 2 * 4.5e10, "tensor": 4.5e10}


def test_jaxpr_flops_multiply_scan_bodies_and_take_the_larger_branch():
  def f(w, x):
    h = jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]  # 3 x [4,8]@[8,8]
    return jax.lax.cond(h.sum() > 0, lambda h: h @ jnp.ones((8, 8)), lambda h: h + 1, h)
  jx = jax.make_jaxpr(f)(jnp.ones((3, 8, 8)), jnp.ones((4, 8)))
  assert _cost.jaxpr_matmul_flops(jx.jaxpr) == 3 * 2 * 4 * 8 * 8 + 2 * 4 * 8 * 8


def test_profile_counts_params_optimizer_state_and_flops():
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=32, heads=4, kv_heads=2,
                           d_mlp=64, vocab=40)
  params = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
  prof = _cost.profile(params, llama.loss_fn, optax.adamw(1e-3), _batch(4, 16))
  n = llama.param_count(cfg)
  assert prof.params == n and prof.param_bytes == 4 * n
  assert prof.opt_bytes == 2 * 4 * n + 4  # adam mu, nu (float32) and the int32 count
  assert (prof.layers, prof.rows, prof.has_remat) == (2, 4, True)
  assert prof.stream_row == 16 * 32 * 4  # the scan carry: [1, seq, d] float32
  m = llama.matmul_params(cfg)
  attn = 2 * 2 * 16 * 16 * 32  # q k^T and a v, per layer, one row
  # fnscale.cross_entropy recomputes the logits in its backward pass: one more [16, 32] x
  # [32, 40] matmul per row.
  assert prof.flops_row == 16 * 6 * m + 3 * 2 * attn + 2 * 16 * 32 * 40
  assert prof.flops_row < prof.flops_row_remat < prof.flops_row * 4 / 3
  assert prof.act_row_remat < prof.act_row


def test_estimate_is_the_scaling_book_fsdp_roofline():
  prof = _cost.Profile(params=10**9, param_bytes=4e9, opt_bytes=8e9, compute_bytes=2e9,
                       grad_bytes=4e9, flops_row=6e12, flops_row_remat=8e12, act_row=1e9,
                       act_row_remat=1e8, layers=10, stream_row=1e6, rows=64, has_remat=True)
  hw = _targets.Hardware("t", "tpu", "v5p", 1, 8, (2, 2, 2), False, 1e14, 95 * GiB,
                         _targets.LinkFacts(1e11, 1e10, 1e12))
  e = _cost.estimate(prof, hw, {"fsdp": 8}, {}, remat=False, accum=2)
  # Per device: params, adam state and gradients (plus an accumulator) split 8 ways; two
  # layers of gathered bf16 weights; activations of 64 / 8 / 2 = 4 rows.
  assert e.params == 0.5e9 and e.opt == 1e9 and e.grads == 1e9
  assert e.weights == 2 * 2e9 / 10 and e.acts == 4e9
  # Matmuls at peak, plus memory traffic at 1e12 B/s: the optimizer update (read params,
  # grads, adam state; write params, state) of the 1/8 shard, and activations written and
  # read once for each of the 8 rows.
  assert e.memory_s == pytest.approx(((2 * 4e9 + 4e9 + 2 * 8e9) / 8 + 2 * 1e9 * 8) / 1e12)
  assert e.compute_s == pytest.approx(6e12 * 64 / 8 / 1e14 + e.memory_s)
  # Per microbatch: all-gather bf16 weights twice, reduce-scatter f32 gradients once, each
  # moving 7/8 of the bytes over 3 torus dims (no wrap) of 1e11 B/s links.
  assert e.comm_s["fsdp"] == pytest.approx(2 * 7 / 8 * (2 * 2e9 + 4e9) / 3e11)
  assert e.step_s == max(e.compute_s, e.comm_s["fsdp"])
  assert e.mfu == pytest.approx(6e12 * 64 / (e.step_s * 8 * 1e14))
  # Data parallel replicates the optimizer update: 8x its memory traffic.
  d = _cost.estimate(prof, hw, {"data": 8}, {}, remat=False, accum=2)
  assert d.memory_s - e.memory_s == pytest.approx(7 * (2 * 4e9 + 4e9 + 2 * 8e9) / 8 / 1e12)


def _fsdp_profile_and_hardware():
  prof = _cost.Profile(params=10**9, param_bytes=4e9, opt_bytes=8e9, compute_bytes=2e9,
                       grad_bytes=4e9, flops_row=6e12, flops_row_remat=8e12, act_row=1e9,
                       act_row_remat=1e8, layers=10, stream_row=1e6, rows=64, has_remat=True)
  hw = _targets.Hardware("t", "tpu", "v5p", 1, 8, (2, 2, 2), False, 1e14, 95 * GiB,
                         _targets.LinkFacts(1e11, 1e10, 1e12))
  return prof, hw


def test_estimate_costs_each_accumulation_mode_as_it_compiles():
  prof, hw = _fsdp_profile_and_hardware()
  per = _cost.estimate(prof, hw, {"fsdp": 8}, {}, False, 4, "per_microbatch")
  once = _cost.estimate(prof, hw, {"fsdp": 8}, {}, False, 4, "once")
  # per_microbatch: sharded accumulator and gradients, two layers of gathered weights; every
  # microbatch gathers the bf16 weights twice and reduce-scatters the f32 gradients.
  assert per.grads == 2 * 4e9 / 8 and per.weights == 2 * 2e9 / 10
  assert per.comm_s["fsdp"] == pytest.approx(4 * 7 / 8 * (2 * 2e9 + 4e9) / 3e11)
  # once: a whole f32 accumulator and the reduced shard; whole bf16 params for the loop;
  # one gather and one reduce-scatter per step.
  assert once.grads == 4e9 + 4e9 / 8 and once.weights == 2e9
  assert once.comm_s["fsdp"] == pytest.approx(7 / 8 * (2e9 + 4e9) / 3e11)
  assert (once.params, once.opt, once.acts) == (per.params, per.opt, per.acts)
  # Without accumulation the modes are the same program.
  assert _cost.estimate(prof, hw, {"fsdp": 8}, {}, False, 1, "once") == _cost.estimate(
      prof, hw, {"fsdp": 8}, {}, False, 1, "per_microbatch")
  # Data parallel: the same memory (params whole either way); per_microbatch all-reduces the
  # f32 gradients in every microbatch (its accumulator is whole over "data"), once once.
  dp_per = _cost.estimate(prof, hw, {"data": 8}, {}, False, 4, "per_microbatch")
  dp_once = _cost.estimate(prof, hw, {"data": 8}, {}, False, 4, "once")
  assert dp_per.bytes == dp_once.bytes
  assert dp_once.comm_s["data"] == pytest.approx(2 * 7 / 8 * 4e9 / 3e11)
  assert dp_per.comm_s["data"] == pytest.approx(4 * dp_once.comm_s["data"])


def test_planner_chooses_once_only_where_its_memory_fits():
  from fnscale import plan as fplan  # pylint: disable=import-outside-toplevel
  prof, hw = _fsdp_profile_and_hardware()
  axes = fs.mesh.MeshAxes({"fsdp": 8}, {})
  per = _cost.estimate(prof, hw, axes.ici, {}, False, 2, "per_microbatch")
  once = _cost.estimate(prof, hw, axes.ici, {}, False, 2, "once")
  # Compute-bound here: the same step time, "once" with a quarter of the communication.
  assert per.bytes < once.bytes and once.step_s <= per.step_s
  assert once.comm_total_s < per.comm_total_s
  # At 2 steps "once" where its memory fits, else the default.
  got = fplan._best_accum(prof, hw, axes, False, once.bytes, (2, 4))
  assert got[:2] == (2, "once") and got[3]
  got = fplan._best_accum(prof, hw, axes, False, (per.bytes + once.bytes) / 2, (2, 4))
  assert got[:2] == (2, "per_microbatch") and got[3]
  # Fewer steps first: accum 1 (10.4 GB here) fits where "once" at 2 does.
  assert fplan._best_accum(prof, hw, axes, False, once.bytes, (1, 2, 4))[:2] == (
      1, "per_microbatch")


def test_a_model_that_fits_nowhere_names_its_smallest_need_and_the_hbm():
  cfg = llama.model_config("llama-70b", 4096)
  with pytest.raises(PlanError, match=r"needs \d+\.\d GiB per device.*16\.0 GiB of HBM"):
    plan(lambda k: llama.init_params(cfg, k), llama.loss_fn, optax.adamw(1e-3),
               _batch(16, 4096), "v5e-4", verify=0)


def test_bad_arguments_raise_plan_errors():
  cfg = llama.model_config("llama-tiny", 16)
  init = lambda k: llama.init_params(cfg, k)
  with pytest.raises(PlanError, match="loss_fn"):
    plan(init, "loss", optax.adam(1e-3), _batch(8, 16), "v5p-8")
  with pytest.raises(PlanError, match="optax"):
    plan(init, llama.loss_fn, "adam", _batch(8, 16), "v5p-8")
  with pytest.raises(PlanError, match="leading batch dim"):
    plan(init, llama.loss_fn, optax.adam(1e-3), {"inputs": 3}, "v5p-8")
  with pytest.raises(PlanError, match="verify"):
    plan(init, llama.loss_fn, optax.adam(1e-3), _batch(8, 16), "v5p-8", verify=-1)


@pytest.mark.tpu
def test_plan_verified_by_compiling_for_v5p(tpu_devices):
  del tpu_devices  # the fixture skips where libtpu is absent; plan() describes the devices
  cfg = llama.ModelConfig(layers=2, d_model=128, heads=1, kv_heads=1, d_mlp=256, seq=256,
                          vocab=256)
  p = plan(lambda k: llama.init_params(cfg, k), llama.loss_fn, optax.adamw(1e-3),
                 _batch(16, 256), "v5p:2x2x2", policy="params=float32,compute=bfloat16",
                 rules=llama.RULES, logical_axes=llama.logical_axes(cfg), verify=1,
                 max_tensor=1)
  best = p.rows[0]
  assert best.compiled is not None and best.fits
  assert (p.axes, p.remat, p.accum) == (best.axes, best.remat, best.accum)
  assert best.compiled.bytes <= p.hardware.hbm_bytes
  # The compiled program does the traced step's matmul work (8 devices share 16 rows).
  program = (p.profile.flops_row_remat if best.remat else p.profile.flops_row) * 16 / 8
  # ... less, at most, the cross-entropy's recomputed logits (2 x tokens x d x vocab per
  # device): with the vocabulary in one block XLA merges them with the forward's.
  recomputed = 2 * 16 * 256 * 128 * 256 / 8
  assert program - recomputed <= best.compiled.matmul_flops * 1.01 <= program * 1.02
  text = str(p)
  assert "chosen:" in text and "yes" in text and mesh_str(p.axes) in text
  s = summary(p)
  assert s["rows"][0]["memory_ratio"] == pytest.approx(best.compiled.bytes / best.estimate.bytes)


def test_a_candidate_xla_finds_too_big_makes_room_for_the_next(monkeypatch):
  from fnscale import plan as plan_module  # pylint: disable=g-import-not-at-top
  est = lambda s: _cost.Estimate(1.0, 1.0, 1.0, 1.0, 1.0, s, {}, s, 0.5)
  rows = [plan_module.Candidate(fs.MeshAxes({"fsdp": 8}, {}), False, a, est(s), None, True)
          for a, s in ((1, 1.0), (2, 1.1), (4, 1.2))]

  def fake_verify(cand, hw, ctx):  # XLA: accum=1 overflows HBM, the others fit
    fits = cand.accum > 1
    c = plan_module.Compiled(10.0 if fits else 99.0, 0.0, 0.0, cand.estimate.step_s, 0.5, 1.0,
                             () if fits else ("memory",))
    return cand._replace(compiled=c, fits=fits)

  monkeypatch.setattr(plan_module, "_verify", fake_verify)
  plan_module._verify_best(rows, None, None, verify=1)
  assert [(r.accum, r.fits, r.compiled is not None) for r in rows] == [
      (2, True, True), (4, True, False), (1, False, True)]
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (18.35G) exceeds available HBM (15.75G).")
  assert plan_module._oom_bytes(msg) == pytest.approx(18.35 * GiB)
