"""fnscale.checkpoint.hf on safetensors files written by the safetensors library itself (no
PyTorch): values against numpy, bytes read and host memory per leaf, remote paths, experts,
export's files, and every bad input named before any array is built."""
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnscale as fs
from fnscale.checkpoint import hf

pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
from safetensors.numpy import load_file, save_file  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hf_worker as w  # noqa: E402  pylint: disable=wrong-import-position
import multiprocess as mp  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf_ckpt")
  size = w.write(str(d))
  return d, size


@pytest.fixture(scope="module")
def mesh():
  return fs.make_mesh({"fsdp": 4, "tensor": 2})


def _check_values(params):
  want = w.expected()
  for name, leaf in params.items():
    np.testing.assert_array_equal(np.asarray(leaf), want[name], err_msg=name)
    assert leaf.dtype == jnp.float32


def test_loads_sliced_and_stacked_leaves_into_their_shardings(ckpt, mesh):
  # Per-layer [f, d] tensors stacked and transposed into [layers, d, f], q rows split into
  # heads, bf16/f16 cast to float32; every device's shard as its sharding says.
  tree = w.target(mesh)
  params = hf.load(ckpt[0], tree, w.cmap(hf))
  _check_values(params)
  for name, leaf in params.items():
    assert leaf.sharding == tree[name].sharding, name


def test_reads_each_element_once_and_holds_one_leaf_at_a_time(ckpt):
  # 8 devices, FSDP: every element of the checkpoint is read once (the replicated norm too,
  # though 8 devices hold it), and while a leaf is built the host holds at most 2 x that
  # leaf's bytes above what it held before (a loader that read the whole model, or whole
  # files, first would hold the model: 3.7 x the largest leaf here). Measured in a fresh
  # process: tracemalloc counts every thread's allocations, and threads other tests leave
  # running (writers, prefetchers) would be counted as the loader's.
  results = mp.run(["tests/hf_worker.py", f"--ckpt={ckpt[0]}"],
                   num_processes=1, devices_per_process=8, timeout_s=120)
  assert results[0].returncode == 0, mp.describe(results)
  m = mp.records(results[0].stdout)[-1]
  assert m["bytes_read"] == m["addressable"] == ckpt[1], m
  assert 0 < m["leaf_peak"] <= 2 * m["largest_leaf"], m


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_each_read_their_own_shards(ckpt, tmp_path):
  # 2 processes x 4 devices, FSDP over all 8: each reads its half of the sharded leaves and
  # all of the replicated one, never more; peak host memory per leaf as above; the export
  # from both processes (one leaf spread over them gathered at a time) writes the values.
  out = tmp_path / "export"
  results = mp.run(["tests/hf_worker.py", f"--ckpt={ckpt[0]}", f"--export={out}"],
                   num_processes=2, devices_per_process=4, timeout_s=240)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  for r in results:
    m = mp.records(r.stdout)[-1]
    assert m["bytes_read"] == m["addressable"] < ckpt[1], m
    assert 0 < m["leaf_peak"] <= 2 * m["largest_leaf"], m
  _check_export(out, w.tensors())


def _check_export(directory, want: dict):
  index = json.loads((directory / hf.INDEX_FILE).read_text())
  got = {}
  for name in sorted(set(index["weight_map"].values())):
    got.update(load_file(str(directory / name)))
  assert set(got) == set(want)
  for k, v in want.items():  # float32 params written back in float32
    np.testing.assert_array_equal(got[k], v.astype(np.float32), err_msg=k)


def test_export_writes_shards_an_index_and_the_config(ckpt, mesh, tmp_path):
  # What the safetensors library reads back: every tensor in its checkpoint layout, files
  # of at most max_shard_bytes (a bigger tensor alone), an index naming each key's file.
  params = hf.load(ckpt[0], w.target(mesh), w.cmap(hf))
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.json").write_text("{}")
  files = hf.export(tmp_path / "out", params, w.cmap(hf), config={"model_type": "x"},
                    tokenizer_from=tmp_path / "tok", max_shard_bytes=40_000)
  out = tmp_path / "out"
  _check_export(out, w.tensors())
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 2
  for f in shards:
    size = os.path.getsize(out / f)
    assert size <= 40_000 + 2048 or len(load_file(str(out / f))) == 1, f
  assert json.loads((out / "config.json").read_text()) == {"model_type": "x"}
  assert (out / "tokenizer.json").read_text() == "{}"
  # A tokenizer's own file is the one written, whatever its name and whatever lies beside it
  # (a run's --tokenizer=tok/my_bpe.json); one named tokenizer.json brings its neighbours.
  (tmp_path / "tok" / "my_bpe.json").write_text('{"mine": 1}')
  (tmp_path / "tok" / "special_tokens_map.json").write_text('{"eos_token": "x"}')
  for src, want in (("my_bpe.json", '{"mine": 1}'), ("tokenizer.json", "{}")):
    out = tmp_path / f"out-{src}"
    hf.export(out, params, w.cmap(hf), config={}, tokenizer_from=tmp_path / "tok" / src)
    assert (out / "tokenizer.json").read_text() == want
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast"}
    assert (out / "special_tokens_map.json").exists() == (src == "tokenizer.json")
  # bfloat16 on request: the float32 params rounded.
  hf.export(tmp_path / "bf16", params, w.cmap(hf), config={}, dtype="bfloat16")
  one = load_file(str(tmp_path / "bf16" / "model.safetensors"))
  assert one["emb.weight"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(one["emb.weight"],
                                w.tensors()["emb.weight"].astype(ml_dtypes.bfloat16))


def test_a_remote_filesystem_reads_the_same_values(ckpt, mesh):
  # gs:// goes through fsspec by byte ranges; its in-memory filesystem stands in for it.
  fsspec = pytest.importorskip("fsspec")
  memory = fsspec.filesystem("memory")
  for f in os.listdir(ckpt[0]):
    memory.put(str(ckpt[0] / f), f"/hf-remote/{f}")
  try:
    _check_values(hf.load("memory://hf-remote", w.target(mesh), w.cmap(hf)))
    hf.export("memory://hf-out", hf.load(ckpt[0], w.target(mesh), w.cmap(hf)), w.cmap(hf),
              config={})
    assert memory.exists("/hf-out/model.safetensors")
    _check_values(hf.load("memory://hf-out", w.target(mesh), w.cmap(hf)))
  finally:
    memory.rm("/hf-remote", recursive=True)
    memory.rm("/hf-out", recursive=True)


def test_experts_stack_over_two_fields(tmp_path):
  # The map's format for mixture-of-experts weights: one key per (layer, expert), a leaf
  # [layers, experts, d, f] split over experts.
  rng = np.random.default_rng(1)
  t = {f"l.{l}.e.{e}.w1.weight": rng.normal(size=(6, 4)).astype(np.float32)
       for l in range(2) for e in range(4)}
  save_file(t, str(tmp_path / "model.safetensors"))
  mesh = fs.make_mesh({"expert": 4, "data": 2})
  tree = {"w1": jax.ShapeDtypeStruct((2, 4, 4, 6), jnp.float32,
                                     sharding=NamedSharding(mesh, P(None, "expert")))}
  cmap = hf.CheckpointMap({"w1": hf.Tensor("l.{layer}.e.{expert}.w1.weight", perm=(1, 0))})
  got = hf.load(tmp_path, tree, cmap)["w1"]
  want = np.stack([np.stack([t[f"l.{l}.e.{e}.w1.weight"].T for e in range(4)])
                   for l in range(2)])
  np.testing.assert_array_equal(np.asarray(got), want)


def test_bfloat16_and_float16_leaves_load_rounded_as_numpy_rounds(tmp_path):
  # bfloat16 is not a numpy floating type (np.issubdtype says no): a check that asked numpy
  # refused every bfloat16 target leaf as "not a float leaf".
  rng = np.random.default_rng(2)
  t = {"w": rng.normal(size=(8, 6)).astype(np.float32),
       "v": rng.normal(size=(8, 6)).astype(ml_dtypes.bfloat16)}
  save_file(t, str(tmp_path / "model.safetensors"))
  mesh = fs.make_mesh({"fsdp": 8})
  for dtype in (jnp.bfloat16, jnp.float16):
    tree = {k: jax.ShapeDtypeStruct((8, 6), dtype, sharding=NamedSharding(mesh, P("fsdp")))
            for k in t}
    got = hf.load(tmp_path, tree, hf.CheckpointMap({k: hf.Tensor(k) for k in t}))
    for k, v in t.items():
      assert got[k].dtype == dtype
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v).astype(dtype), err_msg=k)


def test_reads_within_split_axes_touch_only_their_runs():
  # A split dim cut inside: [3 x heads x dim] rows with heads split over 2 devices reads 3
  # runs per device (not the whole rows); an axis cut inside its inner part reads one run
  # per outer index.
  from fnscale.checkpoint import _safetensors as st
  assert st.runs((3, 4, 2), [slice(0, 3), slice(2, 4), slice(0, 2)]) == [
      (4, 8, (0,)), (12, 16, (1,)), (20, 24, (2,))]
  assert st.runs((4, 2), [slice(1, 3), slice(1, 2)]) == [(3, 4, (0,)), (5, 6, (1,))]
  assert st.runs((5,), [slice(None)]) == [(0, 5, ())]


# ------------------------------------------------------------------------------------------
# Bad input: an fnscale error naming the key or leaf, before any array is built


@pytest.fixture
def no_arrays(monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("an array was built before the checkpoint was checked")
  monkeypatch.setattr(jax, "make_array_from_callback", refuse)


def _copy_without(src, dst, drop=(), add=None):
  t = w.tensors()
  for k in drop:
    del t[k]
  t.update(add or {})
  save_file(t, str(dst / "model.safetensors"))
  return dst


@pytest.mark.parametrize("case,pattern", [
    ("missing", r"no tensor 'layers.2.up.weight' \(for leaf 'up'"),
    ("unused", r"'layers.9.extra.weight' \(and 0 more\) is not loaded"),
    ("shape", r"leaf 'up' has shape \[4, 64, 96\]; 'layers.0.up.weight' of shape \[96, 65\]"),
    ("stacked_shape", r"'layers.3.up.weight' has shape \[96, 32\], unlike"),
    ("dtype", r"'layers.0.up.bias' is I64 and leaf 'up_bias' float32"),
])
def test_bad_checkpoints_are_named(ckpt, mesh, tmp_path, no_arrays, case, pattern):
  del no_arrays
  bad = {"missing": dict(drop=["layers.2.up.weight"]),
         "unused": dict(add={"layers.9.extra.weight": np.zeros(3, np.float32)}),
         "shape": dict(add={f"layers.{l}.up.weight": np.zeros((F, 65), np.float32)
                            for l in range(w.L)}),
         "stacked_shape": dict(add={"layers.3.up.weight": np.zeros((F, 32), np.float32)}),
         "dtype": dict(add={"layers.0.up.bias": np.zeros(F, np.int64)})}[case]
  path = _copy_without(ckpt[0], tmp_path, **bad)
  with pytest.raises(fs.CheckpointError, match=pattern):
    hf.load(path, w.target(mesh), w.cmap(hf))


F = w.F


def test_bad_maps_and_targets_are_named(ckpt, mesh, no_arrays):
  del no_arrays
  tree, cmap = w.target(mesh), w.cmap(hf)
  with pytest.raises(fs.CheckpointError, match="param leaf 'wq' has no source"):
    hf.load(ckpt[0], tree, cmap._replace(tensors={k: v for k, v in cmap.tensors.items()
                                                   if k != "wq"}))
  with pytest.raises(fs.CheckpointError, match="names leaf 'extra'"):
    hf.load(ckpt[0], tree, cmap._replace(tensors={**cmap.tensors, "extra": hf.Tensor("x")}))
  wrong = {**cmap.tensors, "wq": hf.Tensor("layers.{layer}.q.weight", split=((H3 := 3, 11),
                                                                             None))}
  with pytest.raises(fs.CheckpointError, match=f"32 can't split into \\[{H3}, 11\\]"):
    hf.load(ckpt[0], tree, cmap._replace(tensors=wrong))
  with pytest.raises(fs.CheckpointError, match="leaf 'embed' has no sharding"):
    hf.load(ckpt[0], {**tree, "embed": np.zeros((w.V, w.D), np.float32)}, cmap)
  with pytest.raises(fs.CheckpointError, match="holds neither"):
    hf.load(ckpt[0] / "nowhere", tree, cmap)
  with pytest.raises(fs.CheckpointError, match="max_shard_bytes=0"):
    hf.export(ckpt[0] / "x", {}, cmap, config={}, max_shard_bytes=0)


def test_an_exported_tokenizer_json_alone_is_read_by_autotokenizer_whatever_the_model(
    tmp_path):
  """A tokenizer trained here (tokenizers' BPE, no <unk>) exported beside a Gemma config:
  without a tokenizer_config.json transformers picks GemmaTokenizer, which fails on the
  first text; the export names the fast tokenizer of the file, which encodes as the file does."""
  transformers = pytest.importorskip("transformers", reason="transformers: the hf-test extra")
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
  tok.train_from_iterator(["def f(x):\n  return x + 1\n"] * 50,
                          tokenizers.trainers.BpeTrainer(vocab_size=300, show_progress=False))
  (tmp_path / "tok").mkdir()
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))
  cmap = hf.CheckpointMap({"w": hf.Tensor("w")})
  hf.export(tmp_path / "out", {"w": jnp.ones((2, 2), jnp.float32)}, cmap,
            config={"model_type": "gemma3_text"}, tokenizer_from=tmp_path / "tok")
  back = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  text = "def g(y):\n  return y\n"
  assert back(text)["input_ids"] == tok.encode(text).ids
