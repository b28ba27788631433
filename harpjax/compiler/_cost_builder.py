"""Building cost tables from per-layer costs: the inputs and the builder.

:class:`LayerProfile` holds per-layer costs of one microbatch (:func:`synthetic_gpt_profile`
makes an analytic GPT one), :class:`SubclusterSpec` and :class:`LinkSpec` describe the cluster
as plain numbers, and :func:`build_cost_tables` turns them into per-(layer range, submesh)
arrays, choosing the logical mesh ``(dp, tp)`` of each entry; it is what
:meth:`CostTables.from_layer_costs <harpjax.compiler.cost_tables.CostTables.from_layer_costs>`
runs (see its docstring for the equations). Every public name here is re-exported by
:mod:`harpjax.compiler.cost_tables`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from harpjax.compiler._cost_checks import _int, _seq, check_submeshes, paper_submeshes
from harpjax.errors import CostTablesError

if TYPE_CHECKING:
  from harpjax.compiler.cost_tables import CostTables

__all__ = ["SubclusterSpec", "LinkSpec", "LayerProfile", "memory_to_compute_order",
           "build_cost_tables", "synthetic_gpt_profile"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- simple inputs


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

  def __post_init__(self):
    where = f"subcluster {self.name!r}"
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


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """A link between two subclusters: bandwidth (bytes/s) and latency (s)."""
  bandwidth_bytes_per_s: float
  latency_s: float = 0.0

  def __post_init__(self):
    if not float(self.bandwidth_bytes_per_s) > 0 or float(self.latency_s) < 0:
      raise CostTablesError(f"link bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be "
                            f"> 0 and latency_s={self.latency_s} >= 0")


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



# --------------------------------------------------------------------------- builder


def build_cost_tables(cls, layers, subclusters, inter_links, layer_time_s, grad_sync_microbatches,
                      max_tp, order) -> CostTables:
  """The body of :meth:`CostTables.from_layer_costs`; ``cls`` is the class to build."""
  specs = list(subclusters)
  if not specs or not all(isinstance(s, SubclusterSpec) for s in specs):
    raise CostTablesError("subclusters must be a non-empty sequence of SubclusterSpec")
  names = [s.name for s in specs]
  if len(set(names)) != len(names):
    raise CostTablesError(f"subcluster names {names} repeat")
  if _int(grad_sync_microbatches, "grad_sync_microbatches") < 1:
    raise CostTablesError("grad_sync_microbatches must be >= 1")
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
  # Links between consecutive subclusters.
  links = []
  for a, b in zip(ordered, ordered[1:]):
    if isinstance(inter_links, LinkSpec):
      links.append(inter_links)
    elif isinstance(inter_links, Mapping):
      link = inter_links.get((a, b), inter_links.get((b, a)))
      if link is None:
        raise CostTablesError(f"inter_links has no link between {a!r} and {b!r}")
      links.append(link)
    else:
      seq = list(inter_links)
      if len(seq) != len(names) - 1 or ordered != names:
        raise CostTablesError("inter_links as a sequence needs K - 1 links in the given order; "
                              "use a mapping {(a, b): LinkSpec} when reordering")
      links.append(seq[len(links)])
  sums = {f: _range_sums(getattr(layers, f))
          for f in ("param_bytes", "param_mem_bytes", "act_bytes", "tp_comm_bytes")}
  stage_t, param_m, act_m, logical = [], [], [], []
  for s in specs:
    tsum = _range_sums(times[s.name])
    host_bw = s.host_bandwidth_bytes_per_s or s.bandwidth_bytes_per_s
    host_lat = s.host_latency_s if s.host_bandwidth_bytes_per_s else s.latency_s
    S = len(s.submeshes)
    t_k = np.full((L, L, S), np.inf)
    p_k, a_k = np.zeros((L, L, S)), np.zeros((L, L, S))
    lm_k = np.ones((L, L, S, 2), dtype=np.int64)
    for si, (n, m) in enumerate(s.submeshes):
      g = n * m
      best = None  # (fits, key, t, p, a, dp, tp)
      for tp in range(1, m + 1):
        if m % tp or (max_tp is not None and tp > max_tp):
          continue
        dp = g // tp
        t = tsum / g
        if tp > 1:
          t = t + _allreduce_s(sums["tp_comm_bytes"] / dp, tp, host_bw, host_lat)
        if dp > 1:
          bw, lat = (host_bw, host_lat) if n == 1 else (s.bandwidth_bytes_per_s, s.latency_s)
          t = t + _allreduce_s(sums["param_bytes"] / tp, dp, bw, lat) / grad_sync_microbatches
        pm = sums["param_mem_bytes"] / tp
        am = sums["act_bytes"] / dp
        fits = pm + am <= s.memory_bytes
        key = np.where(fits, t, pm + am)
        if best is None:
          best = [fits, key, t, pm, am, np.full((L, L), dp), np.full((L, L), tp)]
          continue
        better = (fits & ~best[0]) | ((fits == best[0]) & (key < best[1]))
        for idx, new in enumerate((fits, key, t, pm, am, dp, tp)):
          best[idx] = np.where(better, new, best[idx])
      iu = np.triu_indices(L)
      t_k[iu[0], iu[1], si] = best[2][iu]
      p_k[iu[0], iu[1], si] = best[3][iu]
      a_k[iu[0], iu[1], si] = best[4][iu]
      lm_k[iu[0], iu[1], si, 0] = best[5][iu]
      lm_k[iu[0], iu[1], si, 1] = best[6][iu]
      lm_k[..., si, 0] = np.where(np.isfinite(t_k[..., si]), lm_k[..., si, 0], g)
      lm_k[..., si, 1] = np.where(np.isfinite(t_k[..., si]), lm_k[..., si, 1], 1)
    stage_t.append(t_k)
    param_m.append(p_k)
    act_m.append(a_k)
    logical.append(lm_k)
  peak = None
  if all(s.peak_flops is not None for s in specs):
    peak = tuple(float(s.peak_flops) for s in specs)
  log.debug("cost tables: %d layers x %d subclusters built from layer costs", L, len(specs))
  return cls(
      num_layers=L, subcluster_names=tuple(ordered),
      num_hosts=tuple(s.num_hosts for s in specs),
      devices_per_host=tuple(s.devices_per_host for s in specs),
      device_memory_bytes=tuple(float(s.memory_bytes) for s in specs),
      submeshes=tuple(s.submeshes for s in specs), stage_time_s=tuple(stage_t),
      param_mem_bytes=tuple(param_m), act_mem_bytes=tuple(act_m),
      boundary_bytes=layers.boundary_bytes,
      intra_bandwidth_bytes_per_s=tuple(float(s.bandwidth_bytes_per_s) for s in specs),
      intra_latency_s=tuple(float(s.latency_s) for s in specs),
      inter_bandwidth_bytes_per_s=tuple(float(l.bandwidth_bytes_per_s) for l in links),
      inter_latency_s=tuple(float(l.latency_s) for l in links),
      logical_mesh=tuple(logical), peak_flops=peak, layer_names=layers.names)


def _range_sums(x: np.ndarray) -> np.ndarray:
  """``[L, L]`` sums ``x[i] + ... + x[j]`` added left to right (``0`` below the diagonal)."""
  L = x.size
  out = np.zeros((L, L))
  for i in range(L):
    out[i, i:] = np.cumsum(x[i:])
  return out


def _allreduce_s(nbytes, p: int, bandwidth: float, latency: float):
  """Ring all-reduce of ``nbytes`` over ``p`` devices: ``2 (p-1)/p * bytes / bw + 2 (p-1) lat``."""
  return 2.0 * (p - 1) / p * nbytes / bandwidth + 2.0 * (p - 1) * latency


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

