"""Zebra stages: a mixture-of-experts stage whose experts run on a second group of devices
(attention/expert disaggregation with zebra overlap, HeterMoE §4.1; docs/moe.md).

A stage with :attr:`~harpjax.compiler.plan.StageSpec.zebra` runs on two groups: the stage's
own devices (the *attention group*: everything but the experts, and the stage's values arrive
and leave there) and the zebra group's (the *expert group*). Its program is cut, per routed
layer ``k`` of :attr:`~harpjax.compiler.plan.ZebraGroup.routed_layers`, into

* ``A_k`` (attention group): the ops since the previous routed layer's experts, up to this
  layer's dispatch (the previous layer's combine, attention, norms, the router, the capacity
  positions, the dispatch einsum or gather); ``A_K`` after the last routed layer is the tail;
* ``E_k`` (expert group): the layer's experts: the ``dot_general`` s reading an expert weight
  (:func:`~harpjax.compiler.layers.sharding.ep_dims`), the views of those weights, and the ops
  between the matmuls that read only their results (SwiGLU's ``silu`` and product), the same
  ops the profiler counts as the experts' (:mod:`harpjax.compiler.profile.routed_split`).

Each part is a stage of its own for :func:`~harpjax.compiler.stages.stage.stage_functions`
(forward returning its residuals, backward, accumulator), jitted on its group's mesh: the
attention group's logical mesh is the stage's, the expert group's ``(1, 1, N)`` (its ``N``
devices split the experts) when ``N`` divides every routed layer's experts, else ``(N, 1)``.
Values cross between the groups per zebra microbatch per layer (the dispatched tokens forward,
their cotangents backward: the dispatch and combine all-to-alls).

Every pipeline microbatch of ``b`` rows is cut into ``R`` (:attr:`~harpjax.compiler.plan.
ZebraGroup.num_microbatches`) zebra microbatches of ``b / R`` rows, traced at their rows as a
mixed-type stage's groups are (:func:`~harpjax.compiler.stages.split.part_at`: the same
program, the full batch's random draws sliced, mean-exact sums): a forward task runs the
``R`` zebra microbatches through the parts in the order of Theorem 1
(:func:`~harpjax.compiler.schedule.theorem1_order`) restricted to the forward, a backward task
in its backward part, each group's tasks in its stream's order (:func:`issue_order`): the
attention group computes ``A_{k+1}`` of one zebra microbatch while the expert group computes
``E_k`` of another (the executables are dispatched asynchronously; each device runs its own in
the order issued). Where the step's examples meet (``TracedStep.couplings``: capacity or the
auxiliary loss decided over the microbatch's tokens) a zebra microbatch would route over its
own tokens only, so the stage runs ``R = 1`` (the groups then overlap across the pipeline's
microbatches only) and says so.

**Where the state lives.** The expert weights (:attr:`ZebraLayout.expert_params`: the
parameters only experts' parts read, and no other stage) live on the expert group, whole and
sharded as the experts' parts read them (the expert mesh's ``ep`` axis splits the experts):
their gradients are summed there (:meth:`ZebraStageExecutables.total`), and their optimizer
state and update run there too (the placement groups that update them are the stage's
*side 1*, :func:`expert_side`, jitted on the expert group's mesh). Nothing of them crosses
per step, but the experts moved onto the attention group (below), whose weights are sent
there each step and whose gradients come back. The attention group holds the rest of the
stage's parameters, their gradients and optimizer state.

**Asymmetric expert assignment** (a non-zero :attr:`~harpjax.compiler.plan.ZebraGroup.offload`
``o_k``): of each expert GPU's ``n / N`` experts of layer ``k`` (in expert order, GPU ``g``
holding ``g n / N ..``), the first ``o_k`` run on the attention group instead: the layer's
experts' part runs twice, ``E_k`` on the kept experts (expert group) and ``X_k`` on the moved
ones (attention group), each on its experts' slice of the weights and of the dispatched tokens
(the experts' axis of each value: :func:`_expert_axes`); their outputs, their inputs'
cotangents and their weights' gradients are joined in expert order on the attention group.
``X`` tasks follow Theorem 1's order (after the layer's ``A`` tasks forward, before the layer
below's backward).

Not run (:func:`check_zebra_runs` raises :class:`~harpjax.errors.ZebraPlanOnlyError`): the Ray
runtime, ZeRO levels, offloaded optimizer state or residuals, interleaved schedules; experts
that cannot run on a part of them (a parameter or output without an experts' axis) when some
are moved.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
from collections import defaultdict
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from harpjax.compiler.layers import LayerSequence
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.schedule import ZebraCosts, ZebraTask, schedule_kind, theorem1_order
from harpjax.compiler.profile import expert_forward_ops
from harpjax.compiler.stages.layout import StageLayout, stage_layout
from harpjax.compiler.stages.placement import Placement
from harpjax.compiler.stages.split import (FIRST, SUMMED, WEIGHTED, Retrace, part_at, rows_of)
from harpjax.compiler.stages.stage import (StageExecutables, StageFunctions, StageProgram,
                                           jit_stage, put, row_slice, slice_stages,
                                           stage_functions)
from harpjax.compiler.trace import Lit, TracedStep, ops_function, primitives, regen_sites
from harpjax.errors import PlanError, ZebraPlanOnlyError

log = logging.getLogger(__name__)

__all__ = ["ZebraPart", "ZebraLayout", "zebra_stage", "issue_order", "expert_mesh",
           "expert_held", "expert_side", "expert_preferred",
           "ZebraStageExecutables", "zebra_executables", "check_zebra_runs"]

_RANDOM = frozenset({"random_bits", "random_split", "random_fold_in", "random_seed",
                     "random_wrap", "rng_bit_generator", "rng_uniform"})


# --------------------------------------------------------------------------- what runs where


def check_zebra_runs(plan: Plan, local: bool = True) -> None:
  """Raises :class:`~harpjax.errors.ZebraPlanOnlyError` when ``plan`` has a zebra stage the
  runtime does not run (module docstring); the message names the stage and what to change.

  Args:
    plan: the plan to run.
    local: whether the local runtime runs it (``False``: the Ray runtime).
  """
  zebra = [s for s, st in enumerate(plan.stages) if st.zebra is not None]
  if not zebra:
    return
  what = (f"stages {zebra} of the plan are zebra stages (attention and experts on two groups "
          "of GPUs)")
  if not local:
    raise ZebraPlanOnlyError(f"{what}: the Ray runtime does not run zebra stages yet; run the "
                             "step with harpjax.LocalRuntime(), or plan without them "
                             "(MixedOptions(zebra='off'); the default, 'auto', plans none for Ray)")
  if schedule_kind(plan.schedule).chunks > 1:
    raise ZebraPlanOnlyError(f"{what}: an interleaved schedule ({plan.schedule!r}) does not "
                             "run zebra stages; use 'h1f1b', '1f1b', 'eager_1f1b' or 'gpipe'")
  for s in zebra:
    st = plan.stages[s]
    bad = [name for name, on in (("zero", st.zero > 0), ("offload", st.offload),
                                 ("offload_activations", st.offload_activations)) if on]
    if bad:
      raise ZebraPlanOnlyError(
          f"stage {s} is a zebra stage with {', '.join(f'{n}={getattr(st, n)!r}' for n in bad)}"
          ", which the runtime does not run on zebra stages yet: set them to 0/False for that "
          "stage (SolveOptions(zero=..., offload=False) for the planner)")


def expert_mesh(zebra, num_experts: Sequence[int]) -> tuple[int, ...]:
  """The expert group's logical mesh: ``(1, 1, N)`` (its ``N`` devices split the experts) when
  ``N > 1`` divides every routed layer's experts, else ``(N, 1)`` (data-parallel)."""
  n = zebra.num_devices
  if n > 1 and all(e % n == 0 for e in num_experts):
    return (1, 1, n)
  return (n, 1)


@dataclasses.dataclass(frozen=True)
class ZebraPart:
  """One part of a zebra stage (module docstring).

  Attributes:
    kind: ``"A"`` (attention group), ``"E"`` (experts on the expert group) or ``"X"``
      (experts moved onto the attention group: asymmetric expert assignment).
    layer: ``k``: the routed layer it precedes (``A``; ``K`` is the tail) or computes the
      experts of (``E``, ``X``), counted within the stage.
    layout: its :class:`~harpjax.compiler.stages.layout.StageLayout` (values at the zebra
      microbatch's rows, on its group's logical mesh; with ``experts``, at those experts).
    experts: the experts it computes, in order (``None``: every expert of the layer, or no
      experts: an ``A`` part).
    axes: value id -> the experts' axis of each value it reads or writes (``None``: a value
      without one, read whole), with ``experts``.
  """
  kind: str
  layer: int
  layout: StageLayout
  experts: tuple | None = None
  axes: dict = dataclasses.field(default_factory=dict)

  def inverse(self, other: "ZebraPart") -> np.ndarray:
    """The positions that put this part's experts followed by ``other``'s back in expert
    order."""
    return np.argsort(np.asarray(self.experts + other.experts))


@dataclasses.dataclass(frozen=True)
class ZebraLayout:
  """How a zebra stage runs: plain, picklable data.

  Attributes:
    stage: the stage.
    rows: rows per pipeline microbatch (``b``).
    zebra_rows: rows per zebra microbatch (``b / R``).
    num_microbatches: ``R`` as it runs (1 where examples meet).
    parts: ``A_0, E_0, [X_0,] A_1, ..., E_{K-1}, [X_{K-1},] A_K`` (:class:`ZebraPart`; ``X_k``
      where layer ``k`` moves experts onto the attention group).
    axes: value id -> row axis (``None``: none) of the stage's values but its parameters.
    combine: output id -> :data:`~harpjax.compiler.stages.split.WEIGHTED`, ``SUMMED`` or
      ``FIRST``, for the outputs without a row axis.
    attn_devices, expert_devices: devices of each group (the stage's devices list the
      attention group's first).
    forward, backward: the :class:`~harpjax.compiler.schedule.ZebraTask` s of a forward and a
      backward task, in the order they are issued (:func:`issue_order`).
    expert_mesh: the expert group's logical mesh (:func:`expert_mesh`).
    expert_params: parameter id -> its ``PartitionSpec`` on the expert group, of the
      parameters held there (every expert weight: the parameters only experts' parts read),
      whole (every expert of the layer) and in the experts' parts' sharding.
  """
  stage: int
  rows: int
  zebra_rows: int
  num_microbatches: int
  parts: tuple
  axes: dict
  combine: dict
  attn_devices: int
  expert_devices: int
  forward: tuple
  backward: tuple
  expert_mesh: tuple = (1, 1)
  expert_params: dict = dataclasses.field(default_factory=dict)

  @property
  def num_routed(self) -> int:
    return sum(p.kind == "E" for p in self.parts)

  def part_of(self, task: ZebraTask) -> int:
    """The index in :attr:`parts` of the part a task runs."""
    for i, p in enumerate(self.parts):
      if p.kind == task.kind and p.layer == task.layer:
        return i
    raise KeyError(task)

  def twin(self, i: int) -> int | None:
    """The part computing the other experts of part ``i``'s layer (``E_k`` for ``X_k`` and
    the reverse), or ``None``."""
    p = self.parts[i]
    if p.experts is None:
      return None
    other = "X" if p.kind == "E" else "E"
    return next(j for j, q in enumerate(self.parts) if q.kind == other and q.layer == p.layer)


def issue_order(num_routed: int, num_microbatches: int, direction: str,
                offloaded: Sequence[bool] = ()) -> tuple:
  """The tasks of a zebra stage's forward (``"F"``) or backward (``"B"``) task, in the order
  they are issued: each stream's tasks in Theorem 1's order
  (:func:`~harpjax.compiler.schedule.theorem1_order`, restricted to ``direction``), the two
  streams merged so that every task comes after its dependencies (forward ``A_k -> E_k ->
  A_{k+1}``, backward the reverse; ``X_k`` beside ``E_k`` for the ``offloaded`` layers), the
  expert stream's next task first when both are ready.
  """
  L, R = num_routed, num_microbatches
  moved = tuple(bool(x) for x in offloaded) or (False,) * L
  order = theorem1_order(ZebraCosts(L, R, 1.0, 1.0, 1.0, 1.0,
                                    offload_fwd_s=[float(x) for x in moved])) if L else None
  if order is None:
    attn = [ZebraTask("A", direction, 0, j) for j in range(R)]
    return tuple(attn)
  attn = [t for t in order.attn if t.direction == direction]
  expert = [t for t in order.expert if t.direction == direction]

  def deps(t: ZebraTask) -> tuple:
    k, j, d = t.layer, t.microbatch, direction
    if t.kind in "EX":
      return (ZebraTask("A", d, k if d == "F" else k + 1, j),)
    k = k - 1 if d == "F" else k
    if not 0 <= k < L:
      return ()
    return (ZebraTask("E", d, k, j),) + ((ZebraTask("X", d, k, j),) if moved[k] else ())

  done: set = set()
  out: list = []
  a = e = 0
  while a < len(attn) or e < len(expert):
    if e < len(expert) and all(d in done for d in deps(expert[e])):
      t, e = expert[e], e + 1
    elif a < len(attn) and all(d in done for d in deps(attn[a])):
      t, a = attn[a], a + 1
    else:   # Theorem 1's order is dependency-valid: never reached
      raise AssertionError(f"zebra order deadlocks at {attn[a:a + 1]} / {expert[e:e + 1]}")
    done.add(t)
    out.append(t)
  return tuple(out)


# --------------------------------------------------------------------------- cutting the stage


def _expert_ops(ops, weights: set, const) -> set[int]:
  """Op indices of the experts of one routed layer's forward ops: the profiler's rule
  (:func:`harpjax.compiler.profile.routed_split.expert_forward_ops`), so the runtime splits
  what the cost tables charge to the expert group."""
  return expert_forward_ops(ops, weights, const)


def _cut(s: int, sp: StageProgram, ts: TracedStep, layers: LayerSequence,
         routed: Sequence[int]) -> tuple[list[StageProgram], list[int], list[dict]]:
  """Stage program ``sp`` cut into ``A_0, E_0, ..., A_K``; each routed layer's number of
  experts and its expert weights (parameter id -> experts' dimension).

  Raises:
    PlanError: a routed layer of the zebra group reads no expert weight, or its experts read
      a value computed after them.
  """
  prog = layers.program
  variable = prog.dependents(prog.invars)
  const = lambda r: isinstance(r, Lit) or r not in variable
  expert_part: dict[int, int] = {}
  num_experts, weights_of = [], []
  for k, l in enumerate(routed):
    a, b = layers.op_range(l, l)
    ops = prog.ops[a:b]
    weights = sharding_lib.ep_dims(prog, ops, sp.param_ids, 1)
    if not weights:
      raise PlanError(f"stage {s}: the zebra group names layer {l} as routed, but it reads no "
                      "expert weight (a parameter a dot_general reads with a batch dimension); "
                      "list only the stage's routed layers in ZebraGroup.routed_layers")
    num_experts.append(min(int(prog.avals[p].shape[d]) for p, d in weights.items()))
    weights_of.append(dict(weights))
    for i in _expert_ops(ops, set(weights), const):
      expert_part[i] = 2 * k + 1
  # every other op: the first attention part after everything it reads; constants (ops of
  # literals only) and views of parameters recomputed in each part that reads them
  static = {op.index for op in sp.ops
            if not any(not const(r) for r in op.invars) and op.name not in _RANDOM
            and op.index not in ts.regen_ops and op.params.get("jaxpr") is None}
  derived = set(sp.param_ids)   # views of the parameters alone: recomputed where read too
  for op in sp.ops:
    ins = [r for r in op.invars if not const(r)]
    outs = [o for o in op.outvars if o >= 0]
    if (op.index not in static and op.index not in expert_part and ins and outs
        and all(r in derived for r in ins) and primitives.is_view(op.name)
        and op.params.get("jaxpr") is None):
      static.add(op.index)
      derived.update(outs)
  level: dict[int, int] = {}
  part_of_op: dict[int, int] = {}
  for op in sp.ops:
    if op.index in static:
      continue
    at = max((level.get(v, 0) for v in op.in_ids()), default=0)
    if op.index in expert_part:
      p = expert_part[op.index]
      if at > p:
        raise PlanError(f"stage {s}: an expert op of routed layer {routed[p // 2]} "
                        f"({op.name}) reads a value computed after that layer's experts")
    else:
      p = at + (at % 2)
    part_of_op[op.index] = p
    for o in op.outvars:
      if o >= 0:
        level[o] = p
  n = 2 * len(routed) + 1
  producer = {o: op for op in sp.ops for o in op.outvars if o >= 0}
  own = [[op for op in sp.ops if part_of_op.get(op.index) == p] for p in range(n)]
  ops_of = []
  for p in range(n):   # the constants each part reads, in program order
    need, stack = set(), [v for op in own[p] for v in op.in_ids()]
    while stack:
      v = stack.pop()
      op = producer.get(v)
      if op is not None and op.index in static and op.index not in need:
        need.add(op.index)
        stack.extend(op.in_ids())
    ops_of.append(tuple(op for op in sp.ops
                        if op.index in need or part_of_op.get(op.index) == p))
  param_set = set(sp.param_ids)
  invars = set(prog.invars)
  reads = [{v for op in ops for v in op.in_ids()} for ops in ops_of]
  made = [{o for op in ops for o in op.outvars if o >= 0} for ops in ops_of]
  stage_outs = dict(zip(sp.output_ids, sp.ct_present))
  programs = []
  for p in range(n):
    ext = reads[p] - made[p]
    later = set().union(*reads[p + 1:]) if p + 1 < n else set()
    acts = sorted(v for v in ext if v not in invars)
    outputs = tuple(sorted(v for v in made[p] if v in later or v in stage_outs))
    ct_present = tuple(primitives.is_float(prog.avals[v])
                       and (stage_outs.get(v, False) or v in later) for v in outputs)
    programs.append(StageProgram(
        s, ops_of[p], sp.own_range, tuple(sorted(v for v in ext if v in param_set)),
        tuple(sorted(v for v in ext if v in invars and v not in param_set)),
        tuple(v for v in acts if primitives.is_float(prog.avals[v])),
        tuple(v for v in acts if not primitives.is_float(prog.avals[v])), outputs, ct_present))
  return programs, num_experts, weights_of


def zebra_stage(s: int, plan_stages: Sequence[StageSpec], home_program: StageProgram,
                home: StageLayout, traced: TracedStep, layers: LayerSequence,
                retrace: Retrace | None, remat: bool | str = False
                ) -> tuple[ZebraLayout, tuple[StageFunctions, ...]]:
  """The :class:`ZebraLayout` of zebra stage ``s`` and each part's functions.

  Args:
    s: the stage.
    plan_stages: the plan's stages (``plan_stages[s].zebra`` set).
    home_program, home: the stage's program and layout (on the attention group).
    traced, layers: the traced step and its layers.
    retrace: the step traced at other rows per microbatch (needed for ``R > 1``).
    remat: the stage's rematerialisation mode (each part's backward recomputes its own).

  Raises:
    PlanError: the microbatch's rows do not divide into ``R`` zebra microbatches that the
      attention group's data-parallel ways divide, a routed layer routes nothing, or the step
      traced at the zebra microbatch's rows is another program.
  """
  spec = plan_stages[s]
  z = spec.zebra
  R = int(z.num_microbatches)
  if R > 1 and traced.couplings:
    log.warning("zebra stage %d runs R=1 zebra microbatch instead of %d: examples of a "
                "microbatch meet in this step (%s), which a part of a microbatch cannot "
                "reproduce; the groups overlap across the pipeline's microbatches only", s, R,
                traced.couplings[0].describe())
    R = 1
  if R > 1 and retrace is None:
    raise PlanError(f"stage {s} is a zebra stage with R={R}: laying it out needs the step "
                    "traced at the zebra microbatch's rows (retrace=...)")
  b = int(retrace.rows) if retrace is not None else None
  if R > 1:
    dp = sharding_lib.LogicalMesh.of(spec.logical_mesh).batch_ways
    if b % R or (b // R) % dp:
      raise PlanError(f"stage {s}: a microbatch of {b} rows does not cut into R={R} zebra "
                      f"microbatches of a multiple of the attention group's {dp} "
                      "data-parallel ways; change ZebraGroup.num_microbatches or the "
                      "microbatch size")
    r = b // R
    part = part_at(s, plan_stages, home_program, traced, layers, retrace, r, spec.logical_mesh,
                   remat)
    axes, combine = rows_of(s, home, traced, layers, [part], b)
    ts_r, layers_r = retrace.at(r)
    regen, exact = regen_sites(traced.region_full, layers_r.program,
                               fractions.Fraction(traced.num_microbatches * b, r))
    ts_r = dataclasses.replace(ts_r, region=layers_r.program, region_full=traced.region_full,
                               regen_ops=regen, rng_exact=exact)
    sp = slice_stages(layers_r, [st.layers for st in plan_stages], ts_r)[s]
    rows = r
  else:
    ts_r, layers_r, sp, rows = traced, layers, home_program, None
    axes = {v: None for v in home.avals if v not in home.param_ids}
    combine = {v: FIRST for v in home.output_ids}
    b = b or 0
    r = b
  programs, num_experts, weights_of = _cut(s, sp, ts_r, layers_r, z.routed_layers)
  prog = layers_r.program
  bd = prog.dependents((prog.invars[k] for k, inp in enumerate(ts_r.inputs)
                        if inp.kind == "split"), ts_r.regen_ops)
  K = len(z.routed_layers)
  N = z.num_devices
  moved_of = []
  for k, (n, o) in enumerate(zip(num_experts, z.offload)):
    if o and (n % N or o > n // N):
      raise PlanError(f"stage {s}: routed layer {z.routed_layers[k]} has {n} experts, "
                      f"{n // N if n % N == 0 else n / N:g} per expert GPU of {N}: moving "
                      f"offload={o} of each onto the attention group needs a whole number of "
                      "experts per expert GPU and at most that many moved")
    moved_of.append(tuple(g * (n // N) + i for g in range(N) for i in range(o)) if o else ())
  emesh = expert_mesh(z, [n - len(m) for n, m in zip(num_experts, moved_of)])
  parts, functions = [], []
  held: dict = {}   # the expert weights, whole, in the experts' parts' sharding
  for p, sub in enumerate(programs):
    k = p // 2
    if not p % 2:
      lay = stage_layout(sub, ts_r, layers_r, bd, tuple(spec.logical_mesh), 0)
      parts.append(ZebraPart("A", k, lay))
      functions.append(stage_functions(sub, ts_r, layers_r, remat, lay, rows=rows))
      continue
    lay = stage_layout(sub, ts_r, layers_r, bd, tuple(emesh), 0)
    held.update((v, lay.specs[v]) for v in sub.param_ids)
    if not moved_of[k]:
      parts.append(ZebraPart("E", k, lay))
      functions.append(stage_functions(sub, ts_r, layers_r, remat, lay, rows=rows))
      continue
    n, moved = num_experts[k], moved_of[k]
    kept = tuple(e for e in range(n) if e not in set(moved))
    ex_axes = _expert_axes(s, z.routed_layers[k], sub, weights_of[k], n, len(kept), prog)
    on_attn = stage_layout(sub, ts_r, layers_r, bd, tuple(spec.logical_mesh), 0)
    for kind, experts, base, mesh in (("E", kept, lay, emesh),
                                      ("X", moved, on_attn, spec.logical_mesh)):
      sliced = _sliced_layout(base, ex_axes, len(experts), mesh)
      parts.append(ZebraPart(kind, k, sliced, experts, ex_axes))
      fn = stage_functions(sub, ts_r, layers_r, remat, sliced, rows=rows)
      functions.append(dataclasses.replace(fn, zeros=_zeros(sliced)))
  offloaded = tuple(bool(m) for m in moved_of)
  log.info("zebra stage %d: %d routed layers, R=%d zebra microbatches of %s rows, experts on "
           "%d devices (logical mesh %s), moved onto the attention group per layer: %s", s, K,
           R, r, N, emesh, [len(m) for m in moved_of])
  on_attn = {v for p in parts if p.kind == "A" for v in p.layout.param_ids}
  layout = ZebraLayout(s, b, r, R, tuple(parts), axes, combine,
                       spec.submesh[0] * spec.submesh[1], N,
                       issue_order(K, R, "F", offloaded), issue_order(K, R, "B", offloaded),
                       tuple(emesh), {v: sp for v, sp in held.items() if v not in on_attn})
  return layout, tuple(functions)


def _expert_axes(s: int, layer: int, sub: StageProgram, weights: dict, n: int, m: int,
                 prog) -> dict:
  """The experts' axis of every value an experts' part reads or writes (``None``: none),
  for running it on ``m`` of its ``n`` experts: the expert weights' from
  :func:`~harpjax.compiler.layers.sharding.ep_dims`, the tokens' from the batch dimension
  the expert matmuls pair with the weight's, the outputs' from the part evaluated on ``m``
  experts.

  Raises:
    ZebraPlanOnlyError: the part cannot run on a part of its experts (a parameter without
      an experts' axis, an output without one).
  """
  where = (f"stage {s}: the experts of routed layer {layer} cannot run on a part of them "
           "(experts moved onto the attention group)")
  axes: dict = {}
  for v in sub.param_ids:
    if v not in weights:
      raise ZebraPlanOnlyError(f"{where}: they read a parameter of shape "
                               f"{tuple(prog.avals[v].shape)} without an experts' axis; give "
                               "that layer offload 0")
    axes[v] = int(weights[v])
  views = dict(axes)
  acts = set(sub.act_ids) | set(sub.act_int_ids) | set(sub.data_ids)
  for op in sub.ops:
    ins = [r for r in op.invars if not isinstance(r, Lit)]
    outs = [o for o in op.outvars if o >= 0]
    if op.name == "convert_element_type" and ins and ins[0] in views and outs:
      views[outs[0]] = views[ins[0]]
    if op.name != "dot_general":
      continue
    (_, _), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.invars[:2]
    for w, a, wb, ab in ((rhs, lhs, rb, lb), (lhs, rhs, lb, rb)):
      if (not isinstance(w, Lit) and w in views and views[w] in tuple(wb)
          and not isinstance(a, Lit) and a in acts):
        axes.setdefault(a, int(ab[tuple(wb).index(views[w])]))
  ins = tuple(sub.param_ids) + tuple(sub.act_ids) + tuple(sub.act_int_ids) + tuple(sub.data_ids)
  for v in ins:
    axes.setdefault(v, None)
  run = ops_function(sub.ops, ins, sub.output_ids)

  def shaped(v, count):
    shape = list(prog.avals[v].shape)
    if axes[v] is not None:
      shape[axes[v]] = count
    return jax.ShapeDtypeStruct(tuple(shape), prog.avals[v].dtype)
  try:
    got = jax.eval_shape(lambda *a: run(*a), *[shaped(v, m) for v in ins])
  except Exception as e:   # noqa: BLE001 -- shapes the ops cannot take: said below
    raise ZebraPlanOnlyError(f"{where}: its ops do not evaluate on {m} experts ({e}); give "
                             "that layer offload 0") from None
  for v, out in zip(sub.output_ids, got):
    full = tuple(prog.avals[v].shape)
    diff = [i for i, (x, y) in enumerate(zip(full, out.shape)) if x != y]
    if len(out.shape) != len(full) or len(diff) != 1 or full[diff[0]] != n:
      raise ZebraPlanOnlyError(f"{where}: its output of shape {full} has no experts' axis; "
                               "give that layer offload 0")
    axes[v] = diff[0]
  return axes


def _sliced_layout(lay: StageLayout, axes: dict, count: int, mesh) -> StageLayout:
  """``lay`` at ``count`` experts (each value's experts' axis, :func:`_expert_axes`), its
  shardings kept where the sizes still divide (else that axis replicated)."""
  lm = sharding_lib.LogicalMesh.of(mesh)
  sizes = dict(zip(lm.axis_names, lm.shape))
  avals, specs = {}, {}
  for v, a in lay.avals.items():
    shape = list(a.shape)
    if axes.get(v) is not None:
      shape[axes[v]] = count
    avals[v] = jax.ShapeDtypeStruct(tuple(shape), a.dtype, weak_type=a.weak_type)
    entries = []
    for i, e in enumerate(lay.specs[v]):
      names = e if isinstance(e, tuple) else (e,) if e is not None else ()
      ways = int(np.prod([sizes[x] for x in names])) if names else 1
      entries.append(e if shape[i] % ways == 0 else None)
    specs[v] = P(*entries)
  return dataclasses.replace(lay, avals=avals, specs=specs,
                             acc_specs={v: specs[v] for v in lay.param_ids})


def _zeros(lay: StageLayout):
  """The zeros of ``lay``'s gradient accumulator (its parameters' shapes)."""
  shapes = [lay.avals[v] for v in lay.param_ids]
  return lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)


# --------------------------------------------------------------------------- the expert state


def expert_held(zebras: dict, param_vids: Sequence[int], users: Sequence[Sequence[int]]
                ) -> dict[int, int]:
  """Parameter index -> zebra stage, of the parameters held on a zebra stage's expert group:
  its expert weights (:attr:`ZebraLayout.expert_params`) that no other stage reads. Their
  gradients, their optimizer state and their update live there too.

  Args:
    zebras: stage -> ``(ZebraLayout, functions)`` (:func:`zebra_stage`).
    param_vids: per parameter index, its region value id.
    users: per parameter index, the stages reading it.
  """
  out = {}
  for j, v in enumerate(param_vids):
    for s, (zl, _) in zebras.items():
      if v in zl.expert_params and tuple(users[j]) == (s,):
        out[j] = s
  return out


def expert_side(placed: Placement, num_stages: int) -> Placement:
  """``placed`` (placed with the expert group of zebra stage ``s`` as home ``num_stages + s``,
  :func:`expert_held`'s values seeded there) with those homes as stage ``s``'s side 1: the
  placement groups that update the expert state, run on the expert group's devices."""
  S = num_stages
  home = lambda h: h - S if h >= S else h
  regroup = lambda gs: tuple(dataclasses.replace(g, home=home(g.home), side=int(g.home >= S))
                             for g in gs)
  return Placement(regroup(placed.before), regroup(placed.after),
                   {i: home(h) for i, h in placed.op_home.items()},
                   {v: home(h) for v, h in placed.var_home.items()})


def expert_preferred(traced: TracedStep, prog, zebras: dict, held: dict,
                     preferred: dict) -> None:
  """Sets the preferred sharding of each expert-held parameter (:func:`expert_held`) and of
  its gradient to its ``PartitionSpec`` on the expert group (``preferred``, keyed
  ``(stage, outer value id)``, is updated; the optimizer state follows them when the
  preferences propagate). ``prog``: the region's program."""
  region = traced.outer.ops[traced.region_op]
  n_fwd = len(prog.outvars)
  for k, inp in enumerate(traced.inputs):
    if inp.kind != "param" or inp.param_index not in held:
      continue
    s = held[inp.param_index]
    spec = zebras[s][0].expert_params[prog.invars[k]]
    if not isinstance(inp.outer_ref, Lit):
      preferred[(s, inp.outer_ref)] = spec
    g = region.outvars[n_fwd + inp.param_index]
    if g >= 0:
      preferred[(s, g)] = spec


# --------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True, eq=False)
class ZebraStageExecutables(StageExecutables):
  """A zebra stage behind the :class:`~harpjax.compiler.stages.stage.StageExecutables`
  interface, so the schedule interpreter runs it as any other stage.

  ``layout``, ``mesh`` and the shardings are the attention group's (the stage's values at
  ``b`` rows); ``fwd`` and ``bwd`` run the parts (``parts``: per part, its executables on its
  group's mesh) on every zebra microbatch in :attr:`ZebraLayout.forward` /
  :attr:`ZebraLayout.backward` order. The residuals are every part's of every zebra
  microbatch; the gradient accumulator is one per part, on its group;
  :meth:`total` sums them into the stage's gradients on the attention group, but those of
  the expert weights (:attr:`ZebraLayout.expert_params`), which live on the expert group
  (``expert_mesh``): the weights themselves (:meth:`sharding`), their gradients
  (:meth:`acc_sharding`) and the placement groups updating them (:meth:`group_mesh`).
  """
  parts: tuple = ()
  zebra: ZebraLayout | None = None
  expert_mesh: Mesh | None = None

  def __post_init__(self):
    object.__setattr__(self, "fwd", self._fwd)
    object.__setattr__(self, "bwd", self._bwd)
    object.__setattr__(self, "zeros", self._zeros)
    object.__setattr__(self, "_params", [None, None])

  @property
  def executables(self) -> tuple:
    return tuple(self.parts)

  @functools.cached_property
  def _shardings(self) -> dict:
    out = {v: NamedSharding(self.mesh, spec) for v, spec in self.layout.specs.items()}
    out.update((v, NamedSharding(self.expert_mesh, spec))
               for v, spec in self.zebra.expert_params.items())
    return out

  @functools.cached_property
  def _acc_shardings(self) -> dict:
    out = {v: NamedSharding(self.mesh, self.layout.acc_spec(v)) for v in self.layout.param_ids}
    out.update((v, NamedSharding(self.expert_mesh, spec))
               for v, spec in self.zebra.expert_params.items())
    return out

  def group_mesh(self, side: int = 0) -> Mesh:
    return self.expert_mesh if side else self.mesh

  def _part_params(self, params) -> list:
    """Per part, the parameters it reads on its devices (an experts' part: its experts' slice
    of the expert weights), put once per version of ``params`` (per step). The expert
    weights are on the expert group already: an experts' part of every expert reads them as
    they are; only the experts moved onto the attention group are copied there."""
    cached, out = self._params
    if cached is not params:
      index = {v: i for i, v in enumerate(self.layout.param_ids)}
      out = [tuple(put(_experts_of(part, v, params[index[v]]), ex.sharding(v))
                   for v in ex.layout.param_ids)
             for part, ex in zip(self.zebra.parts, self.parts)]
      self._params[:] = [params, out]
    return out

  def _rows(self, v, x, j: int):
    z = self.zebra
    axis = z.axes.get(v)
    if z.num_microbatches == 1 or axis is None:
      return x
    return row_slice(x, axis, j * z.zebra_rows, z.zebra_rows, z.rows)

  def _joined(self, p: int, v, mine, theirs, mesh: Mesh | None = None):
    """Value ``v`` of all the experts of part ``p``'s layer, from part ``p``'s experts'
    (``mine``) and its twin's (``theirs``), on ``mesh`` (default: the attention group's)."""
    z = self.zebra
    part, twin = z.parts[p], z.parts[z.twin(p)]
    axis, sh = part.axes[v], NamedSharding(self.mesh if mesh is None else mesh, P())
    if axis is None:   # read whole by both: its cotangents add up
      return put(mine, sh) + put(theirs, sh)
    both = jnp.concatenate([put(mine, sh), put(theirs, sh)], axis=axis)
    return jnp.take(both, jnp.asarray(part.inverse(twin)), axis=axis)

  def _fwd(self, params, acts, acts_int, data, mb_index):
    z, lay = self.zebra, self.layout
    R = z.num_microbatches
    params_p = self._part_params(params)
    env = [dict() for _ in range(R)]
    for j in range(R):
      for ids, values in ((lay.act_ids, acts), (lay.act_int_ids, acts_int),
                          (lay.data_ids, data)):
        env[j].update((v, self._rows(v, x, j)) for v, x in zip(ids, values))
    residuals = [()] * (len(self.parts) * R)
    halves: dict = {}   # (part, microbatch) -> outputs, of the parts with a twin
    for task in z.forward:
      p, j = z.part_of(task), task.microbatch
      ex, part = self.parts[p], z.parts[p]
      sl = ex.layout
      get = lambda ids: tuple(put(_experts_of(part, v, env[j][v]), ex.sharding(v))
                              for v in ids)
      index = (np.int32(int(mb_index) * z.rows + j * z.zebra_rows) if R > 1 else mb_index)
      outs, res = ex.fwd(params_p[p], get(sl.act_ids), get(sl.act_int_ids),
                         get(sl.data_ids), index)
      residuals[p * R + j] = res
      q = z.twin(p)
      if q is None:
        env[j].update(zip(sl.output_ids, outs))
      elif (q, j) in halves:
        env[j].update((v, self._joined(p, v, o, t))
                      for v, o, t in zip(sl.output_ids, outs, halves.pop((q, j))))
      else:
        halves[(p, j)] = outs
    outs = tuple(self._combine(v, [env[j][v] for j in range(R)]) for v in lay.output_ids)
    return outs, tuple(residuals)

  def _combine(self, v, parts):
    sh, axis = self.sharding(v), self.zebra.axes.get(v)
    if len(parts) == 1:
      return put(parts[0], sh)
    if axis is not None:
      return put(jnp.concatenate([put(x, sh) for x in parts], axis=axis), sh)
    how = self.zebra.combine.get(v, FIRST)
    if how == FIRST:
      return put(parts[0], sh)
    w = self.zebra.zebra_rows / self.zebra.rows
    total = None
    for x in parts:
      x = put(x, sh)
      if how == WEIGHTED:
        x = (x * jnp.asarray(w, x.dtype)).astype(x.dtype)
      total = x if total is None else total + x
    return total

  def _bwd(self, params, residuals, cts_present, acc):
    z, lay = self.zebra, self.layout
    R = z.num_microbatches
    params_p = self._part_params(params)
    w = z.zebra_rows / z.rows if R > 1 else 1.0
    present = [v for v, has in zip(lay.output_ids, lay.ct_present) if has]
    # per zebra microbatch, value id -> its cotangents, in the order they arrive
    cts = [defaultdict(list) for _ in range(R)]
    for v, ct in zip(present, cts_present):
      axis, how = z.axes.get(v), z.combine.get(v, FIRST)
      for j in range(R):
        if R == 1:
          c = ct
        elif axis is not None:
          c = row_slice(ct, axis, j * z.zebra_rows, z.zebra_rows, z.rows)
        elif how == WEIGHTED:
          c = (ct * jnp.asarray(w, ct.dtype)).astype(ct.dtype)
        elif how == FIRST and j > 0:
          c = jnp.zeros_like(ct)
        else:
          c = ct
        cts[j][v].append(c)
    summed: dict = {}   # (layer, microbatch, value) -> the cotangent both twins slice
    halves: dict = {}
    acc = list(acc)
    for task in z.backward:
      p, j = z.part_of(task), task.microbatch
      ex, part = self.parts[p], z.parts[p]
      sl, q = ex.layout, z.twin(p)
      mine = []
      for v, has in zip(sl.output_ids, sl.ct_present):
        if not has:
          continue
        key = (part.layer, j, v)
        total = summed.pop(key, None) if q is not None else None
        if total is None:
          for c in cts[j].pop(v, []):
            c = put(c, ex.sharding(v)) if q is None else c
            total = c if total is None else total + c
          if q is not None and total is not None:
            summed[key] = total
        if total is None:
          aval = sl.avals[v]
          total = np.zeros(aval.shape, aval.dtype)
        mine.append(put(_experts_of(part, v, total), ex.sharding(v)))
      acc[p], act_cts = ex.bwd(params_p[p], residuals[p * R + j], tuple(mine), acc[p])
      if q is None:
        for v, c in zip(sl.act_ids, act_cts):
          cts[j][v].append(c)
      elif (q, j) in halves:
        for v, c, t in zip(sl.act_ids, act_cts, halves.pop((q, j))):
          cts[j][v].append(self._joined(p, v, c, t))
      else:
        halves[(p, j)] = act_cts
    out = []
    for v in lay.act_ids:
      sh, axis = self.sharding(v), z.axes.get(v)
      per = []
      for j in range(R):
        total = None
        for c in cts[j].pop(v, []):
          c = put(c, sh)
          total = c if total is None else total + c
        if total is None:
          aval = lay.avals[v]
          total = put(np.zeros(aval.shape, aval.dtype), sh)
        per.append(total)
      if R > 1 and axis is not None:
        out.append(put(jnp.concatenate(per, axis=axis), sh))
      else:
        total = per[0]
        for x in per[1:]:
          total = total + x
        out.append(total)
    return tuple(acc), tuple(out)

  def _zeros(self):
    return tuple(ex.zeros() for ex in self.parts)

  def total(self, acc) -> tuple:
    """The stage's gradients: every part's accumulator summed on the attention group (an
    expert weight's: on the expert group), in part order (an experts' part with its twin:
    their experts' gradients joined first), once per step. Drops the step's copies of the
    parameters the parts read."""
    z = self.zebra
    self._params[:] = [None, None]
    out = []
    for v in self.layout.param_ids:
      sh, x = self.acc_sharding(v), None
      for p, (ex, a) in enumerate(zip(self.parts, acc)):
        if v not in ex.layout.param_ids:
          continue
        g = a[ex.layout.param_ids.index(v)]
        q = z.twin(p)
        if q is not None:
          if q < p:   # joined at the first of the two
            continue
          other = self.parts[q]
          g = self._joined(p, v, g, acc[q][other.layout.param_ids.index(v)], sh.mesh)
        g = put(g, sh)
        x = g if x is None else x + g
      if x is None:
        aval = self.layout.avals[v]
        x = put(np.zeros(aval.shape, aval.dtype), sh)
      out.append(x)
    return tuple(out)


def _experts_of(part: ZebraPart, v, x):
  """``x`` (value ``v`` of every expert of ``part``'s layer) at ``part``'s experts."""
  if part.experts is None or part.axes.get(v) is None:
    return x
  return jnp.take(x, jnp.asarray(part.experts), axis=part.axes[v])


def zebra_executables(home: StageLayout, zebra: ZebraLayout, functions: Sequence,
                      devices: Sequence) -> ZebraStageExecutables:
  """A zebra stage on ``devices`` (the attention group's, then the expert group's), its parts
  jitted on their group's mesh.

  Raises:
    PlanError: ``devices`` are not the two groups' together.
  """
  na, ne = zebra.attn_devices, zebra.expert_devices
  if len(devices) != na + ne:
    raise PlanError(f"stage {zebra.stage} is a zebra stage on {na} + {ne} devices but got "
                    f"{len(devices)}")
  devs = list(devices)
  emesh = sharding_lib.make_mesh(devs[na:], zebra.expert_mesh)
  meshes = {("E", tuple(zebra.expert_mesh)): emesh}
  parts = []
  for part, fn in zip(zebra.parts, functions):
    group = devs[na:] if part.kind == "E" else devs[:na]   # A and X on the attention group
    key = (part.kind, tuple(part.layout.logical_mesh))
    if key not in meshes:
      meshes[key] = sharding_lib.make_mesh(group, part.layout.logical_mesh)
    parts.append(jit_stage(part.layout, fn, meshes[key]))
  mesh = sharding_lib.make_mesh(devs[:na], home.logical_mesh)
  return ZebraStageExecutables(home, mesh, None, None, None, parts=tuple(parts), zebra=zebra,
                               expert_mesh=emesh)
