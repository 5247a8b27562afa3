"""fnscale's errors, by kind.

Every error fnscale raises is a `FnscaleError`, in one of two kinds:

- `InputError` (also a `ValueError`): the caller passed something that can't work (an
  argument, a config, a mesh, rules, a model that doesn't fit). Fix the input and call again.
  Messages name the bad value (with the pytree path for a leaf), say what was expected and
  how to fix it. Each mistake has one type wherever it is made: e.g. a `mesh=` that is not a
  `jax.sharding.Mesh` is a `MeshError` from `make_mesh`, `shardings`, `init_state` and
  `shard_step` alike.
- `RuntimeFailure` (also a `RuntimeError`, never a `ValueError`): the environment failed
  while the call was right (a lost or late peer process, a failed HTTP request, a storage
  read or write that failed). An `except ValueError` written for bad arguments doesn't
  swallow these.
"""


import difflib


def did_you_mean(name, candidates) -> str:
  """"; did you mean 'fsdp'?" for the candidate closest to `name` (difflib's ratio >= 0.6), or
  "" when none is close: the suffix of a message refusing an unknown name."""
  close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
  return f"; did you mean {close[0]!r}?" if close else ""


class FnscaleError(Exception):
  """Base class of every error fnscale raises."""


class InputError(FnscaleError, ValueError):
  """Bad input: an argument, config or value that can't work (a `ValueError`)."""


class RuntimeFailure(FnscaleError, RuntimeError):
  """The environment failed while the input was right (not a `ValueError`)."""


class TopologyError(InputError):
  """The hardware description is malformed or disagrees with the devices present."""


class MeshError(InputError):
  """Mesh axes don't fit the devices or each other, or a `mesh=` that is not a Mesh."""


class ShardingError(InputError):
  """Logical rules, PartitionSpecs or array shapes don't fit the mesh."""


class StepError(InputError):
  """A train step, its state or its batch is malformed."""


class KernelError(InputError):
  """A forced kernel implementation can't serve the call."""


class ExpertError(InputError):
  """A mixture-of-experts layer's arguments can't work: params that don't fit the tokens,
  k outside [1, experts], a capacity factor <= 0."""


class LoraError(InputError):
  """LoRA's arguments can't work: a target pattern that matches no leaf, a leaf its layout
  doesn't fit (not a matmul weight), adapters that don't match the base or the config."""


class CheckpointError(InputError):
  """A checkpoint is missing, corrupt or doesn't fit the target state, or a bad argument."""


class PlanError(InputError):
  """The planner can't serve the request (nothing fits, a bad target or argument)."""


class FitError(PlanError):
  """A step does not fit its devices' memory (`fnscale.analysis.fit`). Fields: `needed`
  (bytes per device), `limit` (the device's bytes, or None where XLA refused the program
  without one given), `options` (`fnscale.analysis.plan.FitOption`s that would fit by the
  planner's estimate, best first)."""

  def __init__(self, message: str, *, needed: float = 0.0, limit: float | None = None,
               options: tuple = ()):
    super().__init__(message)
    self.needed, self.limit, self.options = needed, limit, tuple(options)


class DistributedArgumentError(InputError):
  """A malformed argument to a multi-process call: a process id, process count or
  coordinator address (given or read from `JAX_*` variables, or the roll call's
  `FNSCALE_ROLLCALL_PORT`), a timeout or grace period, a config, a barrier name, a step that
  isn't compiled or isn't an int, or `preemption_guard` entered outside the main thread. Not
  a `DistributedError`: nothing was tried yet."""


class DistributedError(RuntimeFailure):
  """Multi-process initialisation or a cross-process wait failed (a peer lost or late)."""


class CloudError(RuntimeFailure):
  """A Cloud API request failed (HTTP error, network, credentials)."""


class StorageError(RuntimeFailure):
  """Writing or reading files (e.g. a checkpoint) failed in the storage layer."""
