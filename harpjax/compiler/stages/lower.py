"""Lowering a laid-out step for another process: serialised executables and the layout.

A Ray worker does not trace the user's step. The driver lowers each stage's functions and
placement groups to StableHLO with ``jax.export`` (on an abstract ``(dp, tp)`` mesh: no device
is needed, only the target platform), and sends the worker a :class:`LoweredStep`: the
picklable :class:`~harpjax.compiler.stages.layout.StepLayout`, the schedule, the plan, and its
stage's serialised executables. The worker loads them onto its own devices
(:meth:`LoweredStep.load`) and gets the same :class:`~harpjax.compiler.stages.stage.
StageExecutables` the local runtime jits in process: the same computation, bit for bit.

The lowered step records the JAX settings it was lowered under (``jax_enable_x64``, the
default matmul precision...: ``harpjax._compat.JAX_SETTINGS``); a process loading it must have
the same (a Ray worker takes them first), or :meth:`LoweredStep.load` names those that differ.

The forward returns the leaves of its ``jax.vjp`` closure (the residuals); the backward
rebuilds the closure from them with the tree structure recorded while the forward was lowered,
so both cross the process boundary as flat arrays.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from harpjax import _compat
from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.plan import Plan
from harpjax.compiler.schedule import Schedule
from harpjax.compiler.stages.compile import StepProgram, check_host_memory, split_executables
from harpjax.compiler.stages.layout import StepLayout
from harpjax.compiler.stages.stage import (StageExecutables, acc_shardings, fwd_in_specs,
                                           gradient_shardings)
from harpjax.errors import RuntimeFailure, UnsupportedError

log = logging.getLogger(__name__)

__all__ = ["LoweredStage", "LoweredStep", "lower_step"]


@dataclasses.dataclass(frozen=True)
class LoweredStage:
  """One stage's executables, serialised (``jax.export``).

  Attributes:
    index: the stage.
    fwd, bwd, zeros: the serialised forward, backward and zeros functions.
    reduce: the serialised reduction of the replicas' accumulators (``b""``: none).
    groups: placement group index (into :attr:`StepLayout.groups`) -> serialised function,
      for the groups this stage runs.
    parts: a stage that splits its rows among groups of devices
      (:attr:`StepLayout.splits`): per group, its serialised ``(fwd, bwd, zeros)``.
  """
  index: int
  fwd: bytes
  bwd: bytes
  zeros: bytes
  groups: dict
  parts: tuple = ()
  reduce: bytes = b""


@dataclasses.dataclass(frozen=True)
class LoweredStep:
  """A step ready to be compiled in another process: plain data and serialised StableHLO.

  Attributes:
    layout: what goes where (:class:`~harpjax.compiler.stages.layout.StepLayout`).
    plan: the resolved plan.
    schedule: the task tables.
    platform: the platform the executables were lowered for (``"cpu"``, ``"cuda"``...).
    stages: per stage, its :class:`LoweredStage`, or ``None`` where not included
      (:meth:`for_stage` keeps one).
    jax_settings: ``((name, value), ...)``: the JAX settings the step was lowered under
      (``harpjax._compat.jax_settings``); a process loading it needs the same.
  """
  layout: StepLayout
  plan: Plan
  schedule: Schedule
  platform: str
  stages: tuple
  jax_settings: tuple = ()

  def for_stage(self, stage: int) -> "LoweredStep":
    """A copy holding only ``stage``'s executables (what that stage's worker receives)."""
    return dataclasses.replace(self, stages=tuple(
        st if s == stage else None for s, st in enumerate(self.stages)))

  def load(self, stage: int, devices: Sequence, remote: dict | None = None
           ) -> tuple[StageExecutables, dict]:
    """Compiles-to-be ``stage``'s executables on ``devices`` (its submesh, in order).

    A stage that splits its rows among groups (:attr:`StepLayout.splits`) may have groups
    that run in processes of their own: ``remote`` maps each such group to the client that
    reaches it (:class:`~harpjax.compiler.stages.split.RemoteGroup`), and ``devices`` are then
    the other groups' only.

    Returns:
      ``(stage executables, {group index: jitted function})``; both compile on first call
      (or ahead, :func:`~harpjax.compiler.stages.precompile`).

    Raises:
      RuntimeFailure: this process's JAX settings differ from those the step was lowered
        under (:attr:`jax_settings`); the message names each setting with both values.
    """
    lowered = self.stages[stage]
    if lowered is None:
      raise ValueError(f"this lowered step does not hold stage {stage}'s executables")
    differ = _compat.differing_jax_settings(dict(self.jax_settings))
    if differ:
      raise RuntimeFailure(
          f"stage {stage} was lowered under other JAX settings than this process has: "
          + "; ".join(f"{n} is {a!r} in the lowered step but {b!r} here"
                      for n, (a, b) in sorted(differ.items()))
          + "; set them here first (jax.config.update), globally rather than in a context "
          "manager of the lowering thread")
    lay = self.layout.stages[stage]
    self._check_host_memory(stage, devices)
    if stage in self.layout.splits:
      loaders = [lambda g_lay, mesh, blobs=blobs: _load(g_lay, mesh, *blobs)
                 for blobs in lowered.parts]
      executables = split_executables(self.layout, stage, loaders, devices, remote)
      mesh = executables.mesh
    else:
      mesh = sharding_lib.make_mesh(devices, lay.logical_mesh)
      executables = _load(lay, mesh, lowered.fwd, lowered.bwd, lowered.zeros, lowered.reduce)
    groups = {}
    for gi, blob in lowered.groups.items():
      groups[gi] = jax.jit(_call(blob), out_shardings=self.layout.group_out_shardings(gi, mesh))
    return executables, groups

  def _check_host_memory(self, stage: int, devices: Sequence) -> None:
    """The stage's devices have host memory where it keeps its optimizer state or residuals
    there."""
    if any(h == stage for h, _ in self.layout.host):
      check_host_memory(devices, stage)
    if stage in self.layout.host_residuals:
      check_host_memory(devices, stage, residuals=True)

  def load_group(self, stage: int, group: int, devices: Sequence) -> StageExecutables:
    """Group ``group`` of a stage that splits its rows, on ``devices`` (the group's own): what
    a process running only that group loads
    (:class:`~harpjax.runtime.group_worker.GroupWorker`)."""
    lowered = self.stages[stage]
    if lowered is None or not lowered.parts:
      raise ValueError(f"this lowered step does not hold stage {stage}'s groups")
    g_lay = self.layout.splits[stage].groups[group].layout
    self._check_host_memory(stage, devices)
    mesh = sharding_lib.make_mesh(list(devices), g_lay.logical_mesh)
    return _load(g_lay, mesh, *lowered.parts[group])


def _call(blob: bytes):
  return export.deserialize(blob).call


def _load(lay, mesh, fwd: bytes, bwd: bytes, zeros: bytes, reduce: bytes = b""
          ) -> StageExecutables:
  held = acc_shardings(lay, mesh)
  return StageExecutables(
      lay, mesh, jax.jit(_call(fwd)), jax.jit(_call(bwd), donate_argnums=(3,)),
      jax.jit(_call(zeros), out_shardings=held),
      jax.jit(_call(reduce), out_shardings=gradient_shardings(lay, mesh)) if reduce else None)


def lower_step(program: StepProgram, platform: str | None = None,
               stages: Sequence[int] | None = None) -> LoweredStep:
  """Lowers and serialises the stages' executables and placement groups of ``program``.

  Args:
    program: from :func:`~harpjax.compiler.stages.layout_step`.
    platform: the platform the workers run on; default JAX's default backend here.
    stages: the stages to lower (default all).

  Raises:
    UnsupportedError: ``jax.export`` cannot serialise a stage (a host callback, say); the
      message names the stage.
  """
  t0 = time.perf_counter()
  platform = platform or jax.default_backend()
  lay = program.layout
  todo = range(lay.num_stages) if stages is None else stages
  out: list[LoweredStage | None] = [None] * lay.num_stages
  for s in todo:
    try:
      out[s] = _lower_stage(program, s, platform)
    except NotImplementedError as e:   # jax.export: host callbacks and the like
      raise UnsupportedError(
          f"stage {s} cannot be lowered for another process: {e}. Host callbacks "
          "(jax.debug.print, jax.debug.callback, io_callback) run only in this process: remove "
          "them from the step or use runtime='local'") from e
  log.info("lowered %d stages for %s in %.1f s", len(todo), platform, time.perf_counter() - t0)
  return LoweredStep(lay, program.plan, program.schedule, platform, tuple(out),
                     tuple(sorted(_compat.jax_settings().items())))


def _lower_stage(program: StepProgram, s: int, platform: str) -> LoweredStage:
  lay = program.layout.stages[s]
  split = program.layout.splits.get(s)
  reduce = b""
  if split is None:
    fwd, bwd, zeros = _lower_functions(lay, program.functions[s], platform)
    parts = ()
    if program.functions[s].reduce is not None:
      mesh = sharding_lib.abstract_mesh(lay.logical_mesh)
      held = tuple(jax.ShapeDtypeStruct(lay.held_acc_aval(v).shape, lay.avals[v].dtype)
                   for v in lay.param_ids)
      reduce = export.export(jax.jit(program.functions[s].reduce,
                                     in_shardings=(acc_shardings(lay, mesh),),
                                     out_shardings=gradient_shardings(lay, mesh)),
                             platforms=(platform,))(held).serialize()
  else:   # the groups' executables do the work
    fwd = bwd = zeros = b""
    parts = tuple(_lower_functions(g.layout, fns, platform)
                  for g, fns in zip(split.groups, program.split_functions[s]))
  mesh = sharding_lib.abstract_mesh(lay.logical_mesh)
  sharded = lambda spec: NamedSharding(mesh, spec)
  step_lay = program.layout
  groups = {}
  for gi, (g, fn) in enumerate(zip(step_lay.groups, program.group_functions)):
    if g.home != s:
      continue
    pref = lambda v: step_lay.preferred_sharding(s, v, mesh) or sharded(P())
    in_args = tuple(step_lay.outer_avals[v] for v in g.in_ids)
    exp = export.export(jax.jit(fn, in_shardings=tuple(pref(v) for v in g.in_ids),
                                out_shardings=step_lay.group_out_shardings(gi, mesh)),
                        platforms=(platform,))
    groups[gi] = exp(*in_args).serialize()
  return LoweredStage(s, fwd, bwd, zeros, groups, parts, reduce)


def _lower_functions(lay, fns, platform: str) -> tuple[bytes, bytes, bytes]:
  """A stage's (or a group's) forward, backward and zeros, serialised."""
  mesh = sharding_lib.abstract_mesh(lay.logical_mesh)
  sharded = lambda spec: NamedSharding(mesh, spec)
  in_specs = fwd_in_specs(lay)
  in_sh = jax.tree_util.tree_map(sharded, in_specs, is_leaf=lambda x: isinstance(x, P))
  avals = lambda ids: tuple(lay.avals[v] for v in ids)
  args = (avals(lay.param_ids), avals(lay.act_ids), avals(lay.act_int_ids),
          avals(lay.data_ids), jax.ShapeDtypeStruct((), jnp.int32))
  exp = lambda fn, **kw: export.export(jax.jit(fn, **kw), platforms=(platform,))
  fwd = exp(fns.fwd, in_shardings=in_sh)(*args)
  residuals = tuple(fwd.out_avals[len(lay.output_ids):])
  cts = tuple(lay.avals[v] for v, has in zip(lay.output_ids, lay.ct_present) if has)
  ct_sh = tuple(sharded(lay.specs[v]) for v, has in zip(lay.output_ids, lay.ct_present) if has)
  acc_sh = acc_shardings(lay, mesh)
  held = tuple(lay.held_acc_aval(v) for v in lay.param_ids)
  bwd = exp(fns.bwd, in_shardings=(in_sh[0], None, ct_sh, acc_sh),
            out_shardings=(acc_sh, None) if lay.replicas else None)(
      args[0],
      tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in residuals),
      cts, held)
  zeros = exp(fns.zeros, out_shardings=acc_sh)()
  return fwd.serialize(), bwd.serialize(), zeros.serialize()
