"""The planner's sparse index: the feasible (range, submesh) entries as flat arrays.

:class:`SparseIndex` is what the DP kernels of :mod:`harpjax.compiler.plan.dp_kernel` read (as
one :class:`~harpjax.compiler.plan.dp_kernel.DPArrays`): the entries that fit a device with one
microbatch in flight, grouped by (subcluster, first layer, submesh) and sorted by time, with the
device states of :func:`device_states` and the cut costs. :meth:`SparseIndex.run` runs the DP at one
candidate ``t_max``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from harpjax.cluster import bin_pack, is_divisibility_chain
from harpjax.compiler.plan import dp_kernel
from harpjax.compiler.profile import CostTables, cut_fees
from harpjax.errors import PlanError

__all__ = ["SparseIndex", "DeviceStates", "device_states"]


@dataclasses.dataclass(frozen=True, eq=False)
class SparseIndex:
  """The feasible (range, submesh) entries as flat arrays (the kernels' input).

  Entries of subcluster ``k`` starting at layer ``i`` are ``ptr[k, i] .. ptr[k, i + 1] - 1``,
  by submesh and then by time, so at candidate ``tau`` the active ones are a prefix of each
  (subcluster, first layer, submesh) group (``arrays.sp_ptr``). ``E``
  entries.

  Attributes:
    num_layers: ``L``.
    offsets: ``[K + 1]`` device offsets.
    arrays: what the kernels read (:class:`~harpjax.compiler.plan.dp_kernel.DPArrays`): the
      device states' transitions, ``ent_ptr`` ``[K, L + 1]``, per entry its last layer,
      submesh, seconds, parameter and activation bytes, the device memory and the cut costs.
    states: the :class:`DeviceStates` (:func:`device_states`).
    ent_k, ent_i, ent_m: ``[E]`` subcluster, first layer and devices of each entry.
    candidates: the period candidates, sorted: the unique stage times ``ent_t`` and, with
      ``link_bound``, the unique cut costs (a plan's period is its slowest stage or cut).
    sorted_t: sorted ``ent_t`` (active-entry counts per candidate).
    link_bound: cut costs are candidates (plans whose slowest cut is slower than their
      slowest stage are admitted).
    by_t: ``[E]`` entries in the order of ``sorted_t``.
    cut_values: sorted unique cut costs (with ``link_bound``).
    cuts: ``(first layer, last layer, subcluster, submesh) list -> [S]`` cut seconds of a
      plan where its stages sit (:meth:`~harpjax.compiler.profile.CostTables.cut_costs`).
    cut_fee: ``[K, K, L]`` the transfer fee per microbatch of a cut after layer ``j`` from a
      stage on subcluster ``a`` to one on ``b`` (:func:`~harpjax.compiler.profile.cut_fees`),
      ``None`` where no link charges a fee.
  """
  num_layers: int
  offsets: np.ndarray
  arrays: dp_kernel.DPArrays
  states: "DeviceStates"
  ent_k: np.ndarray
  ent_i: np.ndarray
  ent_m: np.ndarray
  candidates: np.ndarray
  sorted_t: np.ndarray
  use_all_devices: bool = False
  keep_order: bool = False
  link_bound: bool = False
  by_t: np.ndarray | None = None
  cut_values: np.ndarray | None = None
  cuts: Callable | None = None
  cut_fee: np.ndarray | None = None

  @classmethod
  def build(cls, tables: CostTables, mem_scale: float = 1.0, *, use_all_devices: bool = False,
            keep_order: bool = False, link_bound: bool = False) -> "SparseIndex":
    """Indexes the entries that fit with one in-flight microbatch (``mem`` scaled).

    ``use_all_devices`` and ``keep_order`` choose the device states (:func:`device_states`);
    ``link_bound`` adds the cut costs to the candidates.
    """
    L, K = tables.num_layers, tables.num_subclusters
    mem = np.asarray(tables.device_memory_bytes, dtype=np.float64) * mem_scale
    cols = {n: [] for n in ("k", "i", "j", "s", "m", "t", "p", "a", "e")}
    for k in range(K):
      t, p, a = tables.stage_time_s[k], tables.param_mem_bytes[k], tables.act_mem_bytes[k]
      end = tables.end_time_s[k] if tables.end_time_s is not None else np.zeros_like(p)
      ok = np.isfinite(t) & (p + 1.0 * a <= mem[k])
      if tables.step_mem_bytes is not None:   # the reduction and the update fit too
        ok &= tables.step_mem_bytes[k] <= mem[k]
      ok &= np.triu(np.ones((L, L), bool))[:, :, None]
      i, j, s = np.nonzero(ok)
      sizes = np.array([n * m for n, m in tables.submeshes[k]], dtype=np.int64)
      for name, v in (("k", np.full(i.size, k)), ("i", i), ("j", j), ("s", s), ("m", sizes[s]),
                      ("t", t[i, j, s]), ("p", p[i, j, s]), ("a", a[i, j, s]),
                      ("e", end[i, j, s])):
        cols[name].append(v)
    c = {n: np.concatenate(v) for n, v in cols.items()}
    order = np.lexsort((c["j"], c["t"], c["s"], c["i"], c["k"]))
    c = {n: np.ascontiguousarray(v[order]) for n, v in c.items()}
    for n in ("k", "i", "j", "s", "m"):
      c[n] = c[n].astype(np.int64)
    keys = c["k"] * (L + 1) + c["i"]
    bounds = np.arange(K)[:, None] * (L + 1) + np.arange(L + 1)[None, :]
    ptr = np.searchsorted(keys, bounds, side="left").astype(np.int64)
    S_max = max(len(x) for x in tables.submeshes)
    sp_keys = (c["k"] * L + c["i"]) * S_max + c["s"]
    sp_ptr = np.searchsorted(sp_keys, np.arange(K * L * S_max + 1), side="left").astype(np.int64)
    # Per entry, the largest last layer of its group so far in time order (the keys grow from
    # group to group, so one running maximum serves them all).
    ent_jmax = np.maximum.accumulate(sp_keys * (L + 1) + c["j"]) - sp_keys * (L + 1)
    st = device_states(tables, use_all_devices=use_all_devices, keep_order=keep_order)
    mv_ptr, mv_state, mv_sub, mv_host = dp_kernel.moves(st)
    arrays = dp_kernel.DPArrays(
        st.sub, st.stay, st.leave, st.end, st.roots, np.ascontiguousarray(ptr), c["j"], c["s"],
        c["t"].astype(np.float64), c["p"].astype(np.float64), c["a"].astype(np.float64), mem,
        np.ascontiguousarray(tables.pair_comm_s), mv_ptr, mv_state, mv_sub,
        c["e"].astype(np.float64), sp_ptr, ent_jmax.astype(np.int64),
        *dp_kernel.fitting_submeshes(mv_ptr, st.end),
        *dp_kernel.link_rows(mv_sub, mv_host, st.sub, mv_ptr, S_max, tables.pair_comm_s,
                             tables.host_comm_s),
        *dp_kernel.moves_into(mv_ptr, mv_state, st.sub.size), c["i"], c["m"])
    cand = c["t"]
    cut_values = np.zeros(0)
    if link_bound and L > 1:
      cuts = tables.pair_comm_s[:, :, :L - 1]
      linked = np.array([[a == b or tables.linked(a, b) for b in range(K)] for a in range(K)])
      cut_values = cuts[linked].ravel()
      hosts = [k for k in range(K) if tables.host_priced[k]]
      cut_values = np.concatenate([cut_values, tables.host_comm_s[hosts, :L - 1].ravel()])
      cut_values = np.unique(cut_values[np.isfinite(cut_values) & (cut_values > 0)])
      cand = np.concatenate([cand, cut_values])
    by_t = np.argsort(c["t"], kind="stable")
    return cls(num_layers=L, offsets=tables.device_offsets, arrays=arrays, states=st,
               ent_k=c["k"], ent_i=c["i"], ent_m=c["m"], candidates=np.unique(cand),
               sorted_t=c["t"][by_t], use_all_devices=use_all_devices,
               keep_order=keep_order, link_bound=link_bound, by_t=by_t.astype(np.int64),
               cut_values=cut_values, cuts=tables.cut_costs, cut_fee=cut_fees(tables))

  @functools.cached_property
  def ends(self) -> tuple[np.ndarray, np.ndarray]:
    """``(end_ptr, by_end)``: the entries by (subcluster ``k``, *last* layer ``j``, submesh
    ``s``), each group sorted by time (ties by entry): those of the group ``x = (k L + j)
    S_max + s`` are ``by_end[end_ptr[x] .. end_ptr[x + 1] - 1]``. The bounded search
    (:func:`~harpjax.compiler.plan.dp_kernel.bounded_search`) reads the index's entries in
    this order; built on its first use."""
    ix = self.arrays
    K, L, S_max = ix.ent_ptr.shape[0], self.num_layers, ix.st_stay.shape[1]
    key = (self.ent_k * L + ix.ent_j) * S_max + ix.ent_s
    by_end = np.lexsort((np.arange(key.size), ix.ent_t, key))
    end_ptr = np.searchsorted(key[by_end], np.arange(K * L * S_max + 1), side="left")
    return end_ptr.astype(np.int64), by_end.astype(np.int64)

  @property
  def num_entries(self) -> int:
    return int(self.ent_k.size)

  def path_cuts(self, path: np.ndarray) -> np.ndarray:
    """``[S]`` seconds of the cut after each stage of a DP path (entry indices), ``0`` after
    the last: where the stages sit, as :func:`~harpjax.compiler.plan.evaluate_plan` prices
    them."""
    return np.asarray(self.cuts([self.entry(int(e)) for e in path]), np.float64)

  def entry(self, e: int) -> tuple[int, int, int, int]:
    """Entry ``e`` as a plan stage: ``(first layer, last layer, subcluster, submesh)``."""
    return (int(self.ent_i[e]), int(self.arrays.ent_j[e]), int(self.ent_k[e]),
            int(self.arrays.ent_s[e]))

  def active_entries(self, tau: float) -> int:
    return int(np.searchsorted(self.sorted_t, tau, side="right"))

  def n_cap(self, num_microbatches: int, check_comm: bool = True) -> int:
    """Largest warm-up count a state can need: ``<= B``, ``1 + 3 (S - 1)``, memory."""
    key = ("n_cap", int(num_microbatches), bool(check_comm))
    cache = self.__dict__.setdefault("_memo", {})
    if key not in cache:
      cache[key] = self._n_cap(int(num_microbatches), bool(check_comm))
    return cache[key]

  def _n_cap(self, num_microbatches: int, check_comm: bool) -> int:
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
          n_cap: int | None = None, discount: float = 0.0,
          lb: np.ndarray | None = None, sb: np.ndarray | None = None,
          link_hits: bool | None = None, hit_cap: int | None = None,
          end_path: bool = False, lbf: np.ndarray | None = None,
          pricing: dp_kernel.Pricing | None = None
          ) -> tuple[float, np.ndarray] | tuple[float, float, float, np.ndarray]:
    """Runs the DP at ``tau``; see :func:`harpjax.compiler.plan.dp_kernel.solve_tau` (cuts
    of ``tau`` are hits when the index is ``link_bound``, unless ``link_hits`` says otherwise;
    ``lb``, ``sb``, ``lbf``: a :meth:`prefix_bound`, :meth:`suffix_bound` and
    the forward half of :meth:`prefix_bounds`, at ``tau`` or above). ``end_path`` counts every
    stage's end
    time (where the entries have any; the suffix without a hit is pruned by
    :meth:`hit_end`). ``pricing``: the objectives with prices (:meth:`pricing`; the result is
    then ``(value, rate, cost, path)``)."""
    fn = dp_kernel.solve_tau if kernel == "numba" else dp_kernel.solve_tau_numpy
    if n_cap is None:
      n_cap = self.n_cap(num_microbatches, check_comm)
    hits = self.link_bound if link_hits is None else link_hits
    if pricing is not None:
      discount, end_path = 0.0, False
    if hit_cap is None and discount > 0 and require_hit:
      hit_cap = self.hit_cap(tau, num_microbatches)
    end_path = bool(end_path and require_hit and self.has_ends)
    hit_e = 0.0   # the least end time of the plan's last hit (a cut of tau: none)
    if end_path and (self.link_bound or not hits):
      hit_e = self.hit_end(tau) if hits else self._stage_hit_end(tau)
    return fn(self.arrays, tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound,
              hits, discount, lb=lb, sb=sb, hit_cap=hit_cap, end_path=end_path, lbf=lbf,
              hit_e=hit_e, hit_j=self.first_hit_layer(tau, hits) if require_hit else -1,
              pricing=pricing)

  def feasible(self, tau: float, num_microbatches: int, eps: float, *,
               check_comm: bool = True, lb: np.ndarray | None = None,
               sb: np.ndarray | None = None, use_numba: bool = True) -> bool:
    """Whether :meth:`run` with ``require_hit=False`` finds a plan at ``tau``
    (:func:`harpjax.compiler.plan.dp_kernel.feasible`: the fewest warm-ups per state, not the
    cost)."""
    return dp_kernel.feasible(self.arrays, tau, num_microbatches, eps,
                              self.n_cap(num_microbatches, check_comm), check_comm, lb, sb,
                              use_numba)

  def r_min(self, price: np.ndarray) -> float:
    """The least hourly rate of one stage (an entry's devices times its subcluster's
    ``price``): a lower bound on any plan's rate (``0`` without entries)."""
    if not self.num_entries:
      return 0.0
    key = ("r_min", np.asarray(price, np.float64).tobytes())
    cache = self.__dict__.setdefault("_memo", {})
    if key not in cache:
      cache[key] = float(np.min(np.asarray(price, np.float64)[self.ent_k] * self.ent_m))
    return cache[key]

  def pricing(self, price: np.ndarray, kind: int, rate_max: float = math.inf,
              t_limit: float = math.inf, relief: float = 0.0,
              lbr: np.ndarray | None = None, fee: np.ndarray | None = None,
              lbfee: np.ndarray | None = None) -> dp_kernel.Pricing:
    """The :class:`~harpjax.compiler.plan.dp_kernel.Pricing` of :meth:`run` for ``price`` per
    device-hour of each subcluster (the devices each state holds: :class:`DeviceStates`);
    ``lbr``: a :meth:`prefix_rate` at the candidate or above; ``fee``: the transfer fees per
    iteration of the cuts (:meth:`fees`), ``lbfee`` a :meth:`prefix_fee` at the candidate or
    above."""
    return dp_kernel.Pricing(self.states.held, np.asarray(price, np.float64), int(kind),
                             float(rate_max), float(t_limit), float(relief),
                             np.zeros((0, 0)) if lbr is None else lbr,
                             np.zeros((0, 0, 0)) if fee is None else fee,
                             np.zeros((0, 0)) if lbfee is None else lbfee)

  def fees(self, num_microbatches: int) -> np.ndarray | None:
    """``[K, K, L]`` the transfer fee per iteration of each cut (:attr:`cut_fee` times ``B``),
    ``None`` where no link charges a fee."""
    if self.cut_fee is None:
      return None
    key = ("fees", int(num_microbatches))
    cache = self.__dict__.setdefault("_memo", {})
    if key not in cache:
      cache[key] = np.ascontiguousarray(self.cut_fee * float(num_microbatches))
    return cache[key]

  def path_fee(self, path: np.ndarray, num_microbatches: int) -> float:
    """The transfer fee per iteration of a DP path (entry indices): each cut's
    :meth:`fees` (``0`` without fees)."""
    fee = self.fees(num_microbatches)
    if fee is None:
      return 0.0
    e = np.asarray(path, np.int64)
    return float(sum(fee[self.ent_k[a], self.ent_k[b], self.arrays.ent_j[a]]
                     for a, b in zip(e[:-1], e[1:])))

  def prefix_fee(self, tau: float, num_microbatches: int) -> np.ndarray | None:
    """:func:`harpjax.compiler.plan.dp_kernel.prefix_fee` at ``tau`` (``None`` without
    fees)."""
    fee = self.fees(num_microbatches)
    return None if fee is None else dp_kernel.prefix_fee(self.arrays, tau, fee)

  def least_fee(self, num_microbatches: int) -> float:
    """A lower bound on the transfer fee per iteration of any plan of any candidate period:
    the least fee of a whole plan at the largest candidate (memory ignored; ``0`` without
    fees or where a plan pays none)."""
    if self.cut_fee is None or not self.candidates.size:
      return 0.0
    key = ("least_fee", int(num_microbatches))
    cache = self.__dict__.setdefault("_memo", {})
    if key not in cache:
      lbfee = self.prefix_fee(float(self.candidates[-1]), num_microbatches)
      least = float(lbfee[self.num_layers, 0])
      cache[key] = least if math.isfinite(least) else 0.0
    return cache[key]

  def cover_rates(self, price: np.ndarray, num_points: int = 256) -> np.ndarray:
    """Per candidate ``tau`` (:attr:`candidates`), a lower bound on the rate (price per hour)
    of any plan whose stages all take at most ``tau``: the cheapest cover of the layers by
    entries of time ``<= tau`` (devices and memory otherwise ignored). Exact at up to
    ``num_points`` candidates spread over the sorted ones; between them, the value at the next
    one up (the cheapest cover only gets cheaper as ``tau`` grows). Kept per ``price``."""
    price = np.asarray(price, np.float64)
    key = ("cover", price.tobytes(), int(num_points))
    cache = self.__dict__.setdefault("_memo", {})
    if key not in cache:
      cache[key] = self._cover_rates(price, int(num_points))
    return cache[key]

  def _cover_rates(self, price: np.ndarray, num_points: int) -> np.ndarray:
    cand = self.candidates
    M, L = cand.size, self.num_layers
    if M == 0 or self.num_entries == 0:
      return np.zeros(M)
    a = self.arrays
    grid = np.unique(np.linspace(0, M - 1, min(M, num_points)).round().astype(np.int64))
    at_grid = dp_kernel.cover_costs(self.ent_i, a.ent_j, a.ent_t, price[self.ent_k] * self.ent_m,
                                    cand[grid], L)
    return at_grid[np.searchsorted(grid, np.arange(M))]

  def prefix_rate(self, tau: float, price: np.ndarray) -> np.ndarray:
    """:func:`harpjax.compiler.plan.dp_kernel.prefix_rate` at ``tau``."""
    return dp_kernel.prefix_rate(self.arrays, tau, self.states.held, price)

  def first_hit_layer(self, tau: float, link_hits: bool) -> int:
    """The first layer that a stage of time exactly ``tau`` ends, or (with ``link_hits``) that
    a cut of ``tau`` may follow (``L``: none): a plan of period ``tau`` has its hit there or
    later."""
    lo = int(np.searchsorted(self.sorted_t, tau, side="left"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    first = self.num_layers
    if hi > lo:
      first = int(np.min(self.arrays.ent_j[self.by_t[lo:hi]]))
    if link_hits:
      cols = np.flatnonzero((self.arrays.c_link == tau).any(axis=0))
      if cols.size:
        first = min(first, int(cols[0]))
    return first

  @functools.cached_property
  def has_ends(self) -> bool:
    """Whether some entry has an end-of-iteration time."""
    return bool(np.any(self.arrays.ent_e > 0))

  def hit_cap(self, tau: float, num_microbatches: int) -> int:
    """The most microbatches (``<= B``) a stage of time exactly ``tau`` can hold in memory;
    ``1`` when no entry takes ``tau`` (the period is then a cut's)."""
    lo = int(np.searchsorted(self.sorted_t, tau, side="left"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    B = int(num_microbatches)
    if lo == hi:
      return 1
    e = self.by_t[lo:hi]
    a, p = self.arrays.ent_a[e], self.arrays.ent_p[e]
    room = self.arrays.mem[self.ent_k[e]] - p
    with np.errstate(divide="ignore", invalid="ignore"):
      n = np.where(a > 0, np.floor(room / np.where(a > 0, a, 1.0)), B)
    return int(max(1, min(B, n.max())))

  def hit_end(self, tau: float) -> float:
    """The least end time (:attr:`~harpjax.compiler.profile.CostTables.end_time_s`) of the
    entries that take exactly ``tau`` (``0`` when none does, or a cut takes ``tau`` too): a
    plan of period ``tau`` has such a stage, which runs ``B`` forwards and backwards and then
    its end, so its simulated time is at least ``B tau`` plus this."""
    if self.link_bound and self.cut_values is not None and self.cut_values.size:
      x = int(np.searchsorted(self.cut_values, tau))
      if x < self.cut_values.size and self.cut_values[x] == tau:
        return 0.0
    return self._stage_hit_end(tau)

  @functools.cached_property
  def candidate_hit_ends(self) -> np.ndarray:
    """``[M]``: :meth:`hit_end` of every period candidate, in one pass (the search's floors
    read it once per candidate; the same numbers, minima of the same floats)."""
    cand = self.candidates
    out = np.zeros(cand.size)
    if self.sorted_t.size:
      times, starts = np.unique(self.sorted_t, return_index=True)
      least = np.minimum.reduceat(self.arrays.ent_e[self.by_t], starts)
      pos = np.minimum(np.searchsorted(times, cand), times.size - 1)
      hit = times[pos] == cand
      out[hit] = least[pos[hit]]
    if self.link_bound and self.cut_values is not None and self.cut_values.size:
      out[np.isin(cand, self.cut_values)] = 0.0
    return out

  def _stage_hit_end(self, tau: float) -> float:
    """The least end time of the entries of time exactly ``tau`` (``0``: none)."""
    lo = int(np.searchsorted(self.sorted_t, tau, side="left"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    if lo == hi:
      return 0.0
    return float(np.min(self.arrays.ent_e[self.by_t[lo:hi]]))

  def is_stage_time(self, tau: float) -> bool:
    """Whether some entry takes exactly ``tau``."""
    x = int(np.searchsorted(self.sorted_t, tau))
    return x < self.sorted_t.size and self.sorted_t[x] == tau

  def prefix_bound(self, tau: float, check_comm: bool = True,
                   live: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """:func:`harpjax.compiler.plan.dp_kernel.prefix_bound` at ``tau``; given ``live``, a
    :meth:`prefix_bound` and a :meth:`suffix_bound` at a candidate at or above ``tau``, only
    through the states that have both there (:meth:`prefix_bounds`): the same bound on every
    state with a suffix at ``tau`` (each state of such a prefix has one there, and a prefix
    at ``tau``, so both at the larger candidate), ``inf`` on some without one, so a
    :meth:`suffix_bound` from it is the same too."""
    if live is None:
      return dp_kernel.prefix_bound(self.arrays, tau, check_comm)
    return dp_kernel.prefix_bounds(self.arrays, tau, -1.0, check_comm, live)[0]

  def prefix_bounds(self, tau: float, fwd_fraction: float, check_comm: bool = True,
                    live: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`harpjax.compiler.plan.dp_kernel.prefix_bounds` at ``tau``: :meth:`prefix_bound`
    and the forward half of the same prefixes (through the ``live`` states only, given)."""
    return dp_kernel.prefix_bounds(self.arrays, tau, fwd_fraction, check_comm, live)

  def grow_prefix_bounds(self, old_tau: float, tau: float, fwd_fraction: float,
                         bounds: tuple[np.ndarray, np.ndarray], check_comm: bool = True,
                         live: tuple[np.ndarray, np.ndarray] | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`prefix_bounds` at ``tau`` from ``bounds``, those at a smaller ``old_tau`` (the
    same ``fwd_fraction``, ``check_comm`` and ``live``; overwritten): the same arrays, from
    the entries that join between the two and the states whose bound falls
    (:func:`harpjax.compiler.plan.dp_kernel.grow_prefix_bounds`); a fresh
    :meth:`prefix_bounds` where a cut's time lies between the two (``check_comm``: its moves
    open, which the growth does not revisit)."""
    c = self.arrays.c_link
    if check_comm and np.any((c > old_tau) & (c <= tau)):
      return self.prefix_bounds(tau, fwd_fraction, check_comm, live)
    lo = int(np.searchsorted(self.sorted_t, old_tau, side="right"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    e = self.by_t[lo:hi]
    fresh = np.zeros((self.arrays.ent_ptr.shape[0], self.num_layers), np.bool_)
    fresh[self.ent_k[e], self.ent_i[e]] = True
    return dp_kernel.grow_prefix_bounds(self.arrays, old_tau, tau, fwd_fraction, bounds[0],
                                        bounds[1], fresh, check_comm, live)

  def suffix_bound(self, tau: float, lb: np.ndarray, check_comm: bool = True) -> np.ndarray:
    """:func:`harpjax.compiler.plan.dp_kernel.suffix_bound` at ``tau``."""
    return dp_kernel.suffix_bound(self.arrays, tau, lb, check_comm)

  def hit_floor(self, tau: float, lb: np.ndarray, lbf: np.ndarray, sb: np.ndarray,
                num_microbatches: int, n_hit: int, fwd_fraction: float) -> float:
    """A lower bound on the simulated time of any plan of period ``tau`` (given
    :meth:`prefix_bounds` and :meth:`suffix_bound` at ``tau`` or above): ``(B - 1) tau`` plus
    :func:`harpjax.compiler.plan.dp_kernel.hit_floor` over the entries of that time, or
    ``B tau`` alone when a cut may take ``tau`` (``inf``: no plan has that period)."""
    B = int(num_microbatches)
    base = (B - 1) * tau
    if self.link_bound and self.cut_values is not None and self.cut_values.size:
      x = int(np.searchsorted(self.cut_values, tau))
      if x < self.cut_values.size and self.cut_values[x] == tau:
        return B * tau
    lo = int(np.searchsorted(self.sorted_t, tau, side="left"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    if lo == hi:
      return math.inf
    return base + dp_kernel.hit_floor(self.arrays, lb, lbf, sb, self.by_t[lo:hi], self.ent_i,
                                      self.ent_k, tau, B, n_hit, fwd_fraction)

  def may_have_period(self, tau: float, lb: np.ndarray, sb: np.ndarray) -> bool:
    """``False`` proves no plan has period exactly ``tau`` (given :meth:`prefix_bound` and
    :meth:`suffix_bound` at ``tau`` or above): no entry of that time can be a stage of a plan
    within ``tau``, and no cut takes ``tau``."""
    if self.link_bound and self.cut_values is not None and self.cut_values.size:
      x = int(np.searchsorted(self.cut_values, tau))
      if x < self.cut_values.size and self.cut_values[x] == tau:
        return True
    lo = int(np.searchsorted(self.sorted_t, tau, side="left"))
    hi = int(np.searchsorted(self.sorted_t, tau, side="right"))
    if lo == hi:
      return False
    return dp_kernel.hit_possible(self.arrays, lb, sb, self.by_t[lo:hi], self.ent_i, self.ent_k,
                                  tau)


# --------------------------------------------------------------------------- device states


def _local_states(tables: CostTables, k: int, shapes: Sequence[tuple[int, int]],
                  use_all_devices: bool, max_states: int
                  ) -> tuple[list[dict[int, tuple[int, list[tuple[int, bool]]]]], list[int],
                             list[bool]]:
  """One subcluster's device states: what the stages so far took of it, over the submesh
  ``shapes`` (the distinct shapes of ``tables.submeshes[k]``: a state's moves depend on the
  shape alone).

  Returns ``(after, used, full)``: per local state ``u`` (``0`` is "nothing used") and submesh
  ``s`` of a stage that fits, ``after[u][s] = (held, nexts)``: the state whose devices the
  stages then hold, and the states the next stage on this subcluster may start from, each with
  whether the cut to it stays inside the stage's host (none: the stage must be the last of
  the subcluster's run); the devices each state holds and whether it holds every device. With
  ``use_all_devices`` only states that can still be completed to fill the subcluster are kept.
  """
  N, M = tables.num_hosts[k], tables.devices_per_host[k]
  cap = N * M
  if tables.host_priced[k]:
    return _placed_states(shapes, M, cap)
  if is_divisibility_chain(M, shapes):
    after = [{s: (u + n * m, [(u + n * m, False)]) for s, (n, m) in enumerate(shapes)
              if u + n * m <= cap} for u in range(cap + 1)]
    return after, list(range(cap + 1)), [u == cap for u in range(cap + 1)]
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

  keep = completable if use_all_devices else packs
  empty = (0,) * (1 + len(widths))
  ids, order, after = {empty: 0}, [empty], []
  while len(after) < len(order):
    key = order[len(after)]
    row = {}
    for s, shape in enumerate(shapes):
      nxt = add(key, shape)
      if total(nxt) > cap or not keep(nxt):
        continue
      if nxt not in ids:
        ids[nxt] = len(order)
        order.append(nxt)
        if len(order) > max_states:
          raise PlanError(
              f"subcluster {tables.subcluster_names[k]!r}: submeshes {list(shapes)} on "
              f"{N} hosts of {M} have more than {max_states} packing states; use "
              "single-host widths that divide each other and M")
      row[s] = (ids[nxt], [(ids[nxt], False)])
    after.append(row)
  used = [total(key) for key in order]
  return after, used, [u == cap for u in used]


# Modes of a subcluster's states where the stages sit as harpjax.cluster.place_stages places
# them (devices used u, the open host's fill f = u mod M): _OPEN: nothing open (f = 0), any
# stage next; _FIT: the next stage is single-host and fits the open host; _MISS: it does not
# (a whole-host stage, or a single-host one that then ends the subcluster's run).
_OPEN, _FIT, _MISS = range(3)


def _placed_states(shapes, M: int, cap: int):
  """:func:`_local_states` of a subcluster whose cuts inside a host are priced at the host
  link (:attr:`CostTables.host_priced`): the state is the device count and the mode of the
  placement (above), so that the cut after a stage knows whether the next stage joins its
  host (:func:`harpjax.cluster.host_joins`) from the state the stage leads to. A single-host
  stage that does not fit the open host may only be the last of the run (it takes a free
  host; placed that way, every cut is priced where its stages sit)."""
  keys = [(u, mode) for u in range(cap + 1) for mode in range(3)
          if (mode == _OPEN) == (u % M == 0)]
  ids = {key: x for x, key in enumerate(keys)}

  def nexts(u2: int, single: bool):
    """The state after a stage ending at ``u2`` (whose devices it holds) and the states the
    next stage may start from, each with its cut's host flag: the next stage joins this
    stage's host when this stage is single-host, its host has room and the next one fits."""
    if u2 % M == 0:
      return ids[(u2, _OPEN)], [(ids[(u2, _OPEN)], False)]
    return ids[(u2, _FIT)], [(ids[(u2, _FIT)], single), (ids[(u2, _MISS)], False)]

  after = []
  for u, mode in keys:
    f = u % M
    row = {}
    for s, (n, m) in enumerate(shapes):
      u2 = u + n * m
      if u2 > cap:
        continue
      single = n == 1 and m < M
      if single and f + m <= M and mode in (_OPEN, _FIT):
        row[s] = nexts(u2, True)
      elif single and f + m > M and mode == _MISS:
        row[s] = (nexts(u2, False)[0], [])    # the run's last stage
      elif not single and mode in (_OPEN, _MISS):
        row[s] = nexts(u2, False)
    after.append(row)
  used = [u for u, _ in keys]
  return after, used, [u == cap for u in used]


class DeviceStates(NamedTuple):
  """The DP's device states and their transitions (see :func:`device_states`).

  ``G`` states, ``S_max`` submeshes, ``K`` subclusters.

  Attributes:
    sub: ``[G]`` subcluster the next stage runs on.
    mask: ``[G]`` subclusters the plan has entered so far (bit ``k``), the current one
      included (``0`` when the order is kept: it is not needed then).
    used: ``[G]`` devices of the current subcluster the stages before hold.
    stay: ``[G, S_max]`` state after a stage on submesh ``s`` when the next stage stays on the
      same subcluster (``-1``: not allowed).
    stay_b: ``[G, S_max]`` a second such state (``-1``: none): where the stages sit decides
      the next stage's link, the state says what may come next (``_placed_states``).
    stay_host, stay_b_host: ``[G, S_max]`` whether the cut of the move to ``stay`` (and to
      ``stay_b``) stays inside the stage's host.
    leave: ``[G, S_max, K]`` state after a stage on ``s`` when the next stage runs on
      subcluster ``k2`` (``-1``: not allowed).
    end: ``[G, S_max]`` whether a stage on ``s`` may be the last one.
    held: ``[G, S_max]`` devices of the current subcluster held once a stage on ``s`` ran
      (``-1`` where it does not fit).
    roots: ``[R]`` the states a plan may start in.
  """
  sub: np.ndarray
  mask: np.ndarray
  used: np.ndarray
  stay: np.ndarray
  leave: np.ndarray
  end: np.ndarray
  held: np.ndarray
  roots: np.ndarray
  stay_b: np.ndarray
  stay_host: np.ndarray
  stay_b_host: np.ndarray


def device_states(tables: CostTables, *, use_all_devices: bool = False,
                  keep_order: bool = False, max_states: int = 200_000) -> DeviceStates:
  """The DP's device states: which subcluster the next stage runs on, what the stages before
  took of it, and (when the order is free) which subclusters the plan has entered.

  Each subcluster holds one contiguous run of stages. Subclusters whose single-host widths
  divide each other and ``M`` pack any mix of stages adding up to at most ``N * M`` devices
  (first-fit decreasing), so their state is the device count (the paper's GPU offset inside
  the subcluster). For other shapes (``(1, 4)`` on hosts of 6) the state is the multiset of
  shapes used so far, kept while it packs onto the hosts.

  After a stage the next one stays on the subcluster (cut over its own link) or moves to
  another subcluster ``k2`` linked to it (cut over that link); the devices the stages did not
  take stay unused. ``keep_order`` allows only later subclusters in the tables' order (so
  earlier ones may be skipped); otherwise any subcluster not entered yet (the state then
  records the set entered: exact over every order and subset, ``2^(K-1)`` times the states).
  With ``use_all_devices`` (HARP's Eq. 19) a stage may leave a subcluster, or end the plan,
  only when it completes it, and the plan must end having entered every subcluster (with
  ``keep_order``: the tables' order, as the paper).

  Returns:
    The :class:`DeviceStates`.

  Raises:
    PlanError: a subcluster with non-dividing widths has more than ``max_states`` states,
      or the expanded states exceed ``max_states``.
  """
  K = tables.num_subclusters
  S_max = max(len(s) for s in tables.submeshes)
  # Moves depend on a submesh's shape alone: the states are walked over each subcluster's
  # distinct shapes (first occurrences in order, so that the states are numbered as a walk over
  # every entry would number them) and the columns of the entries sharing a shape copied.
  distinct = [list(dict.fromkeys(tuple(x) for x in shapes)) for shapes in tables.submeshes]
  column = [np.array([d.index(tuple(x)) for x in shapes], np.int64)
            for d, shapes in zip(distinct, tables.submeshes)]
  local = [_local_states(tables, k, distinct[k], use_all_devices, max_states) for k in range(K)]
  full_mask = (1 << K) - 1
  if keep_order:
    starts = [0] if use_all_devices else list(range(K))
    roots = [(0, k, 0) for k in starts]
  else:
    roots = [(1 << k, k, 0) for k in range(K)]

  def successors(mask, k):
    if keep_order:
      return [k + 1] if use_all_devices and k + 1 < K else \
          ([] if use_all_devices else list(range(k + 1, K)))
    return [k2 for k2 in range(K) if not mask >> k2 & 1]

  linked = [[tables.linked(k, k2) for k2 in range(K)] for k in range(K)]
  ids: dict[tuple[int, int, int], int] = {}
  order: list[tuple[int, int, int]] = []

  def gid(key):
    x = ids.get(key)
    if x is None:
      x = ids[key] = len(order)
      order.append(key)
      if len(order) > max_states:
        raise PlanError(f"more than {max_states} device states for {K} subclusters; keep "
                        "the subcluster order (keep_order=True) or merge subclusters")
    return x

  for r in roots:
    gid(r)
  D = max(len(d) for d in distinct)
  # Per state and distinct shape: stay, stay_b (and their host flags), end, held, and leave.
  stay_d, stay_b_d, end_d, held_d, leave_d = [], [], [], [], []
  host_d, host_b_d = [], []
  g = 0
  while g < len(order):
    mask, k, u = order[g]
    g += 1
    after, used, full = local[k]
    st_row, sb_row, h_row, hb_row = [-1] * D, [-1] * D, [False] * D, [False] * D
    e_row, held_row, lv_row = [False] * D, [-1] * D, [-1] * (D * K)
    last = (mask == full_mask) if not keep_order else (k == K - 1)
    nexts = successors(mask, k)
    for s, (u2, targets) in after[u].items():
      held_row[s] = used[u2]
      if not full[u2] and targets:
        st_row[s], h_row[s] = gid((mask, k, targets[0][0])), targets[0][1]
        if len(targets) > 1:
          sb_row[s], hb_row[s] = gid((mask, k, targets[1][0])), targets[1][1]
      if use_all_devices and not full[u2]:
        continue
      for k2 in nexts:
        if linked[k][k2]:
          lv_row[s * K + k2] = gid((mask | (1 << k2) if not keep_order else 0, k2, 0))
      e_row[s] = (not use_all_devices) or last
    stay_d.append(st_row)
    stay_b_d.append(sb_row)
    host_d.append(h_row)
    host_b_d.append(hb_row)
    end_d.append(e_row)
    held_d.append(held_row)
    leave_d.append(lv_row)
  G = len(order)
  sub = np.array([k for _, k, _ in order], np.int64)
  # Each state's columns: entry s of its subcluster reads distinct shape column[k][s]; the
  # columns past the subcluster's entries stay empty (D, a column of -1 / False, appended).
  pick = np.full((K, S_max), D, np.int64)
  for k in range(K):
    pick[k, :column[k].size] = column[k]
  cols = pick[sub]
  rows = np.arange(G)[:, None]

  def spread(rows_d, fill, dtype, *tail):
    a = np.array(rows_d, dtype).reshape(G, D, *tail)
    a = np.concatenate([a, np.full((G, 1) + a.shape[2:], fill, dtype)], axis=1)
    return np.ascontiguousarray(a[rows, cols])

  return DeviceStates(
      sub=sub, mask=np.array([m for m, _, _ in order], np.int64),
      used=np.array([local[k][1][u] for _, k, u in order], np.int64),
      stay=spread(stay_d, -1, np.int64), leave=spread(leave_d, -1, np.int64, K),
      end=spread(end_d, False, np.bool_), held=spread(held_d, -1, np.int64),
      roots=np.array([ids[r] for r in roots], np.int64),
      stay_b=spread(stay_b_d, -1, np.int64), stay_host=spread(host_d, False, np.bool_),
      stay_b_host=spread(host_b_d, False, np.bool_))
