"""Mesh invariance: the same training steps on several meshes should give the same numbers.

A sharding changes where arithmetic happens, not what it computes: a correct set of rules
gives, on any mesh, the losses and params of one device up to float rounding (the order of
a cross-device sum). `check_mesh_invariance` runs a user's step on each mesh and reports the
largest differences against the first, so rules, custom kernels or hand-written collectives
can be checked before a long run. The same idea scales to processes: tests/test_multihost.py
compares 2 x 4 and 4 x 2 process layouts against 1 x 8 this way.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from fnscale._compile import shard_step
from fnscale._errors import MeshError, StepError
from fnscale._mesh import check_mesh
from fnscale._state import init_state
from fnscale._step import train_step


class InvarianceReport(NamedTuple):
  """Differences of each mesh's run from the first mesh's (float64 absolute values).

  meshes: each mesh's axis sizes, e.g. {"data": 2, "fsdp": 4}.
  losses: per mesh, the loss after each step (float).
  loss_diff: per mesh, max over steps of |loss - first mesh's loss| (0.0 for the first).
  param_diff: per mesh, max over leaves and elements of |param - first mesh's param| after
    the last step.
  worst_leaf: per mesh, the pytree path where param_diff occurs ("" for the first).
  `max_diff` is the largest of them all; `str(report)` a table.

  Examples:
    What `check_mesh_invariance` returns for two meshes whose runs differ by rounding:

    >>> import fnscale as fs
    >>> report = fs.analysis.InvarianceReport(
    ...     meshes=({"data": 1}, {"data": 4, "fsdp": 2}), losses=((1.0, 0.5), (1.0, 0.5000001)),
    ...     loss_diff=(0.0, 1e-7), param_diff=(0.0, 3e-7), worst_leaf=("", "['w']"))
    >>> report.max_diff
    3e-07
    >>> print(report)
    mesh                              max |dloss|  max |dparam|  worst leaf
    {'data': 1}                                 0             0
    {'data': 4, 'fsdp': 2}                  1e-07         3e-07  ['w']
  """
  meshes: tuple[dict[str, int], ...]
  losses: tuple[tuple[float, ...], ...]
  loss_diff: tuple[float, ...]
  param_diff: tuple[float, ...]
  worst_leaf: tuple[str, ...]

  @property
  def max_diff(self) -> float:
    """The largest loss or param difference over all meshes."""
    return max(max(self.loss_diff), max(self.param_diff))

  def __str__(self) -> str:
    rows = [f"{'mesh':<32} {'max |dloss|':>12} {'max |dparam|':>13}  worst leaf"]
    for m, dl, dp, leaf in zip(self.meshes, self.loss_diff, self.param_diff, self.worst_leaf):
      rows.append(f"{str(m):<32} {dl:>12.3g} {dp:>13.3g}  {leaf}")
    return "\n".join(rows)


def _host(tree) -> dict[str, np.ndarray]:
  """Every leaf as a whole host array. Only leaves spread over several processes are
  gathered (a collective all of them must join); a mesh of this process's own devices never
  waits for another process."""
  if all(getattr(a, "is_fully_addressable", True) for a in jax.tree.leaves(tree)):
    full = jax.device_get(tree)
  else:
    full = multihost_utils.process_allgather(tree, tiled=True)
  return {jax.tree_util.keystr(p): np.asarray(v, np.float64)
          for p, v in jax.tree_util.tree_flatten_with_path(full)[0]}


def check_mesh_invariance(loss_fn: Callable, optimizer, init_params: Any, batch: Any,
                          meshes: Sequence[jax.sharding.Mesh], *, steps: int = 1,
                          rules=(), logical_axes=None, has_aux: bool = False, policy=None,
                          mode: str = "auto", key=None) -> InvarianceReport:
  """Trains `steps` steps on each mesh from the same start and compares them to the first.

  Each mesh gets its own `init_state` (params born in that mesh's shardings) and
  `shard_step(train_step(loss_fn, optimizer, ...))`; the batch is split over the mesh's
  data axes. Run it in one process (all meshes over `jax.devices()`), e.g. a 1-device mesh
  first and the production layouts after it. In a multi-process job, meshes of this
  process's own devices (`jax.local_devices()`) run here alone, waiting for no other
  process; a mesh spanning processes needs the same call on every process.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`).
    optimizer: an optax `GradientTransformation`.
    init_params: a pytree of arrays, or `init_fn(key)` (with `key`) / `init_fn()`.
    batch: the global batch (pytree of arrays with a leading batch dim divisible by every
      mesh's data axes), used at every step, or a sequence of `steps` batches.
    meshes: two or more `jax.sharding.Mesh`es; the first is the reference.
    steps: optimizer steps per mesh.
    rules, logical_axes, policy, mode: as in `init_state` / `shard_step` / `train_step`.
    key: PRNG key for `init_fn`.

  Returns:
    An `InvarianceReport` (print it for a table). For float32 steps on CPU expect
    differences around 1e-7 to 1e-6 (reduction order); much larger ones mean a rule or a
    kernel changes what is computed.

  Raises:
    MeshError: fewer than two meshes, or something that isn't a Mesh (named by index).
    StepError: bad steps or a batch list whose length isn't `steps`; and from the step.

  Examples:
    One device against data and FSDP parallelism over 8, two SGD steps:

    >>> import fnscale as fs, jax, jax.numpy as jnp, optax
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(32.0).reshape(8, 4) / 32, "y": jnp.ones((8, 1))}
    >>> meshes = [fs.make_mesh({"data": 1}, devices=jax.devices()[:1]),
    ...           fs.make_mesh({"data": 4, "fsdp": 2})]
    >>> report = fs.analysis.check_mesh_invariance(loss, optax.sgd(0.1), {"w": jnp.zeros((4, 1))},
    ...                                            batch, meshes, steps=2)
    >>> report.loss_diff[0], report.max_diff < 1e-5  # float32 reduction order only
    (0.0, True)
  """
  meshes = list(meshes)
  if len(meshes) < 2:
    raise MeshError(f"check_mesh_invariance needs at least two meshes to compare, got "
                    f"{len(meshes)}; pass e.g. [make_mesh({{'data': 1}}, devices=jax.devices()"
                    "[:1]), make_mesh({'data': -1})].")
  for i, m in enumerate(meshes):
    check_mesh(m, "check_mesh_invariance", arg=f"meshes[{i}]")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise StepError(f"steps={steps!r}, expected a positive int.")
  if isinstance(batch, (list, tuple)):
    if len(batch) != steps:
      raise StepError(f"batch is a sequence of {len(batch)} batches but steps={steps}; give "
                      "one batch per step, or a single batch to reuse.")
    batches = list(batch)
  else:
    batches = [batch] * steps

  step_fn = train_step(loss_fn, optimizer, policy=policy, has_aux=has_aux)
  runs = []
  for mesh in meshes:
    state = init_state(init_params, optimizer, mesh=mesh, rules=rules,
                       logical_axes=logical_axes, policy=policy, key=key)
    sharded = shard_step(step_fn, mesh, rules=rules, logical_axes=logical_axes,
                         mode=mode, donate=False)
    losses = []
    for b in batches:
      state, metrics = sharded(state, b)
      losses.append(float(metrics["loss"]))
    runs.append((dict(mesh.shape), tuple(losses), _host(state.params)))

  _, ref_losses, ref_params = runs[0]
  loss_diff, param_diff, worst = [], [], []
  for _, losses, params in runs:
    loss_diff.append(float(np.max(np.abs(np.subtract(losses, ref_losses)))))
    per_leaf = {k: float(np.max(np.abs(params[k] - ref_params[k]), initial=0.0))
                for k in ref_params}
    leaf = max(per_leaf, key=per_leaf.get)
    param_diff.append(per_leaf[leaf])
    worst.append(leaf if per_leaf[leaf] > 0 else "")
  return InvarianceReport(tuple(r[0] for r in runs), tuple(r[1] for r in runs),
                          tuple(loss_diff), tuple(param_diff), tuple(worst))
