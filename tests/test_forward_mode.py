"""Forward-mode autodiff (jax.jvp, jacfwd, Hessian-vector products) through every kernel
fnscale can select, against the JVP of an independent reference (jax's XLA attention,
optax's cross-entropy on whole logits, a loop over experts), while reverse mode keeps each
kernel's own backward pass."""
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import _autodiff
from fnscale.kernels import context_attention as ca
from fnscale.kernels import grouped_matmul
from fnscale.parallel import _experts as ex

attention_module = importlib.import_module("fnscale.kernels.attention")
RNG = np.random.default_rng(0)
B, T, H, D = 1, 128, 2, 64
Q, K, V, W, TQ = (RNG.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(5))


def _close(a, b, atol=1e-4):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4)


def _reference(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _hvp(attend, q):
  """d/dq of <grad_q sum(attend(q) * W), TQ>: forward over reverse."""
  grad = jax.grad(lambda q: jnp.sum(attend(q, K, V) * W))
  return jax.jvp(grad, (q,), (TQ,))[1]


@pytest.mark.hlo_unread_loops  # Pallas interpret mode: loops over the kernel's grid
@pytest.mark.parametrize("kernel", [pytest.param("splash", marks=pytest.mark.slow),
                                    "pallas_gpu"])  # splash runs quick in test_kernels
def test_attention_kernels_push_tangents_forward(kernel, caplog):
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True),
                          attention=kernel, interpret=True)
  jvp = jax.jit(lambda f: jax.jvp(f, (Q, K, V), (TQ, TQ, TQ)), static_argnums=0)
  with caplog.at_level(logging.WARNING):
    out, tangent = jvp(attend)
  want_out, want = jvp(_reference)
  _close(out, want_out)
  _close(tangent, want)
  assert "forward-mode autodiff" in caplog.text and kernel in caplog.text
  # Forward over reverse: a Hessian-vector product.
  hvp = jax.jit(_hvp, static_argnums=0)
  _close(hvp(attend, Q), hvp(_reference, Q), atol=1e-3)
  # Reverse mode still runs the kernel's own backward pass.
  loss = lambda q: jnp.sum(attend(q, K, V) * W)
  assert "pallas_call" in str(jax.make_jaxpr(jax.grad(loss))(Q))
  _close(jax.jit(jax.grad(loss))(Q), jax.grad(lambda q: jnp.sum(_reference(q, K, V) * W))(Q))


def test_cudnn_selection_takes_the_reference_forward(monkeypatch):
  # cuDNN runs only on a GPU: its selection on "cuda", and its wiring with a stand-in kernel
  # (XLA attention behind a custom_vjp that counts its backward passes).
  sel = fs.kernels.kernel_selection((B, T, H, D), (B, T, H, D), jnp.bfloat16, causal=True,
                                    platform="cuda")
  assert sel.implementation == "cudnn"
  calls = []

  @jax.custom_vjp
  def stand_in(q, k, v):
    return _reference(q, k, v)

  def fwd(q, k, v):
    out, vjp = jax.vjp(_reference, q, k, v)
    return out, vjp

  def bwd(vjp, g):
    calls.append(1)
    return vjp(g)

  stand_in.defvjp(fwd, bwd)
  monkeypatch.setitem(attention_module._KERNELS, "cudnn", lambda q, k, v, *_, **__: stand_in(
      q, k, v))
  monkeypatch.setattr(attention_module, "kernel_selection",
                      lambda *a, **kw: sel._replace(fallback=False))
  attend = lambda q, k, v: fs.attention(q, k, v, causal=True, implementation="cudnn")
  jvp = jax.jit(lambda f: jax.jvp(f, (Q, K, V), (TQ, TQ, TQ))[1], static_argnums=0)
  _close(jvp(attend), jvp(_reference))
  assert not calls
  jax.jit(jax.grad(lambda q: jnp.sum(attend(q, K, V) * W)))(Q)
  assert calls


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_blockwise_cross_entropy_pushes_tangents_forward(reduction):
  hidden = jnp.asarray(RNG.normal(size=(64, 32)).astype(np.float32))
  unembed = jnp.asarray(RNG.normal(size=(32, 500)).astype(np.float32) / 4)
  labels = jnp.asarray(RNG.integers(0, 500, size=64).astype(np.int32))
  dh = jnp.asarray(RNG.normal(size=hidden.shape).astype(np.float32))
  du = jnp.asarray(RNG.normal(size=unembed.shape).astype(np.float32))

  def ours(h, u):
    out = fs.cross_entropy(h, u, labels, chunk_size=16, reduction=reduction)
    return out if reduction == "mean" else out * jnp.arange(64) / 64

  def optax_loss(h, u):
    out = optax.softmax_cross_entropy_with_integer_labels(h @ u, labels)
    return out.mean() if reduction == "mean" else out * jnp.arange(64) / 64

  jvp = jax.jit(lambda f: jax.jvp(f, (hidden, unembed), (dh, du))[1], static_argnums=0)
  _close(jvp(ours), jvp(optax_loss))
  scalar = lambda f: (lambda h: jnp.sum(f(h, unembed)))
  hvp = jax.jit(lambda f: jax.jvp(jax.grad(scalar(f)), (hidden,), (dh,))[1], static_argnums=0)
  _close(hvp(ours), hvp(optax_loss))


@pytest.mark.hlo_unread_loops  # splash in Pallas interpret mode: loops over its grid
@pytest.mark.parametrize("form, order, seq", [
    ("ring", "zigzag", 128),
    pytest.param("all_gather", "contiguous", 512, marks=pytest.mark.slow)])
def test_context_forms_push_tangents_forward(form, order, seq):
  # The sequence split 4 ways; the ring's own custom_vjp and splash inside the all-gather
  # form (128-token pieces) differentiate only in reverse.
  c = 4
  q, k, v, dq = (RNG.normal(size=(2, seq, 2, 64)).astype(np.float32) for _ in range(4))
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context=form,
                          context_order=order,
                          attention="splash" if form == "all_gather" else "xla",
                          interpret=True)
  stored = [ca.reorder(x, c, order) for x in (q, k, v, dq)]
  with fs.with_mesh(fs.make_mesh({"data": 2, "context": 4})):
    tangent = jax.jit(lambda q, k, v, t: jax.jvp(lambda q: attend(q, k, v), (q,), (t,))[1])(
        *stored)
  want = jax.jvp(lambda q: _reference(q, k, v), (q,), (dq,))[1]
  _close(ca.restore(np.asarray(tangent), c, order), want)


def _dense_moe(x, params, top):
  """A loop over every expert for the fixed routing `top` [tokens, k] (one-hot gates)."""
  t = x.reshape(-1, x.shape[-1])
  probs = jax.nn.softmax(t @ params["router"], axis=-1)
  w = jnp.take_along_axis(probs, top, axis=-1)
  gate = jnp.einsum("tk,tke->te", w / w.sum(-1, keepdims=True),
                    jax.nn.one_hot(top, params["router"].shape[1]))
  out = jnp.zeros_like(t)
  for e in range(params["router"].shape[1]):
    h = jax.nn.silu(t @ params["w_gate"][e]) * (t @ params["w_up"][e])
    out = out + gate[:, e:e + 1] * (h @ params["w_down"][e])
  return out.reshape(x.shape)


@pytest.mark.hlo_unread_loops  # megablox in Pallas interpret mode: loops over its grid
@pytest.mark.parametrize("gmm", ["ragged_dot", pytest.param("megablox",
                                                            marks=pytest.mark.slow)])
def test_expert_layer_pushes_tangents_forward(gmm):
  d, e, f = 8, 8, 16
  ks = jax.random.split(jax.random.key(0), 4)
  params = {"router": jax.random.normal(ks[0], (d, e)),
            "w_gate": 0.4 * jax.random.normal(ks[1], (e, d, f)),
            "w_up": 0.4 * jax.random.normal(ks[2], (e, d, f)),
            "w_down": 0.4 * jax.random.normal(ks[3], (e, f, d))}
  x = jnp.asarray(RNG.normal(size=(8, 4, d)).astype(np.float32))
  dx = jnp.asarray(RNG.normal(size=x.shape).astype(np.float32))
  logits = np.asarray(x).reshape(-1, d) @ np.asarray(params["router"])
  top = jnp.asarray(np.argsort(-logits, axis=-1, kind="stable")[:, :2])
  layer = lambda x: ex.moe(x, params, k=2, exchange="ragged", grouped_matmul=gmm,
                           interpret=True)[0]
  with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    tangent = jax.jit(lambda x, t: jax.jvp(layer, (x,), (t,))[1])(x, dx)
  _close(tangent, jax.jvp(lambda x: _dense_moe(x, params, top), (x,), (dx,))[1])


def test_megablox_alone_pushes_tangents_forward():
  lhs = jnp.asarray(RNG.normal(size=(256, 128)).astype(np.float32))
  rhs = jnp.asarray(RNG.normal(size=(2, 128, 128)).astype(np.float32))
  sizes = jnp.array([100, 120], jnp.int32)
  dl, dr = jnp.ones_like(lhs), jnp.ones_like(rhs)
  mm = lambda impl: (lambda l, r: grouped_matmul(l, r, sizes, implementation=impl,
                                                 interpret=True))
  _close(jax.jvp(mm("megablox"), (lhs, rhs), (dl, dr))[1],
         jax.jvp(mm("ragged_dot"), (lhs, rhs), (dl, dr))[1], atol=1e-3)


def test_a_rule_traced_on_its_own_keeps_the_kernel_for_reverse_mode():
  # Inside a scan jax traces the rule before it knows the mode: reverse mode gets the
  # kernel's backward pass; forward mode meets jax's own refusal (the documented fix:
  # the XLA reference for that computation).
  calls = []

  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)

  kernel.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (calls.append(1) or c * g,))
  safe = _autodiff.reverse_only(kernel, jnp.sin, "a test kernel", "jnp.sin")
  scanned = lambda x: jnp.sum(jax.lax.scan(lambda c, _: (safe(c), None), x, None, length=2)[0])
  x = jnp.linspace(0.0, 1.0, 4)
  _close(jax.grad(scanned)(x), jax.grad(lambda x: jnp.sum(jnp.sin(jnp.sin(x))))(x))
  assert calls
  with pytest.raises(TypeError, match="forward-mode autodiff"):
    jax.jvp(scanned, (x,), (x,))
  # Outside a scan: forward mode takes the reference's JVP, also forward over reverse.
  _close(jax.jvp(lambda x: jnp.sum(safe(x)), (x,), (x,))[1], jnp.sum(jnp.cos(x) * x))
  _close(jax.hessian(lambda x: jnp.sum(safe(x)))(x), jnp.diag(-jnp.sin(x)))
