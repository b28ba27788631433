"""From a traced step, a layer sequence and a plan to everything the runtimes execute."""

from __future__ import annotations

import dataclasses
import logging
from typing import Collection, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.layers import LayerSequence
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.plan import Plan
from harpjax.compiler.schedule import Schedule
from harpjax.compiler.stages import placement as placement_lib
from harpjax.compiler.stages.stage import (StageExecutables, build_stage_executables,
                                           slice_stages)
from harpjax.compiler.trace import Lit, TracedStep, aval_nbytes, eval_ops
from harpjax.errors import PlanError

log = logging.getLogger(__name__)

__all__ = ["CompiledStep", "compile_step", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(eq=False)
class CompiledStep:
  """Everything needed to run one pipelined train step.

  Attributes:
    traced: the traced step.
    layers: the layer sequence of the region.
    plan: the plan (with warm-up counts filled in).
    schedule: the task tables.
    stages: per-stage executables.
    placement: where the ops around the region run.
    group_fns: jitted function per placement group (same order as ``placement.before +
      placement.after``).
    param_owner: per parameter index, the stage that owns it (first reader).
    param_users: per parameter index, the stages reading it.
    output_stage: per region output (loss, aux...), the stage computing it, or ``-1`` when the
      output is a region input or a literal.
    batch_dependent: region value ids whose leading axis carries the batch.
    loss_reduction: ``"mean"`` or ``"sum"``.
    programs: per stage, its :class:`~harpjax.compiler.stages.StageProgram` (for every stage,
      built or not).
    built: indices of the stages whose executables (and placement groups) were built; the
      entries of ``stages`` and ``group_fns`` of the others are ``None``.
    preferred: ``(stage, outer value id) -> NamedSharding``: parameters, their gradients and
      the optimizer values computed elementwise from them, as the stage shards them. Placement
      groups take and produce these shardings so that nothing is resharded between steps.
  """
  traced: TracedStep
  layers: LayerSequence
  plan: Plan
  schedule: Schedule
  stages: list
  placement: placement_lib.Placement
  group_fns: list
  param_owner: list
  param_users: list
  output_stage: list
  batch_dependent: set
  loss_reduction: str
  programs: list = dataclasses.field(default_factory=list)
  built: frozenset = frozenset()
  preferred: dict = dataclasses.field(default_factory=dict)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def shared_parameters(self) -> list[tuple[int, int, tuple[int, ...]]]:
    """Parameters read by several stages: ``(step argument leaf index, bytes, readers)``.

    The owner (the first reader) sends each to the other readers every step and sums the
    gradient parts they send back; it alone holds the optimizer state. A leaf index is
    ``-1`` for a parameter that is not a step argument."""
    ts, prog = self.traced, self.layers.program
    leaf_of = {v: i for i, v in enumerate(ts.outer.invars[len(ts.outer_consts):])}
    out = []
    for k, inp in enumerate(ts.inputs):
      users = self.param_users[inp.param_index] if inp.kind == "param" else ()
      if len(users) > 1:
        out.append((leaf_of.get(inp.outer_ref, -1), aval_nbytes(prog.avals[prog.invars[k]]),
                    tuple(users)))
    return out

  def output_sharding(self, stage: int, vid: int) -> NamedSharding:
    """Sharding of a stage output (cotangents sent to it use the same)."""
    st = self.stages[stage]
    dp = st.mesh.devices.shape[0]
    shape = self.layers.program.avals[vid].shape
    spec = sharding_lib.batch_spec(shape, 0, dp) if vid in self.batch_dependent else P()
    return NamedSharding(st.mesh, spec)


def compile_step(traced: TracedStep, layers: LayerSequence, plan: Plan,
                 stage_devices: Sequence[Sequence | None], schedule: Schedule,
                 loss_reduction: str = "mean",
                 build_stages: Collection[int] | None = None) -> CompiledStep:
  """Builds stage executables and the placement of the rest of the step.

  Args:
    traced: from :func:`harpjax.compiler.trace.trace_step`.
    layers: the region's layers; the plan's ranges index them.
    plan: stages with logical meshes.
    stage_devices: per stage, its JAX devices in submesh order (``None`` for a stage that is
      not built).
    schedule: the task tables (one row per stage).
    loss_reduction: how microbatch losses combine into the step's loss.
    build_stages: stages whose executables and placement groups to build; ``None`` builds
      all. A stage worker of the distributed runtime builds only its own; the slicing, the
      parameter owners and the placement are computed for every stage either way.
  """
  if loss_reduction not in LOSS_REDUCTIONS:
    raise PlanError(f"loss_reduction={loss_reduction!r}; choose one of {LOSS_REDUCTIONS}")
  if plan.stages[-1].layers[1] != len(layers) - 1:
    raise PlanError(f"the plan's stages cover layers 0..{plan.stages[-1].layers[1]} but the "
                    f"model has {len(layers)} layers (0..{len(layers) - 1}): {layers}")
  if schedule.num_stages != plan.num_stages:
    raise PlanError(f"schedule has {schedule.num_stages} stages, plan {plan.num_stages}")
  prog = layers.program
  ranges = [s.layers for s in plan.stages]
  programs = slice_stages(layers, ranges, traced)
  batch_dependent = _batch_dependent(traced, prog)
  built = frozenset(range(plan.num_stages) if build_stages is None else build_stages)
  stages: list[StageExecutables | None] = []
  for s, (spec, sp, devs) in enumerate(zip(plan.stages, programs, stage_devices)):
    if s not in built:
      stages.append(None)
      continue
    mesh = sharding_lib.make_mesh(devs, spec.logical_mesh)
    stages.append(build_stage_executables(sp, traced, layers, mesh, batch_dependent,
                                          remat=bool(dict(plan.meta).get("remat", False))))

  # Parameters: owner = first stage that reads them.
  num_params = traced.num_params
  param_vid = [prog.invars[k] for k, inp in enumerate(traced.inputs) if inp.kind == "param"]
  assert len(param_vid) == num_params
  users = [[s for s, sp in enumerate(programs) if v in sp.param_ids] for v in param_vid]
  owner = [u[0] if u else 0 for u in users]

  producer = prog.producers()
  own_stage = {}
  for s, sp in enumerate(programs):
    for i in range(*sp.own_range):
      own_stage[i] = s
  output_stage = []
  for ref in prog.outvars:
    if isinstance(ref, Lit) or ref not in producer:
      output_stage.append(-1)
    else:
      output_stage.append(own_stage[producer[ref]])

  # Placement of the rest of the step.
  outer = traced.outer
  region_eqn = outer.ops[traced.region_op]
  seeds = {}
  for k, inp in enumerate(traced.inputs):
    if inp.kind == "param" and not isinstance(inp.outer_ref, Lit):
      seeds.setdefault(inp.outer_ref, owner[inp.param_index])
  n_fwd_out = len(prog.outvars)
  for k, vid in enumerate(region_eqn.outvars):
    if vid < 0:
      continue
    if k < n_fwd_out:
      seeds[vid] = max(output_stage[k], 0)
    else:
      seeds[vid] = owner[k - n_fwd_out]
  placed = placement_lib.place(outer, traced.region_op, seeds)
  preferred = _preferred_shardings(traced, prog, stages, owner)
  groups = placed.before + placed.after
  _propagate_preferred([g for g in groups if g.home in built], outer, preferred)
  group_fns = [_jit_group(g, [preferred.get((g.home, v)) for v in g.out_ids])
               if g.home in built else None for g in groups]
  log.info("compiled %d of %d stages; %d groups before and %d after the pipeline", len(built),
           len(stages), len(placed.before), len(placed.after))
  return CompiledStep(traced, layers, plan, schedule, stages, placed, group_fns, owner, users,
                      output_stage, batch_dependent, loss_reduction, programs, built, preferred)


def _jit_group(group: placement_lib.Group, out_shardings: Sequence):
  ops, in_ids, out_ids = group.ops, group.in_ids, group.out_ids

  def fn(*inputs):
    env = dict(zip(in_ids, inputs))
    eval_ops(ops, env)
    return tuple(env[v] for v in out_ids)

  return jax.jit(fn, out_shardings=tuple(out_shardings))


def _preferred_shardings(traced: TracedStep, prog, stages, owner) -> dict:
  """(stage, outer value id) -> sharding for parameters and gradients on their owner."""
  out = {}
  region_eqn = traced.outer.ops[traced.region_op]
  n_fwd = len(prog.outvars)
  for k, inp in enumerate(traced.inputs):
    if inp.kind != "param":
      continue
    j = inp.param_index
    s = owner[j]
    if stages[s] is None:   # a stage worker builds only its own stage
      continue
    sh = stages[s].param_sharding.get(prog.invars[k])
    if sh is None:
      continue
    if not isinstance(inp.outer_ref, Lit):
      out[(s, inp.outer_ref)] = sh
    g = region_eqn.outvars[n_fwd + j]
    if g >= 0:
      out[(s, g)] = sh
  return out


def _propagate_preferred(groups: Sequence[placement_lib.Group], outer, preferred: dict) -> None:
  """Values of the groups with a parameter's shape that an op relates to a value with a
  preferred sharding on the same stage prefer it too: an Adam moment computed from the
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


def _batch_dependent(traced: TracedStep, prog) -> set[int]:
  roots = {prog.invars[k] for k, inp in enumerate(traced.inputs) if inp.kind == "split"}
  dep = set(roots)
  for op in prog.ops:
    if op.index in traced.regen_ops or any(v in dep for v in op.in_ids()):
      dep.update(v for v in op.outvars if v >= 0)
  return dep
