"""Old spellings of public names: each still resolves, with a `DeprecationWarning` naming the
one spelling to use instead.

A package lists what moved as `{old name: (where it is now, the spelling to use)}` and sets
`__getattr__ = moved(__name__, table)`: Python calls a module's `__getattr__` (PEP 562) only
for names the module doesn't bind, so the old name is never bound beside the new one, and
`from package import old` warns as `package.old` does. Python's default filter shows a
warning once per line that triggers it. An import of a module path that no longer exists
(`import fnscale.mesh`) is Python's own `ModuleNotFoundError`: no hook on the import system.
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping


def resolve(where: str):
  """The object at `where`: a module ("fnscale.analysis._plan") or "module:attribute"."""
  module, _, attr = where.partition(":")
  obj = importlib.import_module(module)
  return getattr(obj, attr) if attr else obj


def moved(package: str, table: Mapping[str, tuple[str, str]]) -> Callable[[str], object]:
  """A module `__getattr__` for `package` serving the old names in `table`.

  Args:
    package: the module's `__name__`, e.g. "fnscale".
    table: `{old name: (where, use)}`: `where` as for `resolve`, `use` the message's advice,
      e.g. `{"hlo": ("fnscale.analysis.hlo", "fnscale.analysis.hlo")}`.

  Returns:
    `__getattr__(name)`: the object `where` names, after a `DeprecationWarning`
    "fnscale.hlo is deprecated: use fnscale.analysis.hlo"; an `AttributeError` for any other
    name, as Python's own.
  """
  def __getattr__(name: str):  # pylint: disable=invalid-name
    if name not in table:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    where, use = table[name]
    warnings.warn(f"{package}.{name} is deprecated: use {use}", DeprecationWarning,
                  stacklevel=2)
    return resolve(where)
  return __getattr__
