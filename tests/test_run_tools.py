"""The run tools of the recipes: a BPE tokenizer trained offline, a run's metrics in
metrics.jsonl and TensorBoard events, a profiler window, progress lines and the plot.

References are independent of the code under test: the Hugging Face `tokenizers` loader,
tensorboard's own event reader, hand-written expected strings and counts.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from fnscale.errors import FnscaleError

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))

tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
import train_tokenizer as tt  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
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


def test_tokenizer_round_trips_text_and_has_the_asked_vocab(tmp_path):
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


def test_tokenizer_corpus_specs(tmp_path):
  d = _corpus(tmp_path)
  names = [f"part{i}.txt" for i in range(len(CORPUS))]
  assert tt.corpus_files(str(d)) == [str(d / n) for n in names]
  assert tt.corpus_files(str(d / "part1.txt")) == [str(d / "part1.txt")]
  assert tt.corpus_files(str(d / "part[02].txt")) == [str(d / "part0.txt"), str(d / "part2.txt")]
  default = tt.corpus_files(None)
  assert default and all(f.endswith(".py") for f in default) and default == sorted(default)
  with pytest.raises(FnscaleError, match="nope"):
    tt.corpus_files(str(tmp_path / "nope*"))


@pytest.mark.parametrize("vocab, match", [(100, "vocab_size=100: expected an int >= 257"),
                                          ("300", "vocab_size='300'"),
                                          (True, "vocab_size=True"),
                                          (5000, "gave only .* tokens, not vocab_size=5000")])
def test_tokenizer_rejects_bad_vocab_size(tmp_path, vocab, match):
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


def test_train_tokenizer_command_line(tmp_path):
  out = tmp_path / "tokenizer.json"
  script = str(ROOT / "recipes" / "train_tokenizer.py")
  r = _run([script, f"--data={_corpus(tmp_path)}", "--vocab_size=280", f"--out={out}"])
  assert r.returncode == 0, r.stderr
  assert f"-> {out}" in r.stdout
  assert json.loads(out.read_text())["model"]["type"] == "BPE"
  assert tokenizers.Tokenizer.from_file(str(out)).get_vocab_size() == 280
  bad = _run([script, f"--data={tmp_path / 'nothing'}", f"--out={tmp_path / 'x.json'}"])
  assert bad.returncode == 2 and bad.stderr.startswith("error: --data=")
  assert not (tmp_path / "x.json").exists()
