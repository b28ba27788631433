"""The schedule a plan runs: the planner ranks the registered schedules on the stages it found.

The search (:func:`~harpjax.compiler.plan.solve`) finds the stages for H-1F1B's warm-ups: the
DP tracks those counts for its memory check (Eq. 17-18) and ranks plans by H-1F1B's
simulated time. On the stages it returns, another schedule can be faster: Eager-1F1B's
``2 (S - 1 - i) + 1`` warm-ups hide a cut that H-1F1B's ``eps`` tolerance leaves exposed, and
1F1B holds fewer microbatches. :func:`choose_schedule` scores every schedule the registry
marks :attr:`~harpjax.compiler.schedule.ScheduleKind.ranked` (1F1B, Eager-1F1B, H-1F1B and
any a user registers so) on those stages with the simulator, keeps the fastest whose
microbatches in flight fit every stage's memory (ties: the search's own H-1F1B), and records
it in :attr:`Plan.schedule <harpjax.compiler.plan.Plan.schedule>` with its warm-ups and
predicted time. ``SolveOptions(schedule=...)`` pins one instead.

A scorer reads one plan under one schedule: :func:`plan_scorer` for plans without groups
(:func:`~harpjax.compiler.plan.evaluate_plan`); :mod:`~harpjax.compiler.plan.mixed` passes
its own for plans with mixed-type stages.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, NamedTuple

from harpjax.compiler.plan.evaluate import evaluate_plan, PlannedStage
from harpjax.compiler.plan.spec import Plan
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import ranked_schedules, schedule_kind, ScheduleKind
from harpjax.errors import InfeasiblePlanError

__all__ = ["RANK", "ScheduleScore", "Scorer", "choose_schedule", "plan_scorer",
           "schedule_scores"]

log = logging.getLogger(__name__)

RANK = "rank"
"""``SolveOptions(schedule=RANK)``: the planner ranks the registered schedules (the default)."""


class ScheduleScore(NamedTuple):
  """One plan under one schedule.

  Attributes:
    schedule: the schedule's registered name.
    iteration_s: the simulator's seconds per iteration.
    fits: every stage's parameters, ``inflight`` microbatches' residuals and update fit its
      devices' memory.
    warmups: ``[S]`` the schedule's warm-up counts.
    stages: ``[S]`` :class:`~harpjax.compiler.plan.PlannedStage` under it (warm-up, in
      flight, peak memory).
    violations: what does not fit.
  """
  schedule: str
  iteration_s: float
  fits: bool
  warmups: tuple[int, ...]
  stages: tuple[PlannedStage, ...]
  violations: tuple[str, ...] = ()


Scorer = Callable[[Plan, ScheduleKind], ScheduleScore]
"""``score(plan, kind)``: the plan under the schedule ``kind``."""


def plan_scorer(tables: CostTables, num_microbatches: int, eps: float,
                fwd_fraction: float) -> Scorer:
  """Scores a plan without mixed-type stages with
  :func:`~harpjax.compiler.plan.evaluate_plan` on ``tables`` (the simulator's time)."""
  def score(plan: Plan, kind: ScheduleKind) -> ScheduleScore:
    ev = evaluate_plan(tables, plan, num_microbatches, kind, eps=eps, simulator=True,
                       fwd_fraction=fwd_fraction)
    return ScheduleScore(ev.schedule, ev.iteration_s, ev.mem_ok, ev.warmups, ev.stages,
                         ev.violations)
  return score


def schedule_scores(plan: Plan, score: Scorer, kinds=None) -> tuple[ScheduleScore, ...]:
  """The plan under each of ``kinds`` (default: the ranked ones), in registry order."""
  kinds = ranked_schedules() if kinds is None else tuple(schedule_kind(k) for k in kinds)
  return tuple(score(plan, k) for k in kinds)


def choose_schedule(result: Any, score: Scorer, options: Any) -> Any:
  """The planner's result under the schedule it should run.

  ``options.schedule == "rank"``: the search's own schedule (H-1F1B, whose numbers the result
  holds) and every other ranked one scored on the same stages; the fastest that fits memory
  kept (strictly faster only). A registered name: that schedule (an error if its
  microbatches in flight do not fit).

  Args:
    result: a :class:`~harpjax.compiler.plan.PlanResult` of the search.
    score: how to score its plan under a schedule (:func:`plan_scorer`).
    options: the :class:`~harpjax.compiler.plan.SolveOptions` (``schedule``, ``cost_model``,
      ``objective``, ``time_limit_s``).

  Returns:
    The result with the chosen schedule: ``plan.schedule``, the stages' warm-ups,
    ``plan.predicted_iteration_s``, ``iteration_s``, ``warmups``, ``stages`` and (ranked by
    the simulator) ``objective_s`` and ``cost_per_iteration``.

  Raises:
    InfeasiblePlanError: the pinned schedule does not fit memory on the stages found
      (``constraint="memory"``), or makes the iteration longer than ``time_limit_s``
      (``constraint="time"``).
  """
  plan = result.plan
  own = schedule_kind(plan.schedule)
  if options.schedule == RANK:
    kinds = ranked_schedules()
  else:
    kinds = (schedule_kind(options.schedule),)
  best = None
  if own in kinds:   # the search's numbers, memory checked by the search
    best = ScheduleScore(own.name, result.iteration_s, True, tuple(result.warmups),
                         tuple(result.stages))
  scores = [best] if best is not None else []
  for kind in kinds:
    if kind is own:
      continue
    sc = score(plan, kind)
    scores.append(sc)
    if sc.fits and (best is None or sc.iteration_s < best.iteration_s) and \
        _keeps_budget(result, sc, options):
      best = sc
  log.info("planner: schedules on the chosen stages: %s", ", ".join(
      f"{sc.schedule} {sc.iteration_s:.6g} s" + ("" if sc.fits else " (does not fit)")
      for sc in scores))
  if best is None:
    sc = scores[0]
    err = InfeasiblePlanError(
        f"schedule {sc.schedule!r} does not fit on the stages the planner found: "
        f"{'; '.join(sc.violations)}. Let the planner choose the schedule "
        "(SolveOptions(schedule='rank')) or pin one with fewer microbatches in flight")
    err.constraint = "memory"
    raise err
  if (options.objective == "min_cost_within_time" and options.cost_model == "simulator"
      and best.iteration_s > options.time_limit_s):
    err = InfeasiblePlanError(
        f"schedule {best.schedule!r} takes {best.iteration_s:.6g} s per iteration on the stages "
        f"the planner found, more than time_limit_s={options.time_limit_s:.6g} s: let the "
        "planner choose the schedule (SolveOptions(schedule='rank')) or raise the limit")
    err.constraint = "time"
    raise err
  if best.schedule == own.name:
    return result
  log.info("planner: %s is faster than %s on these stages: %.6g s against %.6g s",
           best.schedule, own.name, best.iteration_s, result.iteration_s)
  return with_schedule(result, best, options)


def _keeps_budget(result: Any, sc: ScheduleScore, options: Any) -> bool:
  """Whether the result under schedule ``sc`` keeps ``options.budget_per_hour`` with its
  transfer fees: a faster iteration pays the same fees in less time, so its hourly rate with
  them is higher (without fees, or ranked by Eq. 12, the schedule leaves the rate as it is)."""
  fees = getattr(result, "fees_per_iteration", 0.0)
  if options.budget_per_hour is None or not fees or options.cost_model != "simulator":
    return True
  rate = result.rate_per_hour + 3600.0 * fees / sc.iteration_s
  return rate <= options.budget_per_hour * (1.0 + 1e-12)


def with_schedule(result: Any, sc: ScheduleScore, options: Any) -> Any:
  """The result, its plan and its numbers under the scored schedule ``sc``."""
  objective = sc.iteration_s if options.cost_model == "simulator" else result.objective_s
  rate = result.rate_per_hour
  cost = (None if rate is None
          else rate * objective / 3600.0 + getattr(result, "fees_per_iteration", 0.0))
  meta = dict(result.plan.meta)
  if "cost_per_iteration" in meta:
    meta["cost_per_iteration"] = cost
  stages = tuple(dataclasses.replace(spec, warmup=int(w))
                 for spec, w in zip(result.plan.stages, sc.warmups))
  plan = result.plan.replace(stages=stages, schedule=sc.schedule,
                             predicted_iteration_s=sc.iteration_s, meta=meta)
  return dataclasses.replace(result, plan=plan, objective_s=objective, stages=sc.stages,
                             warmups=sc.warmups, iteration_s=sc.iteration_s,
                             cost_per_iteration=cost)
