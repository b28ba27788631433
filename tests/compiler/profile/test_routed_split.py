"""The profiler's routed split (``CostTables.routed_split``): each routed layer's experts costed
apart from its attention side, checked against a count of the expert matmuls by hand from the
models' shapes, against the entries they are a part of, and through the profile database."""

import math

import numpy as np
import pytest

from harpjax.cluster import Cluster
from harpjax.compiler.profile import profiler as P
from harpjax.compiler.profile import routed_split as rs
from harpjax.compiler.profile import sources
from harpjax.models import BUILTIN_MODELS, MIXTRAL_TINY, MOE_TINY

ONE_HOST = Cluster.simple([("a100", "A100-40G", 1, 2)])
TWO_TYPES = Cluster.simple([("v100", "V100-16G", 1, 2), ("a100", "A100-40G", 1, 2)])


def _profile(spec, cluster, **opts):
  return P.profile_step(spec.step_fn, spec.args, cluster, num_microbatches=spec.num_microbatches,
                        options=P.ProfileOptions(progress=False, **opts))


def _mixtral_by_hand(c, rows: int) -> dict:
  """Mixtral's experts from its config: one routing group of the microbatch's tokens,
  ``capacity`` slots per expert, three SwiGLU matmuls per expert; forward and backward (each
  matmul's input and weight gradients) are 3 x 3 matmuls of ``2 E C h f`` FLOPs."""
  tokens = rows * c.seq_len
  cap = min(tokens, math.ceil(c.capacity_factor * tokens * c.top_k / c.num_experts))
  E, h, f = c.num_experts, c.hidden, c.ffn_hidden
  return {"matmul_flops": 9 * 2 * E * cap * h * f, "state_bytes": 3 * E * h * f * 16.0,
          "routed_bytes": E * cap * h * 4.0, "num_experts": E}


def _moe_by_hand(c, rows: int) -> dict:
  """The zoo MoE's experts: per sequence ``ceil(s * factor / E)`` slots, two GELU-MLP matmuls
  per expert (``h -> 4h -> h``), forward and backward 3 x 2 matmuls of ``2 b E C h f``."""
  cap = max(1, math.ceil(c.seq_len * c.capacity_factor / c.num_experts))
  E, h, f = c.num_experts, c.hidden, c.hidden * c.mlp_ratio
  return {"matmul_flops": 6 * 2 * rows * E * cap * h * f, "state_bytes": 2 * E * h * f * 16.0,
          "routed_bytes": rows * E * cap * h * 4.0, "num_experts": E}


@pytest.mark.parametrize("name, config, by_hand", [
    ("mixtral-tiny", MIXTRAL_TINY, _mixtral_by_hand),
    ("moe-tiny", MOE_TINY, _moe_by_hand),
])
def test_expert_flops_are_the_expert_matmuls_by_hand(name, config, by_hand):
  spec = BUILTIN_MODELS[name](num_microbatches=2, num_blocks=2)
  res = _profile(spec, ONE_HOST, use_cache=False)
  t, layers = res.tables, res.layers
  split = t.routed_split
  want = by_hand(config, spec.microbatch_size)
  routed = [l for l in range(t.num_layers) if split.routed(l)]
  # one layer per routed block reads the expert weights; the others route nothing
  assert len(routed) == sum(m.routed for m in layers.modules) >= 1
  jaxpr = sources.JaxprSource(num_microbatches=spec.num_microbatches)
  found = P.enumerate_tasks(layers, ONE_HOST, P.ordered_subclusters(ONE_HOST, None),
                            res.options, jaxpr.name, jaxpr.cache_extra(),
                            (lambda dp: None, lambda dp: dp == 1))
  for l in routed:
    assert split.num_experts[l] == want["num_experts"]
    assert split.expert_state_bytes[l] == want["state_bytes"]
    assert split.routed_bytes[l] == want["routed_bytes"]
    assert 0 < split.expert_act_bytes[l] <= t.act_mem_bytes[0][l, l, 0]
    for c, cfg in enumerate(found.configs):
      task = found.tasks[found.assign[c][l]]
      cost = rs.expert_cost(jaxpr.traced(task), tuple(task.mesh), task.gpu, None, 16.0)
      dp, tp = task.mesh   # each device does its share of the examples and of the ffn width
      assert cost.matmul_flops == want["matmul_flops"] / (dp * tp), (cfg, cost)
      assert cost.matmul_flops < cost.flops < res.costs[("a100", cfg.submesh, cfg.mesh)][
          "flops"][l]
      # the split holds, for each entry, the experts' seconds on the mesh the entry keeps
      if t.logical_mesh_of(0, l, l, cfg.submesh_index) == tuple(cfg.mesh):
        assert split.expert_time_s[0][l, cfg.submesh_index] == cost.time_s
  for s in range(len(t.submeshes[0])):
    x = split.expert_time_s[0][:, s]
    whole = np.array([t.stage_time_s[0][l, l, s] for l in range(t.num_layers)])
    assert (x[routed] > 0).all() and (x[routed] < whole[routed]).all()
    assert (x[[l for l in range(t.num_layers) if l not in routed]] == 0).all()


@pytest.mark.slow
def test_split_on_two_types_is_cached_and_a_dense_gpt_has_none(tmp_path):
  spec = BUILTIN_MODELS["mixtral-tiny"](num_microbatches=2, num_blocks=1)
  first = _profile(spec, TWO_TYPES, cache_dir=str(tmp_path))
  again = _profile(spec, TWO_TYPES, cache_dir=str(tmp_path))
  assert again.stats.computed == 0
  a, b = first.tables.routed_split, again.tables.routed_split
  for k in range(2):
    np.testing.assert_array_equal(a.expert_time_s[k], b.expert_time_s[k])
  # the same experts take longer on the V100 than on the A100, as the whole entry does
  l = next(l for l in range(a.num_layers) if a.routed(l))
  assert a.expert_time_s[0][l, 0] > a.expert_time_s[1][l, 0]
  gpt = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2, num_blocks=1)
  assert _profile(gpt, ONE_HOST, use_cache=False).tables.routed_split is None
