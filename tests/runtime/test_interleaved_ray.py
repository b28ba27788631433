"""Stages that share a device group on the Ray runtime: one actor per group runs its stages in
the group's interleaved order (and the same workers in threads, ``backend="threads"``); training equals ``jax.jit`` in float64 (plain parameters and
ZeRO-3), and a checkpoint of such a run restores onto a new one.

The cases of ``tests/runtime/test_interleaved.py``: the zoo's ``loop`` model on four stages
over two device groups (``v100 (1, 2)`` and ``a100 (1, 2)``, ``v = 2``, ``B = 4``).
"""

import threading

import jax
import pytest

import harpjax
from harpjax.compiler.schedule import StageTask, Task
from harpjax.errors import RuntimeFailure
from harpjax.runtime.worker import GroupTurns
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err
from tests.runtime.test_interleaved import _num_layers, interleaved_plan

RTOL = 1e-10
GROUPS = [("v100", (1, 2), (2, 1)), ("a100", (1, 2), (2, 1))]


def test_group_turns_keep_the_group_order():
  order = [StageTask(0, "F", 0), StageTask(2, "F", 0), StageTask(0, "F", 1),
           StageTask(2, "B", 0)]
  turns = GroupTurns(order, 0)
  ran, errors = [], []

  def stage(s):
    try:
      for t in (t for t in order if t.stage == s):
        turns.wait(1, s, t.task, 30.0)
        ran.append(t)
        turns.done(1)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=stage, args=(s,)) for s in (2, 0)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and ran == order
  # A failed step wakes its waiters with the reason; a later step runs.
  turns.fail("stage 2 failed", 2)
  with pytest.raises(RuntimeFailure, match="stage 2 failed"):
    turns.wait(2, 0, Task("F", 0), 30.0)
  turns.wait(3, 0, Task("F", 0), 30.0)
  with pytest.raises(RuntimeFailure, match="its turn to run F1"):
    turns.wait(3, 0, Task("F", 1), 0.01)


class _Run:
  """A stand-in for a stage's run: counts its parameter fetches and drops."""

  def __init__(self, s, log):
    self.s, self.log, self.params_on_host, self.on = s, log, True, False

  def fetch_params(self):
    self.log.append(("fetch", self.s))
    self.on = True

  def release_params(self):
    self.log.append(("drop", self.s))
    self.on = False

  def params_resident(self):
    return self.on


def test_group_turns_fetch_and_drop_offloaded_parameters():
  """Turns fetch the next stage's parameters as the running one's run starts and drop a
  stage's once the group moves on: at most two stages' on the devices."""
  order = [StageTask(s, "F", 0) for s in (0, 2, 4)] + [StageTask(s, "B", 0) for s in (4, 2, 0)]
  turns = GroupTurns(order, 0)
  log = []
  runs = {s: _Run(s, log) for s in (0, 2, 4)}
  for r in runs.values():
    turns.add_run(1, r, {0, 2, 4})
  for t in order:
    turns.wait(1, t.stage, t.task, 1.0)
    assert runs[t.stage].on and sum(r.on for r in runs.values()) <= 2
    turns.done(1)
  assert log[:3] == [("fetch", 0), ("fetch", 2), ("drop", 0)]
  assert not any(r.on for r in runs.values())


@pytest.fixture(scope="module")
def ray_instance():
  ray = pytest.importorskip("ray")
  from harpjax.runtime import ray_runtime
  hosts = [h.name for h in harpjax.Cluster.load(DEMO_CLUSTER).hosts]
  ray_runtime.init_ray(num_cpus=4, resources={ray_runtime.HOST_RESOURCE_PREFIX + h: 100
                                               for h in hosts})
  yield ray_runtime
  ray_runtime.release_pool()
  ray.shutdown()


def _check_group_order(runner):
  """Each device group ran its tasks one at a time, in the schedule's group order."""
  sched, last = runner.program.schedule, runner.last
  for g, order in enumerate(sched.groups):
    ran = sorted((a, b, StageTask(s, k, m)) for s in range(sched.num_stages)
                 if sched.device_groups[s] == g for k, m, a, b in last.tasks[s])
    assert [t for _, _, t in ran] == list(order)
    assert all(ran[i][1] <= ran[i + 1][0] for i in range(len(ran) - 1))


def _two_steps_equal_jit(case, pstep, ray_instance):
  """Two steps of ``pstep`` from the case's state equal ``jax.jit``'s to :data:`RTOL`."""
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for i, batch in enumerate(case.batches[:2]):
    out_ref, out_par = ref(s_ref, batch), pstep(s_par, batch)
    err = max_rel_err(out_ref, ray_instance.gather(out_par))
    assert err <= RTOL, f"step {i}: {err:.3g}"
    s_ref, s_par = out_ref[0], out_par[0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
@pytest.mark.parametrize("backend,zero", [("ray", 0), ("ray", 3), ("threads", 0)])
def test_interleaved_on_ray_equals_jit(x64, ray_instance, backend, zero):
  case = zoo.linen("loop")
  plan = interleaved_plan(_num_layers(case), GROUPS, zero=zero)
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                runtime=harpjax.RayRuntime(backend=backend))
  _two_steps_equal_jit(case, pstep, ray_instance)
  runner = pstep.runner(case.state, case.batches[0])
  assert runner.device_groups == ((0, 2), (1, 3))
  if backend == "ray":   # one process per device group; between groups, TCP
    pids = [info["pid"] for info in runner.infos]
    assert pids[0] == pids[2] and pids[1] == pids[3] and pids[0] != pids[1]
    for (a, b), route in runner.routes.items():
      assert (route.transport == "local") == (a % 2 == b % 2), (a, b, route)
  # Within a group, no send: messages go to the other stage's mailbox in the process.
  assert not any(d % 2 == s % 2 for s, sends in enumerate(runner.last.sends)
                 for d, *_ in sends)
  _check_group_order(runner)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
@pytest.mark.parametrize("backend", ["ray", "threads"])
def test_parameter_offload_on_ray_equals_jit(x64, ray_instance, backend):
  """Six stages on two groups (``v = 3``), parameters and optimizer state in host memory:
  float64 equal to ``jax.jit``, each group in its order."""
  import dataclasses
  case = zoo.linen("loop")
  plan = interleaved_plan(_num_layers(case), GROUPS, schedule="interleaved_v3", v=3)
  plan = plan.with_stages([dataclasses.replace(st, offload_params=True, offload=True)
                           for st in plan.stages])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                runtime=harpjax.RayRuntime(backend=backend))
  _two_steps_equal_jit(case, pstep, ray_instance)
  _check_group_order(pstep.runner(case.state, case.batches[0]))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
def test_interleaved_on_ray_checkpoint_restores(x64, ray_instance, tmp_path):
  case = zoo.linen("loop")
  plan = interleaved_plan(_num_layers(case), GROUPS)
  kw = dict(cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan, runtime=harpjax.RayRuntime(),
            checkpoint=harpjax.CheckpointOptions(str(tmp_path / "ck"), every=1,
                                                 asynchronous=False))
  ref = jax.jit(case.step)
  first = harpjax.auto_parallel(case.step, **kw)
  first(case.state, case.batches[0])
  assert first.checkpointer.steps() == [1]
  first.runner(case.state, case.batches[0]).shutdown()
  second = harpjax.auto_parallel(case.step, **kw)   # a new run: new actors
  state = second.restore(like=case.state)
  assert second.steps_done == 1
  out = second(state, case.batches[1])
  expect = ref(ref(case.state, case.batches[0])[0], case.batches[1])
  assert max_rel_err(expect, ray_instance.gather(out)) <= RTOL


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
def test_device_group_over_several_hosts_is_refused(ray_instance):
  # Actors pinned to hosts run a stage spanning hosts as one SPMD program over a process per
  # host; a device group's stages share one process: refused, naming the stages and hosts.
  from harpjax.errors import UnsupportedError
  case = zoo.linen("loop")
  plan = interleaved_plan(_num_layers(case), [("v100", (1, 4), (4, 1)),
                                              ("a100", (2, 2), (4, 1))])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                runtime=harpjax.RayRuntime())
  with pytest.raises(UnsupportedError, match=r"stages \[1, 3\] share a device group that "
                                             r"spans the hosts"):
    pstep(case.state, case.batches[0])
