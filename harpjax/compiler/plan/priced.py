"""The planner's result with transfer fees: its money counted with them, its budget kept.

The search (:func:`~harpjax.compiler.plan.solve`) prices a plan by its GPUs: the DP's rate
criterion is ``sum devices x price``, and a budget per hour bounds that. Transfer fees
(:mod:`~harpjax.compiler.profile.fees`) add ``3600 fee / T`` to the hourly rate of a plan whose
cuts cross zones or regions. :func:`solve_with_fees` runs the search and then holds its result
to the rate *with* fees: when the plan found exceeds ``budget_per_hour`` once its fees count,
it searches again with the GPUs' budget lowered by the plan's fee rate, until the plan found
fits (or no plan does). Each round's budget is lower than the last, so the rounds end; the
plan returned satisfies the budget with fees, and its :class:`FeeResult` says what it costs
with and without them.

This is exact for what it reports, not for what it ranks: a plan that pays fees can still be
ranked above a fee-free one that would be better with its fees counted, and the lowered
budget may exclude a plan whose own fees were smaller. The exact search carries the fees in
the DP's state (docs/cost_model.md, "Transfer fees": a third additive criterion beside the
time and the rate).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from harpjax.compiler.plan.evaluate import PlanEvaluation, evaluate_plan
from harpjax.compiler.plan.solve import PlanResult, SolveOptions, solve
from harpjax.compiler.profile import CostTables
from harpjax.errors import InfeasiblePlanError, PlanError

__all__ = ["FeeResult", "solve_with_fees", "plan_fees"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FeeResult:
  """The planner's result and its evaluation with transfer fees.

  Attributes:
    result: what :func:`~harpjax.compiler.plan.solve` returned in the last round.
    evaluation: the plan scored with its fees (:func:`~harpjax.compiler.plan.evaluate_plan`;
      ``None``: a plan with mixed-type stages on tables without fees, see :func:`plan_fees`).
    rounds: searches run (``1``: the first plan kept the budget with its fees).
    gpu_budget_per_hour: the budget of the GPUs alone in the last round (``None``: none).
  """
  result: PlanResult
  evaluation: PlanEvaluation | None
  rounds: int = 1
  gpu_budget_per_hour: float | None = None

  @property
  def fees_per_iteration(self) -> float:
    return 0.0 if self.evaluation is None else self.evaluation.fees_per_iteration

  @property
  def cost_per_iteration(self) -> float | None:
    """Money per iteration, fees included."""
    ev = self.evaluation
    return self.result.cost_per_iteration if ev is None else ev.cost_per_iteration

  @property
  def rate_with_fees_per_hour(self) -> float | None:
    ev = self.evaluation
    return self.result.rate_per_hour if ev is None else ev.rate_with_fees_per_hour


def plan_fees(tables: CostTables, result: PlanResult) -> PlanEvaluation | None:
  """The planner's result scored with its transfer fees on ``tables`` (``None`` for a plan
  with mixed-type stages on tables that charge no fee: its own result says its cost).

  Raises:
    PlanError: a mixed-type stage in a plan whose tables charge fees (its groups' transfers
      are not counted: :func:`~harpjax.compiler.profile.group_sync_transfer` gives their
      bytes, which :func:`~harpjax.compiler.plan.evaluate_mixed` does not yet add).
  """
  plan = result.plan
  if any(s.groups for s in plan.stages):
    if tables.fees is not None and tables.fees.charges:
      raise PlanError("the plan has mixed-type stages, whose groups' transfers between zones "
                      "are not yet counted in its fees; plan without mixed stages "
                      "(mixed_stages=None) where the cluster charges transfer fees")
    return None
  return evaluate_plan(tables, list(result.stages), result.num_microbatches, plan.schedule,
                       eps=result.eps)


_PER_SUBCLUSTER = ("subcluster_names", "num_hosts", "devices_per_host", "device_memory_bytes",
                   "submeshes", "stage_time_s", "param_mem_bytes", "act_mem_bytes",
                   "intra_bandwidth_bytes_per_s", "intra_latency_s", "logical_mesh",
                   "peak_flops", "price_per_gpu_hour", "end_time_s", "opt_mem_bytes",
                   "gather_time_s", "sync_time_s", "workspace_bytes", "step_mem_bytes",
                   "remat_modes", "grad_out_bytes", "offload_bandwidth_bytes_per_s", "variants",
                   "host_bandwidth_bytes_per_s", "host_latency_s")


def zone_tables(tables: CostTables, zone: str) -> CostTables | None:
  """The tables of the subclusters in ``zone`` alone, in the tables' order, with their links
  (``None`` if none is there): every plan on them pays no transfer fee."""
  fees = tables.fees
  ks = [k for k, n in enumerate(tables.subcluster_names) if fees.zone_of(n) == zone]
  if not ks:
    return None
  pick = {f: None if getattr(tables, f) is None else tuple(getattr(tables, f)[k] for k in ks)
          for f in _PER_SUBCLUSTER}
  bw = tuple(tuple(tables.link_bandwidth_bytes_per_s[a][b] for b in ks) for a in ks)
  lat = tuple(tuple(tables.link_latency_s[a][b] for b in ks) for a in ks)
  return tables.replace(inter_bandwidth_bytes_per_s=(), inter_latency_s=(),
                        link_bandwidth_bytes_per_s=bw, link_latency_s=lat, **pick)


def _ranked(opts: SolveOptions, ev: PlanEvaluation) -> float:
  """What the objective ranks, with fees: the iteration time, or the money per iteration."""
  from harpjax.compiler.plan.solve import objective_of
  goal = objective_of(opts.objective)
  if goal.priced and opts.objective != "min_time_within_budget":
    return ev.cost_per_iteration
  return ev.iteration_s


def _keeps(opts: SolveOptions, ev: PlanEvaluation) -> bool:
  if opts.budget_per_hour is not None and not (
      ev.rate_with_fees_per_hour <= opts.budget_per_hour * (1 + 1e-12)):
    return False
  return opts.time_limit_s is None or ev.iteration_s <= opts.time_limit_s * (1 + 1e-12)


def solve_with_fees(tables: CostTables, num_microbatches: int, *,
                    options: SolveOptions | None = None, max_rounds: int = 8,
                    **overrides) -> FeeResult:
  """:func:`~harpjax.compiler.plan.solve`, its result scored and held to its budget with
  transfer fees.

  Candidates: the search on all the tables, again with the GPUs' budget lowered while its
  plan exceeds the budget with fees (by the plan's fee rate, and below its GPUs' rate, so
  each round excludes the last plan), and, where the subclusters sit in several zones, the
  search on each zone's subclusters alone (fee-free plans). The best candidate by the
  objective with fees (iteration seconds, or money per iteration with fees) that keeps the
  budget with fees and the time limit is returned.

  Args:
    tables: cost tables with :attr:`~harpjax.compiler.profile.CostTables.fees` (without
      them this is :func:`solve` and its evaluation).
    num_microbatches: ``B``.
    options, overrides: as :func:`solve`'s; ``budget_per_hour`` bounds the rate with fees.
    max_rounds: searches on all the tables at most.

  Returns:
    The :class:`FeeResult`.

  Raises:
    InfeasiblePlanError: no candidate keeps the budget with its fees.
  """
  opts = dataclasses.replace(options or SolveOptions(), **overrides)
  B = num_microbatches
  first = solve(tables, B, options=opts)
  ev = plan_fees(tables, first)
  if ev is None or tables.fees is None or not tables.fees.charges:
    return FeeResult(first, ev, 1, opts.budget_per_hour)
  found = [(first, ev, 1, opts.budget_per_hour)]
  budget, rounds, result = opts.budget_per_hour, 1, first
  while budget is not None and not _keeps(opts, ev) and rounds < max_rounds:
    fee_rate = ev.rate_with_fees_per_hour - ev.rate_per_hour
    lower = min(budget - fee_rate, ev.rate_per_hour * (1 - 1e-9))
    if not lower > 0:
      break
    log.info("planner: the plan's rate with fees %.6g exceeds the budget %.6g; searching "
             "again within %.6g for the GPUs", ev.rate_with_fees_per_hour, budget, lower)
    rounds += 1
    try:
      result = solve(tables, B, options=dataclasses.replace(opts, budget_per_hour=lower))
    except InfeasiblePlanError:
      break
    ev = plan_fees(tables, result)
    found.append((result, ev, rounds, lower))
  zones = sorted({z for _, z, _ in tables.fees.places
                  if z is not None and z in {tables.fees.zone_of(n)
                                             for n in tables.subcluster_names}})
  for zone in zones if len(zones) > 1 else ():
    sub = zone_tables(tables, zone)
    try:
      alone = solve(sub, B, options=opts)
    except (InfeasiblePlanError, PlanError):
      continue
    zev = plan_fees(sub, alone)
    if zev is not None:
      found.append((alone, zev, rounds, opts.budget_per_hour))
  keep = [f for f in found if _keeps(opts, f[1])]
  if not keep:
    raise InfeasiblePlanError(
        f"no plan keeps the budget of {budget:g} per hour with its transfer fees: the plan "
        f"found costs {first.rate_per_hour:.6g} per hour for its GPUs and "
        f"{found[0][1].rate_with_fees_per_hour:.6g} with {found[0][1].fees_per_iteration:.6g} "
        f"of fees per iteration, and no plan inside one zone keeps it; raise the budget")
  best = min(keep, key=lambda f: _ranked(opts, f[1]))
  return FeeResult(best[0], best[1], best[2], best[3])
