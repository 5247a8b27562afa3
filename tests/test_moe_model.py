"""The Mixtral- and DeepSeek-style models of recipes/lm/moe.py: their counts against the
published figures and hand counts, a sharded train step against a one-device loss, the
planner's view of them, and their program for a TPU target (ragged all-to-all bytes by hand).
"""
import copy
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.analysis import _cost, _targets, hlo
from fnscale.analysis import PlanOptions, plan, predict
from recipes.lm import moe

GiB = 2**30


def test_mixtral_counts_are_mistrals():
  # Mistral's Mixtral 8x7B: 46.7B params, 12.9B active per token (mistral.ai, "Mixtral of
  # experts", 2023); the counts here count the embedding lookup as a param, not a matmul.
  cfg = moe.model_config("moe-mixtral-8x7b", 4096)
  assert moe.param_count(cfg) == pytest.approx(46.7e9, rel=0.005)
  active = moe.active_matmul_params(cfg) + cfg.vocab * cfg.d_model  # + the lookup table
  assert active == pytest.approx(12.9e9, rel=0.01)
  # 6 x active matmul weights + attention's 12 layers (heads head_dim) seq (PaLM).
  assert moe.flops_per_token(cfg) == 6 * moe.active_matmul_params(cfg) + 12 * 32 * 4096 * 4096


def test_bad_model_configs_name_the_fix():
  with pytest.raises(fs.ExpertError, match="k=9 .* fix: lower k"):
    moe.model_config("moe-tiny", 16, k=9)
  with pytest.raises(fs.ExpertError, match="capacity_factor"):
    moe.model_config("moe-tiny", 16, capacity_factor=0.0)
  cfg = moe.model_config("moe-tiny", 16, d_ff=24)  # a shape no size has: say how it routes
  params = jax.eval_shape(functools.partial(moe.init_params, cfg), jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  with pytest.raises(fs.InputError, match="pass cfg="):
    jax.eval_shape(moe.apply, params, tokens)
  assert jax.eval_shape(functools.partial(moe.apply, cfg=cfg), params, tokens).shape == (
      2, 16, 256)


TINY = dict(layers=1, d_model=32, heads=2, kv_heads=2, d_ff=32)


def _batch(rows, seq, seed=0):
  toks = np.random.default_rng(seed).integers(0, 256, (rows, seq + 1)).astype(np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


@pytest.mark.slow
def test_sampling_continues_a_prompt_with_the_models_own_argmax():
  """`sampling.generate` (train_lm's sample) drives the MoE model's apply, positions given:
  greedy tokens are the argmax of the model's logits, token by token."""
  from recipes.lm import sampling  # pylint: disable=import-outside-toplevel
  cfg = moe.model_config("moe-tiny", 8, **TINY)
  params = moe.init_params(cfg, jax.random.key(1))
  one = jax.sharding.NamedSharding(fs.make_mesh({"data": 1}, devices=jax.devices()[:1]),
                                   jax.P())
  got = sampling.generate(functools.partial(moe.apply, cfg=cfg), jax.device_put(params, one),
                     [1, 2, 3], sampling.Sampling(length=4, seq=8, temperature=0.0, seed=0))
  buf = np.zeros((1, 8), np.int32)
  buf[0, :3] = [1, 2, 3]
  logits = jax.jit(functools.partial(moe.apply, cfg=cfg))
  for pos in range(3, 7):  # causal: the zeros after pos don't change its logits
    buf[0, pos] = int(np.argmax(logits(params, buf)[0, pos - 1]))
  assert got == buf[0, 3:7].tolist()


@pytest.mark.parametrize("size", ["moe-deepseek-tiny"])
def test_a_step_over_the_expert_axis_trains_and_equals_one_device(size):
  cfg = moe.model_config(size, 8, **TINY)
  loss = functools.partial(moe.loss_and_aux, cfg=cfg)
  mesh = fs.make_mesh({"data": 2, "expert": 4})
  opt = optax.adam(1e-2)
  batch = _batch(16, 8)
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(moe.init_params, cfg), opt, mesh=mesh,
                          rules=moe.RULES, logical_axes=moe.logical_axes(cfg),
                          key=jax.random.key(0))
    assert state.params["blocks"]["w_gate"].sharding.spec[1] == "expert"
    first = jax.device_get(state.params)
    step = fs.shard_step(fs.train_step(loss, opt, has_aux=True), mesh, rules=moe.RULES,
                         logical_axes=moe.logical_axes(cfg))
    b = fs.global_batch(batch, fs.batch_sharding(mesh))
    losses = []
    for _ in range(4):
      state, m = step(state, b)
      losses.append(float(m["loss"]))
  # The first step's loss is the loss of the initial params on one device (no mesh).
  want, aux = jax.jit(loss)(first, batch)
  np.testing.assert_allclose(losses[0], float(want), rtol=2e-6)
  assert losses[-1] < losses[0] - 0.1  # it trains
  # Every token's k copies are counted, on one device and summed over the shards alike.
  load = np.asarray(m["aux"]["tokens_per_expert"])
  assert load.shape == (1, cfg.experts) and load.sum() == 16 * 8 * cfg.k
  assert np.asarray(aux["tokens_per_expert"]).sum() == 16 * 8 * cfg.k


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_the_planner_reads_the_experts_off_the_traced_step():
  cfg = moe.model_config("moe-tiny", 16, layers=2)
  rows = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  prof = fs.analysis.profile_model(
      functools.partial(moe.init_params, cfg), functools.partial(moe.loss_fn, cfg=cfg),
      optax.adam(1e-3), {"inputs": rows, "targets": rows}, "v5p-8")
  L, E, D, F, k = cfg.layers, cfg.experts, cfg.d_model, cfg.d_ff, cfg.k
  assert (prof.experts, prof.expert_k) == (E, k)
  assert prof.expert_params == L * 3 * E * D * F  # all experts' gate, up and down
  assert prof.exchange_row == L * 16 * k * D * 4  # each layer's copies, float32
  # Model FLOPs: the active params' (a token's k experts), as the model counts them.
  assert prof.flops_row == pytest.approx(16 * moe.flops_per_token(cfg), rel=1e-3)
  # On an expert axis of 4 the expert weights split 4 ways, the rest stays whole: a
  # replica of the attention, embeddings and router on each device; the buffers hold
  # 4 x min(k, E / 4) / k = 4 times the routed copies.
  prof = prof._replace(rows=8)
  e4 = predict(prof, "v5p-8", fs.MeshAxes({"expert": 4}, {}))
  d4 = predict(prof, "v5p-8", fs.MeshAxes({"data": 4}, {}))
  x = prof.expert_params / prof.params
  assert e4.estimate.params == pytest.approx(prof.param_bytes * ((1 - x) + x / 4))
  assert d4.estimate.params == pytest.approx(prof.param_bytes)
  assert _cost.buffer_factor(prof, 4) == 4
  # Its all-to-alls: 4 passes (dispatch, combine; forward, backward) of 2 rows' copies,
  # 3/4 of them leaving the device, beside the other params' gradient all-reduce.
  hw = _targets.resolve("v5p-8")
  bw = _cost.axis_bandwidth(hw, {"expert": 4}, {})["expert"]
  a2a = 4 * 3 / 4 * prof.exchange_row * 2
  allreduce = 2 * 3 / 4 * prof.grad_bytes * (1 - x)
  assert e4.estimate.comm_s["expert"] == pytest.approx((a2a + allreduce) / bw)


@pytest.mark.slow
def test_tpu_program_sends_the_hand_count_and_the_plan_verifies(tpu_devices):
  """Compiled for a described v5p-8 (4 chips), expert=4: each ragged all-to-all moves a
  device's tokens x k copies of d_model (dispatch) or receives them back (combine):
  forward, backward and remat's recomputation, per layer."""
  del tpu_devices
  seq, rows, layers = 256, 8, 2
  cfg = moe.model_config("moe-tiny", seq, layers=layers, d_model=256, heads=2, kv_heads=2,
                         d_ff=512)
  batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("inputs", "targets")}
  p = plan(functools.partial(moe.init_params, cfg), functools.partial(moe.loss_fn, cfg=cfg),
           optax.adamw(1e-3), batch, "v5p-8",
           PlanOptions(policy="params=float32,compute=bfloat16", rules=moe.RULES,
                       logical_axes=moe.logical_axes(cfg), verify=1, max_tensor=1))
  assert p.profile.experts == 8 and any("expert" in r.axes.ici for r in p.rows)
  assert p.rows[0].compiled is not None
  mesh = fs.make_mesh({"expert": 4}, devices=fs.target_devices("v5p-8"))
  opt = optax.adamw(1e-3)
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(moe.init_params, cfg), opt, mesh=mesh,
                          rules=moe.RULES, logical_axes=moe.logical_axes(cfg),
                          policy="params=float32,compute=bfloat16", key=jax.random.key(0),
                          abstract=True)
    step = fs.train_step(functools.partial(moe.loss_fn, cfg=cfg, remat=True), opt,
                         policy="params=float32,compute=bfloat16")
    compiled = fs.shard_step(step, mesh, rules=moe.RULES,
                             logical_axes=moe.logical_axes(cfg)).compile(state, batch)
  s = hlo.summarize(compiled.compiled.as_text())
  assert not s.unread.count
  ragged = s.collective("ragged-all-to-all")
  per_pass = rows // 4 * seq * cfg.k * cfg.d_model * 2  # bf16 copies of one device
  assert ragged.count == layers * 6 and ragged.bytes == layers * 6 * per_pass
  report = str(fs.compile_report(compiled, state, batch))
  assert "ragged-all-to-all" in report


# ---------------------------------------------------------------------------- Hugging Face

NO_TORCH = ("transformers and PyTorch's CPU build are test-only dependencies for Python < 3.12 "
            "(pyproject's hf-test extra); the comparison with transformers runs on that line")
MIXTRAL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
               num_experts_per_tok=2, max_position_embeddings=64, rope_theta=1e6,
               router_aux_loss_coef=0.02)
# Qwen3-MoE: a head size of its own (16, not 32 / 4), q/k norms, narrow experts.
QWEN3_MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                 max_position_embeddings=64, rope_theta=1e6, router_aux_loss_coef=0.001)
HF_MOE = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL),
          "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
          "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                     dict(QWEN3_MOE, norm_topk_prob=False)),
          # YaRN at factor 4 over 64 positions: of the 8 frequencies 1 kept, 2 blended.
          "qwen3_moe_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
              QWEN3_MOE, rope_theta=1e4, max_position_embeddings=256, rope_scaling=dict(
                  rope_type="yarn", factor=4.0, original_max_position_embeddings=64)))}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
  """family -> a tiny random model of `HF_MOE` saved in ~20 KB files, its logits for two
  rows; made on first use."""
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  from recipes.bench import hf_checkpoint as bench  # pylint: disable=import-outside-toplevel
  transformers.logging.set_verbosity_error()
  made = {}

  def make(family):
    if family not in made:
      config, model_cls, fields = HF_MOE[family]
      d = tmp_path_factory.mktemp(family)
      model = bench.randomize(getattr(transformers, model_cls)(
          getattr(transformers, config)(**fields)))
      model.save_pretrained(d, max_shard_size="20KB")
      tokens = bench.tokens(16)
      with torch.no_grad():
        made[family] = d, tokens, model(torch.tensor(tokens)).logits.numpy()
    return made[family]
  return make


def test_mixtral_configs_read_as_the_moe_model():
  from recipes.lm import hf_maps  # pylint: disable=import-outside-toplevel
  c = dict(MIXTRAL, model_type="mixtral", rope_theta=1e6)
  m = hf_maps.from_config(c, 16)
  assert m.model is moe and m.cfg == moe.ModelConfig(
      layers=2, d_model=32, heads=4, kv_heads=2, d_ff=48, experts=8, k=2, seq=16, vocab=64,
      balance_coef=0.04, rope_theta=1e6, norm_eps=1e-6)
  # What the MoE model can't compute is named, never a silently different model.
  for change, field in ((dict(tie_word_embeddings=True), "tie_word_embeddings"),
                        (dict(head_dim=16), "head_dim=16"),
                        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
                        (dict(num_experts_per_tok=None), "num_experts_per_tok=None")):
    with pytest.raises(fs.InputError, match=field):
      hf_maps.from_config(dict(c, **change), 16)
  # A model trained here exports a config transformers' Mixtral reads as the same model.
  back = hf_maps.from_config(hf_maps.to_config(hf_maps.of_model(moe, m.cfg)), 16)
  assert back.cfg == m.cfg
  with pytest.raises(fs.InputError, match="shared experts"):
    hf_maps.to_config(hf_maps.of_model(moe, moe.model_config("moe-deepseek-tiny", 16)))


def test_qwen3_moe_configs_read_as_the_moe_model():
  from recipes.lm import hf_maps, layers  # pylint: disable=import-outside-toplevel
  c = dict(QWEN3_MOE, model_type="qwen3_moe")
  m = hf_maps.from_config(c, 16)
  assert m.model is moe and m.cfg == moe.ModelConfig(
      layers=2, d_model=32, heads=4, kv_heads=2, d_ff=24, experts=8, k=3, seq=16, vocab=64,
      balance_coef=0.003, rope_theta=1e6, norm_eps=1e-6, head_size=16, qk_norm=True)
  assert not hf_maps.from_config(dict(c, norm_topk_prob=False), 16).cfg.normalize
  for change, field in ((dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\]"),
                        (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
                        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
                        (dict(num_experts=None), "num_experts=None")):
    with pytest.raises(fs.InputError, match=field):
      hf_maps.from_config(dict(c, **change), 16)
  # Trained here (no config.json read): a Qwen3-MoE config.json that reads back the same,
  # YaRN's RoPE (its fields written) included.
  yarn = layers.Yarn(factor=4.0, original_max_position=64, mscale=0.8, truncate=False)
  for cfg in (m.cfg, m.cfg._replace(normalize=False), m.cfg._replace(rope_scaling=yarn)):
    assert hf_maps.from_config(hf_maps.to_config(hf_maps.of_model(moe, cfg)), 16).cfg == cfg
  tiny = moe.model_config("moe-qwen3-tiny", 16)
  assert hf_maps.to_config(hf_maps.of_model(moe, tiny))["model_type"] == "qwen3_moe"


def _load_over_experts_export_and_compare(src, tokens, want, out, written=False):
  """The checkpoint at `src` loaded split over experts ({"data": 2, "expert": 4}) gives
  transformers' logits `want` for `tokens`; its params changed as training would, exported
  to `out` (config.json: the one read, or with `written` one written from the model's
  config), give transformers' logits there equal to fnscale's, which moved. Returns the
  model read (an `hf_maps.HFModel`)."""
  from fnscale.checkpoint import hf  # pylint: disable=import-outside-toplevel
  from recipes.lm import hf_maps  # pylint: disable=import-outside-toplevel
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  m = hf_maps.read(src, tokens.shape[1])
  mesh = fs.make_mesh({"data": 2, "expert": 4})
  target = fs.init_state(functools.partial(m.model.init_params, m.cfg), optax.sgd(0.1),
                         mesh=mesh, rules=m.model.RULES,
                         logical_axes=m.model.logical_axes(m.cfg), key=jax.random.key(0),
                         abstract=True).params
  params = hf.load(src, target, hf_maps.checkpoint_map(m, src))
  assert params["blocks"]["w_gate"].sharding.spec[1] == "expert"
  run = jax.jit(functools.partial(m.model.apply, cfg=m.cfg))
  with fs.with_mesh(mesh):
    got = np.asarray(run(params, jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  changed = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.01 + 0.003, p))(params)
  saved = hf_maps.of_model(m.model, m.cfg) if written else m
  hf.export(out, changed, hf_maps.checkpoint_map(saved), config=hf_maps.to_config(saved),
            max_shard_bytes=20_000)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  with fs.with_mesh(mesh):
    ours = np.asarray(run(changed, jnp.asarray(tokens)))
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  assert not np.allclose(theirs, want, atol=1e-3)  # the change shows
  return m


@pytest.mark.parametrize("family", [
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("qwen3_moe_unnormalised", marks=pytest.mark.slow),
    pytest.param("qwen3_moe_yarn", marks=pytest.mark.slow)])
def test_hf_moe_loads_split_over_experts_and_exports_for_transformers(hf_moe, tmp_path,
                                                                       family):
  d, tokens, want = hf_moe(family)
  fields = HF_MOE[family][2]
  m = _load_over_experts_export_and_compare(d, tokens, want, tmp_path)
  k = fields["num_experts_per_tok"]
  assert m.model is moe and (m.cfg.experts, m.cfg.k) == (8, k)
  # HF's coefficient x k: the same loss
  assert m.cfg.balance_coef == pytest.approx(fields["router_aux_loss_coef"] * k)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["moe-deepseek-tiny"])  # moe-tiny: the README's run
def test_train_lm_trains_a_mixture_of_experts_over_the_expert_axis(work, tmp_path, size, capsys):
  import json  # pylint: disable=import-outside-toplevel
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  summary = train_lm.train_lm(
      model_config=size, mesh="data=2,expert=4", seq=32, global_batch=32, steps=24,
      dataset=str(work / "corpus.txt"), run_dir=str(tmp_path / "run"), eval_batches=1,
      log_every=4, eval_every=12, sample_len=0, checkpoint=False)
  assert summary.mesh == {"data": 2, "expert": 4}
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  evals = [r["eval/loss"] for r in records if "eval/loss" in r]
  assert evals[-1] < evals[0] - 1.0  # it learns
  load = [r for r in records if "moe/load_max_over_mean" in r]
  assert len(load) >= 6 and all(r["moe/load_max_over_mean"] >= 1.0 and r["moe/dropped"] == 0
                                for r in load)
  assert "experts: busiest" in capsys.readouterr().out


# DeepSeek-V3's routed layer: 16 experts in 4 groups, 2 groups a token, 3 experts of them,
# weights renormalised and scaled by 2.5; a random selection bias that changes the choice.
V3_MOE = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, n_group=4,
              topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
              routed_scaling_factor=2.5, n_shared_experts=1, hidden_act="silu")


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "expert": 4}])
def test_deepseek_v3_routing_matches_transformers_moe_layer(axes):
  """fs.parallel.moe with Scoring("sigmoid", groups, topk_groups, scale) and a router_bias
  against transformers' DeepseekV3MoE's routed experts (its output less its shared expert),
  on one device's split and over an expert axis."""
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  layer = v3.DeepseekV3MoE(transformers.DeepseekV3Config(**V3_MOE)).eval()
  with torch.no_grad():
    for p in layer.parameters():
      p.normal_(0.0, 0.3)
    layer.gate.e_score_correction_bias.normal_(0.0, 0.2)
    h = torch.randn(2, 8, 32)
    want = (layer(h) - layer.shared_experts(h)).numpy()
    F = V3_MOE["moe_intermediate_size"]
    gate_up = layer.experts.gate_up_proj.numpy()  # [E, 2F, D]: gate rows, then up rows
    params = {"router": layer.gate.weight.numpy().T,
              "router_bias": layer.gate.e_score_correction_bias.numpy(),
              "w_gate": gate_up[:, :F].transpose(0, 2, 1), "w_up": gate_up[:, F:].transpose(0, 2, 1),
              "w_down": layer.experts.down_proj.numpy().transpose(0, 2, 1)}
  scoring = fs.parallel.Scoring("sigmoid", groups=4, topk_groups=2, scale=2.5)
  mesh = fs.make_mesh(axes)
  run = jax.jit(lambda x, p: fs.parallel.moe(x, p, 3, scoring=scoring)[0])
  with fs.with_mesh(mesh):
    got = np.asarray(run(jnp.asarray(h.numpy()), params))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  # Without the bias the choice differs: the bias is what steers it.
  with fs.with_mesh(mesh):
    unbiased = np.asarray(run(jnp.asarray(h.numpy()), {**params, "router_bias": 0 * params[
        "router_bias"]}))
  assert not np.allclose(unbiased, want, atol=1e-3)


def test_deepseek_v3_scoring_and_bias_that_cant_route_are_named():
  x = jnp.ones((1, 4, 8))
  rng = np.random.default_rng(0)
  params = {"router": rng.normal(size=(8, 6)), "w_gate": rng.normal(size=(6, 8, 4)),
            "w_up": rng.normal(size=(6, 8, 4)), "w_down": rng.normal(size=(6, 4, 8))}
  for scoring in (fs.parallel.Scoring("sigmoid", groups=4),  # 4 doesn't divide 6
                  fs.parallel.Scoring("softplus"), fs.parallel.Scoring(groups=2, topk_groups=3)):
    with pytest.raises(fs.ExpertError, match="scoring="):
      fs.parallel.moe(x, params, 2, scoring=scoring)
  with pytest.raises(fs.ExpertError, match="router_bias has shape"):
    fs.parallel.moe(x, {**params, "router_bias": np.zeros(5)}, 2)


def test_the_bias_update_moves_each_expert_towards_the_mean_load():
  """DeepSeek-V3's update by hand: mean load 4; expert 0 (6) down, 1 (2) up, 2 (4) still."""
  new = fs.parallel.update_router_bias(np.full((2, 3), 0.25), np.array([[6, 2, 4],
                                                                         [4, 4, 4]]), 0.5)
  np.testing.assert_allclose(new, [[-0.25, 0.75, 0.25], [0.25, 0.25, 0.25]])


# A tiny DeepSeek-V3: 3 layers (the first dense), multi-head latent attention with a query
# latent (and without), 8 experts in 4 groups (2 a token), 1 shared; random selection biases.
DEEPSEEK_V3 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                   qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
                   max_position_embeddings=64)
# DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1: cos and sin unscaled, the
# softmax scale times (0.1 ln 40 + 1)^2) over 64 positions: of the 4 rotary frequencies,
# 1 kept, 1 blended, 2 divided by 40.
DEEPSEEK_YARN = dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0,
                     mscale_all_dim=1.0, original_max_position_embeddings=64)
HF_DEEPSEEK = {"deepseek_v3": DEEPSEEK_V3,
               "deepseek_v3_no_q_latent": dict(DEEPSEEK_V3, q_lora_rank=None),
               "deepseek_v3_yarn": dict(DEEPSEEK_V3, qk_rope_head_dim=8, rope_theta=1e4,
                                        max_position_embeddings=2560,
                                        rope_scaling=DEEPSEEK_YARN)}


def test_the_published_deepseek_v3_config_reads_with_its_yarn_and_writes_it_back():
  # deepseek-ai/DeepSeek-V3's config.json (less its fp8 quantization_config, which a bf16
  # copy drops): YaRN at factor 40 from 4096 positions, mscale = mscale_all_dim = 1.
  from recipes.lm import deepseek, hf_maps, layers  # pylint: disable=import-outside-toplevel
  c = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
           attention_bias=False, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
           intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840,
           moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256,
           n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128,
           num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
           num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128,
           qk_rope_head_dim=64, rms_norm_eps=1e-06, rope_theta=10000,
           rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0,
                             mscale_all_dim=1.0, original_max_position_embeddings=4096,
                             type="yarn"),
           routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False,
           topk_group=4, topk_method="noaux_tc", v_head_dim=128, vocab_size=129280)
  m = hf_maps.from_config(c, 4096)
  yarn = layers.Yarn(factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0)
  assert m.cfg == deepseek.model_config("deepseek-v3", 4096, rope_scaling=yarn)
  # cos and sin unscaled (mscale / mscale_all_dim); the logits' scale by hand:
  # (0.1 ln 40 + 1)^2 / sqrt(128 + 64).
  assert yarn.attention_scale == 1.0
  assert deepseek.softmax_scale(m.cfg) == pytest.approx(1.368888 ** 2 / 192 ** 0.5, rel=1e-6)
  assert deepseek.softmax_scale(m.cfg._replace(rope_scaling=None)) == 1 / math.sqrt(192)
  # Exported from the model's config: the same RoPE fields, read back as the same model.
  out = hf_maps.to_config(hf_maps.of_model(deepseek, m.cfg))
  assert out["rope_scaling"] == dict(rope_type="yarn", factor=40, beta_fast=32, beta_slow=1,
                                     mscale=1.0, mscale_all_dim=1.0,
                                     original_max_position_embeddings=4096)
  assert (out["rope_theta"], out["max_position_embeddings"]) == (10000, 163840)
  assert hf_maps.from_config(out, 4096).cfg == m.cfg


@pytest.mark.parametrize("family", [
    pytest.param("deepseek_v3"), pytest.param("deepseek_v3_yarn"),
    pytest.param("deepseek_v3_no_q_latent", marks=pytest.mark.slow)])
def test_deepseek_v3_loads_over_experts_with_transformers_logits_and_exports(tmp_path, family):
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  from recipes.bench import hf_checkpoint as bench  # pylint: disable=import-outside-toplevel
  from recipes.lm import deepseek  # pylint: disable=import-outside-toplevel
  transformers.logging.set_verbosity_error()
  fields = copy.deepcopy(HF_DEEPSEEK[family])  # transformers' config rewrites rope_scaling
  model = bench.randomize(transformers.DeepseekV3ForCausalLM(
      transformers.DeepseekV3Config(**fields)))
  with torch.no_grad():
    for layer in model.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
  model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
  tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  # Exported with a config.json written from the model's config (as a model trained here).
  m = _load_over_experts_export_and_compare(tmp_path / "src", tokens, want, tmp_path / "out",
                                            written=True)
  assert m.model is deepseek and (m.cfg.dense_layers, m.cfg.groups, m.cfg.topk_groups) == (1, 4, 2)


@pytest.mark.slow
def test_a_deepseek_step_moves_each_layers_bias_towards_the_mean_load():
  """train_lm's step for the DeepSeek model (`models.with_balancing`): after one step from a
  zero bias, each MoE layer's router_bias is bias_rate x sign(mean load - load), the load
  being the step's own routing of its batch (the forward pass of the params it started from,
  read here); every other param is what the optimizer alone gives."""
  from recipes.lm import deepseek, models  # pylint: disable=import-outside-toplevel
  cfg = deepseek.model_config("deepseek-tiny", 16, bias_rate=0.25)
  init = functools.partial(deepseek.init_params, cfg)
  mesh = fs.make_mesh({"data": 2, "expert": 4})
  opt = optax.sgd(0.1)
  loss = functools.partial(deepseek.loss_and_aux, cfg=cfg)
  kw = dict(rules=deepseek.RULES, logical_axes=deepseek.logical_axes(cfg))
  tokens = np.random.default_rng(0).integers(0, 256, (8, 17))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  out = {}
  for balanced in (True, False):
    state = fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), **kw)
    step = fs.train_step(loss, opt, has_aux=True)
    step = models.with_balancing(step, deepseek, cfg) if balanced else step
    out[balanced] = jax.device_get(fs.shard_step(step, mesh, donate=False, **kw)(state, batch)[0].params)
  with fs.with_mesh(mesh):
    _, aux = jax.jit(loss)(fs.init_state(init, opt, mesh=mesh, key=jax.random.key(0), **kw).params,
                           batch)
  load = np.asarray(aux["tokens_per_expert"], np.float64)  # [moe layers, experts]
  want = 0.25 * np.sign(load.mean(-1, keepdims=True) - load)
  assert np.any(want != 0)
  np.testing.assert_allclose(out[True]["blocks"]["router_bias"], want)
  np.testing.assert_allclose(out[False]["blocks"]["router_bias"], 0)  # no gradient moves it
  out[True]["blocks"].pop("router_bias"), out[False]["blocks"].pop("router_bias")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), out[True],
               out[False])  # the same step, up to the two programs' float rounding
