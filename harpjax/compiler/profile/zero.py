"""ZeRO inside a stage's data-parallel axis: what each level costs in memory and collectives.

At level 0 every device of a stage holds all of the stage's parameters, their gradient
accumulator and the optimizer state (tensor parallelism aside: ``1/tp`` of what it splits).
ZeRO-1 splits the optimizer state over the stage's ``dp`` devices, ZeRO-2 the gradient
accumulator too, ZeRO-3 the parameters too (:attr:`harpjax.compiler.plan.StageSpec.zero`; the
runtime does it with shardings, :mod:`harpjax.compiler.stages`). This module is the planner's
side: plain numbers in, bytes and seconds out, no devices.

**Memory** (:func:`stage_memory`, per device; ``P``, ``G``, ``O`` the parameter, gradient and
optimizer-state bytes a device holds at level 0, ``R`` one microbatch's residuals, ``N`` the
microbatches in flight). The runtime holds the state, the accumulator and the residuals of
the microbatches in flight while the pipeline runs, and the optimizer update writes its
results beside its arguments (the caller's state is not overwritten), so a stage's peak is the
larger of

* pipeline: ``P_z + G_z + O_z + N R + max(W_fwd, W_bwd)``
* update: ``P_z + G_z + O_z + (P_z + O_z) + W_upd``

(parameters the stage reads but another stage owns, a tied embedding, count in the pipeline's
``P_z`` and ``G_z`` only: their owner updates them).

with ``O_z = O / dp`` from level 1, ``G_z = G / dp`` from level 2, ``P_z = P / dp`` at level
3, and workspaces: the forward writes its outputs (``out_bytes``) and, at level 3, the
gathered parameters ``P``; the backward writes the gradient ``G`` and then its data-parallel
reduction (``G`` for an all-reduce; ``G / dp`` when the backend turns the reduction and the
split into a reduce-scatter, XLA:GPU; XLA:CPU all-reduces and slices, and sometimes reuses a
part of the gradient's buffer, so the model can exceed its peak by ``G / dp``), or before it,
at level 3, the gathered parameters, dead by the time the gradient is reduced: ``G +
max(reduction, gathered)``; the update at levels 1 and 2 writes each device's updated part
before gathering it (``P / dp``). ``workspace_bytes`` (the layers' own temporaries, from the
cost tables) adds to the forward's and the backward's.

**Collectives** (:func:`zero_collectives`, :func:`zero_sync_time_s`; ring model of
:mod:`~harpjax.compiler.profile.collectives` on the link between the ``dp`` replicas). Levels
0 and 1 all-reduce the gradient once per step, after the last backward (the replicas
accumulate their own, :mod:`harpjax.compiler.stages.replicas`); per microbatch, level 2
reduce-scatters it; level 3 also all-gathers the parameters in the forward and again in the
backward. Per step, levels 1 and 2 all-gather the updated parameters. Byte counts are per device (results, as
:func:`~harpjax.compiler.profile.pieces.parse_collectives` reports XLA's).

**Host offload** (``opt_offloaded``, :func:`offload_time_s`): a stage that keeps its optimizer
state in host memory between updates (:class:`harpjax.OffloadOptions`) holds none of it
during the pipeline; the update brings it to the device and writes the new state back (so the
update's peak is unchanged), ``2 O_z`` bytes over the host link per step, after the pipeline
(the simulator's end cost).

**In the planner.** Cost tables that carry the optimizer state's bytes per entry
(:attr:`~harpjax.compiler.profile.CostTables.opt_mem_bytes`, with the weights' all-gather time
:attr:`~harpjax.compiler.profile.CostTables.gather_time_s` and the host link
:attr:`~harpjax.compiler.profile.CostTables.offload_bandwidth_bytes_per_s`;
``CostTables.from_layer_costs(..., optimizer_share=0.75)`` and the profiler with
``ProfileOptions(optimizer_bytes_per_param=12.0)`` fill them) let the planner choose
the level and the offload of every stage: :mod:`harpjax.compiler.plan.variants` makes each
(submesh, level, offload) a choice of the DP, with this module's state bytes
(:func:`zero_state_bytes_per_param`), level 3's two all-gathers per microbatch in the stage
time, levels 1 and 2's all-gather and the offload transfer (:func:`offload_time_s`) in the
stage's end time, which the simulator adds after the stage's last backward, so the plan's
predicted time stays the simulated one. The planner's memory check is the tables' (state and
in-flight activations, no workspaces), and an offloaded stage must still fit its whole state
for the update. The chosen level and offload are the plan's
:attr:`~harpjax.compiler.plan.StageSpec.zero` and :attr:`~harpjax.compiler.plan.StageSpec.offload`.

:func:`zero_tables` rebuilds a profile's :class:`~harpjax.compiler.profile.CostTables` with
every entry's memory and data-parallel time at one level (:func:`zero_layer_costs` per
configuration), to compare levels by hand.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.profile.collectives import collective_time_s, round_trip_time_s
from harpjax.compiler.profile.memory import (check_level, StageMemory,  # noqa: F401
                                            stage_memory, ZERO_LEVELS)
from harpjax.compiler.profile.profiler import (dp_link, MeshConfig, ordered_subclusters,
                                               tables_from_layer_costs)
from harpjax.errors import HarpjaxError

__all__ = ["ZERO_LEVELS", "StageMemory", "stage_memory", "offload_time_s",
           "activation_offload_time_s", "zero_collectives", "zero_sync_time_s",
           "zero_state_bytes_per_param", "zero_stage_times", "sync_per_microbatch",
           "replica_grad_bytes", "param_fetch_time_s", "zero_layer_costs", "zero_tables"]


def offload_time_s(opt_bytes, host_bandwidth_bytes_per_s: float, latency_s: float = 0.0):
  """Seconds per step of a stage's optimizer state kept in host memory: brought to the device
  for the update and written back, ``2 * (latency + opt_bytes / bandwidth)``
  (:func:`~harpjax.compiler.profile.collectives.round_trip_time_s`); ``0`` where there is
  nothing to move.

  Args:
    opt_bytes: optimizer-state bytes one device holds (after ZeRO's split): a number, or an
      array (then so is the result).
    host_bandwidth_bytes_per_s: the device's link to host memory, one direction (PCIe 4.0
      x16: ~25e9 in practice).
    latency_s: per transfer.
  """
  if not host_bandwidth_bytes_per_s > 0:
    raise HarpjaxError(f"host_bandwidth_bytes_per_s={host_bandwidth_bytes_per_s} must be > 0")
  if np.ndim(opt_bytes):
    x = np.asarray(opt_bytes, np.float64)
    return np.where(x > 0, round_trip_time_s(x, host_bandwidth_bytes_per_s, latency_s), 0.0)
  if opt_bytes <= 0:
    return 0.0
  return round_trip_time_s(float(opt_bytes), host_bandwidth_bytes_per_s, latency_s)


def param_fetch_time_s(param_bytes, host_bandwidth_bytes_per_s: float, latency_s: float = 0.0):
  """Seconds to bring a stage's parameters from host memory to its devices once (Zorse's
  parameter offload: a stage of an interleaved device group fetched before its tasks),
  ``latency + param_bytes / bandwidth``, one direction (the device copy is dropped, not
  written back: parameters do not change during a step); ``0`` where there is nothing to move.
  Per step, the update also reads the parameters in and writes the new ones back:
  :func:`offload_time_s` of the parameter bytes.

  Args:
    param_bytes: parameter bytes one device holds (after ZeRO-3's split): a number, or an
      array (then so is the result).
    host_bandwidth_bytes_per_s: the device's link to host memory, one direction.
    latency_s: per transfer.
  """
  if not host_bandwidth_bytes_per_s > 0:
    raise HarpjaxError(f"host_bandwidth_bytes_per_s={host_bandwidth_bytes_per_s} must be > 0")
  x = np.asarray(param_bytes, np.float64)
  out = np.where(x > 0, latency_s + x / host_bandwidth_bytes_per_s, 0.0)
  return out if np.ndim(param_bytes) else float(out)


def activation_offload_time_s(act_bytes, host_bandwidth_bytes_per_s: float,
                              latency_s: float = 0.0):
  """Seconds per microbatch of a stage whose residuals wait for their backward in host memory:
  written there after the forward and read back before the backward, ``2 * (latency +
  act_bytes / bandwidth)`` (an upper bound on what it adds to the stage's time: the runtime
  issues the copies asynchronously, so they overlap with other tasks where the schedule
  leaves room).

  Args:
    act_bytes: residual bytes of one microbatch per device (a number or an array).
    host_bandwidth_bytes_per_s: the device's link to host memory, one direction.
    latency_s: per transfer.
  """
  return offload_time_s(act_bytes, host_bandwidth_bytes_per_s, latency_s)   # the same trips


def zero_state_bytes_per_param(weight_bytes: float, grad_bytes: float, optimizer_bytes: float,
                               dp: int, zero: int) -> float:
  """Bytes per parameter a device holds for parameters, gradients and optimizer state.

  E.g. mixed-precision Adam (2 + 2 + 12 bytes): 16 at level 0, ``4 + 12 / dp`` at level 1,
  ``2 + 14 / dp`` at level 2, ``16 / dp`` at level 3 (the split of
  :func:`~harpjax.compiler.profile.stage_memory`, its :attr:`StageMemory.state_bytes`).
  """
  return stage_memory(param_bytes=weight_bytes, grad_bytes=grad_bytes,
                      opt_bytes=optimizer_bytes, act_bytes=0.0, dp=dp, zero=zero).state_bytes


def zero_stage_times(time_s, end_s, gather_s, sync_s, zero: int):
  """A stage's seconds per microbatch and at the end of the iteration at ZeRO level ``zero``,
  from level 0's, with its collectives (:func:`zero_collectives`) priced by the tables' two:
  ``gather_s``, one all-gather of its weights among its ``dp`` replicas, and ``sync_s``, the
  gradient all-reduce its end time holds (``None``: the time per microbatch already reduces
  the gradient; the tables' :attr:`~harpjax.compiler.profile.CostTables.sync_time_s`).

  Level 3 gathers the weights in the forward and again in the backward (``+ 2 gather_s`` per
  microbatch); levels 1 and 2 gather the updated weights once (``+ gather_s`` at the end);
  from level 2 the gradient is reduce-scattered after every backward (``+ gather_s`` per
  microbatch: the same bytes on the same link) and nothing is left to all-reduce at the end
  (``- sync_s``).

  Args:
    time_s, end_s: level 0's seconds per microbatch and at the end (numbers or arrays).
    gather_s: seconds of one all-gather of the weights.
    sync_s: seconds of the gradient all-reduce within ``end_s``, or ``None``.
    zero: the level.

  Returns:
    ``(time_s, end_s)`` at the level.
  """
  check_level(zero, 1)
  t = time_s + 2.0 * gather_s if zero >= 3 else time_s
  e = end_s + gather_s if zero in (1, 2) else end_s
  if zero >= 2 and sync_s is not None:   # reduce-scattered every microbatch, not all-reduced
    t = t + gather_s
    e = np.maximum(e - sync_s, 0.0)
  return t, e


def sync_per_microbatch(time_s, end_s, sync_s):
  """``(time_s, end_s)`` of a stage that reduces its gradient after every backward instead of
  once per iteration (a mixed-type stage's groups): the all-reduce ``sync_s`` moves from the
  end into the time per microbatch (numbers or arrays)."""
  end = np.maximum(end_s - sync_s, 0.0)
  return time_s + sync_s, (float(end) if np.ndim(end) == 0 else end)


def replica_grad_bytes(state_bytes, tp, grad_fraction: float):
  """One model replica's gradient bytes from the state bytes one device of it holds at level 0
  (parameters, gradients and optimizer state, split ``tp`` ways): ``grad_fraction * state *
  tp`` (``0.25`` for weights, gradient and two Adam moments of one size; numbers or
  arrays)."""
  return grad_fraction * state_bytes * tp


def zero_collectives(param_bytes: float, dp: int, zero: int, grad_bytes: float | None = None
                     ) -> tuple[dict, dict]:
  """The data-parallel collectives of a stage at ZeRO level ``zero``.

  Args:
    param_bytes: parameter bytes per device at level 0 (what an all-gather rebuilds).
    dp: data-parallel degree.
    zero: the level.
    grad_bytes: gradient bytes per device at level 0 (default ``param_bytes``).

  Returns:
    ``(per_microbatch, per_step)``, each ``{kind: [result bytes per device, count]}`` as
    :func:`~harpjax.compiler.profile.collectives.collective_time_s` reads them.
  """
  check_level(zero, dp)
  P = float(param_bytes)
  G = P if grad_bytes is None else float(grad_bytes)
  if dp <= 1:
    return {}, {}
  per_mb: dict = {}
  per_step: dict = {}
  if zero <= 1:
    per_step["all-reduce"] = [G, 1]
  else:
    per_mb["reduce-scatter"] = [G / dp, 1]
  if zero >= 3:
    per_mb["all-gather"] = [2 * P, 2]        # forward and backward
  elif zero >= 1:
    per_step["all-gather"] = [P, 1]          # the updated parameters
  return per_mb, per_step


def zero_sync_time_s(param_bytes: float, dp: int, zero: int, link: Link, num_microbatches: int,
                     grad_bytes: float | None = None) -> float:
  """Seconds of a stage's data-parallel collectives per microbatch at ZeRO level ``zero``
  (the per-step ones shared over the ``num_microbatches``), on ``link``.

  Level 0 gives :func:`~harpjax.compiler.profile.collectives.allreduce_time_s` of the
  gradients over ``num_microbatches`` (one all-reduce per step).
  """
  per_mb, per_step = zero_collectives(param_bytes, dp, zero, grad_bytes)
  return (collective_time_s(per_mb, dp, link)
          + collective_time_s(per_step, dp, link) / max(int(num_microbatches), 1))


# --------------------------------------------------------------------------- tables


def zero_layer_costs(costs: dict, dp: int, zero: int, link: Link, *, num_microbatches: int,
                     state_bytes_per_param: float = 16.0, optimizer_bytes_per_param: float = 12.0,
                     grad_bytes_per_param: float | None = None) -> dict:
  """One configuration's per-layer costs at ZeRO level ``zero``.

  Args:
    costs: ``{field: [L] array}`` of one (subcluster, submesh, logical mesh), as in
      :attr:`~harpjax.compiler.profile.ProfileResult.costs` (at level 0).
    dp: the configuration's data-parallel degree.
    zero: the level.
    link: the link between its ``dp`` replicas.
    num_microbatches: ``B`` (per-step collectives are shared over it).
    state_bytes_per_param: the profile's ``ProfileOptions.state_bytes_per_param``.
    optimizer_bytes_per_param: the optimizer state's part of it (12 of 16 for mixed-precision
      Adam; 8 of 16 for float32 Adam); weights and gradients share the rest equally.
    grad_bytes_per_param: bytes of one gradient element on the wire (default the gradients'
      share of the state).

  Returns:
    New arrays: ``param_mem_bytes`` per :func:`zero_state_bytes_per_param`, ``temp_bytes``
    plus the layer's gathered weights at level 3, ``time_s`` and ``comm_s`` with the level's
    collectives (:func:`zero_collectives`; those once per step shared over the microbatches)
    but the once-per-step all-reduce of levels 0 and 1, which the tables charge at the end of
    the iteration from ``grad_bytes`` (``0`` from level 2: the gradient is reduce-scattered
    every microbatch instead).
  """
  check_level(zero, dp)
  if not 0 <= optimizer_bytes_per_param <= state_bytes_per_param:
    raise HarpjaxError(f"optimizer_bytes_per_param={optimizer_bytes_per_param} must be in "
                       f"[0, state_bytes_per_param={state_bytes_per_param}]")
  out = {f: np.array(a, dtype=np.float64) for f, a in costs.items()}
  if not zero or dp <= 1:
    return out
  w = g = (state_bytes_per_param - optimizer_bytes_per_param) / 2
  wire = g if grad_bytes_per_param is None else grad_bytes_per_param
  n_local = out["param_mem_bytes"] / state_bytes_per_param
  out["param_mem_bytes"] = n_local * zero_state_bytes_per_param(
      w, g, optimizer_bytes_per_param, dp, zero)
  if zero >= 3:
    out["temp_bytes"] = out["temp_bytes"] + n_local * w
  B = max(int(num_microbatches), 1)

  def added(x):
    per_mb, per_step = zero_collectives(x * wire, dp, zero)
    per_step.pop("all-reduce", None)
    return collective_time_s(per_mb, dp, link) + collective_time_s(per_step, dp, link) / B
  after = np.array([added(x) for x in n_local])
  ok = np.isfinite(out["time_s"])
  out["time_s"] = np.where(ok, out["time_s"] + after, out["time_s"])
  out["comm_s"] = np.where(ok, out["comm_s"] + after, out["comm_s"])
  if zero >= 2 and "grad_bytes" in out:
    out["grad_bytes"] = np.zeros_like(out["grad_bytes"])
  return out


def zero_tables(result, cluster, zero: int, *, num_microbatches: int,
                state_bytes_per_param: float = 16.0, optimizer_bytes_per_param: float = 12.0,
                grad_bytes_per_param: float | None = None, imbalance: float = 4.0,
                order=None):
  """A profile's cost tables with every entry at ZeRO level ``zero``
  (:func:`zero_layer_costs` of every configuration, on the link between its replicas: inside
  a host for a one-host submesh, else the subcluster's). Level 0 gives the profile's own
  tables.

  Args:
    result: a :class:`~harpjax.compiler.profile.ProfileResult` (its per-layer ``costs``).
    cluster: the cluster it was profiled on.
    zero: the level for every entry.
    num_microbatches, state_bytes_per_param, optimizer_bytes_per_param, grad_bytes_per_param:
      as in :func:`zero_layer_costs`.
    imbalance, order: as in :class:`~harpjax.compiler.profile.ProfileOptions`.

  Returns:
    The :class:`~harpjax.compiler.profile.CostTables`.
  """
  check_level(zero, 1)
  subs = ordered_subclusters(cluster, order)
  names = [s.name for s in subs]
  configs, costs = [], []
  for (name, submesh, mesh), arr in result.costs.items():
    k = names.index(name)
    sub = subs[k]
    s = list(sub.submesh_shapes()).index(tuple(submesh))
    costs.append(zero_layer_costs(
        arr, mesh[0], zero, dp_link(cluster, sub, submesh), num_microbatches=num_microbatches,
        state_bytes_per_param=state_bytes_per_param,
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        grad_bytes_per_param=grad_bytes_per_param))
    configs.append(MeshConfig(k, s, tuple(submesh), tuple(mesh)))
  split = (state_bytes_per_param, optimizer_bytes_per_param) if zero == 0 else None
  tables, _ = tables_from_layer_costs(result.layers, cluster, subs, configs, costs, imbalance,
                                      split, num_microbatches=num_microbatches,
                                      replica_programs=result.replica_programs)
  return tables
