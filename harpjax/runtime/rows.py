"""A cut sent per data-parallel replica pair: each producer replica's rows go to the consumer
replicas whose rows overlap them, device to device, without gathering the value first.

A value crossing a cut between two data-parallel stages is split on its first axis (its rows:
``batch_spec``) ``dp_p`` ways on the producer and ``dp_c`` ways on the consumer. Sent per
replica pair, producer replica ``i`` sends rows ``[max(i/dp_p, j/dp_c), min((i+1)/dp_p,
(j+1)/dp_c))`` (as fractions of the rows) to every consumer replica ``j`` they overlap: the
``lcm(dp_p, dp_c)`` row blocks, ``dp_p + dp_c - gcd(dp_p, dp_c)`` pieces
(:func:`replica_pieces`). The consumer's replica joins its pieces in row order on one of its
devices and copies the result to the other devices holding the same rows (its tensor-parallel
peers: a move inside the stage). This is the message pattern the cost model prices with
``cut_time_s(b, bw, lat, curve, hp, hc)`` (``docs/cost_model.md``).

:func:`move_rows` does it for one value in one process (the local runtime's every
``put``); values it cannot split (not divided only along their rows on either side, key
arrays, another memory kind) go through ``jax.device_put`` as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from harpjax.compiler.layers import LogicalMesh

__all__ = ["RowPiece", "replica_pieces", "equal_ranges", "row_ranges", "pieces_between",
           "move_rows", "PieceKey", "member_rows", "member_pieces"]


@dataclasses.dataclass(frozen=True)
class RowPiece:
  """One message of a cut sent per replica pair.

  Attributes:
    src: the producer's replica (index of its row range, in row order).
    dst: the consumer's replica.
    start, stop: the rows it carries, ``[start, stop)`` of the value's first axis.
  """
  src: int
  dst: int
  start: int
  stop: int

  @property
  def rows(self) -> int:
    return self.stop - self.start


def replica_pieces(rows: int, src_ranges: Sequence[tuple[int, int]],
                   dst_ranges: Sequence[tuple[int, int]]) -> list[RowPiece]:
  """The pieces of a cut: every overlapping pair of a producer row range and a consumer one.

  Args:
    rows: the value's rows (its first axis).
    src_ranges: per producer replica, its rows ``[start, stop)``, in row order, covering
      ``[0, rows)`` without overlap.
    dst_ranges: per consumer replica, likewise.

  Returns:
    The pieces, ordered by consumer replica, then rows; for ``dp_p`` and ``dp_c`` equal
    ranges, ``dp_p + dp_c - gcd(dp_p, dp_c)`` of them, each a whole number of the
    ``lcm(dp_p, dp_c)`` row blocks.

  Raises:
    ValueError: the ranges of a side do not tile ``[0, rows)``.
  """
  for name, ranges in (("producer", src_ranges), ("consumer", dst_ranges)):
    at = 0
    for a, b in ranges:
      if a != at or b <= a:
        raise ValueError(f"the {name}'s row ranges {list(ranges)} do not tile [0, {rows})")
      at = b
    if at != rows:
      raise ValueError(f"the {name}'s row ranges {list(ranges)} do not tile [0, {rows})")
  out = []
  for j, (c0, c1) in enumerate(dst_ranges):
    for i, (p0, p1) in enumerate(src_ranges):
      a, b = max(p0, c0), min(p1, c1)
      if a < b:
        out.append(RowPiece(i, j, a, b))
  return out


def equal_ranges(rows: int, ways: int) -> list[tuple[int, int]]:
  """``ways`` equal row ranges of ``[0, rows)`` (``ways`` divides ``rows``)."""
  per = rows // ways
  return [(k * per, (k + 1) * per) for k in range(ways)]


def row_ranges(sharding: Sharding, shape: Sequence[int]) -> dict | None:
  """Device -> its rows ``(start, stop)`` of a value of ``shape`` in ``sharding``, or ``None``
  when the sharding divides the value along any other axis (or it has no rows: a scalar).
  Devices are in the sharding's order."""
  if not shape:
    return None
  out = {}
  for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
    for ax, sl in enumerate(idx[1:], start=1):
      if (sl.start or 0) != 0 or sl.stop not in (None, shape[ax]) or sl.step not in (None, 1):
        return None
    r = idx[0]
    if r.step not in (None, 1):
      return None
    out[dev] = (r.start or 0, shape[0] if r.stop is None else r.stop)
  return out


def pieces_between(src: Sharding, dst: Sharding, shape: Sequence[int]):
  """The replica-pair pieces of moving a value of ``shape`` from ``src`` to ``dst``:
  ``(pieces, src_ranges, dst_ranges, src_devices, dst_devices)`` with per replica (distinct row
  range, in row order) its devices; ``None`` when either sharding divides the value along
  another axis than its rows."""
  rs, rd = row_ranges(src, shape), row_ranges(dst, shape)
  if rs is None or rd is None:
    return None
  s_dev, d_dev = _replicas(rs), _replicas(rd)
  s_ranges, d_ranges = sorted(s_dev), sorted(d_dev)
  pieces = replica_pieces(shape[0], s_ranges, d_ranges)
  return (pieces, s_ranges, d_ranges, [s_dev[r] for r in s_ranges],
          [d_dev[r] for r in d_ranges])


def _replicas(ranges: dict) -> dict:
  out: dict = {}
  for dev, r in ranges.items():
    out.setdefault(r, []).append(dev)
  return out


def _movable(x, sharding) -> bool:
  return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
          and x.is_fully_addressable and sharding.is_fully_addressable
          and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          and x.sharding.memory_kind == sharding.memory_kind)


def move_rows(x, sharding: Sharding):
  """``x`` in ``sharding``, each producer replica's rows sent to the consumer replicas they
  overlap (see the module docstring).

  Where ``x`` is already in ``sharding`` it is returned; where the two shardings give every
  device the same rows (``dp_p == dp_c``), or the value cannot be split by rows, it goes
  through ``jax.device_put`` (which copies shard by shard in the first case). Otherwise no
  byte passes through host memory: each piece is sliced on a producer device holding it,
  copied to the first device of its consumer replica, joined there in row order, and the
  joined rows copied to the replica's other devices.
  """
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if not _movable(x, sharding):
    return jax.device_put(x, sharding)
  plan = pieces_between(x.sharding, sharding, x.shape)
  if plan is None:
    return jax.device_put(x, sharding)
  pieces, s_ranges, d_ranges, s_devs, d_devs = plan
  if s_ranges == d_ranges:   # the same rows on both sides: device_put copies shard by shard
    return jax.device_put(x, sharding)
  data = {s.device: s.data for s in x.addressable_shards}
  joined: dict = {}
  for j in range(len(d_ranges)):
    home = d_devs[j][0]
    parts = []
    for pc in (p for p in pieces if p.dst == j):
      p0, p1 = s_ranges[pc.src]
      shard = data[_nearest(s_devs[pc.src], home)]
      if (pc.start, pc.stop) != (p0, p1):
        shard = _rows(shard, pc.start - p0, pc.stop - p0)
      parts.append(jax.device_put(shard, home))
    joined[j] = parts[0] if len(parts) == 1 else _join(parts)
  index = {r: j for j, r in enumerate(d_ranges)}
  ranges = row_ranges(sharding, x.shape)
  arrays = []
  for dev in sharding.addressable_devices_indices_map(x.shape):
    j = index[ranges[dev]]
    a = joined[j]
    arrays.append(a if dev == d_devs[j][0] else jax.device_put(a, dev))
  return jax.make_array_from_single_device_arrays(x.shape, sharding, arrays)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rows(x, start: int, stop: int):
  """Rows ``[start, stop)`` of ``x``, on its device (static bounds: no index leaves the host)."""
  return jax.lax.slice_in_dim(x, start, stop, axis=0)


@jax.jit
def _join(parts):
  return jnp.concatenate(parts, axis=0)


def _nearest(devices, target):
  """Of the producer devices holding a piece, the one to send it from: ``target`` itself or
  one of its process if any holds it, else the first."""
  for d in devices:
    if d == target:
      return d
  for d in devices:
    if d.process_index == target.process_index:
      return d
  return devices[0]



# --------------------------------------------------------------------------- across processes


class PieceKey(NamedTuple):
  """The key of one process's piece of a cut message: the message's
  :class:`~harpjax.runtime.interpreter.MessageKey` fields and the sending member (``rank``
  of its stage's group; ``0`` for a stage in one process)."""
  kind: str
  index: int
  src: int
  rank: int


def member_rows(spec, logical_mesh, ranks: Sequence[int], shape: Sequence[int]):
  """Per member of a stage (process, by rank), the rows ``(start, stop)`` of a value of
  ``shape`` its devices hold, or ``None`` when the value is not split by rows alone (or has
  none: a scalar).

  Args:
    spec: the value's ``PartitionSpec`` on the stage's mesh.
    logical_mesh: the stage's ``(dp, tp)`` or ``(dp, tp, ep)``.
    ranks: per device of the stage, in submesh order, the member holding it.
    shape: the value's shape.

  Raises:
    ValueError: a member's devices hold rows that are not one contiguous range.
  """
  if not shape:
    return None
  spec = tuple(spec)
  if any(e is not None for e in spec[1:]):
    return None
  lm = LogicalMesh.of(logical_mesh)
  names, mshape = lm.axis_names, lm.shape
  axes = () if not spec or spec[0] is None else (
      (spec[0],) if isinstance(spec[0], str) else tuple(spec[0]))
  ways = int(np.prod([mshape[names.index(a)] for a in axes])) if axes else 1
  if shape[0] % ways:
    return None
  per = shape[0] // ways
  size = max(ranks) + 1
  held: list[set] = [set() for _ in range(size)]
  for k, r in enumerate(ranks):
    coords = np.unravel_index(k, mshape)
    rep = 0
    for a in axes:
      rep = rep * mshape[names.index(a)] + int(coords[names.index(a)])
    held[r].add(rep)
  out = []
  for r, reps in enumerate(held):
    lo, hi = min(reps), max(reps) + 1
    if len(reps) != hi - lo:
      raise ValueError(f"member {r} holds replicas {sorted(reps)}: not one range of rows")
    out.append((lo * per, hi * per))
  return tuple(out)


def member_pieces(src_rows: Sequence[tuple[int, int]], dst_rows: Sequence[tuple[int, int]]
                  ) -> list[tuple[int, int, int, int]]:
  """The pieces of a cut between two stages' members: ``(src rank, dst rank, start, stop)``.

  Members holding the same rows (a replica wider than a host) send them once, from the first
  of them; every receiving member gets all its rows (one holding the same rows as another
  receives its own copy).
  """
  first: dict = {}
  for r, rng in enumerate(src_rows):
    first.setdefault(rng, r)
  out = []
  for d, (c0, c1) in enumerate(dst_rows):
    for (p0, p1), r in sorted(first.items()):
      a, b = max(p0, c0), min(p1, c1)
      if a < b:
        out.append((r, d, a, b))
  return out
