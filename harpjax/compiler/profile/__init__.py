"""Phase 3, profiling: cost tables (the planner's only input) from a layer sequence and a
cluster, each distinct layer costed once per GPU type, submesh and logical mesh (HARP §5.1).

Modules: :mod:`~harpjax.compiler.profile.tables` (:class:`CostTables` and the one builder of
them), :mod:`~harpjax.compiler.profile.collectives` (collective times on a link),
:mod:`~harpjax.compiler.profile.calibration` (the analytic time model, its per-GPU factors and
the published measurements), :mod:`~harpjax.compiler.profile.pieces` (a layer as a standalone
function and what XLA says of it), :mod:`~harpjax.compiler.profile.sources` (cost sources:
analytic, measured, imported), :mod:`~harpjax.compiler.profile.cache` (the profile database)
and :mod:`~harpjax.compiler.profile.profiler` (:func:`profile_layers`, :func:`profile_step`).
A new cost source implements :class:`~harpjax.compiler.profile.sources.CostSource` and is
chosen in ``profiler._make_source``.
"""

from harpjax.compiler.profile.cache import CACHE_DIR_ENV as CACHE_DIR_ENV
from harpjax.compiler.profile.cache import ProfileDB as ProfileDB
from harpjax.compiler.profile.cache import default_cache_dir as default_cache_dir
from harpjax.compiler.profile.profiler import ProfileOptions as ProfileOptions
from harpjax.compiler.profile.profiler import ProfileResult as ProfileResult
from harpjax.compiler.profile.profiler import ProfileStats as ProfileStats
from harpjax.compiler.profile.profiler import SOURCES as SOURCES
from harpjax.compiler.profile.profiler import microbatch_size as microbatch_size
from harpjax.compiler.profile.profiler import profile_layers as profile_layers
from harpjax.compiler.profile.profiler import profile_step as profile_step
from harpjax.compiler.profile.tables import CostTables as CostTables
from harpjax.compiler.profile.tables import LayerProfile as LayerProfile
from harpjax.compiler.profile.tables import SubclusterSpec as SubclusterSpec
from harpjax.compiler.profile.tables import assemble_tables as assemble_tables
from harpjax.compiler.profile.tables import memory_to_compute_order as memory_to_compute_order
from harpjax.compiler.profile.tables import synthetic_gpt_profile as synthetic_gpt_profile

__all__ = [
    "assemble_tables", "CACHE_DIR_ENV", "CostTables", "default_cache_dir", "LayerProfile",
    "memory_to_compute_order", "microbatch_size", "profile_layers", "profile_step", "ProfileDB",
    "ProfileOptions", "ProfileResult", "ProfileStats", "SOURCES", "SubclusterSpec",
    "synthetic_gpt_profile",
]
