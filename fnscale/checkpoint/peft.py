"""LoRA adapters written as a Hugging Face PEFT adapter: `adapter_config.json` and
`adapter_model.safetensors`, which peft's `PeftModel.from_pretrained(model, path)` loads onto
the transformers model of the base checkpoint.

peft's LoRA layer adds `lora_B(lora_A(dropout(x))) * lora_alpha / r` to a `torch.nn.Linear`
whose weight is [out_features, in_features]; its `lora_A.weight` is [r, in_features] and
`lora_B.weight` [out_features, r], saved under the module's name with the prefix
`base_model.model.`. fnscale's A [*l, *i, r] and B [*l, r, *o] are the same maps written in
the base leaf's layout, so each target's checkpoint tensors follow from the base leaf's own
`hf.Tensor` (the one `hf.load` read it with): its key names the Linear, its split and perm
say which of the leaf's dims make the Linear's input and output features, in which order.
The files are written as `hf.export` writes (one tensor in host memory at a time; every
process of a job calls it, process 0 writes). Needs the `hf` extra.

Examples:
  Adapters on a stack of q projections, written where peft looks for them:

  >>> import fnscale as fs, jax, jax.numpy as jnp, json, os, tempfile
  >>> hf = fs.checkpoint.hf
  >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q_proj.weight", perm=(1, 0))})
  >>> base = {"wq": jnp.zeros((2, 8, 4))}  # [layer, d, d_q]; HF's q_proj [d_q, d]
  >>> config = fs.lora.LoraConfig(rank=2, alpha=4.0, targets=("wq",))
  >>> adapters = fs.lora.init(base, config, jax.random.key(0))
  >>> with tempfile.TemporaryDirectory() as d:
  ...   files = fs.checkpoint.peft.export(d, adapters, config, base, cmap)
  ...   with open(os.path.join(d, fs.checkpoint.peft.CONFIG_FILE)) as f:
  ...     written = json.load(f)
  >>> files == [fs.checkpoint.peft.WEIGHTS_FILE, fs.checkpoint.peft.CONFIG_FILE]
  True
  >>> print(written["r"], written["lora_alpha"], written["target_modules"])
  2 4.0 ^(layers\\.\\d+\\.q_proj)$
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import jax

from fnscale import lora as _lora
from fnscale.checkpoint import hf as _hf
from fnscale._errors import CheckpointError

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "adapter_map", "export"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's name for the wrapped transformers model


def _groups(src: _hf.Tensor, t: _lora.Target) -> tuple[int, tuple, tuple]:
  """(size of the output group in the split layout, the source split of the output and
  input features), after checking that W is a Linear's [out, in] weight whose input
  features are the leaf's 'i' dims and output features its 'o' dims."""
  split = src.split or (None, None)
  stacked = t.layout.count("l")
  perm = src.perm if src.perm is not None else tuple(range(len(t.layout) - stacked))
  out_n = 1 if split[0] is None else len(split[0])
  body = t.layout[stacked:]
  fits = (len(src.fields) == stacked and len(split) == 2 and src.key.endswith(".weight")
          and all((perm[j] < out_n) == (c == "o") for j, c in enumerate(body)))
  if not fits:
    raise CheckpointError(
        f"LoRA target '{t.path}' (layout {t.layout!r}) is read from {src.key!r} (split "
        f"{src.split}, perm {src.perm}), which is not a Linear's [out, in] '.weight' whose "
        "input features are the leaf's 'i' dims and output features its 'o' dims (stacked "
        "dims one per key field); peft adapts Linear layers only. Fix: target that weight "
        "with the layout its map implies, or leave it out of the export.")
  return out_n, split[0], split[1]


def adapter_map(targets, cmap: _hf.CheckpointMap) -> _hf.CheckpointMap:
  """The checkpoint map of the adapters: leaf `PATH/a` from `...lora_A.weight` and `PATH/b`
  from `...lora_B.weight` of the base leaf PATH's Linear, in peft's layout.

  Args:
    targets: `fnscale.lora.targets(base, config)`.
    cmap: the base params' `hf.CheckpointMap`.

  Raises:
    CheckpointError: a target without a key in `cmap`, or whose key is not a Linear's
      [out, in] weight with the target's input and output dims (named, with the fix).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"wq": hf.Tensor("layers.{layer}.q_proj.weight", perm=(1, 0))})
    >>> targets = fs.lora.targets({"wq": jnp.zeros((2, 8, 4))}, fs.lora.LoraConfig(targets=("wq",)))
    >>> amap = fs.checkpoint.peft.adapter_map(targets, cmap)
    >>> print(amap.tensors["wq/a"].key, amap.tensors["wq/b"].key, sep="\\n")
    base_model.model.layers.{layer}.q_proj.lora_A.weight
    base_model.model.layers.{layer}.q_proj.lora_B.weight
  """
  out = {}
  for t in targets:
    src = cmap.tensors.get(t.path)
    if src is None:
      raise CheckpointError(f"LoRA target '{t.path}' has no key in the checkpoint map; fix: "
                            "the map of the model the adapters were trained on.")
    out_n, out_split, in_split = _groups(src, t)
    stacked = t.layout.count("l")
    perm = src.perm if src.perm is not None else tuple(range(len(t.layout) - stacked))
    body = list(enumerate(t.layout[stacked:]))
    module = PREFIX + src.key[:-len(".weight")]
    # A [*l, *i, r] from lora_A.weight [r, in]: split layout (r, *in axes).
    a_perm = tuple(1 + perm[j] - out_n for j, c in body if c == "i") + (0,)
    # B [*l, r, *o] from lora_B.weight [out, r]: split layout (*out axes, r).
    b_perm = (out_n,) + tuple(perm[j] for j, c in body if c == "o")
    out[f"{t.path}/a"] = _hf.Tensor(module + ".lora_A.weight", (None, in_split), a_perm)
    out[f"{t.path}/b"] = _hf.Tensor(module + ".lora_B.weight", (out_split, None), b_perm)
  return _hf.CheckpointMap(out)


def _modules_regex(amap: _hf.CheckpointMap) -> str:
  """A regex (peft's `target_modules` as a str, matched in full) of exactly the adapted
  modules' names, stacked fields as digits."""
  names = sorted({t.key[len(PREFIX):-len(".lora_A.weight")] for t in amap.tensors.values()
                  if t.key.endswith(".lora_A.weight")})
  parts = [re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(n)) for n in names]
  return "^(" + "|".join(parts) + ")$"


def export(path, adapters, config: _lora.LoraConfig, base, cmap: _hf.CheckpointMap, *,
           base_model: str | None = None, extra_config: Mapping | None = None) -> list[str]:
  """Writes `adapters` as a PEFT LoRA adapter directory.

  Args:
    path: output directory (local or `gs://...`), created if missing.
    adapters: `fnscale.lora.init`'s tree (jax.Arrays, as trained), float32 or other floats.
    config: the `LoraConfig` they were trained with (`rank`, `alpha`, `dropout` go to
      `r`, `lora_alpha`, `lora_dropout`: peft's scale alpha / r is fnscale's).
    base: the base params (arrays or ShapeDtypeStructs: shapes only).
    cmap: the base's `hf.CheckpointMap` (the one it was loaded with).
    base_model: written as `base_model_name_or_path` (the base checkpoint's directory or
      hub name), or None.
    extra_config: more `adapter_config.json` fields (e.g. {"task_type": "SEQ_CLS"}).

  Returns:
    The files written (names in `path`).

  Raises:
    LoraError: from `fnscale.lora.targets`; adapters that don't fit the base.
    CheckpointError: from `adapter_map`.
    StorageError: a file can't be written.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, tempfile
    >>> hf = fs.checkpoint.hf
    >>> cmap = hf.CheckpointMap({"w": hf.Tensor("mlp.up_proj.weight", perm=(1, 0))})
    >>> base, config = {"w": jnp.zeros((8, 16))}, fs.lora.LoraConfig(rank=2, targets=("w",))
    >>> adapters = fs.lora.init(base, config, jax.random.key(0))
    >>> with tempfile.TemporaryDirectory() as d:
    ...   fs.checkpoint.peft.export(d, adapters, config, base, cmap, base_model="my/base")
    ['adapter_model.safetensors', 'adapter_config.json']
  """
  ts = _lora.targets(base, config)
  _lora.check_adapters(ts, adapters, config.rank)
  amap = adapter_map(ts, cmap)
  _hf.write_tensors(path, adapters, amap, name=WEIGHTS_FILE)
  fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(config.rank),
            "lora_alpha": float(config.alpha), "lora_dropout": float(config.dropout),
            "target_modules": _modules_regex(amap), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base_model,
            **dict(extra_config or {})}
  if jax.process_index() == 0:
    _hf.write_json(str(path).rstrip("/") + "/" + CONFIG_FILE, fields)
  return [WEIGHTS_FILE, CONFIG_FILE]
