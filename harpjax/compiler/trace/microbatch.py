"""The program one microbatch runs, such that the microbatches' results make the batch's.

From a :class:`~harpjax.compiler.trace.batchflow.BatchFlow`, the region traced at microbatch
size is rewritten (:func:`rewrite`):

* **hoisted values** (from the batch's data alone: a mask's token count, the denominator of a
  normalised loss) become new inputs of the region, computed once on the whole batch (the
  prelude, :func:`prelude_ops`); the ops that read them read the whole batch's value;
* **sums over the examples** come out in *mean-exact form*: each microbatch's value is its own
  part times the number of microbatches, so that averaging the microbatches' values gives the
  batch's exactly, a constant term included (``mean(ce) + l2(params)``). Where the program
  already divides by the microbatch's size (``jnp.mean``), nothing is added: the scale of every
  value relative to its mean-exact form is tracked through linear ops (``r`` below), and a
  multiplication is inserted only before an op that needs the value itself (a non-linear op,
  an output, a sum with a constant);
* **constants that depend on the batch size** (``x / x.shape[0]``, ``jnp.sqrt(n)``) take the
  whole batch's value, by the same scale tracking where they multiply or divide.

Ops where examples meet (``coupled``) run as the microbatch alone would run them (its own
constants, its values before any rescaling): the per-microbatch semantics every pipeline has.

The rewrite of the microbatch's program fixes the *structure* (which ops are inserted where);
the full batch's program and the programs of other microbatch sizes (groups of a stage that
split rows) follow the same structure with their own constants, so that all stay op for op
aligned (:class:`Structure`).
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Any

import numpy as np

from harpjax import _compat
from harpjax.compiler.trace import primitives
from harpjax.compiler.trace.batchflow import COUPLED, FREE, ROWS, SUM, BatchFlow
from harpjax.compiler.trace.program import Lit, Op, Program

__all__ = ["Structure", "rewrite", "prelude_ops", "RewriteError", "combine_rules", "hoisted_ids"]

_SAME_LINEAR = frozenset({"add", "sub", "add_any", "add_jaxvals", "select_n", "concatenate",
                          "dynamic_update_slice", "pad"})
"""Ops linear in their (non-index) operands jointly: equal scales pass through."""
_UNARY = frozenset({"neg", "convert_element_type", "reduce_sum", "broadcast_in_dim", "reshape",
                    "transpose", "squeeze", "slice", "rev", "copy", "copy_p", "stop_gradient",
                    "dynamic_slice", "gather", "cumsum", "sharding_constraint", "real", "imag",
                    "conj", "reduce_window_sum", "split", "name"})
"""Ops linear in their first operand (the others are indices or absent)."""
_PRODUCT = frozenset({"mul", "dot_general", "conv_general_dilated"})
_BODIES = frozenset({"scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "pjit",
                     "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"})


class RewriteError(Exception):
  """A program of another microbatch size needs a rescaling where the microbatch's does not
  (its structure would differ)."""


@dataclasses.dataclass(frozen=True)
class Structure:
  """What the rewrite inserts and changes, fixed by the microbatch's program.

  Attributes:
    hoisted: the hoisted value ids, in the order of the new inputs.
    hoist_axes: per hoisted value, ``-1`` (whole) or the row axis (split per microbatch).
    rescales: ``{(op index or -1 for the outputs, value id): None}``: values multiplied
      before an op reads them (``-1``: before the region returns them).
    literals: ``{(op index, operand position)}`` whose literal takes the full batch's value.
  """
  hoisted: tuple
  hoist_axes: tuple
  rescales: frozenset
  literals: frozenset


def hoisted_ids(flow: BatchFlow) -> tuple:
  """The hoistable values that an exact op or an output reads (sorted)."""
  if not flow.aligned:
    return ()
  mb_sem = _mb_semantics(flow)
  used = set()
  for op in flow.mb.ops:
    if op.index in mb_sem:
      continue
    used.update(v for v in op.in_ids() if v in flow.hoistable)
  used.update(v for v in flow.mb.outvars if not isinstance(v, Lit) and v in flow.hoistable)
  return tuple(sorted(used))


def _mb_semantics(flow: BatchFlow) -> frozenset:
  """Ops that run as the microbatch alone runs them (its own constants, its values before any
  rescaling): coupled ones, those computing hoisted values (still run for the coupled ops that
  read them), and the ops of values without examples that only those read (the labels
  ``(jnp.arange(2 * n) + n) % (2 * n)`` of an in-batch loss are the microbatch's)."""
  mb = set(flow.coupled_ops)
  mb.update(op.index for op in flow.mb.ops
            if any(v in flow.hoistable for v in op.outvars if v >= 0))
  consumers = flow.mb.consumers()
  outputs = {v for v in flow.mb.outvars if not isinstance(v, Lit)}
  for op in reversed(flow.mb.ops):
    outs = [v for v in op.outvars if v >= 0]
    if op.index in mb or not outs or any(v in outputs for v in outs):
      continue
    readers = [c for v in outs for c in consumers.get(v, ())]
    if readers and all(flow.flows[v].kind == FREE for v in outs) and all(c in mb
                                                                          for c in readers):
      mb.add(op.index)
  return frozenset(mb)


def rewrite(flow: BatchFlow, program: Program, factor, structure: Structure | None = None
            ) -> tuple[Program, Structure, list[int]]:
  """The microbatch's program for ``program`` (``flow.mb``, ``flow.full`` or the region traced
  at another microbatch size, op for op aligned with them).

  Args:
    flow: the analysis.
    program: the program to rewrite.
    factor: the full batch's rows over ``program``'s (B for a microbatch, 1 for the full
      batch; a :class:`fractions.Fraction` for a group's part of a microbatch).
    structure: the structure to follow (from the rewrite of ``flow.mb``); ``None`` fixes it.

  Returns:
    ``(program, structure, new_index)``: ``new_index[i]`` is where old op ``i``'s first
    emitted op (an inserted rescaling, or itself) lands, ``len(ops)`` for the end.

  Raises:
    RewriteError: ``structure`` is given and ``program`` needs a rescaling elsewhere.
  """
  F = fractions.Fraction(factor)
  full = flow.full
  fixing = structure is None
  if not fixing and F == 1 and not (structure.hoisted or structure.rescales
                                    or structure.literals):
    return program, structure, list(range(len(program.ops) + 1))   # nothing to change
  mb_sem = _mb_semantics(flow)
  if fixing:
    hoisted = hoisted_ids(flow)
    structure = Structure(hoisted, tuple(flow.hoistable[v] for v in hoisted), frozenset(),
                          frozenset())
  rescales, literals = set(), set()
  avals = list(program.avals)
  invars = list(program.invars)
  hoist_new = {}
  for v in structure.hoisted:
    avals.append(program.avals[v])
    hoist_new[v] = len(avals) - 1
    invars.append(len(avals) - 1)
  r: dict[int, fractions.Fraction] = {}   # value id -> scale relative to its mean-exact form
  cache: dict[tuple, int] = {}
  ops: list[Op] = []
  new_index: list[int] = []

  def flow_of(v):
    return flow.flows.get(v) if not isinstance(v, Lit) else None

  def scale_of(v) -> fractions.Fraction:
    return fractions.Fraction(1) if isinstance(v, Lit) else r.get(v, fractions.Fraction(1))

  def normalized(v, target, at: int, like: Op):
    """``v`` at scale ``target`` (an inserted multiplication where it is not)."""
    if isinstance(v, Lit):
      return v
    have = scale_of(v)
    key = (at, v)
    f = flow_of(v)
    if have == target or (f is not None and f.zero):
      if not fixing and key in structure.rescales:
        pass   # the microbatch's program multiplies here: so does this one (by one)
      else:
        return v
    elif not fixing and key not in structure.rescales:
      raise RewriteError(f"value {v} needs rescaling before op {at} at this size only")
    if fixing:
      rescales.add(key)
    c = (key, target)
    if c in cache:
      return cache[c]
    aval = avals[v]
    if not primitives.is_float(aval):
      raise RewriteError(f"integer value {v} at scale {have}")
    const = np.asarray(float(target / have), dtype=aval.dtype)
    avals.append(aval)
    out = len(avals) - 1
    prim, params = _compat.mul_eqn()
    ops.append(Op(len(ops), prim, dict(params), (v, Lit(const)), (out,), like.name_stack,
                  like.remat, like.source))
    r[out] = target
    cache[c] = out
    return out

  for op, fo in zip(program.ops, full.ops):
    new_index.append(len(ops))
    i = op.index
    if i in mb_sem:
      ops.append(_moved(op, len(ops)))
      for v in op.outvars:
        if v >= 0:
          r[v] = fractions.Fraction(1)
      continue
    ins = [hoist_new.get(v, v) if not isinstance(v, Lit) else v for v in op.invars]
    ins, out_r = _rescale_op(op, fo, ins, flow, F, scale_of, normalized, literals, structure,
                             fixing, avals.__getitem__)
    ins = tuple(ins)
    ops.append(_moved(op, len(ops)) if ins == op.invars else
               dataclasses.replace(op, index=len(ops), invars=ins))
    for v, scale in zip(op.outvars, out_r):
      if v >= 0:
        r[v] = scale if primitives.is_float(program.avals[v]) else _int_scale(flow, v, F)
  # Outputs: exact floating outputs in mean-exact form.
  outvars = []
  end = Op(len(ops), _compat.mul_eqn()[0], {}, (), (),
           program.ops[-1].name_stack if program.ops else "", (), ())
  for v in program.outvars:
    if isinstance(v, Lit):
      outvars.append(v)
      continue
    v2 = hoist_new.get(v, v)
    f = flow.flows.get(v)
    if f is not None and f.kind != COUPLED and primitives.is_float(program.avals[v]):
      v2 = normalized(v2, fractions.Fraction(1), -1, end)
    outvars.append(v2)
  new_index.append(len(ops))
  new = Program(tuple(avals), tuple(invars), tuple(outvars), tuple(ops), program.num_consts)
  if structure.hoisted:
    new, kept = _drop_dead(new, program)
    new_index = [kept[k] for k in new_index]
  elif len(ops) == len(program.ops) and all(a is b for a, b in zip(ops, program.ops)) and \
      tuple(outvars) == tuple(program.outvars):
    new = program   # unchanged
  if fixing:
    structure = dataclasses.replace(structure, rescales=frozenset(rescales),
                                    literals=frozenset(literals))
  return new, structure, new_index


def _moved(op: Op, index: int) -> Op:
  """``op`` at position ``index`` (itself where it stays)."""
  return op if op.index == index else dataclasses.replace(op, index=index)


def _int_scale(flow: BatchFlow, v: int, F) -> fractions.Fraction:
  """Integer values are never rescaled: a sum over the examples stays the microbatch's part."""
  f = flow.flows.get(v)
  return fractions.Fraction(1) / F if f is not None and f.kind == SUM else fractions.Fraction(1)


def _rescale_op(op: Op, fo: Op, ins: list, flow: BatchFlow, F, scale_of, normalized,
                literals: set, structure: Structure, fixing: bool, aval_of):
  """An exact op's operands (rescaled where needed, literals replaced by the full batch's) and
  the scale of each of its results."""
  one = fractions.Fraction(1)
  name = op.name
  differing = {}   # operand position -> (this program's literal, the full batch's)
  for k, (a, b) in enumerate(zip(op.invars, fo.invars)):
    if isinstance(a, Lit) and isinstance(b, Lit) and (
        not _same(a.value, b.value) or (not fixing and (op.index, k) in structure.literals)):
      differing[k] = (a, b)
  in_flows = [None if isinstance(v, Lit) else flow.flows.get(v) for v in op.invars]
  out_flows = [flow.flows.get(v) if v >= 0 else None for v in op.outvars]
  is_sum = lambda f: f is not None and f.kind == SUM
  reduction = any(is_sum(f) for f in out_flows) and any(
      f is not None and f.kind == ROWS for f in in_flows)

  def substitute(positions):
    for k in positions:
      if k in differing:
        literals.add((op.index, k))
        ins[k] = differing[k][1]

  def to(k, target):
    ins[k] = normalized(ins[k], target, op.index, op)

  floats = [k for k, v in enumerate(ins) if not isinstance(v, Lit)
            and primitives.is_float(aval_of(v))]

  def result(scale):
    return [scale] * len(op.outvars)

  if name in _BODIES:   # bodies are not rewritten: values in, as the body expects them
    substitute(list(differing))
    for k in floats:
      to(k, one / F if is_sum(in_flows[k]) else one)
    return ins, [one / F if is_sum(f) else one for f in out_flows]
  outs_float = all(primitives.is_float(aval_of(v)) for v in op.outvars if v >= 0)
  if not outs_float:
    substitute(list(differing))
    for k in floats:
      to(k, one)
    return ins, result(one)
  if name in ("mul", "div") and all(_nonzero(a.value) and _nonzero(b.value)
                                    for a, b in differing.values()):
    scale = one
    for k, v in enumerate(ins):
      if k in differing:
        a, b = differing[k]
        s = _fraction(a.value) / _fraction(b.value)
      elif isinstance(v, Lit):
        continue
      else:
        s = scale_of(v)
      scale = scale / s if (name == "div" and k == 1) else scale * s
    return ins, result(scale)
  substitute(list(differing))
  if name in ("scatter-add", "scatter_add") and reduction:
    to(0, one)
    to(2, F)   # each microbatch's part of the sum, times the number of parts
    return ins, result(one)
  if name in _PRODUCT:
    scale = one
    for k in floats:
      scale *= scale_of(ins[k])
    return ins, result(scale / F if reduction else scale)
  if name in _UNARY and floats and floats[0] == 0:
    for k in floats[1:]:
      to(k, one)
    scale = scale_of(ins[0])
    return ins, result(scale / F if reduction else scale)
  if name in _SAME_LINEAR or name in ("scatter-add", "scatter_add", "scatter"):
    values = [k for k in range(len(ins)) if _is_value_operand(name, k)]
    constant = any(isinstance(ins[k], Lit) and np.any(np.asarray(ins[k].value)) for k in values)
    movable = [k for k in values if k in floats]
    scales = {scale_of(ins[k]) for k in movable}
    if not constant and len(scales) == 1:
      return ins, result(scales.pop())
    for k in movable:
      to(k, one)
    return ins, result(one)
  for k in floats:   # anything else needs the values themselves
    to(k, one)
  return ins, result(one)


def _is_value_operand(name: str, k: int) -> bool:
  """Operands an op is linear in (not predicates or indices)."""
  if name == "select_n":
    return k >= 1
  if name == "dynamic_update_slice":
    return k in (0, 1)
  if name in ("scatter", "scatter-add", "scatter_add"):
    return k in (0, 2)
  return True


def _fraction(x) -> fractions.Fraction:
  return fractions.Fraction(float(np.asarray(x)))


def _same(a, b) -> bool:
  try:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
  except (TypeError, ValueError):
    return a is b


def _nonzero(x) -> bool:
  try:
    return bool(np.all(np.asarray(x) != 0)) and np.ndim(x) == 0
  except (TypeError, ValueError):
    return False


def _drop_dead(new: Program, old: Program) -> tuple[Program, list[int]]:
  """Leaves out the ops of ``old`` whose results were read before the rewrite and are not any
  more (only their hoisted values were needed). Returns the program and, per op position of
  ``new`` (and one past its end), its position in the result."""
  live_old, live_new = _live_values(old), _live_values(new)
  pos, ops = [], []
  for op in new.ops:
    pos.append(len(ops))
    outs = [v for v in op.outvars if v >= 0]
    dead = _pure(op) and outs and not any(v in live_new for v in outs) and \
        any(v in live_old for v in outs)
    if not dead:
      ops.append(_moved(op, len(ops)))
  pos.append(len(ops))
  return Program(new.avals, new.invars, new.outvars, tuple(ops), new.num_consts), pos


def _live_values(program: Program) -> set:
  """The values the outputs read, transitively (and what effectful ops read)."""
  need = {v for v in program.outvars if not isinstance(v, Lit)}
  for op in reversed(program.ops):
    if any(v in need for v in op.outvars if v >= 0) or not _pure(op):
      need.update(op.in_ids())
  return need


def _pure(op: Op) -> bool:
  return op.name not in ("debug_callback", "io_callback", "pure_callback", "debug_print")


def prelude_ops(flow: BatchFlow, hoisted, region_inputs) -> tuple[list[Op], dict, list]:
  """The ops of the full batch's program that compute ``hoisted`` values from the region's
  inputs, as ops of the step's outer program.

  Args:
    flow: the analysis (``flow.full`` is the source).
    hoisted: value ids of ``flow.full`` to compute.
    region_inputs: per input of the region, the outer program's reference (id or literal).

  Returns:
    ``(ops, new_values, out_refs)``: the ops (outer value ids: ``new_values`` maps each
    region value id to a placeholder key ``("v", id)`` the caller renumbers), and per hoisted
    value its outer reference (a placeholder or an outer reference).
  """
  full = flow.full
  env: dict[int, Any] = dict(zip(full.invars, region_inputs))
  need = set(hoisted)
  producer = full.producers()
  todo = set()
  stack = [v for v in need if v in producer]
  while stack:
    v = stack.pop()
    p = producer[v]
    if p in todo:
      continue
    todo.add(p)
    stack.extend(u for u in full.ops[p].in_ids() if u in producer)
  ops = []
  for op in full.ops:
    if op.index not in todo:
      continue
    ins = tuple(v if isinstance(v, Lit) else env[v] for v in op.invars)
    outs = []
    for v in op.outvars:
      if v < 0:
        outs.append(-1)
        continue
      env[v] = ("v", v)
      outs.append(("v", v))
    ops.append(dataclasses.replace(op, invars=ins, outvars=tuple(outs), remat=()))
  return ops, env, [env[v] for v in hoisted]


def combine_rules(output_flows, program: Program, reduction: str = "mean") -> tuple:
  """How each region output (the loss first) combines over the microbatches: ``("concat",
  axis)`` (per-example), ``"mean"`` (mean-exact values; averaged), ``"sum"`` (integer counts
  over the examples, or ``reduction="sum"`` for coupled outputs) or ``"first"`` (the same in
  every microbatch)."""
  out = []
  for v, f in zip(program.outvars, output_flows):
    aval = _compat_aval(v, program)
    is_float = primitives.is_float(aval)
    if f.kind == ROWS:
      out.append(("concat", f.axis))
    elif f.kind == FREE:
      out.append("first")
    elif f.kind == SUM:
      out.append("mean" if is_float else "sum")
    else:
      out.append("sum" if (not is_float or reduction == "sum") else "mean")
  return tuple(out)


def _compat_aval(v, program: Program):
  return _compat.aval_of(v.value) if isinstance(v, Lit) else program.avals[v]
