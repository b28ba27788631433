"""What the tables charge a stage against XLA's own account of the executables the runtime
compiles for it: FLOPs (``cost_analysis``) of the forward and the backward, with the
backward's recomputation where the stage rematerialises."""

from __future__ import annotations

import numpy as np
import pytest

import harpjax
from harpjax.compiler.profile import ProfileOptions
from harpjax.compiler.stages import compile_stage
from harpjax.models import GPTConfig
from benchmarks.lm_step import lm_train_step
from tests.equivalence import DEMO_CLUSTER

B = 2


def _gpt_step():
  return lm_train_step(GPTConfig(vocab_size=256, seq_len=32, hidden=128, num_heads=4,
                                 num_blocks=2, dtype="float32", param_dtype="float32"), 8)


@pytest.mark.parametrize("remat", [False, True])
def test_stage_flops_within_3_percent_of_xla(remat):
  step_fn, state, tokens = _gpt_step()
  step = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=B,
                               plan=harpjax.AutoPlan(profile=ProfileOptions(remat=remat,
                                                                            use_cache=False)))
  plan, prof = step.plan(state, tokens), step.profile(state, tokens)
  cs = step.compile(state, tokens)
  assert all(plan.remat_of(s) == ("full" if remat else "none") for s in plan.stages)
  for s, (spec, st) in enumerate(zip(plan.stages, cs.stages)):
    compiled = compile_stage(st)
    xla = sum(float(compiled[k].cost_analysis()["flops"]) for k in ("fwd", "bwd"))
    costs = prof.costs[(spec.subcluster, tuple(spec.submesh), tuple(spec.logical_mesh))]
    tables = float(np.sum(costs["flops"][spec.layers[0]:spec.layers[1] + 1]))
    assert abs(tables / xla - 1) <= 0.03, (s, spec.layers, tables, xla)


# --------------------------------------------------------------------------- memory

PLANNER_MEMORY_TOLERANCE = 0.10


@pytest.mark.parametrize("zero", [0, 3, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_planner_memory_against_xla_peak(zero):
  """The memory the planner checks a stage with (the tables' fixed bytes plus its in-flight
  microbatches' residuals, and the peak after the pipeline: the reduction and the optimizer
  update) against XLA's peak over every phase of the runtime's executables
  (:func:`~harpjax.compiler.stages.memory_report`), float32 Adam: 4 + 4 + 8 bytes per
  parameter."""
  from harpjax.compiler.plan import ManualPlan
  from harpjax.compiler.plan.variants import tables_for_stages, variant_slot
  from harpjax.compiler.profile import tables_for_plan
  from harpjax.compiler.stages import memory_report
  step_fn, state, tokens = _gpt_step()
  opts = ProfileOptions(use_cache=False, state_bytes_per_param=16.0,
                        optimizer_bytes_per_param=8.0)
  probe = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=harpjax.AutoPlan(profile=opts))
  prof = probe.profile(state, tokens)
  L = len(prof.layers)
  plan = ManualPlan([dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 4),
                          logical_mesh=(4, 1), zero=zero),
                     dict(layers=(L // 2, L - 1), subcluster="a100", submesh=(1, 2),
                          logical_mesh=(2, 1), zero=zero)])
  step = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan)
  cs = step.compile(state, tokens)
  tables = tables_for_plan(prof, cs.plan)
  expanded = tables_for_stages(tables, cs.plan)
  for s, spec in enumerate(cs.plan.stages):
    r = memory_report(cs, s)
    k = tables.subcluster_index(spec.subcluster)
    i, j = spec.layers
    v = variant_slot(expanded, k, spec.submesh, spec.zero)
    fixed = float(expanded.param_mem_bytes[k][i, j, v])
    act = float(expanded.act_mem_bytes[k][i, j, v])
    step_bytes = float(expanded.step_mem_bytes[k][i, j, v])
    planner = max(fixed + r.in_flight * act, step_bytes)
    assert abs(planner / r.xla_peak_bytes - 1) <= PLANNER_MEMORY_TOLERANCE, (
        s, zero, planner / 2**20, r.xla_peak_bytes / 2**20, r.phases)
