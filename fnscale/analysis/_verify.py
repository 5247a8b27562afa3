"""The planner's verification: the best candidates compiled ahead of time for the target's
described devices (TPU targets, through libtpu, from any machine). XLA's per-device memory
must fit the device's memory limit, its collectives are set beside the estimate, a
disagreement over `DISAGREE` is flagged, and the ranking uses the compiled figures where it
has them. A plan that could not compile says why (`verification`, `cannot_verify`); asking
for compiles where none can be made is a `PlanError`.
"""
from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp

from fnscale import _compat
from fnscale import _compile
from fnscale import _state
from fnscale import _step
from fnscale.analysis import _cost
from fnscale.analysis import _fit
from fnscale.analysis import _forecast
from fnscale.analysis import hlo as _hlo
from fnscale.analysis._model import Frozen, resolve
from fnscale.analysis._search import Candidate, CompileCheck, rank_key
from fnscale._errors import PlanError
from fnscale.kernels._attention import with_kernel
from fnscale._mesh import MeshAxes, make_mesh

DISAGREE = 0.25  # relative disagreement between estimate and compile that gets flagged


def _abstract_state(params, optimizer, mesh, rules, logical_axes, policy):
  """The abstract TrainState `compile_candidate` compiles: born in its shardings by `rules` and
  `logical_axes`; for a `Frozen` tree, the frozen params so (the axes are theirs) and the
  trained params by automatic FSDP, with the optimizer state theirs alone."""
  zeros = lambda t: (lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t))
  if not isinstance(params, Frozen):
    return _state.init_state(zeros(params), optimizer, mesh=mesh, rules=rules,
                             logical_axes=logical_axes, policy=policy, abstract=True)
  frozen = _state.init_state(zeros(params.frozen), optimizer, mesh=mesh, rules=rules,
                             logical_axes=logical_axes, abstract=True).params
  state = _state.init_state(zeros(params.params), optimizer, mesh=mesh, policy=policy,
                            abstract=True)
  return state._replace(frozen=frozen)


def _compiled_comm(summary, hw, axes: MeshAxes) -> dict:
  """Seconds of the compiled collectives by mesh axis: each replica group's ring bytes over
  the bandwidth of the mesh axis of that size, the bytes sent across slices
  (`summary.dcn_groups`) on the DCN axes and the rest on the ICI axes; collective-permutes
  go to the "stage" axis there (a pipeline's sends), else (XLA's windowed einsums) to the
  slowest axis, as do groups no single axis matches."""
  ici = {k: v for k, v in axes.ici.items() if v > 1}
  bw = _cost.axis_bandwidth(hw, ici, axes.dcn)
  across = {(kind, n): b for kind, n, b in summary.dcn_groups}
  out = {}
  for kind, n, sent in summary.groups:
    for sizes, part in ((axes.dcn, across.get((kind, n), 0.0)),
                        (ici, sent - across.get((kind, n), 0.0))):
      if not part:
        continue
      slowest = min(sizes, key=bw.get, default=None)
      axis = next((a for a, k in sizes.items() if k == n), None)
      if kind == "collective-permute":  # a pipeline's stage sends, else windowed einsums
        axis = "stage" if "stage" in sizes else slowest
      elif axis is None:
        axis = slowest
      rate = bw[axis] if axis else min(bw.values(), default=hw.links.ici_link)
      out[axis or "ici"] = out.get(axis or "ici", 0.0) + part / rate
  return out


def compile_candidate(cand: Candidate, hw, ctx) -> Candidate:
  """Compiles the candidate for the target's described devices; returns it with `compiled`
  and the forecast redone with the compiled communication. The program is the one the cost
  model costs: the same loss (remat as the row; off: `PlanOptions.remat_off`), policy, accumulation steps and mode
  (`cand.accum_gather`), and the kernels `fnscale.attention` chooses on the
  target's devices (the profile was traced on one)."""
  params, loss_fn, optimizer, batch, policy, rules, logical_axes, prof, terms = ctx
  mesh = make_mesh(cand.axes, devices=hw.devices)
  state = _abstract_state(params, optimizer, mesh, rules, logical_axes, policy)
  loss = (functools.partial(loss_fn, remat=cand.remat or prof.remat_off) if prof.has_remat
          else loss_fn)
  if cand.stages > 1:
    loss = functools.partial(loss, microbatches=cand.microbatches)
  step = _step.train_step(loss, optimizer, policy=policy, accum_steps=cand.accum_steps,
                          accum_gather=cand.accum_gather)
  if "context" in cand.axes.ici or "context" in cand.axes.dcn:  # the form it was costed with
    step = with_kernel(step, context=cand.context)
  t0 = time.perf_counter()
  try:
    compiled = _compile.shard_step(step, mesh, rules=rules, logical_axes=logical_axes).compile(
        state, batch)
  except jax.errors.JaxRuntimeError as e:  # XLA refuses a program that overflows HBM
    if not _compat.is_oom_error(str(e)):
      raise
    need = _compat.oom_bytes(str(e))
    c = CompileCheck(need, 0.0, 0.0, math.inf, 0.0, time.perf_counter() - t0, ("memory",))
    return cand._replace(compiled=c, fits=False)
  seconds = time.perf_counter() - t0
  summary = _hlo.summarize(compiled.compiled.as_text() or "")
  est = cand.estimate
  by_axis = _compiled_comm(summary, hw, cand.axes)
  comm = sum(by_axis.values())
  compute = max(est.compute_s, summary.matmul_flops / hw.peak_flops)
  step_s = max(compute, comm) if hw.overlap else compute + comm
  nbytes = _fit.step_bytes(compiled)
  flags = tuple(name for name, got, want in (("memory", nbytes, est.bytes),
                                             ("comm", comm, est.comm_total_s))
                if want and abs(got / want - 1) > DISAGREE)
  mfu = prof.flops_row * prof.rows / (step_s * hw.num_devices * hw.peak_flops)
  c = CompileCheck(nbytes, summary.matmul_flops, comm, step_s, mfu, seconds, flags)
  fc = _forecast.forecast(prof, hw, est._replace(compute_s=compute), cand.axes.dcn, by_axis,
                          terms)
  # XLA's peak is the step's footprint, not an estimate of it: held to the allocator's limit,
  # not to the headroom kept for the estimate's error.
  return cand._replace(compiled=c, fits=nbytes <= hw.memory_limit, forecast=fc)


def verify_best(rows: list, hw, ctx, verify: int) -> None:
  """Compiles, best first, until the top `verify` rows that fit are all compiled, then leaves
  `rows` ranked. At most verify + 2 compiles: a candidate XLA finds too big for HBM, or whose
  compiled figures rank it lower, makes room for the next."""
  for _ in range(verify + 2):
    rows.sort(key=rank_key)
    todo = next((i for i, r in enumerate(rows[:verify]) if r.fits and r.compiled is None), None)
    if todo is None:
      break
    rows[todo] = compile_candidate(rows[todo], hw, ctx)
  rows.sort(key=rank_key)


def verification(hw, verify: int | None) -> tuple[int, str]:
  """(candidates to compile, why none are) for `verify` on `hw`.

  Raises:
    PlanError: `verify` > 0 where no program can be compiled for the target (no described
      TPU devices: libtpu's reason; a GPU or CPU target).
  """
  if verify == 0:
    return 0, "not verified: verify=0"
  if hw.kind == "tpu" and hw.devices is not None:
    return (3 if verify is None else verify), ""
  why = hw.no_devices or ("a CPU target is not compiled ahead of time: time its candidates "
                          "instead (recipes/plan.py --measure)")
  if verify:
    raise PlanError(
        f"verify={verify} asks for ahead-of-time compiles for {hw.name}, but {why.rstrip('.')}. "
        "Fix: "
        + ("install libtpu (pip install 'fnscale[tpu]') and check the target name, or "
           if hw.kind == "tpu" else "") + "pass PlanOptions(verify=0) to plan without compiling.")
  return 0, f"not verified: {why}"


def cannot_verify(target, cpu_rates: tuple[float, float] | None = None) -> str:
  """Why `plan(..., PlanOptions(verify=N))` could not compile candidates for `target` ("" if it can):
  libtpu's error for a TPU target it can't describe, or that the target is a GPU or CPU.
  `cpu_rates` as for `plan` (measured when None and the target is "cpu").

  Examples:
    >>> import fnscale as fs
    >>> fs.analysis.cannot_verify("8x h200")
    'jax describes no GPU devices for ahead-of-time compiles (only TPUs, through libtpu)'
  """
  hw = resolve(target, cpu_rates)
  try:
    verification(hw, 1)
  except PlanError:
    return verification(hw, None)[1].removeprefix("not verified: ")
  return ""
