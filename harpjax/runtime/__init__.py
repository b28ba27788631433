"""The runtimes: one process (:mod:`~harpjax.runtime.local`) or one Ray actor per stage
(:mod:`~harpjax.runtime.ray_runtime`), both running the schedule with one interpreter
(:mod:`~harpjax.runtime.interpreter`). This is the only package that imports Ray, and only
``harpjax.api`` imports it. Importing it registers the planner's Ray pool
(:mod:`~harpjax.runtime.planner_pool`).
"""

from harpjax.runtime import planner_pool as planner_pool
