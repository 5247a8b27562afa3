"""Mixture of experts: a routed SwiGLU feed-forward, its experts split over an `expert` axis.

Each token's router logits (float32) pick its top-k experts; the token's output is the
weighted sum of those experts' feed-forwards. `moe` runs it in one of two ways:

- dropless (`capacity_factor=None`, default): the token copies are sorted by expert, one
  grouped matmul per projection runs every expert over its contiguous rows
  (`fnscale.kernels.grouped_matmul`: the TPU megablox kernel, `jax.lax.ragged_dot` on GPUs,
  a tiled form in plain XLA ops elsewhere), the rows are unsorted and combined with the
  routing weights; nothing is dropped (MegaBlocks, Gale et al. 2023; MaxText's
  `sparse_matmul`).
- capacity (`capacity_factor=c`): each expert takes at most C = ceil(c x seq x k / experts)
  copies per sequence, in token order (a token's first choice before its second); the rest
  are dropped (counted) and add nothing (GShard, Lepikhin et al. 2020; Switch Transformer,
  Fedus et al. 2021). Experts run as one batched matmul over a [experts, C x rows] buffer.

Under a mesh the layer runs per shard inside `jax.shard_map`: tokens split over the batch's
data-like axes (the expert axis among them) and, for the dropless layer, the sequence over
the context axes (each shard routes its own piece of every row), experts split over the expert axis
(`fnscale.axis_conventions`: "expert"), each expert's hidden width over the tensor axes
(Megatron-style: its down projection's partial sums are all-reduced). Token copies travel
to their experts' shard and back over the expert axis, or the experts to the tokens, by one
of four exchanges (`exchange_selection` decides, and says why):

- "ragged": `jax.lax.ragged_all_to_all` sends each shard exactly its copies (TPU, GPU);
  the receiving buffer holds the worst case, n x tokens x min(k, local experts) rows, as
  MaxText's dropless default does. `interpret=True` runs it anywhere through a stand-in
  built from an all-gather (the same offsets and sizes; for tests on CPU).
- "gather_experts": the experts' weights are all-gathered over the expert axis (in the
  compute dtype, layer by layer; their gradients reduce-scattered back, as FSDP does) and
  every shard runs every expert over its own tokens, which never move: the matmul work of
  the layer without an expert axis, the weights' memory still split. Where the backend has
  no ragged all-to-all (XLA:CPU, jax#34755) "auto" takes it.
- "all_gather": every shard of the expert axis gathers the tokens and routing of its
  group, runs its own experts over the copies routed to them, and a reduce-scatter
  (`psum_scatter`) sums each token's outputs back to its shard; dropless on any backend.
  Its static buffer holds the worst case, n x tokens x min(k, local experts) rows, and
  without a ragged kernel the grouped matmul computes over all of it: with k <= local
  experts, n times the rows the layer routes there (n = 4, k = 2 of 8 experts, 512 tokens
  a shard: 640 rows against 184 for every expert run locally), so splitting the experts
  costs more matmul work than it saves; hence "gather_experts" on such backends.
- "all_to_all": the capacity path's fixed-size buffers, one `all_to_all` each way.

Inside a caller's own checked `jax.shard_map` over some axes (a data axis, say) the layer's
shard_map nests in it, over the rest; its reverse-mode derivative then passes its residuals
itself (`_nested_shard_map`: jax's own specs name the outer axes, which XLA refuses), and
its auxiliaries cover the rows it sees.

The auxiliaries (`MoEAux`) are over the whole global batch (their partial sums are
all-reduced), so they equal a one-device run's: the load-balance loss (Switch Transformer
eq. 4, experts x sum_e f_e P_e: 1 when balanced; HF's Mixtral loss is k times this), the
router z-loss (ST-MoE, Zoph et al. 2022: mean squared logsumexp of the logits), tokens per
expert and copies dropped.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from fnscale import _autodiff
from fnscale import _axes
from fnscale import _compat
from fnscale import _context
from fnscale._context import ExpertChoice
from fnscale import _tree
from fnscale._errors import KernelError
from fnscale.kernels._per_device import explicit_free_axes
from fnscale.kernels._grouped_matmul import GMM_IMPLEMENTATIONS
from fnscale.parallel._expert_exchange import (
    _Ctx, _Gmm, _capacity, _gathered, _local, _psum, _ragged)
from fnscale.parallel._expert_plan import (
    _PARAM_KEYS, EXCHANGES, ExchangeSelection, _check, capacity, exchange_selection)
from fnscale.parallel._expert_routing import Routing, Scoring, route, update_router_bias  # noqa: F401

__all__ = ["EXCHANGES", "ExchangeSelection", "ExpertChoice", "MoEAux", "Routing",
           "capacity", "exchange_selection", "moe", "route", "with_experts"]

# The layer's work runs under this `jax.named_scope`, so a traced program's expert matmuls
# and exchanges can be told apart (`fnscale.analysis._trace`).
SCOPE = "fnscale_experts"


class MoEAux(NamedTuple):
  """What an MoE layer reports beside its output, over the whole global batch.

  Attributes:
    load_balance_loss: float32 scalar, experts x sum_e f_e P_e (f_e: share of the token
      copies routed to e, P_e: mean router probability of e); 1 when balanced.
    router_z_loss: float32 scalar, mean over tokens of logsumexp(logits)^2.
    tokens_per_expert: int32 [E], token copies routed to each expert (before any drop).
    dropped: int32 scalar, token copies the capacity dropped (0 when dropless).

  Examples:
    Two capacity slots per expert (capacity_factor 1 over 4 tokens, k = 2, 4 experts) and
    routers that send every token to the same two experts: half the copies are dropped.

    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> E, D, F = 4, 8, 16  # experts, d_model, expert hidden width
    >>> rng = np.random.default_rng(0)
    >>> params = {"router": rng.normal(size=(D, E)), "w_gate": rng.normal(size=(E, D, F)),
    ...           "w_up": rng.normal(size=(E, D, F)), "w_down": rng.normal(size=(E, F, D))}
    >>> params["router"] = jnp.zeros((D, E)).at[:, :2].set(1.0)
    >>> x = jnp.ones((1, 4, D))
    >>> _, aux = jax.jit(lambda x, p: fs.parallel.moe(x, p, k=2, capacity_factor=1.0))(x, params)
    >>> aux.tokens_per_expert.tolist(), int(aux.dropped), round(float(aux.load_balance_loss), 2)
    ([4, 4, 0, 0], 4, 2.0)
  """
  load_balance_loss: jax.Array
  router_z_loss: jax.Array
  tokens_per_expert: jax.Array
  dropped: jax.Array


def with_experts(fn: Callable[..., Any] | None = None, *, exchange: str = "auto",
                 grouped_matmul: str = "auto", interpret: bool = False) -> Callable[..., Any]:
  """Returns `fn` with an expert-layer choice in force during each of its calls.

  Like `fnscale.with_kernel` for attention: every `moe(..., exchange="auto")` traced inside
  a call of the returned function behaves as if called with these values; the choice is a
  jax user context, so `jax.jit` traces again under another choice. Wrap the step that
  `shard_step` compiles: `shard_step(with_experts(step, ...), mesh)`.

  Args:
    fn: the function to wrap; omitted: returns a decorator.
    exchange: "auto" or one of "ragged", "gather_experts", "all_gather", "all_to_all"
      (`exchange_selection`).
    grouped_matmul: "auto", "ragged_dot" or "megablox" (`fnscale.kernels.gmm_selection`).
    interpret: run the ragged exchange through its all-gather stand-in and megablox in
      Pallas interpret mode (any backend; for tests).

  Returns:
    A function with `fn`'s signature and result.

  Raises:
    KernelError: an unknown exchange or grouped matmul, `interpret` not a bool, `fn` not
      callable.

  Examples:
    The `moe` calls inside the wrapped function exchange tokens by all-gather
    (`exchange_selection` reads the same choice):

    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> E, D, F = 4, 8, 16  # experts, d_model, expert hidden width
    >>> rng = np.random.default_rng(0)
    >>> params = {"router": rng.normal(size=(D, E)), "w_gate": rng.normal(size=(E, D, F)),
    ...           "w_up": rng.normal(size=(E, D, F)), "w_down": rng.normal(size=(E, F, D))}
    >>> pick = fs.parallel.with_experts(
    ...     lambda: fs.parallel.exchange_selection((8, 16, D), params, k=2).exchange,
    ...     exchange="all_gather")
    >>> with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    ...   pick(), fs.parallel.exchange_selection((8, 16, D), params, k=2).exchange
    ('all_gather', 'gather_experts')
    >>> fs.parallel.EXCHANGES
    ('auto', 'ragged', 'gather_experts', 'all_gather', 'all_to_all')
  """
  if exchange not in EXCHANGES:
    raise KernelError(f"with_experts(exchange={exchange!r}): expected one of {EXCHANGES}.")
  if grouped_matmul not in GMM_IMPLEMENTATIONS:
    raise KernelError(f"with_experts(grouped_matmul={grouped_matmul!r}): expected one of "
                      f"{GMM_IMPLEMENTATIONS}.")
  if not isinstance(interpret, bool):
    raise KernelError(f"with_experts(interpret={interpret!r}): expected True or False.")
  if fn is None:
    return functools.partial(with_experts, exchange=exchange, grouped_matmul=grouped_matmul,
                             interpret=interpret)
  if not callable(fn):
    raise KernelError(f"with_experts(fn={fn!r}): expected a function to wrap.")
  choice = ExpertChoice(exchange, grouped_matmul, interpret)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _context.EXPERT_CHOICE(choice):
      return fn(*args, **kwargs)

  return wrapped


# ----------------------------------------------------------------------------- the layer


def _aux(r: Routing, c: _Ctx, dropped):
  """MoEAux over the global batch: partial sums all-reduced over the token axes."""
  total = r.logits.shape[0] * c.shards  # tokens in the global batch
  counts = jnp.bincount(r.experts.reshape(-1), length=c.experts).astype(jnp.int32)
  z = jnp.sum(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))
  counts, probs, z, dropped = _psum((counts, jnp.sum(r.probs, axis=0), z, dropped), c.tokens)
  share = counts.astype(jnp.float32) / (total * c.k)
  balance = c.experts * jnp.sum(share * probs / total)
  return MoEAux(balance, z / total, counts, dropped)


# The dimension of each param that holds d_model (split over the fsdp axes where stored so).
_D_MODEL_DIM = {"router": 0, "w_gate": 1, "w_up": 1, "w_down": 2}


def _gathered_weights(params, c: _Ctx, dtype) -> dict:
  """The params whole over the fsdp axes (FSDP: all-gathered in the compute dtype, their
  gradients reduce-scattered by the all-gather's transpose); the router stays float32."""
  out = {}
  for key in _PARAM_KEYS:
    w = params[key] if key == "router" else params[key].astype(dtype)
    if c.fsdp:
      w = jax.lax.all_gather(w, c.fsdp, axis=_D_MODEL_DIM[key], tiled=True)
    out[key] = w
  return out


def _all_experts(w: dict, c: _Ctx) -> dict:
  """Every expert's weights on this shard: all-gathered over the expert axis (their
  gradients reduce-scattered back by the all-gather's transpose)."""
  return {key: jax.lax.all_gather(v, c.ax, axis=0, tiled=True) for key, v in w.items()}


def _body(flat, params, *, c: _Ctx, seq: int, normalize: bool, scoring: Scoring):
  """The layer on one shard: tokens [T, D] (whole sequences of `seq` on the capacity path)
  -> ([T, D], MoEAux)."""
  w = _gathered_weights(params, c, flat.dtype)
  r = route(flat, w.pop("router"), c.k, normalize=normalize, scoring=scoring,
            bias=params.get("router_bias"))
  dropped = jnp.zeros((), jnp.int32)
  if c.cap is not None:
    out, dropped = _capacity(flat, r, w, c, seq)
  elif c.n == 1:
    out = _local(flat, r, w, c)
  elif c.exchange == "ragged":
    out = _ragged(flat, r, w, c)
  elif c.exchange == "gather_experts":
    out = _local(flat, r, _all_experts(w, c), c)
  else:
    out = _gathered(flat, r, w, c)
  return out.astype(flat.dtype), _aux(r, c, dropped)


def moe(x: jax.Array, params: Mapping[str, jax.Array], k: int, *,
        capacity_factor: float | None = None, normalize: bool = True,
        scoring: Scoring = Scoring(), expert_axis: str | None = None, exchange: str = "auto",
        grouped_matmul: str = "auto", interpret: bool | None = None,
        mesh=None) -> tuple[jax.Array, MoEAux]:
  """A mixture-of-experts SwiGLU feed-forward (see the module docstring).

  out[t] = sum over t's top-k experts e of weight[t, e] x (silu(x Wg_e) * (x Wu_e)) Wd_e.

  Args:
    x: [batch, seq, d_model] in the compute dtype (the experts' weights are cast to it).
    params: {"router": [d_model, E], "w_gate": [E, d_model, F], "w_up": [E, d_model, F],
      "w_down": [E, F, d_model]}, and DeepSeek-V3's selection bias "router_bias" [E]
      (float32; optional); under a mesh give the expert weights logical axes that put E on
      the expert axis (e.g. a rule ("experts", "expert")), or the layer's shard_map moves
      them there.
    k: experts per token, 1 <= k <= E.
    capacity_factor: None for the dropless layer; a number > 0 for the capacity path
      (`capacity`).
    normalize: renormalise the top-k weights to sum to 1 (Mixtral); False keeps the
      softmax probabilities (DeepSeek-V2).
    scoring: how the router scores and chooses (`Scoring`; DeepSeek-V3's sigmoid, groups
      and weight scale).
    expert_axis: the mesh axis to split experts over; default the convention's expert axis
      when the mesh has one (none: experts are not split).
    exchange: "auto" or a name in `EXCHANGES` (`exchange_selection`); `with_experts` sets the
      default for a block.
    grouped_matmul: "auto", "ragged_dot" or "megablox" (`fnscale.kernels.gmm_selection`).
    interpret: the ragged exchange's stand-in and megablox interpret mode; default the
      enclosing `with_experts`'s (else False).
    mesh: default the context mesh (`fnscale.with_mesh` / `jax.set_mesh`); none: one device.

  Returns:
    (out [batch, seq, d_model] in x's dtype, `MoEAux`).

  Raises:
    ExpertError: params that don't fit x, k outside [1, E], a capacity_factor <= 0.
    ShardingError: E not divisible by the expert axis; batch rows, the sequence or F not
      divisible by the axes that split them; a capacity_factor under a context axis.
    MeshError: an `expert_axis` the mesh lacks.
    KernelError: an exchange or grouped matmul that can't serve the call.

  Examples:
    Dropless, 6 tokens x 2 experts each:

    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> E, D, F = 4, 8, 16  # experts, d_model, expert hidden width
    >>> rng = np.random.default_rng(0)
    >>> params = {"router": rng.normal(size=(D, E)), "w_gate": rng.normal(size=(E, D, F)),
    ...           "w_up": rng.normal(size=(E, D, F)), "w_down": rng.normal(size=(E, F, D))}
    >>> out, aux = jax.jit(fs.parallel.moe, static_argnames="k")(jnp.ones((2, 3, D)), params, k=2)
    >>> out.shape, int(aux.tokens_per_expert.sum()), int(aux.dropped)
    ((2, 3, 8), 12, 0)
  """
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  plan = exchange_selection(jnp.shape(x), params, k, dtype=x.dtype, capacity_factor=capacity_factor,
                       expert_axis=expert_axis, exchange=exchange,
                       grouped_matmul=grouped_matmul, interpret=interpret, mesh=mesh)
  sh = _check(x, params, k, capacity_factor, scoring)
  cap = None if capacity_factor is None else capacity(capacity_factor, sh.seq, k, sh.experts)
  shards = math.prod(mesh.shape[a] for a in plan.token_axes) if plan.token_axes else 1
  c = _Ctx(int(k), sh.experts, plan.expert_axis, plan.expert_shards, plan.token_axes, shards,
           plan.tensor_axes, plan.fsdp_axes, plan.exchange,
           _Gmm(plan.grouped_matmul, plan.interpret, plan.platform), plan.interpret, cap)
  body = functools.partial(_body, c=c, seq=sh.seq, normalize=normalize, scoring=scoring)
  keys = _PARAM_KEYS + (("router_bias",) if "router_bias" in params else ())
  flat = jnp.reshape(x, (sh.batch * sh.seq, sh.d_model))  # batch-major: rows stay whole
  with jax.named_scope(SCOPE):
    if not (c.tokens or c.tensor or c.ax):
      out, aux = body(flat, params)
    else:
      ex, tp, fs = c.ax, _tree.spec_entry(c.tensor), _tree.spec_entry(c.fsdp)
      specs = {"router": P(fs, None), "w_gate": P(ex, fs, tp), "w_up": P(ex, fs, tp),
               "w_down": P(ex, tp, fs), "router_bias": P(None)}
      seq = tuple(a for a in c.tokens if a in _axes.context_axes(mesh))
      rows = _tree.spec_entry(tuple(a for a in c.tokens if a not in seq))
      # A sequence split over context axes: each shard flattens its own rows' pieces.
      xspec = P(rows, _tree.spec_entry(seq), None) if seq else P(_tree.spec_entry(c.tokens), None)
      in_specs = (xspec, {key: specs[key] for key in keys})
      args = (x if seq else flat, {key: params[key] for key in keys})
      if explicit_free_axes(mesh):  # shardings in the types: each enters by its spec
        args = jax.tree.map(lambda s, a: jax.sharding.reshard(a, s), in_specs, args,
                            is_leaf=lambda s: isinstance(s, P))
      out, aux = _shard_map(
          functools.partial(_flat_body, body=body) if seq else body, args,
          mesh=None if isinstance(mesh, jax.sharding.AbstractMesh) else mesh,
          in_specs=in_specs,
          out_specs=(xspec, MoEAux(P(), P(), P(), P())),
          axis_names=tuple(a for a in mesh.axis_names if a in c.tokens + c.tensor + (ex,)))
  return jnp.reshape(out, jnp.shape(x)), aux


def _shard_map(fn, args, *, in_specs, out_specs, axis_names, **kw):
  """`jax.shard_map(fn)(*args)`, checked (megablox, a Pallas call, runs where nothing is:
  `_compat.kernel_call`). Nested in a checked shard_map whose axes the args vary over, its
  reverse-mode derivative passes its residuals itself (`_nested_shard_map`)."""
  sm = lambda f, i, o: jax.shard_map(f, in_specs=i, out_specs=o, axis_names=set(axis_names),
                                     check_vma=True, **kw)
  outer = set().union(*map(_compat.varying_axes, jax.tree.leaves(args))) - set(axis_names)
  if not outer:
    return sm(fn, in_specs, out_specs)(*args)
  return _nested_shard_map(fn, sm, in_specs, out_specs, axis_names)(*args)


def _nested_shard_map(fn, sm, in_specs, out_specs, axes):
  """`sm(fn, in_specs, out_specs)` differentiated in reverse mode with its residuals passed
  from one shard_map to the other as outputs, each device's [1, ...] split over the axes it
  varies over. jax's partial evaluation of a shard_map nested in another checked one specs
  a residual by every axis it varies over, the outer shard_map's too, which its lowering
  refuses ("operates on axis "data" which is already bound by a parent
  sdy.manual_computation op"; jax 0.10.2 and 0.12). Forward mode takes jax's JVP."""
  specs = jax.tree.leaves(out_specs, is_leaf=lambda s: isinstance(s, P))  # one per output
  found = []  # (the pullback's tree, the outputs' types, the residuals' specs), per trace

  def forward(*args):
    out, pullback = jax.vjp(fn, *args)
    residuals, tree = jax.tree.flatten(pullback)
    split = [P(tuple(a for a in axes if a in _compat.varying_axes(r)) or None)
             for r in residuals]
    found.append((tree, jax.tree.map(jax.typeof, out), split))
    return out, [r[None] for r in residuals]

  def fwd(*args):
    # Each residual split over exactly the axes it varies over: split over another, it
    # would come back typed as varying over that one too, which its pullback refuses. A
    # first trace, every residual split over every axis, finds them.
    jax.eval_shape(sm(forward, in_specs, (out_specs, P(tuple(axes)))), *args)
    return sm(forward, in_specs, (out_specs, found[-1][2]))(*args)

  def backward(residuals, cts):  # cts: the float outputs' cotangents
    tree, outs, _ = found[-1]
    cts = iter(cts)
    full = [next(cts) if _floating(o) else np.zeros(o.shape, jax.dtypes.float0)
            for o in jax.tree.leaves(outs)]
    pullback = jax.tree.unflatten(tree, [r[0] for r in residuals])
    return pullback(jax.tree.unflatten(jax.tree.structure(outs), full))

  def bwd(residuals, ct):  # integer outputs' (float0) cotangents don't enter a shard_map
    kept = [(t, s) for t, s in zip(jax.tree.leaves(ct), specs) if _floating(t)]
    return sm(backward, (found[-1][2], [s for _, s in kept]), in_specs)(
        residuals, [t for t, _ in kept])

  plain = sm(fn, in_specs, out_specs)
  run = jax.custom_vjp(plain)
  run.defvjp(fwd, bwd)
  return _autodiff.reverse_only(run, plain, "the expert layer's shard_map nested in another",
                                "jax's JVP of the shard_map", kernels=False)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _flat_body(x, params, *, body):
  """`body` on a shard's [rows, seq piece, D] tokens as [rows x piece, D]."""
  out, aux = body(jnp.reshape(x, (-1, x.shape[-1])), params)
  return jnp.reshape(out, x.shape), aux
