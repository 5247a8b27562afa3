"""Does every process see the same directory? (`check_shared_directory`)

A checkpoint directory must be one directory that every process reads and writes: per-host
disks would leave each save's commit marker on process 0's disk only. Process 0 writes a
token file there, every process looks for it, and all compare what they found through JAX's
coordination service (`fnscale.multihost._agreement`). `fnscale.multihost` re-exports
`check_shared_directory`.
"""
from __future__ import annotations

import contextlib
import secrets
import socket

from absl import logging

from fnscale.multihost import _agreement as _ag
from fnscale.multihost import _coordination as _co
from fnscale.checkpoint import _manager as checkpoint
from fnscale.multihost._coordination import DEFAULT_TIMEOUT_S
from fnscale._errors import DistributedError


def check_shared_directory(directory, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Checks that every process sees the same `directory` (a checkpoint directory must be one).

  Process 0 creates the directory if needed and writes a file named by a fresh random token
  into it; every process looks for that file under `directory` as it resolves the path
  there, all compare what they found through JAX's coordination service, and process 0
  removes the file. Call it on every process at start-up, before training: per-host disks
  (the default `runs/...` on each TPU VM) would otherwise leave the commit marker of each
  save on process 0's disk only, and a restart would restore on process 0 alone. In one
  process it returns at once.

  Args:
    directory: a local path or an object-store URL (`gs://...`), the same string on every
      process.
    timeout_s: seconds to wait for process 0's token and every process's answer.

  Raises:
    DistributedError: on every process, naming each process that doesn't see process 0's
      file and the path it looked at, with the fix (a bucket, `gs://...`, or a shared file
      system mounted at the same path everywhere); or several processes without JAX's
      coordination service (`fnscale.initialize`).

  Examples:
    In one process there is nobody to disagree: it returns at once.

    >>> import fnscale as fs, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...   fs.checkpoint.check_shared_directory(d)
  """
  rt = _co.job_runtime(f"check_shared_directory({directory!r})")
  if rt is None:
    return
  client, pid, n = rt
  path = checkpoint._path(directory)  # pylint: disable=protected-access  # as save sees it
  what = f"the shared-directory check of {directory}"
  token = _ag.from_process_0(what, lambda: _write_token(path),
                             f"token/{next(_ag.choice_count)}", timeout_s)
  if token.startswith("error:"):
    raise DistributedError(f"{what}: process 0 could not write to {path}: {token[6:]}; fix: "
                           "give a directory every process can write (gs://... or a shared "
                           "file system).")
  # Equal entries from every process that sees it: only a difference ends the wait early.
  found = {"sees": "yes"} if (path / token).exists() else {
      "sees": "no", "host": socket.gethostname(), "looked_at": str(path / token)}
  with _co.waiting(what):
    got, _, _ = _ag.exchange(f"shared/{token}", found, timeout_s)
  if pid == 0:
    with contextlib.suppress(OSError):
      (path / token).unlink()
  blind = {p: e for p, e in sorted(got.items()) if e["sees"] != "yes"}
  missing = [p for p in range(n) if p not in got]
  if blind or missing:
    named = [f"process {p} (host {e['host']}) doesn't see it ({e['looked_at']} does not "
             "exist here)" for p, e in blind.items()]
    named += [f"process {p} did not answer within {timeout_s} s" for p in missing]
    raise DistributedError(
        f"directory {directory} is not shared by the {n} processes: process 0 wrote {token} "
        f"there, and {'; '.join(named)}. Checkpoints need one directory every process reads "
        "and writes (per-host local disks, such as the default runs/... on each TPU VM, are "
        "not); fix: use a bucket (gs://BUCKET/PATH) or a shared file system (NFS, Filestore) "
        "mounted at the same path on every host.")
  logging.info("%s: all %d processes see it", what, n)


def _write_token(path) -> str:
  """On process 0: a fresh token file in `path` (created if missing); its name, or
  "error:..." when it can't be written."""
  name = f".fnscale-shared-check-{secrets.token_hex(8)}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(name)
  except OSError as e:
    return f"error:{type(e).__name__}: {e}"
  return name
