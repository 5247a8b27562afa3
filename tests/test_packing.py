"""recipes/lm/packing.py and the models' packed-row paths: rows of packed documents against
each document alone, attention weights across a boundary, rows per process against the whole
batch, resumed positions, mixtures by hand counts, and bad input."""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnscale as fs
from recipes.lm import cache, gpt, llama, options, packing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

SEQ = 32


def _docs(n=40, seed=0):
  """Text documents of 3..70 bytes (some longer than a row of SEQ + 1 tokens)."""
  rng = np.random.default_rng(seed)
  return ["".join(chr(c) for c in rng.integers(97, 123, int(k)))
          for k in rng.integers(3, 71, n)]


def _make_cache(tmp_path, name, docs):
  src = tmp_path / f"{name}.jsonl"
  src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  out = tmp_path / name
  cache.build(cache.BuildSpec((str(src),), str(out), shard_bytes=700), say=lambda *a: None)
  return str(out)


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("packing")
  docs = _docs()
  return _make_cache(tmp, "text", docs), docs


def _batches(path, rows, global_rows=8, spec=packing.PackSpec(SEQ), seed=0):
  sources, _ = packing.open_mixture(path, "")
  return packing.batches(sources, np.asarray(rows), global_rows, spec, seed)


def _segments(batch):
  """(row, segment id, slice) of every segment of a packed batch."""
  out = []
  for r, seg in enumerate(batch["segment_ids"]):
    for s in sorted(set(seg.tolist()) - {0}):
      idx = np.nonzero(seg == s)[0]
      out.append((r, s, slice(idx[0], idx[-1] + 1)))
  return out


def test_rows_are_documents_packed_with_segments_and_positions(text_cache):
  path, docs = text_cache
  batch = next(_batches(path, range(8)))
  assert batch["inputs"].shape == (8, SEQ) and batch["segment_ids"].dtype == np.int32
  pieces = {tuple(d.encode()[a:a + SEQ + 1]) for d in docs for a in range(0, len(d) - 1, SEQ)}
  for r, _, sl in _segments(batch):
    got = batch["inputs"][r, sl].tolist() + [int(batch["targets"][r, sl][-1])]
    assert tuple(got) in pieces  # each segment: a whole document, or a piece of a long one
    np.testing.assert_array_equal(batch["targets"][r, sl][:-1], batch["inputs"][r, sl][1:])
    np.testing.assert_array_equal(batch["positions"][r, sl], np.arange(sl.stop - sl.start))
    assert (batch["weights"][r, sl] == 1).all()
  pad = batch["segment_ids"] == 0
  assert (batch["weights"][pad] == 0).all()
  assert packing.padding_fraction(batch) == pytest.approx(pad.mean())


@pytest.fixture(scope="module")
def packed_batch(text_cache):
  return next(_batches(text_cache[0], range(4), global_rows=4))


@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_packed_loss_is_the_sum_of_each_documents_own_loss(packed_batch, model):
  """float32: the weighted loss sum of a packed batch equals, to 1e-5, the sum over its
  segments of each one's loss computed alone (a batch of one row holding only it, no segment
  ids, positions from 0). Dropping the segment ids or positions changes it (the control)."""
  mod = {"gpt": gpt, "llama": llama}[model]
  size = {"gpt": "nano", "llama": "llama-tiny"}[model]
  cfg = mod.model_config(size, SEQ)._replace(vocab=256)
  if model == "llama":
    cfg = cfg._replace(layers=2, d_model=64, heads=4, kv_heads=2, d_mlp=128)
  # Weights 8x their init scale: attention far from uniform, so the controls below tell.
  params = jax.tree.map(lambda x: 8 * x, mod.init_params(cfg, jax.random.key(1)))
  batch = {k: jnp.asarray(v) for k, v in packed_batch.items()}
  loss = jax.jit(lambda p, b: mod.loss_fn(p, b, weighted=True))
  total, weight = loss(params, batch)
  # Each segment alone at the start of its own row: no segment ids, positions from 0; the
  # zero-weight padding after it can't reach it (causal attention).
  segs = _segments(packed_batch)
  alone = {k: np.zeros((len(segs), SEQ), np.float32 if k == "weights" else np.int32)
           for k in ("inputs", "targets", "weights")}
  for i, (r, _, sl) in enumerate(segs):
    n = sl.stop - sl.start
    for k in alone:
      alone[k][i, :n] = packed_batch[k][r, sl]
  alone_sum, alone_weight = loss(params, alone)
  assert float(weight) == float(alone_weight) == float((packed_batch["segment_ids"] > 0).sum())
  alone = float(alone_sum)
  np.testing.assert_allclose(float(total), alone, rtol=1e-5)
  # RoPE scores depend on position differences only, so within masked segments the
  # positions can't change llama's loss (see the rope test); GPT's learned ones do.
  for drop in ("segment_ids", "positions") if model == "gpt" else ("segment_ids",):
    other, _ = loss(params, {k: v for k, v in batch.items() if k != drop})
    assert abs(float(other) - alone) > 1e-3 * alone, drop


def test_rope_rotates_each_packed_document_from_position_0():
  x = jax.random.normal(jax.random.key(0), (2, 7, 2, 8), jnp.float32)
  positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2]] * 2)
  packed = llama.rope(x, 1e4, positions=positions)
  np.testing.assert_allclose(packed[:, :4], llama.rope(x[:, :4], 1e4), atol=1e-6)
  np.testing.assert_allclose(packed[:, 4:], llama.rope(x[:, 4:], 1e4), atol=1e-6)
  assert float(jnp.abs(llama.rope(x, 1e4)[:, 4:] - packed[:, 4:]).max()) > 0.1


def test_no_token_attends_across_a_document_boundary(packed_batch):
  """The attention weights of `fs.attention(..., segment_ids=...)` on a packed row, read as
  d output_i / d value_j: exactly 0 across segments, and within one equal to a numpy causal
  softmax over that segment alone."""
  seg = jnp.asarray(packed_batch["segment_ids"][:2])
  b, s, h = 2, SEQ, 2
  q, k = jax.random.normal(jax.random.key(0), (2, b, s, h, s), jnp.float32)
  # Values one-hot by key position: output i of a head is that head's weights row i.
  v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, h, s))
  w_all = np.asarray(fs.attention(q, k, v, causal=True, segment_ids=seg))  # [b, q, h, key]
  assert len(set(np.asarray(seg[0]).tolist()) - {0}) > 1  # a boundary inside the row
  for r in range(b):
    ids = np.asarray(seg[r])
    for head in range(h):
      w = w_all[r, :, head]
      logits = np.asarray(q[r, :, head] @ k[r, :, head].T) / np.sqrt(s)
      for i in range(s):
        same = (ids == ids[i]) & (np.arange(s) <= i)
        assert np.all(w[i, ~same] == 0), (r, i)
        p = np.exp(logits[i, same] - logits[i, same].max())
        np.testing.assert_allclose(w[i, same], p / p.sum(), rtol=1e-5, atol=1e-6)


def test_each_processes_rows_are_the_whole_batchs_rows_and_resume_on_any_count(text_cache):
  """Rows 0-3 and 4-7 read apart (two processes' shares) are the 8-row reader's rows, each
  step; positions saved by those two and merged (`resharded_position`) resume one 8-row
  reader on the same rows as the uninterrupted one, and vice versa."""
  path, _ = text_cache
  whole, a, b = _batches(path, range(8)), _batches(path, range(4)), _batches(path, range(4, 8))
  for _ in range(3):
    w, x, y = next(whole), next(a), next(b)
    for key in w:
      np.testing.assert_array_equal(w[key], np.concatenate([x[key], y[key]]))
  merged = packing.resharded_position([a.get_state(), b.get_state()], 0, 1)
  again = _batches(path, range(8))
  again.set_state(merged)
  halves = _batches(path, range(4, 8))
  halves.set_state(packing.resharded_position([whole.get_state()], 1, 2))
  for _ in range(2):
    w, r, y = next(whole), next(again), next(halves)
    np.testing.assert_array_equal(r["inputs"], w["inputs"])
    np.testing.assert_array_equal(y["inputs"], w["inputs"][4:])
  with pytest.raises(fs.InputError, match=r"no rows \[8, 9\].*another global batch"):
    _batches(path, range(8, 10), global_rows=10).set_state(merged)


def test_mixture_draws_documents_in_proportion(tmp_path):
  a = _make_cache(tmp_path, "a", ["a" * 5] * 60)
  b = _make_cache(tmp_path, "b", ["b" * 5] * 60)
  sources, _ = packing.open_mixture(f"{a}:3,{b}:1", "")
  assert [s.weight for s in sources] == [0.75, 0.25]
  first = [chr(d["ids"][0]) for d in packing.documents(sources, 0)[:400]]
  assert first.count("a") == 300  # grain's mix: exactly 3 of every 4
  again = [chr(d["ids"][0]) for d in packing.documents(sources, 0)[:400]]
  assert again == first


@pytest.mark.parametrize("spec, message", [
    ("x:0.5,y:abc", r"the weight of 'y' is not a number >= 0"),
    ("x:0,y:0", r"the weights sum to zero"),
    ("x:-1", r"the weight of 'x' is not a number >= 0"),
    ("x:1,x:2", r"named twice"),
])
def test_bad_weights_are_named(spec, message):
  with pytest.raises(fs.InputError, match=message):
    packing.parse_mixture(spec)


def test_weights_from_a_json_file_and_paths_with_colons(tmp_path):
  f = tmp_path / "mix.json"
  f.write_text('{"web": 0.7, "code": 0.3}')
  assert packing.parse_mixture(str(f)) == [("web", 0.7), ("code", 0.3)]
  assert packing.parse_mixture("gs://b/web:2,c") == [("gs://b/web", 2.0), ("c", 1.0)]


def test_long_documents_split_truncate_or_stop(text_cache):
  path, docs = text_cache
  longest = max(len(d) for d in docs)
  assert longest > SEQ + 1
  trunc = next(_batches(path, range(8), spec=packing.PackSpec(SEQ, long_docs="truncate")))
  starts = {d.encode()[:SEQ + 1] for d in docs}
  for r, _, sl in _segments(trunc):
    assert bytes(trunc["inputs"][r, sl].tolist() + [trunc["targets"][r, sl][-1]]) in starts
  it = _batches(path, range(8), spec=packing.PackSpec(SEQ, long_docs="error"))
  with pytest.raises(fs.InputError, match=r"a document of \d+ tokens is longer than a row "
                     r"\(32 \+ 1 tokens\).*--long_docs=split"):
    for _ in range(4):
      next(it)


def test_best_fit_pads_no_more_than_first_fit(text_cache):
  path, _ = text_cache
  pad = {}
  for how in options.PACKINGS:
    it = _batches(path, range(8), spec=packing.PackSpec(SEQ, packing=how))
    pad[how] = np.mean([packing.padding_fraction(next(it)) for _ in range(6)])
  print(f"padding fraction over 6 batches of 8 x {SEQ}: {pad}")
  assert 0 < pad["best_fit"] <= pad["first_fit"] < 0.5


WORKER = str(pathlib.Path(__file__).resolve().parent / "data_worker.py")


def _job_batches(results):
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  return mp.records(results[0].stdout)


def _assert_rows_equal(got: dict, want: dict):
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_axes", ["data=2,fsdp=4", "fsdp=8", "tensor=8"])
def test_two_processes_read_the_one_process_batches_row_for_row(text_cache, mesh_axes):
  path, _ = text_cache
  results = mp.run([WORKER, f"--cache={path}", f"--mesh={mesh_axes}", "--steps=3"], 2, 4, 300)
  whole = _batches(path, range(8))
  for got in _job_batches(results):
    _assert_rows_equal(got, next(whole))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_process_position_resumes_on_two_and_on_one_process(text_cache, tmp_path):
  path, _ = text_cache
  ckpt = tmp_path / "ckpt"
  mp.run([WORKER, f"--cache={path}", f"--ckpt={ckpt}", "--stop_after=2", "--steps=5"], 2, 4,
         300)
  whole = _batches(path, range(8))
  want = [next(whole) for _ in range(5)][2:]
  again = mp.run([WORKER, f"--cache={path}", f"--ckpt={ckpt}", "--resume", "--steps=5"], 2, 4,
                 300)
  one = mp.run([WORKER, f"--cache={path}", f"--ckpt={ckpt}", "--resume", "--steps=5",
                "--mesh=data=8"], 1, 8, 300)
  for job in (again, one):
    got = _job_batches(job)
    assert [g["step"] for g in got] == [2, 3, 4]
    for g, w in zip(got, want):
      _assert_rows_equal(g, w)
