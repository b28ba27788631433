"""Mixed-type stages: one pipeline stage on groups of devices of several subclusters.

A mixed stage (:attr:`~harpjax.compiler.plan.StageSpec.groups`) runs its layers on a group of
devices of each of several subclusters, data-parallel: every microbatch of ``b`` rows is split
among the groups (group ``g`` runs ``r_g`` rows, a multiple of its data-parallel degree), each
group runs its own executable on its rows, and the parameter gradients are summed across the
groups once per iteration before the update. This module costs such stages on the
:class:`~harpjax.compiler.profile.CostTables` and searches plans that use them.

**Cost model** (:func:`mixed_stage_cost`, :func:`mixed_cut_s`; what the runtime does):

* *time*: group ``g`` on layers ``i..j`` with the tables' entry of its submesh (time ``T_g``
  at the full microbatch, logical mesh ``(dp_g, tp_g)``) takes
  ``t_g(r) = T_g (alpha + (1 - alpha) r / b)`` at ``r`` rows: compute, tensor-parallel
  collectives and the amortised data-parallel reduction scale with the rows, except a fixed
  share ``alpha`` (:attr:`MixedOptions.fixed_fraction`, default 0: the tables cannot tell a
  kernel's fixed cost from its work; Zorse's per-layer fits give 0-20% at 4 rows). The
  stage's values arrive at and leave from its first group, the *home* (the runtime,
  :mod:`harpjax.compiler.stages.split`), so every other group also waits for its rows of the
  stage's inputs and outputs to cross the link from and to the home, forward and backward:
  ``route_g = 2 (in_i + out_j) r / b / bw + 4 lat`` (``in_i`` the boundary bytes of the cut
  before layer ``i``, ``out_j`` of the cut after ``j``; none at the ends of the model;
  :func:`~harpjax.compiler.profile.group_route_s`). The
  stage's forward+backward time per microbatch is ``max_g (t_g(r_g) + route_g)`` (the groups
  run in parallel on their own devices). ``r_g`` must be a multiple of ``dp_g``.
* *memory* per device of group ``g``: its entry's parameter bytes (parameters, gradients and
  optimizer state) plus, per microbatch in flight, its activation bytes times ``r_g / b``;
  checked per group against its own device memory.
* *end of iteration*: ``max_g e_g`` (each group's own reduction and update, the tables'
  ``end_time_s``) plus the cross-group sum as the runtime does it: every other group sends
  its gradient (one replica's bytes) to the home, which sums them, updates, and sends the
  parameters back, one group after the other over the link between them,
  ``sum over g != home of 2 (grad_bytes / bandwidth + latency)``
  (:func:`~harpjax.compiler.profile.home_sync_s`). The gradient bytes are
  :attr:`MixedOptions.grad_bytes` summed over the layers when given, else
  ``grad_fraction`` (0.25: weights, gradient and two Adam moments of one size) times the
  largest per-replica state of the groups (``param_mem_bytes * tp``,
  :func:`~harpjax.compiler.profile.replica_grad_bytes`). Every formula here is one of
  :mod:`harpjax.compiler.profile`'s; this module composes them.
* *cuts*: between the homes of two stages, at the full ``b`` rows: the tables' cut between
  the two home subclusters (the other groups' rows travel inside the stage time above). A
  plain stage is its own home, so between two plain stages this is the tables' cut.
* *ZeRO and offload* (a stage's :attr:`~harpjax.compiler.plan.StageSpec.zero` and
  :attr:`~harpjax.compiler.plan.StageSpec.offload`, mixed or plain): every group is priced by
  its entry's variant, the numbers of :func:`~harpjax.compiler.plan.variants.variant_arrays`
  (``dp_g`` the group's own data-parallel degree): state ``W_z + G_z + O_z`` per device in
  place of the parameter bytes (``W_z + G_z`` with offload, and ``W_z + G_z + O_z`` must fit
  the device for the update), its end time plus the weights' gather at levels 1 and 2 and
  ``2 O_z / offload_bandwidth`` with offload, and, at level 3, ``2 g`` added to its time per
  microbatch (the weights gathered in the forward and the backward: the same bytes whatever
  the rows, so not scaled by ``r_g / b``). This is conservative for the groups other than
  the first: the runtime keeps the optimizer state on the first group only
  (:mod:`harpjax.compiler.stages.split`), but every group is charged as if it held its own
  copy, split over its own ``dp`` from level 1, and ran its own update. The cross-group sum
  moves one replica's gradient whatever the level. A level above 0 or offload needs the
  tables' ``opt_mem_bytes`` (and ``offload_bandwidth_bytes_per_s``), before
  :func:`~harpjax.compiler.plan.variants.expand_variants`; at level 0 without offload the
  numbers are the ones above, unchanged. A stage's ``offload_activations`` (residuals in
  host memory) is priced alike: each group holds two microbatches' residuals at its rows and
  pays the variant's trips to host memory (those of the full microbatch: an upper bound).

**Search** (:func:`solve_mixed`, ``SolveOptions(mixed_stages="auto"|"on")``): a *fusion*
(:class:`Fusion`) is a shape of mixed stage: a submesh of each of two or more subclusters
linked to each other (whole hosts, or with ``sub_host`` a part of one host; a host holding
mixed groups runs no plain stage), and a split of every microbatch's rows among them
(``rows``), up to ``stages`` such stages. It becomes a virtual subcluster of ``stages``
"devices", one per mixed stage; the hosts left to each member stay a (smaller) subcluster of
their own. :func:`fused_tables` writes those tables exactly: stage times and end costs by the
model above, the memory of every group folded into the virtual entry (the most microbatches in
flight every group holds), the cuts to, from and between mixed stages home to home (so a cut
depends only on the two subclusters and the layer, as the DP needs). :func:`solve` on them is
the planner's search over the plans whose mixed stages are the fusion's, in one contiguous run
of the pipeline; :func:`solve_mixed` runs it for every candidate fusion and keeps the best
plan, the plan without mixed stages always a candidate, so the result is never worse; then
every pair of the :attr:`MixedOptions.pair_candidates` best fusions whose hosts fit together,
as two virtual subclusters (mixed stages of two shapes in one plan). The rows splits are splits
in whole data-parallel quanta near the speed-proportional one for two members, for more that
one and its neighbours (``shares="speed"``), or every split (``shares="all"``, small
microbatches).
``"auto"`` fuses only subclusters whose link is at least ``min_link_ratio`` times as fast as
the slower of their own links; ``"on"`` any pair linked both ways. With the tables'
``opt_mem_bytes`` the mixed stages choose their ZeRO level (one virtual choice per level,
without offload), and the plain stages around them their level and offloads from the tables'
variants (:func:`fused_tables` with ``variants``), as the plan without mixed stages, always a
candidate, does. A plan with offload on its mixed stages (hand-made, or edited) is scored by
:func:`evaluate_mixed`. The fusions' searches are bounded (:attr:`MixedOptions.prune`): the
fusions no plan within the budget or time limit can use are left out, the rest searched most
promising first, and once a search has not proved its optimum each counts only plans that
could still be kept or become pair candidates; the result is the one every fusion searched
fully gives (docs/planner.md, "Bounds on the fusions' searches").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import sys
import time
from typing import Sequence

import numpy as np

from harpjax.cluster import pack_submeshes
from harpjax.compiler.plan.evaluate import PlannedStage, check_logical_mesh, simulated_time
from harpjax.compiler.plan.schedule_choice import (choose_schedule, plan_scorer, Scorer,
                                                   ScheduleScore)
from harpjax.compiler.plan.solve import (MIXED_MODES, PlanResult, SolveOptions,
                                         register_mixed_search, solve)
from harpjax.compiler.plan.spec import Plan, StageGroup, StageSpec, ZebraGroup, row_shares
from harpjax.compiler.plan.zebra_stages import (candidate_zebra_shapes, ZebraOptions,
                                                ZebraShape, zebra_mode, zebra_stage_cost)
from harpjax.compiler.plan.variants import (VariantOptions, expand_variants, has_variant_data,
                                           variant_arrays)
from harpjax.compiler.profile import (CostTables, cuts_transfer, group_route_s,
                                      group_route_transfer, group_sync_transfer, home_sync_s,
                                      LinkFees, PlanTransfer, range_sums, replica_grad_bytes,
                                      route_cut_bytes, sync_per_microbatch)
from harpjax.compiler.schedule import (H1F1B, PipelineCosts, pipeline_period, schedule_kind,
                                       ScheduleKind)
from harpjax.errors import HarpjaxError, InfeasiblePlanError, PlanError

__all__ = ["MixedOptions", "Fusion", "GroupCost", "MixedStageCost", "MixedEvaluation",
           "mixed_stage_cost", "mixed_cut_s", "evaluate_mixed", "candidate_fusions",
           "fused_tables", "solve_mixed", "mixed_scorer", "MIXED_MODES", "zebra_mixed_cost",
           "mixed_transfer"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MixedOptions:
  """How mixed-type stages are costed and searched (``SolveOptions.mixed_options``).

  Attributes:
    microbatch_rows: ``b``, rows (sequences) of one microbatch; the search needs it (the rows
      are split among a mixed stage's groups in whole multiples of their data-parallel
      degrees). ``None``: the tables' (:attr:`CostTables.microbatch_rows`), if they carry it.
    fixed_fraction: ``alpha``, the share of a group's time that does not shrink with its rows.
    grad_fraction: gradient bytes of one replica as a share of its state bytes
      (``param_mem_bytes * tp``), when ``grad_bytes`` is not given.
    grad_bytes: optional ``[L]`` gradient bytes of each layer (one replica).
    min_link_ratio: with ``mixed_stages="auto"``, two subclusters are fused only when the link
      between them is at least this times the bandwidth of the slower of their own links.
    max_hosts_per_group: most whole hosts of one member in one mixed stage.
    split_radius: with ``shares="speed"`` and two members, the splits tried are those within
      this many data-parallel quanta of the speed-proportional one.
    sub_host: a member's group may also be a submesh inside one host (``(1, m)``, ``m < M``);
      the hosts that hold such groups then run no plain stage.
    max_members: most subclusters in one fusion.
    shares: ``"speed"`` (splits in whole data-parallel quanta: for two members those near the
      speed-proportional one, for more the speed-proportional one and its neighbours) or
      ``"all"`` (every split of the rows; small microbatches only).
    pair_candidates: plans with two shapes of mixed stage are searched for every pair of the
      this many best fusions (by the plan each found alone) whose hosts do not overlap; ``0``
      or ``1``: one shape per plan.
    zebra: ``"auto"`` (default), ``"on"`` or ``"off"``: whether to consider zebra stages
      (attention and experts of a routed model on two groups of GPUs, :mod:`~harpjax.
      compiler.plan.zebra_stages`) where the tables carry a ``routed_split``; ``"auto"``
      where the runtime runs them (:data:`~harpjax.compiler.plan.zebra_stages.ZEBRA_MODES`:
      not for the Ray runtime); ``"plan-only"`` is a deprecated ``"on"``. The local runtime
      runs them (:mod:`~harpjax.compiler.stages.zebra`); what it does not run (the Ray
      runtime, ZeRO or offloads on a zebra stage) raises
      :class:`~harpjax.errors.ZebraPlanOnlyError` when laid out.
    zebra_options: how zebra stages are costed and searched (:class:`~harpjax.compiler.plan.
      zebra_stages.ZebraOptions`; ``None``: its defaults).
    prune: bound the fusions' searches (:func:`solve_mixed`): leave out the fusions no plan
      within the budget or time limit can use, search the most promising first, and, once a
      search has not proved its optimum, count only plans that could still be kept or become
      pair candidates. ``False``: every fusion searched fully, in order (the same result,
      slower; a cross-check).
  """
  microbatch_rows: int | None = None
  fixed_fraction: float = 0.0
  grad_fraction: float = 0.25
  grad_bytes: tuple[float, ...] | None = None
  min_link_ratio: float = 1.0
  max_hosts_per_group: int = 2
  max_members: int = 3
  shares: str = "speed"
  sub_host: bool = True
  split_radius: int = 6
  pair_candidates: int = 4
  zebra: str = "auto"
  zebra_options: ZebraOptions | None = None
  prune: bool = True

  def __post_init__(self):
    from harpjax.errors import (InvalidOptionError, check_choice, check_count, check_flag,
                                check_number)
    check_count("MixedOptions.microbatch_rows", self.microbatch_rows, 1, allow_none=True)
    check_number("MixedOptions.fixed_fraction", self.fixed_fraction, 0, 1, high_open=True)
    check_number("MixedOptions.grad_fraction", self.grad_fraction, 0, 1)
    if self.grad_bytes is not None:
      try:
        g = tuple(float(x) for x in self.grad_bytes)
      except (TypeError, ValueError):
        g = (math.nan,)
      if any(not (math.isfinite(x) and x >= 0) for x in g):
        raise InvalidOptionError(f"MixedOptions.grad_bytes={self.grad_bytes!r} must be finite "
                                 "bytes >= 0 per layer, or None")
      object.__setattr__(self, "grad_bytes", g)
    check_number("MixedOptions.min_link_ratio", self.min_link_ratio, 0, finite=False)
    check_count("MixedOptions.max_hosts_per_group", self.max_hosts_per_group, 1)
    check_count("MixedOptions.max_members", self.max_members, 2)
    check_count("MixedOptions.split_radius", self.split_radius, 0)
    check_count("MixedOptions.pair_candidates", self.pair_candidates, 0)
    check_choice("MixedOptions.shares", self.shares, ("speed", "all"))
    check_flag("MixedOptions.sub_host", self.sub_host)
    object.__setattr__(self, "zebra", zebra_mode(self.zebra))
    if self.zebra_options is not None and not isinstance(self.zebra_options, ZebraOptions):
      raise InvalidOptionError(f"MixedOptions.zebra_options={self.zebra_options!r} must be a "
                               "harpjax.compiler.plan.ZebraOptions, or None")
    check_flag("MixedOptions.prune", self.prune)


# --------------------------------------------------------------------------- the cost model


def _group_time(t_full, rows, b: int, alpha: float):
  """``T (alpha + (1 - alpha) r / b)`` (scalars or arrays; one expression everywhere)."""
  return t_full * (alpha + (1.0 - alpha) * (rows / b))


def _cut(tables: CostTables, j: int, send: Sequence[tuple[int, int]],
         recv: Sequence[tuple[int, int]]) -> float:
  """Seconds of the cut after layer ``j`` between stages on groups ``send`` and ``recv``, each
  a list of ``(subcluster, rows)``, home first: the tables' cut between the homes (``b``
  rows; the other groups' rows cross inside the stages' times,
  :func:`~harpjax.compiler.profile.group_route_s`)."""
  return float(tables.pair_comm_s[send[0][0], recv[0][0], j])


@dataclasses.dataclass(frozen=True)
class GroupCost:
  """One group of a stage, costed (:func:`mixed_stage_cost`).

  Attributes:
    subcluster: index in the tables; ``submesh_index``, ``submesh``, ``logical_mesh`` its
      entry.
    rows: rows of every microbatch it runs.
    time_s: forward+backward seconds per microbatch at those rows (with the weights' gathers
      at ZeRO-3).
    param_bytes: per device: parameters, gradients and optimizer state as the stage's ZeRO
      level holds them over the group's ``dp`` (level 0: a full copy), without the optimizer
      state with offload (the module docstring: each group charged as if it held its own).
    act_bytes: per device, per microbatch in flight, at its rows.
    end_s: its own end-of-iteration seconds (the tables', with the level's gather and the
      offload's transfers).
    device_memory_bytes: its device's memory.
    zero, offload: the stage's ZeRO level and optimizer-state offload the numbers are for.
    update_bytes: with offload, the state per device while the update runs (``W_z + G_z +
      O_z``: the optimizer state brought in), which must fit the device too; else ``None``.
  """
  subcluster: int
  submesh_index: int
  submesh: tuple[int, int]
  logical_mesh: tuple[int, int]
  rows: int
  time_s: float
  param_bytes: float
  act_bytes: float
  end_s: float
  device_memory_bytes: float
  zero: int = 0
  offload: bool = False
  update_bytes: float | None = None

  def peak_bytes(self, inflight: int) -> float:
    return self.param_bytes + inflight * self.act_bytes

  @property
  def update_fits(self) -> bool:
    """Whether the state the update holds fits the device (always, without offload)."""
    return self.update_bytes is None or self.update_bytes <= self.device_memory_bytes


@dataclasses.dataclass(frozen=True)
class MixedStageCost:
  """A (possibly mixed) stage, costed: ``time_s = max`` of its groups' times; ``end_s`` their
  largest end time plus the cross-group gradient all-reduce ``sync_s``."""
  layers: tuple[int, int]
  groups: tuple[GroupCost, ...]
  time_s: float
  end_s: float
  sync_s: float
  grad_bytes: float

  def max_inflight(self, cap: int) -> int:
    """The most microbatches in flight (``<= cap``) every group's memory holds (0: none)."""
    n = cap if all(g.update_fits for g in self.groups) else 0
    for g in self.groups:
      while n > 0 and not g.peak_bytes(n) <= g.device_memory_bytes:
        n -= 1
    return n


def _grad_bytes(tables: CostTables, options: MixedOptions, i: int, j: int,
                entries: Sequence[tuple[int, int]]) -> float:
  if options.grad_bytes is not None:
    if len(options.grad_bytes) != tables.num_layers:
      raise PlanError(f"MixedOptions.grad_bytes has {len(options.grad_bytes)} entries for "
                      f"{tables.num_layers} layers")
    return float(sum(options.grad_bytes[i:j + 1]))
  return max(replica_grad_bytes(float(tables.param_mem_bytes[k][i, j, s]),
                                tables.logical_mesh_of(k, i, j, s)[1], options.grad_fraction)
             for k, s in entries)


def _zero_numbers(tables: CostTables, layers: tuple[int, int], k: int, s: int, zero: int,
                  offload: bool, offload_activations: bool = False
                  ) -> tuple[float, float, float, float, float, float | None]:
  """``(time, state bytes, activation bytes, end, time added per microbatch, update bytes)``
  of entry ``(k, layers, s)`` under ``zero`` / ``offload`` / ``offload_activations``:
  :func:`~harpjax.compiler.plan.variants.variant_arrays`' numbers (``time added``: level 3's
  gathers and the residuals' trips to host memory; ``update bytes`` with offload only)."""
  where = f"stage on layers {layers[0]}..{layers[1]} (zero={zero}, offload={offload})"
  if offload_activations and tables.offload_bandwidth_bytes_per_s is None:
    raise PlanError(f"{where}: pricing residuals in host memory needs the tables' "
                    "offload_bandwidth_bytes_per_s (a cluster file's host_memory_gbps), or "
                    "set the stage's offload_activations to False")
  if (zero or offload) and tables.opt_mem_bytes is None:
    expanded = (" these tables are expanded into variants (expand_variants): score the plan "
                "on the tables before the expansion;" if tables.variants is not None else "")
    raise PlanError(f"{where}: pricing ZeRO or offload needs the tables' opt_mem_bytes (the "
                    f"optimizer state's part of param_mem_bytes);{expanded} build the tables "
                    "with CostTables.from_layer_costs(..., optimizer_share=...) (or "
                    "ProfileOptions(optimizer_bytes_per_param=...)), or set the stage's zero "
                    "to 0 and offload to False")
  if offload and tables.offload_bandwidth_bytes_per_s is None:
    raise PlanError(f"{where}: pricing offload needs the tables' "
                    "offload_bandwidth_bytes_per_s (the device's link to host memory: "
                    "SubclusterSpec.offload_bandwidth_bytes_per_s, a cluster file's "
                    "host_memory_gbps), or set the stage's offload to False")
  i, j = layers
  t, p, a, e, _ = variant_arrays(tables, k, zero, offload, offload_activations)
  added = float(t[i, j, s]) - float(tables.stage_time_s[k][i, j, s])
  update = (float(variant_arrays(tables, k, zero, False)[1][i, j, s]) if offload else None)
  return (float(t[i, j, s]), float(p[i, j, s]), float(a[i, j, s]), float(e[i, j, s]), added,
          update)


def mixed_stage_cost(tables: CostTables, layers: tuple[int, int],
                     groups: Sequence[tuple[int, int, int]], options: MixedOptions,
                     *, zero: int = 0, offload: bool = False,
                     offload_activations: bool = False) -> MixedStageCost:
  """Costs one stage on groups ``(subcluster, submesh index, rows)`` at ZeRO level ``zero``
  with or without ``offload`` (the model of the module docstring; one group of ``b`` rows is
  a plain stage: the tables' numbers, or its variant's,
  :func:`~harpjax.compiler.plan.variants.variant_arrays`).

  Raises:
    PlanError: no ``microbatch_rows``, rows that do not add up to it or are not a multiple of
      a group's data-parallel degree, a group whose entry has no finite time, or a level above
      0 or offload on tables without ``opt_mem_bytes`` (offload: without
      ``offload_bandwidth_bytes_per_s``).
  """
  options = with_table_rows(options, tables)
  b = _rows(options)
  i, j = (int(x) for x in layers)
  zero, offload = int(zero), bool(offload)
  if zero not in (0, 1, 2, 3):
    raise PlanError(f"stage on layers {layers}: zero={zero} must be 0, 1, 2 or 3")
  if sum(r for _, _, r in groups) != b or any(r < 1 for _, _, r in groups):
    raise PlanError(f"stage on layers {layers}: rows {[r for _, _, r in groups]} must be >= 1 "
                    f"and add up to the microbatch's {b} rows")
  out = []
  home = int(groups[0][0])
  for x, (k, s, r) in enumerate(groups):
    k, s, r = int(k), int(s), int(r)
    lm = tables.logical_mesh_of(k, i, j, s)
    if len(groups) > 1 and r % lm[0]:
      raise PlanError(f"stage on layers {layers}: {r} rows on {tables.subcluster_names[k]} "
                      f"{tables.submeshes[k][s]} are not a multiple of its data-parallel "
                      f"degree {lm[0]}; change the shares or the logical mesh")
    t = float(tables.stage_time_s[k][i, j, s])
    if not math.isfinite(t):
      raise PlanError(f"stage on layers {layers}: {tables.subcluster_names[k]} "
                      f"{tables.submeshes[k][s]} has no finite time in the tables")
    single = len(groups) == 1
    time_s = t if single else float(_group_time(t, r, b, options.fixed_fraction))
    param_bytes = float(tables.param_mem_bytes[k][i, j, s])
    act = float(tables.act_mem_bytes[k][i, j, s])
    frac = 1.0 if single else r / b
    act_bytes = act * frac
    end_s, update = tables.end_of(k, i, j, s), None
    if zero or offload or offload_activations:
      tz, param_bytes, a_v, end_s, added, update = _zero_numbers(
          tables, (i, j), k, s, zero, offload, offload_activations)
      time_s = tz if single else time_s + added
      if offload_activations:   # two microbatches' residuals (at the group's rows) stay
        param_bytes += 2.0 * act * (frac - 1.0)
      act_bytes = a_v * frac
    if not single and zero < 2 and tables.sync_time_s is not None:
      # A mixed-type stage's groups reduce their gradients every microbatch, not once.
      time_s, end_s = sync_per_microbatch(time_s, end_s, float(tables.sync_time_s[k][i, j, s]))
    if x:
      time_s += float(group_route_s(tables, home, k, r, b, i, j))
    out.append(GroupCost(
        subcluster=k, submesh_index=s, submesh=tables.submeshes[k][s], logical_mesh=lm, rows=r,
        time_s=time_s, param_bytes=param_bytes, act_bytes=act_bytes, end_s=end_s,
        device_memory_bytes=tables.device_memory_bytes[k], zero=zero, offload=offload,
        update_bytes=update))
  end = max(g.end_s for g in out)
  sync = gb = 0.0
  if len(out) > 1:
    gb = _grad_bytes(tables, options, i, j, [(g.subcluster, g.submesh_index) for g in out])
    sync = float(home_sync_s(tables, home, [g.subcluster for g in out[1:]], gb))
  return MixedStageCost(layers=(i, j), groups=tuple(out), time_s=max(g.time_s for g in out),
                        end_s=end + sync, sync_s=sync, grad_bytes=gb)


def mixed_cut_s(tables: CostTables, j: int, send: MixedStageCost, recv: MixedStageCost,
                options: MixedOptions) -> float:
  """Seconds of the cut after layer ``j`` from stage ``send`` to stage ``recv``: between their
  homes, at the full rows (``inf`` without a link)."""
  return _cut(tables, j, [(g.subcluster, g.rows) for g in send.groups],
              [(g.subcluster, g.rows) for g in recv.groups])


def with_table_rows(options: MixedOptions, tables: CostTables) -> MixedOptions:
  """``options`` with the tables' :attr:`~harpjax.compiler.profile.CostTables.microbatch_rows`
  where it gives no ``microbatch_rows`` of its own."""
  rows = getattr(tables, "microbatch_rows", None)
  if options.microbatch_rows is None and rows is not None:
    return dataclasses.replace(options, microbatch_rows=int(rows))
  return options


def _rows(options: MixedOptions) -> int:
  if options.microbatch_rows is None:
    raise PlanError("mixed-type stages need the rows of one microbatch: give "
                    "MixedOptions(microbatch_rows=...) (SolveOptions.mixed_options), or tables "
                    "that carry them (CostTables.microbatch_rows; the profiler's do)")
  return int(options.microbatch_rows)


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class MixedEvaluation:
  """A plan with mixed stages scored on cost tables (:func:`evaluate_mixed`).

  Attributes:
    stages: :class:`MixedStageCost` per stage (every group's time and memory).
    planned: :class:`~harpjax.compiler.plan.PlannedStage` per stage, of its first group (time
      and cut of the stage; memory of the group closest to its device's limit).
    time_s, comm_s, end_s: per stage; ``comm_s`` ends with 0.
    warmups: the schedule's warm-up counts (H-1F1B's at the plan's own period).
    t_max_s, period_s, eq12_s, iteration_s: as in
      :class:`~harpjax.compiler.plan.PlanEvaluation` (``iteration_s`` the simulator's).
    mem_ok, devices_ok, comm_ok: every group fits; every subcluster's groups pack onto its
      hosts; every cut has a link.
    violations: what fails.
    num_devices: devices of every group.
    schedule: the schedule evaluated (its registered name).
    fees_per_iteration: the transfer fee per iteration (the tables'
      :attr:`~harpjax.compiler.profile.CostTables.fees`; ``0`` without): the cuts between the
      stages' homes, and each mixed stage's groups' transfers (:func:`mixed_transfer`).
    transfer_bytes: ``[3]`` those bytes per iteration per link class.
  """
  stages: tuple[MixedStageCost, ...]
  planned: tuple[PlannedStage, ...]
  time_s: tuple[float, ...]
  comm_s: tuple[float, ...]
  end_s: tuple[float, ...]
  warmups: tuple[int, ...]
  t_max_s: float
  period_s: float
  eq12_s: float
  iteration_s: float
  mem_ok: bool
  devices_ok: bool
  comm_ok: bool
  violations: tuple[str, ...]
  num_devices: int
  schedule: str = "h1f1b"
  fees_per_iteration: float = 0.0
  transfer_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)

  @property
  def feasible(self) -> bool:
    return self.mem_ok and self.devices_ok and self.comm_ok


def mixed_transfer(tables: CostTables, costs: Sequence[MixedStageCost], num_microbatches: int,
                   microbatch_rows: int) -> PlanTransfer:
  """The bytes per iteration per link class of a plan of stages ``costs`` (pipeline order),
  and their fee: every cut between the homes of two stages (``2 B boundary_bytes[j]``, as
  :func:`~harpjax.compiler.profile.plan_transfer`), and each mixed stage's groups' transfers:
  their rows to and from the home (:func:`~harpjax.compiler.profile.group_route_transfer`)
  and the cross-group gradient sum (:func:`~harpjax.compiler.profile.group_sync_transfer`,
  ``grad_bytes`` of the stage), each over the link class of (home, group). A zebra stage's
  all-to-all is not counted (zebra stages are plan-only)."""
  B = int(num_microbatches)
  names = tables.subcluster_names
  fees = tables.fees
  total = cuts_transfer(fees, names, tables.boundary_bytes,
                        [(c.layers[1], c.groups[0].subcluster) for c in costs], B)
  for c in costs:
    if len(c.groups) < 2 or c.groups[0].rows == microbatch_rows:
      continue   # a plain stage, or a zebra stage (each group sees all b rows)
    home = names[c.groups[0].subcluster]
    others = [(names[g.subcluster], g.rows) for g in c.groups[1:]]
    total = total + group_route_transfer(fees, home, others, microbatch_rows,
                                         tables.boundary_bytes, c.layers, B)
    total = total + group_sync_transfer(fees, home, [n for n, _ in others], c.grad_bytes)
  return total


def evaluate_mixed(tables: CostTables, plan: Plan | Sequence[StageSpec], num_microbatches: int,
                   options: MixedOptions, *, eps: float = 0.1,
                   fwd_fraction: float = 1.0 / 3.0,
                   schedule: str | ScheduleKind | None = None) -> MixedEvaluation:
  """Scores a plan whose stages may have groups (:attr:`StageSpec.groups`) under a registered
  schedule (``schedule``; default the plan's own, else H-1F1B).

  Each stage is costed by :func:`mixed_stage_cost` with its groups' rows
  (:meth:`StageSpec.group_rows` of ``options.microbatch_rows``) at its ZeRO level and offload
  (:attr:`StageSpec.zero`, :attr:`StageSpec.offload`: every group priced by its entry's
  variant, as if it held its own optimizer state: the module docstring), each cut by
  :func:`mixed_cut_s`; warm-ups, memory (``min(N_i, B)`` in flight, per group; with offload
  the update's state too) and the simulated iteration time as
  :func:`~harpjax.compiler.plan.evaluate_plan` does for a plan without groups (the same
  numbers on such a plan).

  Raises:
    PlanError: stages that do not cover the layers, unknown subclusters or submeshes, rows
      that cannot be split, a stage with ``zero`` or ``offload`` on tables that lack the
      optimizer state's bytes (``opt_mem_bytes``; with offload the host link's bandwidth),
      or a schedule that is not registered.
  """
  B = int(num_microbatches)
  if schedule is None:
    schedule = plan.schedule if isinstance(plan, Plan) else "h1f1b"
  try:
    kind = schedule_kind(schedule)
  except HarpjaxError as e:
    raise PlanError(f"schedule={schedule!r}: {e}") from None
  specs = plan.stages if isinstance(plan, Plan) else tuple(plan)
  options = with_table_rows(options, tables)
  b = _rows(options)
  L = tables.num_layers
  if not specs or specs[0].layers[0] != 0 or specs[-1].layers[1] != L - 1 or any(
      y.layers[0] != x.layers[1] + 1 for x, y in zip(specs, specs[1:])):
    raise PlanError(f"stage layer ranges {[s.layers for s in specs]} must cover layers "
                    f"0..{L - 1} contiguously")
  costs, groups_of = [], []
  for st in specs:
    if st.zebra is not None:
      c = zebra_mixed_cost(tables, st, options)
      groups_of.append([(g.subcluster, g.submesh_index, g.rows) for g in c.groups])
      costs.append(c)
      continue
    rows = st.group_rows(b) if st.groups else (b,)
    groups = []
    for g, r in zip(st.all_groups, rows):
      k = tables.subcluster_index(g.subcluster)
      groups.append((k, tables.submesh_index(k, g.submesh), r))
    if not st.groups:   # a plain stage: costed on the tables' mesh, as evaluate_plan
      check_logical_mesh(tables, st, *groups[0][:2])
    groups_of.append(groups)
    costs.append(mixed_stage_cost(tables, st.layers, groups, options, zero=st.zero,
                                  offload=st.offload,
                                  offload_activations=st.offload_activations))
  t = [c.time_s for c in costs]
  if any(st.groups or st.zebra is not None for st in specs):
    comm = [mixed_cut_s(tables, a.layers[1], a, c, options) for a, c in zip(costs, costs[1:])]
    comm.append(0.0)
  else:   # plain stages: where they sit, as evaluate_plan prices them
    comm = [float(x) for x in tables.cut_costs([(st.layers[0], st.layers[1], *g[0][:2])
                                                for st, g in zip(specs, groups_of)])]
  violations = []
  comm_ok = all(math.isfinite(x) for x in comm)
  if not comm_ok:
    violations.append(f"cuts {[x for x, y in enumerate(comm) if not math.isfinite(y)]} have no "
                      "link between some of their groups")
  t_max = max(t)
  period = pipeline_period(comm, t_max) if comm_ok else math.inf
  S = len(specs)
  warm = kind.warmups(PipelineCosts(S, B, tuple(t), tuple(comm[:-1]), eps))
  held = kind.inflight(S, B, warm)
  mem_ok = True
  planned = []
  for x, (st, c) in enumerate(zip(specs, costs)):
    inflight = held[x]
    worst = max(c.groups, key=lambda g: g.peak_bytes(inflight) / g.device_memory_bytes)
    for g in c.groups:
      if not g.peak_bytes(inflight) <= g.device_memory_bytes:
        mem_ok = False
        violations.append(
            f"stage {x} (layers {c.layers[0]}..{c.layers[1]}), group on "
            f"{tables.subcluster_names[g.subcluster]} {g.submesh} with {g.rows} rows needs "
            f"{g.peak_bytes(inflight) / 2**30:.3f} GiB > "
            f"{g.device_memory_bytes / 2**30:.3f} GiB")
      if not g.update_fits:
        mem_ok = False
        violations.append(
            f"stage {x} (layers {c.layers[0]}..{c.layers[1]}), group on "
            f"{tables.subcluster_names[g.subcluster]} {g.submesh}: the update brings its "
            f"offloaded optimizer state in and needs {g.update_bytes / 2**30:.3f} GiB > "
            f"{g.device_memory_bytes / 2**30:.3f} GiB; use a higher zero level or more "
            "devices")
    first = c.groups[0]
    planned.append(PlannedStage(
        layers=c.layers, subcluster=first.subcluster,
        subcluster_name=tables.subcluster_names[first.subcluster],
        submesh_index=first.submesh_index, submesh=first.submesh,
        logical_mesh=first.logical_mesh, device_offset=-1, hosts=(), time_s=c.time_s,
        comm_s=comm[x], warmup=int(warm[x]), inflight=int(inflight),
        param_bytes=worst.param_bytes, act_bytes=worst.act_bytes,
        peak_mem_bytes=worst.peak_bytes(inflight),
        device_memory_bytes=worst.device_memory_bytes, zero=st.zero, offload=st.offload,
        offload_activations=st.offload_activations))
  devices_ok = True
  for k in range(tables.num_subclusters):
    shapes = [g.submesh for c in costs for g in c.groups if g.subcluster == k]
    if shapes and pack_submeshes(tables.num_hosts[k], tables.devices_per_host[k],
                                 shapes) is None:
      devices_ok = False
      violations.append(f"subcluster {tables.subcluster_names[k]!r}: groups {shapes} do not "
                        f"pack onto {tables.num_hosts[k]} hosts of "
                        f"{tables.devices_per_host[k]}")
  ends = [c.end_s for c in costs]
  transfer = mixed_transfer(tables, costs, B, b)
  head = sum(x + 2.0 * y for x, y in zip(t, comm))
  iteration = math.inf
  if comm_ok and math.isfinite(t_max) and all(math.isfinite(e) for e in ends):
    iteration = simulated_time(t, comm, kind, B, warm, fwd_fraction, ends)
  return MixedEvaluation(
      stages=tuple(costs), planned=tuple(planned), time_s=tuple(t), comm_s=tuple(comm),
      end_s=tuple(ends), warmups=warm, t_max_s=t_max, period_s=period,
      eq12_s=head + (B - 1) * t_max, iteration_s=iteration, mem_ok=mem_ok,
      devices_ok=devices_ok, comm_ok=comm_ok, violations=tuple(violations),
      num_devices=sum(g.submesh[0] * g.submesh[1] for c in costs for g in c.groups),
      schedule=kind.name, fees_per_iteration=transfer.fee_per_iteration,
      transfer_bytes=transfer.bytes_by_class)


# --------------------------------------------------------------------------- fusions


@dataclasses.dataclass(frozen=True)
class Fusion:
  """Mixed stages of one shape, planned as one virtual subcluster.

  Every mixed stage of the fusion runs on submesh ``shapes[x]`` of member ``x`` (whole hosts
  ``(h, M)``, or ``(1, m)`` inside one host) and splits every microbatch's rows as ``rows``;
  at most ``stages`` of them. A host that runs a mixed stage's group runs no plain stage:
  member ``x`` gives the fusion :meth:`reserved_hosts` hosts.

  Attributes:
    members: subcluster indices (in the tables), in row order.
    shapes: each member's submesh in one mixed stage.
    stages: the most mixed stages.
    rows: rows of every microbatch each member's group runs.
  """
  members: tuple[int, ...]
  shapes: tuple[tuple[int, int], ...]
  stages: int
  rows: tuple[int, ...]

  def name(self, tables: CostTables) -> str:
    return "+".join(tables.subcluster_names[k] for k in self.members)

  def group_shape(self, x: int) -> tuple[int, int]:
    """Member ``x``'s submesh in a mixed stage."""
    return self.shapes[x]

  def reserved_hosts(self, tables: CostTables, x: int, stages: int | None = None) -> int:
    """Hosts of member ``x`` that ``stages`` (default :attr:`stages`) mixed stages hold."""
    c = self.stages if stages is None else stages
    n, m = self.shapes[x]
    M = tables.devices_per_host[self.members[x]]
    return n * c if m == M else -(-c // (M // m))


def _compositions(total: int, parts: int):
  if parts == 1:
    yield (total,)
    return
  for first in range(1, total - parts + 2):
    for rest in _compositions(total - first, parts - 1):
      yield (first,) + rest


def _min_dp(tables: CostTables, k: int, shape: tuple[int, int]) -> int:
  """The smallest data-parallel degree of a finite entry of submesh ``shape`` of ``k``."""
  n, m = shape
  if tables.logical_mesh is None or shape not in tables.submeshes[k]:
    return n * m
  s = tables.submeshes[k].index(shape)
  ok = np.isfinite(tables.stage_time_s[k][:, :, s])
  return int(tables.logical_mesh[k][:, :, s, 0][ok].min()) if ok.any() else n * m


def _speed_splits(tables: CostTables, members, shapes, b: int, radius: int
                  ) -> set[tuple[int, ...]]:
  """Rows splits of a fusion in whole data-parallel quanta: with two members every split in
  multiples of each group's smallest data-parallel degree within ``radius`` quanta of the
  speed-proportional one; with more (``n * m`` rows per group: valid whatever the logical
  mesh), the
  speed-proportional one (speed of each member's group: layers per second over its
  single-layer entries) and its neighbours (a common multiple of two quanta moved from one
  group to another); and the speed-proportional split in whole rows."""
  quanta = tuple(n * m for n, m in shapes)
  speed = []
  for k, shape in zip(members, shapes):
    if shape not in tables.submeshes[k]:
      return set()
    s = tables.submeshes[k].index(shape)
    t = np.array([tables.stage_time_s[k][i, i, s] for i in range(tables.num_layers)])
    ok = np.isfinite(t)
    if not ok.any():
      return set()
    speed.append(float(ok.sum()) / float(t[ok].sum()))   # layers it can hold, per second
  shares = [max(1, round(1e6 * x / max(speed))) for x in speed]
  if len(members) == 2:   # splits in multiples of the smallest dp any entry has, near speed
    q0, q1 = (_min_dp(tables, k, shape) for k, shape in zip(members, shapes))
    target = b * speed[0] / (speed[0] + speed[1])
    return {(r, b - r) for r in range(q0, b - q1 + 1, q0)
            if (b - r) % q1 == 0 and abs(r - target) <= radius * max(q0, q1)}
  out = set()
  for q in ((1,) * len(members), quanta):
    try:
      out.add(row_shares(b, shares, q))
    except PlanError:
      pass
  try:
    base = row_shares(b, shares, quanta)
  except PlanError:
    return out
  for x, y in itertools.permutations(range(len(members)), 2):
    step = math.lcm(quanta[x], quanta[y])
    if base[x] - step >= quanta[x]:
      moved = list(base)
      moved[x] -= step
      moved[y] += step
      out.add(tuple(moved))
  return out


def candidate_fusions(tables: CostTables, options: MixedOptions, mode: str = "on"
                      ) -> list[Fusion]:
  """The fusions :func:`solve_mixed` tries: every set of ``2..max_members`` subclusters linked
  to each other both ways (with ``mode="auto"``: by links at least ``min_link_ratio`` times
  as fast as the slower of their own links), ``1..max_hosts_per_group`` hosts of each per
  mixed stage, every number of such stages the hosts allow, and the rows splits of
  :attr:`MixedOptions.shares`."""
  b = _rows(options)
  K = tables.num_subclusters
  out = []
  for size in range(2, min(options.max_members, K) + 1):
    for members in itertools.combinations(range(K), size):
      ok = True
      for a, c in itertools.permutations(members, 2):
        bw = tables.link_bandwidth_bytes_per_s[a][c]
        slow = min(tables.intra_bandwidth_bytes_per_s[a], tables.intra_bandwidth_bytes_per_s[c])
        if not bw > 0 or (mode == "auto" and bw < options.min_link_ratio * slow):
          ok = False
      if not ok or b < size:
        continue
      choices = [_group_shapes(tables, k, options) for k in members]
      for shapes in itertools.product(*choices):
        if options.shares == "all":
          splits = sorted(_compositions(b, size))
        else:
          splits = sorted(_speed_splits(tables, members, shapes, b, options.split_radius))
        probe = Fusion(tuple(members), tuple(shapes), 1, (1,) * size)
        top = 1
        while all(probe.reserved_hosts(tables, x, top + 1) <= tables.num_hosts[k]
                  for x, k in enumerate(members)):
          top += 1
        for n in range(1, top + 1):
          for rows in splits:
            out.append(Fusion(tuple(members), tuple(shapes), n, tuple(rows)))
  return out


def _group_shapes(tables: CostTables, k: int, options: MixedOptions) -> list[tuple[int, int]]:
  """A member's group submeshes: ``1..max_hosts_per_group`` whole hosts, and with
  ``sub_host`` the tables' single-host submeshes smaller than a host."""
  N, M = tables.num_hosts[k], tables.devices_per_host[k]
  out = [(1, M) if h == 1 else (h, M) for h in range(1, min(N, options.max_hosts_per_group) + 1)]
  if options.sub_host:
    out = [(1, m) for n, m in tables.submeshes[k] if n == 1 and m < M] + out
  return [s for s in out if s in tables.submeshes[k]]


@dataclasses.dataclass(frozen=True, eq=False)
class _FusedTables(CostTables):
  """Cost tables with a virtual subcluster: cuts given per pair of subcluster names."""
  cut_override: tuple = ()   # ((name_a, name_b, [L] seconds), ...)

  @functools.cached_property
  def pair_comm_s(self) -> np.ndarray:
    out = np.array(CostTables.pair_comm_s.func(self))
    names = self.subcluster_names
    for a, b, arr in self.cut_override:
      if a in names and b in names:
        out[names.index(a), names.index(b)] = arr
    out.setflags(write=False)
    return out


def fused_tables(tables: CostTables, fusion: "Fusion | ZebraShape | Sequence",
                 num_microbatches: int, options: MixedOptions,
                 variants: CostTables | None = None, zero_levels: Sequence[int] = (0,),
                 memo: dict | None = None) -> CostTables:
  """The tables with a virtual subcluster per fusion first (``fusion``: one, or several of
  other shapes), then every subcluster with the hosts the fusions leave it (those left with
  none dropped).

  A virtual subcluster has ``stages`` hosts of one device and one submesh, ``(1, 1)``: a
  mixed stage (:meth:`Fusion.group_shape`), timed and with end costs by
  :func:`mixed_stage_cost`. Its device memory is ``1`` and an entry's parameter bytes ``0``
  and activation bytes ``1 / (n_max + 0.5)``, ``n_max`` the most microbatches in flight
  (``<= B``) every group holds: the DP's memory check ``p + n a <= mem`` then says exactly
  ``n <= n_max``. Cuts involving it are :func:`mixed_cut_s`'s (home to home).

  A :class:`~harpjax.compiler.plan.zebra_stages.ZebraShape` in place of a fusion is a
  virtual subcluster of zebra stages, its entries
  :func:`~harpjax.compiler.plan.zebra_stages.zebra_entry`'s (in the same encoding; its home
  the attention group; ``memo`` shares their choices across calls on the same ``tables``;
  zebra stages run at ZeRO level 0).

  ``variants``: ``tables`` expanded into (submesh, ZeRO level, offload, residual offload)
  variants (:func:`~harpjax.compiler.plan.variants.expand_variants`); given, the subclusters
  left keep every variant of their shapes, so the plain stages of a plan with mixed stages
  choose their level and offload as in a plan without. ``zero_levels``: the ZeRO levels a
  mixed stage may use (a level above 0 needs the tables' ``opt_mem_bytes``): the virtual
  subcluster then has one ``(1, 1)`` choice per level, labelled as a variant.

  Raises:
    PlanError: a fusion's rows do not add up to the microbatch's, or the fusions reserve more
      hosts of a subcluster than it has.
  """
  B = int(num_microbatches)
  options = with_table_rows(options, tables)
  b = _rows(options)
  L, K = tables.num_layers, tables.num_subclusters
  fusions = [fusion] if isinstance(fusion, (Fusion, ZebraShape)) else list(fusion)
  F = len(fusions)
  levels = tuple(sorted({int(z) for z in zero_levels}))
  if tables.opt_mem_bytes is None or any(isinstance(f, ZebraShape) for f in fusions):
    levels = (0,)
  Z = len(levels)
  virtual = []
  for f in fusions:
    if isinstance(f, ZebraShape):
      entries = [f.virtual_entry(tables, B, options, 0, memo)]
    else:
      entries = [_virtual_entry(tables, f, B, options, z) for z in levels]
    virtual.append(tuple(np.concatenate([e[n] for e in entries], axis=2) for n in range(3)))
  # The subclusters with the hosts left.
  left = list(tables.num_hosts)
  for f in fusions:
    for x, k in enumerate(f.members):
      left[k] -= f.reserved_hosts(tables, x)
  if min(left) < 0:
    raise PlanError(f"fusions {[f.name(tables) for f in fusions]} reserve more hosts than "
                    "their subclusters have")
  keep = [k for k in range(K) if left[k] > 0]
  src = tables if variants is None else variants   # the plain stages' choices
  cols = {}
  for k in keep:
    cols[k] = [s for s, (n, m) in enumerate(src.submeshes[k]) if n <= left[k]]
  pick = lambda arrs, k: np.ascontiguousarray(arrs[k][:, :, cols[k]])
  vnames = []
  for f in fusions:   # unique names: fusions of the same members differ in shape
    name = f.name(tables)
    vnames.append(name if name not in vnames else f"{name}#{len(vnames) + 1}")
  names = tuple(vnames) + tuple(tables.subcluster_names[k] for k in keep)
  idx = [None] * F + keep   # new position -> old subcluster (None: a virtual one)
  end_arrays = [e for _, _, e in virtual] + [
      src.end_time_s[k][:, :, cols[k]] if src.end_time_s is not None
      else np.zeros((L, L, len(cols[k]))) for k in keep]
  logical = [np.ones((L, L, Z, 2), np.int64)] * F
  for k in keep:
    if src.logical_mesh is not None:
      logical.append(np.ascontiguousarray(src.logical_mesh[k][:, :, cols[k]]))
    else:
      sizes = np.array([n * m for n, m in src.submeshes[k]])[cols[k]]
      logical.append(np.stack([np.broadcast_to(sizes, (L, L, len(cols[k]))),
                               np.ones((L, L, len(cols[k])), np.int64)], axis=-1))
  Kn = len(names)
  bw = np.zeros((Kn, Kn))
  lat = np.zeros((Kn, Kn))
  groups_of = lambda x: ([(fusions[x].members[0], b)] if idx[x] is None   # the home
                         else [(idx[x], b)])
  overrides = []
  for x in range(Kn):
    for y in range(Kn):
      if idx[x] is not None and idx[y] is not None:
        if x != y:
          bw[x, y] = tables.link_bandwidth_bytes_per_s[idx[x]][idx[y]]
          lat[x, y] = tables.link_latency_s[idx[x]][idx[y]]
        continue
      arr = np.array([_cut(tables, j, groups_of(x), groups_of(y)) for j in range(L)])
      overrides.append((names[x], names[y], arr))
      if x != y:
        bw[x, y] = 1.0 if np.isfinite(arr).all() else 0.0
  fees = None
  if tables.fees is not None:   # the homes' places; the groups' rows charged on the cuts
    place = {n: (z, r) for n, z, r in tables.fees.places}
    homes = [tables.subcluster_names[f.members[0]] for f in fusions]
    places = tuple((vnames[x], *place[homes[x]]) for x in range(F)) + tuple(
        (tables.subcluster_names[k], *place[tables.subcluster_names[k]]) for k in keep)
    route = [None if isinstance(f, ZebraShape) else route_cut_bytes(
        tables.fees, homes[x], [(tables.subcluster_names[k], r)
                                for k, r in zip(f.members[1:], f.rows[1:])], b,
        tables.boundary_bytes) for x, f in enumerate(fusions)]
    extra = []
    for x in range(Kn):
      for y in range(Kn):
        arr = np.zeros((3, L))
        for z in {x, y}:
          if z < F and route[z] is not None:
            arr = arr + route[z] * (2.0 if x == y else 1.0)
        if arr.any():
          extra.append((names[x], names[y], arr))
    fees = LinkFees(places, tables.fees.fees, tuple(extra))
  peak = None
  if tables.peak_flops is not None:
    peak = tuple(sum(tables.peak_flops[k] * n * m for k, (n, m) in zip(f.members, f.shapes))
                 for f in fusions) + tuple(tables.peak_flops[k] for k in keep)
  price = None
  if tables.price_per_gpu_hour is not None:
    price = tuple(sum(tables.price_per_gpu_hour[k] * n * m
                      for k, (n, m) in zip(f.members, f.shapes))
                  for f in fusions) + tuple(tables.price_per_gpu_hour[k] for k in keep)
  return _FusedTables(
      num_layers=L, subcluster_names=names,
      num_hosts=tuple(f.stages for f in fusions) + tuple(left[k] for k in keep),
      devices_per_host=(1,) * F + tuple(tables.devices_per_host[k] for k in keep),
      device_memory_bytes=(1.0,) * F + tuple(tables.device_memory_bytes[k] for k in keep),
      submeshes=(((1, 1),) * Z,) * F + tuple(tuple(src.submeshes[k][s] for s in cols[k])
                                               for k in keep),
      stage_time_s=tuple(t for t, _, _ in virtual) + tuple(pick(src.stage_time_s, k)
                                                           for k in keep),
      param_mem_bytes=(np.zeros((L, L, Z)),) * F + tuple(pick(src.param_mem_bytes, k)
                                                         for k in keep),
      act_mem_bytes=tuple(a for _, a, _ in virtual) + tuple(pick(src.act_mem_bytes, k)
                                                            for k in keep),
      boundary_bytes=tables.boundary_bytes,
      intra_bandwidth_bytes_per_s=(1.0,) * F + tuple(tables.intra_bandwidth_bytes_per_s[k]
                                                     for k in keep),
      intra_latency_s=(0.0,) * F + tuple(tables.intra_latency_s[k] for k in keep),
      link_bandwidth_bytes_per_s=tuple(tuple(float(v) for v in r) for r in bw),
      link_latency_s=tuple(tuple(float(v) for v in r) for r in lat),
      logical_mesh=tuple(logical), peak_flops=peak, price_per_gpu_hour=price,
      end_time_s=tuple(end_arrays),
      # a mixed stage's groups are costed in the tables' first mode (the first entry of each
      # shape: "none" where costed); a plain stage keeps its choice
      remat_modes=None if src.remat_modes is None else (
          ((src.remat_modes[0][0],) * Z,) * F + tuple(tuple(src.remat_modes[k][s] for s in cols[k])
                                       for k in keep)),
      variants=None if src.variants is None and Z == 1 else (
          (tuple((z, False, False) for z in levels),) * F
          + tuple(tuple(src.variants[k][s] for s in cols[k]) if src.variants is not None
                  else ((0, False, False),) * len(cols[k]) for k in keep)),
      fees=fees, cut_override=tuple(overrides))


def _virtual_entry(tables: CostTables, f: "Fusion", B: int, options: MixedOptions,
                   zero: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(time, activation bytes, end time)`` ``[L, L, 1]`` of fusion ``f``'s virtual
  subcluster (:func:`fused_tables`), its mixed stages at ZeRO level ``zero`` (every group
  by its entry's variant, as :func:`mixed_stage_cost` prices it)."""
  b = _rows(options)
  alpha = options.fixed_fraction
  L = tables.num_layers
  if sum(f.rows) != b:
    raise PlanError(f"fusion rows {f.rows} must add up to the microbatch's {b} rows")
  t_v = np.full((L, L, 1), np.inf)
  a_v = np.zeros((L, L, 1))
  e_v = np.zeros((L, L, 1))
  iu = np.triu(np.ones((L, L), bool))
  ii, jj = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
  parts = []
  for x, k in enumerate(f.members):
    shape = f.group_shape(x)
    if shape not in tables.submeshes[k]:
      return t_v, a_v, e_v
    parts.append((k, tables.submeshes[k].index(shape), f.rows[x]))
  t = np.full((L, L), -np.inf)
  ok = iu.copy()
  nmax = np.full((L, L), B, np.int64)
  end = np.full((L, L), -np.inf)
  gb = np.zeros((L, L))
  home = parts[0][0]
  for x, (k, s, r) in enumerate(parts):
    T = tables.stage_time_s[k][:, :, s]
    dp = (tables.logical_mesh[k][:, :, s, 0] if tables.logical_mesh is not None
          else np.full((L, L), tables.submeshes[k][s][0] * tables.submeshes[k][s][1]))
    tp = (tables.logical_mesh[k][:, :, s, 1] if tables.logical_mesh is not None
          else np.ones((L, L), np.int64))
    ok &= np.isfinite(T) & (r % dp == 0)
    p0 = tables.param_mem_bytes[k][:, :, s]
    e = (tables.end_time_s[k][:, :, s] if tables.end_time_s is not None
         else np.zeros((L, L)))
    T_g, p, act = _group_time(T, r, b, alpha), p0, tables.act_mem_bytes[k][:, :, s]
    if zero:
      tz, pz, az, ez, _ = variant_arrays(tables, k, zero, False)
      with np.errstate(invalid="ignore"):
        T_g = T_g + np.where(np.isfinite(T), tz[:, :, s] - T, 0.0)
      p, act, e = pz[:, :, s], az[:, :, s], ez[:, :, s]
    if zero < 2 and tables.sync_time_s is not None:
      # A mixed-type stage's groups reduce their gradients every microbatch, not once.
      T_g, e = sync_per_microbatch(T_g, e, tables.sync_time_s[k][:, :, s])
    t = np.maximum(t, T_g + (group_route_s(tables, home, k, r, b, ii, jj) if x else 0.0))
    nmax = np.minimum(nmax, _max_inflight(p, act * (r / b), tables.device_memory_bytes[k], B))
    end = np.maximum(end, e)
    gb = np.maximum(gb, replica_grad_bytes(p0, tp, options.grad_fraction))
  if options.grad_bytes is not None:
    if len(options.grad_bytes) != L:
      raise PlanError(f"MixedOptions.grad_bytes has {len(options.grad_bytes)} entries for "
                      f"{L} layers")
    gb = range_sums(options.grad_bytes)
  ok &= nmax >= 1
  sync = home_sync_s(tables, home, [k for k, _, _ in parts[1:]], np.where(ok, gb, 0.0))
  t_v[:, :, 0] = np.where(ok, t, np.inf)
  a_v[:, :, 0] = np.where(ok, 1.0 / (np.maximum(nmax, 1) + 0.5), 0.0)
  e_v[:, :, 0] = np.where(ok, end + sync, 0.0)
  return t_v, a_v, e_v


def _max_inflight(p: np.ndarray, act: np.ndarray, mem: float, cap: int) -> np.ndarray:
  """Per entry the most microbatches ``n <= cap`` with ``p + n act <= mem`` (0: none), by the
  same predicate :func:`evaluate_mixed` checks."""
  with np.errstate(divide="ignore", invalid="ignore"):
    n = np.where(act > 0, np.floor((mem - p) / np.where(act > 0, act, 1.0)), cap)
  n = np.clip(np.nan_to_num(n, nan=0.0, posinf=cap, neginf=0.0), 0, cap).astype(np.int64)
  for _ in range(3):   # rounding at the boundary: settle on the predicate itself
    up = (n < cap) & (p + (n + 1) * act <= mem)
    n = n + up
    down = (n > 0) & ~(p + n * act <= mem)
    n = n - down
  return np.where(p <= mem, n, 0)


# --------------------------------------------------------------------------- the search


def _plan_of(tables: CostTables, fused: CostTables, fusions: Sequence["Fusion"],
             result: PlanResult, options: MixedOptions) -> tuple[StageSpec, ...]:
  """The real stages of a plan found on :func:`fused_tables` of ``fusions`` (the fused
  tables' first subclusters, in order)."""
  options = with_table_rows(options, tables)
  b = _rows(options)
  specs = []
  for st in result.stages:
    i, j = st.layers
    if st.subcluster >= len(fusions):
      specs.append(StageSpec(layers=(i, j), subcluster=st.subcluster_name, submesh=st.submesh,
                             logical_mesh=st.logical_mesh, warmup=st.warmup, time_s=st.time_s,
                             comm_s=st.comm_s, zero=st.zero, offload=st.offload,
                             offload_activations=st.offload_activations, remat=st.remat))
      continue
    fusion = fusions[st.subcluster]
    if isinstance(fusion, ZebraShape):
      specs.append(_zebra_spec(tables, fusion, st, b, options))
      continue
    zero = (fused.variants[st.subcluster][st.submesh_index][0] if fused.variants is not None
            else 0)
    groups = []
    for x, k in enumerate(fusion.members):
      shape = fusion.group_shape(x)
      s = tables.submeshes[k].index(shape)
      groups.append(StageGroup(
          subcluster=tables.subcluster_names[k], submesh=shape,
          logical_mesh=tables.logical_mesh_of(k, i, j, s), share=fusion.rows[x],
          time_s=float(_group_time(float(tables.stage_time_s[k][i, j, s]), fusion.rows[x], b,
                                   options.fixed_fraction))))
    first = groups[0]
    specs.append(StageSpec(layers=(i, j), subcluster=first.subcluster, submesh=first.submesh,
                           logical_mesh=first.logical_mesh, warmup=st.warmup, time_s=st.time_s,
                           comm_s=st.comm_s, share=first.share, groups=tuple(groups[1:]),
                           zero=zero, remat=None if tables.remat_modes is None
                           else tables.remat_modes[0][0]))
  return tuple(specs)


def _zebra_spec(tables: CostTables, shape: ZebraShape, st, b: int,
                options: MixedOptions) -> StageSpec:
  """The stage a zebra entry of the fused tables stands for: the choice
  :func:`~harpjax.compiler.plan.zebra_stages.zebra_stage_cost` made for it."""
  i, j = st.layers
  (a, e), (sh_a, sh_e) = shape.members, shape.shapes
  attn = (a, tables.submeshes[a].index(sh_a))
  c = zebra_stage_cost(tables, (i, j), attn, (e, tables.submeshes[e].index(sh_e)), b,
                       options.zebra_options)
  return StageSpec(layers=(i, j), subcluster=tables.subcluster_names[a], submesh=sh_a,
                   logical_mesh=tables.logical_mesh_of(a, i, j, attn[1]), warmup=st.warmup,
                   time_s=st.time_s, comm_s=st.comm_s,
                   zebra=ZebraGroup(subcluster=tables.subcluster_names[e], submesh=sh_e,
                                    num_microbatches=c.num_microbatches,
                                    routed_layers=c.routed_layers, offload=c.offload))


def zebra_mixed_cost(tables: CostTables, st: StageSpec, options: MixedOptions
                     ) -> MixedStageCost:
  """A zebra stage of a plan (:attr:`StageSpec.zebra`), costed as
  :func:`~harpjax.compiler.plan.zebra_stages.zebra_stage_cost` does with its zebra
  microbatches and expert assignment: its two groups (attention first, the stage's home) with
  their memory, its simulated time per microbatch, its end time.

  Raises:
    PlanError: no routed split in the tables, a stage no zebra stage can run (no routed
      layer, no link, experts the group does not divide), routed layers other than the
      range's, or an ``R`` or assignment that does not fit it.
  """
  options = with_table_rows(options, tables)
  b = _rows(options)
  z = st.zebra
  i, j = st.layers
  where = f"zebra stage on layers {i}..{j}"
  if tables.routed_split is None:
    raise PlanError(f"{where}: the tables carry no routed_split (the experts' part of each "
                    "routed layer); score the plan on tables built with one")
  a, e = tables.subcluster_index(st.subcluster), tables.subcluster_index(z.subcluster)
  attn = (a, tables.submesh_index(a, st.submesh))
  expert = (e, tables.submesh_index(e, z.submesh))
  c = zebra_stage_cost(tables, (i, j), attn, expert, b, options.zebra_options,
                       num_microbatches=z.num_microbatches, offload=z.offload)
  if c is None:
    raise PlanError(f"{where}: no zebra stage runs there on {st.subcluster} {st.submesh} | "
                    f"{z.subcluster} {z.submesh} (no routed layer, no link between them, or "
                    "an expert group whose devices do not divide the experts)")
  if c.routed_layers != z.routed_layers:
    raise PlanError(f"{where}: routed_layers={list(z.routed_layers)}, but the tables route "
                    f"{list(c.routed_layers)} there")
  groups = (
      GroupCost(subcluster=a, submesh_index=attn[1], submesh=st.submesh,
                logical_mesh=tables.logical_mesh_of(a, i, j, attn[1]), rows=b,
                time_s=c.time_s, param_bytes=c.attn_param_bytes, act_bytes=c.attn_act_bytes,
                end_s=c.end_s, device_memory_bytes=c.attn_memory_bytes),
      GroupCost(subcluster=e, submesh_index=expert[1], submesh=z.submesh,
                logical_mesh=(1, 1, z.num_devices) if z.num_devices > 1 else (1, 1),
                rows=b, time_s=c.time_s, param_bytes=c.expert_param_bytes,
                act_bytes=c.expert_act_bytes, end_s=c.end_s,
                device_memory_bytes=c.expert_memory_bytes))
  return MixedStageCost(layers=(i, j), groups=groups, time_s=c.time_s, end_s=c.end_s,
                        sync_s=0.0, grad_bytes=0.0)


def solve_mixed(tables: CostTables, num_microbatches: int, options: SolveOptions
                ) -> PlanResult:
  """The best plan with or without mixed-type stages (``options.mixed_stages``).

  Solves the tables as they are, then :func:`fused_tables` of every
  :func:`candidate_fusions` fusion, and keeps the best by the objective (strictly better
  only), all for H-1F1B; then the schedule of the plan kept
  (:func:`~harpjax.compiler.plan.choose_schedule`, ``options.schedule``). ``stats.proved`` of
  the result: every one of those searches proved its optimum. A plan with mixed stages has
  them as :attr:`StageSpec.groups`; its ``predicted_iteration_s`` is :func:`evaluate_mixed`'s
  simulated time of it.

  Raises:
    PlanError: ``mixed_stages="on"`` without ``MixedOptions.microbatch_rows``.
    InfeasiblePlanError: no plan fits, with or without mixed stages.
  """
  start = time.perf_counter()
  B = int(num_microbatches)
  mode = options.mixed_stages
  mopts = options.mixed_options or MixedOptions()
  if not isinstance(mopts, MixedOptions):
    raise PlanError(f"SolveOptions.mixed_options={mopts!r} must be a "
                    "harpjax.compiler.plan.MixedOptions")
  mopts = with_table_rows(mopts, tables)
  plain = dataclasses.replace(options, mixed_stages="off", schedule=H1F1B.name)
  best, error = None, None
  proofs = []   # SearchStats.proved of every search: the result's is all of them
  try:
    best = solve(tables, B, options=plain)
    proofs.append(best.stats.proved)
  except InfeasiblePlanError as e:
    error = e
  if mopts.microbatch_rows is None:
    if mode == "on":
      _rows(mopts)
    log.info("planner: no mixed-type stages (MixedOptions.microbatch_rows not given)")
  elif options.keep_order:
    log.info("planner: no mixed-type stages with keep_order=True")
  else:
    fusions = candidate_fusions(tables, mopts, mode)
    if mopts.zebra != "off":   # zebra stages: one more kind of virtual subcluster
      fusions = fusions + candidate_zebra_shapes(tables, mopts.zebra_options or ZebraOptions())
    memo = {}   # zebra entries' choices, shared by the shapes that differ in stage count
    tried = found = 0
    chosen = None
    if options.use_all_devices:   # every reserved host must be filled by the mixed groups
      fusions = [f for f in fusions if all(
          f.stages * f.shapes[x][0] * f.shapes[x][1]
          == f.reserved_hosts(tables, x) * tables.devices_per_host[k]
          for x, k in enumerate(f.members))]
    expanded = None   # the plain stages' ZeRO and offload choices
    levels = plain.zero_levels if tables.opt_mem_bytes is not None else (0,)   # mixed ones'
    if has_variant_data(tables):
      expanded = expand_variants(tables, VariantOptions(
          plain.zero_levels, plain.offload, plain.offload_activations), B)

    charges = tables.fees is not None and tables.fees.charges
    loose = []   # DP values below the plan's true value (its groups' gradient sums' fees)

    def attempt(fused: CostTables, beat: float = math.inf) -> PlanResult | None:
      """The search on ``fused``; with ``beat`` finite only a plan whose value is at most
      ``beat`` counts (``None``: none found; that search proves nothing)."""
      try:
        if not math.isfinite(beat):
          res = solve(fused, B, options=plain)
        else:
          res = _solve_below(fused, B, plain, beat)
          if res is None:
            proofs.append(False)
            return None
      except InfeasiblePlanError:
        return None
      proofs.append(res.stats.proved)
      return res

    def bar(pairs: bool = True) -> float:
      """The largest value a fusion's plan may have and still count: the best plan's, and
      (``pairs``) the last pair candidate's once there are that many (``inf``: search it
      fully). Only
      once some search could not prove its optimum (so the result will not be proved
      either): a bounded search that finds nothing proves nothing."""
      if not mopts.prune or all(p is True for p in proofs):
        return math.inf
      out = math.inf if best is None else best.value
      pc = mopts.pair_candidates
      if pairs and pc >= 2:
        out = math.inf if len(mixed_plans) < pc else max(out, sorted(mixed_plans)[pc - 1][0])
      return math.nextafter(out, math.inf) if math.isfinite(out) else out

    def charged(res: PlanResult, group: tuple, fused: CostTables) -> PlanResult | None:
      """``res`` with its true fees: the fused tables charge a mixed stage's cuts and its
      groups' rows exactly, but not its cross-group gradient sum (a fee of the stage's whole
      layer range, which no cut knows), so their value is a lower bound; ``None`` when the
      fees break the budget."""
      if not charges:
        return res
      ev = evaluate_mixed(tables, _plan_of(tables, fused, group, res, mopts), B, mopts,
                          eps=options.eps, fwd_fraction=options.fwd_fraction)
      fee = ev.fees_per_iteration
      if fee <= res.fees_per_iteration * (1.0 + 1e-12):
        return res
      loose.append(res.value)
      out = dataclasses.replace(
          res, fees_per_iteration=fee, transfer_bytes=ev.transfer_bytes,
          cost_per_iteration=None if res.rate_per_hour is None
          else res.rate_per_hour * res.objective_s / 3600.0 + fee)
      if options.budget_per_hour is not None and \
          out.rate_with_fees_per_hour > options.budget_per_hour * (1.0 + 1e-9):
        return None
      return out

    mixed_plans = []   # (value, position, fusion) of every fusion that found a mixed plan
    # Fusions no plan can use within the bounds: a mixed stage's GPUs alone cost more than the
    # budget, or its fastest stage times B exceeds the time limit (every plan takes at least
    # B times its slowest stage). Then the rest, the most promising first (position: the
    # fusion's place in candidate_fusions, which breaks ties as the plain order does).
    order, skipped = (_fusion_order(tables, fusions, B, mopts, options, levels) if mopts.prune
                      else (list(range(len(fusions))), 0))
    best_key = (-1,)   # the plain plan wins ties
    for x in order:
      fusion = fusions[x]
      fused = fused_tables(tables, fusion, B, mopts, expanded, levels, memo)
      if not np.isfinite(fused.stage_time_s[0]).any():
        continue
      tried += 1
      limit, t0 = bar(), time.perf_counter()
      res = attempt(fused, limit)
      log.debug("planner: fusion %d (%s, %d stages, rows %s) below %.6g: %s, %.3f s", x,
                fusion.name(tables), fusion.stages, getattr(fusion, "rows", "-"), limit,
                "none" if res is None else f"{res.value:.6g}" + (
                    "" if any(s.subcluster == 0 for s in res.stages) else " (no mixed stage)"),
                time.perf_counter() - t0)
      if res is None or not any(s.subcluster == 0 for s in res.stages):
        continue   # no mixed stage: a plan the tables as they are already have
      res = charged(res, (fusion,), fused)
      if res is None:
        continue
      found += 1
      mixed_plans.append((res.value, x, fusion))
      if best is None or (res.value, x) < (best.value, *best_key):
        best, chosen, best_key = res, ((fusion,), fused), (x,)
    # Two shapes of mixed stage in one plan: pairs of the best fusions that leave each other
    # the hosts they reserve.
    top = [f for _, _, f in sorted(mixed_plans)[:mopts.pair_candidates]]
    pairs = 0
    for f1, f2 in itertools.combinations(top, 2):
      try:
        fused = fused_tables(tables, (f1, f2), B, mopts, expanded, levels, memo)
      except PlanError:
        continue   # together they need more hosts than there are
      pairs += 1
      res = attempt(fused, bar(pairs=False))
      if res is not None and {0, 1} <= {s.subcluster for s in res.stages}:
        res = charged(res, (f1, f2), fused)
        if res is not None and (best is None or res.value < best.value):
          best, chosen = res, ((f1, f2), fused)
    log.info("planner: mixed-type stages: %d fusions (%d out of bounds), %d solved, %d with a "
             "mixed plan, %d pairs, %.2f s", len(fusions), skipped, tried, found, pairs,
             time.perf_counter() - start)
    if chosen is not None:
      best = _mixed_result(tables, B, options, mopts, best, *chosen, start,
                           len(fusions))
    if best is not None and any(v < best.value * (1.0 - 1e-12) for v in loose):
      # a fusion's plan paid more than its search saw; another of its plans may beat best
      log.info("planner: mixed-type stages: %d searches' plans pay gradient-sum fees their "
               "bound does not see; the result is not proved optimal", len(loose))
      proofs.append(False)
  if best is None:
    raise error
  proved = None if any(p is None for p in proofs) else all(proofs)
  best = dataclasses.replace(best, stats=dataclasses.replace(best.stats, proved=proved))
  return choose_schedule(best, mixed_scorer(tables, B, options, mopts), options)


def _solve_below(tables: CostTables, B: int, options: SolveOptions, beat: float
                 ) -> PlanResult | None:
  """:func:`solve` (``options`` plain, H-1F1B) counting only plans whose value is below
  ``beat`` (``None``: no such plan found): the planner's bounded search, whose every step
  starts from that bound (the periods whose floor is beyond it are not even tested)."""
  # solve.py's bounded cascade is module-internal; reached through its module object until
  # that module exports it.
  bounded = getattr(sys.modules[solve.__module__], "_solve_plain")
  res = bounded(tables, B, options, time.perf_counter(), beat=beat)
  if res is None:
    return None
  return choose_schedule(res, plan_scorer(tables, B, options.eps, options.fwd_fraction),
                         options)


def _fusion_order(tables: CostTables, fusions: Sequence, B: int, mopts: MixedOptions,
                  options: SolveOptions, levels: Sequence[int] = (0,)
                  ) -> tuple[list[int], int]:
  """The positions of ``fusions`` to search, the most promising first, and how many were left
  out because no plan with one of their mixed stages keeps the bounds.

  Left out (exactly): a fusion whose one mixed stage's GPUs cost more per hour than
  ``budget_per_hour`` (a plan's rate is at least that), or whose fastest mixed stage (at any ZeRO level of
  ``levels``) times ``B`` exceeds ``time_limit_s`` (an iteration takes at least ``B`` times its slowest
  stage). Order: by the iteration of one mixed stage on every layer (``B t + e``; times its
  GPUs' price for the money objectives), unknown (a zebra shape, or no such stage) last; ties
  keep their order."""
  b = _rows(mopts)
  L = tables.num_layers
  goal = options.objective
  priced_goal = goal in ("max_throughput_per_dollar", "min_cost_within_time")
  keys, skipped = [], 0
  for x, f in enumerate(fusions):
    if not isinstance(f, Fusion) or sum(f.rows) != b:
      keys.append((math.inf, x))
      continue
    rate = (None if tables.price_per_gpu_hour is None else
            sum(tables.price_per_gpu_hour[k] * n * m for k, (n, m) in zip(f.members, f.shapes)))
    if (options.budget_per_hour is not None and rate is not None
        and rate > options.budget_per_hour * (1.0 + 1e-9)):
      skipped += 1
      continue
    entries = [_virtual_entry(tables, f, B, mopts, z) for z in levels]
    t, e = entries[0][0], entries[0][2]
    fastest = min(float(np.min(v[0])) for v in entries)
    if options.time_limit_s is not None and B * fastest > options.time_limit_s * (1.0 + 1e-9):
      skipped += 1
      continue
    est = B * float(t[0, L - 1, 0]) + float(e[0, L - 1, 0])
    if priced_goal and rate is not None:
      est *= rate
    keys.append((est if math.isfinite(est) else math.inf, x))
  return [x for _, x in sorted(keys)], skipped


def mixed_scorer(tables: CostTables, num_microbatches: int, options: SolveOptions,
                 mixed_options: MixedOptions) -> Scorer:
  """Scores a plan under a schedule (:func:`~harpjax.compiler.plan.choose_schedule`): one with
  mixed-type stages by :func:`evaluate_mixed`, one without by
  :func:`~harpjax.compiler.plan.evaluate_plan`."""
  plain = plan_scorer(tables, num_microbatches, options.eps, options.fwd_fraction)
  mixed_options = mixed_options or MixedOptions()

  def score(plan: Plan, kind: ScheduleKind) -> ScheduleScore:
    if not any(s.groups or s.zebra is not None for s in plan.stages):
      return plain(plan, kind)
    ev = evaluate_mixed(tables, plan, num_microbatches, mixed_options, eps=options.eps,
                        fwd_fraction=options.fwd_fraction, schedule=kind)
    return ScheduleScore(ev.schedule, ev.iteration_s, ev.mem_ok, ev.warmups, ev.planned,
                         ev.violations)
  return score


def _mixed_result(tables: CostTables, B: int, options: SolveOptions, mopts: MixedOptions,
                  res: PlanResult, fusions: tuple, fused: CostTables, start: float,
                  num_fusions: int) -> PlanResult:
  """The result found on fused tables, in terms of the real tables."""
  specs = _plan_of(tables, fused, fusions, res, mopts)
  ev = evaluate_mixed(tables, specs, B, mopts, eps=options.eps,
                      fwd_fraction=options.fwd_fraction)
  # The fused tables and the evaluator must agree (an internal invariant: the same
  # arithmetic, so the same bits; the plan carries the evaluator's time either way).
  assert ev.feasible, ev.violations
  assert math.isclose(ev.iteration_s, res.iteration_s, rel_tol=1e-12), (ev.iteration_s,
                                                                        res.iteration_s)
  assert ev.warmups == res.warmups, (ev.warmups, res.warmups)
  assert ev.num_devices == tables.total_devices or not options.use_all_devices
  meta = dict(res.plan.meta)
  meta.update(planner="harpjax.dp+mixed", mixed_stages=options.mixed_stages,
              microbatch_rows=mopts.microbatch_rows, fixed_fraction=mopts.fixed_fraction,
              mixed_fusions=num_fusions, mixed_seconds=time.perf_counter() - start)
  assert math.isclose(ev.fees_per_iteration, res.fees_per_iteration, rel_tol=1e-9,
                      abs_tol=1e-15), (ev.fees_per_iteration, res.fees_per_iteration)
  plan = res.plan.replace(stages=specs, meta=meta, predicted_iteration_s=ev.iteration_s)
  stats = dataclasses.replace(res.stats, seconds=time.perf_counter() - start)
  objective = ev.iteration_s if options.cost_model == "simulator" else res.objective_s
  cost = (None if res.rate_per_hour is None
          else res.rate_per_hour * objective / 3600.0 + ev.fees_per_iteration)
  return dataclasses.replace(res, plan=plan, stages=ev.planned, stats=stats,
                             iteration_s=ev.iteration_s, objective_s=objective,
                             fees_per_iteration=ev.fees_per_iteration,
                             transfer_bytes=ev.transfer_bytes, cost_per_iteration=cost)


register_mixed_search(solve_mixed)
