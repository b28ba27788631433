"""Interleaving as a plan transformation: the planner's "simpler first step" toward Zorse's
interleaved ministages (docs/schedules.md, "Interleaved 1F1B").

For a plan of ``d`` stages (what :func:`~harpjax.compiler.plan.solve` finds), :func:`interleave`
re-cuts it into ``v d`` chunks: device group ``g`` keeps stage ``g``'s devices and layers, cut
into ``v`` chunks as evenly as layers allow, and chunk ``c`` of group ``g`` becomes pipeline
stage ``c d + g`` (the interleaved schedule's numbering). So a group computes what its stage
did, but the pipeline's fill and drain shrink by about ``v``; with parameter offload
(:attr:`~harpjax.compiler.plan.StageSpec.offload_params`, on every chunk) a group holds at most
two chunks' parameters. :func:`choose_interleaving` scores every ``(v, offload)`` with
:func:`~harpjax.compiler.plan.evaluate_plan` and keeps the fastest plan that fits, the plain
plan included; where no plan of ``d`` stages fits, it re-cuts the stages the search finds with
the device memory relaxed, so interleaving with offload is chosen where only it fits.

The transformation keeps the DP's stage ranges: the layers of a group are the ones its stage
had (the chunks of a group are not re-balanced against other groups); the search over groups
of non-consecutive ranges is not built.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from harpjax.compiler.plan.evaluate import evaluate_plan, PlanEvaluation
from harpjax.compiler.plan.solve import solve
from harpjax.compiler.plan.spec import Plan, StageSpec
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import interleaved_kind
from harpjax.errors import HarpjaxError, InfeasiblePlanError, PlanError

log = logging.getLogger(__name__)

__all__ = ["interleave", "InterleaveChoice", "choose_interleaving", "chunk_sizes"]


def chunk_sizes(num_layers: int, chunks: int) -> tuple[int, ...]:
  """``num_layers`` split into ``chunks`` runs as evenly as possible, the longer first.

  Raises:
    PlanError: fewer layers than chunks.
  """
  if num_layers < chunks:
    raise PlanError(f"{num_layers} layers cannot be cut into {chunks} chunks: use fewer chunks")
  q, r = divmod(num_layers, chunks)
  return tuple(q + (c < r) for c in range(chunks))


def interleave(plan: Plan, chunks: int, offload_params: bool = False) -> Plan:
  """``plan``'s ``d`` stages re-cut into ``chunks * d`` interleaved stages (module docstring).

  Args:
    plan: a plan of plain stages (no mixed-type or zebra stages).
    chunks: ``v``, chunks per device group (``>= 2``).
    offload_params: every chunk keeps its parameters in host memory between its tasks.

  Returns:
    A plan under the schedule ``interleaved_v{chunks}`` (``interleaved`` for 2), its stages
    without warm-ups or times (the schedule derives the former, :func:`evaluate_plan` the
    latter).

  Raises:
    PlanError: a stage has fewer layers than ``chunks``, or is not a plain stage.
  """
  if chunks < 2:
    raise PlanError(f"chunks={chunks}: interleaving needs at least 2 chunks per device group")
  d = plan.num_stages
  sizes = []
  for g, st in enumerate(plan.stages):
    if st.groups or st.zebra is not None:
      raise PlanError(f"stage {g} is a mixed-type or zebra stage; only plain stages interleave")
    n = st.layers[1] - st.layers[0] + 1
    try:
      sizes.append(chunk_sizes(n, chunks))
    except PlanError:
      raise PlanError(f"stage {g} has {n} layers, fewer than {chunks} chunks: use fewer "
                      "chunks") from None
  stages, first = [], 0
  for c in range(chunks):
    for g, st in enumerate(plan.stages):
      n = sizes[g][c]
      stages.append(dataclasses.replace(st, layers=(first, first + n - 1), warmup=None,
                                        time_s=None, comm_s=None, devices=st.devices,
                                        offload_params=offload_params))
      first += n
  kind = interleaved_kind(chunks)
  return dataclasses.replace(plan, stages=tuple(stages), schedule=kind.name, t_max_s=None,
                             predicted_iteration_s=None, eta=None)


@dataclasses.dataclass(frozen=True)
class InterleaveChoice:
  """What :func:`choose_interleaving` found.

  Attributes:
    plan: the chosen plan (the plain plan, or an interleaved one), with its predicted times.
    evaluation: its :class:`PlanEvaluation`.
    chunks: ``v`` of the chosen plan (``1``: not interleaved).
    offload_params: whether its chunks keep their parameters in host memory.
    candidates: every ``(chunks, offload_params, iteration_s or None where it does not fit)``
      scored, the plain plan as ``(1, False, ...)`` first.
  """
  plan: Plan
  evaluation: PlanEvaluation
  chunks: int
  offload_params: bool
  candidates: tuple[tuple[int, bool, float | None], ...]


def _fits(e: PlanEvaluation) -> bool:
  return e.mem_ok and e.devices_ok


def _priced(plan: Plan, e: PlanEvaluation) -> Plan:
  stages = tuple(dataclasses.replace(st, time_s=p.time_s, comm_s=p.comm_s)
                 for st, p in zip(plan.stages, e.stages))
  return dataclasses.replace(plan, stages=stages, t_max_s=e.t_max_s,
                             predicted_iteration_s=e.iteration_s, eta=e.eta)


def choose_interleaving(tables: CostTables, num_microbatches: int, *,
                        chunks: Sequence[int] = (2, 3, 4),
                        offload_params: Sequence[bool] = (False, True),
                        relax_memory: float | Sequence[float] = 8.0,
                        **solve_options) -> InterleaveChoice:
  """The fastest of a searched plan and its interleaved re-cuts that fits.

  Args:
    tables: the cost tables (for parameter offload they need ``opt_mem_bytes`` and
      ``offload_bandwidth_bytes_per_s``).
    num_microbatches: ``B``.
    chunks: the ``v`` to try.
    offload_params: with and/or without parameter offload.
    relax_memory: where no plan fits, the stages are searched on devices this many times
      larger, and only their re-cuts can be chosen; several factors are tried in increasing
      order until a re-cut fits (a small factor keeps the search's ZeRO levels and offloads
      close to what the real devices need).
    **solve_options: passed to :func:`~harpjax.compiler.plan.solve`.

  Returns:
    The :class:`InterleaveChoice`.

  Raises:
    InfeasiblePlanError: no plan fits, plain or interleaved (the plain search's error).
  """
  B = int(num_microbatches)
  factors = sorted(float(f) for f in (
      relax_memory if isinstance(relax_memory, Sequence) else (relax_memory,)))
  try:
    base = solve(tables, B, **solve_options).plan
  except InfeasiblePlanError as e:
    err = None
    for f in factors:
      relaxed = dataclasses.replace(tables, device_memory_bytes=tuple(
          float(x) * f for x in tables.device_memory_bytes))
      try:
        base = solve(relaxed, B, **solve_options).plan
      except InfeasiblePlanError:
        continue
      try:
        return _choose(tables, dataclasses.replace(base, num_microbatches=B), B, chunks,
                       offload_params, plain_fits=False)
      except InfeasiblePlanError as why:
        err = why
    raise (err or e) from None
  return _choose(tables, dataclasses.replace(base, num_microbatches=B), B, chunks,
                 offload_params, plain_fits=True)


def _choose(tables: CostTables, base: Plan, B: int, chunks, offload_params,
            plain_fits: bool) -> InterleaveChoice:
  """The fastest of ``base`` (where ``plain_fits``) and its re-cuts that fits."""
  best = None
  candidates = []
  if plain_fits:
    e = evaluate_plan(tables, base, B)
    best = (e.iteration_s, base, e, 1, False)
    candidates.append((1, False, e.iteration_s))
  else:
    candidates.append((1, False, None))
  for v in chunks:
    for off in offload_params:
      try:
        plan = interleave(base, v, off)
        e = evaluate_plan(tables, plan, B)
      except HarpjaxError as why:   # a stage too short, or a schedule that deadlocks
        log.info("no interleaving with v=%d%s: %s", v, " and offload" if off else "", why)
        candidates.append((v, off, None))
        continue
      ok = _fits(e)
      candidates.append((v, off, e.iteration_s if ok else None))
      if ok and (best is None or e.iteration_s < best[0]):
        best = (e.iteration_s, plan, e, v, off)
  if best is None:
    raise InfeasiblePlanError(
        f"no plan for {tables.describe()} with B={B} fits, plain or re-cut into "
        f"{list(chunks)} chunks per device group with parameter offload "
        f"{list(offload_params)}: {candidates}")
  _, plan, e, v, off = best
  log.info("interleaving: chose v=%d%s (%.4g s); candidates %s", v,
           " with parameter offload" if off else "", e.iteration_s, candidates)
  return InterleaveChoice(_priced(plan, e), e, v, off, tuple(candidates))
