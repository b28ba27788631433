"""Layer sequences: the forward program cut into fine-grained layers that keep its structure.

A :class:`LayerSequence` is the unit the planner partitions into stages: layer ``i`` is the
contiguous op range ``layers[i].start .. layers[i].end - 1`` of a boundary-free forward
:class:`~harpjax.compiler.program.Program`.

Automatic construction (:func:`construct_layers`, HARP §5.1; see ``docs/layers.md``):

1. **Canonicalise** every op (:mod:`harpjax.compiler.signature`): primitive, parameters,
   shapes, dtypes, operand kinds; equal computations get equal tokens.
2. **Find repeated modules**, iterating "the most repeated contiguous run with at least ``z``
   compute-heavy ops" over the non-repeated parts. Module instances from the jaxpr's name stack
   (Flax module scopes) are tried first, so that interleaved kinds (dense / MoE blocks) come out
   as two kinds rather than one pair; runs of ops found by a suffix array cover models without
   names. Sub-jaxpr equations (``pjit`` is inlined; ``remat2``, ``custom_jvp_call``,
   ``cond``... are single ops costed from their bodies) take part like any op; a ``scan`` over
   stacked layers is unrolled first (:func:`unroll_scans`).
3. **Cluster** each module kind once into layers of balanced compute whose cuts cross small
   tensors (a DP over low-crossing cut points), and apply the same relative cuts to every
   instance, so layers of one repeat have the signatures of any other.

Manual :func:`harpjax.mark_layer_boundary` calls win where present
(:func:`layers_from_boundaries`).

The phases live in their own modules, along the data flow: :mod:`harpjax.compiler._unroll`
(scan unrolling), :mod:`harpjax.compiler._layer_facts` (per-op FLOPs, tokens, crossing bytes),
:mod:`harpjax.compiler._layer_modules` (step 2) and :mod:`harpjax.compiler._layer_cluster`
(step 3); this module holds the data types, hand-made cuts, construction and the traced-step
glue, and re-exports their names.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Sequence

from harpjax.compiler import primitives, signature
from harpjax.compiler._layer_cluster import _cluster
from harpjax.compiler._layer_facts import _Facts, _facts, crossing_bytes
from harpjax.compiler._layer_modules import _find_modules, _kind_names, _op_path
from harpjax.compiler._unroll import unroll_scans
from harpjax.compiler.program import Lit, Op, Program
from harpjax.errors import HarpjaxError

# Private helpers that moved out of this module, still importable from here.
from harpjax.compiler._layer_cluster import _atoms, _partition  # noqa: F401
from harpjax.compiler._layer_facts import _Aval, _def_use, _lit_aval, _ref_aval  # noqa: F401
from harpjax.compiler._layer_modules import _INDEX, _strip_index  # noqa: F401
from harpjax.compiler._unroll import _iter_stack, _Lazy  # noqa: F401

log = logging.getLogger(__name__)

__all__ = ["Layer", "LayerSequence", "Module", "LayerOptions", "construct_layers",
           "layers_for_step", "layers_from_boundaries", "layers_from_cuts", "crossing_bytes",
           "unroll_scans", "traced_step_for", "relayer"]


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

  @property
  def num_layers(self) -> int:
    return self.last_layer - self.first_layer + 1


@dataclasses.dataclass(frozen=True)
class LayerOptions:
  """Knobs of automatic layer construction.

  Attributes:
    z: fewest compute-heavy ops (matmul, convolution) in a repeated module (paper's ``z``).
    criterion: ``"coverage"`` (occurrences x size) or ``"frequency"`` (the paper's literal
      "most frequent"), see :func:`harpjax.compiler.signature.most_repeated`.
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
    if int(self.z) < 1:
      raise HarpjaxError(f"LayerOptions.z={self.z} must be >= 1")
    if self.criterion not in ("coverage", "frequency"):
      raise HarpjaxError(f"LayerOptions.criterion={self.criterion!r}: use 'coverage' or "
                         "'frequency'")
    for f in ("target_layers", "layers_per_module"):
      v = getattr(self, f)
      if v is not None and int(v) < 1:
        raise HarpjaxError(f"LayerOptions.{f}={v} must be >= 1 or None")
    if self.max_layers_per_module < 1 or not self.max_boundary_ratio > 0:
      raise HarpjaxError("LayerOptions.max_layers_per_module must be >= 1 and "
                         "max_boundary_ratio > 0")


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

  def instances(self, name: str) -> list[Module]:
    """The module instances of kind ``name``."""
    return [m for m in self.modules if m.name == name]

  def cuts(self) -> tuple[int, ...]:
    """Op positions of the cuts between layers."""
    return tuple(l.start for l in self.layers[1:])

  def __str__(self) -> str:
    return self.summary or f"{len(self.layers)} layers"


# --------------------------------------------------------------------------- one layer


def _layer(program: Program, facts: _Facts, index: int, a: int, b: int, **kw) -> Layer:
  n = len(program.ops)
  seen, pbytes = set(), 0
  kind = facts.toks.value_kind
  for op in program.ops[a:b]:
    view_of_param = primitives.is_view(op.name) and op.invars and \
        not isinstance(op.invars[0], Lit) and kind.get(op.invars[0]) == "param"
    if view_of_param:
      continue
    for v in op.in_ids():
      if kind.get(v) == "param" and v not in seen:
        seen.add(v)
        pbytes += program.nbytes(v)
  sig = signature.slice_signature(program, a, b, facts.toks,
                                  lambda v: facts.last_use.get(v, -1) >= b)
  kw.setdefault("name", _common_name(program.ops[a:b]) or f"layer{index}")
  return Layer(index, a, b, signature=sig, flops=float(facts.flops[a:b].sum()),
               param_bytes=int(pbytes), boundary_bytes=int(facts.cross[b]) if b < n else 0,
               heavy_ops=int(facts.heavy[a:b].sum()), **kw)


# --------------------------------------------------------------------------- hand-made cuts


def layers_from_cuts(program: Program, cuts: Sequence[int], names: Sequence[str] | None = None,
                     summary: str = "", input_kinds: Sequence[str] | None = None
                     ) -> LayerSequence:
  """Builds a :class:`LayerSequence` cutting ``program`` before each op index in ``cuts``.

  Args:
    program: the forward program.
    cuts: op positions; out-of-range and repeated positions are ignored.
    names: optional layer names.
    summary: optional summary line.
    input_kinds: per ``program.invars`` entry, the region input kind (``"param"``...), for
      signatures and parameter bytes.
  """
  bounds = [0] + sorted(set(int(c) for c in cuts if 0 < c < len(program.ops))) + \
      [len(program.ops)]
  facts = _facts(program, input_kinds)
  layers = []
  for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
    kw = {"name": names[i]} if names is not None else {}
    layers.append(_layer(program, facts, i, a, b, **kw))
  kinds = tuple(input_kinds) if input_kinds is not None else None
  return LayerSequence(program, tuple(layers), summary or f"{len(layers)} layers",
                       input_kinds=kinds)


def layers_from_boundaries(program: Program, cuts: Sequence[int],
                           input_kinds: Sequence[str] | None = None) -> LayerSequence:
  """Layers cut where the model called :func:`harpjax.mark_layer_boundary`.

  Args:
    program: the boundary-free region program (``TracedStep.region``).
    cuts: the marker positions (``TracedStep.boundary_cuts``).
    input_kinds: optional region input kinds (``[inp.kind for inp in TracedStep.inputs]``).
  """
  n = len([c for c in cuts if 0 < c < len(program.ops)]) + 1
  return layers_from_cuts(program, cuts, input_kinds=input_kinds,
                          summary=f"{n} layer{'s' if n != 1 else ''} (marked by hand)")


def relayer(seq: LayerSequence, program: Program,
            input_kinds: Sequence[str] | None = None) -> LayerSequence:
  """The same cuts and modules over another trace of the same model (e.g. a smaller microbatch).

  Raises:
    ValueError: the programs differ in length (the model's structure depends on the batch).
  """
  if len(program.ops) != len(seq.program.ops):
    raise ValueError(f"cannot transfer {len(seq)} layers: the program has {len(program.ops)} "
                     f"ops, the layered one {len(seq.program.ops)}")
  kinds = input_kinds if input_kinds is not None else seq.input_kinds
  facts = _facts(program, kinds)
  layers = tuple(_layer(program, facts, l.index, l.start, l.end, name=l.name, module=l.module,
                        module_index=l.module_index, position=l.position) for l in seq.layers)
  return dataclasses.replace(seq, program=program, layers=layers,
                             input_kinds=tuple(kinds) if kinds is not None else None)


# --------------------------------------------------------------------------- construction


def construct_layers(program: Program, input_kinds: Sequence[str] | None = None, *,
                     boundary_cuts: Sequence[int] = (),
                     options: LayerOptions | None = None,
                     origin: Sequence[int] | None = None) -> LayerSequence:
  """Fine-grained layers of a forward program that keep its repeated structure (§5.1).

  Args:
    program: the boundary-free forward program (``TracedStep.region``, or the result of
      :func:`unroll_scans`).
    input_kinds: per ``program.invars`` entry, ``"param"`` / ``"split"`` / ``"whole"`` /
      ``"static"`` (``[inp.kind for inp in TracedStep.inputs]``).
    boundary_cuts: hand-placed cuts (``TracedStep.boundary_cuts``); when given they are the
      layers (manual boundaries win) and only signatures and module kinds are computed.
    options: the knobs, :class:`LayerOptions`.
    origin: recorded in the result (see :attr:`LayerSequence.origin`).

  Returns:
    The :class:`LayerSequence`; ``str()`` summarises it.
  """
  opts = options or LayerOptions()
  t0 = time.perf_counter()
  n = len(program.ops)
  kinds = tuple(input_kinds) if input_kinds is not None else None
  origin = tuple(origin) if origin is not None else None
  if n == 0:
    return LayerSequence(program, (), "0 layers", input_kinds=kinds, origin=origin)
  facts = _facts(program, kinds)
  cuts = sorted(set(int(c) for c in boundary_cuts if 0 < c < n))
  if cuts:
    return _from_manual(program, facts, cuts, kinds, origin)
  paths = [_op_path(op) for op in program.ops]
  mods = _find_modules(program, facts, paths, opts)
  names = _kind_names(mods, paths)
  plan = _cluster(mods, facts, opts)
  layers, modules = [], []
  for mi, (a, b, kind, path) in enumerate(mods):
    first = len(layers)
    rel = plan[kind]
    bounds = [a] + [a + r for r in rel] + [b]
    for q, (x, y) in enumerate(zip(bounds, bounds[1:])):
      layers.append(_layer(program, facts, len(layers), x, y, module=names[kind],
                           module_index=mi, position=q))
    repeated = sum(1 for m in mods if m[2] == kind) > 1
    modules.append(Module(mi, kind, names[kind], "/".join(path), a, b, first,
                          len(layers) - 1, repeated))
  seq = LayerSequence(program, tuple(layers), _summary(layers, modules), tuple(modules), kinds,
                      origin)
  log.info("layer construction: %d ops -> %s (%.2f s)", n, seq.summary,
           time.perf_counter() - t0)
  return seq


def _from_manual(program, facts, cuts, kinds, origin) -> LayerSequence:
  bounds = [0] + cuts + [len(program.ops)]
  layers = [_layer(program, facts, i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
  kind_of: dict[str, int] = {}
  modules = []
  count = collections.Counter(l.signature for l in layers)
  for l in layers:
    k = kind_of.setdefault(l.signature, len(kind_of))
    modules.append(Module(l.index, k, l.name, l.name, l.start, l.end, l.index, l.index,
                          count[l.signature] > 1))
  layers = [dataclasses.replace(l, module=l.name, module_index=l.index) for l in layers]
  n = len(layers)
  return LayerSequence(program, tuple(layers),
                       f"{n} layer{'s' if n != 1 else ''} (marked by hand)", tuple(modules),
                       kinds, origin)


# --------------------------------------------------------------------------- summary


def _summary(layers, modules) -> str:
  items = [(m.name, m.repeated, m.num_layers) for m in modules]
  parts, i = [], 0
  while i < len(items):
    best_p, best_reps = 1, 1
    if items[i][1]:
      for p in (1, 2, 3, 4):
        unit = items[i:i + p]
        if len(unit) < p or not all(u[1] for u in unit):
          break
        reps = 1
        while items[i + reps * p:i + (reps + 1) * p] == unit:
          reps += 1
        if reps >= 2 and reps * p > best_reps * best_p:
          best_p, best_reps = p, reps
    unit = items[i:i + best_p]
    if not items[i][1]:
      parts.append(f"{items[i][0]} {items[i][2]}")
    elif best_p == 1:
      parts.append(f"{best_reps} × {unit[0][0]}[{unit[0][2]}]")
    else:
      body = " · ".join(f"{u[0]}[{u[2]}]" for u in unit)
      parts.append(f"{best_reps} × ({body})")
    i += best_p * best_reps
  n = len(layers)
  return f"{n} layer{'s' if n != 1 else ''}: " + " · ".join(parts)


def _common_name(ops: Sequence[Op]) -> str:
  stacks = [op.name_stack for op in ops if op.name_stack]
  if not stacks:
    return ""
  parts = [s.split("/") for s in stacks]
  common = []
  for level in zip(*parts):
    if all(p == level[0] for p in level):
      common.append(level[0])
    else:
      break
  return "/".join(common) or stacks[0].split("/")[0]


# --------------------------------------------------------------------------- traced steps


def layers_for_step(ts, options: LayerOptions | None = None) -> LayerSequence:
  """Layers of a traced step (:class:`~harpjax.compiler.trace.TracedStep`).

  Hand-placed boundaries win; otherwise scans over stacked layers are unrolled (then
  ``LayerSequence.program`` replaces ``ts.region``: run with :func:`traced_step_for`) and
  layers are constructed automatically.
  """
  opts = options or LayerOptions()
  kinds = [inp.kind for inp in ts.inputs]
  if ts.boundary_cuts:
    return construct_layers(ts.region, kinds, boundary_cuts=ts.boundary_cuts, options=opts)
  program, origin = ts.region, None
  if opts.unroll_scan:
    program, origin = unroll_scans(ts.region, z=opts.z, max_length=opts.max_unroll)
  return construct_layers(program, kinds, options=opts, origin=origin)


def traced_step_for(ts, layers: LayerSequence):
  """``ts`` with ``region`` (and random-op indices) replaced by ``layers.program``."""
  if layers.origin is None or layers.program is ts.region:
    return ts
  regen = {new: ts.regen_ops[old] for new, old in enumerate(layers.origin)
           if old >= 0 and old in ts.regen_ops}
  return dataclasses.replace(ts, region=layers.program, regen_ops=regen, boundary_cuts=())
