"""The mixture-of-experts layer against a float32 per-expert loop (one-hot einsums over
every expert) and a numpy oracle of which token copies a capacity drops; its exchanges on
meshes with an expert axis; its errors."""
import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import fnscale as fs
from fnscale.parallel import _expert_exchange as exchange_lib

B, S, D, E, F = 8, 4, 8, 8, 16
EMPTY, TIE = 7, (2, 3)  # expert 7 gets no token; experts 2 and 3 tie on every token


def _params(key=0):
  ks = jax.random.split(jax.random.key(key), 5)
  router = np.array(jax.random.normal(ks[0], (D, E)))
  router[:, TIE[1]] = router[:, TIE[0]]  # identical logits: the lower index wins the tie
  router[:, EMPTY] = 0.0
  router[0, EMPTY] = -50.0  # feature 0 is 1 on every token: expert 7's logit is -50
  scale = lambda k, shape: 0.4 * jax.random.normal(k, shape)
  return {"router": jnp.asarray(router), "w_gate": scale(ks[1], (E, D, F)),
          "w_up": scale(ks[2], (E, D, F)), "w_down": scale(ks[3], (E, F, D))}


def _tokens(key=1):
  x = np.array(jax.random.normal(jax.random.key(key), (B, S, D)))
  x[..., 0] = 1.0
  return jnp.asarray(x)


def _top(x, params, k):
  """The reference's routing, numpy float64: each token's k experts, most probable first
  (a stable sort: ties to the lower index), and its probabilities."""
  logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(params["router"], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
  return top, probs


def _reference(x, params, top, kept):
  """(out, (balance, z)) by a loop over every expert (one-hot einsums), float32,
  differentiable in x and params for the fixed routing `top` [T, k]; `kept` [T, k] (1 or 0)
  masks dropped copies."""
  t = x.reshape(-1, D)
  logits = jnp.dot(t, params["router"], precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  w = jnp.take_along_axis(probs, top, axis=-1)
  w = w / w.sum(-1, keepdims=True) * kept
  gate = jnp.einsum("tk,tke->te", w, jax.nn.one_hot(top, E))
  out = jnp.zeros_like(t)
  for e in range(E):
    h = jax.nn.silu(t @ params["w_gate"][e]) * (t @ params["w_up"][e])
    out = out + gate[:, e:e + 1] * (h @ params["w_down"][e])
  counts = jax.nn.one_hot(top, E).sum((0, 1))
  balance = E * jnp.sum(counts / top.size * probs.mean(0))
  z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  return out.reshape(x.shape), (balance, z)


def _objective(out, balance, z, cot):
  return jnp.sum(out * cot) + 0.3 * balance + 0.1 * z


@jax.jit
def _reference_grads(x, params, top, kept, cot):
  def f(x, params):
    out, (balance, z) = _reference(x, params, top, kept)
    return _objective(out, balance, z, cot), (out, balance, z)
  return jax.value_and_grad(f, (0, 1), has_aux=True)(x, params)


@pytest.fixture(scope="module")
def case():
  x, params = _tokens(), _params()
  cot = jax.random.normal(jax.random.key(2), (B, S, D))
  top, probs = _top(x, params, 2)
  # The data's routing is what the tests say it is, and no near-tie can flip a choice.
  assert not np.any(top == EMPTY) and np.any(top[:, 0] == TIE[0])
  assert np.all(top[top[:, 0] == TIE[0], 1] == TIE[1])
  ordered = -np.sort(-probs, axis=-1)
  tied = probs[:, TIE[0]] == probs[:, TIE[1]]
  assert tied.all()
  for k in (1, 2):  # a choice at the k-th place is clear, or it is the exact tie
    clear = (ordered[:, k - 1] - ordered[:, k]) > 1e-3 * ordered[:, k - 1]
    assert np.all(clear | (ordered[:, k] == probs[:, TIE[0]]))
  assert np.any(ordered[:, 2] == probs[:, TIE[0]])  # a tie at the k = 2 boundary too
  return x, params, cot


def _want(x, params, cot, k=2, kept=None):
  top, _ = _top(x, params, k)
  kept = np.ones(top.shape, np.float32) if kept is None else kept
  (_, (out, balance, z)), grads = _reference_grads(x, params, top, kept, cot)
  return out, balance, z, np.bincount(top.reshape(-1), minlength=E), grads


@pytest.fixture(scope="module")
def want(case):
  """The reference's (out, balance, z, counts, grads) of the dropless layer, per k."""
  return {k: _want(*case, k) for k in (1, 2)}


def _got(x, params, cot, mesh=None, **kw):
  """The layer's (out, aux) and gradients, compiled once under `mesh` (None: one device)."""
  def f(x, params):
    out, aux = fs.parallel.moe(x, params, **kw)
    return _objective(out, aux.load_balance_loss, aux.router_z_loss, cot), (out, aux)
  step = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))
  with fs.with_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    (_, (out, aux)), grads = step(x, params)
  return out, aux, grads


def _assert_close(got, want, atol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def _check_dropless(case, want, k=2, mesh=None, **kw):
  x, params, cot = case
  out, balance, z, counts, grads = want[k]
  got_out, aux, got_grads = _got(x, params, cot, mesh, k=k, **kw)
  _assert_close(got_out, out)
  _assert_close(got_grads, grads)
  np.testing.assert_allclose(float(aux.load_balance_loss), float(balance), rtol=1e-6)
  np.testing.assert_allclose(float(aux.router_z_loss), float(z), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), counts)
  assert int(aux.dropped) == 0 and counts[EMPTY] == 0


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_on_one_device_equals_the_loop_over_experts(case, want, k):
  _check_dropless(case, want, k)


# Each mesh runs an exchange XLA:CPU can ("gather_experts", "all_gather") or the ragged one
# through its stand-in (interpret); the other pairings are in the slow tier.
_MESHES = [({"expert": 8}, "ragged"), ({"data": 2, "expert": 4}, "gather_experts"),
           ({"fsdp": 2, "expert": 4}, "all_gather")]
_SLOW_MESHES = [({"expert": 8}, "all_gather"), ({"data": 2, "expert": 4}, "ragged"),
                ({"fsdp": 2, "expert": 4}, "gather_experts"), ({"expert": 8}, "gather_experts"),
                ({"data": 2, "expert": 4}, "all_gather"), ({"fsdp": 2, "expert": 4}, "ragged")]


@pytest.mark.parametrize("axes,exchange", _MESHES + [
    pytest.param(*m, marks=pytest.mark.slow) for m in _SLOW_MESHES])
def test_dropless_over_the_expert_axis_equals_the_loop(case, want, axes, exchange):
  mesh = fs.make_mesh(axes)
  assert fs.parallel.exchange_selection((B, S, D), case[1], 2, exchange=exchange, interpret=True,
                          mesh=mesh).exchange == exchange
  _check_dropless(case, want, mesh=mesh, exchange=exchange, interpret=exchange == "ragged")


@pytest.mark.slow
def test_dropless_k1_and_tensor_parallel_experts(case, want):
  _check_dropless(case, want, k=1, mesh=fs.make_mesh({"data": 2, "expert": 4}))
  # Each expert's hidden width split over "tensor": its down projection all-reduced.
  _check_dropless(case, want, mesh=fs.make_mesh({"expert": 4, "tensor": 2}),
                  exchange="ragged", interpret=True)


@pytest.mark.slow
@pytest.mark.hlo_unread_loops  # Pallas interpret mode: loops over the kernel's grid
def test_megablox_in_interpret_mode_equals_the_loop(case, want):
  _check_dropless(case, want, mesh=fs.make_mesh({"data": 2, "expert": 4}), exchange="ragged",
                  grouped_matmul="megablox", interpret=True)


def _oracle_drops(top, seq, cap, choice_major=False):
  """Which copies a capacity of `cap` per expert per sequence keeps, in token order (a
  token's first choice before its second; `choice_major`: every first choice of the
  sequence before any second), by a plain loop."""
  kept = np.zeros(top.shape, bool)
  for start in range(0, top.shape[0], seq):
    taken = np.zeros(E, int)
    order = [(t, j) for t in range(start, start + seq) for j in range(top.shape[1])]
    for t, j in sorted(order, key=lambda tj: tj[::-1]) if choice_major else order:
      taken[top[t, j]] += 1
      kept[t, j] = taken[top[t, j]] <= cap
  return kept


@pytest.mark.parametrize("axes", [None, {"data": 2, "expert": 4}])
def test_capacity_drops_what_the_oracle_drops(case, axes):
  x, params, cot = case
  top, _ = _top(x, params, 2)
  cap = fs.parallel.capacity(1.0, S, 2, E)
  assert cap == 1  # 4 tokens x 2 copies over 8 experts, factor 1
  kept = _oracle_drops(top, S, cap)
  assert 0 < (~kept).sum() < kept.size  # some dropped, some kept
  # Negative control: choice-major priority (every first choice of a sequence before any
  # second) keeps other copies, so the test tells the two orders apart.
  assert (_oracle_drops(top, S, cap, choice_major=True) != kept).any()
  out, _, _, counts, grads = _want(x, params, cot, kept=kept.astype(np.float32))
  got_out, aux, got_grads = _got(x, params, cot, fs.make_mesh(axes) if axes else None, k=2,
                                 capacity_factor=1.0)
  _assert_close(got_out, out)
  _assert_close(got_grads, grads)
  assert int(aux.dropped) == int((~kept).sum())
  np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), counts)


def test_a_large_capacity_drops_nothing(case, want):
  x, params, _ = case
  out, aux = jax.jit(functools.partial(fs.parallel.moe, k=2, capacity_factor=float(E)))(x, params)
  _assert_close(out, want[2][0])
  assert int(aux.dropped) == 0


def test_the_plan_says_why(case):
  params = case[1]
  cpu = fs.parallel.exchange_selection((B, S, D), params, 2,
                                       mesh=fs.make_mesh({"data": 2, "expert": 4}))
  assert (cpu.exchange, cpu.fallback, cpu.expert_axis, cpu.expert_shards) == (
      "gather_experts", True, "expert", 4)
  assert "ragged-all-to-all" in cpu.reason and cpu.token_axes == ("data", "expert")
  assert cpu.buffer_rows == (B * S // 8) * 2  # local tokens x k: every expert local
  tokens = fs.parallel.exchange_selection((B, S, D), params, 2, exchange="all_gather",
                                 mesh=fs.make_mesh({"data": 2, "expert": 4}))
  assert tokens.buffer_rows == 4 * (B * S // 8) * 2  # n x local tokens x min(k, local experts)
  tpu = fs.parallel.exchange_selection((B, S, D), params, 2, platform="tpu",
                         mesh=fs.make_mesh({"data": 2, "expert": 4}))
  assert tpu.exchange == "ragged" and not tpu.fallback
  chosen = fs.parallel.with_experts(lambda: fs.parallel.exchange_selection(
      (B, S, D), params, 2, platform="tpu", mesh=fs.make_mesh({"expert": 8})),
      exchange="all_gather")()
  assert chosen.exchange == "all_gather" and chosen.requested == "all_gather"
  local = fs.parallel.exchange_selection((B, S, D), params, 2)
  assert local.exchange == "none" and local.grouped_matmul == "tiled"  # XLA:CPU
  assert "no ragged-dot" in local.reason
  capped = fs.parallel.exchange_selection((B, S, D), params, 2, capacity_factor=1.25,
                            mesh=fs.make_mesh({"expert": 8}))
  assert capped.exchange == "all_to_all" and capped.grouped_matmul == "einsum"


@pytest.mark.parametrize("implementation", ["tiled", "ragged_dot"])
def test_grouped_matmuls_equal_a_loop_over_groups(implementation):
  # Groups of every size (empty ones, one spanning tiles), rows past the groups zero.
  rng = np.random.default_rng(0)
  sizes = np.array([0, 3, 0, 150, 1, 0, 40], np.int32)
  x = rng.normal(size=(200, 8)).astype(np.float32)
  w = rng.normal(size=(7, 8, 5)).astype(np.float32)
  want = np.zeros((200, 5), np.float32)
  for g, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
    want[lo:hi] = x[lo:hi] @ w[g]
  got = fs.kernels.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes),
                                  implementation=implementation)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  # Its weight gradient: each group's rows against the cotangent, nothing from the others.
  cot = rng.normal(size=(200, 5)).astype(np.float32)
  dw = jax.grad(lambda w: jnp.sum(fs.kernels.grouped_matmul(
      jnp.asarray(x), w, jnp.asarray(sizes), implementation=implementation) * cot))(
          jnp.asarray(w))
  lo = np.cumsum(sizes) - sizes
  for g in range(7):
    rows = slice(lo[g], lo[g] + sizes[g])
    np.testing.assert_allclose(np.asarray(dw[g]), x[rows].T @ cot[rows], atol=1e-4)


def test_bad_input_names_the_fix(case):
  x, params, _ = case
  with pytest.raises(fs.ShardingError, match="not divisible by the expert axis"):
    fs.parallel.exchange_selection((B, S, D), {**params, "router": jnp.zeros((D, 6)),
                                 "w_gate": jnp.zeros((6, D, F)), "w_up": jnp.zeros((6, D, F)),
                                 "w_down": jnp.zeros((6, F, D))}, 2,
                     mesh=fs.make_mesh({"data": 2, "expert": 4}))
  with pytest.raises(fs.ExpertError, match=r"k=9 .* fix: lower k"):
    fs.parallel.moe(x, params, k=9)
  for bad in (0, -1.0, float("nan")):
    with pytest.raises(fs.ExpertError, match="capacity_factor"):
      fs.parallel.moe(x, params, k=2, capacity_factor=bad)
  with pytest.raises(fs.MeshError, match="has no such axis.*fix"):
    fs.parallel.moe(x, params, k=2, expert_axis="experts", mesh=fs.make_mesh({"data": 8}))
  with pytest.raises(fs.ExpertError, match="don't fit x"):
    fs.parallel.moe(x, {**params, "w_down": jnp.zeros((E, D, F))}, k=2)
  with pytest.raises(fs.KernelError, match="no ragged-all-to-all"):
    fs.parallel.moe(x, params, k=2, exchange="ragged", mesh=fs.make_mesh({"expert": 8}))
  with pytest.raises(fs.KernelError, match="megablox.*platform tpu"):
    fs.parallel.moe(x, params, k=2, grouped_matmul="megablox")
  with pytest.raises(fs.ShardingError, match=r"tokens \(batch x seq\)"):
    fs.parallel.moe(x[:1, :1], params, k=2, mesh=fs.make_mesh({"data": 2, "expert": 4}))
  with pytest.raises(fs.KernelError, match="exchange"):
    fs.parallel.with_experts(exchange="ring")


def test_padding_rows_pass_no_gradient_either_way():
  # The FFN's input mask: the value is x itself, and the rows past the groups get a zero
  # cotangent (reverse mode) and a zero tangent (forward mode), whatever flows in.
  x = jnp.arange(12.0).reshape(4, 3)
  rows = (jnp.arange(4) < 3)[:, None]
  f = lambda x: exchange_lib._padding_without_gradient(x, rows)  # pylint: disable=protected-access
  np.testing.assert_array_equal(f(x), x)
  ct = jnp.full((4, 3), 2.0)
  want = np.where(np.arange(4)[:, None] < 3, 2.0, 0.0) * np.ones((4, 3))
  np.testing.assert_array_equal(jax.vjp(f, x)[1](ct)[0], want)
  np.testing.assert_array_equal(jax.jvp(f, (x,), (ct,))[1], want)


def _layer_flops(mesh, exchange, x_shape):
  """Matmul FLOPs per device of the layer's forward and backward (`fs.analysis.hlo.summarize`)."""
  from fnscale.analysis import hlo  # pylint: disable=import-outside-toplevel
  params = _params()
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
  f = lambda x, p: jnp.sum(fs.parallel.moe(x, p, k=2, exchange=exchange)[0])
  with fs.with_mesh(mesh):
    text = jax.jit(jax.grad(f, (0, 1))).lower(x, params).compile().as_text()
  return hlo.summarize(text).matmul_flops


@pytest.mark.slow  # the quick tier's time on 2 cores: a quick test checks the same path
def test_an_expert_axis_on_cpu_does_the_matmul_work_of_none():
  # 8 x 64 tokens of d 8 (64 per device), k = 2 of 8 experts, hidden 16; each dot's backward
  # is two dots of its FLOPs: 3 x the forward. Forward, per device, by hand:
  # - router: 2 x 64 tokens x 8 x 8 experts = 8,192;
  # - the experts as the tiled grouped matmul runs them (a static buffer: work items of
  #   8 rows, items = ceil(rows / 8) + groups - 1), three matmuls of 2 x rows x 8 x 16:
  #   data=8 or gather_experts: 128 copies, 8 groups: 16 + 7 = 23 items, 184 rows;
  #   all_gather (tokens): 4 x 64 x min(2, 2) = 512 rows, 2 groups, 128-row items: 4 + 1 =
  #   5 items, 640 rows (n x the rows routed there: 3.5x the work).
  def hand(rows):
    return 3 * (2 * 64 * 8 * 8 + 3 * 2 * rows * 8 * 16)
  shape = (8, 64, D)
  assert _layer_flops(fs.make_mesh({"data": 8}), "auto", shape) == hand(184)
  split = fs.make_mesh({"data": 2, "expert": 4})
  assert _layer_flops(split, "auto", shape) == hand(184)  # gather_experts
  assert _layer_flops(split, "all_gather", shape) == hand(640)


# ------------------------------------------------------------- inside a user's shard_map


@pytest.mark.parametrize("exchange", ["gather_experts",
                                      pytest.param("ragged", marks=pytest.mark.slow)])
def test_the_gradient_inside_a_users_shard_map_equals_one_device_runs(case, exchange):
  # The user's own checked shard_map is manual over "data"; the layer's over "expert" nests
  # in it. The layer sees each data shard's rows (its auxiliaries cover those): the
  # reference runs it on one device per shard and sums.
  x, params, cot = case

  def f(x, p, c):
    out, aux = fs.parallel.moe(x, p, k=2, exchange=exchange, interpret=True)
    return _objective(out, aux.load_balance_loss, aux.router_z_loss, c)
  half = B // 2
  want = jax.jit(jax.grad(lambda x, p: sum(
      f(x[i * half:(i + 1) * half], p, cot[i * half:(i + 1) * half]) for i in range(2)),
      (0, 1)))(x, params)
  step = jax.shard_map(jax.grad(f, (0, 1)), in_specs=(P("data"), P(), P("data")),
                       out_specs=(P("data"), P()), axis_names={"data"})
  # Forward mode too: a directional derivative along the cotangent, summed over the shards.
  along = lambda x, p, c: jax.lax.psum(jax.jvp(lambda x: f(x, p, c), (x,), (c,))[1], "data")
  jvp = jax.shard_map(along, in_specs=(P("data"), P(), P("data")), out_specs=P(),
                      axis_names={"data"})
  with fs.with_mesh(fs.make_mesh({"data": 2, "expert": 4})):
    got, tangent = jax.jit(step)(x, params, cot), jax.jit(jvp)(x, params, cot)
  _assert_close(got, want, atol=1e-4)
  np.testing.assert_allclose(tangent, jnp.sum(want[0] * cot), rtol=1e-4)
