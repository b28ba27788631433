"""Transfer fees inside the one search: every money objective and the budget with fees exact
against brute force (the simulator's and the paper's model), the kernel with fees against its
twins, and fee-free tables unchanged."""

import math

import numpy as np
import pytest

from harpjax.cluster import TransferFees
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import dp_kernel
from harpjax.compiler.profile import LinkFees
from harpjax.errors import InfeasiblePlanError
from tests.compiler.plan import oracle

MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True),
         dict(use_all_devices=True, keep_order=True)]

CASES = [("max_throughput_per_dollar", {}, dict(objective="min_cost")),
         ("min_time_within_budget", dict(budget_per_hour=6.0), dict(budget_per_hour=6.0)),
         ("min_cost_within_time", dict(time_limit_s=40.0),
          dict(objective="min_cost", time_limit_s=40.0)),
         ("min_time", dict(budget_per_hour=8.0), dict(budget_per_hour=8.0))]


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


def _solve(tables, B, objective, **kw):
  kw.setdefault("schedule", "h1f1b")   # the search's exactness is about H-1F1B's stages
  try:
    return planner.solve(tables, B, objective=objective, backend="sequential", **kw)
  except InfeasiblePlanError:
    return None


def _value(res, objective):
  if res is None:
    return math.inf
  if objective in ("min_time", "min_time_within_budget"):
    return res.objective_s
  return res.rate_per_hour * res.objective_s + 3600.0 * res.fees_per_iteration


def _check(tables, B, res, kw):
  """The result's money is the evaluator's, with fees, and keeps its bounds."""
  quads = [(s.layers[0], s.layers[1], s.subcluster, s.submesh_index) for s in res.stages]
  ev = planner.evaluate_plan(tables, quads, B)
  assert _close(res.fees_per_iteration, ev.fees_per_iteration)
  assert _close(res.fees_per_iteration, oracle.plan_fee(tables, quads, B))
  assert res.transfer_bytes == ev.transfer_bytes
  assert _close(res.cost_per_iteration,
                res.rate_per_hour * res.objective_s / 3600 + res.fees_per_iteration)
  assert res.rate_with_fees_per_hour <= kw.get("budget_per_hour", math.inf) * (1 + 1e-9)
  assert res.objective_s <= kw.get("time_limit_s", math.inf)


def _instances(seed, count):
  rng = np.random.default_rng(seed)
  for x in range(count):
    B = int(rng.choice([2, 8, 32]))
    tables = oracle.random_fees(rng, oracle.random_tables(rng, priced=True), B)
    yield x, B, tables


@pytest.mark.parametrize("chunk", [0, *(pytest.param(c, marks=pytest.mark.slow)
                                        for c in range(1, 4))])
def test_money_with_fees_matches_brute_force(chunk):
  """Every money objective and the time within a budget with fees, ranked by the simulator:
  the planner's optimum (proved) is brute force's over every plan, scored with its fees."""
  moved = 0
  for x, B, tables in _instances(5000 + chunk, 12):
    mode = MODES[x % len(MODES)]
    for objective, kw, bf_kw in CASES:
      bf = oracle.brute_force(tables, B, **mode, **bf_kw)
      res = _solve(tables, B, objective, **mode, **kw)
      assert _close(_value(res, objective), bf.objective_s), (x, objective, mode, bf)
      if res is not None:
        assert res.stats.proved
        _check(tables, B, res, kw)
        blind = oracle.brute_force(tables.replace(fees=None), B, **mode, **bf_kw)
        moved += blind.stages != bf.stages
  assert moved >= 2, moved   # the fees change the best plan on these instances


@pytest.mark.parametrize("chunk", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_eq12_money_with_fees_kernel_twin_and_brute_force_agree(chunk):
  """The same with the paper's Eq. 12: the DP with fees (Numba kernel and its twin, which
  keeps every suffix) is exact, without the bounded search."""
  for x, B, tables in _instances(5100 + chunk, 6 if chunk == 0 else 12):
    mode = MODES[x % len(MODES)]
    for objective, kw, bf_kw in CASES:
      bf = oracle.brute_force(tables, B, cost_model="eq12", **mode, **bf_kw)
      got = _solve(tables, B, objective, cost_model="eq12", **mode, **kw)
      twin = _solve(tables, B, objective, cost_model="eq12", kernel="numpy", **mode, **kw)
      assert _close(_value(got, objective), bf.objective_s), (x, objective, mode, bf)
      assert _close(_value(twin, objective), bf.objective_s), (x, objective, mode, bf)
      if got is not None:
        _check(tables, B, got, kw)


@pytest.mark.parametrize("kind", [dp_kernel.KIND_TIME, dp_kernel.KIND_COST])
def test_kernel_with_fees_equals_its_twin_at_every_candidate(kind):
  """The kernel's frontiers with the fee coordinate (and its prefix fee bound, pruning at the
  twin's optimum) give the value and rate of the twin that keeps every suffix."""
  rng = np.random.default_rng(70 + kind)
  checked = 0
  for x in range(24):
    B = int(rng.choice([2, 8, 32]))
    tables = oracle.random_fees(rng, oracle.random_tables(
        rng, num_layers=int(rng.integers(2, 5)), priced=True), B)
    index = planner.SparseIndex.build(tables, link_bound=bool(x % 2), **MODES[x % len(MODES)])
    fee = index.fees(B)
    if fee is None:
      continue
    price = np.asarray(tables.price_per_gpu_hour)
    for tau in rng.choice(index.candidates, size=min(4, index.candidates.size), replace=False):
      tau = float(tau)
      lbr, lbfee = index.prefix_rate(tau, price), index.prefix_fee(tau, B)
      limits = ((math.inf, 12 * tau),) if kind == dp_kernel.KIND_COST else ((3.0, math.inf),
                                                                           (6.0, math.inf))
      for rate_max, t_limit in ((math.inf, math.inf),) + limits:
        pr = index.pricing(price, kind, rate_max, t_limit, fee=fee)
        want = index.run(tau, B, 0.1, require_hit=True, kernel="numpy", pricing=pr)
        got = index.run(tau, B, 0.1, require_hit=True, pricing=pr)
        assert _close(got[0], want[0]) and _close(got[1], want[1]), (tau, got, want)
        if math.isfinite(want[0]):
          bounded = index.run(tau, B, 0.1, require_hit=True, bound=want[0], pricing=index.pricing(
              price, kind, rate_max, t_limit, lbr=lbr, fee=fee, lbfee=lbfee))
          assert _close(bounded[0], want[0]) and _close(bounded[1], want[1])
          checked += 1
  assert checked > 12, checked


@pytest.mark.parametrize("kind", [dp_kernel.KIND_TIME, dp_kernel.KIND_COST])
def test_bounded_search_with_fees_equals_its_twin(kind):
  """The bounded exact search with fees (compiled and in Python) finds its twin's value, the
  twin simulating every plan of the state graph with its fees."""
  rng = np.random.default_rng(80 + kind)
  found = 0
  for x in range(10):
    B = int(rng.choice([2, 8, 32]))
    tables = oracle.random_fees(rng, oracle.random_tables(
        rng, num_layers=int(rng.integers(2, 5)), priced=True), B)
    index = planner.SparseIndex.build(tables, link_bound=True, **MODES[x % len(MODES)])
    fee = index.fees(B)
    price = np.asarray(tables.price_per_gpu_hour)
    taus, phi, eps = index.candidates, 1.0 / 3.0, 0.1
    for rate_max in ((math.inf,) if kind == dp_kernel.KIND_COST else (4.0, 8.0)):
      want = dp_kernel.bounded_search_numpy(index.arrays, taus, B, eps, phi, kind, math.inf,
                                            price, rate_max, fee=fee)
      for use_numba in (True, False):
        value, pos, path, _, _, complete = dp_kernel.bounded_search(
            index.arrays, index.ends, taus, B, eps, phi, index.n_cap(B), kind, math.inf, price,
            rate_max, math.inf, index.r_min(price), use_numba=use_numba, fee=fee)
        assert complete and _close(value, want[0]), (value, want[0])
        if pos >= 0:
          found += 1
          ev = planner.evaluate_plan(tables, [index.entry(int(e)) for e in path], B, eps=eps,
                                     fwd_fraction=phi)
          money = ev.rate_per_hour * ev.iteration_s + 3600 * ev.fees_per_iteration
          assert _close(ev.iteration_s if kind == dp_kernel.KIND_TIME else money, value)
          assert ev.rate_with_fees_per_hour <= rate_max * (1 + 1e-9)
  assert found > 8, found


def test_fee_free_tables_are_unchanged():
  """Fees of zero, or every subcluster in one zone, plan exactly as tables without fees; a
  zero fee array through the kernel's fee coordinate gives the values without it."""
  rng = np.random.default_rng(90)
  for x in range(8):
    tables = oracle.random_tables(rng, priced=True)
    B = 8
    names = tables.subcluster_names
    zero = tables.replace(fees=LinkFees(tuple((n, f"z{k}", "r") for k, n in enumerate(names)),
                                        TransferFees(0.0, 0.0, 0.0)))
    one_zone = tables.replace(fees=LinkFees(tuple((n, "z", "r") for n in names)))
    for objective, kw, _ in CASES:
      plain = _solve(tables, B, objective, **kw)
      for other in (zero, one_zone):
        got = _solve(other, B, objective, **kw)
        assert (plain is None) == (got is None)
        if plain is not None:
          assert got.plan.to_json() == plain.plan.to_json()
          assert got.fees_per_iteration == 0.0 and got.value == plain.value
    index = planner.SparseIndex.build(tables)
    price = np.asarray(tables.price_per_gpu_hour)
    nil = np.zeros((tables.num_subclusters,) * 2 + (tables.num_layers,))
    for tau in index.candidates[::3]:
      for kind in (dp_kernel.KIND_TIME, dp_kernel.KIND_COST):
        rate_max = 5.0 if kind == dp_kernel.KIND_TIME else math.inf
        a = index.run(float(tau), B, 0.1, require_hit=True,
                      pricing=index.pricing(price, kind, rate_max))
        b = index.run(float(tau), B, 0.1, require_hit=True,
                      pricing=index.pricing(price, kind, rate_max, fee=nil))
        assert _close(a[0], b[0]) and _close(a[1], b[1]), (tau, a, b)
