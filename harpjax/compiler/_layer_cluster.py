"""Clustering module kinds into layers (HARP §5.1, step 3 of layer construction).

:func:`_cluster` cuts each module kind once into layers of balanced compute whose cuts cross
small tensors: :func:`_atoms` splits the kind at admissible (low-crossing) cut points and
:func:`_partition` groups the atoms by a DP of balanced FLOPs. The same relative cuts then
apply to every instance. Used by :func:`harpjax.compiler.layers.construct_layers`.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

from harpjax.compiler._layer_facts import _Facts

if TYPE_CHECKING:
  from harpjax.compiler.layers import LayerOptions


def _cluster(mods, facts: _Facts, opts: LayerOptions) -> dict[int, list[int]]:
  """Relative cut positions per module kind."""
  by_kind: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
  for a, b, k, _ in mods:
    by_kind[k].append((a, b))
  parts = {}
  for k, insts in by_kind.items():
    parts[k] = _atoms(insts, facts, opts)
  ks = {}
  for k, (atoms, _) in parts.items():
    usable = len(atoms)
    if opts.layers_per_module is not None:
      ks[k] = max(1, min(opts.layers_per_module, usable))
    elif opts.target_layers is not None:
      ks[k] = 1
    else:
      with_heavy = sum(1 for *_, h in atoms if h > 0)
      ks[k] = max(1, min(opts.max_layers_per_module, with_heavy, usable))
  if opts.target_layers is not None:
    count = {k: len(v) for k, v in by_kind.items()}
    best = {k: _partition(parts[k][0], 1) for k in parts}
    total = sum(count.values())
    while True:
      cands = [(best[k][1], k) for k in parts
               if ks[k] < len(parts[k][0]) and total + count[k] <= opts.target_layers]
      if not cands:
        break
      _, k = max(cands)
      ks[k] += 1
      total += count[k]
      best[k] = _partition(parts[k][0], ks[k])
  plan = {}
  for k, (atoms, _) in parts.items():
    cuts, _ = _partition(atoms, ks[k])
    plan[k] = cuts
  return plan


def _atoms(insts, facts: _Facts, opts: LayerOptions):
  """Segments of a module kind between admissible cut points (relative offsets).

  Returns:
    ``([(rel_start, rel_end, flops, heavy)], cut_bytes)`` from the first instance; a cut is
    admissible where the bytes crossing it (worst instance) are at most
    ``max_boundary_ratio`` times those crossing the module's own boundary.
  """
  a0, b0 = insts[0]
  length = b0 - a0
  cross = np.max([facts.cross[a:b + 1] for a, b in insts], axis=0)
  ends = [x for x in (cross[0], cross[-1]) if x > 0]
  inner = cross[1:-1]
  if ends:
    base = min(ends)
  elif (inner > 0).any():
    base = float(np.min(inner[inner > 0]))
  else:
    base = 0.0
  ok = [r for r in range(1, length) if cross[r] <= opts.max_boundary_ratio * base + 0]
  bounds = [0] + ok + [length]
  atoms = []
  for x, y in zip(bounds, bounds[1:]):
    atoms.append((x, y, float(facts.flops[a0 + x:a0 + y].sum()),
                  int(facts.heavy[a0 + x:a0 + y].sum())))
  return atoms, cross


def _partition(atoms, k: int) -> tuple[list[int], float]:
  """Splits atoms into ``k`` contiguous groups of balanced FLOPs (min sum of squares).

  The sum of squared group FLOPs (fixed total) is smallest for equal groups and penalises a
  near-empty group more than a slightly larger maximum, so glue ops join a heavy neighbour.

  Returns:
    Relative cut offsets and the largest group's FLOPs.
  """
  A = len(atoms)
  k = max(1, min(k, A))
  f = np.array([x[2] for x in atoms])
  scale = max(float(f.max()), 1.0) if A else 1.0
  f = f / scale
  cf = np.concatenate([[0.0], np.cumsum(f)])
  INF = (np.inf, np.inf)
  best = [[INF] * (A + 1) for _ in range(k + 1)]
  arg = [[-1] * (A + 1) for _ in range(k + 1)]
  best[0][0] = (0.0, 0.0)
  for g in range(1, k + 1):
    for a in range(g, A + 1):
      cand, where = INF, -1
      for p in range(g - 1, a):
        prev = best[g - 1][p]
        if prev[0] == np.inf:
          continue
        s = cf[a] - cf[p]
        val = (prev[0] + s * s, max(prev[1], s))
        if val < cand:
          cand, where = val, p
      best[g][a], arg[g][a] = cand, where
  cuts, a = [], A
  for g in range(k, 0, -1):
    p = arg[g][a]
    if p > 0:
      cuts.append(atoms[p][0])
    a = p
  return sorted(cuts), float(best[k][A][1]) * scale
