"""Warm-up counts: how many forwards each stage launches before its first backward.

Every 1F1B-style schedule is its per-stage warm-up counts ``N_i`` (see
:mod:`harpjax.compiler.schedule.tasks`). H-1F1B's (HARP Eq. 1-2) grow by :func:`warmup_delta`
per cut, with the communication cost of the cut relative to ``t_max``; :func:`h1f1b_counts`
is that recurrence, written once (the plan evaluators, the planner and the simulator call it).
A warm-up *rule* reads a :class:`PipelineCosts`; each registered schedule
(:mod:`harpjax.compiler.schedule.registry`) has one.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple, Sequence

from harpjax.errors import ScheduleError

log = logging.getLogger(__name__)

__all__ = ["warmup_delta", "h1f1b_warmups", "h1f1b_counts", "pipeline_period",
           "one_f_one_b_warmups", "eager_1f1b_warmups", "gpipe_warmups", "plan_warmups",
           "check_positive", "PipelineCosts", "h1f1b_rule"]


class PipelineCosts(NamedTuple):
  """What a warm-up rule may read about a pipeline (``S`` stages, ``B`` microbatches).

  Attributes:
    num_stages: ``S``.
    num_microbatches: ``B``.
    times_s: ``[S]`` forward+backward seconds per microbatch of each stage ``t_i``, or
      ``None`` when unknown (a hand-written plan).
    comm_s: ``[S - 1]`` seconds of each cut ``c_i`` (with different costs per direction, the
      mean of the two), or ``None`` when unknown.
    eps: the tolerance of :func:`warmup_delta`.
    subclusters: ``[S]`` the subcluster of each stage, or ``None``; a rule may fall back on
      them when the costs are unknown.
  """
  num_stages: int
  num_microbatches: int
  times_s: tuple[float, ...] | None = None
  comm_s: tuple[float, ...] | None = None
  eps: float = 0.1
  subclusters: tuple[str, ...] | None = None

  @property
  def known(self) -> bool:
    """Every stage time and every cut cost is given."""
    return (self.times_s is not None and self.comm_s is not None
            and all(t is not None for t in self.times_s)
            and all(c is not None for c in self.comm_s))


def warmup_delta(comm_cost_s: float, t_max_s: float, eps: float = 0.0) -> int:
  """Extra forward launches of stage ``i`` over stage ``i+1`` (HARP Eq. 10/17).

  The one definition of the increment: the schedules, the planner's DP kernel (which compiles
  this function with Numba) and its NumPy twin all call it, so the plan's memory check and the
  runtime's schedule agree to the last floating-point step. Plain arithmetic only; the caller
  checks its inputs (:func:`h1f1b_warmups` does).

  ``delta = ceil(2 c / t_max - eps) + 1``, at least 1. With ``eps = 0`` this is the bound of
  Eq. 10, ``ceil(1 + 2c / t_max)``, which makes the steady phase bubble-free whenever
  ``c <= t_max``. ``eps`` is a tolerance on ``2 c / t_max``: communication below
  ``eps * t_max / 2`` is not worth an extra in-flight microbatch (Eq. 2 uses the threshold
  ``c <= eps * t_max`` for the same purpose; ours is Eq. 17's form, used by the planner too, so
  that the plan's memory check and the runtime's schedule agree).

  Args:
    comm_cost_s: per-microbatch transfer time between the two stages, seconds.
    t_max_s: the bottleneck stage's forward+backward time per microbatch, seconds.
    eps: tolerance, dimensionless, ``>= 0``.

  Returns:
    The integer ``delta_i >= 1``.
  """
  if comm_cost_s <= 0.0:
    return 1
  # Guard against 2c/t_max landing a hair above an integer through rounding.
  delta = int(math.ceil((2.0 * comm_cost_s / t_max_s - eps) - 1e-12)) + 1
  return delta if delta > 1 else 1


def h1f1b_warmups(comm_costs: Sequence[float], t_max: float, eps: float = 0.1) -> tuple[int, ...]:
  """H-1F1B warm-up counts (HARP Eq. 1 with the delta of :func:`warmup_delta`).

  The deltas are taken relative to the pipeline's period ``P = max(t_max, max_i c_i)``: the
  bottleneck stage's time, or, when a cut is slower than every stage (a *link-bound*
  pipeline, beyond the paper's ``c <= t_max``), that cut's transfer time, since a link sends
  one microbatch per direction at a time. While every ``c_i <= t_max`` this is Eq. 1 as
  written. Beyond, ``warmup_delta(c_i, t_max)`` would keep growing with ``c_i / t_max`` without
  making the pipeline faster than one microbatch per ``P``; relative to ``P`` each delta is at
  most 3 and every cut is again hidden at that period (the K-block round trip ``t_i + t_{i+1}
  + 2 c_i <= (delta_i + 1) P`` with ``eps = 0``).

  Args:
    comm_costs: ``[num_stages - 1]`` seconds, ``c_i`` between stage ``i`` and ``i + 1``.
    t_max: bottleneck per-microbatch compute time (forward + backward), seconds.
    eps: tolerance of :func:`warmup_delta`; ``0`` gives the exact bubble-free bound.

  Returns:
    ``[num_stages]`` warm-up counts, the last one 1.

  Raises:
    ScheduleError: if a cost is negative or not finite, or ``t_max`` is not positive.

  With different costs per direction (activations ``c_f``, gradients ``c_b``), pass
  ``(c_f + c_b) / 2``: the round trip a warm-up must cover is ``2 t + c_f + c_b``.
  """
  comm = [float(c) for c in comm_costs]
  for i, c in enumerate(comm):
    if not math.isfinite(c) or c < 0:
      raise ScheduleError(f"comm_costs[{i}]={c}: a transfer time is a finite number of "
                          "seconds >= 0")
  if not (math.isfinite(float(t_max)) and t_max > 0):
    raise ScheduleError(f"t_max must be a finite number of seconds > 0, got t_max={t_max}")
  if not eps >= 0:
    raise ScheduleError(f"eps must be >= 0, got eps={eps}")
  period = pipeline_period(comm, t_max)
  if period > t_max:
    log.info("link-bound pipeline: the cut after stage %d takes %.4g s per microbatch, more "
             "than t_max=%.4g s; warm-ups relative to that period", comm.index(period), period,
             t_max)
  return h1f1b_counts(comm, period, eps)


def h1f1b_counts(comm_costs: Sequence[float], period_s: float, eps: float) -> tuple[int, ...]:
  """The H-1F1B recurrence: ``N_{S-1} = 1``, ``N_i = N_{i+1} + warmup_delta(c_i, P, eps)``.

  Plain arithmetic, no checks (:func:`h1f1b_warmups` checks its inputs first): a period that
  is not a positive finite number (a stage without a finite time) gives every ``delta_i = 1``,
  so that a plan the evaluators reject still has counts to report.

  Args:
    comm_costs: ``[S - 1]`` seconds of each cut.
    period_s: the period ``P`` the deltas are relative to (:func:`pipeline_period`).
    eps: tolerance of :func:`warmup_delta`.

  Returns:
    ``[S]`` warm-up counts, the last one 1.
  """
  usable = math.isfinite(period_s) and period_s > 0
  counts = [1]
  for c in reversed(comm_costs):
    counts.append(counts[-1] + (warmup_delta(float(c), period_s, eps) if usable else 1))
  return tuple(reversed(counts))


def pipeline_period(comm_costs: Sequence[float], t_max: float) -> float:
  """The period H-1F1B's warm-ups are computed against: ``max(t_max, max_i c_i)``."""
  return max([float(t_max)] + [float(c) for c in comm_costs])


def one_f_one_b_warmups(num_stages: int) -> tuple[int, ...]:
  """1F1B: stage ``i`` (0-indexed) launches ``S - i`` forwards before its first backward."""
  check_positive("num_stages", num_stages)
  return tuple(num_stages - i for i in range(num_stages))


def eager_1f1b_warmups(num_stages: int) -> tuple[int, ...]:
  """Eager-1F1B: stage ``i`` (0-indexed) launches ``2 (S - 1 - i) + 1`` forwards."""
  check_positive("num_stages", num_stages)
  return tuple(2 * (num_stages - 1 - i) + 1 for i in range(num_stages))


def gpipe_warmups(num_stages: int, num_microbatches: int) -> tuple[int, ...]:
  """GPipe: every stage runs all forwards before any backward."""
  check_positive("num_stages", num_stages)
  check_positive("num_microbatches", num_microbatches)
  return (num_microbatches,) * num_stages


def check_positive(name: str, value: int) -> None:
  """Raises :class:`ScheduleError` unless ``value`` is a positive integer."""
  if int(value) != value or value < 1:
    raise ScheduleError(f"{name} must be a positive integer, got {name}={value!r}")


def plan_warmups(times_s: Sequence[float | None], comms_s: Sequence[float | None],
                 subclusters: Sequence[str], eps: float) -> tuple[int, ...]:
  """H-1F1B warm-up counts of a plan's stages.

  From the stages' times and cut costs when the plan has them all (:func:`h1f1b_warmups` at
  the plan's own ``t_max``); otherwise from its links alone: a cut between two subclusters
  (a slow link) needs one extra in-flight microbatch (``delta = 2``, Eq. 2's middle case), a
  cut inside one none.

  Args:
    times_s: ``[S]`` forward+backward seconds per microbatch of each stage, or ``None``.
    comms_s: ``[S - 1]`` seconds of each cut, or ``None``.
    subclusters: ``[S]`` the subcluster of each stage.
    eps: the tolerance of :func:`warmup_delta`.
  """
  if all(t is not None for t in times_s) and all(c is not None for c in comms_s):
    return h1f1b_warmups(comms_s, max(times_s), eps)
  return _link_counts(subclusters)


def h1f1b_rule(costs: PipelineCosts) -> tuple[int, ...]:
  """H-1F1B's warm-up rule (the one the schedule registry holds).

  :func:`h1f1b_counts` at the pipeline's period ``max(t_max, max_i c_i)`` when every stage
  time and cut cost is known; else from the stages' subclusters alone, as
  :func:`plan_warmups`; else (nothing known: links taken as free) 1F1B's counts.
  """
  if costs.known and costs.times_s:
    comm = [float(c) for c in costs.comm_s]
    return h1f1b_counts(comm, pipeline_period(comm, max(costs.times_s)), costs.eps)
  if costs.subclusters is not None:
    return _link_counts(costs.subclusters)
  return one_f_one_b_warmups(costs.num_stages)


def _link_counts(subclusters: Sequence[str]) -> tuple[int, ...]:
  counts = [1]
  for i in range(len(subclusters) - 2, -1, -1):
    counts.append(counts[-1] + (2 if subclusters[i] != subclusters[i + 1] else 1))
  return tuple(reversed(counts))
