"""The package's modules import one another in one direction: no import cycle, counting the
imports inside functions too (a function-level import hides a cycle from Python, not from
the reader), and no module inside the package imports the package root. Importing fnscale or
a launcher imports no optional framework (Flax, Equinox, Ray).

recipes/ is a package with the same rules and one of its own: the jobs and tools (train_lm,
the commands beside it, bench/, launch/, examples/) import `recipes.lm`, `recipes.lm` imports
only itself and fnscale, fnscale never imports recipes, and no recipe imports a private part
of fnscale (recipes are what users copy). Each recipe runs as a script and as a module
through the install alone: no recipe edits `sys.path` and every import is at the top of its
module."""
import ast
import os
import re
import pathlib
import subprocess
import sys

import fnscale

ROOT = pathlib.Path(fnscale.__file__).parent
RECIPES = ROOT.parent / "recipes"


def _modules(root: pathlib.Path = ROOT) -> dict:
  """{dotted module name: file} for every .py file under `root` (packages by __init__; the
  package is named as its folder)."""
  out = {}
  for f in sorted(root.rglob("*.py")):
    parts = (root.name,) + f.relative_to(root).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  return out


def _targets(node, name: str, is_pkg: bool, modules) -> list:
  """The package modules one import statement names (`from a import b` names a.b when b is a
  module, else a; relative imports resolved against `name`)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name in modules]
  base = node.module or ""
  if node.level:
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    pkg = pkg[:len(pkg) - node.level + 1]
    base = ".".join(pkg + ([base] if base else []))
  found = []
  for a in node.names:
    sub = f"{base}.{a.name}"
    found.append(sub if sub in modules else base)
  return [m for m in found if m in modules]


def import_graph(root: pathlib.Path = ROOT) -> dict:
  """{module: sorted modules it imports}, module-level and function-level imports alike."""
  modules = _modules(root)
  graph = {}
  for name, f in modules.items():
    is_pkg = f.name == "__init__.py"
    deps = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        deps.update(_targets(node, name, is_pkg, modules))
    deps.discard(name)
    graph[name] = sorted(deps)
  return graph


def cycles(graph: dict) -> list:
  """The strongly connected components with more than one module (Tarjan), each sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def test_the_graph_reader_sees_function_level_and_relative_imports(tmp_path):
  pkg = tmp_path / "fnscale"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from fnscale import a\n")
  (pkg / "a.py").write_text("def f():\n  from fnscale import b\n")
  (pkg / "b.py").write_text("import fnscale.sub.c\nfrom fnscale.errors import X\n")
  (pkg / "errors.py").write_text("X = 1\n")
  (pkg / "sub" / "__init__.py").write_text("from . import c\n")
  (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..errors import X\n")
  g = import_graph(pkg)
  assert g == {"fnscale": ["fnscale.a"], "fnscale.a": ["fnscale.b"],
               "fnscale.b": ["fnscale.errors", "fnscale.sub.c"], "fnscale.errors": [],
               "fnscale.sub": ["fnscale.sub.c"],
               "fnscale.sub.c": ["fnscale.a", "fnscale.errors"]}
  assert cycles(g) == [["fnscale.a", "fnscale.b", "fnscale.sub.c"]]
  assert cycles({"x": ["y"], "y": ["z"], "z": []}) == []


def test_no_import_cycles():
  assert cycles(import_graph()) == []


def test_no_module_imports_the_package_root():
  graph = import_graph()
  assert [m for m, deps in graph.items() if m != "fnscale" and "fnscale" in deps] == []


def test_the_package_layout_names_every_module_and_only_those():
  table = fnscale.__doc__.split("Layout of the package:", 1)[1]
  named = set()
  for row in table.splitlines():
    if row.startswith("| `"):
      named.update(re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[1]))
  files = {f.relative_to(ROOT).as_posix() for f in ROOT.glob("*.py") if f.name != "__init__.py"}
  files |= {d.name + "/" for d in ROOT.iterdir() if (d / "__init__.py").exists()}
  assert named == files


def test_the_main_jobs_map_names_every_module():
  # recipes/lm's package docstring: every module named, and each line's lead a module.
  import recipes.lm  # pylint: disable=import-outside-toplevel
  files = {f.stem for f in (ROOT.parent / "recipes" / "lm").glob("*.py")} - {"__init__"}
  assert files <= set(re.findall(r"`(\w+)`", recipes.lm.__doc__))
  assert set(re.findall(r"^- `(\w+)`", recipes.lm.__doc__, re.M)) <= files


# What each layer may import: the core pipeline (the root modules) imports only itself; a
# subpackage imports the core, itself and the layers named here (DESIGN: core <- kernels,
# parallel <- multihost, checkpoint <- analysis). `cloud` and `adapters` are core-level glue.
MAY_IMPORT = {
    "core": {"core"},
    "kernels": {"core", "kernels"},
    "parallel": {"core", "kernels", "parallel"},
    "multihost": {"core", "multihost"},
    "checkpoint": {"core", "multihost", "checkpoint"},
    "analysis": {"core", "kernels", "parallel", "analysis"},
}


def layer(module: str) -> str:
  """The layer of a dotted fnscale module: its subpackage, or "core" for a root module."""
  parts = module.split(".")
  return parts[1] if len(parts) > 2 or parts[1:] and parts[1] in MAY_IMPORT else "core"


def layering_violations(graph: dict) -> list:
  """(module, imported module) pairs where a layer imports one above or beside it."""
  return [(m, d) for m, deps in sorted(graph.items()) if m != "fnscale"
          for d in deps if d != "fnscale" and layer(d) not in MAY_IMPORT[layer(m)]]


def test_the_layering_check_catches_an_upward_import(tmp_path):
  pkg = tmp_path / "fnscale"
  for sub in ("multihost", "checkpoint", "kernels"):
    (pkg / sub).mkdir(parents=True)
    (pkg / sub / "__init__.py").write_text("")
  (pkg / "__init__.py").write_text("")
  (pkg / "mesh.py").write_text("from fnscale.kernels import attention\n")      # core -> kernels
  (pkg / "kernels" / "attention.py").write_text("from fnscale import mesh\n")  # fine
  (pkg / "multihost" / "sync.py").write_text("from fnscale.checkpoint import x\n")  # beside
  (pkg / "checkpoint" / "x.py").write_text("from fnscale.multihost import sync\n")  # fine
  assert layering_violations(import_graph(pkg)) == [
      ("fnscale.mesh", "fnscale.kernels.attention"),
      ("fnscale.multihost.sync", "fnscale.checkpoint.x")]


def test_each_layer_imports_only_the_layers_below_it():
  assert set(ROOT.iterdir()) >= {ROOT / name for name in MAY_IMPORT if name != "core"}
  assert layering_violations(import_graph()) == []


def test_importing_fnscale_or_a_launcher_imports_no_optional_framework():
  # Flax and Equinox (what users embed fnscale in) and Ray (the Ray launcher's extra) are
  # imported by the code that uses them, never by `import fnscale` or a launcher's import.
  code = ("import sys, fnscale; from recipes.launch import launch_local, launch_ray; "
          "print([m for m in ('flax', 'equinox', 'ray') if m in sys.modules])")
  repo = ROOT.parent
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)), check=False)
  assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["[]"], (r.stdout, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------------
# recipes/: a package with a rule of its own
# ------------------------------------------------------------------------------------------------


def recipe_layer(module: str) -> str:
  """"lm" for recipes.lm and its modules, "job" for every other recipes module (train_lm,
  the tools beside it, bench/, launch/, examples/)."""
  return "lm" if module.split(".")[:2] == ["recipes", "lm"] else "job"


def recipe_violations(graph: dict) -> list:
  """(module, imported module) pairs where recipes.lm imports a job or tool."""
  return [(m, d) for m, deps in sorted(graph.items()) for d in deps
          if recipe_layer(m) == "lm" and recipe_layer(d) == "job"]


def path_edits(tree: ast.AST) -> list[int]:
  """Lines of a module that change `sys.path` (a call of one of its methods, an assignment
  to it or to a slice of it)."""
  def is_path(node):
    return isinstance(node, ast.Attribute) and node.attr == "path" and (
        isinstance(node.value, ast.Name) and node.value.id == "sys")
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_path(
        node.func.value):
      lines.append(node.lineno)
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AugAssign) else [])
    for t in targets:
      if is_path(t) or (isinstance(t, ast.Subscript) and is_path(t.value)):
        lines.append(node.lineno)
  return sorted(lines)


def late_imports(tree: ast.Module) -> list[int]:
  """Lines of module-level imports that follow other code (what a linter calls E402): the
  docstring and `from __future__` aside, a recipe's imports come first."""
  seen_code, lines = False, []
  for i, node in enumerate(tree.body):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      if seen_code:
        lines.append(node.lineno)
    elif not (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
      seen_code = True
  return lines


def private_imports(tree: ast.AST) -> list[int]:
  """Lines of a module that import a private part of fnscale (a dotted name with a part
  starting with "_": `fnscale.analysis._forecast`, `from fnscale.analysis import _cost`).
  Recipes are what users copy: they reach fnscale through its public names only."""
  private = lambda name: name.split(".")[0] == "fnscale" and any(
      p.startswith("_") for p in name.split("."))
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                               if a.name[0].islower() or a.name.startswith("_")]
    else:
      continue
    if any(private(n) for n in names):
      lines.append(node.lineno)
  return lines


# The one path edit recipes/ holds: compare_maxtext.py's fnscale side runs in MaxText's own
# interpreter (another virtual environment, where fnscale is not installed).
PATH_EDITS_ALLOWED = {"recipes/bench/compare_maxtext.py"}


def test_the_recipe_checks_catch_a_cycle_an_upward_import_and_a_path_edit(tmp_path):
  pkg = tmp_path / "recipes"
  (pkg / "lm").mkdir(parents=True)
  for f in ("__init__.py", "lm/__init__.py"):
    (pkg / f).write_text("")
  (pkg / "train.py").write_text("from recipes.lm import a\n")                      # fine
  (pkg / "lm" / "a.py").write_text("def f():\n  from recipes.lm import b\n")
  (pkg / "lm" / "b.py").write_text("from recipes.lm import a\nfrom recipes import tool\n")
  (pkg / "tool.py").write_text("X = 1\n")
  g = import_graph(pkg)
  assert cycles(g) == [["recipes.lm.a", "recipes.lm.b"]]
  assert recipe_violations(g) == [("recipes.lm.b", "recipes.tool")]
  script = ("import os, sys\nif not __package__:\n  sys.path.insert(0, '..')\n"
            "import jax\nsys.path[:0] = ['x']\nsys.path = []\nprint(sys.path[0])\n")
  tree = ast.parse(script)
  assert path_edits(tree) == [3, 5, 6] and late_imports(tree) == [4]
  imports = ("import fnscale as fs\nfrom fnscale.analysis import hlo, predict\n"
             "from fnscale.analysis._forecast import CHIP\nimport fnscale._step\n"
             "from fnscale.analysis import _cost\ndef f():\n  from fnscale import _tree\n")
  assert private_imports(ast.parse(imports)) == [3, 4, 5, 7]
  assert late_imports(ast.parse('"""doc."""\nfrom __future__ import annotations\nimport os\n'
                                "X = 1\n")) == []


def test_recipes_import_in_one_direction_without_cycles():
  graph = import_graph(RECIPES)
  assert {"recipes.train_lm", "recipes.lm.options", "recipes.bench.step"} <= set(graph)
  assert cycles(graph) == []
  assert recipe_violations(graph) == []
  # fnscale, below every recipe, imports none.
  assert not [m for m, f in _modules().items()
              if re.search(r"^\s*(from|import) recipes\b", f.read_text(), re.M)]


def test_no_recipe_edits_sys_path_or_imports_after_code():
  files = sorted(RECIPES.rglob("*.py"))
  edits = {f.relative_to(ROOT.parent).as_posix(): path_edits(ast.parse(f.read_text()))
           for f in files}
  assert {f for f, lines in edits.items() if lines} == PATH_EDITS_ALLOWED
  late = {f.relative_to(ROOT.parent).as_posix(): late_imports(ast.parse(f.read_text()))
          for f in files}
  assert {f: lines for f, lines in late.items() if lines} == {}
  assert not [f for f in files if "noqa: E402" in f.read_text()]


# recipes/lm's modules stay readable whole: one job each, at most this many lines.
LM_MODULE_LINES = 350
LM_OVER = set()


def test_recipes_lm_modules_stay_within_their_line_bound():
  lengths = {f.name: len(f.read_text().splitlines()) for f in (RECIPES / "lm").glob("*.py")}
  assert {f for f, n in lengths.items() if n > LM_MODULE_LINES} <= LM_OVER


# train_lm's values stay small: each group of its options, and each part of a run.
VALUE_FIELDS = 12


def test_train_lms_options_and_run_are_groups_of_a_handful_of_fields():
  import dataclasses  # pylint: disable=import-outside-toplevel
  from recipes.lm import cli, options, run_setup  # pylint: disable=import-outside-toplevel
  groups = [f.metadata.get("group") for f in dataclasses.fields(options.Options)]
  assert all(groups)  # every option in a group
  sizes = {g.__name__: len(dataclasses.fields(g)) for g in [options.Options, *groups]}
  sizes.update({t.__name__: len(t._fields) for t in (
      run_setup.Setup, run_setup.Run, run_setup.Compiled, run_setup.Evals, run_setup.Records)})
  assert {name: n for name, n in sizes.items() if n > VALUE_FIELDS} == {}
  # Each option is still one flag and one keyword: no name in two groups.
  assert sum(len(dataclasses.fields(g)) for g in groups) == len(cli.leaves(options.Options))


def test_no_recipe_imports_a_private_part_of_fnscale():
  found = {f.relative_to(ROOT.parent).as_posix(): private_imports(ast.parse(f.read_text()))
           for f in sorted(RECIPES.rglob("*.py"))}
  assert {f: lines for f, lines in found.items() if lines} == {}


def test_train_lm_options_import_nothing_that_runs():
  # The options are the bottom of recipes.lm: the run's machinery depends on them, never the
  # reverse (their words come from fnscale's constants and their own module).
  graph = import_graph(RECIPES)
  assert [d for d in graph["recipes.lm.options"] if d != "recipes.lm.cli"] == []
  assert graph["recipes.lm.cli"] == []


def test_run_from_the_folder_above_the_clone_the_error_says_the_folder_hides_the_package(
    tmp_path):
  """From the folder that holds the clone (named fnscale), Python's first search path is that
  folder, and `import fnscale` gets the clone's own folder (a namespace package, no names)
  instead of the package: the main job says so, and how to run it, instead of failing on a
  missing name."""
  (tmp_path / "fnscale").symlink_to(ROOT.parent, target_is_directory=True)  # the clone
  (tmp_path / "recipes").symlink_to(RECIPES, target_is_directory=True)  # as the install finds it
  out = subprocess.run([sys.executable, "-m", "recipes.train_lm", "--help"], cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode != 0
  assert (f"ImportError: 'import fnscale' found the folder {tmp_path / 'fnscale'}, not the "
          "fnscale package") in out.stderr, out.stderr[-2000:]
  assert "Fix: run from inside the clone" in out.stderr
