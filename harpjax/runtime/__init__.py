"""The runtimes: one process (:func:`run_step`) or one Ray actor per stage
(:func:`ray_runner`), both running the schedule with one interpreter
(:mod:`~harpjax.runtime.interpreter`). This is the only package that imports Ray (only when a
Ray runner or the planner's Ray pool starts), and only the driver (``harpjax.api`` and its
options, ``harpjax.options``) imports it. Importing it registers the planner's Ray pool
(:mod:`~harpjax.runtime.planner_pool`).

Modules: :mod:`~harpjax.runtime.interpreter` (a stage's part of the region, and the message
keys), :mod:`~harpjax.runtime.local` (every stage in this process; :class:`LocalRuntime`),
:mod:`~harpjax.runtime.worker` (one stage in its own process) and
:mod:`~harpjax.runtime.runner` (the driver of the workers; :class:`RayRuntime`),
:mod:`~harpjax.runtime.ray_runtime`
(workers as Ray actors), :mod:`~harpjax.runtime.transport` and
:mod:`~harpjax.runtime.channels` (routes over the fastest NIC, TCP channels, sender threads),
:mod:`~harpjax.runtime.codec` (values on the wire), :mod:`~harpjax.runtime.spmd` (a stage over
several hosts), :mod:`~harpjax.runtime.emulation` (fake devices that behave like the plan's
GPUs and links), :mod:`~harpjax.runtime.handles`, :mod:`~harpjax.runtime.checkpoint`
(plan-independent checkpoints of the training state), :mod:`~harpjax.runtime.elastic`
(:class:`Elastic`: re-planning after lost workers) and :mod:`~harpjax.runtime.measure`.
"""

from harpjax.runtime import planner_pool as planner_pool
from harpjax.runtime.checkpoint import (CheckpointError, CheckpointOptions,
                                        CheckpointOptionsError, Checkpointer,
                                        restore_checkpoint, save_checkpoint)
from harpjax.runtime.elastic import Elastic, ElasticOptions, Failure, Recovery
from harpjax.runtime.emulation import Emulation
from harpjax.runtime.handles import RemoteArray, gather
from harpjax.runtime.local import LocalRuntime, run_step
from harpjax.runtime.runner import RayRuntime, RunnerOptions

__all__ = ["CheckpointError", "CheckpointOptions", "CheckpointOptionsError", "Checkpointer",
           "Elastic", "ElasticOptions", "Emulation", "Failure", "gather", "LocalRuntime",
           "planner_pool", "ray_runner", "RayRuntime", "Recovery", "RemoteArray",
           "restore_checkpoint", "run_step", "RunnerOptions", "save_checkpoint"]


def ray_runner(program, cluster, example_args, options: RayRuntime | None = None, **kwargs):
  """A :class:`~harpjax.runtime.ray_runtime.RayRunner` (Ray is imported here, not before)."""
  from harpjax.runtime.ray_runtime import RayRunner  # noqa: PLC0415 - Ray only when asked
  return RayRunner(program, cluster, example_args, options, **kwargs)
