"""Why no plan fits: the diagnosis behind :class:`~harpjax.errors.InfeasiblePlanError`.

When :func:`~harpjax.compiler.planner.solve` finds no plan, :func:`_infeasible` names the
constraint that rules every plan out (``"layers"``, ``"memory"``, ``"communication"`` or
``"devices"``) and by how much: the smallest footprint and its shortfall, the best plan
ignoring ``C(j) <= t_max`` and how many times its cut is too slow, or the smallest uniform
memory scale at which a plan fits (a bisection over scaled sparse indexes).
"""

from __future__ import annotations

import math

import numpy as np

from harpjax.compiler._plan_eval import evaluate_plan
from harpjax.compiler._sparse_index import SparseIndex
from harpjax.compiler.cost_tables import CostTables
from harpjax.errors import InfeasiblePlanError


def _infeasible(tables: CostTables, B: int, eps: float) -> InfeasiblePlanError:
  """Says which constraint makes every plan infeasible, and by how much."""
  constraint, msg = _diagnose(tables, B, eps)
  err = InfeasiblePlanError(f"no pipeline plan for {tables.describe()} with B={B}: {msg}")
  err.constraint = constraint
  return err


def _diagnose(tables: CostTables, B: int, eps: float) -> tuple[str, str]:
  L, K = tables.num_layers, tables.num_subclusters
  gib = 2.0 ** 30
  if L < K:
    return "layers", (f"every subcluster needs at least one stage (all devices are used), but "
                      f"there are {L} layers for {K} subclusters")
  index = SparseIndex.build(tables)
  for k in range(K):
    if not (index.ent_k == k).any():
      best = (math.inf, None)
      for s in range(len(tables.submeshes[k])):
        fp = tables.param_mem_bytes[k][:, :, s] + tables.act_mem_bytes[k][:, :, s]
        fp = np.where(np.isfinite(tables.stage_time_s[k][:, :, s]), fp, np.inf)
        i, j = np.unravel_index(np.argmin(fp), fp.shape)
        if fp[i, j] < best[0]:
          best = (float(fp[i, j]), (int(i), int(j), tables.submeshes[k][s]))
      mem = tables.device_memory_bytes[k]
      if best[1] is None:
        return "devices", f"subcluster {tables.subcluster_names[k]!r} has no finite stage time"
      return "memory", (
          f"subcluster {tables.subcluster_names[k]!r} cannot hold any stage: the smallest, "
          f"layers {best[1][0]}..{best[1][1]} on {best[1][2]}, needs {best[0] / gib:.3f} GiB "
          f"per device with one microbatch in flight, {(best[0] - mem) / gib:.3f} GiB more "
          f"than the {mem / gib:.3f} GiB device")
  free = SparseIndex.build(tables, mem_scale=math.inf)
  top = float(free.candidates[-1])
  if not math.isfinite(free.run(top, B, eps, require_hit=False)[0]):
    value, path = free.run(top, B, eps, require_hit=False, check_comm=False)
    if not math.isfinite(value):
      return "devices", (f"the {L} layers cannot be cut into stages that use all "
                         f"{tables.total_devices} devices in subcluster order "
                         f"{list(tables.subcluster_names)} with finite stage times")
    quads = [(int(free.ent_i[e]), int(free.ent_j[e]), int(free.ent_k[e]), int(free.ent_s[e]))
             for e in path]
    ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
    x = int(np.argmax([s.comm_s for s in ev.stages]))
    st = ev.stages[x]
    return "communication", (
        f"every plan has a cut slower than its bottleneck stage (H-1F1B needs C(j) <= t_max). "
        f"The best plan without that rule cuts after layer {st.layers[1]} "
        f"({tables.boundary_bytes[st.layers[1]]:.4g} bytes) in {st.comm_s:.6g} s while its "
        f"t_max is {ev.t_max_s:.6g} s: {st.comm_s / ev.t_max_s:.3f}x too slow")
  def fits(scale):
    idx = SparseIndex.build(tables, mem_scale=scale)
    if idx.num_entries == 0:
      return None
    value, path = idx.run(float(idx.candidates[-1]), B, eps, require_hit=False)
    return (idx, path) if math.isfinite(value) else None
  if fits(1.0) is not None:
    msg = ("plans exist whose stages all stay within some t_max, but none stays valid when "
           "t_max is its own bottleneck (more warm-ups: memory; smaller t_max: C(j) <= t_max)")
    top = float(index.candidates[-1])
    worst_link = max(range(K - 1), key=lambda k: tables.inter_comm_s[k, :L - 1].min(),
                     default=None)
    if worst_link is None:
      return "memory", msg
    j = int(np.argmin(tables.inter_comm_s[worst_link, :L - 1]))
    c = float(tables.inter_comm_s[worst_link, j])
    msg += (f". Every plan crosses from {tables.subcluster_names[worst_link]!r} to "
            f"{tables.subcluster_names[worst_link + 1]!r} once; the cheapest such cut (after "
            f"layer {j}) takes {c:.6g} s, so t_max >= {c:.6g} s, while the slowest stage that "
            f"fits takes {top:.6g} s")
    return ("communication" if c > 0.5 * top else "memory"), msg
  lo, hi = 1.0, 2.0
  while fits(hi) is None and hi < 2.0 ** 30:
    lo, hi = hi, hi * 2
  for _ in range(40):
    mid = 0.5 * (lo + hi)
    if fits(mid) is None:
      lo = mid
    else:
      hi = mid
    if hi / lo < 1 + 1e-4:
      break
  idx, path = fits(hi)
  quads = [(int(idx.ent_i[e]), int(idx.ent_j[e]), int(idx.ent_k[e]), int(idx.ent_s[e]))
           for e in path]
  ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
  worst = max(ev.stages, key=lambda s: s.peak_mem_bytes / s.device_memory_bytes)
  return "memory", (
      f"no plan fits device memory with the H-1F1B warm-ups of its own bottleneck; the plans "
      f"that come closest need {hi:.4f}x the device memory: e.g. layers "
      f"{worst.layers[0]}..{worst.layers[1]} on {worst.subcluster_name} {worst.submesh} with "
      f"{worst.inflight} microbatches in flight need {worst.peak_mem_bytes / gib:.3f} GiB, "
      f"{(worst.peak_mem_bytes - worst.device_memory_bytes) / gib:.3f} GiB more than the "
      f"{worst.device_memory_bytes / gib:.3f} GiB device")
