"""Phase 5, planning: the pipeline plan (stages, submeshes, logical meshes, the schedule and its
warm-up counts) that minimises the iteration time on cost tables, by HARP's DP (§5.2).

Modules: :mod:`~harpjax.compiler.plan.spec` (:class:`Plan`, :class:`StageSpec`, saved plans),
:mod:`~harpjax.compiler.plan.index` (device states and the DP's sparse index),
:mod:`~harpjax.compiler.plan.dp_kernel` (the DP at one ``t_max``: Numba kernel and NumPy
twin), :mod:`~harpjax.compiler.plan.evaluate` (scoring any plan, diagnosing infeasibility) and
:mod:`~harpjax.compiler.plan.solve` (:func:`solve`: the search over ``t_max``, for every
objective, transfer fees counted in the money and the budget),
:mod:`~harpjax.compiler.plan.schedule_choice` (:func:`choose_schedule`: the registered
schedules ranked on the stages found) and
:mod:`~harpjax.compiler.plan.variants` (each stage's ZeRO level, optimizer-state offload and
residual offload as variants of its submesh) and :mod:`~harpjax.compiler.plan.mixed`
(mixed-type stages: their cost model, :func:`evaluate_mixed` and :func:`solve_mixed`, what
``solve(mixed_stages=...)`` runs), :mod:`~harpjax.compiler.plan.zebra_stages` (zebra stages,
attention and experts of a routed model on two groups, as virtual subclusters of the same
search) and :mod:`~harpjax.compiler.plan.expert_assignment` (which experts a zebra stage moves
onto its attention group).
The paper's
baseline planners, which the benchmarks compare with, are ``tools/baselines.py``.
"""

from harpjax.compiler.plan.evaluate import evaluate_plan, PlanEvaluation, PlannedStage
from harpjax.compiler.plan.schedule_choice import (choose_schedule, plan_scorer, RANK,
                                                   ScheduleScore, schedule_scores)
from harpjax.compiler.plan.solve import (COST_MODELS, evaluate_candidates, OBJECTIVES,
                                         Objective, OBJECTIVE_REGISTRY, objective_of,
                                         PlanResult, register_parallel_backend, SearchStats,
                                         single_subcluster, solve, SolveOptions)
from harpjax.compiler.plan.spec import (check_device_groups, LAYER_SOURCES, load_plan,
                                        ManualPlan, Plan, REMAT_MODES, row_shares,
                                        StageGroup, StageSpec, ZebraGroup)
from harpjax.compiler.plan.index import SparseIndex
from harpjax.compiler.plan.variants import expand_variants, VariantOptions
from harpjax.compiler.plan.mixed import (candidate_fusions, evaluate_mixed, Fusion,
                                         fused_tables, MIXED_MODES, MixedEvaluation,
                                         MixedOptions, mixed_cut_s, mixed_scorer,
                                         mixed_stage_cost, MixedStageCost, solve_mixed,
                                         zebra_mixed_cost)
from harpjax.compiler.plan.interleave_choice import (choose_interleaving, chunk_sizes,
                                                     interleave, InterleaveChoice)
from harpjax.compiler.plan.zebra_stages import (candidate_zebra_shapes, ZEBRA_MODES,
                                                zebra_for_runtime, zebra_group_bytes,
                                                ZebraOptions, ZebraShape, ZebraStageCost,
                                                zebra_stage_cost)

__all__ = [
    "candidate_fusions", "choose_schedule", "COST_MODELS", "evaluate_candidates", "evaluate_mixed",
    "evaluate_plan", "expand_variants", "Fusion", "fused_tables", "LAYER_SOURCES", "load_plan", "ManualPlan",
    "MIXED_MODES", "MixedEvaluation", "MixedOptions", "mixed_cut_s", "mixed_scorer",
    "mixed_stage_cost", "MixedStageCost", "OBJECTIVES", "Objective", "OBJECTIVE_REGISTRY", "objective_of", "Plan", "plan_scorer", "PlanEvaluation",
    "PlannedStage", "PlanResult", "RANK", "REMAT_MODES", "register_parallel_backend", "row_shares",
    "schedule_scores", "ScheduleScore", "SearchStats", "single_subcluster", "solve", "solve_mixed",
    "check_device_groups", "SolveOptions", "SparseIndex", "StageGroup", "StageSpec",
    "VariantOptions",
    "candidate_zebra_shapes", "ZEBRA_MODES", "zebra_for_runtime", "zebra_group_bytes",
    "ZebraGroup", "zebra_mixed_cost", "ZebraOptions",
    "ZebraShape", "ZebraStageCost", "zebra_stage_cost",
    "choose_interleaving", "chunk_sizes", "interleave", "InterleaveChoice",
]
