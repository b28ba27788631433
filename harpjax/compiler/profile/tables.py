"""Cost tables: the planner's only input, as plain arrays, and the one builder of them.

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
per-layer costs go through :func:`assemble_tables`, which turns per-(submesh, logical mesh)
range costs into the arrays and chooses the logical mesh of each entry: the profiler
(:mod:`harpjax.compiler.profile.profiler`, per-layer costs measured or analysed per mesh) and
:meth:`CostTables.from_layer_costs` (one single-device time per layer, a
:class:`LayerProfile`, and a simple cluster description, :class:`SubclusterSpec`).

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
import logging
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from harpjax.cluster import Link, host_joins, is_divisibility_chain, paper_submeshes
from harpjax.compiler.profile.collectives import allgather_time_s, allreduce_time_s
from harpjax.errors import CostTablesError
from harpjax.compiler.trace import REMAT_MODES

__all__ = ["CostTables", "SubclusterSpec", "LayerProfile", "check_submeshes",
           "memory_to_compute_order", "synthetic_gpt_profile", "assemble_tables", "range_sums",
           "range_max", "with_remat_choice", "in_remat_mode", "ENTRY_ARRAYS"]

ENTRY_ARRAYS = ("stage_time_s", "param_mem_bytes", "act_mem_bytes", "logical_mesh",
                "end_time_s", "opt_mem_bytes", "gather_time_s", "sync_time_s",
                "workspace_bytes", "grad_out_bytes", "step_mem_bytes")
"""The :class:`CostTables` fields with one value per entry, ``[L, L, S_k]`` per subcluster
(``logical_mesh``: ``[L, L, S_k, 2]``)."""


def with_remat_choice(*tables: "CostTables", **by_mode: "CostTables") -> "CostTables":
  """One set of tables whose submesh choices are each submesh once per rematerialisation
  mode (:attr:`CostTables.remat_modes`), from the tables of the same layers and cluster
  costed in each mode: the planner then chooses the mode per stage.

  ``with_remat_choice(none, full)`` (positional: the modes ``"none"`` and ``"full"``, in that
  order) or by name, ``with_remat_choice(none=a, full=b, dots=c)``
  (:data:`~harpjax.compiler.trace.REMAT_MODES`); at least two modes. A table may already say
  its one mode (``remat_modes`` all equal to its name).

  Raises:
    CostTablesError: fewer than two modes, an unknown or repeated mode, tables that do not
      describe the same layers and submeshes, or one already expanded into variants or
      carrying another choice.
  """
  if len(tables) > 2:
    raise CostTablesError("with_remat_choice takes at most two tables by position (none, "
                          "full); name the modes for more: with_remat_choice(none=..., "
                          "full=..., dots=...)")
  given = dict(zip(("none", "full"), tables))
  for mode, t in by_mode.items():
    if mode not in REMAT_MODES or mode in given:
      raise CostTablesError(f"with_remat_choice: mode {mode!r} is unknown or given twice; "
                            f"the modes are {REMAT_MODES}")
    given[mode] = t
  if len(given) < 2:
    raise CostTablesError("with_remat_choice needs the tables of at least two modes")
  modes = [m for m in REMAT_MODES if m in given]
  first = given[modes[0]]
  for mode in modes:
    t = given[mode]
    own = t.remat_modes is None or all(x == mode for row in t.remat_modes for x in row)
    if t.variants is not None or not own:
      raise CostTablesError("with_remat_choice takes tables of one remat mode each, before "
                            "their expansion into variants")
    if t.num_layers != first.num_layers or t.submeshes != first.submeshes or \
        t.subcluster_names != first.subcluster_names:
      raise CostTablesError("with_remat_choice: the tables must cost the same layers on the "
                            "same subclusters and submeshes")
  both = {}
  for f in ENTRY_ARRAYS:
    arrays = [getattr(given[m], f) for m in modes]
    if any(a is None for a in arrays) != all(a is None for a in arrays):
      raise CostTablesError(f"with_remat_choice: {f} is given in some of the tables only")
    if arrays[0] is not None:
      both[f] = tuple(np.concatenate(xs, axis=2) for xs in zip(*arrays))
  return first.replace(submeshes=tuple(s * len(modes) for s in first.submeshes),
                       remat_modes=tuple(tuple(m for m in modes for _ in s)
                                         for s in first.submeshes), **both)


def in_remat_mode(tables: "CostTables", mode: str) -> "CostTables":
  """``tables`` costed in one rematerialisation ``mode`` and saying so: ``"none"``/``"full"``
  as they are (the plan's :attr:`~harpjax.compiler.plan.Plan.remat` names them), any other
  mode in :attr:`CostTables.remat_modes`, so the planned stages carry it."""
  if mode in ("none", "full"):
    return tables
  return tables.replace(remat_modes=tuple((mode,) * len(s) for s in tables.submeshes))


log = logging.getLogger(__name__)


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


def _int(v, where: str) -> int:
  try:
    iv = int(v)
  except (TypeError, ValueError):
    raise CostTablesError(f"{where}={v!r} is not an integer") from None
  if iv != v:
    raise CostTablesError(f"{where}={v!r} is not an integer")
  return iv


def _seq(v, where: str, n: int) -> tuple:
  try:
    t = tuple(v)
  except TypeError:
    raise CostTablesError(f"{where} must be a sequence of {n} entries, got {v!r}") from None
  if len(t) != n:
    raise CostTablesError(f"{where} has {len(t)} entries, expected {n} (one per "
                          f"{'subcluster' if n else 'link'})")
  return t


def _positive(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in _seq(v, where, n))
  if any(not (x > 0 and np.isfinite(x)) for x in t):
    raise CostTablesError(f"{where}={t}: every entry must be finite and > 0")
  return t


def _nonneg(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in _seq(v, where, n))
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
    logical_mesh: optional ``[K]`` int arrays ``[L, L, S_k, 2]`` of the chosen ``(dp, tp)``;
      ``None`` means ``(n * m, 1)`` everywhere.
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
    if self.microbatch_rows is not None:
      rows = _int(self.microbatch_rows, "microbatch_rows")
      if rows < 1:
        raise CostTablesError(f"microbatch_rows={self.microbatch_rows} must be >= 1")
      set_("microbatch_rows", rows)
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
    if self.host_bandwidth_bytes_per_s is not None:
      set_("host_bandwidth_bytes_per_s", _positive(self.host_bandwidth_bytes_per_s,
                                                   "host_bandwidth_bytes_per_s", K))
      set_("host_latency_s", (0.0,) * K if self.host_latency_s is None else
           _nonneg(self.host_latency_s, "host_latency_s", K))
    elif self.host_latency_s is not None:
      raise CostTablesError("host_latency_s needs host_bandwidth_bytes_per_s")
    self._set_links(K)
    if self.price_per_gpu_hour is not None:
      set_("price_per_gpu_hour", _nonneg(self.price_per_gpu_hour, "price_per_gpu_hour", K))
    if self.peak_flops is not None:
      set_("peak_flops", _positive(self.peak_flops, "peak_flops", K))
    repeats = self.variants is not None or self.remat_modes is not None
    shapes = tuple(check_submeshes(names[k], self.num_hosts[k], self.devices_per_host[k],
                                   s, repeats=repeats)
                   for k, s in enumerate(_seq(self.submeshes, "submeshes", K)))
    set_("submeshes", shapes)
    if self.remat_modes is not None:
      modes = tuple(tuple(str(x) for x in row)
                    for row in _seq(self.remat_modes, "remat_modes", K))
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

  def _set_variants(self, K: int) -> None:
    """Checks :attr:`variants`: one ``(zero, offload, offload_activations)`` per submesh entry
    (a pair means no residual offload), no (shape, variant) twice."""
    rows = []
    for k, row in enumerate(_seq(self.variants, "variants", K)):
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

  def _cuts_on(self, latency_s, bandwidth_bytes_per_s) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` on each subcluster's link of these."""
    out = (np.asarray(latency_s)[:, None]
           + self.boundary_bytes[None, :] / np.asarray(bandwidth_bytes_per_s)[:, None])
    out.setflags(write=False)
    return out

  @functools.cached_property
  def intra_comm_s(self) -> np.ndarray:
    """``[K, L]`` seconds of a cut after layer ``j`` inside subcluster ``k``: ``C(j)``."""
    return self._cuts_on(self.intra_latency_s, self.intra_bandwidth_bytes_per_s)

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
          out[a, b] = lat[a, b] + self.boundary_bytes / bw[a, b]
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
    the stages sit.

    Args:
      stages: ``(first layer, last layer, subcluster, submesh index)`` in pipeline order.
    """
    S = len(stages)
    out = np.zeros(S)
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
    for x in range(S - 1):
      a, b, j = stages[x][2], stages[x + 1][2], stages[x][1]
      out[x] = self.host_comm_s[a, j] if joins[x] else self.pair_comm_s[a, b, j]
    return out

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
    """Builds tables from per-layer costs and a simple cluster description.

    For each range ``i..j``, submesh ``(n, m)`` of ``g = n * m`` devices and logical mesh
    ``(dp, tp)`` (``tp`` divides ``m``, so tensor parallelism stays inside a host):

    * time = ``sum(layer_time) / g`` + all-reduce of ``sum(tp_comm_bytes) / dp`` over ``tp``
      devices on the host link + all-reduce of the gradients ``sum(param_bytes) / tp`` over
      ``dp`` devices (host link if ``n == 1``, else the subcluster link), divided by
      ``grad_sync_microbatches`` (the gradient sync runs once per iteration);
    * parameter memory per device = ``sum(param_mem_bytes) / tp`` (data parallelism
      replicates it); activation memory = ``sum(act_bytes) / dp``.

    The logical mesh is chosen by :func:`assemble_tables`. Range sums add layers left to
    right, so ranges of identical layers get bit-identical costs (fewer distinct ``t_max``
    candidates).

    Args:
      layers: the per-layer profile (``L`` layers).
      subclusters: the subclusters, :class:`SubclusterSpec`.
      inter_links: the links between subclusters (:class:`harpjax.cluster.Link`): one for
        every pair, a sequence of ``K - 1`` for consecutive pairs in the given order, or a
        mapping from ``(name_a, name_b)`` to a link (used both ways unless ``(name_b, name_a)``
        is given too; pairs not listed have no link, but consecutive ones in the pipeline
        order must).
      layer_time_s: optional per-subcluster ``[L]`` forward+backward seconds of each layer on
        one device (a sequence in the given order or a mapping by name); default
        ``flops / (peak_flops * efficiency)``.
      grad_sync_microbatches: microbatches per iteration over which the gradient all-reduce
        is amortised (``B``; 1 charges it to every microbatch); with ``end_cost``, the
        microbatches over which the end time is spread when logical meshes are compared.
      max_tp: largest tensor-parallel degree considered (default ``M``).
      order: ``None`` (as given), ``"memory_to_compute"`` (HARP §5.2.1) or a sequence of
        names: the pipeline order of the subclusters.
      end_cost: put the gradient all-reduce where it runs, once per iteration after the
        stage's last backward (:attr:`CostTables.end_time_s`), instead of amortising it over
        ``grad_sync_microbatches``; with the subcluster's ``mem_bandwidth_bytes_per_s`` the
        optimizer update (reading and writing the state, ``2 * param_mem_bytes / tp``) is
        added to it.
      optimizer_share: the optimizer state's share of ``param_mem_bytes`` (``0.75`` for
        mixed-precision Adam, 12 of 16 bytes; ``0.5`` for float32 Adam); with it the tables
        carry :attr:`CostTables.opt_mem_bytes` and :attr:`CostTables.gather_time_s` (a ring
        all-gather of ``param_bytes / tp`` over the ``dp`` replicas, on the gradient sync's
        link), so the planner may choose a ZeRO level per stage, and, where every subcluster
        has ``offload_bandwidth_bytes_per_s``, host offload of the optimizer state.

    Returns:
      The :class:`CostTables`.
    """
    return _from_layer_profile(layers, subclusters, inter_links, layer_time_s,
                               grad_sync_microbatches, max_tp, order, end_cost,
                               optimizer_share)


# --------------------------------------------------------------------------- per-layer costs


@dataclasses.dataclass(frozen=True)
class SubclusterSpec:
  """One homogeneous subcluster, as plain numbers (no dependence on ``harpjax.cluster``).

  Attributes:
    name: subcluster name (``"a100"``).
    num_hosts: ``N``.
    devices_per_host: ``M``.
    memory_bytes: memory of one device.
    peak_flops: peak FLOP/s of one device (used with ``efficiency`` to turn FLOPs into seconds).
    efficiency: achieved fraction of ``peak_flops``.
    bandwidth_bytes_per_s: link between hosts of this subcluster (pipeline cuts inside it and
      collectives that span hosts).
    latency_s: latency of that link.
    host_bandwidth_bytes_per_s: link inside one host (NVLink/PCIe) for collectives of a
      single-host submesh; defaults to ``bandwidth_bytes_per_s``.
    host_latency_s: its latency.
    submeshes: shapes; default :func:`paper_submeshes`.
    price_per_gpu_hour: optional price of one device per hour.
    mem_bandwidth_bytes_per_s: optional device memory bandwidth (the optimizer update's time
      with ``from_layer_costs(..., end_cost=True)``).
    offload_bandwidth_bytes_per_s: optional bandwidth between a device and its host's memory,
      one direction (PCIe 3.0 x16 ~12e9, 4.0 ~25e9): host offload of the optimizer state.
  """
  name: str
  num_hosts: int
  devices_per_host: int
  memory_bytes: float
  bandwidth_bytes_per_s: float
  peak_flops: float | None = None
  efficiency: float = 0.5
  latency_s: float = 0.0
  host_bandwidth_bytes_per_s: float | None = None
  host_latency_s: float = 0.0
  submeshes: tuple[tuple[int, int], ...] | None = None
  price_per_gpu_hour: float | None = None
  mem_bandwidth_bytes_per_s: float | None = None
  offload_bandwidth_bytes_per_s: float | None = None

  def __post_init__(self):
    where = f"subcluster {self.name!r}"
    if self.offload_bandwidth_bytes_per_s is not None and not (
        np.isfinite(self.offload_bandwidth_bytes_per_s)
        and self.offload_bandwidth_bytes_per_s > 0):
      raise CostTablesError(f"{where}: offload_bandwidth_bytes_per_s="
                            f"{self.offload_bandwidth_bytes_per_s} must be finite and > 0")
    if self.mem_bandwidth_bytes_per_s is not None and not (
        np.isfinite(self.mem_bandwidth_bytes_per_s) and self.mem_bandwidth_bytes_per_s > 0):
      raise CostTablesError(f"{where}: mem_bandwidth_bytes_per_s="
                            f"{self.mem_bandwidth_bytes_per_s} must be finite and > 0")
    if self.price_per_gpu_hour is not None and not (
        np.isfinite(self.price_per_gpu_hour) and self.price_per_gpu_hour >= 0):
      raise CostTablesError(f"{where}: price_per_gpu_hour={self.price_per_gpu_hour} must be "
                            "finite and >= 0")
    if _int(self.num_hosts, f"{where}: num_hosts") < 1 or \
        _int(self.devices_per_host, f"{where}: devices_per_host") < 1:
      raise CostTablesError(f"{where}: num_hosts and devices_per_host must be >= 1")
    for f in ("memory_bytes", "bandwidth_bytes_per_s"):
      if not float(getattr(self, f)) > 0:
        raise CostTablesError(f"{where}: {f}={getattr(self, f)} must be > 0")
    if self.peak_flops is not None and not float(self.peak_flops) > 0:
      raise CostTablesError(f"{where}: peak_flops={self.peak_flops} must be > 0")
    if not 0 < float(self.efficiency) <= 1:
      raise CostTablesError(f"{where}: efficiency={self.efficiency} must be in (0, 1]")
    if self.host_bandwidth_bytes_per_s is not None and not self.host_bandwidth_bytes_per_s > 0:
      raise CostTablesError(f"{where}: host_bandwidth_bytes_per_s must be > 0")
    if self.latency_s < 0 or self.host_latency_s < 0:
      raise CostTablesError(f"{where}: latencies must be >= 0")
    shapes = self.submeshes or paper_submeshes(self.num_hosts, self.devices_per_host)
    object.__setattr__(self, "submeshes", check_submeshes(self.name, self.num_hosts,
                                                          self.devices_per_host, shapes))

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProfile:
  """Per-layer costs of one microbatch, for :meth:`CostTables.from_layer_costs`.

  All arrays are ``[L]``.

  Attributes:
    flops: forward+backward FLOPs (including any recomputation).
    param_bytes: bytes of the layer's weights (what the data-parallel gradient all-reduce
      moves, fp16 gradients of the same size).
    param_mem_bytes: bytes of weights + gradients + optimizer state for one model replica.
    act_bytes: activation bytes kept per in-flight microbatch.
    boundary_bytes: bytes of the layer's output per microbatch (what a cut after it sends).
    tp_comm_bytes: bytes all-reduced per microbatch (forward+backward) under tensor
      parallelism.
    names: optional layer names.
  """
  flops: np.ndarray
  param_bytes: np.ndarray
  param_mem_bytes: np.ndarray
  act_bytes: np.ndarray
  boundary_bytes: np.ndarray
  tp_comm_bytes: np.ndarray | None = None
  names: tuple[str, ...] | None = None

  def __post_init__(self):
    n = None
    for f in ("flops", "param_bytes", "param_mem_bytes", "act_bytes", "boundary_bytes",
              "tp_comm_bytes"):
      v = getattr(self, f)
      if v is None:
        continue
      a = np.array(v, dtype=np.float64).reshape(-1)
      if n is None:
        n = a.size
      if a.size != n or not np.isfinite(a).all() or (a < 0).any():
        raise CostTablesError(f"layer profile {f}: expected {n} finite values >= 0")
      a.setflags(write=False)
      object.__setattr__(self, f, a)
    if not n:
      raise CostTablesError("a layer profile needs at least one layer")
    if self.tp_comm_bytes is None:
      z = np.zeros(n)
      z.setflags(write=False)
      object.__setattr__(self, "tp_comm_bytes", z)
    if self.names is not None and len(self.names) != n:
      raise CostTablesError(f"layer profile names: {len(self.names)} names for {n} layers")

  @property
  def num_layers(self) -> int:
    return int(self.flops.size)


def memory_to_compute_order(subclusters: Sequence[SubclusterSpec]) -> tuple[str, ...]:
  """Subcluster names, higher memory-to-compute ratio first (HARP §5.2.1).

  Early pipeline stages hold the most in-flight microbatches, so the subcluster with the most
  memory per FLOP/s goes first. Ties keep the given order.
  """
  def ratio(s):
    if s.peak_flops is None:
      raise CostTablesError(f"subcluster {s.name!r}: peak_flops is needed to order by "
                            "memory-to-compute ratio")
    return s.memory_bytes / (s.peak_flops * s.efficiency)
  return tuple(s.name for s in sorted(subclusters, key=lambda s: -ratio(s)))


# --------------------------------------------------------------------------- the builder


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


MeshCosts = tuple  # (mesh, time, param bytes, act bytes[, end time]); arrays [L, L]
"""``((dp, tp), time_s [L, L], param_mem_bytes [L, L], act_mem_bytes [L, L])`` of every layer
range on one submesh under one logical mesh."""


def assemble_tables(*, names: Sequence[str], num_hosts: Sequence[int],
                    devices_per_host: Sequence[int], memory_bytes: Sequence[float],
                    submeshes: Sequence[Sequence[tuple[int, int]]],
                    mesh_costs: Callable[[int, int], Iterable[MeshCosts]],
                    boundary_bytes: Sequence[float], intra_links: Sequence[Link],
                    inter_links: Sequence[Link], peak_flops: Sequence[float] | None = None,
                    layer_flops: Sequence[float] | None = None, imbalance: float = np.inf,
                    layer_names: Sequence[str] | None = None,
                    pair_links: Sequence[Sequence[Link | None]] | None = None,
                    price_per_gpu_hour: Sequence[float] | None = None,
                    offload_bandwidth_bytes_per_s: Sequence[float] | None = None,
                    host_links: Sequence[Link] | None = None,
                    num_microbatches: int | None = None
                    ) -> tuple[CostTables, dict]:
  """Builds :class:`CostTables` from the range costs of every (submesh, logical mesh).

  For each entry (layer range, submesh) the logical mesh kept is the fastest (time per
  microbatch, plus the end time over ``num_microbatches`` when given) of those whose
  parameters plus one in-flight microbatch fit the device; if none fits, with the optimizer
  state given, the fastest that fits with its state split over its ``dp`` devices (what the
  planner's ZeRO variants can use); else the one with the smallest footprint (its time is
  kept: the planner drops the entry by its memory check).
  A multi-layer range whose share of the model's FLOPs exceeds ``imbalance`` times its
  submesh's share of the cluster's peak FLOP/s is hopelessly imbalanced (§5.1) and marked
  infeasible (``inf``).

  Args:
    names, num_hosts, devices_per_host, memory_bytes: ``[K]`` per subcluster, in pipeline
      order.
    submeshes: ``[K]`` tuples of ``(n, m)``.
    mesh_costs: ``mesh_costs(k, s)`` yields :data:`MeshCosts` of submesh ``s`` of subcluster
      ``k``: ``((dp, tp), time, param bytes, act bytes)`` ``[L, L]`` arrays (an ``inf`` time
      marks a range that cannot run), optionally with a fifth, the end-of-iteration seconds
      (:attr:`CostTables.end_time_s`), and then a sixth and a seventh, the optimizer state's
      bytes and the weights' all-gather seconds (:attr:`CostTables.opt_mem_bytes`,
      :attr:`CostTables.gather_time_s`; both ``None``: no ZeRO data), and an eighth, the
      gradient all-reduce's part of the end time (:attr:`CostTables.sync_time_s`), and a
      ninth, a tenth and an eleventh, the layers' largest temporaries, the peak after the
      pipeline and the most gradient a backward writes beside the accumulator
      (:attr:`CostTables.workspace_bytes`, :attr:`CostTables.step_mem_bytes`,
      :attr:`CostTables.grad_out_bytes`).
    boundary_bytes: ``[L]``.
    intra_links: ``[K]`` links inside each subcluster; inter_links: ``[K - 1]`` between
      consecutive ones.
    pair_links: optional ``[K, K]`` links between any two subclusters (``None`` where there is
      none; the diagonal is ignored); ``inter_links`` may then be empty.
    price_per_gpu_hour: optional ``[K]`` price of one device per hour.
    offload_bandwidth_bytes_per_s: optional ``[K]`` device-to-host-memory bandwidth
      (:attr:`CostTables.offload_bandwidth_bytes_per_s`).
    host_links: optional ``[K]`` links between two devices of one host (cuts between stages
      sharing a host, :attr:`CostTables.host_bandwidth_bytes_per_s`).
    peak_flops: optional ``[K]`` peak FLOP/s of one device (the imbalance rule and the
      load-balance score).
    layer_flops: ``[L]`` forward FLOPs per layer, for the imbalance rule.
    imbalance: the pruning factor (``inf`` disables it).
    layer_names: optional ``[L]``.
    num_microbatches: the iteration's microbatches, over which an end time is spread when
      logical meshes are compared (``None``: meshes are compared by time per microbatch).

  Returns:
    ``(tables, counts)``, counts of entries that fit no logical mesh (``"oom"``) and of entries
    pruned as imbalanced (``"imbalance"``).
  """
  K, L = len(names), len(boundary_bytes)
  iu = np.triu_indices(L)
  hopeless_share = None
  if np.isfinite(imbalance):
    flops = np.asarray(layer_flops, dtype=np.float64)
    share_f = range_sums(flops) / max(flops.sum(), 1e-30)
    total_peak = sum(peak_flops[k] * num_hosts[k] * devices_per_host[k] for k in range(K))
    multi = np.zeros((L, L), dtype=bool)
    multi[iu] = iu[0] < iu[1]
    hopeless_share = lambda k, g: multi & (share_f > imbalance * peak_flops[k] * g / total_peak)
  counts = {"oom": 0, "imbalance": 0}
  stage_t, param_m, act_m, logical, end_t, opt_m, gat_t, sync_t = [], [], [], [], [], [], [], []
  work_m, step_m, gout_m = [], [], []
  has_end = has_zero = has_sync = has_mem = False
  per_iteration = 0.0 if num_microbatches is None else 1.0 / num_microbatches
  for k in range(K):
    S = len(submeshes[k])
    t_k = np.full((L, L, S), np.inf)
    p_k, a_k, e_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    o_k, g_k, y_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    w_k, z_k, q_k = np.zeros((L, L, S)), np.zeros((L, L, S)), np.zeros((L, L, S))
    lm_k = np.zeros((L, L, S, 2), dtype=np.int64)
    for s, (n, m) in enumerate(submeshes[k]):
      g = n * m
      lm_k[..., s, 0], lm_k[..., s, 1] = g, 1
      # [fits, time, param, act, dp, tp, footprint, end, opt, gather, tier, sync, rank];
      # tier 2: fits at level 0, 1: fits only with its state split over dp (ZeRO-3, given
      # the optimizer state), 0: neither. Rank: the time per microbatch with the end time
      # spread over the iteration's microbatches.
      best = None
      for (dp, tp), t, pm, am, *rest in mesh_costs(k, s):
        has_end |= bool(rest)
        end = rest[0] if rest else 0.0
        with_zero = len(rest) > 1 and rest[1] is not None
        opt, gat = (rest[1], rest[2]) if with_zero else (0.0, 0.0)
        has_zero |= with_zero
        sync = rest[3] if len(rest) > 3 else 0.0
        has_sync |= len(rest) > 3
        work, step, gout = (rest[4], rest[5], rest[6]) if len(rest) > 6 else (0.0, 0.0, 0.0)
        has_mem |= len(rest) > 6
        rank = t + np.asarray(end) * per_iteration if per_iteration else t
        foot = pm + am
        fits = np.isfinite(t) & (foot <= memory_bytes[k]) & (step <= memory_bytes[k])
        tier = np.where(fits, 2, 0)
        if with_zero:
          tier = np.where(~fits & np.isfinite(t) & (pm / dp + am <= memory_bytes[k]), 1, tier)
        if best is None:
          best = [fits, t, pm, am, np.full((L, L), dp), np.full((L, L), tp), foot,
                  np.broadcast_to(end, (L, L)), np.broadcast_to(opt, (L, L)),
                  np.broadcast_to(gat, (L, L)), tier, np.broadcast_to(sync, (L, L)),
                  np.broadcast_to(rank, (L, L)), np.broadcast_to(work, (L, L)),
                  np.broadcast_to(step, (L, L)), np.broadcast_to(gout, (L, L))]
          continue
        better = (tier > best[10]) | ((tier == best[10]) & (tier > 0) & (rank < best[12])) | \
            ((tier == 0) & (best[10] == 0) & (foot < best[6]))
        for idx, new in enumerate((fits, t, pm, am, dp, tp, foot, end, opt, gat, tier, sync,
                                   rank, work, step, gout)):
          best[idx] = np.where(better, new, best[idx])
      if best is None:
        continue
      fits, t, pm, am, dps, tps, _, ends, opts, gats, _, syncs, _, works, steps, gouts = best
      keep = np.isfinite(t)
      counts["oom"] += int(np.sum(~fits[iu]))
      if hopeless_share is not None:
        hopeless = hopeless_share(k, g)
        counts["imbalance"] += int(np.sum((hopeless & fits)[iu]))
        keep &= ~hopeless
      t_k[iu[0], iu[1], s] = np.where(keep, t, np.inf)[iu]
      p_k[iu[0], iu[1], s] = np.where(np.isfinite(pm), pm, 0.0)[iu]
      a_k[iu[0], iu[1], s] = np.where(np.isfinite(am), am, 0.0)[iu]
      e_k[iu[0], iu[1], s] = np.where(np.isfinite(ends), ends, 0.0)[iu]
      o_k[iu[0], iu[1], s] = np.where(np.isfinite(opts), opts, 0.0)[iu]
      g_k[iu[0], iu[1], s] = np.where(np.isfinite(gats), gats, 0.0)[iu]
      y_k[iu[0], iu[1], s] = np.where(np.isfinite(syncs), syncs, 0.0)[iu]
      w_k[iu[0], iu[1], s] = np.where(np.isfinite(works), works, 0.0)[iu]
      z_k[iu[0], iu[1], s] = np.where(np.isfinite(steps), steps, 0.0)[iu]
      q_k[iu[0], iu[1], s] = np.where(np.isfinite(gouts), gouts, 0.0)[iu]
      lm_k[..., s, 0] = np.where(keep, dps, g)
      lm_k[..., s, 1] = np.where(keep, tps, 1)
    stage_t.append(t_k)
    param_m.append(p_k)
    act_m.append(a_k)
    logical.append(lm_k)
    end_t.append(e_k)
    opt_m.append(np.minimum(o_k, p_k))
    gat_t.append(g_k)
    sync_t.append(np.minimum(y_k, e_k))
    work_m.append(np.minimum(w_k, p_k))
    step_m.append(z_k)
    gout_m.append(q_k)
  tables = CostTables(
      num_layers=L, subcluster_names=tuple(names), num_hosts=tuple(num_hosts),
      devices_per_host=tuple(devices_per_host), device_memory_bytes=tuple(memory_bytes),
      submeshes=tuple(tuple(s) for s in submeshes), stage_time_s=tuple(stage_t),
      param_mem_bytes=tuple(param_m), act_mem_bytes=tuple(act_m),
      boundary_bytes=np.asarray(boundary_bytes, dtype=np.float64),
      intra_bandwidth_bytes_per_s=tuple(l.bandwidth_bytes_per_s for l in intra_links),
      intra_latency_s=tuple(l.latency_s for l in intra_links),
      inter_bandwidth_bytes_per_s=tuple(l.bandwidth_bytes_per_s for l in inter_links),
      inter_latency_s=tuple(l.latency_s for l in inter_links),
      link_bandwidth_bytes_per_s=None if pair_links is None else tuple(
          tuple(0.0 if (l is None or a == b) else l.bandwidth_bytes_per_s
                for b, l in enumerate(row)) for a, row in enumerate(pair_links)),
      link_latency_s=None if pair_links is None else tuple(
          tuple(0.0 if (l is None or a == b) else l.latency_s for b, l in enumerate(row))
          for a, row in enumerate(pair_links)),
      price_per_gpu_hour=None if price_per_gpu_hour is None else tuple(
          float(p) for p in price_per_gpu_hour),
      logical_mesh=tuple(logical), end_time_s=tuple(end_t) if has_end else None,
      opt_mem_bytes=tuple(opt_m) if has_zero else None,
      gather_time_s=tuple(gat_t) if has_zero else None,
      sync_time_s=tuple(sync_t) if has_sync and has_end else None,
      workspace_bytes=tuple(work_m) if has_mem else None,
      step_mem_bytes=tuple(step_m) if has_mem else None,
      grad_out_bytes=tuple(gout_m) if has_mem else None,
      offload_bandwidth_bytes_per_s=None if offload_bandwidth_bytes_per_s is None else tuple(
          float(b) for b in offload_bandwidth_bytes_per_s),
      host_bandwidth_bytes_per_s=None if host_links is None else tuple(
          l.bandwidth_bytes_per_s for l in host_links),
      host_latency_s=None if host_links is None else tuple(l.latency_s for l in host_links),
      peak_flops=None if peak_flops is None else tuple(float(p) for p in peak_flops),
      layer_names=tuple(layer_names) if layer_names is not None else None)
  return tables, counts


def _from_layer_profile(layers: LayerProfile, subclusters, inter_links, layer_time_s,
                        grad_sync_microbatches, max_tp, order, end_cost=False,
                        optimizer_share=None) -> CostTables:
  """The body of :meth:`CostTables.from_layer_costs` (see there for the equations)."""
  specs = list(subclusters)
  if not specs or not all(isinstance(s, SubclusterSpec) for s in specs):
    raise CostTablesError("subclusters must be a non-empty sequence of SubclusterSpec")
  names = [s.name for s in specs]
  if len(set(names)) != len(names):
    raise CostTablesError(f"subcluster names {names} repeat")
  if _int(grad_sync_microbatches, "grad_sync_microbatches") < 1:
    raise CostTablesError("grad_sync_microbatches must be >= 1")
  if optimizer_share is not None and not 0.0 <= float(optimizer_share) < 1.0:
    raise CostTablesError(f"optimizer_share={optimizer_share} must be in [0, 1): the optimizer "
                          "state's share of param_mem_bytes")
  L = layers.num_layers
  # Per-layer single-device seconds, keyed by name.
  times: dict[str, np.ndarray] = {}
  if layer_time_s is None:
    for s in specs:
      if s.peak_flops is None:
        raise CostTablesError(f"subcluster {s.name!r}: give peak_flops or layer_time_s")
      times[s.name] = layers.flops / (s.peak_flops * s.efficiency)
  else:
    items = (layer_time_s.items() if isinstance(layer_time_s, Mapping)
             else zip(names, _seq(layer_time_s, "layer_time_s", len(specs))))
    for name, v in items:
      a = np.array(v, dtype=np.float64).reshape(-1)
      if a.shape != (L,) or not np.isfinite(a).all() or (a <= 0).any():
        raise CostTablesError(f"layer_time_s[{name!r}] must be {L} finite values > 0")
      times[str(name)] = a
    if set(times) != set(names):
      raise CostTablesError(f"layer_time_s names {sorted(times)} != subclusters {sorted(names)}")
  # Pipeline order.
  if order is None:
    ordered = names
  elif isinstance(order, str):
    if order != "memory_to_compute":
      raise CostTablesError(f"order={order!r}: use None, 'memory_to_compute' or a list of names")
    ordered = list(memory_to_compute_order(specs))
  else:
    ordered = [str(x) for x in order]
    if sorted(ordered) != sorted(names):
      raise CostTablesError(f"order={ordered} must list each subcluster {names} once")
  by_name = {s.name: s for s in specs}
  specs = [by_name[n] for n in ordered]
  # Links between subclusters: every pair that has one.
  K = len(ordered)
  pair: list[list[Link | None]] = [[None] * K for _ in range(K)]
  if isinstance(inter_links, Link):
    pair = [[None if a == b else inter_links for b in range(K)] for a in range(K)]
  elif isinstance(inter_links, Mapping):
    for (a, b), link in inter_links.items():
      if a not in ordered or b not in ordered:
        raise CostTablesError(f"inter_links: unknown subcluster in ({a!r}, {b!r}); the "
                              f"subclusters are {names}")
      pair[ordered.index(a)][ordered.index(b)] = link
      if (b, a) not in inter_links:
        pair[ordered.index(b)][ordered.index(a)] = link
  else:
    seq = list(inter_links)
    if len(seq) != len(names) - 1 or ordered != names:
      raise CostTablesError("inter_links as a sequence needs K - 1 links in the given order; "
                            "use a mapping {(a, b): Link} when reordering")
    for k, link in enumerate(seq):
      pair[k][k + 1] = pair[k + 1][k] = link
  for a in range(K):
    for b in range(K):
      link = pair[a][b]
      if a != b and link is not None and not isinstance(link, Link):
        raise CostTablesError(f"inter_links: expected harpjax.cluster.Link, got {link!r}")
  for a, b in zip(range(K), range(1, K)):
    if pair[a][b] is None:
      raise CostTablesError(f"inter_links has no link between {ordered[a]!r} and "
                            f"{ordered[b]!r}")
  links = [pair[k][k + 1] for k in range(K - 1)]
  sums = {f: range_sums(getattr(layers, f))
          for f in ("param_bytes", "param_mem_bytes", "act_bytes", "tp_comm_bytes")}

  def mesh_costs(k: int, si: int):
    s = specs[k]
    n, m = s.submeshes[si]
    g = n * m
    host = Link(s.host_bandwidth_bytes_per_s or s.bandwidth_bytes_per_s,
                s.host_latency_s if s.host_bandwidth_bytes_per_s else s.latency_s)
    node = Link(s.bandwidth_bytes_per_s, s.latency_s)
    tsum = range_sums(times[s.name])
    for tp in range(1, m + 1):
      if m % tp or (max_tp is not None and tp > max_tp):
        continue
      dp = g // tp
      t = tsum / g
      if tp > 1:
        t = t + allreduce_time_s(sums["tp_comm_bytes"] / dp, tp, host)
      sync = 0.0
      link = host if n == 1 else node
      if dp > 1:
        sync = allreduce_time_s(sums["param_bytes"] / tp, dp, link)
      zero = ()
      if optimizer_share is not None:
        gather = allgather_time_s(sums["param_bytes"] / tp, dp, link)
        zero = (float(optimizer_share) * sums["param_mem_bytes"] / tp, gather)
      if not end_cost:
        if zero:
          yield (dp, tp), t + sync / grad_sync_microbatches, sums["param_mem_bytes"] / tp, \
              sums["act_bytes"] / dp, np.zeros((L, L)), *zero
        else:
          yield (dp, tp), t + sync / grad_sync_microbatches, sums["param_mem_bytes"] / tp, \
              sums["act_bytes"] / dp
        continue
      end = sync + np.zeros((L, L))
      if s.mem_bandwidth_bytes_per_s is not None:
        end = end + 2.0 * sums["param_mem_bytes"] / tp / s.mem_bandwidth_bytes_per_s
      yield ((dp, tp), t, sums["param_mem_bytes"] / tp, sums["act_bytes"] / dp, end, *zero,
             *((sync + np.zeros((L, L)),) if zero else ()))

  peak = None
  if all(s.peak_flops is not None for s in specs):
    peak = tuple(float(s.peak_flops) for s in specs)
  prices = None
  if any(s.price_per_gpu_hour is not None for s in specs):
    missing = [s.name for s in specs if s.price_per_gpu_hour is None]
    if missing:
      raise CostTablesError(f"subclusters {missing} have no price_per_gpu_hour while others "
                            "have one; price every subcluster or none")
    prices = [float(s.price_per_gpu_hour) for s in specs]
  offload = None
  if optimizer_share is not None and all(s.offload_bandwidth_bytes_per_s for s in specs):
    offload = [float(s.offload_bandwidth_bytes_per_s) for s in specs]
  tables, _ = assemble_tables(
      names=ordered, num_hosts=[s.num_hosts for s in specs],
      devices_per_host=[s.devices_per_host for s in specs],
      memory_bytes=[float(s.memory_bytes) for s in specs],
      submeshes=[s.submeshes for s in specs], mesh_costs=mesh_costs,
      boundary_bytes=layers.boundary_bytes,
      intra_links=[Link(float(s.bandwidth_bytes_per_s), float(s.latency_s)) for s in specs],
      inter_links=links, peak_flops=peak, layer_names=layers.names, pair_links=pair,
      price_per_gpu_hour=prices, offload_bandwidth_bytes_per_s=offload,
      host_links=[Link(float(s.host_bandwidth_bytes_per_s or s.bandwidth_bytes_per_s),
                       float(s.host_latency_s if s.host_bandwidth_bytes_per_s else s.latency_s))
                  for s in specs],
      num_microbatches=grad_sync_microbatches if end_cost else None)
  log.debug("cost tables: %d layers x %d subclusters built from layer costs", L, len(specs))
  return tables


# --------------------------------------------------------------------------- synthetic profiles


def synthetic_gpt_profile(num_blocks: int = 48, hidden: int = 8192, seq_len: int = 1024,
                          microbatch: int = 8, vocab: int = 51200, dtype_bytes: int = 2,
                          state_bytes_per_param: int = 16) -> LayerProfile:
  """An analytic GPT profile: embedding, ``3`` layers per block, head (``3 * blocks + 2``).

  The three layers of a block are ``attn`` (LayerNorm, QKV projection, attention core),
  ``proj`` (output projection, residual) and ``mlp`` (LayerNorm, two matmuls, residual). With
  activation recomputation at layer boundaries, forward+backward costs ``4x`` the forward
  FLOPs and a layer keeps only its input per in-flight microbatch. The cut after ``attn``
  carries the attention output and the residual stream (twice the ``(tokens, hidden)``
  tensor); the other cuts carry one. Under tensor parallelism a block all-reduces the
  ``(tokens, hidden)`` tensor six times (two forward, two recomputed, two backward).

  Args:
    num_blocks: transformer blocks (48 for GPT-39B).
    hidden: hidden size (8192).
    seq_len: tokens per sequence (1024).
    microbatch: sequences per microbatch (8).
    vocab: vocabulary size.
    dtype_bytes: bytes of one activation/weight element (2 for fp16).
    state_bytes_per_param: bytes of weights + gradients + optimizer state per parameter
      (16 for mixed-precision Adam).

  Returns:
    The :class:`LayerProfile`.
  """
  h, tok = float(hidden), float(microbatch * seq_len)
  x = tok * h * dtype_bytes
  rows = [("embed", 2 * h, (vocab + seq_len) * h, x, x, 0.0)]
  for b in range(num_blocks):
    rows += [(f"block{b}.attn", 6 * h * h + 4 * seq_len * h, 3 * h * h + 5 * h, x, 2 * x, x),
             (f"block{b}.proj", 2 * h * h, h * h + h, 2 * x, x, 2 * x),
             (f"block{b}.mlp", 16 * h * h, 8 * h * h + 7 * h, x, x, 3 * x)]
  rows.append(("head", 2 * h * vocab, h * vocab + 2 * h, x, 0.0, 0.0))
  names, fwd_per_token, params, act, boundary, tpc = zip(*rows)
  params = np.array(params)
  return LayerProfile(flops=4 * tok * np.array(fwd_per_token), param_bytes=params * dtype_bytes,
                      param_mem_bytes=params * state_bytes_per_param, act_bytes=np.array(act),
                      boundary_bytes=np.array(boundary), tp_comm_bytes=np.array(tpc),
                      names=tuple(names))

