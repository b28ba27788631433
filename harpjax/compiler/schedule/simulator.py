"""Pipeline simulator: the DAG of HARP §4.2.1 evaluated for any schedule table.

Given per-stage forward and backward times, per-link transfer times and a task table,
:func:`simulate` computes when every task and every transfer runs and what that means for one
training iteration: its length, each stage's computation, exposed communication and idle time
split into warm-up, steady and cool-down phases, how much of each link's transfer time is hidden
under computation (the overlap ratio of the paper's Fig. 9), and the peak number of microbatches
whose activations a stage holds.

Semantics (the paper's DAG, Eq. 3 with equality):

* a stage computes one task at a time, in its table's order;
* each link between stage ``i`` and ``i + 1`` is full duplex; each direction sends one message
  at a time, in FIFO order of enqueueing. The activation of ``m`` is enqueued when
  ``F(i, m)`` ends, its gradient when ``B(i + 1, m)`` ends;
* ``F(i + 1, m)`` starts once its activation is delivered, ``B(i, m)`` once its gradient is;
* every task and transfer starts as soon as all its predecessors are done;
* optionally, after its last task a stage spends an end-of-iteration time (gradient
  synchronisation inside its submesh plus the optimizer update); the iteration ends when the
  last stage finishes that.

A schedule whose device groups run several stages each (an interleaved schedule:
:attr:`~harpjax.compiler.schedule.Schedule.groups`) is simulated at the level of groups: a
group computes one task at a time in its order, whatever stage it belongs to; a cut between
two stages of one group costs nothing; every cut from one group to another shares that pair's
link (one channel per ordered pair of groups, FIFO); a group runs each stage's end-of-iteration
time (its reduction and optimizer update) right after that stage's last task, before its next
task (*interleaved optimizer updates*: the update of a group's later stage overlaps the
drain's waits for its earlier stages' gradients). The per-stage fields keep their meaning (a stage's idle time includes
the time its group computes its other stages).

Phases of stage ``s`` (used for the breakdown and for "bubble-free", see ``docs/schedules.md``):
warm-up is ``[0, start of its first B)``, steady is ``[start of its first B, end of its last F)``
(empty when the last F runs before the first B, as in GPipe), cool-down is the rest of the
iteration. The *bubble* of a stage is the time inside its steady phase during which it does not
compute; a stage is *bubble-free* when that is zero.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, NamedTuple

import numpy as np

from harpjax.compiler.schedule import sim_kernel as _sim_kernel
from harpjax.compiler.schedule import tasks as sched
from harpjax.compiler.schedule.registry import schedule_kind, ScheduleKind
from harpjax.compiler.schedule.warmup import PipelineCosts
from harpjax.errors import CostTablesError, ScheduleError

__all__ = ["simulate", "SimResult", "TimelineEvent", "PHASES", "BACKENDS"]

log = logging.getLogger(__name__)

PHASES = ("warmup", "steady", "cooldown")
BACKENDS = ("auto", "numba", "python", "reference")


class TimelineEvent(NamedTuple):
  """One bar of the timeline.

  Attributes:
    lane: ``"stage"`` or ``"link"``.
    index: stage index, or link index ``i`` (between stage ``i`` and ``i + 1``).
    direction: for links ``"fwd"`` (activations ``i -> i+1``) or ``"bwd"`` (gradients);
      ``""`` for stages.
    kind: ``"F"``, ``"B"``, ``"U"`` (end-of-iteration update) or ``"A"``/``"G"`` (activation /
      gradient transfer).
    microbatch: microbatch index, ``-1`` for the update.
    start_s: seconds from the start of the iteration.
    end_s: seconds.
  """
  lane: str
  index: int
  direction: str
  kind: str
  microbatch: int
  start_s: float
  end_s: float


@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
  """One simulated iteration. Times in seconds; ``S`` stages, ``B`` microbatches, ``L = S - 1``.

  Attributes:
    schedule: the simulated :class:`~harpjax.compiler.schedule.Schedule`.
    fwd_s: ``[S, B]`` forward time of each (stage, microbatch).
    bwd_s: ``[S, B]`` backward time.
    comm_fwd_s: ``[L, B]`` activation transfer time over link ``i`` (stage ``i`` to ``i+1``).
    comm_bwd_s: ``[L, B]`` gradient transfer time over link ``i``.
    end_s: ``[S]`` end-of-iteration time of each stage (gradient sync + optimizer update).
    task_start: ``[S, 2B]`` start of each table entry (``schedule.tables[s][p]``).
    task_end: ``[S, 2B]`` end of each table entry.
    msg_start: ``[2, L, B]`` transfer start per (direction, link, microbatch); direction ``0``
      carries activations, ``1`` gradients.
    msg_end: ``[2, L, B]`` delivery time.
    iteration_time: seconds from the first task to the end of the last update.
    phase_time: ``[S, 3]`` length of each stage's warm-up, steady and cool-down phases.
    compute_time: ``[S, 3]`` time computing F/B in each phase.
    comm_time: ``[S, 3]`` exposed communication: not computing while one of the stage's links
      (either direction, in or out) transfers.
    idle_time: ``[S, 3]`` neither computing, updating nor communicating.
    update_time: ``[S]`` end-of-iteration time (always in the cool-down).
    bubble: ``[S]`` time inside the steady phase not spent computing; exactly ``0.0`` when
      every steady task starts the instant its predecessor ends.
    link_busy: ``[L, 2]`` total transfer time per link and direction.
    link_hidden: ``[L, 2]`` the part of it during which the receiving stage computes.
    stage_comm: ``[S]`` time any link of the stage transfers (union over its links).
    stage_comm_hidden: ``[S]`` the part of ``stage_comm`` the stage spends computing.
    peak_inflight: per stage, the most microbatches whose activations it holds at once (from
      the start of ``F(s, m)`` to the end of ``B(s, m)``; the count the memory check of the
      planner, Eq. 18, uses).
    peak_held: per stage, the same but counted from the delivery of the microbatch's input
      activation (received but not yet consumed inputs included).
    act_bytes: ``[S]`` activation bytes one in-flight microbatch holds on each stage, if given.
    wall_s: seconds the simulation itself took.
  """
  schedule: sched.Schedule
  fwd_s: np.ndarray
  bwd_s: np.ndarray
  comm_fwd_s: np.ndarray
  comm_bwd_s: np.ndarray
  end_s: np.ndarray
  task_start: np.ndarray
  task_end: np.ndarray
  msg_start: np.ndarray
  msg_end: np.ndarray
  iteration_time: float
  phase_time: np.ndarray
  compute_time: np.ndarray
  comm_time: np.ndarray
  idle_time: np.ndarray
  update_time: np.ndarray
  bubble: np.ndarray
  link_busy: np.ndarray
  link_hidden: np.ndarray
  stage_comm: np.ndarray
  stage_comm_hidden: np.ndarray
  peak_inflight: tuple[int, ...]
  peak_held: tuple[int, ...]
  act_bytes: np.ndarray | None = None
  wall_s: float = 0.0

  # ---------------------------------------------------------------- shapes and costs

  @property
  def num_stages(self) -> int:
    return self.schedule.num_stages

  @property
  def num_microbatches(self) -> int:
    return self.schedule.num_microbatches

  @property
  def stage_time(self) -> np.ndarray:
    """``[S]`` mean forward+backward seconds per microbatch (``t_i``)."""
    return (self.fwd_s + self.bwd_s).mean(axis=1)

  @property
  def t_max(self) -> float:
    return float(self.stage_time.max())

  @property
  def bottleneck_stages(self) -> tuple[int, ...]:
    """Stages whose ``t_i`` equals ``t_max`` (relative tolerance ``1e-9``)."""
    t = self.stage_time
    return tuple(int(i) for i in np.flatnonzero(t >= t.max() * (1 - 1e-9)))

  # ---------------------------------------------------------------- timeline lookups

  @functools.cached_property
  def _positions(self) -> tuple[np.ndarray, np.ndarray]:
    kinds, mbs = self.schedule.arrays
    S, n = kinds.shape
    pos_f = np.zeros((S, self.num_microbatches), np.int64)
    pos_b = np.zeros_like(pos_f)
    rows = np.repeat(np.arange(S), n).reshape(S, n)
    cols = np.tile(np.arange(n), S).reshape(S, n)
    isf = kinds == _sim_kernel.KIND_F
    pos_f[rows[isf], mbs[isf]] = cols[isf]
    pos_b[rows[~isf], mbs[~isf]] = cols[~isf]
    return pos_f, pos_b

  def _by_mb(self, arr: np.ndarray, kind: int) -> np.ndarray:
    pos = self._positions[kind]
    return np.take_along_axis(arr, pos, axis=1)

  @property
  def f_start(self) -> np.ndarray:
    """``[S, B]`` start of ``F(s, m)``."""
    return self._by_mb(self.task_start, 0)

  @property
  def f_end(self) -> np.ndarray:
    return self._by_mb(self.task_end, 0)

  @property
  def b_start(self) -> np.ndarray:
    """``[S, B]`` start of ``B(s, m)``."""
    return self._by_mb(self.task_start, 1)

  @property
  def b_end(self) -> np.ndarray:
    return self._by_mb(self.task_end, 1)

  @property
  def wait(self) -> np.ndarray:
    """``[S, 2B]`` time each table entry waited after the previous one on its stage ended."""
    prev = np.concatenate([np.zeros((self.num_stages, 1)), self.task_end[:, :-1]], axis=1)
    return self.task_start - prev

  @property
  def phase_bounds(self) -> np.ndarray:
    """``[S, 4]``: 0, end of warm-up, end of steady phase, end of iteration (seconds)."""
    kinds, _ = self.schedule.arrays
    out = np.zeros((self.num_stages, 4))
    for s in range(self.num_stages):
      first_b, last_f = _sim_kernel.steady_positions(kinds[s])
      w = self.task_start[s, first_b]
      out[s] = (0.0, w, max(w, self.task_end[s, last_f]), self.iteration_time)
    return out

  # ---------------------------------------------------------------- derived metrics

  @property
  def overlap(self) -> np.ndarray:
    """``[L, 2]`` share of each link direction's transfer time hidden under the receiver's
    computation (NaN when nothing was sent)."""
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(self.link_busy > 0, self.link_hidden / self.link_busy, np.nan)

  @property
  def overlap_ratio(self) -> np.ndarray:
    """``[L]`` the same for both directions together (Fig. 9's annotation)."""
    busy = self.link_busy.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(busy > 0, self.link_hidden.sum(axis=1) / busy, np.nan)

  @property
  def stage_overlap(self) -> np.ndarray:
    """``[S]`` share of the stage's communication time it spends computing."""
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(self.stage_comm > 0, self.stage_comm_hidden / self.stage_comm, np.nan)

  @property
  def peak_activation_bytes(self) -> np.ndarray | None:
    """``[S]`` peak in-flight microbatches times ``act_bytes`` (``None`` without them)."""
    if self.act_bytes is None:
      return None
    return np.asarray(self.peak_inflight, np.float64) * self.act_bytes

  def events(self) -> list[TimelineEvent]:
    """Every task, update and transfer as a :class:`TimelineEvent`, stage by stage."""
    kinds, mbs = self.schedule.arrays
    out = []
    for s in range(self.num_stages):
      for p in range(kinds.shape[1]):
        out.append(TimelineEvent("stage", s, "", "FB"[kinds[s, p]], int(mbs[s, p]),
                                 float(self.task_start[s, p]), float(self.task_end[s, p])))
      if self.end_s[s] > 0:
        t0 = float(self.task_end[s, -1])
        out.append(TimelineEvent("stage", s, "", "U", -1, t0, t0 + float(self.end_s[s])))
    for d, (name, kind) in enumerate((("fwd", "A"), ("bwd", "G"))):
      for link in range(self.num_stages - 1):
        for m in np.argsort(self.msg_start[d, link], kind="stable"):
          out.append(TimelineEvent("link", link, name, kind, int(m),
                                   float(self.msg_start[d, link, m]),
                                   float(self.msg_end[d, link, m])))
    return out

  def summary(self) -> dict[str, Any]:
    """Plain-JSON breakdown (no per-task timeline); NaN becomes ``None``."""
    out = {
        "schedule": self.schedule.name, "num_stages": self.num_stages,
        "num_microbatches": self.num_microbatches,
        "warmups": list(self.schedule.table_warmups()),
        "iteration_time_s": self.iteration_time, "t_max_s": self.t_max,
        "stage_time_s": self.stage_time, "phases": list(PHASES),
        "phase_time_s": self.phase_time, "compute_s": self.compute_time,
        "comm_s": self.comm_time, "idle_s": self.idle_time,
        "update_s": self.update_time, "bubble_s": self.bubble,
        "peak_inflight": list(self.peak_inflight), "peak_held": list(self.peak_held),
        "link_busy_s": self.link_busy, "link_overlap": self.overlap,
        "overlap_ratio": self.overlap_ratio, "stage_overlap": self.stage_overlap,
    }
    if self.act_bytes is not None:
      out["peak_activation_bytes"] = self.peak_activation_bytes
    return {k: _jsonable(v) for k, v in out.items()}

  def table(self, unit: str | None = None) -> str:
    """The per-stage breakdown as text, like the paper's Fig. 9 in numbers.

    Args:
      unit: ``"s"``, ``"ms"`` or ``"us"``; by default ``s`` for iterations of 10 s or more,
        else ``ms``.
    """
    if unit is None:
      unit = "s" if self.iteration_time >= 10 else "ms"
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    ms = lambda x: f"{x * scale:.{3 if unit == 's' else 2}f}"
    pct = lambda x: "-" if np.isnan(x) else f"{100 * x:.1f}%"
    head = ["stage", f"t ({unit})", "warm-up c/m/i", "steady c/m/i", "cool-down c/m/i",
            "update", "bubble", "in-flight", "held", "link overlap"]
    rows = []
    ov = self.overlap_ratio
    for s in range(self.num_stages):
      cells = [str(s), ms(self.stage_time[s])]
      for ph in range(3):
        cells.append("/".join(ms(x[s, ph]) for x in (self.compute_time, self.comm_time,
                                                      self.idle_time)))
      cells += [ms(self.update_time[s]), ms(self.bubble[s]), str(self.peak_inflight[s]),
                str(self.peak_held[s]), pct(ov[s]) if s < self.num_stages - 1 else ""]
      rows.append(cells)
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths)).rstrip()
    lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    lines.append(f"{self.schedule.name}: B={self.num_microbatches}, warm-ups "
                 f"{list(self.schedule.table_warmups())}, iteration {ms(self.iteration_time)} "
                 f"{unit} (c/m/i = compute / exposed communication / idle)")
    return "\n".join(lines)


def _jsonable(x):
  if isinstance(x, np.ndarray):
    return [_jsonable(v) for v in x.tolist()] if x.ndim else _jsonable(x.item())
  if isinstance(x, list):
    return [_jsonable(v) for v in x]
  if isinstance(x, float) and math.isnan(x):
    return None
  return x


# --------------------------------------------------------------------------- entry point


def simulate(fwd, bwd, comm=0.0, schedule: Any = "h1f1b", *,
             num_microbatches: int | None = None, comm_fwd=None, comm_bwd=None,
             end_cost=0.0, eps: float = 0.1, act_bytes=None,
             backend: str = "auto") -> SimResult:
  """Simulates one training iteration of a pipeline.

  Args:
    fwd: forward seconds per microbatch: a scalar, ``[S]`` per stage, or ``[S, B]``.
    bwd: backward seconds, same forms.
    comm: transfer seconds per microbatch for both directions: a scalar, ``[S - 1]`` per link
      (link ``i`` joins stage ``i`` and ``i + 1``), or ``[S - 1, B]``.
    schedule: a :class:`~harpjax.compiler.schedule.Schedule`; per-stage task tables (tuples of
      :class:`~harpjax.compiler.schedule.Task`, ``"F3"`` strings or ``(kind, m)`` pairs); the
      text of :func:`~harpjax.compiler.schedule.format_tables`; or a registered schedule's
      name (or its :class:`~harpjax.compiler.schedule.ScheduleKind`), in which case
      ``num_microbatches`` is required and the kind's warm-up rule reads the stage times
      (the largest per microbatch), the links' ``(c_f + c_b) / 2`` and ``eps``: H-1F1B gets
      ``h1f1b_warmups((c_f + c_b) / 2, t_max, eps)``.
    num_microbatches: ``B`` when ``schedule`` is a name.
    comm_fwd: activation transfer seconds (overrides ``comm`` for that direction).
    comm_bwd: gradient transfer seconds (overrides ``comm`` for that direction).
    end_cost: end-of-iteration seconds per stage (scalar or ``[S]``): gradient synchronisation
      inside the stage's submesh plus the optimizer update.
    eps: the tolerance a named schedule's warm-up rule reads (H-1F1B's).
    act_bytes: optional ``[S]`` (or scalar) activation bytes one in-flight microbatch holds.
    backend: ``"numba"``, ``"python"`` (the same kernel, interpreted), ``"reference"`` (the
      discrete-event twin) or ``"auto"`` (Numba when installed).

  Returns:
    A :class:`SimResult`.

  Raises:
    ScheduleError: bad or deadlocking schedule.
    CostTablesError: times of the wrong shape, negative or not finite.
  """
  t0 = time.perf_counter()
  given = _coerce_schedule(schedule)
  if isinstance(given, sched.Schedule):
    S, B = given.num_stages, given.num_microbatches
  else:
    S = _infer_num_stages(fwd, bwd, comm, comm_fwd, comm_bwd)
    B = _infer_num_microbatches(given, num_microbatches, fwd, bwd)
  f = _per_mb("fwd", fwd, S, B)
  b = _per_mb("bwd", bwd, S, B)
  L = S - 1
  cf = _per_mb("comm_fwd", comm if comm_fwd is None else comm_fwd, L, B)
  cb = _per_mb("comm_bwd", comm if comm_bwd is None else comm_bwd, L, B)
  ends = _per_stage("end_cost", end_cost, S)
  ab = None if act_bytes is None else _per_stage("act_bytes", act_bytes, S)
  sch = given if isinstance(given, sched.Schedule) else _named_schedule(given, S, B, f, b, cf,
                                                                         cb, eps)
  kinds, mbs = sch.arrays
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
  kcf = cf if L else np.zeros((1, B))
  kcb = cb if L else np.zeros((1, B))
  if sch.groups is not None:
    return _simulate_groups(sch, f, b, cf, cb, kcf, kcb, ends, ab, backend, t0)
  if backend == "reference":
    out = _sim_kernel.simulate_reference(kinds, mbs, f, b, kcf, kcb)
  else:
    use_numba = backend != "python" and _sim_kernel.HAVE_NUMBA
    out = _sim_kernel.simulate_kernel(kinds, mbs, f, b, kcf, kcb, use_numba=use_numba)
  status, start, end, msg_start, msg_end, stuck = out
  if status:  # the validator's dry run should have caught it; keep the message useful anyway
    raise ScheduleError("schedule deadlocks: every stage waits on another\n" +
                        sched.format_tables(sch.tables, marks=[
                            (s, int(p)) for s, p in enumerate(stuck) if p < kinds.shape[1]]))
  msg_start, msg_end = msg_start[:, :L], msg_end[:, :L]
  fields = _sim_kernel.analyze(kinds, start, end, msg_start, msg_end, ends)
  result = SimResult(schedule=sch, fwd_s=f, bwd_s=b, comm_fwd_s=cf, comm_bwd_s=cb, end_s=ends,
                     task_start=start, task_end=end, msg_start=msg_start, msg_end=msg_end,
                     act_bytes=ab, peak_inflight=sch.peak_inflight(),
                     wall_s=time.perf_counter() - t0, **fields)
  log.debug("simulated %s: S=%d B=%d in %.3f s -> iteration %.6g s", sch.name, S, B,
            result.wall_s, result.iteration_time)
  return result


def _group_arrays(sch: sched.Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray]:
  """``(stage, kind, microbatch, position in the stage's row)``, ``[G, n]`` int arrays of a
  schedule's group orders."""
  G = len(sch.groups)
  n = len(sch.groups[0])
  if any(len(row) != n for row in sch.groups):
    raise ScheduleError("the simulator needs device groups with equal numbers of tasks (the "
                        "same number of stages each)")
  arr = np.zeros((4, G, n), np.int64)
  seen = [0] * sch.num_stages
  for g, row in enumerate(sch.groups):
    for p, t in enumerate(row):
      arr[:, g, p] = (t.stage, t.kind == "B", t.microbatch, seen[t.stage])
      seen[t.stage] += 1
  return arr[0], arr[1], arr[2], arr[3]


def _simulate_groups(sch, f, b, cf, cb, kcf, kcb, ends, ab, backend, t0) -> SimResult:
  """:func:`simulate` of a schedule whose device groups run several stages each: the group
  kernel, its times put back in each stage's row. A stage's end time holds its group right
  after the stage's last task (its messages already sent; ``update_time`` keeps each stage's
  own)."""
  S, B, L = sch.num_stages, sch.num_microbatches, sch.num_stages - 1
  gstage, gkind, gmb, gpos = _group_arrays(sch)
  groups = sch.device_groups
  # Interleaved updates: each stage's end time (its reduction and update) holds its group
  # right after its last task, before the group's next task (another stage's backward).
  last = {}
  for g in range(gstage.shape[0]):
    for p in range(gstage.shape[1]):
      last[int(gstage[g, p])] = (g, p)
  hold = np.zeros(gstage.shape)
  for s, (g, p) in last.items():
    hold[g, p] = ends[s]
  if backend == "reference":
    out = _sim_kernel.simulate_groups_reference(gstage, gkind, gmb, f, b, kcf, kcb, groups,
                                                hold=hold)
  else:
    use_numba = backend != "python" and _sim_kernel.HAVE_NUMBA
    out = _sim_kernel.simulate_groups(gstage, gkind, gmb, f, b, kcf, kcb, groups,
                                      use_numba=use_numba, hold=hold)
  status, gstart, gend, msg_start, msg_end, stuck = out
  if status:
    raise ScheduleError("schedule deadlocks: every device group waits on another\n" +
                        sched.format_group_tables(sch.groups, marks=[
                            (g, int(p)) for g, p in enumerate(stuck) if p < gstage.shape[1]]))
  start = np.zeros((S, 2 * B))
  end = np.zeros((S, 2 * B))
  start[gstage, gpos] = gstart
  end[gstage, gpos] = gend
  # Each stage updates right after its last task, on its group's devices.
  upd_end = np.zeros(S)
  for s, (g, p) in last.items():
    upd_end[s] = float(gend[g, p]) + ends[s]
  msg_start, msg_end = msg_start[:, :L], msg_end[:, :L]
  kinds, _ = sch.arrays
  fields = _sim_kernel.analyze(kinds, start, end, msg_start, msg_end, upd_end - end[:, -1])
  fields["update_time"] = ends.copy()
  return SimResult(schedule=sch, fwd_s=f, bwd_s=b, comm_fwd_s=cf, comm_bwd_s=cb, end_s=ends,
                   task_start=start, task_end=end, msg_start=msg_start, msg_end=msg_end,
                   act_bytes=ab, peak_inflight=sch.peak_inflight(),
                   wall_s=time.perf_counter() - t0, **fields)


# --------------------------------------------------------------------------- inputs


def _coerce_schedule(schedule) -> sched.Schedule | ScheduleKind:
  """A :class:`Schedule` for tables and text, the registered kind for a name."""
  if isinstance(schedule, (sched.Schedule, ScheduleKind)):
    return schedule
  if isinstance(schedule, str):
    text = schedule.strip()
    if not (":" in text or "\n" in text or (text[:1] in ("F", "B") and text[1:2].isdigit())):
      return schedule_kind(schedule)
    tables = sched.parse_tables(text)
  elif schedule is None:
    raise ScheduleError("simulate needs a schedule: a name, a Schedule or task tables")
  else:
    tables = tuple(tuple(sched.as_task(t) for t in row) for row in schedule)
  if not tables:
    raise ScheduleError("a schedule needs at least one stage")
  num_mb = sum(1 for t in tables[0] if t.kind == "F")
  return sched.Schedule("custom", tables, num_mb)


def _infer_num_stages(fwd, bwd, comm, comm_fwd, comm_bwd) -> int:
  for x in (fwd, bwd):
    if np.ndim(x) >= 1:
      return int(np.shape(x)[0])
  for x in (comm_fwd, comm_bwd, comm):
    if x is not None and np.ndim(x) >= 1:
      return int(np.shape(x)[0]) + 1
  raise CostTablesError("cannot tell the number of stages: give fwd/bwd per stage or a table")


def _infer_num_microbatches(kind: ScheduleKind, num_microbatches, fwd, bwd) -> int:
  if num_microbatches is not None:
    return int(num_microbatches)
  for x in (fwd, bwd):
    if np.ndim(x) == 2:
      return int(np.shape(x)[1])
  raise ScheduleError(f"schedule={kind.name!r} by name needs num_microbatches")


def _named_schedule(kind: ScheduleKind, S, B, f, b, cf, cb, eps) -> sched.Schedule:
  """The kind's tables, its warm-up rule reading the largest time per microbatch of each
  stage and the mean of each link's two directions."""
  if not eps >= 0:
    raise ScheduleError(f"eps must be >= 0, got eps={eps}")
  c = (cf.max(axis=1) + cb.max(axis=1)) / 2 if S > 1 else np.zeros(0)
  costs = PipelineCosts(S, B, tuple(float(x) for x in (f + b).max(axis=1)),
                        tuple(float(x) for x in c), float(eps))
  return kind.schedule(S, B, kind.warmups(costs))


def _per_mb(name: str, x, rows: int, B: int) -> np.ndarray:
  if x is None:
    x = 0.0
  try:
    a = np.asarray(x, np.float64)
  except (TypeError, ValueError):
    raise CostTablesError(f"{name}={x!r} is not a number or an array of numbers") from None
  if a.ndim == 0:
    a = np.full((rows, B), float(a))
  elif a.ndim == 1 and a.shape[0] == rows:
    a = np.repeat(a[:, None], B, axis=1)
  elif a.ndim != 2 or a.shape != (rows, B):
    raise CostTablesError(f"{name} has shape {a.shape}; expected a scalar, [{rows}] or "
                          f"[{rows}, {B}]")
  _check_times(name, a)
  return np.ascontiguousarray(a)


def _per_stage(name: str, x, S: int) -> np.ndarray:
  a = np.asarray(x, np.float64)
  if a.ndim == 0:
    a = np.full(S, float(a))
  if a.shape != (S,):
    raise CostTablesError(f"{name} has shape {a.shape}; expected a scalar or [{S}]")
  _check_times(name, a)
  return a


def _check_times(name: str, a: np.ndarray) -> None:
  bad = ~np.isfinite(a) | (a < 0)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise CostTablesError(f"{name}[{', '.join(map(str, idx))}]={a[idx]}: times are finite "
                          "seconds >= 0")
