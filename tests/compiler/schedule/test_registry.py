"""The schedule registry: every kind once, with its warm-up rule, tables and memory in flight;
a user's own kind reaches make_schedule, the simulator, the plan evaluator, plans and the
planner."""

import itertools

import numpy as np
import pytest

from harpjax.compiler import plan as planner
from harpjax.compiler import schedule as sched
from harpjax.compiler.schedule import PipelineCosts, ScheduleKind
from harpjax.errors import PlanError, ScheduleError
from tests.compiler.plan import oracle


@pytest.fixture
def registered():
  """Registers kinds for one test and removes them afterwards."""
  names = []

  def add(kind, **kw):
    names.append(kind.name)
    return sched.register_schedule(kind, **kw)
  yield add
  for name in names:
    if name in sched.schedule_names():
      sched.unregister_schedule(name)


def test_built_in_kinds_are_the_paper_rules():
  assert sched.schedule_names()[:4] == sched.SCHEDULE_NAMES
  assert [k.name for k in sched.ranked_schedules()][:3] == ["1f1b", "eager_1f1b", "h1f1b"]
  assert [k.uses_costs for k in sched.registered_schedules()][:4] == [False, False, False, True]
  for S, B in itertools.product([1, 2, 3, 5], [1, 2, 7]):
    costs = PipelineCosts(S, B)
    assert sched.GPIPE.warmups(costs) == sched.gpipe_warmups(S, B)
    assert sched.ONE_F_ONE_B.warmups(costs) == sched.one_f_one_b_warmups(S)
    assert sched.EAGER_1F1B.warmups(costs) == sched.eager_1f1b_warmups(S)
    assert sched.H1F1B.warmups(costs) == sched.one_f_one_b_warmups(S)   # free links
    for kind in sched.registered_schedules()[:4]:
      s = sched.make_schedule(kind.name, S, B)
      assert s.name == kind.name and s.warmups == kind.warmups(costs)
      assert s.tables == sched.table_from_warmups(S, B, s.warmups)
      # The memory in flight the evaluators check is the table's own peak.
      assert kind.inflight(S, B, s.warmups) == s.peak_inflight()


def test_h1f1b_rule_is_the_checked_warmups_and_the_plan_fallback():
  rng = np.random.default_rng(0)
  for _ in range(200):
    S = int(rng.integers(1, 6))
    t = tuple(float(x) for x in rng.uniform(0.1, 2.0, S))
    c = tuple(float(x) for x in rng.uniform(0.0, 3.0, S - 1))
    eps = float(rng.choice([0.0, 0.1, 0.3]))
    want = sched.h1f1b_warmups(c, max(t), eps)
    assert sched.H1F1B.warmups(PipelineCosts(S, 8, t, c, eps)) == want
    subs = tuple(str(x) for x in rng.integers(0, 2, S))
    assert sched.H1F1B.warmups(PipelineCosts(S, 8, (None,) * S, (None,) * (S - 1), eps,
                                             subs)) == sched.plan_warmups(
        (None,) * S, (None,) * (S - 1), subs, eps)
  # A stage without a finite time: every delta 1 (the evaluators still report counts).
  assert sched.H1F1B.warmups(PipelineCosts(3, 8, (1.0, np.inf, 1.0), (5.0, 5.0))) == (3, 2, 1)


def test_spellings_and_unknown_names():
  for spelling, key in [("H-1F1B", "h1f1b"), ("harp", "h1f1b"), ("Eager-1F1B", "eager_1f1b"),
                        ("eager", "eager_1f1b"), ("PipeDream-Flush", "1f1b"),
                        ("pipedream", "1f1b"), ("GPipe", "gpipe"), ("1F1B", "1f1b")]:
    assert sched.schedule_key(spelling) == key
    assert sched.schedule_kind(spelling) is sched.schedule_kind(key)
  with pytest.raises(ScheduleError, match="zero-bubble.*register_schedule"):
    sched.schedule_key("zero-bubble")
  with pytest.raises(ScheduleError, match="fixed warm-up counts.*h1f1b"):
    sched.make_schedule("eager_1f1b", 3, 8, (2, 2, 1))


def _deep(costs):
  """Three more forwards per stage than the next: deeper than Eager-1F1B."""
  return tuple(3 * (costs.num_stages - 1 - i) + 1 for i in range(costs.num_stages))


def test_a_registered_kind_reaches_every_reader(registered):
  deep = registered(ScheduleKind("deep_1f1b", _deep, aliases=("deep",), title="Deep-1F1B"))
  assert sched.schedule_key("Deep-1F1B") == sched.schedule_key("deep") == "deep_1f1b"
  assert sched.make_schedule("deep", 3, 8).warmups == (7, 4, 1)
  assert "deep_1f1b" in sched.schedule_names() and deep not in sched.ranked_schedules()
  # The simulator by name and by kind: the same tables.
  by_name = sched.simulate([1, 1, 1], [2, 2, 2], [0.5, 0.5], "Deep", num_microbatches=8)
  by_kind = sched.simulate([1, 1, 1], [2, 2, 2], [0.5, 0.5], deep, num_microbatches=8)
  assert by_name.schedule.name == "deep_1f1b" and by_name.schedule.warmups == (7, 4, 1)
  assert by_name.iteration_time == by_kind.iteration_time
  assert by_name.peak_inflight == (7, 4, 1)
  # A plan names it (kept canonical; a saved plan loads back); the evaluator scores it.
  rng = np.random.default_rng(3)
  tables = oracle.random_tables(rng)
  res = planner.solve(tables, 8, backend="sequential")
  plan = res.plan.replace(schedule="Deep-1F1B")
  assert plan.schedule == "deep_1f1b"
  assert planner.Plan.from_json(plan.to_json()).schedule == "deep_1f1b"
  ev = planner.evaluate_plan(tables, plan, 8)
  S = plan.num_stages
  assert ev.schedule == "deep_1f1b" and ev.warmups == _deep(PipelineCosts(S, 8))
  assert [s.inflight for s in ev.stages] == [min(w, 8) for w in ev.warmups]
  # Pinned in the planner: the same stages, this schedule.
  pinned = planner.solve(tables, 8, backend="sequential", schedule="deep")
  assert pinned.plan.schedule == "deep_1f1b"
  assert [s.layers for s in pinned.plan.stages] == [s.layers for s in res.plan.stages]
  assert pinned.plan.predicted_iteration_s == ev.iteration_s == pinned.iteration_s
  assert pinned.plan.warmups == ev.warmups
  # Once removed, the name is unknown again.
  sched.unregister_schedule("deep_1f1b")
  with pytest.raises(PlanError, match="deep"):
    planner.solve(tables, 8, schedule="deep")
  with pytest.raises(PlanError, match="schedule"):
    planner.Plan(stages=plan.stages, schedule="deep")


def test_a_ranked_kind_is_chosen_when_faster(registered):
  """A kind registered with ranked=True competes in the planner's choice."""
  rng = np.random.default_rng(11)
  chosen = 0
  for _ in range(20):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([4, 8, 16]))
    try:
      base = planner.solve(tables, B, backend="sequential", schedule="h1f1b")
    except Exception:   # infeasible instances
      continue
    if "deep_1f1b" not in sched.schedule_names():
      registered(ScheduleKind("deep_1f1b", _deep, ranked=True))
    res = planner.solve(tables, B, backend="sequential")
    scores = planner.schedule_scores(base.plan, planner.plan_scorer(tables, B, 0.1, 1 / 3))
    assert "deep_1f1b" in [s.schedule for s in scores]
    best = min(s.iteration_s for s in scores if s.fits)
    assert res.iteration_s == min(best, base.iteration_s)
    chosen += res.plan.schedule == "deep_1f1b"
  assert chosen >= 1


def test_a_kind_with_its_own_tables_holds_what_its_tables_hold(registered):
  """A kind whose tables are not the 1F1B form of its counts (after its warm-up each stage
  runs the next forward before each backward): its memory in flight is its tables' peak,
  one more than min(N_i, B), and the evaluator checks that."""
  def forward_first(S, B, warmups):
    tables = []
    for w in warmups:
      row = [sched.Task("F", m) for m in range(min(w, B))]
      f = len(row)
      for b in range(B):
        if f < B:
          row.append(sched.Task("F", f))
          f += 1
        row.append(sched.Task("B", b))
      tables.append(tuple(row))
    return tuple(tables)

  kind = registered(ScheduleKind("forward_first",
                                 lambda c: sched.one_f_one_b_warmups(c.num_stages),
                                 build_tables=forward_first))
  s = sched.make_schedule("forward_first", 3, 8)
  assert s.tables == forward_first(3, 8, (3, 2, 1)) != sched.table_from_warmups(3, 8, (3, 2, 1))
  assert kind.inflight(3, 8, s.warmups) == s.peak_inflight() == (4, 3, 2)
  sim = sched.simulate([1, 1, 1], [2, 2, 2], 0.1, "forward_first", num_microbatches=8)
  assert sim.peak_inflight == (4, 3, 2)
  rng = np.random.default_rng(3)
  tables = oracle.random_tables(rng)
  plan = planner.solve(tables, 8, backend="sequential").plan
  ev = planner.evaluate_plan(tables, plan, 8, "forward_first")
  S = plan.num_stages
  assert [st.inflight for st in ev.stages] == [min(S - i + 1, 8) for i in range(S)]
  assert all(st.peak_mem_bytes == st.param_bytes + st.inflight * st.act_bytes
             for st in ev.stages)


def test_registration_errors(registered):
  with pytest.raises(ScheduleError, match="registered already"):
    sched.register_schedule(ScheduleKind("h1f1b", _deep))
  with pytest.raises(ScheduleError, match="'eager1f1b' names schedule 'eager_1f1b'"):
    sched.register_schedule(ScheduleKind("mine", _deep, aliases=("eager-1f1b",)))
  with pytest.raises(ScheduleError, match="built in"):
    sched.unregister_schedule("gpipe")
  with pytest.raises(ScheduleError, match="'custom'"):
    ScheduleKind("custom", _deep)
  with pytest.raises(ScheduleError, match="must be a function"):
    ScheduleKind("mine", (1, 2))
  registered(ScheduleKind("short", lambda c: (1,)))
  with pytest.raises(ScheduleError, match="returned \\(1,\\) for 3 stages"):
    sched.make_schedule("short", 3, 4)
  assert "mine" not in sched.schedule_names()
