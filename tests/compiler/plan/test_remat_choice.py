"""Rematerialisation as a per-stage choice of the planner: tables that cost every entry in
each mode (none, full, dots: ``with_remat_choice``, ``ProfileOptions(remat="choose")``), the
search's optimum against a brute force over the modes, a chosen plan trained equal to
``jax.jit`` in float64, and the "dots" mode costed as the runtime runs it."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import harpjax
from harpjax.compiler.plan import SolveOptions, evaluate_plan, solve
from harpjax.compiler.profile import ProfileOptions, with_remat_choice
from harpjax.compiler.profile.tables import ENTRY_ARRAYS
from harpjax.errors import CostTablesError, InfeasiblePlanError, PlanError
from harpjax.models import GPTConfig
from benchmarks.lm_step import lm_train_step
from tests.compiler.plan import oracle
from tests.equivalence import DEMO_CLUSTER, compare_steps

# H-1F1B pinned: the schedule the brute force scores
OFF = SolveOptions(mixed_stages="off", backend="sequential", schedule="h1f1b")


def _rematerialised(tables, rng, slower=(1.2, 1.4), kept=(0.2, 0.5)):
  """The same tables as if every stage recomputed its forward: slower, fewer residuals (by
  default as "full" does; "dots" recomputes less and keeps more)."""
  slower = rng.uniform(*slower)
  return tables.replace(
      stage_time_s=tuple(np.where(np.isfinite(t), np.round(t * slower, 3) + 0.001, np.inf)
                         for t in tables.stage_time_s),
      act_mem_bytes=tuple(a * rng.uniform(*kept) for a in tables.act_mem_bytes))


def _solve(tables, B):
  try:
    return solve(tables, B, options=OFF)
  except InfeasiblePlanError:
    return None


@pytest.mark.parametrize("chunk", [0] + [pytest.param(c, marks=pytest.mark.slow)
                                         for c in (1, 2, 3, 4)])
def test_the_choice_is_the_optimum_of_all_modes(chunk):
  """On random instances the planner over the three modes finds the brute force's optimum
  over them, proved; it is never worse than any mode alone; each stage names its mode, and the
  plan scores the same on the tables it came from."""
  rng = np.random.default_rng(7 + chunk)
  chosen = {"none": 0, "full": 0, "dots": 0}
  most_layers = 5 if chunk == 0 else 7   # the fast chunk's brute force stays small
  for n in range(6):
    none = oracle.random_tables(rng, num_layers=int(rng.integers(3, most_layers)))
    both = with_remat_choice(none=none, full=_rematerialised(none, rng),
                             dots=_rematerialised(none, rng, (1.05, 1.2), (0.4, 0.8)))
    B = int(rng.choice([2, 4, 8]))
    squeezed = False
    if n % 2:   # memory between the least that needs no recomputation and the least with it
      need_none, _ = _least_memory(none, B, steps=12)
      need_both, scaled = _least_memory(both, B, steps=12)
      if need_both < need_none:
        both, squeezed = scaled((need_both + need_none) / 2), True
        none = none.replace(device_memory_bytes=both.device_memory_bytes)
    bf = oracle.brute_force(both, B)
    res = _solve(both, B)
    assert (res is None) == math.isinf(bf.objective_s)
    if res is None:
      continue
    assert res.stats.proved
    assert math.isclose(res.objective_s, bf.objective_s, rel_tol=1e-9), (res, bf)
    for m in range(3):
      one = both.replace(submeshes=none.submeshes, remat_modes=None, **{
          f: tuple(a[:, :, m * len(s):(m + 1) * len(s)]
                   for a, s in zip(getattr(both, f), none.submeshes))
          for f in ("stage_time_s", "param_mem_bytes", "act_mem_bytes")})
      alone = _solve(one, B)
      assert alone is None or res.objective_s <= alone.objective_s * (1 + 1e-9)
    for spec, st in zip(res.plan.stages, res.stages):
      assert spec.remat == both.remat_of(st.subcluster, st.submesh_index)
      chosen[spec.remat] += 1
    assert not squeezed or any(spec.remat != "none" for spec in res.plan.stages)
    again = evaluate_plan(both, res.plan, B)
    assert again.iteration_s == res.iteration_s and again.feasible
  assert chosen["none"] and chosen["full"] + chosen["dots"], chosen


def test_tables_with_the_choice_are_checked():
  rng = np.random.default_rng(3)
  none = oracle.random_tables(rng, num_subclusters=2)
  both = with_remat_choice(none, _rematerialised(none, rng))
  assert all(len(s) == 2 * len(n) for s, n in zip(both.submeshes, none.submeshes))
  with pytest.raises(CostTablesError, match="same layers"):
    with_remat_choice(none, oracle.random_tables(rng, num_layers=none.num_layers + 1))
  with pytest.raises(CostTablesError, match="one remat mode"):
    with_remat_choice(both, both)
  with pytest.raises(CostTablesError, match="remat_modes"):
    both.replace(remat_modes=tuple(("none",) * len(s) for s in both.submeshes))
  with pytest.raises(PlanError, match="'none' and 'full'"):
    from harpjax.compiler.plan.variants import variant_slot
    variant_slot(both, 0, both.submeshes[0][0], remat="dots")
  with pytest.raises(Exception, match="choose"):
    ProfileOptions(remat="sometimes")


def _gpt_step():
  return lm_train_step(GPTConfig(vocab_size=64, seq_len=16, hidden=32, num_heads=2,
                                 num_blocks=2, dtype="float64", param_dtype="float64"), 8)


def _least_memory(tables, B, lo=0.0, hi=1.0, steps=30):
  """The least share of the devices' memory at which ``tables`` have a plan (bisection)."""
  scaled = lambda f: tables.replace(device_memory_bytes=tuple(m * f for m in
                                                              tables.device_memory_bytes))
  for _ in range(steps):
    mid = (lo + hi) / 2
    if _solve(scaled(mid), B) is None:
      lo = mid
    else:
      hi = mid
  return hi, scaled


def test_a_plan_that_fits_only_by_rematerialising_some_stages_trains_like_jit():
  """Devices too small for any plan without rematerialisation: the planner rematerialises
  where it must, and the run equals ``jax.jit`` in float64."""
  with jax.enable_x64(True):
    step_fn, state, tokens = _gpt_step()
    B = 2
    probe = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=B,
                                  profile_options=ProfileOptions(remat="choose",
                                                                 use_cache=False))
    prof = probe.profile(state, tokens)
    both = prof.tables
    assert both.remat_modes is not None and prof.remat_costs is not None
    keep = lambda mode: both.replace(
        submeshes=tuple(tuple(sh for sh, m in zip(s, r) if m == mode)
                        for s, r in zip(both.submeshes, both.remat_modes)),
        remat_modes=None, variants=None, **{
            f: tuple(a[:, :, [x for x, m in enumerate(r) if m == mode]]
                     for a, r in zip(getattr(both, f), both.remat_modes))
            for f in ENTRY_ARRAYS if getattr(both, f) is not None})
    need_none, _ = _least_memory(keep("none"), B)
    need_both, scaled = _least_memory(both, B)
    assert need_both < need_none   # rematerialising lets smaller devices train
    tight = scaled((need_both + need_none) / 2)
    assert _solve(keep("none").replace(device_memory_bytes=tight.device_memory_bytes),
                  B) is None
    plan = _solve(tight, B).plan
    assert "full" in {s.remat for s in plan.stages}
    assert "Remat" in plan.table()
    compare_steps(step_fn, state, [tokens, tokens[::-1]], plan=plan, num_microbatches=B,
                  rtol=1e-10)


def test_dots_is_costed_as_the_runtime_runs_it_and_trains_like_jit():
  """``ProfileOptions(remat="dots")``: every planned stage says "dots"; the tables charge each
  stage the FLOPs of the forward and backward executables the runtime compiles for it
  (XLA's ``cost_analysis``, recomputation included, within 3%); over the model the residuals
  kept lie between full recomputation's and none's; the step equals ``jax.jit`` in float64."""
  from harpjax.compiler.stages import compile_stage
  with jax.enable_x64(True):
    step_fn, state, tokens = _gpt_step()
    B = 2
    profiles = {}
    for mode in ("none", "full", "dots"):
      step = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=B,
                                   profile_options=ProfileOptions(remat=mode, use_cache=False))
      profiles[mode] = (step, step.profile(state, tokens))
    step, prof = profiles["dots"]
    plan = step.plan(state, tokens)
    assert all(plan.remat_of(s) == "dots" for s in plan.stages)
    cs = step.compile(state, tokens)
    act = {m: 0.0 for m in profiles}
    for spec, st in zip(plan.stages, cs.stages):
      compiled = compile_stage(st)
      xla = sum(float(compiled[k].cost_analysis()["flops"]) for k in ("fwd", "bwd"))
      key = (spec.subcluster, tuple(spec.submesh), tuple(spec.logical_mesh))
      i, j = spec.layers
      tables = float(np.sum(prof.costs[key]["flops"][i:j + 1]))
      assert abs(tables / xla - 1) <= 0.03, (spec.layers, tables, xla)
      for m, (_, p) in profiles.items():
        act[m] += float(np.sum(p.costs[key]["act_mem_bytes"][i:j + 1]))
    assert act["full"] < act["dots"] < act["none"], act
    compare_steps(step_fn, state, [tokens, tokens[::-1]], plan=plan, num_microbatches=B,
                  rtol=1e-10)
