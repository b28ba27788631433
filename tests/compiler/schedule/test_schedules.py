"""Schedules as data: warm-up counts, tables, validation, text form."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harpjax.compiler import schedule as sched
from harpjax.compiler.schedule import Schedule, Task
from harpjax.errors import ScheduleError


# --------------------------------------------------------------------------- warm-up counts


def test_named_warmups_match_the_paper_one_indexed_formulas():
  S = 5
  for i in range(S):  # paper: stage j = i + 1 launches S - j + 1 (1F1B), 2 (S - j) + 1 (Eager)
    j = i + 1
    assert sched.one_f_one_b_warmups(S)[i] == S - j + 1
    assert sched.eager_1f1b_warmups(S)[i] == 2 * (S - j) + 1
  assert sched.gpipe_warmups(3, 7) == (7, 7, 7)


def test_warmup_delta_is_eq10_bound_with_eps_zero():
  t = 3.0
  assert sched.warmup_delta(0.0, t, 0.0) == 1          # free link: plain 1F1B
  assert sched.warmup_delta(1e-6, t, 0.0) == 2         # any cost needs one more
  assert sched.warmup_delta(t / 2, t, 0.0) == 2        # Eq. 2's middle case, boundary included
  assert sched.warmup_delta(t / 2 + 1e-9, t, 0.0) == 3
  assert sched.warmup_delta(t, t, 0.0) == 3            # Eq. 2's last case, boundary included
  assert sched.warmup_delta(1.5 * t, t, 0.0) == 4      # beyond the paper's range: still Eq. 10


@given(c=st.floats(0, 5), t=st.floats(0.01, 10))
def test_warmup_delta_equals_ceil_one_plus_two_c_over_t(c, t):
  expected = max(1, math.ceil(1 + 2 * c / t - 1e-12)) if c > 0 else 1
  assert sched.warmup_delta(c, t, 0.0) == expected
  # The smallest delta with delta * t >= t + 2c (bubble-free bound, up to rounding).
  d = sched.warmup_delta(c, t, 0.0)
  assert d * t >= t + 2 * c - 1e-9 * t
  assert d == 1 or (d - 1) * t < t + 2 * c + 1e-9 * t


def test_eps_drops_the_extra_warmup_of_cheap_links():
  t = 1.0
  assert sched.warmup_delta(0.04, t, eps=0.1) == 1     # 2c/t = 0.08 <= eps
  assert sched.warmup_delta(0.06, t, eps=0.1) == 2
  assert sched.warmup_delta(0.9, t, eps=0.1) == 3


def test_h1f1b_warmups_case_study_gives_paper_fig3d():
  # §2.3.2: 5 Gbps between stage 1 and 2 (c ~ 0.8 t_max), InfiniBand between 2 and 3.
  t_max = 0.1356
  assert sched.h1f1b_warmups([0.107, 0.0027], t_max, eps=0.1) == (5, 2, 1)
  assert sched.eager_1f1b_warmups(3) == (5, 3, 1)


def test_h1f1b_warmups_of_a_link_bound_pipeline_are_relative_to_the_link():
  """A cut slower than every stage sets the period: deltas relative to it (at most 3), not
  to t_max (which would grow without bound and buy nothing)."""
  assert sched.pipeline_period([0.5, 3.0], 1.0) == 3.0
  # Relative to the 3 s link: deltas ceil(2 * 0.5 / 3) + 1 = 2 and ceil(2 * 3 / 3) + 1 = 3,
  # the counts of a pipeline whose t_max were 3 s; relative to t_max = 1 s they would be 2, 7.
  assert sched.h1f1b_warmups([0.5, 3.0], 1.0, eps=0.0) == (6, 4, 1)
  assert sched.h1f1b_warmups([0.5, 3.0], 3.0, eps=0.0) == (6, 4, 1)
  assert sched.h1f1b_warmups([0.5, 0.9], 1.0, eps=0.0) == (6, 4, 1)   # Eq. 1 below t_max


def test_link_bound_warmups_lose_no_time_and_save_memory():
  """Against deltas relative to t_max, the period rule never simulates slower on random
  link-bound pipelines, and holds fewer microbatches."""
  rng = np.random.default_rng(5)
  fewer = 0
  for _ in range(300):
    S, B = int(rng.integers(2, 6)), int(rng.choice([4, 16, 64]))
    t = rng.uniform(0.2, 1.0, S)
    c = rng.uniform(0.0, 1.0, S - 1) * rng.choice([0.3, 1.0, 3.0], S - 1)
    if c.max() <= t.max():
      continue
    eps = float(rng.choice([0.0, 0.1]))
    old = [1]
    for x in reversed(c):
      old.append(old[-1] + sched.warmup_delta(x, t.max(), eps))
    old = tuple(reversed(old))
    new = sched.h1f1b_warmups(c, t.max(), eps)
    f, b = t / 3, t - t / 3
    r_old = sched.simulate(f, b, c, sched.make_schedule("h1f1b", S, B, old))
    r_new = sched.simulate(f, b, c, sched.make_schedule("h1f1b", S, B, new))
    assert r_new.iteration_time <= r_old.iteration_time * (1 + 1e-12)
    assert all(a <= b for a, b in zip(new, old))
    fewer += new[0] < old[0]
  assert fewer >= 50, fewer


def test_h1f1b_warmups_rejects_bad_costs():
  with pytest.raises(ScheduleError, match="comm_costs\\[1\\]"):
    sched.h1f1b_warmups([0.1, -1.0], 1.0)
  with pytest.raises(ScheduleError, match="t_max"):
    sched.h1f1b_warmups([0.1], 0.0)


# --------------------------------------------------------------------------- tables


def test_table_from_warmups_layout():
  tables = sched.table_from_warmups(2, 4, (3, 1))
  assert sched.format_tables(tables).splitlines() == [
      "stage 0: F0  F1  F2  B0  F3  B1  B2  B3",
      "stage 1: F0  B0  F1  B1  F2  B2  F3  B3"]


@given(S=st.integers(1, 6), B=st.integers(1, 12), extra=st.lists(st.integers(1, 3), max_size=6))
def test_every_named_schedule_validates_and_counts_inflight(S, B, extra):
  deltas = (extra + [1] * S)[:S - 1]
  warm = [1]
  for d in reversed(deltas):
    warm.append(warm[-1] + d)
  warm = tuple(reversed(warm))
  for name, w in [("gpipe", None), ("1f1b", None), ("eager_1f1b", None), ("h1f1b", warm)]:
    s = sched.make_schedule(name, S, B, w)
    assert s.num_stages == S and all(len(r) == 2 * B for r in s.tables)
    assert s.table_warmups() == tuple(min(x, B) for x in s.warmups)
    assert s.peak_inflight() == s.table_warmups()
    kinds, mbs = s.arrays
    assert kinds.shape == mbs.shape == (S, 2 * B)
    assert [["FB"[k] + str(m) for k, m in zip(kr, mr)] for kr, mr in zip(kinds, mbs)] == \
        [[str(t) for t in row] for row in s.tables]


def test_schedule_names_and_aliases():
  for spelling, key in [("H-1F1B", "h1f1b"), ("harp", "h1f1b"), ("Eager-1F1B", "eager_1f1b"),
                        ("eager", "eager_1f1b"), ("1F1B", "1f1b"), ("PipeDream-Flush", "1f1b"),
                        ("GPipe", "gpipe")]:
    assert sched.schedule_key(spelling) == key
  with pytest.raises(ScheduleError, match="unknown schedule"):
    sched.make_schedule("zb-h1", 2, 2)
  with pytest.raises(ScheduleError, match="fixed warm-up counts"):
    sched.make_schedule("1f1b", 3, 4, (5, 2, 1))
  assert sched.make_schedule("h1f1b", 3, 4).tables == sched.make_schedule("1f1b", 3, 4).tables


def test_text_and_json_round_trip():
  s = sched.make_schedule("eager_1f1b", 3, 5)
  assert Schedule.from_text(s.text(), "eager_1f1b").tables == s.tables
  assert Schedule.from_json(s.to_json()) == s
  assert Task.parse(" B12 ") == Task("B", 12) and str(Task("F", 3)) == "F3"
  with pytest.raises(ScheduleError, match="cannot parse"):
    Task.parse("W3")


def test_schedule_accepts_strings_and_pairs():
  s = Schedule("x", [["F0", "B0", "F1", "B1"]], 2)
  assert s.tables == ((Task("F", 0), Task("B", 0), Task("F", 1), Task("B", 1)),)
  assert Schedule("x", [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]], 2).peak_inflight() == (2,)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("rows, match", [
    ([["F0", "B0", "F1"]], "missing"),
    ([["F0", "B0", "F0", "B1"]], "twice"),
    ([["B0", "F0", "F1", "B1"]], "before F0"),
    ([["F0", "B0", "F5", "B1"]], "microbatch must be"),
])
def test_validation_names_the_bad_task(rows, match):
  with pytest.raises(ScheduleError, match=match):
    Schedule("bad", [[Task.parse(t) for t in r] for r in rows], 2)


def test_deadlock_is_reported_with_the_stuck_positions():
  # Stage 0 waits for B0 from stage 1, which waits for F1 that stage 0 has not sent.
  text = "stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B0 B1"
  with pytest.raises(ScheduleError, match="deadlock") as e:
    Schedule.from_text(text)
  assert "[B0]" in str(e.value) and "[F1]" in str(e.value)
  with pytest.raises(ScheduleError, match="deadlock"):
    sched.dry_run(sched.parse_tables(text))


def test_increasing_warmups_deadlock():
  with pytest.raises(ScheduleError, match="deadlock"):
    sched.make_schedule("h1f1b", 2, 4, (1, 2))


def test_dry_run_order_is_a_valid_execution():
  s = sched.make_schedule("h1f1b", 4, 6, (7, 4, 2, 1))
  done = set()
  for stage, task in sched.dry_run(s.tables):
    if task.kind == "F" and stage > 0:
      assert (stage - 1, task) in done
    if task.kind == "B":
      dep = (stage + 1, task) if stage < 3 else (stage, Task("F", task.microbatch))
      assert dep in done
    done.add((stage, task))
  assert len(done) == 4 * 12


def test_random_valid_tables_validate():
  rng = np.random.default_rng(0)
  for _ in range(50):
    S, B = int(rng.integers(1, 6)), int(rng.integers(1, 8))
    tables = _random_tables(rng, S, B)
    s = Schedule("random", tables, B)
    assert len(sched.dry_run(s.tables)) == 2 * S * B


def _random_tables(rng, S, B):
  """Random deadlock-free tables: a random zero-time execution of any ready task."""
  tables = [[] for _ in range(S)]
  done = [set() for _ in range(S)]
  while any(len(t) < 2 * B for t in tables):
    s = int(rng.integers(S))
    ready = [Task("F", m) for m in range(B)
             if Task("F", m) not in done[s] and (s == 0 or Task("F", m) in done[s - 1])]
    ready += [Task("B", m) for m in range(B) if Task("F", m) in done[s]
              and Task("B", m) not in done[s] and (s == S - 1 or Task("B", m) in done[s + 1])]
    if ready:
      task = ready[int(rng.integers(len(ready)))]
      done[s].add(task)
      tables[s].append(task)
  return tuple(tuple(r) for r in tables)


def _megatron_1f1b(S, B, rank):
  """Megatron-LM's non-interleaved 1F1B loop for one pipeline rank, as a task list."""
  warmup = min(S - rank - 1, B)
  tasks = [Task("F", m) for m in range(warmup)]
  f, b = warmup, 0
  for _ in range(B - warmup):      # steady: one forward, then one backward
    tasks += [Task("F", f), Task("B", b)]
    f, b = f + 1, b + 1
  tasks += [Task("B", m) for m in range(b, B)]
  return tuple(tasks)


@pytest.mark.parametrize("S, B", [(1, 3), (2, 2), (4, 8), (5, 3)])
def test_other_libraries_tables_equal_ours(S, B):
  megatron = tuple(_megatron_1f1b(S, B, r) for r in range(S))
  assert Schedule("megatron", megatron, B).tables == sched.make_schedule("1f1b", S, B).tables
  gpipe = tuple(tuple([Task("F", m) for m in range(B)] + [Task("B", m) for m in range(B)])
                for _ in range(S))
  assert gpipe == sched.make_schedule("gpipe", S, B).tables
