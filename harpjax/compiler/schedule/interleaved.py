"""Interleaved 1F1B: several non-consecutive stages (model chunks) per device group.

The schedule of Megatron-LM (Narayanan et al., 2021) that Zorse's interleaved ministages run:
``d`` device groups, ``v`` model chunks per group, ``S = v d`` stages. Chunk ``c`` of group
``g`` is pipeline stage ``c d + g``, so a microbatch visits every group ``v`` times and the
pipeline's fill and drain shrink by about ``v`` (each task is a ``v``-th of a group's work).
Stages ``c d + g`` and ``(c + 1) d + g`` share group ``g``'s devices: a transfer between two
stages of one group never happens (consecutive stages are on consecutive groups, the last group
sending to the first between chunks).

Group ``g`` runs its ``v B`` forwards in the order: microbatches in blocks of ``d`` (the last
block may be shorter), each block through chunk ``0``, then chunk ``1``, ... ``v - 1``; its
backwards in the same order with the chunks reversed. It launches

    ``W_g = min(2 (d - 1 - g) + (v - 1) d, v B)``

forwards before its first backward (Megatron's warm-up), then alternates one forward and one
backward, then drains the rest. With ``B`` a multiple of
``d`` (Megatron's condition) the order never deadlocks; other ``B`` are accepted where the
order is still deadlock-free (checked), else refused with a named error.

What each chunk holds in flight (the microbatches whose residuals wait for their backward) is
its row's peak (:func:`~harpjax.compiler.schedule.peak_inflight`); a group holds at most the
sum over its chunks (:func:`group_activation_peaks`: the most its order holds at once), every
chunk's state, and the workspace of the one task it runs.

**Parameter offload** (Zorse's): the stages of a group that keep their parameters in host
memory (:attr:`~harpjax.compiler.plan.StageSpec.offload_params`) have them on the devices only
while the group runs them or is about to: :func:`chunk_residency` walks the group's order and
keeps the running stage's parameters and the next stage's (its prefetch, issued as the running
stage's first task of a run starts) and drops the rest; :func:`prefetch_stalls` is the time a
task waits for its parameters where the prefetch takes longer than the tasks it overlaps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from harpjax.compiler.schedule.tasks import (dry_run_groups, GroupTables, StageTask, Tables,
                                             table_warmups, tables_from_groups)
from harpjax.compiler.schedule.warmup import check_positive
from harpjax.errors import ScheduleError

__all__ = ["interleaved_group_tables", "interleaved_tables", "interleaved_warmups",
           "group_warmups", "num_groups_of", "group_of_stage", "group_activation_peaks",
           "ChunkResidency", "chunk_residency", "prefetch_stalls", "update_positions",
           "activations_after"]


def num_groups_of(num_stages: int, chunks: int) -> int:
  """``d = S / v``.

  Raises:
    ScheduleError: ``S`` is not a multiple of ``v``.
  """
  check_positive("num_stages", num_stages)
  check_positive("chunks", chunks)
  if num_stages % chunks:
    raise ScheduleError(f"an interleaved schedule with v={chunks} chunks per device group "
                        f"needs a multiple of {chunks} stages, not {num_stages}: change the "
                        "number of stages or of chunks")
  return num_stages // chunks


def group_of_stage(stage: int, num_stages: int, chunks: int) -> int:
  """The device group of a stage: ``stage mod d``."""
  return stage % num_groups_of(num_stages, chunks)


def group_warmups(num_groups: int, chunks: int, num_microbatches: int) -> tuple[int, ...]:
  """``[d]``: the forwards group ``g`` launches before its first backward, ``W_g``."""
  d, v, B = num_groups, chunks, num_microbatches
  return tuple(min(2 * (d - 1 - g) + (v - 1) * d, v * B) for g in range(d))


def _chunk_order(d: int, v: int, B: int, backward: bool) -> list[tuple[int, int]]:
  """``[(chunk, microbatch)]`` in the order a group runs its forwards (or backwards)."""
  out = []
  for lo in range(0, B, d):
    block = range(lo, min(lo + d, B))
    for c in (reversed(range(v)) if backward else range(v)):
      out.extend((c, m) for m in block)
  return out


def interleaved_group_tables(num_groups: int, chunks: int,
                             num_microbatches: int) -> GroupTables:
  """Per device group, the order of its chunks' tasks (:class:`StageTask`, stage
  ``c d + g``).

  Args:
    num_groups: ``d``.
    chunks: ``v``.
    num_microbatches: ``B``.
  """
  d, v, B = num_groups, chunks, num_microbatches
  for name, x in (("num_groups", d), ("chunks", v), ("num_microbatches", B)):
    check_positive(name, x)
  fwd, bwd = _chunk_order(d, v, B, False), _chunk_order(d, v, B, True)
  n = v * B
  groups = []
  for g, w in enumerate(group_warmups(d, v, B)):
    f = [StageTask(c * d + g, "F", m) for c, m in fwd]
    b = [StageTask(c * d + g, "B", m) for c, m in bwd]
    row = f[:w]
    for k in range(n - w):
      row += [f[w + k], b[k]]
    row += b[n - w:]
    groups.append(tuple(row))
  groups = tuple(groups)
  if B % d:
    try:
      dry_run_groups(groups)
    except ScheduleError:
      raise ScheduleError(
          f"the interleaved schedule with d={d} device groups, v={v} chunks and B={B} "
          f"microbatches deadlocks (its last block of {B % d} microbatches is short): use a "
          f"number of microbatches that is a multiple of {d}") from None
  return groups


def interleaved_tables(num_stages: int, num_microbatches: int, chunks: int) -> Tables:
  """Each stage's row of the interleaved schedule (its tasks in its group's order)."""
  d = num_groups_of(num_stages, chunks)
  return tables_from_groups(interleaved_group_tables(d, chunks, num_microbatches), num_stages)


def interleaved_warmups(num_stages: int, num_microbatches: int,
                        chunks: int) -> tuple[int, ...]:
  """``[S]``: the forwards each stage (chunk) runs before its first backward, in its row."""
  return table_warmups(interleaved_tables(num_stages, num_microbatches, chunks))


def group_activation_peaks(groups: GroupTables, act_bytes) -> tuple[float, ...]:
  """Per device group, the most activation bytes it holds at once in its order: a stage's
  ``act_bytes[s]`` from the start of ``F(s, m)`` to the end of ``B(s, m)``, summed over the
  group's stages (at most the sum of each stage's own peak, which may fall at other times).

  Args:
    groups: the group orders (:attr:`~harpjax.compiler.schedule.Schedule.groups`).
    act_bytes: ``[S]`` bytes one in-flight microbatch of each stage holds.
  """
  out = []
  for row in groups:
    cur = peak = 0.0
    for t in row:
      cur += float(act_bytes[t.stage]) if t.kind == "F" else -float(act_bytes[t.stage])
      peak = max(peak, cur)
    out.append(peak)
  return tuple(out)


def update_positions(order: Sequence[StageTask]) -> dict[int, int]:
  """Per stage of a group's order, the position of its last task, right after which its
  optimizer update runs (*interleaved updates*: inside the pipeline's drain, while the group's
  earlier stages still wait for their gradients)."""
  return {t.stage: p for p, t in enumerate(order)}


def activations_after(order: Sequence[StageTask], act_bytes) -> tuple[float, ...]:
  """Per position of a group's order, the activation bytes the group still holds once that
  task has ended (what an interleaved update there runs beside; see
  :func:`group_activation_peaks` for the accounting)."""
  cur, out = 0.0, []
  for t in order:
    cur += float(act_bytes[t.stage]) if t.kind == "F" else -float(act_bytes[t.stage])
    out.append(cur)
  return tuple(out)


# --------------------------------------------------------------------------- parameter offload


@dataclasses.dataclass(frozen=True)
class ChunkResidency:
  """Where the parameters of a group's offloaded stages are, task by task of its order.

  Attributes:
    resident: per position of the order, the offloaded stages whose parameters are on the
      devices while that task runs: the running stage's and, if offloaded, the next other
      stage's of the order (its prefetch); at most two.
    fetch: per position, the offloaded stages whose parameters are fetched to the devices as
      the task starts (its own at the first position; else the next stage's, prefetched
      while the task and the rest of its run compute).
    release: per position, the offloaded stages whose device copies are dropped once the task
      ends (parameters do not change during a step: the host copy is still theirs).
    needed_at: per position, for each stage in ``fetch``, the position of its first task
      (where it must be on the devices), in ``fetch``'s order.
  """
  resident: tuple[frozenset, ...]
  fetch: tuple[tuple[int, ...], ...]
  release: tuple[tuple[int, ...], ...]
  needed_at: tuple[tuple[int, ...], ...]

  def peak_bytes(self, param_bytes) -> float:
    """The most parameter bytes of offloaded stages on the devices at once (``param_bytes``:
    ``[S]`` per stage, or a mapping)."""
    return max((sum(float(param_bytes[s]) for s in r) for r in self.resident), default=0.0)


def chunk_residency(order: Sequence[StageTask], offloaded) -> ChunkResidency:
  """The parameter residency of one device group's order (see :class:`ChunkResidency`).

  Args:
    order: the group's tasks in order (:attr:`~harpjax.compiler.schedule.Schedule.groups`'
      entry).
    offloaded: the stages of the group that keep their parameters in host memory.
  """
  off = frozenset(int(s) for s in offloaded)
  n = len(order)
  stages = [t.stage for t in order]
  nxt: list[int | None] = [None] * n    # the next other stage after each position
  first: list[int] = [n] * n            # its first position
  after, at = None, n
  for i in range(n - 1, -1, -1):
    if i + 1 < n and stages[i + 1] != stages[i]:
      after, at = stages[i + 1], i + 1
    nxt[i], first[i] = after, at
  resident = [frozenset(s for s in (stages[i], nxt[i]) if s is not None and s in off)
              for i in range(n)]
  fetch, release, needed = [], [], []
  for i in range(n):
    before = resident[i - 1] if i else frozenset()
    later = resident[i + 1] if i + 1 < n else frozenset()
    new = [s for s in (stages[i], nxt[i]) if s in resident[i] and s not in before]
    fetch.append(tuple(new))
    needed.append(tuple(i if s == stages[i] else first[i] for s in new))
    release.append(tuple(sorted(resident[i] - later)))
  return ChunkResidency(tuple(resident), tuple(fetch), tuple(release), tuple(needed))


def prefetch_stalls(order: Sequence[StageTask], residency: ChunkResidency, task_s,
                    fetch_s) -> np.ndarray:
  """Per position of a group's order, the seconds its task waits for its parameters.

  The group's device-host link fetches one stage's parameters at a time, in the order they are
  asked for; a fetch is asked for as the task at its position starts and must end before the
  stage's first task. Only the excess over the tasks it overlaps shows (their durations; the
  waits between tasks hide more, so this is an upper bound where the group idles).

  Args:
    order: the group's tasks in order.
    residency: :func:`chunk_residency` of ``order``.
    task_s: ``[n]`` seconds of each task of the order.
    fetch_s: ``[S]`` (or a mapping) seconds to bring a stage's parameters to the devices
      (:func:`~harpjax.compiler.profile.param_fetch_time_s`).

  Returns:
    ``[n]`` seconds (``0`` where a task does not wait).
  """
  n = len(order)
  stall = np.zeros(n)
  clock, link = 0.0, 0.0
  due: dict[int, float] = {}
  for i in range(n):
    for s, j in zip(residency.fetch[i], residency.needed_at[i]):
      link = max(link, clock) + float(fetch_s[s])
      due[j] = max(due.get(j, 0.0), link)
    if i in due:
      wait = due.pop(i) - clock
      stall[i] = wait if wait > 0.0 else 0.0   # (not a number where times are infinite)
    clock += stall[i] + float(task_s[i])
  return stall
