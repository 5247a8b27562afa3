"""recipes/pretokenize.py and recipes/lm/cache.py, shards.py, chat.py: caches from text, JSONL
and Parquet (and gs:// through a local stand-in for fsspec's GCS file system), checked against
the `tokenizers` library itself; resuming a killed build; chat loss weights against the
template's rendering of each turn by hand; bad input as one `error:` line."""
import dataclasses
import json
import os
import re
import sys
from typing import NamedTuple

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np
import pytest

import fnscale as fs
from recipes import pretokenize
from recipes.lm import cache, chat, shards

tokenizers = pytest.importorskip("tokenizers")
TEXTS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n", "class A:\n    pass\n",
         "x = [i * i for i in range(10)]\n"]


def _bpe(tmp_path, special=()):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(special), show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 20 + ["Hello, how are you? I am fine. What is 2+2? 4."] * 20,
                          trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return tok, str(path)


def _read_all(c):
  from array_record.python import array_record_module as ar  # pylint: disable=g-import-not-at-top
  out = []
  for p in c.shard_paths:
    r = ar.ArrayRecordReader(p)
    out += [shards.unrecord(x, c.weighted) for x in r.read_all()]
    r.close()
  return out


def test_text_jsonl_and_parquet_sources_tokenize_as_the_library_does(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  tok, tok_path = _bpe(tmp_path)
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "a.py").write_text(TEXTS[0])
  (tmp_path / "src" / "b.jsonl").write_text(
      "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)) * 5)
  pq.write_table(pa.table({"text": TEXTS * 3}), tmp_path / "src" / "c.parquet", row_group_size=2)
  spec = cache.BuildSpec((str(tmp_path / "src"),), str(tmp_path / "out"), tok_path,
                         shard_bytes=150)
  manifest = cache.build(spec, say=lambda *a: None)
  want = [TEXTS[0]] + TEXTS * 5 + TEXTS * 3  # files sorted: a.py, b.jsonl, c.parquet
  got = _read_all(cache.open_cache(str(tmp_path / "out")))
  assert len(manifest["shards"]) > 3  # the JSONL and Parquet files split over several shards
  assert [ids.tolist() for ids, _ in got] == [tok.encode(t).ids for t in want]
  assert manifest["docs"] == len(want)
  assert manifest["tokens"] == sum(len(tok.encode(t).ids) for t in want)
  assert manifest["tokenizer"]["vocab"] == tok.get_vocab_size()
  assert [s["bytes"] for s in manifest["sources"]][0] == len(TEXTS[0])


def test_a_jsonl_line_that_is_not_utf8_is_read_as_text_files_are(tmp_path):
  """A Latin-1 byte in a JSONL string (a raw UnicodeDecodeError, a .tmp shard left) reads as
  U+FFFD, as a text file's bytes do; the documents around it are whole."""
  tok, tok_path = _bpe(tmp_path)
  src = tmp_path / "a.jsonl"
  src.write_bytes(b'{"text": "caf\xe9 ok"}\n' + json.dumps({"text": TEXTS[1]}).encode() + b"\n")
  cache.build(cache.BuildSpec((str(src),), str(tmp_path / "out"), tok_path),
              say=lambda *a: None)
  got = _read_all(cache.open_cache(str(tmp_path / "out")))
  assert [ids.tolist() for ids, _ in got] == [tok.encode(t).ids for t in ("caf\ufffd ok",
                                                                        TEXTS[1])]


class _LocalBucket(LocalFileSystem):
  """fsspec's GCS file system stood in by a local directory: gs://BUCKET/x is ROOT/BUCKET/x."""
  root = ""

  def __init__(self, *args, **kwargs):
    kwargs.pop("finalize_on_close", None)
    super().__init__(*args, **kwargs)

  def _strip_protocol(self, path):  # pylint: disable=arguments-differ
    path = path if isinstance(path, str) else str(path)
    if path.startswith("gs://"):
      path = os.path.join(type(self).root, path[len("gs://"):])
    return super()._strip_protocol(path)


def test_gs_sources_read_through_fsspec(tmp_path, monkeypatch):
  bucket = tmp_path / "bucket" / "corpus"
  bucket.mkdir(parents=True)
  (bucket / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  monkeypatch.setattr(_LocalBucket, "root", str(tmp_path / "bucket"))
  registry = sys.modules["fsspec.registry"]._registry  # pylint: disable=protected-access
  monkeypatch.setitem(registry, "gcs", _LocalBucket)
  from etils.epath import backend  # pylint: disable=g-import-not-at-top
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  try:
    manifest = cache.build(cache.BuildSpec(("gs://corpus",), str(tmp_path / "out")),
                           say=lambda *a: None)
  finally:
    backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  assert manifest["sources"][0]["path"] == "gs://corpus/d.jsonl"
  got = _read_all(cache.open_cache(str(tmp_path / "out")))
  assert [bytes(ids.astype(np.uint8).tolist()).decode() for ids, _ in got] == TEXTS


def test_the_processes_said_are_the_ones_used(tmp_path):
  # Four worker processes asked for, one shard to write: one process runs it, and both the
  # start line and the run's record say so.
  src = tmp_path / "d.jsonl"
  src.write_text(json.dumps({"text": TEXTS[0]}) + "\n")
  said = []
  built = cache.build(cache.BuildSpec((str(src),), str(tmp_path / "out"), workers=4),
                      say=said.append)
  assert said[0].endswith(", 1 process"), said[0]
  assert built["run"]["workers"] == 1
  assert cache.processes(2) == "2 processes"
  # Run again, nothing left to write: no process runs.
  said.clear()
  cache.build(cache.BuildSpec((str(src),), str(tmp_path / "out"), workers=4), say=said.append)
  assert said[0].endswith("(1 already done), 0 processes"), said[0]


def test_a_killed_build_reruns_only_its_missing_shards(tmp_path):
  src = tmp_path / "d.jsonl"
  src.write_text("".join(json.dumps({"text": t * 4}) + "\n" for t in TEXTS * 6))
  spec = cache.BuildSpec((str(src),), str(tmp_path / "out"), shard_bytes=400)
  first = cache.build(spec, say=lambda *a: None)
  shard_dir = tmp_path / "out" / "shards"
  names = sorted(p for p in os.listdir(shard_dir) if p.endswith(".array_record"))
  assert len(names) >= 4
  # As a kill leaves it: shard 1 half written (its temporary file), shard 2 not begun,
  # no manifest.
  (shard_dir / names[1]).rename(shard_dir / (names[1] + ".tmp"))
  for n in names[1:3]:
    os.remove(shard_dir / (n + ".json"))
  os.remove(shard_dir / names[2])
  os.remove(tmp_path / "out" / "manifest.json")
  before = {n: os.stat(shard_dir / n).st_mtime_ns for n in names if n not in names[1:3]}
  said = []
  again = cache.build(spec, say=said.append)
  assert f"({len(names) - 2} already done)" in said[0]
  assert {n: os.stat(shard_dir / n).st_mtime_ns for n in before} == before
  assert again["shards"] == first["shards"] and again["tokens"] == first["tokens"]
  assert not any(p.endswith(".tmp") for p in os.listdir(shard_dir))
  with pytest.raises(fs.InputError, match=r"holds a cache begun with other inputs \(differing: "
                     r"tokenizer\)"):
    cache.build(dataclasses.replace(spec, tokenizer=_bpe(tmp_path)[1]), say=lambda *a: None)


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_chat_weights_are_one_exactly_on_each_assistant_turn(tmp_path):
  """Against the template's rendering of each turn, written out by hand: the tokens with
  weight 1 are exactly those of "CONTENT<|end|>\\n" of each assistant turn, tokenized alone;
  the rest (system, user, headers) weight 0; the pieces join to the whole rendering."""
  specials = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
  tok, _ = _bpe(tmp_path, specials)
  template = chat.Template(TEMPLATE)
  conv = [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hello, how are you?"},
          {"role": "assistant", "content": "I am fine."},
          {"role": "user", "content": "What is 2+2?"},
          {"role": "assistant", "content": "4."}]
  ids, weights = chat.tokenize(conv, template, tok)
  enc = lambda t: tok.encode(t, add_special_tokens=False).ids
  turns = ["I am fine.<|end|>\n", "4.<|end|>\n"]
  others = ["<|system|>\nBe brief.<|end|>\n<|user|>\nHello, how are you?<|end|>\n"
            "<|assistant|>\n", "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"]
  want = enc(others[0]) + enc(turns[0]) + enc(others[1]) + enc(turns[1])
  assert ids.tolist() == want
  assert ids[weights == 1].tolist() == enc(turns[0]) + enc(turns[1])
  assert weights.tolist() == ([0] * len(enc(others[0])) + [1] * len(enc(turns[0])) +
                              [0] * len(enc(others[1])) + [1] * len(enc(turns[1])))
  assert "".join(t for t, _ in chat.pieces(conv, template)) == chat.render(conv, template)


def _hf_dir(tmp_path):
  """A tokenizer directory as a Hugging Face checkpoint has it: tokenizer.json and a
  tokenizer_config.json with the chat template."""
  d = tmp_path / "hf"
  d.mkdir()
  _, path = _bpe(tmp_path, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
  os.rename(path, d / "tokenizer.json")
  (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                       "eos_token": "<|end|>"}))
  return d


class _Ran(NamedTuple):
  returncode: int
  stdout: str
  stderr: str


@pytest.fixture
def run(capsys):
  """The command in this process: its exit status and output."""
  def run_(*args):
    capsys.readouterr()
    rc = pretokenize.main(["pretokenize.py", *args])
    out, err = capsys.readouterr()
    return _Ran(rc, out, err)
  return run_


def test_chat_cache_from_a_checkpoints_tokenizer_dir_and_bad_conversations(tmp_path, run):
  d = _hf_dir(tmp_path)
  good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
  src = tmp_path / "chats.jsonl"
  src.write_text(json.dumps({"messages": good}) + "\n")
  r = run(f"--sources={src}", f"--out={tmp_path / 'sft'}", f"--tokenizer={d}", "--chat",
           "--workers=1")
  assert r.returncode == 0, r.stderr
  c = cache.open_cache(str(tmp_path / "sft"))
  assert c.weighted and c.manifest["loss_tokens"] < c.manifest["tokens"]
  assert os.path.isfile(tmp_path / "sft" / "tokenizer_config.json")
  # train_lm --init_from=DIR reads DIR/tokenizer.json: the same tokenizer as the cache's.
  for spec in (str(d), str(d / "tokenizer.json"), ""):
    assert cache.check_tokenizer(c, spec)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": good}) + "\n" +
                 json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
  r = run(f"--sources={bad}", f"--out={tmp_path / 'bad'}", f"--tokenizer={d}", "--chat",
           "--workers=1")
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith(f"error: {bad}, byte ") and "without an assistant turn" in r.stderr


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("not json\n"), r"the line at byte 0 is not JSON"),
    (lambda p: p.write_text('{"body": "x"}\n'), r"has no 'text' field .*--field=NAME"),
])
def test_bad_records_are_one_error_line(tmp_path, run, make, message):
  src = tmp_path / "d.jsonl"
  make(src)
  r = run(f"--sources={src}", f"--out={tmp_path / 'o'}", "--workers=1")
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: ") and re.search(message, r.stderr)


def test_open_names_an_unreadable_shard_and_a_foreign_tokenizer(tmp_path):
  src = tmp_path / "d.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
  cache.build(cache.BuildSpec((str(src),), str(tmp_path / "out"), shard_bytes=200),
              say=lambda *a: None)
  c = cache.open_cache(str(tmp_path / "out"))
  with pytest.raises(fs.InputError, match=r"was tokenized with bytes .* not this run's "
                     r"tokenizer .*fix: pass the cache's tokenizer"):
    cache.check_tokenizer(c, _bpe(tmp_path)[1])
  assert cache.check_tokenizer(c, "") == "bytes"
  broken = c.shard_paths[1]
  with open(broken, "r+b") as f:
    f.truncate(os.path.getsize(broken) // 2)
  with pytest.raises(fs.InputError, match=rf"shard {broken} is unreadable .*rerun the "
                     "pretokenize command"):
    cache.open_cache(str(tmp_path / "out"))
  os.remove(tmp_path / "out" / "manifest.json")
  with pytest.raises(fs.InputError, match="an unfinished build"):
    cache.open_cache(str(tmp_path / "out"))
