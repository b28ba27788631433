"""Submesh packing: how a subcluster's stages fit onto its hosts.

:func:`device_states` builds the DP's device states (what earlier stages took of the subcluster
the next one uses; the paper's GPU offset when single-host widths divide each other and ``M``,
else the multiset of shapes so far) for :class:`~harpjax.compiler._sparse_index.SparseIndex`;
:func:`pack_submeshes` places a plan's submeshes on the hosts for
:func:`~harpjax.compiler._plan_eval.evaluate_plan`. Both rest on the exact bin packing
:func:`_bin_pack`. Re-exported by :mod:`harpjax.compiler.planner`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from harpjax.compiler.cost_tables import CostTables
from harpjax.errors import PlanError

__all__ = ["device_states", "pack_submeshes"]


def device_states(tables: CostTables, max_states: int = 200_000
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The DP's device states: what earlier stages took of the subcluster the next one uses.

  Subclusters whose single-host widths divide each other and ``M`` pack any mix of stages
  adding up to at most ``N * M`` devices (first-fit decreasing), so their state is the device
  count and the state id is the paper's GPU offset. For other shapes (``(1, 4)`` on hosts of
  6) the state is the multiset of shapes used so far, kept while it packs onto the hosts and
  can still be completed to fill every device.

  Returns:
    ``st_sub [G]`` (subcluster of each state; state 0 is the empty first subcluster, ``G`` the
    terminal "every device used"), ``st_next [G, S_max]`` (state after a stage on submesh
    ``s``, ``-1`` if it does not fit) and ``st_exh [G, S_max]`` (that stage completes the
    subcluster: its cut uses the link to the next one).

  Raises:
    PlanError: a subcluster with non-dividing widths has more than ``max_states`` states.
  """
  K = tables.num_subclusters
  S_max = max(len(s) for s in tables.submeshes)
  per = []  # per subcluster: (transitions {state: {s: (state' | None for complete)}}, count)
  for k in range(K):
    N, M = tables.num_hosts[k], tables.devices_per_host[k]
    shapes = tables.submeshes[k]
    cap = N * M
    if _is_chain(M, shapes):
      trans = []
      for u in range(cap):
        row = {}
        for s, (n, m) in enumerate(shapes):
          if u + n * m < cap:
            row[s] = u + n * m
          elif u + n * m == cap:
            row[s] = None
        trans.append(row)
      per.append(trans)
      continue
    widths = sorted({m for n, m in shapes if n == 1 and m < M})

    def add(key, shape):
      n, m = shape
      if n > 1 or m == M:
        return (key[0] + n,) + key[1:]
      x = 1 + widths.index(m)
      return key[:x] + (key[x] + 1,) + key[x + 1:]

    def total(key):
      return key[0] * M + sum(c * w for c, w in zip(key[1:], widths))

    @functools.lru_cache(maxsize=None)
    def packs(key):
      items = [w for c, w in zip(key[1:], widths) for _ in range(c)]
      return key[0] <= N and _bin_pack(items, N - key[0], M) is not None

    @functools.lru_cache(maxsize=None)
    def completable(key):
      if not packs(key):
        return False
      if total(key) == cap:
        return True
      return any(total(key) + n * m <= cap and completable(add(key, (n, m)))
                 for n, m in shapes)

    empty = (0,) * (1 + len(widths))
    ids, order = {empty: 0}, [empty]
    trans = []
    while len(trans) < len(order):
      key = order[len(trans)]
      row = {}
      for s, shape in enumerate(shapes):
        nxt = add(key, shape)
        if total(nxt) > cap or not completable(nxt):
          continue
        if total(nxt) == cap:
          row[s] = None
        else:
          if nxt not in ids:
            ids[nxt] = len(order)
            order.append(nxt)
            if len(order) > max_states:
              raise PlanError(
                  f"subcluster {tables.subcluster_names[k]!r}: submeshes {list(shapes)} on "
                  f"{N} hosts of {M} have more than {max_states} packing states; use "
                  "single-host widths that divide each other and M")
          row[s] = ids[nxt]
      trans.append(row)
    per.append(trans)
  starts = np.concatenate([[0], np.cumsum([len(t) for t in per])]).astype(np.int64)
  G = int(starts[-1])
  st_sub = np.empty(G, np.int64)
  st_next = np.full((G, S_max), -1, np.int64)
  st_exh = np.zeros((G, S_max), np.bool_)
  for k, trans in enumerate(per):
    for u, row in enumerate(trans):
      g = starts[k] + u
      st_sub[g] = k
      for s, v in row.items():
        if v is None:
          st_next[g, s] = starts[k + 1]
          st_exh[g, s] = True
        else:
          st_next[g, s] = starts[k] + v
  return st_sub, st_next, st_exh


def _is_chain(M: int, shapes) -> bool:
  widths = sorted({m for n, m in shapes if n == 1} | {M})
  return all(b % a == 0 for a, b in zip(widths, widths[1:]))


def _bin_pack(items: Sequence[int], num_bins: int, capacity: int) -> list[int] | None:
  """Exact bin packing: a bin per item (items taken largest first), or ``None``."""
  order = sorted(range(len(items)), key=lambda x: -items[x])
  free = [capacity] * num_bins
  out = [0] * len(items)

  def place(x):
    if x == len(order):
      return True
    w, seen = items[order[x]], set()
    for b in range(num_bins):
      if free[b] >= w and free[b] not in seen:
        seen.add(free[b])
        free[b] -= w
        out[order[x]] = b
        if place(x + 1):
          return True
        free[b] += w
    return False

  return out if sum(items) <= num_bins * capacity and place(0) else None


def pack_submeshes(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]
                   ) -> list[tuple[tuple[int, int, int], ...]] | None:
  """Places submeshes on the hosts of one subcluster (exactly: ``None`` only if impossible).

  Multi-host shapes ``(n, M)`` and ``(1, M)`` take whole hosts; the others are bin-packed.

  Returns:
    Per shape ``((host, first_device, num_devices), ...)``, or ``None`` if they do not fit.
  """
  M = devices_per_host
  out: list = [None] * len(shapes)
  host = 0
  for idx, (n, m) in enumerate(shapes):
    if n > 1 or m == M:
      if host + n > num_hosts:
        return None
      out[idx] = tuple((h, 0, m) for h in range(host, host + n))
      host += n
  small = [x for x in range(len(shapes)) if out[x] is None]
  bins = _bin_pack([shapes[x][1] for x in small], num_hosts - host, M)
  if bins is None:
    return None
  fill = [0] * num_hosts
  for x, b in zip(small, bins):
    h = host + b
    out[x] = ((h, fill[h], shapes[x][1]),)
    fill[h] += shapes[x][1]
  return out
