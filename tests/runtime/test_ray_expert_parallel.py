"""Expert-parallel stages on the Ray runtime: each worker builds its stage's ``(dp, ep, tp)``
mesh from the lowered layout and trains as ``jax.jit`` does in float64."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import harpjax
from tests.equivalence import DEMO_CLUSTER, max_rel_err
from tests.models.test_expert_parallel import B, EP4, RTOL, _mixtral

ray = pytest.importorskip("ray")
from harpjax.runtime import ray_runtime  # noqa: E402  (after the importorskip)

pytestmark = pytest.mark.filterwarnings("ignore:os.fork")   # Ray starts processes


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
  hosts = [h.name for h in harpjax.Cluster.load(DEMO_CLUSTER).hosts]
  ray_runtime.init_ray(num_cpus=4, resources={ray_runtime.HOST_RESOURCE_PREFIX + h: 100
                                               for h in hosts})
  yield
  ray_runtime.release_pool()
  ray.shutdown()


@pytest.mark.slow
def test_mixtral_ep_stages_on_ray_equal_jit(x64):
  case = _mixtral(routing_group="sequence", capacity_factor=1.0)
  pray = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                               plan=dataclasses.replace(EP4, layer_source="auto"),
                               runtime=harpjax.RayRuntime())
  ref = jax.jit(case.step)
  s_ray = s_ref = case.state
  for batch in case.batches:
    o_ray, o_ref = pray(s_ray, batch), ref(s_ref, batch)
    assert max_rel_err(o_ref, ray_runtime.gather(o_ray)) <= RTOL
    s_ray, s_ref = o_ray[0], o_ref[0]
