"""Reference and baseline planners, all scored on the same cost tables.

* :func:`brute_force`: every plan of a small instance, scored by its own rules (warm-ups from
  the plan's own bottleneck via :func:`~harpjax.compiler.schedules.h1f1b_warmups`, exact
  bin-packing of submeshes onto hosts). The reference the DP is proved against.
* (a) :func:`homogeneous_plan`: what a homogeneous framework does: ``S`` stages of equal
  layers on equal submeshes, for the best ``S`` (an oracle choice, which flatters it).
* (b) :func:`coarse_plan`: the same DP over coarse layers (:func:`equal_work_cuts` for
  Alpa-style 8 layers, :func:`group_cuts` for one layer per transformer block).
* (c) :func:`comm_unaware_plan`: the same DP with ``C = 0``, then scored with the true ``C``.
* (d) :func:`schedule_variants`: one plan under 1F1B, Eager-1F1B and H-1F1B.

Every plan is scored by :func:`~harpjax.compiler.planner.evaluate_plan` (the simulator when it
exists, else the analytic steady-period model that reduces to Eq. 12 when H-1F1B hides all
communication), so the comparison is on one model and one set of inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import paper_submeshes
from harpjax.compiler.plan.evaluate import PlanEvaluation, evaluate_plan
from harpjax.compiler.plan.solve import PlanResult, SolveOptions, solve
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import h1f1b_warmups
from harpjax.errors import InfeasiblePlanError, PlanError

__all__ = ["BruteForceResult", "brute_force", "packable", "random_tables", "BaselineResult",
           "homogeneous_plan", "coarse_plan", "equal_work_cuts", "group_cuts",
           "comm_unaware_plan", "schedule_variants"]

Quad = tuple[int, int, int, int]  # (first layer, last layer, subcluster, submesh index)


# --------------------------------------------------------------------------- brute force


@dataclasses.dataclass(frozen=True)
class BruteForceResult:
  """The optimum over every plan (``objective_s = inf`` and no stages when none is valid)."""
  objective_s: float
  t_max_s: float
  stages: tuple[Quad, ...]
  warmups: tuple[int, ...]
  num_plans: int
  num_valid: int


def packable(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]) -> bool:
  """Exact test: can these submeshes be placed on the hosts (no chain assumption)?

  The brute force's own packer, written independently of :func:`harpjax.cluster.bin_pack`
  (which the planner and the device allocator share) so that the cross-check is independent.
  """
  whole = sum(n for n, m in shapes if n > 1 or m == devices_per_host)
  if whole > num_hosts:
    return False
  items = sorted((m for n, m in shapes if n == 1 and m < devices_per_host), reverse=True)
  bins = [devices_per_host] * (num_hosts - whole)

  def place(x):
    if x == len(items):
      return True
    seen = set()
    for b in range(len(bins)):
      if bins[b] >= items[x] and bins[b] not in seen:
        seen.add(bins[b])
        bins[b] -= items[x]
        if place(x + 1):
          return True
        bins[b] += items[x]
    return False
  return place(0)


def brute_force(tables: CostTables, num_microbatches: int, eps: float = 0.1,
                max_plans: int = 2_000_000) -> BruteForceResult:
  """Enumerates every plan: stages in subcluster order using all devices.

  A plan is valid when its stage times are finite, every cut ``c_i <= t_max`` (its own
  bottleneck), every stage fits ``mem_p + min(N_i, B) mem_a <= mem`` with ``N_i`` from
  :func:`~harpjax.compiler.schedules.h1f1b_warmups` at that ``t_max``, and each subcluster's
  submeshes pack onto its hosts. Objective: Eq. 12.

  Raises:
    PlanError: more than ``max_plans`` plans (the instance is too large for brute force).
  """
  B, L, K = int(num_microbatches), tables.num_layers, tables.num_subclusters
  offs = [int(x) for x in tables.device_offsets]
  D = offs[-1]
  sizes = [[n * m for n, m in tables.submeshes[k]] for k in range(K)]
  best = [math.inf, math.inf, (), ()]
  counts = [0, 0]
  stack: list[Quad] = []

  def score():
    counts[0] += 1
    if counts[0] > max_plans:
      raise PlanError(f"brute force: more than {max_plans} plans")
    t = [float(tables.stage_time_s[k][i, j, s]) for i, j, k, s in stack]
    if not all(math.isfinite(x) for x in t):
      return
    c = []
    for a, b in zip(stack, stack[1:]):
      c.append(float(tables.intra_comm_s[a[2], a[1]] if a[2] == b[2]
                     else tables.inter_comm_s[a[2], a[1]]))
    t_max = max(t)
    if any(x > t_max for x in c):
      return
    warm = h1f1b_warmups(c, t_max, eps)
    for (i, j, k, s), w in zip(stack, warm):
      p = float(tables.param_mem_bytes[k][i, j, s])
      a = float(tables.act_mem_bytes[k][i, j, s])
      if not p + min(w, B) * a <= tables.device_memory_bytes[k]:
        return
    for k in range(K):
      shapes = [tables.submeshes[k][q[3]] for q in stack if q[2] == k]
      if not packable(tables.num_hosts[k], tables.devices_per_host[k], shapes):
        return
    counts[1] += 1
    obj = sum(x + 2.0 * y for x, y in zip(t, c + [0.0])) + (B - 1) * t_max
    if obj < best[0]:
      best[:] = [obj, t_max, tuple(stack), warm]

  def rec(i, d):
    k = max(x for x in range(K) if offs[x] <= d)
    for j in range(i, L):
      for s, m in enumerate(sizes[k]):
        d2 = d + m
        if d2 > offs[k + 1]:
          continue
        if (j == L - 1) != (d2 == D):
          continue
        stack.append((i, j, k, s))
        if j == L - 1:
          score()
        else:
          rec(j + 1, d2)
        stack.pop()

  rec(0, 0)
  return BruteForceResult(objective_s=best[0], t_max_s=best[1], stages=best[2],
                          warmups=tuple(best[3]), num_plans=counts[0], num_valid=counts[1])


def random_tables(rng: np.random.Generator, num_layers: int | None = None,
                  num_subclusters: int | None = None, max_devices: int = 4,
                  odd_hosts: bool = False) -> CostTables:
  """A small random heterogeneous instance for cross-checks against :func:`brute_force`.

  2-3 subclusters of 1-2 hosts x 1, 2 or 4 devices (at most ``max_devices`` each), different
  speeds and memories, sub-linear scaling with the submesh size, parameters sometimes sharded
  (tensor parallel) and sometimes replicated, ~8% of entries missing (``inf``), fast and slow
  links. About a fifth of the instances are infeasible and a third have binding memory. With
  ``odd_hosts`` some subclusters are 2 hosts x 3 devices, whose ``(1, 2)`` stages do not always
  pack (three of them add up to 6 devices but do not fit).
  """
  K = num_subclusters or int(rng.integers(2, 4))
  L = num_layers or int(rng.integers(K, 9))
  hosts, dph, shapes = [], [], []
  for _ in range(K):
    n, m = int(rng.integers(1, 3)), int(rng.choice([1, 2, 2, 4]))
    if odd_hosts and rng.random() < 0.5:
      n, m = 2, 3
    elif n * m > max_devices:
      n = 1
    hosts.append(n)
    dph.append(m)
    shapes.append(paper_submeshes(n, m))
  work = rng.uniform(0.5, 2.0, L)
  speed = rng.uniform(0.5, 3.0, K)
  pw, aw = rng.uniform(0.5, 2.0, L), rng.uniform(0.1, 1.0, L)
  st, pm, am = [], [], []
  for k in range(K):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    for i in range(L):
      for j in range(i, L):
        for s, (n, m) in enumerate(shapes[k]):
          g = n * m
          if rng.random() < 0.08:
            continue
          scale = g ** rng.uniform(0.6, 1.0) / rng.uniform(0.9, 1.1)
          t[i, j, s] = round(work[i:j + 1].sum() / speed[k] / scale, 3) + 0.001
          p[i, j, s] = pw[i:j + 1].sum() / (int(rng.choice([1, g])) if g > 1 else 1)
          a[i, j, s] = aw[i:j + 1].sum() / g
    st.append(t)
    pm.append(p)
    am.append(a)
  return CostTables(
      num_layers=L, subcluster_names=tuple(f"c{k}" for k in range(K)), num_hosts=tuple(hosts),
      devices_per_host=tuple(dph),
      device_memory_bytes=tuple(float(rng.uniform(1.5, 9.0)) for _ in range(K)),
      submeshes=tuple(shapes), stage_time_s=tuple(st), param_mem_bytes=tuple(pm),
      act_mem_bytes=tuple(am), boundary_bytes=rng.uniform(0, 1.0, L),
      intra_bandwidth_bytes_per_s=tuple(float(rng.choice([2.0, 20.0])) for _ in range(K)),
      intra_latency_s=(0.01,) * K,
      inter_bandwidth_bytes_per_s=tuple(float(rng.choice([0.5, 2.0, 10.0]))
                                        for _ in range(K - 1)),
      inter_latency_s=(0.05,) * (K - 1))


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
