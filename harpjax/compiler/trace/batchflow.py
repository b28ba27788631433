"""Which values of the pipelined region carry the batch, and what microbatches compute exactly.

A pipeline runs the loss function once per microbatch and adds the gradients up. That equals
``jax.jit`` of the whole step exactly when the microbatches' results can be put together into
the batch's: per-example values concatenate, sums over the examples add up. This module reads
the data flow of the region (traced at the full batch and at one microbatch, equation for
equation the same program) and gives every value a :class:`Flow`:

* ``free``: does not depend on the batch's examples (parameters, constants, the step's other
  inputs, and what is computed from them alone);
* ``rows``: per-example along one axis (its ``axis``): microbatch ``m``'s slice along it
  depends on microbatch ``m``'s examples only;
* ``sum``: a linear function of sums over the examples (``jnp.mean(ce)``, a batch mean kept in
  a mutable collection); each microbatch computes its own part, and the parts add up;
* ``coupled``: none of these: values of different examples meet in a way the microbatches
  cannot reproduce (an in-batch similarity matrix, batch statistics inside the model, a
  capacity decided over the batch's tokens). The microbatch computes it over its own examples,
  as every pipeline does, and harpjax says so (:class:`Coupling`).

Values that depend on the batch's data but not on the parameters (a mask's token count, the
normalising denominator of a loss, class weights from the labels) are *hoisted*: computed once
on the whole batch before the pipeline and read by every microbatch, so that a loss such as
``sum(ce * mask) / sum(mask)`` is a sum over the examples again and pipelines exactly.

Rules are per primitive, conservative: an unknown primitive over per-example values is
``coupled``. The rewrite that turns the analysis into the microbatch's program is
:mod:`harpjax.compiler.trace.microbatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from harpjax import _compat
from harpjax.compiler.trace import primitives
from harpjax.compiler.trace.program import Lit, Program, from_closed_jaxpr
from harpjax.compiler.trace.regen import RANDOM_PRIMITIVES, index_iotas, split_axis

__all__ = ["Flow", "Coupling", "BatchFlow", "analyze", "unaligned", "FREE", "ROWS", "SUM",
           "COUPLED", "ELEMENTWISE"]

FREE, ROWS, SUM, COUPLED = "free", "rows", "sum", "coupled"

ELEMENTWISE = primitives.ELEMENTWISE | {
    "convert_element_type", "stop_gradient", "copy", "copy_p", "bitcast_convert_type",
    "random_wrap", "random_unwrap", "sharding_constraint", "name"}
"""Primitives applied element by element (operands of one shape, or scalars)."""

LINEAR = frozenset({"add", "sub", "neg", "add_any", "add_jaxvals", "convert_element_type",
                    "stop_gradient", "copy", "copy_p", "reduce_precision", "select_n",
                    "sharding_constraint", "name", "optimization_barrier", "mul", "div",
                    "real", "imag", "conj"})
"""Elementwise primitives that are linear in a value summed over the examples (``mul`` and
``div`` with a factor, ``select_n`` with a predicate, that does not depend on the examples)."""

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_SCATTERS = frozenset({"scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
                       "scatter_add", "scatter_mul", "scatter_min", "scatter_max"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call"}) | _compat.CALL_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class Flow:
  """How one value relates to the examples of the batch.

  Attributes:
    kind: ``"free"``, ``"rows"``, ``"sum"`` or ``"coupled"`` (module docstring).
    axis: the row axis of a ``"rows"`` value.
    param: depends on the differentiated parameters.
    data: depends on the batch's examples (its split inputs, per-example random draws).
    pos: a ``"free"`` value that is its own index along this axis (a microbatch-local iota
      over the batch, used to index the microbatch's rows); ``-1``: none.
    cols: for an array of index vectors (last axis), per component the axis it is a position
      along (``-1``: none), e.g. ``x[jnp.arange(n), labels]``'s ``[[i, label_i]]``.
    varies: a ``"free"`` value of the batch's length that is not the same along it (a
      position, a constant array of the batch's length): not per-example data.
    false: a boolean known to be all false (``position < 0``).
    zero: known to be all zeros.
  """
  kind: str
  axis: int = -1
  param: bool = False
  data: bool = False
  pos: int = -1
  cols: tuple = ()
  varies: bool = False
  false: bool = False
  zero: bool = False

  @property
  def exact(self) -> bool:
    return self.kind != COUPLED

  @property
  def data_only(self) -> bool:
    return self.data and not self.param


_FREE = Flow(FREE)


def _free(param=False, **kw) -> Flow:
  return Flow(FREE, param=param, **kw)


def _rows(axis: int, ins: Sequence[Flow], **kw) -> Flow:
  return Flow(ROWS, axis, any(f.param for f in ins), any(f.data for f in ins), **kw)


def _sum(ins: Sequence[Flow]) -> Flow:
  return Flow(SUM, -1, any(f.param for f in ins), any(f.data for f in ins))


def _coupled(ins: Sequence[Flow]) -> Flow:
  return Flow(COUPLED, -1, any(f.param for f in ins), any(f.data for f in ins))


@dataclasses.dataclass(frozen=True)
class Coupling:
  """Where values of different examples first meet in a way microbatches cannot reproduce.

  Attributes:
    op: the equation's index in the region program.
    primitive: its primitive.
    where: its module path (name stack).
    source: the model's source line (:func:`harpjax._compat.describe_source`).
    reason: what differs, in words.
  """
  op: int
  primitive: str
  where: str
  source: str
  reason: str

  def describe(self) -> str:
    return f"{_place(self.primitive, self.source, self.where)}: {self.reason}"


def _place(primitive: str, source: str, where: str) -> str:
  at = f" at {source}" if source else ""
  inside = f" in {where}" if where else ""
  return f"{primitive}{at}{inside}"


@dataclasses.dataclass(frozen=True, eq=False)
class BatchFlow:
  """The analysis of one region (:func:`analyze`).

  Attributes:
    full / mb: the region at the full batch and at one microbatch (as traced).
    num_microbatches: B.
    flows: value id -> :class:`Flow` as its consumers see it (a hoisted value: as hoisted).
    hoistable: value id -> ``-1`` (whole) or its row axis (split per microbatch): values
      computed from the batch's data alone that the whole batch can compute up front.
    coupled_ops: indices of the ops whose results are ``coupled`` (they compute what the
      microbatch alone gives).
    couplings: where examples meet (:class:`Coupling`), those that reach an output.
    refusals: messages of uses that would make the per-microbatch result meaningless.
    local_iotas: indices of the iotas over the batch that stay the microbatch's own positions.
    aligned: whether the two traces correspond op for op (else nothing else is filled in).
  """
  full: Program
  mb: Program
  num_microbatches: int
  flows: dict
  hoistable: dict
  coupled_ops: frozenset
  couplings: tuple
  refusals: tuple
  local_iotas: frozenset
  aligned: bool = True

  def output_flows(self) -> tuple:
    """Flows of the region's outputs (the loss first)."""
    return tuple(_FREE if isinstance(r, Lit) else self.flows[r] for r in self.mb.outvars)

  @property
  def exact(self) -> bool:
    """Whether every output is exact (no coupling reaches one)."""
    return self.aligned and not self.couplings


def unaligned(full: Program, mb: Program, num_microbatches) -> BatchFlow:
  """The analysis of two traces that are not the same program: nothing known."""
  return BatchFlow(full, mb, num_microbatches, {}, {}, frozenset(), (), (), frozenset(),
                   aligned=False)


class _Couple(Exception):
  """Raised by a transfer rule: the op's results are coupled, for ``reason``."""


class _Refuse(Exception):
  """Raised by a transfer rule: the per-microbatch result would be meaningless."""


# --------------------------------------------------------------------------- analysis


def analyze(full: Program, mb: Program, in_flows: Sequence[Flow], num_microbatches,
            body: bool = False) -> BatchFlow:
  """The batch flow of a region traced at the full batch (``full``) and at one microbatch.

  A value is hoisted only where nothing coupled depends on it: what a coupled op reads is
  the microbatch's own (the reference of a coupled step is ``jax.jit`` of each microbatch).

  Args:
    full / mb: the two traces (values addressed alike when they correspond op for op).
    in_flows: per input of the programs, its :class:`Flow`.
    num_microbatches: B (the full batch's rows over the microbatch's).
    body: the programs are the body of a loop, branch or custom function: nothing can be
      hoisted out of it, and a sum over the examples may not be offset by a constant.
  """
  keep: frozenset = frozenset()
  while True:
    flow = _analyze(full, mb, in_flows, num_microbatches, body, keep)
    if not flow.aligned or not flow.hoistable or not flow.coupled_ops:
      return flow
    coupled_out = {v for i in flow.coupled_ops for v in mb.ops[i].outvars if v >= 0}
    more = {v for v in flow.hoistable if mb.dependents([v]) & coupled_out}
    if not more - keep:
      return flow
    keep = keep | more


def _analyze(full: Program, mb: Program, in_flows: Sequence[Flow], num_microbatches,
             body: bool, keep: frozenset) -> BatchFlow:
  """:func:`analyze` with the values of ``keep`` not hoisted."""
  if len(full.ops) != len(mb.ops) or any(a.name != b.name for a, b in zip(full.ops, mb.ops)) \
      or len(full.avals) != len(mb.avals):
    return unaligned(full, mb, num_microbatches)
  M = num_microbatches
  local = index_iotas([(op.name, op.params, tuple(op.invars), op.outvars) for op in mb.ops],
                      mb.outvars, {fo.index for fo, mo in zip(full.ops, mb.ops) if fo.name ==
                                   "iota" and full.avals[fo.outvars[0]].shape
                                   != mb.avals[mo.outvars[0]].shape})
  flows: dict[int, Flow] = dict(zip(full.invars, in_flows))
  hoistable: dict[int, int] = {}
  coupled_ops, origins, refusals = set(), [], []

  def bshape(v) -> tuple:
    if isinstance(v, Lit):
      return ()
    fs, ms = tuple(full.avals[v].shape), tuple(mb.avals[v].shape)
    if len(fs) != len(ms):
      return (-1,)
    return tuple(i for i, (a, b) in enumerate(zip(fs, ms)) if a != b)

  for fo, mo in zip(full.ops, mb.ops):
    ins = [_lit_flow(v) if isinstance(v, Lit) else flows[v] for v in fo.invars]
    ctx = _Ctx(fo, mo, full, mb, [bshape(v) for v in fo.invars],
               [bshape(v) if v >= 0 else () for v in fo.outvars], M, body,
               mo.index in local)
    origin = None
    try:
      outs = _transfer(ctx, ins)
    except _Couple as e:
      outs = [_coupled(ins)] * len(fo.outvars)
      origin = str(e)
    except _Refuse as e:
      refusals.append(f"{_where(mo)} {e}")
      outs = [_coupled(ins)] * len(fo.outvars)
    for k, v in enumerate(fo.outvars):
      if v < 0:
        continue
      f, why = _settle(outs[k], ctx.out_b[k], M)
      origin = origin or why
      if not body and f.data_only and f.kind in (SUM, COUPLED) and v not in keep:
        # From the batch's data alone: computed up front on the whole batch.
        axis = _hoist_axis(ctx.out_b[k], full.avals[v].shape, mb.avals[v].shape, M)
        if axis is not None:
          hoistable[v] = axis
          f = Flow(ROWS, axis, data=True) if axis >= 0 else _free()
      flows[v] = f
    if any(flows[v].kind == COUPLED for v in fo.outvars if v >= 0):
      coupled_ops.add(fo.index)
      if not any(i.kind == COUPLED for i in ins):
        origins.append(Coupling(fo.index, fo.name, mo.name_stack,
                                _compat.describe_source(mo.source),
                                origin or "mixes the examples of the batch"))
  reach = _reaching_outputs(mb, [c.op for c in origins])
  couplings, seen = [], set()
  for c in origins:
    key = (c.primitive, c.source, c.where, c.reason)
    if c.op in reach and key not in seen:
      seen.add(key)
      couplings.append(c)
  couplings = tuple(couplings)
  refusals = list(dict.fromkeys(refusals))
  return BatchFlow(full, mb, M, flows, hoistable, frozenset(coupled_ops), couplings,
                   tuple(refusals), local)


def _hoist_axis(bshape, full_shape, mb_shape, M):
  """``-1`` (hoisted whole), the row axis (hoisted and split per microbatch) or ``None``."""
  return -1 if not bshape else split_axis(tuple(full_shape), tuple(mb_shape), M)


def _reaching_outputs(program: Program, op_indices) -> set:
  """Of ``op_indices``, those whose results reach an output of ``program``."""
  outs = {v for v in program.outvars if not isinstance(v, Lit)}
  out = set()
  for i in op_indices:
    dep = program.dependents([v for v in program.ops[i].outvars if v >= 0])
    if dep & outs:
      out.add(i)
  return out


def _where(op) -> str:
  return _place(op.name, _compat.describe_source(op.source), op.name_stack)


def _lit_flow(v: Lit) -> Flow:
  try:
    arr = np.asarray(v.value)
    zero = bool(arr.size and not np.any(arr))
    false = arr.dtype == np.bool_ and not np.any(arr)
  except (TypeError, ValueError):
    zero = false = False
  return Flow(FREE, zero=zero, false=false)


def _settle(f: Flow, bshape: tuple, M):
  """A result's flow checked against its shapes: ``(flow, reason it became coupled or None)``."""
  if M == 1:
    return f, None
  if f.kind == ROWS and tuple(bshape) != (f.axis,):
    return _coupled([f]), ("pairs the examples of the batch with each other (a value with "
                           "the batch's length along more than one axis)")
  if f.kind == SUM and bshape:
    return _coupled([f]), ("sums over the examples into a value whose size follows the "
                           "batch's (such as slots whose number grows with the batch)")
  if f.kind == FREE and -1 in bshape:
    return _coupled([f]), "changes rank with the batch size"
  return f, None


@dataclasses.dataclass
class _Ctx:
  fo: Any            # the op at the full batch
  mo: Any            # the op at the microbatch
  full: Program
  mb: Program
  in_b: list         # per operand, its batch-shaped axes
  out_b: list        # per result, its batch-shaped axes
  M: Any
  body: bool
  local_iota: bool

  @property
  def params(self) -> dict:
    return self.fo.params

  def in_shape(self, k: int) -> tuple:
    """Operand ``k``'s shape at the full batch."""
    v = self.fo.invars[k]
    return tuple(np.shape(v.value)) if isinstance(v, Lit) else tuple(self.full.avals[v].shape)

  def out_shape(self, k: int) -> tuple:
    """Result ``k``'s shape at the full batch."""
    v = self.fo.outvars[k]
    return tuple(self.full.avals[v].shape) if v >= 0 else ()


# --------------------------------------------------------------------------- transfer rules


def _transfer(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  """The flows of an op's results from its operands' (raising :class:`_Couple` where values
  of different examples meet, :class:`_Refuse` where the result would be meaningless)."""
  name = ctx.fo.name
  n_out = len(ctx.fo.outvars)
  _check_indices(ctx, ins)
  if all(f.kind == FREE for f in ins) and name != "iota" and \
      name not in RANDOM_PRIMITIVES and not primitives.subjaxprs(ctx.params):
    return _free_op(ctx, ins)
  if any(f.kind == COUPLED for f in ins):
    return [_coupled(ins)] * n_out
  rule = _RULES.get(name)
  if rule is None:
    if name in ELEMENTWISE:
      return _elementwise(ctx, ins)
    if primitives.subjaxprs(ctx.params):
      return _bodies(ctx, ins)
    raise _Couple(f"harpjax does not know how {name} treats the examples of the batch")
  return rule(ctx, ins)


def _free_op(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  """An op of values that do not depend on the examples: positions pass through plumbing."""
  name = ctx.fo.name
  param = any(f.param for f in ins)
  n_out = len(ctx.fo.outvars)
  varies = any(f.varies for f in ins)
  b0 = ctx.out_b[0] if ctx.out_b else ()
  if name == "lt" and ins[0].pos >= 0 and isinstance(ctx.fo.invars[1], Lit) and \
      np.all(np.asarray(ctx.fo.invars[1].value) <= 0):
    return [_free(param, false=True)]   # a position below zero: never
  if name == "select_n" and ins[0].false:
    return [ins[1]]
  if name in ("convert_element_type", "copy", "copy_p", "reduce_precision") and \
      (ins[0].pos >= 0 or ins[0].zero):
    return [ins[0]]
  if name == "broadcast_in_dim":
    f = ins[0]
    dims = tuple(ctx.params["broadcast_dimensions"])
    pos = dims[f.pos] if f.pos >= 0 else -1
    zero = f.zero
    return [_free(param, pos=pos, varies=f.varies or pos >= 0, zero=zero)]
  if name in ("reshape", "squeeze"):
    f = ins[0]
    pos = _map_unit_axis(ctx.in_shape(0), ctx.out_shape(0), f.pos) if f.pos >= 0 else -1
    return [_free(param, pos=pos, varies=f.varies or (f.pos >= 0 and pos < 0), zero=f.zero)]
  if name == "transpose":
    f = ins[0]
    perm = tuple(ctx.params["permutation"])
    return [_free(param, pos=perm.index(f.pos) if f.pos >= 0 else -1, varies=f.varies,
                  zero=f.zero)]
  if name == "concatenate":
    cols = _index_cols(ctx, ins)
    return [_free(param, cols=cols, varies=varies or any(f.pos >= 0 for f in ins))]
  # Values that do not depend on the examples but have the batch's length and vary along
  # it (positions used as numbers) are not per-example data.
  if b0 and name not in ("broadcast_in_dim",):
    varies = varies or any(f.pos >= 0 for f in ins)
  return [_free(param, varies=varies, zero=_known_zero(name, ins))] * n_out


_ZERO_IF_FIRST = frozenset({"slice", "dynamic_slice", "rev", "neg", "reduce_sum", "cumsum"})
_ZERO_IF_ALL = frozenset({"pad", "concatenate", "add", "sub", "add_any", "max", "min",
                          "dynamic_update_slice"})


def _known_zero(name: str, ins: list[Flow]) -> bool:
  """Whether an op of free values gives zeros (a loop's accumulator starting at zero)."""
  if name == "mul":
    return any(f.zero for f in ins)
  if name in _ZERO_IF_FIRST:
    return ins[0].zero
  if name == "select_n":
    return all(f.zero for f in ins[1:])
  if name in _ZERO_IF_ALL:
    return all(f.zero for f in ins if not f.false)
  return False


def _map_unit_axis(in_shape, out_shape, axis) -> int:
  """Where ``axis`` goes under a reshape that only adds or removes axes of size 1 (else -1)."""
  a = [d for d in in_shape if d != 1]
  b = [d for d in out_shape if d != 1]
  if a != b or in_shape[axis] == 1:
    return -1
  rank = sum(1 for d in in_shape[:axis] if d != 1)
  seen = 0
  for i, d in enumerate(out_shape):
    if d != 1:
      if seen == rank:
        return i
      seen += 1
  return -1


def _index_cols(ctx: _Ctx, ins: list[Flow]) -> tuple:
  """Index vectors built by concatenating along the last axis: each piece's positions."""
  dim = int(ctx.params["dimension"])
  rank = len(ctx.out_shape(0))
  if dim != rank - 1:
    return ()
  cols = []
  for k, f in enumerate(ins):
    width = ctx.in_shape(k)[dim]
    if f.cols:
      cols.extend(f.cols)
    elif width == 1:
      cols.append(f.pos if f.pos >= 0 and f.pos != dim else -1)
    else:
      cols.extend([-1] * width)
  return tuple(cols)


def _rows_axis(ins: list[Flow]) -> int | None:
  """The common row axis of the ``rows`` operands (``None``: none; raises if they differ)."""
  axes = {f.axis for f in ins if f.kind == ROWS}
  if not axes:
    return None
  if len(axes) > 1:
    raise _Couple("combines per-example values whose examples run along different axes")
  return axes.pop()


def _check_free_partners(ctx: _Ctx, ins: list[Flow], axis: int, what: str = "") -> None:
  """``free`` operands of a per-example op must not vary along the batch (a position used as
  data) nor have the batch's length along another axis."""
  for k, f in enumerate(ins):
    if f.kind != FREE:
      continue
    b = ctx.in_b[k]
    if any(a != axis for a in b):
      raise _Couple("meets a value whose length follows the batch along another axis "
                    "than its examples")
    if f.varies and b and f.pos != axis:
      raise _Couple("uses a value of the batch's length that is not per-example data "
                    "(a constant array, or positions) as if it were")


def _elementwise(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  name = ctx.fo.name
  n_out = len(ctx.fo.outvars)
  kinds = {f.kind for f in ins}
  if ROWS in kinds:
    axis = _rows_axis(ins)
    if SUM in kinds:
      raise _Couple("combines a sum over the examples with per-example values (a batch "
                    "statistic applied back to the examples)")
    _check_free_partners(ctx, ins, axis)
    keep_cols = ins[0].cols if name in ("convert_element_type", "select_n", "copy") else ()
    if name == "select_n" and ins[0].kind == FREE and ins[0].false:
      return [ins[1]]
    return [_rows(axis, ins, cols=keep_cols)] * n_out
  # sums over the examples (and free values)
  if name not in LINEAR:
    raise _Couple(f"applies {name} to a sum over the examples (a statistic of the batch "
                  "that is not linear in its examples)")
  sums = [k for k, f in enumerate(ins) if f.kind == SUM]
  if name == "mul" and len(sums) > 1:
    raise _Couple("multiplies two sums over the examples (a statistic of the batch that is "
                  "not linear in its examples)")
  if name == "div" and 1 in sums:
    raise _Couple("divides by a sum over the examples that depends on the parameters")
  if name == "select_n" and 0 in sums:
    raise _Couple("chooses values by a predicate computed over the batch")
  if name == "convert_element_type" and not primitives.is_float(
      ctx.full.avals[ctx.fo.outvars[0]]):
    raise _Couple("rounds a sum over the examples to an integer")
  if name in ("add", "sub", "add_any", "add_jaxvals", "select_n") and \
      any(f.kind == FREE and not f.zero for f in ins) and ctx.body:
    raise _Couple("offsets a sum over the examples by a constant inside a loop or function "
                  "body")
  if name in ("add", "sub", "add_any") and any(
      f.kind == FREE and not f.zero for f in ins) and not primitives.is_float(
          ctx.full.avals[ctx.fo.outvars[0]]):
    raise _Couple("offsets an integer count over the examples by a constant")
  return [_sum(ins)] * n_out


_OUT_OF_RANGE = (
    "each microbatch holds only its own examples, so such labels would be out of range (or "
    "point at the wrong examples). Compute the targets inside the loss function from "
    "positions (jnp.arange over the batch), or make the loss per example")


def _check_indices(ctx: _Ctx, ins: list[Flow]) -> None:
  """Values from the batch's data used as positions of the batch's examples (labels of an
  in-batch contrastive loss given with the data) mean nothing to a microbatch: refused."""
  name = ctx.fo.name
  if name == "gather":
    idx = ins[1]
    if not idx.data_only:
      return
    start_map = tuple(ctx.params["dimension_numbers"].start_index_map)
    for k, d in enumerate(start_map):
      is_pos = idx.cols and k < len(idx.cols) and idx.cols[k] >= 0
      if d in ctx.in_b[0] and not is_pos:
        raise _Refuse("indexes the examples of the batch with values from the batch's data "
                      "(labels that point at examples of the batch); " + _OUT_OF_RANGE)
  elif name in ("eq", "ne") and len(ins) == 2:
    for k in (0, 1):
      pos, other = ins[k], ins[1 - k]
      if pos.kind == FREE and pos.pos >= 0 and pos.pos in ctx.in_b[k] and \
          other.data_only and not other.cols and \
          (other.kind != ROWS or other.axis != pos.pos):
        raise _Refuse("compares values from the batch's data with positions of the "
                      "examples of the batch (a one-hot over the batch); " + _OUT_OF_RANGE)


def _iota(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  b = ctx.out_b[0]
  dim = int(ctx.params["dimension"])
  if dim not in b:   # of the batch's length only where it is the same along it
    return [_free()]
  if ctx.local_iota:
    return [_free(pos=dim, varies=True)]
  if b == (dim,):   # positions used as data: jax.jit's are the full batch's (redrawn)
    return [Flow(ROWS, dim, data=True)]
  raise _Couple("positions over the batch along several axes")


def _random(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  """Draws: of the batch's shape from keys that are not per-example, redrawn as a slice of the
  full batch's (per-example); from per-example keys, per-example along the keys' axis."""
  axis = _rows_axis(ins)
  param = any(f.param for f in ins)
  outs = []
  for b in ctx.out_b:
    if not b:
      outs.append(_free(param))
    elif axis is not None and b == (axis,):
      outs.append(_rows(axis, ins))
    elif axis is None and len(b) == 1:   # redrawn: the slice of the full batch's draws
      outs.append(Flow(ROWS, b[0], param, True))
    else:
      raise _Couple("draws random numbers whose shape follows the batch along several axes")
  return outs


def _reduce(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  name = ctx.fo.name
  f = ins[0]
  axes = tuple(int(a) for a in ctx.params["axes"])
  if f.kind == SUM:
    if name != "reduce_sum":
      raise _Couple(f"takes {name} of a sum over the examples")
    return [_sum(ins)]
  if f.axis not in axes:
    return [_rows(f.axis - sum(1 for a in axes if a < f.axis), ins)]
  if name == "reduce_sum":
    return [_sum(ins)]
  what = {"reduce_max": "the maximum", "reduce_min": "the minimum", "argmax": "the argmax",
          "argmin": "the argmin", "reduce_prod": "the product"}.get(name, name)
  raise _Couple(f"takes {what} over the examples of the batch")


def _cumulative(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    if ctx.fo.name == "cumsum":
      return [_sum(ins)]
    raise _Couple(f"takes {ctx.fo.name} of a sum over the examples")
  if int(ctx.params["axis"]) == f.axis:
    raise _Couple(f"accumulates ({ctx.fo.name}) along the examples of the batch, so each "
                  "example's result depends on the ones before it")
  return [_rows(f.axis, ins)]


def _dot_general(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  (lc, rc), (lb, rb) = ctx.params["dimension_numbers"]
  lc, rc, lb, rb = map(lambda t: tuple(int(x) for x in t), (lc, rc, lb, rb))
  lhs, rhs = ins
  nl, nr = len(ctx.in_shape(0)), len(ctx.in_shape(1))
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  if SUM in (lhs.kind, rhs.kind):
    other, k = (rhs, 1) if lhs.kind == SUM else (lhs, 0)
    if other.kind != FREE or ctx.in_b[k]:
      raise _Couple("multiplies a sum over the examples with values that depend on them")
    return [_sum(ins)]

  def place(side: int, d: int) -> tuple[str, int]:
    """Where axis ``d`` of operand ``side`` goes: ("batch"|"contract", i) or ("out", axis)."""
    c, b, free = (lc, lb, lfree) if side == 0 else (rc, rb, rfree)
    if d in b:
      return "batch", b.index(d)
    if d in c:
      return "contract", c.index(d)
    return "out", len(lb) + (free.index(d) if side == 0 else len(lfree) + free.index(d))

  pl = place(0, lhs.axis) if lhs.kind == ROWS else None
  pr = place(1, rhs.axis) if rhs.kind == ROWS else None
  # A free operand may have the batch's length only along the axis paired with the other
  # operand's examples (a weighted sum over them, or a batch dimension).
  for side, f, p_other in ((0, lhs, pr), (1, rhs, pl)):
    if f.kind != FREE or not ctx.in_b[side]:
      continue
    if f.varies:
      raise _Couple("uses a value of the batch's length that is not per-example data (a "
                    "constant array, or positions) as if it were")
    for d in ctx.in_b[side]:
      if p_other is None or p_other[0] == "out" or place(side, d) != p_other:
        raise _Couple("contracts per-example values with a value whose length follows the "
                      "batch along another axis")
  if pl is not None and pr is not None:
    if pl == pr and pl[0] in ("batch", "contract"):
      return [_rows(pl[1], ins)] if pl[0] == "batch" else [_sum(ins)]
    raise _Couple("multiplies the examples of the batch with each other (an in-batch "
                  "similarity or product)")
  p = pl if pl is not None else pr
  if p[0] == "out":
    return [_rows(p[1], ins)]
  if p[0] == "batch":
    return [_rows(p[1], ins)]
  return [_sum(ins)]   # contracted with a free value of the batch's length (a weighted sum)


def _conv(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  lhs, rhs = ins
  dn = ctx.params["dimension_numbers"]
  if lhs.kind != ROWS or rhs.kind != FREE or ctx.in_b[1] or \
      int(ctx.params.get("batch_group_count", 1)) != 1 or lhs.axis != dn.lhs_spec[0]:
    raise _Couple("convolves across the examples of the batch")
  return [_rows(dn.out_spec[0], ins)]


def _broadcast(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  dims = tuple(int(d) for d in ctx.params["broadcast_dimensions"])
  if f.kind == SUM:
    return [_sum(ins)]
  return [_rows(dims[f.axis], ins, cols=f.cols if dims and dims[-1] == len(
      ctx.out_shape(0)) - 1 else ())]


def _reshape(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)]
  if ctx.params.get("dimensions") is not None:
    raise _Couple("reshapes with a transposition across the examples")
  ish, osh = ctx.in_shape(0), ctx.out_shape(0)
  ob = ctx.out_b[0]
  if len(ob) != 1:
    raise _Couple("reshapes the examples of the batch into several axes")
  k = ob[0]
  if int(np.prod(ish[:f.axis], dtype=np.int64)) != int(np.prod(osh[:k], dtype=np.int64)):
    raise _Couple("reshapes the batch so that its examples interleave with another axis")
  cols = f.cols if f.cols and ish[-1] == osh[-1] and k != len(osh) - 1 else ()
  return [_rows(k, ins, cols=cols)]


def _transpose(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)]
  perm = tuple(int(p) for p in ctx.params["permutation"])
  return [_rows(perm.index(f.axis), ins)]


def _squeeze(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)]
  dims = tuple(int(d) for d in ctx.params["dimensions"])
  if f.axis in dims:
    raise _Couple("squeezes the examples' axis")
  return [_rows(f.axis - sum(1 for d in dims if d < f.axis), ins, cols=f.cols)]


def _rev(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)]
  if f.axis in tuple(ctx.params["dimensions"]):
    raise _Couple("reverses the order of the examples")
  return [_rows(f.axis, ins)]


def _slice(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)]
  a = f.axis
  start, limit = ctx.params["start_indices"], ctx.params["limit_indices"]
  strides = ctx.params.get("strides") or (1,) * len(start)
  if int(start[a]) != 0 or int(limit[a]) != ctx.in_shape(0)[a] or int(strides[a]) != 1:
    raise _Couple("selects some of the examples of the batch")
  cols = f.cols if f.cols and ctx.in_shape(0)[-1] == ctx.out_shape(0)[-1] else ()
  return [_rows(a, ins, cols=cols)]


def _pad(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    if ins[1].kind == FREE and ins[1].zero:
      return [_sum(ins)]
    raise _Couple("pads a sum over the examples with a constant")
  if f.kind != ROWS:
    raise _Couple("pads with a value computed from the examples")
  lo, hi, interior = ctx.params["padding_config"][f.axis]
  if (lo, hi, interior) != (0, 0, 0):
    raise _Couple("pads along the examples of the batch")
  return [_rows(f.axis, ins)]


def _concatenate(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  dim = int(ctx.params["dimension"])
  kinds = {f.kind for f in ins}
  if ROWS not in kinds:
    return [_sum(ins)]
  if SUM in kinds:
    raise _Couple("concatenates per-example values with sums over the examples")
  axis = _rows_axis(ins)
  if dim == axis:
    raise _Couple("concatenates values along the examples of the batch (the examples of "
                  "one value before the other's)")
  for k, f in enumerate(ins):
    if f.kind == FREE and any(a != axis for a in ctx.in_b[k]):
      raise _Couple("concatenates per-example values with a value whose length follows "
                    "the batch along another axis")
  return [_rows(axis, ins, cols=_index_cols(ctx, ins))]


def _dynamic_slice(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if any(g.kind != FREE for g in ins[1:]):
    raise _Couple("slices at a position computed from the examples")
  if f.kind == SUM:
    return [_sum(ins)]
  sizes = tuple(int(s) for s in ctx.params["slice_sizes"])
  if sizes[f.axis] != ctx.in_shape(0)[f.axis]:
    raise _Couple("selects some of the examples of the batch")
  return [_rows(f.axis, ins)]


def _dynamic_update_slice(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  op, upd = ins[0], ins[1]
  if any(g.kind != FREE for g in ins[2:]):
    raise _Couple("writes at a position computed from the examples")
  kinds = {op.kind, upd.kind}
  if ROWS not in kinds:
    return [_sum(ins)]
  if SUM in kinds:
    raise _Couple("writes sums over the examples into per-example values")
  axis = _rows_axis([op, upd])
  if ctx.in_shape(1)[axis] != ctx.in_shape(0)[axis] or (op.kind == FREE and op.varies):
    raise _Couple("writes into some of the examples of the batch")
  return [_rows(axis, ins)]


def _gather(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  operand, idx = ins
  dn = ctx.params["dimension_numbers"]
  offset = tuple(dn.offset_dims)
  collapsed = tuple(dn.collapsed_slice_dims)
  start_map = tuple(dn.start_index_map)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()) or ())
  sizes = tuple(int(s) for s in ctx.params["slice_sizes"])
  oshape, ishape = ctx.in_shape(0), ctx.in_shape(1)
  n_out = len(ctx.out_shape(0))
  batch_out = [d for d in range(n_out) if d not in offset]   # output axes of the index dims
  kept = [d for d in range(len(oshape)) if d not in collapsed and d not in obatch]
  ob = ctx.in_b[0]
  if operand.kind == SUM:
    if idx.kind != FREE or ctx.in_b[1]:
      raise _Couple("gathers from a sum over the examples at positions of the examples")
    return [_sum(ins)]
  col = lambda k: idx.cols[k] if idx.cols and k < len(idx.cols) else -1
  out_axis = None
  if operand.kind == ROWS:
    r = operand.axis
    if r in obatch:   # take_along_axis: each example's row with its own indices
      j = ibatch[obatch.index(r)]
      out_axis = batch_out[j]
    elif sizes[r] == oshape[r]:   # the whole axis of examples, kept
      out_axis = offset[kept.index(r)]
    elif r in start_map and col(start_map.index(r)) >= 0 and r in collapsed:
      out_axis = batch_out[col(start_map.index(r))]   # x[arange(n), ...]: its own row
    else:
      raise _Couple("reads examples of the batch chosen by index (a gather across "
                    "examples)")
  elif ob:   # a free operand of the batch's length
    for d in ob:
      if d in start_map and sizes[d] != oshape[d] and col(start_map.index(d)) < 0:
        raise _Couple("reads a value of the batch's length at positions computed from the "
                      "examples")
    if operand.varies and any(d in obatch for d in ob):
      raise _Couple("gathers from a value of the batch's length that is not per-example data")
  if idx.kind == ROWS:
    j = idx.axis
    if j == len(ishape) - 1:
      raise _Couple("builds index vectors across the examples")
    if out_axis is not None and out_axis != batch_out[j]:
      raise _Couple("gathers per-example values at positions of other examples")
    out_axis = batch_out[j]
  elif idx.kind == FREE and ctx.in_b[1] and operand.kind == ROWS:
    for j in ctx.in_b[1]:
      if j != len(ishape) - 1 and batch_out[j] != out_axis:
        raise _Couple("gathers per-example values at positions of the batch's length along "
                      "another axis")
  if out_axis is None:
    return [_free(operand.param or idx.param, varies=operand.varies or idx.varies)]
  return [_rows(out_axis, ins)]


def _scatter(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  operand, idx, upd = ins[0], ins[1], ins[2]
  dn = ctx.params["dimension_numbers"]
  name = ctx.fo.name
  window = tuple(dn.update_window_dims)
  inserted = tuple(dn.inserted_window_dims)
  to_operand = tuple(dn.scatter_dims_to_operand_dims)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()) or ())
  ushape = ctx.in_shape(2)
  scatter_dims = [d for d in range(len(ushape)) if d not in window]   # one per index dim
  if idx.kind == SUM or upd.kind == SUM or operand.kind == SUM:
    if idx.kind == FREE and not ctx.in_b[1] and upd.kind in (SUM, FREE) and \
        operand.kind in (SUM, FREE) and name in ("scatter-add", "scatter_add"):
      return [_sum(ins)]
    raise _Couple("scatters sums over the examples")
  if operand.kind == ROWS:
    r = operand.axis
    if r in obatch:
      j = ibatch[obatch.index(r)]
      if idx.kind == ROWS and idx.axis != j:
        raise _Couple("scatters into examples at positions of other examples")
      if upd.kind == ROWS and (j >= len(scatter_dims) or upd.axis != scatter_dims[j]):
        raise _Couple("scatters updates of other examples into each example")
      return [_rows(r, ins)]
    if r in to_operand or r in inserted:
      raise _Couple("writes into examples of the batch chosen by index")
    if idx.kind == ROWS:
      raise _Couple("scatters per-example values at per-example positions along another "
                    "axis")
    return [_rows(r, ins)]
  # A free operand (a buffer) receiving per-example updates: a sum over the examples when
  # they are added up, else a write whose result depends on the order of the examples.
  if name in ("scatter-add", "scatter_add") and not ctx.out_b[0]:
    return [_sum(ins)]
  raise _Couple(f"{name} of per-example values into one buffer (the result depends on "
                "which examples land where)")


def _sort(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  axis = _rows_axis(ins)
  if any(f.kind == SUM for f in ins):
    raise _Couple("sorts sums over the examples")
  if int(ctx.params["dimension"]) == axis:
    raise _Couple("sorts along the examples of the batch")
  return [_rows(axis, ins)] * len(ctx.fo.outvars)


def _top_k(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM or f.axis == len(ctx.in_shape(0)) - 1:
    raise _Couple("takes the top k over the examples of the batch")
  return [_rows(f.axis, ins)] * len(ctx.fo.outvars)


def _split(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind == SUM:
    return [_sum(ins)] * len(ctx.fo.outvars)
  if int(ctx.params["axis"]) == f.axis:
    raise _Couple("splits the examples of the batch")
  return [_rows(f.axis, ins)] * len(ctx.fo.outvars)


def _reduce_window(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  f = ins[0]
  if f.kind != ROWS:
    raise _Couple("reduces windows of a sum over the examples")
  a = f.axis
  win = ctx.params.get("window_dimensions", ())
  strides = ctx.params.get("window_strides", ())
  pad = ctx.params.get("padding", ())
  base = ctx.params.get("base_dilation") or (1,) * len(win)
  wdil = ctx.params.get("window_dilation") or (1,) * len(win)
  if win and (int(win[a]) != 1 or int(strides[a]) != 1 or tuple(pad[a]) != (0, 0)
              or int(base[a]) != 1 or int(wdil[a]) != 1):
    raise _Couple("reduces windows across the examples of the batch")
  return [_rows(a, ins)] * len(ctx.fo.outvars)


def _fused_attention(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  """A fused attention call (cuDNN's, :data:`harpjax._compat.FUSED_ATTENTION_PRIMITIVES`):
  each example attends over its own sequence, so the query, key, value (and their cotangents)
  must carry the examples along their first axis (``B`` leads both layouts), and so does every
  result of that length; a result without the batch's length (the gradient of a bias shared by
  the examples) is a sum over them."""
  if any(f.kind == SUM for f in ins):
    raise _Couple("feeds a sum over the examples into attention")
  axis = _rows_axis(ins)
  if axis != 0:
    raise _Couple("attends over operands whose examples do not run along their first axis")
  _check_free_partners(ctx, ins, 0)
  rows = ctx.in_shape(0)[0]
  return [_rows(0, ins) if ctx.out_shape(k)[:1] == (rows,) else _sum(ins)
          for k in range(len(ctx.fo.outvars))]


def _optimization_barrier(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  return list(ins)


# --------------------------------------------------------------------------- bodies


def _bodies(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  """Ops with sub-jaxprs: calls, custom-derivative functions, scan, while, cond."""
  name = ctx.fo.name
  if name == "scan":
    return _scan(ctx, ins)
  if name == "while":
    return _while(ctx, ins)
  if name == "cond":
    return _cond(ctx, ins)
  body_f, body_m = _call_jaxpr(ctx.fo.params), _call_jaxpr(ctx.mo.params)
  if body_f is None or body_m is None:
    raise _Couple(f"harpjax does not know how {name} treats the examples of the batch")
  return _run_body(ctx, body_f, body_m, ins)


def _call_jaxpr(params):
  for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
    body = params.get(key)
    if isinstance(body, _compat.ClosedJaxpr):
      return body
    if isinstance(body, _compat.Jaxpr):
      return _compat.ClosedJaxpr(body, ())
  return None


def _run_body(ctx: _Ctx, body_f, body_m, ins: list[Flow]) -> list[Flow]:
  """The flows of a body's outputs from its inputs' (consts of the closed jaxpr: free)."""
  pf, pm = from_closed_jaxpr(body_f), from_closed_jaxpr(body_m)
  nc = pf.num_consts
  if len(pf.invars) - nc != len(ins):
    raise _Couple(f"{ctx.fo.name}'s body takes other operands than harpjax expects")
  sub = analyze(pf, pm, [_FREE] * nc + list(ins), ctx.M, body=True)
  if not sub.aligned:
    raise _Couple(f"the body of {ctx.fo.name} differs between the batch and a microbatch")
  _check_body_literals(ctx, sub)
  if sub.couplings:
    raise _Couple(f"inside {ctx.fo.name}: " + sub.couplings[0].reason)
  return list(sub.output_flows())


def _check_body_literals(ctx: _Ctx, sub: BatchFlow) -> None:
  """Constants that depend on the batch size inside a body on exact values cannot be
  rewritten there (they are at the top level)."""
  for fo, mo in zip(sub.full.ops, sub.mb.ops):
    if fo.index in sub.coupled_ops:
      continue
    for a, b in zip(fo.invars, mo.invars):
      if isinstance(a, Lit) and isinstance(b, Lit) and not _same_literal(a.value, b.value):
        raise _Couple(f"uses a constant that depends on the batch size ({a.value} for the "
                      f"batch, {b.value} for a microbatch) inside the body of {ctx.fo.name}")


def _same_literal(a, b) -> bool:
  try:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
  except (TypeError, ValueError):
    return a is b


def _join(a: Flow, b: Flow) -> Flow:
  """The flow of a value that is ``a`` or ``b`` (a loop's carry, a branch's result)."""
  param, data = a.param or b.param, a.data or b.data
  if a.kind == COUPLED or b.kind == COUPLED:
    return Flow(COUPLED, param=param, data=data)
  if a.kind == b.kind == FREE:
    return Flow(FREE, param=param, data=data, varies=a.varies or b.varies,
                zero=a.zero and b.zero)
  if {a.kind, b.kind} == {ROWS}:
    if a.axis != b.axis:
      return Flow(COUPLED, param=param, data=data)
    return Flow(ROWS, a.axis, param, data)
  if ROWS in (a.kind, b.kind):
    other = b if a.kind == ROWS else a
    rows = a if a.kind == ROWS else b
    if other.kind == FREE and not other.varies:
      return Flow(ROWS, rows.axis, param, data)
    return Flow(COUPLED, param=param, data=data)
  # sum with sum or free: a free part must be zero (each microbatch would add it again)
  other = b if a.kind == SUM else a
  if other.kind == SUM or other.zero:
    return Flow(SUM, param=param, data=data)
  return Flow(COUPLED, param=param, data=data)


def _scan(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  p = ctx.params
  nc, ncar = int(p["num_consts"]), int(p["num_carry"])
  consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
  x_in = []
  for f in xs:
    if f.kind == ROWS:
      if f.axis == 0:
        raise _Couple("scans over the examples of the batch")
      f = dataclasses.replace(f, axis=f.axis - 1, cols=())
    x_in.append(f)
  for _ in range(len(carry) + 3):
    outs = _run_body(ctx, p["jaxpr"], ctx.mo.params["jaxpr"], consts + carry + x_in)
    new = [_join(c, o) for c, o in zip(carry, outs[:ncar])]
    if new == carry:
      break
    carry = new
  else:
    raise _Couple("a loop whose carried values do not settle")
  ys = []
  for f in outs[ncar:]:
    if f.kind == ROWS:
      f = dataclasses.replace(f, axis=f.axis + 1, cols=())
    ys.append(f)
  return carry + ys


def _while(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  p = ctx.params
  cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
  cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
  for _ in range(len(carry) + 3):
    outs = _run_body(ctx, p["body_jaxpr"], ctx.mo.params["body_jaxpr"], bconsts + carry)
    new = [_join(c, o) for c, o in zip(carry, outs)]
    if new == carry:
      break
    carry = new
  else:
    raise _Couple("a loop whose carried values do not settle")
  pred = _run_body(ctx, p["cond_jaxpr"], ctx.mo.params["cond_jaxpr"], cconsts + carry)[0]
  if pred.kind != FREE:
    raise _Couple("a loop whose number of iterations is decided from the examples of the "
                  "batch")
  return carry


def _cond(ctx: _Ctx, ins: list[Flow]) -> list[Flow]:
  index, ops = ins[0], ins[1:]
  if index.kind != FREE:
    raise _Couple("chooses a branch from the examples of the batch (one choice for all of "
                  "them)")
  outs = None
  for bf, bm in zip(ctx.params["branches"], ctx.mo.params["branches"]):
    got = _run_body(ctx, bf, bm, ops)
    outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got)]
  return outs


_RULES = {
    "iota": _iota,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "rev": _rev,
    "slice": _slice,
    "pad": _pad,
    "concatenate": _concatenate,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather,
    "sort": _sort,
    "top_k": _top_k,
    "split": _split,
    "optimization_barrier": _optimization_barrier,
    **{n: _fused_attention for n in _compat.FUSED_ATTENTION_PRIMITIVES},
    **{n: _reduce for n in _REDUCTIONS},
    **{n: _cumulative for n in _CUMULATIVE},
    **{n: _scatter for n in _SCATTERS},
    **{n: _random for n in RANDOM_PRIMITIVES},
    **{n: _reduce_window for n in ("reduce_window", "reduce_window_sum", "reduce_window_max",
                                   "reduce_window_min")},
}
