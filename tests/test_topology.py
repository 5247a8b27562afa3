"""Topology detection: parsing, environment, a real HTTP metadata server, jax.devices()."""
import dataclasses
import http.server

import jax
import pytest

import fnscale as fs
from fnscale import _machine, _override, _sources
from fnscale import _topology as topo_mod
from fnscale._topology import CHIP_FACTS, GiB
from local_server import serving


# --- parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,dims", [("4x4", (4, 4)), ("2x4x8", (2, 4, 8)), (" 8 ", (8,)),
                                       ("2x4x4x8", (2, 4, 4, 8))])
def test_parse_shape(text, dims):
  assert topo_mod.parse_shape(text) == dims


@pytest.mark.parametrize("bad", ["", "4x", "x4", "4by4", "2x4x8x2x2", "-2x4", "4x-1", "abc", None])
def test_parse_shape_rejects_malformed(bad):
  with pytest.raises(fs.TopologyError, match="is not a chip grid") as e:
    topo_mod.parse_shape(bad)
  assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", ["0x4", "2x0x2"])
def test_parse_shape_rejects_zero(bad):
  with pytest.raises(fs.TopologyError, match="zero or negative dimension"):
    topo_mod.parse_shape(bad)


@pytest.mark.parametrize("acc,gen,chips", [("v5p-128", "v5p", 64), ("v4-8", "v4", 4),
                                           ("v5litepod-16", "v5e", 16), ("v6e-256", "v6e", 256),
                                           ("v2-8", "v2", 4), ("v3-32", "v3", 16),
                                           # single-chip slices (Google's v5e/v6e tables)
                                           ("v5litepod-1", "v5e", 1), ("v6e-1", "v6e", 1)])
def test_parse_accelerator_type(acc, gen, chips):
  assert topo_mod.parse_accelerator_type(acc) == (gen, chips)


def test_unknown_accelerator_type():
  with pytest.raises(fs.TopologyError, match=r"unknown accelerator type 'v9x-8'.*v5p-128"):
    topo_mod.parse_accelerator_type("v9x-8")


def test_odd_core_count_rejected():
  with pytest.raises(fs.TopologyError, match="not a whole number of v5p chips"):
    topo_mod.parse_accelerator_type("v5p-3")


def test_facts_table_public_figures():
  # Vendor figures, dense bf16 per chip.
  assert CHIP_FACTS["v4"].peak_flops == 275e12 and CHIP_FACTS["v5e"].peak_flops == 197e12
  assert CHIP_FACTS["v5p"].peak_flops == 459e12 and CHIP_FACTS["v6e"].peak_flops == 918e12
  assert CHIP_FACTS["v5p"].hbm_bytes == 95 * GiB and CHIP_FACTS["v5p"].torus_dims == 3
  assert CHIP_FACTS["v5e"].torus_dims == 2
  # Links: the scaling book's ICI per link one way, Cloud TPU's DCN per chip (Gbps / 8).
  assert (CHIP_FACTS["v5p"].ici_link, CHIP_FACTS["v5p"].dcn) == (9e10, 50e9 / 8)
  assert (CHIP_FACTS["v6e"].ici_link, CHIP_FACTS["v6e"].dcn) == (9e10, 100e9 / 8)
  assert CHIP_FACTS["v7"].libtpu_name == "tpu7x" and CHIP_FACTS["v5e"].libtpu_name == "v5e"
  assert topo_mod.gpu_facts("NVIDIA H200").peak_flops == 989e12
  assert topo_mod.gpu_facts("NVIDIA H100 80GB HBM3").peak_flops == 989e12
  assert topo_mod.gpu_facts("NVIDIA A100-SXM4-80GB").peak_flops == 312e12
  assert topo_mod.gpu_facts("NVIDIA H100 PCIe").peak_flops == 756e12
  assert topo_mod.gpu_facts("NVIDIA H100 80GB HBM3").torus_dims == 0  # NVSwitch
  assert all(f.source for f in CHIP_FACTS.values())  # every row names where it comes from
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


def test_env_unknown_accelerator_type():
  with pytest.raises(fs.TopologyError, match="fix TPU_ACCELERATOR_TYPE"):
    fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "v99-8"})


# --- override strings, without devices ------------------------------------------------------

@pytest.mark.parametrize("override,facts", [
    # (what the string says, written out by hand)
    ("v5p-128", {"accelerator_type": "v5p-128"}),
    ("  v5litepod-16 ", {"accelerator_type": "v5litepod-16"}),
    ("2x v5p-128", {"num_slices": 2, "accelerator_type": "v5p-128"}),
    ("3 x v6e-8", {"num_slices": 3, "accelerator_type": "v6e-8"}),
    ("v5p:2x4x8", {"generation": "v5p", "chip_grid": (2, 4, 8)}),
    ("v5:2x2x1", {"generation": "v5p", "chip_grid": (2, 2, 1)}),  # libtpu's name of v5p
    ("tpu7x:2x2x1", {"generation": "v7", "chip_grid": (2, 2, 1)}),
    ("v5litepod :4x4", {"generation": "v5e", "chip_grid": (4, 4)}),
    ("2x4x4x8", {"num_slices": 2, "chip_grid": (4, 4, 8)}),
    ("v6e:2x4x4", {"generation": "v6e", "chip_grid": (2, 4, 4)}),  # 3 dims: no slices
    ("4x4", {"chip_grid": (4, 4)}),
])
def test_override_facts(override, facts):
  assert topo_mod._override_facts(override) == {k: (v, "override") for k, v in facts.items()}


@pytest.mark.parametrize("override,pattern", [
    ("0x v5p-128", r"override slices='0' is not ','-separated integers >= 1"),
    ("v5p-3", r"accelerator type 'v5p-3': 3 cores is not a whole number of v5p chips"),
    ("v9-8", r"unknown accelerator type 'v9-8'"),
    ("2x v9-8", r"unknown accelerator type 'v9-8'"),
    ("v5px:2x2x1", r"topology override 'v5px:2x2x1' names an unknown TPU generation 'v5px': "
                   r"expected one of \['tpu7x', 'v2', 'v3', 'v4', 'v5', 'v5e', 'v5litepod', "
                   r"'v5p', 'v6e', 'v7'\] before ':', e.g. 'v5p:2x4x8'"),
    (":2x2", r"names an unknown TPU generation ''"),
    ("v5p:", r"shape '' is not a chip grid"),
    ("v5p:2x2x2x2x2", r"shape '2x2x2x2x2' is not a chip grid"),
    ("", r"topology override '' is empty: expected a chip grid such as '2x4x8', 'v5p:2x4x8', "
         r"slices first as '2x4x4x8', an accelerator type such as 'v5p-128', or slices of one "
         r"as '2x v5p-128'"),
])
def test_override_facts_rejects(override, pattern):
  with pytest.raises(fs.TopologyError, match=pattern):
    topo_mod._override_facts(override)


def test_override_slices_on_cpu_devices():
  # 8 CPU devices as 2 slices of a 2x2x1 grid, or 4 slices of a 2-chip v5e type.
  t = fs.detect_topology("2x2x2x1", env={})
  assert (t.num_slices, t.chip_grid, t.num_chips, t.devices_per_slice) == (2, (2, 2, 1), 4, 4)
  assert t.sources["num_slices"] == "override" and t.sources["num_chips"] == "override"
  t = fs.detect_topology("4x v5litepod-2", env={})
  assert (t.num_slices, t.accelerator_type, t.generation, t.num_chips, t.chip_grid) == (
      4, "v5litepod-2", "v5e", 2, ())
  assert t.sources["chip_grid"] == "unknown (accelerator type gives only the chip count)"
  assert t.sources["generation"] == "override" and t.peak_flops_per_device is None
  with pytest.raises(fs.TopologyError, match=r"topology from override says 2 slice\(s\) x 2 = 4 "
                                             r"devices, but 8 cpu devices are present"):
    fs.detect_topology("2x v5litepod-2", env={})


# --- metadata service ----------------------------------------------------------------------

def _md(path):
  return "/computeMetadata/v1/instance/attributes/" + path


class _Metadata(http.server.BaseHTTPRequestHandler):
  """A local stand-in for the GCE metadata service; tests set `answers` (path -> text)."""
  answers: dict = {}
  seen: list = []

  def do_GET(self):
    self.seen.append((self.path, self.headers.get("Metadata-Flavor")))
    body = self.answers.get(self.path)
    if self.headers.get("Metadata-Flavor") != "Google":
      body = None  # the real service refuses requests without the header
    self.send_response(200 if body is not None else 404)
    self.end_headers()
    if body is not None:
      self.wfile.write(body.encode())

  def log_message(self, *args):
    pass


@pytest.fixture
def metadata_server():
  _Metadata.seen = []
  _Metadata.answers = {
      _md("accelerator-type"): "v5litepod-8",
      _md("tpu-env"): "ACCELERATOR_TYPE: 'v5litepod-8'\nTOPOLOGY: '2x4'\nWORKER_ID: '0'\n",
  }
  with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)) as server:
    yield f"127.0.0.1:{server.server_address[1]}"


def test_detect_from_metadata_server(metadata_server):
  # The override says 2x4 = 8 simulated CPU devices, matching v5litepod-8's chip count.
  t = fs.detect_topology(env={"GCE_METADATA_HOST": metadata_server}, metadata_timeout_s=2)
  assert t.accelerator_type == "v5litepod-8" and t.generation == "v5e"
  assert t.sources["accelerator_type"] == "metadata:instance/attributes/accelerator-type"
  assert t.chip_grid == (2, 4)
  assert t.sources["chip_grid"] == "metadata:instance/attributes/tpu-env:TOPOLOGY"
  assert all(flavor == "Google" for _, flavor in _Metadata.seen)


def test_unreachable_metadata_is_not_an_error(monkeypatch):
  import socket
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()  # nothing listens here now
  t = fs.detect_topology(env={"GCE_METADATA_HOST": f"127.0.0.1:{port}"}, metadata_timeout_s=0.5)
  assert t.accelerator_type is None and t.platform == "cpu"


def test_metadata_facts(monkeypatch):
  # The attributes a multi-host Cloud TPU VM's metadata serves (reduced): the VM's own
  # accelerator-type and agent-worker-number come before the same keys in tpu-env.
  answers = {
      "accelerator-type": "v5p-16", "agent-worker-number": "1",
      "tpu-env": ("ACCELERATOR_TYPE: 'v5p-32'\nTPU_WORKER_ID: '0'\n"
                  "CHIPS_PER_HOST_BOUNDS: '2,2,1'\n  HOST_BOUNDS : 1,1,2\nTOPOLOGY: '2x2x4'\n"
                  "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n"),
  }
  asked = []

  def get(path, *, timeout_s, url):
    asked.append((path, timeout_s, url))
    return answers.get(path.removeprefix("instance/attributes/"))
  monkeypatch.setattr(topo_mod._metadata, "get", get)
  md, env = "metadata:instance/attributes/", "metadata:instance/attributes/tpu-env:"
  assert topo_mod._metadata_facts(0.5, "http://h/computeMetadata/v1") == {
      "accelerator_type": ("v5p-16", md + "accelerator-type"),
      "worker_id": (1, md + "agent-worker-number"),
      "chip_grid": ((2, 2, 2), f"{env}CHIPS_PER_HOST_BOUNDS*{env}HOST_BOUNDS"),
      "processes_per_slice": (2, env + "HOST_BOUNDS"),
      "num_slices": (2, env + "MEGASCALE_NUM_SLICES"),
      "slice_index": (1, env + "MEGASCALE_SLICE_ID"),
  }
  assert {a[0] for a in asked} == {"instance/attributes/accelerator-type",
                                   "instance/attributes/agent-worker-number",
                                   "instance/attributes/worker-network-endpoints",
                                   "instance/attributes/tpu-env"}
  assert {a[1:] for a in asked} == {(0.5, "http://h/computeMetadata/v1")}
  # The slice's hosts as the VM's own attribute (JAX's source) count before tpu-env's bounds,
  # in both spellings: "name:id:ip" triples and bare names.
  for hosts in ("t1v-n-0-w-0:0:10.0.0.2,t1v-n-0-w-1:1:10.0.0.3,t1v-n-0-w-2:2:10.0.0.4",
                "10.0.0.2,10.0.0.3,10.0.0.4"):
    answers["worker-network-endpoints"] = hosts
    assert topo_mod._metadata_facts(0.5, "http://h")["processes_per_slice"] == (
        3, md + "worker-network-endpoints")
  del answers["worker-network-endpoints"]
  # Without the attributes, tpu-env answers; a worker number that is no number is ignored.
  answers.update({"accelerator-type": None, "agent-worker-number": "n/a"})
  facts = topo_mod._metadata_facts(0.5, "http://h")
  assert (facts["accelerator_type"], facts["worker_id"]) == (
      ("v5p-32", env + "ACCELERATOR_TYPE"), (0, env + "TPU_WORKER_ID"))
  answers.clear()  # nothing answers: no facts
  assert topo_mod._metadata_facts(0.5, "http://h") == {}


def test_metadata_not_asked_off_tpu(monkeypatch):
  asked = []
  monkeypatch.setattr(topo_mod._metadata, "get", lambda *a, **k: asked.append(a))
  monkeypatch.setattr(_machine.glob, "glob", lambda pattern: [])
  fs.detect_topology(env={})
  assert asked == []


def test_topology_is_immutable():
  t = fs.detect_topology(env={})
  with pytest.raises(dataclasses.FrozenInstanceError):
    t.num_devices = 3
  with pytest.raises(TypeError):
    t.sources["x"] = "y"
  assert jax.device_count() == t.num_devices


def _topology(**kw):
  fields = dict(platform="tpu", device_kind="TPU v5", generation="v5p", num_devices=128,
                num_processes=32, num_slices=2, devices_per_process=4, chip_grid=(4, 4, 4),
                num_chips=64, cores_per_chip=2, accelerator_type="v5p-128", process_index=0,
                slice_index=0, peak_flops_per_device=459e12, hbm_bytes_per_device=95 * GiB)
  return topo_mod.Topology(**{**fields, **kw})


def test_topology_str():
  # Two v5p-128 slices: 64 chips (4x4x4) each, 16 hosts of 4 chips per slice, 459 TFLOP/s.
  assert str(_topology()) == ("tpu 'TPU v5' (v5p-128): 128 devices = 2 slice(s) x chip grid "
                              "4x4x4, 32 process(es) x 4 devices, peak 459 TFLOP/s bf16 per "
                              "device")
  assert str(_topology(platform="cpu", device_kind="cpu", num_devices=8, num_processes=1,
                       num_slices=1, devices_per_process=8, chip_grid=(), accelerator_type=None,
                       peak_flops_per_device=None)) == (
      "cpu 'cpu' (no accelerator type): 8 devices = 1 slice(s) x chip grid ?, 1 process(es) x 8 "
      "devices, peak ? bf16 per device")
  assert "peak 2307 TFLOP/s" in str(_topology(peak_flops_per_device=2307e12))  # rounds, no .0


def test_devices_per_slice():
  assert _topology().devices_per_slice == 64  # 128 devices over 2 slices
  assert _topology(num_devices=8, num_slices=1).devices_per_slice == 8
  assert _topology(num_devices=8, num_slices=0).devices_per_slice == 8  # never divides by 0


def test_simulate_cpu_devices_after_start(monkeypatch):
  monkeypatch.setattr(_machine, "has_accelerator", lambda: False)
  jax.devices()  # the backend is up with 8 devices (conftest)
  assert fs.simulate_cpu_devices(8) is True
  with pytest.raises(fs.TopologyError, match="already started with 8 devices, so 4"):
    fs.simulate_cpu_devices(4)
  with pytest.raises(fs.TopologyError, match=r"simulated device count n=0 \(int\) must be a positive int"):
    fs.simulate_cpu_devices(0)
  monkeypatch.setattr(_machine, "has_accelerator", lambda: True)
  assert fs.simulate_cpu_devices(4) is False


# --- accelerator device files and simulated CPU devices (no backend started) ----------------

def _device_files(monkeypatch, *files):
  """Makes `glob.glob` in fnscale._machine see only `files`, matched as the shell would."""
  import fnmatch
  monkeypatch.setattr(_machine.glob, "glob",
                      lambda pattern: [f for f in files if fnmatch.fnmatch(f, pattern)])


@pytest.mark.parametrize("files,accelerator", [
    ((), False),
    (("/dev/accel0",), True),  # TPU v4 and later
    (("/dev/vfio/0", "/dev/vfio/vfio"), True),  # TPU v5e/v6e over VFIO
    (("/dev/vfio/vfio",), False),  # the VFIO control file alone: any Linux machine
    (("/dev/nvidia0", "/dev/nvidiactl"), True),
    (("/dev/nvidiactl", "/dev/nvidia-uvm"), False),  # driver files without a GPU
    (("/dev/null", "/dev/sda"), False),
])
def test_has_accelerator_from_device_files(monkeypatch, files, accelerator):
  _device_files(monkeypatch, *files)
  assert topo_mod.has_accelerator() is accelerator


def test_on_tpu_vm(monkeypatch):
  _device_files(monkeypatch)
  assert not topo_mod._on_tpu_vm({})
  assert topo_mod._on_tpu_vm({"GCE_METADATA_HOST": "127.0.0.1:1"})
  # jax's import sets TPU_SKIP_MDS_QUERY=1 wherever there is no TPU chip: a named server wins.
  assert topo_mod._on_tpu_vm({"GCE_METADATA_HOST": "127.0.0.1:1", "TPU_SKIP_MDS_QUERY": "1"})
  _device_files(monkeypatch, "/dev/accel0")
  assert topo_mod._on_tpu_vm({})
  assert not topo_mod._on_tpu_vm({"TPU_SKIP_MDS_QUERY": "true"})
  _device_files(monkeypatch, "/dev/nvidia0")
  assert not topo_mod._on_tpu_vm({})  # a GPU machine has no TPU metadata


_TIMEOUT_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                  "--xla_cpu_collective_timeout_seconds=900")


@pytest.fixture
def jax_config(monkeypatch):
  """Records simulate_cpu_devices' jax.config updates instead of applying them."""
  updates = []
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  _device_files(monkeypatch)  # no accelerator
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  return updates


def test_simulate_cpu_devices_sets_platform_count_and_timeouts(monkeypatch, jax_config):
  import os
  assert fs.simulate_cpu_devices(1) is True
  assert jax_config == [("jax_platforms", "cpu"), ("jax_num_cpu_devices", 1)]
  assert os.environ["XLA_FLAGS"] == _TIMEOUT_FLAGS
  jax_config.clear()
  monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")  # the user's choice stands
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  assert fs.simulate_cpu_devices(16) is True
  assert jax_config == [("jax_num_cpu_devices", 16)]
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d " + _TIMEOUT_FLAGS
  mine = "--xla_cpu_collective_call_terminate_timeout_seconds=60"
  monkeypatch.setenv("XLA_FLAGS", mine)  # the user's own timeout stands
  fs.simulate_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == mine


def test_simulate_cpu_devices_does_nothing_on_an_accelerator(monkeypatch, jax_config):
  import os
  _device_files(monkeypatch, "/dev/accel0")
  assert fs.simulate_cpu_devices(8) is False
  assert jax_config == [] and "XLA_FLAGS" not in os.environ


def test_simulate_cpu_devices_after_start_with_the_same_count(monkeypatch, jax_config):
  def started(name, value):
    if name == "jax_num_cpu_devices":
      raise RuntimeError("jax_num_cpu_devices config should be updated before backends are "
                         "initialized")
  monkeypatch.setattr(jax.config, "update", started)
  monkeypatch.setattr(jax, "device_count", lambda: 4)
  assert fs.simulate_cpu_devices(4) is True
  with pytest.raises(fs.TopologyError, match=r"^jax already started with 4 devices, so 2 "
                                             r"simulated devices can't be set: call "
                                             r"simulate_cpu_devices before the first jax "
                                             r"computation\.$"):
    fs.simulate_cpu_devices(2)


@pytest.mark.parametrize("n", [0, -1, True, 2.0, None])
def test_simulate_cpu_devices_rejects_a_bad_count(jax_config, n):
  with pytest.raises(fs.TopologyError, match=rf"simulated device count n={n!r} "
                                             rf"\({type(n).__name__}\) must be a positive int, "
                                             r"e.g. 8\."):
    fs.simulate_cpu_devices(n)
  assert jax_config == []


@pytest.mark.slow
def test_show_topology_recipe():
  out = _recipe("--devices=4", "--mesh=data=-1,tensor=2")
  assert out.returncode == 0, out.stderr
  assert "4 devices" in out.stdout and "Mesh {'data': 2, 'tensor': 2}" in out.stdout
  bad = _recipe("--devices=4", "--mesh=data=3")
  assert bad.returncode != 0
  assert "error: ICI axes {'data': 3} multiply to 3 devices but there are 4" in bad.stderr
  assert "Traceback" not in bad.stderr
  # The one-chip VM's variables with one device: the report says what it set aside; a grid
  # typed for the whole host (not a TPU target: no generation named) is refused.
  out = _recipe("--devices=1", env_vars=_CHIP_VM_ENV)
  assert out.returncode == 0, out.stderr
  assert "Mesh {'data': 1} over 1 devices" in out.stdout
  assert ("  set aside: env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS says 1 slice(s) x 2x2 "
          "= 4 devices, but 1 cpu device is present: topology from the devices present"
          ) in out.stdout
  bad = _recipe("--devices=1", "--topology=2x2", env_vars=_CHIP_VM_ENV)
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  assert bad.stderr.startswith("error: topology from override says 1 slice(s) x 2x2 = 4 "
                               "devices, but 1 cpu device is present; fix: leave the override "
                               "out"), bad.stderr


# --- real setups: every field against Google's tables and libtpu's described devices -------
#
# Each row: the environment and `tpu-env` metadata a real TPU VM / GKE node sets (reduced),
# the devices libtpu describes for that slice, and the right value of every field. Chips and
# grids: Google Cloud's per-generation "TPU versions" tables (v2/v3/v4/v5p/TPU7x count
# TensorCores in the type name, 2 per chip; v5e/v6e count chips). Processes and devices per
# process: libtpu's described devices (4 chips per host on multi-host slices; v5e/v6e-8 and
# smaller are one host). process_index: worker id + slice id x hosts per slice (JAX's Cloud
# TPU cluster). Fields: chip_grid, num_chips, num_devices, num_processes,
# devices_per_process, process_index, slice_index, accelerator_type.

_V5P16_TPU_ENV = ("TPU_ACCELERATOR_TYPE: 'v5p-16'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\n"
                  "HOST_BOUNDS: '1,1,2'\nTOPOLOGY: '2x2x2'\nTPU_WORKER_ID: '1'\n"
                  "MEGASCALE_COORDINATOR_ADDRESS: 'host-a:8080'\nMEGASCALE_NUM_SLICES: '2'\n"
                  "MEGASCALE_SLICE_ID: '1'\n")
_V4_32_TPU_ENV = ("ACCELERATOR_TYPE: 'v4-32'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\n"
                  "HOST_BOUNDS: '1,1,4'\nTOPOLOGY: '2x2x4'\nWORKER_ID: '0'\n")

SETUPS = [
    # (name, source of the inputs, devices (topology, kwargs), env, metadata, override, want)
    ("multislice-env-v6e-8x2",
     "GKE JobSet on 2 x v6e-8 (2x4, one host each); this host is slice 1, worker 0",
     ("v6e:2x4", dict(chips_per_host_bounds=(2, 4, 1), num_slices=2)),
     {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "host-a"}, None, None,
     ((2, 4), 8, 16, 2, 8, 1, 1, "v6e-8")),
    ("multislice-metadata-v5p-16x2",
     "queued resource, 2 x v5p-16 (2x2x2 = 8 chips, 2 hosts of 4); tpu-env of slice 1, worker 1",
     ("v5p:2x2x2", dict(num_slices=2)), {}, {"tpu-env": _V5P16_TPU_ENV,
                                             "agent-worker-number": "1"}, None,
     ((2, 2, 2), 8, 16, 4, 4, 3, 1, "v5p-16")),
    ("carved-env-tpu7x",
     "GKE: one host (2x2x1) of a tpu7x 2x2x4 slice run alone; TPU7x has 2 TensorCores/chip",
     ("tpu7x:2x2x1", {}),
     {"TPU_TOPOLOGY": "2x2x4", "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
      "TPU_ACCELERATOR_TYPE": "tpu7x-8", "TPU_WORKER_ID": "0"}, None, None,
     ((2, 2, 1), 4, 8, 1, 8, 0, 0, "tpu7x-8")),
    ("carved-env-over-metadata-v4-32",
     "one host of a v4-32 (2x2x4) VM run alone: env bounds 1,1,1 over the metadata's 1,1,4",
     ("v4:2x2x1", dict(chip_config_name="megacore")),
     {"TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
     {"accelerator-type": "v4-32", "tpu-env": _V4_32_TPU_ENV, "agent-worker-number": "0"}, None,
     ((2, 2, 1), 4, 4, 1, 4, 0, 0, "v4-32")),
    ("2d-single-host-v5litepod-8",
     "v5litepod-8: 8 chips as 2x4 on one host (2-D torus: 2 dims)",
     ("v5e:2x4", dict(chips_per_host_bounds=(2, 4, 1))),
     {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
      "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "0"}, None, None,
     ((2, 4), 8, 8, 1, 8, 0, 0, "v5litepod-8")),
    ("3d-single-host-v5p-8-topology",
     "v5p-8 = 4 chips, 2x2x1 in Google's table (3-D torus keeps 3 dims), megacore devices",
     ("v5p:2x2x1", {}), {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_TOPOLOGY": "2x2x1"}, None, None,
     ((2, 2, 1), 4, 4, 1, 4, 0, 0, "v5p-8")),
    ("3d-single-host-v4-8-bounds",
     "v4-8 from host bounds 2,2,1 x 1,1,1: still 2x2x1", ("v4:2x2x1", dict(chip_config_name="megacore")),
     {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
      "TPU_HOST_BOUNDS": "1,1,1"}, None, None,
     ((2, 2, 1), 4, 4, 1, 4, 0, 0, "v4-8")),
    ("3d-single-host-v5p-8-devices", "v5p-8 from the devices alone: 2x2x1",
     ("v5p:2x2x1", {}), {}, None, None, ((2, 2, 1), 4, 4, 1, 4, 0, 0, None)),
    ("described-v4-256-megacore",
     "v4-256 = 128 chips as 4x4x8, 32 hosts of 4 chips, megacore (1 device per chip)",
     ("v4:4x4x8", dict(chip_config_name="megacore")), {}, None, None,
     ((4, 4, 8), 128, 128, 32, 4, 0, 0, None)),
    ("described-v5p-128", "v5p-128 = 64 chips as 4x4x4, 16 hosts of 4 chips",
     ("v5p:4x4x4", {}), {}, None, "v5p-128", ((4, 4, 4), 64, 64, 16, 4, 0, 0, "v5p-128")),
    ("described-v5litepod-16", "v5litepod-16 = 16 chips as 4x4, 4 hosts of 4 chips",
     ("v5e:4x4", {}), {}, None, None, ((4, 4), 16, 16, 4, 4, 0, 0, None)),
    ("described-v3-32", "v3-32 = 16 chips as 4x4, 4 hosts of 4 chips, 2 cores per chip",
     ("v3:4x4", {}), {"TPU_ACCELERATOR_TYPE": "v3-32"}, None, None,
     ((4, 4), 16, 32, 4, 8, 0, 0, "v3-32")),
    ("v2-8", "v2-8 = 4 chips as 2x2 on one host, 2 cores per chip",
     ("v2:2x2", {}), {"TPU_ACCELERATOR_TYPE": "v2-8", "TPU_WORKER_ID": "0"}, None, None,
     ((2, 2), 4, 8, 1, 8, 0, 0, "v2-8")),
    ("generation-only-tpu7x",
     "GKE's Ironwood recipe: TPU_ACCELERATOR_TYPE=tpu7x, shape in TPU_TOPOLOGY",
     ("tpu7x:2x2x1", {}), {"TPU_ACCELERATOR_TYPE": "tpu7x", "TPU_TOPOLOGY": "2x2x1"}, None, None,
     ((2, 2, 1), 4, 8, 1, 8, 0, 0, "tpu7x")),
    ("override-v5-libtpu-name", "MaxText/libtpu spell v5p-8 as 'v5:2x2x1'",
     ("v5p:2x2x1", {}), {}, None, "v5:2x2x1", ((2, 2, 1), 4, 4, 1, 4, 0, 0, None)),
    ("override-two-slices", "'2x v5p-16': two v5p-16 slices (8 chips, 2 hosts each)",
     ("v5p:2x2x2", dict(num_slices=2)), {}, None, "2x v5p-16",
     ((2, 2, 2), 8, 16, 4, 4, 0, 0, "v5p-16")),
]
FIELDS = ("chip_grid", "num_chips", "num_devices", "num_processes", "devices_per_process",
          "process_index", "slice_index", "accelerator_type")


@pytest.mark.tpu
@pytest.mark.parametrize("name,source,devs,env,metadata,override,want", SETUPS,
                         ids=[row[0] for row in SETUPS])
def test_real_setups(tpu_devices, metadata_server, name, source, devs, env, metadata,
                     override, want):
  devices = tpu_devices(devs[0], **devs[1])
  if metadata is not None:
    _Metadata.answers = {_md(k): v for k, v in metadata.items()}
    env = dict(env, GCE_METADATA_HOST=metadata_server)
  t = fs.detect_topology(override, env=env, devices=devices, metadata_timeout_s=2)
  assert tuple(getattr(t, f) for f in FIELDS) == want, source
  assert t.platform == "tpu" and t.num_slices * t.devices_per_slice == t.num_devices


@pytest.mark.tpu
def test_setup_sources(tpu_devices, metadata_server):
  """Where each fact of the multi-slice and carved rows came from."""
  row = {r[0]: r for r in SETUPS}
  _, _, devs, env, metadata, _, _ = row["multislice-env-v6e-8x2"]
  t = fs.detect_topology(env=env, devices=tpu_devices(devs[0], **devs[1]))
  assert t.sources["process_index"] == ("env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x "
                                        "devices process_index")
  assert t.sources["num_slices"] == "env:MEGASCALE_NUM_SLICES"
  _, _, devs, env, metadata, _, _ = row["multislice-metadata-v5p-16x2"]
  _Metadata.answers = {_md(k): v for k, v in metadata.items()}
  t = fs.detect_topology(env={"GCE_METADATA_HOST": metadata_server},
                         devices=tpu_devices(devs[0], **devs[1]), metadata_timeout_s=2)
  md = "metadata:instance/attributes/"
  assert t.sources["process_index"] == (f"{md}agent-worker-number + {md}tpu-env:"
                                        f"MEGASCALE_SLICE_ID x {md}tpu-env:HOST_BOUNDS")
  assert t.sources["accelerator_type"] == f"{md}tpu-env:TPU_ACCELERATOR_TYPE"
  assert t.sources["chip_grid"] == f"{md}tpu-env:CHIPS_PER_HOST_BOUNDS*{md}tpu-env:HOST_BOUNDS"
  _, _, devs, env, _, _, _ = row["carved-env-tpu7x"]
  t = fs.detect_topology(env=env, devices=tpu_devices(devs[0], **devs[1]))
  assert t.sources["chip_grid"] == "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS"
  assert t.generation == "v7" and t.peak_flops_per_device == 2307e12 / 2


# --- each pair of layout sources that can disagree ------------------------------------------

@pytest.mark.tpu
@pytest.mark.parametrize("env,metadata,override,grid,source", [
    # override over the environment
    ({"TPU_TOPOLOGY": "2x2x2"}, None, "v5p:2x2x1", (2, 2, 1), "override"),
    # process bounds over host bounds
    ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1",
      "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,2"}, None, None, (2, 2, 1),
     "env:TPU_CHIPS_PER_PROCESS_BOUNDS*env:TPU_PROCESS_BOUNDS"),
    # bounds over TPU_TOPOLOGY
    ({"TPU_TOPOLOGY": "2x2x2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,1"},
     None, None, (2, 2, 1), "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS"),
    # a lone bounds variable fixes nothing: TPU_TOPOLOGY answers
    ({"TPU_TOPOLOGY": "2x2x1", "TPU_PROCESS_BOUNDS": "1,1,2"}, None, None, (2, 2, 1),
     "env:TPU_TOPOLOGY"),
    # environment TPU_TOPOLOGY over metadata bounds
    ({"TPU_TOPOLOGY": "2x2x1"}, "CHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '1,1,2'\n", None,
     (2, 2, 1), "env:TPU_TOPOLOGY"),
    # environment bounds over metadata bounds
    ({"TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,1"},
     "CHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '1,1,2'\n", None, (2, 2, 1),
     "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS"),
    # metadata bounds over metadata TOPOLOGY
    ({}, "TOPOLOGY: '2x2x2'\nTPU_CHIPS_PER_HOST_BOUNDS: '2,2,1'\nTPU_HOST_BOUNDS: '1,1,1'\n",
     None, (2, 2, 1), "metadata:instance/attributes/tpu-env:TPU_CHIPS_PER_HOST_BOUNDS*"
     "metadata:instance/attributes/tpu-env:TPU_HOST_BOUNDS"),
    # metadata over the devices (here they agree)
    ({}, "TOPOLOGY: '2x2x1'\n", None, (2, 2, 1), "metadata:instance/attributes/tpu-env:TOPOLOGY"),
])
def test_layout_precedence(tpu_devices, metadata_server, env, metadata, override, grid, source):
  devices = tpu_devices("v5p:2x2x1")  # what libtpu runs: 4 chips
  if metadata is not None:
    _Metadata.answers = {_md("tpu-env"): metadata}
    env = dict(env, GCE_METADATA_HOST=metadata_server)
  t = fs.detect_topology(override, env=env, devices=devices, metadata_timeout_s=2)
  assert (t.chip_grid, t.sources["chip_grid"]) == (grid, source)
  assert t.num_chips == 4 and t.num_devices == 4


@pytest.mark.tpu
def test_layout_sources_that_disagree_with_the_devices(tpu_devices, metadata_server):
  devices = tpu_devices("v5p:2x2x1")
  t = fs.detect_topology(env={"TPU_TOPOLOGY": "2x2x2"}, devices=devices)
  assert (t.chip_grid, t.num_chips, t.sources["chip_grid"]) == ((2, 2, 1), 4, "devices coords")
  assert t.set_aside.startswith("env:TPU_TOPOLOGY says 1 slice(s) x 2x2x2 = 8 devices, but 4 "
                                "tpu devices are present: topology from the devices present")
  _Metadata.answers = {_md("tpu-env"): "CHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '1,1,2'\n"}
  t = fs.detect_topology(env={"GCE_METADATA_HOST": metadata_server}, devices=devices,
                         metadata_timeout_s=2)
  assert t.chip_grid == (2, 2, 1) and t.set_aside.startswith(
      "metadata:instance/attributes/tpu-env:CHIPS_PER_HOST_BOUNDS*")
  t = fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "v6e-8"}, devices=devices)
  assert (t.generation, t.accelerator_type) == ("v5p", None) and t.set_aside.startswith(
      "env:TPU_ACCELERATOR_TYPE 'v6e-8' is a v6e, but the devices are 'TPU v5' (v5p)")
  with pytest.raises(fs.TopologyError, match=r"^topology from override says 1 slice\(s\) x "
                                             r"2x2x2 = 8 devices, but 4 tpu devices are "
                                             r"present; fix: .*give theirs \('v5p:2x2x1'\)"):
    fs.detect_topology("v5p:2x2x2", env={}, devices=devices)


@pytest.mark.tpu
def test_env_over_metadata_for_names_and_ids(tpu_devices, metadata_server):
  _Metadata.answers = {_md("accelerator-type"): "v5p-16", _md("agent-worker-number"): "1",
                       _md("tpu-env"): "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n"}
  env = {"GCE_METADATA_HOST": metadata_server, "TPU_ACCELERATOR_TYPE": "v5p-8",
         "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "1", "MEGASCALE_SLICE_ID": "0"}
  t = fs.detect_topology(env=env, devices=tpu_devices("v5p:2x2x1"), metadata_timeout_s=2)
  assert (t.accelerator_type, t.process_index, t.num_slices, t.slice_index) == ("v5p-8", 0, 1, 0)
  assert t.sources["accelerator_type"] == "env:TPU_ACCELERATOR_TYPE"
  del env["TPU_ACCELERATOR_TYPE"], env["TPU_WORKER_ID"]
  t = fs.detect_topology(env=env, devices=tpu_devices("v5p:2x2x1"), metadata_timeout_s=2)
  assert (t.accelerator_type, t.process_index) == ("v5p-16", 1)


def test_grid_spelling_per_generation():
  # A wrong implementation that drops every trailing 1 (or none) fails one of these.
  assert topo_mod._slice_grid((2, 2, 1), "v4") == (2, 2, 1)
  assert topo_mod._slice_grid((2, 2), "v5p") == (2, 2, 1)
  assert topo_mod._slice_grid((8,), "v4") == (8, 1, 1)
  assert topo_mod._slice_grid((), "v4") == ()  # unknown stays unknown
  assert topo_mod._slice_grid((2, 4, 1), "v5e") == (2, 4)
  assert topo_mod._slice_grid((4, 4, 1), "v6e") == (4, 4)
  assert topo_mod._slice_grid((2, 2, 1), "v2") == (2, 2)
  assert topo_mod._slice_grid((2, 2, 1), None) == (2, 2, 1)


def test_detect_from_env_without_tpu_devices():
  # Host bounds on 8 simulated CPU devices: a 2x4 grid of devices, source named.
  env = {"TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1", "TPU_HOST_BOUNDS": "1,1,1",
         "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "1"}
  t = fs.detect_topology(env=env)
  assert (t.chip_grid, t.num_chips, t.sources["chip_grid"]) == (
      (2, 4, 1), 8, "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS")
  with pytest.raises(fs.TopologyError, match=r"env:TPU_HOST_BOUNDS='1,x' is not ','-separated "
                                             r"integers >= 1"):
    fs.detect_topology(env=dict(env, TPU_HOST_BOUNDS="1,x"))
  with pytest.raises(fs.TopologyError, match=r"env:TPU_WORKER_ID='-1' is not ','-separated "
                                             r"integers >= 0"):
    fs.detect_topology(env=dict(env, TPU_WORKER_ID="-1"))
  with pytest.raises(fs.TopologyError, match="different ranks"):
    fs.detect_topology(env=dict(env, TPU_HOST_BOUNDS="1,1"))
  with pytest.raises(fs.TopologyError, match=r"^env:TPU_CHIPS_PER_HOST_BOUNDS='2,4,' is not "
                                             r"','-separated integers >= 1; fix or unset it\.$"):
    fs.detect_topology(env=dict(env, TPU_CHIPS_PER_HOST_BOUNDS="2,4,"))


def test_generation_only_name_without_layout_gives_no_count():
  t = fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "tpu7x"})
  assert (t.generation, t.num_chips, t.chip_grid) == ("v7", 0, ())
  t = fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "v5p-16"})  # 16 TensorCores, 2 per chip
  assert (t.num_chips, t.sources["num_chips"]) == (8, "env:TPU_ACCELERATOR_TYPE")


@pytest.mark.parametrize("env,grid,source", [
    # The non-TPU twin of test_layout_precedence, on 8 CPU devices.
    # process bounds over host bounds (both 8 devices; the grid says which answered)
    ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1", "TPU_PROCESS_BOUNDS": "2,2,1",
      "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,2"}, (2, 4, 1),
     "env:TPU_CHIPS_PER_PROCESS_BOUNDS*env:TPU_PROCESS_BOUNDS"),
    # bounds over TPU_TOPOLOGY
    ({"TPU_TOPOLOGY": "8", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,2"},
     (2, 2, 2), "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS"),
    # a lone bounds variable of either pair fixes nothing: TPU_TOPOLOGY answers
    ({"TPU_TOPOLOGY": "2x4", "TPU_PROCESS_BOUNDS": "1,1,2"}, (2, 4), "env:TPU_TOPOLOGY"),
    ({"TPU_TOPOLOGY": "4x2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,2"}, (4, 2), "env:TPU_TOPOLOGY"),
    # what the metadata's tpu-env calls TOPOLOGY is no environment variable of TPU VMs
    ({"TOPOLOGY": "2x2", "CHIPS_PER_HOST_BOUNDS": "2,2,1", "HOST_BOUNDS": "1,1,1"}, (),
     None),
])
def test_env_layout_precedence_on_cpu_devices(env, grid, source):
  t = fs.detect_topology(env=env)
  assert (t.chip_grid, t.sources.get("chip_grid")) == (grid, source)


@pytest.mark.parametrize("env,index,source", [
    # JAX's Cloud TPU cluster: worker id + slice id x processes per slice.
    ({"TPU_WORKER_ID": "3"}, 3, "env:TPU_WORKER_ID"),
    ({"TPU_WORKER_ID": "3", "MEGASCALE_SLICE_ID": "0"}, 3, "env:TPU_WORKER_ID"),
    # 1 process per slice here (8 CPU devices in this one): worker 0 of slice 1 is process 1
    ({"TPU_WORKER_ID": "0", "MEGASCALE_SLICE_ID": "1"}, 1,
     "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x jax.devices() process_index"),
    # 2x2x1 processes of one chip each per slice, 2 slices: worker 1 of slice 1 is 1 + 4
    ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1",
      "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1", "TPU_WORKER_ID": "1"}, 5,
     "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x env:TPU_PROCESS_BOUNDS"),
    # 3 hosts per slice (empty names don't count): worker 2 of slice 1 is 2 + 3
    ({"TPU_WORKER_HOSTNAMES": "h0, h1,h2,", "TPU_WORKER_ID": "2", "MEGASCALE_SLICE_ID": "1"}, 5,
     "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x env:TPU_WORKER_HOSTNAMES"),
    # TPU_PROCESS_ADDRESSES first, as JAX reads it
    ({"TPU_PROCESS_ADDRESSES": "a:8476,b:8476", "TPU_WORKER_HOSTNAMES": "h0,h1,h2",
      "TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "2"}, 5,
     "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x env:TPU_PROCESS_ADDRESSES"),
    # host bounds count processes before the host names do
    ({"TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,2",
      "TPU_WORKER_HOSTNAMES": "h0,h1,h2", "TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "1"}, 3,
     "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x env:TPU_HOST_BOUNDS"),
    # set but empty is unset (as libtpu and JAX read them)
    ({"TPU_WORKER_ID": " ", "MEGASCALE_SLICE_ID": ""}, 0, "jax.process_index()"),
    ({"WORKER_ID": "3"}, 0, "jax.process_index()"),  # tpu-env's short name is no env variable
    # libtpu's note where it found no worker number (after a compile for a described TPU,
    # inherited by every process started later) is no value
    ({"TPU_WORKER_ID": "WARNING: could not determine TPU worker number, please set env var "
                       "`TPU_WORKER_ID` manually, otherwise libtpu.so may not properly "
                       "initialize."}, 0, "jax.process_index()"),
])
def test_process_index_from_env(env, index, source):
  t = fs.detect_topology(env=env)
  assert (t.process_index, t.sources["process_index"]) == (index, source)


def test_env_names_slice_and_accelerator():
  t = fs.detect_topology(env={"MEGASCALE_SLICE_ID": "1", "TPU_ACCELERATOR_TYPE": " v5p-16 "})
  assert (t.slice_index, t.sources["slice_index"]) == (1, "env:MEGASCALE_SLICE_ID")
  assert (t.accelerator_type, t.generation, t.sources["generation"]) == (
      "v5p-16", "v5p", "env:TPU_ACCELERATOR_TYPE")
  assert t.cores_per_chip == 1  # off TPU a device is no TensorCore
  t = fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "", "ACCELERATOR_TYPE": "v5p-8"})
  assert t.accelerator_type is None and t.generation is None
  t = fs.detect_topology("v5p:2x2x2", env={})
  assert (t.generation, t.sources["generation"], t.chip_grid) == ("v5p", "override", (2, 2, 2))
  t = fs.detect_topology("v5e:2x4x1", env={})  # 2-D torus: the trailing 1 goes
  assert (t.generation, t.chip_grid, t.num_chips) == ("v5e", (2, 4), 8)


def test_detect_from_a_mesh_device_array():
  import numpy as np
  t = fs.detect_topology(env={}, devices=np.array(jax.devices()).reshape(2, 4))
  assert (t.num_devices, t.devices_per_process) == (8, 8)


def test_detect_asks_the_metadata_service_for_1_s_by_default(monkeypatch):
  asked = []
  monkeypatch.setattr(topo_mod._metadata, "get",
                      lambda path, *, timeout_s, url: asked.append((timeout_s, url)))
  fs.detect_topology(env={"GCE_METADATA_HOST": "md.local:8080"})
  assert asked and set(asked) == {(1.0, "http://md.local:8080/computeMetadata/v1")}


def test_detect_logs_the_topology_and_its_sources(caplog):
  import logging
  caplog.set_level(logging.DEBUG, logger="absl")
  t = fs.detect_topology(env={})
  [message] = [r.getMessage() for r in caplog.records if "detected topology" in r.getMessage()]
  assert message.startswith(f"detected topology {t} from {{'platform': 'jax.devices()', ")


def test_detect_from_cpu_devices_names_kind_and_sources():
  t = fs.detect_topology(env={})
  assert (t.device_kind, t.sources["device_kind"]) == ("cpu", "jax.devices()")
  assert (t.process_index, t.sources["process_index"]) == (0, "jax.process_index()")
  assert (t.slice_index, t.generation, t.cores_per_chip, t.hbm_bytes_per_device) == (
      0, None, 1, None)
  t = fs.detect_topology(env={}, devices=jax.devices()[:1])
  assert (t.num_devices, t.devices_per_process, t.sources["num_devices"]) == (1, 1, "devices")


def test_generation_of_device_kinds():
  # The device_kind strings jax reports per generation (v5p reports "TPU v5").
  assert topo_mod.generation_of("TPU v5") == "v5p"
  assert topo_mod.generation_of("TPU v5 lite") == "v5e"
  assert topo_mod.generation_of("TPU v4") == "v4"
  assert topo_mod.generation_of("TPU7x") == "v7"
  assert topo_mod.generation_of("cpu") is None
  assert topo_mod.generation_of("TPU v5 lite ") is None  # exact names, not substrings


def test_env_integer_errors_say_how_to_fix():
  with pytest.raises(fs.TopologyError, match=r"^env:MEGASCALE_NUM_SLICES='0' is not ','-separated "
                                             r"integers >= 1; fix or unset it\.$"):
    fs.detect_topology(env={"MEGASCALE_NUM_SLICES": "0"})


# --- detection from TPU and GPU devices, without libtpu ------------------------------------
#
# Stand-ins for devices with the attributes libtpu's described devices have (printed from
# `get_topology_desc(platform="tpu", topology_name="v5p:2x2x2", num_slices=2)`: per slice,
# process p holds the 4 chips of z = p; coords restart in each slice; slice_index is None on
# one slice), so the tpu-marked tests' logic also runs in the fast suite.

def _fake_tpu(kind, hosts, slices=1, cores=1, first_slice=0):
  """`hosts`: the chip coords of each process of one slice; `cores` devices per chip."""
  import types
  return [types.SimpleNamespace(platform="tpu", device_kind=kind, coords=c, core_on_chip=core,
                                process_index=s * len(hosts) + p,
                                slice_index=s if slices > 1 or first_slice else None)
          for s in range(first_slice, first_slice + slices) for p, chips in enumerate(hosts)
          for c in chips for core in range(cores)]


_V5P_16_HOSTS = [[(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)],
                 [(0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]]  # v5p-16: 2x2x2, 2 hosts


@pytest.fixture
def fake_devices_ok(monkeypatch):
  monkeypatch.setattr(topo_mod, "check_devices", lambda devices: list(devices))
  _device_files(monkeypatch)  # no metadata service is asked


def test_detect_from_tpu_devices_two_slices(fake_devices_ok):
  # 2 x v5p-16: 8 chips (2x2x2) per slice on 2 hosts of 4; megacore, 459 TFLOP/s and 95 GiB
  # per chip (Google's v5p table), 2 TensorCores per chip.
  t = fs.detect_topology(env={}, devices=_fake_tpu("TPU v5", _V5P_16_HOSTS, slices=2))
  assert (t.platform, t.device_kind, t.generation, t.chip_grid, t.num_chips, t.num_devices,
          t.num_processes, t.devices_per_process, t.num_slices, t.process_index,
          t.slice_index, t.cores_per_chip) == (
      "tpu", "TPU v5", "v5p", (2, 2, 2), 8, 16, 4, 4, 2, 0, 0, 2)
  assert (t.peak_flops_per_device, t.hbm_bytes_per_device) == (459e12, 95 * GiB)
  assert type(t.hbm_bytes_per_device) is int
  assert dict(t.sources) == {
      "platform": "devices", "device_kind": "devices", "generation": "devices device_kind",
      "num_devices": "devices", "num_processes": "devices process_index",
      "num_slices": "devices slice_index", "devices_per_process": "devices process_index",
      "chip_grid": "devices coords", "num_chips": "devices coords",
      "process_index": "jax.process_index()", "slice_index": "devices slice_index",
      "peak_flops_per_device": "facts table", "hbm_bytes_per_device": "facts table"}
  # Worker 1 of slice 1 is process 1 + 1 x 2 hosts per slice.
  t = fs.detect_topology(env={"TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "1"},
                         devices=_fake_tpu("TPU v5", _V5P_16_HOSTS, slices=2))
  assert (t.process_index, t.sources["process_index"]) == (
      3, "env:TPU_WORKER_ID + env:MEGASCALE_SLICE_ID x devices process_index")


def test_detect_from_the_devices_of_slice_1_alone(fake_devices_ok):
  t = fs.detect_topology(env={}, devices=_fake_tpu("TPU v5", _V5P_16_HOSTS, first_slice=1))
  assert (t.chip_grid, t.num_slices, t.slice_index, t.process_index, t.num_processes) == (
      (2, 2, 2), 1, 1, 2, 2)


def test_detect_from_tpu_devices_two_per_chip(fake_devices_ok):
  # v4 without megacore: 2 devices (TensorCores) per chip, each half of 275 TFLOP/s, 32 GiB.
  chips = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
  t = fs.detect_topology(env={}, devices=_fake_tpu("TPU v4", [chips], cores=2))
  assert (t.chip_grid, t.num_chips, t.num_devices, t.cores_per_chip) == ((2, 2, 1), 4, 8, 2)
  assert (t.peak_flops_per_device, t.hbm_bytes_per_device) == (275e12 / 2, 16 * GiB)
  # v5litepod-8: 2x4, one device per chip; a 2-D torus drops the z coordinate.
  chips = [(x, y, 0) for y in range(4) for x in range(2)]
  t = fs.detect_topology(env={}, devices=_fake_tpu("TPU v5 lite", [chips]))
  assert (t.generation, t.chip_grid, t.num_chips, t.peak_flops_per_device) == (
      "v5e", (2, 4), 8, 197e12)


def test_variables_that_disagree_with_the_tpu_devices_are_set_aside(fake_devices_ok, caplog):
  import logging
  caplog.set_level(logging.INFO, logger="absl")
  devices = _fake_tpu("TPU v5", _V5P_16_HOSTS, slices=2)  # 2 x v5p-16: 2x2x2 chips each
  t = fs.detect_topology(env={"TPU_ACCELERATOR_TYPE": "v5p-16"}, devices=devices)
  assert (t.accelerator_type, t.generation, t.sources["generation"], t.set_aside) == (
      "v5p-16", "v5p", "devices device_kind", "")
  assert not [r for r in caplog.records if r.levelno == logging.INFO]
  # Another generation, another grid, another slice count: the devices decide, every
  # variable of the environment is set aside (its worker id too), and the note says which.
  for env, note in [
      ({"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_WORKER_ID": "1"},
       "env:TPU_ACCELERATOR_TYPE 'v6e-8' is a v6e, but the devices are 'TPU v5' (v5p)"),
      ({"TPU_TOPOLOGY": "2x2x4", "TPU_WORKER_ID": "1"},
       "env:TPU_TOPOLOGY says 2 slice(s) x 2x2x4 = 32 devices, but 16 tpu devices are present"),
      ({"TPU_TOPOLOGY": "2x2x2", "MEGASCALE_NUM_SLICES": "4"},
       "env:TPU_TOPOLOGY and env:MEGASCALE_NUM_SLICES say 4 slice(s) x 2x2x2 = 32 devices, "
       "but 16 tpu devices are present"),
  ]:
    caplog.clear()
    t = fs.detect_topology(env=env, devices=devices)
    assert (t.accelerator_type, t.generation, t.chip_grid, t.num_slices, t.num_devices,
            t.process_index, t.sources["chip_grid"]) == (
        None, "v5p", (2, 2, 2), 2, 16, 0, "devices coords")
    assert t.set_aside == (note + ": topology from the devices present (chip grid 2x2x2), "
                           "the TPU_* variables and the metadata set aside")
    # One INFO line, no warning.
    assert [(r.levelname, r.getMessage()) for r in caplog.records
            if r.levelno >= logging.INFO] == [("INFO", "topology: " + t.set_aside)]


@pytest.mark.parametrize("override,said,theirs", [
    ("v6e-8", "topology override 'v6e-8' is a v6e, but the devices are 'TPU v5' (v5p)",
     "2x v5p:2x2x2"),
    ("v6e:2x4", "topology override generation 'v6e' is a v6e, but the devices are 'TPU v5' "
     "(v5p)", "2x v5p:2x2x2"),
    ("v5p:2x2x4", "topology from override says 2 slice(s) x 2x2x4 = 32 devices, but 16 tpu "
     "devices are present", "2x v5p:2x2x2"),
    ("3x v5p-16", "topology from override says 3 slice(s) x 2x2x2 = 24 devices, but 16 tpu "
     "devices are present", "2x v5p:2x2x2"),
])
def test_an_override_that_contradicts_the_tpu_devices_is_refused(fake_devices_ok, override,
                                                                 said, theirs):
  devices = _fake_tpu("TPU v5", _V5P_16_HOSTS, slices=2)
  with pytest.raises(fs.TopologyError) as e:
    fs.detect_topology(override, env={}, devices=devices)
  assert str(e.value) == (f"{said}; fix: leave the override out (the devices give the "
                          f"topology), give theirs ('{theirs}'), or run on the hardware it "
                          "describes")
  # What the fix says detects the same devices without complaint.
  t = fs.detect_topology(theirs, env={}, devices=devices)
  assert (t.num_slices, t.chip_grid, t.sources["chip_grid"]) == (2, (2, 2, 2), "override")


def test_coords_grid_of_part_of_a_host():
  assert _sources._coords_grid([(1, 1, 0)]) == (1, 1, 1)  # one chip, not at the origin
  assert _sources._coords_grid([(0, 1, 0), (1, 1, 0)]) == (2, 1, 1)
  assert _sources._coords_grid([(0, 0, 0), (1, 1, 0)]) == ()  # a diagonal: no box
  assert _sources._coords_grid([(0, 0, 0)] * 2) == (1, 1, 1)  # two devices of one chip


# --- part of a host: the variables describe more chips than the job was given ---------------
#
# Each row: the environment a real job finds (as its VM, GKE node or launcher sets it) and
# the devices JAX reports there, with the right value of every field. Sources of the
# variables: this project's one-chip TPU v5e VM (jax.devices() printed there: one 'TPU v5
# lite' at (0,0,0)); a GKE pod on a v5e 2x2 node (its TPU_* variables, printed in the pod);
# Ray's TPU accelerator manager (python/ray/_private/accelerators/tpu.py: an actor of 1 or 2
# chips gets TPU_VISIBLE_CHIPS and TPU_CHIPS_PER_HOST_BOUNDS 1,1,1 / 1,2,1 with
# TPU_HOST_BOUNDS 1,1,1, beside the node's GKE variables); libtpu's several-processes-per-
# host variables (TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS, TPU_PROCESS_ADDRESSES,
# TPU_PROCESS_PORT, TPU_VISIBLE_DEVICES), as pytorch/xla's launcher and JAX's own examples
# set them on a v4-8 / v5e-4 VM, whose metadata still describes the whole VM. The devices
# are `_fake_tpu` stand-ins with what JAX reports there (kind, coords, processes).

_CHIP_VM_ENV = {  # the project's one-chip v5e VM: its variables describe the 4-chip host
    "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "TPU_HOST_BOUNDS": "1,1,1", "TPU_TOPOLOGY": "2x2", "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "true"}
_GKE_V5E_2X2 = {  # a GKE pod on a v5e 2x2 node (ct5lp-hightpu-4t)
    "TPU_TOPOLOGY": "2x2", "TPU_WORKER_ID": "0", "TPU_SKIP_MDS_QUERY": "true",
    "TPU_TOPOLOGY_WRAP": "false,false,false", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_RUNTIME_METRICS_PORTS": "8431,8432,8433,8434",
    "TPU_TOPOLOGY_ALT": "false", "TPU_HOST_BOUNDS": "1,1,1", "TPU_SOFT_SLICE": "true",
    "TPU_WORKER_HOSTNAMES": "job-0.job"}
_GKE_V6E_2X4 = dict(_GKE_V5E_2X2, TPU_TOPOLOGY="2x4", TPU_CHIPS_PER_HOST_BOUNDS="2,4,1",
                    TPU_ACCELERATOR_TYPE="v6e-8")
_V4_8_METADATA = {"accelerator-type": "v4-8", "agent-worker-number": "0",
                  "tpu-env": "ACCELERATOR_TYPE: 'v4-8'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\n"
                             "HOST_BOUNDS: '1,1,1'\nTOPOLOGY: '2x2x1'\nWORKER_ID: '0'\n"}
_SQUARE = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]

PARTIAL_HOSTS = [
    # (name, where, env, metadata, devices: (kind, chips of each process, cores per chip),
    #  want: (grid, chips, devices, processes, devices per process, process index,
    #         accelerator type, peak FLOP/s per device, HBM per device), set_aside begins)
    ("chip-vm-v5e-1-of-4", "one-chip v5e VM, the host's variables",
     _CHIP_VM_ENV, None, ("TPU v5 lite", [[(0, 0, 0)]], 1),
     ((1, 1), 1, 1, 1, 1, 0, None, 197e12, 16 * GiB),
     "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS says 1 slice(s) x 2x2 = 4 devices, "
     "but 1 tpu device is present"),
    ("chip-vm-v5e-chip-3", "the same, given the host's last chip",
     _CHIP_VM_ENV, None, ("TPU v5 lite", [[(1, 1, 0)]], 1),
     ((1, 1), 1, 1, 1, 1, 0, None, 197e12, 16 * GiB), "env:TPU_CHIPS_PER_HOST_BOUNDS"),
    ("v6e-1-of-8", "one chip of a v6e 2x4 node or VM, the host's variables",
     _GKE_V6E_2X4, None, ("TPU v6 lite", [[(0, 0, 0)]], 1),
     ((1, 1), 1, 1, 1, 1, 0, None, 918e12, 32 * GiB),
     "env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS says 1 slice(s) x 2x4 = 8 devices"),
    ("gke-v5e-2x2-whole-node", "GKE, google.com/tpu: 4 on the 2x2 node: all agree",
     _GKE_V5E_2X2, None, ("TPU v5 lite", [_SQUARE], 1),
     ((2, 2), 4, 4, 1, 4, 0, "v5litepod-4", 197e12, 16 * GiB), ""),
    ("gke-v5e-1x1-node", "GKE, google.com/tpu: 1 on a 1x1 node: all agree",
     dict(_GKE_V5E_2X2, TPU_TOPOLOGY="1x1", TPU_CHIPS_PER_HOST_BOUNDS="1,1,1",
          TPU_ACCELERATOR_TYPE="v5litepod-1"), None, ("TPU v5 lite", [[(0, 0, 0)]], 1),
     ((1, 1), 1, 1, 1, 1, 0, "v5litepod-1", 197e12, 16 * GiB), ""),
    ("ray-1-chip-of-v6e-8", "Ray actor of TPU: 1 on a GKE v6e-8 node",
     dict(_GKE_V6E_2X4, TPU_VISIBLE_CHIPS="3", TPU_CHIPS_PER_HOST_BOUNDS="1,1,1"), None,
     ("TPU v6 lite", [[(0, 0, 0)]], 1), ((1, 1), 1, 1, 1, 1, 0, "v6e-8", 918e12, 32 * GiB),
     ""),
    ("ray-2-chips-of-v6e-8", "Ray actor of TPU: 2 on a GKE v6e-8 node",
     dict(_GKE_V6E_2X4, TPU_VISIBLE_CHIPS="0,1", TPU_CHIPS_PER_HOST_BOUNDS="1,2,1"), None,
     ("TPU v6 lite", [[(0, 0, 0), (0, 1, 0)]], 1),
     ((1, 2), 2, 2, 1, 2, 0, "v6e-8", 918e12, 32 * GiB), ""),
    ("v4-8-one-chip-per-process", "4 independent processes of one chip on a v4-8 VM",
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
      "TPU_VISIBLE_DEVICES": "2", "TPU_PROCESS_PORT": "8478",
      "TPU_PROCESS_ADDRESSES": "localhost:8478"}, _V4_8_METADATA,
     ("TPU v4", [[(0, 0, 0)]], 1), ((1, 1, 1), 1, 1, 1, 1, 0, "v4-8", 275e12, 32 * GiB), ""),
    ("v4-8-visible-chip-host-bounds", "one chip of a v4-8 VM by TPU_VISIBLE_DEVICES alone",
     {"TPU_VISIBLE_DEVICES": "2"}, _V4_8_METADATA, ("TPU v4", [[(0, 1, 0)]], 1),
     ((1, 1, 1), 1, 1, 1, 1, 0, None, 275e12, 32 * GiB),
     "metadata:instance/attributes/tpu-env:CHIPS_PER_HOST_BOUNDS*"),
    ("v5e-4-four-processes-one-job", "4 processes of one chip joined in one job (v5e-4)",
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1",
      "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
      "TPU_PROCESS_PORT": "8476", "TPU_VISIBLE_CHIPS": "0", "TPU_ACCELERATOR_TYPE":
      "v5litepod-4"}, None, ("TPU v5 lite", [[c] for c in _SQUARE], 1),
     ((2, 2), 4, 4, 4, 1, 0, "v5litepod-4", 197e12, 16 * GiB), ""),
]
_PARTIAL_FIELDS = ("chip_grid", "num_chips", "num_devices", "num_processes",
                   "devices_per_process", "process_index", "accelerator_type",
                   "peak_flops_per_device", "hbm_bytes_per_device")


@pytest.mark.parametrize("name,where,env,metadata,devs,want,note", PARTIAL_HOSTS,
                         ids=[row[0] for row in PARTIAL_HOSTS])
def test_part_of_a_host(fake_devices_ok, monkeypatch, name, where, env, metadata, devs, want,
                        note):
  if metadata is not None:  # a Cloud TPU VM: its metadata describes the whole VM
    monkeypatch.setattr(topo_mod._metadata, "get", lambda path, *, timeout_s, url:
                        metadata.get(path.removeprefix("instance/attributes/")))
    env = dict(env, GCE_METADATA_HOST="metadata.local")
  kind, hosts, cores = devs
  t = fs.detect_topology(env=env, devices=_fake_tpu(kind, hosts, cores=cores))
  assert tuple(getattr(t, f) for f in _PARTIAL_FIELDS) == want, where
  assert t.set_aside.startswith(note) and bool(t.set_aside) == bool(note), t.set_aside
  if note:  # the devices' own layout answered
    assert t.sources["chip_grid"] == "devices coords"
  # The same machine with the override the message of a refusal gives: no note.
  theirs = f"{t.generation}:{'x'.join(map(str, t.chip_grid))}"
  assert fs.detect_topology(theirs, env=env, devices=_fake_tpu(kind, hosts)).set_aside == ""


def test_one_chip_vm_variables_on_one_cpu_device_build_a_mesh():
  # The one-chip VM's variables where one simulated device is present: detection, then the
  # mesh over the devices present (show_topology's and train_lm's path on that VM).
  t = fs.detect_topology(env=_CHIP_VM_ENV, devices=jax.devices()[:1])
  assert (t.platform, t.num_devices, t.chip_grid, t.accelerator_type) == ("cpu", 1, (), None)
  assert t.set_aside.startswith("env:TPU_CHIPS_PER_HOST_BOUNDS*env:TPU_HOST_BOUNDS says 1 "
                                "slice(s) x 2x2 = 4 devices, but 1 cpu device is present")
  mesh = fs.make_mesh("fsdp=-1", topology=t, devices=jax.devices()[:1])
  assert dict(mesh.shape) == {"fsdp": 1}
  with pytest.raises(fs.TopologyError, match=r"^topology from override says 1 slice\(s\) x "
                                             r"2x2 = 4 devices, but 1 cpu device is present; "
                                             r"fix: leave the override out .*such as '1'\)"):
    fs.detect_topology("v5e:2x2", env=_CHIP_VM_ENV, devices=jax.devices()[:1])


def test_detect_from_gpu_devices(fake_devices_ok):
  import types
  devices = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                   process_index=0) for _ in range(8)]
  t = fs.detect_topology(env={}, devices=devices)
  # NVIDIA's H100 SXM data sheet: 989 TFLOP/s dense bf16, 80 GB.
  assert (t.peak_flops_per_device, t.hbm_bytes_per_device) == (989e12, 80 * 10**9)
  assert (t.generation, t.num_chips, t.chip_grid, t.cores_per_chip) == (None, 0, (), 1)
  assert t.sources["peak_flops_per_device"] == "facts table"


# --- describing a TPU target without the hardware ------------------------------------------

@pytest.mark.parametrize("gen,chips,grid", [
    # Google Cloud's topology tables (v5p, v4, TPU7x: 3-D; v5e, v6e, v2, v3: 2-D).
    ("v5p", 4, (2, 2, 1)), ("v5p", 8, (2, 2, 2)), ("v5p", 16, (2, 2, 4)), ("v5p", 32, (2, 4, 4)),
    ("v5p", 64, (4, 4, 4)), ("v4", 128, (4, 4, 8)), ("v4", 256, (4, 8, 8)),
    ("v7", 512, (8, 8, 8)), ("v5e", 1, (1, 1)), ("v5e", 4, (2, 2)), ("v5e", 8, (2, 4)),
    ("v6e", 16, (4, 4)), ("v6e", 32, (4, 8)), ("v6e", 256, (16, 16)), ("v3", 512, (16, 32)),
])
def test_standard_grid(gen, chips, grid):
  assert topo_mod.standard_grid(gen, chips) == grid


def test_standard_grid_bad_input():
  with pytest.raises(fs.TopologyError, match=r"48 v5p chips is not a standard slice.*'v5p:4x4x4'"):
    topo_mod.standard_grid("v5p", 48)
  with pytest.raises(fs.TopologyError, match=r"generation='v9': expected one of \['v2'"):
    topo_mod.standard_grid("v9", 8)
  with pytest.raises(fs.TopologyError, match=r"chips='8' \(str\): expected a positive int"):
    topo_mod.standard_grid("v5p", "8")
  with pytest.raises(fs.TopologyError, match=r"^generation=5 \(int\): expected one of "
                                             r"\['v2', 'v3', 'v4', 'v5e', 'v5p', 'v6e', 'v7'\]\.$"):
    topo_mod.standard_grid(5, 8)
  # The smallest 3-D slice is 2x2x1 = 4 chips (v5p-8); a 2-D one can be one chip.
  with pytest.raises(fs.TopologyError, match=r"^2 v5p chips is not a standard slice \(a power "
                                             r"of two, at least 4\); give the grid, e\.g\. "
                                             r"'v5p:2x2x1'\.$"):
    topo_mod.standard_grid("v5p", 2)
  with pytest.raises(fs.TopologyError, match=r"^3 v6e chips is not a standard slice \(a power "
                                             r"of two, at least 1\); give the grid, e\.g\. "
                                             r"'v6e:2x2'\.$"):
    topo_mod.standard_grid("v6e", 3)


@pytest.mark.tpu
@pytest.mark.parametrize("target,want", [
    # (grid, chips per slice, devices, processes, devices per process, slices), from Google's
    # tables: v5p-128 = 64 chips 4x4x4 on 16 hosts; v5litepod-8 = 2x4 on one host; v4-256 =
    # 128 chips 4x4x8 on 32 hosts (megacore); tpu7x-8 = 4 chips, 2 TensorCores each.
    ("v5p-128", ((4, 4, 4), 64, 64, 16, 4, 1)),
    ("2x v5p-128", ((4, 4, 4), 64, 128, 32, 4, 2)),
    ("v5p:4x4x4", ((4, 4, 4), 64, 64, 16, 4, 1)),
    ("v5:2x2x1", ((2, 2, 1), 4, 4, 1, 4, 1)),
    ("v5litepod-8", ((2, 4), 8, 8, 1, 8, 1)),
    ("v4-256", ((4, 4, 8), 128, 128, 32, 4, 1)),
    ("tpu7x-8", ((2, 2, 1), 4, 8, 1, 8, 1)),
])
def test_target_devices(tpu_devices, target, want):
  t = fs.detect_topology(target, devices=topo_mod.target_devices(target), env={})
  assert (t.chip_grid, t.num_chips, t.num_devices, t.num_processes, t.devices_per_process,
          t.num_slices) == want


def test_target_devices_without_libtpu(monkeypatch):
  real = _override.importlib.util.find_spec
  monkeypatch.setattr(_override.importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(fs.TopologyError, match=r"describing the TPU target 'v5p-128' without the "
                                             r"hardware needs libtpu, which is not installed: "
                                             r"pip install \"fnscale\[tpu\]\""):
    topo_mod.target_devices("v5p-128")
  with pytest.raises(fs.TopologyError, match=r"target '4x4' names no TPU generation"):
    topo_mod.target_devices("4x4")


@pytest.mark.parametrize("target,name,kw", [
    # libtpu's topology names and options for Google's slices: v5p-128 = 64 chips 4x4x4;
    # v4 runs as megacore; v5e/v6e slices of up to 8 chips sit on one host; TPU7x is
    # "tpu7x" to libtpu; "v5" is libtpu's own name of v5p.
    ("v5p-128", "v5p:4x4x4", {}),
    ("2x v5p-16", "v5p:2x2x2", {"num_slices": 2}),
    ("v5:2x2x1", "v5p:2x2x1", {}),
    ("v4-256", "v4:4x4x8", {"chip_config_name": "megacore"}),
    ("v6e-8", "v6e:2x4", {"chips_per_host_bounds": (2, 4, 1)}),
    ("v5litepod-4", "v5e:2x2", {"chips_per_host_bounds": (2, 2, 1)}),
    ("v6e-16", "v6e:4x4", {}),
    ("v5e:3x3", "v5e:3x3", {}),  # more chips than one host's 8: libtpu's 4 per host
    ("tpu7x-8", "tpu7x:2x2x1", {}),
    ("3x tpu7x:2x2x2", "tpu7x:2x2x2", {"num_slices": 3}),
])
def test_target_devices_asks_libtpu_for(monkeypatch, target, name, kw):
  import types
  from jax.experimental import topologies
  asked = []

  def describe(**kwargs):
    asked.append(kwargs)
    return types.SimpleNamespace(devices=("d0", "d1"))
  monkeypatch.setattr(topologies, "get_topology_desc", describe)
  real = _override.importlib.util.find_spec  # libtpu need not be installed to run this test
  monkeypatch.setattr(_override.importlib.util, "find_spec",
                      lambda m, *a: object() if m == "libtpu" else real(m, *a))
  assert topo_mod.target_devices(target) == ["d0", "d1"]
  assert asked == [{"platform": "tpu", "topology_name": name, **kw}]


def test_target_devices_libtpu_failure(monkeypatch):
  from jax.experimental import topologies

  def fail(**kwargs):
    raise jax.errors.JaxRuntimeError("lockfile held")
  monkeypatch.setattr(topologies, "get_topology_desc", fail)
  real = _override.importlib.util.find_spec
  monkeypatch.setattr(_override.importlib.util, "find_spec",
                      lambda m, *a: object() if m == "libtpu" else real(m, *a))
  with pytest.raises(fs.TopologyError, match=r"^libtpu could not describe 'v4:2x2x1' "
                                             r"\{'chip_config_name': 'megacore'\} for target "
                                             r"'v4-8': lockfile held\. If another process on "
                                             r"this machine holds libtpu \(its lockfile\), set "
                                             r"ALLOW_MULTIPLE_LIBTPU_LOAD=1\.$"):
    topo_mod.target_devices("v4-8")


def _recipe(*args, env_vars=()):
  import os, subprocess, sys
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(env_vars)
  root = os.path.dirname(os.path.dirname(__file__))
  return subprocess.run([sys.executable, os.path.join(root, "recipes", "show_topology.py"),
                         *args], env=env, timeout=120, capture_output=True, text=True)


@pytest.mark.tpu
@pytest.mark.slow
def test_show_topology_describes_a_target(tpu_devices):
  out = _recipe("--topology=v5p-128", "--mesh=fsdp=-1,tensor=4")
  assert out.returncode == 0, out.stderr
  assert "describing target 'v5p-128'" in out.stdout
  assert ("tpu 'TPU v5' (v5p-128): 64 devices = 1 slice(s) x chip grid 4x4x4, 16 process(es) "
          "x 4 devices, peak 459 TFLOP/s") in out.stdout
  assert "Mesh {'fsdp': 16, 'tensor': 4} over 64 devices" in out.stdout
  out = _recipe("--topology=2x v5p-128", "--mesh=hybrid")
  assert out.returncode == 0, out.stderr
  assert "128 devices = 2 slice(s) x chip grid 4x4x4, 32 process(es)" in out.stdout
  assert "Mesh {'replica': 2, 'fsdp': 64} over 128 devices" in out.stdout
  assert "replica    size    2  Auto     DCN (across slices)" in out.stdout
  out = _recipe("--topology=v5p-96")
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "error: 48 v5p chips is not a standard slice" in out.stderr


# --- libtpu's start-up warnings on a machine without a TPU ---------------------------------

def test_quiet_libtpu_env_only_without_a_tpu(monkeypatch):
  monkeypatch.setattr(_machine, "_tpu_device_files", lambda: False)
  real = _machine.importlib.util.find_spec  # libtpu installed (the tpu extra) or not
  monkeypatch.setattr(_machine.importlib.util, "find_spec",
                      lambda name, *a: object() if name == "libtpu" else real(name, *a))
  env = {}
  assert topo_mod.quiet_libtpu(env) == {"TPU_WORKER_HOSTNAMES": "localhost",
                                                    "TPU_PROCESS_BOUNDS": "1,1,1"}
  assert env == {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_PROCESS_BOUNDS": "1,1,1"}
  for var in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS"):
    env = {var: "x"}  # a launcher's own layout is never touched
    assert topo_mod.quiet_libtpu(env) == {} and env == {var: "x"}
  monkeypatch.setattr(_machine, "_tpu_device_files", lambda: True)
  env = {}
  assert topo_mod.quiet_libtpu(env) == {} and env == {}
  monkeypatch.setattr(_machine, "_tpu_device_files", lambda: False)
  monkeypatch.setattr(_machine.importlib.util, "find_spec", lambda name, *a: None)
  env = {}  # without libtpu there is nothing to quiet
  assert topo_mod.quiet_libtpu(env) == {} and env == {}


@pytest.mark.tpu
def test_quiet_libtpu_env_does_not_change_detection(tpu_devices):
  # A lone TPU_PROCESS_BOUNDS fixes no layout: the described devices answer.
  t = fs.detect_topology(env=dict(topo_mod.QUIET_LIBTPU_ENV), devices=tpu_devices("v5p:4x4x4"))
  assert (t.chip_grid, t.num_processes, t.sources["chip_grid"]) == (
      (4, 4, 4), 16, "devices coords")


@pytest.mark.tpu
def test_quiet_libtpu_silences_libtpu_without_a_tpu(tpu_devices):
  import os, subprocess, sys
  if _machine._tpu_device_files():
    pytest.skip("this machine has a TPU: libtpu finds its hosts itself")
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS", *topo_mod.QUIET_LIBTPU_ENV)}
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(__file__))
  code = ("import fnscale, jax; fnscale.quiet_libtpu(); jax.devices(); "
          "from jax.experimental import topologies; "
          "print(len(topologies.get_topology_desc(platform='tpu', topology_name='v5p:2x2x2')"
          ".devices))")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "8", out.stderr
  assert "unexpected worker hostname" not in out.stderr
  assert "Failed to find host bounds" not in out.stderr
  assert out.stderr.strip() == ""


_IMPORT_FNSCALE = ("import fnscale, importlib, pkgutil\n"
                   "for m in pkgutil.walk_packages(fnscale.__path__, 'fnscale.'):\n"
                   "  importlib.import_module(m.name)")


def _environ_changes(*steps: str) -> list[dict]:
  """Per step, {name: [value before, value after]} of os.environ around running it (after
  the steps before it) in one fresh process, where libtpu's quieting would apply (libtpu
  installed, no TPU layout variable set)."""
  import json, os, subprocess, sys
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("TPU_", "MEGASCALE_")) and k != "JAX_PLATFORMS"}
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(__file__))
  code = "import json, os\nchanges = []\n"
  for step in steps:
    code += (f"before = dict(os.environ)\n{step}\nafter = dict(os.environ)\n"
             "changes.append({k: [before.get(k), after.get(k)] for k in sorted(set(before) | "
             "set(after)) if before.get(k) != after.get(k)})\n")
  code += "print(json.dumps(changes))"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_fnscale_changes_no_environment_variable():
  # jax's own import sets a few variables (TPU_SKIP_MDS_QUERY, ...): with jax imported
  # first, importing fnscale and every submodule changes nothing; the quieting is an
  # explicit call, and it does change the environment where libtpu is installed (the tpu
  # extra; without it there is nothing to quiet).
  import importlib.util
  jax_import, fnscale_after_jax, quiet = _environ_changes(
      "import jax", _IMPORT_FNSCALE, "fnscale.quiet_libtpu()")
  assert fnscale_after_jax == {}
  libtpu = importlib.util.find_spec("libtpu") is not None
  assert quiet == {k: [None, v] for k, v in topo_mod.QUIET_LIBTPU_ENV.items() if libtpu}
  # Imported first, fnscale changes exactly what its import of jax does.
  assert _environ_changes(_IMPORT_FNSCALE) == [jax_import]


# --- wrong types: a TopologyError naming the argument, what it got and what it expects -----

@pytest.mark.parametrize("call,pattern", [
    (lambda: fs.detect_topology(5, env={}),
     r"override=5 \(int\): expected None or a str such as 'v5p-128'"),
    (lambda: fs.detect_topology(env="TPU_TOPOLOGY=2x2"),
     r"env='TPU_TOPOLOGY=2x2' \(str\): expected None or a mapping of environment variables"),
    (lambda: fs.detect_topology(env={}, devices=[1, 2]),
     r"devices has element 1 \(int\): expected a non-empty sequence of jax.Device"),
    (lambda: fs.detect_topology(env={}, devices=[1, "a"]),
     r"devices has element 1 \(int\): expected"),
    (lambda: fs.detect_topology(env={}, devices=[]),
     r"devices has an empty sequence: expected a non-empty sequence of jax.Device"),
    (lambda: fs.detect_topology(env={}, devices=jax.devices()[0]),
     r"devices=CpuDevice\(id=0\) \(\w+\): expected a non-empty sequence of jax.Device"),
    (lambda: fs.detect_topology(env={}, metadata_timeout_s="1"),
     r"metadata_timeout_s='1' \(str\): expected a number of seconds > 0"),
    (lambda: fs.detect_topology(env={}, metadata_timeout_s=0),
     r"metadata_timeout_s=0: expected seconds > 0"),
    (lambda: topo_mod.parse_accelerator_type(128),
     r"accelerator_type=128 \(int\): expected a str such as 'v5p-128'"),
    (lambda: topo_mod.generation_of(None),
     r"device_kind=None \(NoneType\): expected a str such as 'TPU v5'\.$"),
    (lambda: topo_mod.gpu_facts(3),
     r"device_kind=3 \(int\): expected a str such as 'NVIDIA H200'\.$"),
    (lambda: fs.simulate_cpu_devices("8"),
     r"simulated device count n='8' \(str\) must be a positive int"),
    (lambda: topo_mod.target_devices(None),
     r"target=None \(NoneType\): expected a str such as 'v5p-128'"),
])
def test_wrong_types_are_topology_errors(call, pattern):
  with pytest.raises(fs.TopologyError, match=pattern):
    call()
