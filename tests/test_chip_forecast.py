"""The planner's forecast for one TPU v5e chip against the steps measured there
(recipes/bench/chip_v5e.json, written by recipes/bench/chip.py on the chip), and the two
costs it counts rather than fits: the optimizer update's extra passes and narrow heads."""
import json

import jax
import jax.numpy as jnp
import optax
import pytest

import fnscale as fs
from fnscale.analysis import _cost, _forecast, _targets, _trace, profile_model
from recipes.bench import forecast_fit as ff
from recipes.lm import optimizers

RUNS = ff.chip_runs()


def test_the_measured_rows_are_the_benchmarks_sizes_and_policies():
  with open(ff.CHIP_V5E, encoding="utf-8") as f:
    doc = json.load(f)
  assert "TPU v5e" in doc["about"] and "JAX 0.10.2" in doc["about"]
  assert {r.model for r in RUNS} == {"small", "medium", "llama-766m", "llama-1b"}
  assert {r.remat for r in RUNS} == {"dots", "full"}
  # Every day's table: the first's 4 rows and the 2026-12-06 rows (Adafactor on the 1B; a
  # row with XLA's attention is not the step the planner costs, and stays out), "dots" only
  # from the table measured once splash's forward ran once under it (RERAN_ATTENTION).
  dots = [r.case for r in RUNS if r.remat == "dots" and not r.unroll]
  assert dots == ["gpt-small,remat=dots,batch=32,peer=1,hand=1",
                  "gpt-medium,remat=dots,batch=12,peer=1",
                  "gpt-small,remat=dots,batch=32,profile=1",
                  "gpt-small,remat=dots,batch=32", "gpt-medium,remat=dots,batch=12",
                  "gpt-small,remat=dots,batch=40", "gpt-small,remat=dots,batch=24"], dots
  # 2026-12-07b's int8 and offloaded rows stay out: the planner costs neither the kernel's
  # unfused layouts nor the host transfers.
  assert not {r.case for r in RUNS} & {"llama,int8=1", "llama-1b,opt=adamw,offload=1,batch=8"}
  # The scan's rows; 2026-12-07e and f measured the 766M's and GPT medium's full-remat rows
  # again beside their offload_attn rows (out of the check: the planner doesn't cost the
  # offload).
  # 2026-12-07g and h: the 1B at 8 rows with bfloat16 params and at 6 with float32, full
  # remat (in) and offload_attn (out).
  assert sum(not r.unroll for r in RUNS) == 20
  assert not {"llama,remat=offload_attn,batch=8", "gpt-medium,remat=offload_attn,batch=32",
              "llama-1b,batch=8,params=bfloat16,remat=offload_attn",
              "llama-1b,batch=6,remat=offload_attn"} & {r.case for r in RUNS}
  assert {r.opt for r in RUNS if r.model == "llama-1b"} == {"adafactor"}
  # The unrolled loops (2026-12-07c and d), held to their own terms; the full-remat one
  # didn't fit, the qkv_attn ones keep a policy the planner doesn't cost.
  assert [r.case for r in RUNS if r.unroll] == [
      "gpt-small,remat=dots,batch=32,unroll=1", "gpt-medium,remat=dots,batch=12,unroll=1",
      "gpt-small,remat=dots,batch=32,unroll=1,peer=1,hand=1",
      "llama,remat=dots,batch=4,unroll=1"]
  # The rows the forecast can't describe stay in the file, out of the check: other remat
  # policies, and GPT small at 16 rows without remat, whose 15.6 GiB fill the chip.
  assert {r["remat"] for r in doc["rows"]} - set(ff.CHIP_REMAT) == {"qkv", "qkv_attn"}
  full = [r["case"] for r in doc["rows"] if r["hbm_gib"] >= ff.CHIP_FULL * ff.CHIP_HBM_GIB]
  assert full == ["gpt-small"] and "gpt-small" not in {r.case for r in RUNS}


# The forecast's one known miss, measured after the fit: the 1B at 8 rows with bfloat16 params
# ran 48.7% against 52.7% forecast (its 4 and 6 rows with float32 params: 1.6 and 2.2 high).
# Refitting both terms over every row leaves 3.5 points (the 766M's rows then low): a cost the
# terms don't hold (the update in bfloat16, or XLA's schedule near the chip's memory), unknown.
MISSED = {"llama-1b,batch=8,params=bfloat16,remat=full": "forecast 4.0 points high"}


def _marks(r):
  if r.case in MISSED:
    return [pytest.mark.xfail(strict=True, reason=MISSED[r.case])]
  # GPT small and the 1B at 6 rows (the fit's worst) in the quick tier, the rest slow.
  return [] if r.case.startswith("gpt-small") or r.case == "llama-1b,batch=6" else [
      pytest.mark.slow]


@pytest.mark.parametrize("run", [pytest.param(r, marks=_marks(r)) for r in RUNS],
                         ids=[r.case for r in RUNS])
def test_the_one_chip_forecast_is_within_3_points_of_each_measured_step(run):
  """With the pods' terms (FITTED) the GPT rows came out 10-22 points high; with the chip's
  terms but without the update's reductions and narrow heads, the 1B's rows 4 points high
  and the 766M's and GPT medium's at 12 rows 4.3 points low; the unrolled loops with the
  scan's terms 6-9 points low."""
  assert abs(ff.predict_chip(run) - run.mfu) <= 3.0, (run.case, ff.predict_chip(run))


def test_plan_py_forecasts_an_unrolled_step_on_the_chip_with_the_unrolled_terms():
  """`recipes/plan.py --unroll` for GPT small, 32 x 1024 on one v5e: the row the chip ran
  (one device, no remat, one step) forecasts within 3 points of the unrolled step measured
  there; the scan's terms (no --unroll) leave that row more than 3 points under it."""
  from recipes import plan as plan_py  # pylint: disable=import-outside-toplevel
  measured = next(r.mfu for r in RUNS if r.case == "gpt-small,remat=dots,batch=32,unroll=1")
  mfu = {}
  for unrolled in (False, True):
    p = plan_py.make_plan("small", "v5e:1x1", 32, 1024, 0, unrolled=unrolled, accum_steps=1)
    assert p.unrolled is unrolled
    mfu[unrolled] = 100 * next(r for r in p.rows if not r.remat).forecast.mfu
  assert abs(mfu[True] - measured) <= 3.0 and measured - mfu[False] > 3.0, (mfu, measured)
  with pytest.raises(fs.InputError, match="--unroll: moe-tiny has no unrolled layer loop"):
    plan_py.make_plan("moe-tiny", "v5e:1x1", 8, 64, 0, unrolled=True)


def test_the_chip_terms_serve_a_one_device_target_only():
  assert _forecast.terms_for(_targets.resolve("v5e:1x1")) == _forecast.CHIP["v5e"]
  assert (_forecast.terms_for(_targets.resolve("v5e:1x1"), unrolled=True)
          == _forecast.CHIP_UNROLLED["v5e"] != _forecast.CHIP["v5e"])
  assert _forecast.terms_for(_targets.resolve("v5e-8"), unrolled=True) == _forecast.FITTED
  assert _forecast.terms_for(_targets.resolve("v5e-8")) == _forecast.FITTED
  assert _forecast.terms_for(_targets.resolve("v5p:2x2x1")) == _forecast.FITTED
  assert _forecast.FITTED.memory == 1.0  # the pods' fit predates the term: unchanged


PARAMS = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
          "b": jax.ShapeDtypeStruct((512,), jnp.float32)}
W, B = 256 * 512 * 4, 512 * 4  # bytes


@pytest.mark.parametrize("name, reduced", [
    # The global-norm clip's sum of squares reads every gradient once.
    ("adamw", W + B),
    # Adafactor: the clip; the row and column statistics of w's g^2 (one array, one pass);
    # the RMS of each update (clipped at 1); b's moment is a vector, unfactored (no
    # statistics); the mean of w's 256 row statistics (its normaliser).
    ("adafactor", W + B + W + W + B + 256 * 4)])
def test_the_update_reads_again_what_its_reductions_reduce(name, reduced):
  opt = optimizers.transformation(name, 1e-3)
  assert _trace.update_reduced_bytes(opt, PARAMS) == reduced
  loss = lambda p, batch: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2)
  batch = {"x": jax.ShapeDtypeStruct((8, 256), jnp.float32)}
  prof = profile_model(PARAMS, loss, opt, batch, "cpu", cpu_rates=(1e12, 1e11))
  assert prof.update_reduced_bytes == reduced
  # The update's traffic: params, gradients and state read, params and state written, and
  # the reductions' arrays read again (no activations counted here: 0 rows).
  state = 2 * 256 * 512 * 4 + 2 * 512 * 4 + 4 if name == "adamw" else prof.opt_bytes
  want = 3 * (W + B) + 2 * state + reduced
  assert _cost.memory_traffic(prof, False, 0, 1, 1) == pytest.approx(want)


def _hw(kind, generation):
  return _targets.Hardware("t", kind, generation, 1, 1, (1, 1) if kind == "tpu" else (),
                           False, 1e14, 16 * 2**30, _targets.LinkFacts(1e11, 1e10, 1e12))


def _synthetic(head_dim):
  return _cost.Profile(params=10**9, param_bytes=4e9, opt_bytes=8e9, compute_bytes=2e9,
                       grad_bytes=4e9, flops_row=6e12, flops_row_remat=8e12, act_row=1e9,
                       act_row_remat=1e8, layers=10, stream_row=1e6, rows=8, has_remat=True,
                       attn_row=1.2e12, attn_row_remat=1.6e12, causal_share=1.0,
                       attn_kernel=True, tokens_row=1000, head_dim=head_dim)


@pytest.mark.parametrize("remat", [False, True])
def test_heads_narrower_than_the_mxu_take_its_share_of_it(remat):
  """On a TPU heads of 64 fill half of the 128-wide MXU: the attention's executed matmuls
  (the kernel skips half of the causal scores) take twice their time; heads of 128, an
  unknown head dim or a GPU: as counted."""
  terms = _forecast.Terms(matmul=0.5, exposed=0.0, per_doubling=0.0)
  step = lambda hd, hw: _forecast.forecast(
      _synthetic(hd), hw, _cost.estimate(_synthetic(hd), hw, {}, {}, remat, 1), {},
      terms=terms).step_s
  tpu, gpu = _hw("tpu", "v5e"), _hw("gpu", "H100")
  attn = (1.6e12 if remat else 1.2e12) / 2 * 8 / 1e14  # seconds at peak, executed
  assert step(64, tpu) - step(128, tpu) == pytest.approx(attn / 0.5)
  assert step(32, tpu) - step(128, tpu) == pytest.approx(3 * attn / 0.5)
  assert step(0, tpu) == step(128, tpu) == step(256, tpu)
  assert step(64, gpu) == step(128, gpu)


def test_the_profile_reads_the_head_dim_off_the_attention():
  def loss(p, batch):
    x = p["embed"][batch["tokens"]]  # [rows, seq, 4 heads x 32]
    q = x.reshape(*x.shape[:2], 4, 32)
    return jnp.mean(fs.attention(q, q, q, causal=True))
  params = {"embed": jax.ShapeDtypeStruct((50, 128), jnp.float32)}
  batch = {"tokens": jax.ShapeDtypeStruct((2, 64), jnp.int32)}
  prof = profile_model(params, loss, optax.sgd(1e-3), batch, "cpu", cpu_rates=(1e12, 1e11))
  assert (prof.heads, prof.head_dim) == (4, 32)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_the_count_is_what_xla_tpu_compiles_the_update_to(name):
  """XLA:TPU's own count of the compiled update's bytes (`cost_analysis()`, compiled for
  described v5e devices: nothing runs) against the traffic's for one matrix: params,
  gradients and state read, params and state written, the reduced arrays read again."""
  hw = _targets.resolve("v5e:1x1")
  if hw.devices is None:
    pytest.skip(hw.no_devices)
  # 512 MiB: more than v5e's 128 MiB of VMEM, where XLA would stage a smaller array (and
  # count those reads too: "bytes accessed" is of every memory, not HBM's alone).
  params = {"w": jax.ShapeDtypeStruct((8, 2048, 8192), jnp.float32)}
  opt = optimizers.transformation(name, 1e-3)
  state = jax.eval_shape(opt.init, params)
  sharding = jax.sharding.SingleDeviceSharding(hw.devices[0])
  on = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=sharding), t)

  def step(g, s, p):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
  compiled = jax.jit(step, donate_argnums=(1, 2)).lower(
      on(params), on(state), on(params)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  counted = 3 * nbytes(params) + 2 * nbytes(state) + _trace.update_reduced_bytes(opt, params)
  assert cost["bytes accessed"] == pytest.approx(counted, rel=0.01)


def test_the_unrolled_loops_memory_term_is_the_fit_of_their_rows():
  """`CHIP_UNROLLED`'s memory term is what `forecast_fit.py --chip --unrolled` fits on the
  unrolled rows of chip_v5e.json (a row added there refits it, or this fails), on the JAX
  the rows were measured with and libtpu's profile of the steps (jax 0.12's trace fits 1.23;
  the forecast holds within 3 points on both lines: the test above)."""
  if jax.__version__ != "0.10.2" or _targets.resolve("v5e:1x1").devices is None:
    pytest.skip("fitted on jax 0.10.2 with libtpu's profile of the v5e steps")
  assert ff.fit_chip(unrolled=True) == _forecast.CHIP_UNROLLED["v5e"]
