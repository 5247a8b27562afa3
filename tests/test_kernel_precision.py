"""The kernels under a caller's `jax.default_matmul_precision`: bfloat16 kernels traced at
the default precision (Mosaic lowers no "highest" bfloat16 dot), float32 ones at the
caller's, the caller's own matmuls untouched."""
import jax
import jax.numpy as jnp
from jax.extend import core as jcore
import pytest

import fnscale as fs

HIGHEST = (jax.lax.Precision.HIGHEST,) * 2


def _dot_precisions(jaxpr, inside: bool = False) -> set:
  """{(inside a kernel's primitive, precision)} of every dot_general in `jaxpr`."""
  out = set()
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      out.add((inside, e.params["precision"]))
    for sub in jcore.jaxprs_in_params(e.params):
      out |= _dot_precisions(sub, inside or e.primitive.name == "fnscale_kernel_call")
  return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_matmuls_in_both_passes_take_the_precision_their_dtype_allows(dtype):
  # The blockwise cross-entropy (a reverse-only kernel, as splash and megablox are) after
  # a matmul of the caller's, differentiated under "highest": the caller's matmul keeps
  # HIGHEST (forward and backward); the kernel's, in its forward and its backward pass,
  # keep it in float32 and take the default (None) in bfloat16. A kernel that ignored the
  # dtype, or reset the caller's precision outside it, shows another set.
  dt = jnp.dtype(dtype)
  x, w = jnp.ones((64, 16), dt), jnp.ones((16, 32), dt)
  unembed, labels = jnp.ones((32, 128), dt), jnp.zeros((64,), jnp.int32)
  loss = lambda x, w, u: fs.cross_entropy(x @ w, u, labels)
  with jax.default_matmul_precision("highest"):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w, unembed).jaxpr
  kernel = HIGHEST if dtype == "float32" else None
  assert _dot_precisions(jaxpr) == {(False, HIGHEST), (True, kernel)}


@pytest.mark.slow  # the interpret-mode precision tests beside it stay quick
@pytest.mark.tpu
def test_bfloat16_pallas_kernels_compile_for_tpu_under_highest_precision(tpu_devices):
  # Splash attention (whole and as the ring over a context axis) and megablox, value and
  # gradient, compiled for a described v5e:2x2 under jax.default_matmul_precision("highest"):
  # Mosaic's "Bad lhs type" if a bfloat16 kernel were traced at the caller's precision.
  devices = tpu_devices("v5e:2x2")
  attend = lambda q, k, v: fs.attention(q, k, v, causal=True, implementation="splash")
  gmm = lambda x, w: fs.kernels.grouped_matmul(x, w, jnp.array([256, 256], jnp.int32),
                                               implementation="megablox", platform="tpu")
  qkv, rows, ffn = (4, 1024, 4, 128), (512, 256), (2, 256, 512)
  cases = [(attend, {"data": 4}, [(qkv, jax.P("data"))] * 3),
           (fs.with_kernel(attend, context="ring"), {"context": 4},
            [(qkv, jax.P(None, "context"))] * 3),
           (gmm, {"data": 4}, [(rows, jax.P()), (ffn, jax.P())])]
  for fn, axes, specs in cases:
    mesh = fs.make_mesh(axes, devices=devices)
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.NamedSharding(mesh, spec))
            for shape, spec in specs]
    grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32)),
                    argnums=tuple(range(len(args))))
    with jax.default_matmul_precision("highest"), fs.with_mesh(mesh):
      jax.jit(grad).lower(*args).compile()
