"""Tracing a train step into its pipelined region and the rest.

Inside :func:`harpjax.auto_parallel`, :func:`value_and_grad` and :func:`grad` do not
differentiate: they record the loss function's forward jaxpr and stand in the step's jaxpr as a
single ``harpjax_pipeline_region`` equation whose results are the loss, the auxiliary outputs
and the gradients. Everything before that equation prepares the region's inputs; everything
after it is the apply-gradient computation (the optimizer update, whatever the user wrote).

The step is traced twice: once with the full batch (the reference semantics of the parts around
the region) and once with one microbatch, up to the region (the forward program the stages
run; what the step does after the region runs on the whole batch only, so that trace ends
there). Comparing the two tells which region inputs are split into microbatches and along which
axis, which auxiliary outputs are per-example (concatenated) or per-batch (averaged), and which
random-number equations must draw the microbatch's slice of the full batch's random bits so
that dropout matches ``jax.jit`` of the undecorated step exactly.

While it traces, Flax's per-parameter shape check is answered once per distinct initializer
call (:func:`harpjax._compat.flax_param_shape_memo`) and Python's cyclic garbage collector is
paused: the two took half the time of tracing a 48-block GPT (docs/layers.md, "Tracing speed").
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import functools
import gc
import logging
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harpjax import _compat
from harpjax.compiler.trace import batchflow, microbatch
from harpjax.compiler.trace.batchflow import BatchFlow, Flow
from harpjax.compiler.trace.program import Lit, Program, from_closed_jaxpr, strip_markers
from harpjax.compiler.trace.regen import regen_sites, split_axis
from harpjax.errors import (BatchCouplingError, BatchCouplingWarning, MicrobatchError,
                            TraceError)

log = logging.getLogger(__name__)

__all__ = ["value_and_grad", "grad", "mark_layer_boundary", "TracedStep", "trace_step",
           "RegionInput", "REGION_PRIMITIVE_NAME", "BOUNDARY_PRIMITIVE_NAME", "BATCH_COUPLING"]

BATCH_COUPLING = (None, "per_microbatch", "error")
"""Values of ``batch_coupling``: ``None`` (a step whose examples meet runs per microbatch and
a :class:`~harpjax.errors.BatchCouplingWarning` says so), ``"per_microbatch"`` (the same,
acknowledged: logged only) and ``"error"`` (a
:class:`~harpjax.errors.BatchCouplingError` instead)."""

REGION_PRIMITIVE_NAME = "harpjax_pipeline_region"
BOUNDARY_PRIMITIVE_NAME = "harpjax_layer_boundary"

_state = threading.local()

boundary_p = _compat.register_identity_primitive(BOUNDARY_PRIMITIVE_NAME)

region_p = _compat.Primitive(REGION_PRIMITIVE_NAME)
region_p.multiple_results = True
region_p.def_abstract_eval(lambda *avals, region_id, out_avals: list(out_avals))


def _region_impl(*args, region_id, out_avals):
  raise TraceError("the pipelined region can only run through harpjax.auto_parallel")


region_p.def_impl(_region_impl)


@dataclasses.dataclass
class _RegionRecord:
  closed: Any   # ClosedJaxpr of the flat forward: (consts, diff, other) -> (loss, aux)
  num_consts: int
  num_diff: int
  num_other: int
  aux_tree: Any
  has_aux: bool


class _Capture:
  def __init__(self, stop_at_region: bool = False):
    self.regions: list[_RegionRecord] = []
    self.stop_at_region = stop_at_region
    self.trace_state = None   # the step's own trace (set when it starts)


class _RegionTraced(BaseException):
  """Ends a trace of the step at its region, whose results it carries: what the step computes
  after the region is not needed at microbatch size. A ``BaseException``, so that a step's
  ``except Exception`` does not take it for its own error."""

  def __init__(self, outs):
    super().__init__()
    self.outs = outs


def _current() -> _Capture | None:
  return getattr(_state, "capture", None)


@contextlib.contextmanager
def _capturing(stop_at_region: bool = False):
  prev = _current()
  _state.capture = _Capture(stop_at_region)
  try:
    yield _state.capture
  finally:
    _state.capture = prev


# --------------------------------------------------------------------------- public markers


def mark_layer_boundary(x):
  """Marks a layer cut after ``x`` (any pytree of arrays) and returns ``x``.

  Outside :func:`harpjax.auto_parallel` this is the identity and leaves no trace in the jaxpr;
  inside it, the equations before the marker belong to one layer and those after to the next.
  """
  if _current() is None:
    return x
  leaves, tree = jax.tree_util.tree_flatten(x)
  if not leaves:
    return x
  return jax.tree_util.tree_unflatten(tree, boundary_p.bind(*leaves))


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **kwargs) -> Callable:
  """``jax.value_and_grad`` that marks the pipelined region under ``auto_parallel``.

  Outside :func:`harpjax.auto_parallel` it is exactly ``jax.value_and_grad(fun, argnums,
  has_aux, **kwargs)``.
  """
  jax_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

  @functools.wraps(fun)
  def wrapper(*args, **kw):
    cap = _current()
    if cap is None:
      return jax_fn(*args, **kw)
    (loss, aux), grads = _capture_region(cap, fun, argnums, has_aux, args, kw)
    return ((loss, aux) if has_aux else loss), grads
  return wrapper


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **kwargs) -> Callable:
  """``jax.grad`` that marks the pipelined region under ``auto_parallel``."""
  jax_fn = jax.grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

  @functools.wraps(fun)
  def wrapper(*args, **kw):
    cap = _current()
    if cap is None:
      return jax_fn(*args, **kw)
    (_, aux), grads = _capture_region(cap, fun, argnums, has_aux, args, kw)
    return (grads, aux) if has_aux else grads
  return wrapper


def _capture_region(cap: _Capture, fun, argnums, has_aux, args, kwargs):
  if cap.regions:
    raise TraceError("the train step calls harpjax.value_and_grad/grad more than once; "
                     "harpjax pipelines exactly one gradient computation per step")
  single = isinstance(argnums, int)
  argnums_t = (argnums,) if single else tuple(argnums)
  for a in argnums_t:
    if not -len(args) <= a < len(args):
      raise TraceError(f"argnums={argnums} but the loss function got {len(args)} arguments")
  argnums_t = tuple(a % len(args) for a in argnums_t)
  diff_args = tuple(args[a] for a in argnums_t)
  other_args = (tuple(a for i, a in enumerate(args) if i not in argnums_t), kwargs)
  diff_leaves, diff_tree = jax.tree_util.tree_flatten(diff_args)
  other_leaves, other_tree = jax.tree_util.tree_flatten(other_args)
  for leaf in diff_leaves:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TraceError("harpjax.value_and_grad differentiates only floating-point parameters; "
                       f"got a leaf of dtype {jnp.result_type(leaf)}")
  nd = len(diff_leaves)
  aux_tree_box = []

  def flat_fun(*leaves):
    d = jax.tree_util.tree_unflatten(diff_tree, leaves[:nd])
    pos, kw = jax.tree_util.tree_unflatten(other_tree, leaves[nd:])
    full, di, pi = [], iter(d), iter(pos)
    for i in range(len(args)):
      full.append(next(di) if i in argnums_t else next(pi))
    out = fun(*full, **kw)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TraceError("has_aux=True but the loss function did not return (loss, aux)")
      loss, aux = out
    else:
      loss, aux = out, None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.inexact):
      raise TraceError(f"the loss must be a floating-point scalar, got {loss.dtype}{loss.shape}")
    aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
    aux_tree_box.append(aux_tree)
    return [loss] + list(aux_leaves)

  closed = jax.make_jaxpr(flat_fun)(*diff_leaves, *other_leaves)
  record = _RegionRecord(closed=closed, num_consts=len(closed.consts), num_diff=nd,
                         num_other=len(other_leaves), aux_tree=aux_tree_box[-1], has_aux=has_aux)
  region_id = len(cap.regions)
  cap.regions.append(record)
  out_avals = tuple(closed.out_avals) + tuple(_compat.aval_of(x) for x in diff_leaves)
  outs = region_p.bind(*closed.consts, *diff_leaves, *other_leaves, region_id=region_id,
                       out_avals=out_avals)
  if cap.stop_at_region and _compat.trace_state() == cap.trace_state:
    # Bound in the step's own jaxpr (not inside a jit, scan or checkpoint of the step, whose
    # trace an exception would abandon): the trace may end here, the region its result.
    raise _RegionTraced(outs)
  n_out = len(closed.out_avals)
  loss = outs[0]
  aux = jax.tree_util.tree_unflatten(record.aux_tree, outs[1:n_out])
  grads = jax.tree_util.tree_unflatten(diff_tree, outs[n_out:])
  grads = grads[0] if single else grads
  return (loss, aux), grads


# --------------------------------------------------------------------------- traced step


@dataclasses.dataclass(frozen=True)
class RegionInput:
  """How one input of the pipelined region is fed to the stages.

  Attributes:
    kind: ``"param"`` (differentiated; ``param_index`` into the gradient list), ``"split"``
      (sliced per microbatch along ``axis``), ``"whole"`` (the same value for every
      microbatch, computed by the step) or ``"static"`` (a constant known at trace time).
      Values the region computes from the batch's data alone (a mask's token count) are
      hoisted out of it: computed on the whole batch before the pipeline, they enter the
      region as further ``"whole"`` (or ``"split"``) inputs.
    outer_ref: where the value lives in the outer program (id or literal).
    axis: split axis for ``"split"``.
    static_value: the constant for ``"static"``.
  """
  kind: str
  outer_ref: Any
  param_index: int = -1
  axis: int = -1
  static_value: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class TracedStep:
  """The two traces of a train step and what their comparison says.

  Attributes:
    outer: the full-batch step program; op ``region_op`` is the pipelined region.
    outer_consts: values of ``outer``'s leading constant inputs.
    in_tree / out_tree: pytree structures of the step's arguments and results.
    region_op: index of the region op in ``outer.ops``.
    region: the region's forward program at microbatch size, layer-boundary markers removed
      (their positions are ``boundary_cuts``); inputs are, in order, the
      region's constants, differentiated leaves and other leaves; outputs are the loss then the
      auxiliary leaves.
    region_full: the same program traced at full batch size (for comparison).
    inputs: one :class:`RegionInput` per ``region.invars``.
    num_params: number of differentiated leaves.
    aux_concat_axes: per auxiliary output, the axis to concatenate microbatches along, or
      ``None`` to average (or sum, per ``loss_reduction``) them.
    regen_ops: op index in ``region`` -> :class:`~harpjax.compiler.trace.regen.Redraw` for ops
      that create a batch dimension (random bits, iota; they compute the full-batch value and
      slice it) or :class:`~harpjax.compiler.trace.regen.Inside` for ops whose bodies do.
    rng_exact: false when the two traces do not correspond op for op and the region draws
      random numbers (microbatch ``m`` then draws from ``fold_in(key, m)``).
    num_microbatches, microbatch_size: B and the batch leaves' leading size divided by B.
    boundary_cuts: op positions in ``region`` before which a layer marker stood.
    output_flows: per region output (the loss first), its
      :class:`~harpjax.compiler.trace.batchflow.Flow`: how the microbatches' values make the
      batch's (:func:`~harpjax.compiler.trace.microbatch.combine_rules`).
    couplings: where examples of different microbatches meet
      (:class:`~harpjax.compiler.trace.batchflow.Coupling`): such values are computed per
      microbatch.
    flow / structure: the analysis of the region and the structure of its rewrite, to apply
      to the region traced at other microbatch sizes (``None`` when the two traces differ).
  """
  outer: Program
  outer_consts: tuple
  in_tree: Any
  out_tree: Any
  region_op: int
  region: Program
  region_full: Program
  inputs: tuple
  num_params: int
  has_aux: bool
  aux_concat_axes: tuple
  regen_ops: dict
  num_microbatches: int
  rng_exact: bool
  boundary_cuts: tuple = ()
  output_flows: tuple = ()
  couplings: tuple = ()
  flow: BatchFlow | None = None
  structure: microbatch.Structure | None = None


def trace_step(step_fn: Callable, args: tuple, *, num_microbatches: int,
               batch_argnums: Sequence[int] = (1,), batch_coupling: str | None = None,
               like: TracedStep | None = None, factor=None) -> TracedStep:
  """Traces ``step_fn(*args)`` at full batch and, up to its region, at microbatch size.

  The region is then rewritten into the program one microbatch runs so that the
  microbatches' results make the batch's (:mod:`~harpjax.compiler.trace.batchflow`,
  :mod:`~harpjax.compiler.trace.microbatch`): what depends on the batch's data alone is
  computed once on the whole batch, sums over the examples come out in mean-exact form, and
  where examples of different microbatches meet, the step says so (``batch_coupling``).

  Args:
    step_fn: the user's train step.
    args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    num_microbatches: B.
    batch_argnums: which arguments hold the batch; their array leaves are split along axis 0.
    batch_coupling: what to do where examples of different microbatches meet
      (:data:`BATCH_COUPLING`).
    like: a step traced earlier from the same function at another batch size: the region is
      rewritten with ``like``'s analysis (its prelude and hoisted inputs), for groups of
      devices that compute part of each microbatch; ``factor`` is then the full batch's rows
      over this trace's microbatch rows. Only the region is traced again (at microbatch
      size, up to the region): the result is ``like`` with that region.

  Raises:
    MicrobatchError: a batch leaf does not split into ``num_microbatches`` parts.
    TraceError: the step has no (or more than one) pipelined region, or behaves differently at
      microbatch size in a way harpjax cannot reconcile.
    BatchCouplingError: examples of different microbatches meet and ``batch_coupling`` is
      ``"error"``, or the batch's data index the batch's examples (labels of an in-batch loss
      given with the data), which a microbatch cannot reproduce.
  """
  # Two costs that change nothing in the result: the collector's full walks of the heap while
  # the trace grows, and Flax's shape check of every existing parameter (a small trace of its
  # initializer each time; evaluated once per distinct initializer call instead).
  with _gc_paused(), _compat.flax_param_shape_memo():
    return _trace_step(step_fn, args, num_microbatches, batch_argnums, batch_coupling, like,
                       factor)


_GC_LOCK = threading.Lock()
_GC_PAUSED = [0, False]   # nesting depth (all threads), whether the collector was on before


@contextlib.contextmanager
def _gc_paused():
  """Python's cyclic garbage collector paused (and restored as it was) while a step traces.

  A trace allocates hundreds of thousands of objects (tracers, equations, avals) that live
  until it ends; each full collection meanwhile walks every object of the process, JAX's and
  Flax's included, and finds almost no cycles: a third of the time of tracing GPT-39B
  (docs/layers.md, "Tracing speed"). Reference counting still frees what a trace drops; the
  few cycles left wait for the next collection after the trace."""
  with _GC_LOCK:
    if _GC_PAUSED[0] == 0:
      _GC_PAUSED[1] = gc.isenabled()
      gc.disable()
    _GC_PAUSED[0] += 1
  try:
    yield
  finally:
    with _GC_LOCK:
      _GC_PAUSED[0] -= 1
      if _GC_PAUSED[0] == 0 and _GC_PAUSED[1]:
        gc.enable()


def _trace_step(step_fn, args, num_microbatches, batch_argnums, batch_coupling, like,
                factor) -> TracedStep:
  if batch_coupling not in BATCH_COUPLING:
    raise TraceError(f"batch_coupling={batch_coupling!r}; choose one of {BATCH_COUPLING}")
  if int(num_microbatches) != num_microbatches or num_microbatches < 1:
    raise MicrobatchError(f"num_microbatches must be a positive integer, got {num_microbatches}")
  B = int(num_microbatches)
  for a in batch_argnums:
    if not 0 <= a < len(args):
      raise TraceError(f"batch_argnums={tuple(batch_argnums)} but the step got {len(args)} "
                       "arguments")
  abstract = jax.tree_util.tree_map(abstractify, args)
  mb_args = list(abstract)
  for a in batch_argnums:
    mb_args[a] = _split_batch(abstract[a], B, a)

  if like is not None:
    return _retraced(step_fn, tuple(mb_args), like, factor, B)
  full_closed, full_cap, out_shape = _trace(step_fn, abstract)
  mb_closed, mb_cap = _trace_microbatch(step_fn, tuple(mb_args), B)
  in_tree = jax.tree_util.tree_structure(args)
  out_tree = jax.tree_util.tree_structure(out_shape)

  outer = from_closed_jaxpr(full_closed)
  outer_mb = from_closed_jaxpr(mb_closed)
  region_ops = [op.index for op in outer.ops if op.name == REGION_PRIMITIVE_NAME]
  region_ops_mb = [op.index for op in outer_mb.ops if op.name == REGION_PRIMITIVE_NAME]
  if not region_ops:
    raise TraceError(
        "the train step never calls harpjax.value_and_grad or harpjax.grad, so there is nothing "
        "to pipeline; compute the gradients with harpjax.value_and_grad(loss_fn)(params)")
  if len(region_ops_mb) != 1 or len(mb_cap.regions) != 1:
    raise TraceError("the train step traced with one microbatch did not produce exactly one "
                     "pipelined region; its control flow must not depend on the batch size")
  rec_full, rec_mb = full_cap.regions[0], mb_cap.regions[0]
  region_full, _ = strip_markers(from_closed_jaxpr(rec_full.closed), BOUNDARY_PRIMITIVE_NAME)
  region, cuts = strip_markers(from_closed_jaxpr(rec_mb.closed), BOUNDARY_PRIMITIVE_NAME)
  if len(region.invars) != len(region_full.invars) or \
      (rec_full.num_consts, rec_full.num_diff) != (rec_mb.num_consts, rec_mb.num_diff):
    raise TraceError("the loss function captures different values when traced with one "
                     "microbatch than with the whole batch; pass batch-dependent values as "
                     "arguments of the loss function or through its closure consistently")

  region_eqn = outer.ops[region_ops[0]]
  region_eqn_mb = outer_mb.ops[region_ops_mb[0]]
  step_arg_ids = set(outer.invars[outer.num_consts:])
  dynamic = outer.dependents(step_arg_ids)
  mb_consts = {vid: val for vid, val in zip(outer_mb.invars[:outer_mb.num_consts],
                                            mb_closed.consts)}
  nc, nd = rec_mb.num_consts, rec_mb.num_diff
  inputs = []
  for k, (ref, ref_mb) in enumerate(zip(region_eqn.invars, region_eqn_mb.invars)):
    full_aval = region_full.avals[region_full.invars[k]]
    mb_aval = region.avals[region.invars[k]]
    if nc <= k < nc + nd:
      inputs.append(RegionInput("param", ref, param_index=k - nc))
      continue
    if not isinstance(ref, Lit) and ref in dynamic:
      if full_aval.shape == mb_aval.shape:
        inputs.append(RegionInput("whole", ref))
      else:
        axis = split_axis(full_aval.shape, mb_aval.shape, B)
        if axis is None:
          raise TraceError(
              f"region input {k} has shape {full_aval.shape} for the batch but {mb_aval.shape} "
              f"for a microbatch; harpjax splits inputs along one axis by {B}")
        inputs.append(RegionInput("split", ref, axis=axis))
      continue
    value = ref_mb.value if isinstance(ref_mb, Lit) else mb_consts.get(ref_mb)
    if value is None and not isinstance(ref_mb, Lit):
      # Computed by the step from constants alone (a mask, a table built outside the loss):
      # the step's own ops compute it, the region takes it whole.
      if full_aval.shape != mb_aval.shape:
        raise TraceError(f"region input {k} is computed from constants but has shape "
                         f"{full_aval.shape} for the batch and {mb_aval.shape} for a "
                         "microbatch; make its shape independent of the batch size")
      inputs.append(RegionInput("whole", ref))
      continue
    inputs.append(RegionInput("static", ref, static_value=value))

  aux_axes = []
  for k in range(1, len(region.outvars)):
    fa = _aval_of(region_full, region_full.outvars[k])
    ma = _aval_of(region, region.outvars[k])
    if fa.shape == ma.shape:
      aux_axes.append(None)
    else:
      axis = split_axis(fa.shape, ma.shape, B)
      if axis is None:
        raise TraceError(f"auxiliary output {k - 1} has shape {fa.shape} for the batch but "
                         f"{ma.shape} for a microbatch; it cannot be reassembled")
      aux_axes.append(axis)

  flow, structure = _analysis(step_fn, abstract, batch_argnums, region_full, region, inputs,
                              B)
  if B > 1:
    _report(flow, B, batch_coupling)
  out_flows = tuple(Flow(batchflow.ROWS, a) if a is not None else Flow(batchflow.COUPLED)
                    for a in [None] + aux_axes)
  if flow.aligned:
    region, structure, new_index = microbatch.rewrite(flow, region, B, structure)
    region_full, _, _ = microbatch.rewrite(flow, region_full, 1, structure)
    cuts = sorted({new_index[c] for c in cuts} - {0, len(region.ops)})
    out_flows = flow.output_flows()
    aux_axes = [r[1] if isinstance(r, tuple) else None
                for r in microbatch.combine_rules(flow.output_flows(), region)[1:]]
    if structure.hoisted:
      outer, region_op, new_inputs = _with_prelude(outer, region_ops[0], flow, structure)
      inputs.extend(new_inputs)
      region_ops = [region_op]
  else:
    flow = None

  regen, rng_exact = regen_sites(region_full, region, B)
  return TracedStep(outer=outer, outer_consts=tuple(full_closed.consts), in_tree=in_tree,
                    out_tree=out_tree, region_op=region_ops[0], region=region,
                    region_full=region_full, inputs=tuple(inputs), num_params=nd,
                    has_aux=rec_mb.has_aux, aux_concat_axes=tuple(aux_axes), regen_ops=regen,
                    num_microbatches=B, rng_exact=rng_exact, boundary_cuts=tuple(cuts),
                    output_flows=tuple(out_flows),
                    couplings=flow.couplings if flow is not None else (),
                    flow=flow, structure=structure)


def _analysis(step_fn, abstract, batch_argnums, region_full: Program, region: Program,
              inputs: list, B: int) -> tuple[BatchFlow, microbatch.Structure | None]:
  """The batch flow of the region and, for one microbatch, the structure of its rewrite.

  With one microbatch the two traces are the same program and cannot tell what carries the
  examples; the step is traced once more with twice the batch to find out (the flows, what to
  hoist and where a part of the batch would need rescaling), so that groups of devices
  computing part of the microbatch rewrite their programs alike."""
  if B > 1:
    in_flows = [_input_flow(inp, region_full.avals[v], region.avals[v])
                for inp, v in zip(inputs, region.invars)]
    return batchflow.analyze(region_full, region, in_flows, B), None
  probe = list(abstract)
  for a in batch_argnums:
    probe[a] = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((2 * x.shape[0],) + tuple(x.shape[1:]), x.dtype)
        if len(x.shape) else x, abstract[a])
  try:
    closed, cap, _ = _trace(step_fn, tuple(probe), stop_at_region=True)
  except Exception:  # pylint: disable=broad-except  (a step written for one batch size)
    return batchflow.unaligned(region_full, region, 1), None
  if len(cap.regions) != 1:
    return batchflow.unaligned(region_full, region, 1), None
  twice, _ = strip_markers(from_closed_jaxpr(cap.regions[0].closed), BOUNDARY_PRIMITIVE_NAME)
  in_flows = []
  for inp, v in zip(inputs, region.invars):
    if inp.kind != "param" and v < len(twice.avals) and \
        tuple(twice.avals[v].shape) != tuple(region.avals[v].shape):
      axis = split_axis(tuple(twice.avals[v].shape), tuple(region.avals[v].shape), 2)
      inp = RegionInput("split", inp.outer_ref, axis=axis if axis is not None else 0)
    in_flows.append(_input_flow(inp, region.avals[v], region.avals[v]))
  probed = batchflow.analyze(twice, region, in_flows, 2)
  if not probed.aligned:
    return probed, None
  _, structure, _ = microbatch.rewrite(probed, region, 2)
  return dataclasses.replace(probed, full=region_full, num_microbatches=1), structure


def _input_flow(inp: RegionInput, full_aval, mb_aval) -> Flow:
  """How a region input relates to the examples."""
  if inp.kind == "param":
    return Flow(batchflow.FREE, param=True)
  if inp.kind == "split":
    return Flow(batchflow.ROWS, inp.axis, data=True)
  varies = tuple(full_aval.shape) != tuple(mb_aval.shape)   # a constant of the batch's length
  return Flow(batchflow.FREE, varies=varies)


def _report(flow: BatchFlow, B: int, mode: str | None) -> None:
  """Refuses, warns or logs where the microbatches cannot reproduce the batch."""
  if flow.refusals:
    raise BatchCouplingError(
        "this step cannot be split into microbatches: " + "; ".join(flow.refusals))
  if not flow.aligned:
    msg = ("the train step traced with one microbatch is not the same program as with the "
           "whole batch (its structure depends on the batch size), so harpjax cannot tell "
           "which values carry the examples; each of the B=%d microbatches runs the step as "
           "it traces for one microbatch, and the results may differ from jax.jit of the "
           "whole batch" % B)
  elif flow.couplings:
    sites = "\n".join(f"  - {c.describe()}" for c in flow.couplings)
    msg = (f"in this step, examples of different microbatches meet where the {B} "
           f"microbatches cannot reproduce the whole batch:\n{sites}\nEach microbatch "
           "computes these over its own examples (as any pipeline does), so the loss, the "
           "gradients and what depends on them differ from jax.jit of the whole batch; they "
           "equal the average of jax.jit run on each microbatch. Pass "
           "batch_coupling='per_microbatch' to auto_parallel to accept this without a "
           "warning, or batch_coupling='error' to refuse such steps.")
  else:
    return
  if mode == "error":
    raise BatchCouplingError(msg)
  if mode == "per_microbatch":
    log.info("%s", msg)
    return
  warnings.warn(msg, BatchCouplingWarning, stacklevel=4)
  if log.hasHandlers():   # also to the logs where they are configured (no second print else)
    log.warning("%s", msg)


def _with_prelude(outer: Program, region_op: int, flow: BatchFlow,
                  structure: microbatch.Structure):
  """``outer`` with the ops computing the hoisted values inserted before the region, which
  takes them as further inputs. Returns the program, the region op's new index and the new
  :class:`RegionInput` s."""
  region_eqn = outer.ops[region_op]
  ops, _, refs = microbatch.prelude_ops(flow, structure.hoisted, region_eqn.invars)
  avals = list(outer.avals)
  ids: dict = {}

  def new_ref(r):
    if isinstance(r, tuple) and not isinstance(r, Lit) and r[0] == "v":
      if r not in ids:
        avals.append(flow.full.avals[r[1]])
        ids[r] = len(avals) - 1
      return ids[r]
    return r

  prelude = []
  for op in ops:
    prelude.append(dataclasses.replace(
        op, invars=tuple(new_ref(v) if isinstance(v, tuple) and not isinstance(v, Lit) else v
                         for v in op.invars),
        outvars=tuple(new_ref(v) if v != -1 else -1 for v in op.outvars)))
  hoisted_refs = [new_ref(r) for r in refs]
  before = list(outer.ops[:region_op])
  new_region = dataclasses.replace(region_eqn,
                                   invars=tuple(region_eqn.invars) + tuple(hoisted_refs))
  after = list(outer.ops[region_op + 1:])
  all_ops = before + prelude + [new_region] + after
  all_ops = [dataclasses.replace(op, index=i) for i, op in enumerate(all_ops)]
  new_outer = Program(tuple(avals), outer.invars, outer.outvars, tuple(all_ops),
                      outer.num_consts)
  inputs = [RegionInput("whole" if axis < 0 else "split", ref, axis=axis)
            for ref, axis in zip(hoisted_refs, structure.hoist_axes)]
  log.info("computing %d value(s) of the batch's data up front (the whole batch's), before "
           "the pipeline", len(inputs))
  return new_outer, len(before) + len(prelude), inputs


def _trace_microbatch(step_fn, mb_args: tuple, B: int):
  """``(closed jaxpr, capture)`` of the step traced at microbatch size up to its region."""
  try:
    return _trace(step_fn, mb_args, stop_at_region=True)[:2]
  except (TraceError, MicrobatchError):
    raise
  except Exception as e:  # pylint: disable=broad-except  (the user's code, at another size)
    raise TraceError(
        f"the train step fails when traced with one microbatch (the batch split into {B}): "
        f"{type(e).__name__}: {e}. harpjax runs the step on each microbatch, so shapes must "
        "follow the batch: read the batch size from the arrays (x.shape[0]) instead of "
        "writing it as a number") from e


def _retraced(step_fn, mb_args: tuple, like: TracedStep, factor, B: int) -> TracedStep:
  """``like`` with its region traced again at the microbatch size of ``mb_args``.

  Only the region is traced (up to it, at that size): the rest of ``like`` (its step at full
  batch, its inputs, its analysis) is what a step traced at these rows would have, the
  analysis applied to the new region by :func:`_like`."""
  mb_closed, mb_cap = _trace_microbatch(step_fn, mb_args, B)
  outer_mb = from_closed_jaxpr(mb_closed)
  if sum(op.name == REGION_PRIMITIVE_NAME for op in outer_mb.ops) != 1 or \
      len(mb_cap.regions) != 1:
    raise TraceError("the train step traced with another microbatch size did not produce "
                     "exactly one pipelined region; its control flow must not depend on the "
                     "batch size")
  rec = mb_cap.regions[0]
  region, cuts = strip_markers(from_closed_jaxpr(rec.closed), BOUNDARY_PRIMITIVE_NAME)
  before = like.flow.mb if like.flow is not None else like.region   # as traced, not rewritten
  params = [k for k, inp in enumerate(like.inputs) if inp.kind == "param"]
  if len(region.invars) != len(before.invars) or rec.num_diff != like.num_params or \
      params != list(range(rec.num_consts, rec.num_consts + rec.num_diff)):
    raise TraceError("the loss function captures different values when traced with another "
                     "microbatch size; pass batch-dependent values as arguments of the loss "
                     "function or through its closure consistently")
  return _like(like, region, cuts, factor)


def _like(like: TracedStep, region: Program, cuts, factor) -> TracedStep:
  """``like`` with its region traced at another microbatch size, rewritten as ``like``'s."""
  if like.flow is None:
    return dataclasses.replace(like, region=region, boundary_cuts=tuple(cuts))
  mb = like.flow.mb
  if len(region.ops) != len(mb.ops) or any(a.name != b.name for a, b in zip(region.ops,
                                                                            mb.ops)):
    raise TraceError("the train step traced with another microbatch size is not the same "
                     "program; its structure depends on the batch size")
  try:
    new, _, new_index = microbatch.rewrite(like.flow, region, fractions.Fraction(factor),
                                           like.structure)
  except microbatch.RewriteError as e:
    raise TraceError(f"the step at another microbatch size needs another rewrite ({e})") \
        from None
  cuts = sorted({new_index[c] for c in cuts} - {0, len(new.ops)})
  return dataclasses.replace(like, region=new, boundary_cuts=tuple(cuts))


def _trace(step_fn, args, stop_at_region: bool = False):
  """``(closed jaxpr, capture, output shapes)`` of ``step_fn(*args)``.

  With ``stop_at_region``, the jaxpr ends with the region's equation where the step calls the
  region at its top level: its results are the region's, and what the step does after the
  region (the optimizer update) is not traced. Everything up to and including the region's
  equation is as in the whole trace."""
  # A fresh function object each time: JAX caches traces by function identity (a jax.jit of
  # the same step traced earlier would otherwise be reused without running our markers).
  def fresh(*a):
    cap.trace_state = _compat.trace_state()
    try:
      return step_fn(*a)
    except _RegionTraced as stop:
      return list(stop.outs)
  with _capturing(stop_at_region) as cap:
    closed, out_shape = jax.make_jaxpr(fresh, return_shape=True)(*args)
  return closed, cap, out_shape


def abstractify(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
  arr = np.asarray(x)
  return jax.ShapeDtypeStruct(arr.shape, jnp.result_type(x))


def _split_batch(tree, B: int, argnum: int):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  for path, leaf in leaves:
    shape = tuple(leaf.shape)
    if len(shape) == 0:
      out.append(leaf)
      continue
    if shape[0] % B != 0:
      where = jax.tree_util.keystr(path) or "<leaf>"
      raise MicrobatchError(
          f"argument {argnum}{where} has {shape[0]} rows, which do not split into "
          f"num_microbatches={B} equal microbatches; choose a batch size divisible by {B}")
    out.append(jax.ShapeDtypeStruct((shape[0] // B,) + shape[1:], leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def _aval_of(program: Program, ref):
  if isinstance(ref, Lit):
    return _compat.aval_of(ref.value)
  return program.avals[ref]
