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
from harpjax.compiler.plan import zebra_group_bytes
from harpjax.compiler.profile import StageMemory, stage_memory
from harpjax.compiler.stages.aot import compile_group, compile_stage
from harpjax.compiler.stages.compile import CompiledStep, state_successors
from harpjax.compiler.stages.split import RemoteGroup
from harpjax.compiler.stages.zebra import ZebraStageExecutables
from harpjax.compiler.trace import aval_nbytes
from harpjax.errors import UnsupportedError

__all__ = ["StageMemoryReport", "ZebraGroupMemory", "ZebraMemoryReport", "memory_report",
           "in_flight"]


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
                  reduce_scatter: bool = False, group: int = 0
                  ) -> StageMemoryReport | ZebraMemoryReport:
  """Stage ``stage``'s per-device memory over a step, from XLA and from the model (a zebra
  stage: each of its two groups', :func:`zebra_memory_report`).

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
    return zebra_memory_report(cs, stage)
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



# --------------------------------------------------------------------------- zebra stages


@dataclasses.dataclass(frozen=True)
class ZebraGroupMemory:
  """One group of a zebra stage: what one of its devices holds over a step (bytes).

  Attributes:
    side: ``"attention"`` or ``"experts"``.
    param_bytes: the parameters it holds (the attention group: the stage's but the expert
      weights, plus the step's copies of the experts moved onto it; the expert group: the
      expert weights, whole, plus the step's slices of the kept experts where some moved).
    grad_bytes: its parts' gradient accumulators.
    opt_bytes: the optimizer state its placement groups update.
    act_bytes: one pipeline microbatch's residuals: its ``R`` zebra microbatches' in every
      part the group runs (XLA's forwards).
    phases: ``"fwd A0"``, ``"bwd E1"``..., ``"update0"``... -> peak bytes while it runs.
    xla_peak_bytes: the largest of ``phases``.
    predicted_peak_bytes: the memory model
      (:func:`~harpjax.compiler.plan.zebra_stages.zebra_group_bytes`, the planner's) of the
      state and activation bytes above (the update's new values: the parameters and the
      optimizer state it holds).
  """
  side: str
  param_bytes: float
  grad_bytes: float
  opt_bytes: float
  act_bytes: float
  phases: dict
  xla_peak_bytes: float
  predicted_peak_bytes: float

  @property
  def state_bytes(self) -> float:
    return self.param_bytes + self.grad_bytes + self.opt_bytes

  @property
  def error(self) -> float:
    """``predicted / xla - 1``."""
    return self.predicted_peak_bytes / self.xla_peak_bytes - 1.0


@dataclasses.dataclass(frozen=True)
class ZebraMemoryReport:
  """A zebra stage's memory per device of each group, from XLA and from the model.

  Attributes:
    stage: the stage.
    in_flight: pipeline microbatches whose residuals it holds at once (``N``).
    num_microbatches: ``R``, zebra microbatches per pipeline microbatch.
    executables: ``"fwd A0"``, ``"bwd E0"``, ``"update0 experts"``... -> ``(argument,
      output, alias, temp)`` bytes of XLA's ``memory_analysis()``.
    attention, experts: each group's :class:`ZebraGroupMemory`.
  """
  stage: int
  in_flight: int
  num_microbatches: int
  executables: dict
  attention: ZebraGroupMemory
  experts: ZebraGroupMemory


def zebra_memory_report(cs: CompiledStep, stage: int) -> ZebraMemoryReport:
  """Zebra stage ``stage``'s memory per device of each group over a step, from the programs
  the runtime compiles (each part's forward and backward, the placement groups that update
  the state each group holds) and XLA's ``memory_analysis()`` of them.

  Each group, one of its devices: its state (parameters, gradient accumulators, optimizer
  state, :class:`ZebraGroupMemory`) and the residuals of the ``N`` pipeline microbatches in
  flight (the stage's row of the task table), each ``R`` zebra microbatches through every
  part the group runs; during a part's forward of the ``N``-th microbatch, that with the
  part's own residuals replaced by its outputs and temporaries (XLA); during a part's
  backward, the state with ``N`` microbatches' residuals plus its new outputs (not aliased to
  the donated accumulator) and temporaries; during an update, the state plus the group's
  outputs and temporaries. The model beside it is the planner's,
  :func:`~harpjax.compiler.plan.zebra_stages.zebra_group_bytes` of the state and activation
  bytes: temporaries are what it leaves out.
  """
  lay, st = cs.layout, cs.stages[stage]
  z = st.zebra
  R = z.num_microbatches
  n = in_flight(cs.schedule, stage)
  held = set(z.expert_params)
  ex: dict = {}
  per_side = {0: dict(params=0.0, grads=0.0, opt=0.0, act=0.0, parts=[]),
              1: dict(params=0.0, grads=0.0, opt=0.0, act=0.0, parts=[])}
  for v in st.layout.param_ids:
    side = 1 if v in held else 0
    per_side[side]["params"] += _device_bytes(st.layout.avals[v], st.sharding(v))
  for part, pex in zip(z.parts, st.parts):
    side = 1 if part.kind == "E" else 0
    acc = per_side[side]
    name = f"{part.kind}{part.layer}"
    if part.experts is not None:   # the step's slices of the expert weights
      acc["params"] += sum(_device_bytes(pex.layout.avals[v], pex.sharding(v))
                           for v in pex.layout.param_ids)
    acc["grads"] += sum(_device_bytes(pex.layout.avals[v], pex.acc_sharding(v))
                        for v in pex.layout.param_ids)
    c = compile_stage(pex)
    ex[f"fwd {name}"], ex[f"bwd {name}"] = _analysis(c["fwd"]), _analysis(c["bwd"])
    _, residual = _fwd_results(c["fwd"], len(pex.layout.output_ids))
    acc["act"] += R * residual
    acc["parts"].append((name, residual))
  outer = cs.traced.outer
  _, state = state_successors(cs.traced)
  groups = [gi for gi in range(lay.num_before, len(lay.groups)) if lay.groups[gi].home == stage]
  for v in state:
    for gi in groups:
      g = lay.groups[gi]
      if v in g.in_ids and (stage, v) in lay.preferred:
        mesh = st.group_mesh(g.side)
        per_side[g.side]["opt"] += _device_bytes(outer.avals[v],
                                                 NamedSharding(mesh, lay.preferred[(stage, v)]))
        break
  sides = []
  for side, label in ((0, "attention"), (1, "experts")):
    acc = per_side[side]
    state_bytes = acc["params"] + acc["grads"] + acc["opt"]
    phases = {}
    for name, residual in acc["parts"]:
      _, f_out, _, f_temp = ex[f"fwd {name}"]
      phases[f"fwd {name}"] = state_bytes + n * acc["act"] - residual + f_out + f_temp
      _, b_out, b_alias, b_temp = ex[f"bwd {name}"]
      phases[f"bwd {name}"] = state_bytes + n * acc["act"] + b_out - b_alias + b_temp
    k = 0
    for gi in groups:
      g = lay.groups[gi]
      if g.side != side:
        continue
      key = f"update{k} {label}"
      ex[key] = _analysis(compile_group(lay, gi, cs.group_fns[gi], st.group_mesh(side)))
      _, g_out, g_alias, g_temp = ex[key]
      phases[key] = state_bytes + g_out - g_alias + g_temp
      k += 1
    sides.append(ZebraGroupMemory(label, acc["params"], acc["grads"], acc["opt"], acc["act"],
                                  phases, max(phases.values()),
                                  zebra_group_bytes(state_bytes, acc["act"], n,
                                                    acc["params"] + acc["opt"])))
  return ZebraMemoryReport(stage, n, R, ex, sides[0], sides[1])
