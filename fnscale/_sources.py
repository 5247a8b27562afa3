"""The sources `detect_topology` reads, each as facts: field -> (value, where it came from).

The TPU environment variables (`_env_facts`), the same keys in the Cloud TPU metadata
service's `tpu-env` and its own attributes (`_metadata_facts`, asked only on a TPU VM:
`_on_tpu_vm`), and the devices (`_device_facts`). The override is read in `_override.py`;
`_topology.py` merges them, first that answers wins.
"""
import math
import re
from collections.abc import Mapping

from fnscale import _machine
from fnscale import _metadata
from fnscale._errors import TopologyError
from fnscale._override import Facts, _as_ints, parse_shape

# Layout variables, most specific first: (chips per unit, units per slice). libtpu runs one
# process per TPU_PROCESS_BOUNDS cell; TPU_HOST_BOUNDS is the per-host spelling of the same.
_BOUNDS = (("TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS"),
           ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS"))


def _lookup(kv: Mapping[str, str], prefix: str, short_names: bool):
  """get(NAME) -> (value, source) or (None, None). `tpu-env` metadata writes some keys with
  the TPU_ prefix (TPU_ACCELERATOR_TYPE) and some without (ACCELERATOR_TYPE): read both."""
  def get(name):
    keys = (name, name.removeprefix("TPU_")) if short_names else (name,)
    for key in keys:
      value = kv.get(key)
      if value is not None and str(value).strip() and not _is_libtpu_note(str(value)):
        return str(value).strip(), prefix + key
    return None, None
  return get


def _is_libtpu_note(value: str) -> bool:
  """libtpu, initialised on a machine without TPU metadata (ahead-of-time compiles for a
  described TPU), writes its warning into the variable it couldn't fill, e.g.
  TPU_WORKER_ID='WARNING: could not determine TPU worker number, ...': no value, so unset
  (every process the job starts afterwards inherits it)."""
  return value.lstrip().startswith("WARNING:")


def _layout_facts(get) -> Facts:
  """The slice layout one source states: its bounds (a pair, both given) before its
  TPU_TOPOLOGY, which a host carved out of a bigger slice keeps from the whole slice."""
  for per_name, bounds_name in _BOUNDS:
    (per, per_src), (bounds, bounds_src) = get(per_name), get(bounds_name)
    if per and bounds:
      a, b = _as_ints(per, per_src, ",", 1), _as_ints(bounds, bounds_src, ",", 1)
      if len(a) != len(b):
        raise TopologyError(f"{per_src}={per!r} and {bounds_src}={bounds!r} have different "
                            "ranks; they must be comma-separated lists of the same length.")
      return {"chip_grid": (tuple(x * y for x, y in zip(a, b)), f"{per_src}*{bounds_src}"),
              "processes_per_slice": (math.prod(b), bounds_src)}
  topology, src = get("TPU_TOPOLOGY")
  return {"chip_grid": (parse_shape(topology), src)} if topology else {}


def _kv_facts(get) -> Facts:
  """Facts from TPU environment variables, or from the same keys in `tpu-env` metadata."""
  facts = _layout_facts(get)
  for field, name, minimum in (("worker_id", "TPU_WORKER_ID", 0),
                               ("num_slices", "MEGASCALE_NUM_SLICES", 1),
                               ("slice_index", "MEGASCALE_SLICE_ID", 0)):
    value, src = get(name)
    if value is not None:
      facts[field] = (_as_ints(value, src, ",", minimum)[0], src)
  acc, src = get("TPU_ACCELERATOR_TYPE")
  if acc:
    facts["accelerator_type"] = (acc, src)
  for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):  # JAX's hosts of one slice
    hosts, src = get(name)
    if hosts and "processes_per_slice" not in facts:
      facts["processes_per_slice"] = (len([h for h in hosts.split(",") if h.strip()]), src)
  return facts


def _env_facts(env: Mapping[str, str]) -> Facts:
  return _kv_facts(_lookup(env, "env:", short_names=False))


def _metadata_facts(timeout_s: float, url: str) -> Facts:
  get = lambda path: _metadata.get("instance/attributes/" + path, timeout_s=timeout_s, url=url)
  facts: Facts = {}
  acc, worker = get("accelerator-type"), get("agent-worker-number")
  if acc:
    facts["accelerator_type"] = (acc, "metadata:instance/attributes/accelerator-type")
  if worker and worker.isdigit():
    facts["worker_id"] = (int(worker), "metadata:instance/attributes/agent-worker-number")
  # The slice's hosts, as JAX's Cloud TPU cluster reads them: "name:id:ip" triples or names.
  hosts = [h for h in (get("worker-network-endpoints") or "").split(",") if h.strip()]
  if hosts:
    facts["processes_per_slice"] = (len(hosts),
                                    "metadata:instance/attributes/worker-network-endpoints")
  # Lines such as "TOPOLOGY: '2x4x8'", "TPU_WORKER_ID: '0'", "MEGASCALE_SLICE_ID: '1'".
  kv = dict(re.findall(r"^\s*([A-Z_]+)\s*:\s*'?([^'\n]*)'?\s*$", get("tpu-env") or "", re.M))
  get_kv = _lookup(kv, "metadata:instance/attributes/tpu-env:", short_names=True)
  return {**_kv_facts(get_kv), **facts}


def _device_facts(devices: list, src: str) -> Facts:
  """Facts the devices show; described devices (a topology description) count their own
  processes and slices, which need not be this machine's."""
  import jax  # deferred: detection from env/metadata needs no backend
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  me = jax.process_index() if jax.process_index() in by_process else min(by_process)
  slice_of = lambda d: getattr(d, "slice_index", 0) or 0
  slices = sorted({slice_of(d) for d in devices})
  d0, procs = devices[0], src + " process_index"
  facts: Facts = {
      "platform": (d0.platform, src), "device_kind": (d0.device_kind, src),
      "num_devices": (len(devices), src), "num_processes": (len(by_process), procs),
      "devices_per_process": (len(by_process[me]), procs),
      "process_index": (me, "jax.process_index()"),
      "num_slices": (len(slices), src + " slice_index"),
      "slice_index": (slice_of(by_process[me][0]), src + " slice_index"),
      "processes_per_slice": (max(len(by_process) // len(slices), 1), procs),
  }
  if d0.platform == "tpu" and getattr(d0, "coords", None) is not None:
    grid = _coords_grid([tuple(d.coords) for d in devices if slice_of(d) == slices[0]])
    if grid:
      facts["chip_grid"] = (grid, src + " coords")
    facts["devices_per_chip"] = (max(getattr(d, "core_on_chip", 0) for d in devices) + 1,
                                 src + " core_on_chip")
  return facts


def _coords_grid(coords: list[tuple[int, ...]]) -> tuple[int, ...]:
  """The box the chips' coordinates span, e.g. (2, 2, 1); () where the chips don't fill it
  (some chips of a host, such as TPU_VISIBLE_CHIPS=0,3 of a 2x2: no grid to name). A part
  of a host need not start at the origin: one chip at (1, 1, 0) is a 1x1x1 grid."""
  chips = set(coords)
  grid = tuple(max(c[i] for c in chips) - min(c[i] for c in chips) + 1
               for i in range(len(coords[0])))
  return grid if math.prod(grid) == len(chips) else ()


def _on_tpu_vm(env: Mapping[str, str]) -> bool:
  """Whether asking the metadata service is worth it: never on a laptop or in CI. A server
  named by GCE_METADATA_HOST is asked; else a TPU VM's (its device files), unless
  TPU_SKIP_MDS_QUERY is set. (`import jax` sets TPU_SKIP_MDS_QUERY=1 on every machine
  without TPU chips, so it can't veto a server the user named.)"""
  if env.get("GCE_METADATA_HOST"):
    return True
  return not env.get("TPU_SKIP_MDS_QUERY") and _machine._tpu_device_files()
