"""Resolving a plan on a cluster: each stage's devices, its warm-up count and the schedule.

A plan names each stage's subcluster and submesh shape; :func:`resolve_devices` gives the
concrete global devices (the plan's own where it lists them, else packed onto the hosts by
:meth:`harpjax.cluster.Cluster.allocate_submeshes`), and :func:`resolve_plan` fills in the
rest of what runs: the warm-up counts of the schedule and the task tables.

Under an interleaved schedule (:func:`~harpjax.compiler.schedule.interleaved_kind`) the
stages of one device group share its devices (stage ``i`` on group ``i mod d``).

A zebra stage's expert group (:attr:`~harpjax.compiler.plan.StageSpec.zebra`) is resolved as
one more group of the stage, listed after the others.

A group of a mixed-type stage (:attr:`~harpjax.compiler.plan.StageSpec.groups`) runs in one
process, so it spans one host: :func:`resolve_plan` runs a group whose submesh spans ``n``
hosts as ``n`` groups of one host each, every one with ``1/n`` of its share
(:func:`per_host_groups`).
"""

from __future__ import annotations

import dataclasses
import math

from harpjax.cluster import Cluster
from harpjax.compiler.plan import check_device_groups, Plan, StageGroup, StageSpec
from harpjax.compiler.schedule import PipelineCosts, Schedule, schedule_kind
from harpjax.errors import HarpjaxError, PlanError

__all__ = ["resolve_devices", "resolve_group_devices", "resolve_plan", "per_host_groups"]


def resolve_devices(cluster: Cluster, plan: Plan) -> list[tuple[int, ...]]:
  """Global device indices of every stage (a stage on several groups: every group's, in
  order): explicit ones checked, the others allocated.

  Raises:
    PlanError: a stage names an unknown subcluster or a device outside it, two stages share a
      device, or the submeshes do not fit.
  """
  return [sum(groups, ()) for groups in resolve_group_devices(cluster, plan)]


def resolve_group_devices(cluster: Cluster, plan: Plan,
                          schedule: str | None = None) -> list[list[tuple[int, ...]]]:
  """Per stage, per group of devices (:attr:`~harpjax.compiler.plan.StageSpec.all_groups`),
  its global device indices; see :func:`resolve_devices`.

  Under an interleaved schedule (``schedule``, default the plan's; ``chunks = v > 1``) the
  stages ``g, g + d, g + 2d, ...`` of device group ``g`` run on the same devices: the group's
  first stage's, explicit or allocated once."""
  kind = schedule_kind(schedule or plan.schedule)
  if kind.chunks > 1:
    check_device_groups(plan.stages, kind.name)
    d = plan.num_stages // kind.chunks
    first = resolve_group_devices(
        cluster, plan.replace(stages=plan.stages[:d], schedule="1f1b", num_layers=None), "1f1b")
    return [first[i % d] for i in range(plan.num_stages)]
  names = [sc.name for sc in cluster.subclusters]
  units = [(i, g, grp) for i, s in enumerate(plan.stages)
           for g, grp in enumerate(s.all_groups + ((s.zebra,) if s.zebra is not None else ()))]
  what = lambda i, g: (f"stage {i} (layers {list(plan.stages[i].layers)})" if g == 0
                       else f"stage {i}'s zebra expert group" if g == len(plan.stages[i].all_groups)
                       else f"stage {i}'s group {g}")
  for i, g, grp in units:
    if grp.subcluster not in names:
      raise PlanError(f"{what(i, g)} uses subcluster {grp.subcluster!r}, which the cluster "
                      f"does not have (it has {', '.join(names)})")
  total = sum(s.num_devices for s in plan.stages)
  if total > cluster.num_devices:
    raise PlanError(f"the plan uses {total} devices but the cluster has {cluster.num_devices}")
  taken: dict[int, str] = {}
  result: dict[tuple[int, int], tuple[int, ...]] = {}
  for i, g, grp in units:
    if grp.devices is None:
      continue
    allowed = set(cluster.devices_of(grp.subcluster))
    for d in grp.devices:
      if d not in allowed:
        raise PlanError(f"{what(i, g)} lists device {d}, which is not in subcluster "
                        f"{grp.subcluster!r} (devices {min(allowed)}..{max(allowed)})")
      if d in taken:
        raise PlanError(f"{taken[d]} and {what(i, g)} both use device {d}; stages need "
                        "disjoint devices")
      taken[d] = what(i, g)
    result[(i, g)] = grp.devices
  todo = [(i, g, grp) for i, g, grp in units if grp.devices is None]
  if todo:
    allocated = cluster.allocate_submeshes([(grp.subcluster, grp.submesh) for _, _, grp in todo])
    for (i, g, _), devs in zip(todo, allocated):
      clash = sorted(set(devs) & set(taken))
      if clash:
        raise PlanError(
            f"{what(i, g)} was allocated devices {list(devs)}, but {taken[clash[0]]} lists "
            f"device {clash[0]} explicitly; give explicit devices for every stage or for none")
      result[(i, g)] = tuple(devs)
  return [[result[(i, g)] for g in range(len(s.all_groups) + (s.zebra is not None))]
          for i, s in enumerate(plan.stages)]


def resolve_plan(plan: Plan, cluster: Cluster, num_layers: int, num_microbatches: int,
                 schedule: str | None = None, eps: float = 0.1) -> tuple[Plan, Schedule]:
  """The plan as it runs: devices, warm-up counts and schedule filled in, and its tables.

  Args:
    plan: a plan (manual, solved or loaded).
    cluster: the cluster it runs on.
    num_layers: layers of the model (the plan's stages must cover them).
    num_microbatches: ``B``.
    schedule: a registered schedule's name; default the plan's.
    eps: the tolerance of the schedule's warm-up rule (H-1F1B's) when the plan does not
      record one (:attr:`~harpjax.compiler.plan.Plan.eps`).

  Returns:
    ``(resolved plan, schedule)``.

  Raises:
    PlanError: the plan does not cover the layers, its devices do not resolve, or the
      schedule is not registered.

  The warm-up counts: a schedule whose counts follow the costs (H-1F1B) keeps the plan's own
  when it is the plan's schedule and the plan records them (what the planner checked memory
  with), else its rule derives them from the stages' times and cuts (or, a hand-written plan
  without them, their subclusters); any other schedule has its fixed counts.
  """
  if plan.stages[-1].layers[1] != num_layers - 1:
    raise PlanError(
        f"the plan's stages cover layers 0..{plan.stages[-1].layers[1]} but the model has "
        f"{num_layers} layers (0..{num_layers - 1}). Adjust the layer ranges or the "
        "mark_layer_boundary calls")
  try:
    kind = schedule_kind(schedule or plan.schedule)
  except HarpjaxError as e:
    raise PlanError(f"schedule={schedule or plan.schedule!r}: {e}") from None
  devices = resolve_group_devices(cluster, plan, kind.name)
  S = plan.num_stages
  warmups = None
  if kind.uses_costs:
    own = schedule_kind(plan.schedule) is kind
    warmups = plan.warmups if own else None
    if warmups is None:
      eps = plan.eps if plan.eps is not None else eps
      warmups = kind.warmups(PipelineCosts(
          S, num_microbatches, tuple(s.time_s for s in plan.stages),
          tuple(s.comm_s for s in plan.stages[:-1]), eps,
          tuple(s.subcluster for s in plan.stages)))
  sched = kind.schedule(S, num_microbatches, warmups)
  name = kind.name
  stages = tuple(
      dataclasses.replace(s, devices=tuple(idx[0]), warmup=w,
                          groups=tuple(dataclasses.replace(grp, devices=tuple(d))
                                       for grp, d in zip(s.groups, idx[1:])),
                          zebra=(dataclasses.replace(s.zebra, devices=tuple(idx[-1]))
                                 if s.zebra is not None else None))
      for s, idx, w in zip(plan.stages, devices, sched.warmups))
  stages = tuple(per_host_groups(s, cluster) if s.groups else s for s in stages)
  return plan.replace(stages=stages, num_microbatches=num_microbatches, schedule=name,
                      num_layers=num_layers), sched


def per_host_groups(stage: StageSpec, cluster: Cluster) -> StageSpec:
  """A mixed-type stage (its devices resolved) whose every group spans one host: a group on
  a submesh ``(n, m)`` over ``n`` hosts becomes ``n`` groups ``(1, m)``, one per host in the
  group's device order, each with logical mesh ``(dp / n, tp)`` and ``1/n`` of its share (all
  shares scaled by the same integer, so the rows stay proportional). The arithmetic is the
  same (every row is still computed once, the gradients summed); each group can then run in
  a process of its own (:mod:`harpjax.runtime.group_worker`). A group whose tensor-parallel
  degree does not divide its devices per host stays whole.
  """
  groups = stage.all_groups
  parts, scale = [], 1
  for grp in groups:
    hosts: dict[str, list[int]] = {}
    for d in grp.devices:
      hosts.setdefault(cluster.host_of_device(d).name, []).append(int(d))
    n, m = len(hosts), grp.num_devices // len(hosts)
    tp = grp.logical_mesh[1]
    if n == 1 or any(len(v) != m for v in hosts.values()) or m % tp:
      parts.append([grp])
      continue
    parts.append([StageGroup(grp.subcluster, (1, m), (m // tp, tp), tuple(v), grp.share,
                             grp.time_s) for v in hosts.values()])
    scale = scale * n // math.gcd(scale, n)
  if all(len(p) == 1 for p in parts):
    return stage
  flat = [dataclasses.replace(g, share=g.share * scale // len(p)) for p in parts for g in p]
  home, rest = flat[0], tuple(flat[1:])
  return dataclasses.replace(stage, submesh=home.submesh, logical_mesh=home.logical_mesh,
                             devices=home.devices, share=home.share, groups=rest)
