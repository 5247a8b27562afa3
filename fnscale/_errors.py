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
  """Base class of every error fnscale raises: an `InputError` or a `RuntimeFailure`.

  Examples:
    >>> import fnscale as fs
    >>> try:
    ...   fs.make_mesh({"data": 3})  # 8 devices here
    ... except fs.FnscaleError as e:
    ...   print(type(e).__name__, "|", e)
    MeshError | ICI axes {'data': 3} multiply to 3 devices but there are 8; make the ...
  """


class InputError(FnscaleError, ValueError):
  """Bad input: an argument, config or value that can't work (a `ValueError`): fix the input
  and call again. Each kind below is one.

  Examples:
    >>> import fnscale as fs
    >>> issubclass(fs.MeshError, fs.InputError), issubclass(fs.InputError, ValueError)
    (True, True)
    >>> fs.parse_axes("data:2")
    Traceback (most recent call last):
    ...
    fnscale.MeshError: axes entry 'data:2' in 'data:2' is not NAME=SIZE: write e.g. ...
  """


class RuntimeFailure(FnscaleError, RuntimeError):
  """The environment failed while the input was right (not a `ValueError`): a lost peer, a
  failed request or storage operation. Retrying (or restarting the job) may succeed.

  Examples:
    >>> import fnscale as fs
    >>> [issubclass(e, fs.RuntimeFailure) for e in (fs.DistributedError, fs.CloudError,
    ...                                             fs.StorageError, fs.MeshError)]
    [True, True, True, False]
    >>> issubclass(fs.RuntimeFailure, ValueError)  # `except ValueError` doesn't catch these
    False
  """


class TopologyError(InputError):
  """The hardware description is malformed or disagrees with the devices present.

  Examples:
    >>> import fnscale as fs
    >>> fs.detect_topology("v9-8")
    Traceback (most recent call last):
    ...
    fnscale.TopologyError: unknown accelerator type 'v9-8': expected one of v2-N, ...
  """


class MeshError(InputError):
  """Mesh axes don't fit the devices or each other, or a `mesh=` that is not a Mesh.

  Examples:
    >>> import fnscale as fs
    >>> fs.make_mesh({"data": -1, "fsdp": -1})
    Traceback (most recent call last):
    ...
    fnscale.MeshError: ICI axes {'data': -1, 'fsdp': -1} has more than one -1; ...
  """


class ShardingError(InputError):
  """Logical rules, PartitionSpecs or array shapes don't fit the mesh.

  Examples:
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"data": 8})
    >>> fs.logical_to_spec(("embed",), [("embed", "data")], mesh, shape=(3,))
    Traceback (most recent call last):
    ...
    fnscale.ShardingError: array: dimension 0 has size 3, not divisible by mesh axes ...
  """


class StepError(InputError):
  """A train step, its state or its batch is malformed.

  Examples:
    >>> import fnscale as fs, optax
    >>> fs.train_step("loss", optax.sgd(0.1))
    Traceback (most recent call last):
    ...
    fnscale.StepError: loss_fn is a str ('loss'), expected a callable loss_fn(params, ...
  """


class KernelError(InputError):
  """A forced kernel implementation can't serve the call, or a kernel name fnscale doesn't
  know.

  Examples:
    >>> import fnscale as fs
    >>> fs.with_kernel(lambda q, k, v: q, attention="flash")
    Traceback (most recent call last):
    ...
    fnscale.KernelError: with_kernel(attention='flash'): expected one of ('auto', 'xla', ...
  """


class ExpertError(InputError):
  """A mixture-of-experts layer's arguments can't work: params that don't fit the tokens,
  k outside [1, experts], a capacity factor <= 0.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> params = {"router": jnp.ones((4, 2)), "w_gate": jnp.ones((2, 4, 8)),
    ...           "w_up": jnp.ones((2, 4, 8)), "w_down": jnp.ones((2, 8, 4))}
    >>> fs.parallel.moe(jnp.ones((1, 2, 4)), params, k=3)
    Traceback (most recent call last):
    ...
    fnscale.ExpertError: moe: k=3 experts per token with 2 experts; expected an int in ...
  """


class LoraError(InputError):
  """LoRA's arguments can't work: a target pattern that matches no leaf, a leaf its layout
  doesn't fit (not a matmul weight), adapters that don't match the base or the config.

  Examples:
    >>> import fnscale as fs, jax.numpy as jnp
    >>> fs.lora.targets({"wq": jnp.zeros((8, 4))}, fs.lora.LoraConfig(targets=("wk",)))
    Traceback (most recent call last):
    ...
    fnscale.LoraError: LoRA target 'wk' matches no leaf of the params (paths: wq); fix: ...
  """


class CheckpointError(InputError):
  """A checkpoint is missing, corrupt or doesn't fit the target state, or a bad argument.

  Examples:
    >>> import fnscale as fs
    >>> fs.checkpoint.hf.read_config("/no/such/model")
    Traceback (most recent call last):
    ...
    fnscale.CheckpointError: /no/such/model has no config.json; fix: pass a Hugging Face ...
  """


class PlanError(InputError):
  """The planner can't serve the request (nothing fits, a bad target or argument).

  Examples:
    >>> import fnscale as fs, jax, optax
    >>> batch = {"x": jax.ShapeDtypeStruct((8, 4), "float32")}
    >>> fs.analysis.plan(lambda key: {"w": jax.numpy.zeros(4)}, lambda p, b: 0.0,
    ...                  optax.sgd(0.1), batch, "v5p-8", fs.analysis.PlanOptions(headroom=2))
    Traceback (most recent call last):
    ...
    fnscale.PlanError: headroom=2, expected a fraction of the device's memory limit in (0, 1]
  """


class FitError(PlanError):
  """A step does not fit its devices' memory (`fnscale.analysis.compile_fitting`). Fields:
  `needed` (bytes per device), `limit` (the device's bytes, or None where XLA refused the
  program without one given), `options` (`fnscale.analysis.FitOption`s that would fit by the
  planner's estimate, best first).

  Examples:
    >>> import fnscale as fs
    >>> try:
    ...   fs.analysis.check_fit(20 * 2**30, 16 * 2**30)
    ... except fs.FitError as e:
    ...   print(e.needed / 2**30, e.limit / 2**30, e.options, isinstance(e, fs.PlanError))
    20.0 16.0 () True
  """

  def __init__(self, message: str, *, needed: float = 0.0, limit: float | None = None,
               options: tuple = ()):
    super().__init__(message)
    self.needed, self.limit, self.options = needed, limit, tuple(options)


class DistributedArgumentError(InputError):
  """A malformed argument to a multi-process call: a process id, process count or
  coordinator address (given or read from `JAX_*` variables, or the roll call's
  `FNSCALE_ROLLCALL_PORT`), a timeout or grace period, a config, a barrier name, a step that
  isn't compiled or isn't an int, or `preemption_guard` entered outside the main thread. Not
  a `DistributedError`: nothing was tried yet.

  Examples:
    >>> import fnscale as fs
    >>> fs.barrier("checkpoint saved", timeout_s=-1)
    Traceback (most recent call last):
    ...
    fnscale.DistributedArgumentError: barrier timeout_s=-1, expected a positive number.
  """


class DistributedError(RuntimeFailure):
  """Multi-process initialisation or a cross-process wait failed (a peer lost or late). A
  job that gets one should exit with `fnscale.multihost.EXIT_JOB_FAILED` (75), which the
  launchers restart from the last checkpoint.

  Examples:
    >>> import fnscale as fs
    >>> issubclass(fs.DistributedError, fs.RuntimeFailure), fs.multihost.EXIT_JOB_FAILED
    (True, 75)
  """


class CloudError(RuntimeFailure):
  """A Cloud API request failed (HTTP error, network, credentials); `fnscale.cloud`'s
  functions raise it, naming the call and the status.

  Examples:
    >>> import fnscale as fs
    >>> issubclass(fs.CloudError, fs.RuntimeFailure), issubclass(fs.CloudError, ValueError)
    (True, False)
  """


class StorageError(RuntimeFailure):
  """Writing or reading files (e.g. a checkpoint) failed in the storage layer: a full disk,
  a lost connection to a bucket. What was already committed is still there.

  Examples:
    >>> import fnscale as fs
    >>> issubclass(fs.StorageError, fs.RuntimeFailure), issubclass(fs.StorageError, OSError)
    (True, False)
  """


# Tracebacks and reprs name each error by its one public spelling: `fnscale.MeshError`.
for _error in [v for v in dict(globals()).values()
               if isinstance(v, type) and issubclass(v, FnscaleError)]:
  _error.__module__ = "fnscale"
