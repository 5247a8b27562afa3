"""recipes/train_lm.py on token caches (recipes/pretokenize.py): bad input as one `error:` line
before anything runs, and (slow) a mixture run that trains, stops and resumes bitwise."""
import json
import os
import re

import numpy as np
import pytest

from recipes import train_lm
from recipes.lm import cache, cli

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3) for i in range(60)]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("caches")
  for name, docs in (("code", DOCS), ("web", [d.upper() for d in DOCS])):
    (tmp / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cache.build(cache.BuildSpec((str(tmp / f"{name}.jsonl"),), str(tmp / name),
                                shard_bytes=2000), say=lambda *a: None)
  return tmp


def _argv(tmp, run_dir, *extra):
  return ["train_lm", "--model_config=nano", "--mesh=data=-1", "--seq=32", "--global_batch=8",
          "--steps=4", f"--run_dir={run_dir}", "--eval_batches=1", "--log_every=1",
          "--sample_len=0", *extra]


def _tokenizer(tmp):
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(DOCS, tokenizers.trainers.BpeTrainer(
      vocab_size=280, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp / "other.json"))
  return str(tmp / "other.json")


BAD = [
    ("another tokenizer", lambda t: [f"--dataset={t / 'code'}", f"--tokenizer={_tokenizer(t)}"],
     r"error: dataset '.*code' was tokenized with bytes .* not this run's tokenizer .*fix: pass "
     r"the cache's tokenizer"),
    ("weights that don't parse", lambda t: [f"--dataset={t / 'code'}:0.7,{t / 'web'}:x"],
     r"error: dataset=.*: the weight of '.*web' is not a number >= 0; fix: write PATH:WEIGHT"),
    ("weights summing to zero", lambda t: [f"--dataset={t / 'code'}:0,{t / 'web'}:0"],
     r"error: dataset=.*: the weights sum to zero; fix: give at least one source a weight"),
    ("a document over the row", lambda t: [f"--dataset={t / 'code'}", "--long_docs=error"],
     r"error: .*code holds a document of \d+ tokens, longer than a row \(32 \+ 1 tokens\), "
     r"and --long_docs=error; fix: --long_docs=split"),
    ("epochs", lambda t: [f"--dataset={t / 'code'}", "--epochs=1", "--steps=0"],
     r"error: epochs=1: token caches are read as an endless mixture; give --steps"),
]


@pytest.mark.parametrize("case, extra, message", BAD, ids=[b[0] for b in BAD])
def test_bad_cache_input_is_one_error_line(caches, tmp_path, capsys, case, extra, message):
  del case
  argv = _argv(caches, tmp_path / "run", *extra(caches))
  if "--epochs=1" in argv:
    argv.remove("--steps=4")
    argv.remove("--steps=0")
  assert train_lm.main(argv) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert re.search(message, last), last


def test_an_unreadable_shard_is_named(caches, tmp_path, capsys):
  broken = tmp_path / "broken"
  os.system(f"cp -r {caches / 'web'} {broken}")  # a copy: the module's caches stay whole
  shard = sorted((broken / "shards").glob("*.array_record"))[1]
  shard.write_bytes(shard.read_bytes()[:40])
  assert train_lm.main(_argv(caches, tmp_path / "run", f"--dataset={broken}")) == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith(f"error: shard {shard} is unreadable") and "rerun the pretokenize" in last


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mixture_trains_stops_and_resumes_bitwise(caches, tmp_path, capsys):
  """Two caches at 0.7 / 0.3: the loss falls; stopped at step 2 and rerun, the run ends with
  the params of the uninterrupted one (the per-row data positions travel in the checkpoint)."""
  mix = [f"--dataset={caches / 'code'}:0.7,{caches / 'web'}:0.3",
         f"--compile_cache_dir={caches / 'xla'}"]
  whole = train_lm.run(cli.parse_flags(train_lm.Options,
                                           _argv(caches, tmp_path / "a", *mix)))
  said = capsys.readouterr().out.splitlines()
  at = lambda start: next(i for i, line in enumerate(said) if line.startswith(start))
  assert at("fnscale train_lm:") < at("packing (first_fit, 8 bins"), said  # after the banner
  train_lm.run(cli.parse_flags(train_lm.Options,
                                   _argv(caches, tmp_path / "b", *mix, "--stop_after=2")))
  resumed = train_lm.run(cli.parse_flags(train_lm.Options,
                                             _argv(caches, tmp_path / "b", *mix)))
  assert resumed.start_step == 2 and whole.final_step == resumed.final_step == 4
  import jax  # pylint: disable=g-import-not-at-top
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(whole.state.params),
               jax.device_get(resumed.state.params))
  first = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[1])
  assert np.isfinite(whole.loss) and whole.eval_loss < 5.5, (first, whole.eval_loss)
