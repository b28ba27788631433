"""Phase 6, stages: from a traced step, its layers and a resolved plan to what the runtimes
execute, after JAX's ``Traced -> Lowered -> Compiled``.

Modules: :mod:`~harpjax.compiler.stages.devices` (which devices each stage runs on, the
resolved plan and its schedule), :mod:`~harpjax.compiler.stages.stage` (slicing the program
into stages; their functions and executables), :mod:`~harpjax.compiler.stages.placement` (the
ops around the pipeline, placed by data flow), :mod:`~harpjax.compiler.stages.split`
(stages that split their microbatches' rows among groups of devices: mixed-type stages),
:mod:`~harpjax.compiler.stages.replicas` (data-parallel replicas that accumulate their own
gradients, reduced once per step),
:mod:`~harpjax.compiler.stages.layout` (what goes where: the picklable
:class:`StepLayout` every runtime routes by),
:mod:`~harpjax.compiler.stages.compile` (:func:`layout_step` -> :class:`StepProgram`;
:func:`compile_step` -> :class:`CompiledStep`, jitted in process),
:mod:`~harpjax.compiler.stages.lower` (:func:`lower_step` -> :class:`LoweredStep`: serialised
executables for a Ray worker), :mod:`~harpjax.compiler.stages.aot` (compiling every
executable ahead of the first call), :mod:`~harpjax.compiler.stages.memory` (a compiled
stage's memory per device, XLA's account beside the model's) and
:mod:`~harpjax.compiler.stages.zebra` (zebra stages: attention and experts on two groups of
devices, in Theorem 1's order).
"""

from harpjax.compiler.stages.aot import compile_group, compile_stage, default_workers, precompile
from harpjax.compiler.stages.compile import (check_host_memory, compile_step, CompiledStep,
                                             layout_step, LOSS_REDUCTIONS, OffloadOptions,
                                             SHARED_PARAMETER_WARNING, state_successors,
                                             StepProgram, warn_shared_parameters)
from harpjax.compiler.stages.devices import resolve_devices, resolve_plan
from harpjax.compiler.stages.layout import (GroupLayout, HOST_MEMORY, StageLayout,
                                            StepLayout)
from harpjax.compiler.stages.lower import lower_step, LoweredStage, LoweredStep
from harpjax.compiler.stages.memory import in_flight, memory_report, StageMemoryReport
from harpjax.compiler.stages.split import (batch_rows, retrace, Retrace, SplitLayout,
                                           SplitStageExecutables)
from harpjax.compiler.stages.stage import put, row_slice, StageExecutables
from harpjax.compiler.stages.zebra import (check_zebra_runs, ZebraLayout,
                                           ZebraStageExecutables)

__all__ = [
    "batch_rows", "check_host_memory", "CompiledStep", "compile_group", "compile_stage",
    "compile_step",
    "default_workers", "GroupLayout", "HOST_MEMORY", "in_flight", "layout_step", "memory_report",
    "LOSS_REDUCTIONS", "LoweredStage", "LoweredStep", "lower_step", "OffloadOptions",
    "precompile", "put", "resolve_devices", "resolve_plan", "retrace", "Retrace", "row_slice",
    "SHARED_PARAMETER_WARNING", "SplitLayout", "SplitStageExecutables",
    "StageExecutables", "StageLayout", "StageMemoryReport", "state_successors", "StepLayout",
    "StepProgram", "warn_shared_parameters", "check_zebra_runs", "ZebraLayout",
    "ZebraStageExecutables",
]
