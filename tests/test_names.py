"""One spelling per public name: every public object of fnscale is reached by exactly one
public spelling (`fs.make_mesh`, `fs.analysis.plan`, `fs.analysis.hlo.summarize`), no function
shadows a module, and an old spelling a user may have typed still works with a
DeprecationWarning that names the new one (tests/surface.py reads the surface)."""
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

import fnscale as fs
import surface


def _package(tmp_path, files: dict) -> str:
  for path, text in files.items():
    f = tmp_path / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(textwrap.dedent(text))
  return "pkgx"


def test_the_checks_find_shadowing_a_second_spelling_and_an_undeclared_module(
    tmp_path, monkeypatch):
  # The mistakes fnscale had: a function named as its module and re-exported by the package
  # (so `import pkgx.kern.attention as m` gave the function), a function reachable from the
  # package and from a public module, a public module no __all__ names, one without __all__.
  name = _package(tmp_path, {
      "pkgx/__init__.py": """
          from pkgx import kern, tools
          from pkgx.core import make
          __all__ = ["make", "kern"]
          """,
      "pkgx/core.py": "__all__ = ['make']\ndef make(): pass\n",
      "pkgx/kern/__init__.py": """
          from pkgx.kern.attention import attention
          __all__ = ["attention"]
          """,
      "pkgx/kern/attention.py": "def attention(): pass\n",
      "pkgx/tools.py": "def tool(): pass\n",
      "pkgx/_private.py": "def helper(): pass\n",
  })
  monkeypatch.syspath_prepend(str(tmp_path))
  found = surface.problems(name)
  assert sorted(found) == sorted([
      "pkgx.core is public but no public __all__ names it: make it private (_core) or "
      "declare it",
      "pkgx.kern.attention has no __all__",
      "pkgx.tools has no __all__",
      "pkgx.tools is bound but not in pkgx.__all__: a second spelling of pkgx.tools",
      "pkgx.core is bound but not in pkgx.__all__: a second spelling of pkgx.core",
      "pkgx.kern.attention is function <function attention at "
      f"{hex(id(sys.modules['pkgx.kern.attention'].attention))}>, shadowing the module "
      "pkgx.kern.attention",
  ]), found
  # Reached through the package and the module's own __all__: two spellings.
  assert surface.duplicates({"pkgx.make": len, "pkgx.core.make": len, "pkgx.n": 3,
                             "pkgx.core.n": 3, "pkgx.m": 3}) == [
      ["pkgx.core.make", "pkgx.make"], ["pkgx.core.n", "pkgx.n"]]


def test_each_public_name_has_one_spelling_and_no_function_shadows_a_module():
  assert surface.problems("fnscale") == []


def test_the_namespaces_users_reach():
  names = surface.public_names("fnscale")
  modules = sorted(n for n, obj in names.items() if type(obj).__name__ == "module")
  assert modules == [
      "fnscale.adapters", "fnscale.analysis", "fnscale.analysis.hlo", "fnscale.checkpoint",
      "fnscale.checkpoint.hf", "fnscale.checkpoint.peft", "fnscale.cloud", "fnscale.kernels",
      "fnscale.lora", "fnscale.multihost", "fnscale.parallel", "fnscale.parallel.context"]
  # The names that were stutters or shadowed their modules are the functions now.
  assert callable(fs.analysis.plan) and callable(fs.parallel.pipeline)
  assert callable(fs.kernels.grouped_matmul)
  # No stutter: a namespace's name as a word of a member's (fs.plan.plan, hlo.HloSummary),
  # but for lora's, named as the field names them (peft's LoraConfig; with_lora as with_kernel).
  words = lambda name: {w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)}
  assert [n for n in names if n.count(".") > 1
          and n.rsplit(".", 2)[-2] in words(n.rsplit(".", 1)[1])] == [
              "fnscale.lora.LoraConfig", "fnscale.lora.LoraWeight", "fnscale.lora.with_lora"]
  assert words("HloSummary") == {"hlo", "summary"} and "kernels" not in words("KernelSelection")


# (old spelling, what it gives, a spelling its warning must name)
OLD = [
    ("plan", lambda: fs.plan.plan, fs.analysis.plan, "fnscale.analysis.plan"),
    ("hlo", lambda: fs.hlo.summarize, fs.analysis.hlo.summarize, "fnscale.analysis.hlo"),
    ("flops", lambda: fs.flops.mfu, fs.analysis.mfu, "fnscale.analysis.mfu"),
    ("report", lambda: fs.report.compile_report, fs.compile_report, "fnscale.compile_report"),
    ("invariance", lambda: fs.invariance.check_mesh_invariance,
     fs.analysis.check_mesh_invariance, "fnscale.analysis.check_mesh_invariance"),
    ("topology", lambda: fs.topology.target_devices, fs.target_devices, "fnscale.target_devices"),
    ("mesh", lambda: fs.mesh.make_mesh, fs.make_mesh, "fnscale.make_mesh"),
    ("sharding", lambda: fs.sharding.logical_to_spec, fs.logical_to_spec,
     "fnscale.logical_to_spec"),
    ("step", lambda: fs.step.train_step, fs.train_step, "fnscale.train_step"),
    ("state", lambda: fs.state.init_state, fs.init_state, "fnscale.init_state"),
    ("compile", lambda: fs.compile.shard_step, fs.shard_step, "fnscale.shard_step"),
    ("errors", lambda: fs.errors.MeshError, fs.MeshError, "fnscale.MeshError"),
    ("analysis.report", lambda: fs.analysis.report.format_report, fs.analysis.format_report,
     "fnscale.analysis.format_report"),
    ("analysis.flops", lambda: fs.analysis.flops.peak_flops, fs.analysis.peak_flops,
     "fnscale.analysis.mfu"),
    ("analysis.invariance", lambda: fs.analysis.invariance.InvarianceReport,
     fs.analysis.InvarianceReport, "fnscale.analysis.check_mesh_invariance"),
    ("analysis.summary", lambda: fs.analysis.summary, fs.analysis.plan_summary,
     "fnscale.analysis.plan_summary"),
    ("multihost.preemption", lambda: fs.multihost.preemption.preemption_guard,
     fs.multihost.preemption_guard, "fnscale.multihost.preemption_guard"),
    ("multihost.cluster", lambda: fs.multihost.cluster.DistributedInfo,
     fs.multihost.DistributedInfo, "fnscale.multihost.DistributedInfo"),
    ("multihost.initialize", lambda: fs.multihost.initialize, fs.initialize, "fnscale.initialize"),
    ("multihost.barrier", lambda: fs.multihost.barrier, fs.barrier, "fnscale.barrier"),
    ("multihost.global_batch", lambda: fs.multihost.global_batch, fs.global_batch,
     "fnscale.global_batch"),
    ("multihost.process_rows", lambda: fs.multihost.process_rows, fs.process_rows,
     "fnscale.process_rows"),
    ("parallel.experts", lambda: fs.parallel.experts.moe, fs.parallel.moe, "fnscale.parallel.moe"),
    ("checkpoint.store", lambda: fs.checkpoint.store.save, fs.checkpoint.save,
     "fnscale.checkpoint.save"),
    ("plan.summary", lambda: fs.plan.summary, fs.analysis.plan_summary,
     "fnscale.analysis.plan_summary"),
    ("mesh.describe", lambda: fs.mesh.describe, fs.describe_mesh, "fnscale.describe_mesh"),
    ("multihost.preemption.check_service", lambda: fs.multihost.preemption.check_service,
     fs.multihost.check_preemption_service, "fnscale.multihost.check_preemption_service"),
    ("analysis.hlo.HloSummary", lambda: fs.analysis.hlo.HloSummary, fs.analysis.hlo.Summary,
     "fnscale.analysis.hlo.Summary"),
    ("kernels.attention", lambda: fs.kernels.attention, fs.attention, "fnscale.attention"),
    ("kernels.cross_entropy", lambda: fs.kernels.cross_entropy, fs.cross_entropy,
     "fnscale.cross_entropy"),
    ("kernels.with_kernel", lambda: fs.kernels.with_kernel, fs.with_kernel, "fnscale.with_kernel"),
    ("kernels.context_attention", lambda: fs.kernels.context_attention.reorder,
     fs.parallel.context.reorder, "fnscale.parallel.context"),
]


@pytest.mark.parametrize("old,get,new,named", OLD, ids=[o[0] for o in OLD])
def test_an_old_spelling_works_and_warns_naming_the_new_one(old, get, new, named):
  # The warning names the old spelling (or, past a first old step such as fs.plan, the
  # module it reached) and the new one.
  last = re.escape(old.rsplit(".", 1)[-1])
  pattern = rf"^fnscale\.[\w.]*\b{last} is deprecated: use .*{re.escape(named)}"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = get()
  assert got is new
  said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  assert any(re.search(pattern, s) for s in said), said


def test_from_imports_of_old_names_warn_and_a_name_nowhere_is_an_attribute_error():
  with pytest.warns(DeprecationWarning, match=r"fnscale\.hlo is deprecated"):
    from fnscale import hlo  # pylint: disable=import-outside-toplevel
  assert hlo is fs.analysis.hlo
  with pytest.raises(AttributeError, match="module 'fnscale.analysis' has no attribute 'nope'"):
    fs.analysis.nope  # pylint: disable=pointless-statement
  with pytest.raises(ImportError):
    from fnscale import nope  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_the_package_uses_no_old_spelling_and_a_user_s_warns_once_per_line():
  # In a fresh interpreter (pytest records every warning): importing every module of the
  # package raises none of fnscale's DeprecationWarnings (it reaches its own names by their
  # one spelling); then, with warnings shown once per line (the "default" action, Python's
  # own for a script's __main__), a loop through an old spelling says so once, at the
  # user's line, not fnscale's.
  code = textwrap.dedent("""\
      import sys, warnings
      warnings.filterwarnings("error", message=r"fnscale\\.", category=DeprecationWarning)
      sys.path.insert(0, "tests")
      import surface
      surface.submodules("fnscale")
      warnings.resetwarnings()
      warnings.simplefilter("default")
      import fnscale as fs
      for _ in range(3):
        fs.hlo.summarize
      """)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     check=False, cwd=surface.__file__.rsplit("/tests/", 1)[0])
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stderr.count("DeprecationWarning") == 1, r.stderr[-2000:]
  assert "<string>:10: DeprecationWarning: fnscale.hlo is deprecated: use fnscale.analysis.hlo" \
      in r.stderr
