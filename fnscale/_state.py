"""The training state born in its shardings: `init_state`, `state_shardings` and the optimizer
state's shardings.

`init_state` traces the params (or takes them), derives their shardings
(`fnscale.shardings`), and builds params and optimizer state directly in those shardings
(`jax.eval_shape` -> shardings -> `jax.jit(..., out_shardings=...)`, as in nanodo), so a
model bigger than one device never lives on one device.
"""
from __future__ import annotations

from collections.abc import Mapping
import functools

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import optax

from fnscale import _flax
from fnscale import _offload
from fnscale import _tree
from fnscale import _sharding as _sh
from fnscale._errors import MeshError, ShardingError, StepError
from fnscale._mesh import _runs_here, check_mesh
from fnscale._step import TrainState, as_policy, check_optimizer, default_loss_scale

__all__ = ["init_state", "opt_state_shardings", "state_shardings"]


def _replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _auto_or_replicated(mesh, leaf, fsdp_axis, min_shard_bytes) -> NamedSharding:
  shape, dtype = _tree.aval(leaf)
  axes = (fsdp_axis,) if isinstance(fsdp_axis, str) else tuple(fsdp_axis or ())
  spec, _ = _sh.auto_spec(shape, dtype, dict(mesh.shape), axes, min_shard_bytes)
  return NamedSharding(mesh, spec)


def opt_state_shardings(optimizer, opt_state, param_shardings, mesh, *, fsdp_axis="fsdp",
                        min_shard_bytes: int = _sh.DEFAULT_MIN_SHARD_BYTES):
  """Shardings for an optax optimizer state that follow the params' shardings.

  Every copy of the params tree inside the state (Adam's mu and nu, momentum traces, ...)
  gets `param_shardings`; other leaves (step counts, scalars) are replicated; other
  non-scalar leaves (e.g. factored statistics) get the automatic FSDP policy (`fsdp_axis`,
  `min_shard_bytes`, as in `shardings`). Param copies are found with optax's
  `tree_utils.tree_map_params` when `optimizer` is given; without one, or if the optimizer's
  init can't run on its placeholder, any subtree with the params' structure counts as a copy.

  Args:
    optimizer: an `optax.GradientTransformation`, or None (match by structure).
    opt_state: the optimizer state, concrete or abstract (`jax.eval_shape(opt.init, params)`).
    param_shardings: pytree of NamedSharding with the params' structure.
    mesh: the mesh.

  Returns:
    A pytree of NamedSharding with `opt_state`'s structure.

  Raises:
    ShardingError: the state's param-shaped subtrees don't match `param_shardings`.
    MeshError: a mesh that isn't one.
  """
  check_mesh(mesh, "opt_state_shardings")
  if optimizer is not None:
    check_optimizer(optimizer)

  def non_param(leaf):
    return _auto_or_replicated(mesh, leaf, fsdp_axis, min_shard_bytes)

  out = None
  if optimizer is not None:
    try:
      out = optax.tree_utils.tree_map_params(
          optimizer, lambda _, s: s, opt_state, param_shardings,
          transform_non_params=non_param,
          is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    except Exception as e:  # pylint: disable=broad-except  # init failed on a placeholder
      logging.info("tree_map_params failed (%s); matching params by structure", e)
  if out is None:
    out = _structural_opt_shardings(opt_state, param_shardings, non_param)

  # A params-structured subtree of another shape (Adafactor's factored rows and columns)
  # can't take the params' specs: it gets the automatic policy instead.
  def fit(leaf, s):
    if isinstance(leaf, optax.MaskedNode):
      return s
    shape, _ = _tree.aval(leaf)
    try:
      _sh.check_spec("", s.spec, shape, dict(mesh.shape))
      return s
    except ShardingError:
      return non_param(leaf)
  return jax.tree.map(fit, opt_state, out, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _structural_opt_shardings(opt_state, param_shardings, non_param):
  """Any subtree with the params' structure gets the param shardings."""
  ptree = jax.tree_util.tree_structure(param_shardings)

  def is_params(x):
    try:
      return jax.tree_util.tree_structure(x) == ptree and ptree.num_leaves > 0
    except Exception:  # pylint: disable=broad-except
      return False

  out = jax.tree_util.tree_map(lambda x: param_shardings if is_params(x) else non_param(x),
                               opt_state, is_leaf=is_params)
  if jax.tree_util.tree_structure(
      out, is_leaf=lambda s: isinstance(s, NamedSharding)) != jax.tree_util.tree_structure(
          opt_state):
    raise ShardingError(
        "could not match the optimizer state to the params' shardings; fix: pass an "
        "optax optimizer whose state holds copies of the params tree, or give shardings for "
        "the state directly.")
  return out


def state_shardings(state, mesh, rules=(), *, logical_axes=None, optimizer=None,
                    sharding_options: Mapping | None = None,
                    param_shardings=None, offload_optimizer: bool = False) -> TrainState:
  """Shardings for a `TrainState` (concrete or abstract): params by `fnscale.shardings`
  (logical rules, else automatic FSDP), optimizer state following the params
  (`opt_state_shardings`; by structure when `optimizer` is None), step and loss scale
  replicated, frozen params (`TrainState.frozen`) where they are placed on `mesh`, else by
  automatic FSDP, the model state (`TrainState.model_state`) replicated.

  Args:
    state: a TrainState of arrays or ShapeDtypeStructs.
    mesh: the mesh.
    rules, logical_axes: as in `fnscale.shardings`.
    optimizer: the optax optimizer (lets optax find the param-shaped parts of its state).
    sharding_options: extra keyword arguments for `fnscale.shardings` (`fsdp_axis`,
      `min_shard_bytes`, `max_replicated_bytes`).
    param_shardings: the params' shardings when already known (a pytree of NamedSharding
      matching `state.params`, e.g. the ones a born-sharded state carries): used instead of
      the rules, and the optimizer state follows them.
    offload_optimizer: the optimizer state's shardings in pinned host memory, as
      `init_state(..., offload_optimizer=True)` places it.

  Returns:
    A TrainState whose leaves are NamedShardings.

  Raises:
    StepError: state is not a TrainState, bad sharding_options.
    MeshError: a mesh that isn't one.
    ShardingError: from `fnscale.shardings`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 8})
    >>> abstract = fs.init_state({"w": jnp.zeros((1024, 64))}, optax.adamw(1e-3), mesh=mesh,
    ...                          abstract=True)  # ShapeDtypeStructs: nothing allocated
    >>> abstract.params["w"].shape
    (1024, 64)
    >>> shardings = fs.state_shardings(abstract, mesh)
    >>> shardings.params["w"].spec, shardings.opt_state[0].nu["w"].spec, shardings.step.spec
    (P('fsdp', None), P('fsdp', None), P())
  """
  opts = _checked(state, mesh, sharding_options)
  psh = (_sh.shardings(state.params, mesh, rules, logical_axes=logical_axes, **opts)
         if param_shardings is None else param_shardings)
  state = _flax.strip(state)  # the shardings of the plain state, as init_state builds it
  osh = _placed(opt_state_shardings(optimizer, state.opt_state, psh, mesh,
                                    **_opt_options(opts)), offload_optimizer)
  rep = _replicated(mesh)
  return TrainState(psh, osh, rep, jax.tree.map(lambda _: rep, state.loss_scale),
                    frozen_shardings(state.frozen, mesh, opts),
                    jax.tree.map(lambda _: rep, state.model_state))


def _placed(opt_shardings, offload: bool):
  """The optimizer state's shardings, in pinned host memory with `offload`."""
  if not isinstance(offload, bool):
    raise StepError(f"offload_optimizer is {_tree.got(offload)}, expected a bool.")
  return jax.tree.map(_offload.on_host, opt_shardings) if offload else opt_shardings


def derived_param_shardings(state, mesh, rules=(), logical_axes=None,
                            sharding_options: Mapping | None = None):
  """The params' shardings of a TrainState as `state_shardings` derives them (from `rules`
  and `logical_axes`, else automatic FSDP), whatever the params carry: a caller that keeps
  what they carry passes the merged tree back as `state_shardings(param_shardings=...)`."""
  opts = _checked(state, mesh, sharding_options)
  return _sh.shardings(state.params, mesh, rules, logical_axes=logical_axes, **opts)


def _checked(state, mesh, sharding_options) -> dict:
  """`sharding_options` as keyword arguments of `fnscale.shardings`, once `state` is a
  TrainState and `mesh` a mesh."""
  if not isinstance(state, TrainState):
    raise StepError(f"state is {_tree.got(state)}, expected fnscale.TrainState; fix: build "
                    "it with fnscale.init_state.")
  check_mesh(mesh, "state_shardings")
  return _options(sharding_options)


def frozen_shardings(frozen, mesh, opts: dict | None = None):
  """The frozen params' shardings: each leaf's own NamedSharding on `mesh` (a base placed
  when it was loaded), else automatic FSDP; None without frozen params."""
  if frozen is None:
    return None
  derived = _sh.shardings(frozen, mesh, **(opts or {}))
  return jax.tree.map(lambda leaf, d: leaf.sharding if isinstance(
      getattr(leaf, "sharding", None), NamedSharding) and leaf.sharding.mesh == mesh else d,
                      frozen, derived)


_OPTION_NAMES = ("fsdp_axis", "min_shard_bytes", "max_replicated_bytes")


def _options(sharding_options) -> dict:
  if sharding_options is None:
    return {}
  if not isinstance(sharding_options, Mapping) or any(
      k not in _OPTION_NAMES for k in sharding_options):
    raise StepError(f"sharding_options is {_tree.got(sharding_options)}, expected a dict "
                    f"with keys among {_OPTION_NAMES}.")
  return dict(sharding_options)


def _opt_options(opts: dict) -> dict:
  return {k: v for k, v in opts.items() if k in ("fsdp_axis", "min_shard_bytes")}


def _is_init_fn(x) -> bool:
  """Whether `init_state` was given an init function (else params). A callable that is a
  pytree with array leaves is a model object holding its params (an Equinox module, from
  `eqx.partition(model, eqx.is_inexact_array)[0]`, or a flax struct with `__call__`): params.
  A callable that flattens to itself (a function, `functools.partial`, a jitted function) or
  a bound method is an init function. A callable pytree without array leaves is neither."""
  if not callable(x):
    return False
  leaves, treedef = jax.tree_util.tree_flatten(x)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1 or isinstance(
      x, functools.partial) or hasattr(x, "__func__"):
    return True
  if any(hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves):
    return False
  raise StepError(
      f"init_fn_or_params is a callable {type(x).__name__} pytree with no array leaves: "
      "neither params (nothing to train) nor a plain init function; fix: pass the params' "
      "arrays (an Equinox model: `eqx.partition(model, eqx.is_inexact_array)[0]`), or wrap "
      "an init function in a plain one: `lambda key: init(key)`.")


def _non_array(tree, numbers: bool = False):
  """(path, leaf) of `tree`'s first leaf that is not an array (nor, with `numbers`, a Python
  number), or None."""
  kinds = (bool, int, float, complex) if numbers else ()
  return next(((path, leaf) for path, leaf in _tree.leaves_with_paths(tree)
               if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
               and not isinstance(leaf, kinds)), None)


def _arrays_out(params):
  """`params` (what an init function returned, traced) if every leaf is an array or a
  number; else a StepError naming the first other leaf (an Equinox model's activation
  function: jax would refuse the output naming its type only)."""
  bad = _non_array(params, numbers=True)
  if bad:
    raise StepError(
        f"init_fn returned a {type(bad[1]).__name__} at params leaf '{bad[0]}', expected "
        "arrays; fix: return the params' arrays (an Equinox model: `eqx.partition(model, "
        "eqx.is_inexact_array)[0]` of it, with the static part combined in the loss).")
  return params


def _check_arrays(tree, what: str) -> None:
  """StepError naming the first leaf of `tree` (`what`: params, model_state) that is not an
  array."""
  bad = _non_array(tree)
  if bad:
    raise StepError(
        f"{what} leaf '{bad[0]}' is a {type(bad[1]).__name__}, expected an array; fix: "
        "pass arrays (jnp/np)" + (" or an init function" if what == "params" else "") + (
            " (an Equinox model: its arrays, `params, static = eqx.partition(model, "
            "eqx.is_inexact_array)`, and `eqx.combine(params, static)` in the loss)"
            if callable(tree) else "") + ".")


def _check_model_state(model_state) -> None:
  """StepError naming a model_state leaf that is not an array, or a typed PRNG key (the step
  carries its leaves exactly, but not an extended dtype)."""
  _check_arrays(model_state, "model_state")
  for path, leaf in _tree.leaves_with_paths(model_state):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise StepError(
          f"model_state leaf '{path}' is a typed PRNG key ({leaf.dtype}), which the step "
          "can't carry there; fix: its bits, jax.random.key_data(key) (uint32, kept exact), "
          "and jax.random.wrap_key_data in the loss; or train_step(..., key=...).")


def _check_static(params) -> None:
  """A jax array in a pytree node's metadata (a static field) would fail every jit over the
  params with a message naming no field: name it here."""
  where = _tree.static_arrays(params)
  if where:
    raise StepError(
        f"params field {where[0]} is a static field holding a jax array: jax compares static "
        "fields between pytrees, which an array can't do, so the params can't be compiled; "
        "fix: make it a normal field (a leaf: `eqx.partition(model, eqx.is_inexact_array)` "
        "puts a float array in the params, others in the static part), or keep a numpy "
        "array or a tuple in the static field.")


def _params(init_fn_or_params, key, cast, mesh, rules, logical_axes, opts, abstract):
  """(params, their shardings): traced and built sharded, or copied into their shardings."""
  if _is_init_fn(init_fn_or_params):
    keys = () if key is None else (key,)
    make = lambda *a: cast(_arrays_out(init_fn_or_params(*a)))

    def build(unit_mesh):
      args = tuple(_flax.on_mesh(a, unit_mesh) for a in keys)
      shapes = jax.eval_shape(make, *args)
      _check_static(shapes)
      _flax.check_only_params(shapes, StepError)
      # Flax metadata is the layout (`shardings` reads it); Linen boxes stay out of the state.
      psh = _sh.shardings(shapes, mesh, rules, logical_axes=logical_axes, **opts)
      shapes = _unboxed(shapes)
      if abstract:
        return _sds(shapes, psh), psh
      return jax.jit(lambda *a: _flax.strip(make(*a)), out_shardings=psh)(*args), psh
    try:
      # Under an ambient mesh without a Linen box's axis: traced again with it, of size 1.
      return _flax.with_box_axes(build, "init_state")
    except ValueError as e:
      boxed = _flax.constraint_failure(e, init=True)
      if boxed is None:
        raise
      raise StepError(boxed) from None
  _check_arrays(init_fn_or_params, "params")
  _check_static(init_fn_or_params)
  _flax.check_only_params(init_fn_or_params, StepError)
  params = jax.eval_shape(cast, init_fn_or_params) if abstract else cast(init_fn_or_params)
  psh = _sh.shardings(params, mesh, rules, logical_axes=logical_axes, **opts)
  params = _unboxed(params)
  if abstract:
    return _sds(params, psh), psh
  return _copy(params, psh), psh


def _unboxed(params):
  """`params` without Linen boxes, said once: under a mesh `model.apply` would turn each box
  into a sharding constraint (and fail on a mesh without its axes)."""
  if not _flax.has_linen_boxes(params):
    return params
  logging.info("init_state: the params' Flax Linen boxes (nn.with_partitioning, "
               "nn.with_logical_partitioning) are taken off: the state holds their plain "
               "arrays, laid out as their names say, and model.apply({'params': params}) "
               "takes them as they are (no sharding constraint of its own)")
  return _flax.strip(params)


def _copy(tree, shardings_tree):
  """Fresh buffers in the given shardings: never an alias of the caller's arrays, so a step
  that donates the state can't delete them (`device_put` keeps a leaf whose sharding already
  matches, whatever `may_alias` says)."""
  return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings_tree)(tree)


def _sds(tree, shardings_tree):
  """ShapeDtypeStructs of `tree` with `shardings_tree` (one sharding or a matching tree)."""
  return _tree.abstract(tree, _tree.leaf_shardings(tree, shardings_tree, "state", StepError))


def init_state(init_fn_or_params, optimizer, *, mesh, rules=(), logical_axes=None,
               policy=None, key=None, loss_scale=None,
               sharding_options: Mapping | None = None,
               abstract: bool = False, offload_optimizer: bool = False,
               model_state=None) -> TrainState:
  """Builds a `TrainState` born in its shardings (no device ever holds the whole model).

  A function is traced with `jax.eval_shape`, its output's shardings derived
  (`state_shardings`), and it runs under `jax.jit(..., out_shardings=...)`; the optimizer
  state is initialised the same way. Concrete params are copied into their shardings by a
  jitted copy (fresh buffers: a step that donates the state never deletes the caller's
  arrays).

  Args:
    init_fn_or_params: `init_fn(key) -> params` (or `init_fn()` when `key` is None), or a
      pytree of arrays. A callable pytree with array leaves is params (an Equinox model's
      `eqx.partition(model, eqx.is_inexact_array)[0]`, a flax struct with `__call__`); a
      function, partial, jitted function or bound method is an init function. A Flax
      model's own sharding metadata is read as the layout where `logical_axes` names none
      (`lambda k: model.init(k, x)["params"]` with Linen boxes, an NNX State with Variable
      metadata: `fnscale.adapters`); the state holds plain arrays (Linen boxes taken off,
      NNX Variables kept). Under an ambient mesh lacking an axis a Linen box names, the
      function is traced with that axis of size 1 added (Flax makes a sharding constraint
      of a box a layer unboxes itself, e.g. DenseGeneral's kernel).
    optimizer: an `optax.GradientTransformation`.
    mesh: the `jax.sharding.Mesh`.
    rules, logical_axes, sharding_options: as in `state_shardings`.
    policy: a jmp policy (or string): params are cast to its param dtype; float16 compute
      adds a dynamic `LossScale` (jmp's dynamic scaling from 2**15) to the state.
    key: a PRNG key for `init_fn`.
    loss_scale: a jmp loss scale (or `LossScale`) for the state, overriding the policy's
      default; `jmp.NoOpLossScale()` means no scaling (a fixed scale of 1).
      A float16 `train_step` needs the state to have one (a `StepError` says so).
    abstract: return `jax.ShapeDtypeStruct`s with their shardings instead of arrays;
      nothing is allocated or run (for `shard_step(...).compile`, `compile_report` on a mesh
      of devices that aren't here, or checkpoint restore targets).
    offload_optimizer: keep the optimizer state in pinned host memory
      (`memory_kind="pinned_host"`) between steps: `train_step` brings each param's share
      of it to the device for the update and sends the new one back, so the device holds
      params, gradients and one param's optimizer state at a time (AdamW's float32 moments,
      8 bytes a param, leave the device's memory). `shard_step` compiles the step with the
      state where it lies. The numbers are those of the state on the device.
    model_state: what the model's forward pass updates rather than trains, a pytree of
      arrays (a BatchNorm's running statistics: Linen's `variables["batch_stats"]`, NNX's
      `nnx.split(model, nnx.Param, nnx.BatchStat, ...)[2]`, an `eqx.nn.State`), copied
      replicated on `mesh`; `train_step` passes it to the loss (`TrainState.model_state`).

  Returns:
    TrainState(params, opt_state, step=int32 0, loss_scale, model_state=...), every leaf a
    jax.Array sharded as `state_shardings(...)` says (or its ShapeDtypeStruct with
    `abstract=True`).

  Raises:
    MeshError: a mesh that isn't one, or (without `abstract=True`) one over described
      devices that can't hold arrays (`fnscale.target_devices`).
    StepError: a bad optimizer, policy, loss_scale or option (offload_optimizer not a
      bool), a seed given as `key`, params (given, or an init function's) that are not
      arrays, a callable pytree with no array leaves (neither params nor a plain init
      function), params keeping a jax array in a static field, or NNX Variables other
      than Params (a whole module's BatchStats: the optimizer would train them), or a
      model_state leaf that is not an array, naming the leaf.
    ShardingError: from the shardings (rules, logical axes, indivisible dimensions).

  Examples:
    Each device holds 1/8 of the weight and of adamw's moments, from the start:

    >>> import jax, jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> mesh = fs.make_mesh({"fsdp": 8})
    >>> def init(key):
    ...   return {"w": jax.random.normal(key, (1024, 64)), "b": jnp.zeros(64)}
    >>> state = fs.init_state(init, optax.adamw(1e-3), mesh=mesh, key=jax.random.key(0))
    >>> state.params["w"].sharding.spec, state.params["b"].sharding.spec
    (P('fsdp', None), P())
    >>> state.params["w"].addressable_shards[0].data.shape
    (128, 64)
    >>> state.opt_state[0].mu["w"].sharding.spec
    P('fsdp', None)

    The optimizer state in the host's memory, the params on the device:

    >>> host = fs.init_state(init, optax.adamw(1e-3), mesh=mesh, key=jax.random.key(0),
    ...                      offload_optimizer=True)
    >>> host.opt_state[0].mu["w"].sharding.memory_kind, host.params["w"].sharding.memory_kind
    ('pinned_host', 'device')
  """
  check_optimizer(optimizer)
  policy = as_policy(policy)
  check_mesh(mesh, "init_state")
  if not isinstance(abstract, bool):
    raise StepError(f"abstract is {_tree.got(abstract)}, expected a bool.")
  if isinstance(key, (bool, int, float)):  # a seed where the key goes
    raise StepError(f"key is {_tree.got(key)}, expected a PRNG key for init_fn; fix: "
                    f"key=jax.random.key({key!r}) (or jax.random.PRNGKey({key!r})).")
  _check_model_state(model_state)
  if not abstract and not _runs_here(mesh):
    raise MeshError(
        f"init_state: the mesh's devices ({mesh.devices.flat[0].device_kind}, "
        f"{mesh.devices.size} of them) are described ones (an ahead-of-time target), which "
        "can compile a program but hold no arrays; fix: init_state(..., abstract=True) for "
        "a state to compile against (shard_step(...).compile, compile_report), or a mesh "
        "over this machine's devices (jax.devices()) to train.")
  # Abstract: traced only, never run. Under `with_mesh` of devices that aren't here (a TPU
  # target described by libtpu) jax can't run even a constant.
  make_scale = lambda: default_loss_scale(policy, loss_scale)
  loss_scale = jax.eval_shape(make_scale) if abstract else make_scale()
  cast = policy.cast_to_param if policy is not None else (lambda t: t)
  opts = _options(sharding_options)
  params, psh = _params(init_fn_or_params, key, cast, mesh, rules, logical_axes, opts,
                        abstract)
  abstract_opt = jax.eval_shape(optimizer.init, params)
  osh = _placed(opt_state_shardings(optimizer, abstract_opt, psh, mesh,
                                    **_opt_options(opts)), offload_optimizer)
  rep = _replicated(mesh)
  if abstract:
    return TrainState(params, _sds(abstract_opt, osh),
                      _sds(jax.ShapeDtypeStruct((), jnp.int32), rep), _sds(loss_scale, rep),
                      model_state=_sds(jax.eval_shape(lambda: model_state), rep))
  step = jnp.zeros((), jnp.int32)
  # Copied: an optimizer state that holds the params themselves (a slow-weights copy)
  # must not share their buffers, or donating the state would donate one buffer twice.
  opt_state = jax.jit(lambda p: jax.tree.map(jnp.copy, optimizer.init(p)),
                      out_shardings=osh)(params)
  return TrainState(params, opt_state, jax.device_put(step, rep),
                    None if loss_scale is None else _copy(loss_scale, rep),
                    model_state=_copy(model_state, jax.tree.map(lambda _: rep, model_state)))
