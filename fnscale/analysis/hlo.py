"""Reading optimized HLO text: collectives and matmul FLOPs, with while-loop trip counts applied.

Pure functions over the text of `jax.stages.Compiled.as_text()` (the partitioned, per-device
program of an SPMD step) or of an XLA dump (`--xla_dump_to`, `*after_optimizations.txt`, which
writes tuple elements as `%param#0` instead of `get-tuple-element` instructions). The module is
split into computations and a call graph; every computation gets the number of times it runs
per step, the product of the `known_trip_count` of the while loops around it (XLA records it
in the loop's `backend_config`). A `lax.scan` over layers or a gradient-accumulation loop
therefore counts its body's matmuls and collectives once per iteration, where XLA's own
`cost_analysis()` counts a loop body once.

Where a loop has no `known_trip_count` (the TPU compiler drops it), the count is read from
its condition `i < N` (`Loop.from_condition`), looking through copies and the one-op fusions
XLA's CPU backend wraps the compare and the counter's increment in.

Matmuls are `dot`, `ragged-dot` (grouped matmuls, `lax.ragged_dot`) and `convolution` ops
(what XLA emits on CPU and TPU, and inside GPU Triton and cuDNN fusions) and the GPU library
calls that replace them: cuBLAS GEMMs (`__cublas$gemm`, `__cublas$lt$matmul`,
`__cublas$lt$matmul$f8`), cuDNN convolutions (forward, backward input, backward filter) and
cuDNN fused attention (`__cudnn$fmha*`).
Custom kernels (Pallas on TPU or GPU, Mosaic GPU, Triton) are listed, not counted
(`Summary.kernels`); grouped matmuls (`ragged-dot` and the kernels XLA and megablox run
for it) are also summed apart, over their whole buffers (`Summary.grouped_flops`). A
`ragged-all-to-all` (sync or async) counts as a collective of the smaller of its operand and
result, and an async `call-start`/`custom-call-start` with its `-update`s and `-done` (TPU
SparseCore offloads) by the computation it calls. Nothing is skipped silently: what could
not be read is returned in
`Summary.unread` (instructions by opcode, among them every opcode whose work is not
counted here, such as `fft`, `triangular-solve`, `cholesky` or `scaled-dot`, and any opcode
not known here; loops without a trip count; collectives whose replica groups were
guessed). Every branch of a `conditional` counts as if it ran.

The TPU compiler writes many reduce-scatters as a fusion whose computation returns a
`dynamic-slice` of an `all-reduce` (libtpu names it `all-reduce-scatter`, its emitter
`AllReduceScatterFusion`): each is counted as the reduce-scatter it runs, (n-1)/n of the
reduced bytes sent, not as its inner all-reduce's 2 (n-1)/n.

This module is the public face (the values read and `summarize`); each part is read apart:
`_hlo_text` parses the text into computations and instructions, `_hlo_read` sends each
instruction by its opcode to a reader, `_hlo_loops` counts loop trips and computation runs,
`_hlo_flops` matmul FLOPs, `_hlo_kernels` custom calls (kernels listed, GPU library matmuls
counted), `_hlo_collectives` collectives, their replica groups and ring bytes sent.

Examples:
  Instruction lines without computations read as one computation that runs once; a
  compiled step's `as_text()` is read the same way, whole.

  >>> import fnscale as fs
  >>> hlo = fs.analysis.hlo
  >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
  ...         "rhs_contracting_dims={0}\\n"
  ...         "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%add")
  >>> s = hlo.summarize(text)
  >>> s.matmul_flops, [(c.kind, c.count, c.bytes) for c in s.collectives], s.unread.count
  (8192.0, [('all-reduce', 1, 1024)], 0)
"""
from __future__ import annotations

import collections
from typing import NamedTuple

from fnscale import _deprecation
from fnscale._errors import StepError
from fnscale.analysis._hlo_collectives import (COLLECTIVE_KINDS, _devices, _fused_scatters,
                                               _per_kind, _ring_groups, ring_bytes_sent)
from fnscale.analysis._hlo_kernels import _kernel_runs
from fnscale.analysis._hlo_loops import _loop_trips, _multiplicities
from fnscale.analysis._hlo_read import _read_computation
from fnscale.analysis._hlo_text import _Graph, _computations, _graph, _index

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Summary",
    "Kernel",
    "Loop",
    "Unread",
    "collectives",
    "flops_ratio",
    "matmul_flops",
    "ring_bytes_sent",
    "summarize",
]

__getattr__ = _deprecation.moved(__name__, {
    "HloSummary": ("fnscale.analysis.hlo:Summary", "fnscale.analysis.hlo.Summary")})

class Collective(NamedTuple):
  """One kind of collective in an optimized HLO module, per device and per step.

  `kind`: one of `COLLECTIVE_KINDS` (async `-start`/`-done` pairs count once, under the base
  kind); `count`: executions per step, each op multiplied by the trip counts of the while
  loops around it; `bytes`: sum of their result sizes in bytes per device per step (for
  reduce-scatter the scattered shard), trip counts applied; `ops`: ops of that kind in the
  module text, each counted once; `bytes_sent`: bytes one device sends per step under ring
  algorithms (`ring_bytes_sent`), trip counts applied.

  Examples:
    An all-reduce over groups of 4 devices (`bytes_sent`: 2 (n-1)/n x 1024 bytes):

    >>> import fnscale as fs
    >>> text = "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%a"
    >>> (c,) = fs.analysis.hlo.collectives(text)
    >>> c, c.kind in fs.analysis.hlo.COLLECTIVE_KINDS
    (Collective(kind='all-reduce', count=1, bytes=1024, ops=1, bytes_sent=1536.0), True)
  """
  kind: str
  count: int
  bytes: int
  ops: int = 0
  bytes_sent: float = 0.0


class Loop(NamedTuple):
  """A while loop: its `body` computation's name and `trip_count` (None where unknown).

  The trip count is XLA's `known_trip_count` where the loop's `backend_config` has one; else
  (`from_condition` True; the TPU compiler drops that config) ceil((N - start) / step) from a
  condition `i < N` on a tuple element against a constant, with `start` the element's
  constant initial value (0 where it is not a constant) and `step` its constant increment in
  the body (1 where the increment is not a constant), as `lax.scan`, `lax.fori_loop` and
  XLA's unrolled windowed-einsum loops lower.

  Examples:
    A `fori_loop` of 5 matmuls: its body's 1024 FLOPs count 5 times.

    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> scan = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ x), x))
    >>> s = fs.analysis.hlo.summarize(scan.lower(jnp.ones((8, 8))).compile().as_text())
    >>> [(loop.trip_count, loop.from_condition) for loop in s.loops], s.matmul_flops
    ([(5, False)], 5120.0)
  """
  body: str
  trip_count: int | None
  from_condition: bool = False


class Kernel(NamedTuple):
  """A custom kernel the program calls (a Pallas kernel on TPU or GPU, Mosaic GPU, Triton);
  its work is in no `Summary` figure.

  `name`: the instruction's name without XLA's `.N` suffix (jax names it after the kernel,
  e.g. `splash_mqa_fwd_residuals`); `target`: the custom-call target (`tpu_custom_call`,
  `__gpu$xla.gpu.triton`, `mosaic_gpu_v2`, ...); `ops`: calls in the module text; `runs`:
  calls per step, trip counts applied; `declared_flops`: FLOPs per step from the kernel's own
  cost estimate (`pallas_call(..., cost_estimate=...)`), None where a call declares none.

  Examples:
    >>> import fnscale as fs
    >>> text = '%k = f32[8,32] custom-call(f32[8,32] %x), custom_call_target="tpu_custom_call"'
    >>> fs.analysis.hlo.summarize(text).kernels
    (Kernel(name='k', target='tpu_custom_call', ops=1, runs=1, declared_flops=None),)
  """
  name: str
  target: str
  ops: int
  runs: int
  declared_flops: float | None = None


class Unread(NamedTuple):
  """What `summarize` could not read; each part is left out of (or guessed in) the figures.

  `ops`: (opcode, instructions) whose FLOPs or bytes count as 0: an op whose work is not
  counted here (`fft`, `triangular-solve`, `cholesky`, `scaled-dot`, ...) or whose opcode is
  not known here, a `dot`/`ragged-dot`/`convolution` whose operand shapes or dimension
  numbers are missing, a `custom-call` to a target not known here (named as
  `custom-call <target>`), a GEMM/cuDNN call whose config lacks what its FLOPs need, a
  collective whose result size can't be read, a device-to-device `send`/`recv` (sizes
  known only at run time), a line in a computation that is not
  an instruction (`unparsed line`); `loops`: bodies of while loops without a known trip count
  (each body counted once); `groups`: (collective kind, instructions) whose replica groups
  were guessed to span every device (a spelling not read here, or text without the module
  header that gives the device count). Instructions are counted once each, in computations
  that run.

  Examples:
    >>> import fnscale as fs
    >>> text = "%f = c64[8,32] fft(c64[8,32] %x), fft_length={32}"
    >>> unread = fs.analysis.hlo.summarize(text).unread
    >>> unread.ops, unread.count, str(unread)
    ((('fft', 1),), 1, '1 fft')
  """
  ops: tuple[tuple[str, int], ...] = ()
  loops: tuple[str, ...] = ()
  groups: tuple[tuple[str, int], ...] = ()

  @property
  def count(self) -> int:
    """Unread instructions + loops without a trip count + collectives with guessed groups."""
    return sum(n for _, n in self.ops) + len(self.loops) + sum(n for _, n in self.groups)

  def __str__(self) -> str:
    parts = [f"{n} {op}" for op, n in self.ops]
    if self.loops:
      parts.append(f"{len(self.loops)} loop(s) without a trip count, counted once: "
                   + ", ".join(self.loops))
    parts += [f"{n} {kind} with guessed replica groups (all devices)" for kind, n in self.groups]
    return "; ".join(parts) if parts else "nothing"


class Summary(NamedTuple):
  """What `summarize` reads from one optimized HLO module; numbers are per device per step.

  `matmul_flops`: 2 x result elements x contracted size summed over every `dot`,
  `ragged-dot` (2 x lhs elements x rhs free elements) and `convolution` and GPU library
  matmul (cuBLAS GEMM, cuDNN convolution and fused attention), loop trip counts applied
  (FLOPs); `matmul_flops_once`: the same with every reachable loop body counted once, as
  XLA's cost analysis does; `collectives`: tuple of `Collective` in `COLLECTIVE_KINDS`
  order; `loops`: every while loop; `num_devices`: devices a collective
  without replica groups spans (the module's replicas x partitions unless given); `groups`:
  (kind, devices per replica group, ring bytes sent per device per step) for each kind and
  group size present (a group size names the mesh axis a collective runs on); `unread`: what
  could not be read (`Unread`; `unread.count == 0` when the figures cover the whole program);
  `kernels`: custom kernels called, whose work no figure includes (`Kernel`);
  `dcn_groups`: the part of `groups` sent across slices (a multi-slice TPU program's
  collectives over the data-center network, their group size the slice count, 2 for a
  collective-permute such as a pipeline's stage-to-stage sends; also in `collectives` and
  `groups`), and `dcn_bytes_sent` its total.
  `grouped_flops`: FLOPs of the grouped matmuls (a mixture of experts' expert matmuls):
  `ragged-dot` ops (also in `matmul_flops`) plus the FLOPs the grouped-matmul kernels
  declare (XLA's TPU `ragged-dot` kernels, Pallas megablox `gmm`/`tgmm`; not in
  `matmul_flops`). Both count every row of their buffers, routed or not: a dropless
  layer's buffers hold the worst case, so this is an upper bound of the work done (the
  kernels skip the rows no group holds).

  Examples:
    A `fori_loop` of 5 matmuls, as compiled for this host:

    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> scan = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ x), x))
    >>> s = fs.analysis.hlo.summarize(scan.lower(jnp.ones((8, 8))).compile().as_text())
    >>> s.matmul_flops, s.matmul_flops_once, s.num_devices, s.unread.count
    (5120.0, 1024.0, 1, 0)
  """
  matmul_flops: float
  matmul_flops_once: float
  collectives: tuple[Collective, ...]
  loops: tuple[Loop, ...]
  num_devices: int
  groups: tuple[tuple[str, int, float], ...] = ()
  unread: Unread = Unread()
  kernels: tuple[Kernel, ...] = ()
  dcn_groups: tuple[tuple[str, int, float], ...] = ()
  grouped_flops: float = 0.0

  @property
  def unknown_trip_counts(self) -> int:
    """While loops without a known trip count (their bodies counted once)."""
    return sum(l.trip_count is None for l in self.loops)

  @property
  def dcn_bytes_sent(self) -> float:
    """Ring bytes sent across slices per device per step (`dcn_groups`' total)."""
    return sum(b for _, _, b in self.dcn_groups)

  def collective(self, kind: str) -> Collective:
    """The entry for `kind`, or a zero one."""
    return next((c for c in self.collectives if c.kind == kind), Collective(kind, 0, 0))


def summarize(hlo_text: str, num_devices: int | None = None) -> Summary:
  """Matmul FLOPs and collective traffic of one optimized HLO module, loops unrolled by count.

  Args:
    hlo_text: `jax.stages.Compiled.as_text()` (optimized, partitioned HLO: shapes per device),
      an XLA dump's `*after_optimizations.txt`, or instruction lines without computations
      (read as one computation that runs once).
    num_devices: devices a collective without `replica_groups` spans; default the module's
      `replica_count` x `num_partitions` (1 where the text has no module header, and such
      collectives are then listed in `unread.groups`).

  Returns:
    An `Summary` (FLOPs and bytes per device per step), with what could not be read in
    its `unread` field.

  Raises:
    StepError: `hlo_text` is not a string or `num_devices` is below 1.

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> s = fs.analysis.hlo.summarize(text)  # 2 x 8 x 32 x 16
    >>> s.matmul_flops, s.collectives, s.unread.count
    (8192.0, (), 0)
  """
  if not isinstance(hlo_text, str):
    raise StepError(f"hlo_text is a {type(hlo_text).__name__}, expected the str of "
                    "`jax.stages.Compiled.as_text()`")
  if num_devices is not None and int(num_devices) < 1:
    raise StepError(f"num_devices={num_devices}, expected at least 1")
  dev = _devices(hlo_text, num_devices)
  if dev.total < 1:
    raise StepError(f"num_devices={dev.total}, expected at least 1")
  comps, entry = _computations(hlo_text)
  g = _graph()
  _index(comps, g)
  _fused_scatters(g)
  for name in comps:
    _read_computation(name, g, dev)

  loops = []
  for caller, body, cond, init, known in g.whiles:
    trips = _loop_trips(g, caller, body, cond, init) if known is None else None
    loop = Loop(body, known) if known is not None else Loop(body, trips, trips is not None)
    loops.append(loop)
    # An unknown count runs the body once; a count of 0 never runs it.
    body_runs = 1 if loop.trip_count is None else loop.trip_count
    g.edges[caller].extend(((body, body_runs), (cond, (loop.trip_count or 0) + 1)))
  mult = _multiplicities(comps, g.edges, entry)
  unknown = tuple(l.body for l, w in zip(loops, g.whiles) if l.trip_count is None and mult[w[0]])
  return _summary(g, mult, tuple(loops), unknown, dev.total)


def _summary(g: _Graph, mult: dict, loops: tuple, unknown: tuple, num_devices: int
             ) -> Summary:
  """The per-step figures of a read module, each computation weighted by its runs."""
  count = lambda d: tuple(sorted(collections.Counter(
      x for c, xs in d.items() if mult[c] for x in xs).items()))
  return Summary(
      matmul_flops=sum(f * mult[c] for c, f in g.dots.items()),
      matmul_flops_once=sum(f for c, f in g.dots.items() if mult[c]),
      collectives=tuple(Collective(*c) for c in _per_kind(g.colls, mult)),
      loops=loops, num_devices=int(num_devices),
      groups=_ring_groups(g.colls, mult),
      unread=Unread(count(g.unread), unknown, count(g.guessed)),
      dcn_groups=_ring_groups(g.dcn, mult),
      grouped_flops=sum(f * mult[c] for c, f in g.grouped.items()),
      kernels=tuple(Kernel(*k) for k in _kernel_runs(g.kernels, mult)))


def collectives(hlo_text: str, num_devices: int | None = None) -> tuple[Collective, ...]:
  """The collectives of an optimized HLO module, executions and bytes per device per step.

  Each op counts once per run of its computation (while-loop trip counts applied); async
  pairs count at their `-done` op, whose result is the collective's output. Returns one
  `Collective` per kind present, in `COLLECTIVE_KINDS` order. Args and errors as `summarize`.

  Examples:
    >>> import fnscale as fs
    >>> text = "%s = f32[8,32] all-reduce(f32[8,32] %d), replica_groups={{0,1,2,3}}, to_apply=%a"
    >>> [(c.kind, c.count, c.bytes, c.ops) for c in fs.analysis.hlo.collectives(text)]
    [('all-reduce', 1, 1024, 1)]
  """
  return summarize(hlo_text, num_devices).collectives


def matmul_flops(hlo_text: str, *, apply_trip_counts: bool = True) -> float:
  """Matmul FLOPs per device per step of an optimized HLO module (`dot`, `ragged-dot`,
  `convolution` and GPU library matmuls, as `summarize`).

  2 x result elements x contracted elements per op; with `apply_trip_counts` each op is
  multiplied by the runs of its computation (while-loop trip counts), else every reachable
  loop body counts once (as XLA's `cost_analysis()` does). Errors as `summarize`.

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> fs.analysis.hlo.matmul_flops(text)  # 2 x 8 x 32 x 16
    8192.0
  """
  s = summarize(hlo_text)
  return s.matmul_flops if apply_trip_counts else s.matmul_flops_once


def flops_ratio(hlo_text: str, model_flops: float) -> float:
  """HLO matmul FLOPs per device per step (`matmul_flops`) / `model_flops` per device.

  With `model_flops` the FLOPs the step's own matmuls need
  (`fnscale.analysis._trace.jaxpr_matmul_flops` of the traced step, remat included), 1.0 says the compiled program does the model's work
  and no more; with PaLM's 6N + attention (`fnscale.analysis.model_flops_per_token` x tokens /
  devices), remat's recomputation shows above 1 and attention inside a Pallas kernel (a
  custom kernel, `Summary.kernels`, not counted here) below.

  Raises:
    StepError: `model_flops` not a positive number, or a bad `hlo_text` (as `summarize`).

  Examples:
    >>> import fnscale as fs
    >>> text = ("%d = f32[8,32] dot(f32[8,16] %x, f32[16,32] %w), lhs_contracting_dims={1}, "
    ...         "rhs_contracting_dims={0}")
    >>> fs.analysis.hlo.flops_ratio(text, model_flops=8192.0)  # the model's work, no more
    1.0
  """
  if isinstance(model_flops, bool) or not isinstance(model_flops, (int, float)) or not (
      model_flops > 0):
    raise StepError(f"model_flops={model_flops!r}, expected a positive number of FLOPs per "
                    "device per step")
  return summarize(hlo_text).matmul_flops / float(model_flops)
