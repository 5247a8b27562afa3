"""Tests for fnscale.analysis.hlo: collectives and matmul FLOPs of optimized HLO, loop trip counts applied."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import fnscale
from fnscale.analysis import hlo

# A module in the shape XLA prints: a while loop (known trip count 4) whose body holds a
# dot and an all-reduce, called from ENTRY next to an async all-gather pair and a dot.
LOOP_HLO = """HloModule loop, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %p = (s32[], f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[16,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[32,32]{1,0} constant({...})
  %d = f32[16,32]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[16,32]{1,0} all-reduce(%d), channel_id=1, replica_groups=[2,4]<=[8], \
use_global_device_ids=true, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16,32]{1,0}) tuple(%j, %r)
}

%cond (q: (s32[], f32[16,32])) -> pred[] {
  %q = (s32[], f32[16,32]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (a: f32[16,32], b: f32[8,16]) -> f32[16,32] {
  %a = f32[16,32]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,32]{1,0}) tuple(%zero, %a)
  %loop = (s32[], f32[16,32]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"4"}}
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%b), dimensions={0}, \
replica_groups={{0,1,2,3,4,5,6,7}}
  %agd = f32[64,16]{1,0} all-gather-done(%ags)
  %e = f32[8,32]{1,0} dot(f32[8,16]{1,0} %b, f32[16,32]{1,0} %a), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
  ROOT %out = f32[16,32]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_loop_trip_count_multiplies_counts_and_flops():
  s = hlo.summarize(LOOP_HLO)
  assert s.num_devices == 8  # from num_partitions
  assert s.loops == (hlo.Loop("body", 4),)
  assert s.unknown_trip_counts == 0
  loop_dot, entry_dot = 2 * 16 * 32 * 32, 2 * 8 * 32 * 16
  assert s.matmul_flops == 4 * loop_dot + entry_dot
  assert s.matmul_flops_once == loop_dot + entry_dot
  assert hlo.matmul_flops(LOOP_HLO) == s.matmul_flops
  assert hlo.matmul_flops(LOOP_HLO, apply_trip_counts=False) == s.matmul_flops_once
  ar, ag = s.collective("all-reduce"), s.collective("all-gather")
  result = 16 * 32 * 4
  assert (ar.count, ar.bytes, ar.ops) == (4, 4 * result, 1)
  assert ar.bytes_sent == pytest.approx(4 * 2 * 3 / 4 * result)  # groups of 4: [2,4]<=[8]
  # The async pair counts once, at -done, with the gathered result.
  assert (ag.count, ag.bytes, ag.ops) == (1, 64 * 16 * 4, 1)
  assert ag.bytes_sent == pytest.approx(7 / 8 * 64 * 16 * 4)
  assert [c.kind for c in hlo.collectives(LOOP_HLO)] == ["all-reduce", "all-gather"]


def test_trip_count_from_the_loop_condition():
  # The TPU compiler drops backend_config; the condition `i < 4` still gives the count.
  text = LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 4, from_condition=True),)
  assert s.collective("all-reduce").count == 4
  # A condition that is not `counter < constant`: the body counts once, and says so.
  text = text.replace("compare(%k, %n), direction=LT", "compare(%k, %n), direction=NE")
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", None),) and s.unknown_trip_counts == 1
  assert s.matmul_flops == s.matmul_flops_once


def test_collectives_parsed_from_instruction_lines():
  snippet = """
  %all-reduce.1 = f32[128,64]{1,0} all-reduce(f32[128,64]{1,0} %p), channel_id=1
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(f32[16]{0} %q), dimensions={0}
  %agd = f32[128]{0} all-gather-done((f32[16]{0}, f32[128]{0}) %ags)
  ROOT %rs = bf16[8,4]{1,0} reduce-scatter(bf16[64,4]{1,0} %r), dimensions={0}
  %ar2 = (f32[4]{0}, s32[2]{0}) all-reduce(f32[4]{0} %a, s32[2]{0} %b), to_apply=%add
  %cp = u8[10]{0} collective-permute(u8[10]{0} %c), source_target_pairs={{0,1}}
  """
  want = {"all-reduce": (2, 128 * 64 * 4 + 16 + 8), "all-gather": (1, 512),
          "reduce-scatter": (1, 64), "collective-permute": (1, 10)}
  assert {c.kind: (c.count, c.bytes) for c in hlo.collectives(snippet)} == want


def test_ring_bytes_sent():
  assert hlo.ring_bytes_sent("all-reduce", 100, 4) == 150
  assert hlo.ring_bytes_sent("all-gather", 100, 4) == 75
  assert hlo.ring_bytes_sent("reduce-scatter", 25, 4) == 75
  assert hlo.ring_bytes_sent("collective-permute", 10, 2) == 10
  assert hlo.ring_bytes_sent("all-reduce", 100, 1) == 0


def test_bad_inputs_raise_step_error():
  with pytest.raises(fnscale.StepError, match="'all-sum' is not known"):
    hlo.ring_bytes_sent("all-sum", 1, 2)
  with pytest.raises(fnscale.StepError, match="hlo_text is a bytes"):
    hlo.summarize(b"HloModule m")
  with pytest.raises(fnscale.StepError, match="num_devices=0"):
    hlo.collectives(LOOP_HLO, num_devices=0)


M, D, F = 64, 32, 16  # global batch, width of the 3 scanned layers, output width


def _scan(w, x):
  return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]


def _loss(params, x):
  return jnp.sum(jnp.tanh(_scan(params["w"], x) @ params["b"]))


def _abstract(mesh):
  rep = NamedSharding(mesh, P())
  params = {"w": jax.ShapeDtypeStruct((3, D, D), jnp.float32, sharding=rep),
            "b": jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=rep)}
  x = jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  return params, x


def test_compiled_scan_on_a_data_parallel_mesh():
  mesh = fnscale.make_mesh("data=8")
  params, x = _abstract(mesh)
  m = M // 8  # rows per device
  # Forward only: the 3 scanned matmuls, per device.
  fwd = jax.jit(lambda p, x: _scan(p["w"], x)).lower(params, x).compile()
  assert hlo.matmul_flops(fwd.as_text()) == 3 * 2 * m * D * D
  assert hlo.matmul_flops(fwd.as_text(), apply_trip_counts=False) == 2 * m * D * D

  # Gradients: per layer forward, d(weights) and d(activations) in the loops; the output
  # layer's three outside them. Weight gradients are all-reduced over the 8 devices.
  grad = jax.jit(jax.grad(_loss)).lower(params, x).compile()
  s = hlo.summarize(grad.as_text())
  assert [l.trip_count for l in s.loops] == [3, 3]
  assert s.matmul_flops == 3 * 3 * 2 * m * D * D + 3 * 2 * m * D * F
  ar = s.collective("all-reduce")
  # Each layer's d(w) [D, D] inside the backward loop, d(b) [D, F] outside it.
  assert ar.bytes == (3 * D * D + D * F) * 4
  assert ar.count > ar.ops  # the in-loop all-reduce runs 3 times
  assert ar.bytes_sent == pytest.approx(2 * 7 / 8 * ar.bytes)

  report = fnscale.compile_report(jax.jit(jax.grad(_loss)), params, x)
  assert report.matmul_flops == s.matmul_flops
  assert report.collectives == s.collectives
  # XLA's cost analysis sees each loop body once: fewer FLOPs than the matmuls alone.
  assert report.flops < s.matmul_flops
  text = str(report)
  assert "loop trip counts applied" in text and "loop bodies once" in text


@pytest.mark.tpu
def test_tpu_convolutions_and_condition_trip_counts(tpu_devices):
  mesh = fnscale.make_mesh("data=8", devices=tpu_devices("v5e:2x4"))
  params, x = _abstract(mesh)
  compiled = jax.jit(jax.grad(_loss)).trace(params, x).lower().compile()
  s = hlo.summarize(compiled.as_text())
  # The TPU compiler writes matmuls as `convolution` and drops known_trip_count.
  assert [(l.trip_count, l.from_condition) for l in s.loops] == [(3, True), (3, True)]
  assert s.unread == hlo.Unread() and s.kernels == ()  # read in full
  m = M // 8
  assert s.matmul_flops == 3 * 3 * 2 * m * D * D + 3 * 2 * m * D * F
  assert s.collective("all-reduce").bytes == (3 * D * D + D * F) * 4


def _valid_taps(size_in, size_out, window, pad_lo):
  """Brute force: (output, tap) pairs whose input index is inside [0, size_in)."""
  return sum(1 for o in range(size_out) for w in range(window) if 0 <= o + w - pad_lo < size_in)


def test_convolution_counts_only_window_taps_on_the_input():
  # The TPU compiler writes a batched dot (heads h=4) as a convolution whose lhs has a
  # spatial dim of size 1 padded by 3 on each side under a window of 4: each output head
  # meets exactly one real tap. A count of the whole window would be 4x too high.
  line = ("%c = bf16[64,4,16,1]{3,2,1,0} convolution(bf16[64,2,8,1]{3,2,1,0} %a, "
          "bf16[2,8,4,16]{3,2,1,0} %b), window={size=4x2 pad=3_3x0_0 rhs_reversal=1x0}, "
          "dim_labels=b1f0_1i0o->b0f1")
  # out[b, h, o] = sum over the 2 x 8 (spatial 1, feature) pairs: a [64,16] x [16,16] dot per head.
  assert hlo.matmul_flops(line) == 2 * 64 * 4 * 16 * (2 * 8)
  # A 3x3 "same" image convolution on 8x8: border outputs see fewer than 9 pixels.
  img = ("%y = f32[2,8,8,5]{3,2,1,0} convolution(f32[2,8,8,3]{3,2,1,0} %x, "
         "f32[3,3,3,5]{3,2,1,0} %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f")
  taps = _valid_taps(8, 8, 3, 1) ** 2
  assert taps == 484  # not 8 * 8 * 9 = 576
  assert hlo.matmul_flops(img) == 2 * 2 * 5 * taps * 3


def test_unrolled_loop_counter_steps_by_its_increment():
  # XLA unrolls windowed-einsum loops by 2: the body does two steps' work and adds 2 to the
  # counter, so `i < 4` means 2 trips, not 4.
  text = (LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
          .replace("%one = s32[] constant(1)", "%one = s32[] constant(2)"))
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 2, True),)
  assert s.matmul_flops == 2 * (2 * 16 * 32 * 32) + 2 * 8 * 32 * 16
  # A counter that starts at 3 (the init tuple's constant) runs ceil((4 - 3) / 2) = 1 trip.
  started = text.replace("%zero = s32[] constant(0)", "%zero = s32[] constant(3)")
  assert hlo.summarize(started).loops == (hlo.Loop("body", 1, True),)


def test_multi_line_kernel_attribute_stays_in_its_loop_body():
  # Pallas kernels (splash attention) carry JSON metadata over several lines; a continuation
  # line starting with "}}" must not end the loop body, or the body's dots lose their trips.
  attr = ('  %x = f32[16,32]{1,0} custom-call(%h), custom_call_target="tpu_custom_call", '
          'frontend_attributes={kernel_metadata={\n"xprof_metadata":"{\\"block_q\\": 512}"\n'
          '}}, metadata={op_name="pallas_call"}\n')
  text = LOOP_HLO.replace("  %w = f32[32,32]{1,0} constant({...})\n",
                          attr + "  %w = f32[32,32]{1,0} constant({...})\n")
  s = hlo.summarize(text)
  assert s.matmul_flops == 4 * (2 * 16 * 32 * 32) + 2 * 8 * 32 * 16
  assert s.collective("all-reduce").count == 4
  assert hlo.flops_ratio(text, 4 * (2 * 16 * 32 * 32) + 2 * 8 * 32 * 16) == 1.0


@pytest.mark.slow
@pytest.mark.tpu
def test_tpu_llama_step_matmul_flops_equal_the_traced_step(tpu_devices, tmp_path):
  # A remat'd 2-layer Llama step with splash attention (a Pallas kernel with multi-line
  # metadata) under FSDP on v5p:2x2x2: the HLO's matmuls must be exactly the matmuls of the
  # traced step (each device runs one of the 8 rows), no more and no fewer.
  import functools  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from recipes.lm import llama  # pylint: disable=g-import-not-at-top
  from fnscale.analysis import _trace  # pylint: disable=g-import-not-at-top
  devices = tpu_devices("v5p:2x2x2")
  cfg = llama.ModelConfig(layers=2, d_model=256, heads=2, kv_heads=1, d_mlp=512, seq=512,
                          vocab=512)
  mesh = fnscale.make_mesh({"fsdp": 8}, devices=devices)
  opt, pol = optax.adamw(1e-3), "params=float32,compute=bfloat16,output=float32"
  la = llama.logical_axes(cfg)
  state = fnscale.init_state(lambda k: llama.init_params(cfg, k), opt, mesh=mesh,
                             rules=llama.RULES, logical_axes=la, policy=pol,
                             key=jax.random.key(0), abstract=True)
  batch = {k: jax.ShapeDtypeStruct((8, 512), jnp.int32) for k in ("inputs", "targets")}
  loss = functools.partial(llama.loss_fn, remat=True)
  # XLA also writes the program's dump file (its other spelling of the same HLO).
  step = fnscale.shard_step(fnscale.train_step(loss, opt, policy=pol), mesh, rules=llama.RULES,
                            logical_axes=la, compiler_options={"xla_dump_to": str(tmp_path)}
                            ).compile(state, batch)
  text = step.compiled.as_text()
  assert "kernel_metadata={\n" in text  # the multi-line attribute is there
  # Read in full: no unread HLO; the splash kernels (attention's matmuls) are listed, not
  # counted: forward per layer (2 trips, once more under remat), and the fused backward kernel
  # (dq, dk and dv in one pass: no separate dq kernel).
  s = hlo.summarize(text)
  assert s.unread == hlo.Unread() and [l.trip_count for l in s.loops] == [2, 2]
  assert {(k.name, k.runs) for k in s.kernels} == {
      ("splash_mqa_fwd_residuals", 4), ("splash_mqa_dkv_no_residuals", 2)}
  (dump,) = tmp_path.glob("*after_optimizations.txt")
  assert hlo.summarize(dump.read_text()) == s
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), state.params)
  with jax.set_mesh(fnscale.make_mesh({"data": 1}, devices=devices[:1])):
    row = {k: jax.ShapeDtypeStruct((1, 512), jnp.int32) for k in batch}
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params, row).jaxpr
  # Hand check of the reference: forward 2 N + 2 x remat'd blocks but the last matmul of
  # each (w_down's output isn't needed to differentiate) + backward 4 N, per token.
  n_block = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512
  n = 2 * n_block + 256 * 512
  want = 512 * (6 * n + 2 * 2 * (n_block - 512 * 256))
  assert hlo.flops_ratio(text, want) == 1.0
  # The jaxpr counter (the planner's) also sees a tiny dot inside the attention wrapper that
  # XLA removes as dead code (2 x 2 x 512 x 128 per layer); the fused cross-entropy's
  # gradients are in its forward pass, so nothing is recomputed.
  assert _trace.jaxpr_matmul_flops(jaxpr) == want + 2 * (2 * 2 * 512 * 128)


@pytest.mark.tpu
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_tpu_multislice_gradients_cross_slices_over_dcn(tpu_devices, slices):
  # FSDP over the 4 chips of each v5p slice, data parallel across slices (DCN): each device's
  # gradient shard of w (f32 [256, 512] split by columns: [256, 128], 128 KiB) is all-reduced
  # across the slices, 2 (S-1)/S x 128 KiB sent per device. The TPU compiler writes those as
  # host-transfer sends of the megascale runtime; a reader that skips them counts 0.
  import optax  # pylint: disable=g-import-not-at-top
  del tpu_devices  # (skips without libtpu)
  target = "v5p:2x2x1" if slices == 1 else f"{slices}x v5p:2x2x1"
  devices = fnscale.target_devices(target)
  mesh = fnscale.make_mesh({"fsdp": 4}, dcn={"replica": slices} if slices > 1 else None,
                           devices=devices)
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  opt = optax.sgd(0.1)
  batch = {"x": jax.ShapeDtypeStruct((8 * len(devices), 256), jnp.float32)}
  with fnscale.with_mesh(mesh):
    state = fnscale.init_state(lambda k: {"w": jnp.zeros((256, 512))}, opt, mesh=mesh,
                               key=jax.random.key(0), abstract=True)
    compiled = fnscale.shard_step(fnscale.train_step(loss, opt), mesh).compile(state, batch)
  assert state.params["w"].sharding.spec == P(None, "fsdp")
  s = hlo.summarize(compiled.compiled.as_text())
  assert s.unread == hlo.Unread()
  shard = 256 * 128 * 4
  ring = 2 * (slices - 1) / slices
  # The gradient shard, plus the loss's few scalars (under 1 KiB) reduced with it.
  assert ring * shard <= s.dcn_bytes_sent <= ring * (shard + 1024)
  # Every byte across slices is an all-reduce over all of them; the groups hold them too.
  assert all((k, n) == ("all-reduce", slices) for k, n, _ in s.dcn_groups)
  assert dict(((k, n), b) for k, n, b in s.groups).get(("all-reduce", slices), 0) >= (
      s.dcn_bytes_sent)


def test_a_counter_carried_through_wide_tuples_is_read_once_per_instruction():
  # The counter passes through 6 tuples of 40 copies each before `i + 1` (as a LoRA step's
  # loop carries dozens of adapter values through fusions): read along every path that is
  # 40**6 readings, which never finished; each instruction read once, the trip count stands.
  lines, prev = [], "%i"
  for level in range(6):
    lines.append(f"  %c{level} = ({', '.join(['s32[]'] * 40)}) tuple({', '.join([prev] * 40)})")
    lines.append(f"  %g{level} = s32[] get-tuple-element(%c{level}), index={level}")
    prev = f"%g{level}"
  text = (LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
          .replace("  %j = s32[] add(%i, %one)", "\n".join(lines) + f"\n  %j = s32[] add({prev}, %one)"))
  assert hlo.summarize(text).loops == (hlo.Loop("body", 4, from_condition=True),)
