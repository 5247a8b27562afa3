"""`--help` of many recipes at the cost of one Python start-up (for tests/test_readme.py),
or any command lines of them (for tests/test_bad_input.py).

  python tests/recipe_help.py script|module RECIPE...    (from the repository root)
  python tests/recipe_help.py argv '[["plan", ["--target=v9"]], ...]'   (as scripts)

Imports jax and fnscale once, then forks a child per recipe that runs it as
`python recipes/RECIPE.py --help` (`script`: the recipe's folder first on sys.path) or
`python -m recipes.RECIPE --help` (`module`: the working directory first) would, and prints
one JSON line per recipe: {"recipe", "args", "rc" (exit status), "out" (stdout and stderr;
the argv form: stdout, and stderr apart in "err")}. Each
child starts without any `recipes` module imported, as a fresh process does, so a recipe that
only imports as one form fails here as it would there.
"""
import json
import os
import runpy
import sys
import tempfile
import traceback

import fnscale  # noqa: F401  (imported once, before the forks: what every recipe imports)
import jax  # noqa: F401


def _child(form: str, name: str, base_path: list[str], args=("--help",)) -> int:
  root = os.getcwd()
  try:
    if form == "script":
      path = os.path.join("recipes", f"{name}.py")  # as typed: argv[0] is relative
      sys.path[:] = [os.path.dirname(os.path.join(root, path)), *base_path]
      sys.argv = [path, *args]
      runpy.run_path(path, run_name="__main__")
    else:
      sys.path[:] = [root, *base_path]
      sys.argv = ["-m", *args]  # run_module puts the module's path in argv[0], as -m does
      runpy.run_module("recipes." + name.replace("/", "."), run_name="__main__", alter_sys=True)
    return 0
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)  # what the interpreter prints for sys.exit("message")
    return 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    return 1


def _run(form: str, name: str, base_path: list[str], args=("--help",), err=None) -> dict:
  """Runs one child; its stderr goes to the file `err` where given (else with stdout)."""
  sys.stdout.flush()
  sys.stderr.flush()
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child: its stdout (and stderr, unless `err`) go to the pipe
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write if err is None else err.fileno(), 2)
    code = _child(form, name, base_path, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  os.close(write)
  chunks = []
  while chunk := os.read(read, 65536):
    chunks.append(chunk)
  os.close(read)
  _, status = os.waitpid(pid, 0)
  result = {"recipe": name, "args": list(args), "rc": os.waitstatus_to_exitcode(status),
            "out": b"".join(chunks).decode(errors="replace")}
  if err is not None:
    err.seek(0)
    result["err"] = err.read().decode(errors="replace")
  return result


def main(argv: list[str]) -> None:
  form, names = argv[1], argv[2:]
  if form not in ("script", "module", "argv"):
    sys.exit(f"recipe_help.py: form {form!r}, expected script, module or argv")
  base_path = sys.path[1:]  # sys.path[0] is tests/, which neither form has
  if form != "argv":
    for name in names:
      print(json.dumps(_run(form, name, base_path)), flush=True)
    return
  for name, args in json.loads(names[0]):  # stderr apart: {"err"} beside {"out"}
    with tempfile.TemporaryFile() as err:
      print(json.dumps(_run("script", name, base_path, args, err)), flush=True)


if __name__ == "__main__":
  main(sys.argv)
