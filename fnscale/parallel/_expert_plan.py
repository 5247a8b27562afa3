"""How `moe` runs a call, decided before tracing: its shapes checked, the mesh axes that split
tokens, experts and their hidden width, the exchange over the expert axis and the grouped
matmul (`exchange_selection`, an `ExchangeSelection`), and the capacity path's `capacity`."""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _axes
from fnscale import _context
from fnscale import _tree
from fnscale._errors import ExpertError, KernelError, MeshError, ShardingError
from fnscale.kernels._grouped_matmul import gmm_selection
from fnscale.parallel._expert_routing import SCORES


EXCHANGES = ("auto", "ragged", "gather_experts", "all_gather", "all_to_all")
_PARAM_KEYS = ("router", "w_gate", "w_up", "w_down")


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


def _check_scoring(scoring, e: int, params) -> None:
  """ExpertError naming a `Scoring` or a `router_bias` that can't route `e` experts."""
  g = scoring.groups
  if scoring.score not in SCORES or not (isinstance(g, int) and g >= 1 and e % g == 0) or not (
      0 <= scoring.topk_groups <= g):
    raise ExpertError(
        f"moe: scoring={scoring!r} for {e} experts; expected score in {SCORES}, groups an "
        "int >= 1 dividing the experts, 0 <= topk_groups <= groups; fix: e.g. "
        "Scoring('sigmoid', groups=8, topk_groups=4) for 256 experts.")
  bias = params.get("router_bias")
  if bias is not None and tuple(jnp.shape(bias)) != (e,):
    raise ExpertError(f"moe: router_bias has shape {tuple(jnp.shape(bias))}; expected [{e}], "
                      "one selection bias per expert.")


class _Shapes(NamedTuple):
  batch: int
  seq: int
  d_model: int
  experts: int
  d_ff: int


def _check(x, params, k, capacity_factor, scoring=None) -> _Shapes:
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
  if scoring is not None:
    _check_scoring(scoring, e, params)
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
