"""Mixed-type stages in the planner: the cost model, evaluate_mixed, and the search against an
exhaustive enumeration of every plan with and without mixed stages (its own code below)."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from tests.compiler.plan import oracle
from harpjax.cluster import Link, paper_submeshes
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import MixedOptions, Plan, StageGroup, StageSpec
from harpjax.compiler.profile import (
  CostTables,
  LayerProfile,
  SubclusterSpec,
  activation_offload_time_s,
)
from harpjax.compiler.schedule import h1f1b_warmups, iteration_times
from harpjax.errors import InfeasiblePlanError, PlanError

GiB = 2.0 ** 30
GBPS = 1e9 / 8


# --------------------------------------------------------------------------- the oracle


def _link(tables, a, b):
  if a == b:
    return tables.intra_bandwidth_bytes_per_s[a], tables.intra_latency_s[a]
  return tables.link_bandwidth_bytes_per_s[a][b], tables.link_latency_s[a][b]


def _oracle_cut(tables, j, send, recv, b):
  """The values go from home to home (each stage's first group), all ``b`` rows."""
  (ka, _), (kb, _) = send[0], recv[0]
  if ka == kb:
    bw, lat = tables.intra_bandwidth_bytes_per_s[ka], tables.intra_latency_s[ka]
  else:
    bw, lat = tables.link_bandwidth_bytes_per_s[ka][kb], tables.link_latency_s[ka][kb]
  return math.inf if bw <= 0 else lat + tables.boundary_bytes[j] / bw


def _oracle_stage(tables, i, j, groups, b, mo):
  """``(time, end, [(p, a, mem)], groups as (k, rows))`` of a stage on ``groups`` = ``[(k, s,
  rows)]``, or ``None`` if it cannot run."""
  out, times, ends, mems = [], [], [], []
  for k, s, r in groups:
    T = float(tables.stage_time_s[k][i, j, s])
    if not math.isfinite(T):
      return None
    n, m = tables.submeshes[k][s]
    dp, tp = tables.logical_mesh_of(k, i, j, s)
    if len(groups) > 1 and r % dp:
      return None
    frac = r / b if len(groups) > 1 else 1.0
    route = 0.0
    if out:   # not the home: its rows of the inputs and outputs cross from and to the home
      bw, lat = _link(tables, groups[0][0], k)
      if bw <= 0:
        return None
      nbytes = ((tables.boundary_bytes[i - 1] if i > 0 else 0.0)
                + (tables.boundary_bytes[j] if j < tables.num_layers - 1 else 0.0))
      route = 2 * nbytes * frac / bw + 4 * lat
    times.append(T * (mo.fixed_fraction + (1 - mo.fixed_fraction) * frac) + route
                 if len(groups) > 1 else T)
    ends.append(0.0 if tables.end_time_s is None else float(tables.end_time_s[k][i, j, s]))
    mems.append((float(tables.param_mem_bytes[k][i, j, s]),
                 float(tables.act_mem_bytes[k][i, j, s]) * frac, tables.device_memory_bytes[k]))
    out.append((k, r))
  end = max(ends)
  if len(groups) > 1:
    grad = (sum(mo.grad_bytes[i:j + 1]) if mo.grad_bytes is not None else
            max(mo.grad_fraction * float(tables.param_mem_bytes[k][i, j, s])
                * tables.logical_mesh_of(k, i, j, s)[1] for k, s, _ in groups))
    for k, _, _ in groups[1:]:   # to the home and back, one group after the other
      bw, lat = _link(tables, groups[0][0], k)
      end += math.inf if bw <= 0 else 2 * (grad / bw + lat)
  return max(times), end, mems, out


_packable = oracle.packable   # the brute force's own packer (independent of bin_pack)


def _mixed_shapes(tables, max_hosts, b):
  """Every mixed-stage shape: members (pairwise linked both ways), the submesh of each (whole
  hosts, or inside one host), rows."""
  K = tables.num_subclusters
  out = []
  for size in range(2, K + 1):
    for members in itertools.combinations(range(K), size):
      if any(tables.link_bandwidth_bytes_per_s[a][c] <= 0
             for a, c in itertools.permutations(members, 2)):
        continue
      options = []
      for k in members:
        N, M = tables.num_hosts[k], tables.devices_per_host[k]
        opts = [(h, M) for h in range(1, min(N, max_hosts) + 1)]
        opts += [(1, m) for m in range(1, M)]
        options.append([s for s in opts if s in tables.submeshes[k]])
      for shapes in itertools.product(*options):
        for rows in itertools.product(range(1, b + 1), repeat=size):
          if sum(rows) == b:
            out.append((members, shapes, rows))
  return out


def _reserved(tables, k, shape, count):
  """Hosts of ``k`` that ``count`` mixed groups of ``shape`` hold (no plain stage beside)."""
  n, m = shape
  M = tables.devices_per_host[k]
  return n * count if m == M else math.ceil(count / (M // m))


def brute_force_mixed(tables, B, mo, eps=0.1, fwd_fraction=1.0 / 3.0, mixed=True,
                      use_all=False, rank=None):
  """The best simulated time over every plan: plain stages (each subcluster one contiguous
  run) and, with ``mixed``, mixed stages of one shape (one contiguous run; hosts holding their
  groups hold no plain stage), in any order the links allow. Returns ``(time, plan)``;
  ``(inf, None)`` if none fits. ``rank(times, plans)``: the values to minimise instead of the
  times (``plans`` each ``(stages, shape)``, a stage ``(i, j, subcluster or "m", submesh)``);
  the value is returned then."""
  L, K = tables.num_layers, tables.num_subclusters
  b = mo.microbatch_rows
  shapes = [None] + (_mixed_shapes(tables, mo.max_hosts_per_group, b) if mixed else [])
  cands = []
  for shape in shapes:
    groups_of = None
    if shape is not None:
      members, gshapes, rows = shape
      groups_of = [(k, tables.submeshes[k].index(sh), r)
                   for k, sh, r in zip(members, gshapes, rows)]

    def rec(i, unit, used, plain, nmixed, stages):
      for j in range(i, L):
        opts = []
        if unit == "m":
          opts.append(("m", None))
        else:
          for s, sh in enumerate(tables.submeshes[unit]):
            opts.append((unit, s))
        for u, s in opts:
          if u == "m":
            nm, pl = nmixed + 1, plain
          else:
            nm, pl = nmixed, {**plain, u: plain.get(u, []) + [tables.submeshes[u][s]]}
          ok = True
          for k in range(K):
            used_h = 0
            if shape is not None and k in members:
              used_h = _reserved(tables, k, gshapes[members.index(k)], nm)
            if used_h > tables.num_hosts[k] or not _packable(
                tables.num_hosts[k] - used_h, tables.devices_per_host[k], pl.get(k, [])):
              ok = False
          if not ok:
            continue
          st = stages + [(i, j, u, s)]
          if j == L - 1:
            yield st
            continue
          yield from rec(j + 1, u, used, pl, nm, st)
          nexts = [k for k in range(K) if k not in used] + (
              ["m"] if shape is not None and "m" not in used else [])
          for v in nexts:
            if v != u:
              yield from rec(j + 1, v, used | {v}, pl, nm, st)

    starts = list(range(K)) + (["m"] if shape is not None else [])
    for u in starts:
      for plan in rec(0, u, frozenset([u]), {}, 0, []):
        nums = []
        for i, j, u2, s in plan:
          gs = groups_of if u2 == "m" else [(u2, s, b)]
          nums.append(_oracle_stage(tables, i, j, gs, b, mo))
        if any(x is None for x in nums):
          continue
        if use_all and sum(tables.submeshes[k][s2][0] * tables.submeshes[k][s2][1]
                           for i, j, u2, s in plan
                           for k, s2, _ in (groups_of if u2 == "m" else [(u2, s, b)])
                           ) != tables.total_devices:
          continue
        t = [x[0] for x in nums]
        c = [_oracle_cut(tables, plan[x][1], nums[x][3], nums[x + 1][3], b)
             for x in range(len(plan) - 1)]
        if not all(math.isfinite(x) for x in c):
          continue
        warm = h1f1b_warmups(c, max(t), eps)
        if not all(p + min(w, B) * a <= mem for x, w in zip(nums, warm) for p, a, mem in x[2]):
          continue
        cands.append((t, c + [0.0], [x[1] for x in nums], warm, plan, shape))
  if not cands:
    return math.inf, None
  S = max(len(x[0]) for x in cands)
  pad = lambda v, fill=0.0: list(v) + [fill] * (S - len(v))
  times = iteration_times([pad(x[0]) for x in cands], [pad(x[1]) for x in cands],
                          [pad(x[2]) for x in cands], [pad(x[3], 1) for x in cands],
                          [len(x[0]) for x in cands], B, fwd_fraction)
  if rank is not None:
    times = np.asarray(rank(times, [x[4:] for x in cands]), np.float64)
    if not np.isfinite(times).any():
      return math.inf, None
  q = int(np.argmin(times))
  return float(times[q]), cands[q][4:]


def random_mixed_tables(rng, K=None, wide=False):
  """A small instance: 2-3 subclusters of 1-3 hosts x 1-2 devices (``wide``: some of one host
  x 4), 2-3 layers, fast links, about half of them with the memory binding."""
  K = K or int(rng.choice([2, 2, 3]))
  L = int(rng.integers(2, 4))
  hosts, dph, shapes = [], [], []
  for _ in range(K):
    n, m = int(rng.integers(1, 4 if K == 2 else 3)), int(rng.choice([1, 2]))
    if wide and rng.random() < 0.5:
      n, m = 1, 4
    hosts.append(n)
    dph.append(m)
    shapes.append(paper_submeshes(n, m))
  work = rng.uniform(0.5, 2.0, L)
  speed = rng.uniform(0.3, 3.0, K)
  pw = rng.uniform(0.5, 2.0, L)
  st, pm, am = [], [], []
  for k in range(K):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    for i in range(L):
      for j in range(i, L):
        for s, (n, m) in enumerate(shapes[k]):
          g = n * m
          if rng.random() < 0.05:
            continue
          t[i, j, s] = round(work[i:j + 1].sum() / speed[k] / g ** rng.uniform(0.7, 1.0), 3) \
              + 0.001
          p[i, j, s] = pw[i:j + 1].sum()
          a[i, j, s] = rng.uniform(0.1, 1.0) * (j - i + 1) / g
    st.append(t)
    pm.append(p)
    am.append(a)
  bw = rng.choice([2.0, 10.0, 50.0], size=(K, K))
  bw = np.where(rng.random((K, K)) < 0.2, 0.0, bw)
  for k in range(K - 1):
    bw[k, k + 1] = bw[k + 1, k] = max(bw[k, k + 1], 2.0)
  return CostTables(
      num_layers=L, subcluster_names=tuple(f"c{k}" for k in range(K)), num_hosts=tuple(hosts),
      devices_per_host=tuple(dph),
      device_memory_bytes=tuple(float(rng.uniform(1.5, 7.0)) for _ in range(K)),
      submeshes=tuple(shapes), stage_time_s=tuple(st), param_mem_bytes=tuple(pm),
      act_mem_bytes=tuple(am), boundary_bytes=rng.uniform(0, 1.0, L),
      intra_bandwidth_bytes_per_s=tuple(float(rng.choice([5.0, 20.0])) for _ in range(K)),
      intra_latency_s=(0.002,) * K,
      link_bandwidth_bytes_per_s=tuple(tuple(float(x) for x in r) for r in bw),
      link_latency_s=((0.005,) * K,) * K,
      end_time_s=tuple(np.where(np.isfinite(x), 0.01 * rng.random(x.shape), 0.0) for x in st))


# --------------------------------------------------------------------------- the search


@pytest.mark.parametrize("seed", range(40))
def test_planner_matches_brute_force_with_mixed_stages(seed):
  rng = np.random.default_rng(1000 + seed)
  tables = random_mixed_tables(rng, K=2, wide=True) if seed >= 30 else random_mixed_tables(rng)
  B = int(rng.integers(2, 7))
  mo = MixedOptions(microbatch_rows=int(rng.choice([2, 3, 4])), shares="all",
                    max_hosts_per_group=2, fixed_fraction=float(rng.choice([0.0, 0.1])),
                    pair_candidates=0)   # the oracle's plans: one shape of mixed stage
  want, _ = brute_force_mixed(tables, B, mo)
  plain, _ = brute_force_mixed(tables, B, mo, mixed=False)
  try:
    got = planner.solve(tables, B, backend="sequential", mixed_stages="on", mixed_options=mo,
                        schedule="h1f1b")   # the oracle's schedule
  except InfeasiblePlanError:
    assert want == math.inf
    return
  assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.iteration_s, want)
  assert got.iteration_s <= plain * (1 + 1e-12)
  assert got.plan.predicted_iteration_s == got.iteration_s
  assert got.stats.proved   # every search (plain and each fusion) proved its optimum
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.iteration_s
  assert ev.warmups == got.plan.warmups


def test_brute_force_without_mixed_stages_is_the_plain_planner():
  """The oracle's plain part agrees with the plain planner (so it checks what it should)."""
  for seed in range(8):
    rng = np.random.default_rng(seed)
    tables = random_mixed_tables(rng)
    mo = MixedOptions(microbatch_rows=2)
    want, _ = brute_force_mixed(tables, 4, mo, mixed=False)
    try:
      got = planner.solve(tables, 4, backend="sequential", schedule="h1f1b").iteration_s
    except InfeasiblePlanError:
      got = math.inf
    assert got == want or math.isclose(got, want, rel_tol=1e-9)


def asymmetric_tables(B: int, inter_gbps: float = 100.0, optimizer_share=None,
                      offload_bps=None, params: float = 0.3e9) -> CostTables:
  """6 A100 (3 hosts x 2) + 5 V100 (5 x 1) + 3 T4 (3 x 1), a 0.3B model cut into 4 layers:
  the A100s and V100s balance two stages and leave the T4s idle. ``optimizer_share`` and
  ``offload_bps`` add the optimizer state's bytes and the host link (ZeRO and offload)."""
  L, tokens, hidden = 4, 8 * 1024, 2048
  x = tokens * hidden * 2.0
  prof = LayerProfile(flops=np.full(L, 8 * params * tokens / L),
                      param_bytes=np.full(L, 2 * params / L),
                      param_mem_bytes=np.full(L, 16 * params / L), act_bytes=np.full(L, x),
                      boundary_bytes=np.full(L, x))
  sub = lambda name, n, m, mem, peak: SubclusterSpec(
      name, n, m, mem * GiB, 100 * GBPS, peak_flops=peak, efficiency=0.5, latency_s=5e-6,
      host_bandwidth_bytes_per_s=100e9, host_latency_s=2e-6,
      offload_bandwidth_bytes_per_s=offload_bps)
  subs = [sub("a100", 3, 2, 40, 312e12), sub("v100", 5, 1, 16, 125e12),
          sub("t4", 3, 1, 16, 65e12)]
  return CostTables.from_layer_costs(prof, subs, Link(inter_gbps * GBPS, 1e-5),
                                     grad_sync_microbatches=B, optimizer_share=optimizer_share)


def test_mixed_stages_are_strictly_better_on_an_asymmetric_cluster():
  B = 32
  # 200 Gbps between the subclusters: a group's rows cross from and to its stage's home
  # fast enough for the T4s to pay (at 100 Gbps they do not).
  tables = asymmetric_tables(B, inter_gbps=200.0)
  mo = MixedOptions(microbatch_rows=64, max_hosts_per_group=5)
  plain = planner.solve(tables, B)
  got = planner.solve(tables, B, mixed_stages="on", mixed_options=mo)
  assert got.iteration_s < plain.iteration_s * (1 - 1e-3)
  assert any(s.groups for s in got.plan.stages)
  assert got.num_devices > plain.num_devices   # the T4s join
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s
  # Every mixed stage's rows, as the runtime will split them, are the ones costed.
  for st, cost in zip(got.plan.stages, ev.stages):
    assert tuple(g.rows for g in cost.groups) == (st.group_rows(64) if st.groups else (64,))
  # Over a slow link the fusion does not pay, and "auto" does not even try it.
  slow = asymmetric_tables(B, inter_gbps=1.0)
  auto = planner.solve(slow, B, mixed_stages="auto", mixed_options=mo)
  assert auto.iteration_s == planner.solve(slow, B).iteration_s
  assert not planner.candidate_fusions(slow, mo, "auto")


def test_off_is_the_plain_planner_and_on_needs_rows():
  tables = asymmetric_tables(8)
  plain = planner.solve(tables, 8)
  assert planner.solve(tables, 8, mixed_stages="off",
                       mixed_options=MixedOptions(microbatch_rows=64)).plan == plain.plan
  with pytest.raises(PlanError, match="microbatch_rows"):
    planner.solve(tables, 8, mixed_stages="on")
  assert planner.solve(tables, 8, mixed_stages="auto").plan == plain.plan
  with pytest.raises(PlanError, match="mixed_stages"):
    planner.SolveOptions(mixed_stages="yes")
  with pytest.raises(PlanError, match="MixedOptions"):
    planner.solve(tables, 8, mixed_stages="on", mixed_options={"microbatch_rows": 8})
  with pytest.raises(PlanError, match="microbatch_rows"):
    MixedOptions(microbatch_rows=0)


# --------------------------------------------------------------------------- the cost model


def test_stage_cost_by_hand():
  tables = asymmetric_tables(8)
  mo = MixedOptions(microbatch_rows=12, fixed_fraction=0.1, grad_fraction=0.25)
  a, v = tables.subcluster_index("a100"), tables.subcluster_index("v100")
  sa, sv = tables.submesh_index(a, (1, 2)), tables.submesh_index(v, (2, 1))
  cost = planner.mixed_stage_cost(tables, (0, 1), [(a, sa, 8), (v, sv, 4)], mo)
  Ta, Tv = tables.stage_time_s[a][0, 1, sa], tables.stage_time_s[v][0, 1, sv]
  assert cost.groups[0].time_s == pytest.approx(Ta * (0.1 + 0.9 * 8 / 12))
  bw, lat = tables.link_bandwidth_bytes_per_s[a][v], tables.link_latency_s[a][v]
  route = 2 * tables.boundary_bytes[1] * 4 / 12 / bw + 4 * lat   # layer 0 starts the model
  assert cost.groups[1].time_s == pytest.approx(Tv * (0.1 + 0.9 * 4 / 12) + route)
  assert cost.time_s == max(g.time_s for g in cost.groups)
  assert cost.groups[1].act_bytes == pytest.approx(tables.act_mem_bytes[v][0, 1, sv] / 3)
  assert cost.groups[0].param_bytes == tables.param_mem_bytes[a][0, 1, sa]
  grad = 0.25 * max(tables.param_mem_bytes[a][0, 1, sa], tables.param_mem_bytes[v][0, 1, sv])
  assert cost.sync_s == pytest.approx(2 * (grad / bw + lat))   # to the home and back
  assert cost.end_s == pytest.approx(max(tables.end_of(a, 0, 1, sa), tables.end_of(v, 0, 1, sv))
                                     + cost.sync_s)
  with pytest.raises(PlanError, match="data-parallel degree"):
    planner.mixed_stage_cost(tables, (0, 1), [(a, sa, 7), (v, sv, 5)], mo)
  # A cut from this stage to one on the T4s: from its home (the A100 group), all the rows.
  t4 = tables.subcluster_index("t4")
  nxt = planner.mixed_stage_cost(tables, (2, 3), [(t4, 0, 12)], mo)
  c = planner.mixed_cut_s(tables, 1, cost, nxt, mo)
  x = tables.boundary_bytes[1]
  assert c == pytest.approx(tables.link_latency_s[a][t4]
                            + x / tables.link_bandwidth_bytes_per_s[a][t4])


def test_evaluate_mixed_is_evaluate_plan_on_plain_plans_and_plain_refuses_mixed():
  tables = asymmetric_tables(16)
  res = planner.solve(tables, 16)
  mo = MixedOptions(microbatch_rows=64)
  ev = planner.evaluate_mixed(tables, res.plan, 16, mo)
  assert ev.iteration_s == res.iteration_s and ev.warmups == res.warmups
  mixed = Plan(stages=(
      StageSpec((0, 1), "a100", (3, 2), share=5,
                groups=(StageGroup("t4", (3, 1), share=1),)),
      StageSpec((2, 3), "v100", (5, 1))), num_microbatches=16)
  with pytest.raises(PlanError, match="evaluate_mixed"):
    planner.evaluate_plan(tables, mixed, 16)
  ev = planner.evaluate_mixed(tables, mixed, 16, MixedOptions(microbatch_rows=66))
  assert ev.num_devices == 14 and [len(s.groups) for s in ev.stages] == [2, 1]
  assert [g.rows for g in ev.stages[0].groups] == [54, 12]   # row_shares(66, [5, 1], [6, 3])
  assert ev.iteration_s > 0 and math.isfinite(ev.iteration_s)
  # A plan whose groups do not pack says so.
  crowded = Plan(stages=(
      StageSpec((0, 1), "a100", (3, 2), share=5, groups=(StageGroup("t4", (3, 1)),)),
      StageSpec((2, 3), "t4", (1, 1))))
  ev = planner.evaluate_mixed(tables, crowded, 16, MixedOptions(microbatch_rows=66))
  assert not ev.devices_ok and not ev.feasible


def _zero_plan(zero, offload=False, first=None):
  """A mixed stage (A100 (3, 2) at share 5 beside T4 (3, 1) at share 1) then a plain V100
  stage; both at ``zero`` / ``offload`` (the first at ``first`` when given)."""
  z0, o0 = first if first is not None else (zero, offload)
  return Plan(stages=(
      StageSpec((0, 1), "a100", (3, 2), share=5, zero=z0, offload=o0,
                groups=(StageGroup("t4", (3, 1), share=1),)),
      StageSpec((2, 3), "v100", (5, 1), zero=zero, offload=offload)), num_microbatches=16)


def _want(tables, k, i, j, s, zero, offload):
  """``(state bytes, gathers per microbatch, added end seconds, update bytes)`` of an entry by
  the variant equations (W = G = (P - O) / 2, each split over the entry's dp by the level)."""
  P, O = tables.param_mem_bytes[k][i, j, s], tables.opt_mem_bytes[k][i, j, s]
  g = tables.gather_time_s[k][i, j, s]
  dp = tables.logical_mesh_of(k, i, j, s)[0]
  W = G = (P - O) / 2
  Oz, Gz, Wz = O / dp if zero >= 1 else O, G / dp if zero >= 2 else G, W / dp if zero == 3 else W
  end = g if zero in (1, 2) else 0.0
  if offload:
    end += 2 * Oz / tables.offload_bandwidth_bytes_per_s[k]
  return (Wz + Gz if offload else Wz + Gz + Oz), (2 * g if zero == 3 else 0.0), end, \
      (Wz + Gz + Oz if offload else None)


def test_evaluate_mixed_prices_zero_and_offload_per_group():
  tables = asymmetric_tables(16, optimizer_share=0.75, offload_bps=25e9)
  mo = MixedOptions(microbatch_rows=66, fixed_fraction=0.1)
  base = planner.evaluate_mixed(tables, _zero_plan(0), 16, mo)
  # Level 0 is what it was: the optimizer share in the tables changes nothing.
  bare = tables.replace(opt_mem_bytes=None, gather_time_s=None,
                        offload_bandwidth_bytes_per_s=None)
  assert planner.evaluate_mixed(bare, _zero_plan(0), 16, mo) == base
  assert [len(c.groups) for c in base.stages] == [2, 1] and base.feasible
  prev = None
  for zero, offload in [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]:
    ev = planner.evaluate_mixed(tables, _zero_plan(zero, offload), 16, mo)
    assert ev.feasible, ev.violations
    for c, c0 in zip(ev.stages, base.stages):
      i, j = c.layers
      for g, g0 in zip(c.groups, c0.groups):
        state, gathers, end, update = _want(tables, g.subcluster, i, j, g.submesh_index, zero,
                                            offload)
        assert (g.zero, g.offload) == (zero, offload)
        assert g.param_bytes == pytest.approx(state, rel=1e-12)
        assert g.update_bytes == (None if update is None else pytest.approx(update, rel=1e-12))
        # The gathers are added whole (not scaled by the group's rows), the rest is level 0's.
        assert g.time_s == pytest.approx(g0.time_s + gathers, rel=1e-12)
        assert g.end_s == pytest.approx(g0.end_s + end, rel=1e-12)
        assert g.act_bytes == g0.act_bytes and g.rows == g0.rows
      assert c.sync_s == c0.sync_s   # one replica's gradient crosses the groups at any level
      assert c.end_s == pytest.approx(max(g.end_s for g in c.groups) + c.sync_s, rel=1e-12)
    if not offload:
      # Every group's state falls with the level (every entry here has dp > 1).
      states = [g.param_bytes for c in ev.stages for g in c.groups]
      if prev is not None:
        assert all(x < y for x, y in zip(states, prev)), (zero, states, prev)
      prev = states
    if zero == 3:   # level 3 is slower per microbatch, its time in the iteration
      assert ev.t_max_s > base.t_max_s and ev.iteration_s > base.iteration_s
  # Offload moves the optimizer state out and pays its transfer at the end of the iteration.
  z2 = planner.evaluate_mixed(tables, _zero_plan(2), 16, mo)
  off = planner.evaluate_mixed(tables, _zero_plan(2, True), 16, mo)
  assert off.iteration_s > z2.iteration_s and off.time_s == z2.time_s
  assert all(g.param_bytes < g2.param_bytes for c, c2 in zip(off.stages, z2.stages)
             for g, g2 in zip(c.groups, c2.groups))


@pytest.mark.slow
def test_evaluate_mixed_with_zero_agrees_with_evaluate_plan_on_plain_stages():
  tables = asymmetric_tables(16, optimizer_share=0.75, offload_bps=25e9)
  mo = MixedOptions(microbatch_rows=64)
  for zero, offload in [(1, False), (3, False), (2, True)]:
    # each stage on the logical mesh the tables cost it with (evaluate_plan refuses others)
    mesh = lambda k, i, j, shape: tables.logical_mesh_of(k, i, j, tables.submesh_index(k, shape))
    plan = Plan(stages=(StageSpec((0, 1), "a100", (3, 2), mesh(0, 0, 1, (3, 2)), zero=zero,
                                  offload=offload),
                        StageSpec((2, 3), "v100", (5, 1), mesh(1, 2, 3, (5, 1)), zero=zero,
                                  offload=offload)))
    ev, ref = planner.evaluate_mixed(tables, plan, 16, mo), planner.evaluate_plan(tables, plan,
                                                                                  16)
    assert ev.iteration_s == ref.iteration_s and ev.warmups == ref.warmups
    assert ev.end_s == ref.end_s and ev.time_s == tuple(st.time_s for st in ref.stages)
    assert [st.param_bytes for st in ev.planned] == [st.param_bytes for st in ref.stages]
    assert [(st.zero, st.offload) for st in ev.planned] == [(zero, offload)] * 2
  # Whatever solve returns (its plain search chooses levels, its mixed search does not),
  # evaluate_mixed gives the plan's predicted time.
  got = planner.solve(tables, 16, mixed_stages="on",
                      mixed_options=MixedOptions(microbatch_rows=64, max_hosts_per_group=5))
  ev = planner.evaluate_mixed(tables, got.plan, 16, MixedOptions(microbatch_rows=64))
  assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s


def test_evaluate_mixed_offload_update_must_fit_and_errors_without_the_data():
  tables = asymmetric_tables(16, optimizer_share=0.75, offload_bps=25e9)
  mo = MixedOptions(microbatch_rows=66)
  # A T4 too small for the update at level 0 with offload (the whole state comes in), big
  # enough without the optimizer state: the violation names the update.
  ev = planner.evaluate_mixed(tables, _zero_plan(0, True), 16, mo)
  t4 = ev.stages[0].groups[1]
  mem = (t4.param_bytes + t4.update_bytes) / 2
  small = tables.replace(device_memory_bytes=(40 * GiB, 16 * GiB, mem))
  ev = planner.evaluate_mixed(small, _zero_plan(0, True), 16, mo)
  assert not ev.mem_ok and not ev.stages[0].groups[1].update_fits
  assert ev.stages[0].max_inflight(16) == 0
  assert any("brings its offloaded optimizer state" in v for v in ev.violations), ev.violations
  bare = asymmetric_tables(16)
  with pytest.raises(PlanError, match="opt_mem_bytes.*optimizer_share"):
    planner.evaluate_mixed(bare, _zero_plan(2), 16, mo)
  with pytest.raises(PlanError, match="offload_bandwidth_bytes_per_s"):
    planner.evaluate_mixed(asymmetric_tables(16, optimizer_share=0.75),
                           _zero_plan(1, True), 16, mo)
  expanded = planner.variants.expand_variants(tables)
  with pytest.raises(PlanError, match="expanded into variants"):
    planner.evaluate_mixed(expanded, _zero_plan(3), 16, mo)
  # Only the stage that asks needs the data: level 0 everywhere scores on bare tables.
  planner.evaluate_mixed(bare, _zero_plan(0), 16, mo)
  with pytest.raises(PlanError, match="zero=1"):
    planner.evaluate_mixed(bare, _zero_plan(0, first=(1, False)), 16, mo)


@pytest.mark.parametrize("kw", [dict(use_all_devices=True), dict(cost_model="eq12"),
                                dict(objective="max_throughput_per_dollar"),
                                dict(keep_order=True)])
def test_other_modes_are_never_worse(kw):
  """Every mode of solve takes mixed stages (keep_order: none) and is never worse."""
  B = 16
  tables = asymmetric_tables(B)
  if "objective" in kw:
    tables = tables.replace(price_per_gpu_hour=(3.0, 1.5, 0.5))
  mo = MixedOptions(microbatch_rows=64, max_hosts_per_group=5)
  plain = planner.solve(tables, B, **kw)
  got = planner.solve(tables, B, mixed_stages="on", mixed_options=mo, **kw)
  value = lambda r: r.objective_s * (r.rate_per_hour or 1.0)
  assert value(got) <= value(plain) * (1 + 1e-12)
  if kw.get("keep_order"):
    assert got.plan == plain.plan
  if any(s.groups for s in got.plan.stages):
    ev = planner.evaluate_mixed(tables, got.plan, B, mo)
    assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s
    if kw.get("use_all_devices"):
      assert ev.num_devices == tables.total_devices
  if kw.get("use_all_devices"):   # the T4s need not be a stage of their own
    assert got.iteration_s < plain.iteration_s * 0.9


def test_groups_inside_one_host():
  """One host of 4 fast devices and one of 2 slow ones; a device holds one layer of two: the
  best plan is two mixed stages, each on half of every host ((1, 2) + (1, 1))."""
  L = 2
  shapes = (((1, 1), (1, 2), (1, 4)), ((1, 1), (1, 2)))
  per_layer = ({(1, 1): 1.0, (1, 2): 0.5, (1, 4): 0.25}, {(1, 1): 2.0, (1, 2): 1.0})
  st, pm, am = [], [], []
  for k in range(2):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    for i in range(L):
      for j in range(i, L):
        for s, sh in enumerate(shapes[k]):
          t[i, j, s] = per_layer[k][sh] * (j - i + 1)
          p[i, j, s] = 1.0 * (j - i + 1)
          a[i, j, s] = 0.01
    st.append(t)
    pm.append(p)
    am.append(a)
  tables = CostTables(
      num_layers=L, subcluster_names=("fast", "slow"), num_hosts=(1, 1),
      devices_per_host=(4, 2), device_memory_bytes=(1.5, 1.5), submeshes=shapes,
      stage_time_s=tuple(st), param_mem_bytes=tuple(pm), act_mem_bytes=tuple(am),
      boundary_bytes=np.full(L, 0.01), intra_bandwidth_bytes_per_s=(100.0, 100.0),
      intra_latency_s=(0.0, 0.0), inter_bandwidth_bytes_per_s=(100.0,),
      inter_latency_s=(0.0,))
  B = 8
  mo = MixedOptions(microbatch_rows=10, shares="all", grad_fraction=0.0)
  plain = planner.solve(tables, B, schedule="h1f1b")   # the oracle's schedule
  got = planner.solve(tables, B, mixed_stages="on", mixed_options=mo, schedule="h1f1b")
  want, found = brute_force_mixed(tables, B, mo)
  assert math.isclose(got.iteration_s, want, rel_tol=1e-9)
  assert got.iteration_s < plain.iteration_s * 0.9
  assert [tuple(g.submesh for g in s.all_groups) for s in got.plan.stages] == \
      [((1, 2), (1, 1))] * 2
  assert [s.group_rows(10) for s in got.plan.stages] == [(8, 2)] * 2
  assert planner.solve(tables, B, mixed_stages="on", mixed_options=MixedOptions(
      microbatch_rows=10, shares="all", sub_host=False),
      schedule="h1f1b").iteration_s == plain.iteration_s


@pytest.mark.parametrize("seed", range(15))
def test_planner_matches_brute_force_using_every_device(seed):
  rng = np.random.default_rng(3000 + seed)
  tables = random_mixed_tables(rng, K=2, wide=seed % 2 == 1)
  B = int(rng.integers(2, 7))
  mo = MixedOptions(microbatch_rows=int(rng.choice([2, 4])), shares="all",
                    pair_candidates=0)   # the oracle's plans: one shape of mixed stage
  want, _ = brute_force_mixed(tables, B, mo, use_all=True)
  try:
    got = planner.solve(tables, B, backend="sequential", mixed_stages="on", mixed_options=mo,
                        use_all_devices=True, schedule="h1f1b")   # the oracle's schedule
  except InfeasiblePlanError:
    assert want == math.inf
    return
  assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.iteration_s, want)
  assert got.num_devices == tables.total_devices


def test_evaluate_mixed_prices_residual_offload_like_evaluate_plan():
  # A plain plan with residuals in host memory scores as evaluate_plan scores it; on a mixed
  # stage each group keeps two microbatches' residuals at its rows and pays the trips.
  B = 16
  tables = asymmetric_tables(B, optimizer_share=0.75, offload_bps=25e9)
  mo = MixedOptions(microbatch_rows=64)
  res = planner.solve(tables, B, zero_levels=(0,), offload=False, offload_activations=False)
  plain = res.plan.replace(stages=tuple(dataclasses.replace(s, offload_activations=True)
                                        for s in res.plan.stages))
  ev, ref = planner.evaluate_mixed(tables, plain, B, mo), planner.evaluate_plan(tables, plain, B)
  assert ev.iteration_s == ref.iteration_s and ev.time_s == tuple(s.time_s for s in ref.stages)
  a, v = tables.subcluster_index("a100"), tables.subcluster_index("v100")
  sa, sv = tables.submesh_index(a, (1, 2)), tables.submesh_index(v, (2, 1))
  base = planner.mixed_stage_cost(tables, (0, 1), [(a, sa, 48), (v, sv, 16)], mo)
  off = planner.mixed_stage_cost(tables, (0, 1), [(a, sa, 48), (v, sv, 16)], mo,
                                 offload_activations=True)
  for g0, g1, k, s in zip(base.groups, off.groups, (a, v), (sa, sv)):
    A = tables.act_mem_bytes[k][0, 1, s] * g0.rows / 64
    assert g1.act_bytes == 0 and g1.param_bytes == pytest.approx(g0.param_bytes + 2 * A)
    assert g1.time_s == pytest.approx(
        g0.time_s + activation_offload_time_s(tables.act_mem_bytes[k][0, 1, s], 25e9))
  with pytest.raises(PlanError, match="offload_activations"):
    planner.mixed_stage_cost(asymmetric_tables(B), (0, 1), [(a, sa, 48), (v, sv, 16)], mo,
                             offload_activations=True)


def _tight_instance(memory: float, seed: int):
  """A random instance with ``memory`` times its devices' memory: ``(tables, the tables with
  the optimizer state's bytes (ZeRO), B)``."""
  rng = np.random.default_rng(7000 + seed)
  t0 = random_mixed_tables(rng, wide=bool(seed % 2))
  B = int(rng.integers(2, 7))
  t0 = dataclasses.replace(t0, device_memory_bytes=tuple(x * memory
                                                         for x in t0.device_memory_bytes))
  return t0, dataclasses.replace(t0, opt_mem_bytes=tuple(0.75 * p for p in t0.param_mem_bytes)), B


@pytest.mark.parametrize("memory, seed", [(0.3, 26), (0.5, 52)])
def test_plain_stages_of_a_mixed_plan_choose_zero(memory, seed):
  # Memory-tight random instances (tables with the optimizer state's bytes): the best plan
  # has a mixed stage next to a plain stage at ZeRO > 0, strictly faster than both the best
  # plan without mixed stages (every variant) and the best with them at level 0 only.
  t0, tables, B = _tight_instance(memory, seed)
  mo = MixedOptions(microbatch_rows=4, shares="all")

  def best(tb, mode):
    try:
      return planner.solve(tb, B, mixed_stages=mode, mixed_options=mo).iteration_s
    except InfeasiblePlanError:
      return math.inf

  got = planner.solve(tables, B, mixed_stages="on", mixed_options=mo)
  assert got.iteration_s < min(best(tables, "off"), best(t0, "on")) * (1 - 1e-6)
  stages = got.plan.stages
  assert any(s.groups for s in stages) and any(s.zero for s in stages if not s.groups)
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s


@pytest.mark.parametrize("seed", [35, 92])
def test_two_shapes_of_mixed_stage_in_one_plan(seed):
  # Three subclusters: the best plan has mixed stages of two shapes (two fusions), strictly
  # faster than the best with one shape; the evaluator agrees with the search to the bit.
  rng = np.random.default_rng(9000 + seed)
  tables = random_mixed_tables(rng, K=3, wide=not seed % 3)
  B = int(rng.integers(2, 7))
  one = MixedOptions(microbatch_rows=4, shares="all", pair_candidates=0)
  two = dataclasses.replace(one, pair_candidates=6)
  single = planner.solve(tables, B, mixed_stages="on", mixed_options=one)
  got = planner.solve(tables, B, mixed_stages="on", mixed_options=two)
  assert got.iteration_s < single.iteration_s * (1 - 1e-6)
  shapes = {tuple((g.subcluster, g.submesh) for g in s.all_groups)
            for s in got.plan.stages if s.groups}
  assert len(shapes) == 2, got.plan.table()
  ev = planner.evaluate_mixed(tables, got.plan, B, two)
  assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s == got.iteration_s
  with pytest.raises(PlanError, match="pair_candidates"):
    MixedOptions(pair_candidates=-1)


@pytest.mark.parametrize("memory, seed", [(0.5, 72), (0.5, 8)])
def test_mixed_stages_choose_zero(memory, seed):
  # Memory-tight random instances: the best plan shards a mixed stage's training state
  # (StageSpec.zero on a stage with groups), faster than every plan without mixed stages; the
  # evaluator prices it exactly as the search did.
  t0, tables, B = _tight_instance(memory, seed)
  mo = MixedOptions(microbatch_rows=4, shares="all")
  got = planner.solve(tables, B, mixed_stages="on", mixed_options=mo)
  assert any(s.zero for s in got.plan.stages if s.groups), got.plan.table()
  try:
    plain = planner.solve(tables, B, mixed_stages="off").iteration_s
  except InfeasiblePlanError:
    plain = math.inf
  assert got.iteration_s < plain
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.plan.predicted_iteration_s
