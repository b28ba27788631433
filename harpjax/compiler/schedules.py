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
  ``t_max`` (:func:`warmup_delta`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, NamedTuple, Sequence

from harpjax.errors import ScheduleError

__all__ = [
    "Task", "Schedule", "SCHEDULE_NAMES", "make_schedule", "table_from_warmups",
    "warmup_delta", "h1f1b_warmups", "eager_1f1b_warmups", "one_f_one_b_warmups",
    "gpipe_warmups", "validate_tables", "dry_run", "peak_inflight", "format_tables",
    "parse_tables",
]

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager_1f1b", "h1f1b")

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


# --------------------------------------------------------------------------- warm-up counts


def warmup_delta(comm_cost_s: float, t_max_s: float, eps: float = 0.0) -> int:
  """Extra forward launches of stage ``i`` over stage ``i+1`` (HARP Eq. 10/17).

  ``delta = ceil(2 c / t_max - eps) + 1``, at least 1. With ``eps = 0`` this is the bound of
  Eq. 10, ``ceil(1 + 2c / t_max)``, which makes the steady phase bubble-free whenever
  ``c <= t_max``. ``eps`` is a tolerance on ``2 c / t_max``: communication below
  ``eps * t_max / 2`` is not worth an extra in-flight microbatch (Eq. 2 uses the threshold
  ``c <= eps * t_max`` for the same purpose; ours is Eq. 17's form, used by the planner too, so
  that the plan's memory check and the runtime's schedule agree).

  Args:
    comm_cost_s: per-microbatch transfer time between the two stages, seconds.
    t_max_s: the bottleneck stage's forward+backward time per microbatch, seconds.
    eps: tolerance, dimensionless, ``>= 0``.

  Returns:
    The integer ``delta_i >= 1``.
  """
  if t_max_s <= 0:
    raise ScheduleError(f"t_max must be positive, got t_max_s={t_max_s}")
  if eps < 0:
    raise ScheduleError(f"eps must be >= 0, got eps={eps}")
  if comm_cost_s <= 0:
    return 1
  # Guard against 2c/t_max landing a hair above an integer through rounding.
  ratio = 2.0 * comm_cost_s / t_max_s - eps
  return max(1, math.ceil(ratio - 1e-12) + 1)


def h1f1b_warmups(comm_costs: Sequence[float], t_max: float, eps: float = 0.1) -> tuple[int, ...]:
  """H-1F1B warm-up counts (HARP Eq. 1 with the delta of :func:`warmup_delta`).

  Args:
    comm_costs: ``[num_stages - 1]`` seconds, ``c_i`` between stage ``i`` and ``i + 1``.
    t_max: bottleneck per-microbatch compute time (forward + backward), seconds.
    eps: tolerance of :func:`warmup_delta`; ``0`` gives the exact bubble-free bound.

  Returns:
    ``[num_stages]`` warm-up counts, the last one 1.
  """
  counts = [1]
  for c in reversed(list(comm_costs)):
    counts.append(counts[-1] + warmup_delta(float(c), float(t_max), eps))
  return tuple(reversed(counts))


def one_f_one_b_warmups(num_stages: int) -> tuple[int, ...]:
  """1F1B: stage ``i`` (0-indexed) launches ``S - i`` forwards before its first backward."""
  _check_positive("num_stages", num_stages)
  return tuple(num_stages - i for i in range(num_stages))


def eager_1f1b_warmups(num_stages: int) -> tuple[int, ...]:
  """Eager-1F1B: stage ``i`` (0-indexed) launches ``2 (S - 1 - i) + 1`` forwards."""
  _check_positive("num_stages", num_stages)
  return tuple(2 * (num_stages - 1 - i) + 1 for i in range(num_stages))


def gpipe_warmups(num_stages: int, num_microbatches: int) -> tuple[int, ...]:
  """GPipe: every stage runs all forwards before any backward."""
  _check_positive("num_stages", num_stages)
  _check_positive("num_microbatches", num_microbatches)
  return (num_microbatches,) * num_stages


# --------------------------------------------------------------------------- tables


def table_from_warmups(num_stages: int, num_microbatches: int,
                       warmups: Sequence[int]) -> Tables:
  """Builds the per-stage task tables of a 1F1B-style schedule.

  Stage ``i`` runs ``F0 .. F(w-1)`` with ``w = min(warmups[i], B)``, then ``B0, Fw, B1,
  F(w+1), ...`` until every forward ran, then the remaining backwards in order.
  """
  _check_positive("num_stages", num_stages)
  _check_positive("num_microbatches", num_microbatches)
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
    name: ``"gpipe"``, ``"1f1b"``, ``"eager_1f1b"``, ``"h1f1b"`` or any label of a custom table.
    tables: ``[num_stages]`` tuples of :class:`Task`.
    num_microbatches: ``B``.
    warmups: the warm-up counts the tables were generated from, if any.
  """
  name: str
  tables: Tables
  num_microbatches: int
  warmups: tuple[int, ...] | None = None

  def __post_init__(self):
    tables = tuple(tuple(Task(*t) if not isinstance(t, Task) else t for t in row)
                   for row in self.tables)
    object.__setattr__(self, "tables", tables)
    validate_tables(tables, self.num_microbatches)

  @property
  def num_stages(self) -> int:
    return len(self.tables)

  def peak_inflight(self) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward ran and backward did not yet."""
    return peak_inflight(self.tables)

  def text(self) -> str:
    return format_tables(self.tables)

  @classmethod
  def from_text(cls, text: str, name: str = "custom") -> "Schedule":
    tables = parse_tables(text)
    num_mb = sum(1 for t in tables[0] if t.kind == "F") if tables else 0
    return cls(name, tables, num_mb)

  def to_json(self) -> dict:
    return {"name": self.name, "num_microbatches": self.num_microbatches,
            "warmups": list(self.warmups) if self.warmups is not None else None,
            "tables": [[str(t) for t in row] for row in self.tables]}

  @classmethod
  def from_json(cls, data: dict) -> "Schedule":
    tables = tuple(tuple(Task.parse(t) for t in row) for row in data["tables"])
    warmups = data.get("warmups")
    return cls(data["name"], tables, int(data["num_microbatches"]),
               tuple(warmups) if warmups is not None else None)


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  warmups: Sequence[int] | None = None) -> Schedule:
  """Generates a named schedule.

  Args:
    name: one of :data:`SCHEDULE_NAMES`.
    num_stages: ``S``.
    num_microbatches: ``B``.
    warmups: per-stage warm-up counts. Required meaning for ``"h1f1b"`` (use
      :func:`h1f1b_warmups`); without them H-1F1B assumes free links and equals 1F1B. For the
      other names, if given, they must equal the name's own counts.

  Returns:
    A validated :class:`Schedule`.
  """
  key = name.lower().replace("-", "_")
  if key not in SCHEDULE_NAMES:
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
  _check_positive("num_stages", num_stages)
  _check_positive("num_microbatches", num_microbatches)
  default = {
      "gpipe": lambda: gpipe_warmups(num_stages, num_microbatches),
      "1f1b": lambda: one_f_one_b_warmups(num_stages),
      "eager_1f1b": lambda: eager_1f1b_warmups(num_stages),
      "h1f1b": lambda: one_f_one_b_warmups(num_stages),
  }[key]()
  if warmups is None:
    counts = default
  else:
    counts = tuple(int(w) for w in warmups)
    if key != "h1f1b" and counts != default:
      raise ScheduleError(
          f"schedule {key!r} has fixed warm-up counts {default}; got warmups={counts}. "
          "Use name='h1f1b' for custom counts.")
  return Schedule(key, table_from_warmups(num_stages, num_microbatches, counts),
                  num_microbatches, counts)


# --------------------------------------------------------------------------- validation


def validate_tables(tables: Tables, num_microbatches: int) -> None:
  """Checks a task table: complete, every F before its B, and free of deadlock.

  Raises:
    ScheduleError: with the grid and the offending position marked.
  """
  if not tables:
    raise ScheduleError("a schedule needs at least one stage")
  expected = {Task(k, m) for k in "FB" for m in range(num_microbatches)}
  for s, row in enumerate(tables):
    seen = set()
    for pos, task in enumerate(row):
      if task.kind not in ("F", "B"):
        raise ScheduleError(f"stage {s} task {pos}: kind {task.kind!r} is not 'F' or 'B'")
      if task in seen:
        raise ScheduleError(
            f"stage {s} runs {task} twice\n" + format_tables(tables, mark=(s, pos)))
      if task.kind == "B" and Task("F", task.microbatch) not in seen:
        raise ScheduleError(
            f"stage {s} runs {task} before F{task.microbatch}\n"
            + format_tables(tables, mark=(s, pos)))
      seen.add(task)
    if seen != expected:
      missing = sorted(str(t) for t in expected - seen)
      extra = sorted(str(t) for t in seen - expected)
      raise ScheduleError(
          f"stage {s} must run F and B of microbatches 0..{num_microbatches - 1} once each; "
          f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}")
  dry_run(tables)


def dry_run(tables: Tables) -> list[tuple[int, Task]]:
  """Executes a table with zero-cost tasks and returns the (stage, task) completion order.

  ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``B(s+1, m)`` (the last stage's backward
  needs only its own forward); each stage runs its tasks in table order.

  Raises:
    ScheduleError: if no stage can make progress (deadlock); the grid marks where each stage
      is stuck.
  """
  num_stages = len(tables)
  done: set[tuple[int, Task]] = set()
  pos = [0] * num_stages
  order: list[tuple[int, Task]] = []
  total = sum(len(r) for r in tables)
  while len(order) < total:
    progressed = False
    for s in range(num_stages):
      while pos[s] < len(tables[s]):
        task = tables[s][pos[s]]
        if task.kind == "F":
          ready = s == 0 or (s - 1, task) in done
        else:
          ready = (s == num_stages - 1 and (s, Task("F", task.microbatch)) in done) or \
              (s < num_stages - 1 and (s + 1, task) in done)
        if not ready:
          break
        done.add((s, task))
        order.append((s, task))
        pos[s] += 1
        progressed = True
    if not progressed:
      stuck = [(s, pos[s]) for s in range(num_stages) if pos[s] < len(tables[s])]
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
    if not line:
      continue
    if ":" in line:
      line = line.split(":", 1)[1]
    tables.append(tuple(Task.parse(tok.strip("[]")) for tok in line.split()))
  return tuple(tables)


def _check_positive(name: str, value: int) -> None:
  if int(value) != value or value < 1:
    raise ScheduleError(f"{name} must be a positive integer, got {name}={value!r}")
