"""Token-normalized (masked-mean) losses, as Flax LM repositories write them, under
accumulation and per shard (8 CPU devices).

The reference is the same loss on the whole batch on one device, trained with plain optax:
the step must give its loss and params whatever the mesh, accum_steps or accum_gather, or
stop before training with an error naming `weighted=True`.
"""
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs

VOCAB, T, ROWS, STEPS = 32, 8, 32, 3  # 32 rows: 4 microbatches x 8 devices


class TinyLM(nn.Module):
  """A Linen next-token model: embed, one gelu MLP, unembed."""
  dim: int = 16

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, self.dim)(tokens)
    x = x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(x)))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = TinyLM()


def init_fn(key):
  return MODEL.init(key, jnp.zeros((1, T), jnp.int32))["params"]


def _ce(params, batch):
  logits = MODEL.apply({"params": params}, batch["inputs"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def sum_over_count(params, batch):
  return jnp.sum(_ce(params, batch) * batch["mask"]) / jnp.sum(batch["mask"])


def clipped_count(params, batch):
  w = batch["mask"]
  return (_ce(params, batch) * w).sum() / jnp.maximum(w.sum(), 1)


def mean_where(params, batch):
  return jnp.mean(_ce(params, batch), where=batch["mask"] > 0)


def one_hot_clip(params, batch):
  """optax's one-hot cross entropy, negated log-likelihood form, count clipped by jnp.clip."""
  logits = MODEL.apply({"params": params}, batch["inputs"])
  labels = jax.nn.one_hot(batch["targets"], VOCAB)
  nll = -jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1)
  return jnp.sum(nll * batch["mask"]) / jnp.clip(jnp.sum(batch["mask"]), 1)


def with_z_loss(params, batch):
  """Cross entropy and a z-loss (log-partition squared), each a jnp.mean(where=)."""
  logits = MODEL.apply({"params": params}, batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  z = jax.nn.logsumexp(logits, axis=-1) ** 2
  where = batch["mask"] > 0
  return jnp.mean(ce, where=where) + 1e-2 * jnp.mean(z, where=where)


@jax.jit
def masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def jitted_helper(params, batch):
  return masked_mean(_ce(params, batch), batch["mask"])


def with_l2(params, batch):
  """A masked mean plus a weight penalty (the same in every microbatch)."""
  l2 = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))
  return sum_over_count(params, batch) + 1e-3 * l2


def kernel_mean(params, batch):
  """fnscale's own cross entropy, its default mean over the tokens `where` keeps."""
  x = params["Embed_0"]["embedding"][batch["inputs"]]
  return fs.cross_entropy(x, params["Dense_2"]["kernel"], batch["targets"],
                          where=batch["mask"] > 0)


def plain_mean(params, batch):
  return jnp.mean(_ce(params, batch))


LOSSES = {f.__name__: f for f in (sum_over_count, clipped_count, mean_where, one_hot_clip,
                                  with_z_loss, jitted_helper, with_l2, kernel_mean,
                                  plain_mean)}


def _batch(seed=0):
  """Padded rows whose token counts differ a lot between microbatches and shards: rows
  0, 4, 8, ... (microbatch 0 at accum 4) hold one token, rows 1, 5, ... are full, the rest
  random, and rows 2 and 6 none at all."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (ROWS, T + 1))
  lengths = rng.integers(0, T + 1, ROWS)
  lengths[0::4], lengths[1::4], lengths[[2, 6]] = 1, T, 0
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1] * (mask > 0), "targets": tokens[:, 1:], "mask": mask}


def _reference(loss_fn, batch, opt):
  """STEPS steps of plain optax on one device: (losses, params). (SGD: the params differ as
  the gradients do, which adam would hide or blow up where they are near 0.)"""
  params = init_fn(jax.random.key(0))
  opt_state, losses = opt.init(params), []

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return losses, params


def _train(loss_fn, batch, opt, axes, accum, gather="auto", mode="auto", **options):
  """(losses, params, last metrics) of STEPS steps of `loss_fn` wrapped on mesh `axes`."""
  mesh = fs.make_mesh(axes)
  state = fs.init_state(init_fn, opt, mesh=mesh, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=accum, accum_gather=gather,
                                     **options), mesh, mode=mode)
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params), metrics


def _check_equal(got, ref):
  np.testing.assert_allclose(got[0], ref[0], rtol=2e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got[1],
               jax.device_get(ref[1]))


SLOW = pytest.mark.slow  # the other forms and meshes: each a compile of its own
CASES = [  # (mesh, accum_steps, accum_gather, loss)
    ("fsdp=8", 1, "auto", "sum_over_count"),
    ("fsdp=8", 2, "auto", "clipped_count"),
    pytest.param("fsdp=8", 4, "per_microbatch", "mean_where", marks=SLOW),
    ("data=2,fsdp=4", 2, "once", "jitted_helper"),
    pytest.param("data=2,fsdp=4", 4, "per_microbatch", "one_hot_clip", marks=SLOW),
    ("data=2,fsdp=2,tensor=2", 2, "per_microbatch", "with_z_loss"),
    pytest.param("data=2,fsdp=2,tensor=2", 4, "once", "clipped_count", marks=SLOW),
    pytest.param("data=2,fsdp=2,tensor=2", 2, "auto", "with_l2", marks=SLOW),
    ("data=2,fsdp=4", 2, "auto", "kernel_mean"),
    pytest.param("fsdp=8", 4, "per_microbatch", "kernel_mean", marks=SLOW),
]


@pytest.mark.parametrize("axes,accum,gather,loss", CASES)
def test_masked_mean_trains_as_the_whole_batch_on_one_device(axes, accum, gather, loss):
  batch, opt = _batch(), optax.sgd(0.5)
  ref = _reference(LOSSES[loss], batch, opt)
  _check_equal(_train(LOSSES[loss], batch, opt, axes, accum, gather), ref)


def test_masked_mean_per_shard_without_accumulation():
  # shard_step(mode="shard_map") runs the loss per shard even at accum_steps=1: 8 shards'
  # means (two of the rows hold no token) averaged were not the batch's mean.
  batch, opt = _batch(1), optax.sgd(0.5)
  ref = _reference(mean_where, batch, opt)
  _check_equal(_train(mean_where, batch, opt, "data=8", 1, mode="shard_map"), ref)


def test_masked_mean_with_aux():
  # (loss, aux): the loss is the first output; aux as the loss computes it.
  def loss_aux(params, batch):
    ce, m = _ce(params, batch), batch["mask"]
    loss = jnp.sum(ce * m) / jnp.sum(m)
    return loss, {"tokens": jnp.sum(m).astype(jnp.int32), "loss": loss}
  batch, opt = _batch(2), optax.sgd(0.5)
  ref = _reference(lambda p, b: loss_aux(p, b)[0], batch, opt)
  *got, metrics = _train(loss_aux, batch, opt, "fsdp=8", 4, has_aux=True)
  _check_equal(got, ref)
  assert int(metrics["aux"]["tokens"]) == int(batch["mask"].sum())


def test_plain_mean_keeps_its_behaviour(caplog):
  # jnp.mean divides by a constant: the step averages the microbatches' means, which is the
  # batch's mean, and says nothing about masks.
  batch, opt = _batch(), optax.sgd(0.5)
  ref = _reference(plain_mean, batch, opt)
  with caplog.at_level(logging.INFO):
    got = _train(plain_mean, batch, opt, "fsdp=8", 2)
  _check_equal(got, ref)
  assert "masked mean" not in caplog.text


def test_masked_mean_is_said_once(caplog):
  with caplog.at_level(logging.INFO):
    _train(sum_over_count, _batch(), optax.sgd(0.1), "data=8", 2)
  assert caplog.text.count("(a masked mean)") == 1


def _mixed(params, batch):
  """A masked mean plus a term that depends on the batch otherwise (a plain mean)."""
  return sum_over_count(params, batch) + 0.1 * jnp.mean(_ce(params, batch))


def _root_count(params, batch):
  return jnp.sum(_ce(params, batch) * batch["mask"]) / jnp.sqrt(jnp.sum(batch["mask"]))


def _nested(params, batch):
  return jnp.log(sum_over_count(params, batch))


def _two_counts(params, batch):
  """Means over two different masks, added."""
  first = (batch["inputs"] > VOCAB // 2).astype(jnp.float32) * batch["mask"]
  return sum_over_count(params, batch) + jnp.sum(_ce(params, batch) * first) / jnp.sum(first)


@pytest.mark.parametrize("loss_fn,what", [
    (_mixed, "adds a mean over a batch count to a term that depends on the batch"),
    pytest.param(_root_count, "not a sum over its rows", marks=SLOW),
    (_nested, "inside a larger expression"),
    pytest.param(_two_counts, "adds means over different counts", marks=SLOW),
])
def test_a_loss_that_cannot_be_split_stops_before_training(loss_fn, what):
  mesh = fs.make_mesh("fsdp=8")
  opt = optax.sgd(0.1)
  state = fs.init_state(init_fn, opt, mesh=mesh, key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss_fn, opt, accum_steps=2), mesh)
  with pytest.raises(fs.StepError, match=what + r".*accum_steps=2.*fix:.*weighted=True"):
    step.compile(state, _batch())
  # The same loss without accumulation sees the whole batch: exact, no error.
  fs.shard_step(fs.train_step(loss_fn, opt), mesh).compile(state, _batch())


def test_the_named_fix_is_exact():
  # What the error names: (sum, weight) with weighted=True.
  def sum_weight(params, batch):
    return jnp.sum(_ce(params, batch) * batch["mask"]), jnp.sum(batch["mask"])
  batch, opt = _batch(3), optax.sgd(0.5)
  ref = _reference(sum_over_count, batch, opt)
  _check_equal(_train(sum_weight, batch, opt, "fsdp=8", 4, weighted=True)[:2], ref)
