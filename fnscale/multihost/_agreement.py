"""Agreement between processes through JAX's coordination service.

Every process publishes what must agree as one JSON entry under fnscale/<topic>/<process id>
in the key-value store of JAX's coordination service and reads everyone else's, so a
difference is named in seconds instead of surfacing as a hang inside a collective
(`exchange`, `from_process_0`, `agreed_choice`). `fnscale.checkpoint` uses it for the step
every process restores, `fnscale.checkpoint._shared_dir` for the shared-directory check.

The checks of `fnscale.multihost` built on it live here too: `barrier` (a bounded wait),
`agree_at_start` (right after `fnscale.initialize` joins: versions, local devices and the
caller's config) and `agree_on_step` (the barrier after compiling: every process compiled the
same step), with the facts they compare. `fnscale.multihost` re-exports `barrier` and
`agree_on_step`.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import pathlib
import time
from importlib import metadata
from typing import Mapping

from absl import logging
import jax
import numpy as np

from fnscale import _compat
from fnscale.multihost import _coordination as _co
from fnscale import _compile
from fnscale.multihost._coordination import DEFAULT_TIMEOUT_S
from fnscale._tree import path_str
from fnscale._errors import DistributedArgumentError, DistributedError

_MAX_NAMED = 6  # differences spelled out per process; the rest are counted
_SETTLE_S = 10.0  # after a first difference, how long to wait for the other processes' entries
# Numbers the broadcasts from process 0 (`from_process_0`), the same on every process.
choice_count = itertools.count()
# The k-th agree_on_step call of this process is compared with the k-th of every other.
_agree_count = itertools.count()
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


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
        "fnscale.checkpoint.check_shared_directory), then restart every process.")
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


# ------------------------------------------------------------------------------ the checks

def barrier(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Blocks until every process reaches the barrier `name`, for at most `timeout_s` seconds.

  A no-op in a single process. Uses the distributed runtime's bounded `wait_at_barrier`.

  Raises:
    DistributedArgumentError: an empty or non-str name, or a timeout that isn't positive.
    DistributedError: not every process arrived in time; or several processes without JAX's
      coordination service (`fnscale.initialize` was not called).

  Examples:
    >>> import jax
    >>> import fnscale as fs
    >>> fs.barrier("checkpoint-saved")  # one process: returns at once
    >>> jax.process_count()
    1
  """
  if not isinstance(name, str) or not name:
    raise DistributedArgumentError(f"barrier name {name!r}, expected a non-empty string.")
  if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
    raise DistributedArgumentError(
        f"barrier timeout_s={timeout_s!r}, expected a positive number.")
  if _co.job_runtime(f"barrier({name!r})") is None:
    logging.debug("barrier %s: single process", name)
    return
  st = _compat.distributed_state()
  if (st.num_processes or 1) == 1:
    return
  try:
    with _co.waiting(name):
      st.client.wait_at_barrier(f"fnscale:{name}", max(1, int(timeout_s * 1000)))
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    arrived, missing = _co.barrier_absentees(str(e))
    who = (f"{arrived} of {st.num_processes} arrived; missing: processes "
           f"{', '.join(map(str, missing))}; " if missing else "")
    where = _co.where_others(st.client, st.process_id, st.num_processes, name)
    raise DistributedError(
        f"barrier {name!r}: not all {st.num_processes} processes arrived within {timeout_s} s "
        f"({who}{''.join(w + '; ' for w in where)}this is process {st.process_id}; {first}); "
        f"fix: make every process call barrier({name!r}) in the same order, check that none "
        "crashed or hangs, or raise timeout_s.") from e
  logging.info("barrier %s passed", name)


def agree_at_start(config: dict[str, str], timeout_s: float) -> None:
  """Right after joining: versions, local devices and `config` must agree everywhere."""
  rt = _co.runtime()
  if rt is None:
    return
  _, pid, n = rt
  jax.local_devices()  # starts the backend, as the program's first jax call would anyway
  t0 = time.perf_counter()
  with _co.waiting("start-up check"):
    got, diffs, waited = exchange("start", _start_facts(config), timeout_s)
  if diffs:
    raise disagreement("their set-up", diffs, late(got, n))
  missing = [p for p in range(n) if p not in got]
  if missing:
    raise DistributedError(
        f"process(es) {', '.join(map(str, missing))} of {n} joined the job but did not report "
        f"their versions and devices within {timeout_s} s (this is process {pid}); fix: check "
        "their logs, or raise timeout_s.")
  logging.info("fnscale.initialize: all %d processes agree on versions, devices and config "
               "(check: %.1f ms of work, %.1f ms waiting for the others)", n,
               1000 * (time.perf_counter() - t0 - waited), 1000 * waited)


def agree_on_step(compiled, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """The barrier after a step compiles: every process checks that all compiled the same.

  Call it on every process after `shard_step(...).compile(state, batch)`, before the first
  step (`recipes/train_lm.py` does). Compiling itself never waits for other processes, so a
  report or a plan made on one process alone doesn't block; this is the one place where
  the processes meet after compiling. Each process publishes the step's fingerprint
  through JAX's coordination service (a hash of the lowered program, the mesh, the compiler
  options, and every state and batch leaf's path, shape and dtype) and compares everyone's
  as they arrive; when all agree, all go on (the exchange is the barrier). Like `barrier`,
  every process makes the same calls in the same order: the k-th call of each process is
  compared with the k-th of every other. In one process it returns at once.

  Args:
    compiled: the compiled step (`shard_step(...).compile(state, batch)`).
    timeout_s: seconds to wait for every process's fingerprint.

  Raises:
    DistributedArgumentError: `compiled` is no CompiledStep.
    DistributedError: within moments of the first differing fingerprint, on every process,
      naming the processes and what differs ("process 1: params/w (64, 64) float32, process
      0: (32, 32) float32"); a process that didn't arrive in `timeout_s` (where it last was
      and whether its heartbeats still come); or several processes without JAX's
      coordination service (`fnscale.initialize`).

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp, optax
    >>> loss = lambda params, batch: jnp.mean((batch["x"] @ params["w"]) ** 2)
    >>> mesh = fs.make_mesh({"data": 8})
    >>> state = fs.init_state({"w": jnp.ones((4, 1))}, optax.sgd(0.1), mesh=mesh)
    >>> step = fs.shard_step(fs.train_step(loss, optax.sgd(0.1)), mesh)
    >>> step = step.compile(state, {"x": jnp.ones((16, 4))})
    >>> fs.multihost.agree_on_step(step)  # one process: nobody to disagree
    >>> fs.multihost.agree_on_step("step")
    Traceback (most recent call last):
    ...
    fnscale.DistributedArgumentError: agree_on_step(compiled=str): expected the CompiledStep ...
  """
  if not isinstance(compiled, _compile.CompiledStep):
    raise DistributedArgumentError(
        f"agree_on_step(compiled={type(compiled).__name__}): expected the CompiledStep that "
        "shard_step(...).compile(state, batch) returns; fix: step = step.compile(state, "
        "batch), then fnscale.multihost.agree_on_step(step) on every process.")
  text = compiled.lowered.as_text()
  name = f"compiled step {hashlib.sha256(text.encode()).hexdigest()[:12]}"
  rt = _co.job_runtime(f"agree_on_step ({name})")
  if rt is None:
    return
  client, pid, n = rt
  t0 = time.perf_counter()
  sig = compiled.signature
  state, batch = (jax.tree_util.tree_unflatten(
      treedef, [jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype, _ in leaves])
                  for treedef, leaves in ((sig.state_def, sig.state_leaves),
                                          (sig.batch_def, sig.batch_leaves)))
  facts = _step_facts(text, state, batch, compiled.mesh, compiled.compiler_options)
  with _co.waiting(name):
    got, diffs, waited = exchange(f"step/{next(_agree_count)}", facts, timeout_s)
  if diffs:
    raise disagreement(f"the step they compiled ({name})", diffs, late(got, n))
  missing = [p for p in range(n) if p not in got]
  if missing:
    where = _co.where_others(client, pid, n, name)
    raise DistributedError(
        f"{name}: process(es) {', '.join(map(str, missing))} of {n} did not finish compiling "
        f"the step within {timeout_s} s ({'; '.join(where) or 'no word from them'}; this is "
        f"process {pid}); fix: check their logs (crashed, hung, preempted), make every "
        "process call agree_on_step after compiling, or raise timeout_s for very long "
        "compiles.")
  logging.info("barrier %s passed: all %d processes compiled the same program (check: %.1f "
               "ms of work, %.1f ms waiting for the others)", name, n,
               1000 * (time.perf_counter() - t0 - waited), 1000 * waited)


# ----------------------------------------------------------------- what the checks compare

def check_config(config) -> dict[str, str]:
  """`initialize`'s `config` as the facts `agree_at_start` compares: {"--name": str(value)}.

  Raises:
    DistributedArgumentError: `config` is neither None nor a mapping with str keys.
  """
  if config is None:
    return {}
  if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
    raise DistributedArgumentError(
        f"config={config!r:.200}, expected a mapping of str names to values (e.g. a recipe's "
        "flags); fix: pass dict(flag=value, ...) or None.")
  return {f"--{k}": str(v) for k, v in config.items()}


def _source_digest() -> str:
  """sha256 of fnscale's own source files (names and bytes): differs for a stale checkout."""
  h = hashlib.sha256()
  for f in sorted(_PACKAGE_DIR.rglob("*.py")):
    h.update(f.relative_to(_PACKAGE_DIR).as_posix().encode() + b"\0" + f.read_bytes())
  return h.hexdigest()[:12]


def _versions() -> dict[str, str]:
  """The versions every process must share: jax and jaxlib (as imported), libtpu and
  fnscale (as installed, "absent" if not) and a digest of fnscale's source."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
  for name in ("libtpu", "fnscale"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "absent"
  out["fnscale_source"] = _source_digest()
  return out


def _start_facts(config: dict[str, str]) -> dict[str, str]:
  """What must agree before anything runs: versions, local devices and the caller's config."""
  devices = jax.local_devices()
  kinds = sorted({d.device_kind for d in devices})
  return {**_versions(), "local_device_count": str(len(devices)),
          "device_kind": ",".join(kinds) or "none", **config}


def _leaf_text(leaf) -> str:
  shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
  dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
  return f"{shape} {np.dtype(dtype).name}"


def _step_facts(program_text: str, state, batch, mesh, compiler_options) -> dict[str, str]:
  """A compiled step's fingerprint: program hash, mesh, compiler options, leaf shapes."""
  kinds = sorted({getattr(d, "device_kind", "?") for d in mesh.devices.flat})
  facts = {
      "program": hashlib.sha256(program_text.encode()).hexdigest()[:16],
      "mesh": ",".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({'/'.join(kinds)})",
      "compiler_options": json.dumps(
          sorted((str(k), str(v)) for k, v in dict(compiler_options or {}).items())),
  }
  for prefix, tree in (("state:", state), ("batch:", batch)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      facts[prefix + path_str(path)] = _leaf_text(leaf)
  return facts
