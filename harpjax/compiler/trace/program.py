"""A flat, integer-addressed copy of a jaxpr that harpjax can slice, place and re-run.

JAX's jaxprs are nested (``jit`` inside ``jit``) and addressed by ``Var`` objects whose
constructor changes between releases. harpjax works on a :class:`Program` instead: a flat tuple
of :class:`Op` (call primitives such as ``jit`` inlined), values addressed by small integers,
literals kept as :class:`Lit`. Rematerialised bodies (``jax.checkpoint``, ``nn.remat``) are
inlined too, each op remembering the :class:`RematScope` s around it, and :func:`eval_ops`
wraps the ops of one scope in ``jax.checkpoint`` again: layer construction and random-number
alignment see every op, and the memory behaviour the user asked for is kept. Slicing a program
into stages, placing the optimizer update on stages and evaluating any slice are then plain
list manipulations, and only :func:`harpjax._compat.bind_eqn` touches JAX internals.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import numpy as np

from harpjax import _compat

__all__ = ["Lit", "Op", "Program", "from_closed_jaxpr", "eval_ops", "ops_function",
           "strip_markers", "Ref", "RematScope"]


class Lit(NamedTuple):
  """A literal operand (a Python or NumPy scalar baked into the jaxpr)."""
  value: Any


Ref = "int | Lit"

_scope_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class RematScope:
  """One inlined ``jax.checkpoint`` equation: ops with the same scope ran inside it.

  Attributes:
    id: distinct per inlined equation (per unrolled iteration, too).
    prevent_cse / policy: the equation's parameters, re-applied by :func:`eval_ops`.
  """
  id: int
  prevent_cse: bool = True
  policy: Any = None

  def renumbered(self) -> "RematScope":
    """The same scope under a new id (one per copy of its body, e.g. per unrolled step)."""
    return dataclasses.replace(self, id=next(_scope_ids))


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
    remat: the :class:`RematScope` s the op sat in, outermost first (``()``: none).
    source: the equation's source information, then that of the calls it was inlined from,
      innermost first (for messages: :func:`harpjax._compat.describe_source`).
  """
  index: int
  primitive: Any
  params: dict
  invars: tuple
  outvars: tuple
  name_stack: str = ""
  remat: tuple = ()
  source: tuple = ()

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
      default inlines ``jit``/``pjit``/``closed_call``/``core_call`` and ``checkpoint``
      (``remat``) bodies, the latter's ops tagged with a :class:`RematScope`.

  Returns:
    The program. Value ids ``0 .. len(invars)-1`` are the inputs.
  """
  if inline is None:
    inline = lambda eqn: eqn.primitive.name in _compat.CALL_PRIMITIVES
  avals: list = []
  ops: list[Op] = []

  def new_id(aval) -> int:
    avals.append(aval)
    return len(avals) - 1

  def read(env, v):
    if _compat.is_literal(v):
      return Lit(_compat.literal_value(v))
    return env[v]

  def walk(jaxpr, env, stack: str, scopes: tuple, sources: tuple = ()):
    for eqn in jaxpr.eqns:
      eqn_stack = _join(stack, _compat.eqn_name_stack(eqn))
      body = _compat.subjaxpr_of_call(eqn) if inline(eqn) else None
      if body is not None:
        inner: dict = {}
        for cv, c in zip(body.jaxpr.constvars, body.consts):
          inner[cv] = Lit(c)
        for iv, ov in zip(body.jaxpr.invars, eqn.invars):
          inner[iv] = read(env, ov)
        inner_scopes = scopes
        if eqn.primitive.name in _compat.REMAT_PRIMITIVES:
          inner_scopes = scopes + (RematScope(next(_scope_ids),
                                              bool(eqn.params.get("prevent_cse", True)),
                                              eqn.params.get("policy")),)
        walk(body.jaxpr, inner, eqn_stack, inner_scopes,
             (_compat.eqn_source_info(eqn),) + sources)
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
      ops.append(Op(len(ops), eqn.primitive, dict(eqn.params), ins, tuple(outs), eqn_stack,
                    scopes, (_compat.eqn_source_info(eqn),) + sources))

  env: dict = {}
  invars = []
  for v in list(closed.jaxpr.constvars) + list(closed.jaxpr.invars):
    vid = new_id(v.aval)
    env[v] = vid
    invars.append(vid)
  walk(closed.jaxpr, env, "", ())
  outvars = tuple(read(env, v) for v in closed.jaxpr.outvars)
  return Program(tuple(avals), tuple(invars), outvars, tuple(ops),
                 num_consts=len(closed.jaxpr.constvars))


def eval_ops(ops: Sequence[Op], env: dict, hook: Callable[[Op, list], list | None] | None = None,
             live: Iterable[int] | None = None) -> dict:
  """Evaluates ``ops`` in order, reading and writing ``env`` (value id -> array or tracer).

  Consecutive ops of one :class:`RematScope` run inside ``jax.checkpoint`` with the scope's
  policy, as the traced program did.

  Args:
    ops: the equations to run.
    env: values of every id the ops read that they do not define; updated in place.
    hook: optional ``hook(op, invals)`` returning replacement outputs for an op, or ``None`` to
      bind it normally (used to rewrite random-bit generation per microbatch).
    live: the ids the caller reads afterwards (``None``: any); a rematerialised scope returns
      only those of its values and the ones later ops read, so that the rest is recomputed.

  Returns:
    ``env``.
  """
  ops = list(ops)
  if not any(op.remat for op in ops):
    for op in ops:
      _eval_op(op, env, hook)
    return env
  segments = []   # [start, end, outermost scope or None]
  for i, op in enumerate(ops):
    scope = op.remat[0] if op.remat else None
    if segments and segments[-1][2] == scope:
      segments[-1][1] = i + 1
    else:
      segments.append([i, i + 1, scope])
  needed_after = []   # per segment: ids read by later segments (or live)
  later = set(live) if live is not None else None
  for a, b, _ in reversed(segments):
    needed_after.append(None if later is None else set(later))
    if later is not None:
      for op in ops[a:b]:
        later.update(op.in_ids())
  needed_after.reverse()
  for (a, b, scope), after in zip(segments, needed_after):
    if scope is None:
      for op in ops[a:b]:
        _eval_op(op, env, hook)
      continue
    _eval_remat(ops[a:b], scope, env, hook, after)
  return env


def _eval_op(op: Op, env: dict, hook) -> None:
  invals = [v.value if isinstance(v, Lit) else env[v] for v in op.invars]
  outs = hook(op, invals) if hook is not None else None
  if outs is None:
    outs = _compat.bind_eqn(op.primitive, op.params, invals)
  for vid, val in zip(op.outvars, outs):
    if vid >= 0:
      env[vid] = val


def _eval_remat(ops: list, scope: RematScope, env: dict, hook, after: set | None) -> None:
  """Runs the ops of one rematerialised scope inside ``jax.checkpoint``."""
  defined, inputs, seen = set(), [], set()
  for op in ops:
    for v in op.in_ids():
      if v not in defined and v not in seen:
        seen.add(v)
        inputs.append(v)
    defined.update(v for v in op.outvars if v >= 0)
  outputs = [v for op in ops for v in op.outvars
             if v >= 0 and (after is None or v in after)]
  inner = [dataclasses.replace(op, remat=op.remat[1:]) for op in ops]

  def body(*values):
    local = dict(zip(inputs, values))
    eval_ops(inner, local, hook, live=outputs)
    return tuple(local[v] for v in outputs)

  results = jax.checkpoint(body, prevent_cse=scope.prevent_cse, policy=scope.policy)(
      *[env[v] for v in inputs])
  env.update(zip(outputs, results))


def ops_function(ops: Sequence[Op], in_ids: Sequence[int], out_ids: Sequence[int],
                 constants: dict | None = None) -> Callable:
  """``ops`` as a function: ``fn(*values of in_ids, hook=None) -> values of out_ids`` (see
  :func:`eval_ops` for ``hook``); ``constants`` are further inputs known in advance."""
  out_ids = tuple(out_ids)

  def fn(*inputs, hook=None):
    env = dict(constants or {})
    env.update(zip(in_ids, inputs))
    eval_ops(ops, env, hook, live=out_ids)
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
