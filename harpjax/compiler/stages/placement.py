"""Placing the parts of the step around the pipelined region onto stages.

The step program has one region op (the pipeline). What comes before prepares its inputs; what
comes after is the apply-gradient computation: the optimizer update, written however the user
likes. Each parameter belongs to one stage (the first that reads it), and so do its gradient and
every op computing from them: the Adam moments of stage 2's weights are updated on stage 2's
devices, next to the weights. The placement is inferred from the data flow:

1. seeds: a parameter and its gradient live on their owner stage; the loss and auxiliary
   outputs on the stage that computes them;
2. forward: an op reading placed values goes where most of those bytes are;
3. backward: an op whose results only placed ops of one stage read goes with them;
4. the rest reads nothing placed (step counters, learning-rate schedules, random keys):
   "floating" ops, recomputed by every group that needs them (Adam's bias correction from the
   step counter is computed by each stage's update, so no stage's update waits for another's).

Ops are then grouped by ``(level, stage)``, where the level increases whenever a value crosses
from one stage to another (a global gradient norm is summed on one stage, then its scale is
sent back), so that groups of one level can run on their stages independently. Only what the
region reads runs before it; every other op runs after it, even one that needs no gradient
(``b1 * mu`` of Adam), so that no value derived from the training state is held through the
pipeline.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from harpjax.compiler.trace import Lit, Program

__all__ = ["Group", "Placement", "place"]

FLOAT = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
  """Ops of the step (outside the region) that run together on one stage.

  Attributes:
    home: stage index.
    level: execution level; groups run in increasing level, the region between ``before`` and
      ``after``.
    ops: the ops, floating ones cloned in, in program order.
    in_ids: values read from outside the group.
    out_ids: values other groups, the region or the step's outputs need.
    side: ``0``: on the stage's devices; ``1``: on a zebra stage's expert group (the update
      of the state held there, :func:`harpjax.compiler.stages.zebra.expert_side`).
  """
  home: int
  level: int
  ops: tuple
  in_ids: tuple
  out_ids: tuple
  side: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """Groups to run before and after the region, and each op's stage (``-1``: floating)."""
  before: tuple
  after: tuple
  op_home: dict
  var_home: dict


def place(outer: Program, region_op: int, seeds: dict[int, int]) -> Placement:
  """Places every op of ``outer`` except the region.

  Args:
    outer: the step program.
    region_op: index of the region op.
    seeds: value id -> stage for the region's parameter operands and results.

  Returns:
    The :class:`Placement`.
  """
  producer = outer.producers()
  consumers = outer.consumers()
  var_home: dict[int, int] = dict(seeds)
  op_home: dict[int, int] = {}

  # 2. forward
  for op in outer.ops:
    if op.index == region_op:
      continue
    weight: dict[int, int] = defaultdict(int)
    for v in op.in_ids():
      if v in var_home:
        weight[var_home[v]] += max(outer.nbytes(v), 1)
    if weight:
      h = min(weight, key=lambda k: (-weight[k], k))
      op_home[op.index] = h
      for o in op.outvars:
        if o >= 0 and o not in seeds:
          var_home[o] = h
  # 3. backward
  for op in reversed(outer.ops):
    if op.index == region_op or op.index in op_home:
      continue
    homes = set()
    for o in op.outvars:
      if o < 0:
        continue
      if o in seeds:
        homes.add(seeds[o])
      for c in consumers.get(o, ()):
        if c != region_op and c in op_home:
          homes.add(op_home[c])
    if len(homes) == 1:   # read on several stages: floating, so no stage waits for another
      h = min(homes)
      op_home[op.index] = h
      for o in op.outvars:
        if o >= 0 and o not in seeds:
          var_home[o] = h
  # 4. floating
  floating = {op.index for op in outer.ops if op.index != region_op and op.index not in op_home}

  # levels: the region's ancestors first, then the rest, which run after the region (an
  # optimizer's ``b1 * mu`` needs no gradient but is only read after it: computed before,
  # it would hold a copy of the moments through the whole pipeline)
  feeds_region, stack = set(), [region_op]
  while stack:
    i = stack.pop()
    for v in outer.ops[i].in_ids():
      p = producer.get(v)
      if p is not None and p not in feeds_region:
        feeds_region.add(p)
        stack.append(p)
  level: dict[int, int] = {}
  order = [op for op in outer.ops if op.index in feeds_region or op.index == region_op] + \
      [op for op in outer.ops if op.index not in feeds_region and op.index != region_op]
  for op in order:
    if op.index in floating:
      continue
    lv = 0 if op.index in feeds_region or op.index == region_op else level[region_op] + 1
    for v in op.in_ids():
      p = producer.get(v)
      if p is None or p in floating:
        continue
      if op.index == region_op:
        lv = max(lv, level[p] + 1)
      elif p == region_op:
        lv = max(lv, level[p] + 1)
      else:
        lv = max(lv, level[p] + (op_home[p] != op_home[op.index]))
    if op.index == region_op:
      lv = max(lv, 1)   # level 0 is always before the region
    level[op.index] = lv
  region_level = level[region_op]

  members: dict[tuple[int, int], list[int]] = defaultdict(list)
  for op in outer.ops:
    if op.index == region_op or op.index in floating:
      continue
    members[(level[op.index], op_home[op.index])].append(op.index)

  # Floating values the region or the step's outputs need come from a level-0 group on stage 0.
  region_reads = set(outer.ops[region_op].in_ids())
  out_reads = {v for v in outer.outvars if not isinstance(v, Lit)}
  float_needed = {v for v in region_reads | out_reads
                  if v in producer and producer[v] in floating}
  extra_outputs: dict[tuple[int, int], set[int]] = defaultdict(set)
  if float_needed:
    key = (0, 0)
    members.setdefault(key, [])
    extra_outputs[key] |= float_needed

  # Who reads what from a group's own (non-floating) ops.
  reads_outside: dict[int, set] = defaultdict(set)   # value -> set of reader keys
  for key, idxs in members.items():
    for i in idxs:
      for v in outer.ops[i].in_ids():
        reads_outside[v].add(key)

  groups_before, groups_after = [], []
  for key in sorted(members, key=lambda k: (k[0], k[1])):
    idxs = members[key]
    own = set(idxs)
    clones = set()
    stack = [v for i in idxs for v in outer.ops[i].in_ids()] + list(extra_outputs.get(key, ()))
    while stack:
      v = stack.pop()
      p = producer.get(v)
      if p is not None and p in floating and p not in clones:
        clones.add(p)
        stack.extend(outer.ops[p].in_ids())
    all_idx = sorted(own | clones)
    defined = {o for i in all_idx for o in outer.ops[i].outvars if o >= 0}
    in_ids = sorted({v for i in all_idx for v in outer.ops[i].in_ids() if v not in defined})
    own_defined = {o for i in idxs for o in outer.ops[i].outvars if o >= 0}
    out_ids = {v for v in own_defined
               if (reads_outside.get(v, set()) - {key}) or v in region_reads or v in out_reads}
    out_ids |= extra_outputs.get(key, set())
    group = Group(home=key[1], level=key[0], ops=tuple(outer.ops[i] for i in all_idx),
                  in_ids=tuple(in_ids), out_ids=tuple(sorted(out_ids)))
    (groups_before if key[0] < region_level else groups_after).append(group)
  return Placement(tuple(groups_before), tuple(groups_after),
                   {**op_home, **{i: FLOAT for i in floating}}, var_home)
