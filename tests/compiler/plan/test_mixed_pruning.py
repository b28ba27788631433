"""The mixed-stage search's bounds (``MixedOptions.prune``) change its speed, never its result:
the same plan, value and proof flag as every fusion searched fully, in the original order."""

import dataclasses

import numpy as np
import pytest

from tests.compiler.plan.test_mixed_fees import zoned_instance
from tests.compiler.plan.test_mixed_planner import random_mixed_tables
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import MixedOptions
from harpjax.errors import InfeasiblePlanError


def _solve(tables, B, mo, **kw):
  try:
    r = planner.solve(tables, B, backend="sequential", mixed_stages="on", mixed_options=mo,
                      schedule="h1f1b", **kw)
  except InfeasiblePlanError:
    return None
  return r.value, r.iteration_s, r.plan.stages, r.stats.proved


def _same_with_and_without(tables, B, mo, **kw):
  full = _solve(tables, B, dataclasses.replace(mo, prune=False), **kw)
  pruned = _solve(tables, B, dataclasses.replace(mo, prune=True), **kw)
  assert pruned == full
  return full


@pytest.mark.parametrize("seed", [0, 2, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_bounds_keep_the_result(seed):
  # proof_nodes=0: no search proves its optimum, so every fusion's search is bounded by the
  # best plan so far (and by the last of the pair candidates).
  rng = np.random.default_rng(1000 + seed)
  tables = random_mixed_tables(rng, K=3 if seed % 2 else None)
  B = int(rng.integers(2, 7))
  mo = MixedOptions(microbatch_rows=4, shares="all", max_hosts_per_group=2, pair_candidates=4)
  got = _same_with_and_without(tables, B, mo, proof_nodes=0)
  if got is not None:
    assert got[3] is not True
  _same_with_and_without(tables, B, mo)   # proved searches: searched fully, in order


@pytest.mark.parametrize("seed", range(4))
def test_bounds_keep_the_result_with_fees_and_money(seed):
  tables, B, mo = zoned_instance(seed)
  mo = dataclasses.replace(mo, pair_candidates=4)
  objective = ("min_time_within_budget", "max_throughput_per_dollar",
               "min_time_within_budget", "min_cost_within_time")[seed % 4]
  kw = dict(objective=objective, proof_nodes=0)
  full_rate = sum(p * tables.devices_per_host[k] * tables.num_hosts[k]
                  for k, p in enumerate(tables.price_per_gpu_hour))
  if objective == "min_time_within_budget":   # tight: some fusions' GPUs alone break it
    kw["budget_per_hour"] = (0.5 if seed else 1.5) * full_rate
  elif objective == "min_cost_within_time":
    kw["time_limit_s"] = 5.0
  _same_with_and_without(tables, B, mo, **kw)
