"""An Equinox model trained by fnscale with FSDP and tensor parallelism.

  python recipes/examples/embed_equinox.py                           # 8 simulated CPU devices
  python recipes/examples/embed_equinox.py --mesh="fsdp=2,tensor=4" --steps=500

An Equinox model is already a pytree. `eqx.partition(model, eqx.is_inexact_array)` splits it
into params (the float arrays; the same module with None elsewhere) and a static part; the
pure loss `eqx.combine`s them back. fnscale's `train_step` + `shard_step` replace
`eqx.filter_jit` + `eqx.filter_value_and_grad`. Equinox has no partitioning annotations, so
the logical axes are given by leaf path: fnscale matches each regex against the leaf's
'/'-joined attribute path (`blocks/0/up/weight`). Note Equinox's `Linear.weight` is
[out_features, in_features].

The model is a tiny pre-LayerNorm causal transformer over bytes (vocabulary 256). Equinox
layers act on one example, so the per-token layers are vmapped and attention runs batched
through `fs.attention` (the best kernel for the platform; `fs.with_kernel` scopes the choice).
The text is the running interpreter's standard library, which every Python has.
"""
from __future__ import annotations

import pathlib
import sysconfig

from absl import app
from absl import flags
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs

VOCAB = 256  # bytes
D_MODEL, HEADS, D_MLP, LAYERS, SEQ = 64, 4, 256, 2, 64
# Logical axis -> mesh axis: "embed" over fsdp shards params and optimizer state ZeRO-3 style;
# heads/mlp/vocab over tensor give Megatron-style tensor parallelism.
RULES = (("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
# Logical axes by leaf path (first match wins; unmatched leaves get automatic FSDP). Linear
# weights are [out, in].
LOGICAL_AXES = (
    (r"/(q|k|v)/weight$", ("heads", "embed")),
    (r"/o/weight$", ("embed", "heads")),
    (r"/up/weight$", ("mlp", "embed")),
    (r"/down/weight$", ("embed", "mlp")),
    (r"^embed/weight$", ("vocab", "embed")),
    (r"^head/weight$", ("vocab", "embed")),
)


def _per_token(layer, x):
  """Applies a single-vector layer to every token of x [batch, seq, features]."""
  return jax.vmap(jax.vmap(layer))(x)


class Block(eqx.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""
  ln1: eqx.nn.LayerNorm
  q: eqx.nn.Linear
  k: eqx.nn.Linear
  v: eqx.nn.Linear
  o: eqx.nn.Linear
  ln2: eqx.nn.LayerNorm
  up: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, key):
    kq, kk, kv, ko, ku, kd = jax.random.split(key, 6)
    self.ln1 = eqx.nn.LayerNorm(D_MODEL)
    self.q = eqx.nn.Linear(D_MODEL, D_MODEL, key=kq)
    # No key bias: it adds the same logit to every key of a query, so softmax ignores it.
    self.k = eqx.nn.Linear(D_MODEL, D_MODEL, use_bias=False, key=kk)
    self.v = eqx.nn.Linear(D_MODEL, D_MODEL, key=kv)
    self.o = eqx.nn.Linear(D_MODEL, D_MODEL, key=ko)
    self.ln2 = eqx.nn.LayerNorm(D_MODEL)
    self.up = eqx.nn.Linear(D_MODEL, D_MLP, key=ku)
    self.down = eqx.nn.Linear(D_MLP, D_MODEL, key=kd)

  def __call__(self, x):  # x: [batch, seq, D_MODEL]
    x = fs.constrain_batch(x)  # keep activations split by batch, not by FSDP params
    b, s, _ = x.shape
    h = _per_token(self.ln1, x)
    split = lambda t: t.reshape(b, s, HEADS, D_MODEL // HEADS)
    q, k, v = (split(_per_token(f, h)) for f in (self.q, self.k, self.v))
    a = fs.attention(q, k, v, causal=True)
    x = x + _per_token(self.o, a.reshape(b, s, D_MODEL))
    h = jax.nn.gelu(_per_token(self.up, _per_token(self.ln2, x)))
    return x + _per_token(self.down, h)


class ByteLM(eqx.Module):
  """Byte-level causal language model: tokens int32 [batch, seq] -> logits [batch, seq, 256]."""
  embed: eqx.nn.Embedding
  pos: jax.Array
  blocks: list
  ln_f: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    ke, kp, kh, *kb = jax.random.split(key, 3 + LAYERS)
    self.embed = eqx.nn.Embedding(
        weight=0.02 * jax.random.normal(ke, (VOCAB, D_MODEL), jnp.float32))
    self.pos = 0.02 * jax.random.normal(kp, (SEQ, D_MODEL), jnp.float32)
    self.blocks = [Block(k) for k in kb]
    self.ln_f = eqx.nn.LayerNorm(D_MODEL)
    self.head = eqx.nn.Linear(D_MODEL, VOCAB, key=kh)

  def __call__(self, tokens):
    x = self.embed.weight[tokens] + self.pos[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return _per_token(self.head, _per_token(self.ln_f, x))


def model_loss(model: ByteLM, batch) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of `batch["tokens"]`, int32 [batch, SEQ + 1]."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _is_param(x) -> bool:
  # Float arrays are trained; abstract ones (from eval_shape) count too, so the static part
  # can be taken from shapes alone.
  if isinstance(x, jax.ShapeDtypeStruct):
    return jnp.issubdtype(x.dtype, jnp.inexact)
  return eqx.is_inexact_array(x)


def static_part() -> ByteLM:
  """The non-trainable part of `ByteLM` (everything but its float arrays), from shapes only."""
  return eqx.partition(eqx.filter_eval_shape(ByteLM, jax.random.key(0)), _is_param)[1]


def init_params(key: jax.Array) -> ByteLM:
  """The float arrays of a fresh `ByteLM` (the module with None elsewhere); jit-able, so it
  can run born sharded inside `fs.init_state`."""
  return eqx.partition(ByteLM(key), _is_param)[0]


def make_loss_fn(static: ByteLM):
  """A pure `loss_fn(params, batch) -> loss`."""

  def loss_fn(params, batch):
    return model_loss(eqx.combine(params, static), batch)

  return loss_fn


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

  `params` is the final params part of the model (combine it with `static_part()` to get
  the module), each array a jax.Array sharded as `RULES` map `LOGICAL_AXES` (other leaves:
  fnscale's automatic FSDP).
  """
  mesh = fs.make_mesh(mesh_axes)
  opt = optimizer()
  # The loss sees fs.attention: with_kernel picks its kernel ("auto": the platform's best).
  step = fs.train_step(fs.with_kernel(make_loss_fn(static_part()), attention="auto"), opt)
  step = fs.shard_step(step, mesh, rules=RULES, logical_axes=LOGICAL_AXES)
  data = corpus()
  losses = []
  with fs.with_mesh(mesh):
    state = fs.init_state(init_params, opt, mesh=mesh, rules=RULES, logical_axes=LOGICAL_AXES,
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
                           logical_axes=LOGICAL_AXES))
  print(f"final loss {losses[-1]:.4f} nats/byte after {cfg.steps} steps")


if __name__ == "__main__":
  # Defined here, not at import, so tests can import several recipes in one process.
  flags.DEFINE_integer("steps", 300, "training steps")
  flags.DEFINE_string("mesh", "fsdp=4,tensor=2", "mesh axes, e.g. 'fsdp=2,tensor=4'")
  flags.DEFINE_integer("log_every", 25, "print the loss every this many steps")
  app.run(main)
