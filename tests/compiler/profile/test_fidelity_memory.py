"""The planner's memory against XLA's peak: per stage, the peak ``evaluate_plan`` checks
(``PlannedStage.peak_mem_bytes`` on ``tables_for_plan``: the tables' fixed bytes plus the
in-flight microbatches' residuals, or the gradient reduction and optimizer update if larger)
against the largest phase of :func:`~harpjax.compiler.stages.memory_report` (XLA's
``memory_analysis()`` of the stage's forward with its in-flight residuals held, its backward
and its optimizer update), for every model of the test zoo, remat off and on, and ZeRO levels
0-3. float32 parameters with Adam/AdamW: 4 + 4 + 8 bytes per parameter.

The fast tests check the per-range parameter and input accounting exactly against the
runtime's own stage slicing; the per-model comparisons with XLA compile every stage and are
slow."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import harpjax
from harpjax.compiler.layers import traced_step_for
from harpjax.compiler.profile import ProfileOptions, tables_for_plan
from harpjax.compiler.profile.profiler import param_holding, stage_input_bytes
from harpjax.compiler.stages import memory_report
from harpjax.compiler.stages.stage import slice_stages
from harpjax.compiler.trace import aval_nbytes

TOLERANCE = 0.10
B = 4
OPTS = dict(state_bytes_per_param=16.0, optimizer_bytes_per_param=8.0, use_cache=False,
            progress=False)


def _model(name: str):
  from benchmarks import fidelity
  return fidelity.MODELS[name](), fidelity.CLUSTER


# --------------------------------------------------------------------------- fast: exact


@pytest.mark.parametrize("name", ["scan", pytest.param("gpt", marks=pytest.mark.slow)])
def test_range_accounting_matches_stage_slicing(name):
  """For every layer range (i, j): the parameters :func:`param_holding` says a stage holds
  (whole, once) and owns (first reader) are those of the runtime's stage program, and what
  :func:`stage_input_bytes` says it takes in is its activations' and data inputs' bytes."""
  m, cluster = _model(name)
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B,
                               profile_options=ProfileOptions(**OPTS))
  tr = step.trace(*m.args)
  layers = tr.layers
  ts = traced_step_for(tr.step, layers) if layers.origin is not None else tr.step
  prog = layers.program
  held, owned, _ = param_holding(layers)
  inputs = stage_input_bytes(layers)
  L = len(layers)
  nbytes = lambda v: float(aval_nbytes(prog.avals[v]))
  first_reader: dict = {}
  for i, sp in enumerate(slice_stages(layers, [(i, i) for i in range(L)], ts)):
    for v in sp.param_ids:
      first_reader.setdefault(v, i)
  shared = 0
  for i in range(L):
    for j in range(i, L):
      ranges = ([(0, i - 1)] if i else []) + [(i, j)] + ([(j + 1, L - 1)] if j < L - 1 else [])
      sp = slice_stages(layers, ranges, ts)[1 if i else 0]
      want_held = sum(nbytes(v) for v in sp.param_ids)
      want_owned = sum(nbytes(v) for v in sp.param_ids if i <= first_reader[v] <= j)
      want_in = sum(nbytes(v) for v in sp.act_ids + sp.act_int_ids + sp.data_ids)
      assert held[i, j] == pytest.approx(want_held), (i, j)
      assert owned[i, j] == pytest.approx(want_owned), (i, j)
      assert inputs[i, j] == pytest.approx(want_in), (i, j)
      shared += want_held > want_owned
  assert shared > 0   # both models share parameters between layers (scan stack, tied head)


# --------------------------------------------------------------------------- slow: vs XLA


def stage_memory_errors(name: str, remat: bool, plan=None):
  """``[(stage, planner bytes, XLA peak bytes, phases)]`` of ``name`` on the planner's plan
  (or ``plan``, a :class:`~harpjax.ManualPlan`)."""
  from harpjax.compiler.plan import evaluate_plan
  m, cluster = _model(name)
  opts = ProfileOptions(remat=remat, **OPTS)
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B,
                               profile_options=opts)
  prof = step.profile(*m.args)
  if plan is not None:
    plan = dataclasses.replace(plan(len(prof.layers)), num_microbatches=B,
                               meta={"layers": "auto", "remat": remat})
    # the warm-ups the planner derives for these stages from the tables, which the runtime
    # then runs (a plan without stage times would run H-1F1B's warm-ups of equal stages)
    ev0 = evaluate_plan(tables_for_plan(prof, plan), plan, B, schedule=plan.schedule)
    plan = plan.with_stages([dataclasses.replace(s, warmup=p.warmup)
                             for s, p in zip(plan.stages, ev0.stages)])
    step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B, plan=plan)
  cs = step.compile(*m.args)
  ev = evaluate_plan(tables_for_plan(prof, cs.plan), cs.plan, B, schedule=cs.plan.schedule)
  out = []
  for s in range(len(cs.stages)):
    r = memory_report(cs, s)
    assert ev.stages[s].inflight == r.in_flight, s
    out.append((s, ev.stages[s].peak_mem_bytes, r.xla_peak_bytes, r.phases))
  return out


def _check(rows, tag):
  bad = [(s, f"{p / x - 1:+.1%}", f"{p / 2**20:.4f} MiB", f"{x / 2**20:.4f} MiB",
          max(ph, key=ph.get)) for s, p, x, ph in rows if abs(p / x - 1) > TOLERANCE]
  assert not bad, (tag, bad)


# Known gaps at the last run (docs/fidelity.md, "Peak memory"): nn.scan without remat keeps,
# per in-flight microbatch, each block's slice of the stacked kernels as a residual of its
# forward (XLA: 6.4 KiB a block, the model 2.4 KiB: the layer's piece takes the slice as its
# parameter), 11-20% short on its block stages; under full remat a transformer stage's
# backward holds its recomputed forward as XLA:CPU schedules it, which the per-layer tables'
# largest workspace does not describe (GPT -14% to +31%, BERT -24% to +12%).
_GAPS = {("scan", False), ("gpt", True), ("bert", True)}


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["remat-off", "remat-on"])
@pytest.mark.parametrize("name", ["loop", "scan", "remat", "remat_policy", "gpt", "bert",
                                  "moe"])
def test_zoo_stage_memory_within_10_percent_of_xla(name, remat, request):
  if (name, remat) in _GAPS:
    request.applymarker(pytest.mark.xfail(strict=True, reason="a known gap: docs/fidelity.md, "
                                          "Peak memory"))
  _check(stage_memory_errors(name, remat), (name, remat))


# Known gaps at the last run (docs/fidelity.md, "Peak memory"): the GPT with dropout on four
# data-parallel V100s is short in its forward at every level (what each replica's dropout
# holds there); the loop model's first stage at ZeRO 1 is 15% short in its backward (the
# variants' level-1 model against XLA's backward temporaries of the replicated stage).
_ZERO_GAPS = {("gpt", 0), ("gpt", 1), ("gpt", 2), ("gpt", 3), ("loop", 1)}


def _dp_plan(zero):
  def plan(L):
    return harpjax.ManualPlan([
        dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 4), logical_mesh=(4, 1),
             zero=zero),
        dict(layers=(L // 2, L - 1), subcluster="a100", submesh=(1, 2), logical_mesh=(2, 1),
             zero=zero)])
  return plan


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["loop", "gpt"])
def test_zero_levels_stage_memory_within_10_percent_of_xla(name, zero, request):
  """Data-parallel stages (V100 x 4, then A100 x 2) at every ZeRO level, remat off."""
  if (name, zero) in _ZERO_GAPS:
    request.applymarker(pytest.mark.xfail(strict=True, reason="a known gap: docs/fidelity.md, "
                                          "Peak memory"))
  _check(stage_memory_errors(name, False, _dp_plan(zero)), (name, zero))
