"""Expert parallelism inside a stage: a ``(dp, tp, ep)`` logical mesh splits the routed
block's expert weights over ``ep`` devices, the batch over ``dp * ep``; XLA's partitioner
moves the tokens to the experts and back with all-to-all (its HLO says so, and never gathers
the expert weights), and training equals ``jax.jit`` in float64 (per-microbatch ``jax.jit``
where routing decides over the microbatch's tokens)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harpjax
from harpjax.errors import PlanError
from harpjax.compiler.layers import sharding
from harpjax.compiler.stages import compile_stage
from harpjax.models.mixtral import Mixtral, MixtralConfig, mixtral_loss
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err
from tests.models.test_moe_exactness import _case

RTOL = 1e-10
B = 2          # microbatches
ROWS = 8       # sequences per batch: 4 per microbatch, split over dp * ep = 4 devices

# Mixtral, 2 blocks: embed 0 · block_0 1-3 · block_1 4-6 · head 7.
EP4 = harpjax.ManualPlan([((0, 3), "v100", (1, 4), (1, 1, 4)),
                          ((4, 7), "a100", (2, 2), (2, 1, 2))])
EP2_TP2 = harpjax.ManualPlan([((0, 3), "v100", (1, 4), (1, 2, 2)),
                              ((4, 7), "a100", (1, 2), (1, 1, 2))])


def _mixtral(**kw) -> zoo.CoupledCase:
  fields = dict(vocab_size=64, seq_len=8, hidden=16, num_heads=4, num_kv_heads=2,
                num_blocks=2, ffn_hidden=24, num_experts=4, top_k=2, dtype="float64",
                param_dtype="float64")
  cfg = MixtralConfig(**{**fields, **kw})
  case = _case(Mixtral(cfg), lambda out, y: mixtral_loss(out, y, cfg.aux_loss_coef),
               cfg.seq_len, cfg.vocab_size)
  rng = np.random.default_rng(1)
  batches = [{k: jax.numpy.asarray(rng.integers(0, cfg.vocab_size, (ROWS, cfg.seq_len)),
                                   jax.numpy.int32) for k in ("tokens", "labels")}
             for _ in range(2)]
  return dataclasses.replace(case, batches=batches)


def _pstep(case, plan):
  return harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                               plan=dataclasses.replace(plan, layer_source="auto"))


def _worst(case, plan, reference, steps=2):
  pstep = _pstep(case, plan)
  s_par = s_ref = case.state
  worst = 0.0
  for batch in case.batches[:steps]:
    out, ref = pstep(s_par, batch), reference(s_ref, batch)
    worst = max(worst, max_rel_err(ref, out))
    s_par, s_ref = out[0], ref[0]
  return worst


def test_logical_mesh_reads_tuples_and_names_axes():
  lm = sharding.LogicalMesh.of((2, 1, 4))
  assert (lm.dp, lm.tp, lm.ep, lm.size, lm.batch_ways) == (2, 1, 4, 8, 8)
  assert lm.axis_names == ("dp", "ep", "tp") and lm.shape == (2, 4, 1)
  assert lm.batch_axes == ("dp", "ep")
  assert sharding.LogicalMesh.of((2, 2)).as_tuple() == (2, 2)
  assert sharding.LogicalMesh.of((2, 2, 1)).axis_names == ("dp", "tp")
  mesh = sharding.make_mesh(jax.devices()[:8], (2, 1, 4))
  assert dict(mesh.shape) == {"dp": 2, "ep": 4, "tp": 1}
  assert sharding.batch_spec((8, 3), 0, lm) == P(("dp", "ep"))
  assert sharding.batch_spec((4, 3), 0, lm) == P()
  # A stage's logical mesh: (dp, tp, ep), ep = 1 read as (dp, tp), the product checked.
  st = harpjax.StageSpec((0, 1), "v100", (1, 4), (1, 1, 4))
  assert st.logical_mesh == (1, 1, 4)
  assert harpjax.StageSpec((0, 1), "v100", (1, 4), (2, 2, 1)).logical_mesh == (2, 2)
  assert harpjax.StageSpec.from_json(st.to_json()) == st
  with pytest.raises(PlanError, match="dp \\* tp \\* ep"):
    harpjax.StageSpec((0, 1), "v100", (1, 4), (2, 1, 4))


def _collectives(hlo: str) -> list[tuple[str, str]]:
  """(kind, result shape) of every collective in an optimized HLO module."""
  pat = r"= (\(.*?\)|\S+) (all-to-all|all-gather|all-reduce|reduce-scatter)\("
  return [(k, s) for s, k in re.findall(pat, hlo)]


def test_expert_weights_split_on_ep_and_tokens_move_by_all_to_all_as_costed(x64):
  case = _mixtral(routing_group="sequence", capacity_factor=1.0)
  cs = _pstep(case, EP4).compile(case.state, case.batches[0])
  st = cs.stages[0]
  assert st.layout.logical_mesh == (1, 1, 4)
  assert dict(st.mesh.shape) == {"dp": 1, "ep": 4, "tp": 1}
  experts = {v: s for v, s in st.layout.specs.items()
             if v in st.layout.param_ids and st.layout.avals[v].shape[:1] == (4,)
             and len(st.layout.avals[v].shape) == 3}
  assert len(experts) == 3 and all(s == P("ep") for s in experts.values()), experts
  others = [s for v, s in st.layout.specs.items() if v in st.layout.param_ids and v not in experts]
  assert others and all(s == P() for s in others)
  compiled = compile_stage(st)
  for key in ("fwd", "bwd"):
    colls = _collectives(compiled[key].as_text())
    assert any(k == "all-to-all" for k, _ in colls), (key, colls)
    # No all-gather of an expert weight ([4, 16, 24] or [4, 24, 16]).
    gathered = [s for k, s in colls if k == "all-gather"]
    assert not any(re.match(r"f64\[4,(16,24|24,16)\]", s) for s in gathered), gathered
  # The profile charges a routed layer of a (dp, tp, ep) stage the tokens dispatched and
  # combined, read off the program, 1 / (dp * ep) per device, forward once and backward twice
  # (harpjax.compiler.profile.profiler.expert_parallel_costs); XLA's compiled stage moves
  # exactly that.
  sp, prog = cs.program.programs[0], cs.program.layers.program
  per_device = sharding.expert_exchange_bytes(
      prog, prog.ops[sp.own_range[0]:sp.own_range[1]], sp.param_ids) / 4
  # [experts 4, sequences 4, capacity 4, hidden 16] f64 dispatched, as many combined.
  assert per_device == 2 * 4 * 4 * 4 * 16 * 8 / 4
  moved = {key: sum(_result_bytes(s) for k, s in _collectives(compiled[key].as_text())
                    if k == "all-to-all") for key in ("fwd", "bwd")}
  assert moved == {"fwd": per_device, "bwd": 2 * per_device}, (moved, per_device)


def _result_bytes(shape: str) -> int:
  """Bytes of an HLO result shape: ``f64[1,4,16]`` or a tuple of them."""
  size = {"f64": 8, "f32": 4, "bf16": 2, "s32": 4, "f16": 2}
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
    total += size[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def test_mixtral_ep4_routed_per_sequence_equals_jit(x64):
  case = _mixtral(routing_group="sequence", capacity_factor=1.0)
  assert _worst(case, EP4, jax.jit(case.step)) <= RTOL


@pytest.mark.slow
def test_mixtral_ep2_with_tp_routed_per_sequence_equals_jit(x64):
  case = _mixtral(routing_group="sequence", capacity_factor=1.0, top_k=1)
  assert _worst(case, EP2_TP2, jax.jit(case.step)) <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("plan", [EP4, EP2_TP2], ids=["ep4", "ep2-tp2"])
def test_mixtral_ep_routed_over_the_batch_equals_jit_per_microbatch(x64, plan):
  case = _mixtral(capacity_factor=1.0)
  assert _worst(case, plan, zoo.per_microbatch_reference(case, B)) <= RTOL


def _toy_cluster(tmp_path, memory_bytes: int) -> str:
  path = tmp_path / f"toy_{memory_bytes}.yaml"
  path.write_text(f"""name: toy
gpus:
  - {{name: toy, tflops: 100, memory_gb: {memory_bytes / 2**30!r}, mem_bandwidth_gbs: 900}}
subclusters:
  - name: toy
    gpu: toy
    hosts: 1
    devices_per_host: 4
    nics:
      - {{name: eth0, kind: ethernet, gbps: 100, network: dc}}
""")
  return str(path)


@pytest.mark.slow
def test_planner_chooses_ep_where_experts_do_not_fit_unsharded_and_trains_exactly(x64, tmp_path):
  from harpjax.compiler.plan import solve
  from tests.compiler.plan import oracle
  case = _mixtral(routing_group="sequence", capacity_factor=1.0)
  auto = harpjax.AutoPlan(profile=harpjax.ProfileOptions(max_tp=1))   # no Megatron split

  def planned(memory_bytes):
    pstep = harpjax.auto_parallel(case.step, cluster=_toy_cluster(tmp_path, memory_bytes),
                                  num_microbatches=B, plan=auto)
    return pstep, pstep.plan(case.state, case.batches[0]), \
        pstep.profile(case.state, case.batches[0])

  # Enough memory: a pipeline of data-parallel stages, no all-to-all.
  _, roomy, _ = planned(400_000)
  assert all(len(s.logical_mesh) == 2 for s in roomy.stages), roomy
  # 250 kB: no stage holding a routed block's 4 experts whole fits (the profile's (dp, tp)
  # entries of the routed layers do not); one expert-parallel stage does.
  pstep, plan, prof = planned(250_000)
  assert [(s.layers, s.submesh, s.logical_mesh) for s in plan.stages] == \
      [((0, 7), (1, 4), (1, 1, 4))], plan
  assert plan.predicted_iteration_s > roomy.predicted_iteration_s
  tables = prof.tables
  assert tables.logical_mesh_of(0, 0, 7, tables.submeshes[0].index((1, 4))) == (1, 1, 4)
  # The search over the tables with their expert-parallel entries: brute force agrees.
  res = solve(tables, B)
  bf = oracle.brute_force(tables, B, eps=res.plan.eps if res.plan.eps is not None else 0.1)
  assert res.plan.predicted_iteration_s == pytest.approx(bf.objective_s, rel=1e-9)
  # And the planned step trains as jax.jit does.
  s_par = s_ref = case.state
  ref = jax.jit(case.step)
  for batch in case.batches:
    out, want = pstep(s_par, batch), ref(s_ref, batch)
    assert max_rel_err(want, out) <= RTOL
    s_par, s_ref = out[0], want[0]


@pytest.mark.slow
def test_interleaved_moe_with_ep_equals_jit(x64):
  # The dense/MoE interleaved model (top-1 per sequence, capacity 0.5: drops): embed 0 ·
  # DenseBlock 1-3 · MoEBlock 4-6 · DenseBlock 7-9 · MoEBlock 10-12 · ln_f 13.
  from harpjax.models import MoEConfig, MoETransformer, gpt
  cfg = MoEConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=4, num_blocks=4,
                  dtype="float64", param_dtype="float64", key_bias=False, layer_marks=0,
                  num_experts=4, capacity_factor=0.5)
  case = _case(MoETransformer(cfg), gpt.lm_loss, cfg.seq_len, cfg.vocab_size)
  rng = np.random.default_rng(2)
  case = dataclasses.replace(case, batches=[
      {k: jax.numpy.asarray(rng.integers(0, cfg.vocab_size, (ROWS, cfg.seq_len)),
                            jax.numpy.int32) for k in ("tokens", "labels")} for _ in range(2)])
  plan = harpjax.ManualPlan([((0, 6), "v100", (1, 4), (1, 1, 4)),
                             ((7, 13), "a100", (2, 2), (2, 1, 2))])
  cs = _pstep(case, plan).compile(case.state, case.batches[0])
  assert any(s == P("ep") for s in cs.stages[0].layout.specs.values())
  assert _worst(case, plan, jax.jit(case.step)) <= RTOL
