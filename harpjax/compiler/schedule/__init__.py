"""Phase 4, schedules: task tables (GPipe, 1F1B, Eager-1F1B, H-1F1B), their warm-up counts, the
simulator every plan and runtime is measured against, and timelines.

Modules: :mod:`~harpjax.compiler.schedule.warmup` (warm-up counts; the one
:func:`warmup_delta`), :mod:`~harpjax.compiler.schedule.tasks` (:class:`Task`,
:class:`Schedule`, :func:`make_schedule`, validation and the dependency-valid order
:func:`dry_run`), :mod:`~harpjax.compiler.schedule.sim_kernel` (the simulator's Numba kernel,
its Python twin and an event-driven reference), :mod:`~harpjax.compiler.schedule.simulator`
(:func:`simulate`) and :mod:`~harpjax.compiler.schedule.timeline` (Chrome traces, Gantt
charts). A new schedule is a new way to derive warm-up counts (``make_schedule``) or any table
that passes :func:`validate_tables`.
"""

from harpjax.compiler.schedule import timeline as timeline
from harpjax.compiler.schedule.simulator import SimResult as SimResult
from harpjax.compiler.schedule.simulator import TimelineEvent as TimelineEvent
from harpjax.compiler.schedule.simulator import simulate as simulate
from harpjax.compiler.schedule.tasks import SCHEDULE_NAMES as SCHEDULE_NAMES
from harpjax.compiler.schedule.tasks import Schedule as Schedule
from harpjax.compiler.schedule.tasks import Task as Task
from harpjax.compiler.schedule.tasks import dry_run as dry_run
from harpjax.compiler.schedule.tasks import format_tables as format_tables
from harpjax.compiler.schedule.tasks import make_schedule as make_schedule
from harpjax.compiler.schedule.tasks import parse_tables as parse_tables
from harpjax.compiler.schedule.tasks import peak_inflight as peak_inflight
from harpjax.compiler.schedule.tasks import schedule_key as schedule_key
from harpjax.compiler.schedule.tasks import table_from_warmups as table_from_warmups
from harpjax.compiler.schedule.tasks import table_warmups as table_warmups
from harpjax.compiler.schedule.tasks import tables_to_arrays as tables_to_arrays
from harpjax.compiler.schedule.tasks import as_task as as_task
from harpjax.compiler.schedule.tasks import validate_tables as validate_tables
from harpjax.compiler.schedule.warmup import eager_1f1b_warmups as eager_1f1b_warmups
from harpjax.compiler.schedule.warmup import gpipe_warmups as gpipe_warmups
from harpjax.compiler.schedule.warmup import h1f1b_warmups as h1f1b_warmups
from harpjax.compiler.schedule.warmup import one_f_one_b_warmups as one_f_one_b_warmups
from harpjax.compiler.schedule.warmup import plan_warmups as plan_warmups
from harpjax.compiler.schedule.warmup import warmup_delta as warmup_delta

__all__ = [
    "dry_run", "eager_1f1b_warmups", "format_tables", "gpipe_warmups", "h1f1b_warmups",
    "make_schedule", "one_f_one_b_warmups", "plan_warmups", "parse_tables", "peak_inflight", "Schedule",
    "schedule_key", "SCHEDULE_NAMES", "SimResult", "simulate", "table_from_warmups",
    "table_warmups", "tables_to_arrays", "as_task", "Task", "timeline", "TimelineEvent", "validate_tables", "warmup_delta",
]
