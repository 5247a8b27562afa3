"""Hugging Face safetensors checkpoints streamed into born-sharded params, and written back.

`load` builds every param leaf where its sharding puts it (`jax.make_array_from_callback`),
reading only the slices of the shards this process holds: a leaf split over 8 devices of 2
processes costs each process half of the leaf's bytes, and host memory holds one leaf's
shards (plus one source tensor's slice in flight), never the model. `export` writes the
params back as safetensors shards with `model.safetensors.index.json`, `config.json` and the
tokenizer's files (what `transformers`' `from_pretrained` reads), one tensor at a time.

A `CheckpointMap` says where each leaf comes from: a `Tensor` per leaf path (fnscale's
'/'-joined spelling, e.g. `blocks/wq`) naming the checkpoint key, with `{layer}` (or any
other field, e.g. `{expert}`) for leaves stacked over leading axes, and the transform from
the checkpoint's layout to the leaf's: `split` of source dims (e.g. q_proj's [heads *
head_dim, d] into [heads, head_dim, d]) then `perm` (a transpose). A leaf's shard index maps
back through them to slices of the source tensors, so only those slices are read. Model
families' maps live with the models (recipes/lm/hf_maps.py).

Paths are local directories or fsspec URLs (`gs://...` with gcsfs installed). Layer:
checkpoint (imports core and multihost only). Needs the `hf` extra (safetensors, fsspec).

Examples:
  A two-layer stack written as Hugging Face tensors and read back, born split over "fsdp":

  >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
  >>> hf = fs.checkpoint.hf
  >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
  >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
  >>> mesh = fs.make_mesh({"fsdp": 2, "data": 4})
  >>> sharding = fs.shardings(params, mesh, rules=[("layers", "fsdp")],
  ...                         logical_axes={"wq": ("layers", None, None)})
  >>> target = {"wq": jax.ShapeDtypeStruct((2, 3, 4), "float32", sharding=sharding["wq"])}
  >>> with tempfile.TemporaryDirectory() as d:
  ...   _ = hf.export(d, params, cmap, config={"model_type": "toy"})
  ...   loaded = hf.load(d, target, cmap)
  >>> bool((loaded["wq"] == params["wq"]).all()), loaded["wq"].sharding.spec
  (True, P('fsdp', None, None))
"""
from __future__ import annotations

import fnmatch
import json
import math
import string
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _tree
from fnscale.checkpoint import _safetensors
from fnscale._errors import CheckpointError, StorageError

__all__ = ["Tensor", "CheckpointMap", "Index", "read_index", "read_config", "check", "load",
           "export", "write_tensors", "write_json", "INDEX_FILE", "TOKENIZER_FILES"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' own default shard size (5 GB)


class Tensor(NamedTuple):
  """Where one param leaf comes from: checkpoint key(s) and the transform to the leaf.

  key: the safetensors key; fields in braces (`model.layers.{layer}.mlp.up_proj.weight`)
    make a stacked leaf whose leading axes are those fields in order of appearance, each
    index one key (`{layer}` then `{expert}`: a leaf [layers, experts, ...]).
  split: per source dim, None (kept) or the sizes it splits into in row-major order
    (`((heads, head_dim), None)`: [heads * head_dim, d] -> [heads, head_dim, d]); empty:
    nothing split.
  perm: the leaf's axes (after the stacked ones) as a permutation of the split axes
    (`np.transpose`'s `axes`); None: unchanged.
  first: per field, the key's index of the leaf's first entry (empty: 0 for each); a
    stack of a model's later layers, e.g. `first=(3,)`: entry 0 is `{layer}` = 3.

  Examples:
    A stacked leaf [layers, heads, head_dim, d] from each layer's q_proj [heads * head_dim, d]:

    >>> import fnscale as fs
    >>> q = fs.checkpoint.hf.Tensor("model.layers.{layer}.self_attn.q_proj.weight",
    ...                             split=((4, 16), None))
    >>> q.fields
    ('layer',)
  """
  key: str
  split: tuple = ()
  perm: tuple[int, ...] | None = None
  first: tuple[int, ...] = ()

  @property
  def fields(self) -> tuple[str, ...]:
    return tuple(f for _, f, _, _ in string.Formatter().parse(self.key) if f)

  def key_at(self, idx: Sequence[int]) -> str:
    """The key of the stacked entry `idx` (one index per field)."""
    first = self.first or (0,) * len(idx)
    return self.key.format(**{f: i + o for f, i, o in zip(self.fields, idx, first)})


class CheckpointMap(NamedTuple):
  """Every param leaf's `Tensor` by leaf path, and the checkpoint keys that are not params
  (`ignore`: fnmatch patterns, e.g. rotary buffers); any other key the map doesn't use is an
  error (its weights would be dropped).

  Examples:
    >>> import fnscale as fs
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"embed": hf.Tensor("model.embed_tokens.weight"),
    ...                          "wq": hf.Tensor("model.layers.{layer}.q.weight", perm=(1, 0))},
    ...                         ignore=("*.rotary_emb.inv_freq",))
    >>> sorted(cmap.tensors), cmap.ignore
    (['embed', 'wq'], ('*.rotary_emb.inv_freq',))
  """
  tensors: Mapping[str, Tensor]
  ignore: tuple[str, ...] = ()


class Index(NamedTuple):
  """A checkpoint directory's tensors (key -> file, dtype, shape, byte range); `nbytes` their
  total size.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = hf.export(d, params, cmap, config={})
    ...   index = hf.read_index(d)
    >>> sorted(index.tensors), index.tensors["layers.0.q.weight"].shape, index.nbytes
    (['layers.0.q.weight', 'layers.1.q.weight'], (4, 3), 96)
  """
  path: str
  tensors: Mapping[str, _safetensors.Entry]

  @property
  def nbytes(self) -> int:
    return sum(e.stop - e.start for e in self.tensors.values())


def _join(path: str, name: str) -> str:
  return path.rstrip("/") + "/" + name


def _exists(path: str) -> bool:
  fs, inner = _safetensors.filesystem(path)
  return fs.exists(inner)


def _is_dir(path: str) -> bool:
  fs, inner = _safetensors.filesystem(path)
  return fs.isdir(inner)


def _read_json(path: str) -> Any:
  fs, inner = _safetensors.filesystem(path)
  try:
    with fs.open(inner, "r") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise StorageError(f"could not read {path}: {e}") from e


def read_config(path) -> dict:
  """The checkpoint's `config.json` as a dict.

  Raises:
    CheckpointError: no config.json in `path`.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = hf.export(d, params, cmap, config={"model_type": "llama", "num_hidden_layers": 2})
    ...   hf.read_config(d)
    {'model_type': 'llama', 'num_hidden_layers': 2}
  """
  path = _text(path)
  if not _exists(_join(path, CONFIG_FILE)):
    raise CheckpointError(f"{path} has no {CONFIG_FILE}; fix: pass a Hugging Face model "
                          "directory (what `save_pretrained` writes).")
  return _read_json(_join(path, CONFIG_FILE))


def _text(path) -> str:
  if not isinstance(path, str) and not hasattr(path, "__fspath__"):
    raise CheckpointError(f"checkpoint path is {_tree.got(path)}, expected a str or "
                          "os.PathLike (a directory or gs://... URL).")
  return str(path)


def read_index(path) -> Index:
  """The tensors of a checkpoint directory: `model.safetensors.index.json`'s files, or the
  single `model.safetensors`; only the headers are read.

  Raises:
    CheckpointError: neither file exists, or the index names a key its file doesn't hold.
    StorageError: a file can't be read.

  Examples:
    Two files of at most 48 bytes, and the index naming them:

    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> with tempfile.TemporaryDirectory() as d:
    ...   files = hf.export(d, params, cmap, config={}, max_shard_bytes=48)
    ...   index = hf.read_index(d)
    >>> hf.INDEX_FILE in files, sorted({e.file.rsplit("/", 1)[1] for e in index.tensors.values()})
    (True, ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
  """
  path = _text(path)
  if _exists(_join(path, INDEX_FILE)):
    weight_map = _read_json(_join(path, INDEX_FILE)).get("weight_map", {})
    files = sorted(set(weight_map.values()))
  elif _exists(_join(path, SINGLE_FILE)):
    weight_map, files = None, [SINGLE_FILE]
  else:
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}; fix: pass "
                          "a directory of Hugging Face safetensors weights (PyTorch .bin "
                          "checkpoints are not read: convert them with transformers first).")
  tensors = {}
  for name in files:
    tensors.update(_safetensors.read_header(_join(path, name)))
  for key, name in (weight_map or {}).items():
    if key not in tensors or not tensors[key].file.endswith("/" + name):
      raise CheckpointError(f"{INDEX_FILE} puts {key!r} in {name}, which doesn't hold it; "
                            "the checkpoint is incomplete or its index stale.")
  return Index(path, tensors)


# ------------------------------------------------------------------------------------------
# The plan: every leaf's sources, checked against the checkpoint before anything is built


class _Leaf(NamedTuple):
  """One target leaf: its path, shape, dtype, sharding and source."""
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  sharding: Any
  src: Tensor
  stack: tuple[int, ...]  # sizes of the stacked leading axes
  source_shape: tuple[int, ...]  # one source tensor's shape


def _split_shape(src: Tensor, source: Sequence[int]) -> tuple[int, ...]:
  """The source shape after `split` (the shape `perm` permutes)."""
  split = src.split or (None,) * len(source)
  out = []
  for d, parts in zip(source, split):
    out.extend([d] if parts is None else parts)
  return tuple(out)


def _keys(src: Tensor, stack: Sequence[int]) -> list[tuple[tuple[int, ...], str]]:
  """(stacked index, key) for every source tensor of a leaf."""
  out = []
  for idx in np.ndindex(*stack):
    out.append((idx, src.key_at(idx)))
  return out


def _body_shape(src: Tensor, source: Sequence[int]) -> tuple[int, ...]:
  """One source tensor's shape after split and perm."""
  shape = _split_shape(src, source)
  perm = src.perm if src.perm is not None else tuple(range(len(shape)))
  return tuple(shape[p] for p in perm)


def _check_transform(path: str, src: Tensor, source: tuple, shape: tuple, first_key: str):
  """Raises CheckpointError unless src's split and perm take `source` to the leaf's body."""
  fix = "fix the map's split/perm for this leaf, or the model config it was made for"
  if src.split and len(src.split) != len(source):
    raise CheckpointError(f"leaf '{path}': split {src.split} has {len(src.split)} entries "
                          f"for {first_key!r} of shape {list(source)}; {fix}.")
  for d, parts in zip(source, src.split or ()):
    if parts is not None and math.prod(parts) != d:
      raise CheckpointError(f"leaf '{path}': {first_key!r} has shape {list(source)}, and "
                            f"{d} can't split into {list(parts)}; {fix}.")
  n = len(_split_shape(src, source))
  if src.perm is not None and sorted(src.perm) != list(range(n)):
    raise CheckpointError(f"leaf '{path}': perm {src.perm} is not a permutation of "
                          f"{n} axes; {fix}.")
  body = _body_shape(src, source)
  if tuple(shape[len(shape) - len(body):]) != body or len(shape) < len(body):
    raise CheckpointError(
        f"leaf '{path}' has shape {list(shape)}; {first_key!r} of shape {list(source)} "
        f"gives {list(body)} per stacked index; {fix} (a config that doesn't match the "
        "weights: check the sizes read from config.json).")


def _plan_leaf(path, leaf, src: Tensor, index: Index) -> _Leaf:
  shape, dtype = _tree.aval(leaf)
  stack = shape[:len(src.fields)]
  if len(stack) != len(src.fields):
    raise CheckpointError(f"leaf '{path}' has {len(shape)} axes, fewer than the key "
                          f"{src.key!r}'s fields {list(src.fields)}; fix the map.")
  keys = _keys(src, stack)
  missing = [k for _, k in keys if k not in index.tensors]
  if missing:
    raise CheckpointError(
        f"the checkpoint in {index.path} has no tensor {missing[0]!r} (for leaf '{path}'"
        f"{f', and {len(missing) - 1} more' if len(missing) > 1 else ''}); fix: check that "
        "config.json describes these weights (layer count, bias, tied embeddings) and that "
        "the model family's map is the right one.")
  source = index.tensors[keys[0][1]].shape
  _check_transform(path, src, source, shape, keys[0][1])
  for _, k in keys:
    e = index.tensors[k]
    if e.shape != source:
      raise CheckpointError(f"{k!r} has shape {list(e.shape)}, unlike {keys[0][1]!r}'s "
                            f"{list(source)}; leaf '{path}' stacks them: fix the map.")
    if e.dtype not in _safetensors.FLOAT_CODES or not jnp.issubdtype(dtype, jnp.floating):
      raise CheckpointError(
          f"{k!r} is {e.dtype} and leaf '{path}' {dtype}: only float tensors (F32, F16, BF16, "
          "F64) load into float leaves; fix: map this key to a float leaf, or ignore it.")
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    raise CheckpointError(
        f"leaf '{path}' has no sharding; fix: pass abstract params with shardings, e.g. "
        "fnscale.init_state(..., abstract=True).params.")
  return _Leaf(path, shape, dtype, sharding, src, stack, source)


def check(path, target, cmap: CheckpointMap) -> list[_Leaf]:
  """Checks that `cmap` takes the checkpoint at `path` to `target`, reading headers only.

  Every target leaf must have a source, every source a target leaf, every key its tensor in
  the checkpoint with a fitting shape and a float dtype, and every checkpoint key be used or
  ignored. Returns the per-leaf plan `load` follows.

  Raises:
    CheckpointError: the first mismatch, naming the leaf path or checkpoint key and the fix.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"wq": jax.ShapeDtypeStruct((2, 3, 4), jnp.float32, sharding=one)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = hf.export(d, params, cmap, config={})
    ...   plan = hf.check(d, target, cmap)
    ...   hf.check(d, target, hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.k.weight")}))
    Traceback (most recent call last):
    ...
    fnscale.CheckpointError: the checkpoint in ... has no tensor 'layers.0.k.weight' (for leaf ...
    >>> len(plan)
    1
  """
  if not isinstance(cmap, CheckpointMap):
    raise CheckpointError(f"cmap is {_tree.got(cmap)}, expected a fnscale.checkpoint.hf."
                          "CheckpointMap.")
  index = path if isinstance(path, Index) else read_index(path)
  leaves = _tree.leaves_with_paths(target)
  paths = [p for p, _ in leaves]
  extra = sorted(set(cmap.tensors) - set(paths))
  if extra:
    raise CheckpointError(f"the map names leaf '{extra[0]}', which the params don't have "
                          f"(they have {paths[:8]}{'...' if len(paths) > 8 else ''}); fix: "
                          "build the params from the same config as the map.")
  unmapped = [p for p in paths if p not in cmap.tensors]
  if unmapped:
    raise CheckpointError(f"param leaf '{unmapped[0]}' has no source in the checkpoint map; "
                          "it would keep its random init. Fix: add it to the map (or build "
                          "the model without it, e.g. tied embeddings).")
  plan = [_plan_leaf(p, leaf, cmap.tensors[p], index) for p, leaf in leaves]
  used = {k for lf in plan for _, k in _keys(lf.src, lf.stack)}
  unused = sorted(k for k in index.tensors if k not in used
                  and not any(fnmatch.fnmatchcase(k, pat) for pat in cmap.ignore))
  if unused:
    raise CheckpointError(
        f"checkpoint tensor {unused[0]!r} (and {len(unused) - 1} more) is not loaded into "
        "any param: its weights would be lost. Fix: check config.json against the weights "
        "(e.g. tie_word_embeddings with an lm_head.weight present, a bias the config leaves "
        "out), or add the key to the map's `ignore` if it is no param.")
  return plan


# ------------------------------------------------------------------------------------------
# Loading


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def _source_reads(lf: _Leaf, body: Sequence[tuple[int, int]]):
  """For a shard's body bounds (the leaf's axes after the stacked ones): the source-tensor
  reads, each (source index, where its data goes in the split layout), and the split-layout
  shape of the shard. Split groups are read by their contiguous runs (`_safetensors.runs`)."""
  src, split_shape = lf.src, _split_shape(lf.src, lf.source_shape)
  perm = src.perm if src.perm is not None else tuple(range(len(split_shape)))
  sb = [None] * len(split_shape)  # bounds in the split layout
  for j, p in enumerate(perm):
    sb[p] = body[j]
  groups, k = [], 0
  for d, parts in zip(lf.source_shape, src.split or (None,) * len(lf.source_shape)):
    sizes = (d,) if parts is None else tuple(parts)
    groups.append((sizes, sb[k:k + len(sizes)]))
    k += len(sizes)
  per_group = [_group_reads(sizes, b) for sizes, b in groups]
  reads = []
  for combo in np.ndindex(*(len(g) for g in per_group)):
    picks = [per_group[i][c] for i, c in enumerate(combo)]
    reads.append((tuple(p[0] for p in picks), sum((p[1] for p in picks), ())))
  return reads, tuple(b - a for a, b in sb)


def _group_reads(sizes, bounds):
  """One source dim split into `sizes`, cut to `bounds` per split axis: [(source slice,
  split-layout position)] with one contiguous source range each."""
  out = []
  for start, stop, pos in _safetensors.runs(sizes, [slice(a, b) for a, b in bounds]):
    k = len(pos)
    inner = math.prod(sizes[k + 1:])
    where = tuple(slice(p, p + 1) for p in pos) + (slice(0, (stop - start) // inner),) + tuple(
        slice(0, s) for s in sizes[k + 1:])
    out.append((slice(start, stop), where))
  return out


def _read_shard(lf: _Leaf, index: Index, read, shard: Sequence[slice]) -> np.ndarray:
  """The leaf's data at `shard` (a device's index), read slice by slice from the sources."""
  bounds = _bounds(shard, lf.shape)
  n = len(lf.stack)
  reads, split_shape = _source_reads(lf, bounds[n:])
  perm = lf.src.perm if lf.src.perm is not None else tuple(range(len(split_shape)))
  out = np.empty(tuple(b - a for a, b in bounds), lf.dtype)
  for pos in np.ndindex(*out.shape[:n]):
    stacked = tuple(bounds[i][0] + p for i, p in enumerate(pos))
    key = lf.src.key_at(stacked)
    entry = index.tensors[key]
    if len(reads) == 1:  # one contiguous read: no staging copy
      part = read(entry, key, reads[0][0]).reshape(split_shape)
    else:
      part = np.empty(split_shape, _safetensors.DTYPES[entry.dtype])
      for source_index, where in reads:
        part[where] = read(entry, key, source_index).reshape(part[where].shape)
    out[pos] = part.transpose(perm)  # cast to the leaf's dtype on assignment
    del part
  return out


def _build(lf: _Leaf, index: Index, read) -> jax.Array:
  """One leaf on its devices: each distinct addressable shard read once."""
  cache = {}

  def shard(idx):
    key = _bounds(idx, lf.shape)
    if key not in cache:
      cache[key] = _read_shard(lf, index, read, idx)
    return cache[key]

  return jax.make_array_from_callback(lf.shape, lf.sharding, shard)


def load(path, target, cmap: CheckpointMap):
  """Params read from the safetensors checkpoint at `path`, born in `target`'s shardings.

  Args:
    path: a Hugging Face model directory (local or `gs://...`) with `model.safetensors` or
      `model.safetensors.index.json` and its files.
    target: a pytree of `jax.ShapeDtypeStruct`s with shardings (e.g.
      `fnscale.init_state(..., abstract=True).params`) or of jax.Arrays: the leaves'
      shapes, dtypes and shardings (float16/bfloat16/float32 sources are cast to them).
    cmap: where each leaf comes from (`CheckpointMap`).

  Returns:
    `target`'s structure of jax.Arrays, each built by `jax.make_array_from_callback` from
    the slices of this process's shards only. Every process of a job calls it.

  Raises:
    CheckpointError: a missing or unused key, a shape or dtype that doesn't fit, a leaf
      without a source or sharding (everything checked from the headers before any array is
      built; `check`).
    StorageError: a file can't be read.

  Examples:
    Saved in float32, loaded as bfloat16 (the target's dtype):

    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"wq": jax.ShapeDtypeStruct((2, 3, 4), jnp.bfloat16, sharding=one)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...   _ = hf.export(d, params, cmap, config={})
    ...   loaded = hf.load(d, target, cmap)
    >>> loaded["wq"].dtype, bool((loaded["wq"] == params["wq"]).all())
    (dtype(bfloat16), True)
  """
  index = read_index(path)
  plan = check(index, target, cmap)
  with _safetensors.reader() as read:
    leaves = [_build(lf, index, read) for lf in plan]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)


# ------------------------------------------------------------------------------------------
# Exporting


def _piece_reader(leaf: jax.Array, n: int, held: dict):
  """pos -> the leaf's [pos] (pos over its first n axes) on host, whole.

  A leaf this process holds entirely is copied to the host shard by shard once (`held`
  keeps the last such leaf only: host memory holds one leaf) and cut there; one spread over
  processes is gathered one stacked index at a time onto every device (a jitted index with a
  replicated output) and read from this process's copy."""
  if leaf.is_fully_addressable:
    def host(pos):
      if held.get("leaf") is not leaf:
        held.clear()
        shards = {}
        for s in leaf.addressable_shards:
          shards.setdefault(_bounds(s.index, leaf.shape), s)
        held.update(leaf=leaf, shards={b: np.asarray(s.data) for b, s in shards.items()})
      out = np.empty(leaf.shape[n:], leaf.dtype)
      for b, data in held["shards"].items():
        if all(a <= p < e for p, (a, e) in zip(pos, b[:n])):
          local = tuple(p - a for p, (a, _) in zip(pos, b[:n]))
          out[tuple(slice(a, e) for a, e in b[n:])] = data[local]
      return out
    return host
  replicated = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
  take = jax.jit(lambda x, i: x[tuple(i)] if n else x, out_shardings=replicated)
  return lambda pos: np.asarray(take(leaf, np.asarray(pos, np.int32)).addressable_data(0))


def _export_plan(params, cmap: CheckpointMap, dtype):
  """[(Planned tensor, leaf path, stacked index)] in leaf order, and path -> leaf."""
  flat = dict(_tree.leaves_with_paths(params))
  unmapped = [p for p in flat if p not in cmap.tensors]
  if unmapped:
    raise CheckpointError(f"param leaf '{unmapped[0]}' has no key in the checkpoint map; it "
                          "would be left out of the export. Fix: add it to the map.")
  out = []
  for p, leaf in flat.items():
    src = cmap.tensors[p]
    n = len(src.fields)
    body = leaf.shape[n:]
    perm = src.perm if src.perm is not None else tuple(range(len(body)))
    split_shape = [0] * len(body)
    for j, q in enumerate(perm):
      split_shape[q] = body[j]
    source = _merge_split(split_shape, src.split)
    code = _safetensors.CODES[np.dtype(dtype or leaf.dtype)]
    for idx, key in _keys(src, leaf.shape[:n]):
      out.append((_safetensors.Planned(key, code, source), p, idx))
  return out, flat


def _merge_split(split_shape: Sequence[int], split) -> tuple[int, ...]:
  """The source shape whose `split` gives `split_shape` (the inverse of `_split_shape`)."""
  out, k = [], 0
  for parts in split or (None,) * len(split_shape):
    width = 1 if parts is None else len(parts)
    out.append(math.prod(split_shape[k:k + width]))
    k += width
  return tuple(out)


def _shards(plan, max_bytes: int) -> list[list]:
  """Consecutive tensors grouped into files of at most `max_bytes` (a bigger tensor alone)."""
  files, size = [[]], 0
  for item in plan:
    nbytes = item[0].nbytes
    if files[-1] and size + nbytes > max_bytes:
      files.append([])
      size = 0
    files[-1].append(item)
    size += nbytes
  return files


def export(path, params, cmap: CheckpointMap, *, config: Mapping, tokenizer_from=None,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype=None) -> list[str]:
  """Writes `params` as a Hugging Face checkpoint: safetensors shards, the index, config.json
  and the tokenizer's files, readable by `transformers`' `from_pretrained`.

  Every process calls it (a leaf spread over processes is gathered one stacked index at a
  time); process 0 writes. Host memory holds one leaf (a leaf this process holds whole) or one
  checkpoint tensor (a leaf spread over processes) at a time; no device ever holds the whole
  model.

  Args:
    path: output directory (local or `gs://...`), created if missing.
    params: the params pytree (jax.Arrays), leaves as `cmap` names them.
    cmap: the same map `load` reads with (its transform is inverted).
    config: the `config.json` contents (e.g. the family's `hf_config(cfg)`).
    tokenizer_from: a directory whose tokenizer files (`TOKENIZER_FILES`) are copied; a
      tokenizer file, written as tokenizer.json (named tokenizer.json: with the files beside
      it); or None.
    max_shard_bytes: the largest file (a bigger single tensor gets a file of its own).
    dtype: the written dtype (e.g. "bfloat16"); default each leaf's own.

  Returns:
    The files written (names in `path`).

  Raises:
    CheckpointError: a leaf without a key in `cmap`, a bad max_shard_bytes.
    StorageError: a file can't be written.

  Examples:
    The tokenizer's files (`TOKENIZER_FILES`) come from `tokenizer_from` when given (a
    tokenizer.json without a tokenizer_config.json gets one naming transformers'
    PreTrainedTokenizerFast, so AutoTokenizer reads that file whatever the model):

    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> "tokenizer.json" in hf.TOKENIZER_FILES
    True
    >>> with tempfile.TemporaryDirectory() as d:
    ...   sorted(hf.export(d, params, cmap, config={"model_type": "toy"}))
    ['config.json', 'model.safetensors']
  """
  path = _text(path)
  _tree.check_int(max_shard_bytes, "max_shard_bytes", CheckpointError, minimum=1)
  names, files = write_tensors(path, params, cmap, dtype=dtype,
                               max_shard_bytes=max_shard_bytes)
  if jax.process_index() == 0:
    _write_side_files(path, names, files, config, tokenizer_from)
  return names + [CONFIG_FILE] + ([INDEX_FILE] if len(names) > 1 else [])


def write_tensors(path, params, cmap: CheckpointMap, *, dtype=None, name: str | None = None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
  """Writes `params`' tensors as `cmap` names them into safetensors files in `path`: one
  file `name`, or `model.safetensors` / `model-0000i-of-0000n.safetensors` of at most
  `max_shard_bytes` each. Process 0 creates `path` and writes; every process takes part in
  the gathers of leaves spread over processes. Returns (file names, the tensors planned in
  each file).

  Raises:
    CheckpointError: a leaf without a key in `cmap`.
    StorageError: a file can't be written.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q.weight", perm=(1, 0))})
    >>> params = {"wq": jnp.arange(24.0).reshape(2, 3, 4)}  # [layer, d, d_q]; HF's [d_q, d]
    >>> with tempfile.TemporaryDirectory() as d:
    ...   names, files = hf.write_tensors(d, params, cmap)
    >>> names, [t.key for t, *_ in files[0]]
    (['model.safetensors'], ['layers.0.q.weight', 'layers.1.q.weight'])
  """
  path = _text(path)
  plan, flat = _export_plan(params, cmap, dtype)
  files = [plan] if name else _shards(plan, max_shard_bytes)
  names = [name] if name else (
      [SINGLE_FILE] if len(files) == 1 else
      [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
  writer = jax.process_index() == 0
  fs, inner = _safetensors.filesystem(path)
  if writer:
    fs.makedirs(inner, exist_ok=True)
  held = {}  # the host copy of one fully addressable leaf at a time
  readers = {p: _piece_reader(leaf, len(cmap.tensors[p].fields), held)
             for p, leaf in flat.items()}
  for name, items in zip(names, files):
    by_key = {t.key: (p, idx) for t, p, idx in items}

    def produce(t, by_key=by_key):
      p, idx = by_key[t.key]
      return _to_source(readers[p](idx), cmap.tensors[p], t)

    if writer:
      _safetensors.write_file(_join(path, name), [t for t, _, _ in items], produce,
                              {"format": "pt"})
    else:  # the other processes take part in the gathers of leaves spread over processes
      for t, p, idx in items:
        if not flat[p].is_fully_addressable:
          readers[p](idx)
  return names, files


def _to_source(piece: np.ndarray, src: Tensor, t: _safetensors.Planned) -> np.ndarray:
  """A leaf's piece (its axes after the stacked ones) in the checkpoint's layout and dtype."""
  perm = src.perm if src.perm is not None else tuple(range(piece.ndim))
  return piece.transpose(np.argsort(perm)).reshape(t.shape).astype(_safetensors.DTYPES[t.dtype])


def _write_side_files(path, names, files, config, tokenizer_from) -> None:
  fs, inner = _safetensors.filesystem(path)
  if len(names) > 1:
    total = sum(t.nbytes for items in files for t, _, _ in items)
    weight_map = {t.key: name for name, items in zip(names, files) for t, _, _ in items}
    write_json(_join(path, INDEX_FILE), {"metadata": {"total_size": total},
                                          "weight_map": weight_map})
  write_json(_join(path, CONFIG_FILE), dict(config))
  if tokenizer_from is None:
    return
  src = _text(tokenizer_from)
  copies = {name: _join(src, name) for name in TOKENIZER_FILES}
  if not _is_dir(src):  # a tokenizer's own file, whatever its name
    beside = src.rsplit("/", 1)[0] if src.endswith("/tokenizer.json") else None
    copies = {n: _join(beside, n) for n in TOKENIZER_FILES} if beside else {}
    copies["tokenizer.json"] = src
  copies = {name: c for name, c in copies.items() if _exists(c)}
  for name, c in copies.items():
    sfs, sinner = _safetensors.filesystem(c)
    with sfs.open(sinner, "rb") as f, fs.open(_join(inner, name), "wb") as g:
      g.write(f.read())
  # A tokenizer.json alone: transformers would pick the model type's own tokenizer class
  # for it (Gemma's needs an <unk> a trained tokenizer may lack); say it is that file.
  if "tokenizer.json" in copies and "tokenizer_config.json" not in copies:
    write_json(_join(path, "tokenizer_config.json"),
               {"tokenizer_class": "PreTrainedTokenizerFast"})


def write_json(path: str, value) -> None:
  """Writes `value` as indented JSON at `path` (local or fsspec URL); StorageError if not.

  Examples:
    >>> import fnscale as fs, json, os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...   fs.checkpoint.hf.write_json(os.path.join(d, "config.json"), {"b": 2, "a": 1})
    ...   with open(os.path.join(d, "config.json")) as f:
    ...     print(f.read())
    {
      "a": 1,
      "b": 2
    }
  """
  fs, inner = _safetensors.filesystem(path)
  try:
    with fs.open(inner, "w") as f:
      json.dump(value, f, indent=2, sort_keys=True)
  except OSError as e:
    raise StorageError(f"could not write {path}: {e}") from e

