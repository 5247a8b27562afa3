"""Rows per process (`fnscale.process_rows`) and the check of rows the mesh replicates across
processes (`fnscale.global_batch`, `fnscale.multihost.check_batch_replicas`): hand counts
of each mesh's rows on 8 devices, a 2-process job of tests/rows_worker.py, and (slow) whole
training jobs of tests/mp_worker.py against the one-process run."""
import pathlib
import sys

import jax
import numpy as np
import pytest

import fnscale as fs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize("axes", [{"data": 8}, {"tensor": 8}, {"data": 2, "tensor": 4}])
def test_one_process_feeds_every_row(axes):
  sh = fs.batch_sharding(fs.make_mesh(axes))
  np.testing.assert_array_equal(fs.process_rows(sh, 16), np.arange(16))
  whole = np.arange(32).reshape(16, 2)
  out = fs.global_batch(whole[fs.process_rows(sh, 16)], sh, check=True)
  np.testing.assert_array_equal(np.asarray(out), whole)


def test_process_rows_refuses_a_batch_the_shards_dont_divide():
  sh = fs.batch_sharding(fs.make_mesh({"data": 8}))
  with pytest.raises(fs.ShardingError, match=r"12 rows does not split over the 8 shards.*"
                     r"multiple of 8"):
    fs.process_rows(sh, 12)
  with pytest.raises(fs.ShardingError, match="not a NamedSharding"):
    fs.process_rows(jax.sharding.SingleDeviceSharding(jax.devices()[0]), 8)


def test_check_needs_global_arrays():
  with pytest.raises(fs.DistributedArgumentError, match="leaf 'x' is ndarray"):
    fs.multihost.check_batch_replicas({"x": np.zeros(2)})


@pytest.mark.multiprocess
def test_two_processes_feed_their_devices_rows_and_a_split_replica_is_named(tmp_path):
  """2 processes x 4 devices: each process's rows by hand (process 0 holds devices 0-3), the
  global array equal to the whole one; per-process halves on {"tensor": 8}, a layout not fed
  before, refused by the default check on both processes with the rows and the fix named
  (a check on a process's first call only let them through); rows that differ from a later
  call on refused at the next multiple of check_every."""
  results = mp.run([str(HERE / "rows_worker.py")], 2, 4, 120, log_dir=tmp_path)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  half = [list(range(8)), list(range(8, 16))]
  want = {"data=2,tensor=4": half, "tensor=8": [list(range(16))] * 2, "fsdp=8": half,
          "tensor=4,data=2": [list(range(16))] * 2}
  for r in results:
    lines = mp.records(r.stdout)
    for ln in lines[:-2]:
      name = ",".join(f"{k}={v}" for k, v in ln["mesh"].items())
      assert ln["rows"] == want[name][r.process_id], (name, ln)
      assert ln["shape"] == [16, 3] and ln["equal"], ln
    err = lines[-2]["halves"]
    assert "processes fed different values for rows the mesh replicates" in err, err
    assert "batch leaf x rows 0-8: process(es) 1 hold other values than process 0" in err
    assert "fnscale.process_rows(sharding, global_rows)" in err
    # The worker's calls: 4 meshes and the halves (k = 0-4), the new layout checked at k = 5;
    # rolled rows from k = 6: unchecked at 6 and 7, refused at 8 (a multiple of 4).
    rolled = lines[-1]
    assert rolled["rolled"] == 3, rolled
    assert "batch leaf x rows 0-16: process(es) 1 hold other values than process 0" in (
        rolled["error"] or ""), rolled


STEPS = 2


MODEL = "heads8"  # 8 heads and vocab 64, mlp 64: a tensor=8 mesh divides every split dim


def _reference(mesh_axes: str):
  """The same training in this process on 1 x 8 devices, whole batches: losses, params."""
  import mp_worker  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  mesh, _, step, init = mp_worker.build(mesh_axes, MODEL)
  state, bs, losses = init(), fs.batch_sharding(mesh), []
  for s in range(STEPS):
    cfg = models.TRANSFORMER._replace(**mp_worker.MODELS[MODEL])
    tokens = mp_worker.global_tokens(s, 16, cfg.seq, cfg.vocab)
    state, metrics = step(state, fs.global_batch({"tokens": tokens}, bs))
    losses.append(float(metrics["loss"]))
  return losses, mp_worker.gathered_params(state.params)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_axes", ["data=2,tensor=4", "tensor=8", "fsdp=8"])
def test_training_on_two_processes_equals_the_whole_batch_run(mesh_axes, tmp_path):
  """2 processes x 4 devices feeding `process_rows` train exactly as one process fed whole
  batches (losses and params to 1e-6), on a mesh that splits the batch across processes, one
  that replicates it and one that splits it over FSDP."""
  results = mp.run([str(HERE / "mp_worker.py"), f"--out={tmp_path}", f"--steps={STEPS}",
                    f"--mesh={mesh_axes}", f"--model={MODEL}"], 2, 4, 300)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  losses, params = _reference(mesh_axes)
  for r in results:
    got = [e["loss"] for e in mp.records(r.stdout) if e["event"] == "step"]
    np.testing.assert_allclose(got, losses, rtol=0, atol=1e-6)
  final = dict(np.load(tmp_path / "params.npz"))
  assert sorted(final) == sorted(params)
  # Adam divides by the gradient's running RMS: a summation-order difference on a gradient
  # near zero moves that element's update by up to ~1e-5 (seen: 1.3e-5 on 1 of 2048). Rows
  # fed wrong change the losses above and every param by ~lr = 3e-3.
  for k in final:
    np.testing.assert_allclose(final[k], params[k], rtol=0, atol=1e-4, err_msg=k)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_process_halves_on_a_replicated_batch_stop_both_processes(tmp_path):
  """The bug this guards against: each process feeds its half of the batch while the mesh
  ({"tensor": 8}) replicates the batch across processes. Both processes stop at the first
  batch (exit 75) with the error naming the fix, before any step runs."""
  results = mp.run([str(HERE / "mp_worker.py"), f"--out={tmp_path}", "--steps=2",
                    "--mesh=tensor=8", "--rows=halves", f"--model={MODEL}"], 2, 4, 300)
  for r in results:
    assert r.returncode == 75, mp.describe(results)
    assert "processes fed different values for rows the mesh replicates" in r.stderr
    assert '"event": "step"' not in r.stdout
