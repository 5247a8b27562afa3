"""The options that say what hardware a recipe runs on: `--topology`, `--mesh_shape`,
`--tpu`. Defined once (`recipes.lm.options.Hardware`): train_lm's `Options` inherit them (flags
and keywords), the benchmarks add them to their absl flags (`define_flags`) or argparse parser
(`add_arguments`), and `detect` turns them into a `fnscale.Topology` the same way for all.

Without them a recipe runs on what `fnscale.detect_topology` finds: on a VM whose TPU_*
variables describe more chips than JAX has (one chip of a host), the devices present.
"""
from __future__ import annotations

import argparse
import dataclasses

from absl import flags

import fnscale as fs
from recipes.lm.options import Hardware

FIELDS = tuple(dataclasses.fields(Hardware))


def define_flags(fv: flags.FlagValues) -> None:
  """Adds `--mesh_shape`, `--topology` and `--[no]tpu` to absl flags `fv`."""
  for f in FIELDS:
    define = flags.DEFINE_boolean if f.type.startswith("bool") else flags.DEFINE_string
    define(f.name, f.default, f.metadata["help"], flag_values=fv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds `--mesh_shape`, `--topology` and `--tpu` / `--no-tpu` to an argparse parser."""
  for f in FIELDS:
    if f.type.startswith("bool"):
      parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction,
                          default=f.default, help=f.metadata["help"])
    else:
      parser.add_argument(f"--{f.name}", default=f.default, help=f.metadata["help"])


def from_values(values) -> Hardware:
  """The options of parsed flags: absl `FlagValues` or an argparse `Namespace`."""
  return Hardware(**{f.name: getattr(values, f.name) for f in FIELDS})


def detect(o, devices=None) -> fs.Topology:
  """`fs.detect_topology` with `o`'s options (`Hardware`, or train_lm's `Options`): the
  seed-style `mesh_shape` ("2x4x8") or the `topology` override, and `tpu`; of `devices`
  (default: all of them).

  Raises:
    TopologyError: both overrides given, one that doesn't match the devices (the message
      names their own layout), or tpu=True where no TPU was found (it says what was).
  """
  if o.mesh_shape and o.topology:
    raise fs.TopologyError(f"mesh_shape={o.mesh_shape!r} and topology={o.topology!r} both "
                           "override the detected hardware; give one of them")
  try:
    topo = fs.detect_topology(override=(o.mesh_shape or o.topology) or None, devices=devices)
  except fs.TopologyError as e:
    raise fs.TopologyError(f"mesh_shape={o.mesh_shape!r}: {e}" if o.mesh_shape
                           else str(e)) from None
  if o.tpu and topo.platform != "tpu":
    raise fs.TopologyError(f"tpu=True but no TPU was found: {topo}. Run on a TPU VM with "
                           "jax[tpu] installed, or leave tpu unset to use these devices")
  return topo


def describe(topo: fs.Topology) -> str:
  """The topology as a recipe's report says it: one line, and what detection set aside."""
  return f"topology: {topo}" + (f"\n  set aside: {topo.set_aside}" if topo.set_aside else "")
