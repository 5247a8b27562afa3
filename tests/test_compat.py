"""fnscale._compat, entry by entry, against the installed jax: each test fails, naming its
entry, when a JAX release changes what fnscale relies on (see the module docstring)."""
import ast
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import mesh_utils
from jax.extend import core as jcore

import fnscale as fs
from fnscale import _compat

import multiprocess as mp

WORKER = str(pathlib.Path(__file__).with_name("compat_worker.py"))
REPO = pathlib.Path(__file__).resolve().parents[1]


def _worker(mode: str, processes: int = 1) -> list[dict]:
  results = mp.run([WORKER, mode], processes, 1, timeout_s=120)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  return [mp.records(r.stdout)[-1] for r in results]


def test_tested_range_is_pyproject_s_and_holds_the_installed_jax():
  deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
  assert f"jax{_compat.TESTED_JAX}" in deps and f"jaxlib{_compat.TESTED_JAX}" in deps
  low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", _compat.TESTED_JAX).groups()
  version = tuple(int(x) for x in jax.__version__.split(".")[:3])
  assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split("."))), (
      f"jax {jax.__version__} is outside the tested range {_compat.TESTED_JAX}")


@pytest.mark.multiprocess
def test_distributed_state_backends_and_preemption_key():
  (r,) = _worker("runtime")
  # Before the join: no client, one process, no preemption service, no backends yet.
  assert r["before"] == [False, True, 0, 1, False]
  assert r["after"] == [0, 1, r["coordinator"], True]
  # The client's key-value store and barrier, as fnscale uses them.
  assert r["try_get"] == "2" and r["blocking_get"] == "3" and r["missing"] != "returned"
  assert r["dir"] == [["t/a", "2"], ["t/b", "3"]]
  # JAX's preemption notifier published the SIGTERM under PREEMPTION_NOTICE_KEY.
  assert r["notice"]
  assert r["backends_after"] is True


@pytest.mark.multiprocess
def test_barrier_absentees_and_is_peer_failure_read_a_real_barrier_timeout():
  first, _ = _worker("barrier", processes=2)
  assert "reached the barrier" in first["text"], first["text"]
  assert first["parsed"] == [1, [1]], first["text"]
  # The coordination service's own error text reads as a lost peer (peer_guard's check).
  assert _compat.is_peer_failure(first["text"]), first["text"]


def test_barrier_absentees_of_other_text():
  assert _compat.barrier_absentees("something else") == (None, [])
  text = ("DEADLINE_EXCEEDED: Barrier timed out. # of tasks that reached the barrier: 1/3. "
          "Some timed out task names:\n/job:jax_worker/replica:0/task:1\n"
          "/job:jax_worker/replica:0/task:2\nRPC: /tensorflow.CoordinationService/Barrier")
  assert _compat.barrier_absentees(text) == (1, [1, 2])


def test_concrete_mesh_outside_inside_and_under_a_trace():
  mesh = fs.make_mesh({"data": 8})
  assert _compat.concrete_mesh().empty
  with jax.set_mesh(mesh):
    assert _compat.concrete_mesh() == mesh
    seen = []
    jax.jit(lambda x: seen.append(_compat.concrete_mesh()) or x)(1.0)
    assert seen == [mesh]  # while tracing, where jax.sharding.get_mesh refuses
  # Only an abstract mesh (a described target): no concrete one.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert _compat.concrete_mesh().empty


def _scan_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn
    for sub in jcore.jaxprs_in_params(eqn.params):
      yield from _scan_eqns(sub)


def test_scan_parts_split_consts_carry_and_xs():
  w, v = jnp.ones((3,)), jnp.ones((3,)) * 2

  def f(carry, xs):
    body = lambda c, x: ((c[0] * w * v + x[0], c[1] + x[2]), c[0] + x[1][:3])
    return jax.lax.scan(body, carry, xs)

  xs = (jnp.ones((5, 3)), jnp.ones((5, 4)), jnp.ones((5,)))
  (eqn,) = _scan_eqns(jax.make_jaxpr(f)((jnp.ones(3), jnp.float32(1)), xs).jaxpr)
  parts = _compat.scan_parts(eqn)
  assert parts.length == 5
  assert [v.aval.shape for v in parts.consts] == [(3,), (3,)]  # w and v, closed over
  assert [v.aval.shape for v in parts.carry] == [(3,), ()]
  assert [v.aval.shape for v in parts.xs] == [(5, 3), (5, 4), (5,)]


def test_scan_parts_inside_a_gradient():
  # The planner reads the scan of value_and_grad's program (forward and transposed scans).
  def loss(layers, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, layers)[0].sum()

  jx = jax.make_jaxpr(jax.value_and_grad(loss))(jnp.ones((4, 8, 8)), jnp.ones((2, 8)))
  scans = [_compat.scan_parts(e) for e in _scan_eqns(jx.jaxpr)]
  assert scans and {s.length for s in scans} == {4}
  assert all(any(v.aval.shape == (2, 8) for v in s.carry) for s in scans)


def test_scan_parts_of_an_unknown_layout_names_the_entry():
  class Eqn:  # what a future release might hand over
    params = {"length": 3, "layout": object()}
    invars = []

  with pytest.raises(fs.FnscaleError, match=r"fnscale._compat.scan_parts: scan's params are "
                                            r"\['layout', 'length'\].* tested with jax >="):
    _compat.scan_parts(Eqn())


@pytest.fixture(scope="module")
def log_lines():
  (r,) = _worker("log")
  return r


def test_xla_log_lines_and_the_gspmd_notice(log_lines):
  gspmd = log_lines["gspmd"]
  # XLA's C++ log format, and GSPMD's notice on a process's first GSPMD compile.
  assert re.search(r"^W\d{4} [\d:.]+\s+\d+ \S+\.cc:\d+\] GSPMD sharding propagation is going "
                   r"to be deprecated", gspmd["raw"], re.M), gspmd["raw"][-2000:]
  for name in ("gspmd", "shardy"):
    messages = log_lines[name]["messages"]
    assert len(messages) == 1, (name, messages)
    assert messages[0].startswith("[SPMD] Involuntary full rematerialization. The compiler "
                                  "cannot go from sharding {"), (name, messages)


def _eqns(jaxpr, name):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      yield eqn
    for sub in jcore.jaxprs_in_params(eqn.params):
      yield from _eqns(sub, name)


def test_name_scopes_and_dot_contracting_dims():
  def f(a, b):
    with jax.named_scope("outer"):
      with jax.named_scope("inner"):
        return jax.lax.dot_general(a, b, (((0, 2), (1, 0)), ((), ())))

  jx = jax.make_jaxpr(f)(jnp.ones((3, 5, 4)), jnp.ones((4, 3, 7)))
  (eqn,) = _eqns(jx.jaxpr, "dot_general")
  assert _compat.name_scopes(eqn) == "outer/inner"
  assert _compat.dot_contracting_dims(eqn) == (0, 2)
  (plain,) = _eqns(jax.make_jaxpr(jnp.dot)(jnp.ones((2, 6)), jnp.ones((6, 3))).jaxpr,
                   "dot_general")
  assert _compat.name_scopes(plain) == "" and _compat.dot_contracting_dims(plain) == (1,)


def test_ragged_dot_dims_of_the_forward_and_its_weight_gradient():
  lhs, rhs, sizes = jnp.ones((6, 3)), jnp.ones((2, 3, 4)), jnp.array([2, 4], jnp.int32)
  jx = jax.make_jaxpr(jax.value_and_grad(
      lambda r: jax.lax.ragged_dot(lhs, r, sizes).sum()))(rhs)
  fwd, *bwd = _eqns(jx.jaxpr, "ragged_dot_general")
  assert _compat.ragged_dot_dims(fwd) == _compat.RaggedDims((1,), (), (0,))
  # The weight gradient: lhs^T against the cotangent, ragged in the contracted rows.
  assert [_compat.ragged_dot_dims(e).rhs_group for e in bwd] == [()]


def test_kernel_cost_of_a_pallas_call_with_and_without_an_estimate():
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def call(name, cost):
    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       interpret=True, name=name, cost_estimate=cost)
    (eqn,) = _eqns(jax.make_jaxpr(f)(jnp.ones((8, 128))).jaxpr, "pallas_call")
    return _compat.kernel_cost(eqn)

  cost = pl.CostEstimate(flops=1234, transcendentals=0, bytes_accessed=8192)
  assert call("doubler", cost) == _compat.KernelCost("doubler", 1234.0)
  assert call("plain", None) == _compat.KernelCost("plain", None)


def test_jaxpr_entries_of_an_unknown_layout_name_themselves():
  class Eqn:  # what a future release might hand over
    params = {"spec": object()}
    source_info = None

  for entry in ("dot_contracting_dims", "kernel_cost", "name_scopes", "ragged_dot_dims"):
    with pytest.raises(fs.FnscaleError, match=rf"fnscale._compat.{entry}: .* tested with jax"
                       ) as e:
      getattr(_compat, entry)(Eqn())
    # The environment failed, not the input: no `except ValueError` swallows it.
    assert isinstance(e.value, fs.RuntimeFailure) and not isinstance(e.value, ValueError)


def test_detect_cluster_returns_what_it_was_given_and_finds_nothing_off_a_cluster(monkeypatch):
  # Given everything, JAX's detection keeps it; on this machine (no launcher, no metadata
  # service: "deactivate" skips the probes) it finds nothing to add.
  for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "TPU_SKIP_MDS_QUERY"):
    monkeypatch.delenv(name, raising=False)
  assert _compat.detect_cluster("127.0.0.1:1234", 2, 1, None, 5) == ("127.0.0.1:1234", 2, 1)
  assert _compat.detect_cluster(None, None, None, "deactivate", 5) == (None, None, None)


# ------------------------------------------------------- error text of XLA and the runtime

# What a survivor's collective raised in tests/test_multihost.py's lost-process job, jax 0.10.2
# on CPU (gloo over TCP): type name and message, as peer_guard reads them.
GLOO_LOST_PEER = ("JaxRuntimeError UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/"
                  "tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:3261")
# JAX's coordination service on a survivor's stderr (jax 0.10.2) once another process was
# killed while a collective waited for it.
HEARTBEAT_LOST = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):"
                  "\n1\nThe tasks have crashed. Check the task logs for an earlier error, or "
                  "scheduler events (e.g. preemption, eviction) to debug further.")


def test_is_peer_failure_of_collective_and_coordination_service_text():
  # The last: the unreachable service tests/test_liveness.py's stand-in store reports.
  for text in (GLOO_LOST_PEER, HEARTBEAT_LOST,
               "RuntimeError UNAVAILABLE: failed to connect to the coordination service"):
    assert _compat.is_peer_failure(text), text
  with pytest.raises(TypeError) as e:  # jax's own text for a program error: not a lost peer
    jnp.ones(3) + jnp.ones(4)
  assert not _compat.is_peer_failure(f"{e.type.__name__} {e.value}"), str(e.value)


GiB = 1024 ** 3
# XLA's refusal of a program too big for a TPU's HBM: the compile below, with jax 0.10.2
# (libtpu 0.0.42.1) and jax 0.12.0.1 (libtpu 0.0.50.1).
OOM_TEXT = {
    "0.10.2": "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
              "temporaries (48.00G) exceeds available HBM (15.75G).",
    "0.12": "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
            "memory required for HLO temporaries (48.00G) exceeds available HBM (15.75G). HLO "
            "module: jit__lambda.\nSee https://openxla.org/xla/errors/error_1000 for more "
            "details.",
}


def test_oom_text_of_a_real_tpu_compile(tpu_devices):
  # A 24 GiB argument and its double on one v5e chip (16 GiB): libtpu refuses at compile time.
  x = jax.ShapeDtypeStruct((6 * 2 ** 30,), jnp.float32,
                           sharding=jax.sharding.SingleDeviceSharding(tpu_devices("v5e:2x2")[0]))
  with pytest.raises(jax.errors.JaxRuntimeError) as e:
    jax.jit(lambda x: x * 2).lower(x).compile()
  text = str(e.value)
  assert _compat.is_oom_error(text), text
  assert 48 * GiB <= _compat.oom_bytes(text) < 49 * GiB, text


def test_oom_text_quoted_and_other_text():
  for text in OOM_TEXT.values():
    assert _compat.is_oom_error(text) and _compat.oom_bytes(text) == 48 * GiB, text
  assert _compat.oom_bytes("RESOURCE_EXHAUSTED: temporaries (512.5M) exceeds") == 512.5 * 2 ** 20
  assert _compat.oom_bytes("RESOURCE_EXHAUSTED: Out of memory") == float("inf")
  assert not _compat.is_oom_error("INVALID_ARGUMENT: Executable expected shape f32[4]")


class _TpuCore:
  """A stand-in for a TPU v4 device: what mesh_utils reads."""
  platform, device_kind, process_index = "tpu", "TPU v4", 0

  def __init__(self, id, coords, core):
    self.id, self.coords, self.core_on_chip = id, coords, core

  def __repr__(self):
    return f"Dev({self.id})"


def _mesh_utils_error(devices, shape) -> AssertionError:
  with pytest.raises(AssertionError) as e:
    mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  return e.value


def test_is_megacore_error_reads_mesh_utils_refusal():
  # Two devices per chip (TensorCores exposed one by one) on a 2x2 chip grid: refused.
  cores = [_TpuCore(2 * (x + 2 * y) + c, (x, y, 0), c)
           for y in range(2) for x in range(2) for c in range(2)]
  assert _compat.is_megacore_error(_mesh_utils_error(cores, [2, 4]))
  # Three chips of a 2x2 grid leave a hole: mesh_utils' other refusal.
  chips = [_TpuCore(i, (i % 2, i // 2, 0), 0) for i in range(3)]
  hole = _mesh_utils_error(chips, [3])
  assert "dims=(2, 2, 1)" in str(hole) and not _compat.is_megacore_error(hole)
  assert not _compat.is_megacore_error(ValueError("megacore"))


def test_explicit_closure_aval_reads_both_refusals():
  # jax refuses an array on Explicit axes closed over inside a shard_map in two forms.
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  mesh = fs.make_mesh({"data": 2, "tensor": 4}, axis_types="explicit")
  x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, jax.P("data")))
  for manual, spec, form, shape in [({"data", "tensor"}, jax.P("data"), NotImplementedError,
                                     "f32[8@data,4]"),
                                    ({"data"}, jax.P(None, "tensor"), ValueError,
                                     "float32[8,4@tensor]")]:
    closed = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, spec))
    f = jax.shard_map(lambda v, c=closed: v * c.sum(), mesh=mesh, in_specs=jax.P("data"),
                      out_specs=jax.P("data"), axis_names=manual)
    with pytest.raises(form) as err:
      jax.jit(f)(x)
    assert _compat.explicit_closure_aval(err.value).startswith(shape), str(err.value)
  assert _compat.explicit_closure_aval(ValueError("shapes (2,) and (3,) differ")) is None
  assert _compat.explicit_closure_aval(NotImplementedError("other")) is None


def test_explicit_closure_aval_reads_the_refusal_at_lowering():
  # jax 0.12 traces a checked shard_map whose gradient closes over an array split over a
  # manual axis, then its verifier refuses the operand it hoisted (jax 0.10.2 runs it).
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, axis_types="explicit")
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  x, w = put(jnp.ones((8, 4)), jax.P(("data", "fsdp"))), put(jnp.ones((4, 4)), jax.P())
  closed = put(jnp.ones((4, 4)), jax.P("fsdp"))
  loss = lambda w, v: jnp.sum(jnp.tanh(v @ w) @ closed)
  f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(jax.P(), jax.P(("data", "fsdp"))),
                    out_specs=jax.P(), axis_names={"data", "fsdp"}, check_vma=True)
  try:
    jax.jit(f).lower(w, x)
  except ValueError as e:
    assert _compat.explicit_closure_aval(e) == "", str(e)
  else:
    assert jax.__version_info__ < (0, 12), "jax 0.12 lowered it: the refusal is gone"
  assert _compat.explicit_closure_aval(ValueError(
      "Cannot lower jaxpr with verifier errors:\n\t'sdy.manual_computation' op operand shape, "
      "corresponding sharding, and region operand shape at index 0 must match.")) == ""
  assert _compat.explicit_closure_aval(ValueError("Cannot lower jaxpr with verifier "
                                                  "errors: 'stablehlo.add' op")) is None


def test_varying_axes_inside_a_checked_shard_map_and_outside():
  mesh = fs.make_mesh({"data": 4, "tensor": 2})
  seen = {}

  def body(x, y):
    seen["x"], seen["y"] = _compat.varying_axes(x), _compat.varying_axes(y)
    return x

  jax.shard_map(body, mesh=mesh, in_specs=(jax.P("data"), jax.P()), out_specs=jax.P("data"),
                check_vma=True)(jnp.ones((8, 2)), jnp.ones(2))
  # x split over "data" varies over it; y, replicated, varies over nothing.
  assert seen == {"x": frozenset({"data"}), "y": frozenset()}
  assert _compat.varying_axes(jnp.ones(3)) == frozenset()


def test_varying_axes_and_platform_version_of_an_unknown_layout_name_themselves(monkeypatch):
  with pytest.raises(fs.RuntimeFailure, match=r"fnscale._compat.platform_version: .*"
                                              r"client.platform_version .* tested with jax"):
    _compat.platform_version(object())
  monkeypatch.setattr(jax, "typeof", lambda x: object())  # a type without the attribute
  with pytest.raises(fs.RuntimeFailure, match=r"fnscale._compat.varying_axes: object has no "
                                              r"manual_axis_type.varying .* tested with jax"):
    _compat.varying_axes(1.0)


def test_platform_version_of_this_machine_s_devices():
  # The CPU runtime names itself; a GPU's says CUDA or ROCm (what attention reads it for).
  assert _compat.platform_version(jax.devices()[0]).lower() == jax.devices()[0].platform


def _module_uses(tree) -> list[str]:
  """What a module does that only _compat may: import from jax._src, compare jax's version."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
      found.append(f"from {node.module} import")
    if isinstance(node, ast.Import):
      found += [f"import {a.name}" for a in node.names if a.name.startswith("jax._src")]
    if (isinstance(node, ast.Attribute) and node.attr in ("_src",) + _JAX_RENAMED
        and getattr(node.value, "id", None) != "_compat"):
      found.append(f".{node.attr}")
    if isinstance(node, ast.Compare) and "__version__" in ast.dump(node):
      found.append("a version comparison")
    if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr")
        and len(node.args) > 1 and getattr(node.args[1], "value", None) in _JAX_RENAMED):
      found.append(f"{node.func.id}(..., {node.args[1].value!r})")
  return found


# Attributes jax renamed between releases: only _compat may read them.
_JAX_RENAMED = ("vma", "manual_axis_type", "platform_version")


def test_only_compat_reaches_into_jax_internals_or_versions():
  uses = {}
  for f in sorted((REPO / "fnscale").rglob("*.py")) + sorted((REPO / "recipes").rglob("*.py")):
    if f.name != "_compat.py":
      found = _module_uses(ast.parse(f.read_text(), str(f)))
      if found:
        uses[str(f.relative_to(REPO))] = found
  assert not uses, f"private jax or version probes outside fnscale/_compat.py: {uses}"
  # The scan sees them (a negative control on a line that does each).
  assert len(_module_uses(ast.parse(
      "from jax._src import mesh\nimport jax._src.xla_bridge\nif jax.__version__ < '0.11': pass\n"
      "getattr(aval, 'vma', None)\nd.client.platform_version\n"))) == 5


def test_kernel_call_keeps_a_declared_transpose_under_every_transformation():
  # x -> a * x, declared to transpose to ct -> 3 ct (not its true transpose, a * ct):
  # where jax transposes by its own rules, the gradients read a, not 3.
  def scale(a, x):
    return _compat.kernel_call(lambda a, x: [a * x], [a, x], fixed=1,
                               transpose=lambda a, ct: [3.0 * ct])[0]

  a, x = jnp.full(3, 2.0), jnp.arange(3.0)
  assert scale(a, x).tolist() == [0.0, 2.0, 4.0]  # evaluated: the function itself
  assert jax.jit(scale)(a, x).tolist() == [0.0, 2.0, 4.0]  # compiled
  grad = lambda f: jax.grad(lambda x: jnp.sum(f(x)))(x).tolist()
  assert grad(lambda x: scale(a, x)) == [3.0] * 3
  assert grad(jax.jit(lambda x: scale(a, x))) == [3.0] * 3
  # Batched: the same primitive of the batched functions, the declared transpose kept.
  stacked = jnp.stack([x, 2 * x])
  assert jax.vmap(scale, in_axes=(None, 0))(a, stacked).tolist() == (a * stacked).tolist()
  assert jax.grad(lambda s: jnp.sum(jax.vmap(scale, in_axes=(None, 0))(a, s)))(
      stacked).tolist() == [[3.0] * 3] * 2
  # Differentiated in its fixed argument (jax.custom_derivatives.linear_call refuses): x.
  assert jax.jvp(lambda a: scale(a, x), (a,), (jnp.ones(3),))[1].tolist() == x.tolist()


def test_kernel_call_keeps_a_declared_jvp_and_its_jaxpr_in_sight():
  # sin, declared to have the JVP t -> 5 t: jax's own JVP would give cos(x) t.
  def f(x):
    return _compat.kernel_call(lambda x: [jnp.sin(x)], [x],
                               jvp=lambda p, t: [5.0 * t[0]])[0]

  x = jnp.arange(3.0)
  assert jnp.allclose(f(x), jnp.sin(x)) and jnp.allclose(jax.jit(f)(x), jnp.sin(x))
  assert jax.jvp(f, (x,), (x,))[1].tolist() == (5 * x).tolist()
  assert jax.jvp(jax.jit(f), (x,), (x,))[1].tolist() == (5 * x).tolist()
  assert jax.jacfwd(f)(x).tolist() == (5 * jnp.eye(3)).tolist()  # vmap of the JVP
  assert jax.grad(lambda x: jnp.sum(f(x)))(x).tolist() == [5.0] * 3  # linearized, transposed
  # The function's equations stay in a jaxpr param, where readers of jaxprs find them.
  eqn, = jax.make_jaxpr(f)(x).jaxpr.eqns
  assert [e.primitive.name for j in jcore.jaxprs_in_params(eqn.params) for e in j.eqns
          ] == ["sin"]


def test_kernel_call_runs_a_pallas_call_inside_a_checked_shard_map():
  # A Pallas call refuses to trace where varying types are checked (its output types
  # can't say it varies); as a kernel_call it runs there, its result typed as varying.
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  kernel = lambda x: [pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                     interpret=True)(x)]
  seen = []

  def body(x):
    y, = _compat.kernel_call(kernel, [x], jvp=lambda p, t: [2.0 * t[0]])
    seen.append(_compat.varying_axes(y))
    return y

  mesh = fs.make_mesh({"data": 8})
  f = jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"),
                    check_vma=True)
  x = jnp.arange(16.0)
  assert jax.jit(f)(x).tolist() == (2 * x).tolist()
  assert seen[-1] == frozenset({"data"})
  assert jax.jit(jax.grad(lambda x: jnp.sum(f(x) * x)))(x).tolist() == (4 * x).tolist()
  with pytest.raises(ValueError, match="check_vma"):  # the refusal kernel_call avoids
    jax.jit(jax.shard_map(lambda x: kernel(x)[0], mesh=mesh, in_specs=jax.P("data"),
                          out_specs=jax.P("data"), check_vma=True))(x)


def test_lower_jaxpr_keeps_what_a_jaxpr_computes():
  jaxpr = jax.make_jaxpr(lambda x: jnp.searchsorted(jnp.arange(4.0), x))(jnp.ones(3))
  lowered = _compat._lower_jaxpr(jaxpr)
  assert jcore.jaxpr_as_fun(lowered)(jnp.array([0.5, 2.0, 9.0]))[0].tolist() == [1, 2, 4]


def test_kernel_call_of_an_unknown_layout_names_itself(monkeypatch):
  from jax.interpreters import ad  # pylint: disable=import-outside-toplevel
  _compat._kernel_primitive.cache_clear()
  monkeypatch.delattr(ad, "primitive_transposes")
  try:
    with pytest.raises(fs.RuntimeFailure, match=r"fnscale._compat.kernel_call: .* tested with"):
      _compat.kernel_call(lambda x: [x], [jnp.ones(2)])
  finally:
    _compat._kernel_primitive.cache_clear()

  from jax._src import config  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import partial_eval  # pylint: disable=import-outside-toplevel
  monkeypatch.delattr(config, "_check_vma")
  with pytest.raises(fs.RuntimeFailure, match=r"fnscale._compat.kernel_call: .*_check_vma"):
    _compat._vma_unchecked()
  monkeypatch.delattr(partial_eval, "lower_jaxpr2")
  with pytest.raises(fs.RuntimeFailure, match=r"fnscale._compat.kernel_call: .*lower_jaxpr2"):
    _compat._lower_jaxpr(None)


def test_memoized_and_compiled_executable_name_jax_s_reuse_of_a_compile():
  # A lowering holds no executable until compiled; a second lowering of the same program
  # holds the first compile's, and its compile() returns that very executable. Both read
  # None from objects of another layout (a jax upgrade): reuse is then never claimed.
  f = jax.jit(lambda x: 3 * x + 1)
  x = jnp.arange(5.0)
  lowered = f.lower(x)
  assert _compat.memoized_executable(lowered) is None
  first = _compat.compiled_executable(lowered.compile())
  assert first is not None
  again = f.lower(x)
  assert _compat.memoized_executable(again) is first
  assert _compat.compiled_executable(again.compile()) is first
  assert _compat.memoized_executable(object()) is None
  assert _compat.compiled_executable(object()) is None


def test_each_function_of_compat_fits_on_a_screen():
  # A JAX release that changes one entry is read and fixed there: no function over 40 code
  # lines (its docstring aside), kernel_call's primitive rules one function each.
  tree = ast.parse((REPO / "fnscale" / "_compat.py").read_text())
  long = {}
  for f in ast.walk(tree):
    if isinstance(f, ast.FunctionDef):
      body = f.body[1:] if isinstance(f.body[0], ast.Expr) and isinstance(
          f.body[0].value, ast.Constant) and len(f.body) > 1 else f.body
      if body[-1].end_lineno - body[0].lineno + 1 > 40:
        long[f.name] = body[-1].end_lineno - body[0].lineno + 1
  assert long == {}


def test_output_names_reads_checkpoint_names_through_nested_jits():
  # What a remat policy saves by name (jax.ad_checkpoint.checkpoint_name), found by
  # _compat.output_names on each output of a jaxpr, directly or inside a jit.
  name = jax.ad_checkpoint.checkpoint_name
  inner = jax.jit(lambda a: (name(a * 2, "inner"), a + 1))
  def fn(a):
    b, c = inner(a)
    return b, c, name(jnp.sin(a), "outer"), a
  closed = jax.make_jaxpr(fn)(jnp.ones(3))
  assert _compat.output_names(closed) == ["inner", None, "outer", None]
  # A kernel run per shard: the names of its shard_map's body, which read as none before,
  # so a policy saving the attention kernel's output recomputed it on any larger mesh.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  per_shard = jax.shard_map(lambda a: (name(a * 2, "shard"), a + 1), mesh=mesh,
                            in_specs=jax.P("d"), out_specs=(jax.P("d"), jax.P("d")))
  closed = jax.make_jaxpr(per_shard)(jnp.ones(8))
  assert _compat.output_names(closed) == ["shard", None]
