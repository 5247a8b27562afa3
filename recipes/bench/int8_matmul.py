"""Where int8 training pays: one block matmul in bf16 against `recipes.lm.int8.dense`, by part.

  python recipes/bench/int8_matmul.py                      # TPU: times each part on the chip
  python recipes/bench/int8_matmul.py --aot=v5e:1x1        # here: XLA's own v5e cost model
  python recipes/bench/int8_matmul.py --shapes=16384x1024x4096,32768x2048x8192
  python recipes/bench/int8_matmul.py --tiles=256x1024       # the kernel's (bm, bn)

Each `--shapes` entry is MxKxN: M tokens, the contracted width K, the output width N (GPT
medium's MLP up projection at 16 rows of 1024 tokens: 16384x1024x4096). For each it reports
the milliseconds of:

- `bf16`: x [M, K] @ w [K, N] in bfloat16, and the same forward + backward (dx and dw);
- `int8 dot`: the int8 x int8 -> int32 product alone, inputs already quantized (the MXU's
  int8 rate: on v5e twice the bf16 rate by the spec sheet);
- `quantize x`: `int8.quantize` of the activations (a max over K per row, then scale, round
  and cast per value: vector-unit work that grows with M K, not M K N);
- `int8.dense`: the whole forward, and forward + backward, through XLA (quantize, then
  `lax.dot_general`: `implementation="xla"`, `--int8`'s path before the kernel);
- `kernel`: the same through `fs.kernels.int8_matmul` (`implementation="pallas"`, as
  `--int8` runs on a TPU where the shapes tile): x's and g's rows quantized inside the
  kernel, at `--tiles` (default: the kernel's choice, printed per shape); "n/a" where it
  can't serve (not a TPU, or a shape that doesn't tile: the note under the table says why)
  and under `--aot` (XLA's estimate does not cost a Mosaic kernel).

On a TPU each figure is a median over `--reps` groups of 8 runs of the compiled program in
flight together (a group's time / 8: a lone call's dispatch and sync would count); with `--aot`
it is the compiler's estimate for the described chip (`compiled.cost_analysis()`'s
"optimal_seconds"; "n/a" where XLA gives none). The speed-up columns are bf16 / int8.dense
and bf16 / kernel.
int8 pays only where the int8 dot's saving exceeds what quantizing costs: with the quantize
cost proportional to M K and the dot's to M K N, the wider N (and K for the backward), the
better.
"""
from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import fnscale as fs
from recipes.lm import cli, int8

# (M, K, N): GPT small's and medium's MLP up projection at train_lm's TPU batch (32 and 16
# rows of 1024 tokens), the 766M Llama's gate projection at 8 rows of 2048.
SHAPES = ((32768, 768, 3072), (16384, 1024, 4096), (16384, 2048, 8192))
_GROUP = 8  # calls timed together, each figure their mean


def parts(m: int, k: int, n: int, tiles: tuple[int, int] | None = None) -> dict:
  """name -> (function, argument shapes) of each measured part at M x K x N (`tiles`: the
  kernel's)."""
  bf, i8 = jnp.bfloat16, jnp.int8
  x, w, g = (m, k), (k, n), (m, n)

  def grads(f):
    def run(x, w, g):  # y returned too: else XLA drops the forward's matmul
      y, pull = jax.vjp(f, x, w)
      return y, pull(g)
    return run
  dense = lambda x, w: int8.dense(x, w, implementation="xla")
  kernel = lambda x, w: int8.dense(x, w, implementation="pallas", tiles=tiles)
  int_dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.int32)
  return {"bf16 fwd": (jnp.matmul, [(x, bf), (w, bf)]),
          "bf16 fwd+bwd": (grads(jnp.matmul), [(x, bf), (w, bf), (g, bf)]),
          "int8 dot": (int_dot, [(x, i8), (w, i8)]),
          "quantize x": (lambda a: int8.quantize(a, 1), [(x, bf)]),
          "int8.dense fwd": (dense, [(x, bf), (w, bf)]),
          "int8.dense fwd+bwd": (grads(dense), [(x, bf), (w, bf), (g, bf)]),
          "kernel fwd": (kernel, [(x, bf), (w, bf)]),
          "kernel fwd+bwd": (grads(kernel), [(x, bf), (w, bf), (g, bf)])}


def kernel_serves(m: int, k: int, n: int, device, tiles=None) -> str | None:
  """Why the kernel can't serve the forward (x [m, k] @ w) or the input gradient
  (g [m, n] @ w^T) on `device`'s platform at `tiles`; None where it serves both."""
  for x, w in (((m, k), (k, n)), ((m, n), (n, k))):
    sel = fs.kernels.int8_selection(x, w, platform=device.platform, tiles=tiles)
    if sel.implementation != "pallas":
      return f"{x} @ {w}: {sel.reason}"
  return None


def seconds(fn, specs, device, aot: bool, reps: int) -> float | None:
  """The compiled `fn`'s seconds on `device`: measured (median of `reps`), or XLA's estimate
  for a described device (None where it gives none)."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
  with fs.with_mesh(fs.make_mesh({"data": 1}, devices=[device])):  # the kernel's platform
    compiled = jax.jit(fn).lower(*args).compile()
  if aot:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    est = (cost or {}).get("optimal_seconds", -1.0)
    return est if est > 0 else None
  key = jax.random.key(0)
  real = [(jax.random.normal(key, s, jnp.float32) * 3).astype(d) for s, d in specs]
  real = jax.device_put(real, sharding)
  jax.block_until_ready(compiled(*real))
  times = []
  for _ in range(reps):  # a group of calls in flight at once: the dispatch and sync of a
    t0 = time.perf_counter()  # lone call (~0.5 ms on a TPU VM) would be timed with it
    jax.block_until_ready([compiled(*real) for _ in range(_GROUP)])
    times.append((time.perf_counter() - t0) / _GROUP)
  return statistics.median(times)


_SPEEDUPS = (("fwd", "int8.dense fwd"), ("fwd+bwd", "int8.dense fwd+bwd"),
             ("kernel fwd", "kernel fwd"), ("kernel fwd+bwd", "kernel fwd+bwd"))


def table(shapes, device, aot: bool, reps: int, tiles=None) -> tuple[str, list[dict]]:
  """A markdown table (milliseconds per part, the speed-ups of int8.dense and the kernel
  over bf16) and its rows; under it a note per shape of the kernel's tiles, or why it
  can't serve."""
  names = list(parts(8, 8, 8))
  lines = ["| M x K x N | " + " | ".join(names) + " | "
           + " | ".join(f"{label} speed-up" for label, _ in _SPEEDUPS) + " |",
           "|---" * (len(names) + len(_SPEEDUPS) + 1) + "|"]
  rows, notes = [], []
  for m, k, n in shapes:
    why = kernel_serves(m, k, n, device, tiles) or (
        aot and "XLA's cost model does not see inside a Mosaic kernel: time it on the chip")
    got = {name: None if name.startswith("kernel") and why else
           seconds(fn, specs, device, aot, reps)
           for name, (fn, specs) in parts(m, k, n, tiles).items()}
    ratio = lambda a, b: (f"{got[a] / got[b]:.2f}x" if got[a] and got[b] else "n/a")
    ms = lambda v: f"{1e3 * v:.4g}" if v else "n/a"
    bf16 = lambda part: "bf16 fwd+bwd" if part.endswith("fwd+bwd") else "bf16 fwd"
    lines.append(f"| {m}x{k}x{n} | " + " | ".join(ms(got[p]) for p in names) + " | "
                 + " | ".join(ratio(bf16(p), p) for _, p in _SPEEDUPS) + " |")
    used = [fs.kernels.int8_selection(x, w, platform=device.platform, tiles=tiles).tiles
            for x, w in (((m, k), (k, n)), ((m, n), (n, k)))]
    notes.append(f"{m}x{k}x{n}: kernel n/a: {why}" if why else
                 f"{m}x{k}x{n}: kernel tiles (bm, bn) forward {used[0]}, input gradient "
                 f"{used[1]}")
    rows.append({"shape": (m, k, n), "seconds": got, "kernel": why or used})
  return "\n".join(lines + [""] + notes), rows


def _tiles(text: str) -> tuple[int, int] | None:
  if not text:
    return None
  try:
    bm, bn = (int(v) for v in text.lower().split("x"))
  except ValueError:
    raise fs.InputError(f"--tiles {text!r} is not BMxBN, e.g. 256x1024") from None
  return bm, bn


def _shape(text: str) -> tuple[int, int, int]:
  try:
    m, k, n = (int(v) for v in text.lower().split("x"))
  except ValueError:
    raise fs.InputError(f"--shapes entry {text!r} is not MxKxN, e.g. 16384x1024x4096") from None
  return m, k, n


def main(argv=None) -> int:
  """The table for `argv`'s shapes. Raises InputError on a bad flag or shape."""
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="", help="MxKxN entries, comma-separated (default: "
                  "GPT small's, medium's and the 766M Llama's MLP)")
  ap.add_argument("--aot", default="", help="describe this TPU (e.g. v5e:1x1): XLA's estimate")
  ap.add_argument("--tiles", default="", help="the kernel's BMxBN (rows of x, columns of w "
                  "per grid step), e.g. 256x1024; default: its choice")
  ap.add_argument("--reps", type=cli.number(int, minimum=1), default=20,
                  help="timed groups of 8 runs per part (the median is reported)")
  a = ap.parse_args(argv)
  fs.quiet_libtpu()
  shapes = [_shape(s) for s in a.shapes.split(",") if s] or list(SHAPES)
  tiles = _tiles(a.tiles)
  devices = fs.target_devices(a.aot) if a.aot else jax.devices()
  if not a.aot and devices[0].platform != "tpu":
    print("note: not a TPU: these are this host's times, not the chip's (--aot=v5e:1x1 gives "
          "XLA's estimate for one v5e chip)")
  text, _ = table(shapes, devices[0], bool(a.aot), a.reps, tiles)
  what = f"XLA's estimate for {a.aot}" if a.aot else f"measured on {devices[0].device_kind}"
  print(f"milliseconds, {what}, jax {jax.__version__}\n{text}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
