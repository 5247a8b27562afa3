"""Training that stalled: steps whose update was skipped, changed nothing or made the params
non-finite although the loss was finite, counted across steps (`check_update`) and stopped
with the likely cause."""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

import fnscale as fs


class Stall(NamedTuple):
  """Consecutive steps that did not train (`did_not_train`): how many, and the first."""
  steps: int = 0
  first: int = 0


def did_not_train(m) -> bool:
  """Whether step metrics `m` show a finite loss with no update that trained: a "bad_update"
  (non-finite gradients; where the change is measured, params unchanged or non-finite) or
  a step a dynamic loss scale skipped (non-finite gradients). A non-finite loss is not counted: the non-finite check stops that run."""
  bad, skipped, loss = jax.device_get((m["bad_update"], m["skipped"], m["loss"]))
  # Skips count whatever the scale. A dynamic scale halves per skip, so k skips in a row
  # lower it 2**k: from float16's default 2**15 to its floor, 1, within 15. train_lm's
  # default limit, 20, leaves that room and 5 halvings more for a scale that grew; gradients
  # still non-finite after 20 halvings (a millionfold) are no scale still being found.
  # Counting only skips at the floor would wait out the halving from wherever the scale
  # grew to, and needs each step's scale before it.
  return bool(int(bad) or (int(skipped) and np.isfinite(loss)))


def check_update(stall: Stall, done: int, m, limit: int) -> Stall:
  """Counts step `done`'s metrics `m` into `stall`; `limit` consecutive steps that did not
  train (`did_not_train`) raise. limit 0: never.

  Raises:
    StepError: naming the steps, the norms and the likely cause.
  """
  if m is None or not did_not_train(m):
    return Stall()
  stall = Stall(stall.steps + 1, stall.first if stall.steps else done)
  if limit and stall.steps >= limit:
    grad = float(m["grad_norm"])
    update = float(m["update_norm"]) if "update_norm" in m else None
    scale = f", loss_scale {float(m['loss_scale']):g}" if "loss_scale" in m else ""
    norms = f"grad_norm {grad:.3g}" + ("" if update is None else f", update_norm {update:.3g}")
    raise fs.StepError(
        f"training stalled: the update was skipped, changed nothing or made the params "
        f"non-finite at {stall.steps} consecutive steps {stall.first}..{done} although the "
        f"loss was finite (at step {done}: loss {float(m['loss']):.4g}, {norms}{scale}); "
        f"likely cause: {_stall_cause(m, grad, update)}; "
        "--max_stalled_steps=0 turns this check off")
  return stall


def _stall_cause(m, grad: float, update: float | None) -> str:
  if int(m["skipped"]):
    return ("the updates were skipped: their gradients were non-finite and halving the "
            "dynamic loss scale did not make them finite, so the scaled gradients overflow "
            "the compute dtype (float16 holds at most 65504) even at the scale's floor, or "
            "are non-finite at any scale (e.g. sqrt's at 0); use precision=float32 (or "
            "bfloat16 compute, float32's range); if loss_scale is still falling from a high "
            "start, raise --max_stalled_steps")
  if not np.isfinite(grad if update is None else update):
    return ("the params became non-finite: the gradients or the optimizer's update "
            "overflowed (a static loss scale too large for the compute dtype applies them "
            "as inf); lower lr or the static scale, or use precision=float32")
  if grad == 0:
    return ("the gradients are zero: they underflow in the compute dtype or the loss does "
            "not depend on the params; use precision=float32 (or float16 with its loss scale)")
  return ("each update is rounded away by the params' dtype (bfloat16 params hold ~3 "
          "significant digits) or the learning rate is 0; keep params in float32 (e.g. "
          "precision='params=float32,compute=bfloat16,output=float32') or raise lr")
