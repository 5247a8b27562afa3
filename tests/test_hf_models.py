"""Hugging Face models in fnscale (recipes/lm/hf_maps.py + fnscale.checkpoint.hf) against
transformers itself: tiny random Llama (plain and llama3 RoPE at factor 32, tied), Mistral,
Qwen2, Qwen3 (plain and YaRN RoPE), Gemma 2, Gemma 3 (text) and GPT-2 models made here with
transformers and PyTorch's CPU build, saved as multi-file safetensors; fnscale's logits after
loading them on 1 and 8 devices, the export read back by `from_pretrained`, and configs the
models can't express.

transformers and torch come with the hf-test extra on Python < 3.12 only (PyTorch's CPU wheel;
its default Linux build pulls several GB of CUDA libraries): on 3.12 the comparisons skip,
saying so; the config checks run on both lines.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.checkpoint import hf
from recipes.bench import hf_checkpoint as bench
from recipes.lm import gpt, hf_maps, llama

NO_TORCH = ("transformers and PyTorch's CPU build are test-only dependencies for Python < 3.12 "
            "(pyproject's hf-test extra); the comparisons with transformers run on that line")
SEQ, ATOL = 32, 1e-4
FAMILIES, LLAMA3, _COMMON = bench.FAMILIES, bench.LLAMA3, bench.COMMON
# The families loaded on 8 devices and round-tripped in the quick tier.
QUICK_8 = ("llama3.2", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def torch_hf():
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  transformers.logging.set_verbosity_error()
  return torch, transformers


@pytest.fixture(scope="module")
def made(torch_hf, tmp_path_factory):
  """family -> (directory, reference logits float32 [2, SEQ, vocab]), saved in files of
  ~20 KB (several per model, with an index)."""
  del torch_hf
  tokens = bench.tokens(SEQ)
  out = {name: (d, bench.make_family(name, d, tokens))
         for name in FAMILIES for d in [tmp_path_factory.mktemp(name.replace(".", "_"))]}
  return out, tokens


def _one_device(m):
  shapes = jax.eval_shape(functools.partial(m.model.init_params, m.cfg), jax.random.key(0))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)


def _sharded(m, mesh):
  return fs.init_state(functools.partial(m.model.init_params, m.cfg), optax.sgd(0.1),
                       mesh=mesh, rules=m.model.RULES, logical_axes=m.model.logical_axes(m.cfg),
                       key=jax.random.key(0), abstract=True).params


@functools.cache
def _jitted(model, cfg):  # one compile per model and mesh, shared by the tests
  return jax.jit(functools.partial(model.apply, cfg=cfg))


def _logits(m, params, tokens, mesh=None):
  run = _jitted(m.model, m.cfg)
  if mesh is None:
    return np.asarray(run(params, jnp.asarray(tokens)))
  with fs.with_mesh(mesh):
    return np.asarray(run(params, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def mesh8():
  return fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_on_one_device(made, family):
  (d, want), tokens = made[0][family], made[1]
  m = hf_maps.read(d, SEQ)
  assert len(hf.read_index(d).tensors) and (d / hf.INDEX_FILE).exists()  # multi-file
  got = _logits(m, hf.load(d, _one_device(m), hf_maps.checkpoint_map(m, d)), tokens)
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def _eight(family):
  marks = () if family in QUICK_8 else (pytest.mark.slow,)
  return pytest.param(family, marks=marks)


@pytest.mark.parametrize("family", [_eight(f) for f in FAMILIES])
def test_logits_match_transformers_on_8_devices(made, mesh8, family):
  # data x FSDP x tensor: every leaf split its own way, layers stacked for the scan.
  (d, want), tokens = made[0][family], made[1]
  m = hf_maps.read(d, SEQ)
  params = hf.load(d, _sharded(m, mesh8), hf_maps.checkpoint_map(m, d))
  assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
             for leaf in jax.tree.leaves(params))
  np.testing.assert_allclose(_logits(m, params, tokens, mesh8), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", [_eight(f) for f in FAMILIES])
def test_export_loads_in_transformers_with_the_same_logits(made, mesh8, torch_hf, tmp_path,
                                                           family):
  # Loaded on 8 devices, changed (as training would), exported in ~20 KB files: transformers'
  # from_pretrained reads it and computes fnscale's logits for the changed params.
  torch, transformers = torch_hf
  (d, _), tokens = made[0][family], made[1]
  m = hf_maps.read(d, SEQ)
  cmap = hf_maps.checkpoint_map(m, d)
  params = hf.load(d, _sharded(m, mesh8), cmap)
  changed = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.01 + 0.003, p))(params)
  hf.export(tmp_path, changed, cmap, config=hf_maps.to_config(m), max_shard_bytes=20_000)
  assert (tmp_path / hf.INDEX_FILE).exists()
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = _logits(m, changed, tokens, mesh8)
  # float32 on both sides, summed in different orders: ~1e-5 apart (a wrong weight is ~0.1).
  np.testing.assert_allclose(theirs, ours, atol=5e-5, rtol=1e-4)


def test_a_wrong_transform_or_rope_fails_the_comparison(made):
  # Negative controls: q_proj split on its input axis instead of its output axis (shapes fit:
  # d_model = heads x head_dim), and plain RoPE for a llama3-scaled checkpoint.
  (d, want), tokens = made[0]["mistral"], made[1]
  m = hf_maps.read(d, SEQ)
  cmap = hf_maps.checkpoint_map(m, d)
  H, K = m.cfg.heads, m.cfg.head_dim
  wrong = {**cmap.tensors, "blocks/wq": cmap.tensors["blocks/wq"]._replace(
      split=(None, (H, K)), perm=None)}
  bad = hf.load(d, _one_device(m), cmap._replace(tensors=wrong))
  assert np.abs(_logits(m, bad, tokens) - want).max() > 100 * ATOL
  (d, want), tokens = made[0]["llama3.2"], made[1]
  m = hf_maps.read(d, SEQ)
  params = hf.load(d, _one_device(m), hf_maps.checkpoint_map(m, d))
  plain = m._replace(cfg=m.cfg._replace(rope_scaling=None))
  assert np.abs(_logits(plain, params, tokens) - want).max() > 100 * ATOL


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
# DeepSeek-V3's (its config.json's rope_scaling, the old key "type" for rope_type).
DEEPSEEK_YARN = dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0,
                     mscale_all_dim=1.0, original_max_position_embeddings=4096)


def test_yarn_written_from_the_model_config_reads_back_in_transformers(made, torch_hf,
                                                                      tmp_path):
  # A model trained here (no config.json kept) with YaRN RoPE: the config.json written from
  # its config says YaRN's fields, reads back as the same config, and transformers computes
  # the checkpoint's own logits from the export. Controls: YaRN's frequencies without its
  # factor on cos and sin, and plain RoPE, are both off.
  torch, transformers = torch_hf
  (d, want), tokens = made[0]["qwen3-yarn"], made[1]
  m = hf_maps.read(d, SEQ)
  params = hf.load(d, _one_device(m), hf_maps.checkpoint_map(m, d))
  trained = hf_maps.of_model(llama, m.cfg)
  config = hf_maps.to_config(trained)
  assert config["rope_scaling"] == dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                        beta_slow=1.0, original_max_position_embeddings=256)
  assert config["max_position_embeddings"] == 1024 and config["rope_theta"] == 1e4
  assert hf_maps.from_config(config, SEQ).cfg == m.cfg
  hf.export(tmp_path, params, hf_maps.checkpoint_map(trained), config=config)
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, want, atol=ATOL, rtol=0)
  yarn = m.cfg.rope_scaling
  for cfg in (m.cfg._replace(rope_scaling=yarn._replace(attention_factor=1.0)),
              m.cfg._replace(rope_scaling=None)):
    assert np.abs(_logits(m._replace(cfg=cfg), params, tokens) - want).max() > 100 * ATOL


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (64, 5e5, LLAMA3), (128, 5e5, dict(LLAMA3, factor=8.0)), (16, 1e4, None),
    (128, 1e6, YARN), (64, 1e4, DEEPSEEK_YARN),
    (64, 1.5e5, dict(YARN, factor=32.0, original_max_position_embeddings=4096, truncate=False)),
    (32, 1e4, dict(YARN, factor=8.0, original_max_position_embeddings=512, mscale=0.707,
                   mscale_all_dim=1.0, beta_fast=16, beta_slow=2))])
def test_rope_frequencies_equal_transformers_inv_freq(torch_hf, head_dim, theta, scaling):
  # To float32 rounding: transformers computes in float32, fnscale in float64 then rounds;
  # YaRN's factor on cos and sin (its attention_scaling) to float64 rounding.
  _, transformers = torch_hf
  config = transformers.LlamaConfig(
      hidden_size=4 * head_dim, num_attention_heads=4, num_hidden_layers=1, vocab_size=8,
      intermediate_size=8, rope_theta=theta, rope_scaling=scaling and dict(scaling),
      max_position_embeddings=131072)  # a copy: transformers' config rewrites its dict
  rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
  want = rotary.inv_freq.numpy()
  m = hf_maps.from_config(config.to_dict(), 8)
  got = llama.rope_frequencies(head_dim, m.cfg.rope_theta, m.cfg.rope_scaling)
  assert got.dtype == want.dtype == np.float32
  np.testing.assert_array_max_ulp(got, want, maxulp=4)
  assert getattr(m.cfg.rope_scaling, "attention_scale", 1.0) == pytest.approx(
      rotary.attention_scaling, rel=1e-12)
  if scaling:  # the scaling really applies (a check that can't pass by plain RoPE)
    assert np.abs(got - llama.rope_frequencies(head_dim, theta)).max() > 1e-4


# ------------------------------------------------------------------------------------------
# Configs (no transformers needed)

_LLAMA = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=48, vocab_size=64, rms_norm_eps=1e-5,
              rope_theta=5e5)


def test_config_json_fields_reach_the_model_config():
  # The published Llama-3.2-1B config.json (its fields as Meta released them).
  c = dict(model_type="llama", hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
           num_hidden_layers=16, intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5,
           rope_theta=500000.0, tie_word_embeddings=True, head_dim=64,
           rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                             original_max_position_embeddings=8192, rope_type="llama3"),
           hidden_act="silu", max_position_embeddings=131072)
  m = hf_maps.from_config(c, 2048)
  assert m.model is llama and m.cfg == llama.model_config("llama-1b", 2048)
  assert llama.param_count(m.cfg) == 1_235_814_400
  # transformers 5's spelling of the same RoPE.
  v5 = {k: v for k, v in c.items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = dict(c["rope_scaling"], rope_theta=500000.0)
  assert hf_maps.from_config(v5, 2048).cfg == m.cfg
  q = hf_maps.from_config(dict(_LLAMA, model_type="qwen3", head_dim=16), 8).cfg
  assert (q.qk_norm, q.qkv_bias, q.head_dim, q.rope_scaling) == (True, False, 16, None)
  assert hf_maps.from_config(dict(_LLAMA, model_type="qwen2"), 8).cfg.qkv_bias
  g = hf_maps.from_config(dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4,
                               vocab_size=64, n_positions=64), 16)
  assert g.model is gpt and g.cfg == gpt.ModelConfig(2, 32, 4, 16, 64, positions=64)


@pytest.mark.parametrize("change,field", [
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)),
     "rope_scaling.original_max_position_embeddings=None is missing: yarn"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_type='dynamic'"),
    (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), "rope_type='longrope'"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope_scaling.low_freq_factor"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(model_type="mistral", sliding_window=4), "sliding_window=4"),
    (dict(model_type="qwen2_moe"), "model_type='qwen2_moe'.*experts"),
    (dict(model_type="bert"), "model_type='bert'"),
    (dict(quantization_config={"bits": 4}), "quantization_config"),
    (dict(num_hidden_layers=None), "num_hidden_layers=None is missing"),
])
def test_configs_the_models_cant_express_are_named(change, field):
  with pytest.raises(fs.InputError, match=field):
    hf_maps.from_config(dict(_LLAMA, **change), 8)


def test_gpt2_configs_the_model_cant_express_are_named():
  base = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
  for change, field in ((dict(activation_function="relu"), "activation_function='relu'"),
                        (dict(n_inner=100), "n_inner=100"),
                        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse")):
    with pytest.raises(fs.InputError, match=field):
      hf_maps.from_config(dict(base, **change), 8)
  with pytest.raises(fs.InputError, match="seq=32 is longer than .* n_positions=16"):
    hf_maps.from_config(base, 32)


def test_a_config_with_more_layers_than_the_weights_is_named_before_loading(made):
  # config.json and the weights disagree: the map asks for a layer the files don't hold.
  (d, _), _ = made[0]["qwen2"], made[1]
  m = hf_maps.read(d, SEQ)
  m = m._replace(cfg=m.cfg._replace(layers=3))
  with pytest.raises(fs.CheckpointError, match="model.layers.2.input_layernorm.weight"):
    hf.load(d, _one_device(m), hf_maps.checkpoint_map(m, d))
  tied = m._replace(cfg=m.cfg._replace(layers=2, tie_embeddings=True))
  with pytest.raises(fs.CheckpointError, match="'lm_head.weight' .* is not loaded"):
    hf.load(d, _one_device(tied), hf_maps.checkpoint_map(tied, d))


@pytest.mark.slow
def test_train_lm_continues_from_a_checkpoint_and_exports_it(torch_hf, work, tmp_path):
  # A tiny Qwen2 (q/k/v biases) with a BPE tokenizer of 300 ids: train_lm(init_from=...)
  # trains its weights (at a learning rate too small to move them: the export still computes
  # the original model's logits, which random weights would not) and exports what
  # transformers loads, with fnscale's final logits and the tokenizer.
  from recipes import train_lm, train_tokenizer  # pylint: disable=import-outside-toplevel
  torch, transformers = torch_hf
  src, out = tmp_path / "qwen", tmp_path / "export"
  model = bench.randomize(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      **dict(_COMMON, vocab_size=300))))
  model.save_pretrained(src, max_shard_size="50KB")
  train_tokenizer.train_tokenizer([str(work / "corpus.txt")], 300, str(src / "tokenizer.json"))
  summary = train_lm.train_lm(
      init_from=str(src), export_hf=str(out), mesh="data=-1,fsdp=2", seq=SEQ, global_batch=16,
      steps=2, lr=1e-9, dataset=str(work / "corpus.txt"), run_dir=str(tmp_path / "run"),
      eval_batches=1, sample_len=0, checkpoint=False)
  tokens = np.random.default_rng(0).integers(0, 300, (2, SEQ))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = exported(torch.tensor(tokens)).logits.numpy()
    original = model(torch.tensor(tokens)).logits.numpy()
  m = hf_maps.read(src, SEQ)
  ours = _logits(m, jax.device_get(summary.state.params), tokens)
  # float32 on both sides, summed in different orders: ~1e-5 apart (a wrong weight is ~0.1).
  np.testing.assert_allclose(theirs, ours, atol=5e-5, rtol=1e-4)
  np.testing.assert_allclose(theirs, original, atol=1e-3)
  assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("family,option,off", [
    ("gemma2", "attn_soft_cap", 0.0), ("gemma2", "logit_soft_cap", 0.0),
    ("gemma2", "windows", ()), ("gemma2", "attn_scale", 0.0), ("gemma2", "embed_scale", False),
    ("gemma2", "activation", "silu"), ("gemma3", "local_rope_theta", 0.0),
    ("gemma3", "windows", (8, 8, 0, 0))])
def test_each_gemma_option_shows_in_the_logits(made, family, option, off):
  # Negative controls: the random configs exercise every option (caps that bend the
  # logits, sequences past the window, a layer past the last whole period of the pattern),
  # so the comparison with transformers fails with any one of them left out.
  (d, want), tokens = made[0][family], made[1]
  m = hf_maps.read(d, SEQ)
  params = hf.load(d, _one_device(m), hf_maps.checkpoint_map(m, d))
  wrong = m._replace(cfg=m.cfg._replace(**{option: off}))
  assert np.abs(_logits(wrong, params, tokens) - want).max() > 100 * ATOL


# The published config.json of gemma-2-2b and gemma-3-1b-pt (the fields Google released).
GEMMA2_2B = dict(
    model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=2304,
    intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, vocab_size=256000,
    hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=256, sliding_window=4096,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
    rms_norm_eps=1e-6, max_position_embeddings=8192, attention_bias=False)
GEMMA3_1B = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, vocab_size=262144,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
    sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling=None, attn_logit_softcapping=None, final_logit_softcapping=None,
    rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=False)


def test_published_gemma_configs_reach_the_model_config():
  # Param counts by hand: gemma-2-2b's 2,614,341,888 and gemma-3-1b's 999,885,952 (tied
  # embeddings, four norms a layer, Gemma 3's q/k norms).
  g2 = hf_maps.from_config(GEMMA2_2B, 8192).cfg
  assert llama.param_count(g2) == 2_614_341_888
  assert (g2.attn_soft_cap, g2.logit_soft_cap, g2.attn_scale, g2.tie_embeddings) == (
      50.0, 30.0, 1 / 16, True)
  assert g2.windows == (4096, 0) * 13 and g2.local_rope_theta == 0.0 and not g2.qk_norm
  g3 = hf_maps.from_config(GEMMA3_1B, 32768).cfg
  assert llama.param_count(g3) == 999_885_952
  assert g3.windows == ((512,) * 5 + (0,)) * 4 + (512, 512)
  assert (g3.rope_theta, g3.local_rope_theta, g3.qk_norm) == (1e6, 1e4, True)
  assert (g3.attn_soft_cap, g3.logit_soft_cap) == (0.0, 0.0)
  # A config.json written for a model trained here says the same model.
  for cfg in (g2, g3):
    again = hf_maps.to_config(hf_maps.of_model(llama, cfg))
    assert hf_maps.from_config(again, cfg.seq).cfg == cfg


_GEMMA3 = dict(model_type="gemma3_text", hidden_size=32, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48,
               vocab_size=64, head_dim=8, sliding_window=4)


@pytest.mark.parametrize("change,field", [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'.*tanh approximation"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types="),
    (dict(layer_types=["full_attention"]), "layer_types=.*one per layer"),
    (dict(sliding_window=None), "sliding_window=None is not a positive int"),
    (dict(rope_scaling=dict(rope_type="linear", factor=8.0)),
     "rope_scaling.rope_type='linear' is not implemented"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                               sliding_attention=dict(rope_type="yarn", factor=2.0))),
     "rope_parameters.sliding_attention.rope_type='yarn'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(model_type="gemma3"), "model_type='gemma3'.*gemma3_text"),
    (dict(model_type="gemma"), "model_type='gemma'.*Gemma 1"),
])
def test_gemma_configs_the_model_cant_express_are_named(change, field):
  with pytest.raises(fs.InputError, match=field):
    hf_maps.from_config(dict(_GEMMA3, **change), 8)


def test_a_gemma_export_the_config_cant_say_is_refused():
  cfg = hf_maps.from_config(_GEMMA3, 8).cfg
  for change, field in ((dict(windows=(4, 2)), "several window sizes"),
                        (dict(activation="silu"), "activation='silu'"),
                        (dict(qk_norm=False, local_rope_theta=5.0), "local_rope_theta=5.0")):
    with pytest.raises(fs.InputError, match=field):
      hf_maps.to_config(hf_maps.of_model(llama, cfg._replace(**change)))
  plain = llama.model_config("llama-tiny", 8)
  with pytest.raises(fs.InputError, match="logit_soft_cap=30.0 without Gemma's norms"):
    hf_maps.to_config(hf_maps.of_model(llama, plain._replace(logit_soft_cap=30.0)))


@pytest.mark.slow
def test_train_lm_trains_a_gemma_checkpoint_and_exports_it(torch_hf, work, tmp_path):
  # A tiny random Gemma 3 (local and global layers, windows shorter than --seq) with a BPE
  # tokenizer of 300 ids: train_lm(init_from=...) trains it 3 steps on 8 devices (FSDP and
  # data) at a learning rate too small to move the weights, and exports what transformers
  # loads with the original model's logits and fnscale's final ones.
  from recipes import train_lm, train_tokenizer  # pylint: disable=import-outside-toplevel
  torch, transformers = torch_hf
  src, out = tmp_path / "gemma", tmp_path / "export"
  _, _, fields = FAMILIES["gemma3"]
  model = bench.randomize(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      **dict(fields, vocab_size=300))))
  model.save_pretrained(src, max_shard_size="50KB")
  train_tokenizer.train_tokenizer([str(work / "corpus.txt")], 300, str(src / "tokenizer.json"))
  summary = train_lm.train_lm(
      init_from=str(src), export_hf=str(out), mesh="data=-1,fsdp=2", seq=SEQ, global_batch=8,
      steps=3, lr=1e-9, dataset=str(work / "corpus.txt"), run_dir=str(tmp_path / "run"),
      eval_batches=1, sample_len=0, checkpoint=False)
  assert np.isfinite(summary.loss) and np.isfinite(summary.eval_loss)
  tokens = np.random.default_rng(0).integers(0, 300, (2, SEQ))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = exported(torch.tensor(tokens)).logits.numpy()
    original = model(torch.tensor(tokens)).logits.numpy()
  m = hf_maps.read(src, SEQ)
  ours = _logits(m, jax.device_get(summary.state.params), tokens)
  np.testing.assert_allclose(theirs, ours, atol=5e-5, rtol=1e-4)
  np.testing.assert_allclose(theirs, original, atol=1e-3)
