"""recipes/lm/data.py: corpora, the held-out split, grain windows, per-process rows, iterator state
and tokenizers, checked against hand counts and the `tokenizers` library itself."""
import math

import jax
import numpy as np
import pytest

import fnscale as fs
from recipes.lm import batches, data


def _window_set(tokens, seq):
  n = (len(tokens) - 1) // seq
  return sorted(tuple(tokens[i * seq:i * seq + seq + 1]) for i in range(n))


def test_each_epoch_reads_every_window_once_in_a_new_order():
  tokens = np.arange(1000, dtype=np.int32)  # 999 // 8 = 124 windows of 9 tokens
  ds = batches.windows(tokens, 8, seed=3, epochs=2)
  assert len(ds) == 2 * 124
  first = [tuple(ds[i]) for i in range(124)]
  second = [tuple(ds[i]) for i in range(124, 248)]
  assert sorted(first) == _window_set(tokens, 8) == sorted(second)
  assert first != sorted(first) and first != second  # shuffled, and anew each epoch
  same = [tuple(w) for w in batches.windows(tokens, 8, seed=3, epochs=1)]
  other = [tuple(w) for w in batches.windows(tokens, 8, seed=4, epochs=1)]
  assert same == first and other != first  # the order is a function of the seed


def test_steps_for_epochs_is_whole_global_batches():
  corpus = data.Corpus(np.zeros(3801, np.uint8), np.zeros(200, np.uint8), 256, 1.0, None, None,
                       "")
  # (3801 - 1) // 32 = 118 windows; 3 epochs = 354 rows = 22 batches of 16 (2 rows dropped).
  assert batches.steps_for(corpus, 32, 16, 3, None) == 22
  assert batches.steps_for(corpus, 32, 16, None, 7) == 7
  assert batches.steps_for(corpus, 32, 16, None, None) is None
  with pytest.raises(fs.FnscaleError, match=r"epochs=1 makes no step: the training split has "
                     r"118 windows of seq \+ 1 = 33 tokens, fewer than one global batch of 128"):
    batches.steps_for(corpus, 32, 128, 1, None)


class _Rows:
  """A stand-in batch sharding: this process's devices hold `rows` of the global batch."""

  def __init__(self, *blocks):
    self.blocks = blocks

  def addressable_devices_indices_map(self, shape):
    return {i: (slice(a, b), slice(None)) for i, (a, b) in enumerate(self.blocks)}


def _corpus(n=5000):
  rng = np.random.default_rng(0)
  return data.Corpus(rng.integers(0, 256, n).astype(np.uint8),
                     rng.integers(0, 256, 700).astype(np.uint8), 256, 1.0, None, None, "")


def test_two_processes_read_disjoint_halves_of_the_one_process_batch():
  corpus = _corpus()
  one, _ = batches.text_batches(corpus, _Rows((0, 8), (8, 16)), 16, 16, 0, 0)
  p0, ev0 = batches.text_batches(corpus, _Rows((0, 4), (4, 8)), 16, 16, 0, 1)
  p1, ev1 = batches.text_batches(corpus, _Rows((8, 12), (12, 16)), 16, 16, 0, 1)
  for _ in range(3):
    whole, a, b = next(one), next(p0), next(p1)
    assert a["inputs"].shape == (8, 16) and a["inputs"].dtype == np.int32
    np.testing.assert_array_equal(a["targets"][:, :-1], a["inputs"][:, 1:])  # shifted by one
    rows = lambda x: sorted(map(tuple, x["inputs"]))
    assert not set(rows(a)) & set(rows(b))
    assert sorted(rows(a) + rows(b)) == rows(whole)
  assert not set(map(tuple, ev0[0]["inputs"])) & set(map(tuple, ev1[0]["inputs"]))


def test_rows_that_are_not_one_block_are_refused():
  with pytest.raises(fs.ShardingError, match=r"rows \[0, 1, 4, 5\]... of the global batch of 16:"
                     r" not one contiguous block"):
    batches.process_shard(_Rows((0, 2), (4, 6)), 16)


def test_iterator_position_travels_in_a_checkpoint(tmp_path):
  """The position goes through fnscale.checkpoint (grain's own orbax handler): a fresh
  iterator restored from it reads exactly the batches the saved one would have read next."""
  corpus = _corpus()
  it, _ = batches.text_batches(corpus, _Rows((0, 16)), 16, 16, 7, 0)
  for _ in range(3):
    next(it)
  fs.checkpoint.save(tmp_path, 3, {"x": np.zeros(2, np.float32)}, data=it)
  expected = [next(it)["inputs"] for _ in range(2)]
  again, _ = batches.text_batches(corpus, _Rows((0, 16)), 16, 16, 7, 0)
  target = {"x": jax.ShapeDtypeStruct((2,), np.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
  fs.checkpoint.restore(tmp_path, target, data=again)
  assert again.get_state() == {"next_index": 3}  # three batches read before the save
  for want in expected:
    np.testing.assert_array_equal(next(again)["inputs"], want)


def test_resharded_position_is_the_common_global_batch():
  """Batch k of the 2-process slices covers the windows of batch k of the 1-process order, so
  positions saved by 2 processes at one step are the 1-process position."""
  corpus = _corpus()
  p0, _ = batches.text_batches(corpus, _Rows((0, 8)), 16, 16, 0, 0)  # process 0 of 2: rows 0-7
  p1, _ = batches.text_batches(corpus, _Rows((8, 16)), 16, 16, 0, 0)
  for _ in range(2):
    next(p0), next(p1)
  saved = [p0.get_state(), p1.get_state()]
  one, _ = batches.text_batches(corpus, _Rows((0, 16)), 16, 16, 0, 0)
  one.set_state(batches.resharded_position(saved, 0, 1))
  rows = lambda x: sorted(map(tuple, x["inputs"]))
  assert rows(next(one)) == sorted(rows(next(p0)) + rows(next(p1)))
  with pytest.raises(fs.FnscaleError, match=r"the 2 saved data positions differ .*resume with "
                     r"2 processes"):
    batches.resharded_position([{"next_index": 2}, {"next_index": 3}], 0, 1)


def test_split_holds_out_every_20th_chunk():
  text = bytes(range(100)) * 40  # 4000 bytes: 20 chunks of 200, the last one held out
  train, held = data.split(text)
  assert train == text[:3800] and held == text[3800:]


def test_tiny_corpus_is_a_fixed_offline_selection():
  files = data.corpus_files("tiny_corpus")
  assert len(files) == len(data.TINY_CORPUS)
  text = data.read_bytes("tiny_corpus")
  assert 500_000 < len(text) < 2_000_000


def _bpe(tmp_path, text: str, vocab: int = 320):
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([text], trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return tok, path


def test_tokenizer_json_gives_ids_vocab_and_tokens_per_byte(tmp_path):
  text = data.read_bytes("tiny_corpus")[:200_000]
  (tmp_path / "c.txt").write_bytes(text)
  tok, path = _bpe(tmp_path, text.decode("utf-8", errors="replace"))
  corpus = data.load(str(tmp_path / "c.txt"), str(path))
  assert corpus.vocab == tok.get_vocab_size() > 256
  assert corpus.train.dtype == np.int32 and corpus.train.max() < corpus.vocab
  _, held = data.split(text)
  want = len(tok.encode(held.decode("utf-8", errors="replace")).ids) / len(held)
  assert corpus.tokens_per_byte == pytest.approx(want, rel=0.02) and want < 0.8  # merges
  line = "def f(x):\n    return x + 1\n"
  assert corpus.decode(corpus.encode(line)) == line
  assert corpus.encode(line) == tok.encode(line).ids


def test_token_ids_are_kept_for_the_next_run_and_their_progress_said(tmp_path, monkeypatch):
  # Tokenizing the stdlib corpus took about 90 s in silence on every run: the ids are kept
  # per machine (keyed by the text and the tokenizer), the first run says what it does.
  from recipes.lm import tokens  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  text = data.read_bytes("tiny_corpus")[:100_000]
  (tmp_path / "c.txt").write_bytes(text)
  tok, path = _bpe(tmp_path, text.decode("utf-8", errors="replace"))
  said = []
  first = data.load(str(tmp_path / "c.txt"), str(path), said.append)
  assert said[0].startswith(f"data: tokenizing {tmp_path / 'c.txt'} with {path} (0.1 MB; "
                            f"kept in {tmp_path / 'cache' / 'fnscale' / 'tokens'}")
  # The ids of one encode_batch over every chunk of the split (a run's, before the ids were
  # kept and encoded a few MB at a time).
  train, _ = data.split(text)
  chunks = tokens._text_chunks(train)  # pylint: disable=protected-access
  want = [i for e in tok.encode_batch(chunks) for i in e.ids]
  assert first.train.tolist() == want
  monkeypatch.setattr(tokens, "_encode", lambda *a: pytest.fail("encoded again"))
  said.clear()
  again = data.load(str(tmp_path / "c.txt"), str(path), said.append)
  np.testing.assert_array_equal(again.train, first.train)
  np.testing.assert_array_equal(again.eval, first.eval)
  assert len(said) == 1 and said[0].startswith("data: the token ids of")
  (tmp_path / "d.txt").write_bytes(text[:50_000])  # other text: not the kept ids
  with pytest.raises(pytest.fail.Exception, match="encoded again"):
    data.load(str(tmp_path / "d.txt"), str(path))


def pruned_tokenizer(path, skip=(5, 7), top=299):
  """A word-level tokenizer.json whose vocabulary lost the ids `skip` but kept the others:
  get_vocab_size() is top + 1 - len(skip), the largest id `top`. Text: 'w1 w2 ...'."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models as tok_models, pre_tokenizers
  vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, top + 1) if i not in skip}}
  tok = tokenizers.Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(path))
  return tok


@pytest.mark.parametrize("skip, top", [((5, 7), 299), ((), 40), ((1, 2, 3), 9)])
def test_pruned_tokenizer_vocabulary_covers_its_largest_id(tmp_path, skip, top):
  tok = pruned_tokenizer(tmp_path / "tok.json", skip, top)
  assert tok.get_vocab_size() == top + 1 - len(skip)
  (tmp_path / "c.txt").write_text(" ".join(f"w{i}" for i in range(1, top + 1)) * 40)
  corpus = data.load(str(tmp_path / "c.txt"), str(tmp_path / "tok.json"))
  assert corpus.vocab == top + 1  # the embedding has a row for every id the text can hold
  assert max(corpus.train.max(), corpus.eval.max()) == top
  said = f"vocab {top + 1}: ids up to {top}, though the tokenizer holds {top + 1 - len(skip)}"
  assert (said in corpus.describe) == bool(skip), corpus.describe


@pytest.mark.parametrize("ids, vocab, bad", [
    (np.array([[0, 3], [299, 2]]), 298, 299),  # the pruned vocabulary's case
    ({"inputs": np.array([[1, 2]]), "targets": np.array([[2, 256]])}, 256, 256),
    (np.array([4, -1, 2]), 10, -1),
])
def test_token_ids_outside_the_vocabulary_are_named(ids, vocab, bad):
  with pytest.raises(fs.FnscaleError, match=rf"token id {bad} is outside the model's "
                     rf"vocabulary of {vocab} \(ids 0..{vocab - 1}"):
    data.check_token_ids(ids, vocab)
  data.check_token_ids(ids, 1000) if bad > 0 else None  # in range: no error
  data.check_token_ids({"inputs": np.zeros((2, 3), np.int32)}, 1)


def test_unreadable_tokenizer_is_an_fnscale_error(tmp_path):
  (tmp_path / "c.txt").write_text("hello world\n" * 100)
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(fs.FnscaleError, match=r"tokenizer='.*bad.json' is not a readable "
                     r"tokenizer.json"):
    data.load(str(tmp_path / "c.txt"), str(tmp_path / "bad.json"))


@pytest.mark.parametrize("vocab", [3, 5000])  # a dense pair table, and pairs counted sparsely
def test_baseline_is_the_add_one_unigram_and_bigram_loss_by_hand(vocab):
  # Train 0 0 1 0 1: unigram counts 0:3, 1:2 of 5; pairs (0,0) (0,1) (1,0) (0,1), so after a 0
  # (3 times) a 1 came twice, after a 1 (once) a 0. Held out 0 1 1: pairs (0,1) and (1,1).
  corpus = data.Corpus(np.array([0, 0, 1, 0, 1], np.uint8), np.array([0, 1, 1], np.uint8), vocab,
                       1.0, None, None, "")
  b = data.baseline(corpus)
  p0, p1 = 4 / (5 + vocab), 3 / (5 + vocab)
  assert b.unigram == pytest.approx(-(math.log(p0) + 2 * math.log(p1)) / 3, rel=1e-12)
  assert b.bigram == pytest.approx(
      -(math.log(3 / (3 + vocab)) + math.log(1 / (1 + vocab))) / 2, rel=1e-12)


def test_a_window_longer_than_the_data_names_how_each_kind_was_split():
  """A text corpus holds out every 20th chunk; token caches hold out documents (the message
  spoke of chunks for both)."""
  ids = np.zeros(9, np.int32)
  text = data.Corpus(ids, ids, 256, 1.0, list, bytes, "text")
  with pytest.raises(fs.InputError, match=r"9 held out \(every 20th chunk\)"):
    data.check_fits(text, 16)
  with pytest.raises(fs.InputError, match=r"9 held out \(the caches' held-out documents\)"):
    data.check_fits(text._replace(packed=([], "bytes")), 16)
