"""fnscale's Llama step beside MaxText's, compiled for the same described TPU target.

Both programs are compiled ahead of time on this machine for a TPU target's described devices
(libtpu), for the same model shape, mesh, batch, precision (float32 params, bfloat16
compute), full remat and flash/splash attention, and both optimized HLO modules are counted
by `fnscale.analysis.hlo`: matmul FLOPs, each collective kind's runs and ring bytes sent per device per
step, argument and temporary memory per device, compile seconds, and the kernels (custom
calls) in the program.

MaxText runs in its own Python 3.12 virtual environment (never a dependency of fnscale),
made once (about 12 minutes; it pulls its own jax):

  python3.12 -m venv maxtext-venv
  maxtext-venv/bin/pip install "maxtext[tpu]==0.2.5"

Then, from the repository root, in fnscale's environment:

  python recipes/bench/compare_maxtext.py --maxtext_python=maxtext-venv/bin/python \\
      --target=v5p-8 --mesh=fsdp=4 --layers=2 --batch=1 --seq=4096
  python recipes/bench/compare_maxtext.py ... --mesh=data=2,fsdp=2
  python recipes/bench/compare_maxtext.py ... --target="2x v5p-8" --mesh=fsdp=4 --dcn=replica=2
  python recipes/bench/compare_maxtext.py ... --target="2x v5p-8" --mesh=fsdp=4 --dcn=stage=2 \\
      --layers=8 --batch=2 --microbatches=4    # pipeline stages across the slices
  python recipes/bench/compare_maxtext.py ... --mesh=context=4 --batch=0.25 --seq=32768 \\
      --context_strategy=all_gather      # or ring; --no-load_balance: the plain order
  python recipes/bench/compare_maxtext.py ... --mesh=context=4 --batch=0.25 --seq=32768 \
      --context_strategy=ulysses         # the all-to-all form (no reorder: plain order)
  python recipes/bench/compare_maxtext.py ... --model=mixtral-8x7b --mesh=expert=4

Each side is compiled by its own interpreter's jax and libtpu, and the table says which.
Buffer assignment and scheduling change between libtpu releases, so for a same-compiler
table give fnscale's side MaxText's Python too (`maxtext-venv/bin/pip install jmp` first):
`--fnscale_python=maxtext-venv/bin/python`.

MaxText's side is its own `train_compile` (`maxtext.trainers.pre_train.train_compile.main`
with `compile_topology=...`); this file, run by MaxText's interpreter with `--maxtext_side`,
wraps its `jit_and_compile` to keep the compiled program's text, memory and compile time
(it imports nothing from fnscale). Mesh axes map as fnscale `data`/`fsdp`/`tensor`/`context`/
`expert` -> MaxText `ici_data/fsdp/tensor/context/expert_parallelism`, fnscale's DCN
`replica` -> `dcn_data_parallelism`, DCN `context` -> `dcn_context_parallelism`.
Pipelines: a `stage` axis (ICI or DCN) -> `ici/dcn_pipeline_parallelism`, `--microbatches`
-> `num_pipeline_microbatches` and `--repeats` (circular; default one layer per stage per
repeat, MaxText's default) -> `num_layers_per_pipeline_stage` = layers / (stages x repeats)
on MaxText's side and llama's circular layout (`ModelConfig.repeats`) on fnscale's.
Context parallelism: `--context_strategy` is MaxText's `context_parallel_strategy` and
fnscale's `with_kernel(context=...)` ("ring" and "ulysses" run MaxText's Tokamax splash,
which both need); `--load_balance` is MaxText's `context_parallel_load_balance` (its
dual-chunk-swap order) and fnscale's zigzag order (else contiguous); "ulysses" attends the
whole sequence on every device, needs no balance, and MaxText refuses its reorder there, so
both sides hold the plain order (and MaxText's Ulysses runs on ICI context axes only);
fnscale's batch carries the positions its Llama needs under a context axis, and with
`--packed` the segment ids MaxText's synthetic batches carry (its splash kernels are then
the segmented ones on both sides).
`--batch` is rows per device (a fraction under a context axis: 0.25 on 4 devices is one
row); `--accum` is both sides' gradient accumulation (fnscale's `accum_steps`, with
`--accum_gather`, default "auto"; MaxText's `gradient_accumulation_steps`), `--batch` then
each microbatch's rows per device, as MaxText's `per_device_batch_size` is. Each side's HLO,
memory and a JSON of the table land in `--out`; `--sides=` (none) compiles nothing and
counts the programs kept there again, e.g. after a change to `fnscale.analysis.hlo` (which
counts libtpu's fused all-reduce-scatters as the reduce-scatters they run: (n-1)/n of the
bytes, where an all-reduce sends 2 (n-1)/n).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

MIB = 2**20
SIDES = ("maxtext", "fnscale")
# MaxText model name -> fnscale's recipes/lm model of the same shapes.
MODELS = {"llama3-8b": "llama-8b", "mixtral-8x7b": "moe-mixtral-8x7b"}
MOE_MODELS = ("mixtral-8x7b",)
# MaxText's dropless MoE as its configs/base.yml defaults it (0.2.5): sorted tokens, megablox
# grouped matmuls, ragged all-to-all over the expert axis, no capacity.
MOE_MAXTEXT = ["sparse_matmul=true", "megablox=true", "capacity_factor=-1.0"]


# ----------------------------------------------------------------------- MaxText's side


def _maxtext_argv(a) -> list[str]:
  """MaxText's `key=value` config for the same model, mesh, batch, precision and remat."""
  ici = _axes(a.mesh)
  dcn = _axes(a.dcn)
  slices = dcn.get("replica", 1) * dcn.get("stage", 1) * dcn.get("context", 1)
  topology = a.target.split()[-1]  # "2x v5p-8" -> "v5p-8" and 2 slices
  return _pipeline_argv(a, ici, dcn) + _context_argv(a, ici, dcn) + [
      f"model_name={a.model}", "override_model_config=true",
      f"base_num_decoder_layers={a.layers}",
      f"compile_topology={topology}", f"compile_topology_num_slices={slices}",
      f"per_device_batch_size={a.batch}", f"max_target_length={a.seq}",
      f"gradient_accumulation_steps={a.accum}",
      "weight_dtype=float32", "dtype=bfloat16", "remat_policy=full", "attention=flash",
      f"ici_data_parallelism={ici.get('data', 1)}", f"ici_fsdp_parallelism={ici.get('fsdp', 1)}",
      f"ici_tensor_parallelism={ici.get('tensor', 1)}",
      f"dcn_data_parallelism={dcn.get('replica', 1)}",
      f"ici_expert_parallelism={ici.get('expert', 1)}",
      "dcn_fsdp_parallelism=1", "dataset_type=synthetic", "enable_checkpointing=false",
      "enable_tensorboard=false", "run_name=compare_maxtext", f"base_output_directory={a.out}",
  ] + (MOE_MAXTEXT if a.model in MOE_MODELS else [])


def _pipeline_argv(a, ici: dict, dcn: dict) -> list[str]:
  """MaxText's pipeline keys for fnscale's `stage` axis: stages over ICI and DCN, the
  microbatches, and layers per stage from the repeats (layers = stages x repeats x layers
  per stage)."""
  stages = ici.get("stage", 1) * dcn.get("stage", 1)
  if stages == 1:
    return []
  return [f"ici_pipeline_parallelism={ici.get('stage', 1)}",
          f"dcn_pipeline_parallelism={dcn.get('stage', 1)}",
          f"num_pipeline_microbatches={a.microbatches or stages}",
          f"num_layers_per_pipeline_stage={a.layers // (stages * _repeats(a, stages))}"]


def _context_argv(a, ici: dict, dcn: dict) -> list[str]:
  """MaxText's context-parallel keys for fnscale's `context` axis (ICI or DCN)."""
  out = [f"ici_context_parallelism={ici.get('context', 1)}",
         f"dcn_context_parallelism={dcn.get('context', 1)}",
         f"context_parallel_strategy={a.context_strategy}",
         f"context_parallel_load_balance={str(a.load_balance).lower()}"]
  if a.context_strategy in ("ring", "ulysses"):
    out.append("use_tokamax_splash=true")  # MaxText's ring and Ulysses run only on it
  return out


def _repeats(a, stages: int) -> int:
  """Circular repeats: `--repeats`, else one layer per stage per repeat (MaxText's default)."""
  return a.repeats or a.layers // stages


def maxtext_side(a) -> None:
  """Runs MaxText's `train_compile` and writes its compiled program (text, memory, seconds)."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  kept = {}
  compile_ = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    t0 = time.perf_counter()
    compiled = compile_(*args, **kwargs)
    kept.update(compiled=compiled, seconds=time.perf_counter() - t0)
    return compiled

  train_compile.jit_and_compile = keep
  config = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  train_compile.main(["train_compile", config] + _maxtext_argv(a))
  _write(a.out, "maxtext", kept["compiled"], kept["seconds"])


# ----------------------------------------------------------------------- fnscale's side


def fnscale_side(a) -> None:
  """Compiles the step of fnscale's model of the same shapes (`recipes/lm/llama.py`, or
  `recipes/lm/moe.py` for Mixtral) for the same target and writes it."""
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fnscale as fs  # pylint: disable=import-outside-toplevel
  from recipes.lm import llama, moe  # pylint: disable=import-outside-toplevel
  model = moe if a.model in MOE_MODELS else llama
  fs.quiet_libtpu()  # describing the target loads libtpu: no host-lookup warnings
  devices = fs.target_devices(a.target)
  mesh = fs.make_mesh(_axes(a.mesh), dcn=_axes(a.dcn) or None, devices=devices)
  stages = mesh.shape.get("stage", 1)
  repeats = _repeats(a, stages) if stages > 1 else 1  # > 1: llama's circular layout
  layout = dict(stages=stages, repeats=repeats) if stages > 1 else {}
  cfg = model.model_config(MODELS[a.model], a.seq, layers=a.layers, **layout)
  # MaxText's defaults: AdamW (b2 0.95, weight decay 0.1) after clipping the global norm at 1.
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
  policy = "params=float32,compute=bfloat16,output=float32"
  axes = model.logical_axes(cfg)
  rows = _rows(a, len(devices)) * a.accum  # MaxText's global batch: its microbatches'
  keys = ("inputs", "targets") + (("positions",) if fs.parallel.context.shards(mesh) > 1
                                  else ()) + (("segment_ids",) if a.packed else ())
  batch = {k: jax.ShapeDtypeStruct((rows, a.seq), jnp.int32) for k in keys}
  order = "zigzag" if a.load_balance else "contiguous"
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(model.init_params, cfg), opt, mesh=mesh,
                          rules=model.RULES, logical_axes=axes, policy=policy,
                          key=jax.random.key(0), abstract=True)
    loss = functools.partial(model.loss_fn, remat=True)
    if stages > 1:
      loss = functools.partial(loss, microbatches=a.microbatches or stages)
    step = fs.train_step(loss, opt, policy=policy, accum_steps=a.accum,
                         accum_gather=a.accum_gather)
    kernel = fs.with_kernel(step, attention="auto", context=a.context_strategy,
                            context_order=order)
    compiled = fs.shard_step(kernel, mesh, rules=model.RULES, logical_axes=axes).compile(
        state, batch)
  _write(a.out, "fnscale", compiled.compiled, compiled.compile_seconds)


# ----------------------------------------------------------------------- both


def _write(out: str, side: str, compiled, seconds: float) -> None:
  """The compiled program's optimized HLO and memory analysis, for the table."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{side}.hlo.txt"), "w", encoding="utf-8") as f:
    f.write(compiled.as_text())
  mem = compiled.memory_analysis()
  facts = {k: getattr(mem, f"{k}_size_in_bytes", None)
           for k in ("argument", "output", "temp", "alias", "generated_code")}
  with open(os.path.join(out, f"{side}.json"), "w", encoding="utf-8") as f:
    json.dump(dict(facts, compile_seconds=seconds, compiler=_compiler()), f)


def _compiler() -> str:
  """"jax X, libtpu Y": the compiler of this interpreter. XLA's buffer assignment and
  schedule change between libtpu releases, so temp memory is only comparable under one."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  try:
    libtpu = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    libtpu = "none"
  return f"jax {jax.__version__}, libtpu {libtpu}"


def _rows(a, devices: int) -> int:
  """Global rows: --batch rows per device (a fraction under a context axis) x devices."""
  rows = a.batch * devices
  if rows != int(rows) or rows < 1:
    raise SystemExit(f"error: --batch={a.batch} x {devices} devices is {rows} rows; give "
                     "a whole number of rows (e.g. --batch=0.25 on 4 devices)")
  return int(rows)


def _axes(text: str | None) -> dict[str, int]:
  """"data=2,fsdp=2" -> {"data": 2, "fsdp": 2}."""
  if not text:
    return {}
  out = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not size.strip().lstrip("-").isdigit():
      raise SystemExit(f"error: mesh axis {part!r} is not name=size (e.g. fsdp=4)")
    out[name.strip()] = int(size)
  return out


def _kernels(hlo: str) -> dict[str, int]:
  """Custom calls in the program by target (a Pallas kernel is a `tpu_custom_call`)."""
  counts: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
    counts[target] = counts.get(target, 0) + 1
  return counts


def read_side(out: str, side: str) -> dict:
  """One side's figures: `fnscale.analysis.hlo.summarize` of its HLO plus its memory analysis."""
  from fnscale.analysis import hlo as fhlo  # pylint: disable=import-outside-toplevel
  with open(os.path.join(out, f"{side}.hlo.txt"), encoding="utf-8") as f:
    text = f.read()
  with open(os.path.join(out, f"{side}.json"), encoding="utf-8") as f:
    facts = json.load(f)
  s = fhlo.summarize(text)
  facts.update(matmul_flops=s.matmul_flops, grouped_flops=s.grouped_flops,
               unknown_trip_counts=s.unknown_trip_counts,
               kernels=_kernels(text), dcn_sent=s.dcn_bytes_sent,
               collectives={c.kind: (c.count, c.bytes_sent) for c in s.collectives if c.count})
  return facts


def table(sides: dict[str, dict]) -> str:
  """Markdown: one row per figure, one column per side (and fnscale / MaxText)."""
  m, f = sides["maxtext"], sides["fnscale"]
  ratio = lambda a, b: f"{b / a:.2f}x" if a else ("same" if not b else "-")
  rows = [("HLO matmul FLOPs", lambda s: f"{s['matmul_flops'] / 1e12:.3f} T",
           lambda: ratio(m["matmul_flops"], f["matmul_flops"]))]
  if m.get("grouped_flops") or f.get("grouped_flops"):  # experts: declared over whole buffers
    rows.append(("grouped matmul FLOPs (whole buffers)",
                 lambda s: f"{s.get('grouped_flops', 0) / 1e12:.3f} T",
                 lambda: ratio(m.get("grouped_flops", 0), f.get("grouped_flops", 0))))
  sent = lambda s: sum(b for _, b in s["collectives"].values())
  rows.append(("collective bytes sent (ring)", lambda s: f"{sent(s) / MIB:,.0f} MiB",
               lambda: ratio(sent(m), sent(f))))
  for kind in sorted(set(m["collectives"]) | set(f["collectives"])):
    cell = lambda s, k=kind: "runs {} / {:,.0f} MiB".format(*(lambda c: (c[0], c[1] / MIB))(
        s["collectives"].get(k, (0, 0.0))))
    rows.append((f"  {kind}", cell, lambda k=kind: ratio(
        m["collectives"].get(k, (0, 0))[1], f["collectives"].get(k, (0, 0))[1])))
  rows.append(("  of which across slices (DCN)", lambda s: f"{s['dcn_sent'] / MIB:,.0f} MiB",
               lambda: ratio(m["dcn_sent"], f["dcn_sent"])))
  for key in ("argument", "temp"):
    rows.append((f"{key} memory", lambda s, k=key: f"{(s[k] or 0) / 2**30:.2f} GiB",
                 lambda k=key: ratio(m[k] or 0, f[k] or 0)))
  rows.append(("compile s", lambda s: f"{s['compile_seconds']:.0f}", lambda: ""))
  compiler = lambda s: s.get("compiler", "unknown")
  rows.append(("compiler", compiler, lambda: "same" if compiler(m) == compiler(f) else
               "**differ**"))
  rows.append(("kernels (custom calls)", lambda s: ", ".join(
      f"{k} x{n}" for k, n in sorted(s["kernels"].items())) or "none", lambda: ""))
  lines = ["| per device per step | MaxText | fnscale | fnscale / MaxText |", "|---|---|---|---|"]
  lines += [f"| {name} | {cell(m)} | {cell(f)} | {r()} |" for name, cell, r in rows]
  if compiler(m) != compiler(f):
    lines += ["", "Two compilers made these programs: memory and schedules differ between "
              "libtpu releases. For a same-compiler table run fnscale's side under MaxText's "
              "Python: --fnscale_python=maxtext-venv/bin/python (after `maxtext-venv/bin/pip "
              "install jmp`)."]
  return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
  """Refuses bad flags with one `error:` line and exit 2, as every recipe does (this script
  also runs under MaxText's Python, without fnscale: no `recipes.lm.cli` here)."""

  def error(self, message: str):
    _refuse(f"{self.prog}: {message}; see --help")


def _refuse(message: str):
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def _positive(text: str) -> int:
  if not text.lstrip("-").isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
  return int(text)


def _flags(argv=None):
  p = _Parser(description=__doc__.split("\n\n")[0])
  p.add_argument("--maxtext_python", default="maxtext-venv/bin/python",
                 help="the Python of the MaxText virtual environment (see the module doc); "
                 "default: maxtext-venv/ under the current directory")
  p.add_argument("--fnscale_python", default="",
                 help="the Python that compiles fnscale's side (default: this one); MaxText's "
                 "gives both sides one compiler (it needs `pip install jmp` there)")
  p.add_argument("--target", default="v5p-8", help='TPU target, e.g. v5p-8 or "2x v5p-8"')
  p.add_argument("--mesh", default="fsdp=4", help="ICI axes, e.g. fsdp=4 or data=2,fsdp=2")
  p.add_argument("--dcn", default="", help="DCN axes across slices, e.g. replica=2")
  p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS),
                 help="MaxText's model name (fnscale's of the same shapes: llama-8b, "
                 "moe-mixtral-8x7b)")
  p.add_argument("--layers", type=_positive, default=2, help="decoder layers (of the model)")
  p.add_argument("--batch", type=float, default=1, help="rows per device (a fraction "
                 "when a context axis splits the rows: 0.25 on 4 devices is one row)")
  p.add_argument("--context_strategy", default="all_gather",
                 choices=("all_gather", "ring", "ulysses"),
                 help="context parallelism's attention (MaxText's context_parallel_strategy)")
  p.add_argument("--packed", action="store_true",
                 help="fnscale's batch carries segment ids, as MaxText's synthetic batches "
                 "do (its attention runs splash's segmented kernels)")
  p.add_argument("--load_balance", default=None, action=argparse.BooleanOptionalAction,
                 help="causal load balance under a context axis (MaxText's "
                 "context_parallel_load_balance; fnscale's zigzag order); default on, "
                 "except for ulysses, which needs none")
  p.add_argument("--seq", type=_positive, default=4096, help="tokens per row")
  p.add_argument("--accum", type=_positive, default=1, help="gradient accumulation steps "
                 "(fnscale's accum_steps, MaxText's gradient_accumulation_steps); --batch "
                 "is then each microbatch's rows per device")
  p.add_argument("--accum_gather", default="auto", choices=("auto", "once", "per_microbatch"),
                 help="fnscale's accum_gather with --accum > 1 (MaxText's loop is "
                 "'per_microbatch''s: params and accumulator sharded)")
  p.add_argument("--microbatches", type=int, default=0,
                 help="pipeline microbatches with a stage axis (default: the stages)")
  p.add_argument("--repeats", type=int, default=0,
                 help="circular pipeline repeats with a stage axis (default: layers / stages, "
                 "one layer per stage per repeat)")
  p.add_argument("--sides", default="maxtext,fnscale",
                 help="which programs to compile now (the others are read from --out)")
  p.add_argument("--out", default="runs/compare_maxtext", help="directory for HLO and JSON")
  p.add_argument("--maxtext_side", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--fnscale_side", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.context_strategy == "ulysses" and (a.load_balance or "context" in a.dcn):
    p.error("--context_strategy=ulysses: MaxText's Ulysses takes neither "
            "--load_balance (every device attends the whole sequence) nor a DCN context axis")
  if a.load_balance is None:
    a.load_balance = a.context_strategy != "ulysses"
  return a


def main(argv=None) -> None:
  a = _flags(argv)
  if a.maxtext_side:
    maxtext_side(a)
    return
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if not __package__:  # run as a script: import `recipes` from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  if a.fnscale_side:
    try:
      import fnscale  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
      _refuse(f"{sys.executable} lacks the module {e.name!r}, which fnscale needs: install "
              f"fnscale's dependencies there (MaxText's environment lacks only jmp: "
              f"{sys.executable} -m pip install jmp)")
    fnscale_side(a)
    return
  todo = [s for s in a.sides.split(",") if s]
  args = list(argv if argv is not None else sys.argv[1:])  # a side's run returns first
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")}
  for side, python in (("maxtext", a.maxtext_python), ("fnscale", a.fnscale_python)):
    if side not in todo or not python:
      continue
    if not os.path.exists(python):
      _refuse(f"--{side}_python={python} does not exist; give a Python that has "
              f"{side}'s packages (the module doc makes MaxText's)")
    rc = subprocess.run([python, os.path.abspath(__file__), f"--{side}_side"] + args,
                        check=False, env=env).returncode
    if rc:
      _refuse(f"{side}'s side under {python} ended with exit status {rc}: its error is above")
  if "fnscale" in todo and not a.fnscale_python:
    fnscale_side(a)
  missing = [s for s in SIDES if not os.path.exists(os.path.join(a.out, f"{s}.hlo.txt"))]
  if missing:
    _refuse(f"no {' or '.join(missing)} program in --out={a.out}: compile it there first "
            f"(--sides={','.join(missing)}, same flags)")
  sides = {s: read_side(a.out, s) for s in SIDES}
  context = (f", context {a.context_strategy}"
             f"{' load-balanced' if a.load_balance else ''}" if "context" in a.mesh + a.dcn
             else "")
  text = (f"{a.target}, mesh {a.mesh}{' | ' + a.dcn if a.dcn else ''}{context}, {a.model} "
          f"shapes x {a.layers} layers, {a.batch:g} row(s) x {a.seq} tokens per device"
          f"{f' per microbatch, accum {a.accum}' if a.accum > 1 else ''}\n\n"
          + table(sides))
  with open(os.path.join(a.out, "table.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
