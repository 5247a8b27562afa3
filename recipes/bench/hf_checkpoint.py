"""Hugging Face checkpoints in and out of fnscale: time, host memory and bytes read.

  python recipes/bench/hf_checkpoint.py --size=llama-1b --dir=/tmp/hf-bench   # ~1.24B params
  python recipes/bench/hf_checkpoint.py --size=llama-tiny --dir=/tmp/hf-bench  # seconds
  python recipes/bench/hf_checkpoint.py --families --dir=/tmp/hf-bench  # max |dlogit| each

Writes a random checkpoint shaped like the named size of recipes/lm/llama.py (keys and shapes
from transformers' own model built on the `meta` device, so nothing is allocated there;
values random bfloat16, written by `safetensors.numpy` in files of --shard_gb), then loads it
into float32 params on the simulated CPU devices with FSDP over all of them
(`fnscale.checkpoint.hf.load`), and exports them (`hf.export`). Prints one JSON line: load
and export wall seconds, bytes read against the checkpoint's bytes, and the largest host
allocation (tracemalloc) while one leaf was built, against the largest leaf. On CPU the
devices' buffers live in host memory too; tracemalloc counts what numpy allocates (the
loader's reads and staging), not the device buffers XLA allocates.

Needs the test extra's transformers and torch (for the meta-device shapes) and the hf extra.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time

import jax
import ml_dtypes
import numpy as np
import optax

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.lm import hf_maps, llama
from recipes.lm import cli

# 8 simulated CPU devices: read when jax's backend starts (first device use), not at import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


# Tiny random models of each family (transformers' classes and config fields), what
# tests/test_hf_models.py and `--families` compare fnscale against.
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, head_dim=16, rope_theta=1e4)),
    "llama3.2": ("LlamaConfig", "LlamaForCausalLM", dict(
        COMMON, hidden_size=64, head_dim=16, tie_word_embeddings=True, rope_theta=5e5,
        rope_scaling=LLAMA3, max_position_embeddings=131072)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=16)),
    # YaRN at factor 4 over 256 positions: 4 of the 8 frequencies blended, 4 divided by 4,
    # cos and sin times 0.1 ln 4 + 1.
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        COMMON, head_dim=16, rope_theta=1e4, max_position_embeddings=1024, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=256))),
    # Sequences of 32 > the window of 8; caps small enough to bend the random logits; a
    # pattern with a layer past its last whole period (local, global | local).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        COMMON, num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Two local layers (their own RoPE base) to one global, then a local one.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, rope_theta=1e4,
        rope_local_base_freq=100.0, layer_types=["sliding_attention", "sliding_attention",
                                                  "full_attention", "sliding_attention"])),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=64, n_embd=32, n_layer=2,
                                                    n_head=4, n_positions=64)),
}


def tokens(seq: int, vocab: int = 64) -> np.ndarray:
  return np.random.default_rng(0).integers(0, vocab, (2, seq))


def randomize(model):
  """Every weight of a torch model random (norm scales around 1, biases nonzero), so a
  dropped or misplaced tensor shows in the logits; the model in eval mode."""
  import torch  # pylint: disable=import-outside-toplevel
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      is_scale = name.endswith("weight") and ("norm" in name or ".ln_" in name)
      p.copy_(1 + 0.2 * noise if is_scale else 0.2 * noise)
  return model.eval()


def make_family(name: str, directory, toks: np.ndarray) -> np.ndarray:
  """Saves a tiny random model of family `name` in `directory` (files of ~20 KB, with an
  index) and returns transformers' float32 logits [batch, seq, vocab] for `toks`."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  transformers.logging.set_verbosity_error()
  config_cls, model_cls, fields = FAMILIES[name]
  model = randomize(getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)))
  model.save_pretrained(directory, max_shard_size="20KB")
  with torch.no_grad():
    return model(torch.tensor(toks)).logits.numpy()


def family_errors(directory: str) -> dict:
  """Max |fnscale logit - transformers logit| per family, loaded on 1 device and on 8
  (data x FSDP x tensor)."""
  out, toks = {}, tokens(32)
  mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  for name in FAMILIES:
    d = os.path.join(directory, name)
    want = make_family(name, d, toks)
    m = hf_maps.read(d, 32)
    run = jax.jit(hf_maps.apply_fn(m))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(functools.partial(m.model.init_params, m.cfg), jax.random.key(0))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)
    got1 = run(hf.load(d, target, hf_maps.checkpoint_map(m, d)), toks)
    target8 = fs.init_state(functools.partial(m.model.init_params, m.cfg), optax.sgd(0.1),
                            mesh=mesh, rules=m.model.RULES,
                            logical_axes=m.model.logical_axes(m.cfg), key=jax.random.key(0),
                            abstract=True).params
    with fs.with_mesh(mesh):
      got8 = run(hf.load(d, target8, hf_maps.checkpoint_map(m, d)), toks)
    out[name] = {"1_device": float(np.abs(np.asarray(got1) - want).max()),
                 "8_devices": float(np.abs(np.asarray(got8) - want).max()),
                 "max_abs_logit": float(np.abs(want).max())}
  return out


def hf_shapes(cfg: llama.ModelConfig) -> dict:
  """{key: shape} of transformers' LlamaForCausalLM for cfg, built on the meta device."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  config = transformers.LlamaConfig(**hf_maps.to_config(hf_maps.of_model(llama, cfg)))
  with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
  return config.to_dict(), {k: tuple(v.shape) for k, v in model.state_dict().items()
                            if not (cfg.tie_embeddings and k == "lm_head.weight")}


def write_checkpoint(directory: str, cfg, shard_bytes: int) -> int:
  """A random bfloat16 checkpoint with config.json and an index; returns its tensor bytes."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  config, shapes = hf_shapes(cfg)
  os.makedirs(directory, exist_ok=True)
  rng, files, current, size, total = np.random.default_rng(0), [], {}, 0, 0

  def flush():
    name = f"model-{len(files) + 1:05d}.safetensors"
    save_file(current, os.path.join(directory, name), metadata={"format": "pt"})
    files.append((name, list(current)))

  for key, shape in shapes.items():
    a = (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
    if current and size + a.nbytes > shard_bytes:
      flush()
      current, size = {}, 0
    current[key], size, total = a, size + a.nbytes, total + a.nbytes
  flush()
  weight_map = {k: name for name, keys in files for k in keys}
  with open(os.path.join(directory, hf.INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(directory, hf.CONFIG_FILE), "w") as f:
    json.dump(config, f)
  return total


@contextlib.contextmanager
def _counting(stats: dict):
  """While open, counts into `stats` the bytes safetensors reads ("bytes_read") and the
  largest host memory one leaf's `jax.make_array_from_callback` takes ("leaf_peak")."""
  import safetensors  # pylint: disable=import-outside-toplevel
  import tracemalloc  # pylint: disable=import-outside-toplevel
  real_open, real_make = safetensors.safe_open, jax.make_array_from_callback

  def _count(a):
    stats["bytes_read"] += a.nbytes
    return a

  class Counted:  # what safetensors returns, counted
    def __init__(self, f):
      self.f = f

    def get_slice(self, key):
      s = self.f.get_slice(key)
      return type("S", (), {"__getitem__": lambda _, i: _count(s[i])})()

    def get_tensor(self, key):
      return _count(self.f.get_tensor(key))

  class Open:
    def __init__(self, *a, **k):
      self.cm = real_open(*a, **k)

    def __enter__(self):
      return Counted(self.cm.__enter__())

    def __exit__(self, *exc):
      return self.cm.__exit__(*exc)

  def make(*a, **k):
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    out = real_make(*a, **k)
    stats["leaf_peak"] = max(stats["leaf_peak"], tracemalloc.get_traced_memory()[1] - before)
    return out

  safetensors.safe_open, jax.make_array_from_callback = Open, make
  tracemalloc.start()
  try:
    yield stats
  finally:
    safetensors.safe_open, jax.make_array_from_callback = real_open, real_make
    tracemalloc.stop()


def measure_load(directory: str, seq: int) -> dict:
  """Loads the checkpoint twice (the first warms jax up), measuring the second."""
  m = hf_maps.read(directory, seq)
  mesh = fs.make_mesh({"fsdp": jax.device_count()})
  target = fs.init_state(functools.partial(m.model.init_params, m.cfg), optax.sgd(0.1),
                         mesh=mesh, rules=m.model.RULES, logical_axes=m.model.logical_axes(m.cfg),
                         key=jax.random.key(0), abstract=True).params
  cmap = hf_maps.checkpoint_map(m, directory)
  with _counting({"bytes_read": 0, "leaf_peak": 0}) as stats:
    t = time.perf_counter()
    params = jax.block_until_ready(hf.load(directory, target, cmap))
    load_s = time.perf_counter() - t
  largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(target))
  return m, cmap, params, dict(stats, load_s=round(load_s, 2), largest_leaf=largest,
                               params=sum(x.size for x in jax.tree.leaves(target)))


def main(argv) -> int:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="llama-tiny", choices=sorted(llama.SIZES))
  p.add_argument("--dir", required=True, help="scratch directory (removed at the end)")
  p.add_argument("--shard_gb", type=cli.number(float, above=0), default=1.0)
  p.add_argument("--seq", type=cli.number(int, minimum=1), default=2048)
  p.add_argument("--families", action="store_true",
                 help="instead: each family's max |dlogit| against transformers")
  a = p.parse_args(argv)
  if a.families:
    try:
      print(json.dumps(family_errors(a.dir)))
    finally:
      shutil.rmtree(a.dir, ignore_errors=True)
    return 0
  cfg = llama.model_config(a.size, a.seq)
  src, out = os.path.join(a.dir, "in"), os.path.join(a.dir, "out")
  try:
    t = time.perf_counter()
    total = write_checkpoint(src, cfg, int(a.shard_gb * 1e9))
    write_s = time.perf_counter() - t
    m, cmap, params, stats = measure_load(src, a.seq)
    t = time.perf_counter()
    files = hf.export(out, params, cmap, config=hf_maps.to_config(m),
                      max_shard_bytes=int(a.shard_gb * 1e9))
    export_s = time.perf_counter() - t
    written = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(json.dumps(dict(size=a.size, devices=jax.device_count(), checkpoint_bytes=total,
                          write_random_s=round(write_s, 2), **stats,
                          export_s=round(export_s, 2), export_bytes=written,
                          export_files=len(files))))
  finally:
    shutil.rmtree(a.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
