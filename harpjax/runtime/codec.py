"""Values on the wire: arrays to NumPy (PRNG keys as their key data) and framed messages.

A message crossing processes is a small Python structure (step, key, a dict of encoded arrays)
pickled with protocol 5, its array buffers sent out of band so that they are written to the
socket without a copy.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import jax
import numpy as np

__all__ = ["encode", "decode", "encoded_nbytes", "nbytes_of", "dumps", "loads", "send_frames",
           "recv_message"]

_LEN = struct.Struct("!Q")


def encode(x) -> tuple:
  """A picklable, device-free form of an array, a PRNG key array or a Python scalar."""
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return ("k", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    return ("a", np.asarray(x))
  if isinstance(x, np.ndarray):
    return ("a", x)
  if isinstance(x, np.generic):
    return ("a", np.asarray(x))
  return ("o", x)


def decode(e: tuple):
  """The inverse of :func:`encode`: NumPy arrays, JAX key arrays (on the default device), or
  the Python object."""
  tag = e[0]
  if tag == "a":
    return e[1]
  if tag == "k":
    return jax.random.wrap_key_data(e[2], impl=e[1])
  return e[1]


def encoded_nbytes(e: tuple) -> int:
  if e[0] in ("a", "k"):
    return int(e[-1].nbytes)
  return 0


def nbytes_of(x) -> int:
  """Bytes of an array (key arrays: their key data), 0 for other objects."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return int(np.prod(x.shape, dtype=np.int64)) * 8
  nb = getattr(x, "nbytes", None)
  return int(nb) if nb is not None else 0


def dumps(obj: Any) -> list:
  """``obj`` as frames: the pickled header, then each out-of-band buffer."""
  buffers: list[pickle.PickleBuffer] = []
  header = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
  return [header] + [b.raw() for b in buffers]


def loads(frames: list) -> Any:
  return pickle.loads(frames[0], buffers=frames[1:])


def send_frames(sock, frames: list) -> int:
  """Writes ``[count][len, bytes]...`` to a socket; returns the bytes written."""
  out = [_LEN.pack(len(frames))]
  total = 0
  for f in frames:
    out.append(_LEN.pack(f.nbytes if isinstance(f, memoryview) else len(f)))
    out.append(f)
  for chunk in out:
    sock.sendall(chunk)
    total += chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
  return total


def _recv_exact(sock, n: int) -> bytearray | None:
  buf = bytearray(n)
  view = memoryview(buf)
  got = 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0:
      return None
    got += k
  return buf


def recv_message(sock) -> Any | None:
  """Reads one message written by :func:`send_frames`; ``None`` at end of stream."""
  head = _recv_exact(sock, _LEN.size)
  if head is None:
    return None
  (count,) = _LEN.unpack(head)
  frames = []
  for _ in range(count):
    lb = _recv_exact(sock, _LEN.size)
    if lb is None:
      return None
    (n,) = _LEN.unpack(lb)
    data = _recv_exact(sock, n) if n else bytearray()
    if data is None:
      return None
    frames.append(data)
  return loads(frames)
