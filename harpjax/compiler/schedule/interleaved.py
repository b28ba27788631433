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
"""

from __future__ import annotations

from harpjax.compiler.schedule.tasks import (dry_run_groups, GroupTables, StageTask, Tables,
                                             table_warmups, tables_from_groups)
from harpjax.compiler.schedule.warmup import check_positive
from harpjax.errors import ScheduleError

__all__ = ["interleaved_group_tables", "interleaved_tables", "interleaved_warmups",
           "group_warmups", "num_groups_of", "group_of_stage", "group_activation_peaks"]


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
