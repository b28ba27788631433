"""Transfer fees of a plan: its bytes per link class against a count by hand, and its money per
iteration and hourly rate with fees (evaluate_plan, the planner's result)."""

import math

import numpy as np
import pytest

from harpjax.cluster import Cluster, Link, TransferFees
from harpjax.compiler.plan import evaluate_plan, solve
from harpjax.compiler.profile import (CostTables, group_sync_transfer, LayerProfile, LinkFees,
                                      plan_transfer, SubclusterSpec, with_fees)
from harpjax.errors import CostTablesError

GB = 1e9


def _tables(prices=(3.0, 1.5, 1.5)) -> CostTables:
  L = 6
  layers = LayerProfile(flops=np.full(L, 2e12), param_bytes=np.full(L, 1e8),
                        param_mem_bytes=np.full(L, 8e8), act_bytes=np.full(L, 1e7),
                        boundary_bytes=np.array([3e7, 5e7, 7e7, 11e7, 13e7, 17e7]))
  subs = [SubclusterSpec("a", 1, 4, 40 * GB, 12.5e9, peak_flops=1e14, latency_s=5e-6,
                         price_per_gpu_hour=prices[0]),
          SubclusterSpec("b", 1, 4, 16 * GB, 6e9, peak_flops=5e13, latency_s=7e-6,
                         price_per_gpu_hour=prices[1]),
          SubclusterSpec("c", 1, 4, 16 * GB, 6e9, peak_flops=5e13, latency_s=7e-6,
                         price_per_gpu_hour=prices[2])]
  links = {("a", "b"): Link(2.5e9, 3e-5), ("b", "c"): Link(1e9, 1e-4)}
  return CostTables.from_layer_costs(layers, subs, links)


# a in zone x, b in zone y of the same region, c in another region.
PLACES = (("a", "x", "r1"), ("b", "y", "r1"), ("c", "z", "r2"))


def test_plan_bytes_and_fee_by_hand():
  t = _tables().replace(fees=LinkFees(PLACES))
  B = 8
  quads = [(0, 1, 0, 2), (2, 2, 0, 1), (3, 4, 1, 2), (5, 5, 2, 2)]
  got = plan_transfer(t, quads, B)
  bb = t.boundary_bytes
  same, zone, region = 2 * B * bb[1], 2 * B * bb[2], 2 * B * bb[4]
  assert got.bytes_by_class == pytest.approx((same, zone, region), rel=1e-12)
  assert got.fee_per_iteration == pytest.approx(zone * 0.01 / GB + region * 0.02 / GB,
                                                rel=1e-12)
  assert got.bytes_of("other_region") == region
  # Without fees in the tables every byte is same-zone and free.
  free = plan_transfer(_tables(), quads, B)
  assert free.bytes_by_class == pytest.approx((same + zone + region, 0.0, 0.0))
  assert free.fee_per_iteration == 0.0


def test_evaluation_counts_fees_in_cost_and_rate():
  """A two-zone plan's reported cost per iteration is rate x time + bytes x fee, by hand."""
  fees = TransferFees(other_zone=0.03)
  t = _tables().replace(fees=LinkFees(PLACES, fees))
  B = 16
  quads = [(0, 2, 0, 2), (3, 5, 1, 2)]            # a (zone x) -> b (zone y): one cut
  ev = evaluate_plan(t, quads, B)
  nbytes = 2 * B * t.boundary_bytes[2]
  fee = nbytes * 0.03 / GB
  rate = 4 * 3.0 + 4 * 1.5
  assert ev.transfer_bytes == (0.0, nbytes, 0.0)
  assert ev.fees_per_iteration == pytest.approx(fee, rel=1e-12)
  assert ev.rate_per_hour == rate
  assert ev.gpu_cost_per_iteration == pytest.approx(rate * ev.iteration_s / 3600, rel=1e-12)
  assert ev.cost_per_iteration == pytest.approx(rate * ev.iteration_s / 3600 + fee, rel=1e-12)
  assert ev.rate_with_fees_per_hour == pytest.approx(rate + 3600 * fee / ev.iteration_s,
                                                     rel=1e-12)
  assert ev.rate_with_fees_per_hour > ev.rate_per_hour
  # The same plan inside one zone pays nothing more.
  one = evaluate_plan(_tables().replace(fees=LinkFees(
      (("a", "x", "r1"), ("b", "x", "r1"), ("c", "x", "r1")))), quads, B)
  assert one.fees_per_iteration == 0.0 and one.cost_per_iteration == one.gpu_cost_per_iteration


def test_fees_survive_the_planner_and_match_the_evaluation():
  t = _tables().replace(fees=LinkFees(PLACES))
  B = 16
  r = solve(t, B, objective="max_throughput_per_dollar", use_all_devices=False)
  quads = [(s.layers[0], s.layers[1], s.subcluster, s.submesh_index) for s in r.stages]
  ev = evaluate_plan(t, quads, B)
  want = plan_transfer(t, quads, B).fee_per_iteration
  assert ev.fees_per_iteration == pytest.approx(want, rel=1e-12)
  assert ev.cost_per_iteration == pytest.approx(
      r.rate_per_hour * r.iteration_s / 3600 + want, rel=1e-12)


def test_with_fees_from_a_cluster_file():
  c = Cluster.from_yaml("""
subclusters:
  - {name: a, gpu: A100-40G, hosts: 1, devices_per_host: 4, zone: us-central1-a,
     region: us-central1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: b, gpu: V100-16G, hosts: 1, devices_per_host: 4, zone: us-west1-b,
     region: us-west1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: c, gpu: V100-16G, hosts: 1, devices_per_host: 4, zone: us-west1-b,
     region: us-west1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
transfer_fee_per_gb: {other_region: 0.05}
""")
  t = with_fees(_tables(), c)
  assert t.fees.link_class("a", "b") == c.link_class("a", "b") == "other_region"
  assert t.fees.fee_per_byte("a", "b") == pytest.approx(0.05 / GB)
  assert t.fees.fee_per_byte("b", "c") == 0.0 and t.fees.charges


def test_named_errors():
  with pytest.raises(CostTablesError, match=r"subclusters \['c'\] have no zone"):
    _tables().replace(fees=LinkFees(PLACES[:2]))
  with pytest.raises(CostTablesError, match="repeats"):
    LinkFees(PLACES + (("a", "x", "r1"),))


def test_group_sync_bytes_per_class():
  fees = LinkFees(PLACES)
  got = group_sync_transfer(fees, "a", ["b", "c"], {"b": 1e9, "c": 2e9})
  assert got.bytes_by_class == (0.0, 2e9, 4e9)
  assert got.fee_per_iteration == pytest.approx(2 * 0.01 + 4 * 0.02)
  assert math.isclose((got + got).fee_per_iteration, 2 * got.fee_per_iteration)


def test_budget_holds_with_fees():
  """Across two regions the fee-blind plan exceeds the budget once its fees count; the search
  with fees returns the fastest plan that keeps it (brute force over every plan, scored with
  its fees), and reports its money with them."""
  from tests.compiler.plan import oracle
  fees = TransferFees(other_region=2.0)           # dear links: fees dominate
  t = _tables(prices=(3.0, 1.0, 1.0)).replace(fees=LinkFees(
      (("a", "x", "r1"), ("b", "z", "r2"), ("c", "z", "r2")), fees))
  B = 16
  kw = dict(objective="min_time_within_budget", use_all_devices=False, schedule="h1f1b")
  blind_t = t.replace(fees=None)
  fast = solve(blind_t, B, budget_per_hour=1e6, **kw)
  budget = fast.rate_per_hour * 1.001
  blind = solve(blind_t, B, budget_per_hour=budget, **kw)
  blind_ev = evaluate_plan(t, list(blind.stages), B)
  assert blind_ev.fees_per_iteration > 0                    # the case this test is about
  assert blind_ev.rate_with_fees_per_hour > budget
  got = solve(t, B, budget_per_hour=budget, **kw)
  ev = evaluate_plan(t, list(got.stages), B)
  assert got.rate_with_fees_per_hour <= budget * (1 + 1e-9)
  assert ev.rate_with_fees_per_hour == pytest.approx(got.rate_with_fees_per_hour, rel=1e-12)
  assert got.stats.proved
  bf = oracle.brute_force(t, B, budget_per_hour=budget)
  assert got.iteration_s == pytest.approx(bf.objective_s, rel=1e-9)
  assert got.cost_per_iteration == pytest.approx(
      got.rate_per_hour * got.iteration_s / 3600 + got.fees_per_iteration, rel=1e-12)
