"""Cost tables: the planner's only input, as plain arrays.

A :class:`CostTables` says, for every subcluster ``k`` (in pipeline order), every layer range
``i..j`` (inclusive, 0-indexed) and every submesh choice ``s`` of that subcluster, how long one
microbatch's forward+backward takes (``stage_time_s[k][i, j, s]``, best logical mesh already
chosen), how many bytes per device the stage's parameters/optimizer state take
(``param_mem_bytes``) and how many bytes one in-flight microbatch's activations take
(``act_mem_bytes``). ``boundary_bytes[j]`` is what crosses a cut after layer ``j`` per
microbatch; a cut costs ``C(j) = latency + boundary_bytes[j] / bandwidth`` on its link: the
link inside a host when both stages sit on one host (with the tables' host link, by
:func:`harpjax.cluster.host_joins`), else the subcluster's own link between hosts for a cut
inside it, and the link between two subclusters for a cut from one to the other
(:meth:`CostTables.cut_costs`).

Tables can be written by hand (tests, other systems' profiles); both ways of building them from
per-layer costs go through :func:`~harpjax.compiler.profile.assemble.assemble_tables`, which
turns per-(submesh, logical mesh) range costs into the arrays and chooses the logical mesh of
each entry: the profiler (:mod:`harpjax.compiler.profile.profiler`, per-layer costs measured or
analysed per mesh) and :meth:`CostTables.from_layer_costs` (one single-device time per layer,
a :class:`~harpjax.compiler.profile.LayerProfile`, and a simple cluster description, a
:class:`~harpjax.compiler.profile.SubclusterSpec`: :mod:`harpjax.compiler.profile.layer_profile`).
The choice of a rematerialisation mode per stage is a transformation of tables
(:mod:`harpjax.compiler.profile.remat_choice`).

This module is the type: its fields, their checks (:meth:`CostTables.__post_init__` and the
argument checks the other modules of the phase share), what derives from them (GPU offsets, the
seconds of a cut on each link), its own transformations (``coarsen``,
``without_communication``) and the range arithmetic its ``[L, L]`` entries are made of
(:func:`range_sums`, :func:`range_max`).

Submesh shapes follow the paper (:func:`harpjax.cluster.paper_submeshes`): ``(1, 1), (1, 2),
(1, 4), ..., (1, M)`` then ``(2, M), ..., (N, M)``. Any single-host ``(1, m)`` with ``m <= M``
and whole-host ``(n, M)`` are accepted. The planner makes sure the stages of a subcluster pack
onto its hosts: when the single-host widths divide each other and ``M`` (powers of two with
``M`` a power of two), any mix adding up to ``N * M`` devices packs and the DP just counts
devices; otherwise (three ``(1, 4)`` add up to two hosts of 6 but do not fit them) it tracks
the shapes used so far.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Mapping, Sequence

import numpy as np

from harpjax.cluster import BandwidthCurve, Link, host_joins, is_divisibility_chain
from harpjax.errors import CostTablesError
from harpjax.compiler.profile.collectives import cut_time_s
from harpjax.compiler.profile.fees import LinkFees
from harpjax.compiler.layers import LogicalMesh
from harpjax.compiler.trace import REMAT_MODES
from harpjax.compiler.profile.routed_split import RoutedSplit

_SPLIT_KEYS = frozenset(("num_layers", "subcluster_names", "num_hosts", "submeshes",
                         "stage_time_s"))

__all__ = ["CostTables", "check_submeshes", "check_int", "check_seq", "range_sums", "range_max",
           "ENTRY_ARRAYS"]

ENTRY_ARRAYS = ("stage_time_s", "param_mem_bytes", "act_mem_bytes", "logical_mesh",
                "end_time_s", "opt_mem_bytes", "gather_time_s", "sync_time_s",
                "workspace_bytes", "grad_out_bytes", "step_mem_bytes")
"""The :class:`CostTables` fields with one value per entry, ``[L, L, S_k]`` per subcluster
(``logical_mesh``: ``[L, L, S_k, 2]`` or ``[L, L, S_k, 3]``)."""


# --------------------------------------------------------------------------- argument checks


def check_submeshes(name: str, num_hosts: int, devices_per_host: int,
                    shapes: Sequence[tuple[int, int]], *,
                    repeats: bool = False) -> tuple[tuple[int, int], ...]:
  """Validates one subcluster's submesh shapes (``repeats``: a shape may appear more than
  once, as in tables with :attr:`CostTables.variants`).

  Raises:
    CostTablesError: a shape is not ``(1, m)`` with ``1 <= m <= M`` or ``(n, M)`` with
      ``2 <= n <= N``, or shapes repeat.
  """
  out = []
  for shape in shapes:
    try:
      n, m = (int(x) for x in shape)
    except (TypeError, ValueError):
      raise CostTablesError(f"subcluster {name!r}: submesh {shape!r} is not (hosts, devices)")
    if not ((n == 1 and 1 <= m <= devices_per_host)
            or (2 <= n <= num_hosts and m == devices_per_host)):
      raise CostTablesError(
          f"subcluster {name!r} ({num_hosts} hosts x {devices_per_host} devices): submesh "
          f"{(n, m)} must be (1, m) with 1 <= m <= {devices_per_host} (inside one host) or "
          f"(n, {devices_per_host}) with 2 <= n <= {num_hosts} (whole hosts)")
    out.append((n, m))
  if not out:
    raise CostTablesError(f"subcluster {name!r} has no submesh shapes")
  if len(set(out)) != len(out) and not repeats:
    raise CostTablesError(f"subcluster {name!r}: submesh shapes {out} repeat")
  return tuple(out)


def check_int(v, where: str) -> int:
  """``v`` as an int; :class:`~harpjax.errors.CostTablesError` naming ``where`` unless it is
  an integral number."""
  try:
    iv = int(v)
  except (TypeError, ValueError):
    raise CostTablesError(f"{where}={v!r} is not an integer") from None
  if iv != v:
    raise CostTablesError(f"{where}={v!r} is not an integer")
  return iv


def check_seq(v, where: str, n: int) -> tuple:
  """``v`` as a tuple of ``n`` entries (one per subcluster, or per link);
  :class:`~harpjax.errors.CostTablesError` naming ``where`` otherwise."""
  try:
    t = tuple(v)
  except TypeError:
    raise CostTablesError(f"{where} must be a sequence of {n} entries, got {v!r}") from None
  if len(t) != n:
    raise CostTablesError(f"{where} has {len(t)} entries, expected {n} (one per "
                          f"{'subcluster' if n else 'link'})")
  return t


# Arrays a CostTables checked, by identity: ``id(array) -> (weak reference, key, beside)``,
# the key naming the field and its shape, ``beside`` the array the check read beside it (held
# while the checked one lives). Tables built from checked tables
# (one subcluster of them, the same arrays again) take them as they are: the check and the
# copy are skipped, and the arrays are shared (read-only, owning their data).
_CHECKED: dict[int, tuple[weakref.ref, tuple, object]] = {}


def _forget(key_id: int):
  return lambda _ref: _CHECKED.pop(key_id, None)


def _was_checked(a, key: tuple, beside=None) -> bool:
  """Whether ``a`` is an array a CostTables checked with the same ``key`` beside the same
  array, unchanged since (still read-only, owning its data)."""
  hit = _CHECKED.get(id(a))
  return (hit is not None and hit[0]() is a and hit[1] == key and hit[2] is beside
          and isinstance(a, np.ndarray) and not a.flags.writeable and a.base is None)


def _mark_checked(a: np.ndarray, key: tuple, beside=None) -> None:
  if a.base is None and not a.flags.writeable:
    _CHECKED[id(a)] = (weakref.ref(a, _forget(id(a))), key, beside)


def _positive(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in check_seq(v, where, n))
  if any(not (x > 0 and np.isfinite(x)) for x in t):
    raise CostTablesError(f"{where}={t}: every entry must be finite and > 0")
  return t


def _nonneg(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in check_seq(v, where, n))
  if any(not (x >= 0 and np.isfinite(x)) for x in t):
    raise CostTablesError(f"{where}={t}: every entry must be finite and >= 0")
  return t


def _matrix(v, where: str, K: int) -> np.ndarray:
  try:
    a = np.array(v, dtype=np.float64)
  except (TypeError, ValueError):
    raise CostTablesError(f"{where} must be a [{K}, {K}] matrix of numbers") from None
  if a.shape != (K, K):
    raise CostTablesError(f"{where} has shape {a.shape}, expected [{K}, {K}] (one entry per "
                          "pair of subclusters)")
  if not (np.isfinite(a).all() and (a >= 0).all()):
    raise CostTablesError(f"{where}: every entry must be finite and >= 0")
  return a


# --------------------------------------------------------------------------- the tables


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
    intra_bandwidth_bytes_per_s: ``[K]`` bandwidth of the link inside each subcluster (between
      its hosts).
    intra_latency_s: ``[K]`` its latency.
    host_bandwidth_bytes_per_s: optional ``[K]`` bandwidth between two devices of one host
      (NVLink, PCIe): a cut between two stages on one host uses it (where the stages sit:
      :func:`harpjax.cluster.place_stages`). ``None``: every cut inside a subcluster is priced
      at ``intra_*``.
    host_latency_s: optional ``[K]`` its latency (``0`` when only the bandwidth is given).
    fees: optional :class:`~harpjax.compiler.profile.fees.LinkFees`: each subcluster's zone
      and region (by name, a superset of ``subcluster_names``) and the transfer fee per GB of
      each link class, what :func:`~harpjax.compiler.profile.plan_transfer` charges a plan's
      cuts (:func:`~harpjax.compiler.profile.with_fees` sets it from a cluster). ``None``:
      no fees.
    inter_bandwidth_bytes_per_s: ``[K - 1]`` bandwidth between subclusters ``k`` and ``k+1``
      (may be left empty when ``link_bandwidth_bytes_per_s`` is given: then derived from it).
    inter_latency_s: ``[K - 1]`` its latency.
    link_bandwidth_bytes_per_s: optional ``[K, K]``: entry ``[a][b]`` is the bandwidth of a cut
      from a stage on subcluster ``a`` to the next stage on ``b`` (``0``: no link; the diagonal
      is ignored, ``intra_*`` describe it). ``None``: only consecutive subclusters are linked,
      both ways, by ``inter_*``.
    link_latency_s: optional ``[K, K]`` latencies of those links.
    price_per_gpu_hour: optional ``[K]`` price of one device of each subcluster per hour (any
      currency; the plan's hourly rate is the sum over its stages of devices times price).
    logical_mesh: optional ``[K]`` int arrays ``[L, L, S_k, 2]`` of the chosen ``(dp, tp)``,
      or ``[L, L, S_k, 3]`` of the chosen ``(dp, tp, ep)`` (expert parallelism,
      :class:`~harpjax.compiler.layers.sharding.LogicalMesh`); ``None`` means ``(n * m, 1)``
      everywhere.
    peak_flops: optional ``[K]`` peak FLOP/s of one device (for the load-balance score).
    layer_names: optional ``[L]`` names.
    end_time_s: optional ``[K]`` arrays ``[L, L, S_k]``: seconds a stage of layers ``i..j`` on
      submesh ``s`` spends once per iteration after its last backward (gradient
      synchronisation inside its submesh and the optimizer update; the simulator's
      ``end_cost``). ``None``: none (e.g. amortised into ``stage_time_s``).
    opt_mem_bytes: optional ``[K]`` arrays ``[L, L, S_k]``: of ``param_mem_bytes``, the
      optimizer state's bytes per device (the rest is weights and gradients, half each). With
      it the planner may shard the state over the stage's ``dp`` devices (ZeRO levels 1-3,
      :mod:`harpjax.compiler.plan.variants`).
    gather_time_s: optional ``[K]`` arrays ``[L, L, S_k]``: seconds of one all-gather of the
      stage's weights among its ``dp`` replicas (ZeRO-1/2 once per iteration, ZeRO-3 twice
      per microbatch); ``None`` with ``opt_mem_bytes``: free.
    sync_time_s: optional ``[K]`` arrays ``[L, L, S_k]``: of ``end_time_s``, the seconds of the
      stage's gradient all-reduce among its ``dp`` replicas, which the runtime runs once per
      iteration after the last backward at ZeRO levels 0 and 1. A stage that reduces every
      microbatch instead (ZeRO levels 2 and 3: a reduce-scatter per backward; mixed-type
      stages) moves it out of the end time (:func:`~harpjax.compiler.plan.variants.
      variant_arrays`). ``None``: no all-reduce in ``end_time_s``.
    workspace_bytes: optional ``[K]`` arrays ``[L, L, S_k]``: the largest temporaries of the
      stage's layers (a forward's or a backward's, per device). With
      :attr:`grad_out_bytes`, ``param_mem_bytes`` is the memory model's fixed bytes at level
      0 (:meth:`~harpjax.compiler.profile.StageMemory.fixed_bytes`: the state, and the larger
      of a forward's outputs and temporaries and a backward's new gradient and temporaries),
      and every variant's bytes are the model's (:func:`~harpjax.compiler.plan.variants.
      variant_arrays`). ``None``: ``param_mem_bytes`` is taken as the state.
    grad_out_bytes: optional ``[K]`` arrays ``[L, L, S_k]``: the most gradient bytes a backward
      writes beside the accumulator at levels 0 and 1 (the largest layer's: XLA adds each into
      the donated accumulator).
    step_mem_bytes: optional ``[K]`` arrays ``[L, L, S_k]``: per device, the peak of the phases
      after the pipeline, which hold no residual (the replicas' gradient reduction and the
      optimizer update, :meth:`~harpjax.compiler.profile.StageMemory.step_bytes`): an entry
      is usable only where it fits the device. ``None``: not checked.
    remat_modes: optional ``[K]`` tuples, one per entry of ``submeshes[k]``: what a stage on
      that choice recomputes in its backward (one of
      :data:`~harpjax.compiler.trace.REMAT_MODES`, as
      :attr:`~harpjax.compiler.plan.StageSpec.remat`); tables that cost several
      (:func:`with_remat_choice`) let the planner choose it per stage, each priced (the
      recompute's time, the residuals it saves). Shapes then repeat, once per mode. Tables of
      one mode other than ``"none"``/``"full"`` say it here too (:func:`in_remat_mode`).
      ``None``: the tables cost one mode, the plan's :attr:`~harpjax.compiler.plan.Plan.remat`.
    offload_bandwidth_bytes_per_s: optional ``[K]`` bandwidth between a device and its host's
      memory, one direction (PCIe); with it (and ``opt_mem_bytes``) the planner may keep a
      stage's optimizer state in host memory, ``2 O / bandwidth`` seconds per iteration, and
      (with or without ``opt_mem_bytes``) a stage's residuals between forward and backward,
      ``2 A / bandwidth`` seconds per microbatch.
    microbatch_rows: optional rows (sequences) of the microbatch the tables cost (the
      profiler fills it in); mixed-type stages split them among their groups, and the planner
      takes it where :class:`~harpjax.compiler.plan.MixedOptions` gives none.
    variants: set only on tables whose submesh choices are (submesh, ZeRO level, offload,
      residual offload) variants (:func:`harpjax.compiler.plan.variants.expand_variants`):
      ``[K]`` tuples of ``(zero, offload, offload_activations)``, one per entry of
      ``submeshes[k]`` (whose shapes then repeat, once per variant).
    link_curves: optional ``[K, K]`` :class:`~harpjax.cluster.BandwidthCurve` or ``None``
      per link: entry ``[a][b]`` (``a != b``) is the bandwidth by message size of the link
      from subcluster ``a`` to ``b``, ``[k][k]`` that of the link between two hosts of ``k``
      (the cluster file's ``gbps_by_size``). A cut on such a link moves at the curve's
      bandwidth at its message size (:func:`~harpjax.compiler.profile.cut_time_s`); ``None``
      (the whole matrix or an entry): at the link's bandwidth.
    routed_split: optional :class:`~harpjax.compiler.profile.routed_split.RoutedSplit`: the
      experts' part of each routed layer's time and memory, which zebra stages (attention and
      experts on two groups of GPUs, :mod:`harpjax.compiler.plan.zebra_stages`) need.
      ``None``: the planner does not consider zebra stages. Transformations that change the
      submesh choices (variants, remat modes) drop it.
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
  link_bandwidth_bytes_per_s: tuple[tuple[float, ...], ...] | None = None
  link_latency_s: tuple[tuple[float, ...], ...] | None = None
  price_per_gpu_hour: tuple[float, ...] | None = None
  end_time_s: tuple[np.ndarray, ...] | None = None
  opt_mem_bytes: tuple[np.ndarray, ...] | None = None
  gather_time_s: tuple[np.ndarray, ...] | None = None
  sync_time_s: tuple[np.ndarray, ...] | None = None
  workspace_bytes: tuple[np.ndarray, ...] | None = None
  grad_out_bytes: tuple[np.ndarray, ...] | None = None
  step_mem_bytes: tuple[np.ndarray, ...] | None = None
  remat_modes: tuple[tuple[str, ...], ...] | None = None
  offload_bandwidth_bytes_per_s: tuple[float, ...] | None = None
  variants: tuple[tuple[tuple[int, bool, bool], ...], ...] | None = None
  microbatch_rows: int | None = None
  host_bandwidth_bytes_per_s: tuple[float, ...] | None = None
  host_latency_s: tuple[float, ...] | None = None
  fees: LinkFees | None = None
  routed_split: RoutedSplit | None = None
  link_curves: tuple[tuple[BandwidthCurve | None, ...], ...] | None = None

  def __post_init__(self):
    L = check_int(self.num_layers, "num_layers")
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
    if self.microbatch_rows is not None:
      rows = check_int(self.microbatch_rows, "microbatch_rows")
      if rows < 1:
        raise CostTablesError(f"microbatch_rows={self.microbatch_rows} must be >= 1")
      set_("microbatch_rows", rows)
    for field in ("num_hosts", "devices_per_host"):
      vals = tuple(check_int(v, f"{field}[{k}]")
                   for k, v in enumerate(check_seq(getattr(self, field), field, K)))
      if min(vals) < 1:
        raise CostTablesError(f"{field}={vals}: every entry must be >= 1")
      set_(field, vals)
    set_("device_memory_bytes", _positive(self.device_memory_bytes, "device_memory_bytes", K))
    set_("intra_bandwidth_bytes_per_s",
         _positive(self.intra_bandwidth_bytes_per_s, "intra_bandwidth_bytes_per_s", K))
    set_("intra_latency_s", _nonneg(self.intra_latency_s, "intra_latency_s", K))
    if self.host_bandwidth_bytes_per_s is not None:
      set_("host_bandwidth_bytes_per_s", _positive(self.host_bandwidth_bytes_per_s,
                                                   "host_bandwidth_bytes_per_s", K))
      set_("host_latency_s", (0.0,) * K if self.host_latency_s is None else
           _nonneg(self.host_latency_s, "host_latency_s", K))
    elif self.host_latency_s is not None:
      raise CostTablesError("host_latency_s needs host_bandwidth_bytes_per_s")
    self._set_links(K)
    if self.link_curves is not None:
      rows = check_seq(self.link_curves, "link_curves", K)
      curves = tuple(tuple(check_seq(r, f"link_curves[{a}]", K)) for a, r in enumerate(rows))
      for a, r in enumerate(curves):
        for b, c in enumerate(r):
          if c is not None and not isinstance(c, BandwidthCurve):
            raise CostTablesError(f"link_curves[{a}][{b}]={c!r}: expected a BandwidthCurve "
                                  "or None")
      set_("link_curves", None if all(c is None for r in curves for c in r) else curves)
    if self.fees is not None:
      if not isinstance(self.fees, LinkFees):
        raise CostTablesError(f"fees: expected a LinkFees, got {self.fees!r}")
      missing = [n for n in names if n not in self.fees.names]
      if missing:
        raise CostTablesError(f"fees: subclusters {missing} have no zone in the tables' "
                              f"transfer fees (they know {', '.join(self.fees.names)}); "
                              "build them from the tables' cluster (with_fees)")
    if self.price_per_gpu_hour is not None:
      set_("price_per_gpu_hour", _nonneg(self.price_per_gpu_hour, "price_per_gpu_hour", K))
    if self.peak_flops is not None:
      set_("peak_flops", _positive(self.peak_flops, "peak_flops", K))
    repeats = self.variants is not None or self.remat_modes is not None
    shapes = tuple(check_submeshes(names[k], self.num_hosts[k], self.devices_per_host[k],
                                   s, repeats=repeats)
                   for k, s in enumerate(check_seq(self.submeshes, "submeshes", K)))
    set_("submeshes", shapes)
    if self.remat_modes is not None:
      modes = tuple(tuple(str(x) for x in row)
                    for row in check_seq(self.remat_modes, "remat_modes", K))
      for k, row in enumerate(modes):
        if len(row) != len(shapes[k]) or any(x not in REMAT_MODES for x in row):
          raise CostTablesError(f"remat_modes[{k}] must give one of {REMAT_MODES} for each "
                                f"of the {len(shapes[k])} submesh entries")
      set_("remat_modes", modes)
    if self.variants is not None:
      self._set_variants(K)
    elif self.remat_modes is not None:
      for k in range(K):
        keys = list(zip(shapes[k], self.remat_modes[k]))
        if len(set(keys)) != len(keys):
          raise CostTablesError(f"remat_modes[{k}]: a (submesh, remat) repeats")
    if self.offload_bandwidth_bytes_per_s is not None:
      set_("offload_bandwidth_bytes_per_s", _positive(self.offload_bandwidth_bytes_per_s,
                                                      "offload_bandwidth_bytes_per_s", K))
    fields = ("stage_time_s", "param_mem_bytes", "act_mem_bytes")
    for extra in ("end_time_s", "opt_mem_bytes", "gather_time_s", "sync_time_s",
                  "workspace_bytes", "grad_out_bytes", "step_mem_bytes"):
      if getattr(self, extra) is not None:
        fields += (extra,)
    for field in fields:
      arrs = []
      for k, a in enumerate(check_seq(getattr(self, field), field, K)):
        want = (L, L, len(shapes[k]))
        # what the check below reads beside the array itself
        dep = (self.stage_time_s[k] if field in ("end_time_s", "gather_time_s",
                                                 "sync_time_s") else
               self.param_mem_bytes[k] if field == "opt_mem_bytes" else None)
        key = (field, want)
        if _was_checked(a, key, dep):
          arrs.append(a)
          continue
        if not (isinstance(a, np.ndarray) and a.dtype == np.float64 and a.base is None
                and not a.flags.writeable):   # nobody else writes a read-only owner
          a = np.array(a, dtype=np.float64)
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
        elif field in ("end_time_s", "gather_time_s", "sync_time_s"):
          bad = np.argwhere((a < 0) | (np.isinf(a) & np.isfinite(self.stage_time_s[k])))
          if bad.size:
            raise CostTablesError(f"{field}[{k}][{tuple(int(x) for x in bad[0])}] = "
                                  f"{a[tuple(bad[0])]}: must be finite seconds >= 0 "
                                  "where the stage time is finite")
          a = np.where(np.isfinite(a), a, 0.0)
        elif field == "opt_mem_bytes":
          bad = np.argwhere((a < 0) | np.isinf(a) | (a > self.param_mem_bytes[k]))
          if bad.size:
            raise CostTablesError(f"opt_mem_bytes[{k}][{tuple(int(x) for x in bad[0])}] = "
                                  f"{a[tuple(bad[0])]}: the optimizer state's bytes must be "
                                  "finite, >= 0 and at most param_mem_bytes there")
        else:
          bad = np.argwhere((a < 0) | np.isinf(a))
          if bad.size:
            raise CostTablesError(f"{field}[{k}][{tuple(int(x) for x in bad[0])}] = "
                                  f"{a[tuple(bad[0])]}: bytes must be finite and >= 0")
        a.setflags(write=False)
        _mark_checked(a, key, dep)
        arrs.append(a)
      set_(field, tuple(arrs))
    if self.sync_time_s is not None:
      if self.end_time_s is None:
        raise CostTablesError("sync_time_s is a part of end_time_s; give end_time_s too")
      for k in range(K):
        over = self.sync_time_s[k] > self.end_time_s[k] * (1 + 1e-9) + 1e-15
        if over.any():
          i, j, s = (int(x) for x in np.argwhere(over)[0])
          raise CostTablesError(f"sync_time_s[{k}][{i}, {j}, {s}] = "
                                f"{self.sync_time_s[k][i, j, s]} exceeds end_time_s there "
                                f"({self.end_time_s[k][i, j, s]}); it is a part of it")
    if self.workspace_bytes is not None:
      for k in range(K):
        if (self.workspace_bytes[k] > self.param_mem_bytes[k] * (1 + 1e-9) + 1e-9).any():
          raise CostTablesError(f"workspace_bytes[{k}] exceeds param_mem_bytes somewhere; it "
                                "is a part of it")
    b = np.array(self.boundary_bytes, dtype=np.float64).reshape(-1)
    if b.shape != (L,) or not np.isfinite(b).all() or (b < 0).any():
      raise CostTablesError(f"boundary_bytes must be [num_layers={L}] finite values >= 0, got "
                            f"shape {b.shape}")
    b.setflags(write=False)
    set_("boundary_bytes", b)
    if self.logical_mesh is not None:
      meshes = []
      for k, a in enumerate(check_seq(self.logical_mesh, "logical_mesh", K)):
        key = ("logical_mesh", shapes[k], L)
        if _was_checked(a, key, self.stage_time_s[k]):
          meshes.append(a)
          continue
        if not (isinstance(a, np.ndarray) and a.dtype == np.int64 and a.base is None
                and not a.flags.writeable):
          a = np.array(a, dtype=np.int64)
        if a.shape[:-1] != (L, L, len(shapes[k])) or a.shape[-1] not in (2, 3):
          raise CostTablesError(f"logical_mesh[{k}] has shape {a.shape}, expected "
                                f"{[L, L, len(shapes[k]), 2]} ((dp, tp)) or "
                                f"{[L, L, len(shapes[k]), 3]} ((dp, tp, ep))")
        sizes = np.array([n * m for n, m in shapes[k]])
        ok = ((np.prod(a, axis=-1) == sizes) & (a >= 1).all(axis=-1)) | \
            ~np.isfinite(self.stage_time_s[k])
        if not ok.all():
          i, j, s = (int(x) for x in np.argwhere(~ok)[0])
          what = "dp * tp" if a.shape[-1] == 2 else "dp * tp * ep"
          raise CostTablesError(f"logical_mesh[{k}][{i}, {j}, {s}] = {tuple(a[i, j, s])}: "
                                f"{what} must be {sizes[s]} devices of submesh {shapes[k][s]}")
        a.setflags(write=False)
        _mark_checked(a, key, self.stage_time_s[k])
        meshes.append(a)
      set_("logical_mesh", tuple(meshes))
    if self.layer_names is not None:
      if len(self.layer_names) != L:
        raise CostTablesError(f"layer_names has {len(self.layer_names)} names for {L} layers")
      set_("layer_names", tuple(str(n) for n in self.layer_names))
    if self.routed_split is not None:
      if not isinstance(self.routed_split, RoutedSplit):
        raise CostTablesError(f"routed_split={self.routed_split!r} must be a RoutedSplit")
      self.routed_split.check(self)

  def _set_variants(self, K: int) -> None:
    """Checks :attr:`variants`: one ``(zero, offload, offload_activations)`` per submesh entry
    (a pair means no residual offload), no (shape, variant) twice."""
    rows = []
    for k, row in enumerate(check_seq(self.variants, "variants", K)):
      try:
        row = tuple((int(v[0]), bool(v[1]), bool(v[2]) if len(v) == 3 else False)
                    for v in row if 2 <= len(v) <= 3)
      except (TypeError, ValueError):
        row = ()
      if len(row) != len(self.submeshes[k]) or any(z not in (0, 1, 2, 3) for z, _, _ in row):
        raise CostTablesError(f"variants[{k}] must give (zero in 0..3, offload, "
                              f"offload_activations) for each of the "
                              f"{len(self.submeshes[k])} submesh entries")
      modes = self.remat_modes[k] if self.remat_modes is not None else (None,) * len(row)
      keys = list(zip(self.submeshes[k], row, modes))
      if len(set(keys)) != len(keys):
        raise CostTablesError(f"variants[{k}]: a (submesh, zero, offload, offload_activations"
                              "[, remat]) repeats")
      rows.append(row)
    object.__setattr__(self, "variants", tuple(rows))

  def _set_links(self, K: int) -> None:
    """Checks the links between subclusters; fills the matrix or the consecutive ones."""
    set_ = functools.partial(object.__setattr__, self)
    bw_m, lat_m = self.link_bandwidth_bytes_per_s, self.link_latency_s
    if bw_m is None:
      if lat_m is not None:
        raise CostTablesError("link_latency_s needs link_bandwidth_bytes_per_s")
      bw = _positive(self.inter_bandwidth_bytes_per_s, "inter_bandwidth_bytes_per_s", K - 1)
      lat = _nonneg(self.inter_latency_s, "inter_latency_s", K - 1)
      set_("inter_bandwidth_bytes_per_s", bw)
      set_("inter_latency_s", lat)
      m_bw, m_lat = np.zeros((K, K)), np.zeros((K, K))
      for k in range(K - 1):
        m_bw[k, k + 1] = m_bw[k + 1, k] = bw[k]
        m_lat[k, k + 1] = m_lat[k + 1, k] = lat[k]
    else:
      m_bw = _matrix(bw_m, "link_bandwidth_bytes_per_s", K)
      m_lat = np.zeros((K, K)) if lat_m is None else _matrix(lat_m, "link_latency_s", K)
      for k in range(K):
        m_bw[k, k], m_lat[k, k] = 0.0, 0.0
      derived_bw = tuple(float(m_bw[k, k + 1]) for k in range(K - 1))
      derived_lat = tuple(float(m_lat[k, k + 1]) for k in range(K - 1))
      for name, got, want in (("inter_bandwidth_bytes_per_s", self.inter_bandwidth_bytes_per_s,
                               derived_bw),
                              ("inter_latency_s", self.inter_latency_s, derived_lat)):
        got = tuple(float(x) for x in got)
        if got and (len(got) != K - 1 or not np.allclose(got, want, rtol=1e-12, atol=0)):
          raise CostTablesError(f"{name}={got} disagrees with the link matrix's consecutive "
                                f"entries {want}; give one of them")
      set_("inter_bandwidth_bytes_per_s", derived_bw)
      set_("inter_latency_s", derived_lat)
    m_bw.setflags(write=False)
    m_lat.setflags(write=False)
    set_("link_bandwidth_bytes_per_s", tuple(tuple(float(x) for x in r) for r in m_bw))
    set_("link_latency_s", tuple(tuple(float(x) for x in r) for r in m_lat))

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

  def _cuts_on(self, latency_s, bandwidth_bytes_per_s, curves=None) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` on each subcluster's link of these (at
    ``curves[k]``'s bandwidth by message size where given)."""
    K = self.num_subclusters
    curves = (None,) * K if curves is None else curves
    out = np.stack([cut_time_s(self.boundary_bytes, bandwidth_bytes_per_s[k], latency_s[k],
                               curves[k]) for k in range(K)]).reshape(K, self.num_layers)
    out.setflags(write=False)
    return out

  def curve(self, a: int, b: int) -> BandwidthCurve | None:
    """The bandwidth by message size of the link from subcluster ``a`` to ``b`` (``a == b``:
    between two hosts of ``a``), or ``None``."""
    return None if self.link_curves is None else self.link_curves[a][b]

  @functools.cached_property
  def intra_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` inside subcluster ``k``: ``C(j)``."""
    return self._cuts_on(self.intra_latency_s, self.intra_bandwidth_bytes_per_s,
                         [self.curve(k, k) for k in range(self.num_subclusters)])

  @functools.cached_property
  def inter_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` from subcluster ``k`` to ``k + 1``.

    Row ``K - 1`` (no next subcluster) is ``inf``.
    """
    K, L = self.num_subclusters, self.num_layers
    out = np.full((K, L), np.inf)
    for k in range(K - 1):
      out[k] = self.pair_comm_s[k, k + 1]
    out.setflags(write=False)
    return out

  @functools.cached_property
  def pair_comm_s(self) -> np.ndarray:
    """``[K, K, L]`` seconds of a cut after layer ``j`` from a stage on subcluster ``a`` to the
    next stage on ``b``: ``intra_comm_s`` on the diagonal, ``inf`` where no link is known."""
    K, L = self.num_subclusters, self.num_layers
    bw = np.asarray(self.link_bandwidth_bytes_per_s, np.float64)
    lat = np.asarray(self.link_latency_s, np.float64)
    out = np.full((K, K, L), np.inf)
    for a in range(K):
      for b in range(K):
        if a == b:
          out[a, b] = self.intra_comm_s[a]
        elif bw[a, b] > 0:
          out[a, b] = cut_time_s(self.boundary_bytes, bw[a, b], lat[a, b], self.curve(a, b))
    out.setflags(write=False)
    return out

  @functools.cached_property
  def host_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` between two stages on one host of
    subcluster ``k``: the host link, or ``intra_comm_s`` without one."""
    if self.host_bandwidth_bytes_per_s is None:
      return self.intra_comm_s
    return self._cuts_on(self.host_latency_s, self.host_bandwidth_bytes_per_s)

  @functools.cached_property
  def host_priced(self) -> tuple[bool, ...]:
    """``[K]``: whether a cut between two stages on one host of subcluster ``k`` is priced at
    the host link: the tables give one that differs from ``intra_*``, and the single-host
    submesh widths divide each other and ``M`` (then where the stages sit follows from their
    order, :func:`harpjax.cluster.host_joins`; other widths are priced between hosts)."""
    if self.host_bandwidth_bytes_per_s is None:
      return (False,) * self.num_subclusters
    return tuple(bool((self.host_comm_s[k] != self.intra_comm_s[k]).any())
                 and is_divisibility_chain(self.devices_per_host[k], self.submeshes[k])
                 for k in range(self.num_subclusters))

  def cut_costs(self, stages: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """``[S]`` seconds of the cut after each stage of a plan (``0`` after the last), where
    the stages sit, each sent as one message on one link (what the runtime sends: a stage's
    outputs gathered and posted once per consumer stage).

    Args:
      stages: ``(first layer, last layer, subcluster, submesh index)`` in pipeline order.
    """
    S = len(stages)
    out = np.zeros(S)
    joins = self._host_joins(stages)
    for x in range(S - 1):
      a, b, j = stages[x][2], stages[x + 1][2], stages[x][1]
      out[x] = self.host_comm_s[a, j] if joins[x] else self.pair_comm_s[a, b, j]
    return out

  def replica_cut_costs(self, stages: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """``[S]`` seconds of the cut after each stage of a plan sent per data-parallel replica
    pair (Sailor's model): each host of the producer sends its replicas' rows to the hosts
    of the consumer whose rows overlap them, every host pair on its own connection at once,
    :func:`~harpjax.compiler.profile.cut_time_s` with the two stages' :attr:`row_hosts`
    (their submeshes and logical meshes). Two stages on one
    host, or two stages whose rows each sit on one host, send one message as
    :meth:`cut_costs`.

    A cut is sent per replica pair only where that is faster than one message: on a link of
    one bandwidth always when ``h > 1`` (``h`` pairs share the bytes), on a link with a
    :class:`~harpjax.cluster.BandwidthCurve` where ``h x bw(bytes / n) > bw(bytes)`` (one
    sending host, ``h = 1``, splitting its rows into ``n`` smaller, slower messages, is not);
    the seconds are the lesser of the two, so never above :meth:`cut_costs`.

    Args:
      stages: ``(first layer, last layer, subcluster, submesh index)`` in pipeline order.
    """
    S = len(stages)
    out = self.cut_costs(stages)
    joins = self._host_joins(stages)
    for x in range(S - 1):
      if joins[x]:
        continue
      (i0, j0, a, s0), (i1, j1, b, s1) = stages[x], stages[x + 1]
      hp, hc = int(self.row_hosts[a][i0, j0, s0]), int(self.row_hosts[b][i1, j1, s1])
      if hp == 1 and hc == 1:
        continue
      bw, lat = ((self.intra_bandwidth_bytes_per_s[a], self.intra_latency_s[a]) if a == b else
                 (self.link_bandwidth_bytes_per_s[a][b], self.link_latency_s[a][b]))
      out[x] = min(out[x], cut_time_s(self.boundary_bytes[j0], bw, lat, self.curve(a, b),
                                      hp, hc))
    return out

  @functools.cached_property
  def row_hosts(self) -> tuple[np.ndarray, ...]:
    """``[K]`` int arrays ``[L, L, S_k]``: the hosts of a stage on layers ``i..j`` on submesh
    ``s`` that hold distinct rows of its microbatch (:func:`~harpjax.compiler.profile.
    row_hosts` of the entry's submesh and logical mesh): what a cut sent per replica pair
    reads of each of its two stages."""
    out = []
    L = self.num_layers
    for k in range(self.num_subclusters):
      n = np.array([sh[0] for sh in self.submeshes[k]], np.int64)
      if self.logical_mesh is None:
        reps = np.array([sh[0] * sh[1] for sh in self.submeshes[k]], np.int64)[None, None, :]
      else:
        lm = np.asarray(self.logical_mesh[k], np.int64)
        reps = lm[..., 0] * (lm[..., 2] if lm.shape[-1] > 2 else 1)
      a = np.broadcast_to(np.maximum(1, np.minimum(n[None, None, :], reps)),
                          (L, L, len(n))).copy()
      a.setflags(write=False)
      out.append(a)
    return tuple(out)

  def replica_cut_table(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The seconds of a cut from a stage on subcluster ``a`` to one on ``b`` (``a == b``:
    between two hosts of ``a``) sent per replica pair, by the two stages' row hosts
    (:attr:`row_hosts`): what the DP would read beside :attr:`pair_comm_s`.

    Returns:
      ``(hosts_a, hosts_b, seconds)``: the distinct row-host counts of ``a``'s and ``b``'s
      entries (sorted) and ``[len(hosts_a), len(hosts_b), L]`` seconds of the cut after
      layer ``j`` from a stage with ``hosts_a[p]`` row hosts to one with ``hosts_b[q]``
      (``inf`` without a link); ``seconds[0, 0]`` is :attr:`pair_comm_s` ``[a, b]`` when
      both lists start at one host.
    """
    ha = np.unique(self.row_hosts[a])
    hb = np.unique(self.row_hosts[b])
    bw, lat = ((self.intra_bandwidth_bytes_per_s[a], self.intra_latency_s[a]) if a == b else
               (self.link_bandwidth_bytes_per_s[a][b], self.link_latency_s[a][b]))
    out = cut_time_s(self.boundary_bytes[None, None, :], bw, lat, self.curve(a, b),
                     ha[:, None, None], hb[None, :, None])
    out = np.broadcast_to(out, (ha.size, hb.size, self.num_layers)).copy()
    out.setflags(write=False)
    return ha, hb, out

  def _host_joins(self, stages: Sequence[tuple[int, int, int, int]]) -> list[bool]:
    """Per cut of a plan, whether its two stages sit on one host (priced at the host link)."""
    S = len(stages)
    joins = [False] * max(S - 1, 0)
    x = 0
    while x < S:   # each subcluster's run of stages, placed as the allocator places it
      y = x
      while y + 1 < S and stages[y + 1][2] == stages[x][2]:
        y += 1
      k = stages[x][2]
      if self.host_priced[k]:
        run = host_joins(self.devices_per_host[k], [self.submeshes[k][st[3]]
                                                    for st in stages[x:y + 1]])
        joins[x:y] = run
      x = y + 1
    return joins

  def linked(self, a: int, b: int) -> bool:
    """Whether a stage on subcluster ``a`` can be followed by one on ``b`` (``a != b``)."""
    return a != b and self.link_bandwidth_bytes_per_s[a][b] > 0

  @property
  def has_prices(self) -> bool:
    return self.price_per_gpu_hour is not None

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

  def remat_of(self, k: int, s: int) -> str | None:
    """The remat mode of submesh choice ``s`` of subcluster ``k`` (``None``: the tables cost
    one mode, the plan's)."""
    return None if self.remat_modes is None else self.remat_modes[k][s]

  def end_of(self, k: int, i: int, j: int, s: int) -> float:
    """End-of-iteration seconds of layers ``i..j`` on submesh ``s`` of subcluster ``k``
    (``0`` without :attr:`end_time_s`)."""
    return 0.0 if self.end_time_s is None else float(self.end_time_s[k][i, j, s])

  def logical_mesh_of(self, k: int, i: int, j: int, s: int) -> tuple[int, ...]:
    """``(dp, tp)`` (or ``(dp, tp, ep)`` with ``ep > 1``) chosen for layers ``i..j`` on
    submesh ``s`` of subcluster ``k``."""
    if self.logical_mesh is None:
      n, m = self.submeshes[k][s]
      return (n * m, 1)
    return LogicalMesh.of(self.logical_mesh[k][i, j, s]).as_tuple()

  # ------------------------------------------------------------------ transformations

  def replace(self, **changes) -> "CostTables":
    """The tables with ``changes``; a change of the layers, subclusters, submesh choices or
    times drops :attr:`routed_split` (the split is of the entries it was made for) unless
    ``changes`` gives one."""
    if "routed_split" not in changes and _SPLIT_KEYS & changes.keys():
      changes["routed_split"] = None
    return dataclasses.replace(self, **changes)

  def without_communication(self) -> "CostTables":
    """The same tables with free links (``C(j) = 0``): the communication-unaware view."""
    K = self.num_subclusters
    return self.replace(boundary_bytes=np.zeros(self.num_layers), intra_latency_s=(0.0,) * K,
                        inter_bandwidth_bytes_per_s=(), inter_latency_s=(),
                        link_latency_s=((0.0,) * K,) * K,
                        host_latency_s=None if self.host_bandwidth_bytes_per_s is None
                        else (0.0,) * K)

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
        end_time_s=None if self.end_time_s is None else pick(self.end_time_s),
        opt_mem_bytes=None if self.opt_mem_bytes is None else pick(self.opt_mem_bytes),
        gather_time_s=None if self.gather_time_s is None else pick(self.gather_time_s),
        sync_time_s=None if self.sync_time_s is None else pick(self.sync_time_s),
        workspace_bytes=None if self.workspace_bytes is None else pick(self.workspace_bytes),
        grad_out_bytes=None if self.grad_out_bytes is None else pick(self.grad_out_bytes),
        step_mem_bytes=None if self.step_mem_bytes is None else pick(self.step_mem_bytes),
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
                       inter_links: "Link | Sequence[Link] | Mapping" = (), *,
                       layer_time_s: Sequence[Sequence[float]] | None = None,
                       grad_sync_microbatches: int = 1, max_tp: int | None = None,
                       order: str | Sequence[str] | None = None,
                       end_cost: bool = False,
                       optimizer_share: float | None = None) -> "CostTables":
    """Builds tables from per-layer costs and a simple cluster description: the layer-profile
    cost model, ``layers.cost_tables(subclusters, inter_links, ...)``
    (:meth:`~harpjax.compiler.profile.LayerProfile.cost_tables`, which states its equations
    and arguments).

    Raises:
      CostTablesError: ``layers`` is not a :class:`~harpjax.compiler.profile.LayerProfile`,
        or the arguments are invalid (see there).
    """
    if not callable(getattr(layers, "cost_tables", None)):
      raise CostTablesError(f"from_layer_costs takes a harpjax.compiler.profile.LayerProfile, "
                            f"got {type(layers).__name__}")
    return layers.cost_tables(subclusters, inter_links, layer_time_s=layer_time_s,
                              grad_sync_microbatches=grad_sync_microbatches, max_tp=max_tp,
                              order=order, end_cost=end_cost, optimizer_share=optimizer_share)


# --------------------------------------------------------------------------- range arithmetic


def range_sums(x: np.ndarray) -> np.ndarray:
  """``[L, L]`` sums of ``x[i..j]`` added left to right (``inf`` below the diagonal, and where
  any term is not finite): ranges of identical layers get bit-identical sums."""
  x = np.asarray(x, dtype=np.float64)
  L = x.size
  out = np.full((L, L), np.inf)
  for i in range(L):
    out[i, i:] = np.cumsum(x[i:])   # an inf term makes every later sum inf
  return out


def range_max(x: np.ndarray) -> np.ndarray:
  """``[L, L]`` maxima of ``x[i..j]``."""
  x = np.asarray(x, dtype=np.float64)
  L = x.size
  out = np.zeros((L, L))
  for i in range(L):
    out[i, i:] = np.maximum.accumulate(x[i:])
  return out
