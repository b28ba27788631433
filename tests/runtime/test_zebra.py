"""Zebra stages on the local runtime (harpjax.compiler.stages.zebra): the order the parts are
issued in against Theorem 1's per-stream order, how a routed block is cut between the groups,
what the runtime refuses, and training in float64 against ``jax.jit`` (of the batch where every
example routes on its own, of each microbatch where routing couples them), one zebra stage
alone and one zebra stage in an H-1F1B pipeline, with and without experts moved onto the
attention group (asymmetric expert assignment), on Mixtral and the zoo's MoE models."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import jax
import numpy as np
import pytest

import harpjax
from harpjax.compiler.plan import Plan, StageSpec, ZebraGroup
from harpjax.compiler.schedule import ZebraCosts, ZebraTask, theorem1_order
from harpjax.compiler.stages import ZebraStageExecutables, check_zebra_runs
from harpjax.compiler.stages.zebra import issue_order
from harpjax.errors import PlanError, ZebraPlanOnlyError
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10


# --------------------------------------------------------------------------- the order


@pytest.mark.parametrize("L,R,moved", [(L, R, moved) for L, R in itertools.product(
    [1, 2, 3], [1, 2, 3]) for moved in {(False,) * L, tuple(k % 2 == 0 for k in range(L))}])
def test_issue_order_is_theorem1s_per_stream_and_dependency_valid(L, R, moved):
  # moved: the layers whose experts are partly on the attention group (X tasks)
  full = theorem1_order(ZebraCosts(L, R, 1.0, 1.0, 1.0, 1.0,
                                   offload_fwd_s=[float(m) for m in moved]))
  for direction in "FB":
    got = issue_order(L, R, direction, moved)
    assert len(got) == len(set(got)) == R * (2 * L + 1 + sum(moved))
    attn = [t for t in got if t.kind in "AX"]
    expert = [t for t in got if t.kind == "E"]
    assert attn == [t for t in full.attn if t.direction == direction]
    assert expert == [t for t in full.expert if t.direction == direction]
    seen = set()
    for t in got:   # every task after the ones feeding it
      k, j = t.layer, t.microbatch
      if t.kind in "EX":
        need = [ZebraTask("A", direction, k if direction == "F" else k + 1, j)]
      else:
        k = k - 1 if direction == "F" else k
        need = ([ZebraTask("E", direction, k, j)] + ([ZebraTask("X", direction, k, j)]
                                                     if moved[k] else [])
                if 0 <= k < L else [])
      assert all(n in seen for n in need), (t, need)
      seen.add(t)
  # the two groups on different zebra microbatches: the experts of microbatch 0 are issued
  # before the attention of the last microbatch of the same layer
  if R > 1:
    fwd = issue_order(L, R, "F")
    assert fwd.index(ZebraTask("E", "F", 0, 0)) < fwd.index(ZebraTask("A", "F", 1, R - 1))


# --------------------------------------------------------------------------- refusals


def _zebra_plan(**kw) -> Plan:
  z = dict(subcluster="v100", submesh=(1, 2), num_microbatches=2, routed_layers=(1,),
           offload=(0,))
  z.update(kw.pop("zebra", {}))
  return harpjax.ManualPlan([StageSpec((0, 2), "a100", (1, 2), zebra=ZebraGroup(**z), **kw)])


def test_what_the_runtime_does_not_run_is_refused_by_name():
  check_zebra_runs(_zebra_plan())   # the local runtime runs it
  with pytest.raises(ZebraPlanOnlyError, match="Ray runtime does not run zebra stages"):
    check_zebra_runs(_zebra_plan(), local=False)
  with pytest.raises(ZebraPlanOnlyError, match="stage 0 is a zebra stage with zero=1"):
    check_zebra_runs(_zebra_plan(zero=1))
  with pytest.raises(ZebraPlanOnlyError, match="offload=True"):
    check_zebra_runs(_zebra_plan(offload=True))
  check_zebra_runs(_zebra_plan(zebra=dict(offload=(1,))))   # asymmetric assignment runs
  with pytest.raises(ZebraPlanOnlyError, match="interleaved"):
    check_zebra_runs(harpjax.ManualPlan([
        StageSpec((0, 0), "a100", (1, 2)),
        StageSpec((1, 2), "a100", (1, 2), zebra=ZebraGroup("v100", (1, 2), 2, (1,), (0,)))
    ]).replace(schedule="interleaved"))
  check_zebra_runs(harpjax.ManualPlan([StageSpec((0, 2), "a100", (1, 2))]), local=False)


def test_the_expert_group_devices_round_trip_through_a_plan_file():
  z = ZebraGroup("v100", (1, 2), 2, (1,), (0,), devices=(2, 3))
  assert ZebraGroup.from_json(z.to_json()) == z
  assert "devices" not in dataclasses.replace(z, devices=None).to_json()
  with pytest.raises(PlanError, match="must be 2 distinct device indices"):
    ZebraGroup("v100", (1, 2), 2, (1,), (0,), devices=(2, 2))
  st = StageSpec((0, 2), "a100", (1, 2), devices=(4, 5), zebra=z)
  assert st.all_devices == (4, 5, 2, 3) and st.num_devices == 4


# --------------------------------------------------------------------------- training


def _run(case, plan, reference, num_microbatches, steps=2):
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER,
                                  num_microbatches=num_microbatches,
                                  plan=dataclasses.replace(plan, layer_source="auto"))
    s_par = s_ref = case.state
    worst = 0.0
    for batch in case.batches[:steps]:
      out, ref = pstep(s_par, batch), reference(s_ref, batch)
      worst = max(worst, max_rel_err(ref, out))
      s_par, s_ref = out[0], ref[0]
  return worst, pstep, [str(w.message) for w in seen]


def _zebra_stages(pstep, case):
  compiled = pstep.trace(case.state, case.batches[0]).plan().layout().compile()
  return {s: st for s, st in enumerate(compiled.stages) if isinstance(st, ZebraStageExecutables)}


@pytest.mark.parametrize("offload", [pytest.param(0, marks=pytest.mark.slow, id="experts"),
                                     pytest.param(1, id="experts+moved")])
def test_zoo_moe_zebra_stage_equals_jit_per_microbatch(x64, caplog, offload):
  # One routed layer (the zoo's top-2 MoE of 4 experts, capacity from the microbatch's
  # tokens: examples meet): attention side on 2 A100, experts on 2 V100 (with ``offload``:
  # one of each V100's two moved onto the A100s); R = 2 asked, R = 1 run, and said.
  case = zoo.moe_capacity(drops=True)
  plan = harpjax.ManualPlan([StageSpec((0, 0), "a100", (1, 2), (1, 2),
                                       zebra=ZebraGroup("v100", (1, 2), 2, (0,), (offload,)))])
  err, pstep, _ = _run(case, plan, zoo.per_microbatch_reference(case, 2), 2)
  assert err <= RTOL, err
  assert "runs R=1 zebra microbatch instead of 2" in caplog.text
  (st,) = _zebra_stages(pstep, case).values()
  z = st.zebra
  if offload:   # experts 0 and 2 (the first of each V100's) on the A100s
    assert [(p.kind, p.experts) for p in z.parts] == [("A", None), ("E", (1, 3)),
                                                      ("X", (0, 2)), ("A", None)]
    assert [str(t) for t in z.forward] == ["AF0.0", "EF0.0", "XF0.0", "AF1.0"]
    x = st.parts[2]
    assert {d.id for d in x.mesh.devices.flat} <= {4, 5, 6, 7}
    assert all(x.layout.avals[v].shape[0] == 2 for v in x.layout.param_ids)
    return
  assert z.num_microbatches == 1 and [p.kind for p in z.parts] == ["A", "E", "A"]
  # the experts' part holds the two expert matmuls and the GELU between them, on the V100s
  # (devices 0-3 of the demo cluster), the rest on the A100s (4-7)
  expert, attn = st.parts[1], (st.parts[0], st.parts[2])
  assert {d.id for d in expert.mesh.devices.flat} <= {0, 1, 2, 3}
  assert all({d.id for d in a.mesh.devices.flat} <= {4, 5, 6, 7} for a in attn)
  assert expert.layout.logical_mesh == (1, 1, 2)
  # what crosses: the dispatched tokens [experts, capacity, hidden] forward, the experts'
  # outputs back; the expert weights are read by the expert part only
  (tokens,) = expert.layout.act_ids
  (back,) = expert.layout.output_ids
  assert expert.layout.avals[tokens].shape[0] == 4 == expert.layout.avals[back].shape[0]
  w = [v for v in expert.layout.param_ids if len(expert.layout.avals[v].shape) == 3]
  assert len(w) == 2 and not set(w) & set(attn[0].layout.param_ids + attn[1].layout.param_ids)


@pytest.mark.parametrize("offload", [pytest.param(0, id="experts"),
                                     pytest.param(1, marks=pytest.mark.slow,
                                                  id="experts+moved")])
def test_the_expert_state_lives_on_the_expert_group(x64, offload):
  # The zoo's MoE (4 experts of [hidden, ffn] and [ffn, hidden]) trained with Adam: after a
  # step the expert weights and their Adam moments are on the V100s (devices 0-3), whole,
  # split over the expert group's ep axis; everything else on the A100s (4-7). The experts'
  # part reads the weights held there as they are (no copy per step); with one expert of
  # each V100 moved, only those two are copied to the A100s.
  case = zoo.moe_capacity(drops=True)
  plan = harpjax.ManualPlan([StageSpec((0, 0), "a100", (1, 2), (1, 2),
                                       zebra=ZebraGroup("v100", (1, 2), 1, (0,), (offload,)))])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=dataclasses.replace(plan, layer_source="auto"))
  state, _ = pstep(case.state, case.batches[0])
  (st,) = _zebra_stages(pstep, case).values()
  on_experts = {d.id for d in st.expert_mesh.devices.flat}
  on_attn = {d.id for d in st.mesh.devices.flat}
  assert on_experts <= {0, 1, 2, 3} and on_attn <= {4, 5, 6, 7}
  experts = [x for x in jax.tree_util.tree_leaves(state)
             if getattr(x, "ndim", 0) == 3 and x.shape[0] == 4]
  assert len(experts) == 6   # two weights, their two Adam moments each
  for x in experts:
    assert {d.id for d in x.sharding.device_set} == on_experts
    assert x.sharding.spec[0] == "ep"
  rest = [x for x in jax.tree_util.tree_leaves(state)
          if getattr(x, "ndim", 0) >= 1 and not any(x is e for e in experts)]
  assert rest and all({d.id for d in x.sharding.device_set} == on_attn for x in rest)
  lay = st.layout
  held = [v for v in lay.param_ids if v in st.zebra.expert_params]
  assert len(held) == 2
  params = tuple(jax.device_put(np.zeros(lay.avals[v].shape, lay.avals[v].dtype),
                                st.sharding(v)) for v in lay.param_ids)
  per_part = st._part_params(params)
  for part, ex, got in zip(st.zebra.parts, st.parts, per_part):
    for v, x in zip(ex.layout.param_ids, got):
      p = params[lay.param_ids.index(v)]
      if part.kind == "E" and not offload:
        assert x is p   # read where it lives
      if part.kind == "X":
        assert x.shape[0] == 2 and {d.id for d in x.sharding.device_set} == on_attn


@pytest.mark.parametrize("offload", [pytest.param(0, marks=pytest.mark.slow, id="experts"),
                                     pytest.param(1, id="experts+moved")])
def test_zebra_memory_report_per_group_against_xla_and_the_planners_model(x64, offload):
  # The zoo's MoE, R = 1 (examples meet), N = 1 in flight. Each group's phases come from
  # XLA's memory_analysis of the parts and updates the runtime compiles; the model beside
  # it is the planner's (zebra_group_bytes). Measured (float64, CPU): the expert group
  # within 0.1% (experts) and 7% (experts+moved: the kept experts' slices are counted whole
  # through the step); the attention group 26% and 17% under XLA's peak, its backward's
  # temporaries and input cotangents, which the model leaves out, being a quarter of this
  # tiny model's bytes.
  from harpjax.compiler.plan import ZebraStageCost, zebra_group_bytes
  from harpjax.compiler.stages.memory import memory_report
  case = zoo.moe_capacity(drops=True)
  plan = harpjax.ManualPlan([StageSpec((0, 0), "a100", (1, 2), (1, 2),
                                       zebra=ZebraGroup("v100", (1, 2), 1, (0,), (offload,)))])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=dataclasses.replace(plan, layer_source="auto"))
  cs = pstep.trace(case.state, case.batches[0]).plan().layout().compile()
  r = memory_report(cs, 0)
  st = cs.stages[0]
  assert r.in_flight == 1 and r.num_microbatches == 1
  # the expert weights (two of [4, ...], split over the expert group's ep = 2), their
  # accumulators and their Adam moments (x 2) on the expert group
  w = sum(st.layout.avals[v].size * 8 / 2 for v in st.zebra.expert_params)
  e, a = r.experts, r.attention
  assert e.param_bytes == w * (1.5 if offload else 1)   # + the kept experts' slices
  assert e.opt_bytes == 2 * w and e.grad_bytes == w * (0.5 if offload else 1)
  assert a.opt_bytes > 0 and a.opt_bytes < e.opt_bytes
  assert set(e.phases) == {"fwd E0", "bwd E0", "update0 experts"}
  assert {"fwd A0", "bwd A1", "update0 attention"} <= set(a.phases)
  for g in (a, e):
    assert g.xla_peak_bytes == max(g.phases.values())
    assert g.predicted_peak_bytes == zebra_group_bytes(
        g.state_bytes, g.act_bytes, r.in_flight, g.param_bytes + g.opt_bytes)
  assert abs(e.error) <= 0.10, e.error
  assert -0.30 <= a.error < 0, a.error
  # the planner checks the same model against each group's memory
  c = ZebraStageCost((0, 0), (0, 0), (1, 0), 1, (0,), (0,), 1.0, a.state_bytes, a.act_bytes,
                     e.state_bytes, e.act_bytes,
                     zebra_group_bytes(a.state_bytes, a.act_bytes, 2), 1e12, 0.0)
  assert c.max_inflight(4) == 2


def _mixtral(routing_group: str):
  from tests.models.test_moe_exactness import _mixtral, _small
  return _mixtral(_small(routing_group=routing_group, capacity_factor=1.0))


# Mixtral, 2 blocks: embed 0 · block_0 1-3 · block_1 4-6 · head 7; layers 3 and 6 hold the
# experts (the routed modules' third layers).
ONE_STAGE = harpjax.ManualPlan([StageSpec((0, 7), "a100", (1, 2), (1, 2),
                                          zebra=ZebraGroup("v100", (1, 4), 2, (3, 6), (0, 0)))])
PIPELINE = harpjax.ManualPlan([StageSpec((0, 3), "v100", (1, 2), (2, 1)),
                               StageSpec((4, 7), "a100", (1, 2), (1, 2),
                                         zebra=ZebraGroup("v100", (1, 2), 2, (6,), (0,)))])


@pytest.mark.slow
@pytest.mark.parametrize("plan", [ONE_STAGE, PIPELINE], ids=["zebra", "pipeline+zebra"])
def test_mixtral_routed_per_sequence_zebra_equals_jit(x64, plan):
  # Every sequence routes on its own: R = 2 zebra microbatches of one sequence each, equal to
  # jax.jit of the whole batch.
  case = _mixtral("sequence")
  err, pstep, seen = _run(case, plan, jax.jit(case.step), 4)
  assert err <= RTOL, err
  assert not [m for m in seen if "examples" in m], seen
  for st in _zebra_stages(pstep, case).values():
    assert st.zebra.num_microbatches == 2 and st.zebra.zebra_rows == 1
    assert [p.kind for p in st.zebra.parts] == ["A", "E"] * (len(st.zebra.parts) // 2) + ["A"]
    assert st.zebra.forward == issue_order(st.zebra.num_routed, 2, "F")


@pytest.mark.slow
@pytest.mark.parametrize("plan", [ONE_STAGE, PIPELINE], ids=["zebra", "pipeline+zebra"])
def test_mixtral_routed_over_the_batch_zebra_equals_jit_per_microbatch(x64, plan):
  case = _mixtral("batch")
  err, _, seen = _run(case, plan, zoo.per_microbatch_reference(case, 4), 4)
  assert err <= RTOL, err
  assert any("cumsum" in m for m in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("routing_group,offload", [("sequence", (1, 0)), ("batch", (1, 2))])
def test_mixtral_zebra_with_experts_moved_onto_the_attention_group(x64, routing_group, offload):
  # Asymmetric expert assignment: of layer 3's 4 experts, one of each V100's two runs on the
  # A100s (X tasks beside the E tasks); with (1, 2) all of layer 6's do (its E part has none).
  case = _mixtral(routing_group)
  plan = harpjax.ManualPlan([StageSpec((0, 7), "a100", (1, 2), (1, 2), zebra=ZebraGroup(
      "v100", (1, 2), 2, (3, 6), offload))])
  ref = jax.jit(case.step) if routing_group == "sequence" else \
      zoo.per_microbatch_reference(case, 4)
  err, pstep, _ = _run(case, plan, ref, 4)
  assert err <= RTOL, err
  (st,) = _zebra_stages(pstep, case).values()
  moved = [p.experts for p in st.zebra.parts if p.kind == "X"]
  assert moved == ([(0, 2)] if offload == (1, 0) else [(0, 2), (0, 1, 2, 3)])


@pytest.mark.slow
def test_interleaved_moe_zebra_stage_in_a_pipeline_equals_jit(x64):
  # The zoo's moe-tiny shape (dense and MoE blocks alternating, top-1 per sequence, drops):
  # embed 0 · Dense 1-3 · MoE 4-6 · Dense 7-9 · MoE 10-12 · ln_f 13; the experts in 6 and 12.
  from tests.models.test_moe_exactness import _interleaved
  case = _interleaved(capacity_factor=0.5)
  plan = harpjax.ManualPlan([StageSpec((0, 4), "v100", (1, 2), (2, 1)),
                             StageSpec((5, 13), "a100", (1, 2), (1, 2),
                                       zebra=ZebraGroup("v100", (1, 2), 2, (6, 12), (0, 0)))])
  err, pstep, _ = _run(case, plan, jax.jit(case.step), 4)
  assert err <= RTOL, err
  (st,) = _zebra_stages(pstep, case).values()
  assert st.zebra.num_routed == 2 and st.zebra.num_microbatches == 2


ZEBRA_CLUSTER = """\
gpus:
  - {name: fastsmall, tflops: 200, memory_gb: 0.003, mem_bandwidth_gbs: 3000}
subclusters:
  - {name: new, gpu: fastsmall, hosts: 1, devices_per_host: 1}
  - {name: old, gpu: T4, hosts: 1, devices_per_host: 1}
links:
  - {between: [new, old], gbps: 100}
"""


@pytest.mark.slow
def test_the_planners_zebra_stage_runs_equal_to_jit(x64, tmp_path):
  # tests/test_cli.py's case in float64 (the small GPU's memory doubled with the bytes): the
  # planner puts attention on the small fast GPU and the experts on the T4; auto_parallel
  # runs the plan it chose.
  from harpjax.compiler.plan import MixedOptions, SolveOptions
  from harpjax.models import BUILTIN_MODELS
  (tmp_path / "zebra.yaml").write_text(ZEBRA_CLUSTER)
  spec = BUILTIN_MODELS["mixtral-tiny"](
      num_microbatches=4, microbatch_size=2, abstract=False, num_blocks=2, vocab_size=256,
      seq_len=16, hidden=32, num_heads=4, num_kv_heads=2, ffn_hidden=64, dtype="float64",
      param_dtype="float64", routing_group="sequence")
  auto = harpjax.AutoPlan(profile=harpjax.ProfileOptions(use_cache=False),
                          solve=SolveOptions(mixed_options=MixedOptions(zebra="on")))
  pstep = harpjax.auto_parallel(spec.step_fn, cluster=str(tmp_path / "zebra.yaml"),
                                num_microbatches=4, plan=auto)
  plan = pstep.trace(*spec.args).plan().plan
  assert [s.zebra is not None for s in plan.stages] == [True], plan.table()
  out = pstep(*spec.args)
  assert max_rel_err(jax.jit(spec.step_fn)(*spec.args), out) <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("plan,B", [
    # the stage's backward recomputes its forward (each part its own), experts moved too
    (harpjax.ManualPlan([StageSpec((0, 7), "a100", (1, 2), (1, 2), remat="full", zebra=ZebraGroup(
        "v100", (1, 2), 2, (3, 6), (1, 0)))]), 4),
    # a data-parallel attention group (zebra microbatches of 2 rows on dp = 2), the stage
    # starting at a routed layer, and 3 expert GPUs for 4 experts (data-parallel experts)
    (harpjax.ManualPlan([StageSpec((0, 2), "v100", (1, 1)),
                         StageSpec((3, 7), "a100", (1, 2), (2, 1), zebra=ZebraGroup(
                             "v100", (1, 3), 2, (3, 6), (0, 0)))]), 2),
], ids=["remat", "dp-attention+3-experts"])
def test_mixtral_zebra_stage_variants_equal_jit(x64, plan, B):
  case = _mixtral("sequence")
  err, pstep, _ = _run(case, plan, jax.jit(case.step), B)
  assert err <= RTOL, err
  (st,) = _zebra_stages(pstep, case).values()
  expected = (1, 1, 2) if plan.stages[-1].zebra.num_devices == 2 else (3, 1)
  assert all(p.layout.logical_mesh == expected for p in st.zebra.parts if p.kind == "E")
