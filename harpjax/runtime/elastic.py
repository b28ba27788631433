"""Elastic training: after a lost worker or host, re-plan on what is left and continue.

With ``auto_parallel(..., runtime="ray", checkpoint=..., elastic=ElasticOptions(...))`` a step
that fails because a stage's worker died is recovered inside the call that failed:

1. **detect**: the driver probes every worker; the hosts of the stages that do not answer are
   lost (:meth:`~harpjax.runtime.runner.PipelineRunner.lost_hosts`);
2. **decide**: the policy sees a :class:`Failure` and answers ``"shrink"`` (drop the lost
   hosts), ``"stop"`` (re-raise), or a :class:`~harpjax.cluster.Cluster` to continue on (the
   repaired cluster after waiting for a node, a new one);
3. **re-plan** on that cluster: tracing is redone (cheap), the profile of GPU types that
   survive comes from the profile cache, only the search runs again;
4. **restore** the newest checkpoint (plan-independent) and **replay** the steps taken since
   it (the step keeps their arguments), then run the failed call.

The result equals what the undecorated step gives for the same arguments: no step is lost or
taken twice. :class:`Recovery` reports the time of each part.

:class:`Elastic` does all of this; the step (:class:`harpjax.ParallelStep`) hands it each call
and offers the few things it needs (:class:`Driver`): run one step, the Ray runners, move to
another cluster, run the phases up to laying out or starting.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

import jax

from harpjax.errors import InvalidOptionError, RuntimeFailure
from harpjax.runtime.checkpoint import CheckpointOptions, Checkpointer
from harpjax.runtime.handles import RemoteArray

log = logging.getLogger(__name__)

__all__ = ["Driver", "Elastic", "ElasticOptions", "Failure", "Recovery"]

POLICIES = ("shrink", "stop")


@dataclasses.dataclass(frozen=True)
class Failure:
  """What the policy sees.

  Attributes:
    step: the call that failed (``steps_done + 1``).
    error: the runtime's error.
    lost_hosts: hosts whose workers no longer answer.
    cluster: the cluster the step ran on.
  """
  step: int
  error: BaseException
  lost_hosts: tuple[str, ...]
  cluster: Any


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
  """Recovery from lost workers (``auto_parallel(..., elastic=ElasticOptions())``).

  Attributes:
    policy: ``"shrink"`` (continue without the lost hosts), ``"stop"``, or a callable
      ``policy(Failure) -> "shrink" | "stop" | Cluster``.
    max_recoveries: recoveries allowed over the step's life; the next failure is raised.
  """
  policy: str | Callable = "shrink"
  max_recoveries: int = 3

  def __post_init__(self):
    if not callable(self.policy) and self.policy not in POLICIES:
      raise InvalidOptionError(f"ElasticOptions.policy={self.policy!r}: choose one of "
                               f"{POLICIES} or pass a callable taking a harpjax Failure")
    if isinstance(self.max_recoveries, bool) or not isinstance(self.max_recoveries, int) or \
        self.max_recoveries < 0:
      raise InvalidOptionError(f"ElasticOptions.max_recoveries={self.max_recoveries!r}: a "
                               "count >= 0")

  def decide(self, failure: Failure):
    """The policy's answer: ``"stop"``, or the cluster to continue on."""
    answer = self.policy(failure) if callable(self.policy) else self.policy
    if answer == "stop":
      return "stop"
    if answer == "shrink":
      if not failure.lost_hosts:
        return "stop"   # nothing was lost: the failure is not the cluster's
      return failure.cluster.without_hosts(failure.lost_hosts)
    if hasattr(answer, "subclusters"):
      return answer
    raise InvalidOptionError(f"ElasticOptions.policy answered {answer!r}; it must return "
                             "'shrink', 'stop' or a harpjax.Cluster")


@dataclasses.dataclass(frozen=True)
class Recovery:
  """One recovery, its parts in seconds.

  Attributes:
    failed_step: the call that failed.
    lost_hosts: hosts dropped (empty when the policy gave a cluster).
    num_devices: devices of the cluster continued on.
    detect_s: from the start of the failing attempt to its error, and probing the workers.
    replan_s: trace, plan (profile from the cache, search) and layout on the new cluster.
    start_s: starting the workers and compiling their stages.
    restore_s: reading the checkpoint.
    replay_s: the steps since the checkpoint, run again.
    step_s: the failed call, run on the new plan (the first completed step after the failure).
    checkpoint_step: the checkpoint restored (0: the state passed to the first call).
    replayed: how many steps were replayed.
  """
  failed_step: int
  lost_hosts: tuple[str, ...]
  num_devices: int
  detect_s: float
  replan_s: float
  start_s: float
  restore_s: float
  replay_s: float
  step_s: float
  checkpoint_step: int
  replayed: int

  @property
  def total_s(self) -> float:
    """Failure to the next completed step."""
    return (self.detect_s + self.replan_s + self.start_s + self.restore_s + self.replay_s
            + self.step_s)


class Driver(Protocol):
  """What :class:`Elastic` needs of the step it recovers (:class:`harpjax.ParallelStep`)."""
  steps_done: int
  cluster: Any
  checkpointer: Checkpointer

  def call_once(self, args: tuple) -> Any:
    """One step: run it, checkpoint on schedule, count it."""

  def runners(self) -> list:
    """The Ray runners of the current cluster."""

  def move_to(self, cluster) -> None:
    """Forget the phases of the current cluster: the next call plans on ``cluster``."""

  def prepare(self, args: tuple, until: str) -> None:
    """Run the phases for ``args`` up to ``until`` (``"layout"`` or ``"run"``)."""


class Elastic:
  """Elastic recovery of one step (see the module docstring).

  It keeps the arguments of every call since the newest checkpoint (the state's slot empty)
  and the first call's state (a recovery before the first checkpoint starts from it); a
  recovery interrupted (Ctrl-C) after the workers were given up is resumed by the next call.

  Args:
    options: the :class:`ElasticOptions`.
    checkpoint: the step's :class:`~harpjax.runtime.checkpoint.CheckpointOptions`.
    state_argnum: the position of the training state among the step's arguments.
  """

  def __init__(self, options: ElasticOptions, checkpoint: CheckpointOptions,
               state_argnum: int = 0):
    self.options = options
    self.checkpoint = checkpoint
    self.state_argnum = state_argnum
    self.recoveries: list[Recovery] = []
    """Recoveries so far, each with its timings."""
    self._replay: dict[int, tuple] = {}   # step -> its arguments, the state's slot None
    self._origin: Any = None              # the first call's state, if it is plain arrays
    self._recovery: tuple | None = None   # (failed step, error, lost hosts, detect s) underway

  def __call__(self, driver: Driver, args: tuple):
    """One call of the step, recovered if its workers are lost."""
    argnum = self.state_argnum
    if self._origin is None and driver.steps_done == 0 and not any(
        isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(args[argnum])):
      self._origin = args[argnum]
    t_start = time.perf_counter()
    if self._recovery is not None:   # Ctrl-C interrupted a recovery: this call resumes it
      result = self._recover(driver, args, self._recovery[1], t_start)
    else:
      try:
        result = self._step(driver, args)
      except RuntimeFailure as err:
        if len(self.recoveries) >= self.options.max_recoveries:
          raise
        result = self._recover(driver, args, err, t_start)
    self._replay[driver.steps_done] = args[:argnum] + (None,) + args[argnum + 1:]
    return result

  def _step(self, driver: Driver, args: tuple):
    """One step; the arguments a new checkpoint covers are no longer kept."""
    result = driver.call_once(args)
    done, every = driver.steps_done, self.checkpoint.every
    if done % every == 0:
      for old in [k for k in self._replay if k <= done - every]:
        del self._replay[old]   # covered by the checkpoint before this one
    return result

  def _recover(self, driver: Driver, args: tuple, err: RuntimeFailure, t_start: float):
    """Re-plans after lost workers, restores, replays, and runs the failed call. Interrupted
    after the workers were given up, the next call takes it up from the restore."""
    argnum = self.state_argnum
    if self._recovery is None:
      failed = driver.steps_done + 1
      runners = driver.runners()
      lost = tuple(sorted({h for r in runners for h in r.lost_hosts()}))
      detect_s = time.perf_counter() - t_start   # the failing attempt, then the probes
      target = self.options.decide(Failure(failed, err, lost, driver.cluster))
      if target == "stop":
        raise err
      log.warning("step %d failed (%s); lost hosts %s: continuing on %d devices", failed,
                  str(err).splitlines()[0], list(lost) or "none", target.num_devices)
      for r in runners:
        try:
          r.shutdown()
        except Exception as e:  # noqa: BLE001 -- a broken runner may fail to shut down
          log.info("shutting down the failed runner: %s", e)
      driver.move_to(target)
      self._recovery = (failed, err, lost, detect_s)
    failed, err, lost, detect_s = self._recovery
    target = driver.cluster

    t1 = time.perf_counter()
    like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), args[argnum])
    found = driver.checkpointer.restore_newest(like)
    if found is not None:
      ck_step, state = found
    elif self._origin is not None:
      state, ck_step = self._origin, 0
    else:
      raise RuntimeFailure(f"{err}\nno checkpoint to recover from yet, and the first call's "
                           "state was not plain arrays") from err
    restore_s = time.perf_counter() - t1
    missing = [k for k in range(ck_step + 1, failed) if k not in self._replay]
    if missing:
      raise RuntimeFailure(f"{err}\ncannot replay steps {missing} after checkpoint "
                           f"{ck_step}") from err

    with_state = lambda a, st: a[:argnum] + (st,) + a[argnum + 1:]
    first = with_state(self._replay.get(ck_step + 1, args), state)
    t2 = time.perf_counter()
    driver.prepare(first, "layout")
    t3 = time.perf_counter()
    driver.prepare(first, "run")
    t4 = time.perf_counter()
    driver.steps_done = ck_step
    for k in range(ck_step + 1, failed):
      state = self.checkpoint.state_of(self._step(driver, with_state(self._replay[k], state)))
    t5 = time.perf_counter()
    result = self._step(driver, with_state(args, state))
    t6 = time.perf_counter()
    self._recovery = None
    self.recoveries.append(Recovery(failed, lost, target.num_devices, detect_s, t3 - t2,
                                    t4 - t3, restore_s, t5 - t4, t6 - t5, ck_step,
                                    failed - 1 - ck_step))
    log.warning("recovered in %.1f s: %s", self.recoveries[-1].total_s, self.recoveries[-1])
    return result
