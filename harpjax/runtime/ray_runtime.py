"""The Ray runtime: one Ray actor per pipeline stage (``auto_parallel(..., runtime="ray")``).

This is the only module of harpjax that imports Ray. The stage worker
(:class:`~harpjax.runtime._worker.StageWorker`) is a plain class, made an actor here at launch;
the driver logic (steps, state handles, gather/save, emulation, simulator comparison) is
:class:`~harpjax.runtime._runner.PipelineRunner`. Every ``ray.get`` has a timeout, and a failed
or killed actor surfaces as a :class:`~harpjax.errors.RuntimeFailure` naming its stage.

Actors. Each actor gets the environment its stage needs: on a CPU-only Ray cluster (this
machine) ``XLA_FLAGS=--xla_force_host_platform_device_count=<stage devices>`` and
``JAX_PLATFORMS=cpu``, so its process has the stage's devices as fake CPU devices; on a GPU
cluster it asks Ray for the stage's GPUs (``num_gpus``), which become its JAX devices. With
``pin_hosts`` each actor is placed on the Ray node that advertises the custom resource
``harpjax_host:<host name>`` (``docker/launch.sh`` starts nodes that way), so that the cluster
file's hosts are the machines that run them. Actors are threaded (``max_concurrency``): the step
runs in one thread while messages (object-store channel), aborts and fetches arrive in others.

Usage::

    step = harpjax.auto_parallel(train_step, cluster=..., plan=..., runtime="ray",
                                 runtime_options={"emulation": Emulation(time_scale=0.05)})
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

from harpjax.errors import HarpjaxError, RuntimeFailure, UnsupportedError
from harpjax.runtime import transport
from harpjax.runtime._handles import RemoteArray, gather, load_tree, save_tree
from harpjax.runtime._measure import MeasuredStep
from harpjax.runtime._runner import PipelineRunner, RunnerOptions, ThreadBackend
from harpjax.runtime._worker import StageWorker

log = logging.getLogger(__name__)

__all__ = ["RayRunner", "RunnerOptions", "RemoteArray", "MeasuredStep", "gather", "save_tree",
           "load_tree", "ObjectStoreChannel", "HOST_RESOURCE_PREFIX", "init_ray", "release_pool"]

HOST_RESOURCE_PREFIX = "harpjax_host:"
"""Custom Ray resource a node advertises for each cluster host it is (value 1)."""

GPU_TYPE_RESOURCE_PREFIX = "harpjax_gpu:"
"""Custom Ray resource a node advertises for its GPU type (value: its GPU count)."""

_WAIT_GET_S = 30.0   # ray.get of a result ray.wait reported ready


class RayRunner(PipelineRunner):
  """Runs a compiled step on one Ray actor per stage.

  Built by :meth:`harpjax.ParallelStep.runner` (``runtime="ray"``); the keyword options are
  ``auto_parallel``'s ``runtime_options``, see
  :class:`~harpjax.runtime._runner.RunnerOptions` (``address``, ``emulation``, ``transport``,
  ``nic_addresses``, ``fetch``, timeouts, ...).

  Args:
    parallel_step: the :class:`harpjax.ParallelStep`.
    compiled: its :class:`~harpjax.compiler.compile.CompiledStep` for these argument shapes.
    example_args: the step's arguments (arrays, ``ShapeDtypeStruct`` or handles).
    **options: :class:`~harpjax.runtime._runner.RunnerOptions` fields.

  Raises:
    PlanError: an unknown or invalid option.
    RuntimeFailure: an actor could not start, compile or connect in ``start_timeout_s``.
  """

  def __init__(self, parallel_step, compiled, example_args, **options):
    opts = RunnerOptions.from_kwargs(options)
    backend = ThreadBackend(opts) if opts.backend == "threads" else RayBackend(opts)
    super().__init__(parallel_step, compiled, example_args, backend, opts)


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


class ObjectStoreChannel(transport.Channel):
  """The fallback channel: the sender thread hands the message to the receiving actor's
  ``deliver`` method through the Ray object store, waiting (bounded) for it to be filed."""
  remote = True

  def __init__(self, actor, dst: int, timeout_s: float):
    self.actor, self.dst, self.timeout_s = actor, dst, timeout_s

  def send(self, step, key, src, payload):
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


class RayBackend:
  """Starts and calls one Ray actor per stage (see the module docstring)."""

  def __init__(self, options: RunnerOptions):
    self.options = options
    self.actors: list = []
    self.keys: list[tuple] = []
    self.healthy = True

  def start(self, runner: PipelineRunner, specs) -> None:
    opts = self.options
    init_ray(opts.address, opts.num_cpus or max(2, len(specs) + 1), **dict(opts.ray_init or {}))
    resources = ray.cluster_resources()
    gpu = resources.get("GPU", 0) > 0
    pin = opts.pin_hosts
    if pin is None:
      pin = any(k.startswith(HOST_RESOURCE_PREFIX) for k in resources)
    _check_placement(runner, specs, pin, gpu)
    cls = ray.remote(StageWorker)
    reused = 0
    for spec in specs:
      n = spec.plan.stages[spec.stage].num_devices
      env = _actor_env(n, gpu, opts.actor_env)
      actor_opts: dict[str, Any] = dict(num_cpus=0, max_concurrency=16,
                                        runtime_env={"env_vars": env})
      if gpu:
        actor_opts["num_gpus"] = n
      if pin:
        res = HOST_RESOURCE_PREFIX + spec.host
        if res not in resources:
          raise HarpjaxError(f"stage {spec.stage} runs on host {spec.host!r}, but no Ray node "
                             f"advertises the resource {res!r}; start each node with "
                             f"--resources='{{\"{res}\": 1}}' (docker/launch.sh) or pass "
                             "pin_hosts=False")
        actor_opts["resources"] = {res: 0.001}
      key = (tuple(sorted(env.items())), actor_opts.get("num_gpus", 0),
             tuple(sorted(actor_opts.get("resources", {}).items())))
      with _POOL_LOCK:
        idle = _POOL.get(key)
        actor = idle.pop() if idle else None
      if actor is None:
        actor = cls.options(**actor_opts).remote()
      else:
        reused += 1
      self.actors.append(actor)
      self.keys.append(key)
    log.info("launched %d stage actors (%d reused; %s devices%s)", len(specs), reused,
             "GPU" if gpu else "CPU", ", pinned to hosts" if pin else "")

  def build_args(self, spec) -> tuple:
    return (spec,)

  def single_machine(self, infos) -> bool:
    me = socket.gethostname()
    return all(info["hostname"] == me for info in infos)

  def same_process(self, a: int, b: int) -> bool:
    return False

  def submit(self, stage: int, method: str, *args):
    return getattr(self.actors[stage], method).remote(*args)

  def wait_any(self, pending: dict, timeout_s: float):
    refs = {ref: s for s, ref in pending.items()}
    ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(timeout_s, 0.0))
    if ready:   # collect every other result that is ready too
      ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    out = []
    for ref in ready:
      s = refs[ref]
      try:
        out.append((s, True, ray.get(ref, timeout=_WAIT_GET_S)))
        continue
      except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        err = cause if isinstance(cause, BaseException) else e
      except ray.exceptions.RayActorError as e:
        err = RuntimeFailure(f"the actor of stage {s} died: {str(e).strip().splitlines()[0]}")
      except ray.exceptions.GetTimeoutError:
        err = RuntimeFailure(f"stage {s}: result not retrievable in {_WAIT_GET_S:g} s")
      except Exception as e:  # pylint: disable=broad-except
        err = e
      self.healthy = False
      out.append((s, False, err))
    return out

  def abort(self, stage: int, reason: str) -> None:
    self.healthy = False
    try:
      self.actors[stage].abort.remote(reason)
    except Exception:  # pylint: disable=broad-except  (a dead actor cannot be aborted)
      pass

  def local_channel(self, dst: int):
    raise HarpjaxError("stages on Ray actors never share a process")

  def object_store_channel(self, dst: int):
    return ObjectStoreChannel(self.actors[dst], dst, self.options.recv_timeout_s)

  def kill(self, stage: int) -> None:
    self.healthy = False
    ray.kill(self.actors[stage], no_restart=True)

  def shutdown(self) -> None:
    """Returns healthy actors to the pool (reset), kills the others."""
    actors, keys, self.actors, self.keys = self.actors, self.keys, [], []
    if not actors or not ray.is_initialized():
      return
    keep = []
    if self.healthy:
      refs = [a.reset.remote() for a in actors]
      try:
        ray.get(refs, timeout=10.0)
        keep = list(zip(actors, keys))
      except Exception:  # pylint: disable=broad-except
        keep = []
    with _POOL_LOCK:
      for a, k in keep:
        idle = _POOL.setdefault(k, [])
        if sum(len(v) for v in _POOL.values()) < _POOL_MAX:
          idle.append(a)
          actors = [x for x in actors if x is not a]
    for a in actors:
      try:
        ray.kill(a, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass


def _check_placement(runner, specs, pin: bool, gpu: bool) -> None:
  """Clear errors for plans the actors cannot be placed for, warnings for mismatched nodes."""
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  for spec in specs:
    st = spec.plan.stages[spec.stage]
    if (pin or gpu) and st.submesh[0] > 1:
      raise UnsupportedError(
          f"stage {spec.stage} spans {st.submesh[0]} hosts (submesh {st.submesh}); the Ray "
          "runtime runs each stage in one process, and a stage over several hosts' processes "
          "(one SPMD program) is not supported yet: use single-host submeshes (1, m) on a "
          "real cluster (on one machine with fake devices, pin_hosts=False runs it)")
    if gpu:
      most = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
      if st.num_devices > most:
        raise UnsupportedError(f"stage {spec.stage} needs {st.num_devices} GPUs in one "
                               f"process, but no Ray node has more than {most:g}")
    if pin:
      want = GPU_TYPE_RESOURCE_PREFIX + runner.cluster.subcluster(st.subcluster).gpu.name
      for n in nodes:
        res = n["Resources"]
        if HOST_RESOURCE_PREFIX + spec.host in res:
          types = [k for k in res if k.startswith(GPU_TYPE_RESOURCE_PREFIX)]
          if types and want not in types:
            log.warning("stage %d: host %s advertises %s but the cluster file says %s",
                        spec.stage, spec.host, types, want)


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
