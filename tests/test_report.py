"""compile_report carries what XLA's partitioner logged while compiling, as data."""
import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from fnscale.analysis import _report as freport

# An embedding's gradient written back: rows split over the batch axes added into a table
# whose rows and columns are split over other axes. Under both sharding propagations
# (Shardy, GSPMD) in both supported jax releases, XLA's partitioner can't reshard the rows
# and says so ("Involuntary full rematerialization").
RULES = (("batch", ("data", "fsdp")), ("vocab", "fsdp"), ("embed", "data"))
AXES = {"table": ("vocab", "embed")}


def _loss(p, batch):
  table = p["table"].at[batch["ids"]].add(fs.constrain_batch(batch["rows"]))
  return jnp.mean(table ** 2)


def _init(key):
  return {"table": jax.random.normal(key, (256, 128))}


def test_partitioner_warnings_reach_the_report(partitioner):
  mesh = fs.make_mesh("data=2,fsdp=4")
  opt = optax.sgd(0.1)
  state = fs.init_state(_init, opt, mesh=mesh, rules=RULES, logical_axes=AXES,
                        key=jax.random.key(0), abstract=True)
  batch = {"ids": jax.ShapeDtypeStruct((16,), jnp.int32),
           "rows": jax.ShapeDtypeStruct((16, 128), jnp.float32)}
  step = fs.shard_step(fs.train_step(_loss, opt), mesh, rules=RULES, logical_axes=AXES)
  report = fs.compile_report(step, state, batch)
  # The one warning, not GSPMD's deprecation notice (a word about jax's configuration).
  assert len(report.xla_warnings) == 1, report.xla_warnings
  assert report.xla_warnings[0].startswith("[SPMD] Involuntary full rematerialization. The "
                                           "compiler cannot go from sharding {")
  text = str(report)
  assert "  XLA warnings (1)" in text and report.xla_warnings[0] in text
  # The compiled value carries the same warnings.
  assert step.compile(state, batch).xla_warnings == report.xla_warnings


def test_a_clean_program_reports_no_warnings(partitioner):
  report = fs.compile_report(lambda x, y: x @ y, jnp.ones((8, 4)), jnp.ones((4, 8)))
  assert report.xla_warnings == () and "XLA warnings" not in str(report)


def test_log_lines_parsed_and_deduplicated():
  text = ("W0000 00:00:1796035210.297997   27774 spmd_partitioner.cc:652] [SPMD] Involuntary "
          "full rematerialization. The compiler cannot go from sharding {a} to {b}\n"
          "I0000 00:00:1796035210.3   27774 other.cc:1] information, not a warning\n"
          "W0000 00:00:1796035210.4   27775 spmd_partitioner.cc:652] [SPMD] Involuntary "
          "full rematerialization. The compiler cannot go from sharding {a} to {b}\n"
          "E0000 00:00:1796035210.5   27774 x.cc:2] an error line\n"
          "W0000 00:00:1796035210.6   27774 sharding_propagation.cc:3456] GSPMD sharding "
          "propagation is going to be deprecated and not supported in the future.\n"
          "plain text\n")
  assert freport.xla_warnings(text) == (
      "[SPMD] Involuntary full rematerialization. The compiler cannot go from sharding {a} "
      "to {b}", "an error line")


def test_a_step_loaded_from_the_persistent_cache_is_said_so(tmp_path):
  # The same step compiled twice by fresh ShardedSteps with jax's persistent cache on: XLA
  # compiles the first, the second is a load from the cache, and only its report says so.
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  state = fs.init_state({"w": jnp.zeros((4, 1))}, opt, mesh=mesh)
  batch = {"x": jnp.ones((16, 4)), "y": jnp.ones((16, 1))}
  with fs.compilation_cache_restored():
    fs.compilation_cache(str(tmp_path))
    first, again = [fs.compile_report(fs.shard_step(fs.train_step(loss, opt), mesh), state,
                                      batch) for _ in range(2)]
  assert (first.from_cache, again.from_cache) == (False, True)
  assert "persistent compilation cache" not in str(first)
  assert "(loaded from jax's persistent compilation cache)" in str(again)


def test_a_step_compiled_earlier_in_the_process_is_said_so():
  # The same ShardedStep compiled twice: jax hands back the executable of the first compile
  # (its in-memory cache: the second "compile" takes microseconds), and only the second
  # report says so; a different batch shape compiles afresh.
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  mesh = fs.make_mesh({"data": 8})
  opt = optax.sgd(0.1)
  state = fs.init_state({"w": jnp.zeros((4, 1))}, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(loss, opt), mesh)
  first, again, other = [fs.compile_report(step, state, {"x": jnp.ones((n, 4))})
                         for n in (16, 16, 32)]
  assert (first.reused, again.reused, other.reused) == (False, True, False)
  assert first.compile_seconds > 10 * again.compile_seconds
  assert "in-memory cache" not in str(first) + str(other)
  assert "(compiled earlier in this process: jax's in-memory cache)" in str(again)
