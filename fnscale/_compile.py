"""`shard_step`: a step compiled once, ahead of time, as one SPMD program over a mesh.

`jax.jit` with in/out shardings and a donated state (GSPMD, Xu et al., 2021), or the step
per shard under `jax.shard_map` over the data axes. What it returns is a declared value: a
`ShardedStep` (compiles on first call per input shapes, like `jax.jit`) whose `compile`
gives a `CompiledStep` holding its one executable, mesh and shardings.

`ShardedStep.compile` reads top to bottom: the layout (`_layout`: the state's shardings,
derived once, `_carried_shardings`; the batch's), the trace and lowering in it (`_traced`,
`_lower`), XLA's compile (`fnscale._compiler`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import hashlib
import linecache
import sysconfig
from typing import Any, NamedTuple

from absl import logging
import jax
from jax.sharding import NamedSharding, PartitionSpec

from fnscale import _axes
from fnscale import _closure
from fnscale import _compiler
from fnscale import _flax
from fnscale import _tree
from fnscale import _sharding as _sh
from fnscale import _state
from fnscale import _loss
from fnscale import _model_state
from fnscale._errors import FnscaleError, ShardingError, StepError
from fnscale._mesh import check_mesh

__all__ = ["CompiledStep", "ShardedStep", "shard_step"]

_MODES = ("auto", "shard_map")


class _Signature(NamedTuple):
  """What a compiled step was built for: structures, per-leaf (name, shape, dtype, sharding)."""
  state_def: Any
  batch_def: Any
  state_leaves: tuple
  batch_leaves: tuple


class _Layout(NamedTuple):
  """Where a compile puts the leaves, derived once per compile: the plain state (no Linen
  boxes), its shardings (a tree and one per leaf), the batch's."""
  state: Any
  state_shardings: Any
  state_flat: list
  batch_shardings: Any
  batch_flat: list


def _signature(state, batch, state_sh, batch_sh) -> _Signature:
  def leaves(tree, shs, what):
    return tuple((f"{what} leaf '{path}'",) + _tree.aval(leaf) + (s,)
                 for (path, leaf), s in zip(_tree.leaves_with_paths(tree), shs))
  return _Signature(jax.tree_util.tree_structure(state), jax.tree_util.tree_structure(batch),
                    leaves(state, state_sh, "state"), leaves(batch, batch_sh, "batch"))


def _same_sharding(actual, expected, ndim: int) -> bool:
  if actual == expected:
    return True
  try:
    return actual.is_equivalent_to(expected, ndim)
  except Exception:  # pylint: disable=broad-except
    return False


def _conform(tree, treedef, expected, what: str):
  """Checks `tree` against a compiled signature; reshards leaves placed differently."""
  # Fast path, taken every step: the previous step's outputs fit exactly. Paths and
  # messages are only built when something doesn't.
  leaves, got_def = jax.tree_util.tree_flatten(tree)
  if got_def == treedef and all(
      isinstance(leaf, jax.Array) and leaf.shape == shape and leaf.dtype == dtype
      and (leaf.sharding is s or leaf.sharding == s) and not leaf.is_deleted()
      for leaf, (_, shape, dtype, s) in zip(leaves, expected)):
    return tree
  if what == "state":  # a state holding Linen boxes runs on their plain arrays
    tree = _flax.strip(tree)
    leaves, got_def = jax.tree_util.tree_flatten(tree)
  pairs = _tree.leaves_with_paths(tree)
  for path, leaf in pairs:
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      # Calling a donated buffer crashes the runtime; say what happened instead.
      raise StepError(
          f"{what} leaf '{path}' was donated to an earlier call of this step (its buffer "
          f"is gone); fix: use the state the step returns, `state, metrics = step(state, "
          f"batch)`, or build the step with donate=False.")
  if got_def != treedef:
    raise StepError(
        f"the {what} has structure {got_def} but the step was compiled for {treedef}; fix: "
        f"pass a {what} with the same pytree structure (or compile again for the new one).")
  out, moved = [], []
  for (_, leaf), (name, shape, dtype, s) in zip(pairs, expected):
    gshape, gdtype = _tree.aval(leaf)
    if gshape != shape or gdtype != dtype:
      raise StepError(
          f"{name}: got {gdtype}{list(gshape)}, the step was compiled for {dtype}{list(shape)}; "
          f"fix: pass a {what} of the compiled shapes and dtypes or compile the step again "
          "for the new ones.")
    if isinstance(leaf, jax.Array) and _same_sharding(leaf.sharding, s, len(shape)):
      out.append(leaf)
    else:
      out.append(jax.device_put(leaf, s))
      moved.append(name)
  if moved:
    log = logging.warning if what == "state" else logging.info
    log("resharded %d %s leaves to the compiled shardings (e.g. %s)", len(moved), what,
        moved[0])
  return jax.tree_util.tree_unflatten(treedef, out)


def _own_sharding(leaf, derived, mesh):
  """A leaf's own NamedSharding on `mesh` (a born-sharded state's), else the derived one."""
  s = getattr(leaf, "sharding", None)
  return s if isinstance(s, NamedSharding) and s.mesh == mesh else derived


def _disagreement(state, carried: list, derived, what: str):
  """Refuses a carried sharding that the passed `what` would change (never a silent reshard
  of the whole state)."""
  for (path, leaf), own, want in zip(_tree.leaves_with_paths(state), carried,
                                     jax.tree.leaves(derived)):
    if own is not None and not _same_sharding(own, want, len(_tree.aval(leaf)[0])):
      raise ShardingError(
          f"state leaf '{path}' carries PartitionSpec {tuple(own.spec)} on the mesh, but the "
          f"{what} passed to shard_step give {tuple(want.spec)}; fix: leave them out (the "
          "step uses the shardings the state carries), pass the ones the state was built "
          "with (init_state's), or pass state_shardings= to reshard on purpose.")


def _carried_shardings(state, mesh, rules, logical_axes, optimizer, sharding_options):
  """The state's shardings, derived once: each leaf's own NamedSharding on `mesh` (a state
  born sharded by `init_state`, arrays or ShapeDtypeStructs), else derived as
  `fnscale.state_shardings` derives them; the optimizer state follows the params' carried
  shardings."""
  # The params' names (a Linen box's too) give their derived shardings.
  derived_params = _state.derived_param_shardings(state, mesh, rules, logical_axes,
                                                  sharding_options)
  state = _flax.strip(state)
  carried = [_own_sharding(leaf, None, mesh) for leaf in jax.tree.leaves(state)]
  n_params = len(jax.tree.leaves(state.params))
  # Rules alone place no leaf without logical axes (a state built from a Flax model's
  # metadata carries its names only in its shardings): nothing to compare then.
  if logical_axes is not None or sharding_options:
    _disagreement(state.params, carried[:n_params], derived_params,
                  "rules / logical_axes / sharding_options")
  psh = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(state.params),
      [d if c is None else c for c, d in zip(carried, jax.tree.leaves(derived_params))])
  derived = _state.state_shardings(state, mesh, optimizer=optimizer,
                                   sharding_options=sharding_options, param_shardings=psh)
  if optimizer is not None:
    _disagreement(state.opt_state, carried[n_params:], derived.opt_state, "optimizer")
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(derived),
      [d if c is None else c for c, d in zip(carried, jax.tree.leaves(derived))])


def _buffer(leaf) -> tuple:
  """Identifies a jax.Array's device buffer (two Array objects may share one)."""
  try:
    shard = leaf.addressable_shards[0]
    return (shard.device.id, shard.data.unsafe_buffer_pointer())
  except Exception:  # pylint: disable=broad-except  # no addressable shard, or deleted
    return ("object", id(leaf))


def _check_donation(state, batch) -> None:
  """Refuses a donated state whose buffers are shared: by two state leaves (XLA can't donate
  one buffer twice) or with a batch leaf (it would be deleted under the caller)."""
  owner: dict[tuple, str] = {}
  for path, leaf in _tree.leaves_with_paths(state):
    if not isinstance(leaf, jax.Array):
      continue
    key = _buffer(leaf)
    if key in owner:
      raise StepError(
          f"state leaves '{owner[key]}' and '{path}' share one device buffer, and the step "
          "donates the state (XLA can't donate a buffer twice; after the step both would be "
          f"gone); fix: give '{path}' its own copy (jnp.copy) or tie the weights inside the "
          "loss, or build the step with donate=False.")
    owner[key] = path
  for path, leaf in _tree.leaves_with_paths(batch):
    if isinstance(leaf, jax.Array) and _buffer(leaf) in owner:
      raise StepError(
          f"batch leaf '{path}' is the buffer of state leaf '{owner[_buffer(leaf)]}', which "
          "the step donates (deleting it while the batch still reads it); fix: pass a copy "
          "in the batch (jnp.copy), close over a separate array in the loss, or build the "
          "step with donate=False.")


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A step compiled for one set of input shapes, dtypes and shardings.

  Call it as `step(state, batch) -> (state, metrics)`: it only ever runs its one executable.
  Fields: `compiled` (`jax.stages.Compiled`), `lowered` (`jax.stages.Lowered`),
  `compile_seconds` (wall time of `Lowered.compile`), `mesh`, `mode`, `state_shardings`
  and `batch_shardings` (pytrees of NamedSharding), `xla_warnings` (XLA's partitioner
  warnings printed while compiling, e.g. "[SPMD] Involuntary full rematerialization"),
  `signature` (the leaves it was compiled for), `compiler_options` (the XLA options it was
  compiled with), `from_cache` (loaded from jax's persistent compilation cache: then
  `compile_seconds` is the load's), `reused` (the executable jax compiled for the same
  program earlier in this process: `compile_seconds` is the lookup's). In a multi-process job,
  `fnscale.multihost.agree_on_step(compiled)` checks that every process compiled the same
  step.
  """
  compiled: Any
  lowered: Any
  compile_seconds: float
  mesh: Any
  mode: str
  state_shardings: Any
  batch_shardings: Any
  xla_warnings: tuple[str, ...]
  signature: _Signature
  donate: bool = True
  compiler_options: Mapping | None = None
  from_cache: bool = False
  reused: bool = False
  # ids of the leaves of the state the last call returned: that state is made of fresh
  # buffers, so the donation check (a few microseconds a leaf) is skipped for it.
  _returned: list = dataclasses.field(default_factory=lambda: [None], init=False,
                                      compare=False, repr=False)

  def __call__(self, state, batch):
    sig = self.signature
    state = _conform(state, sig.state_def, sig.state_leaves, "state")
    batch = _conform(batch, sig.batch_def, sig.batch_leaves, "batch")
    if not self.donate:
      return self.compiled(state, batch)
    if tuple(map(id, jax.tree.leaves(state))) != self._returned[0]:
      _check_donation(state, batch)
    new_state, metrics = self.compiled(state, batch)
    self._returned[0] = tuple(map(id, jax.tree.leaves(new_state)))
    return new_state, metrics


@dataclasses.dataclass(frozen=True)
class ShardedStep:
  """`shard_step`'s result: `step(state, batch) -> (state, metrics)` over `mesh`.

  The first call for a set of input shapes and dtypes compiles (as `jax.jit` would); later
  calls reuse the executable. `lower(state, batch)` -> `jax.stages.Lowered`;
  `compile(state, batch)` -> a `CompiledStep`; `shardings(state, batch)` -> (state
  shardings, batch shardings). Fields: the `shard_step` arguments.
  """
  step: Callable
  mesh: Any
  rules: Any = ()
  logical_axes: Any = None
  state_shardings: Any = None
  batch_sharding: Any = None
  donate: bool = True
  mode: str = "auto"
  optimizer: Any = None
  sharding_options: Mapping | None = None
  compiler_options: Mapping | None = None
  _executables: dict = dataclasses.field(default_factory=dict, init=False, compare=False,
                                         repr=False)

  def __call__(self, state, batch):
    key = _inputs_key(state, batch)
    fn = self._executables.get(key)
    if fn is None:
      # A state with Linen boxes runs the executable of its plain arrays (what it returns).
      plain_key = _inputs_key(_flax.strip(state), batch)
      fn = self._executables.get(plain_key)
      if fn is None:
        if self._executables:
          logging.warning(
              "shard_step: compiling again for new input shapes/dtypes (executable %d); "
              "call step.compile(state, batch) to pin one and get an error instead",
              len(self._executables) + 1)
        fn = self._executables[plain_key] = self.compile(state, batch)
      self._executables[key] = fn
    return fn(state, batch)

  def compile(self, state, batch) -> CompiledStep:
    """Compiles for `(state, batch)`. Only this process: nothing waits for the others (a
    report or a plan on process 0 alone is fine); a job checks that every process compiled
    the same step with `fnscale.multihost.agree_on_step(compiled)`."""
    layout = self._layout(state, batch)  # the state's shardings, derived once
    sig = _signature(layout.state, batch, layout.state_flat, layout.batch_flat)
    lowered = self._traced(layout, batch, sig)
    c = _compiler.compile_lowered(lowered, self.compiler_options)
    name = f"compiled step {hashlib.sha256(lowered.as_text().encode()).hexdigest()[:12]}"
    logging.info("shard_step: %s in %.2f s on mesh %s (mode %s)%s", name, c.seconds,
                 dict(self.mesh.shape), self.mode, " (compiled earlier in this process)"
                 if c.reused else "")
    return CompiledStep(c.compiled, lowered, c.seconds, self.mesh, self.mode,
                        layout.state_shardings, layout.batch_shardings, c.warnings, sig,
                        self.donate, self.compiler_options, c.from_cache, c.reused)

  def shardings(self, state, batch):
    """(state shardings, batch shardings) the step is compiled with, checked against the
    leaves (rank, divisibility)."""
    layout = self._layout(state, batch)
    return layout.state_shardings, layout.batch_shardings

  def lower(self, state, batch):
    """Lowers for `(state, batch)` (arrays or ShapeDtypeStructs)."""
    return self._lower(self._layout(state, batch), batch)

  def _layout(self, state, batch) -> _Layout:
    """Where the state and batch leaves go, checked: a state's Linen boxes give their names
    to its layout, and the step runs on their arrays."""
    ssh = self.state_shardings
    if ssh is None:
      ssh = _carried_shardings(state, self.mesh, self.rules, self.logical_axes,
                               self.optimizer, self.sharding_options)
    if _flax.has_linen_boxes(state):
      logging.info("shard_step: the state's params hold Flax Linen boxes; the step runs on "
                   "their plain arrays (laid out as their names say), so model.apply applies "
                   "no sharding constraint of its own, and returns a state without boxes")
      state = _flax.strip(state)
    state_flat = _tree.leaf_shardings(state, ssh, "state", StepError)
    _sh.check_shardings(state, ssh, what="state")
    if self.batch_sharding is None:
      bs = _sh.batch_sharding(self.mesh)
      # Rank 0 replicated, rank 1 by rows only (a sequence split needs a second dim).
      by_rank = (NamedSharding(self.mesh, PartitionSpec()),
                 NamedSharding(self.mesh, PartitionSpec(*bs.spec[:1])))
      batch_flat = [by_rank[len(_tree.aval(x)[0])] if len(_tree.aval(x)[0]) < 2 else bs
                    for x in jax.tree.leaves(batch)]
    else:
      batch_flat = _tree.leaf_shardings(batch, self.batch_sharding, "batch", StepError)
    bsh = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), batch_flat)
    _sh.check_batch(batch, bsh)
    return _Layout(state, ssh, state_flat, bsh, batch_flat)

  def _traced(self, layout: _Layout, batch, sig: _Signature):
    """`_lower`, its failures said as StepErrors (where the user's step failed, and why)."""
    try:
      return self._lower(layout, batch)
    except FnscaleError:
      raise
    except (NotImplementedError, ValueError) as e:
      boxed = _flax.constraint_failure(e)
      if boxed is not None:
        raise StepError(boxed) from None
      closed = _closure.explicit_closure(e, self.step, "the step")
      if closed is not None and self.mode == "shard_map":
        raise StepError(closed.message(
            "shard_step(mode='shard_map') runs the step per shard under jax.shard_map",
            _closure.FIX + ", or mode='auto'")) from None
      if closed is not None:  # e.g. train_step's per-shard microbatch loop
        raise StepError(closed.message(
            "a jax.shard_map in the step (e.g. train_step's per-shard microbatch loop)",
            _closure.FIX + ", or train_step(..., accum_gather='per_microbatch')")) from None
      raise _trace_error(e, sig, self._signatures()) from e
    except Exception as e:  # pylint: disable=broad-except  # the user's step failed to trace
      raise _trace_error(e, sig, self._signatures()) from e

  def _lower(self, layout: _Layout, batch):
    """`jax.jit(...).lower` of the step in `layout`'s shardings."""
    state, ssh, state_flat, _, batch_flat = layout
    rep = NamedSharding(self.mesh, PartitionSpec())

    def lower(mesh):  # built afresh for each mesh traced under (shard_map keeps the first)
      sf, bf = ([_flax.on_mesh(s, mesh) for s in flat] for flat in (state_flat, batch_flat))
      in_sh = (jax.tree.unflatten(jax.tree.structure(state), sf),
               jax.tree.unflatten(jax.tree.structure(batch), bf))
      jitted = jax.jit(self._body(batch, bf), in_shardings=in_sh, out_shardings=(ssh, rep),
                       donate_argnums=(0,) if self.donate else ())
      return jitted.lower(_tree.abstract(state, sf), _tree.abstract(batch, bf))
    # The step knows the params' shardings (gradient accumulators are pinned to them).
    params = getattr(state, "params", None)  # a TrainState's first leaves
    specs = _loss.param_specs(params, state_flat[:len(jax.tree.leaves(params))])
    # Flax's logical constraints on activations follow the rules, on this mesh's axes.
    with jax.set_mesh(self.mesh), specs, _flax.rules_scope(_sh.normalize_rules(self.rules)):
      # A Linen box's constraint on an axis the mesh lacks: traced again with it, of size 1.
      return _flax.with_box_axes(lower, "shard_step")

  def _body(self, batch, batch_flat):
    daxes = _axes.data_axes(self.mesh)
    if self.mode == "auto" or not daxes:
      if self.mode == "shard_map":
        logging.info("shard_step: mesh %s has no data axes; mode='shard_map' runs as 'auto'",
                     dict(self.mesh.shape))
      return self.step
    batch_specs = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(batch),
        [_tree.filter_spec(s.spec, lambda a: a in daxes) for s in batch_flat])
    # The mesh in scope when traced: `self.mesh`, or it with a Linen box's size-1 axes.
    per_shard = jax.shard_map(self.step, in_specs=(PartitionSpec(), batch_specs),
                              out_specs=(PartitionSpec(), PartitionSpec()),
                              axis_names=set(daxes), check_vma=True)
    explicit = set(daxes) & set(getattr(self.mesh, "explicit_axes", ()))
    if not explicit:
      return per_shard  # shard_map gathers FSDP-split state leaves on entry itself

    def body(state, batch):
      # On Explicit axes the state's types must be whole over the data axes first.
      return per_shard(jax.tree.map(lambda x: _whole_over(x, explicit), state), batch)
    return body

  def _signatures(self) -> list[_Signature]:
    """The signatures this step compiled for before."""
    return [c.signature for c in self._executables.values()]


def _inputs_key(state, batch) -> tuple:
  return (jax.tree_util.tree_structure(state), jax.tree_util.tree_structure(batch),
          tuple(_tree.aval(x) for x in jax.tree.leaves(state)),
          tuple(_tree.aval(x) for x in jax.tree.leaves(batch)))


# Frames of these packages (and Python's own library) are not where a model failed: the
# innermost frame outside them is the user's line (a Linen layer's call, not flax's check).
_LIBRARIES = frozenset({"jax", "jaxlib", "fnscale", "flax", "equinox", "optax", "jmp",
                        "numpy", "chex", "haiku", "einops", "absl"})
_STDLIB = sysconfig.get_paths()["stdlib"]


def _user_frame(e: BaseException) -> str:
  """'file:line, in fn (`source`)' for the innermost frame of `e`'s traceback in the user's
  code, else the innermost frame; '' without a traceback."""
  frames = []
  tb = e.__traceback__
  while tb is not None:
    frames.append(tb)
    tb = tb.tb_next

  def library(tb) -> bool:
    module = tb.tb_frame.f_globals.get("__name__", "") or ""
    path = tb.tb_frame.f_code.co_filename
    # A model installed as a package may sit under the stdlib's folder (site-packages).
    return module.split(".")[0] in _LIBRARIES or (
        path.startswith(_STDLIB) and "-packages" not in path)
  tb = next((t for t in reversed(frames) if not library(t)), frames[-1] if frames else None)
  if tb is None:
    return ""
  code, line = tb.tb_frame.f_code, tb.tb_lineno
  source = linecache.getline(code.co_filename, line).strip()
  source = source if len(source) <= 80 else source[:77] + "..."
  return f" in {code.co_filename}:{line}, in {code.co_name}" + (
      f" (`{source}`)" if source else "")


def _batch_text(leaves) -> str:
  return "{" + ", ".join(f"'{name.split(chr(39))[1]}': {dt}{list(shape)}"
                         for name, shape, dt, _ in leaves) + "}"


def _changed_batch(sig: _Signature, earlier: list[_Signature]) -> str:
  """The known fix for a step that traced before and fails now: the batch leaf whose shape
  or dtype changed (same state, same structure), else ''."""
  for old in earlier:
    if (old.batch_def, old.state_def, old.state_leaves) != (
        sig.batch_def, sig.state_def, sig.state_leaves):
      continue
    for (name, shape, dt, _), (_, gshape, gdt, _) in zip(old.batch_leaves, sig.batch_leaves):
      if (shape, dt) != (gshape, gdt):
        return (f"fix: this step traced for batch {_batch_text(old.batch_leaves)}; {name} is "
                f"{gdt}{list(gshape)} where it was {dt}{list(shape)}: give the batch the "
                "shapes and dtypes it traced with, or make the model take the new ones.")
  return ""


def _trace_error(e: Exception, sig: _Signature, earlier: list[_Signature]) -> StepError:
  """The step's own failure while tracing: where (the user's frame), the model's or jax's
  message whole, and a fix only where one is known (`_changed_batch`)."""
  message = f"{type(e).__name__}: {e}"
  fix = _changed_batch(sig, earlier) or _model_state.hint(message)
  if fix:
    fix = ("\n" if "\n" in message else "; ") + fix
  return StepError(f"tracing the step failed for batch {_batch_text(sig.batch_leaves)}"
                   f"{_user_frame(e)}: {message}{fix}")


def _whole_over(x, axes: set):
  """`x` resharded so that its type no longer splits it over `axes` (Explicit axes)."""
  spec = jax.typeof(x).sharding.spec
  kept = _tree.filter_spec(spec, lambda a: a not in axes)
  return jax.sharding.reshard(x, kept) if kept != PartitionSpec(*spec) else x


def _check_args(step, mesh, mode, donate, optimizer, compiler_options) -> None:
  if not callable(step):
    raise StepError(f"step is {_tree.got(step)}, expected a callable step(state, batch).")
  check_mesh(mesh, "shard_step")
  if mode not in _MODES:
    raise StepError(f"mode={mode!r}, expected one of {_MODES}.")
  if not isinstance(donate, bool):
    raise StepError(f"donate is {_tree.got(donate)}, expected a bool.")
  if optimizer is not None and not (callable(getattr(optimizer, "init", None))
                                    and callable(getattr(optimizer, "update", None))):
    raise StepError(f"optimizer is {_tree.got(optimizer)}, expected an "
                    "optax.GradientTransformation or None.")
  if compiler_options is not None and not isinstance(compiler_options, Mapping):
    raise StepError(f"compiler_options is {_tree.got(compiler_options)}, expected a dict of "
                    "XLA option names to values.")


def shard_step(step: Callable, mesh, *, rules=(), logical_axes=None, state_shardings=None,
               batch_sharding=None, donate: bool = True, mode: str = "auto", example=None,
               optimizer=None, sharding_options: Mapping | None = None,
               compiler_options: Mapping | None = None,
               fast_compile: bool = False):
  """Compiles `step(state, batch) -> (state, metrics)` as one SPMD program over `mesh`.

  The step is lowered and compiled ahead of time from abstract inputs
  (`jax.ShapeDtypeStruct` with shardings), and calls run the kept executable, so step 0
  never compiles again. Compiling involves no other process; in a multi-process job call
  `fnscale.multihost.agree_on_step(compiled)` after `.compile(...)` (a barrier that also
  checks every process compiled the same program). Shardings flow with the values: a
  state leaf that carries a NamedSharding on `mesh` (a state born sharded by `init_state`,
  its arrays or ShapeDtypeStructs) is compiled in that sharding, so `shard_step(step, mesh)`
  needs no rules again and never reshards such a state. Leaves without one (numpy arrays,
  another mesh) are derived as `fnscale.state_shardings` derives them from `rules`,
  `logical_axes` and `sharding_options` (params; automatic FSDP without rules), the
  optimizer state following the params (found with `optimizer` when given, else by
  structure), step and loss scale replicated; `state_shardings` overrides all. A state
  whose params hold Flax Linen boxes is laid out by their names and the step runs on their
  plain arrays (it returns a state without boxes); where a layer unboxes its own box
  (DenseGeneral's flat kernel init, run again by `model.apply`) on a mesh axis the mesh
  lacks, the step is traced on the mesh with that axis of size 1 added (said at INFO; it
  splits nothing, and the state stays on `mesh`). While the step is traced, Flax's logical
  rules are `rules` (else Flax's own in effect), each kept to the mesh axes a constraint may
  name there, so `nn.with_logical_constraint` follows the layout. The step
  is never inspected: a wrapper around it compiles the same program. The batch's leading
  dim is split over the mesh's data axes (`fnscale.batch_sharding`) unless
  `batch_sharding` is given; rank-0 batch leaves are replicated. The state is donated (its
  buffers reused for the new state) when `donate`.

  Args:
    step: the step, e.g. from `train_step` (possibly wrapped, e.g. by `with_kernel`).
    mesh: the `jax.sharding.Mesh`, with Auto or Explicit axis types (`jax.make_mesh`'s
      default); a mesh over `jax.experimental.topologies` devices compiles for hardware
      that isn't here.
    rules, logical_axes, sharding_options: as in `init_state`, for leaves that carry no
      sharding on `mesh`; when given they must agree with the ones that do.
    state_shardings: a TrainState of NamedShardings (or a prefix) to use instead.
    batch_sharding: a NamedSharding for every batch leaf, or a pytree of them.
    donate: donate the state argument.
    mode: "auto": `jax.jit` with in/out shardings, XLA's sharding propagation (GSPMD)
      partitions the step. "shard_map": the step runs per shard under `jax.shard_map`, manual
      over the mesh's data axes (other axes stay automatic), with the batch split over them
      and the state replicated over them (FSDP-sharded leaves are all-gathered at entry);
      `train_step` steps `pmean` gradients, loss and aux over those axes and give the same
      params as "auto" (up to float rounding).
    example: `(state, batch)` (arrays or ShapeDtypeStructs): compile now and return the
      `CompiledStep` (same as `shard_step(...).compile(state, batch)`).
    optimizer: the optax optimizer, to find the param-shaped parts of a state whose
      optimizer leaves carry no sharding on `mesh` (e.g. numpy arrays); optional, and when
      given it must agree with the optimizer leaves that carry one.
    compiler_options: XLA compile options (DebugOptions names) for `Lowered.compile`.
    fast_compile: add `fnscale.fast_compile_options()` (debugging: slower programs).

  Returns:
    A `ShardedStep` (or a `CompiledStep` with `example`). Batch or state leaves placed
    differently from the compiled shardings (numpy arrays, other meshes) are moved there
    with `jax.device_put` (a transfer, never a new compile; a warning for the state); leaves
    of other shapes, dtypes or structure raise StepError. In multi-process jobs build
    batches with `fnscale.global_batch`.

  Raises:
    StepError: a bad step, mesh, mode or option (named, with what was given); a state or
      batch that doesn't match the compiled step (naming the leaf path, expected and got).
    ShardingError: a batch leaf not divisible by the data axes, a state leaf that doesn't
      fit its sharding (naming the leaf path and axes), a state leaf whose carried sharding
      disagrees with the rules / logical axes / sharding options / optimizer passed (naming
      the leaf and both PartitionSpecs).

  Examples:
    The least-squares step of `train_step`, data parallel over 8 devices (16 rows, 2 each):

    >>> import jax.numpy as jnp, optax
    >>> import fnscale as fs
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> mesh = fs.make_mesh({"data": 8})
    >>> opt = optax.sgd(0.1)
    >>> state = fs.init_state({"w": jnp.zeros((4, 1))}, opt, mesh=mesh)
    >>> step = fs.shard_step(fs.train_step(loss_fn, opt), mesh)
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.ones((16, 1))}
    >>> state, metrics = step(state, batch)
    >>> print(f"{metrics['loss']:.4f}", int(state.step))
    1.0000 1
    >>> state, metrics = step(state, batch)
    >>> print(f"{metrics['loss']:.4f}")  # as on one device
    0.0400
  """
  _check_args(step, mesh, mode, donate, optimizer, compiler_options)
  options = dict(compiler_options or {})
  if fast_compile:
    options = {**_compiler.fast_compile_options(), **options}
  sharded = ShardedStep(step, mesh, rules, logical_axes, state_shardings, batch_sharding,
                        donate, mode, optimizer, sharding_options, options)
  if example is None:
    return sharded
  if not (isinstance(example, tuple) and len(example) == 2):
    raise StepError(f"example is {_tree.got(example)}, expected (state, batch).")
  return sharded.compile(*example)
