"""What the stage workers record during a step, in the simulator's timeline form."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from harpjax.compiler.schedule import TimelineEvent
from harpjax.runtime.interpreter import ACT, CT

__all__ = ["MeasuredStep", "measured_step"]


@dataclasses.dataclass(frozen=True, eq=False)
class MeasuredStep:
  """What the workers recorded during one step. Times in seconds.

  Attributes:
    step: the step number.
    wall_s: the driver's time for the whole call.
    iteration_time: from the start of stage 0's first task to the end of the last task of
      any stage (the simulator's ``iteration_time`` without end-of-iteration costs).
    span_s: from the first worker starting the step to the last one finishing it.
    tasks: per stage, ``(kind, microbatch, start, end)`` relative to stage 0's first task.
    sends: per stage, ``(dst, key, start, end, nbytes)`` relative likewise.
    overruns: per stage, tasks whose real duration exceeded the emulated one.
    schedule: the schedule that ran (so that :mod:`harpjax.compiler.schedule.timeline` draws
      this like a :class:`~harpjax.compiler.schedule.SimResult`).
  """
  step: int
  wall_s: float
  iteration_time: float
  span_s: float
  tasks: tuple
  sends: tuple
  overruns: tuple
  schedule: Any = None

  @property
  def num_microbatches(self) -> int:
    return self.schedule.num_microbatches

  def events(self) -> list[TimelineEvent]:
    """Tasks and activation/gradient transfers between neighbouring stages, in the
    simulator's :class:`~harpjax.compiler.schedule.TimelineEvent` form
    (:mod:`harpjax.compiler.schedule.timeline` draws them)."""
    out = []
    for s, tasks in enumerate(self.tasks):
      for kind, m, a, b in tasks:
        out.append(TimelineEvent("stage", s, "", kind, m, a, b))
    for s, sends in enumerate(self.sends):
      for dst, key, a, b, _ in sends:
        if key.kind == ACT and dst == s + 1:
          out.append(TimelineEvent("link", s, "fwd", "A", key.index, a, b))
        elif key.kind == CT and dst == s - 1:
          out.append(TimelineEvent("link", dst, "bwd", "G", key.index, a, b))
    return out


def measured_step(step: int, wall_s: float, results: Sequence[dict], schedule) -> MeasuredStep:
  starts = [r["tasks"][0][2] for r in results if r["tasks"]]
  t0 = results[0]["tasks"][0][2] if results[0]["tasks"] else min(starts, default=0.0)
  ends = [t[3] for r in results for t in r["tasks"]]
  tasks = tuple(tuple((k, m, a - t0, b - t0) for k, m, a, b in r["tasks"]) for r in results)
  sends = tuple(tuple((d, key, a - t0, b - t0, n) for d, key, a, b, n in r["sends"])
                for r in results)
  span = max(r["end"] for r in results) - min(r["begin"] for r in results)
  return MeasuredStep(step, wall_s, (max(ends) - t0) if ends else 0.0, span, tasks, sends,
                      tuple(r["overruns"] for r in results), schedule)
