"""Per-stage executables: forward (returning what its backward needs), backward, accumulators.

A stage owns a contiguous op range of the forward program. Its inputs are parameters, region
data (split per microbatch, or whole), and activations produced by earlier stages (possibly
several stages back: skip connections are forwarded directly). Its outputs are the values later
stages read, plus any loss/auxiliary output it computes.

* ``fwd(params, acts, acts_int, data, mb_index) -> (outputs, residuals)``: the outputs and the
  leaves of the ``jax.vjp`` closure, kept on the stage's devices;
* ``bwd(params, residuals, cotangents, grad_acc) -> (grad_acc + grads,
  activation_cotangents)``: the parameters are passed again rather than kept as residuals,
  and views of them alone (a slice of an ``nn.scan`` stack) are taken from them again.

Sections, in order: the slice of the program a stage runs (:class:`StageProgram`), its
:class:`StageFunctions` and, jitted on a submesh, its :class:`StageExecutables`. What the stage
reads and writes and how it is sharded is its
:class:`~harpjax.compiler.stages.layout.StageLayout`.

Cheap constant ops (iota, broadcasts of literals) read by several stages are recomputed in each
instead of being sent. Ops that create a batch dimension from batch-independent inputs (random
bits, iota over the batch) compute the full batch's value and take the microbatch's slice, so
that random numbers match ``jax.jit`` of the whole step exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from harpjax import _compat
from harpjax.compiler.layers import LayerSequence
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.stages.layout import StageLayout
from harpjax.compiler.trace import remat as remat_lib
from harpjax.compiler.trace import (Lit, Op, Program, TracedStep, apply_site, ops_function,
                                   primitives)

log = logging.getLogger(__name__)

__all__ = ["StageProgram", "StageFunctions", "StageExecutables", "slice_stages",
           "stage_functions", "fwd_in_specs", "acc_shardings", "gradient_shardings", "jit_stage",
           "put", "row_slice"]

_NEVER_CLONE = frozenset({"random_bits", "random_split", "random_fold_in", "random_seed",
                          "random_wrap", "rng_bit_generator", "rng_uniform"})


@dataclasses.dataclass(frozen=True, eq=False)
class StageProgram:
  """The slice of the forward program one stage runs.

  Attributes:
    index: stage number.
    ops: cloned constant ops, then the stage's own ops, in execution order.
    own_range: ``[start, end)`` of the stage's own ops in the program.
    param_ids: region value ids of the parameters read (order of the executables' ``params``).
    data_ids: region value ids of the non-parameter region inputs read.
    act_ids: floating activations from earlier stages (differentiated).
    act_int_ids: non-floating activations from earlier stages (not differentiated).
    output_ids: values produced here and read later or returned by the region.
    ct_present: per output, whether a cotangent flows back into it.
  """
  index: int
  ops: tuple
  own_range: tuple[int, int]
  param_ids: tuple
  data_ids: tuple
  act_ids: tuple
  act_int_ids: tuple
  output_ids: tuple
  ct_present: tuple


def slice_stages(layers: LayerSequence, ranges: Sequence[tuple[int, int]],
                 ts: TracedStep) -> list[StageProgram]:
  """Cuts the forward program into stages covering layer ranges (inclusive)."""
  prog = layers.program
  producer = prog.producers()
  invar_pos = {v: k for k, v in enumerate(prog.invars)}
  param_set = {prog.invars[k] for k, inp in enumerate(ts.inputs) if inp.kind == "param"}
  static_ops = _static_ops(prog, ts)
  op_ranges = [layers.op_range(a, b) for a, b in ranges]
  stage_of_op = np.empty(len(prog.ops), dtype=np.int64)
  for s, (a, b) in enumerate(op_ranges):
    stage_of_op[a:b] = s

  reads_per_stage = []
  clones_per_stage = []
  for s, (a, b) in enumerate(op_ranges):
    own = prog.ops[a:b]
    reads = set()
    for op in own:
      reads.update(op.in_ids())
    if s == len(op_ranges) - 1:
      reads.update(v for v in prog.outvars if not isinstance(v, Lit))
    clones: dict[int, Op] = {}
    stack = [v for v in reads if v in producer and not a <= producer[v] < b]
    while stack:
      v = stack.pop()
      p = producer[v]
      if p in static_ops and p not in clones and not a <= p < b:
        clones[p] = prog.ops[p]
        stack.extend(u for u in prog.ops[p].in_ids() if u in producer)
    clone_reads = set()
    for op in clones.values():
      clone_reads.update(op.in_ids())
    reads |= clone_reads
    reads_per_stage.append(reads)
    clones_per_stage.append(clones)

  own_outs, ext_acts = [], []
  for s, (a, b) in enumerate(op_ranges):
    cloned_out = {v for op in clones_per_stage[s].values() for v in op.outvars}
    own_out = {v for op in prog.ops[a:b] for v in op.outvars if v >= 0}
    ext = [v for v in reads_per_stage[s] if v not in own_out and v not in cloned_out]
    own_outs.append(own_out)
    ext_acts.append(ext)
  region_outs = {v for v in prog.outvars if not isinstance(v, Lit)}
  loss = prog.outvars[0]
  stages = []
  for s, (a, b) in enumerate(op_ranges):
    ext = ext_acts[s]
    params = sorted(v for v in ext if v in param_set)
    data = sorted(v for v in ext if v in invar_pos and v not in param_set)
    acts = sorted(v for v in ext if v in producer)
    assert all(stage_of_op[producer[v]] < s for v in acts), "activation from a later stage"
    act_f = tuple(v for v in acts if primitives.is_float(prog.avals[v]))
    act_i = tuple(v for v in acts if not primitives.is_float(prog.avals[v]))
    later = set()
    for t in range(s + 1, len(op_ranges)):
      later.update(ext_acts[t])
    outputs = tuple(sorted(v for v in own_outs[s] if v in later or v in region_outs))
    ct_present = tuple(
        primitives.is_float(prog.avals[v]) and (v == loss or v in later) for v in outputs)
    ops = tuple(sorted(clones_per_stage[s].values(), key=lambda o: o.index)) + \
        tuple(prog.ops[a:b])
    stages.append(StageProgram(s, ops, (a, b), tuple(params), tuple(data), act_f, act_i,
                               outputs, ct_present))
  return stages


def _static_ops(prog: Program, ts: TracedStep) -> set[int]:
  """Ops computing a constant from literals only: cheap to recompute in any stage."""
  static_vals: set[int] = set()
  out = set()
  for op in prog.ops:
    if op.name in _NEVER_CLONE or op.index in ts.regen_ops or op.params.get("jaxpr") is not None:
      continue
    if all(isinstance(v, Lit) or v in static_vals for v in op.invars):
      out.add(op.index)
      static_vals.update(v for v in op.outvars if v >= 0)
  return out


# --------------------------------------------------------------------------- functions


@dataclasses.dataclass(frozen=True, eq=False)
class StageFunctions:
  """The stage's work as pure functions (jitted in process, or exported for another).

  * ``fwd(params, acts, acts_int, data, mb_index) -> (outputs, residuals)``: the outputs and
    the leaves of the ``jax.vjp`` closure (what the backward needs, kept on the stage's
    devices);
  * ``bwd(params, residuals, cotangents, grad_acc) -> (grad_acc + grads,
    activation_cotangents)``, ``cotangents`` for the outputs whose ``ct_present`` is true
    (the parameters again: they are not among the residuals);
  * ``zeros() -> grad_acc`` of zeros;
  * ``reduce(grad_acc) -> gradients`` (``None``: the accumulator is the gradients), once per
    step, where replicas accumulate their own
    (:func:`~harpjax.compiler.stages.replicas.replica_functions`).

  ``bwd`` rebuilds the closure from the residuals with the tree structure ``fwd`` recorded
  when it was traced: trace ``fwd`` first (every runtime runs a forward before its backward).
  """
  fwd: Callable
  bwd: Callable
  zeros: Callable
  reduce: Callable | None = None


def stage_functions(sp: StageProgram, ts: TracedStep, layers: LayerSequence,
                    remat: bool | str = False, layout: StageLayout | None = None,
                    rows: int | None = None) -> StageFunctions:
  """The forward, backward and zeros functions of one stage.

  ``remat`` (:data:`~harpjax.compiler.plan.REMAT_MODES`; ``True`` is ``"full"``): with
  ``"full"`` the forward keeps only the stage's inputs per in-flight microbatch and the
  backward recomputes the rest (activation recomputation, ``jax.checkpoint``), the memory model
  of a profile made with ``ProfileOptions(remat=True)``; with ``"dots"`` it keeps the matmuls'
  outputs too (``jax.checkpoint_policies.dots_saveable``) and recomputes the rest.

  The parameters are not among the residuals the forward returns: the backward takes them
  again (a residual that is a parameter would be a copy of it per in-flight microbatch).

  With a ``layout`` of ZeRO-2 or more, the backward returns the gradient accumulator in its
  ``dp``-split sharding (``StageLayout.acc_specs``: XLA reduces the gradient and each device
  keeps its part); with ZeRO-3 the parameters arrive split and the forward and the backward
  each gather them to their ``StageLayout.gather_specs`` sharding before use (nothing
  gathered is kept between the two). Shardings are given on the abstract ``(dp, tp)`` mesh, so
  the same functions jit on any submesh and export for another process.

  With ``rows`` (a group of a stage that splits its microbatches' rows, traced at ``rows``
  rows), the forward's last argument is the index in the full batch of the first row it
  computes instead of the microbatch's index, so that its random draws are those rows' of
  ``jax.jit``'s.
  """
  prog = layers.program
  inputs_by_id = {prog.invars[k]: inp for k, inp in enumerate(ts.inputs)}
  static_env = {v: inputs_by_id[v].static_value for v in sp.data_ids
                if inputs_by_id[v].kind == "static"}
  dyn_data = tuple(v for v in sp.data_ids if v not in static_env)
  hook = _make_hook(ts, rows)
  residual_tree = []   # (the vjp closure's tree structure, which leaves are parameters)

  # Views of the parameters alone (a layer's slice of an ``nn.scan`` stack): the forward
  # computes them outside the differentiated function and the backward again from the
  # parameters it takes, so that no microbatch keeps a copy of them among its residuals.
  view_ops, ops = _parameter_views(sp.ops, sp.param_ids)
  view_ids = tuple(o for op in view_ops for o in op.outvars if o >= 0)
  views_of = ops_function(view_ops, sp.param_ids, view_ids, static_env)
  run = ops_function(ops, sp.param_ids + view_ids + sp.act_ids + sp.act_int_ids + dyn_data,
                     sp.output_ids, static_env)
  n_p = len(sp.param_ids)

  gather, acc_sh = {}, None
  if layout is not None and (layout.gather_specs or layout.zero >= 2):
    mesh = sharding_lib.abstract_mesh(layout.logical_mesh)
    gather = {i: NamedSharding(mesh, layout.gather_specs[v])
              for i, v in enumerate(sp.param_ids) if v in layout.gather_specs}
    if layout.zero >= 2:
      acc_sh = tuple(NamedSharding(mesh, layout.acc_spec(v)) for v in sp.param_ids)

  def used(params):
    """The parameters as the stage's ops read them (ZeRO-3: gathered)."""
    return tuple(jax.lax.with_sharding_constraint(p, gather[i]) if i in gather else p
                 for i, p in enumerate(params))

  def primal(params, acts, acts_int, data, mb_index):
    return run(*params, *acts, *acts_int, *data,
               hook=(lambda op, xs: hook(op, xs, mb_index)) if hook else None)

  checkpointed = remat_lib.checkpointed(remat)

  def with_views(params):
    """The parameters and their views: what the differentiated function reads."""
    return tuple(params) + tuple(views_of(*params)) if view_ids else tuple(params)

  def fwd(params, acts, acts_int, data, mb_index):
    params = with_views(used(params))
    f = lambda p, a: primal(p, a, acts_int, data, mb_index)
    outs, vjp = jax.vjp(checkpointed(f), params, acts)
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    slots = tuple(next((i for i, p in enumerate(params) if leaf is p), -1) for leaf in leaves)
    residual_tree[:] = [(tree, slots)]
    return outs, tuple(leaf for leaf, slot in zip(leaves, slots) if slot < 0)

  out_avals = [prog.avals[v] for v in sp.output_ids]

  def bwd(params, residuals, cts_present, acc):
    if not residual_tree:
      raise AssertionError(f"stage {sp.index}: the backward was traced before the forward")
    tree, slots = residual_tree[0]
    params, it = used(params), iter(residuals)
    read = with_views(params)
    vjp_fn = jax.tree_util.tree_unflatten(
        tree, [read[slot] if slot >= 0 else next(it) for slot in slots])
    it = iter(cts_present)
    cts = []
    for aval, present in zip(out_avals, sp.ct_present):
      if not primitives.is_float(aval):
        cts.append(_compat.make_float0_zeros(aval.shape))
      elif present:
        cts.append(next(it))
      else:
        cts.append(jnp.zeros(aval.shape, aval.dtype))
    g_read, g_acts = vjp_fn(tuple(cts))
    g_params = g_read[:n_p]
    if view_ids:   # the views' gradients back onto the parameters they view
      _, views_vjp = jax.vjp(lambda *p: tuple(views_of(*p)), *params)
      g_params = tuple(a + b for a, b in zip(g_params, views_vjp(tuple(g_read[n_p:]))))
    acc = tuple(a + g for a, g in zip(acc, g_params))
    if acc_sh is not None:
      acc = tuple(jax.lax.with_sharding_constraint(a, sh) for a, sh in zip(acc, acc_sh))
    return acc, g_acts

  param_avals = [prog.avals[v] for v in sp.param_ids]

  def zeros():
    return tuple(jnp.zeros(a.shape, a.dtype) for a in param_avals)

  return StageFunctions(fwd, bwd, zeros)


def _parameter_views(ops: Sequence[Op], param_ids: Sequence[int]
                     ) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
  """``(views, rest)``: the ops that only re-address a parameter (or such a view of one:
  :func:`~harpjax.compiler.trace.primitives.is_view`, every other operand a literal), and the
  other ops, each in program order."""
  derived = set(param_ids)
  views, rest = [], []
  for op in ops:
    outs = [o for o in op.outvars if o >= 0]
    ins = list(op.in_ids())
    if (primitives.is_view(op.name) and outs and ins and all(v in derived for v in ins)
        and op.params.get("jaxpr") is None):
      derived.update(outs)
      views.append(op)
    else:
      rest.append(op)
  return tuple(views), tuple(rest)


def acc_shardings(layout: StageLayout, mesh) -> tuple:
  """The gradient accumulators' shardings on ``mesh`` (concrete or abstract), in parameter
  order, as the backward holds them."""
  return tuple(NamedSharding(mesh, layout.held_acc_spec(v)) for v in layout.param_ids)


def gradient_shardings(layout: StageLayout, mesh) -> tuple:
  """The gradients' shardings on ``mesh`` (the accumulators reduced), in parameter order."""
  return tuple(NamedSharding(mesh, layout.acc_spec(v)) for v in layout.param_ids)


def fwd_in_specs(layout: StageLayout) -> tuple:
  """``PartitionSpec`` s of the forward's arguments ``(params, acts, acts_int, data, mb)``."""
  return (tuple(layout.specs[v] for v in layout.param_ids),
          tuple(layout.specs[v] for v in layout.act_ids),
          tuple(layout.specs[v] for v in layout.act_int_ids),
          tuple(layout.specs[v] for v in layout.data_ids), P())


# --------------------------------------------------------------------------- values


def put(x, sharding: NamedSharding):
  """``x`` on ``sharding``, unless it is already there."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  return jax.device_put(x, sharding)


def row_slice(x, axis: int, start: int, size: int, rows: int):
  """Rows ``start .. start + size - 1`` of ``x``, whose ``axis`` holds ``rows`` rows (each of
  ``x.shape[axis] // rows`` entries)."""
  per = x.shape[axis] // rows
  idx = [slice(None)] * np.ndim(x)
  idx[axis] = slice(start * per, (start + size) * per)
  return x[tuple(idx)]


# --------------------------------------------------------------------------- executables


@dataclasses.dataclass(frozen=True, eq=False)
class StageExecutables:
  """One stage on its submesh: its layout, mesh and executables (``fwd``, ``bwd``, ``zeros``
  with the signatures of :class:`StageFunctions`).

  Built in process from the stage's functions (:func:`jit_stage`) or on a worker from the
  stage's lowered form (:meth:`harpjax.compiler.stages.LoweredStep.load`).
  """
  layout: StageLayout
  mesh: Mesh
  fwd: Callable
  bwd: Callable
  zeros: Callable
  reduce: Callable | None = None

  @functools.cached_property
  def _shardings(self) -> dict:
    return {v: NamedSharding(self.mesh, spec) for v, spec in self.layout.specs.items()}

  def sharding(self, vid: int) -> NamedSharding:
    """The sharding of a value the stage reads or writes (a cotangent: its output's)."""
    return self._shardings[vid]

  @functools.cached_property
  def _acc_shardings(self) -> dict:
    return {v: NamedSharding(self.mesh, self.layout.acc_spec(v)) for v in self.layout.param_ids}

  def acc_sharding(self, vid: int) -> NamedSharding:
    """The sharding of parameter ``vid``'s gradient (accumulator), on the stage's devices."""
    return self._acc_shardings[vid]

  @functools.cached_property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def group_mesh(self, side: int = 0) -> Mesh:
    """The mesh a placement group of the stage runs on (``side`` 1: a zebra stage's expert
    group)."""
    return self.mesh

  @property
  def executables(self) -> tuple:
    """The executables that run the stage's work (one stage: itself; a stage that splits its
    rows among groups: each group's)."""
    return (self,)

  def total(self, acc) -> tuple:
    """The stage's gradients from what ``bwd`` returned: the accumulator itself, or, where
    the replicas accumulate their own, their sum (once per step)."""
    return acc if self.reduce is None else self.reduce(acc)


def jit_stage(layout: StageLayout, functions: StageFunctions, mesh: Mesh) -> StageExecutables:
  """Jits a stage's functions on its submesh (the forward with its inputs' shardings, the
  zeros with the gradient accumulators', the backward donating the accumulator)."""
  in_sh = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), fwd_in_specs(layout),
                                 is_leaf=lambda x: isinstance(x, P))
  fwd = jax.jit(functions.fwd, in_shardings=in_sh)
  held = acc_shardings(layout, mesh)
  bwd = jax.jit(functions.bwd, donate_argnums=(3,),
                out_shardings=(held, None) if layout.replicas else None)
  zeros = jax.jit(functions.zeros, out_shardings=held)
  reduce = (jax.jit(functions.reduce, in_shardings=(held,),
                    out_shardings=gradient_shardings(layout, mesh))
            if functions.reduce is not None else None)
  return StageExecutables(layout, mesh, fwd, bwd, zeros, reduce)


def _make_hook(ts: TracedStep, rows: int | None = None):
  if ts.regen_ops:
    regen = ts.regen_ops
    avals = ts.region.avals

    def hook(op, invals, mb_index):
      site = regen.get(op.index)
      if site is None:
        return None
      return apply_site(op.primitive, op.params, invals, site, mb_index,
                        [avals[o] if o >= 0 else None for o in op.outvars], rows)
    return hook
  if not ts.rng_exact:
    log.warning("random numbers cannot be aligned with the full-batch step (its structure "
                "depends on the batch size); microbatch m draws from fold_in(key, m) instead")

    def hook(op, invals, mb_index):
      if op.name not in ("random_bits", "random_split"):
        return None
      key = jax.random.fold_in(invals[0], mb_index)
      return _compat.bind_eqn(op.primitive, op.params, [key] + list(invals[1:]))
    return hook
  return None
