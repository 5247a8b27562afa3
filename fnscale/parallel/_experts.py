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
from fnscale._errors import ExpertError, KernelError, MeshError, ShardingError
from fnscale.kernels._per_device import explicit_free_axes
from fnscale.kernels._grouped_matmul import GMM_IMPLEMENTATIONS, gmm_selection, grouped_matmul

__all__ = ["EXCHANGES", "ExchangeSelection", "ExpertChoice", "MoEAux", "Routing",
           "capacity", "exchange_selection", "moe", "route", "with_experts"]

EXCHANGES = ("auto", "ragged", "gather_experts", "all_gather", "all_to_all")
# The layer's work runs under this `jax.named_scope`, so a traced program's expert matmuls
# and exchanges can be told apart (`fnscale.analysis._cost`).
SCOPE = "fnscale_experts"
_PARAM_KEYS = ("router", "w_gate", "w_up", "w_down")
# What the one log line says when forward-mode autodiff meets the layer's custom_vjps.
_NAME = "the expert layer's token permutations and exchange"
_FORWARD = "the JVP of its plain gathers and exchanges"


class Routing(NamedTuple):
  """A router's decision for T tokens over E experts.

  Attributes:
    logits: float32 [T, E].
    probs: float32 [T, E], softmax of the logits.
    experts: int32 [T, k], each token's experts, most probable first (ties: lower index).
    weights: float32 [T, k], their combine weights (the probs, renormalised to sum to 1
      over the k when `normalize`).

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> router = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])  # [D=2, E=3]
    >>> route = jax.jit(fs.parallel.route, static_argnames=("k", "normalize"))
    >>> r = route(np.array([[1.0, 0.0], [0.0, 1.0]]), router, k=2)
    >>> r.experts.tolist(), r.weights.sum(axis=-1).tolist()
    ([[0, 1], [1, 0]], [1.0, 1.0])
  """
  logits: jax.Array
  probs: jax.Array
  experts: jax.Array
  weights: jax.Array


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


class ExchangeSelection(NamedTuple):
  """How `moe` runs for a call, and why.

  Attributes:
    exchange: "none" (no expert axis > 1), "ragged", "gather_experts", "all_gather" or
      "all_to_all".
    grouped_matmul: "ragged_dot" or "megablox" (dropless), "einsum" (capacity).
    requested: the exchange asked for, after `with_experts` ("auto" or a name).
    reason: why this exchange (and grouped matmul); a fallback names why the preferred
      one can't serve.
    fallback: "auto" wanted the ragged exchange but the backend can't run it.
    platform: the platform decided for.
    interpret: the ragged stand-in / megablox interpret mode.
    expert_axis: the mesh axis experts are split over (None: not split).
    expert_shards: its size (1: not split).
    token_axes: mesh axes the tokens are split over inside the layer: the batch dim over
      the data-like ones, then (dropless layer only) the sequence over the context axes.
    tensor_axes: mesh axes each expert's hidden width is split over.
    fsdp_axes: mesh axes the expert weights' d_model is stored split over (the token axes
      that are neither the expert axis nor pure data-parallel ones: FSDP); the layer
      all-gathers them over these in the compute dtype, their gradients reduce-scattered
      back.
    buffer_rows: rows each grouped matmul runs over per device (the token copies it may
      receive: the worst case for a dropless exchange, the capacity buffer otherwise).

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> E, D, F = 4, 8, 16  # experts, d_model, expert hidden width
    >>> rng = np.random.default_rng(0)
    >>> params = {"router": rng.normal(size=(D, E)), "w_gate": rng.normal(size=(E, D, F)),
    ...           "w_up": rng.normal(size=(E, D, F)), "w_down": rng.normal(size=(E, F, D))}
    >>> with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    ...   sel = fs.parallel.exchange_selection((8, 16, D), params, k=2, exchange="all_gather")
    >>> sel.exchange, sel.expert_axis, sel.expert_shards, sel.token_axes
    ('all_gather', 'expert', 4, ('data', 'expert'))
  """
  exchange: str
  grouped_matmul: str
  requested: str
  reason: str
  fallback: bool
  platform: str
  interpret: bool
  expert_axis: str | None
  expert_shards: int
  token_axes: tuple[str, ...]
  tensor_axes: tuple[str, ...]
  buffer_rows: int
  fsdp_axes: tuple[str, ...] = ()


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


# ----------------------------------------------------------------------------- routing


def route(x: jax.Array, router: jax.Array, k: int, *, normalize: bool = True) -> Routing:
  """Top-k routing in float32.

  Args:
    x: [T, D] tokens (any float dtype; cast to float32).
    router: [D, E] router weights.
    k: experts per token, 1 <= k <= E.
    normalize: renormalise the k weights to sum to 1 (Mixtral); False keeps the softmax
      probabilities (DeepSeek-V2, Switch).

  Returns:
    A `Routing`.

  Examples:
    >>> import fnscale as fs, jax, numpy as np
    >>> router = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])  # [D=2, E=3]
    >>> route = jax.jit(fs.parallel.route, static_argnames=("k", "normalize"))
    >>> r = route(np.array([[1.0, 0.0], [0.0, 1.0]]), router, k=2, normalize=False)
    >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
    ([[0, 1], [1, 0]], [0.665, 0.245])
  """
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(logits, probs, experts.astype(jnp.int32), weights)


def capacity(capacity_factor: float, seq: int, k: int, num_experts: int) -> int:
  """Token copies each expert takes per sequence: ceil(capacity_factor x seq x k /
  experts), at least 1 (GShard's expert capacity per group, a group being a sequence).

  Examples:
    >>> import fnscale as fs
    >>> fs.parallel.capacity(1.25, seq=512, k=2, num_experts=8)  # 1.25 x 512 x 2 / 8
    160
  """
  return max(1, math.ceil(capacity_factor * seq * k / num_experts - 1e-9))


# ----------------------------------------------------------------------------- checks


class _Shapes(NamedTuple):
  batch: int
  seq: int
  d_model: int
  experts: int
  d_ff: int


def _check(x, params, k, capacity_factor) -> _Shapes:
  """Shapes of a call; ExpertError on anything that can't work (before tracing)."""
  if not isinstance(params, Mapping) or any(key not in params for key in _PARAM_KEYS):
    raise ExpertError(
        f"moe: params is {_tree.got(params)}; expected a mapping with keys {_PARAM_KEYS} "
        "(router [d_model, experts], w_gate and w_up [experts, d_model, d_ff], w_down "
        "[experts, d_ff, d_model]).")
  if jnp.ndim(x) != 3:
    raise ExpertError(f"moe: x has shape {jnp.shape(x)}; expected [batch, seq, d_model].")
  b, s, d = jnp.shape(x)
  shapes = {key: tuple(jnp.shape(params[key])) for key in _PARAM_KEYS}
  e = shapes["router"][-1] if len(shapes["router"]) == 2 else -1
  f = shapes["w_gate"][-1] if len(shapes["w_gate"]) == 3 else -1
  want = {"router": (d, e), "w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
  bad = [key for key in _PARAM_KEYS if shapes[key] != want[key]]
  if bad or e < 1:
    raise ExpertError(
        f"moe: params shapes {shapes} don't fit x {tuple(jnp.shape(x))}; expected router "
        f"[d_model, E], w_gate and w_up [E, d_model, F], w_down [E, F, d_model] with "
        f"d_model {d} (mismatched: {bad}).")
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= e:
    raise ExpertError(f"moe: k={k!r} experts per token with {e} experts; expected an int in "
                      f"[1, {e}]; fix: lower k or add experts.")
  if capacity_factor is not None and (
      isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
      or not math.isfinite(capacity_factor) or capacity_factor <= 0):
    raise ExpertError(
        f"moe: capacity_factor={capacity_factor!r}; expected a number > 0 (1.0 is each "
        "expert's balanced share, 1.25 a common choice) or None for the dropless layer.")
  return _Shapes(b, s, d, e, f)


def _free_axes(mesh) -> list[str]:
  """Axes of `mesh` of size > 1 that are not already manual (an enclosing shard_map)."""
  manual = set(getattr(getattr(mesh, "abstract_mesh", mesh), "manual_axes", ()))
  return [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]


def _layout(mesh, expert_axis, sh: _Shapes, capacity_path: bool):
  """(expert axis or None, its size, token axes, tensor axes, fsdp axes) of a call; errors
  on a mesh that doesn't fit."""
  if mesh is None or mesh.empty:
    if expert_axis is not None:
      raise MeshError(f"moe(expert_axis={expert_axis!r}): there is no mesh; fix: call it "
                      "under fnscale.with_mesh / jax.set_mesh, or pass mesh= or "
                      "expert_axis=None.")
    return None, 1, (), (), ()
  if expert_axis is not None and expert_axis not in mesh.axis_names:
    raise MeshError(
        f"moe(expert_axis={expert_axis!r}): the mesh (axes {tuple(mesh.axis_names)}) has no "
        f"such axis; fix: add it to the mesh, e.g. fnscale.make_mesh({{'data': -1, "
        f"'{expert_axis}': N}}), or pass expert_axis=None to use the convention's.")
  free = _free_axes(mesh)
  ax = expert_axis if expert_axis is not None else _axes.expert_axis(mesh)
  ax = ax if ax in free else None
  n = mesh.shape[ax] if ax else 1
  if sh.experts % n:
    raise ShardingError(
        f"moe: {sh.experts} experts are not divisible by the expert axis {ax!r} of size {n}; "
        f"fix: use an expert axis size that divides {sh.experts} (e.g. "
        f"{math.gcd(sh.experts, n)}) or a multiple of {n} experts.")
  tokens = tuple(a for a in _axes.data_axes(mesh) if a in free)
  tokens = tokens + ((ax,) if ax and ax not in tokens else ())
  # Context axes split the sequence: their shards hold pieces of every row.
  seq = tuple(a for a in _axes.context_axes(mesh) if a in free and a not in tokens)
  if seq and capacity_path:
    raise ShardingError(
        f"moe(capacity_factor=...) on a mesh whose context axes {seq} split the sequence: "
        "the capacity path keeps a capacity per whole sequence, which no shard holds; fix: "
        "capacity_factor=None (the dropless layer), or a mesh without a context axis.")
  tensor = tuple(a for a in _axes.head_axes(mesh) if a in free and a not in tokens + seq)
  # The dropless layer splits tokens (batch x seq; rows and sequence separately under a
  # context axis); the capacity path whole sequences.
  what, size = (("rows of the batch", sh.batch) if capacity_path or seq else
                ("tokens (batch x seq)", sh.batch * sh.seq))
  for what, axes, size in ((what, tokens, size), ("the sequence", seq, sh.seq),
                           ("the expert hidden width d_ff", tensor, sh.d_ff)):
    ways = math.prod(mesh.shape[a] for a in axes)
    if size % ways:
      raise ShardingError(
          f"moe: {what} ({size}) must be divisible by the mesh axes {axes} ({ways} ways) the "
          f"layer splits it over; fix: a multiple of {ways}, or a mesh with fewer ways.")
  tokens += seq
  fsdp = tuple(a for a in tokens if a != ax and a not in _axes.current().replica)
  if sh.d_model % math.prod(mesh.shape[a] for a in fsdp):
    fsdp = ()
  return ax, n, tokens, tensor, fsdp


# ----------------------------------------------------------------------------- the plan


def _requested(exchange, grouped_matmul, interpret):
  choice = _context.EXPERT_CHOICE.value
  exchange = choice.exchange if exchange == "auto" else exchange
  grouped_matmul = choice.grouped_matmul if grouped_matmul == "auto" else grouped_matmul
  return exchange, grouped_matmul, choice.interpret if interpret is None else bool(interpret)


def _platform(platform, mesh) -> str:
  if platform is None:
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
  platform = platform.lower()
  return "cuda" if platform == "gpu" else platform


def _pick_exchange(requested, dropless, n, platform, interpret) -> tuple[str, str, bool]:
  """(exchange, reason, fallback) for the arguments of `exchange_selection`."""
  if n == 1:
    return "none", "no expert axis of size > 1: every expert is local", False
  if not dropless:
    if requested not in ("auto", "all_to_all"):
      raise KernelError(f"moe(exchange={requested!r}) with a capacity_factor: the capacity "
                        "path exchanges fixed-size buffers; use exchange='all_to_all' or "
                        "'auto'.")
    return "all_to_all", "the capacity path's fixed-size buffers (all_to_all)", False
  ragged_runs = platform in ("tpu", "cuda", "rocm") or interpret
  if requested == "ragged" and not ragged_runs:
    raise KernelError(
        f"moe(exchange='ragged') can't serve this call: XLA:{platform.upper()} has no "
        "ragged-all-to-all (jax#34755); use exchange='gather_experts' (or 'auto'), or "
        "with_experts(..., interpret=True) for its stand-in.")
  if requested == "all_to_all":
    raise KernelError("moe(exchange='all_to_all') is the capacity path's; pass a "
                      "capacity_factor, or use 'ragged' / 'gather_experts' / 'all_gather' for "
                      "a dropless layer.")
  if requested in ("all_gather", "gather_experts"):
    return requested, f"{requested} was requested", False
  if ragged_runs:
    how = " (its all-gather stand-in, interpret mode)" if platform not in (
        "tpu", "cuda", "rocm") else ""
    return "ragged", f"ragged_all_to_all serves this call{how}", False
  return ("gather_experts", f"ragged: XLA:{platform.upper()} has no ragged-all-to-all "
          "(jax#34755); the experts' weights all-gathered, every expert run over the "
          "shard's own tokens (gathering the tokens instead runs the experts over a "
          "worst-case buffer of n x the routed rows)", requested == "auto")


def exchange_selection(x_shape, params_shapes: Mapping[str, Any], k: int, *, dtype=jnp.float32,
                  capacity_factor: float | None = None, expert_axis: str | None = None,
                  exchange: str = "auto", grouped_matmul: str = "auto",
                  interpret: bool | None = None, platform: str | None = None,
                  mesh=None) -> ExchangeSelection:
  """Decides how `moe` runs a call, without running it.

  "auto": no exchange without an expert axis > 1; the capacity path's all_to_all with a
  `capacity_factor`; else "ragged" on TPU and GPU (or anywhere with `interpret`), and
  "gather_experts" where the backend has no ragged all-to-all (a fallback, said in
  `reason`).
  The grouped matmul is `fnscale.kernels.gmm_selection`'s for the buffer (megablox on a TPU,
  ragged_dot on GPUs, tiled elsewhere, unless asked for another).

  Args:
    x_shape: [batch, seq, d_model].
    dtype: x's dtype (the grouped matmul's; the expert weights are cast to it).
    params_shapes: the `moe` params (arrays or anything with `.shape`).
    k, capacity_factor, expert_axis, exchange, grouped_matmul, interpret: as `moe`.
    platform: default the mesh's, else jax's default backend.
    mesh: default the context mesh (`jax.sharding.get_abstract_mesh()`).

  Returns:
    An `ExchangeSelection`.

  Raises:
    ExpertError, ShardingError, MeshError, KernelError: as `moe`.

  Examples:
    On CPU (no ragged all-to-all) "auto" gathers the experts' weights instead:

    >>> import fnscale as fs, jax, jax.numpy as jnp, numpy as np
    >>> E, D, F = 4, 8, 16  # experts, d_model, expert hidden width
    >>> rng = np.random.default_rng(0)
    >>> params = {"router": rng.normal(size=(D, E)), "w_gate": rng.normal(size=(E, D, F)),
    ...           "w_up": rng.normal(size=(E, D, F)), "w_down": rng.normal(size=(E, F, D))}
    >>> with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    ...   sel = fs.parallel.exchange_selection((8, 16, D), params, k=2)
    >>> sel.exchange, sel.fallback, sel.reason.split(":")[0]
    ('gather_experts', True, 'ragged')
  """
  sh = _check(jax.ShapeDtypeStruct(tuple(x_shape), jnp.float32), params_shapes, k,
              capacity_factor)
  if exchange not in EXCHANGES:
    raise KernelError(f"moe(exchange={exchange!r}): expected one of {EXCHANGES}.")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  ax, n, tokens, tensor, fsdp = _layout(mesh, expert_axis, sh, capacity_factor is not None)
  requested, gmm, interpret = _requested(exchange, grouped_matmul, interpret)
  platform = _platform(platform, None if mesh.empty else mesh)
  name, reason, fallback = _pick_exchange(requested, capacity_factor is None, n, platform,
                                          interpret)
  shards = math.prod(mesh.shape[a] for a in tokens) if tokens else 1
  local = sh.batch * sh.seq // shards
  e_local = sh.experts if name == "gather_experts" else sh.experts // n
  if capacity_factor is not None:
    rows = n * sh.batch // shards * capacity(capacity_factor, sh.seq, k, sh.experts)
    impl = "einsum"
  else:
    rows = {"none": local * k, "gather_experts": local * k,
            "ragged": n * local * min(k, e_local),
            "all_gather": n * local * min(k, e_local)}[name]
    f_local = sh.d_ff // (math.prod(mesh.shape[a] for a in tensor) if tensor else 1)
    g = gmm_selection((rows, sh.d_model), (e_local, sh.d_model, f_local), dtype,
                 implementation=gmm, platform=platform, interpret=interpret)
    impl, reason = g.implementation, f"{reason}; grouped matmul: {g.reason}"
  return ExchangeSelection(name, impl, requested, reason, fallback, platform, interpret,
                           ax if n > 1 else None, n, tokens, tensor, rows, fsdp)


# ----------------------------------------------------------------------------- helpers


@jax.custom_vjp
def _permute_rows(x, order, inverse):
  """x[order] for a permutation `order` (`inverse` its inverse): its gradient is a gather
  by the inverse, not a scatter-add (scatters are slow on accelerators)."""
  return x[order]


def _permute_fwd(x, order, inverse):
  return x[order], (order, inverse)


def _permute_bwd(res, g):
  order, inverse = res
  return g[inverse], None, None


_permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _permute(x, order, inverse):
  """`_permute_rows` with forward-mode autodiff (the plain gather's JVP)."""
  return _autodiff.reverse_only(_permute_rows, lambda x, order, _: x[order], _NAME,
                                _FORWARD)(x, order, inverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_rows(x, order, inverse, k: int):
  """x[order // k]: token copies in sorted order (copy i of token t is row t k + i before the
  sort), without materialising the k copies; the gradient sums each token's k copies'
  cotangents, a gather by the inverse and a sum (no scatter-add)."""
  return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
  return x[order // k], inverse


def _dispatch_bwd(k, inverse, g):
  return g[inverse].reshape(-1, k, g.shape[-1]).sum(1), None, None


_dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


def _dispatch(x, order, inverse, k: int):
  """`_dispatch_rows` with forward-mode autodiff (the plain gather's JVP)."""
  return _autodiff.reverse_only(lambda x, o, i: _dispatch_rows(x, o, i, k),
                                lambda x, o, _: x[o // k], _NAME, _FORWARD)(x, order, inverse)


def _sort(keys):
  """(stable order sorting `keys`, its inverse)."""
  order = jnp.argsort(keys, stable=True)
  return order, jnp.argsort(order, stable=True)


def _psum(x, axes):
  return jax.lax.psum(x, axes) if axes else x


@jax.custom_jvp
def _padding_without_gradient(x, rows):
  """x, whose rows where `rows` is False get no tangent (nor cotangent): no copy of x."""
  del rows
  return x


@_padding_without_gradient.defjvp
def _padding_without_gradient_jvp(primals, tangents):
  x, rows = primals
  return x, jnp.where(rows, tangents[0], jnp.zeros((), tangents[0].dtype))


def _ffn(xs, w, group_sizes, gmm, tensor):
  """SwiGLU experts over sorted rows: silu(x Wg) * (x Wu) Wd, rows past the groups zero.
  With `tensor` axes the hidden width is split: the down projection's partial sums are
  all-reduced over them. The padding rows are zeroed once, in the output and in the
  input's gradient, not after each grouped matmul (which megablox leaves unwritten there):
  without a mask in them XLA's fused backward of silu and the product writes its results
  over its operands' buffers."""
  rows = (jnp.arange(xs.shape[0]) < jnp.sum(group_sizes))[:, None]
  mm = functools.partial(grouped_matmul, group_sizes=group_sizes,
                         implementation=gmm.implementation, interpret=gmm.interpret,
                         platform=gmm.platform, zero_padding=False)
  xs = _padding_without_gradient(xs, rows)
  h = jax.nn.silu(mm(xs, w["w_gate"])) * mm(xs, w["w_up"])
  y = _psum(mm(h, w["w_down"]), tensor)
  return jnp.where(rows, y, jnp.zeros((), y.dtype))


def _combine(y, weights):
  """[T * k, D] expert outputs in token order -> [T, D], weighted: the product in y's dtype,
  summed in float32 (a product and a sum, not a matmul: no FLOPs beyond the model's 6 x
  active params are counted)."""
  t, k = weights.shape
  y = y.reshape(t, k, -1) * weights[..., None].astype(y.dtype)
  return jnp.sum(y, axis=1, dtype=jnp.float32)


class _Gmm(NamedTuple):
  """The grouped matmul's choice (`fnscale.kernels.gmm_selection`'s fields it runs with)."""
  implementation: str
  interpret: bool
  platform: str


class _Ctx(NamedTuple):
  """Static facts of one call inside the shard_map body."""
  k: int
  experts: int
  ax: str | None  # the expert axis (None: experts not split)
  n: int  # its size
  tokens: tuple[str, ...]  # axes splitting the tokens
  shards: int  # ways they split them
  tensor: tuple[str, ...]  # axes splitting each expert's hidden width
  fsdp: tuple[str, ...]  # axes the weights' d_model is stored split over (FSDP)
  exchange: str
  gmm: _Gmm
  interpret: bool
  cap: int | None  # capacity per expert per sequence (None: dropless)


# ----------------------------------------------------------------------------- dropless


def _local(x, r: Routing, w, c: _Ctx):
  """Every expert on this device: sort copies by expert, grouped matmuls, unsort."""
  flat = r.experts.reshape(-1)
  order, inverse = _sort(flat)
  xs = _dispatch(x, order, inverse, c.k)
  sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
  ys = _ffn(xs, w, sizes, c.gmm, c.tensor)
  return _combine(_permute(ys, inverse, order), r.weights)


def _exclusive_cumsum(v, axis=0):
  return jnp.cumsum(v, axis=axis) - v


def _ragged_exchange(operand, output, offsets, sizes, out_offsets, recv, c: _Ctx):
  """`jax.lax.ragged_all_to_all` over the expert axis, or its stand-in with `interpret`."""
  if not c.interpret or c.gmm.platform in ("tpu", "cuda", "rocm"):
    return jax.lax.ragged_all_to_all(operand, output, offsets, sizes, out_offsets, recv,
                                     axis_name=c.ax)
  # The stand-in: every shard's operand gathered, each sender's slice placed where
  # ragged_all_to_all would write it (its `output_offsets` as seen by the receiver).
  everything = jax.lax.all_gather(operand, c.ax)
  from_offsets = jax.lax.all_to_all(offsets, c.ax, 0, 0, tiled=True)
  to_offsets = jax.lax.all_to_all(out_offsets, c.ax, 0, 0, tiled=True)
  rows = jnp.arange(output.shape[0])
  for s in range(c.n):
    inside = (rows >= to_offsets[s]) & (rows < to_offsets[s] + recv[s])
    src = jnp.clip(from_offsets[s] + rows - to_offsets[s], 0, operand.shape[0] - 1)
    output = jnp.where(inside[:, None], everything[s][src], output)
  return output


class _Slices(NamedTuple):
  """One ragged exchange's slices (`jax.lax.ragged_all_to_all`'s arguments), int32 [n]:
  where each destination's rows start in the operand, how many, where they land in the
  destination's buffer, and how many rows arrive from each source."""
  offsets: jax.Array
  sizes: jax.Array
  out_offsets: jax.Array
  recv: jax.Array




def _vary_over(x, axes):
  """x marked varying over the manual `axes` (where it isn't yet)."""
  missing = tuple(a for a in axes if a not in _compat.varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _exchange(c: _Ctx, rows: int, x, there: _Slices):
  """x's slices sent per `there` into [rows, D] buffers (typed as varying over the token
  axes, which they do: an invariant buffer would make the layer's gradients all-reduce
  their cotangents over the expert axis)."""
  return _vary_over(_ragged_exchange(x, _vary_over(jnp.zeros((rows, x.shape[1]), x.dtype),
                                                   c.tokens), *there, c), c.tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_rows(c: _Ctx, rows: int, x, there: _Slices, back: _Slices):
  """x's slices sent per `there` into [rows, D] buffers; the gradient returns by `back`
  (the same rows the other way), one ragged all-to-all each way (jax's own transpose would
  all-reduce the zero buffer's cotangent over the expert axis)."""
  del back  # the way back, for the gradient
  return _exchange(c, rows, x, there)


def _send_fwd(c, rows, x, there, back):
  return _exchange(c, rows, x, there), (x.shape[0], back)


def _send_bwd(c, rows, res, g):
  del rows
  size, back = res
  g = _ragged_exchange(g, _vary_over(jnp.zeros((size, g.shape[1]), g.dtype), c.tokens),
                       *back, c)
  return _vary_over(g, c.tokens), None, None  # x's type: varying over the token axes


_send_rows.defvjp(_send_fwd, _send_bwd)


def _send(c: _Ctx, rows: int, x, there: _Slices, back: _Slices):
  """`_send_rows` with forward-mode autodiff (the exchange's own JVP)."""
  return _autodiff.reverse_only(lambda x, t, b: _send_rows(c, rows, x, t, b),
                                lambda x, t, _: _exchange(c, rows, x, t), _NAME,
                                _FORWARD)(x, there, back)


def _ragged(x, r: Routing, w, c: _Ctx):
  """Dropless over the expert axis by ragged all-to-all: each shard sends its copies,
  sorted by expert, to the shards holding their experts and gets their outputs back."""
  e_local, me = c.experts // c.n, jax.lax.axis_index(c.ax)
  flat = r.experts.reshape(-1)
  order, inverse = _sort(flat)
  xs = _dispatch(x, order, inverse, c.k)
  sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
  every = jax.lax.all_gather(sizes, c.ax)  # [n, E]: what each shard routes to each expert
  sent = every.reshape(c.n, c.n, e_local).sum(-1)  # sent[s, j]: rows shard s sends shard j
  go = _Slices(_exclusive_cumsum(sent[me]), sent[me], _exclusive_cumsum(sent, 0)[me],
               sent[:, me])
  ret = _Slices(_exclusive_cumsum(sent[:, me]), sent[:, me],
                _exclusive_cumsum(sent, 1)[:, me], sent[me])
  buffer = c.n * x.shape[0] * min(c.k, e_local)
  got = _send(c, buffer, xs, go, ret)
  # Received: from each source in turn, its rows for my experts, by local expert.
  local = jax.lax.dynamic_slice_in_dim(every, me * e_local, e_local, axis=1)  # [n, E_l]
  keys = jnp.repeat(jnp.tile(jnp.arange(e_local), c.n), local.reshape(-1),
                    total_repeat_length=buffer)
  keys = jnp.where(jnp.arange(buffer) < jnp.sum(local), keys, e_local)
  lorder, linverse = _sort(keys)
  ys = _ffn(_permute(got, lorder, linverse), w, local.sum(0).astype(jnp.int32), c.gmm,
            c.tensor)
  back = _send(c, xs.shape[0], _permute(ys, linverse, lorder), ret, go)
  return _combine(_permute(back, inverse, order), r.weights)


def _gathered(x, r: Routing, w, c: _Ctx):
  """Dropless over the expert axis by all-gather: each shard runs its experts over the
  copies its group routed to them; a reduce-scatter sums each token's outputs home."""
  e_local, me = c.experts // c.n, jax.lax.axis_index(c.ax)
  xg = jax.lax.all_gather(x, c.ax, tiled=True)
  eg = jax.lax.all_gather(r.experts, c.ax, tiled=True).reshape(-1)
  wg = jax.lax.all_gather(r.weights, c.ax, tiled=True)
  keys = jnp.where(eg // e_local == me, eg % e_local, e_local)
  order, inverse = _sort(keys)
  rows = xg.shape[0] * min(c.k, e_local)  # every copy for my experts sorts first
  xs = _dispatch(xg, order, inverse, c.k)[:rows]
  sizes = jnp.bincount(keys, length=e_local + 1)[:e_local].astype(jnp.int32)
  ys = _ffn(xs, w, sizes, c.gmm, c.tensor)
  ys = jnp.pad(ys, ((0, eg.shape[0] - rows), (0, 0)))
  out = _combine(_permute(ys, inverse, order), wg)
  return jax.lax.psum_scatter(out, c.ax, scatter_dimension=0, tiled=True)


# ----------------------------------------------------------------------------- capacity


def _positions(experts, seq: int, num_experts: int):
  """1-based position of each token copy in its expert's queue within its sequence, in
  token order (copies of one token in choice order). experts: [rows * seq, k]."""
  rows = experts.shape[0] // seq
  onehot = jax.nn.one_hot(experts.reshape(rows, -1), num_experts, dtype=jnp.int32)
  pos = jnp.cumsum(onehot, axis=1) * onehot  # [rows, seq * k, E]
  return pos.sum(-1).reshape(experts.shape)


def _capacity(x, r: Routing, w, c: _Ctx, seq: int):
  """Capacity path: copies past an expert's capacity per sequence are dropped; experts run
  as a batched matmul over [experts, rows x capacity] buffers, exchanged by all_to_all."""
  t, d = x.shape
  rows = t // seq
  pos = _positions(r.experts, seq, c.experts)
  kept = pos <= c.cap
  slot = (jnp.arange(t)[:, None] // seq) * c.cap + pos - 1  # [T, k]
  slot = jnp.where(kept, slot, rows * c.cap)  # out of range: dropped by the scatter
  xs = jnp.zeros((c.experts, rows * c.cap, d), x.dtype)
  xs = xs.at[r.experts, slot].set(jnp.broadcast_to(x[:, None], (t, c.k, d)), mode="drop")
  if c.n > 1:  # [E, S, D] -> [E_l, n * S, D]: my experts' slots from every shard
    xs = jax.lax.all_to_all(xs, c.ax, 0, 1, tiled=True)
  h = jax.nn.silu(jnp.einsum("esd,edf->esf", xs, w["w_gate"])) * jnp.einsum(
      "esd,edf->esf", xs, w["w_up"])
  ys = _psum(jnp.einsum("esf,efd->esd", h, w["w_down"]), c.tensor)
  if c.n > 1:
    ys = jax.lax.all_to_all(ys, c.ax, 1, 0, tiled=True)
  y = ys.at[r.experts, slot].get(mode="fill", fill_value=0)  # [T, k, D]
  out = _combine(y.reshape(t * c.k, d), r.weights * kept)
  return out, jnp.sum(~kept).astype(jnp.int32)


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


def _body(flat, params, *, c: _Ctx, seq: int, normalize: bool):
  """The layer on one shard: tokens [T, D] (whole sequences of `seq` on the capacity path)
  -> ([T, D], MoEAux)."""
  w = _gathered_weights(params, c, flat.dtype)
  r = route(flat, w.pop("router"), c.k, normalize=normalize)
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
        expert_axis: str | None = None, exchange: str = "auto",
        grouped_matmul: str = "auto", interpret: bool | None = None,
        mesh=None) -> tuple[jax.Array, MoEAux]:
  """A mixture-of-experts SwiGLU feed-forward (see the module docstring).

  out[t] = sum over t's top-k experts e of weight[t, e] x (silu(x Wg_e) * (x Wu_e)) Wd_e.

  Args:
    x: [batch, seq, d_model] in the compute dtype (the experts' weights are cast to it).
    params: {"router": [d_model, E], "w_gate": [E, d_model, F], "w_up": [E, d_model, F],
      "w_down": [E, F, d_model]}; under a mesh give the expert weights logical axes that
      put E on the expert axis (e.g. a rule ("experts", "expert")), or the layer's
      shard_map moves them there.
    k: experts per token, 1 <= k <= E.
    capacity_factor: None for the dropless layer; a number > 0 for the capacity path
      (`capacity`).
    normalize: renormalise the top-k weights to sum to 1 (Mixtral); False keeps the
      softmax probabilities (DeepSeek-V2).
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
  sh = _check(x, params, k, capacity_factor)
  cap = None if capacity_factor is None else capacity(capacity_factor, sh.seq, k, sh.experts)
  shards = math.prod(mesh.shape[a] for a in plan.token_axes) if plan.token_axes else 1
  c = _Ctx(int(k), sh.experts, plan.expert_axis, plan.expert_shards, plan.token_axes, shards,
           plan.tensor_axes, plan.fsdp_axes, plan.exchange,
           _Gmm(plan.grouped_matmul, plan.interpret, plan.platform), plan.interpret, cap)
  body = functools.partial(_body, c=c, seq=sh.seq, normalize=normalize)
  flat = jnp.reshape(x, (sh.batch * sh.seq, sh.d_model))  # batch-major: rows stay whole
  with jax.named_scope(SCOPE):
    if not (c.tokens or c.tensor or c.ax):
      out, aux = body(flat, params)
    else:
      ex, tp, fs = c.ax, _tree.spec_entry(c.tensor), _tree.spec_entry(c.fsdp)
      specs = {"router": P(fs, None), "w_gate": P(ex, fs, tp), "w_up": P(ex, fs, tp),
               "w_down": P(ex, tp, fs)}
      seq = tuple(a for a in c.tokens if a in _axes.context_axes(mesh))
      rows = _tree.spec_entry(tuple(a for a in c.tokens if a not in seq))
      # A sequence split over context axes: each shard flattens its own rows' pieces.
      xspec = P(rows, _tree.spec_entry(seq), None) if seq else P(_tree.spec_entry(c.tokens), None)
      in_specs = (xspec, {key: specs[key] for key in _PARAM_KEYS})
      args = (x if seq else flat, {key: params[key] for key in _PARAM_KEYS})
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
