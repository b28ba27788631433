"""The one builder of :class:`~harpjax.compiler.profile.CostTables` from per-layer-range costs:
:func:`assemble_tables` takes the range costs of every (submesh, logical mesh), keeps the best
logical mesh of each entry (what fits, then what is fastest), prunes hopelessly imbalanced
ranges (HARP §5.1) and writes the arrays. The profiler
(:func:`~harpjax.compiler.profile.profiler.tables_from_layer_costs`) and the layer-profile cost
model (:meth:`~harpjax.compiler.profile.LayerProfile.cost_tables`) both build their tables
here."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.layers import LogicalMesh
from harpjax.compiler.profile.tables import CostTables, range_sums

__all__ = ["assemble_tables", "MeshCosts"]


MeshCosts = tuple  # (mesh, time, param bytes, act bytes[, end time]); arrays [L, L]
"""``((dp, tp), time_s [L, L], param_mem_bytes [L, L], act_mem_bytes [L, L])`` of every layer
range on one submesh under one logical mesh."""


def assemble_tables(*, names: Sequence[str], num_hosts: Sequence[int],
                    devices_per_host: Sequence[int], memory_bytes: Sequence[float],
                    submeshes: Sequence[Sequence[tuple[int, int]]],
                    mesh_costs: Callable[[int, int], Iterable[MeshCosts]],
                    boundary_bytes: Sequence[float], intra_links: Sequence[Link],
                    inter_links: Sequence[Link], peak_flops: Sequence[float] | None = None,
                    layer_flops: Sequence[float] | None = None, imbalance: float = np.inf,
                    layer_names: Sequence[str] | None = None,
                    pair_links: Sequence[Sequence[Link | None]] | None = None,
                    price_per_gpu_hour: Sequence[float] | None = None,
                    offload_bandwidth_bytes_per_s: Sequence[float] | None = None,
                    host_links: Sequence[Link] | None = None,
                    num_microbatches: int | None = None
                    ) -> tuple[CostTables, dict]:
  """Builds :class:`CostTables` from the range costs of every (submesh, logical mesh).

  For each entry (layer range, submesh) the logical mesh kept is the fastest (time per
  microbatch, plus the end time over ``num_microbatches`` when given) of those whose
  parameters plus one in-flight microbatch fit the device; if none fits, with the optimizer
  state given, the fastest that fits with its state split over its ``dp`` devices (what the
  planner's ZeRO variants can use); else the one with the smallest footprint (its time is
  kept: the planner drops the entry by its memory check).
  A multi-layer range whose share of the model's FLOPs exceeds ``imbalance`` times its
  submesh's share of the cluster's peak FLOP/s is hopelessly imbalanced (§5.1) and marked
  infeasible (``inf``).

  Args:
    names, num_hosts, devices_per_host, memory_bytes: ``[K]`` per subcluster, in pipeline
      order.
    submeshes: ``[K]`` tuples of ``(n, m)``.
    mesh_costs: ``mesh_costs(k, s)`` yields :data:`MeshCosts` of submesh ``s`` of subcluster
      ``k``: ``((dp, tp), time, param bytes, act bytes)`` ``[L, L]`` arrays (an ``inf`` time
      marks a range that cannot run), optionally with a fifth, the end-of-iteration seconds
      (:attr:`CostTables.end_time_s`), and then a sixth and a seventh, the optimizer state's
      bytes and the weights' all-gather seconds (:attr:`CostTables.opt_mem_bytes`,
      :attr:`CostTables.gather_time_s`; both ``None``: no ZeRO data), and an eighth, the
      gradient all-reduce's part of the end time (:attr:`CostTables.sync_time_s`), and a
      ninth, a tenth and an eleventh, the layers' largest temporaries, the peak after the
      pipeline and the most gradient a backward writes beside the accumulator
      (:attr:`CostTables.workspace_bytes`, :attr:`CostTables.step_mem_bytes`,
      :attr:`CostTables.grad_out_bytes`).
    boundary_bytes: ``[L]``.
    intra_links: ``[K]`` links inside each subcluster; inter_links: ``[K - 1]`` between
      consecutive ones.
    pair_links: optional ``[K, K]`` links between any two subclusters (``None`` where there is
      none; the diagonal is ignored); ``inter_links`` may then be empty.
    price_per_gpu_hour: optional ``[K]`` price of one device per hour.
    offload_bandwidth_bytes_per_s: optional ``[K]`` device-to-host-memory bandwidth
      (:attr:`CostTables.offload_bandwidth_bytes_per_s`).
    host_links: optional ``[K]`` links between two devices of one host (cuts between stages
      sharing a host, :attr:`CostTables.host_bandwidth_bytes_per_s`).
    peak_flops: optional ``[K]`` peak FLOP/s of one device (the imbalance rule and the
      load-balance score).
    layer_flops: ``[L]`` forward FLOPs per layer, for the imbalance rule.
    imbalance: the pruning factor (``inf`` disables it).
    layer_names: optional ``[L]``.
    num_microbatches: the iteration's microbatches, over which an end time is spread when
      logical meshes are compared (``None``: meshes are compared by time per microbatch).

  Returns:
    ``(tables, counts)``, counts of entries that fit no logical mesh (``"oom"``) and of entries
    pruned as imbalanced (``"imbalance"``).
  """
  K, L = len(names), len(boundary_bytes)
  iu = np.triu_indices(L)
  hopeless_share = None
  if np.isfinite(imbalance):
    flops = np.asarray(layer_flops, dtype=np.float64)
    share_f = range_sums(flops) / max(flops.sum(), 1e-30)
    total_peak = sum(peak_flops[k] * num_hosts[k] * devices_per_host[k] for k in range(K))
    multi = np.zeros((L, L), dtype=bool)
    multi[iu] = iu[0] < iu[1]
    hopeless_share = lambda k, g: multi & (share_f > imbalance * peak_flops[k] * g / total_peak)
  counts = {"oom": 0, "imbalance": 0}
  stage_t, param_m, act_m, logical, end_t, opt_m, gat_t, sync_t = [], [], [], [], [], [], [], []
  work_m, step_m, gout_m = [], [], []
  has_end = has_zero = has_sync = has_mem = False
  per_iteration = 0.0 if num_microbatches is None else 1.0 / num_microbatches
  for k in range(K):
    S = len(submeshes[k])
    t_k = np.full((L, L, S), np.inf)
    p_k, a_k, e_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    o_k, g_k, y_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    w_k, z_k, q_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    lm_k = np.zeros((L, L, S, 2), dtype=np.int64)
    ep_k = np.ones((L, L, S), dtype=np.int64)
    for s, (n, m) in enumerate(submeshes[k]):
      g = n * m
      lm_k[..., s, 0], lm_k[..., s, 1] = g, 1
      # [fits, time, param, act, dp, tp, footprint, end, opt, gather, tier, sync, rank];
      # tier 2: fits at level 0, 1: fits only with its state split over dp (ZeRO-3, given
      # the optimizer state), 0: neither. Rank: the time per microbatch with the end time
      # spread over the iteration's microbatches.
      best = None
      for mesh, t, pm, am, *rest in mesh_costs(k, s):
        lmesh = LogicalMesh.of(mesh)
        dp, tp, ep = lmesh.dp, lmesh.tp, lmesh.ep
        has_end |= bool(rest)
        end = rest[0] if rest else 0.0
        with_zero = len(rest) > 1 and rest[1] is not None
        opt, gat = (rest[1], rest[2]) if with_zero else (0.0, 0.0)
        has_zero |= with_zero
        sync = rest[3] if len(rest) > 3 else 0.0
        has_sync |= len(rest) > 3
        work, step, gout = (rest[4], rest[5], rest[6]) if len(rest) > 6 else (0.0, 0.0, 0.0)
        has_mem |= len(rest) > 6
        rank = t + np.asarray(end) * per_iteration if per_iteration else t
        foot = pm + am
        fits = np.isfinite(t) & (foot <= memory_bytes[k]) & (step <= memory_bytes[k])
        tier = np.where(fits, 2, 0)
        if with_zero:
          tier = np.where(~fits & np.isfinite(t) & (pm / dp + am <= memory_bytes[k]), 1, tier)
        if best is None:
          best = [fits, t, pm, am, np.full((L, L), dp), np.full((L, L), tp), foot,
                  np.broadcast_to(end, (L, L)), np.broadcast_to(opt, (L, L)),
                  np.broadcast_to(gat, (L, L)), tier, np.broadcast_to(sync, (L, L)),
                  np.broadcast_to(rank, (L, L)), np.broadcast_to(work, (L, L)),
                  np.broadcast_to(step, (L, L)), np.broadcast_to(gout, (L, L)),
                  np.full((L, L), ep)]
          continue
        better = (tier > best[10]) | ((tier == best[10]) & (tier > 0) & (rank < best[12])) | \
            ((tier == 0) & (best[10] == 0) & (foot < best[6]))
        for idx, new in enumerate((fits, t, pm, am, dp, tp, foot, end, opt, gat, tier, sync,
                                   rank, work, step, gout, ep)):
          best[idx] = np.where(better, new, best[idx])
      if best is None:
        continue
      fits, t, pm, am, dps, tps, _, ends, opts, gats, _, syncs, _, works, steps, gouts, eps = \
          best
      keep = np.isfinite(t)
      counts["oom"] += int(np.sum(~fits[iu]))
      if hopeless_share is not None:
        hopeless = hopeless_share(k, g)
        counts["imbalance"] += int(np.sum((hopeless & fits)[iu]))
        keep &= ~hopeless
      t_k[iu[0], iu[1], s] = np.where(keep, t, np.inf)[iu]
      p_k[iu[0], iu[1], s] = np.where(np.isfinite(pm), pm, 0.0)[iu]
      a_k[iu[0], iu[1], s] = np.where(np.isfinite(am), am, 0.0)[iu]
      e_k[iu[0], iu[1], s] = np.where(np.isfinite(ends), ends, 0.0)[iu]
      o_k[iu[0], iu[1], s] = np.where(np.isfinite(opts), opts, 0.0)[iu]
      g_k[iu[0], iu[1], s] = np.where(np.isfinite(gats), gats, 0.0)[iu]
      y_k[iu[0], iu[1], s] = np.where(np.isfinite(syncs), syncs, 0.0)[iu]
      w_k[iu[0], iu[1], s] = np.where(np.isfinite(works), works, 0.0)[iu]
      z_k[iu[0], iu[1], s] = np.where(np.isfinite(steps), steps, 0.0)[iu]
      q_k[iu[0], iu[1], s] = np.where(np.isfinite(gouts), gouts, 0.0)[iu]
      lm_k[..., s, 0] = np.where(keep, dps, g)
      lm_k[..., s, 1] = np.where(keep, tps, 1)
      ep_k[..., s] = np.where(keep, eps, 1)
    stage_t.append(t_k)
    param_m.append(p_k)
    act_m.append(a_k)
    # (dp, tp), or (dp, tp, ep) where some entry keeps an expert-parallel mesh
    logical.append(np.concatenate([lm_k, ep_k[..., None]], axis=-1) if (ep_k > 1).any()
                   else lm_k)
    end_t.append(e_k)
    opt_m.append(np.minimum(o_k, p_k))
    gat_t.append(g_k)
    sync_t.append(np.minimum(y_k, e_k))
    work_m.append(np.minimum(w_k, p_k))
    step_m.append(z_k)
    gout_m.append(q_k)
  tables = CostTables(
      num_layers=L, subcluster_names=tuple(names), num_hosts=tuple(num_hosts),
      devices_per_host=tuple(devices_per_host), device_memory_bytes=tuple(memory_bytes),
      submeshes=tuple(tuple(s) for s in submeshes), stage_time_s=tuple(stage_t),
      param_mem_bytes=tuple(param_m), act_mem_bytes=tuple(act_m),
      boundary_bytes=np.asarray(boundary_bytes, dtype=np.float64),
      intra_bandwidth_bytes_per_s=tuple(l.bandwidth_bytes_per_s for l in intra_links),
      intra_latency_s=tuple(l.latency_s for l in intra_links),
      inter_bandwidth_bytes_per_s=tuple(l.bandwidth_bytes_per_s for l in inter_links),
      inter_latency_s=tuple(l.latency_s for l in inter_links),
      link_bandwidth_bytes_per_s=None if pair_links is None else tuple(
          tuple(0.0 if (l is None or a == b) else l.bandwidth_bytes_per_s
                for b, l in enumerate(row)) for a, row in enumerate(pair_links)),
      link_latency_s=None if pair_links is None else tuple(
          tuple(0.0 if (l is None or a == b) else l.latency_s for b, l in enumerate(row))
          for a, row in enumerate(pair_links)),
      price_per_gpu_hour=None if price_per_gpu_hour is None else tuple(
          float(p) for p in price_per_gpu_hour),
      logical_mesh=tuple(logical), end_time_s=tuple(end_t) if has_end else None,
      opt_mem_bytes=tuple(opt_m) if has_zero else None,
      gather_time_s=tuple(gat_t) if has_zero else None,
      sync_time_s=tuple(sync_t) if has_sync and has_end else None,
      workspace_bytes=tuple(work_m) if has_mem else None,
      step_mem_bytes=tuple(step_m) if has_mem else None,
      grad_out_bytes=tuple(gout_m) if has_mem else None,
      offload_bandwidth_bytes_per_s=None if offload_bandwidth_bytes_per_s is None else tuple(
          float(b) for b in offload_bandwidth_bytes_per_s),
      host_bandwidth_bytes_per_s=None if host_links is None else tuple(
          l.bandwidth_bytes_per_s for l in host_links),
      host_latency_s=None if host_links is None else tuple(l.latency_s for l in host_links),
      peak_flops=None if peak_flops is None else tuple(float(p) for p in peak_flops),
      layer_names=tuple(layer_names) if layer_names is not None else None,
      link_curves=link_curves(intra_links, inter_links, pair_links))
  return tables, counts


def link_curves(intra_links: Sequence[Link], inter_links: Sequence[Link],
                pair_links: Sequence[Sequence[Link | None]] | None = None):
  """``[K, K]`` bandwidth curves of the tables' links (:attr:`CostTables.link_curves`): the
  diagonal from ``intra_links``, the rest from ``pair_links`` (or the consecutive
  ``inter_links``); ``None`` where a link has none."""
  K = len(intra_links)
  out = [[None] * K for _ in range(K)]
  for k, l in enumerate(intra_links):
    out[k][k] = l.curve
  if pair_links is None:
    for k, l in enumerate(inter_links):
      out[k][k + 1] = out[k + 1][k] = l.curve
  else:
    for a, row in enumerate(pair_links):
      for b, l in enumerate(row):
        if a != b and l is not None:
          out[a][b] = l.curve
  return tuple(tuple(r) for r in out)
