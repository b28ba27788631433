"""The search with every stage's end-of-iteration time (the gradient sync and update once per
step): the DP's end-path bound against enumeration and against the simulator, and the whole
search against a brute force that simulates every plan."""

import math

import numpy as np
import pytest

from harpjax.compiler import plan as planner
from harpjax.compiler.schedule import iteration_times
from harpjax.errors import InfeasiblePlanError
from tests.compiler.plan import oracle

PHI = 1.0 / 3.0
MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True),
         dict(use_all_devices=True, keep_order=True)]


def _with_ends(tables, rng, scale=None):
  """``tables`` with random end times: up to ``scale`` (default: a random 0.5-4) times each
  entry's stage time, sometimes larger on the wide submeshes (a data-parallel all-reduce)."""
  scale = float(rng.uniform(0.5, 4.0)) if scale is None else scale
  ends = []
  for k, t in enumerate(tables.stage_time_s):
    sizes = np.array([n * m for n, m in tables.submeshes[k]], float)
    grow = sizes[None, None, :] ** rng.uniform(0.0, 1.0)
    e = rng.uniform(0.0, scale, t.shape) * t * grow
    ends.append(np.where(np.isfinite(t), e, np.inf))
  return tables.replace(end_time_s=tuple(ends))


def _end_path_value(t, c, ends, warm, B, period, discount, link_hits=True):
  """The DP's end-path value of one plan (``solve_tau``'s docstring): ``sum (t + 2c)``, the
  discount at the last hit ``h``, and ``max_{s <= h} (e_s - U_s)``; ``None`` without a hit."""
  last = oracle.last_hit(t, c, period, link_hits)
  if last is None:
    return None
  h = last[1]
  value = sum(a + 2.0 * b for a, b in zip(t, c))
  if last[0] == "stage":
    value -= discount * period * (min(warm[h], B) - 1)
  up, xe = 0.0, -math.inf
  for s in range(h + 1):
    xe = max(xe, ends[s] - up)
    up += (1.0 - discount) * t[s] + c[s]
  return value + xe


def _enumerated_minimum(tables, B, eps, period, discount, link_hits, **modes):
  best = math.inf
  for stages in oracle.enumerate_plans(tables, **modes):
    nums = oracle.plan_numbers(tables, stages, B, eps)
    if nums is None:
      continue
    t, c, ends, p, warm = nums
    if (p != period) if link_hits else (max(t) != period or p > period):
      continue
    if not oracle.fits(tables, stages, warm, B):
      continue
    v = _end_path_value(t, c, ends, warm, B, period, discount, link_hits)
    if v is not None:
      best = min(best, v)
  return best


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("chunk", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_end_path_value_matches_enumeration_at_every_candidate(chunk):
  """The DP with every stage's end time (kernel and twin): the least end-path value over the
  plans of one period, by enumeration, with cut hits and without."""
  rng = np.random.default_rng(2200 + chunk)
  for x in range(12):
    tables = _with_ends(oracle.random_tables(rng, num_layers=int(rng.integers(2, 6))), rng)
    B = int(rng.choice([2, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    for link_bound in (True, False):
      index = planner.SparseIndex.build(tables, link_bound=link_bound, **mode)
      picks = rng.choice(index.candidates, size=min(5, index.candidates.size), replace=False)
      for tau in picks:
        want = _enumerated_minimum(tables, B, eps, float(tau), PHI, link_bound, **mode)
        got = index.run(float(tau), B, eps, require_hit=True, discount=PHI, end_path=True)[0]
        twin = index.run(float(tau), B, eps, require_hit=True, discount=PHI, end_path=True,
                         kernel="numpy")[0]
        assert _close(got, want) and _close(twin, want), (x, link_bound, tau, got, twin, want)


def test_end_path_value_is_a_lower_bound_on_the_simulated_time():
  """Every valid plan: its end-path value plus ``(B - 1) P`` never exceeds the simulator's
  iteration time (and is no looser than the first stage's end time alone)."""
  rng = np.random.default_rng(2300)
  checked = tight = 0
  for _ in range(15):
    tables = _with_ends(oracle.random_tables(rng, num_layers=int(rng.integers(2, 6))), rng)
    B = int(rng.choice([1, 2, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    for stages in oracle.enumerate_plans(tables):
      nums = oracle.plan_numbers(tables, stages, B, eps)
      if nums is None:
        continue
      t, c, ends, period, warm = nums
      v = _end_path_value(t, c, ends, warm, B, period, PHI)
      sim = iteration_times([t], [c], [ends], [warm], [len(t)], B, PHI)[0]
      assert v + (B - 1) * period <= sim * (1 + 1e-12), (stages, v, sim)
      # The first stage's end alone (the old value): never more, often less.
      old = _end_path_value(t, c, [0.0] * len(t), warm, B, period, PHI) + ends[0]
      assert old <= v + 1e-12
      checked += 1
      tight += v > old + 1e-9
  assert checked > 1000 and tight > 0


@pytest.mark.parametrize("chunk", [0, 1, pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_simulated_optimum_with_end_times_matches_brute_force(chunk):
  """Random instances whose every entry has an end time (some larger than its stage time):
  the planner and a brute force that simulates every plan agree in every mode, proved."""
  rng = np.random.default_rng(2400 + chunk)
  for x in range(12):
    tables = _with_ends(oracle.random_tables(rng), rng)
    B = int(rng.choice([1, 2, 4, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    bf = oracle.brute_force(tables, B, eps=eps, **mode)
    try:
      res = planner.solve(tables, B, eps=eps, backend="sequential", **mode)
    except InfeasiblePlanError:
      res = None
    got = math.inf if res is None else res.objective_s
    assert _close(got, bf.objective_s), (x, mode, bf, res)
    if res is not None:
      assert res.stats.proved
      assert planner.evaluate_plan(tables, res.plan, B, eps=eps).iteration_s == res.iteration_s
