"""A short digest of a pytree's values, computed where the values are (`fingerprint`): what a
checkpoint records to name the frozen params it was trained beside (a LoRA run's base),
without saving them again."""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from fnscale import _tree
from fnscale._errors import CheckpointError

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _words(x) -> jax.Array:
  """x's bits as uint32 words: one per element (8-byte elements: two)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _sums(x) -> tuple[jax.Array, jax.Array]:
  """Two position-weighted sums of x's words, mod 2**32: each weight odd, so a change of any
  one element changes both."""
  w = _words(x)
  i = jnp.arange(w.size, dtype=jnp.uint32).reshape(w.shape)
  return (jnp.sum(w * (i * jnp.uint32(2654435761) | 1), dtype=jnp.uint32),
          jnp.sum(w * (i * jnp.uint32(40503) + jnp.uint32(0x9E3779B9) | 1), dtype=jnp.uint32))


def fingerprint(tree) -> str:
  """A 16-hex-digit digest of `tree`: its leaf paths, shapes, dtypes and every element's
  bits (two position-weighted sums per leaf, reduced on the leaf's own devices, then
  SHA-256 on the host). Equal trees give equal digests on any mesh or process count; a
  change of any element, shape, dtype or path changes it. Not a cryptographic hash of the
  values (two sums mod 2**32 per leaf): it tells apart weights, not adversaries. Every
  process of a job calls it.

  Raises:
    CheckpointError: a leaf that is not an array (e.g. a typed PRNG key).

  Examples:
    >>> import jax.numpy as jnp
    >>> import fnscale as fs
    >>> a = {"w": jnp.arange(6.0).reshape(2, 3)}
    >>> fs.checkpoint.fingerprint(a) == fs.checkpoint.fingerprint({"w": jnp.arange(6.0).reshape(2, 3)})
    True
    >>> fs.checkpoint.fingerprint(a) == fs.checkpoint.fingerprint({"w": a["w"].at[1, 2].add(1e-6)})
    False
  """
  leaves = _tree.leaves_with_paths(tree)
  for path, x in leaves:
    if not isinstance(x, (jax.Array, np.ndarray)) or jnp.issubdtype(x.dtype,
                                                                     jax.dtypes.prng_key):
      raise CheckpointError(f"fingerprint: leaf '{path}' is {_tree.got(x)}; expected arrays.")
  sums = jax.device_get(jax.jit(lambda xs: [_sums(x) for x in xs])([x for _, x in leaves]))
  h = hashlib.sha256()
  for (path, x), (a, b) in zip(leaves, sums):
    h.update(f"{path}|{tuple(x.shape)}|{np.dtype(x.dtype).name}|{int(a)}|{int(b)};".encode())
  return h.hexdigest()[:16]
