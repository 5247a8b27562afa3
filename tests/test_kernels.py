"""Attention kernels, their fallback and scoping, and the blockwise cross-entropy.

Pallas kernels run here in interpret mode (CPU); the TPU splash kernel is also compiled
ahead of time for a v5e topology through libtpu.
"""
import contextlib
import functools
import importlib
import logging as py_logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import KernelError
from fnscale import attention, cross_entropy, with_kernel
from fnscale.kernels import BlockSizes, kernel_selection
from fnscale._mesh import with_mesh

AUTO = jax.sharding.AxisType.Auto
# The package exports the function `attention`, which hides the module of the same name.
attention_lib = importlib.import_module("fnscale.kernels._attention")


@pytest.fixture(autouse=True)
def _float32_matmuls(request):
  """The tolerances below are float32's. On a TPU backend, whose default precision
  contracts float32 in one bfloat16 pass, each test that runs a program (all but the
  ahead-of-time compiles marked `tpu`) runs under "highest" precision; on the CPU, whose
  matmuls are float32 anyway, nothing changes. (The chip itself: tests/test_chip.py.)"""
  if jax.default_backend() != "tpu" or request.node.get_closest_marker("tpu"):
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


def _mask(b, t, s, *, causal=False, segments=None, window=None):
  """[b, 1, t, s] bool: which keys each query sees, from the definitions (numpy)."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  mask = np.ones((b, 1, t, s), bool)
  if causal:
    mask &= j <= i
  if window is not None:
    left, right = window
    mask &= (j >= i - left) & (j <= i + right)
  if segments is not None:
    q_ids, kv_ids = (np.asarray(x) for x in segments)
    mask &= q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  return mask


def _reference(q, k, v, *, causal=False, segments=None, window=None, scale=None,
               soft_cap=None):
  """Attention from its definition, in float64 numpy, independent of jax.nn; soft_cap c:
  the scaled logits become c tanh(logits / c) before the mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  k, v = np.repeat(k, h // kh, axis=2), np.repeat(v, h // kh, axis=2)
  scale = 1 / np.sqrt(d) if scale is None else scale
  logits = np.einsum("bthd,bshd->bhts", q, k) * scale
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  mask = _mask(b, t, s, causal=causal, segments=segments, window=window)
  logits = np.where(mask, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p, v)


def _jax_nn_attention(**mask_kwargs):
  """jax.nn.dot_product_attention with the explicit `_mask`: the gradient reference."""
  def fn(q, k, v):
    mask = _mask(q.shape[0], q.shape[1], k.shape[1], **mask_kwargs)
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask),
                                        implementation="xla")
  return fn


def _relative_error(got, want) -> float:
  """||got - want|| / ||want|| in float64: an all-zero `got` scores 1, not 'close'."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture
def plans(monkeypatch):
  """The KernelSelections `attention` decides during the test, in order."""
  real, decided = attention_lib.kernel_selection, []

  def recording(*args, **kwargs):
    decided.append(real(*args, **kwargs))
    return decided[-1]

  monkeypatch.setattr(attention_lib, "kernel_selection", recording)
  return decided


def _qkv(b, t, h, kh, d, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, h, d), dtype),
          jax.random.normal(ks[1], (b, t, kh, d), dtype),
          jax.random.normal(ks[2], (b, t, kh, d), dtype))


def _weight(shape):
  # A loss whose gradient depends on every output element differently.
  return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape))


def _loss_and_grads(fn, q, k, v):
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * _weight(q.shape))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _out_loss_and_grads(fn, q, k, v):
  """fn's output with `_loss_and_grads`'s loss and gradients, from one forward pass (the
  kernel's forward, interpreted, is the slow part)."""
  out, pullback = jax.vjp(fn, q, k, v)
  weight = _weight(out.shape)
  return out, jnp.sum(out.astype(jnp.float32) * weight), pullback(weight.astype(out.dtype))


CASES = {
    # name: (implementation, (batch, seq, heads, kv_heads, head_dim), attention kwargs)
    "splash-causal-gqa": ("splash", (1, 256, 4, 2, 64), dict(causal=True)),
    "splash-full-mha-d128": ("splash", (2, 128, 2, 2, 128), dict()),
    "splash-window": ("splash", (1, 256, 2, 2, 64), dict(sliding_window=(32, 16))),
    "splash-segments-mqa": ("splash", (1, 128, 4, 1, 64), dict(causal=True, segments=True)),
    "pallas_gpu-causal-gqa": ("pallas_gpu", (1, 128, 4, 2, 64), dict(causal=True)),
    "pallas_gpu-segments": ("pallas_gpu", (2, 128, 2, 2, 64), dict(segments=True)),
}


# Pallas's GPU attention under a causal mask walks key blocks up to a bound that depends on
# the query block: a loop whose trip count is data, which the HLO reader lists as unread.
# One case in the quick tier (Pallas's GPU kernel runs quick in test_forward_mode); the
# other kernels, shapes and masks are slow.
_QUICK_CASES = ("splash-causal-gqa",)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.hlo_unread_loops] * (c == "pallas_gpu-causal-gqa")
                 + [pytest.mark.slow] * (c not in _QUICK_CASES))
    for c in CASES])
def test_interpret_kernel_matches_reference_forward_and_backward(case):
  implementation, (b, t, h, kh, d), kwargs = CASES[case]
  q, k, v = _qkv(b, t, h, kh, d)
  call = dict(kwargs)
  ref_kwargs = dict(causal=call.get("causal", False), window=call.get("sliding_window"))
  if call.pop("segments", False):
    ids = jnp.asarray(np.arange(t)[None, :] * 3 // t + np.arange(b)[:, None], jnp.int32)
    call["segment_ids"] = ids
    ref_kwargs["segments"] = (ids, ids)

  fn = with_kernel(functools.partial(attention, implementation=implementation, **call),
                   interpret=True)
  sel = with_kernel(kernel_selection, interpret=True)(
      q.shape, k.shape, q.dtype, implementation=implementation,
      causal=call.get("causal", False), segment_ids=call.get("segment_ids"),
      sliding_window=call.get("sliding_window"))
  assert sel.implementation == implementation and sel.interpret

  out, loss, grads = _out_loss_and_grads(fn, q, k, v)
  np.testing.assert_allclose(out, _reference(q, k, v, **ref_kwargs), atol=2e-5, rtol=2e-5)
  # The gradient reference: jax.nn's attention with the mask spelled out (not fnscale's own
  # xla path, which shares the mask translation under test).
  ref_loss, ref_grads = _loss_and_grads(_jax_nn_attention(**ref_kwargs), q, k, v)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-4)
  for g, r in zip(grads, ref_grads):
    assert _relative_error(g, r) < 1e-5
    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True, window=(8, 0), segments=True),
    dict(window=(3, 5)),
], ids=["causal-window-segments", "window"])
def test_xla_reference_matches_definition(kwargs):
  q, k, v = _qkv(2, 40, 4, 2, 16, seed=1)
  call = dict(causal=kwargs.get("causal", False), sliding_window=kwargs.get("window"))
  ref = dict(causal=call["causal"], window=kwargs.get("window"))
  if kwargs.get("segments"):
    q_ids = jnp.asarray(np.arange(40)[None] // 13 + np.zeros((2, 1), int), jnp.int32)
    kv_ids = q_ids.at[:, 5].set(7)  # A key no query can see.
    call["segment_ids"], ref["segments"] = (q_ids, kv_ids), (q_ids, kv_ids)
  out = attention(q, k, v, implementation="xla", **call)
  np.testing.assert_allclose(out, _reference(q, k, v, **ref), atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "splash"])
def test_soft_capped_windowed_attention_matches_definition(implementation):
  # Gemma 2's local layers: logits c tanh(scale q.k / c) (large enough here that the cap
  # bends them), a causal sliding window, grouped-query heads; the splash kernel in
  # interpret mode. Values against numpy's definition, gradients against jax's of it.
  q, k, v = _qkv(1, 128, 4, 2, 64, seed=2)
  call = dict(causal=True, sliding_window=(39, 0), scale=0.5, soft_cap=5.0)
  fn = with_kernel(functools.partial(attention, implementation=implementation, **call),
                   interpret=True)
  want = _reference(q, k, v, causal=True, window=(39, 0), scale=0.5, soft_cap=5.0)
  assert np.abs(want - _reference(q, k, v, causal=True, window=(39, 0), scale=0.5)).max() > 0.1
  out, _, grads = _out_loss_and_grads(fn, q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)

  def definition(q, k, v):
    kr, vr = (jnp.repeat(x, 2, axis=2) for x in (k, v))
    logits = 5.0 * jnp.tanh(jnp.einsum("bthd,bshd->bhts", q, kr) * 0.5 / 5.0)
    mask = _mask(1, 128, 128, causal=True, window=(39, 0))
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, vr)
  _, ref_grads = _loss_and_grads(definition, q, k, v)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_soft_cap_kernel_selection_says_who_serves_it():
  q = (2, 1024, 8, 128)
  gemma = dict(causal=True, sliding_window=(4095, 0), soft_cap=50.0)
  assert kernel_selection(q, q, jnp.bfloat16, platform="tpu", **gemma).implementation == (
      "splash")
  sel = kernel_selection(q, q, jnp.bfloat16, platform="cuda", **gemma)
  assert sel.implementation == "xla" and sel.fallback
  assert "cudnn: soft_cap is not supported" in sel.reason
  assert "pallas_gpu: sliding_window is not supported" in sel.reason
  with pytest.raises(KernelError, match="context axis, or no soft_cap"):
    kernel_selection(q, q, mesh=_mesh((2, 4), ("data", "context")), soft_cap=50.0)


@pytest.mark.tpu
def test_gemma_attention_compiles_to_splash_for_tpu_v5e(tpu_devices):
  # A Gemma 2 local layer's call (window 4096 of 8192 tokens, logits capped at 50) on one
  # v5e chip, ahead of time: the splash kernel, forward and backward, no fallback.
  del tpu_devices  # (skips without libtpu) one chip is described by fnscale's own call
  mesh = jax.sharding.Mesh(np.array(fs.target_devices("v5e:1x1")).reshape(1), ("data",),
                           axis_types=(AUTO,))
  spec = jax.sharding.NamedSharding(mesh, jax.P())
  q = jax.ShapeDtypeStruct((1, 8192, 8, 256), jnp.bfloat16, sharding=spec)
  kv = jax.ShapeDtypeStruct((1, 8192, 4, 256), jnp.bfloat16, sharding=spec)
  call = dict(causal=True, sliding_window=(4095, 0), soft_cap=50.0)
  sel = kernel_selection(q.shape, kv.shape, q.dtype, mesh=mesh, **call)
  assert (sel.platform, sel.implementation, sel.fallback) == ("tpu", "splash", False)

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, mesh=mesh, scale=256 ** -0.5, **call).astype(
        jnp.float32))

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower().compile(
      ).as_text()
  assert hlo.count("tpu_custom_call") >= 2  # the forward kernel and the backward's


def _mesh(shape=(2, 4), names=("data", "tensor")):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))


def test_sharded_kernel_compiles_without_gathering_qkv():
  mesh = _mesh()
  b, t, h, d = 2, 128, 4, 64
  q, k, v = _qkv(b, t, h, h, d)
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True) * jnp.cos(q))

  step = jax.jit(jax.value_and_grad(with_kernel(loss, attention="splash", interpret=True),
                                    argnums=(0, 1, 2)))
  with with_mesh(mesh):
    sel = with_kernel(kernel_selection, interpret=True)(q.shape, k.shape, causal=True)
    compiled = step.lower(q, k, v).compile()
    value, grads = compiled(q, k, v)  # the program read below, not a second compile of it
  assert sel.implementation == "splash"
  assert (sel.batch_axes, sel.head_axes) == (("data",), ("tensor",))
  hlo = compiled.as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  # The gradients come back sharded like the inputs, and the values are right.
  assert all(g.sharding.is_equivalent_to(spec, 4) for g in grads)
  ref_value, ref_grads = jax.value_and_grad(
      lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation="xla")
                              * jnp.cos(q)), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-4)


def _hlo_collectives(hlo: str) -> list[str]:
  return re.findall(r"\b(all-gather|all-to-all|collective-permute)(?:-start)?\(", hlo)


@pytest.mark.slow
def test_kernel_keeps_replica_axis_in_batch_spec():
  # The axis names of the "hybrid" preset and of make_mesh(..., dcn={"replica": 2}), within
  # one process of 8 simulated devices (one process can't have two DCN groups).
  mesh = fs.make_mesh({"replica": 2, "fsdp": 4})
  q, k, v = _qkv(8, 128, 2, 2, 32)
  batch = fs.batch_sharding(mesh)  # The batch convention: leading dim over both axes.
  assert batch.spec[0] == ("replica", "fsdp")
  spec = jax.sharding.NamedSharding(mesh, jax.P(("replica", "fsdp"), None, None, None))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True) * jnp.cos(q))
  step = jax.jit(jax.value_and_grad(with_kernel(loss, attention="splash", interpret=True),
                                    argnums=(0, 1, 2)))
  with with_mesh(mesh):
    sel = with_kernel(kernel_selection, interpret=True)(q.shape, k.shape, causal=True)
    compiled = step.lower(q, k, v).compile()
  assert (sel.implementation, sel.batch_axes, sel.head_axes) == (
      "splash", ("replica", "fsdp"), ())
  # A batch spec without "replica" would gather q/k/v over it around the kernel.
  assert _hlo_collectives(compiled.as_text()) == []
  value, grads = compiled(q, k, v)
  ref_value, ref_grads = jax.value_and_grad(
      lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True)
                              * jnp.cos(q)), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    assert _relative_error(g, r) < 1e-5


@pytest.mark.slow
@pytest.mark.tpu
def test_splash_on_multislice_hybrid_mesh_compiles_for_tpu(tpu_devices, plans):
  devices = tpu_devices("v5p:2x2x2", num_slices=2)
  mesh = fs.make_mesh({"fsdp": -1}, dcn={"replica": 2}, devices=devices)
  assert mesh.axis_names == ("replica", "fsdp") and mesh.devices.size == 16
  spec = jax.sharding.NamedSharding(mesh, jax.P(("replica", "fsdp"), None, None, None))
  x = jax.ShapeDtypeStruct((16, 256, 2, 128), jnp.bfloat16, sharding=spec)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True).astype(jnp.float32))
  with with_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
  hlo = compiled.as_text()
  assert "tpu_custom_call" in hlo and _hlo_collectives(hlo) == []
  assert {(p.implementation, p.batch_axes) for p in plans} == {("splash", ("replica",
                                                                           "fsdp"))}


@pytest.mark.tpu
def test_splash_in_shard_map_compiles_for_tpu_v5e(tpu_devices):
  devices = np.array(tpu_devices("v5e:2x2")).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "tensor"), axis_types=(AUTO, AUTO))
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
  shape = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16, sharding=spec)
  sel = kernel_selection(shape.shape, shape.shape, shape.dtype, causal=True, mesh=mesh)
  assert sel.platform == "tpu" and sel.implementation == "splash" and not sel.interpret
  assert sel.block_sizes == BlockSizes(512, 512, 512, 512)

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True, mesh=mesh).astype(jnp.float32))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      shape, shape, shape).lower().compile()
  hlo = compiled.as_text()
  assert "tpu_custom_call" in hlo
  assert "all-gather" not in hlo


# Every way to combine with_mesh, jax.jit and with_kernel around attention. Each form takes
# the attention function f(q, k, v, mesh=None), the mesh and a kernel choice, and returns a
# function of (q, k, v) with the arguments already sharded P("data", None, "tensor", None).
def _in_block(mesh, fn):
  def run(*args):
    with with_mesh(mesh):
      return fn(*args)
  return run


def _abstract_trace(mesh, fn):
  def run(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = jax.jit(fn).trace(*args).lower().compile()
    return compiled(*args)
  return run


def _from_numpy(mesh, fn):  # Unsharded inputs; the mesh only in jit's in_shardings.
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
  jitted = jax.jit(fn, in_shardings=(spec,) * 3)
  return lambda *args: jitted(*(np.asarray(x) for x in args))


WRAPPER_FORMS = {
    "with_mesh-block-around-jit": lambda f, m, c: _in_block(m, jax.jit(with_kernel(f, **c))),
    "with_mesh-wrapper-around-jit": lambda f, m, c: with_mesh(m)(jax.jit(with_kernel(f, **c))),
    "with_mesh-wrapper-inside-jit": lambda f, m, c: jax.jit(with_mesh(m)(with_kernel(f, **c))),
    "with_mesh-block-inside-jit": lambda f, m, c: jax.jit(_in_block(m, with_kernel(f, **c))),
    "with_kernel-around-jit": lambda f, m, c: with_kernel(with_mesh(m)(jax.jit(f)), **c),
    "with_kernel-around-jit-around-with_mesh": lambda f, m, c: with_kernel(
        jax.jit(with_mesh(m)(f)), **c),
    "mesh-only-in-argument-shardings": lambda f, m, c: jax.jit(with_kernel(f, **c)),
    "mesh-only-in-jit-in_shardings": lambda f, m, c: _from_numpy(m, with_kernel(f, **c)),
    "no-jit-sharded-arguments": lambda f, m, c: with_kernel(f, **c),
    "abstract-mesh-during-trace": lambda f, m, c: _abstract_trace(m, with_kernel(f, **c)),
    "mesh-argument": lambda f, m, c: jax.jit(with_kernel(functools.partial(f, mesh=m), **c)),
}


@pytest.mark.parametrize("form", list(WRAPPER_FORMS))
def test_every_wrapper_form_runs_the_kernel_in_shard_map(form, plans):
  mesh = fs.make_mesh({"data": 4, "tensor": 2})
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
  q, k, v = (jax.device_put(x, spec) for x in _qkv(4, 128, 2, 2, 32))
  f = lambda q, k, v, mesh=None: attention(q, k, v, causal=True, mesh=mesh)
  out = WRAPPER_FORMS[form](f, mesh, dict(attention="splash", interpret=True))(q, k, v)
  if form == "mesh-only-in-jit-in_shardings":
    # No mesh in the trace: unsharded (interpret mode is plain XLA, which XLA partitions; a
    # real Pallas kernel falls back instead, test_pallas_kernel_with_no_mesh_in_sight...).
    assert [(p.implementation, p.batch_axes) for p in plans] == [("splash", ())]
  else:  # One decision per trace: the kernel sharded over batch and heads.
    assert [(p.implementation, p.batch_axes, p.head_axes) for p in plans] == [
        ("splash", ("data",), ("tensor",))]
    assert "inside shard_map over ('data', 'tensor')" in plans[0].reason
  np.testing.assert_allclose(out, _reference(q, k, v, causal=True), atol=2e-5)


def test_with_kernel_around_a_jitted_function_traces_again_per_choice(plans):
  q, k, v = _qkv(1, 128, 2, 2, 32)
  jitted = jax.jit(functools.partial(attention, causal=True))
  outs = [with_kernel(jitted, attention="splash", interpret=True)(q, k, v),
          with_kernel(jitted, attention="xla")(q, k, v), jitted(q, k, v),
          with_kernel(jitted, attention="splash", interpret=True)(q, k, v)]
  # Three traces (the last call hits the first one's cache entry), each with its choice.
  assert [p.requested for p in plans] == ["splash", "xla", "auto"]
  for out in outs:
    np.testing.assert_allclose(out, _reference(q, k, v, causal=True), atol=2e-5)


def test_mesh_set_inside_the_trace_over_unsharded_inputs_runs_unsharded_and_says_why(plans):
  mesh = fs.make_mesh({"data": 4, "tensor": 2})
  q, k, v = _qkv(4, 128, 2, 2, 32)  # Single-device arrays: the jit has no mesh to lower.
  f = with_mesh(mesh)(with_kernel(functools.partial(attention, causal=True),
                                  attention="splash", interpret=True))
  out = jax.jit(f)(q, k, v)
  assert [(p.implementation, p.batch_axes, p.head_axes) for p in plans] == [
      ("splash", (), ())]
  assert "not sharded: the mesh was set inside the trace" in plans[0].reason
  np.testing.assert_allclose(out, _reference(q, k, v, causal=True), atol=2e-5)


def test_pallas_kernel_with_no_mesh_in_sight_falls_back_on_a_multi_device_platform(
    monkeypatch):
  # As on a host with 8 TPU chips: jax.jit(f, in_shardings=...) leaves no mesh in the trace,
  # and a Mosaic kernel there fails to compile ("cannot be automatically partitioned").
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  shape = (8, 256, 4, 128)
  sel = kernel_selection(shape, shape, jnp.bfloat16, causal=True)
  assert sel.implementation == "xla" and sel.fallback
  assert ("splash: no mesh in sight while the inputs may be split over 8 devices, and XLA "
          "can't partition this kernel: set the mesh with fnscale.with_mesh") in sel.reason
  with pytest.raises(KernelError, match="'splash'.* may be split over 8 devices"):
    kernel_selection(shape, shape, jnp.bfloat16, implementation="splash")
  mesh = fs.make_mesh({"data": 8})
  assert kernel_selection(shape, shape, jnp.bfloat16, platform="tpu",
                          mesh=mesh).implementation == "splash"
  with with_mesh(mesh):  # (The simulated mesh's own platform is cpu: name the platform.)
    assert kernel_selection(shape, shape, jnp.bfloat16, platform="tpu").batch_axes == ("data",)


def _tpu_loss(mesh=None):
  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True, mesh=mesh).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def _aot_abstract(mesh, fn, args):
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.jit(fn).trace(*args).lower()


# The same forms, compiled ahead of time for a TPU from this CPU: each returns a Lowered.
AOT_FORMS = {
    "with_mesh-block-around-jit": lambda m, a: _in_block(m, jax.jit(_tpu_loss()).lower)(*a),
    "with_mesh-wrapper-around-lower": lambda m, a: with_mesh(m)(jax.jit(_tpu_loss()).lower)(
        *a),
    "with_mesh-wrapper-inside-jit": lambda m, a: jax.jit(with_mesh(m)(_tpu_loss())).lower(*a),
    "with_mesh-block-inside-jit": lambda m, a: jax.jit(_in_block(m, _tpu_loss())).lower(*a),
    "with_kernel-around-lower": lambda m, a: with_kernel(
        jax.jit(with_mesh(m)(_tpu_loss())).lower, attention="splash")(*a),
    "with_kernel-inside-jit": lambda m, a: jax.jit(with_kernel(
        with_mesh(m)(_tpu_loss()), attention="splash")).lower(*a),
    "mesh-only-in-argument-shardings": lambda m, a: jax.jit(_tpu_loss()).lower(*a),
    "abstract-mesh-during-trace": lambda m, a: _aot_abstract(m, _tpu_loss(), a),
    "mesh-argument": lambda m, a: jax.jit(_tpu_loss(mesh=m)).lower(*a),
}


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("form", list(AOT_FORMS))
def test_every_wrapper_form_compiles_splash_for_a_tpu_topology(form, tpu_devices, plans):
  # Mosaic kernels can't be partitioned automatically: a kernel outside shard_map over
  # sharded inputs fails to compile ("Mosaic kernels cannot be automatically partitioned").
  mesh = fs.make_mesh({"data": 4, "tensor": 2}, devices=tpu_devices("v5p:2x2x2"))
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
  x = jax.ShapeDtypeStruct((8, 256, 4, 128), jnp.bfloat16, sharding=spec)
  hlo = AOT_FORMS[form](mesh, (x, x, x)).compile().as_text()
  assert "tpu_custom_call" in hlo and _hlo_collectives(hlo) == []
  assert {(p.platform, p.implementation, p.batch_axes, p.head_axes) for p in plans} == {
      ("tpu", "splash", ("data",), ("tensor",))}


def _attention_model(heads, head_dim, embed):
  def init(key):
    k1, k2 = jax.random.split(key)
    return {"wq": jax.random.normal(k1, (embed, heads, head_dim)) * 0.1,
            "wo": jax.random.normal(k2, (heads, head_dim, embed)) * 0.1}

  def loss_fn(params, batch):
    x = batch["x"]
    q = jnp.einsum("bse,ehd->bshd", x, params["wq"].astype(x.dtype))
    out = attention(q, q, q, causal=True)
    # On Explicit axes a contraction over split heads names its result's sharding.
    explicit = jax.sharding.get_abstract_mesh().explicit_axes
    y = jnp.einsum("bshd,hde->bse", out, params["wo"].astype(x.dtype),
                   **({"out_sharding": jax.typeof(x).sharding} if explicit else {}))
    return jnp.mean((y.astype(jnp.float32) - x.astype(jnp.float32)) ** 2)

  return init, loss_fn


@pytest.mark.tpu
@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit",
                                                            marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["auto", "shard_map"])
def test_shard_step_with_kernel_compiles_for_a_tpu_topology(mode, axis_types, tpu_devices,
                                                            plans):
  # The README's form: with_mesh around shard_step(with_kernel(step), mesh).compile(...).
  mesh = fs.make_mesh({"data": 4, "tensor": 2}, devices=tpu_devices("v5p:2x2x2"),
                      axis_types=axis_types)
  init, loss_fn = _attention_model(heads=4, head_dim=128, embed=128)
  optimizer = optax.sgd(0.1)
  rules = (("heads", "tensor"),)
  axes = {"wq": (None, "heads", None), "wo": ("heads", None, None)}
  # (Eager ops such as jax.random.key under a topology-description mesh fail in jax: the
  # abstract state is built outside it.)
  state = fs.init_state(init, optimizer, mesh=mesh, rules=rules, logical_axes=axes,
                        key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((8, 256, 128), jnp.bfloat16)}

  def compile_with(attention_choice):
    step = with_kernel(fs.train_step(loss_fn, optimizer), attention=attention_choice)
    with with_mesh(mesh):
      return fs.shard_step(step, mesh, rules=rules, logical_axes=axes, mode=mode).compile(
          state, batch).compiled.as_text()

  hlo = compile_with("auto")
  # Splash in either mode; under mode="shard_map" (a shard_map over the data axes that
  # checks varying types, which a Pallas call's can't carry) the kernel runs where none is
  # checked, its heads split over the tensor axis by its own shard_map.
  assert "tpu_custom_call" in hlo
  batch_axes = ("data",) if mode == "auto" else ()
  assert {(p.implementation, p.batch_axes, p.head_axes) for p in plans} == {
      ("splash", batch_axes, ("tensor",))}
  if mode == "auto":
    assert _hlo_collectives(hlo) == []
  assert "tpu_custom_call" in compile_with("splash")


@pytest.mark.tpu
def test_kernel_forms_on_a_tpu_topology_fall_back_or_raise_with_the_reason(tpu_devices,
                                                                            plans):
  mesh = fs.make_mesh({"data": 4, "tensor": 2}, devices=tpu_devices("v5p:2x2x2"))
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", None, None, None))
  odd = jax.ShapeDtypeStruct((8, 256, 3, 128), jnp.bfloat16, sharding=spec)  # 3 heads
  # "auto": the xla reference, which XLA partitions, with the reason.
  hlo = jax.jit(with_mesh(mesh)(_tpu_loss())).lower(odd, odd, odd).compile().as_text()
  assert "tpu_custom_call" not in hlo
  assert plans[-1].fallback and plans[-1].implementation == "xla"
  assert ("splash: heads 3 and kv heads 3 must be divisible by mesh axes ('tensor',) "
          "(size 2)") in plans[-1].reason
  # Forced: a KernelError naming the reason, not a Mosaic error at compile time.
  with pytest.raises(KernelError, match=re.escape(
      "attention(implementation='splash') can't serve this call: heads 3 and kv heads 3")):
    jax.jit(with_kernel(with_mesh(mesh)(_tpu_loss()), attention="splash")).lower(
        odd, odd, odd)
  # Shardings only in jit's in_shardings: no mesh in the trace, so no kernel for this CPU
  # backend; the xla reference compiles for the TPU devices in_shardings names.
  in_shardings = (jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None)),) * 3
  plain = jax.ShapeDtypeStruct((8, 256, 4, 128), jnp.bfloat16)
  hlo = jax.jit(_tpu_loss(), in_shardings=in_shardings).lower(
      plain, plain, plain).compile().as_text()
  assert "tpu_custom_call" not in hlo and plans[-1].implementation == "xla"
  # Inputs without a sharding compile where they live (this CPU), whatever the inner mesh.
  jax.jit(with_mesh(mesh)(_tpu_loss())).lower(plain, plain, plain).compile()
  assert (plans[-1].platform, plans[-1].implementation) == ("cpu", "xla")
  assert "not sharded: the mesh was set inside the trace" in plans[-1].reason


# Fallback: each case is one reason "auto" can't use a kernel, with interpret mode on so
# that the Pallas kernels are candidates on CPU.
FALLBACKS = {
    "seq-not-a-block-multiple": (
        dict(shape=(1, 100, 2, 2, 32)),
        ["splash: sequence lengths (100, 100) must be multiples of 128",
         "pallas_gpu: sequence length 100 must be a multiple of 16"]),
    "window-and-seq": (
        dict(shape=(1, 96, 2, 2, 32), sliding_window=4),
        ["splash: sequence lengths (96, 96) must be multiples of 128",
         "pallas_gpu: sliding_window is not supported"]),
    "dtype-and-window": (
        dict(shape=(1, 128, 2, 2, 32), sliding_window=4, dtype=jnp.float16),
        ["splash: dtype float16 not in", "pallas_gpu: sliding_window is not supported"]),
    "heads-vs-tensor-axis": (
        dict(shape=(4, 128, 4, 2, 32), mesh=True),
        ["splash: heads 4 and kv heads 2 must be divisible by mesh axes ('tensor',) "
         "(size 4)", "pallas_gpu: heads 4 and kv heads 2"]),
}


@pytest.fixture
def fresh_log(caplog):
  attention_lib._log_fallback.cache_clear()  # pylint: disable=protected-access
  caplog.set_level(py_logging.WARNING)
  yield caplog
  attention_lib._log_fallback.cache_clear()  # pylint: disable=protected-access


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallback_gives_reference_result_and_logs_reason_once(case, fresh_log):
  options, reasons = FALLBACKS[case]
  b, t, h, kh, d = options["shape"]
  q, k, v = _qkv(b, t, h, kh, d, options.get("dtype", jnp.float32))
  window = options.get("sliding_window")
  mesh = _mesh() if options.get("mesh") else None
  fn = with_kernel(functools.partial(attention, causal=True, sliding_window=window),
                   interpret=True)
  with with_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    sel = with_kernel(kernel_selection, interpret=True)(
        q.shape, k.shape, q.dtype, causal=True, sliding_window=window)
    out = fn(q, k, v)
    fn(q, k, v)  # The same reason again: logged once only.
  assert sel.implementation == "xla" and sel.fallback
  for reason in reasons:
    assert reason in sel.reason
  expected = _reference(q, k, v, causal=True, window=None if window is None else
                        (window, window))
  tolerance = 2e-3 if q.dtype == jnp.float16 else 1e-5
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tolerance)
  logged = [r.getMessage() for r in fresh_log.records if "falls back" in r.getMessage()]
  assert len(logged) == 1 and sel.reason in logged[0]


def test_platform_choice_and_reasons_per_platform():
  shape = (2, 512, 8, 128)
  tpu = kernel_selection(shape, shape, jnp.bfloat16, causal=True, platform="tpu")
  assert (tpu.implementation, tpu.fallback) == ("splash", False)
  assert tpu.block_sizes == BlockSizes(512, 512, 512, 512)
  cuda = kernel_selection(shape, shape, jnp.bfloat16, causal=True, platform="cuda")
  assert cuda.implementation == "cudnn" and cuda.block_sizes is None
  # cuDNN can't take float32 or segment ids: Pallas-Triton serves instead.
  cuda32 = kernel_selection(shape, shape, jnp.float32, platform="cuda")
  assert cuda32.implementation == "pallas_gpu"
  assert cuda32.block_sizes == BlockSizes(128, 128, 32, 32)
  ids = jax.ShapeDtypeStruct(shape[:2], jnp.int32)
  segs = kernel_selection(shape, shape, jnp.bfloat16, segment_ids=ids, platform="cuda")
  assert segs.implementation == "pallas_gpu"
  assert "cudnn: segment_ids are not supported" in segs.reason
  # Neither GPU kernel: a right-hand window without causal, and a q/kv pair of segment ids.
  neither = kernel_selection(shape, shape, jnp.bfloat16, sliding_window=(8, 8), platform="cuda")
  assert neither.implementation == "xla" and neither.fallback
  assert "needs causal=True on cuDNN" in neither.reason
  tpu_odd = kernel_selection((1, 200, 2, 64), (1, 200, 2, 64), platform="tpu")
  assert tpu_odd.implementation == "xla"
  assert "splash: sequence lengths (200, 200) must be multiples of 128" in tpu_odd.reason
  # Block sizes follow the shape, and can be overridden.
  assert kernel_selection((1, 768, 2, 64), (1, 768, 2, 64), platform="tpu").block_sizes[:2] == (
      256, 256)
  custom = kernel_selection(shape, shape, platform="tpu", block_sizes=BlockSizes(128, 256))
  assert custom.block_sizes == BlockSizes(128, 256, 128, 256)
  # A CPU without interpret mode has no kernel: xla, with no fallback to report.
  cpu = kernel_selection(shape, shape, platform="cpu")
  assert cpu.implementation == "xla" and not cpu.fallback
  assert "no attention kernel for platform 'cpu'" in cpu.reason


@pytest.mark.parametrize("implementation,kwargs,reason", [
    ("splash", {}, "needs platform tpu, this is cpu"),
    ("cudnn", {}, "needs platform cuda, this is cpu"),
    ("pallas_gpu", dict(interpret=True, sliding_window=8),
     "sliding_window is not supported by the Pallas Triton attention"),
    ("splash", dict(interpret=True, block_sizes=BlockSizes(128, 64)),
     "block_kv be a multiple of 128"),
])
def test_forced_implementation_that_cannot_serve_raises(implementation, kwargs, reason):
  q, k, v = _qkv(1, 128, 2, 2, 32)
  kwargs = dict(kwargs)
  fn = functools.partial(attention, implementation=implementation)
  if kwargs.pop("interpret", False):
    fn = with_kernel(fn, interpret=True)
  with pytest.raises(KernelError, match=re.escape(reason)) as info:
    fn(q, k, v, **kwargs)
  assert f"implementation={implementation!r}" in str(info.value)


def test_with_kernel_forced_choice_raises_too():
  q, k, v = _qkv(1, 128, 2, 2, 32)
  with pytest.raises(KernelError, match="'splash'.*needs platform tpu"):
    with_kernel(attention, attention="splash")(q, k, v)


def _kernel_names(jaxpr) -> list[str]:
  return re.findall(r"name=(\w+)", str(jaxpr))


@pytest.mark.hlo_unread_loops  # the causal Triton kernel's key-block bound depends on the query block
def test_with_kernel_scopes_each_wrapped_function_in_one_program():
  q, k, v = _qkv(1, 128, 2, 2, 64)
  inner = functools.partial(attention, causal=True)
  as_xla = with_kernel(inner, attention="xla")
  as_splash = with_kernel(inner, attention="splash", interpret=True)
  as_triton = with_kernel(inner, attention="pallas_gpu", interpret=True)

  def program(q, k, v):
    return as_xla(q, k, v), as_splash(q, k, v), as_triton(q, k, v), inner(q, k, v)

  jaxpr = jax.make_jaxpr(program)(q, k, v)
  # Exactly one Pallas call per kernel-wrapped function; the others are plain XLA.
  assert str(jaxpr).count("pallas_call") == 2
  names = _kernel_names(jaxpr)
  assert names.count("splash_mha_fwd_no_residuals") == 1 and names.count("mha_forward") == 1
  outs = jax.jit(program)(q, k, v)
  ref = _reference(q, k, v, causal=True)
  for out in outs:
    np.testing.assert_allclose(out, ref, atol=2e-5)
  # Outside the wrapped calls the choice is back to the default.
  assert kernel_selection(q.shape, k.shape).requested == "auto"
  assert not kernel_selection(q.shape, k.shape).interpret


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_with_kernel_composes_with_mesh_in_either_order():
  mesh = _mesh((2, 4), ("fsdp", "tensor"))
  q, k, v = _qkv(2, 128, 4, 4, 32)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v))
  plans = []

  def recording():  # A fresh function per jit: jit caches a trace per function.
    def fn(q, k, v):
      plans.append(kernel_selection(q.shape, k.shape, q.dtype))
      return loss(q, k, v)
    return fn

  # As around a shard_step'd step: with_kernel outside with_mesh, and inside it.
  a = with_kernel(with_mesh(mesh)(jax.jit(recording())), attention="splash", interpret=True)
  b = with_mesh(mesh)(with_kernel(jax.jit(recording()), attention="pallas_gpu",
                                  interpret=True))
  # The preferred form: with_kernel inside the jit, so the trace itself carries the choice.
  c = with_mesh(mesh)(jax.jit(with_kernel(recording(), attention="xla")))
  # A mesh set only inside the trace, inputs unsharded: the kernel runs without shard_map.
  d = jax.jit(with_mesh(mesh)(with_kernel(recording(), attention="splash", interpret=True)))
  for fn in (a, b, c, d):
    np.testing.assert_allclose(fn(q, k, v), loss(q, k, v), rtol=1e-5)
  assert [p.implementation for p in plans] == ["splash", "pallas_gpu", "xla", "splash"]
  assert plans[0].batch_axes == ("fsdp",) and plans[1].head_axes == ("tensor",)
  assert plans[3].batch_axes == () and "not sharded" in plans[3].reason
  # Used as a decorator, with_kernel keeps the name and signature.
  decorated = with_kernel(attention="xla")(loss)
  assert decorated.__name__ == "<lambda>" and decorated.__wrapped__ is loss


@pytest.mark.parametrize("mode", ["auto", "shard_map"])
def test_with_kernel_inside_shard_step_trains_like_the_reference(mode):
  # mode="shard_map": the step per data shard in a shard_map that checks varying types,
  # where splash once fell back to XLA (forced: an error advising check_vma=False).
  import fnscale  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top,reimported
  mesh = _mesh()
  heads, head_dim, embed = 4, 32, 64
  plans = []

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"wq": jax.random.normal(k1, (embed, heads, head_dim)) * 0.1,
            "wo": jax.random.normal(k2, (heads, head_dim, embed)) * 0.1}

  def loss_fn(params, batch):
    x = batch["x"]
    q = jnp.einsum("bse,ehd->bshd", x, params["wq"])
    plans.append(kernel_selection(q.shape, q.shape, q.dtype, causal=True))
    out = attention(q, q, q, causal=True)
    return jnp.mean((jnp.einsum("bshd,hde->bse", out, params["wo"]) - x) ** 2)

  optimizer = optax.sgd(0.1)
  batch = {"x": jax.random.normal(jax.random.key(1), (4, 128, embed))}
  results = []
  for choice in (dict(attention="splash", interpret=True), dict(attention="xla")):
    state = fnscale.init_state(init, optimizer, mesh=mesh, key=jax.random.key(0))
    step = fnscale.shard_step(with_kernel(fnscale.train_step(loss_fn, optimizer), **choice),
                              mesh, mode=mode)
    results.append(step(state, batch))
    assert plans and {p.implementation for p in plans} == {choice["attention"]}
    batch_axes = ("data",) if mode == "auto" else ()  # shard_map: data axes already manual
    sharded = (batch_axes, ("tensor",)) if choice["attention"] == "splash" else ((), ())
    assert all((p.batch_axes, p.head_axes) == sharded for p in plans)
    plans.clear()
  (state, metrics), (ref_state, ref_metrics) = results
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v: attention(q[0], k, v), "q has shape (128, 2, 32); expected [batch,"),
    (lambda q, k, v: attention(q, k[:, :, :1], v), "k shape (1, 128, 1, 32) and v shape"),
    (lambda q, k, v: attention(q[:, :, :1], k, v), "kv heads 2 (k (1, 128, 2, 32)) must "
     "divide q heads 1"),
    (lambda q, k, v: attention(q, k.astype(jnp.bfloat16), v), "dtypes float32, bfloat16"),
    (lambda q, k, v: attention(q, k, v, implementation="flash"),
     "implementation='flash'): expected one of"),
    (lambda q, k, v: attention(q, k, v, sliding_window=-1), "sliding_window=-1"),
    (lambda q, k, v: attention(q, k, v, scale=0.0), "scale=0.0"),
    (lambda q, k, v: attention(q, k, v, soft_cap=-1.0), "soft_cap=-1.0): expected None or"),
    (lambda q, k, v: attention(q, k, v, soft_cap=True), "soft_cap=True): expected None or"),
    (lambda q, k, v: attention(q, k, v, block_sizes=(128, 128)), "block_sizes=(128, 128)"),
    (lambda q, k, v: attention(q, k, v, block_sizes=BlockSizes(0, 128)),
     "BlockSizes.block_q=0"),
    (lambda q, k, v: attention(q, k, v, segment_ids=jnp.zeros((1, 64), jnp.int32)),
     "q segment_ids shape (1, 64); expected [batch, seq] = (1, 128)"),
    (lambda q, k, v: attention(q, k, v, segment_ids=jnp.zeros((1, 128))),
     "segment_ids dtype float32; expected an integer"),
    (lambda q, k, v: attention(q, k[:, :64], v[:, :64], segment_ids=jnp.zeros(
        (1, 128), jnp.int32)), "one segment_ids array needs q_seq == kv_seq"),
    (lambda q, k, v: with_kernel(attention, attention="fast"), "attention='fast'"),
    (lambda q, k, v: with_kernel(attention, interpret=1), "interpret=1"),
    (lambda q, k, v: with_kernel(3), "expected a function to wrap, got int"),
])
def test_bad_attention_inputs_raise_kernel_error(call, message):
  q, k, v = _qkv(1, 128, 2, 2, 32)
  with pytest.raises(KernelError, match=re.escape(message)):
    call(q, k, v)


def _plain_ce(hidden, unembed, labels, where=None, z_loss=0.0):
  logits = (hidden.astype(jnp.float32) @ unembed.astype(jnp.float32))
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  per_token += z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
  if where is None:
    return per_token.mean()
  return jnp.sum(jnp.where(where, per_token, 0.0)) / jnp.sum(where)


@pytest.mark.parametrize("chunk_size,z_loss,masked", [(16, 0.0, False), (20, 1e-3, True)])
def test_chunked_cross_entropy_matches_plain_value_and_gradient(chunk_size, z_loss, masked):
  ks = jax.random.split(jax.random.key(3), 4)
  tokens, d, vocab = 48, 32, 1000  # 48 = 3 full chunks of 16 (or 2 of 20 and a tail of 8).
  hidden = jax.random.normal(ks[0], (tokens, d))
  unembed = jax.random.normal(ks[1], (d, vocab)) * 0.5
  labels = jax.random.randint(ks[2], (tokens,), 0, vocab)
  where = jax.random.bernoulli(ks[3], 0.7, (tokens,)) if masked else None
  got = jax.jit(jax.value_and_grad(
      lambda h, u: cross_entropy(h, u, labels, where=where, chunk_size=chunk_size,
                                 z_loss=z_loss), argnums=(0, 1)))(hidden, unembed)
  want = jax.value_and_grad(lambda h, u: _plain_ce(h, u, labels, where, z_loss),
                            argnums=(0, 1))(hidden, unembed)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-4)
  per_token = cross_entropy(hidden, unembed, labels, where=where, reduction="none")
  assert per_token.shape == (tokens,)
  if masked:
    assert np.all(np.asarray(per_token)[~np.asarray(where)] == 0)
  np.testing.assert_allclose(
      cross_entropy(hidden, unembed, labels, reduction="sum", chunk_size=chunk_size),
      _plain_ce(hidden, unembed, labels) * tokens, rtol=1e-5)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "vocab-over-tensor"])
def test_soft_capped_cross_entropy_matches_optax(sharded):
  # Gemma 2's final logits, c tanh(logits / c), c small enough to bend them: the mean's
  # value and gradients and a per-token loss's gradient under a cotangent (the backward
  # that recomputes the chunks' logits), against optax on the capped logits.
  ks = jax.random.split(jax.random.key(4), 4)
  hidden = jax.random.normal(ks[0], (2, 24, 32))
  unembed = jax.random.normal(ks[1], (32, 96))
  labels = jax.random.randint(ks[2], (2, 24), 0, 96)
  weight = jax.random.uniform(ks[3], (2, 24))
  capped = lambda h, u: optax.softmax_cross_entropy_with_integer_labels(
      3.0 * jnp.tanh(h @ u / 3.0), labels)
  ours = lambda h, u, **kw: cross_entropy(h, u, labels, soft_cap=3.0, chunk_size=16, **kw)
  forms = [(lambda h, u: ours(h, u), lambda h, u: capped(h, u).mean()),
           (lambda h, u: jnp.sum(weight * ours(h, u, reduction="none")),
            lambda h, u: jnp.sum(weight * capped(h, u)))]
  for fn, reference in forms:
    with with_mesh(_mesh()) if sharded else contextlib.nullcontext():
      got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(hidden, unembed)
    want = jax.value_and_grad(reference, argnums=(0, 1))(hidden, unembed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
      np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-4)
  plain = optax.softmax_cross_entropy_with_integer_labels(hidden @ unembed, labels).mean()
  assert abs(float(plain) - float(forms[0][1](hidden, unembed))) > 0.1
  with pytest.raises(KernelError, match=r"soft_cap=0\): expected None or a positive"):
    cross_entropy(hidden, unembed, labels, soft_cap=0)


# bfloat16 keeps 8 bits of mantissa (relative step 2**-8 = 0.4%); the gradients sum a few
# hundred such terms, so ~1% relative error is bfloat16 itself, not the chunked loss.
BF16_GRAD_TOLERANCE = 2e-2


@pytest.mark.slow
def test_chunked_cross_entropy_bfloat16_gradient_dtypes():
  hidden = jnp.ones((16, 8), jnp.bfloat16)
  unembed = jnp.linspace(-1, 1, 8 * 300, dtype=jnp.float32).reshape(8, 300).astype(
      jnp.bfloat16)
  labels = jnp.arange(16, dtype=jnp.int32) * 17
  grads = jax.grad(lambda h, u: cross_entropy(h, u, labels, chunk_size=6),
                   argnums=(0, 1))(hidden, unembed)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
  want = jax.grad(lambda h, u: _plain_ce(h, u, labels), argnums=(0, 1))(hidden, unembed)
  for g, w in zip(grads, want):
    # Relative to the gradient's size (entries are ~1e-2): zeros or a wrong sign score ~1.
    assert _relative_error(g, w) < BF16_GRAD_TOLERANCE


def test_cross_entropy_temporary_memory_matches_the_readme():
  # At 2048 tokens x 32k vocab (float32) the compiled temporaries of value-and-grad fall
  # from 512 MiB to 162 MiB (default chunk, 1024 tokens) or 48 MiB (chunk 128).
  tokens, d, vocab = 2048, 256, 32768
  hidden = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
  unembed = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)

  def temp_mib(loss):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        hidden, unembed, labels).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20

  plain = temp_mib(lambda h, u, y: _plain_ce(h, u, y))
  default = temp_mib(lambda h, u, y: cross_entropy(h, u, y))
  chunk_128 = temp_mib(lambda h, u, y: cross_entropy(h, u, y, chunk_size=128))
  mib = lambda rows: rows * vocab * 4 / 2**20  # float32 logits of `rows` tokens
  product = d * vocab * 4 / 2**20  # one chunk's [d, vocab] float32 unembedding gradient
  # Hand counts: the plain loss holds the logits and their gradient (2 x 256 MiB); the
  # chunked one a chunk's logits (default: 2**23 / 32768 = 256 tokens raised to the
  # 1024-token floor; turned in place into their gradient), the chunk's 32 MiB product
  # before XLA:CPU adds it to the unembedding's gradient (the output), and a little
  # bookkeeping (2 MiB at 1024 tokens, under 1 MiB at 128).
  assert 2 * mib(tokens) <= plain <= 2 * mib(tokens) * 1.05
  assert mib(1024) + product <= default < mib(1024) + product + 3
  assert mib(128) + product <= chunk_128 < mib(128) + product + 1
  assert (round(plain), round(default), round(chunk_128)) == (512, 162, 48)


@pytest.mark.parametrize("form", ["ambient-mesh", "argument-shardings"])
def test_cross_entropy_with_vocab_sharded_unembedding_matches_unsharded(form):
  mesh = fs.make_mesh({"data": 2, "tensor": 4})
  put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(*spec)))
  ks = jax.random.split(jax.random.key(5), 4)
  tokens, d, vocab = 48, 32, 1000  # 24 tokens per device: 2 chunks of 10 and a tail.
  hidden = jax.random.normal(ks[0], (tokens, d))
  unembed = jax.random.normal(ks[1], (d, vocab)) * 0.5
  labels = jax.random.randint(ks[2], (tokens,), 0, vocab)
  where = jax.random.bernoulli(ks[3], 0.7, (tokens,))
  loss = lambda h, u: cross_entropy(h, u, put(labels, "data"), where=put(where, "data"),
                                    chunk_size=10, z_loss=1e-3)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = put(hidden, "data", None), put(unembed, None, "tensor")
  with with_mesh(mesh) if form == "ambient-mesh" else contextlib.nullcontext():
    compiled = step.lower(*args).compile()
  value, (d_hidden, d_unembed) = compiled(*args)
  want, want_grads = jax.value_and_grad(
      lambda h, u: _plain_ce(h, u, labels, where, 1e-3), argnums=(0, 1))(hidden, unembed)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  assert _relative_error(d_hidden, want_grads[0]) < 1e-5
  assert _relative_error(d_unembed, want_grads[1]) < 1e-5
  # Each device keeps its vocabulary shard: no all-gather of the unembedding, only of each
  # token's statistics (max, sum of exponentials, label logit: 3 float32 from each of the
  # 4 shards for the device's 24 tokens), and its gradient comes back split the same way.
  s = fs.analysis.hlo.summarize(compiled.as_text())
  assert s.collective("all-gather").bytes == 24 * 3 * 4 * 4
  assert _hlo_collectives(compiled.as_text().replace("all-gather", "")) == []
  assert d_unembed.sharding.spec == jax.P(None, "tensor")


def test_cross_entropy_vocab_parallel_over_fsdp_gathers_tokens_not_the_unembedding():
  # An unembedding stored split by vocabulary over "fsdp" (as recipes/lm/llama.py stores its
  # output layer): the hidden states and labels are gathered over fsdp (48 x 32 float32,
  # 6 KiB), never the [32, 1024] unembedding (128 KiB), whose gradient stays split.
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(*spec)))
  ks = jax.random.split(jax.random.key(6), 3)
  tokens, d, vocab = 48, 32, 1024
  hidden = jax.random.normal(ks[0], (tokens, d))
  unembed = jax.random.normal(ks[1], (d, vocab)) * 0.5
  labels = jax.random.randint(ks[2], (tokens,), 0, vocab)
  loss = lambda h, u: cross_entropy(h, u, put(labels, ("data", "fsdp")), chunk_size=10,
                                    vocab_axes=("fsdp", "tensor"))
  args = put(hidden, ("data", "fsdp"), None), put(unembed, None, "fsdp")
  with with_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
  value, (d_hidden, d_unembed) = compiled(*args)
  want, want_grads = jax.value_and_grad(
      lambda h, u: _plain_ce(h, u, labels, None, 0.0), argnums=(0, 1))(hidden, unembed)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  assert _relative_error(d_hidden, want_grads[0]) < 1e-5
  assert _relative_error(d_unembed, want_grads[1]) < 1e-5
  assert d_unembed.sharding.spec == jax.P(None, "fsdp")
  s = fs.analysis.hlo.summarize(compiled.as_text())
  # Gathered: this data shard's 24 rows of hidden states (3 KiB) and labels, and per token
  # 3 float32 statistics from each of the 4 shards, far below the unembedding's 128 KiB;
  # the hidden states' gradient is reduce-scattered back to the device's 6 rows; the
  # unembedding's is all-reduced over "data" only (2 devices).
  assert s.collective("all-gather").bytes <= 24 * (d + 1) * 4 + 24 * 3 * 4 * 4
  assert s.collective("reduce-scatter").bytes == 6 * d * 4
  assert sum(b for k, n, b in s.groups if k == "all-reduce" and n == 2) == pytest.approx(
      2 * 0.5 * d * vocab // 4 * 4, rel=0.01)


def _plain_reduced(hidden, unembed, labels, where, reduction):
  logits = hidden.astype(jnp.float32) @ unembed.astype(jnp.float32)
  per_token = jnp.where(where, optax.softmax_cross_entropy_with_integer_labels(logits, labels),
                        0.0)
  return {"none": per_token, "sum": per_token.sum(),
          "mean": per_token.sum() / where.sum()}[reduction]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("reduction,outer", [
    ("mean", lambda loss: 3.0 * loss + 1.0),
    ("sum", lambda loss: -0.5 * loss),
    ("none", lambda loss: jnp.sum(loss * jnp.linspace(-2.0, 3.0, loss.shape[0]))),
])
def test_cross_entropy_gradient_under_any_cotangent(reduction, outer, sharded):
  # "mean" and "sum" compute their gradients in the forward pass and scale them by the
  # incoming cotangent; "none" recomputes them for a cotangent per token. Inside a larger
  # loss (scaled, shifted, weighted per token) both must give the plain loss's gradients,
  # on whole arrays and vocab-parallel (tokens over "data", vocabulary over "tensor").
  mesh = fs.make_mesh({"data": 2, "tensor": 4})
  ks = jax.random.split(jax.random.key(8), 4)
  tokens, d, vocab = 40, 16, 512  # 20 tokens per device: chunks of 8, 8 and 4.
  hidden = jax.random.normal(ks[0], (tokens, d))
  unembed = jax.random.normal(ks[1], (d, vocab)) * 0.5
  labels = jax.random.randint(ks[2], (tokens,), 0, vocab)
  where = jax.random.bernoulli(ks[3], 0.7, (tokens,))
  loss = lambda h, u: outer(cross_entropy(h, u, labels, where=where, chunk_size=8,
                                          reduction=reduction))
  with with_mesh(mesh) if sharded else contextlib.nullcontext():
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, unembed)
  want, want_grads = jax.value_and_grad(
      lambda h, u: outer(_plain_reduced(h, u, labels, where, reduction)),
      argnums=(0, 1))(hidden, unembed)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  for g, w in zip(grads, want_grads):
    assert _relative_error(g, w) < 1e-5


def _ce_step_matmul_flops(loss, *args):
  """HLO matmul FLOPs per device of value_and_grad(loss) over its first two arguments."""
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower().compile()
  s = fs.analysis.hlo.summarize(compiled.as_text())
  assert s.unknown_trip_counts == 0
  return s.matmul_flops


@pytest.mark.parametrize("chunk_size", [None, 16, 20])
def test_cross_entropy_matmul_flops_are_the_plain_losses(chunk_size):
  # By hand, as for the plain loss: the logits (2 T d V) and the two gradient matmuls, into
  # the hidden states and into the unembedding (2 T d V each); no logits recomputed, with
  # a chunk of 20 leaving a last chunk of 8. Per-token losses (a cotangent per token)
  # recompute them: 8 T d V.
  tokens, d, vocab = 48, 32, 1000
  args = (jax.ShapeDtypeStruct((tokens, d), jnp.float32),
          jax.ShapeDtypeStruct((d, vocab), jnp.float32),
          jax.ShapeDtypeStruct((tokens,), jnp.int32))
  loss = lambda h, u, y, **kw: cross_entropy(h, u, y, chunk_size=chunk_size, **kw)
  assert _ce_step_matmul_flops(loss, *args) == 6 * tokens * d * vocab
  masked_sum = lambda h, u, y: loss(h, u, y, where=y > 9, reduction="sum", z_loss=1e-4)
  assert _ce_step_matmul_flops(masked_sum, *args) == 6 * tokens * d * vocab
  weighted = lambda h, u, y: jnp.sum(loss(h, u, y, reduction="none") * jnp.arange(tokens))
  # XLA merges a recomputed chunk outside a loop with the forward's (the single default
  # chunk of 48; the tail of 8 after two chunks of 20): 2 T d V more per looped token.
  looped = {None: 0, 16: 48, 20: 40}[chunk_size]
  assert _ce_step_matmul_flops(weighted, *args) == (6 * tokens + 2 * looped) * d * vocab


def _sharded_ce_flops(mesh, tokens, d, vocab, dtype, vocab_axes):
  """Per-device HLO matmul FLOPs of value_and_grad of the mean loss, tokens over the data
  axes and the unembedding's vocabulary over `vocab_axes`."""
  spec = lambda *s: jax.sharding.NamedSharding(mesh, jax.P(*s))
  batch = tuple(a for a in mesh.axis_names if a != "tensor")
  args = (jax.ShapeDtypeStruct((tokens, d), dtype, sharding=spec(batch, None)),
          jax.ShapeDtypeStruct((d, vocab), dtype, sharding=spec(
              None, tuple(a for a in vocab_axes if a in mesh.axis_names))),
          jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=spec(batch)))
  with with_mesh(mesh):
    return _ce_step_matmul_flops(
        lambda h, u, y: cross_entropy(h, u, y, vocab_axes=vocab_axes), *args)


def test_vocab_parallel_cross_entropy_matmul_flops_per_device():
  # {data 2, fsdp 4}, vocabulary over fsdp: a device scores its data shard's 24 tokens
  # (gathered over fsdp) against its 256 of the 1024 columns; 6 T d V per device.
  mesh = fs.make_mesh({"data": 2, "fsdp": 4})
  assert _sharded_ce_flops(mesh, 48, 32, 1024, jnp.float32, ("fsdp", "tensor")) == (
      6 * 24 * 32 * 256)
  # {data 2, tensor 4}: 24 tokens x 250 columns per device.
  mesh = fs.make_mesh({"data": 2, "tensor": 4})
  assert _sharded_ce_flops(mesh, 48, 32, 1000, jnp.float32, ("tensor",)) == 6 * 24 * 32 * 250


@pytest.mark.tpu
@pytest.mark.slow
def test_vocab_parallel_cross_entropy_matmul_flops_on_a_tpu_target(tpu_devices):
  # v5p:2x2x2 as {data 2, fsdp 2, tensor 2}, bfloat16, the vocabulary over fsdp and tensor
  # (as recipes/lm/llama.py stores its output layer): per device 1024 / 2 = 512 tokens of its
  # data shard (default chunks of 2**23 / 8192 = 1024 -> all 512 at once) and 32768 / 4
  # = 8192 columns; 6 T d V per device.
  mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=tpu_devices("v5p:2x2x2"))
  assert _sharded_ce_flops(mesh, 1024, 256, 32768, jnp.bfloat16, ("fsdp", "tensor")) == (
      6 * 512 * 256 * 8192)
  # 4096 tokens: 2048 per device in chunks of 1024 (a loop of 2).
  assert _sharded_ce_flops(mesh, 4096, 256, 32768, jnp.bfloat16, ("fsdp", "tensor")) == (
      6 * 2048 * 256 * 8192)


@pytest.mark.parametrize("kwargs,message", [
    (dict(vocab_axes="fsdp"), "vocab_axes='fsdp'): expected a tuple of mesh axis names"),
    (dict(hidden=jnp.zeros((4, 8, 2))), "hidden (4, 8, 2) and unembed (8, 16) must be"),
    (dict(labels=jnp.zeros((4,))), "labels (4,) float32; expected integer [tokens] = (4,)"),
    (dict(labels=jnp.zeros((5,), jnp.int32)), "labels (5,) int32"),
    (dict(where=jnp.ones((4,))), "where (4,) float32; expected bool"),
    (dict(block_size=17), "block_size=17): the loss walks tokens, not vocabulary columns"),
    (dict(chunk_size=5), "chunk_size=5): expected an int in [1, tokens=4]"),
    (dict(chunk_size=True), "chunk_size=True): expected an int"),
    (dict(z_loss=-1.0), "z_loss=-1.0"),
    (dict(reduction="max"), "reduction='max'"),
])
def test_bad_cross_entropy_inputs_raise_kernel_error(kwargs, message):
  args = dict(hidden=jnp.zeros((4, 8)), unembed=jnp.zeros((8, 16)),
              labels=jnp.zeros((4,), jnp.int32))
  options = {key: kwargs.pop(key) for key in list(kwargs) if key not in args}
  args.update(kwargs)
  with pytest.raises(KernelError, match=re.escape(message)):
    cross_entropy(args["hidden"], args["unembed"], args["labels"], **options)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench_attention(*flags):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(ROOT / "recipes" / "bench" / "attention.py"), *flags],
                        env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_bench_attention_command_line():
  out = _bench_attention("--shapes", "1x128x1x1x32,1x100x1x1x32", "--implementations",
                         "xla,splash", "--iters", "1", "--warmup", "0", "--no-causal")
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  lines = out.stdout.splitlines()
  # The topology report (the same options as the main job) comes first, then the header.
  assert lines[0].startswith("topology: cpu") and "8 devices" in lines[0]
  lines = lines[1:]
  assert lines[0].startswith("platform=cpu") and "causal=False median of 1 after 0" in lines[0]
  rows = {tuple(line.split()[:3]): line.split()[3:] for line in lines[3:]
          if line.startswith("1x")}
  # Shape x implementation x mode: one row each; the splash row gives its tiles.
  assert set(rows) == {("1x128x1x1x32", "xla", "native"), ("1x128x1x1x32", "splash",
                                                           "interpret"),
                       ("1x100x1x1x32", "xla", "native"), ("1x100x1x1x32", "splash",
                                                           "interpret")}
  blocks, ms, ratio, compile_s = rows[("1x128x1x1x32", "splash", "interpret")]
  assert blocks == "128x128" and float(ms) > 0 and ratio.endswith("x")
  assert float(compile_s) > 0
  assert rows[("1x128x1x1x32", "xla", "native")][1] == "1.00x"  # (no tiles column)
  # A shape splash can't serve says why instead of a time.
  assert " ".join(rows[("1x100x1x1x32", "splash", "interpret")]).startswith(
      "n/a: attention(implementation='splash') can't serve this call: sequence lengths "
      "(100, 100) must be multiples of 128")


@pytest.mark.slow  # (the quick tier's megablox forward-mode test reads this gradient too)
@pytest.mark.hlo_unread_loops  # megablox in Pallas interpret mode: loops over its grid
def test_megablox_gradient_is_zero_on_the_rows_past_the_groups():
  # 220 of 256 rows in groups: the kernel writes no gradient for the other 36 (NaN in
  # interpret mode where it once returned them); ragged_dot's, by masks, is zero there.
  from fnscale.kernels import grouped_matmul  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), 3)
  lhs, rhs = jax.random.normal(keys[0], (256, 128)), jax.random.normal(keys[1], (2, 128, 128))
  weight = jax.random.normal(keys[2], (256, 128))
  sizes = jnp.array([100, 120], jnp.int32)
  group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(256), side="right")

  def masked(lhs, rhs):
    out = jnp.einsum("mk,mkn->mn", lhs, rhs[jnp.minimum(group, 1)])
    return jnp.where((group < 2)[:, None], out, 0.0)

  loss = lambda mm: jax.jit(jax.value_and_grad(
      lambda l, r: jnp.sum(mm(l, r) * weight), argnums=(0, 1)))(lhs, rhs)
  got = loss(lambda l, r: grouped_matmul(l, r, sizes, implementation="megablox",
                                         interpret=True))
  want = loss(masked)
  assert not np.isnan(np.asarray(got[1][0])).any()
  assert np.all(np.asarray(got[1][0])[220:] == 0.0)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _relative_error(g, w) < 1e-5



@pytest.mark.hlo_unread_loops  # megablox in Pallas interpret mode: loops over its grid
def test_megablox_output_is_zero_on_the_rows_past_the_groups():
  # The chip test's case (tests/test_chip.py): one 512-row tile, an empty group, 32 rows past
  # the groups, which the kernel leaves unwritten (NaN in interpret mode) and grouped_matmul
  # selects to zero. The reference is ragged_dot with those rows selected to zero too: what
  # ragged_dot itself leaves there is unspecified (on a TPU, not zero).
  from jax.experimental.pallas.ops.tpu.megablox import ops  # pylint: disable=import-outside-toplevel
  from fnscale.kernels import grouped_matmul  # pylint: disable=import-outside-toplevel
  m, k, n, sizes = 512, 256, 256, (100, 0, 250, 130)
  used = sum(sizes)
  lhs = jax.random.normal(jax.random.key(1), (m, k))
  rhs = jax.random.normal(jax.random.key(2), (len(sizes), k, n)) / 16
  group_sizes = jnp.asarray(sizes, jnp.int32)
  weights = jnp.cos(jnp.arange(m * n, dtype=jnp.float32).reshape(m, n))
  rows = (jnp.arange(m) < used)[:, None]

  def product_and_grads(matmul):
    loss = lambda l, r: jnp.sum(matmul(l, r, group_sizes) * weights)
    return jax.jit(lambda l, r: (matmul(l, r, group_sizes),
                                 *jax.grad(loss, argnums=(0, 1))(l, r)))

  unwritten = ops.gmm(lhs, rhs, group_sizes, jnp.float32, (512, 256, 256), None, None, False,
                      True)
  assert np.array_equal(np.nonzero(np.isnan(np.asarray(unwritten)).any(axis=1))[0],
                        np.arange(used, m))
  got = product_and_grads(functools.partial(grouped_matmul, implementation="megablox",
                                            interpret=True))(lhs, rhs)
  with jax.default_matmul_precision("highest"):
    want = product_and_grads(lambda l, r, s: jnp.where(rows, jax.lax.ragged_dot(l, r, s), 0))(
        lhs, rhs)
  assert not np.asarray(got[0][used:]).any()
  for g, w in zip((got[0], got[1][:used], got[2]), (want[0], want[1][:used], want[2])):
    assert _relative_error(g, w) < 1e-5

def _per_device_cases():
  """name -> (kernel fn, reference fn, input): each a function of one array, per device."""
  rng = np.random.default_rng(3)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))
  unembed, rhs = normal(32, 300), normal(2, 128, 128)
  sizes = jnp.array([100, 120], jnp.int32)
  labels = lambda h: (jnp.arange(h.shape[0] * h.shape[1]) % 300).reshape(h.shape[:2])

  def attend(kernel):
    return with_kernel(lambda q: attention(q, q, q, causal=True), attention=kernel,
                       interpret=True)

  def group_of(rows):  # each row's group, by the cumulative sizes (rows past them: 2)
    return jnp.sum(jnp.arange(rows)[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)

  def masked_gmm(x):  # every row times every group's matrix, the row's group kept
    g = group_of(x.shape[0])
    return sum(jnp.where((g == i)[:, None], x @ rhs[i], 0.0) for i in range(2))

  plain_ce = lambda h: -jnp.take_along_axis(jax.nn.log_softmax(h @ unembed), labels(h)[
      ..., None], axis=-1)[..., 0]
  return {
      "splash": (attend("splash"), lambda q: jax.nn.dot_product_attention(
          q, q, q, is_causal=True), normal(4, 128, 4, 64)),
      "pallas_gpu": (attend("pallas_gpu"), lambda q: jax.nn.dot_product_attention(
          q, q, q, is_causal=True), normal(4, 128, 4, 64)),
      "cross_entropy": (lambda h: cross_entropy(h, unembed, labels(h), chunk_size=64,
                                                reduction="none"), plain_ce,
                        normal(4, 64, 32)),
      "megablox": (lambda x: fs.kernels.grouped_matmul(x, rhs, sizes, implementation="megablox",
                                                      interpret=True), masked_gmm,
                   normal(4 * 256, 128)),
  }


@pytest.mark.hlo_unread_loops  # Pallas interpret mode: loops over the kernels' grids
@pytest.mark.parametrize("name, where", [
    ("splash", "checked shard_map"), ("cross_entropy", "explicit axes"),
    *(pytest.param(n, w, marks=pytest.mark.slow) for n, w in (
        ("splash", "explicit axes"), ("cross_entropy", "checked shard_map"),
        ("pallas_gpu", "checked shard_map"), ("pallas_gpu", "explicit axes"),
        ("megablox", "checked shard_map"), ("megablox", "explicit axes")))])
def test_kernels_inside_a_checked_shard_map_and_on_explicit_axes(name, where):
  # Inside a shard_map over "data" that checks varying types (a Pallas call's types can't
  # say it varies) and on Explicit axes (shardings in the types, a Pallas call only where
  # every axis is manual): value, gradient and JVP against the same of the XLA reference.
  # They once raised (a refusal advising check_vma=False, jax's type errors) there.
  kernel, reference, x = _per_device_cases()[name]
  if where == "checked shard_map":
    mesh = fs.make_mesh({"data": 4, "tensor": 2})
    wrap = lambda f: jax.shard_map(f, mesh=mesh, in_specs=jax.P("data"),
                                   out_specs=jax.P("data"), axis_names={"data"},
                                   check_vma=True)
  else:
    mesh = fs.make_mesh({"data": 4, "tensor": 2}, axis_types="explicit")
    wrap = lambda f: f
    x = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))
  t = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

  def all_three(f, x, t):
    f = wrap(f)
    return (f(x), jax.grad(lambda x: jnp.sum(f(x) * jnp.sin(f(x))))(x),
            jax.jvp(f, (x,), (t,))[1])

  with fs.with_mesh(mesh):
    got = jax.jit(all_three, static_argnums=0)(kernel, x, t)
    want = jax.jit(all_three, static_argnums=0)(reference, x, t)
  for what, g, w in zip(("value", "gradient", "jvp"), got, want):
    assert _relative_error(g, w) < 1e-4, what


@pytest.mark.tpu
def test_megablox_on_a_multi_device_auto_mesh_compiles_for_tpu(tpu_devices):
  # A direct call under a 4-device mesh of Auto axes: XLA can't partition a Mosaic kernel
  # ("cannot be automatically partitioned"), so each device runs it whole on all the rows;
  # the program holds the kernel, value and gradient.
  mesh = fs.make_mesh({"data": 4}, devices=tpu_devices("v5e:2x2"))
  rows = jax.NamedSharding(mesh, jax.P("data"))
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((2, 256, 512), jnp.bfloat16, sharding=jax.NamedSharding(mesh, jax.P()))
  gmm = lambda x, w: fs.kernels.grouped_matmul(x, w, jnp.array([256, 200], jnp.int32),
                                               implementation="megablox", platform="tpu")
  loss = lambda x, w: jnp.sum(gmm(x, w).astype(jnp.float32))
  with fs.with_mesh(mesh):
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w).compile().as_text()
  assert "tpu_custom_call" in text


def _pallas_grids(jaxpr) -> list:
  """The grid of every pallas_call in `jaxpr` (nested jaxprs included), in order."""
  from jax.extend import core as jcore  # pylint: disable=import-outside-toplevel
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      out.append(tuple(e.params["grid_mapping"].grid))
    for sub in jcore.jaxprs_in_params(e.params):
      out += _pallas_grids(sub)
  return out


def test_with_kernel_block_sizes_tile_every_call_that_gives_none():
  # Splash (interpret mode) on a 512-token causal call, 2 heads: its forward grid is
  # (heads, q tiles, kv tiles), its fused backward's (kv tiles, heads, q tiles).
  # with_kernel's tiles (128, 256) give (2, 4, 2) and (2, 2, 4); a call's own tiles win over
  # them; without either, splash's default 512 tiles: one block.
  q = jnp.ones((1, 512, 2, 128), jnp.float32)

  def grids(block_sizes=None, own=None):
    f = with_kernel(lambda q: attention(q, q, q, causal=True, block_sizes=own),
                    attention="splash", interpret=True, block_sizes=block_sizes)
    return _pallas_grids(jax.make_jaxpr(jax.value_and_grad(lambda q: f(q).sum()))(q).jaxpr)

  assert grids(BlockSizes(128, 256)) == [(2, 4, 2), (2, 2, 4)]
  assert grids(BlockSizes(128, 256), own=BlockSizes(256, 128)) == [(2, 2, 4), (4, 2, 2)]
  assert grids() == [(2, 1, 1), (1, 2, 1)]
  with pytest.raises(KernelError, match=r"with_kernel\(block_sizes=\(128, 256\)\): expected "
                     "fnscale.kernels.BlockSizes"):
    with_kernel(lambda q: q, block_sizes=(128, 256))
  with pytest.raises(KernelError, match=r"with_kernel: BlockSizes.block_kv=0"):
    with_kernel(block_sizes=BlockSizes(128, 0))


def _remat_layers(attend, policy):
  """Two layers of q/k/v projections and causal attention, scanned under jax.checkpoint
  with `policy`, as a model's blocks are: loss and gradients."""
  def layer(x, w):
    b, t, _ = x.shape
    q, k, v = (jnp.einsum("btd,df->btf", x, w[i]).reshape(b, t, 4, 64) for i in range(3))
    return x + attend(q, k, v).reshape(b, t, 256), None
  block = jax.checkpoint(layer, policy=policy)
  loss = lambda x, w: jnp.sum(jnp.cos(jax.lax.scan(block, x, w)[0]).astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1))


_SAVE_ATTENTION = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(fs.kernels.RESIDUALS))


def test_a_policy_saving_the_kernels_residuals_keeps_its_gradients():
  # The kernel's output and logsumexp saved by name, the rest recomputed: the same loss and
  # gradients as the XLA attention without remat.
  x = jax.random.normal(jax.random.key(1), (2, 128, 256))
  w = jax.random.normal(jax.random.key(2), (2, 3, 256, 256)) * 0.05
  splash = with_kernel(lambda q, k, v: attention(q, k, v, causal=True), attention="splash",
                       interpret=True)
  got = jax.jit(_remat_layers(splash, _SAVE_ATTENTION))(x, w)
  want = jax.jit(_remat_layers(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
      jax.checkpoint_policies.everything_saveable))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.tpu
@pytest.mark.parametrize("kv_heads, target", [(4, "v5e:1x1"), (1, "v5e:1x1"), (4, "v5e:2x2")])
def test_a_policy_saving_the_kernels_residuals_runs_its_forward_once_tpu(tpu_devices, kv_heads,
                                                                         target):
  # fs.kernels.RESIDUALS saved by a remat policy: the forward splash kernel runs once per
  # layer (the scan's body), not again in the backward pass, as a bare splash call does.
  # Before, the kernel's layout change ran inside its primitive, whose transposed q/k/v
  # residuals no policy could save, so the backward reran the forward kernel. On 4 devices
  # the kernel runs per shard, inside a shard_map whose body's names no policy saw either.
  del tpu_devices
  mesh = jax.sharding.Mesh(np.array(fs.target_devices(target)), ("data",),
                           axis_types=(AUTO,))
  x = jax.ShapeDtypeStruct((4, 1024, 256), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))
  w = jax.ShapeDtypeStruct((2, 3, 256, 256), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, jax.P()))
  def attend(q, k, v):
    return attention(q, k[:, :, :kv_heads], v[:, :, :kv_heads], causal=True, mesh=mesh)
  hlo = jax.jit(_remat_layers(attend, _SAVE_ATTENTION)).trace(x, w).lower().compile().as_text()
  forward = set(re.findall(r"%(splash_mh?q?a_fwd[\w.]*)\s*=", hlo))
  backward = set(re.findall(r"%(splash_mh?q?a_d[\w.]*)\s*=", hlo))
  assert len(forward) == 1 and backward, (forward, backward)
