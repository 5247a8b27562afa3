"""Every derivative that pushes a tangent forward (jax.jvp, linearize, jacfwd, jvp of a
vmap, Hessian-vector products by jvp or linearize of grad, jax.hessian; each also of an
already-jitted function) through every kernel fnscale can select, against the same
derivative of an independent reference (jax's XLA attention, a plain log-softmax
cross-entropy, a grouped matmul by masks, a loop over experts); reverse mode keeps each
kernel's own backward pass."""
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnscale as fs
from fnscale import _autodiff
from fnscale.parallel import context as ca
from fnscale.kernels import grouped_matmul
from fnscale.parallel import _experts as ex

attention_module = importlib.import_module("fnscale.kernels._attention")
RNG = np.random.default_rng(0)


def _normal(*shape, scale=1.0):
  return jnp.asarray(scale * RNG.normal(size=shape).astype(np.float32))


def _along(f, x, t, s):
  """f on the plane through x spanned by t and s: a function of 2 numbers."""
  return lambda p: f(jax.tree.map(lambda a, b, c: a + p[0] * b + p[1] * c, x, t, s))


def _stack(*trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _weighted(f, w):
  """A scalar loss of f whose gradient depends on every output element differently."""
  return lambda x: sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(f(x)),
                                                      jax.tree.leaves(w)))


# name -> (f, x, t, s, w) -> what the transformation gives: each pushes the tangent t (and
# s) forward through f, or through the gradient of a scalar loss of f (forward over reverse).
TRANSFORMS = {
    "jvp": lambda f, x, t, s, w: jax.jvp(f, (x,), (t,)),
    "jvp(jit)": lambda f, x, t, s, w: jax.jvp(jax.jit(f), (x,), (t,)),
    "linearize": lambda f, x, t, s, w: (lambda y, lin: (y, lin(t)))(*jax.linearize(f, x)),
    "linearize(jit)": lambda f, x, t, s, w: jax.linearize(jax.jit(f), x)[1](t),
    "jacfwd": lambda f, x, t, s, w: jax.jacfwd(_along(f, x, t, s))(jnp.zeros(2)),
    "jvp(vmap)": lambda f, x, t, s, w: jax.jvp(jax.vmap(f), (_stack(x, s),), (_stack(t, s),)),
    "jvp(grad)": lambda f, x, t, s, w: jax.jvp(jax.grad(_weighted(f, w)), (x,), (t,)),
    "jvp(jit(grad))": lambda f, x, t, s, w: jax.jvp(jax.jit(jax.grad(_weighted(f, w))),
                                                     (x,), (t,)),
    "linearize(grad)": lambda f, x, t, s, w: jax.linearize(jax.grad(_weighted(f, w)),
                                                            x)[1](t),
    "hessian": lambda f, x, t, s, w: jax.hessian(_along(_weighted(f, w), x, t, s))(
        jnp.zeros(2)),
    "grad": lambda f, x, t, s, w: jax.grad(_weighted(f, w))(x),  # reverse mode, for scale
}


def _agree(kernel, reference, point, names, *, jit=True, atol=1e-4, rtol=1e-4):
  """Each transformation in `names` of `kernel` against the same of `reference` at
  `point` (x, t, s, w); all in one outer jit unless jit=False."""
  run = lambda f: [TRANSFORMS[name](f, *point) for name in names]
  run = jax.jit(run, static_argnums=0) if jit else run
  wrong = []
  for name, got, want in zip(names, run(kernel), run(reference), strict=True):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      if not np.allclose(np.asarray(g), np.asarray(r), atol=atol, rtol=rtol):
        wrong.append(f"{name}: max error {np.max(np.abs(np.asarray(g) - np.asarray(r))):.3g}")
  assert not wrong, wrong


# ------------------------------------------------------------------ the wrapper, alone

def _no_tangent(fn):
  """fn that jax can differentiate in reverse mode only, as a Pallas call."""
  g = jax.custom_vjp(fn)
  g.defvjp(lambda x: (fn(x), x), lambda x, c: (jax.vjp(fn, x)[1](c)[0],))
  return g


_SIN, _COS = _no_tangent(jnp.sin), _no_tangent(jnp.cos)
_BACKWARD_TRACES = []


@jax.custom_vjp
def _opaque_kernel(x, y):
  """sin(x) * y whose forward and backward passes take no tangent."""
  return _SIN(x) * y


def _opaque_fwd(x, y):
  return _SIN(x) * y, (x, y)


def _opaque_bwd(res, g):
  _BACKWARD_TRACES.append(1)
  x, y = res
  return _COS(x) * y * g, _SIN(x) * g


_opaque_kernel.defvjp(_opaque_fwd, _opaque_bwd)
_OPAQUE = _autodiff.reverse_only(_opaque_kernel, lambda x, y: jnp.sin(x) * y,
                                 "a test kernel", "its jnp form")


def _opaque_point():
  x = jnp.linspace(0.1, 1.0, 6).reshape(2, 3)
  return (x, x[::-1] + 1.0), (x * 0 + 1.0, x - 0.5), (jnp.cos(x), x * x), jnp.sin(3 * x)


EAGER = ["linearize", "jvp(vmap)", "jvp(grad)"]


@pytest.mark.parametrize("jit", [False, True])
def test_every_forward_transformation_of_a_kernel_without_a_forward_rule(jit):
  # The kernel's own passes take no tangent (as Pallas calls): a wrapper that let one
  # reach them raises; one that computed the wrong linear map differs from the reference.
  # Without an outer jit, each transformation not made of jitted calls.
  f = lambda xy: _OPAQUE(*xy)
  reference = lambda xy: jnp.sin(xy[0]) * xy[1]
  _agree(f, reference, _opaque_point(), TRANSFORMS if jit else EAGER, jit=jit)
  # Also inside a scan and a checkpoint, whose bodies jax traces before it knows the mode.
  scanned = lambda g: (lambda xy: jax.lax.scan(lambda c, _: (g((c, xy[1])), None), xy[0],
                                               None, length=2)[0])
  _agree(scanned(f), scanned(reference), _opaque_point(), ["jvp", "linearize", "jvp(grad)",
                                                           "grad"], jit=jit)
  _agree(jax.checkpoint(f), reference, _opaque_point(), ["jvp", "jvp(grad)", "grad"], jit=jit)


@pytest.mark.parametrize("where", ["plain", "jit", "scan", "checkpoint", "vmap"])
def test_reverse_mode_runs_the_kernel_s_backward_pass_and_no_reference(where):
  # jax.grad wherever the rule was traced: the kernel's backward pass, and not one sin or
  # cos outside the kernel's own calls (a transposed reference would have them).
  f = lambda x: _OPAQUE(x, x + 1.0)
  wrap = {"plain": f, "jit": jax.jit(f), "checkpoint": jax.checkpoint(f),
          "scan": lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0],
          "vmap": jax.vmap(f)}[where]
  loss = lambda x: jnp.sum(wrap(x) * jnp.arange(3.0))
  x = jnp.linspace(0.1, 1.0, 3)
  _BACKWARD_TRACES.clear()
  jaxpr = jax.make_jaxpr(jax.grad(loss))(x)
  assert _BACKWARD_TRACES

  def primitives(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn.primitive.name
      if "custom" not in eqn.primitive.name:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          yield from primitives(sub)
  found = set(primitives(jaxpr.jaxpr))
  assert not {"sin", "cos"} & found, found
  want = jax.grad(lambda x: jnp.sum(jnp.sin(x) * (x + 1.0) * jnp.arange(3.0)))(x)
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), want, rtol=1e-6)


@pytest.mark.parametrize("saves", ["its argument", "a function of it"])
def test_reverse_mode_under_a_scan_saves_no_more_than_the_kernel(saves):
  # The scan keeps what the backward pass reads for every step: an argument the kernel
  # saves is taken from the arguments, not saved twice (2 MiB more here when it was).
  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)

  if saves == "its argument":
    kernel.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))
  else:
    kernel.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  wrapped = _autodiff.reverse_only(kernel, jnp.sin, "a test kernel", "jnp.sin")

  def temporaries(f):
    loss = lambda x: jnp.sum(jax.lax.scan(lambda c, _: (f(jnp.exp(c)) * c, None), x, None,
                                          length=8)[0])
    compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((256, 256))).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temporaries(wrapped) == temporaries(kernel)


def test_forward_mode_says_which_reference_it_takes_once(caplog):
  _autodiff._say.cache_clear()
  f = lambda x: _OPAQUE(x, x)
  x = jnp.linspace(0.1, 1.0, 3)
  with caplog.at_level(logging.WARNING):
    jax.grad(lambda x: jnp.sum(f(x)))(x)
    assert "forward-mode" not in caplog.text  # reverse mode evaluates no reference
    jax.jvp(f, (x,), (x,))
    jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x)
  assert caplog.text.count("a test kernel defines only a reverse-mode derivative") == 1
  assert "uses its jnp form" in caplog.text


# ------------------------------------------------------------------ attention kernels

B, T, H, D = 1, 128, 2, 64


@pytest.fixture
def plans(monkeypatch):
  """The KernelSelections `attention` decides during the test, in order."""
  real, decided = attention_module.kernel_selection, []

  def recording(*args, **kwargs):
    decided.append(real(*args, **kwargs))
    return decided[-1]

  monkeypatch.setattr(attention_module, "kernel_selection", recording)
  return decided


def _attention_point():
  x = _normal(3, B, T, H, D)  # q, k, v stacked
  return x, _normal(3, B, T, H, D), _normal(3, B, T, H, D), _normal(B, T, H, D)


def _xla_attention(x):
  return jax.nn.dot_product_attention(x[0], x[1], x[2], is_causal=True, implementation="xla")


def _kernel_attention(kernel):
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True),
                          attention=kernel, interpret=True)
  return lambda x: attend(x[0], x[1], x[2])


QUICK = ["linearize", "jvp(jit(grad))"]  # the two that jax refused through splash


@pytest.mark.hlo_unread_loops  # Pallas interpret mode: loops over the kernel's grid
@pytest.mark.parametrize("kernel, names", [
    ("splash", QUICK),
    ("auto", ["linearize"]),  # auto takes splash here (interpret mode)
    pytest.param("splash", ["jvp(jit)", "linearize(jit)", "jacfwd", "jvp(vmap)", "jvp(grad)",
                            "hessian"], marks=pytest.mark.slow),
    pytest.param("pallas_gpu", ["linearize", "jvp(jit(grad))", "hessian"],
                 marks=pytest.mark.slow)])
def test_attention_kernels_under_every_forward_transformation(kernel, names, plans):
  _agree(_kernel_attention(kernel), _xla_attention, _attention_point(), names, atol=1e-3)
  assert {p.implementation for p in plans} == {"splash" if kernel == "auto" else kernel}


@pytest.mark.hlo_unread_loops
def test_attention_kernel_s_reverse_mode_is_its_own(plans):
  # The gradient's program holds the kernel's forward and backward Pallas calls, and no
  # matmul outside them to [seq, seq] (the XLA reference's logits, or their gradient).
  loss = _weighted(_kernel_attention("splash"), _attention_point()[3])
  jaxpr = jax.make_jaxpr(jax.grad(loss))(_attention_point()[0])

  def outside_kernels(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      if eqn.primitive.name != "pallas_call":
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          yield from outside_kernels(sub)
  found = list(outside_kernels(jaxpr.jaxpr))
  # The forward kernel and the backward one(s): splash's fused dq-dkv kernel, or two.
  assert [e.primitive.name for e in found].count("pallas_call") >= 2
  assert not [e for e in found if e.primitive.name == "dot_general"
              and e.outvars[0].aval.shape[-2:] == (T, T)]


def test_cudnn_selection_takes_the_reference_forward(monkeypatch):
  # cuDNN runs only on a GPU: its selection on "cuda", and its wiring with a stand-in kernel
  # (XLA attention behind a custom_vjp that counts its backward passes).
  q_shape = (B, T, H, D)
  sel = fs.kernels.kernel_selection(q_shape, q_shape, jnp.bfloat16, causal=True,
                                    platform="cuda")
  assert sel.implementation == "cudnn"
  calls = []
  reference = lambda q, k, v: _xla_attention((q, k, v))

  @jax.custom_vjp
  def stand_in(q, k, v):
    return reference(q, k, v)

  def fwd(q, k, v):
    out, vjp = jax.vjp(reference, q, k, v)
    return out, vjp

  def bwd(vjp, g):
    calls.append(1)
    return vjp(g)

  stand_in.defvjp(fwd, bwd)
  monkeypatch.setitem(attention_module._KERNELS, "cudnn", lambda q, k, v, *_, **__: stand_in(
      q, k, v))
  monkeypatch.setattr(attention_module, "kernel_selection",
                      lambda *a, **kw: sel._replace(fallback=False))
  attend = lambda x: fs.attention(x[0], x[1], x[2], causal=True, implementation="cudnn")
  _agree(attend, _xla_attention, _attention_point(), ["linearize"])
  calls.clear()
  jax.jit(jax.grad(_weighted(attend, _attention_point()[3])))(_attention_point()[0])
  assert calls


@pytest.mark.hlo_unread_loops  # splash in Pallas interpret mode: loops over its grid
@pytest.mark.parametrize("form, order, c, names", [
    ("ring", "zigzag", 4, ["linearize"]),
    pytest.param("ring", "striped", 4, ["jacfwd", "jvp(grad)"], marks=pytest.mark.slow),
    pytest.param("all_gather", "contiguous", 2, ["jvp"], marks=pytest.mark.slow)])
def test_context_forms_under_forward_transformations(form, order, c, names):
  # The sequence split c ways; the ring's own custom_vjp and splash inside the all-gather
  # form (128-token pieces) differentiate only in reverse.
  seq, batch = 128 * c if form == "all_gather" else 128, 8 // c
  x, t, s = (_normal(3, batch, seq, 2, 64) for _ in range(3))
  w = _normal(batch, seq, 2, 64)
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context=form,
                          context_order=order,
                          attention="splash" if form == "all_gather" else "xla",
                          interpret=True)
  stored = lambda a: ca.reorder(a, c, order, axis=a.ndim - 3)
  restored = lambda y: ca.restore(y, c, order, axis=y.ndim - 3)
  ours = lambda x: restored(attend(stored(x[0]), stored(x[1]), stored(x[2])))
  with fs.with_mesh(fs.make_mesh({"data": 8 // c, "context": c})):
    _agree(ours, _xla_attention, (x, t, s, w), names, atol=1e-3)


# ------------------------------------------------------------------------ cross-entropy

TOKENS, DIM, VOCAB = 32, 16, 300
LABELS = jnp.asarray(RNG.integers(0, VOCAB, size=TOKENS).astype(np.int32))


def _plain_cross_entropy(hu, reduction):
  """Per-token losses from the log-softmax of the whole logits, reduced."""
  logp = jax.nn.log_softmax(hu[0] @ hu[1], axis=-1)
  per_token = -jnp.take_along_axis(logp, LABELS[:, None], axis=-1)[:, 0]
  return per_token.mean() if reduction == "mean" else per_token


@pytest.mark.parametrize("reduction, names", [
    ("mean", ["linearize", "jvp(jit)", "linearize(grad)"]), ("none", ["jvp(jit(grad))"]),
    pytest.param("none", ["jacfwd", "jvp(vmap)", "hessian"], marks=pytest.mark.slow)])
def test_blockwise_cross_entropy_under_every_forward_transformation(reduction, names):
  hu = (_normal(TOKENS, DIM), _normal(DIM, VOCAB, scale=0.25))
  point = (hu, (_normal(TOKENS, DIM), _normal(DIM, VOCAB)),
           (_normal(TOKENS, DIM), _normal(DIM, VOCAB)),
           _normal() if reduction == "mean" else _normal(TOKENS))
  ours = lambda hu: fs.cross_entropy(hu[0], hu[1], LABELS, chunk_size=8, reduction=reduction)
  _agree(ours, lambda hu: _plain_cross_entropy(hu, reduction), point, names)


# ------------------------------------------------------------- grouped matmul, experts

def _masked_gmm(lhs, rhs, sizes):
  """Each row times its group's matrix, rows past the groups zero, by masks."""
  ends = jnp.cumsum(sizes)
  group = jnp.sum(jnp.arange(lhs.shape[0])[:, None] >= ends[None, :], axis=1)
  out = jnp.einsum("mk,mkn->mn", lhs, rhs[jnp.minimum(group, rhs.shape[0] - 1)])
  return jnp.where((group < rhs.shape[0])[:, None], out, 0.0)


@pytest.mark.hlo_unread_loops  # megablox in Pallas interpret mode: loops over its grid
@pytest.mark.parametrize("names", [["linearize", "jvp(jit(grad))"],
                                   pytest.param(["jvp(vmap)", "hessian"],
                                                marks=pytest.mark.slow)])
def test_megablox_under_forward_transformations(names):
  sizes = jnp.array([100, 120], jnp.int32)
  point = tuple((_normal(256, 128), _normal(2, 128, 128)) for _ in range(3)) + (
      _normal(256, 128),)
  mm = lambda lr: grouped_matmul(lr[0], lr[1], sizes, implementation="megablox",
                                 interpret=True)
  _agree(mm, lambda lr: _masked_gmm(*lr, sizes), point, names, atol=1e-2, rtol=1e-3)


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
@pytest.mark.parametrize("gmm, names", [
    ("ragged_dot", ["linearize(jit)"]),
    pytest.param("megablox", ["jvp"], marks=pytest.mark.slow)])
def test_expert_layer_under_forward_transformations(gmm, names):
  # Tangents on the tokens only: the routing (a top-k) is the same at every point.
  d, e, f = 8, 8, 16
  ks = jax.random.split(jax.random.key(0), 4)
  params = {"router": jax.random.normal(ks[0], (d, e)),
            "w_gate": 0.4 * jax.random.normal(ks[1], (e, d, f)),
            "w_up": 0.4 * jax.random.normal(ks[2], (e, d, f)),
            "w_down": 0.4 * jax.random.normal(ks[3], (e, f, d))}
  x = _normal(8, 4, d)
  logits = np.asarray(x).reshape(-1, d) @ np.asarray(params["router"])
  top = jnp.asarray(np.argsort(-logits, axis=-1, kind="stable")[:, :2])
  layer = lambda x: ex.moe(x, params, k=2, exchange="ragged", grouped_matmul=gmm,
                           interpret=True)[0]
  with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    _agree(layer, lambda x: _dense_moe(x, params, top),
           (x, _normal(8, 4, d), _normal(8, 4, d), _normal(8, 4, d)), names)
