"""Scoring a given plan on cost tables, and saying why no plan fits.

:func:`evaluate_plan` takes any plan (a :class:`~harpjax.compiler.plan.Plan`, its
:class:`~harpjax.compiler.plan.StageSpec` list, :class:`PlannedStage` list or
``(first_layer, last_layer, subcluster, submesh index)`` tuples) under any registered schedule
(:mod:`harpjax.compiler.schedule.registry`: H-1F1B, 1F1B, Eager-1F1B, GPipe, a user's) and
returns a :class:`PlanEvaluation` (Eq. 12, steady period, memory,
links, packing). The planner assembles its result with it and the baselines score plans with
it.

When :func:`~harpjax.compiler.plan.solve` finds no plan, :func:`infeasible_error` names the
constraint that rules every plan out (``"layers"``, ``"memory"``, ``"communication"`` or
``"devices"``) and by how much: the smallest footprint and its shortfall, the best plan
ignoring ``C(j) <= t_max`` and how many times its cut is too slow, or the smallest uniform
memory scale at which a plan fits (a bisection over scaled sparse indexes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import place_stages
from harpjax.compiler.plan import variants as variants_lib
from harpjax.compiler.plan.index import SparseIndex
from harpjax.compiler.plan.spec import Plan, StageSpec
from harpjax.compiler.profile import (CostTables, offload_time_s, param_fetch_time_s,
                                      plan_transfer)
from harpjax.compiler.schedule import (activations_after, chunk_residency,
                                       group_activation_peaks, update_positions,
                                       prefetch_stalls, PipelineCosts, pipeline_period,
                                       schedule_kind,
                                       ScheduleKind, simulate)
from harpjax.errors import HarpjaxError, InfeasiblePlanError, InvalidOptionError, PlanError

CUT_MODELS = ("one_link", "replica_pairs")
"""How :func:`evaluate_plan` prices a cut: one message on one link (what the runtime sends, and
what the DP prices), or every host pair of the two stages at once (per data-parallel replica
pair, Sailor's model)."""

__all__ = ["CUT_MODELS", "PlannedStage", "PlanEvaluation", "evaluate_plan", "infeasible_error",
           "check_logical_mesh", "simulated_time"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlannedStage:
  """One stage of a planned pipeline, with the numbers behind it.

  Attributes:
    layers: inclusive ``(first, last)`` layer indices.
    subcluster: index ``k`` in the tables' order; ``subcluster_name`` its name.
    submesh_index: ``s``; ``submesh`` its shape ``(n, m)``; ``logical_mesh`` ``(dp, tp)``.
    device_offset: first device of the stage in the tables' numbering (subcluster by
      subcluster, each subcluster's stages in pipeline order from its first device).
    hosts: ``((host, first_device, num_devices), ...)`` inside the subcluster: where the
      stage sits (:func:`harpjax.cluster.place_stages`, the placement its cuts are priced
      by and the allocator hands out, up to the hosts' numbering).
    time_s: forward+backward seconds per microbatch ``t_i``.
    comm_s: seconds of the cut after the stage ``c_i`` (0 for the last stage): on the link
      inside a host when the next stage shares the stage's host
      (:meth:`~harpjax.compiler.profile.CostTables.cut_costs`).
    warmup: the schedule's warm-up count ``N_i``; ``inflight`` the most microbatches the
      stage holds at once under it (``min(N_i, B)`` for the 1F1B-style tables).
    param_bytes, act_bytes: per device; ``peak_mem_bytes = param + inflight * act``.
    device_memory_bytes: the device's memory.
    zero: the stage's ZeRO level; offload: its optimizer state kept in host memory;
      offload_activations: its residuals kept in host memory between forward and backward
      (the variant of tables with :attr:`~harpjax.compiler.profile.CostTables.variants`;
      ``submesh_index`` is then the variant's index in those tables, and ``param_bytes`` and
      ``act_bytes`` are the variant's: with ``offload_activations`` two microbatches'
      residuals in the former, none in the latter).
    remat: what the stage's backward recomputes, where the tables cost it per stage
      (:attr:`~harpjax.compiler.profile.CostTables.remat_modes`); ``None``: the plan's mode.
    offload_params: the stage keeps its parameters in host memory while its device group runs
      its other stages (:attr:`~harpjax.compiler.plan.StageSpec.offload_params`).
  """
  layers: tuple[int, int]
  subcluster: int
  subcluster_name: str
  submesh_index: int
  submesh: tuple[int, int]
  logical_mesh: tuple[int, int]
  device_offset: int
  hosts: tuple[tuple[int, int, int], ...]
  time_s: float
  comm_s: float
  warmup: int
  inflight: int
  param_bytes: float
  act_bytes: float
  peak_mem_bytes: float
  device_memory_bytes: float
  zero: int = 0
  offload: bool = False
  offload_activations: bool = False
  remat: str | None = None
  offload_params: bool = False


@dataclasses.dataclass(frozen=True)
class PlanEvaluation:
  """A plan scored on cost tables (:func:`evaluate_plan`).

  Attributes:
    schedule: the schedule evaluated (its registered name).
    num_microbatches: ``B``.
    stages: :class:`PlannedStage` per stage (warm-ups of ``schedule``).
    warmups: warm-up counts ``N_i`` of ``schedule``.
    t_max_s: bottleneck stage time.
    eq12_s: Eq. 12, ``sum (t_i + 2 c_i) + (B - 1) t_max`` (the paper's planning model;
      valid when every ``c_i <= t_max``).
    steady_period_s: seconds per microbatch in the steady phase:
      ``max(t_max, max_i c_i, max_i (t_i + t_{i+1} + 2 c_i) / (delta_i + 1))`` with
      ``delta_i = min(N_i, B) - min(N_{i+1}, B)`` (the K-block bound of Eq. 7-9 per cut, and
      each link direction carrying one microbatch at a time).
    iteration_s: predicted seconds per iteration: the simulator's when available (with each
      stage's end-of-iteration time), else ``sum (t_i + 2 c_i) + (B - 1) steady_period_s``.
    model: ``"simulator"`` or ``"analytic"``.
    eta: load-balance score of Eq. 20.
    mem_ok: every stage fits ``mem_p + inflight_i mem_a <= mem_device`` (``inflight_i =
      min(N_i, B)`` for the 1F1B-style tables), and its update fits.
    comm_ok: every ``c_i <= t_max`` (H-1F1B's condition in the paper, and Eq. 12's; a plan
      with a slower cut is *link-bound*: it runs at the period ``max_i c_i``, which the
      simulator and the warm-ups account for).
    period_s: ``max(t_max, max_i c_i)``, what H-1F1B's warm-ups are computed against.
    end_s: per stage, the end-of-iteration seconds (``CostTables.end_time_s``).
    devices_ok: no subcluster is over-subscribed and its stages pack onto its hosts.
    uses_all_devices: every device of every subcluster is in some stage.
    violations: human-readable list of what fails.
    num_devices: devices the stages use.
    transfer_bytes: ``[3]`` bytes per iteration the plan's cuts send over links of each class
      (``same_zone``, ``other_zone``, ``other_region``:
      :func:`~harpjax.compiler.profile.plan_transfer`); fees_per_iteration: their transfer
      fee (the tables' :attr:`~harpjax.compiler.profile.CostTables.fees`; ``0`` without).
      :attr:`cost_per_iteration` and :attr:`rate_with_fees_per_hour` count it.
    rate_per_hour: sum over stages of devices times the subcluster's price per device-hour
      (``None`` when the tables have no prices).
  """
  schedule: str
  num_microbatches: int
  stages: tuple[PlannedStage, ...]
  warmups: tuple[int, ...]
  t_max_s: float
  eq12_s: float
  steady_period_s: float
  iteration_s: float
  model: str
  eta: float
  mem_ok: bool
  comm_ok: bool
  devices_ok: bool
  uses_all_devices: bool
  violations: tuple[str, ...]
  num_devices: int = 0
  rate_per_hour: float | None = None
  period_s: float = 0.0
  end_s: tuple[float, ...] = ()

  transfer_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
  fees_per_iteration: float = 0.0

  @property
  def gpu_cost_per_iteration(self) -> float | None:
    """The GPUs' money per iteration, ``rate_per_hour * iteration_s / 3600`` (``None``
    without prices)."""
    return None if self.rate_per_hour is None else self.rate_per_hour * self.iteration_s / 3600

  @property
  def cost_per_iteration(self) -> float | None:
    """Money per iteration with the transfer fees: ``rate_per_hour * iteration_s / 3600 +
    fees_per_iteration`` (``None`` without prices)."""
    gpus = self.gpu_cost_per_iteration
    return None if gpus is None else gpus + self.fees_per_iteration

  @property
  def rate_with_fees_per_hour(self) -> float | None:
    """The hourly rate with the transfer fees: ``rate_per_hour + 3600 fees_per_iteration /
    iteration_s`` (what a budget per hour bounds; ``None`` without prices)."""
    if self.rate_per_hour is None:
      return None
    if self.fees_per_iteration == 0.0:
      return self.rate_per_hour
    return self.rate_per_hour + 3600.0 * self.fees_per_iteration / self.iteration_s

  @property
  def feasible(self) -> bool:
    """Runs without running out of memory on the devices it claims."""
    return self.mem_ok and self.devices_ok


def _resolve_stages(tables: CostTables, stages,
                    num_groups: int | None = None) -> list[tuple[int, int, int, int]]:
  plan = stages if isinstance(stages, Plan) else None
  if isinstance(stages, Plan):
    stages = stages.stages
  out = []
  for st in stages:
    if isinstance(st, StageSpec):
      if st.groups:
        raise PlanError(f"stage on layers {st.layers} runs on {len(st.groups) + 1} groups "
                        "(a mixed-type stage): score the plan with "
                        "harpjax.compiler.plan.evaluate_mixed(tables, plan, B, MixedOptions("
                        "microbatch_rows=...))")
      if st.zebra is not None:
        raise PlanError(f"stage on layers {st.layers} is a zebra stage (attention on "
                        f"{st.subcluster}, experts on {st.zebra.subcluster}): score the plan "
                        "with harpjax.compiler.plan.evaluate_mixed(tables, plan, B, "
                        "MixedOptions(microbatch_rows=...)), on tables with a routed_split")
      k = tables.subcluster_index(st.subcluster)
      slot = variants_lib.variant_slot(tables, k, st.submesh, st.zero, st.offload,
                                       st.offload_activations,
                                       plan.remat_of(st) if plan is not None else st.remat)
      check_logical_mesh(tables, st, k, slot)
      out.append((st.layers[0], st.layers[1], k, slot))
    elif isinstance(st, PlannedStage):
      s = st.submesh_index
      if tables.variants is not None or st.zero or st.offload or st.offload_activations \
          or tables.remat_modes is not None:
        s = variants_lib.variant_slot(tables, st.subcluster, st.submesh, st.zero, st.offload,
                                      st.offload_activations, st.remat)
      out.append((st.layers[0], st.layers[1], st.subcluster, s))
    else:
      i, j, k, s = st
      k = tables.subcluster_index(k)
      if not 0 <= int(s) < len(tables.submeshes[k]):
        raise PlanError(f"stage {st}: submesh index {s} out of range")
      out.append((int(i), int(j), k, int(s)))
  if not out:
    raise PlanError("a plan needs at least one stage")
  if out[0][0] != 0 or out[-1][1] != tables.num_layers - 1 or any(
      b[0] != a[1] + 1 for a, b in zip(out, out[1:])) or any(i > j for i, j, _, _ in out):
    raise PlanError(f"stage layer ranges {[(i, j) for i, j, _, _ in out]} must cover layers "
                    f"0..{tables.num_layers - 1} contiguously")
  seen = set()
  # Under an interleaved schedule the stages return to their groups' subclusters: the groups'
  # own order (the first ``d`` stages) is what must not return.
  for a, b in zip(out[:num_groups], out[1:num_groups]):
    if b[2] == a[2]:
      continue
    seen.add(a[2])
    if b[2] in seen:
      raise PlanError(f"stage on layers {b[:2]} returns to subcluster "
                      f"{tables.subcluster_names[b[2]]!r} after others: each subcluster runs "
                      "one contiguous group of stages")
    if not tables.linked(a[2], b[2]):
      raise PlanError(f"stage on layers {b[:2]} on {tables.subcluster_names[b[2]]!r} follows "
                      f"one on {tables.subcluster_names[a[2]]!r}, but the tables have no link "
                      "between them")
  return out


def check_logical_mesh(tables: CostTables, st: StageSpec, k: int, s: int) -> None:
  """Refuses a stage whose logical mesh is not the one the tables cost its entry with (the
  tables hold one mesh per entry; scoring another would be silently wrong)."""
  i, j = st.layers
  if not (0 <= i <= j < tables.num_layers) or not np.isfinite(tables.stage_time_s[k][i, j, s]):
    return   # the layer ranges and feasibility are reported elsewhere
  have = tables.logical_mesh_of(k, i, j, s)
  if tuple(st.logical_mesh) != have:
    raise PlanError(
        f"stage on layers {st.layers} ({st.subcluster} {tuple(st.submesh)}) runs logical mesh "
        f"(dp, tp) = {tuple(st.logical_mesh)}, but the cost tables cost that range on that "
        f"submesh with {have} only: set the stage's logical_mesh to {have}, or cost the plan "
        "on its own meshes (harpjax simulate plan.json --cluster ... --model ..., or "
        "harpjax.compiler.profile.tables_for_plan)")


def evaluate_plan(tables: CostTables, stages, num_microbatches: int,
                  schedule: str | ScheduleKind | None = None,
                  *, eps: float = 0.1, simulator: bool = True,
                  fwd_fraction: float = 1.0 / 3.0, cuts: str = "one_link") -> PlanEvaluation:
  """Scores a plan on cost tables: Eq. 12, steady period, memory, links, packing.

  Args:
    tables: the cost tables. A stage with a ZeRO level or host offload is scored by its
      variant (:mod:`~harpjax.compiler.plan.variants`: the tables need ``opt_mem_bytes``
      for a level or the optimizer state's offload, ``offload_bandwidth_bytes_per_s`` for
      either offload).
    stages: a :class:`~harpjax.compiler.plan.Plan`, its :class:`StageSpec` list, a
      :class:`PlannedStage` list, or tuples ``(first_layer, last_layer, subcluster, submesh
      index)`` (subcluster by index or name; the index of a variant in expanded tables).
    num_microbatches: ``B``.
    schedule: a registered schedule (name, any accepted spelling, or
      :class:`~harpjax.compiler.schedule.ScheduleKind`); default the plan's own when
      ``stages`` is a :class:`~harpjax.compiler.plan.Plan`, else ``"h1f1b"``.
    eps: the tolerance of the schedule's warm-up rule (H-1F1B's).
    simulator: use :func:`harpjax.compiler.schedule.simulate` for ``iteration_s`` (else the
      analytic steady-period model).
    fwd_fraction: share of a stage's time spent in the forward pass (for the simulator).
    cuts: how each cut is priced (Eq. 12 and the simulator read the same seconds):
      ``"replica_pairs"``, every host pair of the two stages at once (:meth:`~harpjax.
      compiler.profile.CostTables.replica_cut_costs`: what the runtimes send, each host its
      rows on its own connection, and Sailor's model), or ``"one_link"`` (the default: the
      price the DP optimises and the planner reports), one message on one link
      (:meth:`~harpjax.compiler.profile.CostTables.cut_costs`), an upper bound of the former,
      equal to it where either stage holds its rows on one host; docs/cost_model.md. The
      warm-up counts are the one-link ones either way (the plan's, as the DP found it): with
      them fixed, a cheaper cut never lengthens the simulated iteration. The warm-up counts are
      the one-link ones either way (the plan's, as the DP found it): with them fixed, a
      cheaper cut never lengthens the simulated iteration.

  Returns:
    The :class:`PlanEvaluation`.

  Raises:
    PlanError: the stages do not cover the layers contiguously, return to a subcluster after
      leaving it, or follow each other on two subclusters the tables give no link between;
      or the schedule is not registered.
  """
  B = int(num_microbatches)
  kind = _kind(schedule, stages)
  base, tables = tables, variants_lib.tables_for_stages(tables, stages)
  n_stages = len(stages.stages if isinstance(stages, Plan) else stages)
  group = _device_groups(kind, n_stages)
  quads = _resolve_stages(tables, stages, max(group) + 1 if group else None)
  S = len(quads)
  t = [float(tables.stage_time_s[k][i, j, s]) for i, j, k, s in quads]
  if cuts not in CUT_MODELS:
    raise InvalidOptionError(f"evaluate_plan(cuts={cuts!r}): choose one of {CUT_MODELS}")
  c = [float(x) for x in tables.cut_costs(quads)]   # where the stages sit
  # the warm-ups are the plan's as the DP prices its cuts (one link), which the runtime runs
  warm = kind.warmups(PipelineCosts(S, B, tuple(t), tuple(c[:-1]), eps))
  if cuts == "replica_pairs":
    c = [float(x) for x in tables.replica_cut_costs(quads)]
  t_max = max(t)
  period = pipeline_period(c, t_max)
  violations = []
  if not math.isfinite(t_max):
    bad = [q for q, x in zip(quads, t) if not math.isfinite(x)]
    violations.append(f"stages {bad} have no finite time in the tables")
  inflight = kind.inflight(S, B, warm)
  # Devices: over-subscription and packing per subcluster.
  devices_ok, uses_all = True, True
  hosts: dict[int, tuple] = {}
  for k in range(tables.num_subclusters):
    mine = [x for x, q in enumerate(quads) if q[2] == k and (not group or group[x] == x)]
    shapes = [tables.submeshes[k][quads[x][3]] for x in mine]
    used = sum(n * m for n, m in shapes)
    uses_all &= used == tables.subcluster_devices[k]
    packed = place_stages(tables.num_hosts[k], tables.devices_per_host[k], shapes)
    if packed is None:
      devices_ok = False
      violations.append(f"subcluster {tables.subcluster_names[k]!r}: submeshes {shapes} "
                        f"({used} devices) do not pack onto {tables.num_hosts[k]} hosts of "
                        f"{tables.devices_per_host[k]}")
    else:
      hosts.update(zip(mine, packed))
  if group:   # the stages of a group sit where its first stage sits
    hosts.update({x: hosts[group[x]] for x in range(S) if group[x] in hosts})
  mem_ok = True
  held = _params_offloaded(stages, S)
  if any(held) and not group:
    raise PlanError(f"stages {[x for x in range(S) if held[x]]} keep their parameters in host "
                    f"memory (offload_params), which needs stages that share a device group; "
                    f"schedule {kind.name!r} has none: use an interleaved schedule")
  sched = kind.schedule(S, B, warm) if group else None
  off = _param_offload(base, tables, quads, held) if any(held) else None
  group_peak = (_group_peaks(base, tables, quads, kind, B, warm, group, sched, off)
                if group else None)
  planned, taken = [], [0] * tables.num_subclusters
  for x, (i, j, k, s) in enumerate(quads):
    p = float(tables.param_mem_bytes[k][i, j, s])
    a = float(tables.act_mem_bytes[k][i, j, s])
    peak = p + inflight[x] * a if not group else group_peak[group[x]]
    dev_mem = tables.device_memory_bytes[k]
    if group and not peak <= dev_mem:
      if group[x] == x:
        mem_ok = False
        violations.append(
            f"device group {x} ({tables.subcluster_names[k]} {tables.submeshes[k][s]}: stages "
            f"{[y for y in range(S) if group[y] == x]}) needs {peak / 2**30:.3f} GiB (every "
            f"stage's parameters and activations in flight) > {dev_mem / 2**30:.3f} GiB "
            "device memory")
    elif not peak <= dev_mem:
      mem_ok = False
      violations.append(
          f"stage {x} (layers {i}..{j}, {tables.subcluster_names[k]} {tables.submeshes[k][s]}) "
          f"needs {peak / 2**30:.3f} GiB ({p / 2**30:.3f} GiB parameters + {inflight[x]} x "
          f"{a / 2**30:.3f} GiB activations) > {dev_mem / 2**30:.3f} GiB device memory")
    step = (float(tables.step_mem_bytes[k][i, j, s]) if tables.step_mem_bytes is not None
            else 0.0)
    if not step <= dev_mem:
      mem_ok = False
      violations.append(
          f"stage {x} (layers {i}..{j}, {tables.subcluster_names[k]} {tables.submeshes[k][s]}) "
          f"needs {step / 2**30:.3f} GiB for its gradient reduction and optimizer update > "
          f"{dev_mem / 2**30:.3f} GiB device memory")
    peak = max(peak, step)
    n, m = tables.submeshes[k][s]
    if group and group[x] != x:   # on its group's devices
      offset = planned[group[x]].device_offset
    else:
      offset = int(tables.device_offsets[k]) + taken[k]
      taken[k] += n * m
    planned.append(PlannedStage(
        layers=(i, j), subcluster=k, subcluster_name=tables.subcluster_names[k],
        submesh_index=s, submesh=(n, m), logical_mesh=tables.logical_mesh_of(k, i, j, s),
        device_offset=offset, hosts=hosts.get(x, ()), time_s=t[x], comm_s=c[x],
        warmup=int(warm[x]), inflight=int(inflight[x]), param_bytes=p, act_bytes=a,
        peak_mem_bytes=peak, device_memory_bytes=dev_mem,
        zero=variants_lib.variant_of(tables, k, s)[0],
        offload=variants_lib.variant_of(tables, k, s)[1],
        offload_activations=variants_lib.variant_of(tables, k, s)[2],
        remat=tables.remat_of(k, s), offload_params=bool(held[x])))
  comm_ok = all(x <= t_max for x in c)
  ends = [tables.end_of(k, i, j, s) for i, j, k, s in quads]
  stalls = None
  if off is not None:   # the update reads the parameters in and writes the new ones back
    ends = [e + float(offload_time_s(w, off.bandwidth[x])) if held[x] else e
            for x, (e, w) in enumerate(zip(ends, off.param_bytes))]
    stalls = _prefetch_stalls(sched, t, fwd_fraction, off, B)
  head = sum(x + 2.0 * y for x, y in zip(t, c))
  eq12 = head + (B - 1) * t_max
  steady = period  # a link sends one microbatch per direction at a time
  for x in range(S - 1):
    delta = inflight[x] - inflight[x + 1]
    if delta >= 1:
      steady = max(steady, (t[x] + t[x + 1] + 2.0 * c[x]) / (delta + 1))
  iteration, model = head + (B - 1) * steady + max(ends), "analytic"
  transfer = plan_transfer(tables, quads, B)
  if group:   # a group computes its stages' tasks one at a time
    t_max = max(sum(t[x] for x in range(S) if group[x] == g) for g in set(group))
  if (simulator or group) and math.isfinite(t_max):
    iteration, model = simulated_time(t, c, kind, B, warm, fwd_fraction, ends,
                                      stalls), "simulator"
  return PlanEvaluation(schedule=kind.name, num_microbatches=B, stages=tuple(planned),
                        warmups=tuple(int(w) for w in warm), t_max_s=t_max, eq12_s=eq12,
                        steady_period_s=steady, iteration_s=iteration, model=model,
                        eta=_eta(tables, _per_group(planned, group), t_max), mem_ok=mem_ok,
                        comm_ok=comm_ok, devices_ok=devices_ok, uses_all_devices=uses_all,
                        violations=tuple(violations), num_devices=sum(taken),
                        rate_per_hour=_rate(tables, _per_group(planned, group)),
                        period_s=period,
                        end_s=tuple(ends), transfer_bytes=transfer.bytes_by_class,
                        fees_per_iteration=transfer.fee_per_iteration)


def _rate(tables: CostTables, stages: Sequence[PlannedStage]) -> float | None:
  """Hourly rate: per subcluster (in pipeline order) its devices in use times its price."""
  if tables.price_per_gpu_hour is None:
    return None
  held: dict[int, int] = {}
  for s in stages:
    held[s.subcluster] = held.get(s.subcluster, 0) + s.submesh[0] * s.submesh[1]
  rate = 0.0
  for k in reversed(list(held)):   # the order the DP charges them: last subcluster first
    rate += tables.price_per_gpu_hour[k] * held[k]
  return rate


def _eta(tables: CostTables, stages: Sequence[PlannedStage], t_max: float) -> float:
  """Eq. 20: ``1 - sum_d (t_max - t_d) F_d / (t_max sum_d F_d)`` over devices ``d``."""
  if not (math.isfinite(t_max) and t_max > 0):
    return 0.0
  num = den = 0.0
  for s in stages:
    flops = tables.peak_flops[s.subcluster] if tables.peak_flops else 1.0
    devs = s.submesh[0] * s.submesh[1]
    num += devs * (t_max - s.time_s) * flops
    den += devs * t_max * flops
  return 1.0 - num / den


def _kind(schedule, stages) -> ScheduleKind:
  """The registered kind to evaluate: the one named, else the plan's own, else H-1F1B."""
  if schedule is None:
    schedule = stages.schedule if isinstance(stages, Plan) else "h1f1b"
  try:
    return schedule_kind(schedule)
  except HarpjaxError as e:
    raise PlanError(f"schedule={schedule!r}: {e}") from None


# --------------------------------------------------------------------------- device groups


def _device_groups(kind: ScheduleKind, num_stages: int) -> tuple[int, ...] | None:
  """Per stage its device group under an interleaved schedule (``chunks > 1``), else
  ``None`` (every stage on devices of its own)."""
  if kind.chunks == 1:
    return None
  try:
    return kind.device_groups(num_stages)
  except HarpjaxError as e:
    raise PlanError(f"schedule {kind.name!r}: {e}") from None


def _group_peaks(base: CostTables, tables: CostTables, quads, kind: ScheduleKind, B: int,
                 warm, group, sched=None, off=None) -> dict[int, float]:
  """Per device group, the bytes per device it holds at its peak.

  A group computes one task at a time, so it holds every stage's state (its fixed bytes less
  its task workspace, :func:`_task_workspaces`), the most residual bytes its interleaved order
  holds at once (:func:`~harpjax.compiler.schedule.group_activation_peaks`) and the largest
  workspace of its stages' tasks; or, while one stage reduces and updates (``step_mem_bytes``,
  right after its last task: interleaved updates, one stage's at a time), that beside the
  other stages' state, the activations the group still holds then and the parameters it has
  prefetched, if more.

  Args:
    base: the tables ``evaluate_plan`` was given (before variants were expanded for the
      stages' ZeRO levels and offloads); ``tables``: those the stages index.
    sched: the schedule's tables (built here when not given).
    off: the stages' parameter offload (:func:`_param_offload`); a stage that keeps its
      parameters in host memory holds them on the devices only while its group runs it or
      prefetches it (:func:`~harpjax.compiler.schedule.chunk_residency`: at most two stages'
      at once), and not beside another stage's update.
  """
  act = [float(tables.act_mem_bytes[k][i, j, s]) for i, j, k, s in quads]
  if sched is None:
    sched = kind.schedule(len(quads), B, warm)
  held = group_activation_peaks(sched.groups, act)
  work = _task_workspaces(base, tables, quads)
  stay = [float(tables.param_mem_bytes[k][i, j, s]) - w for (i, j, k, s), w in zip(quads, work)]
  away = [0.0] * len(quads) if off is None else [
      w if h else 0.0 for w, h in zip(off.param_bytes, off.held)]
  out: dict[int, float] = {}
  for g in sorted(set(group)):
    mine = [x for x in range(len(quads)) if group[x] == g]
    order = sched.groups[g]
    state = sum(stay[x] - away[x] for x in mine)
    fetched, res = 0.0, None
    if any(away[x] for x in mine):
      res = chunk_residency(order, [x for x in mine if away[x]])
      fetched = res.peak_bytes(away)
    peak = state + fetched + held[g] + max(work[x] for x in mine)
    if tables.step_mem_bytes is not None:
      after = activations_after(order, act)
      for x, p in update_positions(order).items():
        i, j, k, s = quads[x]
        # Beside the update: the others' state, the residuals still held, the next stage's
        # prefetched parameters (its own are in the update's bytes).
        ahead = 0.0 if res is None else sum(away[y] for y in res.resident[p] if y != x)
        peak = max(peak, float(tables.step_mem_bytes[k][i, j, s]) + state - stay[x] + away[x]
                   + after[p] + ahead)
    out[g] = peak
  return out


@dataclasses.dataclass(frozen=True)
class _ParamOffload:
  """Per stage: whether it keeps its parameters in host memory, their bytes per device (at
  its ZeRO level) and its device-host bandwidth."""
  held: tuple
  param_bytes: tuple
  bandwidth: tuple


def _params_offloaded(stages, S: int) -> list[bool]:
  """Per stage, its :attr:`~harpjax.compiler.plan.StageSpec.offload_params` (``False`` for
  stages given as index tuples)."""
  if isinstance(stages, Plan):
    stages = stages.stages
  return [bool(getattr(st, "offload_params", False)) for st in stages][:S]


def _param_offload(base: CostTables, tables: CostTables, quads, held) -> _ParamOffload:
  """The parameter bytes per device of each stage (the memory model's weights at the stage's
  ZeRO level, :func:`~harpjax.compiler.plan.variants.memory_model`; where the tables carry no
  workspace, half of the fixed bytes less the optimizer state), and the host links.

  Raises:
    PlanError: a stage offloads its parameters but the tables lack the host link
      (``offload_bandwidth_bytes_per_s``) or the optimizer state's bytes.
  """
  bw_all = base.offload_bandwidth_bytes_per_s
  if bw_all is None or (base.opt_mem_bytes is None and tables.opt_mem_bytes is None):
    raise PlanError("stages that keep their parameters in host memory (offload_params) need "
                    "cost tables with offload_bandwidth_bytes_per_s and opt_mem_bytes "
                    "(CostTables.from_layer_costs(..., optimizer_share=...) with "
                    "SubclusterSpec.offload_bandwidth_bytes_per_s)")
  out = []
  for x, (i, j, k, s) in enumerate(quads):
    if not held[x]:
      out.append(0.0)
      continue
    zero, offload, _ = variants_lib.variant_of(tables, k, s)
    model = None
    if base.variants is None:
      P = base.param_mem_bytes[k]
      b = variants_lib.base_index(tables, k, s)
      if base.logical_mesh is not None:
        dp = base.logical_mesh[k][..., 0].astype(np.float64)
      else:
        dp = np.broadcast_to(np.array([n * m for n, m in base.submeshes[k]], np.float64),
                             P.shape)
      model = variants_lib.memory_model(base, k, dp, zero, offload)
    if model is not None:
      out.append(float(np.broadcast_to(model.param_bytes, P.shape)[i, j, b]))
    else:   # the variant's fixed bytes less its optimizer state held: weights and gradients
      opt = 0.0 if offload or tables.opt_mem_bytes is None else float(
          tables.opt_mem_bytes[k][i, j, s])
      fixed = float(tables.param_mem_bytes[k][i, j, s]) - opt
      out.append(max(fixed, 0.0) / 2.0)
  return _ParamOffload(tuple(held), tuple(out),
                       tuple(float(bw_all[k]) for _, _, k, _ in quads))


def _prefetch_stalls(sched, t, fwd_fraction: float, off: _ParamOffload, B: int):
  """``(fwd, bwd)`` ``[S, B]`` seconds each task of a stage waits for its parameters'
  prefetch (:func:`~harpjax.compiler.schedule.prefetch_stalls`, fetch times of
  :func:`~harpjax.compiler.profile.param_fetch_time_s`)."""
  S = len(t)
  fwd, bwd = np.zeros((S, B)), np.zeros((S, B))
  fetch = [float(param_fetch_time_s(w, bw)) for w, bw in zip(off.param_bytes, off.bandwidth)]
  for order in sched.groups:
    mine = [x for x in {u.stage for u in order} if off.held[x]]
    if not mine:
      continue
    res = chunk_residency(order, mine)
    task_s = [t[u.stage] * (fwd_fraction if u.kind == "F" else 1.0 - fwd_fraction)
              for u in order]
    for u, w in zip(order, prefetch_stalls(order, res, task_s, fetch)):
      (fwd if u.kind == "F" else bwd)[u.stage, u.microbatch] += w
  return fwd, bwd


def _task_workspaces(base: CostTables, tables: CostTables, quads) -> list[float]:
  """Per stage, the bytes its forward or backward writes besides the residuals it keeps and
  the state (the larger of the memory model's two task workspaces,
  :func:`~harpjax.compiler.plan.variants.memory_model`, at the stage's ZeRO level and
  offload); ``0`` where the tables do not carry the workspace (then a group is charged every
  stage's fixed bytes whole)."""
  if base.variants is not None:   # expanded before: the workspace arrays are gone
    return [0.0] * len(quads)
  models: dict[tuple, object] = {}
  out = []
  for i, j, k, s in quads:
    zero, offload, _ = variants_lib.variant_of(tables, k, s)
    b = variants_lib.base_index(tables, k, s)
    key = (k, zero, offload)
    if key not in models:
      P = base.param_mem_bytes[k]
      if base.logical_mesh is not None:
        dp = base.logical_mesh[k][..., 0].astype(np.float64)
      else:
        dp = np.broadcast_to(np.array([n * m for n, m in base.submeshes[k]], np.float64),
                             P.shape)
      models[key] = variants_lib.memory_model(base, k, dp, zero, offload)
    model = models[key]
    if model is None:
      out.append(0.0)
      continue
    w = np.maximum(model.fwd_workspace_bytes, model.bwd_workspace_bytes)
    out.append(float(np.broadcast_to(w, base.param_mem_bytes[k].shape)[i, j, b]))
  return out


def _per_group(planned: Sequence[PlannedStage], group) -> list[PlannedStage]:
  """One entry per device group (its first stage, with the group's summed time): what the
  hourly rate and Eq. 20 count. The stages themselves without groups."""
  if not group:
    return list(planned)
  out = []
  for x, st in enumerate(planned):
    if group[x] == x:
      total = sum(p.time_s for y, p in enumerate(planned) if group[y] == x)
      out.append(dataclasses.replace(st, time_s=total))
  return out


def simulated_time(t: Sequence[float], c: Sequence[float], schedule: str | ScheduleKind,
                   B: int, warmups: Sequence[int], fwd_fraction: float,
                   ends: Sequence[float], stalls=None) -> float:
  """The simulator's iteration time of a pipeline under a registered schedule at the counts
  ``warmups``: stage ``i`` runs forward ``fwd_fraction t_i`` and backward the rest, cut ``i``
  takes ``c_i`` each way (``c`` ends with the last stage's 0), then its end time ``ends[i]``.
  The plan evaluators (:func:`evaluate_plan`, :func:`~harpjax.compiler.plan.evaluate_mixed`)
  both call it. ``stalls``: ``(fwd, bwd)`` ``[S, B]`` seconds tasks wait besides (parameter
  prefetches), added to their durations."""
  fwd = [x * fwd_fraction for x in t]
  bwd = [x - f for x, f in zip(t, fwd)]
  if stalls is not None:
    fwd = np.asarray(fwd)[:, None] + stalls[0]
    bwd = np.asarray(bwd)[:, None] + stalls[1]
  sched = schedule_kind(schedule).schedule(len(t), B, warmups)
  return float(simulate(fwd, bwd, list(c[:-1]), sched, end_cost=list(ends)).iteration_time)


# --------------------------------------------------------------------------- infeasibility


def infeasible_error(tables: CostTables, B: int, eps: float, use_all_devices: bool = True,
                     keep_order: bool = True, link_bound: bool = False) -> InfeasiblePlanError:
  """Says which constraint makes every plan infeasible, and by how much (``link_bound``:
  plans with a cut slower than their slowest stage were allowed)."""
  constraint, msg = _diagnose(tables, B, eps, use_all_devices, keep_order, link_bound)
  if constraint == "memory" and tables.variants is None and tables.opt_mem_bytes is None:
    msg += (". The planner can shard each stage's training state over its data-parallel "
            "devices (ZeRO) when the tables carry the optimizer state's bytes: "
            "ProfileOptions(optimizer_bytes_per_param=12.0), harpjax plan --zero, or "
            "CostTables.from_layer_costs(..., optimizer_share=0.75)")
  err = InfeasiblePlanError(f"no pipeline plan for {tables.describe()} with B={B}: {msg}")
  err.constraint = constraint
  return err


def _diagnose(tables: CostTables, B: int, eps: float, use_all: bool,
              keep_order: bool, link_bound: bool = False) -> tuple[str, str]:
  L, K = tables.num_layers, tables.num_subclusters
  gib = 2.0 ** 30
  if use_all and L < K:
    return "layers", (f"every subcluster needs at least one stage (all devices are used), but "
                      f"there are {L} layers for {K} subclusters")
  build = lambda scale=1.0: SparseIndex.build(tables, scale, use_all_devices=use_all,
                                              keep_order=keep_order, link_bound=link_bound)
  index = build()
  empty = [k for k in range(K) if not (index.ent_k == k).any()]
  # With resource choice a subcluster that holds no stage is simply left out.
  for k in (empty if use_all or len(empty) == K else []):
    best = (math.inf, None)
    for s in range(len(tables.submeshes[k])):
      fp = tables.param_mem_bytes[k][:, :, s] + tables.act_mem_bytes[k][:, :, s]
      if tables.step_mem_bytes is not None:   # the reduction and the update
        fp = np.maximum(fp, tables.step_mem_bytes[k][:, :, s])
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
  free = build(math.inf)
  top = float(free.candidates[-1])
  if not math.isfinite(free.run(top, B, eps, require_hit=False)[0]):
    value, path = free.run(top, B, eps, require_hit=False, check_comm=False)
    if not math.isfinite(value):
      what = (f"use all {tables.total_devices} devices" if use_all else "fit the devices")
      order = (f" in subcluster order {list(tables.subcluster_names)}" if keep_order else "")
      return "devices", (f"the {L} layers cannot be cut into stages that {what}{order} with "
                         "finite stage times")
    quads = [free.entry(e) for e in path]
    ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
    x = int(np.argmax([s.comm_s for s in ev.stages]))
    st = ev.stages[x]
    return "communication", (
        f"every plan has a cut slower than its bottleneck stage (H-1F1B needs C(j) <= t_max). "
        f"The best plan without that rule cuts after layer {st.layers[1]} "
        f"({tables.boundary_bytes[st.layers[1]]:.4g} bytes) in {st.comm_s:.6g} s while its "
        f"t_max is {ev.t_max_s:.6g} s: {st.comm_s / ev.t_max_s:.3f}x too slow")
  def fits(scale):
    idx = build(scale)
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
  quads = [idx.entry(e) for e in path]
  ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
  worst = max(ev.stages, key=lambda s: s.peak_mem_bytes / s.device_memory_bytes)
  return "memory", (
      f"no plan fits device memory with the H-1F1B warm-ups of its own bottleneck; the plans "
      f"that come closest need {hi:.4f}x the device memory: e.g. layers "
      f"{worst.layers[0]}..{worst.layers[1]} on {worst.subcluster_name} {worst.submesh} with "
      f"{worst.inflight} microbatches in flight need {worst.peak_mem_bytes / gib:.3f} GiB, "
      f"{(worst.peak_mem_bytes - worst.device_memory_bytes) / gib:.3f} GiB more than the "
      f"{worst.device_memory_bytes / gib:.3f} GiB device")
