"""Cuts costed where the stages sit: the link inside a host when two consecutive stages share
one, in the DP (Numba kernel and NumPy twin, every objective and resource mode), in
evaluate_plan and the simulator, and in the allocator that hands out the devices."""

import itertools
import math

import numpy as np
import pytest

from harpjax.cluster import Cluster, allocate_submeshes, host_joins, place_stages
from harpjax.compiler import plan as planner
from harpjax.compiler.profile import CostTables, SubclusterSpec, synthetic_gpt_profile
from harpjax.compiler.schedule import make_schedule, simulate
from harpjax.errors import InfeasiblePlanError
from tests.compiler.plan import oracle

GiB = 2.0 ** 30
MODES = [dict(), dict(keep_order=True), dict(use_all_devices=True),
         dict(use_all_devices=True, keep_order=True)]


def _with_host_links(rng, tables: CostTables) -> CostTables:
  """The tables with a host link 3-50x faster than each subcluster's own link."""
  K = tables.num_subclusters
  fast = tuple(float(b * rng.choice([3.0, 10.0, 50.0]))
               for b in tables.intra_bandwidth_bytes_per_s)
  return tables.replace(host_bandwidth_bytes_per_s=fast,
                        host_latency_s=tuple(float(x) for x in rng.uniform(0.0, 0.005, K)))


def _solve(tables, B, **kw):
  # The search's exactness is about H-1F1B's stages: the schedule stays H-1F1B (the choice of
  # schedule after the search: tests/compiler/plan/test_schedule_choice.py).
  kw.setdefault("schedule", "h1f1b")
  try:
    return planner.solve(tables, B, backend="sequential", **kw)
  except InfeasiblePlanError:
    return None


def _value(res, money=False):
  if res is None:
    return math.inf
  return res.rate_per_hour * res.objective_s if money else res.objective_s


def _close(a, b):
  return a == b or math.isclose(a, b, rel_tol=1e-9)


@pytest.mark.parametrize("chunk", range(3))
def test_optimum_with_host_links_matches_brute_force(chunk):
  """The simulator-judged search equals a brute force that places each plan's stages itself
  (oracle.sharing_cuts) on random instances with hosts of up to 4 devices; proved; the plan's
  predicted time is evaluate_plan's, to the bit. Host links make some plans strictly faster."""
  rng = np.random.default_rng(4000 + chunk)
  faster = 0
  for x in range(20):
    plain = oracle.random_tables(rng, max_devices=8)
    tables = _with_host_links(rng, plain)
    B = int(rng.choice([2, 4, 8, 32]))
    eps = float(rng.choice([0.0, 0.1]))
    mode = MODES[x % len(MODES)]
    bf = oracle.brute_force(tables, B, eps=eps, **mode)
    res = _solve(tables, B, eps=eps, **mode)
    assert _close(_value(res), bf.objective_s), (mode, bf, res)
    faster += bf.objective_s < oracle.brute_force(plain, B, eps=eps, **mode).objective_s * (
        1 - 1e-9)
    if res is None:
      continue
    assert res.stats.proved
    ev = planner.evaluate_plan(tables, res.plan, B, eps=eps)
    assert ev.iteration_s == res.plan.predicted_iteration_s and ev.feasible
    assert [s.comm_s for s in ev.stages] == [s.comm_s for s in res.plan.stages]
  if chunk == 0:
    assert faster >= 1


def test_paper_model_twin_and_prices_match_brute_force_with_host_links():
  """Eq. 12 (kernel and NumPy twin) and the money objective, with host links."""
  rng = np.random.default_rng(4100)
  for x in range(12):
    tables = _with_host_links(rng, oracle.random_tables(rng, max_devices=8,
                                                         priced=x % 2 == 1))
    B = int(rng.choice([2, 4, 8]))
    mode = MODES[x % len(MODES)]
    bf = oracle.brute_force(tables, B, cost_model="eq12", **mode)
    for kernel in ("numba", "numpy"):
      res = _solve(tables, B, cost_model="eq12", kernel=kernel, **mode)
      assert _close(_value(res), bf.objective_s), (kernel, mode)
    if x % 2 == 1:
      bf = oracle.brute_force(tables, B, objective="min_cost", **mode)
      res = _solve(tables, B, objective="max_throughput_per_dollar", **mode)
      assert _close(_value(res, money=True), bf.objective_s), mode


def _two_hosts(boundary_bytes=64e6):
  """2 hosts x 4 A100 on 10 Gbps NICs, NVLink (300 GB/s) inside a host; an 8-layer model."""
  a100 = SubclusterSpec("a100", 2, 4, 40 * GiB, 1.25e9, peak_flops=312e12, latency_s=5e-5,
                        host_bandwidth_bytes_per_s=300e9, host_latency_s=2e-6)
  prof = synthetic_gpt_profile(num_blocks=2, hidden=2048, seq_len=1024, microbatch=4)
  return CostTables.from_layer_costs(prof, [a100])


def test_a_cut_inside_a_host_is_priced_at_the_host_link():
  """Two (1, 2) stages on one host of 2 x 4 A100: their cut uses NVLink (0.2 ms for the
  issue's bytes), not the 10 Gbps NIC (tens of ms); a (1, 4) then (1, 4) crosses hosts."""
  tables = _two_hosts()
  L = tables.num_layers
  j = 3
  s2, s4 = tables.submesh_index(0, (1, 2)), tables.submesh_index(0, (1, 4))
  same = [(0, j, 0, s2), (j + 1, L - 1, 0, s2)]
  apart = [(0, j, 0, s4), (j + 1, L - 1, 0, s4)]
  b = tables.boundary_bytes[j]
  assert tables.cut_costs(same)[0] == pytest.approx(2e-6 + b / 300e9)
  assert tables.cut_costs(apart)[0] == pytest.approx(5e-5 + b / 1.25e9)
  ev = planner.evaluate_plan(tables, same, 8)
  assert ev.stages[0].comm_s == tables.cut_costs(same)[0]
  assert ev.stages[0].hosts[0][0] == ev.stages[1].hosts[0][0]   # they sit on one host
  # the simulator scores the plan with that cut
  t = [s.time_s for s in ev.stages]
  sim = simulate([x / 3 for x in t], [2 * x / 3 for x in t], [ev.stages[0].comm_s],
                 make_schedule("h1f1b", 2, 8, list(ev.warmups)), num_microbatches=8)
  assert sim.iteration_time == pytest.approx(ev.iteration_s)
  # without the host link the same plan pays the NIC: slower
  nic = tables.replace(host_bandwidth_bytes_per_s=None, host_latency_s=None)
  assert planner.evaluate_plan(nic, same, 8).iteration_s > ev.iteration_s


def test_the_allocator_puts_joined_stages_on_one_host():
  """The devices the runtime gets follow the priced placement: stages whose cut is priced
  inside a host share a host, on a cluster file too."""
  cluster = Cluster.simple([("a100", "A100-40G", 2, 4)])
  shapes = [(1, 1), (1, 2), (1, 1), (1, 4)]
  devs = cluster.allocate_submeshes([("a100", s) for s in shapes])
  host = lambda x: {cluster.host_of_device(d).name for d in devs[x]}
  joins = host_joins(4, shapes)
  assert joins == [True, True, False]
  for x, joined in enumerate(joins):
    assert (host(x) == host(x + 1)) == joined


@pytest.mark.parametrize("N, M", [(1, 4), (2, 4), (3, 4), (2, 8)])
def test_placement_fits_whatever_fits_and_realises_the_joins(N, M):
  """place_stages: every run of stages whose devices add up to at most N M fits (divisible
  widths), no host is over-filled, and each cut host_joins prices inside a host is."""
  shapes = [(1, w) for w in (1, 2, 4) if w < M] + [(1, M)] + [(n, M) for n in range(2, N + 1)]
  for length in range(1, 5 if M == 8 else 6):
    for seq in itertools.product(shapes, repeat=length):
      if sum(n * m for n, m in seq) > N * M:
        continue
      where = place_stages(N, M, seq)
      assert where is not None, seq
      fill = {}
      for (n, m), w in zip(seq, where):
        assert sum(c for _, _, c in w) == n * m
        for h, first, c in w:
          fill.setdefault(h, []).append((first, first + c))
      for spans in fill.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= M
      for x, joined in enumerate(host_joins(M, seq)):
        if joined:
          assert {h for h, _, _ in where[x]} == {h for h, _, _ in where[x + 1]}, seq
      local = allocate_submeshes("c", N, M, list(enumerate(seq)))
      for x, joined in enumerate(host_joins(M, seq)):
        if joined:
          assert {d // M for d in local[x]} == {d // M for d in local[x + 1]}


def test_tables_without_host_links_plan_as_before():
  """No host link (or one that prices cuts as the subcluster's own link does): every cut
  inside a subcluster is priced on its own link and the device states are the device count,
  as before."""
  tables = _two_hosts().replace(host_bandwidth_bytes_per_s=None, host_latency_s=None)
  assert tables.host_priced == (False,)
  same = tables.replace(host_bandwidth_bytes_per_s=tables.intra_bandwidth_bytes_per_s,
                        host_latency_s=tables.intra_latency_s)
  assert same.host_priced == (False,)
  a = planner.solve(tables, 8, backend="sequential")
  b = planner.solve(same, 8, backend="sequential")
  assert a.plan.predicted_iteration_s == b.plan.predicted_iteration_s
