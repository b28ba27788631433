"""harpjax: automatic pipeline-parallel training on heterogeneous GPU clusters (HARP)."""

from harpjax.errors import exit_on_interrupt_while_starting as _exit_on_interrupt

_exit_on_interrupt()   # `python -m harpjax`: Ctrl-C during the imports below is one line too

from harpjax._version import __version__ as __version__
from harpjax.api import ParallelStep as ParallelStep
from harpjax.api import auto_parallel as auto_parallel
from harpjax.options import AutoPlan as AutoPlan
from harpjax.options import ParallelOptions as ParallelOptions
from harpjax.phases import LaidOut as LaidOut
from harpjax.phases import Planned as Planned
from harpjax.phases import Traced as Traced
from harpjax.cluster import Cluster as Cluster
from harpjax.cluster import GPU_CATALOG as GPU_CATALOG
from harpjax.cluster import GPUType as GPUType
from harpjax.compiler.layers import LayerOptions as LayerOptions
from harpjax.compiler.layers import LayerSequence as LayerSequence
from harpjax.compiler.layers import LogicalMesh as LogicalMesh
from harpjax.compiler.plan import ManualPlan as ManualPlan
from harpjax.compiler.plan import MixedOptions as MixedOptions
from harpjax.compiler.plan import Plan as Plan
from harpjax.compiler.plan import SolveOptions as SolveOptions
from harpjax.compiler.plan import StageGroup as StageGroup
from harpjax.compiler.plan import StageSpec as StageSpec
from harpjax.compiler.plan import ZebraGroup as ZebraGroup
from harpjax.compiler.plan import ZebraOptions as ZebraOptions
from harpjax.compiler.plan import load_plan as load_plan
from harpjax.compiler.plan import solve as solve
from harpjax.compiler.profile import CostTables as CostTables
from harpjax.compiler.profile import ProfileOptions as ProfileOptions
from harpjax.compiler.schedule import Schedule as Schedule
from harpjax.compiler.schedule import make_schedule as make_schedule
from harpjax.compiler.stages import OffloadOptions as OffloadOptions
from harpjax.compiler.trace import grad as grad
from harpjax.compiler.trace import mark_layer_boundary as mark_layer_boundary
from harpjax.compiler.trace import value_and_grad as value_and_grad
from harpjax.errors import BatchCouplingError as BatchCouplingError
from harpjax.errors import BatchCouplingWarning as BatchCouplingWarning
from harpjax.errors import HarpjaxError as HarpjaxError
from harpjax.errors import InvalidOptionError as InvalidOptionError
from harpjax.errors import OptionConflictError as OptionConflictError
from harpjax.errors import OptionsError as OptionsError
from harpjax.errors import UnknownOptionError as UnknownOptionError
from harpjax.runtime import CheckpointOptions as CheckpointOptions
from harpjax.runtime import Checkpointer as Checkpointer
from harpjax.runtime import ElasticOptions as ElasticOptions
from harpjax.runtime import Emulation as Emulation
from harpjax.runtime import Failure as Failure
from harpjax.runtime import LocalRuntime as LocalRuntime
from harpjax.runtime import RayRuntime as RayRuntime
from harpjax.runtime import Recovery as Recovery
from harpjax.runtime import RunnerOptions as RunnerOptions
from harpjax.runtime import gather as gather
from harpjax.runtime import restore_checkpoint as restore_checkpoint
from harpjax.runtime import save_checkpoint as save_checkpoint

__all__ = [
    "AutoPlan", "BatchCouplingError", "BatchCouplingWarning", "CheckpointOptions", "Checkpointer",
    "Cluster", "CostTables", "ElasticOptions", "Emulation", "Failure", "GPU_CATALOG", "GPUType",
    "HarpjaxError", "InvalidOptionError", "LaidOut", "LayerOptions", "LayerSequence",
    "LocalRuntime", "LogicalMesh", "ManualPlan", "MixedOptions", "OffloadOptions",
    "OptionConflictError", "OptionsError", "ParallelOptions", "ParallelStep", "Plan", "Planned",
    "ProfileOptions", "RayRuntime", "Recovery", "RunnerOptions", "Schedule", "SolveOptions",
    "StageGroup", "StageSpec", "Traced", "UnknownOptionError", "auto_parallel", "gather", "grad",
    "load_plan", "make_schedule", "mark_layer_boundary", "restore_checkpoint", "save_checkpoint",
    "solve", "value_and_grad", "__version__", "ZebraGroup", "ZebraOptions",
]
