"""One process of a multi-process training job, as tests/test_multihost.py runs it.

  python tests/mp_worker.py --out=DIR --steps=6 [--mesh=data=2,fsdp=4] [--ckpt_every=2]

It is also the reference for how a training program uses fnscale's multi-host pieces:
`fnscale.initialize(config=flags)` (every process must run the same flags, versions and
device count), `shard_step` (every process must compile the same step),
`fnscale.multihost.preemption_guard` (a SIGTERM becomes "save step N and exit 143" on every
process) and `fnscale.multihost.peer_guard` (a lost process becomes a DistributedError, exit 75).

Joins the job from the environment `tests/multiprocess.py` sets (or runs alone), builds the
mesh over every process's devices (ordered by process, so "data" and for 4 processes also
"fsdp" run across processes), trains tests/models.py's transformer with fnscale's
`train_step` / `init_state` / `shard_step`, `fnscale.multihost.agree_on_step` (the
barrier after compiling, which checks every process compiled the same step),
feeding only this process's rows of each global batch through `fnscale.global_batch`.

Prints one JSON line per event on stdout: {"event": "step", "step": s, "loss": ...},
{"event": "checkpoint", "step": s, "previous_in_flight": bool}, {"event": "preempted", ...},
{"event": "done"}. Every process keeps one `fnscale.checkpoint.manager` for the run and calls
`fnscale.checkpoint.save` through it (async unless --async_ckpt=0: the loop goes on while the
step is written; --slow_commit_s simulates slow storage); only process 0 writes
DIR/losses.jsonl and DIR/params.npz (the final params, gathered from every process).

On SIGTERM (a preemption notice) JAX's preemption service agrees with every process on one
step to stop at; all save a checkpoint there (after a save still in flight has committed),
wait for its commit and exit 143 (`fs.multihost.EXIT_PREEMPTED`).
Rerunning resumes from the newest checkpoint. `--restore_only` restores the newest
checkpoint onto this job's mesh and writes its params to DIR/restored.npz. A lost process
ends the loop in a `fnscale.DistributedError` (`fnscale.multihost.peer_guard`), exit
status 75; so do processes that disagree (start-up or compiled step). Each event's wall time also goes to
stderr ("<unix time> <event>").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import multiprocess  # tests/multiprocess.py: the job's place in the environment

DATA_SEED = 1234
LEARNING_RATE = 3e-3


def _args(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--mesh", default="data=2,fsdp=4")
  p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
  p.add_argument("--ckpt_every", type=int, default=0)
  p.add_argument("--rows", default="sharding", choices=("sharding", "halves"),
                 help="rows each process feeds: its devices' (right) or a per-process split")
  p.add_argument("--slow_after", type=int, default=-1, help="sleep after each later step")
  p.add_argument("--sleep_s", type=float, default=0.0)
  p.add_argument("--init_timeout_s", type=float, default=60)
  p.add_argument("--heartbeat_s", type=float, default=10)
  p.add_argument("--peer_check_s", type=float, default=3)
  p.add_argument("--restore_only", action="store_true")
  p.add_argument("--model", default="nano", choices=sorted(MODELS))
  p.add_argument("--lr", type=float, default=LEARNING_RATE)
  p.add_argument("--agree", default="model,lr,mesh,batch",
                 help="flags passed to fnscale.initialize(config=...); empty: none")
  p.add_argument("--fake_version", default="",
                 help="NAME=VERSION this process reports (a stale install, simulated)")
  p.add_argument("--hold", type=int, default=-1,
                 help="this process sleeps --hold_s before the 'ready' barrier")
  p.add_argument("--hold_s", type=float, default=0.0)
  p.add_argument("--grace_s", type=float, default=20.0)
  p.add_argument("--async_ckpt", type=int, default=1, help="1: saves overlap training")
  p.add_argument("--slow_commit_s", type=float, default=0.0,
                 help="each of a save's commit renames (its step directory and each item's: "
                 "three here) first waits this long (slow storage, simulated)")
  return p.parse_args(argv)


# Model sizes by name: "tiny" is "nano" twice as wide; "heads8" has 8 heads (a tensor=8 mesh
# splits them).
MODELS = {"nano": {}, "tiny": {"d_model": 64, "d_mlp": 128}, "heads8": {"heads": 8}}


def _emit(**event):
  print(json.dumps(event), flush=True)
  print(f"{time.time():.3f} {event['event']}", file=sys.stderr, flush=True)  # when, for timing


def global_tokens(step: int, batch: int, seq: int, vocab: int):
  """The whole batch of step `step`, the same in every layout: int32 [batch, seq + 1]."""
  import numpy as np
  rng = np.random.default_rng([DATA_SEED, step])
  return rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)


def local_rows(sharding, batch: int, how: str = "sharding"):
  """Row indices of the global batch this process feeds: "sharding", the rows its devices
  hold (`fnscale.process_rows`); "halves", process i's i-th equal part whatever the mesh
  (grain's ShardByJaxProcess): wrong where the mesh replicates the batch across processes."""
  import jax
  import numpy as np
  import fnscale as fs
  if how == "halves":
    n, i = jax.process_count(), jax.process_index()
    return np.arange(i * batch // n, (i + 1) * batch // n)
  return fs.process_rows(sharding, batch)


def build(mesh_axes: str, model: str = "nano", lr: float = LEARNING_RATE):
  """(mesh, optimizer, sharded step, init state fn) for tests/models.py's transformer."""
  import functools
  import jax
  import optax
  import fnscale as fs
  import fnscale as fstep
  import models
  mesh = fs.make_mesh(mesh_axes)
  opt = optax.adam(lr)
  cfg = models.TRANSFORMER._replace(**MODELS[model])
  axes = models.transformer_logical_axes(cfg)
  step = fstep.shard_step(fstep.train_step(models.transformer_loss, opt, has_aux=True), mesh,
                          rules=models.RULES, logical_axes=axes)

  def init():
    return fstep.init_state(functools.partial(models.transformer_init, cfg=cfg), opt,
                            mesh=mesh, rules=models.RULES,
                            logical_axes=axes, key=jax.random.key(0))
  return mesh, opt, step, init


def compiled(step, state, mesh, args):
  """The step compiled for this run's batch, then checked to be the same on every process
  (`fnscale.multihost.agree_on_step`, the barrier after compiling)."""
  import jax
  import numpy as np
  import fnscale as fs
  import models
  cfg = models.TRANSFORMER._replace(**MODELS[args.model])
  rows = jax.ShapeDtypeStruct((args.batch, cfg.seq + 1), np.int32,
                              sharding=fs.batch_sharding(mesh))
  step = step.compile(state, {"tokens": rows})
  fs.multihost.agree_on_step(step)
  return step


def gathered_params(params):
  """Every process's shards gathered into host numpy arrays, keyed by pytree path."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  full = multihost_utils.process_allgather(params, tiled=True)
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(full)[0]}


def _fake_version(spec: str) -> None:
  """Makes this process report another version of one package (`NAME=VERSION`)."""
  from fnscale.multihost import _agreement  # where the start-up check reads the versions
  name, _, version = spec.partition("=")
  real = _agreement._versions  # pylint: disable=protected-access
  _agreement._versions = lambda: {**real(), name: version}  # pylint: disable=protected-access


def _join(args):
  """fnscale.initialize with this run's flags as the config every process must share."""
  from absl import logging
  logging.set_verbosity(logging.INFO)  # the agreement checks show in the log
  if args.fake_version:
    _fake_version(args.fake_version)
  config = {k: getattr(args, k) for k in filter(None, args.agree.split(","))}
  t0 = time.perf_counter()
  info = multiprocess.initialize_from_env(
      timeout_s=args.init_timeout_s, heartbeat_timeout_s=args.heartbeat_s,
      shutdown_timeout_s=60, config=config)
  return info, time.perf_counter() - t0


def _slow_commits(seconds: float) -> None:
  """Each of orbax's commit renames (in its background thread: the step directory and each
  item's, three per save here) first waits `seconds`: storage slow enough that a save is still
  in flight at the next one."""
  import asyncio
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def slow(self):
    await asyncio.sleep(seconds)
    await finalize(self)
  atomicity.AtomicRenameTemporaryPath.finalize = slow


def _train(args, pid, state, step, mesh, should_stop, ckpt, start):
  """The loop: one step, its loss, the preemption check, a checkpoint when due."""
  import fnscale as fs
  from fnscale import checkpoint
  import models
  cfg = models.TRANSFORMER._replace(**MODELS[args.model])
  bs = fs.batch_sharding(mesh)
  rows = local_rows(bs, args.batch, args.rows)
  log = open(os.path.join(args.out, "losses.jsonl"), "a") if pid == 0 else None
  with fs.multihost.peer_guard(timeout_s=args.peer_check_s):
    for s in range(start, args.steps):
      tokens = global_tokens(s, args.batch, cfg.seq, cfg.vocab)[rows]
      state, metrics = step(state, fs.global_batch({"tokens": tokens}, bs))
      loss = float(metrics["loss"])
      _emit(event="step", step=s, loss=loss)
      if log:
        log.write(json.dumps({"step": s, "loss": loss}) + "\n")
        log.flush()
      stop = should_stop(s)  # True on every process at the same step after a notice
      if stop or (args.ckpt_every and (s + 1) % args.ckpt_every == 0):
        in_flight = ckpt.orbax.is_saving_in_progress()  # the previous save, still writing
        checkpoint.save(ckpt, s + 1, state, extra={"step": s + 1})
        _emit(event="checkpoint", step=s + 1, previous_in_flight=in_flight)
      if stop:
        checkpoint.wait(ckpt)  # committed before the process exits
        _emit(event="preempted", step=s + 1)
        return state, fs.multihost.EXIT_PREEMPTED
      if 0 <= args.slow_after <= s:
        time.sleep(args.sleep_s)
  if log:
    log.close()
  return state, 0


def main(argv) -> int:
  args = _args(argv)
  info, join_s = _join(args)
  import jax
  import numpy as np
  import fnscale as fs
  from fnscale import checkpoint
  pid = jax.process_index()
  os.makedirs(args.out, exist_ok=True)
  if args.slow_commit_s:
    _slow_commits(args.slow_commit_s)
  ckpt_dir = os.path.join(args.out, "ckpt")
  fs.checkpoint.check_shared_directory(ckpt_dir)  # every process sees the same one
  # One checkpoint manager for the run; leaving the block waits for the last save.
  with fs.multihost.preemption_guard(grace_s=args.grace_s) as should_stop, checkpoint.manager(
      ckpt_dir, async_save=bool(args.async_ckpt)) as ckpt:
    mesh, _, step, init = build(args.mesh, args.model, args.lr)
    _emit(event="start", process=pid, processes=jax.process_count(),
          devices=jax.device_count(), mesh=dict(mesh.shape), info=list(info), join_s=join_s)
    state = init()
    start = checkpoint.latest_step(ckpt)
    if start is not None:
      state, extra = checkpoint.restore(ckpt, state, step=start)
      _emit(event="restored", step=start, extra=extra)
    checkpoint.nonfinite_leaves(state)  # compiles save's finiteness check outside any notice
    if args.restore_only:
      params = gathered_params(state.params)
      if pid == 0:
        np.savez(os.path.join(args.out, "restored.npz"), **params)
      _emit(event="done", step=start)
      return 0
    step = compiled(step, state, mesh, args)
    if args.hold >= 0:
      _emit(event="holding" if pid == args.hold else "waiting")
      if pid == args.hold:
        time.sleep(args.hold_s)
      fs.barrier("ready", timeout_s=120)
    state, status = _train(args, pid, state, step, mesh, should_stop, ckpt, start or 0)
  if status:
    return status
  params = gathered_params(state.params)
  if pid == 0:
    np.savez(os.path.join(args.out, "params.npz"), **params)
  _emit(event="done", step=args.steps)
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main(sys.argv[1:]))
  except Exception as e:  # pylint: disable=broad-except
    from fnscale import DistributedError
    if not isinstance(e, DistributedError):
      raise
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    if "lost process" in str(e):
      # Python's own exit would wait for the lost process at JAX's shutdown barrier.
      os._exit(75)  # pylint: disable=protected-access
    # Every process is raising: leave through JAX's shutdown barrier, so the coordinator
    # (process 0) stays up until the others have said what differs.
    sys.exit(75)
