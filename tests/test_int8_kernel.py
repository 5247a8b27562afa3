"""The int8 matmul kernel (`fs.kernels.int8_matmul`, Pallas interpret mode here) and
`recipes.lm.int8.dense` on it: the value against a numpy oracle of the same quantization,
the gradients against the XLA path's, the fallback where a shape doesn't tile, remat, and
the program compiled for a described TPU v5e."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnscale as fs
from recipes.lm import int8, remat


def _oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """numpy: x per row and w per column to int8 (m = max|.|: s = m / 127, a times 127 / m
  rounded half to even, clipped to +-127; s = 1 where m = 0), the product in integers,
  times both scales, rounded to bfloat16."""
  def q(a):  # per row
    m = np.abs(a).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
      s = np.where(m > 0, m / np.float32(127), np.float32(1)).astype(np.float32)
      inv = np.where(m > 0, np.float32(127) / m, np.float32(1)).astype(np.float32)
    return np.clip(np.round(a * inv), -127, 127).astype(np.int64), s
  qx, sx = q(x.astype(np.float32))
  qw, sw = q(w.astype(np.float32).T)
  acc = (qx @ qw.T).astype(np.float32)
  return (acc * sx * sw.T).astype(jnp.bfloat16), qw.T.astype(np.int8), sw[:, 0]


def _data(m, k, n):
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(m, k)) * 3).astype(jnp.bfloat16)
  x[1] = 0  # a zero row: scale 1
  x[2, 5] = 200  # an outlier: its row's other values round to few levels
  return x, rng.normal(size=(k, n)).astype(np.float32) * 0.05


@pytest.mark.parametrize("tiles", [(128, 128), None], ids=["2x3-tiles", "chosen"])
def test_the_kernel_equals_a_numpy_oracle_of_the_same_quantization(tiles):
  x, w = _data(256, 256, 384)
  want, qw, sw = _oracle(x, w)
  run = jax.jit(lambda x, qw, sw: fs.kernels.int8_matmul(x, qw, sw, tiles=tiles,
                                                         interpret=True))
  got = np.asarray(run(x, qw, sw))
  assert got.dtype == jnp.bfloat16 and got.shape == (256, 384)
  np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
  assert not np.array_equal(want.astype(np.float32), (x.astype(np.float32) @ w).astype(
      jnp.bfloat16).astype(np.float32))  # it did round to int8


def test_the_selection_tiles_what_fits_and_says_why_not():
  sel = lambda x, w, **kw: fs.kernels.int8_selection(x, w, platform="tpu", **kw)
  # GPT medium's MLP at 16 rows: the largest tiles that fit 3/4 of the 32 MiB limit.
  assert sel((16384, 1024), (1024, 4096)).tiles == (512, 2048)
  # The 766M Llama's down projection: a [512, 8192] bf16 tile twice is 16 MiB: 256 rows.
  assert sel((16384, 8192), (8192, 2048)).tiles == (256, 512)
  assert fs.kernels.vmem_footprint(256, 512, 8192) <= 24 * 2**20
  assert sel((100, 1024), (1024, 4096)).implementation == "xla"
  assert "rows 100 must be a multiple of 32" in sel((100, 1024), (1024, 4096)).reason
  assert "needs platform tpu, this is cpu" in fs.kernels.int8_selection(
      (256, 128), (128, 128), platform="cpu").reason
  with pytest.raises(fs.KernelError, match=r"can't serve x \(100, 1024\).*implementation='xla'"):
    sel((100, 1024), (1024, 4096), implementation="pallas")
  with pytest.raises(fs.KernelError, match=r"tiles \(256, 96\) must divide"):
    sel((512, 128), (128, 384), implementation="pallas", tiles=(256, 96))
  # The kernel itself has no XLA path to be asked for: its error says what to run instead.
  x, qw, sw = jnp.ones((100, 128)), jnp.ones((128, 128), jnp.int8), jnp.ones((128,))
  with pytest.raises(fs.KernelError, match=r"int8_matmul can't serve x \(100, 128\).*rows 100 "
                     r"must be a multiple of 32.*int8_selection\(\.\.\.\) picks 'xla'"):
    fs.kernels.int8_matmul(x, qw, sw, interpret=True)


def _value_and_grads(implementation, x, w, g):
  def f(x, w):
    return int8.dense(x, w, implementation=implementation, interpret=True)
  return jax.jit(lambda x, w, g: (lambda y, pull: (y, *pull(g)))(*jax.vjp(f, x, w)))(x, w, g)


def test_dense_on_the_kernel_equals_the_xla_path_value_and_gradients():
  """Forward (x in the kernel) and input gradient (g's rows in the kernel) as the XLA
  path computes them; the weight gradient the same bf16 product."""
  x, w = _data(256, 128, 256)
  g = np.random.default_rng(1).normal(size=(256, 256)).astype(jnp.bfloat16)
  x = jnp.asarray(x)
  kernel = _value_and_grads("pallas", x, w, g)
  xla = _value_and_grads("xla", x, w, g)
  for a, b in zip(kernel, xla):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  jaxpr = str(jax.make_jaxpr(lambda x, w: jax.vjp(
      lambda x, w: int8.dense(x, w, implementation="pallas", interpret=True), x, w)[1](g))(x, w))
  assert jaxpr.count("pallas_call[") == 2  # the forward's product and dx's


def test_over_a_mesh_the_kernel_runs_per_device_and_equals_the_xla_path():
  """x's 512 rows over data=4 (128 a device: tiles chosen for them, not for the 512) and w's
  columns over tensor=2: value and gradients as XLA's path computes them, y split as x."""
  mesh = fs.make_mesh({"data": 4, "tensor": 2})
  put = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))
  x, w = _data(512, 256, 384)
  x, w = put(x, jax.P("data")), put(w, jax.P(None, "tensor"))
  g = np.random.default_rng(1).normal(size=(512, 384)).astype(jnp.bfloat16)
  with fs.with_mesh(mesh):
    kernel, xla = _value_and_grads("pallas", x, w, g), _value_and_grads("xla", x, w, g)
  for a, b in zip(kernel, xla):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert kernel[0].sharding.spec == jax.P("data")


def test_a_shape_that_does_not_tile_falls_back_and_says_so(caplog):
  x, w = _data(100, 128, 256)  # 100 rows: no multiple of 32
  with caplog.at_level(logging.WARNING):
    got = jax.jit(lambda x, w: int8.dense(x, w, interpret=True))(x, w)
  want, _, _ = _oracle(x, w.astype(jnp.bfloat16))  # dense casts w to x's dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), want.astype(np.float32),
                             rtol=2**-7, atol=1e-6)
  said = [r.getMessage() for r in caplog.records if "int8 matmul (100, 128)" in r.getMessage()]
  assert said and "rows 100 must be a multiple of 32" in said[0]
  with pytest.raises(fs.KernelError, match="can't serve"):
    int8.dense(x, w, implementation="pallas", interpret=True)


@pytest.mark.parametrize("implementation,product", [("pallas", "pallas_call["),
                                                    ("xla", "preferred_element_type=int32")])
def test_remat_dots_saves_the_products_output_instead_of_running_it_again(implementation,
                                                                           product):
  """Under "dots" a dense's output (a custom_vjp's: no dot the policy sees) is saved by its
  name: the gradient runs the int8 product twice (forward, input gradient), not a third
  time for the forward's rerun (as XLA's path did before it was named)."""
  x, w = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 128)) * 0.1
  block = remat.checkpointed(lambda x, w: jnp.tanh(int8.dense(
      x, w, implementation=implementation, interpret=True)) @ w.astype(x.dtype), "dots")
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: block(x, w).astype(jnp.float32).sum(),
                                      (0, 1)))(x, w))
  assert jaxpr.count(product) == 2


@pytest.mark.tpu
def test_dense_compiled_for_a_v5e_runs_one_kernel_per_product_and_never_quantizes_x(
    tpu_devices):
  """Value and gradients of int8.dense compiled for a described v5e:2x2 (rows split over
  `data`): a Mosaic call for the forward and one for the input gradient, and no int8 array
  in the program but the weights' (XLA's path has x's [512, 256] and g's [512, 384])."""
  mesh = fs.make_mesh({"data": 4}, devices=tpu_devices("v5e:2x2"))
  spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                               sharding=jax.NamedSharding(mesh, p))
  x, w = spec((2048, 256), jax.P("data")), spec((256, 384), jax.P())
  loss = lambda x, w: jnp.sum(jnp.tanh(int8.dense(x, w)).astype(jnp.float32))
  with fs.with_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
  calls = re.findall(r"custom-call\(.*custom_call_target=\"tpu_custom_call\"", hlo)
  assert len(calls) == 2
  assert set(re.findall(r"s8\[(\d+,\d+)\]", hlo)) == {"256,384", "384,256"}


@pytest.mark.slow  # ~20 s: a GPT compiled for a v5e
@pytest.mark.tpu
def test_gpt_int8_under_dots_compiled_for_a_v5e_runs_each_kernel_once(tpu_devices):
  """train_lm's GPT with `int8=True`, `remat="dots"`, its gradient compiled for a described
  v5e: per block 4 forward kernels and 4 input-gradient kernels (no rerun of the forward's:
  the dots policy saves them by name), and no activation quantized to int8 by XLA (M = 768
  tokens: no s8[768, ...])."""
  from recipes.lm import gpt  # pylint: disable=import-outside-toplevel
  mesh = fs.make_mesh({"data": 1}, devices=tpu_devices("v5e:2x2")[:1])
  sharding = jax.NamedSharding(mesh, jax.P())
  cfg = gpt.ModelConfig(2, 128, 2, 256, int8=True)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sharding),
                        jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0))))
  batch = {k: jax.ShapeDtypeStruct((3, 256), jnp.int32, sharding=sharding)
           for k in ("inputs", "targets")}
  grad = jax.grad(lambda p, b: gpt.loss_fn(p, b, remat="dots", cfg=cfg))
  with fs.with_mesh(mesh):
    hlo = jax.jit(grad).lower(params, batch).compile().as_text()
  kernels = [l for l in hlo.splitlines()
             if 'custom_call_target="tpu_custom_call"' in l and "fnscale_int8_matmul" in l]
  assert len(kernels) == 8  # the layer loop's body, once
  assert not re.findall(r"s8\[768,", hlo)
