"""Context parallelism: the sequence split over a `context` mesh axis.

Attention's all-gather, ring and Ulysses forms against jax's one-device attention (float32,
causal, packed segments, GQA), the sequence order and its inverse against hand-written
layouts, the balance of causal work against hand counts, collectives, FLOPs and temporaries
against hand counts by the HLO reader, the loss on a sequence-split batch against optax, a
whole Llama step against the same step without the axis, the planner's choice of form
against hand-costed traffic, and the errors that name the fix.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.analysis import hlo
from fnscale import KernelError, ShardingError
from fnscale.parallel import context as ca
from fnscale.kernels import kernel_selection
from fnscale.parallel import context as cp

B, S, H, KH, D = 2, 64, 4, 2, 8
# Meshes over the 8 simulated devices: context 2 beside a batch and a head split, 4 beside a
# batch split, 8 alone.
MESHES = {2: {"data": 2, "context": 2, "tensor": 2}, 4: {"data": 2, "context": 4},
          8: {"context": 8}}


def _segments() -> np.ndarray:
  """Packed rows: three documents in row 0, two in row 1 (ids differ across rows)."""
  return np.array([[0] * 20 + [1] * 30 + [2] * 14, [5] * 40 + [6] * 24], np.int32)


@pytest.fixture(scope="module")
def reference():
  """(q, k, v, segment ids, weight, output, gradients): jax's own attention on one device,
  float32, causal within each segment, in sequence order."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(B, S, h, D)).astype(np.float32) for h in (H, KH, KH))
  w = rng.normal(size=(B, S, H, D)).astype(np.float32)
  seg = _segments()
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  out = attend(q, k, v)
  grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), (0, 1, 2))(q, k, v)
  return q, k, v, seg, w, np.asarray(out), [np.asarray(g) for g in grads]


def _split_run(form, order, c, inputs):
  """Output and q/k/v gradients of fnscale.attention on the sequence split c ways, inputs in
  sequence order: reordered in, restored out."""
  q, k, v, seg, w = (ca.reorder(x, c, order) for x in inputs)
  attend = fs.with_kernel(lambda q, k, v, s: fs.attention(q, k, v, causal=True, segment_ids=s),
                          context=form, context_order=order)
  def loss(q, k, v):  # the output an aux of the gradients' program, attended once
    out = attend(q, k, v, seg)
    return jnp.sum(out * w), out
  with fs.with_mesh(fs.make_mesh(MESHES[c])):
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return [ca.restore(np.asarray(x), c, order) for x in (out, *grads)]


# Quick: the balanced order at every size and the unbalanced one at 4; the rest is slow.
# Ulysses deals H = 4 heads out over the axis: not at 8 (the error test below). At 2 the
# tensor axis halves the heads first; at 2 and 4 each device gets a repeat of a kv head.
@pytest.mark.parametrize("form, c, order", [
    pytest.param(f, c, o, marks=[pytest.mark.slow] * (o == "striped" or (
        o == "contiguous" and c != 4)))
    for f in ca.FORMS for c in (2, 4, 8) for o in ca.ORDERS if (f, c) != ("ulysses", 8)])
def test_split_attention_equals_one_device_reference(form, c, order, reference):
  q, k, v, seg, w, out, grads = reference
  got = _split_run(form, order, c, (q, k, v, seg, w))
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, [out, *grads]):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)


def test_a_batch_left_in_sequence_order_is_caught_by_the_reference(reference):
  """Negative control: attention told "zigzag" on a batch that was never reordered is wrong
  (what the comparison above would catch if the order and the mask disagreed)."""
  q, k, v, seg, w, out, _ = reference
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True, segment_ids=seg),
                          context_order="zigzag")
  with fs.with_mesh(fs.make_mesh(MESHES[4])):
    wrong = np.asarray(jax.jit(attend)(q, k, v))
  assert np.abs(wrong - out).max() > 0.1


# ----------------------------------------------------------------------------- the order


def test_the_order_deals_chunks_as_written_and_restore_inverts_it():
  x = np.arange(8)[None]
  # zigzag: shard 0 holds chunks 0 and 3 of four, shard 1 chunks 1 and 2.
  assert ca.reorder(x, 2, "zigzag").tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
  assert ca.reorder(x, 4, "zigzag").tolist() == [[0, 7, 1, 6, 2, 5, 3, 4]]
  assert ca.reorder(x, 2, "striped").tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]
  assert ca.reorder(x, 2, "contiguous").tolist() == x.tolist()
  y = np.random.default_rng(1).normal(size=(3, 48, 5)).astype(np.float32)
  for order in ca.ORDERS:
    for c in (2, 3, 4, 8) if order != "zigzag" else (2, 3, 4):
      np.testing.assert_array_equal(ca.restore(ca.reorder(y, c, order), c, order), y)
    # jax arrays take the same path as numpy ones.
    np.testing.assert_array_equal(ca.reorder(jnp.asarray(y), 4, order),
                                  ca.reorder(y, 4, order))
  assert ca.positions(8, 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_reorder_batch_puts_every_sequence_leaf_in_order_with_positions():
  seg = _segments()
  batch = {"inputs": np.arange(2 * S).reshape(2, S), "segment_ids": seg,
           "weight": np.ones(2)}
  out = cp.reorder_batch(batch, 4, "zigzag")
  for key in ("inputs", "segment_ids"):
    np.testing.assert_array_equal(out[key], ca.reorder(batch[key], 4, "zigzag"))
  np.testing.assert_array_equal(out["weight"], batch["weight"])
  # Positions restart with each packed segment, and travel with their tokens.
  expected = np.array([list(range(20)) + list(range(30)) + list(range(14)),
                       list(range(40)) + list(range(24))])
  np.testing.assert_array_equal(ca.restore(out["positions"], 4, "zigzag"), expected)
  with pytest.raises(ShardingError, match="disagree"):
    cp.reorder_batch({"a": np.zeros((2, 8)), "b": np.zeros((2, 16))}, 2)


# ----------------------------------------------------------------------------- balance


def _hand_work(c: int, t: int, chunks_of) -> np.ndarray:
  """Unmasked causal pairs per shard from a mask over the whole sequence, each shard's
  query rows being the chunks `chunks_of(shard)` (chunks of t / len(chunks) tokens)."""
  mask = np.tril(np.ones((c * t, c * t), bool))
  out = []
  for s in range(c):
    pieces = chunks_of(s)
    n = t // len(pieces)
    out.append(sum(mask[p * n:(p + 1) * n].sum() for p in pieces))
  return np.array(out)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_causal_work_is_balanced_by_zigzag_and_not_by_contiguous(c):
  t = 64
  zigzag = ca.shard_work(c * t, c, "zigzag")
  contiguous = ca.shard_work(c * t, c, "contiguous")
  np.testing.assert_array_equal(zigzag, _hand_work(c, t, lambda s: (s, 2 * c - 1 - s)))
  np.testing.assert_array_equal(contiguous, _hand_work(c, t, lambda s: (s,)))
  ratio = lambda w: w.max() / w.mean()
  assert ratio(zigzag) <= 1.05 and ratio(ca.shard_work(c * t, c, "striped")) <= 1.05
  # The last shard's share: ((c - 1) t^2 + t (t + 1) / 2) / (c t (c t + 1) / 2 / c), which
  # tends to (2c - 1) / c.
  assert ratio(contiguous) == pytest.approx(
      ((c - 1) * t * t + t * (t + 1) / 2) / ((c * t) * (c * t + 1) / 2 / c))
  assert ratio(contiguous) == pytest.approx((2 * c - 1) / c, rel=0.02)


def test_causal_work_with_packed_segments_counts_each_segment():
  seg = np.repeat(np.arange(4), 16)  # four 16-token documents
  work = ca.shard_work(64, 4, "zigzag", seg)
  mask = np.tril(np.ones((64, 64), bool)) & (seg[:, None] == seg[None, :])
  rows = ca.positions(64, 4, "zigzag")
  np.testing.assert_array_equal(work, [mask[r].sum() for r in rows])


# ----------------------------------------------------------------------------- traffic


@pytest.fixture(scope="module")
def programs():
  """Optimized HLO of one attention call (forward, and forward + backward) per form on
  mesh data=2 x context=4, float32 (XLA's CPU backend computes bfloat16 in float32, and
  moves it so)."""
  mesh = fs.make_mesh(MESHES[4])
  sharded = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.NamedSharding(
      mesh, jax.P("data", "context")))
  args = (sharded(B, S, H, D), sharded(B, S, KH, D), sharded(B, S, KH, D))
  out = {}
  for form in ca.FORMS:
    f = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context=form)
    g = jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2))
    with fs.with_mesh(mesh):
      out[form] = [hlo.summarize(jax.jit(fn).lower(*args).compile().as_text())
                   for fn in (f, g)]
  return out


def test_all_gather_form_moves_the_hand_counted_kv_bytes(programs):
  forward, both = programs["all_gather"]
  c, rows = 4, B // 2
  kv = 2 * rows * S * KH * D * 4  # K and V of this device's rows, whole sequence, float32
  gather = forward.collective("all-gather")
  assert gather.bytes_sent == (c - 1) / c * kv
  assert forward.collective("collective-permute").count == 0
  # Backward: the K/V gradients reduce-scattered back, as many bytes.
  assert both.collective("reduce-scatter").bytes_sent == (c - 1) / c * kv


def test_ring_form_passes_c_minus_1_blocks_and_gathers_no_kv(programs):
  forward, both = programs["ring"]
  c, block = 4, 2 * (B // 2) * (S // 4) * KH * D * 4  # one K/V block, float32
  permute = forward.collective("collective-permute")
  assert (permute.count, permute.bytes_sent) == (c - 1, (c - 1) * block)
  assert forward.collective("all-gather").count == 0
  # Backward: K/V round again (c - 1) and their gradients' float32 accumulators round and
  # home (c).
  back = both.collective("collective-permute")
  assert back.count == 2 * (c - 1) + c
  assert back.bytes_sent == 2 * (c - 1) * block + c * block
  assert both.collective("all-gather").count == 0


def test_ulysses_form_trades_the_hand_counted_shards_all_to_all(programs):
  forward, both = programs["ulysses"]
  c, rows = 4, B // 2
  # This device's T = S / c tokens of q (H heads), of K and V (KH = 2 kv heads repeated
  # twice, so that each of the 4 devices gets one) and of the output, float32.
  shard = rows * (S // c) * H * D * 4
  swap = forward.collective("all-to-all")
  assert swap.bytes_sent == (c - 1) / c * 4 * shard
  assert forward.collective("all-gather").count == 0  # no K/V gathered (no segment ids)
  assert forward.collective("collective-permute").count == 0
  # The gradients alone: q, k, v out, the output's cotangent out and dq, dk, dv home (the
  # output itself is unused).
  assert both.collective("all-to-all").bytes_sent == (c - 1) / c * 7 * shard


def _ulysses_program(c: int, b=1, s=256, h=4, kh=1, d=8):
  """Compiled forward + backward of one causal attention call on `context=c` (c = 1: one
  device), float32: (per-device matmul FLOPs, temporaries in bytes)."""
  mesh = fs.make_mesh({"context": c}, devices=jax.devices()[:c])
  split = jax.NamedSharding(mesh, jax.P(None, "context"))
  arg = lambda n: jax.ShapeDtypeStruct((b, s, n, d), jnp.float32, sharding=split)
  f = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context="ulysses")
  g = jax.value_and_grad(lambda q, k, v, w: jnp.sum(f(q, k, v) * w), (0, 1, 2))
  with fs.with_mesh(mesh):
    compiled = jax.jit(g).lower(arg(h), arg(kh), arg(kh), arg(h)).compile()
  return (hlo.summarize(compiled.as_text()).matmul_flops,
          compiled.memory_analysis().temp_size_in_bytes)


def test_ulysses_splits_the_attention_work_and_memory_with_the_axis():
  """Per device, from the compiled program: the XLA reference's matmuls over the whole
  score matrix, 2 forward (q k^T, p v) and 4 backward of 2 B S^2 (H / c) D FLOPs each, and
  the temporaries (the float32 scores and their gradients) a c-th of one device's. MQA: the
  one kv head goes to every device."""
  b, s, h, d = 1, 256, 4, 8
  got = {c: _ulysses_program(c, b, s, h, 1, d) for c in (1, 2, 4)}
  for c, (flops, _) in got.items():
    assert flops == 12 * b * s * s * h * d / c, c
  # One device's temporaries are several [B, H, S, S] float32 score-sized buffers; a
  # context device's, those of its H / c heads (the exchanged shards are 1/32 of a score).
  temp = {c: t for c, (_, t) in got.items()}
  assert temp[1] >= 4 * b * h * s * s * 4
  for c in (2, 4):
    assert temp[1] / c <= temp[c] <= 1.05 * temp[1] / c, temp


# ----------------------------------------------------------------------------- the loss


def test_loss_on_a_sequence_split_batch_never_gathers_the_sequence():
  rng = np.random.default_rng(2)
  h = rng.normal(size=(4, 16, 8)).astype(np.float32)
  u = rng.normal(size=(8, 32)).astype(np.float32)
  y = rng.integers(0, 32, (4, 16)).astype(np.int32)
  ref = lambda h, u: optax.softmax_cross_entropy_with_integer_labels(
      jnp.einsum("bsd,dv->bsv", h, u), y).mean()
  value, grads = jax.value_and_grad(ref, (0, 1))(h, u)
  mesh = fs.make_mesh(MESHES[4])
  split = jax.NamedSharding(mesh, jax.P("data", "context"))
  hh, yy = jax.device_put(h, split), jax.device_put(y, split)
  f = jax.jit(jax.value_and_grad(lambda h, u: fs.cross_entropy(h, u, yy), (0, 1)))
  with fs.with_mesh(mesh):
    got, got_grads = f(hh, u)
    summary = hlo.summarize(f.lower(hh, u).compile().as_text())
  np.testing.assert_allclose(got, value, rtol=1e-6)
  for g, r in zip(got_grads, grads):
    np.testing.assert_allclose(g, r, atol=1e-6)
  assert got_grads[0].sharding.spec[:2] == ("data", "context")
  assert summary.collective("all-gather").count == 0
  # Per token only: the loss's sum and the unembedding's gradient are all-reduced.
  assert {c.kind for c in summary.collectives if c.count} == {"all-reduce"}


# ----------------------------------------------------------------------------- shardings


def test_batch_sharding_and_constrain_batch_split_the_sequence():
  mesh = fs.make_mesh(MESHES[4])
  assert fs.batch_sharding(mesh).spec == jax.P("data", "context")
  assert fs.batch_sharding(fs.make_mesh({"data": 8})).spec == jax.P("data")
  with pytest.raises(ShardingError, match="splits both"):
    fs.batch_sharding(mesh, axes=("data", "context"))
  x = jax.ShapeDtypeStruct((B, S, 8), jnp.float32)
  with fs.with_mesh(mesh):
    text = jax.jit(lambda x: fs.constrain_batch(x) * 2).lower(x).as_text()
  assert '{"data"}, {"context"}' in text.replace("'", '"') or "data" in text and (
      "context" in text)
  # Rules can name the axis: a "length" dim over context.
  spec = fs.logical_to_spec(("batch", "length", "embed"),
                                     (("batch", "data"), ("length", "context")), mesh)
  assert spec == jax.P("data", "context", None)


# ----------------------------------------------------------------------------- a whole step


@pytest.mark.slow  # the attention-level context tests stay quick
@pytest.mark.parametrize("form", ca.FORMS)
def test_llama_loss_and_grads_with_context_4_equal_one_device(form):
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(layers=1, d_model=32, heads=4, kv_heads=2, d_mlp=64, seq=32,
                          vocab=20)
  params = llama.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(3).integers(0, 20, (4, 33)).astype(np.int32)
  seg = np.repeat((np.arange(32) * 3 // 32)[None], 4, 0).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg}
  grad = jax.value_and_grad(llama.loss_fn)
  loss, grads = jax.jit(grad)(params, cp.reorder_batch(batch, 1))  # one device

  mesh = fs.make_mesh(MESHES[4])
  shardings = fs.shardings(params, mesh, llama.RULES, logical_axes=llama.logical_axes(cfg))
  split = fs.global_batch(cp.reorder_batch(batch, mesh), fs.batch_sharding(mesh))
  with fs.with_mesh(mesh):
    got, got_grads = jax.jit(fs.with_kernel(grad, context=form))(
        jax.device_put(params, shardings), split)
  assert float(got) == pytest.approx(float(loss), abs=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(got_grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
  # The params (and so their gradients) are split over the context axis, not replicated.
  wq = shardings["blocks"]["wq"]
  assert wq.shard_shape(params["blocks"]["wq"].shape)[1] == cfg.d_model // 4


# ------------------------------------------------- beside pipeline stages and experts


def _model_step(model, cfg, mesh_axes, batch, loss, **kw):
  """(loss, grads) of `loss` on one device and on `mesh_axes` (batch reordered for it)."""
  params = model.init_params(cfg, jax.random.key(0))
  grad = jax.jit(jax.value_and_grad(loss, has_aux=kw.get("has_aux", False)))
  one = grad(params, cp.reorder_batch(batch, 1))
  mesh = fs.make_mesh(mesh_axes)
  shardings = fs.shardings(params, mesh, model.RULES, logical_axes=model.logical_axes(cfg))
  split = fs.global_batch(cp.reorder_batch(batch, mesh), fs.batch_sharding(mesh))
  with fs.with_mesh(mesh):
    return one, grad(jax.device_put(params, shardings), split)


def _packed_batch(rows: int, seq: int, vocab: int) -> dict:
  tokens = np.random.default_rng(5).integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  seg = np.repeat((np.arange(seq) * 3 // seq)[None], rows, 0).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg}


def _assert_same(one, split, atol=1e-6):
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(split)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=atol)


@pytest.mark.slow
def test_pipeline_stages_beside_a_context_axis_equal_one_device():
  """Llama's layers as 2 pipeline stages (2 microbatches) over stage=2 x context=4, packed
  rows: loss and gradients equal one device's."""
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(layers=2, d_model=32, heads=4, kv_heads=2, d_mlp=64, seq=32,
                          vocab=16)
  loss = functools.partial(llama.loss_fn, microbatches=2)
  one, split = _model_step(llama, cfg, {"stage": 2, "context": 4}, _packed_batch(4, 32, 16),
                           loss)
  _assert_same(one, split)


@pytest.mark.slow
def test_a_mixture_of_experts_beside_a_context_axis_equals_one_device():
  """The MoE model (dropless, packed rows) over expert=2 x context=4: each context shard
  routes its piece of every row; loss, router statistics and gradients equal one device's."""
  from recipes.lm import moe  # pylint: disable=import-outside-toplevel
  cfg = moe.model_config("moe-tiny", 32, layers=1, d_model=32, heads=2, kv_heads=2, d_ff=32,
                         vocab=64)
  loss = functools.partial(moe.loss_and_aux, cfg=cfg)
  one, split = _model_step(moe, cfg, {"expert": 2, "context": 4}, _packed_batch(4, 32, 64),
                           loss, has_aux=True)
  _assert_same(one, split)
  assert one[0][1]["tokens_per_expert"].sum() == 4 * 32 * cfg.k


def test_the_capacity_path_under_a_context_axis_names_the_fix():
  p = {"router": (8, 4), "w_gate": (4, 8, 16), "w_up": (4, 8, 16), "w_down": (4, 16, 8)}
  shapes = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in p.items()}
  mesh = fs.make_mesh({"expert": 2, "context": 4})
  with pytest.raises(ShardingError, match="capacity_factor=None"):
    fs.parallel.exchange_selection((2, 64, 8), shapes, 2, capacity_factor=1.0, mesh=mesh)
  with pytest.raises(ShardingError, match=r"the sequence \(62\).*\('context',\)"):
    fs.parallel.exchange_selection((2, 62, 8), shapes, 2, mesh=mesh)
  plan = fs.parallel.exchange_selection((2, 64, 8), shapes, 2, mesh=mesh)
  assert plan.token_axes == ("expert", "context")


# ----------------------------------------------------------------------------- errors


def _plan(axes, *, q=(B, S, H, D), k=(B, S, KH, D), **kernel):
  """kernel_selection under a mesh with the given with_kernel choice."""
  attention = kernel.pop("attention", "auto")
  window = kernel.pop("window", None)
  with fs.with_mesh(fs.make_mesh(axes)):
    return fs.with_kernel(kernel_selection, attention=attention, **kernel)(
        q, k, causal=True, sliding_window=window)


@pytest.mark.parametrize("seq, order, needs", [(60, "zigzag", 8), (62, "striped", 4),
                                              (6, "contiguous", 4)])
def test_a_sequence_the_shards_cant_split_names_the_multiple(seq, order, needs):
  with pytest.raises(KernelError, match=f"multiple of {needs}"):
    _plan(MESHES[4], q=(B, seq, H, D), k=(B, seq, KH, D), context_order=order)


def test_a_ring_whose_heads_the_mesh_cant_split_names_the_fix():
  with pytest.raises(KernelError, match=r"kv heads 2 must be divisible by the head axes"):
    _plan({"context": 2, "tensor": 4}, context="ring")
  # The all-gather form attends every head on each device of the head group instead.
  assert _plan({"context": 2, "tensor": 4}).head_axes == ()


def test_ulysses_heads_the_context_axis_cant_split_name_the_fix():
  with pytest.raises(KernelError, match=r"context='ulysses': 4 heads can't be dealt out over "
                     r"the context axes \('context',\) \(8 devices\).*fix: a context axis "
                     r"whose size divides 4, or context='all_gather' or 'ring'"):
    _plan(MESHES[8], context="ulysses")
  # Heads split over tensor first: 2 per tensor shard, over 4 context devices.
  with pytest.raises(KernelError, match=r"2 heads per \('tensor',\) shard"):
    _plan({"context": 4, "tensor": 2}, context="ulysses")
  # Fewer kv heads (2) than devices (4): repeated, each device gets the one its heads use.
  plan = _plan(MESHES[4], context="ulysses")
  assert plan.context.form == "ulysses" and plan.head_axes == ()
  assert "ulysses over ('context',) (4 shards, zigzag order)" in plan.reason


@pytest.mark.parametrize("kernel", ["cudnn", "pallas_gpu"])
def test_a_kernel_that_cant_take_a_context_axis_says_so(kernel):
  with pytest.raises(KernelError, match=f"{kernel}.*can't take a sequence split.*attention="):
    _plan(MESHES[4], attention=kernel)


def test_context_plan_says_what_runs_and_why():
  plan = _plan(MESHES[4], context="ring", context_order="striped")
  assert plan.implementation == "xla" and plan.context.form == "ring"
  assert plan.context.axes == ("context",) and plan.batch_axes == ("data",)
  assert "ring over ('context',) (4 shards, striped order)" in plan.reason
  assert "splash: needs platform tpu" in plan.reason
  with pytest.raises(KernelError, match="sliding_window"):
    _plan(MESHES[4], window=(4, 0))
  with pytest.raises(KernelError, match="context='spiral'"):
    fs.with_kernel(context="spiral")


def test_a_model_given_no_positions_under_a_context_axis_says_how_to_add_them():
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(layers=1, d_model=16, heads=2, kv_heads=1, d_mlp=16, seq=16,
                          vocab=16)
  params = jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0))
  batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.int32) for k in ("inputs", "targets")}
  with fs.with_mesh(fs.make_mesh(MESHES[4])):
    with pytest.raises(fs.InputError, match="reorder_batch"):
      jax.eval_shape(llama.loss_fn, params, batch)


# ----------------------------------------------------------------------------- splash


@pytest.mark.slow
@pytest.mark.parametrize("form, order", [("all_gather", "zigzag"), ("ring", "zigzag"),
                                         ("ring", "striped"), ("ring", "contiguous"),
                                         ("ulysses", "striped")])
def test_splash_inside_each_form_equals_the_reference(form, order):
  """The splash kernel in interpret mode (CPU) inside both forms, on the smallest sequence
  whose zigzag ring halves fill a 128-token tile: c 2 x 256 tokens, packed, MQA."""
  c, b, s, h, kh, d = 2, 1, 512, 2, 1, 64
  rng = np.random.default_rng(4)
  q, k, v, w = (rng.normal(size=(b, s, n, d)).astype(np.float32) for n in (h, kh, kh, h))
  seg = (np.arange(s)[None] * 3 // s).astype(np.int32)
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  out = attend(q, k, v)
  grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), (0, 1, 2))(q, k, v)
  q_, k_, v_, seg_, w_ = (ca.reorder(x, c, order) for x in (q, k, v, seg, w))
  split = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True, segment_ids=seg_),
                         context=form, context_order=order, interpret=True)
  mesh = fs.make_mesh({"context": c}, devices=jax.devices()[:c])
  with fs.with_mesh(mesh):
    plan = fs.with_kernel(kernel_selection, context=form, interpret=True)(
        q.shape, k.shape, causal=True, segment_ids=seg_)
    def loss(q, k, v):  # the output an aux of the gradients' program: one compile
      out = split(q, k, v)
      return jnp.sum(out * w_), out
    (_, got), got_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
        q_, k_, v_)
  assert plan.implementation == "splash", plan.reason
  np.testing.assert_allclose(ca.restore(np.asarray(got), c, order), out, atol=1e-5)
  for g, r in zip(got_grads, grads):  # splash's own float32 backward: ~1e-5 here
    np.testing.assert_allclose(ca.restore(np.asarray(g), c, order), r, atol=3e-5)


@pytest.mark.slow
@pytest.mark.parametrize("form", ca.FORMS)
def test_tpu_program_runs_splash_inside_each_form(form, tpu_devices):
  """Compiled ahead of time for a described v5p-8 (4 chips, context=4): the Mosaic kernels
  are in the program, and the collectives are the form's."""
  mesh = fs.make_mesh({"context": 4}, devices=tpu_devices("v5p:2x2x1"))
  b, s, h, kh, d = 1, 2048, 4, 2, 128
  split = jax.NamedSharding(mesh, jax.P(None, "context"))
  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=split)
  ids = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=split)
  f = fs.with_kernel(lambda q, k, v, i: fs.attention(q, k, v, causal=True, segment_ids=i),
                     context=form)
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))
  with fs.with_mesh(mesh):
    text = jax.jit(g).lower(arg(b, s, h, d), arg(b, s, kh, d), arg(b, s, kh, d),
                            ids).compile().as_text()
  summary = hlo.summarize(text)
  names = {k.name for k in summary.kernels}
  # Ulysses: the 2 kv heads repeated to 4, one per device (MQA within a device).
  kind = "mqa" if form == "ulysses" else "mha"
  assert {f"splash_{kind}_fwd_segmented_residuals", f"splash_{kind}_dq_segmented_no_residuals",
          f"splash_{kind}_dkv_segmented_no_residuals"} <= names, names
  assert all(k.target == "tpu_custom_call" for k in summary.kernels)
  kv = 2 * b * s * kh * d * 2
  if form == "ulysses":  # q, k, v (4 heads each) out, dq, dk, dv home; the ids gathered
    assert summary.collective("all-to-all").bytes_sent == 3 / 4 * 6 * b * s / 4 * h * d * 2
    assert summary.collective("all-gather").bytes_sent == 3 / 4 * b * s * 4
  elif form == "ring":
    assert summary.collective("collective-permute").count == 2 * 3 + 4
    assert summary.collective("all-gather").bytes_sent == 3 / 4 * b * s * 4  # the ids only
  else:
    assert summary.collective("all-gather").bytes_sent == 3 / 4 * (kv + b * s * 4)


# ----------------------------------------------------------------------------- the planner


def _long_profile(tokens: int, rows: int = 16) -> "object":
  """A Llama-8B-like profile at `tokens` per row (per-row figures scale with the tokens;
  attention quadratically)."""
  from fnscale.analysis import _cost  # pylint: disable=import-outside-toplevel
  params, layers, d, kv = 8.03e9, 32, 4096, 8 * 128
  attn = 12 * layers * d * tokens * tokens
  return _cost.Profile(
      params=int(params), param_bytes=4 * params, opt_bytes=8 * params, compute_bytes=2 * params,
      grad_bytes=4 * params, flops_row=6 * params * tokens + attn,
      flops_row_remat=8 * params * tokens + attn * 4 / 3, act_row=40 * layers * d * tokens,
      act_row_remat=2 * layers * d * tokens, layers=layers, stream_row=2 * d * tokens,
      rows=rows, has_remat=True, attn_row=attn, attn_row_remat=attn * 4 / 3,
      causal_share=1.0, attn_kernel=True, tokens_row=tokens,
      act_row_stream=2 * layers * d * tokens, act_row_remat_stream=2 * layers * d * tokens,
      kv_row=layers * 2 * tokens * kv * 2, q_row=layers * tokens * 32 * 128 * 2, heads=32,
      kv_heads=8)


def test_planner_considers_context_only_for_long_sequences():
  from fnscale.analysis import _targets  # pylint: disable=import-outside-toplevel
  from fnscale.analysis._search import _meshes  # pylint: disable=import-outside-toplevel
  hw = _targets.resolve("v5p-128")
  short = _meshes(hw, 16, 8, tokens=4096)
  long = _meshes(hw, 16, 8, tokens=131072)
  assert not any("context" in m.ici for m in short)
  sizes = sorted({m.ici.get("context", 1) for m in long})
  assert sizes == [1, 2, 4, 8, 16, 32]  # shards of >= 4096 tokens; 64 would hold 2048
  # Every mesh covers the slice, and its data axes split the 16 rows.
  assert all(np.prod(list(m.ici.values())) == 64 for m in long)
  assert all(16 % (m.ici.get("data", 1) * m.ici.get("fsdp", 1)) == 0 for m in long)


def test_planner_costs_the_context_axis_by_hand():
  from fnscale.analysis import _cost, _targets  # pylint: disable=import-outside-toplevel
  hw, prof = _targets.resolve("v5p-128"), _long_profile(131072)
  ici = {"fsdp": 16, "context": 4}
  est = _cost.estimate(prof, hw, ici, {}, True, 1)
  bw = _cost.axis_bandwidth(hw, ici, {})
  rows = 16 / 16  # rows per device of the fsdp group
  # K/V gathered forward and again under remat, their gradients reduce-scattered.
  assert est.comm_s["context"] == pytest.approx(3 * 3 / 4 * prof.kv_row * rows / bw["context"])
  # Params over the 64-device fsdp x context group, on both axes' links.
  per_step = 2 * prof.compute_bytes + prof.grad_bytes
  assert est.comm_s["fsdp+context"] == pytest.approx(
      63 / 64 * per_step / (bw["fsdp"] + bw["context"]))
  # A device holds a quarter of its row's activations and 1/64 of the state.
  plain = _cost.estimate(prof, hw, {"fsdp": 16, "tensor": 4}, {}, True, 1)
  assert est.acts == pytest.approx(_cost.act_per_row(prof, True, 1)[0] * rows / 4)
  assert est.params == pytest.approx(prof.param_bytes / 64) == plain.params
  # Context alone: the params' group and the K/V traffic both on its links.
  alone = _cost.estimate(prof, hw, {"data": 2, "context": 32}, {}, False, 1)
  bw = _cost.axis_bandwidth(hw, {"data": 2, "context": 32}, {})
  assert alone.comm_s["context"] == pytest.approx(
      31 / 32 * per_step / bw["context"] + 2 * 31 / 32 * prof.kv_row * 8 / bw["context"])


def test_planner_costs_each_context_form_by_hand_and_picks_the_quickest():
  from fnscale.analysis import _cost, _search, _targets  # pylint: disable=import-outside-toplevel
  hw, prof = _targets.resolve("v5p-128"), _long_profile(131072)
  kv = prof.kv_row  # bytes of one row's K and V (bf16); its queries are twice that
  traffic = lambda form, c, t=1: _cost.context_traffic(prof, form, c, t, True)
  # Remat: three passes. All-gather: (c-1)/c of K/V each. Ring: (c-1)/c of K/V each and the
  # float32 dK/dV accumulators (2x bf16) once round. Ulysses: (c-1)/c of this device's
  # shards (1/c of the row) of q, output, K, V each; at c=16 the 8 kv heads are doubled.
  assert traffic("all_gather", 8) == pytest.approx(3 * 7 / 8 * kv)
  assert traffic("ring", 8) == pytest.approx((3 * 7 / 8 + 2) * kv)
  assert traffic("ulysses", 8) == pytest.approx(3 * 7 / 8 * (2 * 2 * kv + kv) / 8)
  assert traffic("ulysses", 16) == pytest.approx(3 * 15 / 16 * (2 * 2 * kv + 2 * kv) / 16)
  assert traffic("ulysses", 4, t=2) == pytest.approx(3 * 3 / 4 * (4 * kv + kv) / 4 / 2)
  # The form whose estimate is quickest: Ulysses' all-to-alls move less than the gather
  # from c = 8, more at 4 (5/4 of K/V a pass against 3/4). Beside tensor=2 at c = 8 each
  # tensor shard's 4 kv heads are doubled: 6/8 x 7/8 of its K/V a pass against 7/8 (1.33x),
  # the ring's 3 x 7/8 + 2 against 3 x 6/8 x 7/8 (2.35x).
  pick = lambda ici, p=prof: _search.context_form(p, hw, fs.MeshAxes(ici, {}), True, 1,
                                                   "auto")
  form, est, why = pick({"fsdp": 8, "context": 8, "tensor": 2})
  assert form == "ulysses" and est.comm_s["context"] > 0
  assert why.startswith("ulysses, the quickest estimate (the others' context traffic "
                        "against its: all_gather 1.33x, ring 2.35x)"), why
  assert pick({"fsdp": 16, "context": 4})[0] == "all_gather"
  # Heads the axis can't split: Ulysses isn't a candidate, and the plan says why.
  few = prof._replace(heads=4, kv_heads=4)
  form, _, why = pick({"fsdp": 8, "context": 8, "tensor": 2}, few)
  assert form == "all_gather" and why.endswith("ulysses: 2 heads don't divide over context=8")
  assert pick({"data": 64})[0] == "all_gather"


def test_profile_counts_the_queries_keys_and_values_attention_takes():
  from fnscale.analysis import _trace  # pylint: disable=import-outside-toplevel
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(layers=3, d_model=32, heads=4, kv_heads=2, d_mlp=32, seq=64, vocab=16)
  params = jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0))
  batch = {k: jax.ShapeDtypeStruct((2, 64), jnp.int32) for k in ("inputs", "targets")}
  kv, q, heads, kv_heads, head_dim = _trace._attention_row(  # pylint: disable=protected-access
      llama.loss_fn, params, batch, False)
  assert kv == 3 * 2 * 64 * 2 * 8 * 4  # layers x (K, V) x seq x kv_heads x head_dim x f32
  assert q == 3 * 64 * 4 * 8 * 4 and (heads, kv_heads, head_dim) == (4, 2, 8)


# ----------------------------------------------------------------------------- the main job


@pytest.mark.slow
def test_train_lm_on_a_context_axis_matches_the_batch_split_run(work, tmp_path):
  """`train_lm --mesh=data=2,context=4` end to end on 8 CPU devices (Llama, both forms):
  its losses are those of the same global batch on data=8."""
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  run = lambda name, **kw: train_lm.train_lm(**{**dict(
      model_config="llama-tiny", seq=64, global_batch=8, steps=3, log_every=1,
      eval_batches=1, sample_len=8, dataset=str(work / "corpus.txt"),
      run_dir=str(tmp_path / name), checkpoint=False,
      compile_cache_dir=str(work / "cache")), **kw})
  plain = run("data", mesh="data=8")
  gathered = run("gather", mesh="data=2,context=4")
  ring = run("ring", mesh="data=2,context=4", context="ring", context_order="striped")
  assert gathered.mesh == ring.mesh == {"data": 2, "context": 4}
  for split in (gathered, ring):
    assert split.final_step == 3 and split.sample
    assert split.loss == pytest.approx(plain.loss, abs=1e-4)
    assert split.eval_loss == pytest.approx(plain.eval_loss, abs=1e-4)


@pytest.mark.slow
def test_train_lm_on_packed_rows_and_a_context_axis_matches_the_batch_split_run(
    work, tmp_path, capsys):
  """Packed token-cache rows (segment ids, per-document positions, loss weights) reordered
  over data=2 x context=4: the losses of the same rows on data=8."""
  import json  # pylint: disable=import-outside-toplevel
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  from recipes.lm import cache  # pylint: disable=import-outside-toplevel
  docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3) for i in range(60)]
  (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  cache.build(cache.BuildSpec((str(tmp_path / "code.jsonl"),), str(tmp_path / "code"),
                              shard_bytes=2000), say=lambda *a: None)
  run = lambda name, mesh: train_lm.train_lm(
      model_config="llama-tiny", seq=64, global_batch=8, steps=3, log_every=1,
      eval_batches=1, sample_len=0, dataset=str(tmp_path / "code"), mesh=mesh,
      run_dir=str(tmp_path / name), checkpoint=False, compile_cache_dir=str(work / "cache"))
  plain = run("data", "data=8")
  capsys.readouterr()
  split = run("context", "data=2,context=4")
  assert "each row split 4 ways over the context axis (16 tokens per device)" in (
      capsys.readouterr().out)
  assert split.mesh == {"data": 2, "context": 4} and split.final_step == 3
  assert split.loss == pytest.approx(plain.loss, abs=1e-5)
  assert split.eval_loss == pytest.approx(plain.eval_loss, abs=1e-5)


@pytest.mark.slow
def test_planner_ranks_and_compiles_a_context_mesh_for_a_long_row(tpu_devices):
  """One 32,768-token row of a one-layer Llama-1B on a described v5p-8 (4 chips): no batch
  split serves it, so the plan ranks context and tensor meshes; context=4 leads the
  estimate and is compiled, with its HLO matmul FLOPs those of the traced step."""
  del tpu_devices  # (skips without libtpu)
  from fnscale.analysis import _table  # pylint: disable=import-outside-toplevel
  from recipes import plan as plan_recipe  # pylint: disable=import-outside-toplevel
  p = plan_recipe.make_plan("llama-1b", "v5p-8", 1, 32768, 1, overrides={"layers": 1})
  rows = {fs.analysis.mesh_str(r.axes): r for r in p.rows if not r.remat}
  assert {"context=4", "context=2 tensor=2", "tensor=4"} <= set(rows)
  split = rows["context=4"]
  assert split.compiled is not None and split.fits, p
  assert split.estimate.comm_s["context"] > 0
  assert split.compiled.matmul_flops == pytest.approx(
      _table._dot_flops_row(p.profile, False) * 1 / 4, rel=0.02)  # pylint: disable=protected-access
  assert p.rows[0].compiled is not None  # the choice is a compiled row


@pytest.mark.slow
@pytest.mark.parametrize("form", ca.FORMS)
def test_a_context_axis_across_slices(form, tpu_devices):
  """`dcn={"context": 2}` over two described v5p-8 slices: the sequence splits across
  them, and only the form's K/V traffic (and its gradients') crosses the slices."""
  mesh = fs.make_mesh({"fsdp": 4}, dcn={"context": 2},
                      devices=tpu_devices("v5p:2x2x1", num_slices=2))
  b, s, h, kh, d = 4, 1024, 4, 2, 128
  split = jax.NamedSharding(mesh, jax.P("fsdp", "context"))
  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=split)
  f = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context=form)
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))
  with fs.with_mesh(mesh):
    summary = hlo.summarize(jax.jit(g).lower(arg(b, s, h, d), arg(b, s, kh, d),
                                             arg(b, s, kh, d)).compile().as_text())
  kv = 2 * (b // 4) * s * kh * d * 2  # this device's rows' K and V, whole sequence, bf16
  assert {n for _, n, _ in summary.dcn_groups} == {2}
  assert summary.collective("all-to-all").count == (6 if form == "ulysses" else 0)
  if form == "ulysses":  # this device's half of q, k, v out, and of dq, dk, dv home (a
    # sum's cotangent is built where it is needed): half of each comes across
    q = (b // 4) * (s // 2) * h * d * 2
    assert summary.dcn_bytes_sent == summary.collective("all-to-all").bytes_sent == (
        1 / 2 * 2 * (q + kv / 2))
  elif form == "ring":  # every pass crosses: a K/V block, its float32 dK/dV twice
    permute = summary.collective("collective-permute")
    assert summary.dcn_bytes_sent == permute.bytes_sent >= kv / 2 + 2 * kv
    assert summary.collective("all-gather").count == 0
  else:  # gathered forward (half of it comes across), the gradients reduce-scattered back
    assert summary.dcn_bytes_sent == kv / 2 + kv / 2
