"""Asymmetric expert assignment (HeterMoE §4.2): the stage it implies, Algorithm 1, and local
search on top of it against exhaustive search."""

import itertools

import numpy as np
import pytest

from harpjax.cluster import Link
from harpjax.compiler.plan.expert_assignment import (exhaustive_assignment, ExpertAssignmentProblem,
                                                     gather_and_squeeze, local_search,
                                                     optimize_assignment)
from harpjax.compiler.schedule import simulate_zebra
from harpjax.errors import PlanError

GROUPS = [(1, 2), (2, 2), (2, 4), (4, 2), (3, 3), (2, 1), (4, 4), (3, 2)]


def random_problem(rng, comm=False):
  L = int(rng.integers(2, 5))
  R = int(rng.integers(2, 5))
  M, N = GROUPS[rng.integers(len(GROUPS))]
  n = N * int(rng.integers(2, 5))
  ta = rng.uniform(1.0, 2.0, L + 1)
  te = ta[:L] * rng.uniform(0.9, 2.0, L)          # experts mostly the bottleneck
  tx = te * rng.uniform(0.3, 0.8, L)              # attention GPUs are faster at experts
  kw = {}
  if comm:
    kw = dict(routed_bytes=rng.uniform(1e6, 4e6, L), link=Link.from_gbps(100, latency_us=5))
  return ExpertAssignmentProblem(n, M, N, R, ta, 2 * ta, te, 2 * te, tx, 2 * tx, **kw)


def test_chunks():
  def p(M, N, n=12):
    return ExpertAssignmentProblem(n, M, N, 2, 1.0, 1.0, [1.0], [1.0], [1.0], [1.0])
  assert p(2, 4).chunk == (2, 1)     # paper: n1 = N / M, n2 = 1
  assert p(4, 2).chunk == (1, 2)     # paper: n1 = 1, n2 = M / N
  assert p(3, 2).chunk == (2, 3)     # neither divides: smallest whole chunk
  with pytest.raises(PlanError, match="divide"):
    p(2, 5)


def test_costs_move_work_between_groups():
  p = ExpertAssignmentProblem(8, 2, 4, 3, [1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [4.0, 4.0],
                              [8.0, 8.0], [2.0, 2.0], [4.0, 4.0], routed_bytes=1e6,
                              link=Link.from_gbps(100))
  c0, c1 = p.costs([0, 0]), p.costs([1, 0])
  assert not c0.offloaded(0) and c1.offloaded(0) and not c1.offloaded(1)
  # One of the 2 experts per expert GPU moves: half the expert GPUs' work; the attention
  # GPUs take 4 * 1 / 2 = 2 experts each = one expert GPU's share at their speed.
  assert c1.expert_fwd_s[0] == pytest.approx(2.0) and c1.offload_fwd_s[0] == pytest.approx(2.0)
  assert c1.dispatch_fwd_s[0] < c0.dispatch_fwd_s[0]
  assert p.iteration_time([0, 0]) == simulate_zebra(c0).iteration_time


def test_memory_bounds():
  rng = np.random.default_rng(3)
  base = random_problem(rng)
  kw = {f: getattr(base, f) for f in ("num_experts", "num_attn", "num_expert",
                                      "num_microbatches", "attn_fwd_s", "attn_bwd_s",
                                      "expert_fwd_s", "expert_bwd_s", "expert_on_attn_fwd_s",
                                      "expert_on_attn_bwd_s")}
  n2 = base.chunk[1]
  capped = ExpertAssignmentProblem(**kw, max_offload=n2)
  for r in (gather_and_squeeze(capped), local_search(capped), exhaustive_assignment(capped)):
    assert sum(r.offload) <= n2
  forced = ExpertAssignmentProblem(**kw, min_offload=2 * n2)
  for r in (gather_and_squeeze(forced), local_search(forced), exhaustive_assignment(forced)):
    assert sum(r.offload) >= 2 * n2
  with pytest.raises(PlanError, match="min_offload"):
    ExpertAssignmentProblem(**kw, min_offload=3, max_offload=2)


def gaps(rng, count, comm):
  worst_alg1 = worst_ls = 0.0
  for _ in range(count):
    p = random_problem(rng, comm)
    ex = exhaustive_assignment(p)
    a1, ls = gather_and_squeeze(p), local_search(p)
    assert ex.iteration_time <= min(a1.iteration_time, ls.iteration_time) + 1e-12
    worst_alg1 = max(worst_alg1, a1.iteration_time / ex.iteration_time - 1)
    worst_ls = max(worst_ls, ls.iteration_time / ex.iteration_time - 1)
  return worst_alg1, worst_ls


def test_local_search_within_two_percent_of_exhaustive():
  worst_alg1, worst_ls = gaps(np.random.default_rng(0), 6, comm=True)
  assert worst_ls <= 0.02


@pytest.mark.slow
@pytest.mark.parametrize("comm", [False, True])
def test_local_search_within_two_percent_of_exhaustive_many(comm):
  """200 random instances each: Algorithm 1 alone is not within 2% (worst gaps in
  docs/moe.md), Algorithm 1 followed by local search is."""
  worst_alg1, worst_ls = gaps(np.random.default_rng(1 + comm), 200, comm)
  print(f"worst gap: Algorithm 1 {worst_alg1:.2%}, with local search {worst_ls:.2%}")
  assert worst_ls <= 0.02


def test_optimize_assignment_picks_exhaustive_when_small():
  p = ExpertAssignmentProblem(4, 2, 2, 2, 1.0, 2.0, [2.0, 2.0], [4.0, 4.0], [1.0, 1.0],
                              [2.0, 2.0])
  assert optimize_assignment(p).method == "exhaustive"
  assert optimize_assignment(p, exhaustive_limit=1).method == "local_search"


def test_batched_times_and_pruned_exhaustive_equal_one_by_one_simulation():
  """``iteration_times`` (one kernel call per set of offloaded layers) equals ``simulate_zebra``
  of ``costs`` assignment by assignment, the lower bound holds, and the exhaustive search that
  skips assignments by that bound returns what simulating every one in enumeration order
  returns (the first fastest), ties included (whole-second times)."""
  rng = np.random.default_rng(11)
  pruned = 0
  for k in range(24):
    p = random_problem(rng, comm=bool(k % 2))
    if k % 3 == 0:       # equal times: ties between assignments
      p = ExpertAssignmentProblem(p.num_experts, p.num_attn, p.num_expert, p.num_microbatches,
                                  np.round(p.attn_fwd_s), np.round(p.attn_bwd_s),
                                  np.round(p.expert_fwd_s), np.round(p.expert_bwd_s),
                                  np.round(p.expert_on_attn_fwd_s),
                                  np.round(p.expert_on_attn_bwd_s))
    n2 = p.chunk[1]
    grid = [[c * n2 for c in ch]
            for ch in itertools.product(range(p.max_chunks + 1), repeat=p.num_layers)]
    ref = [simulate_zebra(p.costs(o)).iteration_time for o in grid]
    assert list(p.iteration_times(grid)) == ref
    assert np.all(p.lower_bounds(grid) <= np.array(ref) * (1 + 1e-12))
    best = min(range(len(grid)), key=lambda i: (ref[i], i))
    ex = exhaustive_assignment(p, 10 ** 6)
    assert ex.offload == tuple(grid[best]) and ex.iteration_time == ref[best]
    pruned += ex.evaluated < len(grid)
  assert pruned > 0      # the bound skips some


def test_local_search_result_is_its_simulated_time():
  rng = np.random.default_rng(12)
  for _ in range(6):
    p = random_problem(rng, comm=True)
    r = local_search(p)
    assert r.iteration_time == simulate_zebra(p.costs(r.offload)).iteration_time
