"""Processes that disagree are named in seconds: real multi-process jobs on 127.0.0.1.

Each job runs tests/mp_worker.py (fnscale.initialize with the run's flags as config, then
shard_step) with one or two processes started differently, as a stale host would be. Every
process must end with fnscale's DistributedError (exit status 75) naming the odd process and
what differs, long before any barrier timeout (300 s).
"""
import json
import pathlib
import re
import sys
import time

import jax
import jaxlib
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mp_worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess as mp  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.multiprocess

WORKER = str(pathlib.Path(mp_worker.__file__))
JOB_TIMEOUT_S = 180
# The design bound: a disagreement ends every process within seconds of joining (start-up
# check) or of compiling (step check); generous for this loaded 2-core machine.
BOUND_S = 30


def _error(r: mp.Result) -> str:
  m = re.search(r"fnscale\.DistributedError: (.*)", r.stderr)
  return m.group(1) if m else ""


def _ended_named(results, pattern: str) -> list[str]:
  errors = []
  for r in results:
    assert r.returncode == 75, mp.describe(results)
    assert re.search(pattern, _error(r)), mp.describe(results)
    errors.append(_error(r))
  return errors


def test_start_up_disagreements_are_named_on_every_process(tmp_path):
  """Another model flag, another local device count and another jaxlib: all named at once."""
  results = mp.run(
      [WORKER, f"--out={tmp_path}"], 3, 2, JOB_TIMEOUT_S,
      process_args={1: ["--model=tiny"], 2: ["--fake_version=jaxlib=0.0.1"]},
      process_env={2: {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}})
  errors = _ended_named(results, r"^the processes of this job disagree on their set-up: ")
  for e in errors:
    assert "process 1 has --model=tiny, process 0 --model=nano" in e, e
    assert "process 2 has local_device_count=1, process 0 local_device_count=2" in e, e
    assert f"process 2 has jaxlib=0.0.1, process 0 jaxlib={jaxlib.__version__}" in e, e
    # What agrees is not named.
    assert "process 1 has local_device_count" not in e and "--lr" not in e
  for r in results:
    assert not [ln for ln in r.stdout.splitlines() if '"event": "step"' in ln]
    print(f"process {r.process_id} ended after {r.elapsed_s:.1f} s (from its start)")
    assert r.elapsed_s < BOUND_S, mp.describe(results)


@pytest.mark.slow
@pytest.mark.parametrize("odd,named", [
    # tests/models.py: w_in is [d_model, d_mlp]; nano (32, 64), tiny (64, 128). Params come
    # first (pytree order), six per process, then a count.
    ("--model=tiny", r"process 1: params/blocks/0/ln1 \(64,\) float32, process 0: \(32,\) "
     r"float32; process 1: params/blocks/0/ln2 \(64,\) float32, process 0: \(32,\) float32; "
     r"process 1: params/blocks/0/w_in \(64, 128\) float32, process 0: \(32, 64\) float32; "
     r".*; and \d+ more differences of process 1\."),
    # The same shapes, another constant in the program.
    ("--lr=0.01", r"process 1 compiled program \w+, process 0 program \w+, with the same "
     r"shapes, mesh and compiler options"),
])
def test_compiled_step_disagreement_is_named_on_every_process(tmp_path, odd, named):
  """No config check at start-up: the check after shard_step compiles names the odd one,
  within seconds of the last process finishing its compile."""
  args = [WORKER, f"--out={tmp_path}", "--agree=", "--mesh=data=2,fsdp=2", "--batch=8"]
  with mp.job(args, 2, 2, process_args={1: [odd]}) as job:
    compiled = []
    for i in (0, 1):  # the moment each says it compiled (seen within 50 ms)
      mp.wait_for_output(job, i, r"shard_step: compiled step \w+ in", JOB_TIMEOUT_S,
                         stream="stderr")
      compiled.append(time.monotonic())
    results = mp.wait(job, JOB_TIMEOUT_S)
  _ended_named(results, r"^the processes of this job disagree on the step they compiled "
               r"\(compiled step \w+\): " + named)
  last = max(compiled)
  for r, p in zip(results, job.processes):
    assert not [ln for ln in r.stdout.splitlines() if '"event": "step"' in ln]
    took = p.started + r.elapsed_s - last
    print(f"process {r.process_id} ended {took:.1f} s after the last compile finished")
    assert took < BOUND_S, mp.describe(results)


# Process 0 alone makes a report, compiles again, plans (with an ahead-of-time compile for a
# TPU target) and checks mesh invariance over its own devices while process 1 is already in
# its first step, waiting for process 0 there.
_ONE_PROCESS_CALLS = """
import functools, json, sys, time
sys.path.insert(0, {tests!r})
import multiprocess, mp_worker, models
multiprocess.initialize_from_env(timeout_s=60, heartbeat_timeout_s=30)
import jax, numpy as np, optax
import fnscale as fs
from fnscale.analysis import check_mesh_invariance
mesh, _, sharded, init = mp_worker.build("data=2,fsdp=2")
state = init()
cfg, bs = models.TRANSFORMER, fs.batch_sharding(mesh)
tokens = mp_worker.global_tokens(0, 8, cfg.seq, cfg.vocab)[mp_worker.local_rows(bs, 8)]
batch = fs.global_batch({{"tokens": tokens}}, bs)
step = sharded.compile(state, batch)
fs.multihost.agree_on_step(step)
rows = jax.ShapeDtypeStruct((8, cfg.seq + 1), np.int32)
local = jax.local_devices()  # invariance over this process's own devices
meshes = [fs.make_mesh({{"data": 1}}, devices=local[:1]),
          fs.make_mesh({{"data": 2}}, devices=local)]
mlp_batch = jax.tree.map(np.asarray, models.mlp_batch(jax.random.key(1), 8))
calls = {{
    "compile_report": lambda: fs.compile_report(sharded, state, batch),
    "compile": lambda: sharded.compile(state, batch),
    "plan_verify": lambda: fs.analysis.plan(
        functools.partial(models.transformer_init, cfg=cfg),
        lambda p, b: models.transformer_loss(p, b)[0], optax.adam(1e-3), {{"tokens": rows}},
        "v5p-8", fs.analysis.PlanOptions(
            rules=models.RULES, logical_axes=models.transformer_logical_axes(cfg),
            key=jax.random.key(0), verify=1, accum_steps=(1,))),
    "latest_step": lambda: fs.checkpoint.latest_step({ckpt!r}),
    "check_mesh_invariance": lambda: check_mesh_invariance(
        models.mlp_loss, optax.sgd(0.1), models.mlp_init, mlp_batch, meshes,
        key=jax.random.key(0)).max_diff,
}}
took = {{}}
for name, call in calls.items():
  if jax.process_index() == 0:
    t0 = time.perf_counter()
    out = call()
    took[name] = time.perf_counter() - t0
    print(json.dumps({{"event": name, "s": took[name],
                      "value": out if isinstance(out, (int, float)) else None}}), flush=True)
state, metrics = step(state, batch)
print(json.dumps({{"event": "done", "loss": float(metrics["loss"])}}), flush=True)
"""
ONE_PROCESS_BOUND_S = 60


@pytest.mark.slow
def test_reports_compiles_and_plans_on_process_0_alone_never_wait_for_the_others(tmp_path):
  from fnscale import checkpoint  # pylint: disable=import-outside-toplevel
  checkpoint.save(tmp_path / "ckpt", 3, {"w": np.zeros(2, np.float32)})
  script = tmp_path / "one_process_calls.py"
  script.write_text(_ONE_PROCESS_CALLS.format(tests=str(pathlib.Path(__file__).parent),
                                              ckpt=str(tmp_path / "ckpt")))
  results = mp.run([script], 2, 2, JOB_TIMEOUT_S)
  assert all(r.returncode == 0 for r in results), mp.describe(results)
  events = [mp.records(r.stdout) for r in results]
  took = {e["event"]: e["s"] for e in events[0] if "s" in e}
  print(f"process 0 alone: {took}")
  assert sorted(took) == ["check_mesh_invariance", "compile", "compile_report", "latest_step",
                         "plan_verify"], mp.describe(results)
  values = {e["event"]: e["value"] for e in events[0] if "s" in e}
  assert values["latest_step"] == 3  # the calls did their work
  assert values["check_mesh_invariance"] <= 1e-6
  assert all(s < ONE_PROCESS_BOUND_S for s in took.values()), took
  assert not [e for e in events[1] if "s" in e]  # process 1 made none of those calls
  # Both then ran the same first step.
  assert events[0][-1]["loss"] == events[1][-1]["loss"], mp.describe(results)
