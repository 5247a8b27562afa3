"""Arrays a user's function closes over that fnscale's own `jax.shard_map`s can't take.

A function traced inside `jax.shard_map` may not close over an array sharded on Explicit
mesh axes (jax raises NotImplementedError, jax#29162: the array would have to be passed as
an argument, and fnscale can't rewrite the user's closure). Where fnscale runs the user's
loss or step per shard (`shard_step(mode="shard_map")`, `train_step`'s per-shard
microbatch loop, a pipeline's stages) it turns that error into one naming the array, found
by walking the function's closure, and the fix.
"""
from __future__ import annotations

import functools
import types
from typing import NamedTuple

import jax

from fnscale import _compat
from fnscale import _tree

# Auto axes: jax gathers a closed-over array whole into every shard, so the loss sees what
# it sees on one device.
FIX = ("fix: give that array Auto axis types, e.g. jax.device_put(x, jax.sharding."
       "NamedSharding(fs.make_mesh(<the same axes>, axis_types='auto'), spec)), which jax "
       "gathers whole into every shard, or pass it as an argument (in the params, with a "
       "zero update: optax.multi_transform / optax.set_to_zero)")


class Closure(NamedTuple):
  """Closed-over arrays on Explicit axes: `names` ('frozen', 'tables/a') found in the
  closure of `owner` ("the loss", "the step"), maybe none, and `aval`, jax's text for the
  one it met."""
  names: tuple[str, ...]
  aval: str
  owner: str = "the function"

  def describe(self) -> str:
    what = (", ".join(repr(n) for n in self.names) if self.names
            else "an array") + (f" ({self.aval.strip()})" if self.aval else "")
    return (f"{self.owner} closes over {what}, sharded on Explicit mesh axes, which jax "
            "can't take into a shard_map (jax#29162)")

  def message(self, where: str, fix: str = FIX) -> str:
    return f"{where}: {self.describe()}; {fix}."


def explicit_closure(err: BaseException, fn, owner: str = "the function") -> Closure | None:
  """The `Closure` behind `err` when it is jax's refusal of a closed-over Explicit-sharded
  array inside a shard_map (else None), naming the arrays `fn` closes over."""
  aval = _compat.explicit_closure_aval(err)
  if aval is None:
    return None
  names = tuple(name for name, _ in closed_arrays(fn))
  if not aval and not names and isinstance(err, ValueError):
    return None  # jax's lowering refusal names no array: without one found, not a closure
  return Closure(names, aval, owner)


def _explicit(x) -> bool:
  sharding = getattr(x, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return (isinstance(x, jax.Array) and mesh is not None
          and jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())))


def _arrays(name: str, value) -> list[tuple[str, jax.Array]]:
  """(name, array) for the Explicit-sharded arrays in `value` (an array or a pytree)."""
  if _explicit(value):
    return [(name, value)]
  if not isinstance(value, (dict, list, tuple)):
    return []
  return [(f"{name}/{path}", x) for path, x in _tree.leaves_with_paths(value) if _explicit(x)]


def _references(fn) -> list[tuple[str, object]]:
  """(name, value) of what `fn` refers to outside itself: partial arguments, a wrapped
  function, closure cells and the globals its code (and nested code) names."""
  if isinstance(fn, functools.partial):
    return ([("partial", fn.func)] + [(f"argument {i}", a) for i, a in enumerate(fn.args)]
            + list(fn.keywords.items()))
  out = [("wrapped", fn.__wrapped__)] if hasattr(fn, "__wrapped__") else []
  if isinstance(fn, types.MethodType):
    return out + [("self", fn.__self__), ("method", fn.__func__)]
  code = getattr(fn, "__code__", None)
  if code is None:
    return out
  cells = fn.__closure__ or ()
  out += [(n, c.cell_contents) for n, c in zip(code.co_freevars, cells)
          if _has_contents(c)]
  names, stack = set(), [code]
  while stack:
    c = stack.pop()
    names.update(c.co_names)
    stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
  g = getattr(fn, "__globals__", {})
  return out + [(n, g[n]) for n in sorted(names) if n in g]


def _has_contents(cell) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
  except ValueError:  # an empty cell
    return False
  return True


def _callables(value) -> list:
  """The functions `value` is or holds directly (a tuple, list or dict of them, such as a
  NamedTuple of settings)."""
  if isinstance(value, (type, types.ModuleType)):
    return []
  if callable(value):
    return [value]
  items = value.values() if isinstance(value, dict) else (
      value if isinstance(value, (tuple, list)) else ())
  return [v for v in items if callable(v) and not isinstance(v, (type, types.ModuleType))]


def closed_arrays(fn, depth: int = 4) -> list[tuple[str, jax.Array]]:
  """(name, array) for arrays sharded on Explicit axes that `fn` reaches through its
  closure, partial arguments and globals, following functions up to `depth` deep."""
  found, seen, todo = [], set(), [(fn, depth)]
  while todo:
    f, d = todo.pop()
    if id(f) in seen or d < 0:
      continue
    seen.add(id(f))
    for name, value in _references(f):
      arrays = [(n, x) for n, x in _arrays(name, value) if id(x) not in seen]
      found += arrays
      seen.update(id(x) for _, x in arrays)
      todo += [(c, d - 1) for c in _callables(value)]
  return found
