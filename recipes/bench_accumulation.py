"""Collectives and temporaries per step, accum 1 vs 4, from compile_report (no timing).

The model of the accumulation report: fsdp=8, 2 layers, d 256, mlp 1024 (4 MiB of f32
params), batch 8192 rows; on 8 simulated CPU devices and, ahead of time, TPU v5p:2x2x2.

  python recipes/bench_accumulation.py [cpu] [tpu]
"""
import sys

import jax
import jax.numpy as jnp
import optax

import fnscale as fs

D, M, L, B = 256, 1024, 2, 8192
MIB = 2**20


def init_mlp(key, d: int = D, m: int = M, layers: int = L) -> dict:
  """Residual ReLU MLP params: per layer "l{i}" float32 w1 [d, m] and w2 [m, d] ~ N(0, 0.02²)."""
  ks = jax.random.split(key, 2 * layers)
  return {f"l{i}": {"w1": jax.random.normal(ks[2 * i], (d, m)) * 0.02,
                    "w2": jax.random.normal(ks[2 * i + 1], (m, d)) * 0.02}
          for i in range(layers)}


def mlp_loss(p: dict, b: dict) -> jax.Array:
  """Mean square of the residual stack's output; b["x"]: float32 [batch, d] -> scalar."""
  x = b["x"]
  for i in range(len(p)):
    x = x + jax.nn.relu(x @ p[f"l{i}"]["w1"]) @ p[f"l{i}"]["w2"]
  return jnp.mean(x ** 2)


def row(mesh, accum: int, gather: str) -> str:
  opt = optax.sgd(0.1)
  state = fs.init_state(init_mlp, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((B, D), jnp.float32)}
  step = fs.train_step(mlp_loss, opt, accum_steps=accum, accum_gather=gather)
  r = fs.compile_report(fs.shard_step(step, mesh), state, batch)
  cells = [f"{c.count} / {c.bytes / MIB:.2f} MiB"
           for c in (r.collective("all-reduce"), r.collective("all-gather"))]
  return " | ".join([f"accum {accum} {gather}"] + cells + [f"{(r.temp_bytes or 0) / MIB:.2f}"])


def main(targets) -> None:
  print("| target | step | all-reduce runs / bytes | all-gather runs / bytes | temp MiB |")
  for target in targets:
    devices = None
    if target == "tpu":
      devices = fs.topology.target_devices("v5p:2x2x2")
    mesh = fs.make_mesh({"fsdp": 8}, devices=devices)
    for accum, gather in ((1, "once"), (4, "once"), (4, "per_microbatch")):
      print(f"| {target} | {row(mesh, accum, gather)} |", flush=True)


if __name__ == "__main__":
  fs.topology.quiet_libtpu()
  fs.simulate_cpu_devices(8)
  main(sys.argv[1:] or ["cpu", "tpu"])
