"""Topology detection: parsing, environment, a real HTTP metadata server, jax.devices()."""
import http.server
import threading

import jax
import pytest

import fnscale as fs
from fnscale import topology as topo_mod
from fnscale.topology import GiB, TPU_FACTS


# --- parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,dims", [("4x4", (4, 4)), ("2x4x8", (2, 4, 8)), (" 8 ", (8,)),
                                       ("2x4x4x8", (2, 4, 4, 8))])
def test_parse_shape(text, dims):
  assert fs.parse_shape(text) == dims


@pytest.mark.parametrize("bad", ["", "4x", "x4", "4by4", "2x4x8x2x2", "-2x4", "4x-1", "abc", None])
def test_parse_shape_rejects_malformed(bad):
  with pytest.raises(fs.TopologyError, match="is not a chip grid") as e:
    fs.parse_shape(bad)
  assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", ["0x4", "2x0x2"])
def test_parse_shape_rejects_zero(bad):
  with pytest.raises(fs.TopologyError, match="zero or negative dimension"):
    fs.parse_shape(bad)


@pytest.mark.parametrize("acc,gen,chips", [("v5p-128", "v5p", 64), ("v4-8", "v4", 4),
                                           ("v5litepod-16", "v5e", 16), ("v6e-256", "v6e", 256),
                                           ("v2-8", "v2", 4), ("v3-32", "v3", 16)])
def test_parse_accelerator_type(acc, gen, chips):
  assert fs.parse_accelerator_type(acc) == (gen, chips)


def test_unknown_accelerator_type():
  with pytest.raises(fs.TopologyError, match=r"unknown accelerator type 'v9x-8'.*v5p-128"):
    fs.parse_accelerator_type("v9x-8")


def test_odd_core_count_rejected():
  with pytest.raises(fs.TopologyError, match="not a whole number of v5p chips"):
    fs.parse_accelerator_type("v5p-3")


def test_facts_table_public_figures():
  # Vendor figures, dense bf16 per chip.
  assert TPU_FACTS["v4"].peak_flops == 275e12 and TPU_FACTS["v5e"].peak_flops == 197e12
  assert TPU_FACTS["v5p"].peak_flops == 459e12 and TPU_FACTS["v6e"].peak_flops == 918e12
  assert TPU_FACTS["v5p"].hbm_bytes == 95 * GiB and TPU_FACTS["v5p"].torus_dims == 3
  assert TPU_FACTS["v5e"].torus_dims == 2
  assert topo_mod.gpu_facts("NVIDIA H200").peak_flops == 989e12
  assert topo_mod.gpu_facts("NVIDIA H100 80GB HBM3").peak_flops == 989e12
  assert topo_mod.gpu_facts("NVIDIA A100-SXM4-80GB").peak_flops == 312e12
  assert topo_mod.gpu_facts("NVIDIA H100 PCIe").peak_flops == 756e12
  assert topo_mod.gpu_facts("cpu") is None


# --- detection -----------------------------------------------------------------------------

def test_detect_from_devices_cpu():
  t = fs.detect_topology(env={})
  assert t.platform == "cpu" and t.num_devices == 8 and t.devices_per_process == 8
  assert t.num_processes == 1 and t.num_slices == 1 and t.chip_grid == ()
  assert t.sources["num_devices"] == "jax.devices()"
  assert t.peak_flops_per_device is None


def test_override_grid_and_mismatch():
  t = fs.detect_topology("2x4", env={})
  assert t.chip_grid == (2, 4) and t.sources["chip_grid"] == "override"
  with pytest.raises(fs.TopologyError, match=r"says 1 slice\(s\) x 2x4x8 = 64 devices, but 8 cpu"):
    fs.detect_topology("2x4x8", env={})
  t = fs.detect_topology("2x2x2", env={})
  assert t.chip_grid == (2, 2, 2)
  with pytest.raises(fs.TopologyError, match="unknown TPU generation"):
    fs.detect_topology("v9:2x2", env={})
  with pytest.raises(fs.TopologyError, match="is empty"):
    fs.detect_topology("  ", env={})


def _tpu_devices(name, num_slices=1):
  topologies = pytest.importorskip("jax.experimental.topologies")
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        num_slices=num_slices).devices
  except Exception as e:  # libtpu missing
    pytest.skip(f"libtpu not available ({e}); install fnscale[tpu]")


@pytest.mark.tpu
def test_detect_from_tpu_devices_and_env():
  devs = _tpu_devices("v5p:2x2x2", num_slices=2)
  env = {"TPU_ACCELERATOR_TYPE": "v5p-16", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
         "MEGASCALE_SLICE_ID": "0"}
  t = fs.detect_topology(devices=devs, env=env)
  assert t.platform == "tpu" and t.generation == "v5p" and t.num_devices == 16
  assert t.chip_grid == (2, 2, 2) and t.num_slices == 2 and t.accelerator_type == "v5p-16"
  assert t.peak_flops_per_device == 459e12 and t.hbm_bytes_per_device == 95 * GiB
  assert t.sources["accelerator_type"] == "env:TPU_ACCELERATOR_TYPE"
  assert t.sources["num_slices"] == "env:MEGASCALE_NUM_SLICES"
  assert t.sources["chip_grid"] == "jax.devices() coords"
  # The environment wins over the devices, and a disagreeing one is an error.
  env_bad = dict(env, TPU_TOPOLOGY="2x4x4")
  with pytest.raises(fs.TopologyError, match="env:TPU_TOPOLOGY says 2 slice.*64 devices, but 16"):
    fs.detect_topology(devices=devs, env=env_bad)


@pytest.mark.tpu
def test_detect_v5e_from_host_bounds():
  devs = _tpu_devices("v5e:4x4")
  env = {"TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "2,2,1"}
  t = fs.detect_topology(devices=devs, env=env)
  assert t.generation == "v5e" and t.chip_grid == (4, 4) and t.peak_flops_per_device == 197e12
  assert t.sources["chip_grid"] == "env:TPU_CHIPS_PER_HOST_BOUNDS*HOST_BOUNDS"


def test_env_unknown_accelerator_type():
  with pytest.raises(fs.TopologyError, match="fix TPU_ACCELERATOR_TYPE"):
    fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "v99-8"})


# --- metadata service ----------------------------------------------------------------------

class _Metadata(http.server.BaseHTTPRequestHandler):
  answers = {
      "/computeMetadata/v1/instance/attributes/accelerator-type": "v5litepod-8",
      "/computeMetadata/v1/instance/attributes/tpu-env":
          "ACCELERATOR_TYPE: 'v5litepod-8'\nTOPOLOGY: '2x4'\nWORKER_ID: '0'\n",
  }
  seen: list = []

  def do_GET(self):
    self.seen.append((self.path, self.headers.get("Metadata-Flavor")))
    if self.headers.get("Metadata-Flavor") != "Google":
      self.send_response(403)
      self.end_headers()
      return
    body = self.answers.get(self.path)
    self.send_response(200 if body is not None else 404)
    self.end_headers()
    if body is not None:
      self.wfile.write(body.encode())

  def log_message(self, *args):
    pass


@pytest.fixture
def metadata_server():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  _Metadata.seen = []
  yield f"127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  server.server_close()


def test_detect_from_metadata_server(metadata_server):
  # The override says 2x4 = 8 simulated CPU devices, matching v5litepod-8's chip count.
  t = fs.detect_topology(env={"GCE_METADATA_HOST": metadata_server}, metadata_timeout_s=2)
  assert t.accelerator_type == "v5litepod-8" and t.generation == "v5e"
  assert t.sources["accelerator_type"] == "metadata:instance/attributes/accelerator-type"
  assert t.chip_grid == (2, 4)
  assert t.sources["chip_grid"] == "metadata:instance/attributes/tpu-env:TOPOLOGY"
  assert all(flavor == "Google" for _, flavor in _Metadata.seen)


def test_metadata_rejects_missing_header(metadata_server):
  import urllib.request, urllib.error
  with pytest.raises(urllib.error.HTTPError, match="403"):
    urllib.request.urlopen(f"http://{metadata_server}/computeMetadata/v1/instance/attributes/"
                           "accelerator-type", timeout=2)


def test_unreachable_metadata_is_not_an_error(monkeypatch):
  import socket
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()  # nothing listens here now
  t = fs.detect_topology(env={"GCE_METADATA_HOST": f"127.0.0.1:{port}"}, metadata_timeout_s=0.5)
  assert t.accelerator_type is None and t.platform == "cpu"


def test_metadata_not_asked_off_tpu(monkeypatch):
  asked = []
  monkeypatch.setattr(topo_mod._metadata, "get", lambda *a, **k: asked.append(a))
  monkeypatch.setattr(topo_mod.glob, "glob", lambda pattern: [])
  fs.detect_topology(env={})
  assert asked == []


def test_topology_is_immutable():
  t = fs.detect_topology(env={})
  with pytest.raises(Exception):
    t.num_devices = 3
  with pytest.raises(TypeError):
    t.sources["x"] = "y"
  assert jax.device_count() == t.num_devices


def test_simulate_cpu_devices_after_start(monkeypatch):
  monkeypatch.setattr(topo_mod, "has_accelerator", lambda: False)
  jax.devices()  # the backend is up with 8 devices (conftest)
  assert fs.simulate_cpu_devices(8) is True
  with pytest.raises(fs.TopologyError, match="already started with 8 devices, so 4"):
    fs.simulate_cpu_devices(4)
  with pytest.raises(fs.TopologyError, match="count 0 must be a positive int"):
    fs.simulate_cpu_devices(0)
  monkeypatch.setattr(topo_mod, "has_accelerator", lambda: True)
  assert fs.simulate_cpu_devices(4) is False


def test_show_topology_recipe(tmp_path):
  import subprocess, sys, os
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  root = os.path.dirname(os.path.dirname(__file__))
  out = subprocess.run([sys.executable, os.path.join(root, "recipes", "show_topology.py"),
                        "--devices=4", "--mesh=data=-1,tensor=2"], env=env, timeout=120,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert "4 devices" in out.stdout and "Mesh {'data': 2, 'tensor': 2}" in out.stdout
  bad = subprocess.run([sys.executable, os.path.join(root, "recipes", "show_topology.py"),
                        "--devices=4", "--mesh=data=3"], env=env, timeout=120,
                       capture_output=True, text=True)
  assert bad.returncode != 0
  assert "error: ICI axes {'data': 3} multiply to 3 devices but there are 4" in bad.stderr
  assert "Traceback" not in bad.stderr
