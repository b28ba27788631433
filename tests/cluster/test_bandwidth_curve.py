"""Bandwidth as a function of the message size: the cluster file's ``gbps_by_size``, its checks,
its interpolation, and every price read on a link that has one (cuts in the tables, the ring
collectives, the emulated links)."""

import math

import numpy as np
import pytest

from harpjax.cluster import GBPS, BandwidthCurve, Cluster, Link
from harpjax.compiler.profile import CostTables, LayerProfile, SubclusterSpec
from harpjax.compiler.profile.collectives import (allgather_time_s, allreduce_time_s,
                                                  collective_time_s, cut_time_s)
from harpjax.errors import BandwidthCurveError, ClusterSpecError
from harpjax.runtime.emulation import Emulation

_FILE = """
subclusters:
  - {name: a, gpu: A100-40G, hosts: 2, devices_per_host: 2,
     nics: [{name: ib0, kind: rdma, gbps: 100, network: f}, {name: eth0, kind: ethernet, gbps: 10, network: w}]}
  - {name: b, gpu: T4, hosts: 2, devices_per_host: 2,
     nics: [{name: eth0, kind: ethernet, gbps: 10, network: w}]}
links:
  - {between: [a, b], latency_us: 50, gbps_by_size: [[1.0e+5, 1.0], [1.0e+7, 4.0], [1.0e+9, 9.0]]}
"""


def _cluster(text=_FILE):
  return Cluster.from_yaml(text)


def test_curve_is_linear_in_log_size_and_flat_beyond_its_points():
  c = BandwidthCurve.from_gbps([[1e5, 1.0], [1e7, 4.0], [1e9, 9.0]])
  gb = lambda b: c.bandwidth_at(b) / GBPS
  assert gb(1e3) == gb(1e5) == pytest.approx(1.0)       # below the first size: its bandwidth
  assert gb(1e12) == pytest.approx(9.0)                  # above the last: the last
  assert gb(1e6) == pytest.approx(2.5)                   # half way in log2 between 1e5 and 1e7
  assert gb(1e8) == pytest.approx(6.5)
  b = 3.3e6   # an independent statement of the interpolation
  f = (math.log2(b) - math.log2(1e5)) / (math.log2(1e7) - math.log2(1e5))
  assert gb(b) == pytest.approx(1.0 + f * 3.0, rel=1e-12)
  sizes = np.array([1e3, 1e6, 1e8, 1e12])
  np.testing.assert_allclose(c.bandwidth_at(sizes), [c.bandwidth_at(x) for x in sizes])


def test_cluster_file_gives_the_link_its_curve_and_writes_it_back():
  c = _cluster()
  link = c.inter_subcluster_link("a", "b")
  assert link.curve is not None and link.gbps == pytest.approx(9.0)   # gbps: the largest's
  assert link.latency_s == pytest.approx(50e-6)
  for b in (1e4, 1e6, 5e7, 1e10):
    assert link.transfer_time_s(b) == pytest.approx(50e-6 + b / link.curve.bandwidth_at(b))
  assert link.transfer_time_s(1e6) > 50e-6 + 1e6 / link.bandwidth_bytes_per_s   # slower small
  again = Cluster.from_yaml(c.to_yaml())
  assert again == c and again.inter_subcluster_link("a", "b").curve == link.curve
  # hosts of the two subclusters talk over it; a link without points keeps one bandwidth
  assert c.link_between_hosts(c.subclusters[0].hosts[0].name,
                              c.subclusters[1].hosts[1].name).curve == link.curve
  assert c.intra_subcluster_link("a").curve is None


@pytest.mark.parametrize("points,msg", [
    ("[[1.0e+7, 4.0], [1.0e+5, 1.0]]", "sizes must increase strictly"),
    ("[[1.0e+5, 1.0], [1.0e+5, 2.0]]", "sizes must increase strictly"),
    ("[]", "non-empty list"),
    ("[[1.0e+5]]", "non-empty list of \\[bytes, gbps\\] pairs"),
    ("[[0, 1.0]]", "gbps_by_size\\[0\\]\\[0\\] \\(bytes\\)"),
    ("[[1.0e+5, -1]]", "gbps_by_size\\[0\\]\\[1\\] \\(gbps\\)"),
    ("[[1e5, 1.0]]", "write the number without quotes"),   # YAML reads 1e5 as a string
])
def test_malformed_points_are_named_errors(points, msg):
  text = _FILE.replace("[[1.0e+5, 1.0], [1.0e+7, 4.0], [1.0e+9, 9.0]]", points)
  with pytest.raises(BandwidthCurveError, match=msg) as e:
    _cluster(text)
  assert isinstance(e.value, ClusterSpecError) and "links[0].gbps_by_size" in str(e.value)


def test_a_link_needs_gbps_or_points():
  text = _FILE.replace(", gbps_by_size: [[1.0e+5, 1.0], [1.0e+7, 4.0], [1.0e+9, 9.0]]", "")
  with pytest.raises(ClusterSpecError, match="give gbps .* or gbps_by_size"):
    _cluster(text)


def _tables(curve):
  L = 4
  layers = LayerProfile(flops=np.full(L, 1e12), param_bytes=np.full(L, 1e8),
                        param_mem_bytes=np.full(L, 8e8), act_bytes=np.full(L, 1e7),
                        boundary_bytes=np.array([3e4, 5e6, 7e7, 1.1e9]))
  subs = [SubclusterSpec("a", 2, 4, 40e9, 12.5e9, peak_flops=1e14, latency_s=5e-6),
          SubclusterSpec("b", 2, 4, 16e9, 6e9, peak_flops=5e13, latency_s=7e-6)]
  return CostTables.from_layer_costs(layers, subs, {("a", "b"): Link(1.125e9, 5e-5,
                                                                     curve=curve)})


def test_tables_price_each_cut_at_its_message_size():
  curve = BandwidthCurve.from_gbps([[1e5, 1.0], [1e7, 4.0], [1e9, 9.0]])
  t, flat = _tables(curve), _tables(None)
  link = Link(1.125e9, 5e-5, curve=curve)
  for j, b in enumerate(t.boundary_bytes):
    assert t.pair_comm_s[0, 1, j] == pytest.approx(link.transfer_time_s(b), rel=1e-12)
    assert t.pair_comm_s[1, 0, j] == pytest.approx(link.transfer_time_s(b), rel=1e-12)
    assert flat.pair_comm_s[0, 1, j] == pytest.approx(5e-5 + b / 1.125e9, rel=1e-12)
  np.testing.assert_array_equal(t.intra_comm_s, flat.intra_comm_s)   # no curve inside
  assert t.curve(0, 1) == curve and t.curve(0, 0) is None
  assert _tables(None).link_curves is None
  # a cut's price at the cut's size is what cut_costs charges a plan
  stages = [(0, 1, 0, 0), (2, 3, 1, 0)]
  assert t.cut_costs(stages)[0] == pytest.approx(link.transfer_time_s(5e6), rel=1e-12)


def test_cut_time_splits_the_bytes_over_host_pairs():
  curve = BandwidthCurve.from_gbps([[1e5, 1.0], [1e7, 4.0], [1e9, 9.0]])
  link = Link(1.125e9, 5e-5, curve=curve)
  for b in (1e6, 3e8):
    for h in (1, 2, 4):   # h hosts on either side: h pairs, one message of b / h each
      assert cut_time_s(b, 1.125e9, 5e-5, curve, h, h) == pytest.approx(
          link.transfer_time_s(b / h), rel=1e-12)
      assert cut_time_s(b, 1.125e9, 5e-5, None, h, h) == pytest.approx(
          5e-5 + b / h / 1.125e9)
    # one sender, four receivers: four messages of b / 4 through the sender's link in turn
    assert cut_time_s(b, 1.125e9, 5e-5, curve, 1, 4) == pytest.approx(
        5e-5 + 4 * (b / 4) / curve.bandwidth_at(b / 4), rel=1e-12)
    assert cut_time_s(b, 1.125e9, 5e-5, curve, 4, 1) == cut_time_s(b, 1.125e9, 5e-5, curve, 1, 4)
  assert cut_time_s(1e6, 0.0) == math.inf


def test_ring_collectives_read_the_curve_at_each_steps_message():
  curve = BandwidthCurve.from_gbps([[1e5, 1.0], [1e7, 4.0], [1e9, 9.0]])
  link = Link(1.125e9, 5e-5, curve=curve)
  nbytes, p = 4e7, 4
  step = nbytes / p   # each of the ring's steps sends a quarter
  assert allreduce_time_s(nbytes, p, link) == pytest.approx(
      2 * (p - 1) * link.transfer_time_s(step), rel=1e-12)
  assert allgather_time_s(nbytes, p, link) == pytest.approx(
      (p - 1) * link.transfer_time_s(step), rel=1e-12)
  assert collective_time_s({"all-reduce": [nbytes, 1]}, p, link) == pytest.approx(
      allreduce_time_s(nbytes, p, link), rel=1e-12)
  assert collective_time_s({"collective-permute": [2e6, 2]}, p, link) == pytest.approx(
      2 * link.transfer_time_s(1e6), rel=1e-12)
  flat = Link(1.125e9, 5e-5)   # without points: the former formula
  assert allreduce_time_s(nbytes, p, flat) == pytest.approx(
      2 * (p - 1) / p * nbytes / 1.125e9 + 2 * (p - 1) * 5e-5, rel=1e-12)


def test_emulated_link_holds_a_message_as_the_curve_prices_it():
  c = _cluster()
  link = c.inter_subcluster_link("a", "b")
  emu = Emulation(fwd_s=(0.1, 0.1), bwd_s=(0.2, 0.2), links={(0, 1): link})
  for b in (1e4, 2e6, 5e8):
    assert emu.transfer_s(0, 1, b) == pytest.approx(link.latency_s + b / curve_bw(link, b))


def curve_bw(link, b):
  return link.curve.bandwidth_at(b)
