"""A Flax Linen model with its own logical partitioning, trained by fnscale (FSDP + tensor).

  python recipes/examples/embed_flax_linen.py                        # 8 simulated CPU devices
  python recipes/examples/embed_flax_linen.py --mesh="fsdp=2,tensor=4" --steps=500

The model annotates its params the Linen way, `nn.with_logical_partitioning(init, names)`, so
`model.init` returns `nn.LogicallyPartitioned` boxes that carry logical axis names ("embed",
"mlp", ...). fnscale reads those names (`fs.adapters.unbox_flax`, which also unboxes the arrays) and
maps them onto mesh axes with its own `RULES`, in the role Linen's `nn.logical_axis_rules`
plays elsewhere; the same rule pairs work for both. Unannotated params (biases, LayerNorm
scales) get fnscale's automatic FSDP. The loss is the pure `model.apply({"params": p}, ...)`,
and fnscale's `train_step` + `shard_step` replace flax's `TrainState` + `jax.jit`.

The model is a tiny pre-LayerNorm causal transformer over bytes (vocabulary 256) whose
attention is `fs.attention` (the best kernel for the platform; `fs.with_kernel` scopes the
choice). The text is the running interpreter's standard library, which every Python has.
"""
from __future__ import annotations

import pathlib
import sysconfig

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs

VOCAB = 256  # bytes
D_MODEL, HEADS, D_MLP, LAYERS, SEQ = 64, 4, 256, 2, 64
# Logical axis -> mesh axis, in the format of flax's `nn.logical_axis_rules`: "embed" over fsdp
# shards params and optimizer state ZeRO-3 style; heads/mlp/vocab over tensor give
# Megatron-style tensor parallelism.
RULES = (("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))


def _dense(features: int, names: tuple, name: str, use_bias: bool = True) -> nn.Dense:
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
  return nn.Dense(features, use_bias=use_bias, kernel_init=init, name=name)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

  @nn.compact
  def __call__(self, x):  # x: [batch, seq, D_MODEL]
    x = fs.constrain_batch(x)  # keep activations split by batch, not by FSDP params
    b, s, _ = x.shape
    h = nn.LayerNorm(name="ln1")(x)
    split = lambda t: t.reshape(b, s, HEADS, D_MODEL // HEADS)
    q = split(_dense(D_MODEL, ("embed", "heads"), "q")(h))
    # No key bias: it adds the same logit to every key of a query, so softmax ignores it.
    k = split(_dense(D_MODEL, ("embed", "heads"), "k", use_bias=False)(h))
    v = split(_dense(D_MODEL, ("embed", "heads"), "v")(h))
    a = fs.attention(q, k, v, causal=True)
    x = x + _dense(D_MODEL, ("heads", "embed"), "o")(a.reshape(b, s, D_MODEL))
    h = nn.gelu(_dense(D_MLP, ("embed", "mlp"), "up")(nn.LayerNorm(name="ln2")(x)))
    return x + _dense(D_MODEL, ("mlp", "embed"), "down")(h)


class ByteLM(nn.Module):
  """Byte-level causal language model: tokens int32 [batch, seq] -> logits [batch, seq, 256]."""

  @nn.compact
  def __call__(self, tokens):
    normal = nn.initializers.normal(0.02)
    embed = nn.Embed(VOCAB, D_MODEL, name="embed",
                     embedding_init=nn.with_logical_partitioning(normal, ("vocab", "embed")))
    pos = self.param("pos", nn.with_logical_partitioning(normal, (None, "embed")), (SEQ, D_MODEL))
    x = embed(tokens) + pos[: tokens.shape[1]]
    for i in range(LAYERS):
      x = Block(name=f"block_{i}")(x)
    return _dense(VOCAB, ("embed", "vocab"), "head")(nn.LayerNorm(name="ln_f")(x))


MODEL = ByteLM()


def loss_fn(params, batch) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of `batch["tokens"]`, int32 [batch, SEQ + 1];
  `params` is the unboxed Linen params dict."""
  tokens = batch["tokens"]
  logits = MODEL.apply({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def init_variables(key: jax.Array):
  """Linen variables with `nn.LogicallyPartitioned` boxes, as `model.init` returns them."""
  return MODEL.init(key, jnp.zeros((1, SEQ), jnp.int32))


def init_params(key: jax.Array):
  """Unboxed float32 params (jit-able, so it can run born sharded inside `fs.init_state`)."""
  params, _ = fs.adapters.unbox_flax(init_variables(key)["params"])
  return params


def logical_axes():
  """fnscale logical axes of the params, read from the annotations of an abstract init."""
  _, axes = fs.adapters.unbox_flax(jax.eval_shape(init_variables, jax.random.key(0))["params"])
  return axes


def optimizer() -> optax.GradientTransformation:
  return optax.adam(3e-3)


def corpus(max_bytes: int = 1 << 20) -> np.ndarray:
  """uint8 bytes of the standard library's sources (sorted paths, so every run agrees)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    chunks.append(path.read_bytes())
    total += len(chunks[-1])
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def get_batch(data: np.ndarray, step: int, batch_size: int = 16, seed: int = 0) -> dict:
  """Random windows of SEQ + 1 bytes: {"tokens": int32 [batch_size, SEQ + 1]}, a pure
  function of (seed, step)."""
  starts = np.random.default_rng([seed, step]).integers(0, len(data) - SEQ - 1, batch_size)
  return {"tokens": np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int32)}


def train(steps: int, mesh_axes: str = "fsdp=4,tensor=2", *, seed: int = 0,
          batch_size: int = 16, log_every: int = 0):
  """Trains `ByteLM` for `steps` steps on a mesh; returns (losses: list of float, params).

  `params` is the final Linen params dict, each leaf a jax.Array sharded as `RULES` map its
  annotations (unannotated leaves: fnscale's automatic FSDP).
  """
  mesh = fs.make_mesh(mesh_axes)
  axes = logical_axes()
  opt = optimizer()
  # The loss sees fs.attention: with_kernel picks its kernel ("auto": the platform's best).
  step = fs.train_step(fs.with_kernel(loss_fn, attention="auto"), opt)
  step = fs.shard_step(step, mesh, rules=RULES, logical_axes=axes)
  data = corpus()
  losses = []
  with fs.with_mesh(mesh):
    state = fs.init_state(init_params, opt, mesh=mesh, rules=RULES, logical_axes=axes,
                          key=jax.random.key(seed))
    for i in range(steps):
      batch = jax.device_put(get_batch(data, i, batch_size, seed), fs.batch_sharding(mesh))
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
      if log_every and (i % log_every == 0 or i == steps - 1):
        print(f"step {i:5d}  loss {losses[-1]:.4f} nats/byte")
  return losses, state.params


def main(argv):
  del argv
  cfg = flags.FLAGS
  fs.simulate_cpu_devices(8)  # before any jax computation; no-op on TPU/GPU machines
  losses, params = train(cfg.steps, cfg.mesh, log_every=cfg.log_every)
  # Where the annotations put each param: logical axes -> PartitionSpec on the mesh.
  print(fs.sharding_report(params, jax.tree.map(lambda x: x.sharding, params),
                           logical_axes=logical_axes()))
  print(f"final loss {losses[-1]:.4f} nats/byte after {cfg.steps} steps")


if __name__ == "__main__":
  # Defined here, not at import, so tests can import several recipes in one process.
  flags.DEFINE_integer("steps", 300, "training steps")
  flags.DEFINE_string("mesh", "fsdp=4,tensor=2", "mesh axes, e.g. 'fsdp=2,tensor=4'")
  flags.DEFINE_integer("log_every", 25, "print the loss every this many steps")
  app.run(main)
