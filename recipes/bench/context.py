"""Context parallelism's figures: correctness, a whole step, causal balance and K/V traffic.

Four tables, each against an independent reference (no timing):

- correctness: `fnscale.attention` on a sequence split c ways (c = 2, 4, 8; all-gather,
  ring and Ulysses forms, Ulysses where the heads divide over c; zigzag, striped and
  contiguous orders; packed rows of several documents), output and q/k/v gradients against
  jax's own attention on one device in float32 (causal within each document): the largest
  absolute difference.
- step: a Llama training step's loss and gradients (`recipes/lm/llama.py`, packed rows) on
  mesh data=2 x context=4 against the same step on one device.
- balance: unmasked causal query-key pairs per shard, counted from the mask of the whole
  sequence (`numpy.tril`) over the rows each shard holds: max / mean per order, beside the
  contiguous split's (2c - 1) / c.
- traffic: one attention call's optimized HLO (8 simulated CPU devices, float32; or ahead of
  time for a described TPU target, bfloat16, with `--target`), read by
  `fnscale.analysis.hlo`, beside the hand counts: the all-gather form sends
  (c - 1) / c x 2 x B x S x kv_heads x head_dim x bytes of K/V per layer forward (B: a
  device's rows); the ring form runs c - 1 collective-permutes of one K/V block
  (2 x B x S / c x kv_heads x head_dim x bytes) and no K/V all-gather; the Ulysses form
  four all-to-alls (q, k, v out, the output home) of (c - 1) / c of a device's shards
  (B x S / c x heads x head_dim x bytes for q and the output, kv heads repeated up to a
  multiple of c for k and v).

  python recipes/bench/context.py                        # all four, 8 simulated CPU devices
  python recipes/bench/context.py --figures=traffic --target=v5p-8 --seq=8192
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fnscale as fs
from fnscale.analysis import hlo
from fnscale.parallel import context as ca
from recipes.lm import cli
from recipes.lm import llama

# 8 simulated CPU devices: read when jax's backend starts (first device use), not at import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

FIGURES = ("correctness", "step", "balance", "traffic")
# Meshes over 8 devices for each context size: beside a batch and a head split, a batch
# split, alone.
MESHES = {2: {"data": 2, "context": 2, "tensor": 2}, 4: {"data": 2, "context": 4},
          8: {"context": 8}}


def _cpu_mesh(axes: dict):
  """A mesh over the 8 simulated CPU devices this script sets up: present on a machine with
  an accelerator too (where jax's default devices are its chips, maybe one)."""
  return fs.make_mesh(axes, devices=jax.devices("cpu"))


def _segments(rows: int, seq: int) -> np.ndarray:
  """Packed rows: row r holds r + 2 documents of unequal lengths (ids differ across rows)."""
  out = np.zeros((rows, seq), np.int32)
  for r in range(rows):
    cuts = np.sort(np.random.default_rng(r).choice(np.arange(1, seq), r + 1, replace=False))
    out[r] = 10 * r + np.searchsorted(cuts, np.arange(seq), side="right")
  return out


def _reference(a):
  """(q, k, v, segment ids, cotangent, [out, dq, dk, dv]): one device, float32."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(a.batch, a.seq, h, a.head_dim)).astype(np.float32)
             for h in (a.heads, a.kv_heads, a.kv_heads))
  w = rng.normal(size=q.shape).astype(np.float32)
  seg = _segments(a.batch, a.seq)
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), (0, 1, 2))(q, k, v)
  return (q, k, v, seg, w), [np.asarray(x) for x in (attend(q, k, v), *grads)]


def _split(inputs, form: str, order: str, c: int):
  """[out, dq, dk, dv] of fnscale.attention on the sequence split c ways, in sequence order."""
  q, k, v, seg, w = (ca.reorder(x, c, order) for x in inputs)
  attend = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True, segment_ids=seg),
                          context=form, context_order=order)
  loss = lambda q, k, v: (jnp.sum(attend(q, k, v) * w), attend(q, k, v))
  with fs.with_mesh(_cpu_mesh(MESHES[c])):
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return [ca.restore(np.asarray(x), c, order) for x in (out, *grads)]


def correctness(a) -> list[str]:
  inputs, ref = _reference(a)
  lines = [f"B {a.batch}, S {a.seq}, heads {a.heads}, kv heads {a.kv_heads}, head_dim "
           f"{a.head_dim}, float32, causal, packed rows ({', '.join(str(len(set(r))) for r in inputs[3])} documents)",
           "", "| form | c | order | max abs err out | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
  for form in ca.FORMS:
    for c in (2, 4, 8):
      for order in ca.ORDERS:
        try:
          errs = [np.abs(g - r).max() for g, r in zip(_split(inputs, form, order, c), ref)]
        except fs.KernelError as e:  # Ulysses: heads that don't divide over c
          lines.append(f"| {form} | {c} | {order} | refused: {str(e).split(';')[0]} |||")
          continue
        lines.append(f"| {form} | {c} | {order} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
  return lines


def step(a) -> list[str]:
  """Loss and gradients of a Llama step, context=4 (every form) against one device."""
  from fnscale.parallel import context as cp  # pylint: disable=import-outside-toplevel
  cfg = llama.ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, d_mlp=128, seq=a.seq,
                          vocab=64)
  params = llama.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(3).integers(0, 64, (4, a.seq + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": _segments(4, a.seq)}
  grad = jax.jit(jax.value_and_grad(llama.loss_fn))
  loss, grads = grad(params, cp.reorder_batch(batch, 1))
  mesh = _cpu_mesh(MESHES[4])
  shardings = fs.shardings(params, mesh, llama.RULES, logical_axes=llama.logical_axes(cfg))
  lines = [f"Llama 2 layers, d 64, seq {a.seq}, 4 packed rows, float32: one device against "
           "data=2 x context=4", "", "| form | loss (one device) | loss (context=4) | "
           "abs diff | max abs grad diff |", "|---|---|---|---|---|"]
  for form in ca.FORMS:
    split = fs.global_batch(cp.reorder_batch(batch, mesh), fs.batch_sharding(mesh))
    with fs.with_mesh(mesh):
      got, got_grads = jax.jit(fs.with_kernel(jax.value_and_grad(llama.loss_fn), context=form))(
          jax.device_put(params, shardings), split)
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(got_grads)))
    lines.append(f"| {form} | {float(loss):.7f} | {float(got):.7f} | "
                 f"{abs(float(loss) - float(got)):.1e} | {diff:.1e} |")
  return lines


def _hand_work(seq: int, rows: np.ndarray) -> np.ndarray:
  """Unmasked pairs per shard: the causal mask's rows (key <= query) at each shard's query
  places, built and summed 1024 rows at a time."""
  keys = np.arange(seq)
  return np.array([sum(int((keys[None] <= r[i:i + 1024, None]).sum())
                       for i in range(0, len(r), 1024)) for r in rows])


def balance(a) -> list[str]:
  seq = a.balance_seq
  lines = [f"S {seq} tokens, causal: unmasked query-key pairs per shard, max / mean", "",
           "| c | zigzag | striped | contiguous | (2c-1)/c |", "|---|---|---|---|---|"]
  for c in (2, 4, 8):
    ratio = lambda order: (lambda w: w.max() / w.mean())(
        _hand_work(seq, ca.positions(seq, c, order)))
    lines.append(f"| {c} | {ratio('zigzag'):.4f} | {ratio('striped'):.4f} | "
                 f"{ratio('contiguous'):.4f} | {(2 * c - 1) / c:.4f} |")
  return lines


def _attention_hlo(a, form: str, mesh, dtype):
  """HLO summary of one attention call's forward on [batch, seq] split (data, context)."""
  spec = fs.batch_sharding(mesh).spec  # rows over data (if any), the sequence over context
  spec = spec if "data" in mesh.axis_names else jax.P(None, "context")
  arg = lambda h: jax.ShapeDtypeStruct((a.batch, a.seq, h, a.head_dim), dtype,
                                       sharding=jax.NamedSharding(mesh, spec))
  f = fs.with_kernel(lambda q, k, v: fs.attention(q, k, v, causal=True), context=form)
  with fs.with_mesh(mesh):
    lowered = jax.jit(f).lower(arg(a.heads), arg(a.kv_heads), arg(a.kv_heads))
    return hlo.summarize(lowered.compile().as_text())


def traffic(a) -> list[str]:
  if a.target == "cpu":
    mesh, dtype = _cpu_mesh(MESHES[4]), jnp.float32
  else:
    mesh = fs.make_mesh({"context": 4}, devices=fs.target_devices(a.target))
    dtype = jnp.bfloat16
  c, rows = mesh.shape["context"], a.batch // mesh.shape.get("data", 1)
  nbytes = jnp.dtype(dtype).itemsize
  kv = 2 * rows * a.seq * a.kv_heads * a.head_dim * nbytes
  lines = [f"{a.target}, mesh {dict(mesh.shape)}, {jnp.dtype(dtype).name}, B {a.batch} "
           f"({rows} per device), S {a.seq}, kv heads {a.kv_heads}, head_dim {a.head_dim}: "
           "one attention call (one layer) forward, per device", "",
           "| form | collective | runs (HLO) | runs (hand) | bytes sent (HLO) | bytes (hand) "
           "| kernels |", "|---|---|---|---|---|---|---|"]
  summaries = {form: _attention_hlo(a, form, mesh, dtype) for form in ca.FORMS}
  # Ulysses' shards: q and the output, K and V with their heads repeated to a multiple of c.
  q = rows * a.seq // c * a.heads * a.head_dim * nbytes
  kv_heads = a.kv_heads * c // np.gcd(a.kv_heads, c)
  swapped = 2 * q + 2 * q * kv_heads // a.heads
  # Hand runs: K and V gathered (2); c - 1 permutes of the stacked K/V block; 4 all-to-alls.
  for form, kind, runs, sent in (("all_gather", "all-gather", 2, (c - 1) / c * kv),
                                 ("all_gather", "collective-permute", 0, 0),
                                 ("ring", "collective-permute", c - 1, (c - 1) * kv / c),
                                 ("ring", "all-gather", 0, 0),
                                 ("ulysses", "all-to-all", 4, (c - 1) / c * swapped),
                                 ("ulysses", "all-gather", 0, 0)):
    s = summaries[form]
    got = s.collective(kind)
    kernels = ", ".join(sorted({k.name for k in s.kernels})) or "none (xla)"
    lines.append(f"| {form} | {kind} | {got.count} | {runs} | {got.bytes_sent:,.0f} | "
                 f"{sent:,.0f} | {kernels} |")
  return lines


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--figures", default=",".join(FIGURES), help=f"of {FIGURES}")
  p.add_argument("--target", default="cpu", help='traffic: "cpu" (8 simulated devices, '
                 'data=2 x context=4) or a TPU target ("v5p-8": context=4, ahead of time)')
  p.add_argument("--batch", type=cli.number(int, minimum=1), default=2, help="rows")
  p.add_argument("--seq", type=cli.number(int, minimum=16), default=128,
                 help="tokens per row (a multiple of 16)")
  p.add_argument("--heads", type=cli.number(int, minimum=1), default=4)
  p.add_argument("--kv_heads", type=cli.number(int, minimum=1), default=2)
  p.add_argument("--head_dim", type=cli.number(int, minimum=1), default=16)
  p.add_argument("--balance_seq", type=cli.number(int, minimum=16), default=16384,
                 help="balance: tokens per row")
  a = p.parse_args(argv)
  if a.target != "cpu":
    fs.quiet_libtpu()
  names = a.figures.split(",")
  for name in names:  # all checked before any runs
    if name not in FIGURES:
      raise fs.InputError(f"--figures: {name!r} is not one of {FIGURES}")
  for name in names:
    print(f"## {name}\n")
    with jax.default_device(jax.devices("cpu")[0]):  # the one-device references too
      print("\n".join(globals()[name](a)) + "\n", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
