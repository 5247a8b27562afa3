"""fnscale.multihost._liveness: which processes still show signs of life, judged from a key-value store
(a stand-in for the coordination service's, whose real use tests/test_multihost.py covers)."""
import threading
import time

import pytest

from fnscale.multihost import _liveness


class _Store:
  """The coordination client's key-value calls `watch` makes, in memory; `down` makes every
  call fail as an unreachable service does."""

  def __init__(self):
    self.data, self.down, self.lock = {}, False, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      if self.down:
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
      assert allow_overwrite or key not in self.data
      self.data[key] = value

  def key_value_dir_get(self, prefix):
    with self.lock:
      if self.down:
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
      return [(k, v) for k, v in sorted(self.data.items()) if k.startswith(prefix)]


def _beats(store, pid, stop: threading.Event, period=0.05):
  """Another process's watcher, publishing until `stop`."""
  def run():
    n = 0
    while not stop.wait(period):
      store.key_value_set(f"fnscale/alive/{pid}", str(n), allow_overwrite=True)
      n += 1
  threading.Thread(target=run, daemon=True).start()


def test_silent_judges_only_processes_whose_value_stopped_changing():
  heard = {}
  assert _liveness.silent(heard, {1: "0", 2: "0"}, 0.0, 1.0) == []
  assert _liveness.silent(heard, {1: "1", 2: "0"}, 0.9, 1.0) == []
  assert _liveness.silent(heard, {1: "2", 2: "0"}, 1.5, 1.0) == [2]  # 2 silent 1.5 s
  assert _liveness.silent(heard, {1: "2", 2: "left"}, 1.6, 1.0) == []  # 2 left on purpose
  assert _liveness.silent(heard, {1: "2", 2: "left"}, 2.6, 1.0) == [1]
  assert _liveness.silent(heard, {1: "3", 2: "left", 3: "0"}, 2.7, 1.0) == []


def test_a_process_that_stops_publishing_is_named_once():
  store, stop, lost = _Store(), threading.Event(), []
  _beats(store, 1, stop)
  _beats(store, 2, threading.Event())
  with _liveness.watch(store, 0, 0.4, lost.append):
    time.sleep(0.3)
    stop.set()  # process 1 dies
    t0 = time.monotonic()
    while not lost and time.monotonic() - t0 < 5:
      time.sleep(0.02)
    took = time.monotonic() - t0
    time.sleep(0.3)
  assert lost == [[1]]
  assert 0.3 < took < 3  # silent for 0.4 s, read every 0.1 s (a loaded machine: slack)
  assert store.data["fnscale/alive/0"] == "left"  # the block ended normally


def test_processes_that_keep_publishing_are_never_named():
  store, stop, lost = _Store(), threading.Event(), []
  _beats(store, 1, stop)
  with _liveness.watch(store, 0, 0.3, lost.append):
    time.sleep(1.2)
  stop.set()
  assert lost == []
  # This process published while it watched: a counter that moved.
  assert store.data["fnscale/alive/0"] == "left"


def test_an_unreachable_store_names_the_coordinator():
  store, lost = _Store(), []
  with _liveness.watch(store, 1, 0.3, lost.append):
    time.sleep(0.1)
    store.down = True
    time.sleep(1.0)
  assert lost == [[0]]


def test_a_block_that_raises_does_not_say_left():
  store = _Store()
  with pytest.raises(RuntimeError, match="boom"):
    with _liveness.watch(store, 3, 0.3, lambda ids: None):
      time.sleep(0.1)
      raise RuntimeError("boom")
  assert store.data["fnscale/alive/3"] != "left"  # gone: the others will name it


def test_leave_says_left_only_once_this_process_published(monkeypatch):
  store = _Store()
  for name in ("_PUBLISHED", "_LEAVING"):
    monkeypatch.setattr(_liveness, name, threading.Event())
  state = _liveness._compat.DistributedState(store, 2, 3, "127.0.0.1:1", False)
  asked = []
  monkeypatch.setattr(_liveness._compat, "distributed_state",
                      lambda: asked.append(1) or state)
  # Before any watch (e.g. a join that timed out): the client, maybe half-formed, is left alone.
  _liveness.leave()
  assert asked == [] and store.data == {}
  monkeypatch.setattr(_liveness, "_LEAVING", threading.Event())
  with _liveness.watch(store, 2, 0.4, lambda ids: None):
    time.sleep(0.2)
    _liveness.leave()  # fnscale's own exit, from inside the block
    assert store.data["fnscale/alive/2"] == "left"
    time.sleep(0.3)  # the watcher publishes no counter over it
    assert store.data["fnscale/alive/2"] == "left"
