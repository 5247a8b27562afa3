"""fnscale.checkpoint: sharded save, restore onto other meshes, atomicity and bad input."""
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import fnscale
from fnscale import checkpoint as ckpt
from fnscale import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh(shape, names, n):
  return fnscale.make_mesh(dict(zip(names, shape)), devices=jax.devices()[:n])


def _fsdp_spec(x):
  return P("fsdp") if x.ndim and x.shape[0] % 4 == 0 else P()


def _state(seed=0):
  """An FSDP-sharded train state on 8 devices: params, adamw state (NamedTuples), step."""
  mesh = _mesh((2, 4), ("data", "fsdp"), 8)
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {
      "w": jax.random.normal(k1, (8, 6), jnp.float32),
      "emb": jax.random.normal(k2, (16, 4), jnp.bfloat16),
      "b": jnp.arange(3, dtype=jnp.float32) - 1.5,
  }
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _fsdp_spec(x))), params)
  opt = optax.adamw(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.25, params)
  _, opt_state = opt.update(grads, opt_state, params)  # non-trivial mu, nu and count
  return {"params": params, "opt_state": opt_state, "step": jnp.int32(7 + seed)}


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.itemsize in (1, 2, 4, 8) else x


def _assert_bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(_bits(x), _bits(y))


def _abstract(tree, sharding_fn):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Steps 1 and 2 of two different states, saved from the 8-device mesh."""
  directory = tmp_path_factory.mktemp("ckpt") / "run"
  states = {1: _state(0), 2: _state(1)}
  for step, state in states.items():
    ckpt.save(directory, step, state, extra={"data_position": 100 * step, "config": {"lr": 0.01}})
  return directory, states


def test_restore_onto_two_devices_and_one_device(saved):
  directory, states = saved
  assert ckpt.latest_step(directory) == 2 and ckpt.steps(directory) == (1, 2)

  mesh2 = _mesh((2,), ("fsdp",), 2)
  want2 = lambda x: NamedSharding(mesh2, P("fsdp") if x.ndim and x.shape[0] % 2 == 0 else P())
  state, extra = ckpt.restore(directory, _abstract(states[2], want2))
  _assert_bitwise(state, states[2])
  assert extra == {"data_position": 200, "config": {"lr": 0.01}}
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(states[2])):
    assert got.sharding == want2(ref)
  # optax's NamedTuple states come back as the same types, not dicts or lists.
  assert type(state["opt_state"][0]).__name__ == "ScaleByAdamState"
  assert isinstance(state["opt_state"][0].count, jax.Array)

  one = SingleDeviceSharding(jax.devices()[3])
  state1, extra1 = ckpt.restore(directory, _abstract(states[1], lambda x: one), step=1)
  _assert_bitwise(state1, states[1])
  assert extra1["data_position"] == 100
  assert all(x.sharding == one for x in jax.tree.leaves(state1))


def test_restore_uses_shardings_of_concrete_target_arrays(saved):
  directory, states = saved
  mesh4 = _mesh((4,), ("fsdp",), 4)
  target = jax.tree.map(
      lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), NamedSharding(mesh4, _fsdp_spec(x))),
      states[2])
  state, _ = ckpt.restore(directory, target)
  _assert_bitwise(state, states[2])
  for got, tgt in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
    assert got.sharding == tgt.sharding


def test_restored_state_keeps_training_like_the_original(saved):
  """A restored adamw state gives bitwise the same next update as the saved one."""
  directory, states = saved
  opt = optax.adamw(1e-2)
  mesh8 = _mesh((2, 4), ("data", "fsdp"), 8)
  target = _abstract(states[2], lambda x: NamedSharding(mesh8, _fsdp_spec(x)))
  state, _ = ckpt.restore(directory, target)
  grads = jax.tree.map(lambda x: jnp.full_like(x, -0.5), states[2]["params"])
  ref, _ = opt.update(grads, states[2]["opt_state"], states[2]["params"])
  got, _ = opt.update(grads, state["opt_state"], state["params"])
  _assert_bitwise(got, ref)


def test_keep_prunes_oldest_and_latest_step(tmp_path):
  assert ckpt.latest_step(tmp_path / "absent") is None
  assert ckpt.latest_step(tmp_path) is None and ckpt.steps(tmp_path) == ()
  state = {"x": jnp.arange(4.0)}
  for step in (3, 10, 20, 30):
    out = ckpt.save(tmp_path / "k", step, {"x": state["x"] + step}, keep=2)
    assert out == os.fspath(tmp_path / "k" / str(step))
  assert ckpt.steps(tmp_path / "k") == (20, 30)
  assert sorted(os.listdir(tmp_path / "k")) == ["20", "30"]
  for step in (1, 2, 3):
    ckpt.save(tmp_path / "all", step, state, keep=None)
  assert ckpt.steps(tmp_path / "all") == (1, 2, 3)
  # A lower step than those on disk is still saved (orbax alone would skip it silently).
  ckpt.save(tmp_path / "all", 0, state, keep=None)
  assert ckpt.steps(tmp_path / "all") == (0, 1, 2, 3)


def test_interrupted_save_is_never_restored(tmp_path):
  """A process killed after writing every file but before the commit leaves nothing usable."""
  directory = tmp_path / "run"
  ckpt.save(directory, 1, {"x": jnp.full((8,), 1.0)}, extra={"pos": 1})
  script = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {REPO!r})
      import jax.numpy as jnp
      from orbax.checkpoint._src.path import atomicity
      async def crash(self):  # dies at the worst moment: data written, not committed
        os._exit(17)
      atomicity.AtomicRenameTemporaryPath.finalize = crash
      from fnscale import checkpoint
      checkpoint.save({os.fspath(directory)!r}, 2, {{"x": jnp.full((8,), 2.0)}}, extra={{"pos": 2}})
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        timeout=300, check=False)
  assert proc.returncode == 17, proc.stderr.decode()[-2000:]
  leftovers = sorted(os.listdir(directory))
  assert any(n.startswith("2.orbax-checkpoint-tmp") for n in leftovers), leftovers
  assert ckpt.latest_step(directory) == 1 and ckpt.steps(directory) == (1,)
  target = {"x": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=SingleDeviceSharding(
      jax.devices()[0]))}
  state, extra = ckpt.restore(directory, target)
  np.testing.assert_array_equal(state["x"], np.full((8,), 1.0, np.float32))
  assert extra == {"pos": 1}
  # Saving step 2 again replaces the unfinished attempt (orbax clears it) and commits.
  ckpt.save(directory, 2, {"x": jnp.full((8,), 2.0)})
  assert ckpt.latest_step(directory) == 2
  assert sorted(os.listdir(directory)) == ["1", "2"]


def _damage(step_dir, how):
  if how == "no_commit_marker":
    os.remove(step_dir / "commit_success.txt")
  elif how == "deleted_data":
    for name in os.listdir(step_dir / "state" / "d"):
      os.remove(step_dir / "state" / "d" / name)
  elif how == "truncated_data":
    for name in os.listdir(step_dir / "state" / "d"):
      path = step_dir / "state" / "d" / name
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
  elif how == "truncated_array_file":
    # The arrays live in the OCDBT store's data files; the metadata stays intact.
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir / "state") for f in fs
             if f"{os.sep}ocdbt.process_" in r and f"{os.sep}d" in r]
    assert files, "no OCDBT data files found"
    for path in files:
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
  elif how == "no_tree_metadata":
    os.remove(step_dir / "state" / "_METADATA")
  elif how == "no_extra":
    os.remove(step_dir / "extra" / "metadata")


def _listing(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return sorted((os.path.relpath(f, directory), os.path.getsize(f)) for f in files)


@pytest.mark.parametrize(
    "how", ["no_commit_marker", "deleted_data", "truncated_data", "no_tree_metadata", "no_extra"])
def test_corrupt_latest_is_refused_and_previous_used(tmp_path, how, caplog):
  directory = tmp_path / "run"
  for step in (1, 2):
    ckpt.save(directory, step, {"x": jnp.full((4, 2), float(step))}, extra={"step": step})
  _damage(directory / "2", how)
  before = _listing(directory)
  target = {"x": jax.ShapeDtypeStruct((4, 2), jnp.float32,
                                       sharding=SingleDeviceSharding(jax.devices()[0]))}
  with caplog.at_level("WARNING"):
    state, extra = ckpt.restore(directory, target)
  np.testing.assert_array_equal(state["x"], np.full((4, 2), 1.0, np.float32))
  assert extra == {"step": 1}
  warned = " ".join(r.getMessage() for r in caplog.records)
  assert "step 2" in warned and os.fspath(directory / "2") in warned
  with pytest.raises(CheckpointError, match=r"checkpoint step 2 at .*run/2 is (corrupt|incompl)"):
    ckpt.restore(directory, target, step=2)
  assert _listing(directory) == before  # nothing overwritten or deleted

  # Saving step 2 again moves the damaged one aside (kept for inspection), then commits.
  ckpt.save(directory, 2, {"x": jnp.full((4, 2), 5.0)})
  aside = [n for n in os.listdir(directory) if n.startswith("2.corrupt-")]
  assert len(aside) == 1
  state, _ = ckpt.restore(directory, target)
  np.testing.assert_array_equal(state["x"], np.full((4, 2), 5.0, np.float32))


def test_damaged_array_data_is_refused_then_moved_aside_by_the_next_save(tmp_path):
  # Metadata intact, array bytes truncated: only reading the arrays finds it. A run that
  # resumed from step 1 must be able to save step 2 again (not be refused forever).
  directory = tmp_path / "run"
  values = {s: jax.random.normal(jax.random.key(s), (256, 256)) for s in (1, 2, 3)}
  for step in (1, 2):
    ckpt.save(directory, step, {"x": values[step]})
  _damage(directory / "2", "truncated_array_file")
  target = {"x": jax.ShapeDtypeStruct((256, 256), jnp.float32,
                                       sharding=SingleDeviceSharding(jax.devices()[0]))}
  state, _ = ckpt.restore(directory, target)
  np.testing.assert_array_equal(state["x"], values[1])
  ckpt.save(directory, 2, {"x": values[3]})
  assert len([n for n in os.listdir(directory) if n.startswith("2.corrupt-")]) == 1
  state, _ = ckpt.restore(directory, target)
  np.testing.assert_array_equal(state["x"], values[3])


def test_no_good_checkpoint_lists_every_refused_step(tmp_path):
  directory = tmp_path / "run"
  for step in (1, 2):
    ckpt.save(directory, step, {"x": jnp.ones(3)})
  _damage(directory / "1", "no_commit_marker")
  _damage(directory / "2", "no_tree_metadata")
  target = {"x": jax.ShapeDtypeStruct((3,), jnp.float32,
                                       sharding=SingleDeviceSharding(jax.devices()[0]))}
  with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*step 2 at .*: corrupt: "
                     r"its tree metadata can't be read.*step 1 at .*commit marker is missing"):
    ckpt.restore(directory, target)
  assert ckpt.latest_step(directory) is None


def test_existing_complete_step_is_never_overwritten(saved):
  directory, states = saved
  with pytest.raises(CheckpointError, match=r"complete checkpoint for step 2 already exists at "
                     r".*run/2; fnscale never overwrites"):
    ckpt.save(directory, 2, states[1])


def test_target_that_does_not_match_names_each_leaf(saved):
  directory, states = saved
  one = SingleDeviceSharding(jax.devices()[0])
  target = _abstract(states[2], lambda x: one)
  target["params"]["w"] = jax.ShapeDtypeStruct((8, 5), jnp.float32, sharding=one)
  target["params"]["b"] = jax.ShapeDtypeStruct((3,), jnp.int32, sharding=one)
  with pytest.raises(CheckpointError) as e:
    ckpt.restore(directory, target)
  msg = str(e.value)
  assert "checkpoint step 2 at" in msg and "doesn't fit the target" in msg
  assert "params.w: saved (8, 6) float32, target expects (8, 5) float32" in msg
  assert "params.b: saved (3,) float32, target expects (3,) int32" in msg

  target = _abstract(states[2], lambda x: one)
  del target["params"]["emb"]
  target["params"]["extra_bias"] = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=one)
  with pytest.raises(CheckpointError) as e:
    ckpt.restore(directory, target, step=1)
  msg = str(e.value)
  assert "params.extra_bias: in the target ((2,) float32) but not in the checkpoint" in msg
  assert "params.emb: in the checkpoint ((16, 4) bfloat16) but not in the target" in msg


def test_missing_directory_and_missing_step(saved, tmp_path):
  one = SingleDeviceSharding(jax.devices()[0])
  target = {"x": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=one)}
  with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist.*"
                     r"latest_step returns None"):
    ckpt.restore(tmp_path / "nowhere", target)
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match=r"no checkpoint in .*empty \(no step directories\)"):
    ckpt.restore(tmp_path / "empty", target)
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match=r"checkpoint path .*file is a file, not a directory"):
    ckpt.latest_step(tmp_path / "file")
  directory, states = saved
  with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 in .*run; complete steps "
                     r"there: \[1, 2\]"):
    ckpt.restore(directory, _abstract(states[2], lambda x: one), step=5)


def test_bad_arguments_are_named(tmp_path):
  one = SingleDeviceSharding(jax.devices()[0])
  state = {"x": jnp.ones(2)}
  with pytest.raises(CheckpointError, match=r"extra\['pos'\] = .*array.* is not JSON"):
    ckpt.save(tmp_path, 1, state, extra={"pos": np.arange(2)})
  with pytest.raises(CheckpointError, match=r"extra must be a dict"):
    ckpt.save(tmp_path, 1, state, extra=[1, 2])
  with pytest.raises(CheckpointError, match=r"step must be a non-negative int, got -1"):
    ckpt.save(tmp_path, -1, state)
  with pytest.raises(CheckpointError,
                     match=r"keep must be a positive int or None \(keep all\), got 0"):
    ckpt.save(tmp_path, 1, state, keep=0)
  with pytest.raises(CheckpointError, match=r"state leaf layers.0.name is a str"):
    ckpt.save(tmp_path, 1, {"layers": [{"name": "mlp", "w": jnp.ones(2)}]})
  with pytest.raises(CheckpointError, match=r"state leaf rng is a typed PRNG key"):
    ckpt.save(tmp_path, 1, {"rng": jax.random.key(0)})
  donated = jnp.ones(2)
  jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
  with pytest.raises(CheckpointError, match=r"state leaf x has been deleted \(donated to a "
                     r"jitted step\?\)"):
    ckpt.save(tmp_path, 1, {"x": donated})
  assert ckpt.latest_step(tmp_path) is None  # nothing was written
  ckpt.save(tmp_path, 1, state)
  with pytest.raises(CheckpointError, match=r"target leaf x \(\(2,\) float32\) has no sharding"):
    ckpt.restore(tmp_path, {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
  with pytest.raises(CheckpointError, match=r"target leaf x is a ndarray; expected "
                     r"jax.ShapeDtypeStruct"):
    ckpt.restore(tmp_path, {"x": np.ones(2, np.float32)})
  state2, extra = ckpt.restore(tmp_path, {"x": jax.ShapeDtypeStruct((2,), jnp.float32,
                                                                     sharding=one)})
  np.testing.assert_array_equal(state2["x"], np.ones(2, np.float32))
  assert extra == {}


def test_without_orbax_says_how_to_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # makes the import fail
  with pytest.raises(CheckpointError, match=r"pip install fnscale\[checkpoint\]"):
    ckpt.latest_step(tmp_path)


def test_custom_pytree_nodes_and_a_bare_array(tmp_path):
  """jmp loss scales and NamedTuples round-trip; so does a state that is one array."""
  import jmp  # pylint: disable=import-outside-toplevel
  one = SingleDeviceSharding(jax.devices()[1])
  state = {"loss_scale": jmp.DynamicLossScale(jnp.float32(2.0 ** 15), jnp.int32(17)),
           "w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)}
  ckpt.save(tmp_path / "a", 3, state)
  restored, _ = ckpt.restore(tmp_path / "a", _abstract(state, lambda x: one))
  assert isinstance(restored["loss_scale"], jmp.DynamicLossScale)
  _assert_bitwise(restored, state)
  ckpt.save(tmp_path / "b", 0, jnp.arange(5))
  bare, _ = ckpt.restore(tmp_path / "b", jax.ShapeDtypeStruct((5,), jnp.int32, sharding=one))
  np.testing.assert_array_equal(bare, np.arange(5))


def _one(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(jax.devices()[0]))


def test_nonfinite_state_is_never_saved_unless_allowed(tmp_path):
  good = {"w": jnp.ones((4, 4)), "step": jnp.int32(1)}
  bad = {"w": jnp.ones((4, 4)).at[2, 3].set(jnp.nan), "step": jnp.int32(1)}
  with pytest.raises(CheckpointError, match=r"not saving step 1: state leaf w holds NaN or inf;"
                     r".*allow_nonfinite=True"):
    ckpt.save(tmp_path / "a", 1, bad)
  mixed = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.array([1.0, jnp.inf]),
           "c": np.array([np.nan]), "n": jnp.arange(3)}
  with pytest.raises(CheckpointError, match=r"state leaf b holds NaN or inf \(and 1 more leaves\)"):
    ckpt.save(tmp_path / "a", 1, mixed)
  assert ckpt.nonfinite_leaves(mixed) == ["b", "c"]
  assert ckpt.steps(tmp_path / "a") == ()  # nothing was written
  assert bool(ckpt.all_finite(good)) and not bool(jax.jit(ckpt.all_finite)(mixed))
  # Edge values: the largest finite floats, an empty leaf and complex parts near the float32
  # limit are finite; -inf, and a NaN in either part of a complex, are not.
  big = jnp.finfo(jnp.float32).max
  edges = {"big": jnp.array([big, -big]), "empty": jnp.zeros((0, 3)),
           "bf16": jnp.array([jnp.finfo(jnp.bfloat16).max], jnp.bfloat16),
           "z": jnp.array([big + 1j * big], jnp.complex64)}
  assert ckpt.nonfinite_leaves(edges) == [] and bool(jax.jit(ckpt.all_finite)(edges))
  worse = dict(edges, big=jnp.array([1.0, -jnp.inf]), z=jnp.array([1 + 1j * jnp.nan]))
  assert ckpt.nonfinite_leaves(worse) == ["big", "z"]
  assert not bool(ckpt.all_finite({"z": worse["z"]})) and not bool(ckpt.all_finite(worse))

  directory = tmp_path / "run"
  with ckpt.manager(directory, keep=2) as m:
    ckpt.save(m, 1, good)
    for step in (2, 3, 4):
      ckpt.save(m, step, bad, allow_nonfinite=True)
  # orbax's LatestN(2) keeps 3 and 4; the newest finite step, 1, stays as well.
  assert ckpt.steps(directory) == (1, 3, 4)
  with ckpt.manager(directory, keep=2) as m:  # a new run reads the verdicts from disk
    ckpt.save(m, 5, bad, allow_nonfinite=True)
  assert ckpt.steps(directory) == (1, 4, 5)
  assert ckpt.latest_step(directory) == 1
  state, _ = ckpt.restore(directory, jax.tree.map(_one, good))
  _assert_bitwise(state, good)
  kept, _ = ckpt.restore(directory, jax.tree.map(_one, good), step=5)  # named: for inspection
  assert np.isnan(np.asarray(kept["w"])[2, 3]) and np.isfinite(np.asarray(kept["w"])).sum() == 15


def test_all_finite_reading_each_param_with_its_moments_finds_every_nan_and_inf():
  """`all_finite(tree, like=params)` combines the equal-shaped leaves at one place of the
  subtrees shaped as the params (moments in bfloat16 and float32; a factored moment of
  another shape; a complex leaf; an empty one; an integer count): a NaN, inf or -inf in
  any element of any floating leaf is found, and the largest finite values are finite."""
  big = np.finfo(np.float32).max
  params = {"b": np.array([1.0, -big, 0.5], np.float32), "w": np.ones((2, 3), np.float32)}
  state = {"params": params, "count": np.int32(3), "loss": np.float32(2.0),
           "mu": {"b": np.zeros(3, jnp.bfloat16), "w": np.full((2, 3), -2, jnp.bfloat16)},
           "nu": {"b": np.full(3, big, np.float32), "w": np.zeros((2, 3), np.float32)},
           "row": {"b": np.zeros(3, np.float32), "w": np.ones(2, np.float32)},  # factored
           "z": np.array([1 + 1j * big], np.complex64), "empty": np.zeros((0, 2), np.float32)}
  finite = jax.jit(lambda s: ckpt.all_finite(s, like=s["params"]))
  assert bool(finite(state))
  flat, treedef = jax.tree.flatten(state)
  checked = 0
  for i, leaf in enumerate(flat):
    if not jnp.issubdtype(np.asarray(leaf).dtype, jnp.inexact):
      continue
    for place in range(np.asarray(leaf).size):
      for bad in (np.nan, np.inf, -np.inf, 1j * np.nan):
        if np.iscomplexobj(bad) and not np.iscomplexobj(leaf):
          continue
        broken = np.array(leaf).copy().reshape(-1)
        broken[place] = bad
        tree = jax.tree.unflatten(treedef, [*flat[:i], broken.reshape(np.shape(leaf)),
                                            *flat[i + 1:]])
        assert not bool(finite(tree)), (jax.tree_util.keystr(
            jax.tree_util.tree_flatten_with_path(state)[0][i][0]), place, bad)
        checked += 1
  assert checked == (3 * (3 + 6) + 3 + 2 + 1) * 3 + 4  # params, mu, nu; row; loss; z
  # A params tree of one leaf: every floating leaf read alone (nothing to group by).
  assert not bool(ckpt.all_finite({"p": np.ones(2), "m": np.array([1, np.nan])},
                                  like=np.ones(2)))


def test_all_finite_reads_moments_in_the_hosts_memory_apart_from_the_params():
  """An optimizer state offloaded to the host's memory (train_lm's --optimizer_offload) is
  read apart from the params in the device's: combining the two raised jax's "memory_space
  of all inputs passed to `max` must be the same"."""
  host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  params = {"b": jnp.zeros(3), "w": jnp.ones((2, 3))}
  finite = jax.jit(lambda s: ckpt.all_finite(s, like=s["params"]))
  good = jax.device_put({"b": jnp.zeros(3), "w": jnp.ones((2, 3))}, host)
  assert bool(finite({"params": params, "mu": good}))
  bad = jax.device_put({"b": jnp.zeros(3), "w": jnp.ones((2, 3)).at[1, 2].set(jnp.inf)}, host)
  assert not bool(finite({"params": params, "mu": bad}))


@pytest.mark.slow
def test_async_save_blocks_the_loop_less_than_a_synchronous_save(tmp_path):
  """256 MiB on 8 devices: the synchronous save (write and commit) against the time an async
  save keeps the loop (finiteness check, copy to host); the loop computes while it writes."""
  mesh = _mesh((8,), ("fsdp",), 8)
  make = jax.jit(lambda: jnp.arange(8192 * 8192, dtype=jnp.float32).reshape(8192, 8192),
                 out_shardings=NamedSharding(mesh, P("fsdp")))
  state = {"w": make()}
  assert state["w"].nbytes == 256 * 2**20
  want = {"w": np.arange(8192 * 8192, dtype=np.float32).reshape(8192, 8192)}
  ckpt.nonfinite_leaves(state)  # compiled once, outside both timings
  t = time.perf_counter()
  ckpt.save(tmp_path / "sync", 1, state)
  sync_s = time.perf_counter() - t
  step = jax.jit(lambda s: {"w": s["w"] + 1.0}, donate_argnums=0)
  with ckpt.manager(tmp_path / "async") as m:
    t = time.perf_counter()
    ckpt.save(m, 1, state)
    blocked_s = time.perf_counter() - t
    in_flight = m.orbax.is_saving_in_progress()
    for _ in range(3):  # the loop goes on, donating the saved state's buffers
      state = jax.block_until_ready(step(state))
  print(f"256 MiB: synchronous save {sync_s:.2f} s, async save blocked {blocked_s:.2f} s "
        f"(ratio {blocked_s / sync_s:.3f})")
  assert in_flight
  assert blocked_s < 0.5 * sync_s
  target = {"w": jax.ShapeDtypeStruct((8192, 8192), jnp.float32,
                                      sharding=NamedSharding(_mesh((2,), ("fsdp",), 2), P("fsdp")))}
  for name in ("sync", "async"):
    restored, _ = ckpt.restore(tmp_path / name, target)
    _assert_bitwise(restored, want)  # the values at the save, not the later ones


def test_manager_rotation_never_overwrites_and_keeps_a_period(tmp_path):
  directory = tmp_path / "run"
  with ckpt.manager(directory, keep=1, keep_period=4) as m:
    for step in range(1, 10):
      ckpt.save(m, step, {"x": jnp.full((3,), float(step))})
    # The save of 9 is in flight: saving it again waits for its commit, then refuses.
    with pytest.raises(CheckpointError, match=r"complete checkpoint for step 9 already exists"):
      ckpt.save(m, 9, {"x": jnp.zeros(3)})
    with pytest.raises(CheckpointError, match=r"keep= belongs to the Manager"):
      ckpt.save(m, 10, {"x": jnp.zeros(3)}, keep=5)
  assert ckpt.steps(directory) == (4, 8, 9)  # EveryNSteps(4) keeps 4 and 8, LatestN(1) 9
  state, _ = ckpt.restore(directory, {"x": _one(jnp.zeros(3))})
  np.testing.assert_array_equal(state["x"], np.full((3,), 9.0, np.float32))
  with ckpt.manager(directory, read_only=True) as ro:
    with pytest.raises(CheckpointError, match=r"read-only"):
      ckpt.save(ro, 11, {"x": jnp.zeros(3)})
  with pytest.raises(CheckpointError, match=r"keep_period must be a positive int"):
    ckpt.manager(directory, keep_period=0)
  with pytest.raises(CheckpointError, match=r"close takes the Manager that fnscale.checkpoint."
                     r"manager\(...\) returned, got a str"):
    ckpt.close(str(directory))
  assert ckpt.steps(directory) == (4, 8, 9)


def test_last_save_seconds_is_orbax_s_start_to_commit_time(tmp_path):
  assert ckpt.last_save_seconds(tmp_path / "none") is None
  t = time.perf_counter()
  ckpt.save(tmp_path, 3, {"x": jnp.ones((512, 512))})
  wall = time.perf_counter() - t
  step, seconds = ckpt.last_save_seconds(tmp_path)
  assert step == 3 and 0 < seconds <= wall


def test_data_position_needs_one_saved_with_the_step(tmp_path):
  grain = pytest.importorskip("grain")
  it = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
  ckpt.save(tmp_path, 1, {"x": jnp.ones(2)})
  with pytest.raises(CheckpointError, match=r"step 1 at .* holds no data position \(saved "
                     r"without data=\)"):
    ckpt.restore(tmp_path, {"x": _one(jnp.ones(2))}, data=it)
  with pytest.raises(CheckpointError, match=r"data is a list.*expected a grain iterator"):
    ckpt.save(tmp_path, 2, {"x": jnp.ones(2)}, data=[1, 2])
  next(it), next(it)
  ckpt.save(tmp_path, 2, {"x": jnp.ones(2)}, data=it)
  fresh = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
  ckpt.restore(tmp_path, {"x": _one(jnp.ones(2))}, data=fresh)
  assert fresh.get_state() == {"next_index": 2}
  np.testing.assert_array_equal(next(fresh), np.arange(8, 12))
