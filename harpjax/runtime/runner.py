"""The driver side of the distributed runtime, independent of how workers are started.

:class:`PipelineRunner` starts one :class:`~harpjax.runtime.worker.StageWorker` per stage
(the stages of a device group under an interleaved schedule together in one process, a
:class:`~harpjax.runtime.worker.DeviceGroupWorker`, kept to the group's task order) through a
*backend* (Ray actors in :mod:`harpjax.runtime.ray_runtime`; threads of this process
in :class:`ThreadBackend`, for debugging), wires their channels on the links the cluster model
chooses (:mod:`harpjax.runtime.transport`), and runs steps: one call per worker per step, every
wait bounded, a failure anywhere reported as a :class:`~harpjax.errors.RuntimeFailure` naming
the stage.

State stays on the workers. A step's outputs come back as :class:`RemoteArray` handles (which
stage holds which leaf), except those the runner fetches (by default the metrics: every output
after the first of a tuple-returning step). Passing handles back into the next step moves
nothing; :meth:`PipelineRunner.gather` fetches real arrays, :meth:`PipelineRunner.save` writes
them to an ``.npz`` file.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harpjax import _compat
from harpjax.compiler.stages import StepProgram, lower_step
from harpjax.compiler.trace import aval_nbytes
from harpjax.errors import (HarpjaxError, InvalidOptionError, PlanError, RuntimeFailure,
                            UnknownOptionError, check_choice, check_count, check_flag,
                            check_number)
from harpjax.runtime import codec, transport
from harpjax.runtime.channels import LocalChannel
from harpjax.runtime.emulation import Emulation
from harpjax.runtime.local import check_compilation_cache
from harpjax.runtime.handles import (RemoteArray, gather, new_runner_id, register_runner,
                                     save_tree, unregister_runner)
from harpjax.runtime.measure import MeasuredStep, measured_step
from harpjax.runtime.worker import (GroupTurns, StageWorker, WorkerOptions, WorkerSpec,
                                    host_pair_cuts)

log = logging.getLogger(__name__)

__all__ = ["RayRuntime", "RunnerOptions", "PipelineRunner", "ThreadBackend", "FETCH_MODES",
           "device_groups_of"]

FETCH_MODES = ("metrics", "all", "none")


# --------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class RayRuntime:
  """Run each stage in a worker of its own, Ray actors by default
  (``auto_parallel(runtime=harpjax.RayRuntime(...))``; ``runtime="ray"`` is ``RayRuntime()``).
  The options of :class:`~harpjax.runtime.ray_runtime.RayRunner`.

  Attributes:
    address: Ray cluster address (``"auto"``, ``"ray://host:10001"``...); ``None`` starts a
      local Ray instance (or joins the one already initialised in this process).
    backend: ``"ray"`` (one actor per stage) or ``"threads"`` (the same workers in threads of
      this process, without Ray: for debugging).
    transport: ``"auto"``, ``"tcp"`` or ``"object_store"`` (see
      :func:`harpjax.runtime.transport.plan_routes`).
    nic_addresses: ``{host: {nic: ip}}`` addresses of the cluster's NICs (default: each host's
      interface of the NIC's name; loopback when everything runs on this machine).
    emulation: an :class:`~harpjax.runtime.emulation.Emulation`, or ``None`` to run at the
      speed of the actual devices.
    fetch: which step outputs come back as arrays: ``"metrics"`` (all but the first element of
      a tuple, i.e. everything except the new state), ``"all"`` or ``"none"``.
    recv_timeout_s: longest wait of a worker for one message.
    step_timeout_s: longest wait of the driver for one step (first step: with compilation).
    start_timeout_s: longest wait for the workers to start and compile.
    retain_steps: steps whose outputs the workers keep.
    interrupt_grace_s: after Ctrl-C during a step, how long the driver waits for the workers
      to abandon it before raising ``KeyboardInterrupt``.
    num_cpus: CPUs of a local Ray instance (default: ``max(2, stages + 1)``).
    actor_env: extra environment variables of the actors. The actors take the driver's JAX
      settings (``jax_enable_x64``...: :data:`harpjax._compat.JAX_SETTINGS`) without being
      told; one set here (``JAX_ENABLE_X64``) is left as given, and is an error at start if
      it differs from the driver's.
    pin_hosts: place each stage's actor on a Ray node advertising the resource
      ``harpjax_host:<host name>``; ``None``: when such resources exist.
    spmd_hosts: run a stage whose devices are on several hosts as one SPMD program over one
      process per host (``jax.distributed``, :mod:`harpjax.runtime.spmd`); ``None``: when
      actors are pinned to hosts or use GPUs (on one machine with fake CPU devices a single
      process can hold all of the stage's devices instead).
    group_processes: run each group of a mixed-type stage that sits on other hosts than the
      stage's first group in a process of its own (:mod:`harpjax.runtime.group_worker`);
      ``None``: when actors are pinned to hosts or use GPUs (on one machine with fake CPU
      devices one process can hold every group).
    bind_device: also ``SO_BINDTODEVICE`` TCP sockets to the NIC (root).
    ray_init: extra keyword arguments of ``ray.init``.
    compilation_cache: keep compiled executables on disk (the driver's JAX setting, which
      the workers take): as :attr:`harpjax.LocalRuntime.compilation_cache`.
  """
  address: str | None = None
  backend: str = "ray"
  transport: str = "auto"
  nic_addresses: Any = None
  emulation: Emulation | None = None
  fetch: str = "metrics"
  recv_timeout_s: float = 300.0
  step_timeout_s: float = 900.0
  start_timeout_s: float = 600.0
  retain_steps: int = 2
  interrupt_grace_s: float = 10.0
  num_cpus: int | None = None
  actor_env: Any = None
  pin_hosts: bool | None = None
  spmd_hosts: bool | None = None
  group_processes: bool | None = None
  bind_device: bool = False
  ray_init: Any = None
  compilation_cache: bool | str = True

  name = "ray"

  def __post_init__(self):
    check_choice("RayRuntime.backend", self.backend, ("ray", "threads"))
    check_choice("RayRuntime.transport", self.transport, transport.TRANSPORTS)
    check_choice("RayRuntime.fetch", self.fetch, FETCH_MODES)
    if self.address is not None and not isinstance(self.address, str):
      raise InvalidOptionError(f"RayRuntime.address={self.address!r}: a Ray address (a str, "
                               "'auto', 'ray://host:10001') or None (a local Ray instance)")
    if self.emulation is not None and not isinstance(self.emulation, Emulation):
      raise InvalidOptionError(f"RayRuntime.emulation={self.emulation!r}: give a "
                               "harpjax.Emulation or None")
    for name in ("recv_timeout_s", "step_timeout_s", "start_timeout_s"):
      check_number(f"RayRuntime.{name}", getattr(self, name), 0, low_open=True, finite=False)
    check_number("RayRuntime.interrupt_grace_s", self.interrupt_grace_s, 0)
    check_count("RayRuntime.retain_steps", self.retain_steps, 1)
    check_count("RayRuntime.num_cpus", self.num_cpus, 1, allow_none=True)
    for name in ("nic_addresses", "actor_env", "ray_init"):
      v = getattr(self, name)
      if v is not None and not hasattr(v, "items"):
        raise InvalidOptionError(f"RayRuntime.{name}={v!r} must be a dict or None")
    for name in ("pin_hosts", "spmd_hosts", "group_processes"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, bool):
        raise InvalidOptionError(f"RayRuntime.{name}={v!r} must be True, False or None (the "
                                 "default: decided from the cluster)")
    check_flag("RayRuntime.bind_device", self.bind_device)
    object.__setattr__(self, "compilation_cache", check_compilation_cache(
        self.compilation_cache, "RayRuntime.compilation_cache"))

  @classmethod
  def from_kwargs(cls, kwargs: dict) -> "RayRuntime":
    """The options of a ``runtime_options`` dict (the spelling before :class:`RayRuntime`).

    Raises:
      UnknownOptionError: a key that is not a field.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
      raise UnknownOptionError(f"unknown runtime_options {unknown}: RayRuntime has "
                               f"{sorted(known)}")
    return cls(**kwargs)

  def worker_options(self) -> WorkerOptions:
    return WorkerOptions(recv_timeout_s=float(self.recv_timeout_s),
                         retain_steps=int(self.retain_steps), bind_device=self.bind_device)


RunnerOptions = RayRuntime
"""The former name of :class:`RayRuntime`."""


# --------------------------------------------------------------------------- runner


class PipelineRunner:
  """Runs a compiled step on one worker per stage. See the module docstring.

  Args:
    program: the step laid out on the resolved plan
      (:class:`~harpjax.compiler.stages.StepProgram`); each worker receives its stage of it
      lowered (:func:`~harpjax.compiler.stages.lower_step`).
    cluster: the :class:`~harpjax.cluster.Cluster`.
    example_args: arguments of this structure (arrays, ``ShapeDtypeStruct`` or handles).
    backend: starts and calls the workers.
    options: :class:`RayRuntime`.
  """

  def __init__(self, program: StepProgram, cluster, example_args, backend,
               options: RayRuntime):
    t0 = time.time()
    self.id = new_runner_id()
    self.options = options
    self.program = program
    self.layout = lay = program.layout
    self.cluster = cluster
    self.num_stages = S = program.num_stages
    self.hosts = transport.stage_hosts(self.cluster, [s.all_devices for s in program.plan.stages])
    self.host_groups = [host_groups(self.cluster, st.all_devices) for st in program.plan.stages]
    # Stages that share a device group (an interleaved schedule) run in one worker process.
    self.device_groups = device_groups_of(program.schedule)
    self.emulation = (None if options.emulation is None else
                      options.emulation.resolve(program.plan, self.cluster, self.hosts))
    self._backend = backend
    self._step = 0
    self._completed = 0
    self._failed: str | None = None
    self._lock = threading.Lock()
    self.last: MeasuredStep | None = None
    self.history: list[MeasuredStep] = []
    self._last_outputs = None
    self._revocable = None
    leaves = jax.tree_util.tree_leaves(example_args)
    if len(leaves) != len(lay.leaf_vids):
      raise PlanError(f"the step was compiled for {len(lay.leaf_vids)} argument leaves, got "
                      f"{len(leaves)}")
    wopts = options.worker_options()
    split = backend.prepare(self)   # stages run by one process per host
    self.split = frozenset(split)
    self.row_hosts: dict = {}   # (src, dst) -> hosts with distinct rows, a cut per host pair
    lowered = lower_step(program, platform=backend.platform)
    consts = tuple(codec.encode(x) for x in program.traced.outer_consts)
    # Workers in processes of their own take the JAX settings the stages were lowered under
    # (but those the actors' environment sets on purpose, which are checked).
    env = {str(k) for k in dict(options.actor_env or {})}
    kept = frozenset(n for n, _ in lowered.jax_settings if _compat.setting_env_var(n) in env)
    specs = [WorkerSpec(stage=s, lowered=lowered.for_stage(s), consts=consts, host=self.hosts[s],
                        options=wopts, emulation=self.emulation,
                        device_layout=(group_layout(self.host_groups[s],
                                                    program.plan.stages[s].all_devices)
                                       if s in split else None),
                        take_settings=backend.own_processes, env_settings=kept,
                        remote_groups=tuple(backend.remote_groups.get(s, ())))
             for s in range(S)]
    out_tree = program.traced.out_tree
    self._fetch = _fetch_indices(out_tree, out_tree.num_leaves, options.fetch)
    self._consts = dict(zip(lay.const_vids, program.traced.outer_consts))
    register_runner(self.id, self)
    try:
      backend.start(self, specs)
      self._call_all("build", [backend.build_args(spec) for spec in specs],
                     options.start_timeout_s, "starting the stage workers")
      self.infos = self._call_all("info", [()] * S, options.start_timeout_s, "starting")
      self.routes = self._connect()
    except BaseException:
      backend.healthy = False   # workers left half-built are not reused
      self.shutdown()
      raise
    log.info("runner %d: %d stage workers ready in %.1f s; routes:\n  %s", self.id, S,
             time.time() - t0, "\n  ".join(r.describe() for r in self.routes.values()))

  # ------------------------------------------------------------------ wiring

  def _connect(self) -> dict:
    S, lay, be = self.num_stages, self.layout, self._backend
    single = be.single_machine(self.infos)
    addresses = {}
    if not single:
      for s, info in enumerate(self.infos):
        host = self.cluster.host(self.hosts[s])
        for nic in host.nics:
          ip = info["interfaces"].get(nic.name)
          if ip:
            addresses[(host.name, nic.name)] = ip
    addresses.update(transport.normalize_addresses(self.options.nic_addresses))
    machine = [info["hostname"] for info in self.infos]
    routes = transport.plan_routes(self.cluster, self.hosts, lay.pairs(), addresses=addresses,
                                   same_process=be.same_process,
                                   same_machine=lambda a, b: machine[a] == machine[b],
                                   single_machine=single, transport=self.options.transport)
    token = transport.new_token()
    listen = [sorted({r.dst_address for r in routes.values()
                      if r.transport == "tcp" and r.dst == s}) for s in range(S)]
    endpoints = self._call_all("listen", [(listen[s], token) for s in range(S)],
                               self.options.start_timeout_s, "opening listeners")
    channels = [dict() for _ in range(S)]
    for (a, b), r in routes.items():
      if r.transport == "tcp":
        device = r.src_nic if r.src_address != transport.LOOPBACK else None
        channels[a][b] = ("tcp", r.src_address, endpoints[b][r.dst_address], device)
      elif r.transport == "local":
        channels[a][b] = be.local_channel(b)
      else:
        channels[a][b] = be.object_store_channel(b)
    self._call_all("connect", [(channels[s],) for s in range(S)],
                   self.options.start_timeout_s, "connecting channels")
    self._connect_rows(routes, token, addresses, single)
    return routes

  def _connect_rows(self, routes: dict, token: str, addresses: dict, single: bool) -> None:
    """Connects every member of a stage spanning several hosts (a group) to every member of
    each stage it sends to or receives from over TCP, for the cuts sent per host pair
    (``docs/runtime.md``); pairs where a member's address is unknown keep the leader's one
    connection."""
    S, prog = self.num_stages, self.program
    size = [len(self.host_groups[s]) if s in self.split else 1 for s in range(S)]
    member_host = [[h for h, _ in self.host_groups[s]] if s in self.split else [self.hosts[s]]
                   for s in range(S)]
    ranks = [tuple(r for r, _ in group_layout(self.host_groups[s], st.all_devices))
             if s in self.split else (0,) * len(st.all_devices)
             for s, st in enumerate(prog.plan.stages)]

    def address(s: int, rank: int, nic) -> str | None:
      if single or (rank == 0 and nic is None):
        return transport.LOOPBACK
      return addresses.get((member_host[s][rank], nic))

    pairs, listen = [], {}
    for (a, b), r in sorted(routes.items()):
      if r.transport != "tcp" or (size[a] == 1 and size[b] == 1):
        continue
      dst_addr = [address(b, k, r.dst_nic) for k in range(size[b])]
      src_addr = [address(a, k, r.src_nic) for k in range(size[a])]
      if None in dst_addr or None in src_addr or len(set(listen.get(b, dst_addr))
                                                      ^ set(dst_addr)) > 0:
        continue
      listen[b] = dst_addr
      pairs.append((a, b, src_addr, r))
    if not pairs:
      return
    opts = self.options
    endpoints = self._call("listen_rows", {b: (listen[b], token) for b in listen},
                           opts.start_timeout_s, "opening listeners for per-host cuts")
    channels: list[dict] = [dict() for _ in range(S)]
    for a, b, src_addr, r in pairs:
      for ra in range(size[a]):
        mine = channels[a].setdefault(ra, {})
        for rb in range(size[b]):
          mine[(b, rb)] = ("tcp", src_addr[ra], tuple(endpoints[b][rb]), None)
    directed = [(a, b) for a, b, _, _ in pairs]
    self._call_all("connect_rows", [(channels[s], directed, ranks) for s in range(S)],
                   opts.start_timeout_s, "connecting the members of groups")
    self.row_hosts = {(p, c): (cut.senders, cut.receivers) for (_, p, c), cut in
                      host_pair_cuts(self.layout, None, set(directed), ranks).items()}
    log.info("runner %d: cuts sent per host pair on %s", self.id, directed)

  # ------------------------------------------------------------------ steps

  def __call__(self, args):
    with self._lock:
      return self._run(tuple(args))

  def _run(self, args):
    if self._failed is not None:
      raise RuntimeFailure(f"this runner failed earlier ({self._failed}); build a new "
                           "auto_parallel step to start over")
    t0 = time.time()
    lay, S = self.layout, self.num_stages
    leaves = jax.tree_util.tree_leaves(args)
    manifest, encoded = [], {}
    for i, x in enumerate(leaves):
      if isinstance(x, RemoteArray) and x.runner_id == self.id:
        manifest.append((x.stage, x.key))
        continue
      if isinstance(x, RemoteArray):
        x = x.gather()
      manifest.append(None)
      if lay.leaf_readers[i]:
        encoded[i] = codec.encode(x if isinstance(x, (jax.Array, np.ndarray))
                                   else np.asarray(x))
    self._step += 1
    step = self._step
    # The outputs of the last `retain_steps` completed steps stay on the workers: an
    # interrupted or failed call completes nothing, so the state it consumed stays valid.
    keep_from = self._completed - int(self.options.retain_steps) + 1
    per_stage = []
    for s in range(S):
      inputs = {i: e for i, e in encoded.items() if s in lay.leaf_readers[i]}
      fetch = [k for k in self._fetch if lay.outputs[k][0] == "stage" and lay.outputs[k][1] == s]
      per_stage.append((step, manifest, inputs, fetch, keep_from))
    results = self._call_all("run_step", per_stage, self.options.step_timeout_s, f"step {step}",
                             fail_runner=True, step=step)
    outs = []
    for k, o in enumerate(lay.outputs):
      if o[0] == "lit":
        outs.append(o[1])
      elif o[0] == "const":
        outs.append(self._consts[o[1]])
      elif o[0] == "leaf":
        outs.append(leaves[o[1]])
      else:
        _, h, vid = o
        if k in self._fetch:
          x = codec.decode(results[h]["outputs"][k])
          outs.append(x if isinstance(x, jax.Array) else jnp.asarray(x))
        else:
          aval = lay.outer_avals[vid]
          outs.append(RemoteArray(self.id, h, (step, k), aval.shape, aval.dtype))
    out = jax.tree_util.tree_unflatten(self.program.traced.out_tree, outs)
    self.last = measured_step(step, time.time() - t0, results, self.program.schedule)
    self.history.append(self.last)
    if len(self.history) > 64:
      del self.history[:-64]
    over = sum(self.last.overruns)
    if over and self.emulation is not None and step > 1:   # step 1 compiles
      log.warning("step %d: %d tasks took longer than their emulated time; increase "
                  "Emulation.time_scale for a faithful emulation", step, over)
    self._last_outputs = out
    self._revocable = (out, self._completed)
    self._completed = step   # last: an interrupt before here leaves the state passed in valid
    return out

  def revoke(self, outputs) -> None:
    """Undoes the completion of the last step, whose ``outputs`` its caller did not take (Ctrl-C
    while they were checkpointed): the state that step consumed stays valid for its retry
    however often that is interrupted again."""
    with self._lock:
      if self._revocable is not None and self._revocable[0] is outputs:
        self._completed = self._revocable[1]
        self._revocable = None

  def _call_all(self, method: str, args_per_stage, timeout_s: float, what: str,
                fail_runner: bool = False, step: int | None = None) -> list:
    """``method(*args)`` on every stage's worker; their results in stage order."""
    out = self._call(method, dict(enumerate(args_per_stage)), timeout_s, what, fail_runner,
                     step=step)
    return [out[s] for s in range(len(args_per_stage))]

  def _call(self, method: str, args: dict, timeout_s: float, what: str,
            fail_runner: bool = False, abort_others: bool = True,
            step: int | None = None) -> dict:
    """``method(*args[s])`` on the workers of the stages in ``args``, every wait bounded; a
    failure anywhere (the others aborted, unless not ``abort_others``) or a timeout raises a
    :class:`RuntimeFailure` naming the stage that caused it.

    An interrupt (Ctrl-C) while waiting aborts ``step`` on every worker, waits a moment for
    them to stop, and raises ``KeyboardInterrupt``: the runner stays usable and the state
    passed in stays valid (workers release state only when the driver starts a later step).
    A call that is not a step (a gather, the start) waits for no message: it is left to
    finish on its own, and the workers' next steps are not touched.
    """
    be = self._backend
    pending: dict = {}
    try:
      for s, a in args.items():
        pending[s] = be.submit(s, method, *a)
      return self._wait(pending, timeout_s, what, fail_runner, abort_others, step)
    except KeyboardInterrupt:
      if step is None:
        raise
      for t in pending:
        be.abort(t, f"{what} interrupted", step)
      until = time.monotonic() + self.options.interrupt_grace_s
      try:
        while pending and time.monotonic() < until:
          for t, _, _ in be.wait_any(pending, until - time.monotonic()):
            del pending[t]
      except KeyboardInterrupt:   # a second Ctrl-C: stop waiting
        pass
      if pending:
        log.warning("%s interrupted; stage(s) %s still unwinding (their next step waits for "
                    "them)", what, sorted(pending))
      raise

  def _wait(self, pending: dict, timeout_s: float, what: str, fail_runner: bool,
            abort_others: bool, step: int | None) -> dict:
    be = self._backend
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout_s
    grace_until = None
    while pending:
      now = time.monotonic()
      limit = deadline if grace_until is None else min(deadline, grace_until)
      if now >= limit:
        break
      for s, ok, value in be.wait_any(pending, limit - now):
        del pending[s]
        if ok:
          results[s] = value
        else:
          errors[s] = value
          if grace_until is None:   # let the others report why they stopped
            grace_until = time.monotonic() + 3.0
            for t in pending if abort_others and step is not None else ():
              be.abort(t, f"stage {s} failed during {what}", step)
    if not errors and not pending:
      return results
    if pending and not errors:
      for t in pending if step is not None else ():
        be.abort(t, f"{what} timed out", step)
      msg = (f"{what}: stage(s) {sorted(pending)} ("
             + ", ".join(self.hosts[t] for t in sorted(pending))
             + f") did not finish within {timeout_s:g} s")
    else:
      root = _root_cause(errors)
      msg = (f"{what} failed on stage {root} (host {self.hosts[root]}): "
             f"{_describe(errors[root])}")
      others = [f"stage {t}: {_describe(e)}" for t, e in sorted(errors.items()) if t != root]
      if others:
        msg += "\n  then " + "\n  then ".join(others)
    if fail_runner:
      self._failed = msg.splitlines()[0]
    raise RuntimeFailure(msg)

  # ------------------------------------------------------------------ state

  def fetch_handles(self, handles: Sequence[RemoteArray]) -> list:
    by_stage: dict[int, list[int]] = {}
    for i, h in enumerate(handles):
      by_stage.setdefault(h.stage, []).append(i)
    got = self._call("fetch", {s: ([handles[i].key for i in idx],) for s, idx in by_stage.items()},
                     self.options.step_timeout_s, "gather", abort_others=False)
    out: list = [None] * len(handles)
    for s, idx in by_stage.items():
      for i, e in zip(idx, got[s]):
        x = codec.decode(e)
        out[i] = x if isinstance(x, jax.Array) else jnp.asarray(x)
    return out

  def gather(self, tree=None):
    """The arrays behind the handles in ``tree`` (default: the last step's outputs)."""
    return gather(self._last_outputs if tree is None else tree)

  def save(self, path: str | os.PathLike, tree=None) -> None:
    """Gathers ``tree`` (default: the state, i.e. the first output of the last step) and
    writes it with :func:`save_tree`."""
    if tree is None:
      out = self._last_outputs
      if out is None:
        raise HarpjaxError("save(): no step has run yet; pass the tree to save")
      tree = out[0] if isinstance(out, (tuple, list)) else out
    save_tree(path, tree)

  # ------------------------------------------------------------------ emulation

  def set_emulation(self, emulation: Emulation | None) -> None:
    """Switches the emulated hardware of every worker (between steps)."""
    resolved = None if emulation is None else emulation.resolve(self.program.plan,
                                                                 self.cluster, self.hosts)
    self._call_all("set_emulation", [(resolved,)] * self.num_stages,
                   self.options.start_timeout_s, "set_emulation")
    self.emulation = resolved

  def message_bytes(self) -> tuple[list[int], list[int]]:
    """``([S-1] activation bytes i -> i+1, [S-1] cotangent bytes i+1 -> i)`` per microbatch."""
    lay, S = self.layout, self.num_stages
    nbytes = lambda i, ids: sum(aval_nbytes(lay.stages[i].avals[v]) for v in ids)
    act = [nbytes(i + 1, lay.act_routes.get((i, i + 1), ())) for i in range(S - 1)]
    ct = [nbytes(i + 1, lay.ct_routes.get((i + 1, i), ())) for i in range(S - 1)]
    return act, ct

  def simulate(self, emulation: Emulation | None = None, **kwargs):
    """The simulator's prediction of an iteration with the emulated numbers the workers use.

    Raises:
      HarpjaxError: no emulation.
    """
    emu = emulation.resolve(self.program.plan, self.cluster, self.hosts) if emulation \
        else self.emulation
    if emu is None:
      raise HarpjaxError("simulate() needs an emulation: pass runtime=harpjax.RayRuntime("
                         "emulation=harpjax.Emulation(...)) or an Emulation here")
    lay = self.layout
    skips = [k for k in list(lay.act_routes) + list(lay.ct_routes) if abs(k[0] - k[1]) != 1]
    if skips:
      log.warning("messages between non-neighbouring stages %s are not in the simulator's "
                  "model", skips)
    act, ct = self.message_bytes()
    return emu.simulate(self.program.schedule, act, ct, row_hosts=self.row_hosts, **kwargs)

  # ------------------------------------------------------------------ lifetime

  def lost_hosts(self) -> list[str]:
    """Hosts of the stages whose worker no longer answers (a killed actor, a lost node)."""
    lost = set()
    for s, st in enumerate(self.program.plan.stages):
      if not self._backend.alive(s):
        lost.update(self.cluster.host_of_device(d).name for d in st.all_devices)
    return sorted(lost)

  def kill_stage(self, stage: int, rank: int = 0) -> None:
    """Kills one stage's worker (member ``rank`` of a group; for testing failure handling)."""
    self._backend.kill(stage, rank)

  def shutdown(self) -> None:
    """Stops the workers; the runner's handles become invalid."""
    unregister_runner(self.id)
    try:
      self._backend.shutdown()
    finally:
      self._failed = self._failed or "shut down"

  def __del__(self):
    try:
      self._backend.shutdown()
    except Exception:  # pylint: disable=broad-except
      pass


def device_groups_of(schedule) -> tuple[tuple[int, ...], ...]:
  """The stages of each device group that runs several (an interleaved schedule's chunks), in
  order; empty when every stage has devices of its own."""
  if schedule.groups is None:
    return ()
  groups: dict[int, list[int]] = {}
  for s, g in enumerate(schedule.device_groups):
    groups.setdefault(g, []).append(s)
  return tuple(tuple(v) for _, v in sorted(groups.items()) if len(v) > 1)


def host_groups(cluster, devices) -> list[tuple[str, list[int]]]:
  """A stage's devices by host: ``[(host, [global device indices])]`` in order of first
  appearance (the first host's process leads a group)."""
  out: dict[str, list[int]] = {}
  for d in devices:
    out.setdefault(cluster.host_of_device(d).name, []).append(int(d))
  return list(out.items())


def group_layout(groups, devices) -> tuple:
  """Per device of the stage, in submesh order, ``(rank of its host, index on that host)``."""
  where = {d: (rank, i) for rank, (_, devs) in enumerate(groups) for i, d in enumerate(devs)}
  return tuple(where[int(d)] for d in devices)


def _fetch_indices(out_tree, n: int, mode: str) -> frozenset:
  if mode == "all":
    return frozenset(range(n))
  if mode == "none":
    return frozenset()
  pos = jax.tree_util.tree_unflatten(out_tree, list(range(n)))
  if isinstance(pos, (tuple, list)) and len(pos) > 1:
    return frozenset(jax.tree_util.tree_leaves(list(pos[1:])))
  return frozenset()


def _root_cause(errors: dict) -> int:
  """The stage whose error is not a consequence of another's (a lost peer, an abort).

  A dead actor comes first; then any error that is not about a peer (a send or receive that
  broke because the other side went away, an abort, a wait); else the lowest stage.
  """
  for s, e in sorted(errors.items()):
    if "died" in str(e):
      return s
  secondary = ("lost stage", "aborted while waiting", "failed during", "waited",
               "sending to stage", "receiving from stage", "failed earlier",
               "Connection reset", "Broken pipe", "connection closed")
  for s, e in sorted(errors.items()):
    if not any(p in str(e) for p in secondary):
      return s
  return min(errors)


def _describe(e: BaseException) -> str:
  text = str(e).strip()
  first = text.splitlines()[0] if text else ""
  return f"{type(e).__name__}: {first}" if first else type(e).__name__


# --------------------------------------------------------------------------- threads


class ThreadBackend:
  """Workers in threads of this process (no Ray): the same protocol, for debugging and tests.

  Stages talk through :class:`~harpjax.runtime.channels.LocalChannel` (``device_put``), or
  over loopback TCP with ``transport="tcp"``. The workers share the driver's JAX settings.
  """
  own_processes = False
  remote_groups: dict = {}   # every group of a mixed-type stage runs in its stage's thread
  healthy = True

  def __init__(self, options: RayRuntime):
    self.options = options
    self.workers: list[StageWorker] = []
    self._pool: cf.ThreadPoolExecutor | None = None
    self.platform = jax.default_backend()

  def prepare(self, runner: PipelineRunner) -> frozenset:
    return frozenset()   # threads of one process: no stage is split

  def start(self, runner: PipelineRunner, specs) -> None:
    self._local = runner.cluster.local_devices()
    self.workers = [StageWorker() for _ in specs]
    sched = runner.program.schedule
    for stages in runner.device_groups:   # a device group's stages keep its task order
      turns = GroupTurns(sched.groups[sched.device_groups[stages[0]]],
                         sched.device_groups[stages[0]])
      for s in stages:
        self.workers[s].turns = turns
        self.workers[s].group_peers = {t: self.workers[t] for t in stages}
    self._pool = cf.ThreadPoolExecutor(max_workers=2 * len(specs) + 2,
                                       thread_name_prefix="harpjax-stage")

  def build_args(self, spec) -> tuple:
    return (spec, [self._local[i] for i in spec.lowered.plan.stages[spec.stage].all_devices])

  def single_machine(self, infos) -> bool:
    return True

  def same_process(self, a: int, b: int) -> bool:
    return self.options.transport != "tcp"

  def submit(self, stage: int, method: str, *args):
    return self._pool.submit(getattr(self.workers[stage], method), *args)

  def wait_any(self, pending: dict, timeout_s: float):
    inv = {f: s for s, f in pending.items()}
    done, _ = cf.wait(list(inv), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
    out = []
    for f in done:
      e = f.exception()
      out.append((inv[f], e is None, f.result() if e is None else e))
    return out

  def abort(self, stage: int, reason: str, step: int | None = None) -> None:
    self.workers[stage].abort(reason, step)

  def local_channel(self, dst: int):
    return LocalChannel(self.workers[dst].mailbox)

  def object_store_channel(self, dst: int):
    return self.local_channel(dst)

  def kill(self, stage: int, rank: int = 0) -> None:
    raise HarpjaxError("the threads backend cannot kill a stage")

  def alive(self, stage: int) -> bool:
    return True

  def shutdown(self) -> None:
    for w in self.workers:
      w.shutdown()
    self.workers = []
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None
