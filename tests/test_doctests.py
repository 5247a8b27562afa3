"""The examples of every public name run, here on 8 simulated CPU devices.

Every name a public namespace exports (`fnscale.__all__`, `fnscale.analysis.__all__`,
`fnscale.analysis.hlo.__all__`, ...: the surface tests/surface.py reads) has an example
that runs: a function, class or module in an `Examples:` section of its own docstring; a
value (a constant, a preset) in an example of its namespace (the namespace's docstring or a
member's) that names it. An example that needs libtpu says "the tpu extra" in its docstring
and is a `tpu` test, skipped where libtpu is not installed.

They run here rather than under `pytest --doctest-modules` so that they run in this suite's
environment (the 8 devices and the compiled-program reader of conftest.py, which a doctest
collected from `fnscale/` would not get) and in the quick tier by default, and so that a
public name without examples fails.
"""
import doctest
import importlib
import importlib.util
import os
import re
import types

import pytest

import surface

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
NAMES = surface.public_names("fnscale")
DOCUMENTED = {s: o for s, o in NAMES.items() if callable(o) or isinstance(o, types.ModuleType)}
VALUES = {s: o for s, o in NAMES.items() if s not in DOCUMENTED}
TPU_EXTRA = "the tpu extra"


def run_examples(obj, name: str) -> tuple[doctest.TestResults, str]:
  """Runs the examples of `obj`'s own docstring (not its members'), each docstring with
  fresh globals (an example imports what it uses); returns the results and the report of
  any failure. The process environment is restored afterwards (examples may set it, as
  `simulate_cpu_devices` does)."""
  tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  report, environ = [], dict(os.environ)
  try:
    for test in tests:
      runner.run(test, out=report.append)
  finally:
    os.environ.clear()
    os.environ.update(environ)
  return runner.summarize(verbose=False), "".join(report)


def example_sources(obj, name: str) -> str:
  """The source of every example in `obj`'s own docstring."""
  tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
  return "\n".join(e.source for t in tests for e in t.examples)


def needs_libtpu(obj) -> bool:
  return TPU_EXTRA in (obj.__doc__ or "")


def _param(spelling):
  marks = [pytest.mark.tpu] if needs_libtpu(DOCUMENTED[spelling]) else []
  return pytest.param(spelling, marks=marks, id=spelling)


@pytest.mark.parametrize("spelling", [_param(s) for s in sorted(DOCUMENTED)])
def test_examples_of_each_public_name_run(spelling):
  obj = DOCUMENTED[spelling]
  if needs_libtpu(obj) and importlib.util.find_spec("libtpu") is None:
    pytest.skip("its examples describe a TPU target: install fnscale[tpu]")
  assert "Examples:" in (obj.__doc__ or ""), f"{spelling} has no Examples: section"
  results, report = run_examples(obj, spelling)
  assert results.attempted > 0, f"{spelling}: its Examples: section has no example"
  assert results.failed == 0, report


def named_in(name: str, sources: str) -> bool:
  return re.search(rf"\b{re.escape(name)}\b", sources) is not None


@pytest.mark.parametrize("spelling", sorted(VALUES))
def test_each_public_value_is_named_by_an_example_of_its_namespace(spelling):
  # A value has no docstring of its own: an example of its namespace shows it (and runs,
  # as every documented name's examples do above).
  namespace, name = spelling.rsplit(".", 1)
  documented = {namespace: importlib.import_module(namespace)}
  documented.update({s: o for s, o in DOCUMENTED.items() if s.rsplit(".", 1)[0] == namespace})
  sources = "\n".join(example_sources(o, s) for s, o in documented.items())
  assert named_in(name, sources), (
      f"{spelling} is named by no example of {namespace} (its docstring or a member's)")


def test_every_public_name_is_covered():
  # 100%: each public name is either documented (runs its own examples) or a value (named by
  # its namespace's examples); the walk found the namespaces users reach.
  assert set(DOCUMENTED) | set(VALUES) == set(NAMES)
  assert len(NAMES) > 150 and "fnscale.analysis.hlo.summarize" in DOCUMENTED
  assert {"fnscale.ACCUM_GATHER", "fnscale.CHIP_FACTS", "fnscale.FNSCALE_AXES"} <= set(VALUES)


def test_a_wrong_example_fails_and_says_where():
  def double(x):
    """Doubles.

    Examples:
      >>> 2 * 2
      5
    """
    return 2 * x

  results, report = run_examples(double, "double")
  assert results == doctest.TestResults(failed=1, attempted=1)
  assert "Expected:\n    5\nGot:\n    4" in report
  # An example that raises fails too, and the environment an example changes is restored.
  def setenv():
    """Examples:
      >>> import os
      >>> os.environ["FNSCALE_DOCTEST_PROBE"] = "1"
      >>> 1 / 0
    """
  results, report = run_examples(setenv, "setenv")
  assert results.failed == 1 and "ZeroDivisionError" in report
  assert "FNSCALE_DOCTEST_PROBE" not in os.environ


def test_a_value_is_named_as_a_word_and_only_in_examples():
  def documented():
    """EXIT_CODE is in prose only.

    Examples:
      >>> MAX_STEPS_S = 1  # a longer name holding the short one
    """
  sources = example_sources(documented, "documented")
  assert not named_in("EXIT_CODE", sources) and not named_in("MAX_STEPS", sources)
  assert named_in("MAX_STEPS_S", sources)
