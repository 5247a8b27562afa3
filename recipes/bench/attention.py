"""Benchmark: forward+backward time of each attention implementation on this machine.

Runs every implementation that can serve on the current platform (TPU: splash; NVIDIA GPU:
cudnn, pallas_gpu; always: the xla reference) for a few shapes and prints the median of N
timed runs after warm-up. On CPU the Pallas kernels run in interpret mode at tiny shapes:
those numbers test that the path works, they say nothing about kernel speed.

  python recipes/bench/attention.py                     # default shapes for the platform
  python recipes/bench/attention.py --shapes 4x2048x16x8x128 --iters 20 --causal
  python recipes/bench/attention.py --shapes 1x128x1x1x32 --implementations xla,splash \
      --iters 1 --warmup 0                              # a quick check that the paths run
"""
import argparse
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fnscale
from fnscale.kernels import kernel_selection

from recipes.lm import cli, hardware

DEFAULT_SHAPES = {  # batch x seq x heads x kv_heads x head_dim
    "tpu": "4x2048x16x16x128,4x4096x16x4x128,1x8192x8x8x128",
    "cuda": "4x2048x16x16x128,4x4096x16x4x128,1x8192x8x8x128",
    "cpu": "1x128x2x2x64,1x256x4x2x64",
}


def _implementations(platform: str):
  """(implementation, interpret) pairs that can run on `platform`."""
  if platform == "tpu":
    return [("xla", False), ("splash", False)]
  if platform == "gpu":
    return [("xla", False), ("cudnn", False), ("pallas_gpu", False)]
  return [("xla", False), ("splash", True), ("pallas_gpu", True)]


class Timing(NamedTuple):
  """How each case is timed: `warmup` untimed runs, then the median of `iters`."""
  warmup: int
  iters: int


def _time(fn, args, timing: Timing) -> float:
  """Median wall time of fn(*args) in milliseconds (`timing`)."""
  for _ in range(timing.warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(timing.iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def bench(shape, implementation, interpret, *, dtype, causal, timing: Timing):
  b, t, h, kh, d = shape
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k = jax.random.normal(keys[1], (b, t, kh, d), dtype)
  v = jax.random.normal(keys[2], (b, t, kh, d), dtype)

  def loss(q, k, v):
    out = fnscale.attention(q, k, v, causal=causal, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32))

  # with_kernel wraps the function jit traces, so the interpret choice is part of the trace.
  step = jax.jit(jax.value_and_grad(fnscale.with_kernel(loss, interpret=interpret),
                                    argnums=(0, 1, 2)))
  try:
    sel = fnscale.with_kernel(kernel_selection, interpret=interpret)(
        q.shape, k.shape, dtype, causal=causal, implementation=implementation)
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    compile_s = time.perf_counter() - start
  except fnscale.KernelError as e:
    return None, None, str(e)
  blocks = "" if sel.block_sizes is None else "x".join(map(str, sel.block_sizes[:2]))
  return _time(step, (q, k, v), timing), compile_s, blocks


def _parse_shape(parser, text):
  parts = text.lower().split("x")
  if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
    parser.error(f"--shapes entry {text!r}: expected BATCHxSEQxHEADSxKV_HEADSxHEAD_DIM, "
                 "five positive ints such as 1x128x2x2x64")
  return tuple(int(p) for p in parts)


def _parser() -> cli.ArgumentParser:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=None,
                      help="comma-separated BATCHxSEQxHEADSxKV_HEADSxHEAD_DIM")
  parser.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, "
                      "float32 on CPU")
  parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--warmup", type=cli.number(int, minimum=0), default=2)
  parser.add_argument("--iters", type=cli.number(int, minimum=1), default=None,
                      help="default: 20, CPU 5")
  parser.add_argument("--implementations", default=None,
                      help="comma-separated subset of the platform's implementations "
                      "(default: all of them)")
  hardware.add_arguments(parser)  # train_lm's hardware options
  return parser


def _chosen(parser, platform: str, wanted: str | None) -> list:
  """The platform's (implementation, interpret) pairs, those of `--implementations` only
  where given (an implementation the platform can't run is refused)."""
  chosen = _implementations(platform)
  if not wanted:
    return chosen
  wanted = wanted.split(",")
  unknown = sorted(set(wanted) - {name for name, _ in chosen})
  if unknown:
    parser.error(f"--implementations {unknown} can't run on {platform}; choose from "
                 f"{[name for name, _ in chosen]}")
  return [(name, interpret) for name, interpret in chosen if name in wanted]


def _table(parsed, chosen, dtype, causal: bool, timing: Timing) -> None:
  """Prints one row per shape and implementation: its time and its speed against xla's."""
  header = (f"{'shape (b x s x h x kvh x d)':<28} {'implementation':<16} {'mode':<10} "
            f"{'blocks':<9} {'fwd+bwd ms':>11} {'vs xla':>7} {'compile s':>9}")
  print(header)
  print("-" * len(header))
  for text, shape in parsed:
    reference = None
    for implementation, interpret in chosen:
      ms, compile_s, note = bench(shape, implementation, interpret, dtype=dtype,
                                  causal=causal, timing=timing)
      mode = "interpret" if interpret else "native"
      if ms is None:
        print(f"{text:<28} {implementation:<16} {mode:<10} n/a: {note}")
        continue
      reference = ms if implementation == "xla" else reference
      ratio = f"{reference / ms:.2f}x" if reference else ""
      print(f"{text:<28} {implementation:<16} {mode:<10} {note:<9} {ms:>11.2f} "
            f"{ratio:>7} {compile_s:>9.1f}")


def main(argv=None) -> int:
  fnscale.simulate_cpu_devices(8)  # CPU only, before any jax computation
  parser = _parser()
  args = parser.parse_args(argv)
  topo = hardware.detect(hardware.from_values(args))

  platform = jax.default_backend()
  on_cpu = platform not in ("tpu", "gpu")
  shapes = args.shapes or DEFAULT_SHAPES["cpu" if on_cpu else
                                         ("tpu" if platform == "tpu" else "cuda")]
  dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
  iters = args.iters or (5 if on_cpu else 20)
  parsed = [(text, _parse_shape(parser, text)) for text in shapes.split(",")]
  chosen = _chosen(parser, platform, args.implementations)
  print(hardware.describe(topo))
  print(f"platform={platform} device={jax.devices()[0].device_kind} dtype={dtype.name} "
        f"causal={args.causal} median of {iters} after {args.warmup} warm-up runs")
  _table(parsed, chosen, dtype, args.causal, Timing(args.warmup, iters))
  if on_cpu:
    print("interpret mode emulates the Pallas kernels with XLA ops on CPU: it checks the "
          "path, its times are not kernel speed.")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
