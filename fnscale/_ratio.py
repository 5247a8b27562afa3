"""A mean loss read as `(sum, weight)`: token-normalized losses under accumulation.

Flax models' losses divide by the batch's count of non-pad tokens (`jnp.sum(ce * mask) /
jnp.sum(mask)`, `jnp.mean(ce, where=mask)`, a count clipped by `jnp.maximum(., 1)`). Where
`train_step` calls the loss on parts of the batch (microbatches, shards), averaging the
parts' means is not the batch's mean. `find` reads the loss's jaxpr: a loss whose last
operation (through casts, negation, scaling by constants, `jit` wrappers, and sums of such
terms or with terms that don't depend on the batch) divides by a scalar that depends on the
batch and not the params is such a mean, and `split` evaluates the same jaxpr as (numerator,
count), which the step sums over the parts and divides once, as `weighted=True` does. A
count clipped by a constant (`max(count, c)`) is summed unclipped, the clip applied to the
total. A loss that divides by a batch-dependent count in a way that can't be split this way
raises `Unsplittable`.

Dependence is tracked per jaxpr variable: on the params (P), the batch or key (B), or
neither (constants; the frozen params count as constants: they are the same in every part).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
from jax.extend import core
import jax.numpy as jnp
import numpy as np

from fnscale import _compat

P, B = 1, 2
_CASTS = {"convert_element_type", "pvary", "pcast"}  # a value unchanged (dtype, vma type)
_UNARY = _CASTS | {"neg", "copy", "copy_p", "reduce_precision"}
_CALLS = {"jit", "pjit", "closed_call", "core_call"}  # evaluated inline on a split's path
_NONLINEAR = {"sqrt", "rsqrt", "cbrt", "pow", "integer_pow", "exp", "exp2", "log", "log1p",
              "max", "min", "clamp", "select_n", "abs", "square", "logistic", "tanh"}


class Unsplittable(Exception):
  """The loss divides by a batch-dependent scalar but is not a sum over the batch divided by
  a count that sums over the batch's parts; `str(e)` says what was found."""


class Ratio(NamedTuple):
  """A loss found to be a batch sum over a batch count. `floor`: the `c` of a count clipped
  as `max(count, c)` (applied to the total count), or None."""
  floor: float | None


class _Div(NamedTuple):
  """The division of a split: by `den`, the count unclipped (a variable of its jaxpr)."""
  den: object


class _Path(NamedTuple):
  """One jaxpr's part of a split: `roles` maps equation index -> a `_Div`, "linear" (linear
  in the split value) or a `_Path` (a call whose jaxpr holds it); `den` is the count
  (unclipped) where the division is in this jaxpr, `floor` its clip."""
  roles: dict
  den: object = None
  floor: float | None = None


def _inner(eqn):
  """(jaxpr, consts) of an equation calling a sub-jaxpr with its operands 1:1, else None."""
  for name in ("jaxpr", "call_jaxpr"):
    j = eqn.params.get(name)
    if j is None or eqn.primitive.name == "scan":
      continue
    jaxpr, consts = (j.jaxpr, j.consts) if isinstance(j, core.ClosedJaxpr) else (j, ())
    if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
      return jaxpr, consts
  return None


def _read_taint(taint, v) -> int:
  return 0 if isinstance(v, core.Literal) else taint.get(v, 0)


def _taints(jaxpr, ins: list[int]) -> dict:
  """Each variable's dependence (P | B bits) given the invars' `ins`."""
  taint = dict(zip(jaxpr.invars, ins))
  for eqn in jaxpr.eqns:
    got = [_read_taint(taint, v) for v in eqn.invars]
    inner = _inner(eqn)
    if inner is not None:
      sub = _taints(inner[0], got)
      outs = [_read_taint(sub, v) for v in inner[0].outvars]
    elif eqn.primitive.name == "scan":
      outs = _scan_taints(eqn, got)
    else:
      t = 0
      for g in got:
        t |= g
      outs = [t] * len(eqn.outvars)
    taint.update(zip(eqn.outvars, outs))
  return taint


def _scan_taints(eqn, got: list[int]) -> list[int]:
  """A scan's outputs' dependence: its body's, the carry taken to a fixed point."""
  body = eqn.params["jaxpr"].jaxpr
  parts = _compat.scan_parts(eqn)
  nc, ncarry = len(parts.consts), len(parts.carry)
  carry = got[nc:nc + ncarry]
  while True:
    sub = _taints(body, got[:nc] + carry + got[nc + ncarry:])
    outs = [_read_taint(sub, v) for v in body.outvars]
    new = [a | b for a, b in zip(carry, outs[:ncarry])]
    if new == carry:
      return outs
    carry = new


def _producers(jaxpr) -> dict:
  return {v: (i, eqn) for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}


def _static(v, prod, args=None):
  """The constant value of `v` (a literal, maybe cast; in a call's jaxpr an invar bound to a
  literal by `args`, inner invar -> operand), or None."""
  if args and v in args:
    v = args[v]
  if isinstance(v, core.Literal):
    return np.asarray(v.val)
  if v in prod and prod[v][1].primitive.name in _CASTS:
    return _static(prod[v][1].invars[0], prod, args)
  return None


def _strip(jaxpr, prod, d, args=None):
  """(count, floor): `d` itself, or for `d = max(count, c)` (`jnp.maximum`, or `jnp.clip`
  whose jit wraps it) with a constant c > 0, the count (a variable of `jaxpr`) and c."""
  if d not in prod:
    return d, None
  _, eqn = prod[d]
  inner = _inner(eqn) if eqn.primitive.name in _CALLS and args is None else None
  if inner is not None:
    sub = inner[0]
    sargs = dict(zip(sub.invars, eqn.invars))
    got, floor = _strip(sub, _producers(sub), sub.outvars[eqn.outvars.index(d)], sargs)
    if floor is not None and got in sargs and not isinstance(sargs[got], core.Literal):
      return sargs[got], floor
    return d, None
  if eqn.primitive.name == "max":
    for a, b in (eqn.invars, eqn.invars[::-1]):
      c = _static(b, prod, args)
      if c is not None and c.size == 1 and float(c) > 0 and _static(a, prod, args) is None:
        return a, float(c)
  return d, None


def _additive(jaxpr, prod, taint, d) -> bool:
  """Whether the count `d` sums over the batch's parts (a sum, a scan, scaled or shifted by
  constants), not a nonlinear function of one (a square root, a clip not stripped)."""
  while d in prod:
    _, eqn = prod[d]
    name = eqn.primitive.name
    if name in _NONLINEAR:
      return False
    if name in _CASTS or name in ("mul", "div", "add", "sub"):
      ops = [v for v in eqn.invars if _read_taint(taint, v)]
      if len(ops) != 1 or (name == "div" and ops[0] is not eqn.invars[0]):
        return False
      d = ops[0]
      continue
    return True
  return True


def _walk(jaxpr, taint, prod, var) -> _Path | None:
  """The split path of `var` in `jaxpr`: None where `var` isn't a split mean."""
  if isinstance(var, core.Literal) or var not in prod:
    return None
  i, eqn = prod[var]
  name, ops = eqn.primitive.name, eqn.invars
  if name in _UNARY:
    return _extend(_walk(jaxpr, taint, prod, ops[0]), i)
  if name == "mul":
    for a, b in (ops, ops[::-1]):
      if _read_taint(taint, b) == 0:
        return _extend(_walk(jaxpr, taint, prod, a), i)
    return None
  if name == "div":
    t = _read_taint(taint, ops[1])
    if t == 0:
      return _extend(_walk(jaxpr, taint, prod, ops[0]), i)
    if t != B or ops[1].aval.shape:
      return None
    den, floor = _strip(jaxpr, prod, ops[1])
    if not _additive(jaxpr, prod, taint, den):
      raise Unsplittable(f"the loss divides by a count of the batch that is not a sum over "
                         f"its rows ({_describe(prod, ops[1])})")
    return _Path({i: _Div(den)}, den, floor)
  if name in ("add", "sub"):
    paths = [_walk(jaxpr, taint, prod, v) for v in ops]
    found = [p for p in paths if p is not None]
    if not found:
      return None
    for v, p in zip(ops, paths):
      if p is None and _read_taint(taint, v) & B:
        raise Unsplittable("the loss adds a mean over a batch count to a term that depends "
                           "on the batch otherwise")
    return _extend(_merge(found, prod), i)
  if name in _CALLS and _inner(eqn) is not None:
    sub, _ = _inner(eqn)
    subtaint = _taints(sub, [_read_taint(taint, v) for v in ops])
    inner = _walk(sub, subtaint, _producers(sub), sub.outvars[eqn.outvars.index(var)])
    if inner is None:
      return None
    return _Path({i: inner})
  return None


def _extend(path: _Path | None, i: int) -> _Path | None:
  if path is None:
    return None
  return path._replace(roles={**path.roles, i: path.roles.get(i, "linear")})


def _merge(paths: list[_Path], prod) -> _Path:
  """Paths of the terms of a sum: one count for all (the same computation in this jaxpr's
  equations `prod`), or Unsplittable."""
  dens = [d for p in paths for d in _dens(p)]
  own = [p.den for p in paths if p.den is not None]
  if len(own) != len(dens) or not all(_same(d, own[0], prod) for d in own[1:]):
    if len({id(d) for d in dens}) > 1:
      raise Unsplittable("the loss adds means over different counts of the batch")
  roles = {}
  for p in paths:
    for i, r in p.roles.items():
      roles[i] = _merge([roles[i], r], {}) if isinstance(r, _Path) and i in roles else r
  den = next((p for p in paths if p.den is not None), paths[0])
  return _Path(roles, den.den, den.floor)


def _same(a, b, prod, depth: int = 12) -> bool:
  """Whether `a` and `b` are computed alike (the same equations over the same inputs), as
  two `jnp.mean(x, where=mask)` count one mask twice."""
  if a is b:
    return True
  if isinstance(a, core.Literal) or isinstance(b, core.Literal):
    return (isinstance(a, core.Literal) and isinstance(b, core.Literal)
            and np.array_equal(a.val, b.val))
  if depth == 0 or a not in prod or b not in prod:
    return False
  (_, ea), (_, eb) = prod[a], prod[b]
  return (ea.primitive is eb.primitive and ea.params == eb.params
          and ea.outvars.index(a) == eb.outvars.index(b) and len(ea.invars) == len(eb.invars)
          and all(_same(x, y, prod, depth - 1) for x, y in zip(ea.invars, eb.invars)))


def _dens(path: _Path) -> list:
  """The counts a path divides by, in its jaxpr and the calls it goes into."""
  inner = [d for r in path.roles.values() if isinstance(r, _Path) for d in _dens(r)]
  return ([path.den] if path.den is not None else []) + inner


def _floor(path: _Path):
  if path.den is not None:
    return path.floor
  return next((_floor(r) for r in path.roles.values() if isinstance(r, _Path)), None)


def _describe(prod, v) -> str:
  names, seen = [], [v]
  while seen and len(names) < 4:
    x = seen.pop()
    if x in prod:
      names.append(prod[x][1].primitive.name)
      seen.extend(u for u in prod[x][1].invars if not isinstance(u, core.Literal))
  return "computed by " + " <- ".join(names)


def _hidden_count(jaxpr, taint, var) -> str | None:
  """A division by a scalar that depends on the batch and not the params among `var`'s
  ancestors (inside jit wrappers too), described, or None."""
  prod, todo, seen = _producers(jaxpr), [var], set()
  while todo:
    v = todo.pop()
    if isinstance(v, core.Literal) or v in seen or v not in prod:
      continue
    seen.add(v)
    _, eqn = prod[v]
    if (eqn.primitive.name == "div" and _read_taint(taint, eqn.invars[1]) == B
        and not getattr(eqn.invars[1].aval, "shape", (1,))):
      return _describe(prod, eqn.invars[1])
    inner = _inner(eqn)
    if inner is not None:
      sub = inner[0]
      subtaint = _taints(sub, [_read_taint(taint, u) for u in eqn.invars])
      got = _hidden_count(sub, subtaint, sub.outvars[eqn.outvars.index(v)])
      if got is not None:
        return got
    todo.extend(eqn.invars)
  return None


def _plan(closed, ins: list[int]) -> _Path | None:
  jaxpr = closed.jaxpr
  if not jaxpr.outvars or getattr(jaxpr.outvars[0].aval, "shape", None) != ():
    return None  # not a scalar loss: the step's own checks say so
  taint = _taints(jaxpr, ins)
  path = _walk(jaxpr, taint, _producers(jaxpr), jaxpr.outvars[0])
  if path is None:
    hidden = _hidden_count(jaxpr, taint, jaxpr.outvars[0])
    if hidden is not None:
      raise Unsplittable(f"the loss divides by a count of the batch ({hidden}) inside a "
                         "larger expression")
  return path


def find(fn, args, ins: list[int]) -> Ratio | None:
  """Whether `fn(*args)` (whose first output leaf is the loss; `ins`: each flat argument
  leaf's dependence) is a batch sum over a batch count: its `Ratio`, or None.

  Raises:
    Unsplittable: it divides by a batch-dependent scalar in a way that can't be split.
  """
  path = _plan(jax.make_jaxpr(fn)(*args), ins)
  return None if path is None else Ratio(_floor(path))


def split(fn, args, ins: list[int], ratio: Ratio):
  """`fn(*args)` evaluated from its jaxpr as (its outputs, numerator, count): the loss is
  numerator / count, the count unclipped (`ratio.floor` is applied to the total).

  Raises:
    Unsplittable: this trace of `fn` is not the split `find` found.
  """
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  path = _plan(closed, ins)
  if path is None or _floor(path) != ratio.floor:
    raise Unsplittable("the loss traced on a part of the batch divides differently from "
                       "the loss on the whole batch")
  outs, shadow, den = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), path)
  tree = jax.tree.structure(shape)
  return jax.tree.unflatten(tree, outs), shadow[closed.jaxpr.outvars[0]], den


def _eval(jaxpr, consts, args, path: _Path):
  """Evaluates `jaxpr` as `jax.core.eval_jaxpr` does, and along `path` also the split's
  numerator (the `shadow` of each variable on the path). Returns (outputs, shadow, count)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  shadow, den = {}, None
  for i, eqn in enumerate(jaxpr.eqns):
    invals = [read(v) for v in eqn.invars]
    role = path.roles.get(i)
    if isinstance(role, _Path):
      sub, subconsts = _inner(eqn)
      outs, subshadow, den = _eval(sub, subconsts, invals, role)
      shadow.update({o: subshadow[s] for o, s in zip(eqn.outvars, sub.outvars)
                     if s in subshadow})
    elif isinstance(role, _Div):
      # Its value isn't differentiated (the numerator is): a count of 0 would make it nan.
      outs = _compat.bind_equation(eqn, jax.lax.stop_gradient(invals))
    else:
      outs = _compat.bind_equation(eqn, invals)
    env.update(zip(eqn.outvars, outs))
    if isinstance(role, _Div):
      den = read(role.den)
      shadow[eqn.outvars[0]] = invals[0]
    elif role == "linear":
      ops = [_shadow_of(eqn, v, x, shadow, den) for v, x in zip(eqn.invars, invals)]
      shadow[eqn.outvars[0]] = _compat.bind_equation(eqn, ops)[0]
  return [read(v) for v in jaxpr.outvars], shadow, den


def _shadow_of(eqn, v, x, shadow, den):
  """An operand of a linear equation on the path: its numerator where it has one; else a
  constant factor as is, except a term added to a mean (a regularizer of the params), which
  joins the sum times the count, so that sum / count gives it back."""
  if not isinstance(v, core.Literal) and v in shadow:
    return shadow[v]
  if eqn.primitive.name in ("add", "sub"):
    dtype = eqn.outvars[0].aval.dtype
    return jnp.asarray(x, dtype) * jnp.asarray(den, dtype)
  return x
