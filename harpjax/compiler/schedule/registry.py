"""Schedules in one place: every kind of pipeline schedule, registered once with its rules.

A :class:`ScheduleKind` holds what the rest of harpjax needs to know about a schedule: its
name and the spellings accepted for it, its *warm-up rule* (how many forwards each stage
launches before its first backward, from the pipeline's costs: a
:class:`~harpjax.compiler.schedule.warmup.PipelineCosts`), how its task tables follow from
those counts, and so what each stage holds in flight (the microbatches whose residuals wait
for their backward: the memory check of the planner and of every plan evaluation). The plan
evaluators, the planner's choice of schedule, the simulator, the runtime's resolution of a
plan and the command line all read the registry; none of them compares names.

Four kinds are built in, in this order (stages 0-indexed, ``S`` stages, ``B`` microbatches):

* ``gpipe`` (GPipe): ``N_i = B``;
* ``1f1b`` (1F1B, PipeDream-Flush): ``N_i = S - i``;
* ``eager_1f1b`` (Eager-1F1B): ``N_i = 2 (S - 1 - i) + 1``;
* ``h1f1b`` (H-1F1B, HARP Eq. 1-2): ``N_{S-1} = 1``, ``N_i = N_{i+1} + delta_i`` with the
  cut's cost relative to the pipeline's period
  (:func:`~harpjax.compiler.schedule.warmup.h1f1b_rule`); the only one that reads the costs
  and ``eps``.

The planner ranks the kinds marked :attr:`ScheduleKind.ranked` (1F1B, Eager-1F1B and H-1F1B)
on the stages it found and keeps the fastest that fits memory
(:func:`harpjax.compiler.plan.choose_schedule`). A user's own kind is registered with
:func:`register_schedule`; see ``docs/schedules.md``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

from harpjax.compiler.schedule import interleaved as interleaved_lib
from harpjax.compiler.schedule.tasks import (peak_inflight, Schedule, Tables,
                                             table_from_warmups)
from harpjax.compiler.schedule.warmup import (check_positive, eager_1f1b_warmups,
                                              gpipe_warmups, h1f1b_rule, one_f_one_b_warmups,
                                              PipelineCosts)
from harpjax.errors import ScheduleError

__all__ = ["ScheduleKind", "WarmupRule", "TableBuilder", "register_schedule",
           "unregister_schedule", "schedule_kind", "schedule_key", "schedule_names",
           "registered_schedules", "ranked_schedules", "make_schedule", "SCHEDULE_NAMES",
           "GPIPE", "ONE_F_ONE_B", "EAGER_1F1B", "H1F1B", "interleaved_kind", "INTERLEAVED", "INTERLEAVED_NAMES"]

WarmupRule = Callable[[PipelineCosts], Sequence[int]]
"""``rule(costs) -> [S]`` warm-up counts, each ``>= 1``."""

TableBuilder = Callable[[int, int, Sequence[int]], Tables]
"""``build(num_stages, num_microbatches, warmups) -> tables`` (one tuple of tasks per stage)."""


def _spelling(name: str) -> str:
  """What names are compared by: lower case, without ``-``, ``_`` and blanks."""
  return re.sub(r"[-_\s]", "", str(name).lower())


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
  """A kind of pipeline schedule and its rules.

  Attributes:
    name: the canonical name (what plans and :class:`~harpjax.compiler.schedule.Schedule`
      record), e.g. ``"eager_1f1b"``.
    warmup_rule: ``rule(costs: PipelineCosts) -> [S]`` counts: the forwards stage ``i``
      launches before its first backward.
    aliases: other spellings accepted for it (names are compared in lower case, without
      ``-``, ``_`` and blanks).
    title: how people write it (``"Eager-1F1B"``); default the name.
    uses_costs: the rule reads the stage times, cut costs and ``eps`` (H-1F1B); the others'
      counts depend on ``S`` and ``B`` alone, and counts given to :meth:`schedule` must be
      theirs.
    ranked: the planner ranks it on the stages it finds
      (:func:`harpjax.compiler.plan.choose_schedule`).
    build_tables: ``build(S, B, warmups) -> tables``; default
      :func:`~harpjax.compiler.schedule.table_from_warmups` (warm-up forwards, then one
      backward and one forward alternately, then the remaining backwards).
    chunks: ``v``, the stages each device group runs (an interleaved schedule,
      :func:`interleaved_kind`): stage ``i`` runs on group ``i mod (S / v)``, and the kind's
      schedules carry each group's order of tasks
      (:attr:`~harpjax.compiler.schedule.Schedule.groups`). ``1``: a group per stage.
  """
  name: str
  warmup_rule: WarmupRule
  aliases: tuple[str, ...] = ()
  title: str = ""
  uses_costs: bool = False
  ranked: bool = False
  build_tables: TableBuilder = table_from_warmups
  chunks: int = 1

  def __post_init__(self):
    if not isinstance(self.name, str) or not _spelling(self.name) or _spelling(
        self.name) == "custom":
      raise ScheduleError(f"ScheduleKind(name={self.name!r}): a schedule's name is a non-empty "
                          "string other than 'custom' (the label of a hand-written table)")
    aliases = (self.aliases,) if isinstance(self.aliases, str) else tuple(self.aliases)
    for a in aliases:
      if not isinstance(a, str) or not _spelling(a):
        raise ScheduleError(f"ScheduleKind {self.name!r}: alias {a!r} must be a non-empty "
                            "string")
    object.__setattr__(self, "aliases", aliases)
    if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
      raise ScheduleError(f"ScheduleKind {self.name!r}: chunks={self.chunks!r} must be an "
                          "integer >= 1 (model chunks per device group)")
    for field in ("warmup_rule", "build_tables"):
      if not callable(getattr(self, field)):
        raise ScheduleError(f"ScheduleKind {self.name!r}: {field}={getattr(self, field)!r} "
                            "must be a function")

  @property
  def label(self) -> str:
    """:attr:`title`, else :attr:`name`."""
    return self.title or self.name

  def spellings(self) -> tuple[str, ...]:
    """The normalised names this kind answers to."""
    return tuple(dict.fromkeys(_spelling(n) for n in (self.name, self.title) + self.aliases
                               if n))

  def warmups(self, costs: PipelineCosts) -> tuple[int, ...]:
    """Its warm-up counts for a pipeline: the rule's answer, checked.

    Raises:
      ScheduleError: the rule returned other than ``S`` integers ``>= 1``.
    """
    counts = tuple(self.warmup_rule(costs))
    if len(counts) != costs.num_stages or any(
        isinstance(w, bool) or int(w) != w or w < 1 for w in counts):
      raise ScheduleError(f"the warm-up rule of schedule {self.name!r} returned {counts} for "
                          f"{costs.num_stages} stages; it must return one integer >= 1 per "
                          "stage")
    return tuple(int(w) for w in counts)

  def default_warmups(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Its counts when nothing is known about the costs (links taken as free)."""
    return self.warmups(PipelineCosts(num_stages, num_microbatches))

  def schedule(self, num_stages: int, num_microbatches: int,
               warmups: Sequence[int] | None = None) -> Schedule:
    """Its validated task tables.

    Args:
      num_stages: ``S``.
      num_microbatches: ``B``.
      warmups: per-stage warm-up counts; default :meth:`default_warmups`. A kind that does
        not read the costs only accepts its own counts.

    Raises:
      ScheduleError: non-positive sizes, or counts that contradict the kind.
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    default = None
    if warmups is None:
      counts = default = self.default_warmups(num_stages, num_microbatches)
    else:
      counts = tuple(int(w) for w in warmups)
      if not self.uses_costs:
        default = self.default_warmups(num_stages, num_microbatches)
        if counts != default:
          others = [k.name for k in registered_schedules() if k.uses_costs]
          raise ScheduleError(
              f"schedule {self.name!r} has fixed warm-up counts {default}; got warmups="
              f"{counts}. Use a schedule whose warm-ups follow the costs ({', '.join(others)}) "
              "for other counts, or build a Schedule from your own tables")
    groups = None
    if self.chunks > 1:
      groups = interleaved_lib.interleaved_group_tables(
          interleaved_lib.num_groups_of(num_stages, self.chunks), self.chunks,
          num_microbatches)
    return Schedule(self.name, self.build_tables(num_stages, num_microbatches, counts),
                    num_microbatches, counts, groups)

  def device_groups(self, num_stages: int) -> tuple[int, ...]:
    """Per stage, the device group that runs it: ``i mod (S / v)`` (``i`` when ``v = 1``).

    Raises:
      ScheduleError: ``S`` is not a multiple of :attr:`chunks`.
    """
    d = interleaved_lib.num_groups_of(num_stages, self.chunks)
    return tuple(i % d for i in range(num_stages))

  def inflight(self, num_stages: int, num_microbatches: int,
               warmups: Sequence[int]) -> tuple[int, ...]:
    """Per stage, the most microbatches whose residuals it holds at once under the counts
    ``warmups`` (``min(N_i, B)`` for the 1F1B-style tables): what the memory checks multiply
    the activation bytes by."""
    if self.build_tables is table_from_warmups:
      return tuple(min(int(w), int(num_microbatches)) for w in warmups)
    return peak_inflight(self.build_tables(num_stages, num_microbatches, tuple(warmups)))


# --------------------------------------------------------------------------- the registry

_REGISTRY: dict[str, ScheduleKind] = {}   # canonical name -> kind, in registration order
_SPELLINGS: dict[str, str] = {}            # normalised spelling -> canonical name


def register_schedule(kind: ScheduleKind, *, replace: bool = False) -> ScheduleKind:
  """Registers a schedule kind under its name and aliases; returns it.

  Args:
    kind: the :class:`ScheduleKind`.
    replace: replace a registered kind of the same name (its spellings go with it).

  Raises:
    ScheduleError: the name or a spelling is taken by another kind (or by this name, unless
      ``replace``).
  """
  if not isinstance(kind, ScheduleKind):
    raise ScheduleError(f"register_schedule needs a ScheduleKind, got {type(kind).__name__}")
  if kind.name in _REGISTRY and not replace:
    raise ScheduleError(f"a schedule named {kind.name!r} is registered already; pass "
                        "replace=True to replace it")
  for sp in kind.spellings():
    owner = _SPELLINGS.get(sp)
    if owner is not None and owner != kind.name:
      raise ScheduleError(f"schedule {kind.name!r}: the spelling {sp!r} names schedule "
                          f"{owner!r} already; choose another name or alias")
  if kind.name in _REGISTRY:
    _drop(kind.name)
  _REGISTRY[kind.name] = kind
  for sp in kind.spellings():
    _SPELLINGS[sp] = kind.name
  return kind


def unregister_schedule(name: str) -> ScheduleKind:
  """Removes a kind registered with :func:`register_schedule` (built-in ones stay).

  Raises:
    ScheduleError: unknown name, or a built-in kind.
  """
  kind = schedule_kind(name)
  if kind.name in SCHEDULE_NAMES + INTERLEAVED_NAMES:
    raise ScheduleError(f"schedule {kind.name!r} is built in and stays registered")
  _drop(kind.name)
  return kind


def _drop(name: str) -> None:
  del _REGISTRY[name]
  for sp in [sp for sp, owner in _SPELLINGS.items() if owner == name]:
    del _SPELLINGS[sp]


def schedule_kind(name: "str | ScheduleKind") -> ScheduleKind:
  """The registered kind a name (any accepted spelling) stands for; a kind is returned as is.

  Raises:
    ScheduleError: for an unknown name.
  """
  if isinstance(name, ScheduleKind):
    return name
  key = _SPELLINGS.get(_spelling(name))
  if key is None:
    raise ScheduleError(f"unknown schedule {name!r}; choose one of "
                        f"{', '.join(schedule_names())} (or register one: "
                        "harpjax.compiler.schedule.register_schedule)")
  return _REGISTRY[key]


def schedule_key(name: str) -> str:
  """The canonical name of a schedule spelling.

  ``"H-1F1B"``, ``"h1f1b"`` and ``"harp"`` give ``"h1f1b"``; ``"Eager-1F1B"`` and ``"eager"``
  give ``"eager_1f1b"``; ``"PipeDream-Flush"`` gives ``"1f1b"``.

  Raises:
    ScheduleError: for an unknown name.
  """
  return schedule_kind(name).name


def registered_schedules() -> tuple[ScheduleKind, ...]:
  """Every registered kind, built-in ones first, in registration order."""
  return tuple(_REGISTRY.values())


def schedule_names() -> tuple[str, ...]:
  """The canonical names of every registered kind."""
  return tuple(_REGISTRY)


def ranked_schedules() -> tuple[ScheduleKind, ...]:
  """The kinds the planner ranks (:attr:`ScheduleKind.ranked`)."""
  return tuple(k for k in _REGISTRY.values() if k.ranked)


def make_schedule(name: "str | ScheduleKind", num_stages: int, num_microbatches: int,
                  warmups: Sequence[int] | None = None) -> Schedule:
  """Generates a registered schedule's task tables.

  Args:
    name: a registered name or spelling (:func:`schedule_names`), or a
      :class:`ScheduleKind`.
    num_stages: ``S``.
    num_microbatches: ``B``.
    warmups: per-stage warm-up counts. What gives ``"h1f1b"`` its meaning (use
      :func:`~harpjax.compiler.schedule.h1f1b_warmups`); without them H-1F1B assumes free
      links and equals 1F1B. For a kind whose counts do not depend on the costs, if given,
      they must equal its own.

  Returns:
    A validated :class:`~harpjax.compiler.schedule.Schedule`.

  Raises:
    ScheduleError: unknown name, non-positive sizes, or counts that contradict the name.
  """
  return schedule_kind(name).schedule(num_stages, num_microbatches, warmups)


# --------------------------------------------------------------------------- built-in kinds

GPIPE = register_schedule(ScheduleKind(
    "gpipe", lambda c: gpipe_warmups(c.num_stages, c.num_microbatches), title="GPipe"))
ONE_F_ONE_B = register_schedule(ScheduleKind(
    "1f1b", lambda c: one_f_one_b_warmups(c.num_stages), title="1F1B",
    aliases=("pipedream", "PipeDream-Flush"), ranked=True))
EAGER_1F1B = register_schedule(ScheduleKind(
    "eager_1f1b", lambda c: eager_1f1b_warmups(c.num_stages), title="Eager-1F1B",
    aliases=("eager",), ranked=True))
H1F1B = register_schedule(ScheduleKind(
    "h1f1b", h1f1b_rule, title="H-1F1B", aliases=("harp",), uses_costs=True, ranked=True))



def interleaved_kind(chunks: int) -> ScheduleKind:
  """The interleaved 1F1B kind with ``chunks`` (``v >= 2``) model chunks per device group
  (:mod:`~harpjax.compiler.schedule.interleaved`): named ``interleaved`` for ``v = 2``, else
  ``interleaved_v<v>``; the registered one if there is one, else registered now."""
  if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
    raise ScheduleError(f"interleaved_kind(chunks={chunks!r}): an interleaved schedule runs "
                        "an integer v >= 2 chunks per device group")
  name = "interleaved" if chunks == 2 else f"interleaved_v{chunks}"
  if name in _REGISTRY:
    return _REGISTRY[name]
  return register_schedule(ScheduleKind(
      name, lambda c: interleaved_lib.interleaved_warmups(c.num_stages, c.num_microbatches,
                                                          chunks),
      title=f"Interleaved-1F1B (v={chunks})",
      aliases=("interleaved_v2", "interleaved_1f1b") if chunks == 2 else (),
      build_tables=lambda S, B, w: interleaved_lib.interleaved_tables(S, B, chunks),
      chunks=chunks))


INTERLEAVED = interleaved_kind(2)
for _v in (3, 4):
  interleaved_kind(_v)

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager_1f1b", "h1f1b")
"""The built-in schedules with a device group per stage (:func:`schedule_names` lists the
interleaved ones and those registered since too)."""

INTERLEAVED_NAMES = ("interleaved", "interleaved_v3", "interleaved_v4")
"""The built-in interleaved schedules (``v = 2, 3, 4``; :func:`interleaved_kind` registers
others)."""
