"""Structural identity: canonical hashes of equations, layers and jaxprs; repeated modules.

Two pieces of a program are *the same computation* when their equations agree in primitive,
parameters, operand/result shapes and dtypes and in how values flow between them, whatever the
variables are called. This module hashes that canonical form:

* :func:`op_tokens` gives every op of a :class:`~harpjax.compiler.program.Program` a small
  integer token from its primitive, canonical parameters, operand descriptors (literal value,
  or shape/dtype and whether it is a parameter, a region input or an activation) and result
  shapes. Equal tokens in equal order are what repeated-module detection compares.
* :func:`slice_signature` hashes a contiguous op range with its values renumbered locally
  (inputs in order of first use, with their kind and shape) and which of its results are read
  later: the layer signature the profiler deduplicates on.
* :func:`jaxpr_digest` does the same for sub-jaxprs held in parameters (``pjit``, ``remat2``,
  ``custom_jvp_call``, ``scan``...), so equal bodies hash equal.

Offsets of slices taken from a parameter are not part of the hash: slice ``i`` of a stacked
parameter (an unrolled ``scan`` over layers) costs what slice ``j`` costs.

:func:`most_repeated` is the paper's step (i) of layer construction (§5.1): among the
non-repeated segments of a token sequence, the contiguous run that occurs most often
(non-overlapping) and holds at least ``z`` compute-heavy ops. It uses a suffix array and LCP
intervals, so a 10^4-op program takes milliseconds. :func:`name_stack_repeats` finds repeated
module instances from the name stack (Flax module scopes) first, so that interleaved kinds
stay separate.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import re
from typing import Any, Callable, Sequence

import numpy as np

from harpjax import _compat
from harpjax.compiler import primitives
from harpjax.compiler.program import Lit, Program

__all__ = ["canonical", "jaxpr_digest", "digest", "op_tokens", "OpTokens", "slice_signature",
           "Repeat", "most_repeated", "suffix_array", "lcp_array", "name_stack_repeats",
           "free_segments", "common_path"]

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
    if in_kinds and in_kinds[0] == "param" and primitives.is_view(op.name):
      params = _offset_free(op.name, params)
      out_kind = "param"
    else:
      out_kind = "act"
    desc = []
    for v, k in zip(op.invars, in_kinds):
      if isinstance(v, Lit):
        lit = v.value
        if out_kind == "param" and op.name == "dynamic_slice":
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


def _offset_free(name: str, params: dict) -> dict:
  """Parameters of a view of a parameter without the offsets (slice i costs what j does)."""
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


# --------------------------------------------------------------------------- repeats


@dataclasses.dataclass(frozen=True)
class Repeat:
  """A run of ``length`` units occurring (non-overlapping) at ``starts``."""
  length: int
  starts: tuple[int, ...]

  @property
  def count(self) -> int:
    return len(self.starts)


def suffix_array(s: np.ndarray) -> np.ndarray:
  """Suffix array of an int sequence by prefix doubling (``O(n log^2 n)``, NumPy sorts)."""
  n = len(s)
  if n == 0:
    return np.zeros(0, dtype=np.int64)
  _, rank = np.unique(np.asarray(s), return_inverse=True)
  rank = rank.astype(np.int64)
  idx = np.arange(n)
  k = 1
  while True:
    key2 = np.full(n, -1, dtype=np.int64)
    key2[: n - k] = rank[k:] if k < n else key2[:0]
    sa = np.lexsort((key2, rank))
    r, k2 = rank[sa], key2[sa]
    new = np.empty(n, dtype=np.int64)
    new[sa] = np.concatenate([[0], np.cumsum((r[1:] != r[:-1]) | (k2[1:] != k2[:-1]))])
    rank = new
    if rank.max() == n - 1 or k >= n:
      return sa
    k *= 2
  return idx  # pragma: no cover


def lcp_array(s: np.ndarray, sa: np.ndarray) -> np.ndarray:
  """``lcp[i]`` = longest common prefix of suffixes ``sa[i-1]`` and ``sa[i]`` (Kasai)."""
  n = len(s)
  rank = np.empty(n, dtype=np.int64)
  rank[sa] = np.arange(n)
  lcp = np.zeros(n, dtype=np.int64)
  sl = s.tolist()
  sal = sa.tolist()
  rl = rank.tolist()
  h = 0
  for i in range(n):
    r = rl[i]
    if r > 0:
      j = sal[r - 1]
      while i + h < n and j + h < n and sl[i + h] == sl[j + h]:
        h += 1
      lcp[r] = h
      if h > 0:
        h -= 1
    else:
      h = 0
  return lcp


def most_repeated(tokens: np.ndarray, heavy: np.ndarray, segments: Sequence[tuple[int, int]],
                  z: int, *, weights: np.ndarray | None = None,
                  start_cost: np.ndarray | None = None, criterion: str = "coverage",
                  min_count: int = 2) -> Repeat | None:
  """The most repeated contiguous run with at least ``z`` compute-heavy units.

  Runs never cross segment boundaries. Occurrences are counted non-overlapping (greedy from
  the left).

  Args:
    tokens: ``[n]`` unit tokens.
    heavy: ``[n]`` compute-heavy ops per unit.
    segments: ``[(start, end)]`` the non-repeated parts to search.
    z: minimum compute-heavy ops in the run.
    weights: ``[n]`` ops per unit (default 1): the size of a run.
    start_cost: ``[n]`` cost of starting an occurrence at a unit (bytes crossing the cut
      there); among equally good runs, the cheapest cuts win (this picks the phase of a
      periodic sequence that starts at module boundaries).
    criterion: ``"coverage"`` ranks by occurrences x size, then occurrences (the run that
      accounts for the most of the program; with ``z`` small, plain frequency would pick a
      single matmul); ``"frequency"`` ranks by occurrences, then size (the paper's literal
      rule, with ``z`` as the only granularity control).
    min_count: fewest occurrences that make a repeat.

  Returns:
    The best :class:`Repeat`, or ``None``.
  """
  n = len(tokens)
  weights = np.ones(n, dtype=np.int64) if weights is None else np.asarray(weights)
  start_cost = np.zeros(n) if start_cost is None else np.asarray(start_cost, dtype=np.float64)
  segs = [(int(a), int(b)) for a, b in segments if b - a >= 1]
  if not segs:
    return None
  # Concatenate segments with unique separators.
  base = int(tokens.max()) + 1 if n else 0
  seq, pos_of = [], []
  for k, (a, b) in enumerate(segs):
    seq.extend(tokens[a:b].tolist())
    pos_of.extend(range(a, b))
    seq.append(base + k)
    pos_of.append(-1)
  s = np.asarray(seq, dtype=np.int64)
  pos_of = np.asarray(pos_of, dtype=np.int64)
  m = len(s)
  ok = pos_of >= 0
  hv = np.where(ok, heavy[np.maximum(pos_of, 0)], 0)
  wt = np.where(ok, weights[np.maximum(pos_of, 0)], 0)
  cheavy = np.concatenate([[0], np.cumsum(hv)])
  cweight = np.concatenate([[0], np.cumsum(wt)])
  sa = suffix_array(s)
  lcp = lcp_array(s, sa)
  best_key, best = None, None
  stack = [(0, 0)]  # (lcp, lb)
  for i in range(1, m + 1):
    l = int(lcp[i]) if i < m else 0
    lb = i - 1
    while l < stack[-1][0]:
      depth, top_lb = stack.pop()
      parent = max(l, stack[-1][0])
      cand = _evaluate(sa[top_lb:i], depth, parent, z, cheavy, cweight, pos_of, start_cost,
                       criterion, min_count)
      if cand is not None and (best_key is None or cand[0] > best_key):
        best_key, best = cand
      lb = top_lb
    if l > stack[-1][0]:
      stack.append((l, lb))
  return best


def _evaluate(positions, depth, parent, z, cheavy, cweight, pos_of, start_cost, criterion,
              min_count):
  if len(positions) < min_count:
    return None
  p = np.sort(positions)
  p0 = int(p[0])
  lengths = {int(depth)}
  if len(p) > 1:
    gaps = np.diff(p)
    for g in np.unique(gaps[(gaps > parent) & (gaps < depth)]).tolist()[:16]:
      lengths.add(int(g))
  best = None
  for x in sorted(lengths, reverse=True):
    if x <= parent or cheavy[p0 + x] - cheavy[p0] < z:
      continue
    chosen, last = [], -1
    for q in p.tolist():
      if q >= last:
        chosen.append(q)
        last = q + x
    c = len(chosen)
    if c < min_count:
      continue
    size = int(cweight[p0 + x] - cweight[p0])
    starts = tuple(int(pos_of[q]) for q in chosen)
    cut = -float(sum(start_cost[q] for q in starts))
    if criterion == "frequency":
      key = (c, size, cut, -starts[0])
    else:
      key = (c * size, c, cut, -starts[0])
    if best is None or key > best[0]:
      best = (key, Repeat(x, starts))
  return best


# --------------------------------------------------------------------------- name-stack modules


def free_segments(free: np.ndarray) -> list[tuple[int, int]]:
  """Maximal runs ``[(start, end)]`` of true entries of a boolean array."""
  idx = np.flatnonzero(np.diff(np.concatenate([[0], free.astype(np.int8), [0]])))
  return [(int(a), int(b)) for a, b in zip(idx[::2], idx[1::2])]


def name_stack_repeats(tokens: np.ndarray, heavy: np.ndarray, paths: Sequence[tuple],
                       z: int) -> list[list[tuple]]:
  """Repeated module kinds from the name stack's module instances, greedily by coverage.

  A module instance is a maximal run of ops sharing a name-stack prefix of some depth
  (``GPT/block_3``). Instances with at least ``z`` compute-heavy ops and equal token runs
  form a candidate kind; the kind covering the most ops (instances x size) wins, its
  instances are extended over identical glue ops of their parent (a residual add written
  around the module call), and the search repeats on what is left. Interleaved kinds
  (dense / MoE blocks) come out as separate kinds, since only whole instances are compared.

  Args:
    tokens: ``[n]`` op tokens (:func:`op_tokens`).
    heavy: ``[n]`` compute-heavy ops per op.
    paths: per op, its name-stack path as a tuple of components.
    z: fewest compute-heavy ops in a repeated module.

  Returns:
    Per chosen kind, its instances ``[(start, end, path)]``.
  """
  n = len(tokens)
  seen_ranges, groups = set(), collections.defaultdict(list)
  depth_max = max((len(p) for p in paths), default=0)
  cheavy = np.concatenate([[0], np.cumsum(heavy)])
  for d in range(1, depth_max + 1):
    i = 0
    while i < n:
      if len(paths[i]) < d:
        i += 1
        continue
      pre = paths[i][:d]
      j = i + 1
      while j < n and paths[j][:d] == pre:
        j += 1
      if (i, j) not in seen_ranges and cheavy[j] - cheavy[i] >= z:
        seen_ranges.add((i, j))
        groups[digest(tokens[i:j].tobytes())].append((i, j, d, pre))
      i = j
  groups = {k: v for k, v in groups.items() if len(v) > 1}
  free = np.ones(n + 1, dtype=np.int64)
  result = []
  while groups:
    cfree = np.concatenate([[0], np.cumsum(free[:n])])
    best, best_key = None, None
    for key, insts in groups.items():
      valid, last = [], -1
      for a, b, d, pre in sorted(insts):
        if cfree[b] - cfree[a] == b - a and a >= last:
          valid.append((a, b, d, pre))
          last = b
      if len(valid) < 2:
        continue
      size = valid[0][1] - valid[0][0]
      score = (len(valid) * size, len(valid), -valid[0][2], -valid[0][0])
      if best_key is None or score > best_key:
        best_key, best = score, (key, valid)
    if best is None:
      break
    key, valid = best
    del groups[key]
    glue = np.array([len(p) < valid[0][2] and h == 0 for p, h in zip(paths, heavy)])
    ranges = _extend([(a, b) for a, b, _, _ in valid], tokens, free & np.append(glue, False))
    for (a, b), (_, _, _, pre) in zip(ranges, valid):
      free[a:b] = 0
    result.append([(a, b, pre) for (a, b), (_, _, _, pre) in zip(ranges, valid)])
  return result


def _extend(ranges, tokens, free) -> list[tuple[int, int]]:
  """Grows every instance right, then left, over free ops equal in all instances.

  ``free`` marks the ops that may be absorbed: glue of the parent module (a residual add
  written around the module call), not ops of sibling modules.
  """
  n = len(tokens)
  ranges = [list(r) for r in ranges]
  claimed = np.zeros(n, dtype=bool)
  for a, b in ranges:
    claimed[a:b] = True
  for side in (1, -1):
    while True:
      nxt = [(b if side == 1 else a - 1) for a, b in ranges]
      if any(not 0 <= x < n or not free[x] or claimed[x] for x in nxt):
        break
      if len({int(tokens[x]) for x in nxt}) != 1 or len(set(nxt)) != len(nxt):
        break
      for r, x in zip(ranges, nxt):
        claimed[x] = True
        if side == 1:
          r[1] += 1
        else:
          r[0] -= 1
  return [tuple(r) for r in ranges]


def common_path(paths) -> tuple[str, ...]:
  """The longest common prefix of name-stack paths (empty paths ignored)."""
  ps = [p for p in paths if p]
  if not ps:
    return ()
  out = []
  for level in zip(*ps):
    if all(x == level[0] for x in level):
      out.append(level[0])
    else:
      break
  return tuple(out)
