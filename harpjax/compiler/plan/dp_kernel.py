"""The planner's DP for one candidate ``t_max``: a Numba kernel and its pure-NumPy twin.

Both take one :class:`DPArrays` (plain arrays: the sparse index of
:mod:`harpjax.compiler.plan.index`) and return the same thing: the smallest
``sum_i (t_i + 2 c_i)`` over the plans whose bottleneck is the candidate ``tau`` (or at most
``tau``, see ``require_hit``), and the plan as entry indices.

State. ``F(i, d, n, h)`` is the cheapest way to run layers ``i..L-1`` when the stages before
them leave the devices in *device state* ``d``, such that the first stage of this suffix has
H-1F1B warm-up count ``n`` (capped at ``B``: a stage never holds more than ``B`` microbatches)
and ``h = 1`` iff some stage of the suffix takes exactly ``tau``. A device state says which
subcluster ``k`` the next stage goes to and what the earlier stages already took of it; a stage
on submesh ``s`` moves it to ``st_next[d, s]``. When the submesh widths of ``k`` divide each
other (the paper's shapes with ``M`` a power of two), any stages adding up to at most
``N * M`` devices pack onto the hosts and the state is just the device count: ``d`` is the
paper's GPU offset ``O_{k-1} + used`` (Eq. 13). Otherwise the state is the multiset of shapes
used so far, kept only while it packs and can still be completed (the planner builds the
states). A stage that completes subcluster ``k`` moves to the first state of ``k + 1`` and its
cut uses the link between ``k`` and ``k + 1`` (``st_exh``), else the link inside ``k``. The last
stage has ``n = 1`` and no cut and must complete the last subcluster: every device is used
(Eq. 19).

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
growing pool (:class:`Frontier`): state ``(i, d, h)`` owns points ``first[i, d, h] ..
first + count - 1``, ``n`` increasing and cost decreasing along them. A forward pass computes
a lower bound ``lb(i, d)`` on the cost of any prefix reaching ``(i, d)``; states no prefix
reaches are skipped and points with ``lb + cost + (B - 1) tau > bound`` are dropped (``bound``
is the best objective found so far, so only worse plans are pruned).

Twin. The same recurrence over the dense array ``F[i, d, n, h]``, vectorised over ``d`` and
``n``, without frontiers or bounds except the final comparison with ``bound``; it cross-checks
the kernel's frontier and pruning logic.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harpjax.compiler.schedule import warmup_delta

try:  # Numba is a hard dependency; the twin keeps the planner usable without it.
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["DPArrays", "Frontier", "solve_tau", "solve_tau_numpy", "HAVE_NUMBA", "BOUND_SLACK"]

HAVE_NUMBA = _numba is not None

# Relative slack of the pruning bound: values within it of the best are always evaluated, so
# the search returns the same plan however its candidates are batched.
BOUND_SLACK = 1e-9


class DPArrays(NamedTuple):
  """The kernels' input: the feasible (range, submesh) entries and the device states.

  ``G`` device states, ``K`` subclusters, ``L`` layers, ``E`` entries, ``S_max`` submeshes.

  Attributes:
    st_sub: ``[G]`` int64 subcluster of each device state (what the stages before use of its
      subcluster; state 0 is "nothing used", ``G`` is "every device used").
    st_next: ``[G, S_max]`` int64 state after a stage on submesh ``s`` (``-1``: it does not
      fit); a stage that completes its subcluster leads to the next subcluster's first state.
    st_exh: ``[G, S_max]`` bool: that stage completes its subcluster (its cut uses the link to
      the next subcluster).
    ent_ptr: ``[K, L + 1]`` int64; entries of (subcluster ``k``, first layer ``i``) are
      ``ent_ptr[k, i] .. ent_ptr[k, i + 1] - 1``, sorted by time.
    ent_j: ``[E]`` int64 last layer of each entry.
    ent_s: ``[E]`` int64 submesh index of each entry.
    ent_t: ``[E]`` float64 stage time, seconds.
    ent_p: ``[E]`` float64 parameter bytes per device.
    ent_a: ``[E]`` float64 activation bytes per device per in-flight microbatch.
    mem: ``[K]`` float64 device memory, bytes.
    c_intra: ``[K, L]`` float64 cut cost inside subcluster ``k`` after layer ``j``, seconds.
    c_inter: ``[K, L]`` float64 cut cost from ``k`` to ``k + 1`` after layer ``j``.
  """
  st_sub: np.ndarray
  st_next: np.ndarray
  st_exh: np.ndarray
  ent_ptr: np.ndarray
  ent_j: np.ndarray
  ent_s: np.ndarray
  ent_t: np.ndarray
  ent_p: np.ndarray
  ent_a: np.ndarray
  mem: np.ndarray
  c_intra: np.ndarray
  c_inter: np.ndarray


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


def _solve_tau_impl(ix, tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound):
  """Kernel body (compiled by Numba when available); see :func:`solve_tau`."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]  # device states; G itself is the terminal "every device used"
  B = num_microbatches
  H = 2 if require_hit else 1
  inf = np.inf
  # Forward pass: lower bound on the cost of a prefix ending just before (i, d).
  lb = np.full((L + 1, G + 1), inf)
  lb[0, 0] = 0.0
  for i in range(L):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      for e in range(ix.ent_ptr[k, i], ix.ent_ptr[k, i + 1]):
        t = ix.ent_t[e]
        if t > tau:
          break
        d2 = ix.st_next[d, ix.ent_s[e]]
        j = ix.ent_j[e]
        if d2 < 0 or j == L - 1 or d2 == G:
          continue
        c = ix.c_inter[k, j] if ix.st_exh[d, ix.ent_s[e]] else ix.c_intra[k, j]
        if check_comm and c > tau:
          continue
        v = base + t + 2.0 * c
        if v < lb[j + 1, d2]:
          lb[j + 1, d2] = v
  budget_all = inf
  if bound < inf:
    budget_all = bound * (1.0 + BOUND_SLACK) - (B - 1) * tau
  first = np.zeros((L + 1, G + 1, H), np.int64)
  count = np.zeros((L + 1, G + 1, H), np.int64)
  pool = _new_frontier(1024)
  used = 0
  # Best suffix per (n, h) found for the current state: cost, entry, successor point.
  tc = np.full((n_cap + 1, H), inf)
  te = np.zeros((n_cap + 1, H), np.int64)
  ts = np.zeros((n_cap + 1, H), np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf:
        continue
      budget = budget_all - lb[i, d]
      k = ix.st_sub[d]
      mk = ix.mem[k]
      nlo = n_cap + 1
      nhi = 0
      for e in range(ix.ent_ptr[k, i], ix.ent_ptr[k, i + 1]):
        t = ix.ent_t[e]
        if t > tau:
          break
        s = ix.ent_s[e]
        d2 = ix.st_next[d, s]
        if d2 < 0:
          continue
        j = ix.ent_j[e]
        hit = 1 if (require_hit and t == tau) else 0
        if j == L - 1:
          if d2 != G or t > budget:
            continue
          if t < tc[1, hit]:
            tc[1, hit] = t
            te[1, hit] = e
            ts[1, hit] = -1
            nlo = min(nlo, 1)
            nhi = max(nhi, 1)
          continue
        if d2 == G:
          continue
        c = ix.c_inter[k, j] if ix.st_exh[d, s] else ix.c_intra[k, j]
        if check_comm and c > tau:
          continue
        dl = _warmup_delta(c, tau, eps)
        step = t + 2.0 * c
        p = ix.ent_p[e]
        a = ix.ent_a[e]
        for h2 in range(H):
          h = 1 if (h2 == 1 or hit == 1) else 0
          q0 = first[j + 1, d2, h2]
          for q in range(q0, q0 + count[j + 1, d2, h2]):
            n = pool.n[q] + dl
            if n > B:
              n = B
            if n > n_cap or p + n * a > mk:
              break  # n grows along the frontier
            x = pool.cost[q] + step
            if x > budget:
              continue  # costs fall along the frontier: later points may fit
            if x < tc[n, h]:
              tc[n, h] = x
              te[n, h] = e
              ts[n, h] = q
              if n < nlo:
                nlo = n
              if n > nhi:
                nhi = n
      if nhi == 0:
        continue
      # Compress into Pareto frontiers (h = 1 first: it also dominates h = 0 points).
      pool = _grow_frontier(pool, used, used + H * (nhi - nlo + 1))
      for h in range(H - 1, -1, -1):
        first[i, d, h] = used
        best_same = inf
        best_hit = inf
        for n in range(nlo, nhi + 1):
          if H == 2 and tc[n, 1] < best_hit:
            best_hit = tc[n, 1]
          x = tc[n, h]
          if x < best_same and (h == 1 or x < best_hit):
            best_same = x
            pool.n[used] = n
            pool.cost[used] = x
            pool.entry[used] = te[n, h]
            pool.succ[used] = ts[n, h]
            used += 1
        count[i, d, h] = used - first[i, d, h]
      for n in range(nlo, nhi + 1):
        for h in range(H):
          tc[n, h] = inf
  hf = H - 1
  m = count[0, 0, hf]
  if m == 0:
    return inf, np.zeros(0, np.int64)
  q = first[0, 0, hf] + m - 1  # costs fall along the frontier: the last point is the cheapest
  value = pool.cost[q]
  path = np.empty(L, np.int64)
  s = 0
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
  _solve_tau_numba = _numba.njit(cache=True, nogil=True)(_solve_tau_impl)
else:  # pragma: no cover
  _warmup_delta = warmup_delta
  _solve_tau_numba = None


def solve_tau(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
              require_hit: bool, check_comm: bool, bound: float,
              use_numba: bool = True) -> tuple[float, np.ndarray]:
  """The DP at one candidate ``t_max`` (Numba kernel).

  Args:
    ix: the entries and device states, :class:`DPArrays`.
    tau: candidate ``t_max``, seconds.
    num_microbatches: ``B``.
    eps: H-1F1B tolerance of :func:`harpjax.compiler.schedule.warmup_delta`.
    n_cap: largest warm-up count any state can need (``<= B``), sizes the scratch arrays.
    require_hit: count only plans with a stage of time exactly ``tau`` (the exact search);
      ``False`` allows any bottleneck ``<= tau`` (monotone in ``tau``: the feasibility test of
      the binary search and a lower bound).
    check_comm: enforce ``C(j) <= tau`` (H-1F1B's condition); ``False`` only to explain
      infeasibility.
    bound: best objective known, seconds (``inf`` for none); plans costing more than
      ``bound * (1 + 1e-9)`` may be dropped.
    use_numba: run the compiled kernel (``False`` runs the same code in Python: slow).

  Returns:
    ``(value, path)``: the smallest ``sum (t_i + 2 c_i)`` (``inf`` if none) and the entry
    index of each stage in pipeline order.
  """
  fn = _solve_tau_numba if (use_numba and HAVE_NUMBA) else _solve_tau_impl
  return fn(ix, float(tau), int(num_microbatches), float(eps), int(n_cap), bool(require_hit),
            bool(check_comm), float(bound))


def solve_tau_numpy(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
                    require_hit: bool, check_comm: bool, bound: float,
                    use_numba: bool = False) -> tuple[float, np.ndarray]:
  """The pure-NumPy twin of :func:`solve_tau` (dense ``F[i, d, n, h]``, same arguments)."""
  del use_numba
  st_sub, st_next, st_exh, ent_ptr, ent_j, ent_s, ent_t, ent_p, ent_a, mem, c_intra, c_inter = ix
  L, B = ent_ptr.shape[1] - 1, int(num_microbatches)
  K = ent_ptr.shape[0]
  G = int(st_sub.size)
  H = 2 if require_hit else 1
  NC = int(n_cap)
  F = np.full((L + 1, G + 1, NC + 1, H), np.inf)
  # Parent of each state value: entry and successor (n', h'); n' = 0 marks the last stage.
  par_e = np.full(F.shape, -1, np.int64)
  par_n = np.zeros(F.shape, np.int64)
  par_h = np.zeros(F.shape, np.int64)
  n_idx = np.arange(NC + 1)
  states = [np.nonzero(st_sub == k)[0] for k in range(K)]
  for i in range(L - 1, -1, -1):
    for k in range(K):
      for e in range(int(ent_ptr[k, i]), int(ent_ptr[k, i + 1])):
        t = float(ent_t[e])
        if t > tau:
          break
        s, j = int(ent_s[e]), int(ent_j[e])
        hit = 1 if (require_hit and t == tau) else 0
        nxt = st_next[states[k], s]
        if j == L - 1:
          for d in states[k][nxt == G]:
            if t < F[i, d, 1, hit]:
              F[i, d, 1, hit] = t
              par_e[i, d, 1, hit] = e
              par_n[i, d, 1, hit] = 0
          continue
        p, a, mk = float(ent_p[e]), float(ent_a[e]), float(mem[k])
        n_ok = (n_idx >= 1) & (n_idx <= NC) & (p + n_idx * a <= mk)
        valid = (nxt >= 0) & (nxt < G)
        for exhaust in (False, True):
          sel = valid & (st_exh[states[k], s] == exhaust)
          ds = states[k][sel]
          if ds.size == 0:
            continue
          c = float(c_inter[k, j] if exhaust else c_intra[k, j])
          if check_comm and c > tau:
            continue
          dl = warmup_delta(c, tau, eps)
          step = t + 2.0 * c
          src = F[j + 1, st_next[ds, s]]                   # [nd, NC + 1, H]
          cur = F[i, ds]                                   # [nd, NC + 1, H] (a copy)
          top = min(NC, B - 1)
          tgt = np.arange(1 + dl, top + 1)                 # n = n' + dl below the cap
          tgt = tgt[n_ok[tgt]]
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit) else 0
            if tgt.size:
              v = src[:, tgt - dl, h2] + step
              better = v < cur[:, tgt, h]
              if better.any():
                r, cidx = np.nonzero(better)
                F[i, ds[r], tgt[cidx], h] = v[r, cidx]
                cur[r, tgt[cidx], h] = v[r, cidx]
                par_e[i, ds[r], tgt[cidx], h] = e
                par_n[i, ds[r], tgt[cidx], h] = tgt[cidx] - dl
                par_h[i, ds[r], tgt[cidx], h] = h2
            if NC == B and n_ok[B]:                        # n' + dl >= B: capped at B
              srcn = np.arange(max(1, B - dl), NC + 1)
              vals = src[:, srcn, h2] + step               # [nd, len]
              arg = np.argmin(vals, axis=1)
              v = vals[np.arange(vals.shape[0]), arg]
              better = v < cur[:, B, h]
              if better.any():
                rows = ds[better]
                F[i, rows, B, h] = v[better]
                cur[better, B, h] = v[better]
                par_e[i, rows, B, h] = e
                par_n[i, rows, B, h] = srcn[arg[better]]
                par_h[i, rows, B, h] = h2
  root = F[0, 0, :, H - 1]
  n0 = int(np.argmin(root))
  value = float(root[n0])
  if not np.isfinite(value) or (np.isfinite(bound)
                                and value + (B - 1) * tau > bound * (1.0 + BOUND_SLACK)):
    return np.inf, np.zeros(0, np.int64)
  path, i, d, n, h = [], 0, 0, n0, H - 1
  while True:
    e = int(par_e[i, d, n, h])
    path.append(e)
    if par_n[i, d, n, h] == 0:
      break
    i, d, n, h = int(ent_j[e]) + 1, int(st_next[d, ent_s[e]]), int(par_n[i, d, n, h]), \
        int(par_h[i, d, n, h])
  return value, np.asarray(path, np.int64)
