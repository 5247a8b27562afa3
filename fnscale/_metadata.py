"""A minimal client for the GCE metadata service, which Cloud TPU VMs answer.

It is never required: every failure returns None and logs at debug level. The host comes
from `GCE_METADATA_HOST` (as in Google's own client libraries) so tests can point it at a
local server.
"""
import os
import urllib.error
import urllib.request

from absl import logging

DEFAULT_HOST = "metadata.google.internal"
HEADERS = {"Metadata-Flavor": "Google"}


def base_url(env=None) -> str:
  """`http://HOST/computeMetadata/v1`, HOST from `GCE_METADATA_HOST` or the GCE default."""
  host = (os.environ if env is None else env).get("GCE_METADATA_HOST", DEFAULT_HOST)
  if "://" not in host:
    host = "http://" + host
  return host.rstrip("/") + "/computeMetadata/v1"


def get(path: str, *, timeout_s: float = 1.0, url: str | None = None) -> str | None:
  """Reads one metadata value, e.g. `instance/attributes/accelerator-type`.

  Args:
    path: path under `computeMetadata/v1/`.
    timeout_s: seconds to wait for the connection and the answer.
    url: base URL overriding `base_url()`.

  Returns:
    The value as text, or None when the service is unreachable, slow or says 404.
  """
  full = (url or base_url()).rstrip("/") + "/" + path.lstrip("/")
  request = urllib.request.Request(full, headers=HEADERS)
  try:
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
      return response.read().decode().strip()
  except (urllib.error.URLError, OSError, ValueError) as e:
    logging.debug("metadata %s unavailable: %s", full, e)
    return None
