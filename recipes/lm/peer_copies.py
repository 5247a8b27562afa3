"""Node-local emergency copies (--emergency_dir with `{process}` in it, emergency.py): each
process keeps its copies in a directory of its own (a host's local disk: the same path on
every host, `{process}` set apart processes that share a host), holding its own shards of
the state and a replica of one peer's, process (i+1) % n's, so that the copies of a job that
lost a host, its directory with it, are still complete.

A save (`Copies.save`, every --emergency_every steps) copies this process's shards off the
devices, and its peer's: each leaf's shards as one row a device, moved by `jax.device_put`
onto the same devices in another order (`_rows`: process i's devices in the places of
process i+1's), then writes both in a background thread of its own: the loop waits for the
previous copy's write only, the persistent checkpoints (orbax's own threads) never. A step
is committed per process by renaming `<step>.partial` to `<step>`.

A restart gathers which steps each process holds and resumes from the newest that the set
can give whole (`complete_step`): every process's shards, from its own directory or from the
replica its peer (i-1) % n holds, moved back by the inverse move. Copies restore only onto
the mesh that saved them (the same devices, process count and mesh shape: `mesh_key`);
another mesh's are said and passed over (the persistent checkpoint is resumed), and removed
at this run's first copy.

Layout of a process's directory:

  <step>/own.bin, own.json          this process's shards (raw bytes; leaf, device, dtype,
                                    shape and offset of each)
  <step>/replica.bin, replica.json  process (i+1) % n's shards (none in a one-process job)
  <step>/meta.json                  the checkpoint's extra, every process's data position,
                                    the mesh (`mesh_key`)
  <step>.partial/                   a write that never finished: never read, removed at start
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fnscale as fs

PLACEHOLDER = "{process}"
PARTIAL = ".partial"


def complete_step(held: list) -> int | None:
  """The newest step the node-local copies of a job can give whole, or None.

  Args:
    held: by process index i, the steps process i's directory holds complete (each holds
      process i's shards and a replica of process (i+1) % n's), e.g. [{10, 20}, {20}].

  Returns:
    The newest step s such that every process i's shards are there: s in held[i] (its own)
    or s in held[(i-1) % n] (its peer's replica of them). [{10, 20}, set(), {20}] gives 20
    (process 1's from process 0's replica); [{20}, set(), set()] gives None (process 2's
    shards are lost with it and with process 1, which held their replica).

  Examples:
    >>> complete_step([{10, 20}, set(), {10}]), complete_step([{20}, set(), set()])
    (10, None)
  """
  n = len(held)
  for step in sorted(set().union(*held), reverse=True):
    if all(step in held[i] or step in held[(i - 1) % n] for i in range(n)):
      return step
  return None


def own_directory(d: str) -> str:
  """This process's directory of an --emergency_dir holding `{process}`."""
  return d.replace(PLACEHOLDER, str(jax.process_index()))


def mesh_key(mesh: Mesh) -> str:
  """What a copy must share with a run to restore onto it: the mesh's axes and devices."""
  return f"{dict(mesh.shape)} devices {[d.id for d in mesh.devices.flat]}"


def _rows(mesh: Mesh, roll: bool = False) -> NamedSharding:
  """One row a device of `mesh`, in its devices' order; `roll`: row k on the device of the
  same local index as row k's, of the process before (p-1: its peer's keeper), so that
  `jax.device_put` from the one to the other moves each process's rows to its keeper. Rows,
  not the leaf's own sharding: a replicated dim would let XLA keep each device's own copy
  (replicas are equal by contract, and a lost process's are not)."""
  order = list(mesh.devices.flat)
  if roll:
    n, local = jax.process_count(), {}
    for d in sorted(order, key=lambda d: d.id):
      local.setdefault(d.process_index, []).append(d)
    keeper = {d: local[(p - 1) % n][k] for p, ds in local.items() for k, d in enumerate(ds)}
    order = [keeper[d] for d in order]
  return NamedSharding(Mesh(np.array(order, dtype=object), ("copies",)), P("copies"))


def _row_array(sharding: NamedSharding, shard_shape, dtype, row):
  """A [devices, *shard_shape] array on `sharding` (`_rows`) whose row k is the numpy
  `row(k)`, on this process's devices."""
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(
      (sharding.mesh.size, *shard_shape)).items():
    arrays.append(jax.device_put(row(index[0].start)[None].astype(dtype), device))
  return jax.make_array_from_single_device_arrays((sharding.mesh.size, *shard_shape),
                                                  sharding, arrays)


def _moved(x, sharding):
  """`x` put onto `sharding` (its devices in another order), under that sharding's mesh:
  jax's move between orders compiles a copy that must agree with the ambient mesh."""
  with jax.set_mesh(sharding.mesh):
    return jax.device_put(x, sharding)


def _allgather_text(text: str) -> list[str]:
  """Every process's `text`, by process index (two small collectives)."""
  if jax.process_count() == 1:
    return [text]
  raw = np.frombuffer(text.encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int32)))
  padded = np.zeros(int(sizes.max()) or 1, np.uint8)
  padded[:raw.size] = raw
  every = np.asarray(multihost_utils.process_allgather(padded))
  return [bytes(every[i, :int(sizes[i, 0])]).decode() for i in range(len(sizes))]


def _shards(leaves) -> list:
  """[(leaf index, device id, numpy shard)] of this process's shards of `leaves`."""
  return [(i, s.device.id, np.asarray(s.data)) for i, x in enumerate(leaves)
          for s in x.addressable_shards]


def _write(path: str, shards) -> None:
  index, offset = [], 0
  with open(path + ".bin", "wb") as f:
    for leaf, device, a in shards:
      f.write(a.tobytes())
      index.append(dict(leaf=leaf, device=device, dtype=str(a.dtype), shape=list(a.shape),
                        offset=offset))
      offset += a.nbytes
  with open(path + ".json", "w", encoding="utf-8") as f:
    json.dump(index, f)


def _read(path: str) -> dict:
  """{(leaf index, device id): numpy shard} of a file `_write` wrote."""
  with open(path + ".json", encoding="utf-8") as f:
    index = json.load(f)
  raw = np.fromfile(path + ".bin", np.uint8)
  out = {}
  for e in index:
    dtype = np.dtype(jax.numpy.dtype(e["dtype"]))
    size = int(np.prod(e["shape"])) * dtype.itemsize
    out[e["leaf"], e["device"]] = (raw[e["offset"]:e["offset"] + size].view(dtype)
                                   .reshape(e["shape"]))
  return out


def _on(target, sharding, shards: dict, leaf: int):
  """A global array of `target`'s shape on `sharding` from this process's `shards`.

  Raises:
    CheckpointError: a shard is missing or of another shape (the copy is not this mesh's).
  """
  arrays = []
  want = sharding.shard_shape(target.shape)
  for device in sharding.addressable_devices_indices_map(target.shape):
    a = shards.get((leaf, device.id))
    if a is None or tuple(a.shape) != tuple(want):
      raise fs.CheckpointError(
          f"the emergency copy lacks leaf {leaf}'s shard {want} of device {device.id} (got "
          f"{None if a is None else tuple(a.shape)}): not a copy of this mesh's state; "
          "remove the emergency directories to resume from the checkpoint")
    arrays.append(jax.device_put(a, device))
  return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)


class Copies:
  """This process's node-local emergency copies (every process makes one, with the same
  arguments; see the module's docstring). `directory`: the --emergency_dir as given (with
  `{process}`); `mine`: this process's; `mesh`: the run's."""

  def __init__(self, directory: str, mesh: Mesh, keep: int):
    self.directory, self.mine, self.keep = directory, own_directory(directory), keep
    self.key = mesh_key(mesh)
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "emergency-copies")
    self._pending = None
    self.held = None  # by process: the steps each holds for this mesh (`latest_step`)
    self.foreign = []  # the steps held of another mesh, on any process (`latest_step`)

  def wait(self) -> None:
    """Until the last copy is written (its error, if it failed, raised here)."""
    if self._pending is not None:
      pending, self._pending = self._pending, None
      pending.result()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._writer.shutdown()

  def steps(self, foreign: bool = False) -> list[int]:
    """The complete steps in this process's directory saved on this run's mesh (`foreign`:
    on another)."""
    if not os.path.isdir(self.mine):
      return []
    found = []
    for name in os.listdir(self.mine):
      meta = os.path.join(self.mine, name, "meta.json")
      if name.isdigit() and os.path.isfile(meta):
        with open(meta, encoding="utf-8") as f:
          if (json.load(f).get("mesh") == self.key) != foreign:
            found.append(int(name))
    return sorted(found)

  def latest_step(self) -> int | None:
    """The newest step the job's copies give whole (`complete_step`), the same on every
    process (it gathers each process's steps)."""
    self.wait()
    every = [json.loads(t) for t in _allgather_text(json.dumps([self.steps(),
                                                                  self.steps(foreign=True)]))]
    self.held = [set(mine) for mine, _ in every]
    self.foreign = sorted(set().union(*(set(other) for _, other in every)))
    return complete_step(self.held)

  def save(self, step: int, state, data, extra: dict) -> None:
    """Copies this process's shards of `state` and its peer's replica off the devices, then
    writes them, with `extra` and every process's position of `data`, in the background."""
    self.wait()
    leaves = jax.tree_util.tree_leaves(state)
    own, replica = _shards(leaves), []
    by_device = {(i, d): a for i, d, a in own}
    for i, x in enumerate(leaves if jax.process_count() > 1 else ()):  # the peer's, moved here
      mesh = x.sharding.mesh
      order = list(mesh.devices.flat)
      rows = _row_array(_rows(mesh), x.sharding.shard_shape(x.shape), x.dtype,
                        lambda k, i=i, order=order: by_device[i, order[k].id])
      for s in _moved(rows, _rows(mesh, roll=True)).addressable_shards:
        replica.append((i, order[s.index[0].start].id, np.asarray(s.data)[0]))
    positions = [json.loads(t) for t in _allgather_text(json.dumps(data.get_state()))]
    meta = dict(step=step, extra=extra, positions=positions, mesh=self.key)
    self._pending = self._writer.submit(self._commit, step, own, replica, meta)

  def _commit(self, step: int, own, replica, meta: dict) -> None:
    final = os.path.join(self.mine, str(step))
    tmp = final + PARTIAL
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write(os.path.join(tmp, "own"), own)
    _write(os.path.join(tmp, "replica"), replica)
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
      json.dump(meta, f)
    if os.path.isdir(final):  # a copy of a run that went back past it (a restart)
      shutil.rmtree(final)
    os.rename(tmp, final)
    kept = self.steps()[-self.keep:]  # and another mesh's copies: this run went past them
    for name in os.listdir(self.mine):
      if name.isdigit() and int(name) not in kept:
        shutil.rmtree(os.path.join(self.mine, name), ignore_errors=True)

  def restore(self, step: int, target, data):
    """`(state, extra)` of `step` (held whole: `latest_step` chose it) onto `target`'s
    shardings (abstract leaves), `data` put at this process's saved position; and which
    processes' shards came from a peer's replica."""
    n, me, held = jax.process_count(), jax.process_index(), self.held
    lost = [i for i in range(n) if step not in held[i]]
    where = os.path.join(self.mine, str(step))
    own = _read(os.path.join(where, "own")) if me not in lost else {}
    replica = _read(os.path.join(where, "replica")) if me not in lost else {}
    meta = ""
    if me not in lost:
      with open(os.path.join(where, "meta.json"), encoding="utf-8") as f:
        meta = f.read()
    meta = json.loads(next(t for t in _allgather_text(meta) if t))  # a holder's
    flat, treedef = jax.tree_util.tree_flatten(target)
    leaves = []
    for i, t in enumerate(flat):
      shards = own
      if lost:  # their shards from the replicas their peers hold, moved back
        mesh, shape = t.sharding.mesh, t.sharding.shard_shape(t.shape)
        order = list(mesh.devices.flat)
        zeros = np.zeros(shape, t.dtype)
        peer = _row_array(_rows(mesh, roll=True), shape, t.dtype,
                          lambda k, i=i, order=order: replica.get((i, order[k].id), zeros))
        if me in lost:
          shards = {(i, order[s.index[0].start].id): np.asarray(s.data)[0]
                    for s in _moved(peer, _rows(mesh)).addressable_shards}
        else:
          _moved(peer, _rows(mesh))  # every process takes part in the move
      leaves.append(_on(t, t.sharding, shards, i))
    data.set_state(meta["positions"][me])
    if callable(getattr(data, "start_prefetch", None)):
      data.start_prefetch()  # as grain's own restore does
    return jax.tree_util.tree_unflatten(treedef, leaves), meta["extra"], lost


def save(manager, step: int, state, data, extra: dict) -> None:
  """An emergency copy of `state` at `step` with the data position `data` and `extra`:
  node-local (`Copies`: own shards and a peer's) or through an orbax manager (one shared
  directory, `fs.checkpoint.save`)."""
  if isinstance(manager, Copies):
    manager.save(step, state, data, extra)
  else:
    fs.checkpoint.save(manager, step, state, data=data, extra=extra)
