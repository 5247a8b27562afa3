"""Continuing a prompt with a trained model: greedy or sampled, in one jitted loop."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fnscale as fs


class Sampling(NamedTuple):
  """How `generate` continues a prompt: `length` new tokens, each predicted from the last
  `seq`; greedy at `temperature` 0, else sampled (key `seed`); `attention`: the kernel."""
  length: int
  seq: int
  temperature: float
  seed: int
  attention: str = "auto"


def generate(apply_fn, params: dict, prompt: list[int], how: Sampling) -> list[int]:
  """Continues `prompt` (token ids) by `how.length` tokens: greedy at temperature 0, else
  sampled.

  Model-agnostic (`apply_fn(params, tokens, positions=)` -> logits [batch, seq, vocab]). Each
  new token is predicted from the last `seq` tokens (a sliding window; a model this small
  needs no KV cache), all in one jitted `lax.fori_loop`. Every process must call it (params may be sharded
  across processes); all get the same tokens.
  """
  length, seq, temperature, seed, attention = how
  prompt = list(prompt or [0])[-seq:]
  p = len(prompt)
  total = max(seq, p + length)
  buf = np.zeros((1, total), np.int32)
  buf[0, :p] = prompt
  mesh = jax.tree.leaves(params)[0].sharding.mesh

  def _run(params):
    def body(pos, carry):
      tokens, key = carry
      start = jnp.clip(pos - seq, 0, total - seq)
      window = jax.lax.dynamic_slice(tokens, (0, start), (1, seq))
      # Positions given: under a mesh that splits the sequence a model asks for them.
      logits = apply_fn(params, window, positions=jnp.arange(seq, dtype=jnp.int32)[None])[0]
      logits = jax.lax.dynamic_index_in_dim(logits, pos - 1 - start, keepdims=False)
      key, sub = jax.random.split(key)
      if temperature > 0:
        nxt = jax.random.categorical(sub, logits / temperature)
      else:
        nxt = jnp.argmax(logits)
      return tokens.at[0, pos].set(nxt.astype(jnp.int32)), key

    init = (jnp.asarray(buf), jax.random.key(seed))
    return jax.lax.fori_loop(p, p + length, body, init)[0]

  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # A window is in sequence order, whatever order training fed a context axis.
  run = jax.jit(fs.with_kernel(_run, attention=attention, context_order="contiguous"),
                out_shardings=replicated)
  out = np.asarray(run(params).addressable_data(0))
  return out[0, p:p + length].tolist()
