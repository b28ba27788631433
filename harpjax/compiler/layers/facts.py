"""Per-op facts of a forward program that layer construction reads.

:func:`crossing_bytes` (bytes of the values live across each cut point) and :class:`Facts`
(op tokens from :func:`harpjax.compiler.trace.op_tokens`, forward FLOPs and compute-heavy
counts from :mod:`harpjax.compiler.trace.primitives`, crossing bytes, last uses), computed once
per program by :func:`op_facts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from harpjax.compiler.trace import Lit, Program, primitives, signature

__all__ = ["Aval", "lit_aval", "crossing_bytes", "Facts", "op_facts"]


class Aval(NamedTuple):
  shape: tuple
  dtype: Any


def lit_aval(v) -> Aval:
  return Aval(tuple(np.shape(v.value)), np.result_type(v.value))


def _ref_aval(program: Program, r):
  return lit_aval(r) if isinstance(r, Lit) else program.avals[r]


def crossing_bytes(program: Program) -> np.ndarray:
  """``out[c]`` = bytes of values defined before op ``c`` and read at or after it.

  Program inputs are not counted (they are fed to every stage directly); outputs count as read
  at the end. Shape ``[len(ops) + 1]``.
  """
  n = len(program.ops)
  diff = np.zeros(n + 2, dtype=np.int64)
  defined_at, last_use = _def_use(program)
  for v, lu in last_use.items():
    d = defined_at.get(v)
    if d is not None and lu > d:
      diff[d + 1] += program.nbytes(v)
      diff[lu + 1] -= program.nbytes(v)
  return np.cumsum(diff)[: n + 1]


def _def_use(program: Program) -> tuple[dict, dict]:
  n = len(program.ops)
  defined_at, last_use = {}, {}
  for op in program.ops:
    for v in op.outvars:
      if v >= 0:
        defined_at[v] = op.index
    for v in op.in_ids():
      last_use[v] = op.index
  for v in program.outvars:
    if not isinstance(v, Lit):
      last_use[v] = n
  return defined_at, last_use


@dataclasses.dataclass(frozen=True, eq=False)
class Facts:
  toks: signature.OpTokens
  flops: np.ndarray        # [n] forward FLOPs per op
  heavy: np.ndarray        # [n] compute-heavy ops per op
  cross: np.ndarray        # [n + 1] crossing bytes
  last_use: dict


def op_facts(program: Program, input_kinds) -> Facts:
  toks = signature.op_tokens(program, input_kinds)
  n = len(program.ops)
  flops = np.zeros(n)
  heavy = np.zeros(n, dtype=np.int64)
  for op in program.ops:
    ins = [_ref_aval(program, r) for r in op.invars]
    outs = [program.avals[o] if o >= 0 else Aval((), np.float32) for o in op.outvars]
    flops[op.index] = primitives.eqn_flops(op.name, op.params, ins, outs)
    heavy[op.index] = primitives.eqn_heavy_count(op.name, op.params)
  _, last_use = _def_use(program)
  return Facts(toks, flops, heavy, crossing_bytes(program), last_use)
