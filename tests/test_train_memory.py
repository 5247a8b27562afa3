"""train_lm's memory pre-flight (recipes/lm/memory.py) on one described TPU v5e chip: what
the user left open is chosen to fit, what they fixed is left to XLA's compile, and what can't
fit stops before anything is built, naming the fix; a LoRA run's estimate against XLA's."""

import dataclasses
import functools
import json
import re
import types

import jax
import jax.numpy as jnp
import optax
import pytest

import fnscale as fs
from fnscale import FitError
from recipes.bench import chip
from recipes.bench import forecast_fit as ff
from recipes.lm import cli, finetune, gpt, llama, memory, startup
from recipes.lm.options import Options, StepOptions


@pytest.fixture(scope="module")
def v5e(tpu_devices):
  """(topology, mesh) of one described v5e chip (16 GiB of HBM, of which a program may hold
  15.75: the limit measured on the chip)."""
  del tpu_devices  # skips without libtpu
  devices = fs.target_devices("v5e:1x1")
  return fs.detect_topology(devices=devices), fs.make_mesh({"data": 1}, devices=devices)


def _choose(v5e, name, rows, **options):
  topo, mesh = v5e
  model = gpt if name in gpt.SIZES else llama
  said = []
  step = memory.choose(Options.of(**options).step, "auto",
                       memory.Model(model, model.model_config(name, 1024), name), topo, mesh,
                       rows, said.append)
  return step, step.batch_size, said


@pytest.mark.tpu
def test_the_default_that_does_not_fit_becomes_what_the_planner_fits(v5e):
  """GPT small at 64 rows of 1024 tokens keeping its matmul outputs (train_lm's default on
  a TPU): 19.5 GiB by the estimate (XLA: 19.2 GiB) on a chip that lets it hold 15.75 GiB.
  Left to the defaults, the step takes the planner's fastest option within 90% of the
  memory, keeping the 64 rows, and says so; a batch size the user gave is kept the same
  way."""
  for given in ({}, dict(batch_size=64)):
    o, rows, said = _choose(v5e, "small", 64, **given)
    assert rows == 64 and (o.remat or o.accum_steps > 1)
    assert len(said) == 1 and said[0].startswith("memory: batch_size=64, accum_steps=1, "
                                                 "remat=False needs 19.") and "15.75 GiB" in said[0]
    assert (f"chose --batch_size=64 --accum_steps={o.accum_steps} "
            f"{'--remat' if o.remat else '--noremat'} (") in said[0]
  # Where it fits (32 rows: 10.4 GiB by the estimate, XLA 10.2 GiB), nothing changes.
  o, rows, said = _choose(v5e, "small", 32)
  assert (o.remat, o.accum_steps, rows, said) == (False, 1, 32, [])


@pytest.mark.slow  # beside the quick pre-flight tests of the same module
@pytest.mark.tpu
def test_what_the_user_fixed_is_left_to_the_compile(v5e):
  o, rows, said = _choose(v5e, "small", 64, batch_size=64, remat=False, accum_steps=1)
  assert (o.remat, o.accum_steps, rows, said) == (False, 1, 64, [])


@pytest.mark.slow
@pytest.mark.tpu
def test_a_batch_or_a_model_that_nothing_fits_stops_before_anything_runs(v5e):
  with pytest.raises(FitError, match=r"medium on mesh \{'data': 1\} needs .* GiB per device "
                     r"by the planner's estimate, and the device has 15.75 GiB; with "
                     r"--batch_size=16384 nothing fits, whatever the remat and accumulation; "
                     r"fix: --batch_size=\d+ --accum_steps=\d+ --(no)?remat \(\d+\.\d\d GiB\)"):
    _choose(v5e, "medium", 16384, batch_size=16384)
  # Llama-3.2-3B's float32 params and AdamW state alone are 48 GiB: no option on one chip.
  with pytest.raises(FitError, match=r"fix: a smaller model, or more devices to split it "
                     r"over \(--mesh=fsdp=N\)"):
    _choose(v5e, "llama-3b", 16)


@pytest.mark.slow
@pytest.mark.tpu
def test_the_estimate_of_a_lora_run_tracks_xlas_peak(v5e):
  """LoRA rank 16 on every block weight of a 4-layer Llama of width 1024 (a 64M-param
  bfloat16 base), 4 rows of 512 tokens, the blocks keeping everything (--remat_policy=none):
  the pre-flight's estimate against XLA's peak for the step train_lm compiles (its state
  from `finetune.init`). The estimate that gave the frozen base gradients and a cast copy
  was 1.39x XLA's; within 15%, as full training's (tests/test_plan.py)."""
  topo, mesh = v5e
  cfg = llama.model_config("llama-tiny", 512, layers=4, d_model=1024, heads=8, kv_heads=8,
                           d_mlp=4096)
  lora = fs.lora.LoraConfig(16, 32.0, 0.0, llama.lora_targets(cfg))
  policy, opt = startup.policy("bfloat16", "tpu"), optax.adamw(1e-3)
  prof = memory.profile(memory.Model(llama, cfg, "llama", lora), topo, 4, policy, "none")
  est = fs.analysis.predict(prof, topo, fs.MeshAxes(dict(mesh.shape), {})).estimate.bytes
  run = types.SimpleNamespace(mesh=mesh, model=llama, cfg=cfg, o=Options())  # no --init_from
  state = finetune.init(run, opt, policy, jax.random.key(0), lora)(abstract=True)
  loss = fs.lora.with_lora(functools.partial(llama.loss_fn, cfg=cfg, remat="none"), lora)
  rows = jax.ShapeDtypeStruct((4, 512), jnp.int32)
  step = fs.shard_step(fs.train_step(loss, opt, policy=policy), mesh)
  compiled = step.compile(state, {"inputs": rows, "targets": rows})
  assert est == pytest.approx(fs.analysis.step_bytes(compiled), rel=0.15)


@pytest.mark.tpu
@pytest.mark.parametrize("name", ["small", "llama-4x1024"])
def test_the_estimate_under_a_partial_remat_policy_tracks_xlas_peak(v5e, name):
  """train_lm's TPU default keeps each block's matmul outputs (--remat_policy=dots): the
  pre-flight's estimate for 16 rows of 1024 tokens against XLA's peak for the step compiled
  for a v5e chip (`step_bytes`), GPT small and a 4-layer Llama of width 1024 (vocab 32000).
  Never under (a default the estimate keeps must fit), at most 8% over: the estimate that
  added two whole layers' residuals was 1.20x (GPT small) and 1.58x (the Llama)."""
  topo, mesh = v5e
  model, cfg = ((gpt, gpt.model_config("small", 1024)) if name == "small" else
                (llama, llama.model_config("llama-tiny", 1024, vocab=32000, layers=4,
                                           d_model=1024, heads=8, kv_heads=8, d_mlp=4096)))
  policy, opt = startup.policy("auto", "tpu"), optax.adamw(1e-3)
  prof = memory.profile(memory.Model(model, cfg, name), topo, 16, policy, "dots")
  est = fs.analysis.predict(prof, topo, fs.MeshAxes(dict(mesh.shape), {})).estimate.bytes
  kw = dict(rules=model.RULES, logical_axes=model.logical_axes(cfg))
  state = fs.init_state(functools.partial(model.init_params, cfg), opt, mesh=mesh,
                        policy=policy, key=jax.random.key(0), abstract=True, **kw)
  loss = functools.partial(model.loss_fn, cfg=cfg, remat="dots")
  step = fs.shard_step(fs.train_step(loss, opt, policy=policy), mesh, **kw)
  rows = jax.ShapeDtypeStruct((16, 1024), jnp.int32)
  xla = fs.analysis.step_bytes(step.compile(state, {"inputs": rows, "targets": rows}))
  assert 1.0 <= est / xla <= 1.08, (est / 2**30, xla / 2**30)


@pytest.mark.slow  # the quick tier's time: tests/test_plan.py's LoRA estimates stay quick
def test_a_lora_runs_profile_keeps_what_its_remat_policy_keeps():
  """A LoRA run's blocks keep what the run's remat policy keeps, as a full fine-tune's do:
  blocks keeping only their inputs ("full") hold remat's residuals. The profile that traced
  the LoRA loss keeping everything, whatever the policy, counted all of a block's residuals
  for "dots" (and twice a whole layer's more, for the recomputation)."""
  cfg = llama.model_config("llama-tiny", 32, layers=2, d_model=64, heads=4, kv_heads=2,
                           d_mlp=128, vocab=64)
  lora = fs.lora.LoraConfig(4, 8.0, 0.0, llama.lora_targets(cfg))
  for adapters in (None, lora):
    prof = memory.profile(memory.Model(llama, cfg, "llama", adapters), "cpu", 8, None, "full",
                          cpu_rates=(1e11, 1e10))
    assert prof.act_row == prof.act_row_remat


@pytest.mark.slow  # the quick tier's time: tests/test_fit.py's refusal of a compiled step stays quick
def test_a_compiled_step_over_the_memory_is_refused_naming_the_fix(monkeypatch):
  """After compiling (`compile_step`), XLA's bytes against the device's memory (a made-up
  1 MiB for the CPU devices): a step over it is a FitError naming its bytes and the fix."""
  monkeypatch.setattr(memory, "limit", lambda mesh: 2**20)
  cfg, mesh = gpt.model_config("nano", 64), fs.make_mesh({"data": 8})
  kw = dict(rules=gpt.RULES, logical_axes=gpt.logical_axes(cfg))
  opt = optax.adamw(1e-3)
  state = fs.init_state(functools.partial(gpt.init_params, cfg), opt, mesh=mesh,
                        key=jax.random.key(0), abstract=True, **kw)
  step = fs.shard_step(fs.train_step(functools.partial(gpt.loss_fn, cfg=cfg), opt), mesh, **kw)
  setup = types.SimpleNamespace(
      o=Options.of(model_config="nano", batch_size=8, accum_steps=1, remat=False,
                   remat_policy="none"),
      topo=fs.detect_topology(), mesh=mesh, model=gpt, cfg=cfg, lora=None)
  rows = jax.ShapeDtypeStruct((64, 64), jnp.int32)
  with pytest.raises(FitError, match=r"the step \(batch_size=8, accum_steps=1, remat=False\) "
                     r"needs .* per device \(XLA's peak\) and the device has 0.00 GiB; fix: "):
    memory.compile_step(setup, step, state, {"inputs": rows, "targets": rows})


def test_the_memory_benchmark_refuses_bad_flags(capsys):
  from recipes.bench import memory as bench  # pylint: disable=import-outside-toplevel
  assert cli.run(bench.main, ["--models=small,gpt-9"]) == 2
  assert "--models: ['gpt-9'] unknown" in capsys.readouterr().err
  assert cli.run(bench.main, ["--run"]) == 2
  assert "add --target=device" in capsys.readouterr().err


@pytest.mark.slow
def test_the_memory_benchmark_chooses_a_smaller_optimizer_state_as_train_lm_does(tmp_path):
  """Where no remat or accumulation fits with AdamW in float32, the benchmark's choice is
  train_lm's next one: AdamW with a bfloat16 first moment, which compiles and runs; the
  program it reports holds 2 bytes a param less state than AdamW's in float32 (a hand
  count of the compiled programs' arguments, independent of the planner)."""
  from recipes.bench import memory as bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "rows.json"
  assert cli.run(bench.main, ["--target=device", "--limit_gib=0.0024", "--models=nano",
                              "--rows=8", "--seq=64", "--run", f"--json={out}"]) == 0
  choice = json.loads(out.read_text())[0]["choice"]
  assert (choice["optimizer"], choice["ran"]) == ("--mu_dtype=bfloat16", "ok")
  cfg = gpt.model_config("nano", 64)
  compiled = {opt: bench._compile(gpt, cfg, jax.devices()[:1], 8, choice["remat"],  # pylint: disable=protected-access
                                  choice["accum_steps"], place=False, keep="none", opt=opt)
              for opt in memory.OPTIMIZERS[:2]}
  assert compiled[memory.OPTIMIZERS[1]][1] == choice["xla"]
  state = {o: c[0].compiled.memory_analysis().argument_size_in_bytes
           for o, c in compiled.items()}
  params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      functools.partial(gpt.init_params, cfg), jax.random.key(0))))
  assert state[memory.OPTIMIZERS[0]] - state[memory.OPTIMIZERS[1]] == 2 * params


def test_one_choice_holds_rows_accumulation_and_remat_with_the_planners_row():
  """On CPU (no memory limit: nothing is estimated) the choice is what was asked: a
  --mesh=auto row's accumulation where it has more steps than the user's, its remat where
  the user gave none, its global batch split over the 8 data-parallel devices; without a
  row, the defaults (the platform's rows, 1 step, no remat, AdamW in float32)."""
  topo, mesh = fs.detect_topology(), fs.make_mesh({"data": 8})
  model = memory.Model(gpt, gpt.model_config("nano", 32), "nano")
  planned = memory.Planned(global_batch=64, remat=True, accum_steps=2, accum_gather="once")
  said = []
  step = memory.choose(StepOptions(), "auto", model, topo, mesh, 4, said.append, planned)
  assert step == memory.Choice(batch_size=8, global_batch=64, accum_steps=2,
                               accum_gather="once", remat=True, remat_policy="full",
                               optimizer="adamw", mu_dtype="float32", context="all_gather")
  asked = StepOptions(accum_steps=4, accum_gather="per_microbatch")
  step = memory.choose(asked, "auto", model, topo, mesh, 4, said.append, planned)
  assert (step.accum_steps, step.accum_gather, step.remat) == (4, "per_microbatch", True)
  step = memory.choose(StepOptions(), "auto", model, topo, mesh, 4, said.append)
  assert step == memory.Choice(batch_size=4, global_batch=32, accum_steps=1,
                               accum_gather="auto", remat=False, remat_policy="none",
                               optimizer="adamw", mu_dtype="float32", context="all_gather")
  # A row planned over a context axis brings its attention form; a --context given stays.
  ulysses = planned._replace(context="ulysses")
  assert memory.choose(StepOptions(), "auto", model, topo, mesh, 4, said.append,
                       ulysses).context == "ulysses"
  assert memory.choose(StepOptions(context="ring"), "auto", model, topo, mesh, 4, said.append,
                       ulysses).context == "ring"
  assert said == []
  with pytest.raises(fs.InputError, match=r"--remat with --remat_policy=dots: --remat "
                     r"recomputes whole blocks \(offload_attn or full\); give one of them"):
    memory.choose(StepOptions(remat=True, remat_policy="dots"), "auto", model, topo, mesh, 4,
                  said.append)
  step = memory.choose(StepOptions(remat=True, remat_policy="offload_attn"), "auto", model,
                       topo, mesh, 4, said.append)
  assert (step.remat, step.remat_policy) == (True, "offload_attn")


def _measured_both_ways():
  """{chip.py case of full remat: (its step ms, offload_attn's)} for each shape measured under
  both on one v5e (recipes/bench/chip_v5e.json)."""
  with open(ff.CHIP_V5E, encoding="utf-8") as f:
    rows = [r for k, v in json.load(f).items() if k.startswith("rows") for r in v]
  ms = {r["case"]: r["fnscale"]["step_ms"] for r in rows if "fnscale" in r}
  return {c: (t, ms[c.replace("remat=full", "remat=offload_attn")]) for c, t in ms.items()
          if "remat=full" in c and c.replace("remat=full", "remat=offload_attn") in ms}


# XLA's host buffer under offload_attn of each shape measured both ways (its full-remat
# case), compiled for v5e:1x1 (chip.py's fnscale side, memory_analysis().host_temp), GiB.
HOST_GIB = {"llama,remat=full,batch=8": 0.508, "gpt-medium,remat=full,batch=32": 3.047,
            "llama-1b,batch=8,params=bfloat16,remat=full": 2.031,
            "llama-1b,batch=6,remat=full": 1.523}


@pytest.mark.tpu
def test_remats_policy_offloads_the_attention_where_the_chip_ran_it_faster(v5e):
  """--remat (its policy left to auto) on one v5e takes offload_attn where the host link
  carries the attention's output out in the forward pass's time by the forecast, else full:
  on each shape the chip ran both ways, the faster one (the 766M Llama at 8 x 2048:
  offload_attn 680 ms against 698; GPT medium at 32 x 1024: full 892 ms against 1079; the
  1B at 8 x 2048 with bf16 params, Adafactor, 1371 against 1404, and at 6 rows with float32
  params 1023 against 1032: both chosen before they ran). The bytes said are XLA's host
  buffer (`HOST_GIB`); the share is the measured step's (the transfer at 8.5 GB/s over a
  quarter of full's step: 37% for the 766M, 73% for the 1B) within the full-remat
  forecast's error on these rows (test_chip_forecast: the 1B's 8 rows 8% fast). A
  --remat_policy the user gave is kept; a chip without a measured link stays full."""
  topo, mesh = v5e
  pairs = _measured_both_ways()
  assert set(pairs) == set(HOST_GIB)
  for label, (full_ms, offload_ms) in pairs.items():
    case = chip.parse_case(label)
    module, cfg = chip.model_of(case)
    model, said = memory.Model(module, cfg, case.model), []
    precision = f"params={case.params},compute=bfloat16,output=float32"
    asked = lambda **kw: Options.of(remat=True, batch_size=case.batch, optimizer=case.opt,
                                    **kw).step
    choose = lambda step: memory.choose(step, precision, model, topo, mesh, case.batch,
                                        said.append)
    step = choose(asked())
    want = "offload_attn" if offload_ms < full_ms else "full"
    assert (step.remat, step.remat_policy, step.batch_size) == (True, want, case.batch), label
    told = [s for s in said if s.startswith("remat: ")]
    assert len(told) == (want != "full"), said
    for line in told:
      share = re.fullmatch(
          r"remat: offload_attn: the attention kernel's output goes to the host and back "
          rf"\({HOST_GIB[label]:.2f} GiB a step per device\) in (\d+)% of the forward pass's "
          r"time by the forecast, rather than running again \(--remat_policy=full "
          r"recomputes it\)", line)
      measured = HOST_GIB[label] * 2**30 / 8.5e9 / (full_ms / 4e3) * 100  # one way
      assert share and abs(int(share[1]) - measured) <= 0.1 * measured, (line, measured)
    assert choose(asked(remat_policy="full")).remat_policy == "full"
    unmeasured = dataclasses.replace(topo, generation="v5p")
    assert memory.choose(asked(), precision, model, unmeasured, mesh, case.batch,
                         said.append).remat_policy == "full"
