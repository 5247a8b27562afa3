"""train_lm's optimizers (`--optimizer`, `--mu_dtype`): one optax transformation per choice,
for the run (`run_setup.optimizer`), the memory pre-flight's estimate of its state
(`recipes/lm/memory.py`) and the benchmarks (`recipes/bench/chip.py`).

What each keeps per param of n values (float32 unless said):
- adamw: the first and second moments, 2 n (mu in bfloat16 with mu_dtype="bfloat16": 1.5 n
  floats' bytes); the update is Adam's, the weight decay decoupled (lr x decay x param).
- adafactor: the second moment factored over each matrix's two largest dims (rows + columns
  of it, a vector for a leaf under 128 on either), no first moment: about 0 x n. The update
  is scaled by the lr alone (not by the param's RMS, Adafactor's other form), so --lr means
  what it means for AdamW; Adafactor clips each update's RMS at 1 after the global-norm
  clip, and its decay is lr x decay x param on the same leaves as AdamW's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from recipes.lm.options import MU_DTYPES, OPTIMIZERS


def decay_mask(params):
  """Weight decay on weight matrices and embeddings ("w*" leaves), not biases or norms."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: str(getattr(path[-1], "key", "")).startswith("w"), params)


def transformation(name: str, lr, *, mu_dtype: str = "float32", weight_decay: float = 0.1,
                   grad_clip: float = 1.0) -> optax.GradientTransformation:
  """The optax transformation of optimizer `name` (`OPTIMIZERS`) at learning rate `lr` (a
  float or a schedule of the step), after clipping the global gradient norm to `grad_clip`
  (0: no clipping). `mu_dtype`: AdamW's first-moment dtype (adafactor keeps none).

  Raises:
    ValueError: an unknown `name` or `mu_dtype` (train_lm's options check both first).

  Examples:
    >>> import jax.numpy as jnp
    >>> clip, adafactor = transformation("adafactor", 1e-3).init({"w": jnp.zeros((256, 512))})
    >>> adafactor[0].v_row["w"].shape, adafactor[0].v_col["w"].shape
    ((256,), (512,))
  """
  if name not in OPTIMIZERS or mu_dtype not in MU_DTYPES:
    raise ValueError(f"optimizer {name!r}, mu_dtype {mu_dtype!r}: expected one of "
                     f"{OPTIMIZERS} and {MU_DTYPES}")
  chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  if name == "adamw":
    chain.append(optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask,
                             mu_dtype=jnp.dtype(mu_dtype)))
  else:
    # optax adds Adafactor's decay after the lr: scaled by the lr here, as AdamW's is.
    decay = (lambda step: weight_decay * lr(step)) if callable(lr) else weight_decay * lr
    chain.append(optax.adafactor(lr, multiply_by_parameter_scale=False,
                                 weight_decay_rate=decay, weight_decay_mask=decay_mask))
  return optax.chain(*chain)
