"""The planner's analytic model: what one training step costs on a mesh.

`estimate` turns a `Profile` (what the step needs, read off its traced program by
`fnscale.analysis._trace.profile`) into per-device bytes and step time for one mesh,
following "How to Scale Your Model" (Austin et al., 2025; jax-ml.github.io/scaling-book),
parts 3 "Sharded Matmuls" and 5 "Training":

- FSDP (ZeRO-3, Rajbhandari et al. 2020): per microbatch every device all-gathers the
  compute-dtype weights twice (forward, and again in the backward pass) and reduce-scatters
  the gradients once; an all-gather or reduce-scatter of V bytes over an axis of n devices
  moves V (n-1)/n per device. With accumulation in `train_step`'s accum_gather="once" the
  whole compute-dtype params are gathered once per step and the gradients reduce-scattered
  once, at the memory of whole params and a whole float32 accumulator per device.
- Data parallel: one gradient all-reduce per step, 2 V (n-1)/n per device (Patarasuk &
  Yuan 2009); one per microbatch with accum_gather="per_microbatch" accumulation ("auto",
  the default, reduces once as "once" does where nothing is split over fsdp).
- Tensor parallel (Megatron, Shoeybi et al. 2019): per layer two all-reduces of the
  residual stream forward and two backward (two more forward with remat).
- Context parallel (the sequence split c ways, `fnscale.parallel.context`): every
  device holds 1/c of each row's activations and does 1/c of its work (balanced by the
  zigzag order); attention all-gathers K and V over the axis forward ((c-1)/c of their
  bytes; again in the backward pass with remat) and reduce-scatters their gradients (the
  same bytes), or passes them round a ring, or trades the row's shards for heads by
  all-to-all (Ulysses), as its form moves them (`context_traffic`). Params are split over
  the axis as over "fsdp" (MaxText's "embed" rule, and `recipes/lm/llama.py`'s): their
  gathers and the gradients' reduce-scatter run over the fsdp x context group, whose
  collectives drive both axes' links.
- Axis bandwidth: an axis laid over k torus dimensions uses 2 k links per device on a ring
  with wrap-around, k without (one direction idles at the ends); through a switch (NVSwitch)
  one link's rate; DCN axes the per-chip DCN rate.
- Overlap assumption (written down because it decides the ranking): on TPU and GPU, XLA's
  async collectives and latency-hiding scheduler overlap all communication with compute,
  so step = max(compute, communication) (the scaling book's roofline); on simulated CPU
  devices the same cores copy and compute, so step = compute + communication.
- Bytes per device (`Estimate`): params and optimizer state (split as the params are); the
  backward's gradients of the trained params (not of frozen ones, e.g. a LoRA base) in the
  compute dtype, the float32 accumulator beside them with accumulation; the compute-dtype
  weights in flight (two layers gathered under FSDP, else a whole cast copy of the params
  stored in another dtype than the compute dtype); activations: the residuals
  `jax.vjp` keeps, in the tiles a TPU holds them in on a TPU target (`tiled_nbytes`), and
  under remat the checkpoints plus the share of one recomputed layer XLA keeps
  (`REMAT_LIVE`). Set against XLA's peak by `recipes/bench/memory.py`.
- Memory traffic at HBM bandwidth, added to compute (the vector work that moves it runs
  between the matmuls): `memory_traffic`. It matters where the optimizer update is
  replicated (data parallel), and on CPU, where memory is slow.
- Attention: the score and value matmuls, 4 B T S H Q FLOPs forward per layer (B rows, T
  queries, S keys, H heads of Q dims; twice that backward), counted over the whole score
  matrix as PaLM's MFU does. A kernel (splash, cuDNN, Pallas flash) under a causal mask
  skips the blocks above the diagonal, so the program executes about half of that
  (`CAUSAL_SAVING`; exactly (T+1)/2T of the scores are unmasked, and whole diagonal blocks
  run, so the executed share is slightly above one half); the XLA reference computes it all.
- Matmuls at the device's peak: predicted MFU is therefore an upper bound (the roofline);
  `fnscale.analysis._forecast` adds the efficiency terms it leaves out.
- Pipeline stages (a "stage" axis of S devices, M microbatches, `fnscale.parallel.pipeline`):
  the layer stack (the longest `lax.scan`'s params and FLOPs) is split S ways and runs
  M + S - 1 iterations for M microbatches' work (the bubble, (S-1)/(M+S-1), executes too);
  each iteration sends one microbatch's residual stream to the next stage, plus S - 1 sends
  of M/S microbatches before and after the loop, forward and backward; FSDP gathers a
  stage's weights (and reduce-scatters its gradients) in every iteration. Outside the stack
  the stage axis splits the batch like a data axis (its gradients reduced over it too).
- Mixture of experts (`fnscale.parallel.moe`): a grouped matmul (`ragged_dot`) costs
  2 x routed rows x k x n, so the model's FLOPs are the active params' (traced on one
  device, its rows are exactly the routed copies). On an `expert` axis of e devices the
  expert weights (the forward grouped matmuls' rhs), their optimizer state and gradients
  are split e ways more; the other params are replicated over it, their gradients
  all-reduced over it as over a data axis; each MoE layer all-to-alls its token copies to
  the experts' devices and back, forward and backward (and again under remat), (e-1)/e of
  them leaving the device; and the dropless receive buffers hold the worst case, e x
  min(k, E/e) / k times the routed copies, so the grouped matmuls' activations grow by that
  factor (GShard, Lepikhin et al. 2020; MaxText's dropless buffers).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fnscale import _accumulate
from fnscale.analysis._targets import Hardware
from fnscale.analysis._trace import Profile, profile  # the cost model's input, and its maker
from fnscale.kernels._context_attention import kv_repeats

__all__ = ["CAUSAL_SAVING", "REMAT_LIVE", "Estimate", "Profile", "act_per_row", "axis_bandwidth",
           "buffer_factor", "estimate", "executed_attention_row", "executed_flops_row",
           "memory_traffic", "profile"]

# Share of causal attention's score-matrix FLOPs a kernel skips (see the module docstring).
CAUSAL_SAVING = 0.5


class Estimate(NamedTuple):
  """One candidate's predicted cost. Bytes per device; seconds per step.

  `params`, `opt`, `grads` (with the accumulator), `weights` (gathered compute-dtype weights
  in flight), `acts` (activations): the parts of `bytes`; `compute_s` at peak; `comm_s`:
  axis name -> seconds of its collectives; `step_s` per the overlap assumption; `mfu`:
  model FLOPs / (step x devices x peak), an upper bound; `comm_ratio`: communication /
  compute time; `memory_s`: the memory traffic's seconds (`memory_traffic`), part of
  `compute_s`; `recompute_s`: remat's recomputation at peak, part of `compute_s`; `attn_s`:
  the attention's score and value matmuls (as executed, recomputation included) at peak,
  part of `compute_s`.
  """
  params: float
  opt: float
  grads: float
  weights: float
  acts: float
  compute_s: float
  comm_s: dict
  step_s: float
  mfu: float
  memory_s: float = 0.0
  recompute_s: float = 0.0
  attn_s: float = 0.0

  @property
  def bytes(self) -> float:
    return self.params + self.opt + self.grads + self.weights + self.acts

  @property
  def comm_total_s(self) -> float:
    return sum(self.comm_s.values())

  @property
  def comm_ratio(self) -> float:
    return self.comm_total_s / self.compute_s if self.compute_s else math.inf


def axis_bandwidth(hw: Hardware, ici: dict, dcn: dict) -> dict:
  """Bytes/s per device for a collective on each mesh axis.

  ICI axes are laid on the torus largest first, each taking whole grid dimensions where its
  size allows (as `mesh_utils.create_device_mesh` does); an axis over k dimensions drives 2k
  links with wrap-around, k without. Switched links (NVSwitch, CPU copies): one link's rate.
  DCN axes: the per-chip DCN rate.
  """
  bw = {a: hw.links.dcn for a in dcn}
  if hw.links.switched or not hw.chip_grid:
    return {**bw, **{a: hw.links.ici_link for a in ici}}
  free = sorted((g for g in hw.chip_grid if g > 1), reverse=True)
  for a in sorted(ici, key=ici.get, reverse=True):
    n, dims, whole = ici[a], 0, True
    for g in list(free):
      if n > 1 and n % g == 0:
        free.remove(g)
        n //= g
        dims += 1
    if n > 1:  # part of a dimension: no wrap-around on that ring
      g = next((g for g in free if g % n == 0), None)
      if g is not None:
        free[free.index(g)] = g // n
      dims, whole = dims + 1, False
    bw[a] = max(dims, 1) * hw.links.ici_link * (2 if hw.wrap and whole else 1)
  return bw


def executed_flops_row(prof: Profile, remat: bool) -> tuple[float, float]:
  """(FLOPs per row the program executes, of which remat's recomputation). Model FLOPs
  (`flops_row`, `flops_row_remat` with remat) less what a causal attention kernel skips
  (`CAUSAL_SAVING` of the causal calls' attention, only where a kernel serves them)."""
  def run(r):
    return (prof.flops_row_remat if r else prof.flops_row) - _skipped(prof, r)
  return run(remat), (run(True) - run(False) if remat else 0.0)


def executed_attention_row(prof: Profile, remat: bool) -> float:
  """The attention score and value FLOPs per row the program executes: `attn_row`
  (`attn_row_remat` with remat) less what a causal kernel skips (`executed_flops_row`)."""
  return (prof.attn_row_remat if remat else prof.attn_row) - _skipped(prof, remat)


def _skipped(prof: Profile, remat: bool) -> float:
  attn = prof.attn_row_remat if remat else prof.attn_row
  return attn * prof.causal_share * CAUSAL_SAVING if prof.attn_kernel else 0.0


# The share of one layer's residuals live at the peak of its recomputed backward pass under
# remat: XLA fuses the elementwise ones into the backward's kernels instead of keeping them.
# Fitted on XLA:TPU's peak memory of compiled steps (GPT small and medium at 8-32 rows of
# 1024 tokens, Llama-3.2-1B, on v5e: 0.33-0.53 per program); `recipes/bench/memory.py`
# measures it.
REMAT_LIVE = 0.4


# Under a checkpoint policy that saves part of each layer (`PlanOptions.remat_off`, e.g.
# "dots": the matmul outputs), XLA's peak holds more per row than the traced saved
# residuals: per layer, 4.3 (GPT small), 3.6 (GPT medium) and 4.0 (a 4-layer Llama of width
# 1024) residual-stream carries (the traced residuals hold no layer's input, which the
# backward recomputes from), compiled for v5e at 4-64 rows of 1024 tokens
# (recipes/bench/memory.py --remat_policy=dots); fewer (1.1, 2.6) where XLA rematerialises to
# fit (recipes/lm's 766M and 1B Llamas at seq 2048). 4.5, so that a step the estimate keeps
# fits. (It was 2 whole layers' residuals: up to 1.6x XLA's peak on a Llama.)
STREAM_LIVE = 4.5


def act_per_row(prof: Profile, remat: bool, tensor: int) -> tuple[float, float]:
  """(live activation bytes, activation bytes written and read) per row of a microbatch on
  one device of a `tensor`-way tensor-parallel group: residuals shaped like the residual
  stream are replicated over the group, the rest split. Without remat both are the
  residuals. With remat the live ones are the checkpoints and, at the peak, the larger of
  the head's residuals (its backward runs first) and the `REMAT_LIVE` share of one layer's
  recomputed ones (each layer's backward); the traffic is the checkpoints' plus every
  residual's again (`memory_traffic`). Where remat off runs a checkpoint policy, the live
  bytes are what it keeps and `STREAM_LIVE` carries a layer, the traffic every residual's
  (`Profile.act_row_moved`)."""
  split = lambda total, stream: stream + (total - stream) / tensor
  full = split(prof.act_row, prof.act_row_stream)
  share = full / prof.act_row if prof.act_row else 1.0  # the head and a layer split alike
  moved = prof.act_row_moved * share or full
  if not remat:
    carries = STREAM_LIVE * prof.layers * prof.stream_row if prof.remat_off is not False else 0
    return full + carries, moved
  kept = split(prof.act_row_remat, prof.act_row_remat_stream)
  layer = prof.act_row_layer * share or full / max(prof.layers, 1)
  head = prof.act_row_head * share
  return kept - head + max(head, REMAT_LIVE * layer), kept + moved


def memory_traffic(prof: Profile, remat: bool, rows_mb: float, accum_steps: int,
                   shard: int, tensor: int = 1) -> float:
  """Bytes one device moves through HBM per step outside its matmuls.

  The optimizer update reads the trained params (not frozen ones), gradients and optimizer
  state and writes params and state once per step (the device's 1/`shard`), and reads again
  what its reductions reduce (`Profile.update_reduced_bytes`: the global-norm clip's
  gradients, Adafactor's statistics and RMS clip). Activations, per
  row of each of `accum_steps` microbatches of `rows_mb` rows: without remat, the forward pass
  writes the residuals and the backward reads them (2 x `act_row`). Remat keeps only the
  checkpoints between blocks (written and read: 2 x `act_row_remat`), but recomputation
  writes the same intermediates again and the backward reads them (2 x `act_row` more):
  remat never moves fewer bytes. `rows_mb` counts the rows of the device's tensor-parallel
  group (`act_per_row`).
  """
  update = (2 * prof.trained_bytes + prof.grad_bytes + 2 * prof.opt_bytes
            + prof.update_reduced_bytes) / shard
  return update + 2 * act_per_row(prof, remat, tensor)[1] * rows_mb * accum_steps


class _Stages(NamedTuple):
  """A candidate's pipeline as the estimate costs it: `stages` S (1: none), `microbatches`
  M, `bytes_share` / `flops_share` of the params / FLOPs in the layer stack (0 without
  stages), `iters` (M + S - 1) / M (the loop's iterations per microbatch's work)."""
  stages: int
  microbatches: int
  bytes_share: float
  flops_share: float
  iters: float

  def keep(self, nbytes: float) -> float:
    """Of a param-shaped tree's bytes, those one stage holds (the stack split S ways)."""
    return nbytes * (1 - self.bytes_share + self.bytes_share / self.stages)


def _stages(prof: Profile, ici: dict, dcn: dict, microbatches: int) -> _Stages:
  s = ici.get("stage", 1) * dcn.get("stage", 1)
  if s == 1:
    return _Stages(1, 1, 0.0, 0.0, 1.0)
  return _Stages(s, microbatches, prof.stack_bytes / prof.compute_bytes if prof.compute_bytes
                 else 0.0, prof.stack_flops_row / prof.flops_row if prof.flops_row else 0.0,
                 (microbatches + s - 1) / microbatches)


def _stage_comm(prof: Profile, pp: _Stages, rows_mb: float, f: int, t: int) -> tuple:
  """Bytes per device per step of a pipeline: (the stage axis's sends, FSDP's gathers and
  reduce-scatters, the stack's in every iteration and the rest once). `rows_mb`: a
  device's rows outside the pipeline (the stage axis splits the batch there)."""
  s, m = pp.stages, pp.microbatches
  one = rows_mb * s / m * prof.stack_stream_row  # one microbatch of a device's stream
  sends = 2 * (m + s - 1 + 2 * (s - 1) * m / s) * one
  stack_c, stack_g = prof.compute_bytes * pp.bytes_share, prof.grad_bytes * pp.bytes_share
  gathers = ((m + s - 1) * (2 * stack_c + stack_g) / s
             + 2 * (prof.compute_bytes - stack_c) + prof.grad_bytes - stack_g)
  return sends, (f - 1) / f * gathers / t


def buffer_factor(prof: Profile, e: int) -> float:
  """How many times the routed copies a dropless layer's receive buffer holds on an expert
  axis of `e` devices: e x min(k, experts / e) / k (1 without experts or axis)."""
  if e <= 1 or not prof.experts or not prof.expert_k:
    return 1.0
  return e * min(prof.expert_k, prof.experts / e) / prof.expert_k


def _split(prof: Profile, shard: int, e: int) -> float:
  """Per-device share of the params' bytes (or state, gradients): the expert weights split
  over `shard` x `e` devices, the rest over `shard`."""
  x = prof.expert_share
  return (1 - x) / shard + x / (shard * e)


def estimate(prof: Profile, hw: Hardware, ici: dict, dcn: dict, remat: bool,
             accum_steps: int, gather: str = "auto", microbatches: int = 1,
             context: str = "all_gather") -> Estimate:
  """Per-device bytes and step time of one candidate (see the module docstring for the
  formulas and the overlap assumption). `ici`/`dcn`: axis -> size ("data", "fsdp",
  "tensor", "stage", "expert", "context"; "replica" or "stage" across slices); the global
  batch must divide over the data axes (the expert and stage axes among them) and `accum_steps`.
  `gather`: `train_step`'s accum_gather, costed as it compiles: "auto" is "once" where
  nothing is split over fsdp or context, or where whole compute-dtype params and a whole
  accumulator take at most `fnscale._accumulate.ONCE_SHARE` of the device's memory (not on CPU,
  whose memory the step doesn't know), else "per_microbatch"; "per_microbatch" keeps
  params and the float32 accumulator sharded and gathers / reduce-scatters over fsdp in
  every microbatch, and reduces over the data and DCN axes in every microbatch too (the
  accumulator is sharded as the params, so whole over those axes); "once" (with accum_steps > 1)
  holds whole compute-dtype params and a whole float32 accumulator (split by tensor only),
  gathers and reduces once per step. `microbatches`: the pipeline's, with a "stage" axis
  (accum_steps 1). A context axis splits each row's activations and work, and the params with
  fsdp (one group); `context`: its attention form (`context_traffic`)."""
  d, f, t, c = (ici.get(a, 1) for a in ("data", "fsdp", "tensor", "context"))
  e = ici.get("expert", 1)
  whole = (prof.compute_bytes + prof.grad_bytes) / t  # "once"'s whole params and accumulator
  auto_once = f * c == 1 or (hw.kind != "cpu" and whole <= _accumulate.ONCE_SHARE * hw.memory_limit)
  once = accum_steps > 1 and (gather == "once" or gather == "auto" and auto_once)
  r = math.prod(dcn.values()) if dcn else 1
  pp = _stages(prof, ici, dcn, microbatches)
  n = hw.num_devices
  shard = f * c * t  # params split over the fsdp x context group and tensor
  # This device's share of params, state and gradients: the expert weights split over the
  # expert axis too, the layer stack over the pipeline stages.
  share = pp.keep(_split(prof, shard, e))
  rows_mb = prof.rows / (r * d * f * e * ici.get("stage", 1)) / accum_steps
  rows_act = rows_mb / c  # a row's activations and work are split over context
  moe_acts = prof.expert_act_row * (buffer_factor(prof, e) - 1) * rows_act * pp.iters
  layer_w = prof.compute_bytes * _split(prof, shard, e) * shard / max(prof.layers, 1) / t
  io = 2 * prof.stack_stream_row * rows_act * pp.stages if pp.stages > 1 else 0.0  # stage 0's
  # The backward's gradients (of the trained params only) are in the compute dtype (the cast
  # to the params' dtype fuses into the update), beside a float32 accumulator with
  # accumulation; without FSDP the weights stored in another dtype are cast whole.
  parts = dict(params=prof.param_bytes * share, opt=prof.opt_bytes * share,
               grads=(prof.trained_compute_bytes + (prof.grad_bytes if accum_steps > 1 else 0.0))
               * share,
               weights=2 * layer_w if f * c > 1 else prof.cast_bytes * share * shard / t,
               acts=act_per_row(prof, remat, t)[0] * rows_act * pp.iters + moe_acts + io)
  if once and f * c > 1:  # the whole accumulator beside the reduced shard; whole params
    parts.update(grads=prof.grad_bytes * share * shard / t + prof.grad_bytes * share,
                 weights=prof.compute_bytes * share * shard / t)
  model_flops = prof.flops_row * prof.rows
  memory = memory_traffic(prof, remat, rows_act * pp.iters, accum_steps, 1 / share, t) / hw.links.hbm
  bubble = 1 - pp.flops_share + pp.flops_share * pp.iters
  run, recompute = (x * bubble * prof.rows / n / hw.peak_flops
                    for x in executed_flops_row(prof, remat))
  compute = run + memory
  bw = axis_bandwidth(hw, {k: v for k, v in ici.items() if v > 1}, dcn)
  comm = _comm(prof, bw, (d, f, t, e, c), dcn, (remat, accum_steps, once, rows_mb), pp, context)
  total = sum(comm.values())
  step = max(compute, total) if hw.overlap else compute + total
  return Estimate(**parts, compute_s=compute, comm_s=comm, step_s=step,
                  mfu=model_flops / (step * n * hw.peak_flops) if step else 0.0,
                  memory_s=memory, recompute_s=recompute,
                  attn_s=executed_attention_row(prof, remat) * bubble * prof.rows / n
                  / hw.peak_flops)


def _comm(prof: Profile, bw: dict, sizes: tuple, dcn: dict, run: tuple, pp: _Stages,
          form: str = "all_gather") -> dict:
  """Seconds of each axis's collectives per step (`estimate`'s). `sizes`: (data, fsdp,
  tensor, expert, context); `run`: (remat, accum_steps, once, rows per device per microbatch);
  `pp`: the pipeline (`_stages`). Params' collectives over fsdp and context are one group,
  named "fsdp+context" when both split them ("context", with the K/V traffic, when only it
  does)."""
  (d, f, t, e, c), (remat, accum_steps, once, rows_mb) = sizes, run
  reductions = 1 if once else accum_steps
  frac = lambda k: (k - 1) / k
  split = _split(prof, f * c * t, e)
  share = pp.keep(split)
  rows_act = rows_mb / c * pp.iters  # tokens of a device's rows, per microbatch's work
  comm = {}
  group = [a for a, n in (("fsdp", f), ("context", c)) if n > 1]
  if group:  # a collective over both axes drives both axes' links
    per_step = prof.compute_bytes + prof.grad_bytes if once else accum_steps * (
        2 * prof.compute_bytes + prof.grad_bytes)
    comm["+".join(group)] = frac(f * c) * per_step * split * f * c / sum(bw[a] for a in group)
  if pp.stages > 1:  # the stack's FSDP gathers run in every iteration
    sends, gathers = _stage_comm(prof, pp, rows_mb / c, f * c, t)
    if group:
      comm["+".join(group)] = gathers / sum(bw[a] for a in group)
    # Outside the stack the stage axis is a data axis: its gradients are reduced over it.
    rest = 2 * frac(pp.stages) * prof.grad_bytes * (1 - pp.bytes_share) / (f * c * t)
    comm["stage"] = (sends + rest) / bw["stage"]
  if d > 1:
    comm["data"] = reductions * 2 * frac(d) * prof.grad_bytes * share / bw["data"]
  if t > 1:
    per_layer = (6 if remat else 4) * 2 * frac(t) * prof.stream_row * rows_act
    comm["tensor"] = accum_steps * prof.layers * per_layer / bw["tensor"]
  if e > 1:  # the other params' gradients all-reduced; each layer's copies to and fro
    rest = pp.keep((1 - prof.expert_share) / (f * c * t))
    passes = 6 if remat else 4  # dispatch + combine, forward, backward (and recomputed)
    comm["expert"] = (reductions * 2 * frac(e) * prof.grad_bytes * rest + accum_steps * passes
                      * frac(e) * prof.exchange_row * rows_act) / bw["expert"]
  if c > 1:  # attention's traffic over the axis, as its form moves it
    comm["context"] = comm.get("context", 0.0) + (
        context_traffic(prof, form, c, t, remat) * rows_mb * pp.iters * accum_steps
        / bw["context"])
  for a, k in dcn.items():
    if k > 1 and a != "stage":
      comm[a] = reductions * 2 * frac(k) * prof.grad_bytes * share / bw[a]
  return comm


def context_traffic(prof: Profile, form: str, c: int, t: int, remat: bool) -> float:
  """Bytes one device sends over a context axis of c for one row's attention per step (its
  tensor axis of t splitting the heads), as `fnscale.analysis.hlo` counts them (ring
  algorithms; a permute its result), K/V bytes `kv_row`, query bytes `q_row`:

  - "all_gather": K/V gathered forward (again with remat), their gradients reduce-scattered:
    (c-1)/c x kv_row each.
  - "ring": c-1 permutes of a K/V block (kv_row / c) forward (again with remat) and
    backward, and c of its float32 dK/dV accumulator.
  - "ulysses": per pass four all-to-alls of this device's shards (1/c of the row): q, the
    output, K and V with their heads repeated to a multiple of c
    (`fnscale.kernels._context_attention.kv_repeats`); forward, backward (the cotangents),
    again with remat.
  """
  frac, passes = (c - 1) / c, (3 if remat else 2)
  if form == "ring":
    f32 = 4 * prof.params / prof.compute_bytes if prof.compute_bytes else 1.0
    return (passes * frac + f32) * prof.kv_row / t
  if form == "ulysses":  # heads that don't divide over tensor aren't split by it
    t = t if prof.heads % t == 0 and prof.kv_heads % t == 0 else 1
    r = kv_repeats(max(prof.kv_heads // t, 1), c)
    return passes * frac * (2 * prof.q_row + r * prof.kv_row) / c / t
  return passes * frac * prof.kv_row / t
