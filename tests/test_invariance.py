"""check_mesh_invariance: same steps on several meshes, largest differences reported."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale.analysis import check_mesh_invariance
import models


def _meshes():
  return [fs.make_mesh({"data": 1}, devices=jax.devices()[:1]),
          fs.make_mesh({"data": 2, "fsdp": 4}), fs.make_mesh({"fsdp": 8})]


def test_mlp_is_invariant_across_meshes():
  batches = [models.mlp_batch(jax.random.key(i), 16) for i in range(2)]
  report = check_mesh_invariance(
      models.mlp_loss, optax.adam(1e-2), models.mlp_init, batches, _meshes(), steps=2,
      rules=models.RULES, logical_axes=models.mlp_logical_axes(), key=jax.random.key(0))
  assert report.meshes == ({"data": 1}, {"data": 2, "fsdp": 4}, {"fsdp": 8})
  assert report.loss_diff[0] == 0.0 and report.param_diff[0] == 0.0
  assert report.max_diff <= 1e-6, str(report)
  # The losses are the model's own: recompute the first one independently.
  params = models.mlp_init(jax.random.key(0))
  assert all(abs(l[0] - float(models.mlp_loss(params, batches[0]))) < 1e-6
             for l in report.losses)
  assert report.losses[0][1] < report.losses[0][0]  # it trained
  text = str(report)
  assert "{'data': 2, 'fsdp': 4}" in text and "max |dparam|" in text


def test_a_mesh_dependent_loss_is_caught():
  # A habit from per-device (pmap) code: scaling the loss by the number of devices. Under a
  # global-view step that changes the result with the mesh, which the check reveals.
  def scaled_loss(params, batch):
    return models.mlp_loss(params, batch) / jax.sharding.get_abstract_mesh().size

  batch = models.mlp_batch(jax.random.key(1), 16)
  meshes = [fs.make_mesh({"data": 2}, devices=jax.devices()[:2]), fs.make_mesh({"data": 8})]
  report = check_mesh_invariance(scaled_loss, optax.sgd(1e-1), models.mlp_init, batch,
                                    meshes, steps=2, key=jax.random.key(0))
  np.testing.assert_allclose(report.losses[1][0], report.losses[0][0] / 4, rtol=1e-5)
  assert report.loss_diff[1] > 0.1 and report.param_diff[1] > 1e-4, str(report)
  assert report.worst_leaf[1].startswith("['")


def test_bad_arguments():
  with pytest.raises(fs.MeshError, match="at least two meshes"):
    check_mesh_invariance(models.mlp_loss, optax.sgd(1.0), {}, {}, _meshes()[:1])
  with pytest.raises(fs.MeshError, match=r"meshes\[1\] is a str"):
    check_mesh_invariance(models.mlp_loss, optax.sgd(1.0), {}, {}, [_meshes()[0], "x"])
  with pytest.raises(fs.StepError, match="sequence of 1 batches but steps=2"):
    check_mesh_invariance(models.mlp_loss, optax.sgd(1.0), {}, [{}], _meshes(), steps=2)
  with pytest.raises(fs.StepError, match=r"steps=0, expected a positive int"):
    check_mesh_invariance(models.mlp_loss, optax.sgd(1.0), {}, {}, _meshes(), steps=0)
