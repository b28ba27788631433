"""Tests of harpjax.cluster.packing: the one exact packer every fit question goes to."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harpjax.cluster import Cluster
from harpjax.cluster.packing import (allocate_submeshes, bin_pack, is_divisibility_chain,
                                     pack_submeshes, submesh_shapes)
from harpjax.errors import PlanError

# Fifteen devices per host, five hosts, nineteen single-host submeshes filling all 75 devices.
# A packer that gives up after a node budget (first-fit decreasing, then a plain search)
# rejects it; it packs, e.g. 7+4+4 | 7+4+4 | 7+3+3+2 | 6+5+2+2 | 5+3+3+2+2.
HARD_FEASIBLE = ([7, 7, 7, 6, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 2], 5, 15)


def _brute_force(sizes, num_bins, capacity):
  """Whether a packing exists: every bin for every item, no cleverness."""
  for bins in itertools.product(range(num_bins), repeat=len(sizes)):
    load = [0] * num_bins
    for s, b in zip(sizes, bins):
      load[b] += s
    if max(load, default=0) <= capacity:
      return True
  return False


def _check_packing(sizes, num_bins, capacity, out):
  assert len(out) == len(sizes)
  load = [0] * num_bins
  for s, b in zip(sizes, out):
    assert 0 <= b < num_bins
    load[b] += s
  assert max(load, default=0) <= capacity


def test_hard_feasible_instance_packs():
  sizes, bins, cap = HARD_FEASIBLE
  assert sum(sizes) == bins * cap
  out = bin_pack(sizes, bins, cap)
  assert out is not None
  _check_packing(sizes, bins, cap, out)


def test_hard_instance_same_answer_for_planner_and_allocator():
  sizes, hosts, per_host = HARD_FEASIBLE
  shapes = [(1, w) for w in sizes]
  placed = pack_submeshes(hosts, per_host, shapes)
  assert placed is not None
  seen = set()
  for (n, m), where in zip(shapes, placed):
    assert len(where) == 1 and where[0][2] == m
    h, first, count = where[0]
    devs = {(h, d) for d in range(first, first + count)}
    assert not devs & seen and all(d < per_host for _, d in devs)
    seen |= devs
  assert len(seen) == hosts * per_host
  out = allocate_submeshes("s", hosts, per_host, list(enumerate(shapes)))
  assert sorted(d for ds in out.values() for d in ds) == list(range(hosts * per_host))
  for i, (n, m) in enumerate(shapes):
    assert len({d // per_host for d in out[i]}) == 1 and len(out[i]) == m
  # Through the Cluster as well: the stages' devices are disjoint.
  c = Cluster.simple([("s", "A100", hosts, per_host)])
  groups = c.allocate_submeshes([("s", s) for s in shapes])
  assert sorted(d for g in groups for d in g) == list(range(hosts * per_host))


def test_infeasible_instances_end_with_none():
  # Six items over half the capacity cannot share five bins, whatever the small ones do.
  assert bin_pack([8] * 6 + [1] * 27, 5, 15) is None
  # Exactly full, yet 8 cannot go with 6 and the two 6s cannot go together.
  assert bin_pack([6, 6, 8], 2, 10) is None
  assert bin_pack([11], 3, 10) is None
  assert bin_pack([5, 5, 5], 1, 10) is None


def test_empty_and_trivial():
  assert bin_pack([], 0, 4) == []
  assert bin_pack([], 3, 4) == []
  assert bin_pack([4], 1, 4) == [0]
  assert bin_pack([1], 0, 4) is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.data())
def test_bin_pack_matches_brute_force(num_bins, capacity, data):
  sizes = data.draw(st.lists(st.integers(1, capacity), max_size=7))
  out = bin_pack(sizes, num_bins, capacity)
  assert (out is not None) == _brute_force(sizes, num_bins, capacity)
  if out is not None:
    _check_packing(sizes, num_bins, capacity, out)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_chain_widths_pack_whenever_devices_suffice(num_hosts, per_host, data):
  shapes = submesh_shapes(num_hosts, per_host, "chain")
  assert is_divisibility_chain(per_host, shapes)
  widths = data.draw(st.lists(st.sampled_from([m for n, m in shapes if n == 1 and m < per_host]
                                               or [per_host]), max_size=10))
  fits = sum(widths) <= num_hosts * per_host
  assert (bin_pack(widths, num_hosts, per_host) is not None) == fits


def test_powers_are_not_a_chain_for_six():
  shapes = submesh_shapes(2, 6, "powers")
  assert [m for n, m in shapes if n == 1] == [1, 2, 4, 6]
  assert not is_divisibility_chain(6, shapes)
  # 12 devices requested, 12 available, yet three (1, 4) need three hosts.
  assert pack_submeshes(2, 6, [(1, 4)] * 3) is None
  with pytest.raises(PlanError, match="single-host submeshes cannot span hosts"):
    allocate_submeshes("s", 2, 6, list(enumerate([(1, 4)] * 3)))
