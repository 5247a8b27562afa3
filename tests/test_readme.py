"""The README's commands, run as a newcomer runs them: in order, in a fresh copy of the
repository's files, with fnscale importable the way `pip install -e .` makes it and nothing
else (so `python recipes/X.py` has to find `recipes` itself, from any directory).

What runs and what is checked (the README's Tests section says the same, for whoever adds a
command): every ```bash and ```python block of README.md, recipes/README.md,
recipes/examples/README.md and recipes/bench/README.md (`READMES`, in that order) runs as
written, in order, unless the line directly above it is a marker:

  <!-- readme-test: run: OLD => NEW; OLD2 => NEW2 -->   runs, with these text substitutions
                                                        (smaller sizes for the test)
  <!-- readme-test: check: WHY -->                      not run (needs a TPU, GPU, cluster,
                                                        network, or minutes); checked
  <!-- readme-test: extra: EXTRA,... -->                runs where these extras of
                                                        pyproject.toml are installed (a block
                                                        that needs libtpu: `tpu`), else
                                                        checked only

Checked means: each `python recipes/X.py --flag` (or `-m recipes.X`) has its flags looked up
in that recipe's `--help`; each Python name reached through `fnscale` or `recipes` exists and
each call's keywords fit its signature (`train_lm(...)` keywords: its `Options`); each
`pip install .[extras]` names extras of pyproject.toml; each `.ci/...` script exists. The same
checks apply to the `$ ...` lines of blocks without a language (example output) and to
`python recipes/...` commands quoted inline in the text. `pip install`, `python -m pytest`
and `.ci/...` (this suite) are never run, only checked.
"""
from __future__ import annotations

import ast
import concurrent.futures
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- readme-test: (run|check|extra): (.+?) -->")
SHELL, PYTHON = ("bash", "sh", "shell"), ("python",)


class ReadmeError(Exception):
  """A README marker that can't be followed (malformed, misplaced, stale)."""


class Block(NamedTuple):
  """One fenced code block: its first line in the README, language, text, and what the test
  does with it: "run" (with `subs`, (old, new) pairs; only where the extras `needs` names
  are installed), "check" (`why`) or "text"."""
  line: int
  lang: str
  code: str
  mode: str
  subs: tuple = ()
  why: str = ""
  needs: tuple = ()


def read_blocks(text: str) -> list[Block]:
  """The fenced code blocks of a markdown text with their markers applied.

  Raises:
    ReadmeError: a malformed marker, one not directly above a bash or python block, or a
      substitution whose text is not in its block.
  """
  lines, blocks, marker, i = text.splitlines(), [], None, 0
  while i < len(lines):
    line = lines[i].strip()
    if line.startswith("<!-- readme-test"):
      m = MARKER.fullmatch(line)
      if not m:
        raise ReadmeError(f"README line {i + 1}: malformed marker {line!r}; write "
                          "<!-- readme-test: run: OLD => NEW -->, <!-- readme-test: check: "
                          "WHY --> or <!-- readme-test: extra: EXTRA -->")
      marker = (i + 1, m[1], m[2].strip())
      if i + 1 >= len(lines) or not lines[i + 1].strip().startswith("```"):
        raise ReadmeError(f"README line {i + 1}: the marker must be directly above a code "
                          "block")
    elif line.startswith("```"):
      end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")),
                 len(lines))
      lang = line[3:].strip().lower()
      blocks.append(_block(i + 1, lang, "\n".join(lines[i + 1:end]), marker))
      marker, i = None, end
    i += 1
  return blocks


def _block(line: int, lang: str, code: str, marker) -> Block:
  if marker is None:
    return Block(line, lang, code, "run" if lang in SHELL + PYTHON else "text")
  at, mode, detail = marker
  if lang not in SHELL + PYTHON:
    raise ReadmeError(f"README line {at}: a marker above a ```{lang} block; markers are for "
                      "bash and python blocks")
  if mode == "check":
    return Block(line, lang, code, "check", why=detail)
  if mode == "extra":
    return Block(line, lang, code, "run", needs=tuple(e.strip() for e in detail.split(",")))
  subs = []
  for part in detail.split(";"):
    old, sep, new = part.partition("=>")
    old, new = old.strip(), new.strip()
    if not sep or not old:
      raise ReadmeError(f"README line {at}: substitution {part.strip()!r}; write OLD => NEW")
    if old not in code:
      raise ReadmeError(f"README line {at}: {old!r} is not in the block below the marker "
                        "(update the marker with the block)")
    subs.append((old, new))
  return Block(line, lang, code, "run", subs=tuple(subs))


def shell_commands(code: str, prompt: bool = False) -> list[str]:
  """Commands of a shell block: lines joined across trailing backslashes, blank and comment
  lines dropped. `prompt`: only lines starting with "$ " (example output), prompt removed."""
  out, current = [], ""
  for raw in code.splitlines():
    line = raw.rstrip()
    if not current:
      if prompt and not line.startswith("$ "):
        continue
      line = line[2:] if prompt else line
      if not line.strip() or line.lstrip().startswith("#"):
        continue
    current += line[:-1] if line.endswith("\\") else line  # as bash joins them
    if not line.endswith("\\"):
      out.append(current.strip())
      current = ""
  return out + ([current.strip()] if current else [])


def _tokens(command: str) -> list[str]:
  lex = shlex.shlex(command, posix=True, punctuation_chars=True)
  lex.whitespace_split, lex.commenters = True, "#"
  return list(lex)


_SEPARATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")"}


def recipe_calls(command: str) -> list[tuple[str, list[str]]]:
  """`(recipe, args)` for each `recipes/X.py ...` or `-m recipes.X ...` in a shell command,
  also inside quoted arguments (`--command="cd repo && python recipes/X.py ..."`). A recipe's
  args end at a shell separator or at `--` (a launcher's command follows it)."""
  toks, calls = _tokens(command), []
  for i, tok in enumerate(toks):
    name = None
    m = re.fullmatch(r"(?:.*/)?recipes/([\w/]+)\.py", tok)
    if m:
      name, rest = m[1], toks[i + 1:]
    elif tok == "-m" and i + 1 < len(toks) and toks[i + 1].startswith("recipes."):
      name, rest = toks[i + 1][len("recipes."):].replace(".", "/"), toks[i + 2:]
    elif " " in tok and "recipes" in tok:  # a command inside an argument
      calls += recipe_calls(tok.split("=", 1)[1] if tok.startswith("-") else tok)
    if name:
      args = []
      for a in rest:
        if a in _SEPARATORS or a == "--":
          break
        args.append(a)
      calls.append((name, args))
  return calls


class Flags(NamedTuple):
  """The flags a recipe's --help lists: all names, and those that are booleans (--[no]x)."""
  names: frozenset
  booleans: frozenset


def help_flags(help_text: str) -> Flags:
  """The flags of a --help text (absl: `--[no]name:`, argparse: `--name VALUE`), read from
  its flags/options section on, so flags its description merely mentions don't count."""
  m = re.search(r"^(flags|options|optional arguments):\s*$", help_text, re.M | re.I)
  body = help_text[m.start():] if m else help_text
  found = re.findall(r"(?<![\w-])--(\[no\])?([A-Za-z][\w-]*)", body)
  return Flags(frozenset(n for _, n in found), frozenset(n for no, n in found if no))


def flag_problems(recipe: str, args: list[str], flags: Flags) -> list[str]:
  """Flags in `args` that `flags` doesn't know (`--noX` is fine for a boolean X)."""
  problems = []
  for a in args:
    if not a.startswith("--") or a == "--":
      continue
    name = a[2:].split("=", 1)[0]
    if name not in flags.names and not (name.startswith("no") and name[2:] in flags.booleans):
      problems.append(f"recipes/{recipe}.py has no flag --{name} (its --help lists "
                      f"{', '.join('--' + n for n in sorted(flags.names))})")
  return problems


def extras_problems(command: str, extras: set[str]) -> list[str]:
  """Extras of `pip install ...[a,b]` (`.[a]`, `-e ".[a]"`, `fnscale[a]`) not in `extras`."""
  toks = _tokens(command)
  if toks[:2] != ["pip", "install"] and toks[:4] != ["python", "-m", "pip", "install"]:
    return []
  asked = {e for t in toks for m in [re.fullmatch(r"(?:\.|fnscale)\[([\w,-]+)\]", t)] if m
           for e in m[1].split(",")}
  return [f"pip install asks for extra {e!r}; pyproject.toml defines {sorted(extras)}"
          for e in sorted(asked - extras)]


# ------------------------------------------------------------------------------------------------
# Python: names reached through fnscale / recipes exist; calls fit their signatures.
# ------------------------------------------------------------------------------------------------

_UNKNOWN = object()


def _ours(module: str) -> bool:
  return module.split(".")[0] in ("fnscale", "recipes")


def python_problems(code: str) -> list[str]:
  """What in a Python snippet names a missing fnscale/recipes object or calls one with
  keywords (or more positional arguments) its signature doesn't take. Names the snippet
  defines itself (the reader's `loss_fn`, `params`) are not checked."""
  try:
    tree = ast.parse(code)
  except SyntaxError as e:
    return [f"syntax error: {e}"]
  names, problems = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if _ours(a.name):
          top = a.asname or a.name.split(".")[0]
          names[top] = _import(a.name if a.asname else top, problems)
    elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
      module = _import(node.module, problems)
      for a in node.names:
        names[a.asname or a.name] = _attribute(module, a.name, node.module, problems)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      target = _resolve(node.func, names, problems)
      if target is not _UNKNOWN and callable(target):
        problems += _call_problems(target, node)
    elif isinstance(node, ast.Attribute):
      _resolve(node, names, problems)
  return sorted(set(problems))


def _import(name: str, problems: list):
  try:
    return importlib.import_module(name)
  except ImportError as e:
    problems.append(f"import {name}: {e}")
    return _UNKNOWN


def _attribute(obj, attr: str, where: str, problems: list):
  if obj is _UNKNOWN:
    return _UNKNOWN
  if hasattr(obj, attr):
    return getattr(obj, attr)
  if inspect.ismodule(obj):
    try:
      return importlib.import_module(f"{obj.__name__}.{attr}")
    except ImportError:
      pass
  problems.append(f"{where}.{attr} does not exist")
  return _UNKNOWN


def _resolve(node, names: dict, problems: list):
  """The object an expression names through fnscale/recipes, else _UNKNOWN."""
  if isinstance(node, ast.Name):
    return names.get(node.id, _UNKNOWN)
  if isinstance(node, ast.Attribute):
    base = _resolve(node.value, names, problems)
    if base is not _UNKNOWN and (inspect.ismodule(base) or inspect.isclass(base)):
      return _attribute(base, node.attr, ast.unparse(node.value), problems)
  return _UNKNOWN


def _call_problems(fn, call: ast.Call) -> list[str]:
  if any(isinstance(a, ast.Starred) for a in call.args) or any(
      k.arg is None for k in call.keywords):
    return []
  keywords = [k.arg for k in call.keywords]
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return []
  params = list(sig.parameters.values())
  options = getattr(inspect.getmodule(fn), "Options", None)
  if [p.kind for p in params] == [inspect.Parameter.VAR_KEYWORD] and options is not None:
    from recipes.lm import cli  # pylint: disable=import-outside-toplevel
    known = set(cli.leaves(options))  # a recipe's options, flat
    return [f"{ast.unparse(call.func)}(): no option {k!r}" for k in keywords if k not in known]
  try:
    sig.bind_partial(*[None] * len(call.args), **dict.fromkeys(keywords))
  except TypeError as e:
    return [f"{ast.unparse(call.func)}{sig}: {e}"]
  return []


# ------------------------------------------------------------------------------------------------
# The fresh checkout and the commands run in it.
# ------------------------------------------------------------------------------------------------


class Checkout(NamedTuple):
  """A copy of the repository's files (`root`) and the environment its commands run in
  (`env`: sorted (name, value) pairs, so a Checkout can key a cache)."""
  root: pathlib.Path
  env: tuple


def _repository_files() -> list[str]:
  try:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: the known folders
    keep = ("fnscale/", "recipes/", "tests/", ".ci/", "README.md", "pyproject.toml", "LICENSE")
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
            and str(p.relative_to(ROOT)).startswith(keep) and "__pycache__" not in p.parts]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Checkout:
  """The repository's tracked (and new, unignored) files copied to a temporary directory.
  The packages pyproject.toml installs (fnscale, recipes) are importable through a directory
  holding only links to them, as an editable install makes them, and nothing else of the
  copy is (the commands run from the copy's root, as written)."""
  base = tmp_path_factory.mktemp("readme")
  root = base / "fnscale-repo"
  for f in _repository_files():
    (root / f).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / f, root / f)
  site = base / "site"
  site.mkdir()
  for package in _installed_packages():
    (site / package).symlink_to(root / package, target_is_directory=True)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  # One persistent compile cache for all the commands (a program several of them compile,
  # such as the default run's step, compiles once), also for quick compiles.
  env.update(PYTHONPATH=str(site), PATH=os.path.dirname(sys.executable) + os.pathsep +
             env.get("PATH", ""), JAX_COMPILATION_CACHE_DIR=str(base / "compile-cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return Checkout(root, tuple(sorted(env.items())))


def _run(co: Checkout, argv: list[str], stdin: str | None = None, timeout: float = 900):
  return subprocess.run(argv, cwd=co.root, env=dict(co.env), input=stdin, capture_output=True,
                        text=True, timeout=timeout)


def _help_alone(co: Checkout, recipe: str, as_module: bool = False) -> tuple[int, str]:
  """`python recipes/RECIPE.py --help` (or `-m recipes.RECIPE`) in a process of its own:
  exit status, output."""
  argv = (["-m", "recipes." + recipe.replace("/", ".")] if as_module
          else [f"recipes/{recipe}.py"])
  r = _run(co, [sys.executable, *argv, "--help"], timeout=180)
  return r.returncode, r.stdout + r.stderr


@functools.cache
def _all_help(co: Checkout, as_module: bool) -> dict[str, tuple[int, str]]:
  """`--help` of every recipe in one form: one process imports jax and fnscale once, then
  forks a fresh child per recipe (tests/recipe_help.py), 50 interpreter start-ups saved."""
  r = _run(co, [sys.executable, "tests/recipe_help.py", "module" if as_module else "script",
                *RECIPES], timeout=600)
  rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
  found = {row["recipe"]: (row["rc"], row["out"]) for row in rows}
  return {name: found.get(name, (r.returncode, f"recipe_help.py gave nothing: {r.stderr[-600:]}"))
          for name in RECIPES}


def _help(co: Checkout, recipe: str, as_module: bool = False) -> tuple[int, str]:
  """`python recipes/RECIPE.py --help` (or `-m recipes.RECIPE`): exit status, output."""
  if recipe in RECIPES:
    return _all_help(co, as_module)[recipe]
  return _help_alone(co, recipe, as_module)


def _recipe_flags(co: Checkout, recipe: str) -> Flags | str:
  """The recipe's --help flags, or why they can't be read."""
  if not (co.root / "recipes" / f"{recipe}.py").is_file():
    return f"recipes/{recipe}.py does not exist"
  rc, out = _help(co, recipe)
  flags = help_flags(out)
  # absl's --help exits 1 after printing; a crash prints a traceback instead.
  if rc not in (0, 1) or "Traceback" in out or not flags.names:
    return f"recipes/{recipe}.py --help failed (exit {rc}): {out[-600:]}"
  return flags


def check_command(co: Checkout, command: str, extras: set[str]) -> list[str]:
  """Everything checkable in one shell command, without running it."""
  problems = extras_problems(command, extras)
  for recipe, args in recipe_calls(command):
    flags = _recipe_flags(co, recipe)
    problems += [flags] if isinstance(flags, str) else flag_problems(recipe, args, flags)
  toks = _tokens(command)
  for i, tok in enumerate(toks):
    if tok.startswith(".ci/") and not os.access(co.root / tok, os.X_OK):
      problems.append(f"{tok} is not an executable script of the repository")
    if tok == "-c" and i > 0 and toks[i - 1].startswith("python") and i + 1 < len(toks):
      problems += python_problems(toks[i + 1])
  return problems


def _never_run(command: str) -> bool:
  """pip installs (the environment is the one they install) and the test suite itself
  (pytest, the .ci/ scripts that run it)."""
  toks = [t for t in _tokens(command) if not re.fullmatch(r"\w+=\S*", t)]  # env assignments
  return (toks[:2] == ["pip", "install"] or toks[:1] == ["pytest"]
          or toks[1:3] == ["-m", "pytest"] or (bool(toks) and toks[0].startswith(".ci/")))


def _installed_packages() -> list[str]:
  """The top-level packages pyproject.toml's `packages.find` installs ("fnscale*" -> fnscale)."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
  return sorted({pattern.rstrip("*").split(".")[0] for pattern in include})


def _extras() -> set[str]:
  return set(_optional_dependencies())


def _optional_dependencies() -> dict[str, list[str]]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["optional-dependencies"]


def missing_packages(extra: str) -> list[str]:
  """The distributions fnscale's `extra` asks for that are not installed, with those of the
  extras it asks of them (`jax[tpu]`: libtpu), its markers applied.

  Raises:
    ReadmeError: an extra pyproject.toml does not define.
  """
  from packaging.requirements import Requirement  # pytest's own dependency
  extras = _optional_dependencies()
  if extra not in extras:
    raise ReadmeError(f"extra {extra!r}: pyproject.toml defines {sorted(extras)}")
  missing = []
  for req in map(Requirement, extras[extra]):
    if req.marker is not None and not req.marker.evaluate():
      continue
    if req.name == "fnscale":
      missing += [m for e in sorted(req.extras) for m in missing_packages(e)]
      continue
    try:
      asks = [Requirement(r) for r in importlib.metadata.requires(req.name) or ()]
    except importlib.metadata.PackageNotFoundError:
      missing.append(req.name)
      continue
    for sub in asks:  # what req's own extras add (extra == "tpu": libtpu)
      if sub.marker is None or sub.marker.evaluate({"extra": ""}) or not any(
          sub.marker.evaluate({"extra": e}) for e in req.extras):
        continue
      try:
        importlib.metadata.version(sub.name)
      except importlib.metadata.PackageNotFoundError:
        missing.append(f"{sub.name} ({req.name}[{','.join(sorted(req.extras))}])")
  return missing


def _steps(block: Block) -> list[tuple[str, str]]:
  """`(kind, text)` for each step of a block: kind "shell" or "python"."""
  code = block.code
  for old, new in block.subs:
    code = code.replace(old, new)
  if block.lang in PYTHON:
    return [("python", code)]
  return [("shell", c) for c in shell_commands(code, prompt=block.mode == "text")]


def _do(co: Checkout, block: Block, kind: str, text: str, extras) -> tuple[str, list[str]]:
  """Runs or checks one step; returns (what was done, problems)."""
  missing = [m for e in block.needs for m in missing_packages(e)]
  if missing:  # a block of an extra not installed here: checked, as a "check" block is
    block = block._replace(mode="check", why=f"{', '.join(missing)} not installed")
  if kind == "python":
    if block.mode == "check":
      return "checked", python_problems(text)
    r = _run(co, [sys.executable, "-"], stdin=text)
    return "ran", [] if r.returncode == 0 else [f"exit {r.returncode}: {r.stderr[-3000:]}"]
  if block.mode != "run" or _never_run(text):
    return "checked", check_command(co, text, extras)
  problems = check_command(co, text, extras)
  r = _run(co, ["bash", "-c", "set -euo pipefail\n" + text])
  if r.returncode:
    problems.append(f"exit {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
  return "ran", problems


def _inline_commands(readme: str) -> list[str]:
  """The recipe commands quoted in the text; a capitalised name (`python recipes/X.py`) is a
  placeholder."""
  return re.findall(r"`(python (?:recipes/|-m recipes\.)(?![A-Z])[^`]*)`", readme)


# The READMEs, in the order their commands run (recipes/README.md continues from the guide's
# runs: the plot of the Quick start run, the caches its data section writes).
READMES = ("README.md", "recipes/README.md", "recipes/examples/README.md",
           "recipes/bench/README.md")


def _readmes(co: Checkout):
  """(name, text) of each README in the checkout."""
  return [(name, (co.root / name).read_text(encoding="utf-8")) for name in READMES]


def test_readmes_are_read_in_one_sitting():
  # The guide: at most 300 lines and 16 KB; the others at most 300 lines.
  sizes = {name: (len(text.splitlines()), len(text.encode()))
           for name, text in ((n, (ROOT / n).read_text(encoding="utf-8")) for n in READMES)}
  assert sizes["README.md"][0] <= 300 and sizes["README.md"][1] <= 16 * 1024, sizes
  assert all(lines <= 300 for lines, _ in sizes.values()), sizes


def test_the_exit_statuses_listed_are_the_main_jobs():
  """README's list of exit statuses holds every status `python recipes/train_lm.py` ends
  with, and no other."""
  from recipes.lm import cli  # pylint: disable=import-outside-toplevel
  import fnscale as fs  # pylint: disable=import-outside-toplevel
  said = re.search(r"Exit statuses: ([^.]*)\.", (ROOT / "README.md").read_text()).group(1)
  listed = {int(n) for n in re.findall(r"\b(\d+) ", said)}
  assert listed == {0, cli.EXIT_BAD_INPUT, fs.multihost.EXIT_JOB_FAILED,
                    *cli.EXIT_STOPPED.values()}, said


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_readme_commands_run_in_order(checkout):
  extras, problems, rows = _extras(), [], []
  for name, readme in _readmes(checkout):
    for block in read_blocks(readme):
      for kind, text in _steps(block):
        t = time.time()
        done, found = _do(checkout, block, kind, text, extras)
        first = text.strip().splitlines()[0][:90] if text.strip() else ""
        rows.append(f"{time.time() - t:7.1f} s  {done:7}  {name} {block.line:4}  {first}")
        problems += [f"{name} line {block.line} ({first}): {p}" for p in found]
    for command in _inline_commands(readme):
      problems += [f"{name}: inline `{command}`: {p}"
                   for p in check_command(checkout, command, extras)]
  print(f"README commands (load average {os.getloadavg()[0]:.1f} at the end):\n  "
        + "\n  ".join(rows))
  assert not problems, "\n".join(problems)
  # What the commands wrote lies where .gitignore keeps it out of a commit (runs/, caches/,
  # ...), not beside the repository's own files.
  assert _left_in_the_tree(checkout) == []


def _left_in_the_tree(co: Checkout) -> list[str]:
  """The files in the checkout that are neither the repository's nor ignored by its
  .gitignore (a command's output left beside the sources)."""
  copied = set(_repository_files())
  new = sorted(p.relative_to(co.root).as_posix() for p in co.root.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts)
  new = [f for f in new if f not in copied]
  if not new:
    return []
  r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
                     input="\n".join(new), capture_output=True, text=True, check=False)
  ignored = set(r.stdout.splitlines())
  return [f for f in new if f not in ignored]


@pytest.mark.timeout(600)
def test_readme_commands_are_checked(checkout):
  """The quick tier's share of the test above: every step of every block checked (flags
  against the recipe's --help, extras, Python names and keywords), none run, so a renamed
  flag, recipe, extra or function fails `python -m pytest -q` as well."""
  extras, problems, steps = _extras(), [], 0
  for name, readme in _readmes(checkout):
    for block in read_blocks(readme):
      for extra in block.needs:  # a marker's extras are pyproject.toml's
        if extra not in extras:
          problems.append(f"{name} line {block.line}: readme-test extra {extra!r} is not one "
                          f"of pyproject.toml's {sorted(extras)}")
      for kind, text in _steps(block):
        steps += 1
        found = (python_problems(text) if kind == "python"
                 else check_command(checkout, text, extras))
        problems += [f"{name} line {block.line}: {p}" for p in found]
    for command in _inline_commands(readme):
      problems += [f"{name}: inline `{command}`: {p}"
                   for p in check_command(checkout, command, extras)]
  assert steps > 20  # the READMEs' blocks were read (a parser that finds none checks nothing)
  assert not problems, "\n".join(problems)


RECIPES = sorted(p.relative_to(ROOT / "recipes").with_suffix("").as_posix()
                 for p in (ROOT / "recipes").rglob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_recipe_runs_as_a_script_and_as_a_module(checkout):
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two forms side by side
    forms = dict(zip((False, True), pool.map(lambda m: _all_help(checkout, m), (False, True))))
  outs = {(r, m): forms[m][r] for r in RECIPES for m in (False, True)}
  # The forked children answer as a process of its own does (one recipe, both forms).
  for as_module in (False, True):
    rc, out = _help_alone(checkout, "train_lm", as_module)
    assert (rc, help_flags(out)) == (outs["train_lm", as_module][0],
                                     help_flags(outs["train_lm", as_module][1]))
  problems = []
  for recipe in RECIPES:
    script, module = outs[recipe, False], outs[recipe, True]
    for how, (rc, out) in ((f"python recipes/{recipe}.py", script),
                           ("python -m recipes." + recipe.replace("/", "."), module)):
      if rc not in (0, 1) or "Traceback" in out or not help_flags(out).names:
        problems.append(f"{how} --help: exit {rc}: {out[-800:]}")
    if help_flags(script[1]) != help_flags(module[1]):
      problems.append(f"recipes/{recipe}.py: --help lists other flags as a module")
  assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# The machinery above, on hand-written READMEs: each check can fail.
# ------------------------------------------------------------------------------------------------

SAMPLE = """# A README

<!-- readme-test: run: --steps=100 => --steps=2; 20:25 => 2:3 -->
```bash
python recipes/train_lm.py --steps=100 \\
  --profile_steps=20:25   # a comment
# a comment line

python -m pytest -q
```

```
$ python -c "import fnscale"
output line
```

<!-- readme-test: check: needs a TPU pod -->
```python
import fnscale as fs
```

<!-- readme-test: extra: tpu, ray -->
```bash
python recipes/show_topology.py --topology=v5p-8
```
"""


def test_read_blocks_applies_markers():
  run, text, check, extra = read_blocks(SAMPLE)
  assert (run.line, run.lang, run.mode, run.subs) == (
      4, "bash", "run", (("--steps=100", "--steps=2"), ("20:25", "2:3")))
  assert _steps(run) == [("shell", "python recipes/train_lm.py --steps=2   --profile_steps=2:3"
                          "   # a comment"), ("shell", "python -m pytest -q")]
  assert (text.mode, _steps(text)) == ("text", [("shell", 'python -c "import fnscale"')])
  assert (check.mode, check.why, _steps(check)) == (
      "check", "needs a TPU pod", [("python", "import fnscale as fs")])
  assert (extra.mode, extra.needs, run.needs) == ("run", ("tpu", "ray"), ())


def test_missing_packages_of_an_extra():
  import importlib.util
  libtpu = importlib.util.find_spec("libtpu") is not None
  missing = missing_packages("tpu")
  assert ("libtpu (jax[tpu])" in missing) is not libtpu and (missing == []) is libtpu
  assert missing_packages("test") == []  # this suite runs: its extra is installed
  with pytest.raises(ReadmeError, match=r"extra 'tpux': pyproject.toml defines \['checkpoint'"):
    missing_packages("tpux")


@pytest.mark.parametrize("readme, message", [
    ("<!-- readme-test: skip -->\n```bash\nls\n```", "malformed marker"),
    ("<!-- readme-test: check: why -->\n\n```bash\nls\n```", "directly above a code block"),
    ("<!-- readme-test: run: --steps=9 => --steps=1 -->\n```bash\nls\n```", "is not in the block"),
    ("<!-- readme-test: run: --steps=9 -->\n```bash\nls --steps=9\n```", "write OLD => NEW"),
    ("<!-- readme-test: check: why -->\n```\nout\n```", "markers are for bash and python"),
])
def test_read_blocks_refuses_markers_it_cant_follow(readme, message):
  with pytest.raises(ReadmeError, match=message):
    read_blocks(readme)


def test_recipe_calls_finds_recipes_inside_launchers_and_quoted_commands():
  assert recipe_calls("python recipes/launch/launch_local.py --num_processes=2 -- recipes/train_lm.py "
                      "--steps=3 && echo done") == [
                          ("launch/launch_local", ["--num_processes=2"]),
                          ("train_lm", ["--steps=3"])]
  assert recipe_calls('gcloud ssh X --worker=all --command="cd fnscale && python '
                      'recipes/train_lm.py --model=small"') == [("train_lm", ["--model=small"])]
  assert recipe_calls("srun -N 4 python -m recipes.plan --measure # --not_a_flag") == [
      ("plan", ["--measure"])]
  assert recipe_calls("python -m recipes.bench.step --sizes=nano") == [
      ("bench/step", ["--sizes=nano"])]
  assert recipe_calls("tensorboard --logdir runs") == []


ABSL_HELP = """Trains a model.

  python recipes/train_lm.py --model=tiny      (a stale mention in the description)

flags:
  --[no]checkpoint: save checkpoints
    (default: 'true')
  --model_config: model
  --steps: train steps
"""


def test_flags_are_checked_against_the_help_section():
  flags = help_flags(ABSL_HELP)
  assert flags == Flags(frozenset({"checkpoint", "model_config", "steps"}),
                        frozenset({"checkpoint"}))
  assert flag_problems("train_lm", ["--steps=3", "--nocheckpoint", "--checkpoint", "pos"],
                       flags) == []
  (problem,) = flag_problems("train_lm", ["--model=small", "--steps", "9"], flags)
  assert problem.startswith("recipes/train_lm.py has no flag --model (its --help lists "
                            "--checkpoint, --model_config, --steps)")
  assert flag_problems("train_lm", ["--nosteps"], flags)  # not a boolean
  argparse_help = "usage: plan.py [-h]\n\noptions:\n  -h, --help  show\n  --target TARGET  where\n"
  assert help_flags(argparse_help).names == {"help", "target"}


def test_files_left_beside_the_sources_are_found(tmp_path):
  for f in ("chats.jsonl", "caches/chats.jsonl", "runs/x/metrics.jsonl", "recipes/chat.jinja"):
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).write_text("x")
  assert _left_in_the_tree(Checkout(tmp_path, ())) == ["chats.jsonl", "recipes/chat.jinja"]


def test_the_install_holds_the_recipes_beside_fnscale():
  # `python recipes/X.py` finds `recipes` through the install, as `-m recipes.X` does from the
  # checkout's root: no recipe sets up a path of its own (tests/test_imports.py).
  assert _installed_packages() == ["fnscale", "recipes"]


def test_pip_extras_are_checked_against_pyproject():
  extras = _extras()
  assert {"test", "tpu", "cuda12", "cuda13", "recipes"} <= extras
  assert extras_problems('pip install -e ".[test,tpu]"', extras) == []
  assert extras_problems('pip install "fnscale[checkpoint]"', extras) == []
  assert extras_problems('pip install -e ".[test,cuda]"', {"test"}) == [
      "pip install asks for extra 'cuda'; pyproject.toml defines ['test']"]
  assert extras_problems("echo .[nonsense]", extras) == []  # not a pip command
  assert [_never_run(c) for c in ('pip install -e ".[test]"', "python -m pytest -q", ".ci/run",
                                  "MUTATION_SAMPLE=3 .ci/mutation mesh", "python recipes/x.py",
                                  "echo pytest")] == [True, True, True, True, False, False]


def test_python_names_and_keywords_are_checked():
  ok = ("import fnscale as fs, optax\nfrom fnscale import checkpoint\n"
        "from recipes.train_lm import train_lm\n"
        "mesh = fs.make_mesh({'data': -1}, topology=fs.detect_topology())\n"
        "checkpoint.save(d, 3, state, keep=3)\ntrain_lm(model_config='nano', steps=3)\n"
        "step = fs.train_step(my_loss, optax.adamw(1e-3), accum_steps=4)\nmy_loss.anything(1)\n")
  assert python_problems(ok) == []
  bad = ("import fnscale as fs\nfrom fnscale.analysis.hlo import summarize, no_such_name\n"
         "from recipes.train_lm import train_lm\nfs.make_mesh({'data': -1}, topo=None)\n"
         "fs.not_a_function(1)\nfs.checkpoint.latest_step(d, e, f)\ntrain_lm(model='tiny')\n")
  problems = python_problems(bad)
  assert any("fnscale.analysis.hlo.no_such_name does not exist" in p for p in problems)
  assert any("fs.not_a_function does not exist" in p for p in problems)
  assert any(p.startswith("fs.make_mesh(") and "topo" in p for p in problems)
  assert any(p.startswith("fs.checkpoint.latest_step(") for p in problems)
  assert any("train_lm(): no option 'model'" in p for p in problems)
  assert len(problems) == 5, problems
  assert python_problems("def f(:\n") and python_problems("def f(:\n")[0].startswith("syntax")


@pytest.mark.slow
def test_the_readme_test_command_prints_its_seed():
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_pip_extras_are_checked_against_pyproject"]
  out = subprocess.run(cmd + ["--randomly-seed=1234"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300).stdout
  assert "random order: --randomly-seed=1234 repeats it" in out and "1 passed" in out
  out = subprocess.run(cmd + ["-p", "no:randomly"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300).stdout
  assert "1 passed" in out and "randomly-seed" not in out


def test_summary_fields_the_readme_names_exist():
  # `train_lm(...)`'s Summary, as the README's text and code reach it (`Summary.x`, `summary.x`).
  from recipes.lm import summary  # pylint: disable=import-outside-toplevel
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  named = set(re.findall(r"\b[Ss]ummary\.([a-z_]+)\b", text))
  assert "final_step" in named and "bigram_loss" in named
  # summary.unread and summary.dcn_* are compile_report's Summary, a different value.
  report = {"unread", "dcn_bytes_sent", "dcn_groups"}
  assert not named - report - set(summary.Summary._fields), named - report


# The README's CPU-only install (`pip install -e ".[test]"`, no libtpu), as a Python start-up
# that can't find libtpu: importing it fails and `importlib.util.find_spec` says it is absent.
NO_LIBTPU = """\
import importlib.abc, importlib.util, sys
class _NoLibtpu(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "libtpu":
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoLibtpu())
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] == "libtpu" else _find(name, package))
"""


def _without_libtpu(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", NO_LIBTPU + code], cwd=ROOT, text=True,
                        capture_output=True, timeout=300, check=False)


def test_the_mesh_section_runs_on_the_cpu_only_install_and_marks_what_needs_libtpu():
  # The first block a newcomer runs there runs without libtpu; the blocks that describe TPU
  # targets (`fs.target_devices`) carry the tpu extra's marker.
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  section = text.split("## Choose a mesh", 1)[1].split("\n## ", 1)[0]
  blocks = [b for b in read_blocks(section) if b.lang in PYTHON]
  assert blocks[0].needs == () and "fs.make_mesh(" in blocks[0].code
  for b in blocks:
    assert ("target_devices" in b.code) is ("tpu" in b.needs), b.code
  plain = [b for b in blocks if not b.needs and b.mode == "run"]
  # One start-up for both: the blocks, then (the harness does hide libtpu) describing a TPU
  # target, which must fail saying so.
  r = _without_libtpu("\n".join(f"exec({b.code!r}, {{}})" for b in plain)
                      + "\nprint('blocks ran', flush=True)\nimport fnscale as fs\n"
                      "fs.target_devices('v5p-8')")
  assert r.stdout.splitlines()[-1:] == ["blocks ran"], r.stderr[-3000:]
  assert r.returncode != 0 and "needs libtpu, which is not" in r.stderr, r.stderr[-2000:]
