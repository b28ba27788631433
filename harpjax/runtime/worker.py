"""The stage worker: one pipeline stage's part of every training step, in its own process.

A :class:`StageWorker` is a plain class; :mod:`harpjax.runtime.ray_runtime` makes it a Ray actor
at launch (or runs it in a thread of the driver for debugging). It never traces the user's
step: it receives its stage of the :class:`~harpjax.compiler.stages.LoweredStep` (the layout,
the schedule and its executables serialised by ``jax.export``) and loads the executables onto
its devices. Per step (:meth:`StageWorker.run_step`) it takes its share of the arguments (from
the driver, its own store or the stage holding them), runs its placement groups before the
pipeline, its row of the task table with the one interpreter
(:class:`~harpjax.runtime.interpreter.StageRun`, the worker being its ``Messenger``), its
groups after the pipeline, and keeps the outputs it computed (the new state stays here).

Sends go through one :class:`~harpjax.runtime.channels.Sender` thread per destination, so
computing never waits on the network; receives land in a
:class:`~harpjax.runtime.channels.Mailbox`, every wait bounded by ``recv_timeout_s``.

Stages that share a device group (an interleaved schedule's chunks) run in one process, a
:class:`DeviceGroupWorker`: a stage worker each, on the same devices, kept to the group's task
order by :class:`GroupTurns`; messages between them stay in the process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np

from harpjax import _compat
from harpjax.compiler.stages import LoweredStep, precompile
from harpjax.compiler.trace import Lit
from harpjax.errors import NotEnoughDevicesError, RuntimeFailure
from harpjax.runtime import codec, spmd, transport
from harpjax.runtime.channels import (FanoutChannel, Mailbox, Sender, TcpChannel, TcpListener,
                                      sleep_until)
from harpjax.runtime.emulation import Emulation
from harpjax.runtime.interpreter import (ACT, CT, VALUE, GroupParams, MessageKey, StageRun,
                                        place_on_mesh, put)
from harpjax.runtime.rows import PieceKey, member_pieces, member_rows, move_rows, row_ranges

log = logging.getLogger(__name__)

__all__ = ["WorkerOptions", "WorkerSpec", "StageWorker", "GroupTurns", "DeviceGroupWorker",
           "apply_settings", "host_pair_cuts"]


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
    lowered: the step lowered for the workers, holding this stage's executables
      (:meth:`~harpjax.compiler.stages.LoweredStep.for_stage`).
    consts: the step program's constants, encoded (:func:`harpjax.runtime.codec.encode`).
    host: the cluster host the stage runs on.
    options: :class:`WorkerOptions`.
    emulation: a resolved :class:`~harpjax.runtime.emulation.Emulation`, or ``None``.
    device_layout: for a stage run by a group of processes (one per host), per device of the
      stage in submesh order its ``(rank, local index)``: which member holds it, and where
      among that member's devices; ``None`` for a stage in one process.
    take_settings: the worker's process is not the driver's: before loading anything it takes
      the JAX settings the step was lowered under
      (:attr:`~harpjax.compiler.stages.LoweredStep.jax_settings`; :func:`apply_settings`).
    env_settings: names among those settings that the worker's environment sets on purpose
      (``RayRuntime.actor_env``): left as they are, an error if they differ.
    remote_groups: for a stage that splits its rows among groups, the groups that run in
      processes of their own (:mod:`harpjax.runtime.group_worker`); this worker runs the
      others and holds only their devices.
  """
  stage: int
  lowered: LoweredStep
  consts: tuple
  host: str
  options: WorkerOptions = WorkerOptions()
  emulation: Emulation | None = None
  device_layout: tuple | None = None
  take_settings: bool = False
  env_settings: frozenset = frozenset()
  remote_groups: tuple = ()

  @property
  def num_devices(self) -> int:
    """The devices of the stage this worker's process holds."""
    split = self.lowered.layout.splits.get(self.stage)
    if split is None or not self.remote_groups:
      return self.lowered.plan.stages[self.stage].num_devices
    return sum(g.num_devices for i, g in enumerate(split.groups) if i not in self.remote_groups)


def apply_settings(spec: WorkerSpec) -> None:
  """Puts this process under the JAX settings ``spec``'s step was lowered under (the
  driver's), all but those its environment sets on purpose; nothing unless
  ``spec.take_settings``.

  Raises:
    RuntimeFailure: a setting still differs from the driver's (``actor_env`` sets it
      otherwise, or this process's JAX refuses it); the message names each with both values.
  """
  if not spec.take_settings:
    return
  settings = dict(spec.lowered.jax_settings)
  refused = _compat.apply_jax_settings(settings, keep=spec.env_settings)
  differ = _compat.differing_jax_settings(settings)
  if not differ:
    return
  parts = []
  for name, (driver, here) in sorted(differ.items()):
    var = _compat.setting_env_var(name)
    if name in spec.env_settings:
      fix = (f"RayRuntime.actor_env sets {var}={os.environ.get(var)!r}: remove it or give "
             "it the driver's value")
    else:
      fix = (f"it could not be set here ({refused.get(name, 'the value did not take')}): run "
             "the workers with the driver's JAX version")
    parts.append(f"{name} is {driver!r} in the driver but {here!r} here; {fix}")
  raise RuntimeFailure(f"stage {spec.stage}: its process runs under JAX settings other than "
                       f"the driver's, which the stage was lowered under: {'; '.join(parts)}")


class StageWorker:
  """One stage's worker (see the module docstring).

  Args:
    spec: the :class:`WorkerSpec`.
    devices: the JAX devices of the stage's submesh, in order; default the first
      ``n`` devices of this process (an actor's own devices).
  """

  def __init__(self, spec: WorkerSpec | None = None, devices=None):
    # Everything a call may touch exists from here on: an abort or a message reaching a
    # worker whose build has not finished (or failed) finds an empty mailbox, not a missing one.
    self.stage = -1
    self.spec: WorkerSpec | None = None
    self.senders: dict[int, Sender] = {}
    self.member_senders: dict[int, Sender] = {}   # stage -> sender to its members
    self.cuts: dict[tuple, _Cut] = {}   # (kind, src, dst) -> a cut sent per host pair
    self.listeners: dict[str, TcpListener] = {}
    self.store: dict[tuple, Any] = {}
    self._step_lock = threading.Lock()
    self.group: spmd.Group | None = None
    self._arrived: float | None = None
    self.devices: list = []
    self.init_s = self.compile_s = 0.0
    self.lay = self.exe = self.group_fns = None
    self.options = WorkerOptions()
    self.emulation: Emulation | None = None
    self.mailbox = Mailbox(-1)
    self.token: str | None = None
    self._step = -1
    self._tasks: list[tuple] = []
    self._overruns = 0
    # Set by a DeviceGroupWorker: the other stages of this device group in this process, and
    # the group's task order, which this stage's region keeps.
    self.group_peers: dict[int, "StageWorker"] = {}
    self.turns: GroupTurns | None = None
    if spec is not None:
      self.build(spec, devices)

  def build(self, spec: WorkerSpec, devices=None, remote: dict | None = None) -> float:
    """Loads this stage's executables and compiles them; returns the seconds it took.

    A worker process can be rebuilt for another step (after :meth:`reset`): the runtime
    reuses its processes. ``remote``: group -> client of the groups of a stage that splits
    its rows that run in processes of their own (``spec.remote_groups``).
    """
    t0 = time.time()
    self.reset()
    self.spec = spec
    self.stage = s = spec.stage
    self.options = spec.options
    self.emulation = spec.emulation
    self.mailbox = Mailbox(s)
    self.token = None
    self._step = -1
    self._tasks = []
    apply_settings(spec)   # before anything is loaded or put on a device
    lowered = spec.lowered
    n = spec.num_devices
    if set(remote or {}) != set(spec.remote_groups):
      raise RuntimeFailure(f"stage {s}: groups {sorted(spec.remote_groups)} run in processes "
                           f"of their own but clients reach {sorted(remote or {})}")
    if devices is None and self.group is not None:
      devices = spmd.group_devices(spec.device_layout, s)
    if devices is None:
      avail = jax.devices()
      if len(avail) < n:
        raise NotEnoughDevicesError(
            f"stage {s} needs {n} devices but its process has {len(avail)} ({avail[0].platform})")
      devices = avail[:n]
    self.devices = list(devices)
    self.lay = lay = lowered.layout
    self.schedule = lowered.schedule
    self.exe, self.group_fns = lowered.load(s, self.devices, remote)
    self.mesh = self.exe.mesh
    self.preferred = {v: lay.preferred_sharding(s, v, self.mesh) for (h, v) in lay.preferred
                      if h == s}
    self.consts = dict(zip(lay.const_vids, (codec.decode(e) for e in spec.consts)))
    # Compile now, in every process at once, rather than during the first step, where each
    # stage would start compiling only when its predecessor's first activations arrive.
    self.compile_s = precompile(lay, {s: self.exe}, self.group_fns, workers=1)
    self.init_s = time.time() - t0
    log.info("stage %d ready on %s in %.2f s (%.2f s compiling)", s, self.devices, self.init_s,
             self.compile_s)
    return self.init_s

  def reset(self) -> None:
    """Closes channels and drops state, leaving the process ready for :meth:`build`."""
    self.shutdown()
    self.store.clear()
    self.lay = self.exe = self.group_fns = None

  # ------------------------------------------------------------------ set-up

  def join_group(self, coordinator: str, size: int, rank: int, timeout_s: float) -> int:
    """Makes this process member ``rank`` of a stage spanning ``size`` hosts (before
    :meth:`build`; see :mod:`harpjax.runtime.spmd`)."""
    self.group = spmd.join(coordinator, size, rank, timeout_s)
    self._broadcast = spmd.Broadcaster(self.group)
    return os.getpid()

  def free_port(self, address: str) -> int:
    """A TCP port free on ``address`` (the group leader's coordinator port)."""
    return spmd.free_port(address)

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
        self.listeners[addr] = TcpListener(addr, self.mailbox, token)
      out[addr] = tuple(self.listeners[addr].endpoint)
    return out

  def connect(self, channels: dict) -> dict[int, tuple]:
    """Starts a sender thread per destination stage.

    Args:
      channels: ``{dst: channel}``: a :class:`~harpjax.runtime.channels.Channel`,
        ``("tcp", src_address, (dst_address, port), device)``, or ``("local", dst)`` for a
        stage of this worker's device group in this process (its mailbox directly).

    Returns:
      ``{dst: local socket address}`` of the TCP channels.
    """
    out = {}
    for dst, ch in sorted(channels.items() if self.leader else ()):
      if isinstance(ch, tuple) and ch[0] == "tcp":
        _, src_addr, endpoint, device = ch
        ch = TcpChannel(src_addr, endpoint, self.token, self.stage,
                                  device=device if self.options.bind_device else None,
                                  timeout_s=self.options.recv_timeout_s)
        out[dst] = ch.local
      elif isinstance(ch, tuple) and ch[0] == "local":
        if dst not in self.group_peers:
          raise RuntimeFailure(f"stage {self.stage}: a local channel to stage {dst}, which "
                               "does not run in this process")
        old = self.senders.pop(dst, None)
        if old is not None:
          old.close()
        continue   # post() puts the message in the peer's mailbox: no sender
      old = self.senders.pop(dst, None)
      if old is not None:
        old.close()
      self.senders[dst] = Sender(ch, self.stage, dst, self._delay_fn(dst))
    return out

  @property
  def rank(self) -> int:
    """This process's member rank in its stage's group (``0`` in a stage of one process)."""
    return 0 if self.group is None else self.group.rank

  def listen_rows(self, addresses, token: str) -> list:
    """Opens a listener on this member's address (``addresses[rank]``), for the pieces of
    cuts sent per host pair; returns every member's endpoint, by rank (in a group a
    collective: every member calls it)."""
    self.token = token
    addr = addresses[self.rank]
    if addr not in self.listeners:
      self.listeners[addr] = TcpListener(addr, self.mailbox, token)
    mine = tuple(self.listeners[addr].endpoint)
    return [mine] if self.group is None else spmd.allgather_object(mine)

  def connect_rows(self, channels: dict, pairs, stage_ranks) -> None:
    """Starts a sender per member of each stage this one sends a cut to per host pair, and
    works out which values of which messages go that way.

    Args:
      channels: ``{rank: {(dst, dst_rank): ("tcp", src_address, (address, port), device)}}``:
        this member's are under its rank.
      pairs: the ``(src, dst)`` stage pairs whose activations (``src < dst`` routes) or
        cotangents go per host pair.
      stage_ranks: per stage, per device in submesh order, the member holding it.
    """
    for old in self.member_senders.values():
      old.close()
    self.member_senders = {}
    self.cuts = host_pair_cuts(self.lay, self.stage, {tuple(p) for p in pairs}, stage_ranks)
    by_dst: dict[int, dict] = {}
    for (dst, d), ch in sorted(channels.get(self.rank, {}).items()):
      _, src_addr, endpoint, device = ch
      by_dst.setdefault(dst, {})[d] = TcpChannel(
          src_addr, endpoint, self.token, self.stage,
          device=device if self.options.bind_device else None,
          timeout_s=self.options.recv_timeout_s)
    for dst, chans in by_dst.items():
      self.member_senders[dst] = Sender(FanoutChannel(chans), self.stage, dst,
                                        self._cut_delay_fn(dst))

  def set_emulation(self, emulation: Emulation | None) -> None:
    """Switches the emulated hardware (between steps)."""
    self.emulation = emulation
    for dst, snd in self.senders.items():
      snd.delay_s = self._delay_fn(dst)
    for dst, snd in self.member_senders.items():
      snd.delay_s = self._cut_delay_fn(dst)

  def _cut_delay_fn(self, dst: int):
    """The emulated lane of this host's part of the cuts to ``dst`` sent per host pair."""
    cut = next((c for (_, a, b), c in self.cuts.items() if (a, b) == (self.stage, dst)), None)
    if self.emulation is None or cut is None:
      return None
    return self.emulation.cut_delay_fn(self.stage, dst, cut.senders, cut.receivers)

  def _delay_fn(self, dst: int):
    if self.emulation is None or dst in self.group_peers:   # one device group: no link
      return None
    return self.emulation.delay_fn(self.stage, dst)

  # ------------------------------------------------------------------ messages

  def deliver(self, step: int, key: MessageKey, src: int, payload: dict) -> None:
    """Receiving end of a channel that calls the worker (the Ray object store)."""
    self.mailbox.put((step, key), {k: codec.decode(e) for k, e in payload.items()})

  def abort(self, reason: str, step: int | None = None) -> None:
    """Fails every wait of step ``step`` (``None``: of any step) because another stage failed
    or the driver was interrupted; later steps run normally."""
    self.mailbox.fail(reason, step)
    if self.turns is not None:
      self.turns.fail(reason, step)

  def ping(self) -> int:
    """Answers at once (a liveness probe of the driver)."""
    return self.stage

  def fetch(self, keys) -> list:
    """Encoded values of stored outputs (state gathered by the driver). In a group every
    member must be asked (the values are gathered collectively); the leader answers."""
    values = dict(enumerate(self._stored(tuple(k)) for k in keys))
    if self.group is not None:
      values = spmd.gather(values)   # one collective for all of them
    return [codec.encode(values[i]) for i in range(len(keys))] if self.leader else []

  def shutdown(self) -> None:
    for snd in list(self.senders.values()) + list(self.member_senders.values()):
      snd.close()
    for lst in self.listeners.values():
      lst.close()
    self.senders.clear()
    self.member_senders.clear()
    self.cuts = {}
    self.listeners.clear()

  def _stored(self, key: tuple):
    try:
      return self.store[key]
    except KeyError:
      raise RuntimeFailure(
          f"stage {self.stage} no longer holds output {key[1]} of step {key[0]}: only the "
          f"outputs of the last {self.options.retain_steps} steps are kept (retain_steps); "
          "gather() state you want to keep") from None

  # ------------------------------------------------------------------ the Messenger

  def _host(self, x):
    return x if self.group is None else spmd.to_host(x)

  def put(self, x, sharding):
    return put(x, sharding) if self.group is None else spmd.put(x, sharding)

  def take(self, x, sharding):
    """A received activation or cotangent on ``sharding``: one from another stage of this
    process (a device group's) moves per replica pair, device to device
    (:func:`~harpjax.runtime.rows.move_rows`); one received over the network arrives in host
    memory and each device takes its rows."""
    return move_rows(x, sharding) if self.group is None else spmd.put(x, sharding)

  def gather(self, payload: dict, dst: int | None = None, kind: str | None = None):
    """In a group (a collective): the payload in host memory on the leader, ``None`` on the
    other members; otherwise the payload itself. A message of a cut sent per host pair
    (``kind`` to stage ``dst``, :meth:`connect_rows`) keeps its values with rows here, as this
    member's rows in host memory, and gathers only the others."""
    cut = self.cuts.get((kind, self.stage, dst))
    if cut is not None:
      whole = {v: x for v, x in payload.items() if v not in cut.rows}
      # A value the executable left split along another axis too (XLA's choice) is gathered
      # like the values without rows: a process then holds only part of its rows.
      spread = {v: payload[v] for v in cut.rows if spmd.is_global(payload[v])
                and not _holds_own_rows(payload[v], cut.rows[v][0])}
      if (whole or spread) and self.group is not None:
        host = spmd.gather({**whole, **spread})
        whole = {v: host[v] for v in whole}
        payload = {**payload, **{v: host[v] for v in spread}}
      rows = {v: _own_rows(payload[v], cut.rows[v][0][self.rank]) for v in cut.rows}
      return _CutPayload(whole if (whole and self.leader) else None, rows)
    if self.group is None:
      return payload
    payload = spmd.gather(payload)
    return payload if self.group.leader else None

  def post(self, dst: int, key: MessageKey, payload: dict | None) -> None:
    """Queues a message for stage ``dst`` (a group's other members send nothing: one
    message per stage pair, from the leader)."""
    if isinstance(payload, _CutPayload):
      self._post_rows(dst, key, payload.rows)
      payload = payload.whole
    if payload is None:
      return
    peer = self.group_peers.get(dst)
    if peer is not None:   # a stage of this device group, in this process: no send
      peer.mailbox.put((self._step, key), payload)
      return
    snd = self.senders.get(dst)
    if snd is None:
      raise RuntimeFailure(f"stage {self.stage} has no channel to stage {dst}")
    snd.submit(self._step, key, payload)

  def _post_rows(self, dst: int, key: MessageKey, rows: dict) -> None:
    """Sends this member's pieces of a cut to each member of ``dst`` whose rows overlap
    them, each on its own connection."""
    cut = self.cuts[(key.kind, self.stage, dst)]
    msgs: dict[int, dict] = {}
    for v, (src_rows, _, pieces) in cut.rows.items():
      lo = src_rows[self.rank][0]
      for r, d, a, b in pieces:
        if r == self.rank:
          msgs.setdefault(d, {})[v] = rows[v][a - lo:b - lo]
    if msgs:
      self.member_senders[dst].submit(self._step, PieceKey(key.kind, key.index, key.src,
                                                           self.rank), msgs, cut.row_bytes)

  def _recv_rows(self, key: MessageKey, cut: "_Cut", what: str) -> dict:
    """This member's part of a cut sent per host pair: the values without rows from the
    leader (broadcast in a group), each value with rows joined from the pieces of the
    producer's members, as the stage's array."""
    out: dict = {}
    if cut.whole:
      msg = None
      if self.leader:
        msg = self.mailbox.get((self._step, key), key.src, self.options.recv_timeout_s,
                               f"{what} (step {self._step})")
      out.update(msg if self.group is None else self._broadcast(msg, key.kind_key))
    mine = {v: sorted((a, r) for r, d, a, _ in pieces if d == self.rank)
            for v, (_, _, pieces) in cut.rows.items()}
    got = {}
    for r in sorted({r for parts in mine.values() for _, r in parts}):
      got[r] = self.mailbox.get((self._step, PieceKey(key.kind, key.index, key.src, r)),
                                key.src, self.options.recv_timeout_s,
                                f"{what} (step {self._step}, rows of member {r})")
    for v, parts in mine.items():
      pieces = [got[r][v] for _, r in parts]
      x = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
      if self.group is not None:
        aval = self.lay.stages[self.stage].avals[v]
        x = jax.make_array_from_process_local_data(self.exe.sharding(v), x, aval.shape)
      out[v] = x
    return out

  def recv(self, key: MessageKey, what: str) -> dict:
    cut = self.cuts.get((key.kind, key.src, self.stage))
    if cut is not None:
      out = self._recv_rows(key, cut, what)
      self._arrived = time.time()
      return out
    msg = None
    if self.leader:
      msg = self.mailbox.get((self._step, key), key.src, self.options.recv_timeout_s,
                             f"{what} (step {self._step})")
    self._arrived = time.time()
    if self.group is None:
      return msg
    return self._broadcast(msg, key.kind_key)

  def begin_task(self) -> None:
    self._arrived = None

  def task_started(self) -> float:
    """When a task may start: now, or in a group when its last message reached the leader
    (the broadcast to the members counts as part of the task, as the emulated time does)."""
    if self.group is not None and self._arrived is not None:
      return self._arrived
    return time.time()

  def task_finished(self, kind: str, m: int, start: float, outs) -> None:
    """Records the task; with emulation, first waits until its emulated duration passed."""
    emu = self.emulation
    if emu is not None:
      jax.block_until_ready(outs)
      target = start + emu.compute_s(self.stage, kind)
      if time.time() > target:
        self._overruns += 1
      sleep_until(target)
    self._tasks.append((kind, m, start, time.time()))

  def _send_value(self, dst: int, vid: int, x) -> None:
    self.post(dst, MessageKey(VALUE, vid), self.gather({vid: x}))

  # ------------------------------------------------------------------ one step

  def run_step(self, step: int, manifest, inputs: dict, fetch, keep_from: int | None = None
               ) -> dict:
    """Runs this stage's part of one training step (one at a time: a step submitted while an
    aborted one is still unwinding waits for it).

    Args:
      step: the step number (messages are tagged with it).
      manifest: per argument leaf, ``None`` (sent by the driver to its readers) or
        ``(holder stage, store key)``.
      inputs: ``{leaf index: encoded value}`` of the driver-sent leaves this stage reads.
      fetch: indices of step outputs to return instead of keeping.
      keep_from: outputs of earlier steps are released (the driver's oldest step whose state
        may still be passed in; ``None`` keeps everything). Releasing at the start of a step,
        on the driver's word, means an interrupted step never releases the state it consumed.

    Returns:
      ``{"stage": s, "outputs": {k: encoded}, "tasks": [(kind, m, start, end)], "sends":
      [(dst, key, start, end, bytes)], "begin": t, "end": t, "overruns": n, "phases":
      {phase: seconds since begin}}`` (times from ``time.time()``).
    """
    with self._step_lock:
      return self._run_step(step, manifest, inputs, fetch, keep_from)

  def _run_step(self, step, manifest, inputs, fetch, keep_from) -> dict:
    s, lay = self.stage, self.lay
    begin = time.time()
    if keep_from is not None:
      for key in [k for k in self.store if k[0] < keep_from]:
        del self.store[key]
    self._step = step
    self._tasks = []
    self._overruns = 0
    self.mailbox.drop_before(step)
    env: dict[int, Any] = dict(self.consts)
    pending: dict[int, int] = {}
    for i, entry in enumerate(manifest):
      vid, readers = lay.leaf_vids[i], lay.leaf_readers[i]
      if entry is None:
        if s in readers:
          env[vid] = codec.decode(inputs[i])
        continue
      holder, key = entry
      if holder == s:
        x = self._stored(tuple(key))
        if s in readers:
          env[vid] = x
        for r in sorted(readers - {s}):
          self._send_value(r, vid, x)
      elif s in readers:
        pending[vid] = holder
    for v, rs in lay.readers.items():
      h = lay.home.get(v)
      if h is not None and h != s and s in rs:
        pending[v] = h
    self._env, self._pending = env, pending

    phases = {"inputs": time.time() - begin}
    for gi in lay.before[s]:
      self._run_group(gi)
    phases["before"] = time.time() - begin
    region_end = self._run_region()
    phases["region"] = time.time() - begin
    for gi in lay.after[s]:
      self._run_group(lay.num_before + gi)
    phases["after"] = time.time() - begin
    if self.emulation is not None and self.emulation.end_s is not None:
      jax.block_until_ready([env[v] for v in env if isinstance(env[v], jax.Array)])
      sleep_until(region_end + self.emulation.end_time_s(s))

    fetch = set(fetch)
    outputs = {}
    for k, o in enumerate(lay.outputs):
      if o[0] == "stage" and o[1] == s:
        if k in fetch:
          x = self._host(env[o[2]])
          if self.leader:
            outputs[k] = codec.encode(x)
        else:
          self.store[(step, k)] = env[o[2]]
    phases["outputs"] = time.time() - begin
    for snd in list(self.senders.values()) + list(self.member_senders.values()):
      snd.flush(self.options.recv_timeout_s)
    phases["flush"] = time.time() - begin
    sends = []
    for dst, snd in list(self.senders.items()) + list(self.member_senders.items()):
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
    env[v] = self.recv(MessageKey(VALUE, v), f"value %{v}")[v]
    return env[v]

  def _publish(self, v: int, x) -> None:
    self._env[v] = x
    for r in sorted(self.lay.readers.get(v, frozenset()) - {self.stage}):
      self._send_value(r, v, x)

  def _run_group(self, gi: int) -> None:
    g = self.lay.groups[gi]
    args = []
    for v in g.in_ids:
      x, pref = self._need(v), self.preferred.get(v)
      if self.group is not None and not spmd.is_global(x):   # this process's value only
        x = spmd.put(x, pref if pref is not None else self.exe.replicated)
      args.append(place_on_mesh(x, self.mesh, pref))
    for v, x in zip(g.out_ids, self.group_fns[gi](*args)):
      self._publish(v, x)

  def _run_region(self) -> float:
    """This stage's part of the region; returns when its last task ended."""
    lay, s = self.lay, self.stage
    inputs = {lay.region_invars[k]: ref.value if isinstance(ref, Lit) else self._need(ref)
              for k, ref in lay.region_inputs[s]}
    run = StageRun(lay, self.exe, self, inputs)
    turns = self.turns
    if turns is None:
      run.run(self.schedule.tables[s])
    else:   # a stage of a device group: its tasks in the group's order, one at a time
      try:
        turns.add_run(self._step, run, lay.host_params)
        for task in self.schedule.tables[s]:
          turns.wait(self._step, s, task, self.options.recv_timeout_s)
          run.task(task)
          turns.done(self._step)
      except BaseException as e:
        turns.fail(f"stage {s} failed: {type(e).__name__}: {e}", self._step)
        raise
    region_end = time.time()
    for vid, x in run.combine().items():
      self._publish(vid, x)
    run.send_gradient_parts()
    for vid, x in run.reduce().items():
      self._publish(vid, x)
    return region_end


# --------------------------------------------------------------------------- device groups


class GroupTurns:
  """The task order of one device group whose stages share its devices (an interleaved
  schedule), kept by the threads that run those stages in one process.

  Each stage's thread runs its own row (its tasks in the group's order); before a task it
  waits for its turn (:meth:`wait`), after it passes the turn on (:meth:`done`), so the group
  computes one task at a time in :attr:`~harpjax.compiler.schedule.Schedule.groups`' order, as
  the simulator and the memory model assume. Turns are counted per step; :meth:`fail` wakes
  the waiters of a step (a stage failed, or the runner aborted the step).

  Args:
    order: the group's tasks (:class:`~harpjax.compiler.schedule.StageTask`) in order.
    group: the group's index (for messages).
  """

  def __init__(self, order, group: int):
    self.order = tuple(order)
    self.group = group
    self._cond = threading.Condition()
    self._pos: dict[int, int] = {}
    self._failed: dict[int | None, str] = {}
    self._params: dict[int, GroupParams] = {}   # per step, with offloaded parameters

  def add_run(self, step: int, run, host_params) -> None:
    """Registers a stage's run of ``step``: the parameters of the group's stages that keep
    them in host memory are fetched and dropped along the order (:class:`~harpjax.runtime.
    interpreter.GroupParams`) as the turns pass."""
    if not {t.stage for t in self.order} & set(host_params):
      return
    with self._cond:
      gp = self._params.get(step)
      if gp is None:
        gp = self._params[step] = GroupParams(self.order, host_params)
      gp.add(run)

  def wait(self, step: int, stage: int, task, timeout_s: float) -> None:
    """Returns when ``stage``'s ``task`` is the group's next task in ``step``.

    Raises:
      RuntimeFailure: the step failed or was aborted, or the turn did not come in
        ``timeout_s`` (another stage of the group waits for a message that does not come).
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while True:
        reason = self._failed.get(step, self._failed.get(None))
        if reason is not None:
          raise RuntimeFailure(f"stage {stage}: aborted while waiting for its turn on device "
                               f"group {self.group}: {reason}")
        pos = self._pos.get(step, 0)
        nxt = self.order[pos] if pos < len(self.order) else None
        if nxt is not None and (nxt.stage, nxt.kind, nxt.microbatch) == (
            stage, task.kind, task.microbatch):
          gp = self._params.get(step)
          if gp is not None:
            gp.before(pos)
          return
        left = deadline - time.monotonic()
        if left <= 0:
          raise RuntimeFailure(
              f"stage {stage}: waited {timeout_s:g} s for its turn to run {task} on device "
              f"group {self.group}, whose next task is {nxt} (step {step})")
        self._cond.wait(min(left, 1.0))

  def done(self, step: int) -> None:
    """The group's current task of ``step`` finished: the next one may run."""
    with self._cond:
      pos = self._pos.get(step, 0)
      gp = self._params.get(step)
      if gp is not None:
        gp.after(pos)
      self._pos[step] = pos + 1
      for old in [k for k in self._pos if k < step]:
        del self._pos[old]
      for old in [k for k in self._params if k < step]:
        del self._params[old]
      for old in [k for k in self._failed if k is not None and k < step]:
        del self._failed[old]
      self._cond.notify_all()

  def fail(self, reason: str, step: int | None = None) -> None:
    """Wakes every wait of ``step`` (``None``: of every step) with ``reason`` (the first
    reason given stays)."""
    with self._cond:
      self._failed.setdefault(step, reason)
      self._cond.notify_all()


class DeviceGroupWorker:
  """The stages of one device group in one process: an interleaved schedule's chunks, which
  share the group's devices.

  Holds a :class:`StageWorker` per stage of the group, built on the same devices, and one
  :class:`GroupTurns`: every stage runs its row of the task table in a thread of its own, and
  the turns make the group compute its tasks in the schedule's group order, one at a time.
  Messages between stages of the group stay in this process (``("local", dst)`` channels put
  them in the receiver's mailbox, as device arrays); to other groups they go as between any
  two stages. The runner addresses each stage as usual; :meth:`call` hands a call to that
  stage's worker. Like :class:`StageWorker` a plain class; :mod:`harpjax.runtime.ray_runtime`
  makes it an actor.

  Args:
    stages: the group's stages, in order.
  """

  def __init__(self, stages=()):
    self.stages = tuple(int(s) for s in stages)
    self.workers = {s: StageWorker() for s in self.stages}
    for w in self.workers.values():
      w.group_peers = self.workers
    self.turns: GroupTurns | None = None
    self._lock = threading.Lock()

  def build(self, stage: int, spec: WorkerSpec, devices=None) -> float:
    """Builds ``stage``'s worker (the group's turns with the first of them)."""
    if stage not in self.workers:
      raise RuntimeFailure(f"stage {stage} does not run on this device group (stages "
                           f"{list(self.stages)})")
    sched = spec.lowered.schedule
    with self._lock:
      if self.turns is None:
        if sched.groups is None:
          raise RuntimeFailure(f"stage {stage}: schedule {sched.name!r} has no device groups")
        g = sched.device_groups[stage]
        if tuple(s for s, h in enumerate(sched.device_groups) if h == g) != self.stages:
          raise RuntimeFailure(f"device group {g} runs stages "
                               f"{[s for s, h in enumerate(sched.device_groups) if h == g]}, "
                               f"but this worker holds {list(self.stages)}")
        self.turns = GroupTurns(sched.groups[g], g)
    w = self.workers[stage]
    w.turns = self.turns
    return w.build(spec, devices)

  def call(self, stage: int, method: str, *args):
    """``method(*args)`` of ``stage``'s worker."""
    worker = self.workers.get(stage)
    if worker is None:
      raise RuntimeFailure(f"stage {stage} does not run on this device group (stages "
                           f"{list(self.stages)})")
    if method == "build":
      return self.build(stage, *args)
    return getattr(worker, method)(*args)

  def ping(self) -> tuple:
    return self.stages

  def shutdown(self) -> None:
    for w in self.workers.values():
      w.shutdown()


# --------------------------------------------------------------------------- cuts per host pair


@dataclasses.dataclass(frozen=True)
class _Cut:
  """A message kind between two stages sent per host pair: per value with rows, the rows of
  each member of the sending and of the receiving stage and the pieces
  (:func:`~harpjax.runtime.rows.member_pieces`); ``whole``: whether values without rows go
  too (from leader to leader, as any message); ``row_bytes``: the bytes of the values with
  rows (the cut's ``b``), ``senders`` and ``receivers``: the hosts holding distinct rows on
  either side (of the first such value; ``cut_time_s``'s ``hp`` and ``hc``)."""
  rows: dict
  whole: bool
  row_bytes: int
  senders: int
  receivers: int


@dataclasses.dataclass(frozen=True)
class _CutPayload:
  whole: dict | None
  rows: dict


def host_pair_cuts(lay, stage: int | None, pairs: set, stage_ranks) -> dict:
  """The cuts stage ``stage`` (``None``: any stage) sends or receives per host pair:
  ``{(kind, src, dst): _Cut}``."""
  out = {}
  for (a, b) in pairs:
    if stage is not None and stage not in (a, b):
      continue
    for kind, vids, (p, c) in ((ACT, lay.act_routes.get((a, b), ()), (a, b)),
                               (CT, lay.ct_routes.get((a, b), ()), (a, b))):
      rows, whole = {}, False
      for v in vids:
        sp, sc = lay.stages[p], lay.stages[c]
        shape = tuple(sp.avals[v].shape)
        src = member_rows(sp.specs[v], sp.logical_mesh, stage_ranks[p], shape)
        dst = member_rows(sc.specs[v], sc.logical_mesh, stage_ranks[c], shape)
        if src is None or dst is None:
          whole = True
        else:
          rows[v] = (src, dst, member_pieces(src, dst))
      if rows:
        first = next(iter(rows.values()))
        nbytes = sum(int(np.prod(lay.stages[p].avals[v].shape))
                     * np.dtype(lay.stages[p].avals[v].dtype).itemsize for v in rows)
        out[(kind, p, c)] = _Cut(rows, whole, nbytes, len(set(first[0])), len(set(first[1])))
  return out


def _holds_own_rows(x, src_rows) -> bool:
  """Whether each process holds, on its own devices, the whole of the rows it sends of the
  global array ``x`` (``src_rows``: by rank): the same answer in every process."""
  ranges = row_ranges(x.sharding, x.shape)
  if ranges is None:
    return False
  for rank, (lo, hi) in enumerate(src_rows):
    held = sorted(r for d, r in ranges.items() if d.process_index == rank)
    at = lo
    for a, b in held:
      if a <= at < b:
        at = b
    if at < hi:
      return False
  return True


def _own_rows(x, rows: tuple[int, int]) -> np.ndarray:
  """Rows ``[start, stop)`` of ``x`` in this process's host memory, from the shards this
  process holds (a global array) or from the whole value."""
  lo, hi = rows
  if not spmd.is_global(x):
    return np.asarray(x)[lo:hi]
  shards = {}
  for sh in x.addressable_shards:
    r = sh.index[0]
    start = r.start or 0
    stop = x.shape[0] if r.stop is None else r.stop
    if lo <= start and stop <= hi:
      shards.setdefault(start, (stop, sh.data))
  parts, at = [], lo
  while at < hi:
    stop, data = shards[at]
    parts.append(np.asarray(data))
    at = stop
  return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
