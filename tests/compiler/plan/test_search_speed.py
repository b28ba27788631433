"""The shortcuts of the search that leave its answers as they are: the feasibility DP that
keeps only the fewest warm-ups (against the full DP's), the prefix bounds grown from those at a
smaller period (against a fresh pass, element for element) and the prefix bound taken
through the states live at a larger period (against the plain one)."""

import math

import numpy as np
import pytest

from harpjax.compiler.plan.index import SparseIndex
from tests.compiler.plan import oracle
from tests.compiler.plan.test_end_times import _with_ends

MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True)]


@pytest.mark.parametrize("mode", MODES)
def test_feasible_is_the_full_dp_finding_a_plan(mode):
  rng = np.random.default_rng(2201)
  checked = 0
  for _ in range(8):
    tables = _with_ends(oracle.random_tables(rng), rng)
    index = SparseIndex.build(tables, link_bound=True, **mode)
    B = int(rng.integers(2, 12))
    for tau in index.candidates:
      for eps in (0.0, 0.1):
        full = math.isfinite(index.run(float(tau), B, eps, require_hit=False)[0])
        assert index.feasible(float(tau), B, eps) == full
        assert index.feasible(float(tau), B, eps, use_numba=False) == full
        checked += full
  assert checked > 10   # plans were found, not only their absence


def test_grown_prefix_bounds_equal_a_fresh_pass():
  rng = np.random.default_rng(2202)
  for _ in range(10):
    tables = _with_ends(oracle.random_tables(rng), rng)
    index = SparseIndex.build(tables, link_bound=True)
    cand = index.candidates
    if cand.size < 4:
      continue
    top = float(cand[-1])
    lb = index.prefix_bound(top)
    live = (lb, index.suffix_bound(top, lb))
    steps = sorted({int(x) for x in rng.integers(0, cand.size, 5)})
    grown = index.prefix_bounds(float(cand[steps[0]]), 0.3, live=live)
    for a, b in zip(steps, steps[1:]):
      grown = index.grow_prefix_bounds(float(cand[a]), float(cand[b]), 0.3,
                                       (grown[0].copy(), grown[1].copy()), live=live)
      fresh = index.prefix_bounds(float(cand[b]), 0.3, live=live)
      np.testing.assert_array_equal(grown[0], fresh[0])
      np.testing.assert_array_equal(grown[1], fresh[1])
    # The plain prefix bound (no forward half, no live states) grows the same way.
    a, b = float(cand[steps[0]]), float(cand[steps[-1]])
    plain = index.grow_prefix_bounds(a, b, -1.0, (index.prefix_bound(a), np.zeros((0, 0))))[0]
    np.testing.assert_array_equal(plain, index.prefix_bound(b))
    # A bound through the live states above is the plain one wherever a suffix leaves.
    tau = float(cand[steps[-1]])
    plain = index.prefix_bound(tau)
    through = index.prefix_bound(tau, live=live)
    sb = index.suffix_bound(tau, plain)
    has = np.isfinite(sb)
    np.testing.assert_array_equal(through[:-1][has[:-1]], plain[:-1][has[:-1]])
    np.testing.assert_array_equal(index.suffix_bound(tau, through), sb)

