"""The one schedule interpreter: a stage's part of the pipelined region, whoever runs it.

Both runtimes run the region through :class:`StageRun`, one per stage; they differ only in the
:class:`Messenger` that moves values between stages: the local runtime's keeps every message
in this process (:class:`LocalMessenger`) and runs the stages' tasks in a dependency-valid
order (:meth:`harpjax.compiler.schedule.Schedule.run_order`); a Ray worker's sends them over the network
and runs its own stage's row of the task table. A stage's part of one step:

1. :meth:`StageRun.forward` for each ``F`` task: receive the microbatch's activations from the
   producing stages, run the forward executable, send the outputs to the consuming stages;
2. :meth:`StageRun.backward` for each ``B`` task: receive the cotangents of its outputs (summed
   in decreasing consumer order, the loss seeded with ``1/B`` or ``1``), run the backward
   executable, send the activations' cotangents back;
3. :meth:`StageRun.combine`: the loss and auxiliary outputs it computes, over microbatches;
4. :meth:`StageRun.send_gradient_parts` and :meth:`StageRun.reduce`: the gradient parts of
   parameters other stages own go to their owner, which sums them in increasing stage order.

Routes and shapes come from the :class:`~harpjax.compiler.stages.StepLayout`; messages are
keyed by :class:`MessageKey`. The order of every sum is fixed by the layout, so both runtimes
compute the same numbers bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.schedule import chunk_residency
from harpjax.compiler.stages import HOST_MEMORY, StageExecutables, StepLayout, put, row_slice
from harpjax.compiler.trace import Lit
from harpjax.runtime.rows import move_rows

__all__ = ["MessageKey", "ACT", "CT", "GRAD", "VALUE", "Messenger", "LocalMessenger", "StageRun",
           "GroupParams", "put", "place_on_mesh", "microbatch_slice", "combine_microbatches"]

ACT, CT, GRAD, VALUE = "act", "ct", "grad", "value"


class MessageKey(NamedTuple):
  """What a message between two stages carries.

  Attributes:
    kind: :data:`ACT` (activations), :data:`CT` (cotangents), :data:`GRAD` (a parameter's
      gradient part) or :data:`VALUE` (an outer value: a step argument, a placement group's
      result, a region output).
    index: the microbatch (activations, cotangents), the parameter (gradients) or the outer
      value id (values).
    src: the sending stage (``-1`` for values: each has one home).
  """
  kind: str
  index: int
  src: int = -1

  @property
  def kind_key(self) -> tuple:
    """The key without the microbatch: messages with equal ``kind_key`` have equal
    structure (a group broadcasts it once)."""
    return (self.kind, self.src) if self.kind in (ACT, CT) else tuple(self)


# --------------------------------------------------------------------------- values


def place_on_mesh(x, mesh, preferred: NamedSharding | None = None):
  """``x`` on ``mesh``: kept as is when already on exactly its devices (in the ``preferred``
  memory, if any), else put in the ``preferred`` sharding (replicated when there is none)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    if x.sharding.device_set == set(mesh.devices.flat) and (
        preferred is None or x.sharding.memory_kind == preferred.memory_kind):
      return x
  return jax.device_put(x, preferred if preferred is not None else NamedSharding(mesh, P()))


def microbatch_slice(x, axis: int, m: int, num_microbatches: int):
  """Microbatch ``m`` of ``x``: its ``m``-th of ``num_microbatches`` equal parts along ``axis``."""
  return row_slice(x, axis, m, 1, num_microbatches)


@jax.jit
def _mean(xs):
  return jnp.mean(jnp.stack(xs), axis=0).astype(xs[0].dtype)


@jax.jit
def _sum(xs):
  return jnp.sum(jnp.stack(xs), axis=0).astype(xs[0].dtype)


def combine_microbatches(per_mb: list, rule):
  """One region output from its per-microbatch values, by its rule
  (:func:`harpjax.compiler.trace.combine_rules`): concatenated along an axis (``("concat",
  axis)``: per-example values), averaged (``"mean"``: each microbatch's value is in
  mean-exact form), summed (``"sum"``) or the first (``"first"``: the same in every
  microbatch)."""
  if isinstance(rule, tuple):
    return jnp.concatenate(per_mb, axis=rule[1])
  if rule == "first":
    return per_mb[0]
  dev = per_mb[0]
  if isinstance(dev, jax.Array):
    per_mb = [put(x, dev.sharding) if isinstance(x, jax.Array) else x for x in per_mb]
  xs = tuple(per_mb)
  if rule == "mean" and jnp.issubdtype(jnp.result_type(xs[0]), jnp.inexact):
    return _mean(xs)
  return _sum(xs)


# --------------------------------------------------------------------------- messages


class Messenger(Protocol):
  """How one stage exchanges messages with the others (the runtime provides it).

  A send is two calls, so that a stage spanning several processes can make its collective
  first: :meth:`gather` (the payload in one place; ``None`` on the members that do not send;
  given the destination and the message kind, a runtime that sends a cut per host pair keeps
  each member's rows where they are) and :meth:`post`. A received activation or cotangent goes onto the stage's sharding with
  :meth:`take` (the consumer's side of a cut), any other value with :meth:`put`. Task hooks let a runtime time (and emulate) each task.
  """

  def gather(self, payload: dict, dst: int | None = None, kind: str | None = None
             ) -> dict | None: ...

  def post(self, dst: int, key: MessageKey, payload: dict | None) -> None: ...

  def recv(self, key: MessageKey, what: str) -> dict: ...

  def put(self, x, sharding: NamedSharding): ...

  def take(self, x, sharding: NamedSharding): ...

  def begin_task(self) -> None: ...

  def task_started(self) -> float: ...

  def task_finished(self, kind: str, microbatch: int, start: float, outputs) -> None: ...


class LocalMessenger:
  """Messages between stages of one process: one in-memory inbox per stage.

  A message carries the producer's arrays as they are; the consumer's :meth:`take` moves an
  activation or cotangent split by rows on both sides per replica pair, device to device
  (:func:`harpjax.runtime.rows.move_rows`: each producer replica's rows to the consumer
  replicas they overlap, no gather through host memory).

  Args:
    stage: the stage this messenger serves.
    inboxes: per stage, ``{MessageKey: payload}`` (shared by the stages of the process).
  """

  def __init__(self, stage: int, inboxes: list[dict]):
    self.stage, self.inboxes = stage, inboxes

  def gather(self, payload: dict, dst: int | None = None, kind: str | None = None) -> dict:
    return payload

  def post(self, dst: int, key: MessageKey, payload: dict | None) -> None:
    self.inboxes[dst][key] = payload

  def recv(self, key: MessageKey, what: str) -> dict:
    try:
      return self.inboxes[self.stage].pop(key)
    except KeyError:
      raise AssertionError(f"stage {self.stage}: {what} ({key}) was not sent before it was "
                           "needed; the task order is not dependency-valid") from None

  def put(self, x, sharding: NamedSharding):
    return put(x, sharding)

  def take(self, x, sharding: NamedSharding):
    return move_rows(x, sharding)

  def begin_task(self) -> None:
    pass

  def task_started(self) -> float:
    return 0.0

  def task_finished(self, kind: str, microbatch: int, start: float, outputs) -> None:
    pass


# --------------------------------------------------------------------------- a stage


class StageRun:
  """Stage ``stage.layout.index``'s part of the region of one step (see the module docstring).

  Args:
    layout: the step's layout.
    stage: the stage's executables.
    io: its :class:`Messenger`.
    inputs: region value id -> value of the region inputs the stage reads (parameters, data,
      and inputs passed through to a region output it computes), as the step computed them.
  """

  def __init__(self, layout: StepLayout, stage: StageExecutables, io: Messenger,
               inputs: dict[int, Any]):
    self.layout, self.stage, self.io = layout, stage, io
    self.s = s = stage.layout.index
    sl = stage.layout
    self.B = layout.num_microbatches
    self.inputs = inputs
    self.params_on_host = s in layout.host_params
    if self.params_on_host:   # fetched before the stage's tasks (GroupParams), else on use
      self._host_params = tuple(io.put(inputs[v], stage.sharding(v).with_memory_kind(HOST_MEMORY))
                                for v in sl.param_ids)
      self._params = None
    else:
      self._params = tuple(io.put(inputs[v], stage.sharding(v)) for v in sl.param_ids)
    self._whole: dict[int, Any] = {}
    self.consumers = sorted(t for (p, t) in layout.act_routes if p == s)
    self.ct_from = sorted(t for (t, p) in layout.ct_routes if p == s)
    self.region_outs = {v for v in layout.region_outvars if not isinstance(v, Lit)}
    self.fwd_outputs: list[dict[int, Any]] = [dict() for _ in range(self.B)]
    self.residuals: dict[int, Any] = {}
    self.acc = stage.zeros()
    self.scale = 1.0 if layout.combine[0] == "sum" else 1.0 / self.B
    self.mb_index = [np.int32(m) for m in range(self.B)]
    self.to_host = s in layout.host_residuals
    self._total = None   # the gradient accumulator, summed over a split stage's groups

  # ------------------------------------------------------------------ parameters

  @property
  def params(self) -> tuple:
    """The stage's parameters on its devices (fetched from host memory now if the stage keeps
    them there and no prefetch brought them)."""
    if self._params is None:
      self.fetch_params()
    return self._params

  def fetch_params(self) -> None:
    """Starts bringing the parameters of a stage that keeps them in host memory to its
    devices (asynchronous: the copy overlaps the tasks dispatched before the stage's own)."""
    if self.params_on_host and self._params is None:
      self._params = tuple(self._to_device(x) for x in self._host_params)

  def release_params(self) -> None:
    """Drops the device copy of the parameters of a stage that keeps them in host memory (the
    host copy is unchanged: a step does not write parameters)."""
    if self.params_on_host:
      self._params = None

  # ------------------------------------------------------------------ tasks

  def data(self, m: int) -> tuple:
    """The region data of microbatch ``m`` the stage reads, on its submesh."""
    out = []
    for v in self.stage.layout.data_ids:
      kind, axis = self.layout.input_kinds[v]
      sh = self.stage.sharding(v)
      if kind == "split":
        out.append(self.io.put(microbatch_slice(self.inputs[v], axis, m, self.B), sh))
      else:
        if v not in self._whole:
          self._whole[v] = self.io.put(self.inputs[v], sh)
        out.append(self._whole[v])
    return tuple(out)

  def forward(self, m: int) -> None:
    """Task ``F m``: activations in, forward, outputs out."""
    lay, st, sl, io, s = self.layout, self.stage, self.stage.layout, self.io, self.s
    io.begin_task()
    acts: dict[int, Any] = {}
    for p in lay.act_sources[s]:
      acts.update(io.recv(MessageKey(ACT, m, p), f"the activations of microbatch {m}"))
    start = io.task_started()
    a = tuple(io.take(acts[v], st.sharding(v)) for v in sl.act_ids)
    ai = tuple(io.take(acts[v], st.sharding(v)) for v in sl.act_int_ids)
    outs, residuals = st.fwd(self.params, a, ai, self.data(m), self.mb_index[m])
    out_map = dict(zip(sl.output_ids, outs))
    msgs = [(t, io.gather({v: out_map[v] for v in lay.act_routes[(s, t)]}, t, ACT))
            for t in self.consumers]
    io.task_finished("F", m, start, outs)
    for t, payload in msgs:
      io.post(t, MessageKey(ACT, m, s), payload)
    for v in sl.output_ids:
      if v in self.region_outs:
        self.fwd_outputs[m][v] = out_map[v]
    if self.to_host:   # kept in host memory until the backward
      residuals = jax.tree_util.tree_map(self._to_host, residuals)
    self.residuals[m] = residuals

  @staticmethod
  def _to_host(x):
    return jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY))

  @staticmethod
  def _to_device(x):
    return jax.device_put(x, x.sharding.with_memory_kind("device"))

  def backward(self, m: int) -> None:
    """Task ``B m``: output cotangents in, backward, activation cotangents out."""
    lay, st, sl, io, s = self.layout, self.stage, self.stage.layout, self.io, self.s
    io.begin_task()
    msgs = {t: io.recv(MessageKey(CT, m, t), f"the cotangents of microbatch {m}")
            for t in self.ct_from}
    start = io.task_started()
    present = []
    for v, has in zip(sl.output_ids, sl.ct_present):
      if not has:
        continue
      ct = None
      for t in lay.ct_sources[s].get(v, ()):
        g = io.take(msgs[t][v], st.sharding(v))
        ct = g if ct is None else ct + g
      if v == lay.loss_vid:
        seed = io.put(np.asarray(self.scale, sl.avals[v].dtype), st.replicated)
        ct = seed if ct is None else ct + seed
      if ct is None:
        aval = sl.avals[v]
        ct = io.put(np.zeros(aval.shape, aval.dtype), st.sharding(v))
      present.append(ct)
    residuals = self.residuals.pop(m)
    if self.to_host:
      residuals = jax.tree_util.tree_map(self._to_device, residuals)
    self.acc, act_cts = st.bwd(self.params, residuals, tuple(present), self.acc)
    ct_map = dict(zip(sl.act_ids, act_cts))
    cts = [(p, io.gather({v: ct_map[v] for v in lay.ct_routes[(s, p)]}, p, CT))
           for p in lay.ct_targets[s]]
    io.task_finished("B", m, start, (self.acc, act_cts))
    for p, payload in cts:
      io.post(p, MessageKey(CT, m, s), payload)

  def task(self, task) -> None:
    """Runs one task of the table (``F m`` or ``B m``)."""
    (self.forward if task.kind == "F" else self.backward)(task.microbatch)

  def run(self, tasks) -> None:
    """Runs a row of the task table in order."""
    for task in tasks:
      self.task(task)

  # ------------------------------------------------------------------ after the pipeline

  def params_resident(self) -> bool:
    """Whether the stage's parameters are on its devices now."""
    return self._params is not None

  def _region_output(self, ref, m: int):
    if isinstance(ref, Lit):
      return jnp.asarray(ref.value)
    if ref in self.fwd_outputs[m]:
      return self.fwd_outputs[m][ref]
    kind, axis = self.layout.input_kinds[ref]
    x = self.inputs[ref]
    return microbatch_slice(x, axis, m, self.B) if kind == "split" else x

  def combine(self) -> dict[int, Any]:
    """The loss and auxiliary outputs this stage computes: outer value id -> value."""
    lay, out = self.layout, {}
    for k, ref in enumerate(lay.region_outvars):
      vid = lay.region_results[k]
      if lay.region_out_home[k] != self.s or vid < 0:
        continue
      per_mb = [self._region_output(ref, m) for m in range(self.B)]
      out[vid] = combine_microbatches(per_mb, lay.combine[k])
    return out

  def gradients(self) -> tuple:
    """The stage's gradient accumulator, per parameter it reads (a stage that splits its rows
    among groups sums theirs here, once)."""
    if self._total is None:
      self._total = self.stage.total(self.acc)
      if self.stage.layout.replicas:
        self.acc = None   # the replicas' parts, summed: not kept through the update
    return self._total

  def send_gradient_parts(self) -> None:
    """Sends the gradients of the parameters other stages own to their owners."""
    lay, s = self.layout, self.s
    mine = {v: i for i, v in enumerate(self.stage.layout.param_ids)}
    n_fwd = len(lay.region_outvars)
    acc = self.gradients()
    for j in range(lay.num_params):
      owner = lay.param_owner[j]
      if lay.region_results[n_fwd + j] >= 0 and owner != s and s in lay.grad_users[j]:
        payload = self.io.gather({j: acc[mine[lay.param_vids[j]]]})
        self.io.post(owner, MessageKey(GRAD, j, s), payload)

  def reduce(self) -> dict[int, Any]:
    """The gradients of the parameters this stage owns, every reader's part summed in stage
    order: outer value id -> value."""
    lay, st, s, io = self.layout, self.stage, self.s, self.io
    mine = {v: i for i, v in enumerate(st.layout.param_ids)}
    n_fwd = len(lay.region_outvars)
    acc = self.gradients()
    out = {}
    for j in range(lay.num_params):
      out_vid = lay.region_results[n_fwd + j]
      if lay.param_owner[j] != s or out_vid < 0:
        continue
      vid = lay.param_vids[j]
      total = None
      for u in lay.param_users[j]:
        g = (acc[mine[vid]] if u == s else
             io.recv(MessageKey(GRAD, j, u), f"the gradient part of parameter {j}")[j])
        g = io.put(g, st.acc_sharding(vid))
        total = g if total is None else total + g
      if total is None:   # a parameter no stage reads: zero gradient
        aval = lay.param_avals[j]
        total = io.put(np.zeros(aval.shape, aval.dtype), st.replicated)
      out[out_vid] = total
    return out


# --------------------------------------------------------------------------- parameter offload


class GroupParams:
  """The parameters of a device group's stages that keep them in host memory
  (:attr:`~harpjax.compiler.stages.StepLayout.host_params`), fetched and dropped along the
  group's order (:func:`~harpjax.compiler.schedule.chunk_residency`): before the task at a
  position, the fetches it asks for are dispatched (the running stage's at the first position,
  else the next stage's, which then overlaps the running stage's tasks); after it, the stages
  it releases drop their device copies. A stage whose run is not known yet when its fetch is
  due fetches on its first task.

  Args:
    order: the group's tasks in order.
    offloaded: the stages of the layout that keep their parameters in host memory.
  """

  def __init__(self, order, offloaded):
    self.order = tuple(order)
    self.residency = chunk_residency(self.order, {t.stage for t in self.order} & set(offloaded))
    self.runs: dict[int, StageRun] = {}
    self.resident_log: list[tuple[int, ...]] = []   # per task: the stages whose parameters were on the devices

  def add(self, run: StageRun) -> None:
    """Registers a stage's run of the current step."""
    self.runs[run.s] = run

  def before(self, pos: int) -> None:
    """Dispatches the fetches of position ``pos``."""
    for s in self.residency.fetch[pos]:
      if s in self.runs:
        self.runs[s].fetch_params()

  def after(self, pos: int) -> None:
    """Drops the device copies position ``pos`` releases (and notes what was resident)."""
    self.resident_log.append(tuple(sorted(s for s, r in self.runs.items()
                                          if r.params_on_host and r.params_resident())))
    for s in self.residency.release[pos]:
      if s in self.runs:
        self.runs[s].release_params()
