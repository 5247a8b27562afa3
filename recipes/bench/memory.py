"""The memory pre-flight against XLA: each model's predicted bytes, XLA's, and the verdict.

  python recipes/bench/memory.py                            # described v5e:1x1, compiled here
  python recipes/bench/memory.py --models=small,medium --rows=16,64
  python recipes/bench/memory.py --target=device --run      # the attached chip: run each step
  python recipes/bench/memory.py --remat_policy=dots        # train_lm's default on a TPU
  python recipes/bench/memory.py --target=device --limit_gib=0.05 --models=nano --rows=8 \\
      --seq=64 --run                                        # on CPU, with a made-up limit

For each model (train_lm's GPT and Llama sizes) and rows per device (`--rows`) at `--seq`
tokens, with AdamW and the bf16 policy, on one device of `--target` (a described TPU, by
default one v5e chip, compiled ahead of time from this machine; or `device`, this machine's
first device):

- plain: the step without remat or accumulation, its blocks keeping what `--remat_policy`
  keeps (train_lm's default on an accelerator is dots). `est`: the planner's bytes per device
  (`fnscale.analysis.predict`); `xla`: XLA's peak bytes per device of the compiled step
  (`fnscale.analysis.step_bytes`; where XLA refuses the program at compile time, the
  figure of its refusal); `ratio` est / xla; the pre-flight's verdict against the device's
  memory (`fnscale.analysis.device_memory`, or `--limit_gib`): fits or refused.
- choice: where plain is refused, train_lm's choice for those rows (`recipes/lm/memory.py`:
  the planner's fastest remat and accumulation within 90% of the memory with AdamW in
  float32, else the smaller or offloaded states in its order), its est, xla and verdict;
  "none" where nothing fits.
- ran (`--run`, on `device`): each compiled step run once on the device, whatever the
  verdict (a state that can't be placed is not run): "ok" or the error's first words; the
  verdict agrees when what fits runs and what is refused fails.

`--json` writes every row.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import fnscale as fs
from recipes.lm import cli, gpt, hardware, llama, memory, optimizers
from recipes.lm.options import REMAT_POLICIES

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads

POLICY = "params=float32,compute=bfloat16,output=float32"
MODELS = {**{n: gpt for n in gpt.SIZES}, **{n: llama for n in llama.SIZES if n != "llama-70b"}}
GiB = 2**30


def _target(args):
  """(planning target, its keywords for the planner, devices, memory limit in bytes or
  None)."""
  if args.target == "device":
    devices = jax.devices()[:1]  # one device, of however many this machine has
    topo = hardware.detect(hardware.from_values(args), devices)
  else:
    hw = fs.analysis.hardware(args.target)
    if hw.devices is None:
      raise fs.InputError(f"--target={args.target}: {hw.no_devices}; fix: install libtpu "
                          "(pip install 'fnscale[tpu]'), or --target=device")
    topo, devices = args.target, hw.devices[:1]
  kw = {"cpu_rates": fs.analysis.calibrate_cpu()} if devices[0].platform == "cpu" else {}
  limit = args.limit_gib * GiB if args.limit_gib else fs.analysis.device_memory(devices[0])
  return topo, kw, devices, limit


def _compile(model, cfg, devices, rows: int, remat: bool, accum: int, *, place: bool,
             keep: str, opt: tuple = memory.OPTIMIZERS[0]):
  """(compiled step or None, XLA's bytes, state or None) of the step on `devices`, the
  blocks keeping what remat policy `keep` keeps (remat: "full"), with optimizer `opt`
  (--optimizer, --mu_dtype, --optimizer_offload: `recipes.lm.memory.OPTIMIZERS`)."""
  mesh = fs.make_mesh({"data": 1}, devices=devices)
  transform = optimizers.transformation(opt[0], 1e-3, mu_dtype=opt[1] or "float32")
  init = functools.partial(model.init_params, cfg)
  kw = dict(rules=model.RULES, logical_axes=model.logical_axes(cfg))
  state = fs.init_state(init, transform, mesh=mesh, policy=POLICY, key=jax.random.key(0),
                        abstract=not place, offload_optimizer=opt[2], **kw)
  loss = functools.partial(memory.remat_loss(model, cfg, keep), remat=remat)
  step = fs.shard_step(fs.train_step(loss, transform, policy=POLICY, accum_steps=accum), mesh,
                       **kw)
  try:
    compiled = fs.analysis.compile_fitting(step, state, _shapes(rows, cfg.seq), limit=math.inf)
  except fs.FitError as e:  # XLA's own refusal: its figure
    return None, e.needed, None
  return compiled, fs.analysis.step_bytes(compiled), state if place else None


def _shapes(rows: int, seq: int) -> dict:
  return {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("inputs", "targets")}


def _run(compiled, state, cfg, rows: int) -> str:
  """One step on the device: "ok", or the error's first words."""
  tokens = np.random.default_rng(0).integers(0, cfg.vocab, (rows, cfg.seq + 1), np.int32)
  batch = fs.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                          fs.batch_sharding(compiled.mesh))
  try:
    _, metrics = compiled(state, batch)
    return "ok" if np.isfinite(float(metrics["loss"])) else "non-finite loss"
  except Exception as e:  # pylint: disable=broad-except  # what the device says is the result
    return " ".join(str(e).split())[:60]


def measure(name: str, rows: int, args, target, kw: dict, devices, limit) -> dict:
  """One row of the table (the module docstring)."""
  model, t0 = MODELS[name], time.perf_counter()
  cfg = model.model_config(name, args.seq)
  prof = lambda opt=memory.OPTIMIZERS[0]: memory.profile(
      memory.Model(model, cfg), target, rows, POLICY, args.remat_policy, opt, **kw)
  one = fs.MeshAxes({"data": 1}, {})
  # A state that can't be placed on the device is compiled, not run.
  place = lambda p: args.run and (limit is None or p.param_bytes + p.opt_bytes < limit)
  out = dict(model=name, rows=rows, seq=args.seq, limit=limit, est=fs.analysis.predict(
      prof(), target, one, remat=False, accum_steps=1, **kw).estimate.bytes)
  compiled, out["xla"], state = _compile(model, cfg, devices, rows, False, 1,
                                         place=place(prof()), keep=args.remat_policy)
  out["fits"] = limit is None or out["xla"] <= limit
  if args.run and state is not None:
    out["ran"] = _run(compiled, state, cfg, rows) if compiled is not None else "refused by XLA"
  if not out["fits"]:
    out["choice"] = _choice(model, cfg, rows, args, (target, kw, devices, limit), prof)
  out["seconds"] = time.perf_counter() - t0
  return out


def _choice(model, cfg, rows: int, args, where: tuple, prof) -> dict | None:
  """train_lm's choice where the plain step is refused (`recipes.lm.memory`): the planner's
  fastest remat and accumulation within its headroom with AdamW in float32, else with the
  next smaller optimizer state (`OPTIMIZERS`); compiled, and run with `--run`. `where`:
  `_target`'s (target, planner keywords, devices, memory limit)."""
  target, kw, devices, limit = where
  one = fs.MeshAxes({"data": 1}, {})
  for opt in memory.OPTIMIZERS:
    p = prof(opt)
    options = fs.analysis.fit_options(p, target, one, memory.HEADROOM * limit, rows=rows, **kw)
    if options:
      break
  else:
    return None
  best, run = options[0], args.run and p.param_bytes + p.opt_bytes < limit
  c, xla, state = _compile(model, cfg, devices, rows, best.remat, best.accum_steps,
                           place=run, keep=args.remat_policy, opt=opt)
  choice = {**best._asdict(), "optimizer": memory.optimizer_flags(opt).strip(), "xla": xla,
            "fits": xla <= limit}
  if run and state is not None and c is not None:
    choice["ran"] = _run(c, state, cfg, rows)
  return choice


def _row(r: dict) -> str:
  gib = lambda b: f"{b / GiB:.3g}"
  c = r.get("choice", "-")
  choice = ("none fits" if c is None else "-" if c == "-" else
            f"{'remat' if c['remat'] else 'no remat'}, accum {c['accum_steps']}"
            f"{', ' + c['optimizer'] if c.get('optimizer') else ''}: "
            f"est {gib(c['bytes'])}"
            f" / xla {gib(c['xla'])} ({'fits' if c['fits'] else 'REFUSED'})"
            + (f", ran {c['ran']}" if "ran" in c else ""))
  return (f"| {r['model']} | {r['rows']} | {gib(r['est'])} | {gib(r['xla'])} | "
          f"{r['est'] / r['xla']:.3f} | {'fits' if r['fits'] else 'refused'} | "
          f"{r.get('ran', '-')} | {choice} |")


def main(argv=None) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="v5e:1x1",
                  help="a described TPU target (v5e:1x1, v6e-1, ...) or 'device'")
  ap.add_argument("--models", default=",".join(MODELS),
                  help=f"comma-separated, of {list(MODELS)}")
  ap.add_argument("--rows", type=cli.numbers(int, minimum=1), default=(8, 16, 32, 64),
                  help="rows per device, comma-separated")
  ap.add_argument("--seq", type=cli.number(int, minimum=1), default=1024)
  ap.add_argument("--limit_gib", type=cli.number(float, above=0), default=None,
                  help="the device's memory (default: the device's own; none on CPU)")
  ap.add_argument("--remat_policy", default="none", choices=REMAT_POLICIES[:-1],
                  help="what each block keeps without remat (train_lm's --remat_policy; on "
                       "TPU/GPU it defaults to dots)")
  ap.add_argument("--run", action="store_true", help="run each step on --target=device")
  ap.add_argument("--json", default=None, help="write the rows here")
  hardware.add_arguments(ap)  # train_lm's hardware options, for --target=device
  args = ap.parse_args(argv)
  names = [m.strip() for m in args.models.split(",") if m.strip()]
  bad = [m for m in names if m not in MODELS]
  if bad:
    raise fs.InputError(f"--models: {bad} unknown; expected some of {list(MODELS)}")
  if args.run and args.target != "device":
    raise fs.InputError("--run runs the steps on this machine's device: add --target=device")
  fs.quiet_libtpu()  # a described target loads libtpu: no host-lookup warnings
  target, kw, devices, limit = _target(args)
  print(f"target {args.target}: {devices[0].device_kind}, memory "
        + (f"{limit / GiB:.2f} GiB" if limit else "not limited") + f"; seq {args.seq}")
  print("| model | rows | est GiB | xla GiB | est/xla | pre-flight | ran | choice |")
  print("|---|---:|---:|---:|---:|---|---|---|")
  rows = []
  for name in names:
    for n in args.rows:
      rows.append(measure(name, n, args, target, kw, devices, limit))
      print(_row(rows[-1]), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
