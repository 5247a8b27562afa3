"""Emergency copies: besides the run's persistent checkpoints (every --checkpoint_every steps),
a frequent copy of the train state, with the data position, every --emergency_every steps in
--emergency_dir (default RUN_DIR/emergency; a fast disk, the newest `KEEP` kept), so that a
process killed without warning (kill -9, a host gone) loses at most that many steps. It is a
second orbax manager beside the persistent one: neither waits on the other's saves. A restart
resumes from the newer of the two (`newest`), saying which.

The options are checked before the data is read (`check_options`: a directory without an
interval is refused, not ignored), the directory before anything trains (`prepare`): writable
by every process and not another run's (its copies would resume this run from that run's
state): each is an `error:` line naming the fix, before anything of the persistent
checkpoints is touched. Copies
saved on another mesh or process count restore onto this one (orbax reads them by the
state's shardings; the data positions are mapped as for checkpoints, `batches`).

With `{process}` in --emergency_dir the copies are node-local (peer_copies.py): each process
keeps its own shards and a replica of one peer's in its own directory (`{process}` replaced
by its index: a host's local disk, where orbax's would need one shared directory), so a lost
host's directory is no loss; they restore onto the same mesh only.

  python recipes/train_lm.py --emergency_every=10          # copies in RUN_DIR/emergency
  python recipes/train_lm.py --emergency_every=10 --emergency_dir=/local/ssd/e/{process}
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import jax

import fnscale as fs
from recipes.lm import checkpoints, peer_copies
from recipes.lm.options import CheckpointOptions

KEEP = 2  # the newest copy, and the one before it while the next is written
OWNER_FILE = "owner.json"  # which run the copies are of (`prepare`)


def directory(c: CheckpointOptions) -> str:
  """Where a run with train_lm's checkpoint options `c` (run_dir filled in) keeps its
  emergency copies; "" when they are off (--emergency_every=0, or --nocheckpoint)."""
  if not (c.checkpoint and c.emergency_every):
    return ""
  return c.emergency_dir or os.path.join(c.run_dir, "emergency")


def check_options(c: CheckpointOptions) -> None:
  """Refuses emergency options that would save nothing unsaid: --emergency_dir without
  --emergency_every (its interval is the user's to choose: copies cost a save each), or
  --emergency_every with --nocheckpoint (a run that saves nothing resumes from nothing).

  Raises:
    InputError: naming the options and the fix.
  """
  if c.emergency_dir and not c.emergency_every:
    raise fs.InputError(f"--emergency_dir={c.emergency_dir} without --emergency_every: no "
                        "emergency copies are saved; fix: add --emergency_every=N to save one "
                        "every N steps there (e.g. 10), or leave --emergency_dir out")
  if c.emergency_every and not c.checkpoint:
    raise fs.InputError(f"--emergency_every={c.emergency_every} with --nocheckpoint: a run "
                        "without checkpoints neither saves nor resumes from emergency copies; "
                        "fix: drop --nocheckpoint, or leave --emergency_every out")


def owner(s) -> dict:
  """What names a run's copies as its own: its run directory and what fixes its state's
  shapes and data order (`s`: run_setup.Setup)."""
  return dict(run_dir=os.path.abspath(s.o.ckpt.run_dir), model=s.o.model.model_config,
              seq=s.cfg.seq, vocab=s.cfg.vocab, seed=s.o.data.seed,
              global_batch=s.o.step.global_batch)


def prepare(s, say) -> str:
  """Checks the emergency directory of run `s` on every process before anything trains,
  removes the saves a kill left unfinished, and records the run as its owner; returns it
  ("" when copies are off).

  Raises:
    InputError: the directory can't be written (by this process, or isn't the same for every
      process: unless node-local, with `{process}`), or holds another run's copies; the
      message names the fix, and that the persistent checkpoints are untouched.
  """
  d = directory(s.o.ckpt)
  if not d:
    return ""
  # An empty directory (made by an earlier refused start) holds nothing to keep.
  saved = s.o.ckpt.checkpoint_dir and os.path.isdir(s.o.ckpt.checkpoint_dir) and os.listdir(
      s.o.ckpt.checkpoint_dir)
  untouched = (f"the checkpoints in {s.o.ckpt.checkpoint_dir} are untouched" if saved
               else "nothing was saved")
  node_local = peer_copies.PLACEHOLDER in d
  fix = ("give a directory every process can write (--emergency_dir=PATH: "
         + ("a local disk's path on each host, with {process} in it" if node_local else
            "a fast local disk on one host, a shared file system on several, or a local disk "
            "on each host with {process} in the path")
         + f"), or --emergency_every=0 to save no emergency copies; {untouched}")
  d_mine = peer_copies.own_directory(d)
  if "://" in d:
    raise fs.InputError(f"--emergency_dir={d}: emergency copies are for a fast file system "
                        "path (a local disk, or a shared file system on several hosts), not an "
                        f"object store; the persistent --checkpoint_dir takes buckets. Fix: "
                        f"{fix}")
  if os.path.exists(d_mine) and not os.path.isdir(d_mine):
    raise fs.InputError(f"--emergency_dir={d_mine} is a file, not a directory; {fix}")
  try:
    os.makedirs(d_mine, exist_ok=True)
    probe = os.path.join(d_mine, f".writable-{jax.process_index()}")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    raise fs.InputError(f"--emergency_dir={d_mine} can't be written ({type(e).__name__}: "
                        f"{e.strerror or e}); {fix}") from None
  if not node_local:
    try:
      fs.checkpoint.check_shared_directory(d)  # several processes: orbax needs one directory
    except fs.DistributedError as e:
      raise fs.InputError(f"--emergency_dir={d}: {e} Or {fix}") from None
  ours = owner(s)
  if _inside(d_mine, s.o.ckpt.run_dir):  # moves with its run (a copied run dir): not its name
    ours.pop("run_dir")
  _check_owner(d_mine, ours, untouched)
  if node_local:  # each process its own directory: its own unfinished copies
    _remove_partial(d_mine, say)
  else:
    checkpoints.remove_unfinished(d, say)
  if node_local or jax.process_index() == 0:  # replaced whole: another may be reading it
    tmp = os.path.join(d_mine, f".{OWNER_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(owner(s), f)
    os.replace(tmp, os.path.join(d_mine, OWNER_FILE))
  return d


def _remove_partial(d: str, say) -> None:
  """Removes the node-local copies a kill left unwritten (`<step>.partial`), saying so."""
  gone = sorted(n for n in os.listdir(d) if n.endswith(peer_copies.PARTIAL))
  for name in gone:
    shutil.rmtree(os.path.join(d, name), ignore_errors=True)
  if gone:
    say(f"checkpoint: removed the unfinished emergency copies {gone} in {d} (a run ended "
        "while writing them); the complete ones are kept")


def _inside(d: str, run_dir: str) -> bool:
  d, run_dir = os.path.abspath(d), os.path.abspath(run_dir)
  return os.path.commonpath([d, run_dir]) == run_dir


def _check_owner(d: str, ours: dict, untouched: str) -> None:
  """Refuses copies in `d` that another run saved (another model or data order; another run
  directory where `ours` names one), or copies without an owner record."""
  path = os.path.join(d, OWNER_FILE)
  saved = sorted(int(n) for n in os.listdir(d) if n.isdigit())  # step directories
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      theirs = json.load(f)
  elif saved:
    theirs = {}
  else:
    return
  diff = [f"{k} {theirs.get(k)!r} (this run: {v!r})" for k, v in ours.items()
          if theirs.get(k) != v]
  if diff:
    raise fs.InputError(
        f"--emergency_dir={d} holds the emergency copies of another run (steps "
        f"{list(saved)}; " + (", ".join(diff) if theirs else f"no {OWNER_FILE} naming its run")
        + "): this run would resume from that run's state. Fix: give this run its own "
        f"--emergency_dir, or remove {d} if those copies are not needed; {untouched}")


@contextlib.contextmanager
def manager(d: str, mesh):
  """A context of the run's emergency copies over `d` (asynchronous saves, the newest `KEEP`
  kept): an orbax manager, or with `{process}` in `d` the node-local `peer_copies.Copies` of
  the run's `mesh`; None when `d` is "". Leaving it waits for the last save."""
  if not d:
    yield None
  elif peer_copies.PLACEHOLDER in d:
    copies = peer_copies.Copies(d, mesh, KEEP)
    try:
      yield copies
    finally:
      copies.close()
  else:
    with fs.checkpoint.manager(d, keep=KEEP) as local:
      yield local


def newest(ckpt, local, say):
  """The manager a restart resumes from: `local` (the emergency copies) when its newest
  complete finite step is newer than `ckpt`'s, else `ckpt`; says which when there are
  copies."""
  node_local = isinstance(local, peer_copies.Copies)
  copy = (local.latest_step() if node_local else fs.checkpoint.latest_step(local)
          if local is not None else None)
  if copy is None:
    if node_local and local.foreign:
      say(f"checkpoint: the emergency copies of step(s) {local.foreign} in {local.directory} "
          "were saved on another mesh (devices, processes or --mesh): node-local copies "
          "restore onto their own only; passed over (the newest checkpoint, if any, is "
          "resumed)")
    return ckpt
  kept = fs.checkpoint.latest_step(ckpt) if ckpt is not None else None
  if kept is not None and kept >= copy:
    say(f"checkpoint: the newest checkpoint (step {kept}) is not older than the newest "
        f"emergency copy (step {copy}, {local.directory}): resuming from the checkpoint")
    return ckpt
  say(f"checkpoint: resuming from the emergency copy of step {copy} ({local.directory}"
      + (_whose(local.held, copy) if node_local else "") + "); "
      + (f"the newest checkpoint is step {kept}" if kept is not None
         else "there is no checkpoint"))
  return local


def _whose(held: list, step: int) -> str:
  """Where each process's shards of node-local `step` come from (`held`: by process)."""
  n = len(held)
  lost = [i for i in range(n) if step not in held[i]]
  return (": every process's own" if not lost else ": " + ", ".join(
      f"process {i}'s shards from process {(i - 1) % n}'s replica" for i in lost))
