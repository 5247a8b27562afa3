"""The package's modules import one another in one direction: no import cycle, counting the
imports inside functions too (a function-level import hides a cycle from Python, not from
the reader), and no module inside the package imports the package root. Importing fnscale or
a launcher imports no optional framework (Flax, Equinox, Ray)."""
import ast
import os
import re
import pathlib
import subprocess
import sys

import fnscale

ROOT = pathlib.Path(fnscale.__file__).parent


def _modules(root: pathlib.Path = ROOT) -> dict:
  """{dotted module name: file} for every .py file under `root` (packages by __init__)."""
  out = {}
  for f in sorted(root.rglob("*.py")):
    parts = ("fnscale",) + f.relative_to(root).with_suffix("").parts
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


def test_the_readme_layout_names_every_module_and_only_those():
  readme = (ROOT.parent / "README.md").read_text()
  table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
  named = set()
  for row in table.splitlines():
    if row.startswith("| `"):
      named.update(re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[1]))
  files = {f.relative_to(ROOT).as_posix() for f in ROOT.glob("*.py") if f.name != "__init__.py"}
  files |= {d.name + "/" for d in ROOT.iterdir() if (d / "__init__.py").exists()}
  assert named == files


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
