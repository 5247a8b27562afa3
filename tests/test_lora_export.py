"""LoRA adapters out of fnscale: the PEFT adapter (fnscale.checkpoint.peft) loaded by Hugging
Face's peft onto the transformers model gives fnscale's logits, and the merged Hugging Face
export holds base + scale B A as computed with numpy from the files themselves.

A tiny random Llama made here with transformers (recipes/bench/hf_checkpoint.py), loaded into
fnscale on 8 devices; transformers, PyTorch's CPU build and peft come with the hf-test extra
on Python < 3.12 only (the comparisons skip on 3.12, saying so)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.checkpoint import hf, peft
from recipes.bench import hf_checkpoint as bench
from recipes.lm import hf_maps, llama

NO_TORCH = ("transformers, PyTorch's CPU build and peft are test-only dependencies for "
            "Python < 3.12 (pyproject's hf-test extra)")
SEQ = 16
TARGETS = (("blocks/w(q|k|v)", "lioo"), ("blocks/wo", "liio"),
           ("blocks/w_(gate|up|down)", "lio"))
LORA = fs.lora.LoraConfig(rank=4, alpha=8.0, targets=TARGETS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(checkpoint dir, HFModel, map, base on 8 devices, adapters with random A and B)."""
  pytest.importorskip("torch", reason=NO_TORCH)
  pytest.importorskip("transformers", reason=NO_TORCH)
  d = tmp_path_factory.mktemp("llama")
  bench.make_family("llama", d, bench.tokens(SEQ))
  m = hf_maps.read(d, SEQ)
  cmap = hf_maps.checkpoint_map(m, d)
  mesh = fs.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  target = fs.init_state(lambda k: llama.init_params(m.cfg, k), optax.sgd(0.0), mesh=mesh,
                         rules=llama.RULES, logical_axes=llama.logical_axes(m.cfg),
                         key=jax.random.key(0), abstract=True).params
  base = hf.load(d, target, cmap)
  adapters = fs.lora.init(base, LORA, jax.random.key(1))
  # As after training: B no longer zero (A and B each random, in their shardings).
  adapters = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(
      jax.random.key(x.size), x.shape, x.dtype), adapters)
  return d, m, cmap, base, adapters


def _fnscale_logits(m, base, adapters, tokens):
  bound = fs.lora.bind(base, adapters, LORA)
  return np.asarray(jax.jit(lambda p, t: llama.apply(p, t, cfg=m.cfg))(bound, tokens))


@pytest.mark.slow
def test_peft_loads_the_adapter_onto_transformers_with_fnscale_logits(trained, tmp_path):
  torch = pytest.importorskip("torch", reason=NO_TORCH)
  transformers = pytest.importorskip("transformers", reason=NO_TORCH)
  peft_lib = pytest.importorskip("peft", reason=NO_TORCH)
  d, m, cmap, base, adapters = trained
  files = peft.export(tmp_path, adapters, LORA, base, cmap, base_model=str(d))
  assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
  model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
  model = peft_lib.PeftModel.from_pretrained(model, tmp_path).eval()
  tokens = bench.tokens(SEQ)
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = _fnscale_logits(m, base, adapters, tokens)
  plain = np.asarray(jax.jit(lambda p, t: llama.apply(p, t, cfg=m.cfg))(base, tokens))
  assert np.abs(plain - ours).max() > 0.1  # the adapters change the logits visibly
  assert np.abs(theirs - ours).max() <= 2e-5 * np.abs(ours).max()
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  # exactly the adapted modules (peft matches a str target_modules in full)
  assert config["r"] == 4 and config["lora_alpha"] == 8.0
  adapted = {n for n, _ in model.named_modules() if n.endswith("lora_A")}
  assert len(adapted) == 2 * 7


@pytest.mark.slow
def test_merged_export_holds_base_plus_scale_b_a(trained, tmp_path):
  safetensors = pytest.importorskip("safetensors.numpy")
  d, m, cmap, base, adapters = trained
  merged = jax.jit(lambda b, a: fs.lora.merge(b, a, LORA))(base, adapters)
  hf.export(tmp_path / "merged", merged, cmap, config=hf_maps.to_config(m))
  peft.export(tmp_path / "adapter", adapters, LORA, base, cmap)

  def tensors(directory):
    out = {}
    for f in directory.glob("*.safetensors"):
      out.update(safetensors.load_file(f))
    return out
  before, after = tensors(d), tensors(tmp_path / "merged")
  lora = tensors(tmp_path / "adapter")
  assert set(before) == set(after)
  changed = 0
  for key, w in before.items():
    module = "base_model.model." + key[:-len(".weight")]
    if module + ".lora_A.weight" in lora:
      a, b = lora[module + ".lora_A.weight"], lora[module + ".lora_B.weight"]
      want = w.astype(np.float64) + (8.0 / 4) * (b.astype(np.float64) @ a.astype(np.float64))
      np.testing.assert_allclose(after[key], want, rtol=1e-5, atol=1e-6)
      changed += 1
    else:
      np.testing.assert_array_equal(after[key], w)
  assert changed == 2 * 7


@pytest.mark.slow
def test_a_target_that_is_no_linear_weight_is_refused(trained, tmp_path):
  d, m, cmap, base, adapters = trained
  del d, m
  # wq's layout written as if its heads were inputs: shapes fit the adapters' ranks of
  # dims, but not q_proj's [out, in] weight.
  wrong = LORA._replace(targets=(("blocks/wq", "liio"),))
  ad = fs.lora.init(base, wrong, jax.random.key(0))
  with pytest.raises(fs.CheckpointError, match=r"q_proj.*not a Linear's \[out, in\]"):
    peft.export(tmp_path, ad, wrong, base, cmap)
  assert not (tmp_path / "adapter_config.json").exists()
