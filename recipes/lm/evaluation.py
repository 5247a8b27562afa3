"""The held-out loss of a train state (`evaluate`, in nats per token and bits per byte) and
the text its model writes (`sample`). `r` is train_lm's `run_setup.Run`."""
from __future__ import annotations

import functools
import math
import time

import jax
import numpy as np

import fnscale as fs
from recipes.lm import packing, sampling


def eval_loss(loss_fn, policy, kernels: dict):
  """`eval_loss(params, batch) -> mean loss` (nats/token; jitted, under the run's
  `kernels`): `loss_fn` in the policy's compute dtype, a packed batch's (sum, weight) made a
  mean."""
  cast = policy.cast_to_compute if policy is not None else (lambda p: p)
  return jax.jit(fs.with_kernel(lambda p, b: packing.mean(loss_fn(cast(p), b)), **kernels))


def bits_per_byte(corpus, loss: float) -> float:
  """A loss in nats per token of `corpus` (a `data.Corpus`), in bits per byte of text."""
  return loss * corpus.tokens_per_byte / math.log(2)


def evaluate(r, state, step: int) -> float:
  """The held-out loss (nats/token) of `state` at `step` of run `r`, said and logged; its
  time is the run's goodput's "eval"."""
  with r.rec.goodput.during("eval"):
    return _evaluate(r, state, step)


def _evaluate(r, state, step: int) -> float:
  # All devices finish each eval program (not just the one a scalar is read from).
  ev, rec = r.evals, r.rec
  params = ev.params_of(state)
  value = float(np.mean([float(jax.block_until_ready(ev.loss(params, b)))
                         for b in ev.batches]))
  if r.setup.o.tune.objective == "dpo":
    rec.say(f"eval  step {step:>6}: DPO loss {value:.4f} over held-out pairs")
    rec.log.write(step, {"eval/dpo_loss": value})
    return value
  bpb = bits_per_byte(r.setup.corpus, value)
  rec.say(f"eval  step {step:>6}: loss {value:.4f} nats/token, {bpb:.4f} bits/byte")
  rec.log.write(step, {"eval/loss": value, "eval/bits_per_byte": bpb})
  return value


def sample(r, state) -> str:
  """`--sample_len` tokens that `state`'s model of run `r` writes after `--prompt`, said;
  its time is the run's goodput's "eval"."""
  with r.rec.goodput.during("eval"):
    return _sample(r, state)


def _sample(r, state) -> str:
  o, c, t = r.setup.o, r.setup.corpus, time.time()
  apply = functools.partial(r.setup.model.apply, cfg=r.setup.cfg)
  how = sampling.Sampling(o.log.sample_len, r.setup.cfg.seq, o.log.temperature, o.data.seed,
                          o.model.attention)
  text = c.decode(sampling.generate(apply, r.evals.params_of(state),
                                    c.encode(o.log.prompt or "\n"), how))
  r.rec.say(f"sample ({o.log.sample_len} tokens, temperature {o.log.temperature}, "
        f"{time.time() - t:.1f} s):\n{'-' * 60}\n{o.log.prompt}{text}\n{'-' * 60}")
  return text
