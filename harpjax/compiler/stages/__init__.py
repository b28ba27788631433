"""Phase 6, stages: from a traced step, its layers and a resolved plan to what the runtimes
execute: per-stage forward/backward executables on their submeshes, the placement of the rest
of the step (the optimizer update next to its weights), device resolution and compilation
ahead of the first call.

Modules: :mod:`~harpjax.compiler.stages.devices` (which devices each stage runs on),
:mod:`~harpjax.compiler.stages.stage` (slicing the program into stages and jitting them),
:mod:`~harpjax.compiler.stages.placement` (the ops around the pipeline, placed by data flow),
:mod:`~harpjax.compiler.stages.compile` (:func:`compile_step`: :class:`CompiledStep`) and
:mod:`~harpjax.compiler.stages.aot` (compiling every executable ahead, in threads).
"""

from harpjax.compiler.stages.aot import default_workers as default_workers
from harpjax.compiler.stages.aot import precompile as precompile
from harpjax.compiler.stages.compile import LOSS_REDUCTIONS as LOSS_REDUCTIONS
from harpjax.compiler.stages.compile import CompiledStep as CompiledStep
from harpjax.compiler.stages.compile import compile_step as compile_step

__all__ = [
    "compile_step", "CompiledStep", "default_workers", "LOSS_REDUCTIONS", "precompile",
]
