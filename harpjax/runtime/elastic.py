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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from harpjax.errors import HarpjaxError

__all__ = ["ElasticOptions", "Failure", "Recovery"]

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
      raise HarpjaxError(f"ElasticOptions.policy={self.policy!r}: choose one of {POLICIES} or "
                         "pass a callable taking a harpjax Failure")
    if not isinstance(self.max_recoveries, int) or self.max_recoveries < 0:
      raise HarpjaxError(f"ElasticOptions.max_recoveries={self.max_recoveries!r}: a count >= 0")

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
    raise HarpjaxError(f"the elastic policy answered {answer!r}; it must return 'shrink', "
                       "'stop' or a harpjax.Cluster")


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
