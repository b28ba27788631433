"""The expert part of each routed layer's cost: what a zebra stage needs to cut a
mixture-of-experts block between two groups of GPUs (HeterMoE §4.1).

A routed layer (a layer of a module the layer construction marks routed,
:attr:`~harpjax.compiler.layers.Module.routed`) costs, in :class:`CostTables`, its attention
side (attention, norms, router) and its experts together. A zebra stage runs the two on
different GPUs (:mod:`harpjax.compiler.plan.zebra_stages`), so it needs them apart.
:class:`RoutedSplit` is that split, carried by the tables (``CostTables.routed_split``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from harpjax.errors import CostTablesError

__all__ = ["RoutedSplit"]


def _per_layer(v, where: str, L: int) -> np.ndarray:
  a = np.array(v, dtype=np.float64).reshape(-1)
  if a.shape == (1,):
    a = np.full(L, float(a[0]))
  if a.shape != (L,) or not np.isfinite(a).all() or (a < 0).any():
    raise CostTablesError(f"RoutedSplit.{where} must be [num_layers={L}] finite values >= 0, "
                          f"got shape {a.shape}")
  a.setflags(write=False)
  return a


@dataclasses.dataclass(frozen=True, eq=False)
class RoutedSplit:
  """Per layer, the experts' share of a routed layer's cost (zeros for a layer that routes
  nothing).

  Attributes:
    num_experts: ``[L]`` experts of each layer's routed block; ``0``: the layer routes nothing.
    expert_time_s: ``[K]`` arrays ``[L, S_k]``: seconds (forward + backward of one microbatch)
      of layer ``l``'s experts inside ``stage_time_s[k][l, l, s]`` (the rest of that entry is
      the layer's attention side). ``0`` where the layer routes nothing.
    expert_state_bytes: ``[L]`` training state (parameters, gradients, optimizer state) of all
      of layer ``l``'s experts together, bytes.
    expert_act_bytes: ``[L]`` residual bytes of one microbatch's experts of layer ``l``, all
      experts together.
    routed_bytes: ``[L]`` bytes of one microbatch's routed token copies (``tokens * top_k *
      hidden * dtype bytes``): what the dispatch all-to-all moves, and the combine back.
  """
  num_experts: Sequence[int]
  expert_time_s: Sequence[np.ndarray]
  expert_state_bytes: Sequence[float]
  expert_act_bytes: Sequence[float]
  routed_bytes: Sequence[float]

  def __post_init__(self):
    try:
      n = tuple(int(x) for x in self.num_experts)
    except (TypeError, ValueError):
      raise CostTablesError(f"RoutedSplit.num_experts={self.num_experts!r} must be integers "
                            ">= 0, one per layer") from None
    if not n or min(n) < 0:
      raise CostTablesError(f"RoutedSplit.num_experts={n} must be integers >= 0, one per layer")
    object.__setattr__(self, "num_experts", n)
    L = len(n)
    for name in ("expert_state_bytes", "expert_act_bytes", "routed_bytes"):
      object.__setattr__(self, name, _per_layer(getattr(self, name), name, L))
    arrs = []
    for k, a in enumerate(self.expert_time_s):
      a = np.array(a, dtype=np.float64)
      if a.ndim != 2 or a.shape[0] != L or not np.isfinite(a).all() or (a < 0).any():
        raise CostTablesError(f"RoutedSplit.expert_time_s[{k}] must be [num_layers={L}, "
                              f"num_submeshes] finite seconds >= 0, got shape {a.shape}")
      if (a[np.array(n) == 0] > 0).any():
        raise CostTablesError(f"RoutedSplit.expert_time_s[{k}]: a layer with no experts has "
                              "expert time")
      a.setflags(write=False)
      arrs.append(a)
    object.__setattr__(self, "expert_time_s", tuple(arrs))

  @property
  def num_layers(self) -> int:
    return len(self.num_experts)

  def routed(self, layer: int) -> bool:
    """Whether layer ``layer`` holds a routed block."""
    return self.num_experts[layer] > 0

  def check(self, tables) -> None:
    """Checks the split against its tables: one array per subcluster, one column per submesh
    choice, each expert time at most its layer's whole time.

    Raises:
      CostTablesError: naming the entry that does not fit.
    """
    L, K = tables.num_layers, tables.num_subclusters
    if self.num_layers != L or len(self.expert_time_s) != K:
      raise CostTablesError(f"routed_split covers {self.num_layers} layers and "
                            f"{len(self.expert_time_s)} subclusters; the tables {L} and {K}")
    for k in range(K):
      a = self.expert_time_s[k]
      if a.shape != (L, len(tables.submeshes[k])):
        raise CostTablesError(f"routed_split.expert_time_s[{k}] has shape {a.shape}, expected "
                              f"[num_layers, num_submeshes] = {[L, len(tables.submeshes[k])]}")
      whole = np.stack([tables.stage_time_s[k][l, l] for l in range(L)])
      over = np.isfinite(whole) & (a > whole * (1 + 1e-12))
      if over.any():
        l, s = (int(x) for x in np.argwhere(over)[0])
        raise CostTablesError(f"routed_split.expert_time_s[{k}][{l}, {s}] = {a[l, s]} exceeds "
                              f"the layer's whole time {whole[l, s]}; it is a part of it")
