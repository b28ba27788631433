"""The planner's memory of a device group that runs several stages (an interleaved schedule)
against XLA's account.

``evaluate_plan`` charges a group every stage's state, the most residual bytes its interleaved
order holds at once (:func:`~harpjax.compiler.schedule.group_activation_peaks`) and the
largest task workspace among its stages, or its largest update if more (docs/schedules.md).
The XLA side follows the same group on one device: :func:`~harpjax.compiler.stages.
memory_report` of each of its compiled stages gives the stage's state and, per phase, what
XLA's executable adds on top (its outputs and temporaries, the forward's residuals of the
running microbatch); walking the group's task order, each task's peak is every stage's state,
the residuals held by the group's other microbatches in flight and the running task's own
bytes; after the pipeline each stage's reduction and update run beside the other stages'
state. The zoo's ``loop`` model on four stages over two device groups (``v = 2``, ``B = 4``),
remat off and on, within 10%.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import harpjax
from harpjax.compiler.profile import ProfileOptions, tables_for_plan
from harpjax.compiler.stages import memory_report

TOLERANCE = 0.10
B = 4
OPTS = dict(state_bytes_per_param=16.0, optimizer_bytes_per_param=8.0, use_cache=False,
            progress=False)
GROUPS = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]


def interleaved_plan(num_layers, groups=GROUPS, v=2):
  """``v * len(groups)`` stages of about equal layer counts; stage ``i`` on ``groups[i % d]``
  (as ``tests/runtime/test_interleaved.py``)."""
  S = v * len(groups)
  cuts = [round(k * num_layers / S) for k in range(S + 1)]
  return harpjax.ManualPlan([
      dict(layers=(cuts[i], cuts[i + 1] - 1), subcluster=groups[i % len(groups)][0],
           submesh=groups[i % len(groups)][1], logical_mesh=groups[i % len(groups)][2])
      for i in range(S)], schedule="interleaved")


def group_xla_peaks(schedule, reports) -> dict[int, tuple[float, str]]:
  """Per device group, XLA's peak bytes per device over a step and the phase it falls in
  (``"3F1"``: stage 3's forward of microbatch 1; ``"update0 of stage 2"``...).

  ``reports``: :func:`memory_report` of every stage (none with offloaded state or residuals).
  """
  state = [r.param_bytes + r.grad_bytes + r.opt_bytes for r in reports]
  # What each phase adds to the stage's state and its own held residuals: the running task's
  # inputs, outputs (the forward's include this microbatch's residuals) and temporaries.
  own_f = [r.phases["fwd"] - st - (r.in_flight - 1) * r.act_bytes
           for r, st in zip(reports, state)]
  own_b = [r.phases["bwd"] - st - r.in_flight * r.act_bytes for r, st in zip(reports, state)]
  out = {}
  for g, order in enumerate(schedule.groups):
    stages = sorted({t.stage for t in order})
    base = sum(state[s] for s in stages)
    held, best = 0.0, (0.0, "")
    for t in order:
      s = t.stage
      if t.kind == "F":
        best = max(best, (base + held + own_f[s], str(t)))
        held += reports[s].act_bytes
      else:
        best = max(best, (base + held + own_b[s], str(t)))
        held -= reports[s].act_bytes
    for s in stages:
      for name, peak in reports[s].phases.items():
        if name not in ("fwd", "bwd"):
          best = max(best, (base - state[s] + peak, f"{name} of stage {s}"))
    out[g] = best
  return out


def group_memory_rows(name: str, remat: bool):
  """``[(group, model bytes, XLA bytes, XLA's peak phase)]`` of ``name`` on the interleaved
  plan."""
  from benchmarks import fidelity
  from harpjax.compiler.plan import evaluate_plan
  m, cluster = fidelity.MODELS[name](), fidelity.CLUSTER
  opts = ProfileOptions(remat=remat, **OPTS)
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B,
                               profile_options=opts)
  prof = step.profile(*m.args)
  plan = dataclasses.replace(interleaved_plan(len(prof.layers)), num_microbatches=B,
                             meta={"layers": "auto", "remat": remat})
  step = harpjax.auto_parallel(m.step, cluster=cluster, num_microbatches=B, plan=plan)
  cs = step.compile(*m.args)
  sched = cs.schedule
  assert sched.groups is not None and len(sched.groups) == 2
  ev = evaluate_plan(tables_for_plan(prof, cs.plan), cs.plan, B, schedule=cs.plan.schedule)
  reports = [memory_report(cs, s) for s in range(len(cs.stages))]
  xla = group_xla_peaks(sched, reports)
  rows = []
  for g, (x, phase) in xla.items():
    first = sched.device_groups.index(g)
    rows.append((g, ev.stages[first].peak_mem_bytes, x, phase))
  return rows


def _tables(L=8, step_extra=4.0):
  """One subcluster of 4 devices, submesh (1, 2) only; per layer 10 bytes of fixed memory
  (4 of them optimizer state), a 3-byte task workspace, 0.5 residual bytes per microbatch."""
  from harpjax.compiler.profile import CostTables
  shape = (L, L, 1)
  n = np.zeros(shape)
  for i in range(L):
    n[i, i:, 0] = np.arange(1, L - i + 1)
  valid = n > 0
  t = np.where(valid, n / 2.0, np.inf)
  p, opt = 10.0 * n, 4.0 * n
  ws, gout = np.where(valid, 3.0, 0.0), np.where(valid, 1.0, 0.0)
  return CostTables(num_layers=L, subcluster_names=("c0",), num_hosts=(1,),
                    devices_per_host=(4,), device_memory_bytes=(1e9,), submeshes=(((1, 2),),),
                    stage_time_s=(t,), param_mem_bytes=(p,), act_mem_bytes=(0.5 * n,),
                    boundary_bytes=np.zeros(L), intra_bandwidth_bytes_per_s=(1e12,),
                    intra_latency_s=(0.0,), inter_bandwidth_bytes_per_s=(),
                    inter_latency_s=(), opt_mem_bytes=(opt,), workspace_bytes=(ws,),
                    grad_out_bytes=(gout,), step_mem_bytes=(p + step_extra * valid,),
                    logical_mesh=(np.broadcast_to(np.array([2, 1]), shape + (2,)).copy(),))


def test_group_memory_charges_one_task_workspace_and_updates_beside_the_state():
  """A group holds its stages' state, the most residuals its order holds and one task's
  workspace (not each stage's); an update runs beside the other stages' state."""
  from harpjax.compiler import schedule as sc
  from harpjax.compiler.plan import evaluate_plan
  from harpjax.compiler.plan.variants import memory_model
  tables, B = _tables(), 4
  plan = harpjax.ManualPlan([((2 * x, 2 * x + 1), "c0", (1, 2)) for x in range(4)],
                            schedule="interleaved")
  ev = evaluate_plan(tables, plan, B)
  model = memory_model(tables, 0, tables.logical_mesh[0][..., 0].astype(float), 0)
  fixed = tables.param_mem_bytes[0][0, 1, 0]
  assert model.fixed_bytes()[0, 1, 0] == pytest.approx(fixed)   # the tables' own split
  w = float(np.maximum(model.fwd_workspace_bytes, model.bwd_workspace_bytes)[0, 1, 0])
  assert 0 < w < fixed
  held = sc.group_activation_peaks(sc.make_schedule("interleaved", 4, B).groups, [1.0] * 4)
  assert held == (5.0, 3.0)
  pipeline = [2 * (fixed - w) + h + w for h in held]
  # Interleaved updates: a stage updates right after its last backward. In each group the
  # second chunk's last backward (B3 of the last block) comes before the first chunk's B2 and
  # B3, so its update runs beside the other stage's state and those two microbatches' residuals
  # (1 byte each); the first chunk's update, last, beside the state alone.
  update = (fixed + 4.0) + (fixed - w) + 2 * 1.0
  want = [max(pipeline[0], update), max(pipeline[1], update)]
  assert want == [update, update] and update > max(pipeline)   # both groups peak in an update
  assert [st.peak_mem_bytes for st in ev.stages] == pytest.approx(want * 2)
  # Without the workspace arrays, every stage's fixed bytes are charged whole.
  bare = tables.replace(workspace_bytes=None)
  ev0 = evaluate_plan(bare, plan, B)
  assert ev0.stages[0].peak_mem_bytes == pytest.approx(
      max(2 * fixed + held[0], (fixed + 4.0) + fixed + 2 * 1.0))


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["remat-off", "remat-on"])
def test_interleaved_group_memory_within_10_percent_of_xla(remat):
  rows = group_memory_rows("loop", remat)
  bad = [(g, f"{p / x - 1:+.1%}", f"{p / 2**20:.4f} MiB", f"{x / 2**20:.4f} MiB", ph)
         for g, p, x, ph in rows if abs(p / x - 1) > TOLERANCE]
  assert not bad, (remat, bad)
