"""Fit the planner's forecast on MaxText's published v5p runs; check it on the other tables.

  python recipes/bench/forecast_fit.py               # fit, then the fit and held-out tables
  python recipes/bench/forecast_fit.py --json=out.json

The planner's forecast adds three efficiency terms to its roofline
(`fnscale.analysis.forecast_terms`). This recipe fits them on the one table they may be fitted
on, MaxText's v5p table, and reports the forecast on published runs the fit never sees:
MaxText's v5e, v4 and A3 (H100) tables and its v6e and v5p model tiering. Each run is
described here as MaxText's configuration at the time of the table: the model shape, per-chip
batch, sequence length, mesh and remat policy; fnscale traces an equivalent model
(`parallel_decoder` for MaxText's 2023 default model, the Llama of `recipes/lm/llama.py` for
the Llama runs) and predicts it with `fnscale.analysis.predict`.

Sources (github.com/AI-Hypercomputer/maxtext): the v5p, v5e and v4 tables and their configs
as of commit 76bd53b0f44caf989c88189afadeb1062f9254f0 (2023-12-15; `MaxText/configs/v5p/
README.md`, `v5e/README.md`, `v4/README.md`, the `*.sh` configs beside them and
`MaxText/configs/base.yml`; the tables are unchanged at e591f30cbbf217ed67ef71263ec0538239f9c3b8,
now under `src/maxtext/configs/tpu/`); the A3 table `MaxText/configs/a3/llama_2_7b/README.md`
and its `*vm.sh` at efb6d9e4a2856198f8272dcbfb7d9c91eda0728e (2024-04-09); the tiering table
`docs/reference/models/tiering.md` at e591f30cb with the configs it links
(`benchmarks/maxtext_trillium_model_configs.py` and `maxtext_v5p_model_configs.py` at
92e59fdf547421f647590087f50fea5729da42d8 and e591f30cb).

Each table counts its MFU's FLOPs its own way, and the comparison uses that count:
MaxText's code of late 2023 / early 2024 (`calculate_training_tflops`, `MaxText/train.py` at
76bd53b0f) counts 6 x all params per token plus half of the attention (causal); the tiering
table's runs (2025) count 6 x the matmul weights (the unembedding, not the lookup table)
plus all of the attention, as fnscale (PaLM) does: their tokens/s times that count over the
peak gives their MFU to 0.1 point.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from fnscale.analysis import (
    FORECAST_TERMS, ForecastTerms, forecast_terms, hardware, mesh_str, predict, profile_model)
from recipes.lm import llama
from recipes.lm import cli, optimizers
from recipes.lm.models import MODELS

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads

POLICY = "params=float32,compute=bfloat16,output=float32"
# The A3 table gives TFLOP/s per GPU; MFU is that over the dense bf16 peak.
H100_PEAK = fs.CHIP_FACTS["H100"].peak_flops


# ------------------------------------------------------------------------------------------
# MaxText's 2023 default model: a decoder with parallel attention and MLP on one RMSNorm,
# a ReLU MLP of two matrices, heads of 256 dims, an output layer tied to the embedding.
# ------------------------------------------------------------------------------------------

class Shape(NamedTuple):
  """A decoder of MaxText's 2023 `base.yml` family (vocabulary 32768)."""
  layers: int
  d_model: int
  heads: int
  d_mlp: int
  head_dim: int = 256
  vocab: int = 32768


def scaled(scale: int) -> Shape:
  """The shape MaxText's `global_parameter_scale` gave its 2023 base model (d 2560, 8 heads of
  256, MLP 8192, 16 layers): each doubling of the scale doubles, in turn, heads and MLP
  width, then d_model, then layers."""
  k = int(math.log2(scale))
  rounds, step = divmod(k, 3)
  wide = 2 ** (rounds + (step > 0))
  return Shape(layers=16 * 2**rounds, d_model=2560 * 2 ** (rounds + (step > 1)),
               heads=8 * wide, d_mlp=8192 * wide)


def parallel_init(shape: Shape, key) -> dict:
  """float32 params, blocks stacked for `lax.scan`."""
  L, D, H, K, F = shape.layers, shape.d_model, shape.heads, shape.head_dim, shape.d_mlp
  ks = jax.random.split(key, 7)
  w = lambda k, s: 0.02 * jax.random.normal(k, s, jnp.float32)
  return {"embed": w(ks[0], (shape.vocab, D)), "final_norm": jnp.ones((D,)),
          "blocks": {"norm": jnp.ones((L, D)), "wq": w(ks[1], (L, D, H, K)),
                     "wk": w(ks[2], (L, D, H, K)), "wv": w(ks[3], (L, D, H, K)),
                     "wo": w(ks[4], (L, H, K, D)), "wi": w(ks[5], (L, D, F)),
                     "wm": w(ks[6], (L, F, D))}}


def parallel_loss(params: dict, batch: dict, *, remat: bool = False):
  """Mean next-token cross-entropy; x + attention(norm(x)) + mlp(norm(x)) per block."""
  def block(x, p):
    h = llama.rms_norm(x, p["norm"])
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, p[n]) for n in ("wq", "wk", "wv"))
    a = fs.attention(llama.rope(q, 1e4), llama.rope(k, 1e4), v, causal=True)
    m = jax.nn.relu(jnp.einsum("bsd,df->bsf", h, p["wi"]))
    return x + jnp.einsum("bshk,hkd->bsd", a, p["wo"]) + jnp.einsum("bsf,fd->bsd", m, p["wm"])
  block = jax.checkpoint(block) if remat else block
  x = params["embed"][batch["inputs"]]
  x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
  x = llama.rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,vd->bsv", x, params["embed"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


# ------------------------------------------------------------------------------------------
# The published runs.
# ------------------------------------------------------------------------------------------

LLAMA2_7B = llama.ModelConfig(32, 4096, 32, 32, 11008, 0, 32000)
LLAMA2_70B = llama.ModelConfig(80, 8192, 64, 8, 28672, 0, 32000)
LLAMA31_8B = llama.ModelConfig(32, 4096, 32, 8, 14336, 0, llama.LLAMA3_VOCAB)
LLAMA31_70B = llama.ModelConfig(80, 8192, 64, 8, 28672, 0, llama.LLAMA3_VOCAB)

# MaxText remat policies as fnscale's two: "minimal" keeps every weight matmul's output
# (`checkpoint_dots_with_no_batch_dims` in 2023), so it recomputes no matmul, as remat off;
# "full" recomputes the block. The partial policies keep some projections (on the host):
# counted as full remat, which overstates their recomputation (marked "~" in the tables).
REMAT = {"minimal": False, "minimal_flash": False, "full": True, "custom": True,
         "save_dot_except_mlpwi": True}


class Run(NamedTuple):
  """One published measurement. `model`: a `Shape` (MaxText's 2023 model) or a Llama
  `ModelConfig`; `target`: fnscale's name for the hardware ("2x v5p-128"); `batch`: MaxText's
  per_device_batch_size (per chip); `tensor`: its ici_tensor_parallelism (the rest of a
  slice is FSDP, slices data parallel); `remat`: its remat_policy; `mfu`: the published MFU,
  percent; `count`: how the table counted FLOPs ("2023" or "2025", module docstring)."""
  table: str
  name: str
  model: object
  target: str
  batch: int
  seq: int
  tensor: int
  remat: str
  mfu: float
  count: str


class Knobs(NamedTuple):
  """A 2023 MaxText run's per_device_batch_size, ici_tensor_parallelism and remat_policy."""
  batch: int
  tensor: int
  remat: str


def _runs(table, name, model, target, knobs: Knobs, mfus) -> list[Run]:
  """The run on 1, 2, 4, ... slices of `target` (seq 2048, 2023 counting), one per MFU."""
  slices = (1, 2, 4, 8, 16, 32)
  return [Run(table, name, model, target if k == 1 else f"{k}x {target}", knobs.batch, 2048,
              knobs.tensor, knobs.remat, m, "2023") for k, m in zip(slices, mfus)]


V5P = "v5p"  # MaxText/configs/v5p/README.md and 32b.sh ... 1024b.sh at 76bd53b0f
FIT_RUNS = (
    _runs(V5P, "32B", scaled(32), "v5p-128", Knobs(8, 4, "minimal"), (71.47, 69.43))
    + _runs(V5P, "64B", scaled(64), "v5p-128", Knobs(4, 4, "minimal"), (70.31, 67.26))
    + _runs(V5P, "128B", scaled(128), "v5p-256", Knobs(2, 8, "minimal"), (68.68, 66.34))
    + _runs(V5P, "128B", scaled(128), "v5p-512", Knobs(2, 8, "minimal"), (68.83, 59.66))
    + _runs(V5P, "256B", scaled(256), "v5p-1024", Knobs(2, 8, "minimal"), (67.09, 62.99))
    + _runs(V5P, "512B", scaled(512), "v5p-1024", Knobs(2, 16, "full"), (63.99, 61.45))
    + _runs(V5P, "1024B", scaled(1024), "v5p-2048", Knobs(2, 16, "full"), (55.35, 51.55))
    + _runs(V5P, "1024B", scaled(1024), "v5p-4096", Knobs(2, 16, "full"), (64.80, 60.83)))

V5E = "v5e"  # MaxText/configs/v5e/README.md and 16b.sh ... 128b.sh at 76bd53b0f
V4 = "v4"  # MaxText/configs/v4/README.md, 22b.sh and 52b.sh at 76bd53b0f
A3 = "A3 H100"  # MaxText/configs/a3/llama_2_7b/README.md and 1vm.sh ... 16vm.sh, efb6d9e4a
TIER = "tiering"  # docs/reference/models/tiering.md (e591f30cb) and the configs it links
HELD_OUT_RUNS = (
    _runs(V5E, "16B", scaled(16), "v5e-256", Knobs(6, 1, "full"),
          (61.10, 59.37, 59.14, 58.27, 56.56, 54.65))
    + _runs(V5E, "32B", scaled(32), "v5e-256", Knobs(4, 1, "full"),
            (66.86, 64.81, 64.10, 63.67, 62.26, 60.40))
    + _runs(V5E, "64B", scaled(64), "v5e-256", Knobs(2, 1, "full"),
            (59.90, 56.66, 55.85, 54.96, 53.29, 50.18))
    + _runs(V5E, "128B", scaled(128), "v5e-256", Knobs(1, 16, "full"),
            (56.06, 55.82, 54.93, 52.93, 50.86, 46.25))
    + _runs(V4, "22B", Shape(48, 6144, 24, 24576), "v4-128", Knobs(16, 1, "full"),
            (56.7, 55.2, 54.3, 53.2))
    + _runs(V4, "52B", Shape(32, 12288, 32, 49152), "v4:4x4x12", Knobs(10, 1, "full"),
            (56.0, 58.9))
    + [Run(A3, "Llama 2 7B", LLAMA2_7B, f"{8 * k}x h100", 4, 4096, 1, "minimal_flash",
           round(100 * tf * 1e12 / H100_PEAK, 2), "2023")
       for k, tf in ((1, 492), (2, 422), (4, 407), (8, 409), (16, 375))]
    + [Run(TIER, "Llama 2 70B", LLAMA2_70B, "v6e-256", 4, 4096, 1, "full", 43.8, "2025"),
       Run(TIER, "Llama 3.1 8B", LLAMA31_8B, "v6e-256", 4, 8192, 1, "custom", 45.46, "2025"),
       Run(TIER, "Llama 3.1 70B", LLAMA31_70B, "v6e-256", 5, 8192, 1, "custom", 50.33,
           "2025"),
       Run(TIER, "Llama 2 70B", LLAMA2_70B, "v5p-1024", 4, 4096, 1, "save_dot_except_mlpwi",
           65.4, "2025")])
# Left out: the tiering's Llama 3.1 405B (FSDP across two v6e slices, which fnscale's meshes
# don't make, and its tokens/s and MFU disagree by 10%) and Mixtral (mixture of experts).


# ------------------------------------------------------------------------------------------
# Forecast of a run, and the fit.
# ------------------------------------------------------------------------------------------

def _model(run: Run):
  if isinstance(run.model, Shape):
    return functools.partial(parallel_init, run.model), parallel_loss
  return functools.partial(llama.init_params, run.model._replace(seq=run.seq)), llama.loss_fn


@functools.lru_cache(maxsize=None)
def _profile(model, seq: int, target: str):
  """The run's model traced for a small target of its generation (the kernels and so the
  profile are the same on every slice of a generation); one row."""
  run = Run("", "", model, target, 1, seq, 1, "full", 0.0, "2025")
  init, loss = _model(run)
  rows = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  return profile_model(init, loss, optax.adamw(1e-4), {"inputs": rows, "targets": rows},
                       target, policy=POLICY)


def _small(hw) -> str:
  return "8x h100" if hw.kind == "gpu" else f"{hw.generation}-8"


def counted_flops_per_token(prof, count: str) -> float:
  """FLOPs per token the table's MaxText counted (module docstring)."""
  if count == "2023":
    return 6.0 * prof.params + prof.attn_row / prof.tokens_row / 2
  return prof.flops_row / prof.tokens_row


class Predicted(NamedTuple):
  """A run's forecast: `mfu` as its table counts (percent), `error` = mfu - published,
  `mfu_palm` fnscale's count, `step_s`, `tokens_s`, `bound` the roofline's MFU (its count)."""
  run: Run
  mfu: float
  error: float
  mfu_palm: float
  step_s: float
  tokens_s: float
  bound: float
  axes: fs.MeshAxes


def run_axes(run: Run, hw) -> fs.MeshAxes:
  """MaxText's mesh for the run: tensor x FSDP (the rest of a slice), data parallel across
  slices (GPU nodes)."""
  fsdp = hw.devices_per_slice // run.tensor
  ici = {k: v for k, v in (("fsdp", fsdp), ("tensor", run.tensor)) if v > 1}
  return fs.MeshAxes(ici, {"replica": hw.num_slices} if hw.num_slices > 1 else {})


def run_profile(run: Run, hw):
  """The run's `fnscale.analysis._cost.Profile`, for its global batch. MaxText's 2023 rules shard the
  residual stream's activations over the tensor axis too (`activation_embed` -> tensor in
  its base.yml), where fnscale's models replicate them: for those runs every activation
  splits over tensor."""
  prof = _profile(run.model, run.seq, _small(hw))._replace(rows=run.batch * hw.chips)
  if isinstance(run.model, Shape):
    prof = prof._replace(act_row_stream=0.0, act_row_remat_stream=0.0)
  return prof


def predict_run(run: Run, terms: ForecastTerms | None = None) -> Predicted:
  """The forecast for one published run (nothing runs; each model is traced once)."""
  hw = hardware(run.target)
  prof = run_profile(run, hw)
  axes = run_axes(run, hw)
  cand = predict(prof, run.target, axes, remat=REMAT[run.remat], accum_steps=1,
                 terms=terms or FORECAST_TERMS)
  per_token = counted_flops_per_token(prof, run.count)
  peak = hw.num_devices * hw.peak_flops
  mfu = 100 * per_token * cand.tokens_s / peak
  bound = 100 * per_token * prof.rows * prof.tokens_row / cand.estimate.step_s / peak
  return Predicted(run, mfu, mfu - run.mfu, 100 * cand.mfu, cand.step_s, cand.tokens_s, bound,
                   axes)


def fit(runs=FIT_RUNS) -> ForecastTerms:
  """Terms minimising the largest |forecast - published| MFU over `runs`: scipy's
  differential evolution (seeded, so the fit repeats) over matmul in [0.3, 1], exposed in
  [0, 3], per_doubling in [0, 0.2], rounded to 4 decimals."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top  # jax depends on scipy
  worst = lambda x: max(abs(predict_run(r, ForecastTerms(*x)).error) for r in runs)
  best = optimize.differential_evolution(worst, [(0.3, 1.0), (0.0, 3.0), (0.0, 0.2)], seed=0,
                                         tol=1e-8, maxiter=400, polish=True)
  return ForecastTerms(*(round(float(v), 4) for v in best.x))


# ------------------------------------------------------------------------------------------
# One chip, measured here: recipes/bench/chip.py's rows (recipes/bench/chip_v5e.json).
# ------------------------------------------------------------------------------------------

CHIP_V5E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chip_v5e.json")
# The models' remat policies the planner's two stand for: "dots" recomputes no matmul (as
# none), "full" the whole block. "qkv" and "qkv_attn" recompute part of a block, which
# neither describes: their rows stay in the data, out of the forecast's check, as do the
# offloading ones, which the planner doesn't cost ("offload_attn" recomputes all but the
# attention: 4.4 points over full's forecast for the 766M at 8 rows; GPT medium at 32 rows,
# bound by the host link, 7 under).
CHIP_REMAT = {"none": False, "dots": False, "full": True}


# The tables measured while a remat policy's saved attention output still ran splash's
# forward kernel again in the backward (fixed 2026-12-06): their "dots" rows timed a program
# with one more attention forward than the planner costs, and stay out of the check.
RERAN_ATTENTION = ("rows", "rows_2026_12_06", "rows_2026_12_06b")


class ChipRun(NamedTuple):
  """One measured row of chip_v5e.json: train_lm's `model` at `batch` x `seq`, its remat
  policy, param and first-moment dtypes, the measured MFU (percent, PaLM's count) and the
  optimizer (`recipes.lm.optimizers`)."""
  case: str
  model: str
  batch: int
  seq: int
  remat: str
  params: str
  mu: str
  mfu: float
  opt: str = "adamw"
  unroll: bool = False


# The memory a program may use on the chip (the runtime's limit there, 15.75 GiB:
# `fnscale.CHIP_FACTS`' measured `hbm_limit`), and the share of it past which XLA's
# rematerialization under memory pressure recomputes work that the forecast counts once: GPT small at 16 rows without remat, 15.60 GiB, measured 29.6%
# MFU against a forecast of 34-36% (jax 0.10.2 and 0.12 trace its residuals differently).
CHIP_HBM_GIB, CHIP_FULL = fs.CHIP_FACTS["v5e"].hbm_limit / 2**30, 0.98


def chip_runs(path: str = CHIP_V5E) -> list[ChipRun]:
  """The rows the forecast is held to, of every day's table: those whose program is the
  one the planner traces and costs (the Llama's loss with fnscale.cross_entropy's default
  chunk, which is 1024 tokens there: the 64-token row measured the old default; a remat
  policy in `CHIP_REMAT`; no int8, accumulation, XLA attention or offloaded optimizer
  state; the layer loop a scan, or unrolled: `unroll`) and leaves XLA room (below
  `CHIP_FULL` of the chip's memory)."""
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  rows = [(k, r if k == "rows" else _flat(r)) for k in sorted(doc) if k.startswith("rows")
          for r in doc[k]]
  return [ChipRun(*(r[k] for k in ChipRun._fields if k in r)) for table, r in rows
          if r["loss_chunk"] in (0, 1024) and r["remat"] in CHIP_REMAT
          and r["hbm_gib"] < CHIP_FULL * CHIP_HBM_GIB and r.get("plain", True)
          and not (r["remat"] == "dots" and table in RERAN_ATTENTION)]


def _flat(row: dict) -> dict:
  """A row as chip.py writes it now (its case's levers, each side's figures) in the first
  table's fields: fnscale's side, MFU in percent, and whether it is a plain step."""
  lev, side = {"opt": "adamw", "accum": 1, **row["levers"]}, row["fnscale"]  # older rows
  plain = not (lev["int8"] or lev["accum"] > 1 or lev["xla"] or lev["blocks"]
               or lev.get("attn") == "xla"  # the planner costs splash's attention on a TPU
               or lev.get("offload"))  # and no transfers to the host's memory
  return {**{k: lev[k] for k in ("model", "batch", "seq", "remat", "params", "mu", "opt",
                                 "loss_chunk")},
          "case": row["case"], "mfu": 100 * side["mfu"], "hbm_gib": side["hbm_gib"],
          "plain": plain, "unroll": bool(lev["unroll"])}


@functools.lru_cache(maxsize=None)
def _chip_profile(model: str, seq: int, params: str, mu: str, opt: str = "adamw"):
  module = MODELS[model]
  cfg = module.model_config(model, seq)
  rows = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  return profile_model(functools.partial(module.init_params, cfg),
                       functools.partial(module.loss_fn, cfg=cfg),
                       optimizers.transformation(opt, 1e-4, mu_dtype=mu),
                       {"inputs": rows, "targets": rows}, "v5e:1x1",
                       policy=f"params={params},compute=bfloat16,output=float32")


def predict_chip(run: ChipRun, terms: ForecastTerms | None = None) -> float:
  """The forecast MFU (percent, PaLM's count) of a measured one-chip row; `terms` default:
  the planner's for one v5e chip and the row's layer loop (`forecast_terms(unrolled=...)`)."""
  terms = terms or forecast_terms("v5e-1", unrolled=run.unroll)
  prof = _chip_profile(run.model, run.seq, run.params, run.mu, run.opt)._replace(
      rows=run.batch)
  cand = predict(prof, "v5e:1x1", fs.MeshAxes({"fsdp": 1}, {}), remat=CHIP_REMAT[run.remat],
                 terms=terms)
  return 100 * cand.forecast.mfu


def fit_chip(runs=None, unrolled: bool = False) -> ForecastTerms:
  """`matmul` in [0.3, 1] and `memory` in [0, 10] minimising the largest |forecast -
  measured| MFU over the one-chip rows of scanned layer loops (differential evolution,
  seeded); the communication terms stay FITTED's (one chip has none). `unrolled`: `memory`
  alone over the unrolled rows, `matmul` the planner's (the same matmuls, fewer copies)."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top  # jax depends on scipy
  runs = [r for r in (chip_runs() if runs is None else runs) if r.unroll == unrolled]
  matmul = forecast_terms("v5e-1").matmul
  terms = lambda x: ForecastTerms(matmul if unrolled else x[0], FORECAST_TERMS.exposed,
                                  FORECAST_TERMS.per_doubling, x[-1])
  worst = lambda x: max(abs(predict_chip(r, terms(x)) - r.mfu) for r in runs)
  bounds = [(0.0, 10.0)] if unrolled else [(0.3, 1.0), (0.0, 10.0)]
  best = optimize.differential_evolution(worst, bounds, seed=0, tol=1e-8, maxiter=400,
                                         polish=True)
  return terms([round(float(v), 4) for v in best.x])


def _chip_table(terms: ForecastTerms, unrolled: bool = False) -> str:
  lines = ["| case | measured MFU | forecast MFU | error |", "|---|---|---|---|"]
  for r in (r for r in chip_runs() if r.unroll == unrolled):
    got = predict_chip(r, terms)
    lines.append(f"| {r.case} | {r.mfu:.1f}% | {got:.1f}% | {got - r.mfu:+.1f} |")
  return "\n".join(lines)


def _table(preds, title: str) -> str:
  head = ("| table | model | target | batch/chip x seq | mesh | remat | published MFU | "
          "forecast MFU | error | roofline | forecast tokens/s/chip |")
  lines = [f"**{title}**", "", head, "|" + "---|" * 11]
  for p in preds:
    r = p.run
    remat = r.remat + ("" if r.remat in ("minimal", "minimal_flash", "full") else " (~full)")
    lines.append(
        f"| {r.table} | {r.name} | {r.target} | {r.batch} x {r.seq} | "
        f"{mesh_str(p.axes).replace(' | ', ', DCN ')} | {remat} | {r.mfu:.2f}% | {p.mfu:.2f}% | "
        f"{p.error:+.2f} | {p.bound:.1f}% | {p.tokens_s / _chips(r):,.0f} |")
  errs = np.array([p.error for p in preds])
  lines += ["", f"max |error| {np.abs(errs).max():.2f} points, rms {np.sqrt((errs**2).mean()):.2f}"
            f", {np.mean(np.abs(errs) <= 8):.0%} within 8 points ({len(errs)} runs)"]
  return "\n".join(lines)


def _chips(run: Run) -> int:
  return hardware(run.target).chips


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", default=None, help="write the fit and every prediction here")
  ap.add_argument("--nofit", action="store_true",
                  help="use the planner's terms (fnscale.analysis.forecast_terms)")
  ap.add_argument("--chip", action="store_true", help="fit the one-v5e-chip terms on "
                  "recipes/bench/chip_v5e.json instead")
  ap.add_argument("--unrolled", action="store_true",
                  help="with --chip: the unrolled layer loops' memory term")
  a = ap.parse_args(argv)
  fs.quiet_libtpu()  # TPU profiles load libtpu: no host-lookup warnings
  if a.chip:
    chip = forecast_terms("v5e-1", unrolled=a.unrolled)
    terms = chip if a.nofit else fit_chip(unrolled=a.unrolled)
    print(f"one v5e chip: {terms} (in fnscale/analysis/_forecast.py: {chip})\n")
    print(_chip_table(terms, a.unrolled))
    return 0
  terms = FORECAST_TERMS if a.nofit else fit()
  print(f"terms: {terms} (in fnscale/analysis/_forecast.py: {FORECAST_TERMS})\n")
  fitted = [predict_run(r, terms) for r in FIT_RUNS]
  held = [predict_run(r, terms) for r in HELD_OUT_RUNS]
  print(_table(fitted, "Fit: MaxText's v5p table"), "\n")
  print(_table(held, "Held out: MaxText's v5e, v4, A3 (H100) and tiering tables"))
  for table in (V5E, V4, A3, TIER):
    errs = [abs(p.error) for p in held if p.run.table == table]
    print(f"{table}: max |error| {max(errs):.2f}, within 8 points {sum(e <= 8 for e in errs)}"
          f"/{len(errs)}")
  if a.json:
    rows = [dict(table=p.run.table, model=p.run.name, target=p.run.target,
                 batch=p.run.batch, seq=p.run.seq, tensor=p.run.tensor, remat=p.run.remat,
                 count=p.run.count, published_mfu=p.run.mfu, forecast_mfu=p.mfu,
                 error=p.error, forecast_mfu_palm=p.mfu_palm, roofline_mfu=p.bound,
                 step_s=p.step_s, tokens_s=p.tokens_s, fit=p in fitted)
            for p in fitted + held]
    with open(a.json, "w") as f:
      json.dump(dict(terms=terms._asdict(), rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
