"""harpjax: automatic pipeline-parallel training on heterogeneous GPU clusters (HARP)."""

from harpjax.errors import HarpjaxError as HarpjaxError
from harpjax.compiler.plan import ManualPlan as ManualPlan
from harpjax.compiler.plan import Plan as Plan
from harpjax.compiler.plan import StageSpec as StageSpec
from harpjax.compiler.schedules import make_schedule as make_schedule

__version__ = "0.1.0"

__all__ = ["HarpjaxError", "ManualPlan", "Plan", "StageSpec", "make_schedule", "__version__"]
