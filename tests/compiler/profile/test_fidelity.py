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


def _two_dp_stages(zero, opts, num_microbatches):
  """``(state, tokens, profile, step)``: the GPT's first half on four data-parallel V100s and
  its second on two A100s, both at ZeRO level ``zero``."""
  from harpjax.compiler.plan import ManualPlan
  step_fn, state, tokens = _gpt_step()
  probe = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER,
                                num_microbatches=num_microbatches,
                                plan=harpjax.AutoPlan(profile=opts))
  prof = probe.profile(state, tokens)
  L = len(prof.layers)
  plan = ManualPlan([dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 4),
                          logical_mesh=(4, 1), zero=zero),
                     dict(layers=(L // 2, L - 1), subcluster="a100", submesh=(1, 2),
                          logical_mesh=(2, 1), zero=zero)])
  step = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=num_microbatches,
                               plan=plan)
  return state, tokens, prof, step


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
  from harpjax.compiler.plan.variants import tables_for_stages, variant_slot
  from harpjax.compiler.profile import tables_for_plan
  from harpjax.compiler.stages import memory_report
  opts = ProfileOptions(use_cache=False, state_bytes_per_param=16.0,
                        optimizer_bytes_per_param=8.0)
  state, tokens, prof, step = _two_dp_stages(zero, opts, 2)
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


# --------------------------------------------------------------------------- random draws


@pytest.mark.parametrize("shape, raw_key", [((7,), False), ((4, 32), True),
                                            ((3, 5, 6), False)])
def test_random_bits_flops_as_xla_counts_them(shape, raw_key):
  """A ``random_bits`` draw costs what XLA's cost analysis counts for the hash behind it (tens
  of integer operations per element, not one), at shapes and ranks the fit never saw."""
  import jax
  import jax.numpy as jnp
  from harpjax.compiler.trace import primitives
  key = jax.random.PRNGKey(0) if raw_key else jax.random.key(0)
  fn = lambda k: jax.random.bits(k, shape, jnp.uint32)
  eqn = next(e for e in jax.make_jaxpr(fn)(key).eqns if e.primitive.name == "random_bits")
  ours = primitives.eqn_flops("random_bits", eqn.params, [v.aval for v in eqn.invars],
                              [v.aval for v in eqn.outvars])
  xla = float(jax.jit(fn).lower(key).compile().cost_analysis()["flops"])
  assert ours > 10 * np.prod(shape)
  assert ours == pytest.approx(xla, rel=0.01)


# --------------------------------------------------------------------------- the zoo


def _zoo_flops_errors(name: str, remat: bool) -> list:
  """Per stage of the planner's plan of a zoo model (float32, B = 4, demo cluster): its
  layers, its logical mesh, and the tables' FLOPs over XLA's ``cost_analysis`` of the stage's
  forward and backward, less 1."""
  import benchmarks.fidelity as bench
  rows = bench.measure_stages(name, remat)
  return [(tuple(int(x) for x in r["layers"].split("-")), r["where"],
           r["flops"][0] / r["flops"][1] - 1) for r in rows]


_ZOO = ["loop", "remat", "remat_policy", "moe", "gpt", "bert", "scan"]
# What is left (docs/fidelity.md, FLOPs), by the layers of the stage it shows in: the zoo's
# tensor-parallel first layer (Dense and dropout on four devices, a few kFLOP), where XLA:CPU
# computes the masked cotangent once for the weight gradient's matmul and again inside the
# bias gradient's reduction, and nn.scan's first stage also splits the keys of its layers,
# costed nowhere (4-10%); the GPT's rematerialised blocks with dropout (-6.6%); BERT's
# embedding layer alone (-5.9 to -8.9%). Every other stage within 3%; these within 11%.
_TP_FIRST = {(0, 0)}
_KNOWN = {**{(n, r): _TP_FIRST for n in ("loop", "scan", "remat", "remat_policy")
             for r in (False, True)},
          ("remat_policy", True): _TP_FIRST | {(1, 2)},   # -3.03%: see docs/fidelity.md
          ("gpt", True): {(3, 4)}, ("bert", False): {(0, 0)}, ("bert", True): {(0, 0)}}


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("name", _ZOO)
def test_zoo_stage_flops_within_3_percent_of_xla(name, remat):
  """Every stage of the planner's plan, tensor-parallel ones included: dropout's random draws
  (redrawn at the full batch, hashed by threefry, split with the value they mask), the
  backward's gradient accumulation, rematerialised recomputation."""
  known = _KNOWN.get((name, remat), set())
  for layers, where, err in _zoo_flops_errors(name, remat):
    bound = 0.11 if layers in known else 0.03
    assert abs(err) <= bound, (name, remat, layers, where, err)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3])
def test_zero_stage_flops_within_3_percent_of_xla(zero):
  """A ZeRO-3 stage all-gathers its parameters before the forward and reduce-scatters its
  gradients: collectives, no FLOPs the tables miss (float32 GPT, data-parallel V100s then
  A100s)."""
  state, tokens, prof, step = _two_dp_stages(zero, ProfileOptions(use_cache=False), B)
  cs = step.compile(state, tokens)
  for s, (spec, st) in enumerate(zip(cs.plan.stages, cs.stages)):
    assert spec.zero == zero
    compiled = compile_stage(st)
    xla = sum(float(compiled[k].cost_analysis()["flops"]) for k in ("fwd", "bwd"))
    costs = prof.costs[(spec.subcluster, tuple(spec.submesh), tuple(spec.logical_mesh))]
    tables = float(np.sum(costs["flops"][spec.layers[0]:spec.layers[1] + 1]))
    assert abs(tables / xla - 1) <= 0.03, (s, zero, tables, xla)
