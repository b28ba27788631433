"""Cost tables: the planner's only input, as plain arrays.

A :class:`CostTables` says, for every subcluster ``k`` (in pipeline order), every layer range
``i..j`` (inclusive, 0-indexed) and every submesh choice ``s`` of that subcluster, how long one
microbatch's forward+backward takes (``stage_time_s[k][i, j, s]``, best logical mesh already
chosen), how many bytes per device the stage's parameters/optimizer state take
(``param_mem_bytes``) and how many bytes one in-flight microbatch's activations take
(``act_mem_bytes``). ``boundary_bytes[j]`` is what crosses a cut after layer ``j`` per
microbatch; a cut costs ``C(j) = latency + boundary_bytes[j] / bandwidth`` on its link: the
subcluster's own link for a cut inside it, the link between consecutive subclusters ``k`` and
``k + 1`` for the cut where subcluster ``k``'s devices are exhausted.

Tables can be written by hand (tests, other systems' profiles) or built from per-layer costs
with :meth:`CostTables.from_layer_costs` (what the analytic profiler feeds).

Submesh shapes follow the paper: ``(1, 1), (1, 2), (1, 4), ..., (1, M)`` then
``(2, M), ..., (N, M)``. Any single-host ``(1, m)`` with ``m <= M`` and whole-host ``(n, M)``
are accepted. The planner makes sure the stages of a subcluster pack onto its hosts: when the
single-host widths divide each other and ``M`` (powers of two with ``M`` a power of two), any
mix adding up to ``N * M`` devices packs and the DP just counts devices; otherwise (three
``(1, 4)`` add up to two hosts of 6 but do not fit them) it tracks the shapes used so far.

Layout. This module holds :class:`CostTables` and is the public home of every cost-table name:
the builder and its inputs (:class:`LayerProfile`, :class:`SubclusterSpec`, :class:`LinkSpec`,
:func:`memory_to_compute_order`, :func:`synthetic_gpt_profile`) live in
``harpjax/compiler/_cost_builder.py``, the submesh shapes (:func:`paper_submeshes`,
:func:`check_submeshes`) and argument checks in ``harpjax/compiler/_cost_checks.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import numpy as np

from harpjax.compiler._cost_builder import LayerProfile as LayerProfile
from harpjax.compiler._cost_builder import LinkSpec as LinkSpec
from harpjax.compiler._cost_builder import SubclusterSpec as SubclusterSpec
from harpjax.compiler._cost_builder import build_cost_tables
from harpjax.compiler._cost_builder import memory_to_compute_order as memory_to_compute_order
from harpjax.compiler._cost_builder import synthetic_gpt_profile as synthetic_gpt_profile
from harpjax.compiler._cost_checks import _int, _nonneg, _positive, _seq
from harpjax.compiler._cost_checks import check_submeshes as check_submeshes
from harpjax.compiler._cost_checks import paper_submeshes as paper_submeshes
from harpjax.errors import CostTablesError

__all__ = ["CostTables", "SubclusterSpec", "LinkSpec", "LayerProfile", "paper_submeshes",
           "check_submeshes", "memory_to_compute_order", "synthetic_gpt_profile"]


@dataclasses.dataclass(frozen=True, eq=False)
class CostTables:
  """Per-stage costs of every (layer range, subcluster, submesh) candidate.

  ``K`` subclusters in pipeline order, ``L`` layers, ``S_k`` submesh choices of subcluster
  ``k``. Arrays are copied to read-only float64.

  Attributes:
    num_layers: ``L``.
    subcluster_names: ``[K]`` names.
    num_hosts: ``[K]`` ``N_k``.
    devices_per_host: ``[K]`` ``M_k``.
    device_memory_bytes: ``[K]`` memory of one device, bytes.
    submeshes: ``[K]`` tuples of ``S_k`` shapes ``(n, m)``.
    stage_time_s: ``[K]`` arrays ``[L, L, S_k]``: forward+backward seconds of one microbatch
      of layers ``i..j`` on submesh ``s``; ``inf`` where infeasible or ``i > j``.
    param_mem_bytes: ``[K]`` arrays ``[L, L, S_k]``: parameter, gradient and optimizer-state
      bytes per device.
    act_mem_bytes: ``[K]`` arrays ``[L, L, S_k]``: activation bytes per device per in-flight
      microbatch.
    boundary_bytes: ``[L]`` bytes crossing a cut after layer ``j`` per microbatch (each
      direction: activations forward, gradients backward).
    intra_bandwidth_bytes_per_s: ``[K]`` bandwidth of the link inside each subcluster.
    intra_latency_s: ``[K]`` its latency.
    inter_bandwidth_bytes_per_s: ``[K - 1]`` bandwidth between subclusters ``k`` and ``k+1``.
    inter_latency_s: ``[K - 1]`` its latency.
    logical_mesh: optional ``[K]`` int arrays ``[L, L, S_k, 2]`` of the chosen ``(dp, tp)``;
      ``None`` means ``(n * m, 1)`` everywhere.
    peak_flops: optional ``[K]`` peak FLOP/s of one device (for the load-balance score).
    layer_names: optional ``[L]`` names.
  """
  num_layers: int
  subcluster_names: tuple[str, ...]
  num_hosts: tuple[int, ...]
  devices_per_host: tuple[int, ...]
  device_memory_bytes: tuple[float, ...]
  submeshes: tuple[tuple[tuple[int, int], ...], ...]
  stage_time_s: tuple[np.ndarray, ...]
  param_mem_bytes: tuple[np.ndarray, ...]
  act_mem_bytes: tuple[np.ndarray, ...]
  boundary_bytes: np.ndarray
  intra_bandwidth_bytes_per_s: tuple[float, ...]
  intra_latency_s: tuple[float, ...]
  inter_bandwidth_bytes_per_s: tuple[float, ...] = ()
  inter_latency_s: tuple[float, ...] = ()
  logical_mesh: tuple[np.ndarray, ...] | None = None
  peak_flops: tuple[float, ...] | None = None
  layer_names: tuple[str, ...] | None = None

  def __post_init__(self):
    L = _int(self.num_layers, "num_layers")
    if L < 1:
      raise CostTablesError(f"num_layers={self.num_layers} must be >= 1")
    names = tuple(str(n) for n in self.subcluster_names)
    K = len(names)
    if K < 1:
      raise CostTablesError("cost tables need at least one subcluster")
    if len(set(names)) != K:
      raise CostTablesError(f"subcluster names {names} repeat")
    set_ = functools.partial(object.__setattr__, self)
    set_("num_layers", L)
    set_("subcluster_names", names)
    for field in ("num_hosts", "devices_per_host"):
      vals = tuple(_int(v, f"{field}[{k}]") for k, v in enumerate(_seq(getattr(self, field),
                                                                         field, K)))
      if min(vals) < 1:
        raise CostTablesError(f"{field}={vals}: every entry must be >= 1")
      set_(field, vals)
    set_("device_memory_bytes", _positive(self.device_memory_bytes, "device_memory_bytes", K))
    set_("intra_bandwidth_bytes_per_s",
         _positive(self.intra_bandwidth_bytes_per_s, "intra_bandwidth_bytes_per_s", K))
    set_("intra_latency_s", _nonneg(self.intra_latency_s, "intra_latency_s", K))
    set_("inter_bandwidth_bytes_per_s",
         _positive(self.inter_bandwidth_bytes_per_s, "inter_bandwidth_bytes_per_s", K - 1))
    set_("inter_latency_s", _nonneg(self.inter_latency_s, "inter_latency_s", K - 1))
    if self.peak_flops is not None:
      set_("peak_flops", _positive(self.peak_flops, "peak_flops", K))
    shapes = tuple(check_submeshes(names[k], self.num_hosts[k], self.devices_per_host[k],
                                   s) for k, s in enumerate(_seq(self.submeshes, "submeshes", K)))
    set_("submeshes", shapes)
    for field in ("stage_time_s", "param_mem_bytes", "act_mem_bytes"):
      arrs = []
      for k, a in enumerate(_seq(getattr(self, field), field, K)):
        a = np.array(a, dtype=np.float64)
        want = (L, L, len(shapes[k]))
        if a.shape != want:
          raise CostTablesError(f"{field}[{k}] ({names[k]!r}) has shape {a.shape}, expected "
                                f"[num_layers, num_layers, num_submeshes] = {list(want)}")
        if np.isnan(a).any():
          raise CostTablesError(f"{field}[{k}] ({names[k]!r}) contains NaN")
        if field == "stage_time_s":
          bad = np.argwhere(a <= 0)
          if bad.size:
            raise CostTablesError(f"stage_time_s[{k}][{tuple(int(x) for x in bad[0])}] = "
                                  f"{a[tuple(bad[0])]}: stage times must be > 0 (inf if "
                                  "infeasible)")
        else:
          bad = np.argwhere((a < 0) | np.isinf(a))
          if bad.size:
            raise CostTablesError(f"{field}[{k}][{tuple(int(x) for x in bad[0])}] = "
                                  f"{a[tuple(bad[0])]}: bytes must be finite and >= 0")
        a.setflags(write=False)
        arrs.append(a)
      set_(field, tuple(arrs))
    b = np.array(self.boundary_bytes, dtype=np.float64).reshape(-1)
    if b.shape != (L,) or not np.isfinite(b).all() or (b < 0).any():
      raise CostTablesError(f"boundary_bytes must be [num_layers={L}] finite values >= 0, got "
                            f"shape {b.shape}")
    b.setflags(write=False)
    set_("boundary_bytes", b)
    if self.logical_mesh is not None:
      meshes = []
      for k, a in enumerate(_seq(self.logical_mesh, "logical_mesh", K)):
        a = np.array(a, dtype=np.int64)
        if a.shape != (L, L, len(shapes[k]), 2):
          raise CostTablesError(f"logical_mesh[{k}] has shape {a.shape}, expected "
                                f"{[L, L, len(shapes[k]), 2]}")
        sizes = np.array([n * m for n, m in shapes[k]])
        ok = (a[..., 0] * a[..., 1] == sizes) | ~np.isfinite(self.stage_time_s[k])
        if not ok.all():
          i, j, s = (int(x) for x in np.argwhere(~ok)[0])
          raise CostTablesError(f"logical_mesh[{k}][{i}, {j}, {s}] = {tuple(a[i, j, s])}: "
                                f"dp * tp must be {sizes[s]} devices of submesh {shapes[k][s]}")
        a.setflags(write=False)
        meshes.append(a)
      set_("logical_mesh", tuple(meshes))
    if self.layer_names is not None:
      if len(self.layer_names) != L:
        raise CostTablesError(f"layer_names has {len(self.layer_names)} names for {L} layers")
      set_("layer_names", tuple(str(n) for n in self.layer_names))

  # ------------------------------------------------------------------ derived quantities

  @property
  def num_subclusters(self) -> int:
    return len(self.subcluster_names)

  @property
  def subcluster_devices(self) -> tuple[int, ...]:
    """``[K]`` devices ``N_k * M_k`` of each subcluster."""
    return tuple(n * m for n, m in zip(self.num_hosts, self.devices_per_host))

  @property
  def device_offsets(self) -> np.ndarray:
    """``[K + 1]`` GPU offsets ``O_k`` (``O_0 = 0``, ``O_K`` = all devices)."""
    return np.concatenate([[0], np.cumsum(self.subcluster_devices)]).astype(np.int64)

  @property
  def total_devices(self) -> int:
    return int(sum(self.subcluster_devices))

  @functools.cached_property
  def intra_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` inside subcluster ``k``: ``C(j)``."""
    lat = np.asarray(self.intra_latency_s)[:, None]
    bw = np.asarray(self.intra_bandwidth_bytes_per_s)[:, None]
    out = lat + self.boundary_bytes[None, :] / bw
    out.setflags(write=False)
    return out

  @functools.cached_property
  def inter_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` from subcluster ``k`` to ``k + 1``.

    Row ``K - 1`` (no next subcluster) is ``inf``.
    """
    K, L = self.num_subclusters, self.num_layers
    out = np.full((K, L), np.inf)
    if K > 1:
      lat = np.asarray(self.inter_latency_s)[:, None]
      bw = np.asarray(self.inter_bandwidth_bytes_per_s)[:, None]
      out[:K - 1] = lat + self.boundary_bytes[None, :] / bw
    out.setflags(write=False)
    return out

  def submesh_index(self, k: int, shape: Sequence[int]) -> int:
    """Index ``s`` of submesh ``shape`` in subcluster ``k``."""
    shape = tuple(int(x) for x in shape)
    try:
      return self.submeshes[k].index(shape)
    except ValueError:
      raise CostTablesError(f"subcluster {self.subcluster_names[k]!r} has no submesh {shape}; "
                            f"its submeshes are {list(self.submeshes[k])}") from None

  def subcluster_index(self, name: str | int) -> int:
    if isinstance(name, (int, np.integer)):
      if not 0 <= int(name) < self.num_subclusters:
        raise CostTablesError(f"subcluster index {name} out of range")
      return int(name)
    try:
      return self.subcluster_names.index(name)
    except ValueError:
      raise CostTablesError(f"unknown subcluster {name!r}; the tables have "
                            f"{list(self.subcluster_names)}") from None

  def logical_mesh_of(self, k: int, i: int, j: int, s: int) -> tuple[int, int]:
    """``(dp, tp)`` chosen for layers ``i..j`` on submesh ``s`` of subcluster ``k``."""
    if self.logical_mesh is None:
      n, m = self.submeshes[k][s]
      return (n * m, 1)
    dp, tp = self.logical_mesh[k][i, j, s]
    return (int(dp), int(tp))

  # ------------------------------------------------------------------ transformations

  def replace(self, **changes) -> "CostTables":
    return dataclasses.replace(self, **changes)

  def without_communication(self) -> "CostTables":
    """The same tables with free links (``C(j) = 0``): the communication-unaware view."""
    K = self.num_subclusters
    return self.replace(boundary_bytes=np.zeros(self.num_layers), intra_latency_s=(0.0,) * K,
                        inter_latency_s=(0.0,) * (K - 1))

  def coarsen(self, last_layers: Sequence[int]) -> "CostTables":
    """Tables over coarse layers made of consecutive fine layers.

    Args:
      last_layers: increasing fine indices where the coarse layers end; the last is ``L - 1``.
        Coarse layer ``I`` is fine layers ``last_layers[I-1] + 1 .. last_layers[I]``.

    Returns:
      Tables whose entries are the fine entries of the corresponding ranges, so a coarse plan
      costs exactly what the same fine plan costs.
    """
    ends = np.asarray([int(x) for x in last_layers], dtype=np.int64)
    if ends.size == 0 or ends[-1] != self.num_layers - 1 or (np.diff(ends) <= 0).any() \
        or ends[0] < 0:
      raise CostTablesError(f"last_layers={list(ends)} must increase and end at "
                            f"{self.num_layers - 1}")
    starts = np.concatenate([[0], ends[:-1] + 1])
    ix = np.ix_(starts, ends)
    pick = lambda arrs: tuple(a[ix] for a in arrs)
    names = None
    if self.layer_names is not None:
      names = tuple(f"{self.layer_names[a]}..{self.layer_names[b]}" if a != b
                    else self.layer_names[a] for a, b in zip(starts, ends))
    return self.replace(
        num_layers=len(ends), stage_time_s=pick(self.stage_time_s),
        param_mem_bytes=pick(self.param_mem_bytes), act_mem_bytes=pick(self.act_mem_bytes),
        boundary_bytes=self.boundary_bytes[ends],
        logical_mesh=None if self.logical_mesh is None else pick(self.logical_mesh),
        layer_names=names)

  def describe(self) -> str:
    """A short human-readable summary."""
    parts = [f"{self.num_layers} layers"]
    for k, name in enumerate(self.subcluster_names):
      parts.append(f"{name}: {self.num_hosts[k]}x{self.devices_per_host[k]}, "
                   f"{self.device_memory_bytes[k] / 2**30:.1f} GiB, "
                   f"{len(self.submeshes[k])} submeshes")
    return "; ".join(parts)

  # ------------------------------------------------------------------ builders

  @classmethod
  def from_layer_costs(cls, layers: "LayerProfile", subclusters: Sequence["SubclusterSpec"],
                       inter_links: "LinkSpec | Sequence[LinkSpec] | Mapping" = (), *,
                       layer_time_s: Sequence[Sequence[float]] | None = None,
                       grad_sync_microbatches: int = 1, max_tp: int | None = None,
                       order: str | Sequence[str] | None = None) -> "CostTables":
    """Builds tables from per-layer costs and a simple cluster description.

    For each range ``i..j``, submesh ``(n, m)`` of ``g = n * m`` devices and logical mesh
    ``(dp, tp)`` (``tp`` divides ``m``, so tensor parallelism stays inside a host):

    * time = ``sum(layer_time) / g`` + all-reduce of ``sum(tp_comm_bytes) / dp`` over ``tp``
      devices on the host link + all-reduce of the gradients ``sum(param_bytes) / tp`` over
      ``dp`` devices (host link if ``n == 1``, else the subcluster link), divided by
      ``grad_sync_microbatches`` (the gradient sync runs once per iteration);
    * parameter memory per device = ``sum(param_mem_bytes) / tp`` (data parallelism
      replicates it); activation memory = ``sum(act_bytes) / dp``.

    The logical mesh with the smallest time among those whose parameters plus one in-flight
    microbatch fit the device is chosen; if none fits, the one with the smallest footprint
    (the planner will then drop the entry). Range sums add layers left to right, so ranges of
    identical layers get bit-identical costs (fewer distinct ``t_max`` candidates).

    Args:
      layers: the per-layer profile (``L`` layers).
      subclusters: the subclusters, :class:`SubclusterSpec`.
      inter_links: the links between subclusters: one :class:`LinkSpec` for every pair, a
        sequence of ``K - 1`` for consecutive pairs in the given order, or a mapping from
        ``(name_a, name_b)`` (either order) to :class:`LinkSpec`.
      layer_time_s: optional per-subcluster ``[L]`` forward+backward seconds of each layer on
        one device (a sequence in the given order or a mapping by name); default
        ``flops / (peak_flops * efficiency)``.
      grad_sync_microbatches: microbatches per iteration over which the gradient all-reduce
        is amortised (``B``; 1 charges it to every microbatch).
      max_tp: largest tensor-parallel degree considered (default ``M``).
      order: ``None`` (as given), ``"memory_to_compute"`` (HARP §5.2.1) or a sequence of
        names: the pipeline order of the subclusters.

    Returns:
      The :class:`CostTables`.
    """
    return build_cost_tables(cls, layers, subclusters, inter_links, layer_time_s,
                             grad_sync_microbatches, max_tp, order)

