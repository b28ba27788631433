"""Stages whose microbatches' rows are split among groups of devices (mixed-type stages).

A stage with :attr:`~harpjax.compiler.plan.StageSpec.groups` runs on several groups of devices,
of one GPU type each, data-parallel: every microbatch's ``b`` rows are split among the groups
in proportion to their shares (:meth:`~harpjax.compiler.plan.StageSpec.group_rows`: an A100
group takes 5 rows for every 2 of a V100 group), and each group runs its own executables,
traced at its own rows. The stage's first group is its *home*: the stage's values arrive and
leave there (in the stage's :class:`~harpjax.compiler.stages.layout.StageLayout`, at ``b``
rows, on the first group's mesh), its parameters and optimizer state live there, and the
gradients of the other groups are summed into its own, in group order, once per step.

With a ZeRO level (:attr:`~harpjax.compiler.plan.StageSpec.zero`) every group lays itself out
at that level over its own ``dp`` axis: from level 2 each group's gradient accumulator is
split over its ``dp``, at level 3 the parameters its executables take too (gathered where
used). The step's state stays on the home: the parameters in the home's layout (split over
the home's ``dp`` at level 3), put once per step into each other group's sharding; the
optimizer state split over the home's ``dp`` from level 1, or in host memory with
:attr:`~harpjax.compiler.plan.StageSpec.offload`, and updated there only. The other groups
hold no optimizer state; their accumulators are summed into the home's sharding once per step
(:meth:`SplitStageExecutables.total`).

The arithmetic is ``jax.jit``'s: a group's program is the step traced again with ``r`` rows
per microbatch (op for op the same program, or a :class:`~harpjax.errors.PlanError` says the
step's structure depends on the batch size), rewritten as the microbatch's is
(:func:`~harpjax.compiler.trace.trace_step` with ``like``: the whole batch's hoisted values,
sums over the examples in mean-exact form for ``r`` rows); values with a row axis are sliced
and concatenated along it; the random numbers a group draws are its rows' slice of the full
batch's (:func:`~harpjax.compiler.trace.apply_site` with ``rows``); the values without a row
axis that depend on the rows (the loss, averaged auxiliary outputs) are the groups' weighted
sum, with weights ``r / b``, and their cotangents weighted alike; a value that does not
depend on the rows is the first group's (each computes the same), and only the first group
receives its cotangent. This is exact for the steps microbatching is exact for; a step whose
examples meet (``TracedStep.couplings``) does not split rows.

:class:`SplitLayout` is the plain data (it pickles to a Ray worker); :func:`split_stage` builds
it with each group's functions; :class:`SplitStageExecutables` runs them behind the
:class:`~harpjax.compiler.stages.stage.StageExecutables` interface, so the schedule
interpreter runs a split stage as any other.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.compiler.layers import LayerSequence, layers_like
from harpjax.compiler.plan import StageSpec
from harpjax.compiler.stages.layout import StageLayout, stage_layout
from harpjax.compiler.stages.stage import (StageExecutables, StageFunctions, StageProgram,
                                           put, row_slice, slice_stages, stage_functions)
from harpjax.compiler.trace import (Lit, TracedStep, abstractify, primitives, regen_sites,
                                    trace_step)
from harpjax.errors import MicrobatchError, PlanError

__all__ = ["batch_rows", "retrace", "Retrace", "SplitGroup", "SplitLayout", "split_stage", "SplitStageExecutables",
           "RemoteGroup", "RemoteResidual", "FIRST", "WEIGHTED", "SUMMED", "Part", "part_at",
           "rows_of"]

WEIGHTED, SUMMED, FIRST = "weighted", "summed", "first"
"""How an output without a row axis combines over the groups: their weighted sum (floating
values that depend on the rows), their sum (integer ones: counts), or the first group's (values
that do not depend on the rows)."""


@dataclasses.dataclass(frozen=True)
class Retrace:
  """The step traced again at other microbatch sizes, for stages that split rows.

  Attributes:
    rows: rows per microbatch of the step as traced (``b``).
    at: ``at(r) -> (TracedStep, LayerSequence)``: the step traced with ``r`` rows per
      microbatch, cut into the same layers (:func:`~harpjax.compiler.layers.layers_like`).
  """
  rows: int
  at: Callable[[int], tuple[TracedStep, LayerSequence]]


def batch_rows(args: tuple, batch_argnums: Sequence[int]) -> int:
  """Rows of the batch: the leading size of the batch arguments' array leaves.

  Raises:
    MicrobatchError: the batch arguments hold no arrays.
  """
  leaves = [x for a in batch_argnums for x in jax.tree_util.tree_leaves(args[a])
            if np.ndim(x) >= 1]
  if not leaves:
    raise MicrobatchError(f"the batch arguments {tuple(batch_argnums)} hold no arrays")
  return int(np.shape(leaves[0])[0])


def retrace(step_fn: Callable, args: tuple, traced: TracedStep, layers: LayerSequence,
            batch_argnums: Sequence[int]) -> Retrace:
  """The step ``step_fn`` (traced as ``traced`` from ``args``, cut into ``layers``) traced again
  on demand with other rows per microbatch, cut into the same layers: the :class:`Retrace`
  that :func:`~harpjax.compiler.stages.layout_step` asks only where a stage splits its rows.
  Each row count is traced once."""
  B = traced.num_microbatches
  argnums = tuple(batch_argnums)
  rows = batch_rows(args, argnums)

  @functools.lru_cache(maxsize=None)
  def at(r: int):
    scaled = list(jax.tree_util.tree_map(abstractify, args))
    for a in argnums:
      scaled[a] = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct((B * r,) + tuple(x.shape[1:]), x.dtype)
          if len(x.shape) >= 1 and x.shape[0] == rows else x, scaled[a])
    ts = trace_step(step_fn, tuple(scaled), num_microbatches=B, batch_argnums=argnums,
                    like=traced, factor=fractions.Fraction(rows, r))
    return ts, layers_like(ts, layers)
  return Retrace(rows // B, at)


@dataclasses.dataclass(frozen=True)
class SplitGroup:
  """One group of a split stage.

  Attributes:
    layout: the group's stage layout: its values at its rows, on its ``(dp, tp)`` mesh.
    rows: rows of each microbatch it computes.
    offset: the first of them, within the microbatch.
    num_devices: its devices (the stage's devices list the groups' in order).
    weight: the weight of its outputs of kind :data:`WEIGHTED`.
  """
  layout: StageLayout
  rows: int
  offset: int
  num_devices: int
  weight: float


@dataclasses.dataclass(frozen=True)
class SplitLayout:
  """How a stage splits its microbatches' rows among its groups: plain, picklable data.

  Attributes:
    stage: the stage.
    rows: rows per microbatch (``b``).
    groups: its :class:`SplitGroup` s, the first (home) group first.
    axes: value id -> row axis of every value the stage reads or writes (``None``: no rows).
    combine: output value id -> :data:`WEIGHTED`, :data:`SUMMED` or :data:`FIRST`, for the
      outputs without a row axis.
  """
  stage: int
  rows: int
  groups: tuple
  axes: dict
  combine: dict

  @property
  def num_devices(self) -> int:
    return sum(g.num_devices for g in self.groups)

  def device_slices(self) -> list[slice]:
    """Per group, its slice of the stage's devices."""
    out, start = [], 0
    for g in self.groups:
      out.append(slice(start, start + g.num_devices))
      start += g.num_devices
    return out


def split_stage(s: int, plan_stages: Sequence[StageSpec], home_program: StageProgram,
                home: StageLayout, traced: TracedStep, layers: LayerSequence,
                retrace: Retrace,
                remat: bool | str = False) -> tuple[SplitLayout, tuple[StageFunctions, ...]]:
  """The split layout of stage ``s`` and each group's functions.

  Raises:
    PlanError: the microbatch's rows do not split among the groups, the step traced at a
      group's rows is not the same program, an output mixes the rows of a microbatch
      without being a region output (a batch statistic), or examples of different
      microbatches meet in the step (``traced.couplings``: a part of a microbatch would
      compute them over its own rows only).
  """
  if traced.couplings:
    raise PlanError(f"stage {s} cannot split its rows among groups of devices: examples of "
                    "the batch meet in this step (" + traced.couplings[0].describe() + "), "
                    "which a group computing part of each microbatch cannot reproduce")
  spec = plan_stages[s]
  b = int(retrace.rows)
  rows = spec.group_rows(b)
  parts = {}
  for grp, r in zip(spec.all_groups, rows):
    if (r, grp.logical_mesh) not in parts:
      parts[(r, grp.logical_mesh)] = part_at(s, plan_stages, home_program, traced, layers,
                                             retrace, r, grp.logical_mesh, remat)
  groups, functions, offset = [], [], 0
  for grp, r in zip(spec.all_groups, rows):
    part = parts[(r, grp.logical_mesh)]
    functions.append(part.functions)
    groups.append(SplitGroup(part.layout, r, offset, grp.num_devices, r / b))
    offset += r
  axes, combine = rows_of(s, home, traced, layers, list(parts.values()), b)
  return SplitLayout(s, b, tuple(groups), axes, combine), tuple(functions)


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
  """A stage traced at ``rows`` of each microbatch's rows (a group's, or a replica's).

  Attributes:
    rows: its rows per microbatch.
    layout: its :class:`~harpjax.compiler.stages.layout.StageLayout` (values at its rows).
    functions: its :class:`~harpjax.compiler.stages.stage.StageFunctions`; their forward's
      last argument is the index in the full batch of the first row it computes.
    row_inputs: region inputs whose shape follows the rows.
    draws: op indices of the draws of batch-sized random numbers.
  """
  rows: int
  layout: StageLayout
  functions: StageFunctions
  row_inputs: frozenset
  draws: frozenset


def part_at(s: int, plan_stages: Sequence[StageSpec], home_program: StageProgram,
            traced: TracedStep, layers: LayerSequence, retrace: Retrace, r: int,
            logical_mesh, remat: bool | str = False) -> Part:
  """Stage ``s`` traced at ``r`` rows per microbatch, on a ``logical_mesh`` of its own.

  Raises:
    PlanError: the step traced at ``r`` rows is not the same program (its structure depends
      on the batch size).
  """
  b = int(retrace.rows)
  spec = plan_stages[s]
  ts_r, layers_r = retrace.at(r)
  _check_same_program(s, layers.program, layers_r.program, b, r)
  # The draws to redraw: the full batch's (B b rows) against these r rows.
  regen, exact = regen_sites(traced.region_full, layers_r.program,
                             fractions.Fraction(traced.num_microbatches * b, r))
  ts_r = dataclasses.replace(ts_r, region=layers_r.program, region_full=traced.region_full,
                             regen_ops=regen, rng_exact=exact)
  sp = slice_stages(layers_r, [st.layers for st in plan_stages], ts_r)[s]
  for name in ("param_ids", "data_ids", "act_ids", "act_int_ids", "output_ids", "ct_present"):
    if getattr(sp, name) != getattr(home_program, name):
      raise PlanError(f"stage {s}: traced with {r} rows per microbatch, its {name} differ "
                      f"from those at {b} rows; the step's structure depends on the batch "
                      "size, so the stage cannot split its rows")
  prog, prog_r = layers.program, layers_r.program
  row_inputs = frozenset(v for v in prog.invars if prog.avals[v].shape != prog_r.avals[v].shape)
  bd = prog_r.dependents((prog_r.invars[k] for k, inp in enumerate(ts_r.inputs)
                          if inp.kind == "split"), ts_r.regen_ops)
  lay = stage_layout(sp, ts_r, layers_r, bd, tuple(logical_mesh), spec.zero)
  return Part(r, lay, stage_functions(sp, ts_r, layers_r, remat, lay, rows=r), row_inputs,
              frozenset(regen))


def rows_of(s: int, home: StageLayout, traced: TracedStep, layers: LayerSequence, parts,
            b: int) -> tuple[dict, dict]:
  """Where a stage's values hold the microbatch's rows, and how its outputs without them
  combine over parts that compute some of the rows each.

  Returns:
    ``(axes, combine)``: value id -> row axis (``None``: none) of every value the stage reads
    or writes but its parameters; output id -> :data:`WEIGHTED`, :data:`SUMMED` or
    :data:`FIRST` of the outputs without a row axis.

  Raises:
    PlanError: a value does not split along one axis in proportion to the rows, or an output
      mixes the rows without being a region output (a statistic over the batch).
  """
  prog = layers.program
  axes = {}
  for v, aval in home.avals.items():
    if v in home.param_ids:
      continue
    axes[v] = _row_axis(s, v, aval.shape, [(p.layout.avals[v].shape, p.rows) for p in parts],
                        b)
  outvars = traced.region.outvars
  region_outs = {v for k, v in enumerate(outvars) if not isinstance(v, Lit)
                 and not (k < len(traced.output_flows) and traced.output_flows[k].kind == "rows")}
  row_dependent = prog.dependents(set().union(*(p.row_inputs for p in parts)),
                                  set().union(*(p.draws for p in parts)))
  combine = {}
  for v in home.output_ids:
    if axes[v] is not None:
      continue
    if v not in row_dependent:
      combine[v] = FIRST
    elif v in region_outs:
      combine[v] = WEIGHTED if primitives.is_float(home.avals[v]) else SUMMED
    else:
      raise PlanError(
          f"stage {s} computes a value of shape {home.avals[v].shape} from the rows of a "
          "microbatch that has no row axis and is not the loss or an auxiliary output (a "
          "statistic over the batch); it cannot split its rows among parts of its devices")
  return axes, combine


def _check_same_program(s: int, home, other, b: int, r: int) -> None:
  if len(home.ops) != len(other.ops) or any(
      a.name != o.name or tuple(a.outvars) != tuple(o.outvars)
      for a, o in zip(home.ops, other.ops)):
    raise PlanError(f"stage {s}: the step traced with {r} rows per microbatch is not the same "
                    f"program as with {b} rows (its structure depends on the batch size), so "
                    "the stage cannot split its rows among groups")


def _row_axis(s: int, v: int, shape, group_shapes, b: int) -> int | None:
  """The axis of ``v`` that holds the microbatch's rows, or ``None``."""
  if all(tuple(gs) == tuple(shape) for gs, _ in group_shapes):
    return None
  axis = None
  for gs, r in group_shapes:
    diff = [i for i, (x, y) in enumerate(zip(shape, gs)) if x != y]
    ok = len(gs) == len(shape) and len(diff) == 1 and gs[diff[0]] * b == shape[diff[0]] * r
    if not ok or (axis is not None and diff[0] != axis):
      raise PlanError(f"stage {s}: a value of shape {tuple(shape)} at {b} rows per microbatch "
                      f"has shape {tuple(gs)} at {r} rows: it does not split along one axis "
                      "in proportion to the rows, so the stage cannot split its rows")
    axis = diff[0]
  return axis


# --------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True)
class RemoteGroup:
  """A group of a split stage that runs in a process of its own (on another host): its
  executables live there, in a :class:`~harpjax.runtime.group_worker.GroupWorker`, which keeps
  the group's parameters, residuals and gradient accumulator; the home process sends it each
  microbatch's rows and receives its outputs.

  Attributes:
    layout: the group's stage layout (its values at its rows).
    client: reaches the group's process: ``client.submit(method, *args)`` starts a call of
      the worker's method (arrays in tuples of ``args`` cross as host copies) and returns a
      handle, ``client.wait(handle)`` its value (raising
      :class:`~harpjax.errors.RuntimeFailure` when the process failed or died). Calls run in
      the order they were submitted.
  """
  layout: StageLayout
  client: object


@dataclasses.dataclass(frozen=True)
class RemoteResidual:
  """Stands for a remote group's residuals of one microbatch (kept in its process); a pytree
  without leaves, so the schedule interpreter passes it through untouched."""
  key: int


jax.tree_util.register_pytree_node(RemoteResidual, lambda r: ((), r.key),
                                   lambda key, _: RemoteResidual(key))


@dataclasses.dataclass(frozen=True, eq=False)
class SplitStageExecutables(StageExecutables):
  """A split stage behind the :class:`StageExecutables` interface.

  ``layout``, ``mesh`` and the shardings are the home's (the first group's devices, the
  stage's values at ``b`` rows); ``fwd``, ``bwd`` and ``zeros`` run every group's executables
  (``parts``) on its rows and combine their results there. The gradient accumulator is one
  per group, on its devices in its own layout (split over its ``dp`` from ZeRO-2 on);
  :meth:`total` sums them on the home, in group order, in the home's accumulator sharding.
  The parameters arrive in the home's layout and are put into each group's once per step.
  """
  parts: tuple = ()
  split: SplitLayout | None = None

  def __post_init__(self):
    object.__setattr__(self, "fwd", self._fwd)
    object.__setattr__(self, "bwd", self._bwd)
    object.__setattr__(self, "zeros", self._zeros)
    object.__setattr__(self, "_params", [None, None])

  @property
  def executables(self) -> tuple:
    """The groups' executables in this process (a remote group's are in its own)."""
    return tuple(ex for ex in self.parts if not isinstance(ex, RemoteGroup))

  def _group_params(self, params) -> list:
    """Per group, the parameters on its devices; a remote group receives them (once per
    version of ``params``: per step) and gets ``None`` here."""
    cached, out = self._params
    if cached is not params:
      out, sent = [], []
      for ex in self.parts:
        if isinstance(ex, RemoteGroup):
          sent.append(ex.client.submit("set_params", tuple(params)))
          out.append(None)
        else:
          out.append(tuple(put(p, ex.sharding(v)) for p, v in zip(params, ex.layout.param_ids)))
      for ex, call in zip((x for x in self.parts if isinstance(x, RemoteGroup)), sent):
        ex.client.wait(call)
      self._params[:] = [params, out]
    return out

  def _inputs(self, ids, values, g: int) -> tuple:
    sp, grp, ex = self.split, self.split.groups[g], self.parts[g]
    remote = isinstance(ex, RemoteGroup)
    out = []
    for v, x in zip(ids, values):
      axis = sp.axes[v]
      if axis is not None:
        x = row_slice(x, axis, grp.offset, grp.rows, sp.rows)
      out.append(x if remote else put(x, ex.sharding(v)))
    return tuple(out)

  def _fwd(self, params, acts, acts_int, data, mb_index):
    sp, lay = self.split, self.layout
    first_row = int(mb_index) * sp.rows
    params_g = self._group_params(params)
    calls = {}   # the remote groups start first and run while the local ones do
    for g, (grp, ex) in enumerate(zip(sp.groups, self.parts)):
      if isinstance(ex, RemoteGroup):
        calls[g] = ex.client.submit(
            "fwd", first_row + grp.offset, self._inputs(lay.act_ids, acts, g),
            self._inputs(lay.act_int_ids, acts_int, g), self._inputs(lay.data_ids, data, g))
    per_group, residuals = [None] * len(self.parts), [None] * len(self.parts)
    for g, (grp, ex, p) in enumerate(zip(sp.groups, self.parts, params_g)):
      if g not in calls:
        per_group[g], residuals[g] = ex.fwd(
            p, self._inputs(lay.act_ids, acts, g), self._inputs(lay.act_int_ids, acts_int, g),
            self._inputs(lay.data_ids, data, g), np.int32(first_row + grp.offset))
    for g, call in calls.items():
      per_group[g] = self.parts[g].client.wait(call)
      residuals[g] = RemoteResidual(first_row + sp.groups[g].offset)
    outs = []
    for i, v in enumerate(lay.output_ids):
      parts = [o[i] for o in per_group]
      outs.append(self._combine(v, parts, [grp.weight for grp in sp.groups]))
    return tuple(outs), tuple(residuals)

  def _combine(self, v, parts, weights):
    sh, axis = self.sharding(v), self.split.axes[v]
    if axis is not None:
      return put(jnp.concatenate([put(x, sh) for x in parts], axis=axis), sh)
    how = self.split.combine.get(v, FIRST)
    if how == FIRST:
      return put(parts[0], sh)
    total = None
    for x, w in zip(parts, weights):
      x = put(x, sh)
      if how == WEIGHTED:
        x = (x * jnp.asarray(w, x.dtype)).astype(x.dtype)
      total = x if total is None else total + x
    return total

  def _bwd(self, params, residuals, cts_present, acc):
    sp, lay = self.split, self.layout
    present = [v for v, has in zip(lay.output_ids, lay.ct_present) if has]
    params_g = self._group_params(params)
    n = len(self.parts)
    accs, act_cts, calls = [None] * n, [None] * n, {}
    for g in sorted(range(n), key=lambda g: not isinstance(self.parts[g], RemoteGroup)):
      grp, ex = sp.groups[g], self.parts[g]
      remote = isinstance(ex, RemoteGroup)
      cts = []
      for v, ct in zip(present, cts_present):
        axis = sp.axes[v]
        if axis is not None:
          ct = row_slice(ct, axis, grp.offset, grp.rows, sp.rows)
        elif sp.combine.get(v, FIRST) == WEIGHTED:
          ct = (ct * jnp.asarray(grp.weight, ct.dtype)).astype(ct.dtype)
        elif g > 0:
          ct = jnp.zeros_like(ct)
        cts.append(ct if remote else put(ct, ex.sharding(v)))
      if remote:   # its accumulator stays in its process
        calls[g] = ex.client.submit("bwd", residuals[g].key, tuple(cts))
      else:
        accs[g], act_cts[g] = ex.bwd(params_g[g], residuals[g], tuple(cts), acc[g])
    for g, call in calls.items():
      act_cts[g] = self.parts[g].client.wait(call)
    out = []
    for i, v in enumerate(lay.act_ids):
      sh, axis = self.sharding(v), sp.axes[v]
      parts = [put(c[i], sh) for c in act_cts]
      if axis is not None:
        out.append(put(jnp.concatenate(parts, axis=axis), sh))
      else:
        total = parts[0]
        for x in parts[1:]:
          total = total + x
        out.append(total)
    return tuple(accs), tuple(out)

  def _zeros(self):
    calls = {g: ex.client.submit("zeros") for g, ex in enumerate(self.parts)
             if isinstance(ex, RemoteGroup)}
    out = tuple(None if g in calls else ex.zeros() for g, ex in enumerate(self.parts))
    for g, call in calls.items():
      self.parts[g].client.wait(call)
    return out

  def total(self, acc) -> tuple:
    """The stage's gradient accumulator: every group's summed on the home, in group order
    (the reduction across the groups; a remote group sends its accumulator here)."""
    calls = {g: ex.client.submit("accumulator") for g, ex in enumerate(self.parts)
             if isinstance(ex, RemoteGroup)}
    acc = [self.parts[g].client.wait(calls[g]) if g in calls else a for g, a in enumerate(acc)]
    out = []
    for i, v in enumerate(self.layout.param_ids):
      sh = self.acc_sharding(v)
      x = put(acc[0][i], sh)
      for a in acc[1:]:
        x = x + put(a[i], sh)
      out.append(x)
    return tuple(out)
