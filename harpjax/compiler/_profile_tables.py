"""From per-layer costs to :class:`~harpjax.compiler.cost_tables.CostTables`.

For every subcluster ``k``, submesh ``s`` and logical mesh, a stage of layers ``i..j`` costs
the sum of its layers' times (each with its collectives and gradient all-reduce) and needs the
sum of their parameter state plus the largest XLA workspace among them, and the sum of their
residuals per in-flight microbatch. The logical mesh with the smallest time among those that
fit one in-flight microbatch is kept; a range that fits under none is infeasible (``inf``), as
is a multi-layer range whose share of the model's FLOPs exceeds ``imbalance`` times the
submesh's share of the cluster's peak FLOP/s (hopelessly imbalanced, §5.1). Ranges of
identical layers add bit-identical sums (left to right), so the planner sees few distinct
``t_max`` candidates.

``CostTables.from_layer_costs`` takes one single-device time per layer and divides by the
submesh size; this builder needs per-(submesh, logical mesh) layer costs instead, hence its
own construction of the same object.
"""

from __future__ import annotations

import numpy as np

from harpjax.compiler.cost_tables import CostTables

__all__ = ["range_sums", "range_max", "build_tables"]


def range_sums(x: np.ndarray) -> np.ndarray:
  """``[L, L]`` sums of ``x[i..j]`` added left to right; ``inf`` if any term is not finite."""
  x = np.asarray(x, dtype=np.float64)
  L = x.size
  out = np.full((L, L), np.inf)
  for i in range(L):
    out[i, i:] = np.cumsum(x[i:])   # an inf term makes every later sum inf
  return out


def range_max(x: np.ndarray) -> np.ndarray:
  """``[L, L]`` maxima of ``x[i..j]``."""
  x = np.asarray(x, dtype=np.float64)
  L = x.size
  out = np.zeros((L, L))
  for i in range(L):
    out[i, i:] = np.maximum.accumulate(x[i:])
  return out


def build_tables(*, names, num_hosts, devices_per_host, memory_bytes, submeshes, configs,
                 layer_flops, boundary_bytes, peak_flops, intra_links, inter_links,
                 imbalance: float, layer_names=None) -> tuple[CostTables, dict]:
  """Builds the tables.

  Args:
    names, num_hosts, devices_per_host, memory_bytes, peak_flops: ``[K]`` per subcluster, in
      pipeline order.
    submeshes: ``[K]`` tuples of ``(n, m)``.
    configs: ``{(k, s): [((dp, tp), {"time_s", "param_mem_bytes", "act_mem_bytes",
      "temp_bytes": [L] arrays})]}``; ``inf`` time marks a pruned layer.
    layer_flops: ``[L]`` forward FLOPs per layer (for the imbalance rule).
    boundary_bytes: ``[L]``.
    intra_links: ``[K]`` ``(bandwidth, latency)``; inter_links: ``[K-1]``.
    imbalance: the pruning factor (``inf`` disables it).
    layer_names: optional ``[L]``.

  Returns:
    ``(tables, counts)`` with counts of pruned entries (``"oom"``, ``"imbalance"``).
  """
  K = len(names)
  L = len(boundary_bytes)
  flops = np.asarray(layer_flops, dtype=np.float64)
  share_f = range_sums(flops) / max(flops.sum(), 1e-30)
  total_peak = sum(peak_flops[k] * num_hosts[k] * devices_per_host[k] for k in range(K))
  iu = np.triu_indices(L)
  multi = np.zeros((L, L), dtype=bool)
  multi[iu] = iu[0] < iu[1]
  counts = {"oom": 0, "imbalance": 0}
  stage_t, param_m, act_m, logical = [], [], [], []
  for k in range(K):
    S = len(submeshes[k])
    t_k = np.full((L, L, S), np.inf)
    p_k, a_k = np.zeros((L, L, S)), np.zeros((L, L, S))
    lm_k = np.zeros((L, L, S, 2), dtype=np.int64)
    for s, (n, m) in enumerate(submeshes[k]):
      best = None
      for (dp, tp), arr in configs.get((k, s), []):
        t = range_sums(arr["time_s"])
        pm = range_sums(arr["param_mem_bytes"]) + range_max(arr["temp_bytes"])
        am = range_sums(arr["act_mem_bytes"])
        fits = np.isfinite(t) & (pm + am <= memory_bytes[k])
        foot = pm + am
        if best is None:
          best = [fits, np.where(fits, t, np.inf), t, pm, am, np.full((L, L), dp),
                  np.full((L, L), tp), foot]
          continue
        better = (fits & ~best[0]) | (fits & best[0] & (t < best[1])) | \
            (~fits & ~best[0] & (foot < best[7]))
        for idx, new in enumerate((fits, np.where(fits, t, np.inf), t, pm, am, dp, tp, foot)):
          best[idx] = np.where(better, new, best[idx])
      if best is None:
        lm_k[..., s, 0], lm_k[..., s, 1] = n * m, 1
        continue
      fits, _, t, pm, am, dps, tps, _ = best
      share_c = peak_flops[k] * n * m / total_peak
      hopeless = multi & (share_f > imbalance * share_c)
      counts["oom"] += int(np.sum(~fits[iu]))
      counts["imbalance"] += int(np.sum((hopeless & fits)[iu]))
      keep = fits & ~hopeless
      t_k[iu[0], iu[1], s] = np.where(keep, t, np.inf)[iu]
      p_k[iu[0], iu[1], s] = np.where(np.isfinite(pm), pm, 0.0)[iu]
      a_k[iu[0], iu[1], s] = np.where(np.isfinite(am), am, 0.0)[iu]
      lm_k[..., s, 0] = np.where(keep, dps, n * m)
      lm_k[..., s, 1] = np.where(keep, tps, 1)
    stage_t.append(t_k)
    param_m.append(p_k)
    act_m.append(a_k)
    logical.append(lm_k)
  tables = CostTables(
      num_layers=L, subcluster_names=tuple(names), num_hosts=tuple(num_hosts),
      devices_per_host=tuple(devices_per_host), device_memory_bytes=tuple(memory_bytes),
      submeshes=tuple(tuple(s) for s in submeshes), stage_time_s=tuple(stage_t),
      param_mem_bytes=tuple(param_m), act_mem_bytes=tuple(act_m),
      boundary_bytes=np.asarray(boundary_bytes, dtype=np.float64),
      intra_bandwidth_bytes_per_s=tuple(b for b, _ in intra_links),
      intra_latency_s=tuple(l for _, l in intra_links),
      inter_bandwidth_bytes_per_s=tuple(b for b, _ in inter_links),
      inter_latency_s=tuple(l for _, l in inter_links),
      logical_mesh=tuple(logical), peak_flops=tuple(peak_flops),
      layer_names=tuple(layer_names) if layer_names is not None else None)
  return tables, counts
