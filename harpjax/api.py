"""The ``@auto_parallel`` decorator and the step object it returns."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np

from harpjax import runtime  # noqa: F401 - registers the planner's Ray pool
from harpjax.compiler import schedule as schedules_lib
from harpjax.compiler.stages import default_workers, precompile
from harpjax.compiler.stages import LOSS_REDUCTIONS, CompiledStep, compile_step
from harpjax.compiler.layers import LayerSequence, layers_from_boundaries
from harpjax.compiler.plan import Plan
from harpjax.compiler.trace import aval_nbytes
from harpjax.compiler.trace import TracedStep, trace_step
from harpjax.errors import (HarpjaxError, InfeasiblePlanError, MicrobatchError, PlanError,
                            ScheduleError)

log = logging.getLogger(__name__)

__all__ = ["auto_parallel", "ParallelStep", "ParallelOptions"]

RUNTIMES = ("local", "ray")
LOCAL_RUNTIME_OPTIONS = ("compile_workers",)


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
  """Options of :func:`auto_parallel` (see there)."""
  cluster: Any
  num_microbatches: int | None = None
  plan: Plan | None = None
  schedule: str | None = None
  batch_argnums: tuple[int, ...] = (1,)
  loss_reduction: str = "mean"
  runtime: str = "local"
  eps: float = 0.1
  runtime_options: tuple = ()
  layer_options: Any = None
  profile_options: Any = None
  solve_options: Any = None

  def __post_init__(self):
    if self.loss_reduction not in LOSS_REDUCTIONS:
      raise PlanError(f"loss_reduction={self.loss_reduction!r}; choose one of {LOSS_REDUCTIONS}")
    if self.runtime not in RUNTIMES:
      raise PlanError(f"runtime={self.runtime!r}; choose one of {RUNTIMES}")
    if self.schedule is not None:
      try:
        key = schedules_lib.schedule_key(self.schedule)
      except ScheduleError as e:
        raise PlanError(f"schedule={self.schedule!r}: {e}") from None
      object.__setattr__(self, "schedule", key)
    if self.num_microbatches is not None and (int(self.num_microbatches) != self.num_microbatches
                                              or self.num_microbatches < 1):
      raise MicrobatchError(f"num_microbatches={self.num_microbatches} must be a positive "
                            "integer")
    object.__setattr__(self, "batch_argnums", tuple(self.batch_argnums))
    if isinstance(self.runtime_options, dict):
      object.__setattr__(self, "runtime_options", tuple(sorted(self.runtime_options.items())))
    if self.runtime == "local":
      unknown = sorted(set(dict(self.runtime_options)) - set(LOCAL_RUNTIME_OPTIONS))
      if unknown:
        raise PlanError(f"runtime_options {unknown} are not options of the local runtime; it "
                        f"takes {list(LOCAL_RUNTIME_OPTIONS)}; the others belong to runtime='ray'")
      workers = dict(self.runtime_options).get("compile_workers")
      if workers is not None and (isinstance(workers, bool) or not isinstance(
          workers, (int, np.integer)) or workers < 0):
        raise PlanError(f"runtime_options compile_workers={workers!r}: a count of threads "
                        ">= 0 (0 compiles lazily, on the first call)")


def auto_parallel(fun: Callable | None = None, *, cluster, num_microbatches: int | None = None,
                  plan: Plan | None = None, schedule: str | None = None,
                  batch_argnums: Sequence[int] = (1,), loss_reduction: str = "mean",
                  runtime: str = "local", eps: float = 0.1,
                  runtime_options: dict | None = None, layer_options=None,
                  profile_options=None, solve_options=None):
  """Pipelines a train step over a heterogeneous cluster.

  ``fun(state, batch, ...)`` is an ordinary train step that computes its gradients with
  :func:`harpjax.value_and_grad` (or :func:`harpjax.grad`) and applies them however it likes.
  The decorated step returns the same pytree structure; its numbers equal ``jax.jit(fun)``'s
  (up to float summation order) when the loss is a mean over the batch.

  Args:
    fun: the train step.
    cluster: a :class:`harpjax.Cluster`, a path to its YAML file, or its dict form.
    num_microbatches: B; the batch arguments' leading axis must divide by it.
    plan: the pipeline plan (:class:`harpjax.ManualPlan` or a saved plan); ``None`` (or
      ``"auto"``) plans automatically on the first call: layers are constructed from the
      forward program, profiled on the cluster's GPU types
      (:mod:`harpjax.compiler.profile`) and the exact DP (:func:`harpjax.compiler.planner.
      solve`) picks stages, submeshes, logical meshes and H-1F1B warm-up counts.
    schedule: ``"h1f1b"``, ``"1f1b"``, ``"eager_1f1b"`` or ``"gpipe"``; default the plan's.
    batch_argnums: positions of the step's batch arguments (split along axis 0).
    loss_reduction: ``"mean"`` if the loss (and scalar aux outputs) average over the batch,
      ``"sum"`` if they add up.
    runtime: ``"local"`` (one process, the default) or ``"ray"`` (one Ray actor per stage).
    eps: H-1F1B tolerance of :func:`harpjax.compiler.schedules.warmup_delta`.
    runtime_options: keyword options of the runtime. ``"local"`` takes ``compile_workers``:
      threads compiling the stages' executables ahead of the first call (default one per
      stage, at most one per CPU; ``0`` compiles lazily, executable by executable, on the
      first call). For ``"ray"``: see :class:`harpjax.runtime.ray_runtime.RayRunner`.
    layer_options: :class:`harpjax.compiler.layers.LayerOptions` of automatic planning.
    profile_options: :class:`harpjax.compiler.profile.ProfileOptions` (cost source: analytic by
      default, from the GPU types' rates; ``"measured"`` times the local devices).
    solve_options: :class:`harpjax.compiler.planner.SolveOptions`.

  Returns:
    A :class:`ParallelStep`, callable like ``fun``.
  """
  options = ParallelOptions(cluster=cluster, num_microbatches=num_microbatches, plan=plan,
                            schedule=schedule, batch_argnums=tuple(batch_argnums),
                            loss_reduction=loss_reduction, runtime=runtime, eps=eps,
                            runtime_options=dict(runtime_options or {}),
                            layer_options=layer_options, profile_options=profile_options,
                            solve_options=solve_options)
  if fun is None:
    return lambda f: ParallelStep(f, options)
  return ParallelStep(fun, options)


class ParallelStep:
  """A pipelined train step. Call it like the original step.

  Attributes:
    plan: the plan in use, with warm-up counts, once the step has been compiled (else the
      plan given).
    layers: the layer sequence of the model, once traced.
  """

  def __init__(self, fun: Callable, options: ParallelOptions):
    functools.update_wrapper(self, fun)
    self._fun = fun
    self.options = options
    self._cluster = None
    self._compiled: dict[Any, CompiledStep] = {}
    self._runners: dict[Any, Any] = {}
    self._last: CompiledStep | None = None
    self._auto_plans: dict[Any, Plan] = {}
    self.profile = None   # the last ProfileResult of automatic planning

  # ------------------------------------------------------------------ public

  @property
  def cluster(self):
    if self._cluster is None:
      self._cluster = _load_cluster(self.options.cluster)
    return self._cluster

  @property
  def plan(self) -> Plan | None:
    return self._last.plan if self._last is not None else self.options.plan

  @property
  def layers(self) -> LayerSequence | None:
    return self._last.layers if self._last is not None else None

  @property
  def compiled(self) -> CompiledStep | None:
    return self._last

  def __call__(self, *args):
    cs = self.compile(*args)
    if self.options.runtime == "ray":
      return self.runner(*args)(args)
    from harpjax.runtime.local import run_step
    return run_step(cs, args)

  def runner(self, *args):
    """The Ray runner for these arguments' structure (``runtime="ray"`` only)."""
    cs = self.compile(*args)
    key = _signature(args)
    if key not in self._runners:
      from harpjax.runtime.ray_runtime import RayRunner
      self._runners[key] = RayRunner(self, cs, args, **dict(self.options.runtime_options))
    return self._runners[key]

  def compile(self, *args) -> CompiledStep:
    """Traces and compiles for these arguments (shapes and structure); cached."""
    key = _signature(args)
    cs = self._compiled.get(key)
    if cs is None:
      cs = self._compile(args)
      self._compiled[key] = cs
    self._last = cs
    return cs

  def trace(self, *args) -> tuple[TracedStep, LayerSequence]:
    """The traced step and its layer sequence, without compiling."""
    B = self._num_microbatches()
    ts = trace_step(self._fun, args, num_microbatches=B,
                    batch_argnums=self.options.batch_argnums)
    return ts, layers_from_boundaries(ts.region, ts.boundary_cuts)

  # ------------------------------------------------------------------ internals

  def _num_microbatches(self) -> int:
    B = self.options.num_microbatches
    if B is None and isinstance(self.options.plan, Plan):
      B = self.options.plan.num_microbatches
    if B is None:
      raise MicrobatchError("num_microbatches is not set: pass num_microbatches=B to "
                            "auto_parallel or set it in the plan")
    return int(B)

  def _compile(self, args) -> CompiledStep:
    plan = self.options.plan
    cluster = self.cluster
    if plan is None or (isinstance(plan, str) and plan == "auto"):
      plan, ts, layers = self._plan_automatically(args)
    else:
      if isinstance(plan, (str, os.PathLike)):
        from harpjax.compiler.plan import load_plan
        plan = load_plan(plan)
      if dict(plan.meta).get("layers") == "auto":   # a saved automatic plan: same layers
        ts, layers = self._auto_layers(args)
      else:
        ts, layers = self.trace(*args)
    B = ts.num_microbatches
    if plan.stages[-1].layers[1] != len(layers) - 1:
      raise PlanError(
          f"the plan's stages cover layers 0..{plan.stages[-1].layers[1]} but the model has "
          f"{len(layers)} layers (0..{len(layers) - 1}); {layers}. Adjust the layer ranges or "
          "the mark_layer_boundary calls")
    stage_indices = resolve_devices(cluster, plan)
    local = cluster.local_devices()
    stage_devices = [[local[i] for i in idx] for idx in stage_indices]
    schedule_name = self.options.schedule or schedules_lib.schedule_key(plan.schedule)
    eps = float(dict(plan.meta).get("eps", self.options.eps))
    warmups = _warmups(schedule_name, plan, layers, cluster, stage_indices, B, eps)
    schedule = schedules_lib.make_schedule(
        schedule_name, plan.num_stages, B,
        warmups if schedule_name == "h1f1b" else None)
    stages = tuple(dataclasses.replace(s, devices=tuple(idx), warmup=w)
                   for s, idx, w in zip(plan.stages, stage_indices, schedule.warmups))
    plan = plan.replace(stages=stages, num_microbatches=B, schedule=schedule_name,
                        num_layers=len(layers))
    log.info("compiling %d stages over %d layers with %s, B=%d", plan.num_stages, len(layers),
             schedule_name, B)
    cs = compile_step(ts, layers, plan, stage_devices, schedule, self.options.loss_reduction)
    _warn_shared_parameters(cs, args)
    if self.options.runtime == "local":
      workers = dict(self.options.runtime_options).get("compile_workers")
      if workers is None:
        workers = default_workers(plan.num_stages)
      if workers:
        seconds = precompile(cs, workers)
        log.info("compiled the executables of %d stages in %.1f s (%d threads)",
                 plan.num_stages, seconds, workers)
    return cs


  def _plan_automatically(self, args) -> tuple[Plan, TracedStep, LayerSequence]:
    """Layers, profile and DP: the plan for these arguments, plus the matching trace."""
    from harpjax.compiler.plan import SolveOptions, solve
    from harpjax.compiler.profile import ProfileOptions, profile_step

    B = self._num_microbatches()
    cluster = self.cluster
    opts = self.options
    key = _signature(args)
    result = profile_step(self._fun, args, cluster, num_microbatches=B,
                          batch_argnums=opts.batch_argnums, layer_options=opts.layer_options,
                          options=opts.profile_options or ProfileOptions())
    self.profile = result
    log.info("profiled: %s", result.stats.describe())
    solve_opts = opts.solve_options or SolveOptions(eps=opts.eps)
    plan = self._auto_plans.get(key)
    if plan is None:
      try:
        plan = solve(result.tables, B, options=solve_opts).plan
      except InfeasiblePlanError as e:
        st = result.stats
        if st.pruned_oom or st.pruned_tasks:
          raise InfeasiblePlanError(
              f"{e}. The profiler found {st.pruned_oom + st.pruned_tasks} stage candidates that "
              f"do not fit device memory (and {st.pruned_imbalance} hopelessly imbalanced "
              "ones): use more or larger GPUs, fewer or smaller microbatches, or "
              "ProfileOptions(remat=True)") from None
        raise
      remat = bool((opts.profile_options or ProfileOptions()).remat)
      plan = plan.replace(meta={**dict(plan.meta), "remat": remat, "layers": "auto"})
      self._auto_plans[key] = plan
    ts, layers = self._auto_layers(args)
    if len(layers) != len(result.layers):
      raise PlanError(f"layer construction is not deterministic: {len(layers)} layers now, "
                      f"{len(result.layers)} when profiled")
    return plan, ts, layers

  def _auto_layers(self, args) -> tuple[TracedStep, LayerSequence]:
    """The trace and the automatically constructed layers (what automatic plans index)."""
    from harpjax.compiler.layers import layers_for_step, traced_step_for
    ts = trace_step(self._fun, args, num_microbatches=self._num_microbatches(),
                    batch_argnums=self.options.batch_argnums)
    layers = layers_for_step(ts, self.options.layer_options)
    return traced_step_for(ts, layers), layers


SHARED_PARAMETER_WARNING = 0.25


def _warn_shared_parameters(cs: CompiledStep, args) -> None:
  """Warns when copies of parameters read by several stages (sent every step, their gradients
  sent back) exceed ``SHARED_PARAMETER_WARNING`` of the model's parameter bytes: the case of
  an ``nn.scan`` over layers, whose stacked parameters every stage running a layer reads."""
  shared = cs.shared_parameters()
  if not shared:
    return
  prog = cs.layers.program
  total = sum(aval_nbytes(prog.avals[prog.invars[k]])
              for k, inp in enumerate(cs.traced.inputs) if inp.kind == "param")
  copies = sum(nbytes * (len(users) - 1) for _, nbytes, users in shared)
  if copies <= SHARED_PARAMETER_WARNING * total:
    log.info("%d parameters are read by several stages; %s of copies per step", len(shared),
             _size(copies))
    return
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
  worst = sorted(shared, key=lambda x: -x[1] * (len(x[2]) - 1))[:3]
  names = "; ".join(f"{'args' + paths[i] if i >= 0 else 'a computed parameter'} "
                    f"({_size(n)}, stages {', '.join(map(str, u))})" for i, n, u in worst)
  log.warning(
      "%d parameters are read by several stages, and their copies are %.0f%% of the model's "
      "parameter bytes: %s. The first stage reading each sends it to the others every step, "
      "sums the gradients they send back, and alone holds its optimizer state. The planner's "
      "costs assume every stage holds only its own layers' parameters. Stacked parameters of "
      "an nn.scan over layers are read so; a Python loop over the blocks gives each stage "
      "its own.", len(shared), 100 * copies / total, names)


def _size(nbytes: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if nbytes < 1024 or unit == "GiB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return ""


def resolve_devices(cluster, plan: Plan) -> list[tuple[int, ...]]:
  """Global device indices of every stage: explicit ones checked, the others allocated."""
  names = [sc.name for sc in cluster.subclusters]
  for i, s in enumerate(plan.stages):
    if s.subcluster not in names:
      raise PlanError(f"stage {i} (layers {list(s.layers)}) uses subcluster {s.subcluster!r}, "
                      f"which the cluster does not have (it has {', '.join(names)})")
  total = sum(s.num_devices for s in plan.stages)
  if total > cluster.num_devices:
    raise PlanError(f"the plan uses {total} devices but the cluster has {cluster.num_devices}")
  explicit = {i: s.devices for i, s in enumerate(plan.stages) if s.devices is not None}
  taken: dict[int, int] = {}
  for i, devs in explicit.items():
    allowed = set(cluster.devices_of(plan.stages[i].subcluster))
    for d in devs:
      if d not in allowed:
        raise PlanError(f"stage {i} lists device {d}, which is not in subcluster "
                        f"{plan.stages[i].subcluster!r} (devices {min(allowed)}..{max(allowed)})")
      if d in taken:
        raise PlanError(f"stages {taken[d]} and {i} both use device {d}; stages need disjoint "
                        "devices")
      taken[d] = i
  todo = [i for i in range(plan.num_stages) if i not in explicit]
  result: dict[int, tuple[int, ...]] = dict(explicit)
  if todo:
    allocated = cluster.allocate_submeshes(
        [(plan.stages[i].subcluster, plan.stages[i].submesh) for i in todo])
    for i, devs in zip(todo, allocated):
      clash = sorted(set(devs) & set(taken))
      if clash:
        raise PlanError(
            f"stage {i} was allocated devices {list(devs)}, but stage {taken[clash[0]]} lists "
            f"device {clash[0]} explicitly; give explicit devices for every stage or for none")
      result[i] = tuple(devs)
  return [result[i] for i in range(plan.num_stages)]


def _warmups(schedule: str, plan: Plan, layers: LayerSequence, cluster, stage_indices, B: int,
             eps: float) -> tuple[int, ...] | None:
  """H-1F1B warm-up counts: given, from known stage/link times, or from the links alone."""
  if schedule != "h1f1b":
    return None
  if plan.warmups is not None:
    return plan.warmups
  S = plan.num_stages
  times = [s.time_s for s in plan.stages]
  comms = [s.comm_s for s in plan.stages[:-1]]
  if all(t is not None for t in times) and all(c is not None for c in comms):
    return schedules_lib.h1f1b_warmups(comms, max(times), eps)
  # Without compute times, assume a cut over a slower-than-intra-subcluster link needs one
  # extra in-flight microbatch (delta = 2, Eq. 2's middle case) and a fast one none.
  counts = [1]
  for i in range(S - 2, -1, -1):
    a, b = plan.stages[i], plan.stages[i + 1]
    delta = 2 if a.subcluster != b.subcluster else 1
    counts.append(counts[-1] + delta)
  return tuple(reversed(counts))


def _load_cluster(spec):
  from harpjax.cluster import Cluster
  if isinstance(spec, Cluster):
    return spec
  if isinstance(spec, (str, os.PathLike)):
    return Cluster.load(spec)
  if isinstance(spec, dict):
    return Cluster.from_dict(spec)
  raise HarpjaxError(f"cluster must be a harpjax.Cluster, a YAML path or a dict, not "
                     f"{type(spec).__name__}")


def _signature(args) -> Any:
  leaves, tree = jax.tree_util.tree_flatten(args)
  return tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in leaves)
