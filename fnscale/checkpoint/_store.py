"""Checkpoints at pod scale: one orbax CheckpointManager per run, saves that overlap training,
restore onto any mesh, and never a bad state kept over a good one.

Built on orbax-checkpoint (the `checkpoint` extra: `pip install fnscale[checkpoint]`). A run
opens its checkpoint directory once and keeps the value for its whole length:

  with fs.checkpoint.manager(directory, keep=3) as ckpt:
    if fs.checkpoint.latest_step(ckpt) is not None:
      state, extra = fs.checkpoint.restore(ckpt, abstract_state, data=batches)
    for step in range(start, steps):
      state, metrics = train(state, next(batches))
      if (step + 1) % every == 0:
        fs.checkpoint.save(ckpt, step + 1, state, extra={"lr": lr}, data=batches)
  # leaving the block waits until the last save is committed

What a save blocks: `save` returns once the state is known to be finite, any earlier save of
the same manager has committed, and orbax has copied the arrays off the devices into host
memory; orbax writes and commits them in a background thread while the loop trains. `wait`
(or leaving the `with` block, or `close`) returns when the last save is committed.
`save(directory, ...)` with a path instead of a manager saves synchronously.

What fnscale adds to orbax's manager:
  * never overwrite: saving a step that is already complete raises CheckpointError.
  * damaged steps: a step whose commit marker, metadata or arrays can't be read is refused by
    `restore` (named, with its path), which falls back to the newest earlier good step; a save
    first moves damaged steps aside to `<step>.corrupt-<unix time>` (kept for inspection,
    never deleted), so rotation can't delete them and a new save can use the name.
  * never a non-finite state: `save` refuses a state with a NaN or inf in any floating leaf
    (naming the leaf) unless `allow_nonfinite=True`. Each step's metadata records whether its
    state was finite; `restore(step=None)` and `latest_step` pass over non-finite steps, and
    rotation (orbax's LatestN and EveryNSteps preservation policies) always also keeps the
    newest finite step.
  * data positions: `data=` (a grain iterator) saves its position per process through grain's
    own orbax handler (`grain.checkpoint`), so each process resumes its own position; a job
    restored with another process count says how positions map (`reshard_data`).
  * any mesh, device count or process count on restore: a checkpoint records values, shapes
    and dtypes, never the mesh; the target's shardings decide the layout.

Every process of a multi-process job calls `manager`, `save`, `restore` and `close` with the
same arguments, in the same order (they hold different shards, and orbax's manager
synchronises the processes when it opens, saves and restores); `latest_step` and `steps` on a
directory only read it and may be called from any process alone. The directory must be
visible to every process (a shared file system or a bucket such as `gs://...`;
`fnscale.checkpoint.check_shared_directory` checks it), and `restore(step=None)` restores
process 0's newest complete step everywhere.

Layout (orbax's; fnscale reads it only through orbax's API):

  <step>/                          one committed checkpoint per step: state/ (the arrays,
                                   OCDBT), extra/ (the JSON `extra`), data/ (grain's positions)
  <step>.orbax-checkpoint-tmp*/    a save that never finished: never read
  <step>.corrupt-<unix time>/      a damaged step moved aside: kept for inspection

By job: `_manager` (the manager, and the names the others share), `_steps` (what is on disk),
`_finite` (what may be saved), `_save`, `_restore`; this module gathers their public names.
"""
from fnscale.checkpoint._finite import all_finite, nonfinite_leaves
from fnscale.checkpoint._manager import Manager, close, manager, wait
from fnscale.checkpoint._restore import restore
from fnscale.checkpoint._save import save
from fnscale.checkpoint._steps import last_save_seconds, latest_step, steps

__all__ = [
    "Manager", "manager", "wait", "close", "save", "restore", "steps", "latest_step",
    "last_save_seconds", "all_finite", "nonfinite_leaves",
]
