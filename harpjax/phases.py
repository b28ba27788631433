"""The phases of a step, and their results, each of which advances itself.

After JAX's ``Traced -> Lowered -> Compiled`` (``jax/_src/stages.py``)::

    step.trace(*args)          # Traced:  the step's programs and the layers a plan indexes
        .plan()                # Planned: the resolved plan, its schedule, the profile behind it
        .layout()              # LaidOut: the step cut into the plan's stages (no devices)
        .compile()             # CompiledStep: executables on this process's devices
                               # (or .lower(): a LoweredStep for other processes)

Each phase is a function here, with everything that phase owns: the trace phase cuts the
layers a plan indexes (marked, or automatic with the options the plan records); the plan phase
reads a plan file (a damaged one is replaced by automatic planning), profiles and solves
(automatic planning, the microbatch's rows for mixed-type stages, why no plan fits), and
resolves the plan on the cluster; the layout phase traces the step again where a stage splits
its rows, and when the planner's mixed-type stages cannot split this step's rows plans again
without them; the compile phase compiles every stage ahead of the first call in one pool of
threads. The step (:class:`harpjax.ParallelStep`) only drives them, caching each result per
argument structure.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable

from harpjax import _compat
from harpjax.cluster import Cluster
from harpjax.compiler.layers import (LayerSequence, layers_for_step, layers_from_boundaries,
                                     traced_step_for)
from harpjax.compiler.plan import MixedOptions, Plan, load_plan, solve, zebra_for_runtime
from harpjax.compiler.profile import (ProfileResult, default_cache_dir, profile_step,
                                      progress_bar)
from harpjax.compiler.schedule import Schedule
from harpjax.compiler.stages import (CompiledStep, LoweredStep, StepProgram, batch_rows,
                                     compile_step, default_workers, layout_step, lower_step,
                                     precompile, resolve_plan, retrace, check_zebra_runs)
from harpjax.compiler.trace import TracedStep, trace_step
from harpjax.errors import HarpjaxError, InfeasiblePlanError, MicrobatchError, PlanError
from harpjax.options import AutoPlan, ParallelOptions

log = logging.getLogger(__name__)

__all__ = ["Traced", "Planned", "LaidOut", "num_microbatches", "read_plan", "trace_phase",
           "plan_phase", "layout_phase", "compile_phase", "use_compilation_cache"]


# --------------------------------------------------------------------------- results


def _advance(result, until: str):
  if result._advance is None:
    raise HarpjaxError(f"this {type(result).__name__} was not made by a harpjax.ParallelStep: "
                       f"call step.trace(*args) and go on from there")
  return result._advance(until)


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
  """The trace phase's result: the traced step and the layers its plan indexes (hand-marked,
  or constructed automatically when the plan is automatic or was made on automatic layers).

  Attributes:
    step: the :class:`~harpjax.compiler.trace.TracedStep`.
    layers: the :class:`~harpjax.LayerSequence`.
  """
  step: TracedStep
  layers: LayerSequence
  _advance: Callable[[str], Any] | None = dataclasses.field(default=None, repr=False)

  def plan(self) -> "Planned":
    """The plan phase's result for these arguments (cached by the step)."""
    return _advance(self, "plan")


@dataclasses.dataclass(frozen=True, eq=False)
class Planned:
  """The plan phase's result.

  Attributes:
    traced: the trace phase's result it was planned on.
    plan: the resolved :class:`~harpjax.Plan` (devices, warm-up counts and schedule filled in).
    schedule: its :class:`~harpjax.Schedule`.
    profile: the profile automatic planning made (``None`` when a plan was given).
  """
  traced: Traced
  plan: Plan
  schedule: Schedule
  profile: ProfileResult | None
  _advance: Callable[[str], Any] | None = dataclasses.field(default=None, repr=False)

  def layout(self) -> "LaidOut":
    """The layout phase's result (cached by the step)."""
    return _advance(self, "layout")


@dataclasses.dataclass(frozen=True, eq=False)
class LaidOut:
  """The layout phase's result: the step cut into the plan's stages and laid out.

  Attributes:
    planned: the plan phase's result it was laid out on (another than the one it advanced
      from when the planner's mixed-type stages could not split the step's rows).
    program: the :class:`~harpjax.compiler.stages.StepProgram` (programs, pure functions and
      the picklable layout; no devices).
  """
  planned: Planned
  program: StepProgram
  _advance: Callable[[str], Any] | None = dataclasses.field(default=None, repr=False)

  def compile(self) -> CompiledStep:
    """The step compiled on this process's devices (cached by the step)."""
    return _advance(self, "compile")

  def lower(self) -> LoweredStep:
    """The step lowered for other processes: its layout and serialised executables."""
    return lower_step(self.program)


# --------------------------------------------------------------------------- trace


def read_plan(path: str | os.PathLike) -> Plan | None:
  """The plan saved in ``path``; ``None`` (with a warning) when the file is damaged (cut
  short by an interrupted save, zeroed): automatic planning replaces it, and the step's numbers
  do not depend on the plan.

  Raises:
    PlanError: the file is missing, unreadable, or valid JSON but not a valid plan.
  """
  try:
    return load_plan(path)
  except PlanError as e:
    if not _damaged_file(path):
      raise
    log.warning("%s; planning automatically instead", e)
    return None


def num_microbatches(options: ParallelOptions, given: Plan | None) -> int:
  """``B``: the option's, or the given plan's.

  Raises:
    PlanError: both are given and differ.
    MicrobatchError: neither is.
  """
  B, planned = options.num_microbatches, None if given is None else given.num_microbatches
  if B is not None and planned is not None and int(B) != int(planned):
    raise PlanError(f"num_microbatches={B} but the plan given was made for B={planned}: pass "
                    "one of them only, or the same B")
  B = planned if B is None else B
  if B is None:
    raise MicrobatchError("num_microbatches is not set: pass num_microbatches=B to "
                          "auto_parallel or set it in the plan")
  return int(B)


def trace_phase(fun: Callable, args: tuple, options: ParallelOptions,
                given: Plan | None) -> tuple[TracedStep, LayerSequence]:
  """The step traced, and the layers its plan indexes: the marked ones for a plan on marked
  layers, else constructed automatically (with the options the plan records, or automatic
  planning's)."""
  ts = trace_step(fun, args, num_microbatches=num_microbatches(options, given),
                  batch_argnums=options.batch_argnums, batch_coupling=options.batch_coupling)
  if given is not None and given.layer_source != "auto":
    return ts, layers_from_boundaries(ts.region, ts.boundary_cuts)
  layer_options = options.auto.layers if given is None else given.layer_options
  layers = layers_for_step(ts, layer_options)
  return traced_step_for(ts, layers), layers


# --------------------------------------------------------------------------- plan


def plan_phase(fun: Callable, args: tuple, traced: Traced, cluster: Cluster,
               options: ParallelOptions, given: Plan | None, mixed: bool = True
               ) -> tuple[Plan, Schedule, ProfileResult | None]:
  """The plan these arguments run with, resolved on ``cluster``: ``given``, or automatic
  planning's (``mixed=False``: without mixed-type stages).

  Returns:
    ``(resolved plan, its schedule, the profile behind it or None)``.
  """
  plan, profile = given, None
  if plan is None:
    plan, profile = _plan_automatically(fun, args, traced, cluster, options, mixed)
  plan, schedule = resolve_plan(plan, cluster, len(traced.layers), traced.step.num_microbatches)
  log.info("plan: %d stages over %d layers with %s, B=%d", plan.num_stages,
           len(traced.layers), schedule.name, schedule.num_microbatches)
  return plan, schedule, profile


def _plan_automatically(fun: Callable, args: tuple, traced: Traced, cluster: Cluster,
                        options: ParallelOptions, mixed: bool) -> tuple[Plan, ProfileResult]:
  """Cost tables from the layers, then the search."""
  auto: AutoPlan = options.auto
  result = profile_step(fun, args, cluster, num_microbatches=traced.step.num_microbatches,
                        batch_argnums=options.batch_argnums, layer_options=auto.layers,
                        options=auto.profile, layers=traced.layers, traced=traced.step)
  log.info("profiled: %s", result.stats.describe())
  solve_opts = auto.solve
  if not mixed:
    solve_opts = dataclasses.replace(solve_opts, mixed_stages="off")
  if solve_opts.mixed_stages != "off":   # mixed-type stages split the microbatch's rows
    mopts = zebra_for_runtime(solve_opts.mixed_options or MixedOptions(), options.local)
    if mopts.microbatch_rows is None:
      mopts = dataclasses.replace(mopts, microbatch_rows=batch_rows(
          args, options.batch_argnums) // traced.step.num_microbatches)
    solve_opts = dataclasses.replace(solve_opts, mixed_options=mopts)
  try:
    plan = solve(result.tables, traced.step.num_microbatches, options=solve_opts).plan
  except InfeasiblePlanError as e:
    st = result.stats
    if st.pruned_oom or st.pruned_tasks:
      raise InfeasiblePlanError(
          f"{e}. The profiler found {st.pruned_oom + st.pruned_tasks} stage candidates that "
          f"do not fit device memory (and {st.pruned_imbalance} hopelessly imbalanced "
          "ones): use more or larger GPUs, fewer or smaller microbatches, or "
          "ProfileOptions(remat=True)") from None
    raise
  # a choice of modes or "dots": every stage says its own (StageSpec.remat)
  remat = "full" if auto.profile.remat_modes == ("full",) else "none"
  rows = batch_rows(args, options.batch_argnums) // traced.step.num_microbatches
  return plan.replace(remat=remat, layer_source="auto", layer_options=auto.layers,
                      microbatch_size=rows), result


# --------------------------------------------------------------------------- layout


def layout_phase(fun: Callable, args: tuple, planned: Planned, cluster: Cluster,
                 options: ParallelOptions, replanned: Callable[..., Planned]
                 ) -> tuple[Planned, StepProgram]:
  """The step cut into the plan's stages and laid out, traced again at other rows per
  microbatch where a stage splits them.

  When a mixed-type stage the planner chose cannot split this step's rows (a statistic over
  the batch inside the region), the plan phase runs again without mixed-type stages
  (``replanned(mixed=False)`` gives its result) and that plan is laid out.

  Returns:
    ``(the plan phase's result laid out, the StepProgram)``.

  Raises:
    ZebraPlanOnlyError: the plan has a zebra stage the runtime does not run (the Ray
      runtime, an interleaved schedule, ZeRO or offloads on it:
      :func:`harpjax.compiler.stages.zebra.check_zebra_runs`).
  """
  check_zebra_runs(planned.plan, local=options.local)
  try:
    return planned, _layout(fun, args, planned, options)
  except PlanError as e:
    if planned.profile is None or not any(s.mixed for s in planned.plan.stages):
      raise
    log.warning("the plan's mixed-type stages cannot split this step's rows (%s); "
                "planning without them", e)
  planned = replanned(mixed=False)
  return planned, _layout(fun, args, planned, options)


def _layout(fun: Callable, args: tuple, planned: Planned,
            options: ParallelOptions) -> StepProgram:
  traced = planned.traced
  again = retrace(fun, args, traced.step, traced.layers, options.batch_argnums)
  return layout_step(traced.step, traced.layers, planned.plan, planned.schedule,
                     options.loss_reduction, again)


# --------------------------------------------------------------------------- compile


def use_compilation_cache(setting: bool | str) -> None:
  """JAX's persistent compilation cache as ``setting`` says (``True``: ``executables/`` of
  harpjax's cache directory; a directory; ``False``: leave JAX's setting alone)."""
  if setting is False:
    return
  path = os.path.join(default_cache_dir(), "executables") if setting is True else setting
  path, set_here = _compat.use_persistent_compilation_cache(os.path.expanduser(path))
  if set_here:
    log.info("compiled executables are kept in %s (JAX's persistent compilation cache)", path)


def compile_phase(program: StepProgram, cluster: Cluster, workers: int | None = 0,
                  progress: bool | None = None) -> CompiledStep:
  """The step's executables on this process's devices, compiled ahead of the first call by
  ``workers`` threads (``None``: one per stage, at most one per CPU; ``0``: lazily, on the
  first call), the largest stage first, with a progress bar over the stages."""
  local = cluster.local_devices()
  cs = compile_step(program, [[local[i] for i in s.all_devices] for s in program.plan.stages])
  if workers is None:
    workers = default_workers(program.num_stages)
  if workers:
    groups = {gi: fn for gi, fn in enumerate(cs.group_fns)}
    order = sorted(range(cs.num_stages), key=lambda s: -len(program.programs[s].ops))
    with progress_bar(cs.num_stages, progress, "compiling", unit="stage") as bar:
      seconds = precompile(cs.layout, dict(enumerate(cs.stages)), groups, workers, order,
                           done=lambda s: bar.update(1))
    log.info("compiled the executables of %d stages in %.1f s (%d threads)",
             program.num_stages, seconds, workers)
  return cs


def _damaged_file(path) -> bool:
  """Whether ``path`` is a file whose content is not JSON (truncated, zeroed, not text)."""
  try:
    with open(path, "rb") as f:
      json.loads(f.read().decode())
  except (ValueError, UnicodeDecodeError):
    return True
  except OSError:
    return False
  return False
