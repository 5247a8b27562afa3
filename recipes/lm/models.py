"""train_lm's models: the named sizes of every model module, a Hugging Face checkpoint as the
start of a run (`--init_from`) and as its result (`--export_hf`).

Each model module has one interface: `SIZES`, `model_config(size, seq)`, `init_params`,
`RULES`, `logical_axes`, `loss_fn(params, batch, *, remat, cfg, ...)`, `apply`,
`flops_per_token`. `s` below is train_lm's `run_setup.Setup`.
"""
from __future__ import annotations


import functools
import inspect
import os
import time
from types import ModuleType

import fnscale as fs
from recipes.lm import deepseek, gpt, hf_maps, llama, moe
from recipes.lm.shards import BYTES, tokenizer_file, tokenizer_identity
from recipes.lm.cli import did_you_mean
from recipes.lm.options import ModelOptions, StepOptions
from recipes.lm.remat import WHOLE_BLOCK, block_policy

# Model name -> its module.
MODELS = {name: module for module in (gpt, llama, moe, deepseek) for name in module.SIZES}


def choose(mo: ModelOptions, size: str, seq: int, corpus, *, dataset: str = "",
           lora_rank: int = 0) -> tuple[ModuleType, object, str]:
  """(model module, its config, the run's model name) of the model options `mo`
  (`Options.model`): --init_from's config.json, else the named `size` with the corpus's
  vocabulary. `dataset`, `lora_rank`: --dataset (named in an error) and --lora_rank. Raises
  InputError on an unknown name, both options given, a tokenizer with more ids than the
  checkpoint's model, packed rows for a model whose loss takes no weights, or --int8 for a
  model without int8 matmuls or with LoRA."""
  model, cfg, name = _choose(mo, size, seq, corpus.vocab)
  if corpus.packed is not None and "weighted" not in inspect.signature(model.loss_fn).parameters:
    raise fs.InputError(f"--dataset={dataset}: packed rows need a model whose loss masks "
                        f"documents and weighs tokens; {name} doesn't; fix: a gpt or llama "
                        "model, or a text dataset")
  if mo.int8:
    if "int8" not in cfg._fields:
      raise fs.InputError(f"--int8: {name} has no int8 matmuls; fix: a gpt or llama model, "
                          "or leave --int8 out")
    if lora_rank:
      raise fs.InputError("--int8 with --lora_rank: the int8 matmuls take plain weights, "
                          "not a base with adapters; give one of them")
    cfg = cfg._replace(int8=True)
  return model, cfg, name


def _choose(mo: ModelOptions, size: str, seq: int, vocab: int) -> tuple[ModuleType, object, str]:
  if not mo.init_from:
    if size not in MODELS:
      raise fs.InputError(f"model_config={size!r} is not a known model; expected one of "
                          f"{list(MODELS)}{did_you_mean(size, MODELS)}")
    return MODELS[size], MODELS[size].model_config(size, seq)._replace(vocab=vocab), size
  if mo.model_config:
    raise fs.InputError(f"--model_config={mo.model_config} with --init_from={mo.init_from}: "
                        "the checkpoint's config.json chooses the model; leave one out")
  m = hf_maps.read(mo.init_from, seq)
  if vocab > m.cfg.vocab:
    raise fs.InputError(f"the tokenizer has {vocab} ids and {mo.init_from}'s model "
                        f"{m.cfg.vocab}; fix: use the checkpoint's own tokenizer.json")
  name = os.path.basename(os.path.normpath(mo.init_from.split("://")[-1])) or "hf"
  return m.model, m.cfg, name


def tokenizer(mo: ModelOptions) -> str:
  """--tokenizer ("bytes": UTF-8 bytes), else --init_from's tokenizer.json (its model's ids),
  else "" (bytes)."""
  if mo.tokenizer == BYTES:
    return ""
  if mo.tokenizer or not mo.init_from:
    return mo.tokenizer
  path = os.path.join(mo.init_from, "tokenizer.json")
  if not os.path.isfile(path):
    raise fs.InputError(f"--init_from={mo.init_from} has no tokenizer.json; fix: pass the "
                        "model's tokenizer with --tokenizer=PATH/tokenizer.json, or "
                        f"--tokenizer={BYTES} for a byte-level model (vocabulary 256: what "
                        "train_lm exports without --tokenizer)")
  return path


def losses(s) -> tuple:
  """(train loss, eval loss, has_aux) of run `s`'s model: the eval loss is the mean
  cross-entropy (a (sum, weight) pair on packed rows); the train loss adds a mixture of
  experts' router losses and returns its load as aux (has_aux)."""
  o, model = s.o, s.model
  kw = dict(cfg=s.cfg, **({"weighted": True} if s.corpus.packed is not None else {}),
            **({"microbatches": o.step.microbatches} if o.step.microbatches else {}))
  aux = getattr(model, "HAS_AUX", False)
  train = functools.partial(model.loss_and_aux if aux else model.loss_fn,
                            remat=remat_of(o.step, model), **kw)
  return train, functools.partial(model.loss_fn, **kw), aux


def with_balancing(step, model, cfg):
  """The train step, then the model's step-to-step balancing where it has one (DeepSeek-V3's
  selection biases: `deepseek.update_bias` on the step's expert load), in the same program;
  other models' steps unchanged."""
  update = getattr(model, "update_bias", None)
  if update is None:
    return step

  def balanced(state, batch):
    state, metrics = step(state, batch)
    return state._replace(params=update(state.params, metrics["aux"], cfg)), metrics
  return balanced


def unrolled(mo: ModelOptions, step: StepOptions, cfg, name: str, platform: str):
  """`cfg` with its layer loop unrolled or not (`cfg.unroll`): as --unroll/--nounroll say,
  else on a TPU where each block keeps part of its activations (--remat_policy resolved,
  `run_setup.decide`, not one of `WHOLE_BLOCK`). Measured on one v5e (recipes/bench/README.md),
  GPT small's step (remat dots, 32 rows) ran 1.23x the scan's tokens/s (50.0% MFU against
  40.8%), GPT medium's 1.06x; under full remat the 766M Llama unrolled needed 19.5 GiB,
  the scan 15.0 (XLA's schedule keeps more of each layer live). Where the unrolled step
  doesn't fit, train_lm compiles the scan (`train_lm._compiled`). Raises InputError for
  --unroll on a model without the lever (moe, deepseek)."""
  if "unroll" not in getattr(cfg, "_fields", ()):
    if mo.unroll:
      raise fs.InputError(f"--unroll: {name} has no unrolled layer loop; fix: a gpt or "
                          "llama model, or leave --unroll out")
    return cfg
  on = (platform == "tpu" and block_policy(step) not in WHOLE_BLOCK if mo.unroll is None
        else mo.unroll)
  return cfg._replace(unroll=bool(on))


def remat_of(step: StepOptions, model) -> bool | str:
  """The loss's `remat` for the step's options (--remat_policy resolved, `run_setup.decide`):
  the policy's name for a model that takes one (gpt, llama: `REMAT_POLICIES`), else on for
  `WHOLE_BLOCK`'s and off for the others (moe recomputes a block whole or not at all)."""
  policy = block_policy(step)
  return policy if hasattr(model, "REMAT_POLICIES") else policy in WHOLE_BLOCK


def init(s, optimizer, policy, seed_key):
  """`init(abstract=False)` of the run's state, born in its shardings: fresh params, or
  --init_from's weights read straight into their shardings (`fnscale.checkpoint.hf.load`)."""
  kw = dict(mesh=s.mesh, rules=s.model.RULES, logical_axes=s.model.logical_axes(s.cfg),
            policy=policy, offload_optimizer=bool(s.o.step.optimizer_offload))
  fresh = functools.partial(fs.init_state, functools.partial(s.model.init_params, s.cfg),
                            optimizer, key=seed_key, **kw)
  if not s.o.model.init_from:
    return fresh

  def from_hf(abstract: bool = False):
    shapes = fresh(abstract=True)
    if abstract:
      return shapes
    m = hf_maps.HFModel(s.model, s.cfg, {})
    params = fs.checkpoint.hf.load(s.o.model.init_from, shapes.params,
                                   hf_maps.checkpoint_map(m, s.o.model.init_from))
    return fs.init_state(params, optimizer, **kw)
  return from_hf


def export(s, state, say) -> None:
  """Writes the params as a Hugging Face checkpoint to --export_hf (every process calls it;
  process 0 writes), with --init_from's config.json and tokenizer files when it has them."""
  t, o = time.time(), s.o
  m = (hf_maps.read(o.model.init_from, s.cfg.seq) if o.model.init_from else
       hf_maps.of_model(s.model, s.cfg))
  tok = trained_tokenizer(s)
  fs.checkpoint.hf.export(o.ckpt.export_hf, state.params,
                          hf_maps.checkpoint_map(m, o.model.init_from or None),
                          config=hf_maps.to_config(m), tokenizer_from=tok)
  say(f"exported a Hugging Face checkpoint to {o.ckpt.export_hf} ({time.time() - t:.1f} s; "
      f"{'tokenizer ' + tok if tok else 'byte-level: no tokenizer file'})")


def trained_tokenizer(s) -> str | None:
  """The tokenizer.json run `s` trained with (an export's): --tokenizer's file, --init_from's,
  or a token cache's own copy; None for UTF-8 bytes."""
  packed = s.corpus.packed
  tok = packed[1] if packed is not None else tokenizer(s.o.model)
  return None if tok in ("", BYTES) else tokenizer_file(tok)


def tokenizer_sha(s) -> str | None:
  """The hash of `trained_tokenizer(s)`'s serialisation (`shards.tokenizer_identity`: the
  same wherever its file lies); None for UTF-8 bytes."""
  tok = trained_tokenizer(s)
  return None if tok is None else tokenizer_identity(tok)["sha256"]
