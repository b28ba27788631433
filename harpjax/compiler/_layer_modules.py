"""Finding repeated modules in a forward program (HARP §5.1, step 2 of layer construction).

:func:`_find_modules` covers the ops with module instances: name-stack repeats first (Flax
module scopes, so interleaved kinds stay apart), then "the most repeated contiguous run with
at least ``z`` compute-heavy ops" found by a suffix array, iterated over the parts not yet
covered; what is left becomes non-repeated modules. :func:`_op_path` gives an op's module
path and :func:`_kind_names` a readable, unique name per module kind. Used by
:func:`harpjax.compiler.layers.construct_layers`.
"""

from __future__ import annotations

import collections
import re
from typing import TYPE_CHECKING

import numpy as np

from harpjax import _compat
from harpjax.compiler import primitives, signature
from harpjax.compiler._layer_facts import _Facts
from harpjax.compiler.program import Op

if TYPE_CHECKING:
  from harpjax.compiler.layers import LayerOptions


def _op_path(op: Op) -> tuple[str, ...]:
  """Module path of an op; for call-like ops the common path of their body is appended."""
  parts = tuple(p for p in op.name_stack.split("/") if p)
  if op.name in ("scan", "while", "cond"):
    return parts
  bodies = primitives.subjaxprs(op.params)
  if bodies:
    firsts = {_compat.eqn_name_stack(e).split("/")[0]
              for _, j in bodies for e in j.eqns if _compat.eqn_name_stack(e)}
    if len(firsts) == 1:
      parts = parts + (firsts.pop(),)
  return parts


def _find_modules(program, facts: _Facts, paths, opts: LayerOptions) -> list[tuple]:
  """``[(start, end, kind, path)]`` covering all ops; repeated kinds have several entries."""
  n = len(program.ops)
  tokens, heavy = facts.toks.tokens, facts.heavy
  free = np.ones(n, dtype=bool)
  chosen: list[tuple[int, int, int, tuple]] = []
  kind = 0
  if opts.use_name_stack:
    for insts in signature.name_stack_repeats(tokens, heavy, paths, opts.z):
      for a, b, path in insts:
        free[a:b] = False
        chosen.append((a, b, kind, path))
      kind += 1
  while True:
    segs = signature.free_segments(free)
    rep = signature.most_repeated(tokens, heavy, segs, opts.z, start_cost=facts.cross[:n],
                                  criterion=opts.criterion)
    if rep is None:
      break
    for s in rep.starts:
      free[s:s + rep.length] = False
      chosen.append((s, s + rep.length, kind, signature.common_path(paths[s:s + rep.length])))
    kind += 1
  for a, b in signature.free_segments(free):
    chosen.append((a, b, kind, signature.common_path(paths[a:b])))
    kind += 1
  chosen.sort()
  # Renumber kinds in order of first appearance.
  order: dict[int, int] = {}
  return [(a, b, order.setdefault(k, len(order)), p) for a, b, k, p in chosen]


_INDEX = re.compile(r"^(.*?)[_.\-]?\d+$")


def _strip_index(part: str) -> str:
  """``block_3`` -> ``block``; a bare index (``h/0``) -> ``""``."""
  if part.isdigit():
    return ""
  m = _INDEX.match(part)
  return m.group(1) if m and m.group(1) else part


def _kind_names(mods, paths) -> dict[int, str]:
  """A readable, unique name per kind."""
  by_kind: dict[int, list] = collections.defaultdict(list)
  for a, b, k, p in mods:
    by_kind[k].append((a, b, p))
  named = [p for p in paths if p]
  root = signature.common_path(named) if named else ()
  raw = {}
  for k, insts in by_kind.items():
    a, b, p = insts[0]
    if len(insts) > 1 and p:
      parts = [_strip_index(x) for x in p]
      name = parts[-1] or (parts[-2] if len(parts) > 1 else "")
      if not name and len(p) > 1:
        name = _strip_index(p[-2])
    else:
      counts = collections.Counter(
          pp[len(root)] for pp in paths[a:b] if len(pp) > len(root))
      name = _strip_index(counts.most_common(1)[0][0]) if counts else ""
    raw[k] = name or ("module" if len(insts) > 1 else "ops")
  out, used = {}, collections.Counter(raw.values())
  seen: collections.Counter = collections.Counter()
  for k in sorted(raw):
    name = raw[k]
    if used[name] > 1:
      seen[name] += 1
      name = f"{name}#{seen[name]}"
    out[k] = name
  return out
