"""Detects the hardware, builds a mesh over it and prints both.

    python recipes/show_topology.py                          # 8 simulated devices on a CPU
    python recipes/show_topology.py --mesh="data=-1,tensor=2" --devices=4
    python recipes/show_topology.py --mesh=hybrid            # a preset: data, fsdp, tensor, hybrid
"""
import sys

from absl import app, flags

import fnscale as fs
from fnscale.mesh import describe

flags.DEFINE_string("mesh", "data=-1", "mesh axes 'name=size,...' or a preset name")
flags.DEFINE_string("dcn", None, "axes across slices/processes, e.g. 'replica=2'")
flags.DEFINE_string("topology", None, "override the detected chip grid, e.g. '2x4x8'")
flags.DEFINE_integer("devices", 8, "simulated CPU devices when no accelerator is present")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  try:
    fs.simulate_cpu_devices(FLAGS.devices)  # only where no accelerator is present
    topo = fs.detect_topology(FLAGS.topology)
    mesh = fs.make_mesh(FLAGS.mesh, dcn=FLAGS.dcn, topology=topo)
  except fs.FnscaleError as e:
    sys.exit(f"error: {e}")
  print("topology:", topo)
  for field, source in topo.sources.items():
    print(f"  {field:<22} from {source}")
  print(describe(mesh))


if __name__ == "__main__":
  app.run(main)
