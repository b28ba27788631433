"""The planner's choice of interleaving (a plan transformation): the re-cut keeps each
group's layers and devices, and the choice is the fastest that fits among every candidate,
checked by brute force over the candidates with ``evaluate_plan``."""

import dataclasses

import pytest

from harpjax.cluster import GPU_CATALOG, Link
from harpjax.compiler.plan import (choose_interleaving, chunk_sizes, evaluate_plan, interleave,
                                   solve)
from harpjax.compiler.profile import CostTables, SubclusterSpec, synthetic_gpt_profile
from harpjax.errors import PlanError
from tests.compiler.plan.test_param_offload import GBPS, _tables


def test_interleave_keeps_each_groups_layers_and_devices():
  T = _tables(12e9)
  base = dataclasses.replace(solve(T, 4).plan, num_microbatches=4)
  d = base.num_stages
  for v in (2, 3):
    if any(st.layers[1] - st.layers[0] + 1 < v for st in base.stages):
      continue
    p = interleave(base, v, offload_params=True)
    assert p.num_stages == v * d and p.schedule.startswith("interleaved")
    for g, st in enumerate(base.stages):
      mine = p.stages[g::d]
      assert sum(s.layers[1] - s.layers[0] + 1 for s in mine) == \
          st.layers[1] - st.layers[0] + 1
      assert all((s.subcluster, s.submesh, s.offload_params) == (st.subcluster, st.submesh, True)
                 for s in mine)
    assert [s.layers for s in p.stages][0][0] == 0
    assert all(b.layers[0] == a.layers[1] + 1 for a, b in zip(p.stages, p.stages[1:]))
  assert chunk_sizes(7, 3) == (3, 2, 2)
  with pytest.raises(PlanError, match="fewer"):
    chunk_sizes(2, 3)


@pytest.mark.parametrize("bw", [1e8, 12e9, 1e15])
def test_choice_is_the_fastest_candidate_that_fits(bw):
  T = _tables(bw)
  got = choose_interleaving(T, 4, chunks=(2, 3), offload_params=(False, True))
  base = dataclasses.replace(solve(T, 4).plan, num_microbatches=4)
  brute = [(evaluate_plan(T, base, 4).iteration_s, 1, False)]
  for v in (2, 3):
    for off in (False, True):
      try:
        e = evaluate_plan(T, interleave(base, v, off), 4)
      except PlanError:
        continue
      if e.mem_ok and e.devices_ok:
        brute.append((e.iteration_s, v, off))
  best = min(brute)
  assert got.evaluation.iteration_s == pytest.approx(best[0], rel=1e-12)
  assert (got.chunks, got.offload_params) == best[1:]
  assert got.plan.predicted_iteration_s == pytest.approx(best[0], rel=1e-12)


def _small_tables(mem_bytes):
  """The GPT of ``_tables`` (6 blocks, 6 coarse layers) on one host of 2 V100s with
  ``mem_bytes`` each; a host link that hides every prefetch."""
  prof = synthetic_gpt_profile(num_blocks=6, hidden=1024, seq_len=128, microbatch=1,
                               vocab=8192)
  g = GPU_CATALOG["V100-16G"]
  spec = SubclusterSpec("v100", 1, 2, mem_bytes, 25 * GBPS, peak_flops=g.peak_flops,
                        efficiency=0.5, host_bandwidth_bytes_per_s=g.intra_host_bytes_per_s,
                        host_latency_s=2e-6, mem_bandwidth_bytes_per_s=g.mem_bandwidth_bytes_per_s,
                        offload_bandwidth_bytes_per_s=1e15)
  fine = CostTables.from_layer_costs(prof, [spec], Link(25 * GBPS, 1e-4), max_tp=1,
                                     end_cost=True, optimizer_share=0.75)
  return fine.coarsen([3 * (b + 1) for b in range(5)] + [fine.num_layers - 1])


def test_only_an_interleaved_recut_with_offload_fits():
  """700 MiB per device: no plain plan fits (brute force over every plan of 1 or 2 stages on
  the 2 devices), nor a re-cut without parameter offload; ``v = 3`` with offload does (a
  group holds two of its three chunks' weights), and it is what the choice returns."""
  T, B = _small_tables(700 * 2**20), 4
  opts = dict(zero_levels=(0,), offload=False)
  L = T.num_layers
  shapes = list(T.submeshes[0])
  plain = [[(0, L - 1, 0, s)] for s in range(len(shapes))]
  one = shapes.index((1, 1))
  plain += [[(0, c, 0, one), (c + 1, L - 1, 0, one)] for c in range(L - 1)]
  assert not any(evaluate_plan(T, p, B).feasible for p in plain)
  got = choose_interleaving(T, B, chunks=(2, 3), offload_params=(False, True), **opts)
  relaxed = dataclasses.replace(T, device_memory_bytes=(8 * T.device_memory_bytes[0],))
  base = dataclasses.replace(solve(relaxed, B, **opts).plan, num_microbatches=B)
  fits = {}
  for v in (2, 3):
    for off in (False, True):
      e = evaluate_plan(T, interleave(base, v, off), B)
      fits[(v, off)] = e.iteration_s if e.feasible else None
  assert [k for k, x in fits.items() if x is not None] == [(3, True)]
  assert (got.chunks, got.offload_params) == (3, True)
  assert got.evaluation.iteration_s == pytest.approx(fits[(3, True)], rel=1e-12)
  assert got.candidates[0] == (1, False, None)
  assert got.evaluation.mem_ok and all(s.offload_params for s in got.plan.stages)
