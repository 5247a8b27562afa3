"""Deletes the Cloud TPU VM (or its queued resource) when a job ends, so idle chips stop billing.

`shutdown_at_exit()` reads who and where it runs from the GCE metadata service that every
Cloud TPU VM answers, builds the Cloud TPU API v2 request that deletes it, and registers it
with `atexit`. The pieces are pure and public so callers can inspect them:

  plan = shutdown_plan()     # metadata (+ a read-only node lookup) -> ShutdownPlan value
  result = execute(plan)     # sentinel check, fresh token, the DELETE -> ShutdownResult

Rules, in order:
- Off a Cloud TPU VM (metadata unreachable, or no `accelerator-type` attribute) nothing is
  planned and the plan's `reason` says so.
- Only one process acts: `jax.process_index()` 0 when `jax.distributed` is initialised,
  otherwise worker 0 by `TPU_WORKER_ID`, the metadata attribute `agent-worker-number` or the
  `WORKER_ID` of the `tpu-env` attribute (and slice 0 by `MEGASCALE_SLICE_ID` in multi-slice
  jobs). Other workers plan nothing.
- The VM's node name is `NODE_ID` from the `tpu-env` metadata attribute (the GCE instance name
  of a TPU VM is an internal `t1v-...` name); project from `project/project-id`, zone from the
  last segment of `instance/zone`.
- Queued resources: the node is looked up (`GET .../nodes/NAME`); when its `queuedResource`
  field is set, the queued resource is deleted with `force=true` (which also deletes its
  nodes), since a node created through one can't be deleted by itself. Pass
  `queued_resource=` to skip the lookup.
- At exit, after `delay_s` seconds, nothing is sent if the sentinel file exists
  (default `/tmp/fnscale-keep-vm`: `touch` it on worker 0 to keep the VM).
- `dry_run=True` logs the exact request (method, URL, headers with the token elided) and sends
  no DELETE.
- atexit runs on normal interpreter exit, including after an uncaught exception; not when the
  process is killed by a signal or `os._exit`. Errors are logged, never raised at exit.

Base URLs are overridable: the metadata service through `GCE_METADATA_HOST` or `metadata_url`,
the TPU API through `FNSCALE_TPU_API_URL` or `api_url`.
"""
import atexit
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import NamedTuple

from absl import logging

from fnscale import _metadata
from fnscale.errors import CloudError

DEFAULT_SENTINEL = "/tmp/fnscale-keep-vm"
DEFAULT_API_URL = "https://tpu.googleapis.com"
API_URL_ENV = "FNSCALE_TPU_API_URL"
TOKEN_PATH = "instance/service-accounts/default/token"
_METADATA_TIMEOUT_S = 2.0
_TOKEN_SHOWN = "Bearer <access token from metadata instance/service-accounts/default/token>"


class ShutdownPlan(NamedTuple):
  """What `execute` will do; holds no credentials (the token is fetched when sending).

  Attributes:
    action: "delete_node", "delete_queued_resource" or "none".
    reason: why this action (for "none": why nothing will happen).
    method: HTTP method ("DELETE") or None.
    url: the full request URL or None.
    project, zone, node, queued_resource: where the VM lives (None when unknown).
    worker: this process's worker index (None when unknown).
    delay_s: seconds `shutdown_at_exit` waits at exit before sending.
    sentinel: path of the file whose existence cancels the request.
    dry_run: log the request instead of sending it.
    metadata_url: metadata base URL used for the token.
    timeout_s: per-request timeout in seconds.
  """
  action: str
  reason: str
  method: str | None = None
  url: str | None = None
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
  """What `execute` did: `sent` with the HTTP `status` and response `body`, or why not."""
  sent: bool
  reason: str
  status: int | None = None
  body: str = ""


def _metadata_base(metadata_url: str | None) -> str:
  if metadata_url is None:
    return _metadata.base_url()
  url = metadata_url if "://" in metadata_url else "http://" + metadata_url
  url = url.rstrip("/")
  return url if url.endswith("/computeMetadata/v1") else url + "/computeMetadata/v1"


def _api_base(api_url: str | None) -> str:
  return (api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).rstrip("/")


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


def _request(method: str, url: str, token: str, timeout_s: float) -> tuple[int, str]:
  """Sends one API request; HTTP and network failures become CloudError (status, body)."""
  request = urllib.request.Request(url, method=method, headers={
      "Authorization": f"Bearer {token}", "User-Agent": "fnscale"})
  try:
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
      return response.status, response.read().decode(errors="replace")
  except urllib.error.HTTPError as e:
    body = e.read().decode(errors="replace")
    error = CloudError(f"{method} {url} returned HTTP {e.code}: {body[:2000]}. Check that the "
                       "VM's service account may manage TPUs (roles/tpu.admin) and the name.")
    error.status, error.body = e.code, body
    raise error from e
  except (urllib.error.URLError, OSError, ValueError) as e:
    error = CloudError(f"{method} {url} failed: {e}. Is the TPU API reachable from this VM?")
    error.status, error.body = None, ""
    raise error from e


def _token(metadata_url: str, timeout_s: float) -> str:
  text = _metadata.get(TOKEN_PATH, timeout_s=min(timeout_s, _METADATA_TIMEOUT_S),
                       url=metadata_url)
  if not text:
    raise CloudError(f"no access token from the metadata service ({metadata_url}/{TOKEN_PATH}); "
                     "the VM needs a service account with the cloud-platform scope.")
  try:
    return json.loads(text)["access_token"]
  except (ValueError, KeyError, TypeError) as e:
    raise CloudError(f"metadata {TOKEN_PATH} answered {text[:80]!r}..., not JSON with "
                     "access_token.") from e


def _queued_resource_path(name: str, project: str, zone: str) -> str:
  if name.startswith("projects/"):
    return name
  return f"projects/{project}/locations/{zone}/queuedResources/{name}"


def _queued_resource(given, node_url, node, meta, timeout_s) -> tuple[str | None, str | None]:
  """The queued resource this TPU VM came from (one read-only GET of the node unless given),
  and how it was found; (None, None) when the lookup fails (then the node itself is deleted)."""
  if given is not None:
    return given, "given as queued_resource="
  try:
    _, body = _request("GET", node_url, _token(meta, timeout_s), timeout_s)
    return json.loads(body).get("queuedResource") or None, "from the node's queuedResource field"
  except (CloudError, ValueError, AttributeError) as e:
    logging.warning("fnscale: couldn't look up whether TPU VM %s came from a queued "
                    "resource (%s); planning to delete the node itself.", node, e)
    return None, None


def _check_plan_args(delay_s, timeout_s, worker) -> None:
  if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s >= 0:
    raise CloudError(f"delay_s must be a number of seconds >= 0, got {delay_s!r}.")
  if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
    raise CloudError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
  if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int)
                             or worker < 0):
    raise CloudError(f"worker must be a non-negative int or None (detect), got {worker!r}.")


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


def shutdown_plan(*, delay_s: float = 60.0, dry_run: bool = False,
                  sentinel: str = DEFAULT_SENTINEL, metadata_url: str | None = None,
                  api_url: str | None = None, node: str | None = None,
                  queued_resource: str | None = None, worker: int | None = None,
                  timeout_s: float = 10.0) -> ShutdownPlan:
  """Builds the request that deletes this Cloud TPU VM, from the metadata service.

  Sends at most one read-only request (the node lookup that finds its queued resource),
  never a DELETE.

  Args:
    delay_s: seconds to wait at exit before sending (recorded in the plan).
    dry_run: record that `execute` should log the request instead of sending it.
    sentinel: file whose existence at exit cancels the deletion.
    metadata_url: metadata base URL (`http://HOST[:PORT]`, optionally with
      `/computeMetadata/v1`); default from `GCE_METADATA_HOST`.
    api_url: Cloud TPU API base URL; default `FNSCALE_TPU_API_URL` or
      https://tpu.googleapis.com.
    node: TPU node name, overriding `NODE_ID` from the `tpu-env` attribute.
    queued_resource: queued resource name or full path; skips the node lookup.
    worker: this process's worker index, overriding the detection described in the module.
    timeout_s: seconds per API request (metadata requests wait at most 2 s).

  Returns:
    A `ShutdownPlan`; action "none" with the reason when nothing should be deleted from here.

  Raises:
    CloudError: a malformed argument (named). Environment problems never raise: they give an
      action "none" plan with the reason.
  """
  _check_plan_args(delay_s, timeout_s, worker)
  sentinel = os.path.expanduser(os.fspath(sentinel))
  meta = _metadata_base(metadata_url)
  api = _api_base(api_url)
  base = ShutdownPlan(action="none", reason="", delay_s=float(delay_s), sentinel=sentinel,
                      dry_run=bool(dry_run), metadata_url=meta, timeout_s=float(timeout_s))

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
  zone_path = get("instance/zone") or ""
  zone = zone_path.rsplit("/", 1)[-1] or tpu_env.get("ZONE")
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

  node_url = f"{api}/v2/projects/{project}/locations/{zone}/nodes/{node}"
  queued_resource, how = _queued_resource(queued_resource, node_url, node, meta, timeout_s)
  if queued_resource:
    path = _queued_resource_path(queued_resource, project, zone)
    return base._replace(
        action="delete_queued_resource", method="DELETE", url=f"{api}/v2/{path}?force=true",
        queued_resource=path,
        reason=f"worker 0 of {accelerator} VM {node} created through queued resource {path} "
               f"({how}): deleting it (force=true) deletes the VM.")
  return base._replace(
      action="delete_node", method="DELETE", url=node_url,
      reason=f"worker 0 of {accelerator} VM {node} in {project}/{zone}: deleting the node.")


def describe(plan: ShutdownPlan) -> str:
  """One line with the exact request of `plan` (token elided), or why there is none."""
  if plan.action == "none":
    return f"no shutdown request: {plan.reason}"
  return (f"{plan.method} {plan.url} headers {{Authorization: {_TOKEN_SHOWN}, "
          f"User-Agent: fnscale}}")


def execute(plan: ShutdownPlan) -> ShutdownResult:
  """Carries out `plan` now: unless its sentinel exists or it is a dry run, sends the DELETE.

  The access token is read from the metadata service at this moment (tokens expire).

  Returns:
    A `ShutdownResult`: sent with status and body, or not sent with the reason.

  Raises:
    CloudError: no token, a network failure or an HTTP error (its `status` and `body`
      attributes hold the answer).
  """
  if plan.action == "none":
    logging.info("fnscale: %s", describe(plan))
    return ShutdownResult(False, plan.reason)
  if os.path.exists(plan.sentinel):
    reason = f"sentinel {plan.sentinel} exists: keeping the VM (remove it to allow deletion)."
    logging.warning("fnscale: %s", reason)
    return ShutdownResult(False, reason)
  if plan.dry_run:
    reason = f"dry run, not sent: {describe(plan)}"
    logging.warning("fnscale: %s", reason)
    print(f"fnscale shutdown_at_exit {reason}", file=sys.stderr, flush=True)
    return ShutdownResult(False, reason)
  logging.warning("fnscale: sending %s", describe(plan))
  status, body = _request(plan.method, plan.url, _token(plan.metadata_url, plan.timeout_s),
                          plan.timeout_s)
  logging.warning("fnscale: %s answered HTTP %d", plan.url, status)
  return ShutdownResult(True, plan.reason, status, body)


def _at_exit(plan: ShutdownPlan):
  """The atexit hook: wait, then execute; log every failure, never raise into exit."""
  try:
    if plan.delay_s > 0:
      logging.warning("fnscale: job ended; %s in %.0f s unless %s exists.", describe(plan),
                      plan.delay_s, plan.sentinel)
      time.sleep(plan.delay_s)
    execute(plan)
  except Exception as e:  # pylint: disable=broad-except  # the program is exiting anyway
    logging.error("fnscale: deleting the TPU VM failed: %s", e)


def shutdown_at_exit(delay_s: float = 60.0, dry_run: bool = False, *,
                     sentinel: str = DEFAULT_SENTINEL, metadata_url: str | None = None,
                     api_url: str | None = None, node: str | None = None,
                     queued_resource: str | None = None, worker: int | None = None,
                     timeout_s: float = 10.0, register: bool = True) -> ShutdownPlan:
  """On a Cloud TPU VM, deletes the VM (or its queued resource) when this program exits.

  Call it once, early, on every worker (only worker 0 acts). Off a Cloud TPU VM it does
  nothing and logs why. See the module docstring for how the VM is found.

  Args:
    delay_s: seconds to wait after the program ends before deleting (time to copy logs or
      `touch` the sentinel).
    dry_run: log the exact request at exit instead of sending it.
    sentinel: a file that, if it exists at exit, keeps the VM. Default `/tmp/fnscale-keep-vm`.
    metadata_url, api_url, node, queued_resource, worker, timeout_s: as in `shutdown_plan`.
    register: register the atexit hook (False: only build and return the plan).

  Returns:
    The `ShutdownPlan` (action "none" with the reason when nothing will be deleted).

  Raises:
    CloudError: a malformed argument. Environment and network problems are logged instead.
  """
  plan = shutdown_plan(delay_s=delay_s, dry_run=dry_run, sentinel=sentinel,
                       metadata_url=metadata_url, api_url=api_url, node=node,
                       queued_resource=queued_resource, worker=worker, timeout_s=timeout_s)
  if plan.action == "none":
    logging.info("fnscale shutdown_at_exit: nothing to do: %s", plan.reason)
    return plan
  logging.warning("fnscale shutdown_at_exit: at exit, after %.0f s, %s%s unless %s exists.",
                  plan.delay_s, "(dry run) " if plan.dry_run else "", describe(plan),
                  plan.sentinel)
  if register:
    atexit.register(_at_exit, plan)
  return plan
