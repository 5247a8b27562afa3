"""Compiling a lowered program with XLA: timed, with the warnings XLA's C++ code logs while
compiling captured from stderr, plus the compile settings (`fast_compile_options`, jax's
persistent `compilation_cache`). `fnscale.shard_step` compiles steps with it and
`fnscale.compile_report` reads what it returns; the settings are public as
`fnscale.fast_compile_options`, `fnscale.compilation_cache` and
`fnscale.compilation_cache_restored`."""
from __future__ import annotations

from collections.abc import Mapping
import contextlib
import hashlib
import os
import sys
import tempfile
import threading
import time
from typing import Any, NamedTuple

import jax

from fnscale import _compat
from fnscale import _tree
from fnscale._errors import StepError

def xla_warnings(text: str) -> tuple[str, ...]:
  """The warning and error messages in XLA's C++ log output, de-duplicated in order (XLA's
  notices about JAX's configuration, such as GSPMD's deprecation, left out: they stay on
  stderr). The partitioner's own warnings read the same under Shardy and GSPMD, though the
  shardings they quote are written in Shardy's notation under Shardy in jax 0.12."""
  return tuple(dict.fromkeys(_compat.xla_log_messages(text)))


# Warnings by program: jax serves a program compiled before in this process from its cache,
# and XLA logs nothing the second time.
_SEEN_WARNINGS: dict[str, tuple[str, ...]] = {}


class Compilation(NamedTuple):
  """`compile_lowered`'s result: the `jax.stages.Compiled`, its wall time in seconds, XLA's
  warning messages, `from_cache` (jax loaded it from its persistent compilation cache: the
  seconds are a load's) and `reused` (jax returned the executable it compiled for the same
  program earlier in this process: the seconds are a lookup's)."""
  compiled: Any
  seconds: float
  warnings: tuple[str, ...]
  from_cache: bool
  reused: bool


def compile_lowered(lowered, compiler_options: Mapping | None = None) -> Compilation:
  """`lowered.compile(...)`, timed, with what XLA logged to stderr meanwhile captured.

  XLA's partitioner writes its warnings from C++ straight to file descriptor 2, so that
  descriptor is pointed at a temporary file during the compile; the text is then written
  back to stderr (nothing is hidden) and parsed. A thread that ends the process meanwhile
  (`fnscale.multihost._coordination.exit_with`: a preemption notice, a lost peer) gives the descriptor
  back first (`release_stderr`), so its message and XLA's lines reach stderr. A program
  compiled again in the same process (jax's in-memory cache) gets the warnings of its first
  compile; one loaded from the persistent compilation cache has none.
  """
  key = hashlib.sha256((lowered.as_text() + repr(sorted((compiler_options or {}).items())))
                       .encode()).hexdigest()
  earlier = _compat.memoized_executable(lowered)
  compiled, seconds, text, from_cache = _compile_capturing(lowered, compiler_options)
  warnings = xla_warnings(text)
  if warnings:
    _SEEN_WARNINGS[key] = warnings
  reused = earlier is not None and _compat.compiled_executable(compiled) is earlier
  return Compilation(compiled, seconds, warnings or _SEEN_WARNINGS.get(key, ()), from_cache,
                     reused)


# The compile whose stderr is being captured, if any: {"saved": the real stderr's duplicate
# descriptor, "tmp": the capture file}. A process leaving from another thread while a compile
# runs (`release_stderr`) gives fd 2 back first, or its last words would go to the file.
_CAPTURE: dict[str, Any] = {}
_CAPTURE_LOCK = threading.Lock()


def release_stderr() -> None:
  """Gives file descriptor 2 back to the real stderr if a compile is capturing it, writing
  what was captured so far there first. For a thread about to end the process (a
  preemption notice, a lost peer) while the main thread compiles; safe from any thread, and
  a no-op when nothing is captured."""
  with _CAPTURE_LOCK:
    if not _CAPTURE:
      return
    _restore(_CAPTURE.pop("saved"), _CAPTURE.pop("tmp"))


def _restore(saved: int, tmp) -> str:
  """fd 2 back to `saved` (closed after), `tmp`'s text echoed there; returns the text."""
  sys.stderr.flush()
  os.dup2(saved, 2)
  os.close(saved)
  tmp.seek(0)
  text = tmp.read().decode("utf-8", "replace")
  if text:
    sys.stderr.write(text)
    sys.stderr.flush()
  return text


# jax.monitoring (public) reports each program jax loads from its persistent compilation
# cache with this event.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def _cache_hits():
  """A list that gets one entry per program this thread loads from jax's persistent
  compilation cache inside the block (a listener for the block only: no module state)."""
  hits, thread = [], threading.get_ident()

  def listen(event: str, **_) -> None:
    if event == _CACHE_HIT and threading.get_ident() == thread:
      hits.append(event)
  jax.monitoring.register_event_listener(listen)
  try:
    yield hits
  finally:
    jax.monitoring.unregister_event_listener(listen)


def _compile_capturing(lowered, compiler_options):
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    with _CAPTURE_LOCK:
      sys.stderr.flush()
      _CAPTURE.update(saved=os.dup(2), tmp=tmp)
      os.dup2(tmp.fileno(), 2)
    try:
      with _cache_hits() as hits:
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=dict(compiler_options or {}) or None)
        seconds = time.perf_counter() - t0
    finally:
      with _CAPTURE_LOCK:
        # Empty when another thread released stderr: the process is leaving anyway.
        text = _restore(_CAPTURE.pop("saved"), _CAPTURE.pop("tmp")) if _CAPTURE else ""
  return compiled, seconds, text, bool(hits)


def fast_compile_options() -> dict[str, Any]:
  """XLA compile options that turn most backend optimisations off, for quick debug compiles.

  `xla_backend_optimization_level=0` and `xla_llvm_disable_expensive_passes=True` (XLA
  DebugOptions, accepted by `jax.stages.Lowered.compile(compiler_options=...)`). They cut
  compile time of large programs roughly in half on the CPU backend; the program runs slower.
  Not for production steps.

  Examples:
    >>> import fnscale as fs, jax, jax.numpy as jnp
    >>> lowered = jax.jit(lambda x: 2 * x).lower(jnp.ones(4))
    >>> lowered.compile(compiler_options=fs.fast_compile_options())(jnp.ones(4))
    Array([2., 2., 2., 2.], dtype=float32)
  """
  return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compilation_cache(directory: str, *, min_compile_time_s: float = 0.0,
                      min_entry_size_bytes: int = 0) -> None:
  """Turns on JAX's persistent compilation cache in `directory` (a local path or gs://...).

  Sets `jax_compilation_cache_dir`, `jax_persistent_cache_min_compile_time_secs` and
  `jax_persistent_cache_min_entry_size_bytes` (defaults 0: cache every program, even small
  ones) and resets jax's cache object so the new directory takes effect. This is jax's own
  process-wide configuration; in multi-process jobs only process 0 writes entries.

  Raises:
    StepError: an empty directory, thresholds of the wrong type or negative.

  Examples:
    A run that caches its own programs, the process's setting restored after it:

    >>> import fnscale as fs, jax, jax.numpy as jnp, os, tempfile
    >>> with fs.compilation_cache_restored(), tempfile.TemporaryDirectory() as d:
    ...   fs.compilation_cache(d)
    ...   _ = jax.jit(lambda x: 3 * x + 1)(jnp.ones(4))
    ...   len(os.listdir(d)) > 0  # the program is in the cache
    True
  """
  if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
    raise StepError(f"compilation cache directory is {_tree.got(directory)}, expected a "
                    "non-empty path.")
  if (isinstance(min_compile_time_s, bool) or not isinstance(min_compile_time_s, (int, float))
      or min_compile_time_s < 0):
    raise StepError(f"min_compile_time_s={min_compile_time_s!r}, expected a number >= 0.")
  _tree.check_int(min_entry_size_bytes, "min_entry_size_bytes", StepError, minimum=0)
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc
  jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
  cc.reset_cache()



# The process-wide jax settings `compilation_cache` changes (and the switch a caller may set).
_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")


@contextlib.contextmanager
def compilation_cache_restored():
  """A block after which jax's persistent compilation cache is configured as before it:
  `compilation_cache` inside it (a run that caches its own programs) doesn't leave later
  compiles of the process writing to, or reading stale entries from, that directory.

  Examples:
    >>> import fnscale as fs, jax
    >>> before = jax.config.jax_compilation_cache_dir
    >>> with fs.compilation_cache_restored():
    ...   fs.compilation_cache("/tmp/fnscale-example-cache")
    >>> jax.config.jax_compilation_cache_dir == before
    True
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc
  before = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
  try:
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    cc.reset_cache()
