"""Submesh allocation: packing pipeline-stage submeshes onto the hosts of one subcluster.

:meth:`harpjax.cluster.Cluster.allocate_submeshes` checks the requests and calls
:func:`allocate_in_subcluster` once per subcluster; it packs single-host submeshes with
first-fit decreasing (:func:`_pack`, an exact search behind it) and hands out hosts in
pipeline order. Device indices here are local to the subcluster.
"""

from __future__ import annotations

import logging

from harpjax._cluster_types import SubCluster
from harpjax.errors import PlanError

__all__ = ["allocate_in_subcluster"]

logger = logging.getLogger(__name__)

def allocate_in_subcluster(s: SubCluster,
                           reqs: list[tuple[int, tuple[int, int]]]) -> dict[int, list[int]]:
  """Stage index -> device indices local to ``s`` for the requests on ``s``."""
  n_hosts, per_host = s.num_hosts, s.devices_per_host
  used = 0
  for i, (n, m) in reqs:
    used += n * m
    if used > s.num_devices:
      left = s.num_devices - used + n * m
      raise PlanError(f"stage {i}: submesh ({n}, {m}) does not fit on subcluster {s.name!r}: the "
                      f"stages before it already take {used - n * m} of its {s.num_devices} "
                      f"devices ({n_hosts} hosts x {per_host}), {left} left")
  whole = [(i, n) for i, (n, m) in reqs if m == per_host]
  part = [(i, m) for i, (n, m) in reqs if m < per_host]
  taken = sum(n for _, n in whole)  # <= n_hosts: the device count was checked above
  free_hosts = n_hosts - taken
  order = sorted(part, key=lambda r: (-r[1], r[0]))
  bins = _pack(order, free_hosts, per_host)
  if bins is None:
    free = [per_host] * free_hosts
    for i, m in order:  # replay first-fit decreasing to name the stage that does not fit
      fit = next((b for b, f in enumerate(free) if f >= m), None)
      if fit is None:
        raise PlanError(
            f"stage {i}: submesh (1, {m}) does not fit on subcluster {s.name!r} "
            f"({n_hosts} hosts x {per_host}): {taken} hosts go to whole-host stages and, with "
            f"the larger stages placed first, the other hosts have {free} devices free; "
            f"single-host submeshes cannot span hosts")
      free[fit] -= m
    raise PlanError(f"no packing of the stages on subcluster {s.name!r} was found within the "
                    "search limit; use fewer or larger single-host submeshes")
  units = [(i, "whole", n) for i, n in whole]
  units += [(min(i for i, _ in b), "bin", sorted(b)) for b in bins if b]
  out: dict[int, list[int]] = {}
  host = 0
  for first, kind, what in sorted(units, key=lambda u: u[0]):
    if kind == "whole":
      out[first] = list(range(host * per_host, (host + what) * per_host))
      host += what
    else:
      slot = 0
      for i, m in what:
        out[i] = list(range(host * per_host + slot, host * per_host + slot + m))
        slot += m
      host += 1
  return out


def _pack(items: list[tuple[int, int]], num_bins: int, capacity: int,
          max_nodes: int = 200_000) -> list[list[tuple[int, int]]] | None:
  """Packs ``(stage, size)`` items (sorted large first) into bins; None if impossible.

  Depth-first search whose first branch is first-fit decreasing (optimal for power-of-two
  sizes); bins with equal free space are tried once.
  """
  free = [capacity] * num_bins
  assign = [0] * len(items)
  nodes = 0

  def search(k: int) -> bool:
    nonlocal nodes
    if k == len(items):
      return True
    nodes += 1
    if nodes > max_nodes:
      return False
    size, tried = items[k][1], set()
    for b in range(num_bins):
      if free[b] >= size and free[b] not in tried:
        tried.add(free[b])
        free[b] -= size
        assign[k] = b
        if search(k + 1):
          return True
        free[b] += size
    return False

  if not search(0):
    if nodes > max_nodes:
      logger.warning("submesh packing gave up after %d search nodes", max_nodes)
    return None
  bins: list[list[tuple[int, int]]] = [[] for _ in range(num_bins)]
  for item, b in zip(items, assign):
    bins[b].append(item)
  return bins
