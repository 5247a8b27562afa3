"""The optimizer state in host memory: `init_state(..., offload_optimizer=True)` places it in
pinned host memory (`memory_kind="pinned_host"`) between steps, and the train step's update
(`update`) brings it to the device and sends the new state back, as MaxText's optimizer
offload keeps it on the host. Params and gradients stay on the device.

Brought in whole (MaxText's way), the state would sit on the device at once during the
update (XLA starts every copy early, to overlap them): the device then holds params,
gradients and moments together, more than without offload. So the update runs once per
param (the other params' state a zero XLA drops, the shared parts such as the global norm
computed once), and where it is elementwise in that param's state (Adam's moments, from
the update's jaxpr: `_plan`) a slice of its leading axis at a time (a layer of a stacked
block, rows of an embedding: `SLICE_BYTES`) in a `lax.fori_loop`, each slice copied in and
its new state written back over the old one in host memory: the device holds a slice or two
of state. Else the param's whole state comes in after the previous param's went back
(`lax.optimization_barrier`). Either is exact where each param's new state and update read
no other param's state (Adam, AdamW, Adafactor, SGD with momentum, a global-norm clip before
them: `_separable`); another optimizer's state comes in whole, said at INFO.

On a mesh of several devices a long leading axis may be split over them (an embedding's rows
under FSDP; the trace holds no sharding to tell): a slice then takes every n-th row, so that
each device's part lies in its own shard (`_chunks`). Where the rows allow no such slices
(rows / n not a multiple of the devices, n not of a TPU tile's rows), runs of rows cut across
devices, and XLA runs their update on the host, gathering (compiled for a v5e:2x2, fsdp=4).
"""
from __future__ import annotations

import math

from absl import logging
import jax
import jax.extend
import jax.numpy as jnp
import jmp
import numpy as np
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
  """`optimizer.update(grads cast to the params' dtypes, opt_state, params)` -> (updates, new
  state), the state's leaves that arrive in host memory (traced: their type says so)
  brought to the device for it and the new ones sent back. `finite`: None, or a bool
  scalar, False keeping the old state (a step a dynamic loss scale skips). Streamed, the
  cast is made a slice at a time with the update (float32 gradients never whole)."""
  leaves, treedef = jax.tree.flatten(opt_state)
  host = [_is_host(x) for x in leaves]
  if not any(host):
    updates, new = optimizer.update(_cast(grads, params), opt_state, params)
    return updates, new if finite is None else jmp.select_tree(finite, new, opt_state)
  labels = _labels(optimizer, opt_state, params)
  if labels is None or not _separable(optimizer, _cast(grads, params), opt_state, params,
                                      labels):
    logging.info("optimizer offload: the optimizer's update reads several params' state "
                 "together; its state comes to the device whole for the update")
    on_device = [_to(x, jax.memory.Space.Device) if h else x for x, h in zip(leaves, host)]
    updates, new = optimizer.update(_cast(grads, params), treedef.unflatten(on_device), params)
    return updates, treedef.unflatten([
        _to(_kept(finite, x, old), jax.memory.Space.Host) if h else _kept(finite, x, old)
        for x, old, h in zip(jax.tree.leaves(new), on_device, host)])
  return _streamed(optimizer, grads, leaves, treedef, params, labels, host, finite)


def _cast(grads, params):
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


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
  per output, else every output of an equation (a loop's too) reads all of its inputs."""
  env = dict(zip(jaxpr.invars, deps_in))
  read = lambda v: (frozenset() if isinstance(v, jax.extend.core.Literal)
                    else env.get(v, frozenset()))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    # Into calls only: a loop's body read once would miss what its carry passes on.
    inner = _inner(eqn) if eqn.primitive.name in _CALLS else None
    if inner is not None and len(inner.invars) == len(ins) and len(
        inner.outvars) == len(eqn.outvars):
      outs = _reads(inner, ins)
    else:
      outs = [frozenset().union(*ins)] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
  return [read(v) for v in jaxpr.outvars]


def _inner(eqn):
  """The jaxpr a call equation runs (pjit's, custom_jvp's, ...), or None."""
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(name)
    if j is not None:
      return getattr(j, "jaxpr", j)
  return None


def _streamed(optimizer, grads, leaves, treedef, params, labels, host, finite):
  """The update once per param, in the params' order: a slice of its leading axis at a time
  where the update is elementwise in its state (`_by_slices`), else its whole state copied
  to the device after the previous param's new state went back
  (`lax.optimization_barrier`)."""
  pleaves = jax.tree.leaves(params)
  shared = [_to(x, jax.memory.Space.Device) if h and lab is None else x
            for x, h, lab in zip(leaves, host, labels)]
  zero = [jnp.zeros(x.shape, x.dtype) for x in leaves]
  updates, new_leaves, done = [None] * len(pleaves), list(leaves), None
  for i, p in enumerate(pleaves):
    mine = [k for k, lab in enumerate(labels) if lab == i]
    outs_k = mine + ([k for k, lab in enumerate(labels) if lab is None] if i == 0 else [])
    to_host = [False] + [host[k] for k in outs_k]

    def update_one(*ins, i=i, mine=mine, outs_k=outs_k):
      state = [zero[k] if lab is not None and lab != i else x
               for k, (x, lab) in enumerate(zip(shared, labels))]
      for k, x in zip(mine, ins):
        state[k] = x
      u, new = optimizer.update(_cast(grads, params), treedef.unflatten(state), params)
      new = jax.tree.leaves(new)
      return [jax.tree.leaves(u)[i]] + [_kept(finite, new[k], state[k]) for k in outs_k]
    outs = None
    if mine and all(np.shape(leaves[k]) == np.shape(p) for k in mine):
      outs = _by_slices(update_one, [leaves[k] for k in mine], [host[k] for k in mine],
                        np.shape(p), to_host)
    if outs is None:
      ins = [_to(leaves[k], jax.memory.Space.Device) if host[k] else leaves[k] for k in mine]
      if done is not None and ins:
        ins, _ = jax.lax.optimization_barrier((ins, done))
      outs = [_to(x, jax.memory.Space.Host) if h else x
              for x, h in zip(update_one(*ins), to_host)]
      done = outs[1:len(mine) + 1] or done
    updates[i] = outs[0]
    for k, x in zip(outs_k, outs[1:]):
      new_leaves[k] = x
  return (jax.tree.unflatten(jax.tree.structure(params), updates),
          treedef.unflatten(new_leaves))

# Elementwise primitives: a param's state may be updated a slice of its leading axis at a
# time where only these read it (Adam's moments; not a norm over the whole leaf).
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "div",
    "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite",
    "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or",
    "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sqrt",
    "square", "stop_gradient", "sub", "tanh", "xor"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"})
# A slice of a param's state brought in at once: about this many bytes.
SLICE_BYTES = 64 * 2**20
SHORT_AXIS = 256


class _NotElementwise(Exception):
  pass


class _Lazy:
  """An elementwise equation of the leaf's shape that reads no state: computed a slice at a
  time where the sliced update reads it, whole (once) where anything else does."""

  def __init__(self, prim, params, args):
    self.prim, self.params, self.args, self.value = prim, params, args, None

  def force(self):
    if self.value is None:
      self.value = self.prim.bind(*[_force(a) for a in self.args], **self.params)
    return self.value


def _force(ref):
  kind, x = ref
  if kind == "s":
    raise _NotElementwise("the whole state")  # e.g. a norm over it
  return x.force() if kind == "d" else x


def _sliceable(eqn, shape) -> bool:
  """An elementwise equation (or a scalar's broadcast) over values of the leaf's `shape`."""
  ins = [tuple(a.aval.shape) for a in eqn.invars]
  if not all(tuple(v.aval.shape) == shape for v in eqn.outvars):
    return False
  if eqn.primitive.name == "broadcast_in_dim":
    return ins[0] == ()
  return eqn.primitive.name in _ELEMENTWISE and all(x in ((), shape) for x in ins)


def _plan(jaxpr, consts, ins, shape):
  """Walks `jaxpr` with inputs `ins` (("v", value): read from no state; ("s", step): read
  from it), returning the outputs' refs: ("v", value) computed now, ("d", _Lazy) and ("s",
  (prim, params, args)) computed a slice at a time: elementwise equations of the leaf's
  `shape`. Calls are walked inside. Raises _NotElementwise otherwise."""
  env = {}
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = ("v", c)
  for v, r in zip(jaxpr.invars, ins):
    env[v] = r
  get = lambda a: ("v", a.val) if isinstance(a, jax.extend.core.Literal) else env[a]
  for eqn in jaxpr.eqns:
    args = [get(a) for a in eqn.invars]
    name = eqn.primitive.name
    state = any(k == "s" for k, _ in args)
    if name in _CALLS and _inner(eqn) is not None and (state or any(k == "d" for k, _ in args)):
      inner = next(eqn.params[n] for n in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                   if eqn.params.get(n) is not None)
      if len(getattr(inner, "jaxpr", inner).invars) != len(args):
        raise _NotElementwise(name)
      refs = _plan(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), args, shape)
    elif not eqn.primitive.multiple_results and _sliceable(eqn, shape):
      refs = [("s" if state else "d", (eqn.primitive, eqn.params, args) if state
               else _Lazy(eqn.primitive, eqn.params, args))]
    elif state:
      raise _NotElementwise(name)
    else:
      outs = eqn.primitive.bind(*[_force(a) for a in args], **eqn.params)
      refs = [("v", o) for o in (outs if eqn.primitive.multiple_results else [outs])]
    for v, r in zip(eqn.outvars, refs):
      env[v] = r
  return [get(v) for v in jaxpr.outvars]


def _chunks(shape, itemsizes, devices: int = 1) -> tuple[int, bool]:
  """(n, strided): n slices of the leading axis (a divisor of it) that keep a slice's state
  near `SLICE_BYTES`, each whole TPU tiles (`_tile_rows`); (1, False) where the leaf is small
  or no slice is whole tiles. A short leading axis of a leaf of 3 dims or more (a layer
  stack) is sliced at each index. On a mesh of `devices` > 1 a long leading axis may be split
  over them (an embedding's rows under FSDP): a slice then takes every n-th row (`strided`),
  a multiple of `devices` of them, so that each device's part is in its own shard; where no
  n allows that, runs of rows, which cut across devices. `itemsizes`: the state leaves'
  bytes per element."""
  if not shape or shape[0] < 2:
    return 1, False
  want = math.ceil(math.prod(shape) * sum(itemsizes) / SLICE_BYTES)
  tile = _tile_rows(len(shape), min(itemsizes))
  if want <= 1:
    return 1, False
  if shape[0] <= SHORT_AXIS and tile == 1:
    return shape[0], False
  divs = [n for n in range(2, shape[0] + 1) if shape[0] % n == 0]
  pick = lambda ok: next((n for n in ok if n >= want), ok[-1] if ok else 1)
  # Strided, the n slices' index is the second-minor axis of [rows / n, n, ...]: whole tiles.
  ok = [n for n in divs if n % tile == 0 and shape[0] // n % devices == 0]
  if devices > 1 and len(shape) > 1 and ok:
    return pick(ok), True
  return pick([n for n in divs if shape[0] // n % tile == 0]), False


def _tile_rows(ndim: int, itemsize: int) -> int:
  """The leading axis's elements in one TPU tile of an array of `ndim` dims: 1 where it is
  not one of the two minor dims a TPU tiles (a layer stack's layers); a 2-D leaf's rows come
  8 (4-byte), 16 (2-byte) or 32 (1-byte) to a tile, a 1-D leaf's elements 128 times that.
  Compiled for a v5e, a slice of a float32 [3000, 512] state of 250 rows, over its old one in
  host memory, aborted XLA (the process, not an error)."""
  rows = 8 * 4 // itemsize
  return 1 if ndim > 2 else rows if ndim == 2 else 128 * rows


def _by_slices(update_one, ins, host, shape, to_host):
  """`update_one(ins) -> outs` (the state leaves of one param in, its update and new state
  leaves out, all of `shape`; output 1 + m the new value of input m) run a slice of the
  leading axis at a time in a `lax.fori_loop`, each slice of `ins` copied to the device
  (from the host where `host`) and each new one back (the outputs where `to_host`); None
  where the update is not elementwise in the state (`_plan`) or the leaf is too small to
  slice (`_chunks`). A new state slice is written over its old one in the loop's carry: a
  fresh host buffer would cost a whole copy of the leaf on the host at the step's end
  (XLA's host offloading moves a loop's stacked output into the output buffer there, ~0.3
  GB/s for bfloat16 on a v5e's host)."""
  n, strided = _chunks(shape, [jnp.dtype(x.dtype).itemsize for x in ins],
                       max(jax.sharding.get_abstract_mesh().size, 1))
  if n == 1:
    return None
  plain = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ins]
  closed = jax.make_jaxpr(update_one)(*plain)
  try:
    outs = _plan(closed.jaxpr, closed.consts, [("s", ("in", k)) for k in range(len(ins))],
                 tuple(shape))
    whole = [r if k == "v" else None for k, r in outs]
  except _NotElementwise as e:
    logging.info("optimizer offload: the update reads %s of a param's state; its state "
                 "comes to the device whole", e)
    return None
  reads = _whole_reads([r for r in outs if r[0] != "v"], tuple(shape))
  sliced = [j for j, (k, _) in enumerate(outs) if k != "v"]
  # Output j's buffer: input j - 1's where it replaces it in the same memory, else a new one.
  over = {j: j - 1 for j in sliced if 0 < j <= len(ins) and to_host[j] == host[j - 1]
          and closed.out_avals[j].dtype == ins[j - 1].dtype}
  size = shape[0] // n
  if strided:  # slice i: every n-th row from row i (each device's rows in its own shard)
    grid = lambda x: x.reshape((size, n) + tuple(shape[1:]))
    at = lambda x, i: jax.lax.dynamic_index_in_dim(grid(x), i, 1, keepdims=False)
    put = lambda b, x, i: jax.lax.dynamic_update_index_in_dim(grid(b), x, i, 1).reshape(shape)
  else:  # slice i: the rows [i size, (i + 1) size)
    at = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * size, size)
    put = lambda b, x, i: jax.lax.dynamic_update_slice_in_dim(b, x, i * size, 0)

  def body(i, bufs):
    state = {m: bufs[sliced.index(j)] for j, m in over.items()}
    memo = {("in", k): at(state.get(k, x), i) for k, x in enumerate(ins)}
    memo = {key: _to(x, jax.memory.Space.Device) if host[key[1]] else x
            for key, x in memo.items()}
    memo.update({id(x): at(x, i) for x in reads})
    return [put(b, _to(_sliced(outs[j], memo), jax.memory.Space.Host)
                if to_host[j] and j in over else _sliced(outs[j], memo), i)
            for j, b in zip(sliced, bufs)]
  start = [ins[over[j]] if j in over else jnp.zeros(shape, closed.out_avals[j].dtype)
           for j in sliced]
  done = jax.lax.fori_loop(0, n, body, start)
  for j, y in zip(sliced, done):
    whole[j] = y
  return [_to(x, jax.memory.Space.Host) if h and (k == "v" or j not in over) else x
          for j, (x, h, (k, _)) in enumerate(zip(whole, to_host, outs))]


def _whole_reads(refs, shape) -> list:
  """The values of the leaf's `shape` that the sliced equations behind `refs` read whole
  (gradients, params: sliced along with the state)."""
  found, seen, todo = {}, set(), list(refs)
  while todo:
    kind, x = todo.pop()
    if kind == "v":
      if tuple(np.shape(x)) == shape:
        found.setdefault(id(x), x)
      continue
    if kind == "s" and x[0] == "in" or id(x) in seen:
      continue
    seen.add(id(x))
    todo.extend(x.args if kind == "d" else x[2])
  return list(found.values())


def _sliced(ref, memo):
  """`ref`'s value for one slice: `memo` holds the slice's state (("in", k)) and whole
  reads (by id), and the equations computed so far."""
  kind, x = ref
  if kind == "v":
    return memo.get(id(x), x)
  key = x if kind == "s" and x[0] == "in" else id(x)
  if key in memo:
    return memo[key]
  prim, params, args = (x.prim, x.params, x.args) if kind == "d" else x
  operands = [_sliced(a, memo) for a in args]
  if prim.name == "broadcast_in_dim":  # a scalar's broadcast, to the slice's shape
    params = dict(params, shape=tuple(np.shape(next(
        (v for k, v in memo.items() if isinstance(k, tuple)), None))))
  memo[key] = prim.bind(*operands, **params)
  return memo[key]
