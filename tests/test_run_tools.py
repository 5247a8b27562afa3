"""The run tools of the recipes: a BPE tokenizer trained offline, a run's metrics in
metrics.jsonl and TensorBoard events, a profiler window, progress lines and the plot.

References are independent of the code under test: the Hugging Face `tokenizers` loader,
tensorboard's own event reader, hand-written expected strings and counts.
"""
import gzip
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnscale import FnscaleError

ROOT = pathlib.Path(__file__).resolve().parent.parent
from recipes import plot_run as pr
from recipes.lm import profiling as prof_mod
from recipes.lm import run_log as rl
from recipes import train_tokenizer as tt


# The recipes' libraries are optional: each test skips only when the one it needs is absent.
@pytest.fixture(name="tokenizers")
def _tokenizers():
  return pytest.importorskip("tokenizers", reason="pip install tokenizers")


@pytest.fixture(name="matplotlib")
def _matplotlib():
  return pytest.importorskip("matplotlib", reason="pip install matplotlib")


# Varied text (ASCII, accents, CJK, emoji, tabs) so BPE finds many pairs to merge.
CORPUS = [
    "def greet(name):\n\treturn f'Grüße, {name}!'  # café naïve\n",
    "class Point:\n    x: float = 0.0\n    y: float = 0.0  # 点 座標 ☃\n",
    "for i in range(10):\n    print(i, i * i, 'xyz xyz xyz')  🙂\n",
    "Über allen Gipfeln ist Ruh, in allen Wipfeln spürest du kaum einen Hauch.\n",
]


def _corpus(tmp_path, repeat=20):
  d = tmp_path / "corpus"
  d.mkdir()
  for i, text in enumerate(CORPUS):
    (d / f"part{i}.txt").write_text(text * repeat, encoding="utf-8")
  return d


def test_tokenizer_round_trips_text_and_has_the_asked_vocab(tmp_path, tokenizers):
  files = tt.corpus_files(str(_corpus(tmp_path)))
  out = tt.train_tokenizer(files, 300, str(tmp_path / "tok" / "tokenizer.json"))
  tok = tokenizers.Tokenizer.from_file(out)  # the library's own loader, not ours
  assert tok.get_vocab_size() == 300
  unseen = ["Привет, мир! 你好 — ∑ x² ≤ ∞\n", "  leading spaces\tand tabs\r\n", "🙂🙃", ""]
  for text in CORPUS + unseen:
    assert tok.decode(tok.encode(text).ids) == text
  # Merges were learned: a training sentence takes fewer tokens than bytes, and a word the
  # corpus repeats 60 times becomes one token.
  assert len(tok.encode(CORPUS[0]).ids) < len(CORPUS[0].encode())
  assert len(tok.encode(" xyz").ids) == 1
  assert tok.token_to_id(tt.END_OF_TEXT) is not None


def test_tokenizer_trains_on_files_with_bytes_that_are_not_utf8(tmp_path, tokenizers):
  # The stdlib corpus holds such files (test data); tokenizers' own file reader stops at them.
  d = _corpus(tmp_path)
  (d / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 50 + b"\xff\xfe\x80 xyz\n")
  out = tt.train_tokenizer(sorted(str(p) for p in d.iterdir()), 300, str(tmp_path / "t.json"))
  tok = tokenizers.Tokenizer.from_file(out)
  assert tok.get_vocab_size() == 300
  # The bad bytes were read as train_lm reads them: U+FFFD, whose UTF-8 bytes BPE merged.
  assert tok.decode(tok.encode("caf\ufffd").ids) == "caf\ufffd"
  assert len(tok.encode("\ufffd").ids) == 1


def test_files_of_records_are_refused_as_text_naming_pretokenize(tmp_path):
  """A .jsonl or .parquet file (alone or in a directory) given as a text corpus: train_lm,
  baseline and train_tokenizer trained on its JSON markup or compressed bytes; refused,
  naming pretokenize. A directory path as --out is refused before training."""
  from recipes.lm import data  # pylint: disable=import-outside-toplevel
  d = _corpus(tmp_path)
  (d / "rows.jsonl").write_text('{"text": "hello"}\n')
  for spec in (str(d), str(d / "rows.jsonl")):
    with pytest.raises(FnscaleError, match=r"rows\.jsonl'\] hold records \(JSONL/Parquet\), "
                       r"not text; fix: .*recipes/pretokenize\.py --sources="):
      data.read_bytes(spec)
  assert len(data.text_files(str(d / "part1.txt"))) == 1
  r = _run([str(ROOT / "recipes" / "train_tokenizer.py"), f"--data={d}", "--vocab_size=280",
            f"--out={tmp_path / 't.json'}"])
  assert r.returncode == 2 and "hold records" in r.stderr and not (tmp_path / "t.json").exists()
  with pytest.raises(FnscaleError, match=r"expected a file path"):
    tt.train_tokenizer([str(d / "part1.txt")], 280, str(tmp_path / "newdir") + "/")


def test_tokenizer_corpus_specs(tmp_path):
  d = _corpus(tmp_path)
  names = [f"part{i}.txt" for i in range(len(CORPUS))]
  assert tt.corpus_files(str(d)) == [str(d / n) for n in names]
  assert tt.corpus_files(str(d / "part1.txt")) == [str(d / "part1.txt")]
  assert tt.corpus_files(str(d / "part[02].txt")) == [str(d / n) for n in names[0:3:2]]
  default = tt.corpus_files(None)
  assert default and all(f.endswith(".py") for f in default) and default == sorted(default)
  with pytest.raises(FnscaleError, match="nope"):
    tt.corpus_files(str(tmp_path / "nope*"))


@pytest.mark.parametrize("vocab, match", [(100, "vocab_size=100: expected an int >= 257"),
                                          ("300", "vocab_size='300'"),
                                          (True, "vocab_size=True"),
                                          (5000, "gave only .* tokens, not vocab_size=5000")])
def test_tokenizer_rejects_bad_vocab_size(tmp_path, tokenizers, vocab, match):
  files = tt.corpus_files(str(_corpus(tmp_path, repeat=1)))
  out = tmp_path / "tokenizer.json"
  with pytest.raises(FnscaleError, match=match):
    tt.train_tokenizer(files, vocab, str(out))
  assert not out.exists()


def test_tokenizer_rejects_bad_files(tmp_path):
  with pytest.raises(FnscaleError, match="not found: .*missing.txt"):
    tt.train_tokenizer([str(tmp_path / "missing.txt")], 300, str(tmp_path / "t.json"))
  with pytest.raises(FnscaleError, match="expected a non-empty list of paths"):
    tt.train_tokenizer(str(tmp_path / "a.txt"), 300, str(tmp_path / "t.json"))


def _run(args, timeout=240):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_train_tokenizer_command_line(tmp_path, tokenizers):
  out = tmp_path / "tokenizer.json"
  script = str(ROOT / "recipes" / "train_tokenizer.py")
  r = _run([script, f"--data={_corpus(tmp_path)}", "--vocab_size=280", f"--out={out}"])
  assert r.returncode == 0, r.stderr
  assert f"-> {out}" in r.stdout
  assert json.loads(out.read_text())["model"]["type"] == "BPE"
  assert tokenizers.Tokenizer.from_file(str(out)).get_vocab_size() == 280
  bad = _run([script, f"--data={tmp_path / 'nothing'}", f"--out={tmp_path / 'x.json'}"])
  assert bad.returncode == 2 and bad.stderr.startswith("error: dataset=")
  assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------------------------
# run_log: metrics.jsonl + TensorBoard, profiler window, progress lines
# ------------------------------------------------------------------------------------------------

# What a run writes, and (by hand) the records and scalars it must produce.
RECORDS = [
    (0, {"eval/loss": 5.5}),
    (10, {"train/loss": 3.25, "perf/tokens_per_s": None, "perf/mfu": np.float32(0.125)}),
    (20, {"train/loss": jnp.asarray(2.5), "perf/tokens_per_s": 4471, "perf/mfu": 0.3}),
    (20, {"eval/loss": 2.75}),
]
JSONL = [{"step": 0, "eval/loss": 5.5},
         {"step": 10, "train/loss": 3.25, "perf/mfu": 0.125},
         {"step": 20, "train/loss": 2.5, "perf/tokens_per_s": 4471.0, "perf/mfu": 0.3},
         {"step": 20, "eval/loss": 2.75}]
SCALARS = {"eval/loss": [(0, 5.5), (20, 2.75)], "train/loss": [(10, 3.25), (20, 2.5)],
           "perf/tokens_per_s": [(20, 4471.0)], "perf/mfu": [(10, 0.125), (20, 0.3)]}


def _write(run_dir, records=RECORDS, **kw):
  log = rl.run_log(str(run_dir), **kw)
  for step, metrics in records:
    log.write(step, metrics)
  log.close()


def _jsonl(run_dir):
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_scalars(run_dir):
  # tensorboard's own reader, independent of the tensorboardX writer
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=all
  acc = event_accumulator.EventAccumulator(str(run_dir))
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _float32(scalars):  # TensorBoard stores float32
  return {tag: [(s, float(np.float32(v))) for s, v in pts] for tag, pts in scalars.items()}


def test_run_log_writes_jsonl_and_tensorboard_events(tmp_path):
  pytest.importorskip("tensorboardX")
  pytest.importorskip("tensorboard")
  _write(tmp_path / "run")
  assert _jsonl(tmp_path / "run") == JSONL
  assert _tensorboard_scalars(tmp_path / "run") == _float32(SCALARS)


def test_run_log_appends_when_a_run_resumes(tmp_path):
  pytest.importorskip("tensorboardX")
  pytest.importorskip("tensorboard")
  _write(tmp_path, RECORDS[:2])
  _write(tmp_path, RECORDS[2:])
  assert _jsonl(tmp_path) == JSONL
  assert _tensorboard_scalars(tmp_path) == _float32(SCALARS)


def test_a_run_resumed_from_a_step_logs_no_step_twice(tmp_path):
  # A run stopped with its log at step 20 but its checkpoint at step 10 trains steps 11..20
  # again: resuming from 10 drops the records after 10 (TensorBoard hides the events), and
  # the records it writes follow, each step once.
  pytest.importorskip("tensorboardX")
  pytest.importorskip("tensorboard")
  _write(tmp_path)
  said = []
  _write(tmp_path, [(20, {"train/loss": 2.0})], keep_through=10, say=said.append)
  assert _jsonl(tmp_path) == JSONL[:2] + [{"step": 20, "train/loss": 2.0}]
  assert said == [f"run_log: 2 records of step 20 dropped from {tmp_path}/metrics.jsonl "
                  "(this run continues from step 10: no step is logged twice)"]
  scalars = _tensorboard_scalars(tmp_path)
  assert scalars["train/loss"] == [(10, 3.25), (20, 2.0)] and scalars["eval/loss"] == [(0, 5.5)]
  # Starting afresh (-1): a fresh log; nothing to drop: nothing said.
  _write(tmp_path, RECORDS[:1], keep_through=-1, say=said.append)
  assert _jsonl(tmp_path) == JSONL[:1] and len(said) == 2 and "a fresh log" in said[1]
  _write(tmp_path, RECORDS[1:2], keep_through=0, say=said.append)
  assert _jsonl(tmp_path) == JSONL[:2] and len(said) == 2


def test_run_log_without_tensorboardx_writes_jsonl_and_says_so_once(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
  said = []
  _write(tmp_path, say=said.append)
  assert _jsonl(tmp_path) == JSONL
  assert len(said) == 1 and "tensorboardX is not installed" in said[0]
  assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_run_log_inactive_writes_nothing(tmp_path):
  _write(tmp_path / "run", active=False)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("step, metrics, match", [
    (-1, {"train/loss": 1.0}, "step=-1: expected an int >= 0"),
    ("3", {"train/loss": 1.0}, "step='3'"),
    (True, {"train/loss": 1.0}, "step=True"),
    (1, [("train/loss", 1.0)], "expected a dict"),
    (1, {"train/loss": "low"}, "metric 'train/loss'='low': expected a str name and a real"),
    (1, {"train/loss": np.ones(2)}, "metric 'train/loss'="),
    (1, {3: 1.0}, "metric 3=1.0"),
])
def test_run_log_rejects_bad_records(tmp_path, step, metrics, match):
  log = rl.run_log(str(tmp_path), tracker="none")
  with pytest.raises(FnscaleError, match=match):
    log.write(step, metrics)
  log.close()
  assert (tmp_path / "metrics.jsonl").read_text() == ""
  with pytest.raises(FnscaleError, match="is closed"):
    log.write(1, {"train/loss": 1.0})


def test_parse_profile_steps():
  assert prof_mod.parse_profile_steps("10:15") == (10, 15)
  assert prof_mod.parse_profile_steps(" 0:1 ", steps=1) == (0, 1)
  assert prof_mod.parse_profile_steps("") is None and prof_mod.parse_profile_steps(None) is None


@pytest.mark.parametrize("spec", ["10", "15:10", "5:5", "a:b", "-1:3", "1:2:3", "1.5:3", 12])
def test_parse_profile_steps_rejects_bad_strings(spec):
  with pytest.raises(FnscaleError) as e:
    prof_mod.parse_profile_steps(spec)
  assert f"--profile_steps={spec!r}: expected START:STOP" in str(e.value)


def test_parse_profile_steps_rejects_a_window_past_the_run():
  with pytest.raises(FnscaleError, match=r"'10:15'.* <= 12 \(the run's steps\)"):
    prof_mod.parse_profile_steps("10:15", steps=12)


def _traced_calls(trace_dir, name):
  """Calls of jitted `name` in the Perfetto trace (outermost events: a call nests two)."""
  with gzip.open(os.path.join(trace_dir, "perfetto_trace.json.gz")) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
           if e.get("name") == f"PjitFunction({name})" and e.get("ph") == "X"]
  return sum(not any(a <= s and t <= b and (a, b) != (s, t) for a, b in spans)
             for s, t in spans)


def _tiny_steps(prof, n):
  def tiny_step(x):
    return jnp.tanh(x @ x)
  step = jax.jit(tiny_step)
  x = jax.block_until_ready(step(jnp.ones((16, 16))))  # compiled before any trace
  returned = []
  for i in range(n):
    returned.append(prof.at_step(i, pending=x))
    x = step(x)
  return returned, x


def test_profiler_traces_exactly_the_window(tmp_path):
  said = []
  prof = prof_mod.profiler(prof_mod.ProfileWindow(2, 5), str(tmp_path), say=said.append)
  returned, x = _tiny_steps(prof, 7)
  where = returned[5]
  assert returned[:5] == [None] * 5 and returned[6] is None and prof.close(7, x) is None
  assert os.path.dirname(where) == str(tmp_path / "plugins" / "profile")
  assert [f for f in os.listdir(where) if f.endswith(".xplane.pb")]
  assert _traced_calls(where, "tiny_step") == 3  # steps 2, 3, 4 and no other
  assert len(said) == 2 and said[1].startswith(f"profile: steps 2..4 traced to {where}")


def test_profiler_close_stops_a_trace_the_loop_ended_inside(tmp_path):
  prof = prof_mod.profiler(prof_mod.ProfileWindow(1, 100), str(tmp_path), say=lambda s: None)
  returned, x = _tiny_steps(prof, 3)
  assert returned == [None] * 3
  where = prof.close(3, x)
  assert _traced_calls(where, "tiny_step") == 2
  assert prof_mod.profiler(None, str(tmp_path / "none")).at_step(0) is None
  assert not (tmp_path / "none").exists()
  with pytest.raises(FnscaleError, match="profile window '1:3': expected a ProfileWindow"):
    prof_mod.profiler("1:3", str(tmp_path))


def test_progress_line_is_one_plain_line_with_eta():
  line = rl.progress_line(120, 500, {"train/loss": 2.332, "train/lr": 2.74e-3,
                                     "perf/tokens_per_s": 4471.2, "perf/mfu": 0.327,
                                     "train/grad_norm": 0.123456, "eval/loss": None},
                          seconds_per_step=348 / 380)
  assert line == ("step    120/500  loss 2.3320  lr 2.74e-03  4,471 tok/s  MFU 32.7%  "
                  "grad_norm 0.1235  ETA 5m48s")
  assert rl.progress_line(0, 10) == "step      0/10"
  assert rl.format_duration(3725) == "1h02m" and rl.format_duration(-3) == "0m00s"


# ------------------------------------------------------------------------------------------------
# plot_run: metrics.jsonl -> PNG
# ------------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics_file(run_dir, lines):
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
  return run_dir


def _falling_run(run_dir, rate):
  lines = [json.dumps({"step": s, "train/loss": 5.0 * rate ** s, "perf/tokens_per_s": 4000 + s,
                       "perf/mfu": 0.3}) for s in range(1, 40)]
  lines += [json.dumps({"step": s, "eval/loss": 5.0 * rate ** s}) for s in (0, 20, 39)]
  return _metrics_file(run_dir, lines)


def test_read_metrics_keeps_the_last_value_of_a_repeated_step(tmp_path):
  lines = ['{"event": "start", "model": "tiny"}',             # no step: skipped
           '{"step": 10, "train/loss": 3.0, "other": 1.0}',
           '{"step": 20, "train/loss": 2.0, "perf/mfu": "n/a"}',
           '{"step": 20, "eval/loss": 2.5}',
           '{"step": 15, "train/loss": 2.9}',                  # resumed from step 10
           '{"step": 20, "train/loss": 2.1}',
           '{"step": 30, "train/lo']                           # being written
  got = pr.read_metrics(str(_metrics_file(tmp_path, lines) / "metrics.jsonl"))
  assert got == {"train/loss": ([10, 15, 20], [3.0, 2.9, 2.1]), "eval/loss": ([20], [2.5])}


def test_plot_run_writes_a_png_that_depends_on_the_data(tmp_path, matplotlib):
  import matplotlib.image  # pylint: disable=import-outside-toplevel,redefined-outer-name
  a = pr.plot_run(str(_falling_run(tmp_path / "a", 0.97)))
  b = pr.plot_run(str(_falling_run(tmp_path / "b", 0.90)), out=str(tmp_path / "b.png"))
  assert a == str(tmp_path / "a" / "metrics.png") and b == str(tmp_path / "b.png")
  images = []
  for path in (a, b):
    with open(path, "rb") as f:
      assert f.read(8) == PNG_MAGIC
    images.append(matplotlib.image.imread(path))
    assert images[-1].shape == (800, 700, 4)  # figsize 7x8 inches at 100 dpi
    assert images[-1][..., :3].std() > 0.05  # not a blank page
  assert not np.array_equal(images[0], images[1])


def test_plot_run_draws_the_bigram_baseline_train_lm_recorded(tmp_path, matplotlib):
  import matplotlib.image  # pylint: disable=import-outside-toplevel,redefined-outer-name
  plain = pr.plot_run(str(_falling_run(tmp_path / "plain", 0.95)))
  run = _falling_run(tmp_path / "base", 0.95)
  assert pr.read_baseline(str(run)) is None  # no run.json: no line, no error
  (run / "run.json").write_text("{not json")
  assert pr.read_baseline(str(run)) is None
  (run / "run.json").unlink()
  rl.write_run_record(str(run), "data", {"bigram_loss": 2.46})
  assert pr.read_baseline(str(run)) == 2.46
  with_line = pr.plot_run(str(run))
  a, b = matplotlib.image.imread(plain), matplotlib.image.imread(with_line)
  changed = np.argwhere(np.abs(a - b).sum(axis=-1) > 0.1)
  # Only the loss panel (the top third of the 800-pixel-high figure) changed: line, legend.
  assert len(changed) > 100 and changed[:, 0].max() < 800 / 3


def test_plot_run_draws_a_run_logged_by_run_log(tmp_path, matplotlib):
  _write(tmp_path, tracker="none")
  with open(pr.plot_run(str(tmp_path)), "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_plot_run_errors_name_the_path(tmp_path):
  with pytest.raises(FnscaleError, match=f"run directory '{tmp_path / 'nope'}' does not exist"):
    pr.plot_run(str(tmp_path / "nope"))
  with pytest.raises(FnscaleError, match=f"{tmp_path / 'metrics.jsonl'} is missing or empty"):
    pr.plot_run(str(tmp_path))
  _metrics_file(tmp_path, [])
  with pytest.raises(FnscaleError, match="is missing or empty"):
    pr.plot_run(str(tmp_path))
  _metrics_file(tmp_path, ['{"step": 1, "grad_norm": 2.0}'])
  with pytest.raises(FnscaleError, match="metrics.jsonl has none of train/loss, eval/loss"):
    pr.plot_run(str(tmp_path))
  _metrics_file(tmp_path, ['{"step": 1, "train/loss": 2.0}', "oops", '{"step": 2}'])
  with pytest.raises(FnscaleError, match=f"{tmp_path / 'metrics.jsonl'}:2: not a JSON line"):
    pr.plot_run(str(tmp_path))
  assert not (tmp_path / "metrics.png").exists()


@pytest.mark.slow
def test_plot_run_command_line(tmp_path, matplotlib):
  script = str(ROOT / "recipes" / "plot_run.py")
  r = _run([script, str(_falling_run(tmp_path / "run", 0.95))], timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == str(tmp_path / "run" / "metrics.png")
  with open(tmp_path / "run" / "metrics.png", "rb") as f:
    assert f.read(8) == PNG_MAGIC
  bad = _run([script, str(tmp_path / "missing")], timeout=120)
  assert bad.returncode == 2 and bad.stderr.startswith("error: run directory")


def test_the_last_eval_of_a_run_cut_by_a_kill_is_read_past_its_torn_last_line(tmp_path):
  """A run killed mid-write leaves half a line at the end of metrics.jsonl: a finished run's
  rerun still quotes its last eval (summary.last_logged reads run_log.records), and a torn
  line elsewhere is named."""
  from recipes.lm import summary  # pylint: disable=import-outside-toplevel
  lines = ['{"step": 2, "eval/loss": 3.5}', '{"step": 4, "train/loss": 2.0}',
           '{"step": 4, "eval/loss": 3.25}', '{"step": 5, "eval/lo']
  run_dir = _metrics_file(tmp_path, lines)
  assert summary.last_logged(str(run_dir), ("eval/loss",), 4) == (4, 3.25)
  assert summary.last_logged(str(run_dir), ("eval/loss",), 3) == (2, 3.5)
  bad = _metrics_file(tmp_path / "bad", [lines[0], lines[3], lines[2]])
  with pytest.raises(FnscaleError, match="metrics.jsonl:2: not a JSON line"):
    summary.last_logged(str(bad), ("eval/loss",), 4)


# ------------------------------------------------------------------------------------------------
# goodput: where a run's wall time goes
# ------------------------------------------------------------------------------------------------

def _earlier_start(run_dir):
  """The metrics.jsonl of a start that trained steps 1..5 (its last record at step 4: a kill
  after step 5 left none) and spent 10 s, 3 of them on 4 steps."""
  record = {"step": 4, "goodput/productive_s": 3.0, "goodput/startup_s": 4.0,
            "goodput/compile_s": 2.0, "goodput/checkpoint_s": 0.5, "goodput/eval_s": 0.25,
            "goodput/lost_s": 0.0, "goodput/other_s": 0.25, "goodput/wall_s": 10.0,
            "goodput/fraction": 0.3, "goodput/steps": 4.0, "goodput/lost_steps": 0.0,
            "goodput/trained_through": 4.0, "goodput/starts": 1.0}
  return _metrics_file(run_dir, [json.dumps({"step": s, "train/loss": 3.0}) for s in (1, 2, 4)]
                       + [json.dumps(record), json.dumps({"step": 5, "train/loss": 2.9})])


def test_a_restart_books_each_second_once_and_redone_steps_as_lost(tmp_path, monkeypatch):
  """On a clock set by hand: a restart of the run above, resumed from step 2, spends 1 s
  starting, 2 s compiling, 0.5 s restoring, 1 s on each of steps 3, 4 and 5 (which the earlier
  start trained: lost) with a 0.25 s save in step 4, then 1 s on step 6 (productive)."""
  from recipes.lm import goodput  # pylint: disable=import-outside-toplevel
  now = [100.0]
  monkeypatch.setattr(goodput.time, "time", lambda: now[0])
  ledger = goodput.ledger(100.0, str(_earlier_start(tmp_path)))

  def at(t, call, *args):
    now[0] = 100.0 + t
    return call(*args)
  at(1.0, ledger.enter, "compile")
  at(3.0, ledger.enter, "other")
  with ledger.during("checkpoint"):
    now[0] = 103.5
  for t, done in ((3.5, 3), (4.5, 4)):
    at(t, ledger.at_step, done)
  now[0] = 105.0
  with ledger.during("checkpoint"):
    now[0] = 105.25
  at(5.75, ledger.at_step, 5)
  at(6.75, ledger.at_step, 6)
  got = at(7.75, ledger.record)
  assert got == {"goodput/productive_s": 3.0 + 1.0, "goodput/startup_s": 4.0 + 1.0,
                 "goodput/compile_s": 2.0 + 2.0, "goodput/checkpoint_s": 0.5 + 0.75,
                 "goodput/eval_s": 0.25, "goodput/lost_s": 3.0, "goodput/other_s": 0.25,
                 "goodput/wall_s": 10.0 + 7.75, "goodput/fraction": 4.0 / 17.75,
                 "goodput/steps": 5, "goodput/lost_steps": 3, "goodput/trained_through": 6,
                 "goodput/starts": 2}
  assert goodput.line(got) == (
      "goodput 22.5% of 18 s over 2 starts: start-up 28.2%, compile 22.5%, checkpoints 7.0%, "
      "eval/sample 1.4%, lost 16.9% (3 steps redone), other 1.4% (5 steps trained)")


def test_the_goodput_figure_draws_each_phases_share_of_the_records(tmp_path, matplotlib):
  """One line per phase, at each step's last record (a restart writes its step again), each
  phase's seconds over the wall seconds in percent; a log without goodput records is named."""
  import matplotlib.image  # pylint: disable=import-outside-toplevel,redefined-outer-name
  from recipes.lm import goodput  # pylint: disable=import-outside-toplevel
  run_dir = _earlier_start(tmp_path / "run")
  second = dict(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[3]),
                **{"goodput/wall_s": 20.0, "goodput/lost_s": 10.0})
  with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write(json.dumps({**second, "step": 2}) + "\n" + json.dumps(second) + "\n")
  lines = pr.goodput_figure(str(run_dir)).axes[0].get_lines()
  want = {"productive": [15.0, 15.0], "startup": [20.0, 20.0], "compile": [10.0, 10.0],
          "checkpoint": [2.5, 2.5], "eval": [1.25, 1.25], "lost": [50.0, 50.0],
          "other": [1.25, 1.25]}
  assert [ln.get_label() for ln in lines] == list(goodput.PHASES)
  for ln in lines:
    assert list(ln.get_xdata()) == [2, 4] and list(ln.get_ydata()) == want[ln.get_label()]
  out = pr.plot_goodput(str(run_dir))
  assert out == str(run_dir / "goodput.png") and os.path.getsize(out) > 0
  assert matplotlib.image.imread(out).shape[:2] == (450, 700)
  with pytest.raises(FnscaleError, match="metrics.jsonl has no goodput records"):
    pr.goodput_figure(str(_falling_run(tmp_path / "plain", 0.9)))
