"""The planner's forecast: the roofline of `fnscale.analysis._cost` plus what the bound leaves out.

The roofline runs every matmul at peak and hides every collective behind compute, so its MFU
is an upper bound (93% for Llama-3-8B on v5p-128, where MaxText measures about 70%). The
forecast adds three named efficiency terms (`Terms`):

- `matmul`: the fraction of peak FLOP/s the step's matmuls (attention kernels included)
  sustain.
- `exposed`: the fraction of the ICI collectives' time (`fnscale.analysis._cost.estimate`'s FSDP
  gathers and reduce-scatters, data-parallel all-reduce, tensor-parallel all-reduces) that
  compute does not hide. Remat's recomputation needs no collective, so it runs while the
  backward pass waits on one: the step pays max(exposed communication, recomputation), never
  less than without remat.
- `per_doubling`: the step time each doubling of the slice count adds (cross-slice
  synchronisation: the DCN all-reduce at the end of the step and the slowest slice setting
  the pace). Measured runs lose a similar share going from one slice to two whatever their
  DCN bytes, so the bytes stay in the bound and this term carries the loss.
- `memory`: a multiplier on the memory traffic's seconds (1 on pods: at the HBM bandwidth).

step = max(bound, ((first pass + narrow) / matmul + memory x traffic
                   + max(exposed x ICI, recompute / matmul)) x (1 + per_doubling x log2(slices)))

where the first pass is the executed FLOPs without remat at peak and traffic the bound's
memory traffic (`fnscale.analysis._cost.memory_traffic`, the optimizer update's passes
included), and `narrow` what heads narrower than a TPU's matrix unit add to the attention
(`narrow_heads`): both counted, not fitted. The pod terms were fitted on MaxText's published
v5p measurements only (`FITTED`; `python recipes/bench/forecast_fit.py` refits them and
checks the forecast against MaxText's v5e, v6e, v4 and GPU tables, which the fit never
sees). A one-device target of a generation measured on one chip uses that chip's fit
(`CHIP`, `terms_for`; `CHIP_UNROLLED` for a step whose layer loop is unrolled). On
simulated CPU devices the cost model's rates are measured on the host, so the forecast is
the bound.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fnscale.analysis import _cost
from fnscale.analysis._targets import Hardware


class Terms(NamedTuple):
  """Efficiency terms of the forecast (see the module docstring). `matmul` in (0, 1];
  `exposed` >= 0 (a fraction of the ICI collectives' seconds); `per_doubling` >= 0 (a
  fraction of the step per doubling of slices); `memory` >= 0: the memory traffic's
  seconds are multiplied by it (1: at the HBM bandwidth).

  Examples:
    The fitted terms (`fnscale.analysis.FORECAST_TERMS`), and a forecast with others:

    >>> import fnscale as fs
    >>> terms = fs.analysis.FORECAST_TERMS
    >>> type(terms) is fs.analysis.ForecastTerms, 0 < terms.matmul <= 1, terms.exposed >= 0
    (True, True, True)
    >>> slower = terms._replace(matmul=terms.matmul / 2)  # pass as predict(..., terms=slower)
  """
  matmul: float
  exposed: float
  per_doubling: float
  memory: float = 1.0


# Fitted by `python recipes/bench/forecast_fit.py`: the largest |forecast - published| MFU over the
# 16 runs of MaxText's v5p table (MaxText/configs/v5p/README.md, with the model shapes, meshes
# and remat of its configs at the table's commit) is 4.99 points, rms 3.5.
FITTED = Terms(matmul=0.7182, exposed=0.2033, per_doubling=0.0578)

# One chip of a generation, measured: fitted by `python recipes/bench/forecast_fit.py --chip`
# on the steps `recipes/bench/chip.py` timed on that chip (recipes/bench/chip_v5e.json: GPT
# small and medium, the 766M Llama and Llama 3.2 1B's shape under Adafactor, without remat,
# with "dots" and with full remat; a step filling the chip's memory is left out,
# `forecast_fit.CHIP_FULL`). One chip has no collectives, so only `matmul` and `memory` are
# fitted (the others are FITTED's). On v5e the steps are explained by matmuls at 80% of the
# roofline's rate (attention at heads of 64 at half that: `narrow_heads`) and the memory
# traffic, the optimizer update's passes included (`fnscale.analysis._trace.reduced_bytes`),
# at about 60% of the HBM bandwidth (the vector work around the matmuls: norms, activations,
# the attention kernel's softmax). Fitted over the 14 rows measured on jax 0.10.2 of the
# program the planner costs (`forecast_fit.chip_runs`): largest |forecast - measured| 2.9
# points (GPT medium at 12 rows with splash's 1024 tiles and the 766M Llama low, GPT medium
# at 32 rows high); the 2 rows measured after the fit (GPT small at 24 and 40 rows) within
# 1.9. Without the update's reductions and the narrow heads the fit was 4.3 points off,
# the 1B's rows high and the 766M's low; the pods' terms (FITTED) 10-22 points high on the
# GPT rows.
CHIP = {"v5e": Terms(matmul=0.7969, exposed=FITTED.exposed, per_doubling=FITTED.per_doubling,
                     memory=1.6792)}
# The same chip with the layer loop unrolled (no `lax.scan`: no stacked residuals and weights
# sliced and updated each layer, and fusions across layers): the memory traffic runs at
# 1.14x the HBM bandwidth's time instead of 1.68x, the matmul term the scan's. Fitted by
# `python recipes/bench/forecast_fit.py --chip --unrolled` on the 3 unrolled steps measured
# on jax 0.10.2 (GPT small at 32 rows and medium at 12 keeping `dots`, the 766M Llama at 4):
# within 1.5 points of each (the scan's terms: 6-9 points low).
CHIP_UNROLLED = {"v5e": CHIP["v5e"]._replace(memory=1.1375)}


# The side of a TPU's matrix unit (MXU): 128 x 128 on v4, v5e and v5p (v6e's is 256 wide:
# counted as 128 here, as its held-out runs, heads of 128, were checked).
MXU = 128


def narrow_heads(head_dim: int, hw: Hardware) -> float:
  """How many times its time at the matmuls' rate the attention takes for heads of
  `head_dim` on `hw`: each of attention's matmuls contracts over the head dim (q k^T, and
  the backward's dO v^T) or makes head-dim columns (p v, dq, dk, dv), so on a TPU heads
  narrower than the MXU fill head_dim / `MXU` of it (heads of 64: 2); 1 elsewhere or where
  the head dim is unknown (0). Examples: `narrow_heads(64, hardware("v5e-1"))` is 2.0."""
  if hw.kind != "tpu" or not 0 < head_dim < MXU:
    return 1.0
  return MXU / head_dim


def terms_for(hw: Hardware, unrolled: bool = False) -> Terms:
  """The forecast's terms for `hw`: its generation's one-chip fit on one device (`CHIP`, or
  `CHIP_UNROLLED` for a step whose layer loop is unrolled), else `FITTED` (pods: the terms
  carry the communication the one-chip fit never saw; no unrolled pod step was measured)."""
  if hw.num_devices == 1 and hw.generation in CHIP:
    return (CHIP_UNROLLED if unrolled else CHIP)[hw.generation]
  return FITTED


class Forecast(NamedTuple):
  """A candidate's forecast. `step_s`: seconds per step; `tokens_s`: tokens per second of
  the whole job (rows x `Profile.tokens_row` / step); `mfu`: model FLOPs (PaLM's count, no
  remat) / (step x devices x peak)."""
  step_s: float
  tokens_s: float
  mfu: float


def forecast(prof: _cost.Profile, hw: Hardware, est: _cost.Estimate, dcn: dict,
             comm_s: dict | None = None, terms: Terms | None = None) -> Forecast:
  """The forecast for one candidate.

  Args:
    prof, hw, est: the candidate's profile, target and roofline estimate.
    dcn: the candidate's DCN axes (name -> size); their collectives stay in the bound.
    comm_s: axis name -> seconds of collectives to use instead of the estimate's (the
      compiled program's, after verification).
    terms: the efficiency terms (default `terms_for(hw)`).

  Returns:
    A `Forecast`; never faster than the roofline with the same communication.
  """
  terms = terms_for(hw) if terms is None else terms
  comm = est.comm_s if comm_s is None else comm_s
  total = sum(comm.values())
  bound = max(est.compute_s, total) if hw.overlap else est.compute_s + total
  step = bound
  if hw.kind != "cpu":
    ici = sum(s for a, s in comm.items() if a not in dcn)
    narrow = est.attn_s * (narrow_heads(prof.head_dim, hw) - 1)
    first = ((est.compute_s - est.memory_s - est.recompute_s + narrow) / terms.matmul
             + terms.memory * est.memory_s)
    late = max(terms.exposed * ici, est.recompute_s / terms.matmul)
    slices = math.prod(dcn.values()) if dcn else 1
    step = max(bound, (first + late) * (1 + terms.per_doubling * math.log2(slices)))
  model = prof.flops_row * prof.rows
  return Forecast(step, prof.rows * prof.tokens_row / step,
                  model / (step * hw.num_devices * hw.peak_flops))
