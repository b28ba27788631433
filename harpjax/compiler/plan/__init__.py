"""Phase 5, planning: the pipeline plan (stages, submeshes, logical meshes, H-1F1B warm-up
counts) that minimises the iteration time on cost tables, by HARP's DP (§5.2).

Modules: :mod:`~harpjax.compiler.plan.spec` (:class:`Plan`, :class:`StageSpec`, saved plans),
:mod:`~harpjax.compiler.plan.index` (device states and the DP's sparse index),
:mod:`~harpjax.compiler.plan.dp_kernel` (the DP at one ``t_max``: Numba kernel and NumPy
twin), :mod:`~harpjax.compiler.plan.evaluate` (scoring any plan, diagnosing infeasibility),
:mod:`~harpjax.compiler.plan.solve` (:func:`solve`: the search over ``t_max``) and
:mod:`~harpjax.compiler.plan.baselines` (brute force and the paper's baselines).
"""

from harpjax.compiler.plan.evaluate import PlanEvaluation as PlanEvaluation
from harpjax.compiler.plan.evaluate import PlannedStage as PlannedStage
from harpjax.compiler.plan.evaluate import evaluate_plan as evaluate_plan
from harpjax.compiler.plan.solve import PlanResult as PlanResult
from harpjax.compiler.plan.solve import SearchStats as SearchStats
from harpjax.compiler.plan.solve import SolveOptions as SolveOptions
from harpjax.compiler.plan.solve import register_parallel_backend as register_parallel_backend
from harpjax.compiler.plan.solve import evaluate_candidates as evaluate_candidates
from harpjax.compiler.plan.solve import solve as solve
from harpjax.compiler.plan.spec import ManualPlan as ManualPlan
from harpjax.compiler.plan.spec import Plan as Plan
from harpjax.compiler.plan.spec import StageSpec as StageSpec
from harpjax.compiler.plan.spec import load_plan as load_plan
from harpjax.compiler.plan.index import SparseIndex as SparseIndex

__all__ = [
    "evaluate_candidates", "evaluate_plan", "load_plan", "ManualPlan", "Plan", "PlanEvaluation",
    "PlannedStage", "PlanResult", "register_parallel_backend", "SearchStats", "solve",
    "SolveOptions", "SparseIndex", "StageSpec",
]
