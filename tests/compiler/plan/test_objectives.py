"""The objectives with prices: exact against brute force (kernel and NumPy twin), and
consistent with each other and with the time objective."""

import math

import numpy as np
import pytest

from harpjax.compiler import plan as planner
from harpjax.errors import InfeasiblePlanError, PlanError
from tests.compiler.plan import oracle

MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True),
         dict(use_all_devices=True, keep_order=True)]


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


def _value(tables, B, objective, kernel="numba", **kw):
  """The optimised quantity: seconds (time objectives) or rate x seconds (cost ones)."""
  # The search's exactness is about H-1F1B's stages: the schedule stays H-1F1B (the choice of
  # schedule after the search: tests/compiler/plan/test_schedule_choice.py).
  kw.setdefault("schedule", "h1f1b")
  try:
    r = planner.solve(tables, B, objective=objective, kernel=kernel, backend="sequential", **kw)
  except InfeasiblePlanError:
    return math.inf, None
  if objective in ("min_time", "min_time_within_budget"):
    return r.objective_s, r
  return r.rate_per_hour * r.objective_s, r


CASES = [("max_throughput_per_dollar", {}, dict(objective="min_cost")),
         ("min_time_within_budget", dict(budget_per_hour=6.0), dict(budget_per_hour=6.0)),
         ("min_cost_within_time", dict(time_limit_s=40.0),
          dict(objective="min_cost", time_limit_s=40.0)),
         ("min_time", {}, {})]


def _check(tables, B, res, kw, mode):
  ev = planner.evaluate_plan(tables, res.plan, B)
  assert ev.feasible and ev.uses_all_devices >= mode.get("use_all_devices", False)
  assert _close(res.rate_per_hour, oracle.plan_rate(tables, [
      (s.layers[0], s.layers[1], s.subcluster, s.submesh_index) for s in res.stages]))
  assert _close(res.cost_per_iteration, res.rate_per_hour * res.objective_s / 3600)
  assert res.rate_per_hour <= kw.get("budget_per_hour", math.inf)
  assert res.objective_s <= kw.get("time_limit_s", math.inf)
  assert res.plan.predicted_iteration_s == ev.iteration_s


@pytest.mark.parametrize("chunk", [0, 1, *(pytest.param(c, marks=pytest.mark.slow)
                                           for c in range(2, 8))])
def test_objectives_match_brute_force_on_random_instances(chunk):
  """Every objective, ranked by the simulator (the default), against a brute force that
  simulates every plan: the same optimum, proved."""
  rng = np.random.default_rng(3000 + chunk)
  for x in range(24):
    tables = oracle.random_tables(rng, priced=True)
    B = int(rng.choice([2, 8, 32]))
    mode = MODES[x % len(MODES)]
    for objective, kw, bf_kw in CASES:
      bf = oracle.brute_force(tables, B, **mode, **bf_kw)
      got, res = _value(tables, B, objective, **mode, **kw)
      assert _close(got, bf.objective_s), (objective, mode, got, bf)
      if res is not None:
        assert res.stats.proved and res.objective_s == res.iteration_s
        _check(tables, B, res, kw, mode)


@pytest.mark.parametrize("chunk", [0, *(pytest.param(c, marks=pytest.mark.slow)
                                        for c in range(1, 3))])
def test_eq12_objectives_kernel_twin_and_brute_force_agree(chunk):
  """The same objectives with the paper's Eq. 12 and its rule c <= t_max: the rate DP (Numba
  kernel and NumPy twin) is exact."""
  rng = np.random.default_rng(3100 + chunk)
  for x in range(24):
    tables = oracle.random_tables(rng, priced=True)
    B = int(rng.choice([2, 8, 32]))
    mode = MODES[x % len(MODES)]
    for objective, kw, bf_kw in CASES:
      bf = oracle.brute_force(tables, B, cost_model="eq12", **mode, **bf_kw)
      got, res = _value(tables, B, objective, cost_model="eq12", **mode, **kw)
      twin, _ = _value(tables, B, objective, kernel="numpy", cost_model="eq12", **mode, **kw)
      assert _close(got, bf.objective_s), (objective, mode, got, bf)
      assert _close(twin, bf.objective_s), (objective, mode, twin, bf)
      if res is not None:
        _check(tables, B, res, kw, mode)


def test_objectives_agree_with_each_other():
  """A budget at least the cheapest fastest plan's rate gives the fastest time; the cheapest
  plan per iteration is never cheaper than what the time objective's plan costs."""
  rng = np.random.default_rng(41)
  for _ in range(25):
    tables = oracle.random_tables(rng, priced=True)
    B = 8
    fastest, res = _value(tables, B, "min_time")
    if res is None:
      continue
    within, _ = _value(tables, B, "min_time_within_budget", budget_per_hour=res.rate_per_hour)
    assert _close(within, fastest)
    cheapest, cres = _value(tables, B, "max_throughput_per_dollar")
    assert cheapest <= res.rate_per_hour * res.objective_s * (1 + 1e-12)
    limited, _ = _value(tables, B, "min_cost_within_time", time_limit_s=cres.objective_s)
    assert _close(limited, cheapest)


def test_priced_options_are_checked():
  tables = oracle.random_tables(np.random.default_rng(0))
  with pytest.raises(PlanError, match="needs prices"):
    planner.solve(tables, 4, objective="max_throughput_per_dollar")
  with pytest.raises(PlanError, match="budget_per_hour"):
    planner.SolveOptions(objective="min_time_within_budget")
  with pytest.raises(PlanError, match="time_limit_s"):
    planner.SolveOptions(objective="min_cost_within_time")
  with pytest.raises(PlanError, match="does not use it"):
    planner.SolveOptions(objective="max_throughput_per_dollar", budget_per_hour=3.0)
  with pytest.raises(PlanError, match="objective"):
    planner.SolveOptions(objective="fastest")
  with pytest.raises(PlanError, match="finite number > 0"):
    planner.SolveOptions(budget_per_hour=-1.0)


def test_budget_below_every_plan_is_explained():
  rng = np.random.default_rng(8)
  while True:
    tables = oracle.random_tables(rng, priced=True)
    if math.isfinite(_value(tables, 8, "min_time")[0]):
      break
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tables, 8, budget_per_hour=1e-6)
  assert e.value.constraint == "budget" and "per hour" in str(e.value)
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tables, 8, objective="min_cost_within_time", time_limit_s=1e-6)
  assert e.value.constraint == "time"


@pytest.mark.parametrize("backend", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_money_objectives_on_parallel_backends_return_the_identical_plan(backend):
  """The objectives with prices evaluate their window in batches on any backend, with the
  same plan as sequentially (the simulator judging, and Eq. 12)."""
  from harpjax.cluster import Link
  from harpjax.compiler.profile import CostTables, SubclusterSpec, synthetic_gpt_profile
  GiB = 2.0 ** 30
  prof = synthetic_gpt_profile(num_blocks=6, hidden=4096, seq_len=1024, microbatch=4)
  a = SubclusterSpec("a100", 2, 4, 40 * GiB, 25e9, peak_flops=312e12, price_per_gpu_hour=3.0)
  v = SubclusterSpec("v100", 2, 4, 32 * GiB, 25e9, peak_flops=125e12, price_per_gpu_hour=1.0)
  tables = CostTables.from_layer_costs(prof, [v, a], Link(1.25e9), grad_sync_microbatches=64)
  for kw in (dict(objective="max_throughput_per_dollar"),
             dict(objective="min_time_within_budget", budget_per_hour=20.0),
             dict(objective="max_throughput_per_dollar", cost_model="eq12")):
    seq = planner.solve(tables, 64, backend="sequential", **kw)
    par = planner.solve(tables, 64, backend=backend, workers=2, parallel_min_work=0, **kw)
    assert par.stats.backend == backend and par.stats.num_window > 1
    assert par.plan.stages == seq.plan.stages and par.objective_s == seq.objective_s
    assert par.cost_per_iteration == seq.cost_per_iteration
