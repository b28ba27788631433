"""One search: the transition every kernel calls, the rate criterion of the one DP kernel
(against its dense twin and against the time objective it extends), its bounds, and the
objectives' registry."""

import importlib
import itertools
import math

import numpy as np
import pytest

from harpjax.compiler import plan as planner
from harpjax.compiler.plan import dp_kernel
from harpjax.compiler.schedule import warmup_delta
from harpjax.errors import PlanError
from tests.compiler.plan import oracle

solve_mod = importlib.import_module("harpjax.compiler.plan.solve")

MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True),
         dict(use_all_devices=True, keep_order=True)]


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


def test_warmup_step_is_the_recurrence_and_its_memory_check():
  """The compiled transition, its Python twin and Eq. 1-2 with Eq. 18 written out agree."""
  rng = np.random.default_rng(0)
  for _ in range(2000):
    n_next = int(rng.integers(1, 40))
    tau = float(rng.uniform(0.01, 1.0))
    c = float(rng.choice([0.0, rng.uniform(0, 1.5) * tau, tau, tau / 2]))
    eps = float(rng.choice([0.0, 0.1, 0.3]))
    B = int(rng.integers(1, 64))
    p, a = float(rng.uniform(0, 10)), float(rng.uniform(0, 1))
    mem = float(rng.uniform(0, 30))
    n = min(n_next + warmup_delta(c, tau, eps), B)
    want = n if p + n * a <= mem else -1
    delta = dp_kernel.warmup_delta_kernel(c, tau, eps)
    assert delta == warmup_delta(c, tau, eps)
    assert dp_kernel.warmup_step(n_next, delta, B, p, a, mem) == want
    assert dp_kernel.warmup_step_kernel(n_next, delta, B, p, a, mem) == want


def test_cover_costs_equal_every_cover_enumerated():
  """The cheapest cover of the layers by entries within a period (the money objectives'
  floor), compiled and in Python, against every way to cut the layers."""
  rng = np.random.default_rng(1)
  for _ in range(30):
    L = int(rng.integers(1, 6))
    ranges = [(i, j) for i in range(L) for j in range(i, L) for _ in range(int(rng.integers(0, 3)))]
    if not ranges:
      continue
    ent_i = np.array([r[0] for r in ranges])
    ent_j = np.array([r[1] for r in ranges])
    ent_t = rng.uniform(0.1, 1.0, len(ranges))
    w = rng.uniform(0.5, 5.0, len(ranges))
    taus = np.sort(rng.uniform(0.1, 1.2, 5))
    got = dp_kernel.cover_costs(ent_i, ent_j, ent_t, w, taus, L)
    twin = dp_kernel.cover_costs(ent_i, ent_j, ent_t, w, taus, L, use_numba=False)
    for g, tau in enumerate(taus):
      best = math.inf
      for cuts in itertools.product([0, 1], repeat=L - 1):   # a cut after layer x or not
        ends = [x for x in range(L - 1) if cuts[x]] + [L - 1]
        total, first = 0.0, 0
        for last in ends:
          opts = [w[e] for e in range(len(ranges))
                  if ent_i[e] == first and ent_j[e] == last and ent_t[e] <= tau]
          total += min(opts, default=math.inf)
          first = last + 1
        best = min(best, total)
      assert _close(got[g], best) and _close(twin[g], best), (got[g], twin[g], best)


@pytest.mark.parametrize("kind", [dp_kernel.KIND_TIME, dp_kernel.KIND_COST])
def test_rate_criterion_kernel_equals_its_twin_at_every_candidate(kind):
  """The one kernel with the rate criterion on (and its prefix rate bound, pruning at the
  twin's own optimum as the bound) gives the dense twin's value and rate at every candidate;
  with a budget and a time limit too."""
  rng = np.random.default_rng(40 + kind)
  checked = 0
  for x in range(16):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 6)), priced=True)
    B = int(rng.choice([2, 8, 32]))
    index = planner.SparseIndex.build(tables, link_bound=bool(x % 2), **MODES[x % len(MODES)])
    price = np.asarray(tables.price_per_gpu_hour)
    for tau in rng.choice(index.candidates, size=min(5, index.candidates.size), replace=False):
      tau = float(tau)
      lbr = index.prefix_rate(tau, price)
      for rate_max, t_limit in ((math.inf, math.inf), (3.0, math.inf), (math.inf, 12 * tau)):
        pr = index.pricing(price, kind, rate_max, t_limit)
        want = index.run(tau, B, 0.1, require_hit=True, kernel="numpy", pricing=pr)
        got = index.run(tau, B, 0.1, require_hit=True, pricing=pr)
        assert _close(got[0], want[0]) and _close(got[1], want[1]), (tau, got, want)
        if math.isfinite(want[0]):
          bounded = index.run(tau, B, 0.1, require_hit=True, bound=want[0],
                              pricing=index.pricing(price, kind, rate_max, t_limit, lbr=lbr))
          assert _close(bounded[0], want[0]) and _close(bounded[1], want[1])
          checked += 1
  assert checked > 30


def test_prices_of_zero_give_the_time_objective():
  """The rate criterion is a parameter of the time DP: with every price zero and the time
  ranked it finds the time DP's value (Eq. 12's model, the first stage's end time in)."""
  rng = np.random.default_rng(7)
  for x in range(20):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 6)), priced=True)
    B = int(rng.choice([2, 8, 32]))
    index = planner.SparseIndex.build(tables, **MODES[x % len(MODES)])
    free = index.pricing(np.zeros(tables.num_subclusters), dp_kernel.KIND_TIME)
    for tau in index.candidates:
      for hit in (True, False):
        plain = index.run(float(tau), B, 0.1, require_hit=hit)[0]
        priced = index.run(float(tau), B, 0.1, require_hit=hit, pricing=free)[0]
        want = plain + (B - 1) * float(tau) if math.isfinite(plain) else math.inf
        assert _close(priced, want), (tau, hit, priced, want)


def test_objective_registry_says_what_each_objective_needs():
  assert planner.OBJECTIVES == tuple(solve_mod.OBJECTIVE_REGISTRY)
  for name, goal in solve_mod.OBJECTIVE_REGISTRY.items():
    assert goal.name == name and solve_mod.objective_of(name) is goal
    bounds = dict(budget_per_hour=3.0, time_limit_s=10.0)
    kw = {goal.requires: bounds[goal.requires]} if goal.requires else {}
    opts = planner.SolveOptions(objective=name, **kw)   # accepted with what it requires
    assert goal.value(2.0, 5.0) == (5.0 if goal.kind == dp_kernel.KIND_TIME else 10.0)
    for field in set(bounds) - set(goal.accepts):
      with pytest.raises(PlanError, match="does not use it"):
        planner.SolveOptions(objective=name, **{field: bounds[field], **kw})
    assert opts.objective == name
  with pytest.raises(PlanError, match="choose one of"):
    solve_mod.objective_of("fastest")


@pytest.mark.parametrize("kind", [dp_kernel.KIND_TIME, dp_kernel.KIND_COST])
def test_bounded_search_equals_its_twin(kind):
  """The bounded exact search (compiled, and the same code in Python) over the DP's state
  graph finds, within its budget, the value of its NumPy twin, which simulates every plan of
  that graph at each candidate period without a bound; its plan simulates to that value.
  With a budget, a time limit and a value to beat too."""
  rng = np.random.default_rng(60 + kind)
  found = 0
  for x in range(12):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 5)), priced=True)
    B = int(rng.choice([2, 8, 32]))
    index = planner.SparseIndex.build(tables, link_bound=True, **MODES[x % len(MODES)])
    price = np.asarray(tables.price_per_gpu_hour) if kind == dp_kernel.KIND_COST else None
    taus = index.candidates
    phi, eps = 1.0 / 3.0, 0.1
    n_max = index.n_cap(B)
    r_min = index.r_min(price) if price is not None else 0.0
    full = dp_kernel.bounded_search_numpy(index.arrays, taus, B, eps, phi, kind, math.inf,
                                          price)
    limits = [(math.inf, math.inf, math.inf)]
    if math.isfinite(full[0]):
      limits += [(full[0] * 1.5, math.inf, math.inf), (math.inf, 3.0, math.inf),
                 (math.inf, math.inf, 1.2 * float(taus[full[1]]) * B)]
    for best, rate_max, t_limit in limits:
      if kind == dp_kernel.KIND_TIME and math.isfinite(rate_max):
        continue
      want = dp_kernel.bounded_search_numpy(index.arrays, taus, B, eps, phi, kind, best,
                                            price, rate_max, t_limit)
      for use_numba in (True, False):
        got = dp_kernel.bounded_search(index.arrays, index.ends, taus, B, eps, phi, n_max,
                                       kind, best, price, rate_max, t_limit, r_min,
                                       use_numba=use_numba)
        value, pos, path, _, _, complete = got
        assert complete
        assert _close(value, want[0]), (value, want[0])
        assert (pos < 0) == (want[1] < 0)
        if pos >= 0:
          found += 1
          _, _, again = dp_kernel.bounded_search_numpy(
              index.arrays, taus[pos:pos + 1], B, eps, phi, kind, math.inf, price)
          assert again.size   # the search's plan has that period
          stages = [index.entry(int(e)) for e in path]
          ev = planner.evaluate_plan(tables, stages, B, eps=eps, fwd_fraction=phi)
          sim = ev.iteration_s if kind == dp_kernel.KIND_TIME else \
              ev.rate_per_hour * ev.iteration_s
          assert _close(sim, value), (sim, value)
  assert found > 20, found
