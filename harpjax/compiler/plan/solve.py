"""HARP's inter-op planner: the DP of Eq. 13-19 over every candidate ``t_max`` (§5.2).

:func:`solve` takes :class:`~harpjax.compiler.profile.CostTables` and the number of
microbatches ``B`` and returns the plan minimising Eq. 12,
``sum_i (t_i + 2 c_i) + (B - 1) max_i t_i``, over plans that place stages in subcluster order,
use every device, keep each stage's submesh inside one subcluster (packed onto its hosts,
:func:`~harpjax.compiler.plan.index.device_states`), satisfy ``C(j) <= t_max``
and fit memory with the H-1F1B warm-up counts their own bottleneck implies
(``mem_p + min(N_i, B) mem_a <= mem_device``). The DP for one candidate lives in
:mod:`harpjax.compiler.plan.dp_kernel` (state and exactness argument there).

The search over ``t_max`` (§5.2.4):

1. *Sparse index*: the (range, submesh) entries that fit a device with one microbatch in
   flight, grouped by (subcluster, first layer) and sorted by time; at candidate ``tau`` the
   active entries are a prefix of each group.
2. *Candidates*: the sorted unique stage times. *Binary search* for the smallest ``t_S`` at
   which some plan has every stage within it (feasibility is monotone in ``tau``).
3. *Incumbent*: the exact DP (bottleneck exactly ``tau``) from ``t_S`` up until a plan is
   found, objective ``T``. *Drop* every ``tau > T / B`` (the bottleneck stage alone then
   costs ``B tau > T``). Further (exact) pruning: with ``G(tau)``, the cheapest
   ``sum (t_i + 2 c_i)`` of any plan with stages ``<= tau``, non-increasing in ``tau``, a
   candidate needs ``(B - 1) tau + max(G(tau_E), tau) <= T``.
4. *Batched parallel evaluation* of the rest: batches balanced by their number of active
   entries, run sequentially, in local worker processes, or by a registered backend (Ray
   actors: ``backend="ray"``, registered by :mod:`harpjax.runtime`); every backend returns the
   identical plan (ties broken by the smaller ``t_max``).

Every objective (:data:`OBJECTIVE_REGISTRY`: time, money, time within a budget, money within
a time) is a parameter of this one search (one driver, one candidate evaluator,
:func:`evaluate_candidates`): with prices the DP runs with its rate criterion
(:class:`~harpjax.compiler.plan.dp_kernel.Pricing`), the feasibility test keeps to the
budget, and a candidate's floor is the cheapest cover's rate times ``B tau``.

The pieces, along the data flow: :mod:`~harpjax.compiler.plan.spec` (the plan types),
:mod:`~harpjax.compiler.plan.index` (device states and the kernels' input),
:mod:`~harpjax.compiler.plan.dp_kernel` (the DP), :mod:`~harpjax.compiler.plan.evaluate`
(:func:`~harpjax.compiler.plan.evaluate_plan` scores any plan, :func:`solve` builds its result
with it; why no plan fits) and this module (options, results, the search and its parallel
backends).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from harpjax.compiler.plan import dp_kernel
from harpjax.compiler.plan import variants as variants_lib
from harpjax.compiler.plan.dp_kernel import BOUND_SLACK, KIND_COST, KIND_TIME
from harpjax.compiler.plan.evaluate import (PlannedStage, evaluate_plan,
                                            infeasible_error)
from harpjax.compiler.plan.index import SparseIndex
from harpjax.compiler.plan.schedule_choice import choose_schedule, plan_scorer, RANK
from harpjax.compiler.plan.spec import Plan, StageSpec
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import (H1F1B, h1f1b_counts, iteration_times, pipeline_period,
                                       schedule_key)
from harpjax.errors import (HarpjaxError, InfeasiblePlanError, interruptible_kernel, PlanError,
                            RuntimeFailure)

__all__ = ["SolveOptions", "SearchStats", "PlanResult", "Scoring", "solve", "single_subcluster",
           "keeps_budget",
           "evaluate_candidates", "simulate_paths", "plan_arrays", "prove_time",
           "register_parallel_backend", "BACKENDS", "ALWAYS", "require_offloads", "OBJECTIVES",
           "COST_MODELS", "MIXED_MODES",
           "register_mixed_search", "Objective", "OBJECTIVE_REGISTRY", "objective_of"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Objective:
  """One thing :func:`solve` can optimise (``SolveOptions.objective``, ``harpjax plan
  --objective``): a parameter of the one search, not a search of its own.

  Attributes:
    name: the option's value.
    kind: what is ranked: :data:`~harpjax.compiler.plan.dp_kernel.KIND_TIME` (the iteration
      time ``T``, seconds) or :data:`~harpjax.compiler.plan.dp_kernel.KIND_COST` (the cost of
      an iteration, ``R T + 3600 F`` with ``R`` the plan's hourly rate and ``F`` its transfer
      fees per iteration; reported per iteration as ``R T / 3600 + F``).
    priced: needs the tables' prices (``CostTables.price_per_gpu_hour``).
    requires: the :class:`SolveOptions` bound it needs (``"budget_per_hour"`` or
      ``"time_limit_s"``), or ``None``.
    accepts: the bounds it may be given (a budget bounds ``"min_time"`` too).
    summary: one line, for help texts.
  """
  name: str
  kind: int
  priced: bool
  requires: str | None
  accepts: tuple[str, ...]
  summary: str

  def value(self, rate_per_hour: float | None, seconds: float, fees: float = 0.0) -> float:
    """The ranked value of a plan of ``seconds`` per iteration at ``rate_per_hour`` that pays
    ``fees`` of transfer per iteration."""
    if self.kind == KIND_TIME:
      return seconds
    return rate_per_hour * seconds + 3600.0 * fees if fees else rate_per_hour * seconds

  def check(self, budget_per_hour: float | None, time_limit_s: float | None) -> None:
    """Raises :class:`~harpjax.errors.PlanError` when a bound is missing or not used."""
    given = {"budget_per_hour": budget_per_hour, "time_limit_s": time_limit_s}
    if self.requires is not None and given[self.requires] is None:
      raise PlanError(f"objective {self.name!r} needs {self.requires}")
    for field, v in given.items():
      if v is not None and field not in self.accepts:
        owner = next(o.name for o in OBJECTIVE_REGISTRY.values() if o.requires == field)
        raise PlanError(f"{field} is the bound of {owner!r}; objective {self.name!r} does not "
                        "use it")


OBJECTIVE_REGISTRY: dict[str, Objective] = {o.name: o for o in (
    Objective("min_time", KIND_TIME, False, None, ("budget_per_hour",),
              "the shortest iteration (with budget_per_hour: within it)"),
    Objective("max_throughput_per_dollar", KIND_COST, True, None, (),
              "the lowest cost per iteration"),
    Objective("min_time_within_budget", KIND_TIME, True, "budget_per_hour",
              ("budget_per_hour",), "the shortest iteration within budget_per_hour"),
    Objective("min_cost_within_time", KIND_COST, True, "time_limit_s", ("time_limit_s",),
              "the lowest cost per iteration within time_limit_s"),
)}
"""Every :class:`Objective`, by name."""

OBJECTIVES = tuple(OBJECTIVE_REGISTRY)
"""What :func:`solve` optimises (:class:`SolveOptions`): the names of
:data:`OBJECTIVE_REGISTRY`."""


def objective_of(name: str) -> Objective:
  """The registered :class:`Objective` called ``name``.

  Raises:
    PlanError: no such objective.
  """
  try:
    return OBJECTIVE_REGISTRY[name]
  except (KeyError, TypeError):
    raise PlanError(f"SolveOptions.objective={name!r}; choose one of {OBJECTIVES}") from None

COST_MODELS = ("simulator", "eq12")
"""How :func:`solve` ranks plans (:class:`SolveOptions`)."""

MIXED_MODES = ("off", "auto", "on")

ALWAYS = "always"
"""The value of :attr:`SolveOptions.offload` (and ``offload_activations``) that requires the
offload on every stage."""
"""Whether :func:`solve` considers mixed-type stages (:mod:`~harpjax.compiler.plan.mixed`)."""

BACKENDS = ("auto", "sequential", "process", "thread")
"""Built-in ways of evaluating the candidates; more are registered by other packages
(:func:`register_parallel_backend`: the runtime registers ``"ray"``)."""

BatchRunner = Callable[..., list[tuple[list[tuple[int, float, float, np.ndarray]], int]]]
_PARALLEL_BACKENDS: dict[str, BatchRunner] = {}


def register_parallel_backend(name: str, run_batches: BatchRunner) -> None:
  """Makes ``SolveOptions(backend=name)`` evaluate candidate batches with ``run_batches``.

  Args:
    name: the backend's name.
    run_batches: ``run_batches(index, batches, args, workers, timeout_s)`` returns, per batch,
      what ``evaluate_candidates(index, batch, *args)`` returns (in any process that has the
      :class:`SparseIndex`).
  """
  _PARALLEL_BACKENDS[name] = run_batches


_MIXED_SEARCH: list[Callable[..., "PlanResult"]] = []


def register_mixed_search(search: Callable[..., "PlanResult"]) -> None:
  """Makes ``SolveOptions(mixed_stages="auto"|"on")`` call ``search(tables, B, options)``
  (:func:`harpjax.compiler.plan.mixed.solve_mixed` registers itself on import)."""
  _MIXED_SEARCH[:] = [search]


@dataclasses.dataclass(frozen=True)
class SolveOptions:
  """Options of :func:`solve`.

  Attributes:
    eps: H-1F1B tolerance of :func:`~harpjax.compiler.schedule.warmup_delta`, in [0, 1] (the
      runtime must use the same value; the plan records it, :attr:`~harpjax.Plan.eps`, which
      takes the same range).
    backend: ``"auto"`` (sequential for small searches, else ``"process"``), ``"sequential"``,
      ``"process"`` (local worker processes), ``"thread"`` (threads; the Numba kernel releases
      the GIL) or a registered one (``"ray"``: Ray actors, :mod:`harpjax.runtime`).
    workers: parallel workers (default: CPUs available).
    kernel: ``"numba"`` or ``"numpy"`` (the twin; slow, for cross-checks).
    bound_pruning: apply the exact lower-bound pruning beyond the paper's ``T(t_S) / B``.
    parallel_min_work: ``"auto"`` goes parallel when the candidates left hold at least this
      many active entries in total.
    timeout_s: limit on waiting for a worker or actor, seconds.
    start_method: multiprocessing start method of ``"process"``; default ``"fork"`` when no
      other Python thread runs, else ``"forkserver"`` (a script then needs the usual
      ``if __name__ == "__main__":`` guard).
    objective: ``"min_time"`` (default: the shortest iteration), ``"max_throughput_per_dollar"``
      (the lowest cost per iteration, ``rate * T``), ``"min_time_within_budget"`` (the
      shortest iteration whose hourly rate is at most ``budget_per_hour``) or
      ``"min_cost_within_time"`` (the lowest cost per iteration among plans of at most
      ``time_limit_s`` seconds). All but ``"min_time"`` need the tables' prices
      (``CostTables.price_per_gpu_hour``).
    budget_per_hour: the budget of ``"min_time_within_budget"`` (currency per hour: the sum over
      stages of devices times price, plus ``3600 F / T`` where the tables charge transfer fees,
      :attr:`~harpjax.compiler.profile.CostTables.fees`); also allowed with ``"min_time"`` as
      the same bound.
    time_limit_s: the bound on the iteration time of ``"min_cost_within_time"``.
    use_all_devices: every device of every subcluster must run a stage (HARP's Eq. 19);
      default ``False``: the plan may leave devices, hosts or whole subclusters unused.
    keep_order: stages follow the tables' subcluster order (subclusters may still be skipped
      unless ``use_all_devices``); default ``False``: the order is chosen too, exactly, over
      every order the links allow. ``use_all_devices=True, keep_order=True`` is the paper's
      planner.
    cost_model: ``"simulator"`` (default): plans are ranked by the simulator's iteration time
      of the H-1F1B schedule the runtime runs (warm-ups and end-of-iteration times included),
      and plans with a cut slower than their slowest stage (link-bound) are admitted; the DP
      proposes, per candidate period, the plan minimising a lower bound on that time, and a
      bounded exact search (``proof_nodes``) proves the optimum where it can. ``"eq12"``: the
      paper's planner, Eq. 12 with the rule ``c <= t_max``.
    fwd_fraction: the forward's share of a stage's time in the simulated schedule.
    proof_nodes: node budget of the bounded exact search after the DP (``0``: none); the
      result says whether it completed (``SearchStats.proved``).
    bound_pieces: slices of the window of candidates, each bounded below by its own ``G``
      (with ``bound_pruning``).
    hidden_share: with the simulator, the DP's pruning assumes that the warm-up forwards of a
      plan's bottleneck stage hide at most this share of an iteration (of the round trip of
      the stages below it); ``1``: no assumption (slower). It only steers which plans the DP
      proposes: the bounded exact search makes no such assumption.
    zero_levels: the ZeRO levels a stage may use, chosen per stage by the search where the
      tables carry the optimizer state's bytes (``CostTables.opt_mem_bytes``; tables without
      them plan at level 0). ``(0,)``: no sharding of the training state.
    offload: ``True`` (default): a stage may keep its optimizer state in host memory (where
      the tables also give ``offload_bandwidth_bytes_per_s``), chosen per stage
      (:mod:`~harpjax.compiler.plan.variants`); ``False``: no stage does; ``"always"``: every
      stage does, the user's request as a constraint on the tables' variants: the planner
      prices it (each stage's time and memory are its offload variant's) and the plan's stages
      carry it (:attr:`~harpjax.compiler.plan.StageSpec.offload`).
    offload_activations: the same for a stage's residuals, kept in host memory between
      forward and backward (:attr:`~harpjax.compiler.plan.StageSpec.offload_activations`).
    mixed_stages: ``"off"``, ``"auto"`` (default) or ``"on"``: also consider stages that run
      on groups of devices of several subclusters joined by a link (``"auto"``: only fast
      links), data-parallel with rows split by speed; the plan without them stays a candidate
      (:func:`harpjax.compiler.plan.mixed.solve_mixed`). Only where ``mixed_options`` or the
      tables (:attr:`~harpjax.compiler.profile.CostTables.microbatch_rows`, which the profiler
      fills in) give the microbatch's rows: without them ``"auto"`` plans as ``"off"``.
    mixed_options: a :class:`~harpjax.compiler.plan.mixed.MixedOptions` (the microbatch's rows,
      the cost model's knobs, which fusions to try).
    schedule: ``"rank"`` (default): the search finds the stages for H-1F1B, then the
      registered schedules the planner ranks (1F1B, Eager-1F1B, H-1F1B: the
      :attr:`~harpjax.compiler.schedule.ScheduleKind.ranked` ones) are simulated on them
      and the fastest whose microbatches in flight fit every stage is kept
      (:func:`~harpjax.compiler.plan.choose_schedule`); or a registered schedule's name,
      which pins it (the same stages, that schedule).
  """
  eps: float = 0.1
  backend: str = "auto"
  workers: int | None = None
  kernel: str = "numba"
  bound_pruning: bool = True
  parallel_min_work: int = 3_000_000
  timeout_s: float = 3600.0
  start_method: str | None = None
  use_all_devices: bool = False
  keep_order: bool = False
  objective: str = "min_time"
  budget_per_hour: float | None = None
  time_limit_s: float | None = None
  cost_model: str = "simulator"
  fwd_fraction: float = 1.0 / 3.0
  proof_nodes: int = 200_000
  bound_pieces: int = 16
  hidden_share: float = 0.02
  zero_levels: tuple[int, ...] = (0, 1, 2, 3)
  offload: bool | str = True
  offload_activations: bool | str = True
  mixed_stages: str = "auto"
  mixed_options: Any = None
  schedule: str = RANK

  def __post_init__(self):
    from harpjax.errors import (InvalidOptionError, check_choice, check_count, check_flag,
                                check_number)
    if self.schedule != RANK:
      try:
        object.__setattr__(self, "schedule", schedule_key(self.schedule))
      except HarpjaxError as e:
        raise InvalidOptionError(f"SolveOptions.schedule={self.schedule!r}: {RANK!r} (the "
                                 f"planner ranks the schedules) or a registered schedule; "
                                 f"{e}") from None
    for name in ("offload", "offload_activations"):
      value = getattr(self, name)
      if not (isinstance(value, bool) or value == ALWAYS):
        raise InvalidOptionError(f"SolveOptions.{name}={value!r}: True (the planner chooses "
                                 f"per stage), False (no stage) or {ALWAYS!r} (every stage)")
    if self.mixed_stages == "on" and ALWAYS in (self.offload, self.offload_activations):
      raise InvalidOptionError(
          f"SolveOptions.mixed_stages='on' with an offload {ALWAYS!r}: mixed-type stages are "
          "not priced with a required offload; give mixed_stages='auto' or 'off'")
    try:
      variant_opts = variants_lib.VariantOptions(self.zero_levels, bool(self.offload),
                                                 bool(self.offload_activations))
    except PlanError as e:
      raise InvalidOptionError(f"SolveOptions.{e}") from None
    object.__setattr__(self, "zero_levels", variant_opts.zero_levels)
    check_choice("SolveOptions.mixed_stages", self.mixed_stages, MIXED_MODES)
    check_choice("SolveOptions.cost_model", self.cost_model, COST_MODELS)
    check_number("SolveOptions.fwd_fraction", self.fwd_fraction, 0, 1, low_open=True,
                 high_open=True)
    check_number("SolveOptions.hidden_share", self.hidden_share, 0, 1)
    check_count("SolveOptions.proof_nodes", self.proof_nodes, 0)
    check_count("SolveOptions.bound_pieces", self.bound_pieces, 1)
    check_count("SolveOptions.parallel_min_work", self.parallel_min_work, 0)
    try:
      goal = objective_of(self.objective)
    except PlanError as e:
      raise InvalidOptionError(str(e)) from None
    for name in ("budget_per_hour", "time_limit_s"):
      check_number(f"SolveOptions.{name}", getattr(self, name), 0, low_open=True,
                   allow_none=True)
    try:
      goal.check(self.budget_per_hour, self.time_limit_s)
    except PlanError as e:
      raise InvalidOptionError(f"SolveOptions: {e}") from None
    # the range Plan.eps takes: the plan records the tolerance it was made with
    check_number("SolveOptions.eps", self.eps, 0, 1)
    known = BACKENDS + tuple(_PARALLEL_BACKENDS)
    if self.backend not in known:
      raise InvalidOptionError(f"SolveOptions.backend={self.backend!r}; choose one of {known}")
    check_choice("SolveOptions.kernel", self.kernel, ("numba", "numpy"))
    check_count("SolveOptions.workers", self.workers, 1, allow_none=True)
    check_number("SolveOptions.timeout_s", self.timeout_s, 0, low_open=True, finite=False)
    if self.start_method is not None:
      check_choice("SolveOptions.start_method", self.start_method,
                   multiprocessing.get_all_start_methods())
    for name in ("bound_pruning", "use_all_devices", "keep_order"):
      check_flag(f"SolveOptions.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What the search did (for logs and benchmarks).

  Attributes:
    num_entries: feasible (range, submesh) entries in the sparse index.
    num_candidates: distinct ``t_max`` candidates.
    t_s, t_e: smallest feasible candidate and the paper's upper cut ``T(t_S) / B``.
    num_window: candidates between the incumbent and ``t_E``.
    num_pruned_by_bound: of those, dropped by the lower bound ``(B-1) tau + G(t_E)``.
    num_evaluated: exact DP runs (incumbent search and window).
    num_feasibility_runs: DP runs of the binary search and the lower bound.
    backend, workers: how the window was evaluated.
    seconds: wall time of :func:`solve`.
    num_simulated: plans simulated.
    proved: the bounded exact search completed: no plan beats the result (``None``: not run,
      as with ``cost_model="eq12"``, whose DP is exact for its own objective).
    proof_nodes: nodes the bounded exact search visited.
  """
  num_entries: int
  num_candidates: int
  t_s: float
  t_e: float
  num_window: int
  num_pruned_by_bound: int
  num_evaluated: int
  num_feasibility_runs: int
  backend: str
  workers: int
  seconds: float
  num_simulated: int = 0
  proved: bool | None = None
  proof_nodes: int = 0


@dataclasses.dataclass(frozen=True)
class PlanResult:
  """What :func:`solve` returns.

  Attributes:
    plan: the :class:`~harpjax.compiler.plan.Plan` (its schedule, warm-ups, ``t_max``, and
      the simulated iteration time as ``predicted_iteration_s``).
    objective_s: the iteration time the plan was ranked by, seconds: the simulator's under
      the plan's schedule (``cost_model="simulator"``), or Eq. 12 plus the first stage's end
      time (``"eq12"``).
    t_max_s: the plan's bottleneck stage time.
    stages: the :class:`PlannedStage` list (warm-ups and memory of the plan's schedule).
    warmups: the plan's schedule's warm-up counts ``N_i`` (H-1F1B's from ``t_max_s`` and
      ``eps``).
    num_microbatches: ``B``.
    eps: the H-1F1B tolerance used.
    stats: :class:`SearchStats`.
    rate_per_hour: the plan's hourly rate (sum over stages of devices times price), ``None``
      without prices.
    cost_per_iteration: ``rate_per_hour * objective_s / 3600 + fees_per_iteration``, ``None``
      without prices.
    objective: the :class:`SolveOptions` objective optimised.
    iteration_s: the simulator's iteration time under the plan's schedule (equals
      ``plan.predicted_iteration_s``).
    eq12_s: Eq. 12 of the plan.
    period_s: ``max(t_max, max_i c_i)``; above ``t_max_s`` the plan is link-bound.
    fees_per_iteration: the transfer fees its cuts pay per iteration (the tables'
      :attr:`~harpjax.compiler.profile.CostTables.fees`; ``0`` without), counted in its money
      and its budget.
    transfer_bytes: ``[3]`` bytes per iteration its cuts send over links of each class
      (:data:`~harpjax.cluster.LINK_CLASSES`).
  """
  plan: Plan
  objective_s: float
  t_max_s: float
  stages: tuple[PlannedStage, ...]
  warmups: tuple[int, ...]
  num_microbatches: int
  eps: float
  stats: SearchStats
  rate_per_hour: float | None = None
  cost_per_iteration: float | None = None
  objective: str = "min_time"
  iteration_s: float = math.nan
  eq12_s: float = math.nan
  period_s: float = math.nan
  fees_per_iteration: float = 0.0
  transfer_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)

  @property
  def value(self) -> float:
    """What the objective ranks: ``objective_s``, or the hourly rate times it plus 3600 times
    the fees (:meth:`Objective.value`)."""
    return objective_of(self.objective).value(self.rate_per_hour, self.objective_s,
                                              self.fees_per_iteration)

  @property
  def rate_with_fees_per_hour(self) -> float | None:
    """The hourly rate with the transfer fees, ``rate_per_hour + 3600 fees_per_iteration /
    objective_s`` (what ``budget_per_hour`` bounds; ``None`` without prices)."""
    if self.rate_per_hour is None or not self.fees_per_iteration:
      return self.rate_per_hour
    return self.rate_per_hour + 3600.0 * self.fees_per_iteration / self.objective_s

  @property
  def num_devices(self) -> int:
    """Devices the plan uses (every group of a mixed stage)."""
    return sum(s.num_devices for s in self.plan.stages)

  def table(self) -> str:
    return self.plan.table()


# --------------------------------------------------------------------------- batch evaluation


class Scoring(NamedTuple):
  """How the search scores the candidates' plans (sent to workers by value).

  Attributes:
    num_microbatches: ``B``.
    eps: H-1F1B tolerance.
    kernel: ``"numba"`` or ``"numpy"``.
    discount: the DP's ``discount`` (``fwd_fraction`` when the simulator judges, else 0).
    simulated: rank by the simulator (else by the DP's value plus ``(B - 1) tau``).
    fwd_fraction: the forward's share of a stage's time.
    nmax: largest in-flight count of any stage (``min(n_cap, B)``).
    hidden_share: see :class:`SolveOptions`.
    kind: ``-1`` for the time objective; with prices what is ranked (the
      :class:`Objective`'s kind: :data:`~harpjax.compiler.plan.dp_kernel.KIND_TIME` or
      ``KIND_COST``; the DP's rate criterion, :class:`~harpjax.compiler.plan.dp_kernel.
      Pricing`), with the
      budget ``rate_max``, the time limit ``t_limit`` and the ``price`` per device-hour.
  """
  num_microbatches: int
  eps: float
  kernel: str
  discount: float
  simulated: bool
  fwd_fraction: float
  nmax: int
  hidden_share: float = 1.0
  kind: int = -1
  rate_max: float = math.inf
  t_limit: float = math.inf
  price: tuple[float, ...] = ()

  @property
  def priced(self) -> bool:
    """Whether the objective has prices (the DP's rate criterion)."""
    return self.kind >= 0

  def priced_floor(self, tau: float, r_min: float, least_fee: float = 0.0) -> float:
    """With prices: a lower bound on the ranked value of any plan of period ``tau`` (``inf``
    beyond the time limit): its time is at least ``B tau``, its rate at least ``r_min`` (the
    cheapest single stage, or cover), its transfer fees at least ``least_fee``."""
    B = self.num_microbatches
    if B * tau > self.t_limit * (1.0 + BOUND_SLACK):
      return math.inf
    if self.kind == KIND_TIME:
      return B * tau
    return r_min * B * tau + 3600.0 * least_fee if least_fee else r_min * B * tau

  def capped(self, tau: float, hit_cap: int, bound: float) -> int:
    """``hit_cap`` under the ``hidden_share`` assumption: the hit stage's warm-up forwards
    hide at most ``hidden_share * bound`` seconds."""
    if self.discount > 0 and math.isfinite(bound) and self.hidden_share < 1:
      return min(hit_cap, 1 + int(self.hidden_share * bound / (self.discount * tau)))
    return hit_cap

  def floor(self, tau: float, sigma_lb: float, hit_cap: int | None = None,
            hit_end: float = 0.0) -> float:
    """A lower bound on the score of any plan of period ``tau`` whose DP value is at least
    ``sigma_lb`` before the discount: the simulated time is at least ``B tau`` (the bottleneck
    stage or link alone) plus ``hit_end`` (the least end time of a stage that takes ``tau``,
    :meth:`~harpjax.compiler.plan.index.SparseIndex.hit_end`, after its last backward), and
    at least the DP's value plus ``(B - 1) tau``. ``hit_cap``: the most microbatches a stage
    of time ``tau`` holds (bounds the discount)."""
    B = self.num_microbatches
    n = self.nmax if hit_cap is None else min(self.nmax, hit_cap)
    lb = (B - 1) * tau + max(sigma_lb, tau) - self.discount * tau * (n - 1)
    return max(lb, B * tau + hit_end) if self.simulated else lb


def plan_arrays(index: SparseIndex, path: np.ndarray, eps: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Stage times, cut costs (``0`` after the last), end times and H-1F1B warm-ups of a DP
  path (entry indices), as :func:`~harpjax.compiler.plan.evaluate_plan` computes them."""
  e = np.asarray(path, np.int64)
  ix = index.arrays
  t = ix.ent_t[e]
  c = index.path_cuts(e)
  period = pipeline_period(c, float(t.max()))
  warm = np.asarray(h1f1b_counts(c[:-1], period, eps), np.int64)
  return t, c, ix.ent_e[e], warm


def simulate_paths(index: SparseIndex, paths: Sequence[np.ndarray], scoring: Scoring
                   ) -> np.ndarray:
  """The simulator's iteration time of each DP path under its H-1F1B schedule (bit for bit
  :func:`harpjax.compiler.schedule.simulate`'s, see
  :func:`~harpjax.compiler.schedule.sim_kernel.iteration_times`)."""
  Q = len(paths)
  S = max((len(p) for p in paths), default=1)
  T, C, E = np.zeros((Q, S)), np.zeros((Q, S)), np.zeros((Q, S))
  W = np.ones((Q, S), np.int64)
  for q, p in enumerate(paths):
    t, c, e, w = plan_arrays(index, p, scoring.eps)
    n = len(p)
    T[q, :n], C[q, :n], E[q, :n], W[q, :n] = t, c, e, w
  return iteration_times(T, C, E, W, [len(p) for p in paths],
                                    scoring.num_microbatches, scoring.fwd_fraction)


def evaluate_candidates(index: SparseIndex, taus: Sequence[int], scoring: Scoring,
                        bound: float, sigma_lb: float | dict[int, float] = 0.0,
                        above: tuple[np.ndarray, np.ndarray] | None = None
                        ) -> tuple[list[tuple[int, float, float, np.ndarray]], int]:
  """Exact DP at candidates ``taus`` (ascending indices), each plan scored, tightening
  ``bound`` as it goes: one loop for every objective (``scoring.kind``).

  ``sigma_lb``: a lower bound on the DP's value (before the discount) of every plan of those
  periods, or per candidate index (the time objective). The candidates share prefix and
  suffix bounds taken at the largest of a run of them (bounds at every smaller one); a
  candidate that no plan can have as its period is skipped without a DP.

  Time objective: when the simulator judges, a candidate that is a stage time and has a plan
  also gets the plan of the paper's model there (Eq. 12, every cut within the stage time):
  the old rule's optimum is then among the plans simulated, so the result never simulates
  slower than it. Objectives with prices: the DP with the rate criterion
  (:class:`~harpjax.compiler.plan.dp_kernel.Pricing`), its Eq. 12 value less the most the
  warm-ups can hide when the simulator judges compared with ``bound``.

  ``above``: a prefix and a suffix bound (:meth:`~harpjax.compiler.plan.index.SparseIndex.
  prefix_bound`, :meth:`~harpjax.compiler.plan.index.SparseIndex.suffix_bound`) at a candidate
  at or above the largest of ``taus``, if the caller has them: the states that have both at
  the largest of ``taus`` are then found by a pass through the states that have both there
  (the same states, a shorter pass).

  Returns:
    For every plan found within the bound ``(candidate index, x, score, path)``, ``x`` the DP
    value plus ``(B - 1) tau`` (time objective) or the plan's hourly rate (with prices); and
    the number of DP runs.
  """
  B = scoring.num_microbatches
  n_cap = index.n_cap(B)
  priced = scoring.priced
  price = np.asarray(scoring.price, np.float64)
  fee = index.fees(B) if priced else None   # the cuts' transfer fees (None: none charged)
  out, runs = [], 0
  # With the simulator's model every stage's end time counts in the DP's bound, whose prefix
  # bounds pay for themselves at every BOUND_CHUNK candidates (those left by the floor); so
  # do those with prices, whose frontiers are larger.
  end_path = not priced and scoring.simulated and scoring.discount > 0 and index.has_ends
  chunk = BOUND_CHUNK if (end_path or priced) else len(taus)
  lb = sb = lbf = live = lbr = lbfee = None
  top = -math.inf   # the period the bounds were last taken at
  shared: set[int] = set()   # the candidates that share the bounds
  slack = 1.0 + BOUND_SLACK

  def floor(c: int, hit_cap: int | None) -> float:
    sig = sigma_lb.get(c, 0.0) if isinstance(sigma_lb, dict) else sigma_lb
    return _floor(index, scoring, c, sig, hit_cap)

  # In ascending period; with prices the least floor first (a good plan found early prunes
  # the rest: a money objective's value varies little with the period). Either way a run of
  # candidates shares the bounds taken at the largest period among them.
  taus = sorted(taus)
  floors = np.array([floor(c, None) for c in taus])
  if priced:
    order = np.lexsort((np.asarray(taus), floors))
    taus, floors = [taus[o] for o in order], floors[order]
  if end_path and taus and above is not None and len(taus) <= chunk:
    live = above   # one set of bounds: taken through the states live above (the same)
  elif end_path and taus:   # states without a prefix or a suffix at the top are in no plan
    top = float(index.candidates[taus[-1]])
    live = index.prefix_bound(top, live=above)
    live = (live, index.suffix_bound(top, live))
  for x, idx in enumerate(taus):
    tau = float(index.candidates[idx])
    hit_cap = None if priced else scoring.capped(tau, index.hit_cap(tau, B), bound)
    if floor(idx, hit_cap) > bound * slack:
      continue
    if idx not in shared:
      left = np.flatnonzero(floors[x:] <= bound * slack)[:chunk] + x
      shared = {taus[int(y)] for y in left}
      prev, top = top, float(index.candidates[max(shared)])
      if end_path and lb is not None and prev < top:   # the same bounds, from those below
        lb, lbf = index.grow_prefix_bounds(prev, top, scoring.discount, (lb, lbf), live=live)
      elif end_path:
        lb, lbf = index.prefix_bounds(top, scoring.discount, live=live)
      else:
        lb = index.prefix_bound(top)
      sb = index.suffix_bound(top, lb)
      if priced:
        lbr = index.prefix_rate(top, price)
        if fee is not None:
          lbfee = index.prefix_fee(top, B)
    if not index.may_have_period(tau, lb, sb):
      continue
    if end_path and index.hit_floor(tau, lb, lbf, sb, B, hit_cap, scoring.fwd_fraction) > \
        bound * slack:
      continue   # the path through the hit stage to its own end of iteration is too long
    runs += 1
    log.debug("planner: DP at period %.6g s (%d active entries), bound %.6g s", tau,
              index.active_entries(tau), bound)
    if priced:
      relief = scoring.discount * tau * (scoring.nmax - 1)
      value, rate, _, path = index.run(
          tau, B, scoring.eps, require_hit=True, bound=bound, kernel=scoring.kernel,
          n_cap=n_cap, lb=lb, sb=sb, pricing=index.pricing(
              price, scoring.kind, scoring.rate_max, scoring.t_limit, relief, lbr, fee,
              lbfee))
      if not math.isfinite(value):
        continue
      if scoring.simulated:
        sim = float(simulate_paths(index, [path], scoring)[0])
        if sim > scoring.t_limit:
          continue
        if fee is None:
          value = sim if scoring.kind == KIND_TIME else rate * sim
        else:   # the money and the budget with the plan's transfer fees
          paid = index.path_fee(path, B)
          if not keeps_budget(rate, paid, sim, scoring.rate_max):
            continue
          value = sim if scoring.kind == KIND_TIME else rate * sim + 3600.0 * paid
      out.append((idx, rate, value, path))
      bound = min(bound, value)
      continue
    value, path = index.run(tau, B, scoring.eps, require_hit=True, bound=bound,
                            kernel=scoring.kernel, n_cap=n_cap, discount=scoring.discount,
                            lb=lb, sb=sb, hit_cap=hit_cap, end_path=end_path, lbf=lbf)
    if not math.isfinite(value):
      continue
    found = [(value, path)]
    if scoring.simulated and scoring.discount > 0 and index.is_stage_time(tau):
      # Its simulated time is at least its Eq. 12 value less the most the warm-ups can hide
      # (``relief``, as with prices): a plan whose value exceeds the bound by more cannot win.
      # Its last stage of time tau holds at most the microbatches its memory allows
      # (hit_cap): a plan beyond bound + relief is no plan to simulate.
      runs += 1
      relief = scoring.discount * tau * (min(scoring.nmax, index.hit_cap(tau, B)) - 1)
      found.append(index.run(tau, B, scoring.eps, require_hit=True, kernel=scoring.kernel,
                             n_cap=n_cap, lb=lb, sb=sb, link_hits=False,
                             bound=bound + relief))
    for value, path in found:
      if not math.isfinite(value):
        continue
      sur = value + (B - 1) * tau
      score = float(simulate_paths(index, [path], scoring)[0]) if scoring.simulated else sur
      out.append((idx, sur, score, path))
      bound = min(bound, score)
  return out, runs


def keeps_budget(rate_per_hour: float, fees_per_iteration: float, seconds: float,
                 budget_per_hour: float) -> bool:
  """Whether a plan at ``rate_per_hour`` for its devices that pays ``fees_per_iteration`` of
  transfer fees per iteration of ``seconds`` keeps ``budget_per_hour``: ``rate + 3600 fees /
  seconds <= budget`` (to a relative ``1e-12``)."""
  if not fees_per_iteration:
    return rate_per_hour <= budget_per_hour * (1.0 + 1e-12)
  return (rate_per_hour + 3600.0 * fees_per_iteration / seconds
          <= budget_per_hour * (1.0 + 1e-12))


BOUND_CHUNK = 32
"""With end times: the candidates (of those the floor leaves) that share one set of prefix and
suffix bounds in :func:`evaluate_candidates`, taken at the largest of them."""

_WORKER_INDEX: dict[str, SparseIndex] = {}  # per worker process: the index it was started with


def _worker_init(index: SparseIndex) -> None:
  # Ctrl-C in a terminal reaches the whole process group: the parent cancels the pool and
  # terminates its workers, which must not each print a KeyboardInterrupt traceback.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _WORKER_INDEX["index"] = index


def _worker_batch(args) -> tuple[list[tuple[int, float, float, np.ndarray]], int]:
  return evaluate_candidates(_WORKER_INDEX["index"], *args)


def _balanced_batches(index: SparseIndex, cand: Sequence[int], num_batches: int
                      ) -> list[list[int]]:
  """Longest-processing-time split of candidates by their number of active entries."""
  work = [(index.active_entries(index.candidates[c]), c) for c in cand]
  work.sort(key=lambda x: (-x[0], x[1]))
  batches = [[] for _ in range(max(1, min(num_batches, len(work))))]
  load = [0] * len(batches)
  for w, c in work:
    b = int(np.argmin(load))
    batches[b].append(c)
    load[b] += w
  return [sorted(b) for b in batches if b]


def _default_start_method() -> str:
  """``fork`` (children inherit the compiled kernel, no ``__main__`` guard needed) unless
  other Python threads run (Ray, user code), then ``forkserver``. Native library threads
  (BLAS, XLA) do not matter: the children only run the kernel on NumPy arrays; nor do threads
  marked ``fork_safe`` (the command line's Ctrl-C watcher, which holds no lock)."""
  methods = multiprocessing.get_all_start_methods()
  others = [t for t in threading.enumerate()
            if t is not threading.current_thread() and not getattr(t, "fork_safe", False)]
  if "fork" in methods and not others:
    return "fork"
  return "forkserver" if "forkserver" in methods else "spawn"


def _cancel(ex: concurrent.futures.Executor) -> None:
  """Stops a pool now: queued batches cancelled, worker processes terminated (a thread
  finishes the batch it runs; its result is dropped).

  Its worker processes are terminated here, every one the pool started: a pool whose worker
  was killed (kill -9, the OOM killer) terminates those it lists and then waits for all, and
  one listed just after (its start was under way) would wait forever for the queue's lock
  the killed worker held, and the pool for it (and the interpreter's exit for the pool).
  """
  procs = list((getattr(ex, "_processes", None) or {}).values())   # shutdown forgets them
  ex.shutdown(wait=False, cancel_futures=True)
  for p in procs:
    try:
      p.terminate()
    except (OSError, ValueError):   # already gone or closed
      pass


def _run_parallel(index: SparseIndex, batches: list[list[int]], args: tuple, backend: str,
                  workers: int, timeout_s: float, start_method: str | None
                  ) -> tuple[list[tuple[int, float, float, np.ndarray]], int]:
  outs = []
  if backend in ("thread", "process"):
    if backend == "thread":
      ex = concurrent.futures.ThreadPoolExecutor(workers)
    else:
      ctx = multiprocessing.get_context(start_method or _default_start_method())
      ex = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx,
                                                  initializer=_worker_init, initargs=(index,))
    try:
      if backend == "thread":
        futs = [ex.submit(evaluate_candidates, index, b, *args) for b in batches]
      else:
        futs = [ex.submit(_worker_batch, (b, *args)) for b in batches]
      for n, f in enumerate(futs):
        try:
          outs.append(f.result(timeout=timeout_s))
        except concurrent.futures.TimeoutError:
          raise RuntimeFailure(f"planner {backend} worker on batch {n} of {len(batches)} "
                               f"timed out after {timeout_s} s") from None
    except concurrent.futures.BrokenExecutor as e:   # a worker process killed (OOM, kill -9)
      _cancel(ex)
      log.warning("a planner worker process died (%s); searching in this process", e)
      outs = [evaluate_candidates(index, b, *args) for b in batches]
    except BaseException:   # KeyboardInterrupt included: nothing keeps computing or waits
      _cancel(ex)
      raise
    if backend == "thread":
      ex.shutdown(wait=True)
    else:   # every result is in: the workers are stopped, not waited for (see _cancel)
      _cancel(ex)
  else:
    outs = _PARALLEL_BACKENDS[backend](index, batches, args, workers, timeout_s)
  return [r for o in outs for r in o[0]], sum(o[1] for o in outs)


# --------------------------------------------------------------------------- solve


@interruptible_kernel   # Ctrl-C in any kernel or NumPy callback of the search: KeyboardInterrupt
def solve(tables: CostTables, num_microbatches: int, *, options: SolveOptions | None = None,
          **overrides: Any) -> PlanResult:
  """Finds the fastest plan (or the best by a money objective): HARP §5.2's search, judged by
  the simulator.

  Args:
    tables: the cost tables (subclusters in pipeline order).
    num_microbatches: ``B``.
    options: :class:`SolveOptions`; keyword arguments override its fields
      (``solve(t, 128, backend="ray")``).

  Returns:
    The :class:`PlanResult`: stages (layer range, subcluster, submesh, logical mesh), the
    schedule (``options.schedule``: the fastest ranked one that fits, by default) and its
    warm-up counts, ``t_max``, the simulated iteration time and search statistics.

  Where the tables charge transfer fees (:attr:`~harpjax.compiler.profile.CostTables.fees`)
  the search counts them: the money objectives rank ``rate x T / 3600 + fees`` per iteration,
  ``budget_per_hour`` bounds ``rate + 3600 fees / T``, exactly as
  :func:`~harpjax.compiler.plan.evaluate_plan` reports them (each cut's fee carried in the
  DP's state, :class:`~harpjax.compiler.plan.dp_kernel.Pricing`; a mixed-type stage's
  groups' transfers too, :func:`~harpjax.compiler.plan.mixed.solve_mixed`).

  Raises:
    InfeasiblePlanError: no plan fits; the message names the constraint and by how much
      (its ``constraint`` attribute is ``"memory"``, ``"communication"``, ``"devices"``,
      ``"layers"``, ``"budget"`` or ``"time"``).
  """
  if not isinstance(tables, CostTables):
    raise PlanError(f"solve needs CostTables, got {type(tables).__name__}")
  opts = dataclasses.replace(options or SolveOptions(), **overrides)
  B = int(num_microbatches)
  if B != num_microbatches or B < 1:
    raise PlanError(f"num_microbatches={num_microbatches} must be a positive integer")
  if opts.mixed_stages != "off" and _MIXED_SEARCH and not any(_required_offloads(opts)):
    return _MIXED_SEARCH[0](tables, B, opts)   # it chooses the schedule too
  asked, opts = opts, dataclasses.replace(opts, schedule=H1F1B.name)   # the search's schedule
  result = _solve_plain(tables, B, opts, time.perf_counter())
  return choose_schedule(result, plan_scorer(tables, B, opts.eps, opts.fwd_fraction), asked)


def _solve_plain(given: CostTables, B: int, opts: SolveOptions, start: float,
                 beat: float = math.inf) -> PlanResult | None:
  """:func:`solve` without mixed-type stages, for H-1F1B, before the schedule is chosen: the
  search on the tables' variants, then (not proved) each subcluster alone and fewer memory
  options. With ``beat`` finite only plans whose value is below it count (``None`` if there
  is none): every search of the cascade then starts from that bound."""
  tables = given
  required = _required_offloads(opts)
  if variants_lib.has_variant_data(given):
    # A required offload keeps every variant (B not given: none is dropped as dominated by
    # one without it), then only those with it.
    tables = variants_lib.expand_variants(
        given, variants_lib.VariantOptions(opts.zero_levels, bool(opts.offload),
                                           bool(opts.offload_activations)),
        None if any(required) else B)
  if any(required):
    tables = require_offloads(tables, *required)
  result = _search(tables, B, opts, start, beat=beat)
  if (opts.cost_model == "simulator" and not opts.use_all_devices
      and tables.num_subclusters > 1 and (result is None or not result.stats.proved)):
    result = _best_of_single_subclusters(tables, B, opts, result, start, beat)
  if tables is not given:
    result = _with_fewer_variants(given, tables, B, opts, result, start, beat)
  return result


def _required_offloads(opts: SolveOptions) -> tuple[bool, bool]:
  """Whether every stage must offload its optimizer state, and its residuals."""
  return opts.offload == ALWAYS, opts.offload_activations == ALWAYS


def require_offloads(tables: CostTables, optimizer_state: bool, activations: bool
                     ) -> CostTables:
  """``tables`` (expanded into variants) with only the variants that offload what is asked
  usable (the others' stage times ``inf``): the user's offload request as a constraint the
  search prices.

  Raises:
    InfeasiblePlanError: the tables cannot price the offload (no link to host memory, or
      for the optimizer state no optimizer bytes), or no entry offloads it.
  """
  what = " and ".join(n for n, x in (("offload='always'", optimizer_state),
                                     ("offload_activations='always'", activations)) if x)
  if tables.variants is None:
    err = InfeasiblePlanError(
        f"SolveOptions({what}) but {tables.describe()} cannot price it: the tables need "
        "offload_bandwidth_bytes_per_s (the link to host memory) and, to offload the "
        "optimizer state, opt_mem_bytes; give them, or drop the request")
    err.constraint = "memory"
    raise err
  times = []
  for k in range(tables.num_subclusters):
    keep = np.array([(o or not optimizer_state) and (r or not activations)
                     for _, o, r in tables.variants[k]], dtype=bool)
    times.append(np.where(keep[None, None, :], tables.stage_time_s[k], np.inf))
  if not any(np.isfinite(t).any() for t in times):
    err = InfeasiblePlanError(f"SolveOptions({what}): no stage of {tables.describe()} can "
                              "offload that (no variant with it fits a device)")
    err.constraint = "memory"
    raise err
  return tables.replace(stage_time_s=tuple(times))


def _with_fewer_variants(given: CostTables, tables: CostTables, B: int, opts: SolveOptions,
                         result: PlanResult | None, start: float, beat: float = math.inf
                         ) -> PlanResult | None:
  """The stages' submesh indices in the caller's tables (``given``; ``tables`` are its
  variants). When the search could not prove its optimum: the search without offload and at
  level 0 alone too, the best result kept (strictly better only), so that the new freedom
  never makes the result worse than planning without it. Those searches only look for plans
  better than the best so far (``beat``): a plan of theirs that is not could not be kept."""
  if result is not None:
    result = dataclasses.replace(result, stages=tuple(
        dataclasses.replace(st, submesh_index=variants_lib.base_index(
            tables, st.subcluster, st.submesh_index)) for st in result.stages))
    if result.stats.proved:
      return result
  # Without offload first; that search (unless it proves its optimum) tries level 0 alone.
  fewer = [dict(zero_levels=(0,), offload=False, offload_activations=False)]
  if given.offload_bandwidth_bytes_per_s is not None and (opts.offload
                                                          or opts.offload_activations):
    fewer = [dict(offload=False, offload_activations=False)]
  # A required offload stays required: only the other freedoms are taken away.
  fewer = [{f: v for f, v in change.items() if getattr(opts, f) != ALWAYS}
           for change in fewer]
  fewer = [change for change in fewer if change and any(
      getattr(opts, f) != v for f, v in change.items())]
  for change in fewer:
    alt_opts = dataclasses.replace(opts, **change)
    best = beat if result is None else min(beat, _value(result))
    try:
      alt = _solve_plain(given, B, alt_opts, time.perf_counter(), beat=best)
    except InfeasiblePlanError:
      continue
    if alt is None:
      continue
    alt = choose_schedule(alt, plan_scorer(given, B, alt_opts.eps, alt_opts.fwd_fraction),
                          alt_opts)
    if _value(alt) < best:
      log.info("planner: a plan with fewer memory options (%s) simulates better: %.6g",
               change, _value(alt))
      result = alt
  if result is None:
    return None
  # Proved or not is about the whole problem, with every variant: not proved here.
  stats = dataclasses.replace(result.stats, seconds=time.perf_counter() - start, proved=False)
  return dataclasses.replace(result, stats=stats)


def _value(result: PlanResult) -> float:
  """What the objective ranks (:attr:`PlanResult.value`)."""
  return result.value


def single_subcluster(tables: CostTables, k: int) -> CostTables:
  """The tables of subcluster ``k`` alone."""
  pick = lambda x: None if x is None else (x[k],)
  return tables.replace(
      subcluster_names=(tables.subcluster_names[k],), num_hosts=(tables.num_hosts[k],),
      devices_per_host=(tables.devices_per_host[k],),
      device_memory_bytes=(tables.device_memory_bytes[k],), submeshes=(tables.submeshes[k],),
      stage_time_s=(tables.stage_time_s[k],), param_mem_bytes=(tables.param_mem_bytes[k],),
      act_mem_bytes=(tables.act_mem_bytes[k],),
      intra_bandwidth_bytes_per_s=(tables.intra_bandwidth_bytes_per_s[k],),
      intra_latency_s=(tables.intra_latency_s[k],), inter_bandwidth_bytes_per_s=(),
      inter_latency_s=(), link_bandwidth_bytes_per_s=None, link_latency_s=None,
      logical_mesh=pick(tables.logical_mesh), peak_flops=pick(tables.peak_flops),
      price_per_gpu_hour=pick(tables.price_per_gpu_hour), end_time_s=pick(tables.end_time_s),
      opt_mem_bytes=pick(tables.opt_mem_bytes), gather_time_s=pick(tables.gather_time_s),
      sync_time_s=pick(tables.sync_time_s), workspace_bytes=pick(tables.workspace_bytes),
      step_mem_bytes=pick(tables.step_mem_bytes), remat_modes=pick(tables.remat_modes),
      grad_out_bytes=pick(tables.grad_out_bytes),
      offload_bandwidth_bytes_per_s=pick(tables.offload_bandwidth_bytes_per_s),
      variants=pick(tables.variants),
      host_bandwidth_bytes_per_s=pick(tables.host_bandwidth_bytes_per_s),
      host_latency_s=pick(tables.host_latency_s))


def _best_of_single_subclusters(tables: CostTables, B: int, opts: SolveOptions,
                                result: PlanResult | None, start: float,
                                beat: float = math.inf) -> PlanResult | None:
  """When the search could not prove its optimum: the same search on each subcluster alone
  (a smaller problem the DP covers better), its plan kept if it simulates better (than
  ``result``, and than ``beat``); so the result is never worse than :func:`solve` restricted
  to any one subcluster."""
  best, best_quads, stats = (beat if result is None else min(beat, _value(result))), None, None
  for k in range(tables.num_subclusters):
    try:
      alone = _search(single_subcluster(tables, k), B, opts, time.perf_counter(), beat=best)
    except InfeasiblePlanError:
      continue
    if alone is not None and _value(alone) < best:
      best, stats = _value(alone), alone.stats
      best_quads = [(s.layers[0], s.layers[1], k, s.submesh_index) for s in alone.stages]
  if best_quads is None:
    return result
  log.info("planner: a plan on one subcluster simulates better: %.6g", best)
  stats = dataclasses.replace(stats if result is None else result.stats,
                              seconds=time.perf_counter() - start)
  ev = evaluate_plan(tables, best_quads, B, eps=opts.eps, simulator=True,
                     fwd_fraction=opts.fwd_fraction)
  out = _assemble(tables, None, best_quads, B, ev.period_s, ev.iteration_s, stats, opts)
  assert math.isclose(_value(out), best, rel_tol=1e-9), (_value(out), best)
  return out


def _search(tables: CostTables, B: int, opts: SolveOptions, start: float,
            beat: float = math.inf) -> PlanResult | None:
  """:func:`solve` on one set of tables, for any objective; with ``beat`` finite, only plans
  whose value is below it count (``None`` if there is none).

  One search for every :class:`Objective`: the smallest feasible period ``t_S`` (galloping,
  then binary: monotone in ``tau``; within the budget where there is one), an incumbent from
  ``t_S`` up, the window of candidates whose floor (:func:`_floor`) the incumbent leaves,
  evaluated in batches on the chosen backend (:func:`evaluate_candidates`: the DP of
  :mod:`~harpjax.compiler.plan.dp_kernel`, with the rate criterion when the objective has
  prices), and with the simulator the bounded exact search. The time objective also bounds
  the window by ``G`` (``bound_pruning``).
  """
  goal = objective_of(opts.objective)
  priced = goal.priced or opts.budget_per_hour is not None
  if priced and not tables.has_prices:
    raise PlanError(f"objective {opts.objective!r} (or a budget) needs prices: give the "
                    "subclusters price_per_gpu_hour (CostTables.price_per_gpu_hour)")
  simulated = opts.cost_model == "simulator"
  index = SparseIndex.build(tables, use_all_devices=opts.use_all_devices,
                            keep_order=opts.keep_order, link_bound=simulated)
  cand = index.candidates
  M = cand.size
  kernel = opts.kernel
  rate_max = math.inf if opts.budget_per_hour is None else float(opts.budget_per_hour)
  t_limit = math.inf if opts.time_limit_s is None else float(opts.time_limit_s)
  price = (np.asarray(tables.price_per_gpu_hour, np.float64) if priced else np.zeros(0))
  scoring = Scoring(B, opts.eps, kernel, opts.fwd_fraction if simulated else 0.0, simulated,
                    opts.fwd_fraction, min(index.n_cap(B), B),
                    opts.hidden_share if not priced else 1.0,
                    kind=goal.kind if priced else -1, rate_max=rate_max, t_limit=t_limit,
                    price=tuple(float(x) for x in price))
  log.info("planner: %d layers, %d devices, %d feasible entries, %d period candidates",
           tables.num_layers, tables.total_devices, index.num_entries, M)
  # Feasibility of "a plan with every stage and cut <= tau" (within the budget, if any).
  budget = index.pricing(price, goal.kind, rate_max) if math.isfinite(rate_max) else None

  n_g = [0]
  known = {}   # the bounds at the first candidate found feasible: bounds below it too
  # G at the candidates where it was taken (the time objective, from t_S): G is
  # non-increasing in the period, so its value at one candidate bounds it from above at every
  # larger one.
  g_seen: dict[int, float] = {}

  def g(idx) -> bool:  # G-feasibility: a plan with every stage and cut <= tau (monotone)
    n_g[0] += 1
    tau = float(cand[idx])
    if known and known["idx"] > idx:
      lb, sb = known["lb"], known["sb"]
    else:   # the prefix bound the kernel takes here, kept for the probes below if feasible
      lb, sb = index.prefix_bound(tau), None
    if budget is None:   # existence alone: the fewest warm-ups per state, not the cost
      ok = index.feasible(tau, B, opts.eps, lb=lb, sb=sb, use_numba=kernel == "numba")
    else:
      ok = math.isfinite(index.run(tau, B, opts.eps, require_hit=False, kernel=kernel, lb=lb,
                                   sb=sb, pricing=budget)[0])
    if ok and not known:   # the gallop's first feasible candidate
      known.update(idx=idx, lb=lb, sb=index.suffix_bound(tau, lb))
    return ok

  def infeasible():
    return infeasible_error(tables, B, opts.eps, opts.use_all_devices, opts.keep_order,
                            simulated)

  top_bounds = {}

  g_plans = []   # plans the lower bounds found on the way: candidates for the incumbent

  def g_bounded(idx, top):  # G at idx with the prefix and suffix bounds of candidate top
    n_g[0] += 1
    if top_bounds.get("top") != top:
      if known and known["idx"] < top:   # grown from the first feasible probe's: the same
        lb = index.grow_prefix_bounds(float(cand[known["idx"]]), float(cand[top]), -1.0,
                                      (known["lb"].copy(), np.zeros((0, 0))))[0]
      else:
        lb = index.prefix_bound(float(cand[top]))
      top_bounds.update(top=top, lb=lb, sb=index.suffix_bound(float(cand[top]), lb))
    # G here is at most G at any smaller candidate: with that as the DP's bound it returns
    # the same plan (only plans no cheaper than it are pruned) and prunes the rest.
    tau = float(cand[idx])
    if not g_seen and t_s_idx <= idx:   # G at t_S, with the bounds of its first probe
      n_g[0] += 1
      g_seen[t_s_idx] = index.run(float(cand[t_s_idx]), B, opts.eps, require_hit=False,
                                  kernel=kernel, lb=known["lb"], sb=known["sb"])[0]
    upper = min((v for c, v in g_seen.items() if c <= idx), default=math.inf)
    value, path = index.run(tau, B, opts.eps, require_hit=False, kernel=kernel,
                            lb=top_bounds["lb"], sb=top_bounds["sb"],
                            bound=upper + (B - 1) * tau)
    if math.isfinite(value):
      g_plans.append(path)
      g_seen[idx] = float(value)
    return value

  slack = 1.0 + BOUND_SLACK
  feasible = g
  if math.isfinite(beat):   # periods whose floor is beyond beat cannot win: not even tested
    if priced:
      floors = (index.cover_rates(price) * B * cand + 3600.0 * index.least_fee(B)
                if goal.kind == KIND_COST else B * cand)
      floors[(B * cand > t_limit * slack) | (index.cover_rates(price) > rate_max * slack)] = \
          math.inf
      within = np.flatnonzero(floors <= beat * slack)
      top = int(within[-1]) + 1 if within.size else 0
    else:
      top = int(np.searchsorted(cand, beat * slack / B, side="right"))
    if top == 0 or not feasible(top - 1):
      return None
    t_s_idx = _smallest_feasible(top, feasible)
  else:
    # A first probe a little above the work-based estimate is usually feasible; its bounds
    # then make every probe below it cheap.
    guess = int(np.searchsorted(cand, 1.25 * _period_estimate(tables)))
    t_s_idx = _smallest_feasible(M, feasible, guess, cand) if M else None
  if t_s_idx is None:
    if M and budget is not None and math.isfinite(index.run(
        float(cand[-1]), B, opts.eps, require_hit=False, kernel=kernel)[0]):
      raise _budget_error(tables, B, opts)
    raise infeasible()
  best = None   # (score, key, candidate index, x, path): the least (score, key, index) wins
  bound = beat
  n_incumbent = 0

  def keep(found):
    nonlocal best, bound
    for idx, x, score, path in found:
      key = x if priced else 0.0   # with prices, ties go to the lower rate
      if score < beat and (best is None or (score, key, idx) < best[:3]):
        best = (score, key, idx, x, path)
        bound = min(bound, score)

  first = t_s_idx
  if not math.isfinite(beat):   # the incumbent: from t_S up until a candidate has a plan
    while first < M and _floor(index, scoring, first) <= bound * slack:
      found, runs = evaluate_candidates(index, [first], scoring, bound, above=(
          (known["lb"], known["sb"]) if known and known["idx"] >= first else None))
      n_incumbent += runs
      keep(found)
      first += 1
      if found:
        break
    if best is None and not priced:   # every plan within a period fails at its own period
      raise infeasible()
  # Without prices every floor is at least B tau: the candidates beyond bound / B are out.
  last = M if priced else min(M, int(np.searchsorted(cand, bound * slack / B, side="right")))
  window = [c for c in range(first, last) if _floor(index, scoring, c) <= bound * slack]
  t_e = float(cand[window[-1]]) if window else float(cand[first - 1])
  sigma_lb: dict[int, float] | float = {} if not priced else 0.0
  num_window = len(window)
  if opts.bound_pruning and window and not priced:
    sigma_lb = _piecewise_sigma(index, window, g_bounded, opts.bound_pieces)
    # The plans behind those bounds (every stage within a slice's top): the valid ones (their
    # memory checked with the warm-ups of their own period) tighten the bound first.
    for path in g_plans:
      found = _valid_plan(index, path, scoring)
      if found is not None:
        score, idx, sur, path = found
        keep([(idx, sur, score, path)])
    window = [c for c in window if _floor(index, scoring, c, sigma_lb[c], scoring.capped(
        cand[c], index.hit_cap(cand[c], B), bound)) <= bound * slack]
  log.info("planner: t_S=%.6g s (candidate %d), incumbent %.6g, %d candidates up to "
           "%.6g s, %d left after the lower bound", cand[t_s_idx], t_s_idx, bound,
           num_window, t_e, len(window))
  backend, workers = _backend(opts, index, window)
  args = (scoring, bound, sigma_lb)
  if backend == "sequential" or not window:
    above = None   # bounds the search already took at a candidate at or above the window's
    if window and top_bounds and top_bounds["top"] >= window[-1]:
      above = (top_bounds["lb"], top_bounds["sb"])
    elif window and known and known["idx"] >= window[-1]:
      above = (known["lb"], known["sb"])
    results, runs = evaluate_candidates(index, window, *args, above=above)
    workers_used = 1
  else:
    batches = _balanced_batches(index, window, workers)
    results, runs = _run_parallel(index, batches, args, backend, workers, opts.timeout_s,
                                  opts.start_method)
    workers_used = min(workers, len(batches))
  keep(results)
  if best is None and math.isfinite(beat):
    return None
  num_sim = (len(results) + n_incumbent) if simulated else 0
  proved, nodes = None, 0
  if simulated and opts.proof_nodes > 0 and (best is not None or priced):
    found, proved, nodes, n_sim = prove_time(index, scoring, bound, opts.proof_nodes)
    num_sim += n_sim
    if found is not None and (best is None or found[0] < best[0]):
      best = (found[0], -math.inf, found[1], math.nan, found[2])
  if best is None and math.isfinite(beat):
    return None
  if best is None:
    if math.isfinite(rate_max) and index.cut_fee is not None:
      err = InfeasiblePlanError(f"no pipeline plan for {tables.describe()} with B={B} keeps the "
                                f"budget of {rate_max:g} per hour with its transfer fees "
                                "(the GPUs' rate plus 3600 x fees per iteration / iteration "
                                "seconds); raise the budget")
      err.constraint = "budget"
      raise err
    if math.isfinite(t_limit):
      err = InfeasiblePlanError(f"no pipeline plan for {tables.describe()} with B={B} runs an "
                                f"iteration within time_limit_s={t_limit:g} s"
                                + (f" and budget {rate_max:g}/h" if math.isfinite(rate_max)
                                   else ""))
      err.constraint = "time"
      raise err
    raise infeasible()
  score, _, idx, _, path = best
  stats = SearchStats(num_entries=index.num_entries, num_candidates=M, t_s=float(cand[t_s_idx]),
                      t_e=t_e, num_window=num_window,
                      num_pruned_by_bound=num_window - len(window),
                      num_evaluated=runs + n_incumbent, num_feasibility_runs=n_g[0],
                      backend=backend, workers=workers_used,
                      seconds=time.perf_counter() - start, num_simulated=num_sim,
                      proved=proved, proof_nodes=nodes)
  result = _assemble(tables, index, path, B, float(cand[idx]),
                     math.nan if priced else score, stats, opts)
  if priced:   # the time each objective ranks by: the simulated one, or Eq. 12 (+ e_0)
    objective = (result.iteration_s if simulated
                 else result.eq12_s + float(index.arrays.ent_e[int(np.asarray(path)[0])]))
    cost = result.rate_per_hour * objective / 3600.0 + result.fees_per_iteration
    result = dataclasses.replace(result, objective_s=objective, cost_per_iteration=cost,
                                 plan=result.plan.replace(meta=dict(
                                     result.plan.meta, cost_per_iteration=cost)))
    assert math.isclose(result.value, score, rel_tol=1e-9), (result.value, score)
    assert result.rate_with_fees_per_hour <= rate_max * (1 + 1e-9), (
        result.rate_with_fees_per_hour, rate_max)
    assert objective <= t_limit * (1 + 1e-12), (objective, t_limit)
  log.info("planner: %s, %d stages on %d devices, t_max=%.6g s, %s %.6g s, %s%.2f s search "
           "(%s)%s", opts.objective, len(result.stages), result.num_devices, result.t_max_s,
           "simulated" if simulated else "Eq. 12", result.objective_s,
           "" if result.rate_per_hour is None else
           f"{result.rate_per_hour:.6g} per hour, {result.cost_per_iteration:.6g} per "
           "iteration, ", stats.seconds, backend, "" if proved is None else
           (", optimum proved" if proved else ", proof budget exhausted"))
  return result


def _floor(index: SparseIndex, scoring: Scoring, c: int, sigma_lb: float = 0.0,
           hit_cap: int | None = None) -> float:
  """A lower bound on the ranked value of every plan of period ``candidates[c]``: with prices
  the cheapest cover's rate (:meth:`~harpjax.compiler.plan.index.SparseIndex.cover_rates`)
  times ``B tau`` (``inf`` beyond the budget or the time limit); else :meth:`Scoring.floor`
  with ``sigma_lb`` and ``hit_cap``."""
  tau = float(index.candidates[c])
  if scoring.priced:
    cover = index.cover_rates(np.asarray(scoring.price, np.float64))[c]
    if cover > scoring.rate_max * (1.0 + BOUND_SLACK):
      return math.inf
    return scoring.priced_floor(tau, cover, index.least_fee(scoring.num_microbatches))
  return scoring.floor(tau, sigma_lb, hit_cap, float(index.candidate_hit_ends[c]))


def _backend(opts: SolveOptions, index: SparseIndex, window: Sequence[int]) -> tuple[str, int]:
  """The backend and the number of workers for a window of candidates (``"auto"``: worker
  processes when the candidates hold at least ``parallel_min_work`` active entries)."""
  workers = opts.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1)
  backend = opts.backend
  if backend == "auto":
    work = sum(index.active_entries(index.candidates[c]) for c in window)
    backend = "process" if (workers > 1 and len(window) > 1
                            and work >= opts.parallel_min_work) else "sequential"
  return backend, workers


def _smallest_feasible(M: int, feasible: Callable[[int], bool], start: int = 0,
                       values: np.ndarray | None = None) -> int | None:
  """The smallest candidate index at which ``feasible`` (monotone) holds, ``None`` if none:
  a galloping search upwards from ``start`` (a guess at or below the answer; a test costs more
  the larger the candidate, since more entries are active), then a binary search. A guess
  above the answer only costs a binary search below it. With the candidates' ``values``
  (ascending, > 0) and a guess, the gallop's steps grow in value (0.5%, 1%, 2%, ... above the
  guess) rather than in index."""
  start = min(max(start, 0), M - 1)
  lo, step = 0, 1
  if start > 0:
    if feasible(start):
      lo, probe = 0, start
      step = 0
    else:
      lo = start + 1
  rel = 0.005 if (values is not None and start > 0) else 0.0
  while step:
    if rel:
      probe = int(np.searchsorted(values, values[start] * (1.0 + rel)))
      probe = min(max(probe, lo), M - 1)
      rel *= 2
    else:
      probe = min(lo + step - 1, M - 1)
      step *= 2
    if feasible(probe):
      break
    if probe == M - 1:
      return None
    lo = probe + 1
  hi = probe
  while lo < hi:
    mid = (lo + hi) // 2
    if feasible(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


def _valid_plan(index: SparseIndex, path: np.ndarray, scoring: Scoring
                ) -> tuple[float, int, float, np.ndarray] | None:
  """``(score, candidate index, Eq. 12-like value, path)`` of a DP path whose warm-ups were
  taken at some larger period, if it fits memory with those of its own period."""
  t, c, e, warm = plan_arrays(index, path, scoring.eps)
  ix = index.arrays
  B = scoring.num_microbatches
  ent = np.asarray(path, np.int64)
  if np.any(ix.ent_p[ent] + np.minimum(warm, B) * ix.ent_a[ent] > ix.mem[index.ent_k[ent]]):
    return None
  period = pipeline_period(c, float(t.max()))
  if not scoring.simulated and period > t.max():
    return None   # the paper's rule: every cut within the bottleneck stage's time
  idx = int(np.searchsorted(index.candidates, period))
  sur = float(np.sum(t + 2.0 * c) + e[0] + (B - 1) * period)
  score = float(simulate_paths(index, [path], scoring)[0]) if scoring.simulated else sur
  return score, idx, sur, path


def _piecewise_sigma(index: SparseIndex, window: list[int],
                     g: Callable[[int, int], float], pieces: int) -> dict[int, float]:
  """Per candidate of the window, a lower bound on the DP's value of its plans: ``G`` (the
  cheapest ``sum (t + 2 c)`` with every stage within the period, no hit required) is
  non-increasing in the period, so ``G`` at the top of each of ``pieces`` slices of the window
  bounds every candidate of the slice."""
  n = len(window)
  cuts = sorted({window[min(n - 1, (q * n) // pieces - 1)] for q in range(1, pieces + 1)})
  out, lo = {}, 0
  top = window[-1]
  for b in cuts:
    sig = g(b, top)
    for c in window[lo:]:
      if c > b:
        break
      out[c] = sig
      lo += 1
  return out


def _period_estimate(tables: CostTables) -> float:
  """A guess at the smallest period, from below when each stage costs at least its layers'
  single-device work spread over its devices (additive costs): the model's single-device time
  on every device at once, ``1 / sum_k D_k / T_k``. Only the starting point of a search."""
  rate = 0.0
  for k in range(tables.num_subclusters):
    sizes = [n * m for n, m in tables.submeshes[k]]
    s = int(np.argmin(sizes))
    t = np.array([tables.stage_time_s[k][x, x, s] for x in range(tables.num_layers)])
    if np.isfinite(t).all() and t.sum() > 0:
      rate += tables.subcluster_devices[k] / (t.sum() * sizes[s])
  return 1.0 / rate if rate > 0 else 0.0


def _assemble(tables: CostTables, index: SparseIndex | None, path, B: int,
              period: float, objective: float, stats: SearchStats,
              opts: SolveOptions) -> PlanResult:
  """The result for a DP path of ``index`` (or, with ``index=None``, stage quads)."""
  if index is None:
    quads = list(path)
  else:
    quads = [index.entry(x) for x in np.asarray(path, dtype=np.int64)]
  ev = evaluate_plan(tables, quads, B, H1F1B, eps=opts.eps, simulator=True,
                     fwd_fraction=opts.fwd_fraction)
  simulated = opts.cost_model == "simulator"
  iteration = ev.iteration_s
  rate = ev.rate_per_hour
  fees = ev.fees_per_iteration
  cost = None if rate is None else rate * objective / 3600.0 + fees
  # The search's bookkeeping and the evaluator must agree (an internal invariant).
  assert ev.period_s == period, (ev.period_s, period)
  assert ev.feasible, ev.violations
  assert ev.comm_ok or simulated, ev.violations
  assert ev.uses_all_devices or not opts.use_all_devices, ev.violations
  if math.isnan(objective):   # filled in by the caller
    pass
  elif simulated:
    assert iteration == objective, (iteration, objective)
  else:
    assert math.isclose(ev.eq12_s + ev.end_s[0], objective, rel_tol=1e-9), (ev.eq12_s,
                                                                             objective)
  stages = ev.stages
  specs = tuple(StageSpec(layers=s.layers, subcluster=s.subcluster_name, submesh=s.submesh,
                          logical_mesh=s.logical_mesh, warmup=s.warmup, time_s=s.time_s,
                          comm_s=s.comm_s, zero=s.zero, offload=s.offload,
                          offload_activations=s.offload_activations, remat=s.remat)
                for s in stages)
  plan = Plan(stages=specs, num_microbatches=B, schedule=ev.schedule,
              num_layers=tables.num_layers,
              t_max_s=ev.t_max_s, predicted_iteration_s=iteration, eta=ev.eta,
              meta={"planner": "harpjax.dp", "eps": opts.eps, "cost_model": opts.cost_model,
                    "fwd_fraction": opts.fwd_fraction, "period_s": ev.period_s,
                    "eq12_s": ev.eq12_s, "use_all_devices": opts.use_all_devices,
                    "keep_order": opts.keep_order, "objective": opts.objective,
                    "rate_per_hour": rate, "cost_per_iteration": cost})
  return PlanResult(plan=plan, objective_s=objective, t_max_s=ev.t_max_s, stages=stages,
                    warmups=ev.warmups, num_microbatches=B, eps=opts.eps, stats=stats,
                    rate_per_hour=rate, cost_per_iteration=cost, objective=opts.objective,
                    iteration_s=iteration, eq12_s=ev.eq12_s, period_s=ev.period_s,
                    fees_per_iteration=fees, transfer_bytes=ev.transfer_bytes)


def prove_time(index: SparseIndex, scoring: Scoring, best: float, node_budget: int
               ) -> tuple[tuple[float, int, np.ndarray] | None, bool, int, int]:
  """The bounded exact search (:func:`~harpjax.compiler.plan.dp_kernel.bounded_search`) after
  the DP, over the index's state graph, for the objective of ``scoring`` (its prices, budget
  and time limit).

  Returns:
    ``(found, complete, nodes, simulated)``: ``(value, candidate index, path)`` of a plan
    better than ``best`` (``None`` if none), whether the search finished (then nothing beats
    the best of the two), the suffixes visited and the plans simulated.
  """
  B = scoring.num_microbatches
  cand = index.candidates
  r_min = 0.0
  price = np.asarray(scoring.price, np.float64) if scoring.priced else None
  kind = scoring.kind if scoring.priced else KIND_TIME
  rate_max, t_limit = scoring.rate_max, scoring.t_limit
  if price is not None:
    r_min = index.r_min(price)
  ok = B * cand <= t_limit * (1.0 + BOUND_SLACK)
  if price is None:
    floor = B * cand
  else:
    cover = index.cover_rates(price)
    ok &= cover <= rate_max * (1.0 + BOUND_SLACK)
    floor = (B * cand if kind == KIND_TIME
             else cover * B * cand + 3600.0 * index.least_fee(B))
  keep = np.flatnonzero((floor <= best * (1.0 + BOUND_SLACK)) & ok)
  value, pos, path, nodes, n_sim, complete = dp_kernel.bounded_search(
      index.arrays, index.ends, cand[keep], B, scoring.eps, scoring.fwd_fraction,
      scoring.nmax, kind, best, price, rate_max, t_limit, r_min, node_budget,
      use_numba=scoring.kernel == "numba", fee=index.fees(B) if price is not None else None)
  log.info("planner: bounded exact search: %d suffixes, %d plans simulated, %s", nodes, n_sim,
           "complete" if complete else "budget exhausted")
  found = None if pos < 0 else (value, int(keep[pos]), path)
  return found, complete, nodes, n_sim


def _budget_error(tables: CostTables, B: int, opts: SolveOptions) -> InfeasiblePlanError:
  price = tables.price_per_gpu_hour
  cheapest = min(p * n * m for k, p in enumerate(price) for n, m in tables.submeshes[k])
  err = InfeasiblePlanError(
      f"no pipeline plan for {tables.describe()} with B={B} fits the budget of "
      f"{opts.budget_per_hour:g} per hour (plans exist without it; the cheapest single "
      f"submesh costs {cheapest:g} per hour)")
  err.constraint = "budget"
  return err
