"""DPO (recipes/lm/dpo.py) and its data (recipes/lm/preference.py): the loss and its gradients
against PyTorch's autograd of the papers' formulas on fixed log-probabilities, the reference
log-probabilities of packed rows against the base model scoring each side alone, and bad
preference rows refused with the fix."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from recipes.lm import dpo, llama, preference

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("loss, eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.1)])
def test_dpo_loss_and_gradients_match_pytorch(loss, eps):
  torch = pytest.importorskip("torch", reason="PyTorch's CPU build: the hf-test extra")
  rng = np.random.default_rng(0)
  logps = [rng.normal(-30, 5, 16) for _ in range(4)]  # chosen, rejected, ref_c, ref_r
  beta = 0.3
  cfg = dpo.DPOConfig(beta=beta, label_smoothing=eps, loss=loss)

  def ours(c, r):
    losses, _, _ = dpo.preference_loss(c, r, logps[2], logps[3], cfg)
    return jnp.mean(losses)
  value, grads = jax.value_and_grad(ours, argnums=(0, 1))(
      jnp.asarray(logps[0], jnp.float32), jnp.asarray(logps[1], jnp.float32))
  # Rafailov et al. eq. 7; cDPO's smoothed labels; rDPO's eq. 8, in float64.
  c, r = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in logps[:2])
  h = beta * ((c - torch.tensor(logps[2])) - (r - torch.tensor(logps[3])))
  logsig = torch.nn.functional.logsigmoid
  if loss == "robust":
    want = ((1 - eps) * -logsig(h) - eps * -logsig(-h)) / (1 - 2 * eps)
  else:
    want = (1 - eps) * -logsig(h) + eps * -logsig(-h)
  want.mean().backward()
  assert abs(float(value) - want.mean().item()) < 1e-6
  np.testing.assert_allclose(grads[0], c.grad.numpy(), atol=1e-6, rtol=0)
  np.testing.assert_allclose(grads[1], r.grad.numpy(), atol=1e-6, rtol=0)


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


ROWS = [{"prompt": "2+2?", "chosen": "4", "rejected": "five"},
        {"prompt": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"}],
         "chosen": [{"role": "assistant", "content": "hello"}], "rejected": "go away now"},
        {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}],
         "chosen": "d", "rejected": "ee"}]


@pytest.fixture
def template(tmp_path):
  f = tmp_path / "chat.jinja"
  f.write_text(TEMPLATE)
  return str(f)


def test_weights_fall_on_the_responses_only_and_pairs_pack_whole(tmp_path, template):
  path = _write(tmp_path / "prefs.jsonl", ROWS)
  t = preference.chat.load_template("bytes", template)
  pairs = [preference.tokenize(r, t, None, "row") for _, r in preference.read_rows(path)]
  scored = lambda ids, w: bytes(ids[w == 1].tolist()).decode()
  assert scored(pairs[0].chosen, pairs[0].chosen_weights) == "4</>"
  assert scored(pairs[0].rejected, pairs[0].rejected_weights) == "five</>"
  # the assistant turn inside the prompt ("b") is context, not preference
  assert scored(pairs[2].chosen, pairs[2].chosen_weights) == "d</>"
  assert bytes(pairs[2].chosen.tolist()).decode() == "<user>a</><assistant>b</><user>c</><assistant>d</>"
  rows = preference.pack(pairs, seq=160, max_pairs=2)
  assert len(rows) == 2  # two pairs fit the first row, the third starts the next
  seg = rows[0]["segment_ids"]
  assert sorted(set(seg.tolist())) == [0, 1, 2, 3, 4]
  first = seg == 1
  assert rows[0]["positions"][first].tolist() == list(range(first.sum()))
  np.testing.assert_array_equal(rows[0]["inputs"][first], pairs[0].chosen[:-1])
  np.testing.assert_array_equal(rows[0]["targets"][first], pairs[0].chosen[1:])
  assert rows[0]["weights"][seg == 0].sum() == 0


@pytest.mark.parametrize("row, words", [
    ({"prompt": "x", "chosen": "y"}, ["line 1", "without 'rejected'", "\"rejected\""]),
    ({"prompt": "x", "rejected": "y", "chosen": ""}, ["without 'chosen'"]),
    ({"prompt": "x", "chosen": 3, "rejected": "y"}, ["'chosen' is '3'", "string or a list"]),
])
def test_bad_preference_rows_are_named_with_the_fix(tmp_path, template, row, words):
  path = _write(tmp_path / "prefs.jsonl", [row])
  with pytest.raises(fs.InputError) as e:
    preference.load(path, "", template)
  for w in words:
    assert w in str(e.value)


def test_a_pair_longer_than_a_row_is_named(tmp_path, template):
  path = _write(tmp_path / "prefs.jsonl", ROWS[:1] + [{**ROWS[0], "chosen": "x" * 100}])
  train, _ = preference.load(path, "", template)
  with pytest.raises(fs.InputError, match=r"prefs.jsonl line 2: .* more than a row of --seq=64"):
    preference.rows(train, 64, 2)


CFG = llama.model_config("llama-tiny", 160, layers=2, d_model=32, heads=4, kv_heads=2,
                         d_mlp=64)


def _batch(template):
  t = preference.chat.load_template("bytes", template)
  pairs = [preference.tokenize(r, t, None, "row") for r in ROWS]
  rows = preference.pack(pairs, seq=CFG.seq, max_pairs=4)
  return pairs, {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def test_reference_logps_of_packed_rows_equal_the_base_model_scoring_each_side(template):
  base = llama.init_params(CFG, jax.random.key(0))
  pairs, batch = _batch(template)
  lp = jax.jit(lambda p, b: dpo.token_logps(llama, p, b, cfg=CFG))(base, batch)
  chosen, rejected, present = dpo.pair_logps(lp, jnp.asarray(batch["segment_ids"]), 4)
  apply = jax.jit(lambda p, t: llama.apply(p, t, cfg=CFG))

  def alone(ids, weights):  # one side, unpacked (padded after it: causal attention)
    n = len(ids) - 1
    tokens = np.pad(ids[:-1], (0, CFG.seq - n))[None]
    logits = np.asarray(apply(base, jnp.asarray(tokens)))[0, :n].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return float(np.sum(logp[np.arange(n), ids[1:]] * weights[1:]))
  got_c, got_r = np.asarray(chosen)[present], np.asarray(rejected)[present]
  want_c = [alone(p.chosen, p.chosen_weights) for p in pairs]
  want_r = [alone(p.rejected, p.rejected_weights) for p in pairs]
  np.testing.assert_allclose(got_c, want_c, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(got_r, want_r, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_dpo_steps_start_at_log_2_and_learn_the_preference(template):
  base = llama.init_params(CFG, jax.random.key(0))
  lora = fs.lora.LoraConfig(rank=4, alpha=8.0, targets=(("blocks/w(q|v)", "lioo"),
                                                        ("blocks/w_(up|down)", "lio")))
  cfg = dpo.DPOConfig(beta=0.5, pairs=4)
  loss = dpo.loss_fn(llama, lora, cfg, cfg=CFG)
  opt = optax.adam(3e-2)
  adapters = fs.lora.init(base, lora, jax.random.key(1))
  state = fs.TrainState(adapters, opt.init(adapters), jnp.zeros((), jnp.int32), None, base)
  step = jax.jit(fs.train_step(loss, opt, weighted=True, has_aux=True))
  batch = jax.tree.map(jnp.asarray, _batch(template)[1])
  losses = []
  for _ in range(8):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[0] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference
  assert float(m["weight"]) == 3  # three pairs
  assert losses[-1] < 0.5 * losses[0] and float(m["aux"]["reward_accuracy"]) == 1.0
  for x, y in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(base)):
    np.testing.assert_array_equal(x, y)


def test_a_preference_corpus_with_a_tokenizer_takes_its_vocabulary(tmp_path, template):
  # A BPE tokenizer of 300 ids (as --init_from brings): the corpus's vocabulary is the
  # tokenizer's, and its encode / decode are the tokenizer's.
  import tokenizers  # pylint: disable=import-outside-toplevel
  from recipes import train_tokenizer  # pylint: disable=import-outside-toplevel
  text = tmp_path / "text.txt"
  text.write_text("".join(f"{a} + {b} is {a + b}. No.\n" for a in range(40) for b in range(9)))
  tok = tokenizers.Tokenizer.from_file(
      train_tokenizer.train_tokenizer([str(text)], 300, str(tmp_path / "tokenizer.json")))
  rows = [{"prompt": f"{a}+1?", "chosen": f"It is {a + 1}.", "rejected": "No."}
          for a in range(12)]
  c = preference.corpus(_write(tmp_path / "prefs.jsonl", rows), str(tmp_path / "tokenizer.json"),
                        template)
  assert c.vocab == tok.get_vocab_size() == 300
  assert c.encode("It is 5.") == tok.encode("It is 5.").ids
  assert c.decode(c.encode("It is 5.")) == tok.decode(tok.encode("It is 5.").ids)
  assert max(c.train.max(), c.eval.max()) < 300
