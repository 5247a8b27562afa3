"""Logical rules resolve exactly as `flax.linen.logical_to_mesh_axes` resolves them (the
reference), over generated rules and names and over MaxText's default rule list."""
from jax.sharding import AbstractMesh
import pytest

from fnscale import _sharding as fsh

import maxtext_rules

flax_spmd = pytest.importorskip("flax.linen").logical_to_mesh_axes
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

LOGICAL = ("batch", "embed", "mlp", "heads", "vocab")
MESH = ("data", "fsdp", "tensor", "expert")


def _entries(spec) -> tuple[tuple[str, ...], ...]:
  """A PartitionSpec as one tuple of mesh axes per dimension (None, 'a', ('a',) alike)."""
  out = []
  for e in spec:
    out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
  return tuple(out)


def _mesh(axes) -> AbstractMesh:
  return AbstractMesh((1,) * len(axes), tuple(axes))


def _reference(names, rules, mesh_axes):
  """flax's answer for the rules fnscale can use on this mesh (those whose mesh axes all
  exist: fnscale skips the others, so rules written for bigger meshes still apply)."""
  usable = [(n, a) for n, a in fsh.normalize_rules(rules) if all(x in mesh_axes for x in a)]
  return _entries(flax_spmd(names, usable))


_axes = st.one_of(st.none(), st.sampled_from(MESH + ("pipe",)),
                  st.lists(st.sampled_from(MESH), min_size=0, max_size=3, unique=True))
_rules = st.lists(st.tuples(st.sampled_from(LOGICAL), _axes), max_size=12)
_names = st.lists(st.one_of(st.none(), st.sampled_from(LOGICAL + ("other",))), min_size=0,
                  max_size=5).filter(lambda ns: len([n for n in ns if n]) == len(
                      {n for n in ns if n}))
_mesh_axes = st.lists(st.sampled_from(MESH), min_size=1, max_size=len(MESH), unique=True)


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(rules=_rules, names=_names, mesh_axes=_mesh_axes)
def test_generated_rules_match_flax(rules, names, mesh_axes):
  got = fsh.logical_to_spec(tuple(names), rules, _mesh(mesh_axes))
  assert _entries(got) == _reference(tuple(names), rules, mesh_axes)


@hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
@hypothesis.given(rules=_rules, names=_names)
def test_generated_rules_match_flax_when_every_axis_exists(rules, names):
  # Every rule's axes in the mesh: no filtering, flax's result as it is.
  rules = [(n, a) for n, a in rules if a != "pipe"]
  got = fsh.logical_to_spec(tuple(names), rules, _mesh(MESH))
  assert _entries(got) == _entries(flax_spmd(tuple(names), rules))


_MAXTEXT_NAMES = tuple(sorted({n for n, _ in maxtext_rules.LOGICAL_AXIS_RULES}))


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(names=st.lists(st.sampled_from(_MAXTEXT_NAMES), max_size=5, unique=True),
                  mesh_axes=st.lists(st.sampled_from(maxtext_rules.MESH_AXES), min_size=1,
                                     unique=True))
def test_maxtext_default_rules_match_flax(names, mesh_axes):
  rules = maxtext_rules.LOGICAL_AXIS_RULES
  got = fsh.logical_to_spec(tuple(names), rules, _mesh(maxtext_rules.MESH_AXES))
  assert _entries(got) == _entries(flax_spmd(tuple(names), [list(r) for r in rules]))
  # On a mesh with only some of MaxText's axes, the rules naming the others are skipped.
  got = fsh.logical_to_spec(tuple(names), rules, _mesh(mesh_axes))
  assert _entries(got) == _reference(tuple(names), rules, mesh_axes)


def test_maxtext_parameter_layouts_by_hand():
  # Worked by hand on MaxText's full mesh. "mlp"'s rule (before any "embed" rule) claims
  # fsdp_transpose and the tensor axes first; "embed"'s first rule needs fsdp_transpose, its
  # second (fsdp, sequence, tensor_transpose, context, expert) is free. Resolving dimension by
  # dimension instead would give "embed" its first rule and leave "mlp" replicated.
  rules = maxtext_rules.LOGICAL_AXIS_RULES
  mesh = _mesh(maxtext_rules.MESH_AXES)
  assert _entries(fsh.logical_to_spec(("embed", "mlp"), rules, mesh)) == (
      ("fsdp", "sequence", "tensor_transpose", "context", "expert"),
      ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"))
  # "heads" takes tensor_transpose, so "embed" falls to its third rule; "layers" to stage.
  assert _entries(fsh.logical_to_spec(("layers", "embed", "heads"), rules, mesh)) == (
      ("stage",), ("fsdp", "fsdp_transpose", "sequence", "context", "expert"),
      ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive"))
