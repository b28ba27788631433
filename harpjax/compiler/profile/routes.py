"""Link routing on the cost tables: which link a transfer between subclusters takes, and the
seconds of the transfers a mixed-type stage adds (HARP's heterogeneous subclusters, the
mixed stages of :mod:`harpjax.compiler.plan.mixed`).

* :func:`subcluster_link`: the link from a stage on subcluster ``a`` to one on ``b``: the
  tables' link between them, or subcluster ``a``'s own link between hosts when ``a == b``
  (the links :attr:`~harpjax.compiler.profile.CostTables.pair_comm_s` prices cuts on).
* :func:`group_route_s`: a mixed stage's values arrive at and leave from its first group, the
  *home*; every other group waits for its ``r`` of the ``b`` rows of the stage's inputs and
  outputs to cross from and to the home, forward and backward:
  ``2 (in_i + out_j) r / b / bw + 4 lat`` (a round trip of two messages,
  :func:`~harpjax.compiler.profile.collectives.round_trip_time_s`; ``in_i`` the boundary bytes
  of the cut before layer ``i``, ``out_j`` of the cut after ``j``, none at the ends of the
  model).
* :func:`home_sync_s`: the cross-group sum of a mixed stage's gradients as the runtime does
  it: every other group sends its gradient to the home, which sums them, updates, and sends
  the parameters back, one group after the other, ``sum over g != home of 2 (bytes / bw +
  lat)``.
* :func:`row_hosts`: the hosts of a stage that hold distinct rows of its microbatch (its
  data-parallel replicas' rows, split over its hosts): how many host pairs a cut sent per
  replica pair uses at once (:meth:`~harpjax.compiler.profile.CostTables.replica_cut_costs`).
* :func:`replica_link`: the link between a submesh's data-parallel replicas: inside a host
  for a one-host submesh, else the subcluster's link between hosts; :func:`host_link` and
  :func:`node_link` are those two links of a cluster's subcluster.

A missing link (bandwidth ``0`` in the tables) costs ``inf``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from harpjax.cluster import INTRA_HOST_LATENCY_S, Link
from harpjax.compiler.profile.collectives import round_trip_time_s

__all__ = ["subcluster_link", "group_route_s", "home_sync_s", "replica_link", "host_link",
           "node_link", "row_hosts"]


def subcluster_link(tables, a: int, b: int) -> tuple[float, float]:
  """``(bandwidth, latency)`` from a stage on subcluster ``a`` to one on ``b`` of ``tables`` (a
  :class:`~harpjax.compiler.profile.CostTables`): subcluster ``a``'s own link between hosts
  when ``a == b``; bandwidth ``0``: no link."""
  if a == b:
    return float(tables.intra_bandwidth_bytes_per_s[a]), float(tables.intra_latency_s[a])
  return (float(tables.link_bandwidth_bytes_per_s[a][b]),
          float(tables.link_latency_s[a][b]))


def group_route_s(tables, home: int, k: int, rows: int, b: int, i, j):
  """Seconds a group on subcluster ``k`` with ``rows`` of ``b`` rows waits per microbatch for
  its rows of a stage on layers ``i..j`` (scalars or index arrays) to cross from and to the
  home on ``home``: inputs and outputs forward, their cotangents backward (``inf`` without a
  link)."""
  bw, lat = subcluster_link(tables, home, k)
  L = tables.num_layers
  bb = np.asarray(tables.boundary_bytes, float)
  i, j = np.asarray(i), np.asarray(j)
  into = np.where(i > 0, bb[np.maximum(i - 1, 0)], 0.0)
  out = np.where(j < L - 1, bb[np.minimum(j, L - 1)], 0.0)
  if not bw > 0:
    return np.full(np.broadcast(into, out).shape, np.inf)
  return round_trip_time_s((into + out) * (rows / b), bw, 2.0 * lat)


def home_sync_s(tables, home: int, others: Sequence[int], nbytes):
  """Seconds of the cross-group sum of a mixed stage whose home group is on subcluster
  ``home`` and whose other groups are on ``others``: each sends its gradient, ``nbytes`` (a
  number or an array), to the home and receives the parameters back, one group after the
  other (``inf`` without a link)."""
  total = 0.0 * nbytes
  for k in others:
    bw, lat = subcluster_link(tables, home, k)
    if not bw > 0:
      return math.inf + total
    total = total + round_trip_time_s(nbytes, bw, lat)
  return total


def replica_link(submesh: Sequence[int], host_link: Link, node_link: Link) -> Link:
  """The link between the data-parallel replicas of ``submesh`` ``(n, m)``: ``host_link``
  (inside one host) when ``n == 1``, else ``node_link`` (between the subcluster's hosts)."""
  return host_link if submesh[0] == 1 else node_link


def host_link(sub) -> Link:
  """The link between two devices of one host of subcluster ``sub``: its intra-host bandwidth
  at :data:`~harpjax.cluster.INTRA_HOST_LATENCY_S`."""
  return Link(sub.intra_host_bytes_per_s, INTRA_HOST_LATENCY_S)


def node_link(cluster, sub) -> Link:
  """The link between two hosts of subcluster ``sub`` of ``cluster``
  (:meth:`~harpjax.cluster.Cluster.intra_subcluster_link`, as a plain :class:`Link`)."""
  nl = cluster.intra_subcluster_link(sub.name)
  return Link(nl.bandwidth_bytes_per_s, nl.latency_s, curve=nl.curve)


def row_hosts(submesh: Sequence[int], mesh: Sequence[int]) -> int:
  """Hosts of a stage on ``submesh`` ``(n, m)`` with logical mesh ``mesh`` ``(dp, tp[, ep])``
  that hold distinct rows of its microbatch: ``min(n, dp x ep)``. The rows are split over the
  ``dp x ep`` replicas, which take consecutive devices, host by host: a replica within one
  host leaves each of the ``n`` hosts its own rows; one spanning several hosts (``tp`` wider
  than a host) gives them the same rows (``dp x ep`` distinct sets)."""
  n = int(submesh[0])
  reps = int(mesh[0]) * (int(mesh[2]) if len(mesh) > 2 else 1)
  return max(1, min(n, reps))
