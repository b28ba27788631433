"""Stages that share a device group, run in the interleaved 1F1B order: training equals
``jax.jit`` in float64, with plain parameters and with ZeRO.

Four stages on two device groups (``v = 2``): stages 0 and 2 on group 0, stages 1 and 3 on
group 1; the activations from stage 1 to stage 2 go from group 1 back to group 0.
"""

import dataclasses

import jax
import pytest

import harpjax
from harpjax.compiler.stages import resolve_plan
from harpjax.cluster import load_cluster
from harpjax.errors import PlanError
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10


def interleaved_plan(num_layers, groups, zero=0, schedule="interleaved", v=2):
  """``v * len(groups)`` stages over ``num_layers`` layers; stage ``i`` on ``groups[i % d]``
  (``(subcluster, submesh, logical mesh)``)."""
  S = v * len(groups)
  cuts = [round(k * num_layers / S) for k in range(S + 1)]
  return dataclasses.replace(harpjax.ManualPlan([
      dict(layers=(cuts[i], cuts[i + 1] - 1), subcluster=groups[i % len(groups)][0],
           submesh=groups[i % len(groups)][1], logical_mesh=groups[i % len(groups)][2],
           zero=zero) for i in range(S)], schedule=schedule), layer_source="auto")


def _num_layers(case):
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2)
  return len(probe.trace(case.state, case.batches[0]).layers)


def _train_like_jit(case, plan, num_microbatches, steps=2):
  """Trains ``steps`` steps with ``plan`` and with ``jax.jit``, comparing every step's
  outputs; returns the pipelined step and its last outputs."""
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER,
                                num_microbatches=num_microbatches, plan=plan)
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for i, batch in enumerate(case.batches[:steps]):
    out_ref, out_par = ref(s_ref, batch), pstep(s_par, batch)
    err = max_rel_err(out_ref, out_par)
    assert err <= RTOL, f"step {i}: {err:.3g}"
    s_ref, s_par = out_ref[0], out_par[0]
  return pstep, out_par


@pytest.mark.parametrize("zero", [0, 3])
def test_interleaved_equals_jit(x64, zero):
  case = zoo.linen("loop")
  L = _num_layers(case)
  assert L >= 4
  groups = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]
  plan = interleaved_plan(L, groups, zero=zero)
  pstep, _ = _train_like_jit(case, plan, num_microbatches=4)
  compiled = pstep.compile(case.state, case.batches[0])
  sched = compiled.schedule
  assert sched.name == "interleaved" and sched.device_groups == (0, 1, 0, 1)
  devs = [tuple(d.id for d in st.mesh.devices.flat) for st in compiled.stages]
  assert devs[0] == devs[2] and devs[1] == devs[3] and not set(devs[0]) & set(devs[1])


def test_shared_devices_need_an_interleaved_schedule():
  cluster = load_cluster(DEMO_CLUSTER)
  groups = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]
  plan = interleaved_plan(8, groups)
  resolved, sched = resolve_plan(plan, cluster, 8, 4)
  assert [s.devices for s in resolved.stages][0] == resolved.stages[2].devices
  assert sched.groups is not None
  # The same stages with explicit shared devices under 1F1B: refused.
  shared = plan.replace(schedule="1f1b", stages=tuple(
      dataclasses.replace(s, devices=r.devices) for s, r in zip(plan.stages, resolved.stages)))
  with pytest.raises(PlanError, match="disjoint"):
    resolve_plan(shared, cluster, 8, 4)
  # Stages of one group that differ: refused, naming them.
  bad = list(plan.stages)
  bad[2] = dataclasses.replace(bad[2], submesh=(1, 1), logical_mesh=(1, 1))
  with pytest.raises(PlanError, match="stages 0 and 2 share device group 0"):
    plan.replace(stages=tuple(bad))
  with pytest.raises(PlanError, match="multiple of 2 stages"):
    harpjax.ManualPlan([((0, 2), "v100", (1, 2)), ((3, 5), "a100", (1, 2)),
                        ((6, 7), "v100", (1, 2))], schedule="interleaved")


@pytest.mark.parametrize("zero,offload", [(0, False),
                                          pytest.param(3, True, marks=pytest.mark.slow)])
def test_parameter_offload_equals_jit(x64, monkeypatch, zero, offload):
  """Six stages on two groups (``v = 3``), every stage's parameters (and, with ``offload``,
  its optimizer state) in host memory: float64 equal to ``jax.jit``; a group holds at most
  two stages' parameters on its devices at any task (the running one's and the prefetched
  next one's), and the new parameters come back in host memory."""
  from harpjax.runtime import interpreter, local
  case = zoo.linen("loop")
  L = _num_layers(case)
  assert L >= 6
  groups = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]
  plan = interleaved_plan(L, groups, zero=zero, schedule="interleaved_v3", v=3)
  plan = plan.with_stages([dataclasses.replace(st, offload_params=True, offload=offload)
                           for st in plan.stages])
  seen = []
  after = interpreter.GroupParams.after

  def record(self, pos):
    after(self, pos)
    seen.append((self.order[pos].stage, self.resident_log[-1]))

  monkeypatch.setattr(interpreter.GroupParams, "after", record)
  # What the devices are asked to run, in order: the stages' tasks and the groups after the
  # pipeline (the optimizer update), as (home stage, group index).
  events = []
  task, run_groups = interpreter.StageRun.task, local._run_groups

  def record_task(self, t):
    events.append(("task", self.s))
    return task(self, t)

  def record_groups(cs, indices, env):
    indices = list(indices)
    events.extend(("update", cs.layout.groups[gi].home) for gi in indices
                  if gi >= cs.layout.num_before)
    return run_groups(cs, indices, env)

  monkeypatch.setattr(interpreter.StageRun, "task", record_task)
  monkeypatch.setattr(local, "_run_groups", record_groups)
  # One step (two where the optimizer state is offloaded too): the second step starts from
  # parameters the first wrote back to host memory.
  pstep, out = _train_like_jit(case, plan, num_microbatches=4, steps=2 if offload else 1)
  assert seen and all(len(r) <= 2 and s in r for s, r in seen)
  # Interleaved optimizer updates: stage 4 (the last on group 0) updates as soon as its last
  # backward is done, before stages 2 and 0 of its group finish theirs.
  tasks = [i for i, e in enumerate(events) if e[0] == "task"]
  first = events[:tasks[6 * 2 * 4 - 1] + 1]   # the first step's tasks, with its updates
  last = {s: max(i for i, e in enumerate(first) if e == ("task", s)) for s in range(6)}
  upd = {s: min((i for i, e in enumerate(first) if e == ("update", s)), default=None)
         for s in range(6)}
  assert upd[4] is not None and upd[4] < last[2] < last[0], (upd, last)
  assert upd[5] is not None and upd[5] < last[1], (upd, last)
  assert max(len(r) for _, r in seen) == 2
  # Stages 0, 2, 4 share group 0: at some task one of them has no parameters on the devices.
  assert any(len({0, 2, 4} & set(r)) < 3 for s, r in seen if s in (0, 2, 4))
  kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(out[0][0])}
  assert kinds == {"pinned_host"}
  compiled = pstep.compile(case.state, case.batches[0])
  assert compiled.layout.host_params == frozenset(range(6))


def test_parameter_offload_needs_device_groups():
  case = zoo.linen("loop")
  L = _num_layers(case)
  groups = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]
  plan = interleaved_plan(L, groups, schedule="1f1b", v=1)
  plan = plan.with_stages([dataclasses.replace(st, offload_params=True) for st in plan.stages])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan)
  with pytest.raises(PlanError, match="offload_params"):
    pstep.compile(case.state, case.batches[0])
