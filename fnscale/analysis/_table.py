"""The planner's answer, `Plan`, and how it reads: as a table (`format_plan`, `str(plan)`), as
plain data for JSON (`plan_summary`), and the error of a model that fits nowhere
(`no_fit_error`).
"""
from __future__ import annotations

from typing import NamedTuple

from fnscale import _deprecation
from fnscale.analysis import _cost
from fnscale.analysis import _forecast
from fnscale.analysis import _targets
from fnscale.analysis._search import HEADROOM, Candidate, mesh_str
from fnscale._errors import PlanError
from fnscale._mesh import MeshAxes


class Plan(NamedTuple):
  """The planner's answer: `rows` ranked best first (fitting rows by step time, then those
  that don't fit); the chosen `axes` (a `MeshAxes` for `fnscale.make_mesh`), `remat`,
  `accum_steps` and `accum_gather` (for `fnscale.train_step`); `why` the winner won; `hardware`
  the resolved target; `profile` what the model needs per step; `verification` what was
  compiled, or why nothing was; `tokens` the token budget the table's days and chip-hours
  are for (None: not shown); `microbatches` the pipeline's (with a "stage" axis in `axes`);
  `headroom` the share of the memory limit an estimate may fill; `unrolled` whether the
  forecast took an unrolled layer loop's terms. `str(plan)` is the table (`format_plan`).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> opts = fs.analysis.PlanOptions(verify=0)
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts)
    >>> p.axes == p.rows[0].axes, p.remat, p.accum_steps, p.accum_gather, p.verification
    (True, False, 1, 'auto', 'not verified: verify=0')
    >>> p.hardware.num_devices, p.profile.rows
    (4, 64)
  """
  rows: tuple[Candidate, ...]
  axes: MeshAxes
  remat: bool
  accum_steps: int
  why: str
  hardware: _targets.Hardware
  profile: _cost.Profile
  verification: str = ""
  tokens: float | None = None
  accum_gather: str = "auto"
  microbatches: int = 1
  headroom: float = HEADROOM
  unrolled: bool = False

  accum = _deprecation.renamed_field("Plan", "accum", "accum_steps")

  def __str__(self) -> str:
    return format_plan(self)


def _count(n: float) -> str:
  """A count in 3 significant digits and the unit that keeps it above 1: 834k, 1.24B."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:.0f}"


def _hardware_line(p: Plan) -> str:
  hw, prof = p.hardware, p.profile
  gib = lambda b: f"{b / 2**30:.1f}"
  batch = (f"{_count(prof.params)} params, batch {prof.rows} rows of {prof.tokens_row} "
           "tokens")
  if prof.experts:
    batch += (f"; a mixture of {prof.experts} experts, {prof.expert_k} per token "
              f"({_count(prof.expert_params)} expert params)")
  if hw.kind == "cpu":
    n = hw.num_devices
    return (f"plan for {hw.name}: {n} simulated devices sharing this host (measured for the "
            f"host: {hw.peak_flops * n / 1e9:.1f} GFLOP/s matmul, {hw.links.hbm * n / 1e9:.2f} "
            f"GB/s memory copy; 1/{n} each; memory not limited); {batch}")
  return (f"plan for {hw.name}: {hw.num_devices} devices ({hw.num_slices} slice(s)), "
          f"{gib(hw.hbm_bytes)} GiB HBM and {hw.peak_flops / 1e12:.0f} TFLOP/s per device; "
          f"{batch}")


def _budget(p: Plan, r: Candidate) -> tuple[str, str]:
  """(days, chip-hours) to train on `p.tokens` at the row's forecast tokens/s."""
  if not p.tokens or not r.tokens_s > 0:
    return "-", "-"
  seconds = p.tokens / r.tokens_s
  return f"{seconds / 86400:,.1f}", f"{seconds / 3600 * p.hardware.chips:,.0f}"


def format_plan(p: Plan, top: int = 12) -> str:
  """The plan as a table: mesh, remat, accumulation, GiB/device (estimate; compiled) vs HBM,
  the forecast (step time, tokens/s, MFU) beside the roofline's MFU bound, communication /
  compute, days and chip-hours for `p.tokens` (when given), verified (and flags); then what
  was compiled, kernels whose FLOPs are not counted, the memory an estimate may fill (the
  device's limit, where it comes from, and the headroom kept), and why the winner won.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> opts = fs.analysis.PlanOptions(verify=0)
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts)
    >>> lines = fs.analysis.format_plan(p, top=2).splitlines()
    >>> lines[1].split()[:5], lines[-1].startswith("chosen: " + fs.analysis.mesh_str(p.axes))
    (['#', 'mesh', 'remat', 'accum', 'pipeline'], True)
  """
  budget = ("days", "chip-h") if p.tokens else ()
  cols = ("#", "mesh", "remat", "accum", "pipeline", "GiB/dev est", "compiled", "fits",
          "step ms",
          "tokens/s", "MFU", "bound", "comm/comp", *budget, "verified")
  lines = []
  for i, r in enumerate(p.rows[:top]):
    c = r.compiled
    steps = (f"{r.accum_steps} once" if r.accum_gather == "once" and r.accum_steps > 1
             else str(r.accum_steps))
    pipe = f"M={r.microbatches} bubble {r.bubble:.2f}" if r.stages > 1 else "-"
    mesh = mesh_str(r.axes) + (f" ({r.context})" if r.context_why else "")
    lines.append((str(i + 1), mesh, "on" if r.remat else "off", steps, pipe,
                  f"{r.estimate.bytes / 2**30:.1f}", f"{c.bytes / 2**30:.1f}" if c else "-",
                  "yes" if r.fits else "NO", f"{r.step_s * 1e3:.4g}", f"{r.tokens_s:,.0f}",
                  f"{r.mfu:.0%}", f"{r.bound_mfu:.0%}",
                  f"{(c.comm_s / r.estimate.compute_s if c else r.estimate.comm_ratio):.2f}",
                  *(_budget(p, r) if p.tokens else ()),
                  (f"yes {c.seconds:.0f}s" + (" FLAG:" + ",".join(c.flags) if c.flags else ""))
                  if c else "no"))
  widths = [max(len(x) for x in col) for col in zip(cols, *lines)]
  fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths))
  more = f"\n... {len(p.rows) - top} more" if len(p.rows) > top else ""
  notes = [f"for {p.tokens:.3g} tokens: days and chip-hours at the forecast tokens/s"
           if p.tokens else "", p.verification]
  if p.hardware.kind != "cpu":
    notes.append(f"memory: estimates held to {_usable(p.hardware, p.headroom)}")
  if p.profile.uncounted:
    notes.append("FLOPs not counted (Pallas kernels without a cost_estimate): "
                 + ", ".join(p.profile.uncounted))
  return "\n".join([_hardware_line(p), fmt(cols), *map(fmt, lines)]) + more + "".join(
      f"\n{n}" for n in notes if n) + (
          f"\nchosen: {mesh_str(p.axes)}, remat={p.remat}, accum={p.accum_steps}"
          + (f", accum_gather={p.accum_gather}" if p.accum_steps > 1 else "")
          + (f", context={p.rows[0].context}" if p.rows[0].context_why else "")
          + (f", microbatches={p.microbatches} (bubble {p.rows[0].bubble:.2f})"
             if p.rows[0].stages > 1 else "") + f": {p.why}")


def _dot_flops_row(prof: _cost.Profile, remat: bool) -> float:
  """Matmul FLOPs per row an HLO reader sees as dots: the model's, less the attention a
  kernel (a custom call) computes."""
  attn = (prof.attn_row_remat if remat else prof.attn_row) if prof.attn_kernel else 0.0
  return (prof.flops_row_remat if remat else prof.flops_row) - attn


def plan_summary(p: Plan) -> dict:
  """The plan as plain data (for JSON): target facts, the chosen row and every row's
  estimate beside its compile (bytes, memory ratio compiled / estimated, step, comm; HLO
  matmul FLOPs over the traced step's dots with this row's remat, and without remat; attention
  in a kernel is not a dot) and its forecast (step, tokens/s, MFU; days and chip-hours for
  `p.tokens`).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> init = lambda key: {"w": jax.random.normal(key, (256, 256))}
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in "xy"}
    >>> opts = fs.analysis.PlanOptions(verify=0)
    >>> p = fs.analysis.plan(init, loss, optax.adam(1e-3), batch, "v5p-8", opts)
    >>> s = fs.analysis.plan_summary(p)
    >>> s["target"], s["devices"], s["chosen"] == fs.analysis.mesh_str(p.axes), len(s["rows"])
    ('v5p-8', 4, True, 6)
  """
  rows, prof, n = [], p.profile, p.hardware.num_devices
  for r in p.rows:
    c, e, f = r.compiled, r.estimate, r.forecast
    program = _dot_flops_row(prof, r.remat) * prof.rows / n
    plain = _dot_flops_row(prof, False) * prof.rows / n
    rows.append(dict(
        mesh=mesh_str(r.axes), remat=r.remat, accum_steps=r.accum_steps,
        accum_gather=r.accum_gather, context=r.context if r.context_why else None,
        microbatches=r.microbatches, bubble=r.bubble, fits=r.fits,
        est_bytes=e.bytes, est_step_s=e.step_s, est_mfu=e.mfu, est_comm_s=e.comm_total_s,
        compute_s=e.compute_s, compiled_bytes=c.bytes if c else None,
        memory_ratio=c.bytes / e.bytes if c else None, compiled_comm_s=c.comm_s if c else None,
        compiled_step_s=c.step_s if c else None, compiled_mfu=c.mfu if c else None,
        hlo_matmul_flops=c.matmul_flops if c else None, compile_s=c.seconds if c else None,
        flags=list(c.flags) if c else None,
        hlo_over_traced_no_remat=c.matmul_flops / plain if c else None,
        hlo_over_program=c.matmul_flops / program if c else None,
        forecast_step_s=f.step_s if f else None, forecast_tokens_s=f.tokens_s if f else None,
        forecast_mfu=f.mfu if f else None, bound_mfu=r.bound_mfu,
        days=p.tokens / f.tokens_s / 86400 if p.tokens and f else None,
        chip_hours=p.tokens / f.tokens_s / 3600 * p.hardware.chips if p.tokens and f else None))
  hw = p.hardware
  return dict(target=hw.name, devices=hw.num_devices, chips=hw.chips, hbm_bytes=hw.hbm_bytes,
              memory_limit=hw.memory_limit, limit_source=hw.limit_source, headroom=p.headroom,
              peak_flops=hw.peak_flops, chosen=mesh_str(p.axes), remat=p.remat,
              accum_steps=p.accum_steps, accum_gather=p.accum_gather, microbatches=p.microbatches,
              why=p.why, verification=p.verification, tokens=p.tokens,
              uncounted_kernels=list(prof.uncounted),
              forecast_terms=_forecast.terms_for(hw, p.unrolled)._asdict(),
              model_flops_per_device=prof.flops_row * prof.rows / hw.num_devices, rows=rows)


def no_fit_error(rows, hw, headroom) -> PlanError:
  low = min(rows, key=lambda r: r.estimate.bytes)
  return PlanError(
      f"the model fits nowhere on {hw.name}: the smallest candidate ({mesh_str(low.axes)}, "
      f"remat={low.remat}, accum={low.accum_steps}) needs {_gib(low.estimate.bytes)} per "
      "device, "
      f"and the target has {_usable(hw, headroom)}, of which the params take "
      f"{_gib(low.estimate.params)} and the optimizer's state {_gib(low.estimate.opt)}; fix: a "
      "target with more devices or slices, an optimizer with less state (e.g. a bfloat16 "
      "first moment, or Adafactor's factored second moment), a smaller global batch, or a "
      "smaller model.")


def _gib(b: float) -> str:
  return f"{b / 2**30:.2f} GiB"


def _usable(hw, headroom: float) -> str:
  """What an estimate may fill per device, and why: "14.96 GiB usable per device (95% of the
  15.75 GiB a program may hold of 16.00 GiB HBM: bytes_limit measured on a v5e chip; ...)"."""
  return (f"{_gib(hw.memory_limit * headroom)} usable per device ({headroom:.0%} of the "
          f"{_gib(hw.memory_limit)} a program may hold of {_gib(hw.hbm_bytes)} HBM: "
          f"{hw.limit_source or 'the HBM'}; the rest is the estimate's error margin)")
