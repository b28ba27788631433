"""The ``@auto_parallel`` decorator and the step object it returns: the driver of the flow.

A :class:`ParallelStep` runs harpjax's phases (:mod:`harpjax.phases`) for the structure of its
arguments (shapes, dtypes, pytree), each returning a frozen object cached like ``jax.jit``'s:
``trace`` (:class:`~harpjax.phases.Traced`), ``plan`` (the resolved :class:`~harpjax.Plan`;
``step.trace(*args).plan()`` gives the :class:`~harpjax.phases.Planned`), ``layout`` and
``compile`` / ``lower``, then the call itself (``runtime``); each phase's result advances
itself (``step.trace(*args).plan().layout().compile()``). :meth:`ParallelStep._phases` is the
whole flow in order, each phase logged with its time. The options are read and checked in
:mod:`harpjax.options`; elastic recovery is :class:`harpjax.runtime.Elastic`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np

from harpjax import runtime
from harpjax.cluster import Cluster
from harpjax.compiler.plan import Plan
from harpjax.compiler.profile import ProfileResult
from harpjax.compiler.stages import (CompiledStep, LoweredStep, StepProgram, lower_step,
                                     warn_shared_parameters)
from harpjax.errors import HarpjaxError, OptionsError
from harpjax.options import AutoPlan, ParallelOptions, parallel_options
from harpjax.phases import (LaidOut, Planned, Traced, compile_phase, layout_phase,
                            plan_phase, read_plan, trace_phase, use_compilation_cache)
from harpjax.runtime import (CheckpointError, Checkpointer, Elastic, LocalRuntime, RayRuntime,
                             Recovery)

log = logging.getLogger(__name__)

__all__ = ["auto_parallel", "ParallelStep", "ParallelOptions", "Traced", "Planned", "LaidOut"]

_STATE_ARGNUM = 0   # the training state is the step's first argument (elastic recovery)


def auto_parallel(fun: Callable | None = None, *, cluster, num_microbatches: int | None = None,
                  plan: Plan | str | os.PathLike | AutoPlan | None = None,
                  runtime: str | LocalRuntime | RayRuntime = "local",
                  batch_argnums: Sequence[int] = (1,), loss_reduction: str = "mean",
                  batch_coupling: str | None = None, checkpoint=None, elastic=None,
                  schedule: str | None = None, eps: float | None = None,
                  runtime_options: dict | None = None, layer_options=None,
                  profile_options=None, solve_options=None, compilation_cache=None,
                  offload=None):
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

  The options are grouped by the phase that reads them (:mod:`harpjax.options`): what to plan
  with (``plan``), how to run (``runtime``), how to recover (``checkpoint``, ``elastic``), and
  how the batch splits (``num_microbatches``, ``batch_argnums``, ``loss_reduction``,
  ``batch_coupling``). Each choice is made in one place.

  Args:
    fun: the train step.
    cluster: a :class:`harpjax.Cluster`, a path to its YAML file, or its dict form.
    num_microbatches: B; the batch arguments' leading axis must divide by it. Default the
      given plan's.
    plan: what to plan with, one of two kinds. A plan to follow: a :class:`harpjax.Plan`
      (:func:`harpjax.ManualPlan`, a solved or loaded plan) or a saved plan's path; its
      schedule, H-1F1B tolerance (``eps``), remat and offloads are its own fields
      (``ManualPlan(..., schedule="1f1b")``, ``plan.replace(...)``). Or
      :class:`harpjax.AutoPlan` (the default; ``None`` and ``"auto"`` mean ``AutoPlan()``):
      on the first call layers are constructed from the forward program
      (``AutoPlan.layers``), profiled on the cluster's GPU types (``AutoPlan.profile``:
      by default each layer's jaxpr at the GPU types' calibrated rates, nothing compiled;
      ``"analytic"`` compiles each layer to refine them; ``"measured"`` times the local
      devices), and the search (``AutoPlan.solve``, :func:`harpjax.solve`) picks stages,
      submeshes, logical meshes, ZeRO levels and offloads for H-1F1B, then the fastest of
      1F1B, Eager-1F1B and H-1F1B that fits memory on those stages
      (``SolveOptions(schedule=...)`` pins one), with its warm-up counts.
    runtime: how to run: ``"local"`` or :class:`harpjax.LocalRuntime` (every stage in this
      process; ``compile_workers``, ``compilation_cache``), or ``"ray"`` or
      :class:`harpjax.RayRuntime` (one Ray actor per stage: ``address``, ``emulation``,
      ``transport``, timeouts, ``compilation_cache``...).
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
    checkpoint: a directory or :class:`harpjax.CheckpointOptions`: the new training state
      (the first element of the step's result, by default) is saved every ``every`` completed
      steps, the newest ``keep`` kept (:class:`harpjax.Checkpointer`; plan-independent, so it
      restores onto any plan or ``jax.jit``). :meth:`ParallelStep.restore` resumes.
    elastic: :class:`harpjax.ElasticOptions` (the Ray runtime, and ``checkpoint``): a step
      that fails because workers were lost re-plans on what is left (or on the cluster the
      policy gives), restores the newest checkpoint, replays the steps since, and returns the
      failed call's result (:mod:`harpjax.runtime.elastic`; :attr:`ParallelStep.recoveries`).
    schedule, eps, runtime_options, layer_options, profile_options, solve_options,
      compilation_cache, offload: the spellings of earlier releases, deprecated: each is moved
      to its one place with a ``DeprecationWarning`` (:func:`harpjax.options.
      parallel_options`), and refused where it does not apply.

  Returns:
    A :class:`ParallelStep`, callable like ``fun``.

  Raises:
    OptionsError: an option has a value it cannot take.
    UnknownOptionError: a ``runtime_options`` key the runtime does not have.
    OptionConflictError: an option where it does not apply, or a choice given twice.
  """
  options = parallel_options(cluster=cluster, num_microbatches=num_microbatches, plan=plan,
                             runtime=runtime, batch_argnums=batch_argnums,
                             loss_reduction=loss_reduction, batch_coupling=batch_coupling,
                             checkpoint=checkpoint, elastic=elastic, schedule=schedule,
                             eps=eps, runtime_options=runtime_options,
                             layer_options=layer_options, profile_options=profile_options,
                             solve_options=solve_options, compilation_cache=compilation_cache,
                             offload=offload)
  if fun is None:
    return lambda f: ParallelStep(f, options)
  return ParallelStep(fun, options)


@dataclasses.dataclass
class _Phases:
  """The cached phases of one argument structure."""
  traced: Traced | None = None
  planned: Planned | None = None
  laid: LaidOut | None = None
  compiled: CompiledStep | None = None
  runner: Any = None

  @property
  def program(self) -> StepProgram | None:
    return None if self.laid is None else self.laid.program


class _Advance:
  """How a phase's result advances: the next phase for its arguments' structure.

  It holds the step weakly (the step's cache holds the results: a cycle would keep a step,
  and the Ray workers its runners own, alive until the garbage collector runs) and the
  arguments' shapes, not their arrays."""

  def __init__(self, step: "weakref.ref[ParallelStep]", key, args):
    self._step, self._key, self._args = step, key, args

  def __call__(self, until: str):
    step = self._step()
    if step is None:
      raise HarpjaxError("the step this result came from no longer exists: advance from "
                         "step.trace(*args) of a live step")
    return step._advance(self._key, self._args, until)


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
    self._elastic = (None if options.elastic is None else
                     Elastic(options.elastic, options.checkpoint, _STATE_ARGNUM))
    self._replanned = False               # the given plan no longer applies
    self._plan_file: Plan | bool | None = None   # the plan file read (False: damaged)
    self._retired: list = []              # runners of the cluster before replan()

  @property
  def cluster(self) -> Cluster:
    """The cluster (loaded from the ``cluster`` option on first use)."""
    if self._cluster is None:
      self._cluster = _load_cluster(self.options.cluster)
    return self._cluster

  @property
  def recoveries(self) -> list[Recovery]:
    """Elastic recoveries so far, each with its timings."""
    return [] if self._elastic is None else self._elastic.recoveries

  # ------------------------------------------------------------------ the phases

  def trace(self, *args) -> Traced:
    """The traced step and its layers (:class:`~harpjax.phases.Traced`; ``.plan()`` goes
    on)."""
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
    ``LocalRuntime(compile_workers=0)``)."""
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
    """The Ray runner for these arguments' structure (the Ray runtime only)."""
    return self._phases(args, "run").runner

  def __call__(self, *args):
    if self._elastic is not None:
      return self._elastic(self, args)
    return self.call_once(args)

  def call_once(self, args: tuple):
    """One step: run, count, checkpoint on schedule (no elastic recovery)."""
    phases = self._phases(args, "run")
    if self.options.local:
      result = runtime.run_step(phases.compiled, args)
    else:
      result = phases.runner(args)
    done, ck = self.steps_done + 1, self.options.checkpoint
    if ck is not None and done % ck.every == 0:
      # Before the step counts: a worker lost while its state is gathered fails the step, and
      # Ctrl-C during the save leaves it uncounted (its retry finds the checkpoint written).
      try:
        self.checkpointer.save(done, ck.state_of(result))
      except BaseException:
        if not self.options.local:
          phases.runner.revoke(result)   # the state passed in stays the one to retry with
        raise
    self.steps_done = done
    self._release_retired()
    return result

  # ------------------------------------------------------------------ other clusters

  def runners(self) -> list:
    """The Ray runners started for the current cluster."""
    return [p.runner for p in self._cache.values() if p.runner is not None]

  def move_to(self, cluster) -> None:
    """Forgets every phase of the current cluster: the next call plans on ``cluster`` (a given
    plan no longer applies). The current runners are left as they are."""
    self._cluster, self._cache, self._replanned = _load_cluster(cluster), {}, True

  def prepare(self, args: tuple, until: str) -> None:
    """Runs the phases for ``args`` up to ``until`` (``"trace"``, ``"plan"``, ``"layout"``,
    ``"compile"`` or ``"run"``: the runner started)."""
    self._phases(args, until)

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
    self._retired += self.runners()
    self.move_to(new)
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
      raise OptionsError("this step has no checkpoint directory; pass auto_parallel(..., "
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

  def _phases(self, args, until: str, key: Any = None) -> _Phases:
    """The flow, phase by phase, up to ``until`` (``"trace"``, ``"plan"``, ``"layout"``,
    ``"compile"`` or ``"run"``); every phase's result is cached for this structure (``key``,
    default the arguments')."""
    key = _signature(args) if key is None else key
    p = self._cache.setdefault(key, _Phases())
    local, rt = self.options.local, self.options.runtime
    advance = _Advance(weakref.ref(self), key, _abstract(args))
    if p.compiled is None and (until == "compile" or (until == "run" and local)):
      self.cluster.local_devices()   # too few devices: said now, not after tracing and planning
    if until == "run" and self.options.checkpoint is not None:
      self.checkpointer   # noqa: B018 -- its directory is checked (and created) now
    if p.traced is None:
      with _phase("trace"):
        p.traced = Traced(*trace_phase(self._fun, args, self.options, self._given_plan()),
                          _advance=advance)
    if until == "trace":
      return p
    if p.planned is None:
      with _phase("plan"):
        p.planned = self._plan(args, p.traced)
    if until == "plan":
      return p
    if p.laid is None:
      with _phase("layout"):
        planned, program = layout_phase(
            self._fun, args, p.planned, self.cluster, self.options,
            lambda mixed: self._plan(args, p.traced, mixed=mixed))
        p.planned, p.laid = planned, LaidOut(planned, program, _advance=advance)
        warn_shared_parameters(program, _leaf_paths(args))
    if until == "layout":
      return p
    if (p.compiled is None and (local or until == "compile")) or (
        until == "run" and not local and p.runner is None):
      use_compilation_cache(rt.compilation_cache)
    if p.compiled is None and (local or until == "compile"):
      with _phase("compile"):
        workers = rt.compile_workers if local else 0
        p.compiled = compile_phase(p.program, self.cluster, workers,
                                   rt.progress if local else None)
    if until == "run" and not local and p.runner is None:
      with _phase("start the Ray runner"):
        p.runner = runtime.ray_runner(p.program, self.cluster, args, rt)
    return p

  def _advance(self, key, args, until: str):
    """The result of phase ``until`` for the arguments of structure ``key`` (what a phase's
    result advances to)."""
    p = self._phases(args, until, key)
    return {"plan": p.planned, "layout": p.laid, "compile": p.compiled}[until]

  def _plan(self, args, traced: Traced, mixed: bool = True) -> Planned:
    plan, schedule, profile = plan_phase(self._fun, args, traced, self.cluster, self.options,
                                         self._given_plan(), mixed)
    return Planned(traced, plan, schedule, profile, _advance=traced._advance)

  def _given_plan(self) -> Plan | None:
    """The plan to follow (``None``: plan automatically)."""
    plan = self.options.plan
    if isinstance(plan, AutoPlan) or self._replanned:
      return None
    if isinstance(plan, Plan):
      return plan
    if self._plan_file is None:
      read = read_plan(plan)
      self._plan_file = False if read is None else self.options.given(read)
    return self._plan_file or None


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


def _abstract(args):
  """``args`` with every array a ``jax.ShapeDtypeStruct`` (its weak type kept); other leaves
  (Python scalars) as they are."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                     weak_type=bool(getattr(x, "weak_type", False)))
      if hasattr(x, "shape") and hasattr(x, "dtype") else x, args)


def _signature(args) -> Any:
  leaves, tree = jax.tree_util.tree_flatten(args)
  return tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in leaves)
