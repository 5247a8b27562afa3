"""The mutation-testing configuration (pyproject.toml's [tool.mutmut], `.ci/mutation`) names
files and tests that exist: a module renamed or moved would otherwise leave mutmut mutating
nothing, or a test selection that collects nothing, with no error until someone runs it."""
import pathlib
import subprocess
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _exists(arg: str) -> bool:
  """A path, or a pytest node id (`file::test`), or `--deselect=<node id>`, that exists."""
  path, _, test = arg.removeprefix("--deselect=").partition("::")
  if not (ROOT / path).is_file():
    return False
  return not test or f"\ndef {test}(" in (ROOT / path).read_text(encoding="utf-8")


def test_pyproject_mutmut_paths_exist():
  cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mutmut"]
  paths = cfg["source_paths"] + cfg["also_copy"] + cfg["only_mutate"]
  paths += cfg["pytest_add_cli_args_test_selection"]
  assert [p for p in paths if not (ROOT / p).exists()] == []
  assert len(cfg["only_mutate"]) == 5


def test_ci_mutation_modules_name_files_and_tests_that_exist():
  r = subprocess.run(["bash", ".ci/mutation", "--list"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60, check=True)
  rows = [line.split() for line in r.stdout.splitlines()]
  assert [row[0] for row in rows] == ["topology", "mesh", "sharding", "hlo", "flops"]
  assert [a for row in rows for a in row[1:] if not _exists(a)] == []
  # Every file the script mutates is one pyproject.toml's full run mutates too.
  cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mutmut"]
  assert sorted(row[1] for row in rows) == sorted(cfg["only_mutate"])
