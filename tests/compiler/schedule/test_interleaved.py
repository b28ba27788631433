"""The interleaved 1F1B schedule: its task table against a hand-written case, the simulator
against a brute-force fixed point of the event equations, and a plan priced by evaluate_plan."""

import dataclasses

import numpy as np
import pytest

from harpjax.compiler import schedule as sc
from harpjax.compiler.plan import evaluate_plan, ManualPlan
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import sim_kernel
from harpjax.errors import PlanError, ScheduleError

# d = 2 groups, v = 2 chunks, B = 4, written out from Megatron's rule by hand: group g warms
# up with 2 (d - 1 - g) + (v - 1) d forwards, in blocks of d microbatches per chunk.
HAND = """
group 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
group 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
"""


def _parse_groups(text):
  return tuple(tuple(sc.StageTask.parse(t) for t in line.split(":")[1].split())
               for line in text.strip().splitlines())


def test_task_table_matches_hand_written_case():
  s = sc.make_schedule("interleaved", 4, 4)
  assert s.groups == _parse_groups(HAND)
  assert s.device_groups == (0, 1, 0, 1)
  assert s.warmups == s.table_warmups() == (4, 3, 2, 1)
  assert sc.schedule_kind("interleaved").inflight(4, 4, s.warmups) == (4, 3, 2, 1)
  assert sc.Schedule.from_json(s.to_json()) == s


def test_one_chunk_alternates_after_megatrons_warmup():
  """``v = 1``: ``2 (d - 1 - g)`` warm-up forwards, then one forward and one backward
  alternately (so ``2 (d - 1 - g) + 1`` forwards before the first backward)."""
  assert sc.table_warmups(sc.interleaved_tables(3, 6, 1)) == (5, 3, 1)


@pytest.mark.parametrize("d,v", [(1, 2), (2, 2), (3, 2), (2, 3), (4, 2), (3, 4)])
def test_every_multiple_of_d_is_deadlock_free(d, v):
  for B in (d, 2 * d, 3 * d):
    s = sc.make_schedule(sc.interleaved_kind(v), d * v, B)
    assert len(sc.dry_run_groups(s.groups)) == 2 * d * v * B


def test_refusals():
  with pytest.raises(ScheduleError, match="multiple of 2 stages"):
    sc.make_schedule("interleaved", 3, 4)
  with pytest.raises(ScheduleError, match="multiple of 4"):
    sc.make_schedule("interleaved_v3", 12, 5)
  bad = list(_parse_groups(HAND))
  bad[1] = bad[1][1:] + bad[1][:1]   # group 1 starts with 1F1: F1 before F0 is fine, but ...
  with pytest.raises(ScheduleError):
    sc.Schedule("custom", sc.tables_from_groups(tuple(bad), 4), 4, groups=tuple(bad))


def brute_force(groups, fwd, bwd, cf, cb, device_groups, ends=None):
  """The event equations solved by iterating them to their fixed point: a task starts when
  its group's previous task ended and its input arrived; a message on a channel starts when
  its producer ended and the channel's previous message (in the producer's order) arrived.
  ``ends``: per stage, the seconds its update holds its group right after its last task."""
  G, S, B = len(groups), fwd.shape[0], fwd.shape[1]
  ends = np.zeros(S) if ends is None else ends
  chan_f, chan_b, _ = sim_kernel.group_channels(device_groups)
  end = {}           # (stage, kind, m) -> end
  arrive = {}        # (kind, stage, m) -> input arrival at stage
  updated = {}       # stage -> end of its update
  for _ in range(10 * G * len(groups[0])):
    old = dict(end)
    for row in groups:
      prev = 0.0
      lastpos = {t.stage: p for p, t in enumerate(row)}
      for p, t in enumerate(row):
        k = 0 if t.kind == "F" else 1
        ready = 0.0 if (k == 0 and t.stage == 0) else arrive.get((k, t.stage, t.microbatch),
                                                                 np.inf)
        st = max(prev, ready)
        prev = st + (fwd if k == 0 else bwd)[t.stage, t.microbatch]
        end[(t.stage, k, t.microbatch)] = prev
        if lastpos[t.stage] == p:
          prev += ends[t.stage]
          updated[t.stage] = prev
    chan_last = {}
    for row in groups:   # messages in each producer's order
      for t in row:
        s, k, m = t.stage, 0 if t.kind == "F" else 1, t.microbatch
        e = end[(s, k, m)]
        if k == 0 and s == S - 1:
          arrive[(1, s, m)] = e
          continue
        if k == 1 and s == 0:
          continue
        link, c = (s, chan_f[s]) if k == 0 else (s - 1, chan_b[s - 1])
        if c >= 0:
          e = max(e, chan_last.get(c, 0.0)) + (cf if k == 0 else cb)[link, m]
          chan_last[c] = e
        arrive[(0, s + 1, m) if k == 0 else (1, s - 1, m)] = e
    if end == old:
      break
  return max(max(end.values()), max(updated.values()))


@pytest.mark.parametrize("seed", range(6))
def test_simulator_equals_brute_force(seed):
  rng = np.random.default_rng(seed)
  d, v = [(2, 2), (3, 2), (2, 3), (4, 2), (2, 2), (3, 3)][seed]
  S, B = d * v, d * int(rng.integers(1, 4))
  s = sc.make_schedule(sc.interleaved_kind(v), S, B)
  f = rng.uniform(0.5, 2.0, (S, B))
  b = rng.uniform(1.0, 3.0, (S, B))
  c = rng.uniform(0.0, 2.5, (S - 1, B))
  cb = rng.uniform(0.0, 2.5, (S - 1, B))
  ends = rng.uniform(0.0, 3.0, S) * (seed % 2)   # odd seeds: interleaved updates
  want = brute_force(s.groups, f, b, c, cb, s.device_groups, ends)
  for backend in ("numba", "python", "reference"):
    r = sc.simulate(f, b, schedule=s, comm_fwd=c, comm_bwd=cb, backend=backend,
                    end_cost=ends)
    assert r.iteration_time == pytest.approx(want, rel=1e-12), backend
    # Each group computes one task at a time.
    for g in range(d):
      mine = [x for x in range(S) if s.device_groups[x] == g]
      iv = sorted(zip(r.task_start[mine].ravel(), r.task_end[mine].ravel()))
      assert all(a[1] <= b_[0] + 1e-12 for a, b_ in zip(iv, iv[1:]))


def test_groups_of_one_stage_equal_the_stage_simulator():
  rng = np.random.default_rng(7)
  plain = sc.make_schedule("h1f1b", 4, 6, (5, 3, 2, 1))
  groups = tuple(tuple(sc.StageTask(x, t.kind, t.microbatch) for t in row)
                 for x, row in enumerate(plain.tables))
  grouped = sc.Schedule("custom", plain.tables, 6, groups=groups)
  f, b, c = rng.uniform(0.5, 2, (4, 6)), rng.uniform(1, 3, (4, 6)), rng.uniform(0, 2, (3, 6))
  want = sc.simulate(f, b, c, plain)
  got = sc.simulate(f, b, c, grouped)
  np.testing.assert_allclose(got.task_start, want.task_start, rtol=1e-12)
  assert got.iteration_time == pytest.approx(want.iteration_time, rel=1e-12)


def test_interleaving_shrinks_the_bubble():
  """Zero-cost links: 1F1B on d stages of the groups' whole work takes (B + d - 1) T; the
  interleaved schedule on v chunks each a v-th of it, (B + (d - 1) / v) T."""
  d, v, B, T = 4, 2, 8, 3.0
  one = sc.simulate(T / 3, 2 * T / 3, 0.0, "1f1b", num_microbatches=B,
                    comm_fwd=[0.0] * (d - 1))
  s = sc.make_schedule("interleaved", d * v, B)
  inter = sc.simulate(T / 3 / v, 2 * T / 3 / v, 0.0, s)
  assert one.iteration_time == pytest.approx((B + d - 1) * T)
  assert inter.iteration_time == pytest.approx((B + (d - 1) / v) * T)


def test_interleaved_updates_overlap_the_drain():
  """HAND's group 0 ends ``2B2 2B3 0B2 0B3``; with 0.5 s links ``0B2`` waits for ``1B2``'s
  gradient from group 1 (2/3 s): stage 2's update, right after ``2B3``, hides in that wait
  (the iteration does not grow), where an update after the group's last task would add its
  whole time. Stage 0's, after the group's last task, adds all of its."""
  s = sc.make_schedule("interleaved", 4, 4)
  f, b = np.full((4, 4), 1 / 3), np.full((4, 4), 2 / 3)
  r = sc.simulate(f, b, 0.5, s)
  base = r.iteration_time
  g0 = [t for t in s.groups[0]]
  assert str(g0[sc.update_positions(g0)[2]]) == "2B3"
  wait = r.task_start[0, 2 * 4 - 2] - r.task_end[2, 2 * 4 - 1]   # before 0B2, after 2B3
  assert wait == pytest.approx(2 / 3)
  u = 0.5
  hidden = sc.simulate(f, b, 0.5, s, end_cost=[0.0, 0.0, u, 0.0])
  assert hidden.iteration_time == pytest.approx(base, rel=1e-12)
  assert hidden.update_time[2] == u
  last = sc.simulate(f, b, 0.5, s, end_cost=[u, 0.0, 0.0, 0.0])
  assert last.iteration_time == pytest.approx(base + u, rel=1e-12)


def test_update_memory_counts_the_residuals_still_held():
  """An interleaved update runs beside the residuals its group still holds: stage 2's, right
  after ``2B3`` (HAND), beside stage 0's microbatches 2 and 3."""
  s = sc.make_schedule("interleaved", 4, 4)
  after = sc.activations_after(s.groups[0], [1.0, 0.0, 1.0, 0.0])
  assert after[sc.update_positions(s.groups[0])[2]] == 2.0
  assert after[-1] == 0.0
  tables = _tables()
  tables = dataclasses.replace(tables, step_mem_bytes=tuple(
      np.full_like(p, 4.5) for p in tables.param_mem_bytes))
  plan = ManualPlan([((2 * x, 2 * x + 1), "c0", (1, 2)) for x in range(4)],
                    schedule="interleaved")
  ev = evaluate_plan(tables, plan, 4)
  # Group 0: stage 2's update (4.5) beside stage 0's state (2) and its microbatches 2, 3 (1
  # each) is 8.5, under the pipeline's 9; group 1 (pipeline 7): stage 3's update after 3B3
  # beside stage 1's state and its microbatches 2, 3 is 8.5 (after the pipeline: 6.5).
  assert [st.peak_mem_bytes for st in ev.stages] == [9.0, 8.5, 9.0, 8.5]


def _tables(L=8):
  """One subcluster, 1 host x 4 devices, submeshes (1,1), (1,2), (1,4); each layer 1 s on one
  device, parameters 1 byte per layer, activations 0.5 bytes per layer per microbatch."""
  shapes = ((1, 1), (1, 2), (1, 4))
  t = np.full((L, L, 3), np.inf)
  p, a = np.zeros((L, L, 3)), np.zeros((L, L, 3))
  for i in range(L):
    for j in range(i, L):
      for s, (n, m) in enumerate(shapes):
        t[i, j, s] = (j - i + 1) / (n * m)
        p[i, j, s] = float(j - i + 1)
        a[i, j, s] = 0.5 * (j - i + 1)
  return CostTables(num_layers=L, subcluster_names=("c0",), num_hosts=(1,),
                    devices_per_host=(4,), device_memory_bytes=(8.0,), submeshes=(shapes,),
                    stage_time_s=(t,), param_mem_bytes=(p,), act_mem_bytes=(a,),
                    boundary_bytes=np.zeros(L), intra_bandwidth_bytes_per_s=(1e12,),
                    intra_latency_s=(0.0,), inter_bandwidth_bytes_per_s=(),
                    inter_latency_s=())


def test_evaluate_plan_prices_groups():
  tables, B = _tables(), 4
  plan = ManualPlan([((2 * x, 2 * x + 1), "c0", (1, 2)) for x in range(4)],
                    schedule="interleaved")
  ev = evaluate_plan(tables, plan, B)
  s = sc.make_schedule("interleaved", 4, B)
  want = sc.simulate([1 / 3] * 4, [2 / 3] * 4, 0.0, s).iteration_time
  assert ev.iteration_s == pytest.approx(want, rel=1e-9) and ev.model == "simulator"
  assert ev.t_max_s == pytest.approx(2.0)           # a group computes both its chunks
  assert ev.num_devices == 4 and ev.devices_ok and ev.uses_all_devices
  # Memory: a group holds both chunks' parameters (2 + 2 bytes) and the most activation
  # bytes its order holds at once (1 byte per in-flight microbatch of either chunk): counted
  # by hand from HAND, 5 microbatches on group 0 (after 0F2), 3 on group 1.
  held = sc.group_activation_peaks(s.groups, [1.0] * 4)
  assert held == (5.0, 3.0)
  assert [st.peak_mem_bytes for st in ev.stages] == [9.0, 7.0, 9.0, 7.0]
  assert not ev.mem_ok and "device group 0" in " ".join(ev.violations)
  assert "device group 1" not in " ".join(ev.violations)
  # The same stages on four devices groups of their own (1F1B): every stage on 2 devices
  # would need 8 devices.
  assert not evaluate_plan(tables, plan.replace(schedule="1f1b"), B).devices_ok
  with pytest.raises(PlanError, match="share device group"):
    ManualPlan([((0, 1), "c0", (1, 2)), ((2, 3), "c0", (1, 2)), ((4, 5), "c0", (1, 1)),
                ((6, 7), "c0", (1, 2))], schedule="interleaved")


# --------------------------------------------------------------------------- parameter offload


def test_chunk_residency_keeps_the_running_and_the_next_stage():
  from harpjax.compiler.schedule import chunk_residency, interleaved_group_tables
  for d, v, B in [(2, 3, 4), (3, 4, 6), (1, 3, 2), (2, 2, 4)]:
    for order in interleaved_group_tables(d, v, B):
      stages = sorted({t.stage for t in order})
      res = chunk_residency(order, stages)
      on: set = set()
      for i, t in enumerate(order):
        on |= set(res.fetch[i])
        assert on == res.resident[i] and t.stage in on and len(on) <= 2
        nxt = next((u.stage for u in order[i + 1:] if u.stage != t.stage), None)
        assert nxt is None or nxt in on   # the next stage is already on its way
        on -= set(res.release[i])
      assert not on
      # Brute force: each fetch is due at the first later task of its stage.
      for i, (fs, js) in enumerate(zip(res.fetch, res.needed_at)):
        for s, j in zip(fs, js):
          assert j == next(k for k in range(i, len(order)) if order[k].stage == s)
  # Only offloaded stages move: stage 2 stays.
  order = interleaved_group_tables(2, 3, 4)[0]
  res = chunk_residency(order, [0, 4])
  assert all(2 not in r for r in res.resident)


def test_prefetch_stalls_show_only_the_excess():
  from harpjax.compiler.schedule import StageTask, chunk_residency, prefetch_stalls
  order = [StageTask(0, "F", 0), StageTask(0, "F", 1), StageTask(2, "F", 0),
           StageTask(2, "F", 1)]
  res = chunk_residency(order, [0, 2])
  # Stage 0's fetch (1 s) is not hidden; stage 2's (3 s) starts after it, overlaps the two
  # 1-s tasks of stage 0 and leaves 1 s.
  assert list(prefetch_stalls(order, res, [1.0] * 4, {0: 1.0, 2: 3.0})) == [1.0, 0, 1.0, 0]
  assert list(prefetch_stalls(order, res, [5.0] * 4, {0: 1.0, 2: 3.0})) == [1.0, 0, 0, 0]
