"""A pipelined Llama step's stage sends, DCN share, bubble and temporaries (no timing).

Compiles `recipes/lm/llama.py`'s training step (AdamW, remat of each block, float32 params)
with its layers run through `fnscale.parallel.pipeline` for each microbatch count given, on 8
simulated CPU devices or ahead of time for a described TPU target, and prints per device per
step: the collective-permutes the HLO reader counts beside the hand count (one send of a
microbatch per iteration, R M + S - 1 of them, and S - 1 sends of M/S microbatches before
and after the loop; the same again backward; a microbatch: its rows on one device x seq x
d_model x bytes per element), the DCN share by kind, the bubble the compile report reads
off the program, and XLA's temporary memory (the last column: over the first row's).

  python recipes/bench/pipeline.py                                  # CPU, stage=4 x data=2
  python recipes/bench/pipeline.py --target="2x v5p-8" --mesh=fsdp=4 --dcn=stage=2 \\
      --model=llama-8b --layers=8 --repeats=4 --batch=2 --seq=4096 --microbatches=4,16
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from fnscale.analysis import hlo
from recipes.lm import cli, llama

# 8 simulated CPU devices: read when jax's backend starts (first device use), not at import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MIB = 2**20


def hand_count(a, mesh, m: int) -> tuple[int, float]:
  """(collective-permute runs, bytes) per device per step of the stage sends."""
  s, r = mesh.shape["stage"], a.repeats
  rows = a.batch * mesh.devices.size // m  # a microbatch's rows
  split = mesh.devices.size // s // mesh.shape.get("tensor", 1)  # over the other data axes
  one = rows // split * a.seq * a.d_model * jnp.dtype(a.compute).itemsize
  loop, edges = r * m + s - 1, s - 1
  return 2 * (loop + 2 * edges), 2 * (loop + 2 * edges * m // s) * one


def compile_step(a, mesh, m: int):
  """The compiled step and its compile report for `m` microbatches."""
  cfg = llama.model_config(a.model, a.seq, layers=a.layers, stages=mesh.shape["stage"],
                           repeats=a.repeats)
  opt = optax.adamw(3e-4)
  policy = f"params=float32,compute={a.compute},output=float32"
  rows = a.batch * mesh.devices.size
  batch = {k: jax.ShapeDtypeStruct((rows, a.seq), jnp.int32) for k in ("inputs", "targets")}
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                          rules=llama.RULES, logical_axes=llama.logical_axes(cfg),
                          policy=policy, key=jax.random.key(0), abstract=True)
    loss = functools.partial(llama.loss_fn, remat=True, microbatches=m)
    step = fs.train_step(loss, opt, policy=policy)
    compiled = fs.shard_step(fs.with_kernel(step, attention="auto"), mesh).compile(state, batch)
  return compiled, fs.compile_report(compiled, state, batch)


def row(a, mesh, m: int, first_temp: float | None) -> tuple[str, float]:
  compiled, report = compile_step(a, mesh, m)
  s = hlo.summarize(compiled.compiled.as_text())
  got = s.collective("collective-permute")
  runs, nbytes = hand_count(a, mesh, m)
  dcn = ", ".join(f"{k} {b / MIB:,.1f}" for k, _, b in s.dcn_groups) or "-"
  temp = float(report.temp_bytes or 0)
  bubble = ", ".join(f"{p.bubble:.3f}" for p in report.pipelines)
  ratio = f"{temp / first_temp:.3f}" if first_temp else "1"
  return (f"| {m} | {got.count} / {runs} | {got.bytes / MIB:,.1f} / {nbytes / MIB:,.1f} | "
          f"{dcn} | {bubble} | {temp / MIB:,.1f} ({ratio}) |"), temp


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="cpu", help='"cpu" (8 simulated devices) or a TPU '
                 'target, e.g. "2x v5p-8"')
  p.add_argument("--mesh", default="stage=4,data=2", help="ICI axes")
  p.add_argument("--dcn", default="", help="DCN axes, e.g. stage=2")
  p.add_argument("--model", default="llama-tiny", choices=list(llama.SIZES))
  p.add_argument("--layers", type=cli.number(int, minimum=1), default=4)
  p.add_argument("--repeats", type=cli.number(int, minimum=1), default=1, help="circular repeats")
  p.add_argument("--batch", type=cli.number(int, minimum=1), default=8, help="rows per device")
  p.add_argument("--seq", type=cli.number(int, minimum=1), default=64)
  p.add_argument("--microbatches", type=cli.numbers(int, minimum=1), default="4,16",
                 help="microbatch counts to compile")
  p.add_argument("--compute", default=None, help="compute dtype (default: bfloat16 on a TPU "
                 "target, float32 on CPU, whose XLA sends bfloat16 as float32)")
  a = p.parse_args(argv)
  a.compute = a.compute or ("float32" if a.target == "cpu" else "bfloat16")
  if a.target != "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other jobs may hold libtpu
    fs.quiet_libtpu()
  # "cpu": the 8 simulated CPU devices set up above, there beside a machine's chips too.
  devices = jax.devices("cpu") if a.target == "cpu" else fs.target_devices(a.target)
  mesh = fs.make_mesh(a.mesh, dcn=a.dcn or None, devices=devices)
  a.d_model = llama.SIZES[a.model]["d_model"]
  print(f"{a.target}, mesh {dict(mesh.shape)}, {a.model} x {a.layers} layers, repeats "
        f"{a.repeats}, {a.batch} row(s) x {a.seq} tokens per device, {a.compute}; per "
        "device per step")
  print("| microbatches | collective-permute runs (HLO / hand) | MiB (HLO / hand) | "
        "DCN MiB by kind | bubble | temp MiB (x first) |")
  print("|---|---|---|---|---|---|")
  first = None
  for m in a.microbatches:
    text, temp = row(a, mesh, m, first)
    first = first or temp
    print(text, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
