"""Phase 3, profiling: cost tables (the planner's only input) from a layer sequence and a
cluster, each distinct layer costed once per GPU type, submesh and logical mesh (HARP §5.1).

Modules: :mod:`~harpjax.compiler.profile.tables` (:class:`CostTables`, the type and its
checks; :mod:`~harpjax.compiler.profile.routed_split`, the experts' part of a routed
layer's cost, one of its optional fields), :mod:`~harpjax.compiler.profile.assemble` (:func:`assemble_tables`, the one builder
of them), :mod:`~harpjax.compiler.profile.layer_profile` (the layer-profile cost model:
:class:`LayerProfile`, :class:`SubclusterSpec`, :func:`synthetic_gpt_profile`),
:mod:`~harpjax.compiler.profile.remat_choice` (:func:`with_remat_choice`: the remat mode as a
per-stage choice), :mod:`~harpjax.compiler.profile.collectives` (collective times on a link),
:mod:`~harpjax.compiler.profile.calibration` (the analytic time model, its per-GPU factors and
the published measurements), :mod:`~harpjax.compiler.profile.pieces` (a layer as a standalone
function and what XLA says of it), :mod:`~harpjax.compiler.profile.estimate` (the same
statistics read off its jaxpr), :mod:`~harpjax.compiler.profile.sources` (cost sources: jaxpr,
analytic, measured, imported), :mod:`~harpjax.compiler.profile.cache` (the profile database)
and :mod:`~harpjax.compiler.profile.profiler` (:func:`profile_layers`, :func:`profile_step`);
:mod:`~harpjax.compiler.profile.zero` says what each ZeRO level costs a stage in memory and
collectives (:func:`stage_memory`, :func:`zero_stage_times`, :func:`offload_time_s`,
:func:`zero_tables`), and :mod:`~harpjax.compiler.profile.routes` which link a transfer
between subclusters takes and what a mixed-type stage's transfers cost, and
:mod:`~harpjax.compiler.profile.fees` what a plan's transfers between zones and regions pay. Every cost formula
of the planner is one of these modules'.
A new cost source implements :class:`~harpjax.compiler.profile.sources.CostSource` and is
chosen in ``profiler._make_source``.
"""

from harpjax.compiler.profile.cache import CACHE_DIR_ENV, default_cache_dir, ProfileDB
from harpjax.compiler.profile.profiler import (microbatch_size, profile_layers, profile_step,
                                               ProfileOptions, ProfileResult, ProfileStats,
                                               progress_bar, SOURCES, stage_flops,
                                               stage_times, tables_for_plan)
from harpjax.compiler.profile.assemble import assemble_tables
from harpjax.compiler.profile.layer_profile import (LayerProfile, memory_to_compute_order,
                                                    SubclusterSpec, synthetic_gpt_profile)
from harpjax.compiler.profile.fees import (cut_fees, cuts_transfer, group_route_transfer,
                                           group_sync_transfer, route_cut_bytes, NO_TRANSFER,
                                           LinkFees, plan_transfer,
                                           PlanTransfer, with_fees)
from harpjax.compiler.profile.collectives import cut_time_s
from harpjax.compiler.profile.remat_choice import with_remat_choice
from harpjax.compiler.profile.routes import (group_route_s, home_sync_s, replica_link, row_hosts,
                                             subcluster_link)
from harpjax.compiler.profile.routed_split import expert_forward_ops, RoutedSplit
from harpjax.compiler.profile.tables import CostTables, range_sums
from harpjax.compiler.profile.zero import (activation_offload_time_s, offload_time_s,
                                           param_fetch_time_s,
                                           replica_grad_bytes, stage_memory, StageMemory,
                                           sync_per_microbatch, ZERO_LEVELS, zero_collectives,
                                           zero_layer_costs, zero_stage_times,
                                           zero_state_bytes_per_param, zero_sync_time_s,
                                           zero_tables)

__all__ = [
    "activation_offload_time_s", "assemble_tables", "CACHE_DIR_ENV", "CostTables",
    "cut_time_s", "default_cache_dir", "expert_forward_ops", "group_route_s", "group_sync_transfer",
    "group_route_transfer", "route_cut_bytes", "NO_TRANSFER", "cuts_transfer", "cut_fees",
    "LinkFees", "plan_transfer",
    "PlanTransfer", "with_fees", "home_sync_s", "LayerProfile",
    "memory_to_compute_order", "microbatch_size", "offload_time_s", "param_fetch_time_s", "profile_layers",
    "profile_step", "ProfileDB", "ProfileOptions", "ProfileResult", "ProfileStats", "progress_bar",
    "range_sums", "replica_grad_bytes", "replica_link", "row_hosts", "RoutedSplit", "SOURCES", "stage_memory",
    "StageMemory", "stage_flops", "stage_times", "subcluster_link", "SubclusterSpec", "sync_per_microbatch",
    "synthetic_gpt_profile", "tables_for_plan", "with_remat_choice",
    "ZERO_LEVELS", "zero_collectives", "zero_layer_costs", "zero_stage_times",
    "zero_state_bytes_per_param", "zero_sync_time_s", "zero_tables",
]
