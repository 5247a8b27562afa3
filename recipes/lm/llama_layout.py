"""Where the Llama's params and activations live on a mesh: each param's logical axis names
(`logical_axes`), the rules mapping them to mesh axes (`RULES`), the loss's vocabulary axes
(`vocab_axes`) and the weights LoRA adapts (`LORA_WEIGHTS`, `lora_targets`).
`recipes.lm.llama` re-exports these as its module interface.
"""
from __future__ import annotations

import math

import jax

from recipes.lm.llama_config import ModelConfig, variant


def logical_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of every param (same tree as `init_params`)."""
  names = variant(_AXES, {"bq": ("layers", "heads", "head_dim"),
                          "bk": ("layers", "kv_heads", "head_dim"),
                          "bv": ("layers", "kv_heads", "head_dim"),
                          "q_norm": ("layers", "norm"), "k_norm": ("layers", "norm"),
                          "post_attn_norm": ("layers", "norm"),
                          "post_mlp_norm": ("layers", "norm")}, cfg)
  staged = ("stage", "repeats") if cfg.repeats > 1 else ()
  return {**names, "blocks": {k: staged + v for k, v in names["blocks"].items()}}


_AXES = {
      "embed": ("vocab", "embed"),
      "blocks": {
          "attn_norm": ("layers", "norm"),
          "wq": ("layers", "embed", "heads", "head_dim"),
          "wk": ("layers", "embed", "kv_heads", "head_dim"),
          "wv": ("layers", "embed", "kv_heads", "head_dim"),
          "wo": ("layers", "heads", "head_dim", "embed"),
          "mlp_norm": ("layers", "norm"),
          "w_gate": ("layers", "embed", "mlp"),
          "w_up": ("layers", "embed", "mlp"),
          "w_down": ("layers", "mlp", "embed"),
      },
      "final_norm": ("norm",),
      "unembed": (None, "vocab_out"),
}


# The weights LoRA adapts (`fnscale.lora`), by name: the layout of one layer's weight ('i' its
# dims contracted with the activations, 'o' those it produces); the stored layer dims lead.
LORA_WEIGHTS = {"wq": "ioo", "wk": "ioo", "wv": "ioo", "wo": "iio", "w_gate": "io",
                "w_up": "io", "w_down": "io"}


def lora_targets(cfg: ModelConfig, names=None) -> tuple:
  """`fnscale.lora.LoraConfig.targets` for the block weights `names` (default every one of
  `LORA_WEIGHTS`): ("blocks/<name>", layout) pairs, with the stored layer dims ([layers],
  or a circular pipeline's [stages, repeats, layers per stage]) as 'l's."""
  stacked = "l" if cfg.repeats == 1 else "lll"
  return tuple((f"blocks/{n}", stacked + LORA_WEIGHTS[n]) for n in (names or LORA_WEIGHTS))


# Logical axis -> mesh axes: "embed" over fsdp shards params and optimizer state (ZeRO-3);
# heads, kv heads, mlp and vocab over tensor are Megatron-style tensor parallelism. The
# output layer is stored split by vocabulary over fsdp and tensor ("vocab_out"): the loss
# (`fnscale.cross_entropy(..., vocab_axes=VOCAB_OUT_AXES)`) then gathers the hidden states
# over fsdp, not the [d, vocab] weight, and never reduces its gradient over fsdp.
# A "context" axis (the sequence split) holds params split as "fsdp" does (MaxText's "embed"
# rule names both): its devices see different tokens, so their gradients are reduced over it
# anyway, and replicated params would hold c times the memory. Rules naming an axis the mesh
# lacks are skipped, so the combinations come largest first.
VOCAB_OUT_AXES = ("fsdp", "context", "tensor")


def _largest_first(name: str, axes: tuple[str, ...]) -> tuple:
  """(name, combination) rules for every non-empty combination of `axes`, largest first."""
  combos = [tuple(a for i, a in enumerate(axes) if mask >> i & 1)
            for mask in range(2 ** len(axes) - 1, 0, -1)]
  return tuple((name, c) for c in sorted(combos, key=len, reverse=True))


# Pipeline stages: a circular layout's "stage" dim over the stage axis, else the layer stack
# split into contiguous stages (as MaxText's ("layers", "stage")); a mesh without "stage"
# skips both rules.
RULES = (
    ("batch", ("replica", "stage", "data", "fsdp")),
    ("stage", "stage"),
    ("layers", "stage"),
    *_largest_first("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    *_largest_first("vocab_out", VOCAB_OUT_AXES),
    ("norm", None),  # RMSNorm scales: small, replicated on purpose
)


# Mesh axes that split the tokens (a batch's rows, a row's sequence) in RULES and the context
# convention: the loss gathers the hidden states over those it splits the vocabulary over.
TOKEN_AXES = ("replica", "stage", "data", "fsdp", "expert", "context")


def vocab_axes(hidden_shape, vocab: int, axes: tuple[str, ...] = VOCAB_OUT_AXES
               ) -> tuple[str, ...]:
  """The loss's vocabulary axes for hidden states [batch, seq, d] on the ambient mesh:
  `axes` (the output layer's storage split), less those that also split the tokens when a device holds more tokens than
  vocabulary rows. Over such an axis the loss gathers either the tokens' hidden states
  (vocab-parallel) or the output layer's shards (the partitioner, before the loss): it
  gathers the smaller. (Llama 3 at 2 x 131,072 tokens over fsdp=2 x context=4: 32,768
  tokens against 16,032 vocabulary rows per device.)"""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return axes
  size = lambda names: math.prod(mesh.shape.get(a, 1) for a in names)
  tokens = math.prod(hidden_shape[:-1]) // size(TOKEN_AXES)
  if tokens <= vocab // size(axes):
    return axes
  return tuple(a for a in axes if a not in TOKEN_AXES)
