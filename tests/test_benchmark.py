"""recipes/bench/step.py and fnscale.analysis's FLOP counts against hand counts: the `nano` model on 2 devices.

Every expected number below is counted by hand from the model's shapes (the GPT of
recipes/train_lm.py), not recomputed with the benchmark's or fnscale's own formulas.
"""
import dataclasses

import jax
import pytest

import fnscale as fs

from recipes.bench import step as bm
from recipes.lm import gpt as tl

# nano: 2 layers, d_model 64, 4 heads of 16, MLP 256, byte vocab 256; seq 32, 4 rows, 2 devices.
L, D, H, K, F, V = 2, 64, 4, 16, 256, 256
SEQ, ROWS, N = 32, 4, 2

# Every param leaf of nano by hand: (shape, sharded over fsdp by the "embed" rule).
SHAPES = {
    "wte": ((V, D), True), "wpe": ((SEQ, D), True),
    "ln1": ((2, L, D), False), "ln2": ((2, L, D), False), "ln_f": ((2, D), False),
    "w_qkv": ((L, D, 3, H, K), True), "b_qkv": ((L, 3, H, K), False),
    "w_out": ((L, H, K, D), True), "b_out": ((L, D), False),
    "w_fc": ((L, D, F), True), "b_fc": ((L, F), False),
    "w_proj": ((L, F, D), True), "b_proj": ((L, D), False),
}


def _count(sharded=None):
  total = 0
  for shape, is_sharded in SHAPES.values():
    if sharded is None or sharded == is_sharded:
      n = 1
      for s in shape:
        n *= s
      total += n
  return total


PARAMS = _count()                         # 118,528
SHARDED_BYTES = 4 * _count(sharded=True)  # float32: wte, wpe and the 4 block matrices
REPLICATED_BYTES = 4 * _count(sharded=False)
PARAM_BYTES = 4 * PARAMS
TOKENS = ROWS * SEQ
# Matmul FLOPs of one training step, forward counted product by product (2 per multiply-add),
# backward twice the forward: per layer and token q/k/v 2*D*3D, output 2*D*D, MLP 2*2*D*F,
# scores q.k 2*SEQ*D and weights.v 2*SEQ*D (causal attention computed in full); the tied output
# layer 2*D*V. The embedding lookup is a gather, not a matmul.
FWD_PER_TOKEN = L * (2 * D * 3 * D + 2 * D * D + 2 * 2 * D * F + 2 * 2 * SEQ * D) + 2 * D * V
STEP_FLOPS = 3 * FWD_PER_TOKEN * TOKENS   # 94,371,840


def test_hand_counts_are_what_they_claim():
  # The hand tables above describe the model train_lm builds (else every test below is moot).
  params = jax.eval_shape(lambda: tl.init_params(tl.model_config("nano", SEQ),
                                                 jax.random.key(0)))
  assert sum(x.size for x in jax.tree.leaves(params)) == PARAMS == 118528
  assert STEP_FLOPS == 94371840


def test_model_flops_per_token_against_hand_count():
  nano = tl.model_config("nano", SEQ)
  assert tl.flops_per_token(nano) == 3 * FWD_PER_TOKEN
  assert bm.model_flops_per_step(nano, ROWS) == STEP_FLOPS
  # PaLM appendix B: 6 N + 12 L d seq with N the matmul weights (blocks + tied output layer).
  assert fs.analysis.model_flops_per_token(params=L * 12 * D * D + V * D, layers=L, d_model=D,
                                     seq=SEQ) == 3 * FWD_PER_TOKEN
  with pytest.raises(fs.FnscaleError, match="layers=-1"):
    fs.analysis.model_flops_per_token(params=1, layers=-1, d_model=1, seq=1)
  # 1 GFLOP in 0.5 s on 2 x 1 GFLOP/s
  assert fs.analysis.mfu(1e9, 0.5, 2, 1e9) == pytest.approx(1.0)
  assert fs.analysis.mfu(3e9, 2.0, 4, 1e9) == pytest.approx(0.375)
  with pytest.raises(fs.FnscaleError, match="step_seconds=0"):
    fs.analysis.mfu(1e9, 0, 2, 1e9)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  """The data-parallel, FSDP and FSDP shard_map rows of nano on 2 devices, and one overhead."""
  cache = str(tmp_path_factory.mktemp("cache"))
  with bm.persistent_cache(cache):
    out = {spec: bm.measure("nano", spec, N, batch=ROWS, seq=SEQ, steps=2, warmup=1,
                            peak_per_device=1e9)
           for spec in ("data=-1", "fsdp=-1", "fsdp=-1@shard_map")}
    over = bm.overhead("nano", "data=-1", N, batch=ROWS, seq=SEQ, rounds=6, warmup=1)
  assert jax.config.jax_compilation_cache_dir != cache  # the previous settings are restored
  return out, over


@pytest.mark.slow
def test_hlo_matmul_flops_equal_the_hand_count(rows):
  measured, _ = rows
  for spec, r in measured.items():
    # Replicated attention (activations that lost their batch split) would be ~1.1x; a
    # missing backward matmul < 1.
    assert r.model_flops == STEP_FLOPS, spec
    assert r.hlo_dot_flops / STEP_FLOPS == pytest.approx(1.0, abs=1e-6), spec
    assert bm.flop_check(r)[0], bm.flop_check(r)[1]
    # XLA's cost analysis counts each loop body once: the 2-layer scan is under-counted.
    assert r.xla_flops == pytest.approx(r.xla_flops_per_device * N)
    assert r.hlo_dot_flops_once < r.hlo_dot_flops


@pytest.mark.slow
def test_flop_check_rejects_a_replicated_matmul(rows):
  r = rows[0]["fsdp=-1"]
  more = dataclasses.replace(r, hlo_dot_flops=r.hlo_dot_flops * 1.1)
  ok, why = bm.flop_check(more)
  assert not ok and "1.100" in why and "more than the model" in why
  ok, why = bm.flop_check(dataclasses.replace(r, hlo_dot_flops=r.hlo_dot_flops * 0.99))
  assert not ok and "less than the formula" in why


@pytest.mark.slow
def test_step_figures(rows):
  measured, _ = rows
  for r in measured.values():
    assert r.devices == N and r.params == PARAMS and r.param_bytes_total == PARAM_BYTES
    assert r.step_p10_s <= r.step_s <= r.step_p90_s and r.compile_cold_s > 0
    assert r.warm_from_cache, "the warm compile must come from the persistent cache"
    assert r.tokens_per_s == pytest.approx(TOKENS / r.step_s)
    assert r.mfu == pytest.approx(STEP_FLOPS / r.step_s / (N * 1e9))


@pytest.mark.slow
def test_params_and_arguments_per_device(rows):
  measured, _ = rows
  batch_bytes = 2 * ROWS * SEQ * 4 // N  # int32 inputs and targets, rows split over 2
  expect = {"data=-1": PARAM_BYTES,
            "fsdp=-1": SHARDED_BYTES // N + REPLICATED_BYTES,
            "fsdp=-1@shard_map": SHARDED_BYTES // N + REPLICATED_BYTES}
  for spec, r in measured.items():
    assert r.param_bytes == expect[spec], spec
    # Arguments: params and AdamW's two moments, the batch shard, and a few int32 counters.
    low = 3 * expect[spec] + batch_bytes
    assert low <= r.argument_bytes <= low + 64, (spec, r.argument_bytes, low)


@pytest.mark.slow
def test_wire_bytes_against_the_textbook_volume(rows):
  measured, _ = rows
  ring = (N - 1) / N
  # Data parallel: one ring all-reduce of every gradient, 2 (n-1)/n x param bytes.
  dp = measured["data=-1"]
  textbook_dp = 2 * ring * PARAM_BYTES
  assert dp.theory == {"dp": textbook_dp, "fsdp": 0.0, "tp": 0.0, "total": textbook_dp}
  assert set(dp.collectives) == {"all-reduce"}
  # Measured (jax 0.10.2, CPU): the textbook volume plus the loss, and the tied embedding's
  # gradient reduced in two parts (its lookup and its use as the output layer): + V x D x 4,
  # the same with a plain `wte[tokens]` lookup (data parallel keeps the table whole).
  assert textbook_dp <= dp.wire_bytes <= textbook_dp + 2 * ring * V * D * 4 + 64, dp.wire_bytes
  # FSDP (ZeRO-3): all-gather sharded params forward and backward and reduce-scatter their
  # gradients, 3 (n-1)/n x sharded bytes; all-reduce the replicated leaves' gradients.
  textbook_fsdp = 3 * ring * SHARDED_BYTES + 2 * ring * REPLICATED_BYTES
  fsdp = measured["fsdp=-1"]
  assert fsdp.theory["total"] == pytest.approx(textbook_fsdp)
  assert fsdp.collectives["all-gather"][1] >= SHARDED_BYTES  # every sharded param gathered
  # At least: gather the other shards once and reduce every gradient once.
  assert fsdp.wire_bytes >= ring * (SHARDED_BYTES + PARAM_BYTES)
  # At most: XLA's CPU backend all-reduces the gradients (2 (n-1)/n) where the textbook
  # reduce-scatters ((n-1)/n). Nothing for the table beyond that: the lookup moves ids and
  # activations, and its gradient lands in each device's own [V, D / n] block.
  assert fsdp.wire_bytes <= textbook_fsdp + ring * PARAM_BYTES, fsdp.wire_bytes
  # shard_map mode gathers the whole state (params and both AdamW moments) at entry and
  # all-reduces (pmean) every gradient.
  smap = measured["fsdp=-1@shard_map"]
  assert smap.collectives["all-gather"][1] == 3 * SHARDED_BYTES
  assert smap.wire_bytes <= 3 * ring * SHARDED_BYTES + 2 * ring * PARAM_BYTES + 64


@pytest.mark.slow
def test_compile_report_and_benchmark_read_the_same_collectives(rows):
  for r in rows[0].values():
    assert {k: v[:2] for k, v in r.report_collectives.items()} == {
        k: v[:2] for k, v in r.collectives.items()}


@pytest.mark.slow
def test_overhead_is_the_same_program(rows):
  _, over = rows
  # Same math: the fnscale step and the hand-written jax.jit step give the same params, to
  # rounding: the two programs (fnscale's computes its metrics too) fuse, and so round, the
  # gradients apart, and AdamW's division by their root mean square turns that into up to
  # 3e-6 here over the warm-up and 6 rounds (seen in CI); other math moves params by up to
  # its lr, 1e-3, a step.
  assert over.max_param_diff < 1e-4
  # The same compiled program: its executable alone runs as fast as the hand-written one
  # (medians of alternated rounds; 1.5 leaves room for a loaded machine, a program doing
  # twice the work would not fit).
  assert 0 < over.program_ratio < 1.5, over
  assert over.ratio > 0 and over.ratio_p10 <= over.ratio <= over.ratio_p90
  # Beside the hand-written step that computes fnscale's metrics too, its program is that
  # computation (a program with a second step's work would not fit under 1.5).
  assert 0 < over.program_vs_metrics_cpu < 1.5 and over.metrics_cpu_ratio > 0, over


@pytest.mark.slow
def test_tables(rows):
  measured, over = rows
  text = bm.tables(list(measured.values()), [over], peak_note="peak: test", header="test")
  for field in ("compile cold s", "warm s (cache)", "step ms median", "tokens/s", "MFU",
                "model FLOPs/step", "HLO matmul FLOPs", "XLA cost analysis", "params/dev",
                "temporaries", "sent per step", "textbook", "ratio median",
                "jax.jit + metrics ms", "CPU s ratio"):
    assert field in text
  assert "(1.00x)" in text and "largest difference +0.0%" in text
  assert "| nano | data=2 | 2 | 463.00 KiB | 1/1.00 |" in text  # 474,112 bytes
  assert "| nano | fsdp=2 | 2 | 235.00 KiB | 1/1.97 |" in text  # 240,640 bytes


def test_bad_size_and_flags():
  with pytest.raises(fs.FnscaleError, match="'huge'"):
    bm.model_config("huge", 32)
  with pytest.raises(fs.FnscaleError, match="--steps=0"):
    bm.parse_flags(["benchmark", "--steps=0"])
  with pytest.raises(fs.MeshError, match="16 devices requested"):
    bm._mesh("data=-1", 16)


def test_compare_maxtext_asks_maxtext_for_its_ulysses_as_its_config_spells_it():
  """MaxText 0.2.5's configs/types.py: context_parallel_strategy "ulysses" needs Tokamax
  splash and no load-balancing reorder (it raises otherwise); fnscale's side the plain order."""
  from recipes.bench import compare_maxtext as cm  # pylint: disable=import-outside-toplevel
  a = cm._flags(  # pylint: disable=protected-access
      ["--mesh=context=4", "--context_strategy=ulysses"])
  argv = cm._maxtext_argv(a)  # pylint: disable=protected-access
  assert {"context_parallel_strategy=ulysses", "use_tokamax_splash=true",
          "context_parallel_load_balance=false", "ici_context_parallelism=4"} <= set(argv)
  assert cm._flags(["--mesh=context=4"]).load_balance  # pylint: disable=protected-access


def test_compare_maxtext_says_when_two_compilers_made_the_programs():
  """Temp memory depends on the libtpu release as much as on the program: the table names each
  side's compiler and says how to get one compiler for both when they differ."""
  from recipes.bench import compare_maxtext as cm  # pylint: disable=import-outside-toplevel
  side = dict(matmul_flops=2e12, collectives={"all-gather": (2, 4 * 2**20)}, dcn_sent=0,
              argument=2**30, temp=2**31, compile_seconds=3.0, kernels={},
              compiler="jax 0.12.0.1, libtpu 0.0.52")
  same = cm.table({"maxtext": side, "fnscale": dict(side, temp=2**30)})
  assert "| compiler | jax 0.12.0.1, libtpu 0.0.52 | jax 0.12.0.1, libtpu 0.0.52 | same |" in same
  assert "| temp memory | 2.00 GiB | 1.00 GiB | 0.50x |" in same
  assert "--fnscale_python" not in same
  other = cm.table({"maxtext": side, "fnscale": dict(side, compiler="jax 0.10.2, libtpu 0.0.42")})
  assert "| **differ** |" in other and "--fnscale_python=maxtext-venv/bin/python" in other
  old = {k: v for k, v in side.items() if k != "compiler"}  # written before compilers were kept
  assert "| compiler | unknown | jax 0.12.0.1" in cm.table({"maxtext": old, "fnscale": side})
  assert cm._compiler().startswith(f"jax {jax.__version__}, libtpu ")  # pylint: disable=protected-access
