"""A synthetic multi-file safetensors checkpoint, the params it loads into, and the load's
measured cost: what tests/test_hf_checkpoint.py checks in one process and, run as a script
under tests/multiprocess.py, in each process of a job.

  python tests/hf_worker.py --ckpt=DIR [--export=DIR]   # prints one JSON line of measures

The checkpoint is written by `safetensors.numpy.save_file` with a hand-written index (not by
fnscale), in bfloat16, float16 and float32: a stacked, transposed weight [layers, d, f] from
per-layer [f, d] tensors, a q-like weight whose rows split into heads, an embedding, a norm
scale (replicated: every device reads it) and per-layer biases.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tracemalloc

import ml_dtypes
import numpy as np

L, D, F, H, K, V = 4, 64, 96, 4, 8, 256  # layers, width, mlp, heads, head dim, vocab
FILES = 5


def tensors() -> dict:
  """The checkpoint's tensors by key, as the file stores them (numpy, mixed float dtypes)."""
  rng = np.random.default_rng(0)
  out = {"emb.weight": rng.normal(size=(V, D)).astype(np.float32),
         "norm.weight": rng.normal(size=(D,)).astype(ml_dtypes.bfloat16)}
  for l in range(L):
    out[f"layers.{l}.up.weight"] = rng.normal(size=(F, D)).astype(ml_dtypes.bfloat16)
    out[f"layers.{l}.q.weight"] = rng.normal(size=(H * K, D)).astype(np.float32)
    out[f"layers.{l}.up.bias"] = rng.normal(size=(F,)).astype(np.float16)
  return out


def write(directory: str) -> int:
  """Writes the checkpoint as FILES files plus model.safetensors.index.json; returns the
  tensors' bytes."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  items = sorted(tensors().items())
  weight_map = {}
  for i in range(FILES):
    name = f"model-{i + 1:05d}-of-{FILES:05d}.safetensors"
    part = dict(items[i::FILES])
    save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in part})
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return sum(a.nbytes for _, a in items)


def expected() -> dict:
  """The params the checkpoint holds (float32), computed with plain numpy."""
  t = {k: v.astype(np.float32) for k, v in tensors().items()}
  return {
      "embed": t["emb.weight"],
      "norm": t["norm.weight"],
      "up": np.stack([t[f"layers.{l}.up.weight"].T for l in range(L)]),
      "up_bias": np.stack([t[f"layers.{l}.up.bias"] for l in range(L)]),
      "wq": np.stack([t[f"layers.{l}.q.weight"].reshape(H, K, D).transpose(2, 0, 1)
                      for l in range(L)]),
  }


def cmap(hf):
  """The map from the params to the checkpoint's keys."""
  T = hf.Tensor
  return hf.CheckpointMap({
      "embed": T("emb.weight"), "norm": T("norm.weight"),
      "up": T("layers.{layer}.up.weight", perm=(1, 0)),
      "up_bias": T("layers.{layer}.up.bias"),
      "wq": T("layers.{layer}.q.weight", split=((H, K), None), perm=(2, 0, 1)),
  })


def target(mesh):
  """Abstract float32 params with FSDP shardings over `mesh`'s "fsdp" axis (the norm
  replicated), and (tensor over "tensor" where the mesh has it)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  t = "tensor" if "tensor" in mesh.axis_names else None
  specs = {"embed": P(t, "fsdp"), "norm": P(), "up": P(None, "fsdp", t),
           "up_bias": P(None, t), "wq": P(None, "fsdp", t, None)}
  shapes = {k: v.shape for k, v in expected().items()}
  return {k: jax.ShapeDtypeStruct(shapes[k], np.float32, sharding=NamedSharding(mesh, specs[k]))
          for k in specs}


def addressable_bytes(target_tree, itemsize: dict) -> dict:
  """Per leaf, the bytes of the distinct shards this process holds at `itemsize[leaf]` bytes
  an element: what a loader that reads only its own shards reads."""
  out = {}
  for name, leaf in target_tree.items():
    idx = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
    distinct = {tuple(s.indices(d)[:2] for s, d in zip(i, leaf.shape)) for i in idx}
    out[name] = sum(math.prod(b - a for a, b in bounds) for bounds in distinct) * itemsize[name]
  return out


ITEMSIZE = {"embed": 4, "norm": 2, "up": 2, "up_bias": 2, "wq": 4}  # in the checkpoint
FLOAT32 = dict.fromkeys(ITEMSIZE, 4)  # in the params


@contextlib.contextmanager
def measured():
  """Counts the bytes `safetensors.safe_open(...).get_slice(...)[...]` returns and the
  largest host allocation (tracemalloc) made while one `jax.make_array_from_callback` runs
  (one leaf), above what was allocated before it. Yields a dict filled in on exit."""
  import jax  # pylint: disable=import-outside-toplevel
  import safetensors  # pylint: disable=import-outside-toplevel
  out = {"bytes_read": 0, "leaf_peak": 0}
  real_open, real_make = safetensors.safe_open, jax.make_array_from_callback

  class Slice:  # pylint: disable=too-few-public-methods
    def __init__(self, s):
      self.s = s

    def __getitem__(self, index):
      a = self.s[index]
      out["bytes_read"] += a.nbytes
      return a

  @contextlib.contextmanager
  def counting_open(*args, **kwargs):
    with real_open(*args, **kwargs) as f:
      yield type("Counted", (), {"get_slice": lambda _, k: Slice(f.get_slice(k)),
                                 "get_tensor": lambda _, k: Slice(f.get_tensor(k))[...]})()

  def make(*args, **kwargs):
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    arr = real_make(*args, **kwargs)
    out["leaf_peak"] = max(out["leaf_peak"], tracemalloc.get_traced_memory()[1] - before)
    return arr

  tracemalloc.start()
  safetensors.safe_open, jax.make_array_from_callback = counting_open, make
  try:
    yield out
  finally:
    safetensors.safe_open, jax.make_array_from_callback = real_open, real_make
    tracemalloc.stop()


def main(argv) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--ckpt", required=True)
  p.add_argument("--export", default="")
  a = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import multiprocess  # pylint: disable=import-outside-toplevel
  multiprocess.initialize_from_env()
  import jax  # pylint: disable=import-outside-toplevel
  import fnscale as fs  # pylint: disable=import-outside-toplevel
  from fnscale.checkpoint import hf  # pylint: disable=import-outside-toplevel
  mesh = fs.make_mesh({"fsdp": jax.device_count()})
  tree = target(mesh)
  hf.load(a.ckpt, tree, cmap(hf))  # warm-up: jax's own one-time allocations
  with measured() as m:
    params = hf.load(a.ckpt, tree, cmap(hf))
    jax.block_until_ready(params)
  want = expected()
  for name, leaf in params.items():
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want[name][shard.index])
  if a.export:
    hf.export(a.export, params, cmap(hf), config={"model_type": "synthetic"},
              max_shard_bytes=40_000)
  print(json.dumps(dict(m, process=jax.process_index(),
                        largest_leaf=max(addressable_bytes(tree, FLOAT32).values()),
                        addressable=sum(addressable_bytes(tree, ITEMSIZE).values()))),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
