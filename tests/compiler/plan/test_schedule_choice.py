"""The planner's schedule: on the stages the search finds, the fastest of 1F1B, Eager-1F1B and
H-1F1B whose microbatches in flight fit memory, by the simulator; or the one pinned."""

import math

import numpy as np
import pytest

from harpjax.compiler import plan as planner
from harpjax.compiler import schedule as sched
from harpjax.compiler.profile import CostTables
from harpjax.errors import InfeasiblePlanError, PlanError
from tests.compiler.plan import oracle


def _solve(tables, B, **kw):
  try:
    return planner.solve(tables, B, backend="sequential", **kw)
  except InfeasiblePlanError:
    return None


def _check_choice(tables, B, **kw):
  """Ranked against H-1F1B alone on the same instance; returns (ranked, H-1F1B) results."""
  res = _solve(tables, B, **kw)
  base = _solve(tables, B, schedule="h1f1b", **kw)
  assert (res is None) == (base is None)
  if res is None:
    return None, None
  # The search is the same: the same stages; only the schedule (and its warm-ups) differ.
  strip = lambda p: [(s.layers, s.subcluster, s.submesh, s.logical_mesh, s.zero, s.offload,
                      s.offload_activations) for s in p.stages]
  assert strip(res.plan) == strip(base.plan)
  assert base.plan.schedule == "h1f1b"
  # Never slower than H-1F1B alone, and the minimum over the ranked schedules that fit.
  assert res.iteration_s <= base.iteration_s
  score = planner.plan_scorer(tables, B, 0.1, 1.0 / 3.0)
  scores = {s.schedule: s for s in planner.schedule_scores(base.plan, score)}
  assert set(scores) == {"1f1b", "eager_1f1b", "h1f1b"}
  assert scores["h1f1b"].iteration_s == base.iteration_s and scores["h1f1b"].fits
  fit = {n: s.iteration_s for n, s in scores.items() if s.fits}
  assert res.iteration_s == min(fit.values())
  assert fit[res.plan.schedule] == res.iteration_s
  if res.plan.schedule != "h1f1b":
    assert res.iteration_s < base.iteration_s   # ties keep the search's H-1F1B
  # The plan as the runtime reads it: its schedule's warm-ups, time and memory.
  ev = planner.evaluate_plan(tables, res.plan, B)
  assert ev.schedule == res.plan.schedule and ev.mem_ok
  assert ev.iteration_s == res.iteration_s == res.plan.predicted_iteration_s == res.objective_s
  assert res.warmups == res.plan.warmups == ev.warmups
  assert [s.warmup for s in res.stages] == list(ev.warmups)
  assert all(s.peak_mem_bytes <= s.device_memory_bytes for s in res.stages)
  return res, base


def test_the_chosen_schedule_is_the_fastest_that_fits_on_random_instances():
  rng = np.random.default_rng(2024)
  chosen = {"1f1b": 0, "eager_1f1b": 0, "h1f1b": 0}
  blocked = 0   # a faster schedule ruled out by memory
  for x in range(80):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([2, 4, 8, 16, 32]))
    res, base = _check_choice(tables, B)
    if res is None:
      continue
    chosen[res.plan.schedule] += 1
    for kind in sched.ranked_schedules():
      ev = planner.evaluate_plan(tables, base.plan, B, kind)
      blocked += not ev.mem_ok and ev.iteration_s < res.iteration_s
  assert chosen["eager_1f1b"] >= 1 and chosen["h1f1b"] >= 30, chosen
  assert blocked >= 1


def test_link_bound_instances_and_every_mode():
  """Slow links between subclusters (link-bound plans admitted), each planner mode, and the
  paper's cost model: the choice is still the fastest that fits."""
  rng = np.random.default_rng(77)
  modes = [dict(), dict(use_all_devices=True, keep_order=True), dict(cost_model="eq12")]
  eager = 0
  for x in range(24):
    tables = oracle.random_tables(rng)
    slow = float(rng.choice([0.05, 0.2]))
    matrix = tables.link_bandwidth_bytes_per_s
    tables = tables.replace(
        inter_bandwidth_bytes_per_s=tuple(b * slow for b in tables.inter_bandwidth_bytes_per_s),
        link_bandwidth_bytes_per_s=None if matrix is None else tuple(
            tuple(b * slow for b in row) for row in matrix))
    kw = modes[x % len(modes)]
    B = int(rng.choice([4, 8, 16]))
    if kw.get("cost_model") == "eq12":   # objective_s stays Eq. 12's; the rest as above
      res = _solve(tables, B, **kw)
      base = _solve(tables, B, schedule="h1f1b", **kw)
      if res is not None:
        assert res.objective_s == base.objective_s and res.iteration_s <= base.iteration_s
      continue
    res, _ = _check_choice(tables, B, **kw)
    eager += res is not None and res.plan.schedule == "eager_1f1b"
  assert eager >= 1


def _two_stage_tables(act_mem: float, device_mem: float, cut_s: float = 0.04) -> CostTables:
  """Two 1-device subclusters, two layers; each layer 1 s on either device, the pair 2 s; the
  cut 0.04 s, under H-1F1B's tolerance (2c/t_max = 0.08 <= eps = 0.1): H-1F1B runs 1F1B's
  warm-ups (2, 1) and leaves the cut exposed, Eager-1F1B's (3, 1) hide it."""
  L, one = 2, ((1, 1),)
  t = np.array([[1.0, 2.0], [np.inf, 1.0]])[:, :, None]
  p = np.full((L, L, 1), 1.0)
  a = np.full((L, L, 1), act_mem)
  return CostTables(num_layers=L, subcluster_names=("c0", "c1"), num_hosts=(1, 1),
                    devices_per_host=(1, 1), device_memory_bytes=(device_mem, device_mem),
                    submeshes=(one, one), stage_time_s=(t, t), param_mem_bytes=(p, p),
                    act_mem_bytes=(a, a), boundary_bytes=np.array([cut_s, 0.0]),
                    intra_bandwidth_bytes_per_s=(1.0, 1.0), intra_latency_s=(0.0, 0.0),
                    inter_bandwidth_bytes_per_s=(1.0,), inter_latency_s=(0.0,))


def test_a_schedule_whose_microbatches_do_not_fit_is_not_chosen():
  B = 8
  # Room for three microbatches' residuals: Eager-1F1B fits and is faster.
  roomy = _solve(_two_stage_tables(act_mem=1.0, device_mem=4.0), B)
  assert roomy.plan.num_stages == 2 and roomy.plan.schedule == "eager_1f1b"
  assert roomy.plan.warmups == (3, 1)
  base = _solve(_two_stage_tables(act_mem=1.0, device_mem=4.0), B, schedule="h1f1b")
  assert base.plan.warmups == (2, 1) and roomy.iteration_s < base.iteration_s
  # Room for two: the same stages, Eager-1F1B simulates faster but does not fit.
  tight = _two_stage_tables(act_mem=1.0, device_mem=3.5)
  res = _solve(tight, B)
  assert res.plan.num_stages == 2 and res.plan.schedule == "h1f1b"
  ev = planner.evaluate_plan(tight, res.plan, B, "eager_1f1b")
  assert not ev.mem_ok and ev.iteration_s < res.iteration_s
  assert "2 x 1.000 GiB" not in " ".join(ev.violations) and "3 x" in " ".join(ev.violations)
  # Pinned, it is refused with the stage and the memory.
  with pytest.raises(InfeasiblePlanError, match="eager_1f1b.*does not fit.*stage 0") as e:
    planner.solve(tight, B, schedule="Eager-1F1B")
  assert e.value.constraint == "memory"


def test_pinned_schedules_and_the_option():
  rng = np.random.default_rng(5)
  tables = next(t for t in (oracle.random_tables(rng) for _ in range(50))
                if _solve(t, 8) is not None)
  for name in ("1f1b", "eager_1f1b", "h1f1b", "gpipe"):
    res = _solve(tables, 8, schedule=name)
    if res is None:   # does not fit
      continue
    ev = planner.evaluate_plan(tables, res.plan, 8)
    assert res.plan.schedule == ev.schedule == name
    assert res.iteration_s == ev.iteration_s == res.plan.predicted_iteration_s
    assert res.plan.warmups == ev.warmups
  assert planner.SolveOptions(schedule="PipeDream-Flush").schedule == "1f1b"
  assert planner.SolveOptions().schedule == "rank"
  with pytest.raises(PlanError, match="SolveOptions.schedule='zero-bubble'.*rank"):
    planner.SolveOptions(schedule="zero-bubble")


def test_min_cost_within_time_refuses_a_pinned_schedule_over_the_limit():
  # A 0.3 s cut: H-1F1B's warm-ups (3, 1) hide it, 1F1B's (2, 1) do not.
  B = 8
  tables = _two_stage_tables(act_mem=1.0, device_mem=100.0, cut_s=0.3).replace(
      price_per_gpu_hour=(1.0, 1.0))
  fast = _solve(tables, B)
  slow = _solve(tables, B, schedule="1f1b")
  assert fast.plan.warmups == (3, 1) and slow.iteration_s > fast.iteration_s
  limit = 0.5 * (fast.iteration_s + slow.iteration_s)
  res = _solve(tables, B, objective="min_cost_within_time", time_limit_s=limit)
  assert res.iteration_s <= limit
  with pytest.raises(InfeasiblePlanError, match="'1f1b' takes .* time_limit_s") as e:
    planner.solve(tables, B, objective="min_cost_within_time", time_limit_s=limit,
                  schedule="1f1b")
  assert e.value.constraint == "time"
  assert math.isclose(res.cost_per_iteration, res.rate_per_hour * res.objective_s / 3600)
