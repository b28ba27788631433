"""Sailor's planner (``tools/sailor.py``) against ours, on Sailor's profiles, by one simulator."""

import functools
import math

import numpy as np
import pytest

from harpjax.compiler.plan import SolveOptions, evaluate_plan, solve
from tools import sailor

US_A, US_B, WEST = "us-central1-a", "us-central1-b", "us-west1-b"

# Small clusters of Sailor's kinds (hosts of 4 GPUs): one type, two types, two regions, zones.
CLUSTERS = [
    [sailor.Pool("a100", "A100-40", US_A, 2)],
    [sailor.Pool("a100", "A100-40", US_A, 1), sailor.Pool("v100", "V100-16", US_A, 2)],
    [sailor.Pool("v100", "V100-16", US_A, 2), sailor.Pool("a100", "A100-40", US_A, 1)],
    [sailor.Pool("a100@c", "A100-40", US_A, 1), sailor.Pool("a100@w", "A100-40", WEST, 1)],
    [sailor.Pool("a100@a", "A100-40", US_A, 1), sailor.Pool("v100@b", "V100-16", US_B, 1)],
]


# GPT-Neo-2.7B needs a pipeline or tensor parallelism on these GPUs.
NEO_CLUSTERS = [
    [sailor.Pool("a100", "A100-40", US_A, 2)],
    [sailor.Pool("a100", "A100-40", US_A, 1), sailor.Pool("v100", "V100-16", US_A, 2)],
]

CASES = [("OPT-350", c) for c in range(len(CLUSTERS))] + \
    [("GPT-Neo-2.7", c) for c in range(len(NEO_CLUSTERS))]


@functools.lru_cache(maxsize=None)
def _model(name):
  return sailor.load_model(name)


@pytest.fixture(scope="module")
def model():
  return _model("OPT-350")


def test_tables_hold_sailors_numbers(model):
  pools = CLUSTERS[1]
  t = sailor.sailor_tables(model, pools, 8)
  assert t.subcluster_names == ("a100", "v100") and t.num_layers == 26
  assert t.price_per_gpu_hour == (4.05, 2.55)
  # One A100 (submesh (1, 1)) runs the 8 sequences as one replica at tp 1: the profile's
  # forward + backward of every layer at microbatch 8.
  prof = model.times["A100-40"][8][1]
  want = sum(prof[k, 0] + prof[k, 1] for k in model.kinds)
  s = t.submesh_index(0, (1, 1))
  assert t.stage_time_s[0][0, 25, s] == pytest.approx(want, rel=1e-12)
  assert t.logical_mesh_of(0, 0, 25, s) == (1, 1)
  # Memory: 24 bytes per parameter plus Sailor's overhead; activations of 8 sequences.
  params = sum(model.memory[1][k, 0] for k in model.kinds)
  assert t.param_mem_bytes[0][0, 25, s] == pytest.approx(params * 24 + 2e9)
  # Every entry's replicas get a whole number of sequences; one sequence cannot be split over
  # 8 V100s (tp is at most 4 on a host of 4), so that entry does not exist.
  s8 = t.submesh_index(1, (2, 4))
  dp, tp = t.logical_mesh_of(1, 3, 3, s8)
  assert dp * tp == 8 and 8 % dp == 0
  assert np.isinf(sailor.sailor_tables(model, pools, 1).stage_time_s[1][3, 3, s8])


def test_even_stages_put_the_extra_layers_last():
  assert sailor.even_stages(26, 4) == [(0, 5), (6, 11), (12, 18), (19, 25)]
  assert sailor.even_stages(26, 1) == [(0, 25)]


def test_single_stage_estimate_is_the_simulated_time(model):
  """For one stage Sailor's estimate N_b t + e is what the simulator gives under 1F1B."""
  sp = sailor.sailor_plan(model, CLUSTERS[0], max_stages=1)
  assert len(sp.stages) == 1 and sp.evaluation.feasible
  assert sp.iteration_s == pytest.approx(sp.estimate_s, rel=1e-9)


@pytest.mark.parametrize("name,c", CASES)
def test_sailor_plans_are_valid_and_ours_is_never_slower(name, c):
  model = _model(name)
  pools = (CLUSTERS if name == "OPT-350" else NEO_CLUSTERS)[c]
  sp = sailor.sailor_plan(model, pools, max_stages=8)
  ev = sp.evaluation
  assert ev.feasible, ev.violations
  # The mapping: D replicas of each stage are its data-parallel dimension.
  assert sp.num_devices == sum(s.submesh[0] * s.submesh[1] for s in ev.stages)
  assert [s.logical_mesh for s in ev.stages] == [(sp.dp, tp) for *_, tp in sp.stages]
  assert sp.num_microbatches * sp.microbatch == model.global_batch
  # Ours at Sailor's own global microbatch, on the same tables, by the same simulator.
  tables = sailor.sailor_tables(model, pools, sp.microbatch)
  r = solve(tables, sp.num_microbatches)
  assert r.iteration_s <= sp.iteration_s * (1 + 1e-9), (r.iteration_s, sp.iteration_s)
  # Sailor's plan under our schedule, where its memory allows the extra warm-ups.
  if sp.h1f1b.feasible:
    assert r.iteration_s <= sp.h1f1b.iteration_s * (1 + 1e-9)
  again = evaluate_plan(tables, r.plan, sp.num_microbatches)
  assert again.feasible and again.iteration_s == r.iteration_s


@pytest.mark.parametrize("c", [1, 4])
def test_ours_is_never_costlier_per_iteration(model, c):
  pools = CLUSTERS[c]
  sp = sailor.sailor_plan(model, pools, objective="max_throughput_per_dollar", max_stages=6)
  assert sp.evaluation.feasible
  tables = sailor.sailor_tables(model, pools, sp.microbatch)
  r = solve(tables, sp.num_microbatches,
            options=SolveOptions(objective="max_throughput_per_dollar"))
  assert r.rate_per_hour * r.iteration_s <= sp.rate_per_hour * sp.iteration_s * (1 + 1e-9)


def test_budget_is_respected_by_both(model):
  pools = CLUSTERS[1]
  budget = 30.0   # USD per hour: at most 7 A100s, or some V100s
  sp = sailor.sailor_plan(model, pools, objective="min_time_within_budget",
                          budget_per_hour=budget, max_stages=6)
  assert sp.rate_per_hour <= budget and sp.evaluation.feasible
  tables = sailor.sailor_tables(model, pools, sp.microbatch)
  r = solve(tables, sp.num_microbatches,
            options=SolveOptions(objective="min_time_within_budget", budget_per_hour=budget))
  assert r.rate_per_hour <= budget
  assert r.iteration_s <= sp.iteration_s * (1 + 1e-9)
  assert math.isfinite(sp.estimate_s)


def test_cheapest_within_a_time(model):
  """§5.2.4 scenario 1: both keep to the time limit by their own model; where Sailor's plan
  keeps to it by the simulator too, ours costs no more per iteration."""
  pools = CLUSTERS[4]
  limit = 60.0
  sp = sailor.sailor_plan(model, pools, objective="min_cost_within_time", time_limit_s=limit,
                          max_stages=6)
  assert sp.evaluation.feasible and sp.estimate_s <= limit
  tables = sailor.sailor_tables(model, pools, sp.microbatch)
  r = solve(tables, sp.num_microbatches,
            options=SolveOptions(objective="min_cost_within_time", time_limit_s=limit))
  assert r.iteration_s <= limit
  if sp.iteration_s <= limit:
    assert r.rate_per_hour * r.iteration_s <= sp.rate_per_hour * sp.iteration_s * (1 + 1e-9)
