"""harpjax: automatic pipeline-parallel training on heterogeneous GPU clusters (HARP)."""

from harpjax.api import ParallelStep as ParallelStep
from harpjax.api import auto_parallel as auto_parallel
from harpjax.cluster import Cluster as Cluster
from harpjax.cluster import GPU_CATALOG as GPU_CATALOG
from harpjax.cluster import GPUType as GPUType
from harpjax.compiler.cost_tables import CostTables as CostTables
from harpjax.compiler.layers import LayerOptions as LayerOptions
from harpjax.compiler.layers import LayerSequence as LayerSequence
from harpjax.compiler.plan import ManualPlan as ManualPlan
from harpjax.compiler.plan import Plan as Plan
from harpjax.compiler.plan import StageSpec as StageSpec
from harpjax.compiler.plan import load_plan as load_plan
from harpjax.compiler.planner import SolveOptions as SolveOptions
from harpjax.compiler.planner import solve as solve
from harpjax.compiler.profile import ProfileOptions as ProfileOptions
from harpjax.compiler.schedules import Schedule as Schedule
from harpjax.compiler.schedules import make_schedule as make_schedule
from harpjax.compiler.trace import grad as grad
from harpjax.compiler.trace import mark_layer_boundary as mark_layer_boundary
from harpjax.compiler.trace import value_and_grad as value_and_grad
from harpjax.errors import HarpjaxError as HarpjaxError

__version__ = "0.1.0"

__all__ = [
    "Cluster", "CostTables", "GPU_CATALOG", "GPUType", "HarpjaxError", "LayerOptions",
    "LayerSequence", "ManualPlan", "ParallelStep", "Plan", "ProfileOptions", "Schedule",
    "SolveOptions", "StageSpec", "auto_parallel", "grad", "load_plan", "make_schedule",
    "mark_layer_boundary", "solve", "value_and_grad", "__version__",
]
