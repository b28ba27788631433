"""The paper's baseline planners, all scored on the same cost tables as the DP.

A developer tool (``benchmarks/planner.py`` compares the DP with them), not part of the library.

* (a) :func:`homogeneous_plan`: what a homogeneous framework does: ``S`` stages of equal
  layers on equal submeshes, for the best ``S`` (an oracle choice, which flatters it).
* (b) :func:`coarse_plan`: the same DP over coarse layers (:func:`equal_work_cuts` for
  Alpa-style 8 layers, :func:`group_cuts` for one layer per transformer block).
* (c) :func:`comm_unaware_plan`: the same DP with ``C = 0``, then scored with the true ``C``.
* (d) :func:`schedule_variants`: one plan under 1F1B, Eager-1F1B and H-1F1B.

Every plan is scored by :func:`~harpjax.compiler.plan.evaluate_plan` (with the simulator), so
the comparison is on one model and one set of inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from harpjax.compiler.plan import (PlanEvaluation, PlanResult, SolveOptions, evaluate_plan,
                                   solve)
from harpjax.compiler.profile import CostTables
from harpjax.errors import InfeasiblePlanError, PlanError

__all__ = ["join_runs", "BaselineResult", "homogeneous_plan", "coarse_plan", "equal_work_cuts", "group_cuts",
           "comm_unaware_plan", "schedule_variants"]

Quad = tuple[int, int, int, int]  # (first layer, last layer, subcluster, submesh index)


# --------------------------------------------------------------------------- baselines


@dataclasses.dataclass(frozen=True)
class BaselineResult:
  """A baseline's plan (fine layer ranges) and its evaluation on the fine tables."""
  name: str
  stages: tuple[Quad, ...]
  evaluation: PlanEvaluation
  note: str = ""

  @property
  def iteration_s(self) -> float:
    return self.evaluation.iteration_s if self.evaluation.feasible else math.inf


def homogeneous_plan(tables: CostTables, num_microbatches: int, *, eps: float = 0.1,
                     schedule: str = "1f1b") -> BaselineResult:
  """Baseline (a): equal layers per stage on equal submeshes, best stage count.

  For every stage count ``S`` whose ``D / S`` devices form a submesh of every subcluster and
  divide each subcluster's devices, the layers are split into ``S`` near-equal contiguous
  chunks (the first ``L mod S`` get one more) and placed in subcluster order, run with a
  homogeneous framework's schedule (1F1B by default). The best memory-feasible ``S`` by
  predicted iteration time is returned (an oracle choice of ``S``, which flatters it).

  Raises:
    InfeasiblePlanError: no stage count gives a plan that fits memory.
  """
  L, D, K = tables.num_layers, tables.total_devices, tables.num_subclusters
  best, tried = None, []
  for S in range(1, min(L, D) + 1):
    if D % S:
      continue
    g = D // S
    if any(n % g for n in tables.subcluster_devices):
      continue
    sub = []
    for k in range(K):
      s_idx = [x for x, (n, m) in enumerate(tables.submeshes[k]) if n * m == g]
      sub += [(k, s_idx[0])] * (tables.subcluster_devices[k] // g) if s_idx else [None]
    if None in sub:
      continue
    q, r = divmod(L, S)
    bounds, start = [], 0
    for x in range(S):
      size = q + (1 if x < r else 0)
      bounds.append((start, start + size - 1))
      start += size
    quads = tuple((i, j, k, s) for (i, j), (k, s) in zip(bounds, sub))
    ev = evaluate_plan(tables, quads, num_microbatches, schedule, eps=eps)
    tried.append((S, ev.feasible))
    if ev.feasible and math.isfinite(ev.iteration_s) and (
        best is None or ev.iteration_s < best.evaluation.iteration_s):
      best = BaselineResult("homogeneous", quads, ev, note=f"S={S} stages of {g} devices")
  if best is None:
    raise InfeasiblePlanError(f"homogeneous baseline: no equal split fits (tried {tried})")
  return best


def equal_work_cuts(tables: CostTables, num_layers: int,
                    weights: Sequence[float] | None = None) -> tuple[int, ...]:
  """Last fine layer of each of ``num_layers`` coarse layers of near-equal work.

  Args:
    tables: the fine tables.
    num_layers: coarse layers wanted (``<= L``).
    weights: ``[L]`` work per fine layer; default its time alone on the first subcluster's
      smallest submesh (any finite one).
  """
  L = tables.num_layers
  if not 1 <= num_layers <= L:
    raise PlanError(f"num_layers={num_layers} must be in 1..{L}")
  if weights is None:
    w = np.full(L, np.inf)
    for k in range(tables.num_subclusters):
      for s in range(len(tables.submeshes[k])):
        d = np.diagonal(tables.stage_time_s[k][:, :, s])
        w = np.where(np.isfinite(w), w, d)
    w = np.where(np.isfinite(w), w, 0.0)
  else:
    w = np.asarray(weights, dtype=np.float64)
  cum = np.cumsum(w)
  cuts, prev = [], -1
  for q in range(1, num_layers):
    target = cum[-1] * q / num_layers
    j = int(np.argmin(np.abs(cum - target)))
    j = max(j, prev + 1)
    j = min(j, L - 1 - (num_layers - q))
    cuts.append(j)
    prev = j
  return tuple(cuts) + (L - 1,)


def group_cuts(labels: Sequence[str]) -> tuple[int, ...]:
  """Last fine layer of each run of equal labels (e.g. one coarse layer per block)."""
  labels = list(labels)
  return tuple(x for x in range(len(labels)) if x == len(labels) - 1
               or labels[x + 1] != labels[x])


def _fine(quads, ends: Sequence[int]) -> tuple[Quad, ...]:
  starts = [0] + [e + 1 for e in ends[:-1]]
  return tuple((starts[i], ends[j], k, s) for i, j, k, s in quads)


def _quads(result: PlanResult) -> tuple[Quad, ...]:
  return tuple((s.layers[0], s.layers[1], s.subcluster, s.submesh_index) for s in result.stages)


def coarse_plan(tables: CostTables, num_microbatches: int, last_layers: Sequence[int], *,
                options: SolveOptions | None = None, name: str = "coarse") -> BaselineResult:
  """Baseline (b): the same DP over coarse layers, scored on the fine tables."""
  coarse = tables.coarsen(last_layers)
  res = solve(coarse, num_microbatches, options=options)
  quads = _fine(_quads(res), list(last_layers))
  ev = evaluate_plan(tables, quads, num_microbatches, "h1f1b", eps=res.eps)
  return BaselineResult(name, quads, ev, note=f"{coarse.num_layers} layers")


def comm_unaware_plan(tables: CostTables, num_microbatches: int, *,
                      options: SolveOptions | None = None) -> BaselineResult:
  """Baseline (c): the DP with ``C = 0``, scored with the true ``C`` (and its warm-ups)."""
  res = solve(tables.without_communication(), num_microbatches, options=options)
  quads = _quads(res)
  ev = evaluate_plan(tables, quads, num_microbatches, "h1f1b", eps=res.eps)
  return BaselineResult("comm_unaware", quads, ev)


def schedule_variants(tables: CostTables, result: PlanResult,
                      schedules: Sequence[str] = ("1f1b", "eager_1f1b", "h1f1b")
                      ) -> dict[str, BaselineResult]:
  """Baseline (d): one plan under several schedules (memory checked per schedule)."""
  quads = _quads(result)
  return {s: BaselineResult(s, quads, evaluate_plan(tables, quads, result.num_microbatches, s,
                                                    eps=result.eps)) for s in schedules}


def join_runs(parts) -> str:
  """``parts`` joined by commas, each run of equal neighbours written once as ``"n x part"``
  (a plan's stages, for a table cell)."""
  out, x = [], 0
  while x < len(parts):
    y = x
    while y < len(parts) and parts[y] == parts[x]:
      y += 1
    out.append(parts[x] if y - x == 1 else f"{y - x}x {parts[x]}")
    x = y
  return ", ".join(out)
