"""Real programs read in full by `fnscale.analysis.hlo.summarize`, in both of XLA's spellings.

Every program the suite compiles (CPU, and TPU ahead of time) is already read as it is
compiled, and a test whose programs hold anything unread fails (tests/conftest.py). Here two
programs are compiled once more with XLA writing its dump file beside them (`xla_dump_to`),
so both spellings are read: `Compiled.as_text()` (get-tuple-element instructions) and the
dump's `*after_optimizations.txt` (tuple elements as `%param#0` since jax 0.12). Both must
read the same, and the counts must match references outside the HLO: PaLM's 6N + attention
FLOPs for the GPT step (no remat, so the program's matmuls are exactly those), the mesh's
fsdp size for the parameter all-gathers, the microbatch and layer counts for the loops. The
TPU programs (splash attention, convolutions, loops without `known_trip_count`) are read in
test_hlo.py.
"""
import functools
import glob
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import optax
import pytest

import fnscale as fs
from fnscale.analysis import hlo
from recipes.lm import gpt

CFG = gpt.model_config("nano", 128)
ROWS = 32


def _texts(compile_fn, dump_dir, options):
  """(as_text, dump text) of one compile; `compile_fn(compiler_options)` -> Compiled."""
  compiled = compile_fn({**options, "xla_dump_to": str(dump_dir)})
  dumps = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
  assert len(dumps) == 1, dumps
  with open(dumps[0]) as f:
    return compiled.as_text(), f.read()


def _gpt_step(mesh_spec, mode="auto", accum=1):
  mesh = fs.make_mesh(mesh_spec)
  opt, la = optax.adamw(1e-3), gpt.logical_axes(CFG)
  with fs.with_mesh(mesh):
    state = fs.init_state(functools.partial(gpt.init_params, CFG), opt, mesh=mesh,
                          rules=gpt.RULES, logical_axes=la, key=jax.random.key(0),
                          abstract=True)
  batch = {k: jax.ShapeDtypeStruct((ROWS, CFG.seq), jnp.int32) for k in ("inputs", "targets")}
  step = fs.train_step(gpt.loss_fn, opt, accum_steps=accum)

  def compile_fn(options):
    with fs.with_mesh(mesh):
      return fs.shard_step(step, mesh, rules=gpt.RULES, logical_axes=la, mode=mode,
                           compiler_options=options).compile(state, batch).compiled
  return compile_fn


def _scan_grad(options):
  # Three tanh layers under lax.scan, data parallel: the gradient has two while loops.
  mesh = fs.make_mesh("data=8")
  rep = NamedSharding(mesh, P())
  params = {"w": jax.ShapeDtypeStruct((3, 32, 32), jnp.float32, sharding=rep),
            "b": jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=rep)}
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data")))

  def loss(p, x):
    h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
    return jnp.sum(jnp.tanh(h @ p["b"]))
  return jax.jit(jax.grad(loss)).lower(params, x).compile(compiler_options=options)


PROGRAMS = {
    # The mesh whose jax 0.10.2 replica groups (`mesh[...], device_ids=(...)`) were misread,
    # with two microbatches: loops around the layer scans.
    "gpt data=2,fsdp=4 accum 2": _gpt_step("data=2,fsdp=4", accum=2),
    "scan grad data=8": _scan_grad,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, default_cpu_codegen):
  out = {}
  for name, compile_fn in PROGRAMS.items():
    as_text, dump = _texts(compile_fn, tmp_path_factory.mktemp("dump"), default_cpu_codegen)
    out[name] = (hlo.summarize(as_text), hlo.summarize(dump), dump)
  return out


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_read_in_full_in_both_spellings(corpus, name):
  text, dump, _ = corpus[name]
  assert text.unread == hlo.Unread(), text.unread
  assert text.kernels == () and text.loops and text.collectives
  assert all(l.trip_count is not None for l in text.loops)
  # The dump is the same module: every figure reads the same.
  assert dump == text


def test_gpt_step_matmul_flops_are_palm_flops(corpus):
  text, _, _ = corpus["gpt data=2,fsdp=4 accum 2"]
  # PaLM's count (fnscale.analysis.model_flops_per_token, a formula of the config): 6 x 114688 matmul params
  # (2 x 12 x 64^2 in blocks + the tied 256 x 64 output layer) + 12 x 2 layers x 64 x 128
  # (attention) = 884736 FLOPs per token; 32 x 128 tokens over 8 devices.
  assert gpt.flops_per_token(CFG) == 6 * 114688 + 12 * 2 * 64 * 128 == 884736
  assert text.matmul_flops == 884736 * ROWS * CFG.seq / 8


def test_fsdp_gathers_run_on_the_fsdp_axis(corpus):
  text, _, _ = corpus["gpt data=2,fsdp=4 accum 2"]
  # The params are sharded over fsdp=4 (embed) and replicated over data: every all-gather
  # runs in groups of 4 and sends 3/4 of what it gathers (all 8 devices would be 7/8).
  assert {n for kind, n, _ in text.groups if kind == "all-gather"} == {4}
  ag = text.collective("all-gather")
  assert ag.bytes_sent == pytest.approx(3 / 4 * ag.bytes)


def test_accumulation_loop_and_dump_tuple_elements(corpus):
  text, _, dump = corpus["gpt data=2,fsdp=4 accum 2"]
  # Two microbatches around the two-layer scans (forward and backward).
  assert sorted(l.trip_count for l in text.loops) == [2, 2, 2]
  # jax 0.12's XLA writes tuple elements as `%name#k` in dumps; jax 0.10.2's as instructions.
  assert bool(re.search(r"%[\w.\-]+#\d", dump)) == (jax.__version_info__ >= (0, 12))
