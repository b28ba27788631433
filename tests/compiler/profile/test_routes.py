"""The cost formulas the planner composes, each against an independent statement of it: a
mixed stage's transfers against :meth:`harpjax.cluster.Link.transfer_time_s` one message at a
time, a ZeRO level's times against its collectives priced by the ring model, the offload times
of arrays against those of numbers."""

import math

import numpy as np
import pytest

from harpjax.cluster import Link
from harpjax.compiler.profile import (CostTables, group_route_s, home_sync_s, LayerProfile,
                                      offload_time_s, replica_link, SubclusterSpec,
                                      subcluster_link, zero_collectives, zero_stage_times)
from harpjax.compiler.profile.collectives import (allgather_time_s, allreduce_time_s,
                                                  collective_time_s)

GB = 1e9


def _tables(linked: bool = True) -> CostTables:
  L = 4
  layers = LayerProfile(flops=np.full(L, 1e12), param_bytes=np.full(L, 1e8),
                        param_mem_bytes=np.full(L, 8e8), act_bytes=np.full(L, 1e7),
                        boundary_bytes=np.array([3e6, 5e6, 7e6, 11e6]))
  subs = [SubclusterSpec("a", 2, 4, 40 * GB, 12.5e9, peak_flops=1e14, latency_s=5e-6),
          SubclusterSpec("b", 2, 4, 16 * GB, 6e9, peak_flops=5e13, latency_s=7e-6),
          SubclusterSpec("c", 1, 4, 16 * GB, 6e9, peak_flops=5e13, latency_s=7e-6)]
  links = {("a", "b"): Link(2.5e9, 3e-5), ("b", "c"): Link(1e9, 1e-4)}
  if linked:
    links[("a", "c")] = Link(1.25e9, 2e-4)
  return CostTables.from_layer_costs(layers, subs, links)


def test_subcluster_link_is_the_one_cuts_are_priced_on():
  t = _tables()
  for a in range(3):
    for b in range(3):
      bw, lat = subcluster_link(t, a, b)
      assert t.pair_comm_s[a, b, 1] == pytest.approx(lat + t.boundary_bytes[1] / bw, rel=1e-12)


@pytest.mark.parametrize("i,j", [(0, 0), (1, 2), (0, 3), (3, 3)])
def test_group_route_is_four_messages_on_the_link_to_the_home(i, j):
  t = _tables()
  rows, b = 3, 8
  link = Link(*subcluster_link(t, 0, 1))
  into = t.boundary_bytes[i - 1] * rows / b if i > 0 else 0.0
  out = t.boundary_bytes[j] * rows / b if j < t.num_layers - 1 else 0.0
  want = 2 * (link.transfer_time_s(into) + link.transfer_time_s(out))
  assert group_route_s(t, 0, 1, rows, b, i, j) == pytest.approx(want, rel=1e-12)
  ii, jj = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
  assert group_route_s(t, 0, 1, rows, b, ii, jj)[i, j] == pytest.approx(want, rel=1e-12)


def test_home_sync_sends_each_gradient_and_the_parameters_back_in_turn():
  t = _tables()
  nbytes = 4e8
  want = sum(2 * Link(*subcluster_link(t, 0, k)).transfer_time_s(nbytes) for k in (1, 2))
  assert home_sync_s(t, 0, [1, 2], nbytes) == pytest.approx(want, rel=1e-12)
  arr = home_sync_s(t, 0, [1, 2], np.array([0.0, nbytes]))
  assert arr[1] == pytest.approx(want, rel=1e-12)
  unlinked = _tables(linked=False)
  assert math.isinf(home_sync_s(unlinked, 0, [2], nbytes))
  assert np.isinf(group_route_s(unlinked, 0, 2, 1, 2, 1, 2))


def test_replica_link_is_the_host_link_for_one_host():
  host, node = Link(300e9, 2e-6), Link(12.5e9, 5e-6)
  assert replica_link((1, 8), host, node) is host
  assert replica_link((2, 8), host, node) is node


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_times_are_the_levels_collectives(zero):
  """The tables price a level by one all-gather of the weights and the once-per-step
  all-reduce; the same level's collectives (zero_collectives) on the ring model must give the
  same seconds per microbatch and per step."""
  P, dp = 6e8, 4
  link = Link(12.5e9, 5e-6)
  t0, gather, sync = 0.25, allgather_time_s(P, dp, link), allreduce_time_s(P, dp, link)
  update = 0.01
  t, e = zero_stage_times(t0, sync + update, gather, sync, zero)
  per_mb, per_step = zero_collectives(P, dp, zero)
  assert t == pytest.approx(t0 + collective_time_s(per_mb, dp, link), rel=1e-12)
  assert e == pytest.approx(update + collective_time_s(per_step, dp, link), rel=1e-12)


def test_offload_times_of_arrays_are_those_of_numbers():
  x = np.array([0.0, 1e6, 3.5e9])
  got = offload_time_s(x, 25e9, 1e-5)
  assert got.shape == (3,)
  for a, g in zip(x, got):
    assert g == offload_time_s(float(a), 25e9, 1e-5)
  assert got[0] == 0.0 and got[2] == pytest.approx(2 * (1e-5 + 3.5e9 / 25e9), rel=1e-15)
