"""The planner's choice of interleaving (a plan transformation): the re-cut keeps each
group's layers and devices, and the choice is the fastest that fits among every candidate,
checked by brute force over the candidates with ``evaluate_plan``."""

import dataclasses

import pytest

from harpjax.compiler.plan import (choose_interleaving, chunk_sizes, evaluate_plan, interleave,
                                   solve)
from harpjax.errors import PlanError
from tests.compiler.plan.test_param_offload import _tables


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
