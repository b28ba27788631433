"""The planner's per-stage ZeRO level and optimizer-state offload: the optimum equals brute
force over every (submesh, level, offload) variant, it is never worse than without the new
freedom and strictly better where memory binds, and the simulator's time stays the plan's
predicted time, exactly."""

import math

import numpy as np
import pytest

from harpjax.cluster import Link
from harpjax.compiler.plan import evaluate_plan, Plan, solve, StageSpec, variants
from harpjax.compiler.profile import (CostTables, offload_time_s, SubclusterSpec,
                                     synthetic_gpt_profile, zero_state_bytes_per_param)
from harpjax.errors import CostTablesError, InfeasiblePlanError, PlanError
from tests.compiler.plan import oracle

GiB = 2.0 ** 30
OFF = dict(zero_levels=(0,), offload=False)


def _obj(tables, B, **kw):
  try:
    return solve(tables, B, backend="sequential", **kw)
  except InfeasiblePlanError:
    return None


def _value(res):
  return math.inf if res is None else res.objective_s


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


def _chunks(ci, slow):
  return [*range(ci), *(pytest.param(c, marks=pytest.mark.slow) for c in range(ci, ci + slow))]


@pytest.mark.parametrize("chunk", _chunks(2, 2))
def test_optimum_with_zero_and_offload_matches_brute_force(chunk):
  """25 random memory-tight instances per chunk (100 in all): the planner's optimum equals
  brute force over every variant, is proved, is never worse than at level 0 alone (itself
  brute force's optimum without the variants) and often strictly better; the plan's
  predicted time is the simulator's on the caller's tables."""
  rng = np.random.default_rng(4000 + chunk)
  better = 0
  for _ in range(25):
    tables = oracle.random_zero_tables(rng, num_layers=int(rng.integers(2, 5)),
                                       num_subclusters=int(rng.integers(1, 3)))
    B = int(rng.choice([1, 2, 4, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    bf = oracle.brute_force(oracle.all_variants(tables), B, eps=eps)
    plain = oracle.brute_force(tables.replace(opt_mem_bytes=None, gather_time_s=None), B,
                               eps=eps)
    res = _obj(tables, B, eps=eps)
    without = _obj(tables, B, eps=eps, **OFF)
    assert _close(_value(res), bf.objective_s), (bf, res)
    assert _close(_value(without), plain.objective_s), (plain, without)
    assert _value(res) <= _value(without) * (1 + 1e-12)
    better += _value(res) < _value(without) * (1 - 1e-9)
    if res is None:
      continue
    assert res.stats.proved
    ev = evaluate_plan(tables, res.plan, B, eps=eps)
    assert ev.iteration_s == res.plan.predicted_iteration_s == res.iteration_s
    assert ev.feasible, ev.violations
    for spec, st, evs in zip(res.plan.stages, res.stages, ev.stages):
      assert (spec.zero, spec.offload) == (st.zero, st.offload) == (evs.zero, evs.offload)
      assert tables.submeshes[st.subcluster][st.submesh_index] == st.submesh
      nums = oracle.variant_numbers(tables, st.subcluster, *st.layers, st.submesh_index,
                                    st.zero, st.offload)
      assert nums is not None
      got = (st.time_s, st.param_bytes, ev.end_s[res.stages.index(st)])
      assert all(_close(x, y) for x, y in zip(got, nums)), (got, nums)
  assert better >= 4, better


def test_pruned_variants_keep_the_brute_force_optimum_in_every_mode():
  """Resource modes, orders and money objectives see the same variants."""
  rng = np.random.default_rng(4100)
  modes = [dict(use_all_devices=True, keep_order=True), dict(keep_order=True),
           dict(use_all_devices=True)]
  for x in range(12):
    tables = oracle.random_zero_tables(rng, num_layers=int(rng.integers(2, 4)),
                                       num_subclusters=2)
    B = int(rng.choice([2, 8]))
    mode = modes[x % len(modes)]
    bf = oracle.brute_force(oracle.all_variants(tables), B, **mode)
    assert _close(_value(_obj(tables, B, **mode)), bf.objective_s), mode


def _gpt_tables(mem_gib, offload_bw=None, share=0.75, blocks=8, **kw):
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=2048, seq_len=1024, microbatch=8,
                               vocab=8192)
  specs = [SubclusterSpec("v100", 1, 4, mem_gib * GiB, 12.5e9, peak_flops=125e12,
                          host_bandwidth_bytes_per_s=150e9,
                          offload_bandwidth_bytes_per_s=offload_bw),
           SubclusterSpec("t4", 1, 2, mem_gib * GiB, 12.5e9, peak_flops=65e12,
                          host_bandwidth_bytes_per_s=32e9,
                          offload_bandwidth_bytes_per_s=offload_bw)]
  return CostTables.from_layer_costs(prof, specs, Link.from_gbps(10), max_tp=1,
                                     end_cost=True, optimizer_share=share, **kw)


def test_a_model_that_fits_only_with_zero_or_offload():
  """Memory-tight GPT: no plan at level 0; ZeRO finds one; with offload a smaller device
  still fits; each plan simulates what it predicts and carries its choices in the stages."""
  tables = _gpt_tables(1.4)
  with pytest.raises(InfeasiblePlanError):
    solve(tables, 8, **OFF)
  res = solve(tables, 8, offload=False)
  assert any(s.zero for s in res.plan.stages)
  assert evaluate_plan(tables, res.plan, 8).iteration_s == res.plan.predicted_iteration_s
  assert "ZeRO-" in res.plan.table()
  back = Plan.from_json(res.plan.to_json())
  assert [s.zero for s in back.stages] == [s.zero for s in res.plan.stages]
  small = _gpt_tables(1.2, offload_bw=12e9)
  with pytest.raises(InfeasiblePlanError):
    solve(small, 8, offload=False)
  res = solve(small, 8)
  assert any(s.offload for s in res.plan.stages)
  ev = evaluate_plan(small, res.plan, 8)
  assert ev.iteration_s == res.plan.predicted_iteration_s and ev.feasible
  back = Plan.from_json(res.plan.to_json())
  assert [s.offload for s in back.stages] == [s.offload for s in res.plan.stages]


def test_room_to_spare_plans_as_before():
  """Where level 0 holds every microbatch a stage can need, the variants of the same time per
  microbatch (levels 1, 2, offload) are all dropped; only level 3 (slower per microbatch) is
  kept, and the plan is the one without the variants, at level 0."""
  tables = _gpt_tables(40.0, offload_bw=12e9)
  plain = tables.replace(opt_mem_bytes=None, gather_time_s=None)
  expanded = variants.expand_variants(tables, variants.VariantOptions(), 8)
  assert {v for row in expanded.variants for v in row} == {(0, False), (3, False)}
  a, b = solve(tables, 8), solve(plain, 8)
  assert a.objective_s == b.objective_s and a.stats.proved
  assert not any(s.zero or s.offload for s in a.plan.stages)
  assert [s.layers for s in a.plan.stages] == [s.layers for s in b.plan.stages]


def test_variant_numbers_follow_the_memory_model():
  """A variant's state bytes are profile.zero's per-parameter bytes, its offload time
  profile.zero's, its end time the level's all-gather."""
  tables = _gpt_tables(16.0, offload_bw=12e9)
  k, i, j = 0, 1, 5
  s = tables.submesh_index(k, (1, 4))
  dp = tables.logical_mesh_of(k, i, j, s)[0]
  assert dp == 4
  P = tables.param_mem_bytes[k][i, j, s]
  n = P / 16.0
  g = tables.gather_time_s[k][i, j, s]
  assert g > 0
  for zero in range(4):
    for off in (False, True):
      t, p, e, ok = variants.variant_arrays(tables, k, zero, off)
      want = n * zero_state_bytes_per_param(2.0, 2.0, 12.0, dp, zero)
      O_z = n * 12.0 / (dp if zero else 1)
      if off:
        want -= O_z
      assert math.isclose(p[i, j, s], want, rel_tol=1e-12) and ok[i, j, s]
      e0 = tables.end_time_s[k][i, j, s]
      extra = (g if zero in (1, 2) else 0.0) + (offload_time_s(O_z, 12e9) if off else 0.0)
      assert math.isclose(e[i, j, s], e0 + extra, rel_tol=1e-12)
      t0 = tables.stage_time_s[k][i, j, s]
      assert t[i, j, s] == (t0 + 2 * g if zero == 3 else t0)


def test_tables_fields_and_options():
  tables = _gpt_tables(16.0, offload_bw=12e9)
  assert tables.opt_mem_bytes is not None and tables.offload_bandwidth_bytes_per_s
  coarse = tables.coarsen([3, 10, tables.num_layers - 1])
  assert coarse.opt_mem_bytes[0].shape[:2] == (3, 3)
  assert coarse.opt_mem_bytes[0][1, 1, 0] == tables.opt_mem_bytes[0][4, 10, 0]
  with pytest.raises(CostTablesError, match="optimizer_share"):
    _gpt_tables(16.0, share=1.5)
  with pytest.raises(CostTablesError, match="opt_mem_bytes"):
    tables.replace(opt_mem_bytes=tuple(p * 2 + 1 for p in tables.param_mem_bytes))
  with pytest.raises(CostTablesError, match="repeat"):
    tables.replace(submeshes=tuple(s + s[:1] for s in tables.submeshes))
  with pytest.raises(PlanError, match="zero_levels"):
    solve(tables, 8, zero_levels=(4,))
  with pytest.raises(PlanError, match="offload"):
    StageSpec((0, 1), "v100", (1, 4), offload="yes")
  # A plan asking for a level the tables cannot price says what to change.
  plain = tables.replace(opt_mem_bytes=None, gather_time_s=None)
  spec = StageSpec((0, tables.num_layers - 1), "v100", (1, 4), zero=2)
  with pytest.raises(PlanError, match="opt_mem_bytes"):
    evaluate_plan(plain, [spec], 8)
  ev = evaluate_plan(tables, [spec], 8)
  assert ev.stages[0].zero == 2 and ev.stages[0].submesh == (1, 4)


def test_money_objectives_and_the_numpy_twin_see_the_variants():
  """Throughput per dollar, a budget and a time limit rank plans with variants exactly as
  brute force does; the NumPy twin of the DP finds the same optimum."""
  rng = np.random.default_rng(4200)
  for x in range(8):
    tables = oracle.random_zero_tables(rng, num_layers=int(rng.integers(2, 4)),
                                       num_subclusters=2, priced=True)
    B = int(rng.choice([2, 8]))
    full = oracle.all_variants(tables)
    for kw, bf_kw in ((dict(objective="max_throughput_per_dollar"), dict(objective="min_cost")),
                      (dict(budget_per_hour=4.0), dict(budget_per_hour=4.0)),
                      (dict(objective="min_cost_within_time", time_limit_s=20.0),
                       dict(objective="min_cost", time_limit_s=20.0))):
      bf = oracle.brute_force(full, B, **bf_kw)
      res = _obj(tables, B, **kw)
      got = math.inf if res is None else (
          res.objective_s if "objective" not in kw else res.rate_per_hour * res.objective_s)
      assert _close(got, bf.objective_s), (kw, got, bf)
    bf = oracle.brute_force(full, B)
    assert _close(_value(_obj(tables, B, kernel="numpy")), bf.objective_s)
