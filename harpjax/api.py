"""The ``@auto_parallel`` decorator and the step object it returns: the driver of the flow.

A :class:`ParallelStep` runs harpjax's phases for the structure of its arguments (shapes,
dtypes, pytree), each returning a frozen object cached like ``jax.jit``'s: ``trace``
(:class:`Traced`: the step's programs and layers; ``compiler.trace``, ``compiler.layers``),
``plan`` (the resolved :class:`~harpjax.Plan`, profiled and solved when none was given;
``compiler.profile``, ``compiler.plan``, ``compiler.stages.devices``), ``layout`` and
``compile`` / ``lower`` (``compiler.stages``), then the call itself (``runtime``).
:meth:`ParallelStep._phases` is the whole flow in order, each phase logged with its time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fractions
import functools
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from harpjax import _compat, runtime
from harpjax.runtime import (CheckpointError, CheckpointOptions, Checkpointer, ElasticOptions,
                             Failure, Recovery, RemoteArray)
from harpjax.cluster import Cluster
from harpjax.compiler.layers import (LayerSequence, layers_for_step, layers_from_boundaries,
                                     layers_like, traced_step_for)
from harpjax.compiler.plan import MixedOptions, Plan, RANK, SolveOptions, load_plan, solve
from harpjax.compiler.profile import (ProfileOptions, ProfileResult, default_cache_dir,
                                     profile_step, progress_bar)
from harpjax.compiler.schedule import Schedule, schedule_key
from harpjax.compiler.stages import (LOSS_REDUCTIONS, CompiledStep, LoweredStep,
                                     OffloadOptions, StepProgram, compile_step, default_workers,
                                     layout_step, lower_step, precompile, resolve_plan,
                                     Retrace, warn_shared_parameters)
from harpjax.compiler.trace import BATCH_COUPLING, TracedStep, abstractify, trace_step
from harpjax.errors import (HarpjaxError, InfeasiblePlanError, MicrobatchError, PlanError,
                            RuntimeFailure, ScheduleError)

log = logging.getLogger(__name__)

__all__ = ["auto_parallel", "ParallelStep", "ParallelOptions", "Traced", "Planned"]

RUNTIMES = ("local", "ray")
LOCAL_RUNTIME_OPTIONS = ("compile_workers",)
_STATE_ARGNUM = 0   # the training state is the step's first argument (elastic recovery)


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
  """Options of :func:`auto_parallel` (see there)."""
  cluster: Any
  num_microbatches: int | None = None
  plan: Plan | None = None
  schedule: str | None = None
  batch_argnums: tuple[int, ...] = (1,)
  loss_reduction: str = "mean"
  batch_coupling: str | None = None
  runtime: str = "local"
  eps: float = 0.1
  runtime_options: tuple = ()
  layer_options: Any = None
  profile_options: Any = None
  solve_options: Any = None
  checkpoint: CheckpointOptions | None = None
  elastic: ElasticOptions | None = None
  compilation_cache: Any = True
  offload: OffloadOptions | None = None

  def __post_init__(self):
    cc = self.compilation_cache
    if not isinstance(cc, (bool, str, os.PathLike)):
      raise PlanError(f"compilation_cache={cc!r}: True (in the profile cache directory), "
                      "False, or a directory")
    if self.offload is not None and not isinstance(self.offload, OffloadOptions):
      raise PlanError(f"offload={self.offload!r}: give a harpjax.OffloadOptions")
    if self.elastic is not None:
      if not isinstance(self.elastic, ElasticOptions):
        raise PlanError(f"elastic={self.elastic!r}: give a harpjax.ElasticOptions")
      if self.runtime != "ray":
        raise PlanError("elastic recovery is for runtime='ray' (workers that can be lost); "
                        "the local runtime runs in this process")
      if self.checkpoint is None:
        raise PlanError("elastic recovery restores a checkpoint: pass checkpoint=... too")
    if isinstance(self.checkpoint, (str, os.PathLike)):
      object.__setattr__(self, "checkpoint", CheckpointOptions(os.fspath(self.checkpoint)))
    if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointOptions):
      raise PlanError(f"checkpoint={self.checkpoint!r}: give a directory or a "
                      "harpjax.CheckpointOptions")
    if self.loss_reduction not in LOSS_REDUCTIONS:
      raise PlanError(f"loss_reduction={self.loss_reduction!r}; choose one of {LOSS_REDUCTIONS}")
    if self.batch_coupling not in BATCH_COUPLING:
      raise PlanError(f"batch_coupling={self.batch_coupling!r}; choose one of "
                      f"{BATCH_COUPLING}")
    if self.runtime not in RUNTIMES:
      raise PlanError(f"runtime={self.runtime!r}; choose one of {RUNTIMES}")
    if self.schedule is not None:
      try:
        key = schedule_key(self.schedule)
      except ScheduleError as e:
        raise PlanError(f"schedule={self.schedule!r}: {e}") from None
      object.__setattr__(self, "schedule", key)
    B = self.num_microbatches
    if B is not None and (isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1):
      raise MicrobatchError(f"num_microbatches={B!r} must be a positive integer")
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
                  batch_coupling: str | None = None, runtime: str = "local", eps: float = 0.1,
                  runtime_options: dict | None = None, layer_options=None,
                  profile_options=None, solve_options=None, checkpoint=None, elastic=None,
                  compilation_cache=True, offload=None):
  """Pipelines a train step over a heterogeneous cluster.

  ``fun(state, batch, ...)`` is an ordinary train step that computes its gradients with
  :func:`harpjax.value_and_grad` (or :func:`harpjax.grad`) and applies them however it likes.
  The decorated step returns the same pytree structure; its numbers equal ``jax.jit(fun)``'s
  (up to float summation order) whenever the microbatches can reproduce the batch: losses and
  auxiliary outputs that are sums or means over the examples, normalised by anything computed
  from the batch's data alone (a padded batch's token count is computed on the whole batch).
  Where examples of different microbatches meet (an in-batch contrastive loss, batch
  statistics, a capacity decided over the batch's tokens), each microbatch computes those over
  its own examples and ``batch_coupling`` says what happens.

  Args:
    fun: the train step.
    cluster: a :class:`harpjax.Cluster`, a path to its YAML file, or its dict form.
    num_microbatches: B; the batch arguments' leading axis must divide by it.
    plan: the pipeline plan (:class:`harpjax.ManualPlan` or a saved plan); ``None`` (or
      ``"auto"``) plans automatically on the first call: layers are constructed from the
      forward program, profiled on the cluster's GPU types
      (:mod:`harpjax.compiler.profile`) and the exact DP (:func:`harpjax.compiler.plan.solve`)
      picks stages, submeshes and logical meshes for H-1F1B, then the fastest of 1F1B,
      Eager-1F1B and H-1F1B that fits memory on those stages, with its warm-up counts.
    schedule: a registered schedule (``"h1f1b"``, ``"1f1b"``, ``"eager_1f1b"``, ``"gpipe"``
      or one added with :func:`harpjax.compiler.schedule.register_schedule`); default the
      plan's. With automatic planning it pins the planner's schedule
      (``SolveOptions(schedule=...)``), so that the plan's memory check and predicted time
      are that schedule's.
    batch_argnums: positions of the step's batch arguments (split along axis 0).
    loss_reduction: for a step whose examples meet, how the microbatches' losses (and
      auxiliary outputs without a batch axis) combine: ``"mean"`` averages them, ``"sum"``
      adds them up. Elsewhere the data flow decides: a mean over the examples comes out a mean
      and a sum a sum, whatever this says.
    batch_coupling: where examples of different microbatches meet in the step, ``None``
      (default) computes them per microbatch and warns once
      (:class:`~harpjax.errors.BatchCouplingWarning`, naming each place and the model's
      source line), ``"per_microbatch"`` does the same without the warning, ``"error"``
      raises :class:`~harpjax.errors.BatchCouplingError` instead. Values from the batch's data
      used as positions of its examples (labels of an in-batch loss passed in with the data)
      are refused in every mode: a microbatch's result would be meaningless.
    runtime: ``"local"`` (one process, the default) or ``"ray"`` (one Ray actor per stage).
    eps: H-1F1B tolerance of :func:`harpjax.compiler.schedule.warmup_delta`.
    runtime_options: keyword options of the runtime. ``"local"`` takes ``compile_workers``:
      threads compiling the stages' executables ahead of the first call (default one per
      stage, at most one per CPU; ``0`` compiles lazily, executable by executable, on the
      first call). For ``"ray"``: see :class:`harpjax.runtime.ray_runtime.RayRunner`.
    layer_options: :class:`harpjax.compiler.layers.LayerOptions` of automatic planning.
    profile_options: :class:`harpjax.compiler.profile.ProfileOptions` (cost source: by default
      ``"jaxpr"``, each layer's jaxpr with the GPU types' calibrated rates, nothing compiled;
      ``"analytic"`` compiles each layer to refine them; ``"measured"`` times the local
      devices).
    solve_options: :class:`harpjax.compiler.plan.SolveOptions`.
    checkpoint: a directory or :class:`harpjax.CheckpointOptions`: the new training state
      (the first element of the step's result, by default) is saved every ``every`` completed
      steps, the newest ``keep`` kept (:class:`harpjax.Checkpointer`; plan-independent, so it
      restores onto any plan or ``jax.jit``). :meth:`ParallelStep.restore` resumes.
    elastic: :class:`harpjax.ElasticOptions` (``runtime="ray"``): a step that fails because
      workers were lost re-plans on what is left (or on the cluster the policy gives),
      restores the newest checkpoint, replays the steps since, and returns the failed call's
      result (:mod:`harpjax.runtime.elastic`; :attr:`ParallelStep.recoveries`).
    compilation_cache: keep the stages' compiled executables on disk, so the first step of a
      later process compiles nothing: ``True`` (JAX's persistent compilation cache in
      ``executables/`` of the profile cache directory), a directory, or ``False``. A cache
      directory you configured in JAX is kept; otherwise the setting is process-wide (later
      ``jax.jit`` compilations are kept too) and JAX's one-second minimum compile time for
      keeping an executable drops to zero.
    offload: :class:`harpjax.OffloadOptions`: stages that keep their optimizer state in host
      memory between steps (JAX memory kind ``"pinned_host"``; a
      :class:`~harpjax.errors.MemoryKindError` where the devices have none).

  Returns:
    A :class:`ParallelStep`, callable like ``fun``.
  """
  options = ParallelOptions(cluster=cluster, num_microbatches=num_microbatches, plan=plan,
                            schedule=schedule, batch_argnums=tuple(batch_argnums),
                            loss_reduction=loss_reduction, batch_coupling=batch_coupling,
                            runtime=runtime, eps=eps,
                            runtime_options=dict(runtime_options or {}),
                            layer_options=layer_options, profile_options=profile_options,
                            solve_options=solve_options, checkpoint=checkpoint,
                            elastic=elastic, compilation_cache=compilation_cache,
                            offload=offload)
  if fun is None:
    return lambda f: ParallelStep(f, options)
  return ParallelStep(fun, options)


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
  """What :meth:`ParallelStep.trace` returns: the traced step and the layers its plan indexes
  (hand-marked, or constructed automatically when the plan is automatic)."""
  step: TracedStep
  layers: LayerSequence


@dataclasses.dataclass(frozen=True, eq=False)
class Planned:
  """The plan phase's result: the resolved plan, its schedule, and the profile behind it
  (``None`` when the plan was given)."""
  traced: Traced
  plan: Plan
  schedule: Schedule
  profile: ProfileResult | None


@dataclasses.dataclass
class _Phases:
  """The cached phases of one argument structure."""
  traced: Traced | None = None
  planned: Planned | None = None
  program: StepProgram | None = None
  compiled: CompiledStep | None = None
  runner: Any = None


@contextlib.contextmanager
def _phase(name: str):
  t0 = time.perf_counter()
  yield
  log.info("%s: %.2f s", name, time.perf_counter() - t0)


class ParallelStep:
  """A pipelined train step. Call it like the original step.

  Every phase takes the step's arguments (arrays or ``jax.ShapeDtypeStruct`` s) and is cached
  by their structure; see the module docstring.
  """

  def __init__(self, fun: Callable, options: ParallelOptions):
    functools.update_wrapper(self, fun)
    self._fun = fun
    self.options = options
    self._cluster = None
    self._cache: dict[Any, _Phases] = {}
    self._checkpointer: Checkpointer | None = None
    self.steps_done = 0
    """Completed calls (continues from the checkpoint :meth:`restore` read)."""
    self.recoveries: list[Recovery] = []
    """Elastic recoveries so far, each with its timings."""
    self._replay: dict[int, tuple] = {}   # step -> its arguments, the state's slot None
    self._origin: Any = None              # the first call's state, if it is plain arrays
    self._replanned = False               # the given plan no longer applies
    self._plan_file: Plan | bool | None = None   # the plan file read (False: damaged)
    self._recovery: tuple | None = None   # (failed step, error, lost hosts, detect s) underway
    self._retired: list = []              # runners of the cluster before replan()

  @property
  def cluster(self) -> Cluster:
    """The cluster (loaded from the ``cluster`` option on first use)."""
    if self._cluster is None:
      self._cluster = _load_cluster(self.options.cluster)
    return self._cluster

  # ------------------------------------------------------------------ the phases

  def trace(self, *args) -> Traced:
    """The traced step and its layers (:class:`Traced`)."""
    return self._phases(args, "trace").traced

  def plan(self, *args) -> Plan:
    """The plan these arguments run with: the given one or the planner's, resolved (devices,
    warm-up counts and schedule filled in). ``print`` shows it as a table."""
    return self._phases(args, "plan").planned.plan

  def profile(self, *args) -> ProfileResult | None:
    """The profile automatic planning made for these arguments (``None`` with a given plan)."""
    return self._phases(args, "plan").planned.profile

  def compile(self, *args) -> CompiledStep:
    """The step compiled for the local runtime (executables compiled ahead unless
    ``compile_workers=0``)."""
    return self._phases(args, "compile").compiled

  def layout(self, *args) -> StepProgram:
    """The step cut into the plan's stages and laid out (:class:`~harpjax.compiler.stages.
    StepProgram`: programs, pure functions and the picklable layout; no devices)."""
    return self._phases(args, "layout").program

  def lower(self, *args) -> LoweredStep:
    """The step lowered for other processes: its layout and serialised executables (what each
    Ray worker receives a stage of)."""
    return lower_step(self.layout(*args))

  def runner(self, *args):
    """The Ray runner for these arguments' structure (``runtime="ray"`` only)."""
    return self._phases(args, "run").runner

  def __call__(self, *args):
    if self.options.elastic is not None:
      return self._call_elastic(args)
    return self._call(args)

  def _call(self, args):
    """One step: run, count, checkpoint on schedule."""
    phases = self._phases(args, "run")
    if self.options.runtime == "ray":
      result = phases.runner(args)
    else:
      result = runtime.run_step(phases.compiled, args)
    done, ck = self.steps_done + 1, self.options.checkpoint
    if ck is not None and done % ck.every == 0:
      # Before the step counts: a worker lost while its state is gathered fails the step, and
      # Ctrl-C during the save leaves it uncounted (its retry finds the checkpoint written).
      try:
        self.checkpointer.save(done, ck.state_of(result))
      except BaseException:
        if self.options.runtime == "ray":
          phases.runner.revoke(result)   # the state passed in stays the one to retry with
        raise
      for old in [k for k in self._replay if k <= done - ck.every]:
        del self._replay[old]   # covered by the checkpoint before this one
    self.steps_done = done
    self._release_retired()
    return result

  # ------------------------------------------------------------------ elastic

  def _call_elastic(self, args):
    argnum = _STATE_ARGNUM
    if self._origin is None and self.steps_done == 0 and not any(
        isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(args[argnum])):
      self._origin = args[argnum]
    t_start = time.perf_counter()
    if self._recovery is not None:   # Ctrl-C interrupted a recovery: this call resumes it
      result = self._recover(args, self._recovery[1], t_start)
    else:
      try:
        result = self._call(args)
      except RuntimeFailure as err:
        if len(self.recoveries) >= self.options.elastic.max_recoveries:
          raise
        result = self._recover(args, err, t_start)
    self._replay[self.steps_done] = args[:argnum] + (None,) + args[argnum + 1:]
    return result

  def _recover(self, args, err: RuntimeFailure, t_start: float):
    """Re-plans after lost workers, restores, replays, and runs the failed call (see
    :mod:`harpjax.runtime.elastic`). Interrupted after the workers were given up, the next
    call takes it up from the restore."""
    ck, argnum = self.options.checkpoint, _STATE_ARGNUM
    if self._recovery is None:
      failed = self.steps_done + 1
      runners = [p.runner for p in self._cache.values() if p.runner is not None]
      lost = tuple(sorted({h for r in runners for h in r.lost_hosts()}))
      detect_s = time.perf_counter() - t_start   # the failing attempt, then the probes
      target = self.options.elastic.decide(Failure(failed, err, lost, self.cluster))
      if target == "stop":
        raise err
      log.warning("step %d failed (%s); lost hosts %s: continuing on %d devices", failed,
                  str(err).splitlines()[0], list(lost) or "none", target.num_devices)
      for r in runners:
        try:
          r.shutdown()
        except Exception as e:  # noqa: BLE001 -- a broken runner may fail to shut down
          log.info("shutting down the failed runner: %s", e)
      self._cluster, self._cache, self._replanned, self._recovery = (
          target, {}, True, (failed, err, lost, detect_s))
    failed, err, lost, detect_s = self._recovery
    target = self.cluster

    t1 = time.perf_counter()
    like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), args[argnum])
    found = self.checkpointer.restore_newest(like)
    if found is not None:
      ck_step, state = found
    elif self._origin is not None:
      state, ck_step = self._origin, 0
    else:
      raise RuntimeFailure(f"{err}\nno checkpoint to recover from yet, and the first call's "
                           "state was not plain arrays") from err
    restore_s = time.perf_counter() - t1
    missing = [k for k in range(ck_step + 1, failed) if k not in self._replay]
    if missing:
      raise RuntimeFailure(f"{err}\ncannot replay steps {missing} after checkpoint "
                           f"{ck_step}") from err

    with_state = lambda a, st: a[:argnum] + (st,) + a[argnum + 1:]
    first = with_state(self._replay.get(ck_step + 1, args), state)
    t2 = time.perf_counter()
    self._phases(first, "layout")
    t3 = time.perf_counter()
    self._phases(first, "run")
    t4 = time.perf_counter()
    self.steps_done = ck_step
    for k in range(ck_step + 1, failed):
      state = ck.state_of(self._call(with_state(self._replay[k], state)))
    t5 = time.perf_counter()
    result = self._call(with_state(args, state))
    t6 = time.perf_counter()
    self._recovery = None
    self.recoveries.append(Recovery(failed, lost, target.num_devices, detect_s, t3 - t2,
                                    t4 - t3, restore_s, t5 - t4, t6 - t5, ck_step,
                                    failed - 1 - ck_step))
    log.warning("recovered in %.1f s: %s", self.recoveries[-1].total_s, self.recoveries[-1])
    return result

  def replan(self, cluster, state=None):
    """Moves the step onto ``cluster`` (a :class:`~harpjax.cluster.Cluster`, a YAML path or a
    mapping): the next call re-plans there (the profile of GPU types already profiled comes
    from the profile cache; a given plan no longer applies) and compiles anew.

    Args:
      cluster: the new cluster (grown, shrunk, or another one).
      state: training state returned by an earlier call; its arrays held by Ray workers are
        fetched before the workers are shut down.

    Returns:
      ``state`` with every :class:`~harpjax.runtime.RemoteArray` replaced by its array (pass
      it to the next call), or ``None`` without ``state``.
    """
    new = _load_cluster(cluster)
    state = None if state is None else runtime.gather(state)
    log.info("re-planning on %s (%d devices)", new.name, new.num_devices)
    # The old workers are shut down after the next step completes: until then the handles
    # passed here stay valid, so a replan interrupted anywhere can be called again.
    self._retired += [p.runner for p in self._cache.values() if p.runner is not None]
    self._cluster, self._cache, self._replanned = new, {}, True
    return state

  def _release_retired(self) -> None:
    while self._retired:
      self._retired[-1].shutdown()
      self._retired.pop()

  # ------------------------------------------------------------------ checkpoints

  @property
  def checkpointer(self) -> Checkpointer:
    """The :class:`harpjax.Checkpointer` of the ``checkpoint`` option."""
    ck = self.options.checkpoint
    if ck is None:
      raise PlanError("this step has no checkpoint directory; pass auto_parallel(..., "
                      "checkpoint='/path' or harpjax.CheckpointOptions(...))")
    if self._checkpointer is None:
      self._checkpointer = Checkpointer(ck.directory, keep=ck.keep,
                                        asynchronous=ck.asynchronous)
    return self._checkpointer

  def restore(self, like, step: int | None = None):
    """The training state of the newest intact checkpoint (or of ``step``) in the structure of
    ``like``; :attr:`steps_done` continues from its step.

    Before the first checkpoint (the first run of a script that resumes) this returns
    ``like`` itself and :attr:`steps_done` is 0. A damaged checkpoint is skipped for the
    previous intact one, with one warning naming it.

    Raises:
      CheckpointError: ``step`` is missing or damaged; the checkpoint's leaves differ from
        ``like``'s; or there is none yet and ``like`` holds shapes rather than arrays.
    """
    ckpt = self.checkpointer
    if step is not None:
      state = ckpt.restore(like, step)
    else:
      found = ckpt.restore_newest(like)
      if found is None:
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(like)):
          raise CheckpointError(f"{ckpt.directory} holds no complete checkpoint yet, and "
                                "like= holds shapes (jax.ShapeDtypeStruct), not a state to "
                                "start from: pass the initial state")
        log.info("%s holds no checkpoint yet: starting from the state given", ckpt.directory)
        step, state = 0, like
      else:
        step, state = found
    self.steps_done = int(step)
    return state

  def _phases(self, args, until: str) -> _Phases:
    """The flow, phase by phase, up to ``until`` (``"trace"``, ``"plan"``, ``"layout"``,
    ``"compile"`` or ``"run"``); every phase's result is cached for this structure."""
    p = self._cache.setdefault(_signature(args), _Phases())
    local = self.options.runtime == "local"
    if p.compiled is None and (until == "compile" or (until == "run" and local)):
      self.cluster.local_devices()   # too few devices: said now, not after tracing and planning
    if until == "run" and self.options.checkpoint is not None:
      self.checkpointer   # noqa: B018 -- its directory is checked (and created) now
    if p.traced is None:
      with _phase("trace"):
        p.traced = self._trace(args)
    if until == "trace":
      return p
    if p.planned is None:
      with _phase("plan"):
        p.planned = self._plan(args, p.traced)
    if until == "plan":
      return p
    if p.program is None:
      with _phase("layout"):
        try:
          p.program = self._layout(args, p)
        except PlanError as e:
          # A mixed-type stage the planner chose may not split this step's rows (a statistic
          # over the batch inside the region): plan again without them.
          if p.planned.profile is None or not any(s.mixed for s in p.planned.plan.stages):
            raise
          log.warning("the plan's mixed-type stages cannot split this step's rows (%s); "
                      "planning without them", e)
          p.planned = self._plan(args, p.traced, mixed=False)
          p.program = self._layout(args, p)
        warn_shared_parameters(p.program, _leaf_paths(args))
    if until == "layout":
      return p
    if (p.compiled is None and (local or until == "compile")) or (
        until == "run" and not local and p.runner is None):
      self._use_compilation_cache()
    if p.compiled is None and (local or until == "compile"):
      with _phase("compile"):
        p.compiled = self._compile(p.program, ahead=local)
    if until == "run" and not local and p.runner is None:
      with _phase("start the Ray runner"):
        p.runner = runtime.ray_runner(p.program, self.cluster, args,
                                      **dict(self.options.runtime_options))
    return p

  # ------------------------------------------------------------------ each phase

  def _num_microbatches(self) -> int:
    B, plan = self.options.num_microbatches, self._given_plan()
    planned = None if plan is None else plan.num_microbatches
    if B is not None and planned is not None and int(B) != int(planned):
      raise PlanError(f"num_microbatches={B} but the plan given was made for B={planned}: pass "
                      "one of them only, or the same B")
    B = planned if B is None else B
    if B is None:
      raise MicrobatchError("num_microbatches is not set: pass num_microbatches=B to "
                            "auto_parallel or set it in the plan")
    return int(B)

  def _given_plan(self) -> Plan | None:
    plan = self.options.plan
    if plan is None or (isinstance(plan, str) and plan == "auto") or self._replanned:
      return None
    if not isinstance(plan, (str, os.PathLike)):
      return plan
    if self._plan_file is None:
      try:
        self._plan_file = load_plan(plan)
      except PlanError as e:
        if not _damaged_file(plan):
          raise
        # A plan file cut short (an interrupted save, a damaged disk): the planner can
        # replace it, and the numbers do not depend on the plan.
        log.warning("%s; planning automatically instead", e)
        self._plan_file = False
    return self._plan_file or None

  def _trace(self, args) -> Traced:
    ts = trace_step(self._fun, args, num_microbatches=self._num_microbatches(),
                    batch_argnums=self.options.batch_argnums,
                    batch_coupling=self.options.batch_coupling)
    plan = self._given_plan()
    if plan is not None and plan.layer_source != "auto":
      return Traced(ts, layers_from_boundaries(ts.region, ts.boundary_cuts))
    layers = layers_for_step(ts, self.options.layer_options)   # automatic, or a saved one
    return Traced(traced_step_for(ts, layers), layers)

  def _batch_rows(self, args) -> int:
    """Rows of the batch (the leading size of the batch arguments' array leaves)."""
    leaves = [x for a in self.options.batch_argnums for x in jax.tree_util.tree_leaves(args[a])
              if np.ndim(x) >= 1]
    if not leaves:
      raise MicrobatchError(f"the batch arguments {self.options.batch_argnums} hold no arrays")
    return int(np.shape(leaves[0])[0])

  def _retrace(self, args, traced: Traced) -> Retrace:
    """The step traced again with other rows per microbatch (for stages that split them among
    groups of devices), cut into the same layers."""
    B = traced.step.num_microbatches
    argnums = self.options.batch_argnums
    rows = self._batch_rows(args)

    @functools.lru_cache(maxsize=None)
    def at(r: int):
      scaled = list(jax.tree_util.tree_map(abstractify, args))
      for a in argnums:
        scaled[a] = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((B * r,) + tuple(x.shape[1:]), x.dtype)
            if len(x.shape) >= 1 and x.shape[0] == rows else x, scaled[a])
      ts = trace_step(self._fun, tuple(scaled), num_microbatches=B, batch_argnums=argnums,
                      like=traced.step, factor=fractions.Fraction(rows, r))
      return ts, layers_like(ts, traced.layers)
    return Retrace(rows // B, at)

  def _layout(self, args, p: _Phases) -> StepProgram:
    retrace = self._retrace(args, p.traced)   # traces again only where a stage needs it
    return layout_step(p.traced.step, p.traced.layers, p.planned.plan, p.planned.schedule,
                       self.options.loss_reduction, self.options.offload, retrace)

  def _plan(self, args, traced: Traced, mixed: bool = True) -> Planned:
    plan, profile = self._given_plan(), None
    if plan is None:
      plan, profile = self._solve(args, traced, mixed)
    plan, schedule = resolve_plan(plan, self.cluster, len(traced.layers),
                                  traced.step.num_microbatches, self.options.schedule,
                                  self.options.eps)
    log.info("plan: %d stages over %d layers with %s, B=%d", plan.num_stages,
             len(traced.layers), schedule.name, schedule.num_microbatches)
    return Planned(traced, plan, schedule, profile)

  def _solve(self, args, traced: Traced, mixed: bool = True) -> tuple[Plan, ProfileResult]:
    """Automatic planning: cost tables from the layers, then the DP."""
    opts = self.options
    profile_opts = opts.profile_options or ProfileOptions()
    result = profile_step(self._fun, args, self.cluster,
                          num_microbatches=traced.step.num_microbatches,
                          batch_argnums=opts.batch_argnums, layer_options=opts.layer_options,
                          options=profile_opts, layers=traced.layers)
    log.info("profiled: %s", result.stats.describe())
    solve_opts = opts.solve_options or SolveOptions(eps=opts.eps)
    if opts.schedule is not None:   # the schedule to run is the one to plan for
      if solve_opts.schedule not in (RANK, opts.schedule):
        raise PlanError(f"schedule={opts.schedule!r} but solve_options.schedule="
                        f"{solve_opts.schedule!r}: give the schedule once")
      solve_opts = dataclasses.replace(solve_opts, schedule=opts.schedule)
    if not mixed:
      solve_opts = dataclasses.replace(solve_opts, mixed_stages="off")
    if solve_opts.mixed_stages != "off":   # mixed-type stages split the microbatch's rows
      mixed = solve_opts.mixed_options or MixedOptions()
      if mixed.microbatch_rows is None:
        mixed = dataclasses.replace(mixed, microbatch_rows=self._batch_rows(args) // (
            traced.step.num_microbatches))
        solve_opts = dataclasses.replace(solve_opts, mixed_options=mixed)
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
    # a choice of modes or "dots": every stage says its own (StageSpec.remat); else the meta
    remat = "full" if profile_opts.remat_modes == ("full",) else "none"
    return plan.replace(remat=remat, layer_source="auto"), result

  def _use_compilation_cache(self) -> None:
    cc = self.options.compilation_cache
    if cc is False:
      return
    if cc is True:
      root = (self.options.profile_options or ProfileOptions()).cache_dir
      if not (self.options.profile_options or ProfileOptions()).use_cache:
        return
      cc = os.path.join(root if root is not None else default_cache_dir(), "executables")
    path, set_here = _compat.use_persistent_compilation_cache(os.path.expanduser(cc))
    if set_here:
      log.info("compiled executables are kept in %s (JAX's persistent compilation cache)", path)

  def _compile(self, program: StepProgram, ahead: bool) -> CompiledStep:
    local = self.cluster.local_devices()
    cs = compile_step(program, [[local[i] for i in s.all_devices]
                                for s in program.plan.stages])
    workers = dict(self.options.runtime_options).get("compile_workers") if ahead else 0
    if workers is None:
      workers = default_workers(program.num_stages)
    if workers:
      progress = (self.options.profile_options or ProfileOptions()).progress
      seconds = _precompile(cs, workers, progress)
      log.info("compiled the executables of %d stages in %.1f s (%d threads)",
               program.num_stages, seconds, workers)
    return cs


def _precompile(cs: CompiledStep, workers: int, progress: bool | None) -> float:
  """:func:`precompile`, one stage per job (its executables, then its placement groups), in
  ``workers`` threads, largest stage first, with a progress bar over the stages. Returns the
  seconds taken."""
  groups: list[dict] = [{} for _ in cs.stages]
  for gi, fn in enumerate(cs.group_fns):
    groups[cs.layout.groups[gi].home][gi] = fn
  order = sorted(range(cs.num_stages), key=lambda s: -len(cs.program.programs[s].ops))
  t0 = time.perf_counter()
  ex = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="harpjax-compile")
  try:
    with progress_bar(len(cs.stages), progress, "compiling", unit="stage") as bar:
      jobs = [ex.submit(precompile, cs.layout, {s: cs.stages[s]}, groups[s], 1) for s in order]
      for job in concurrent.futures.as_completed(jobs):
        job.result()
        bar.update(1)
  except BaseException:
    # Ctrl-C (or a failure) returns now: the stages not started are cancelled; those being
    # compiled finish in their threads (XLA cannot be stopped mid-compile) and are dropped.
    ex.shutdown(wait=False, cancel_futures=True)
    raise
  ex.shutdown(wait=True)
  return time.perf_counter() - t0


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


def _leaf_paths(args) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]


def _load_cluster(spec) -> Cluster:
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
