"""Layer construction: the forward program cut into fine-grained layers that keep its structure.

Automatic construction (:func:`construct_layers`, HARP §5.1; see ``docs/layers.md``):

1. **Canonicalise** every op (:func:`harpjax.compiler.trace.op_tokens`): primitive,
   parameters, shapes, dtypes, operand kinds; equal computations get equal tokens
   (:mod:`harpjax.compiler.layers.facts` gathers them with FLOPs and crossing bytes).
2. **Find repeated modules** (section "step 2" below), iterating "the most repeated contiguous
   run with at least ``z`` compute-heavy ops" over the non-repeated parts
   (:mod:`harpjax.compiler.layers.repeats`). Module instances from the jaxpr's name stack
   (Flax module scopes) are tried first, so that interleaved kinds (dense / MoE blocks) come out
   as two kinds rather than one pair; runs of ops found by a suffix array cover models without
   names. Sub-jaxpr equations (``pjit`` is inlined; ``remat2``, ``custom_jvp_call``,
   ``cond``... are single ops costed from their bodies) take part like any op; a ``scan`` over
   stacked layers is unrolled first (:func:`~harpjax.compiler.layers.unroll.unroll_scans`).
3. **Cluster** each module kind once into layers of balanced compute whose cuts cross small
   tensors (section "step 3": a DP over low-crossing cut points), and apply the same relative
   cuts to every instance, so layers of one repeat have the signatures of any other.

Each module records whether it holds a routed block (a mixture of experts: :func:`routes`,
``Module.routed``). Manual :func:`harpjax.mark_layer_boundary` calls win where present
(:func:`layers_from_boundaries`). :func:`layers_for_step` and :func:`traced_step_for` connect
layers with a traced step.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import time
from typing import Sequence

import numpy as np

from harpjax import _compat
from harpjax.compiler.layers import repeats
from harpjax.compiler.layers.facts import Facts, op_facts
from harpjax.compiler.layers.types import Layer, LayerOptions, LayerSequence, Module
from harpjax.compiler.layers.unroll import unroll_scans
from harpjax.compiler.trace import Lit, Op, Program, primitives, regen_sites, signature
from harpjax.errors import PlanError

log = logging.getLogger(__name__)

__all__ = ["construct_layers", "layers_for_step", "layers_from_boundaries", "layers_from_cuts",
           "traced_step_for", "relayer"]


# --------------------------------------------------------------------------- one layer


def _layer(program: Program, facts: Facts, index: int, a: int, b: int, **kw) -> Layer:
  n = len(program.ops)
  seen, pbytes = set(), 0
  kind = facts.toks.value_kind
  for op in program.ops[a:b]:
    view_of_param = primitives.is_view(op.name) and op.invars and \
        not isinstance(op.invars[0], Lit) and kind.get(op.invars[0]) == "param"
    if view_of_param:
      continue
    for v in op.in_ids():
      if kind.get(v) == "param" and v not in seen:
        seen.add(v)
        pbytes += program.nbytes(v)
  sig = signature.slice_signature(program, a, b, facts.toks,
                                  lambda v: facts.last_use.get(v, -1) >= b)
  kw.setdefault("name", _common_name(program.ops[a:b]) or f"layer{index}")
  return Layer(index, a, b, signature=sig, flops=float(facts.flops[a:b].sum()),
               param_bytes=int(pbytes), boundary_bytes=int(facts.cross[b]) if b < n else 0,
               heavy_ops=int(facts.heavy[a:b].sum()), **kw)


# --------------------------------------------------------------------------- hand-made cuts


def layers_from_cuts(program: Program, cuts: Sequence[int], names: Sequence[str] | None = None,
                     summary: str = "", input_kinds: Sequence[str] | None = None
                     ) -> LayerSequence:
  """Builds a :class:`LayerSequence` cutting ``program`` before each op index in ``cuts``.

  Args:
    program: the forward program.
    cuts: op positions; out-of-range and repeated positions are ignored.
    names: optional layer names.
    summary: optional summary line.
    input_kinds: per ``program.invars`` entry, the region input kind (``"param"``...), for
      signatures and parameter bytes.
  """
  bounds = [0] + sorted(set(int(c) for c in cuts if 0 < c < len(program.ops))) + \
      [len(program.ops)]
  facts = op_facts(program, input_kinds)
  layers = []
  for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
    kw = {"name": names[i]} if names is not None else {}
    layers.append(_layer(program, facts, i, a, b, **kw))
  kinds = tuple(input_kinds) if input_kinds is not None else None
  return LayerSequence(program, tuple(layers), summary or f"{len(layers)} layers",
                       input_kinds=kinds)


def layers_from_boundaries(program: Program, cuts: Sequence[int],
                           input_kinds: Sequence[str] | None = None) -> LayerSequence:
  """Layers cut where the model called :func:`harpjax.mark_layer_boundary`.

  Args:
    program: the boundary-free region program (``TracedStep.region``).
    cuts: the marker positions (``TracedStep.boundary_cuts``).
    input_kinds: optional region input kinds (``[inp.kind for inp in TracedStep.inputs]``).
  """
  n = len([c for c in cuts if 0 < c < len(program.ops)]) + 1
  return layers_from_cuts(program, cuts, input_kinds=input_kinds,
                          summary=f"{n} layer{'s' if n != 1 else ''} (marked by hand)")


def relayer(seq: LayerSequence, program: Program,
            input_kinds: Sequence[str] | None = None) -> LayerSequence:
  """The same cuts and modules over another trace of the same model (e.g. a smaller microbatch).

  Raises:
    ValueError: the programs differ in length (the model's structure depends on the batch).
  """
  if len(program.ops) != len(seq.program.ops):
    raise ValueError(f"cannot transfer {len(seq)} layers: the program has {len(program.ops)} "
                     f"ops, the layered one {len(seq.program.ops)}")
  kinds = input_kinds if input_kinds is not None else seq.input_kinds
  facts = op_facts(program, kinds)
  layers = tuple(_layer(program, facts, l.index, l.start, l.end, name=l.name, module=l.module,
                        module_index=l.module_index, position=l.position) for l in seq.layers)
  return dataclasses.replace(seq, program=program, layers=layers,
                             input_kinds=tuple(kinds) if kinds is not None else None)


# --------------------------------------------------------------------------- construction


def construct_layers(program: Program, input_kinds: Sequence[str] | None = None, *,
                     boundary_cuts: Sequence[int] = (),
                     options: LayerOptions | None = None,
                     origin: Sequence[int] | None = None) -> LayerSequence:
  """Fine-grained layers of a forward program that keep its repeated structure (§5.1).

  Args:
    program: the boundary-free forward program (``TracedStep.region``, or the result of
      :func:`unroll_scans`).
    input_kinds: per ``program.invars`` entry, ``"param"`` / ``"split"`` / ``"whole"`` /
      ``"static"`` (``[inp.kind for inp in TracedStep.inputs]``).
    boundary_cuts: hand-placed cuts (``TracedStep.boundary_cuts``); when given they are the
      layers (manual boundaries win) and only signatures and module kinds are computed.
    options: the knobs, :class:`LayerOptions`.
    origin: recorded in the result (see :attr:`LayerSequence.origin`).

  Returns:
    The :class:`LayerSequence`; ``str()`` summarises it.
  """
  opts = options or LayerOptions()
  t0 = time.perf_counter()
  n = len(program.ops)
  kinds = tuple(input_kinds) if input_kinds is not None else None
  origin = tuple(origin) if origin is not None else None
  if n == 0:
    return LayerSequence(program, (), "0 layers", input_kinds=kinds, origin=origin)
  facts = op_facts(program, kinds)
  cuts = sorted(set(int(c) for c in boundary_cuts if 0 < c < n))
  if cuts:
    return _from_manual(program, facts, cuts, kinds, origin)
  paths = [_op_path(op) for op in program.ops]
  mods = _find_modules(program, facts, paths, opts)
  names = _kind_names(mods, paths)
  plan = _cluster(mods, facts, opts)
  layers, modules = [], []
  routed_kind: dict[int, bool] = {}
  after_matmul = _after_matmul(program, facts)
  for mi, (a, b, kind, path) in enumerate(mods):
    first = len(layers)
    rel = plan[kind]
    bounds = [a] + [a + r for r in rel] + [b]
    for q, (x, y) in enumerate(zip(bounds, bounds[1:])):
      layers.append(_layer(program, facts, len(layers), x, y, module=names[kind],
                           module_index=mi, position=q))
    repeated = sum(1 for m in mods if m[2] == kind) > 1
    if kind not in routed_kind:
      routed_kind[kind] = routes(program, facts, a, b, after_matmul)
    modules.append(Module(mi, kind, names[kind], "/".join(path), a, b, first,
                          len(layers) - 1, repeated, routed_kind[kind]))
  seq = LayerSequence(program, tuple(layers), _summary(layers, modules), tuple(modules), kinds,
                      origin)
  log.info("layer construction: %d ops -> %s (%.2f s)", n, seq.summary,
           time.perf_counter() - t0)
  return seq


def _from_manual(program, facts, cuts, kinds, origin) -> LayerSequence:
  bounds = [0] + cuts + [len(program.ops)]
  layers = [_layer(program, facts, i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
  kind_of: dict[str, int] = {}
  modules = []
  count = collections.Counter(l.signature for l in layers)
  after_matmul = _after_matmul(program, facts)
  for l in layers:
    k = kind_of.setdefault(l.signature, len(kind_of))
    modules.append(Module(l.index, k, l.name, l.name, l.start, l.end, l.index, l.index,
                          count[l.signature] > 1,
                          routes(program, facts, l.start, l.end, after_matmul)))
  layers = [dataclasses.replace(l, module=l.name, module_index=l.index) for l in layers]
  n = len(layers)
  return LayerSequence(program, tuple(layers),
                       f"{n} layer{'s' if n != 1 else ''} (marked by hand)", tuple(modules),
                       kinds, origin)


# ----------------------------------------------------------------- step 2: repeated modules


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


def _find_modules(program, facts: Facts, paths, opts: LayerOptions) -> list[tuple]:
  """``[(start, end, kind, path)]`` covering all ops; repeated kinds have several entries."""
  n = len(program.ops)
  tokens, heavy = facts.toks.tokens, facts.heavy
  free = np.ones(n, dtype=bool)
  chosen: list[tuple[int, int, int, tuple]] = []
  kind = 0
  if opts.use_name_stack:
    for insts in repeats.name_stack_repeats(tokens, heavy, paths, opts.z):
      for a, b, path in insts:
        free[a:b] = False
        chosen.append((a, b, kind, path))
      kind += 1
  while True:
    segs = repeats.free_segments(free)
    rep = repeats.most_repeated(tokens, heavy, segs, opts.z, start_cost=facts.cross[:n],
                                  criterion=opts.criterion)
    if rep is None:
      break
    for s in rep.starts:
      free[s:s + rep.length] = False
      chosen.append((s, s + rep.length, kind, repeats.common_path(paths[s:s + rep.length])))
    kind += 1
  for a, b in repeats.free_segments(free):
    chosen.append((a, b, kind, repeats.common_path(paths[a:b])))
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
  root = repeats.common_path(named) if named else ()
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


# ------------------------------------------------------------------ routed blocks (MoE)

_SELECTIONS = frozenset({"argmax", "argmin", "top_k"})


def _after_matmul(program: Program, facts: Facts) -> set[int]:
  """Ids of the values computed, transitively, from a compute-heavy op's results."""
  return program.dependents((), sources={i for i in range(len(program.ops))
                                         if facts.heavy[i] > 0})


def routes(program: Program, facts: Facts, a: int, b: int,
           after_matmul: set[int] | None = None) -> bool:
  """Whether ops ``[a, b)`` hold a routed block (a mixture of experts).

  A routed block is a router, a dispatch, experts and a combine: a data-dependent choice
  (``argmax``, ``argmin``, ``top_k``, or a ``sort`` that carries indices, i.e. ``argsort``)
  over scores computed by a matmul, whose choice reaches, through any ops, a compute-heavy op
  of the same range (the dispatch einsum that moves tokens to the chosen experts; with a gather
  by index instead, the expert matmuls reading the gathered tokens). Attention's softmax, a
  loss's ``argmax`` for an accuracy, or a ``sort`` of values alone do not qualify.

  Args:
    program: the forward program.
    facts: its per-op facts (compute-heavy counts).
    a, b: the op range.
    after_matmul: :func:`_after_matmul` of the program, if already computed.

  Returns:
    ``True`` where the range routes.
  """
  after = _after_matmul(program, facts) if after_matmul is None else after_matmul
  for i in range(a, b):
    op = program.ops[i]
    selects = op.name in _SELECTIONS or (op.name == "sort" and len(op.invars) > 1)
    if not selects or not any(v in after for v in op.in_ids()):
      continue
    chosen = {v for v in op.outvars if v >= 0}
    for j in range(i + 1, b):
      later = program.ops[j]
      if any(v in chosen for v in later.in_ids()):
        if facts.heavy[j] > 0:
          return True
        chosen.update(v for v in later.outvars if v >= 0)
  return False


# ----------------------------------------------------------- step 3: clustering into layers


def _cluster(mods, facts: Facts, opts: LayerOptions) -> dict[int, list[int]]:
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


def _atoms(insts, facts: Facts, opts: LayerOptions):
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


# --------------------------------------------------------------------------- summary


def _summary(layers, modules) -> str:
  items = [(m.name, m.repeated, m.num_layers) for m in modules]
  parts, i = [], 0
  while i < len(items):
    best_p, best_reps = 1, 1
    if items[i][1]:
      for p in (1, 2, 3, 4):
        unit = items[i:i + p]
        if len(unit) < p or not all(u[1] for u in unit):
          break
        reps = 1
        while items[i + reps * p:i + (reps + 1) * p] == unit:
          reps += 1
        if reps >= 2 and reps * p > best_reps * best_p:
          best_p, best_reps = p, reps
    unit = items[i:i + best_p]
    if not items[i][1]:
      parts.append(f"{items[i][0]} {items[i][2]}")
    elif best_p == 1:
      parts.append(f"{best_reps} × {unit[0][0]}[{unit[0][2]}]")
    else:
      body = " · ".join(f"{u[0]}[{u[2]}]" for u in unit)
      parts.append(f"{best_reps} × ({body})")
    i += best_p * best_reps
  n = len(layers)
  return f"{n} layer{'s' if n != 1 else ''}: " + " · ".join(parts)


def _common_name(ops: Sequence[Op]) -> str:
  stacks = [op.name_stack for op in ops if op.name_stack]
  if not stacks:
    return ""
  return "/".join(repeats.common_path([s.split("/") for s in stacks])) or stacks[0].split("/")[0]


# --------------------------------------------------------------------------- traced steps


def layers_for_step(ts, options: LayerOptions | None = None) -> LayerSequence:
  """Layers of a traced step (:class:`~harpjax.compiler.trace.TracedStep`).

  Hand-placed boundaries win; otherwise scans over stacked layers are unrolled (then
  ``LayerSequence.program`` replaces ``ts.region``: run with :func:`traced_step_for`) and
  layers are constructed automatically.
  """
  opts = options or LayerOptions()
  kinds = [inp.kind for inp in ts.inputs]
  if ts.boundary_cuts:
    return construct_layers(ts.region, kinds, boundary_cuts=ts.boundary_cuts, options=opts)
  program, origin = ts.region, None
  if opts.unroll_scan:
    program, origin = unroll_scans(ts.region, z=opts.z, max_length=opts.max_unroll)
  return construct_layers(program, kinds, options=opts, origin=origin)


def traced_step_for(ts, layers: LayerSequence):
  """``ts`` with ``region`` replaced by ``layers.program`` (scans unrolled).

  The full batch's region is unrolled the same way and the draws to redraw per microbatch are
  found again on the unrolled pair, so that dropout inside an unrolled scan body slices the
  full batch's random numbers as at the top level.
  """
  if layers.origin is None or layers.program is ts.region:
    return ts
  kept = {old for old in layers.origin if old >= 0}
  unrolled = frozenset(i for i in range(len(ts.region.ops)) if i not in kept)
  full, _ = unroll_scans(ts.region_full, only=unrolled)
  regen, exact = regen_sites(full, layers.program, ts.num_microbatches)
  return dataclasses.replace(ts, region=layers.program, region_full=full, regen_ops=regen,
                             rng_exact=exact, boundary_cuts=())


def layers_like(ts, layers: LayerSequence) -> LayerSequence:
  """The layers of ``layers`` on another trace ``ts`` of the same step (traced with another
  microbatch size): the same scans unrolled, the same cuts.

  Raises:
    PlanError: ``ts`` is not the same program op for op (the step's structure depends on the
      batch size).
  """
  program = ts.region
  if layers.origin is not None:
    kept = {old for old in layers.origin if old >= 0}
    program, _ = unroll_scans(ts.region, only=frozenset(
        i for i in range(len(ts.region.ops)) if i not in kept))
  if len(program.ops) != len(layers.program.ops) or any(
      a.name != b.name for a, b in zip(program.ops, layers.program.ops)):
    raise PlanError(f"the step traced with another microbatch size has {len(program.ops)} ops "
                    f"where it had {len(layers.program.ops)} (or other ones): its structure "
                    "depends on the batch size")
  return dataclasses.replace(layers, program=program)
