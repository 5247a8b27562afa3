"""A Flax NNX model trained by fnscale with FSDP and tensor parallelism.

  python recipes/examples/embed_flax_nnx.py                          # 8 simulated CPU devices
  python recipes/examples/embed_flax_nnx.py --mesh="fsdp=2,tensor=4" --steps=500

fnscale needs only a pytree of params and a loss function, so an NNX model joins in three
moves: `nnx.split` the module into a graph definition and a `State`; read the
`nnx.with_partitioning` annotations into fnscale logical axes (`fs.adapters.unbox_flax`, which also
turns the State into a pure dict of arrays); and write the loss as a pure function that
`nnx.merge`s the params back into a module. NNX's own `nnx.Optimizer` and `nnx.jit` are not
used: fnscale's `train_step` applies the optax optimizer and `shard_step` compiles one SPMD
program for the mesh. The annotations are logical names ("embed", "mlp", ...) mapped onto
mesh axes by `RULES`; flax's eager sharding is off, so fnscale alone places every array.

The model is a tiny pre-LayerNorm causal transformer over bytes (vocabulary 256) whose
attention is `fs.attention` (the best kernel for the platform; `fs.with_kernel` scopes the
choice). The text is the running interpreter's standard library, which every Python has.
"""
from __future__ import annotations

import pathlib
import sysconfig

from absl import app
from absl import flags
from flax import nnx
import jax
import numpy as np
import optax

import fnscale as fs

VOCAB = 256  # bytes
D_MODEL, HEADS, D_MLP, LAYERS, SEQ = 64, 4, 256, 2, 64
# Logical axis -> mesh axis: "embed" over fsdp shards params and optimizer state ZeRO-3 style;
# heads/mlp/vocab over tensor give Megatron-style tensor parallelism.
RULES = (("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))


def _init(names, init=nnx.initializers.lecun_normal()):
  # eager_sharding=False: keep the names as metadata only; fnscale places the arrays.
  return nnx.with_partitioning(init, names, eager_sharding=False)


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

  def __init__(self, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
    self.q = nnx.Linear(D_MODEL, D_MODEL, kernel_init=_init(("embed", "heads")), rngs=rngs)
    # No key bias: it adds the same logit to every key of a query, so softmax ignores it.
    self.k = nnx.Linear(D_MODEL, D_MODEL, use_bias=False, kernel_init=_init(("embed", "heads")),
                        rngs=rngs)
    self.v = nnx.Linear(D_MODEL, D_MODEL, kernel_init=_init(("embed", "heads")), rngs=rngs)
    self.o = nnx.Linear(D_MODEL, D_MODEL, kernel_init=_init(("heads", "embed")), rngs=rngs)
    self.ln2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
    self.up = nnx.Linear(D_MODEL, D_MLP, kernel_init=_init(("embed", "mlp")), rngs=rngs)
    self.down = nnx.Linear(D_MLP, D_MODEL, kernel_init=_init(("mlp", "embed")), rngs=rngs)

  def __call__(self, x):  # x: [batch, seq, D_MODEL]
    x = fs.constrain_batch(x)  # keep activations split by batch, not by FSDP params
    b, s, _ = x.shape
    h = self.ln1(x)
    split = lambda t: t.reshape(b, s, HEADS, D_MODEL // HEADS)
    a = fs.attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), causal=True)
    x = x + self.o(a.reshape(b, s, D_MODEL))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class ByteLM(nnx.Module):
  """Byte-level causal language model: tokens int32 [batch, seq] -> logits [batch, seq, 256]."""

  def __init__(self, rngs: nnx.Rngs):
    normal = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB, D_MODEL, embedding_init=_init(("vocab", "embed"), normal),
                           rngs=rngs)
    self.pos = nnx.Param(normal(rngs.params(), (SEQ, D_MODEL)))  # unannotated: auto-FSDP
    self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.ln_f = nnx.LayerNorm(D_MODEL, rngs=rngs)
    self.head = nnx.Linear(D_MODEL, VOCAB, kernel_init=_init(("embed", "vocab")), rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def model_loss(model: ByteLM, batch) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of `batch["tokens"]`, int32 [batch, SEQ + 1]."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def split_model():
  """The graph definition and fnscale logical axes of `ByteLM`, from shapes only."""
  # Filtering by nnx.Param alone fails loudly if the model ever holds other state (batch
  # statistics, RNG counters), which a pure params pytree could not carry.
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ByteLM(nnx.Rngs(0))), nnx.Param)
  _, logical_axes = fs.adapters.unbox_flax(abstract)
  return graphdef, logical_axes


def init_params(key: jax.Array):
  """Params of a fresh `ByteLM` as a pure dict of float32 arrays (jit-able, so it can run
  born sharded inside `fs.init_state`)."""
  params, _ = fs.adapters.unbox_flax(nnx.split(ByteLM(nnx.Rngs(key)), nnx.Param)[1])
  return params


def make_loss_fn(graphdef):
  """A pure `loss_fn(params, batch) -> loss` over the pure-dict params."""

  def loss_fn(params, batch):
    return model_loss(nnx.merge(graphdef, params), batch)

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

  `params` is the final pure dict of params, each a jax.Array sharded as `RULES` map its
  annotations (unannotated leaves: fnscale's automatic FSDP).
  """
  mesh = fs.make_mesh(mesh_axes)
  graphdef, logical_axes = split_model()
  opt = optimizer()
  # The loss sees fs.attention: with_kernel picks its kernel ("auto": the platform's best).
  step = fs.train_step(fs.with_kernel(make_loss_fn(graphdef), attention="auto"), opt)
  step = fs.shard_step(step, mesh, rules=RULES, logical_axes=logical_axes)
  data = corpus()
  losses = []
  with fs.with_mesh(mesh):
    state = fs.init_state(init_params, opt, mesh=mesh, rules=RULES, logical_axes=logical_axes,
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
                           logical_axes=split_model()[1]))
  print(f"final loss {losses[-1]:.4f} nats/byte after {cfg.steps} steps")


if __name__ == "__main__":
  # Defined here, not at import, so tests can import several recipes in one process.
  flags.DEFINE_integer("steps", 300, "training steps")
  flags.DEFINE_string("mesh", "fsdp=4,tensor=2", "mesh axes, e.g. 'fsdp=2,tensor=4'")
  flags.DEFINE_integer("log_every", 25, "print the loss every this many steps")
  app.run(main)
