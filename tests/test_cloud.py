"""fnscale.cloud against a fake GCE metadata service and Cloud TPU API on 127.0.0.1, reached
through Google's TpuClient (REST transport, endpoint override) and google-auth."""
import http.server
import json
import os
import socket
import subprocess
import sys
import urllib.parse

import pytest

from fnscale import cloud
from fnscale import CloudError, InputError
from local_server import serving

pytest.importorskip("google.cloud.tpu_v2", reason="the cloud extra (google-cloud-tpu)")
from google.oauth2 import credentials as oauth2  # noqa: E402  (after the skip)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "ya29.test-token-value"
TPU_ENV = ("ACCELERATOR_TYPE: 'v5litepod-16'\nCONSUMER_PROJECT_ID: 'proj-from-env'\n"
           "NODE_ID: 'my-tpu'\nWORKER_ID: '0'\nZONE: 'us-west4-a'\n")
NODE = "projects/my-project/locations/us-west4-a/nodes/my-tpu"


def _metadata(**overrides):
  values = {
      "project/project-id": "my-project",
      "instance/zone": "projects/123456789/zones/us-west4-a",
      "instance/attributes/accelerator-type": "v5litepod-16",
      "instance/attributes/agent-worker-number": "0",
      "instance/attributes/tpu-env": TPU_ENV,
      "instance/name": "t1v-n-0a1b2c3d-w-0",
      "instance/service-accounts/default/token": json.dumps(
          {"access_token": TOKEN, "expires_in": 3599, "token_type": "Bearer"}),
      "instance/service-accounts/default/": json.dumps(
          {"email": "sa@my-project.iam.gserviceaccount.com", "aliases": ["default"],
           "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}),
  }
  values.update(overrides)
  return {k: v for k, v in values.items() if v is not None}


class _Fake(http.server.ThreadingHTTPServer):
  """Metadata under /computeMetadata/v1/ (needs Metadata-Flavor: Google) and the TPU API."""

  def __init__(self):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.metadata = _metadata()
    self.node = {"name": NODE}
    self.api_status = 200
    self.requests = []  # (method, path, headers, query) of every API request


class _Handler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def _send(self, status, body, content_type="application/json"):
    data = body.encode()
    self.send_response(status)
    self.send_header("Metadata-Flavor", "Google")
    self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _handle(self, method):
    server = self.server
    url = urllib.parse.urlsplit(self.path)
    if url.path.startswith("/computeMetadata/v1/"):
      if self.headers.get("Metadata-Flavor") != "Google" or method != "GET":
        return self._send(403, "Missing Metadata-Flavor:Google header.", "text/plain")
      key = url.path[len("/computeMetadata/v1/"):]
      if key not in server.metadata:
        return self._send(404, "not found", "text/plain")
      kind = "application/json" if server.metadata[key].startswith("{") else "text/plain"
      return self._send(200, server.metadata[key], kind)
    query = urllib.parse.parse_qs(url.query)
    server.requests.append((method, url.path, {k.lower(): v for k, v in self.headers.items()},
                            query))
    if server.api_status != 200:
      return self._send(server.api_status, json.dumps(
          {"error": {"code": server.api_status, "message": "Permission 'tpu.nodes.delete' "
                     "denied", "status": "PERMISSION_DENIED"}}))
    if method == "GET":
      return self._send(200, json.dumps(server.node))
    return self._send(200, json.dumps({"name": "projects/my-project/locations/us-west4-a/"
                                               "operations/operation-1", "done": False}))

  def do_GET(self):  # pylint: disable=invalid-name
    self._handle("GET")

  def do_DELETE(self):  # pylint: disable=invalid-name
    self._handle("DELETE")


@pytest.fixture
def fake():
  with serving(_Fake()) as server:
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server


@pytest.fixture(autouse=True)
def _no_ambient_worker(monkeypatch):
  for name in ("TPU_WORKER_ID", "MEGASCALE_SLICE_ID", "GCE_METADATA_HOST", cloud.API_URL_ENV):
    monkeypatch.delenv(name, raising=False)


def _credentials():
  return oauth2.Credentials(token=TOKEN)  # a fixed access token: no refresh, no network


def _request(fake, tmp_path, **kw):
  kw.setdefault("sentinel", tmp_path / "keep")
  kw.setdefault("credentials", _credentials())
  return cloud.shutdown_request(metadata_url=fake.url, api_url=fake.url, **kw)


def _deletes(fake):
  return [r for r in fake.requests if r[0] == "DELETE"]


def test_deletes_the_node_through_the_client(fake, tmp_path):
  request = _request(fake, tmp_path, delay_s=0)
  assert request.action == "delete_node"
  assert (request.project, request.zone, request.node, request.worker) == (
      "my-project", "us-west4-a", "my-tpu", 0)
  assert request.name == NODE and request.endpoint == fake.url
  assert TOKEN not in repr(request)  # requests are safe to print
  # Planning looked the node up (read-only) and sent no delete.
  assert [(m, p) for m, p, _, _ in fake.requests] == [("GET", "/v2/" + NODE)]
  assert fake.requests[0][2]["authorization"] == f"Bearer {TOKEN}"

  result = cloud.execute(request, credentials=_credentials())
  assert result.sent and result.operation.endswith("/operations/operation-1")
  (method, path, headers, _), = _deletes(fake)
  assert (method, path) == ("DELETE", "/v2/" + NODE)
  assert headers["authorization"] == f"Bearer {TOKEN}"


def test_queued_resource_is_deleted_with_force(fake, tmp_path):
  qr = "projects/my-project/locations/us-west4-a/queuedResources/my-qr"
  fake.node["queuedResource"] = qr
  request = _request(fake, tmp_path)
  assert request.action == "delete_queued_resource" and request.queued_resource == qr
  assert cloud.execute(request, credentials=_credentials()).sent
  (method, path, headers, query), = _deletes(fake)
  assert (method, path, query["force"]) == ("DELETE", f"/v2/{qr}", ["true"])
  assert headers["authorization"] == f"Bearer {TOKEN}"
  # Given by name, no lookup is needed.
  fake.requests.clear()
  request = _request(fake, tmp_path, queued_resource="other-qr")
  assert fake.requests == []
  assert request.name == "projects/my-project/locations/us-west4-a/queuedResources/other-qr"


def test_dry_run_sends_nothing_and_shows_the_call(fake, tmp_path, capsys):
  request = _request(fake, tmp_path, dry_run=True)
  result = cloud.execute(request, credentials=_credentials())
  assert not result.sent and _deletes(fake) == []
  err = capsys.readouterr().err
  assert f"TpuClient.delete_node(name='{NODE}') at {fake.url}" in err
  assert TOKEN not in err and TOKEN not in result.reason


def test_sentinel_cancels(fake, tmp_path):
  request = _request(fake, tmp_path)
  (tmp_path / "keep").write_text("")
  result = cloud.execute(request, credentials=_credentials())
  assert not result.sent and "sentinel" in result.reason and str(tmp_path / "keep") in result.reason
  assert _deletes(fake) == []


@pytest.mark.parametrize("url", ["http://tpu.googleapis.com", "http://10.0.0.7:8080",
                                 "ftp://127.0.0.1", "tpu.googleapis.com", "https://"])
def test_the_api_endpoint_must_be_https_off_loopback(fake, tmp_path, monkeypatch, url):
  with pytest.raises(InputError, match="must be an https:// URL"):
    cloud.shutdown_request(metadata_url=fake.url, api_url=url, sentinel=tmp_path / "keep")
  monkeypatch.setenv(cloud.API_URL_ENV, url)
  with pytest.raises(InputError, match=f"{cloud.API_URL_ENV}="):
    cloud.shutdown_request(metadata_url=fake.url, sentinel=tmp_path / "keep")
  assert fake.requests == []  # refused before any request carried a token


def test_https_and_loopback_endpoints_are_accepted(monkeypatch):
  for url in ("https://tpu.googleapis.com", "https://europe-west4-tpu.example.com:443/",
              "http://127.0.0.1:8080", "http://[::1]:9", "http://localhost:1"):
    assert cloud.api_endpoint(url) == url.rstrip("/")
  monkeypatch.delenv(cloud.API_URL_ENV, raising=False)
  assert cloud.api_endpoint() == "https://tpu.googleapis.com"


@pytest.mark.parametrize("how", ["metadata", "env", "argument", "tpu_env"])
def test_only_worker_zero_acts(fake, tmp_path, monkeypatch, how):
  if how == "metadata":
    fake.metadata["instance/attributes/agent-worker-number"] = "3"
    request = _request(fake, tmp_path)
  elif how == "env":
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    request = _request(fake, tmp_path)
  elif how == "argument":
    request = _request(fake, tmp_path, worker=1)
  else:
    del fake.metadata["instance/attributes/agent-worker-number"]
    fake.metadata["instance/attributes/tpu-env"] = TPU_ENV.replace("WORKER_ID: '0'",
                                                                   "WORKER_ID: '5'")
    request = _request(fake, tmp_path)
  assert request.action == "none" and "only worker 0 deletes" in request.reason
  assert not cloud.execute(request).sent
  assert fake.requests == []


def test_other_slices_do_nothing(fake, tmp_path, monkeypatch):
  monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
  request = _request(fake, tmp_path)
  assert request.action == "none" and "slice 1" in request.reason


def test_off_a_tpu_vm_does_nothing_and_says_why(fake, tmp_path):
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    closed = f"127.0.0.1:{s.getsockname()[1]}"
  request = cloud.shutdown_at_exit(0, metadata_url=closed, api_url=fake.url,
                                sentinel=tmp_path / "keep", timeout_s=0.5, register=False)
  assert request.action == "none" and "unreachable" in request.reason and closed in request.reason
  del fake.metadata["instance/attributes/accelerator-type"]
  request = _request(fake, tmp_path)
  assert request.action == "none" and "not a Cloud TPU VM" in request.reason
  assert fake.requests == []


def test_node_name_missing_says_how_to_fix(fake, tmp_path):
  fake.metadata["instance/attributes/tpu-env"] = "ACCELERATOR_TYPE: 'v4-8'\n"
  request = _request(fake, tmp_path)
  assert request.action == "none" and "node not found" in request.reason and "node=" in request.reason
  request = _request(fake, tmp_path, node="explicit-name")
  assert request.action == "delete_node" and request.name.endswith("/nodes/explicit-name")


def test_api_errors_carry_status_and_body(fake, tmp_path, caplog):
  fake.api_status = 403
  with caplog.at_level("WARNING"):
    request = _request(fake, tmp_path)  # the lookup fails: fall back to deleting the node
  assert request.action == "delete_node"
  assert "couldn't look up" in " ".join(r.getMessage() for r in caplog.records)
  with pytest.raises(CloudError, match=r"TpuClient.delete_node\(.*/nodes/my-tpu\) failed with "
                     r"HTTP 403: Forbidden: .*tpu.nodes.delete.*roles/tpu.admin") as e:
    try:
      cloud.execute(request, credentials=_credentials())
    except ValueError:
      pytest.fail("a failed API call must not be caught as a ValueError")
  assert e.value.status == 403 and "tpu.nodes.delete" in e.value.body
  assert not isinstance(e.value, ValueError)


def test_bad_arguments_are_input_errors(tmp_path):
  with pytest.raises(InputError, match=r"delay_s must be a number of seconds >= 0, got -1"):
    cloud.shutdown_at_exit(-1, register=False)
  with pytest.raises(ValueError, match=r"worker must be a non-negative int or None"):
    cloud.shutdown_request(worker="0")


def _run_child(fake, tmp_path, body, extra_env=None):
  script = "\n".join([f"import sys; sys.path.insert(0, {REPO!r})", "from fnscale import cloud",
                       body, "print('PLAN', request.action, flush=True)"])
  env = dict(os.environ, GCE_METADATA_HOST=fake.url.split("://")[1],
             FNSCALE_TPU_API_URL=fake.url, JAX_PLATFORMS="cpu", **(extra_env or {}))
  env.pop("TPU_WORKER_ID", None)
  return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, timeout=120, check=False)


@pytest.mark.slow
def test_at_exit_deletes_after_the_program_ends(fake, tmp_path):
  keep = os.fspath(tmp_path / "keep")
  proc = _run_child(fake, tmp_path,
                    f"request = cloud.shutdown_at_exit(delay_s=0, sentinel={keep!r})")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "PLAN delete_node" in proc.stdout
  (method, path, headers, _), = _deletes(fake)
  # The token came from the metadata server through google-auth's Compute Engine credentials.
  assert (method, path) == ("DELETE", "/v2/" + NODE)
  assert headers["authorization"] == f"Bearer {TOKEN}"

  # An API error at exit is retried (500 is transient), then logged; the program still
  # exits cleanly with its own status.
  fake.requests.clear()
  fake.api_status = 500
  proc = _run_child(fake, tmp_path, f"request = cloud.shutdown_at_exit(delay_s=0, "
                    f"sentinel={keep!r}, queued_resource='qr', timeout_s=1.5)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "deleting the TPU VM failed" in proc.stderr and "HTTP 500" in proc.stderr
  assert len(_deletes(fake)) >= 2

  # No access token from the metadata server: logged, nothing deleted.
  fake.requests.clear()
  fake.api_status = 200
  del fake.metadata["instance/service-accounts/default/token"]
  proc = _run_child(fake, tmp_path, f"request = cloud.shutdown_at_exit(delay_s=0, "
                    f"sentinel={keep!r}, queued_resource='qr', timeout_s=1.5)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "deleting the TPU VM failed" in proc.stderr and "RefreshError" in proc.stderr
  assert fake.requests == []
  fake.metadata = _metadata()

  # A sentinel that appears while the job runs keeps the VM.
  fake.requests.clear()
  fake.api_status = 200
  proc = _run_child(fake, tmp_path, f"request = cloud.shutdown_at_exit(delay_s=0.2, "
                    f"sentinel={keep!r})\nopen({keep!r}, 'w').close()")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "PLAN delete_node" in proc.stdout and f"sentinel {keep} exists" in proc.stderr
  assert _deletes(fake) == []
