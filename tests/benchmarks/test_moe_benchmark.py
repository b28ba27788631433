"""``benchmarks/moe.py``'s (d) and pipeline + zebra, on one ``--quick``-sized setting (6 A40 +
6 V100, Mixtral-W1, 4K): the pipeline's tables are the EP column's model, the planner's plan
is no slower than the one-type baselines, and the pipeline estimate is Eq. 12 where it should
be and above the zebra simulator where that can check it."""

import importlib.util
import math
import os
import sys

import pytest

from harpjax.compiler.plan import evaluate_plan
from harpjax.compiler.schedule import simulate_zebra

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SEQ = 4096


@pytest.fixture(scope="module")
def moe():
  spec = importlib.util.spec_from_file_location(
      "moe_bench", os.path.join(ROOT, "benchmarks", "moe.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod                     # its dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def case(moe):
  s, m = moe.SETUPS["O1"], moe.MODELS["Mixtral-W1"]
  return moe, s, m, 4 * (s.num_new + s.num_old)


def test_tables_are_the_ep_columns_model(case):
  moe, s, m, batch = case
  mb = 12                                          # B = 4
  tables = moe.pipeline_tables(m, s, SEQ, mb)
  link = moe.link_of(s)
  for k, (gpu, count) in enumerate(((s.new, s.num_new), (s.old, s.num_old))):
    t = tables.stage_time_s[k]
    assert tables.submeshes[k] == tuple((1, p) for p in range(1, count + 1))
    # Every block of one microbatch on all `count` GPUs of the type: the EP column on them.
    whole = moe.ep_iteration_s(m, SEQ, [(gpu, count)], mb / count, link)
    assert t[0, m.layers - 1, count - 1] == pytest.approx(whole, rel=1e-12)
    assert t[1, 2, count - 1] == pytest.approx(2 * whole / m.layers, rel=1e-12)
    assert tuple(tables.logical_mesh[k][0, 0, count - 1]) == (1, 1, count)
    # 5 GPUs divide neither the 12 experts nor the 12 sequences: no such stage.
    assert math.isinf(t[0, 0, 4])
  assert tables.boundary_bytes[0] == mb * SEQ * m.hidden * moe.DTYPE_BYTES


def test_pipeline_no_slower_than_one_type_alone_and_estimate_is_eq12(case):
  moe, s, m, batch = case
  t, B, r = moe.best_pipeline(m, s, SEQ, batch)
  assert r.iteration_s == t and batch % B == 0
  tables = moe.pipeline_tables(m, s, SEQ, batch // B)
  assert evaluate_plan(tables, r.plan, B).iteration_s == pytest.approx(t, rel=1e-9)
  link = moe.link_of(s)
  for gpu, count in ((s.new, s.num_new), (s.old, s.num_old)):
    # One type alone, EP over all of it, the whole batch at once: a plan solve could give.
    alone = moe.ep_iteration_s(m, SEQ, [(gpu, count)], batch / count, link)
    assert t <= alone * (1 + 1e-9)
  # The pipeline estimate of the plan's own stages is the planner's Eq. 12.
  stages = [moe.ep_stage_estimate(m, s, SEQ, batch // B, st.subcluster, st.submesh[1],
                                  st.layers[1] - st.layers[0] + 1) for st in r.plan.stages]
  cut = link.latency_s + batch // B * SEQ * m.hidden * moe.DTYPE_BYTES / link.bandwidth_bytes_per_s
  assert moe.pipeline_estimate_s(stages, cut, B) == pytest.approx(r.eq12_s, rel=1e-9)


def test_zebra_estimate_bounds_the_zebra_simulator(case):
  moe, s, m, batch = case
  for R in (1, 2, 4):
    sim = simulate_zebra(moe.zebra_problem(m, s, SEQ, batch, R).costs([0] * m.layers))
    e = moe.zebra_stage_estimate(m, s, SEQ, batch // R, s.num_new, s.num_old, m.layers)
    est = moe.pipeline_estimate_s([e], 0.0, R)
    # One microbatch: the chain, exactly; more: latency + (R - 1) periods, never below.
    assert est >= sim.iteration_time * (1 - 1e-12)
    if R == 1:
      assert est == pytest.approx(sim.iteration_time, rel=1e-12)
    assert est >= R * e.period_s


def test_pipeline_zebra_search_covers_its_family(case):
  moe, s, m, batch = case
  t, B, (first, second) = moe.best_pipeline_zebra(m, s, SEQ, batch)
  assert first.what.startswith("Z(")
  # Two equal zebra halves at the same B are in the family: the best is no slower.
  half = moe.zebra_stage_estimate(m, s, SEQ, batch // 16, 3, 3, m.layers // 2)
  link = moe.link_of(s)
  cut = link.latency_s + batch // 16 * SEQ * m.hidden * moe.DTYPE_BYTES / link.bandwidth_bytes_per_s
  assert t <= moe.pipeline_estimate_s([half, half], cut, 16) * (1 + 1e-12)


@pytest.mark.slow
def test_quick_run_prints_the_d_columns(moe, capsys):
  moe.main(["--quick"])
  out = capsys.readouterr().out
  assert "| (d) Pipeline | vs EP |" in out and "vs (d) |" in out
  assert "Zebra+Asym-EA over (d) Pipeline" in out and "P+Z est." in out


def test_planner_tables_split_each_block_and_keep_the_pipelines_costs(case):
  moe, s, m, batch = case
  mb = 12
  plain = moe.pipeline_tables(m, s, SEQ, mb)
  tables = moe.planner_tables(m, s, SEQ, mb)
  split = tables.routed_split
  assert tables.microbatch_rows == mb and split.num_experts == (m.experts,) * m.layers
  for k, (gpu, count) in enumerate(((s.new, s.num_new), (s.old, s.num_old))):
    assert tables.submeshes[k] == tuple((p, 1) for p in range(1, count + 1))
    assert (tables.stage_time_s[k] == plain.stage_time_s[k]).all()
    for c, (p, _) in enumerate(tables.submeshes[k]):
      t = tables.stage_time_s[k][0, 0, c]
      if math.isfinite(t):   # the rest of the entry is the EP column's attention side
        assert t - split.expert_time_s[k][0, c] == pytest.approx(
            moe.attn_s(m, SEQ, mb / p, gpu), rel=1e-9)


def test_the_planners_zebra_stage_is_scored_as_searched(case):
  # B = 4: one zebra stage on all 12 GPUs is a candidate; the planner's plan at this B is no
  # slower than (d)'s at this B, and evaluate_mixed gives its time back
  from harpjax.compiler.plan import (MixedOptions, SolveOptions, evaluate_mixed, solve,
                                     ZebraOptions)
  moe, s, m, batch = case
  B = 4
  zo = ZebraOptions(assignment_limit=0, max_hosts_per_group=8,
                    fixed_fraction=moe.fixed_share(m, s, SEQ, batch // B))
  mo = MixedOptions(zebra="on", min_link_ratio=math.inf, pair_candidates=0,
                    zebra_options=zo)
  tables = moe.planner_tables(m, s, SEQ, batch // B)
  r = solve(tables, B, options=SolveOptions(mixed_stages="auto", backend="sequential",
                                            mixed_options=mo))
  d = solve(moe.pipeline_tables(m, s, SEQ, batch // B), B,
            options=SolveOptions(mixed_stages="off", backend="sequential"))
  assert r.iteration_s <= d.iteration_s * (1 + 1e-12)
  assert evaluate_mixed(tables, r.plan, B, mo).iteration_s == r.iteration_s
