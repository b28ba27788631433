"""The planner: exactness against brute force and the NumPy twin, the memory model, search
pruning, backends, infeasibility explanations and the Eq. 12 evaluator."""

import itertools
import math
import re

import numpy as np
import pytest

from harpjax.cluster import Link, pack_submeshes
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import dp_kernel
from tests.compiler.plan import oracle
from harpjax.compiler.plan.index import device_states
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.profile import CostTables, SubclusterSpec, synthetic_gpt_profile
from harpjax.compiler.schedule import h1f1b_warmups, make_schedule, simulate, warmup_delta
from harpjax.errors import InfeasiblePlanError, PlanError

GiB = 2.0 ** 30


def _solve_or_inf(tables, B, **kw):
  # The search's exactness is about H-1F1B's stages: the schedule stays H-1F1B (the choice of
  # schedule after the search: tests/compiler/plan/test_schedule_choice.py).
  kw.setdefault("schedule", "h1f1b")
  try:
    return planner.solve(tables, B, backend="sequential", **kw)
  except InfeasiblePlanError:
    return None


def _obj(res):
  return math.inf if res is None else res.objective_s


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


def _tables(L, shapes, times, params, acts, mem, boundary, intra_bw=1.0, inter_bw=1.0,
            hosts=None, dph=None):
  """Hand-made tables: ``times[k]`` maps ``(i, j, s)`` to seconds (others ``inf``)."""
  K = len(shapes)
  st, pm, am = [], [], []
  for k in range(K):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    for key, v in times[k].items():
      t[key] = v
      p[key] = params[k].get(key, 0.0)
      a[key] = acts[k].get(key, 0.0)
    st.append(t)
    pm.append(p)
    am.append(a)
  hosts = hosts or [1] * K
  dph = dph or [max(m for _, m in sh) for sh in shapes]
  return CostTables(num_layers=L, subcluster_names=tuple(f"c{k}" for k in range(K)),
                    num_hosts=tuple(hosts), devices_per_host=tuple(dph),
                    device_memory_bytes=tuple(mem), submeshes=tuple(shapes),
                    stage_time_s=tuple(st), param_mem_bytes=tuple(pm), act_mem_bytes=tuple(am),
                    boundary_bytes=np.asarray(boundary, float),
                    intra_bandwidth_bytes_per_s=(intra_bw,) * K, intra_latency_s=(0.0,) * K,
                    inter_bandwidth_bytes_per_s=(inter_bw,) * (K - 1),
                    inter_latency_s=(0.0,) * (K - 1))


# --------------------------------------------------------------------------- warm-up twin


def test_compiled_warmup_delta_matches_the_schedules_one():
  """The DP kernel compiles the schedules' warmup_delta with Numba: same integer everywhere."""
  for c, tau, eps in itertools.product([0.0, 1e-9, 0.01, 0.05, 0.25, 0.5, 0.4999999, 1.0, 2.5],
                                       [0.1, 0.5, 1.0, 3.0], [0.0, 0.1, 0.3]):
    assert dp_kernel._warmup_delta(c, tau, eps) == warmup_delta(c, tau, eps)


# --------------------------------------------------------------------------- exactness


PAPER = dict(use_all_devices=True, keep_order=True)
MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True), PAPER]
"""Resource choice (default), the tables' order kept, every device used in any order, and the
paper's planner (every device, the tables' order)."""


def _chunk_params(ci, slow):
  """``ci`` chunks in CI, ``slow`` more behind the slow mark."""
  return [*range(ci), *(pytest.param(c, marks=pytest.mark.slow) for c in range(ci, ci + slow))]


@pytest.mark.parametrize("chunk", _chunk_params(6, 14))
def test_simulated_optimum_matches_brute_force_on_random_instances(chunk):
  """The planner (DP proposals, simulator, bounded exact search) and a brute force that
  simulates every plan: the same optimum in every mode, proved; the plan's predicted time is
  the simulator's, exactly."""
  rng = np.random.default_rng(1000 + chunk)
  for x in range(25):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([1, 2, 4, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    bf = oracle.brute_force(tables, B, eps=eps, **mode)
    res = _solve_or_inf(tables, B, eps=eps, **mode)
    assert _close(_obj(res), bf.objective_s), (mode, bf, res)
    if res is None:
      continue
    assert res.stats.proved
    _check_plan_model(tables, res, B, eps, **mode)


@pytest.mark.parametrize("chunk", _chunk_params(2, 4))
def test_eq12_model_kernel_twin_and_brute_force_agree(chunk):
  """The paper's planner (Eq. 12, c <= t_max): Numba kernel, NumPy twin and brute force."""
  rng = np.random.default_rng(1100 + chunk)
  for x in range(30):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([1, 2, 4, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    bf = oracle.brute_force(tables, B, eps=eps, cost_model="eq12", **mode)
    res = _solve_or_inf(tables, B, eps=eps, cost_model="eq12", **mode)
    twin = _solve_or_inf(tables, B, eps=eps, kernel="numpy", cost_model="eq12", **mode)
    assert _close(_obj(res), bf.objective_s), (mode, bf, res)
    assert _close(_obj(twin), bf.objective_s), mode
    if res is not None:
      _check_plan_model(tables, res, B, eps, **mode)
      assert res.stats.proved is None and _close(res.objective_s, dict(res.plan.meta)["eq12_s"])


def test_simulated_search_without_numba_agrees():
  """The whole simulator-judged search with the NumPy twin and the bounded exact search run as
  plain Python: the same optimum as compiled."""
  rng = np.random.default_rng(1400)
  for x in range(8):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 5)))
    B = int(rng.choice([2, 8]))
    fast = _solve_or_inf(tables, B, **MODES[x % len(MODES)])
    slow = _solve_or_inf(tables, B, kernel="numpy", **MODES[x % len(MODES)])
    assert _close(_obj(fast), _obj(slow))
    assert slow is None or slow.stats.proved


@pytest.mark.parametrize("chunk", _chunk_params(1, 3))
def test_dp_value_matches_enumeration_at_every_candidate(chunk):
  """The DP at one candidate period (kernel and twin): the least value over the plans of that
  period, by enumeration, with the discount and link-bound hits (the simulator's model) and
  without (Eq. 12's)."""
  rng = np.random.default_rng(1200 + chunk)
  for x in range(20):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 6)))
    B = int(rng.choice([2, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    for link_bound, phi in ((True, 1.0 / 3.0), (False, 0.0)):
      index = planner.SparseIndex.build(tables, link_bound=link_bound, **mode)
      picks = rng.choice(index.candidates, size=min(6, index.candidates.size), replace=False)
      for tau in picks:
        want = oracle.surrogate_minimum(tables, B, eps, float(tau), phi, link_hits=link_bound,
                                        **mode)
        got = index.run(float(tau), B, eps, require_hit=True, discount=phi)[0]
        twin = index.run(float(tau), B, eps, require_hit=True, discount=phi, kernel="numpy")[0]
        assert _close(got, want) and _close(twin, want), (link_bound, tau, got, twin, want)


def test_period_precheck_never_rejects_a_period_some_plan_has():
  """The search skips a candidate when the prefix and suffix bounds (memory ignored, taken at
  a larger candidate) show no entry of that time fits a plan within it: check against every
  plan's period, by enumeration."""
  rng = np.random.default_rng(1300)
  skipped = 0
  for x in range(40):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 7)))
    mode = MODES[x % len(MODES)]
    index = planner.SparseIndex.build(tables, link_bound=True, **mode)
    periods = set()
    for stages in oracle.enumerate_plans(tables, **mode):
      nums = oracle.plan_numbers(tables, stages, 8, 0.1)
      if nums is not None and all(
          tables.param_mem_bytes[k][i, j, s] + tables.act_mem_bytes[k][i, j, s]
          <= tables.device_memory_bytes[k] for i, j, k, s in stages):
        periods.add(nums[3])
    cand = index.candidates
    top = float(cand[-1])
    for bounds_at in (None, top):
      for tau in cand:
        at = float(tau) if bounds_at is None else bounds_at
        lb = index.prefix_bound(at)
        ok = index.may_have_period(float(tau), lb, index.suffix_bound(at, lb))
        assert ok or float(tau) not in periods, (x, tau)
        skipped += not ok
  assert skipped > 50, skipped


def _check_plan_model(tables, res, B, eps, use_all_devices=False, keep_order=False):
  ev = planner.evaluate_plan(tables, res.plan, B, eps=eps)
  assert ev.mem_ok and ev.devices_ok, ev.violations
  assert ev.uses_all_devices or not use_all_devices
  subs = [s.subcluster for s in res.stages]
  runs = [k for x, k in enumerate(subs) if x == 0 or subs[x - 1] != k]
  assert len(runs) == len(set(runs))            # one contiguous run per subcluster
  if keep_order:
    assert runs == sorted(runs)
  assert ev.t_max_s == res.t_max_s == res.plan.t_max_s
  assert ev.period_s == res.period_s
  # The predicted time is the simulator's, exactly, for the schedule the runtime builds.
  assert res.plan.predicted_iteration_s == res.iteration_s == ev.iteration_s
  comm = [s.comm_s for s in res.stages[:-1]]
  warm = h1f1b_warmups(comm, res.t_max_s, eps)
  assert res.warmups == warm == res.plan.warmups
  t = [s.time_s for s in res.stages]
  f = [x * (1.0 / 3.0) for x in t]
  sim = simulate(f, [x - y for x, y in zip(t, f)], comm, make_schedule("h1f1b", len(t), B, warm))
  assert sim.iteration_time == res.plan.predicted_iteration_s
  assert _close(ev.eq12_s, res.eq12_s)
  for s in res.stages:
    assert s.peak_mem_bytes == s.param_bytes + min(s.warmup, B) * s.act_bytes
    assert s.peak_mem_bytes <= s.device_memory_bytes
    assert s.comm_s <= res.period_s


def test_resource_choice_is_never_worse_and_often_better():
  """Leaving devices unused and choosing the order only add plans: the optimum is never worse
  than with every device in the tables' order, and on the random corpus often better."""
  rng = np.random.default_rng(99)
  better = 0
  for _ in range(60):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([2, 8, 32]))
    objs = [_obj(_solve_or_inf(tables, B, **mode)) for mode in MODES]
    free, kept, all_free, paper = objs
    assert free <= min(kept, all_free) * (1 + 1e-12) and kept <= paper * (1 + 1e-12)
    assert all_free <= paper * (1 + 1e-12)
    better += free < paper * (1 - 1e-9)
  assert better >= 15, better


@pytest.mark.parametrize("chunk", range(2))
def test_dp_matches_brute_force_when_submeshes_may_not_pack(chunk):
  """Hosts of 3 devices: (1, 2) stages add up but may not pack; the DP tracks the shapes."""
  rng = np.random.default_rng(2000 + chunk)
  for x in range(40):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 7)), odd_hosts=True)
    B = int(rng.choice([2, 8]))
    bf = oracle.brute_force(tables, B)
    res = _solve_or_inf(tables, B)
    assert _close(_obj(res), bf.objective_s), (bf, res)
    if res is not None:
      _check_plan_model(tables, res, B, 0.1)
    if x % 4 == 0:   # the NumPy twin is slow: a quarter of them
      bf = oracle.brute_force(tables, B, cost_model="eq12")
      assert _close(_obj(_solve_or_inf(tables, B, kernel="numpy", cost_model="eq12")),
                    bf.objective_s)


def test_three_quarter_hosts_do_not_pack():
  """Two hosts of 6: the cheapest split into three (1, 4) stages adds up but does not fit."""
  shapes = [(1, 2), (1, 4), (1, 6), (2, 6)]
  times = {(0, 0, 1): 1.0, (1, 1, 1): 1.0, (2, 2, 1): 1.0,               # 3 x (1, 4)
           (0, 0, 0): 1.6, (1, 1, 0): 1.6, (0, 1, 2): 1.7, (2, 2, 2): 1.7}
  tables = _tables(L=3, shapes=[shapes], times=[times], params=[{}], acts=[{}], mem=[1.0],
                   boundary=[0.0, 0.0, 0.0], hosts=[2], dph=[6])
  st = device_states(tables, **PAPER)
  assert st.sub.size > 1 and (st.stay[:, 1] >= 0).sum() >= 2
  bf = oracle.brute_force(tables, 4, **PAPER)
  res = planner.solve(tables, 4, **PAPER)
  assert _close(res.objective_s, bf.objective_s) and res.t_max_s == 1.7
  assert sorted(s.submesh for s in res.stages) == [(1, 6), (1, 6)]
  assert not oracle.packable(2, 6, [(1, 4)] * 3)


def test_random_instances_exercise_binding_memory_and_the_bottleneck_trap():
  """The corpus above is not trivial: memory binds often, and a DP that evaluates the warm-ups
  at the candidate t_max instead of the plan's own bottleneck would be wrong on some."""
  rng = np.random.default_rng(7)
  binds = trap = infeasible = 0
  for _ in range(150):
    tables = oracle.random_tables(rng)
    B = int(rng.choice([2, 8, 32]))
    bf = oracle.brute_force(tables, B, **PAPER)
    if not math.isfinite(bf.objective_s):
      infeasible += 1
      continue
    roomy = tables.replace(device_memory_bytes=(1e12,) * tables.num_subclusters)
    binds += oracle.brute_force(roomy, B, **PAPER).objective_s < bf.objective_s * (1 - 1e-9)
    index = planner.SparseIndex.build(tables, **PAPER)
    naive = min(index.run(float(t), B, 0.1, require_hit=False)[0] + (B - 1) * float(t)
                for t in index.candidates)
    trap += not _close(naive, bf.objective_s)
  assert binds >= 20 and trap >= 3 and 10 <= infeasible <= 60, (binds, trap, infeasible)


def test_bottleneck_trap_instance_is_infeasible():
  """Two 1-device subclusters, one plan: stage times 1.0 and 1.0, cut 0.6 s.

  At its own t_max = 1.0 the first stage needs N = 1 + (ceil(1.2 - 0.1) + 1) = 4 warm-ups,
  which do not fit; at the candidate t_max = 2.0 (another entry's time) it would need only 3.
  """
  one = [(1, 1)]
  tables = _tables(
      L=2, shapes=[one, one],
      times=[{(0, 0, 0): 1.0, (0, 1, 0): 2.0}, {(1, 1, 0): 1.0}],
      params=[{(0, 0, 0): 1.0, (0, 1, 0): 1.0}, {}], acts=[{(0, 0, 0): 1.0}, {}],
      mem=[4.5, 10.0], boundary=[0.6, 0.0])
  index = planner.SparseIndex.build(tables, **PAPER)
  assert math.isfinite(index.run(2.0, 8, 0.1, require_hit=False)[0])  # the trap
  assert not math.isfinite(oracle.brute_force(tables, 8, **PAPER).objective_s)
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tables, 8, **PAPER)
  assert e.value.constraint in ("memory", "communication")
  # With resource choice the whole model on c0 is a plan (one stage of 2.0 s).
  assert planner.solve(tables, 8).plan.num_stages == 1
  # With one more byte of memory per stage the plan is valid, with N = (4, 1).
  roomy = tables.replace(device_memory_bytes=(5.0, 10.0))
  res = planner.solve(roomy, 8, **PAPER)
  assert res.warmups == (4, 1) and res.t_max_s == 1.0


def _paper_dp(tables, B, eps):
  """Eq. 13-19 as written: N tracked along the cheapest suffix (Eq. 17), no bottleneck flag."""
  L, K = tables.num_layers, tables.num_subclusters
  offs = [int(x) for x in tables.device_offsets]
  D = offs[-1]
  best = math.inf
  index = planner.SparseIndex.build(tables)
  for tau in index.candidates:
    F = {(L, D): (0.0, 0)}
    for i in range(L - 1, -1, -1):
      for d in range(D):
        k = max(x for x in range(K) if offs[x] <= d)
        cur = None
        for j in range(i, L):
          for s, (n, m) in enumerate(tables.submeshes[k]):
            t = tables.stage_time_s[k][i, j, s]
            d2 = d + n * m
            if t > tau or d2 > offs[k + 1] or (j + 1, d2) not in F:
              continue
            if j == L - 1:
              c, nn = 0.0, 1
            else:
              c = (tables.inter_comm_s[k, j] if d2 == offs[k + 1] else tables.intra_comm_s[k, j])
              if c > tau:
                continue
              nn = F[(j + 1, d2)][1] + warmup_delta(c, tau, eps)
            if tables.param_mem_bytes[k][i, j, s] + min(nn, B) * tables.act_mem_bytes[k][i, j, s] \
                > tables.device_memory_bytes[k]:
              continue
            v = F[(j + 1, d2)][0] + t + 2 * c
            if cur is None or v < cur[0]:
              cur = (v, nn)
        if cur is not None:
          F[(i, d)] = cur
    if (0, 0) in F:
      best = min(best, F[(0, 0)][0] + (B - 1) * tau)
  return best


def test_warmups_in_the_state_beat_eq17_tracking():
  """The cheapest suffix (two fast stages on c1) needs one more warm-up on c0 than the slower
  one-stage suffix; only the latter fits c0's memory. Eq. 17 keeps the former and finds no plan.
  """
  tables = _tables(
      L=3, shapes=[[(1, 1)], [(1, 1), (1, 2)]],
      times=[{(0, 0, 0): 1.0}, {(1, 1, 0): 0.3, (2, 2, 0): 0.3, (1, 2, 1): 0.8}],
      params=[{(0, 0, 0): 1.0}, {}], acts=[{(0, 0, 0): 1.0}, {}],
      mem=[4.5, 10.0], boundary=[0.2, 0.01, 0.0], dph=[1, 2])
  bf = oracle.brute_force(tables, 8, **PAPER)
  res = planner.solve(tables, 8, **PAPER)
  assert _close(res.objective_s, bf.objective_s)
  assert [s.layers for s in res.stages] == [(0, 0), (1, 2)] and res.warmups == (3, 1)
  assert _paper_dp(tables, 8, 0.1) == math.inf


def _dp_with_stage_count(tables, B, eps):
  """The paper's state with the stage count s kept (plus exact n and the bottleneck flag)."""
  L, K = tables.num_layers, tables.num_subclusters
  offs = [int(x) for x in tables.device_offsets]
  D = offs[-1]
  index = planner.SparseIndex.build(tables)
  best = math.inf
  for tau in index.candidates:
    # F[s][(i, d, n, h)] = cheapest suffix of s stages
    F = [dict() for _ in range(min(L, D) + 1)]
    F[0][(L, D, 0, 0)] = 0.0
    for s in range(1, min(L, D) + 1):
      for (j1, d2, n2, h2), v2 in F[s - 1].items():
        for i in range(j1 - 1, -1, -1):
          j = j1 - 1
          for d in range(D):
            k = max(x for x in range(K) if offs[x] <= d)
            for si, (n, m) in enumerate(tables.submeshes[k]):
              t = tables.stage_time_s[k][i, j, si]
              if d + n * m != d2 or d2 > offs[k + 1] or t > tau:
                continue
              if s == 1:
                c, nn = 0.0, 1
              else:
                c = tables.inter_comm_s[k, j] if d2 == offs[k + 1] else tables.intra_comm_s[k, j]
                if c > tau:
                  continue
                nn = min(n2 + warmup_delta(c, tau, eps), B)
              if tables.param_mem_bytes[k][i, j, si] + nn * tables.act_mem_bytes[k][i, j, si] \
                  > tables.device_memory_bytes[k]:
                continue
              key = (i, d, nn, h2 or t == tau)
              F[s][key] = min(F[s].get(key, math.inf), v2 + t + 2 * c)
    for s in range(1, len(F)):
      for (i, d, n, h), v in F[s].items():
        if i == 0 and d == 0 and h:
          best = min(best, v + (B - 1) * tau)
  return best


def test_dropping_the_stage_count_keeps_the_optimum():
  rng = np.random.default_rng(11)
  for _ in range(40):
    tables = oracle.random_tables(rng, num_layers=int(rng.integers(2, 6)))
    B = int(rng.choice([2, 8]))
    assert _close(_obj(_solve_or_inf(tables, B, cost_model="eq12", **PAPER)),
                  _dp_with_stage_count(tables, B, 0.1))


def test_gpt_like_kernel_and_twin_agree():
  prof = synthetic_gpt_profile(num_blocks=4, hidden=4096, seq_len=1024, microbatch=4)
  a = SubclusterSpec("a100", 2, 4, 40 * GiB, 25e9, peak_flops=312e12,
                     host_bandwidth_bytes_per_s=300e9)
  v = SubclusterSpec("v100", 1, 4, 32 * GiB, 25e9, peak_flops=125e12,
                     host_bandwidth_bytes_per_s=150e9)
  tables = CostTables.from_layer_costs(prof, [a, v], Link(0.625e9, 1e-4),
                                       grad_sync_microbatches=32, order="memory_to_compute")
  res = planner.solve(tables, 32)
  twin = planner.solve(tables, 32, kernel="numpy")
  loose = planner.solve(tables, 32, bound_pruning=False)
  assert _close(res.objective_s, twin.objective_s)
  assert res.plan.stages == loose.plan.stages and res.objective_s == loose.objective_s
  _check_plan_model(tables, res, 32, 0.1)
  paper = planner.solve(tables, 32, **PAPER)
  assert paper.plan.stages[0].subcluster == "v100"  # memory-to-compute order puts V100 first
  assert res.objective_s <= paper.objective_s


# --------------------------------------------------------------------------- search & backends


def _gpt_instance(rng, blocks=8):
  """A GPT-like instance of 2-3 GPU types, too large for brute force (3 layers a block + 2)."""
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=2048, seq_len=1024, microbatch=4)
  types = [("v100", 32, 125e12), ("a100", 40, 312e12), ("h100", 80, 989e12)]
  K = int(rng.integers(2, 4))
  specs = [SubclusterSpec(n, int(rng.integers(1, 4)), int(rng.choice([4, 8])),
                          mem * GiB * float(rng.uniform(0.03, 0.15)), 25e9, peak_flops=f,
                          host_bandwidth_bytes_per_s=150e9)
           for n, mem, f in (types[x] for x in rng.choice(3, K, replace=False))]
  gbps = float(rng.choice([1.0, 5.0, 25.0]))
  return CostTables.from_layer_costs(prof, specs, Link(gbps * 1.25e8, 1e-4),
                                     grad_sync_microbatches=32, order="memory_to_compute")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_never_worse_than_the_old_rule_or_one_subcluster(seed):
  """Where nothing can be checked exhaustively: the plan never simulates slower than the
  paper's planner's plan, nor than the planner's plan on any one subcluster; its predicted
  time is the simulator's."""
  rng = np.random.default_rng(500 + seed)
  checked = unproved = 0
  for _ in range(6):
    tables = _gpt_instance(rng)
    B = int(rng.choice([16, 64]))
    res = _solve_or_inf(tables, B, proof_nodes=2_000)   # too small to prove: the DP decides
    old = _solve_or_inf(tables, B, cost_model="eq12")
    if res is None:
      assert old is None
      continue
    ev = planner.evaluate_plan(tables, res.plan, B)
    assert ev.iteration_s == res.iteration_s == res.plan.predicted_iteration_s
    if old is not None:
      assert res.iteration_s <= planner.evaluate_plan(tables, old.plan, B).iteration_s
    for k in range(tables.num_subclusters):
      alone = _solve_or_inf(planner.single_subcluster(tables, k), B, proof_nodes=2_000)
      if alone is not None:
        assert res.iteration_s <= alone.iteration_s * (1 + 1e-12)
    checked += 1
    unproved += not res.stats.proved
  assert checked >= 3 and unproved >= 2, (checked, unproved)


def test_link_bound_plan_is_admitted_and_faster():
  """Two 1-device subclusters; the model needs both to be fast, and the cut between them
  (3 s per microbatch) is slower than either stage (2.5 s): the paper's rule rejects that plan
  and keeps the model on the slow device; admitted, it simulates 2.6x faster, with warm-ups
  relative to the link."""
  one = [(1, 1)]
  tables = _tables(L=2, shapes=[one, one],
                   times=[{(0, 0, 0): 2.5, (0, 1, 0): 10.0}, {(1, 1, 0): 2.5}],
                   params=[{}, {}], acts=[{}, {}], mem=[1.0, 1.0], boundary=[3.0, 0.0])
  B = 8
  old = planner.solve(tables, B, cost_model="eq12")
  new = planner.solve(tables, B)
  assert old.plan.num_stages == 1 and new.plan.num_stages == 2
  assert new.period_s == 3.0 and new.t_max_s == 2.5 and not planner.evaluate_plan(
      tables, new.plan, B).comm_ok
  assert new.warmups == h1f1b_warmups([3.0], 2.5, 0.1) == (4, 1)
  old_sim = planner.evaluate_plan(tables, old.plan, B).iteration_s
  assert new.iteration_s < 0.45 * old_sim
  assert _close(new.objective_s, oracle.brute_force(tables, B).objective_s)


def test_end_times_are_in_the_objective():
  """Tables with end-of-iteration times: the planner and a brute force that simulates every
  plan with them agree; a large end time on one subcluster moves the plan off it."""
  rng = np.random.default_rng(77)
  for x in range(12):
    tables = oracle.random_tables(rng)
    ends = tuple(np.where(np.isfinite(t), rng.uniform(0, 2.0) * t, np.inf)
                 for t in tables.stage_time_s)
    tables = tables.replace(end_time_s=ends)
    B = int(rng.choice([2, 8]))
    bf = oracle.brute_force(tables, B)
    res = _solve_or_inf(tables, B)
    assert _close(_obj(res), bf.objective_s), (x, bf, res)
    if res is not None:
      ev = planner.evaluate_plan(tables, res.plan, B)
      assert ev.iteration_s == res.iteration_s and ev.end_s[0] > 0
  one = [(1, 1)]
  base = _tables(L=1, shapes=[one, one], times=[{(0, 0, 0): 1.0}, {(0, 0, 0): 1.2}],
                 params=[{}, {}], acts=[{}, {}], mem=[1.0, 1.0], boundary=[0.0])
  assert planner.solve(base, 4).plan.stages[0].subcluster == "c0"
  slow_end = base.replace(end_time_s=(np.full((1, 1, 1), 5.0), np.zeros((1, 1, 1))))
  res = planner.solve(slow_end, 4)
  assert res.plan.stages[0].subcluster == "c1" and res.iteration_s == pytest.approx(4 * 1.2)


def _medium_tables():
  prof = synthetic_gpt_profile(num_blocks=6, hidden=4096, seq_len=1024, microbatch=4)
  a = SubclusterSpec("a100", 2, 4, 40 * GiB, 25e9, peak_flops=312e12)
  v = SubclusterSpec("v100", 2, 4, 32 * GiB, 25e9, peak_flops=125e12)
  return CostTables.from_layer_costs(prof, [v, a], Link(1.25e9), grad_sync_microbatches=64)


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_parallel_backends_return_the_identical_plan(backend):
  tables = _medium_tables()
  seq = planner.solve(tables, 64, backend="sequential", bound_pruning=False)
  par = planner.solve(tables, 64, backend=backend, workers=2, parallel_min_work=0,
                      bound_pruning=False)
  assert par.stats.backend == backend and par.stats.workers == 2
  assert par.plan == seq.plan and par.objective_s == seq.objective_s


@pytest.mark.slow
def test_ray_backend_returns_the_identical_plan():  # ~12 s on 2 cores, mostly Ray start-up
  pytest.importorskip("ray")
  tables = _medium_tables()
  seq = planner.solve(tables, 64, backend="sequential", bound_pruning=False)
  par = planner.solve(tables, 64, backend="ray", workers=2, parallel_min_work=0,
                      bound_pruning=False)
  assert par.stats.backend == "ray"
  assert par.plan.stages == seq.plan.stages and par.objective_s == seq.objective_s


def test_search_statistics_and_pruning():
  tables = _medium_tables()
  res = planner.solve(tables, 64)
  st = res.stats
  assert st.num_candidates == planner.SparseIndex.build(tables, link_bound=True).candidates.size
  assert planner.SparseIndex.build(tables).candidates.size < st.num_candidates   # + cut costs
  assert st.t_s <= res.t_max_s <= st.t_e
  assert 0 <= st.num_pruned_by_bound <= st.num_window
  assert st.num_evaluated >= 1 and st.seconds > 0


def test_sparse_index_groups_sorted_by_time():
  tables = _medium_tables()
  ix = planner.SparseIndex.build(tables)
  a = ix.arrays
  K, L = tables.num_subclusters, tables.num_layers
  assert a.ent_ptr.shape == (K, L + 1) and a.ent_ptr[-1, -1] == ix.num_entries
  S = max(len(x) for x in tables.submeshes)
  for k, i in itertools.product(range(K), range(L)):
    sl = slice(a.ent_ptr[k, i], a.ent_ptr[k, i + 1])
    assert (ix.ent_k[sl] == k).all() and (ix.ent_i[sl] == i).all()
    for s in range(S):
      x = (k * L + i) * S + s
      sub = slice(a.sp_ptr[x], a.sp_ptr[x + 1])
      assert a.sp_ptr[x] >= a.ent_ptr[k, i] and a.sp_ptr[x + 1] <= a.ent_ptr[k, i + 1]
      assert (a.ent_s[sub] == s).all() and (np.diff(a.ent_t[sub]) >= 0).all()
  fits = a.ent_p + a.ent_a <= a.mem[ix.ent_k]
  assert fits.all()
  assert ix.active_entries(ix.candidates[0]) >= 1
  assert ix.active_entries(ix.candidates[-1]) == ix.num_entries


def test_result_plan_is_a_complete_plan():
  tables = _medium_tables()
  res = planner.solve(tables, 64)
  plan = res.plan
  assert isinstance(plan, Plan) and plan.num_layers == tables.num_layers
  assert plan.num_microbatches == 64 and plan.schedule == "h1f1b"
  assert plan.eps == 0.1 and "eps" not in dict(plan.meta)
  assert Plan.from_json(plan.to_json()) == plan
  assert "Layer Range" in res.table()
  for s, spec in zip(res.stages, plan.stages):
    n, m = s.submesh
    assert spec.logical_mesh[0] * spec.logical_mesh[1] == n * m
    assert sum(x[2] for x in s.hosts) == n * m
  assert 0 < plan.eta <= 1


def test_solve_rejects_bad_arguments():
  tables = _medium_tables()
  with pytest.raises(PlanError):
    planner.solve(tables, 0)
  with pytest.raises(PlanError):
    planner.solve(tables, 8, backend="mpi")
  with pytest.raises(PlanError):
    planner.solve(tables, 8, kernel="cuda")


# --------------------------------------------------------------------------- infeasibility


def test_infeasible_memory_is_explained_with_the_shortfall():
  tables = _medium_tables()
  tiny = tables.replace(device_memory_bytes=(2 * GiB, 2 * GiB))
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tiny, 64)
  assert e.value.constraint == "memory" and "GiB" in str(e.value)


def test_infeasible_memory_with_warmups_reports_the_scale_needed():
  one = [(1, 1)]
  tables = _tables(L=2, shapes=[one, one], times=[{(0, 0, 0): 1.0}, {(1, 1, 0): 1.0}],
                   params=[{(0, 0, 0): 1.0}, {}], acts=[{(0, 0, 0): 1.0}, {}],
                   mem=[3.0, 10.0], boundary=[0.6, 0.0])
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tables, 8)
  assert e.value.constraint == "memory"
  scale = float(re.search(r"need ([0-9.]+)x the device memory", str(e.value)).group(1))
  assert abs(scale - 5.0 / 3.0) < 1e-3  # 1 + 4 warm-ups x 1 bytes on a 3-byte device


def test_infeasible_layers_and_communication():
  one = [(1, 1)]
  t1 = _tables(L=1, shapes=[one, one], times=[{(0, 0, 0): 1.0}, {(0, 0, 0): 1.0}],
               params=[{}, {}], acts=[{}, {}], mem=[1.0, 1.0], boundary=[0.0])
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(t1, 4, **PAPER)
  assert e.value.constraint == "layers"
  assert planner.solve(t1, 4).plan.num_stages == 1     # one subcluster is enough
  t2 = _tables(L=2, shapes=[one, one], times=[{(0, 0, 0): 1.0}, {(1, 1, 0): 1.0}],
               params=[{}, {}], acts=[{}, {}], mem=[1.0, 1.0], boundary=[5.0, 0.0])
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(t2, 4, cost_model="eq12")
  assert e.value.constraint == "communication" and "5.000x too slow" in str(e.value)
  # The simulator's model admits the link-bound plan: 4 microbatches over a 5 s link.
  res = planner.solve(t2, 4)
  assert res.period_s == 5.0 and res.t_max_s == 1.0 and res.warmups == (4, 1)
  assert res.iteration_s >= 4 * 5.0


def test_infeasible_device_geometry():
  tables = _tables(L=2, shapes=[[(1, 1), (1, 2)]], times=[{(0, 0, 1): 1.0, (1, 1, 1): 1.0}],
                   params=[{}], acts=[{}], mem=[1.0], boundary=[0.0, 0.0])
  with pytest.raises(InfeasiblePlanError) as e:
    planner.solve(tables, 4)
  assert e.value.constraint == "devices"


# --------------------------------------------------------------------------- evaluation


def _two_stage():
  one = [(1, 1)]
  return _tables(L=3, shapes=[one, [(1, 1), (1, 2)]],
                 times=[{(0, 0, 0): 1.0, (0, 1, 0): 2.0},
                        {(1, 2, 1): 1.5, (2, 2, 1): 0.5, (1, 1, 0): 0.7, (2, 2, 0): 0.6}],
                 params=[{(0, 0, 0): 1.0}, {}], acts=[{(0, 0, 0): 0.5}, {}],
                 mem=[10.0, 10.0], boundary=[0.25, 0.1, 0.0], intra_bw=1.0, inter_bw=0.5,
                 dph=[1, 2])


def test_evaluate_plan_eq12_and_schedules():
  tables = _two_stage()
  quads = [(0, 0, 0, 0), (1, 1, 1, 0), (2, 2, 1, 0)]
  B = 10
  ev = planner.evaluate_plan(tables, quads, B, simulator=False)
  t, c = [1.0, 0.7, 0.6], [0.5, 0.1, 0.0]
  assert ev.t_max_s == 1.0 and [s.comm_s for s in ev.stages] == c
  assert _close(ev.eq12_s, sum(a + 2 * b for a, b in zip(t, c)) + (B - 1) * 1.0)
  assert ev.warmups == h1f1b_warmups(c[:2], 1.0, 0.1) == (5, 3, 1)
  assert ev.iteration_s >= ev.eq12_s and ev.model == "analytic"
  assert planner.evaluate_plan(tables, quads, B, "1f1b", simulator=False).warmups == (3, 2, 1)
  eager = planner.evaluate_plan(tables, quads, B, "eager_1f1b", simulator=False)
  assert eager.warmups == (5, 3, 1)
  assert eager.stages[0].peak_mem_bytes == 1.0 + 5 * 0.5
  # 1F1B cannot hide the 0.5 s cut: its steady period is (1 + 0.7 + 2 x 0.5) / 2 per microbatch.
  one = planner.evaluate_plan(tables, quads, B, "1f1b", simulator=False)
  assert _close(one.steady_period_s, 1.35)


def test_evaluate_plan_accepts_plans_and_rejects_bad_ones():
  tables = _two_stage()
  spec = [StageSpec((0, 0), "c0", (1, 1)), StageSpec((1, 2), "c1", (1, 2))]
  ev = planner.evaluate_plan(tables, Plan(tuple(spec)), 4, simulator=False)
  assert ev.t_max_s == 1.5 and ev.uses_all_devices
  with pytest.raises(PlanError):
    planner.evaluate_plan(tables, [(0, 0, 0, 0), (2, 2, 1, 1)], 4)  # gap
  over = planner.evaluate_plan(tables, [(0, 0, 0, 0), (1, 1, 1, 1), (2, 2, 1, 1)], 4,
                               simulator=False)
  assert not over.devices_ok and not over.feasible


def test_pack_submeshes():
  assert pack_submeshes(2, 8, [(1, 4), (2, 8)]) is None
  got = pack_submeshes(3, 8, [(1, 4), (2, 8), (1, 2), (1, 2)])
  assert got[1] == ((0, 0, 8), (1, 0, 8)) and got[0] == ((2, 0, 4),)
  assert sorted(x[0][1] for x in (got[2], got[3])) == [4, 6]


# A planner worker process killed while the pool starts another (a slow forkserver start): the
# pool's own clean-up terminates the workers it knows of, then waits for all of them, the new
# one included, which waits forever for the queue's lock the killed worker held. Run in a
# process of its own, which would hang, with every moment forced (no timing involved).
_KILLED_WHILE_ANOTHER_STARTS = r"""
import multiprocessing, os, signal, sys, time
import concurrent.futures.process as cfp
import importlib
solve_mod = importlib.import_module("harpjax.compiler.plan.solve")

def evaluate(index, batch, *args):   # (the workers import this file too: the same stand-in)
  return [], len(batch)

solve_mod.evaluate_candidates = evaluate

def until(cond):
  while not cond():
    time.sleep(0.005)

def spawn(self):
  if not self._processes:
    return real_spawn(self)
  first = next(iter(self._processes.values()))
  until(lambda: not self._pending_work_items)   # the first worker did every batch
  def holds_the_lock():   # ... and waits for more, holding the call queue's read lock
    if self._call_queue._rlock.acquire(block=False):
      self._call_queue._rlock.release()
      return False
    return True
  until(holds_the_lock)
  p = self._mp_context.Process(target=cfp._process_worker, args=(
      self._call_queue, self._result_queue, self._initializer, self._initargs,
      self._max_tasks_per_child))
  p.start()                        # the second one starts (and waits for that lock) ...
  os.kill(first.pid, signal.SIGKILL)
  until(lambda: self._call_queue._reader.closed)   # ... the pool, broken, terminated the rest
  self._processes[p.pid] = p       # ... and only then is the second one listed

if __name__ == "__main__":
  real_spawn = cfp.ProcessPoolExecutor._spawn_process
  cfp.ProcessPoolExecutor._spawn_process = spawn
  out = solve_mod._run_parallel(None, [[0], [1]], (), "process", 2, 600.0, "forkserver")
  print("returned", out, flush=True)
  deadline = time.monotonic() + 60
  while multiprocessing.active_children() and time.monotonic() < deadline:
    time.sleep(0.05)
  print("left", len(multiprocessing.active_children()), flush=True)
"""


def test_a_worker_killed_while_the_pool_starts_another_leaves_no_process(tmp_path):
  import os
  import signal
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  script = tmp_path / "killed_while_another_starts.py"
  script.write_text(_KILLED_WHILE_ANOTHER_STARTS)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + sys.path))
  proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=180)   # seconds when it does not hang
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)   # its workers and forkserver too
    out, err = proc.communicate()
    raise AssertionError(f"the planner's pool hung: {out!r}") from None
  assert proc.returncode == 0, err[-3000:]
  assert "returned ([], 2)" in out and "left 0" in out, (out, err)
