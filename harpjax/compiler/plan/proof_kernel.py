"""The planner's bounded exact search: every plan that could beat the best one, simulated.

The DP (:mod:`harpjax.compiler.plan.dp_kernel`) minimises, per candidate period ``P``, a lower
bound on the simulated iteration time; the simulator then scores its plans. A plan the DP did
not propose can still simulate faster. This search settles it: for each candidate period it
enumerates, last stage first, every plan whose *lower bound* on the objective is below the
best value found, simulates those that survive, and keeps the best. When it finishes within
its node budget no plan beats the result: the optimum over all plans, by the simulator, is
proved.

Lower bound. For a plan with stage times ``t_s`` (forward ``f_s = phi t_s``), cuts ``c_s``,
warm-ups ``w_s = min(N_s, B)`` and first stage's end time ``e_0``, the simulated iteration
time ``T`` satisfies (paths of the pipeline's DAG, ``docs/schedules.md``)::

  T >= H + e_0 + max( max_s [(B - 1) t_s - (w_s - 1) f_s],  max_s (B - 1) c_s ),
  H = sum_s (t_s + 2 c_s).

The first term is the path through stage ``s``: microbatch 0 down to ``s``, its round trip
below ``s`` (of which ``w_s - 1`` forwards hide the part they overlap), every other task of
``s``, the last gradient back up, then stage 0's end of iteration. The second is the path
through the ``B`` messages of one link direction. Both paths may instead stop at any stage
``s' <= s``, whose end of iteration follows its last backward: ``T >= H - U_s' + e_s' +
[the term of s]``, ``U_s'`` the backwards and cuts above ``s'`` (``(1 - phi) t + c`` each), so
``T >= H + Z`` with ``Z`` the largest such pair (``s' = 0`` gives the bound above); a suffix
carries its own ``Z`` and a plan costs at least the forward half of the suffix's prefix
(``sum (phi t + c)``) plus the suffix's ``H`` and ``Z``. Also ``T >= B P`` for the plan's period
``P = max(t_max, max_s c_s)``. A suffix (the stages after layer ``i``, chosen last stage
first, so its warm-ups are known) extends to a plan costing at least the cheapest prefix
``lb[i, d]`` (a forward pass at ``P``) plus the suffix's part of the bound; when the suffix
has no stage or cut of time ``P`` yet, the prefix has one, contributing at least
``P (B - 1 - phi (n_max - 1))``. (``lb`` is computed once, at the largest candidate period: a
bound at every smaller one.) Money objectives multiply by the hourly rate (at least the
suffix's plus the cheapest stage when a prefix remains).

The kernel runs the same code with or without Numba; its independent reference is the brute
force of the tests (``tests/compiler/plan/oracle.py``), which simulates every plan.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harpjax.compiler.plan.dp_kernel import (BOUND_SLACK, KIND_COST, KIND_TIME, DPArrays,
                                             prefix_bounds, warmup_delta_kernel,
                                             warmup_step_kernel)
from harpjax.compiler.schedule import iteration_time_kernel
from harpjax.errors import interruptible_kernel

try:
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["ProofArrays", "proof_arrays", "bounded_search", "KIND_TIME", "KIND_COST"]

_warmup_step = warmup_step_kernel   # the DP's transition (warm-up count and memory check)
_warmup_delta = warmup_delta_kernel


class ProofArrays(NamedTuple):
  """What the bounded search reads besides :class:`DPArrays`.

  ``G`` device states, ``K`` subclusters, ``L`` layers, ``S_max`` submeshes, ``E`` entries.

  Attributes:
    rv_ptr: ``[G + 1]``: the moves *into* state ``d`` are ``rv_ptr[d] .. rv_ptr[d + 1] - 1``.
    rv_state: ``[V]`` the state a stage ran in; ``rv_s``: ``[V]`` its submesh.
    is_root: ``[G]`` whether a plan may start in the state.
    grp_ptr: ``[K * L * S_max + 1]``: the entries of subcluster ``k`` ending at layer ``j`` on
      submesh ``s`` are ``grp_ent[grp_ptr[x] .. grp_ptr[x + 1] - 1]``, ``x = (k L + j) S_max +
      s``, sorted by time.
    grp_ent: ``[E]`` entry indices.
    ent_i: ``[E]`` first layer of each entry; ``ent_k``: its subcluster; ``ent_m``: its
      devices.
    price: ``[K]`` price of a device per hour (zeros without prices).
    rv_link: ``[V]`` the row of ``c_link`` pricing the move's cut (``mv_link``).
  """
  rv_ptr: np.ndarray
  rv_state: np.ndarray
  rv_s: np.ndarray
  is_root: np.ndarray
  grp_ptr: np.ndarray
  grp_ent: np.ndarray
  ent_i: np.ndarray
  ent_k: np.ndarray
  ent_m: np.ndarray
  price: np.ndarray
  rv_link: np.ndarray


def proof_arrays(ix: DPArrays, ent_i: np.ndarray, ent_k: np.ndarray, ent_m: np.ndarray,
                 price: np.ndarray | None) -> ProofArrays:
  """The reverse moves and the entries grouped by (subcluster, last layer, submesh)."""
  G, S_max = ix.st_stay.shape
  K, L = ix.ent_ptr.shape[0], ix.ent_ptr.shape[1] - 1
  src = np.repeat(np.arange(G * S_max), np.diff(ix.mv_ptr))
  order = np.argsort(ix.mv_state, kind="stable")
  into = ix.mv_state[order]
  rv_ptr = np.searchsorted(into, np.arange(G + 1), side="left").astype(np.int64)
  is_root = np.zeros(G, np.bool_)
  is_root[ix.roots] = True
  key = (ent_k * L + ix.ent_j) * S_max + ix.ent_s
  grp = np.lexsort((np.arange(key.size), ix.ent_t, key))
  grp_ptr = np.searchsorted(key[grp], np.arange(K * L * S_max + 1), side="left")
  return ProofArrays(rv_ptr=rv_ptr, rv_state=(src[order] // S_max).astype(np.int64),
                     rv_s=(src[order] % S_max).astype(np.int64), is_root=is_root,
                     grp_ptr=grp_ptr.astype(np.int64), grp_ent=grp.astype(np.int64),
                     ent_i=np.asarray(ent_i, np.int64), ent_k=np.asarray(ent_k, np.int64),
                     ent_m=np.asarray(ent_m, np.int64),
                     price=np.zeros(K) if price is None else np.asarray(price, np.float64),
                     rv_link=np.ascontiguousarray(ix.mv_link[order]))


def _search_impl(ix, px, taus, num_mb, eps, phi, n_max, kind, best, rate_max, t_limit,
                 r_min, node_budget, out_path, lb, lbf):
  """Kernel body; see :func:`bounded_search`."""
  L = ix.ent_ptr.shape[1] - 1
  G = ix.st_sub.shape[0]
  S_max = ix.st_stay.shape[1]
  B = num_mb
  inf = np.inf
  # One frame per stage of the current suffix, frame 0 the last stage.
  f_e = np.zeros(L + 1, np.int64)
  f_d = np.zeros(L + 1, np.int64)
  f_n = np.zeros(L + 1, np.int64)
  f_h = np.zeros(L + 1)          # sum (t + 2c) of the suffix from this stage
  f_g = np.zeros(L + 1)          # max of the per-stage and per-link terms
  f_z = np.zeros(L + 1)          # max of a term below plus an end time up to it (docstring)
  f_hit = np.zeros(L + 1, np.int64)
  f_r = np.zeros(L + 1)          # hourly rate of the suffix
  f_c = np.zeros(L + 1)          # the cut after this stage (0 for the last)
  f_x = np.zeros(L + 1, np.int64)  # cursor over the moves into this stage's state
  f_y = np.zeros(L + 1, np.int64)  # cursor over the entries of the current move
  f_yend = np.zeros(L + 1, np.int64)
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
        for y0 in range(px.grp_ptr[x0], px.grp_ptr[x0 + 1]):
          e0 = px.grp_ent[y0]
          t0 = ix.ent_t[e0]
          if t0 > tau:
            break
          if lb[px.ent_i[e0], d0] == inf:
            continue
          # The suffix made of the last stage alone.
          depth = 0
          f_e[0] = e0
          f_d[0] = d0
          f_n[0] = 1
          f_h[0] = t0
          f_g[0] = (B - 1) * t0
          f_z[0] = (B - 1) * t0 + ix.ent_e[e0]
          f_hit[0] = 1 if t0 == tau else 0
          f_r[0] = px.price[k0] * px.ent_m[e0]
          f_c[0] = 0.0
          f_x[0] = -1
          nodes += 1
          while depth >= 0:
            if nodes > node_budget:
              aborted = True
              break
            e = f_e[depth]
            d = f_d[depth]
            i = px.ent_i[e]
            if f_x[depth] == -1:
              # First visit: a complete plan if the suffix starts at layer 0.
              if i == 0:
                if px.is_root[d] and f_hit[depth] == 1:
                  lbv = f_h[depth] + ix.ent_e[e] + f_g[depth]
                  if f_h[depth] + f_z[depth] > lbv:
                    lbv = f_h[depth] + f_z[depth]
                  val = lbv if kind == KIND_TIME else f_r[depth] * lbv
                  if val <= best * slack and lbv <= t_limit * slack and \
                      f_r[depth] <= rate_max * slack:
                    S = depth + 1
                    for z in range(S):
                      fz = depth - z
                      ez = f_e[fz]
                      t_arr[z] = ix.ent_t[ez]
                      c_arr[z] = f_c[fz]
                      e_arr[z] = ix.ent_e[ez]
                      w_arr[z] = f_n[fz]
                    sim = iteration_time_kernel(t_arr[:S], c_arr[:S], e_arr[:S], w_arr[:S], B,
                                                phi)
                    n_sim += 1
                    val = sim if kind == KIND_TIME else f_r[depth] * sim
                    if sim <= t_limit and val < best:
                      best = val
                      best_tau = ti
                      best_len = S
                      for z in range(S):
                        out_path[z] = f_e[depth - z]
                depth -= 1
                continue
              f_x[depth] = px.rv_ptr[d]
              f_y[depth] = 0
              f_yend[depth] = 0
            # Next child: advance the entry cursor, else the move cursor.
            pushed = False
            while not pushed:
              if f_y[depth] >= f_yend[depth]:
                x = f_x[depth]
                if x >= px.rv_ptr[d + 1] or nodes > node_budget:
                  break
                f_x[depth] = x + 1
                d2 = px.rv_state[x]
                k2 = ix.st_sub[d2]
                gx = (k2 * L + (i - 1)) * S_max + px.rv_s[x]
                f_y[depth] = px.grp_ptr[gx]
                f_yend[depth] = px.grp_ptr[gx + 1]
                continue
              y = f_y[depth]
              f_y[depth] = y + 1
              nodes += 1   # the budget counts every entry looked at
              x = f_x[depth] - 1
              d2 = px.rv_state[x]
              k2 = ix.st_sub[d2]
              e2 = px.grp_ent[y]
              t2 = ix.ent_t[e2]
              if t2 > tau:
                f_y[depth] = f_yend[depth]   # sorted by time: the rest is slower
                continue
              i2 = px.ent_i[e2]
              pre = lb[i2, d2]
              if pre == inf:
                continue
              c = ix.c_link[px.rv_link[x], i - 1]
              if c > tau:
                f_y[depth] = f_yend[depth]   # the same cut for every entry of this move
                continue
              n2 = _warmup_step(f_n[depth], _warmup_delta(c, tau, eps), B, ix.ent_p[e2],
                                ix.ent_a[e2], ix.mem[k2])
              if n2 < 0:
                continue
              h2 = f_h[depth] + t2 + 2.0 * c
              g2 = f_g[depth]
              gs = (B - 1) * t2 - phi * t2 * (n2 - 1)
              if gs > g2:
                g2 = gs
              if (B - 1) * c > g2:
                g2 = (B - 1) * c
              hit2 = 1 if (f_hit[depth] == 1 or t2 == tau or c == tau) else 0
              r2 = f_r[depth] + px.price[k2] * px.ent_m[e2]
              if r2 > rate_max * slack:
                continue
              bnd = pre + h2 + (g2 if (hit2 == 1 or g2 >= miss) else miss)
              if i2 == 0:
                bnd += ix.ent_e[e2]
              z2 = f_z[depth] - (1.0 - phi) * t2 - c
              if ix.ent_e[e2] + g2 > z2:
                z2 = ix.ent_e[e2] + g2
              if lbf[i2, d2] + h2 + z2 > bnd:
                bnd = lbf[i2, d2] + h2 + z2   # the prefix's forward half, then a path's end
              val = bnd if kind == KIND_TIME else (r2 + (r_min if i2 > 0 else 0.0)) * bnd
              if val > best * slack or bnd > t_limit * slack:
                continue
              depth += 1
              f_e[depth] = e2
              f_d[depth] = d2
              f_n[depth] = n2
              f_h[depth] = h2
              f_g[depth] = g2
              f_z[depth] = z2
              f_hit[depth] = hit2
              f_r[depth] = r2
              f_c[depth] = c
              f_x[depth] = -1
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


if _numba is not None:
  _search_jit = _numba.njit(cache=True, nogil=True)(_search_impl)
else:  # pragma: no cover
  _search_jit = _search_impl


@interruptible_kernel
def bounded_search(ix: DPArrays, px: ProofArrays, taus: np.ndarray, num_microbatches: int,
                   eps: float, fwd_fraction: float, n_max: int, kind: int, best: float,
                   rate_max: float = np.inf, t_limit: float = np.inf, r_min: float = 0.0,
                   node_budget: int = 2_000_000, use_numba: bool = True
                   ) -> tuple[float, int, np.ndarray, int, int, bool]:
  """Simulates every plan whose lower bound (module docstring) beats ``best``.

  Args:
    ix, px: the index's arrays and :func:`proof_arrays`.
    taus: ``[P]`` candidate periods, seconds, ascending.
    num_microbatches: ``B``.
    eps: H-1F1B tolerance (warm-ups relative to each candidate period).
    fwd_fraction: ``phi``, the forward's share of a stage's time.
    n_max: the largest in-flight count any stage can have (``<= B``).
    kind: :data:`KIND_TIME` (the simulated time) or :data:`KIND_COST` (rate times it).
    best: the value to beat (``inf``: none).
    rate_max: hourly budget; ``t_limit``: bound on the simulated time.
    r_min: the smallest hourly rate of a single stage (for the cost bound).
    node_budget: stages to look at, at most (each a candidate stage in front of a suffix).
    use_numba: run compiled (``False``: the same code in Python).

  Returns:
    ``(value, candidate, path, work, simulated, complete)``: the best value found below
    ``best`` (else ``best``), the position in ``taus`` of its period (``-1``: none found), its
    entries in pipeline order, the stages looked at, the plans simulated, and whether the
    search finished (then no plan beats ``value``).
  """
  L = ix.ent_ptr.shape[1] - 1
  out = np.zeros(L, np.int64)
  taus = np.ascontiguousarray(taus, np.float64)
  if taus.size == 0:
    return float(best), -1, out[:0].copy(), 0, 0, True
  # One prefix bound, at the largest period: a bound at every smaller one.
  lb, lbf = prefix_bounds(ix, float(taus[-1]), float(fwd_fraction), True)
  fn = _search_jit if use_numba else _search_impl
  value, idx, length, nodes, n_sim, aborted = fn(
      ix, px, taus, int(num_microbatches), float(eps), float(fwd_fraction), int(n_max),
      int(kind), float(best), float(rate_max), float(t_limit), float(r_min), int(node_budget),
      out, lb, lbf)
  return (float(value), int(idx), out[:length].copy(), int(nodes), int(n_sim), not aborted)
