"""Rematerialisation per stage (``StageSpec.remat``): the runtime honours each stage's mode,
its forward keeps fewer residuals the more it recomputes (XLA's outputs say so), training
equals jax.jit in float64 either way, and the mode survives a plan file and shows in its
table."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import harpjax
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.stages import compile_stage
from harpjax.errors import PlanError
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

B = 4


def _plan(num_layers: int, first: str, second: str) -> Plan:
  half = num_layers // 2
  return dataclasses.replace(harpjax.ManualPlan([
      StageSpec((0, half - 1), "v100", (1, 2), (2, 1), remat=first),
      StageSpec((half, num_layers - 1), "a100", (1, 2), (1, 2), remat=second)]),
      layer_source="auto")


def _num_layers(case):
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B)
  return len(probe.trace(case.state, case.batches[0]).layers)


def _residual_bytes(step, case) -> list[float]:
  cs = step.compile(case.state, case.batches[0])
  out = []
  for st in cs.stages:
    fwd = compile_stage(st)["fwd"].memory_analysis()
    out.append(float(fwd.output_size_in_bytes))
  return out


def test_each_stage_recomputes_as_its_plan_says_and_matches_jit_float64(x64):
  case = zoo.linen("loop")
  n = _num_layers(case)
  by_mode = {}
  for mode in ("none", "dots", "full"):
    step = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                 plan=_plan(n, mode, "none"))
    by_mode[mode] = _residual_bytes(step, case)[0]
    if mode != "dots":
      continue
    ref = jax.jit(case.step)
    s_ref = s_par = case.state
    for batch in case.batches[:2]:
      out_ref, out_par = ref(s_ref, batch), step(s_par, batch)
      assert max_rel_err(out_ref, out_par) <= 1e-10
      s_ref, s_par = out_ref[0], out_par[0]
  # The forward's results (outputs and residuals) shrink as it recomputes more.
  assert by_mode["full"] < by_mode["dots"] < by_mode["none"], by_mode


def test_remat_survives_a_plan_file_and_shows_in_the_table(tmp_path):
  plan = harpjax.ManualPlan([StageSpec((0, 1), "v100", (1, 2), remat="full"),
                             StageSpec((2, 3), "a100", (1, 2))])
  path = tmp_path / "plan.json"
  plan.save(path)
  again = harpjax.load_plan(path)
  assert [s.remat for s in again.stages] == ["full", None]
  assert [again.remat_of(s) for s in again.stages] == ["full", "none"]
  assert "Remat" in again.table() and "full" in again.table()
  with pytest.raises(PlanError, match="remat"):
    StageSpec((0, 1), "v100", (1, 2), remat="some")
