"""Every JAX interface fnscale relies on that JAX does not promise to keep, in one module.

fnscale is tested with jax 0.10.2 (Python 3.11) and jax 0.12 (Python 3.12+): `TESTED_JAX`,
the range pyproject.toml states. Each entry here is private to JAX (`jax._src`), an
attribute JAX renamed between releases or keeps undocumented (an array type's varying axes,
a device's runtime client), a parameter layout of JAX's program representation (jaxpr), or a
text format: XLA's logs and errors, the collectives' and the coordination service's errors,
`mesh_utils`' refusals. No other module of fnscale reaches into `jax._src` or probes jax for
an attribute or a version (`tests/test_compat.py` also checks that).
`tests/test_compat.py` has a test per entry that fails, naming the entry, when a JAX release
changes it; an entry that finds JAX changed at run time raises `RuntimeFailure` naming itself,
the installed jax and the tested range.

Where JAX has a public interface fnscale uses it and it is not here:
`jax.distributed.is_initialized`, `jax.process_count`, `jax.experimental.multihost_utils`
(barriers over devices, the preemption sync point), `jax.extend.core.jaxprs_in_params`
(the programs inside an equation, open in both releases), `jax.sharding.get_abstract_mesh`.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

import jax
import jax.ad_checkpoint
import jax.extend
import jax.numpy as jnp

from fnscale._errors import RuntimeFailure

# The JAX releases fnscale is tested with; pyproject.toml's `jax` requirement says the same.
TESTED_JAX = ">=0.10.2,<0.12.1"


def _changed(entry: str, what: str) -> RuntimeFailure:
  # Not bad input: the installed JAX is not the one this entry was written for.
  return RuntimeFailure(
      f"fnscale._compat.{entry}: {what} in jax {jax.__version__}; fnscale is tested with jax "
      f"{TESTED_JAX}. Fix: install a jax in that range (pip install 'jax{TESTED_JAX}'), or "
      "adapt this entry of fnscale/_compat.py to the new release.")


# ------------------------------------------------ multi-process runtime (jax._src.distributed)

class DistributedState(NamedTuple):
  """What `jax.distributed.initialize` set up in this process (a snapshot).

  `client`: the coordination service's client (key-value store: `key_value_set(key, value,
  allow_overwrite=)`, `key_value_try_get`, `blocking_key_value_get(key, timeout_ms)`,
  `key_value_dir_get(prefix)`; `wait_at_barrier(name, timeout_ms)`), None when not joined.
  `preemption_sync`: JAX's preemption sync manager runs (`jax_enable_preemption_service`).
  """
  client: Any
  process_id: int
  num_processes: int
  coordinator_address: str | None
  preemption_sync: bool


def distributed_state() -> DistributedState:
  """JAX's distributed runtime in this process (`jax._src.distributed.global_state`): there
  is no public accessor for the client, and `jax.process_count` would start the backends.

  Raises:
    RuntimeFailure: JAX moved or renamed it.
  """
  try:
    from jax._src import distributed as jd  # pylint: disable=g-import-not-at-top
    st = jd.global_state
    return DistributedState(st.client, int(st.process_id or 0), int(st.num_processes or 1),
                            st.coordinator_address, st.preemption_sync_manager is not None)
  except (ImportError, AttributeError) as e:
    raise _changed("distributed_state", f"jax._src.distributed.global_state is gone ({e})"
                   ) from None


def detect_cluster(coordinator_address, num_processes, process_id, method, timeout_s: int):
  """JAX's own cluster detection (Cloud TPU VMs and GKE, SLURM, Open MPI, ...), as
  `jax.distributed.initialize` runs it for what it isn't given: `(coordinator_address,
  num_processes, process_id)`, each None where it found nothing. Public jax offers it only
  inside `initialize`, and fnscale needs the coordinator first, to bound the wait for it.

  Raises:
    RuntimeFailure: JAX moved or renamed `clusters.ClusterEnv.auto_detect_unset_distributed_params`.
    Whatever the detection itself raises (a metadata service that doesn't answer, ...).
  """
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
  except (ImportError, AttributeError) as e:
    raise _changed("detect_cluster", f"jax._src.clusters' detection is gone ({e})") from None
  found = detect(coordinator_address, num_processes, process_id, None, method, timeout_s)
  return tuple(found[:3])


def backends_initialized() -> bool:
  """Whether JAX has started its backends (then `jax.distributed.initialize` is too late).

  Raises:
    RuntimeFailure: JAX moved or renamed `xla_bridge.backends_are_initialized`.
  """
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError) as e:
    raise _changed("backends_initialized",
                   f"jax._src.xla_bridge.backends_are_initialized is gone ({e})") from None


# Where JAX's preemption sync manager (in jaxlib's C++) publishes a notice, in the
# coordination service's key-value store: the time it came.
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"

# A coordination-service barrier that timed out: "... # of tasks that reached the barrier:
# 1/3 ... Some timed out task names: 1 2 ... RPC: ..." (task names bare ids or
# "/job:jax_worker/replica:0/task:1").
_BARRIER_REACHED = re.compile(r"reached the barrier:\s*(\d+)\s*/\s*(\d+)")
_BARRIER_TASK = re.compile(r"(?:task:)?(\d+)\s*(?:\n|$)")


def barrier_absentees(text: str) -> tuple[int | None, list[int]]:
  """(how many processes arrived, ids of those that didn't) from the error text of a
  coordination-service barrier that timed out; (None, []) for other text."""
  m = _BARRIER_REACHED.search(text)
  arrived = int(m.group(1)) if m else None
  tail = text.split("timed out task names:", 1)
  if len(tail) < 2:
    return arrived, []
  names = tail[1].split("RPC:", 1)[0]
  return arrived, sorted({int(x) for x in _BARRIER_TASK.findall(names)})


# ------------------------------------------------------------------------- meshes

def concrete_mesh():
  """The concrete mesh `jax.set_mesh` put in force (an empty Mesh if none), also while
  tracing, where the public `jax.sharding.get_mesh` refuses.

  Raises:
    RuntimeFailure: JAX moved or renamed `jax._src.mesh.get_concrete_mesh`.
  """
  try:
    from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    return mesh_lib.get_concrete_mesh()
  except (ImportError, AttributeError) as e:
    raise _changed("concrete_mesh", f"jax._src.mesh.get_concrete_mesh is gone ({e})") from None


def is_megacore_error(err: BaseException) -> bool:
  """Whether `jax.experimental.mesh_utils.create_device_mesh` refused TPU devices exposed one
  per TensorCore rather than one per chip: its AssertionError "Creating meshes for TPU >v3
  requires one device per chip ("megacore" mode). Got device id 1 for a device of kind TPU
  v4: ..." (jax 0.10.2 and 0.12)."""
  return isinstance(err, AssertionError) and "megacore" in str(err)


_MESH_MISMATCH = re.compile(
    r"context mesh (AbstractMesh\(.*?\)) should match the aval mesh (AbstractMesh\(.*?\)) "
    r"for shape (\S+)")


# jax 0.12 lowers a shard_map (check_vma=True) whose body closes over an array split over
# one of its manual axes, then its verifier refuses the operand jax hoisted for it.
_HOISTED_OPERAND = "'sdy.manual_computation' op operand shape, corresponding sharding"


def explicit_closure_aval(err: BaseException) -> str | None:
  """The type jax names when code traced inside a `jax.shard_map` closes over an array
  sharded on Explicit mesh axes, or None for any other error. jax 0.10.2 and 0.12 say it
  three ways: a NotImplementedError "Closing over inputs to shard_map where the input is
  sharded on `Explicit` axes is not implemented. ... Got input with shape
  f32[64@fsdp,64]({Explicit: ('data', 'fsdp')})" where every other axis is Auto or Manual;
  a ValueError "For primitive dot_general, context mesh AbstractMesh(... Manual ...)
  should match the aval mesh AbstractMesh(... Explicit ...) for shape float32[16@data,16]"
  where some other axis is Explicit; and (jax 0.12, at lowering, the array split over a
  manual axis) a ValueError "Cannot lower jaxpr with verifier errors: 'sdy.manual_computation'
  op operand shape, corresponding sharding, and region operand shape at index 0 must
  match", which names no type. Returns that type's text ("" if the message has none).
  """
  text = str(err)
  if isinstance(err, NotImplementedError) and "Closing over inputs to shard_map" in text:
    found = re.search(r"Got input with shape (.+)", text)
    return found.group(1).strip() if found else ""
  if isinstance(err, ValueError) and _HOISTED_OPERAND in text:
    return ""
  found = _MESH_MISMATCH.search(text) if isinstance(err, ValueError) else None
  if found and "Manual" in found.group(1) and "Explicit" in found.group(2):
    return found.group(3).rstrip(".")
  return None


class TypedRefusal(NamedTuple):
  """jax refusing an op's sharding in types (`out_sharding=`, `jax.sharding.reshard`):
  `kind` "manual" (the op names an axis that is Manual: inside `jax.shard_map`),
  "constraint" (a `with_sharding_constraint` naming an axis that is Manual there), "auto"
  (an Auto axis), "missing" (an axis the mesh lacks) or "mismatch" (operands sharded
  differently, a ShardingTypeError); `axis` the axis named, or None; `text` jax's message's
  first line."""
  kind: str
  axis: str | None
  text: str


_TYPED_AXIS = re.compile(r"cannot contain axis names that are of type Auto or Manual\..*? "
                         r"with axis name: (\S+) of type: AxisType\.(\w+)", re.S)
# jax's refusal of a sharding naming an axis the mesh in scope lacks (group 1: the axis).
MISSING_AXIS = re.compile(r"Resource axis: (\S+) of .*? is not found in mesh", re.S)


def typed_refusal(err: BaseException) -> TypedRefusal | None:
  """The `TypedRefusal` behind `err`, or None for any other error. jax 0.10.2 says: a
  ValueError "PartitionSpec passed to dot_general cannot contain axis names that are of type
  Auto or Manual. Got PartitionSpec: P('data', None) with axis name: data of type:
  AxisType.Manual"; a NotImplementedError "Going from `Manual` AxisType to `Auto` or
  `Explicit` AxisType is not allowed"; a ValueError "Resource axis: data of P('data', None)
  is not found in mesh: ('fsdp',)"; a ValueError "The spec of NamedSharding passed to
  with_sharding_constraint can only refer to Auto axes of the mesh"; a `ShardingTypeError`
  (no public class: read by name)
  "sub got incompatible shardings for broadcasting: ...".
  """
  text = str(err)
  first = text.split(" This error occurs at source")[0].splitlines()[0] if text else ""
  if isinstance(err, NotImplementedError) and "Going from `Manual` AxisType" in text:
    return TypedRefusal("manual", None, first)
  if type(err).__name__ == "ShardingTypeError":
    return TypedRefusal("mismatch", None, first)
  if not isinstance(err, ValueError):
    return None
  if "can only refer to Auto axes" in text:  # with_sharding_constraint naming a Manual axis
    return TypedRefusal("constraint", None, first)
  found = _TYPED_AXIS.search(text)
  if found and found.group(2) in ("Manual", "Auto"):
    return TypedRefusal(found.group(2).lower(), found.group(1), first)
  found = MISSING_AXIS.search(text)
  if found:
    return TypedRefusal("missing", found.group(1), first)
  return None


# ------------------------------------------------------------ array types and devices

def varying_axes(x) -> frozenset[str]:
  """The manual mesh axes `x` varies over inside a `jax.shard_map` that checks them (jax's
  varying-manual-axes type; empty outside one): `jax.typeof(x).manual_axis_type.varying` in
  jax 0.10.2 and 0.12 (the documented `.vma` of earlier releases is gone).

  Raises:
    RuntimeFailure: the value's type carries no `manual_axis_type.varying`.
  """
  aval = jax.typeof(x)
  try:
    return frozenset(aval.manual_axis_type.varying)
  except AttributeError as e:
    raise _changed("varying_axes", f"{type(aval).__name__} has no manual_axis_type.varying "
                   f"({e})") from None


def platform_version(device) -> str:
  """The version string of the runtime behind `device` (`device.client.platform_version`:
  "cpu" on CPU; on GPUs it names CUDA or ROCm), which public jax doesn't offer.

  Raises:
    RuntimeFailure: the device carries no `client.platform_version`.
  """
  try:
    return str(device.client.platform_version)
  except AttributeError as e:
    raise _changed("platform_version", f"a {type(device).__name__} has no "
                   f"client.platform_version ({e})") from None


# ------------------------------------------------------------------------- autodiff

def _primitive_tables():
  """jax's primitive class and rule tables (`jax.extend.core`, `jax.interpreters`: public
  modules whose contents JAX does not promise to keep)."""
  try:
    from jax.extend import core  # pylint: disable=g-import-not-at-top
    from jax.interpreters import ad, batching, mlir  # pylint: disable=g-import-not-at-top
    return (core.Primitive, ad.Zero, ad.instantiate_zeros,
            ad.primitive_jvps, ad.primitive_transposes, batching.primitive_batchers,
            mlir.register_lowering, mlir.core_call_lowering)
  except (ImportError, AttributeError) as e:
    raise _changed("kernel_call", f"jax's primitive rule tables moved ({e})") from None


def _lower_jaxpr(jaxpr):
  """`jaxpr` with jax's high-level operations in low-level ones
  (`jax._src.interpreters.partial_eval.lower_jaxpr2`, as jax lowers a jit's).

  Raises:
    RuntimeFailure: JAX moved or renamed it.
  """
  try:
    from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
    return pe.lower_jaxpr2(jaxpr)
  except (ImportError, AttributeError) as e:
    raise _changed("kernel_call", f"jax's lower_jaxpr2 is gone ({e})") from None


def _vma_unchecked():
  """A context in which jax checks no varying manual axes (as inside `jax.shard_map(...,
  check_vma=False)`): `jax._src.config._check_vma`, which shard_map itself sets.

  Raises:
    RuntimeFailure: JAX moved or renamed it.
  """
  try:
    from jax._src import config  # pylint: disable=g-import-not-at-top
    return config._check_vma(False)  # pylint: disable=protected-access
  except (ImportError, AttributeError, TypeError) as e:
    raise _changed("kernel_call", f"jax._src.config._check_vma is gone ({e})") from None


def _untyped(x):
  """`x` without varying axes in its type, where none are checked: there an operation of
  two operands varies over no axis (`core.standard_vma_rule`; one of one operand keeps its
  operand's). max(x, x): the same bits, for every dtype, which XLA folds away."""
  return jax.lax.max(x, x)


class _Traced(NamedTuple):
  jaxpr: Any  # the ClosedJaxpr of fn
  out_avals: tuple  # the primitive's output types
  unchecked: bool  # traced and run where no varying axes are checked


def _trace(fn, args, kernels: bool) -> _Traced:
  """`fn` on `args` as a jaxpr. Where an argument varies over manual axes of a shard_map
  that checks them and `fn` holds kernels (Pallas calls, whose output types can't say
  so), `fn` is traced on the arguments' shapes alone where nothing is checked, and its
  outputs are typed as varying over every axis an argument varies over: per-device
  results of per-device data."""
  varying = tuple(sorted(set().union(*(varying_axes(a) for a in args))))
  whole = lambda *a: list(fn(*a))
  if not (kernels and varying):
    traced = jax.make_jaxpr(whole)(*args)
    return _Traced(traced, tuple(traced.out_avals), False)
  def shape(x):  # an argument's or an output's type without its varying axes
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding)
  with _vma_unchecked():
    traced = jax.make_jaxpr(whole)(*map(shape, args))
  typed = jax.make_jaxpr(lambda *a: [jax.lax.pcast(x, varying, to="varying") for x in a])(
      *map(shape, traced.out_avals))
  return _Traced(traced, tuple(typed.out_avals), True)


def _kernel_evaluate(*args, jaxpr, on_evaluate, unchecked, **_):
  """`kernel_call`'s primitive run eagerly: its jaxpr."""
  if on_evaluate is not None:
    on_evaluate()
  if not unchecked:
    return jax.extend.core.jaxpr_as_fun(jaxpr)(*args)
  with _vma_unchecked():  # the arguments' types as the jaxpr was traced for: no axes
    return jax.extend.core.jaxpr_as_fun(jaxpr)(*map(_untyped, args))


def _kernel_jvp(p, zero, instantiate, primals, tangents, **params):
  """The JVP rule of `kernel_call`'s primitive `p` (`zero`, `instantiate`: jax's `ad.Zero`,
  `ad.instantiate_zeros`)."""
  outs, fixed = p.bind(*primals, **params), params["fixed"]
  if params["jvp"] is not None:
    t_out = params["jvp"](list(primals), list(map(instantiate, tangents)))
    return outs, [zero(a.to_tangent_aval()) if t is None else t
                  for a, t in zip(params["out_avals"], t_out)]
  # A linear map: itself in its linear arguments (its transpose kept), and jax's JVP of
  # the function in the fixed ones.
  parts = []
  if any(type(t) is not zero for t in tangents[fixed:]):
    parts.append(p.bind(*primals[:fixed], *map(instantiate, tangents[fixed:]), **params))
  if any(type(t) is not zero for t in tangents[:fixed]):
    parts.append(jax.jvp(jax.extend.core.jaxpr_as_fun(params["jaxpr"]), list(primals),
                         [*map(instantiate, tangents[:fixed]),
                          *(jnp.zeros_like(x) for x in primals[fixed:])])[1])
  if not parts:
    return outs, [zero(a.to_tangent_aval()) for a in params["out_avals"]]
  return outs, [sum(ts[1:], ts[0]) for ts in zip(*parts)]


def _kernel_transpose(instantiate, cts, *args, transpose, fixed, **_):
  """The transpose rule: the linear map's own `transpose`, in its linear arguments."""
  return [None] * fixed + list(transpose(*args[:fixed], *map(instantiate, cts)))


def _kernel_batch(p, args, dims, *, jaxpr, jvp, transpose, fixed, out_avals, on_evaluate,
                  unchecked):
  """The batching rule: the same primitive `p` of the batched functions, so that its rules
  hold under vmap; a linear map's linear arguments all batched, so its transpose's outputs
  match them."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  if transpose is not None:
    args[fixed:] = [a if d is not None else jnp.broadcast_to(a, (size, *a.shape))
                    for a, d in zip(args[fixed:], dims[fixed:])]
    dims = [*dims[:fixed], *[0] * (len(args) - fixed)]
  axes = [None if d is None else 0 for d in dims]
  batched = _trace(jax.vmap(jax.extend.core.jaxpr_as_fun(jaxpr), in_axes=axes), args,
                   unchecked)
  outs = p.bind(
      *args, jaxpr=batched.jaxpr,
      jvp=None if jvp is None else jax.vmap(jvp, in_axes=(axes, axes)),
      transpose=None if transpose is None else jax.vmap(
          transpose, in_axes=(*axes[:fixed], *[0] * len(out_avals))),
      fixed=fixed, out_avals=batched.out_avals, on_evaluate=on_evaluate,
      unchecked=batched.unchecked)
  return outs, [0] * len(outs)


def _kernel_lowering(call_lowering, ctx, *args, jaxpr, on_evaluate, **_):
  """The jaxpr as traced (a call), not traced again with the lowering's types: a kernel's
  was traced without the varying axes its arguments have there."""
  if on_evaluate is not None:
    on_evaluate()
  return call_lowering(ctx, *args, name="fnscale_kernel_call", call_jaxpr=jaxpr)


def _kernel_to_lojax(p, *args, jaxpr, **params):
  """A jaxpr holding jax's high-level operations (jax 0.12's searchsorted, inside
  megablox), lowered before compiling like a jit's."""
  return p.bind(*args, jaxpr=_lower_jaxpr(jaxpr), **params)


@functools.lru_cache(maxsize=None)
def _kernel_primitive():
  """The primitive behind `kernel_call`, defined on first use (cached so that it is defined
  once: a primitive is a name with rules, and a second one would be a second name)."""
  (primitive, zero, instantiate, jvps, transposes, batchers, register,
   call_lowering) = _primitive_tables()
  p = primitive("fnscale_kernel_call")
  p.multiple_results = True
  p.def_impl(_kernel_evaluate)
  p.def_abstract_eval(lambda *args, out_avals, **_: out_avals)
  p.to_lojax = functools.partial(_kernel_to_lojax, p)
  register(p, functools.partial(_kernel_lowering, call_lowering))
  jvps[p] = functools.partial(_kernel_jvp, p, zero, instantiate)
  transposes[p] = functools.partial(_kernel_transpose, instantiate)
  batchers[p] = functools.partial(_kernel_batch, p)
  return p


def kernel_call(fn, args, *, jvp=None, transpose=None, fixed: int = 0, on_evaluate=None,
                kernels: bool = True) -> list:
  """`fn(*args)` (flat lists of arrays in and out) as one jax primitive with the
  derivative rules given, which jax keeps wherever it traces (a `jax.custom_jvp` can be
  inlined, its rule dropped, where jax hoists a scan's loop-invariant work after
  linearizing it):

  - `jvp(primals, tangents)` -> the outputs' tangents (None for a zero), for a function
    with a reverse-mode rule of its own elsewhere; jax never transposes it.
  - `transpose(*args[:fixed], *cotangents)` -> the cotangents of `args[fixed:]`, for `fn`
    linear in those (its other arguments fixed): jax transposes it by this function instead
    of by its own rules (`jax.custom_derivatives.linear_call`, which jax can neither batch
    nor differentiate in its fixed arguments), and differentiates it as `fn`.

  Evaluated or compiled it runs `fn` (traced once, here: `fn` must not close over traced
  values) and calls `on_evaluate()` first (None: nothing); under `jax.vmap`, the same
  primitive of the batched functions. `kernels`: `fn` may hold Pallas calls, which inside
  a `jax.shard_map` that checks varying axes run where none is checked (`_trace`).

  Raises:
    RuntimeFailure: jax's primitive rule tables are not where they were.
  """
  traced = _trace(fn, args, kernels)
  outs = _kernel_primitive().bind(*args, jaxpr=traced.jaxpr, jvp=jvp, transpose=transpose,
                                  fixed=fixed, out_avals=traced.out_avals,
                                  on_evaluate=on_evaluate, unchecked=traced.unchecked)
  names = output_names(traced.jaxpr)
  return [o if n is None else jax.ad_checkpoint.checkpoint_name(o, n)
          for o, n in zip(outs, names)]


def output_names(closed) -> list:
  """The `jax.ad_checkpoint.checkpoint_name` each output of a ClosedJaxpr carries (None:
  none), looking through nested jit calls and shard_maps (a kernel run per shard), as jax's
  remat policies read it (the `name` equations and the `jit` and `shard_map` primitives'
  `jaxpr` parameter are jaxpr internals)."""
  def name(jaxpr, var):
    while isinstance(var, jax.extend.core.Var):
      made = {v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
      if var not in made:
        return None
      eqn, i = made[var]
      if eqn.primitive.name == "name":
        return eqn.params["name"]
      inner = (eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit", "shard_map")
               else None)
      if inner is None:
        return None
      jaxpr = getattr(inner, "jaxpr", inner)
      var = jaxpr.outvars[i]
    return None
  return [name(closed.jaxpr, v) for v in closed.jaxpr.outvars]


# ------------------------------------------------------------------------- jaxprs

class ScanParts(NamedTuple):
  """A `lax.scan` equation: its `length` and its operands split into (consts, carry, xs)."""
  length: int
  consts: list
  carry: list
  xs: list


def scan_parts(eqn) -> ScanParts:
  """Reads a `scan` equation: jax 0.10.2 counts consts and carry (`num_consts`,
  `num_carry`); jax 0.12 describes the operands as a flat tree of (consts, carry, xs)
  (`ft_in`), each group's `len` its number of operands.

  Raises:
    RuntimeFailure: neither layout (a JAX release changed scan's params).
  """
  p = eqn.params
  if "num_consts" in p and "num_carry" in p:
    n_consts, n_carry = p["num_consts"], p["num_carry"]
  elif hasattr(p.get("ft_in"), "unpack"):
    groups = p["ft_in"].unpack()
    if len(groups) != 3:
      raise _changed("scan_parts", f"scan's ft_in has {len(groups)} groups, not 3")
    n_consts, n_carry = len(groups[0]), len(groups[1])
  else:
    raise _changed("scan_parts", f"scan's params are {sorted(p)} (neither num_consts/"
                   "num_carry nor ft_in)")
  ops = list(eqn.invars)
  return ScanParts(int(p["length"]), ops[:n_consts], ops[n_consts:n_consts + n_carry],
                   ops[n_consts + n_carry:])


def bind_equation(eqn, invals) -> list:
  """The outputs of a jaxpr equation applied to `invals`, as `jax.core.eval_jaxpr` binds it
  (jax 0.10.2 and 0.12: `primitive.get_bind_params`, under the equation's `ctx.manager`).

  Raises:
    RuntimeFailure: the equation has neither (a JAX release changed them).
  """
  try:
    params = eqn.primitive.get_bind_params(eqn.params)
    manager = eqn.ctx.manager
  except AttributeError as e:
    raise _changed("bind_equation", f"a jaxpr equation can't be bound as before ({e})"
                   ) from None
  if isinstance(params, tuple):  # older jax: (subfuns, params)
    subfuns, params = params
  else:
    subfuns = ()
  with manager:
    ans = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def name_scopes(eqn) -> str:
  """The `jax.named_scope` names an equation was traced under, "/"-joined (its
  `source_info.name_stack`; a `jit` or `custom_vjp` body's equations start afresh).

  Raises:
    RuntimeFailure: the equation carries no `source_info.name_stack`.
  """
  try:
    return str(eqn.source_info.name_stack)
  except AttributeError as e:
    raise _changed("name_scopes", f"a jaxpr equation has no source_info.name_stack ({e})"
                   ) from None


def dot_contracting_dims(eqn) -> tuple[int, ...]:
  """The lhs dimensions a `dot_general` equation contracts (its `dimension_numbers`,
  ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) as `lax.dot_general` takes).

  Raises:
    RuntimeFailure: the params hold no such `dimension_numbers`.
  """
  try:
    (lc, _), _ = eqn.params["dimension_numbers"]
    return tuple(int(i) for i in lc)
  except (KeyError, TypeError, ValueError) as e:
    raise _changed("dot_contracting_dims", f"dot_general's params are {sorted(eqn.params)} "
                   f"({e!r})") from None


class RaggedDims(NamedTuple):
  """A `ragged_dot_general` equation's dimension numbers: the rhs dimensions it contracts,
  pairs as batch, and indexes by group."""
  rhs_contracting: tuple[int, ...]
  rhs_batch: tuple[int, ...]
  rhs_group: tuple[int, ...]


def ragged_dot_dims(eqn) -> RaggedDims:
  """The rhs dimension roles of a `ragged_dot_general` equation (its
  `ragged_dot_dimension_numbers`: `dot_dimension_numbers` as `lax.dot_general` takes them,
  `lhs_ragged_dimensions`, `rhs_group_dimensions`).

  Raises:
    RuntimeFailure: the params hold no such `ragged_dot_dimension_numbers`.
  """
  try:
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, rc), (_, rb) = numbers.dot_dimension_numbers
    return RaggedDims(tuple(int(i) for i in rc), tuple(int(i) for i in rb),
                      tuple(int(i) for i in numbers.rhs_group_dimensions))
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise _changed("ragged_dot_dims", f"ragged_dot_general's params are {sorted(eqn.params)} "
                   f"({e!r})") from None


class KernelCost(NamedTuple):
  """A `pallas_call` equation: its kernel's `name` and the FLOPs its `cost_estimate`
  declares (None: it declares none)."""
  name: str
  flops: float | None


def kernel_cost(eqn) -> KernelCost:
  """Reads a `pallas_call` equation's `name` and `cost_estimate` (`pl.CostEstimate` or None).

  Raises:
    RuntimeFailure: the params hold no `name` or no `cost_estimate` entry.
  """
  p = eqn.params
  if "name" not in p or "cost_estimate" not in p:
    raise _changed("kernel_cost", f"pallas_call's params are {sorted(p)} (no name or "
                   "cost_estimate)")
  cost = getattr(p["cost_estimate"], "flops", None)
  return KernelCost(str(p["name"] or "pallas_call"), float(cost) if cost else None)


# ------------------------------------------------------------------------- compiles

def memoized_executable(lowered):
  """The executable jax keeps on `lowered`'s computation (`jax.stages.Lowered._lowering.
  _executable`) from an earlier compile in this process, which a later `compile()` without
  compiler options returns again, or None."""
  return getattr(getattr(lowered, "_lowering", None), "_executable", None)


def compiled_executable(compiled):
  """The executable a `jax.stages.Compiled` runs (`Compiled._executable`), or None."""
  return getattr(compiled, "_executable", None)


# ------------------------------------------------------------------------- XLA's logs

# An absl/glog line from XLA's C++ code: severity W or E, date, time, thread, file:line].
_LOG_LINE = re.compile(r"^([WE])\d{4} [\d:.]+\s+\d+ [^\]]+\] (.*)$")
# Messages about JAX's configuration, not the program compiled: with GSPMD propagation
# (jax_use_shardy_partitioner off) XLA says that GSPMD is going away, on every compile (jax
# 0.10.2) or the first one (0.12).
_CONFIGURATION_NOTICE = re.compile(r"GSPMD sharding propagation is going to be deprecated")


def xla_log_messages(text: str) -> list[str]:
  """The messages of the warning and error lines XLA's C++ code logged in `text`, in order,
  without XLA's notices about JAX's configuration."""
  out = []
  for line in text.splitlines():
    m = _LOG_LINE.match(line.strip())
    if m and not _CONFIGURATION_NOTICE.match(m.group(2)):
      out.append(m.group(2))
  return out


# ------------------------------------------------------- error text of XLA and the runtime

# A collective's or the coordination service's failure that can mean another process is gone
# ("peer" a word of its own: "TypeError" holds "peEr").
_PEER_FAILURE = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|socket closed|unavailable|"
    r"deadline_exceeded|coordination service|heartbeat|\bpeers?\b", re.IGNORECASE)


def is_peer_failure(text: str) -> bool:
  """Whether an error's text (its type name and message) reads as a failed collective or
  coordination-service call, which can mean another process is gone: gloo's over TCP on CPU
  ("UNKNOWN: Gloo AllGather failed: [.../tcp/pair.cc:547] Connection closed by peer
  [127.0.0.1]:3261", jax 0.10.2; under jax 0.12 such a collective blocks instead), NCCL's,
  and the coordination service's status codes (UNAVAILABLE: "... tasks are unhealthy
  (stopped sending heartbeats)", jax 0.10.2; DEADLINE_EXCEEDED: a barrier timed out, jax
  0.10.2 and 0.12)."""
  return bool(_PEER_FAILURE.search(text))


# XLA's status code for a program too big for the device's memory.
_OOM_STATUS = "RESOURCE_EXHAUSTED"
# "... required for HLO temporaries (18.35G) exceeds available HBM (15.75G)."
_OOM_NEED = re.compile(r"\(([\d.]+)([KMGT])\) exceeds")


def is_oom_error(text: str) -> bool:
  """Whether an error's text is XLA refusing a program too big for the device's memory:
  status RESOURCE_EXHAUSTED. A TPU compile (libtpu) says "RESOURCE_EXHAUSTED: Ran out of
  memory on HBM, the total memory required for HLO temporaries (18.35G) exceeds available
  HBM (15.75G)." with jax 0.10.2; jax 0.12's adds "E1000: CompileTimeHbmOom: " after the
  status and " HLO module: <name>." plus a link after the sentence."""
  return _OOM_STATUS in text


def oom_bytes(text: str) -> float:
  """Bytes XLA said the program needs in an out-of-memory error (`is_oom_error`: the
  "(18.35G) exceeds" figure, binary units), or inf where the text gives none."""
  m = _OOM_NEED.search(text)
  return float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024 if m else math.inf


# ------------------------------------- splash attention's block kernels (pallas.ops.tpu)

def _splash_module():
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as splash)
  return splash


def _splash_masks(kernel):
  """The kernel's (fwd, dq, dkv) mask infos, each partial-mask-block stack collapsed to one
  leading dim as the kernel's own entry point does, and its static keyword arguments."""
  try:
    infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
    kwargs = dict(kernel.kwargs)
  except AttributeError:
    raise _changed("splash_block_forward", "SplashAttentionKernel has no mask infos") from None

  def collapse(info):
    if info is None or info.partial_mask_blocks is None:
      return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))
  return tuple(collapse(i) for i in infos), kwargs


def splash_block_forward(kernel, q, k, v, segment_ids):
  """One splash kernel call that also returns its logsumexp: (out [heads, q_seq, head_dim]
  in q's dtype, logsumexp float32 [heads, q_seq], natural log of the scaled logits), for one
  example (`jax.vmap` it). `kernel`: from `make_splash_mha`/`make_splash_mqa`; q already
  scaled. The public kernel returns the logsumexp only with `save_residuals=True`, which it
  can't differentiate; a ring of blocks needs it to merge blocks and its own backward pass
  (`splash_block_backward`). Private: `splash_attention_kernel._splash_attention_forward`.
  """
  splash = _splash_module()
  (fwd, _, _), kw = _splash_masks(kernel)
  try:
    out, (lse,) = splash._splash_attention_forward(  # pylint: disable=protected-access
        fwd, q, k, v, segment_ids, None, mask_value=kw["mask_value"], is_mqa=kw["is_mqa"],
        block_sizes=kw["block_sizes"], residual_checkpoint_name=None, save_residuals=True,
        mask_function=kw["mask_function"], attn_logits_soft_cap=kw["attn_logits_soft_cap"],
        interpret=kw["interpret"])
  except (AttributeError, TypeError, KeyError) as e:
    raise _changed("splash_block_forward", f"_splash_attention_forward changed ({e})") from None
  return out, lse


def splash_block_backward(kernel, q, k, v, segment_ids, out, lse, d_out):
  """The gradients (dq, dk, dv) of one splash block given the whole attention's `out` and
  `lse` (of every block merged), for one example: with those, a block's share of the flash
  backward pass is exact (Dao et al. 2022, arXiv:2205.14135, algorithm 4), so a ring sums
  its blocks' shares. dq is for the scaled q. Private:
  `splash_attention_kernel._splash_attention_bwd`."""
  splash = _splash_module()
  (_, dq_info, dkv_info), kw = _splash_masks(kernel)
  res = (q, k, v, segment_ids, None, out, lse, dq_info, dkv_info)
  try:
    grads = splash._splash_attention_bwd(  # pylint: disable=protected-access
        False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
        kw["attn_logits_soft_cap"], kw["interpret"], res, d_out)
  except (AttributeError, TypeError, KeyError, ValueError) as e:
    raise _changed("splash_block_backward", f"_splash_attention_bwd changed ({e})") from None
  return grads[3], grads[4], grads[5]
