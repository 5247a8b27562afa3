"""A GPT-2-style decoder as a plain pytree and pure functions (the model of `train_lm.py`).

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners": pre-LayerNorm
blocks, learned positions, GELU MLP and an output layer tied to the token embedding. Every param
carries logical axis names that fnscale's rules map onto the mesh.

The model-module interface `train_lm.py` relies on (a Llama module offers the same names):
`ModelConfig` (a NamedTuple with at least `layers, d_model, heads, seq, vocab`), `SIZES`,
`model_config(size, seq)`, `init_params(cfg, key)`, `logical_axes(cfg)`, `RULES`,
`apply(params, tokens, *, remat)`, `loss_fn(params, batch, *, remat)`, `matmul_params(cfg)`,
`flops_per_token(cfg)`; a batch is {"inputs", "targets"}: int32 [batch, seq], plus optional
"segment_ids" and "positions" (int32 [batch, seq]: packed rows, `packing.py`, or the order of
a sequence split over a "context" mesh axis, `fnscale.parallel.context.reorder_batch`) and
"weights" (float32 [batch, seq], the loss weight of each target).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import fnscale as fs
from fnscale.analysis import flops
from recipes.lm import int8, remat as remat_lib

VOCAB = 256  # bytes; a tokenizer's vocabulary replaces it (`cfg._replace(vocab=n)`)
REMAT_POLICIES = remat_lib.POLICIES  # what `remat=` takes besides True / False


class ModelConfig(NamedTuple):
  """Shape of the decoder. d_mlp is 4 * d_model as in GPT-2. `positions`: rows of the learned
  position table (GPT-2's n_positions, 1024); 0: `seq`. `int8`: the blocks' projections and
  MLP multiply in int8 (`recipes.lm.int8.dense`); `unroll`: the layer loop unrolled instead of
  one `lax.scan` body."""
  layers: int
  d_model: int
  heads: int
  seq: int
  vocab: int = VOCAB
  positions: int = 0
  int8: bool = False
  unroll: bool = False

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def d_mlp(self) -> int:
    return 4 * self.d_model


# GPT-2 small and medium shapes (Radford et al. 2019); with a byte vocabulary their embedding
# tables are tiny, so `small` has 86M params rather than GPT-2's 124M (50257-token vocabulary).
# `tiny_gpt2` is the same layout at a size that trains in minutes on a 2-core CPU.
SIZES = {
    "nano": dict(layers=2, d_model=64, heads=4),
    "tiny_gpt2": dict(layers=4, d_model=128, heads=4),
    "tiny": dict(layers=4, d_model=256, heads=4),
    "small": dict(layers=12, d_model=768, heads=12),
    "medium": dict(layers=24, d_model=1024, heads=16),
}


def model_config(size: str, seq: int) -> ModelConfig:
  """The config of a named size at sequence length `seq` (tokens).

  Raises:
    FnscaleError: an unknown size (the message lists the known ones).
  """
  if size not in SIZES:
    raise fs.InputError(f"model_config={size!r} is not a known GPT size; expected one of "
                          f"{list(SIZES)}")
  return ModelConfig(seq=seq, **SIZES[size])


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Returns float32 params; block params are stacked along a leading `layers` axis for scan.

  Init follows GPT-2: N(0, 0.02) weights, residual output projections scaled by
  1/sqrt(2 * layers), zero biases, unit LayerNorm scales.
  """
  L, D, H, K, F = cfg.layers, cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_mlp
  ks = jax.random.split(key, 6)
  std, res_std = 0.02, 0.02 / math.sqrt(2 * L)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
  ln = lambda: {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))}
  return {
      "wte": normal(ks[0], (cfg.vocab, D), std),
      "wpe": normal(ks[1], (cfg.positions or cfg.seq, D), std),
      "blocks": {
          "ln1": ln(),
          "attn": {
              "w_qkv": normal(ks[2], (L, D, 3, H, K), std),
              "b_qkv": jnp.zeros((L, 3, H, K)),
              "w_out": normal(ks[3], (L, H, K, D), res_std),
              "b_out": jnp.zeros((L, D)),
          },
          "ln2": ln(),
          "mlp": {
              "w_fc": normal(ks[4], (L, D, F), std),
              "b_fc": jnp.zeros((L, F)),
              "w_proj": normal(ks[5], (L, F, D), res_std),
              "b_proj": jnp.zeros((L, D)),
          },
      },
      "ln_f": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
  }


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  del cfg
  ln = {"scale": ("layers", "norm"), "bias": ("layers", "norm")}
  return {
      "wte": ("vocab", "embed"),
      "wpe": ("position", "embed"),
      "blocks": {
          "ln1": ln,
          "attn": {
              "w_qkv": ("layers", "embed", "qkv", "heads", "head_dim"),
              "b_qkv": ("layers", "qkv", "heads", "head_dim"),
              "w_out": ("layers", "heads", "head_dim", "embed"),
              "b_out": ("layers", "norm"),
          },
          "ln2": ln,
          "mlp": {
              "w_fc": ("layers", "embed", "mlp"),
              "b_fc": ("layers", "mlp"),
              "w_proj": ("layers", "mlp", "embed"),
              "b_proj": ("layers", "norm"),
          },
      },
      "ln_f": {"scale": ("norm",), "bias": ("norm",)},
  }


# Logical axis -> mesh axes. "embed" over fsdp gives ZeRO-3-style sharded params and optimizer
# state; heads/mlp/vocab over tensor give Megatron-style tensor parallelism (Shoeybi et al. 2019).
# Under a "context" axis (the sequence split) params are split over it as over fsdp.
RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp", "context")),
    ("embed", "fsdp"),
    ("embed", "context"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def _layer_norm(x, p, eps=1e-5):
  # Statistics in float32 whatever the compute dtype, for stability under bfloat16.
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _block(x, p, segment_ids=None, int8_matmuls: bool = False):
  """One pre-LN transformer block. x: [batch, seq, d_model]; segment_ids: None or int32
  [batch, seq] (a token attends only within its segment); int8_matmuls: the four weight
  matmuls in int8 (`recipes.lm.int8.dense`)."""
  # Keep the residual stream split by batch; otherwise GSPMD may follow the FSDP params'
  # d_model sharding and run attention for the whole batch on every device.
  x = fs.constrain_batch(x)
  h = _layer_norm(x, p["ln1"])
  a = p["attn"]
  if int8_matmuls:
    qkv = jnp.moveaxis(int8.dense(h, a["w_qkv"]), 2, 0) + a["b_qkv"][:, None, None]
  else:
    qkv = jnp.einsum("bsd,dthk->tbshk", h, a["w_qkv"]) + a["b_qkv"][:, None, None]
  q, k, v = (remat_lib.name_qkv(t) for t in (qkv[0], qkv[1], qkv[2]))
  o = fs.attention(q, k, v, causal=True, segment_ids=segment_ids)
  mm = int8.dense if int8_matmuls else jnp.tensordot
  x = x + mm(o, a["w_out"], 2) + a["b_out"]
  h = _layer_norm(x, p["ln2"])
  m = p["mlp"]
  h = jax.nn.gelu(mm(h, m["w_fc"], 1) + m["b_fc"])
  return x + mm(h, m["w_proj"], 1) + m["b_proj"]


def embed_lookup(table: jax.Array, tokens: jax.Array, rules=None) -> jax.Array:
  """`table[tokens]` ([vocab, d] at int [batch, seq] -> [batch, seq, d]), batch-split, with
  only token ids and activations crossing devices: the table is never gathered.

  `rules`: the model's logical rules (default this module's `RULES`), which split the table
  ("vocab", "embed"): d over the FSDP-like axes (fsdp, expert, context), vocab over
  "tensor". Under a mesh the lookup runs in a `jax.shard_map` over the axes the trace sees
  whole. Each device all-gathers the token ids of the devices that hold the table's other
  columns (and other tokens: int32, over d's axes that split the batch rows, along the
  rows; over those that split the sequence, along it), looks them up in its own
  [vocab / tensor, d / ...] block (ids outside the block give 0, summed over "tensor"), and
  all-to-alls turn the result back into this device's tokens with every column, the minor
  axis of d first. The backward pass is the same in reverse: all-to-alls of the
  activations' gradient and a local scatter-add into the table's block. Left to the
  partitioner (`table[tokens]`, one mesh axis on two dims of the gather), jax 0.10.2's GSPMD
  replicates the output ("[SPMD] Involuntary full rematerialization"); gathering the table's
  d first (what FSDP does for a weight) moves the whole table forward and its whole gradient
  backward. Inside a `shard_map` that is manual over the data axes the ids are already local
  and the table whole there: a plain lookup.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return table[tokens]
  manual = set(mesh.manual_axes)
  free = lambda names: tuple(a for a in names if a in mesh.axis_names and a not in manual
                             and mesh.shape[a] > 1)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  rows = free(fs.sharding.data_axes(mesh))  # the batch's axes (with "stage", if any)
  if tokens.shape[0] % size(rows):
    rows = ()
  seq = free(("context",))  # a sequence split over it stays split
  if tokens.shape[1] % size(seq):
    seq = ()
  spec = fs.sharding.logical_to_spec(("vocab", "embed"), RULES if rules is None else rules, mesh)
  runs = _column_runs(free(_axes_of(spec[1])), rows, seq, table.shape[1], mesh.shape)
  # Vocabulary blocks are summed over their axes: never over axes that split the tokens.
  vocab = tuple(a for a in free(_axes_of(spec[0])) if a not in rows + seq)
  if table.shape[0] % size(vocab):
    vocab = ()
  if not rows and not vocab:
    return fs.constrain_batch(table[tokens])

  def local(table, tokens):
    for axes, dim in sorted(runs, key=lambda r: size(r[0])):  # the smaller gather first
      tokens = jax.lax.all_gather(tokens, axes, axis=dim, tiled=True)
    if vocab:  # this device's vocabulary rows start at its index along "tensor"
      ids = tokens - jax.lax.axis_index(vocab) * table.shape[0]
      inside = (ids >= 0) & (ids < table.shape[0])
      x = jnp.where(inside[..., None], table[jnp.clip(ids, 0, table.shape[0] - 1)], 0)
      x = jax.lax.psum(x, vocab)
    else:
      x = table[tokens]
    for axes, dim in reversed(runs):  # [.., tokens x n, .., d / n] -> [.., tokens, .., d]
      x = jax.lax.all_to_all(x, axes, split_axis=dim, concat_axis=2, tiled=True)
    return x

  columns = tuple(a for axes, _ in runs for a in axes)
  table_spec, token_spec = P(_spec(vocab), _spec(columns)), P(_spec(rows), _spec(seq))
  if set(free(mesh.axis_names)) & set(getattr(mesh, "explicit_axes", ())):
    # Explicit axes: shard_map takes only arrays already split as its specs say.
    table = jax.sharding.reshard(table, table_spec)
    tokens = jax.sharding.reshard(tokens, token_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, token_spec),
                       out_specs=P(_spec(rows), _spec(seq), None), axis_names=frozenset(
                           free(mesh.axis_names)), check_vma=True)(table, tokens)


def _column_runs(columns: tuple[str, ...], rows: tuple[str, ...], seq: tuple[str, ...],
                 width: int, sizes) -> tuple:
  """The table's column (d) axes as runs of (axes, token dim): consecutive axes that split
  the batch rows (dim 0) or the sequence (dim 1), at most one run per dim, their sizes'
  product dividing `width` (d). The columns from the first axis that fits none of these on
  are whole inside the lookup (gathered on entry)."""
  runs: list[tuple[tuple[str, ...], int]] = []
  split = 1
  for a in columns:
    dim = 0 if a in rows else 1 if a in seq else None
    split *= sizes[a]
    if (dim is None or width % split
        or (runs and runs[-1][1] != dim and any(d == dim for _, d in runs))):
      break
    if runs and runs[-1][1] == dim:
      runs[-1] = (runs[-1][0] + (a,), dim)
    else:
      runs.append(((a,), dim))
  return tuple(runs)


def _axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(axes: tuple[str, ...]):
  """A PartitionSpec entry for mesh axes: None, one name, or a tuple."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def check_positions(positions) -> None:
  """Under a mesh whose "context" axis splits the sequence, a model must be given each
  token's position: the shards hold the sequence reordered, so 0..seq-1 would be wrong.

  Raises:
    FnscaleError: no positions under a context axis of size > 1.
  """
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1 if mesh.empty else fs.parallel.context.shards(mesh)
  if positions is None and shards > 1:
    raise fs.InputError(
        f"the mesh splits the sequence over its context axes ({shards} shards) and the "
        "batch has no 'positions'; fix: pass the batch through "
        "fnscale.parallel.context.reorder_batch(batch, mesh, order) (it adds them) before "
        "fnscale.global_batch.")


def apply(params: dict, tokens: jax.Array, *, remat: bool | str = False,
          cfg: ModelConfig | None = None, segment_ids=None, positions=None) -> jax.Array:
  """Next-token logits. tokens: int32 [batch, seq <= cfg.seq] -> float32 [batch, seq, vocab].

  Packed rows: `segment_ids` (int32 [batch, seq]) keep attention inside each document and
  `positions` (int32 [batch, seq], from 0 in each document) index the learned positions; by
  default one document per row, positions 0..seq-1.

  Computes in the dtype of `params` (a precision policy casts them); LayerNorm statistics and
  logits are float32. Blocks run under `lax.scan` over the stacked layer axis (one compiled
  block whatever the depth); `remat` trades FLOPs for memory: what each block saves for the
  backward pass, a policy of `recipes.lm.remat` (True: "full", recompute the whole block;
  False: "none"; "dots": keep the matmul outputs, ...). `cfg`: its `int8` and `unroll`
  choices (default neither); GPT-2's shapes come from the params. `positions`,
  `segment_ids`: int [batch, seq] (default 0..seq-1, one sequence per row); positions are
  required under a context axis (`check_positions`).
  """
  seq = tokens.shape[1]
  check_positions(positions)
  pos = params["wpe"][:seq] if positions is None else jnp.take(params["wpe"], positions, 0)
  x = embed_lookup(params["wte"], tokens) + pos
  block = functools.partial(_block, segment_ids=segment_ids,
                            int8_matmuls=cfg is not None and cfg.int8)
  block = remat_lib.checkpointed(block, remat)
  x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"],
                      unroll=cfg is not None and cfg.unroll)
  x = _layer_norm(x, params["ln_f"])
  return jnp.einsum("bsd,vd->bsv", x, params["wte"]).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, *, remat: bool | str = False,
            cfg: ModelConfig | None = None, weighted: bool = False):
  """Mean next-token cross-entropy in nats. batch: {"inputs", "targets"} int32 [batch, seq],
  ids in [0, cfg.vocab): an id outside gives a nan or wrong loss, not an error (jit cannot
  raise on values); check data of your own with `data.check_token_ids(batch, cfg.vocab)`.
  Packed batches add "segment_ids" and "positions" (see `apply`).

  weighted=True (for `fnscale.train_step(..., weighted=True)`): returns (sum over targets of
  weight x cross-entropy, sum of weights) with batch["weights"] (float32 [batch, seq]; 0 on
  padding and on targets without loss; default all 1), so the step divides by the weight of
  the whole batch, whatever the mesh or accumulation."""
  logits = apply(params, batch["inputs"], remat=remat, cfg=cfg,
                 segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  if not weighted:
    return ce.mean()
  w = batch.get("weights", jnp.ones(ce.shape, jnp.float32)).astype(jnp.float32)
  return jnp.sum(ce * w), jnp.sum(w)


def matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations: 12 d^2 per block (qkv, out, 2 MLP) plus the tied
  output layer; embedding lookups and positions are not matmuls."""
  return cfg.layers * 12 * cfg.d_model**2 + cfg.vocab * cfg.d_model


def flops_per_token(cfg: ModelConfig) -> float:
  """Training FLOPs per token (forward + backward): `fnscale.analysis.flops.model_flops_per_token`
  (PaLM appendix B) for this model. Remat's recomputation is not counted (MFU, not hardware
  utilisation)."""
  return flops.model_flops_per_token(params=matmul_params(cfg), layers=cfg.layers,
                                     d_model=cfg.d_model, seq=cfg.seq)


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
