"""Collectives and temporaries per step, accum 1 vs 4 in each accum_gather mode, from
the compiled program (no timing).

The model: 2 layers, d 256, mlp 1024 (4 MiB of f32 params), batch 8192 rows, FSDP over every
device: 8 simulated CPU devices and, ahead of time, TPU v5p-8 (4 chips). Rows: accum 1, then
accum 4 with the default ("auto": chosen by the device's memory, none known on CPU), "once"
and "per_microbatch".

  python recipes/bench/accumulation.py [cpu] [tpu] [--large | --llama8b] [--scales] [--data=N]

Targets default to both. `--scales`: each layer's input multiplied by a scale [d] (a norm's),
a leaf replicated over the data axes whose gradient is all-reduced, not reduce-scattered.
`--data=N`: a data axis of N devices beside fsdp, over which the fsdp shards' gradients are
all-reduced.

`--large`: 2 layers of d 1024, mlp 4096 (64 MiB of f32 params), batch 64.
`--llama8b`: 2 layers at Llama-3-8B's widths (d 4096, mlp 14336: 896 MiB of f32 params),
batch 16384 rows, computed in bfloat16.
"""
import sys

import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from fnscale.analysis import hlo

from recipes.lm import cli

D, M, L, B = 256, 1024, 2, 8192
MIB = 2**20
# 4 chips: on 8 or more v5p/v6e chips this libtpu writes a reduce-scatter as an all-reduce
# and a slice (measured with a lone psum_scatter), which would hide the mode's reduction.
TPU = "v5p-8"


def init_mlp(key, d: int = D, m: int = M, layers: int = L, scales: bool = False) -> dict:
  """Residual ReLU MLP params: per layer "l{i}" float32 w1 [d, m] and w2 [m, d] ~ N(0, 0.02²);
  with `scales`, also an input scale [d] of ones (a norm's scale: replicated, not FSDP-split)."""
  ks = jax.random.split(key, 2 * layers)
  return {f"l{i}": {"w1": jax.random.normal(ks[2 * i], (d, m)) * 0.02,
                    "w2": jax.random.normal(ks[2 * i + 1], (m, d)) * 0.02,
                    **({"scale": jnp.ones((d,))} if scales else {})}
          for i in range(layers)}


def mlp_loss(p: dict, b: dict) -> jax.Array:
  """Mean square of the residual stack's output; b["x"]: float32 [batch, d] -> scalar."""
  x = b["x"]
  for i in range(len(p)):
    layer = p[f"l{i}"]
    h = x * layer["scale"] if "scale" in layer else x
    x = x + jax.nn.relu(h @ layer["w1"]) @ layer["w2"]
  return jnp.mean(x ** 2)


KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def row(mesh, accum: int, gather: str, d: int = D, m: int = M, rows: int = B,
        policy: str | None = None, scales: bool = False) -> str:
  opt = optax.sgd(0.1)
  init = lambda key: init_mlp(key, d, m, scales=scales)
  state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), abstract=True)
  batch = {"x": jax.ShapeDtypeStruct((rows, d), jnp.float32)}
  step = fs.train_step(mlp_loss, opt, accum_steps=accum, accum_gather=gather, policy=policy)
  compiled = fs.shard_step(step, mesh).compile(state, batch).compiled
  s = hlo.summarize(compiled.as_text())
  cells = [f"{c.count} / {c.bytes_sent / MIB:.2f} MiB" for c in map(s.collective, KINDS)]
  temp = compiled.memory_analysis().temp_size_in_bytes
  return " | ".join([f"accum {accum} {gather}"] + cells + [_placed(s, accum), f"{temp / MIB:.2f}"])


def _placed(s, accum: int) -> str:
  """All-reduce ops in the microbatch loop's body / after it: an op in the body runs
  `accum` times, one outside once (count = after + accum x body, ops = after + body).
  "-" where the program has no loop or more than one."""
  loops, c = s.loops, s.collective("all-reduce")
  if accum == 1 or len(loops) != 1 or loops[0].trip_count != accum:
    return "-" if accum > 1 else f"0 / {c.ops}"
  body = (c.count - c.ops) // (accum - 1)
  return f"{body} / {c.ops - body}"


MODES = ((1, "auto"), (4, "auto"), (4, "once"), (4, "per_microbatch"))


def main(targets, d: int = D, m: int = M, rows: int = B, policy: str | None = None,
         scales: bool = False, data: int = 1) -> None:
  print(f"{L} layers, d {d}, mlp {m}{', input scales' if scales else ''}, batch {rows}: runs / "
        "bytes sent per device per step")
  print("| target | step | " + " | ".join(KINDS) + " | all-reduce ops in loop / after | temp MiB |")
  for target in targets:
    devices = fs.target_devices(TPU) if target == "tpu" else None
    mesh = fs.make_mesh({"data": data, "fsdp": -1}, devices=devices)
    name = f"{TPU} (AOT)" if target == "tpu" else "CPU"
    axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
    for accum, gather in MODES:
      cells = row(mesh, accum, gather, d, m, rows, policy, scales)
      print(f"| {name}, {axes} | {cells} |", flush=True)


def _cli(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("targets", nargs="*", metavar="{cpu,tpu}", help="where to compile: 8 "
                      "simulated CPU devices, TPU v5p-8 (libtpu); default both")
  parser.add_argument("--large", action="store_true", help="2 layers of d 1024, mlp 4096 "
                      "(64 MiB of f32 params), batch 64")
  parser.add_argument("--llama8b", action="store_true", help="2 layers at Llama-3-8B's "
                      "widths (d 4096, mlp 14336), batch 16384, bfloat16 compute")
  parser.add_argument("--scales", action="store_true", help="each layer's input multiplied by "
                      "a scale [d] (a norm's: replicated over the data axes, its gradient "
                      "all-reduced)")
  parser.add_argument("--data", type=int, default=1, help="a data axis of this size beside "
                      "fsdp (the rest of the devices)")
  args = parser.parse_args(argv)
  if set(args.targets) - {"cpu", "tpu"}:
    parser.error(f"unknown target(s) {sorted(set(args.targets) - {'cpu', 'tpu'})}; "
                 "expected cpu and/or tpu")
  fs.quiet_libtpu()
  fs.simulate_cpu_devices(8)
  targets, model = args.targets or ["cpu", "tpu"], {"scales": args.scales, "data": args.data}
  if args.large:  # 64 MiB of f32 params, 64 rows: XLA moves activations instead
    main(targets, d=1024, m=4096, rows=64, **model)
  elif args.llama8b:
    main(targets, d=4096, m=14336, rows=16384,
         policy="params=float32,compute=bfloat16,output=float32", **model)
  else:
    main(targets, **model)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(_cli))
