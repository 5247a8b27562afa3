"""What XLA made of a step, and how a pytree is sharded, as values and readable text.

- `compile_report` reads compile time, FLOPs, per-device bytes and the collectives from the
  compiled executable itself (collectives and matmul FLOPs from its optimized HLO with
  while-loop trip counts applied, `fnscale.analysis.hlo`), plus the warnings XLA's SPMD partitioner
  printed while compiling it (e.g. "[SPMD] Involuntary full rematerialization").
- `sharding_report`: a table of every leaf's spec and bytes.
- `fast_compile_options`, `compilation_cache`: XLA / jax compile settings (defined in
  `fnscale._compiler`, which compiles every program fnscale compiles).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import math
from typing import NamedTuple

from absl import logging
import jax

from fnscale import _tree
from fnscale import _compile
from fnscale.analysis import hlo as _hlo
from fnscale import _sharding as _sh
from fnscale._errors import ShardingError, StepError
from fnscale.analysis.hlo import Collective
from fnscale.parallel import _pipeline
# The compile settings are public here; the warnings reader is reached here by its tests.
from fnscale._compiler import compilation_cache, compilation_cache_restored  # noqa: F401
from fnscale._compiler import fast_compile_options  # noqa: F401
from fnscale._compiler import compile_lowered, xla_warnings  # noqa: F401

__all__ = ["CompileReport", "compilation_cache", "compilation_cache_restored", "compile_report",
           "fast_compile_options", "format_report", "sharding_report"]


class CompileReport(NamedTuple):
  """What XLA says about one compiled step. Bytes are per device.

  Fields: `compile_seconds` (wall time of `Lowered.compile`), `flops`, `transcendentals`
  and `bytes_accessed` (XLA cost analysis of the partitioned, per-device program; None where
  the backend gives none; it counts each while-loop body once, so a `lax.scan` over layers
  or gradient-accumulation microbatches is under-counted), `argument_bytes`, `output_bytes`,
  `temp_bytes`, `alias_bytes` (arguments whose buffers the outputs reuse, e.g. a donated
  state) and `generated_code_bytes` (memory analysis; None where unavailable), `collectives`
  (tuple of `fnscale.analysis.hlo.Collective`: executions, result bytes and ring bytes sent per device
  per step, loop trip counts applied), `platform`, `num_devices`, `mesh_shape` (dict axis ->
  size, or None), `matmul_flops` (FLOPs of the dots, convolutions and GPU library matmuls of
  the optimized HLO per device per step, loop trip counts applied; `fnscale.analysis.hlo.summarize`),
  `xla_warnings` (the warnings XLA logged while compiling, one string each, de-duplicated in
  order), `model_flops` (the model's own FLOPs per device per step, when the caller gave them),
  `hlo_unread` (what the HLO reader could not read, `fnscale.analysis.hlo.Unread`: instructions by
  opcode, loops without a trip count, collectives whose groups were guessed; empty when the
  HLO figures cover the whole program), `kernels` (custom kernels the program calls, whose
  work the HLO figures leave out; `fnscale.analysis.hlo.Kernel`), `dcn_bytes_sent` (of the ring
  bytes sent per device per step, those across slices: the data-center network of a
  multi-slice TPU job), `pipelines` (the pipeline schedules the program runs,
  `fnscale.parallel.Schedule`: stages, microbatches, repeats and the bubble
  (S - 1) / (R M + S - 1)), `grouped_flops` (the grouped matmuls' FLOPs of a mixture of
  experts, `ragged-dot` ops and the kernels that run them, over their whole buffers: an upper
  bound of the work for a dropless layer; `fnscale.analysis.hlo.Summary.grouped_flops`),
  `from_cache` (the program was loaded from jax's persistent compilation cache, so
  `compile_seconds` is the load's), `reused` (jax returned the executable it compiled for
  the same program earlier in this process: `compile_seconds` is the lookup's).

  Examples:
    A plain function of (state, batch), compiled with `jax.jit` on one device: [8, 4] x [4, 2]
    is 2 x 8 x 4 x 2 = 128 matmul FLOPs.

    >>> import jax.numpy as jnp
    >>> import fnscale as fs
    >>> report = fs.compile_report(lambda w, x: x @ w, jnp.ones((4, 2)), jnp.ones((8, 4)))
    >>> report.matmul_flops, report.num_devices, report.collectives
    (128.0, 1, ())
  """
  compile_seconds: float
  flops: float | None
  transcendentals: float | None
  bytes_accessed: float | None
  argument_bytes: int | None
  output_bytes: int | None
  temp_bytes: int | None
  alias_bytes: int | None
  generated_code_bytes: int | None
  collectives: tuple[Collective, ...]
  platform: str
  num_devices: int
  mesh_shape: dict | None
  matmul_flops: float | None = None
  xla_warnings: tuple[str, ...] = ()
  model_flops: float | None = None
  hlo_unread: _hlo.Unread = _hlo.Unread()
  kernels: tuple[_hlo.Kernel, ...] = ()
  dcn_bytes_sent: float = 0.0
  pipelines: tuple[_pipeline.Schedule, ...] = ()
  grouped_flops: float = 0.0
  from_cache: bool = False
  reused: bool = False

  @property
  def flops_ratio(self) -> float | None:
    """HLO matmul FLOPs / the model's FLOPs (per device per step): 1.0 means the program does
    the model's work and no more; None without `model_flops`."""
    if self.model_flops is None or self.matmul_flops is None:
      return None
    return self.matmul_flops / self.model_flops

  @property
  def peak_bytes(self) -> int | None:
    """arguments + outputs + temporaries - aliased: the step's per-device footprint."""
    parts = (self.argument_bytes, self.output_bytes, self.temp_bytes)
    if any(p is None for p in parts):
      return None
    return sum(parts) - (self.alias_bytes or 0)

  def collective(self, kind: str) -> Collective:
    """The entry for `kind`, or a zero-count one."""
    return next((c for c in self.collectives if c.kind == kind), Collective(kind, 0, 0))

  def __str__(self) -> str:
    return format_report(self)


# ----------------------------------------------------------------------------- the report


def _analysis(compiled, name: str):
  try:
    return getattr(compiled, name)()
  except Exception as e:  # pylint: disable=broad-except  # backends without one
    logging.info("%s unavailable: %s", name, e)
    return None


def report_from_compiled(compiled, compile_seconds: float, mesh=None,
                         warnings: tuple[str, ...] = (), from_cache: bool = False,
                         reused: bool = False) -> CompileReport:
  """A `CompileReport` from a `jax.stages.Compiled`, its measured compile time, the
  warnings XLA logged while compiling it, whether it came from the persistent cache and
  whether jax reused an executable compiled earlier in this process."""
  cost = _analysis(compiled, "cost_analysis")
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = dict(cost or {})
  mem = _analysis(compiled, "memory_analysis")

  def m(name):
    v = getattr(mem, name, None) if mem is not None else None
    return int(v) if v is not None else None

  def c(name):
    v = cost.get(name)
    return float(v) if v is not None else None

  text = compiled.as_text() or ""
  hlo = _hlo.summarize(text)
  if mesh is not None:
    platform, num = mesh.devices.flat[0].platform, mesh.devices.size
  else:
    devices = jax.tree.leaves(compiled.input_shardings)
    devices = devices[0].device_set if devices else set()
    platform, num = ((next(iter(devices)).platform, len(devices)) if devices
                     else (jax.default_backend(), 1))
  return CompileReport(
      compile_seconds=float(compile_seconds), flops=c("flops"),
      transcendentals=c("transcendentals"), bytes_accessed=c("bytes accessed"),
      argument_bytes=m("argument_size_in_bytes"), output_bytes=m("output_size_in_bytes"),
      temp_bytes=m("temp_size_in_bytes"), alias_bytes=m("alias_size_in_bytes"),
      generated_code_bytes=m("generated_code_size_in_bytes"),
      collectives=hlo.collectives, platform=platform, num_devices=int(num),
      mesh_shape=dict(mesh.shape) if mesh is not None else None,
      matmul_flops=hlo.matmul_flops, xla_warnings=tuple(warnings), hlo_unread=hlo.unread,
      kernels=hlo.kernels, dcn_bytes_sent=hlo.dcn_bytes_sent,
      pipelines=_pipeline.schedules_in(text), grouped_flops=hlo.grouped_flops,
      from_cache=bool(from_cache), reused=bool(reused))


def compile_report(step: Callable, state, batch, *,
                   compiler_options: Mapping | None = None,
                   fast_compile: bool = False,
                   model_flops: float | None = None) -> CompileReport:
  """Compiles `step` for `(state, batch)` and reports what XLA made of it.

  Args:
    step: a `CompiledStep` (`shard_step(...).compile(...)`: its executable, compile time and
      warnings are reused), a `ShardedStep` (`shard_step(...)`: compiled now with its own
      options plus these), or a plain function (compiled with `jax.jit`).
    state, batch: arrays or `jax.ShapeDtypeStruct`s (abstract inputs never touch a device,
      so this works for a mesh of `jax.experimental.topologies` devices, e.g. a TPU pod
      compiled on a CPU machine).
    compiler_options, fast_compile: as in `shard_step` (ignored for a `CompiledStep`).
    model_flops: the model's FLOPs per device per step (e.g. PaLM's 6N + attention from
      `fnscale.analysis.model_flops_per_token` x tokens per step / devices); the report then
      gives HLO matmul FLOPs / model FLOPs (`flops_ratio`), which exposes redundant compute.

  Returns:
    A `CompileReport` (a NamedTuple; `str(report)` / `format_report(report)` is a readable
    summary). FLOPs and bytes are per device.

  Raises:
    StepError: `step` not callable, options of the wrong type; and as `shard_step` does for
      inputs that don't fit (ShardingError too).

  Examples:
    A data-parallel step on 8 devices: one all-reduce (the gradients and the loss, combined).

    >>> import jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> mesh = fs.make_mesh({"data": 8})
    >>> state = fs.init_state({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh=mesh)
    >>> step = fs.shard_step(fs.train_step(loss_fn, optax.sgd(0.1)), mesh)
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.ones((16, 1))}
    >>> report = fs.compile_report(step, state, batch)
    >>> report.platform, report.num_devices, report.mesh_shape
    ('cpu', 8, {'data': 8})
    >>> [(c.kind, c.count) for c in report.collectives]
    [('all-reduce', 1)]
  """
  if not callable(step):
    raise StepError(f"step is {_tree.got(step)}, expected a step function, a ShardedStep or "
                    "a CompiledStep.")
  if compiler_options is not None and not isinstance(compiler_options, Mapping):
    raise StepError(f"compiler_options is {_tree.got(compiler_options)}, expected a dict.")
  if model_flops is not None and (isinstance(model_flops, bool) or not isinstance(
      model_flops, (int, float)) or not model_flops > 0):
    raise StepError(f"model_flops is {_tree.got(model_flops)}, expected a positive number of "
                    "FLOPs per device per step, or None.")
  return _report(step, state, batch, options=_options(compiler_options, fast_compile),
                 model_flops=model_flops)


def _options(compiler_options, fast_compile) -> dict:
  return {**(fast_compile_options() if fast_compile else {}), **(compiler_options or {})}


def _report(step, state, batch, *, options, model_flops) -> CompileReport:
  if isinstance(step, _compile.ShardedStep) and options:
    step = _replace_options(step, options)
  if isinstance(step, _compile.ShardedStep):
    step = step.compile(state, batch)
  if isinstance(step, _compile.CompiledStep):
    report = report_from_compiled(step.compiled, step.compile_seconds, step.mesh,
                                  step.xla_warnings, step.from_cache, step.reused)
  else:
    c = compile_lowered(jax.jit(step).lower(state, batch), options)
    report = report_from_compiled(c.compiled, c.seconds, None, c.warnings, c.from_cache,
                                  c.reused)
  return report._replace(model_flops=None if model_flops is None else float(model_flops))


def _replace_options(step, options):
  import dataclasses  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(step, compiler_options={**(step.compiler_options or {}),
                                                     **options})


def format_report(report: CompileReport) -> str:
  """Readable multi-line text for a `CompileReport` (`str(report)` gives the same): the
  platform and mesh, compile time, FLOPs, memory per device, the collectives and what XLA
  warned about.

  Raises:
    StepError: `report` is not a CompileReport.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, optax
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"]) ** 2)
    >>> mesh = fs.make_mesh({"data": 8})
    >>> state = fs.init_state({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh=mesh)
    >>> step = fs.shard_step(fs.train_step(loss, optax.sgd(0.1)), mesh)
    >>> report = fs.compile_report(step, state, {"x": jnp.ones((16, 4))})
    >>> print(fs.analysis.format_report(report).splitlines()[0])
    compiled step: cpu x8 mesh data=8
  """
  if not isinstance(report, CompileReport):
    raise StepError(f"report is {_tree.got(report)}, expected a CompileReport.")
  fb, fn = _tree.fmt_bytes, _tree.fmt_num
  mesh = (" mesh " + ",".join(f"{k}={v}" for k, v in report.mesh_shape.items())
          if report.mesh_shape else "")
  lines = [
      f"compiled step: {report.platform} x{report.num_devices}{mesh}",
      f"  compile time      {report.compile_seconds:.2f} s"
      + (" (loaded from jax's persistent compilation cache)" if report.from_cache else
         " (compiled earlier in this process: jax's in-memory cache)" if report.reused
         else ""),
      f"  FLOPs per device  {fn(report.flops)}  (XLA cost analysis, loop bodies once; "
      f"transcendentals {fn(report.transcendentals)}, bytes accessed "
      f"{fb(report.bytes_accessed)})",
      f"  matmul FLOPs/dev  {fn(report.matmul_flops)}  (HLO dots, convolutions and GPU "
      "library matmuls, loop trip counts applied)" + (
          "" if report.flops_ratio is None else
          f"; {report.flops_ratio:.3f} x the model's {fn(report.model_flops)}"),
      *([f"  grouped FLOPs/dev {fn(report.grouped_flops)}  (experts' grouped matmuls: "
         "ragged-dot and its kernels over their whole buffers, a dropless layer's worst "
         "case: an upper bound)"] if report.grouped_flops else []),
      "  memory per device",
      f"    arguments       {fb(report.argument_bytes)}",
      f"    outputs         {fb(report.output_bytes)}",
      f"    temporaries     {fb(report.temp_bytes)}",
      f"    aliased         {fb(report.alias_bytes)}",
      f"    peak (a+o+t-al) {fb(report.peak_bytes)}",
  ]
  if report.collectives:
    lines.append("  collectives per step (runs [ops in program], result / ring-sent bytes "
                 "per device)")
    lines += [f"    {c.kind:<20} {c.count:>4} [{c.ops}]  {fb(c.bytes)} / {fb(c.bytes_sent)}"
              for c in report.collectives]
    if report.dcn_bytes_sent:
      lines.append(f"    of which across slices (DCN): {fb(report.dcn_bytes_sent)} ring-sent")
  else:
    lines.append("  collectives: none")
  lines += [f"  pipeline: {p} ((S-1)/(R*M+S-1) of each device's iterations idle)"
            for p in report.pipelines]
  lines += _hlo_notes(report)
  if report.xla_warnings:
    lines.append(f"  XLA warnings ({len(report.xla_warnings)})")
    lines += [f"    {w}" for w in report.xla_warnings]
  return "\n".join(lines)


def _hlo_notes(report: CompileReport) -> list[str]:
  """What the HLO figures above leave out: unread HLO and custom kernels."""
  u = report.hlo_unread
  lines = ([f"  HLO not read ({u.count}; the figures above leave it out or guess)"]
           if u.count else [])
  lines += [f"    {n} {op}" for op, n in u.ops]
  lines += [f"    loop without a trip count (body {b}), counted once" for b in u.loops]
  lines += [f"    {n} {kind} with guessed replica groups (all {report.num_devices} devices)"
            for kind, n in u.groups]
  if report.kernels:
    lines.append("  custom kernels (their work is not in the figures above)")
    lines += [f"    {k.name:<20} {k.runs:>4} [{k.ops}]  {k.target}" + (
        "" if k.declared_flops is None else f", declares {_tree.fmt_num(k.declared_flops)} FLOPs")
              for k in report.kernels]
  return lines


# ----------------------------------------------------------------------------- shardings


def _fmt_axes(axes) -> str:
  if axes is None:
    return "-"
  if isinstance(axes, jax.sharding.PartitionSpec):
    return f"spec{tuple(axes)}"
  return "(" + ", ".join("None" if a is None else a for a in axes) + ")"


def _fmt_spec(spec) -> str:
  return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


def sharding_report(tree, shardings_or_layout, *, logical_axes=None) -> str:
  """A readable table: per leaf its path, shape, dtype, logical axes, PartitionSpec,
  global and per-device bytes and how the sharding was chosen; then totals.

  Args:
    tree: the pytree the shardings are for (arrays or ShapeDtypeStructs).
    shardings_or_layout: a `ShardingLayout` (from `sharding_layout`; gives the reason
      column) or a pytree of NamedSharding (reason inferred: "sharded" or "replicated").
    logical_axes: as in `shardings`, shown in the logical-axes column when the second
      argument is a plain shardings tree.

  Returns:
    Multi-line text. Per-device bytes are one device's shard (jax's `shard_shape`).

  Raises:
    ShardingError: a layout for another tree, shardings that don't match the tree.

  Examples:
    >>> import jax.numpy as jnp
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
    >>> params = {"w_in": jnp.zeros((64, 256)), "w_out": jnp.zeros((256, 64))}
    >>> layout = fs.sharding_layout(
    ...     params, mesh, (("embed", "fsdp"), ("mlp", "tensor")),
    ...     logical_axes={"w_in": ("embed", "mlp"), "w_out": ("mlp", "embed")})
    >>> print(fs.sharding_report(params, layout))
    path   shape   dtype    logical axes  spec                 global    per device  how
    -----  ------  -------  ------------  -------------------  --------  ----------  -----
    w_in   64x256  float32  (embed, mlp)  P('fsdp', 'tensor')  64.0 KiB  8.0 KiB     rules
    w_out  256x64  float32  (mlp, embed)  P('tensor', 'fsdp')  64.0 KiB  8.0 KiB     rules
    <BLANKLINE>
    mesh: fsdp=4 tensor=2 (8 devices)
    leaves: 2  total: 128.0 KiB  per device: 16.0 KiB  replicated: 0 leaves (0 B)
  """
  n = jax.tree_util.tree_structure(tree).num_leaves
  if isinstance(shardings_or_layout, _sh.ShardingLayout):
    layout = shardings_or_layout
    if len(layout.leaves) != n:
      raise ShardingError(
          f"the layout has {len(layout.leaves)} leaves but the tree has {n}; fix: report on "
          "the tree the layout was made for.")
  else:
    layout = _sh.layout_of(tree, shardings_or_layout, logical_axes=logical_axes)
  return "\n".join(_table(layout.leaves) + [""] + _totals(layout))


def _table(leaves) -> list[str]:
  header = ("path", "shape", "dtype", "logical axes", "spec", "global", "per device", "how")
  rows = [(lp.path or "<root>", "x".join(map(str, lp.shape)) or "scalar", str(lp.dtype),
           _fmt_axes(lp.logical_axes), _fmt_spec(lp.spec), _tree.fmt_bytes(lp.global_bytes),
           _tree.fmt_bytes(lp.device_bytes), lp.reason + (f" ({lp.note})" if lp.note else ""))
          for lp in leaves]
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
  return lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _totals(layout) -> list[str]:
  leaves, fb = layout.leaves, _tree.fmt_bytes
  mesh = layout.mesh
  repl = [lp for lp in leaves if lp.device_bytes == lp.global_bytes and lp.global_bytes]
  indiv = [lp for lp in leaves if lp.reason == _sh.INDIVISIBLE]
  lines = []
  if mesh is not None:
    sizes = dict(mesh.shape)
    lines.append("mesh: " + " ".join(f"{a}={n}" for a, n in sizes.items())
                 + f" ({math.prod(sizes.values())} devices)")
  lines.append(f"leaves: {len(leaves)}  total: {fb(sum(lp.global_bytes for lp in leaves))}  "
               f"per device: {fb(sum(lp.device_bytes for lp in leaves))}  replicated: "
               f"{len(repl)} leaves ({fb(sum(lp.global_bytes for lp in repl))})")
  if indiv:
    lines.append(f"large leaves replicated because no dimension divides the fsdp size: "
                 f"{len(indiv)} ({fb(sum(lp.global_bytes for lp in indiv))}): "
                 + ", ".join(lp.path for lp in indiv))
  return lines
