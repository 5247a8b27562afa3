"""Lists the public functions of fnscale/ that no test ran, from the `.coverage` data file that
`.ci/coverage` (pytest-cov) writes. Exit status 1 if there is one."""
import ast
import pathlib
import sys

import coverage


def _functions(tree, prefix=""):
  """(qualified name, line, body line numbers) of every public function and method."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      yield from _functions(node, prefix + node.name + ".")
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
        not node.name.startswith("_")):
      body = {n for stmt in node.body for n in range(stmt.lineno, stmt.end_lineno + 1)}
      yield prefix + node.name, node.lineno, body


def main() -> int:
  cov = coverage.Coverage(data_file=".coverage")
  cov.load()
  data = cov.get_data()
  measured = {pathlib.Path(f).resolve(): f for f in data.measured_files()}
  total, missed = 0, []
  for path in sorted(pathlib.Path("fnscale").rglob("*.py")):
    ran = set(data.lines(measured.get(path.resolve(), "")) or ())
    for name, line, body in _functions(ast.parse(path.read_text(encoding="utf-8"))):
      total += 1
      if not body & ran:
        missed.append(f"  {path}:{line} {name}")
  print(f"public functions and methods in fnscale/: {total}; run by no test: {len(missed)}")
  print("\n".join(missed))
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main())
