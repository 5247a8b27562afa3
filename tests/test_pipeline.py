"""Pipeline parallelism (`fnscale.parallel.pipeline`): the stage transform against a
one-device sequential reference, its traffic by hand count, its memory, its errors, and the
`stage` axis in meshes, batches, the HLO reader, the compile report and the planner."""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.analysis import _cost, hlo
from fnscale.analysis import _search
from fnscale.analysis import _verify
from fnscale.analysis import _report as fs_report

L, T, D, B = 8, 4, 8, 16  # layers, tokens per row, width, rows


def _layer(w, h, m=1.0):
  return h + jnp.tanh(h @ w["a"]) * w["b"] * m


def _stage(ws, x):
  """One stage: its layers in order (a pytree x carries a mask every layer applies)."""
  if isinstance(x, dict):
    h = jax.lax.scan(lambda h, w: (_layer(w, h, x["m"]), None), x["h"], ws)[0]
    return {"h": h, "m": x["m"]}
  return jax.lax.scan(lambda h, w: (_layer(w, h), None), x, ws)[0]


def _sequential(ws, x):
  """The reference: the 8 layers one after another on one device, no fnscale."""
  h, m = (x["h"], x["m"]) if isinstance(x, dict) else (x, 1.0)
  for i in range(L):
    h = _layer({"a": ws["a"][i], "b": ws["b"][i]}, h, m)
  return {"h": h, "m": m} if isinstance(x, dict) else h


def _loss(y):
  """A scalar of the output; of a pytree's every leaf (so every leaf's sends are needed)."""
  return jnp.mean(y["h"] ** 2 * y["m"]) if isinstance(y, dict) else jnp.mean(y ** 2)


def _weights():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"a": jax.random.normal(k1, (L, D, D)) / 3,
          "b": 1 + 0.1 * jax.random.normal(k2, (L, D))}


def _inputs(tree: bool):
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  if not tree:
    return x
  return {"h": x, "m": 0.5 + jax.random.uniform(jax.random.key(2), (B, T, 1))}


# (repeats, microbatches per stage, remat) of the four schedules each program runs.
SCHEDULES = ((1, 1, False), (1, 2, True), (2, 1, jax.checkpoint_policies.nothing_saveable),
             (2, 2, True))


def _program(stages: int, tree: bool):
  """One compiled program: loss and gradients of each schedule of `SCHEDULES` on a mesh of
  `stages` stages with FSDP inside them (each stage's weights split over "fsdp")."""
  mesh = fs.make_mesh({"stage": stages, "fsdp": 8 // stages})
  fns = [fs.parallel.pipeline(_stage, microbatches=stages * m, repeats=r, remat=remat)
         for r, m, remat in SCHEDULES]

  def losses(params, xs):  # one input each, so XLA shares no send between schedules
    return [jax.value_and_grad(lambda p, x: _loss(f(p, x)), argnums=(0, 1))(p, x)
            for f, p, x in zip(fns, params, xs)]

  ws, x = _weights(), _inputs(tree)
  staged = [fs.parallel.stage_layers(ws, stages, r) for r, _, _ in SCHEDULES]
  spec = lambda r: {"a": P("stage", *([None] * r), None, "fsdp"), "b": P("stage")}
  with fs.with_mesh(mesh):
    params = [jax.device_put(p, jax.tree.map(lambda s: NamedSharding(mesh, s), spec(r)))
              for p, (r, _, _) in zip(staged, SCHEDULES)]
    xs = [jax.device_put(x, fs.batch_sharding(mesh)) for _ in SCHEDULES]
    compiled = jax.jit(losses).lower(params, xs).compile()
    return compiled, compiled(params, xs)


@pytest.fixture(scope="module", params=[2, 4], ids=["stages2", "stages4"])
def program(request):
  stages = request.param
  return stages, *_program(stages, tree=stages == 2)


def test_loss_and_gradients_equal_the_sequential_model(program):
  # Stages 2 and 4 (FSDP of 4 and 2 inside each), repeats 1 and 2, microbatches S and 2S,
  # with and without remat; the 2-stage program's input is a pytree whose mask leaf rides
  # the pipeline. Catches microbatches put back in the wrong rows, layers run out of order
  # (the circular schedule's), a repeat started before its input arrived (the FIFO), bubble
  # iterations leaking into the gradients.
  stages, _, results = program
  ws, x = _weights(), _inputs(stages == 2)
  want_loss, (want_w, want_x) = jax.jit(jax.value_and_grad(
      lambda w, x: _loss(_sequential(w, x)), argnums=(0, 1)))(ws, x)
  for (r, m, _), (loss, (g_w, g_x)) in zip(SCHEDULES, results):
    where = f"stages {stages} repeats {r} microbatches {stages * m}"
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
    got_w = fs.parallel.unstage_layers(g_w, r)
    for k in ("a", "b"):
      np.testing.assert_allclose(got_w[k], want_w[k], rtol=1e-5,
                                 atol=1e-6 * float(jnp.abs(want_w[k]).max()), err_msg=where)
    for got, want in zip(jax.tree.leaves(g_x), jax.tree.leaves(want_x)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()),
                                 err_msg=where)


def test_collective_permutes_by_hand_count(program):
  # Per schedule and pass (forward, then the same backward): one send per iteration
  # (R M + S - 1) and S - 1 sends of M/S microbatches into stage 0 before the loop and S - 1
  # out of the last stage after it. A microbatch on one device: B / M rows over the FSDP
  # axis (8 / S devices; the stage axis holds whole microbatches), T x D float32 each; the
  # 2-stage program's input is a pytree: each hop sends its mask leaf (T x 1) too.
  stages, compiled, _ = program
  leaves, width = (2, D + 1) if stages == 2 else (1, D)
  runs = bytes_ = 0
  for r, m_per, _ in SCHEDULES:
    m = stages * m_per
    mb = B // m // (8 // stages) * T * width * 4
    loop, edges = r * m + stages - 1, stages - 1
    runs += 2 * (loop + 2 * edges) * leaves
    bytes_ += 2 * (loop * mb + 2 * edges * m_per * mb)
  s = hlo.summarize(compiled.as_text())
  got = s.collective("collective-permute")
  assert (got.count, got.bytes) == (runs, bytes_)
  assert s.unread == hlo.Unread()


def test_compile_report_gives_the_schedules_and_bubbles(program):
  # (S-1)/(R M + S - 1), by hand for S = 4: R 1 M 4: 3/7; R 1 M 8: 3/11; R 2 M 4: 3/11;
  # R 2 M 8: 3/19.
  stages, compiled, _ = program
  report = fs_report.report_from_compiled(compiled, 0.0)
  got = {(p.stages, p.repeats, p.microbatches): p.bubble for p in report.pipelines}
  if stages == 4:
    assert got == pytest.approx({(4, 1, 4): 3 / 7, (4, 1, 8): 3 / 11, (4, 2, 4): 3 / 11,
                                 (4, 2, 8): 3 / 19})
    assert "pipeline: 4 stages x 2 repeat(s), 8 microbatches: bubble 0.158" in str(report)
  else:
    assert set(got) == {(2, r, 2 * m) for r, m, _ in SCHEDULES}
  assert fs.parallel.bubble_fraction(4, 8, 2) == 3 / 19


def _memory_program(microbatches: int) -> int:
  mesh = fs.make_mesh({"stage": 2, "data": 4})
  f = fs.parallel.pipeline(_stage, microbatches=microbatches, remat=True)
  ws = fs.parallel.stage_layers(_weights(), 2)
  x = jax.ShapeDtypeStruct((256, 16, D), jnp.float32, sharding=fs.batch_sharding(mesh))
  with fs.with_mesh(mesh):
    ws = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                     sharding=NamedSharding(mesh, P("stage"))),
                      ws)
    grad = jax.grad(lambda p, x: jnp.mean(f(p, x) ** 2), argnums=(0, 1))
    return jax.jit(grad).lower(ws, x).compile().memory_analysis().temp_size_in_bytes


def test_temp_memory_does_not_grow_with_microbatches():
  # With remat of the stage function the backward pass keeps one microbatch's stage input
  # per iteration: (M + S - 1) x B/M rows, about the batch whatever M. XLA's own memory
  # analysis of the compiled programs at M = 2 and M = 8 (4x): within 1.25x.
  small, large = _memory_program(2), _memory_program(8)
  assert large <= 1.25 * small, (small, large)


# ----------------------------------------------------------------------------- bad input


def _trace(f, params, x):
  return jax.jit(f).trace(params, x)


def test_bad_input_is_an_fnscale_error_naming_the_fix():
  mesh = fs.make_mesh({"stage": 4, "data": 2})
  ws, x = _weights(), _inputs(False)
  staged = fs.parallel.stage_layers(ws, 4)
  f = fs.parallel.pipeline(_stage, microbatches=4)
  with pytest.raises(fs.MeshError, match=r"none is set; fix: call the pipelined function "
                                         r"under fnscale.with_mesh"):
    _trace(f, staged, x)
  with fs.with_mesh(fs.make_mesh({"data": 8})):
    with pytest.raises(fs.MeshError, match=r"over mesh axis 'stage', which the mesh \(axes "
                                           r"\{'data': 8\}\) lacks; fix: add it"):
      _trace(f, staged, x)
  with fs.with_mesh(mesh):
    with pytest.raises(fs.StepError, match=r"microbatches=2 with 4 stages.*fix: "
                                           r"microbatches=4"):
      _trace(fs.parallel.pipeline(_stage, microbatches=2), staged, x)
    with pytest.raises(fs.StepError, match=r"microbatches=6 with 4 stages.*fix: "
                                           r"microbatches=8"):
      _trace(fs.parallel.pipeline(_stage, microbatches=6), staged, x)
    with pytest.raises(fs.StepError, match=r"a batch of 12 rows does not split into "
                                           r"microbatches=8"):
      _trace(fs.parallel.pipeline(_stage, microbatches=8), staged, x[:12])
    with pytest.raises(fs.ShardingError, match=r"leaf 'a' has shape \(8, 8, 8\), expected "
                                               r"leading dims \(4,\).*stage_layers"):
      _trace(f, ws, x)  # the layer stack, not stacked by stage
    with pytest.raises(fs.ShardingError, match=r"leaf 'b' has shape \(4, 8\), expected "
                                               r"leading dims \(4, 2\)"):
      _trace(fs.parallel.pipeline(_stage, microbatches=4, repeats=2),
             {"a": fs.parallel.stage_layers(ws, 4, 2)["a"], "b": ws["b"][:4]}, x)
    with pytest.raises(fs.StepError, match=r"stage_fn maps a microbatch .* to .*float16"):
      _trace(fs.parallel.pipeline(lambda w, h: _stage(w, h).astype(jnp.float16), microbatches=4),
             staged, x)
    inside = jax.shard_map(lambda p, x: f(p, x), mesh=mesh, in_specs=P("stage"),
                           out_specs=P("stage"), axis_names={"stage"})
    with pytest.raises(fs.MeshError, match="already manual"):
      _trace(inside, staged, x)
  with pytest.raises(fs.ShardingError, match=r"8 layers are not divisible by stages x "
                                             r"repeats = 4 x 3"):
    fs.parallel.stage_layers(ws, 4, 3)
  with pytest.raises(fs.StepError, match=r"microbatches=0"):
    fs.parallel.pipeline(_stage, microbatches=0)


def test_stage_layers_orders_layers_for_the_circular_schedule():
  # Layer l = (r S + s) K + k runs on stage s at repeat r: with 8 layers, 2 stages and 2
  # repeats (K = 2), stage 0 holds layers 0, 1 (repeat 0) and 4, 5 (repeat 1).
  layers = jnp.arange(8)
  assert fs.parallel.stage_layers(layers, 2, 2).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
  assert fs.parallel.stage_layers(layers, 4).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
  staged = fs.parallel.stage_layers(layers, 2, 2)
  assert fs.parallel.unstage_layers(staged, 2).tolist() == list(range(8))


# ----------------------------------------------------------------------------- the axis


def test_stage_axis_splits_the_batch_and_kernels_inside_a_stage():
  # Outside the pipeline the stage axis splits the batch (fnscale's and MaxText's
  # conventions); inside it the stage axis is manual, so an attention kernel's shard_map
  # splits the microbatch over the other data axes only and the kernel serves the call (no
  # fallback for a batch "not divisible by stage x data").
  mesh = fs.make_mesh({"stage": 2, "data": 4})
  assert fs.batch_sharding(mesh).spec == P(("stage", "data"))
  assert fs.FNSCALE_AXES.stage == ("stage",) and fs.MAXTEXT_AXES.stage == ("stage",)
  plans = []

  def stage(w, x):
    q = jnp.broadcast_to(x[:, :, None, :1], x.shape[:2] + (2, 128)).astype(jnp.float32)
    plans.append(fs.kernels.kernel_selection(q, q.shape, causal=True))
    return x * w

  x = jax.ShapeDtypeStruct((16, 128, D), jnp.float32, sharding=fs.batch_sharding(mesh))
  w = jax.ShapeDtypeStruct((2, D), jnp.float32, sharding=NamedSharding(mesh, P("stage")))
  with fs.with_mesh(mesh):
    fn = fs.with_kernel(fs.parallel.pipeline(stage, microbatches=2), interpret=True)
    jax.jit(fn).trace(w, x)
  (plan,) = plans
  assert (plan.implementation, plan.fallback, plan.batch_axes) == ("splash", False, ("data",))


@pytest.mark.tpu
def test_stages_run_across_slices_by_default(tpu_devices):
  del tpu_devices  # (skips without libtpu)
  devices = fs.target_devices("2x v5p-8")
  mesh = fs.make_mesh({"stage": 2, "fsdp": 4}, devices=devices)
  assert dict(mesh.shape) == {"stage": 2, "fsdp": 4}
  assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
  assert "stage      size    2  Auto     DCN (across slices)" in fs.describe_mesh(mesh)
  # Within a slice where asked: data parallel across the slices, stages inside each.
  mesh = fs.make_mesh({"stage": 4}, dcn={"replica": 2}, devices=devices)
  assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
  assert dict(mesh.shape) == {"replica": 2, "stage": 4}


# ----------------------------------------------------------------------------- HLO reader

# Two of the stage-to-stage sends of MaxText 0.2.5's own 2-slice pipeline step (Llama-3-8B
# shapes, 8 layers, dcn_pipeline_parallelism=2, circular, 4 microbatches; libtpu's compiled
# program, recipes/bench/compare_maxtext.py), inside a loop of its 17 iterations.
_PAIRS = ("{{100000->200000},{200000->100000},{100002->200002},{200002->100002},"
          "{100001->200001},{200001->100001},{100003->200003},{200003->100003}}")


def _send(n: int, pairs: str) -> str:
  attrs = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
           f'"xla_megascale_runtime",_xla_host_transfer_rendezvous="ppermute.{n}_0",'
           f'_xla_megascale_target={pairs},_xla_megascale_transfer_type="ONE_TO_ONE"}}')
  shape = "bf16[1,1,4096,4096]{2,3,1,0:T(8,128)(2,1)}"
  return "\n".join([
      f"  %after-all.{n} = token[] after-all()",
      f"  %send.{n} = ({shape}, u32[]{{:S(2)}}, token[]) send(%x, %after-all.{n}), "
      f"channel_id={2 * n}, {attrs}",
      f"  %recv.{n} = ({shape}, u32[]{{:S(2)}}, token[]) recv(%after-all.{n}), "
      f"channel_id={2 * n + 1}, {attrs}",
      f"  %send-done.{n} = token[] send-done(%send.{n}), channel_id={2 * n}, {attrs}",
      f"  %recv-done.{n} = ({shape}, token[]) recv-done(%recv.{n}), channel_id={2 * n + 1}, "
      f"{attrs}"])


def _loop_module(body: str) -> str:
  return "\n".join([
      "HloModule m, num_partitions=8", "",
      "%body (p: (s32[], bf16[1,1,4096,4096])) -> (s32[], bf16[1,1,4096,4096]) {",
      "  %p = (s32[], bf16[1,1,4096,4096]) parameter(0)",
      "  %i = s32[] get-tuple-element(%p), index=0",
      "  %x = bf16[1,1,4096,4096]{3,2,1,0} get-tuple-element(%p), index=1", body,
      "  ROOT %t = (s32[], bf16[1,1,4096,4096]) tuple(%i, %x)", "}", "",
      "%cond (p: (s32[], bf16[1,1,4096,4096])) -> pred[] {",
      "  %p = (s32[], bf16[1,1,4096,4096]) parameter(0)",
      "  ROOT %c = pred[] constant(true)", "}", "",
      "ENTRY %main (a: (s32[], bf16[1,1,4096,4096])) -> (s32[], bf16[1,1,4096,4096]) {",
      "  %a = (s32[], bf16[1,1,4096,4096]) parameter(0)",
      '  ROOT %w = (s32[], bf16[1,1,4096,4096]) while(%a), condition=%cond, body=%body, '
      'backend_config={"known_trip_count":{"n":"17"}}', "}"])


def test_reader_counts_stage_sends_across_slices():
  # 3 sends a loop iteration x 17 iterations = 51 runs of 4096 x 4096 bf16 (32 MiB), each
  # sent once by a device: all across slices (slice 1's chip k and slice 2's). MaxText's
  # whole step has two such loops (forward, backward): 102 runs, 3,264 MiB
  # (recipes/bench/compare_maxtext.py). A reader that leaves them unread counts 0.
  text = _loop_module("\n".join(_send(n, _PAIRS) for n in (1, 2, 3)))
  s = hlo.summarize(text)
  assert s.unread == hlo.Unread()
  mib32 = 4096 * 4096 * 2
  assert s.collective("collective-permute") == hlo.Collective(
      "collective-permute", 51, 51 * mib32, 3, 51.0 * mib32)
  assert s.dcn_groups == (("collective-permute", 2, 51.0 * mib32),)
  assert s.dcn_bytes_sent == 51 * mib32
  # Pairs within one slice are no DCN traffic the runtime would carry: unread, not counted.
  inside = _loop_module(_send(1, "{{100000->100001},{100001->100000}}"))
  assert hlo.summarize(inside).unread.ops == (("send ONE_TO_ONE", 1),)


# ----------------------------------------------------------------------------- planner


def _profile(**kw) -> _cost.Profile:
  base = dict(params=1_000, param_bytes=4e9, opt_bytes=8e9, compute_bytes=2e9,
              grad_bytes=4e9, flops_row=1e12, flops_row_remat=1.3e12, act_row=1e8,
              act_row_remat=1e7, layers=8, stream_row=4096 * 4096 * 2, rows=32,
              has_remat=True, stack_layers=8, stack_bytes=1.5e9,
              stack_stream_row=4096 * 4096 * 2, stack_flops_row=0.75e12)
  return _cost.Profile(**{**base, **kw})


def test_planner_costs_the_bubble_and_the_stage_sends():
  # 2 slices of v5p-8 (4 chips each); fsdp=4 within, 2 stages across; 32 rows, M = 8.
  # A device's rows outside the pipeline: 32 / (2 x 4) = 4; a microbatch on one device:
  # 32 / 8 / 4 = 1 row of 4096 x 4096 bf16 (32 MiB). Sends per step, by hand: 2 passes x
  # (8 + 2 - 1 iterations + 2 x (2 - 1) x 8 / 2 microbatches at the edges) = 2 x 17 = 34.
  # The stack is 1.5 of the 2 GB compute-dtype params (0.75). Outside it the stage axis is a
  # data axis: a ring all-reduce of the rest's gradients' fsdp shard, 2 x 1/2 x 4e9 x 0.25 / 4.
  hw = fs.analysis.hardware("2x v5p-8")
  prof = _profile()
  est = _cost.estimate(prof, hw, {"fsdp": 4}, {"stage": 2}, False, 1, microbatches=8)
  sends = 34 * 4096 * 4096 * 2
  rest = 2 * 0.5 * 4e9 * (1 - 0.75) / 4
  assert est.comm_s["stage"] == pytest.approx((sends + rest) / hw.links.dcn)
  # The bubble: the stack's FLOPs (0.75 of them) run (M + S - 1) / M = 9/8 as long.
  plain = _cost.estimate(prof, hw, {"fsdp": 4}, {"replica": 2}, False, 1)
  assert est.compute_s - est.memory_s == pytest.approx(
      (plain.compute_s - plain.memory_s) * (0.25 + 0.75 * 9 / 8))
  # A stage holds its half of the stack: params 4e9 x (0.25 + 0.75 / 2) / 4 (fsdp).
  assert est.params == pytest.approx(4e9 * 0.625 / 4)
  row = fs.analysis.predict(prof, "2x v5p-8", fs.MeshAxes({"fsdp": 4}, {"stage": 2}),
                                 microbatches=8)
  assert row.stages == 2 and row.bubble == pytest.approx(1 / 9)
  # Within one slice, stages are candidates only for a model whose compute-dtype weights
  # exceed one device's HBM (95 GiB on v5p): 2 and 4 stages of v5p-8's 4 chips.
  meshes = _search._stage_meshes  # pylint: disable=protected-access
  one = fs.analysis.hardware("v5p-8")
  assert meshes(prof, one, 8) == []
  big = {m.ici.get("stage") for m in meshes(prof._replace(compute_bytes=200e9), one, 8)}
  assert big == {2, 4}


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_planner_proposes_stages_across_slices_for_a_pipelined_loss():
  # A loss that takes `microbatches` gets pipeline rows on a multi-slice target; a stage's
  # microbatches split every device's rows (at most 8 a stage): 32 rows over 2 stages x
  # data x fsdp devices -> 32 / (2 d f) a device, so M = 2 x min(8, 32 / (2 d f)).
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=32, heads=4, kv_heads=2,
                           d_mlp=64)
  batch = {k: jax.ShapeDtypeStruct((32, 16), jnp.int32) for k in ("inputs", "targets")}
  p = fs.analysis.plan(functools.partial(llama.init_params, cfg), llama.loss_fn,
                       optax.adamw(1e-3), batch, "2x v5p-8",
                       fs.analysis.PlanOptions(rules=llama.RULES,
                                               logical_axes=llama.logical_axes(cfg), verify=0))
  staged = [r for r in p.rows if r.stages > 1]
  assert staged and all(r.axes.dcn == {"stage": 2} for r in staged)
  for r in staged:
    rows = 32 // (2 * r.axes.ici.get("data", 1) * r.axes.ici.get("fsdp", 1))
    assert r.microbatches == 2 * min(8, rows), r
  assert {r.axes.dcn.get("replica") for r in p.rows if r.stages == 1} == {2}
  assert p.profile.stack_layers == 2
  table = fs.analysis.format_plan(p, top=len(p.rows))
  assert "M=8 bubble 0.11" in table and "M=16 bubble 0.06" in table


def test_planner_compiles_the_pipelined_program_it_costs(monkeypatch):
  # Verifying a pipeline row compiles the loss with that row's microbatches on its mesh.
  from fnscale import _step as step_module  # pylint: disable=import-outside-toplevel
  from fnscale.analysis import _targets  # pylint: disable=import-outside-toplevel
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  seen = {}

  class Stop(Exception):
    pass

  def train_step(loss, optimizer, **kw):
    del optimizer, kw
    seen.update(loss.keywords)
    raise Stop

  monkeypatch.setattr(step_module, "train_step", train_step)  # as plan calls it
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=32, heads=4, kv_heads=2,
                           d_mlp=64)
  params = jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0))
  batch = {k: jax.ShapeDtypeStruct((32, 16), jnp.int32) for k in ("inputs", "targets")}
  prof = _cost.profile(params, llama.loss_fn, optax.adamw(1e-3), batch)
  hw = _targets.resolve("cpu", (1e10, 1e9))
  cand = fs.analysis.predict(prof, "cpu", fs.MeshAxes({"stage": 2, "data": 4}, {}),
                                  remat=True, microbatches=4, cpu_rates=(1e10, 1e9))
  ctx = (params, llama.loss_fn, optax.adamw(1e-3), batch, None, llama.RULES,
         llama.logical_axes(cfg), prof, None)
  with pytest.raises(Stop):
    _verify.compile_candidate(cand, hw, ctx)
  assert seen == dict(remat=True, microbatches=4)


# ----------------------------------------------------------------------------- slow tier


@pytest.mark.slow
@pytest.mark.tpu
def test_two_slice_step_sends_only_stage_activations_and_the_data_parallel_reduction(
    tpu_devices):
  # A 2-slice v5p target (4 chips a slice), 2 stages across the slices (make_mesh's default
  # for a "stage" axis of the slice count), FSDP over the 4 chips inside each; a weight
  # outside the pipeline (w_in, replicated over stages) and 8 layers in a circular schedule
  # (R 2, M 4). Across slices, by hand: the stage sends, per pass (R M + S - 1) = 9
  # iterations of one microbatch plus 2 x (S - 1) x M/S = 4 microbatches at the edges, twice
  # a step: 26 microbatches of B/M / 4 = 2 rows x 128 x 256 float32 (256 KiB); and w_in's
  # gradient shard (256 x 256 / 4 float32, 64 KiB) all-reduced over the 2 slices (2 x 1/2 of
  # it), with the loss's scalars. Nothing else crosses: the stack's gradients stay on their
  # stage.
  del tpu_devices  # (skips without libtpu)
  devices = fs.target_devices("2x v5p:2x2x1")
  mesh = fs.make_mesh({"stage": 2, "fsdp": 4}, devices=devices)
  assert mesh.axis_names == ("stage", "fsdp")
  d, t, b, m = 256, 128, 32, 4
  stage_fn = lambda ws, h: jax.lax.scan(lambda h, w: (_layer(w, h), None), h, ws)[0]
  f = fs.parallel.pipeline(stage_fn, microbatches=m, repeats=2)
  loss = lambda p, batch: jnp.mean(f(p["stack"], batch["x"] @ p["w_in"]) ** 2)
  init = lambda k: {"w_in": jnp.zeros((d, d)), "stack": {"a": jnp.zeros((2, 2, 2, d, d)),
                                                         "b": jnp.zeros((2, 2, 2, d))}}
  axes = {"w_in": (None, "embed"), "stack": {"a": ("stage", None, None, None, "embed"),
                                             "b": ("stage", None, None, None)}}
  rules = (("stage", "stage"), ("embed", "fsdp"))
  opt = optax.sgd(0.1)
  batch = {"x": jax.ShapeDtypeStruct((b, t, d), jnp.float32)}
  with fs.with_mesh(mesh):
    state = fs.init_state(init, opt, mesh=mesh, rules=rules, logical_axes=axes,
                          key=jax.random.key(0), abstract=True)
    compiled = fs.shard_step(fs.train_step(loss, opt), mesh).compile(state, batch)
  s = hlo.summarize(compiled.compiled.as_text())
  assert s.unread == hlo.Unread()
  across = {(k, n): v for k, n, v in s.dcn_groups}
  assert set(across) == {("all-reduce", 2), ("collective-permute", 2)}
  assert across[("collective-permute", 2)] == 26 * (b // m // 4) * t * d * 4
  assert 64 * 1024 <= across[("all-reduce", 2)] <= 64 * 1024 + 1024
  report = fs.compile_report(compiled, state, batch)
  assert report.pipelines == (fs.parallel.Schedule(2, 4, 2),)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_axes,repeats", [({"stage": 4, "data": 2}, 1),
                                               ({"stage": 2, "fsdp": 4}, 2)])
def test_llama_pipelined_step_equals_one_device(mesh_axes, repeats):
  # recipes/lm/llama.py's blocks through the pipeline inside fnscale's compiled step
  # (train_step, shard_step, with_kernel, remat of each block): the gradients the step's
  # optimizer receives (it keeps them as its state) equal the one-device ones (float32, rtol
  # 1e-5), flat layers split into 4 contiguous stages, or a circular layout of 2 stages x 2
  # repeats with FSDP inside.
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.model_config("llama-tiny", 16, layers=4, d_model=32, heads=4, kv_heads=2,
                           d_mlp=64, stages=mesh_axes["stage"], repeats=repeats)
  params = llama.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (16, 17), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  flat = {**params, "blocks": fs.parallel.unstage_layers(params["blocks"], repeats)
          if repeats > 1 else params["blocks"]}
  want = jax.jit(jax.grad(llama.loss_fn))(flat, batch)
  mesh = fs.make_mesh(mesh_axes)
  keep = lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g)
  opt = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), keep)
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                          rules=llama.RULES, logical_axes=llama.logical_axes(cfg),
                          key=jax.random.key(0))
    assert state.params["blocks"]["wq"].sharding.spec[0] == "stage"
    step = fs.train_step(functools.partial(llama.loss_fn, remat=True, microbatches=8), opt)
    new, _ = fs.shard_step(fs.with_kernel(step, attention="auto"), mesh, donate=False)(
        state, batch)
  got = new.opt_state
  if repeats > 1:
    got = {**got, "blocks": fs.parallel.unstage_layers(got["blocks"], repeats)}
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.abs(w).max()),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("spec", [P(), P(None, None, "stage")], ids=["whole", "stage-on-d"])
def test_explicit_axes_take_params_not_split_over_the_stages(spec):
  # On Explicit axes jax's shard_map takes only params whose stage dim is on the stage
  # axis: params replicated, or split over "stage" on another dim, are moved there first
  # (jax 0.12 refuses them otherwise; 0.10.2 checks only a shard_map manual over every axis).
  mesh = fs.make_mesh({"stage": 4, "data": 2}, axis_types="explicit")
  ws, x = _weights(), _inputs(False)
  with fs.with_mesh(mesh):
    staged = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(
        mesh, P(*tuple(spec)[:a.ndim]))), fs.parallel.stage_layers(ws, 4))
    y = jax.jit(fs.parallel.pipeline(_stage, microbatches=8))(staged, x)
  np.testing.assert_allclose(y, _sequential(ws, x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_explicit_axes_equal_the_sequential_model():
  # On a mesh of Explicit axes (shardings in the types) the reshapes into and out of the
  # stages say their shardings: loss and gradients as the sequential model's.
  mesh = fs.make_mesh({"stage": 4, "data": 2}, axis_types="explicit")
  ws, x = _weights(), _inputs(False)
  f = fs.parallel.pipeline(_stage, microbatches=8, repeats=2, remat=True)
  grad = jax.value_and_grad(lambda p, x: jnp.mean(f(p, x) ** 2), argnums=(0, 1))
  with fs.with_mesh(mesh):
    staged = jax.device_put(fs.parallel.stage_layers(ws, 4, 2), NamedSharding(mesh, P("stage")))
    loss, (g_w, g_x) = jax.jit(grad)(staged, jax.device_put(x, fs.batch_sharding(mesh)))
  want_loss, (want_w, want_x) = jax.jit(jax.value_and_grad(
      lambda w, x: jnp.mean(_sequential(w, x) ** 2), argnums=(0, 1)))(ws, x)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  got_w = fs.parallel.unstage_layers(jax.tree.map(np.asarray, g_w), 2)
  for got, want in zip(jax.tree.leaves(got_w) + [np.asarray(g_x)],
                       jax.tree.leaves(want_w) + [want_x]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_train_lm_runs_llama_through_the_pipeline(work, tmp_path):
  # `train_lm --model_config=llama-tiny --mesh=data=2,stage=4` on 8 CPU devices, end to
  # end: the blocks split into 4 stages (each device holds its stage's layers), 8
  # microbatches, and after 3 steps the same params as the data-parallel run on the same
  # batches (float32; AdamW).
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  common = dict(model_config="llama-tiny", seq=16, global_batch=16, steps=3,
                dataset=str(work / "corpus.txt"), eval_batches=1, sample_len=4,
                checkpoint=False)
  piped = train_lm.train_lm(mesh="data=2,stage=4", microbatches=8,
                            run_dir=str(tmp_path / "pipe"), **common)
  plain = train_lm.train_lm(mesh="data=8", run_dir=str(tmp_path / "plain"), **common)
  assert piped.mesh == {"data": 2, "stage": 4}
  wq = piped.state.params["blocks"]["wq"]
  assert wq.sharding.spec[0] == "stage" and wq.addressable_shards[0].data.shape[0] == 1
  got, want = (jax.tree.map(np.asarray, jax.device_get(s.state.params)) for s in (piped, plain))
  # AdamW's step divides by the gradient's rms, so a gradient element near 0 turns the sum's
  # order (microbatches, stages) into up to ~1e-6 of a 3e-3 learning rate's steps.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  with pytest.raises(fs.InputError, match=r"--microbatches=8 on mesh .*: pipeline stages need "
                                          r".* a mesh with a 'stage' axis"):
    train_lm.train_lm(mesh="data=8", microbatches=8, run_dir=str(tmp_path / "bad"), **common)


@pytest.mark.slow
@pytest.mark.tpu
def test_planner_verifies_stages_across_slices_by_compiling(tpu_devices):
  # plan() on 2 slices of v5p-8 for a pipelined Llama: its pipeline rows (stages across the
  # slices) are compiled for the target's described devices like any row, and the compiled
  # program's DCN traffic is costed on the stage axis (its sends and the reduction of the
  # weights outside the stack).
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  del tpu_devices  # (skips without libtpu)
  cfg = llama.model_config("llama-tiny", 128, layers=4, d_model=128, heads=4, kv_heads=2,
                           d_mlp=256)
  batch = {k: jax.ShapeDtypeStruct((32, 128), jnp.int32) for k in ("inputs", "targets")}
  p = fs.analysis.plan(functools.partial(llama.init_params, cfg), llama.loss_fn,
                       optax.adamw(1e-3), batch, "2x v5p-8",
                       fs.analysis.PlanOptions(rules=llama.RULES,
                                               logical_axes=llama.logical_axes(cfg), verify=0))
  hw = fs.analysis.hardware("2x v5p-8")
  row = next(r for r in p.rows if r.stages == 2 and r.axes.ici == {"fsdp": 4})
  ctx = (jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0)),
         llama.loss_fn, optax.adamw(1e-3), batch, None, llama.RULES, llama.logical_axes(cfg),
         p.profile, None)
  done = _verify.compile_candidate(row, hw, ctx)
  assert done.compiled is not None and done.fits and done.compiled.matmul_flops > 0
  assert done.forecast.step_s >= done.compiled.comm_s > 0


def test_reader_reads_asynchronous_calls_on_the_sparsecore():
  # libtpu with jax 0.12 runs a pipelined Llama's label gather on the SparseCore as an
  # asynchronous call (start / update / done; its computation ends with the line
  # `}, execution_thread="sparsecore"`). The called computation is read once, as any (here
  # a dot of 2 x 8 x 16 x 4 FLOPs); a reader that ends computations only at "}" merges the
  # next computation into it, and one that doesn't know the ops leaves them unread.
  text = "\n".join([
      "HloModule m, num_partitions=8", "",
      "%called_computation (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {",
      "  %p0 = f32[8,16]{1,0} parameter(0)",
      "  %p1 = f32[16,4]{1,0} parameter(1)",
      "  ROOT %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}",
      '}, execution_thread="sparsecore"', "",
      "ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {",
      "  %a = f32[8,16]{1,0} parameter(0)",
      "  %b = f32[16,4]{1,0} parameter(1)",
      "  %start = ((f32[8,16]{1,0}, f32[16,4]{1,0}), f32[8,4]{1,0}, u32[]{:S(8)}) "
      'call-start(%a, %b), async_execution_thread="sparsecore", '
      "to_apply=%called_computation",
      "  %update = ((f32[8,16]{1,0}, f32[16,4]{1,0}), f32[8,4]{1,0}) call-update(%start)",
      "  %done = f32[8,4]{1,0} call-done(%update)",
      "  ROOT %out = f32[8,4]{1,0} add(%done, %done)", "}"])
  s = hlo.summarize(text)
  assert s.unread == hlo.Unread() and s.matmul_flops == 2 * 8 * 16 * 4
