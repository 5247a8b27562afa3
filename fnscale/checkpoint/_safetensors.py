"""The safetensors format, read by slices and written tensor by tensor, local or remote.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{...}}`, offsets relative to the end of the header) and the tensors' row-major bytes
(the format's specification: github.com/huggingface/safetensors, "Format").

Local files are read through `safetensors.safe_open(...).get_slice` (a memory map: only the
pages of the slices asked for are read). Remote files (`gs://...`, any fsspec URL) are read
through fsspec by byte ranges: the contiguous runs of a slice, runs closer than `MERGE_GAP`
bytes read as one request. Files are written through fsspec, header first, then one tensor at
a time (host memory holds one tensor, never a whole shard).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import ml_dtypes  # registers bfloat16 with numpy (safetensors' numpy reader needs it)
import numpy as np

from fnscale._errors import CheckpointError, StorageError

# safetensors dtype codes <-> numpy dtypes (the float and int types models hold).
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
CODES = {v: k for k, v in DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
MERGE_GAP = 1 << 20  # remote reads: runs this close are fetched as one range
_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned


class Entry(NamedTuple):
  """One tensor of a file: its dtype code, shape and absolute byte range in the file."""
  file: str
  dtype: str
  shape: tuple[int, ...]
  start: int
  stop: int


def is_remote(path: str) -> bool:
  return "://" in path and not path.startswith("file://")


def filesystem(path: str):
  """(fsspec filesystem, path within it) for a local path or URL.

  Raises:
    CheckpointError: fsspec is missing, or has no implementation for the URL's protocol (e.g.
      `gs://` without gcsfs), naming what to install.
  """
  try:
    import fsspec  # pylint: disable=import-outside-toplevel
    return fsspec.core.url_to_fs(path)
  except ImportError as e:
    raise CheckpointError(f"reading or writing {path!r} needs a filesystem library that "
                          f"can't be imported ({e}); fix: `pip install fnscale[hf]` (and "
                          "gcsfs for gs:// paths).") from e


def read_header(path: str) -> dict[str, Entry]:
  """The tensors of one safetensors file (local path or URL), from its header alone.

  Raises:
    CheckpointError: a file that is not safetensors (a bad header), naming the file.
    StorageError: the file can't be read.
  """
  fs, inner = filesystem(path)
  try:
    with fs.open(inner, "rb") as f:
      head = f.read(8)
      n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
      if not 0 < n < (100 << 20):
        raise CheckpointError(f"{path} is not a safetensors file (header length {n}); fix: "
                              "point at a directory of *.safetensors files.")
      header = json.loads(f.read(n))
  except (OSError, ValueError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise StorageError(f"could not read the safetensors header of {path}: {e}") from e
  base = 8 + n
  out = {}
  for key, v in header.items():
    if key == "__metadata__":
      continue
    b, e = v["data_offsets"]
    out[key] = Entry(path, v["dtype"], tuple(v["shape"]), base + b, base + e)
  return out


# ------------------------------------------------------------------------------------------
# Reading slices


@contextlib.contextmanager
def reader() -> Iterator[Callable[[Entry, str, Sequence[slice]], np.ndarray]]:
  """`read(entry, key, index)`: entry's tensor at `index` (one step-1 slice per dim) as a
  numpy array in the file's dtype, reading only those elements (`get_slice` on a memory map
  locally, byte ranges remotely). Local files stay open until the block ends."""
  with contextlib.ExitStack() as stack:
    opened = {}

    def read(entry: Entry, key: str, index: Sequence[slice]) -> np.ndarray:
      if is_remote(entry.file):
        return _read_remote(entry, index)
      if entry.file not in opened:
        import safetensors  # pylint: disable=import-outside-toplevel
        opened[entry.file] = stack.enter_context(
            safetensors.safe_open(entry.file, framework="numpy"))
      f = opened[entry.file]
      return f.get_slice(key)[tuple(index)] if entry.shape else f.get_tensor(key)

    yield read


def runs(shape: Sequence[int], index: Sequence[slice]) -> list[tuple[int, int, tuple]]:
  """The contiguous element runs of `index` in a row-major array of `shape`: (start, stop,
  position) with position the run's offsets in the leading dims (every dim up to and
  including the last one the index cuts; later dims are whole)."""
  bounds = [s.indices(d)[:2] for s, d in zip(index, shape)]
  cut = [k for k, (a, b) in enumerate(bounds) if (a, b) != (0, shape[k])]
  last = cut[-1] if cut else 0
  inner = math.prod(shape[last + 1:])
  strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
  out = []
  for combo in itertools.product(*(range(a, b) for a, b in bounds[:last])):
    base = sum(c * s for c, s in zip(combo, strides))
    a, b = bounds[last] if shape else (0, 1)
    out.append((base + a * inner, base + b * inner,
                tuple(c - bounds[k][0] for k, c in enumerate(combo))))
  return out


def _read_remote(entry: Entry, index: Sequence[slice]) -> np.ndarray:
  """Byte-range reads of `index`'s runs (run i fills row i of the output seen as [runs, -1]:
  `runs` lists them in row-major order of their positions)."""
  dtype = DTYPES[entry.dtype]
  shape = tuple(b - a for a, b in (s.indices(d)[:2] for s, d in zip(index, entry.shape)))
  out = np.empty(shape, dtype)
  pieces = runs(entry.shape, index)
  if out.size == 0:
    return out
  rows = out.reshape(len(pieces), -1)
  fs, inner = filesystem(entry.file)
  try:
    with fs.open(inner, "rb") as f:
      for group in _merged(pieces, dtype.itemsize):
        lo, hi = pieces[group[0]][0], pieces[group[-1]][1]
        f.seek(entry.start + lo * dtype.itemsize)
        block = np.frombuffer(f.read((hi - lo) * dtype.itemsize), dtype)
        for i in group:
          rows[i] = block[pieces[i][0] - lo:pieces[i][1] - lo]
  except OSError as e:
    raise StorageError(f"could not read {entry.file}: {e}") from e
  return out


def _merged(pieces, itemsize: int) -> list[list[int]]:
  """Indices of consecutive runs grouped so that gaps under MERGE_GAP bytes are read along
  (fewer requests to an object store, at most MERGE_GAP extra bytes per gap)."""
  groups = [[0]]
  for i in range(1, len(pieces)):
    if (pieces[i][0] - pieces[i - 1][1]) * itemsize <= MERGE_GAP:
      groups[-1].append(i)
    else:
      groups.append([i])
  return groups


# ------------------------------------------------------------------------------------------
# Writing


class Planned(NamedTuple):
  """A tensor to write: its key, dtype code and shape (the bytes come later, in order)."""
  key: str
  dtype: str
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def header_bytes(tensors: Sequence[Planned], metadata: dict | None = None) -> bytes:
  """The 8-byte length and the JSON header of a file holding `tensors` in this order."""
  header, offset = {}, 0
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for t in tensors:
    header[t.key] = {"dtype": t.dtype, "shape": list(t.shape),
                     "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-(8 + len(text)) % _ALIGN)
  return struct.pack("<Q", len(text)) + text


def write_file(path: str, tensors: Sequence[Planned], produce: Callable[[Planned], np.ndarray],
               metadata: dict | None = None) -> None:
  """Writes one safetensors file: the header, then `produce(t)` for each tensor in order
  (each checked against its plan; one tensor in host memory at a time).

  Raises:
    CheckpointError: a produced array whose shape or dtype differs from its plan.
    StorageError: the file can't be written.
  """
  fs, inner = filesystem(path)
  try:
    with fs.open(inner, "wb") as f:
      f.write(header_bytes(tensors, metadata))
      for t in tensors:
        a = np.ascontiguousarray(produce(t))
        if a.shape != tuple(t.shape) or CODES.get(a.dtype) != t.dtype:
          raise CheckpointError(f"tensor {t.key!r} came out {a.dtype}{list(a.shape)}, planned "
                                f"{t.dtype}{list(t.shape)}; fix the map's transform.")
        f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8).data)
  except OSError as e:
    raise StorageError(f"could not write {path}: {e}") from e
