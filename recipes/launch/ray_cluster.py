"""A Ray cluster of several nodes on this machine, for trying and testing recipes/launch/launch_ray.py.

  with ray_cluster.local_cluster(2) as address:      # two `ray start` nodes: two "hosts"
    launch_ray.launch(argv, launch_ray.nodes(2), address=address, devices_per_process=4)

Every node is `ray start --block` in its own session (stopped with all its processes when the
block ends), with no dashboard and no usage stats, and nothing sent off this machine: with
usage stats off, Ray 2.60's dashboard process still probes cloud metadata servers and posts a
"usage stats disabled" report to Ray's server; here it finds the provider in
`~/ray_bootstrap_config.yaml` (HOME is the cluster's directory) and the report goes to a closed
local port. (Ray names its nodes by this machine's own address even when given 127.0.0.1;
that traffic stays on the machine.)
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Sequence

from recipes.launch import launch_local

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL when the cluster is stopped


def _start_node(head_port: int, temp_dir: str, index: int, cpus: float,
                resources: dict | None, env: dict[str, str] | None) -> subprocess.Popen:
  """`ray start --block` for node `index` (0: the head) on 127.0.0.1, in its own session,
  every port it opens chosen free (several nodes share this machine), output to a file."""
  ports = {name: launch_local.free_port() for name in (
      "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
      "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")}
  if index == 0:
    ports.update({"port": head_port, "ray-client-server-port": launch_local.free_port(),
                  "dashboard-port": launch_local.free_port()})
  cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
         "--node-ip-address=127.0.0.1", f"--num-cpus={cpus:g}", "--num-gpus=0",
         "--disable-usage-stats", f"--object-store-memory={100 * 2**20}",
         *[f"--{k}={v}" for k, v in ports.items()]]
  cmd += (["--head", "--include-dashboard=false", f"--temp-dir={temp_dir}"] if index == 0
          else [f"--address=127.0.0.1:{head_port}"])
  if resources:
    cmd.append("--resources=" + repr(dict(resources)).replace("'", '"'))
  # Nothing off this machine (module docstring): the provider named in HOME's
  # ray_bootstrap_config.yaml, the "disabled" usage report to a closed local port.
  env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HOME": temp_dir,
         "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/", **(env or {})}
  with open(os.path.join(temp_dir, f"node{index}.log"), "wb") as log:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)


def _wait_node(proc: subprocess.Popen, log_path: str, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    with open(log_path, "rb") as f:
      text = f.read().decode(errors="replace")
    if "Ray runtime started" in text:
      return
    if proc.poll() is not None:
      raise RuntimeError(f"ray start exited with {proc.returncode}; its output "
                         f"({log_path}):\n{text[-3000:]}")
    time.sleep(0.2)
  raise RuntimeError(f"ray start did not start a node within {timeout_s:g} s ({log_path})")


@contextlib.contextmanager
def local_cluster(num_nodes: int = 2, *, cpus_per_node: float = 1,
                  node_resources: Sequence[dict] = (), node_env: Sequence[dict] = (),
                  timeout_s: float = 120.0) -> Iterator[str]:
  """A Ray cluster of `num_nodes` nodes on this machine (module docstring); yields its
  address ("127.0.0.1:port").
  Node i gets `node_resources[i]` (extra Ray resources) and `node_env[i]` (environment) when
  given. Every node's processes are stopped (SIGTERM, then SIGKILL) when the block ends.

  Raises:
    RuntimeError: a node did not start (with its output).
  """
  # Short: Ray's socket paths under it must fit in 107 bytes.
  temp_dir = tempfile.mkdtemp(prefix="fsray-", dir="/tmp")
  with open(os.path.join(temp_dir, "ray_bootstrap_config.yaml"), "w") as f:
    f.write("provider:\n  type: local\n")
  port, procs = launch_local.free_port(), []
  try:
    for i in range(num_nodes):  # one at a time: nodes starting together race for ports
      procs.append(_start_node(port, temp_dir, i, cpus_per_node,
                               node_resources[i] if i < len(node_resources) else None,
                               node_env[i] if i < len(node_env) else None))
      _wait_node(procs[-1], os.path.join(temp_dir, f"node{i}.log"), timeout_s)
    yield f"127.0.0.1:{port}"
  finally:
    launch_local.stop(procs[::-1], grace_s=STOP_GRACE_S)
    shutil.rmtree(temp_dir, ignore_errors=True)
