"""The pipeline simulator: kernels against their twins, semantics on hand-checked cases,
breakdown bookkeeping, timeline files and the CLI."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from harpjax.compiler.schedule import timeline
from harpjax.cli.simulate import command as simulate_cmd
from harpjax.compiler.schedule import sim_kernel as _sim_kernel
from harpjax.compiler import schedule as sched
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.schedule import simulate
from harpjax.errors import CostTablesError, ScheduleError


def random_valid_tables(rng, S, B):
  """A random deadlock-free table: a random zero-time execution where each step runs any
  ready task (forwards in any microbatch order, backwards of any forwarded microbatch whose
  gradient arrived). Covers GPipe, 1F1B-like and stranger orders other libraries produce."""
  tables = [[] for _ in range(S)]
  done_f = [set() for _ in range(S)]
  done_b = [set() for _ in range(S)]
  while any(len(t) < 2 * B for t in tables):
    s = int(rng.integers(S))
    ready = [("F", m) for m in range(B) if m not in done_f[s] and (s == 0 or m in done_f[s - 1])]
    ready += [("B", m) for m in done_f[s] if m not in done_b[s]
              and (m in done_f[s] if s == S - 1 else m in done_b[s + 1])]
    if not ready:
      continue
    kind, m = ready[int(rng.integers(len(ready)))]
    (done_f if kind == "F" else done_b)[s].add(m)
    tables[s].append(sched.Task(kind, m))
  return tuple(tuple(r) for r in tables)


def _random_costs(rng, S, B):
  f = rng.uniform(0, 2, (S, B)) * (rng.random((S, B)) > 0.05)
  b = rng.uniform(0, 3, (S, B)) * (rng.random((S, B)) > 0.05)
  links = max(S - 1, 1)
  cf = rng.uniform(0, 3, (links, B)) * (rng.random((links, B)) > 0.2)
  cb = rng.uniform(0, 3, (links, B)) * (rng.random((links, B)) > 0.2)
  return f, b, cf, cb


# --------------------------------------------------------------------------- kernels


def test_kernel_matches_python_twin_and_event_simulation():
  rng = np.random.default_rng(1)
  for trial in range(120):
    S, B = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    tables = random_valid_tables(rng, S, B) if trial % 2 else \
        sched.make_schedule("h1f1b", S, B, tuple(range(S + trial % 3, trial % 3, -1))).tables
    kinds, mbs = sched.tables_to_arrays(tables)
    f, b, cf, cb = _random_costs(rng, S, B)
    outs = [_sim_kernel.simulate_kernel(kinds, mbs, f, b, cf, cb),
            _sim_kernel.simulate_python(kinds, mbs, f, b, cf, cb),
            _sim_kernel.simulate_reference(kinds, mbs, f, b, cf, cb)]
    for out in outs[1:]:
      assert out[0] == outs[0][0] == 0
      for a, r in zip(outs[0][1:5], out[1:5]):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-12)


def test_kernel_reports_deadlock_positions():
  tables = sched.parse_tables("stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B0 B1")
  kinds, mbs = sched.tables_to_arrays(tables)
  z = np.zeros((2, 2))
  for fn in (_sim_kernel.simulate_kernel, _sim_kernel.simulate_reference):
    status, *_, stuck = fn(kinds, mbs, z, z, z[:1], z[:1])
    assert status == 1 and list(stuck) == [1, 1]


# --------------------------------------------------------------------------- semantics


def test_two_stage_1f1b_by_hand():
  # f = 1, b = 2, c = 0.5 both ways, B = 3, 1F1B:
  #   stage 0: F0 F1 B0 F2 B1 B2      stage 1: F0 B0 F1 B1 F2 B2
  r = simulate([1, 1], [2, 2], 0.5, "1f1b", num_microbatches=3)
  np.testing.assert_allclose(r.f_start, [[0, 1, 7], [1.5, 4.5, 8.5]])
  np.testing.assert_allclose(r.b_start, [[5, 8, 12], [2.5, 5.5, 9.5]])
  np.testing.assert_allclose(r.msg_start[0, 0], [1, 2, 8])         # activations
  np.testing.assert_allclose(r.msg_start[1, 0], [4.5, 7.5, 11.5])  # gradients
  assert r.iteration_time == 14
  # Stage 1 waits 1 s for F2's activation inside its steady phase [2.5, 9.5).
  assert r.bubble.tolist() == [0.0, 1.0]
  assert r.phase_bounds.tolist() == [[0, 5, 8, 14], [0, 2.5, 9.5, 14]]
  assert r.compute_time.tolist() == [[2, 3, 4], [1, 6, 2]]
  # The gap [7.5, 8.5) is B1's gradient leaving, then F2's activation arriving.
  assert r.comm_time[1, 1] == 1.0 and r.idle_time[1, 1] == 0.0


def test_fifo_links_queue_messages_in_send_order():
  # Stage 0 sends three activations 0.1 s apart over a 1 s link: they queue.
  r = simulate([0.1, 0.1], [0.1, 0.1], 1.0, "gpipe", num_microbatches=3)
  np.testing.assert_allclose(r.msg_start[0, 0], [0.1, 1.1, 2.1])
  np.testing.assert_allclose(r.msg_end[0, 0], [1.1, 2.1, 3.1])
  np.testing.assert_allclose(r.f_start[1], [1.1, 2.1, 3.1])


def test_directions_are_independent_full_duplex():
  r = simulate([1, 1], [1, 1], 0.0, "1f1b", num_microbatches=6, comm_fwd=0.7, comm_bwd=0.3)
  np.testing.assert_allclose(r.msg_end[0] - r.msg_start[0], 0.7)
  np.testing.assert_allclose(r.msg_end[1] - r.msg_start[1], 0.3)
  both = simulate([1, 1], [1, 1], 0.5, "1f1b", num_microbatches=6)
  assert r.iteration_time == pytest.approx(both.iteration_time)  # only the sum matters here


def test_single_stage_and_end_costs():
  r = simulate([1.0], [2.0], None, "1f1b", num_microbatches=4, end_cost=0.5)
  assert r.iteration_time == 12.5 and r.update_time.tolist() == [0.5]
  assert r.compute_time.sum() == 12.0 and r.bubble.tolist() == [0.0]
  r = simulate([1, 1, 1], [1, 1, 1], 0, "1f1b", num_microbatches=4, end_cost=[5, 0, 0])
  base = simulate([1, 1, 1], [1, 1, 1], 0, "1f1b", num_microbatches=4)
  # Stage 0 ends last anyway; its update extends the iteration by exactly its length.
  assert r.iteration_time == pytest.approx(base.iteration_time + 5)
  assert [e for e in r.events() if e.kind == "U"][0].start_s == base.iteration_time


def test_iteration_times_kernel_equals_simulate_bit_for_bit():
  """The planner's batch kernel: the same iteration time as simulate(), to the last bit, with
  end costs and any 1F1B-style warm-ups, in one call for pipelines of different lengths."""
  rng = np.random.default_rng(3)
  rows = []
  for _ in range(200):
    S, B = int(rng.integers(1, 7)), int(rng.choice([1, 2, 3, 8, 32]))
    t = rng.uniform(0.1, 2, S)
    c = rng.uniform(0, 2, S) * (rng.random(S) > 0.2)
    e = rng.uniform(0, 1, S) * (rng.random() < 0.5)
    w = np.sort(rng.integers(1, 2 * S + 2, S))[::-1]
    f = [x * (1.0 / 3.0) for x in t]
    bwd = [x - y for x, y in zip(t, f)]
    tables = sched.make_schedule("h1f1b", S, B, tuple(int(x) for x in w))
    ref = simulate(f, bwd, list(c[:-1]), tables, end_cost=e).iteration_time
    rows.append((S, B, t, c, e, w, ref))
  for B in {r[1] for r in rows}:
    mine = [r for r in rows if r[1] == B]
    S_max = max(r[0] for r in mine)
    pad = lambda x, S, v=0.0: np.concatenate([x, np.full(S_max - S, v)])
    got = sched.iteration_times([pad(r[2], r[0]) for r in mine], [pad(r[3], r[0]) for r in mine],
                                [pad(r[4], r[0]) for r in mine],
                                [pad(r[5], r[0], 1).astype(int) for r in mine],
                                [r[0] for r in mine], B)
    assert got.tolist() == [r[6] for r in mine]


def test_per_microbatch_times():
  f = np.array([[1.0, 2.0, 3.0]])
  r = simulate(f, f, None, "1f1b", num_microbatches=3)
  assert r.iteration_time == 12.0
  np.testing.assert_allclose(r.f_end - r.f_start, f)


@given(seed=st.integers(0, 10_000))
def test_longer_durations_never_start_anything_earlier(seed):
  """Max-plus monotonicity: the DAG is fixed, so raising any duration can only delay."""
  rng = np.random.default_rng(seed)
  S, B = int(rng.integers(1, 5)), int(rng.integers(1, 7))
  tables = random_valid_tables(rng, S, B)
  f, b, cf, cb = _random_costs(rng, S, B)
  r0 = simulate(f, b, None, tables, comm_fwd=cf[:S - 1], comm_bwd=cb[:S - 1])
  bump = lambda x: x + rng.uniform(0, 1, x.shape) * (rng.random(x.shape) < 0.3)
  r1 = simulate(bump(f), bump(b), None, tables, comm_fwd=bump(cf[:S - 1]),
                comm_bwd=bump(cb[:S - 1]))
  assert np.all(r1.task_start >= r0.task_start - 1e-12)
  assert r1.iteration_time >= r0.iteration_time - 1e-12


# --------------------------------------------------------------------------- bookkeeping


@given(seed=st.integers(0, 10_000), name=st.sampled_from(sched.SCHEDULE_NAMES + ("random",)))
def test_breakdown_adds_up(seed, name):
  rng = np.random.default_rng(seed)
  S, B = int(rng.integers(1, 6)), int(rng.integers(1, 10))
  f, b, cf, cb = _random_costs(rng, S, B)
  schedule = random_valid_tables(rng, S, B) if name == "random" else name
  end = rng.uniform(0, 1, S)
  r = simulate(f, b, None, schedule, num_microbatches=B, comm_fwd=cf[:S - 1],
               comm_bwd=cb[:S - 1], end_cost=end, eps=0.0)
  T = r.iteration_time
  total = r.compute_time.sum(1) + r.comm_time.sum(1) + r.idle_time.sum(1) + r.update_time
  np.testing.assert_allclose(total, T, rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(r.phase_time.sum(1), T, rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(r.compute_time.sum(1), (f + b).sum(1), rtol=1e-9, atol=1e-9)
  steady_gap = r.comm_time[:, 1] + r.idle_time[:, 1]
  np.testing.assert_allclose(r.bubble, steady_gap, rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(r.link_busy[:, 0], cf[:S - 1].sum(1), rtol=1e-9, atol=1e-12)
  assert np.all(r.link_hidden <= r.link_busy + 1e-9)
  assert np.all(r.stage_comm_hidden <= r.stage_comm + 1e-9)
  assert r.peak_inflight == sched.peak_inflight(r.schedule.tables)
  assert all(h >= p for h, p in zip(r.peak_held, r.peak_inflight))
  # Task bars on a stage never overlap and follow the table.
  assert np.all(r.task_start[:, 1:] >= r.task_end[:, :-1] - 1e-12)
  np.testing.assert_allclose(r.wait.sum(1) + (f + b).sum(1), r.task_end[:, -1], rtol=1e-9)
  json.dumps(r.summary())


def test_overlap_ratio_extremes():
  # One microbatch: every transfer is waited for, nothing is hidden.
  r = simulate([1, 1], [2, 2], 0.5, "1f1b", num_microbatches=1)
  assert r.overlap.tolist() == [[0.0, 0.0]] and r.overlap_ratio.tolist() == [0.0]
  # No communication: nothing to hide (NaN), and no exposed communication.
  r = simulate([1, 1], [2, 2], 0.0, "1f1b", num_microbatches=4)
  assert np.isnan(r.overlap_ratio[0]) and r.comm_time.sum() == 0
  # H-1F1B over a link at 0.8 t_max: steady transfers are all hidden, only the first and last
  # of each direction are exposed, so the ratio approaches 1 as B grows.
  ratios = [simulate([1, 1], [2, 2], 2.4, "h1f1b", num_microbatches=B, eps=0).overlap_ratio[0]
            for B in (8, 32, 128)]
  assert ratios[0] < ratios[1] < ratios[2] and ratios[2] > 0.98


def test_peak_held_counts_inputs_waiting():
  # Stage 1 is slow; stage 0 (GPipe) forwards everything first: stage 1 holds all inputs.
  r = simulate([0.1, 1.0], [0.1, 1.0], 0.0, "gpipe", num_microbatches=5)
  assert r.peak_inflight == (5, 5) and r.peak_held == (5, 5)
  r = simulate([0.1, 1.0], [0.1, 1.0], 0.0, "1f1b", num_microbatches=5)
  assert r.peak_inflight == (2, 1) and r.peak_held == (2, 2)


def test_activation_bytes():
  r = simulate([1, 1], [1, 1], 0, "eager_1f1b", num_microbatches=8, act_bytes=[2e6, 1e6])
  np.testing.assert_allclose(r.peak_activation_bytes, [3 * 2e6, 1e6])


# --------------------------------------------------------------------------- inputs


def test_schedule_input_forms_agree():
  f, b, c = [1, 2, 1], [2, 3, 2], [0.5, 0.2]
  s = sched.make_schedule("eager_1f1b", 3, 6)
  ref = simulate(f, b, c, s).iteration_time
  assert simulate(f, b, c, "Eager-1F1B", num_microbatches=6).iteration_time == ref
  assert simulate(f, b, c, s.text()).iteration_time == ref
  assert simulate(f, b, c, [[str(t) for t in row] for row in s.tables]).iteration_time == ref
  r = simulate(f, b, c, "h1f1b", num_microbatches=6, eps=0)
  assert r.schedule.warmups == sched.h1f1b_warmups(c, 5, 0)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(fwd=[1, -1], bwd=[1, 1], comm=0), CostTablesError, r"fwd\[1"),
    (dict(fwd=[1, 1], bwd=[1, np.nan], comm=0), CostTablesError, r"bwd\[1"),
    (dict(fwd=[1, 1], bwd=[1, 1], comm=[1, 2]), CostTablesError, "shape"),
    (dict(fwd=[1, 1, 1], bwd=[1, 1], comm=0), CostTablesError, "shape"),
    (dict(fwd=[1, 1], bwd=[1, 1], comm=0, end_cost=[1]), CostTablesError, "end_cost"),
])
def test_bad_costs_raise_named_errors(kwargs, err, match):
  with pytest.raises(err, match=match):
    simulate(schedule="1f1b", num_microbatches=3, **kwargs)


def test_bad_schedules_raise():
  with pytest.raises(ScheduleError, match="num_microbatches"):
    simulate([1, 1], [1, 1], 0, "1f1b")
  with pytest.raises(ScheduleError, match="deadlock"):
    simulate([1, 1], [1, 1], 0, "stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B0 B1")
  with pytest.raises(CostTablesError, match="shape"):
    simulate([1, 1, 1], [1, 1, 1], 0, sched.make_schedule("1f1b", 2, 2))


def test_64_stages_512_microbatches():
  # (How fast: benchmarks/schedules.py, simulator_speed.)
  rng = np.random.default_rng(0)
  f, b, c = rng.uniform(1, 2, 64), rng.uniform(2, 4, 64), rng.uniform(0, 3, 63)
  s = sched.make_schedule("h1f1b", 64, 512, sched.h1f1b_warmups(c, (f + b).max(), 0))
  r = simulate(f, b, c, s)
  assert r.task_start.shape == (64, 1024)
  again = simulate(f, b, c, "h1f1b", num_microbatches=512, eps=0)
  assert again.iteration_time == r.iteration_time


# --------------------------------------------------------------------------- pictures, CLI


def test_chrome_trace_and_gantt(tmp_path):
  r = simulate([1, 1, 1], [2, 2, 2], [0.5, 0.1], "h1f1b", num_microbatches=4, end_cost=0.3)
  trace = timeline.chrome_trace(r)
  bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(bars) == 3 * 8 + 3 + 2 * 2 * 4          # tasks, updates, transfers
  rows = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
  assert rows == {"stage 0", "stage 1", "stage 2", "link 0\u21921", "link 1\u21920",
                  "link 1\u21922", "link 2\u21921"}
  f3 = [e for e in bars if e["name"] == "F3" and e["tid"] == 0][0]
  assert f3["ts"] == pytest.approx(r.f_start[0, 3] * 1e6)
  path = timeline.save_chrome_trace(r, tmp_path / "t.json")
  assert json.load(open(path))["otherData"]["num_microbatches"] == 4
  png = timeline.save_gantt(r, tmp_path / "g.png")
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_direct_times(tmp_path):
  res = CliRunner().invoke(simulate_cmd, [
      "--fwd", "1,1,1", "--bwd", "2,2,2", "--comm", "0.5,0.1", "-B", "16",
      "--schedule", "h1f1b,1f1b", "--eps", "0", "--out", str(tmp_path)])
  assert res.exit_code == 0, res.output
  assert "h1f1b" in res.output and "vs 1f1b" in res.output
  for name in ("h1f1b.trace.json", "h1f1b.png", "1f1b.trace.json", "1f1b.png", "summary.json"):
    assert (tmp_path / name).exists()
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary[0]["warmups"] == [5, 3, 1]
  assert max(summary[0]["bubble_s"]) < 1e-12


def test_cli_plan_file_units_and_custom_table(tmp_path):
  plan = Plan(stages=(StageSpec((0, 3), "v100", (1, 2), time_s=0.15, comm_s=0.1),
                      StageSpec((4, 9), "a100", (1, 2), time_s=0.15)),
              num_microbatches=8, schedule="h1f1b")
  plan.save(tmp_path / "plan.json")
  res = CliRunner().invoke(simulate_cmd, [str(tmp_path / "plan.json"), "--json", "--eps", "0"])
  assert res.exit_code == 0, res.output
  out = json.loads(res.output)
  assert out[0]["warmups"] == [4, 1] and out[0]["stage_time_s"] == [0.15, 0.15]
  (tmp_path / "t.txt").write_text("stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1\n")
  res = CliRunner().invoke(simulate_cmd, ["--time", "150ms", "--comm", "100ms", "--table",
                                          str(tmp_path / "t.txt"), "--json"])
  assert res.exit_code == 0, res.output
  assert json.loads(res.output)[0]["schedule"] == "custom"
  res = CliRunner().invoke(simulate_cmd, ["--fwd", "1,2", "--bwd", "1,1,1", "-B", "2"])
  assert res.exit_code != 0 and "expected 1 or 3" in res.output
  res = CliRunner().invoke(simulate_cmd, ["--fwd", "1x", "--bwd", "1", "-B", "2"])
  assert res.exit_code != 0 and "not a time" in res.output
