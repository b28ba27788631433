"""Running a compiled step in one process.

Stages live on disjoint submeshes of the local devices, except that under an interleaved schedule
the stages of one device group share its submesh; activations and gradients move between them
with ``jax.device_put`` (a no-op between stages of one group). The placement groups before the pipeline run on their stages, then
the region: every stage's :class:`~harpjax.runtime.interpreter.StageRun`, their tasks in a
dependency-valid order (:meth:`harpjax.compiler.schedule.Schedule.run_order`: each device
group's tasks in its order), messages kept in this
process (:class:`~harpjax.runtime.interpreter.LocalMessenger`); then the groups after it. JAX
dispatches asynchronously, so stages on different devices overlap as their data dependencies
allow.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
from typing import Any

import jax
import jax.numpy as jnp

from harpjax.compiler.stages import CompiledStep
from harpjax.compiler.trace import Lit
from harpjax.errors import InvalidOptionError
from harpjax.runtime.interpreter import GroupParams, LocalMessenger, StageRun, place_on_mesh

log = logging.getLogger(__name__)

__all__ = ["LocalRuntime", "check_compilation_cache", "run_step", "run_region",
           "early_updates", "run_ready_groups", "strongly_typed"]


def check_compilation_cache(value, where: str):
  """``value`` as a ``compilation_cache`` option: ``True``, ``False`` or a directory (a
  ``str``); else an :class:`~harpjax.errors.InvalidOptionError` naming ``where``."""
  if isinstance(value, bool):
    return value
  if isinstance(value, (str, os.PathLike)):
    return os.fspath(value)
  raise InvalidOptionError(f"{where}={value!r}: True (harpjax's cache directory, "
                           "$HARPJAX_CACHE_DIR or ~/.cache/harpjax/profiles, under "
                           "executables/), False, or a directory")


@dataclasses.dataclass(frozen=True)
class LocalRuntime:
  """Run every stage in this process (``auto_parallel(runtime=harpjax.LocalRuntime(...))``;
  ``runtime="local"`` is ``LocalRuntime()``).

  Attributes:
    compile_workers: threads compiling the stages' executables ahead of the first call;
      ``None`` one per stage, at most one per CPU; ``0`` compiles lazily, executable by
      executable, on the first call.
    compilation_cache: keep the stages' compiled executables on disk, so the first step of a
      later process compiles nothing: ``True`` (JAX's persistent compilation cache in
      ``executables/`` of harpjax's cache directory, ``$HARPJAX_CACHE_DIR`` or
      ``~/.cache/harpjax/profiles``), a directory, or ``False``. A cache directory configured
      in JAX is kept; otherwise the setting is process-wide (later ``jax.jit`` compilations
      are kept too) and JAX's one-second minimum compile time for keeping an executable
      drops to zero.
    progress: a progress bar over the stages while they compile (``None``: when stderr is a
      terminal).
  """
  compile_workers: int | None = None
  compilation_cache: bool | str = True
  progress: bool | None = None

  name = "local"

  def __post_init__(self):
    w = self.compile_workers
    if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0):
      raise InvalidOptionError(f"LocalRuntime.compile_workers={w!r}: a count of threads >= 0 "
                               "(0 compiles lazily, on the first call) or None (one per "
                               "stage)")
    if w is not None:
      object.__setattr__(self, "compile_workers", int(w))
    object.__setattr__(self, "compilation_cache", check_compilation_cache(
        self.compilation_cache, "LocalRuntime.compilation_cache"))
    if self.progress is not None and not isinstance(self.progress, bool):
      raise InvalidOptionError(f"LocalRuntime.progress={self.progress!r} must be True, False "
                               "or None (when stderr is a terminal)")


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
  after = list(range(lay.num_before, len(lay.groups)))
  run_region(cs, env, after)
  _run_groups(cs, after, env)
  outs = [ref.value if isinstance(ref, Lit) else env[ref] for ref in outer.outvars]
  return jax.tree_util.tree_unflatten(ts.out_tree, outs)


def _run_groups(cs: CompiledStep, indices, env: dict) -> None:
  """Runs placement groups, each on its stage's mesh, reading and writing ``env``."""
  lay = cs.layout
  for gi in indices:
    g = lay.groups[gi]
    mesh = cs.stages[g.home].group_mesh(g.side)
    args = [place_on_mesh(env[v], mesh, lay.preferred_sharding(g.home, v, mesh))
            for v in g.in_ids]
    env.update(zip(g.out_ids, cs.group_fns[gi](*args)))


def _group_params(sched, host_params, runs) -> list:
  """Per device group, its :class:`~harpjax.runtime.interpreter.GroupParams` (``None`` where
  no stage of the group keeps its parameters in host memory); ``[]`` without any."""
  if not host_params or sched.groups is None:
    return []
  out = []
  for order in sched.groups:
    if not {t.stage for t in order} & set(host_params):
      out.append(None)
      continue
    gp = GroupParams(order, host_params)
    for s in {t.stage for t in order}:
      gp.add(runs[s])
    out.append(gp)
  return out


def early_updates(lay) -> tuple[bool, ...]:
  """Per stage, whether its gradients are final once its own last task has run: every
  parameter it owns is read by it alone (no other stage sends it a gradient part), so its
  reduction, and the update that reads only its gradients, may run inside the pipeline's
  drain (interleaved optimizer updates)."""
  out = [True] * lay.num_stages
  for j in range(lay.num_params):
    if tuple(lay.param_users[j]) != (lay.param_owner[j],):
      out[lay.param_owner[j]] = False
  return tuple(out)


def run_ready_groups(cs: CompiledStep, pending: list, env: dict) -> list:
  """Runs, in order, the groups of ``pending`` (indices into the layout's groups) whose
  inputs are all in ``env`` (a group's outputs may make a later one ready); removes them
  from ``pending`` and returns their indices."""
  groups = cs.layout.groups
  done = []
  for gi in list(pending):
    if all(v in env for v in groups[gi].in_ids):
      _run_groups(cs, (gi,), env)
      pending.remove(gi)
      done.append(gi)
  return done


def run_region(cs: CompiledStep, env: dict, after: list | None = None) -> None:
  """The pipelined region: reads its inputs from ``env`` and writes its results (loss,
  auxiliary outputs, gradients) there.

  With ``after`` (the indices of the groups after the pipeline still to run; those run here
  are removed), a stage whose gradients are final once its last task has run
  (:func:`early_updates`) reduces them right after that task, and every group whose inputs
  are then all there runs at once (:func:`run_ready_groups`): its optimizer update runs on
  its devices inside the pipeline's drain, while the other stages finish their backwards
  (under an interleaved schedule, between the tasks of its device group), not after the
  whole pipeline. The values are the same either way."""
  lay = cs.layout
  inboxes: list[dict] = [dict() for _ in range(lay.num_stages)]
  runs = []
  for s, st in enumerate(cs.stages):
    inputs = {lay.region_invars[k]: ref.value if isinstance(ref, Lit) else env[ref]
              for k, ref in lay.region_inputs[s]}
    runs.append(StageRun(lay, st, LocalMessenger(s, inboxes), inputs))
  sched = cs.schedule
  held = _group_params(sched, lay.host_params, runs)
  pos = [0] * len(held)
  left = [len(row) for row in sched.tables]   # per stage, its tasks still to run
  early = early_updates(lay) if after is not None else (False,) * lay.num_stages
  reduced = set()
  for t in sched.run_order():   # stages sharing a device group: its interleaved order
    g = sched.device_groups[t.stage] if held else -1
    if g >= 0 and held[g] is not None:   # its offloaded parameters, along the group's order
      held[g].before(pos[g])
      runs[t.stage].task(t.task)
      held[g].after(pos[g])
      pos[g] += 1
    else:
      runs[t.stage].task(t.task)
    left[t.stage] -= 1
    if left[t.stage] == 0 and early[t.stage]:   # its update, inside the drain
      env.update(runs[t.stage].reduce())
      reduced.add(t.stage)
      run_ready_groups(cs, after, env)
  for run in runs:
    env.update(run.combine())
  for run in runs:
    run.send_gradient_parts()
  for run in runs:
    if run.s not in reduced:
      env.update(run.reduce())
