"""The stage worker: one pipeline stage's part of every training step, in its own process.

A :class:`StageWorker` is a plain class; :mod:`harpjax.runtime.ray_runtime` makes it a Ray actor
at launch (or runs it in a thread of the driver for debugging). Jitted functions do not pickle,
so each worker traces the user's step itself (:func:`harpjax.compiler.trace.trace_step` on the
abstract arguments, the driver's layer cuts) and builds only its own stage's executables and
placement groups on its own devices; a fingerprint of the traced programs, checked against the
driver's, makes sure every process derived the same routes
(:mod:`harpjax.runtime._dataflow`).

Per step the worker's compute thread (the caller of :meth:`StageWorker.run_step`):

1. takes its share of the step's arguments: from the driver, from its own store (state it
   computed last step), or from the stage holding them;
2. runs its placement groups before the pipeline, sending results other stages read;
3. runs its row of the schedule's task table: ``F`` waits for the activations of its
   microbatch, runs the forward executable and queues the outputs to the consuming stages;
   ``B`` waits for the cotangents, runs the backward executable, queues the activation
   cotangents back;
4. combines the loss and auxiliary outputs it computes, collects the gradient parts of the
   parameters it owns;
5. runs its placement groups after the pipeline (the optimizer update next to the weights);
6. keeps the step's outputs it computed (the new state stays here) and returns the others.

Sends go through one :class:`~harpjax.runtime.transport.Sender` thread per destination, so
computing never waits on the network; receives land in a
:class:`~harpjax.runtime.transport.Mailbox`, every wait bounded by ``recv_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any, Callable

import jax
import numpy as np

from harpjax.compiler.stages import precompile
from harpjax.compiler.stages import compile_step
from harpjax.compiler.layers import layers_from_cuts
from harpjax.compiler.plan import Plan
from harpjax.compiler.trace import Lit
from harpjax.compiler.schedule import Schedule
from harpjax.compiler.trace import trace_step
from harpjax.errors import NotEnoughDevicesError, RuntimeFailure
from harpjax.runtime import codec as _codec, spmd as _spmd, transport
from harpjax.runtime.dataflow import step_dataflow
from harpjax.runtime.emulation import Emulation
from harpjax.runtime.local import (_combine, _param_vid, _preferred_shardings, _put_on_mesh,
                                   microbatch_slice,
                                   _region_output, put)

log = logging.getLogger(__name__)

__all__ = ["WorkerOptions", "WorkerSpec", "StageWorker"]


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
  """Knobs of a stage worker (sent by value).

  Attributes:
    recv_timeout_s: longest wait for one message from another stage; covers the other
      stage's first-step compilation.
    retain_steps: outputs of this many most recent steps stay on the worker (older state
      handles are released).
    bind_device: also bind TCP sockets to the NIC's interface (``SO_BINDTODEVICE``, root).
  """
  recv_timeout_s: float = 300.0
  retain_steps: int = 2
  bind_device: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerSpec:
  """Everything a worker needs to build its stage (pickled to the actor).

  Attributes:
    stage: the stage index.
    step_fn: the user's train step (Ray pickles it with cloudpickle).
    abstract_args: the step's arguments as ``jax.ShapeDtypeStruct`` leaves.
    num_microbatches, batch_argnums, loss_reduction: as given to ``auto_parallel``.
    layer_starts: first op index of every layer (the driver's cuts, so that layers match).
    unrolled: whether the driver's layer program is the region with scans unrolled
      (``LayerSequence.origin`` set) rather than the region itself.
    plan: the resolved plan (devices and warm-ups filled in).
    schedule: the task tables.
    fingerprint: the driver's :func:`harpjax.runtime._dataflow.fingerprint`.
    host: the cluster host the stage runs on.
    options: :class:`WorkerOptions`.
    emulation: a resolved :class:`~harpjax.runtime.emulation.Emulation`, or ``None``.
    layout: for a stage run by a group of processes (one per host), per device of the stage
      in submesh order its ``(rank, local index)``: which member holds it, and where among
      that member's devices; ``None`` for a stage in one process.
  """
  stage: int
  step_fn: Callable
  abstract_args: tuple
  num_microbatches: int
  batch_argnums: tuple
  layer_starts: tuple
  plan: Plan
  schedule: Schedule
  loss_reduction: str
  fingerprint: str
  host: str
  options: WorkerOptions = WorkerOptions()
  emulation: Emulation | None = None
  unrolled: bool = False
  layout: tuple | None = None


class StageWorker:
  """One stage's worker (see the module docstring).

  Args:
    spec: the :class:`WorkerSpec`.
    devices: the JAX devices of the stage's submesh, in order; default the first
      ``n`` devices of this process (an actor's own devices).
  """

  def __init__(self, spec: WorkerSpec | None = None, devices=None):
    self.stage = -1
    self.senders: dict[int, transport.Sender] = {}
    self.listeners: dict[str, transport.TcpListener] = {}
    self.store: dict[tuple, Any] = {}
    self.group: _spmd.Group | None = None
    self._arrived: float | None = None
    self.devices: list = []
    self.init_s = 0.0
    if spec is not None:
      self.build(spec, devices)

  def build(self, spec: WorkerSpec, devices=None) -> float:
    """Traces the step and builds this stage's executables; returns the seconds it took.

    A worker process can be rebuilt for another step (after :meth:`reset`): the runtime
    reuses its processes.
    """
    t0 = time.time()
    self.reset()
    self.spec = spec
    self.stage = s = spec.stage
    plan = spec.plan
    n = plan.stages[s].num_devices
    if devices is None and self.group is not None:
      devices = _spmd.group_devices(spec.layout, s)
    if devices is None:
      avail = jax.devices()
      if len(avail) < n:
        raise NotEnoughDevicesError(
            f"stage {s} needs {n} devices but its process has {len(avail)} ({avail[0].platform})")
      devices = avail[:n]
    self.devices = list(devices)
    ts = trace_step(spec.step_fn, spec.abstract_args, num_microbatches=spec.num_microbatches,
                    batch_argnums=spec.batch_argnums)
    ts, layers = _layers(ts, spec)
    stage_devices: list = [None] * plan.num_stages
    stage_devices[s] = self.devices
    self.cs = compile_step(ts, layers, plan, stage_devices, spec.schedule, spec.loss_reduction,
                           build_stages={s})
    self.df = step_dataflow(self.cs)
    if self.df.fingerprint != spec.fingerprint:
      raise RuntimeFailure(
          f"stage {s} traced the step differently from the driver (fingerprint "
          f"{self.df.fingerprint} != {spec.fingerprint}); the step must trace the same way in "
          "every process: same jax/flax/optax versions, no randomness or globals in tracing")
    st = self.cs.stages[s]
    self.mesh = st.mesh
    self.preferred = {v: sh for (h, v), sh in _preferred_shardings(self.cs).items() if h == s}
    # Compile now, in every process at once, rather than during the first step, where each
    # stage would start compiling only when its predecessor's first activations arrive.
    self.compile_s = precompile(self.cs, workers=1)
    prog = self.cs.layers.program
    self.inputs_by_id = {prog.invars[k]: inp for k, inp in enumerate(ts.inputs)}
    self.options = spec.options
    self.emulation = spec.emulation
    self.mailbox = transport.Mailbox(s)
    self.token: str | None = None
    self._step = -1
    self._tasks: list[tuple] = []
    self.init_s = time.time() - t0
    log.info("stage %d ready on %s in %.2f s (%.2f s compiling)", s, self.devices, self.init_s,
             self.compile_s)
    return self.init_s

  def reset(self) -> None:
    """Closes channels and drops state, leaving the process ready for :meth:`build`."""
    self.shutdown()
    self.store.clear()
    self.cs = self.df = None

  # ------------------------------------------------------------------ set-up

  def join_group(self, coordinator: str, size: int, rank: int, timeout_s: float) -> int:
    """Makes this process member ``rank`` of a stage spanning ``size`` hosts (before
    :meth:`build`; see :mod:`harpjax.runtime._spmd`)."""
    self.group = _spmd.join(coordinator, size, rank, timeout_s)
    self._broadcast = _spmd.Broadcaster(self.group)
    return os.getpid()

  def free_port(self, address: str) -> int:
    """A TCP port free on ``address`` (the group leader's coordinator port)."""
    return _spmd.free_port(address)

  @property
  def leader(self) -> bool:
    """Whether this worker talks to other stages (always, but in a group's other members)."""
    return self.group is None or self.group.leader

  def info(self) -> dict:
    """Where this worker runs: process, host name, interfaces, devices, start-up seconds."""
    return {"stage": self.stage, "pid": os.getpid(), "hostname": socket.gethostname(),
            "interfaces": transport.interface_addresses(),
            "devices": [str(d) for d in self.devices], "init_s": self.init_s}

  def listen(self, addresses, token: str) -> dict[str, tuple[str, int]]:
    """Opens a TCP listener on each address; returns ``{address: (address, port)}``."""
    self.token = token
    out = {}
    for addr in (addresses if self.leader else ()):
      if addr not in self.listeners:
        self.listeners[addr] = transport.TcpListener(addr, self.mailbox, token)
      out[addr] = tuple(self.listeners[addr].endpoint)
    return out

  def connect(self, channels: dict) -> dict[int, tuple]:
    """Starts a sender thread per destination stage.

    Args:
      channels: ``{dst: channel}``: a :class:`~harpjax.runtime.transport.Channel`, or
        ``("tcp", src_address, (dst_address, port), device)``.

    Returns:
      ``{dst: local socket address}`` of the TCP channels.
    """
    out = {}
    for dst, ch in sorted(channels.items() if self.leader else ()):
      if isinstance(ch, tuple) and ch[0] == "tcp":
        _, src_addr, endpoint, device = ch
        ch = transport.TcpChannel(src_addr, endpoint, self.token, self.stage,
                                  device=device if self.options.bind_device else None,
                                  timeout_s=self.options.recv_timeout_s)
        out[dst] = ch.local
      old = self.senders.pop(dst, None)
      if old is not None:
        old.close()
      self.senders[dst] = transport.Sender(ch, self.stage, dst, self._delay_fn(dst))
    return out

  def set_emulation(self, emulation: Emulation | None) -> None:
    """Switches the emulated hardware (between steps)."""
    self.emulation = emulation
    for dst, snd in self.senders.items():
      snd.delay_s = self._delay_fn(dst)

  def _delay_fn(self, dst: int):
    return None if self.emulation is None else self.emulation.delay_fn(self.stage, dst)

  # ------------------------------------------------------------------ messages

  def deliver(self, step: int, key: tuple, src: int, payload: dict) -> None:
    """Receiving end of a channel that calls the worker (the Ray object store)."""
    self.mailbox.put((step,) + tuple(key), {k: _codec.decode(e) for k, e in payload.items()})

  def abort(self, reason: str) -> None:
    """Fails every wait of the current step (another stage failed)."""
    self.mailbox.fail(reason)

  def fetch(self, keys) -> list:
    """Encoded values of stored outputs (state gathered by the driver). In a group every
    member must be asked (the values are gathered collectively); the leader answers."""
    values = dict(enumerate(self._stored(tuple(k)) for k in keys))
    if self.group is not None:
      values = _spmd.gather(values)   # one collective for all of them
    return [_codec.encode(values[i]) for i in range(len(keys))] if self.leader else []

  def shutdown(self) -> None:
    for snd in self.senders.values():
      snd.close()
    for lst in self.listeners.values():
      lst.close()
    self.senders.clear()
    self.listeners.clear()

  def _stored(self, key: tuple):
    try:
      return self.store[key]
    except KeyError:
      raise RuntimeFailure(
          f"stage {self.stage} no longer holds output {key[1]} of step {key[0]}: only the "
          f"outputs of the last {self.options.retain_steps} steps are kept (retain_steps); "
          "gather() state you want to keep") from None

  def _host(self, x):
    return x if self.group is None else _spmd.to_host(x)

  def _put(self, x, sharding):
    return put(x, sharding) if self.group is None else _spmd.put(x, sharding)

  def _send(self, dst: int, key: tuple, payload: dict) -> None:
    self._post(dst, key, self._gather(payload))

  def _gather(self, payload: dict) -> dict | None:
    """In a group (a collective): the payload in host memory on the leader, ``None`` on the
    other members; otherwise the payload itself."""
    if self.group is None:
      return payload
    payload = _spmd.gather(payload)
    return payload if self.group.leader else None

  def _post(self, dst: int, key: tuple, payload: dict | None) -> None:
    """Queues a message for stage ``dst`` (a group's other members send nothing: one
    message per stage pair, from the leader)."""
    if payload is None:
      return
    snd = self.senders.get(dst)
    if snd is None:
      raise RuntimeFailure(f"stage {self.stage} has no channel to stage {dst}")
    snd.submit(self._step, key, payload)

  def _recv(self, key: tuple, src: int, what: str) -> dict:
    msg = None
    if self.leader:
      msg = self.mailbox.get((self._step,) + key, src, self.options.recv_timeout_s,
                             f"{what} (step {self._step})")
    self._arrived = time.time()
    if self.group is None:
      return msg
    kind = (key[0], key[2]) if key[0] in ("act", "ct") else key   # without the microbatch
    return self._broadcast(msg, kind)

  def _task_start(self) -> float:
    """When a task may start: now, or in a group when its last message reached the leader
    (the broadcast to the members counts as part of the task, as the emulated time does)."""
    if self.group is not None and self._arrived is not None:
      return self._arrived
    return time.time()

  # ------------------------------------------------------------------ one step

  def run_step(self, step: int, manifest, inputs: dict, fetch) -> dict:
    """Runs this stage's part of one training step.

    Args:
      step: the step number (messages are tagged with it).
      manifest: per argument leaf, ``None`` (sent by the driver to its readers) or
        ``(holder stage, store key)``.
      inputs: ``{leaf index: encoded value}`` of the driver-sent leaves this stage reads.
      fetch: indices of step outputs to return instead of keeping.

    Returns:
      ``{"stage": s, "outputs": {k: encoded}, "tasks": [(kind, m, start, end)], "sends":
      [(dst, key, start, end, bytes)], "begin": t, "end": t, "overruns": n, "phases":
      {phase: seconds since begin}}`` (times from ``time.time()``).
    """
    s, df, cs = self.stage, self.df, self.cs
    begin = time.time()
    self._step = step
    self._tasks = []
    self._overruns = 0
    self.mailbox.drop_before(step)
    env: dict[int, Any] = dict(zip(df.const_vids, cs.traced.outer_consts))
    pending: dict[int, int] = {}
    for i, entry in enumerate(manifest):
      vid, readers = df.leaf_vids[i], df.leaf_readers[i]
      if entry is None:
        if s in readers:
          env[vid] = _codec.decode(inputs[i])
        continue
      holder, key = entry
      if holder == s:
        x = self._stored(tuple(key))
        if s in readers:
          env[vid] = x
        for r in sorted(readers - {s}):
          self._send(r, ("v", vid), {vid: x})
      elif s in readers:
        pending[vid] = holder
    for v, rs in df.readers.items():
      h = df.home.get(v)
      if h is not None and h != s and s in rs:
        pending[v] = h
    self._env, self._pending = env, pending

    n_before = len(cs.placement.before)
    phases = {"inputs": time.time() - begin}
    for gi in df.before[s]:
      self._run_group(cs.placement.before[gi], cs.group_fns[gi])
    phases["before"] = time.time() - begin
    region_end = self._run_region(step)
    phases["region"] = time.time() - begin
    for gi in df.after[s]:
      self._run_group(cs.placement.after[gi], cs.group_fns[n_before + gi])
    phases["after"] = time.time() - begin
    if self.emulation is not None and self.emulation.end_s is not None:
      jax.block_until_ready([env[v] for v in env if isinstance(env[v], jax.Array)])
      _sleep_until(region_end + self.emulation.end_time_s(s))

    fetch = set(fetch)
    outputs = {}
    for k, o in enumerate(df.outputs):
      if o[0] == "stage" and o[1] == s:
        if k in fetch:
          x = self._host(env[o[2]])
          if self.leader:
            outputs[k] = _codec.encode(x)
        else:
          self.store[(step, k)] = env[o[2]]
    for key in [k for k in self.store if k[0] <= step - self.options.retain_steps]:
      del self.store[key]
    phases["outputs"] = time.time() - begin
    for snd in self.senders.values():
      snd.flush(self.options.recv_timeout_s)
    phases["flush"] = time.time() - begin
    sends = []
    for dst, snd in self.senders.items():
      evs, snd.events = snd.events, []
      sends += [(dst,) + e[1:] for e in evs if e[0] == step]
    self._env = self._pending = None
    return {"stage": s, "outputs": outputs, "tasks": self._tasks, "sends": sends,
            "begin": begin, "end": time.time(), "overruns": self._overruns,
            "phases": phases}

  def _need(self, v: int):
    env = self._env
    if v in env:
      return env[v]
    src = self._pending.get(v)
    if src is None:
      raise RuntimeFailure(f"stage {self.stage}: internal error, value {v} has no source")
    env[v] = self._recv(("v", v), src, f"value %{v}")[v]
    return env[v]

  def _publish(self, v: int, x) -> None:
    self._env[v] = x
    for r in sorted(self.df.readers.get(v, frozenset()) - {self.stage}):
      self._send(r, ("v", v), {v: x})

  def _run_group(self, group, fn) -> None:
    args = []
    for v in group.in_ids:
      x, pref = self._need(v), self.preferred.get(v)
      if self.group is not None and not _spmd.is_global(x):   # this process's value only
        x = _spmd.put(x, pref if pref is not None else self.cs.stages[self.stage].replicated)
      args.append(_put_on_mesh(x, self.mesh, pref))
    outs = fn(*args)
    for v, x in zip(group.out_ids, outs):
      self._publish(v, x)

  def _pad(self, kind: str, m: int, start: float, outs) -> None:
    emu = self.emulation
    if emu is not None:
      jax.block_until_ready(outs)
      target = start + emu.compute_s(self.stage, kind)
      if time.time() > target:
        self._overruns += 1
      _sleep_until(target)
    self._tasks.append((kind, m, start, time.time()))

  def _run_region(self, step: int) -> float:
    s, cs, df = self.stage, self.cs, self.df
    st = cs.stages[s]
    sp = st.program
    ts = cs.traced
    prog = cs.layers.program
    region_eqn = ts.outer.ops[ts.region_op]
    B = ts.num_microbatches
    value = {}
    for k, ref in df.region_inputs[s]:
      value[prog.invars[k]] = ref.value if isinstance(ref, Lit) else self._need(ref)
    params = tuple(self._put(value[v], st.param_sharding[v]) for v in sp.param_ids)
    whole_cache: dict[int, Any] = {}

    def data_for(m: int):
      out = []
      for v in sp.data_ids:
        inp = self.inputs_by_id[v]
        sh = st.input_sharding[v]
        if inp.kind == "split":
          out.append(self._put(microbatch_slice(value[v], inp.axis, m, B), sh))
        else:
          if v not in whole_cache:
            whole_cache[v] = self._put(value[v], sh)
          out.append(whole_cache[v])
      return tuple(out)

    consumers = sorted(t for (p, t) in df.act_routes if p == s)
    ct_from = sorted(t for (t, p) in df.ct_routes if p == s)
    fwd_outputs: list[dict[int, Any]] = [dict() for _ in range(B)]
    residuals: dict[int, Any] = {}
    acc = st.zeros()
    loss_vid = prog.outvars[0]
    region_outs = {v for v in prog.outvars if not isinstance(v, Lit)}
    scale = 1.0 / B if cs.loss_reduction == "mean" else 1.0
    mb_index = [np.int32(m) for m in range(B)]

    for task in cs.schedule.tables[s]:
      m = task.microbatch
      if task.kind == "F":
        acts: dict[int, Any] = {}
        self._arrived = None
        for p in df.act_sources[s]:
          acts.update(self._recv(("act", m, p), p, f"the activations of microbatch {m}"))
        start = self._task_start()
        a = tuple(self._put(acts[v], st.input_sharding[v]) for v in sp.act_ids)
        ai = tuple(self._put(acts[v], st.input_sharding[v]) for v in sp.act_int_ids)
        outs, vjp = st.fwd(params, a, ai, data_for(m), mb_index[m])
        out_map = dict(zip(sp.output_ids, outs))
        msgs = [(t, self._gather({v: out_map[v] for v in df.act_routes[(s, t)]}))
                for t in consumers]
        self._pad("F", m, start, outs)
        for t, payload in msgs:
          self._post(t, ("act", m, s), payload)
        for v in sp.output_ids:
          if v in region_outs:
            fwd_outputs[m][v] = out_map[v]
        residuals[m] = vjp
      else:
        self._arrived = None
        msgs = {t: self._recv(("ct", m, t), t, f"the cotangents of microbatch {m}")
                for t in ct_from}
        start = self._task_start()
        present = []
        for v, has in zip(sp.output_ids, sp.ct_present):
          if not has:
            continue
          ct = None
          for t in df.ct_sources[s].get(v, ()):
            g = self._put(msgs[t][v], cs.output_sharding(s, v))
            ct = g if ct is None else ct + g
          if v == loss_vid:
            seed = self._put(np.asarray(scale, prog.avals[v].dtype), st.replicated)
            ct = seed if ct is None else ct + seed
          if ct is None:
            aval = prog.avals[v]
            ct = self._put(np.zeros(aval.shape, aval.dtype), cs.output_sharding(s, v))
          present.append(ct)
        acc, act_cts = st.bwd(residuals.pop(m), tuple(present), acc)
        ct_map = dict(zip(sp.act_ids, act_cts))
        cts = [(p, self._gather({v: ct_map[v] for v in df.ct_routes[(s, p)]}))
               for p in df.ct_targets[s]]
        self._pad("B", m, start, (acc, act_cts))
        for p, payload in cts:
          self._post(p, ("ct", m, s), payload)
    region_end = time.time()

    # Loss and auxiliary outputs computed here.
    n_fwd = len(prog.outvars)
    for k, ref in enumerate(prog.outvars):
      vid = region_eqn.outvars[k]
      if df.region_out_home[k] != s or vid < 0:
        continue
      per_mb = [_region_output(cs, ref, value, fwd_outputs[m], m) for m in range(B)]
      axis = None if k == 0 else ts.aux_concat_axes[k - 1]
      self._publish(vid, _combine(per_mb, axis, cs.loss_reduction))

    # Gradients: parts go to the owner, which sums them in stage order.
    mine = {v: i for i, v in enumerate(sp.param_ids)}
    for j in range(ts.num_params):
      owner, vid = df.param_owner[j], _param_vid(cs, j)
      if region_eqn.outvars[n_fwd + j] >= 0 and owner != s and s in df.grad_users[j]:
        self._send(owner, ("grad", j, s), {j: acc[mine[vid]]})
    for j in range(ts.num_params):
      out_vid = region_eqn.outvars[n_fwd + j]
      if df.param_owner[j] != s or out_vid < 0:
        continue
      vid = _param_vid(cs, j)
      total = None
      for u in cs.param_users[j]:
        g = acc[mine[vid]] if u == s else self._recv(("grad", j, u), u,
                                                     f"the gradient part of parameter {j}")[j]
        g = self._put(g, st.param_sharding[vid])
        total = g if total is None else total + g
      if total is None:   # a parameter no stage reads: zero gradient
        aval = prog.avals[vid]
        total = self._put(np.zeros(aval.shape, aval.dtype), st.replicated)
      self._publish(out_vid, total)
    return region_end


def _layers(ts, spec: WorkerSpec):
  """The driver's layers: its cut positions on the region, or on the region with scans unrolled
  the way :func:`harpjax.compiler.layers.layers_for_step` does (then ``ts`` is replaced by the
  matching traced step)."""
  if not spec.unrolled:
    return ts, layers_from_cuts(ts.region, spec.layer_starts[1:])
  from harpjax.compiler import layers as layers_lib
  seq = layers_lib.layers_for_step(ts)
  layers = dataclasses.replace(layers_from_cuts(seq.program, spec.layer_starts[1:]),
                               origin=seq.origin)
  return layers_lib.traced_step_for(ts, layers), layers


def _sleep_until(deadline: float) -> None:
  left = deadline - time.time()
  if left > 0:
    time.sleep(left)
