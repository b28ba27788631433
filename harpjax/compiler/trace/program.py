"""A flat, integer-addressed copy of a jaxpr that harpjax can slice, place and re-run.

JAX's jaxprs are nested (``jit`` inside ``jit``) and addressed by ``Var`` objects whose
constructor changes between releases. harpjax works on a :class:`Program` instead: a flat tuple
of :class:`Op` (call primitives such as ``jit`` inlined), values addressed by small integers,
literals kept as :class:`Lit`. Slicing a program into stages, placing the optimizer update on
stages and evaluating any slice are then plain list manipulations, and only
:func:`harpjax._compat.bind_eqn` touches JAX internals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from harpjax import _compat

__all__ = ["Lit", "Op", "Program", "from_closed_jaxpr", "eval_ops", "ops_function",
           "strip_markers", "Ref"]


class Lit(NamedTuple):
  """A literal operand (a Python or NumPy scalar baked into the jaxpr)."""
  value: Any


Ref = "int | Lit"


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
  """One equation of a flat program.

  Attributes:
    index: position in :attr:`Program.ops`.
    primitive: the JAX primitive.
    params: the equation's parameters (sub-jaxprs of non-inlined ops included).
    invars: operand ids or :class:`Lit` literals.
    outvars: result ids; ``-1`` for results nobody reads (JAX's ``_``).
    name_stack: module path from the jaxpr's name stack (``"block_3/attn"``), may be ``""``.
  """
  index: int
  primitive: Any
  params: dict
  invars: tuple
  outvars: tuple
  name_stack: str = ""

  @property
  def name(self) -> str:
    return self.primitive.name

  def in_ids(self) -> Iterable[int]:
    return (v for v in self.invars if not isinstance(v, Lit))


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A flat program.

  Attributes:
    avals: ``avals[i]`` is the abstract value (shape, dtype) of value ``i``.
    invars: input value ids, in order (the jaxpr's constants first, then its inputs).
    outvars: output refs (ids or literals).
    ops: the equations in a valid execution order.
    num_consts: how many leading ``invars`` were the closed jaxpr's constants.
  """
  avals: tuple
  invars: tuple
  outvars: tuple
  ops: tuple
  num_consts: int = 0

  def producers(self) -> dict[int, int]:
    """Value id -> index of the op defining it (inputs are absent)."""
    out = {}
    for op in self.ops:
      for v in op.outvars:
        if v >= 0:
          out[v] = op.index
    return out

  def consumers(self) -> dict[int, list[int]]:
    """Value id -> indices of the ops reading it, in order."""
    out: dict[int, list[int]] = {}
    for op in self.ops:
      for v in op.in_ids():
        out.setdefault(v, []).append(op.index)
    return out

  def dependents(self, roots, sources=()) -> set[int]:
    """Ids that depend, transitively, on ``roots``; the results of the ops whose index is in
    ``sources`` count as roots too."""
    dep = set(roots)
    for op in self.ops:
      if op.index in sources or any(v in dep for v in op.in_ids()):
        dep.update(v for v in op.outvars if v >= 0)
    return dep

  def nbytes(self, vid: int) -> int:
    aval = self.avals[vid]
    try:
      return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
      return int(np.prod(aval.shape, dtype=np.int64)) * 8


def from_closed_jaxpr(closed, inline: Callable[[Any], bool] | None = None) -> Program:
  """Flattens a ``ClosedJaxpr`` into a :class:`Program`.

  Args:
    closed: the closed jaxpr; its constants become the leading inputs.
    inline: predicate on an equation deciding whether to inline a call primitive's body;
      default inlines ``jit``/``pjit``/``closed_call``/``core_call`` but keeps ``remat`` opaque.

  Returns:
    The program. Value ids ``0 .. len(invars)-1`` are the inputs.
  """
  if inline is None:
    inline = lambda eqn: eqn.primitive.name in ("jit", "pjit", "closed_call", "core_call")
  avals: list = []
  ops: list[Op] = []

  def new_id(aval) -> int:
    avals.append(aval)
    return len(avals) - 1

  def read(env, v):
    if _compat.is_literal(v):
      return Lit(_compat.literal_value(v))
    return env[v]

  def walk(jaxpr, env, stack: str):
    for eqn in jaxpr.eqns:
      eqn_stack = _join(stack, _compat.eqn_name_stack(eqn))
      body = _compat.subjaxpr_of_call(eqn) if inline(eqn) else None
      if body is not None:
        inner: dict = {}
        for cv, c in zip(body.jaxpr.constvars, body.consts):
          inner[cv] = Lit(c)
        for iv, ov in zip(body.jaxpr.invars, eqn.invars):
          inner[iv] = read(env, ov)
        walk(body.jaxpr, inner, eqn_stack)
        for ov, bv in zip(eqn.outvars, body.jaxpr.outvars):
          if not _compat.is_dropvar(ov):
            env[ov] = read(inner, bv)
        continue
      ins = tuple(read(env, v) for v in eqn.invars)
      outs = []
      for v in eqn.outvars:
        if _compat.is_dropvar(v):
          outs.append(-1)
        else:
          vid = new_id(v.aval)
          env[v] = vid
          outs.append(vid)
      ops.append(Op(len(ops), eqn.primitive, dict(eqn.params), ins, tuple(outs), eqn_stack))

  env: dict = {}
  invars = []
  for v in list(closed.jaxpr.constvars) + list(closed.jaxpr.invars):
    vid = new_id(v.aval)
    env[v] = vid
    invars.append(vid)
  walk(closed.jaxpr, env, "")
  outvars = tuple(read(env, v) for v in closed.jaxpr.outvars)
  return Program(tuple(avals), tuple(invars), outvars, tuple(ops),
                 num_consts=len(closed.jaxpr.constvars))


def eval_ops(ops: Sequence[Op], env: dict, hook: Callable[[Op, list], list | None] | None = None
             ) -> dict:
  """Evaluates ``ops`` in order, reading and writing ``env`` (value id -> array or tracer).

  Args:
    ops: the equations to run.
    env: values of every id the ops read that they do not define; updated in place.
    hook: optional ``hook(op, invals)`` returning replacement outputs for an op, or ``None`` to
      bind it normally (used to rewrite random-bit generation per microbatch).

  Returns:
    ``env``.
  """
  for op in ops:
    invals = [v.value if isinstance(v, Lit) else env[v] for v in op.invars]
    outs = hook(op, invals) if hook is not None else None
    if outs is None:
      outs = _compat.bind_eqn(op.primitive, op.params, invals)
    for vid, val in zip(op.outvars, outs):
      if vid >= 0:
        env[vid] = val
  return env


def ops_function(ops: Sequence[Op], in_ids: Sequence[int], out_ids: Sequence[int],
                 constants: dict | None = None) -> Callable:
  """``ops`` as a function: ``fn(*values of in_ids, hook=None) -> values of out_ids`` (see
  :func:`eval_ops` for ``hook``); ``constants`` are further inputs known in advance."""
  def fn(*inputs, hook=None):
    env = dict(constants or {})
    env.update(zip(in_ids, inputs))
    eval_ops(ops, env, hook)
    return tuple(env[v] for v in out_ids)
  return fn


def strip_markers(program: Program, marker: str) -> tuple[Program, list[int]]:
  """Removes identity marker ops named ``marker`` (layer boundaries).

  Returns:
    The program without marker ops (their results replaced by their operands) and the cut
    positions: op indices in the new program before which a marker stood.
  """
  alias: dict[int, object] = {}
  ops: list[Op] = []
  cuts: list[int] = []
  res = lambda r: r if isinstance(r, Lit) else alias.get(r, r)
  for op in program.ops:
    if op.name == marker:
      for o, i in zip(op.outvars, op.invars):
        if o >= 0:
          alias[o] = res(i)
      if not cuts or cuts[-1] != len(ops):
        cuts.append(len(ops))
      continue
    ops.append(dataclasses.replace(op, index=len(ops), invars=tuple(res(v) for v in op.invars)))
  outvars = tuple(res(v) for v in program.outvars)
  cuts = [c for c in cuts if 0 < c < len(ops)]
  return Program(program.avals, program.invars, outvars, tuple(ops), program.num_consts), cuts


def _join(outer: str, inner: str) -> str:
  if not outer:
    return inner
  if not inner:
    return outer
  return f"{outer}/{inner}"
