"""What a compiled stage holds per device over a step: XLA's account beside the memory model's.

:func:`memory_report` compiles a stage's forward, backward and optimizer update (the placement
groups after the pipeline) with the shardings the runtime passes, reads XLA's
``memory_analysis()`` of each, and follows the step on one device of the stage:

* the *state* it holds: the parameters, the gradient accumulator, the optimizer state (the
  step inputs :func:`~harpjax.compiler.stages.state_successors` finds, homed on the stage;
  none of it on the device if the stage keeps it in host memory), each in its sharding
  (ZeRO splits them over ``dp``), and the residuals of the microbatches in
  flight (``N``, from the stage's row of the task table; one microbatch's residuals are what
  XLA's forward returns besides the stage's outputs);
* during the ``N``-th forward: that state with ``N - 1`` residuals, plus the forward's outputs
  and temporaries (XLA); during a backward: the state with ``N`` residuals, plus its new
  outputs (not aliased to the donated accumulator) and temporaries (XLA);
* where the replicas accumulate their own gradients, their sum after the last backward: the
  state plus the reduced gradients (XLA);
* during the update, group after group: everything alive (the state, the gradients, the
  results of earlier groups; the optimizer state brought from host memory included), plus the
  group's outputs and temporaries (XLA; XLA:CPU counts results bound for host memory among
  them, and so does the model).

The largest of these is the stage's peak as XLA compiled it (``xla_peak_bytes``), next to
:func:`harpjax.compiler.profile.stage_memory`'s prediction from the stage's parameter,
gradient, optimizer-state and activation bytes *without* ZeRO and its level
(``predicted``). ``benchmarks/memory.py`` prints both for several stages and levels.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.profile import StageMemory, stage_memory
from harpjax.compiler.stages.aot import compile_group, compile_stage
from harpjax.compiler.stages.compile import CompiledStep, state_successors
from harpjax.compiler.stages.split import RemoteGroup
from harpjax.compiler.stages.zebra import ZebraStageExecutables
from harpjax.compiler.trace import aval_nbytes
from harpjax.errors import UnsupportedError

__all__ = ["StageMemoryReport", "memory_report", "in_flight"]


@dataclasses.dataclass(frozen=True)
class StageMemoryReport:
  """One stage's memory per device, from XLA and from the model (bytes).

  Attributes:
    stage: the stage; zero, dp: its ZeRO level and data-parallel degree.
    in_flight: the most microbatches whose residuals it holds at once (``N``).
    param_bytes, grad_bytes, opt_bytes: what one device holds, as sharded.
    act_bytes: one microbatch's residuals per device (XLA's forward).
    executables: name (``"fwd"``, ``"bwd"``, ``"update0"``...) ->
      ``(argument, output, alias, temp)`` bytes of XLA's ``memory_analysis()``.
    phases: name -> peak bytes while it runs (state held around it included).
    xla_peak_bytes: the largest of ``phases``.
    predicted: the model's :class:`~harpjax.compiler.profile.StageMemory`.
  """
  stage: int
  zero: int
  dp: int
  in_flight: int
  param_bytes: float
  grad_bytes: float
  opt_bytes: float
  act_bytes: float
  executables: dict
  phases: dict
  xla_peak_bytes: float
  predicted: StageMemory

  @property
  def predicted_peak_bytes(self) -> float:
    return self.predicted.peak_bytes(self.in_flight)

  @property
  def error(self) -> float:
    """``predicted / xla - 1``."""
    return self.predicted_peak_bytes / self.xla_peak_bytes - 1.0


def in_flight(schedule, stage: int) -> int:
  """The most microbatches stage ``stage`` has run forward but not yet backward."""
  n = most = 0
  for task in schedule.tables[stage]:
    n += 1 if task.kind == "F" else -1
    most = max(most, n)
  return most


def _device_bytes(aval, sharding) -> float:
  """Bytes of one device's shard of a value of ``aval`` in ``sharding``."""
  shape = tuple(aval.shape)
  shard = sharding.shard_shape(shape) if shape else ()
  whole = aval_nbytes(aval)
  n = int(np.prod(shape, dtype=np.int64)) if shape else 1
  return whole * (int(np.prod(shard, dtype=np.int64)) if shape else 1) / max(n, 1)



def _fwd_results(compiled, num_outputs: int) -> tuple[float, float]:
  """Per-device bytes of a compiled forward's outputs (its first ``num_outputs`` results) and
  of its residuals (the rest), each in the sharding XLA gave it."""
  info = jax.tree_util.tree_leaves(compiled.out_info)
  shardings = jax.tree_util.tree_leaves(compiled.output_shardings)
  sizes = [_device_bytes(i, sh) for i, sh in zip(info, shardings, strict=True)]
  return float(sum(sizes[:num_outputs])), float(sum(sizes[num_outputs:]))


def _analysis(compiled) -> tuple[float, float, float, float]:
  m = compiled.memory_analysis()
  return (float(m.argument_size_in_bytes), float(m.output_size_in_bytes),
          float(m.alias_size_in_bytes), float(m.temp_size_in_bytes))


def memory_report(cs: CompiledStep, stage: int, *, compiled: Mapping | None = None,
                  reduce_scatter: bool = False, group: int = 0) -> StageMemoryReport:
  """Stage ``stage``'s per-device memory over a step, from XLA and from the model.

  Args:
    cs: the compiled step.
    stage: the stage.
    compiled: its executables already compiled by
      :func:`~harpjax.compiler.stages.compile_stage` (saves compiling them again).
    reduce_scatter: the model's assumption for the backend (XLA:CPU: ``False``).
    group: of a stage that splits its rows among groups (a mixed-type stage), the group to
      follow: its executables at its rows on its devices. The first group holds the optimizer
      state and runs the update; the others hold parameters, accumulator and residuals only.

  Returns:
    The :class:`StageMemoryReport`.
  """
  lay, st = cs.layout, cs.stages[stage]
  if isinstance(st, ZebraStageExecutables):
    raise UnsupportedError(f"stage {stage} is a zebra stage (attention and experts on two "
                           "groups of devices): its memory report is not made yet")
  split = lay.splits.get(stage)
  if split is None and group:
    raise UnsupportedError(f"stage {stage} runs on one group of devices; group={group} "
                           "names none")
  if split is not None:
    if not 0 <= group < len(split.groups):
      raise UnsupportedError(f"stage {stage} has {len(split.groups)} groups; group={group} "
                             "names none")
    part = st.parts[group]
    if isinstance(part, RemoteGroup):
      raise UnsupportedError(f"stage {stage}'s group {group} runs in another process")
    st = part
  home = group == 0
  sl, mesh = st.layout, st.mesh
  traced = cs.traced
  outer = traced.outer
  dp = sl.logical_mesh[0]
  c = dict(compiled) if compiled is not None else compile_stage(st)
  ex = {"fwd": _analysis(c["fwd"]), "bwd": _analysis(c["bwd"])}

  def held(aval, spec):
    return _device_bytes(aval, NamedSharding(mesh, spec))

  # The state, as held and as it would be without ZeRO.
  params = sum(held(sl.avals[v], sl.specs[v]) for v in sl.param_ids)
  params0 = sum(held(sl.avals[v], sharding_lib.without_dp(sl.specs[v])) for v in sl.param_ids)
  shared0 = sum(held(sl.avals[v], sharding_lib.without_dp(sl.specs[v])) for v in sl.param_ids
                if lay.param_owner[lay.param_vids.index(v)] != stage)
  grads = sum(held(sl.avals[v], sl.acc_spec(v)) for v in sl.param_ids)
  grads0 = sum(held(sl.avals[v], sharding_lib.without_dp(sl.acc_spec(v))) for v in sl.param_ids)
  _, state = state_successors(traced)
  pref = lambda v: lay.preferred.get((stage, v), P())
  opt_vids = [v for v in state if (stage, v) in lay.preferred and home]
  opt = sum(held(outer.avals[v], pref(v)) for v in opt_vids)
  opt0 = sum(held(outer.avals[v], sharding_lib.without_dp(pref(v))) for v in opt_vids)
  on_host = sum(held(outer.avals[v], pref(v)) for v in opt_vids if (stage, v) in lay.host)
  # One microbatch's outputs and residuals as the forward returns them: in the shardings XLA
  # chose for its results (a tensor-parallel stage may return its outputs split, which the
  # runtime then sends on, and keeps its residuals whole).
  outs, residual = _fwd_results(c["fwd"], len(sl.output_ids))
  n = in_flight(cs.schedule, stage)
  n_dev = min(n, 2) if stage in lay.host_residuals else n   # residuals held on the devices
  extra_in = sum(held(sl.avals[v], sl.specs[v]) for v in sl.act_ids + sl.act_int_ids
                 + sl.data_ids)
  cts = sum(held(sl.avals[v], sl.specs[v])
            for v, has in zip(sl.output_ids, sl.ct_present) if has)

  phases = {}
  state_bytes = params + grads + opt - on_host   # on the devices through the pipeline
  _, f_out, _, f_temp = ex["fwd"]
  phases["fwd"] = state_bytes + (n_dev - 1) * residual + extra_in + f_out + f_temp
  _, b_out, b_alias, b_temp = ex["bwd"]
  phases["bwd"] = state_bytes + n_dev * residual + cts + (b_out - b_alias) + b_temp
  if "reduce" in c:   # the replicas' gradients summed once, after the last backward
    ex["reduce"] = _analysis(c["reduce"])
    _, r_out, r_alias, r_temp = ex["reduce"]
    phases["reduce"] = state_bytes + r_out - r_alias + r_temp

  # The update: the step's state on this stage and its gradients, then each group's results.
  alive = {}
  for (s, v), spec in lay.preferred.items():
    if s == stage and (v in outer.invars or lay.home.get(v) == stage and v in
                       lay.region_results):
      alive[v] = held(outer.avals[v], spec)
  after = [gi for gi in range(lay.num_before, len(lay.groups))
           if lay.groups[gi].home == stage and home]
  for k, gi in enumerate(after):
    g = lay.groups[gi]
    name = f"update{k}"
    ex[name] = _analysis(compile_group(lay, gi, cs.group_fns[gi], mesh))
    for v in g.in_ids:
      alive.setdefault(v, held(outer.avals[v], pref(v)))
    _, g_out, g_alias, g_temp = ex[name]
    phases[name] = sum(alive.values()) + g_out - g_alias + g_temp
    for v in g.out_ids:
      alive[v] = held(outer.avals[v], pref(v))

  predicted = stage_memory(param_bytes=params0, grad_bytes=grads0, opt_bytes=opt0,
                           act_bytes=residual, dp=dp, zero=sl.zero, out_bytes=outs,
                           reduce_scatter=reduce_scatter, shared_param_bytes=shared0,
                           offload_optimizer=on_host > 0,
                           offload_activations=stage in lay.host_residuals, updates=home,
                           replicas=sl.replicas)
  return StageMemoryReport(stage, sl.zero, dp, n, params, grads, opt, residual, ex, phases,
                           max(phases.values()), predicted)

