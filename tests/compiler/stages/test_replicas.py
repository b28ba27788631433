"""Data-parallel replicas accumulate their own gradients and reduce them once per step: the
per-microbatch backward of a ZeRO-0/1 stage holds no all-reduce over its replicas (XLA's own
HLO says so), the step's reduction does, and training equals jax.jit in float64."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import harpjax
from harpjax.compiler.stages import compile_stage, compile_step, layout_step
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

B = 4


def _compiled(case, plan, **kw):
  step = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B, plan=plan,
                               **kw)
  return step, step.compile(case.state, case.batches[0])


def _plan(num_layers: int, zero: int = 0):
  # Stage 0 data-parallel over two devices (dp=2, tp=1), stage 1 tensor-parallel.
  plan = harpjax.ManualPlan([((0, num_layers // 2 - 1), "v100", (1, 2), (2, 1)),
                             ((num_layers // 2, num_layers - 1), "a100", (1, 2), (1, 2))])
  stages = tuple(dataclasses.replace(s, zero=zero) if i == 0 else s
                 for i, s in enumerate(plan.stages))
  return dataclasses.replace(plan, stages=stages, layer_source="auto")


def _num_layers(case):
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B)
  return len(probe.trace(case.state, case.batches[0]).layers)


def _hlo(compiled, key):
  return compiled[key].as_text()


@pytest.mark.parametrize("zero", [0, 1])
def test_backward_of_replicas_holds_no_all_reduce_and_the_step_reduces_once(x64, zero):
  case = zoo.linen("loop")
  step, cs = _compiled(case, _plan(_num_layers(case), zero))
  st = cs.stages[0]
  assert st.layout.replicas and st.layout.logical_mesh == (2, 1)
  compiled = compile_stage(st)
  assert "all-reduce" not in _hlo(compiled, "bwd")
  assert "all-reduce" in _hlo(compiled, "reduce")
  # One SPMD program over the replicas (a layout without the step traced at their rows)
  # all-reduces the gradients in every microbatch's backward.
  prog = cs.program
  plain = layout_step(prog.traced, prog.layers, prog.plan, prog.schedule)
  assert not plain.layout.stages[0].replicas
  devices = [list(st.mesh.devices.flat) for st in cs.stages]
  assert "all-reduce" in _hlo(compile_stage(compile_step(plain, devices).stages[0]), "bwd")
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for batch in case.batches[:2]:
    out_ref, out_par = ref(s_ref, batch), step(s_par, batch)
    assert max_rel_err(out_ref, out_par) <= 1e-10
    s_ref, s_par = out_ref[0], out_par[0]


@pytest.mark.slow
def test_replicas_on_ray_actors_match_jit_float64(x64):
  # The replicas' forward, backward and reduction lowered for the stage's actor.
  case = zoo.linen("loop")
  step, _ = _compiled(case, _plan(_num_layers(case), 1),
                      runtime=harpjax.RayRuntime(num_cpus=2))
  runner_stage = step.compile(case.state, case.batches[0]).layout.stages[0]
  assert runner_stage.replicas
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for batch in case.batches[:2]:
    out_ref, out_par = ref(s_ref, batch), step(s_par, batch)
    assert max_rel_err(out_ref, out_par) <= 1e-10
    s_ref, s_par = out_ref[0], out_par[0]
