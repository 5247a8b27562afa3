"""The `Examples:` of every public name of the pipeline run, here on 8 simulated CPU devices.

Each name `fnscale.__all__` exports (errors aside) must have an `Examples:` section in its
docstring, and its examples must give the output they show. They run here rather than under
`pytest --doctest-modules` so that they run in this suite's environment (the 8 devices and
the compiled-program reader of conftest.py, which a doctest collected from `fnscale/` would
not get) and in the quick tier by default, and so that a public name without examples fails.
"""
import doctest
import os

import pytest

import fnscale as fs

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
PIPELINE = [n for n in fs.__all__
            if not (isinstance(getattr(fs, n), type) and issubclass(getattr(fs, n), Exception))]


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


@pytest.mark.parametrize("name", [n for n in PIPELINE if not n.endswith("_AXES")])
def test_examples_of_each_public_name_run(name):
  obj = getattr(fs, name)
  assert "Examples:" in (obj.__doc__ or ""), f"fnscale.{name} has no Examples: section"
  results, report = run_examples(obj, f"fnscale.{name}")
  assert results.attempted > 0, f"fnscale.{name}: its Examples: section has no example"
  assert results.failed == 0, report


def test_the_axis_presets_are_shown_by_their_type():
  # The presets are values of AxisConventions, whose examples show them.
  assert {n for n in PIPELINE if n.endswith("_AXES")} == {
      "FNSCALE_AXES", "LEVANTER_AXES", "MAXTEXT_AXES"}
  assert all(isinstance(getattr(fs, n), fs.AxisConventions) for n in PIPELINE
             if n.endswith("_AXES"))
  assert "LEVANTER_AXES" in fs.AxisConventions.__doc__


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
