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

from harpjax.compiler.schedule import timeline
from harpjax.compiler.schedule.sim_kernel import iteration_time_kernel, iteration_times
from harpjax.compiler.schedule.simulator import SimResult, simulate, TimelineEvent
from harpjax.compiler.schedule.tasks import (as_task, dry_run, format_tables, make_schedule,
                                             parse_tables, peak_inflight, Schedule, schedule_key,
                                             SCHEDULE_NAMES, table_from_warmups, table_warmups,
                                             tables_to_arrays, Task, validate_tables)
from harpjax.compiler.schedule.warmup import (eager_1f1b_warmups, gpipe_warmups, h1f1b_warmups,
                                              one_f_one_b_warmups, pipeline_period, plan_warmups,
                                              warmup_delta)

__all__ = [
    "as_task", "dry_run", "eager_1f1b_warmups", "format_tables", "gpipe_warmups", "h1f1b_warmups",
    "iteration_time_kernel", "iteration_times",
    "make_schedule", "one_f_one_b_warmups", "parse_tables", "peak_inflight", "pipeline_period",
    "plan_warmups",
    "Schedule", "schedule_key", "SCHEDULE_NAMES", "SimResult", "simulate", "table_from_warmups",
    "table_warmups", "tables_to_arrays", "Task", "timeline", "TimelineEvent", "validate_tables",
    "warmup_delta",
]
