"""shard_step compiles a born-sharded state in the shardings it carries (8 CPU devices)."""
import jax
import optax
import pytest

import fnscale
import models

RULES = (("mlp", "tensor"), ("embed", "fsdp"))


def _setup(abstract=False):
  mesh = fnscale.make_mesh("data=2,fsdp=2,tensor=2")
  opt = optax.adam(1e-2)
  state = fnscale.init_state(models.mlp_init, opt, mesh=mesh, rules=RULES,
                             logical_axes=models.mlp_logical_axes(), key=jax.random.key(0),
                             abstract=abstract)
  return mesh, opt, state, fnscale.train_step(models.mlp_loss, opt)


def _specs(tree):
  return [tuple(x.sharding.spec) for x in jax.tree.leaves(tree)]


def test_state_born_sharded_compiles_in_its_shardings():
  mesh, _, state, step = _setup()
  # The carried w1 sharding is the rules' ("embed" -> fsdp, "mlp" -> tensor), which the
  # automatic FSDP a rule-less derivation gives is not: a re-deriving step would reshard.
  assert tuple(state.params["w1"].sharding.spec) == ("fsdp", "tensor")
  derived = fnscale.state_shardings(state, mesh)
  assert tuple(derived.params["w1"].spec) != ("fsdp", "tensor")
  batch = models.mlp_batch(jax.random.key(1), 16)
  compiled = fnscale.shard_step(step, mesh).compile(state, batch)
  in_state, _ = compiled.compiled.input_shardings[0]
  out_state, _ = compiled.compiled.output_shardings
  want = [x.sharding for x in jax.tree.leaves(state)]
  for got_in, got_out, w, leaf in zip(jax.tree.leaves(in_state), jax.tree.leaves(out_state),
                                      want, jax.tree.leaves(state)):
    assert got_in.is_equivalent_to(w, leaf.ndim) and got_out.is_equivalent_to(w, leaf.ndim)
  before = _specs(state)
  new_state, _ = compiled(state, batch)
  assert _specs(new_state) == before


def test_abstract_state_shardings_flow_too():
  mesh, _, abstract, step = _setup(abstract=True)
  batch = jax.eval_shape(lambda: models.mlp_batch(jax.random.key(1), 16))
  ssh, _ = fnscale.shard_step(step, mesh).shardings(abstract, batch)
  assert [tuple(s.spec) for s in jax.tree.leaves(ssh)] == [
      tuple(x.sharding.spec) for x in jax.tree.leaves(abstract)]


def test_same_rules_passed_again_still_accepted():
  mesh, opt, state, step = _setup()
  batch = models.mlp_batch(jax.random.key(1), 16)
  ssh, _ = fnscale.shard_step(step, mesh, rules=RULES, logical_axes=models.mlp_logical_axes(),
                              optimizer=opt).shardings(state, batch)
  assert [tuple(s.spec) for s in jax.tree.leaves(ssh)] == _specs(state)


def test_rules_that_disagree_with_the_state_are_named():
  mesh, _, state, step = _setup()
  batch = models.mlp_batch(jax.random.key(1), 16)
  other = (("mlp", "fsdp"), ("embed", "tensor"))
  with pytest.raises(fnscale.ShardingError, match=r"state leaf 'b1'.*\('tensor',\).*rules"):
    fnscale.shard_step(step, mesh, rules=other,
                       logical_axes=models.mlp_logical_axes()).shardings(state, batch)
  # Options alone (automatic FSDP over "tensor") disagree too: b1 is the first leaf.
  with pytest.raises(fnscale.ShardingError, match=r"state leaf 'b1'.*give \(\)"):
    fnscale.shard_step(step, mesh, sharding_options={"fsdp_axis": "tensor"}).shardings(
        state, batch)


def test_numpy_state_leaves_are_still_derived_from_the_rules():
  mesh, _, state, step = _setup()
  host = jax.device_get(state)  # numpy leaves carry no sharding
  batch = models.mlp_batch(jax.random.key(1), 16)
  ssh, _ = fnscale.shard_step(step, mesh, rules=RULES,
                              logical_axes=models.mlp_logical_axes()).shardings(host, batch)
  assert [tuple(s.spec) for s in jax.tree.leaves(ssh)] == _specs(state)


def test_one_compile_derives_the_state_shardings_once(monkeypatch):
  # Counted where they are defined: `fnscale._state.state_shardings` (the whole state) and
  # `fnscale._sharding.shardings` (a tree's leaves; here the params, the state has no
  # frozen params). One compile with numpy leaves (nothing carried, all derived) calls each
  # once; the first call of a ShardedStep compiles once too.
  from fnscale import _sharding, _state
  mesh, opt, state, step = _setup()
  host = jax.device_get(state)
  batch = models.mlp_batch(jax.random.key(1), 16)
  calls = {"state": 0, "tree": 0}

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return wrapper
  monkeypatch.setattr(_state, "state_shardings", counted("state", _state.state_shardings))
  monkeypatch.setattr(_sharding, "shardings", counted("tree", _sharding.shardings))
  sharded = fnscale.shard_step(step, mesh, rules=RULES, logical_axes=models.mlp_logical_axes(),
                               optimizer=opt)
  compiled = sharded.compile(host, batch)
  assert calls == {"state": 1, "tree": 1}
  assert [tuple(s.spec) for s in jax.tree.leaves(compiled.state_shardings)] == _specs(state)
  calls.update(state=0, tree=0)
  sharded(state, batch)
  assert calls == {"state": 1, "tree": 1}
