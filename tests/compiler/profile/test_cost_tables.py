"""Cost tables: validation, derived link costs, coarsening and the per-layer builder."""

import numpy as np
import pytest

from harpjax.cluster import Link, paper_submeshes
from harpjax.compiler.profile import (CostTables, LayerProfile, SubclusterSpec,
                                      memory_to_compute_order, synthetic_gpt_profile)
from harpjax.compiler.profile.tables import check_submeshes
from harpjax.errors import ClusterSpecError, CostTablesError

GiB = 2.0 ** 30


def _tiny(**over):
  L = 3
  shapes = ((1, 1), (1, 2))
  t = np.full((L, L, 2), np.inf)
  for i in range(L):
    for j in range(i, L):
      t[i, j] = [j - i + 1.0, (j - i + 1.0) / 1.5]
  kw = dict(num_layers=L, subcluster_names=("a", "b"), num_hosts=(1, 1), devices_per_host=(2, 2),
            device_memory_bytes=(10.0, 20.0), submeshes=(shapes, shapes),
            stage_time_s=(t, 2 * t), param_mem_bytes=(np.ones((L, L, 2)),) * 2,
            act_mem_bytes=(np.ones((L, L, 2)),) * 2, boundary_bytes=[4.0, 8.0, 0.0],
            intra_bandwidth_bytes_per_s=(2.0, 4.0), intra_latency_s=(0.5, 0.25),
            inter_bandwidth_bytes_per_s=(1.0,), inter_latency_s=(0.125,))
  kw.update(over)
  return CostTables(**kw)


def test_paper_submeshes():
  assert paper_submeshes(4, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8))
  assert paper_submeshes(2, 6) == ((1, 1), (1, 2), (1, 4), (1, 6), (2, 6))
  assert paper_submeshes(1, 1) == ((1, 1),)


def test_submesh_shapes_are_single_host_or_whole_hosts():
  with pytest.raises(CostTablesError, match="whole hosts"):
    check_submeshes("x", 2, 8, [(2, 4)])
  with pytest.raises(CostTablesError, match="repeat"):
    check_submeshes("x", 2, 8, [(1, 2), (1, 2)])
  with pytest.raises(CostTablesError):
    check_submeshes("x", 2, 8, [(3, 8)])
  with pytest.raises(CostTablesError):
    check_submeshes("x", 2, 8, [(1, 9)])
  assert check_submeshes("x", 2, 6, [(1, 4), (1, 6), (2, 6)]) == ((1, 4), (1, 6), (2, 6))


def test_validation_errors_name_the_field():
  L = 3
  with pytest.raises(CostTablesError, match="stage_time_s"):
    _tiny(stage_time_s=(np.ones((L, L, 1)), np.ones((L, L, 2))))
  with pytest.raises(CostTablesError, match="> 0"):
    _tiny(stage_time_s=(np.zeros((L, L, 2)), np.ones((L, L, 2))))
  with pytest.raises(CostTablesError, match="NaN"):
    _tiny(param_mem_bytes=(np.full((L, L, 2), np.nan), np.ones((L, L, 2))))
  with pytest.raises(CostTablesError, match="act_mem_bytes"):
    _tiny(act_mem_bytes=(-np.ones((L, L, 2)), np.ones((L, L, 2))))
  with pytest.raises(CostTablesError, match="boundary_bytes"):
    _tiny(boundary_bytes=[1.0, 2.0])
  with pytest.raises(CostTablesError, match="inter_bandwidth"):
    _tiny(inter_bandwidth_bytes_per_s=())
  with pytest.raises(CostTablesError, match="device_memory_bytes"):
    _tiny(device_memory_bytes=(10.0, 0.0))
  with pytest.raises(CostTablesError, match="repeat"):
    _tiny(subcluster_names=("a", "a"))
  with pytest.raises(CostTablesError, match="logical_mesh"):
    _tiny(logical_mesh=(np.ones((L, L, 2, 2), int),) * 2)


def test_arrays_are_read_only_copies():
  t = _tiny()
  with pytest.raises(ValueError):
    t.stage_time_s[0][0, 0, 0] = 5.0
  assert t.stage_time_s[0].dtype == np.float64


def test_comm_costs_and_offsets():
  t = _tiny()
  np.testing.assert_allclose(t.intra_comm_s, [[0.5 + 2, 0.5 + 4, 0.5], [0.25 + 1, 0.25 + 2, 0.25]])
  np.testing.assert_allclose(t.inter_comm_s[0], [0.125 + 4, 0.125 + 8, 0.125])
  assert np.isinf(t.inter_comm_s[1]).all()
  assert list(t.device_offsets) == [0, 2, 4] and t.total_devices == 4
  assert t.submesh_index(1, (1, 2)) == 1 and t.subcluster_index("b") == 1
  assert t.logical_mesh_of(0, 0, 1, 1) == (2, 1)
  with pytest.raises(CostTablesError):
    t.submesh_index(0, (2, 2))


def test_coarsen_picks_the_fine_entries():
  t = _tiny(layer_names=("x", "y", "z"))
  c = t.coarsen([0, 2])
  assert c.num_layers == 2 and c.layer_names == ("x", "y..z")
  assert c.stage_time_s[1][1, 1, 0] == t.stage_time_s[1][1, 2, 0]
  assert c.stage_time_s[0][0, 1, 1] == t.stage_time_s[0][0, 2, 1]
  assert list(c.boundary_bytes) == [4.0, 0.0]
  with pytest.raises(CostTablesError):
    t.coarsen([1])
  free = t.without_communication()
  assert (free.intra_comm_s == 0).all() and (free.inter_comm_s[0] == 0).all()


def _spec(name, hosts, dph, mem, **kw):
  return SubclusterSpec(name, hosts, dph, mem, 10.0, peak_flops=100.0, efficiency=1.0, **kw)


def test_from_layer_costs_formulas():
  prof = LayerProfile(flops=[100.0, 300.0], param_bytes=[2.0, 6.0], param_mem_bytes=[8.0, 24.0],
                      act_bytes=[4.0, 4.0], boundary_bytes=[5.0, 0.0], tp_comm_bytes=[2.0, 2.0])
  spec = _spec("g", 1, 2, 100.0, host_bandwidth_bytes_per_s=20.0)
  t = CostTables.from_layer_costs(prof, [spec], grad_sync_microbatches=2)
  assert t.submeshes == (((1, 1), (1, 2)),)
  assert t.stage_time_s[0][0, 1, 0] == 4.0  # 400 FLOPs at 100 FLOP/s
  assert np.isinf(t.stage_time_s[0][1, 0, 0])
  assert t.param_mem_bytes[0][0, 1, 0] == 32.0 and t.act_mem_bytes[0][0, 1, 0] == 8.0
  # (1, 2): dp = 2 costs 4 / 2 + allreduce(8 bytes, 2) / 2 = 2 + (8 / 20) / 2 = 2.2 s;
  # tp = 2 costs 2 + allreduce(4 bytes, 2) = 2 + 4 / 20 = 2.2 s: a tie keeps dp.
  assert t.stage_time_s[0][0, 1, 1] == pytest.approx(2.2)
  assert tuple(t.logical_mesh[0][0, 1, 1]) == (2, 1)
  # With too little memory for replicas, tensor parallelism (half the parameters) is chosen.
  tight = CostTables.from_layer_costs(prof, [_spec("g", 1, 2, 20.0,
                                                   host_bandwidth_bytes_per_s=20.0)])
  assert tuple(tight.logical_mesh[0][0, 1, 1]) == (1, 2)
  assert tight.param_mem_bytes[0][0, 1, 1] == 16.0 and tight.act_mem_bytes[0][0, 1, 1] == 8.0


def test_end_times_validated_coarsened_and_built():
  """end_time_s: checked (finite where the stage runs), carried by coarsen, and built by
  from_layer_costs(end_cost=True) from the gradient all-reduce and the optimizer update."""
  L = 3
  end = np.full((L, L, 2), np.inf)
  for i in range(L):
    for j in range(i, L):
      end[i, j] = [0.0, 0.1 * (j - i + 1)]
  t = _tiny(end_time_s=(end, end))
  assert t.end_of(0, 0, 2, 1) == pytest.approx(0.3) and t.end_of(0, 2, 0, 1) == 0.0
  assert _tiny().end_of(0, 0, 2, 1) == 0.0
  c = t.coarsen([0, 2])
  assert c.end_time_s[0][1, 1, 1] == t.end_time_s[0][1, 2, 1]
  with pytest.raises(CostTablesError, match="end_time_s"):
    _tiny(end_time_s=(end, -end))
  prof = LayerProfile(flops=[100.0, 300.0], param_bytes=[2.0, 6.0], param_mem_bytes=[8.0, 24.0],
                      act_bytes=[4.0, 4.0], boundary_bytes=[5.0, 0.0])
  spec = _spec("g", 1, 2, 100.0, host_bandwidth_bytes_per_s=20.0, mem_bandwidth_bytes_per_s=64.0)
  amort = CostTables.from_layer_costs(prof, [spec], grad_sync_microbatches=2, max_tp=1)
  at_end = CostTables.from_layer_costs(prof, [spec], grad_sync_microbatches=2, max_tp=1,
                                       end_cost=True)
  assert amort.end_time_s is None
  # (1, 2), dp = 2: 2 s of compute, the all-reduce of 8 bytes (0.4 s) once at the end, plus the
  # update reading and writing 32 bytes of state at 64 B/s (1 s).
  assert at_end.stage_time_s[0][0, 1, 1] == pytest.approx(2.0)
  assert at_end.end_time_s[0][0, 1, 1] == pytest.approx(0.4 + 1.0)
  assert amort.stage_time_s[0][0, 1, 1] == pytest.approx(2.0 + 0.4 / 2)
  assert at_end.end_time_s[0][0, 1, 0] == pytest.approx(1.0)   # one device: the update only
  with pytest.raises(CostTablesError, match="mem_bandwidth"):
    _spec("g", 1, 2, 100.0, mem_bandwidth_bytes_per_s=0.0)


def test_from_layer_costs_order_and_links():
  prof = LayerProfile(flops=[1.0] * 4, param_bytes=[1.0] * 4, param_mem_bytes=[1.0] * 4,
                      act_bytes=[1.0] * 4, boundary_bytes=[1.0] * 4)
  a = SubclusterSpec("a", 1, 2, 40.0, 10.0, peak_flops=300.0)
  v = SubclusterSpec("v", 1, 2, 32.0, 10.0, peak_flops=100.0)
  t = CostTables.from_layer_costs(prof, [a, v], {("a", "v"): Link(2.0, 0.5)},
                                  order="memory_to_compute")
  assert t.subcluster_names == ("v", "a") == memory_to_compute_order([a, v])
  assert t.inter_bandwidth_bytes_per_s == (2.0,) and t.inter_latency_s == (0.5,)
  assert t.peak_flops == (100.0, 300.0)
  with pytest.raises(CostTablesError):
    CostTables.from_layer_costs(prof, [a, v], [Link(1.0)], order=["v", "a"])
  with pytest.raises(CostTablesError):
    CostTables.from_layer_costs(prof, [SubclusterSpec("x", 1, 1, 1.0, 1.0)])
  own = CostTables.from_layer_costs(prof, [a], layer_time_s={"a": [1, 2, 3, 4]})
  assert own.stage_time_s[0][0, 3, 0] == 10.0


def test_synthetic_gpt_profile_and_identical_ranges():
  prof = synthetic_gpt_profile()
  assert prof.num_layers == 146 and prof.names[0] == "embed" and prof.names[-1] == "head"
  params = prof.param_bytes.sum() / 2
  assert 38e9 < params < 41e9
  small = synthetic_gpt_profile(num_blocks=4, hidden=1024)
  spec = SubclusterSpec("a", 1, 4, 40 * GiB, 25e9, peak_flops=312e12)
  t = CostTables.from_layer_costs(small, [spec])
  st = t.stage_time_s[0]
  # blocks 0 and 1 (layers 1..3 and 4..6) are identical: bit-identical costs
  assert st[1, 3, 2] == st[4, 6, 2] and st[1, 6, 0] == st[4, 9, 0]


def test_spec_validation():
  with pytest.raises(CostTablesError):
    SubclusterSpec("x", 0, 8, 1.0, 1.0)
  with pytest.raises(CostTablesError):
    SubclusterSpec("x", 1, 8, 1.0, 1.0, efficiency=1.5)
  with pytest.raises(CostTablesError):
    SubclusterSpec("x", 2, 6, 1.0, 1.0, submeshes=((2, 4), (1, 6)))
  with pytest.raises(ClusterSpecError):
    Link(0.0)
  with pytest.raises(CostTablesError):
    LayerProfile(flops=[1.0], param_bytes=[1.0, 2.0], param_mem_bytes=[1.0], act_bytes=[1.0],
                 boundary_bytes=[1.0])
