"""Phase 2, layers: the forward program cut into fine-grained layers that keep the model's
repeated structure (HARP §5.1), and the sharding rules of a layer on a logical mesh.

Modules, along the data flow: :mod:`~harpjax.compiler.layers.types` (:class:`Layer`,
:class:`LayerSequence`, :class:`Module`, :class:`LayerOptions`),
:mod:`~harpjax.compiler.layers.facts` (per-op FLOPs, tokens, crossing bytes),
:mod:`~harpjax.compiler.layers.repeats` (repeated runs of tokens),
:mod:`~harpjax.compiler.layers.unroll` (scans over stacked layers become straight-line ops),
:mod:`~harpjax.compiler.layers.construct` (construction, hand cuts, the traced-step glue) and
:mod:`~harpjax.compiler.layers.sharding` (logical meshes ``(dp, tp[, ep])``,
:class:`LogicalMesh`, and the tensor- and expert-parallel rules, read by the profiler and the
stages).
"""

from harpjax.compiler.layers import sharding
from harpjax.compiler.layers.construct import (construct_layers, layers_for_step,
                                               layers_from_boundaries, layers_from_cuts,
                                               layers_like, relayer, traced_step_for)
from harpjax.compiler.layers.facts import crossing_bytes
from harpjax.compiler.layers.sharding import LogicalMesh
from harpjax.compiler.layers.types import Layer, LayerOptions, LayerSequence, Module
from harpjax.compiler.layers.unroll import unroll_scans

__all__ = [
    "construct_layers", "crossing_bytes", "Layer", "LayerOptions", "layers_for_step",
    "layers_from_boundaries", "layers_from_cuts", "layers_like",
    "LayerSequence", "LogicalMesh", "Module", "relayer", "sharding",
    "traced_step_for", "unroll_scans",
]
