"""Running a compiled step in one process.

Stages live on disjoint submeshes of the local devices; activations and gradients move between
them with ``jax.device_put``. The placement groups before the pipeline run on their stages, then
the region: every stage's :class:`~harpjax.runtime.interpreter.StageRun`, their tasks in a
dependency-valid order (:func:`harpjax.compiler.schedule.dry_run`), messages kept in this
process (:class:`~harpjax.runtime.interpreter.LocalMessenger`); then the groups after it. JAX
dispatches asynchronously, so stages on different devices overlap as their data dependencies
allow.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from harpjax.compiler.schedule import dry_run
from harpjax.compiler.stages import CompiledStep
from harpjax.compiler.trace import Lit
from harpjax.runtime.interpreter import LocalMessenger, StageRun, place_on_mesh

log = logging.getLogger(__name__)

__all__ = ["run_step", "run_region", "strongly_typed"]


def strongly_typed(x, aval):
  """A Python scalar or weakly typed argument as the traced program types it (strongly):
  ``TrainState.step`` starts as the int ``0``, and a weak first step would compile the
  placement groups once more on the second step."""
  if isinstance(x, (bool, int, float, complex)) or (
      getattr(x, "weak_type", False) and not getattr(aval, "weak_type", False)):
    return jnp.asarray(x, dtype=aval.dtype)
  return x


def run_step(cs: CompiledStep, args: tuple) -> Any:
  """Runs one training step; returns the step's outputs with the user's pytree structure."""
  ts, lay = cs.traced, cs.layout
  outer = ts.outer
  leaves = jax.tree_util.tree_leaves(args)
  leaves = [strongly_typed(x, outer.avals[v]) for x, v in zip(leaves, lay.leaf_vids)]
  env: dict[int, Any] = dict(zip(outer.invars, list(ts.outer_consts) + leaves))
  _run_groups(cs, range(lay.num_before), env)
  run_region(cs, env)
  _run_groups(cs, range(lay.num_before, len(lay.groups)), env)
  outs = [ref.value if isinstance(ref, Lit) else env[ref] for ref in outer.outvars]
  return jax.tree_util.tree_unflatten(ts.out_tree, outs)


def _run_groups(cs: CompiledStep, indices, env: dict) -> None:
  """Runs placement groups, each on its stage's mesh, reading and writing ``env``."""
  lay = cs.layout
  for gi in indices:
    g = lay.groups[gi]
    mesh = cs.stages[g.home].mesh
    args = [place_on_mesh(env[v], mesh, lay.preferred_sharding(g.home, v, mesh))
            for v in g.in_ids]
    env.update(zip(g.out_ids, cs.group_fns[gi](*args)))


def run_region(cs: CompiledStep, env: dict) -> None:
  """The pipelined region: reads its inputs from ``env`` and writes its results (loss,
  auxiliary outputs, gradients) there."""
  lay = cs.layout
  inboxes: list[dict] = [dict() for _ in range(lay.num_stages)]
  runs = []
  for s, st in enumerate(cs.stages):
    inputs = {lay.region_invars[k]: ref.value if isinstance(ref, Lit) else env[ref]
              for k, ref in lay.region_inputs[s]}
    runs.append(StageRun(lay, st, LocalMessenger(s, inboxes), inputs))
  for s, task in dry_run(cs.schedule.tables):
    runs[s].task(task)
  for run in runs:
    env.update(run.combine())
  for run in runs:
    run.send_gradient_parts()
  for run in runs:
    env.update(run.reduce())
