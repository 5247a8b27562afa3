"""The chip tier: what the CPU tiers can only simulate, checked on a real TPU chip.

On a TPU VM, in one process (a chip runs one program at a time), from the repository root:

    python -m pytest -q -m chip

Under `-m chip` conftest.py collects only the `test_chip*.py` modules (the others expect 8
simulated CPU devices) and leaves JAX on its default platform, the TPU, with the CPU backend
beside it; it needs no network, socket or optional framework (torch, transformers, flax).
Where JAX has no TPU (CI, a laptop, the CPU tiers) every test skips, saying why. About two
minutes on one TPU v5e chip, most of it compiling.

What it checks, a section each (a new check of the chip adds a section):
- splash attention, forward and backward, against XLA's attention (capped logits too), in
  a small Gemma 3's step and in the Ulysses context form;
- the megablox grouped matmul against `jax.lax.ragged_dot`;
- the blockwise cross-entropy against the plain one on the whole logits;
- the int8 matmul kernel (x's rows quantized in the kernel) against XLA's int8 path,
  forward and both gradients;
- AdamW's state in the host's pinned memory, streamed by slices, against the same steps
  with the state on the chip;
- Llama 3.2 1B's shape training on one chip with Adafactor;
- a train step on the chip against the same step on the CPU backend, in float32 and with
  the bf16 policy;
- a checkpoint saved from the chip, restored onto the chip and onto the CPU;
- the memory pre-flight: a step that does not fit the chip is refused before it runs, and
  the planner's fix compiles within the chip's memory and trains.

Tolerances. The truth is the float32 computation under `jax.default_matmul_precision(
"highest")` (on a TPU, float32 contractions in six bfloat16 passes: float32's accuracy, give
or take a unit). The kernels run at the default precision, as a user's program runs them:
Mosaic refuses bfloat16 operands under "highest" ("Bad lhs type"; on a TPU
`jax.lax.ragged_dot` is a Mosaic kernel too). The chip's matrix unit multiplies bfloat16: a
bf16 kernel rounds its operands and softmax probabilities to 8 significand bits (unit
roundoff 2**-9), and a float32 kernel at the default precision contracts in bfloat16 passes.
So a kernel passes when its error, ||got - truth|| / ||truth|| for the output and each
gradient, is at most 3x that of XLA's own computation from the bfloat16-rounded inputs, plus
1e-3 (`_bound`): the same rounding in another order and tiling. A wrong mask, scale, head or
group mapping is off by more than 0.1. Computations of XLA ops only (the cross-entropy, a
float32 step with XLA's attention) run under "highest" on both sides and agree to 1e-4 (the
step's loss to 1e-5): float32 rounding in another order.
"""
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import _topology
from fnscale.kernels import gmm_selection, grouped_matmul, kernel_selection

pytestmark = pytest.mark.chip
_HOW = "on a TPU VM: python -m pytest -q -m chip"
if not _topology.has_accelerator():  # no device file: no backend need start to know
  pytest.skip(f"the chip tier runs on a TPU; this machine has none ({_HOW})",
              allow_module_level=True)

HIGHEST = functools.partial(jax.default_matmul_precision, "highest")


@pytest.fixture(scope="module", autouse=True)
def _on_a_tpu():
  """Skips the module where JAX's default platform is not a TPU (the CPU tiers on a TPU VM
  force the CPU)."""
  platform = jax.default_backend()
  if platform != "tpu":
    pytest.skip(f"the chip tier runs on a TPU; JAX runs on {platform} here ({_HOW})")


def _error(got, truth) -> float:
  """||got - truth|| / ||truth|| in float64 on the host: an all-zero `got` scores 1."""
  got, truth = np.asarray(got, np.float64), np.asarray(truth, np.float64)
  return float(np.linalg.norm(got - truth) / np.linalg.norm(truth))


def _bound(bf16_reference, truth) -> float:
  """The error a kernel may have (module docstring): 3x XLA's from bf16 inputs, + 1e-3."""
  return 3 * _error(bf16_reference, truth) + 1e-3


def _check_within_bound(names, got, bf16_reference, truth):
  for name, g, r, t in zip(names, got, bf16_reference, truth):
    error, bound = _error(g, t), _bound(r, t)
    assert error <= bound, f"{name}: error {error:.2e} > {bound:.2e} (3x XLA bf16's + 1e-3)"


def _rounded(*xs):
  return tuple(x.astype(jnp.bfloat16) for x in xs)


def _upcast(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def _cosine_weights(shape):
  """Loss weights that make every output element's gradient different."""
  return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape))


# --- splash attention -----------------------------------------------------------------------

ATTENTION = {  # name: ((batch, seq, heads, kv_heads, head_dim), fs.attention keywords)
    "causal-gqa": ((2, 512, 4, 2, 128), dict(causal=True)),
    "full-mha": ((1, 256, 2, 2, 128), dict()),
    "causal-window": ((1, 512, 2, 2, 128), dict(causal=True, sliding_window=(128, 0))),
    "segments-mqa": ((2, 256, 4, 1, 128), dict(causal=True, segments=True)),
    # Gemma 2's local layers: a window and the logits capped (a cap that bites: |logits|
    # reach 4.5, q scaled by 3).
    "softcap-window-gqa": ((1, 512, 4, 2, 128), dict(causal=True, sliding_window=(127, 0),
                                                     soft_cap=1.5)),
}
ATTENTION_CASES = [(n, "bfloat16") for n in ATTENTION] + [("causal-gqa", "float32")]


def _mask(b, t, *, causal=False, sliding_window=None, segment_ids=None):
  """[b, 1, t, t] bool: which keys each query sees, from the definitions (numpy)."""
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  mask = np.ones((b, 1, t, t), bool)
  if causal:
    mask &= j <= i
  if sliding_window is not None:
    left, right = sliding_window
    mask &= (j >= i - left) & (j <= i + right)
  if segment_ids is not None:
    ids = np.asarray(segment_ids)
    mask &= ids[:, None, :, None] == ids[:, None, None, :]
  return mask


def _reference(mask, soft_cap=None):
  """XLA's attention of [b, t, h, d] q and [b, t, kh, d] k, v under a [b, 1, t, t] mask,
  the scaled logits capped as c tanh(logits / c) when `soft_cap` is c."""
  if soft_cap is None:
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                        implementation="xla")

  def attend(q, k, v):
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = soft_cap * jnp.tanh(logits / soft_cap)
    weights = jax.nn.softmax(jnp.where(mask, logits.astype(jnp.float32), -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
  return attend


def _attention_and_grads(attend, shape):
  """jit of (q, k, v) -> (output, dq, dk, dv) of a loss weighting each output element."""
  weights = _cosine_weights(shape)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * weights)
  return jax.jit(lambda q, k, v: (attend(q, k, v),
                                  *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))


@pytest.mark.parametrize("case,dtype", ATTENTION_CASES,
                         ids=[f"{n}-{d}" for n, d in ATTENTION_CASES])
def test_splash_attention_matches_xla_attention(case, dtype):
  (b, t, h, kh, d), kw = ATTENTION[case]
  kw = dict(kw)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype) * (3 if "soft_cap" in kw else 1)
  k, v = (jax.random.normal(key, (b, t, kh, d), dtype) for key in keys[1:])
  ids = None
  if kw.pop("segments", False):  # three documents per row, starting at other places
    ids = jnp.asarray(np.arange(t)[None, :] * 3 // t + np.arange(b)[:, None], jnp.int32)
  mask = jnp.asarray(_mask(b, t, causal=kw.get("causal", False),
                           sliding_window=kw.get("sliding_window"), segment_ids=ids))
  splash = lambda q, k, v: fs.attention(q, k, v, implementation="splash", segment_ids=ids,
                                        **kw)
  xla = _reference(mask, kw.get("soft_cap"))
  sel = kernel_selection(q.shape, k.shape, q.dtype, implementation="splash",
                         segment_ids=ids, **kw)
  assert (sel.implementation, sel.platform, sel.interpret) == ("splash", "tpu", False)
  compiled = _attention_and_grads(splash, q.shape).lower(q, k, v).compile()
  got = compiled(q, k, v)
  with HIGHEST():
    truth = _attention_and_grads(xla, q.shape)(*_upcast(q, k, v))
  reference = _attention_and_grads(xla, q.shape)(*_rounded(q, k, v))
  assert "tpu_custom_call" in compiled.as_text()  # the Pallas kernel, not a fallback
  assert got[0].dtype == q.dtype
  _check_within_bound(("output", "dq", "dk", "dv"), got, reference, truth)


def _splash_against_xla(run, args):
  """(got, bf16 reference, truth) of jit(run(attention)) for splash at the default precision
  against XLA's attention at the default and at "highest" precision."""
  got = jax.jit(fs.with_kernel(run, attention="splash")).lower(*args).compile()
  assert "tpu_custom_call" in got.as_text()  # the Pallas kernel, not a fallback
  xla = jax.jit(fs.with_kernel(run, attention="xla"))
  with HIGHEST():
    truth = xla(*args)
  return got(*args), xla(*args), truth


def test_a_small_gemma3_trains_through_splash_on_the_chip():
  """A Gemma-3-shaped Llama (local layers of a 128-token window beside global ones, their own
  RoPE base, (1 + w) norms, post-norms, GeGLU, q/k norms, capped logits): loss and gradients
  with splash within the bound of XLA's attention (module docstring)."""
  from recipes.lm import llama  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(2, 256, 4, 2, 512, 512, vocab=512, head_size=128,
                          windows=(128, 0), norm_plus_one=True, post_norms=True,
                          activation="gelu_tanh", embed_scale=True, attn_soft_cap=0.0,
                          logit_soft_cap=30.0, qk_norm=True, local_rope_theta=10_000.0)
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape),
                        llama.init_params(cfg, jax.random.key(0)))  # norms off their zeros
  tokens = jax.random.randint(jax.random.key(2), (2, 513), 0, cfg.vocab)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  run = lambda p, b: jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg))(p, b)
  got, reference, truth = _splash_against_xla(run, (params, batch))
  flat = lambda out: [out[0]] + jax.tree.leaves(out[1])
  names = ["loss"] + [jax.tree_util.keystr(k) for k, _ in
                      jax.tree_util.tree_leaves_with_path(params)]
  _check_within_bound(names, flat(got), flat(reference), flat(truth))


def test_the_ulysses_form_runs_splash_on_the_chip():
  """The Ulysses context form's kernel path (the all-to-all over a context axis of one
  device, the whole-sequence splash kernel over the stored order, packed segments, GQA) on
  the chip, against XLA's attention."""
  from fnscale.kernels import _context_attention as ca  # pylint: disable=import-outside-toplevel
  b, t, h, kh, d = 2, 512, 4, 2, 128
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
  k, v = (jax.random.normal(key, (b, t, kh, d), jnp.bfloat16) for key in keys[1:])
  ids = jnp.asarray(np.arange(t)[None, :] * 3 // t + np.arange(b)[:, None], jnp.int32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("context",))
  sel = ca.selection(ca.ContextCall(q.shape, k.shape, "bfloat16", True, None, "splash",
                                    "ulysses", "zigzag", "tpu", False, {"context": 1},
                                    ("context",), (), ()))
  assert (sel.form, sel.kernel) == ("ulysses", "splash"), sel
  ulysses = lambda q, k, v: ca.attend(q, k, v, ids, ids, sel, mesh, causal=True,
                                      scale=1 / np.sqrt(d))
  mask = jnp.asarray(_mask(b, t, causal=True, segment_ids=ids))
  compiled = _attention_and_grads(ulysses, q.shape).lower(q, k, v).compile()
  assert "tpu_custom_call" in compiled.as_text()
  with HIGHEST():
    truth = _attention_and_grads(_reference(mask), q.shape)(*_upcast(q, k, v))
  reference = _attention_and_grads(_reference(mask), q.shape)(*_rounded(q, k, v))
  _check_within_bound(("output", "dq", "dk", "dv"), compiled(q, k, v), reference, truth)


# --- megablox grouped matmul ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_megablox_matches_ragged_dot(dtype):
  m, k, n, sizes = 512, 256, 256, (100, 0, 250, 130)  # an empty group; 32 padding rows
  lhs = jax.random.normal(jax.random.key(1), (m, k), dtype)
  rhs = jax.random.normal(jax.random.key(2), (len(sizes), k, n), dtype) / 16
  group_sizes = jnp.asarray(sizes, jnp.int32)
  weights = _cosine_weights((m, n))

  def product_and_grads(matmul):
    loss = lambda l, r: jnp.sum(matmul(l, r, group_sizes).astype(jnp.float32) * weights)
    return jax.jit(lambda l, r: (matmul(l, r, group_sizes),
                                 *jax.grad(loss, argnums=(0, 1))(l, r)))

  used = sum(sizes)
  # The reference: ragged_dot with its rows past the groups selected to zero, the function
  # grouped_matmul defines. ragged_dot doesn't specify those rows, and on a TPU they are not
  # zero: against the unmasked reference the kernel's zeroed output was off by 0.25 =
  # sqrt(32 / 512), as if those 32 rows held products like the others'. The select also
  # keeps them out of the reference's rhs gradient.
  rows = (jnp.arange(m) < used)[:, None]
  ragged_dot = lambda l, r, s: jnp.where(rows, jax.lax.ragged_dot(l, r, s), 0)
  megablox = functools.partial(grouped_matmul, implementation="megablox")
  assert gmm_selection(lhs.shape, rhs.shape, lhs.dtype,
                       implementation="megablox").implementation == "megablox"
  compiled = product_and_grads(megablox).lower(lhs, rhs).compile()
  got = compiled(lhs, rhs)
  with HIGHEST():
    truth = product_and_grads(ragged_dot)(*_upcast(lhs, rhs))
  reference = product_and_grads(ragged_dot)(*_rounded(lhs, rhs))
  assert "tpu_custom_call" in compiled.as_text()
  # The lhs gradient's rows past the groups are what the kernel leaves unwritten (the
  # experts' FFN masks them once, fnscale.parallel.moe): compared up to the groups' end.
  part = lambda out, d_lhs, d_rhs: (out, d_lhs[:used], d_rhs)
  _check_within_bound(("output", "d lhs", "d rhs"), part(*got), part(*reference),
                      part(*truth))
  assert not np.asarray(got[0][used:]).any()  # the output's rows past the groups: zero


# --- blockwise cross-entropy ----------------------------------------------------------------

def test_blockwise_cross_entropy_matches_the_plain_one():
  tokens, d, vocab, z_loss = 1024, 256, 8192, 1e-4
  keys = jax.random.split(jax.random.key(3), 3)
  hidden = jax.random.normal(keys[0], (tokens, d), jnp.float32)
  unembed = jax.random.normal(keys[1], (d, vocab), jnp.float32) / 16
  labels = jax.random.randint(keys[2], (tokens,), 0, vocab)
  where = jnp.arange(tokens) < tokens - 100  # the last 100 tokens are padding

  def plain(h, u):  # the whole [tokens, vocab] logits, the loss from its definition
    logits = h @ u
    lse = jax.nn.logsumexp(logits, axis=-1)
    label = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    per_token = lse - label + z_loss * lse ** 2
    return jnp.sum(jnp.where(where, per_token, 0.0)) / jnp.sum(where)

  blockwise = lambda h, u: fs.cross_entropy(h, u, labels, where=where, chunk_size=256,
                                            z_loss=z_loss)
  with HIGHEST():
    got = jax.jit(jax.value_and_grad(blockwise, argnums=(0, 1)))(hidden, unembed)
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(hidden, unembed)
  (loss, grads), (want_loss, want_grads) = got, want
  assert abs(float(loss) - float(want_loss)) <= 1e-4 * abs(float(want_loss))
  for name, g, w in zip(("d hidden", "d unembed"), grads, want_grads):
    assert _error(g, w) <= 1e-4, name
  assert not np.asarray(grads[0][-100:]).any()  # padding adds no gradient


# --- int8 matmul kernel ----------------------------------------------------------------------

def _quantized_product(a, b) -> np.ndarray:
  """float64 a [m, k] @ b [k, n] through int8 as the kernel and XLA's path define it, in
  numpy: a's rows and b's columns each scaled by max|.| / 127, rounded half to even."""
  def rows(v):
    v = np.asarray(v, np.float32)
    m = np.abs(v).max(1, keepdims=True)
    inv = np.where(m > 0, np.float32(127) / m, np.float32(1))
    return np.clip(np.round(v * inv), -127, 127), np.where(m > 0, m / np.float32(127), 1)
  (qa, sa), (qb, sb) = rows(a), rows(np.asarray(b, np.float32).T)
  return (qa.astype(np.float64) @ qb.T.astype(np.float64)) * sa * sb.T


@pytest.mark.parametrize("tiles", [None, (256, 256)], ids=["chosen", "256x256"])
def test_the_int8_kernel_matches_xlas_int8_path(tiles):
  """y = x @ w and dx = g @ w^T through int8, by the kernel and by XLA's path, each against
  a float64 numpy product of the same quantization: within that product's own bfloat16
  rounding (the outputs are bfloat16) plus 1e-3 (a value on a rounding tie may take the
  other int8 level in another program). A wrong scale, tile or level is off by ~1% (int8's
  own error against the float product). dw, a bfloat16 matmul in both, against float32.
  w comes in bfloat16, as a model's weights under a bf16 compute policy: given in float32,
  dense's cast to x's dtype may be dropped by XLA on a TPU (excess precision allowed), the
  weights then quantized from their float32 values, 5e-3 from this oracle (on the chip, in
  XLA's program and not the kernel's)."""
  from recipes.lm import int8  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(4), 3)
  x = jax.random.normal(keys[0], (1024, 512), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (512, 768), jnp.float32) / 16).astype(jnp.bfloat16)
  g = jax.random.normal(keys[2], (1024, 768), jnp.bfloat16)

  def value_and_grads(implementation):
    f = lambda x, w: int8.dense(x, w, implementation=implementation, tiles=tiles)
    return jax.jit(lambda x, w, g: (lambda y, pull: (y, *pull(g)))(*jax.vjp(f, x, w)))
  compiled = value_and_grads("pallas").lower(x, w, g).compile()
  assert compiled.as_text().count("fnscale_int8_matmul") >= 2  # forward and input gradient
  oracle = (_quantized_product(x, w), _quantized_product(g, w.T))
  rounded = [_error(np.asarray(o, np.float32).astype(jnp.bfloat16), o) for o in oracle]
  with HIGHEST():
    dw = x.astype(jnp.float32).T @ g.astype(jnp.float32)
  for side, (y, dx, got_dw) in (("kernel", compiled(x, w, g)),
                                ("xla", value_and_grads("xla")(x, w, g))):
    for name, a, o, r in zip(("output", "d x"), (y, dx), oracle, rounded):
      assert _error(a, o) <= r + 1e-3, (side, name, _error(a, o), r)
    assert _error(got_dw, dw) < 0.02, (side, "d w")


# --- the optimizer state in the host's memory -----------------------------------------------

def test_an_offloaded_optimizer_state_trains_on_the_chip_as_on_the_device(monkeypatch):
  """AdamW's state in the chip host's pinned memory, streamed a slice of a layer at a time
  (slices of 64 KiB here: 4 of each 256 x 256 layer): 3 steps equal the run with the state
  on the chip, to float32 rounding, and the new state goes back to the host."""
  from fnscale import _offload  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(_offload, "SLICE_BYTES", 2**16)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
  mesh = fs.make_mesh({"data": 1}, devices=jax.devices()[:1])
  params = {"w": jax.random.normal(jax.random.key(0), (4, 256, 256)) / 16,
            "embed": jax.random.normal(jax.random.key(1), (512, 256))}

  def loss(p, batch):
    x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), p["embed"][batch["tokens"]],
                        p["w"])
    return jnp.mean((x @ p["embed"].T) ** 2)

  batch = {"tokens": jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128) % 512}
  runs = {}
  for offload in (False, True):
    state = fs.init_state(params, opt, mesh=mesh, offload_optimizer=offload)
    step, losses = fs.shard_step(fs.train_step(loss, opt), mesh), []
    with HIGHEST():
      for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    runs[offload] = losses, state
  (want_losses, want), (losses, got) = runs[False], runs[True]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got.opt_state)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got.params)} == {"device"}
  # The two programs fuse (and so round) the gradients apart: where one sums to near zero,
  # Adam's division by its root mean square turns that into up to 1e-4 of the learning rate.
  for a, b in zip(jax.tree.leaves((want.params, want.opt_state)),
                  jax.tree.leaves((got.params, got.opt_state))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


# --- a 1B model on one chip -----------------------------------------------------------------

def test_the_llama_1b_shape_trains_on_one_chip_with_adafactor():
  """Llama 3.2 1B's shape (1.24B params), Adafactor, `qkv_attn` remat, 2 rows of 2048
  tokens, as `recipes/bench/chip.py --case=llama-1b,remat=qkv_attn,batch=2` runs it (51%
  MFU there): the chip's runtime holds the compiled step, and the loss falls over 4 steps
  on one batch of text."""
  from recipes.lm import llama, optimizers  # pylint: disable=import-outside-toplevel
  cfg = llama.model_config("llama-1b", 2048)._replace(loss_chunk=1024)
  mesh = fs.make_mesh({"data": 1}, devices=jax.devices()[:1])
  opt = optimizers.transformation("adafactor", 1e-3)
  kw = dict(rules=llama.RULES, logical_axes=llama.logical_axes(cfg))
  state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                        policy=BF16, key=jax.random.key(0), **kw)
  assert 1.2e9 < sum(x.size for x in jax.tree.leaves(state.params)) < 1.3e9
  text = np.frombuffer(__doc__.encode() * 8, np.uint8)[:2 * 2049]  # bytes: ids < 256
  rows = text.astype(np.int32).reshape(2, 2049)
  batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
  step = fs.shard_step(fs.train_step(functools.partial(llama.loss_fn, cfg=cfg,
                                                       remat="qkv_attn"), opt, policy=BF16),
                       mesh, **kw)
  compiled = step.compile(state, batch)
  assert fs.analysis.step_bytes(compiled.compiled) <= fs.analysis.device_memory(jax.devices()[0])
  losses = []
  for _ in range(4):
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


# --- a train step: the chip against the CPU backend -----------------------------------------

VOCAB, D_MODEL, HEADS, HEAD_DIM, MLP = 512, 256, 2, 128, 512
ROWS, SEQ = 4, 256
BF16 = "params=float32,compute=bfloat16,output=float32"


def _params():
  rng = np.random.default_rng(0)
  normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)
  return {"embed": normal(VOCAB, D_MODEL) * 8, "qkv": normal(D_MODEL, 3 * HEADS * HEAD_DIM),
          "out": normal(HEADS * HEAD_DIM, D_MODEL), "up": normal(D_MODEL, MLP),
          "down": normal(MLP, D_MODEL), "unembed": normal(D_MODEL, VOCAB)}


def _batch():
  tokens = np.random.default_rng(1).integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _loss(params, batch):
  """One causal attention block and an MLP, then the blockwise cross-entropy."""
  x = params["embed"][batch["inputs"]]
  qkv = (x @ params["qkv"]).reshape(ROWS, SEQ, 3, HEADS, HEAD_DIM)
  attended = fs.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
  x = x + attended.reshape(ROWS, SEQ, HEADS * HEAD_DIM) @ params["out"]
  x = x + jax.nn.gelu(x @ params["up"]) @ params["down"]
  return fs.cross_entropy(x, params["unembed"], batch["targets"])


def _keep_gradients():
  """An optimizer that leaves the params as they are and keeps the step's gradients as its
  state: the step's gradients come back exactly, in the params' dtype."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _one_step(devices, *, policy=None, attention="xla"):
  """(loss, gradients, the state after the step, the compiled step) of one train step on
  `devices`: float32 under "highest" matmul precision; a bf16 policy at the default one
  (its bfloat16 operands make the precision moot, and Mosaic refuses them under "highest")."""
  mesh = fs.make_mesh({"data": 1}, devices=devices)
  opt = _keep_gradients()
  state = fs.init_state(_params(), opt, mesh=mesh)
  batch = fs.global_batch(_batch(), fs.batch_sharding(mesh))
  step = fs.shard_step(fs.with_kernel(fs.train_step(_loss, opt, policy=policy),
                                      attention=attention), mesh)
  with HIGHEST() if policy is None else contextlib.nullcontext():
    compiled = step.compile(state, batch)
    state, metrics = compiled(state, batch)
  return float(metrics["loss"]), state.opt_state, state, compiled


@pytest.fixture(scope="module")
def cpu_float32():
  """The float32 step on the CPU backend: the truth both chip steps are held to."""
  return _one_step(jax.devices("cpu")[:1])


@pytest.fixture(scope="module")
def chip_float32():
  return _one_step(jax.devices()[:1])


def _bf16_matmuls(hlo: str) -> int:
  """Matmuls of an optimized TPU program with a bfloat16 result (operands print untyped)."""
  return len(re.findall(r"= bf16\[[^\]]*\]\S* (?:dot|convolution)\(", hlo))


def test_float32_train_step_matches_the_cpu_backend(chip_float32, cpu_float32):
  (loss, grads, state, compiled), (want_loss, want_grads, _, _) = chip_float32, cpu_float32
  assert {d.platform for d in state.params["embed"].devices()} == {"tpu"}
  assert _bf16_matmuls(compiled.compiled.as_text()) == 0
  assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
  for name in want_grads:
    assert _error(grads[name], want_grads[name]) <= 1e-4, name


def test_bf16_policy_train_step_on_the_chip(cpu_float32):
  """bfloat16 compute (splash attention, bf16 matmuls), float32 params and gradients, within
  the bound the same policy's step on the CPU gives against float32 (module docstring)."""
  loss, grads, state, compiled = _one_step(jax.devices()[:1], policy=BF16, attention="auto")
  cpu_loss, cpu_grads, _, _ = _one_step(jax.devices("cpu")[:1], policy=BF16)
  want_loss, want_grads, _, _ = cpu_float32
  assert {x.dtype for x in jax.tree.leaves((state.params, grads))} == {jnp.dtype("float32")}
  hlo = compiled.compiled.as_text()
  assert "tpu_custom_call" in hlo  # splash ran, in bf16
  assert _bf16_matmuls(hlo) >= 4  # the model's matmuls in bfloat16 (a TPU dot: convolution)
  assert abs(loss - want_loss) <= 3 * abs(cpu_loss - want_loss) + 1e-3 * abs(want_loss)
  _check_within_bound(list(want_grads), [grads[n] for n in want_grads],
                      [cpu_grads[n] for n in want_grads], [want_grads[n] for n in want_grads])


# --- a checkpoint saved from the chip -------------------------------------------------------

def test_checkpoint_saved_on_the_chip_restores_on_the_chip_and_the_cpu(chip_float32,
                                                                       tmp_path):
  _, _, state, _ = chip_float32
  saved = jax.tree.map(np.asarray, state)
  with fs.checkpoint.manager(str(tmp_path / "ckpt")) as ckpt:
    fs.checkpoint.save(ckpt, 1, state, extra={"on": "tpu"})
  for devices, platform in ((jax.devices()[:1], "tpu"), (jax.devices("cpu")[:1], "cpu")):
    target = fs.init_state(_params(), _keep_gradients(), abstract=True,
                           mesh=fs.make_mesh({"data": 1}, devices=devices))
    with fs.checkpoint.manager(str(tmp_path / "ckpt")) as ckpt:
      restored, extra = fs.checkpoint.restore(ckpt, target)
    assert extra == {"on": "tpu"}
    assert {d.platform for x in jax.tree.leaves(restored) for d in x.devices()} == {platform}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), saved)


# --- the memory pre-flight ------------------------------------------------------------------

def test_a_step_that_does_not_fit_is_refused_before_it_runs_and_its_fix_runs():
  """GPT small, 64 rows of 1024 tokens, no remat, no accumulation: XLA needs about 56 GiB
  (compiled for a described v5e chip), more than the chip's memory. `compile_fitting`
  refuses it with the planner's options (estimated within 90% of the memory, as train_lm
  asks); the first compiles within the memory and trains a step."""
  from recipes.lm import gpt  # pylint: disable=import-outside-toplevel
  cfg, device = gpt.model_config("small", 1024), jax.devices()[0]
  limit = fs.analysis.device_memory(device)  # the runtime's limit: 15.75 GiB on a v5e
  mesh, opt, policy = fs.make_mesh({"data": 1}, devices=[device]), optax.adamw(1e-3), BF16
  init, loss = functools.partial(gpt.init_params, cfg), functools.partial(gpt.loss_fn, cfg=cfg)
  kw = dict(rules=gpt.RULES, logical_axes=gpt.logical_axes(cfg))
  state = fs.init_state(init, opt, mesh=mesh, policy=policy, key=jax.random.key(0), **kw)
  shapes = {k: jax.ShapeDtypeStruct((64, 1024), jnp.int32) for k in ("inputs", "targets")}
  step = lambda remat, accum: fs.shard_step(fs.train_step(
      functools.partial(loss, remat=remat), opt, policy=policy, accum_steps=accum), mesh, **kw)
  topo = fs.detect_topology()
  prof = fs.analysis.profile_model(init, loss, opt, shapes, topo, policy=policy)
  options = lambda: fs.analysis.fit_options(prof, topo, fs.MeshAxes({"data": 1}, {}),
                                        0.9 * limit, rows=64)
  with pytest.raises(fs.FitError) as refused:
    fs.analysis.compile_fitting(step(False, 1), state, shapes, options=options)
  assert refused.value.needed > limit == refused.value.limit and refused.value.options
  best = refused.value.options[0]
  fixed = fs.analysis.compile_fitting(step(best.remat, best.accum_steps), state, shapes)
  assert fs.analysis.step_bytes(fixed) <= limit
  tokens = np.random.default_rng(2).integers(0, cfg.vocab, (64, 1025), dtype=np.int32)
  batch = fs.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                          fs.batch_sharding(mesh))
  _, metrics = fixed(state, batch)
  assert np.isfinite(float(metrics["loss"]))
