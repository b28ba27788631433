"""Pieces of a stage over several hosts that need no second process: which host holds which of
the stage's devices, and the structure a group broadcasts. (Groups themselves run in
test_ray_runtime.py.)"""

import jax
import numpy as np

import harpjax
from harpjax.runtime import spmd as _spmd
from harpjax.runtime.runner import group_layout, host_groups
from tests.equivalence import DEMO_CLUSTER


def test_host_groups_and_layout_follow_the_plans_device_order():
  cluster = harpjax.Cluster.load(DEMO_CLUSTER)   # v100-0: 0-3, a100-0: 4-5, a100-1: 6-7
  groups = host_groups(cluster, (4, 5, 6, 7))
  assert groups == [("a100-0", [4, 5]), ("a100-1", [6, 7])]
  assert group_layout(groups, (4, 5, 6, 7)) == ((0, 0), (0, 1), (1, 0), (1, 1))
  # Interleaved devices: the submesh order is kept, each device found on its own host.
  groups = host_groups(cluster, (6, 4, 7, 5))
  assert [h for h, _ in groups] == ["a100-1", "a100-0"]          # the first device's host leads
  assert group_layout(groups, (6, 4, 7, 5)) == ((0, 0), (1, 0), (0, 1), (1, 1))
  assert host_groups(cluster, (0, 1)) == [("v100-0", [0, 1])]


def test_broadcast_spec_keeps_scalars_and_keys():
  payload = {3: np.float32(2.5), 1: np.arange(6, dtype=np.int32).reshape(2, 3),
             7: jax.random.key(0), 2: np.array([True, False])}
  spec = _spmd._spec_of(payload)
  assert [k for k, *_ in spec] == [1, 2, 3, 7]
  shapes = {k: shape for k, shape, *_ in spec}
  assert shapes[3] == () and shapes[1] == (2, 3) and shapes[2] == (2,)
  assert shapes[7] == (2,) and dict((k, impl) for k, *_, impl in spec)[7] is not None
  assert sum(nbytes for _, _, _, nbytes, _ in spec) == 4 + 24 + 2 + 8


def test_one_process_helpers_leave_local_values_alone():
  x = np.ones((2, 2), np.float32)
  assert _spmd.gather({0: x})[0] is x
  assert not _spmd.is_global(jax.numpy.ones(3))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("dp", "tp"))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
  y = _spmd.put(jax.random.key_data(jax.random.key(1)), sh)
  assert y.sharding == sh
