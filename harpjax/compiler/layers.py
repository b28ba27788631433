"""Layer sequences: the forward program cut into contiguous layers.

A :class:`LayerSequence` is the unit the planner partitions into stages: layer ``i`` is the
contiguous op range ``layers[i].start .. layers[i].end - 1`` of a boundary-free forward
:class:`~harpjax.compiler.program.Program`. Layers come from
:func:`harpjax.mark_layer_boundary` calls (:func:`layers_from_boundaries`); automatic layer
construction produces the same type.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from harpjax.compiler.program import Lit, Op, Program

__all__ = ["Layer", "LayerSequence", "layers_from_boundaries",
           "layers_from_cuts", "crossing_bytes"]


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the forward program.

  Attributes:
    index: position in the sequence.
    start, end: op range ``[start, end)`` in :attr:`LayerSequence.program`.
    name: module path (from the jaxpr name stack) or a generated label.
    signature: structural hash; equal signatures mean identical computations.
    flops: forward FLOPs per microbatch.
    param_bytes: bytes of the parameters the layer reads.
    boundary_bytes: bytes of the values crossing the cut after this layer, per microbatch.
  """
  index: int
  start: int
  end: int
  name: str = ""
  signature: str | None = None
  flops: float = 0.0
  param_bytes: int = 0
  boundary_bytes: int = 0

  @property
  def num_ops(self) -> int:
    return self.end - self.start


@dataclasses.dataclass(frozen=True, eq=False)
class LayerSequence:
  """A forward program cut into layers.

  Attributes:
    program: the boundary-free forward program (region inputs -> loss, aux).
    layers: contiguous layers covering every op.
    summary: a one-line description (``"146 layers: embed 1 · 48 × block[3] · head 1"``).
  """
  program: Program
  layers: tuple[Layer, ...]
  summary: str = ""

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

  def __str__(self) -> str:
    return self.summary or f"{len(self.layers)} layers"


def crossing_bytes(program: Program) -> np.ndarray:
  """``out[c]`` = bytes of values defined before op ``c`` and read at or after it.

  Program inputs are not counted (they are fed to every stage directly); outputs count as read
  at the end. Shape ``[len(ops) + 1]``.
  """
  n = len(program.ops)
  diff = np.zeros(n + 2, dtype=np.int64)
  defined_at = {}
  for op in program.ops:
    for v in op.outvars:
      if v >= 0:
        defined_at[v] = op.index
  last_use = {}
  for op in program.ops:
    for v in op.in_ids():
      if v in defined_at:
        last_use[v] = op.index
  for v in program.outvars:
    if not isinstance(v, Lit) and v in defined_at:
      last_use[v] = n
  for v, lu in last_use.items():
    d = defined_at[v]
    if lu > d:
      diff[d + 1] += program.nbytes(v)
      diff[lu + 1] -= program.nbytes(v)
  return np.cumsum(diff)[: n + 1]


def layers_from_cuts(program: Program, cuts: Sequence[int], names: Sequence[str] | None = None,
                     summary: str = "") -> LayerSequence:
  """Builds a :class:`LayerSequence` cutting ``program`` before each op index in ``cuts``."""
  bounds = [0] + sorted(set(int(c) for c in cuts if 0 < c < len(program.ops))) + \
      [len(program.ops)]
  cross = crossing_bytes(program)
  layers = []
  for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
    name = names[i] if names is not None else _common_name(program.ops[a:b]) or f"layer{i}"
    layers.append(Layer(i, a, b, name=name,
                        boundary_bytes=int(cross[b]) if b < len(program.ops) else 0))
  return LayerSequence(program, tuple(layers), summary or f"{len(layers)} layers")


def layers_from_boundaries(program: Program, cuts: Sequence[int]) -> LayerSequence:
  """Layers cut where the model called :func:`harpjax.mark_layer_boundary`.

  Args:
    program: the boundary-free region program (``TracedStep.region``).
    cuts: the marker positions (``TracedStep.boundary_cuts``).
  """
  n = len([c for c in cuts if 0 < c < len(program.ops)]) + 1
  return layers_from_cuts(program, cuts,
                          summary=f"{n} layer{'s' if n != 1 else ''} (marked by hand)")


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
