"""LoRA and DPO runs of train_lm (`--lora_rank`, `--objective=dpo`): the LoRA config the
options ask for, the state (the base frozen, from --init_from or fresh, in the compute dtype;
adapters trained), the losses, what the start-up report says of trainable and frozen params,
the model FLOPs of MFU, and the exports (a merged Hugging Face checkpoint and a PEFT
adapter). `s` is train_lm's `run_setup.Setup`.

MFU of a LoRA step counts what the step must compute (Hu et al. 2021, sec. 4.2): every
frozen matmul weight's forward and input gradient, 4 N FLOPs per token for N frozen matmul
params (no weight gradient: 6 N would be full fine-tuning's), the adapters' 6 N_adapters, and
attention's 12 layers x heads x head_dim x seq (PaLM's count,
`fnscale.analysis.model_flops_per_token`). DPO
adds the reference's forward pass over the same tokens: 2 N + 4 layers x heads x head_dim x
seq.
"""
from __future__ import annotations

import functools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fnscale as fs
from recipes.lm import cli, data, dpo, hf_maps, models, preference
from recipes.lm.options import FinetuneOptions


def lora_config(tune: FinetuneOptions, model, cfg, name: str = "") -> fs.lora.LoraConfig | None:
  """The LoRA config of fine-tuning options `tune` for `model` (None without --lora_rank;
  `name`: --model_config, named in an error); --lora_targets names weights of
  `model.LORA_WEIGHTS` or regexes over their leaf paths.

  Raises:
    InputError: --lora_rank with a model whose leaves LoRA can't adapt, a --lora_targets
      item that matches none of its weights (each named, with the fix), DPO without LoRA.
  """
  if tune.objective == "dpo" and not tune.lora_rank:
    raise fs.InputError("--objective=dpo needs --lora_rank (e.g. 16): DPO's reference model "
                        "is the frozen base, the params without adapters")
  if not tune.lora_rank:
    return None
  names = getattr(model, "LORA_WEIGHTS", None)
  if names is None:
    raise fs.InputError(
        f"--lora_rank={tune.lora_rank} with model {name or model.__name__}: its matmul "
        "weights don't multiply through fs.lora.einsum, so LoRA can't adapt its leaves; fix: a "
        "Llama-family model (--model_config=llama-*, or --init_from a Llama, Mistral, Qwen "
        "or Gemma checkpoint), or full fine-tuning (no --lora_rank)")
  chosen = []
  for item in [t.strip() for t in tune.lora_targets.split(",") if t.strip()] or list(names):
    hits = [n for n in names if n == item or _fullmatch(item, f"blocks/{n}")]
    if not hits:
      raise fs.InputError(
          f"--lora_targets: {item!r} matches no weight LoRA can adapt in this model; its "
          f"weights are {','.join(names)} (leaf paths blocks/<name>){cli.did_you_mean(item, names)}"
          "; fix: name some of them")
    chosen += [n for n in hits if n not in chosen]
  alpha = 2.0 * tune.lora_rank if tune.lora_alpha is None else tune.lora_alpha
  return fs.lora.LoraConfig(tune.lora_rank, alpha, tune.lora_dropout,
                            model.lora_targets(cfg, [n for n in names if n in chosen]))


def _fullmatch(pattern: str, text: str) -> bool:
  try:
    return re.fullmatch(pattern, text) is not None
  except re.error as e:
    raise fs.InputError(f"--lora_targets: {pattern!r} is not a regex ({e})") from None


def dpo_config(tune: FinetuneOptions) -> dpo.DPOConfig:
  return dpo.check(dpo.DPOConfig(tune.dpo_beta, tune.dpo_label_smoothing, tune.dpo_loss,
                                 tune.dpo_pairs))


def corpus(o, tokenizer: str, say=None) -> data.Corpus:
  """The run's data: preference pairs for --objective=dpo (`preference.corpus`), else
  `data.load`'s corpus (its tokenizing's progress said by `say`)."""
  if o.tune.objective != "dpo":
    if o.model.tokenizer == models.BYTES and data.is_packed(o.data.dataset):
      tokenizer = models.BYTES  # checked against the cache's ("": the cache's own, whatever)
    return data.load(o.data.dataset, tokenizer, say)
  if o.schedule.epochs is not None:
    raise fs.InputError(f"--epochs={o.schedule.epochs} with --objective=dpo: preference "
                        "pairs are read as an endless shuffle; give --steps instead")
  return preference.corpus(o.data.dataset, tokenizer, o.tune.chat_template)


def losses(s, lora) -> tuple:
  """(train loss, eval loss over bound params, has_aux, weighted) of a LoRA run `s`."""
  o, model = s.o, s.model
  if o.tune.objective == "dpo":
    cfg = dpo_config(o.tune)
    return (functools.partial(dpo.loss_fn(model, lora, cfg, cfg=s.cfg), remat=o.step.remat),
            dpo.eval_loss_fn(model, cfg, cfg=s.cfg), True, True)
  train, evaluate, aux = models.losses(s)
  return (fs.lora.with_lora(train, lora), evaluate, aux, s.corpus.packed is not None)


def params_of(lora):
  """state -> the params evaluation and sampling use: the base with the adapters bound
  (`fnscale.lora.bind`, no dropout); the state's own params without LoRA."""
  if lora is None:
    return lambda state: state.params
  return lambda state: fs.lora.bind(state.frozen, state.params, lora)


def base_dtype(policy):
  """The frozen base's stored dtype: the policy's compute dtype (bfloat16 on accelerators:
  half of float32's bytes), float32 without a policy."""
  return jnp.dtype(policy.compute_dtype) if policy is not None else jnp.dtype(jnp.float32)


def init(s, optimizer, policy, seed_key, lora):
  """`init(abstract=False)` of a LoRA run's state: the base (--init_from's weights read into
  their shardings in the compute dtype, or fresh) frozen, adapters new
  (`fnscale.lora.init_state`)."""
  kw = dict(mesh=s.mesh, rules=s.model.RULES, logical_axes=s.model.logical_axes(s.cfg))
  dtype = base_dtype(policy)

  def base(abstract: bool):
    shapes = fs.init_state(functools.partial(s.model.init_params, s.cfg), optax.sgd(0.0),
                           key=seed_key, abstract=True, **kw).params
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding),
                          shapes)
    if abstract:
      return shapes
    if s.o.model.init_from:
      m = hf_maps.HFModel(s.model, s.cfg, {})
      return fs.checkpoint.hf.load(s.o.model.init_from, shapes,
                                   hf_maps.checkpoint_map(m, s.o.model.init_from))
    make = lambda k: jax.tree.map(lambda x: x.astype(dtype), s.model.init_params(s.cfg, k))
    return jax.jit(make, out_shardings=jax.tree.map(lambda x: x.sharding, shapes))(seed_key)

  def make_state(abstract: bool = False):
    return fs.lora.init_state(base(abstract), lora, optimizer,
                              key=jax.random.fold_in(seed_key, 1), policy=policy,
                              abstract=abstract)
  return make_state


def _device_bytes(tree) -> int:
  """The most bytes one device holds of `tree` (arrays or ShapeDtypeStructs with
  shardings)."""
  per: dict = {}
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape)
    n = int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    for d in x.sharding.device_set:
      per[d] = per.get(d, 0) + n
  return max(per.values(), default=0)


def describe(state, lora, say) -> dict:
  """Says (and returns, for run.json) the trainable and frozen params of a LoRA state and
  what each holds per device."""
  count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
  gib = _bytes
  rec = dict(trainable=count(state.params), frozen=count(state.frozen),
             trainable_bytes=_device_bytes(state.params),
             optimizer_bytes=_device_bytes(state.opt_state),
             frozen_bytes=_device_bytes(state.frozen))
  dtype = jax.tree.leaves(state.frozen)[0].dtype
  say(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, "
      f"{len(lora.targets)} weights ({', '.join(p.split('/')[-1] for p, _ in lora.targets)}): "
      f"trainable {rec['trainable'] / 1e6:.2f}M params ({gib(rec['trainable_bytes'])} "
      f"+ {gib(rec['optimizer_bytes'])} optimizer state per device), frozen "
      f"{rec['frozen'] / 1e6:.2f}M ({jnp.dtype(dtype).name}, {gib(rec['frozen_bytes'])} per "
      "device, no gradient or optimizer state)")
  return rec


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def flops_per_token(s, lora) -> float:
  """Model FLOPs per token of a LoRA (or DPO) step (see the module docstring)."""
  cfg = s.cfg
  adapters = sum(int(np.prod(a)) + int(np.prod(b)) for a, b in _adapter_shapes(s, lora))
  attn = 12 * cfg.layers * cfg.heads * cfg.head_dim * cfg.seq
  n = s.model.matmul_params(cfg)
  out = 4 * n + 6 * adapters + attn
  if s.o.tune.objective == "dpo":
    out += 2 * n + attn / 3
  return float(out)


def _adapter_shapes(s, lora):
  shapes = jax.eval_shape(functools.partial(s.model.init_params, s.cfg), jax.random.key(0))
  return [t.adapter_shapes(lora.rank) for t in fs.lora.targets(shapes, lora)]


def export(s, state, lora, say) -> None:
  """--export_hf of a LoRA run: the merged params (W + scale A B) as a Hugging Face
  checkpoint, and the adapters as a PEFT adapter (--export_adapter, default
  EXPORT_HF/adapter) naming --init_from as its base model."""
  t, o = time.time(), s.o
  m = (hf_maps.read(o.model.init_from, s.cfg.seq) if o.model.init_from else
       hf_maps.of_model(s.model, s.cfg))
  cmap = hf_maps.checkpoint_map(m, o.model.init_from or None)
  merged = jax.jit(lambda f, a: fs.lora.merge(f, a, lora))(state.frozen, state.params)
  fs.checkpoint.hf.export(o.ckpt.export_hf, merged, cmap, config=hf_maps.to_config(m),
                          tokenizer_from=models.trained_tokenizer(s))
  adapter = o.ckpt.export_adapter or os.path.join(o.ckpt.export_hf, "adapter")
  fs.checkpoint.peft.export(adapter, state.params, lora, state.frozen, cmap,
                            base_model=o.model.init_from or None)
  say(f"exported the merged model to {o.ckpt.export_hf} and the PEFT adapter to {adapter} "
      f"({time.time() - t:.1f} s)")
