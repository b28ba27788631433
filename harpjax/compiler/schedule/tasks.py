"""Pipeline schedules as data.

A schedule is, for every stage, the ordered tuple of tasks it runs in one iteration: ``F3`` is
the forward pass of microbatch 3, ``B0`` the backward pass of microbatch 0. The local runtime,
the Ray runtime and the simulator all interpret these same tables; nothing else decides the
order of work.

Every 1F1B-style schedule is described by its per-stage *warm-up count* ``N_i``: stage ``i``
first launches ``N_i`` forward passes, then alternates one backward and one forward, then drains
the remaining backward passes. The schedules differ only in the counts (stages 0-indexed here,
``S`` stages):

* GPipe: ``N_i = B`` (all forwards, then all backwards);
* 1F1B: ``N_i = S - i`` (the paper's ``S - i + 1`` with 1-indexed stages);
* Eager-1F1B: ``N_i = 2 (S - 1 - i) + 1`` (the paper's ``2(S - i) + 1``, 1-indexed);
* H-1F1B (HARP Eq. 1-2): ``N_{S-1} = 1`` and ``N_i = N_{i+1} + delta_i`` where ``delta_i``
  grows with the communication cost ``c_i`` between stage ``i`` and ``i+1`` relative to
  ``t_max`` (:func:`~harpjax.compiler.schedule.warmup.warmup_delta`).

The counts are computed in :mod:`harpjax.compiler.schedule.warmup`; each named schedule, with
its rule and its tables, is registered once in :mod:`harpjax.compiler.schedule.registry`
(:func:`~harpjax.compiler.schedule.make_schedule`). What they buy is proven on
the simulator (:mod:`harpjax.compiler.schedule.simulator`) in
``tests/compiler/schedule/test_h1f1b_theory.py`` and explained in ``docs/schedules.md``: with
``eps = 0`` and every ``c_i <= t_max``, H-1F1B keeps every bottleneck stage busy from its first
backward to its last forward.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from harpjax.compiler.schedule.warmup import check_positive
from harpjax.errors import ScheduleError

log = logging.getLogger(__name__)

__all__ = [
    "Task", "Tables", "Schedule", "table_from_warmups", "validate_tables", "dry_run", "peak_inflight", "table_warmups",
    "tables_to_arrays", "format_tables", "parse_tables", "as_task", "StageTask", "GroupTables",
    "tables_from_groups", "dry_run_groups", "stage_groups", "format_group_tables",
]

_TASK_RE = re.compile(r"^\s*([FB])(\d+)\s*$")


class Task(NamedTuple):
  """One unit of work of a stage: the forward (``"F"``) or backward (``"B"``) of a microbatch."""
  kind: str
  microbatch: int

  def __str__(self) -> str:
    return f"{self.kind}{self.microbatch}"

  @classmethod
  def parse(cls, text: str) -> "Task":
    """Parses the text form (``"F3"``, ``"B0"``) back into a task."""
    m = _TASK_RE.match(text)
    if not m:
      raise ScheduleError(f"cannot parse task {text!r}: expected F<microbatch> or B<microbatch>")
    return cls(m.group(1), int(m.group(2)))


Tables = tuple[tuple[Task, ...], ...]

_STAGE_TASK_RE = re.compile(r"^\s*(\d+)([FB])(\d+)\s*$")


class StageTask(NamedTuple):
  """A task of a device group that runs several stages (an interleaved schedule): stage
  ``stage``'s forward or backward of a microbatch. Its text form is ``"2F3"`` (stage 2, F3)."""
  stage: int
  kind: str
  microbatch: int

  @property
  def task(self) -> Task:
    return Task(self.kind, self.microbatch)

  def __str__(self) -> str:
    return f"{self.stage}{self.kind}{self.microbatch}"

  @classmethod
  def parse(cls, text: str) -> "StageTask":
    """Parses the text form (``"2F3"``) back into a task."""
    m = _STAGE_TASK_RE.match(text)
    if not m:
      raise ScheduleError(f"cannot parse task {text!r}: expected <stage>F<microbatch> or "
                          "<stage>B<microbatch>")
    return cls(int(m.group(1)), m.group(2), int(m.group(3)))


GroupTables = tuple[tuple[StageTask, ...], ...]
"""Per device group, the ordered tasks of every stage it runs (an interleaved schedule)."""


# --------------------------------------------------------------------------- tables


def table_from_warmups(num_stages: int, num_microbatches: int,
                       warmups: Sequence[int]) -> Tables:
  """Builds the per-stage task tables of a 1F1B-style schedule.

  Stage ``i`` runs ``F0 .. F(w-1)`` with ``w = min(warmups[i], B)``, then ``B0, Fw, B1,
  F(w+1), ...`` until every forward ran, then the remaining backwards in order.
  """
  check_positive("num_stages", num_stages)
  check_positive("num_microbatches", num_microbatches)
  if len(warmups) != num_stages:
    raise ScheduleError(
        f"warmups has {len(warmups)} entries but there are num_stages={num_stages} stages")
  tables = []
  for i, w in enumerate(warmups):
    if int(w) != w or w < 1:
      raise ScheduleError(f"warmups[{i}]={w}: a warm-up count is an integer >= 1")
    w = min(int(w), num_microbatches)
    tasks = [Task("F", m) for m in range(w)]
    next_f, next_b = w, 0
    while next_b < num_microbatches:
      tasks.append(Task("B", next_b))
      next_b += 1
      if next_f < num_microbatches:
        tasks.append(Task("F", next_f))
        next_f += 1
    tables.append(tuple(tasks))
  return tuple(tables)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A validated schedule: per stage the ordered tasks of one iteration.

  Attributes:
    name: a registered schedule's name (:func:`~harpjax.compiler.schedule.schedule_names`:
      ``"gpipe"``, ``"1f1b"``, ``"eager_1f1b"``, ``"h1f1b"`` and any registered since) or
      any label of a custom table.
    tables: ``[num_stages]`` tuples of :class:`Task`.
    num_microbatches: ``B``.
    warmups: the warm-up counts the tables were generated from, if any.
    groups: with several stages per device group (an interleaved schedule), per group the
      order it runs its stages' tasks in (:class:`StageTask`); every stage is in exactly one
      group, and each stage's row of ``tables`` is its tasks in its group's order. ``None``:
      every stage has devices of its own and runs its row.
  """
  name: str
  tables: Tables
  num_microbatches: int
  warmups: tuple[int, ...] | None = None
  groups: GroupTables | None = None

  def __post_init__(self):
    tables = self.tables
    if not (type(tables) is tuple and all(type(row) is tuple for row in tables)
            and all(type(t) is Task for row in tables for t in row)):
      tables = tuple(tuple(as_task(t) for t in row) for row in tables)
    object.__setattr__(self, "tables", tables)
    if self.warmups is not None:
      object.__setattr__(self, "warmups", tuple(int(w) for w in self.warmups))
    # Validation builds the array form anyway; keep it for :attr:`arrays`.
    object.__setattr__(self, "arrays", _validate(tables, self.num_microbatches))
    if self.groups is not None:
      groups = tuple(tuple(t if type(t) is StageTask else _as_stage_task(t) for t in row)
                     for row in self.groups)
      object.__setattr__(self, "groups", groups)
      if tables_from_groups(groups, len(tables)) != tables:
        raise ScheduleError("a schedule's group orders must hold each stage's row of tasks "
                            "in order; they do not:\n" + format_group_tables(groups))
      dry_run_groups(groups)

  @property
  def device_groups(self) -> tuple[int, ...]:
    """Per stage, the device group that runs it (``0 .. S - 1`` without :attr:`groups`)."""
    if self.groups is None:
      return tuple(range(self.num_stages))
    return stage_groups(self.groups, self.num_stages)

  @property
  def num_groups(self) -> int:
    """Device groups: one per stage unless stages share them."""
    return self.num_stages if self.groups is None else len(self.groups)

  def run_order(self) -> list[StageTask]:
    """A dependency-valid order of every task for one driver (:func:`dry_run`, or
    :func:`dry_run_groups` with several stages per group)."""
    if self.groups is not None:
      return dry_run_groups(self.groups)
    return [StageTask(s, t.kind, t.microbatch) for s, t in dry_run(self.tables)]

  @property
  def num_stages(self) -> int:
    return len(self.tables)

  def peak_inflight(self) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward ran and backward did not yet."""
    return peak_inflight(self.tables)

  def table_warmups(self) -> tuple[int, ...]:
    """Per stage, the forwards run before the first backward (the effective warm-up)."""
    return table_warmups(self.tables)

  @functools.cached_property
  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """``(kinds, microbatches)``, two read-only ``[num_stages, 2 B]`` int64 arrays.

    ``kinds[s, p]`` is ``0`` for a forward and ``1`` for a backward; the simulator and the
    kernels read tables in this form.
    """
    return tables_to_arrays(self.tables)

  def text(self) -> str:
    return format_tables(self.tables)

  @classmethod
  def from_text(cls, text: str, name: str = "custom") -> "Schedule":
    """Parses :func:`format_tables` text; ``B`` is the number of forwards of stage 0."""
    tables = parse_tables(text)
    num_mb = sum(1 for t in tables[0] if t.kind == "F") if tables else 0
    return cls(name, tables, num_mb)

  def to_json(self) -> dict:
    out = {"name": self.name, "num_microbatches": self.num_microbatches,
           "warmups": list(self.warmups) if self.warmups is not None else None,
           "tables": [[str(t) for t in row] for row in self.tables]}
    if self.groups is not None:
      out["groups"] = [[str(t) for t in row] for row in self.groups]
    return out

  @classmethod
  def from_json(cls, data: dict) -> "Schedule":
    tables = tuple(tuple(Task.parse(t) for t in row) for row in data["tables"])
    warmups = data.get("warmups")
    groups = data.get("groups")
    return cls(data["name"], tables, int(data["num_microbatches"]),
               tuple(warmups) if warmups is not None else None,
               tuple(tuple(StageTask.parse(t) for t in row) for row in groups)
               if groups is not None else None)


# --------------------------------------------------------------------------- validation


def validate_tables(tables: Tables, num_microbatches: int) -> None:
  """Checks a task table: complete, every F before its B, and free of deadlock.

  Raises:
    ScheduleError: with the grid and the offending position marked.
  """
  _validate(tables, num_microbatches)


def _validate(tables: Tables, num_microbatches: int) -> tuple[np.ndarray, np.ndarray]:
  if not tables:
    raise ScheduleError("a schedule needs at least one stage")
  B = int(num_microbatches)
  if B != num_microbatches or B < 1:
    raise ScheduleError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
  for s, row in enumerate(tables):
    seen_f = bytearray(B)
    seen_b = bytearray(B)
    for pos, task in enumerate(row):
      kind, m = task
      if kind not in ("F", "B"):
        raise ScheduleError(f"stage {s} task {pos}: kind {kind!r} is not 'F' or 'B'")
      if not isinstance(m, (int, np.integer)) or not 0 <= m < B:
        raise ScheduleError(
            f"stage {s} task {pos} ({kind}{m}): microbatch must be an integer in 0..{B - 1}\n"
            + format_tables(tables, mark=(s, pos)))
      seen = seen_f if kind == "F" else seen_b
      if seen[m]:
        raise ScheduleError(
            f"stage {s} runs {kind}{m} twice\n" + format_tables(tables, mark=(s, pos)))
      if kind == "B" and not seen_f[m]:
        raise ScheduleError(
            f"stage {s} runs B{m} before F{m}\n" + format_tables(tables, mark=(s, pos)))
      seen[m] = 1
    if len(row) != 2 * B:
      missing = [f"F{m}" for m in range(B) if not seen_f[m]]
      missing += [f"B{m}" for m in range(B) if not seen_b[m]]
      raise ScheduleError(
          f"stage {s} must run F and B of microbatches 0..{B - 1} once each; "
          f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}")
  # Deadlock check: the simulator's kernel with zero durations (Numba; O(tasks)).
  from harpjax.compiler.schedule import sim_kernel as _sim_kernel
  kinds, mbs = tables_to_arrays(tables)
  zeros = np.zeros((len(tables), B))
  links = np.zeros((max(len(tables) - 1, 1), B))
  status, *_, stuck = _sim_kernel.simulate_kernel(kinds, mbs, zeros, zeros, links, links)
  if status:
    marks = [(s, int(p)) for s, p in enumerate(stuck) if p < kinds.shape[1]]
    raise ScheduleError("schedule deadlocks: every stage waits on another\n"
                        + format_tables(tables, marks=marks))
  return kinds, mbs


def dry_run(tables: Tables) -> list[tuple[int, Task]]:
  """Executes a table with zero-cost tasks and returns the (stage, task) completion order.

  ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``B(s+1, m)`` (the last stage's backward
  needs only its own forward); each stage runs its tasks in table order. Stages are visited
  ``0, 1, ..., S-1`` over and over, each running as far as it can, so the order is a valid
  global order for a single-threaded driver.

  Raises:
    ScheduleError: if no stage can make progress (deadlock); the grid marks where each stage
      is stuck.
  """
  num_stages = len(tables)
  num_mb = max((t.microbatch for row in tables for t in row), default=-1) + 1
  done_f = [bytearray(num_mb) for _ in range(num_stages)]
  done_b = [bytearray(num_mb) for _ in range(num_stages)]
  pos = [0] * num_stages
  lens = [len(r) for r in tables]
  order: list[tuple[int, Task]] = []
  total = sum(lens)
  last = num_stages - 1
  while len(order) < total:
    progressed = False
    for s in range(num_stages):
      row, p, n = tables[s], pos[s], lens[s]
      while p < n:
        task = row[p]
        m = task.microbatch
        if task.kind == "F":
          if s and not done_f[s - 1][m]:
            break
          done_f[s][m] = 1
        else:
          if (done_f[s][m] == 0) if s == last else (done_b[s + 1][m] == 0):
            break
          done_b[s][m] = 1
        order.append((s, task))
        p += 1
      if p != pos[s]:
        pos[s] = p
        progressed = True
    if not progressed:
      stuck = [(s, pos[s]) for s in range(num_stages) if pos[s] < lens[s]]
      raise ScheduleError("schedule deadlocks: every stage waits on another\n"
                          + format_tables(tables, marks=stuck))
  return order


def peak_inflight(tables: Tables) -> tuple[int, ...]:
  """Per stage, the largest number of microbatches forwarded but not yet backwarded."""
  peaks = []
  for row in tables:
    cur = peak = 0
    for task in row:
      cur += 1 if task.kind == "F" else -1
      peak = max(peak, cur)
    peaks.append(peak)
  return tuple(peaks)


def table_warmups(tables: Tables) -> tuple[int, ...]:
  """Per stage, how many forwards its table runs before its first backward."""
  counts = []
  for row in tables:
    n = 0
    for task in row:
      if task.kind != "F":
        break
      n += 1
    counts.append(n)
  return tuple(counts)


def tables_to_arrays(tables: Tables) -> tuple[np.ndarray, np.ndarray]:
  """``(kinds, microbatches)`` as ``[num_stages, tasks_per_stage]`` int64 arrays.

  ``kinds`` is ``0`` for ``F`` and ``1`` for ``B``. The arrays are read-only.

  Raises:
    ScheduleError: if the stages have different numbers of tasks.
  """
  lens = {len(r) for r in tables}
  if len(lens) > 1:
    raise ScheduleError(f"stages have different numbers of tasks {sorted(lens)}")
  flat = [t for row in tables for t in row]
  shape = (len(tables), lens.pop() if lens else 0)
  kinds = np.fromiter((t.kind == "B" for t in flat), np.int64, len(flat)).reshape(shape)
  mbs = np.fromiter((t.microbatch for t in flat), np.int64, len(flat)).reshape(shape)
  kinds.flags.writeable = False
  mbs.flags.writeable = False
  return kinds, mbs


def format_tables(tables: Tables, mark: tuple[int, int] | None = None,
                  marks: Iterable[tuple[int, int]] = ()) -> str:
  """The grid text form, one line per stage; marked positions are shown as ``[F3]``."""
  marked = set(marks)
  if mark is not None:
    marked.add(mark)
  width = max((len(str(t)) for row in tables for t in row), default=2) + 2
  lines = []
  for s, row in enumerate(tables):
    cells = [(f"[{t}]" if (s, p) in marked else str(t)).ljust(width) for p, t in enumerate(row)]
    lines.append(f"stage {s}: " + "".join(cells).rstrip())
  return "\n".join(lines)


def parse_tables(text: str) -> Tables:
  """Parses the text form of :func:`format_tables` (the ``stage i:`` prefix is optional)."""
  tables = []
  for line in text.strip().splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if ":" in line:
      line = line.split(":", 1)[1]
    tables.append(tuple(Task.parse(tok.strip("[]")) for tok in line.split()))
  return tuple(tables)


def as_task(t) -> Task:
  """A :class:`Task` from a Task, its text (``"F3"``) or a ``(kind, microbatch)`` pair."""
  if isinstance(t, Task):
    return t
  if isinstance(t, str):
    return Task.parse(t)
  try:
    kind, m = t
  except (TypeError, ValueError):
    raise ScheduleError(f"cannot read task {t!r}: give a Task, 'F3'/'B0' or (kind, microbatch)"
                        ) from None
  return Task(str(kind), int(m) if isinstance(m, (int, np.integer)) else m)


# --------------------------------------------------------------------------- device groups


def _as_stage_task(t) -> StageTask:
  if isinstance(t, str):
    return StageTask.parse(t)
  try:
    stage, kind, m = t
  except (TypeError, ValueError):
    raise ScheduleError(f"cannot read task {t!r}: give a StageTask, '2F3' or (stage, kind, "
                        "microbatch)") from None
  return StageTask(int(stage), str(kind), int(m))


def stage_groups(groups: GroupTables, num_stages: int) -> tuple[int, ...]:
  """Per stage, the index of the one group whose order holds its tasks.

  Raises:
    ScheduleError: a stage in no group or in two.
  """
  owner = [-1] * num_stages
  for g, row in enumerate(groups):
    for t in row:
      if not 0 <= t.stage < num_stages:
        raise ScheduleError(f"group {g} runs {t}, but there are {num_stages} stages")
      if owner[t.stage] not in (-1, g):
        raise ScheduleError(f"stage {t.stage} has tasks in groups {owner[t.stage]} and {g}; "
                            "a stage runs on one device group")
      owner[t.stage] = g
  missing = [s for s, g in enumerate(owner) if g < 0]
  if missing:
    raise ScheduleError(f"stages {missing} have no tasks in any group")
  return tuple(owner)


def tables_from_groups(groups: GroupTables, num_stages: int) -> Tables:
  """Each stage's row: its tasks, in its group's order."""
  stage_groups(groups, num_stages)
  rows: list[list[Task]] = [[] for _ in range(num_stages)]
  for row in groups:
    for t in row:
      rows[t.stage].append(Task(t.kind, t.microbatch))
  return tuple(tuple(r) for r in rows)


def dry_run_groups(groups: GroupTables) -> list[StageTask]:
  """:func:`dry_run` for device groups that each run several stages: every group runs its
  tasks in its order, one at a time; ``F(s, m)`` needs ``F(s-1, m)``, ``B(s, m)`` needs
  ``B(s+1, m)`` (the last stage's needs its own ``F(m)``). Groups are visited ``0, 1, ...``
  over and over, each running as far as it can.

  Returns:
    Every task, in a dependency-valid order for one driver.

  Raises:
    ScheduleError: no group can make progress (the grid marks where each is stuck).
  """
  num_stages = max((t.stage for row in groups for t in row), default=-1) + 1
  num_mb = max((t.microbatch for row in groups for t in row), default=-1) + 1
  done_f = [bytearray(num_mb) for _ in range(num_stages)]
  done_b = [bytearray(num_mb) for _ in range(num_stages)]
  pos = [0] * len(groups)
  total = sum(len(r) for r in groups)
  last = num_stages - 1
  order: list[StageTask] = []
  while len(order) < total:
    progressed = False
    for g, row in enumerate(groups):
      p = pos[g]
      while p < len(row):
        s, kind, m = row[p]
        if kind == "F":
          if s and not done_f[s - 1][m]:
            break
          done_f[s][m] = 1
        else:
          if not (done_f[s][m] if s == last else done_b[s + 1][m]):
            break
          done_b[s][m] = 1
        order.append(row[p])
        p += 1
      if p != pos[g]:
        pos[g] = p
        progressed = True
    if not progressed:
      raise ScheduleError("schedule deadlocks: every device group waits on another\n"
                          + format_group_tables(groups, marks=[
                              (g, pos[g]) for g in range(len(groups)) if pos[g] < len(groups[g])]))
  return order


def format_group_tables(groups: GroupTables, marks: Iterable[tuple[int, int]] = ()) -> str:
  """The grid text form of group orders, one line per group (``2F3``: stage 2's F3)."""
  marked = set(marks)
  width = max((len(str(t)) for row in groups for t in row), default=3) + 2
  return "\n".join(
      f"group {g}: " + "".join((f"[{t}]" if (g, p) in marked else str(t)).ljust(width)
                               for p, t in enumerate(row)).rstrip()
      for g, row in enumerate(groups))
