"""`--help` of many recipes at the cost of one Python start-up (for tests/test_readme.py),
or any command lines of them (for tests/test_bad_input.py).

  python tests/recipe_help.py script|module RECIPE...    (from the repository root)
  python tests/recipe_help.py argv '[["plan", ["--target=v9"]], ...]'   (as scripts)

Imports jax and fnscale once, then forks a child per recipe (as many at a time as the
machine has cores; the rows come in the order asked) that runs it as
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
# What most recipes import through recipes.lm (the data loader and its checkpoints: about a
# third of a child's time); a library, never a `recipes` module.
import grain  # noqa: F401  pylint: disable=unused-import


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


def _start(form: str, name: str, base_path: list[str], args=("--help",), err=None):
  """Forks one child; its stdout (and stderr, unless to the file `err`) go to a pipe.
  Returns what `_finish` collects."""
  sys.stdout.flush()
  sys.stderr.flush()
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write if err is None else err.fileno(), 2)
    code = _child(form, name, base_path, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  os.close(write)
  return pid, read, name, list(args), err


def _finish(pid: int, read: int, name: str, args: list, err) -> dict:
  """A started child's row, once it has exited."""
  chunks = []
  while chunk := os.read(read, 65536):
    chunks.append(chunk)
  os.close(read)
  _, status = os.waitpid(pid, 0)
  result = {"recipe": name, "args": args, "rc": os.waitstatus_to_exitcode(status),
            "out": b"".join(chunks).decode(errors="replace")}
  if err is not None:
    err.seek(0)
    result["err"] = err.read().decode(errors="replace")
    err.close()
  return result


def _run_all(jobs: list[tuple], at_once: int) -> None:
  """Runs `_start(*job)` for each job, `at_once` children at a time (the machine's cores),
  printing each row in the jobs' order. A child blocked on a full pipe waits for its turn
  to be read; the one read first never waits on it."""
  running = []
  for job in jobs:
    if len(running) == at_once:
      print(json.dumps(_finish(*running.pop(0))), flush=True)
    running.append(_start(*job))
  for started in running:
    print(json.dumps(_finish(*started)), flush=True)


def main(argv: list[str]) -> None:
  form, names = argv[1], argv[2:]
  if form not in ("script", "module", "argv"):
    sys.exit(f"recipe_help.py: form {form!r}, expected script, module or argv")
  base_path = sys.path[1:]  # sys.path[0] is tests/, which neither form has
  at_once = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
      os.cpu_count() or 1)  # (macOS has no affinity)
  if form != "argv":
    _run_all([(form, name, base_path) for name in names], at_once)
    return
  _run_all([("script", name, base_path, args, tempfile.TemporaryFile())  # stderr apart
            for name, args in json.loads(names[0])], at_once)


if __name__ == "__main__":
  main(sys.argv)
