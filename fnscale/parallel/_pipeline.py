"""Pipeline parallelism: a stack of layers run as stages over the `stage` mesh axis.

`pipeline(stage_fn, microbatches=M, repeats=R)` takes a per-stage function
`stage_fn(stage_params, x) -> x` and returns `fn(params, x) -> x`, a function of the same
shape as the unpipelined model's: `params` are the stages' params stacked along a leading
`stage` dim (then a `repeats` dim for a circular schedule), `x` the whole batch. Each of the
S devices along the `stage` axis holds one stage's params; the batch is cut into M
microbatches that flow through the stages, one stage-to-stage `ppermute` per iteration,
under a `lax.scan` of R M + S - 1 iterations inside a `jax.shard_map` that is manual over the
stage axis only (FSDP and tensor parallelism inside a stage stay with XLA's partitioner).
The backward pass is jax's transpose of that program (autodiff), as in GPipe (Huang et al.
2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism") and
MaxText's SPMD pipeline; with R > 1 each device runs R non-adjacent stages, the circular
schedule of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM"), which divides the bubble by R.

Sequential meaning: for r in range(R): for s in range(S): x = stage_fn(params[s, r], x),
applied to every row (stage_fn must treat rows independently). The idle share of each
device's iterations, the bubble, is (S - 1) / (R M + S - 1) (`Schedule.bubble`).

Data flow on the stage axis: the rows a stage's devices hold enter as that stage's M / S
microbatches; before the loop stage 0 receives the others' (S - 1 one-to-one sends of M / S
microbatches), and after it the last stage sends each stage its outputs back (S - 1 more),
so the output is split over the stage axis exactly as the input was. In the loop every
iteration sends one microbatch of activations to the next stage (with R > 1 the last stage's
to the first, which keeps the M - S it can't start yet in a buffer). Bytes per send:
microbatch rows x the row's bytes; the backward pass sends as many again.

Layer: imports the core pipeline (`fnscale._axes`, `fnscale._errors`, `fnscale._tree`) only.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fnscale import _axes
from fnscale import _closure
from fnscale import _tree
from fnscale._errors import MeshError, ShardingError, StepError

__all__ = ["Schedule", "bubble_fraction", "pipeline", "schedules_in", "stage_layers",
           "unstage_layers"]


class Schedule(NamedTuple):
  """A pipeline's shape: `stages` S (devices along the stage axis), `microbatches` M, and
  `repeats` R (passes of each microbatch around the stages; R > 1 is circular);
  `iterations` R M + S - 1 and `bubble` (S - 1) / (R M + S - 1) follow.

  Examples:
    >>> import fnscale as fs
    >>> s = fs.parallel.Schedule(stages=4, microbatches=8, repeats=2)
    >>> s.iterations, round(s.bubble, 3), str(s)
    (19, 0.158, '4 stages x 2 repeat(s), 8 microbatches: bubble 0.158')
  """
  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def iterations(self) -> int:
    """Scan iterations per pass (forward, and again backward): R M + S - 1."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The idle share of a device's iterations: (S - 1) / (R M + S - 1)."""
    return (self.stages - 1) / self.iterations

  def __str__(self) -> str:
    return (f"{self.stages} stages x {self.repeats} repeat(s), {self.microbatches} "
            f"microbatches: bubble {self.bubble:.3f}")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """(S - 1) / (R M + S - 1): the share of a pipeline's iterations a device idles.

  Raises:
    StepError: sizes that are not positive ints.

  Examples:
    GPipe's 4 stages over 8 microbatches idle 3 of 11 iterations; two repeats (circular)
    halve that:

    >>> import fnscale as fs
    >>> round(fs.parallel.bubble_fraction(4, 8), 3), round(fs.parallel.bubble_fraction(4, 8, 2), 3)
    (0.273, 0.158)
  """
  for name, v in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
    _tree.check_int(v, name, StepError, minimum=1)
  return Schedule(stages, microbatches, repeats).bubble


# The name scope that marks a pipeline in the compiled program (its ops' metadata), so that
# a compile report can say which schedules the program runs.
_SCOPE = "fnscale_pipeline_s{}_r{}_m{}"
_SCOPE_RE = re.compile(r"fnscale_pipeline_s(\d+)_r(\d+)_m(\d+)")


def schedules_in(hlo_text: str) -> tuple[Schedule, ...]:
  """The pipeline schedules a compiled program runs (from its ops' name scopes), in order.

  Examples:
    A compiled program's ops name the pipeline's scope in their metadata:

    >>> import fnscale as fs
    >>> text = ('%t = f32[8] tanh(f32[8] %x), '
    ...         'metadata={op_name="jit(f)/fnscale_pipeline_s4_r2_m8/tanh"}')
    >>> fs.parallel.schedules_in(text)
    (Schedule(stages=4, microbatches=8, repeats=2),)
  """
  found = dict.fromkeys(_SCOPE_RE.findall(hlo_text or ""))
  return tuple(Schedule(int(s), int(m), int(r)) for s, r, m in found)


# ----------------------------------------------------------------------------- layouts


def stage_layers(layers, stages: int, repeats: int = 1):
  """Stacks a layer stack [L, ...] (layers in the order they run) for `pipeline`.

  Layer l = (r S + s) K + k (K = L / (S R) layers per stage) goes to stage s, repeat r,
  position k: leaves become [S, K, ...] (repeats 1) or [S, R, K, ...], so a `stage_fn` that
  runs its K layers in order gives the sequential model. A pure reshape and transpose: call
  it inside an init function to get params born in the pipeline's layout.

  Raises:
    ShardingError: a leaf without a leading layer dim, or L not divisible by S x R.

  Examples:
    8 layers over 2 stages and 2 repeats: stage 0 runs layers 0, 1 then 4, 5.

    >>> import fnscale as fs, jax.numpy as jnp
    >>> fs.parallel.stage_layers(jnp.arange(8), stages=2, repeats=2).tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    >>> fs.parallel.stage_layers(jnp.arange(8), stages=4).shape
    (4, 2)
  """
  _tree.check_int(stages, "stages", ShardingError, minimum=1)
  _tree.check_int(repeats, "repeats", ShardingError, minimum=1)

  def one(path, x):
    n = x.shape[0] if getattr(x, "ndim", 0) else None
    if n is None or n % (stages * repeats):
      raise ShardingError(
          f"leaf '{_tree.path_str(path)}' has shape {tuple(getattr(x, 'shape', ()))}: "
          f"{n} layers are not divisible by stages x repeats = {stages} x {repeats}; fix: "
          f"choose stages and repeats whose product divides {n} (or a layer count that "
          f"is a multiple of {stages * repeats}).")
    k = n // (stages * repeats)
    x = jnp.reshape(x, (repeats, stages, k) + x.shape[1:]).swapaxes(0, 1)
    return x[:, 0] if repeats == 1 else x
  return jax.tree_util.tree_map_with_path(one, layers)


def unstage_layers(params, repeats: int = 1):
  """The inverse of `stage_layers`: [S, K, ...] or [S, R, K, ...] -> [L, ...] in run order.

  Raises:
    ShardingError: `repeats` not a positive int.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> staged = fs.parallel.stage_layers(jnp.arange(8), stages=2, repeats=2)
    >>> fs.parallel.unstage_layers(staged, repeats=2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
  """
  _tree.check_int(repeats, "repeats", ShardingError, minimum=1)
  if repeats == 1:
    return jax.tree.map(lambda x: jnp.reshape(x, (-1,) + x.shape[2:]), params)
  return jax.tree.map(lambda x: jnp.reshape(x.swapaxes(0, 1), (-1,) + x.shape[3:]), params)


# ----------------------------------------------------------------------------- checks


def _stage_mesh(axis: str | None):
  """(the ambient mesh, the stage axis name) or a MeshError naming the fix."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise MeshError(
        "pipeline needs a mesh with a stage axis and none is set; fix: call the pipelined "
        "function under fnscale.with_mesh(mesh) (or inside a step compiled by "
        "fnscale.shard_step), with e.g. fnscale.make_mesh({'stage': 4, 'data': -1}).")
  names = (axis,) if axis is not None else _axes.current().stage
  found = next((a for a in names if a in mesh.axis_names), None)
  if found is None:
    want = axis or (names[0] if names else "stage")
    raise MeshError(
        f"pipeline runs its stages over mesh axis {want!r}, which the mesh (axes "
        f"{dict(mesh.shape)}) lacks; fix: add it, e.g. fnscale.make_mesh({{'{want}': 4, "
        f"'data': -1}}) or across slices make_mesh(..., dcn={{'{want}': 2}}), or pass "
        "axis= naming the mesh's pipeline axis.")
  if found in getattr(mesh, "manual_axes", ()):
    raise MeshError(
        f"pipeline's stage axis {found!r} is already manual (the call is inside a shard_map "
        f"over it); fix: call the pipelined function outside that shard_map, or compile the "
        "step with fnscale.shard_step(..., mode='auto').")
  return mesh, found


def _check_schedule(sched: Schedule, axis: str) -> None:
  s, m = sched.stages, sched.microbatches
  if m < s or m % s:
    raise StepError(
        f"microbatches={m} with {s} stages (mesh axis {axis!r}): the pipeline needs a "
        f"multiple of the stage count, at least {s}; fix: microbatches={s * max(1, -(-m // s))}"
        f" (more microbatches shrink the bubble (S-1)/(R*M+S-1)).")


def _check_params(params, sched: Schedule) -> None:
  lead = (sched.stages,) if sched.repeats == 1 else (sched.stages, sched.repeats)
  names = "[stages, ...]" if sched.repeats == 1 else "[stages, repeats, ...]"
  pairs = _tree.leaves_with_paths(params)
  if not pairs:
    raise ShardingError("pipeline params have no leaves; fix: pass the stages' stacked params.")
  for path, leaf in pairs:
    shape = tuple(getattr(leaf, "shape", ()))
    if shape[:len(lead)] != lead:
      raise ShardingError(
          f"pipeline param leaf '{path}' has shape {shape}, expected leading dims {lead} "
          f"({names}: {sched.stages} stages on the mesh's stage axis"
          + (f", {sched.repeats} repeats" if sched.repeats > 1 else "") + "); fix: stack the "
          "stages' params, e.g. fnscale.parallel.stage_layers(layers, "
          f"stages={sched.stages}, repeats={sched.repeats}).")


def _check_batch(x, sched: Schedule) -> int:
  pairs = _tree.leaves_with_paths(x)
  if not pairs:
    raise StepError("pipeline input x has no leaves; fix: pass an array [batch, ...].")
  rows = {tuple(getattr(leaf, "shape", ()))[:1] for _, leaf in pairs}
  if len(rows) != 1 or () in rows:
    raise StepError(
        f"pipeline input leaves have leading dims {sorted(rows)}; every leaf of x needs the "
        "same leading batch dim; fix: pass arrays [batch, ...] of one batch size.")
  (b,), = rows
  if b % sched.microbatches:
    raise StepError(
        f"a batch of {b} rows does not split into microbatches={sched.microbatches}; fix: a "
        f"batch that is a multiple of {sched.microbatches} rows, or a microbatch count that "
        f"divides {b} (and is a multiple of the {sched.stages} stages).")
  return b


# ----------------------------------------------------------------------------- the batch


class _Layout(NamedTuple):
  """How rows map to [stages, microbatches per stage, microbatch rows]: the batch split
  over `pre` axes, the stage axis, then `post` axes (mesh order), `aligned` when each
  device's rows divide into its microbatches (no row then changes device)."""
  pre: tuple[str, ...]
  post: tuple[str, ...]
  sizes: tuple[int, int, int]  # prod(pre), prod(post), rows per device per microbatch
  aligned: bool
  axis: str


def _layout(mesh, axis: str, rows: int, sched: Schedule) -> _Layout:
  manual = set(getattr(mesh, "manual_axes", ()))
  data = [a for a in _axes.data_axes(mesh) if a not in manual and a != axis]
  split = list(_axes.data_axes(mesh))
  cut = split.index(axis) if axis in split else len(split)
  pre = tuple(a for a in split[:cut] if a in data)
  post = tuple(a for a in split[cut:] if a in data)
  p = math.prod(mesh.shape[a] for a in pre)
  q = math.prod(mesh.shape[a] for a in post)
  per = sched.microbatches // sched.stages
  aligned = rows % (p * sched.stages * q * per) == 0
  return _Layout(pre, post, (p, q, rows // (p * sched.stages * q * per) if aligned else 0),
                 aligned, axis)


def _reshape(x, shape, lead: tuple, explicit: bool):
  """x.reshape(shape); on Explicit axes with the leading dims' mesh axes given (`lead`: one
  entry per new leading dim) and the trailing dims' kept, as jax asks there."""
  if not explicit:
    return x.reshape(shape)
  rest = tuple(jax.typeof(x).sharding.spec)[x.ndim - (len(shape) - len(lead)):]
  rest += (None,) * (len(shape) - len(lead) - len(rest))
  return jax.lax.reshape(x, shape, out_sharding=P(*lead, *rest))


def _to_stages(x, lay: _Layout, sched: Schedule, axis: str, explicit: bool):
  """[B, ...] -> [S, M / S, B / M, ...]: stage s's microbatches are rows its devices hold."""
  s, per = sched.stages, sched.microbatches // sched.stages
  rows = _tree.spec_entry(lay.pre + lay.post)
  if not lay.aligned:
    return _reshape(x, (s, per, -1) + x.shape[1:], (axis, None, None), explicit)
  p, q, k = lay.sizes
  rest, e = x.shape[1:], _tree.spec_entry
  y = _reshape(x, (p, s, q, k, per) + rest, (e(lay.pre), axis, e(lay.post), None, None),
               explicit)
  y = jnp.transpose(y, (1, 4, 0, 2, 3) + tuple(range(5, y.ndim)))
  return _reshape(y, (s, per, p * q * k) + rest, (axis, None, rows), explicit)


def _from_stages(y, lay: _Layout, sched: Schedule, rows: int, explicit: bool):
  """The inverse of `_to_stages`."""
  rest = y.shape[3:]
  batch = _tree.spec_entry(lay.pre + (lay.axis,) + lay.post)
  if not lay.aligned:
    return _reshape(y, (rows,) + rest, (batch,), explicit)
  p, q, k = lay.sizes
  s, per = sched.stages, sched.microbatches // sched.stages
  e = _tree.spec_entry
  y = _reshape(y, (s, per, p, q, k) + rest, (lay.axis, None, e(lay.pre), e(lay.post), None),
               explicit)
  y = jnp.transpose(y, (2, 0, 3, 4, 1) + tuple(range(5, y.ndim)))
  return _reshape(y, (rows,) + rest, (batch,), explicit)


def _on_stages(params, axis: str, explicit: bool):
  """On Explicit axes jax's shard_map takes only params whose stage dim is already split
  over the stage axis (jax 0.12 refuses others): reshard them there, the other dims keeping
  their mesh axes but the stage axis."""
  if not explicit:
    return params

  def one(p):
    spec = tuple(jax.typeof(p).sharding.spec) + (None,) * p.ndim
    if spec[0] == axis:
      return p
    rest = _tree.filter_spec(P(*spec[1:p.ndim]), lambda a: a != axis)
    return jax.sharding.reshard(p, P(axis, *rest))
  return jax.tree.map(one, params)


def _pin(y, mesh, axis: str, lay: _Layout):
  """Stage dim over the stage axis, microbatch rows over the other data axes (Auto axes)."""
  if mesh.auto_axes and set(mesh.auto_axes) >= {axis, *lay.pre, *lay.post}:
    rows = _tree.spec_entry(lay.pre + lay.post) if lay.aligned else P.UNCONSTRAINED
    spec = P(axis, None, rows, *([P.UNCONSTRAINED] * (y.ndim - 3)))
    return jax.lax.with_sharding_constraint(y, spec)
  return y


# ----------------------------------------------------------------------------- the schedule


def _index(tree, i):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _update(tree, value, i):
  return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def _where(pred, a, b):
  return jax.tree.map(lambda u, v: jnp.where(pred, u, v), a, b)


def _stage_call(stage_fn, sched: Schedule, remat) -> Callable:
  """run(params, r, x): stage_fn on repeat r's params (the slice taken inside the remat, so
  the backward pass keeps only x and r per iteration, not a copy of the params)."""
  def run(params, r, x):
    return stage_fn(_index(params, r) if sched.repeats > 1 else params, x)
  if remat is True:
    return jax.checkpoint(run)
  if callable(remat):
    return jax.checkpoint(run, policy=remat)
  return run


def _loop(run, params, io, axis: str, sched: Schedule):
  """The R M + S - 1 iterations on one stage's devices; returns `io` with the last stage's
  outputs in microbatch order (meaningful on the last stage)."""
  S, M, R = sched.stages, sched.microbatches, sched.repeats
  s = jax.lax.axis_index(axis)
  wait = M - S if R > 1 else 0  # iterations an output waits at stage 0 for its next repeat
  zeros = jax.tree.map(lambda a: jnp.zeros_like(a[0]), io)  # (keeping io's sharding)
  fifo = jax.tree.map(lambda a: jnp.zeros_like(a[:wait]), io)
  ring = [(i, (i + 1) % S) for i in range(S)] if R > 1 else [(i, i + 1) for i in range(S - 1)]
  send = (lambda y: y if R > 1 else zeros) if S == 1 else (
      lambda y: jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), y))

  def step(carry, t):
    io, shift, fifo = carry
    k = t - s  # the work item this stage runs now: microbatch k % M, repeat k // M
    kc = jnp.clip(k, 0, R * M - 1)
    m, r = kc % M, kc // M
    first = _index(io, jnp.minimum(t, M - 1))
    if R > 1:
      back = _index(fifo, t % wait) if wait else shift
      first = _where(t < M, first, back)
      if wait:
        fifo = _update(fifo, shift, t % wait)
    x = _where(s == 0, first, shift)
    y = run(params, r, x)
    _check_output(x, y)
    done = (s == S - 1) & (k >= (R - 1) * M) & (k < R * M)
    io = _update(io, _where(done, y, _index(io, m)), m)
    return (io, send(y), fifo), None

  (io, _, _), _ = jax.lax.scan(step, (io, zeros, fifo), jnp.arange(sched.iterations))
  return io


def _gather(x, axis: str, sched: Schedule):
  """Stage 0 receives every stage's microbatches: [M / S, ...] -> [M, ...] (in stage order;
  meaningful on stage 0)."""
  blocks = [x] + [jax.lax.ppermute(x, axis, [(j, 0)]) for j in range(1, sched.stages)]
  return jnp.concatenate(blocks)


def _scatter(io, axis: str, sched: Schedule):
  """The last stage sends stage j its microbatches j M / S .. (j + 1) M / S - 1."""
  S, n = sched.stages, sched.microbatches // sched.stages
  s = jax.lax.axis_index(axis)
  out = jnp.where(s == S - 1, io[(S - 1) * n:], 0)
  for j in range(S - 1):
    out = out + jax.lax.ppermute(io[j * n:(j + 1) * n], axis, [(S - 1, j)])
  return out


def _per_stage(run, axis: str, sched: Schedule):
  """The body of the shard_map: one stage's params and microbatches in, its outputs out."""
  def body(params, x):
    params = jax.tree.map(lambda a: a[0], params)
    io = jax.tree.map(lambda a: _gather(a[0], axis, sched), x)
    io = _loop(run, params, io, axis, sched)
    return jax.tree.map(lambda a: _scatter(a, axis, sched)[None], io)
  return body


def _check_output(x, y) -> None:
  """A stage must map a microbatch to one of the same structure, shapes and dtypes (the next
  stage's input); checked where the loop traces stage_fn."""
  kind = lambda t: jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", t)
  if jax.tree.structure(y) != jax.tree.structure(x) or any(
      (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b))
      for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(x))):
    raise StepError(
        f"stage_fn maps a microbatch {kind(x)} to {kind(y)}; a stage must return its input's "
        "structure, shapes and dtypes (the next stage's input); fix: return x's kind of "
        "value from stage_fn (cast back to x's dtype).")


def pipeline(stage_fn: Callable, *, microbatches: int, repeats: int = 1,
             remat: bool | Callable = False, axis: str | None = None) -> Callable:
  """Runs `stage_fn` as the stages of a pipeline over the mesh's stage axis.

  Args:
    stage_fn: `stage_fn(stage_params, x) -> x`: one stage (e.g. a `lax.scan` over its
      layers); `stage_params` is one stage's (and repeat's) slice of the params, `x` a
      microbatch (an array or pytree of arrays [rows, ...]); returns x's structure, shapes
      and dtypes. It may use FSDP or tensor-parallel params (the other mesh axes stay with
      XLA's partitioner), `fnscale.constrain_batch`, `fnscale.attention` and its kernels.
    microbatches: M, the pieces the batch is cut into; a multiple of the stage count S. The
      bubble is (S - 1) / (R M + S - 1); the activations kept for the backward pass do not
      grow with M (with `remat`, one microbatch's stage input per iteration).
    repeats: R; with R > 1 each device runs R stages of the model (circular schedule:
      layers (r S + s) K .. on stage s at repeat r, `stage_layers`), and M >= S.
    remat: True: recompute each stage's activations in the backward pass
      (`jax.checkpoint`), keeping only its input; a `jax.checkpoint_policies` policy to
      keep some; False: keep what autodiff keeps.
    axis: the mesh axis the stages run over; default the ambient
      `fnscale.axis_conventions`' stage axis ("stage") present in the mesh.

  Returns:
    `fn(params, x) -> y`: params leaves [S, ...] (repeats 1) or [S, R, ...], x leaves
    [B, ...] (B a multiple of M); y has x's structure, shapes and dtypes and equals the
    sequential model (for r: for s: x = stage_fn(params[s, r], x)). Call it under the mesh
    (`fnscale.with_mesh`, or in a step compiled by `fnscale.shard_step`); shard the stage
    dim of the params over the stage axis (logical name "stage", or rule ("layers",
    "stage") for `stage_layers` of a layer stack), and split the batch over the stage axis
    and the data axes (fnscale's batch sharding does): then no row moves except along the
    pipeline. The compiled program's ops carry the name scope `fnscale_pipeline_s{S}_r{R}_m{M}`
    (`schedules_in`, `fnscale.compile_report`).

  Raises:
    MeshError: no ambient mesh, a mesh without the stage axis, a stage axis already manual.
    StepError: microbatches fewer than the stages or not a multiple of them, a batch they
      don't divide, bad ints, a stage_fn whose output differs from its input's kind.
    ShardingError: params without the leading [S] (or [S, R]) dims.

  Examples:
    Four layers as 2 stages over 4 microbatches, against the layers run in order:

    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> stage = lambda ws, x: jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]
    >>> rng = np.random.default_rng(0)
    >>> ws, x = rng.normal(size=(4, 8, 8)) / 3, rng.normal(size=(16, 8))  # 4 layers, 16 rows
    >>> with fs.with_mesh(fs.make_mesh({"stage": 2, "data": 4})):
    ...   y = jax.jit(fs.parallel.pipeline(stage, microbatches=4))(
    ...       fs.parallel.stage_layers(ws, stages=2), x)
    >>> bool(jnp.allclose(y, stage(ws, x), atol=1e-5))
    True
  """
  if not callable(stage_fn):
    raise StepError(f"stage_fn is {_tree.got(stage_fn)}, expected stage_fn(params, x) -> x.")
  _tree.check_int(microbatches, "microbatches", StepError, minimum=1)
  _tree.check_int(repeats, "repeats", StepError, minimum=1)
  if not (isinstance(remat, bool) or callable(remat)):
    raise StepError(f"remat is {_tree.got(remat)}, expected a bool or a jax.checkpoint "
                    "policy.")
  if axis is not None and not isinstance(axis, str):
    raise MeshError(f"axis is {_tree.got(axis)}, expected a mesh axis name or None.")

  @functools.wraps(stage_fn)
  def piped(params, x):
    mesh, name = _stage_mesh(axis)
    sched = Schedule(int(mesh.shape[name]), microbatches, repeats)
    _check_schedule(sched, name)
    _check_params(params, sched)
    rows = _check_batch(x, sched)
    lay = _layout(mesh, name, rows, sched)
    explicit = name in getattr(mesh, "explicit_axes", ())
    with jax.named_scope(_SCOPE.format(sched.stages, sched.repeats, sched.microbatches)):
      xs = jax.tree.map(lambda a: _pin(_to_stages(a, lay, sched, name, explicit), mesh, name,
                                       lay), x)
      body = _per_stage(_stage_call(stage_fn, sched, remat), name, sched)
      try:
        ys = jax.shard_map(body, mesh=mesh, in_specs=(P(name), P(name)), out_specs=P(name),
                           axis_names={name}, check_vma=False)(
                               _on_stages(params, name, explicit), xs)
      except (NotImplementedError, ValueError) as e:
        closed = _closure.explicit_closure(e, stage_fn, "stage_fn")
        if closed is None:
          raise
        raise StepError(closed.message(
            f"the pipeline runs stage_fn per stage under jax.shard_map over {name!r}")) from None
      return jax.tree.map(
          lambda a: _from_stages(_pin(a, mesh, name, lay), lay, sched, rows, explicit), ys)

  return piped
