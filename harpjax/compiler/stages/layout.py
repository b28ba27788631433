"""What goes where: the picklable layout of a compiled step, for every runtime.

A stage's :class:`StageLayout` says which values it reads and writes, their shapes and how its
submesh shards them; the step's :class:`StepLayout` adds who computes what and who sends what
to whom. Derived once on the driver from the traced programs and the placement, it is all a
runtime needs besides the executables: the local runtime routes values between its stages by
it, and a Ray worker receives it (with its stage's lowered executables,
:class:`~harpjax.compiler.stages.LoweredStep`) and never sees a program. Every send has exactly
one matching receive: outer values (step arguments, placement groups' results, the region's
results) go from their home stage to each stage reading them; activations of a microbatch go,
after its forward, one message per consuming stage; cotangents come back the same way; gradient
parts of a parameter read by several stages go to its owner.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.layers import LayerSequence
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.trace import Lit, TracedStep

__all__ = ["StageLayout", "GroupLayout", "StepLayout", "stage_layout", "step_layout",
           "HOST_MEMORY"]

HOST_MEMORY = "pinned_host"
"""The memory kind of values a stage keeps in host memory."""


# --------------------------------------------------------------------------- one stage


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """What one stage reads and writes, their shapes and how they are sharded: plain data.

  Everything a runtime needs to feed the stage's executables and route its values, without
  the program (so it pickles to a Ray worker).

  Attributes:
    index: stage number.
    logical_mesh: ``(dp, tp)``, or ``(dp, tp, ep)`` with expert parallelism
      (:class:`~harpjax.compiler.layers.sharding.LogicalMesh`).
    param_ids: region value ids of the parameters read, in the executables' order.
    data_ids: region value ids of the region inputs read that change per step (split per
      microbatch or whole); constant inputs are baked into the executables.
    act_ids: floating activations from earlier stages (differentiated).
    act_int_ids: non-floating activations from earlier stages.
    output_ids: values produced here and read later or returned by the region.
    ct_present: per output, whether a cotangent flows back into it.
    specs: value id -> ``PartitionSpec`` over the mesh's axes of every value above (inputs
      as the executables take them, outputs as they return them; a cotangent has the sharding
      of its output).
    avals: value id -> ``jax.ShapeDtypeStruct`` of every value above.
    zero: the stage's ZeRO level (:attr:`~harpjax.compiler.plan.StageSpec.zero`).
    acc_specs: parameter id -> ``PartitionSpec`` of its gradient accumulator (the
      parameter's own below ZeRO-2, split on ``dp`` from ZeRO-2 on).
    gather_specs: parameter id -> the ``PartitionSpec`` the forward and backward gather it
      to where it is used (ZeRO-3, parameters split on ``dp`` only); absent: used as held.
    replicas: the stage's ``dp`` replicas each accumulate their own gradients, reduced once
      per step (:mod:`~harpjax.compiler.stages.replicas`): the accumulator is held as
      ``[dp, ...]`` per parameter (:meth:`held_acc_spec`), and ``acc_specs`` are the reduced
      gradients'.
  """
  index: int
  logical_mesh: tuple[int, int]
  param_ids: tuple
  data_ids: tuple
  act_ids: tuple
  act_int_ids: tuple
  output_ids: tuple
  ct_present: tuple
  specs: dict
  avals: dict
  zero: int = 0
  acc_specs: dict = dataclasses.field(default_factory=dict)
  gather_specs: dict = dataclasses.field(default_factory=dict)
  replicas: bool = False

  def acc_spec(self, vid: int) -> P:
    """The ``PartitionSpec`` of parameter ``vid``'s gradient (the accumulator reduced over the
    replicas, with :attr:`replicas`)."""
    return self.acc_specs.get(vid, self.specs[vid])

  def held_acc_spec(self, vid: int) -> P:
    """The ``PartitionSpec`` of parameter ``vid``'s accumulator as the backward holds it."""
    spec = self.acc_spec(vid)
    return P(sharding_lib.DP, *spec) if self.replicas else spec

  def held_acc_aval(self, vid: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of parameter ``vid``'s accumulator as the backward holds it."""
    aval = self.avals[vid]
    if not self.replicas:
      return aval
    return jax.ShapeDtypeStruct((self.logical_mesh[0],) + tuple(aval.shape), aval.dtype)


def stage_layout(sp, ts: TracedStep, layers: LayerSequence,
                 batch_dependent: set[int], logical_mesh: tuple[int, int],
                 zero: int = 0) -> StageLayout:
  """The layout of stage ``sp`` (a :class:`~harpjax.compiler.stages.stage.StageProgram`) on a
  ``(dp, tp)`` or ``(dp, tp, ep)`` logical mesh: parameters split Megatron-style on ``tp``
  (:mod:`harpjax.compiler.layers.sharding`), expert weights on ``ep``, batch-carrying values on
  ``dp`` (and ``ep``), the rest replicated. With ``zero >= 2`` the gradient accumulators are
  also split on ``dp`` (:func:`~harpjax.compiler.layers.sharding.zero_spec`), with ``zero == 3`` the
  parameters too (gathered where used)."""
  prog = layers.program
  lm = sharding_lib.LogicalMesh.of(logical_mesh)
  dp, tp = lm.dp, lm.tp
  own_ops = prog.ops[sp.own_range[0]:sp.own_range[1]]
  specs = dict(sharding_lib.param_specs(prog, own_ops, sp.param_ids, lm))
  acc_specs, gather_specs = {}, {}
  for v in sp.param_ids:
    split = sharding_lib.zero_spec(prog.avals[v].shape, specs[v], dp, tp)
    acc_specs[v] = split if zero >= 2 else specs[v]
    if zero >= 3 and split != specs[v]:
      gather_specs[v] = specs[v]
      specs[v] = split
  inputs_by_id = {prog.invars[k]: inp for k, inp in enumerate(ts.inputs)}
  data = tuple(v for v in sp.data_ids if inputs_by_id[v].kind != "static")
  for v in data:
    inp = inputs_by_id[v]
    specs[v] = (sharding_lib.batch_spec(prog.avals[v].shape, inp.axis, lm)
                if inp.kind == "split" else P())
  for v in sp.act_ids + sp.act_int_ids + sp.output_ids:
    specs[v] = (sharding_lib.batch_spec(prog.avals[v].shape, 0, lm) if v in batch_dependent
                else P())
  avals = {v: jax.ShapeDtypeStruct(prog.avals[v].shape, prog.avals[v].dtype,
                                   weak_type=getattr(prog.avals[v], "weak_type", False))
           for v in specs}
  return StageLayout(sp.index, lm.as_tuple(), tuple(sp.param_ids), data, sp.act_ids,
                     sp.act_int_ids, sp.output_ids, sp.ct_present, specs, avals, int(zero),
                     acc_specs, gather_specs)


# --------------------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True)
class GroupLayout:
  """A placement group (ops around the pipeline that run together on one stage).

  Attributes:
    home: its stage.
    in_ids: outer value ids it reads.
    out_ids: outer value ids it computes that others read.
    side: ``0``: on the stage's devices; ``1``: on a zebra stage's expert group.
  """
  home: int
  in_ids: tuple
  out_ids: tuple
  side: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
  """Who computes what, and who sends what to whom, in one step. Plain, picklable data; stage
  indices are pipeline positions, value ids are the traced programs'.

  Attributes:
    num_stages, num_microbatches, num_params: ``S``, ``B`` and the differentiated leaves.
    stages: per stage, its :class:`StageLayout`.
    groups: the placement groups, those before the pipeline first (``num_before`` of them).
    num_before: how many groups run before the pipeline.
    preferred: ``(stage, outer value id) -> PartitionSpec``: parameters, their gradients and
      the optimizer values computed elementwise from them, as their stage shards them;
      placement groups take and produce these shardings so that nothing is resharded between
      steps.
    outer_avals: outer value id -> ``jax.ShapeDtypeStruct`` of every value a group reads or
      a step output on a stage.
    const_vids: outer value ids of the step program's constants (every runtime has them).
    leaf_vids: per flattened step-argument leaf, its outer value id.
    leaf_readers: per leaf, the stages that read it.
    home: outer value id -> the stage computing it (placement groups and region outputs).
    readers: outer value id -> the stages reading it (groups and region inputs).
    before: per stage, indices into ``groups`` of its groups before the pipeline, in order.
    after: per stage, indices into ``groups[num_before:]`` of its groups after it, in order.
    region_inputs: per stage, ``(region invar index, outer ref)`` of the region inputs it
      reads (parameters, data, and inputs passed through to a region output it computes).
    region_invars: per region input, its region value id.
    input_kinds: region value id -> ``(kind, axis)`` of every non-parameter region input
      (``"split"`` along ``axis``, ``"whole"`` or ``"static"``).
    region_outvars: the region program's outputs (loss, then auxiliary values): value ids or
      :class:`~harpjax.compiler.trace.Lit` literals.
    region_results: the region op's results in the step program (outer value ids, ``-1`` when
      unused): loss, auxiliary values, then one gradient per parameter.
    region_out_home: per region result, the stage computing it.
    combine: per region output (the loss first), how the microbatches' values make the
      step's (:func:`~harpjax.compiler.trace.combine_rules`): ``("concat", axis)``,
      ``"mean"``, ``"sum"`` or ``"first"``.
    param_vids: per parameter, its region value id.
    param_avals: per parameter, its ``jax.ShapeDtypeStruct``.
    param_owner: per parameter, its owner stage (the first reader).
    param_users: per parameter, the stages reading it, increasing.
    grad_users: per parameter, the stages other than the owner whose gradient parts go to it.
    act_routes: ``(producer, consumer)`` -> region value ids sent after each forward.
    ct_routes: ``(consumer, producer)`` -> region value ids whose cotangents go back after
      each backward.
    ct_sources: per stage, region value id -> consumer stages sending its cotangent, in
      decreasing order (the order they are summed in).
    act_sources: per stage, the producer stages it receives activations from.
    ct_targets: per stage, the producer stages it sends cotangents to.
    outputs: per step output, ``("lit", value)``, ``("const", vid)``, ``("leaf", i)`` or
      ``("stage", s, vid)``.
    host: ``(stage, outer value id)`` of the values kept in host memory (memory kind
      ``"pinned_host"``) between the groups that use them: the optimizer state of stages
      that offload it (:class:`~harpjax.compiler.stages.OffloadOptions`).
    splits: stage -> its :class:`~harpjax.compiler.stages.split.SplitLayout`, for the stages
      that split their microbatches' rows among groups of devices (a mixed-type stage; its
      entry in ``stages`` is its home's layout).
    host_residuals: the stages that keep each microbatch's residuals in host memory between
      its forward and its backward (``OffloadOptions(activations=True)``).
    host_params: the stages that keep their parameters in host memory while their device
      group runs other stages (:attr:`~harpjax.compiler.plan.StageSpec.offload_params`): the
      interpreter fetches them before the stage's tasks and drops the device copy after;
      between steps they stay in host memory (in :attr:`host`, with their successors).
  """
  num_stages: int
  num_microbatches: int
  num_params: int
  stages: tuple
  groups: tuple
  num_before: int
  preferred: dict
  outer_avals: dict
  const_vids: tuple
  leaf_vids: tuple
  leaf_readers: tuple
  home: dict
  readers: dict
  before: tuple
  after: tuple
  region_inputs: tuple
  region_invars: tuple
  input_kinds: dict
  region_outvars: tuple
  region_results: tuple
  region_out_home: tuple
  combine: tuple
  param_vids: tuple
  param_avals: tuple
  param_owner: tuple
  param_users: tuple
  grad_users: tuple
  act_routes: dict
  ct_routes: dict
  ct_sources: tuple
  act_sources: tuple
  ct_targets: tuple
  outputs: tuple
  host: frozenset = frozenset()
  splits: dict = dataclasses.field(default_factory=dict)
  host_residuals: frozenset = frozenset()
  host_params: frozenset = frozenset()

  @property
  def loss_vid(self):
    return self.region_outvars[0]

  def preferred_sharding(self, stage: int, vid: int, mesh) -> NamedSharding | None:
    """Value ``vid``'s preferred sharding on ``stage``'s ``mesh`` (``None``: no preference),
    in host memory if the stage keeps it there (:attr:`host`)."""
    spec = self.preferred.get((stage, vid))
    if spec is None:
      return None
    if (stage, vid) in self.host:
      return NamedSharding(mesh, spec, memory_kind=HOST_MEMORY)
    return NamedSharding(mesh, spec)

  def group_out_shardings(self, gi: int, mesh) -> tuple:
    """The output shardings of placement group ``gi`` on its home stage's ``mesh``."""
    g = self.groups[gi]
    return tuple(self.preferred_sharding(g.home, v, mesh) for v in g.out_ids)

  def producer(self, vid: int) -> int:
    """The stage computing region value ``vid``."""
    for s, st in enumerate(self.stages):
      if vid in st.output_ids:
        return s
    raise KeyError(vid)

  def pairs(self) -> frozenset[tuple[int, int]]:
    """Every ``(sender, receiver)`` pair of stages that may exchange a message in a step.

    Step arguments held on the workers go from the stage that computed them (the home of a
    step output) to the stages that read them.
    """
    out = set(self.act_routes) | set(self.ct_routes)
    for v, h in self.home.items():
      out |= {(h, r) for r in self.readers.get(v, ()) if r != h}
    for j, users in enumerate(self.grad_users):
      out |= {(u, self.param_owner[j]) for u in users}
    holders = {o[1] for o in self.outputs if o[0] == "stage"}
    for rs in self.leaf_readers:
      out |= {(h, r) for h in holders for r in rs if r != h}
    return frozenset(out)


def step_layout(traced: TracedStep, layers: LayerSequence, stages, programs, placement,
                param_owner, param_users, output_stage, preferred: dict,
                combine: tuple, host: frozenset = frozenset()) -> StepLayout:
  """Derives the :class:`StepLayout` of a step cut into ``programs`` (see the module
  docstring).

  Args:
    traced, layers: the traced step and its layers.
    stages: per stage, its :class:`StageLayout`.
    programs: per stage, its :class:`~harpjax.compiler.stages.stage.StageProgram`.
    placement: the :class:`~harpjax.compiler.stages.placement.Placement` of the other ops.
    param_owner, param_users: per parameter, its owner and readers.
    output_stage: per region output, the stage computing it (``-1``: none).
    preferred: ``(stage, outer value id) -> PartitionSpec``.
    combine: per region output, how the microbatches' values combine.
    host: ``(stage, outer value id)`` of the values kept in host memory.
  """
  ts = traced
  outer = ts.outer
  prog = layers.program
  S = len(stages)
  region_eqn = outer.ops[ts.region_op]
  n_fwd = len(prog.outvars)
  nc = outer.num_consts
  const_vids = tuple(outer.invars[:nc])
  leaf_vids = tuple(outer.invars[nc:])
  readers: dict[int, set[int]] = defaultdict(set)
  home: dict[int, int] = {}

  groups = list(placement.before) + list(placement.after)
  n_before = len(placement.before)
  before = [[] for _ in range(S)]
  after = [[] for _ in range(S)]
  for gi, g in enumerate(groups):
    (before if gi < n_before else after)[g.home].append(gi if gi < n_before else gi - n_before)
    for v in g.in_ids:
      readers[v].add(g.home)
    for v in g.out_ids:
      home[v] = g.home

  # Region inputs each stage reads.
  invar_index = {vid: k for k, vid in enumerate(prog.invars)}
  dynamic = {prog.invars[k] for k, inp in enumerate(ts.inputs) if inp.kind != "static"}
  region_inputs: list[list[tuple[int, Any]]] = [[] for _ in range(S)]
  for s, sp in enumerate(programs):
    for v in tuple(sp.param_ids) + tuple(sp.data_ids):
      if v in dynamic:
        k = invar_index[v]
        region_inputs[s].append((k, region_eqn.invars[k]))
  region_out_home = []
  for k in range(len(region_eqn.outvars)):
    region_out_home.append(max(output_stage[k], 0) if k < n_fwd else param_owner[k - n_fwd])
  for k, ref in enumerate(prog.outvars):   # region inputs passed through to an output
    if not isinstance(ref, Lit) and ref in invar_index:
      kk = invar_index[ref]
      entry = (kk, region_eqn.invars[kk])
      if entry not in region_inputs[region_out_home[k]]:
        region_inputs[region_out_home[k]].append(entry)
  for s in range(S):
    for _, ref in region_inputs[s]:
      if not isinstance(ref, Lit):
        readers[ref].add(s)
  for k, vid in enumerate(region_eqn.outvars):
    if vid >= 0:
      home[vid] = region_out_home[k]
  for v in const_vids:   # every runtime has the constants
    readers.pop(v, None)
    home.pop(v, None)

  # Activations and cotangents.
  producer = {}
  for s, sp in enumerate(programs):
    for v in sp.output_ids:
      producer[v] = s
  act_routes: dict[tuple[int, int], list[int]] = defaultdict(list)
  ct_routes: dict[tuple[int, int], list[int]] = defaultdict(list)
  ct_sources: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(S)]
  for t, sp in enumerate(programs):
    for v in tuple(sp.act_ids) + tuple(sp.act_int_ids):
      act_routes[(producer[v], t)].append(v)
    for v in sp.act_ids:
      p = producer[v]
      ct_routes[(t, p)].append(v)
      ct_sources[p][v].append(t)
  act_sources = tuple(tuple(sorted(p for (p, t) in act_routes if t == s)) for s in range(S))
  ct_targets = tuple(tuple(sorted(p for (t, p) in ct_routes if t == s)) for s in range(S))

  param_vids = tuple(prog.invars[k] for k, inp in enumerate(ts.inputs) if inp.kind == "param")
  grad_users = tuple(tuple(s for s in param_users[j] if s != param_owner[j])
                     for j in range(ts.num_params))

  leaf_pos = {v: i for i, v in enumerate(leaf_vids)}
  outputs = []
  for ref in outer.outvars:
    if isinstance(ref, Lit):
      outputs.append(("lit", ref.value))
    elif ref in const_vids:
      outputs.append(("const", ref))
    elif ref in leaf_pos:
      outputs.append(("leaf", leaf_pos[ref]))
    else:
      outputs.append(("stage", home[ref], ref))

  aval = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type",
                                                                             False))
  outer_avals = {v: aval(outer.avals[v]) for g in groups for v in g.in_ids}
  outer_avals.update({o[2]: aval(outer.avals[o[2]]) for o in outputs if o[0] == "stage"})
  frozen_readers = {v: frozenset(rs) for v, rs in readers.items()}
  return StepLayout(
      num_stages=S, num_microbatches=ts.num_microbatches, num_params=ts.num_params,
      stages=tuple(stages),
      groups=tuple(GroupLayout(g.home, tuple(g.in_ids), tuple(g.out_ids), g.side)
                   for g in groups),
      num_before=n_before, preferred=dict(preferred), outer_avals=outer_avals,
      const_vids=const_vids, leaf_vids=leaf_vids,
      leaf_readers=tuple(frozen_readers.get(v, frozenset()) for v in leaf_vids),
      home=home, readers=frozen_readers,
      before=tuple(tuple(b) for b in before), after=tuple(tuple(a) for a in after),
      region_inputs=tuple(tuple(r) for r in region_inputs),
      region_invars=tuple(prog.invars),
      input_kinds={prog.invars[k]: (inp.kind, inp.axis) for k, inp in enumerate(ts.inputs)
                   if inp.kind != "param"},
      region_outvars=tuple(prog.outvars), region_results=tuple(region_eqn.outvars),
      region_out_home=tuple(region_out_home), combine=tuple(combine),
      param_vids=param_vids, param_avals=tuple(aval(prog.avals[v]) for v in param_vids),
      param_owner=tuple(param_owner), param_users=tuple(tuple(u) for u in param_users),
      grad_users=grad_users,
      act_routes={k: tuple(sorted(v)) for k, v in act_routes.items()},
      ct_routes={k: tuple(sorted(v)) for k, v in ct_routes.items()},
      ct_sources=tuple({v: tuple(sorted(ts_, reverse=True)) for v, ts_ in d.items()}
                       for d in ct_sources),
      act_sources=act_sources, ct_targets=ct_targets, outputs=tuple(outputs),
      host=frozenset(host))
