"""Float64 equivalence with ``jax.jit`` on the model zoo: random draws everywhere, remat, scan,
mutable state, NNX; layer summaries keep each model's repeated block count."""

from __future__ import annotations

import dataclasses
import logging

import jax
import pytest

import harpjax
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10
B = 4


def _two_stage_plan(num_layers: int) -> harpjax.Plan:
  """Two stages over automatic layers: dp x tp = 2 x 1 on V100s, then 1 x 2 on A100s."""
  half = num_layers // 2
  plan = harpjax.ManualPlan([((0, half - 1), "v100", (1, 2), (2, 1)),
                             ((half, num_layers - 1), "a100", (1, 2), (1, 2))])
  return dataclasses.replace(plan, layer_source="auto")


def _run_both(case: zoo.Case, plan, steps: int = 2, **kwargs):
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                plan=plan, **kwargs)
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  worst = 0.0
  for batch in case.batches[:steps]:
    out_ref, out_par = ref(s_ref, batch), pstep(s_par, batch)
    assert jax.tree_util.tree_structure(out_ref) == jax.tree_util.tree_structure(out_par)
    worst = max(worst, max_rel_err(out_ref, out_par))
    s_ref, s_par = out_ref[0], out_par[0]
  return pstep, worst


def _layers(case: zoo.Case):
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B)
  return probe.trace(case.state, case.batches[0]).layers


# "jit" (inlined at the top level, like "loop"), "cond" and "while" (re-issued whole, as in
# the next test) add nothing here but time; the zoo keeps them for other uses.
@pytest.mark.parametrize("kind", [k for k in zoo.KINDS if k not in ("jit", "cond", "while")])
def test_dropout_anywhere_matches_jit_float64(x64, kind):
  case = zoo.linen(kind)
  layers = _layers(case)
  assert f"{zoo.BLOCKS} × " in layers.summary, layers.summary
  _, err = _run_both(case, _two_stage_plan(len(layers)))
  assert err <= RTOL, f"{kind}: {err:.3g} ({layers.summary})"


@pytest.mark.parametrize("kind", ["scan_remat", "while", "cond", "scan_jit"])
def test_draws_inside_kept_bodies_match_jit_float64(x64, kind):
  # One stage over the region as traced: scans stay scans, so the draws in their bodies (and
  # in while / cond / nested jit bodies) are redrawn from inside the re-issued equation.
  case = zoo.linen(kind)
  _, err = _run_both(case, harpjax.ManualPlan([((0, 0), "a100", (1, 2), (2, 1))]), steps=2)
  assert err <= RTOL, f"{kind}: {err:.3g}"


def test_mutable_batch_stats_and_aux_match_jit_float64(x64):
  case = zoo.batch_stats()
  layers = _layers(case)
  assert f"{zoo.BLOCKS} × " in layers.summary, layers.summary
  _, err = _run_both(case, _two_stage_plan(len(layers)))
  assert err <= RTOL, err


def test_nnx_matches_jit_float64(x64):
  case = zoo.nnx_model()
  layers = _layers(case)
  assert f"{zoo.BLOCKS} × " in layers.summary, layers.summary
  _, err = _run_both(case, _two_stage_plan(len(layers)))
  assert err <= RTOL, err


def test_fully_automatic_scan_remat_dropout_float64(x64):
  case = zoo.linen("scan_remat")
  pstep, err = _run_both(case, None, steps=2)
  assert err <= RTOL, err
  assert f"{zoo.BLOCKS} × " in pstep.trace(case.state, case.batches[0]).layers.summary


def test_draw_inside_custom_vjp_warns(x64, caplog):
  case = zoo.custom_vjp()
  with caplog.at_level(logging.WARNING, logger="harpjax"):
    _run_both(case, harpjax.ManualPlan([((0, 0), "a100", (1, 2), (2, 1))]), steps=1)
  assert any("custom_vjp_call" in r.getMessage() and "cannot be aligned" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
