"""The layer-profile cost model: cost tables from one profile per layer (FLOPs, parameter,
activation and boundary bytes, a :class:`LayerProfile`) and a simple cluster description
(:class:`SubclusterSpec`), the second source of tables beside the profiler, for tests,
benchmarks and other systems' profiles (:meth:`LayerProfile.cost_tables`, also
:meth:`CostTables.from_layer_costs <harpjax.compiler.profile.CostTables.from_layer_costs>`);
the pipeline order of subclusters by memory-to-compute ratio (HARP §5.2.1); and
:func:`synthetic_gpt_profile`, an analytic GPT's layer profile.

Every collective is priced by :mod:`~harpjax.compiler.profile.collectives` and the tables are
built by :func:`~harpjax.compiler.profile.assemble.assemble_tables`, as the profiler's are.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import numpy as np

from harpjax.cluster import Link, paper_submeshes
from harpjax.compiler.profile.assemble import assemble_tables
from harpjax.compiler.profile.collectives import (allgather_time_s, allreduce_time_s,
                                                  update_time_s)
from harpjax.compiler.profile.routes import replica_link
from harpjax.compiler.profile.tables import (check_int, check_seq, check_submeshes, CostTables,
                                             range_sums)
from harpjax.errors import CostTablesError

__all__ = ["SubclusterSpec", "LayerProfile", "memory_to_compute_order", "synthetic_gpt_profile"]

log = logging.getLogger(__name__)


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
    if check_int(self.num_hosts, f"{where}: num_hosts") < 1 or \
        check_int(self.devices_per_host, f"{where}: devices_per_host") < 1:
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

  def cost_tables(self, subclusters: Sequence["SubclusterSpec"],
                  inter_links: "Link | Sequence[Link] | Mapping" = (), *,
                  layer_time_s: Sequence[Sequence[float]] | None = None,
                  grad_sync_microbatches: int = 1, max_tp: int | None = None,
                  order: str | Sequence[str] | None = None, end_cost: bool = False,
                  optimizer_share: float | None = None) -> CostTables:
    """Builds tables from per-layer costs and a simple cluster description.

    For each range ``i..j``, submesh ``(n, m)`` of ``g = n * m`` devices and logical mesh
    ``(dp, tp)`` (``tp`` divides ``m``, so tensor parallelism stays inside a host):

    * time = ``sum(layer_time) / g`` + all-reduce of ``sum(tp_comm_bytes) / dp`` over ``tp``
      devices on the host link + all-reduce of the gradients ``sum(param_bytes) / tp`` over
      ``dp`` devices (host link if ``n == 1``, else the subcluster link), divided by
      ``grad_sync_microbatches`` (the gradient sync runs once per iteration);
    * parameter memory per device = ``sum(param_mem_bytes) / tp`` (data parallelism
      replicates it); activation memory = ``sum(act_bytes) / dp``.

    The logical mesh is chosen by
    :func:`~harpjax.compiler.profile.assemble.assemble_tables`. Range sums add layers left to
    right, so ranges of identical layers get bit-identical costs (fewer distinct ``t_max``
    candidates).

    Args:
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

    Raises:
      CostTablesError: invalid subclusters, links, layer times, order or shares.

    Returns:
      The :class:`CostTables`.
    """
    specs = list(subclusters)
    if not specs or not all(isinstance(s, SubclusterSpec) for s in specs):
      raise CostTablesError("subclusters must be a non-empty sequence of SubclusterSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
      raise CostTablesError(f"subcluster names {names} repeat")
    if check_int(grad_sync_microbatches, "grad_sync_microbatches") < 1:
      raise CostTablesError("grad_sync_microbatches must be >= 1")
    if optimizer_share is not None and not 0.0 <= float(optimizer_share) < 1.0:
      raise CostTablesError(f"optimizer_share={optimizer_share} must be in [0, 1): the optimizer "
                            "state's share of param_mem_bytes")
    L = self.num_layers
    # Per-layer single-device seconds, keyed by name.
    times: dict[str, np.ndarray] = {}
    if layer_time_s is None:
      for s in specs:
        if s.peak_flops is None:
          raise CostTablesError(f"subcluster {s.name!r}: give peak_flops or layer_time_s")
        times[s.name] = self.flops / (s.peak_flops * s.efficiency)
    else:
      items = (layer_time_s.items() if isinstance(layer_time_s, Mapping)
               else zip(names, check_seq(layer_time_s, "layer_time_s", len(specs))))
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
    sums = {f: range_sums(getattr(self, f))
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
        link = replica_link((n, m), host, node)
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
          end = end + update_time_s(sums["param_mem_bytes"] / tp, s.mem_bandwidth_bytes_per_s)
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
        boundary_bytes=self.boundary_bytes,
        intra_links=[Link(float(s.bandwidth_bytes_per_s), float(s.latency_s)) for s in specs],
        inter_links=links, peak_flops=peak, layer_names=self.names, pair_links=pair,
        price_per_gpu_hour=prices, offload_bandwidth_bytes_per_s=offload,
        host_links=[Link(float(s.host_bandwidth_bytes_per_s or s.bandwidth_bytes_per_s),
                         float(s.host_latency_s if s.host_bandwidth_bytes_per_s else s.latency_s))
                    for s in specs],
        num_microbatches=grad_sync_microbatches if end_cost else None)
    log.debug("cost tables: %d layers x %d subclusters built from layer costs", L, len(specs))
    return tables


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
