"""fnscale's five ambient values (`fnscale._context`): declared there only, scoped, and seen
from threads, asyncio tasks and jit's cache as the module's docstring says."""
import ast
import asyncio
import contextlib
import pathlib
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import fnscale as fs
from fnscale import _axes, _context
from fnscale import _loss

ROOT = pathlib.Path(fs.__file__).parent
SHAPE = (8, 128, 2, 64)


@pytest.fixture(scope="module")
def mesh():
  return fs.make_mesh({"data": 8})


def _seen() -> dict:
  """Each ambient value as traced code reads it."""
  return {"mesh": dict(jax.sharding.get_abstract_mesh().shape),
          "axes": _axes.current().head,
          "kernel": fs.kernels.kernel_selection(SHAPE, SHAPE).requested,
          "specs": _context.PARAM_SPECS.value is not None}


NONE_SET = {"mesh": {}, "axes": ("tensor",), "kernel": "auto", "specs": False}
ALL_SET = {"mesh": {"data": 8}, "axes": ("model",), "kernel": "xla", "specs": True}


@contextlib.contextmanager
def _all_but_the_kernel(mesh):
  with fs.with_mesh(mesh), fs.axis_conventions("levanter"):
    with _loss.param_specs({"w": 1}, [NamedSharding(mesh, P())]):
      yield


def test_each_ambient_value_is_declared_in_context_only():
  made = {}
  for f in sorted(ROOT.rglob("*.py")):
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
      if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
          "ContextVar", "make_user_context", "local"):
        made.setdefault(f.relative_to(ROOT).as_posix(), []).append(node.func.attr)
  assert made == {"_context.py": ["ContextVar"] + ["make_user_context"] * 3}


def test_scoped_and_reset(mesh):
  assert _seen() == NONE_SET
  with _all_but_the_kernel(mesh):
    inside = fs.with_kernel(_seen, attention="xla")()
  assert inside == ALL_SET
  assert _seen() == NONE_SET  # each wrapper reset its value on the way out


def test_a_new_thread_sees_none_of_them(mesh):
  got = {}
  thread = threading.Thread(target=lambda: got.update(_seen()))
  with _all_but_the_kernel(mesh):
    fs.with_kernel(lambda: (thread.start(), thread.join()), attention="xla")()
  assert got == NONE_SET


def test_asyncio_tasks_share_jax_s_contexts_but_not_the_axis_conventions(mesh):
  async def setter(ready, done, out):
    with _all_but_the_kernel(mesh):
      ready.set()
      await done.wait()
      out["setter"] = _seen()

  async def reader(ready, done, out):
    await ready.wait()
    out["reader"] = _seen()
    done.set()

  async def main():
    out, ready, done = {}, asyncio.Event(), asyncio.Event()
    await asyncio.gather(setter(ready, done, out), reader(ready, done, out))
    return out

  out = asyncio.run(main())
  assert out["setter"] == {**ALL_SET, "kernel": "auto"}
  # The mesh and the params' specs are jax's thread-local state: the other task sees them;
  # the axis conventions are a ContextVar, copied into each task when it starts.
  assert out["reader"] == {**ALL_SET, "kernel": "auto", "axes": ("tensor",)}
  assert _seen() == NONE_SET


def test_jit_traces_again_under_another_kernel_choice_or_mesh_not_conventions(mesh):
  traces = []

  @jax.jit
  def f(x):
    traces.append((fs.kernels.kernel_selection(SHAPE, SHAPE).requested, _axes.current().head))
    return x + 1

  x = jnp.ones(8)
  f(x)
  fs.with_kernel(f, attention="xla")(x)  # part of jit's cache key: traced again
  with fs.axis_conventions("levanter"):
    f(x)  # not part of it: the first trace is reused
  with fs.with_mesh(mesh):
    f(x)  # the mesh is
  assert traces == [("auto", ("tensor",)), ("xla", ("tensor",)), ("auto", ("tensor",))]
