"""Detects the hardware (or describes a TPU target), builds a mesh over it and prints both.

    python recipes/show_topology.py                          # 8 simulated devices on a CPU
    python recipes/show_topology.py --mesh="data=-1,tensor=2" --devices=4
    python recipes/show_topology.py --mesh=hybrid            # a preset: data, fsdp, tensor, hybrid
    python recipes/show_topology.py --topology=v5p-128 --mesh=fsdp=-1,tensor=4
    python recipes/show_topology.py --topology="2x v5p-128" --mesh=hybrid   # two slices
    python recipes/show_topology.py --topology=v5p:4x4x4     # libtpu's spelling

A TPU target (an accelerator type, "GEN:GRID", or "Nx TYPE" for N slices) is described by
libtpu's own device descriptions, without the hardware; that needs the tpu extra
(`pip install "fnscale[tpu]"`). A bare grid ("2x4") overrides the layout of this machine's
devices instead.
"""
import re
import sys

from absl import flags

import fnscale as fs
from fnscale import topology
from fnscale.mesh import describe
from recipes.lm import cli

flags.DEFINE_string("mesh", "data=-1", "mesh axes 'name=size,...' or a preset name")
flags.DEFINE_string("dcn", None, "axes across slices/processes, e.g. 'replica=2'")
flags.DEFINE_string("topology", None, "a TPU target to describe ('v5p-128', '2x v5p-128', "
                    "'v5p:4x4x4') or a chip grid overriding this machine's ('2x4')")
flags.DEFINE_integer("devices", 8, "simulated CPU devices when no accelerator is present",
                     lower_bound=1)
FLAGS = flags.FLAGS


def _detect(target):
  """(topology, devices, what it describes)."""
  topology.quiet_libtpu()  # describing a TPU loads libtpu: no host-lookup warnings
  fs.simulate_cpu_devices(FLAGS.devices)  # only where no accelerator is present
  if target and not re.fullmatch(r"[\dx\s]+", target):  # names a TPU: describe the target
    devices = topology.target_devices(target)
    # This machine's environment says nothing about the target: env={}.
    return fs.detect_topology(target, devices=devices, env={}), devices, \
        f"target {target!r} (libtpu's described devices; no TPU needed)"
  return fs.detect_topology(target), None, "this machine"


def main(argv):
  if len(argv) > 1:
    raise fs.InputError(f"unexpected arguments {argv[1:]}; flags are written --name=value")
  topo, devices, what = _detect(FLAGS.topology)
  mesh = fs.make_mesh(FLAGS.mesh, dcn=FLAGS.dcn, topology=topo, devices=devices)
  print(f"describing {what}")
  print("topology:", topo)
  print(f"  chips per slice {topo.num_chips}, grid {'x'.join(map(str, topo.chip_grid)) or '?'}"
        f", process {topo.process_index} of {topo.num_processes}, slice {topo.slice_index} of "
        f"{topo.num_slices}")
  for field, source in topo.sources.items():
    print(f"  {field:<22} from {source}")
  if topo.set_aside:  # the environment described other hardware than the devices present
    print(f"  set aside: {topo.set_aside}")
  print(describe(mesh))


if __name__ == "__main__":
  sys.exit(cli.absl_run(main))
