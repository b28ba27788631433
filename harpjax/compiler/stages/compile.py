"""From a traced step, its layers and a resolved plan to what the runtimes execute.

Two phases, after JAX's ``Traced -> Lowered -> Compiled``: :func:`layout_step` cuts the step
into stages and places the rest (a :class:`StepProgram`: programs, pure functions and the
picklable :class:`~harpjax.compiler.stages.layout.StepLayout`, no devices);
:func:`compile_step` jits it on devices (a :class:`CompiledStep`, what the local runtime runs).
For other processes, :func:`~harpjax.compiler.stages.lower.lower_step` turns a
:class:`StepProgram` into serialised executables instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from harpjax.compiler.layers import LayerSequence
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.plan import Plan
from harpjax.compiler.schedule import Schedule
from harpjax.compiler.stages import placement as placement_lib
from harpjax.compiler.stages.layout import HOST_MEMORY, StepLayout, stage_layout, step_layout
from harpjax.compiler.stages.replicas import replica_functions
from harpjax.compiler.stages.split import (RemoteGroup, Retrace, SplitStageExecutables, part_at,
                                           rows_of, split_stage)
from harpjax.compiler.stages.stage import (StageFunctions, jit_stage, slice_stages,
                                           stage_functions)
from harpjax.compiler.stages.zebra import (expert_held, expert_preferred, expert_side,
                                           zebra_executables, zebra_stage)
from harpjax.compiler.trace import (Lit, TracedStep, aval_nbytes, combine_rules, ops_function,
                                   primitives)
from harpjax.errors import (HarpjaxError, MemoryKindError, OptionConflictError, OptionsError,
                            PlanError)

log = logging.getLogger(__name__)

__all__ = ["StepProgram", "CompiledStep", "OffloadOptions", "layout_step", "compile_step",
           "split_executables",
           "group_function", "check_host_memory",
           "warn_shared_parameters", "state_successors", "LOSS_REDUCTIONS",
           "SHARED_PARAMETER_WARNING"]

LOSS_REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True, eq=False)
class StepProgram:
  """A step cut into stages, its other ops placed on them: programs and pure functions.

  Attributes:
    traced: the traced step.
    layers: the layer sequence of the region.
    plan: the resolved plan (devices and warm-up counts filled in).
    schedule: the task tables.
    programs: per stage, its :class:`~harpjax.compiler.stages.stage.StageProgram`.
    functions: per stage, its :class:`~harpjax.compiler.stages.stage.StageFunctions`.
    placement: where the ops around the region run.
    group_functions: per placement group (``placement.before + placement.after``), the pure
      function of its ops: ``fn(*values of in_ids) -> values of out_ids``.
    layout: the :class:`~harpjax.compiler.stages.layout.StepLayout` (what the runtimes route).
    split_functions: stage -> per group, its
      :class:`~harpjax.compiler.stages.stage.StageFunctions`, for the stages that split their
      rows among groups (``layout.splits``).
    zebras: stage -> ``(ZebraLayout, per part its StageFunctions)`` of the zebra stages
      (:mod:`~harpjax.compiler.stages.zebra`).
  """
  traced: TracedStep
  layers: LayerSequence
  plan: Plan
  schedule: Schedule
  programs: tuple
  functions: tuple
  placement: placement_lib.Placement
  group_functions: tuple
  layout: StepLayout
  split_functions: dict = dataclasses.field(default_factory=dict)
  zebras: dict = dataclasses.field(default_factory=dict)

  @property
  def num_stages(self) -> int:
    return len(self.programs)

  def shared_parameters(self) -> list[tuple[int, int, tuple[int, ...]]]:
    """Parameters read by several stages: ``(step argument leaf index, bytes, readers)``.

    The owner (the first reader) sends each to the other readers every step and sums the
    gradient parts they send back; it alone holds the optimizer state. A leaf index is
    ``-1`` for a parameter that is not a step argument."""
    ts, prog, lay = self.traced, self.layers.program, self.layout
    leaf_of = {v: i for i, v in enumerate(ts.outer.invars[len(ts.outer_consts):])}
    out = []
    for k, inp in enumerate(ts.inputs):
      users = lay.param_users[inp.param_index] if inp.kind == "param" else ()
      if len(users) > 1:
        out.append((leaf_of.get(inp.outer_ref, -1), aval_nbytes(prog.avals[prog.invars[k]]),
                    tuple(users)))
    return out


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
  """What stages of a given plan keep in host memory (JAX memory kind ``"pinned_host"``):
  :meth:`apply` writes it into the plan's stages (:attr:`~harpjax.StageSpec.offload`,
  :attr:`~harpjax.StageSpec.offload_activations`), the one place the runtime reads it from.
  Automatic planning chooses offloads per stage itself, pricing them
  (:class:`~harpjax.SolveOptions`).

  Attributes:
    optimizer_state: keep the optimizer state (the step inputs :func:`state_successors` finds)
      in host memory: the update brings it to the devices, computes, and writes the new state
      back; between updates the devices hold none of it.
    activations: keep what each microbatch's backward needs from its forward (the residuals,
      boundary activations included) in host memory between the two: the forward's results
      go to host memory, and the backward brings them back first. The devices then hold the
      residuals of the microbatch being computed only, not of every one in flight; the cost
      is two transfers of them over the host link per microbatch.
    stages: the stages that do (pipeline positions); ``None``: every stage.

  Raises:
    OptionsError: a field has the wrong type.
  """
  optimizer_state: bool = False
  stages: tuple[int, ...] | None = None
  activations: bool = False

  def __post_init__(self):
    for name in ("optimizer_state", "activations"):
      if not isinstance(getattr(self, name), bool):
        raise OptionsError(f"OffloadOptions.{name}={getattr(self, name)!r} must be True or "
                           "False")
    if self.stages is not None:
      stages = tuple(self.stages) if not isinstance(self.stages, (str, bytes)) else None
      if stages is None or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                               for x in stages):
        raise OptionsError(f"OffloadOptions.stages={self.stages!r} must be stage indices "
                           "(ints >= 0) or None for every stage")
      object.__setattr__(self, "stages", stages)

  def apply(self, plan: Plan) -> Plan:
    """``plan`` with the stages this names keeping what this says in host memory (what the
    plan's stages offload already stays offloaded): for a plan written by hand, which then
    carries its offloads per stage. A plan the planner priced (its
    :attr:`~harpjax.Plan.predicted_iteration_s` set) is never changed to offload what it was
    priced without: ask the planner for it (``SolveOptions(offload="always")``,
    ``offload_activations="always"``), which prices it.

    Raises:
      OptionConflictError: :attr:`stages` names a stage the plan does not have, or the plan
        was priced without an offload this asks for.
    """
    bad = [s for s in self.stages or () if s >= plan.num_stages]
    if bad:
      raise OptionConflictError(f"OffloadOptions.stages={list(self.stages)} names stage(s) "
                                f"{bad}, but the plan has {plan.num_stages}")
    stages = [dataclasses.replace(st, offload=st.offload or self.offloads(s),
                                  offload_activations=(st.offload_activations
                                                       or self.offloads_activations(s)))
              for s, st in enumerate(plan.stages)]
    changed = [s for s, (a, b) in enumerate(zip(stages, plan.stages)) if a != b]
    if not changed:
      return plan
    if plan.predicted_iteration_s is not None:
      raise OptionConflictError(
          f"{self} asks stage(s) {changed} to offload, but the plan was priced without "
          f"it (predicted_iteration_s={plan.predicted_iteration_s:.6g} s): plan with "
          "harpjax.SolveOptions(offload='always') or offload_activations='always', which "
          "prices it, or give a plan written by hand (harpjax.ManualPlan)")
    return plan.with_stages(stages)

  def offloads(self, stage: int) -> bool:
    """Whether ``stage`` keeps its optimizer state in host memory."""
    return self.optimizer_state and (self.stages is None or stage in self.stages)

  def offloads_activations(self, stage: int) -> bool:
    """Whether ``stage`` keeps its residuals in host memory between forward and backward."""
    return self.activations and (self.stages is None or stage in self.stages)


def check_host_memory(devices: Sequence, stage: int, residuals: bool = False,
                      params: bool = False) -> None:
  """Raises :class:`~harpjax.errors.MemoryKindError` unless every device of ``stage`` has the
  host memory kind (:data:`~harpjax.compiler.stages.layout.HOST_MEMORY`); ``residuals``: what
  the stage keeps there is its residuals, ``params``: its parameters (else its optimizer
  state)."""
  what, option = (("its residuals", "offload_activations") if residuals
                  else ("its parameters", "offload_params") if params
                  else ("its optimizer state", "offload"))
  for d in devices:
    kinds = [m.kind for m in d.addressable_memories()] \
        if hasattr(d, "addressable_memories") else []
    if HOST_MEMORY not in kinds:
      raise MemoryKindError(
          f"stage {stage} keeps {what} in host memory, but device {d} "
          f"({getattr(d, 'platform', '?')}) has the memory kinds {kinds}, not "
          f"{HOST_MEMORY!r}; set the stage's StageSpec.{option} to false (or plan with "
          f"SolveOptions({option}=False)), or run on a backend with host memory")


def layout_step(traced: TracedStep, layers: LayerSequence, plan: Plan, schedule: Schedule,
                loss_reduction: str = "mean",
                retrace: Retrace | None = None) -> StepProgram:
  """Cuts the step into the plan's stages, lays them out and places the rest of the step.

  Args:
    traced: from :func:`harpjax.compiler.trace.trace_step`.
    layers: the region's layers; the plan's ranges index them.
    plan: stages with logical meshes.
    schedule: the task tables (one row per stage).
    loss_reduction: how the microbatches' values of a loss or auxiliary output combine where
      examples of different microbatches meet (``traced.couplings``): averaged or added up.
      Elsewhere the data flow decides (:func:`~harpjax.compiler.trace.combine_rules`).
    retrace: the step traced at other microbatch sizes
      (:class:`~harpjax.compiler.stages.split.Retrace`); needed when a stage splits its rows
      among groups of devices (:attr:`~harpjax.compiler.plan.StageSpec.groups`). With it, the
      replicas of a data-parallel stage at ZeRO level 0 or 1 accumulate their own gradients,
      reduced once per step (:mod:`~harpjax.compiler.stages.replicas`); without it they are
      all-reduced every microbatch.

  Raises:
    PlanError: the plan does not cover the layers, or disagrees with the schedule, or a stage
      cannot split its rows.

  What a stage keeps in host memory is its plan's (:attr:`~harpjax.compiler.plan.StageSpec.
  offload`, :attr:`~harpjax.compiler.plan.StageSpec.offload_activations`).
  """
  if loss_reduction not in LOSS_REDUCTIONS:
    raise PlanError(f"loss_reduction={loss_reduction!r}; choose one of {LOSS_REDUCTIONS}")
  if plan.stages[-1].layers[1] != len(layers) - 1:
    raise PlanError(f"the plan's stages cover layers 0..{plan.stages[-1].layers[1]} but the "
                    f"model has {len(layers)} layers (0..{len(layers) - 1}): {layers}")
  if schedule.num_stages != plan.num_stages:
    raise PlanError(f"schedule has {schedule.num_stages} stages, plan {plan.num_stages}")
  prog = layers.program
  programs = slice_stages(layers, [s.layers for s in plan.stages], traced)
  batch_dependent = prog.dependents(  # the batch axis flows from split inputs and regen ops
      (prog.invars[k] for k, inp in enumerate(traced.inputs) if inp.kind == "split"),
      traced.regen_ops)
  remat = [plan.remat_of(spec) for spec in plan.stages]
  layouts = [stage_layout(sp, traced, layers, batch_dependent, spec.logical_mesh, spec.zero)
             for sp, spec in zip(programs, plan.stages)]
  functions = [stage_functions(sp, traced, layers, r, lay)
               for sp, lay, r in zip(programs, layouts, remat)]
  if retrace is not None:
    for s, spec in enumerate(plan.stages):
      got = _replicas(s, plan, programs[s], layouts[s], traced, layers, retrace, remat[s])
      if got is not None:
        layouts[s], functions[s] = got
  splits, split_functions = {}, {}
  for s, spec in enumerate(plan.stages):
    if spec.mixed:
      if retrace is None:
        raise PlanError(f"stage {s} runs on {len(spec.all_groups)} groups of devices; laying "
                        "it out needs the step traced at their rows (retrace=...)")
      splits[s], split_functions[s] = split_stage(
          s, plan.stages, programs[s], layouts[s], traced, layers, retrace, remat[s])
  zebras = {s: zebra_stage(s, plan.stages, programs[s], layouts[s], traced, layers, retrace,
                           remat[s])
            for s, spec in enumerate(plan.stages) if spec.zebra is not None}

  # Parameters: owner = first stage that reads them.
  param_vid = [prog.invars[k] for k, inp in enumerate(traced.inputs) if inp.kind == "param"]
  users = [[s for s, sp in enumerate(programs) if v in sp.param_ids] for v in param_vid]
  owner = [u[0] if u else 0 for u in users]
  producer = prog.producers()
  own_stage = {}
  for s, sp in enumerate(programs):
    for i in range(*sp.own_range):
      own_stage[i] = s
  output_stage = [-1 if isinstance(ref, Lit) or ref not in producer
                  else own_stage[producer[ref]] for ref in prog.outvars]

  # Placement of the rest of the step.
  outer = traced.outer
  region_eqn = outer.ops[traced.region_op]
  # a zebra stage's expert weights, their gradients and optimizer state: on its expert group
  # (placed as a home of its own, S + s)
  S = len(programs)
  held = expert_held(zebras, param_vid, users)
  place_at = [o + S * (j in held) for j, o in enumerate(owner)]
  seeds = {}
  for inp in traced.inputs:
    if inp.kind == "param" and not isinstance(inp.outer_ref, Lit):
      seeds.setdefault(inp.outer_ref, place_at[inp.param_index])
  n_fwd_out = len(prog.outvars)
  for k, vid in enumerate(region_eqn.outvars):
    if vid >= 0:
      seeds[vid] = max(output_stage[k], 0) if k < n_fwd_out else place_at[k - n_fwd_out]
  placed = expert_side(placement_lib.place(outer, traced.region_op, seeds), S)
  groups = placed.before + placed.after
  preferred = _preferred_specs(traced, prog, layouts, owner)
  expert_preferred(traced, prog, zebras, held, preferred)
  _zero_state_specs(traced, placed, layouts, preferred)
  _propagate_preferred(groups, outer, preferred)
  host = _offloaded(traced, placed, preferred, tuple(st.offload for st in plan.stages))
  host_params = frozenset(s for s, st in enumerate(plan.stages) if st.offload_params)
  if host_params and schedule.groups is None:
    raise PlanError(f"stage(s) {sorted(host_params)} keep their parameters in host memory "
                    "between their tasks (offload_params), which needs stages that share a "
                    f"device group; schedule {schedule.name!r} gives every stage devices of "
                    "its own: use an interleaved schedule or set offload_params to false")
  if host_params:
    host = host | _offloaded_params(traced, placed, preferred, host_params, users)
  combine = combine_rules(traced.output_flows, prog, loss_reduction)
  layout = step_layout(traced, layers, layouts, programs, placed, owner, users, output_stage,
                       preferred, combine, host)
  if splits:
    layout = dataclasses.replace(layout, splits=splits)
  if host_params:
    layout = dataclasses.replace(layout, host_params=host_params)
  residuals = frozenset(s for s, st in enumerate(plan.stages) if st.offload_activations)
  if residuals:
    layout = dataclasses.replace(layout, host_residuals=residuals)
  log.info("laid out %d stages; %d groups before and %d after the pipeline", len(programs),
           len(placed.before), len(placed.after))
  fns = []
  for g in groups:
    mesh = sharding_lib.abstract_mesh(plan.stages[g.home].logical_mesh)
    fns.append(group_function(g, {i: NamedSharding(mesh, preferred[(g.home, v)],
                                                   memory_kind="device")
                                  for i, v in enumerate(g.in_ids) if (g.home, v) in host}))
  return StepProgram(traced, layers, plan, schedule, tuple(programs), tuple(functions), placed,
                     tuple(fns), layout, split_functions, zebras)


def _replicas(s: int, plan: Plan, sp, layout, traced: TracedStep, layers: LayerSequence,
              retrace: Retrace, remat: str):
  """Stage ``s``'s layout and functions with its data-parallel replicas accumulating their own
  gradients (reduced once per step), or ``None`` where it cannot: one replica, ZeRO level 2
  or more, a mixed-type stage, examples that meet in the step, a step that traces otherwise
  at the replica's rows."""
  spec = plan.stages[s]
  lm = sharding_lib.LogicalMesh.of(spec.logical_mesh)
  dp, tp = lm.dp, lm.tp
  b = int(retrace.rows)
  if (dp <= 1 or lm.ep > 1 or spec.zero >= 2 or spec.mixed or spec.zebra is not None
      or traced.couplings or b % dp):
    return None
  try:
    part = part_at(s, plan.stages, sp, traced, layers, retrace, b // dp, (1, tp), remat)
    axes, combine = rows_of(s, layout, traced, layers, [part], b)
  except HarpjaxError as e:   # the step traces otherwise at the replica's rows
    log.info("stage %d all-reduces its gradients every microbatch: %s", s, e)
    return None
  specs = dict(layout.specs)
  for v, axis in axes.items():
    if v in specs and (v in layout.act_ids or v in layout.act_int_ids or v in layout.output_ids
                       or v in layout.data_ids):
      specs[v] = P() if axis is None else P(*([None] * axis + [sharding_lib.DP]))
  layout = dataclasses.replace(layout, specs=specs, replicas=True)
  return layout, replica_functions(layout, part, axes, combine, b)


def group_function(group: placement_lib.Group, to_device: dict | None = None) -> Callable:
  """The pure function of a placement group's ops: ``fn(*in values) -> out values``.

  ``to_device``: input position -> the sharding (memory kind ``"device"``) an input held in
  host memory is brought to before the ops read it."""
  run = ops_function(group.ops, group.in_ids, group.out_ids)
  if not to_device:
    return lambda *inputs: run(*inputs)

  def fn(*inputs):
    return run(*(jax.device_put(x, to_device[i]) if i in to_device else x
                 for i, x in enumerate(inputs)))
  return fn


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledStep:
  """A laid-out step jitted on devices: what the local runtime runs.

  Attributes:
    program: the :class:`StepProgram`.
    stages: per stage, its :class:`~harpjax.compiler.stages.stage.StageExecutables`.
    group_fns: per placement group, its jitted function (inputs and outputs in the stage's
      preferred shardings, see :attr:`StepLayout.preferred`).
  """
  program: StepProgram
  stages: tuple
  group_fns: tuple

  @property
  def traced(self) -> TracedStep:
    return self.program.traced

  @property
  def layers(self) -> LayerSequence:
    return self.program.layers

  @property
  def plan(self) -> Plan:
    return self.program.plan

  @property
  def schedule(self) -> Schedule:
    return self.program.schedule

  @property
  def layout(self) -> StepLayout:
    return self.program.layout

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def shared_parameters(self) -> list[tuple[int, int, tuple[int, ...]]]:
    """See :meth:`StepProgram.shared_parameters`."""
    return self.program.shared_parameters()


def compile_step(program: StepProgram, stage_devices: Sequence[Sequence]) -> CompiledStep:
  """Jits every stage's functions on its devices, and the placement groups on their stages.

  Args:
    program: from :func:`layout_step`.
    stage_devices: per stage, its JAX devices in submesh order.
  """
  lay = program.layout
  for s in sorted(lay.host_params):
    check_host_memory(stage_devices[s], s, params=True)
  for s in sorted({h for h, _ in lay.host}):
    check_host_memory(stage_devices[s], s)
  for s in sorted(lay.host_residuals):
    check_host_memory(stage_devices[s], s, residuals=True)
  stages = tuple(split_executables(lay, s, program.split_functions[s], devs)
                 if s in lay.splits else
                 zebra_executables(sl, *program.zebras[s], devs) if s in program.zebras else
                 jit_stage(sl, fn, sharding_lib.make_mesh(devs, sl.logical_mesh))
                 for s, (sl, fn, devs) in enumerate(zip(lay.stages, program.functions,
                                                        stage_devices)))
  group_fns = tuple(
      jax.jit(fn, out_shardings=lay.group_out_shardings(gi, stages[g.home].group_mesh(g.side)))
      for gi, (g, fn) in enumerate(zip(lay.groups, program.group_functions)))
  return CompiledStep(program, stages, group_fns)


def split_executables(layout: StepLayout, s: int, functions: Sequence, devices: Sequence,
                      remote: dict | None = None) -> SplitStageExecutables:
  """Stage ``s``, which splits its rows among groups, on ``devices`` (every group's, in
  order), behind the stage's interface. ``functions``: per group, its
  :class:`~harpjax.compiler.stages.stage.StageFunctions` (jitted here on the group's mesh),
  or ``load(group layout, mesh) -> StageExecutables`` (a worker loading lowered ones).
  ``remote``: group -> client of the groups that run in processes of their own
  (:class:`~harpjax.compiler.stages.split.RemoteGroup`; never the first); ``devices`` are
  then the other groups' only."""
  split = layout.splits[s]
  remote = dict(remote or {})
  if 0 in remote:
    raise PlanError(f"stage {s}: its first group holds the stage's state and cannot run in "
                    "another process")
  local = [g for g in range(len(split.groups)) if g not in remote]
  need = sum(split.groups[g].num_devices for g in local)
  if len(devices) != need:
    raise PlanError(f"stage {s} runs on {need} devices (its groups' in this process) but got "
                    f"{len(devices)}")
  parts, start = [], 0
  for g, (grp, fn) in enumerate(zip(split.groups, functions)):
    if g in remote:
      parts.append(RemoteGroup(grp.layout, remote[g]))
      continue
    mesh = sharding_lib.make_mesh(list(devices)[start:start + grp.num_devices],
                                  grp.layout.logical_mesh)
    start += grp.num_devices
    parts.append(jit_stage(grp.layout, fn, mesh) if isinstance(fn, StageFunctions)
                 else fn(grp.layout, mesh))
  home = layout.stages[s]
  mesh = sharding_lib.make_mesh(list(devices)[:split.groups[0].num_devices], home.logical_mesh)
  return SplitStageExecutables(home, mesh, None, None, None, parts=tuple(parts), split=split)


def _preferred_specs(traced: TracedStep, prog, layouts, owner) -> dict:
  """(stage, outer value id) -> spec for parameters and gradients on their owner."""
  out = {}
  region_eqn = traced.outer.ops[traced.region_op]
  n_fwd = len(prog.outvars)
  for k, inp in enumerate(traced.inputs):
    if inp.kind != "param":
      continue
    j = inp.param_index
    s = owner[j]
    spec = layouts[s].specs.get(prog.invars[k])
    if spec is None:
      continue
    if not isinstance(inp.outer_ref, Lit):
      out[(s, inp.outer_ref)] = spec
    g = region_eqn.outvars[n_fwd + j]
    if g >= 0:
      out[(s, g)] = layouts[s].acc_spec(prog.invars[k])
  return out


# --------------------------------------------------------------------------- ZeRO


def state_successors(traced: TracedStep) -> tuple[dict[int, int], dict[int, int]]:
  """The training state of a step, found from its data flow: which step outputs are the next
  values of which step inputs.

  A step input's *successor* is the step output nearest to it (fewest ops) along values of its
  own shape and dtype: ``p + u`` for a parameter ``p``, ``b1 * mu + (1 - b1) * g`` for a
  moment ``mu``. The *optimizer state* is every floating step input that is not a parameter
  of the pipelined region, does not flow into the region, and has a successor that is not a
  parameter's: Adam's moments, momentum buffers, Adafactor's factored statistics, whatever the
  optimizer's names. Step counters (integers), PRNG keys, scalars, the batch (it flows into
  the region) and the parameters are not.

  Returns:
    ``(parameters, optimizer state)``, each ``{input value id: successor value id}`` (outer
    program ids); a parameter without a successor is absent.
  """
  outer = traced.outer
  region = outer.ops[traced.region_op]
  consumers = outer.consumers()
  outputs = {v for v in outer.outvars if not isinstance(v, Lit)}
  nc = outer.num_consts
  leaves = outer.invars[nc:]

  def successor(v):
    aval = outer.avals[v]
    frontier, seen = [v], {v}
    while frontier:
      hits = sorted(u for u in frontier if u in outputs and u != v)
      if hits:
        return hits[0]
      nxt = []
      for u in frontier:
        for i in consumers.get(u, ()):
          if i == traced.region_op:
            continue
          for o in outer.ops[i].outvars:
            if o >= 0 and o not in seen and outer.avals[o].shape == aval.shape and \
                outer.avals[o].dtype == aval.dtype:
              seen.add(o)
              nxt.append(o)
      frontier = nxt
    return v if v in outputs else None   # returned unchanged

  params = {}
  for inp in traced.inputs:
    if inp.kind == "param" and not isinstance(inp.outer_ref, Lit) and inp.outer_ref in leaves:
      nxt = successor(inp.outer_ref)
      if nxt is not None:
        params[inp.outer_ref] = nxt
  producer = outer.producers()
  into_region, stack = set(), list(region.in_ids())   # values the region's inputs come from
  while stack:
    u = stack.pop()
    if u in into_region:
      continue
    into_region.add(u)
    if u in producer:
      stack.extend(outer.ops[producer[u]].in_ids())
  state = {}
  taken = set(params.values())
  for v in leaves:
    aval = outer.avals[v]
    if v in params or v in into_region or not primitives.is_float(aval) or not aval.shape:
      continue
    nxt = successor(v)
    if nxt is not None and nxt != v and nxt not in taken:
      state[v] = nxt
  return params, state


def _state_homes(traced: TracedStep, placement: placement_lib.Placement) -> dict:
  """Optimizer state input -> ``(its stage, its successor)``, for the state read on one stage
  only and whose successor is computed there (the rest has no home)."""
  _, state = state_successors(traced)
  readers: dict[int, set[int]] = {}
  for g in list(placement.before) + list(placement.after):
    for v in g.in_ids:
      readers.setdefault(v, set()).add(g.home)
  out = {}
  for v, nxt in state.items():
    homes = readers.get(v, set())
    if len(homes) == 1:
      (s,) = homes
      if placement.var_home.get(nxt) == s:
        out[v] = (s, nxt)
  return out


def _offloaded(traced: TracedStep, placement: placement_lib.Placement, preferred: dict,
               planned: Sequence[bool]) -> frozenset:
  """``(stage, value)`` of the optimizer state (inputs and successors) kept in host memory:
  of the stages the plan offloads (``planned``, per stage
  :attr:`~harpjax.compiler.plan.StageSpec.offload`); each gets a preferred sharding
  (replicated if it had none)."""
  chosen = {s for s, x in enumerate(planned) if x}
  if not chosen:
    return frozenset()
  host = set()
  for v, (s, nxt) in _state_homes(traced, placement).items():
    if s in chosen:
      for u in (v, nxt):
        preferred.setdefault((s, u), P())
        host.add((s, u))
  return frozenset(host)


def _offloaded_params(traced: TracedStep, placement: placement_lib.Placement, preferred: dict,
                      chosen: frozenset, users: Sequence[Sequence[int]]) -> frozenset:
  """``(stage, value)`` of the parameters (inputs and successors) kept in host memory between
  steps: those of the stages in ``chosen`` (:attr:`~harpjax.compiler.plan.StageSpec.
  offload_params`) that no other stage reads (``users``: per parameter index, the stages
  reading it) and whose successor the stage computes; each gets a preferred sharding
  (replicated if it had none). The update reads them into device memory and writes the new
  ones back."""
  params, _ = state_successors(traced)
  stage_of = {}
  for inp in traced.inputs:
    if inp.kind == "param" and not isinstance(inp.outer_ref, Lit):
      u = users[inp.param_index]
      stage_of[inp.outer_ref] = u[0] if len(u) == 1 else None
  host = set()
  for v, nxt in params.items():
    s = stage_of.get(v)
    if s in chosen and placement.var_home.get(nxt) == s:
      for u in (v, nxt):
        preferred.setdefault((s, u), P())
        host.add((s, u))
  return frozenset(host)


def _zero_state_specs(traced: TracedStep, placement: placement_lib.Placement, layouts,
                      preferred: dict) -> None:
  """Preferred shardings of the training state on stages with ZeRO (``preferred`` is updated):
  the optimizer state (:func:`state_successors`) split on ``dp`` from ZeRO-1 on, input and
  successor alike; a parameter's successor in the parameter's own sharding (split from ZeRO-3
  on), so that the next step reads the state in the sharding this one left it in. A value read
  or computed on several stages keeps no preference."""
  outer = traced.outer
  if not any(lay.zero for lay in layouts):
    return
  params, _ = state_successors(traced)
  without = dict(preferred)   # the shardings the state would have without ZeRO (tp splits)
  _propagate_preferred(list(placement.before) + list(placement.after), outer, without)
  held_on: dict[int, set[int]] = {}
  for (s, u) in preferred:
    held_on.setdefault(u, set()).add(s)
  for v, nxt in params.items():
    homes = held_on.get(v, set())
    if len(homes) == 1:
      (s,) = homes
      if placement.var_home.get(nxt) == s and layouts[s].zero:
        preferred[(s, nxt)] = preferred[(s, v)]
  for v, (s, nxt) in _state_homes(traced, placement).items():
    lay = layouts[s]
    if lay.zero < 1:
      continue
    base = without.get((s, v), P())
    lm = sharding_lib.LogicalMesh.of(lay.logical_mesh)
    spec = sharding_lib.zero_spec(outer.avals[v].shape, sharding_lib.without_dp(base),
                                  lm.dp, lm.tp)
    preferred[(s, v)] = preferred[(s, nxt)] = spec



def _propagate_preferred(groups: Sequence[placement_lib.Group], outer, preferred: dict) -> None:
  """Values of the groups with a parameter's shape that an op relates to a value with a
  preferred ``PartitionSpec`` on the same stage prefer it too: an Adam moment computed from the
  gradient, the new parameter from the old, and, backwards, the inputs behind them (the
  moments' previous values, however many ops and groups away). Repeated to a fixed point over
  all groups, so that a state leaf arrives in the sharding the previous step left it in and no
  group compiles twice."""
  changed = True
  while changed:
    changed = False
    for group in groups:
      h = group.home
      for op in group.ops:
        vals = [v for v in list(op.in_ids()) + list(op.outvars) if v >= 0]
        src = next(((outer.avals[v].shape, preferred[(h, v)]) for v in vals
                    if (h, v) in preferred), None)
        if src is None:
          continue
        shape, sh = src
        for v in vals:
          if (h, v) not in preferred and outer.avals[v].shape == shape:
            preferred[(h, v)] = sh
            changed = True


SHARED_PARAMETER_WARNING = 0.25
"""Share of the model's parameter bytes above which copies of shared parameters warn."""


def warn_shared_parameters(program: StepProgram, arg_paths: Sequence[str]) -> None:
  """Warns when copies of parameters read by several stages (sent every step, their gradients
  sent back) exceed :data:`SHARED_PARAMETER_WARNING` of the model's parameter bytes: the case
  of an ``nn.scan`` over layers, whose stacked parameters every stage running a layer reads.

  Args:
    program: the laid-out step.
    arg_paths: per step-argument leaf, its path (``jax.tree_util.keystr``), for the message.
  """
  shared = program.shared_parameters()
  if not shared:
    return
  prog = program.layers.program
  total = sum(aval_nbytes(prog.avals[prog.invars[k]])
              for k, inp in enumerate(program.traced.inputs) if inp.kind == "param")
  copies = sum(nbytes * (len(users) - 1) for _, nbytes, users in shared)
  if copies <= SHARED_PARAMETER_WARNING * total:
    log.info("%d parameters are read by several stages; %s of copies per step", len(shared),
             _size(copies))
    return
  paths = list(arg_paths)
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
