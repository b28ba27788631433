"""Elastic recovery as the runtime's phase: ``runtime.Elastic`` against a driver of fakes.

The end-to-end recoveries (Ray actors killed, float64 against ``jax.jit``) are in
``tests/faults``; here the bookkeeping alone: which checkpoint is restored, which steps are
replayed, what the policy sees, and that the result equals the steps run without failure.
"""

import numpy as np
import pytest

from harpjax.errors import RuntimeFailure
from harpjax.runtime import CheckpointOptions, Elastic, ElasticOptions


class FakeCluster:
  def __init__(self, hosts):
    self.hosts = tuple(hosts)
    self.num_devices = 2 * len(self.hosts)
    self.subclusters = ()

  def without_hosts(self, lost):
    return FakeCluster(h for h in self.hosts if h not in lost)


class FakeRunner:
  def __init__(self, lost):
    self.lost, self.shut = lost, False

  def lost_hosts(self):
    return list(self.lost)

  def shutdown(self):
    self.shut = True


class FakeCheckpointer:
  def __init__(self):
    self.saved = {}

  def save(self, step, state):
    self.saved[step] = np.array(state)

  def restore_newest(self, like):
    if not self.saved:
      return None
    k = max(self.saved)
    return k, self.saved[k]


class FakeDriver:
  """A step ``state + batch`` whose workers on host ``"b"`` die at call ``fail_at``."""

  def __init__(self, every, fail_at):
    self.steps_done, self.cluster = 0, FakeCluster(["a", "b", "c"])
    self.checkpointer, self.every, self.fail_at = FakeCheckpointer(), every, fail_at
    self.calls, self.prepared, self.runner = 0, [], FakeRunner(["b"])

  def call_once(self, args):
    self.calls += 1
    if self.calls == self.fail_at:
      raise RuntimeFailure("step failed on stage 1 (host b): the actor died")
    state, batch = args
    out = (np.asarray(state) + batch, float(batch))
    done = self.steps_done + 1
    if done % self.every == 0:
      self.checkpointer.save(done, out[0])
    self.steps_done = done
    return out

  def runners(self):
    return [self.runner]

  def move_to(self, cluster):
    self.cluster = cluster

  def prepare(self, args, until):
    self.prepared.append(until)


@pytest.mark.parametrize("every, fail_at, replayed", [(2, 6, 1), (3, 5, 1), (10, 4, 3)])
def test_recovery_restores_replays_and_equals_the_steps_without_failure(every, fail_at,
                                                                        replayed):
  driver = FakeDriver(every, fail_at)
  seen = []

  def policy(failure):
    seen.append(failure)
    return "shrink"

  elastic = Elastic(ElasticOptions(policy=policy), CheckpointOptions("unused", every=every))
  state, batches = np.zeros(()), [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
  for b in batches:
    state, _ = elastic(driver, (state, b))
  assert float(state) == sum(batches) and driver.steps_done == len(batches)
  (failure,) = seen
  assert failure.step == fail_at   # every call before it succeeded
  assert failure.lost_hosts == ("b",) and driver.runner.shut
  assert driver.cluster.hosts == ("a", "c") and driver.prepared == ["layout", "run"]
  (rec,) = elastic.recoveries
  assert rec.replayed == replayed and rec.lost_hosts == ("b",) and rec.num_devices == 4


def test_stop_policy_and_the_recovery_limit_reraise():
  driver = FakeDriver(every=1, fail_at=2)
  elastic = Elastic(ElasticOptions(policy="stop"), CheckpointOptions("unused"))
  elastic(driver, (np.zeros(()), 1.0))
  with pytest.raises(RuntimeFailure, match="actor died"):
    elastic(driver, (np.ones(()), 1.0))
  driver = FakeDriver(every=1, fail_at=2)
  elastic = Elastic(ElasticOptions(max_recoveries=0), CheckpointOptions("unused"))
  elastic(driver, (np.zeros(()), 1.0))
  with pytest.raises(RuntimeFailure, match="actor died"):
    elastic(driver, (np.ones(()), 1.0))
  assert not elastic.recoveries
