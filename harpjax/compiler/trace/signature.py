"""Structural identity: canonical hashes of equations, layers and jaxprs.

Two pieces of a program are *the same computation* when their equations agree in primitive,
parameters, operand/result shapes and dtypes and in how values flow between them, whatever the
variables are called. This module hashes that canonical form:

* :func:`op_tokens` gives every op of a :class:`~harpjax.compiler.trace.Program` a small
  integer token from its primitive, canonical parameters, operand descriptors (literal value,
  or shape/dtype and whether it is a parameter, a region input or an activation) and result
  shapes. Equal tokens in equal order are what repeated-module detection compares.
* :func:`slice_signature` hashes a contiguous op range with its values renumbered locally
  (inputs in order of first use, with their kind and shape) and which of its results are read
  later: the layer signature the profiler deduplicates on.
* :func:`jaxpr_digest` does the same for sub-jaxprs held in parameters (``pjit``, ``remat2``,
  ``custom_jvp_call``, ``scan``...), so equal bodies hash equal.

Offsets of slices are not part of the hash: slice ``i`` of a stacked parameter (an unrolled
``scan`` over layers), of the per-layer PRNG keys or of a per-layer head mask costs what slice
``j`` costs, and repeats differing only by such a constant stay repeats.

Finding *repeated* runs of tokens is layer construction's business
(:mod:`harpjax.compiler.layers.repeats`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from typing import Any, Callable, Sequence

import numpy as np

from harpjax import _compat
from harpjax.compiler.trace import primitives
from harpjax.compiler.trace.program import Lit, Program

__all__ = ["canonical", "jaxpr_digest", "digest", "op_tokens", "OpTokens", "slice_signature"]

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]+")
_SMALL_CONST = 4096   # constants up to this many elements are hashed by value


def digest(obj: Any, size: int = 8) -> str:
  """A short hex digest of the ``repr`` of a canonical value."""
  return hashlib.blake2b(repr(obj).encode(), digest_size=size).hexdigest()


def _aval_key(aval) -> tuple:
  return (tuple(int(d) for d in getattr(aval, "shape", ())), str(getattr(aval, "dtype", "?")))


def _array_key(x) -> tuple:
  a = np.asarray(x)
  if a.size <= _SMALL_CONST:
    try:
      data = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).hexdigest()
    except (TypeError, ValueError):
      data = "?"
  else:
    data = "big"
  return ("arr", tuple(a.shape), str(a.dtype), data)


def canonical(v: Any) -> Any:
  """A hashable, address-free canonical form of an equation parameter."""
  if v is None or isinstance(v, (bool, int, float, str)):
    return v
  if isinstance(v, (np.bool_, np.integer, np.floating)):
    return v.item()
  if isinstance(v, np.dtype):
    return ("dtype", str(v))
  if isinstance(v, (_compat.ClosedJaxpr, _compat.Jaxpr)):
    return ("jaxpr", jaxpr_digest(v))
  if isinstance(v, enum.Enum):
    return ("enum", type(v).__name__, v.name)
  if isinstance(v, (tuple, list)):
    return tuple(canonical(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((str(k), canonical(x)) for k, x in v.items()))
  if isinstance(v, (set, frozenset)):
    return tuple(sorted(repr(canonical(x)) for x in v))
  if isinstance(v, np.ndarray) or (hasattr(v, "shape") and hasattr(v, "dtype")
                                   and hasattr(v, "__array__")):
    return _array_key(v)
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    return (type(v).__name__,) + tuple(
        (f.name, canonical(getattr(v, f.name))) for f in dataclasses.fields(v))
  if callable(v):
    return ("fn", getattr(v, "__qualname__", None) or type(v).__name__)
  return _ADDR.sub("", repr(v))


_jaxpr_memo: dict[int, tuple[Any, str]] = {}


def jaxpr_digest(jaxpr) -> str:
  """Canonical digest of a ``Jaxpr``/``ClosedJaxpr`` (variables renumbered, memoised)."""
  hit = _jaxpr_memo.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  consts: tuple = ()
  inner = jaxpr
  if isinstance(jaxpr, _compat.ClosedJaxpr):
    inner, consts = jaxpr.jaxpr, tuple(jaxpr.consts)
  env: dict = {}

  def ref(v):
    if _compat.is_literal(v):
      return ("lit", canonical(_compat.literal_value(v)))
    return env.setdefault(v, len(env))

  parts: list = [("consts",) + tuple(_array_key(c) for c in consts)]
  parts.append(tuple(("c", _aval_key(v.aval), ref(v)) for v in inner.constvars))
  parts.append(tuple(("i", _aval_key(v.aval), ref(v)) for v in inner.invars))
  for e in inner.eqns:
    ins = tuple(ref(v) for v in e.invars)
    outs = tuple(_aval_key(v.aval) for v in e.outvars)
    for v in e.outvars:
      if not _compat.is_dropvar(v):
        ref(v)
    parts.append((e.primitive.name, canonical(e.params), ins, outs))
  parts.append(tuple(ref(v) for v in inner.outvars))
  d = digest(tuple(parts), 12)
  _jaxpr_memo[id(jaxpr)] = (jaxpr, d)
  return d


# --------------------------------------------------------------------------- op tokens


@dataclasses.dataclass(frozen=True)
class OpTokens:
  """Canonical facts about every op of a program.

  Attributes:
    tokens: ``[num_ops]`` int64 hashes: equal tokens mean equal op-local computations (in
      any program).
    core: per op, the digest of primitive, parameters and result shapes.
    operands: per op, the operand descriptors hashed into its token.
    value_kind: value id -> ``"param"``, ``"data"`` or ``"act"`` (param views are params).
  """
  tokens: np.ndarray
  core: tuple
  operands: tuple
  value_kind: dict


def op_tokens(program: Program, input_kinds: Sequence[str] | None = None) -> OpTokens:
  """Tokens of every op of ``program``.

  Args:
    program: the forward program.
    input_kinds: per ``program.invars`` entry, ``"param"`` for differentiated parameters and
      anything else (``"split"``, ``"whole"``, ``"static"``) for data; default all data.

  Returns:
    The :class:`OpTokens`.
  """
  kinds = list(input_kinds) if input_kinds is not None else ["data"] * len(program.invars)
  value_kind: dict[int, str] = {}
  for vid, k in zip(program.invars, kinds):
    value_kind[vid] = "param" if k == "param" else "data"
  tokens = np.empty(len(program.ops), dtype=np.int64)
  cores, operands = [], []
  for op in program.ops:
    in_kinds = [None if isinstance(v, Lit) else value_kind.get(v, "act") for v in op.invars]
    params = op.params
    view = primitives.is_view(op.name)
    if view:
      params = _offset_free(op.name, params)
    out_kind = "param" if in_kinds and in_kinds[0] == "param" and view else "act"
    desc = []
    for v, k in zip(op.invars, in_kinds):
      aval = _compat.aval_of(v.value) if isinstance(v, Lit) else program.avals[v]
      if _is_int_scalar(aval):
        # A counter, an index or a salt: a constant in one repeat and computed in the next
        # (an RNG counter, a layer index) changes values, not the computation or its cost.
        desc.append(("int", _aval_key(aval)))
        continue
      if isinstance(v, Lit):
        lit = v.value
        if view and op.name == "dynamic_slice":
          desc.append(("idx", _aval_key(_compat.aval_of(lit))))
        elif op.name in _SALT_PRIMITIVES and np.ndim(lit) == 0:
          # A per-module salt (Flax folds each module's path hash into its dropout key):
          # the value changes which random numbers, not the computation or its cost.
          desc.append(("salt", _aval_key(_compat.aval_of(lit))))
        else:
          desc.append(("lit", canonical(lit) if np.ndim(lit) == 0 else _array_key(lit)))
      else:
        desc.append((k, _aval_key(program.avals[v])))
    for o in op.outvars:
      if o >= 0:
        value_kind[o] = out_kind
    core = digest((op.name, canonical(params),
                   tuple(_aval_key(program.avals[o]) if o >= 0 else None for o in op.outvars)))
    cores.append(core)
    operands.append(tuple(desc))
    tokens[op.index] = int(digest((core, tuple(desc))), 16) >> 2   # comparable across programs
  return OpTokens(tokens, tuple(cores), tuple(operands), value_kind)


_SALT_PRIMITIVES = frozenset({"random_fold_in"})


def _is_int_scalar(aval) -> bool:
  if tuple(getattr(aval, "shape", ())) != ():
    return False
  try:
    return np.dtype(aval.dtype).kind in "iu"
  except TypeError:   # PRNG keys
    return False


def _offset_free(name: str, params: dict) -> dict:
  """Parameters of a view without the offsets (slice i costs what j does)."""
  if name == "slice":
    start, limit = params["start_indices"], params["limit_indices"]
    return {"sizes": tuple(int(b) - int(a) for a, b in zip(start, limit)),
            "strides": params.get("strides")}
  return params


def slice_signature(program: Program, start: int, end: int, toks: OpTokens,
                    live_out: Callable[[int], bool]) -> str:
  """Structural signature of ops ``[start, end)``.

  Values are renumbered locally: inputs (values read but not defined in the range) in order
  of first use with their kind and shape, results in order of definition. The signature also
  says which results are read after the range (``live_out``), since that decides what a stage
  cut sends and what the backward receives.

  Returns:
    A 16-hex-digit string.
  """
  local: dict[int, tuple] = {}
  n_in = 0
  parts = []
  for op in program.ops[start:end]:
    refs = []
    for v, d in zip(op.invars, toks.operands[op.index]):
      if isinstance(v, Lit):
        refs.append(d)
        continue
      r = local.get(v)
      if r is None:
        r = ("in", n_in, d)
        n_in += 1
        local[v] = r
      refs.append(r[:2])
    outs = []
    for o in op.outvars:
      if o >= 0:
        local[o] = ("v", len(local))
        outs.append((local[o][1], bool(live_out(o))))
      else:
        outs.append(None)
    parts.append((toks.core[op.index], tuple(refs), tuple(outs)))
  return digest(tuple(parts), 8)
