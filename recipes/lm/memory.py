"""train_lm's memory pre-flight: the run fits its devices' memory before the first step, or
says how it would.

Before anything is built (`choose`, the one place the run's rows per device, accumulation
steps and mode, remat and optimizer are decided, as a `Choice` the options then hold): the
planner estimates the step's bytes per device (`fnscale.analysis.plan`); where the default
configuration's estimate exceeds the device's memory, the remat, accumulation steps and rows
per device the user left to their defaults (no `--remat`/`--noremat`, `--accum_steps`,
`--batch_size` or `--global_batch`) become the fastest the planner estimates within
`HEADROOM` of it, and the run says what it chose. Where none of those fit with AdamW's
float32 state and the user left the optimizer to its default (no `--optimizer` or
`--mu_dtype`), the state shrinks as the step's math changes least: AdamW's first moment in
bfloat16, then the state in the host's memory (float32, then with the bfloat16 first moment:
the same math, host transfers each step; left to the user with `--optimizer_offload` or
`--nooptimizer_offload`), then Adafactor (`OPTIMIZERS`), said the same way. A run that
nothing on its mesh can fit (a model whose state alone outgrows the chip, or a batch the
user fixed that even remat and accumulation can't hold) stops with an `error:` naming the
fix. Remat's policy is the forecast's (`remat.whole_block`). After compiling (`compile_step`):
XLA's peak bytes per device against the memory (`fnscale.analysis.compile_fitting`), never a
raw RESOURCE_EXHAUSTED; a step that doesn't fit is refused with the options that would, as
flags. On CPU (no memory limit) nothing is checked.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import numpy as np

import fnscale as fs
from fnscale import FitError
from recipes.lm import optimizers, remat, startup
from recipes.lm.options import StepOptions
from recipes.lm.remat import WHOLE_BLOCK, remat_policy

# Options are chosen by estimates within this share of the device's memory: the estimate
# tracks XLA's peak within about 5% at GPT small to Llama-8B sizes (recipes/bench/memory.py).
HEADROOM = 0.9
GiB = 2**30
# The optimizers the pre-flight tries in turn, (--optimizer, --mu_dtype, --optimizer_offload):
# the default first, then by their state on the device per param: 2 floats, 1.5 floats'
# bytes, a few params' state (the rest in the host's memory), about 0 (factored).
OPTIMIZERS = (("adamw", "float32", False), ("adamw", "bfloat16", False),
              ("adamw", "float32", True), ("adamw", "bfloat16", True), ("adafactor", None, False))
# With the state in the host's memory (`fs.init_state(..., offload_optimizer=True)`), the
# update brings AdamW's state to the device a slice of each param's leading axis at a time,
# slices of up to 64 MiB: one in, one out and the next one coming (IN_FLIGHT).
SLICE_BYTES, IN_FLIGHT = 64 * 2**20, 3
# What an offloaded state costs in speed, said when the pre-flight chooses it: measured on one
# TPU v5e (recipes/bench/chip_v5e.json, 2026-12-07), the 1B shape's step with AdamW's state
# offloaded ran 5.4k tokens/s (8 rows), Adafactor's on the device 12.3k (2 rows).
OFFLOAD_COST = ("the state's trips to the host bound the step: on one v5e the 1B's ran at "
                "0.44x Adafactor's tokens/s (--optimizer=adafactor)")


def limit(mesh) -> float | None:
  """Bytes a step may use on each of `mesh`'s devices (`fnscale.analysis.device_memory`;
  None on CPU)."""
  return fs.analysis.device_memory(mesh.devices.flat[0])


def remat_loss(model, cfg, keep: str):
  """The model's loss with the `remat` the planner toggles: off is the run's policy `keep`
  (`recipes/lm/remat.py`; a model without policies: off unless "full"), on is "full"; a
  policy's name is passed on (`PlanOptions.remat_off`)."""
  named = hasattr(model, "REMAT_POLICIES")

  def loss(params, batch, *, remat=False):
    policy = remat if isinstance(remat, str) else "full" if remat else keep
    return model.loss_fn(params, batch, cfg=cfg,
                         remat=policy if named else policy in WHOLE_BLOCK)
  return loss


class Model(NamedTuple):
  """The run's model as the planner sees it: its module (`recipes.lm.gpt`, `llama`, `moe`),
  config, name (for messages) and LoRA config (None: every param trained)."""
  module: object
  cfg: object
  name: str = ""
  lora: object = None


def profile(m: Model, target, rows: int, policy, keep: str = "none",
            opt: tuple = OPTIMIZERS[0], **kw):
  """The planner's profile of the run's step (`fnscale.analysis.profile_model`: its
  traced FLOPs, residuals, params and optimizer state) for `rows` global rows on `target`,
  with the jmp `policy` (or None), the blocks keeping what the remat policy `keep` keeps
  without remat (`remat_loss`), the optimizer `opt` (--optimizer, --mu_dtype,
  --optimizer_offload) and `m.lora`'s state; with the state offloaded the state counted is
  what the device holds of it (`IN_FLIGHT`). `kw`: profile_model's."""
  prof = _per_row(m, target, policy, keep, opt[:2], tuple(kw.items()))._replace(rows=rows)
  return _on_device(m, prof) if opt[2:3] == (True,) else prof


def _on_device(m: Model, prof):
  """`prof` with the optimizer state the device holds when it lives in the host's memory:
  `IN_FLIGHT` slices of it (a LoRA's state is counted whole: small)."""
  if m.lora is not None:
    return prof
  return prof._replace(opt_bytes=min(prof.opt_bytes, IN_FLIGHT * SLICE_BYTES))


@functools.lru_cache(maxsize=16)  # per row: the same for every batch (tracing takes seconds)
def _per_row(m: Model, target, policy, keep: str, opt: tuple, kw: tuple):
  model, cfg, lora = m.module, m.cfg, m.lora
  shape = jax.ShapeDtypeStruct((1, cfg.seq), np.int32)
  optimizer = optimizers.transformation(opt[0], 1e-3, mu_dtype=opt[1] or "float32")
  init = (functools.partial(model.init_params, cfg) if lora is None
          else startup.lora_state(model, cfg, policy, lora, optimizer))
  # A LoRA loss keeps what the run's policy keeps, as the full model's does: a policy saving
  # part of each block as `remat_off` (its carries and traffic: fnscale.analysis's cost).
  off = remat.remat_off(model, keep)
  loss = remat_loss(model, cfg, "none" if off else keep)
  loss = loss if lora is None else fs.lora.with_lora(loss, lora)
  return fs.analysis.profile_model(init, loss, optimizer, {"inputs": shape, "targets": shape},
                                   target, policy=policy, remat_off=off, **dict(kw))


def flags(o: fs.analysis.FitOption, opt: tuple = OPTIMIZERS[0]) -> str:
  """The train_lm flags of an option (and of optimizer `opt` unless it is the default),
  with the planner's estimate."""
  return (f"--batch_size={o.rows} --accum_steps={o.accum_steps} "
          f"{'--remat' if o.remat else '--noremat'}{optimizer_flags(opt)} "
          f"({o.bytes / GiB:.2f} GiB)")


def optimizer_flags(opt: tuple) -> str:
  """' --optimizer=adafactor', ' --mu_dtype=bfloat16', then ' --optimizer_offload' where
  the state is offloaded; '' for the default, for `opt`."""
  name = (f" --optimizer={opt[0]}" if opt[0] != "adamw" else
          f" --mu_dtype={opt[1]}" if opt[1] != "float32" else "")
  return name + (" --optimizer_offload" if opt[2:3] == (True,) else "")


def asked_optimizers(step: StepOptions) -> tuple:
  """The optimizers the pre-flight may run for the step's options: `OPTIMIZERS` (those
  placed as --optimizer_offload says where given), or the one the user named (--optimizer
  and/or --mu_dtype), on the device unless --optimizer_offload."""
  if step.optimizer is None and step.mu_dtype is None:
    return tuple(o for o in OPTIMIZERS
                 if step.optimizer_offload is None or o[2] == step.optimizer_offload)
  name = step.optimizer or "adamw"
  return ((name, (step.mu_dtype or "float32") if name == "adamw" else None,
           bool(step.optimizer_offload)),)


def _mesh_axes(mesh) -> fs.MeshAxes:
  return fs.MeshAxes(dict(mesh.shape), {})


class Planned(NamedTuple):
  """--mesh=auto's row (`startup.plan_mesh`) for the global batch it was planned for."""
  global_batch: int
  remat: bool
  accum_steps: int
  accum_gather: str
  context: str | None = None  # the attention form over the planned context axis


class Choice(NamedTuple):
  """How each step of the run runs, decided once (`choose`) and only read after: each field
  is the `Options.step` field of its name, filled in."""
  batch_size: int  # rows per device per step
  global_batch: int
  accum_steps: int
  accum_gather: str
  remat: bool
  remat_policy: str  # what each block keeps, --remat_policy's auto resolved
  optimizer: str
  mu_dtype: str | None
  context: str  # the attention form over a context axis
  optimizer_offload: bool = False  # the optimizer state in the host's memory between steps


def choose(step: StepOptions, precision: str, m: Model, topo, mesh, per_device: int, say,
           planned: Planned | None = None) -> Choice:
  """The run's rows per device, accumulation (steps, gather mode), remat (and its policy:
  `remat.whole_block`'s where auto) and optimizer, from the step's options (`precision`:
  --precision), --mesh=auto's `planned` row and the memory pre-flight: what the user gave
  (the planned row's remat where they gave none, its accumulation where it has more steps),
  else the defaults (`per_device` rows; remat off, 1 step, AdamW in float32), or where their
  estimate exceeds the device's memory, the planner's fastest option within `HEADROOM` of it
  among the choices left open, the optimizers tried in `OPTIMIZERS`' order, said in a line.
  What the user fixed is left to the compiled check (`compile_step`).

  Raises:
    InputError: --remat with a --remat_policy other than full.
    FitError: nothing the user left open fits by the estimate (with every choice fixed:
      nothing on this mesh fits at all, the state alone being too big); the message gives
      the estimate, the memory and the fix (other optimizers' flags among them).
  """
  step = _asked(step, planned)
  if step.remat and step.remat_policy not in ("auto",) + WHOLE_BLOCK:
    raise fs.InputError(f"--remat with --remat_policy={step.remat_policy}: --remat recomputes "
                        f"whole blocks ({' or '.join(WHOLE_BLOCK)}); give one of them")
  dp = math.prod(mesh.shape[a] for a in fs.data_axes(mesh))
  if step.global_batch is not None:
    per_device = max(1, step.global_batch // dp)
  policy = startup.policy(precision, topo.platform)
  step, rows = _preflight(step, policy, m, topo, mesh, per_device, say)
  chosen = remat_policy(step, topo.platform)
  if chosen == "full" and step.remat_policy == "auto":
    rate = lambda: _full_remat_rate(step, policy, m, topo, mesh, rows)
    chosen = remat.whole_block(m.module, m.cfg, topo, mesh.size, policy, say, rate)
  return Choice(rows, rows * dp if step.global_batch is None else step.global_batch,
                step.accum_steps, step.accum_gather, step.remat, chosen, step.optimizer,
                step.mu_dtype, step.context, bool(step.optimizer_offload))


def _full_remat_rate(step: StepOptions, policy, m: Model, topo, mesh, rows: int):
  """(the forecast's tokens/s under full remat, global rows); None without its figures."""
  axes = _mesh_axes(mesh)
  base = remat_policy(dataclasses.replace(step, remat=False), topo.platform)
  global_rows = rows * fs.analysis.data_parallel(axes)
  try:  # the pre-flight's profile (cached)
    prof = profile(m, topo, global_rows, policy, base, asked_optimizers(step)[0])
    return fs.analysis.fit_options(prof, topo, axes, float("inf"), remat=True, rows=rows,
                                   accum_steps=step.accum_steps or 1,
                                   accum_gather=step.accum_gather)[0].tokens_s, global_rows
  except (fs.TopologyError, fs.PlanError):
    return None


def _asked(step: StepOptions, planned: Planned | None) -> StepOptions:
  """The step's options as the pre-flight takes them: with --mesh=auto, the planned global batch,
  remat where the user gave none, accumulation (steps and mode) where the planned row has
  more steps than the user's, and the planned context axis's attention form where --context
  was left at its default."""
  if planned is None:
    return step
  if planned.accum_steps > (step.accum_steps or 1):
    step = dataclasses.replace(step, accum_steps=planned.accum_steps,
                               accum_gather=planned.accum_gather)
  if planned.context and step.context == StepOptions.context:  # a --context given is kept
    step = dataclasses.replace(step, context=planned.context)
  return dataclasses.replace(step, remat=bool(step.remat or planned.remat),
                             global_batch=planned.global_batch)


def _preflight(step: StepOptions, policy, m: Model, topo, mesh, per_device: int, say):
  """(the step's options, rows per device) with `remat`, `accum_steps`, `optimizer` and
  `mu_dtype` filled in (`choose`); `policy`: the run's jmp policy."""
  # Without remat the blocks keep what the run's policy keeps; remat is "full".
  base = remat_policy(dataclasses.replace(step, remat=False), topo.platform)
  fixed = dict(remat=step.remat if step.remat_policy == "auto"
               else step.remat_policy in WHOLE_BLOCK, accum_steps=step.accum_steps,
               rows=per_device if step.batch_size is not None
               or step.global_batch is not None else None)
  opts = asked_optimizers(step)
  filled = lambda remat, steps, rows, opt=opts[0]: (dataclasses.replace(
      step, remat=bool(remat), accum_steps=steps or 1, optimizer=opt[0], mu_dtype=opt[1],
      optimizer_offload=opt[2]),
      rows)
  cap = limit(mesh)
  if cap is None:
    return filled(step.remat, step.accum_steps, per_device)
  dp = fs.analysis.data_parallel(_mesh_axes(mesh))
  now = dict(remat=bool(fixed["remat"]), accum_steps=step.accum_steps or 1, rows=per_device)
  try:
    ask = lambda opt, room, **kw: fs.analysis.fit_options(
        profile(m, topo, per_device * dp, policy, base, opt), topo, _mesh_axes(mesh), room,
        accum_gather=step.accum_gather, **kw)
    need = ask(opts[0], float("inf"), **now)[0].bytes
  except (fs.TopologyError, fs.PlanError):  # no figures for this target: the compile judges
    return filled(step.remat, step.accum_steps, per_device)
  if need <= cap:
    return filled(step.remat, step.accum_steps, per_device)
  free = [k for k, v in fixed.items() if v is None]
  held = {k: v for k, v in fixed.items() if v is not None}
  for opt in opts:  # the default optimizer with what is free, then the smaller states
    chosen = ask(opt, HEADROOM * cap, **held)
    if chosen and (free or opt != opts[0]):
      say(f"memory: batch_size={per_device}, accum_steps={now['accum_steps']}, "
          f"remat={now['remat']}{optimizer_flags(opts[0]).replace(' --', ', ')} needs {need / GiB:.2f} GiB per "
          f"device by the planner's estimate, more than the device's {cap / GiB:.2f} GiB; "
          f"chose {flags(chosen[0], opt)}" + (f"; {OFFLOAD_COST}" if opt[2] else ""))
      return filled(chosen[0].remat, chosen[0].accum_steps, chosen[0].rows, opt)
  if not free and ask(opts[0], HEADROOM * cap):  # the user's choice: the compile judges
    return filled(step.remat, step.accum_steps, per_device)
  raise _no_fit(m, mesh, need, cap, held, opts, ask)


def _no_fit(m: Model, mesh, need: float, cap: float, held: dict, opts, ask) -> FitError:
  """The error of a run that fits no choice left free: what it needs against what the device
  has, what the user pinned, and as the fix what fits with the user's optimizer, else with a
  smaller state (`ask(opt, room)`: the planner's rows that fit `room` bytes)."""
  anything = next((a for a in ([(x, opt) for x in ask(opt, HEADROOM * cap)]
                               for opt in dict.fromkeys(opts[:1] + OPTIMIZERS)) if a), [])
  spell = dict(remat=lambda v: "--remat" if v else "--noremat",
               accum_steps=lambda v: f"--accum_steps={v}", rows=lambda v: f"--batch_size={v}")
  pinned = " ".join([spell[k](v) for k, v in held.items()] + (
      [f"--optimizer={opts[0][0]}" + (f" --mu_dtype={opts[0][1]}" if opts[0][1] else "")
       + (" --optimizer_offload" if opts[0][2] else "")] if len(opts) == 1 else []))
  return FitError(
      f"{m.name} on mesh {dict(mesh.shape)} needs {need / GiB:.2f} GiB per device by the "
      f"planner's estimate, and the device has {cap / GiB:.2f} GiB"
      + (f"; with {pinned.strip()} nothing fits, whatever the remat and accumulation"
         if pinned.strip() else "")
      + "; fix: " + ("; ".join(flags(x, opt) for x, opt in anything[:3]) if anything else
                     "a smaller model, or more devices to split it over (--mesh=fsdp=N): "
                     "nothing fits one device, even with --optimizer=adafactor"),
      needed=need, limit=cap, options=[x for x, _ in anything])


def compile_step(setup, step, state, batch):
  """`step.compile(state, batch)` held against the device's memory
  (`fnscale.analysis.compile_fitting`).

  Raises:
    FitError: XLA's peak exceeds the memory; the message names the bytes, the memory and
      the options on this mesh that would fit, as train_lm flags.
  """
  o, mesh, opt = setup.o, setup.mesh, asked_optimizers(setup.o.step)[0]
  try:
    return fs.analysis.compile_fitting(step, state, batch, limit=limit(mesh))
  except FitError as e:
    dp = fs.analysis.data_parallel(_mesh_axes(mesh))
    try:
      base = o.step.remat_policy if o.step.remat_policy not in WHOLE_BLOCK else remat_policy(
          dataclasses.replace(o.step, remat=False, remat_policy="auto"),  # the default's
          setup.topo.platform)
      prof = profile(Model(setup.model, setup.cfg, o.model.model_config, setup.lora),
                     setup.topo, o.step.batch_size * dp,
                     startup.policy(o.model.precision, setup.topo.platform), base, opt)
      options = fs.analysis.fit_options(prof, setup.topo, _mesh_axes(mesh),
                                        HEADROOM * (e.limit or e.needed),
                                        accum_gather=o.step.accum_gather)
    except (fs.TopologyError, fs.PlanError):
      options = ()
    fix = ("; ".join(flags(x, opt) for x in options[:3])
           or "a smaller model or batch, or more devices")
    raise FitError(f"the step (batch_size={o.step.batch_size}, "
                   f"accum_steps={o.step.accum_steps}, remat={o.step.remat}) needs "
                   f"{e.needed / GiB:.2f} GiB per device (XLA's peak) "
                   + (f"and the device has {e.limit / GiB:.2f} GiB" if e.limit else
                      "and XLA refused it as too big for the device") + f"; fix: {fix}",
                   needed=e.needed,
                   limit=e.limit, options=options) from None
