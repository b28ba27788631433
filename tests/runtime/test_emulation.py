"""Emulated GPUs and links: the numbers, and measured runs against the simulator."""

import dataclasses

import numpy as np
import pytest

import harpjax
from harpjax.cluster import Link
from harpjax.compiler import schedule as schedules
from harpjax.errors import OptionConflictError, OptionsError, PlanError
from harpjax.runtime.emulation import Emulation, annotate_plan
from benchmarks import runtime as bench

PLAN = harpjax.ManualPlan([
    harpjax.StageSpec((0, 0), "v100", (1, 2), devices=(0, 1), time_s=0.06),
    harpjax.StageSpec((1, 1), "a100", (1, 2), devices=(4, 5), time_s=0.03),
    harpjax.StageSpec((2, 3), "a100", (1, 2), devices=(6, 7), time_s=0.045)])


def test_times_from_the_plan_and_links_from_the_cluster():
  cluster = bench.make_cluster(2.0)
  hosts = ["v100-0", "a100-0", "a100-1"]
  emu = Emulation(time_scale=0.5, bytes_scale=10).resolve(PLAN, cluster, hosts)
  np.testing.assert_allclose(emu.fwd_s, [0.02, 0.01, 0.015])
  np.testing.assert_allclose(emu.bwd_s, [0.04, 0.02, 0.03])
  assert emu.compute_s(0, "B") == pytest.approx(0.02)          # scaled
  eth = cluster.link_between_hosts("v100-0", "a100-0")
  ib = cluster.link_between_hosts("a100-0", "a100-1")
  assert emu.link_map[(0, 1)] == eth
  assert emu.link_map[(2, 1)] == ib
  nbytes = 1e6
  assert emu.transfer_s(0, 1, nbytes) == pytest.approx(
      0.5 * (eth.latency_s + 10 * nbytes / eth.bandwidth_bytes_per_s))
  # An explicit link replaces the cluster's for that direction only.
  emu2 = Emulation(fwd_s=(1, 1, 1), bwd_s=(2, 2, 2), links={(0, 1): Link.from_gbps(1, 100)})
  emu2 = emu2.resolve(PLAN, cluster, hosts)
  assert emu2.transfer_s(0, 1, 125e6) == pytest.approx(1.0001)
  assert emu2.link_map[(1, 0)].bandwidth_bytes_per_s == eth.bandwidth_bytes_per_s


def test_bad_emulations():
  bare = PLAN.with_stages([dataclasses.replace(s, time_s=None) for s in PLAN.stages])
  with pytest.raises(PlanError, match=r"stages \[0, 1, 2\] have no StageSpec.time_s"):
    Emulation().resolve(bare)
  with pytest.raises(OptionsError, match="both fwd_s and bwd_s"):
    Emulation(fwd_s=(1.0,))
  with pytest.raises(OptionsError, match="time_scale"):
    Emulation(time_scale=0)
  with pytest.raises(OptionConflictError, match="times for 2 stages"):
    Emulation(fwd_s=(1, 1), bwd_s=(1, 1)).resolve(PLAN)


def test_simulate_gets_the_emulated_numbers():
  emu = Emulation(fwd_s=(0.01, 0.02, 0.01), bwd_s=(0.02, 0.04, 0.02), time_scale=2.0,
                  links={(0, 1): Link(1e6, 0.001), (1, 0): Link(2e6, 0.0),
                         (1, 2): Link(1e9), (2, 1): Link(1e9)}).resolve(PLAN)
  sch = schedules.make_schedule("h1f1b", 3, 6, (4, 2, 1))
  got = emu.simulate(sch, act_bytes=[10_000, 20_000], ct_bytes=[10_000, 20_000])
  want = schedules.simulate([0.02, 0.04, 0.02], [0.04, 0.08, 0.04], schedule=sch,
                            comm_fwd=[2 * 0.011, 2 * 20_000 / 1e9],
                            comm_bwd=[2 * 0.005, 2 * 20_000 / 1e9])
  assert got.iteration_time == pytest.approx(want.iteration_time)
  np.testing.assert_allclose(got.task_end, want.task_end)


def test_annotated_plan_gives_h1f1b_the_emulated_link():
  cluster = bench.make_cluster(1.0)
  state, batch = bench.make_state_and_batch()
  probe = harpjax.auto_parallel(bench.make_step(), cluster=cluster, plan=PLAN,
                                num_microbatches=8)
  layers = probe.trace(state, batch).layers
  act = layers[0].boundary_bytes
  emu = Emulation(bytes_scale=2**20 / act)               # 1 MiB per microbatch
  plan = annotate_plan(PLAN, layers, cluster, emu)
  eth = cluster.link_between_hosts("v100-0", "a100-0")
  assert plan.stages[0].comm_s == pytest.approx(eth.transfer_time_s(2**20))
  assert plan.stages[2].comm_s is None and plan.stages[1].time_s == pytest.approx(0.03)
  t_max = max(s.time_s for s in plan.stages)
  warm = schedules.h1f1b_warmups([s.comm_s for s in plan.stages[:-1]], t_max, 0.1)
  step = harpjax.auto_parallel(bench.make_step(), cluster=cluster,
                               plan=plan.replace(schedule="h1f1b"), num_microbatches=8)
  # The slow link earns extra warm-ups.
  assert step.plan(state, batch).warmups == warm and warm[0] > 3


def _follows_the_schedule(name, r):
  """Every worker ran its tasks in the order of the schedule the simulator scored, and every
  activation and gradient crossed its link once per microbatch, in microbatch order: what an
  emulated run must do however loaded the machine is (how close its wall seconds come to the
  simulated ones is a measurement: ``python benchmarks/runtime.py fidelity``)."""
  from harpjax.runtime.interpreter import ACT, CT
  last, sim = r["last"], r["sim"]
  tables = sim.schedule.tables
  assert len(last.tasks) == len(tables)
  for s, (ran, table) in enumerate(zip(last.tasks, tables)):
    assert [(k, m) for k, m, _, _ in ran] == [(t.kind, t.microbatch) for t in table], (name, s)
  b = sim.schedule.num_microbatches
  for s, sends in enumerate(last.sends):
    acts = [key.index for dst, key, *_ in sends if key.kind == ACT and dst == s + 1]
    cts = [key.index for dst, key, *_ in sends if key.kind == CT and dst == s - 1]
    assert acts == (list(range(b)) if s + 1 < len(tables) else []), (name, s)
    assert cts == (list(range(b)) if s > 0 else []), (name, s)


def test_emulated_threads_run_follows_the_simulated_schedule():
  # The stage workers in threads of this process (no Ray): quick, and the same protocol.
  r = bench.fidelity_case("h1f1b", 2.5, backend="threads", steps=1, time_scale=0.25)
  _follows_the_schedule("h1f1b", r)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
def test_ray_emulated_runs_follow_the_simulated_schedule():
  # A 3-stage plan over two emulated subclusters with a 2.5 Gbps link between them, on Ray
  # actors. What is checked does not depend on the machine's speed or load: every worker runs
  # its tasks in the order of the schedule the simulator scores, and every activation and
  # gradient crosses its link once per microbatch, in microbatch order. How close the measured
  # wall seconds come to the simulated ones is a measurement, not a test:
  # ``python benchmarks/runtime.py fidelity --backend ray`` prints it side by side.
  pytest.importorskip("ray")
  from harpjax.runtime import ray_runtime

  ray_runtime.init_ray(num_cpus=4)
  try:
    res = {s: bench.fidelity_case(s, 2.5, backend="ray", steps=1, time_scale=0.25)
           for s in ("1f1b", "h1f1b")}
  finally:
    ray_runtime.release_pool()
    ray_runtime.ray.shutdown()
  for name, r in res.items():
    _follows_the_schedule(name, r)
  # H-1F1B earns extra warm-ups on the slow link where 1F1B keeps S - 1 - s.
  assert res["h1f1b"]["warmups"][0] > res["1f1b"]["warmups"][0]
