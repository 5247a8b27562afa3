"""The planner's forecast for Mixtral 8x7B beside MaxText's published MFU.

  python recipes/bench/moe_forecast.py          # the table (traces Mixtral-8x7B, ~1 min)
  python recipes/bench/moe_forecast.py --json=out.json

MaxText publishes three Mixtral 8x7B runs; each is described here as MaxText's configuration
for it, and fnscale traces its own Mixtral (`recipes/lm/moe.py`, the same shapes: 32 layers,
d 4096, 8 experts of width 14336, 2 per token) and forecasts it with
`fnscale.analysis.plan.predict` (the roofline plus the efficiency terms fitted on MaxText's
dense v5p table, `recipes/bench/forecast_fit.py`; no term was fitted on a mixture of
experts). MFU counts 6 x the active matmul weights (the two routed experts, the router, the
unembedding) plus all of the attention per token, as MaxText's tables of 2024-2025 do.

Sources (github.com/AI-Hypercomputer): MaxText's `tests/end_to_end/tpu/mixtral/
Run_Mixtral.md` (v5p-128, 54.89%, July 2024: dropless megablox, the configuration of
tpu-recipes' `training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh` at its first
commit: per_device_batch_size 36, max_target_length 4096, bfloat16 weights and compute,
FSDP over the slice, remat "full", flash attention); MaxText's `docs/reference/models/
tiering.md` at e591f30cb (v5p 8x4x4 = v5p-256, 52.56%, the same recipe; v6e-256, 35.23%:
`benchmarks/maxtext_trillium_model_configs.py` "mixtral_8x7b_dropped": per_device_batch_size
12, 4096 tokens, FSDP over 256 chips, capacity_factor 1.25, remat "custom" with the
projections offloaded to the host, costed here as full remat).
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from fnscale.analysis.plan import hardware, mesh_str, predict, profile_model
from recipes.lm import moe
from recipes.lm import cli

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads

POLICY = "params=bfloat16,compute=bfloat16,output=float32"  # weight_dtype=bfloat16


class Run(NamedTuple):
  """One published run: `batch` per chip x `seq` tokens, FSDP over the slice, `remat`,
  `capacity_factor` (None: dropless), published `mfu` (percent) and where it comes from."""
  target: str
  batch: int
  seq: int
  remat: bool
  capacity_factor: float | None
  mfu: float
  source: str


RUNS = (
    Run("v5p-128", 36, 4096, True, None, 54.89, "Run_Mixtral.md (2024), dropless megablox"),
    Run("v5p-256", 36, 4096, True, None, 52.56, "tiering.md, dropless megablox"),
    Run("v6e-256", 12, 4096, True, 1.25, 35.23, "tiering.md, mixtral_8x7b_dropped (~full remat)"),
)


@functools.lru_cache(maxsize=None)
def _profile(generation: str, seq: int, capacity_factor: float | None):
  """Mixtral-8x7B traced on one device of the generation (one row, bfloat16 weights)."""
  cfg = moe.model_config("moe-mixtral-8x7b", seq, capacity_factor=capacity_factor)
  init = lambda key: jax.tree.map(lambda x: x.astype(jnp.bfloat16), moe.init_params(cfg, key))
  rows = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  loss = functools.partial(moe.loss_fn, cfg=cfg)  # keeps its `remat` keyword
  return profile_model(init, loss, optax.adamw(1e-4), {"inputs": rows, "targets": rows},
                       f"{generation}-8", policy=POLICY), cfg


def forecast(run: Run) -> dict:
  """The forecast of one run (nothing compiles)."""
  hw = hardware(run.target)
  prof, cfg = _profile(hw.generation, run.seq, run.capacity_factor)
  prof = prof._replace(rows=run.batch * hw.chips)
  axes = fs.MeshAxes({"fsdp": hw.devices_per_slice}, {})
  cand = predict(prof, run.target, axes, remat=run.remat)
  per_token = moe.flops_per_token(cfg)
  mfu = 100 * per_token * cand.tokens_s / (hw.num_devices * hw.peak_flops)
  return dict(target=run.target, batch=run.batch, seq=run.seq, mesh=mesh_str(axes),
              remat=run.remat, capacity_factor=run.capacity_factor, published_mfu=run.mfu,
              forecast_mfu=mfu, error=mfu - run.mfu, roofline_mfu=100 * cand.bound_mfu,
              fits=cand.fits, gib_per_device=cand.estimate.bytes / 2**30,
              tokens_s_chip=cand.tokens_s / hw.chips, source=run.source,
              traced_flops_token=prof.flops_row / prof.tokens_row, model_flops_token=per_token)


def table(rows: list[dict]) -> str:
  lines = ["| target | batch/chip x seq | mesh | remat | capacity | published MFU | forecast "
           "MFU | error | roofline | GiB/chip | tokens/s/chip |", "|" + "---|" * 11]
  for r in rows:
    lines.append(
        f"| {r['target']} | {r['batch']} x {r['seq']} | {r['mesh']} | "
        f"{'full' if r['remat'] else 'off'} | {r['capacity_factor'] or 'dropless'} | "
        f"{r['published_mfu']:.2f}% | {r['forecast_mfu']:.2f}% | {r['error']:+.2f} | "
        f"{r['roofline_mfu']:.1f}% | {r['gib_per_device']:.1f} | {r['tokens_s_chip']:,.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", default=None, help="write the rows here")
  a = ap.parse_args(argv)
  fs.topology.quiet_libtpu()
  rows = [forecast(r) for r in RUNS]
  print(table(rows))
  print(f"\nmodel FLOPs/token (6 x active + attention): {rows[0]['model_flops_token']:.4g}; "
        f"traced (dropless): {rows[0]['traced_flops_token']:.4g}")
  if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
