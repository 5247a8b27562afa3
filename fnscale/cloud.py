"""Deletes the Cloud TPU VM (or its queued resource) when a job ends, so idle chips stop billing.

`shutdown_at_exit()` reads who and where it runs from the GCE metadata service that every
Cloud TPU VM answers, builds the Cloud TPU API v2 call that deletes it, and registers it with
`atexit`. The calls go through Google's client (`google.cloud.tpu_v2.TpuClient`, the `cloud`
extra: `pip install 'fnscale[cloud]'`) with google-auth's Compute Engine credentials (an
access token from the metadata server, refreshed when it expires), the client's retries of
transient errors and its long-running operation for the delete. The pieces are pure and
public so callers can inspect them:

  request = shutdown_request()  # metadata (+ a read-only node lookup) -> ShutdownRequest
  result = execute(request)     # sentinel check, then TpuClient.delete_* -> ShutdownResult

Rules, in order:
- Off a Cloud TPU VM (metadata unreachable, or no `accelerator-type` attribute) nothing is
  requested and the request's `reason` says so.
- Only one process acts: `jax.process_index()` 0 when `jax.distributed` is initialised,
  otherwise worker 0 by `TPU_WORKER_ID`, the metadata attribute `agent-worker-number` or the
  `WORKER_ID` of the `tpu-env` attribute (and slice 0 by `MEGASCALE_SLICE_ID` in multi-slice
  jobs). Other workers request nothing.
- The VM's node name is `NODE_ID` from the `tpu-env` metadata attribute (the GCE instance name
  of a TPU VM is an internal `t1v-...` name); project from `project/project-id`, zone from the
  last segment of `instance/zone`.
- Queued resources: the node is looked up (`TpuClient.get_node`); when its `queued_resource`
  field is set, the queued resource is deleted with `force=True` (which also deletes its
  nodes), since a node created through one can't be deleted by itself. Pass
  `queued_resource=` to skip the lookup.
- At exit, after `delay_s` seconds, nothing is sent if the sentinel file exists
  (default `/tmp/fnscale-keep-vm`: `touch` it on worker 0 to keep the VM).
- `dry_run=True` logs the exact call (method, resource name, endpoint) and sends no delete.
- atexit runs on normal interpreter exit, including after an uncaught exception; not when the
  process is killed by a signal or `os._exit`. Errors are logged, never raised at exit.

Endpoints are overridable: the metadata service through `GCE_METADATA_HOST` (read by
google-auth and by fnscale) or `metadata_url` (fnscale's reads only), the TPU API through
`FNSCALE_TPU_API_URL` or `api_url`. The API endpoint must be https (the requests carry an
access token), except on the loopback interface (a local fake of the API in tests).

Examples:
  Off a Cloud TPU VM (no metadata service answers here), nothing is requested:

  >>> import fnscale as fs
  >>> fs.cloud.shutdown_at_exit(metadata_url="127.0.0.1:9", register=False).action
  'none'
"""
import atexit
import ipaddress
import os
import sys
import time
from typing import Any, NamedTuple
import urllib.parse

from absl import logging

from fnscale import _metadata
from fnscale._errors import CloudError, InputError

__all__ = ["shutdown_at_exit", "shutdown_request", "execute", "describe", "ShutdownRequest",
           "ShutdownResult"]

DEFAULT_SENTINEL = "/tmp/fnscale-keep-vm"
DEFAULT_API_URL = "https://tpu.googleapis.com"
API_URL_ENV = "FNSCALE_TPU_API_URL"
_METADATA_TIMEOUT_S = 2.0
_INSTALL = "install the cloud extra: pip install 'fnscale[cloud]' (google-cloud-tpu)"


class ShutdownRequest(NamedTuple):
  """What `execute` will do; holds no credentials (they are fetched when sending).

  Attributes:
    action: "delete_node", "delete_queued_resource" or "none".
    reason: why this action (for "none": why nothing will happen).
    name: the full resource name to delete (`projects/P/locations/Z/nodes/N` or
      `.../queuedResources/Q`), or None.
    endpoint: the Cloud TPU API endpoint (https, or http on loopback only).
    project, zone, node, queued_resource: where the VM lives (None when unknown).
    worker: this process's worker index (None when unknown).
    delay_s: seconds `shutdown_at_exit` waits at exit before sending.
    sentinel: path of the file whose existence cancels the request.
    dry_run: log the call instead of making it.
    metadata_url: metadata base URL fnscale read the VM's facts from.
    timeout_s: per-request timeout in seconds (also the retry deadline).

  Examples:
    >>> import fnscale as fs
    >>> request = fs.cloud.ShutdownRequest(
    ...     "delete_node", "worker 0 of a Cloud TPU VM", name="projects/p/locations/z/nodes/n1")
    >>> request.action, request.endpoint, request.delay_s, request.sentinel
    ('delete_node', 'https://tpu.googleapis.com', 60.0, '/tmp/fnscale-keep-vm')
  """
  action: str
  reason: str
  name: str | None = None
  endpoint: str = DEFAULT_API_URL
  project: str | None = None
  zone: str | None = None
  node: str | None = None
  queued_resource: str | None = None
  worker: int | None = None
  delay_s: float = 60.0
  sentinel: str = DEFAULT_SENTINEL
  dry_run: bool = False
  metadata_url: str | None = None
  timeout_s: float = 10.0


class ShutdownResult(NamedTuple):
  """What `execute` did: `sent` with the long-running `operation` name the API answered,
  or why not.

  Examples:
    >>> import fnscale as fs
    >>> fs.cloud.execute(fs.cloud.ShutdownRequest("none", "not a Cloud TPU VM"))
    ShutdownResult(sent=False, reason='not a Cloud TPU VM', operation='')
  """
  sent: bool
  reason: str
  operation: str = ""


def _metadata_base(metadata_url: str | None) -> str:
  if metadata_url is None:
    return _metadata.base_url()
  url = metadata_url if "://" in metadata_url else "http://" + metadata_url
  url = url.rstrip("/")
  return url if url.endswith("/computeMetadata/v1") else url + "/computeMetadata/v1"


def _loopback(host: str | None) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host or "").is_loopback
  except ValueError:
    return False


def api_endpoint(api_url: str | None = None) -> str:
  """The Cloud TPU API endpoint: `api_url`, else `FNSCALE_TPU_API_URL`, else
  https://tpu.googleapis.com.

  Raises:
    InputError: not an http(s) URL, or plain http to a host other than loopback (the
      access token would travel unencrypted).
  """
  url = (api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).rstrip("/")
  parts = urllib.parse.urlsplit(url)
  if parts.scheme == "https" and parts.hostname:
    return url
  if parts.scheme == "http" and _loopback(parts.hostname):
    return url
  source = "api_url" if api_url else API_URL_ENV
  raise InputError(
      f"{source}={url!r}: the Cloud TPU API endpoint must be an https:// URL (requests carry "
      "an access token), or http:// only on loopback (127.0.0.1, ::1, localhost) for a local "
      "fake; fix: e.g. https://tpu.googleapis.com.")


def _parse_tpu_env(text: str | None) -> dict[str, str]:
  """`KEY: 'value'` lines of the `tpu-env` metadata attribute -> dict."""
  out = {}
  for line in (text or "").splitlines():
    key, sep, value = line.partition(":")
    if sep:
      out[key.strip()] = value.strip().strip("'\"")
  return out


def _as_int(value) -> int | None:
  try:
    return int(str(value).strip())
  except (TypeError, ValueError):
    return None


def _jax_process_index() -> int | None:
  """The process index if jax.distributed is initialised; never initialises a backend."""
  jax = sys.modules.get("jax")
  if jax is None:
    return None
  try:
    if jax.distributed.is_initialized():
      return jax.process_index()
  except Exception:  # pylint: disable=broad-except  # an old jax or a broken runtime
    return None
  return None


def _client(endpoint: str, credentials):
  """A `TpuClient` on the REST transport at `endpoint`; default credentials are google-auth's
  Compute Engine credentials (the VM's service account, token from the metadata server)."""
  try:
    from google.cloud import tpu_v2  # pylint: disable=import-outside-toplevel
    from google.auth import compute_engine  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise CloudError(f"fnscale.cloud needs google-cloud-tpu, which can't be imported ({e}); "
                     f"{_INSTALL}.") from e
  if credentials is None:
    credentials = compute_engine.Credentials()
  return tpu_v2.TpuClient(credentials=credentials, transport="rest",
                          client_options={"api_endpoint": endpoint})


def _retry(timeout_s: float):
  from google.api_core import retry  # pylint: disable=import-outside-toplevel
  return retry.Retry(predicate=retry.if_transient_error, initial=0.5, maximum=4.0,
                     timeout=timeout_s)


def _cloud_error(call: str, e: Exception) -> CloudError:
  """A google-api-core or google-auth failure as a CloudError with `status` and `body`
  (the last attempt's, when the client's retries ran out)."""
  e = getattr(e, "cause", None) or e
  status, body = getattr(e, "code", None), str(getattr(e, "message", "") or e)
  status = status if isinstance(status, int) else None
  hint = (" Check that the VM's service account may manage TPUs (roles/tpu.admin) and the "
          "name." if status in (403, 404) else " Is the TPU API reachable from this VM, and "
          "does it have a service account with the cloud-platform scope?")
  error = CloudError(f"{call} failed{f' with HTTP {status}' if status else ''}: "
                     f"{type(e).__name__}: {body[:2000]}.{hint}")
  error.status, error.body = status, body
  return error


def _call(what: str, fn, **kwargs):
  from google.api_core import exceptions as api_errors  # pylint: disable=import-outside-toplevel
  from google.auth import exceptions as auth_errors  # pylint: disable=import-outside-toplevel
  try:
    return fn(**kwargs)
  except (api_errors.GoogleAPIError, auth_errors.GoogleAuthError, OSError) as e:
    raise _cloud_error(what, e) from e


def _queued_resource_path(name: str, project: str, zone: str) -> str:
  if name.startswith("projects/"):
    return name
  return f"projects/{project}/locations/{zone}/queuedResources/{name}"


def _queued_resource(given, node_name, client, timeout_s) -> tuple[str | None, str | None]:
  """The queued resource this TPU VM came from (one read-only get_node unless given), and
  how it was found; (None, None) when the lookup fails (then the node itself is deleted)."""
  if given is not None:
    return given, "given as queued_resource="
  try:
    node = _call(f"TpuClient.get_node({node_name})", client.get_node, name=node_name,
                 retry=_retry(timeout_s), timeout=timeout_s)
    return node.queued_resource or None, "from the node's queued_resource field"
  except CloudError as e:
    logging.warning("fnscale: couldn't look up whether TPU VM %s came from a queued "
                    "resource (%s); deleting the node itself.", node_name, e)
    return None, None


def _check_request_args(delay_s, timeout_s, worker) -> None:
  if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s >= 0:
    raise InputError(f"delay_s must be a number of seconds >= 0, got {delay_s!r}.")
  if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
    raise InputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
  if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int)
                             or worker < 0):
    raise InputError(f"worker must be a non-negative int or None (detect), got {worker!r}.")


def _worker_index(worker, get, tpu_env) -> tuple[int, str]:
  """This host's worker index and where it came from, first source that answers."""
  if worker is not None:
    return worker, "argument worker="
  sources = (
      (_jax_process_index, "jax.process_index()"),
      (lambda: _as_int(os.environ.get("TPU_WORKER_ID")), "TPU_WORKER_ID"),
      (lambda: _as_int(get("instance/attributes/agent-worker-number")),
       "metadata agent-worker-number"),
      (lambda: _as_int(tpu_env.get("WORKER_ID")), "tpu-env WORKER_ID"),
  )
  for read, source in sources:
    value = read()
    if value is not None:
      return value, source
  return 0, "no worker index found (a single-host VM)"


def shutdown_request(*, delay_s: float = 60.0, dry_run: bool = False,
                     sentinel: str = DEFAULT_SENTINEL, metadata_url: str | None = None,
                     api_url: str | None = None, node: str | None = None,
                     queued_resource: str | None = None, worker: int | None = None,
                     timeout_s: float = 10.0, credentials: Any = None) -> ShutdownRequest:
  """The call that deletes this Cloud TPU VM, from the metadata service (not yet sent).

  Makes at most one read-only API call (`get_node`, to find its queued resource), never a
  delete.

  Args:
    delay_s: seconds to wait at exit before sending (recorded in the request).
    dry_run: record that `execute` should log the call instead of making it.
    sentinel: file whose existence at exit cancels the deletion.
    metadata_url: metadata base URL for fnscale's reads (`http://HOST[:PORT]`, optionally
      with `/computeMetadata/v1`); default from `GCE_METADATA_HOST`. (google-auth's
      credentials read `GCE_METADATA_HOST` themselves.)
    api_url: Cloud TPU API endpoint; default `FNSCALE_TPU_API_URL` or
      https://tpu.googleapis.com; https, or http on loopback only.
    node: TPU node name, overriding `NODE_ID` from the `tpu-env` attribute.
    queued_resource: queued resource name or full path; skips the node lookup.
    worker: this process's worker index, overriding the detection described in the module.
    timeout_s: seconds per API request and for its retries (metadata reads wait at most 2 s).
    credentials: google-auth credentials for the lookup; default the VM's service account
      (`google.auth.compute_engine.Credentials`).

  Returns:
    A `ShutdownRequest`; action "none" with the reason when nothing should be deleted from here.

  Raises:
    InputError: a malformed argument (named), a non-https endpoint off loopback.
    CloudError: google-cloud-tpu is not installed (the cloud extra) on worker 0 of a TPU VM.
    Other environment problems never raise: they give an action "none" request with the reason.

  Examples:
    >>> import fnscale as fs
    >>> request = fs.cloud.shutdown_request(metadata_url="127.0.0.1:9")  # nothing answers
    >>> request.action, request.reason
    ('none', 'the metadata service at http://127.0.0.1:9/computeMetadata/v1 is unreachable: ...')
  """
  _check_request_args(delay_s, timeout_s, worker)
  sentinel = os.path.expanduser(os.fspath(sentinel))
  meta = _metadata_base(metadata_url)
  base = ShutdownRequest(action="none", reason="", endpoint=api_endpoint(api_url),
                         delay_s=float(delay_s), sentinel=sentinel, dry_run=bool(dry_run),
                         metadata_url=meta, timeout_s=float(timeout_s))
  base = _locate(base, node, worker)
  if base.reason:
    return base
  node_name = f"projects/{base.project}/locations/{base.zone}/nodes/{base.node}"
  client = _client(base.endpoint, credentials)  # the extra is needed now, not first at exit
  queued_resource, how = _queued_resource(queued_resource, node_name, client, timeout_s)
  if queued_resource:
    path = _queued_resource_path(queued_resource, base.project, base.zone)
    return base._replace(
        action="delete_queued_resource", name=path, queued_resource=path,
        reason=f"worker 0 of TPU VM {base.node} created through queued resource {path} "
               f"({how}): deleting it (force=True) deletes the VM.")
  return base._replace(
      action="delete_node", name=node_name,
      reason=f"worker 0 of TPU VM {base.node} in {base.project}/{base.zone}: deleting the "
             "node.")


def _locate(base: ShutdownRequest, node, worker) -> ShutdownRequest:
  """`base` with the VM's project, zone, node and worker from the metadata service, and a
  `reason` when this process must not delete anything (empty when it should)."""
  meta, timeout_s = base.metadata_url, base.timeout_s

  def get(path):
    # Short: off Cloud the first lookup must fail fast, and the service answers in ms.
    return _metadata.get(path, timeout_s=min(timeout_s, _METADATA_TIMEOUT_S), url=meta)

  project = get("project/project-id")
  if project is None:
    return base._replace(reason=f"the metadata service at {meta} is unreachable: not a Cloud "
                         "VM, nothing will be deleted.")
  accelerator = get("instance/attributes/accelerator-type")
  if not accelerator:
    return base._replace(project=project, reason="a Cloud VM without the accelerator-type "
                         "metadata attribute: not a Cloud TPU VM, nothing will be deleted.")
  tpu_env = _parse_tpu_env(get("instance/attributes/tpu-env"))
  zone = (get("instance/zone") or "").rsplit("/", 1)[-1] or tpu_env.get("ZONE")
  project = project or tpu_env.get("CONSUMER_PROJECT_ID")
  node = node or tpu_env.get("NODE_ID")
  worker, source = _worker_index(worker, get, tpu_env)
  base = base._replace(project=project, zone=zone, node=node, worker=worker)
  if worker != 0:
    return base._replace(reason=f"this is worker {worker} ({source}); only worker 0 deletes "
                         f"{accelerator} VM {node}.")
  slice_id = _as_int(os.environ.get("MEGASCALE_SLICE_ID", tpu_env.get("MEGASCALE_SLICE_ID")))
  if source != "jax.process_index()" and slice_id not in (None, 0):
    return base._replace(reason=f"this is worker 0 of slice {slice_id}; only slice 0's worker "
                         "0 deletes the queued resource.")
  missing = [n for n, v in (("project", project), ("zone", zone), ("node", node)) if not v]
  if missing:
    return base._replace(reason=f"can't name this TPU VM: {', '.join(missing)} not found in the "
                         "metadata (tpu-env NODE_ID, instance/zone, project/project-id); pass "
                         "node= to shutdown_at_exit.")
  return base


def describe(request: ShutdownRequest) -> str:
  """One line with the exact call of `request` (no credentials), or why there is none.

  Examples:
    >>> import fnscale as fs
    >>> request = fs.cloud.ShutdownRequest(
    ...     "delete_node", "worker 0 of a Cloud TPU VM", name="projects/p/locations/z/nodes/n1")
    >>> fs.cloud.describe(request)
    "TpuClient.delete_node(name='projects/p/locations/z/nodes/n1') at https://tpu.googleapis.com..."
    >>> fs.cloud.describe(fs.cloud.ShutdownRequest("none", "off a Cloud TPU VM"))
    'no shutdown request: off a Cloud TPU VM'
  """
  if request.action == "none":
    return f"no shutdown request: {request.reason}"
  force = ", force=True" if request.action == "delete_queued_resource" else ""
  return (f"TpuClient.{request.action}(name={request.name!r}{force}) at {request.endpoint} (REST, "
          "google-auth credentials of the VM's service account)")


def execute(request: ShutdownRequest, *, credentials: Any = None) -> ShutdownResult:
  """Carries out `request` now: unless its sentinel exists or it is a dry run, makes the delete.

  The delete returns a long-running operation; its name is in the result (the VM goes away
  while it runs, so nothing waits for it).

  Args:
    request: from `shutdown_request`.
    credentials: google-auth credentials; default the VM's service account (an access token
      from the metadata server, fetched now: tokens expire).

  Returns:
    A `ShutdownResult`: sent with the operation's name, or not sent with the reason.

  Raises:
    CloudError: google-cloud-tpu missing, no credentials, a network failure or an API error
      after the client's retries (its `status` and `body` attributes hold the answer).

  Examples:
    The sentinel file keeps the VM (nothing is sent):

    >>> import fnscale as fs
    >>> request = fs.cloud.ShutdownRequest(
    ...     "delete_node", "worker 0 of a Cloud TPU VM", name="projects/p/locations/z/nodes/n1")
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as keep:
    ...   result = fs.cloud.execute(request._replace(sentinel=keep.name))
    >>> result.sent, result.reason.startswith("sentinel")
    (False, True)
  """
  if request.action == "none":
    logging.info("fnscale: %s", describe(request))
    return ShutdownResult(False, request.reason)
  if os.path.exists(request.sentinel):
    reason = f"sentinel {request.sentinel} exists: keeping the VM (remove it to allow deletion)."
    logging.warning("fnscale: %s", reason)
    return ShutdownResult(False, reason)
  if request.dry_run:
    reason = f"dry run, not sent: {describe(request)}"
    logging.warning("fnscale: %s", reason)
    print(f"fnscale shutdown_at_exit {reason}", file=sys.stderr, flush=True)
    return ShutdownResult(False, reason)
  logging.warning("fnscale: sending %s", describe(request))
  client = _client(request.endpoint, credentials)
  body = {"name": request.name}
  if request.action == "delete_queued_resource":
    body["force"] = True
  operation = _call(f"TpuClient.{request.action}({request.name})", getattr(client, request.action),
                    request=body, retry=_retry(request.timeout_s), timeout=request.timeout_s)
  name = operation.operation.name
  logging.warning("fnscale: %s accepted: operation %s", request.name, name)
  return ShutdownResult(True, request.reason, name)


def _at_exit(request: ShutdownRequest, credentials):
  """The atexit hook: wait, then execute; log every failure, never raise into exit."""
  try:
    if request.delay_s > 0:
      logging.warning("fnscale: job ended; %s in %.0f s unless %s exists.", describe(request),
                      request.delay_s, request.sentinel)
      time.sleep(request.delay_s)
    execute(request, credentials=credentials)
  except Exception as e:  # pylint: disable=broad-except  # the program is exiting anyway
    logging.error("fnscale: deleting the TPU VM failed: %s", e)


def shutdown_at_exit(delay_s: float = 60.0, dry_run: bool = False, *,
                     sentinel: str = DEFAULT_SENTINEL, metadata_url: str | None = None,
                     api_url: str | None = None, node: str | None = None,
                     queued_resource: str | None = None, worker: int | None = None,
                     timeout_s: float = 10.0, credentials: Any = None,
                     register: bool = True) -> ShutdownRequest:
  """On a Cloud TPU VM, deletes the VM (or its queued resource) when this program exits.

  Call it once, early, on every worker (only worker 0 acts). Off a Cloud TPU VM it does
  nothing and logs why. See the module docstring for how the VM is found.

  Args:
    delay_s: seconds to wait after the program ends before deleting (time to copy logs or
      `touch` the sentinel).
    dry_run: log the exact call at exit instead of making it.
    sentinel: a file that, if it exists at exit, keeps the VM. Default `/tmp/fnscale-keep-vm`.
    metadata_url, api_url, node, queued_resource, worker, timeout_s, credentials: as in
      `shutdown_request`.
    register: register the atexit hook (False: only build and return the request).

  Returns:
    The `ShutdownRequest` (action "none" with the reason when nothing will be deleted).

  Raises:
    InputError: a malformed argument. CloudError: google-cloud-tpu missing (see
      `shutdown_request`). Environment and network problems are logged instead.

  Examples:
    >>> import fnscale as fs
    >>> request = fs.cloud.shutdown_at_exit(delay_s=30, metadata_url="127.0.0.1:9")
    >>> request.action, request.delay_s  # off a Cloud TPU VM: nothing registered
    ('none', 30.0)
  """
  request = shutdown_request(delay_s=delay_s, dry_run=dry_run, sentinel=sentinel,
                          metadata_url=metadata_url, api_url=api_url, node=node,
                          queued_resource=queued_resource, worker=worker, timeout_s=timeout_s,
                          credentials=credentials)
  if request.action == "none":
    logging.info("fnscale shutdown_at_exit: nothing to do: %s", request.reason)
    return request
  logging.warning("fnscale shutdown_at_exit: at exit, after %.0f s, %s%s unless %s exists.",
                  request.delay_s, "(dry run) " if request.dry_run else "", describe(request),
                  request.sentinel)
  if register:
    atexit.register(_at_exit, request, credentials)
  return request
