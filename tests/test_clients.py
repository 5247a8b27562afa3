"""The clients tier: published JAX model packages, wrapped unchanged, train like one device.

`python -m pytest -q -m clients` with the `clients` extra installed (README: Tests). Each
package's own classes build a small random config of its model, trained with the loss its
users write for it (token cross-entropy masked by pads or by the masked-LM positions and
divided by their count) and optax's adamw, wrapped as README's first step shows:
`fs.make_mesh`, `fs.init_state`, `fs.train_step(loss_fn, opt, accum_steps=...)`,
`fs.shard_step`. Three steps on 8 simulated devices must give the losses and params of the
same loss trained on one device by a hand-written `jax.jit` step with optax (the full batch's
gradient), with some param split over the mesh.

- recurrentgemma (Flax Linen): `Griffin`, one recurrent and one local-attention block; its
  params carry no partitioning boxes, so automatic FSDP, on fsdp=8 and data=2,fsdp=4.
- penzai: a Llama-like `TransformerLM` (`llamalike_common`), params from `pz.unbind_params`,
  the loss written as penzai's `basic_training.LossFunction`; on the tensor mesh its named
  axes ("embedding", "neurons", "heads", "vocabulary") are the logical axes.
- esm2quinox (Equinox): the `ESM2` masked language model, params from `eqx.partition`; on the
  tensor mesh logical axes by leaf path, Equinox having no sharding metadata.
- mamba2-jax (Flax NNX): `Mamba2ForCausalLM` with its own loss (an unmasked mean), params
  from `nnx.split`; no sharding metadata, so automatic FSDP.

Rows of different lengths give the microbatches different token counts, so with accumulation
a mean of microbatch means would not be the batch's mean: the masked mean as written must be
summed exactly, and so must its `(sum, count)` form with `weighted=True`. Each test wraps a
client built afresh, as a new process would: ESM2's rotary embedding computes its table
eagerly at its first trace (`jax.ensure_compile_time_eval`), which may be inside the step's
per-shard accumulation loop.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import sys
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

pytestmark = pytest.mark.clients

STEPS, BATCH, SEQ, VOCAB = 3, 16, 8, 128
FSDP = {"fsdp": 8}
DATA_FSDP = {"data": 2, "fsdp": 4}
TENSOR = {"data": 2, "fsdp": 2, "tensor": 2}
OPT = optax.adamw(1e-2)


class Client(NamedTuple):
  """A package's model as its users train it.

  init_fn: key -> params. loss_fn: (params, batch) -> the scalar its users train on.
  token_loss: None, or (params, batch) -> (masked loss sum, mask count), the two scalars
  `loss_fn` divides. batches: STEPS numpy batches of BATCH rows. sharding: rules and
  logical_axes for meshes with a tensor axis (the model's own names), else automatic FSDP.
  """
  init_fn: Callable
  loss_fn: Callable
  token_loss: Callable | None
  batches: list
  sharding: dict


def _masked_mean(token_loss):
  """The loss the packages' users write: the masked sum divided by the count."""
  return lambda params, batch: operator.truediv(*token_loss(params, batch))


def _needs(name):
  return pytest.importorskip(name, reason=f"{name} is not installed: pip install -e "
                             "'.[test,clients]' && pip install --no-deps recurrentgemma==1.0.1 "
                             "(pyproject.toml: clients)")


def _padded_tokens(seed):
  """Token rows int32 [BATCH, SEQ + 1] and bool [BATCH, SEQ + 1] marking the real ones (the
  rest are 0, the pad), lengths 3..SEQ + 1."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, SEQ + 2, BATCH)
  mask = np.arange(SEQ + 1)[None] < lengths[:, None]
  return np.where(mask, rng.integers(1, VOCAB, (BATCH, SEQ + 1)), 0).astype(np.int32), mask


# ------------------------------------------------------------ recurrentgemma (Flax Linen)


def _griffin() -> Client:
  """Next-token loss masked by pads and divided by their count, as recurrentgemma's
  fine-tuning tutorial writes it."""
  rg = _needs("recurrentgemma.jax")
  config = rg.GriffinConfig(
      vocab_size=VOCAB, width=32, mlp_expanded_width=128, num_heads=2,
      block_types=(rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION),
      embeddings_scale_by_sqrt_dim=True, attention_window_size=SEQ, logits_soft_cap=30.0)
  model = rg.Griffin(config, gradient_checkpointing=False)

  def init_fn(key):
    return model.init(key, jnp.zeros((1, SEQ), jnp.int32), jnp.arange(SEQ)[None])["params"]

  def token_loss(params, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens[:, :-1].shape)
    logits, _ = model.apply({"params": params}, tokens[:, :-1], positions, return_cache=False)
    target_mask = mask[:, 1:].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(nll * target_mask), jnp.sum(target_mask)

  batches = [dict(zip(("tokens", "mask"), _padded_tokens(i))) for i in range(STEPS)]
  return Client(init_fn, _masked_mean(token_loss), token_loss, batches, {})


# ------------------------------------------------------------------------------- penzai


def _penzai() -> Client:
  """A two-block Llama-like TransformerLM; the loss a penzai `StatefulTrainer` takes."""
  _needs("penzai")
  from penzai import pz  # pylint: disable=g-import-not-at-top
  from penzai.models.transformer.variants import (  # pylint: disable=g-import-not-at-top
      llamalike_common)
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=32, projection_dim=16,
      mlp_hidden_dim=128, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
      tie_embedder_and_logits=False)

  def build(key):
    return llamalike_common.build_llamalike_transformer(config, init_base_rng=key)

  stateless_model, _ = pz.unbind_params(build(jax.random.key(0)))

  def init_fn(key):
    return pz.unbind_params(build(key), freeze=True)[1]

  def xent_loss_fn(*, model, state, rng, tokens, mask):  # basic_training.LossFunction
    del rng
    tokens = pz.nx.wrap(tokens).tag("batch", "seq")
    target_mask = pz.nx.wrap(mask[:, 1:].astype(jnp.float32)).tag("batch", "seq")
    logits = model(tokens[{"seq": pz.slice[:-1]}])
    nll = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
        logits.untag("vocabulary"), tokens[{"seq": pz.slice[1:]}])
    total = (nll * target_mask).unwrap("batch", "seq").sum()
    count = target_mask.unwrap("batch", "seq").sum()
    return (total, count), state, {}

  def token_loss(params, batch):
    model = pz.bind_variables(stateless_model, params)
    return xent_loss_fn(model=model, state=None, rng=None, **batch)[0]

  # penzai's sharding metadata is each array's axis names: they are the logical axes (a tree
  # of the params' structure with names for arrays, as penzai's own
  # sharding_util.name_to_name_sharding swaps each array for its sharding).
  logical_axes = jax.tree.map(
      lambda x: dataclasses.replace(x, data_array=tuple(x.named_axes)),
      jax.eval_shape(init_fn, jax.random.key(0)), is_leaf=pz.nx.is_namedarray)
  rules = (("embedding", "fsdp"), ("neurons", "tensor"), ("heads", "tensor"),
           ("vocabulary", "tensor"))
  batches = [dict(zip(("tokens", "mask"), _padded_tokens(10 + i))) for i in range(STEPS)]
  return Client(init_fn, _masked_mean(token_loss), token_loss, batches,
                {"rules": rules, "logical_axes": logical_axes})


# ------------------------------------------------------------------ esm2quinox (Equinox)


def _esm2_model():
  esm2quinox, eqx = _needs("esm2quinox"), _needs("equinox")
  model = esm2quinox.ESM2(num_layers=2, embed_size=32, num_heads=2, token_dropout=True,
                          key=jax.random.key(0))
  return esm2quinox, eqx, model


def _esm2() -> Client:
  """The masked-LM loss: 15% of the real residues replaced by the mask token, cross-entropy
  at those positions divided by their count."""
  esm2quinox, eqx, model = _esm2_model()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  mask_token = int(esm2quinox.tokenise(["#"])[0, 1])

  def token_loss(params, batch):
    logits = jax.vmap(eqx.combine(params, static))(batch["masked"]).logits
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"])
    weight = batch["is_masked"].astype(jnp.float32)
    return jnp.sum(nll * weight), jnp.sum(weight)

  batches = []
  for i in range(STEPS):
    rng = np.random.default_rng(20 + i)
    proteins = ["".join(rng.choice(list("LAGVSERTIDPKQNFYMHWC"), rng.integers(2, SEQ - 1)))
                for _ in range(BATCH)]
    tokens = esm2quinox.tokenise(proteins, length=SEQ).astype(np.int32)  # pads at the end
    is_masked = (rng.random(tokens.shape) < 0.15) & (tokens > 3)  # residues only
    is_masked[:, 1] = True  # every row predicts at least one residue
    batches.append({"tokens": tokens, "masked": np.where(is_masked, mask_token, tokens),
                    "is_masked": is_masked})
  # Equinox has no sharding metadata: logical axes by leaf path ('/'-joined attributes); the
  # stacked layers' leading axis stays whole.
  logical_axes = (
      (r"layers/attn/(query|key|value)_proj/weight$", ("layer", "heads", "embed")),
      (r"layers/attn/output_proj/weight$", ("layer", "embed", "heads")),
      (r"layers/linear1/weight$", ("layer", "mlp", "embed")),
      (r"layers/linear2/weight$", ("layer", "embed", "mlp")))
  rules = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"))
  return Client(lambda key: params, _masked_mean(token_loss), token_loss, batches,
                {"rules": rules, "logical_axes": logical_axes})


# ------------------------------------------------------------------ mamba2-jax (Flax NNX)


def _mamba2() -> Client:
  """A one-layer Mamba2ForCausalLM and its own loss (`labels=`: the mean next-token
  cross-entropy over every position, no mask), params from `nnx.split`."""
  _needs("mamba2_jax")
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from mamba2_jax import modeling  # pylint: disable=g-import-not-at-top
  config = modeling.Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=16, head_dim=16,
                                 chunk_size=SEQ, num_hidden_layers=1)

  def init_fn(key):
    return nnx.split(modeling.Mamba2ForCausalLM(config, rngs=nnx.Rngs(key)), nnx.Param)[1]

  graphdef, _ = nnx.split(nnx.eval_shape(
      lambda: modeling.Mamba2ForCausalLM(config, rngs=nnx.Rngs(0))), nnx.Param)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    return model(batch["tokens"], labels=batch["tokens"])["loss"]

  batches = [{"tokens": np.random.default_rng(30 + i).integers(0, VOCAB, (BATCH, SEQ),
                                                               dtype=np.int32)}
             for i in range(STEPS)]
  return Client(init_fn, loss_fn, None, batches, {})


CLIENTS = {"recurrentgemma": _griffin, "penzai": _penzai, "esm2quinox": _esm2,
           "mamba2-jax": _mamba2}
# The meshes each client trains on (a tensor axis where the model has names for it).
MESHES = {"recurrentgemma": (FSDP, DATA_FSDP), "penzai": (FSDP, TENSOR),
          "esm2quinox": (FSDP, TENSOR), "mamba2-jax": (FSDP, DATA_FSDP)}
MASKED = ("recurrentgemma", "penzai", "esm2quinox")  # those whose loss is a masked mean


def _client(name) -> Client:
  """A client built afresh, as in a new process: jax's and Equinox's caches empty (ESM2's
  RoPE table is computed at its first trace)."""
  jax.clear_caches()
  if "equinox" in sys.modules:
    sys.modules["equinox"].clear_caches()
  return CLIENTS[name]()


@functools.lru_cache(maxsize=None)
def _one_device(name):
  """(losses, params): the client's loss trained on device 0 by a hand-written jitted step."""
  client = CLIENTS[name]()
  params = client.init_fn(jax.random.key(0))

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(client.loss_fn)(params, batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = OPT.init(params), []
  for batch in client.batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return losses, params


def _wrapped(client: Client, axes, accum_steps, loss_fn, params=None, **step_options):
  """(losses, params) trained as README's first step wraps a step, on a mesh of `axes`,
  from `client.init_fn` (or from `params` when given)."""
  mesh = fs.make_mesh(axes)
  sharding = client.sharding if "tensor" in axes else {}
  if params is None:
    state = fs.init_state(client.init_fn, OPT, mesh=mesh, key=jax.random.key(0), **sharding)
  else:
    state = fs.init_state(params, OPT, mesh=mesh, **sharding)
  step = fs.train_step(loss_fn, OPT, accum_steps=accum_steps, **step_options)
  step = fs.shard_step(step, mesh)
  losses = []
  for batch in client.batches:
    state, metrics = step(state, fs.global_batch(batch, fs.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return losses, state.params


def _assert_trains_like_one_device(got, want, axes):
  """Losses and params equal to the one-device run's; returns {path: spec} of the params
  split over the mesh."""
  (got_losses, got_params), (want_losses, want_params) = got, want
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
  got_flat = jax.tree_util.tree_flatten_with_path(got_params)[0]
  want_flat = jax.tree_util.tree_flatten_with_path(want_params)[0]
  assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
  for (path, g), (_, w) in zip(got_flat, want_flat):
    g, w = np.asarray(g), np.asarray(w)
    # Per leaf, loosely: Adam turns a gradient that is ~0 up to rounding (a key bias under
    # softmax) into a step of either sign, so leaves differ by ~1e-4 of their norm between
    # two correct programs; the losses above are the tight check.
    assert np.linalg.norm(g - w) <= 1e-3 * np.linalg.norm(w) + 1e-6, jax.tree_util.keystr(path)
  split = {jax.tree_util.keystr(p, simple=True, separator="/"):
           x.sharding.spec for p, x in got_flat if x.sharding.shard_shape(x.shape) != x.shape}
  assert split, f"no param is split over the mesh {axes}"
  return split


def _cases():
  """(client, axes, accum_steps) for each client's meshes and accumulation 1 and 2."""
  return [pytest.param(name, axes, accum, id="-".join(
      [name] + [f"{k}{v}" for k, v in axes.items()] + [f"accum{accum}"]))
          for name, meshes in MESHES.items() for axes in meshes for accum in (1, 2)]


@pytest.mark.parametrize("name,axes,accum_steps", _cases())
def test_trains_like_one_device(name, axes, accum_steps):
  client = _client(name)
  got = _wrapped(client, axes, accum_steps, client.loss_fn)
  split = _assert_trains_like_one_device(got, _one_device(name), axes)
  if "tensor" in axes:  # the model's own names mapped by the rules: an MLP weight on tensor
    assert any("tensor" in str(spec) for spec in split.values()), split


# ESM2's RoPE table, computed eagerly while traced (Equinox's RotaryPositionalEmbedding under
# jax.ensure_compile_time_eval), fails inside the per-shard accumulation loop of a weighted
# loss (jax's "Unhandled OpSharding type", an AssertionError on fsdp=8): "auto" then runs the
# loop with the partitioner, the same gradients.
@pytest.mark.parametrize("name", MASKED)
def test_weighted_sum_and_count_are_exact_under_accumulation(name):
  # The masked loss as `(sum, count)` with weighted=True: the full batch's mean at any
  # accumulation, on the client's last mesh.
  client, axes = _client(name), MESHES[name][-1]
  got = _wrapped(client, axes, 2, client.token_loss, weighted=True)
  _assert_trains_like_one_device(got, _one_device(name), axes)


def test_equinox_params_as_the_first_step_passes_them():
  # `eqx.partition(model, eqx.is_inexact_array)[0]` is an ESM2 module, and so callable.
  _, eqx, model = _esm2_model()
  params, _ = eqx.partition(model, eqx.is_inexact_array)
  client = _client("esm2quinox")
  got = _wrapped(client, FSDP, 1, client.loss_fn, params=params)
  _assert_trains_like_one_device(got, _one_device("esm2quinox"), FSDP)
