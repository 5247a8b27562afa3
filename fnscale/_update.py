"""The optimizer update of the train step and the norms it reports: the gradients' always,
the change applied to the params where an update can be lost unseen or when asked. Part of
the train step (`fnscale._step` says the reading order)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jmp
import optax

from fnscale import _offload
from fnscale._loss import _Config


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _computes_float16(policy) -> bool:
  return policy is not None and jnp.dtype(policy.compute_dtype) == jnp.float16


def _unscale(grads, ls):
  """Gradients divided by the loss scale: exact for a power-of-two scale wherever the
  result is a normal float32 (jmp multiplies by 1 / scale, which is 0 on a device that
  flushes subnormals once the scale reaches 2**127, and inexact for other scales)."""
  if ls is None:
    return grads
  return jax.tree.map(lambda g: g / ls.loss_scale, grads)


def _measures_change(cfg: _Config, params) -> bool:
  """Whether the step measures the change it applies (`train_step`'s update_norm): asked
  for, or by default where an update can be lost unseen: a trained param narrower than
  float32 (its rounding swallows small updates) or float16 compute (its gradients
  underflow to 0)."""
  if cfg.update_norm is not None:
    return cfg.update_norm
  return _computes_float16(cfg.policy) or any(
      _is_float(p) and jnp.finfo(p.dtype).bits < 32 for p in jax.tree.leaves(params))


def _update(cfg: _Config, state, grads, ls):
  """The optimizer update; with a dynamic loss scale, a non-finite step is skipped.
  Returns the new state, `skipped`, and the float32 norms of `grads` (float32, unscaled)
  and of the change applied to the params (the update after rounding to the param dtype;
  None where not measured, `_measures_change`).

  Both norms come from sums over each leaf (`_square_sums`), taken before the new
  params are written: the change is computed from the old params and the updates, and the
  new params read the change's norm (`_apply`), which orders that reduction first. The
  new params then take the old params' (donated) buffers in place. Measured afterwards as
  new - old, the old params would have to outlive the update: XLA copies every param
  first, then reads old and new again. Either way the change is a pass over the updates
  of its own (XLA fuses the updates into the params' write): 1.7% of a Llama 766M step on
  TPU v5e (recipes/bench/chip.py, hand=1). The gradients' norm costs nothing beside
  optax's global-norm clipping, which sums the same squares."""
  params = state.params
  cast = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  skipped = jnp.zeros((), jnp.int32)
  new_ls = state.loss_scale
  finite = jmp.all_finite(cast) if isinstance(ls, jmp.DynamicLossScale) else None
  # The update takes the gradients cast to the params' dtypes (`_offload.update` casts them).
  # A state in host memory (init_state's offload_optimizer) comes to the device for it; a
  # skipped step keeps the old state (selected there).
  updates, opt_state = _offload.update(cfg.optimizer, grads, state.opt_state, params, finite)
  if finite is not None:
    ls = ls.adjust(finite)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    new_ls = dataclasses.replace(state.loss_scale, scale=ls.loss_scale,
                                 counter=jnp.asarray(ls.counter, jnp.int32))
  zero = jnp.zeros((), jnp.float32)
  if _measures_change(cfg, params):
    sums = [_square_sums(g, _applied(p, u, finite)) for g, p, u in
            zip(jax.tree.leaves(grads), jax.tree.leaves(params), jax.tree.leaves(updates))]
    grad_norm = jnp.sqrt(sum((g for g, _ in sums), zero))
    update_norm = jnp.sqrt(sum((c for _, c in sums), zero))
  else:
    grad_norm = jnp.sqrt(sum((_square_sums(g) for g in jax.tree.leaves(grads)), zero))
    update_norm = None
  new_params = jax.tree.map(lambda p, u: _apply(p, u, finite, update_norm), params, updates)
  new_state = state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                             loss_scale=new_ls)
  return new_state, skipped, grad_norm, update_norm


def _apply(p, u, finite, update_norm=None):
  """`p` updated by `u` as optax applies it (p + u in p's dtype); `p` itself where a
  dynamic loss scale skips the step (`finite` False). Also `p` where `update_norm` < 0,
  which never holds (a norm is not negative, NaN compares False): the select makes the
  update read the norm, so XLA reduces the old params before overwriting them."""
  new = optax.apply_updates(p, u)
  keep = None if update_norm is None else update_norm < 0
  if finite is not None:
    keep = jnp.logical_not(finite) if keep is None else keep | jnp.logical_not(finite)
  return new if keep is None else jnp.where(keep, p, new)


def _applied(p, u, finite):
  """The change `_apply` makes to `p`, in float32: p + u rounded to p's dtype explicitly
  (XLA may otherwise keep the excess precision of a float32 sum that it rounds,
  xla_allow_excess_precision), minus p; a float32 leaf is its own rounding. 0 where the
  step is skipped; a 0-d 0 for a non-floating leaf."""
  if not _is_float(p):
    return jnp.zeros((), jnp.float32)
  new = optax.apply_updates(p, u).astype(jnp.float32)
  if p.dtype != jnp.float32:
    info = jnp.finfo(p.dtype)
    new = jax.lax.reduce_precision(new, info.nexp, info.nmant)
  change = new - p.astype(jnp.float32)
  return change if finite is None else jnp.where(finite, change, 0.0)


def _square_sums(g, c=None):
  """(sum of g**2, sum of c**2) in float32; sum of g**2 alone without `c`. Two sums, not
  one variadic reduce over both: GSPMD partitions a variadic reduce of sharded operands by
  gathering them first."""
  g = jnp.asarray(g, jnp.float32)
  if c is None:
    return jnp.sum(g * g)
  c = jnp.asarray(c, jnp.float32)
  return jnp.sum(g * g), jnp.sum(c * c)
