"""LoRA fine-tuning on TPU chips: a run prepared for one v5e chip, and the memory of a larger
one compiled ahead of time for a described slice.

  python recipes/bench/lora.py --prepare=/tmp/lora1b                  # Llama-3.2-1B-shaped
  python recipes/bench/lora.py --prepare=/tmp/lora-tiny --size=llama-tiny --seq=128   # CPU
  python recipes/bench/lora.py --compile --size=llama-8b --target=v5litepod-8 --seq=2048

--prepare=DIR writes, without downloading anything: DIR/model, a Hugging Face checkpoint of
the named Llama size with random bfloat16 weights (written by fnscale's own export:
config.json with Llama 3.2's tied embeddings and RoPE scaling for llama-1b, safetensors
shards) and a byte-level BPE tokenizer.json trained on the conversations; DIR/chats.jsonl,
synthetic conversations (arithmetic and list questions, the answers the assistant's turns);
DIR/chat.jinja, their template; DIR/cache, their token cache (`recipes/pretokenize.py
--chat`: loss weight on the assistant's tokens only). It prints the train_lm command that
fine-tunes the model with LoRA rank 16 on rows of --seq tokens; train_lm's progress lines
give tokens/s and MFU (frozen matmuls counted 4 N, adapters 6 N: recipes/lm/finetune.py),
its compile report the step's memory per device, and its last line the device's HBM peak.

--compile builds the LoRA state of the named size abstractly (bfloat16 base, float32
adapters of rank --rank on every block matmul, AdamW) on --target's described devices
(libtpu; FSDP over all of them) and compiles train_lm's LoRA step for --global_batch rows
of --seq tokens; prints one JSON line: XLA's memory per chip (arguments, temporaries, peak)
against the chip's HBM, and the compile time.
"""
from __future__ import annotations

import functools
import json
import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from recipes import train_tokenizer
from recipes.lm import cache, cli, hf_maps, llama
from recipes.lm.options import MIXED

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def conversations(n: int, seed: int = 0) -> list[dict]:
  """`n` synthetic conversations of a few turns: sums, sorted lists, repeated words."""
  rng, out = random.Random(seed), []
  for _ in range(n):
    messages = []
    for _ in range(rng.randint(1, 4)):
      kind = rng.randrange(3)
      if kind == 0:
        a, b = rng.randint(1, 10**6), rng.randint(1, 10**6)
        q, r = f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
      elif kind == 1:
        xs = [rng.randint(0, 999) for _ in range(rng.randint(5, 40))]
        q, r = f"Sort these numbers: {xs}", f"Sorted: {sorted(xs)}"
      else:
        w = rng.choice(["alpha", "tensor", "mesh", "shard", "adapter", "rank"])
        k = rng.randint(3, 30)
        q, r = f"Repeat the word {w} {k} times.", " ".join([w] * k)
      messages += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
    out.append({"messages": messages})
  return out


def prepare(out: str, size: str, seq: int, n: int) -> str:
  """Writes the checkpoint, tokenizer, conversations and cache (see the module docstring);
  returns the train_lm command."""
  cfg = llama.model_config(size, seq)
  cfg = cfg._replace(vocab=max(cfg.vocab, 512))  # room for a BPE tokenizer's merges
  model_dir, chats = os.path.join(out, "model"), os.path.join(out, "chats.jsonl")
  os.makedirs(model_dir, exist_ok=True)
  with open(chats, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(c) + "\n" for c in conversations(n))
  with open(os.path.join(out, "chat.jinja"), "w", encoding="utf-8") as f:
    f.write(TEMPLATE)
  vocab = min(4096, cfg.vocab - 12)
  train_tokenizer.train_tokenizer([chats], vocab, os.path.join(model_dir, "tokenizer.json"))
  m = hf_maps.of_model(llama, cfg)
  params = jax.jit(functools.partial(llama.init_params, cfg))(jax.random.key(0))
  fs.checkpoint.hf.export(model_dir, params, hf_maps.checkpoint_map(m), dtype="bfloat16",
                          config=hf_maps.to_config(m), max_shard_bytes=2_000_000_000)
  del params
  cache.build(cache.BuildSpec((chats,), os.path.join(out, "cache"), model_dir, chat=True,
                              chat_template=os.path.join(out, "chat.jinja")),
              say=lambda *a: None)
  return (f"python recipes/train_lm.py --init_from={model_dir} --lora_rank=16 "
          f"--dataset={os.path.join(out, 'cache')} --seq={seq} --global_batch=8 --mesh=auto "
          f"--steps=30 --log_every=5 --eval_every=30 --eval_batches=1 --sample_len=0 "
          f"--nocheckpoint --run_dir={os.path.join(out, 'run')}")


def compile_memory(size: str, target: str, seq: int, batch: int, rank: int,
                   remat: bool) -> dict:
  """XLA's per-chip memory of the LoRA step of `size` compiled for `target` (FSDP)."""
  devices = fs.topology.target_devices(target)
  cfg = llama.model_config(size, seq)
  mesh = fs.make_mesh({"fsdp": len(devices)}, devices=devices)
  base = fs.init_state(functools.partial(llama.init_params, cfg), optax.sgd(0.0), mesh=mesh,
                       rules=llama.RULES, logical_axes=llama.logical_axes(cfg),
                       key=jax.random.key(0), abstract=True).params
  base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16,
                                                     sharding=x.sharding), base)
  lora = fs.lora.LoraConfig(rank, 2.0 * rank, 0.0, llama.lora_targets(cfg))
  opt = optax.adamw(1e-4)
  state = fs.lora.init_state(base, lora, opt, key=jax.random.key(1), policy=MIXED,
                             abstract=True)
  loss = fs.lora.with_lora(functools.partial(llama.loss_fn, cfg=cfg, remat=remat), lora)
  rows = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=fs.batch_sharding(mesh))
  t, batch_ = time.time(), {"inputs": rows, "targets": rows}
  step = fs.shard_step(fs.train_step(loss, opt, policy=MIXED), mesh)
  count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
  out = dict(size=size, target=target, seq=seq, global_batch=batch, rank=rank, remat=remat,
             trainable_params=count(state.params), frozen_params=count(state.frozen),
             hbm_bytes=fs.analysis.plan.hardware(target).hbm_bytes)
  try:
    report = fs.compile_report(step.compile(state, batch_), state, batch_)
  except jax.errors.JaxRuntimeError as e:  # XLA refuses a program over the chip's HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return dict(out, fits=False, refused=str(e).splitlines()[0][:300],
                compile_s=time.time() - t)
  return dict(out, fits=True, argument_bytes=report.argument_bytes,
              temp_bytes=report.temp_bytes, peak_bytes=report.peak_bytes,
              compile_s=time.time() - t)


def main(argv=None) -> int:
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--prepare", default="", help="write a run's files into this directory")
  p.add_argument("--compile", action="store_true", help="compile for --target, print memory")
  p.add_argument("--size", default=None, help="a Llama size of recipes/lm/llama.py")
  p.add_argument("--seq", type=cli.number(int, minimum=1), default=2048)
  p.add_argument("--conversations", type=cli.number(int, minimum=1), default=3000)
  p.add_argument("--target", default="v5litepod-8")
  p.add_argument("--global_batch", type=cli.number(int, minimum=1), default=8)
  p.add_argument("--rank", type=cli.number(int, minimum=1), default=16)
  p.add_argument("--remat", action="store_true")
  args = p.parse_args(argv)
  if bool(args.prepare) == args.compile:
    raise fs.InputError("give one of --prepare=DIR and --compile")
  size = args.size or ("llama-1b" if args.prepare else "llama-8b")
  if size not in llama.SIZES:
    raise fs.InputError(f"--size={size!r}: expected one of {list(llama.SIZES)}")
  if args.prepare:
    print(prepare(args.prepare, size, args.seq, args.conversations), flush=True)
  else:
    print(json.dumps(compile_memory(size, args.target, args.seq, args.global_batch, args.rank,
                                    args.remat)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
