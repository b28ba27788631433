"""Who computes what and who sends what to whom, for runtimes with one worker per stage.

The local runtime keeps every value of a step in one dictionary. A distributed runtime keeps
each value on the stage that computes it, and every other stage that reads it must be sent a
copy. :func:`step_dataflow` derives those routes from a
:class:`~harpjax.compiler.compile.CompiledStep`, once, identically on the driver and in every
worker (it reads only the traced programs and the placement, never executables), so that
every send has exactly one matching receive:

* *outer values* (the step's arguments, the placement groups' results, the region's loss,
  auxiliary outputs and gradients) live on their home stage and go to each other stage that
  reads them (a placement group there, or that stage's part of the region);
* *activations* of microbatch ``m`` go, after ``F(s, m)``, in one message per consuming stage;
* *cotangents* go back after ``B(t, m)``, one message per producing stage, and are summed by
  the producer in decreasing consumer order (the local runtime's order, so that the numbers
  are bit for bit the same);
* *gradient parts* of a parameter read by several stages go to its owner after the pipeline.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from typing import Any

from harpjax.compiler.stages import CompiledStep
from harpjax.compiler.trace import Lit

__all__ = ["StepDataflow", "step_dataflow", "fingerprint"]


@dataclasses.dataclass(frozen=True, eq=False)
class StepDataflow:
  """The routes of one compiled step. Stage indices are pipeline positions.

  Attributes:
    num_stages: ``S``.
    const_vids: outer value ids of the step program's constants (every worker has them).
    leaf_vids: per flattened step-argument leaf, its outer value id.
    leaf_readers: per leaf, the stages that read it.
    home: outer value id -> the stage computing it (placement groups and region outputs).
    readers: outer value id -> the stages reading it (groups and region inputs).
    before: per stage, indices into ``placement.before`` of its groups, in execution order.
    after: per stage, indices into ``placement.after`` of its groups, in execution order.
    region_inputs: per stage, ``(region invar index, outer ref)`` of the region inputs it
      reads (parameters, data, and inputs passed through to a region output it computes).
    region_out_home: per region output (loss, aux..., gradients), the stage computing it.
    act_routes: ``(producer, consumer)`` -> region value ids sent after each forward.
    ct_routes: ``(consumer, producer)`` -> region value ids whose cotangents go back after
      each backward.
    ct_sources: per stage, region value id -> consumer stages sending its cotangent, in
      decreasing order (the order they are summed in).
    act_sources: per stage, the producer stages it receives activations from.
    ct_targets: per stage, the producer stages it sends cotangents to.
    grad_users: per parameter, the stages whose gradient parts go to the owner (the owner
      excluded), increasing.
    param_owner: per parameter, its owner stage.
    outputs: per outer output, ``("lit", value)``, ``("const", vid)``, ``("leaf", i)`` or
      ``("stage", s, vid)``.
    fingerprint: a digest of the traced programs and the placement; workers check theirs.
  """
  num_stages: int
  const_vids: tuple
  leaf_vids: tuple
  leaf_readers: tuple
  home: dict
  readers: dict
  before: tuple
  after: tuple
  region_inputs: tuple
  region_out_home: tuple
  act_routes: dict
  ct_routes: dict
  ct_sources: tuple
  act_sources: tuple
  ct_targets: tuple
  grad_users: tuple
  param_owner: tuple
  outputs: tuple
  fingerprint: str

  def pairs(self) -> frozenset[tuple[int, int]]:
    """Every ``(sender, receiver)`` pair of stages that may exchange a message in a step.

    Step arguments held on the workers go from the stage that computed them (the home of a
    step output) to the stages that read them.
    """
    out = set(self.act_routes) | set(self.ct_routes)
    for v, h in self.home.items():
      out |= {(h, r) for r in self.readers.get(v, ()) if r != h}
    for j, users in enumerate(self.grad_users):
      out |= {(u, self.param_owner[j]) for u in users}
    holders = {o[1] for o in self.outputs if o[0] == "stage"}
    for rs in self.leaf_readers:
      out |= {(h, r) for h in holders for r in rs if r != h}
    return frozenset(out)


def fingerprint(cs: CompiledStep) -> str:
  """A digest of what the dataflow depends on: programs, avals, stage slices, placement."""
  h = hashlib.sha256()
  ts = cs.traced
  add = lambda *xs: h.update(repr(xs).encode())
  for prog in (ts.outer, cs.layers.program):
    add(len(prog.avals), prog.invars, prog.outvars, prog.num_consts)
    for op in prog.ops:
      add(op.name, op.invars, op.outvars)
    for a in prog.avals:
      add(getattr(a, "shape", None), str(getattr(a, "dtype", None)))
  add(ts.region_op, ts.num_params, ts.num_microbatches, [layer.start for layer in cs.layers])
  for sp in cs.programs:
    add(sp.own_range, sp.param_ids, sp.data_ids, sp.act_ids, sp.act_int_ids, sp.output_ids)
  for g in cs.placement.before + cs.placement.after:
    add(g.home, g.level, g.in_ids, g.out_ids, [op.index for op in g.ops])
  add(cs.schedule.tables, cs.param_owner, cs.output_stage)
  return h.hexdigest()[:16]


def step_dataflow(cs: CompiledStep) -> StepDataflow:
  """Derives the routes of a compiled step (see the module docstring)."""
  ts = cs.traced
  outer = ts.outer
  prog = cs.layers.program
  S = cs.num_stages
  programs = cs.programs
  region_eqn = outer.ops[ts.region_op]
  n_fwd = len(prog.outvars)
  nc = outer.num_consts
  const_vids = tuple(outer.invars[:nc])
  leaf_vids = tuple(outer.invars[nc:])
  readers: dict[int, set[int]] = defaultdict(set)
  home: dict[int, int] = {}

  groups = list(cs.placement.before) + list(cs.placement.after)
  n_before = len(cs.placement.before)
  before = [[] for _ in range(S)]
  after = [[] for _ in range(S)]
  for gi, g in enumerate(groups):
    (before if gi < n_before else after)[g.home].append(gi if gi < n_before else gi - n_before)
    for v in g.in_ids:
      readers[v].add(g.home)
    for v in g.out_ids:
      home[v] = g.home

  # Region inputs each stage reads.
  invar_index = {vid: k for k, vid in enumerate(prog.invars)}
  dynamic = {prog.invars[k] for k, inp in enumerate(ts.inputs) if inp.kind != "static"}
  region_inputs: list[list[tuple[int, Any]]] = [[] for _ in range(S)]
  for s, sp in enumerate(programs):
    for v in tuple(sp.param_ids) + tuple(sp.data_ids):
      if v in dynamic:
        k = invar_index[v]
        region_inputs[s].append((k, region_eqn.invars[k]))
  region_out_home = []
  for k in range(len(region_eqn.outvars)):
    region_out_home.append(max(cs.output_stage[k], 0) if k < n_fwd
                           else cs.param_owner[k - n_fwd])
  for k, ref in enumerate(prog.outvars):
    if not isinstance(ref, Lit) and ref in invar_index and ref in dynamic:
      kk = invar_index[ref]
      entry = (kk, region_eqn.invars[kk])
      if entry not in region_inputs[region_out_home[k]]:
        region_inputs[region_out_home[k]].append(entry)
  for s in range(S):
    for _, ref in region_inputs[s]:
      if not isinstance(ref, Lit):
        readers[ref].add(s)
  for k, vid in enumerate(region_eqn.outvars):
    if vid >= 0:
      home[vid] = region_out_home[k]
  for v in const_vids:   # every worker traced the constants itself
    readers.pop(v, None)
    home.pop(v, None)

  # Activations and cotangents.
  producer = {}
  for s, sp in enumerate(programs):
    for v in sp.output_ids:
      producer[v] = s
  act_routes: dict[tuple[int, int], list[int]] = defaultdict(list)
  ct_routes: dict[tuple[int, int], list[int]] = defaultdict(list)
  ct_sources: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(S)]
  for t, sp in enumerate(programs):
    for v in tuple(sp.act_ids) + tuple(sp.act_int_ids):
      act_routes[(producer[v], t)].append(v)
    for v in sp.act_ids:
      p = producer[v]
      ct_routes[(t, p)].append(v)
      ct_sources[p][v].append(t)
  act_sources = tuple(tuple(sorted(p for (p, t) in act_routes if t == s)) for s in range(S))
  ct_targets = tuple(tuple(sorted(p for (t, p) in ct_routes if t == s)) for s in range(S))

  grad_users = []
  for j in range(ts.num_params):
    grad_users.append(tuple(s for s in cs.param_users[j] if s != cs.param_owner[j]))

  leaf_pos = {v: i for i, v in enumerate(leaf_vids)}
  outputs = []
  for ref in outer.outvars:
    if isinstance(ref, Lit):
      outputs.append(("lit", ref.value))
    elif ref in const_vids:
      outputs.append(("const", ref))
    elif ref in leaf_pos:
      outputs.append(("leaf", leaf_pos[ref]))
    else:
      outputs.append(("stage", home[ref], ref))

  frozen_readers = {v: frozenset(rs) for v, rs in readers.items()}
  return StepDataflow(
      num_stages=S, const_vids=const_vids, leaf_vids=leaf_vids,
      leaf_readers=tuple(frozen_readers.get(v, frozenset()) for v in leaf_vids),
      home=home, readers=frozen_readers,
      before=tuple(tuple(b) for b in before), after=tuple(tuple(a) for a in after),
      region_inputs=tuple(tuple(r) for r in region_inputs),
      region_out_home=tuple(region_out_home),
      act_routes={k: tuple(sorted(v)) for k, v in act_routes.items()},
      ct_routes={k: tuple(sorted(v)) for k, v in ct_routes.items()},
      ct_sources=tuple({v: tuple(sorted(ts_, reverse=True)) for v, ts_ in d.items()}
                       for d in ct_sources),
      act_sources=act_sources, ct_targets=ct_targets, grad_users=tuple(grad_users),
      param_owner=tuple(cs.param_owner), outputs=tuple(outputs), fingerprint=fingerprint(cs))
