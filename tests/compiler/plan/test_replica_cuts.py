"""A cut priced per data-parallel replica pair (every host pair of the two stages at once,
Sailor's model) beside the one-link price the runtime sends and the DP reads: each against an
independent statement of it, and the DP's price an upper bound of the plan's per-pair price."""

import math

import numpy as np
import pytest

from harpjax.cluster import BandwidthCurve, Link
from harpjax.compiler import plan as planner
from harpjax.compiler.plan import evaluate_plan
from harpjax.compiler.profile import (CostTables, LayerProfile, SubclusterSpec, cut_time_s,
                                      row_hosts)
from harpjax.errors import InvalidOptionError

GB = 1e9


def _tables(curve=None, hosts=(4, 4)):
  L = 6
  layers = LayerProfile(flops=np.full(L, 4e12), param_bytes=np.full(L, 1e8),
                        param_mem_bytes=np.full(L, 8e8), act_bytes=np.full(L, 1e7),
                        boundary_bytes=np.array([2e7, 3e7, 5e7, 7e7, 1.1e8, 1.3e8]))
  subs = [SubclusterSpec("a", hosts[0], 2, 40 * GB, 12.5e9, peak_flops=1e14, latency_s=5e-6),
          SubclusterSpec("b", hosts[1], 2, 16 * GB, 6e9, peak_flops=5e13, latency_s=7e-6)]
  return CostTables.from_layer_costs(layers, subs, {("a", "b"): Link(1.25e9, 1e-4,
                                                                     curve=curve)})


def _stages(t):
  """Every two-stage plan a..b and the same-subcluster plans of three stages on a."""
  out = []
  for j in range(t.num_layers - 1):
    for sa in range(len(t.submeshes[0])):
      for sb in range(len(t.submeshes[1])):
        if np.isfinite(t.stage_time_s[0][0, j, sa]) and np.isfinite(
            t.stage_time_s[1][j + 1, t.num_layers - 1, sb]):
          out.append([(0, j, 0, sa), (j + 1, t.num_layers - 1, 1, sb)])
  return out


def test_row_hosts_are_the_hosts_with_their_own_rows():
  assert row_hosts((1, 2), (2, 1)) == 1      # one host
  assert row_hosts((4, 2), (8, 1)) == 4      # two replicas per host
  assert row_hosts((4, 2), (4, 2)) == 4      # one replica per host
  assert row_hosts((4, 2), (2, 4)) == 2      # a replica spans two hosts
  assert row_hosts((4, 2), (1, 8)) == 1
  assert row_hosts((4, 2), (2, 1, 4)) == 4   # dp x ep replicas of the rows
  t = _tables()
  for k in range(2):
    for s, sh in enumerate(t.submeshes[k]):
      for i, j in ((0, 0), (1, 4), (0, 5)):
        assert t.row_hosts[k][i, j, s] == row_hosts(sh, t.logical_mesh_of(k, i, j, s))


@pytest.mark.parametrize("curve", [None, BandwidthCurve.from_gbps([[1e6, 3.0], [1e9, 10.0]])])
def test_replica_cut_is_the_busiest_hosts_share_on_its_own_link(curve):
  t = _tables(curve)
  link = Link(1.25e9, 1e-4, curve=curve)
  seen = set()
  for stages in _stages(t):
    (i0, j0, a, s0), (i1, j1, b, s1) = stages
    hp, hc = t.row_hosts[a][i0, j0, s0], t.row_hosts[b][i1, j1, s1]
    nbytes = t.boundary_bytes[j0]
    h, n = min(hp, hc), max(hp, hc)
    # h hosts each move n / h messages of bytes / n at once
    per_pair = link.latency_s + (n / h) * (nbytes / n) / link.bandwidth_at(nbytes / n)
    assert cut_time_s(nbytes, 1.25e9, 1e-4, curve, hp, hc) == pytest.approx(per_pair, rel=1e-12)
    want = min(per_pair, link.transfer_time_s(nbytes))   # where it is faster than one message
    got = t.replica_cut_costs(stages)
    assert got[0] == pytest.approx(want, rel=1e-12) and got[1] == 0.0
    assert t.cut_costs(stages)[0] == pytest.approx(link.transfer_time_s(nbytes), rel=1e-12)
    if h == n == 1:
      assert got[0] == t.cut_costs(stages)[0]
    seen.add((int(hp), int(hc)))
  assert {(1, 1), (4, 4)} <= seen and any(p != q for p, q in seen)   # the cases are covered
  # the DP's table by row hosts holds the same seconds
  ha, hb, table = t.replica_cut_table(0, 1)
  for p, x in enumerate(ha):
    for q, y in enumerate(hb):
      np.testing.assert_allclose(table[p, q], cut_time_s(t.boundary_bytes, 1.25e9, 1e-4, curve,
                                                         x, y), rtol=1e-12)
  assert ha[0] == hb[0] == 1
  np.testing.assert_allclose(table[0, 0], t.pair_comm_s[0, 1], rtol=1e-12)


@pytest.mark.parametrize("curve", [None, BandwidthCurve.from_gbps([[1e6, 3.0], [1e9, 10.0]])])
def test_dp_price_is_an_upper_bound_of_the_plan_sent_per_replica_pair(curve):
  """The DP prices one link; the plan sent per replica pair where that is faster (its
  warm-ups the DP's) is never slower, so the DP's value bounds it from above."""
  t = _tables(curve)
  strict = 0
  for stages in _stages(t):
    one = evaluate_plan(t, stages, 8)
    pairs = evaluate_plan(t, stages, 8, cuts="replica_pairs")
    assert pairs.iteration_s <= one.iteration_s * (1 + 1e-12)
    assert all(p.comm_s <= o.comm_s * (1 + 1e-12) for p, o in zip(pairs.stages, one.stages))
    strict += pairs.iteration_s < one.iteration_s * (1 - 1e-9)
  assert strict > 0   # the per-pair price is below the DP's on some plans
  res = planner.solve(t, 8, backend="sequential")
  assert evaluate_plan(t, res.plan, 8).iteration_s == pytest.approx(res.iteration_s, rel=1e-12)
  assert evaluate_plan(t, res.plan, 8, cuts="replica_pairs").iteration_s <= (
      res.iteration_s * (1 + 1e-12))


def test_a_split_that_loses_throughput_is_sent_as_one_message():
  """Splitting a message over h pairs loses throughput when the bandwidth falls more than h
  times (or at all, from one sending host): the cut then goes as one message."""
  steep = BandwidthCurve.from_gbps([[1e6, 0.1], [1e8, 10.0]])
  assert cut_time_s(4e6, 1.25e9, 0.0, steep, 4, 4) > cut_time_s(4e6, 1.25e9, 0.0, steep)
  assert cut_time_s(1e8, 1.25e9, 0.0, steep, 1, 4) > cut_time_s(1e8, 1.25e9, 0.0, steep)
  t = _tables(steep)
  ones = 0
  for stages in _stages(t):
    (i0, j0, a, s0), (i1, j1, b, s1) = stages
    if min(t.row_hosts[a][i0, j0, s0], t.row_hosts[b][i1, j1, s1]) == 1:
      np.testing.assert_array_equal(t.replica_cut_costs(stages), t.cut_costs(stages))
      ones += 1
    assert (t.replica_cut_costs(stages) <= t.cut_costs(stages)).all()
  assert ones > 0


def test_unknown_cut_model_is_refused():
  t = _tables()
  with pytest.raises(InvalidOptionError, match="one_link"):
    evaluate_plan(t, _stages(t)[0], 8, cuts="sailor")
