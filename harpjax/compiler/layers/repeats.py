"""Repeated runs of op tokens: the paper's step (i) of layer construction (HARP §5.1).

:func:`most_repeated` finds, among the non-repeated segments of a token sequence (from
:func:`harpjax.compiler.trace.op_tokens`), the contiguous run that occurs most often
(non-overlapping) and holds at least ``z`` compute-heavy ops. It uses a suffix array and LCP
intervals, so a 10^4-op program takes milliseconds. :func:`name_stack_repeats` finds repeated
module instances from the name stack (Flax module scopes) first, so that interleaved kinds
stay separate.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from harpjax.compiler.trace import signature

__all__ = ["Repeat", "most_repeated", "suffix_array", "lcp_array", "name_stack_repeats",
           "free_segments", "common_path"]


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
        groups[signature.digest(tokens[i:j].tobytes())].append((i, j, d, pre))
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
