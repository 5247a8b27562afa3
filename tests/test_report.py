"""compile_report carries what XLA's partitioner logged while compiling, as data."""
import jax
import jax.numpy as jnp
import optax

import fnscale as fs
from fnscale import report as freport

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("vocab", None))
AXES = {"embed": ("vocab", "embed"), "w": ("embed", None)}


def _loss(p, batch):
  x = fs.constrain_batch(p["embed"][batch["tokens"]])
  return jnp.mean((x @ p["w"]) ** 2)


def _init(key):
  k1, k2 = jax.random.split(key)
  return {"embed": jax.random.normal(k1, (256, 128)), "w": jax.random.normal(k2, (128, 128))}


def test_partitioner_warnings_reach_the_report():
  mesh = fs.make_mesh("data=2,fsdp=4")
  opt = optax.sgd(0.1)
  state = fs.init_state(_init, opt, mesh=mesh, rules=RULES, logical_axes=AXES,
                        key=jax.random.key(0), abstract=True)
  batch = {"tokens": jax.ShapeDtypeStruct((16, 64), jnp.int32)}
  step = fs.shard_step(fs.train_step(_loss, opt), mesh, rules=RULES, logical_axes=AXES)
  report = fs.compile_report(step, state, batch)
  remat = [w for w in report.xla_warnings if "Involuntary full rematerialization" in w]
  assert remat and remat[0].startswith("[SPMD] Involuntary full rematerialization")
  text = str(report)
  assert f"  XLA warnings ({len(report.xla_warnings)})" in text and remat[0] in text
  # The compiled value carries the same warnings.
  assert step.compile(state, batch).xla_warnings == report.xla_warnings


def test_a_clean_program_reports_no_warnings():
  report = fs.compile_report(lambda x, y: x @ y, jnp.ones((8, 4)), jnp.ones((4, 8)))
  assert report.xla_warnings == () and "XLA warnings" not in str(report)


def test_log_lines_parsed_and_deduplicated():
  text = ("W0000 00:00:1796035210.297997   27774 spmd_partitioner.cc:652] [SPMD] Involuntary "
          "full rematerialization. The compiler cannot go from sharding {a} to {b}\n"
          "I0000 00:00:1796035210.3   27774 other.cc:1] information, not a warning\n"
          "W0000 00:00:1796035210.4   27775 spmd_partitioner.cc:652] [SPMD] Involuntary "
          "full rematerialization. The compiler cannot go from sharding {a} to {b}\n"
          "E0000 00:00:1796035210.5   27774 x.cc:2] an error line\n"
          "plain text\n")
  assert freport.xla_warnings(text) == (
      "[SPMD] Involuntary full rematerialization. The compiler cannot go from sharding {a} "
      "to {b}", "an error line")
