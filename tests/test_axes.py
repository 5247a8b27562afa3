"""Axis conventions: fnscale's, MaxText's and Levanter's mesh axis names as values."""
import logging as py_logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import fnscale as fs
from fnscale import attention, with_kernel
from fnscale.kernels import kernel_selection

import maxtext_rules

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])


def test_presets_name_the_batch_and_head_axes():
  maxtext = _mesh((2, 2, 2), ("data", "fsdp", "fsdp_transpose"))
  levanter = _mesh((1, 2, 4), ("replica", "data", "model"))
  # fnscale's own names: fsdp_transpose and model mean nothing, so they don't split a batch.
  assert fs.batch_sharding(maxtext).spec == P(("data", "fsdp"))
  with fs.axis_conventions("maxtext"):
    assert fs.batch_sharding(maxtext).spec == P(("data", "fsdp", "fsdp_transpose"))
  with fs.axis_conventions(fs.LEVANTER_AXES) as conv:
    assert conv is fs.LEVANTER_AXES
    assert fs.batch_sharding(levanter).spec == P(("replica", "data"))
    assert fs.data_axes(levanter) == ("replica", "data")
  # The block ended: the default is back.
  assert fs.batch_sharding(maxtext).spec == P(("data", "fsdp"))
  custom = fs.AxisConventions(data=("dp",), replica=("dp",), head=("tp",))
  with fs.axis_conventions(custom):
    assert fs.batch_sharding(_mesh((4, 2), ("dp", "tp"))).spec == P("dp")


def test_bad_conventions_are_a_mesh_error():
  for bad in ("megatron", ("data",), fs.AxisConventions(data="data", replica=(), head=())):
    with pytest.raises(fs.MeshError, match="expected an fnscale.AxisConventions"):
      with fs.axis_conventions(bad):
        pass


def test_levanter_model_axis_splits_attention_heads():
  mesh = _mesh((2, 4), ("data", "model"))
  b, t, h, d = 2, 128, 4, 64
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (b, t, h, d)) for kk in ks)
  spec = jax.sharding.NamedSharding(mesh, P("data", None, "model", None))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
  with fs.with_mesh(mesh):
    sel = with_kernel(kernel_selection, interpret=True)(q.shape, k.shape, causal=True)
    # Under fnscale's names "model" means nothing: every device computes every head.
    assert (sel.batch_axes, sel.head_axes) == (("data",), ())
    with fs.axis_conventions("levanter"):
      sel = with_kernel(kernel_selection, interpret=True)(q.shape, k.shape, causal=True)
      assert (sel.implementation, sel.batch_axes, sel.head_axes) == (
          "splash", ("data",), ("model",))
      fn = jax.jit(with_kernel(lambda q, k, v: attention(q, k, v, causal=True),
                               attention="splash", interpret=True))
      hlo = fn.lower(q, k, v).compile().as_text()
      out = fn(q, k, v)
  # Heads split over "model": no device gathers q, k or v, and the values are attention's.
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert out.sharding.is_equivalent_to(spec, 4)
  ref = attention(*(np.asarray(x) for x in (q, k, v)), causal=True, implementation="xla")
  np.testing.assert_allclose(out, ref, atol=2e-5)


def test_maxtext_and_levanter_names_are_not_typos(caplog):
  tree = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
  axes = {"w": ("embed", "mlp")}
  sizes = {"fsdp": 4, "tensor": 2}
  full = _mesh(tuple(sizes.get(a, 1) for a in maxtext_rules.MESH_AXES), maxtext_rules.MESH_AXES)
  with caplog.at_level(py_logging.WARNING):
    # On MaxText's mesh (every axis present) its default rules give MaxText's layout.
    sh = fs.shardings(tree, full, maxtext_rules.LOGICAL_AXIS_RULES, logical_axes=axes)
    # On a smaller mesh the rules naming stage, sequence, ... are skipped without a word
    # (every "embed" rule names sequence: replicated, as the rules say).
    small = fs.sharding_layout(tree, _mesh((2, 4), ("data", "fsdp")),
                               maxtext_rules.LOGICAL_AXIS_RULES, logical_axes=axes)
    fs.shardings(tree, _mesh((2, 4), ("data", "fsdp")), (("embed", "model"), ("mlp", "fsdp")),
                 logical_axes=axes)
  assert sh["w"].spec == P(("fsdp", "sequence", "tensor_transpose", "context", "expert"),
                           ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"))
  assert sh["w"].shard_shape((64, 256)) == (16, 128)
  assert small.leaves[0].spec == P(None, None) and "mesh doesn't have" in small.leaves[0].note
  assert "typo" not in caplog.text
  with pytest.raises(fs.ShardingError, match=r"names mesh axis 'fsdpp', which the mesh \(axes "
                     r"\('data', 'stage',.*did you mean 'fsdp'\?"):
    fs.shardings(tree, full, (("embed", "fsdpp"),), logical_axes=axes)
