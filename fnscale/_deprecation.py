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


def renamed_field(owner: str, old: str, new: str) -> property:
  """A read-only attribute `old` of a value whose field is now `new` (a NamedTuple field
  renamed): reading it warns "Plan.accum is deprecated: use Plan.accum_steps" and gives
  `new`'s value."""
  def get(self):
    warnings.warn(f"{owner}.{old} is deprecated: use {owner}.{new}", DeprecationWarning,
                  stacklevel=2)
    return getattr(self, new)
  return property(get, doc=f"Deprecated spelling of `{new}`.")


def renamed_keyword(function: str, old: str, new: str, old_value, new_value):
  """The value of keyword `new` of `function`, given as its old spelling `old` (not None:
  a `DeprecationWarning`) or as `new_value`; TypeError for both, as Python's own for a
  keyword given twice."""
  if old_value is None:
    return new_value
  if new_value is not None:
    raise TypeError(f"{function}() got {old}= and {new}=: {old} is the deprecated "
                    f"spelling of {new}, give {new} alone")
  warnings.warn(f"{function}({old}=...) is deprecated: use {new}=", DeprecationWarning,
                stacklevel=3)
  return old_value
