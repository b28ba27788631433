"""Zebra stages in the planner (harpjax.compiler.plan.zebra_stages): the search over tables
with zebra entries against an enumeration of every plan with and without a zebra stage (every
group split, every number of zebra microbatches, every expert assignment), each scored by the
same evaluator and simulator; a case where zebra wins and one where it does not; the plan's
record of the choice, and what the runtime refuses (tests/runtime/test_zebra.py runs the rest)."""

import itertools
import json
import math

import numpy as np
import pytest

from tests.compiler.plan import oracle
from harpjax.cluster import paper_submeshes
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import MixedOptions, Plan, StageSpec, ZebraGroup, ZebraOptions
from harpjax.compiler.profile import CostTables, RoutedSplit
from harpjax.errors import CostTablesError, InfeasiblePlanError, PlanError


def routed_tables(*, hosts=(1, 1), dph=(2, 2), att_speed=(4.0, 1.0), exp_speed=(1.5, 1.0),
                  L=3, routed=(1, 2), experts=4, att_work=None, exp_work=None,
                  mem=(100.0, 100.0), expert_state=2.0, expert_act=1.0, routed_bytes=0.5,
                  bw=50.0, boundary=0.1, rows=4, exponent=1.0):
  """A routed model's tables: layer ``l`` has attention-side work ``att_work[l]`` and, when
  routed, expert work ``exp_work[l]``; subcluster ``k`` runs them at ``att_speed[k]`` and
  ``exp_speed[k]`` per device, ``g ** exponent`` times faster on ``g`` devices; parameters 1
  byte per layer plus the experts' state, activations 0.5 plus the experts' per microbatch,
  over the devices."""
  att_work = att_work or [1.0] * L
  exp_work = exp_work or [2.0 if l in routed else 0.0 for l in range(L)]
  K = len(hosts)
  shapes = [paper_submeshes(n, m) for n, m in zip(hosts, dph)]
  st, pm, am, xt = [], [], [], []
  for k in range(K):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    x = np.zeros((L, S))
    for s, (n, m) in enumerate(shapes[k]):
      g = (n * m) ** exponent
      att = [att_work[l] / att_speed[k] / g for l in range(L)]
      exp = [exp_work[l] / exp_speed[k] / g for l in range(L)]
      x[:, s] = exp
      for i in range(L):
        for j in range(i, L):
          t[i, j, s] = sum(att[i:j + 1]) + sum(exp[i:j + 1])
          p[i, j, s] = sum(1.0 + (expert_state if l in routed else 0.0)
                           for l in range(i, j + 1))
          a[i, j, s] = sum(0.5 + (expert_act if l in routed else 0.0)
                           for l in range(i, j + 1)) / (n * m)
    st.append(t)
    pm.append(p)
    am.append(a)
    xt.append(x)
  bwm = np.full((K, K), float(bw))
  np.fill_diagonal(bwm, 0.0)
  on = lambda v: [v if l in routed else 0.0 for l in range(L)]
  split = RoutedSplit(num_experts=[experts if l in routed else 0 for l in range(L)],
                      expert_time_s=xt, expert_state_bytes=on(expert_state),
                      expert_act_bytes=on(expert_act), routed_bytes=on(routed_bytes))
  return CostTables(num_layers=L, subcluster_names=tuple(f"c{k}" for k in range(K)),
                    num_hosts=tuple(hosts), devices_per_host=tuple(dph),
                    device_memory_bytes=tuple(mem), submeshes=tuple(shapes),
                    stage_time_s=tuple(st), param_mem_bytes=tuple(pm), act_mem_bytes=tuple(am),
                    boundary_bytes=np.full(L, boundary),
                    intra_bandwidth_bytes_per_s=(100.0,) * K, intra_latency_s=(0.0,) * K,
                    link_bandwidth_bytes_per_s=bwm, link_latency_s=np.zeros((K, K)),
                    microbatch_rows=rows, routed_split=split)


def zebra_options(**kw):
  # no data-parallel mixed-type stages (links never fast enough): plain and zebra stages only
  return MixedOptions(zebra="on", min_link_ratio=math.inf, pair_candidates=0, **kw)


def solve(tables, B, mo):
  return planner.solve(tables, B, backend="sequential", mixed_stages="auto", mixed_options=mo,
                       schedule="h1f1b")


# --------------------------------------------------------------------------- the oracle


_packable = oracle.packable   # the brute force's own packer (independent of bin_pack)


def _reserved(tables, k, shape, count):
  n, m = shape
  M = tables.devices_per_host[k]
  return n * count if m == M else math.ceil(count / (M // m))


def _zebra_choices(tables, i, j, a, sh_a, e, sh_e, rows, max_r):
  """Every (R, offload) of a zebra stage on layers i..j, from the split alone."""
  split = tables.routed_split
  routed = [l for l in range(i, j + 1) if split.num_experts[l] > 0]
  if not routed:
    return []
  n = split.num_experts[routed[0]]
  M, N = sh_a[0] * sh_a[1], sh_e[0] * sh_e[1]
  if n % N or any(split.num_experts[l] != n for l in routed):
    return []
  chunk = M // math.gcd(M, N)
  per = range(0, n // N + 1, chunk)
  # a zebra microbatch's rows are a multiple of the attention group's data-parallel degree
  # (these tables' logical mesh: (M, 1))
  return [(r, tuple(o)) for r in range(1, min(rows, max_r) + 1)
          if rows % r == 0 and (rows // r) % M == 0
          for o in itertools.product(per, repeat=len(routed))], routed


def brute_force_zebra(tables, B, mo, zebra=True, max_r=8, max_hosts=2):
  """The best simulated H-1F1B time (``evaluate_mixed``) over every plan of plain stages
  (each subcluster one contiguous run, any order the links allow) and, with ``zebra``, every
  plan with zebra stages of one shape (one contiguous run): every attention/expert pair of
  subclusters, every group submesh, and per zebra stage every R and expert assignment.
  Returns ``(time, stages)``."""
  L, K = tables.num_layers, tables.num_subclusters
  b = mo.microbatch_rows
  names = tables.subcluster_names

  def group_shapes(k):
    N, M = tables.num_hosts[k], tables.devices_per_host[k]
    out = [(h, M) for h in range(1, min(N, max_hosts) + 1)] + [(1, m) for m in range(1, M)]
    return [s for s in out if s in tables.submeshes[k]]
  shapes = [None]
  if zebra:
    shapes += [(a, sa, e, se) for a in range(K) for e in range(K) if a != e
               and tables.link_bandwidth_bytes_per_s[a][e] > 0
               for sa in group_shapes(a) for se in group_shapes(e)]
  best = (math.inf, None)
  for shape in shapes:

    def rec(i, unit, used, plain, nz, stages):
      for j in range(i, L):
        if unit == "z":
          a, sa, e, se = shape
          got = _zebra_choices(tables, i, j, a, sa, e, se, b, max_r)
          opts = [] if not got else [StageSpec((i, j), names[a], sa, zebra=ZebraGroup(
              names[e], se, r, got[1], o)) for r, o in got[0]]
          nz2, pl = nz + 1, plain
        else:
          opts = [StageSpec((i, j), names[unit], sh) for sh in tables.submeshes[unit]]
          nz2 = nz
        for spec in opts:
          pl = plain if unit == "z" else {**plain, unit: plain.get(unit, []) + [spec.submesh]}
          ok = True
          for k in range(K):
            held = 0
            if shape is not None:
              a, sa, e, se = shape
              held = (_reserved(tables, k, sa, nz2) if k == a else 0) + \
                  (_reserved(tables, k, se, nz2) if k == e else 0)
            if held > tables.num_hosts[k] or not _packable(
                tables.num_hosts[k] - held, tables.devices_per_host[k], pl.get(k, [])):
              ok = False
          if not ok:
            continue
          st = stages + [spec]
          if j == L - 1:
            yield st
            continue
          yield from rec(j + 1, unit, used, pl, nz2, st)
          for v in [k for k in range(K) if k not in used] + (
              ["z"] if shape is not None and "z" not in used else []):
            if v != unit:
              yield from rec(j + 1, v, used | {v}, pl, nz2, st)

    for u in list(range(K)) + (["z"] if shape is not None else []):
      for stages in rec(0, u, frozenset([u]), {}, 0, []):
        if shape is not None and not any(s.zebra for s in stages):
          continue
        ev = planner.evaluate_mixed(tables, stages, B, mo, schedule="h1f1b")
        if ev.feasible and ev.iteration_s < best[0]:
          best = (ev.iteration_s, stages)
  return best


# --------------------------------------------------------------------------- the search


def _random_case(seed):
  rng = np.random.default_rng(7000 + seed)
  L = int(rng.integers(2, 4))
  routed = tuple(l for l in range(L) if rng.random() < 0.7) or (L - 1,)
  tables = routed_tables(
      L=L, routed=routed, dph=(2, int(rng.choice([1, 2]))),
      att_speed=(float(rng.uniform(2.0, 5.0)), 1.0), exp_speed=(float(rng.uniform(0.8, 2.0)), 1.0),
      att_work=list(rng.uniform(0.5, 2.0, L)), exp_work=[float(rng.uniform(0.5, 4.0))
                                                        if l in routed else 0.0
                                                        for l in range(L)],
      routed_bytes=float(rng.choice([0.05, 0.5, 2.0])), bw=float(rng.choice([5.0, 50.0])),
      exponent=float(rng.uniform(0.7, 1.0)), rows=int(rng.choice([2, 4])))
  return tables, int(rng.integers(2, 5))


@pytest.mark.parametrize("seed", range(2))
def test_planner_matches_brute_force_with_zebra_stages(seed):
  tables, B = _random_case(seed)
  mo = zebra_options(microbatch_rows=tables.microbatch_rows)
  want, stages = brute_force_zebra(tables, B, mo)
  plain, _ = brute_force_zebra(tables, B, mo, zebra=False)
  got = solve(tables, B, mo)
  assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.iteration_s, want, stages)
  assert got.iteration_s <= plain * (1 + 1e-12)
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.iteration_s == got.plan.predicted_iteration_s
  assert ev.warmups == got.plan.warmups


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 22))
def test_planner_matches_brute_force_with_zebra_stages_more(seed):
  test_planner_matches_brute_force_with_zebra_stages(seed)


def test_zebra_wins_where_attention_is_much_faster_on_the_newer_gpus():
  # c0 runs attention 6x faster than c1 but experts only 1.2x: attention on c0, experts on c1
  tables = routed_tables(att_speed=(6.0, 1.0), exp_speed=(1.2, 1.0), att_work=[1.0, 1.0, 1.0],
                         exp_work=[0.0, 3.0, 3.0], routed_bytes=0.05, bw=100.0)
  B = 4
  mo = zebra_options(microbatch_rows=4)
  want, stages = brute_force_zebra(tables, B, mo)
  plain, _ = brute_force_zebra(tables, B, mo, zebra=False)
  got = solve(tables, B, mo)
  assert any(s.zebra is not None for s in stages)
  assert math.isclose(got.iteration_s, want, rel_tol=1e-9)
  assert got.iteration_s < 0.9 * plain
  z = [s for s in got.plan.stages if s.zebra is not None]
  assert z and z[0].subcluster == "c0" and z[0].zebra.subcluster == "c1"
  assert "Zebra" in got.plan.table() and "c0|c1" in got.plan.table()


def test_zebra_loses_where_the_gpus_differ_alike_and_the_link_is_slow():
  # both parts 2x faster on c0 and a slow link between the groups: no zebra stage pays
  tables = routed_tables(att_speed=(2.0, 1.0), exp_speed=(2.0, 1.0), routed_bytes=4.0, bw=2.0)
  B = 4
  mo = zebra_options(microbatch_rows=4)
  want, _ = brute_force_zebra(tables, B, mo)
  plain, _ = brute_force_zebra(tables, B, mo, zebra=False)
  got = solve(tables, B, mo)
  assert want == plain
  assert math.isclose(got.iteration_s, plain, rel_tol=1e-9)
  assert not any(s.zebra is not None for s in got.plan.stages)
  off = planner.solve(tables, B, backend="sequential", mixed_stages="auto",
                      mixed_options=MixedOptions(microbatch_rows=4), schedule="h1f1b")
  assert off.iteration_s == got.iteration_s


def test_zebra_is_considered_by_default_and_not_when_off():
  # MixedOptions' default zebra="auto" plans zebra stages (solve, `harpjax plan` and
  # auto_parallel on the local runtime alike); "off" does not
  tables = routed_tables(att_speed=(6.0, 1.0), exp_speed=(1.2, 1.0), exp_work=[0.0, 3.0, 3.0],
                         routed_bytes=0.05, bw=100.0)
  kw = dict(microbatch_rows=4, min_link_ratio=math.inf)
  got = planner.solve(tables, 4, backend="sequential", mixed_options=MixedOptions(**kw))
  off = planner.solve(tables, 4, backend="sequential",
                      mixed_options=MixedOptions(zebra="off", **kw))
  assert any(s.zebra is not None for s in got.plan.stages)
  assert not any(s.zebra is not None for s in off.plan.stages)
  assert got.iteration_s < off.iteration_s


def test_memory_moves_experts_onto_the_attention_group():
  # the expert GPU cannot hold both layers' experts: the chosen stage offloads some
  tables = routed_tables(hosts=(1, 1), dph=(2, 1), att_speed=(6.0, 1.0), exp_speed=(1.2, 1.0),
                         exp_work=[0.0, 3.0, 3.0], routed_bytes=0.05, bw=100.0,
                         mem=(100.0, 4.5), expert_state=2.0, expert_act=0.5)
  B = 2
  mo = zebra_options(microbatch_rows=2)
  z = planner.zebra_stage_cost(tables, (0, 2), (0, 1), (1, 0), 2)
  assert z is not None and sum(z.offload) > 0
  assert z.expert_param_bytes + z.expert_act_bytes <= 4.5
  free = planner.zebra_stage_cost(tables, (0, 2), (0, 1), (1, 0), 2, num_microbatches=1,
                                  offload=(0, 0))
  assert free.max_inflight(B) == 0   # without offload nothing fits
  got = solve(tables, B, mo)
  ev = planner.evaluate_mixed(tables, got.plan, B, mo)
  assert ev.feasible and ev.iteration_s == got.iteration_s


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_zebra_stage_cost_is_the_zebra_simulator(alpha):
  tables = routed_tables()
  c = planner.zebra_stage_cost(tables, (0, 2), (0, 1), (1, 1), 4,
                               ZebraOptions(fixed_fraction=alpha), num_microbatches=2,
                               offload=(1, 0))
  x = alpha + (1 - alpha) / 2   # each of the 2 zebra microbatches' share of a compute task
  # by hand: attention side of layers 0+1 then 2 (tail 0), experts of 1 and 2, on 2+2 GPUs
  from harpjax.cluster import Link
  from harpjax.compiler.schedule import bipartite_all_to_all_time_s, simulate_zebra, ZebraCosts
  f = 1.0 / 3.0
  att = np.array([1.0 / 4 / 2 * 2, 1.0 / 4 / 2, 0.0])   # c0 on 2 devices
  exp = np.array([2.0 / 1.0 / 2, 2.0 / 1.0 / 2])        # c1 on 2 devices
  on_attn = np.array([2.0 / 1.5 / 2, 2.0 / 1.5 / 2]) * 2 / 2
  keep = np.array([1.0 / 2.0, 1.0])                      # 1 of 2 experts per expert GPU moved
  share = np.array([2 * 1 / 2 / 2, 0.0])
  comm = [bipartite_all_to_all_time_s(0.5 / 2, 2, 2, k, Link(50.0, 0.0)) for k in keep]
  costs = ZebraCosts(2, 2, att * f * x, att * (1 - f) * x, exp * keep * f * x,
                     exp * keep * (1 - f) * x, comm, comm, comm, comm,
                     on_attn * share * f * x, on_attn * share * (1 - f) * x)
  assert math.isclose(c.time_s, simulate_zebra(costs).iteration_time, rel_tol=1e-12)
  assert c.routed_layers == (1, 2) and c.offload == (1, 0) and c.num_microbatches == 2


def test_a_zebra_plan_is_recorded_shown_and_scored_only_by_evaluate_mixed():
  tables = routed_tables(att_speed=(6.0, 1.0), exp_speed=(1.2, 1.0), exp_work=[0.0, 3.0, 3.0],
                         routed_bytes=0.05, bw=100.0)
  got = solve(tables, 4, zebra_options(microbatch_rows=4))
  plan = got.plan
  assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
  z = next(s for s in plan.stages if s.zebra is not None)
  assert z.num_devices == z.submesh[0] * z.submesh[1] + z.zebra.num_devices
  assert f"R={z.zebra.num_microbatches}" in plan.table()
  with pytest.raises(PlanError, match="zebra stage.*evaluate_mixed"):
    planner.evaluate_plan(tables, plan, 4)
  with pytest.raises(PlanError, match="offload"):
    StageSpec((0, 2), "c0", (1, 2), zebra=ZebraGroup("c1", (1, 2), 2, (1, 2), (0,)))
  with pytest.raises(PlanError, match="routed"):
    planner.evaluate_mixed(tables, [StageSpec((0, 2), "c0", (1, 2), zebra=ZebraGroup(
        "c1", (1, 2), 2, (0, 2), (0, 0)))], 4, MixedOptions(microbatch_rows=4))
  for R in (3, 4):   # 4 rows: R = 3 does not divide them, R = 4 leaves 1 row for 2 devices
    with pytest.raises(PlanError, match="divide"):
      planner.evaluate_mixed(tables, [StageSpec((0, 2), "c0", (1, 2), zebra=ZebraGroup(
          "c1", (1, 2), R, (1, 2), (0, 0)))], 4, MixedOptions(microbatch_rows=4))


def test_routed_split_is_checked_against_its_tables():
  tables = routed_tables()
  split = tables.routed_split
  with pytest.raises(CostTablesError, match="exceeds"):
    tables.replace(routed_split=RoutedSplit(split.num_experts,
                                            [x * 100 for x in split.expert_time_s],
                                            split.expert_state_bytes, split.expert_act_bytes,
                                            split.routed_bytes))
  with pytest.raises(CostTablesError, match="no experts"):
    RoutedSplit([0, 4, 4], split.expert_time_s[:1] + tuple(np.ones((3, 2)) for _ in (0,)),
                0.0, 0.0, 0.0)
  # a transformation of the entries drops it
  assert tables.without_communication().routed_split is not None
  assert tables.replace(stage_time_s=tables.stage_time_s).routed_split is None


def test_the_runtime_refuses_what_it_does_not_run_of_a_zebra_plan_by_name():
  import jax
  import jax.numpy as jnp
  import optax
  from flax.training import train_state

  import harpjax
  from harpjax.errors import ZebraPlanOnlyError
  from harpjax.models import MLP
  from tests.equivalence import DEMO_CLUSTER
  model = MLP(features=(16, 16, 16), num_classes=4)
  x = jnp.ones((8, 6))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(0.1))

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batch = {"x": jax.random.normal(jax.random.key(1), (8, 6)), "y": jnp.arange(8) % 4}
  # a ZeRO level on a zebra stage: planned, not run
  plan = harpjax.ManualPlan([StageSpec((0, 1), "v100", (1, 2)),
                             StageSpec((2, 3), "a100", (1, 2), zero=1, zebra=ZebraGroup(
                                 "v100", (1, 2), 2, (2,), (1,)))])
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan)
  with pytest.raises(ZebraPlanOnlyError, match="zebra stage.*does not run"):
    pstep(state, batch)
  # a layer without experts named routed
  plan = harpjax.ManualPlan([StageSpec((0, 1), "v100", (1, 2)),
                             StageSpec((2, 3), "a100", (1, 2), zebra=ZebraGroup(
                                 "v100", (1, 2), 1, (2,), (0,)))])
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan)
  with pytest.raises(PlanError, match="names layer 2 as routed, but it reads no expert"):
    pstep(state, batch)


def test_the_zebra_mode_auto_on_off_and_the_deprecated_plan_only():
  from harpjax.compiler.plan import zebra_for_runtime
  from harpjax.errors import InvalidOptionError
  assert MixedOptions().zebra == "auto"   # auto_parallel, solve and `harpjax plan` alike
  with pytest.warns(DeprecationWarning, match="'plan-only' is deprecated.*zebra='on'"):
    assert MixedOptions(zebra="plan-only").zebra == "on"
  with pytest.raises(InvalidOptionError, match="MixedOptions.zebra"):
    MixedOptions(zebra="yes")
  # auto: considered where the runtime runs zebra stages (local), not for Ray; on stays on
  # (the Ray runtime then refuses the plan by name)
  assert zebra_for_runtime(MixedOptions(), local=True).zebra == "auto"
  assert zebra_for_runtime(MixedOptions(), local=False).zebra == "off"
  assert zebra_for_runtime(MixedOptions(zebra="on"), local=False).zebra == "on"
  assert zebra_for_runtime(MixedOptions(zebra="off"), local=True).zebra == "off"
