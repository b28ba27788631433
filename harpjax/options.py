"""What a step is configured with, grouped by the phase that reads it.

``auto_parallel(fun, cluster=..., num_microbatches=B, plan=..., runtime=..., checkpoint=...,
elastic=...)``:

* **what to plan with**, one typed choice (``plan=``): a plan to follow (a
  :class:`~harpjax.Plan`, from :func:`~harpjax.ManualPlan` or a saved plan's path), whose
  schedule, H-1F1B tolerance, remat and offloads are its own fields; or :class:`AutoPlan`
  (the default), automatic planning with its :class:`~harpjax.LayerOptions`,
  :class:`~harpjax.ProfileOptions` and :class:`~harpjax.SolveOptions`. An option of one
  cannot be given to the other.
* **how to run**, one typed choice (``runtime=``): :class:`~harpjax.LocalRuntime` (every stage
  in this process; ``"local"``, the default) or :class:`~harpjax.RayRuntime` (a worker per
  stage; ``"ray"``), each with its own options.
* **how to recover**: ``checkpoint=`` (:class:`~harpjax.CheckpointOptions` or a directory) and
  ``elastic=`` (:class:`~harpjax.ElasticOptions`; the Ray runtime and a checkpoint).
* how the step's batch is split (``num_microbatches``, ``batch_argnums``,
  ``loss_reduction``, ``batch_coupling``), read by tracing whatever the plan.

Every choice is made in one place. The spellings of earlier releases (``schedule=``,
``eps=``, ``layer_options=``, ``profile_options=``, ``solve_options=``, ``runtime_options=``,
``compilation_cache=``, ``offload=`` on ``auto_parallel``) still work for this release, with a
``DeprecationWarning`` naming the new place, and are refused where they contradict it
(:class:`~harpjax.errors.OptionConflictError`).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from typing import Any, Callable, Sequence

from harpjax.compiler.layers import LayerOptions
from harpjax.compiler.plan import RANK, MixedOptions, Plan, SolveOptions
from harpjax.compiler.profile import ProfileOptions
from harpjax.compiler.schedule import schedule_key
from harpjax.compiler.stages import LOSS_REDUCTIONS, OffloadOptions
from harpjax.compiler.trace import BATCH_COUPLING
from harpjax.errors import (HarpjaxError, InvalidOptionError, MicrobatchError,
                            OptionConflictError, UnknownOptionError)
from harpjax.runtime import CheckpointOptions, ElasticOptions, LocalRuntime, RayRuntime

__all__ = ["AutoPlan", "ParallelOptions", "RUNTIMES", "parallel_options"]

RUNTIMES = {"local": LocalRuntime, "ray": RayRuntime}
"""The runtimes by name: ``runtime="ray"`` is ``RayRuntime()``."""


@dataclasses.dataclass(frozen=True)
class AutoPlan:
  """Automatic planning (``auto_parallel(plan=harpjax.AutoPlan(...))``, the default): on the
  first call the step's forward program is cut into layers, each candidate stage is costed on
  the cluster's GPU types, and the planner picks the stages, their submeshes, logical meshes,
  ZeRO levels, offloads and remat, and the schedule.

  Attributes:
    layers: how the layers are cut (:class:`~harpjax.LayerOptions`).
    profile: how they are costed (:class:`~harpjax.ProfileOptions`: the cost source, the
      profile cache, the remat modes to cost).
    solve: what the search optimises and may choose (:class:`~harpjax.SolveOptions`: the
      objective, the H-1F1B tolerance ``eps``, the schedule, ZeRO levels, offloads, mixed-type
      stages).

  Raises:
    InvalidOptionError: a field is not of its class.
  """
  layers: LayerOptions = dataclasses.field(default_factory=LayerOptions)
  profile: ProfileOptions = dataclasses.field(default_factory=ProfileOptions)
  solve: SolveOptions = dataclasses.field(default_factory=SolveOptions)

  def __post_init__(self):
    for name, cls in (("layers", LayerOptions), ("profile", ProfileOptions),
                      ("solve", SolveOptions)):
      v = getattr(self, name)
      if v is None:
        object.__setattr__(self, name, cls())
      elif not isinstance(v, cls):
        raise InvalidOptionError(f"AutoPlan.{name}={v!r}: give a harpjax.{cls.__name__}")
    mixed = self.solve.mixed_options
    if mixed is not None and not isinstance(mixed, MixedOptions):
      raise InvalidOptionError(f"SolveOptions.mixed_options={mixed!r}: give a "
                               "harpjax.MixedOptions or None")

  def replace(self, **changes) -> "AutoPlan":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
  """Everything :func:`~harpjax.auto_parallel` was given, checked (see there and the module
  docstring).

  Attributes:
    cluster: a :class:`~harpjax.Cluster`, its YAML file or its dict form.
    num_microbatches: ``B``, or ``None`` for the given plan's.
    plan: an :class:`AutoPlan`, a :class:`~harpjax.Plan`, or a saved plan's path.
    runtime: a :class:`~harpjax.LocalRuntime` or a :class:`~harpjax.RayRuntime`.
    batch_argnums: positions of the batch arguments.
    loss_reduction: ``"mean"`` or ``"sum"``.
    batch_coupling: ``None``, ``"per_microbatch"`` or ``"error"``.
    checkpoint: a :class:`~harpjax.CheckpointOptions` or ``None``.
    elastic: an :class:`~harpjax.ElasticOptions` or ``None``.
    plan_changes: changes the spellings of earlier releases make to a plan read from a file
      (applied when it is read); empty otherwise.
  """
  cluster: Any
  num_microbatches: int | None = None
  plan: Any = dataclasses.field(default_factory=AutoPlan)
  runtime: Any = dataclasses.field(default_factory=LocalRuntime)
  batch_argnums: tuple[int, ...] = (1,)
  loss_reduction: str = "mean"
  batch_coupling: str | None = None
  checkpoint: CheckpointOptions | None = None
  elastic: ElasticOptions | None = None
  plan_changes: tuple[Callable[[Plan], Plan], ...] = ()

  def __post_init__(self):
    plan = self.plan
    if plan is None or (isinstance(plan, str) and plan == "auto"):
      object.__setattr__(self, "plan", AutoPlan())
    elif isinstance(plan, os.PathLike):
      object.__setattr__(self, "plan", os.fspath(plan))
    elif not isinstance(plan, (AutoPlan, Plan, str)):
      raise InvalidOptionError(f"plan={plan!r}: give a harpjax.Plan (harpjax.ManualPlan(...)), a "
                         "saved plan's path, or harpjax.AutoPlan(...) (automatic planning)")
    runtime = self.runtime
    if isinstance(runtime, str):
      if runtime not in RUNTIMES:
        raise InvalidOptionError(f"runtime={runtime!r}; choose one of {tuple(RUNTIMES)} or give a "
                           "harpjax.LocalRuntime or harpjax.RayRuntime")
      object.__setattr__(self, "runtime", RUNTIMES[runtime]())
    elif not isinstance(runtime, (LocalRuntime, RayRuntime)):
      raise InvalidOptionError(f"runtime={runtime!r}: give 'local', 'ray', a harpjax.LocalRuntime "
                         "or a harpjax.RayRuntime")
    if isinstance(self.checkpoint, (str, os.PathLike)):
      object.__setattr__(self, "checkpoint", CheckpointOptions(os.fspath(self.checkpoint)))
    if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointOptions):
      raise InvalidOptionError(f"checkpoint={self.checkpoint!r}: give a directory or a "
                         "harpjax.CheckpointOptions")
    if self.elastic is not None:
      if not isinstance(self.elastic, ElasticOptions):
        raise InvalidOptionError(f"elastic={self.elastic!r}: give a harpjax.ElasticOptions")
      if not isinstance(self.runtime, RayRuntime):
        raise OptionConflictError("elastic recovery is for the Ray runtime (workers that can "
                                  "be lost; runtime='ray' or harpjax.RayRuntime(...)); the "
                                  "local runtime runs in this process")
      if self.checkpoint is None:
        raise OptionConflictError("elastic recovery restores a checkpoint: pass "
                                  "checkpoint=... too")
    if self.loss_reduction not in LOSS_REDUCTIONS:
      raise InvalidOptionError(f"loss_reduction={self.loss_reduction!r}; choose one of "
                         f"{LOSS_REDUCTIONS}")
    if self.batch_coupling not in BATCH_COUPLING:
      raise InvalidOptionError(f"batch_coupling={self.batch_coupling!r}; choose one of "
                         f"{BATCH_COUPLING}")
    B = self.num_microbatches
    if B is not None and (isinstance(B, bool) or not isinstance(B, numbers.Integral) or B < 1):
      raise MicrobatchError(f"num_microbatches={B!r} must be a positive integer")
    try:
      object.__setattr__(self, "batch_argnums", tuple(int(a) for a in self.batch_argnums))
    except (TypeError, ValueError):
      raise InvalidOptionError(f"batch_argnums={self.batch_argnums!r}: positions of the step's "
                         "batch arguments (ints)") from None

  @property
  def automatic(self) -> bool:
    """Whether the plan is made automatically (:class:`AutoPlan`)."""
    return isinstance(self.plan, AutoPlan)

  @property
  def auto(self) -> AutoPlan:
    """The :class:`AutoPlan` (automatic planning's options; defaults with a given plan: a
    plan file that turns out damaged is replaced by automatic planning with them)."""
    return self.plan if isinstance(self.plan, AutoPlan) else AutoPlan()

  @property
  def local(self) -> bool:
    """Whether every stage runs in this process."""
    return isinstance(self.runtime, LocalRuntime)

  def given(self, plan: Plan) -> Plan:
    """``plan`` (given, or read from its file) with :attr:`plan_changes` applied."""
    for change in self.plan_changes:
      plan = change(plan)
    return plan


# --------------------------------------------------------------------------- earlier spellings


def _deprecated(old: str, new: str) -> None:
  warnings.warn(f"auto_parallel({old}) is deprecated: {new}", DeprecationWarning,
                stacklevel=4)


def _with_schedule(schedule: str) -> Callable[[Plan], Plan]:
  def change(plan: Plan) -> Plan:
    if schedule_key(plan.schedule) == schedule:
      return plan
    # the plan's warm-up counts are its own schedule's: the new one derives its own
    return plan.replace(schedule=schedule, stages=tuple(
        dataclasses.replace(s, warmup=None) for s in plan.stages))
  return change


def _with_eps(eps: float) -> Callable[[Plan], Plan]:
  def change(plan: Plan) -> Plan:
    if plan.eps == eps:
      return plan
    # warm-up counts the plan records follow its own tolerance: the new one derives its own
    # (kept, they would leave the tolerance asked for without effect)
    return plan.replace(eps=eps, stages=tuple(
        dataclasses.replace(s, warmup=None) for s in plan.stages))
  return change


def _with_offload(offload: OffloadOptions) -> Callable[[Plan], Plan]:
  return offload.apply


def _with_layer_options(layers: LayerOptions) -> Callable[[Plan], Plan]:
  def change(plan: Plan) -> Plan:
    if plan.layer_source != "auto":
      raise OptionConflictError(
          "layer_options apply to plans on automatically constructed layers "
          "(Plan.layer_source='auto'); this plan's stages index the layers the step marks")
    if plan.layer_options is not None and plan.layer_options != layers:
      raise OptionConflictError(
          f"layer_options={layers} but the plan records the layers it was made on, "
          f"{plan.layer_options}: drop layer_options")
    return plan.replace(layer_options=layers)
  return change


def parallel_options(*, cluster, num_microbatches=None, plan=None, runtime="local",
                     batch_argnums: Sequence[int] = (1,), loss_reduction: str = "mean",
                     batch_coupling=None, checkpoint=None, elastic=None, schedule=None,
                     eps=None, runtime_options=None, layer_options=None, profile_options=None,
                     solve_options=None, compilation_cache=None,
                     offload=None) -> ParallelOptions:
  """:class:`ParallelOptions` from :func:`~harpjax.auto_parallel`'s keywords, the spellings of
  earlier releases moved to their one place (each with a ``DeprecationWarning``).

  Raises:
    InvalidOptionError: a value an option cannot take.
    UnknownOptionError: a ``runtime_options`` key its runtime does not have.
    OptionConflictError: an option given where it does not apply (a planner's option with a
      given plan), or the same choice given twice differently.
  """
  if plan is None or (isinstance(plan, str) and plan == "auto"):
    plan = AutoPlan()
  elif isinstance(plan, os.PathLike):
    plan = os.fspath(plan)
  automatic = isinstance(plan, AutoPlan)
  changes: list[Callable[[Plan], Plan]] = []

  # what to plan with
  planner = {"layer_options": (layer_options, "layers", LayerOptions),
             "profile_options": (profile_options, "profile", ProfileOptions),
             "solve_options": (solve_options, "solve", SolveOptions)}
  for old, (value, field, cls) in planner.items():
    if value is None:
      continue
    if not isinstance(value, cls):
      raise InvalidOptionError(f"{old}={value!r}: give a harpjax.{cls.__name__}")
    if not automatic:
      if old == "layer_options":
        _deprecated(old, "a plan made on automatic layers records them (Plan.layer_options)")
        changes.append(_with_layer_options(value))
        continue
      raise OptionConflictError(
          f"{old} are options of automatic planning, but a plan was given to follow: drop "
          f"{old}, or plan automatically with plan=harpjax.AutoPlan({field}=...)")
    _deprecated(old, f"pass plan=harpjax.AutoPlan({field}=...)")
    default = cls()
    if getattr(plan, field) != default and getattr(plan, field) != value:
      raise OptionConflictError(f"{old} and AutoPlan.{field} both given: give it once, in "
                                "AutoPlan")
    plan = plan.replace(**{field: value})
  if schedule is not None:
    try:
      key = schedule_key(schedule)
    except HarpjaxError as e:
      raise InvalidOptionError(f"schedule={schedule!r}: {e}") from None
    if automatic:
      _deprecated("schedule=...", "pass plan=harpjax.AutoPlan(solve=harpjax.SolveOptions("
                  "schedule=...))")
      if plan.solve.schedule not in (RANK, key):
        raise OptionConflictError(f"schedule={schedule!r} but SolveOptions.schedule="
                                  f"{plan.solve.schedule!r}: give the schedule once, in "
                                  "SolveOptions")
      plan = plan.replace(solve=dataclasses.replace(plan.solve, schedule=key))
    else:
      _deprecated("schedule=...", "a given plan runs its own schedule: "
                  "ManualPlan(..., schedule=...) or plan.replace(schedule=...)")
      changes.append(_with_schedule(key))
  if eps is not None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps <= 1:
      raise InvalidOptionError(f"eps={eps!r} must be a number in [0, 1]")
    if automatic:
      _deprecated("eps=...", "pass plan=harpjax.AutoPlan(solve=harpjax.SolveOptions(eps=...))")
      if plan.solve.eps not in (SolveOptions().eps, eps):
        raise OptionConflictError(f"eps={eps} but SolveOptions.eps={plan.solve.eps}: give it "
                                  "once, in SolveOptions")
      plan = plan.replace(solve=dataclasses.replace(plan.solve, eps=float(eps)))
    else:
      _deprecated("eps=...", "a given plan's warm-up counts use its own tolerance: "
                  "ManualPlan(..., eps=...) or plan.replace(eps=...)")
      changes.append(_with_eps(float(eps)))
  if offload is not None:
    if not isinstance(offload, OffloadOptions):
      raise InvalidOptionError(f"offload={offload!r}: give a harpjax.OffloadOptions")
    if automatic:
      raise OptionConflictError(
          "offload= forces stages of a given plan to keep state in host memory; automatic "
          "planning chooses that per stage where it pays, pricing it; to require it on every "
          "stage, plan with harpjax.AutoPlan(solve=harpjax.SolveOptions(offload='always')) "
          "or offload_activations='always'")
    _deprecated("offload=...", "a plan's stages say what they keep in host memory "
                "(StageSpec.offload, StageSpec.offload_activations; "
                "harpjax.OffloadOptions(...).apply(plan))")
    changes.append(_with_offload(offload))

  # how to run
  if isinstance(runtime, str) and runtime not in RUNTIMES:
    raise InvalidOptionError(f"runtime={runtime!r}; choose one of {tuple(RUNTIMES)} or give a "
                       "harpjax.LocalRuntime or harpjax.RayRuntime")
  if runtime_options:
    if not isinstance(runtime_options, dict):
      raise InvalidOptionError(f"runtime_options={runtime_options!r}: a dict")
    if not isinstance(runtime, str):
      raise OptionConflictError(f"runtime_options given with runtime={runtime!r}: give the "
                                "options in the runtime object only")
    cls = RUNTIMES[runtime]
    _deprecated("runtime_options={...}", f"pass runtime=harpjax.{cls.__name__}(...)")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(runtime_options) - set(known))
    if unknown:
      other = [n for n, c in RUNTIMES.items() if n != runtime and
               set(unknown) <= {f.name for f in dataclasses.fields(c)}]
      hint = f"; they are options of runtime={other[0]!r}" if other else ""
      raise UnknownOptionError(f"unknown runtime_options {unknown}: the {runtime} runtime "
                               f"({cls.__name__}) takes {known}{hint}")
    runtime = cls(**runtime_options)
  if compilation_cache is not None:
    _deprecated("compilation_cache=...", "pass runtime=harpjax.LocalRuntime("
                "compilation_cache=...) or harpjax.RayRuntime(compilation_cache=...)")
    if isinstance(runtime, str):
      runtime = RUNTIMES[runtime]()
    if isinstance(runtime, (LocalRuntime, RayRuntime)):
      if runtime.compilation_cache not in (True, compilation_cache):
        raise OptionConflictError(
            f"compilation_cache={compilation_cache!r} but {type(runtime).__name__}."
            f"compilation_cache={runtime.compilation_cache!r}: give it once, in the runtime")
      runtime = dataclasses.replace(runtime, compilation_cache=compilation_cache)

  if not automatic and isinstance(plan, Plan):
    given = plan
    for change in changes:
      given = change(given)
    plan, changes = given, []
  return ParallelOptions(cluster=cluster, num_microbatches=num_microbatches, plan=plan,
                         runtime=runtime, batch_argnums=tuple(batch_argnums),
                         loss_reduction=loss_reduction, batch_coupling=batch_coupling,
                         checkpoint=checkpoint, elastic=elastic, plan_changes=tuple(changes))
