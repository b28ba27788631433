"""The planner's DP for one candidate ``t_max``: a Numba kernel and its pure-NumPy twin.

Both take one :class:`DPArrays` (plain arrays: the sparse index of
:mod:`harpjax.compiler.plan.index`) and return the same thing: the smallest
``sum_i (t_i + 2 c_i)`` over the plans whose bottleneck is the candidate ``tau`` (or at most
``tau``, see ``require_hit``), and the plan as entry indices.

State. ``F(i, d, n, h)`` is the cheapest way to run layers ``i..L-1`` when the stages before
them leave the devices in *device state* ``d``, such that the first stage of this suffix has
H-1F1B warm-up count ``n`` (capped at ``B``: a stage never holds more than ``B`` microbatches)
and ``h = 1`` iff some stage of the suffix takes exactly ``tau``. A device state
(:func:`harpjax.compiler.plan.index.device_states`) says which subcluster ``k`` the next stage
runs on, what the earlier stages took of it (the device count when the submesh widths divide
each other, else the multiset of shapes) and, when the order is free, which subclusters the
plan has entered. After a stage on submesh ``s`` the next one stays on ``k`` (``st_stay``, cut
over ``k``'s own link) or moves to a subcluster ``k2`` (``st_leave``, cut over the link between
them), leaving ``k``'s other devices unused; ``st_end`` says which stages may be last. With
HARP's rule (every device, Eq. 19) only stages that complete their subcluster leave it or end
the plan. A plan starts in one of the ``roots``.

Why this is exact. The feasibility of a prefix stage depends on the suffix only through the
suffix's first warm-up count (``N_i = N_{i+1} + delta_i``, Eq. 1), so keeping ``n`` in the
state (instead of the count of the cheapest suffix, Eq. 17) loses no plan whose memory only
fits with a costlier suffix of fewer warm-ups. ``delta_i`` is computed with the candidate
``tau``, and with ``require_hit`` only plans whose bottleneck *equals* ``tau`` count, so the
warm-up counts (and the memory check ``mem_p + min(N, B) mem_a <= mem``, Eq. 18) are the ones
the runtime derives from the plan's own ``t_max``. The stage count ``s`` of the paper's
``F(s, i, d)`` is not needed: neither the objective nor the memory check depends on it.

Kernel. Per state ``(i, d)`` only the Pareto frontier over ``n`` is kept (a point with smaller
``n`` and no larger cost dominates: every earlier stage then has fewer warm-ups); a point with
``h = 1`` also dominates ``h = 0`` points with larger ``n`` and cost. The frontiers live in one
growing pool (:class:`Frontier`): state ``(i, d, h)`` owns points ``first[i, d', h] ..
first + count - 1`` (``d'``: ``d``'s number among the states some prefix reaches), ``n``
increasing and cost decreasing along them. A forward pass computes a lower bound ``lb(i, d)``
on the cost of any prefix reaching ``(i, d)``; states no prefix reaches are skipped and points
with ``lb + cost + (B - 1) tau > bound`` are dropped (``bound`` is the best objective found so
far, so only worse plans are pruned).

Twin. The same recurrence over the dense array ``F[i, d, n, h]``, vectorised over ``d`` and
``n``, without frontiers or bounds except the final comparison with ``bound``; it cross-checks
the kernel's frontier and pruning logic.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harpjax.compiler.schedule import warmup_delta
from harpjax.errors import interruptible_kernel

try:  # Numba is a hard dependency; the twin keeps the planner usable without it.
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["DPArrays", "Frontier", "moves", "cut_cost", "link_rows", "fitting_submeshes",
           "prefix_bound", "prefix_bound_kernel", "suffix_bound", "hit_possible",
           "active_entries", "solve_tau", "solve_tau_numpy", "HAVE_NUMBA", "BOUND_SLACK"]

HAVE_NUMBA = _numba is not None

# Relative slack of the pruning bound: values within it of the best are always evaluated, so
# the search returns the same plan however its candidates are batched.
BOUND_SLACK = 1e-9


class DPArrays(NamedTuple):
  """The kernels' input: the feasible (range, submesh) entries and the device states.

  ``G`` device states, ``K`` subclusters, ``L`` layers, ``E`` entries, ``S_max`` submeshes,
  ``R`` root states (:func:`harpjax.compiler.plan.index.device_states`).

  Attributes:
    st_sub: ``[G]`` int64 subcluster the next stage of each device state runs on.
    st_stay: ``[G, S_max]`` int64 state after a stage on submesh ``s`` when the next stage
      stays on the subcluster (``-1``: not allowed); its cut uses the subcluster's own link.
    st_leave: ``[G, S_max, K]`` int64 state after a stage on ``s`` when the next stage runs on
      subcluster ``k2`` (``-1``: not allowed); its cut uses the link between the two.
    st_end: ``[G, S_max]`` bool: a stage on ``s`` may be the last one.
    roots: ``[R]`` int64 states a plan may start in.
    ent_ptr: ``[K, L + 1]`` int64; entries of (subcluster ``k``, first layer ``i``) are
      ``ent_ptr[k, i] .. ent_ptr[k, i + 1] - 1``, by submesh, then by time.
    ent_j: ``[E]`` int64 last layer of each entry.
    ent_s: ``[E]`` int64 submesh index of each entry.
    ent_t: ``[E]`` float64 stage time, seconds.
    ent_p: ``[E]`` float64 parameter bytes per device.
    ent_a: ``[E]`` float64 activation bytes per device per in-flight microbatch.
    mem: ``[K]`` float64 device memory, bytes.
    c_pair: ``[K, K, L]`` float64 cut cost from a stage on ``a`` to one on ``b`` after layer
      ``j``, seconds (``a == b``: the subcluster's own link).
    mv_ptr: ``[G * S_max + 1]`` int64: the moves after a stage on ``s`` from state ``g``
      (``st_stay`` and ``st_leave`` listed) are ``mv_ptr[g * S_max + s] ..`` ``mv_ptr[g *
      S_max + s + 1] - 1``.
    mv_state: ``[V]`` int64 the state of each move; ``mv_sub``: ``[V]`` its subcluster.
    mv_link: ``[V]`` int64 the row of ``c_link`` that prices the move's cut: ``a K + b`` for a
      cut from subcluster ``a`` to ``b`` (``c_pair``), ``K K + k`` for one that stays inside
      a host of ``k`` (where the stages sit: :func:`harpjax.cluster.host_joins`).
    c_link: ``[K K + K, L]`` float64 those cuts' seconds after layer ``j``: one lookup per
      move in the kernels.
    ent_e: ``[E]`` float64 end-of-iteration seconds of each entry (gradient synchronisation
      inside its submesh and the optimizer update; zeros when the tables have none).
    sp_ptr: ``[K * L * S_max + 1]`` int64: the entries of (``k``, ``i``, submesh ``s``) are
      ``sp_ptr[x] .. sp_ptr[x + 1] - 1``, ``x = (k L + i) S_max + s``, sorted by time (the
      active ones at ``tau`` are a prefix).
    sp_mono: ``[K * L * S_max]`` bool: that group is sorted by last layer too (time grows with
      the range, as for additive costs), so the kernel can skip to a layer by bisection.
    fs_ptr: ``[G + 1]``, ``fs_s``: the submeshes a stage may use from state ``g`` (a move
      follows, or it may be the last) are ``fs_s[fs_ptr[g] .. fs_ptr[g + 1] - 1]``.
  """
  st_sub: np.ndarray
  st_stay: np.ndarray
  st_leave: np.ndarray
  st_end: np.ndarray
  roots: np.ndarray
  ent_ptr: np.ndarray
  ent_j: np.ndarray
  ent_s: np.ndarray
  ent_t: np.ndarray
  ent_p: np.ndarray
  ent_a: np.ndarray
  mem: np.ndarray
  c_pair: np.ndarray
  mv_ptr: np.ndarray
  mv_state: np.ndarray
  mv_sub: np.ndarray
  ent_e: np.ndarray
  sp_ptr: np.ndarray
  sp_mono: np.ndarray
  fs_ptr: np.ndarray
  fs_s: np.ndarray
  mv_link: np.ndarray
  c_link: np.ndarray


def cut_cost(ix, k, x, j):
  """Seconds of the cut after layer ``j`` of a stage on subcluster ``k`` followed by move
  ``x`` (the twins; the kernels read ``c_link[mv_link[x], j]`` inline)."""
  del k
  return ix.c_link[ix.mv_link[x], j]


def link_rows(mv_sub: np.ndarray, mv_host: np.ndarray, st_sub: np.ndarray, mv_ptr: np.ndarray,
              num_submeshes: int, c_pair: np.ndarray, c_host: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
  """``(mv_link, c_link)`` of :class:`DPArrays` from each move's subcluster and host flag."""
  K, _, L = c_pair.shape
  src = st_sub[np.repeat(np.arange(mv_ptr.size - 1) // num_submeshes, np.diff(mv_ptr))]
  rows = np.where(mv_host, K * K + src, src * K + mv_sub).astype(np.int64)
  return rows, np.ascontiguousarray(np.concatenate([c_pair.reshape(K * K, L), c_host]))


def fitting_submeshes(mv_ptr: np.ndarray, st_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(fs_ptr, fs_s)`` of :class:`DPArrays`: per state the submeshes with a move or an end."""
  G, S = st_end.shape
  ok = (np.diff(mv_ptr).reshape(G, S) > 0) | st_end
  ptr = np.concatenate([[0], np.cumsum(ok.sum(axis=1))]).astype(np.int64)
  return ptr, np.nonzero(ok)[1].astype(np.int64)


def moves(states) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The moves of :class:`DPArrays` (``mv_ptr``, ``mv_state``, ``mv_sub``, ``mv_host``) as
  flat lists, from :class:`~harpjax.compiler.plan.index.DeviceStates`: per (state, submesh)
  the stays (``stay``, then ``stay_b``), then the leaves by subcluster."""
  G, S, K = states.leave.shape
  sub = np.asarray(states.sub, np.int64)
  # [G, S, 2 + K] candidate targets, their subclusters and host flags, in that order.
  to = np.concatenate([states.stay[:, :, None], states.stay_b[:, :, None], states.leave],
                      axis=2)
  subs = np.concatenate([np.broadcast_to(sub[:, None, None], (G, S, 2)),
                         np.broadcast_to(np.arange(K)[None, None, :], (G, S, K))], axis=2)
  host = np.concatenate([states.stay_host[:, :, None], states.stay_b_host[:, :, None],
                         np.zeros((G, S, K), np.bool_)], axis=2)
  ok = to >= 0
  ptr = np.concatenate([[0], np.cumsum(ok.reshape(G * S, -1).sum(axis=1))]).astype(np.int64)
  return (ptr, to[ok].astype(np.int64), subs[ok].astype(np.int64),
          host[ok].astype(np.bool_))


class Frontier(NamedTuple):
  """The kernel's pool of frontier points; point ``q`` is a suffix plan.

  Attributes:
    n: ``[cap]`` int64 warm-up count of the suffix's first stage (capped at ``B``).
    cost: ``[cap]`` float64 ``sum (t_i + 2 c_i)`` of the suffix, seconds.
    entry: ``[cap]`` int64 entry of the suffix's first stage.
    succ: ``[cap]`` int64 point of the rest of the suffix, ``-1`` after the last stage.
  """
  n: np.ndarray
  cost: np.ndarray
  entry: np.ndarray
  succ: np.ndarray


def _new_frontier(cap: int) -> Frontier:
  return Frontier(np.empty(cap, np.int64), np.empty(cap, np.float64), np.empty(cap, np.int64),
                  np.empty(cap, np.int64))


def _grow_frontier(pool: Frontier, used: int, need: int) -> Frontier:
  """``pool`` with room for ``need`` points (doubling), its first ``used`` points kept."""
  cap = pool.n.shape[0]
  if need <= cap:
    return pool
  while cap < need:
    cap *= 2
  bigger = _new_frontier(cap)
  bigger.n[:used] = pool.n[:used]
  bigger.cost[:used] = pool.cost[:used]
  bigger.entry[:used] = pool.entry[:used]
  bigger.succ[:used] = pool.succ[:used]
  return bigger


def _prefix_bound_impl(ix, tau, check_comm):
  """``lb[i, d]``: the cheapest ``sum (t + 2 c)`` of a prefix reaching layer ``i`` with the
  devices in state ``d`` and every stage (and, with ``check_comm``, cut) ``<= tau``; memory
  ignored; ``inf``: unreachable. ``lb[L, 0]`` is the cheapest whole plan. Non-increasing in
  ``tau``: the bound at a larger candidate is a bound at a smaller one too."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  lb = np.full((L + 1, G), inf)
  for r in ix.roots:
    lb[0, r] = 0.0
  for i in range(L - 1):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      gx = (k * L + i) * S_max
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        m1 = ix.mv_ptr[mp + 1]
        if m0 == m1:
          continue  # the submesh does not fit, or no stage may follow it
        for e in range(ix.sp_ptr[gx + s], ix.sp_ptr[gx + s + 1]):
          t = ix.ent_t[e]
          if t > tau:
            break  # sorted by time within (subcluster, first layer, submesh)
          j = ix.ent_j[e]
          if j == L - 1:
            continue
          for x in range(m0, m1):
            d2 = ix.mv_state[x]
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            v = base + t + 2.0 * c
            if v < lb[j + 1, d2]:
              lb[j + 1, d2] = v
  # lb[L, 0]: the cheapest whole plan (its last stage added); inf: no plan within tau.
  for i in range(L):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      gx = (k * L + i) * S_max
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        if not ix.st_end[d, s]:
          continue
        for e in range(ix.sp_ptr[gx + s], ix.sp_ptr[gx + s + 1]):
          t = ix.ent_t[e]
          if t > tau:
            break
          if ix.ent_j[e] == L - 1 and base + t < lb[L, 0]:
            lb[L, 0] = base + t
  return lb


def _suffix_bound_impl(ix, tau, check_comm, lb):
  """``sb[i, d]``: the cheapest ``sum (t + 2 c)`` of a suffix covering layers ``i..L-1`` from
  device state ``d`` with every stage (and cut) ``<= tau``; memory ignored; ``inf``: none, or
  no prefix reaches ``(i, d)`` by the prefix bound ``lb``. Like :func:`_prefix_bound_impl`, a
  bound at a larger ``tau`` holds at a smaller one."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  sb = np.full((L + 1, G), inf)
  jmin = np.full(G, L + 1, np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf:
        continue
      k = ix.st_sub[d]
      gx = (k * L + i) * S_max
      best = inf
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        m1 = ix.mv_ptr[mp + 1]
        may_end = ix.st_end[d, s]
        jlo = L - 1 if may_end else L + 1
        for x in range(m0, m1):
          v = jmin[ix.mv_state[x]] - 1
          if v < jlo:
            jlo = v
        if jlo >= L:
          continue
        e0 = ix.sp_ptr[gx + s]
        e1 = ix.sp_ptr[gx + s + 1]
        if ix.sp_mono[gx + s] and jlo > i:
          e0 += np.searchsorted(ix.ent_j[e0:e1], jlo)
        for e in range(e0, e1):
          t = ix.ent_t[e]
          if t > tau:
            break
          j = ix.ent_j[e]
          if j == L - 1:
            if may_end and t < best:
              best = t
            continue
          for x in range(m0, m1):
            d2 = ix.mv_state[x]
            rest = sb[j + 1, d2]
            if rest == inf:
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            v = t + 2.0 * c + rest
            if v < best:
              best = v
      if best < inf:
        sb[i, d] = best
        jmin[d] = i
  return sb


def _hit_possible_impl(ix, lb, sb, hits, ent_i, ent_k, tau, check_comm):
  """Whether one of the entries ``hits`` (time ``tau``) can be a stage of a plan whose other
  stages (and cuts) are within ``tau``, by the prefix and suffix bounds ``lb``, ``sb`` (at
  ``tau`` or above; memory ignored): a necessary condition for a plan of period ``tau``."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  for y in range(hits.shape[0]):
    e = hits[y]
    i = ent_i[e]
    k = ent_k[e]
    j = ix.ent_j[e]
    s = ix.ent_s[e]
    for d in range(G):
      if ix.st_sub[d] != k or lb[i, d] == np.inf:
        continue
      if j == L - 1:
        if ix.st_end[d, s]:
          return True
        continue
      mp = d * S_max + s
      for x in range(ix.mv_ptr[mp], ix.mv_ptr[mp + 1]):
        if sb[j + 1, ix.mv_state[x]] == np.inf:
          continue
        if check_comm and ix.c_link[ix.mv_link[x], j] > tau:
          continue
        return True
  return False


def _solve_tau_impl(ix, tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound,
                    link_hits, discount, lb, sb, hit_cap):
  """Kernel body (compiled by Numba when available); see :func:`solve_tau`."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_microbatches
  H = 2 if require_hit else 1
  inf = np.inf
  if lb.shape[0] != L + 1:
    lb = _prefix_bound(ix, tau, check_comm)
  if lb[L, 0] == inf:
    return inf, np.zeros(0, np.int64)   # no plan has every stage within tau
  use_sb = sb.shape[0] == L + 1
  budget_all = inf
  if bound < inf:
    budget_all = bound * (1.0 + BOUND_SLACK) - (B - 1) * tau
  # The most a hit stage further up can still take off a suffix without one (see solve_tau).
  nmax = n_cap if n_cap < B else B
  if hit_cap < nmax:
    nmax = hit_cap
  disc_max = discount * tau * (nmax - 1) if require_hit else 0.0
  # The frontiers are kept for the states some prefix reaches only (their own numbering).
  act = np.full(G, -1, np.int64)
  n_act = 0
  for d in range(G):
    for i in range(L + 1):
      if lb[i, d] < inf:
        act[d] = n_act
        n_act += 1
        break
  first = np.zeros((L + 1, n_act, H), np.int64)
  count = np.zeros((L + 1, n_act, H), np.int64)
  pool = _new_frontier(1024)
  used = 0
  # Best suffix per (n, h) found for the current state: cost, entry, successor point.
  tc = np.full((n_cap + 1, H), inf)
  te = np.zeros((n_cap + 1, H), np.int64)
  ts = np.zeros((n_cap + 1, H), np.int64)
  # jmin[d]: the first layer (of those done) with a suffix from state d; a stage from (i, d)
  # can only lead to a layer at or beyond it.
  jmin = np.full(G, L + 1, np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf or (use_sb and sb[i, d] == inf):
        continue   # no prefix reaches (i, d), or no suffix leaves it
      budget = budget_all - lb[i, d]
      k = ix.st_sub[d]
      mk = ix.mem[k]
      nlo = n_cap + 1
      nhi = 0
      gx = (k * L + i) * S_max
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        m1 = ix.mv_ptr[mp + 1]
        may_end = ix.st_end[d, s]
        jlo = L - 1 if may_end else L + 1   # the least last layer worth a look
        for x in range(m0, m1):
          v = jmin[ix.mv_state[x]] - 1
          if v < jlo:
            jlo = v
        if jlo >= L:
          continue  # the submesh does not fit, or nothing after it has a suffix yet
        e0 = ix.sp_ptr[gx + s]
        e1 = ix.sp_ptr[gx + s + 1]
        if ix.sp_mono[gx + s] and jlo > i:
          e0 += np.searchsorted(ix.ent_j[e0:e1], jlo)   # sorted by layer too: skip ahead
        for e in range(e0, e1):
          t = ix.ent_t[e]
          if t > tau:
            break  # sorted by time within (subcluster, first layer, submesh)
          j = ix.ent_j[e]
          hit = 1 if (require_hit and t == tau) else 0
          # The first stage (layer 0) also pays its end-of-iteration time.
          t_end = t + ix.ent_e[e] if i == 0 else t
          if j == L - 1:
            if not may_end:
              continue
            if t_end - (disc_max if hit == 0 else 0.0) > budget:
              continue
            if t_end < tc[1, hit]:
              tc[1, hit] = t_end
              te[1, hit] = e
              ts[1, hit] = -1
              nlo = min(nlo, 1)
              nhi = max(nhi, 1)
            continue
          p = ix.ent_p[e]
          a = ix.ent_a[e]
          for x in range(m0, m1):
            a2 = act[ix.mv_state[x]]
            if a2 < 0 or (count[j + 1, a2, 0] == 0 and (H == 1 or count[j + 1, a2, 1] == 0)):
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            dl = _warmup_delta(c, tau, eps)
            step = t_end + 2.0 * c
            hit_c = 1 if (require_hit and link_hits and c == tau) else 0
            for h2 in range(H):
              h = 1 if (h2 == 1 or hit == 1 or hit_c == 1) else 0
              # This stage is the last hit of the plan: the round trip below it hides under
              # its warm-up forwards (the lower bound of the discount, see solve_tau).
              own = discount * tau if (h2 == 0 and hit == 1 and hit_c == 0) else 0.0
              q0 = first[j + 1, a2, h2]
              for q in range(q0, q0 + count[j + 1, a2, h2]):
                n = pool.n[q] + dl
                if n > B:
                  n = B
                if n > n_cap or p + n * a > mk:
                  break  # n grows along the frontier
                v = pool.cost[q] + step - own * (n - 1)
                if v - (disc_max if h == 0 else 0.0) > budget:
                  continue  # costs fall along the frontier: later points may fit
                if v < tc[n, h]:
                  tc[n, h] = v
                  te[n, h] = e
                  ts[n, h] = q
                  if n < nlo:
                    nlo = n
                  if n > nhi:
                    nhi = n
      if nhi == 0:
        continue
      # Compress into Pareto frontiers (h = 1 first: without the discount it also dominates
      # h = 0 points). With the discount, an h = 0 point with more warm-ups gets more off at
      # its hit stage further up: its frontier is over (n, cost - discount * tau * n).
      pool = _grow_frontier(pool, used, used + H * (nhi - nlo + 1))
      for h in range(H - 1, -1, -1):
        first[i, act[d], h] = used
        best_same = inf
        best_hit = inf
        slope = discount * tau if (h == 0 and H == 2) else 0.0
        for n in range(nlo, nhi + 1):
          if H == 2 and discount == 0.0 and tc[n, 1] < best_hit:
            best_hit = tc[n, 1]
          v = tc[n, h]
          if v - slope * n < best_same and (h == 1 or v < best_hit):
            best_same = v - slope * n
            pool.n[used] = n
            pool.cost[used] = v
            pool.entry[used] = te[n, h]
            pool.succ[used] = ts[n, h]
            used += 1
        count[i, act[d], h] = used - first[i, act[d], h]
        if count[i, act[d], h] > 0:
          jmin[d] = i
      for n in range(nlo, nhi + 1):
        for h in range(H):
          tc[n, h] = inf
  hf = H - 1
  best_q = -1
  value = inf
  for r in ix.roots:
    if act[r] < 0:
      continue
    m = count[0, act[r], hf]
    if m == 0:
      continue
    q = first[0, act[r], hf] + m - 1  # costs fall along the frontier: the last is the cheapest
    if pool.cost[q] < value:
      value = pool.cost[q]
      best_q = q
  if bound < inf and value + (B - 1) * tau > bound * (1.0 + BOUND_SLACK):
    return inf, np.zeros(0, np.int64)
  if best_q < 0:
    return inf, np.zeros(0, np.int64)
  path = np.empty(L, np.int64)
  s = 0
  q = best_q
  while q >= 0:
    path[s] = pool.entry[q]
    s += 1
    q = pool.succ[q]
  return value, path[:s]


if HAVE_NUMBA:
  # ``cache=True`` keys the on-disk cache on this file only: touch it when warmup_delta changes.
  _warmup_delta = _numba.njit(cache=True)(warmup_delta)
  _new_frontier = _numba.njit(cache=True)(_new_frontier)
  _grow_frontier = _numba.njit(cache=True)(_grow_frontier)
  _prefix_bound = _numba.njit(cache=True, nogil=True)(_prefix_bound_impl)
  _suffix_bound = _numba.njit(cache=True, nogil=True)(_suffix_bound_impl)
  _hit_possible = _numba.njit(cache=True, nogil=True)(_hit_possible_impl)
  _solve_tau_numba = _numba.njit(cache=True, nogil=True)(_solve_tau_impl)
else:  # pragma: no cover
  _warmup_delta = warmup_delta
  _prefix_bound = _prefix_bound_impl
  _suffix_bound = _suffix_bound_impl
  _hit_possible = _hit_possible_impl
  _solve_tau_numba = None

prefix_bound_kernel = _prefix_bound
"""The compiled :func:`prefix_bound` ``(ix, tau, check_comm)``, callable from other kernels."""

_NO_BOUND = np.zeros((0, 0))


@interruptible_kernel
def suffix_bound(ix: DPArrays, tau: float, lb: np.ndarray, check_comm: bool = True,
                 use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the cheapest ``sum (t + 2 c)`` of a suffix from layer ``i`` in device state
  ``d`` with every stage and cut ``<= tau``, memory ignored (``inf``: none), for the states
  :func:`prefix_bound` ``lb`` (at ``tau`` or above) says a prefix reaches."""
  fn = _suffix_bound if (use_numba and HAVE_NUMBA) else _suffix_bound_impl
  return fn(ix, float(tau), bool(check_comm), lb)


@interruptible_kernel
def hit_possible(ix: DPArrays, lb: np.ndarray, sb: np.ndarray, hits: np.ndarray,
                 ent_i: np.ndarray, ent_k: np.ndarray, tau: float, check_comm: bool = True,
                 use_numba: bool = True) -> bool:
  """Whether a stage of one of the entries ``hits`` (of time ``tau``) can be part of a plan
  with every other stage and cut ``<= tau``, by :func:`prefix_bound` and :func:`suffix_bound`
  at ``tau`` or above (memory ignored). ``False`` proves that no plan has period ``tau``
  through a stage of that time."""
  fn = _hit_possible if (use_numba and HAVE_NUMBA) else _hit_possible_impl
  return bool(fn(ix, lb, sb, np.asarray(hits, np.int64), ent_i, ent_k, float(tau),
                 bool(check_comm)))


@interruptible_kernel
def prefix_bound(ix: DPArrays, tau: float, check_comm: bool = True,
                 use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the cheapest ``sum (t + 2 c)`` of a prefix reaching layer ``i`` in device
  state ``d`` with every stage and cut ``<= tau``, memory ignored (``inf``: unreachable);
  ``[L, 0]`` that of a whole plan. The bound at a larger ``tau`` is also one at a smaller
  ``tau`` (:func:`solve_tau` takes it)."""
  fn = _prefix_bound if (use_numba and HAVE_NUMBA) else _prefix_bound_impl
  return fn(ix, float(tau), bool(check_comm))


@interruptible_kernel
def solve_tau(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
              require_hit: bool, check_comm: bool, bound: float, link_hits: bool = False,
              discount: float = 0.0, use_numba: bool = True,
              lb: np.ndarray | None = None, sb: np.ndarray | None = None,
              hit_cap: int | None = None) -> tuple[float, np.ndarray]:
  """The DP at one candidate period ``tau`` (Numba kernel).

  Args:
    ix: the entries and device states, :class:`DPArrays`.
    tau: candidate period ``P`` (``t_max``, or with ``link_hits`` the larger of ``t_max`` and
      the slowest cut), seconds; the warm-ups are ``warmup_delta(c, tau, eps)``.
    num_microbatches: ``B``.
    eps: H-1F1B tolerance of :func:`harpjax.compiler.schedule.warmup_delta`.
    n_cap: largest warm-up count any state can need (``<= B``), sizes the scratch arrays.
    require_hit: count only plans whose period is exactly ``tau`` (a stage of time ``tau``, or
      with ``link_hits`` also a cut of ``tau``): the exact search; ``False`` allows any period
      ``<= tau`` (monotone in ``tau``: the feasibility test of the binary search and a lower
      bound).
    check_comm: enforce ``C(j) <= tau``; ``False`` only to explain infeasibility.
    bound: best objective known, seconds (``inf`` for none); plans whose value plus
      ``(B - 1) tau`` exceeds ``bound * (1 + 1e-9)`` may be dropped.
    link_hits: a cut of exactly ``tau`` makes ``tau`` the plan's period (link-bound plans).
    discount: ``phi``, the forward's share of a stage's time. With ``discount > 0`` the value
      of a plan is ``sum (t_i + 2 c_i) + e_0 - phi tau (min(N_h, B) - 1)``, where ``h`` is the
      last stage of time ``tau`` (none if a cut of ``tau`` follows it); plus ``(B - 1) tau``
      it is a lower bound on the simulated iteration time (the path through stage ``h``: its
      first ``N_h - 1`` forwards hide under the round trip below it). ``0``: Eq. 12's
      ``sum (t_i + 2 c_i) + e_0``.
    use_numba: run the compiled kernel (``False`` runs the same code in Python: slow).
    lb: :func:`prefix_bound` at ``tau`` or at any larger candidate (with the same
      ``check_comm``); ``None``: computed here.
    sb: optional :func:`suffix_bound` at ``tau`` or above: states without a suffix are
      skipped.
    hit_cap: the most microbatches a stage of time ``tau`` can hold (memory); bounds the
      discount still to come for a suffix without a hit, so the bound prunes those too.

  Returns:
    ``(value, path)``: the smallest value (``inf`` if none) and the entry index of each stage
    in pipeline order. ``e_0`` is the end-of-iteration time of the first stage (``ent_e``).
  """
  fn = _solve_tau_numba if (use_numba and HAVE_NUMBA) else _solve_tau_impl
  return fn(ix, float(tau), int(num_microbatches), float(eps), int(n_cap), bool(require_hit),
            bool(check_comm), float(bound), bool(link_hits), float(discount),
            _NO_BOUND if lb is None else lb, _NO_BOUND if sb is None else sb,
            int(num_microbatches) if hit_cap is None else int(hit_cap))


def active_entries(ix: DPArrays, k: int, i: int, tau: float) -> list[int]:
  """The entries of subcluster ``k`` starting at layer ``i`` with time ``<= tau`` (for the
  twins; each (subcluster, first layer, submesh) group is sorted by time)."""
  S_max = ix.st_stay.shape[1]
  L = ix.ent_ptr.shape[1] - 1
  out = []
  for s in range(S_max):
    x = (k * L + i) * S_max + s
    lo, hi = int(ix.sp_ptr[x]), int(ix.sp_ptr[x + 1])
    out.extend(range(lo, lo + int(np.searchsorted(ix.ent_t[lo:hi], tau, side="right"))))
  return out


_active = active_entries


def solve_tau_numpy(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
                    require_hit: bool, check_comm: bool, bound: float, link_hits: bool = False,
                    discount: float = 0.0, use_numba: bool = False,
                    lb: np.ndarray | None = None, sb: np.ndarray | None = None,
                    hit_cap: int | None = None) -> tuple[float, np.ndarray]:
  """The pure-NumPy twin of :func:`solve_tau` (dense ``F[i, d, n, h]``, same arguments)."""
  del use_numba, lb, sb, hit_cap
  (st_sub, st_stay, st_leave, st_end, roots, ent_ptr, ent_j, ent_s, ent_t, ent_p, ent_a, mem,
   c_pair) = ix[:13]
  ent_e = ix.ent_e
  L, B = ent_ptr.shape[1] - 1, int(num_microbatches)
  G = int(st_sub.size)
  H = 2 if require_hit else 1
  NC = int(n_cap)
  F = np.full((L + 1, G, NC + 1, H), np.inf)
  # Parent of each value: entry, successor state and (n', h'); n' = 0 marks the last stage.
  par_e = np.full(F.shape, -1, np.int64)
  par_d = np.zeros(F.shape, np.int64)
  par_n = np.zeros(F.shape, np.int64)
  par_h = np.zeros(F.shape, np.int64)
  n_idx = np.arange(NC + 1)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      k = int(st_sub[d])
      for e in _active(ix, k, i, tau):
        t = float(ent_t[e])
        s, j = int(ent_s[e]), int(ent_j[e])
        hit = 1 if (require_hit and t == tau) else 0
        t_end = t + float(ent_e[e]) if i == 0 else t
        if j == L - 1:
          if st_end[d, s] and t_end < F[i, d, 1, hit]:
            F[i, d, 1, hit] = t_end
            par_e[i, d, 1, hit] = e
            par_n[i, d, 1, hit] = 0
          continue
        p, a, mk = float(ent_p[e]), float(ent_a[e]), float(mem[k])
        n_ok = (n_idx >= 1) & (p + n_idx * a <= mk)
        mp = d * st_stay.shape[1] + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2 = int(ix.mv_state[x])
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          dl = warmup_delta(c, tau, eps)
          step = t_end + 2.0 * c
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit or hit_c) else 0
            own = discount * tau if (h2 == 0 and hit and not hit_c) else 0.0
            src = F[j + 1, d2, :, h2]                      # [NC + 1] by n'
            tgt = np.minimum(n_idx[1:] + dl, B)            # n of the new first stage
            vals = src[1:] + step - own * (tgt - 1)
            ok = (tgt <= NC) & n_ok[np.minimum(tgt, NC)] & np.isfinite(vals)
            for n_prev, n_new, v in zip(n_idx[1:][ok], tgt[ok], vals[ok]):
              if v < F[i, d, n_new, h]:
                F[i, d, n_new, h] = v
                par_e[i, d, n_new, h] = e
                par_d[i, d, n_new, h] = d2
                par_n[i, d, n_new, h] = n_prev
                par_h[i, d, n_new, h] = h2
  best = (np.inf, -1, -1)
  for r in roots:
    n0 = int(np.argmin(F[0, r, :, H - 1]))
    if F[0, r, n0, H - 1] < best[0]:
      best = (float(F[0, r, n0, H - 1]), int(r), n0)
  value, d, n = best
  if not np.isfinite(value) or (np.isfinite(bound)
                                and value + (B - 1) * tau > bound * (1.0 + BOUND_SLACK)):
    return np.inf, np.zeros(0, np.int64)
  path, i, h = [], 0, H - 1
  while True:
    e = int(par_e[i, d, n, h])
    path.append(e)
    if par_n[i, d, n, h] == 0:
      break
    i, d, n, h = (int(ent_j[e]) + 1, int(par_d[i, d, n, h]), int(par_n[i, d, n, h]),
                  int(par_h[i, d, n, h]))
  return value, np.asarray(path, np.int64)
