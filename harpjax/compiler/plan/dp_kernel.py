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
far, so only worse plans are pruned). With ``end_path`` (:func:`solve_tau`) the value of a plan
also holds the end times of the stages at or above its last hit: the hit suffixes then carry
their end term (``Frontier.xe``) and are kept per ``n`` as a staircase over (cost, cost plus
end term); the ``h = 1`` points no longer dominate ``h = 0`` ones.

Twin. The same recurrence over the dense array ``F[i, d, n, h]``, vectorised over ``d`` and
``n``, without frontiers or bounds except the final comparison with ``bound``; it cross-checks
the kernel's frontier and pruning logic (with ``end_path``, the hit suffixes as lists of every
point no other beats in both cost and cost plus end term).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harpjax.compiler.schedule import iteration_time_kernel, warmup_delta
from harpjax.errors import interruptible_kernel

try:  # Numba is a hard dependency; the twin keeps the planner usable without it.
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["DPArrays", "Frontier", "Pricing", "NO_PRICING", "moves", "cut_cost", "link_rows",
           "fitting_submeshes", "prefix_bound", "prefix_bound_kernel", "prefix_bounds",
           "grow_prefix_bounds", "feasible",
           "prefix_rate", "prefix_fee", "cover_costs",
           "suffix_bound", "hit_possible", "hit_floor", "warmup_step", "warmup_step_kernel",
           "warmup_delta_kernel",
           "active_entries", "solve_tau", "solve_tau_numpy", "moves_into", "bounded_search",
           "bounded_search_numpy", "HAVE_NUMBA", "BOUND_SLACK", "KIND_TIME", "KIND_COST"]

HAVE_NUMBA = _numba is not None

# Relative slack of the pruning bound: values within it of the best are always evaluated, so
# the search returns the same plan however its candidates are batched.
BOUND_SLACK = 1e-9

KIND_TIME = 0
""":attr:`Pricing.kind` (and the bounded search's): the value ranked is the iteration time."""
KIND_COST = 1
"""The value ranked is the hourly rate times the iteration time (cost per iteration)."""


def warmup_step(n_next, delta, num_microbatches, p, a, mem):
  """The transition of every kernel: a stage's H-1F1B warm-up count and its memory check.

  A stage followed by a suffix whose first stage launches ``n_next`` microbatches launches
  ``n = min(n_next + delta, B)`` (Eq. 1-2), ``delta = warmup_delta(c, tau, eps)`` of the cut
  between them (:func:`harpjax.compiler.schedule.warmup_delta`, the schedules' own rule, which
  the callers take once per cut), and holds ``n`` microbatches' activations: it fits when
  ``p + n a <= mem`` (Eq. 18).

  Args:
    n_next: warm-up count of the next stage (``>= 1``).
    delta: ``warmup_delta(c, tau, eps)`` of the cut between the two stages.
    num_microbatches: ``B``.
    p, a: the stage's fixed bytes and bytes per microbatch in flight (per device).
    mem: device memory, bytes.

  Returns:
    ``n``, or ``-1`` when the stage does not fit with it. The kernels call the compiled
    :data:`warmup_step_kernel`; this function is its Python twin (the same code).
  """
  n = n_next + delta
  if n > num_microbatches:
    n = num_microbatches
  if p + n * a > mem:
    return -1
  return n


class Pricing(NamedTuple):
  """The rate criterion of :func:`solve_tau` (the objectives with prices), and the transfer
  fees.

  With pricing the DP keeps, per state, every suffix not dominated in (warm-ups ``n``, hourly
  rate ``R``, cost): the rate of subcluster ``k`` is charged when its last stage runs (the
  move that leaves ``k`` or ends the plan knows the devices of ``k`` the stages hold,
  ``held``), so ``R`` is additive over the suffix. The value is Eq. 12's
  ``T = cost + (B - 1) tau`` (no discount, first stage's end time included), ranked as ``T``
  (:data:`KIND_TIME`, ``R <= rate_max``) or ``R T`` (:data:`KIND_COST`, ``T <= t_limit``).

  With transfer fees (``fee``) each suffix also carries its fee per iteration ``F``, added by
  each cut (``fee[a, b, j]``), and the money is ``R T + 3600 F`` (:data:`KIND_COST`: the cost
  per iteration times 3600), the budget ``R + 3600 F / T <= rate_max``, i.e.
  ``(R - rate_max) T + 3600 F <= 0`` (:data:`KIND_TIME`). Both are linear in a suffix's
  ``R``, ``cost`` and a third coordinate ``z`` with non-negative coefficients given the
  prefix, so a suffix dominates another of no more warm-ups when it has no more of each:
  ``z = R cost + 3600 F`` (the money) or ``z = (R - rate_max) cost + 3600 F`` (the budget;
  ``0`` without one). The frontiers are then over (``n``, ``R``, ``cost``, ``z``).

  Attributes:
    held: ``[G, S_max]`` int64 devices of the current subcluster the stages hold once a stage
      on submesh ``s`` ran from state ``g`` (``[0, 0]``: no pricing, :data:`NO_PRICING`).
    price: ``[K]`` float64 price of one device per hour.
    kind: :data:`KIND_TIME` or :data:`KIND_COST`.
    rate_max: largest hourly rate allowed (``inf``: none).
    t_limit: largest iteration time ``T`` allowed, seconds (``inf``: none).
    relief: seconds by which the ranked time may fall below ``T`` (``T - relief`` is compared
      with the bound and ``t_limit`` while pruning): when the simulator judges, ``T`` is not
      a lower bound on its time, ``T - phi tau (n_max - 1)`` is.
    lbr: ``[L + 1, G]`` :func:`prefix_rate` at the candidate or above (the least rate the
      stages before a suffix add to it), or ``[0, 0]``: none (``0`` assumed).
    fee: ``[K, K, L]`` float64 the fee per iteration of a cut after layer ``j`` from a stage
      on subcluster ``a`` to one on ``b`` (:func:`harpjax.compiler.profile.cut_fees` times
      ``B``), or ``[0, 0, 0]``: no fees (the frontiers over (``n``, ``R``, ``cost``) alone).
    lbfee: ``[L + 1, G]`` :func:`prefix_fee` at the candidate or above (the least fee the
      cuts before a suffix add to it), or ``[0, 0]``: none (``0`` assumed).
  """
  held: np.ndarray
  price: np.ndarray
  kind: int
  rate_max: float
  t_limit: float
  relief: float
  lbr: np.ndarray
  fee: np.ndarray = np.zeros((0, 0, 0))
  lbfee: np.ndarray = np.zeros((0, 0))


NO_PRICING = Pricing(np.zeros((0, 0), np.int64), np.zeros(0), KIND_TIME, np.inf, np.inf, 0.0,
                     np.zeros((0, 0)), np.zeros((0, 0, 0)), np.zeros((0, 0)))
"""The time objective: no rate criterion."""


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
    ent_jmax: ``[E]`` int64 the largest last layer of the entries of its (``k``, ``i``,
      ``s``) group up to it in time order: non-decreasing along a group, so the kernels skip
      to the entries that can reach a layer by bisection (equal to ``ent_j`` where time grows
      with the range, as for additive costs; not always: a longer range may run on a
      faster logical mesh than a shorter one that fits another).
    fs_ptr: ``[G + 1]``, ``fs_s``: the submeshes a stage may use from state ``g`` (a move
      follows, or it may be the last) are ``fs_s[fs_ptr[g] .. fs_ptr[g + 1] - 1]``.
    mv_from: ``[V]`` int64 ``g S_max + s`` of each move: the state and submesh of the stage it
      follows.
    in_ptr: ``[G + 1]`` int64, ``in_mv``: ``[V]`` the same moves read backwards: those *into*
      state ``d`` are ``in_mv[in_ptr[d] .. in_ptr[d + 1] - 1]`` (in move order), for the
      bounded search (:func:`bounded_search`), which extends a suffix by the stage before it.
    ent_i: ``[E]`` int64 first layer of each entry; ``ent_m``: ``[E]`` int64 its devices.
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
  ent_jmax: np.ndarray
  fs_ptr: np.ndarray
  fs_s: np.ndarray
  mv_link: np.ndarray
  c_link: np.ndarray
  mv_from: np.ndarray
  in_ptr: np.ndarray
  in_mv: np.ndarray
  ent_i: np.ndarray
  ent_m: np.ndarray


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


def moves_into(mv_ptr: np.ndarray, mv_state: np.ndarray, num_states: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(mv_from, in_ptr, in_mv)`` of :class:`DPArrays`: each move's source ``g S_max + s``
  and the moves grouped by the state they lead into (stable: in move order)."""
  mv_from = np.repeat(np.arange(mv_ptr.size - 1, dtype=np.int64), np.diff(mv_ptr))
  in_mv = np.argsort(mv_state, kind="stable").astype(np.int64)
  in_ptr = np.searchsorted(mv_state[in_mv], np.arange(num_states + 1), side="left")
  return mv_from, in_ptr.astype(np.int64), in_mv


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
    xe: ``[cap]`` float64 with ``end_path``, of a suffix that has the plan's last hit: the
      largest ``e_s - U_s`` over its stages ``s`` at or above that hit, ``U_s`` the backward
      and cut seconds from the suffix's first stage down to ``s`` (:func:`solve_tau`).
    r: ``[cap]`` float64 with :class:`Pricing`, the suffix's hourly rate.
    f: ``[cap]`` float64 with :class:`Pricing` on tables with transfer fees, the suffix's fee
      per iteration (its cuts'; ``0`` without fees).
  """
  n: np.ndarray
  cost: np.ndarray
  entry: np.ndarray
  succ: np.ndarray
  xe: np.ndarray
  r: np.ndarray
  f: np.ndarray


def _new_frontier(cap: int) -> Frontier:
  return Frontier(np.empty(cap, np.int64), np.empty(cap, np.float64), np.empty(cap, np.int64),
                  np.empty(cap, np.int64), np.empty(cap, np.float64), np.empty(cap, np.float64),
                  np.empty(cap, np.float64))


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
  bigger.xe[:used] = pool.xe[:used]
  bigger.r[:used] = pool.r[:used]
  bigger.f[:used] = pool.f[:used]
  return bigger


def _grow_stairs(sv, sw, se, sq, cap):
  """The per-warm-up staircases of :func:`_stair_add` with room for ``2 cap`` points each."""
  R = sv.shape[0]
  nv = np.empty((R, 2 * cap))
  nw = np.empty((R, 2 * cap))
  ne = np.empty((R, 2 * cap), np.int64)
  nq = np.empty((R, 2 * cap), np.int64)
  nv[:, :cap] = sv
  nw[:, :cap] = sw
  ne[:, :cap] = se
  nq[:, :cap] = sq
  return nv, nw, ne, nq


def _stair_add(sv, sw, se, sq, cnt, n, v, w, e, q):
  """Adds the point ``(v, w)`` (its entry ``e`` and successor ``q``) to row ``n`` of the
  staircases unless a point of that row has ``v' <= v`` and ``w' <= w`` (the first one kept
  on ties); drops the points it dominates. A row is sorted by ``v`` ascending, ``w``
  descending. The caller makes room for one more point first."""
  m = cnt[n]
  pos = 0
  while pos < m and sv[n, pos] < v:
    pos += 1
  if pos > 0 and sw[n, pos - 1] <= w:
    return
  if pos < m and sv[n, pos] == v and sw[n, pos] <= w:
    return
  r = pos
  while r < m and sw[n, r] >= w:
    r += 1   # dominated by the new point: v' >= v, w' >= w (a run, w falls along the row)
  drop = r - pos
  if drop == 0:
    for z in range(m, pos, -1):
      sv[n, z] = sv[n, z - 1]
      sw[n, z] = sw[n, z - 1]
      se[n, z] = se[n, z - 1]
      sq[n, z] = sq[n, z - 1]
  elif drop > 1:
    for z in range(r, m):
      sv[n, z - drop + 1] = sv[n, z]
      sw[n, z - drop + 1] = sw[n, z]
      se[n, z - drop + 1] = se[n, z]
      sq[n, z - drop + 1] = sq[n, z]
  sv[n, pos] = v
  sw[n, pos] = w
  se[n, pos] = e
  sq[n, pos] = q
  cnt[n] = m - drop + 1


def _prefix_bound_impl(ix, tau, check_comm):
  """``lb[i, d]``: the cheapest ``sum (t + 2 c) + e_0`` (its first stage's end time included)
  of a prefix reaching layer ``i`` with the devices in state ``d`` and every stage (and, with
  ``check_comm``, cut) ``<= tau``; memory ignored; ``inf``: unreachable. ``lb[L, 0]`` is the
  cheapest whole plan. Non-increasing in ``tau``: the bound at a larger candidate is a bound
  at a smaller one too."""
  return _prefix_pair(ix, tau, check_comm, -1.0, _NO_BOUND, _NO_BOUND)[0]


def _prefix_pair_impl(ix, tau, check_comm, phi, live_lb, live_sb):
  """``(lb, lbf)``: :func:`_prefix_bound_impl` and, with ``phi >= 0``, the cheapest
  ``sum (phi t + c)`` (the forward half of a prefix: its forwards and one way of its cuts) of
  the same prefixes (else ``lbf`` is empty). Given a prefix and a suffix bound at a larger
  candidate (``live_lb``, ``live_sb``; empty: none), only prefixes through states that have
  both there are counted: the others are in no plan, so the bounds hold and are tighter."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  fwd = phi >= 0.0
  live = live_lb.shape[0] == L + 1 and live_sb.shape[0] == L + 1
  lb = np.full((L + 1, G), inf)
  lbf = np.full((L + 1, G) if fwd else (0, 0), inf)
  for r in ix.roots:
    lb[0, r] = 0.0
    if fwd:
      lbf[0, r] = 0.0
  for i in range(L - 1):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      base_f = lbf[i, d] if fwd else 0.0
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
          te = t + ix.ent_e[e] if i == 0 else t
          for x in range(m0, m1):
            d2 = ix.mv_state[x]
            if live and (live_lb[j + 1, d2] == inf or live_sb[j + 1, d2] == inf):
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            v = base + te + 2.0 * c
            if v < lb[j + 1, d2]:
              lb[j + 1, d2] = v
            if fwd:
              v = base_f + phi * t + c
              if v < lbf[j + 1, d2]:
                lbf[j + 1, d2] = v
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
          v = base + (t + ix.ent_e[e] if i == 0 else t)
          if ix.ent_j[e] == L - 1 and v < lb[L, 0]:
            lb[L, 0] = v
  return lb, lbf


def _prefix_pair_grow_impl(ix, old_tau, tau, check_comm, phi, live_lb, live_sb, lb, lbf,
                           fresh):
  """``(lb, lbf)`` of :func:`_prefix_pair_impl` at ``old_tau`` made, in place, those at a
  larger ``tau`` (the same ``check_comm``, ``phi`` and live states): the same numbers as a
  pass at ``tau``, from the states whose bound fell and the entries of time in ``(old_tau,
  tau]`` alone (``fresh[k, i]``: some entry of subcluster ``k`` from layer ``i`` has one);
  with ``check_comm``, no cut has a time in ``(old_tau, tau]``.

  Why the same: a pass at ``tau`` takes each bound as the least ``lb[i, d] + t (+ e_0) + 2c``
  (and ``lbf[i, d] + phi t + c``) over the moves into it. Here every such term is taken from
  the final ``lb[i, d]`` where it fell (the states are visited by layer, so a state's bound
  is final when it is visited) and, where it did not, the old entries' terms are those of
  the pass at ``old_tau`` (the same base), the new ones are added; a term left from a larger
  old base is never below its replacement (rounding is monotone). Entries only join as the
  period grows, so nothing else changes."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  fwd = phi >= 0.0
  live = live_lb.shape[0] == L + 1 and live_sb.shape[0] == L + 1
  changed = np.zeros((L + 1, G), np.bool_)
  for i in range(L):
    for d in range(G):
      base = lb[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      full = changed[i, d]
      if not full and not fresh[k, i]:
        continue   # neither its bound nor its entries changed: its terms are all there
      base_f = lbf[i, d] if fwd else 0.0
      gx = (k * L + i) * S_max
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        m1 = ix.mv_ptr[mp + 1]
        may_end = ix.st_end[d, s]
        e0 = ix.sp_ptr[gx + s]
        e1 = ix.sp_ptr[gx + s + 1]
        if not full:   # the new entries only (sorted by time within the group)
          e0 += np.searchsorted(ix.ent_t[e0:e1], old_tau, side="right")
        for e in range(e0, e1):
          t = ix.ent_t[e]
          if t > tau:
            break
          j = ix.ent_j[e]
          te = t + ix.ent_e[e] if i == 0 else t
          if j == L - 1:
            if may_end:
              v = base + te
              if v < lb[L, 0]:
                lb[L, 0] = v
            continue
          for x in range(m0, m1):
            d2 = ix.mv_state[x]
            if live and (live_lb[j + 1, d2] == inf or live_sb[j + 1, d2] == inf):
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            v = base + te + 2.0 * c
            if v < lb[j + 1, d2]:
              lb[j + 1, d2] = v
              changed[j + 1, d2] = True
            if fwd:
              v = base_f + phi * t + c
              if v < lbf[j + 1, d2]:
                lbf[j + 1, d2] = v
                changed[j + 1, d2] = True
  return lb, lbf


def _prefix_rate_impl(ix, tau, check_comm, held, price):
  """``lbr[i, d]``: the least hourly rate a prefix reaching layer ``i`` in device state ``d``
  with every stage (and, with ``check_comm``, cut) ``<= tau`` charges, memory ignored: the
  subclusters it left, each at the devices it held there (those of the current subcluster are
  charged by the suffix, :class:`Pricing`); ``inf``: unreachable. Non-decreasing as ``tau``
  falls: the bound at a larger candidate holds at a smaller one."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  lbr = np.full((L + 1, G), inf)
  for r in ix.roots:
    lbr[0, r] = 0.0
  for i in range(L - 1):
    for d in range(G):
      base = lbr[i, d]
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
          continue
        charge = price[k] * held[d, s]
        for e in range(ix.sp_ptr[gx + s], ix.sp_ptr[gx + s + 1]):
          if ix.ent_t[e] > tau:
            break
          j = ix.ent_j[e]
          if j == L - 1:
            continue
          for x in range(m0, m1):
            if check_comm and ix.c_link[ix.mv_link[x], j] > tau:
              continue
            d2 = ix.mv_state[x]
            v = base if ix.mv_sub[x] == k else base + charge
            if v < lbr[j + 1, d2]:
              lbr[j + 1, d2] = v
  return lbr


def _prefix_fee_impl(ix, tau, check_comm, fee):
  """``lbfee[i, d]``: the least transfer fee per iteration of the cuts of a prefix reaching
  layer ``i`` in device state ``d`` (the cut into ``d`` included) with every stage (and, with
  ``check_comm``, cut) ``<= tau``, memory ignored (``inf``: unreachable); ``lbfee[L, 0]``: the
  least fee of a whole plan. Non-decreasing as ``tau`` falls: a bound at a larger candidate
  holds at a smaller one."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  inf = np.inf
  lbf = np.full((L + 1, G), inf)
  for r in ix.roots:
    lbf[0, r] = 0.0
  whole = inf
  for i in range(L):
    for d in range(G):
      base = lbf[i, d]
      if base == inf:
        continue
      k = ix.st_sub[d]
      gx = (k * L + i) * S_max
      for y in range(ix.fs_ptr[d], ix.fs_ptr[d + 1]):
        s = ix.fs_s[y]
        mp = d * S_max + s
        m0 = ix.mv_ptr[mp]
        m1 = ix.mv_ptr[mp + 1]
        for e in range(ix.sp_ptr[gx + s], ix.sp_ptr[gx + s + 1]):
          if ix.ent_t[e] > tau:
            break
          j = ix.ent_j[e]
          if j == L - 1:
            if ix.st_end[d, s] and base < whole:
              whole = base
            continue
          for x in range(m0, m1):
            if check_comm and ix.c_link[ix.mv_link[x], j] > tau:
              continue
            d2 = ix.mv_state[x]
            v = base + fee[k, ix.mv_sub[x], j]
            if v < lbf[j + 1, d2]:
              lbf[j + 1, d2] = v
  lbf[L, 0] = whole
  return lbf


def _cover_impl(ent_i, ent_j, ent_t, w, by_j, taus, L):
  """Per ``taus[g]``, the least ``sum w_e`` of entries of time ``<= taus[g]`` that cover the
  layers ``0 .. L - 1`` in order (``inf``: none); ``by_j`` the entries by last layer."""
  out = np.empty(taus.shape[0])
  f = np.empty(L + 1)
  for g in range(taus.shape[0]):
    tau = taus[g]
    f[:] = np.inf
    f[0] = 0.0
    for y in range(by_j.shape[0]):
      e = by_j[y]
      if ent_t[e] > tau:
        continue
      v = f[ent_i[e]] + w[e]
      if v < f[ent_j[e] + 1]:
        f[ent_j[e] + 1] = v
    out[g] = f[L]
  return out


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
        if jlo > i:
          e0 += np.searchsorted(ix.ent_jmax[e0:e1], jlo)
        for e in range(e0, e1):
          t = ix.ent_t[e]
          if t > tau:
            break
          j = ix.ent_j[e]
          if j < jlo:
            continue
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


def _hit_floor_impl(ix, lb, lbf, sb, hits, ent_i, ent_k, tau, num_mb, n_hit, discount):
  """The least ``max(P_h + e_0, D_h + e_h) + R_h - phi tau (w_h - 1)`` over the entries
  ``hits`` (time ``tau``) as a plan's stage ``h``: ``P_h`` the cost of its prefix (``lb``,
  which holds ``e_0``), ``D_h`` its prefix's forward half (``lbf``), ``R_h`` its round trip
  (its time, its cut both ways and the suffix after it, ``sb``), ``e_h`` its end time,
  ``w_h`` its microbatches in flight (at most ``n_hit`` and what its memory holds). Plus
  ``(B - 1) tau`` a lower bound on the simulated time of any plan whose last hit is a stage
  of those entries (its path through ``h`` up to stage 0's end, or to ``h``'s own);
  ``inf``: none."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  best = np.inf
  for y in range(hits.shape[0]):
    e = hits[y]
    i = ent_i[e]
    k = ent_k[e]
    j = ix.ent_j[e]
    s = ix.ent_s[e]
    a = ix.ent_a[e]
    w = num_mb
    if a > 0:
      room = np.floor((ix.mem[k] - ix.ent_p[e]) / a)
      if room < w:
        w = int(room)
    if n_hit < w:
      w = n_hit
    if w < 1:
      w = 1
    own = ix.ent_t[e] - discount * tau * (w - 1)
    for d in range(G):
      if ix.st_sub[d] != k or lbf[i, d] == np.inf:
        continue
      pre = lbf[i, d] + ix.ent_e[e]
      if i > 0 and lb[i, d] > pre:
        pre = lb[i, d]   # the prefix's cost and its first stage's end time
      if j == L - 1:
        if ix.st_end[d, s] and pre + own < best:
          best = pre + own
        continue
      mp = d * S_max + s
      for x in range(ix.mv_ptr[mp], ix.mv_ptr[mp + 1]):
        rest = sb[j + 1, ix.mv_state[x]]
        if rest == np.inf:
          continue
        c = ix.c_link[ix.mv_link[x], j]
        if c > tau:
          continue
        v = pre + own + 2.0 * c + rest
        if v < best:
          best = v
  return best


def _priced_out(pr, rate, t, fee, limit):
  """Whether a suffix of hourly ``rate`` in a plan of at least ``t`` seconds and ``fee`` per
  iteration is out: over the budget, the time limit or the bound ``limit`` on the ranked value
  (:class:`Pricing`)."""
  if rate > pr.rate_max or t > pr.t_limit:
    return True
  return (t if pr.kind == KIND_TIME else rate * t + 3600.0 * fee) > limit


def _fee_z(pr, rate, cost, fee):
  """The third coordinate of a suffix's frontier point with fees (:class:`Pricing`)."""
  if pr.kind == KIND_COST:
    return rate * cost + 3600.0 * fee
  if pr.rate_max < np.inf:
    return (rate - pr.rate_max) * cost + 3600.0 * fee
  return 0.0


def _grow_rows(sz, cap):
  """A ``[R, cap]`` float array of :func:`_row_add`'s with room for ``2 cap`` points."""
  nz = np.empty((sz.shape[0], 2 * cap))
  nz[:, :cap] = sz
  return nz


def _row_add(sv, sw, sz, sf, se, sq, cnt, n, v, w, z, f, e, q):
  """Adds the point ``(v, w, z)`` (its fee ``f``, entry ``e``, successor ``q``) to row ``n``
  (unordered) unless a point of the row has ``v' <= v``, ``w' <= w`` and ``z' <= z``; drops
  the points it dominates. The caller makes room for one more point first."""
  m = cnt[n]
  for y in range(m):
    if sv[n, y] <= v and sw[n, y] <= w and sz[n, y] <= z:
      return
  y = 0
  while y < m:
    if v <= sv[n, y] and w <= sw[n, y] and z <= sz[n, y]:
      m -= 1
      sv[n, y] = sv[n, m]
      sw[n, y] = sw[n, m]
      sz[n, y] = sz[n, m]
      sf[n, y] = sf[n, m]
      se[n, y] = se[n, m]
      sq[n, y] = sq[n, m]
    else:
      y += 1
  sv[n, m] = v
  sw[n, m] = w
  sz[n, m] = z
  sf[n, m] = f
  se[n, m] = e
  sq[n, m] = q
  cnt[n] = m + 1


def _feasible_impl(ix, tau, num_microbatches, eps, n_cap, check_comm, lb, sb):
  """Kernel body of :func:`feasible`: per state the fewest warm-ups of a suffix from it
  (``n_cap + 1``: none), layer by layer from the last."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_microbatches
  inf = np.inf
  if lb.shape[0] != L + 1:
    lb = _prefix_bound(ix, tau, check_comm)
  if lb[L, 0] == inf:
    return False   # no plan has every stage within tau
  use_sb = sb.shape[0] == L + 1
  none = n_cap + 1
  fewest = np.full((L + 1, G), none, np.int64)
  # jmin[d]: the first layer (of those done) with a suffix from state d (as in solve_tau).
  jmin = np.full(G, L + 1, np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf or (use_sb and sb[i, d] == inf):
        continue
      k = ix.st_sub[d]
      mk = ix.mem[k]
      gx = (k * L + i) * S_max
      best = none
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
          continue
        e0 = ix.sp_ptr[gx + s]
        e1 = ix.sp_ptr[gx + s + 1]
        if jlo > i:
          e0 += np.searchsorted(ix.ent_jmax[e0:e1], jlo)
        for e in range(e0, e1):
          if ix.ent_t[e] > tau:
            break  # sorted by time within (subcluster, first layer, submesh)
          j = ix.ent_j[e]
          if j < jlo:
            continue
          if j == L - 1:
            if may_end:
              best = 1   # the last stage holds one microbatch (every entry fits one)
            continue
          p = ix.ent_p[e]
          a = ix.ent_a[e]
          for x in range(m0, m1):
            n_next = fewest[j + 1, ix.mv_state[x]]
            if n_next > n_cap:
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            n = _warmup_step(n_next, _warmup_delta(c, tau, eps), B, p, a, mk)
            if 0 < n < best:
              best = n
      fewest[i, d] = best
      if best < none:
        jmin[d] = i
  for r in ix.roots:
    if fewest[0, r] <= n_cap:
      return True
  return False


def _solve_tau_impl(ix, tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound,
                    link_hits, discount, lb, sb, hit_cap, end_path, lbf, hit_e, hit_j, pr):
  """Kernel body (compiled by Numba when available); see :func:`solve_tau`. Returns
  ``(value, rate, cost, path)`` (``rate`` ``0`` and ``cost == value`` without pricing)."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_microbatches
  H = 2 if require_hit else 1
  inf = np.inf
  priced = pr.held.shape[0] == G and G > 0
  # With transfer fees: every suffix carries its fee, its frontiers a third coordinate.
  feed = priced and pr.fee.shape[0] == ix.ent_ptr.shape[0] and pr.fee.shape[0] > 0
  if lb.shape[0] != L + 1:
    lb = _prefix_bound(ix, tau, check_comm)
  if lb[L, 0] == inf:
    return inf, inf, inf, np.zeros(0, np.int64)   # no plan has every stage within tau
  use_sb = sb.shape[0] == L + 1
  # With end_path (require_hit only) a hit suffix's value is cost + xe: the end times of
  # every stage at or above the plan's last hit, not the first stage's alone.
  paths = end_path and H == 2 and not priced
  if paths and lbf.shape[0] != L + 1:
    lbf = _prefix_pair(ix, tau, check_comm, discount, _NO_BOUND, _NO_BOUND)[1]
  budget_all = inf
  if bound < inf:
    budget_all = bound * (1.0 + BOUND_SLACK) - (B - 1) * tau
  limit = bound * (1.0 + BOUND_SLACK)
  tail = (B - 1) * tau - pr.relief   # with pricing: the time compared with the limits
  # The most a hit stage further up can still take off a suffix without one (see solve_tau).
  nmax = n_cap if n_cap < B else B
  if hit_cap < nmax:
    nmax = hit_cap
  disc_max = discount * tau * (nmax - 1) if (require_hit and not priced) else 0.0
  # The frontiers are kept for the states some prefix reaches only (their own numbering).
  # (lb read by rows, as it lies in memory; the states numbered in order)
  act = np.full(G, -1, np.int64)
  for i in range(L + 1):
    for d in range(G):
      if lb[i, d] < inf:
        act[d] = 0
  n_act = 0
  for d in range(G):
    if act[d] == 0:
      act[d] = n_act
      n_act += 1
  # first[i, a, h] is read only where count[i, a, h] > 0 (set together): left unset.
  first = np.empty((L + 1, n_act, H), np.int64)
  count = np.zeros((L + 1, n_act, H), np.int32)
  pool = _new_frontier(1024)
  used = 0
  # Best suffix per (n, h) found for the current state: cost, entry, successor point.
  tc = np.full((n_cap + 1, H), inf)
  te = np.zeros((n_cap + 1, H), np.int64)
  ts = np.zeros((n_cap + 1, H), np.int64)
  # Staircases: with end_path the hit suffixes per n over (cost, cost + xe); with pricing
  # every suffix per (h, n) (row h (n_cap + 1) + n) over (cost, rate).
  stairs = paths or priced
  nrows = (n_cap + 1) * H if priced else n_cap + 1
  scap = 4 if stairs else 1
  sv = np.empty((nrows, scap))
  sw = np.empty((nrows, scap))
  se = np.empty((nrows, scap), np.int64)
  sq = np.empty((nrows, scap), np.int64)
  sz = np.empty((nrows, scap))   # with fees: each point's third coordinate and its fee
  sf = np.empty((nrows, scap))
  scnt = np.zeros(nrows, np.int64)
  phi_b = 1.0 - discount   # a stage's backward share
  # jmin[d]: the first layer (of those done) with a suffix from state d; a stage from (i, d)
  # can only lead to a layer at or beyond it.
  jmin = np.full(G, L + 1, np.int64)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      if lb[i, d] == inf or (use_sb and sb[i, d] == inf):
        continue   # no prefix reaches (i, d), or no suffix leaves it
      pre = lb[i, d]
      pre_r = pr.lbr[i, d] if (priced and pr.lbr.shape[0] == L + 1) else 0.0
      pre_f = pr.lbfee[i, d] if (feed and pr.lbfee.shape[0] == L + 1) else 0.0
      budget = budget_all - pre
      # No hit ends before layer i: a suffix from here without one can never get one.
      no_miss = H == 2 and i <= hit_j
      # A whole plan costs at least the forward half of its prefix, the suffix and the end
      # term of the suffix's stages (or, without a hit yet, of the hit to come).
      budget_f = budget_all - lbf[i, d] if paths else inf
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
        # With pricing: the rate of subcluster k once this stage ran (charged when the plan
        # leaves k or ends).
        charge = pr.price[k] * pr.held[d, s] if priced else 0.0
        e0 = ix.sp_ptr[gx + s]
        e1 = ix.sp_ptr[gx + s + 1]
        if jlo > i:   # the first entry that may reach jlo; the others are skipped one by one
          e0 += np.searchsorted(ix.ent_jmax[e0:e1], jlo)
        for e in range(e0, e1):
          t = ix.ent_t[e]
          if t > tau:
            break  # sorted by time within (subcluster, first layer, submesh)
          j = ix.ent_j[e]
          hit = 1 if (require_hit and t == tau) else 0
          ee = ix.ent_e[e]
          # The first stage (layer 0) also pays its end-of-iteration time (without end_path).
          t_end = t + ee if (i == 0 and not paths) else t
          if j < jlo:
            continue  # no move from here has a suffix at j + 1 (a group not sorted by layer)
          if j == L - 1:
            if not may_end or (hit == 0 and no_miss):
              continue
            if priced:
              if _priced_out(pr, pre_r + charge, pre + t_end + tail, pre_f, limit):
                continue
              row = hit * (n_cap + 1) + 1
              if scnt[row] == scap:
                sv, sw, se, sq = _grow_stairs(sv, sw, se, sq, scap)
                if feed:
                  sz = _grow_rows(sz, scap)
                  sf = _grow_rows(sf, scap)
                scap *= 2
              if feed:
                _row_add(sv, sw, sz, sf, se, sq, scnt, row, t_end, charge,
                         _fee_z(pr, charge, t_end, 0.0), 0.0, e, -1)
              else:
                _stair_add(sv, sw, se, sq, scnt, row, t_end, charge, e, -1)
              nlo = min(nlo, 1)
              nhi = max(nhi, 1)
              continue
            if t_end - (disc_max if hit == 0 else 0.0) > budget:
              continue
            if paths:
              if hit == 1:
                if t + ee > budget_f:
                  continue
                if scnt[1] == scap:
                  sv, sw, se, sq = _grow_stairs(sv, sw, se, sq, scap)
                  scap *= 2
                _stair_add(sv, sw, se, sq, scnt, 1, t, t + ee, e, -1)
                nlo = min(nlo, 1)
                nhi = max(nhi, 1)
                continue
              if t - disc_max + hit_e > budget_f:
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
          bk = phi_b * t
          for x in range(m0, m1):
            a2 = act[ix.mv_state[x]]
            if a2 < 0 or (count[j + 1, a2, 0] == 0 and (H == 1 or count[j + 1, a2, 1] == 0)):
              continue
            c = ix.c_link[ix.mv_link[x], j]
            if check_comm and c > tau:
              continue
            step = t_end + 2.0 * c
            dl = _warmup_delta(c, tau, eps)
            hit_c = 1 if (require_hit and link_hits and c == tau) else 0
            add = 0.0 if ix.mv_sub[x] == k else charge   # the move leaves k: charge it
            for h2 in range(H):
              h = 1 if (h2 == 1 or hit == 1 or hit_c == 1) else 0
              if h == 0 and no_miss:
                continue
              # This stage is the last hit of the plan: the round trip below it hides under
              # its warm-up forwards (the lower bound of the discount, see solve_tau).
              own = discount * tau if (h2 == 0 and hit == 1 and hit_c == 0) else 0.0
              q0 = first[j + 1, a2, h2]
              for q in range(q0, q0 + count[j + 1, a2, h2]):
                n = _warmup_step(pool.n[q], dl, B, p, a, mk)
                if n < 0 or n > n_cap:
                  break  # n grows along the frontier
                v = pool.cost[q] + step - own * (n - 1)
                if priced:
                  rate = pool.r[q] + add
                  fq = pool.f[q] + pr.fee[k, ix.mv_sub[x], j] if feed else 0.0
                  if _priced_out(pr, pre_r + rate, pre + v + tail, pre_f + fq, limit):
                    continue
                  row = h * (n_cap + 1) + n
                  if scnt[row] == scap:
                    sv, sw, se, sq = _grow_stairs(sv, sw, se, sq, scap)
                    if feed:
                      sz = _grow_rows(sz, scap)
                      sf = _grow_rows(sf, scap)
                    scap *= 2
                  if feed:
                    _row_add(sv, sw, sz, sf, se, sq, scnt, row, v, rate,
                             _fee_z(pr, rate, v, fq), fq, e, q)
                  else:
                    _stair_add(sv, sw, se, sq, scnt, row, v, rate, e, q)
                  if n < nlo:
                    nlo = n
                  if n > nhi:
                    nhi = n
                  continue
                if v - (disc_max if h == 0 else 0.0) > budget:
                  continue  # costs fall along the frontier: later points may fit
                if paths:
                  if h == 1:
                    xe = ee
                    if h2 == 1 and pool.xe[q] - bk - c > ee:
                      xe = pool.xe[q] - bk - c
                    if v + xe > budget_f:
                      continue
                    if scnt[n] == scap:
                      sv, sw, se, sq = _grow_stairs(sv, sw, se, sq, scap)
                      scap *= 2
                    _stair_add(sv, sw, se, sq, scnt, n, v, v + xe, e, q)
                    if n < nlo:
                      nlo = n
                    if n > nhi:
                      nhi = n
                    continue
                  if v - disc_max + hit_e > budget_f:
                    continue
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
      # its hit stage further up: its frontier is over (n, cost - discount * tau * n). With
      # end_path the hit frontier is over (n, cost, cost + xe), by n and then by cost; with
      # pricing every frontier is over (n, rate, cost), by n, then rate, then cost.
      pool = _grow_frontier(pool, used, used + H * (nhi - nlo + 1) * (scap if stairs else 1))
      ad = act[d]
      for h in range(H - 1, -1, -1):
        first[i, ad, h] = used
        best_same = inf
        best_hit = inf
        slope = discount * tau if (h == 0 and H == 2) else 0.0
        if priced:
          for n in range(nlo, nhi + 1):
            row = h * (n_cap + 1) + n
            for z in range(scnt[row] - 1, -1, -1):   # rate ascending, cost descending
              v = sv[row, z]
              w = sw[row, z]
              zz = sz[row, z] if feed else 0.0   # with fees (an unordered row)
              kept = True
              for q in range(first[i, ad, h], used):   # those of no more warm-ups
                if pool.r[q] <= w and pool.cost[q] <= v and (
                    not feed or _fee_z(pr, pool.r[q], pool.cost[q], pool.f[q]) <= zz):
                  kept = False
                  break
              if kept and h == 0 and H == 2:   # a hit suffix dominates one without
                for q in range(first[i, ad, 1], first[i, ad, 0]):
                  if pool.n[q] <= n and pool.r[q] <= w and pool.cost[q] <= v and (
                      not feed or _fee_z(pr, pool.r[q], pool.cost[q], pool.f[q]) <= zz):
                    kept = False
                    break
              if kept:
                pool.n[used] = n
                pool.cost[used] = v
                pool.entry[used] = se[row, z]
                pool.succ[used] = sq[row, z]
                pool.xe[used] = 0.0
                pool.r[used] = w
                pool.f[used] = sf[row, z] if feed else 0.0
                used += 1
            scnt[row] = 0
        elif paths and h == 1:
          for n in range(nlo, nhi + 1):
            for z in range(scnt[n]):
              v = sv[n, z]
              w = sw[n, z]
              kept = True
              for q in range(first[i, ad, h], used):   # those of fewer warm-ups
                if pool.n[q] < n and pool.cost[q] <= v and pool.cost[q] + pool.xe[q] <= w:
                  kept = False
                  break
              if kept:
                pool.n[used] = n
                pool.cost[used] = v
                pool.entry[used] = se[n, z]
                pool.succ[used] = sq[n, z]
                pool.xe[used] = w - v
                pool.r[used] = 0.0
                pool.f[used] = 0.0
                used += 1
            scnt[n] = 0
        else:
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
              pool.xe[used] = 0.0
              pool.r[used] = 0.0
              pool.f[used] = 0.0
              used += 1
        count[i, ad, h] = used - first[i, ad, h]
        if count[i, ad, h] > 0:
          jmin[d] = i
      if not priced:
        for n in range(nlo, nhi + 1):
          for h in range(H):
            tc[n, h] = inf
  hf = H - 1
  best_q = -1
  value = inf
  best_rate = inf
  for r in ix.roots:
    if act[r] < 0:
      continue
    m = count[0, act[r], hf]
    if m == 0:
      continue
    if priced:   # the least ranked value within the limits; ties to the lower rate
      for q in range(first[0, act[r], hf], first[0, act[r], hf] + m):
        tt = pool.cost[q] + tail
        if tt > pr.t_limit or pool.r[q] > pr.rate_max:
          continue
        tt += pr.relief
        if feed:   # the money and the budget with the plan's fees
          fq = pool.f[q]
          if pr.kind == KIND_TIME:
            if (pool.r[q] - pr.rate_max) * tt + 3600.0 * fq > 0.0:
              continue
            val = tt
          else:
            val = pool.r[q] * tt + 3600.0 * fq
        else:
          val = tt if pr.kind == KIND_TIME else pool.r[q] * tt
        if val < value or (val == value and pool.r[q] < best_rate):
          value = val
          best_rate = pool.r[q]
          best_q = q
      continue
    if paths:   # the least cost + xe of the frontier
      for q in range(first[0, act[r], hf], first[0, act[r], hf] + m):
        if pool.cost[q] + pool.xe[q] < value:
          value = pool.cost[q] + pool.xe[q]
          best_q = q
      continue
    q = first[0, act[r], hf] + m - 1  # costs fall along the frontier: the last is the cheapest
    if pool.cost[q] < value:
      value = pool.cost[q]
      best_q = q
  if not priced and bound < inf and value + (B - 1) * tau > bound * (1.0 + BOUND_SLACK):
    return inf, inf, inf, np.zeros(0, np.int64)
  if best_q < 0:
    return inf, inf, inf, np.zeros(0, np.int64)
  path = np.empty(L, np.int64)
  s = 0
  q = best_q
  while q >= 0:
    path[s] = pool.entry[q]
    s += 1
    q = pool.succ[q]
  if priced:
    return value, best_rate, pool.cost[best_q], path[:s]
  return value, 0.0, value, path[:s]


if HAVE_NUMBA:
  # ``cache=True`` keys the on-disk cache on this file only: touch it when warmup_delta changes.
  _warmup_delta = _numba.njit(cache=True, inline="always")(warmup_delta)
  _warmup_step = _numba.njit(cache=True, inline="always")(warmup_step)
  _priced_out = _numba.njit(cache=True)(_priced_out)
  _fee_z = _numba.njit(cache=True, inline="always")(_fee_z)
  _grow_rows = _numba.njit(cache=True)(_grow_rows)
  _row_add = _numba.njit(cache=True)(_row_add)
  _new_frontier = _numba.njit(cache=True)(_new_frontier)
  _grow_frontier = _numba.njit(cache=True)(_grow_frontier)
  _grow_stairs = _numba.njit(cache=True)(_grow_stairs)
  _stair_add = _numba.njit(cache=True)(_stair_add)
  _prefix_pair = _numba.njit(cache=True, nogil=True)(_prefix_pair_impl)
  _prefix_pair_grow = _numba.njit(cache=True, nogil=True)(_prefix_pair_grow_impl)
  _prefix_bound = _numba.njit(cache=True, nogil=True)(_prefix_bound_impl)
  _suffix_bound = _numba.njit(cache=True, nogil=True)(_suffix_bound_impl)
  _prefix_rate = _numba.njit(cache=True, nogil=True)(_prefix_rate_impl)
  _prefix_fee = _numba.njit(cache=True, nogil=True)(_prefix_fee_impl)
  _cover = _numba.njit(cache=True, nogil=True)(_cover_impl)
  _hit_possible = _numba.njit(cache=True, nogil=True)(_hit_possible_impl)
  _hit_floor = _numba.njit(cache=True, nogil=True)(_hit_floor_impl)
  _solve_tau_numba = _numba.njit(cache=True, nogil=True)(_solve_tau_impl)
  _feasible_numba = _numba.njit(cache=True, nogil=True)(_feasible_impl)
else:  # pragma: no cover
  _warmup_delta = warmup_delta
  _warmup_step = warmup_step
  _prefix_pair = _prefix_pair_impl
  _prefix_pair_grow = _prefix_pair_grow_impl
  _prefix_bound = _prefix_bound_impl
  _suffix_bound = _suffix_bound_impl
  _prefix_rate = _prefix_rate_impl
  _prefix_fee = _prefix_fee_impl
  _cover = _cover_impl
  _hit_possible = _hit_possible_impl
  _hit_floor = _hit_floor_impl
  _solve_tau_numba = None
  _feasible_numba = None

prefix_bound_kernel = _prefix_bound
"""The compiled :func:`prefix_bound` ``(ix, tau, check_comm)``, callable from other kernels."""

warmup_step_kernel = _warmup_step
"""The compiled :func:`warmup_step`, the transition every kernel calls."""

warmup_delta_kernel = _warmup_delta
"""The compiled :func:`harpjax.compiler.schedule.warmup_delta` the kernels take once per cut."""

_NO_BOUND = np.zeros((0, 0))
_NO_FEE = np.zeros((0, 0, 0))


@interruptible_kernel
def suffix_bound(ix: DPArrays, tau: float, lb: np.ndarray, check_comm: bool = True,
                 use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the cheapest ``sum (t + 2 c)`` of a suffix from layer ``i`` in device state
  ``d`` with every stage and cut ``<= tau``, memory ignored (``inf``: none), for the states
  :func:`prefix_bound` ``lb`` (at ``tau`` or above) says a prefix reaches."""
  fn = _suffix_bound if (use_numba and HAVE_NUMBA) else _suffix_bound_impl
  return fn(ix, float(tau), bool(check_comm), lb)


@interruptible_kernel
def prefix_rate(ix: DPArrays, tau: float, held: np.ndarray, price: np.ndarray,
                check_comm: bool = True, use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the least hourly rate that the stages of a prefix reaching layer ``i`` in
  device state ``d`` charge (the subclusters it left, at the devices held there; every stage
  and cut ``<= tau``, memory ignored; ``inf``: unreachable). A bound at ``tau`` holds at every
  smaller candidate; :class:`Pricing` ``lbr``."""
  fn = _prefix_rate if (use_numba and HAVE_NUMBA) else _prefix_rate_impl
  return fn(ix, float(tau), bool(check_comm), np.ascontiguousarray(held, np.int64),
            np.ascontiguousarray(price, np.float64))


@interruptible_kernel
def prefix_fee(ix: DPArrays, tau: float, fee: np.ndarray, check_comm: bool = True,
               use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the least transfer fee per iteration that the cuts of a prefix reaching
  layer ``i`` in device state ``d`` pay (``fee``: :class:`Pricing`'s ``[K, K, L]``; every
  stage and cut ``<= tau``, memory ignored; ``inf``: unreachable), and at ``[L, 0]`` the least
  fee of any whole plan. A bound at ``tau`` holds at every smaller candidate; :class:`Pricing`
  ``lbfee``."""
  fn = _prefix_fee if (use_numba and HAVE_NUMBA) else _prefix_fee_impl
  return fn(ix, float(tau), bool(check_comm), np.ascontiguousarray(fee, np.float64))


@interruptible_kernel
def cover_costs(ent_i: np.ndarray, ent_j: np.ndarray, ent_t: np.ndarray, weight: np.ndarray,
                taus: np.ndarray, num_layers: int, use_numba: bool = True) -> np.ndarray:
  """``[P]``: per period ``taus[g]`` the least total ``weight`` of entries (first layer
  ``ent_i``, last ``ent_j``, time ``ent_t``) of time ``<= taus[g]`` that cover every layer
  once, in order; ``inf``: none. Memory and devices ignored: with ``weight`` an entry's hourly
  rate, a lower bound on the rate of any plan within the period
  (:meth:`~harpjax.compiler.plan.index.SparseIndex.cover_rates`)."""
  fn = _cover if (use_numba and HAVE_NUMBA) else _cover_impl
  by_j = np.argsort(ent_j, kind="stable").astype(np.int64)
  return fn(np.asarray(ent_i, np.int64), np.asarray(ent_j, np.int64),
            np.asarray(ent_t, np.float64), np.asarray(weight, np.float64), by_j,
            np.ascontiguousarray(taus, np.float64), int(num_layers))


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
def hit_floor(ix: DPArrays, lb: np.ndarray, lbf: np.ndarray, sb: np.ndarray, hits: np.ndarray,
              ent_i: np.ndarray, ent_k: np.ndarray, tau: float, num_microbatches: int,
              n_hit: int, fwd_fraction: float, use_numba: bool = True) -> float:
  """A lower bound on the simulated time, less ``(B - 1) tau``, of every plan whose last hit
  is a stage of one of the entries ``hits`` (of time ``tau``), by :func:`prefix_bound` ``lb``,
  the forward half ``lbf`` of :func:`prefix_bounds` and :func:`suffix_bound` ``sb`` at ``tau``
  or above: the path of the pipeline's DAG
  through that stage, up to its own end of iteration (``inf``: no such plan). ``n_hit``
  bounds the stage's microbatches in flight (its warm-up forwards' discount)."""
  fn = _hit_floor if (use_numba and HAVE_NUMBA) else _hit_floor_impl
  return float(fn(ix, lb, lbf, sb, np.asarray(hits, np.int64), ent_i, ent_k, float(tau),
                  int(num_microbatches), int(n_hit), float(fwd_fraction)))


@interruptible_kernel
def prefix_bound(ix: DPArrays, tau: float, check_comm: bool = True,
                 use_numba: bool = True) -> np.ndarray:
  """``[L + 1, G]``: the cheapest ``sum (t + 2 c)`` plus the first stage's end time of a prefix
  reaching layer ``i`` in device state ``d`` with every stage and cut ``<= tau``, memory
  ignored (``inf``: unreachable); ``[L, 0]`` that of a whole plan. The bound at a larger
  ``tau`` is also one at a smaller ``tau`` (:func:`solve_tau` takes it)."""
  fn = _prefix_bound if (use_numba and HAVE_NUMBA) else _prefix_bound_impl
  return fn(ix, float(tau), bool(check_comm))


@interruptible_kernel
def prefix_bounds(ix: DPArrays, tau: float, fwd_fraction: float, check_comm: bool = True,
                  live: tuple[np.ndarray, np.ndarray] | None = None,
                  use_numba: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """``(lb, lbf)``, each ``[L + 1, G]``: :func:`prefix_bound`, and the cheapest forward half
  ``sum (phi t + c)`` (``phi = fwd_fraction``) of the same prefixes: what a whole plan spends
  above its suffix besides the backwards and cuts that the path to an end time below does not
  wait for (:func:`solve_tau`'s ``end_path``). ``live``: a :func:`prefix_bound` and
  :func:`suffix_bound` at a larger candidate; prefixes through states without both there are
  left out (they are in no plan)."""
  fn = _prefix_pair if (use_numba and HAVE_NUMBA) else _prefix_pair_impl
  llb, lsb = (_NO_BOUND, _NO_BOUND) if live is None else live
  return fn(ix, float(tau), bool(check_comm), float(fwd_fraction), llb, lsb)


@interruptible_kernel
def feasible(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
             check_comm: bool = True, lb: np.ndarray | None = None,
             sb: np.ndarray | None = None, use_numba: bool = True) -> bool:
  """Whether :func:`solve_tau` with ``require_hit=False`` (and no bound, no pricing) finds a
  plan: some plan has every stage (and, with ``check_comm``, cut) within ``tau`` and fits
  memory with the H-1F1B warm-ups of ``tau``. The same DP keeping per state only the fewest
  warm-ups of a suffix, not its cost: a stage fits with fewer warm-ups after it whenever it
  fits with more (:func:`warmup_step` is monotone in ``n_next``), so a suffix with the fewest
  is as good as any for feasibility. ``lb``, ``sb``: as for :func:`solve_tau`."""
  fn = _feasible_numba if (use_numba and HAVE_NUMBA) else _feasible_impl
  return bool(fn(ix, float(tau), int(num_microbatches), float(eps), int(n_cap),
                 bool(check_comm), _NO_BOUND if lb is None else lb,
                 _NO_BOUND if sb is None else sb))


@interruptible_kernel
def grow_prefix_bounds(ix: DPArrays, old_tau: float, tau: float, fwd_fraction: float,
                       lb: np.ndarray, lbf: np.ndarray, fresh: np.ndarray,
                       check_comm: bool = True,
                       live: tuple[np.ndarray, np.ndarray] | None = None,
                       use_numba: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """:func:`prefix_bounds` at ``tau`` from those at a smaller ``old_tau`` (``lb``, ``lbf``,
  taken with the same ``fwd_fraction``, ``check_comm`` and ``live``; overwritten): the same
  arrays, element for element, from a pass through the states whose bound falls and the
  entries of time in ``(old_tau, tau]`` (``fresh``: ``[K, L]`` bool, some entry of
  subcluster ``k`` from layer ``i`` has such a time). With ``check_comm`` no cut may take a
  time in ``(old_tau, tau]`` (the moves it opens after old entries are not revisited; the
  caller takes a fresh :func:`prefix_bounds` then)."""
  fn = _prefix_pair_grow if (use_numba and HAVE_NUMBA) else _prefix_pair_grow_impl
  llb, lsb = (_NO_BOUND, _NO_BOUND) if live is None else live
  return fn(ix, float(old_tau), float(tau), bool(check_comm), float(fwd_fraction), llb, lsb,
            lb, lbf, np.ascontiguousarray(fresh, np.bool_))


@interruptible_kernel
def solve_tau(ix: DPArrays, tau: float, num_microbatches: int, eps: float, n_cap: int,
              require_hit: bool, check_comm: bool, bound: float, link_hits: bool = False,
              discount: float = 0.0, use_numba: bool = True,
              lb: np.ndarray | None = None, sb: np.ndarray | None = None,
              hit_cap: int | None = None, end_path: bool = False,
              lbf: np.ndarray | None = None, hit_e: float = 0.0, hit_j: int = -1,
              pricing: Pricing | None = None
              ) -> tuple[float, np.ndarray] | tuple[float, float, float, np.ndarray]:
  """The DP at one candidate period ``tau`` (Numba kernel), for any objective.

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
    end_path: (with ``require_hit``) every stage's end time counts, not only the first's: the
      value is ``sum (t_i + 2 c_i) - phi tau (min(N_h, B) - 1) + max_{s <= h} (e_s - U_s)``,
      ``h`` the plan's last hit (a stage of time ``tau``, or the stage before a cut of
      ``tau``) and ``U_s = sum_{r < s} ((1 - phi) t_r + c_r)`` the backwards and cuts above
      ``s``. Plus ``(B - 1) tau`` it is still a lower bound on the simulated time: the path
      through ``h`` goes on up to stage ``s``, whose end of iteration follows its last
      backward (``s = 0`` gives ``e_0``; without end times the value is the one above). The
      frontier of suffixes with a hit is then over ``(n, cost, cost + xe)``
      (:class:`Frontier`), and a suffix is pruned by the forward half of its prefix
      (``lbf``) plus its own cost and end term.
    lbf: the forward half of :func:`prefix_bounds` at ``tau`` or above, for ``end_path``
      (``None``: computed here).
    hit_e: with ``end_path``, the least end time of a stage of time ``tau`` (``0`` where a
      cut may take ``tau``): a suffix without a hit gets at least that from the hit to come.
    hit_j: (with ``require_hit``) no stage of time ``tau`` ends, and no cut that may take
      ``tau`` follows, a layer before ``hit_j``: suffixes without a hit that start at or
      before it are not kept (no prefix can give them one). ``-1``: no such layer known.
    pricing: the objectives with prices (:class:`Pricing`): the same DP with the hourly rate
      as one more criterion of the frontiers (``discount`` and ``end_path`` then unused; the
      value is Eq. 12's, ranked by ``pricing.kind``, and ``bound`` is on that ranked value).
      ``None``: the time objective.

  Returns:
    ``(value, path)``: the smallest value (``inf`` if none) and the entry index of each stage
    in pipeline order. ``e_0`` is the end-of-iteration time of the first stage (``ent_e``).
    With ``pricing``: ``(value, rate, cost, path)``, the best ranked value (time, or rate
    times time; plus ``(B - 1) tau``), its hourly rate and its ``sum (t_i + 2 c_i) + e_0``;
    ties of the value go to the lower rate.
  """
  fn = _solve_tau_numba if (use_numba and HAVE_NUMBA) else _solve_tau_impl
  pr = NO_PRICING if pricing is None else _pricing_arrays(pricing)
  out = fn(ix, float(tau), int(num_microbatches), float(eps), int(n_cap), bool(require_hit),
           bool(check_comm), float(bound), bool(link_hits),
           0.0 if pricing is not None else float(discount),
           _NO_BOUND if lb is None else lb, _NO_BOUND if sb is None else sb,
           int(num_microbatches) if hit_cap is None else int(hit_cap),
           bool(end_path) and pricing is None,
           _NO_BOUND if lbf is None else lbf, float(hit_e), int(hit_j), pr)
  if pricing is None:
    return float(out[0]), out[3]
  return float(out[0]), float(out[1]), float(out[2]), out[3]


def _pricing_arrays(pricing: Pricing) -> Pricing:
  """``pricing`` with the types the compiled kernel takes (one specialisation)."""
  return Pricing(np.ascontiguousarray(pricing.held, np.int64),
                 np.ascontiguousarray(pricing.price, np.float64), int(pricing.kind),
                 float(pricing.rate_max), float(pricing.t_limit), float(pricing.relief),
                 np.ascontiguousarray(pricing.lbr, np.float64),
                 np.ascontiguousarray(pricing.fee, np.float64),
                 np.ascontiguousarray(pricing.lbfee, np.float64))


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
                    hit_cap: int | None = None, end_path: bool = False,
                    lbf: np.ndarray | None = None, hit_e: float = 0.0, hit_j: int = -1,
                    pricing: Pricing | None = None
                    ) -> tuple[float, np.ndarray] | tuple[float, float, float, np.ndarray]:
  """The pure-NumPy twin of :func:`solve_tau` (dense ``F[i, d, n, h]``, same arguments; with
  ``end_path`` the hit suffixes of each ``(i, d, n)`` are a list of every point that no other
  beats in both cost and cost plus end term; with ``pricing`` dense over the distinct rates a
  suffix can have too, ``F[i, d, n, h, r]``)."""
  del use_numba, lb, sb, hit_cap, lbf, hit_e, hit_j
  if pricing is not None and np.asarray(pricing.fee).size:
    return _solve_tau_fee_twin(ix, pricing, tau, num_microbatches, eps, n_cap, require_hit,
                               check_comm, bound, link_hits)
  if pricing is not None:
    return _solve_tau_rate_twin(ix, pricing, tau, num_microbatches, eps, n_cap, require_hit,
                                check_comm, bound, link_hits)
  if end_path and require_hit:
    return _solve_tau_paths_twin(ix, tau, num_microbatches, eps, n_cap, check_comm, bound,
                                 link_hits, discount)
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
        mp = d * st_stay.shape[1] + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2 = int(ix.mv_state[x])
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          step = t_end + 2.0 * c
          dl = warmup_delta(c, tau, eps)
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit or hit_c) else 0
            own = discount * tau if (h2 == 0 and hit and not hit_c) else 0.0
            src = F[j + 1, d2, :, h2]                      # [NC + 1] by n'
            for n_prev in np.flatnonzero(np.isfinite(src[1:])) + 1:
              n_new = warmup_step(int(n_prev), dl, B, p, a, mk)
              if n_new < 0 or n_new > NC:
                continue
              v = src[n_prev] + step - own * (n_new - 1)
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


def _solve_tau_paths_twin(ix: DPArrays, tau: float, num_microbatches: int, eps: float,
                          n_cap: int, check_comm: bool, bound: float, link_hits: bool,
                          discount: float) -> tuple[float, np.ndarray]:
  """:func:`solve_tau_numpy` with ``end_path``: ``F0[i, d, n]`` the cheapest suffix without a
  hit (dense), ``F1[(i, d, n)]`` the hit suffixes as ``(cost, xe, entry, next key)``, kept
  unless another of no more warm-ups has no larger cost and no larger cost plus ``xe``."""
  L, B = ix.ent_ptr.shape[1] - 1, int(num_microbatches)
  G, S_max = int(ix.st_sub.size), ix.st_stay.shape[1]
  NC = int(n_cap)
  F0 = np.full((L + 1, G, NC + 1), np.inf)
  P0 = {}                        # (i, d, n) -> (entry, next key or None)
  F1: dict[tuple[int, int, int], list] = {}
  n_idx = np.arange(NC + 1)
  for i in range(L - 1, -1, -1):
    for d in range(G):
      k = int(ix.st_sub[d])
      cell: dict[int, list] = {}
      for e in _active(ix, k, i, tau):
        t, ee = float(ix.ent_t[e]), float(ix.ent_e[e])
        s, j = int(ix.ent_s[e]), int(ix.ent_j[e])
        hit = t == tau
        if j == L - 1:
          if not ix.st_end[d, s]:
            continue
          if hit:
            cell.setdefault(1, []).append((t, ee, e, None))
          elif t < F0[i, d, 1]:
            F0[i, d, 1] = t
            P0[(i, d, 1)] = (e, None)
          continue
        p, a, mk = float(ix.ent_p[e]), float(ix.ent_a[e]), float(ix.mem[k])
        mp = d * S_max + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2 = int(ix.mv_state[x])
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          hit_c = link_hits and c == tau
          succ = [(n2, float(F0[j + 1, d2, n2]), None, 0) for n2 in n_idx[1:]
                  if np.isfinite(F0[j + 1, d2, n2])]
          succ += [(n2, v2, xe2, z) for n2 in n_idx[1:]
                   for z, (v2, xe2, _, _) in enumerate(F1.get((j + 1, d2, n2), []))]
          for n2, v2, xe2, z in succ:
            n = warmup_step(int(n2), warmup_delta(c, tau, eps), B, p, a, mk)
            if n < 0 or n > NC:
              continue
            own = discount * tau if (xe2 is None and hit and not hit_c) else 0.0
            v = v2 + t + 2.0 * c - own * (n - 1)
            key = (j + 1, d2, n2, z if xe2 is not None else None)
            if xe2 is None and not (hit or hit_c):
              if v < F0[i, d, n]:
                F0[i, d, n] = v
                P0[(i, d, n)] = (e, key)
              continue
            xe = ee if xe2 is None else max(ee, xe2 - (1.0 - discount) * t - c)
            cell.setdefault(n, []).append((v, xe, e, key))
      kept: list[tuple[int, tuple]] = []
      for n in sorted(cell):
        for pt in sorted(cell[n], key=lambda q: (q[0], q[0] + q[1])):
          if not any(n2 <= n and q[0] <= pt[0] and q[0] + q[1] <= pt[0] + pt[1]
                     for n2, q in kept):
            kept.append((n, pt))
      for n, pt in kept:
        F1.setdefault((i, d, n), []).append(pt)
  best, where = np.inf, None
  for r in ix.roots:
    for n in range(1, NC + 1):
      for z, (v, xe, _, _) in enumerate(F1.get((0, int(r), n), [])):
        if v + xe < best:
          best, where = v + xe, (0, int(r), n, z)
  if where is None or (np.isfinite(bound)
                       and best + (B - 1) * tau > bound * (1.0 + BOUND_SLACK)):
    return np.inf, np.zeros(0, np.int64)
  path = []
  while where is not None:
    i, d, n, z = where
    if z is None:
      e, where = P0[(i, d, n)]
    else:
      _, _, e, where = F1[(i, d, n)][z]
    path.append(int(e))
  return float(best), np.asarray(path, np.int64)


class _RateIds(dict):
  """Index of a rate among the distinct sums (rounded to 1e-9: sums in another order)."""

  def __init__(self, rates):
    super().__init__((r, x) for x, r in enumerate(rates))

  def __getitem__(self, rate):
    return super().__getitem__(round(rate, 9))


def _solve_tau_rate_twin(ix: DPArrays, pr: Pricing, tau: float, num_microbatches: int,
                         eps: float, n_cap: int, require_hit: bool, check_comm: bool,
                         bound: float, link_hits: bool
                         ) -> tuple[float, float, float, np.ndarray]:
  """:func:`solve_tau_numpy` with pricing: dense over the distinct suffix rates."""
  (st_sub, st_stay, _, st_end, roots, ent_ptr, ent_j, ent_s, ent_t, ent_p, ent_a, mem,
   _) = ix[:13]
  L, B, K, G = ent_ptr.shape[1] - 1, int(num_microbatches), ent_ptr.shape[0], int(st_sub.size)
  H = 2 if require_hit else 1
  NC = int(n_cap)
  relief = float(pr.relief)
  # Every rate a suffix can have: sums over subclusters of one charge each.
  charges = [sorted({float(pr.price[k] * h) for g in range(G) if st_sub[g] == k
                     for h in pr.held[g] if h >= 0}) for k in range(K)]
  rates = {0.0}
  for k in range(K):
    rates |= {r + c for r in rates for c in charges[k]}
  rates = sorted({round(r, 9) for r in rates})
  rid = _RateIds(rates)
  F = np.full((L + 1, G, NC + 1, H, len(rates)), np.inf)
  par = {}
  for i in range(L - 1, -1, -1):
    for d in range(G):
      k = int(st_sub[d])
      for e in _active(ix, k, i, tau):
        t = float(ent_t[e])
        s, j = int(ent_s[e]), int(ent_j[e])
        hit = 1 if (require_hit and t == tau) else 0
        if pr.held[d, s] < 0:   # the stage does not fit the subcluster
          continue
        charge = float(pr.price[k] * pr.held[d, s])
        t_end = t + float(ix.ent_e[e]) if i == 0 else t
        if j == L - 1:
          r = rid[charge]
          if st_end[d, s] and t_end < F[i, d, 1, hit, r]:
            F[i, d, 1, hit, r] = t_end
            par[(i, d, 1, hit, r)] = (e, -1, 0, 0, 0)
          continue
        p, a, mk = float(ent_p[e]), float(ent_a[e]), float(mem[k])
        mp = d * st_stay.shape[1] + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2 = int(ix.mv_state[x])
          add = 0.0 if ix.mv_sub[x] == k else charge
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          for h2 in range(H):
            h = 1 if (h2 == 1 or hit or hit_c) else 0
            src = F[j + 1, d2, :, h2, :]                  # [NC + 1, rates] by (n', r')
            for n_prev, r_prev in zip(*np.nonzero(np.isfinite(src))):
              if n_prev < 1:
                continue
              n_new = warmup_step(int(n_prev), warmup_delta(c, tau, eps), B, p, a, mk)
              if n_new < 0 or n_new > NC:
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
      for r in range(len(rates)):
        v = F[0, root, n, H - 1, r]
        tt = v + tail
        if not np.isfinite(v) or tt - relief > pr.t_limit or rates[r] > pr.rate_max:
          continue
        val = tt if pr.kind == KIND_TIME else rates[r] * tt
        if (val, rates[r]) < best[:2]:
          best = (val, rates[r], (0, int(root), n, H - 1, r))
  val, rate, key = best
  low = val - relief * (1.0 if pr.kind == KIND_TIME else rate)
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


def _solve_tau_fee_twin(ix: DPArrays, pr: Pricing, tau: float, num_microbatches: int,
                        eps: float, n_cap: int, require_hit: bool, check_comm: bool,
                        bound: float, link_hits: bool
                        ) -> tuple[float, float, float, np.ndarray]:
  """:func:`solve_tau_numpy` with pricing and transfer fees: every suffix of every state is
  kept (no dominance at all; exponential in the layers, for the tests), each with its
  warm-ups, hit flag, cost, rate and fee; the plans are then ranked by the money or the time
  within the budget with their fees."""
  L, B = ix.ent_ptr.shape[1] - 1, int(num_microbatches)
  G, S_max = int(ix.st_sub.size), ix.st_stay.shape[1]
  H = 2 if require_hit else 1
  NC = int(n_cap)
  fee = np.asarray(pr.fee, np.float64)
  suffixes: dict[tuple[int, int], list] = {}
  for i in range(L - 1, -1, -1):
    for d in range(G):
      k = int(ix.st_sub[d])
      pts = []
      for e in _active(ix, k, i, tau):
        t = float(ix.ent_t[e])
        s, j = int(ix.ent_s[e]), int(ix.ent_j[e])
        if pr.held[d, s] < 0:
          continue
        hit = 1 if (require_hit and t == tau) else 0
        charge = float(pr.price[k] * pr.held[d, s])
        t_end = t + float(ix.ent_e[e]) if i == 0 else t
        if j == L - 1:
          if ix.st_end[d, s]:
            pts.append((1, hit, t_end, charge, 0.0, e, None))
          continue
        p, a, mk = float(ix.ent_p[e]), float(ix.ent_a[e]), float(ix.mem[k])
        mp = d * S_max + s
        for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
          d2, k2 = int(ix.mv_state[x]), int(ix.mv_sub[x])
          c = float(cut_cost(ix, k, x, j))
          if check_comm and c > tau:
            continue
          hit_c = 1 if (require_hit and link_hits and c == tau) else 0
          add = 0.0 if k2 == k else charge
          for z, (n2, h2, v2, r2, f2, _, _) in enumerate(suffixes.get((j + 1, d2), ())):
            n = warmup_step(int(n2), warmup_delta(c, tau, eps), B, p, a, mk)
            if n < 0 or n > NC:
              continue
            h = 1 if (h2 or hit or hit_c) else 0
            pts.append((n, h, v2 + t_end + 2.0 * c, r2 + add, f2 + float(fee[k, k2, j]), e,
                        (j + 1, d2, z)))
      suffixes[(i, d)] = pts
  best = (np.inf, np.inf, None)
  relief = float(pr.relief)
  tail = (B - 1) * tau - relief
  for root in ix.roots:
    for z, (n, h, v, r, f, _, _) in enumerate(suffixes.get((0, int(root)), ())):
      if h != H - 1:
        continue
      tt = v + tail
      if tt > pr.t_limit or r > pr.rate_max:
        continue
      tt += relief
      if pr.kind == KIND_TIME:
        if (r - pr.rate_max) * tt + 3600.0 * f > 0.0:
          continue
        val = tt
      else:
        val = r * tt + 3600.0 * f
      if (val, r) < best[:2]:
        best = (val, r, (0, int(root), z))
  val, rate, key = best
  low = val - relief * (1.0 if pr.kind == KIND_TIME else rate)
  if key is None or low > bound * (1.0 + BOUND_SLACK):
    return np.inf, np.inf, np.inf, np.zeros(0, np.int64)
  cost = suffixes[key[:2]][key[2]][2]
  path = []
  while key is not None:
    pt = suffixes[key[:2]][key[2]]
    path.append(pt[5])
    key = pt[6]
  return float(val), float(rate), float(cost), np.asarray(path, np.int64)


# --------------------------------------------------------------------------- bounded search
#
# The DP minimises, per candidate period ``P``, a lower bound on the simulated iteration time;
# the simulator then scores its plans. A plan the DP did not propose can still simulate
# faster. The bounded exact search settles it, over the same state graph (:class:`DPArrays`,
# its moves read backwards: ``in_ptr``/``in_mv``), with the same transition
# (:func:`warmup_step`) and the same suffix points (:class:`Frontier`): for each candidate
# period it enumerates, last stage first, every suffix whose *lower bound* on the objective is
# below the best value found, simulates the whole plans that survive, and keeps the best. Where
# the DP keeps per state the suffixes no other dominates, the search keeps the one suffix being
# extended: its pool holds a point per stage of it (``succ`` the stage after, ``xe`` its end
# term ``z`` below). When it finishes within its node budget no plan beats the result: the
# optimum over all plans, by the simulator, is proved.
#
# Lower bound. For a plan with stage times ``t_s`` (forward ``f_s = phi t_s``), cuts ``c_s``,
# warm-ups ``w_s = min(N_s, B)`` and first stage's end time ``e_0``, the simulated iteration
# time ``T`` satisfies (paths of the pipeline's DAG, ``docs/schedules.md``)::
#
#   T >= H + e_0 + max( max_s [(B - 1) t_s - (w_s - 1) f_s],  max_s (B - 1) c_s ),
#   H = sum_s (t_s + 2 c_s).
#
# The first term is the path through stage ``s``: microbatch 0 down to ``s``, its round trip
# below ``s`` (of which ``w_s - 1`` forwards hide the part they overlap), every other task of
# ``s``, the last gradient back up, then stage 0's end of iteration. The second is the path
# through the ``B`` messages of one link direction. Both paths may instead stop at any stage
# ``s' <= s``, whose end of iteration follows its last backward: ``T >= H - U_s' + e_s' +
# [the term of s]``, ``U_s'`` the backwards and cuts above ``s'`` (``(1 - phi) t + c`` each),
# so ``T >= H + Z`` with ``Z`` the largest such pair (``s' = 0`` gives the bound above); a
# suffix carries its own ``Z`` and a plan costs at least the forward half of the suffix's
# prefix (``sum (phi t + c)``) plus the suffix's ``H`` and ``Z``. Also ``T >= B P`` for the
# plan's period ``P = max(t_max, max_s c_s)``. A suffix (the stages after layer ``i``, chosen
# last stage first, so its warm-ups are known) extends to a plan costing at least the cheapest
# prefix ``lb[i, d]`` (a forward pass at ``P``) plus the suffix's part of the bound; when the
# suffix has no stage or cut of time ``P`` yet, the prefix has one, contributing at least
# ``P (B - 1 - phi (n_max - 1))``. (``lb`` is computed once, at the largest candidate period:
# a bound at every smaller one.) Money objectives multiply by the hourly rate (at least the
# suffix's plus the cheapest stage when a prefix remains).

# Columns of the search's per-depth walk (besides its Frontier point): the state the suffix
# starts in, whether it has a hit, the cursor over the moves into that state and over the
# entries of the current move (and that group's end); its largest path term and its cut.
_W_D, _W_HIT, _W_X, _W_Y, _W_YEND = range(5)
_W_G, _W_C = range(2)


def _search_impl(ix, end_ptr, by_end, price, fee, taus, num_mb, eps, phi, n_max, kind, best,
                 rate_max, t_limit, r_min, node_budget, out_path, lb, lbf):
  """Kernel body; see :func:`bounded_search`."""
  L = ix.ent_ptr.shape[1] - 1
  feed = fee.shape[0] == ix.ent_ptr.shape[0] and fee.shape[0] > 0   # transfer fees
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_mb
  inf = np.inf
  is_root = np.zeros(G, np.bool_)
  for r in ix.roots:
    is_root[r] = True
  # The suffix being extended: point ``q`` its stage at depth ``q`` (0: the last stage), with
  # n its warm-ups, cost its ``H``, xe its ``Z``, r its hourly rate.
  pool = _new_frontier(L + 1)
  wi = np.zeros((L + 1, 5), np.int64)
  wf = np.zeros((L + 1, 2))
  t_arr = np.zeros(L)
  c_arr = np.zeros(L)
  e_arr = np.zeros(L)
  w_arr = np.zeros(L, np.int64)
  nodes = 0
  n_sim = 0
  best_len = 0
  best_tau = -1
  aborted = False
  slack = 1.0 + BOUND_SLACK
  for ti in range(taus.shape[0]):
    tau = taus[ti]
    floor = B * tau if kind == KIND_TIME else r_min * B * tau
    if floor > best * slack or B * tau > t_limit * slack:
      continue
    miss = tau * (B - 1 - phi * (n_max - 1))   # the least a prefix hit still adds
    for d0 in range(G):
      k0 = ix.st_sub[d0]
      for s0 in range(S_max):
        if not ix.st_end[d0, s0]:
          continue
        x0 = (k0 * L + (L - 1)) * S_max + s0
        for y0 in range(end_ptr[x0], end_ptr[x0 + 1]):
          e0 = by_end[y0]
          t0 = ix.ent_t[e0]
          if t0 > tau:
            break
          if lb[ix.ent_i[e0], d0] == inf:
            continue
          # The suffix made of the last stage alone.
          depth = 0
          pool.entry[0] = e0
          pool.n[0] = 1
          pool.cost[0] = t0
          pool.xe[0] = (B - 1) * t0 + ix.ent_e[e0]
          pool.r[0] = price[k0] * ix.ent_m[e0]
          pool.f[0] = 0.0
          pool.succ[0] = -1
          wi[0, _W_D] = d0
          wi[0, _W_HIT] = 1 if t0 == tau else 0
          wi[0, _W_X] = -1
          wf[0, _W_G] = (B - 1) * t0
          wf[0, _W_C] = 0.0
          nodes += 1
          while depth >= 0:
            if nodes > node_budget:
              aborted = True
              break
            e = pool.entry[depth]
            d = wi[depth, _W_D]
            i = ix.ent_i[e]
            if wi[depth, _W_X] == -1:
              # First visit: a complete plan if the suffix starts at layer 0.
              if i == 0:
                h = pool.cost[depth]
                rate = pool.r[depth]
                fq = pool.f[depth]
                if is_root[d] and wi[depth, _W_HIT] == 1:
                  lbv = h + ix.ent_e[e] + wf[depth, _W_G]
                  if h + pool.xe[depth] > lbv:
                    lbv = h + pool.xe[depth]
                  val = lbv if kind == KIND_TIME else rate * lbv + 3600.0 * fq
                  if val <= best * slack and lbv <= t_limit * slack and \
                      rate <= rate_max * slack:
                    S = depth + 1
                    q = depth
                    for z in range(S):
                      t_arr[z] = ix.ent_t[pool.entry[q]]
                      c_arr[z] = wf[q, _W_C]
                      e_arr[z] = ix.ent_e[pool.entry[q]]
                      w_arr[z] = pool.n[q]
                      q = pool.succ[q]
                    sim = iteration_time_kernel(t_arr[:S], c_arr[:S], e_arr[:S], w_arr[:S], B,
                                                phi)
                    n_sim += 1
                    val = sim if kind == KIND_TIME else rate * sim + 3600.0 * fq
                    # the budget with the plan's fees: rate + 3600 fee / sim <= rate_max
                    fits = not feed or (rate - rate_max * slack) * sim + 3600.0 * fq <= 0.0
                    if sim <= t_limit and val < best and fits:
                      best = val
                      best_tau = ti
                      best_len = S
                      q = depth
                      for z in range(S):
                        out_path[z] = pool.entry[q]
                        q = pool.succ[q]
                depth -= 1
                continue
              wi[depth, _W_X] = ix.in_ptr[d]
              wi[depth, _W_Y] = 0
              wi[depth, _W_YEND] = 0
            # Next child: advance the entry cursor, else the move cursor.
            pushed = False
            while not pushed:
              if wi[depth, _W_Y] >= wi[depth, _W_YEND]:
                x = wi[depth, _W_X]
                if x >= ix.in_ptr[d + 1] or nodes > node_budget:
                  break
                wi[depth, _W_X] = x + 1
                src = ix.mv_from[ix.in_mv[x]]
                d2 = src // S_max
                gx = (ix.st_sub[d2] * L + (i - 1)) * S_max + src % S_max
                wi[depth, _W_Y] = end_ptr[gx]
                wi[depth, _W_YEND] = end_ptr[gx + 1]
                continue
              y = wi[depth, _W_Y]
              wi[depth, _W_Y] = y + 1
              nodes += 1   # the budget counts every entry looked at
              mv = ix.in_mv[wi[depth, _W_X] - 1]
              d2 = ix.mv_from[mv] // S_max
              k2 = ix.st_sub[d2]
              e2 = by_end[y]
              t2 = ix.ent_t[e2]
              if t2 > tau:
                wi[depth, _W_Y] = wi[depth, _W_YEND]   # sorted by time: the rest is slower
                continue
              i2 = ix.ent_i[e2]
              pre = lb[i2, d2]
              if pre == inf:
                continue
              c = ix.c_link[ix.mv_link[mv], i - 1]
              if c > tau:
                wi[depth, _W_Y] = wi[depth, _W_YEND]   # the same cut for every entry
                continue
              n2 = _warmup_step(pool.n[depth], _warmup_delta(c, tau, eps), B, ix.ent_p[e2],
                                ix.ent_a[e2], ix.mem[k2])
              if n2 < 0:
                continue
              h2 = pool.cost[depth] + t2 + 2.0 * c
              g2 = wf[depth, _W_G]
              gs = (B - 1) * t2 - phi * t2 * (n2 - 1)
              if gs > g2:
                g2 = gs
              if (B - 1) * c > g2:
                g2 = (B - 1) * c
              hit2 = 1 if (wi[depth, _W_HIT] == 1 or t2 == tau or c == tau) else 0
              r2 = pool.r[depth] + price[k2] * ix.ent_m[e2]
              if r2 > rate_max * slack:
                continue
              f2 = pool.f[depth] + fee[k2, ix.mv_sub[mv], i - 1] if feed else 0.0
              bnd = pre + h2 + (g2 if (hit2 == 1 or g2 >= miss) else miss)
              if i2 == 0:
                bnd += ix.ent_e[e2]
              z2 = pool.xe[depth] - (1.0 - phi) * t2 - c
              if ix.ent_e[e2] + g2 > z2:
                z2 = ix.ent_e[e2] + g2
              if lbf[i2, d2] + h2 + z2 > bnd:
                bnd = lbf[i2, d2] + h2 + z2   # the prefix's forward half, then a path's end
              val = bnd if kind == KIND_TIME else (r2 + (r_min if i2 > 0 else 0.0)) * bnd
              if feed and kind != KIND_TIME:
                val += 3600.0 * f2
              if val > best * slack or bnd > t_limit * slack:
                continue
              q = depth + 1
              pool.entry[q] = e2
              pool.n[q] = n2
              pool.cost[q] = h2
              pool.xe[q] = z2
              pool.r[q] = r2
              pool.f[q] = f2
              pool.succ[q] = depth
              wi[q, _W_D] = d2
              wi[q, _W_HIT] = hit2
              wi[q, _W_X] = -1
              wf[q, _W_G] = g2
              wf[q, _W_C] = c
              depth = q
              pushed = True
            if not pushed:
              depth -= 1
          if aborted:
            break
        if aborted:
          break
      if aborted:
        break
    if aborted:
      break
  return best, best_tau, best_len, nodes, n_sim, aborted


if HAVE_NUMBA:
  _search_numba = _numba.njit(cache=True, nogil=True)(_search_impl)
else:  # pragma: no cover
  _search_numba = _search_impl


@interruptible_kernel
def bounded_search(ix: DPArrays, ends: tuple[np.ndarray, np.ndarray], taus: np.ndarray,
                   num_microbatches: int, eps: float, fwd_fraction: float, n_max: int,
                   kind: int, best: float, price: np.ndarray | None = None,
                   rate_max: float = np.inf, t_limit: float = np.inf, r_min: float = 0.0,
                   node_budget: int = 2_000_000, use_numba: bool = True,
                   fee: np.ndarray | None = None
                   ) -> tuple[float, int, np.ndarray, int, int, bool]:
  """The bounded exact search: simulates every plan whose lower bound (the section's comment)
  beats ``best``, over the DP's state graph.

  Args:
    ix: the index's arrays (:class:`DPArrays`).
    ends: ``(end_ptr, by_end)``, the entries by (subcluster, last layer, submesh), each group
      sorted by time (:attr:`~harpjax.compiler.plan.index.SparseIndex.ends`).
    taus: ``[P]`` candidate periods, seconds, ascending.
    num_microbatches: ``B``.
    eps: H-1F1B tolerance (warm-ups relative to each candidate period).
    fwd_fraction: ``phi``, the forward's share of a stage's time.
    n_max: the largest in-flight count any stage can have (``<= B``).
    kind: :data:`KIND_TIME` (the simulated time) or :data:`KIND_COST` (rate times it).
    best: the value to beat (``inf``: none).
    price: ``[K]`` price of a device per hour (``None``: zeros, the time objective).
    rate_max: hourly budget; ``t_limit``: bound on the simulated time.
    r_min: the smallest hourly rate of a single stage (for the cost bound).
    node_budget: stages to look at, at most (each a candidate stage in front of a suffix).
    use_numba: run compiled (``False``: the same code in Python).
    fee: ``[K, K, L]`` the transfer fee per iteration of each cut (:class:`Pricing`'s
      ``fee``; ``None``: none): the money is then ``rate x time + 3600 fee`` and the budget
      ``rate + 3600 fee / time <= rate_max`` (a plan's simulated time).

  Returns:
    ``(value, candidate, path, work, simulated, complete)``: the best value found below
    ``best`` (else ``best``), the position in ``taus`` of its period (``-1``: none found), its
    entries in pipeline order, the stages looked at, the plans simulated, and whether the
    search finished (then no plan beats ``value``).
  """
  L = ix.ent_ptr.shape[1] - 1
  K = ix.ent_ptr.shape[0]
  out = np.zeros(L, np.int64)
  taus = np.ascontiguousarray(taus, np.float64)
  if taus.size == 0:
    return float(best), -1, out[:0].copy(), 0, 0, True
  # One prefix bound, at the largest period: a bound at every smaller one.
  lb, lbf = prefix_bounds(ix, float(taus[-1]), float(fwd_fraction), True,
                          use_numba=use_numba)
  price = np.zeros(K) if price is None else np.ascontiguousarray(price, np.float64)
  fee = _NO_FEE if fee is None else np.ascontiguousarray(fee, np.float64)
  fn = _search_numba if (use_numba and HAVE_NUMBA) else _search_impl
  value, idx, length, nodes, n_sim, aborted = fn(
      ix, ends[0], ends[1], price, fee, taus, int(num_microbatches), float(eps),
      float(fwd_fraction), int(n_max), int(kind), float(best), float(rate_max),
      float(t_limit), float(r_min), int(node_budget), out, lb, lbf)
  return (float(value), int(idx), out[:length].copy(), int(nodes), int(n_sim), not aborted)


def bounded_search_numpy(ix: DPArrays, taus: np.ndarray, num_microbatches: int, eps: float,
                         fwd_fraction: float, kind: int, best: float,
                         price: np.ndarray | None = None, rate_max: float = np.inf,
                         t_limit: float = np.inf, fee: np.ndarray | None = None
                         ) -> tuple[float, int, np.ndarray]:
  """The pure-NumPy twin of :func:`bounded_search`: every plan of the state graph, read
  forwards as the DP reads it (no bound, no budget), at each candidate period it has (a stage
  or cut of exactly that period, every other within it), with its warm-ups from
  :func:`warmup_step` and simulated; the best one below ``best``. Exponential in the layers:
  for the tests.

  Returns:
    ``(value, candidate, path)`` as :func:`bounded_search` (candidate ``-1`` and ``best``:
    none beats it); the search, complete, finds the same value.
  """
  L = ix.ent_ptr.shape[1] - 1
  S_max = ix.st_stay.shape[1]
  B = int(num_microbatches)
  price = np.zeros(ix.ent_ptr.shape[0]) if price is None else np.asarray(price, np.float64)
  slack = 1.0 + BOUND_SLACK
  plans: list[tuple[list[int], list[float], list[int]]] = []

  def walk(i, d, path, cuts, subs):
    k = int(ix.st_sub[d])
    for e in range(int(ix.ent_ptr[k, i]), int(ix.ent_ptr[k, i + 1])):
      s, j = int(ix.ent_s[e]), int(ix.ent_j[e])
      if j == L - 1:
        if ix.st_end[d, s]:
          plans.append((path + [e], cuts + [0.0], subs + [k]))
        continue
      mp = d * S_max + s
      for x in range(int(ix.mv_ptr[mp]), int(ix.mv_ptr[mp + 1])):
        walk(j + 1, int(ix.mv_state[x]), path + [e], cuts + [float(cut_cost(ix, k, x, j))],
             subs + [k])

  for r in ix.roots:
    walk(0, int(r), [], [], [])
  found, at, where = float(best), -1, np.zeros(0, np.int64)
  for ti, tau in enumerate(np.asarray(taus, np.float64)):
    for path, cuts, subs in plans:
      t, c = ix.ent_t[path], np.asarray(cuts)
      if t.max() > tau or c.max() > tau or not (np.any(t == tau) or np.any(c == tau)):
        continue
      S = len(path)
      warm = np.ones(S, np.int64)   # the last stage holds one (every entry fits with one)
      for z in range(S - 2, -1, -1):
        e = path[z]
        warm[z] = warmup_step(int(warm[z + 1]), warmup_delta(c[z], tau, eps), B, ix.ent_p[e],
                              ix.ent_a[e], ix.mem[subs[z]])
        if warm[z] < 0:
          break
      if np.any(warm < 0):
        continue
      rate = float(np.sum(price[subs] * ix.ent_m[path]))
      if rate > rate_max * slack:
        continue
      paid = 0.0 if fee is None else float(sum(
          fee[subs[z], subs[z + 1], ix.ent_j[path[z]]] for z in range(S - 1)))
      sim = iteration_time_kernel(t, c, ix.ent_e[path], warm, B, fwd_fraction)
      val = sim if kind == KIND_TIME else rate * sim + 3600.0 * paid
      if paid > 0 and (rate - rate_max * slack) * sim + 3600.0 * paid > 0:
        continue   # over the budget with its fees
      if sim <= t_limit and val < found:
        found, at, where = val, ti, np.asarray(path, np.int64)
  return found, at, where
