"""The optimizer state in host memory: `init_state(..., offload_optimizer=True)` places it in
pinned host memory (`memory_kind="pinned_host"`) between steps, and the train step's update
(`update`) brings it to the device and sends the new state back, one param's share at a
time where the optimizer's update allows it, as MaxText's optimizer offload keeps it on the
host. Params and gradients stay on the device.

Brought in whole, the state would sit on the device at once during the update (XLA starts
every copy early, to overlap them): the device then holds params, gradients and moments
together, more than without offload. So the update runs once per param (each call's other
params' state a zero XLA drops, the shared parts such as the global norm computed once),
each param's state copied in only after the previous param's update is done
(`lax.optimization_barrier`): the device holds one param's state at a time. That is exact
where each param's new state and update read no other param's state (Adam, AdamW,
Adafactor, SGD with momentum, a global-norm clip before them: read from the update's jaxpr,
`_separable`); another optimizer's state comes in whole, said at INFO.
"""
from __future__ import annotations

from absl import logging
import jax
import jax.extend
import jax.numpy as jnp
import jmp
import optax

HOST = "pinned_host"


def on_host(sharding):
  """`sharding` in pinned host memory."""
  return sharding.with_memory_kind(HOST)


def _is_host(x) -> bool:
  return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def _to(x, space):
  return jax.device_put(x, space)


def update(optimizer, grads, opt_state, params, finite=None):
  """`optimizer.update(grads, opt_state, params)` -> (updates, new state), the state's
  leaves that arrive in host memory (traced: their type says so) brought to the device for
  it and the new ones sent back. `finite`: None, or a bool scalar, False keeping the old
  state (a step a dynamic loss scale skips)."""
  leaves, treedef = jax.tree.flatten(opt_state)
  host = [_is_host(x) for x in leaves]
  if not any(host):
    updates, new = optimizer.update(grads, opt_state, params)
    return updates, new if finite is None else jmp.select_tree(finite, new, opt_state)
  labels = _labels(optimizer, opt_state, params)
  if labels is None or not _separable(optimizer, grads, opt_state, params, labels):
    logging.info("optimizer offload: the optimizer's update reads several params' state "
                 "together; its state comes to the device whole for the update")
    on_device = [_to(x, jax.memory.Space.Device) if h else x for x, h in zip(leaves, host)]
    updates, new = optimizer.update(grads, treedef.unflatten(on_device), params)
    return updates, treedef.unflatten([
        _to(_kept(finite, x, old), jax.memory.Space.Host) if h else _kept(finite, x, old)
        for x, old, h in zip(jax.tree.leaves(new), on_device, host)])
  return _streamed(optimizer, grads, leaves, treedef, params, labels, host, finite)


def _kept(finite, new, old):
  """`new`, or `old` where `finite` is False (None: always `new`)."""
  return new if finite is None else jnp.where(finite, new, old)


def _labels(optimizer, opt_state, params) -> list | None:
  """For each leaf of `opt_state`, the index (in `params`' leaves) of the param it belongs
  to (Adam's mu and nu of it, Adafactor's factored rows of it), or None for a shared leaf
  (a step count); None where optax can't tell (`tree_utils.tree_map_params`)."""
  index = jax.tree.unflatten(jax.tree.structure(params),
                             list(range(len(jax.tree.leaves(params)))))
  mark = lambda _, i: ("param", i)
  try:
    marked = optax.tree_utils.tree_map_params(
        optimizer, mark, opt_state, index, transform_non_params=lambda _: ("shared", None),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  except Exception as e:  # pylint: disable=broad-except  # init failed on a placeholder
    logging.info("optimizer offload: tree_map_params failed (%s)", e)
    return None
  out = jax.tree.leaves(marked, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                        and x[0] in ("param", "shared"))
  if len(out) != len(jax.tree.leaves(opt_state)):
    return None
  return [i for _, i in out]


def _separable(optimizer, grads, opt_state, params, labels) -> bool:
  """Whether each param's update and new state read only its own state and the shared
  leaves, and the shared leaves' new values only shared leaves (grads and params, all on the
  device, may be read together): from the jaxpr of the update, each output's state inputs."""
  n_grads = len(jax.tree.leaves(grads))
  plain = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  jaxpr = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(
      *map(plain, (grads, opt_state, params)))
  inputs = [None] * n_grads + [("s", i) for i in range(len(labels))] + [None] * len(
      jax.tree.leaves(params))
  reads = _reads(jaxpr.jaxpr, [frozenset() if x is None else frozenset([x[1]])
                               for x in inputs])
  out_labels = list(range(n_grads)) + labels  # updates follow the params' order
  for read, own in zip(reads, out_labels):
    if any(labels[k] is not None and labels[k] != own for k in read):
      return False
  return True


def _reads(jaxpr, deps_in):
  """For each output of `jaxpr`, the set of tagged inputs it depends on (`deps_in`: per
  input, a frozenset of tags); through calls with an inner jaxpr (pjit, custom_jvp, ...)
  per output, else every output of an equation reads all of its inputs."""
  env = {}
  read = lambda v: env.get(v, frozenset()) if not isinstance(v, jax.extend.core.Literal) else frozenset()
  for v, d in zip(jaxpr.invars, deps_in):
    env[v] = d
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _inner(eqn)
    if inner is not None and len(inner.invars) == len(ins) and len(
        inner.outvars) == len(eqn.outvars):
      outs = _reads(inner, ins)
    else:
      outs = [frozenset().union(*ins)] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
  return [read(v) for v in jaxpr.outvars]


def _inner(eqn):
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(name)
    if j is not None:
      return getattr(j, "jaxpr", j)
  return None


def _streamed(optimizer, grads, leaves, treedef, params, labels, host, finite):
  """The update once per param, in the params' order, each param's state copied to the
  device after the previous param's new state is made (`lax.optimization_barrier`)."""
  n = len(jax.tree.leaves(params))
  shared = [_to(x, jax.memory.Space.Device) if h and lab is None else x
            for x, h, lab in zip(leaves, host, labels)]
  back = lambda k, x, old: (_to(_kept(finite, x, old), jax.memory.Space.Host) if host[k]
                            else _kept(finite, x, old))
  zero = [jnp.zeros(x.shape, x.dtype) for x in leaves]
  updates, new_leaves, done = [None] * n, list(leaves), None
  for i in range(n):
    mine = [k for k, lab in enumerate(labels) if lab == i]
    ins = [_to(leaves[k], jax.memory.Space.Device) if host[k] else leaves[k] for k in mine]
    if done is not None and ins:
      ins, _ = jax.lax.optimization_barrier((ins, done))
    state = list(shared)
    for k, lab in enumerate(labels):
      if lab is not None and lab != i:
        state[k] = zero[k]
    for k, x in zip(mine, ins):
      state[k] = x
    u, new = optimizer.update(grads, treedef.unflatten(state), params)
    new = jax.tree.leaves(new)
    updates[i] = jax.tree.leaves(u)[i]
    for k in mine:
      new_leaves[k] = back(k, new[k], state[k])
    if i == 0:
      for k, lab in enumerate(labels):
        if lab is None:
          new_leaves[k] = back(k, new[k], state[k])
    done = [new_leaves[k] for k in mine] or done
  return (jax.tree.unflatten(jax.tree.structure(params), updates),
          treedef.unflatten(new_leaves))
