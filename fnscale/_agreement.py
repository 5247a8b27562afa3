"""Agreement between processes through JAX's coordination service.

Every process publishes what must agree as one JSON entry under fnscale/<topic>/<process id>
in the key-value store of JAX's coordination service and reads everyone else's, so a
difference is named in seconds instead of surfacing as a hang inside a collective. Used by
`fnscale.distributed` (the start-up and compiled-step checks, the shared-directory check)
and `fnscale.checkpoint` (the step every process restores).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import time

from fnscale import _coordination as _co
from fnscale.errors import DistributedError

_MAX_NAMED = 6  # differences spelled out per process; the rest are counted
_SETTLE_S = 10.0  # after a first difference, how long to wait for the other processes' entries
# Numbers the broadcasts from process 0 (`from_process_0`), the same on every process.
choice_count = itertools.count()


def from_process_0(what: str, choose, topic: str, timeout_s: float = _co.DEFAULT_TIMEOUT_S):
  """`choose()` as process 0 computes it (a JSON value), on every process: a broadcast
  through the coordination service under `topic`, the same on every process."""
  rt = _co.job_runtime(what)
  if rt is None:
    return choose()
  client, pid, _ = rt
  key = f"{_co.KEY}/{topic}"
  if pid == 0:
    value = choose()
    client.key_value_set(key, json.dumps(value))
    return value
  try:
    with _co.waiting(what):
      return json.loads(client.blocking_key_value_get(key, max(1, int(timeout_s * 1000))))
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"{what}: process {pid} waited {timeout_s} s for process 0's choice ({type(e).__name__}: "
        f"{first}); fix: make every process make the same calls, check process 0's log.") from e


def agreed_choice(what: str, choose, check, timeout_s: float = _co.DEFAULT_TIMEOUT_S):
  """Process 0's `choose()` on every process, after every process found it usable: `check(value)`
  is None there, else says why not. Raises a DistributedError naming each process that
  can't use it, on every process (so none goes on into a collective alone)."""
  k = next(choice_count)
  value = from_process_0(what, choose, f"choice/{k}", timeout_s)
  rt = _co.runtime()
  if rt is None:
    return value
  _, _, n = rt
  with _co.waiting(what):
    got, _, _ = exchange(f"choice/{k}/check", {"problem": check(value) or ""}, timeout_s)
  bad = [f"process {p}: {e['problem']}" for p, e in sorted(got.items()) if e["problem"]]
  bad += [f"process {p}: no answer within {timeout_s} s" for p in range(n) if p not in got]
  if bad:
    raise DistributedError(
        f"{what}: process 0 chose {value!r}, which not every process can use ({'; '.join(bad)}); "
        "fix: give every process the same view (a directory shared by all, "
        "fnscale.distributed.check_shared_directory), then restart every process.")
  return value


def _say(field: str, p: int, value: str, ref: int, ref_value: str) -> str:
  if field.startswith("state:"):
    return f"process {p}: {field[6:]} {value}, process {ref}: {ref_value}"
  if field.startswith("batch:"):
    return f"process {p}: batch {field[6:]} {value}, process {ref}: {ref_value}"
  if field == "program":
    return (f"process {p} compiled program {value}, process {ref} program {ref_value}, with "
            "the same shapes, mesh and compiler options: the code or a setting that changes "
            "no shape differs (compare the command lines, checkouts and XLA_FLAGS)")
  return f"process {p} has {field}={value}, process {ref} {field}={ref_value}"


def differences(entries: dict[int, dict[str, str]]) -> list[str]:
  """One line per field where a process differs from the lowest-numbered one (at most
  `_MAX_NAMED` per process, then a count); a differing program is named only when nothing
  else differs (it follows from any other difference)."""
  if len(entries) < 2:
    return []
  ref = min(entries)
  out = []
  for p in sorted(entries):
    if p == ref or entries[p] == entries[ref]:
      continue
    # In the entries' own order: set-up fields first, then leaves in pytree order.
    fields = list(entries[ref]) + [f for f in entries[p] if f not in entries[ref]]
    diff = [f for f in fields
            if entries[p].get(f, "absent") != entries[ref].get(f, "absent")]
    if len(diff) > 1:
      diff = [f for f in diff if f != "program"]
    out += [_say(f, p, entries[p].get(f, "absent"), ref, entries[ref].get(f, "absent"))
            for f in diff[:_MAX_NAMED]]
    if len(diff) > _MAX_NAMED:
      out.append(f"and {len(diff) - _MAX_NAMED} more differences of process {p}")
  return out


def exchange(topic: str, facts: dict[str, str], timeout_s: float):
  """Publishes `facts` as this process's entry under `topic` and collects every process's.

  Returns (entries by process id, differences, seconds spent waiting for others) when all
  are there, `_SETTLE_S` after a first difference, or at `timeout_s`.
  """
  client, pid, n = _co.runtime()
  prefix = f"{_co.KEY}/{topic}/"
  deadline = time.monotonic() + timeout_s
  waited = 0.0
  try:
    client.key_value_set(prefix + str(pid), json.dumps(facts))
    while True:
      got = {int(k.rsplit("/", 1)[1]): json.loads(v)
             for k, v in client.key_value_dir_get(prefix)}
      diffs = differences(got)
      missing = [i for i in range(n) if i not in got]
      if diffs and missing and deadline > time.monotonic() + _SETTLE_S:
        # The job is lost anyway: wait a moment for the rest, so that every process names
        # the same differences against the same process.
        deadline = time.monotonic() + _SETTLE_S
      left = deadline - time.monotonic()
      if not missing or left <= 0:
        return got, diffs, waited
      t0 = time.monotonic()
      with contextlib.suppress(Exception):  # not there within the slice: look again
        client.blocking_key_value_get(prefix + str(missing[0]),
                                      max(1, int(min(1.0, left) * 1000)))
      waited += time.monotonic() - t0
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"process {pid}: JAX's coordination service failed while the processes compared "
        f"{topic} ({type(e).__name__}: {first}); the coordinator (process 0) is probably "
        "gone: check its log, then restart every process.") from e


def late(got: dict, n: int) -> str:
  missing = [str(p) for p in range(n) if p not in got]
  return (f" (process(es) {', '.join(missing)} had not reported within {_SETTLE_S:g} s of the "
          "first difference; they may differ too)" if missing else "")


def disagreement(what: str, diffs: list[str], late: str = "") -> DistributedError:
  return DistributedError(
      f"the processes of this job disagree on {what}: {'; '.join(diffs)}{late}. Every "
      "process must run the same code, versions and command line on the same kind of host; "
      "fix the odd ones out and restart every process.")

