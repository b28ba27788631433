"""Phase 4, schedules: task tables (GPipe, 1F1B, Eager-1F1B, H-1F1B, interleaved 1F1B), their warm-up counts, the
registry that holds each kind of schedule once, the simulator every plan and runtime is
measured against, and timelines.

Modules: :mod:`~harpjax.compiler.schedule.warmup` (warm-up counts; the one
:func:`warmup_delta` and the one H-1F1B recurrence :func:`h1f1b_counts`),
:mod:`~harpjax.compiler.schedule.tasks` (:class:`Task`, :class:`Schedule`, validation and the
dependency-valid order :func:`dry_run`), :mod:`~harpjax.compiler.schedule.registry`
(:class:`ScheduleKind`: each schedule's name, warm-up rule, tables and memory in flight;
:func:`register_schedule`, :func:`make_schedule`), :mod:`~harpjax.compiler.schedule.sim_kernel`
(the simulator's Numba kernel, its Python twin and an event-driven reference),
:mod:`~harpjax.compiler.schedule.simulator` (:func:`simulate`) and
:mod:`~harpjax.compiler.schedule.timeline` (Chrome traces, Gantt charts) and
:mod:`~harpjax.compiler.schedule.zebra` (a mixture-of-experts stage split between an attention
group and an expert group: its tasks, Theorem 1's order, its event-driven simulator; its array kernel in
:mod:`~harpjax.compiler.schedule.zebra_kernel`). A new schedule is a
registered :class:`ScheduleKind`, or any table that passes :func:`validate_tables`.
"""

from harpjax.compiler.schedule import timeline
from harpjax.compiler.schedule.interleaved import (chunk_residency, ChunkResidency,
                                                   group_activation_peaks, group_warmups,
                                                   interleaved_group_tables,
                                                   interleaved_tables, interleaved_warmups,
                                                   prefetch_stalls, update_positions,
                                                   activations_after)
from harpjax.compiler.schedule.registry import (EAGER_1F1B, GPIPE, H1F1B, INTERLEAVED,
                                                interleaved_kind, make_schedule,
                                                ONE_F_ONE_B, ranked_schedules,
                                                register_schedule, registered_schedules,
                                                SCHEDULE_NAMES, schedule_key, schedule_kind,
                                                schedule_names, ScheduleKind,
                                                unregister_schedule)
from harpjax.compiler.schedule.sim_kernel import iteration_time_kernel, iteration_times
from harpjax.compiler.schedule.simulator import SimResult, simulate, TimelineEvent
from harpjax.compiler.schedule.tasks import (as_task, dry_run, dry_run_groups,
                                             format_group_tables, format_tables, GroupTables,
                                             parse_tables, peak_inflight, Schedule,
                                             StageTask, table_from_warmups, tables_from_groups,
                                             table_warmups, tables_to_arrays, Task,
                                             validate_tables)
from harpjax.compiler.schedule.warmup import (eager_1f1b_warmups, gpipe_warmups, h1f1b_counts,
                                              h1f1b_rule, h1f1b_warmups, one_f_one_b_warmups,
                                              PipelineCosts, pipeline_period, plan_warmups,
                                              warmup_delta)
from harpjax.compiler.schedule.zebra import (bipartite_all_to_all_time_s, simulate_zebra,
                                             theorem1_iteration_time,
                                             theorem1_iteration_times, theorem1_order,
                                             zebra_arrays, ZebraArrays, ZebraCosts, ZebraOrder,
                                             ZebraResult, ZebraTask)

__all__ = [
    "as_task", "dry_run", "EAGER_1F1B", "eager_1f1b_warmups", "format_tables", "GPIPE",
    "gpipe_warmups", "H1F1B", "h1f1b_counts", "h1f1b_rule", "h1f1b_warmups",
    "iteration_time_kernel", "iteration_times", "make_schedule", "ONE_F_ONE_B",
    "one_f_one_b_warmups", "parse_tables", "peak_inflight", "PipelineCosts", "pipeline_period",
    "plan_warmups", "ranked_schedules", "register_schedule", "registered_schedules",
    "Schedule", "schedule_key", "schedule_kind", "schedule_names", "SCHEDULE_NAMES",
    "ScheduleKind", "SimResult", "simulate", "table_from_warmups", "table_warmups",
    "tables_to_arrays", "Task", "timeline", "TimelineEvent", "unregister_schedule",
    "validate_tables", "warmup_delta", "bipartite_all_to_all_time_s", "simulate_zebra", "theorem1_iteration_time", "theorem1_iteration_times", "theorem1_order",
    "zebra_arrays", "ZebraArrays", "ZebraCosts",
    "ZebraOrder", "ZebraResult", "ZebraTask", "dry_run_groups", "format_group_tables",
    "GroupTables", "group_activation_peaks", "group_warmups", "INTERLEAVED", "interleaved_group_tables",
    "interleaved_kind", "interleaved_tables", "interleaved_warmups", "StageTask",
    "tables_from_groups", "chunk_residency", "ChunkResidency", "prefetch_stalls",
    "update_positions", "activations_after",
]
