"""What a piece costs, read off its jaxpr: no XLA compilation.

The forward+backward of a :class:`~harpjax.compiler.profile.pieces.Piece` (``jax.vjp`` with
given cotangents, :func:`~harpjax.compiler.profile.pieces.make_functions`) is traced to a
jaxpr from ``jax.ShapeDtypeStruct`` s (milliseconds), flattened to a
:class:`~harpjax.compiler.trace.Program` and stripped of the ops nothing returned needs, as
XLA strips them. :func:`jaxpr_stats` reads, per device of a ``(dp, tp)`` logical mesh, at the
full microbatch's shapes, what :func:`~harpjax.compiler.profile.pieces.xla_stats` reads from
the compiled piece (the calibrated time factors were fitted to those statistics):

* **FLOPs**: :func:`~harpjax.compiler.trace.primitives.eqn_flops` per op. An op whose result
  depends on a batch-split input does ``1 / dp`` of it; an op the tensor-parallel rules split
  (:func:`~harpjax.compiler.layers.sharding.tp_plan` run over the forward *and* backward ops:
  a column-parallel matmul, what flows from it, the row-parallel matmul that reduces it) does
  ``1 / tp`` of it. As XLA counts them: the ops its simplifier removes cost nothing
  (:func:`simplified_away`), the cheap elementwise ops its fusion computes in several
  fusions are counted in each (at most twice).
* **Bytes accessed**: every op reads its operands and writes its results, except broadcasts,
  conversions, reshapes, transposes and iotas, which XLA computes inside their consumers (a
  consumer reads their operands instead). This is close to XLA:CPU's count, which fuses
  little more than that: within a quarter on GPT-2.6B-sized layers. A value carrying the
  batch is ``1 / dp`` of its size, one split on ``tp`` ``1 / tp`` of it.
* **Collectives**: one all-reduce per matmul the rules make row-parallel (the forward's second
  matmul of a Megatron pair, the backward's input gradient of the first), of its result.
* **Residuals** (activation memory per in-flight microbatch): the leaves of the forward's
  ``jax.vjp`` closure, parameters and views of them excluded (the stage's backward takes the
  parameters again and views them anew), activation inputs the backward keeps included,
  divided as above.
* **For the stage level** (:func:`~harpjax.compiler.profile.profiler.stage_workspaces`): the
  bytes of the forward's random draws (their sum and the largest), and, where the backward
  rematerialises, what it keeps of its recomputed forward for its backward proper.
* **Workspace**: the larger of the forward's and the backward's, which the runtime compiles
  as two executables: the peak bytes of the results each writes live at once, its inputs and
  outputs excluded (the residuals are the forward's outputs and the backward's inputs: they
  count once, as residuals). Besides the folded ops above, an elementwise op whose result only
  elementwise ops and reductions read is computed inside them (XLA's loop and input fusion)
  and writes nothing; a matmul operand whose batch dimensions do not lead (or whose
  contracting dimensions XLA must move, several at once) is copied from when it exists until
  the matmul (:func:`~harpjax.compiler.trace.primitives.dot_operand_copies`). Within a buffer
  or two of XLA:CPU's temporaries of the two executables; not the joint forward+backward's,
  whose temporaries hold the residuals too (and, on a data-parallel mesh, the gradient before
  its all-reduce, which the memory model counts apart).
* **Parameters**: this device's shard (:func:`~harpjax.compiler.layers.sharding.param_specs`).
* **Work** (:func:`jaxpr_work`, what the time model reads: a
  :class:`~harpjax.compiler.profile.calibration.Work`): the FLOPs and bytes of each
  compute-heavy op, the bytes of all other ops, and the ops that launch a kernel of their
  own: compute-heavy ops, ops doing more than one FLOP per result element (reductions,
  cumulative sums, sorts) and data movement that is neither computed inside its consumers nor
  a view (gather, scatter, concatenate, pad...); elementwise ops are fused into their
  neighbours. Every term is a sum over ops. A fused attention call
  (``jax.nn.dot_product_attention(..., implementation="cudnn")``: the primitives in
  :data:`harpjax._compat.FUSED_ATTENTION_PRIMITIVES`) is one kernel of its own
  (``Work.flash_flops``, ``Work.flash_bytes``: its FLOPs, its operands and results), with its
  XLA composition beside it (:func:`composition_work`) for GPU types without the kernel
  (docs/cost_model.md, "Attention").

The work is read off the forward+backward that also returns the forward's outputs, as the
stage's forward the runtime runs does (they cross the cut to the next stage): the ops that
compute them cost their time however finely the model is cut; its backward (traced after a
marker, :data:`_CUT`) gives the backward's workspace, rematerialised recomputation included.
The bytes are read off the forward+backward without the outputs, as XLA's cost analysis of
the piece counts them; the residuals and the forward's workspace off the forward that returns
the outputs and the residuals.

The data-parallel share needs no trace at the local microbatch: which values and ops depend on
a batch-split input is known from the program. A value that depends on the batch but has a
parameter's shape (a weight gradient) is not batch-sized; one computed from constants alone but
shaped like a batch-sized value (a causal mask broadcast to the batch) is.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import numpy as np

from harpjax import _compat
from harpjax.compiler.layers import sharding
from harpjax.compiler.profile import pieces as pieces_lib
from harpjax.compiler.profile.calibration import Work
from harpjax.compiler.trace import (checkpointed, Lit, Program, from_closed_jaxpr, ops_function,
                                    primitives, regen, remat_mode, strip_markers)

log = logging.getLogger(__name__)

__all__ = ["ESTIMATE_VERSION", "TracedPiece", "trace_piece", "jaxpr_stats", "jaxpr_work",
           "accumulated_params", "simplified_away", "outputs_recompute_ops",
           "outputs_recompute_work", "live_ops_work", "composition_work"]

ESTIMATE_VERSION = "14"
"""Bumped when what :func:`jaxpr_stats` counts changes (part of the jaxpr source's cache key)."""

# Ops XLA computes inside each consumer (fuses, duplicating them if need be): their results
# are never written; a consumer reads their operands instead.
_FOLDED = frozenset({"broadcast_in_dim", "convert_element_type", "iota", "reshape", "squeeze",
                     "expand_dims", "transpose"})
_EFFECTS = frozenset({"debug_callback", "io_callback", "pure_callback"})
# Ops with a kernel of their own although they do at most one FLOP per result element: data
# movement XLA does not fuse away, and scans along an axis.
_OWN_KERNELS = frozenset({"gather", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                          "scatter_mul", "scatter-min", "scatter-max", "scatter_min",
                          "scatter_max", "concatenate", "pad", "dynamic_update_slice",
                          "rev", "select_and_scatter_add", "split", "sort", "cumsum",
                          "cumprod", "cummax", "cummin", "cumlogsumexp", "scan", "while",
                          "cond"})
# Where the forward+backward's backward begins: bound between ``jax.vjp`` and the call of its
# closure while tracing (every op of the forward is emitted before it, every op of the
# backward after it, a rematerialised forward's recomputation included), stripped afterwards.
_CUT_NAME = "harpjax_estimate_fwd_bwd_cut"
_CUT = _compat.register_identity_primitive(_CUT_NAME)
# Ops that only re-address their operand: a view of a split value is split.
_MOVES = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type",
                    "copy", "copy_p", "broadcast_in_dim", "slice", "dynamic_slice"})


@dataclasses.dataclass(frozen=True, eq=False)
class TracedPiece:
  """A piece's forward+backward and forward-with-residuals as flat programs.

  Attributes:
    piece: the piece.
    fwd_bwd: ``(params, acts, aux, cts) -> (param grads, act grads)`` as a program (what XLA's
      cost analysis of the piece describes: the bytes).
    live: the same returning the forward's outputs too, ``-> (outputs, param grads, act
      grads)``: its ops are the work (:func:`jaxpr_work`), those from ``bwd_start`` on the
      backward's workspace.
    fwd_res: ``(params, acts, aux) -> (outputs, residual leaves)`` as a program (the
      forward the runtime runs: its workspace).
    num_outputs: outputs of ``fwd_res`` before its residuals.
    trace_s: seconds spent tracing.
    bwd_start: index of the first op of ``live`` 's backward (the ops before it are the
      forward's, which the runtime runs in an executable of its own); ``None``: not known.
    remat: the rematerialisation mode it was traced in (``"none"``: its backward reads the
      forward's residuals, recomputes nothing).
    positional: ``(shape, bit width)`` of the batch-sized draws a stage computes by position
      (:func:`~harpjax.compiler.profile.pieces.position_draws`): traced as the piece's own
      ``random_bits``, costed as the stage's hash of its rows whenever the stage redraws them
      (more than one microbatch, or data-parallel replicas).
    num_microbatches: B it was traced for (1 when not known).
  """
  piece: pieces_lib.Piece
  fwd_bwd: Program
  fwd_res: Program
  num_outputs: int
  trace_s: float
  live: Program | None = None
  bwd_start: int | None = None
  remat: str = "none"
  positional: frozenset = frozenset()
  num_microbatches: int = 1

  def redrawn(self, dp: int) -> frozenset:
    """:attr:`positional` where a stage on ``dp`` replicas redraws them (B > 1 or dp > 1: a
    single microbatch on one device draws as ``jax.jit`` does)."""
    return self.positional if self.num_microbatches > 1 or dp > 1 else frozenset()


def _flatten(closed) -> Program:
  """Every call-like body JAX lets harpjax inline, inlined."""
  return from_closed_jaxpr(closed, inline=lambda e: e.primitive.name in _compat.CALL_PRIMITIVES)


def _dce(prog: Program, cut: int | None = None):
  """Drops the ops nothing returned depends on (as XLA does: the forward's outputs are not
  results of ``fwd_bwd``, so the ops only they need cost nothing in XLA's statistics, which
  the calibrated factors were fitted against). With ``cut`` (an op index), returns
  ``(program, how many kept ops stood before the cut)``."""
  live = {v for v in prog.outvars if not isinstance(v, Lit)}
  keep = []
  for op in reversed(prog.ops):
    if any(o in live for o in op.outvars) or op.name in _EFFECTS:
      keep.append(op)
      live.update(op.in_ids())
  keep.reverse()
  ops = tuple(dataclasses.replace(op, index=i) for i, op in enumerate(keep))
  out = Program(prog.avals, prog.invars, prog.outvars, ops, prog.num_consts)
  if cut is None:
    return out
  return out, sum(1 for op in keep if op.index < cut)


def _split_fwd_bwd(closed) -> tuple[Program, int | None]:
  """A forward+backward traced with the :data:`_CUT` marker between them, flattened,
  stripped of the marker and of dead ops, and the index of its backward's first op
  (``None`` unless exactly one marker was traced)."""
  flat = _flatten(closed)
  pos = [op.index for op in flat.ops if op.name == _CUT_NAME]
  prog, _ = strip_markers(flat, _CUT_NAME)
  if len(pos) != 1:
    return _dce(prog), None
  return _dce(prog, pos[0])   # ops before the marker keep their index when it is stripped


def trace_piece(piece: pieces_lib.Piece, remat: bool | str = False,
                num_microbatches: int | None = None) -> TracedPiece:
  """Traces a piece's forward+backward (from ``jax.ShapeDtypeStruct`` s; nothing compiled).

  The forward+backward returns the forward's outputs too, so the ops computing them are
  costed (the stage's forward sends them on), those without a cotangent (keys split for later
  layers, :attr:`~harpjax.compiler.profile.pieces.Piece.extra_out_ids`) included. With
  ``remat`` (``"full"`` or ``True``, ``"dots"``) the backward recomputes the forward as the
  runtime's does (:func:`~harpjax.compiler.trace.checkpointed`): the work counted is the
  forward, its recomputation and the backward, the residuals are what the mode keeps (the
  inputs alone under ``"full"``), and the backward's workspace holds the recomputed
  forward's values. With ``num_microbatches`` (B), a batch-sized random draw is the
  microbatch's rows of the full batch's draw, as the stage draws it
  (:func:`~harpjax.compiler.profile.pieces.redraws`): one the stage computes by position
  (threefry keys) is the piece's own draw at the microbatch's shape, costed as the stage's
  hash of its rows (:func:`position_draw_flops`; on a data-parallel mesh each replica's rows,
  :attr:`TracedPiece.positional`); another PRNG's is drawn whole and sliced.
  """
  t0 = time.perf_counter()
  n_out = len(piece.out_ids)
  run = ops_function(piece.ops, piece.param_ids + piece.act_ids + piece.aux_ids,
                     piece.out_ids + piece.extra_out_ids)
  hook = pieces_lib.redraw_hook(piece, num_microbatches, stand_in=True)
  primal = checkpointed(remat)(lambda p, a, aux: run(*p, *a, *aux, hook=hook))

  def live(params, acts, aux, cts):
    # the values later layers read without a cotangent (keys split for them) as its aux
    split = lambda p, a: (lambda o: (tuple(o[:n_out]), tuple(o[n_out:])))(primal(p, a, aux))
    outs, vjp, extra = jax.vjp(split, params, acts, has_aux=True)
    _CUT.bind()   # the backward begins: the runtime runs it in an executable of its own
    return outs, vjp(cts), extra

  fwd_bwd, _ = pieces_lib.make_functions(piece, False, num_microbatches, stand_in=True)
  _, fwd_res = pieces_lib.make_functions(piece, remat, num_microbatches, stand_in=True)
  args = pieces_lib.abstract_inputs(piece)
  fb = _dce(_flatten(jax.make_jaxpr(fwd_bwd)(*args)))
  lv, start = _split_fwd_bwd(jax.make_jaxpr(live)(*args))
  fr = _dce(_flatten(jax.make_jaxpr(fwd_res)(*args[:3])))
  return TracedPiece(piece, fb, fr, len(piece.out_ids), time.perf_counter() - t0, lv, start,
                     remat_mode(remat), pieces_lib.position_draws(piece),
                     int(num_microbatches or 1))


def _input_roles(piece: pieces_lib.Piece, prog: Program, with_cts: bool):
  """``(parameter input ids, batch-split input ids)`` of a traced program of ``piece``."""
  n_p = len(piece.param_ids)
  ids = piece.param_ids + piece.act_ids + piece.aux_ids + (piece.out_ids if with_cts else ())
  inputs = prog.invars[prog.num_consts:]
  params = tuple(inputs[:n_p])
  batch = [inputs[i] for i, v in enumerate(ids) if v in piece.batch_ids]
  return params, batch


class _Sizes:
  """Per-device bytes of a program's values on a ``(dp, tp)`` mesh, and which ops split."""

  def __init__(self, prog: Program, params, batch_inputs, dp: int, tp: int, grads=(),
               positional=frozenset()):
    self.prog, self.dp, self.tp = prog, dp, tp
    self.positional = positional
    self.batch: set = set()
    self.batch_ops: set = set()
    if dp > 1:
      dep = prog.dependents(batch_inputs)
      param_shapes = {tuple(prog.avals[p].shape) for p in params}
      sized = lambda v: (tuple(prog.avals[v].shape) not in param_shapes
                         and len(prog.avals[v].shape) > 0)
      self.batch = {v for v in dep if sized(v)}
      self.batch_ops = {op.index for op in prog.ops if any(o in dep for o in op.outvars)}
      # A value computed from constants alone but shaped like a batch-sized one (a causal
      # mask, zeros broadcast to the batch) is as large as the replica's batch makes it.
      shapes = {tuple(prog.avals[v].shape) for v in self.batch}
      variable = prog.dependents(prog.invars)
      for op in prog.ops:
        if not any(v in variable for v in op.in_ids()):
          for o in op.outvars:
            if o >= 0 and tuple(prog.avals[o].shape) in shapes and sized(o):
              self.batch.add(o)
              self.batch_ops.add(op.index)
      self._split_position_draws(prog, sized)
    self.split: set = set()
    self.row_ops: tuple = ()
    self.partial_ops: set = set()
    if tp > 1:
      plan = sharding.tp_plan(prog, prog.ops, params, tp)
      self.split = set(plan.act_dims) | set(plan.param_dims)
      self._propagate(prog, plan, params, grads)
      for op in prog.ops:   # views of split values (a transposed weight) are split too
        outs = [o for o in op.outvars if o >= 0]
        if (op.name in _MOVES and len(outs) == 1 and op.invars
            and not isinstance(op.invars[0], Lit) and op.invars[0] in self.split):
          self.split.add(outs[0])
      self.row_ops = plan.row_ops
      self._split_draws(prog)
    row = set(self.row_ops) | self.partial_ops
    self.split_ops = {op.index for op in prog.ops
                      if op.index in row or any(o in self.split for o in op.outvars)}

  def _propagate(self, prog: Program, plan, params, grads) -> None:
    """What XLA's sharding propagation splits besides the rules' choices (read off the
    compiled stages' HLO): a parameter's gradient is split like the parameter (the backward
    adds it into an accumulator sharded so), and so is whatever computes it (the weight
    gradient's matmul, the bias gradient's reduction, the dropout mask and the draw behind it,
    the cotangent each device slices locally); the forward is split from there on (an
    elementwise op, view or reduction of a split value, a matmul of one split on a dimension
    it keeps). Walks back from the gradients, then forward from every split value; a value
    keeps the first dimension it is given, the program's inputs keep theirs."""
    tp = self.tp
    dims = dict(plan.act_dims)
    dims.update((p, d) for p, d in plan.param_dims.items())
    inputs = set(prog.invars)
    made = {o: op for op in prog.ops for o in op.outvars if o >= 0}
    todo = []
    for p, g in zip(params, grads):
      if p in plan.param_dims and not isinstance(g, Lit) and g not in inputs:
        todo.append((g, plan.param_dims[p]))
    while todo:   # backward: the producers of split gradients
      v, d = todo.pop()
      if v in dims or v in inputs or not self._fits(v, d):
        continue
      dims[v] = d
      if v in made:
        for r, m in _dim_maps(made[v], prog):
          back = {o: i for i, o in m.items()}
          if d in back and not isinstance(r, Lit) and r not in dims:
            todo.append((r, back[d]))
    for op in prog.ops:   # forward: what split values compute
      for r, m in _dim_maps(op, prog):
        if isinstance(r, Lit) or r not in dims or dims[r] not in m:
          continue
        for o in op.outvars:
          if o >= 0 and o not in dims and self._fits(o, m[dims[r]]):
            dims[o] = m[dims[r]]
        break
      if op.name == "dot_general":   # contracting a split dimension: partial sums
        (lc, rc), _ = op.params["dimension_numbers"]
        if any(not isinstance(r, Lit) and dims.get(r, -1) in {int(c) for c in cs}
               for r, cs in zip(op.invars, (lc, rc))):
          self.partial_ops.add(op.index)
    self.split |= set(dims)

  def _fits(self, v, d) -> bool:
    shape = self.prog.avals[v].shape
    return 0 <= d < len(shape) and shape[d] % self.tp == 0 and shape[d] >= self.tp

  def _split_position_draws(self, prog: Program, sized) -> None:
    """A batch-sized draw computed by position is each replica's rows alone (a replica's
    ``shard_map`` program hashes its own counters; in one program XLA's sharding propagation
    splits the counters' iota with the value the draw masks), and so is what is computed
    from it and constants alone (the bits made floats, the mask)."""
    if not self.positional:
      return
    drawn: set = set()
    variable = prog.dependents([v for v in prog.invars
                                if _dtype(prog.avals[v]) not in (np.dtype(object),
                                                                 np.dtype(np.uint32))])
    for op in prog.ops:
      outs = [o for o in op.outvars if o >= 0]
      if op.name == "random_bits":
        if (tuple(int(d) for d in op.params["shape"]), int(op.params["bit_width"])) \
            not in self.positional:
          continue
      elif not any(v in drawn for v in op.in_ids()) or any(
          v in variable and v not in drawn for v in op.in_ids()):
        continue
      drawn.update(outs)
      for o in outs:
        if sized(o):
          self.batch.add(o)
      self.batch_ops.add(op.index)

  def _split_draws(self, prog: Program) -> None:
    """Random numbers drawn for a split value are split like it: a partitionable draw
    (threefry's counters are an iota) is partitioned by XLA's sharding propagation from the
    value it masks back to the draw, each device hashing its own part."""
    key_inputs = {v for v in prog.invars   # typed PRNG keys, or their raw uint32 data
                  if _dtype(prog.avals[v]) in (np.dtype(object), np.dtype(np.uint32))}
    variable = prog.dependents([v for v in prog.invars if v not in key_inputs])
    drawn: set = set()
    for op in prog.ops:
      ins = tuple(op.in_ids())
      if any(v in variable for v in ins):
        continue
      if op.name in regen.RANDOM_PRIMITIVES or any(v in drawn for v in ins):
        drawn.update(o for o in op.outvars if o >= 0)
    for op in reversed(prog.ops):
      outs = [o for o in op.outvars if o >= 0 and o in self.split]
      if not outs:
        continue
      rank = len(prog.avals[outs[0]].shape)
      for v in op.in_ids():
        if v in drawn and len(prog.avals[v].shape) == rank:
          self.split.add(v)

  def nbytes(self, v) -> float:
    if isinstance(v, Lit):
      return 0.0
    b = float(self.prog.nbytes(v))
    if v in self.batch:
      b /= self.dp
    if v in self.split:
      b /= self.tp
    return b

  def op_scale(self, op) -> float:
    s = 1.0
    if op.index in self.batch_ops:
      s /= self.dp
    if op.index in self.split_ops:
      s /= self.tp
    return s


_KEEP_DIMS = frozenset({"convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                        "stop_gradient", "optimization_barrier", "reduce_precision",
                        "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


def _dim_maps(op, prog: Program) -> list:
  """``[(operand, {operand dim: result dim})]``: which dimensions of a result each operand's
  dimensions become, for the ops a split passes through (elementwise ops, views, reductions,
  a matmul's kept dimensions); empty for the others."""
  outs = [o for o in op.outvars if o >= 0]
  if not outs or not op.invars:
    return []
  out = tuple(prog.avals[outs[0]].shape)
  shape = lambda r: tuple(np.shape(r.value)) if isinstance(r, Lit) else tuple(
      prog.avals[r].shape)
  name = op.name
  if name in primitives.ELEMENTWISE:
    return [(r, {d: d for d in range(len(out)) if shape(r)[d] == out[d]})
            for r in op.invars if len(shape(r)) == len(out)]
  if name in _KEEP_DIMS:
    s = shape(op.invars[0])
    return ([(op.invars[0], {d: d for d in range(len(out)) if s[d] == out[d]})]
            if len(s) == len(out) else [])
  if name == "transpose":
    return [(op.invars[0], {int(p): j for j, p in enumerate(op.params["permutation"])})]
  if name == "broadcast_in_dim":
    s = shape(op.invars[0])
    return [(op.invars[0], {i: int(j) for i, j in enumerate(op.params["broadcast_dimensions"])
                            if s[i] == out[int(j)]})]
  if name in ("reshape", "squeeze", "expand_dims"):
    s = shape(op.invars[0])   # a dimension whose elements before it are the same
    pre_in, pre_out = np.cumprod((1,) + s), np.cumprod((1,) + out)
    m = {}
    for d, size in enumerate(s):
      hit = np.flatnonzero((pre_out[:-1] == pre_in[d]) & (np.array(out + (0,))[:-1] == size))
      if size > 1 and len(hit):
        m[d] = int(hit[0])
    return [(op.invars[0], m)]
  if name in primitives.REDUCTIONS and "axes" in op.params:
    axes = {int(a) for a in op.params["axes"]}
    kept = [d for d in range(len(shape(op.invars[0]))) if d not in axes]
    return [(op.invars[0], {d: j for j, d in enumerate(kept)})]
  if name == "dot_general":
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    ls, rs = shape(op.invars[0]), shape(op.invars[1])
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    nb = len(lb)
    lm = {int(d): j for j, d in enumerate(lb)}
    lm.update({d: nb + j for j, d in enumerate(lfree)})
    rm = {int(d): j for j, d in enumerate(rb)}
    rm.update({d: nb + len(lfree) + j for j, d in enumerate(rfree)})
    return [(op.invars[0], lm), (op.invars[1], rm)]
  return []


def _read(prog: Program) -> dict:
  """Value -> the values a consumer of it actually reads: the operands behind
  :data:`_FOLDED` ops, which are computed inside their consumers."""
  src: dict = {}
  for op in prog.ops:
    if op.name in _FOLDED:
      got = [u for v in op.in_ids() for u in src.get(v, (v,))]
      for o in op.outvars:
        if o >= 0:
          src[o] = tuple(dict.fromkeys(got))
  return src


def _bytes_accessed(prog: Program, sizes: _Sizes, read: dict) -> float:
  """Bytes every op reads and writes, :data:`_FOLDED` ops computed inside their consumers
  (results the program returns are written all the same)."""
  total = 0.0
  for op in prog.ops:
    if op.name in _FOLDED:
      continue
    ins = dict.fromkeys(u for v in op.in_ids() for u in read.get(v, (v,)))
    total += sum(sizes.nbytes(v) for v in ins)
    total += sum(sizes.nbytes(o) for o in op.outvars if o >= 0)
  total += sum(sizes.nbytes(v) for v in set(prog.outvars) if not isinstance(v, Lit)
               and v in read)
  return total


def _fused(prog: Program, read: dict, shared_expensive: bool = False) -> tuple[dict, set]:
  """What XLA's fusion leaves unwritten, for the workspace: ``(read, fused)`` with ``fused``
  the elementwise ops computed inside their consumers (every op reading their result is an
  elementwise op or a reduction, :data:`~harpjax.compiler.trace.primitives.FUSES_PRODUCERS`,
  and the program does not return it) and ``read`` as :func:`_read`'s, those ops' operands
  read in their stead. Only the memory statistics see this: the bytes accessed stay those
  XLA:CPU's cost analysis counts, which the calibrated factors were fitted against. With
  ``shared_expensive``, an expensive op (:data:`~harpjax.compiler.trace.primitives.EXPENSIVE`)
  that several ops read is written once rather than computed inside each (XLA's fusion does
  not duplicate them: a rematerialised GELU's ``tanh``, which its forward and its derivative
  read, is a buffer of XLA:CPU's recomputing backward)."""
  outputs, readers = _readers(prog, read)
  fused = set()
  for op in prog.ops:
    outs = [o for o in op.outvars if o >= 0]
    if (op.name in primitives.ELEMENTWISE and len(outs) == 1 and outs[0] not in outputs
        and outs[0] in readers
        and all(r.name in primitives.FUSES_PRODUCERS for r in readers[outs[0]])
        and not (shared_expensive and op.name in primitives.EXPENSIVE
                 and len(readers[outs[0]]) > 1)):
      fused.add(op.index)
  src: dict = {}
  for op in prog.ops:
    if op.name in _FOLDED or op.index in fused:
      got = [u for v in op.in_ids() for u in src.get(v, (v,))]
      for o in op.outvars:
        if o >= 0:
          src[o] = tuple(dict.fromkeys(got))
  return src, fused


_POSITION_FITS = primitives.XlaFits("position_draw")


def position_draw_flops(key_aval, params: dict, parts: float = 1.0) -> float:
  """FLOPs of a batch-sized draw a stage computes by position, as XLA's cost analysis counts
  them: :func:`~harpjax.compiler.trace.regen.redraw_slice` hashing the slice of shape
  ``params['shape']`` (the microbatch's rows) of a draw twice as large, at a traced offset.
  Its counters are 32-bit multiply-adds per dimension where ``random_bits`` ' are 64-bit
  (XLA:CPU: 42 FLOPs per element against 47), so it is read off XLA apart, like
  :func:`~harpjax.compiler.trace.primitives.random_bits_flops`: compiled at two small shapes
  of the draw's rank (per key type, bit width, rank and backend; memoised).

  Args:
    key_aval: the abstract key operand.
    params: the piece's draw's parameters (``shape``: the slice's, ``bit_width``).
    parts: the slice is split into this many equal parts, one per device (``1 / parts`` of
      the elements each, the key set up on each).
  """
  shape = tuple(int(d) for d in params.get("shape", ()))
  bits = int(params.get("bit_width", 32))
  n = float(np.prod(shape, dtype=np.float64)) if shape else 1.0
  key = (jax.default_backend(), str(getattr(key_aval, "dtype", "")), bits, len(shape))
  fit = _POSITION_FITS.get(key, lambda: _fit_position_draw(key_aval, bits, len(shape)))
  per, fixed = fit
  return float(primitives.aval_size(key_aval) * (per * n / parts + fixed))


def _fit_position_draw(key_aval, bits: int, rank: int) -> tuple[float, float]:
  """``(FLOPs per element, fixed FLOPs)`` of a draw by position of ``rank`` dimensions: the
  first dimension's half of a draw, at slices of 64 and 128 elements."""
  if not rank:
    return 0.0, primitives.random_bits_flops(key_aval, {"shape": (), "bit_width": bits})
  dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bits]
  key = jax.ShapeDtypeStruct((), key_aval.dtype)

  def flops(local):
    full = (2 * local[0],) + local[1:]
    eqn = jax.make_jaxpr(lambda k: jax.random.bits(k, full, dtype))(key).jaxpr.eqns[-1]
    site = regen.Redraw(0, dict(eqn.params))
    aval = eqn.outvars[0].aval.update(shape=local)
    fn = jax.jit(lambda k, m: regen.redraw_slice(eqn.primitive, site, [k], [aval], m)[0])
    ca = fn.lower(key, jax.ShapeDtypeStruct((), np.int32)).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0))
  small = (2,) * (rank - 1) + (64,)
  large = (2,) * (rank - 1) + (128,)
  try:
    a, b = flops(small), flops(large)
  except Exception as e:  # noqa: BLE001 -- costed as JAX's own draw
    log.info("a draw by position of %s cannot be costed by XLA alone (%s)",
             getattr(key_aval, "dtype", "?"), e)
    return (primitives.random_bits_flops(key_aval, {"shape": small, "bit_width": bits})
            / float(np.prod(small)), 0.0)
  n_small, n_large = int(np.prod(small)), int(np.prod(large))
  per = (b - a) / (n_large - n_small)
  return per, a - per * n_small


_DRAW_TEMPS: dict = {}


def random_bits_temp_bytes(key_aval, params: dict, out_bytes: float) -> float:
  """Temporary bytes XLA allocates while one ``random_bits`` draw of ``out_bytes`` (its result,
  on one device) runs: the hash's own buffers (the counters, the state it carries through its
  rounds), as XLA's ``memory_analysis()`` counts them on the default backend. Like
  :func:`~harpjax.compiler.trace.primitives.random_bits_flops`, read off XLA once per key
  type, bit width and backend from two draws alone (affine in the elements; XLA:CPU: three
  times the draw's bytes), memoised; ``0`` if the draw cannot be compiled alone."""
  bits = int(params.get("bit_width", 32))
  key = (jax.default_backend(), str(getattr(key_aval, "dtype", "")), bits,
         bool(jax.config.jax_threefry_partitionable))
  fit = _DRAW_TEMPS.get(key)
  if fit is None:
    fit = _DRAW_TEMPS[key] = _fit_draw_temp(key_aval, bits)
  per, fixed = fit
  return max(per * float(out_bytes) + fixed, 0.0) if out_bytes > 0 else 0.0


def _fit_draw_temp(key_aval, bits: int) -> tuple[float, float]:
  """``(temporary bytes per byte drawn, fixed bytes)`` of a ``random_bits`` draw, from XLA's
  memory analysis of two draws of 4096 and 8192 elements."""
  dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}.get(bits)
  try:
    key = jax.ShapeDtypeStruct((), key_aval.dtype)

    def temp(n):
      fn = jax.jit(lambda k: jax.random.bits(k, (n,), dtype))
      return float(fn.lower(key).compile().memory_analysis().temp_size_in_bytes)
    a, b = temp(4096), temp(8192)
  except Exception:  # noqa: BLE001 -- an unusual PRNG: no workspace of its own
    return 0.0, 0.0
  size = np.dtype(dtype).itemsize
  per = (b - a) / (4096 * size)
  return per, a - per * 4096 * size


def _scatters_in_place(prog: Program, read: dict) -> set:
  """Indices of the scatter-adds into zeros whose every reader adds them to another value:
  XLA rewrites ``x + scatter(0, i, u)`` as ``scatter(x, i, u)``, which writes into ``x``'s
  buffer (the gradient of a cross-entropy's gather of the labels' logits: no buffer of its
  own beside the sum, read off XLA:CPU's buffer assignment of the head's backward)."""
  _, readers = _readers(prog, read)
  zeros = {o for op in prog.ops if op.name == "broadcast_in_dim" and op.invars
           and isinstance(op.invars[0], Lit) and np.all(np.asarray(op.invars[0].value) == 0)
           for o in op.outvars if o >= 0}
  out = set()
  for op in prog.ops:
    outs = [o for o in op.outvars if o >= 0]
    if (op.name in _SCATTER_ADDS and len(outs) == 1 and op.invars
        and (isinstance(op.invars[0], Lit) or op.invars[0] in zeros)
        and readers.get(outs[0])
        and all(r.name in ("add", "add_any") for r in readers[outs[0]])):
      out.add(op.index)
  return out


def _peak_live(prog: Program, sizes: _Sizes, read: dict, start: int = 0) -> float:
  """Peak bytes of written results live at once (inputs and outputs excluded; :func:`_fused`
  ops write nothing; a matmul's operands XLA reorders are copied,
  :func:`~harpjax.compiler.trace.primitives.dot_operand_copies`), counting the results of the
  ops from ``start`` on only (the values of earlier ops are the inputs of the executable that
  runs them). A backward (``start > 0``) that draws again what its recomputed forward drew
  draws first: the draw depends on the key alone, and XLA:CPU schedules it at the start
  (read off the buffer assignment of the GPT's and BERT's rematerialised layers), its loop's
  state (both halves: twice the draw's bytes) held from there to the draw's last reader, its
  counters (the rest of its workspace) while it runs."""
  read, fused = _fused(prog, read)
  hoisted = lambda op: start > 0 and op.name == "random_bits"
  at = lambda op: start if hoisted(op) else op.index
  outputs = {u for v in prog.outvars if not isinstance(v, Lit) for u in read.get(v, (v,))}
  last = {}
  for op in prog.ops:
    if op.name in _FOLDED or op.index in fused:
      continue
    for v in op.in_ids():
      for u in read.get(v, (v,)):
        last[u] = op.index
  if start > 0:   # a hoisted draw's state lives as long as what slices and converts it
    made = {o: op for op in prog.ops for o in op.outvars if o >= 0}
    for op in reversed(prog.ops[start:]):
      ins = list(op.in_ids())
      if len(ins) == 1 and (op.name in _SLICES or op.name in _FOLDED
                            or op.name in _DRAW_TO_FLOAT_OPS):
        src = made.get(ins[0])
        if src is not None and src.index >= start and (
            src.name == "random_bits" or src.name in _SLICES or src.name in _FOLDED
            or src.name in _DRAW_TO_FLOAT_OPS):
          for o in op.outvars:
            if o in last:
              last[ins[0]] = max(last.get(ins[0], -1), last[o])
  in_place = _scatters_in_place(prog, read)
  delta = [0.0] * (len(prog.ops) + 1)
  for op in prog.ops[start:]:
    if op.name in _FOLDED or op.index in fused or op.index in in_place:
      continue
    for v in op.outvars:
      if v >= 0 and v not in outputs and v in last:
        held = sizes.nbytes(v) * (2 if hoisted(op) else 1)
        delta[at(op)] += held
        delta[last[v] + 1] -= held
  # A random draw's hash works in buffers of its own while it runs (XLA:CPU's threefry loop
  # carries its counters and the two halves of its state: three times the draw's bytes).
  for op in prog.ops[start:]:
    if op.name == "random_bits":
      outs = [o for o in op.outvars if o >= 0]
      if outs and not isinstance(op.invars[0], Lit):
        ws = random_bits_temp_bytes(prog.avals[op.invars[0]], op.params,
                                    sizes.nbytes(outs[0]))
        if hoisted(op) and outs[0] in last and outs[0] not in outputs:
          ws = max(ws - sizes.nbytes(outs[0]), 0.0)   # its second half is held above
        delta[at(op)] += ws
        delta[at(op) + 1] -= ws
  # Operands a matmul reads in another order are copied as soon as they exist (XLA schedules
  # the copy right after what it copies; an input's at the start), kept until the last
  # matmul reading them.
  made = {o: op.index for op in prog.ops for o in op.outvars if o >= 0}
  copies: dict = {}
  for op in prog.ops[start:]:
    if op.name != "dot_general":
      continue
    ins = [_lit_aval(r) if isinstance(r, Lit) else prog.avals[r] for r in op.invars]
    for r, copied in zip(op.invars, primitives.dot_operand_copies(op.params, ins)):
      if copied and not isinstance(r, Lit):
        ready = max([made.get(u, -1) + 1 for u in read.get(r, (r,))] + [start])
        first, _ = copies.get(r, (ready, op.index))
        copies[r] = (min(first, ready), op.index)
  for r, (first, end) in copies.items():
    delta[first] += sizes.nbytes(r)
    delta[end + 1] -= sizes.nbytes(r)
  peak = live = 0.0
  for d in delta:
    live += d
    peak = max(peak, live)
  return peak


def jaxpr_stats(traced: TracedPiece, mesh_shape: tuple[int, int]) -> pieces_lib.XlaStats:
  """Per-device statistics of a traced piece on a ``(dp, tp)`` logical mesh (see the module
  docstring), in the form :func:`~harpjax.compiler.profile.pieces.xla_stats` returns."""
  return jaxpr_costs(traced, mesh_shape)[0]


def jaxpr_work(traced: TracedPiece, mesh_shape: tuple[int, int]) -> Work:
  """The per-device :class:`~harpjax.compiler.profile.calibration.Work` of a traced piece on a
  ``(dp, tp)`` logical mesh: what the time model reads (see the module docstring)."""
  return jaxpr_costs(traced, mesh_shape)[1]


def jaxpr_costs(traced: TracedPiece, mesh_shape: tuple[int, int]
                ) -> tuple[pieces_lib.XlaStats, Work]:
  """:func:`jaxpr_stats` and :func:`jaxpr_work` of a traced piece, in one pass."""
  dp, tp = mesh_shape
  piece = traced.piece
  fb = traced.fwd_bwd
  params, batch = _input_roles(piece, fb, with_cts=True)
  n_p = len(piece.param_ids)
  sizes = _Sizes(fb, params, batch, dp, tp, fb.outvars[:n_p], traced.redrawn(dp))
  read = _read(fb)
  lv = traced.live if traced.live is not None else fb
  if lv is fb:
    lv_sizes, lv_read = sizes, read
  else:
    lv_sizes, lv_read = _live_sizes(traced, dp, tp), _read(lv)
  work = _work(lv, lv_sizes, lv_read)
  nbytes = _bytes_accessed(fb, sizes, read)
  fr_sizes = _fwd_sizes(traced, dp, tp)
  if traced.bwd_start is None or lv is fb:   # one program: its workspace
    temp = fwd_temp = bwd_temp = _peak_live(fb, sizes, read)
  else:   # the forward and the backward run apart: each its own workspace
    fwd_temp = _peak_live(traced.fwd_res, fr_sizes, _read(traced.fwd_res))
    bwd_temp = _peak_live(lv, lv_sizes, lv_read, traced.bwd_start)
    temp = max(fwd_temp, bwd_temp)
  colls = {}
  if sizes.row_ops:
    out_bytes = sum(sizes.nbytes(o) * sizes.tp if o in sizes.split else sizes.nbytes(o)
                    for i in sizes.row_ops for o in fb.ops[i].outvars if o >= 0)
    colls["all-reduce"] = [out_bytes, len(sizes.row_ops)]
  residual = _residual_bytes(traced, fr_sizes)
  draws = _draw_bytes(traced.fwd_res, fr_sizes)
  held = 0.0
  if traced.remat != "none" and traced.bwd_start is not None and lv is not fb:
    held = _recompute_held_bytes(lv, lv_sizes, lv_read, traced.bwd_start,
                                 lv.invars[len(lv.invars) - len(piece.out_ids):])
  specs = sharding.param_specs(piece.program, piece.ops, piece.param_ids, tp)
  local_bytes, local_n = 0.0, 0.0
  for v in piece.param_ids:
    aval = piece.program.avals[v]
    div = tp if specs[v] != sharding.P() else 1
    local_bytes += primitives.aval_nbytes(aval) / div
    local_n += primitives.aval_size(aval) / div
  stats = pieces_lib.XlaStats(flops=work.flops, bytes_accessed=nbytes, transcendentals=0.0,
                              collective_bytes=colls, temp_bytes=temp, residual_bytes=residual,
                              param_bytes=local_bytes, num_params=local_n,
                              compile_s=traced.trace_s, fwd_temp_bytes=fwd_temp,
                              bwd_temp_bytes=bwd_temp, draw_bytes=draws[0],
                              draw_max_bytes=draws[1], remat_held_bytes=held)
  return stats, work


def _live_sizes(traced: TracedPiece, dp: int, tp: int) -> _Sizes:
  """:class:`_Sizes` of the forward+backward that returns the outputs (``traced.live``)."""
  lv, piece = traced.live, traced.piece
  params, batch = _input_roles(piece, lv, with_cts=True)
  n_p = len(piece.param_ids)
  grads = lv.outvars[traced.num_outputs:traced.num_outputs + n_p]
  return _Sizes(lv, params, batch, dp, tp, grads, traced.redrawn(dp))


def outputs_recompute_ops(traced: TracedPiece) -> set:
  """Indices of the ops of ``traced.live`` 's forward that a stage rematerialising as a whole
  computes again in its backward when this layer is not the stage's last, and that the
  layer's own rematerialised backward does not: what makes the layer's outputs (the next
  layer's recomputation reads them) from what that backward has (the inputs, the residuals
  its mode saves, the values it recomputes for itself). Empty without rematerialisation.

  The GPT block's MLP ends with its second matmul, dropout and the residual add: its own
  backward needs none of them (the cotangent of the sum is that of the matmul's output), so
  it recomputes only up to the first matmul's activation; the stage's backward recomputes
  them all, since the next block's layer norm reads the sum. Under ``"dots"`` the matmuls'
  outputs are saved (:func:`~harpjax.compiler.trace.checkpointed`'s policy), so only what
  follows them is computed again.

  A value the backward recomputes is found by structure: an op of the backward that depends
  on no cotangent and does what a forward op does (same primitive and parameters) to the same
  operands (the same inputs, or values found so).
  """
  lv, start = traced.live, traced.bwd_start
  if traced.remat == "none" or lv is None or start is None:
    return set()
  piece = traced.piece
  n_out = traced.num_outputs
  n_extra = len(piece.extra_out_ids)
  roots = list(lv.outvars[:n_out]) + (list(lv.outvars[len(lv.outvars) - n_extra:])
                                       if n_extra else [])
  cts = [v for v in lv.invars[len(lv.invars) - len(piece.out_ids):] if not isinstance(v, Lit)]
  ct_dep = lv.dependents(cts)
  ids: dict = {}     # structural key -> small int
  key_of: dict = {}  # value id -> its key's int
  made: dict = {}    # forward value id -> its op
  recomputed: set = set()
  saved: set = set()
  for op in lv.ops:
    operands = tuple(("lit", repr(np.asarray(r.value).tolist())) if isinstance(r, Lit)
                     else key_of.get(r, ("in", r)) for r in op.invars)
    k = ids.setdefault((op.name, repr(sorted((n, str(v)) for n, v in op.params.items())),
                        operands), len(ids))
    for pos, o in enumerate(op.outvars):
      if o < 0:
        continue
      key_of[o] = ids.setdefault((k, pos), len(ids))
      if op.index < start:
        made[o] = op
      elif o not in ct_dep:
        recomputed.add(key_of[o])
    if op.index >= start:
      saved.update(v for v in op.in_ids() if v in made)
  dots = traced.remat == "dots"
  extra: set = set()
  todo = [v for v in roots if not isinstance(v, Lit)]
  seen: set = set()
  while todo:
    v = todo.pop()
    if v in seen or v not in made or v in saved or key_of[v] in recomputed:
      continue
    seen.add(v)
    op = made[v]
    if dots and op.name in _SAVED_BY_DOTS:
      continue
    extra.add(op.index)
    todo.extend(op.in_ids())
  return extra


# What ``jax.checkpoint_policies.dots_saveable`` saves (the ``"dots"`` mode).
_SAVED_BY_DOTS = frozenset({"dot_general", "conv_general_dilated"})


def outputs_recompute_work(traced: TracedPiece, mesh_shape: tuple[int, int]) -> Work:
  """The per-device :class:`~harpjax.compiler.profile.calibration.Work` of
  :func:`outputs_recompute_ops` on a ``(dp, tp)`` logical mesh, each op counted as in the
  layer's own work (:func:`jaxpr_work`): what a stage rematerialising layers ``i..j`` as a
  whole adds to the sum of its layers' work for each of ``i..j-1``."""
  ops = outputs_recompute_ops(traced)
  if not ops:
    return Work()
  dp, tp = mesh_shape
  lv = traced.live
  return _work(lv, _live_sizes(traced, dp, tp), _read(lv), only=ops)


def live_ops_work(traced: TracedPiece, mesh_shape: tuple[int, int], ops) -> Work:
  """The per-device :class:`~harpjax.compiler.profile.calibration.Work` of the ops ``ops``
  (indices into ``traced.live``) on a ``(dp, tp)`` logical mesh, each counted as in the
  layer's own work (:func:`jaxpr_work`): a part of the layer's work, never more than it (the
  experts of a routed layer, :mod:`~harpjax.compiler.profile.routed_split`)."""
  dp, tp = mesh_shape
  lv = traced.live if traced.live is not None else traced.fwd_bwd
  sizes = _live_sizes(traced, dp, tp) if traced.live is not None else None
  if sizes is None:
    params, batch = _input_roles(traced.piece, lv, with_cts=True)
    sizes = _Sizes(lv, params, batch, dp, tp, lv.outvars[:len(traced.piece.param_ids)])
  return _work(lv, sizes, _read(lv), only=set(ops))


def _draw_bytes(prog: Program, sizes: _Sizes) -> tuple[float, float]:
  """``(sum, largest)`` per-device bytes of the random draws a forward makes (the
  ``random_bits`` results), which
  :func:`~harpjax.compiler.profile.memory.stage_draw_workspace_bytes` adds up over a stage."""
  each = [sizes.nbytes(o) for op in prog.ops if op.name == "random_bits"
          for o in op.outvars[:1] if o >= 0]
  return float(sum(each)), float(max(each, default=0.0))


def _recompute_held_bytes(prog: Program, sizes: _Sizes, read: dict, start: int,
                          cts) -> float:
  """Per-device bytes of the values a rematerialising backward recomputes (its ops from
  ``start`` that do not depend on the cotangents ``cts``) and keeps for the ops that do: the
  written ones (:func:`_fused` ops compute inside their readers, and so do the views; an
  expensive op read several times is written), read by an op of the backward proper. A
  random draw read there through the ops that slice and convert it (computed inside its
  readers) is held whole, both halves of the hash's state (twice the draw's bytes), as
  XLA:CPU holds a draw's loop results until their last reader. In a stage of several layers
  that rematerialises as a whole, these are what an earlier layer holds while the later
  layers' backward runs."""
  read, fused = _fused(prog, read, shared_expensive=True)
  ct_dep = prog.dependents([v for v in cts if not isinstance(v, Lit)])
  made = {o: op for op in prog.ops for o in op.outvars if o >= 0}
  recomputed = {o for op in prog.ops[start:] for o in op.outvars
                if o >= 0 and o not in ct_dep}
  kept = set()
  for op in prog.ops[start:]:
    if op.name in _FOLDED or op.index in fused or not any(o in ct_dep for o in op.outvars):
      continue
    for v in op.in_ids():
      kept.update(u for u in read.get(v, (v,)) if u in recomputed)

  def draw_of(u):   # the draw a value merely slices or converts, or None
    while u in made:
      op = made[u]
      if op.name == "random_bits":
        return u
      ins = list(op.in_ids())
      if len(ins) != 1 or not (op.name in _SLICES or op.name in _FOLDED
                               or op.name in _DRAW_TO_FLOAT_OPS):
        return None
      u = ins[0]
    return None
  total, draws = 0.0, set()
  for u in kept:
    d = draw_of(u)
    if d is not None:
      if d not in draws:
        draws.add(d)
        total += 2.0 * sizes.nbytes(d)
    elif made[u].name not in _FOLDED and made[u].index not in fused:
      total += sizes.nbytes(u)
  return float(total)


# What turns a draw's bits into floats: computed inside the draw's readers (the memory
# model's; the FLOPs count's own set of a draw's fused steps is :data:`_BIT_OPS`).
_DRAW_TO_FLOAT_OPS = frozenset({"shift_right_logical", "shift_left", "or", "and",
                                "bitcast_convert_type", "convert_element_type"})


_SCATTER_ADDS = frozenset({"scatter-add", "scatter_add"})


def accumulated_params(traced: TracedPiece, mesh_shape: tuple[int, int]) -> tuple[float, float]:
  """``(elements, bytes)`` per device of the parameters whose gradient the stage's backward
  adds into its accumulator with an add of its own: all but those whose gradient a
  scatter-add produces (an embedding table's), which XLA scatters into the donated
  accumulator directly (``acc + scatter(0, i, u)`` is ``scatter(acc, i, u)``). A slice of a
  stacked parameter (a layer of ``nn.scan``) counts the whole stacked parameter: the stage's
  accumulator is the stacked parameter's, and XLA pads each layer's gradient of its slice to
  it and adds it whole."""
  piece, fb = traced.piece, traced.fwd_bwd
  prog = piece.program
  made_in = {o: op for op in prog.ops for o in op.outvars if o >= 0}
  invars = set(prog.invars)

  def stacked(v):   # the whole parameter a slice of one views, or v itself
    while v not in invars and v in made_in and made_in[v].invars and \
        not isinstance(made_in[v].invars[0], Lit) and primitives.is_view(made_in[v].name):
      v = made_in[v].invars[0]
    return v if v in invars else None
  tp = mesh_shape[1]
  made = {o: op for op in fb.ops for o in op.outvars if o >= 0}
  folded = _read(fb)
  n_p = len(piece.param_ids)
  grads = fb.outvars[:n_p]
  specs = sharding.param_specs(piece.program, piece.ops, piece.param_ids, tp)
  n = nbytes = 0.0
  for v, g in zip(piece.param_ids, grads):
    srcs = (g,) if isinstance(g, Lit) else folded.get(g, (g,))
    if any(not isinstance(u, Lit) and u in made and made[u].name in _SCATTER_ADDS
           for u in srcs):
      continue
    aval = prog.avals[v]
    div = tp if specs[v] != sharding.P() else 1
    root = stacked(v)
    whole = 1.0 if root is None else primitives.aval_size(prog.avals[root]) / max(
        primitives.aval_size(aval), 1)
    n += whole * primitives.aval_size(aval) / div
    nbytes += whole * primitives.aval_nbytes(aval) / div
  return n, nbytes


def _op_flops(prog: Program, op) -> float:
  ins = [_lit_aval(r) if isinstance(r, Lit) else prog.avals[r] for r in op.invars]
  outs = [prog.avals[o] if o >= 0 else _lit_aval(Lit(0.0)) for o in op.outvars]
  return primitives.eqn_flops(op.name, op.params, ins, outs)


# Operations on PRNG keys: tens of FLOPs per key (a threefry hash), no kernel of their own.
_KEY_OPS = frozenset({"random_fold_in", "random_split"})
# Data movement XLA computes inside its consumers like an elementwise op (a slice of a draw).
_SLICES = frozenset({"slice", "dynamic_slice"})
# A random draw, whose last step (threefry's final xor) XLA computes in each consumer's
# fusion, and a reinterpretation of bits (elementwise, in the same fusions).
_BIT_OPS = frozenset({"random_bits", "bitcast_convert_type"})
# Arithmetic XLA's algebraic simplifier removes when an operand is a constant 1 (``x * 1``,
# ``x / 1``) or 0 (``x + 0``, ``x - 0``): position of that operand, ``None`` for either.
_IDENTITY_OF = {"mul": (1.0, None), "div": (1.0, 1), "add": (0.0, None),
                "add_any": (0.0, None), "sub": (0.0, 1)}
# Ops that carry a constant's value to their result unchanged (every element alike).
_CARRY_CONST = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
                          "expand_dims", "copy", "copy_p"})
_CONST_FN = {"add": np.add, "add_any": np.add, "sub": np.subtract, "mul": np.multiply,
             "div": np.divide, "max": np.maximum, "min": np.minimum, "neg": np.negative}


def _constants(prog: Program) -> tuple[dict, set]:
  """``(value -> the number its every element is, constant arithmetic folded away)``: the
  values made from literals by broadcasts, conversions, reshapes and arithmetic."""
  const: dict = {}
  folded: set = set()
  for op in prog.ops:
    outs = [o for o in op.outvars if o >= 0]
    if len(outs) != 1 or not op.invars:
      continue
    vals = [_const_value(r, const) for r in op.invars]
    if op.name in _CARRY_CONST and vals[0] is not None:
      const[outs[0]] = vals[0]
    elif op.name in _CONST_FN and all(v is not None for v in vals):
      with np.errstate(all="ignore"):
        const[outs[0]] = _CONST_FN[op.name](*[np.float64(v) for v in vals])
      folded.add(op.index)
  return const, folded


def _const_value(r, const: dict):
  if isinstance(r, Lit):
    v = np.asarray(r.value)
    return v.flat[0] if v.size and np.all(v == v.flat[0]) else None
  return const.get(r)


def simplified_away(prog: Program) -> set:
  """Indices of the ops XLA removes before counting FLOPs: arithmetic on constants alone
  (constant folding: ``maxval - minval`` of ``jax.random.uniform``) and arithmetic with a
  constant identity (``x * (maxval - minval)`` with ``maxval - minval == 1``, ``x + minval``
  with ``minval == 0``: the algebraic simplifier; a dropout mask's ``uniform`` does both).
  A constant here is a value every element of which is the same known number, made from
  literals by broadcasts, conversions, reshapes and the arithmetic above."""
  const, gone = _constants(prog)
  for op in prog.ops:
    outs = [o for o in op.outvars if o >= 0]
    ident = _IDENTITY_OF.get(op.name)
    if ident is None or len(outs) != 1 or len(op.invars) != 2 or op.index in gone:
      continue
    vals = [_const_value(r, const) for r in op.invars]
    unit, pos = ident
    sides = (0, 1) if pos is None else (pos,)
    if any(vals[i] is not None and float(vals[i]) == unit
           and prog.avals[outs[0]].shape == _shape(op.invars[1 - i], prog) for i in sides):
      gone.add(op.index)
  return gone


def _shape(r, prog: Program) -> tuple:
  return tuple(np.shape(r.value)) if isinstance(r, Lit) else tuple(prog.avals[r].shape)


def _readers(prog: Program, read: dict) -> tuple[set, dict]:
  """``(the values the program returns, value -> the ops reading it)``, through the views
  ``read`` resolves (ops :data:`_FOLDED` into their readers left out)."""
  outputs = {u for v in prog.outvars if not isinstance(v, Lit) for u in read.get(v, (v,))}
  readers: dict = {}
  for op in prog.ops:
    if op.name in _FOLDED:
      continue
    for u in dict.fromkeys(u for v in op.in_ids() for u in read.get(v, (v,))):
      readers.setdefault(u, []).append(op)
  return outputs, readers


def _copies(prog: Program, read: dict) -> dict:
  """Op index -> how many times XLA computes the op, for the ops its fusion duplicates: a
  cheap elementwise op (not :data:`~harpjax.compiler.trace.primitives.EXPENSIVE`), a slice,
  and a random draw's last step (the xor that ends threefry, which lands in its consumers).
  A value that two elementwise fusions read (or one, and the program returns it) is computed
  in each, and so is the chain of such ops computing it (a reinterpretation of its bits, as
  ``uniform`` makes floats of the hash's bits, is one of them); every other op once (at most
  twice: XLA's fusion does not duplicate without bound). Read off XLA:CPU's optimized HLO: a
  dropout mask the forward returns as a residual and also applies is computed twice, from
  the hash's last xor (at the drawn shape, before the microbatch's rows are sliced) on."""
  outputs, readers = _readers(prog, read)
  const, _ = _constants(prog)
  copies: dict = {}
  for op in reversed(prog.ops):
    outs = [o for o in op.outvars if o >= 0]
    if len(outs) != 1 or not (op.name in _SLICES or op.name in _BIT_OPS or (
        op.name in primitives.ELEMENTWISE and op.name not in primitives.EXPENSIVE)):
      continue
    mine = readers.get(outs[0], ())
    fusing = [copies[r.index] for r in mine if r.index in copies]
    n = sum(fusing) + (outs[0] in outputs)
    # An effectively unary op (one array operand, the others constants) that a reduction
    # reads is computed inside the reduction's fusion too, and once more for a reader that
    # fuses nothing (a matmul): XLA duplicates it rather than read it back.
    if (op.name in primitives.ELEMENTWISE and _arrays_read(op, prog, const) <= 1
        and any(r.name in primitives.REDUCTIONS for r in mine)):
      n += 1 + any(r.index not in copies and r.name not in primitives.REDUCTIONS
                   for r in mine)
    copies[op.index] = min(2, max(1, n))
  return copies


def _arrays_read(op, prog: Program, const: dict) -> int:
  """How many of an op's operands are arrays (not literals, constants or single elements)."""
  return sum(1 for r in op.invars if not isinstance(r, Lit) and r not in const
             and primitives.aval_size(prog.avals[r]) > 1)


def _work(prog: Program, sizes: _Sizes, read: dict, only: set | None = None) -> Work:
  """The :class:`Work` of a program: FLOPs (split as :class:`_Sizes` says), bytes as
  :func:`_bytes_accessed` counts them op by op, and the ops with a kernel of their own; with
  ``only`` (op indices), of those ops alone, each counted as it is in the whole program."""
  heavy_f, heavy_b, flash_f, flash_b = [], [], [], []
  composition = None
  light_f = light_b = kernels = 0.0
  copies = _copies(prog, read)
  gone = simplified_away(prog)
  for op in prog.ops:
    if only is not None and op.index not in only:
      continue
    raw = once = 0.0 if op.index in gone else _op_flops(prog, op)
    scale = sizes.op_scale(op)
    if op.name == "random_bits":
      key_aval = prog.avals[op.invars[0]]
      if op.index in gone:
        pass
      elif (tuple(int(d) for d in op.params["shape"]),
            int(op.params["bit_width"])) in sizes.positional:   # the stage's hash of its rows
        raw = position_draw_flops(key_aval, op.params, 1 / scale) / scale
      elif scale < 1:   # each device draws its part, setting up the key all the same
        raw = primitives.random_bits_flops(key_aval, op.params, 1 / scale) / scale
      # the hash's last xor, computed again inside each further fusion reading the draw
      raw += (copies.get(op.index, 1) - 1) * sum(
          primitives.aval_size(prog.avals[o]) for o in op.outvars if o >= 0)
    elif op.index in copies:
      raw *= copies[op.index]
    flops = raw * scale
    if op.name in _FOLDED:
      light_f += flops
      continue
    ins = dict.fromkeys(u for v in op.in_ids() for u in read.get(v, (v,)))
    nbytes = (sum(sizes.nbytes(v) for v in ins)
              + sum(sizes.nbytes(o) for o in op.outvars if o >= 0))
    if op.name in _compat.FUSED_ATTENTION_PRIMITIVES:   # one fused kernel, or its composition
      flash_f.append(flops)
      flash_b.append(nbytes)
      comp = composition_work(op.name, op.params,
                              [None if isinstance(r, Lit) else prog.avals[r]
                               for r in op.invars]).scaled(1.0 / scale)
      composition = comp if composition is None else composition + comp
      continue
    if primitives.is_compute_heavy(op.name):
      heavy_f.append(flops)
      heavy_b.append(nbytes)
      kernels += 1
      continue
    light_f += flops
    light_b += nbytes
    out_elems = sum(primitives.aval_size(prog.avals[o]) for o in op.outvars if o >= 0)
    # (computed again inside another fusion is no kernel of its own; a key's hash, a few
    # scalar operations, is computed where its draw is)
    if (op.name in _OWN_KERNELS or (once > max(out_elems, 1) and op.name not in _KEY_OPS)
        or (op.name in primitives.REDUCTIONS and raw > 0)):
      kernels += 1   # a reduction, scan or sort, or data movement XLA does not fuse away
  return Work(tuple(heavy_f), tuple(heavy_b), light_f, light_b, kernels, tuple(flash_f),
              tuple(flash_b), composition)


def _plain_work(closed) -> Work:
  """The :class:`Work` of a whole closed jaxpr on one device (no mesh)."""
  prog = _flatten(closed)
  return _work(prog, _Sizes(prog, [], [], 1, 1), _read(prog))


def composition_work(name: str, params: dict, in_avals) -> Work:
  """The XLA composition of one fused attention equation (``name`` in
  :data:`harpjax._compat.FUSED_ATTENTION_PRIMITIVES`): the program
  ``jax.nn.dot_product_attention(..., implementation="xla")`` traces to on the same operands
  (the ``S x S`` scores written and read, softmax in fp32), read as any program is. A
  backward equation is the composition's forward+backward (``jax.vjp``) less its forward:
  the gradient from the scores the forward kept, no recomputation. What a GPU type without
  the fused kernel runs in its place (:attr:`Work.flash_composition`)."""
  bias = in_avals[3] if len(in_avals) > 3 and in_avals[3] is not None and all(
      in_avals[3].shape) and len(in_avals[3].shape) == 4 else None
  key = (name, _compat.fused_attention_layout(params), _compat.fused_attention_causal(params),
         float(params.get("scale", 1.0)),
         tuple((tuple(a.shape), str(a.dtype)) for a in in_avals[:3]),
         None if bias is None else (tuple(bias.shape), str(bias.dtype)))
  return _composition_work(key)


@functools.lru_cache(maxsize=256)
def _composition_work(key) -> Work:
  name, layout, causal, scale, qkv, bias = key
  structs = [jax.ShapeDtypeStruct(shape, np.dtype(dt)) for shape, dt in qkv]
  if bias is not None:
    structs.append(jax.ShapeDtypeStruct(bias[0], np.dtype(bias[1])))
  btnh = (lambda t: t.transpose(0, 2, 1, 3)) if layout == "BNTH" else (lambda t: t)

  def attention(q, k, v, *b):
    out = jax.nn.dot_product_attention(btnh(q), btnh(k), btnh(v), b[0] if b else None,
                                       scale=scale, is_causal=causal, implementation="xla")
    return btnh(out)

  fwd = _plain_work(jax.make_jaxpr(attention)(*structs))
  if "bwd" not in name:
    return fwd
  out = jax.eval_shape(attention, *structs)
  both = _plain_work(jax.make_jaxpr(lambda g, *a: jax.vjp(attention, *a)[1](g))(out, *structs))
  n = len(fwd.heavy_flops)
  return Work(both.heavy_flops[n:], both.heavy_bytes[n:],
              max(both.light_flops - fwd.light_flops, 0.0),
              max(both.light_bytes - fwd.light_bytes, 0.0), max(both.kernels - fwd.kernels, 0.0))


def _fwd_sizes(traced: TracedPiece, dp: int, tp: int) -> _Sizes:
  """:class:`_Sizes` of the forward with residuals (``traced.fwd_res``)."""
  params, batch = _input_roles(traced.piece, traced.fwd_res, with_cts=False)
  return _Sizes(traced.fwd_res, params, batch, dp, tp, positional=traced.redrawn(dp))


def _residual_bytes(traced: TracedPiece, sizes: _Sizes) -> float:
  """Per-device bytes of the forward's residuals (parameters and views of them excluded:
  the stage's backward takes the parameters again and views them anew, as
  :func:`~harpjax.compiler.stages.stage_functions` does; activation inputs the backward keeps
  included)."""
  piece, fr = traced.piece, traced.fwd_res
  dp = sizes.dp
  inputs = fr.invars[fr.num_consts:]
  pos = {v: i for i, v in enumerate(inputs)}
  n_p = len(piece.param_ids)
  views = set(inputs[:n_p])
  for op in fr.ops:
    ins = list(op.in_ids())
    if primitives.is_view(op.name) and ins and all(v in views for v in ins) \
        and op.params.get("jaxpr") is None:
      views.update(o for o in op.outvars if o >= 0)
  total, seen = 0.0, set()
  for v in fr.outvars[traced.num_outputs:]:
    if isinstance(v, Lit) or v in seen or (v in views and v not in pos):
      continue
    seen.add(v)
    if v in pos:
      if pos[v] >= n_p:   # an activation input kept for the backward: whole on every device
        vid = (piece.act_ids + piece.aux_ids)[pos[v] - n_p]
        total += float(fr.nbytes(v)) / (dp if vid in piece.batch_ids else 1)
      continue
    total += sizes.nbytes(v)
  return total


def _dtype(aval):
  """The NumPy dtype of an abstract value; ``object`` for extended ones (PRNG keys)."""
  try:
    return np.dtype(aval.dtype)
  except TypeError:
    return np.dtype(object)


def _lit_aval(r: Lit):
  return jax.ShapeDtypeStruct(np.shape(r.value), np.result_type(r.value))
