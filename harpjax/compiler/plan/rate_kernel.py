"""The planner's DP with prices: a Numba kernel and its pure-NumPy twin.

The DP of :mod:`harpjax.compiler.plan.dp_kernel` with one more criterion, the plan's hourly
rate ``R = sum_i devices_i * price(subcluster_i)`` (any currency per hour). ``R`` is additive
over the subclusters a plan uses: the rate of subcluster ``k`` is charged when its last stage
runs (the transition that leaves ``k`` or ends the plan knows how many of ``k``'s devices the
stages took, ``held``). The objectives of :func:`harpjax.compiler.plan.solve` that involve
money combine ``R`` with the iteration time ``T`` non-linearly (``R * T`` per iteration, or
``T`` under ``R <= budget``), so the frontier of a state keeps every point not dominated in
``(n, R, cost)``: a suffix with no more warm-ups, no higher rate and no higher cost is at least
as good for every prefix and every objective. That is exact; its price is larger frontiers.

Objectives (``kind``): ``0`` minimises ``T`` (with ``rate_max`` a budget), ``1`` minimises
``R * T`` (with ``t_limit`` a bound on ``T``). ``T = cost + (B - 1) tau`` as in Eq. 12.

Twin. :func:`solve_tau_rate_numpy` runs the same recurrence densely over the (few, on the
instances it is meant for) distinct rates a suffix can have, ``F[i, d, n, h, r]``, without
frontiers; it cross-checks the kernel's dominance and pruning.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harpjax.compiler.plan.dp_kernel import BOUND_SLACK, DPArrays, cut_cost
from harpjax.compiler.plan.dp_kernel import active_entries as _active
from harpjax.compiler.schedule import warmup_delta
from harpjax.errors import interruptible_kernel

try:
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["RateArrays", "solve_tau_rate", "solve_tau_rate_numpy", "KIND_TIME", "KIND_COST"]

KIND_TIME = 0
KIND_COST = 1


class RateArrays(NamedTuple):
  """What the rate DP reads besides :class:`~harpjax.compiler.plan.dp_kernel.DPArrays`.

  Attributes:
    held: ``[G, S_max]`` int64 devices of the current subcluster the stages hold once a stage
      on submesh ``s`` ran from state ``g``.
    price: ``[K]`` float64 price of one device per hour.
  """
  held: np.ndarray
  price: np.ndarray


def _objective(kind, rate, t):
  return t if kind == 0 else rate * t


def _solve_tau_rate_impl(ix, rx, tau, num_microbatches, eps, n_cap, require_hit, check_comm,
                         bound, rate_max, t_limit, kind, link_hits, relief):
  """Kernel body (compiled by Numba when available); see :func:`solve_tau_rate`."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_microbatches
  H = 2 if require_hit else 1
  inf = np.inf
  tail = (B - 1) * tau - relief   # in the comparisons with the bound and the time limit
  lb = np.full((L + 1, G), inf)
  for r in ix.roots:
    lb[0, r] = 0.0
  for i in range(L):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      for e in range(ix.ent_ptr[k, i], ix.ent_ptr[k, i + 1]):
        t = ix.ent_t[e]
        if t > tau:
          continue
        j = ix.ent_j[e]
        if j == L - 1:
          continue
        s = ix.ent_s[e]
        mp = d * S_max + s
        for x in range(ix.mv_ptr[mp], ix.mv_ptr[mp + 1]):
          d2 = ix.mv_state[x]
          c = ix.c_link[ix.mv_link[x], j]
          if check_comm and c > tau:
            continue
          v = base + t + 2.0 * c
          if v < lb[j + 1, d2]:
            lb[j + 1, d2] = v
  limit = bound * (1.0 + BOUND_SLACK)
  first = np.zeros((L + 1, G, H), np.int64)
  count = np.zeros((L + 1, G, H), np.int64)
  cap = 1024
  pn = np.empty(cap, np.int64)
  pr = np.empty(cap, np.float64)
  pc = np.empty(cap, np.float64)
  pe = np.empty(cap, np.int64)
  ps = np.empty(cap, np.int64)
  used = 0
  ccap = 256
  cn = np.empty(ccap, np.int64)
  cr = np.empty(ccap, np.float64)
  cc = np.empty(ccap, np.float64)
  ce = np.empty(ccap, np.int64)
  cq = np.empty(ccap, np.int64)
  ch = np.empty(ccap, np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf:
        continue
      pre = lb[i, d]
      k = ix.st_sub[d]
      mk = ix.mem[k]
      m = 0
      for e in range(ix.ent_ptr[k, i], ix.ent_ptr[k, i + 1]):
        t = ix.ent_t[e]
        if t > tau:
          continue
        s = ix.ent_s[e]
        j = ix.ent_j[e]
        hit = 1 if (require_hit and t == tau) else 0
        charge = _charge(rx, k, d, s)
        p = ix.ent_p[e]
        a = ix.ent_a[e]
        t_end = t + ix.ent_e[e] if i == 0 else t   # the first stage pays its end time
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        for x in range(m0 - 1, ix.mv_ptr[mp + 1]):
          # x = m0 - 1: the last stage; then the moves (staying on k, or leaving it).
          if x == m0 - 1:
            if j != L - 1 or not ix.st_end[d, s]:
              continue
            v = t_end
            rate = charge
            if rate > rate_max or pre + v + tail > t_limit or \
                _objective(kind, rate, pre + v + tail) > limit:
              continue
            if m == ccap:
              ccap *= 2
              cn, cr, cc, ce, cq, ch = _grow6(cn, cr, cc, ce, cq, ch, m, ccap)
            cn[m], cr[m], cc[m], ce[m], cq[m], ch[m] = 1, rate, v, e, -1, hit
            m += 1
            continue
          if j == L - 1:
            break
          d2 = ix.mv_state[x]
          c = ix.c_link[ix.mv_link[x], j]
          if check_comm and c > tau:
            continue
          dl = _warmup_delta(c, tau, eps)
          step = t_end + 2.0 * c
          add = 0.0 if ix.mv_sub[x] == k else charge
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit == 1 or hit_c == 1) else 0
            q0 = first[j + 1, d2, h2]
            for q in range(q0, q0 + count[j + 1, d2, h2]):
              n = pn[q] + dl
              if n > B:
                n = B
              if n > n_cap or p + n * a > mk:
                break  # n grows along the frontier
              v = pc[q] + step
              rate = pr[q] + add
              if rate > rate_max or pre + v + tail > t_limit or \
                  _objective(kind, rate, pre + v + tail) > limit:
                continue
              if m == ccap:
                ccap *= 2
                cn, cr, cc, ce, cq, ch = _grow6(cn, cr, cc, ce, cq, ch, m, ccap)
              cn[m], cr[m], cc[m], ce[m], cq[m], ch[m] = n, rate, v, e, q, h
              m += 1
      if m == 0:
        continue
      # Pareto filter in (n, rate, cost); h = 1 points also dominate h = 0 points.
      idx = np.argsort(cc[:m], kind="mergesort")
      idx = idx[np.argsort(cr[:m][idx], kind="mergesort")]
      idx = idx[np.argsort(cn[:m][idx], kind="mergesort")]
      if used + m > cap:
        while cap < used + m:
          cap *= 2
        pn, pr, pc, pe, ps = _grow5(pn, pr, pc, pe, ps, used, cap)
      hit_lo = used
      for h in range(H - 1, -1, -1):
        first[i, d, h] = used
        for y in range(m):
          z = idx[y]
          if ch[z] != h:
            continue
          dominated = False
          for w in range(first[i, d, h], used):
            if pr[w] <= cr[z] and pc[w] <= cc[z]:
              dominated = True
              break
          if not dominated and h == 0 and H == 2:
            for w in range(hit_lo, first[i, d, 0]):
              if pn[w] <= cn[z] and pr[w] <= cr[z] and pc[w] <= cc[z]:
                dominated = True
                break
          if dominated:
            continue
          pn[used], pr[used], pc[used], pe[used], ps[used] = cn[z], cr[z], cc[z], ce[z], cq[z]
          used += 1
        count[i, d, h] = used - first[i, d, h]
  hf = H - 1
  best_q = -1
  best = inf
  best_rate = inf
  for r in ix.roots:
    for q in range(first[0, r, hf], first[0, r, hf] + count[0, r, hf]):
      tt = pc[q] + tail
      if tt > t_limit or pr[q] > rate_max:
        continue
      tt += relief
      val = _objective(kind, pr[q], tt)
      if val < best or (val == best and pr[q] < best_rate):
        best = val
        best_rate = pr[q]
        best_q = q
  if best_q < 0:
    return inf, inf, inf, np.zeros(0, np.int64)
  path = np.empty(L, np.int64)
  s = 0
  q = best_q
  cost = pc[best_q]
  while q >= 0:
    path[s] = pe[q]
    s += 1
    q = ps[q]
  return best, best_rate, cost, path[:s]


def _charge(rx, k, d, s):
  """Hourly rate of subcluster ``k`` once a stage on ``s`` ran from state ``d``."""
  return rx.price[k] * rx.held[d, s]


def _grow6(a, b, c, d, e, f, used, cap):
  a2 = np.empty(cap, a.dtype)
  b2 = np.empty(cap, b.dtype)
  c2 = np.empty(cap, c.dtype)
  d2 = np.empty(cap, d.dtype)
  e2 = np.empty(cap, e.dtype)
  f2 = np.empty(cap, f.dtype)
  a2[:used], b2[:used], c2[:used] = a[:used], b[:used], c[:used]
  d2[:used], e2[:used], f2[:used] = d[:used], e[:used], f[:used]
  return a2, b2, c2, d2, e2, f2


def _grow5(a, b, c, d, e, used, cap):
  a2 = np.empty(cap, a.dtype)
  b2 = np.empty(cap, b.dtype)
  c2 = np.empty(cap, c.dtype)
  d2 = np.empty(cap, d.dtype)
  e2 = np.empty(cap, e.dtype)
  a2[:used], b2[:used], c2[:used] = a[:used], b[:used], c[:used]
  d2[:used], e2[:used] = d[:used], e[:used]
  return a2, b2, c2, d2, e2


if _numba is not None:
  _warmup_delta = _numba.njit(cache=True)(warmup_delta)
  _objective = _numba.njit(cache=True)(_objective)
  _charge = _numba.njit(cache=True)(_charge)
  _grow6 = _numba.njit(cache=True)(_grow6)
  _grow5 = _numba.njit(cache=True)(_grow5)
  _solve_tau_rate_numba = _numba.njit(cache=True, nogil=True)(_solve_tau_rate_impl)
else:  # pragma: no cover
  _warmup_delta = warmup_delta
  _solve_tau_rate_numba = None


@interruptible_kernel
def solve_tau_rate(ix: DPArrays, rx: RateArrays, tau: float, num_microbatches: int, eps: float,
                   n_cap: int, require_hit: bool, check_comm: bool, bound: float,
                   rate_max: float, t_limit: float, kind: int, link_hits: bool = False,
                   relief: float = 0.0, use_numba: bool = True
                   ) -> tuple[float, float, float, np.ndarray]:
  """The DP with prices at one candidate ``t_max`` (Numba kernel).

  Args:
    ix, tau, num_microbatches, eps, n_cap, require_hit, check_comm: as
      :func:`harpjax.compiler.plan.dp_kernel.solve_tau`.
    rx: :class:`RateArrays`.
    bound: best objective value known (``T`` seconds for ``kind = 0``, ``R * T`` for
      ``kind = 1``); worse plans may be dropped.
    rate_max: largest hourly rate allowed (the budget; ``inf`` for none).
    t_limit: largest iteration time ``T`` allowed, seconds (``inf`` for none).
    kind: :data:`KIND_TIME` or :data:`KIND_COST`.
    link_hits: a cut of exactly ``tau`` makes ``tau`` the plan's period (link-bound plans;
      see :func:`~harpjax.compiler.plan.dp_kernel.solve_tau`).
    relief: seconds by which the plan's time may fall below ``T`` (``T - relief`` is compared
      with ``bound`` and ``t_limit``): when the simulator judges, ``T`` is not a lower bound on
      its time, ``T - phi tau (n_max - 1)`` is.

  Returns:
    ``(value, rate, cost, path)``: the best objective value (``inf`` if no plan), its rate,
    its ``sum (t_i + 2 c_i)`` and the entry of each stage in pipeline order. Ties of the value
    go to the lower rate.
  """
  fn = _solve_tau_rate_numba if (use_numba and _solve_tau_rate_numba is not None) \
      else _solve_tau_rate_impl
  return fn(ix, rx, float(tau), int(num_microbatches), float(eps), int(n_cap),
            bool(require_hit), bool(check_comm), float(bound), float(rate_max),
            float(t_limit), int(kind), bool(link_hits), float(relief))


class _RateIds(dict):
  """Index of a rate among the distinct sums (rounded to 1e-9: sums in another order)."""

  def __init__(self, rates):
    super().__init__((r, x) for x, r in enumerate(rates))

  def __getitem__(self, rate):
    return super().__getitem__(round(rate, 9))


def solve_tau_rate_numpy(ix: DPArrays, rx: RateArrays, tau: float, num_microbatches: int,
                         eps: float, n_cap: int, require_hit: bool, check_comm: bool,
                         bound: float, rate_max: float, t_limit: float, kind: int,
                         link_hits: bool = False, relief: float = 0.0,
                         use_numba: bool = False) -> tuple[float, float, float, np.ndarray]:
  """The pure-NumPy twin of :func:`solve_tau_rate`: dense over the distinct suffix rates."""
  del use_numba
  ent_e = ix.ent_e
  (st_sub, st_stay, st_leave, st_end, roots, ent_ptr, ent_j, ent_s, ent_t, ent_p, ent_a, mem,
   c_pair) = ix[:13]
  L, B, K, G = ent_ptr.shape[1] - 1, int(num_microbatches), ent_ptr.shape[0], int(st_sub.size)
  H = 2 if require_hit else 1
  NC = int(n_cap)
  # Every rate a suffix can have: sums over subclusters of one charge each.
  charges = [sorted({float(rx.price[k] * h) for g in range(G) if st_sub[g] == k
                     for h in rx.held[g] if h >= 0}) for k in range(K)]
  rates = {0.0}
  for k in range(K):
    rates |= {r + c for r in rates for c in charges[k]}
  rates = sorted({round(r, 9) for r in rates})
  rid = _RateIds(rates)
  Rn = len(rates)
  F = np.full((L + 1, G, NC + 1, H, Rn), np.inf)
  par = {}
  n_idx = np.arange(NC + 1)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      k = int(st_sub[d])
      for e in _active(ix, k, i, tau):
        t = float(ent_t[e])
        s, j = int(ent_s[e]), int(ent_j[e])
        hit = 1 if (require_hit and t == tau) else 0
        if rx.held[d, s] < 0:   # the stage does not fit the subcluster
          continue
        charge = float(rx.price[k] * rx.held[d, s])
        t_end = t + float(ent_e[e]) if i == 0 else t
        if j == L - 1:
          r = rid[charge]
          if st_end[d, s] and t_end < F[i, d, 1, hit, r]:
            F[i, d, 1, hit, r] = t_end
            par[(i, d, 1, hit, r)] = (e, -1, 0, 0, 0)
          continue
        p, a, mk = float(ent_p[e]), float(ent_a[e]), float(mem[k])
        n_ok = (n_idx >= 1) & (p + n_idx * a <= mk)
        mp = d * st_stay.shape[1] + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2 = int(ix.mv_state[x])
          add = 0.0 if ix.mv_sub[x] == k else charge
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          dl = warmup_delta(c, tau, eps)
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit or hit_c) else 0
            src = F[j + 1, d2, :, h2, :]                  # [NC + 1, Rn] by (n', r')
            for n_prev, r_prev in zip(*np.nonzero(np.isfinite(src))):
              n_new = min(int(n_prev) + dl, B)
              if n_prev < 1 or n_new > NC or not n_ok[n_new]:
                continue
              v = src[n_prev, r_prev] + t_end + 2.0 * c
              r = rid[rates[r_prev] + add]
              if v < F[i, d, n_new, h, r]:
                F[i, d, n_new, h, r] = v
                par[(i, d, n_new, h, r)] = (e, d2, int(n_prev), h2, int(r_prev))
  best = (np.inf, np.inf, None)
  tail = (B - 1) * tau
  for root in roots:
    for n in range(NC + 1):
      for r in range(Rn):
        v = F[0, root, n, H - 1, r]
        tt = v + tail
        if not np.isfinite(v) or tt - relief > t_limit or rates[r] > rate_max:
          continue
        val = tt if kind == KIND_TIME else rates[r] * tt
        if (val, rates[r]) < best[:2]:
          best = (val, rates[r], (0, int(root), n, H - 1, r))
  val, rate, key = best
  low = val - relief * (1.0 if kind == KIND_TIME else rate)
  if key is None or low > bound * (1.0 + BOUND_SLACK):
    return np.inf, np.inf, np.inf, np.zeros(0, np.int64)
  cost = float(F[key])
  path = []
  while True:
    e, d2, n_prev, h2, r_prev = par[key]
    path.append(e)
    if d2 < 0:
      break
    key = (int(ent_j[e]) + 1, d2, n_prev, h2, r_prev)
  return float(val), float(rate), cost, np.asarray(path, np.int64)
