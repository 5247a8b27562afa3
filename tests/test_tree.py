"""Leaf paths: one spelling, '/'-joined keys, for every kind of pytree node."""
import collections
import dataclasses

import jax

from fnscale import _tree

Pair = collections.namedtuple("Pair", "a b")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
  w: object
  extra: object


class Opaque:  # flattened without keys: its children get flat indices
  def __init__(self, a, b):
    self.a, self.b = a, b


jax.tree_util.register_pytree_node(Opaque, lambda o: ((o.a, o.b), None),
                                   lambda _, c: Opaque(*c))


def test_paths_are_slash_joined_keys_indices_and_field_names():
  tree = {"blocks": [{"attn": {"wq": 1}}], "ints": {3: (1, 2)}, "pair": Pair(1, {"k": 2}),
          "block": Block(1, [2]), "opaque": Opaque(1, 2), "s p": 1}
  got = [p for p, _ in _tree.leaves_with_paths(tree)]
  assert got == ["block/w", "block/extra/0", "blocks/0/attn/wq", "ints/3/0", "ints/3/1",
                 "opaque/0", "opaque/1", "pair/a", "pair/b/k", "s p"]
  assert _tree.leaves_with_paths(7) == [("", 7)]
  assert [p for p, _ in _tree.leaves_with_paths({(0, 1): 1, (1, 2): 2})] == ["(0, 1)", "(1, 2)"]
