"""fs.compile_report and shard_step's compile options against independent references.

Public API only. Each number is a hand count from the shapes below, the arrays' own
addressable shards, or what the compiled executable itself carries.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

N = 8
B, DIN, DH, DOUT = 512, 64, 128, 32  # rows, input, hidden and output widths of the MLP


def _init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (DIN, DH), jnp.float32) / DIN**0.5,
          "w2": jax.random.normal(k2, (DH, DOUT), jnp.float32) / DH**0.5}


def _loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.mean(jnp.square(h @ params["w2"] - batch["y"]))


def _batch(key=None):
  kx, ky = jax.random.split(jax.random.key(1) if key is None else key)
  return {"x": jax.random.normal(kx, (B, DIN), jnp.float32),
          "y": jax.random.normal(ky, (B, DOUT), jnp.float32)}


# Matmul FLOPs of one step, 2 per multiply-add: forward x@w1 and h@w2; backward dW2 = h^T dy,
# dh = dy w2^T and dW1 = x^T dh (no dx: x is data, not a param).
STEP_FLOPS = 2 * B * DIN * DH + 2 * B * DH * DOUT + 2 * (2 * B * DH * DOUT) + 2 * B * DIN * DH
PARAM_BYTES = (DIN * DH + DH * DOUT) * 4


def _compiled(mesh_spec, opt=None, **kw):
  mesh = fs.make_mesh(mesh_spec)
  opt = opt or optax.sgd(0.1)
  state = fs.init_state(_init, opt, mesh=mesh, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(_loss, opt), mesh, **kw).compile(state, _batch())
  return mesh, state, step


def _per_device_bytes(tree):
  """{device: bytes} summed over the addressable shards of every leaf."""
  per = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return per


def test_matmul_flops_are_the_hand_count_split_over_devices():
  _, state, step = _compiled(f"data={N}")
  report = fs.compile_report(step, state, _batch())
  assert STEP_FLOPS == 2 * 512 * (64 * 128 * 2 + 128 * 32 * 3)  # 3,670,016
  # Data parallel: each device does exactly 1/8 of the step's matmuls.
  assert report.matmul_flops == STEP_FLOPS / N
  # Replicated data parallelism all-reduces every gradient once per step (plus the loss and
  # the gradient norm's scalars).
  ar = report.collective("all-reduce")
  assert PARAM_BYTES <= ar.bytes <= PARAM_BYTES + 64
  assert ar.bytes_sent == pytest.approx(2 * (N - 1) / N * ar.bytes)
  assert report.collective("all-gather").count == 0
  # Given the model's own count, the report says the program does exactly that work (a
  # program with a duplicated matmul would read 1.5 or more; None without the count).
  assert report.flops_ratio is None and report.model_flops is None
  checked = fs.compile_report(step, state, _batch(), model_flops=STEP_FLOPS / N)
  assert checked.model_flops == STEP_FLOPS / N and checked.flops_ratio == 1.0
  assert "1.000 x the model's" in str(checked)
  with pytest.raises(fs.StepError, match=r"model_flops is .*expected a positive number"):
    fs.compile_report(step, state, _batch(), model_flops=0)


def test_fsdp_all_gather_bytes_are_the_params_times_n_minus_one_over_n():
  _, state, step = _compiled(f"fsdp={N}")
  # Both matrices are split 8 ways (automatic FSDP over their 128-wide dimension).
  assert {k: v.sharding.spec for k, v in state.params.items()} == {
      "w1": jax.sharding.PartitionSpec(None, "fsdp"),
      "w2": jax.sharding.PartitionSpec("fsdp", None)}
  report = fs.compile_report(step, state, _batch())
  ag = report.collective("all-gather")
  # Every device gathers the 7 shards it lacks of each weight, once: the gathered weights
  # serve the forward and the backward pass.
  assert ag.bytes == PARAM_BYTES
  assert ag.bytes_sent == pytest.approx(PARAM_BYTES * (N - 1) / N)
  assert report.matmul_flops == STEP_FLOPS / N


def test_argument_bytes_are_the_state_and_batch_shards_each_device_holds():
  opt = optax.adamw(1e-3)
  for spec in (f"data={N}", f"fsdp={N}"):
    mesh, state, step = _compiled(spec, opt)
    batch = jax.device_put(_batch(), fs.batch_sharding(mesh))
    per = _per_device_bytes((state, batch))
    assert len(set(per.values())) == 1, per  # every device holds the same amount
    report = fs.compile_report(step, state, batch)
    assert report.argument_bytes == next(iter(per.values())), spec
  # On fsdp=8 that is 1/8 of the params and both AdamW moments, plus the batch rows.
  assert report.argument_bytes <= 3 * PARAM_BYTES / N + (B * (DIN + DOUT) * 4) / N + 64


def _reference_params(opt, steps):
  """The same training written with plain jax.jit on one device."""
  params = _init(jax.random.key(0))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for i in range(steps):
    params, opt_state = step(params, opt_state, _batch(jax.random.key(10 + i)))
  return jax.device_get(params)


# How jax hands compile options to XLA: a map entry of the executable's CompileOptions
# (env_option_overrides: name -> OptionOverrideProto), serialized with the executable.
# Protobuf wire format of ("xla_backend_optimization_level" -> int 0) and
# ("xla_llvm_disable_expensive_passes" -> bool true).
LEVEL_0 = b"\n\x1exla_backend_optimization_level\x12\x02\x18\x00"
NO_EXPENSIVE_PASSES = b"\n!xla_llvm_disable_expensive_passes\x12\x02\x10\x01"


@pytest.mark.slow
def test_fast_compile_reaches_the_executable_and_trains_like_jax_jit():
  opt = optax.adam(1e-2)
  ref = _reference_params(opt, 3)
  for fast in (False, True):
    _, state, step = _compiled(f"data={N}", opt, fast_compile=fast)
    blob = step.compiled.runtime_executable().serialize()
    assert (LEVEL_0 in blob) == fast and (NO_EXPENSIVE_PASSES in blob) == fast
    for i in range(3):
      state, _ = step(state, _batch(jax.random.key(10 + i)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(state.params), ref)
  # Options given directly reach it the same way.
  _, _, step = _compiled(f"data={N}", opt,
                         compiler_options={"xla_backend_optimization_level": 0})
  blob = step.compiled.runtime_executable().serialize()
  assert LEVEL_0 in blob and NO_EXPENSIVE_PASSES not in blob


@pytest.mark.tpu
def test_tpu_aot_report_numbers(tpu_devices):
  """A v5p:2x2x2 step compiled on this machine: memory figures from the shapes."""
  devices = tpu_devices("v5p:2x2x2")
  assert len(devices) == N
  mesh = fs.make_mesh(f"fsdp={N}", devices=devices)
  opt = optax.sgd(0.1)
  rows, din, dh, dout = 2048, 512, 1024, 512
  shapes = {"w1": (din, dh), "w2": (dh, dout)}
  state = fs.init_state(lambda: {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}, opt,
                        mesh=mesh, abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((rows, din), jnp.float32),
           "y": jax.ShapeDtypeStruct((rows, dout), jnp.float32)}
  step = fs.shard_step(fs.train_step(_loss, opt), mesh).compile(state, batch)
  report = fs.compile_report(step, state, batch)
  assert report.platform == "tpu" and report.num_devices == N
  param_bytes = (din * dh + dh * dout) * 4            # 4 MiB
  act_bytes = rows * (din + dh + dout) * 4 // N       # x, h and y rows of one device: 2 MiB
  # Arguments: 1/8 of the params (sgd keeps no state) and of the batch, and the step counter.
  args = param_bytes // N + rows * (din + dout) * 4 // N
  assert args <= report.argument_bytes <= args + 4096
  # Outputs: the new params shard, the step counter and the metrics' scalars.
  assert param_bytes // N <= report.output_bytes <= param_bytes // N + 4096
  # Temporaries (measured 7.5 MiB): at least the hidden activations of one device's rows,
  # kept for the backward pass; at most every weight and its gradient whole plus two copies
  # of one device's activations. A step that did not split the batch would need 8x the
  # activations (16 MiB of x, h and y alone) and fails the upper bound.
  assert rows // N * dh * 4 <= report.temp_bytes <= 2 * param_bytes + 2 * act_bytes, report
  assert report.collective("all-gather").count > 0
  # Forward 2 matmuls, backward 3 (no dx for the data), split over the 8 chips.
  assert report.matmul_flops == (2 * 2 * rows * din * dh + 3 * 2 * rows * dh * dout) / N


@pytest.mark.hlo_unread_loops
def test_report_prints_what_the_hlo_reader_could_not_read():
  # A loop whose bound is data (a while_loop, not a scan): no trip count anywhere, so its
  # body's matmul counts once, and the report says so.
  def f(x, n):
    return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ c[0], c[1] + 1),
                              (x, 0))[0]
  report = fs.compile_report(f, jnp.ones((8, 8)), jnp.int32(3))
  assert len(report.hlo_unread.loops) == 1 and report.hlo_unread.count == 1
  assert report.matmul_flops == 2 * 8 * 8 * 8  # once, not 3 times
  text = str(report)
  assert "  HLO not read (1; the figures above leave it out or guess)" in text
  assert f"    loop without a trip count (body {report.hlo_unread.loops[0]}), counted once" in text
  # A program read in full prints no such section.
  clean = fs.compile_report(lambda x, y: x @ y, jnp.ones((8, 4)), jnp.ones((4, 8)))
  assert clean.hlo_unread == fs.analysis.hlo.Unread() and "HLO not read" not in str(clean)


def test_report_lines_for_each_kind_of_unread_item_and_kernels():
  unread = fs.analysis.hlo.Unread(ops=(("custom-call __onednn$matmul", 2), ("dot", 1)),
                         loops=("body.7",), groups=(("all-gather", 3),))
  kernels = (fs.analysis.hlo.Kernel("splash_mqa_fwd", "tpu_custom_call", 1, 2),
             fs.analysis.hlo.Kernel("my_matmul", "tpu_custom_call", 1, 4, 4 * 2 * 128**3))
  report = fs.compile_report(lambda x, y: x @ y, jnp.ones((8, 4)), jnp.ones((4, 8)))
  text = str(report._replace(hlo_unread=unread, kernels=kernels))
  assert ("  HLO not read (7; the figures above leave it out or guess)\n"
          "    2 custom-call __onednn$matmul\n"
          "    1 dot\n"
          "    loop without a trip count (body body.7), counted once\n"
          "    3 all-gather with guessed replica groups (all 1 devices)\n"
          "  custom kernels (their work is not in the figures above)\n"
          "    splash_mqa_fwd          2 [1]  tpu_custom_call\n"
          "    my_matmul               4 [1]  tpu_custom_call, declares 16.78 M FLOPs") in text
