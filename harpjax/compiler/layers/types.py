"""The layer types: a forward program cut into layers, the modules they belong to, the knobs.

A :class:`LayerSequence` is the unit the planner partitions into stages: layer ``i`` is the
contiguous op range ``layers[i].start .. layers[i].end - 1`` of a boundary-free forward
:class:`~harpjax.compiler.trace.Program`. Construction is in
:mod:`harpjax.compiler.layers.construct`.
"""

from __future__ import annotations

import collections
import dataclasses

from harpjax.compiler.trace import Program

__all__ = ["Layer", "Module", "LayerOptions", "LayerSequence"]


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the forward program.

  Attributes:
    index: position in the sequence.
    start, end: op range ``[start, end)`` in :attr:`LayerSequence.program`.
    name: module path (from the jaxpr name stack) or a generated label.
    signature: structural hash; equal signatures mean identical computations.
    flops: forward FLOPs per microbatch.
    param_bytes: bytes of the parameters the layer reads (slices of stacked parameters count
      the slice).
    boundary_bytes: bytes of the values crossing the cut after this layer, per microbatch.
    module: the layer's module kind (``"block"``); ``""`` when unknown.
    module_index: index of the layer's module in :attr:`LayerSequence.modules`.
    position: index of the layer inside its module.
    heavy_ops: compute-heavy ops in the layer.
  """
  index: int
  start: int
  end: int
  name: str = ""
  signature: str | None = None
  flops: float = 0.0
  param_bytes: int = 0
  boundary_bytes: int = 0
  module: str = ""
  module_index: int = -1
  position: int = 0
  heavy_ops: int = 0

  @property
  def num_ops(self) -> int:
    return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Module:
  """A module instance: a contiguous run of layers.

  Attributes:
    index: position in :attr:`LayerSequence.modules`.
    kind: module kind id; instances of one repeated kind are structurally identical.
    name: kind name (``"block"``; for non-repeated modules their own name).
    path: instance path from the name stack (``"GPT/block_3"``), may be ``""``.
    start, end: op range.
    first_layer, last_layer: inclusive layer range.
    repeated: whether the kind has several instances.
    routed: whether the module holds a routed block (a mixture of experts): a router's
      data-dependent choice (``argmax``, ``top_k``, an index-returning ``sort``) over scores
      computed by a matmul, reaching the matmuls that dispatch tokens to experts and combine
      their outputs, inside the module. Equal for every instance of a kind. See
      docs/layers.md, "Module kinds".
  """
  index: int
  kind: int
  name: str
  path: str
  start: int
  end: int
  first_layer: int
  last_layer: int
  repeated: bool
  routed: bool = False

  @property
  def num_layers(self) -> int:
    return self.last_layer - self.first_layer + 1


@dataclasses.dataclass(frozen=True)
class LayerOptions:
  """Knobs of automatic layer construction.

  Attributes:
    z: fewest compute-heavy ops (matmul, convolution) in a repeated module (paper's ``z``).
    criterion: ``"coverage"`` (occurrences x size) or ``"frequency"`` (the paper's literal
      "most frequent"), see :func:`harpjax.compiler.layers.repeats.most_repeated`.
    target_layers: total layers wanted; modules get more layers where their layers are the
      heaviest until the total would exceed it. ``None``: ``layers_per_module``.
    layers_per_module: layers per module; ``None``: one per low-crossing segment holding
      compute-heavy ops, at most ``max_layers_per_module``.
    max_layers_per_module: cap of the default (3: GPT blocks give attention | projection |
      MLP, 146 layers for a 48-block GPT as in the paper).
    max_boundary_ratio: a cut inside a module may cross at most this many times the bytes
      crossing the module's own boundary.
    use_name_stack: find module instances from the name stack first.
    unroll_scan: unroll ``scan`` equations whose body has ``>= z`` compute-heavy ops and
      ``length <= max_unroll`` (a scan over stacked layers), see :func:`unroll_scans`.
    max_unroll: longest scan to unroll.
  """
  z: int = 2
  criterion: str = "coverage"
  target_layers: int | None = None
  layers_per_module: int | None = None
  max_layers_per_module: int = 3
  max_boundary_ratio: float = 2.0
  use_name_stack: bool = True
  unroll_scan: bool = True
  max_unroll: int = 512

  def __post_init__(self):
    from harpjax.errors import check_choice, check_count, check_flag, check_number
    check_count("LayerOptions.z", self.z, 1)
    check_choice("LayerOptions.criterion", self.criterion, ("coverage", "frequency"))
    for f in ("target_layers", "layers_per_module"):
      check_count(f"LayerOptions.{f}", getattr(self, f), 1, allow_none=True)
    check_count("LayerOptions.max_layers_per_module", self.max_layers_per_module, 1)
    check_number("LayerOptions.max_boundary_ratio", self.max_boundary_ratio, 0, low_open=True)
    check_flag("LayerOptions.use_name_stack", self.use_name_stack)
    check_flag("LayerOptions.unroll_scan", self.unroll_scan)
    check_count("LayerOptions.max_unroll", self.max_unroll, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerSequence:
  """A forward program cut into layers.

  Attributes:
    program: the boundary-free forward program (region inputs -> loss, aux) the stages slice.
      It is ``TracedStep.region`` unless scans were unrolled (``origin`` is set): then use
      :func:`traced_step_for` to get the matching ``TracedStep``.
    layers: contiguous layers covering every op.
    summary: a one-line description (``"146 layers: embed 1 · 48 × block[3] · ln_f 1"``).
    modules: module instances in order (empty for hand-cut sequences without analysis).
    input_kinds: per ``program.invars`` entry, the region input kind (``"param"``...).
    origin: per op, the index of the op of ``TracedStep.region`` it copies (``-1`` for ops of
      an unrolled scan); ``None`` when ``program`` is the region itself.
  """
  program: Program
  layers: tuple[Layer, ...]
  summary: str = ""
  modules: tuple[Module, ...] = ()
  input_kinds: tuple[str, ...] | None = None
  origin: tuple[int, ...] | None = None

  def __post_init__(self):
    pos = 0
    for i, layer in enumerate(self.layers):
      assert layer.index == i and layer.start == pos and layer.end >= layer.start, layer
      pos = layer.end
    assert pos == len(self.program.ops), (pos, len(self.program.ops))

  def __len__(self) -> int:
    return len(self.layers)

  def __getitem__(self, i) -> Layer:
    return self.layers[i]

  def __iter__(self):
    return iter(self.layers)

  def op_range(self, first: int, last: int) -> tuple[int, int]:
    """Op range ``[start, end)`` of layers ``first..last`` inclusive."""
    return self.layers[first].start, self.layers[last].end

  @property
  def signatures(self) -> tuple:
    return tuple(l.signature for l in self.layers)

  def module_kinds(self, repeated_only: bool = True) -> dict[str, int]:
    """Kind name -> number of instances (repeated kinds only by default)."""
    counts = collections.Counter(m.name for m in self.modules
                                 if m.repeated or not repeated_only)
    return dict(counts)

  def routed_modules(self) -> list[Module]:
    """The module instances holding a routed block (:attr:`Module.routed`)."""
    return [m for m in self.modules if m.routed]

  def instances(self, name: str) -> list[Module]:
    """The module instances of kind ``name``."""
    return [m for m in self.modules if m.name == name]

  def cuts(self) -> tuple[int, ...]:
    """Op positions of the cuts between layers."""
    return tuple(l.start for l in self.layers[1:])

  def __str__(self) -> str:
    return self.summary or f"{len(self.layers)} layers"
