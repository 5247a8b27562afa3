"""Benchmark: one MoE layer's forward+backward beside a dense layer of the same active FLOPs.

The MoE layer (`fnscale.parallel.experts.moe`, dropless: route, sort, grouped matmuls,
unsort, combine) with E experts of width F, k per token, and a dense SwiGLU of width k x F:
the same matmul FLOPs per token (2 x 3 x d x k F forward), so their time ratio is what the
routing, sorting and grouped matmul cost over plain matmuls. One device, float32; the two
steps alternate and each pair's ratio counts: the median of the ratios in one run (load on
the machine slows both of a pair alike).

  python recipes/bench/moe_layer.py                     # 4096 tokens, d 256, 8 x 512, k 2
  python recipes/bench/moe_layer.py --tokens=8192 --experts=64 --d_ff=128 --k=6
"""
from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

from fnscale.parallel import experts
from recipes.lm import cli


def _params(a, key):
  ks = jax.random.split(key, 7)
  n = lambda k, s: 0.05 * jax.random.normal(k, s, jnp.float32)
  d, e, f = a.d_model, a.experts, a.d_ff
  moe = {"router": n(ks[0], (d, e)), "w_gate": n(ks[1], (e, d, f)),
         "w_up": n(ks[2], (e, d, f)), "w_down": n(ks[3], (e, f, d))}
  dense = {"w_gate": n(ks[4], (d, a.k * f)), "w_up": n(ks[5], (d, a.k * f)),
           "w_down": n(ks[6], (a.k * f, d))}
  return moe, dense


def _steps(a):
  """(moe step, dense step): jitted value and gradient of sum(out^2) in x and the params."""
  def moe_loss(x, p):
    out, aux = experts.moe(x, p, a.k)
    return jnp.sum(out**2) + aux.load_balance_loss

  def dense_loss(x, p):
    h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
    return jnp.sum((h @ p["w_down"])**2)

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return grad(moe_loss), grad(dense_loss)


def run(a) -> dict:
  moe_p, dense_p = _params(a, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (1, a.tokens, a.d_model), jnp.float32)
  moe_step, dense_step = _steps(a)
  for _ in range(a.warmup):
    jax.block_until_ready((moe_step(x, moe_p), dense_step(x[0], dense_p)))
  moe_s, dense_s = [], []
  for _ in range(a.iters):
    for times, step, args in ((moe_s, moe_step, (x, moe_p)), (dense_s, dense_step,
                                                            (x[0], dense_p))):
      t = time.perf_counter()
      jax.block_until_ready(step(*args))
      times.append(time.perf_counter() - t)
  flops = 3 * 2 * 3 * a.tokens * a.d_model * a.k * a.d_ff  # fwd + bwd, 3 matrices
  return dict(moe_ms=1e3 * statistics.median(moe_s), dense_ms=1e3 * statistics.median(dense_s),
              ratio=statistics.median(m / d for m, d in zip(moe_s, dense_s)),
              matmul_gflop=flops / 1e9, platform=jax.default_backend())


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=cli.number(int, minimum=1), default=4096)
  ap.add_argument("--d_model", type=cli.number(int, minimum=1), default=256)
  ap.add_argument("--d_ff", type=cli.number(int, minimum=1), default=512,
                  help="each expert's hidden width")
  ap.add_argument("--experts", type=cli.number(int, minimum=1), default=8)
  ap.add_argument("--k", type=cli.number(int, minimum=1), default=2, help="experts per token")
  ap.add_argument("--iters", type=cli.number(int, minimum=1), default=20)
  ap.add_argument("--warmup", type=cli.number(int, minimum=0), default=3)
  a = ap.parse_args(argv)
  r = run(a)
  print(f"{r['platform']}: {a.tokens} tokens, d_model {a.d_model}; MoE {a.experts} x "
        f"{a.d_ff}, k {a.k} vs dense SwiGLU {a.k * a.d_ff} wide ({r['matmul_gflop']:.2f} "
        f"GFLOP of matmuls each, forward + backward)")
  print(f"median step: MoE {r['moe_ms']:.2f} ms, dense {r['dense_ms']:.2f} ms; median of "
        f"{a.iters} paired ratios MoE / dense: {r['ratio']:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
