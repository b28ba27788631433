"""Scan unrolling: a ``scan`` over stacked layers becomes straight-line ops.

:func:`unroll_scans` replaces each ``scan`` whose body holds enough compute-heavy ops with
its iterations, so that layer construction sees them as module instances (name-stack
component ``<name>_<t>``). The unrolled program replaces ``TracedStep.region``; see
:func:`harpjax.compiler.layers.layers_for_step` and
:func:`harpjax.compiler.layers.traced_step_for`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from harpjax.compiler.layers.facts import lit_aval
from harpjax.compiler.layers.repeats import common_path
from harpjax.compiler.trace import Lit, Op, Program, from_closed_jaxpr, primitives

__all__ = ["unroll_scans"]

log = logging.getLogger(__name__)


def unroll_scans(program: Program, *, z: int = 1, max_length: int = 512,
                 only: frozenset | None = None) -> tuple[Program, tuple[int, ...] | None]:
  """Unrolls ``scan`` equations over stacked layers into straight-line ops.

  A scan is unrolled when its body holds at least ``z`` compute-heavy ops and its length is at
  most ``max_length``. Iteration ``t`` reads slice ``t`` of every stacked input (the slice ops
  sit just before their first use, so a layer slices what it needs), threads the carry, and
  stacked outputs are re-assembled after the last iteration. Value ids of the original program
  are kept (the scan's results become aliases); new values get new ids. Iteration ``t`` gets
  the name-stack component ``<name>_<t>`` (``iter_<t>`` for unnamed bodies) so that iterations
  are module instances.

  ``only`` (op indices) unrolls exactly those scans instead: the same unrolling of another trace
  of the program (the full batch's, see :func:`~harpjax.compiler.layers.traced_step_for`).

  Returns:
    ``(program, origin)``: the new program and, per op, the index of the op it copies (``-1``
    for unrolled ops); ``(program, None)`` when nothing was unrolled.
  """
  if only is not None:
    todo = set(only)
  else:
    todo = {op.index for op in program.ops if op.name == "scan"
            and int(op.params.get("length", 0)) <= max_length
            and primitives.jaxpr_heavy_count(op.params["jaxpr"].jaxpr) >= z}
  if not todo:
    return program, None
  avals = list(program.avals)
  ops: list[Op] = []
  origin: list[int] = []
  alias: dict[int, Any] = {}
  res = lambda r: r if isinstance(r, Lit) else alias.get(r, r)

  def aval(r):
    return lit_aval(r) if isinstance(r, Lit) else avals[r]

  def spec(r):
    a = aval(r)
    return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)

  def splice(sub: Program, consts, in_refs: list, stack: Callable[[str], str],
             lazy: Callable[[int], Any] | None = None, outer_remat: tuple = ()) -> list:
    env: dict[int, Any] = {v: Lit(c) for v, c in zip(sub.invars[:sub.num_consts], consts)}
    env.update(zip(sub.invars[sub.num_consts:], in_refs))
    made: dict[int, Any] = {}
    scopes: dict[int, Any] = {}   # the body's remat scopes, renumbered for this copy
    for op in sub.ops:
      ins = []
      for v in op.invars:
        r = v if isinstance(v, Lit) else env[v]
        if isinstance(r, _Lazy):
          if r.key not in made:
            made[r.key] = lazy(r.key)
          r = made[r.key]
        ins.append(r)
      outs = []
      for o in op.outvars:
        if o >= 0:
          avals.append(sub.avals[o])
          env[o] = len(avals) - 1
        outs.append(env[o] if o >= 0 else -1)
      remat = tuple(scopes.setdefault(sc.id, sc.renumbered()) for sc in op.remat)
      ops.append(Op(len(ops), op.primitive, op.params, tuple(ins), tuple(outs),
                    stack(op.name_stack), outer_remat + remat, op.source))
      origin.append(-1)
    return [r if isinstance(r, Lit) else env[r] for r in sub.outvars]

  def slice_at(x, t: int, stack, outer_remat):
    helper = jax.make_jaxpr(lambda a: jax.lax.index_in_dim(a, t, 0, keepdims=False))(spec(x))
    return splice(from_closed_jaxpr(helper), helper.consts, [x], stack,
                  outer_remat=outer_remat)[0]

  for op in program.ops:
    if op.index not in todo:
      ops.append(dataclasses.replace(op, index=len(ops),
                                     invars=tuple(res(v) for v in op.invars)))
      origin.append(op.index)
      continue
    p = op.params
    L, nc, ncar = int(p["length"]), int(p["num_consts"]), int(p["num_carry"])
    body = p["jaxpr"]
    sub = from_closed_jaxpr(body)
    first = common_path([tuple(x for x in o.name_stack.split("/") if x) for o in sub.ops])
    ins = [res(v) for v in op.invars]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    ys_steps = []
    for t in (range(L - 1, -1, -1) if p.get("reverse") else range(L)):
      stack = functools.partial(_iter_stack, op.name_stack, first[0] if first else "", t)
      outs = splice(sub, body.consts, consts + carry + [_Lazy(j) for j in range(len(xs))],
                    stack, lambda j, t=t, stack=stack: slice_at(xs[j], t, stack, op.remat),
                    outer_remat=op.remat)
      carry = outs[:ncar]
      ys_steps.append((t, outs[ncar:]))
    ys_steps.sort(key=lambda x: x[0])
    finals = list(carry)
    for j in range(len(op.outvars) - ncar):
      if op.outvars[ncar + j] < 0:
        finals.append(None)
        continue
      parts = [ys[j] for _, ys in ys_steps]
      helper = jax.make_jaxpr(lambda *a: jnp.stack(a))(*[spec(r) for r in parts])
      finals.append(splice(from_closed_jaxpr(helper), helper.consts, parts,
                           lambda s, st=op.name_stack: st, outer_remat=op.remat)[0])
    for o, r in zip(op.outvars, finals):
      if o >= 0 and r is not None:
        alias[o] = r
  outvars = tuple(res(v) for v in program.outvars)
  new = Program(tuple(avals), program.invars, outvars, tuple(ops), program.num_consts)
  log.info("unrolled %d scan(s): %d -> %d ops", len(todo), len(program.ops), len(ops))
  return new, tuple(origin)


class _Lazy(NamedTuple):
  key: int


def _iter_stack(outer: str, first: str, t: int, inner: str) -> str:
  """Name stack of an op of iteration ``t``: ``outer/<first>_<t>/...`` or ``outer/iter_<t>/...``."""
  parts = [p for p in inner.split("/") if p]
  if first and parts and parts[0] == first:
    parts = [f"{first}_{t}"] + parts[1:]
  elif first:
    parts = [f"{first}_{t}"] + parts
  else:
    parts = [f"iter_{t}"] + parts
  return "/".join(([outer] if outer else []) + parts)
