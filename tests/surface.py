"""fnscale's public surface, read off the package: its public modules and each public name's
spellings.

A module is public when no part of its dotted name starts with "_"; its public names are its
`__all__` (every public module declares one), a name in it that is itself a module being a
public namespace to walk into. A spelling is the dotted path of one such name:
`fnscale.make_mesh`, `fnscale.analysis.hlo.summarize`. Old spellings served by a module's
`__getattr__` (with a DeprecationWarning) are never bound, so the walk doesn't see them.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types

SCALARS = (bool, int, float, complex, str, bytes, type(None))


def submodules(root: str) -> list[str]:
  """Every module under the package `root` (itself included), imported."""
  pkg = importlib.import_module(root)
  names = [root] + [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".")]
  for name in names:
    importlib.import_module(name)
  return names


def is_public(dotted: str) -> bool:
  return not any(part.startswith("_") for part in dotted.split("."))


def public_names(root: str) -> dict[str, object]:
  """{spelling: object} for every name in the `__all__` of every public module reachable from
  `root` through the modules its `__all__`s name."""
  out, todo, seen = {}, [root], set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    module = importlib.import_module(name)
    for attr in getattr(module, "__all__", ()):
      obj = getattr(module, attr)
      out[f"{name}.{attr}"] = obj
      if isinstance(obj, types.ModuleType) and obj.__name__.startswith(root + "."):
        todo.append(obj.__name__)
  return out


def _key(spelling: str, obj) -> object:
  """What makes two spellings name one thing: the object itself, or for a scalar constant
  (a 0 or "auto" could be two unrelated constants) its name, so a re-exported constant still
  counts twice."""
  return ("scalar", spelling.rsplit(".", 1)[1]) if isinstance(obj, SCALARS) else id(obj)


def duplicates(names: dict[str, object]) -> list[list[str]]:
  """The groups of spellings that name one public thing, each sorted."""
  groups: dict[object, list[str]] = {}
  for spelling, obj in names.items():
    groups.setdefault(_key(spelling, obj), []).append(spelling)
  return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _defined_in(obj, root: str) -> bool:
  module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
  return (module or "").split(".")[0] == root


def problems(root: str) -> list[str]:
  """What breaks "one spelling per public thing" under the package `root`, in words:

  - a public module without `__all__`, or whose `__all__` names what it doesn't bind;
  - a public module that no public module's `__all__` names (reached only by its path);
  - a public package binding, under a public name outside its `__all__`, a module of `root`
    or a function or class defined in `root` (a second spelling nobody declared; plain
    modules' imports are their implementation, as PEP 8 has it);
  - a name of a package bound to something other than its submodule of that name (a function
    shadowing its module: `import root.pkg.name as m` gives the function);
  - two public spellings of one thing.
  """
  out = []
  modules = submodules(root)
  names = public_names(root)
  declared = {obj.__name__ for obj in names.values() if isinstance(obj, types.ModuleType)}
  for name in filter(is_public, modules):
    module = sys.modules[name]
    if not hasattr(module, "__all__"):
      out.append(f"{name} has no __all__")
      continue
    out += [f"{name}.__all__ names {a!r}, which {name} doesn't bind"
            for a in module.__all__ if a not in vars(module)]
    if name != root and name not in declared:
      out.append(f"{name} is public but no public __all__ names it: make it private "
                 f"(_{name.rsplit('.', 1)[1]}) or declare it")
    is_pkg = hasattr(module, "__path__")
    for attr, obj in vars(module).items():
      if attr.startswith("_") or attr in module.__all__ or not _defined_in(obj, root):
        continue
      if isinstance(obj, types.ModuleType) or (is_pkg and (inspect.isfunction(obj)
                                                           or inspect.isclass(obj))):
        out.append(f"{name}.{attr} is bound but not in {name}.__all__: a second spelling of "
                   f"{getattr(obj, '__module__', None) or obj.__name__}"
                   f".{getattr(obj, '__qualname__', '')}".rstrip("."))
  for name in modules:
    parent, _, attr = name.rpartition(".")
    if parent and getattr(sys.modules[parent], attr, sys.modules[name]) is not sys.modules[name]:
      out.append(f"{parent}.{attr} is {type(getattr(sys.modules[parent], attr)).__name__} "
                 f"{getattr(sys.modules[parent], attr)!r}, shadowing the module {name}")
  out += [f"one thing, several spellings: {', '.join(g)}" for g in duplicates(names)]
  return out
