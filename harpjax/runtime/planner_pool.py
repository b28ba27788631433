"""The planner's Ray pool: ``solve(..., backend="ray")`` evaluates candidate batches on actors.

Registered with :func:`harpjax.compiler.plan.register_parallel_backend` when
:mod:`harpjax.runtime` is imported (which ``import harpjax`` does), so that the planner itself
never imports Ray. Ray is imported only when the backend runs.
"""

from __future__ import annotations

from harpjax.compiler.plan import evaluate_candidates, register_parallel_backend
from harpjax.errors import RuntimeFailure

__all__ = ["run_on_ray"]


class DPWorker:
  """Plain class; wrapped as a Ray actor at launch (holds the index, evaluates batches)."""

  def __init__(self, index):
    self._index = index

  def run(self, *args):
    return evaluate_candidates(self._index, *args)


def run_on_ray(index, batches, args, workers: int, timeout_s: float) -> list:
  """Per batch, ``evaluate_candidates(index, batch, *args)`` on up to ``workers`` actors of a
  local Ray instance (started and stopped here unless Ray is already initialised)."""
  import ray  # noqa: PLC0415 - only when this backend runs

  owned = not ray.is_initialized()
  if owned:
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
  actors, outs = [], []
  try:
    actor_cls = ray.remote(num_cpus=1)(DPWorker)
    ref = ray.put(index)
    actors = [actor_cls.remote(ref) for _ in range(min(workers, len(batches)))]
    futs = [actors[n % len(actors)].run.remote(b, *args) for n, b in enumerate(batches)]
    for n, f in enumerate(futs):
      try:
        outs.append(ray.get(f, timeout=timeout_s))
      except ray.exceptions.GetTimeoutError:
        raise RuntimeFailure(f"planner actor {n % len(actors)} (batch {n} of {len(batches)}) "
                             f"timed out after {timeout_s} s") from None
  finally:
    for a in actors:
      ray.kill(a)
    if owned:
      ray.shutdown()
  return outs


register_parallel_backend("ray", run_on_ray)
