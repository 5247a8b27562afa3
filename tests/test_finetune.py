"""train_lm's LoRA, DPO and W&B (recipes/lm/finetune.py, dpo.py, preference.py, run_log.py):
bad input refused with one `error:` line, a LoRA run that resumes to the uninterrupted run's
state and exports what the base plus its adapters compute, its checkpoints refused beside
another base, DPO from a preference file, and the W&B tracker recording what TensorBoard
and metrics.jsonl record."""
import json
import sys
import types

import jax
import numpy as np
import pytest

import fnscale as fs
from recipes import train_lm
from recipes.lm import run_log

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TINY = ["--model_config=llama-tiny", "--dataset=tiny_corpus", "--steps=1", "--seq=16",
        "--batch_size=1", "--sample_len=0", "--nocheckpoint"]


def _main(capsys, tmp_path, *args):
  capsys.readouterr()
  rc = train_lm.main(["train_lm.py", *args, f"--run_dir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  return rc, [line for line in err.splitlines() if line.startswith("error:")]


def _prefs(tmp_path, rows):
  (tmp_path / "chat.jinja").write_text(TEMPLATE)
  path = tmp_path / "prefs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path), f"--chat_template={tmp_path / 'chat.jinja'}"


@pytest.mark.parametrize("args, words", [
    (TINY + ["--lora_rank=4", "--lora_targets=wq,w_q"],
     ["'w_q' matches no weight LoRA can adapt", "did you mean 'wq'"]),
    (TINY + ["--lora_rank=4", "--lora_targets=embed"], ["wq,wk,wv,wo,w_gate,w_up,w_down"]),
    ([a.replace("llama-tiny", "tiny_gpt2") for a in TINY] + ["--lora_rank=4"],
     ["tiny_gpt2", "LoRA can't adapt its leaves", "a Llama-family model"]),
])
def test_lora_options_that_cannot_work_are_one_error_line(capsys, tmp_path, args, words):
  rc, errors = _main(capsys, tmp_path, *args)
  assert rc == 2 and len(errors) == 1, errors
  for w in words:
    assert w in errors[0]
  assert not (tmp_path / "run").exists()


def test_a_preference_row_without_rejected_is_one_error_line(capsys, tmp_path):
  path, template = _prefs(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                     {"prompt": "a", "chosen": "b"}])
  rc, errors = _main(capsys, tmp_path, "--model_config=llama-tiny", "--objective=dpo",
                     "--lora_rank=4", f"--dataset={path}", template, "--steps=1")
  assert rc == 2 and len(errors) == 1, errors
  assert "prefs.jsonl line 2: a preference row without 'rejected'" in errors[0]


def test_wandb_without_the_package_is_one_error_line(capsys, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  rc, errors = _main(capsys, tmp_path, *TINY, "--tracker=wandb")
  assert rc == 2 and len(errors) == 1, errors
  assert "--tracker=wandb needs the wandb package" in errors[0]
  assert "pip install 'fnscale[wandb]'" in errors[0]


def test_wandb_records_the_scalars_and_config_metrics_jsonl_has(tmp_path, monkeypatch):
  logged, inits = [], []

  class Run:
    def log(self, scalars, step):
      logged.append((step, dict(scalars)))

    def finish(self):
      logged.append("finished")

  def init(**kw):
    inits.append(kw)
    return Run()
  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  log = run_log.run_log(str(tmp_path), tracker="wandb", config={"lora_rank": 16})
  log.write(1, {"train/loss": 2.5, "perf/mfu": None, "moe/load_max_over_mean": 1.25})
  log.write(2, {"train/loss_scale": 32768.0})
  log.close()
  jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged[:2] == [(r.pop("step"), r) for r in jsonl] and logged[2] == "finished"
  assert inits[0]["config"] == {"lora_rank": 16} and inits[0]["dir"] == str(tmp_path)
  assert inits[0]["resume"] == "allow" and inits[0]["id"].startswith(tmp_path.name[:40])


def test_a_wandb_run_resumed_before_its_last_step_says_which_points_it_keeps(tmp_path,
                                                                           monkeypatch):
  # A first attempt logged steps 1..5; the run resumes from a checkpoint at step 3. W&B
  # (resumed under the same id) rejects steps 4 and 5 again: the line says its points for
  # them are the first attempt's; metrics.jsonl keeps steps 1..3. A resume from the last
  # step logged, or with TensorBoard (which hides them), says nothing of W&B.
  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
      init=lambda **kw: types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)))
  log = run_log.run_log(str(tmp_path), tracker="wandb")
  for step in range(1, 6):
    log.write(step, {"train/loss": float(step)})
  log.close()
  said = []
  for keep, tracker in ((5, "wandb"), (3, "wandb"), (2, "none")):
    said.append([])
    run_log.run_log(str(tmp_path), tracker=tracker, keep_through=keep,
                    say=said[-1].append).close()
  assert not said[0]
  assert [line for line in said[1] if "W&B" in line] == [
      "run_log: the W&B run keeps the points it got for steps 4..5 before this resume (W&B "
      "takes no step below its last one), so it shows this run's only from step 6; "
      "metrics.jsonl and TensorBoard hold this run's"]
  assert said[2] and not any("W&B" in line for line in said[2])
  steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]


@pytest.mark.slow
def test_train_lm_records_to_wandb_offline(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  train_lm.train_lm(model_config="nano", dataset="tiny_corpus", steps=2, seq=16,
                    sample_len=0, checkpoint=False, tracker="wandb", eval_batches=1,
                    run_dir=str(tmp_path / "run"))
  (record,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
  data = record.read_bytes()  # wandb's own record log: names and config as written
  for name in (b"train/loss", b"eval/loss", b"perf/tokens_per_s", b"global_batch"):
    assert name in data, name


def _lora_run(tmp_path, name, **kw):
  # One compile cache for the runs of a test: the resumed run's programs are the first's.
  opts = dict(model_config="llama-tiny", dataset="tiny_corpus", lora_rank=4, seq=32,
              batch_size=1, mesh="data=2,fsdp=4", sample_len=0, eval_batches=1, lr=1e-2,
              checkpoint_every=2, run_dir=str(tmp_path / name),
              compile_cache_dir=str(tmp_path / "compile-cache"))
  return train_lm.train_lm(**{**opts, **kw})


@pytest.mark.slow
def test_a_lora_run_resumes_bitwise_and_exports_base_plus_adapters(tmp_path):
  whole = _lora_run(tmp_path, "whole", steps=4, export_hf=str(tmp_path / "export"),
                    checkpoint_dir=str(tmp_path / "ckpt"))
  # Another run directory resuming from those checkpoints with another base (seed 1): the
  # saved adapters were trained beside seed 0's.
  with pytest.raises(fs.CheckpointError, match=r"trained beside frozen params 'fresh, seed "
                     r"0' of fingerprint \w+, but this run's are fingerprint \w+"):
    _lora_run(tmp_path, "other", steps=6, seed=1, checkpoint_dir=str(tmp_path / "ckpt"))
  _lora_run(tmp_path, "parts", steps=4, stop_after=2)
  parts = _lora_run(tmp_path, "parts", steps=4)
  assert parts.resumed_from == 2 and parts.eval_loss == whole.eval_loss
  for a, b in zip(jax.tree.leaves(parts.state.params), jax.tree.leaves(whole.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  saved = json.loads((tmp_path / "whole" / "run.json").read_text())["start"]["lora"]
  assert saved["trainable"] == sum(x.size for x in jax.tree.leaves(whole.state.params))
  # The checkpoint holds the adapters and optimizer state, not the base.
  ckpt = tmp_path / "ckpt"
  step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        whole.state._replace(frozen=None))
  restored, extra = fs.checkpoint.restore(str(ckpt), target, step=step)
  assert extra["frozen"]["fingerprint"] == fs.checkpoint.fingerprint(whole.state.frozen)
  # The export: transformers-free, read back by fnscale and compared with merge itself.
  from recipes.lm import hf_maps  # pylint: disable=import-outside-toplevel
  m = hf_maps.read(str(tmp_path / "export"), 32)
  cfg = fs.lora.LoraConfig(4, 8.0, 0.0, m.model.lora_targets(m.cfg))
  merged = fs.lora.merge(whole.state.frozen, whole.state.params, cfg)
  got = fs.checkpoint.hf.load(str(tmp_path / "export"), target_like(merged),
                              hf_maps.checkpoint_map(m, str(tmp_path / "export")))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(merged)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (tmp_path / "export" / "adapter" / "adapter_config.json").exists()


def target_like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.mark.slow
def test_dpo_from_a_preference_file_learns_the_preferred_answers(tmp_path):
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(60):
    a, b = (int(x) for x in rng.integers(1, 50, 2))
    # One preference that held-out pairs share: a polite answer over a curt one.
    rows.append({"prompt": f"{a}+{b}?", "chosen": f"It is {a + b}.", "rejected": "No."})
  path, template = _prefs(tmp_path, rows)
  s = train_lm.train_lm(model_config="llama-tiny", objective="dpo", lora_rank=4,
                        dataset=path, chat_template=template.split("=", 1)[1], seq=128,
                        batch_size=1, mesh="data=2,fsdp=4", steps=8, lr=2e-2,
                        warmup_steps=1, eval_batches=1, sample_len=0, checkpoint=False,
                        run_dir=str(tmp_path / "run"))
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
  evals = [r["eval/dpo_loss"] for r in records if "eval/dpo_loss" in r]
  assert evals[0] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts as its reference
  assert s.eval_loss < evals[0] - 0.05
  assert any("dpo/reward_accuracy" in r for r in records)


@pytest.mark.slow
def test_the_prepared_chip_run_trains_at_a_tiny_size(tmp_path):
  # recipes/bench/lora.py --prepare at llama-tiny: a random HF checkpoint written by fnscale,
  # its tokenizer, a chat cache; the command it prints runs (2 steps here) and the planner
  # (--mesh=auto) chooses for the LoRA state.
  from recipes.bench import lora  # pylint: disable=import-outside-toplevel
  command = lora.prepare(str(tmp_path), "llama-tiny", 64, 40)
  args = dict(a[2:].split("=", 1) for a in command.split()[2:] if "=" in a)
  assert args["lora_rank"] == "16" and args["mesh"] == "auto"
  s = train_lm.train_lm(init_from=args["init_from"], lora_rank=16, dataset=args["dataset"],
                        seq=64, global_batch=8, mesh="auto", steps=2, eval_batches=1,
                        sample_len=0, checkpoint=False, run_dir=args["run_dir"])
  assert s.final_step == 2 and np.isfinite(s.loss)
  frozen = sum(x.size for x in jax.tree.leaves(s.state.frozen))
  assert frozen == sum(x.size for x in jax.tree.leaves(
      fs.checkpoint.hf.load(args["init_from"], target_like(s.state.frozen), _map(args))))


def _map(args):
  from recipes.lm import hf_maps  # pylint: disable=import-outside-toplevel
  m = hf_maps.read(args["init_from"], 64)
  return hf_maps.checkpoint_map(m, args["init_from"])
