"""fnscale's errors.

Every error fnscale raises for bad input is a `FnscaleError`. Messages name the bad value
(with the pytree path for a leaf), say what was expected and how to fix it.
"""


class FnscaleError(ValueError):
  """Base class of every error fnscale raises for bad input or a failed environment."""


class TopologyError(FnscaleError):
  """The hardware description is malformed or disagrees with the devices present."""


class MeshError(FnscaleError):
  """Mesh axes don't fit the devices or each other."""


class ShardingError(FnscaleError):
  """Logical rules, PartitionSpecs or array shapes don't fit the mesh."""


class StepError(FnscaleError):
  """A train step, its state or its batch is malformed."""


class KernelError(FnscaleError):
  """A forced kernel implementation can't serve the call."""


class DistributedError(FnscaleError):
  """Multi-process initialisation or a cross-process wait failed."""


class CheckpointError(FnscaleError):
  """A checkpoint is missing, corrupt or doesn't fit the target state."""


class CloudError(FnscaleError):
  """A Cloud API request failed."""


class PlanError(FnscaleError):
  """The planner can't serve the request (nothing fits, a bad target or argument)."""
