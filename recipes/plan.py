"""Plan the mesh, remat and accumulation of a GPT, Llama or MoE model on a target, from here.

  python recipes/plan.py --model=llama-8b --target=v5p-128 --batch=256 --seq=4096
  python recipes/plan.py --model=medium --target=v5litepod-1 --batch=16 --seq=1024
  python recipes/plan.py --model=small --target=v5litepod-1 --batch=32 --seq=1024 --unroll
  python recipes/plan.py --model=llama-8b --target=v5p-128 --tokens=2e12 --verify=0
  python recipes/plan.py --model=llama-1b --target="2x v5p-8" --batch=64 --verify=1
  python recipes/plan.py --model=moe-mixtral-8x7b --target=v5p-128 --batch=2304 --verify=0
  python recipes/plan.py --measure                # CPU: predicted vs measured step-time order

`fnscale.analysis.plan` ranks the candidates by its forecast (step time, tokens/s, MFU beside the
roofline's bound; with `--tokens`, days and chip-hours to train on that many tokens) and
compiles the best `--verify` of them for the target's described devices (TPU targets; libtpu
does this without the hardware; default: 1 where it can, none elsewhere). `--measure` plans for this host's 8 simulated CPU devices with the cost model
calibrated from measured matmul and memory-copy rates, runs every candidate mesh, and
reports the Spearman rank correlation between predicted and measured step times. A row
without remat runs train_lm's `--remat_policy` (auto: "dots" on a TPU or GPU target, whose
residuals it holds, `PlanOptions.remat_off`; none on CPU), as the main job would.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from fnscale.analysis import (Plan, PlanOptions, calibrate_cpu, cannot_verify, mesh_str, plan,
                              plan_summary)
from recipes.lm import cli, gpt, llama, models, optimizers, remat
from recipes.lm.options import REMAT_POLICIES, StepOptions

if "--measure" in sys.argv:  # simulated devices: set before jax's backend starts
  if "JAX_PLATFORMS" not in os.environ:  # read when jax was imported: the config now
    jax.config.update("jax_platforms", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads

POLICY = "params=float32,compute=bfloat16,output=float32"


def _batch(rows: int, seq: int, positions: bool = True) -> dict:
  """Tokens, targets and positions (a mesh that splits the sequence needs positions:
  `fnscale.parallel.context.reorder_batch`; GPT's learned positions take none)."""
  return {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32)
          for k in ("inputs", "targets") + (("positions",) if positions else ())}


def make_plan(model: str, target, rows: int, seq: int, verify: int | None, *,
              optimizer: str = "adamw", mu_dtype: str = "float32",
              remat_policy: str = "auto", **kw) -> Plan:
  """`fnscale.analysis.plan` for a named GPT, Llama or MoE size (`recipes/lm/gpt.py`,
  `llama.py`, `moe.py`: an expert axis joins the candidates for a mixture of experts) and
  train_lm's optimizer (`recipes.lm.optimizers`: adamw or adafactor, AdamW's first moment
  in `mu_dtype`), its rows without remat keeping what train_lm's `remat_policy` keeps (auto:
  its default on the target's platform, "dots" on a TPU: `PlanOptions.remat_off`); `kw`:
  `PlanOptions` fields (policy: POLICY unless given; `unrolled` runs the model's layer loop
  unrolled too) and `overrides` of the model's config (e.g. layers).

  Raises:
    InputError: `unrolled` for a model without an unrolled loop (moe, deepseek)."""
  module = models.MODELS[model]
  if "remat_off" not in kw:
    platform = fs.analysis.hardware(target).kind
    kw["remat_off"] = remat.remat_off(
        module, remat.remat_policy(StepOptions(remat_policy=remat_policy), platform))
  overrides = kw.pop("overrides", {})
  cfg = (module.model_config(model, seq)._replace(**overrides) if module is gpt
         else module.model_config(model, seq, **overrides))
  if kw.get("unrolled"):
    if "unroll" not in cfg._fields:
      raise fs.InputError(f"--unroll: {model} has no unrolled layer loop; fix: a gpt or "
                          "llama model, or leave --unroll out")
    cfg = cfg._replace(unroll=True)
  kw.setdefault("policy", POLICY)
  return plan(lambda k: module.init_params(cfg, k), functools.partial(module.loss_fn, cfg=cfg),
              optimizers.transformation(optimizer, 3e-4, mu_dtype=mu_dtype),
              _batch(rows, seq, positions=module is not gpt), target,
              PlanOptions(rules=module.RULES, logical_axes=module.logical_axes(cfg), verify=verify,
                          **kw))


def spearman(a, b) -> float:
  """Spearman's rank correlation: Pearson's r of the ranks (ties broken by order)."""
  ra, rb = (np.argsort(np.argsort(np.asarray(x))) for x in (a, b))
  return float(np.corrcoef(ra, rb)[0, 1])


def _compiled(cfg, cand, rows: int):
  """(step, state, batch) of the candidate on this host's devices, compiled and warmed up."""
  mesh = fs.make_mesh(cand.axes)
  opt = optax.adamw(3e-4)
  la = llama.logical_axes(cfg)
  state = fs.init_state(lambda k: llama.init_params(cfg, k), opt, mesh=mesh, rules=llama.RULES,
                        logical_axes=la, key=jax.random.key(0))
  loss = functools.partial(llama.loss_fn, remat=cand.remat)
  step = fs.shard_step(fs.train_step(loss, opt, accum_steps=cand.accum_steps), mesh,
                       rules=llama.RULES, logical_axes=la, donate=False)
  data = np.random.default_rng(0).integers(0, cfg.vocab, (rows, cfg.seq + 1), dtype=np.int32)
  batch = fs.global_batch(fs.parallel.context.reorder_batch(
      {"inputs": data[:, :-1], "targets": data[:, 1:]}, mesh), fs.batch_sharding(mesh))
  jax.block_until_ready(step(state, batch))
  return step, state, batch


def measure(rows: int, seq: int, rounds: int, remat: bool) -> dict:
  """Plans for the 8 simulated CPU devices, then times every candidate mesh (remat fixed)
  in `rounds` interleaved rounds (one step of each per round, so load from other jobs on
  the host hits all alike); returns the rates, rows (mesh, predicted s, median measured s)
  and Spearman's rho."""
  rates = calibrate_cpu()
  cfg = llama.model_config("llama-tiny", seq, layers=2)
  p = plan(lambda k: llama.init_params(cfg, k), llama.loss_fn, optax.adamw(3e-4),
           _batch(rows, seq), "cpu",
           PlanOptions(rules=llama.RULES, logical_axes=llama.logical_axes(cfg), verify=0,
                       max_tensor=2, cpu_rates=rates))
  cands = [r for r in p.rows if r.remat == remat]
  built = [_compiled(cfg, c, rows) for c in cands]
  times = [[] for _ in cands]
  for _ in range(rounds):
    for i, (step, state, batch) in enumerate(built):
      t0 = time.perf_counter()
      jax.block_until_ready(step(state, batch))
      times[i].append(time.perf_counter() - t0)
  out = [(mesh_str(c.axes), c.estimate.step_s, statistics.median(t))
         for c, t in zip(cands, times)]
  for mesh, pred, got in out:
    print(f"{mesh:24s} predicted {pred * 1e3:8.2f} ms  measured {got * 1e3:8.2f} ms")
  rho = spearman([o[1] for o in out], [o[2] for o in out])
  return dict(matmul_flops=rates[0], copy_bytes_per_s=rates[1], rows=out, spearman=rho)


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="llama-8b", choices=list(models.MODELS))
  ap.add_argument("--target", default="v5p-128")
  ap.add_argument("--batch", type=cli.number(int, minimum=1), default=256,
                  help="global batch, rows")
  ap.add_argument("--seq", type=cli.number(int, minimum=1), default=4096)
  ap.add_argument("--layers", type=cli.number(int, minimum=1), default=None,
                  help="override the model's depth")
  ap.add_argument("--verify", type=cli.number(int, minimum=0), default=None,
                  help="candidates to compile for the target (default: 1 where its devices "
                       "can be described, else none, and the plan says why)")
  ap.add_argument("--optimizer", default="adamw", choices=optimizers.OPTIMIZERS,
                  help="train_lm's optimizer (recipes/lm/optimizers.py)")
  ap.add_argument("--mu_dtype", default="float32", choices=optimizers.MU_DTYPES,
                  help="AdamW's first-moment dtype")
  ap.add_argument("--tokens", type=cli.number(float, above=0), default=None,
                  help="token budget, e.g. 2e12: days and chip-hours per candidate")
  ap.add_argument("--remat_policy", default="auto", choices=("auto",) + REMAT_POLICIES,
                  help="what the blocks keep in the rows without remat (train_lm's "
                       "--remat_policy; auto: dots on a TPU or GPU, none on CPU)")
  ap.add_argument("--unroll", action="store_true",
                  help="the layer loop unrolled (train_lm's TPU default where remat is off)")
  ap.add_argument("--measure", action="store_true")
  ap.add_argument("--remat", action="store_true", help="--measure: time remat'd candidates")
  ap.add_argument("--steps", type=cli.number(int, minimum=1), default=7,
                  help="--measure: interleaved rounds")
  ap.add_argument("--json", default=None, help="write the result here")
  a = ap.parse_args(argv)
  fs.quiet_libtpu()  # describing the target loads libtpu: no host-lookup warnings
  if a.measure:
    res = measure(a.batch if a.batch != 256 else 16, a.seq if a.seq != 4096 else 64, a.steps,
                  a.remat)
    print(f"CPU rates: matmul {res['matmul_flops'] / 1e9:.1f} GFLOP/s, copy "
          f"{res['copy_bytes_per_s'] / 1e9:.2f} GB/s; Spearman rho {res['spearman']:.3f}")
  else:
    overrides = {"layers": a.layers} if a.layers else {}
    t0 = time.perf_counter()
    verify = a.verify
    if verify is None:  # one compile where the target's devices can be described
      verify = 0 if cannot_verify(a.target) else 1
    p = make_plan(a.model, a.target, a.batch, a.seq, verify, optimizer=a.optimizer,
                  mu_dtype=a.mu_dtype, overrides=overrides, tokens=a.tokens,
                  unrolled=a.unroll, remat_policy=a.remat_policy)
    print(p)
    print(f"planned in {time.perf_counter() - t0:.0f} s")
    res = plan_summary(p)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
