"""The planner's sparse index: the feasible (range, submesh) entries as flat arrays.

:class:`SparseIndex` is what the DP kernels of :mod:`harpjax.compiler.plan.dp_kernel` read (as
one :class:`~harpjax.compiler.plan.dp_kernel.DPArrays`): the entries that fit a device with one
microbatch in flight, grouped by (subcluster, first layer) and sorted by time, with the device
states of :func:`device_states` and the cut costs. :meth:`SparseIndex.run` runs the DP at one
candidate ``t_max``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from harpjax.cluster import bin_pack, is_divisibility_chain
from harpjax.compiler.plan import dp_kernel
from harpjax.compiler.profile import CostTables
from harpjax.errors import PlanError

__all__ = ["SparseIndex", "device_states"]


@dataclasses.dataclass(frozen=True, eq=False)
class SparseIndex:
  """The feasible (range, submesh) entries as flat arrays (the kernels' input).

  Entries of subcluster ``k`` starting at layer ``i`` are ``ptr[k, i] .. ptr[k, i + 1] - 1``,
  sorted by time, so at candidate ``tau`` the active ones are a prefix of each group. ``E``
  entries.

  Attributes:
    num_layers: ``L``.
    offsets: ``[K + 1]`` device offsets.
    arrays: what the kernels read (:class:`~harpjax.compiler.plan.dp_kernel.DPArrays`): the
      device states (:func:`device_states`), ``ent_ptr`` ``[K, L + 1]``, per entry its last
      layer, submesh, seconds, parameter and activation bytes, the device memory and the cut
      costs.
    ent_k, ent_i, ent_m: ``[E]`` subcluster, first layer and devices of each entry.
    candidates: sorted unique ``ent_t``: the ``t_max`` candidates.
    sorted_t: sorted ``ent_t`` (active-entry counts per candidate).
  """
  num_layers: int
  offsets: np.ndarray
  arrays: dp_kernel.DPArrays
  ent_k: np.ndarray
  ent_i: np.ndarray
  ent_m: np.ndarray
  candidates: np.ndarray
  sorted_t: np.ndarray

  @classmethod
  def build(cls, tables: CostTables, mem_scale: float = 1.0) -> "SparseIndex":
    """Indexes the entries that fit with one in-flight microbatch (``mem`` scaled)."""
    L, K = tables.num_layers, tables.num_subclusters
    mem = np.asarray(tables.device_memory_bytes, dtype=np.float64) * mem_scale
    cols = {n: [] for n in ("k", "i", "j", "s", "m", "t", "p", "a")}
    for k in range(K):
      t, p, a = tables.stage_time_s[k], tables.param_mem_bytes[k], tables.act_mem_bytes[k]
      ok = np.isfinite(t) & (p + 1.0 * a <= mem[k])
      ok &= np.triu(np.ones((L, L), bool))[:, :, None]
      i, j, s = np.nonzero(ok)
      sizes = np.array([n * m for n, m in tables.submeshes[k]], dtype=np.int64)
      for name, v in (("k", np.full(i.size, k)), ("i", i), ("j", j), ("s", s), ("m", sizes[s]),
                      ("t", t[i, j, s]), ("p", p[i, j, s]), ("a", a[i, j, s])):
        cols[name].append(v)
    c = {n: np.concatenate(v) for n, v in cols.items()}
    order = np.lexsort((c["s"], c["j"], c["t"], c["i"], c["k"]))
    c = {n: np.ascontiguousarray(v[order]) for n, v in c.items()}
    for n in ("k", "i", "j", "s", "m"):
      c[n] = c[n].astype(np.int64)
    keys = c["k"] * (L + 1) + c["i"]
    bounds = np.arange(K)[:, None] * (L + 1) + np.arange(L + 1)[None, :]
    ptr = np.searchsorted(keys, bounds, side="left").astype(np.int64)
    st_sub, st_next, st_exh = device_states(tables)
    arrays = dp_kernel.DPArrays(
        st_sub, st_next, st_exh, np.ascontiguousarray(ptr), c["j"], c["s"],
        c["t"].astype(np.float64), c["p"].astype(np.float64), c["a"].astype(np.float64), mem,
        np.ascontiguousarray(tables.intra_comm_s), np.ascontiguousarray(tables.inter_comm_s))
    return cls(num_layers=L, offsets=tables.device_offsets, arrays=arrays, ent_k=c["k"],
               ent_i=c["i"], ent_m=c["m"], candidates=np.unique(c["t"]),
               sorted_t=np.sort(c["t"]))

  @property
  def num_entries(self) -> int:
    return int(self.ent_k.size)

  def entry(self, e: int) -> tuple[int, int, int, int]:
    """Entry ``e`` as a plan stage: ``(first layer, last layer, subcluster, submesh)``."""
    return (int(self.ent_i[e]), int(self.arrays.ent_j[e]), int(self.ent_k[e]),
            int(self.arrays.ent_s[e]))

  def active_entries(self, tau: float) -> int:
    return int(np.searchsorted(self.sorted_t, tau, side="right"))

  def n_cap(self, num_microbatches: int, check_comm: bool = True) -> int:
    """Largest warm-up count a state can need: ``<= B``, ``1 + 3 (S - 1)``, memory."""
    B = int(num_microbatches)
    D = int(self.offsets[-1])
    n = B if not check_comm else min(B, 1 + 3 * (min(self.num_layers, D) - 1))
    if self.num_entries:
      a = self.arrays.ent_a
      room = self.arrays.mem[self.ent_k] - self.arrays.ent_p
      with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(a > 0, np.floor(room / np.where(a > 0, a, 1.0)) + 1, B)
      n = min(n, int(min(B, per.max())))
    return max(1, n)

  def run(self, tau: float, num_microbatches: int, eps: float, *, require_hit: bool,
          bound: float = math.inf, check_comm: bool = True, kernel: str = "numba",
          n_cap: int | None = None) -> tuple[float, np.ndarray]:
    """Runs the DP at ``tau``; see :func:`harpjax.compiler.plan.dp_kernel.solve_tau`."""
    fn = dp_kernel.solve_tau if kernel == "numba" else dp_kernel.solve_tau_numpy
    if n_cap is None:
      n_cap = self.n_cap(num_microbatches, check_comm)
    return fn(self.arrays, tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound)


# --------------------------------------------------------------------------- device states


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
    if is_divisibility_chain(M, shapes):
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
      return key[0] <= N and bin_pack(items, N - key[0], M) is not None

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
