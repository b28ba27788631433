"""ZeRO on the planner's side: memory per level, collectives and their seconds, tables."""

import numpy as np
import pytest

import harpjax
from harpjax.cluster import Link
from harpjax.compiler.profile import (ProfileOptions, profile_step, stage_memory,
                                      zero_collectives, zero_layer_costs,
                                      zero_state_bytes_per_param, zero_sync_time_s, zero_tables)
from harpjax.compiler.profile.collectives import allgather_time_s, allreduce_time_s
from harpjax.errors import HarpjaxError
from tests import zoo
from tests.equivalence import DEMO_CLUSTER


def test_stage_memory_splits_what_each_level_says():
  kw = dict(param_bytes=100.0, opt_bytes=200.0, act_bytes=10.0, dp=4, out_bytes=1.0)
  m0, m1, m2, m3 = (stage_memory(zero=z, **kw) for z in range(4))
  assert (m0.param_bytes, m0.grad_bytes, m0.opt_bytes) == (100, 100, 200)
  assert (m1.param_bytes, m1.grad_bytes, m1.opt_bytes) == (100, 100, 50)
  assert (m2.param_bytes, m2.grad_bytes, m2.opt_bytes) == (100, 25, 50)
  assert (m3.param_bytes, m3.grad_bytes, m3.opt_bytes) == (25, 25, 50)
  # The backward's gradient and its all-reduce (XLA:CPU: the whole gradient even at level 2);
  # with a reduce-scatter the reduction is dp times smaller; level 3 gathers the parameters.
  assert m0.bwd_workspace_bytes == m2.bwd_workspace_bytes == 200
  assert stage_memory(zero=2, reduce_scatter=True, **kw).bwd_workspace_bytes == 125
  assert m3.fwd_workspace_bytes == 101 and m0.fwd_workspace_bytes == 1
  # Pipeline: state + N residuals + the larger workspace; update: state + new params and state.
  assert m0.pipeline_bytes(3) == 400 + 30 + 200
  assert m0.update_bytes() == 400 + 300
  assert m1.update_bytes() == 250 + 150 + 25     # the updated part before it is gathered
  assert m0.peak_bytes(3) == 700 and m0.peak_bytes(10) == 400 + 100 + 200
  assert stage_memory(zero=3, dp=1, param_bytes=8, opt_bytes=8, act_bytes=0).param_bytes == 8
  # A parameter read here but owned (and updated) by another stage: held, not updated.
  shared = stage_memory(zero=0, shared_param_bytes=40.0, **kw)
  assert shared.pipeline_bytes(1) == m0.pipeline_bytes(1)
  assert shared.update_bytes() == m0.update_bytes() - 3 * 40
  with pytest.raises(HarpjaxError, match="zero"):
    stage_memory(zero=4, **kw)


def test_state_bytes_and_collectives_per_level():
  assert zero_state_bytes_per_param(2, 2, 12, 8, 0) == 16
  assert zero_state_bytes_per_param(2, 2, 12, 8, 1) == 4 + 12 / 8
  assert zero_state_bytes_per_param(2, 2, 12, 8, 2) == 2 + 14 / 8
  assert zero_state_bytes_per_param(2, 2, 12, 8, 3) == 16 / 8
  # levels 0 and 1 reduce once per step (the replicas accumulate their own gradients)
  assert zero_collectives(100, 4, 0) == ({}, {"all-reduce": [100, 1]})
  assert zero_collectives(100, 4, 1) == ({}, {"all-reduce": [100, 1],
                                              "all-gather": [100, 1]})
  assert zero_collectives(100, 4, 2) == ({"reduce-scatter": [25, 1]}, {"all-gather": [100, 1]})
  assert zero_collectives(100, 4, 3) == ({"reduce-scatter": [25, 1], "all-gather": [200, 2]},
                                         {})
  assert zero_collectives(100, 1, 3) == ({}, {})
  link = Link(1e9, 1e-5)
  t = {z: zero_sync_time_s(1e8, 4, z, link, num_microbatches=8) for z in range(4)}
  assert t[0] == pytest.approx(allreduce_time_s(1e8, 4, link) / 8)   # once in 8 microbatches
  assert t[1] > t[0]                     # the gather of the updated parameters on top
  # level 2: a reduce-scatter (half an all-reduce's bytes) every microbatch, a gather per step
  assert t[2] == pytest.approx(allgather_time_s(1e8, 4, link) * (1 + 1 / 8))
  assert t[3] > t[2]                     # two gathers of the parameters per microbatch


@pytest.fixture(scope="module")
def profiled():
  import jax
  with jax.enable_x64(True):
    case = zoo.linen("loop")
    cluster = harpjax.Cluster.load(DEMO_CLUSTER)
    result = profile_step(case.step, (case.state, case.batches[0]), cluster,
                          num_microbatches=4, options=ProfileOptions(use_cache=False,
                                                                     progress=False))
  return result, cluster


def test_zero_tables(profiled):
  result, cluster = profiled
  same = zero_tables(result, cluster, 0, num_microbatches=4)
  for a, b in zip(same.param_mem_bytes + same.stage_time_s,
                  result.tables.param_mem_bytes + result.tables.stage_time_s):
    np.testing.assert_array_equal(a, b)
  link = Link(1e10, 2e-6)
  for (_, _, (dp, tp)), arr in result.costs.items():
    levels = [zero_layer_costs(arr, dp, z, link, num_microbatches=4) for z in range(4)]
    mem = [x["param_mem_bytes"] for x in levels]
    if dp == 1:
      assert all(np.array_equal(m, arr["param_mem_bytes"]) for m in mem)
      continue
    assert np.all(mem[0] >= mem[1]) and np.all(mem[1] >= mem[2]) and np.all(mem[2] >= mem[3])
    np.testing.assert_allclose(mem[3], arr["param_mem_bytes"] / dp)
    assert np.all(levels[3]["temp_bytes"] >= arr["temp_bytes"])
    ok = np.isfinite(arr["time_s"])
    # level 0 all-reduces once per step (the tables' end time, from grad_bytes); level 2
    # reduce-scatters every microbatch instead
    assert np.all(levels[2]["time_s"][ok] > arr["time_s"][ok])
    assert not levels[2]["grad_bytes"].any() and levels[1]["grad_bytes"].all()
  for z in (1, 2, 3):
    t = zero_tables(result, cluster, z, num_microbatches=4)
    assert sum(float(np.sum(a)) for a in t.param_mem_bytes) < \
        sum(float(np.sum(a)) for a in result.tables.param_mem_bytes)


def test_offload_time_and_memory():
  from harpjax.compiler.profile import offload_time_s
  assert offload_time_s(25e9, 25e9) == pytest.approx(2.0)
  assert offload_time_s(0, 25e9) == 0.0
  assert offload_time_s(1e9, 1e9, latency_s=1e-3) == pytest.approx(2.002)
  with pytest.raises(HarpjaxError, match="bandwidth"):
    offload_time_s(1.0, 0.0)
  kw = dict(param_bytes=100.0, opt_bytes=200.0, act_bytes=10.0, dp=2, zero=1)
  off, on = stage_memory(offload_optimizer=True, **kw), stage_memory(**kw)
  assert off.pipeline_bytes(2) == on.pipeline_bytes(2) - 100
  assert off.update_bytes() == on.update_bytes()


def test_profiled_tables_carry_the_optimizer_state_for_the_planner(profiled):
  # ProfileOptions.optimizer_bytes_per_param: the profiler's tables carry each entry's
  # optimizer state (its share of the state, besides the workspace) and the weights'
  # all-gather over its dp replicas; on devices too small for level 0 the planner picks ZeRO.
  import jax
  from harpjax.compiler.plan import evaluate_plan, solve
  from harpjax.compiler.profile import CostTables
  from harpjax.errors import InfeasiblePlanError
  _, cluster = profiled
  with jax.enable_x64(True):
    case = zoo.linen("loop")
    result = profile_step(case.step, (case.state, case.batches[0]), cluster,
                          num_microbatches=4,
                          options=ProfileOptions(use_cache=False, progress=False,
                                                 optimizer_bytes_per_param=12.0))
  t = result.tables
  assert isinstance(t, CostTables) and t.opt_mem_bytes is not None
  for k in range(t.num_subclusters):
    ok = np.isfinite(t.stage_time_s[k])
    assert np.all(t.opt_mem_bytes[k][ok] <= t.param_mem_bytes[k][ok])
    assert np.all(t.opt_mem_bytes[k][ok] > 0)
    dp = t.logical_mesh[k][..., 0]
    assert np.all((t.gather_time_s[k][ok] > 0) == (dp[ok] > 1))
  B = 4

  def smallest_memory(**kw):   # bisection on the device memory: the least that has a plan
    lo, hi = 1.0, float(max(t.device_memory_bytes))
    for _ in range(40):
      mid = (lo * hi) ** 0.5
      try:
        solve(t.replace(device_memory_bytes=(mid,) * t.num_subclusters), B, **kw)
        hi = mid
      except InfeasiblePlanError:
        lo = mid
    return hi

  m0, mz = smallest_memory(zero_levels=(0,), offload=False), smallest_memory()
  assert mz < 0.9 * m0, (mz, m0)      # ZeRO lets devices with less memory train the model
  tight = t.replace(device_memory_bytes=(mz,) * t.num_subclusters)
  res = solve(tight, B)
  assert any(s.zero for s in res.plan.stages)
  assert evaluate_plan(tight, res.plan, B).iteration_s == res.plan.predicted_iteration_s
  with pytest.raises(HarpjaxError, match="optimizer_bytes_per_param"):
    ProfileOptions(optimizer_bytes_per_param=16.0)
