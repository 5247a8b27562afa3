"""Exercises fnscale._compat's runtime entries in a fresh process, for tests/test_compat.py.

  python tests/compat_worker.py runtime   # one process of a job tests/multiprocess.py starts
  python tests/compat_worker.py barrier   # process 0 waits at a barrier process 1 skips
  python tests/compat_worker.py log       # compiles a program that draws a partitioner
                                          # warning, GSPMD propagation first

Prints one JSON line of findings on stdout. Each mode needs a process of its own: JAX joins a
job and starts its backends once per process, and logs GSPMD's notice once per process.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position


def _join(**kwargs):
  import jax
  jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                             int(os.environ["JAX_NUM_PROCESSES"]),
                             int(os.environ["JAX_PROCESS_ID"]), **kwargs)


def runtime() -> dict:
  """One process: the state, the client's key-value store, the preemption notice's key, and
  the backends' start."""
  from fnscale import _compat
  before = (_compat.backends_initialized(), _compat.distributed_state())
  _join()
  st = _compat.distributed_state()
  c = st.client
  c.key_value_set("t/a", "1", allow_overwrite=True)
  c.key_value_set("t/a", "2", allow_overwrite=True)
  c.key_value_set("t/b", "3")
  try:
    c.key_value_try_get("t/missing")
    missing = "returned"
  except Exception as e:  # pylint: disable=broad-except
    missing = type(e).__name__
  c.wait_at_barrier("t-barrier", 2000)
  os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier handles it
  notice = c.blocking_key_value_get(_compat.PREEMPTION_NOTICE_KEY, 10_000)
  import jax
  jax.devices()
  return {"before": [before[0], before[1].client is None, before[1].process_id,
                     before[1].num_processes, before[1].preemption_sync],
          "after": [st.process_id, st.num_processes, st.coordinator_address,
                    st.preemption_sync],
          "coordinator": os.environ["JAX_COORDINATOR_ADDRESS"],
          "try_get": c.key_value_try_get("t/a"), "missing": missing,
          "blocking_get": c.blocking_key_value_get("t/b", 1000),
          "dir": sorted(map(list, c.key_value_dir_get("t/"))),
          "notice": notice, "backends_after": _compat.backends_initialized()}


def barrier() -> dict:
  """Process 0 waits 1.5 s at a barrier that process 1 never reaches."""
  from fnscale import _compat
  _join()
  st = _compat.distributed_state()
  text = ""
  if st.process_id == 0:
    try:
      st.client.wait_at_barrier("t-absent", 1500)
    except Exception as e:  # pylint: disable=broad-except
      text = str(e)
    st.client.key_value_set("t/done", "1")
  else:
    st.client.blocking_key_value_get("t/done", 60_000)
  return {"text": text, "parsed": list(_compat.barrier_absentees(text))}


def log() -> dict:
  """Compiles, under GSPMD then Shardy propagation, a step XLA's partitioner warns about."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fnscale import _compat
  from fnscale import _compiler
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sh = lambda *spec: NamedSharding(mesh, P(*spec))
  args = (jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=sh("fsdp", "data")),
          jax.ShapeDtypeStruct((16,), jnp.int32, sharding=sh(("data", "fsdp"))),
          jax.ShapeDtypeStruct((16, 128), jnp.float32, sharding=sh(("data", "fsdp"), None)))
  out = {}
  for name, shardy in (("gspmd", False), ("shardy", True)):
    jax.config.update("jax_use_shardy_partitioner", shardy)
    lowered = jax.jit(lambda t, i, u: t.at[i].add(u)).lower(*args)
    _, _, text, _ = _compiler._compile_capturing(lowered, None)  # pylint: disable=protected-access
    out[name] = {"raw": text, "messages": _compat.xla_log_messages(text)}
  return out


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if sys.argv[1] == "log":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  result = {"runtime": runtime, "barrier": barrier, "log": log}[sys.argv[1]]()
  print(json.dumps(result), flush=True)
  time.sleep(0.1)
