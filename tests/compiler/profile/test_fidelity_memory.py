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
from harpjax.compiler.profile.profiler import (param_holding, stage_input_bytes,
                                               stage_workspaces)
from harpjax.compiler.profile.tables import range_max
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


def test_stage_workspaces_exact_for_every_range():
  """:func:`stage_workspaces` against its definition, range by range, on random layer costs:
  the forward's and backward's largest layer; under rematerialisation the draws' workspace
  (``2 * sum + 2 * largest``) and, while layer ``l``'s backward runs, the recomputed values
  held by the layers before it in the stage, and, beside the draws' workspace, the values
  recomputed up to the stage's first drawing layer."""
  rng = np.random.default_rng(0)
  L = 9
  arr = {f: rng.uniform(0, 1000, L) for f in ("temp_bytes", "fwd_temp_bytes",
                                                "bwd_temp_bytes", "remat_held_bytes")}
  arr["draw_max_bytes"] = rng.uniform(0, 300, L) * (rng.uniform(size=L) < 0.6)
  arr["draw_bytes"] = arr["draw_max_bytes"] * rng.integers(1, 3, L)
  for remat in ("none", "full", "dots"):
    work_f, work_b = stage_workspaces(arr, remat)
    for i in range(L):
      for j in range(i, L):
        r = slice(i, j + 1)
        total, largest = arr["draw_bytes"][r].sum(), arr["draw_max_bytes"][r].max()
        draws = 2 * total + 2 * largest if total > 0 else 0.0
        want_f = arr["fwd_temp_bytes"][r].max()
        want_b = arr["bwd_temp_bytes"][r].max()
        if remat != "none":
          want_f = max(want_f, draws)
          f = next((l for l in range(i, j + 1) if arr["draw_bytes"][l] > 0), None)
          alive = 0.0 if f is None else arr["remat_held_bytes"][i:f].sum() + max(
              arr["remat_held_bytes"][f] - 2 * arr["draw_bytes"][f], 0.0)
          want_b = max(draws + alive if total > 0 else 0.0,
                       max(arr["remat_held_bytes"][i:l].sum() + arr["bwd_temp_bytes"][l]
                           for l in range(i, j + 1)))
        assert work_f[i, j] == pytest.approx(want_f), (remat, i, j)
        assert work_b[i, j] == pytest.approx(want_b), (remat, i, j)
  # without draws or held values the stage's workspaces are its layers' largest
  plain = {"temp_bytes": arr["temp_bytes"]}
  work_f, work_b = stage_workspaces(plain, "full")
  upper = np.triu(np.ones((L, L), bool))
  assert np.allclose(work_f[upper], range_max(arr["temp_bytes"])[upper])
  assert np.allclose(work_b[upper], range_max(arr["temp_bytes"])[upper])


# --------------------------------------------------------------------------- slow: vs XLA


def stage_memory_errors(name: str, remat: bool, plan=None):
  """``[(stage, planner bytes, XLA peak bytes, phases)]`` of ``name`` on the planner's plan
  (or ``plan``, a :class:`~harpjax.ManualPlan`)."""
  from harpjax.compiler.plan import evaluate_plan
  m, cluster = _model(name)
  opts = ProfileOptions(remat=remat, **OPTS)
  # plain stages: a zebra stage (which the planner considers for routed models) has its own
  # report (tests/runtime/test_zebra.py)
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B,
                               profile_options=opts,
                               solve_options=harpjax.SolveOptions(
                                   mixed_options=harpjax.MixedOptions(zebra="off")))
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


class OpenRow(AssertionError):
  """A stage the memory model is known to miss by more than :data:`TOLERANCE` (its cause
  measured and stated in the reason of the case's ``xfail``): raised only for those stages,
  so that every other stage of the case is still checked."""


def _check(rows, tag, open_stages=()):
  bad = [(s, f"{p / x - 1:+.1%}", f"{p / 2**20:.4f} MiB", f"{x / 2**20:.4f} MiB",
          max(ph, key=ph.get)) for s, p, x, ph in rows if abs(p / x - 1) > TOLERANCE]
  assert not [b for b in bad if b[0] not in open_stages], (tag, bad)
  if bad:
    raise OpenRow((tag, bad))


# The zoo's first stage (a Dense in and its dropout on four V100s, tensor-parallel, 3-5 KiB):
# XLA:CPU places every buffer at a 64-byte boundary, and the stage runs three threefry hash
# loops (the key's fold_in over u32[1], its split over u32[4], the draw over u32[4, 4] per
# device) whose loop states (a 64-byte tuple and eight buffers of 4 to 64 bytes, each in a
# 64-byte slot) are built before the first loop runs. The scan model's forward (remat off):
# 1796 bytes of temporaries, 28 slots; compiled alone, the draw takes 964 bytes (what the
# layer's workspace charges), fold_in, split and the draw together 1476. Neither the key's
# hashes nor the slots are in the model (docs/fidelity.md, "Draws by position").
_FIRST_STAGE = ("stage 0: the key's fold_in and split hash loops beside the draw's, each "
                "buffer in a 64-byte slot of XLA:CPU, not modelled")
# The GPT's middle stages under remat, in their backward (docs/fidelity.md): layers 3-4 (an
# MLP, then attention) hold the MLP's recomputed values as modelled (448 KiB) while the
# attention's backward runs, but that backward holds less than the layer's own workspace
# (about 520 KiB against 679 KiB); layers 5-6 (a layer norm with
# dropout, then an MLP) hold four MLP-hidden buffers (128 KiB each), a draw's state and six
# 32 KiB values during the MLP's backward: 854272 bytes of temporaries, where the model charges
# the MLP's workspace and the layer norm's held values, 525824.
_GPT_REMAT = ("stages 2 (layers 3-4, +11.7%) and 3 (layers 5-6, -17.5%): a rematerialising "
              "layer's backward within the stage holds other than its workspace alone")
OPEN = {("loop", True): ((0,), _FIRST_STAGE), ("remat", True): ((0,), _FIRST_STAGE),
        ("remat_policy", True): ((0,), _FIRST_STAGE), ("scan", False): ((0,), _FIRST_STAGE),
        ("scan", True): ((0,), _FIRST_STAGE), ("gpt", True): ((2, 3), _GPT_REMAT)}


def _zoo_cases():
  for name in ["loop", "scan", "remat", "remat_policy", "gpt", "bert", "moe"]:
    for remat in (False, True):
      marks = [pytest.mark.slow]
      if (name, remat) in OPEN:
        marks.append(pytest.mark.xfail(strict=True, raises=OpenRow,
                                       reason=OPEN[name, remat][1]))
      yield pytest.param(name, remat, marks=marks,
                         id=f"{name}-remat-{'on' if remat else 'off'}")


@pytest.mark.parametrize("name, remat", list(_zoo_cases()))
def test_zoo_stage_memory_within_10_percent_of_xla(name, remat):
  """Every stage of the planner's plan within 10% of XLA's peak, remat off and on: among
  them the runtime viewing an ``nn.scan`` stack's slices anew in the backward (no residual
  copy per microbatch), and a rematerialising stage's backward at stage level (its draws
  together, the earlier layers' recomputed values held while later layers' backward runs,
  and those recomputed up to the stage's first draw beside the draws' workspace)."""
  _check(stage_memory_errors(name, remat), (name, remat), OPEN.get((name, remat), ((),))[0])


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
def test_zero_levels_stage_memory_within_10_percent_of_xla(name, zero):
  """Data-parallel stages (V100 x 4, then A100 x 2) at every ZeRO level, remat off: among
  them the loop model's first stage, whose step traces otherwise at one row per replica (the
  runtime then all-reduces the gradient every microbatch: its backward holds the gradient
  and the reduction, at levels 0 and 1 as at 2 and 3), and the GPT with dropout, each replica
  hashing its own rows of the batch's dropout bits."""
  _check(stage_memory_errors(name, False, _dp_plan(zero)), (name, zero))


def test_stage_forward_keeps_no_view_of_a_parameter():
  """The stage's forward returns no view of a parameter among its residuals (a layer's slice
  of an ``nn.scan`` stack): its backward takes the parameters again and slices them anew, so
  what a microbatch keeps is what the layers' costs charge (their pieces take the slice as a
  parameter). Before, each in-flight microbatch kept a copy of its blocks' kernels."""
  import jax
  from harpjax.compiler.stages.stage import stage_functions
  m, cluster = _model("scan")
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B,
                               profile_options=ProfileOptions(**OPTS))
  tr = step.trace(*m.args)
  layers = tr.layers
  ts = traced_step_for(tr.step, layers) if layers.origin is not None else tr.step
  prog = layers.program
  L = len(layers)
  sp = slice_stages(layers, [(0, 0), (1, L - 2), (L - 1, L - 1)], ts)[1]
  kinds = {prog.invars[k]: inp.kind for k, inp in enumerate(ts.inputs)}
  aval = lambda v: jax.ShapeDtypeStruct(prog.avals[v].shape, prog.avals[v].dtype)
  fns = stage_functions(sp, ts, layers)
  args = (tuple(aval(v) for v in sp.param_ids), tuple(aval(v) for v in sp.act_ids),
          tuple(aval(v) for v in sp.act_int_ids),
          tuple(aval(v) for v in sp.data_ids if kinds.get(v) != "static"),
          jax.ShapeDtypeStruct((), np.int32))
  _, residuals = jax.eval_shape(fns.fwd, *args)
  stacked = [prog.avals[v].shape for v in sp.param_ids if len(prog.avals[v].shape) == 3]
  assert stacked   # the stage reads the nn.scan stacks
  slices = {s[1:] for s in stacked}
  kept = [r.shape for r in residuals if tuple(r.shape) in slices]
  assert not kept, kept
  # what the layers' costs charge per microbatch: the forward's residual bytes, each once
  res_bytes = sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize for r in residuals)
  assert res_bytes > 0


def test_backward_that_reduces_holds_the_gradient_and_its_reduction():
  """Where the replicas cannot accumulate their own gradients (rows that do not split over
  ``dp``, expert parallelism), a level-0/1 backward writes the whole gradient and its
  all-reduce beside it; where they can, the largest layer's gradient alone."""
  from harpjax.compiler.profile.memory import runs_replicas, stage_memory
  assert runs_replicas(4, 8) and runs_replicas(4, None) and not runs_replicas(1, 8)
  assert not runs_replicas(4, 6) and not runs_replicas(2, 8, ep=2)
  assert list(runs_replicas(np.array([1, 2, 3, 4]), 8)) == [False, True, False, True]
  kw = dict(param_bytes=100.0, opt_bytes=200.0, act_bytes=0.0, dp=4, zero=1,
            grad_out_bytes=10.0, bwd_workspace_bytes=5.0)
  rep = stage_memory(replicas=True, **kw)
  spmd = stage_memory(replicas=False, **kw)
  assert rep.bwd_workspace_bytes == 10.0 + 5.0 and rep.reduce_bytes() > 0
  assert spmd.bwd_workspace_bytes == 100.0 + 100.0 + 5.0 and spmd.reduce_bytes() == 0.0
  per_entry = stage_memory(replicas=np.array([True, False]), **{**kw, "dp": np.array([4, 4])})
  assert list(per_entry.bwd_workspace_bytes) == [15.0, 205.0]
