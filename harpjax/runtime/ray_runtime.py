"""The Ray runtime: one Ray actor per pipeline stage (``auto_parallel(..., runtime="ray")``).

With :mod:`~harpjax.runtime.planner_pool`, the only modules of harpjax that import Ray. The stage
worker (:class:`~harpjax.runtime.worker.StageWorker`) is a plain class, made an actor here at
launch; the driver logic (steps, state handles, gather/save, emulation, simulator comparison) is
:class:`~harpjax.runtime.runner.PipelineRunner`. Every ``ray.get`` has a timeout, and a failed
or killed actor surfaces as a :class:`~harpjax.errors.RuntimeFailure` naming its stage.

Actors. Each actor gets the environment its stage needs: on a CPU-only Ray cluster (this
machine) ``XLA_FLAGS=--xla_force_host_platform_device_count=<stage devices>`` and
``JAX_PLATFORMS=cpu``, so its process has the stage's devices as fake CPU devices; on a GPU
cluster it asks Ray for the stage's GPUs (``num_gpus``), which become its JAX devices. With
``pin_hosts`` each actor is placed on the Ray node that advertises the custom resource
``harpjax_host:<host name>`` (``docker/launch.sh`` starts nodes that way), so that the cluster
file's hosts are the machines that run them. Actors are threaded (``max_concurrency``): the step
runs in one thread while messages (object-store channel), aborts and fetches arrive in others.

Under an interleaved schedule the stages of one device group share its devices: one actor, a
:class:`~harpjax.runtime.worker.DeviceGroupWorker`, runs them all (each stage's calls reach its
worker there through ``call``), its messages between them staying in the process. Such actors
are not reused.

A stage spanning several hosts (submesh ``(n, M)``, ``n > 1``) is, with ``spmd_hosts`` (the
default when actors are pinned to hosts or use GPUs), one actor per host: the members join one
``jax.distributed`` world and run the stage as one SPMD program; the first member talks to the
other stages (:mod:`harpjax.runtime.spmd`). Such actors are not reused by later runners.

A mixed-type stage (groups of several GPU types, :mod:`harpjax.compiler.stages.split`) runs its
groups on the stage's first host in the stage's actor, and, with ``group_processes`` (the
default when actors are pinned to hosts or use GPUs), each group on another host in an actor of
its own (:class:`~harpjax.runtime.group_worker.GroupWorker`), which the stage's actor drives
with ordered calls; their values cross through Ray's object store (Ray's own connection
between the nodes, not the NIC the cluster model picks for messages between stages). Such
actors are not reused either.

Usage::

    step = harpjax.auto_parallel(train_step, cluster=..., plan=...,
                                 runtime=harpjax.RayRuntime(emulation=Emulation(time_scale=0.05)))
    state, loss = step(state, batch)     # state: RemoteArray handles, loss: an array
    state = harpjax.runtime.ray_runtime.gather(state)
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
from typing import Any

import ray

from harpjax.errors import HarpjaxError, OptionConflictError, RuntimeFailure, UnsupportedError
from harpjax.runtime import codec, transport
from harpjax.runtime.channels import Channel
from harpjax.runtime.group_worker import GroupWorker
from harpjax.runtime.handles import RemoteArray, gather, load_tree, save_tree
from harpjax.runtime.measure import MeasuredStep
from harpjax.runtime.runner import PipelineRunner, RayRuntime, RunnerOptions, ThreadBackend
from harpjax.runtime.worker import DeviceGroupWorker, StageWorker

log = logging.getLogger(__name__)

__all__ = ["RayRunner", "RayRuntime", "RunnerOptions", "RemoteArray", "MeasuredStep", "gather", "save_tree",
           "load_tree", "ObjectStoreChannel", "HOST_RESOURCE_PREFIX", "init_ray", "release_pool"]

HOST_RESOURCE_PREFIX = "harpjax_host:"
"""Custom Ray resource a node advertises for each cluster host it is (value 1)."""

GPU_TYPE_RESOURCE_PREFIX = "harpjax_gpu:"
"""Custom Ray resource a node advertises for its GPU type (value: its GPU count)."""

_WAIT_GET_S = 30.0   # ray.get of a result ray.wait reported ready
_PING_S = 10.0       # a live actor answers a ping within this


class RayRunner(PipelineRunner):
  """Runs a compiled step on one Ray actor per stage.

  Built by :meth:`harpjax.ParallelStep.runner` (``runtime="ray"`` or a
  :class:`~harpjax.runtime.runner.RayRuntime`: ``address``, ``emulation``, ``transport``,
  ``nic_addresses``, ``fetch``, timeouts, ...).

  Args:
    program: the step laid out on its resolved plan
      (:class:`~harpjax.compiler.stages.StepProgram`).
    cluster: the :class:`~harpjax.cluster.Cluster`.
    example_args: the step's arguments (arrays, ``ShapeDtypeStruct`` or handles).
    options: a :class:`~harpjax.runtime.runner.RayRuntime` (default ``RayRuntime()``).
    **kwargs: its fields instead (the ``runtime_options`` spelling).

  Raises:
    OptionsError: an unknown or invalid option.
    RuntimeFailure: an actor could not start, compile or connect in ``start_timeout_s``.
  """

  def __init__(self, program, cluster, example_args, options: RayRuntime | None = None,
               **kwargs):
    if options is not None and kwargs:
      raise OptionConflictError(f"RayRunner: options given both as a RayRuntime and as "
                                f"keywords {sorted(kwargs)}: give one")
    opts = options if options is not None else RayRuntime.from_kwargs(kwargs)
    backend = ThreadBackend(opts) if opts.backend == "threads" else RayBackend(opts)
    super().__init__(program, cluster, example_args, backend, opts)


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs) -> None:
  """Connects to a Ray cluster at ``address``, or starts a local instance (explicit CPU count,
  no dashboard, worker logs not forwarded); does nothing if Ray is already initialised."""
  if ray.is_initialized():
    return
  if address is None:
    kw = dict(num_cpus=num_cpus or 4, include_dashboard=False, log_to_driver=False)
    kw.update(kwargs)
    ray.init(**kw)
    log.info("started a local Ray instance with %s CPUs", kw["num_cpus"])
  else:
    ray.init(address=address, **kwargs)
    log.info("connected to the Ray cluster at %s", address)


class ObjectStoreChannel(Channel):
  """The fallback channel: the sender thread hands the message to the receiving actor's
  ``deliver`` method through the Ray object store, waiting (bounded) for it to be filed.
  ``grouped``: the actor runs a device group's stages (``call(dst, "deliver", ...)``)."""
  remote = True

  def __init__(self, actor, dst: int, timeout_s: float, grouped: bool = False):
    self.actor, self.dst, self.timeout_s, self.grouped = actor, dst, timeout_s, grouped

  def send(self, step, key, src, payload):
    if self.grouped:
      ref = self.actor.call.remote(self.dst, "deliver", step, key, src, payload)
    else:
      ref = self.actor.deliver.remote(step, key, src, payload)
    try:
      ray.get(ref, timeout=self.timeout_s)
    except ray.exceptions.GetTimeoutError:
      raise RuntimeFailure(f"stage {src}: stage {self.dst} did not accept a message within "
                           f"{self.timeout_s:g} s") from None
    except ray.exceptions.RayActorError as e:
      raise RuntimeFailure(f"stage {src}: stage {self.dst}'s actor died: "
                           f"{str(e).splitlines()[0]}") from None


def _actor_env(num_devices: int, gpu: bool, extra: dict | None) -> dict[str, str]:
  env: dict[str, str] = {}
  paths = [p for p in sys.path if p and os.path.isdir(p)]
  if os.environ.get("PYTHONPATH"):
    paths = os.environ["PYTHONPATH"].split(os.pathsep) + paths
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
  if not gpu:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={num_devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
  env.update({str(k): str(v) for k, v in (extra or {}).items()})
  return env


# Idle actor processes, by (environment, GPUs, resources): a new runner (another argument
# structure, another schedule) rebuilds them instead of paying for new processes and imports.
_POOL: dict[tuple, list] = {}
_POOL_MAX = 8
_POOL_LOCK = threading.Lock()


class _Call:
  """One method call on every member of a stage's actor group: done when all answered or one
  failed; the value is the leader's."""

  def __init__(self, refs: list):
    self.refs = refs
    self.values: dict[int, Any] = {}


class RayBackend:
  """Starts and calls the stage actors (see the module docstring): one per stage, or, for a
  stage spanning several hosts with ``spmd_hosts``, one per host, joined into one
  ``jax.distributed`` group (:mod:`harpjax.runtime.spmd`). Actors are processes of their
  own: each takes the driver's JAX settings when it builds its stage."""
  own_processes = True

  def __init__(self, options: RayRuntime):
    self.options = options
    self.actors: list[list] = []     # per stage, its members (leader first)
    self.keys: list[tuple | None] = []
    self.remote_groups: dict[int, tuple] = {}   # mixed stage -> groups in actors of their own
    self.group_hosts: dict[tuple, str] = {}     # (stage, group) -> its host
    self.group_actors: dict[int, dict] = {}     # stage -> group -> actor
    self.device_group: dict[int, int] = {}      # stage -> its device group's index, for the
    #                                             stages of an interleaved schedule (one actor)
    self.healthy = True
    self.pin = self.gpu = False
    self.platform = "cpu"   # what the stages are lowered for (set by prepare)

  def prepare(self, runner: PipelineRunner) -> frozenset:
    """Starts Ray; returns the stages run by one process per host."""
    opts = self.options
    init_ray(opts.address, opts.num_cpus or max(2, runner.num_stages + 1),
             **dict(opts.ray_init or {}))
    resources = ray.cluster_resources()
    self.gpu = resources.get("GPU", 0) > 0
    self.platform = "cuda" if self.gpu else "cpu"   # (GPU: untested here, see docs/runtime.md)
    self.pin = opts.pin_hosts
    if self.pin is None:
      self.pin = any(k.startswith(HOST_RESOURCE_PREFIX) for k in resources)
    spmd = opts.spmd_hosts
    if spmd is None:
      spmd = self.pin or self.gpu
    mixed = {s for s, st in enumerate(runner.program.plan.stages) if st.mixed}
    split = frozenset(s for s, g in enumerate(runner.host_groups)
                      if spmd and len(g) > 1 and s not in mixed)
    procs = opts.group_processes
    if procs is None:
      procs = self.pin or self.gpu
    self.remote_groups, self.group_hosts = {}, {}
    for s in sorted(mixed) if procs else ():
      st = runner.program.plan.stages[s]
      hosts = [_group_hosts(runner.cluster, s, g, grp) for g, grp in enumerate(st.all_groups)]
      for g, h in enumerate(hosts):
        if g and h != hosts[0]:
          self.remote_groups.setdefault(s, ())
          self.remote_groups[s] += (g,)
          self.group_hosts[(s, g)] = h
    _check_placement(runner, self.pin, self.gpu, split, self.remote_groups)
    self.device_group = {s: i for i, stages in enumerate(runner.device_groups) for s in stages}
    _check_device_groups(runner, split, mixed)
    return split

  def start(self, runner: PipelineRunner, specs) -> None:
    opts = self.options
    resources = ray.cluster_resources()
    cls = ray.remote(StageWorker)
    group_cls = ray.remote(DeviceGroupWorker)
    group_actors: dict[int, Any] = {}
    reused = 0
    for spec in specs:
      g = self.device_group.get(spec.stage)
      if g is not None:   # one process runs the device group's stages
        if g not in group_actors:
          env = _actor_env(spec.num_devices, self.gpu, dict(opts.actor_env or {}))
          stages = runner.device_groups[g]
          actor_opts = self._actor_options(env, spec.num_devices, spec.host, resources,
                                           16 * len(stages), f"stages {list(stages)}")
          group_actors[g] = group_cls.options(**actor_opts).remote(stages)
        self.actors.append([group_actors[g]])
        self.keys.append(None)
        continue
      if spec.device_layout is None:
        members = [(spec.host, spec.num_devices)]
      else:
        members = [(h, len(devs)) for h, devs in runner.host_groups[spec.stage]]
      group_env = _group_env(runner, spec.stage) if (spec.device_layout and self.gpu) else {}
      actors, key = [], None
      for host, n in members:
        env = _actor_env(n, self.gpu, {**group_env, **dict(opts.actor_env or {})})
        actor_opts = self._actor_options(env, n, host, resources, 16, f"stage {spec.stage}")
        actor = None
        # A group's processes join a jax.distributed world: they are not reused; nor are
        # those of a stage that drives groups in processes of their own.
        if spec.device_layout is None and not spec.remote_groups:
          key = (tuple(sorted(env.items())), actor_opts.get("num_gpus", 0),
                 tuple(sorted(actor_opts.get("resources", {}).items())))
          with _POOL_LOCK:
            idle = _POOL.get(key)
            actor = idle.pop() if idle else None
          reused += actor is not None
        actors.append(actor or cls.options(**actor_opts).remote())
      self.actors.append(actors)
      self.keys.append(key)
    groups = [s for s, spec in enumerate(specs) if spec.device_layout is not None]
    if groups:
      self._join_groups(runner, groups)
    self._start_group_workers(specs, resources)
    log.info("launched %d stage actors (%d reused; %s devices%s%s%s)",
             len({id(a) for m in self.actors for a in m}), reused,
             "GPU" if self.gpu else "CPU", ", pinned to hosts" if self.pin else "",
             f"; stages {groups} as groups of one process per host" if groups else "",
             f"; device groups {list(runner.device_groups)} in one process each"
             if group_actors else "")

  def _actor_options(self, env: dict, n: int, host: str, resources: dict,
                     concurrency: int, who: str) -> dict[str, Any]:
    """Ray options of an actor with ``n`` devices on ``host`` (its GPUs, its host's resource
    when actors are pinned)."""
    out: dict[str, Any] = dict(num_cpus=0, max_concurrency=concurrency,
                               runtime_env={"env_vars": env})
    if self.gpu:
      out["num_gpus"] = n
    if self.pin:
      res = HOST_RESOURCE_PREFIX + host
      if res not in resources:
        raise HarpjaxError(f"{who} runs on host {host!r}, but no Ray node advertises the "
                           f"resource {res!r}; start each node with "
                           f"--resources='{{\"{res}\": 1}}' (docker/launch.sh) or pass "
                           "pin_hosts=False")
      out["resources"] = {res: 0.001}
    return out

  def _start_group_workers(self, specs, resources) -> None:
    """Starts and builds an actor for each group of a mixed-type stage that runs in a process
    of its own (one call at a time: the stage's actor relies on their order)."""
    opts = self.options
    cls = ray.remote(GroupWorker)
    builds = []
    for spec in specs:
      split = spec.lowered.layout.splits.get(spec.stage)
      for g in spec.remote_groups:
        n = split.groups[g].num_devices
        host = self.group_hosts[(spec.stage, g)]
        env = _actor_env(n, self.gpu, dict(opts.actor_env or {}))
        actor_opts = self._actor_options(env, n, host, resources, 1,
                                         f"group {g} of stage {spec.stage}")
        actor = cls.options(**actor_opts).remote()
        self.group_actors.setdefault(spec.stage, {})[g] = actor
        builds.append((spec.stage, actor.build.remote(spec, g)))
    for s, ref in builds:
      self._get([ref], opts.start_timeout_s, s, "starting a group of its devices")
    if builds:
      log.info("started %d actors for groups of mixed-type stages %s", len(builds),
               sorted(self.group_actors))

  def _join_groups(self, runner: PipelineRunner, stages: list[int]) -> None:
    """Starts each group's ``jax.distributed`` world: the coordinator on the leader, at its
    address on the NIC the cluster model picks between the group's first two hosts (loopback
    when all members run on one machine)."""
    timeout = self.options.start_timeout_s
    calls = {}
    for s in stages:
      members = self.actors[s]
      infos = self._get([m.info.remote() for m in members], timeout, s, "starting")
      hosts = [h for h, _ in runner.host_groups[s]]
      if len({i["hostname"] for i in infos}) == 1:
        ip = transport.LOOPBACK
      else:
        link = runner.cluster.link_between_hosts(hosts[0], hosts[1])
        addrs = transport.normalize_addresses(self.options.nic_addresses)
        nic = link.src_nic.name if link.src_nic is not None else None
        ip = (addrs.get((hosts[0], nic)) or infos[0]["interfaces"].get(nic)
              or socket.gethostbyname(infos[0]["hostname"]))
      port = self._get([members[0].free_port.remote(ip)], timeout, s, "starting")[0]
      coordinator = f"{ip}:{port}"
      calls[s] = [m.join_group.remote(coordinator, len(members), r, timeout)
                  for r, m in enumerate(members)]
      log.info("stage %d: %d processes on %s join the group at %s", s, len(members),
               ", ".join(hosts), coordinator)
    for s, refs in calls.items():
      self._get(refs, timeout + 30, s, "forming its group of processes")

  def _get(self, refs, timeout_s: float, stage: int, what: str) -> list:
    try:
      return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
      raise RuntimeFailure(f"stage {stage}: {what} did not finish within {timeout_s:g} s") \
          from None
    except ray.exceptions.RayActorError as e:
      raise RuntimeFailure(f"the actor of stage {stage} died while {what}: "
                           f"{str(e).strip().splitlines()[0]}") from None
    except ray.exceptions.RayTaskError as e:
      cause = getattr(e, "cause", None)
      raise (cause if isinstance(cause, BaseException) else e) from None

  def build_args(self, spec) -> tuple:
    if not spec.remote_groups:
      return (spec,)
    clients = {g: GroupClient(a, spec.stage, g, self.options.recv_timeout_s)
               for g, a in self.group_actors[spec.stage].items()}
    return (spec, None, clients)

  def single_machine(self, infos) -> bool:
    me = socket.gethostname()
    return all(info["hostname"] == me for info in infos)

  def same_process(self, a: int, b: int) -> bool:
    g = self.device_group.get(a)
    return g is not None and g == self.device_group.get(b)

  def _invoke(self, stage: int, actor, method: str, *args):
    if stage in self.device_group:
      return actor.call.remote(stage, method, *args)
    return getattr(actor, method).remote(*args)

  def submit(self, stage: int, method: str, *args):
    return _Call([self._invoke(stage, a, method, *args) for a in self.actors[stage]])

  def wait_any(self, pending: dict, timeout_s: float):
    owner = {ref: (s, r) for s, call in pending.items() for r, ref in enumerate(call.refs)
             if r not in call.values}
    ready, _ = ray.wait(list(owner), num_returns=1, timeout=max(timeout_s, 0.0))
    if ready:   # collect every other result that is ready too
      ready, _ = ray.wait(list(owner), num_returns=len(owner), timeout=0)
    failed: dict[int, BaseException] = {}
    for ref in ready:
      s, r = owner[ref]
      ok, value = self._result(ref, s, r, len(pending[s].refs))
      if ok:
        pending[s].values[r] = value
      else:
        failed.setdefault(s, value)
    out = []
    for s, call in pending.items():
      if s in failed:
        self.healthy = False
        out.append((s, False, failed[s]))
      elif len(call.values) == len(call.refs):
        out.append((s, True, call.values[0]))
    return out

  def _result(self, ref, s: int, rank: int, size: int):
    who = f"stage {s}" if size == 1 else f"stage {s} (process {rank} of {size})"
    try:
      return True, ray.get(ref, timeout=_WAIT_GET_S)
    except ray.exceptions.RayTaskError as e:
      cause = getattr(e, "cause", None)
      return False, cause if isinstance(cause, BaseException) else e
    except ray.exceptions.RayActorError as e:
      return False, RuntimeFailure(f"the actor of {who} died: "
                                   f"{str(e).strip().splitlines()[0]}")
    except ray.exceptions.GetTimeoutError:
      return False, RuntimeFailure(f"{who}: result not retrievable in {_WAIT_GET_S:g} s")
    except Exception as e:  # pylint: disable=broad-except
      return False, e

  def abort(self, stage: int, reason: str, step: int | None = None) -> None:
    self.healthy = False
    for a in self.actors[stage]:
      try:
        self._invoke(stage, a, "abort", reason, step)
      except Exception:  # pylint: disable=broad-except  (a dead actor cannot be aborted)
        pass

  def local_channel(self, dst: int):
    if dst not in self.device_group:
      raise HarpjaxError("only the stages of one device group share a Ray actor's process")
    return ("local", dst)   # the worker puts the message in dst's mailbox

  def object_store_channel(self, dst: int):
    return ObjectStoreChannel(self.actors[dst][0], dst, self.options.recv_timeout_s,
                              grouped=dst in self.device_group)

  def kill(self, stage: int, rank: int = 0) -> None:
    self.healthy = False
    ray.kill(self.actors[stage][rank], no_restart=True)

  def alive(self, stage: int) -> bool:
    """Whether every actor of the stage answers within a few seconds."""
    try:
      ray.get([a.ping.remote() for a in self.actors[stage]]
              + [a.ping.remote() for a in self.group_actors.get(stage, {}).values()],
              timeout=_PING_S)
      return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
      return False

  def shutdown(self) -> None:
    """Returns healthy single-process actors to the pool (reset), kills the others."""
    actors, keys, self.actors, self.keys = self.actors, self.keys, [], []
    group_actors, self.group_actors = self.group_actors, {}
    if not actors or not ray.is_initialized():
      return
    actors = actors + [list(g.values()) for g in group_actors.values()]
    self.device_group = {}
    keep = []
    if self.healthy:
      single = [(m[0], k) for m, k in zip(actors, keys) if k is not None]
      try:
        ray.get([a.reset.remote() for a, _ in single], timeout=10.0)
        keep = single
      except Exception:  # pylint: disable=broad-except
        keep = []
    kept = set()
    with _POOL_LOCK:
      for a, k in keep:
        if sum(len(v) for v in _POOL.values()) < _POOL_MAX:
          _POOL.setdefault(k, []).append(a)
          kept.add(id(a))
    for a in (a for members in actors for a in members):
      if id(a) in kept:
        continue
      try:
        ray.kill(a, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass


def _group_env(runner, stage: int) -> dict[str, str]:
  """NCCL settings for a group's collectives: the NIC the cluster model picks between the
  stage's hosts (documented, not exercised here: no GPU)."""
  hosts = [h for h, _ in runner.host_groups[stage]]
  return transport.nccl_env(runner.cluster.link_between_hosts(hosts[0], hosts[1]))


def _group_hosts(cluster, s: int, g: int, group) -> str:
  """The host of group ``g`` of mixed-type stage ``s`` (a group spans one host)."""
  hosts = list(dict.fromkeys(cluster.host_of_device(d).name for d in group.devices))
  if len(hosts) > 1:
    raise UnsupportedError(
        f"group {g} of stage {s} ({group.subcluster} {group.submesh}) spans the hosts "
        f"{', '.join(hosts)}; a group of a mixed-type stage runs in one process, so its devices "
        "must share a host: use submeshes (1, m) for the groups")
  return hosts[0]


def _check_placement(runner, pin: bool, gpu: bool, split: frozenset,
                     remote_groups: dict | None = None) -> None:
  """Clear errors for plans the actors cannot be placed for, warnings for mismatched nodes."""
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  remote_groups = remote_groups or {}
  for s, st in enumerate(runner.program.plan.stages):
    groups = runner.host_groups[s]
    if st.mixed:
      remote = set(remote_groups.get(s, ()))
      if not (pin or gpu or remote):
        continue   # one process holds every group (fake devices on one machine)
      hosts = [_group_hosts(runner.cluster, s, g, grp) for g, grp in enumerate(st.all_groups)]
      away = [g for g in range(1, len(hosts)) if hosts[g] != hosts[0] and g not in remote]
      if (pin or gpu) and away:
        raise UnsupportedError(
            f"stage {s} runs groups {away} on other hosts than its first group "
            f"({', '.join(hosts)}) but group_processes=False runs them in the stage's process: "
            "allow group_processes (an actor per such group), or, on one machine with fake "
            "devices, pass pin_hosts=False")
      if gpu:
        most = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
        local = sum(g.num_devices for i, g in enumerate(st.all_groups) if i not in remote)
        need = max([local] + [st.all_groups[g].num_devices for g in remote])
        if need > most:
          raise UnsupportedError(f"stage {s} needs {need} GPUs in one process, but no Ray "
                                 f"node has more than {most:g}")
      if pin:
        for g, grp in enumerate(st.all_groups):
          _check_gpu_type(runner, nodes, s, hosts[g], grp.subcluster)
      continue
    if (pin or gpu) and len(groups) > 1 and s not in split:
      raise UnsupportedError(
          f"stage {s} spans {len(groups)} hosts (submesh {st.submesh}) but spmd_hosts=False "
          "runs each stage in one process: allow spmd_hosts (one process per host, joined "
          "by jax.distributed), or use single-host submeshes (1, m); on one machine with fake "
          "devices, pin_hosts=False runs it in one process")
    if gpu:
      most = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
      need = max(len(d) for _, d in groups) if s in split else st.num_devices
      if need > most:
        raise UnsupportedError(f"stage {s} needs {need} GPUs in one process, but no Ray "
                               f"node has more than {most:g}")
    if pin:
      for host, _ in groups:
        _check_gpu_type(runner, nodes, s, host, st.subcluster)


def _check_device_groups(runner, split: frozenset, mixed: set) -> None:
  """A device group's stages run in one process: refuses what that process cannot hold."""
  for stages in runner.device_groups:
    wide = [s for s in stages if s in split]
    if wide:
      raise UnsupportedError(
          f"stages {list(stages)} share a device group that spans the hosts "
          f"{', '.join(h for h, _ in runner.host_groups[stages[0]])}; the Ray runtime runs a "
          "device group's stages in one process, not as one SPMD program over several hosts: "
          "use single-host submeshes (1, m) for an interleaved schedule, or, on one machine "
          "with fake devices, pass spmd_hosts=False")
    split_stages = [s for s in stages if s in mixed]
    if split_stages:
      raise UnsupportedError(
          f"stages {split_stages} of device group {list(stages)} split their rows among "
          "groups of several GPU types; the Ray runtime does not run mixed-type stages that "
          "share a device group: give them one GPU type each, or run the plan with "
          "harpjax.LocalRuntime()")


def _check_gpu_type(runner, nodes, s: int, host: str, subcluster: str) -> None:
  want = GPU_TYPE_RESOURCE_PREFIX + runner.cluster.subcluster(subcluster).gpu.name
  for n in nodes:
    res = n["Resources"]
    if HOST_RESOURCE_PREFIX + host in res:
      types = [k for k in res if k.startswith(GPU_TYPE_RESOURCE_PREFIX)]
      if types and want not in types:
        log.warning("stage %d: host %s advertises %s but the cluster file says %s",
                    s, host, types, want)


class GroupClient:
  """Reaches a :class:`~harpjax.runtime.group_worker.GroupWorker` actor from its stage's actor
  (the ``client`` of :class:`~harpjax.compiler.stages.split.RemoteGroup`); every wait bounded
  by ``timeout_s``, a failure a :class:`~harpjax.errors.RuntimeFailure` naming the group."""

  def __init__(self, actor, stage: int, group: int, timeout_s: float):
    self.actor, self.stage, self.group, self.timeout_s = actor, stage, group, timeout_s

  def submit(self, method: str, *args):
    """Calls the worker's ``method``; the arrays in tuple arguments cross encoded
    (:func:`harpjax.runtime.codec.encode`)."""
    args = [tuple(codec.encode(x) for x in a) if isinstance(a, tuple) else a for a in args]
    return getattr(self.actor, method).remote(*args)

  def wait(self, ref):
    """The call's value (a tuple of arrays comes back decoded)."""
    who = f"stage {self.stage}: group {self.group}"
    try:
      value = ray.get(ref, timeout=self.timeout_s)
      return tuple(codec.decode(e) for e in value) if isinstance(value, tuple) else value
    except ray.exceptions.GetTimeoutError:
      raise RuntimeFailure(f"{who} did not answer within {self.timeout_s:g} s") from None
    except ray.exceptions.RayActorError as e:
      raise RuntimeFailure(f"{who}: its actor died: {str(e).strip().splitlines()[0]}") \
          from None
    except ray.exceptions.RayTaskError as e:
      cause = getattr(e, "cause", None)
      raise RuntimeFailure(f"{who} failed: {cause!r}") from None


def release_pool() -> None:
  """Kills the idle actor processes kept for reuse."""
  with _POOL_LOCK:
    idle = [a for v in _POOL.values() for a in v]
    _POOL.clear()
  for a in idle:
    try:
      ray.kill(a, no_restart=True)
    except Exception:  # pylint: disable=broad-except
      pass
