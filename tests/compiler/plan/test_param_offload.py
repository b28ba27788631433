"""Parameter offload on interleaved device groups, priced by ``evaluate_plan``: a group holds
at most two of its offloaded stages' parameters, and the prefetch shows only where it takes
longer than the tasks it overlaps."""

import dataclasses

import pytest

from harpjax.cluster import GPU_CATALOG, Link
from harpjax.compiler.plan import Plan, StageSpec, evaluate_plan
from harpjax.compiler.profile import CostTables, SubclusterSpec, synthetic_gpt_profile
from harpjax.errors import PlanError

GBPS = 1e9 / 8


def _tables(offload_bw):
  prof = synthetic_gpt_profile(num_blocks=6, hidden=1024, seq_len=512, microbatch=2,
                               vocab=8192)
  g = GPU_CATALOG["V100-16G"]
  spec = SubclusterSpec("v100", 1, 8, g.memory_bytes, 25 * GBPS, peak_flops=g.peak_flops,
                        efficiency=0.5, host_bandwidth_bytes_per_s=g.intra_host_bytes_per_s,
                        host_latency_s=2e-6, mem_bandwidth_bytes_per_s=g.mem_bandwidth_bytes_per_s,
                        offload_bandwidth_bytes_per_s=offload_bw)
  fine = CostTables.from_layer_costs(prof, [spec], Link(25 * GBPS, 1e-4), max_tp=1,
                                     end_cost=True, optimizer_share=0.75)
  return fine.coarsen([3 * (b + 1) for b in range(5)] + [fine.num_layers - 1])


def _plan(off, d=2, v=3, L=6):
  S = d * v
  cuts = [round(k * L / S) for k in range(S + 1)]
  return Plan(stages=tuple(StageSpec(layers=(cuts[i], cuts[i + 1] - 1), subcluster="v100",
                                     submesh=(1, 4), offload_params=off) for i in range(S)),
              num_microbatches=4, schedule="interleaved_v3")


def test_parameter_offload_holds_two_stages_parameters():
  T = _tables(12e9)
  plain, held = evaluate_plan(T, _plan(False), 4), evaluate_plan(T, _plan(True), 4)
  for g in range(2):
    saved = plain.stages[g].peak_mem_bytes - held.stages[g].peak_mem_bytes
    # Three equal stages per group: one stage's parameters fewer on the devices (or more,
    # where the update, which holds none of the others' parameters, was the peak).
    assert saved > 0
  assert held.stages[0].offload_params and not plain.stages[0].offload_params
  assert held.iteration_s >= plain.iteration_s


def test_prefetch_hidden_by_a_fast_link_and_exposed_by_a_slow_one():
  fast, slow = _tables(1e15), _tables(1e8)
  plain = evaluate_plan(fast, _plan(False), 4).iteration_s
  assert evaluate_plan(fast, _plan(True), 4).iteration_s == pytest.approx(plain, rel=1e-4)
  assert evaluate_plan(slow, _plan(True), 4).iteration_s > 1.5 * evaluate_plan(
      slow, _plan(False), 4).iteration_s


def test_parameter_offload_needs_device_groups():
  T = _tables(12e9)
  p = _plan(True)
  with pytest.raises(PlanError, match="offload_params"):
    evaluate_plan(T, p, 4, schedule="1f1b")
