"""LoRA as pure functions over any params pytree: low-rank adapters trained beside a frozen base.

Hu et al. (2021), "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685): a
frozen matmul weight W is used as W + (alpha / rank) A B, where A maps W's inputs to `rank`
dims and B maps those to W's outputs. Only A and B are trained: A starts uniform in
+-1/sqrt(fan_in) (PyTorch's `nn.Linear` default, as Hugging Face's peft does), B at zero, so
training starts from the base model exactly.

The pieces, each a function of values:

  config = fs.lora.LoraConfig(rank=16, alpha=32, targets=("blocks/w_(up|down)",))
  state = fs.lora.init_state(base, config, optax.adamw(1e-4), key=key)  # placed base
  step = fs.shard_step(fs.train_step(fs.lora.with_lora(loss_fn, config), opt), mesh)
  merged = fs.lora.merge(state.frozen, state.params, config)   # W + scale A B, to export

The split between trained and frozen is the state's: `TrainState.params` holds the adapters
(the optimizer's state and the gradients are theirs alone) and `TrainState.frozen` the base,
which `train_step` hands the loss undifferentiated; `with_lora` puts them back together.
Adapters are placed by the base leaf's own sharding: A takes the PartitionSpec entries of
W's stacked and input dims, B those of its stacked and output dims, the rank dim is
replicated (tensor parallelism over W's outputs splits B as it splits W, so the low-rank
path needs no collective of its own), and an FSDP-like axis (data or context) that splits W
but neither of those dims goes on the adapter's largest dim it divides: each adapter and
its optimizer state is split as many ways as W is.

Which leaves and how: `LoraConfig.targets` holds regexes matched in full against each leaf's
'/'-joined path (`blocks/wq`), each with a layout, one letter per dim of the leaf: `l` a
stacked dim (the layer axis a model scans over; one adapter per index, and they lead), `i`
an input dim (contracted with the activations), `o` an output dim. A 2-D leaf defaults to
"io" (x @ W), a 3-D one to "lio" (stacked); others need theirs: a [layers, d, heads,
head_dim] query weight is "lioo", PyTorch/Equinox's [out, in] is "oi". A: [*l, *i, rank],
B: [*l, rank, *o], dims in W's order.

Two ways to compute with the adapters. `merge` gives the base's tree with W + scale A B in
place of each target: any model function, any framework (Flax, Equinox: their params tree);
its backward pass computes the full-size gradient of the merged weight (6 N FLOPs per token
for N adapted weights, as full fine-tuning). `bind` gives the tree with `LoraWeight` values
in place of the targets, for models that multiply by their weights through `fs.lora.einsum`
(a drop-in `jnp.einsum`): x W + scale (x A) B, whose backward never forms W's gradient (4 N
FLOPs for the frozen matmuls: forward and input gradient), and LoRA dropout on x. A
`LoraWeight` reaching any other jnp function raises `LoraError` naming the fix.

Examples:
  Rank-2 adapters on a 16 x 8 weight: 48 trained values instead of 128, and a model that
  starts as the base (B is zero):

  >>> import fnscale as fs, jax, jax.numpy as jnp
  >>> base = {"w": jnp.ones((16, 8))}
  >>> config = fs.lora.LoraConfig(rank=2, alpha=4.0, targets=("w",))
  >>> adapters = fs.lora.init(base, config, jax.random.key(0))
  >>> sum(x.size for x in jax.tree.leaves(adapters)), config.scale
  (48, 2.0)
  >>> bool((fs.lora.merge(base, adapters, config)["w"] == base["w"]).all())
  True
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
import inspect
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from fnscale import _axes
from fnscale import _tree
from fnscale import _state
from fnscale._errors import LoraError, did_you_mean
from fnscale._step import TrainState, as_policy, check_optimizer, default_loss_scale

__all__ = ["LoraConfig", "LoraWeight", "Target", "targets", "init", "shardings",
           "init_state", "bind", "merge", "einsum", "with_lora"]

_LAYOUT = re.compile(r"l*[io]+")


class LoraConfig(NamedTuple):
  """What to adapt and how.

  Fields:
    rank: r, the adapters' inner width (int >= 1).
    alpha: the scale's numerator: adapters add (alpha / rank) A B (Hu et al. 2021, 4.1;
      peft's `lora_alpha`). A float > 0.
    dropout: the probability of zeroing an input of A (LoRA dropout; `einsum` with a key),
      in [0, 1).
    targets: regexes over leaf paths (`re.fullmatch`), each a str (layout by rank: 2-D
      "io", 3-D "lio") or a (regex, layout) pair; the first that matches a leaf gives its
      layout. Every regex must match some leaf.
  `scale` is alpha / rank.

  Examples:
    >>> import fnscale as fs
    >>> config = fs.lora.LoraConfig(rank=8, alpha=16.0, targets=("blocks/w(q|v)",))
    >>> config.scale, config.dropout
    (2.0, 0.0)
  """
  rank: int = 16
  alpha: float = 32.0
  dropout: float = 0.0
  targets: tuple = ()

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


class Target(NamedTuple):
  """One adapted leaf: its path, layout ('l', 'i', 'o' per dim), shape and dtype;
  `adapter_shapes(rank)` gives A's and B's.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> (t,) = fs.lora.targets({"wq": jnp.zeros((2, 8, 4))}, fs.lora.LoraConfig(targets=("wq",)))
    >>> t.path, t.layout, t.adapter_shapes(rank=2)  # a stacked weight: one adapter per layer
    ('wq', 'lio', ((2, 8, 2), (2, 2, 4)))
  """
  path: str
  layout: str
  shape: tuple[int, ...]
  dtype: np.dtype

  def dims(self, role: str) -> tuple[int, ...]:
    return tuple(d for d, c in zip(self.shape, self.layout) if c == role)

  def adapter_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A's shape [*l, *i, rank], B's shape [*l, rank, *o])."""
    stacked = self.dims("l")
    return stacked + self.dims("i") + (rank,), stacked + (rank,) + self.dims("o")


def _check_config(config) -> tuple[tuple[str, str | None], ...]:
  """The config's targets as (regex, layout or None) pairs, after checking every field."""
  if not isinstance(config, LoraConfig):
    raise LoraError(f"config is {_tree.got(config)}, expected a fnscale.lora.LoraConfig.")
  _tree.check_int(config.rank, "LoraConfig.rank", LoraError, minimum=1)
  for name, v, ok in (("alpha", config.alpha, lambda v: v > 0),
                      ("dropout", config.dropout, lambda v: 0 <= v < 1)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
      want = "a float > 0" if name == "alpha" else "a float in [0, 1)"
      raise LoraError(f"LoraConfig.{name}={v!r}, expected {want}.")
  items = (config.targets,) if isinstance(config.targets, str) else tuple(config.targets)
  if not items:
    raise LoraError("LoraConfig.targets is empty; fix: name the weights to adapt, e.g. "
                    "targets=('blocks/w(q|v)',) (regexes over '/'-joined leaf paths).")
  pairs = []
  for item in items:
    pattern, layout = (item, None) if isinstance(item, str) else (tuple(item) + (None,))[:2]
    if not isinstance(pattern, str) or not (layout is None or isinstance(layout, str)) or (
        not isinstance(item, str) and len(item) != 2):
      raise LoraError(f"LoraConfig.targets holds {_tree.got(item)}; expected a regex str or "
                      "a (regex, layout) pair such as ('blocks/wq', 'lioo').")
    try:
      re.compile(pattern)
    except re.error as e:
      raise LoraError(f"LoraConfig.targets: {pattern!r} is not a regex ({e}).") from None
    pairs.append((pattern, layout))
  return tuple(pairs)


def _layout(path: str, shape, dtype, layout: str | None, pattern: str) -> str:
  """The leaf's layout, checked: given, or by rank for 2-D and 3-D leaves."""
  fix = (f"give its layout, e.g. targets=(({pattern!r}, '{'l' * max(0, len(shape) - 2)}io'),)"
         " ('l' stacked dims first, then 'i' input and 'o' output dims in the leaf's order),"
         " or a regex that leaves it out")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise LoraError(f"leaf '{path}' ({np.dtype(dtype).name}{list(shape)}) matched "
                    f"{pattern!r}, but LoRA adapts float matmul weights only; fix: a regex "
                    "that leaves it out.")
  if layout is None:
    if len(shape) not in (2, 3):
      raise LoraError(f"leaf '{path}' has shape {list(shape)}: LoRA infers the layout of 2-D "
                      f"(x @ W) and stacked 3-D weights only; fix: {fix}.")
    layout = "io" if len(shape) == 2 else "lio"
  if len(layout) != len(shape) or not _LAYOUT.fullmatch(layout) or not (
      "i" in layout and "o" in layout):
    raise LoraError(f"leaf '{path}' has shape {list(shape)} but layout {layout!r}; a layout "
                    f"has one letter per dim, stacked 'l's first, at least one 'i' and one "
                    f"'o'; fix: {fix}.")
  return layout


def targets(base, config: LoraConfig) -> tuple[Target, ...]:
  """The leaves of `base` that `config` adapts, in flattening order.

  Args:
    base: any pytree of arrays or `jax.ShapeDtypeStruct`s (plain dicts, a Flax params dict,
      Equinox's `eqx.partition(model, eqx.is_inexact_array)[0]`).
    config: a `LoraConfig`.

  Returns:
    A tuple of `Target(path, layout, shape, dtype)`.

  Raises:
    LoraError: a bad config; a regex that matches no leaf (naming the leaves there are and
      the closest); a matched leaf that is not float or whose layout doesn't fit its shape
      (naming the leaf and the fix).

  Examples:
    >>> import jax.numpy as jnp
    >>> import fnscale as fs
    >>> base = {"w1": jnp.zeros((16, 64)), "b1": jnp.zeros(64),
    ...         "blocks": {"wq": jnp.zeros((2, 16, 4, 8))}}
    >>> cfg = fs.lora.LoraConfig(rank=4, targets=("w1", ("blocks/wq", "lioo")))
    >>> [(t.path, t.layout, t.adapter_shapes(4)) for t in fs.lora.targets(base, cfg)]
    [('blocks/wq', 'lioo', ((2, 16, 4), (2, 4, 4, 8))), ('w1', 'io', ((16, 4), (4, 64)))]
  """
  pairs = _check_config(config)
  leaves = _tree.leaves_with_paths(base)
  used, out = set(), []
  for path, leaf in leaves:
    for pattern, layout in pairs:
      if re.fullmatch(pattern, path):
        used.add(pattern)
        shape, dtype = _tree.aval(leaf)
        out.append(Target(path, _layout(path, shape, dtype, layout, pattern), shape, dtype))
        break
  for pattern, _ in pairs:
    if pattern not in used:
      paths = [p for p, _ in leaves]
      shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
      raise LoraError(f"LoRA target {pattern!r} matches no leaf of the params (paths: "
                      f"{shown}){did_you_mean(pattern, paths)}; fix: a regex matching whole "
                      "'/'-joined leaf paths.")
  return tuple(out)


def _nest(pairs) -> dict:
  """{'a/b': v, ...} -> {'a': {'b': v}}: adapters keyed like the base's leaf paths."""
  out: dict = {}
  for path, value in pairs:
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = value
  return out


def _pick(tree, path: str):
  for p in path.split("/"):
    if not isinstance(tree, Mapping) or p not in tree:
      return None
    tree = tree[p]
  return tree


def _init_adapters(key, ts: tuple[Target, ...], rank: int, dtype) -> dict:
  pairs = []
  for i, t in enumerate(ts):
    a_shape, b_shape = t.adapter_shapes(rank)
    bound = 1.0 / math.sqrt(math.prod(t.dims("i")))
    a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
    pairs.append((t.path, {"a": a.astype(dtype), "b": jnp.zeros(b_shape, dtype)}))
  return _nest(pairs)


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (ndim - len(spec))


def _adapter_specs(t: Target, spec: tuple, mesh, rank: int):
  """A's and B's PartitionSpecs from W's: stacked and input entries for A, stacked and
  output entries for B, the rank dim replicated; then the FSDP-like axes (data and context
  axes) that split W but neither adapter's dims so far go on its largest free dim that
  they divide, so each adapter and its optimizer state is split as many ways as W."""
  by = {r: tuple(e for e, c in zip(spec, t.layout) if c == r) for r in "lio"}
  storage = set(_axes.data_axes(mesh)) | set(_axes.context_axes(mesh))
  split = [a for e in spec for a in _tree.entry_axes(e) if a in storage]
  out = []
  for entries, shape, r_dim in ((by["l"] + by["i"] + (None,), t.adapter_shapes(rank)[0], -1),
                                (by["l"] + (None,) + by["o"], t.adapter_shapes(rank)[1],
                                 len(by["l"]))):
    entries = list(entries)
    used = {a for e in entries for a in _tree.entry_axes(e)}
    missing = tuple(a for a in split if a not in used)
    ways = math.prod(mesh.shape[a] for a in missing)
    free = [j for j in range(len(shape)) if entries[j] is None and j != r_dim % len(shape)
            and shape[j] % ways == 0]
    if missing and free:
      entries[max(free, key=lambda j: shape[j])] = _tree.spec_entry(missing)
    out.append(PartitionSpec(*entries))
  return tuple(out)


def _base_mesh(base):
  """The one mesh the base's leaves are placed on (NamedShardings), or None if none is."""
  meshes = {s.mesh for s in (getattr(x, "sharding", None) for x in jax.tree.leaves(base))
            if isinstance(s, NamedSharding)}
  if len(meshes) > 1:
    raise LoraError("the base's leaves are placed on different meshes; fix: place every "
                    "leaf on one mesh (fs.init_state, fnscale.checkpoint.hf.load).")
  return next(iter(meshes), None)


def shardings(base, config: LoraConfig) -> dict:
  """The adapters' NamedShardings, from the base leaves' own (see the module docstring).

  Args:
    base: the base params, placed: jax.Arrays or ShapeDtypeStructs with NamedShardings on
      one mesh.
    config: a `LoraConfig`.

  Returns:
    A tree like `init`'s: {..path..: {"a": NamedSharding, "b": NamedSharding}}.

  Raises:
    LoraError: from `targets`; a base leaf that is not placed on a mesh.

  Examples:
    W [embed, mlp] split over fsdp x tensor: A [embed, rank] takes W's input split, B
    [rank, mlp] its output split.

    >>> import fnscale as fs, jax, numpy as np
    >>> mesh = fs.make_mesh({"fsdp": 4, "tensor": 2})
    >>> w = jax.device_put(np.ones((64, 16), np.float32),
    ...                    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor")))
    >>> s = fs.lora.shardings({"w": w}, fs.lora.LoraConfig(rank=4, targets=("w",)))["w"]
    >>> s["a"].spec, s["b"].spec
    (P('fsdp', None), P(None, 'tensor'))
  """
  ts = targets(base, config)
  mesh = _base_mesh(base)
  flat = dict(_tree.leaves_with_paths(base))
  pairs = []
  for t in ts:
    s = getattr(flat[t.path], "sharding", None)
    if mesh is None or not isinstance(s, NamedSharding):
      raise LoraError(f"base leaf '{t.path}' has no NamedSharding; fix: place the base on a "
                      "mesh first (fs.init_state(...).params, fnscale.checkpoint.hf.load).")
    a, b = _adapter_specs(t, _spec(s, len(t.shape)), mesh, config.rank)
    pairs.append((t.path, {"a": NamedSharding(mesh, a), "b": NamedSharding(mesh, b)}))
  return _nest(pairs)


def init(base, config: LoraConfig, key, *, dtype=jnp.float32) -> dict:
  """New adapters for `base`: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (fan_in: the product of
  W's input dims), B = 0, so that `merge` gives the base back exactly.

  Args:
    base: the base params (arrays or ShapeDtypeStructs; only shapes are read). Where its
      leaves are placed on a mesh, the adapters are born in `shardings(base, config)`.
    config: a `LoraConfig`.
    key: a `jax.random.key`.
    dtype: the adapters' dtype (default float32).

  Returns:
    A nested dict keyed by the targets' path components, {"a": A, "b": B} at each:
    A [*stacked, *inputs, rank], B [*stacked, rank, *outputs] (dims in W's order).

  Raises:
    LoraError: from `targets`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> cfg = fs.lora.LoraConfig(rank=2, alpha=4.0, targets=("w",))
    >>> adapters = fs.lora.init({"w": jnp.zeros((8, 3))}, cfg, jax.random.key(0))
    >>> adapters["w"]["a"].shape, adapters["w"]["b"].shape, float(abs(adapters["w"]["b"]).max())
    ((8, 2), (2, 3), 0.0)
  """
  ts = targets(base, config)
  make = functools.partial(_init_adapters, ts=ts, rank=config.rank, dtype=dtype)
  if _base_mesh(base) is None:
    return jax.jit(make)(key)
  return jax.jit(make, out_shardings=shardings(base, config))(key)


def check_adapters(ts: tuple[Target, ...], adapters, rank: int) -> None:
  """Raises LoraError unless `adapters` holds A and B of the right shapes for every target
  of `ts` (`targets(...)`) at `rank`, and nothing else."""
  want = {}
  for t in ts:
    a, b = t.adapter_shapes(rank)
    want[f"{t.path}/a"], want[f"{t.path}/b"] = a, b
  got = {p: _tree.aval(x)[0] for p, x in _tree.leaves_with_paths(adapters)}
  for p in sorted(set(want) | set(got)):
    if want.get(p) != got.get(p):
      raise LoraError(
          f"adapter leaf '{p}': the base and config call for "
          f"{list(want[p]) if p in want else 'no such leaf'}, the adapters hold "
          f"{list(got[p]) if p in got else 'none'}; fix: adapters made by fs.lora.init for "
          "this base and config (the same targets and rank).")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "a", "b", "key"],
                   meta_fields=["layout", "scale", "dropout"])
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """A frozen weight with its adapters, as `bind` puts it in the params for `einsum`.

  A pytree (w, a, b and the dropout key are its leaves, so `lax.scan` over a stacked tree
  slices them together); `shape`, `dtype` and `ndim` are W's. Fields: `w` the frozen
  weight, `a` [*l, *i, rank], `b` [*l, rank, *o], `key` (a dropout key per stacked index,
  shape [*l], or None: no dropout), static `layout` (as written for the whole stacked leaf),
  `scale` (alpha / rank) and `dropout`.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> config = fs.lora.LoraConfig(rank=2, alpha=2.0, targets=("w",))
    >>> adapters = {"w": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}}
    >>> weight = fs.lora.bind({"w": jnp.zeros((4, 3))}, adapters, config)["w"]
    >>> type(weight).__name__, weight.shape, weight.layout, weight.scale
    ('LoraWeight', (4, 3), 'io', 1.0)
    >>> jnp.sum(weight)
    Traceback (most recent call last):
    ...
    fnscale.LoraError: a LoRA-adapted weight (shape [4, 3]) reached a jnp function as an ...
  """
  w: Any
  a: Any
  b: Any
  key: Any = None
  layout: str = "io"
  scale: float = 1.0
  dropout: float = 0.0

  @property
  def shape(self):
    return self.w.shape

  @property
  def dtype(self):
    return self.w.dtype

  @property
  def ndim(self) -> int:
    return self.w.ndim

  def roles(self) -> str:
    """The layout of `w` as it is now: stacked dims dropped (sliced by a scan) or added
    (a pipeline's stage split) at the front."""
    extra = self.w.ndim - len(self.layout)
    return "l" * extra + self.layout if extra >= 0 else self.layout[-extra:]

  def __jax_array__(self):
    raise LoraError(
        f"a LoRA-adapted weight (shape {list(self.shape)}) reached a jnp function as an "
        "array; fix: multiply by it with fs.lora.einsum (x W + scale (x A) B), or build the "
        "params with fs.lora.merge (W + scale A B; with_lora(..., merged=True)).")


def bind(base, adapters, config: LoraConfig, key=None):
  """The base's tree with a `LoraWeight` in place of each target, for `einsum`.

  Args:
    base: the base params (arrays, possibly cast to a compute dtype).
    adapters: `init`'s tree (trained).
    config: the `LoraConfig` they were made with.
    key: a `jax.random.key` for LoRA dropout (split per target and stacked index), or None:
      no dropout (evaluation).

  Returns:
    The base's structure, each target leaf replaced by a `LoraWeight`.

  Raises:
    LoraError: from `targets`; adapters that don't fit the base and config.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> config = fs.lora.LoraConfig(rank=2, targets=("w",))
    >>> adapters = {"w": {"a": jnp.ones((4, 2)), "b": jnp.zeros((2, 3))}}
    >>> bound = fs.lora.bind({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}, adapters, config)
    >>> type(bound["w"]).__name__, type(bound["b"]).__name__  # untargeted leaves unchanged
    ('LoraWeight', 'ArrayImpl')
  """
  ts = targets(base, config)
  check_adapters(ts, adapters, config.rank)
  by_path = {t.path: (i, t) for i, t in enumerate(ts)}

  def leaf(path, w):
    p = _tree.path_str(path)
    if p not in by_path:
      return w
    i, t = by_path[p]
    ad = _pick(adapters, p)
    k = None
    if key is not None and config.dropout > 0:
      k = jax.random.split(jax.random.fold_in(key, i), t.dims("l") or ()).reshape(t.dims("l"))
    return LoraWeight(w, ad["a"], ad["b"], k, t.layout, config.scale, float(config.dropout))
  return jax.tree_util.tree_map_with_path(leaf, base)


def _delta(t: Target, a, b, scale: float):
  """scale A B in W's layout (float32)."""
  letters = "abcdefghjkmnpqrstuvwxyz"[:len(t.layout)]
  role = dict(zip(letters, t.layout))
  pick = lambda r: "".join(c for c in letters if role[c] == r)
  spec = f"{pick('l')}{pick('i')}z,{pick('l')}z{pick('o')}->{letters}"
  return scale * jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)


def merge(base, adapters, config: LoraConfig):
  """The base's tree with W + scale A B (computed in float32, cast to W's dtype) in place of
  each target: the adapted model as plain params, for any model function or an export.

  Args, Raises: as `bind` (no key: merged weights have no dropout).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> cfg = fs.lora.LoraConfig(rank=1, alpha=2.0, targets=("w",))
    >>> base = {"w": jnp.zeros((2, 3)), "b": jnp.ones(3)}
    >>> adapters = {"w": {"a": jnp.array([[1.0], [2.0]]), "b": jnp.array([[1.0, 0.0, 3.0]])}}
    >>> fs.lora.merge(base, adapters, cfg)["w"]  # 0 + (2 / 1) A B
    Array([[ 2.,  0.,  6.],
           [ 4.,  0., 12.]], dtype=float32)
  """
  ts = targets(base, config)
  check_adapters(ts, adapters, config.rank)
  by_path = {t.path: t for t in ts}

  def leaf(path, w):
    t = by_path.get(_tree.path_str(path))
    if t is None:
      return w
    ad = _pick(adapters, t.path)
    return (w.astype(jnp.float32) + _delta(t, ad["a"], ad["b"], config.scale)).astype(w.dtype)
  return jax.tree_util.tree_map_with_path(leaf, base)


def _roles(subscripts: str, w: LoraWeight) -> tuple[str, str, str, str, str]:
  """(x's, W's and the output's subscripts, W's stacked+input letters, W's output letters)
  of a two-operand einsum, checked against the weight's layout."""
  text = subscripts.replace(" ", "")
  if "->" not in text or "." in text or text.count(",") != 1:
    raise LoraError(f"fs.lora.einsum({subscripts!r}, ...) with a LoRA weight needs two "
                    "operands, an explicit '->' and no ellipsis, e.g. 'bsd,dhk->bshk'.")
  ins, out = text.split("->")
  xs, ws = ins.split(",")
  roles = w.roles()
  if len(ws) != len(roles):
    raise LoraError(f"fs.lora.einsum({subscripts!r}): the weight has {len(roles)} dims "
                    f"(shape {list(w.shape)}), the subscripts give it {len(ws)}.")
  role = dict(zip(ws, roles))
  for c in ws:
    fits = {"l": c in xs and c in out, "i": c in xs and c not in out,
            "o": c not in xs and c in out}[role[c]]
    if not fits:
      raise LoraError(
          f"fs.lora.einsum({subscripts!r}): the weight's dim {c!r} is "
          f"{ {'l': 'stacked', 'i': 'an input', 'o': 'an output'}[role[c]] } by its layout "
          f"{w.layout!r}, which the subscripts don't compute; fix: the target's layout in "
          "LoraConfig.targets ('l' kept, 'i' contracted with x, 'o' produced).")
  pick = lambda r: "".join(c for c in ws if role[c] == r)
  return xs, ws, out, pick("l") + pick("i"), pick("o")


def _dropout(x, w: LoraWeight):
  if w.key is None or w.dropout == 0:
    return x
  key = w.key if w.key.ndim == 0 else w.key.reshape(-1)[0]
  keep = jax.random.bernoulli(key, 1.0 - w.dropout, x.shape)
  return jnp.where(keep, x / (1.0 - w.dropout), 0).astype(x.dtype)


def einsum(subscripts: str, x, w, **kwargs):
  """`jnp.einsum(subscripts, x, w)`, and for a `LoraWeight` w: x W + scale ((drop(x) A) B).

  Args:
    subscripts: a two-operand einsum with '->' ("bsd,dhk->bshk"); for a LoraWeight, W's
      input dims must be contracted with x, its output dims produced and stacked dims kept,
      as its layout says.
    x: the activations.
    w: an array or a `LoraWeight` (from `bind`).
    **kwargs: passed to every `jnp.einsum` (precision, preferred_element_type).

  Returns:
    The product, in x W's dtype. The low-rank path costs 2 rank (|x| / |i| + |out| / |o|)
    multiply-adds: small beside x W's.

  Raises:
    LoraError: subscripts that don't fit the weight's layout.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import fnscale as fs
    >>> cfg = fs.lora.LoraConfig(rank=2, targets=("w",))
    >>> base = {"w": jax.random.normal(jax.random.key(0), (4, 3))}
    >>> ad = {"w": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}}
    >>> x = jnp.ones((5, 4))
    >>> y = fs.lora.einsum("bd,df->bf", x, fs.lora.bind(base, ad, cfg)["w"])
    >>> bool(jnp.allclose(y, x @ fs.lora.merge(base, ad, cfg)["w"], atol=1e-5))
    True
  """
  if not isinstance(w, LoraWeight):
    return jnp.einsum(subscripts, x, w, **kwargs)
  xs, ws, out, a_letters, o_letters = _roles(subscripts, w)
  r = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA"
           if c not in xs + ws + out)
  mid = "".join(c for c in out if c not in o_letters) + r
  stacked = "".join(c for c in a_letters if c in out)
  y = jnp.einsum(subscripts, x, w.w, **kwargs)
  h = jnp.einsum(f"{xs},{a_letters}{r}->{mid}", _dropout(x, w), w.a, **kwargs)
  low = jnp.einsum(f"{mid},{stacked}{r}{o_letters}->{out}", h, w.b, **kwargs)
  return y + (w.scale * low).astype(y.dtype)


def with_lora(loss_fn: Callable, config: LoraConfig, *, merged: bool = False) -> Callable:
  """`loss_fn(params, batch)` as the loss of a state whose params are the adapters and whose
  frozen params are the base (`init_state`): `lora_loss(adapters, batch, key=None, *,
  frozen)`, the signature `fnscale.train_step` calls it with.

  Args:
    loss_fn: the model's loss over its own params.
    config: the `LoraConfig`.
    merged: give the model `merge(frozen, adapters)` (any model); default `bind(frozen,
      adapters, key)`, for models that multiply through `fs.lora.einsum`.

  Returns:
    `lora_loss`. With `config.dropout > 0` it needs a key (`train_step(..., key=...)`).
    Keywords after `frozen` go to `loss_fn`; its signature names those `loss_fn` takes
    with defaults (e.g. `remat`, for `fnscale.analysis.plan`).

  Raises:
    LoraError: a bad config; dropout with `merged` (dropout acts on a weight's inputs, which
      a merged weight never sees apart); when traced, dropout without a key.

  Examples:
    Any loss over the merged weight; at init (B = 0) it is the base model's loss:

    >>> import fnscale as fs, inspect, jax, jax.numpy as jnp
    >>> loss = lambda params, x: jnp.mean((x @ params["w"]) ** 2)
    >>> base, x = {"w": jnp.ones((4, 3))}, jnp.ones((2, 4))
    >>> config = fs.lora.LoraConfig(rank=2, targets=("w",))
    >>> lora_loss = fs.lora.with_lora(loss, config, merged=True)
    >>> adapters = fs.lora.init(base, config, jax.random.key(0))
    >>> float(lora_loss(adapters, x, frozen=base)), float(loss(base, x))
    (16.0, 16.0)
    >>> str(inspect.signature(lora_loss))  # as train_step calls a state with frozen params
    '(adapters, batch, key=None, *, frozen)'
  """
  _check_config(config)
  if not callable(loss_fn):
    raise LoraError(f"loss_fn is {_tree.got(loss_fn)}, expected a callable.")
  if merged and config.dropout > 0:
    raise LoraError(f"LoraConfig.dropout={config.dropout} with merged=True: dropout acts on "
                    "a weight's inputs, which the merged weight never sees apart; fix: "
                    "dropout=0, or the factored form (merged=False, the model multiplying "
                    "through fs.lora.einsum).")

  def lora_loss(adapters, batch, key=None, *, frozen, **kwargs):
    if merged:
      return loss_fn(merge(frozen, adapters, config), batch, **kwargs)
    if config.dropout > 0 and key is None:
      raise LoraError(f"LoraConfig.dropout={config.dropout} needs a key; fix: "
                      "fs.train_step(..., key=jax.random.key(seed)), or dropout=0.")
    return loss_fn(bind(frozen, adapters, config, key), batch, **kwargs)
  lora_loss.__signature__ = _signature(loss_fn)
  return lora_loss


def _signature(loss_fn) -> inspect.Signature:
  """lora_loss's signature: (adapters, batch, key=None, *, frozen) and the keywords with
  defaults that `loss_fn` takes after its two arguments (e.g. remat, which
  `fnscale.analysis.plan` then chooses)."""
  p = inspect.Parameter
  try:
    extra = [q.replace(kind=p.KEYWORD_ONLY)
             for q in list(inspect.signature(loss_fn).parameters.values())[2:]
             if q.default is not p.empty and q.kind != p.VAR_KEYWORD]
  except (TypeError, ValueError):
    extra = []
  return inspect.Signature(
      [p("adapters", p.POSITIONAL_OR_KEYWORD), p("batch", p.POSITIONAL_OR_KEYWORD),
       p("key", p.POSITIONAL_OR_KEYWORD, default=None), p("frozen", p.KEYWORD_ONLY)]
      + [q for q in extra if q.name not in ("key", "frozen")])


def init_state(base, config: LoraConfig, optimizer, *, key, policy=None, base_dtype=None,
               abstract: bool = False) -> TrainState:
  """A `TrainState` for LoRA training: params the new adapters (`init`), placed by the
  base's shardings, the optimizer's state theirs alone, and `frozen` the base.

  Args:
    base: the base params placed on a mesh (jax.Arrays or, with `abstract`,
      ShapeDtypeStructs with NamedShardings), e.g. `fnscale.checkpoint.hf.load`'s. Copied
      into the state (fresh buffers, cast to `base_dtype`): a step that donates the state
      never deletes the caller's arrays; drop them to free their memory.
    config: a `LoraConfig`.
    optimizer: an `optax.GradientTransformation` (over the adapters).
    key: a `jax.random.key` for A's initial values.
    policy: a jmp policy (or string): adapters in its param dtype; float16 compute adds
      jmp's dynamic loss scale, as `fnscale.init_state` does.
    base_dtype: the frozen base's stored dtype (e.g. jnp.bfloat16: half of float32's
      bytes; it carries no gradient or optimizer state); None keeps each leaf's.
    abstract: ShapeDtypeStructs instead of arrays (nothing allocated).

  Returns:
    TrainState(params=adapters, opt_state, step=int32 0, loss_scale, frozen=base).

  Raises:
    LoraError: from `targets`; a base not placed on one mesh.
    StepError: a bad optimizer or policy.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 8})
    >>> base = fs.init_state({"w": jnp.ones((1024, 64))}, optax.sgd(0.1), mesh=mesh).params
    >>> cfg = fs.lora.LoraConfig(rank=4, targets=("w",))
    >>> state = fs.lora.init_state(base, cfg, optax.adam(1e-3), key=jax.random.key(0),
    ...                            base_dtype=jnp.bfloat16)
    >>> state.frozen["w"].dtype, state.frozen["w"].sharding.spec
    (dtype(bfloat16), P('fsdp', None))
    >>> state.params["w"]["a"].sharding.spec, state.opt_state[0].mu["w"]["b"].shape
    (P('fsdp', None), (4, 64))
  """
  check_optimizer(optimizer)
  policy = as_policy(policy)
  mesh = _base_mesh(base)
  if mesh is None:
    raise LoraError("the base is not placed on a mesh (no leaf has a NamedSharding); fix: "
                    "place it first (fs.init_state(...).params, fnscale.checkpoint.hf.load).")
  ash = shardings(base, config)
  cast = policy.cast_to_param if policy is not None else (lambda t: t)
  make = lambda k: cast(_init_adapters(k, targets(base, config), config.rank, jnp.float32))
  fsh = _state.frozen_shardings(base, mesh)
  store = lambda t: jax.tree.map(
      lambda x: jnp.array(x, dtype=base_dtype or x.dtype, copy=True), t)
  shapes = jax.eval_shape(make, key)
  osh = _state.opt_state_shardings(optimizer, jax.eval_shape(optimizer.init, shapes), ash,
                                   mesh)
  step, ls = jnp.zeros((), jnp.int32), default_loss_scale(policy, None)
  rep = NamedSharding(mesh, PartitionSpec())
  if abstract:
    sds = lambda t, sh: _tree.abstract(t, _tree.leaf_shardings(t, sh, "state", LoraError))
    return TrainState(sds(shapes, ash), sds(jax.eval_shape(optimizer.init, shapes), osh),
                      sds(step, rep), sds(jax.eval_shape(lambda t: t, ls), rep),
                      sds(jax.eval_shape(store, base), fsh))
  adapters = jax.jit(make, out_shardings=ash)(key)
  opt_state = jax.jit(lambda p: jax.tree.map(jnp.copy, optimizer.init(p)),
                      out_shardings=osh)(adapters)
  return TrainState(adapters, opt_state, jax.device_put(step, rep),
                    None if ls is None else jax.device_put(ls, rep),
                    jax.jit(store, out_shardings=fsh)(base))

