"""Multi-process helpers: single-process no-ops, global_batch, and a real 2-process job."""
import contextlib
import http.server
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fnscale as fs
from fnscale.multihost import _agreement
from fnscale.multihost import _cluster as fsd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position
from local_server import serving  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[1]
AUTO = jax.sharding.AxisType.Auto
LAUNCHER_VARS = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NPROCS",
                 "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                 "MEGASCALE_NUM_SLICES")


@pytest.fixture
def clean_env(monkeypatch):
  for v in LAUNCHER_VARS:
    monkeypatch.delenv(v, raising=False)
  return monkeypatch


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AUTO, AUTO))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# ------------------------------------------------------------------------- one process


def test_initialize_noop_single_process(clean_env):
  assert fs.initialize() == fs.multihost.DistributedInfo(0, 1, None, False)
  assert fs.initialize(num_processes=1) == fs.multihost.DistributedInfo(0, 1, None, False)
  assert fs.initialize("127.0.0.1:1234", 1, 0) == fs.multihost.DistributedInfo(0, 1, None, False)
  assert not jax.distributed.is_initialized()


def test_launcher_detection(clean_env):
  assert fsd._multiprocess_env() is None
  clean_env.setenv("SLURM_JOB_ID", "7")
  clean_env.setenv("SLURM_NTASKS", "1")
  assert fsd._multiprocess_env() is None  # a one-task SLURM job is single-process
  clean_env.setenv("SLURM_NTASKS", "4")
  assert fsd._multiprocess_env() == "SLURM"
  clean_env.delenv("SLURM_JOB_ID")
  clean_env.setenv("TPU_WORKER_HOSTNAMES", "h0")
  assert fsd._multiprocess_env() is None
  clean_env.setenv("TPU_WORKER_HOSTNAMES", "h0,h1")
  assert fsd._multiprocess_env().startswith("TPU pod")


def test_initialize_bad_arguments(clean_env):
  """Bad arguments are bad input (an InputError, a ValueError), not a failed job."""
  calls = {
      r"process_id=2, expected an int in \[0, 2\)": ("127.0.0.1:1234", 2, 2),
      r"num_processes=0, expected a positive int": ("127.0.0.1:1234", 0, 0),
      r"coordinator_address='localhost', expected": ("localhost", 2, 0),
  }
  for match, args in calls.items():
    with pytest.raises(fs.DistributedArgumentError, match=match) as e:
      fs.initialize(*args)
    assert isinstance(e.value, (fs.InputError, ValueError)), match
    assert not isinstance(e.value, (fs.DistributedError, fs.RuntimeFailure)), match
  with pytest.raises(fs.DistributedArgumentError, match=r"timeout_s=0, expected a positive"):
    fs.initialize("127.0.0.1:1234", 2, 0, timeout_s=0)


def test_numpy_integer_ids_are_the_ints_they_are(clean_env):
  info = fs.initialize(None, np.int32(1), np.int64(0))
  assert info == fs.multihost.DistributedInfo(0, 1, None, False)
  assert type(info.process_id) is int and type(info.num_processes) is int
  with pytest.raises(fs.DistributedArgumentError,
                     match=r"process_id=2, expected an int in \[0, 2\)"):
    fs.initialize("127.0.0.1:1234", np.int64(2), np.int64(2))
  for bad in (True, np.bool_(False), 1.0):
    with pytest.raises(fs.DistributedArgumentError, match=r"process_id=.*expected an int"):
      fs.initialize("127.0.0.1:1234", 2, bad)


def test_initialize_after_backend_is_a_clear_error(clean_env):
  jax.devices()  # the backend is up, as it is in any process that already used jax
  with pytest.raises(fs.DistributedError,
                     match=r"after jax initialised its backend.*2-process job at "
                     r"127.0.0.1:1234.*call fnscale.initialize at the very start"):
    fs.initialize("127.0.0.1:1234", 2, 0)
  # A detected launcher takes the same path.
  clean_env.setenv("SLURM_JOB_ID", "7")
  clean_env.setenv("SLURM_NTASKS", "2")
  with pytest.raises(fs.DistributedError, match=r"after jax initialised its backend"):
    fs.initialize()
  assert not jax.distributed.is_initialized()


def test_barrier_single_process():
  fs.barrier("one")  # returns at once
  with pytest.raises(fs.DistributedArgumentError, match=r"barrier name '', expected a non-"):
    fs.barrier("")
  with pytest.raises(fs.DistributedArgumentError, match=r"barrier timeout_s=-1, expected a "):
    fs.barrier("x", timeout_s=-1)
  with pytest.raises(fs.DistributedArgumentError, match=r"peer_guard timeout_s=0, expected a "):
    with fs.multihost.peer_guard(timeout_s=0):
      pass


def test_global_batch_single_process(mesh):
  local = {"tokens": np.arange(16 * 5, dtype=np.int32).reshape(16, 5),
           "mask": np.ones((16,), np.float32)}
  s = fs.batch_sharding(mesh)
  g = fs.global_batch(local, s)
  for k in local:
    np.testing.assert_array_equal(np.asarray(g[k]), local[k])
    assert g[k].sharding == s and g[k].shape == local[k].shape
  # Rows are split over data x fsdp: each device holds 2 consecutive rows.
  shard = next(sh for sh in g["tokens"].addressable_shards if sh.device == mesh.devices[1, 2])
  np.testing.assert_array_equal(np.asarray(shard.data), local["tokens"][12:14])
  # A pytree of shardings, including a 2-D one.
  s2 = {"tokens": NamedSharding(mesh, P("data", "fsdp")), "mask": s}
  local2 = {"tokens": np.arange(32, dtype=np.float32).reshape(4, 8), "mask": local["mask"]}
  g2 = fs.global_batch(local2, s2)
  np.testing.assert_array_equal(np.asarray(g2["tokens"]), local2["tokens"])
  assert g2["tokens"].sharding == s2["tokens"]


def test_global_batch_bad_shapes(mesh):
  s = fs.batch_sharding(mesh)
  with pytest.raises(fs.ShardingError) as e:
    fs.global_batch({"x": np.zeros((12, 3))}, s)
  msg = str(e.value)
  assert msg.startswith("batch not divisible by the data axes: process-local leaf 'x'")
  assert "size 12" in msg and "holds 8 of the 8 shards of mesh axes ('data', 'fsdp')" in msg
  with pytest.raises(fs.ShardingError, match=r"leaf 'y' has shape \(\) but .* rank >= 1"):
    fs.global_batch({"y": np.float32(0)}, s)
  with pytest.raises(fs.ShardingError, match=r"batch shardings don't match"):
    fs.global_batch({"x": np.zeros((8,)), "y": np.zeros((8,))}, {"x": s})
  with pytest.raises(fs.ShardingError, match=r"leaf 'x': sharding .* is not a NamedSharding"):
    fs.global_batch({"x": np.zeros((8,))}, {"x": jax.sharding.SingleDeviceSharding(
        jax.devices()[0])})


def _tiny_compiled(mesh):
  import optax  # pylint: disable=import-outside-toplevel
  opt = optax.sgd(0.1)
  loss = lambda p, b: jax.numpy.mean((b["x"] @ p["w"]) ** 2)
  state = fs.init_state({"w": np.ones((4, 4), np.float32)}, opt, mesh=mesh)
  batch = {"x": np.ones((8, 4), np.float32)}
  return fs.shard_step(fs.train_step(loss, opt), mesh).compile(state, batch)


def test_several_processes_without_the_coordination_service_raise(mesh, monkeypatch, tmp_path):
  """What libtpu gives a pod whose hosts never called initialize: jax sees 2 processes, JAX's
  coordination service is off. Every feature that needs it refuses, naming the fix, instead
  of running per process."""
  compiled = _tiny_compiled(mesh)
  fs.multihost.agree_on_step(compiled)  # one process: returns at once
  assert not jax.distributed.is_initialized()
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)

  def guard(cm):
    with cm:
      pass
  calls = {
      "barrier('x')": lambda: fs.barrier("x"),
      "agree_on_step (compiled step ": lambda: fs.multihost.agree_on_step(compiled),
      "preemption_guard": lambda: guard(fs.multihost.preemption_guard()),
      "peer_guard": lambda: guard(fs.multihost.peer_guard()),
      "the checkpoint step to restore from": lambda: fs.checkpoint.restore(
          tmp_path, {"w": jax.ShapeDtypeStruct((2,), np.float32)}),
      "check_shared_directory(": lambda: fs.checkpoint.check_shared_directory(tmp_path),
  }
  for what, call in calls.items():
    with pytest.raises(fs.DistributedError) as e:
      call()
    msg = str(e.value)
    assert msg.startswith(what), msg
    assert ("needs JAX's coordination service, but this is process 1 of 2 and "
            "jax.distributed was never initialised") in msg, msg
    assert "fix: call fnscale.initialize() first thing in every process" in msg


def test_agree_on_step_wants_the_compiled_step(mesh):
  sharded = fs.shard_step(lambda s, b: (s, {}), mesh)
  with pytest.raises(fs.DistributedArgumentError, match=r"agree_on_step\(compiled=ShardedStep\): "
                     r"expected the CompiledStep .*fix: step = step.compile\(state, batch\)"):
    fs.multihost.agree_on_step(sharded)


# ------------------------------------------------------------------------- two processes

_WORKER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import fnscale as fs
    port, pid, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    out = {"pid": pid}
    try:
      info = fs.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=float(sys.argv[4]),
                           heartbeat_timeout_s=10, shutdown_timeout_s=10)
    except fs.DistributedError as e:
      print(json.dumps({"pid": pid, "init_error": str(e)}), flush=True)
      sys.exit(0)
    out["info"] = list(info)
    out["again"] = list(fs.initialize(f"127.0.0.1:{port}", 2, pid))  # idempotent
    try:
      fs.initialize(f"127.0.0.1:{port}", 3, pid)
    except fs.DistributedError as e:
      out["mismatch"] = str(e)
    import jax
    from jax.experimental import multihost_utils
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    local = {"x": np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + 1000 * pid}
    g = fs.global_batch(local, fs.batch_sharding(mesh))
    out["shape"] = list(g["x"].shape)
    out["full"] = np.asarray(multihost_utils.process_allgather(g["x"], tiled=True)).tolist()
    out["sum"] = float(jax.jit(lambda a: a.sum())(g["x"]))
    fs.barrier("step", timeout_s=20)
    fs.barrier("step", timeout_s=20)  # the same name can be reused
    if pid == 0:  # process 1 comes late, then to another barrier: bounded, named waits
      for name, timeout_s in (("lonely", 1), ("lonely2", 4)):
        try:
          fs.barrier(name, timeout_s=timeout_s)
        except fs.DistributedError as e:
          out[name] = str(e)
    else:
      import time
      time.sleep(2)  # then at 'end' from 2 s on; process 0's 'lonely2' ends at 5 s
    fs.barrier("end", timeout_s=20)
    print(json.dumps(out), flush=True)
""")


def _run_workers(tmp_path, pids, timeout_s, init_timeout_s=20):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  for v in LAUNCHER_VARS:
    env.pop(v, None)
  procs = [subprocess.Popen(
      ["timeout", str(timeout_s), sys.executable, str(script), str(port), str(pid), "run",
       str(init_timeout_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, start_new_session=True) for pid in pids]
  try:
    outs = [p.communicate(timeout=timeout_s + 5) for p in procs]
  finally:
    for p in procs:  # each in its own process group: the group goes, children included
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  results = []
  for p, (stdout, stderr) in zip(procs, outs):
    lines = mp.records(stdout)
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{stdout}\n{stderr[-3000:]}"
    results.append(lines[-1])
  return results


@pytest.mark.multiprocess
def test_two_processes_global_batch_and_barrier(tmp_path):
  r0, r1 = _run_workers(tmp_path, [0, 1], timeout_s=60)
  port_info = r0["info"][2]
  assert r0["info"] == [0, 2, port_info, True] and r1["info"] == [1, 2, port_info, True]
  assert r0["again"] == r0["info"] and r1["again"] == r1["info"]
  assert "already initialised as process 0 of 2" in r0["mismatch"]
  assert "{'num_processes': 3}" in r0["mismatch"]
  rows = [np.arange(24, dtype=np.float32).reshape(8, 3) + 1000 * pid for pid in (0, 1)]
  expected = np.concatenate(rows)
  for r in (r0, r1):
    assert r["shape"] == [16, 3]
    np.testing.assert_array_equal(np.array(r["full"]), expected)
    assert r["sum"] == float(expected.sum())
  # Process 1 was busy after the second 'step', then waited at 'end': each case named.
  assert "barrier 'lonely': not all 2 processes arrived within 1 s" in r0["lonely"]
  assert re.search(r"process 1 has not arrived \(last heard from \d+ s ago, leaving 'step'\)",
                   r0["lonely"]), r0["lonely"]
  assert ("barrier 'lonely2': not all 2 processes arrived within 4 s" in r0["lonely2"])
  assert ("process 1 is waiting at 'end' instead: the processes reached different barriers"
          in r0["lonely2"]), r0["lonely2"]
  assert "fix: make every process call barrier('lonely2') in the same order" in r0["lonely2"]


@pytest.mark.multiprocess
def test_missing_coordinator_is_a_bounded_clear_error(tmp_path):
  # Process 1 of 2 alone: nobody serves the coordinator port.
  (r1,) = _run_workers(tmp_path, [1], timeout_s=40, init_timeout_s=1.5)
  msg = r1["init_error"]
  assert "expected 2 processes, this one as process 1, but the coordinator 127.0.0.1:" in msg
  assert "didn't accept connections within 1.5 s" in msg and "fix: start process 0" in msg


def test_initialize_reads_launcher_variables(monkeypatch):
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert fs.initialize() == fs.multihost.DistributedInfo(0, 1, None, False)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(fs.DistributedArgumentError,
                     match="JAX_NUM_PROCESSES='two' is not an integer"):
    fs.initialize()


def test_launch_local_help_lists_its_flags():
  r = subprocess.run([sys.executable, str(REPO / "recipes" / "launch" / "launch_local.py"), "--help"],
                     capture_output=True, text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("Runs a recipe as N processes on this machine")
  for flag in ("--num_processes", "--devices_per_process", "--timeout_s"):
    assert flag in r.stdout, r.stdout
  assert "Unknown command line flag" not in r.stderr


def test_disagreement_message_names_process_field_and_both_values():
  entries = {
      0: {"jax": "0.10.2", "--model": "nano", "program": "aa", "state:params/w": "(4, 4) f32",
          "batch:tokens": "(8, 9) int32"},
      1: {"jax": "0.10.2", "--model": "tiny", "program": "bb", "state:params/w": "(8, 4) f32",
          "batch:tokens": "(8, 9) int32"},
      2: {"jax": "0.9.0", "--model": "nano", "program": "cc", "state:params/w": "(4, 4) f32",
          "batch:tokens": "(8, 9) int32"},
      3: {"jax": "0.10.2", "--model": "nano", "program": "dd", "state:params/w": "(4, 4) f32",
          "batch:tokens": "(8, 9) int32"},
      4: {"jax": "0.10.2", "--model": "nano", "program": "aa", "state:params/w": "(4, 4) f32",
          "batch:tokens": "(8, 9) int32"},
  }
  assert _agreement.differences(entries) == [
      "process 1 has --model=tiny, process 0 --model=nano",
      "process 1: params/w (8, 4) f32, process 0: (4, 4) f32",
      "process 2 has jax=0.9.0, process 0 jax=0.10.2",
      "process 3 compiled program dd, process 0 program aa, with the same shapes, mesh and "
      "compiler options: the code or a setting that changes no shape differs (compare the "
      "command lines, checkouts and XLA_FLAGS)",
  ]
  many = {0: {f"state:w{i}": "(1,) f32" for i in range(9)},
          1: {f"state:w{i}": "(2,) f32" for i in range(9)}}
  lines = _agreement.differences(many)
  assert len(lines) == 7 and lines[-1] == "and 3 more differences of process 1"
  assert _agreement.differences({0: entries[0]}) == []
  with pytest.raises(fs.DistributedArgumentError, match=r"config=\['model'\], expected a mapping"):
    fs.initialize(num_processes=1, config=["model"])


# ------------------------------------------------- a Cloud TPU VM known only to its metadata


class _Metadata(http.server.BaseHTTPRequestHandler):
  """The GCE metadata service of one TPU VM worker: `server.answers` by attribute name."""

  def do_GET(self):
    key = self.path.removeprefix("/computeMetadata/v1/instance/attributes/")
    body = self.server.answers.get(key)
    if self.headers.get("Metadata-Flavor") != "Google":
      body = None  # the real service refuses requests without the header
    self.send_response(200 if body is not None else 404)
    self.end_headers()
    self.wfile.write((body if body is not None else "not found").encode())

  def log_message(self, *args):
    pass


def _v4_16_worker(worker: int) -> dict[str, str]:
  """What a `gcloud compute tpus tpu-vm create --accelerator-type=v4-16` worker's metadata
  serves (reduced): 8 chips as 2x2x2, 2 hosts; the endpoints point at this machine."""
  return {
      "accelerator-type": "v4-16",
      "agent-worker-number": str(worker),
      "worker-network-endpoints": "t1v-n-0-w-0:0:127.0.0.1,t1v-n-0-w-1:1:127.0.0.1",
      "tpu-env": ("ACCELERATOR_TYPE: 'v4-16'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\n"
                  f"HOST_BOUNDS: '1,1,2'\nTOPOLOGY: '2x2x2'\nWORKER_ID: '{worker}'\n"),
  }


@pytest.fixture
def metadata_servers():
  """`start(answers) -> "127.0.0.1:port"`: local metadata servers, shut down afterwards."""
  with contextlib.ExitStack() as stack:

    def start(answers):
      server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
      server.answers = answers
      stack.enter_context(serving(server))
      return f"127.0.0.1:{server.server_address[1]}"
    yield start


_TPU_VM_WORKER = textwrap.dedent("""
    import json, sys
    import fnscale as fs
    try:
      info = fs.initialize(timeout_s=float(sys.argv[1]), heartbeat_timeout_s=10,
                           shutdown_timeout_s=10)
    except fs.DistributedError as e:
      print(json.dumps({"error": str(e)}), flush=True)
      sys.exit(0)
    import jax, numpy as np
    from jax.experimental import multihost_utils
    fs.barrier("joined", timeout_s=30)
    pid = jax.process_index()
    total = multihost_utils.process_allgather(np.array([pid + 1]), tiled=True).sum()
    print(json.dumps({"info": list(info), "processes": jax.process_count(),
                      "devices": jax.device_count(), "total": int(total)}), flush=True)
""")


def _tpu_vm_job(tmp_path, metadata_hosts, coordinator_port, timeout_s):
  """Each process with only a metadata server (and JAX's documented coordinator port
  variable) in its environment: no launcher variable says there are several."""
  script = tmp_path / "tpu_vm_worker.py"
  script.write_text(_TPU_VM_WORKER)
  base = {k: v for k, v in os.environ.items()
          if k not in LAUNCHER_VARS and not k.startswith(("JAX_", "TPU_", "MEGASCALE_"))}
  procs = []
  for host in metadata_hosts:
    env = dict(base, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               GCE_METADATA_HOST=host, GCE_METADATA_IP=host,  # fnscale's and JAX's spelling
               JAX_COORDINATOR_PORT=str(coordinator_port))
    procs.append(subprocess.Popen(
        ["timeout", "120", sys.executable, str(script), str(timeout_s)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=150)
      lines = mp.records(out)
      assert p.returncode == 0 and lines, f"rc={p.returncode}\n{out}\n{err[-3000:]}"
      results.append(lines[-1])
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_metadata_only_tpu_vm_worker_tries_to_join(tmp_path, metadata_servers):
  """Worker 1 of a v4-16 whose environment says nothing: initialize asks JAX's Cloud TPU
  detection, which names worker 0 as the coordinator; nobody serves it, so a bounded
  DistributedError names that address, never a single process."""
  port = _free_port()
  (r,) = _tpu_vm_job(tmp_path, [metadata_servers(_v4_16_worker(1))], port, timeout_s=3)
  msg = r.get("error", "")
  assert msg.startswith("could not form the multi-process job: expected 2 processes, this one "
                        f"as process 1, but the coordinator 127.0.0.1:{port} (found through "
                        "Cloud TPU VM: 2 worker(s) per slice in instance/attributes/"
                        "worker-network-endpoints) (process 0) didn't accept connections"), r


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
@pytest.mark.multiprocess
def test_metadata_only_tpu_vm_workers_form_one_job(tmp_path, metadata_servers):
  """Both workers of that v4-16, each knowing only its metadata server: one 2-process job."""
  port = _free_port()
  hosts = [metadata_servers(_v4_16_worker(w)) for w in (0, 1)]
  r0, r1 = _tpu_vm_job(tmp_path, hosts, port, timeout_s=60)
  address = f"127.0.0.1:{port}"
  assert r0["info"] == [0, 2, address, True] and r1["info"] == [1, 2, address, True]
  for r in (r0, r1):
    assert r["processes"] == 2 and r["devices"] == 4 and r["total"] == 1 + 2
