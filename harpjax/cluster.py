"""The cluster model: GPU catalog, NICs, hosts, subclusters, links, submeshes and the YAML file.

A :class:`Cluster` is an ordered tuple of homogeneous :class:`SubCluster` s (HARP's
``DeviceMesh_k(N_k, M_k)``: ``N_k`` hosts of ``M_k`` devices) plus optional link overrides.
Devices are numbered globally in cluster order (subcluster, then host, then device);
:attr:`Cluster.device_offsets` are the paper's GPU offsets ``O_k`` (Eq. 13).

Links. Two devices of one host use the host's intra-host bandwidth (NVLink/PCIe). Two hosts use
the fastest NIC pair on a shared ``network`` (bandwidth of the slower NIC, latency of the slower
kind) unless a ``links`` entry overrides the pair of subclusters (``between: [a, b]``;
``[a, a]`` overrides the link between two hosts of ``a``). The hosts of a subcluster and every
two *adjacent* subclusters must be connected: this is checked when a :class:`Cluster` is built
(so :meth:`Cluster.reordered` can raise too); other pairs raise when queried.

Units. Inside: seconds, bytes, bytes/s, FLOP/s. In the catalog and YAML: TFLOP/s, memory in
GiB (``memory_gb``; GPU memory is sized in binary units, a "40 GB" A100 has 40 GiB), memory
bandwidth in GB/s (1e9 bytes/s), link bandwidth in Gbps (1e9 bits/s), latency in microseconds.
See ``docs/cluster.md`` for the file format.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import logging
import math
import operator
import os
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import yaml

from harpjax.errors import ClusterSpecError, NotEnoughDevicesError, PlanError, UnknownGPUError

__all__ = [
    "GPUType", "GPU_CATALOG", "GPU_ALIASES", "lookup_gpu", "NIC", "NIC_LATENCY_S",
    "INTRA_HOST_LATENCY_S", "Link", "LinkOverride", "Host", "SubCluster", "DeviceInfo", "Cluster",
    "load_cluster",
]

logger = logging.getLogger(__name__)

TFLOPS = 1e12        # TFLOP/s -> FLOP/s
GIB = 2**30          # memory_gb (GiB) -> bytes
GBS = 1e9            # GB/s -> bytes/s
GBPS = 1e9 / 8       # Gbps -> bytes/s

NIC_LATENCY_S = {"rdma": 5e-6, "infiniband": 5e-6, "roce": 5e-6, "ethernet": 50e-6}
"""Default one-way latency of a NIC by ``kind`` (RDMA ~5 us, TCP over Ethernet ~50 us)."""

INTRA_HOST_LATENCY_S = 2e-6
"""Latency of a transfer between two devices of one host (NVLink/PCIe)."""


def _clean(x: float) -> int | float:
  """A YAML-unit value rounded to 12 significant digits; an int when integral."""
  v = float(f"{x:.12g}")
  return int(v) if v.is_integer() else v


# ------------------------------------------------------------------------------------ checks


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
  close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(d: Any, where: str, allowed: Sequence[str], required: Sequence[str]) -> None:
  if not isinstance(d, Mapping):
    raise ClusterSpecError(f"{where}: expected a mapping with keys {', '.join(required)}, "
                           f"got {d!r}")
  for k in d:
    if k not in allowed:
      raise ClusterSpecError(f"{where}: unknown key {k!r}{_did_you_mean(str(k), allowed)}; "
                             f"allowed: {', '.join(allowed)}")
  for k in required:
    if k not in d:
      raise ClusterSpecError(f"{where}: missing field {k!r}")


def _or_empty(x: Any) -> Any:
  """An optional list left empty in YAML (``nics:``) reads as None: treat it as ``[]``."""
  return [] if x is None else x


def _check_list(x: Any, where: str) -> list:
  if not isinstance(x, list):
    raise ClusterSpecError(f"{where}: expected a list, got {x!r}")
  return x


def _check_str(x: Any, where: str) -> str:
  if not isinstance(x, str) or not x.strip():
    raise ClusterSpecError(f"{where}: expected a non-empty string, got {x!r}")
  return x


def _string_hint(x: Any) -> str:
  if isinstance(x, str):
    try:
      float(x)
      return " (a string: write the number without quotes, exponents as 1.0e+3)"
    except ValueError:
      pass
  return ""


def _check_pos_int(x: Any, where: str) -> int:
  if isinstance(x, bool) or not isinstance(x, int) or x < 1:
    raise ClusterSpecError(f"{where}: expected a positive integer, got {x!r}{_string_hint(x)}")
  return x


def _check_number(x: Any, where: str, minimum: float) -> float:
  if (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
      or x < minimum):
    raise ClusterSpecError(f"{where}: expected a number >= {minimum:g}, got {x!r}"
                           f"{_string_hint(x)}")
  return x


def _check_pos_number(x: Any, where: str) -> float:
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
    raise ClusterSpecError(f"{where}: expected a positive number, got {x!r}{_string_hint(x)}")
  return x


def _check_kind(x: Any, where: str) -> str:
  if isinstance(x, str) and x.lower() in NIC_LATENCY_S:
    return x.lower()
  raise ClusterSpecError(f"{where}: unknown kind {x!r}{_did_you_mean(str(x), NIC_LATENCY_S)}; "
                         f"known: {', '.join(NIC_LATENCY_S)}")


# ------------------------------------------------------------------------------------ GPUs


@dataclasses.dataclass(frozen=True)
class GPUType:
  """One GPU model.

  Attributes:
    name: catalog name, e.g. ``"A100-40G"``.
    peak_flops: peak dense fp16/bf16 tensor-core FLOP/s (no sparsity).
    memory_bytes: device memory, bytes.
    mem_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
    intra_host_bytes_per_s: default bandwidth between two devices of one host (NVLink or PCIe,
      the spec-sheet figure), bytes/s.
  """
  name: str
  peak_flops: float
  memory_bytes: int
  mem_bandwidth_bytes_per_s: float
  intra_host_bytes_per_s: float

  def __post_init__(self):
    where = f"GPUType {self.name!r}"
    _check_str(self.name, f"{where}.name")
    for f in ("peak_flops", "memory_bytes", "mem_bandwidth_bytes_per_s", "intra_host_bytes_per_s"):
      _check_pos_number(getattr(self, f), f"{where}.{f}")
    object.__setattr__(self, "memory_bytes", int(round(self.memory_bytes)))

  @classmethod
  def from_units(cls, name: str, tflops: float, memory_gb: float, mem_bandwidth_gbs: float,
                 intra_host_gbps: float) -> "GPUType":
    """Builds a GPU type from catalog units (TFLOP/s, GiB, GB/s, Gbps)."""
    return cls(name, tflops * TFLOPS, memory_gb * GIB, mem_bandwidth_gbs * GBS,
               intra_host_gbps * GBPS)

  @property
  def memory_to_compute(self) -> float:
    """Bytes of device memory per FLOP/s of peak compute (the ordering key of HARP §5.2.1)."""
    return self.memory_bytes / self.peak_flops

  def to_dict(self) -> dict:
    return {"name": self.name, "tflops": _clean(self.peak_flops / TFLOPS),
            "memory_gb": _clean(self.memory_bytes / GIB),
            "mem_bandwidth_gbs": _clean(self.mem_bandwidth_bytes_per_s / GBS),
            "intra_host_gbps": _clean(self.intra_host_bytes_per_s / GBPS)}


def _catalog_entry(name, tflops, memory_gib, mem_gbs, intra_host_gbs) -> GPUType:
  return GPUType(name, tflops * TFLOPS, memory_gib * GIB, mem_gbs * GBS, intra_host_gbs * GBS)


# name, dense fp16/bf16 tensor TFLOP/s, memory GiB, memory GB/s, intra-host GB/s (spec sheet:
# NVLink total for SXM parts, PCIe Gen4 x16 = 64 GB/s, Gen3 x16 = 32 GB/s for PCIe parts).
GPU_CATALOG: dict[str, GPUType] = {g.name: g for g in (
    _catalog_entry("A100-40G", 312, 40, 1555, 600),     # SXM4, NVLink 3
    _catalog_entry("A100-80G", 312, 80, 2039, 600),     # SXM4, NVLink 3
    _catalog_entry("V100-16G", 125, 16, 900, 300),      # SXM2, NVLink 2
    _catalog_entry("V100-32G", 125, 32, 900, 300),      # SXM2, NVLink 2
    _catalog_entry("H100-80G", 989, 80, 3350, 900),     # SXM5, NVLink 4
    _catalog_entry("H200", 989, 141, 4800, 900),        # SXM, NVLink 4
    _catalog_entry("L40S", 362, 48, 864, 64),           # PCIe Gen4
    _catalog_entry("A10G", 70, 24, 600, 64),            # PCIe Gen4 (AWS g5)
    _catalog_entry("T4", 65, 16, 320, 32),              # PCIe Gen3
    _catalog_entry("RTX-4090", 165.2, 24, 1008, 64),    # PCIe Gen4, fp16 accumulate
)}
"""Built-in GPU types by name; names are matched case-insensitively."""

GPU_ALIASES: dict[str, str] = {"A100": "A100-40G", "V100": "V100-32G", "H100": "H100-80G",
                               "RTX4090": "RTX-4090", "RTX 4090": "RTX-4090"}
"""Short names accepted for catalog GPUs (case-insensitive)."""


def lookup_gpu(name: str, extra: Iterable[GPUType] = (), where: str = "gpu") -> GPUType:
  """Finds a GPU type by name.

  Args:
    name: a name, matched case-insensitively against ``extra``, then :data:`GPU_CATALOG`,
      then :data:`GPU_ALIASES`.
    extra: user-declared GPU types; they take precedence over the catalog.
    where: field path used in the error message.

  Returns:
    The GPU type.

  Raises:
    UnknownGPUError: no GPU of that name.
  """
  extra = tuple(extra)
  if isinstance(name, str):
    key = name.strip().lower()
    for table in ({g.name.lower(): g for g in extra},
                  {n.lower(): g for n, g in GPU_CATALOG.items()},
                  {a.lower(): GPU_CATALOG[n] for a, n in GPU_ALIASES.items()}):
      if key in table:
        return table[key]
  known = [g.name for g in extra] + [n for n in GPU_CATALOG if n not in {g.name for g in extra}]
  hint = _did_you_mean(str(name), known + list(GPU_ALIASES))
  aliases = ", ".join(f"{a} -> {n}" for a, n in GPU_ALIASES.items())
  raise UnknownGPUError(
      f"{where}: unknown GPU {name!r}{hint}; known: {', '.join(known)} (aliases: {aliases}); "
      "declare other GPUs under 'gpus:' with name, tflops, memory_gb, mem_bandwidth_gbs")


# ------------------------------------------------------------------------------------ links


@dataclasses.dataclass(frozen=True)
class NIC:
  """A network interface of every host of a subcluster.

  Attributes:
    name: interface name, e.g. ``"ib0"``; unique within its subcluster.
    kind: ``"rdma"``, ``"infiniband"``, ``"roce"`` or ``"ethernet"`` (sets the default latency,
      :data:`NIC_LATENCY_S`, and tells the transport what to use).
    gbps: bandwidth, Gbit/s.
    network: NICs on the same network can talk to each other.
    latency_s: one-way latency, seconds; ``None`` means the default of ``kind``.
  """
  name: str
  kind: str
  gbps: float
  network: str
  latency_s: float | None = None

  def __post_init__(self):
    where = f"NIC {self.name!r}"
    _check_str(self.name, f"{where}.name")
    _check_str(self.network, f"{where}.network")
    object.__setattr__(self, "kind", _check_kind(self.kind, f"{where}.kind"))
    _check_pos_number(self.gbps, f"{where}.gbps")
    if self.latency_s is None:
      object.__setattr__(self, "latency_s", NIC_LATENCY_S[self.kind])
    _check_number(self.latency_s, f"{where}.latency_s", minimum=0.0)

  @property
  def bandwidth_bytes_per_s(self) -> float:
    return self.gbps * GBPS

  def to_dict(self) -> dict:
    d = {"name": self.name, "kind": self.kind, "gbps": _clean(self.gbps), "network": self.network}
    if self.latency_s != NIC_LATENCY_S[self.kind]:
      d["latency_us"] = _clean(self.latency_s * 1e6)
    return d


@dataclasses.dataclass(frozen=True)
class Link:
  """A point-to-point link as seen by one transfer.

  Attributes:
    bandwidth_bytes_per_s: bytes/s (``inf`` for a device to itself).
    latency_s: seconds.
    src_nic: the sender's NIC (``None`` inside a host or when no NIC pair exists).
    dst_nic: the receiver's NIC.
    kind: ``"intra_host"``, ``"local"`` (same device) or a NIC kind (``"rdma"``...).
    overridden: whether bandwidth and latency come from a ``links`` entry.
  """
  bandwidth_bytes_per_s: float
  latency_s: float
  src_nic: NIC | None = None
  dst_nic: NIC | None = None
  kind: str = "intra_host"
  overridden: bool = False

  def transfer_time_s(self, nbytes: float) -> float:
    """Seconds to send ``nbytes``: ``latency_s + nbytes / bandwidth_bytes_per_s``."""
    return self.latency_s + nbytes / self.bandwidth_bytes_per_s

  @property
  def gbps(self) -> float:
    return self.bandwidth_bytes_per_s / GBPS


@dataclasses.dataclass(frozen=True)
class LinkOverride:
  """A ``links`` entry: the link between hosts of two subclusters (or of one, ``[a, a]``).

  Attributes:
    between: the two subcluster names (unordered).
    gbps: bandwidth, Gbit/s.
    latency_s: seconds; ``None``: the default of ``kind`` if given, else the latency of the NIC
      pair the link would otherwise use, else the Ethernet default.
    kind: link kind reported by :class:`Link`; ``None``: that of the NIC pair, else Ethernet.
  """
  between: tuple[str, str]
  gbps: float
  latency_s: float | None = None
  kind: str | None = None

  def __post_init__(self):
    between = tuple(self.between) if isinstance(self.between, (list, tuple)) else ()
    if len(between) != 2 or not all(isinstance(x, str) and x for x in between):
      raise ClusterSpecError(f"LinkOverride.between={self.between!r}: expected two subcluster "
                             "names")
    object.__setattr__(self, "between", between)
    _check_pos_number(self.gbps, f"link {list(between)}.gbps")
    if self.latency_s is not None:
      _check_number(self.latency_s, f"link {list(between)}.latency_s", minimum=0.0)
    if self.kind is not None:
      object.__setattr__(self, "kind", _check_kind(self.kind, f"link {list(between)}.kind"))

  @property
  def bandwidth_bytes_per_s(self) -> float:
    return self.gbps * GBPS

  def to_dict(self) -> dict:
    d: dict[str, Any] = {"between": list(self.between), "gbps": _clean(self.gbps)}
    if self.latency_s is not None:
      d["latency_us"] = _clean(self.latency_s * 1e6)
    if self.kind is not None:
      d["kind"] = self.kind
    return d


def _nic_pair_link(src: Sequence[NIC], dst: Sequence[NIC]) -> Link | None:
  """The fastest NIC pair on a shared network (ties: lower latency, then NIC order)."""
  best = None
  for a in src:
    for b in dst:
      if a.network != b.network:
        continue
      bw = min(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s)
      lat = max(a.latency_s, b.latency_s)
      if best is None or (-bw, lat) < (-best.bandwidth_bytes_per_s, best.latency_s):
        best = Link(bw, lat, a, b, a.kind if a.latency_s >= b.latency_s else b.kind)
  return best


# ------------------------------------------------------------------------------------ hosts


@dataclasses.dataclass(frozen=True)
class Host:
  """One machine of a subcluster (derived; see :attr:`SubCluster.hosts`).

  Attributes:
    name: ``"<subcluster>-<index>"``, e.g. ``"a100-0"``.
    subcluster: name of its subcluster.
    index: host index inside the subcluster.
    gpu: its GPU type.
    num_devices: devices on the host (``M`` of the subcluster).
    nics: its NICs.
    intra_host_bytes_per_s: bandwidth between two of its devices, bytes/s.
  """
  name: str
  subcluster: str
  index: int
  gpu: GPUType
  num_devices: int
  nics: tuple[NIC, ...]
  intra_host_bytes_per_s: float

  @property
  def intra_host_link(self) -> Link:
    return Link(self.intra_host_bytes_per_s, INTRA_HOST_LATENCY_S, kind="intra_host")


@dataclasses.dataclass(frozen=True)
class SubCluster:
  """``N`` identical hosts of ``M`` devices of one GPU type: HARP's ``DeviceMesh_k(N, M)``.

  Attributes:
    name: unique name in the cluster, e.g. ``"a100"``.
    gpu: the GPU type (a catalog name is resolved with :func:`lookup_gpu`).
    num_hosts: ``N``.
    devices_per_host: ``M``.
    nics: NICs of every host.
    intra_host_bytes_per_s: bandwidth between devices of one host, bytes/s; ``None`` means the
      GPU type's default.
    hosts: the ``N`` hosts (derived).
  """
  name: str
  gpu: GPUType
  num_hosts: int
  devices_per_host: int
  nics: tuple[NIC, ...] = ()
  intra_host_bytes_per_s: float | None = None
  hosts: tuple[Host, ...] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    where = f"SubCluster {self.name!r}"
    _check_str(self.name, f"{where}.name")
    if not isinstance(self.gpu, GPUType):
      object.__setattr__(self, "gpu", lookup_gpu(self.gpu, where=f"{where}.gpu"))
    _check_pos_int(self.num_hosts, f"{where}.num_hosts")
    _check_pos_int(self.devices_per_host, f"{where}.devices_per_host")
    nics = tuple(self.nics)
    for i, nic in enumerate(nics):
      if not isinstance(nic, NIC):
        raise ClusterSpecError(f"{where}.nics[{i}]: expected a NIC, got {nic!r}")
      if nic.name in [n.name for n in nics[:i]]:
        raise ClusterSpecError(f"{where}.nics[{i}].name: duplicate NIC name {nic.name!r}")
    object.__setattr__(self, "nics", nics)
    if self.intra_host_bytes_per_s is None:
      object.__setattr__(self, "intra_host_bytes_per_s", self.gpu.intra_host_bytes_per_s)
    _check_pos_number(self.intra_host_bytes_per_s, f"{where}.intra_host_bytes_per_s")
    object.__setattr__(self, "hosts", tuple(
        Host(f"{self.name}-{h}", self.name, h, self.gpu, self.devices_per_host, nics,
             self.intra_host_bytes_per_s) for h in range(self.num_hosts)))

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host

  @property
  def shape(self) -> tuple[int, int]:
    """``(N, M)``."""
    return (self.num_hosts, self.devices_per_host)

  @property
  def peak_flops(self) -> float:
    """Peak FLOP/s of one device."""
    return self.gpu.peak_flops

  @property
  def total_peak_flops(self) -> float:
    """Peak FLOP/s of all ``N * M`` devices."""
    return self.gpu.peak_flops * self.num_devices

  @property
  def memory_bytes(self) -> int:
    """Memory of one device, bytes."""
    return self.gpu.memory_bytes

  def submesh_shapes(self, all_sizes: bool = False) -> list[tuple[int, int]]:
    """Submesh shapes ``(n, m)`` a stage may use on this subcluster (HARP §5.1).

    By default the single-host widths are the powers of two ``1, 2, 4, ...`` below ``M`` as long
    as they divide ``M``, then ``M``: a divisibility chain, so that any mix of submeshes whose
    sizes add up to at most ``N * M`` packs onto the hosts, which the planner relies on when it
    counts devices. For ``M`` a power of two this is ``1, 2, 4, ..., M``; for ``M = 6`` it is
    ``1, 2, 6`` (three ``(1, 4)`` would not pack on two hosts of 6). The same rule as
    ``harpjax.compiler.cost_tables.paper_submeshes``.

    Args:
      all_sizes: if True, ``m`` runs over every width ``1..M`` (what
        :meth:`Cluster.allocate_submeshes` accepts).

    Returns:
      ``[(1, 1), (1, 2), (1, 4), ..., (1, M), (2, M), ..., (N, M)]``.
    """
    m_max = self.devices_per_host
    if all_sizes:
      ms = list(range(1, m_max + 1))
    else:
      ms, w = [], 1
      while w < m_max and m_max % w == 0:
        ms.append(w)
        w *= 2
      ms.append(m_max)
    return [(1, m) for m in ms] + [(n, m_max) for n in range(2, self.num_hosts + 1)]

  def to_dict(self) -> dict:
    d: dict[str, Any] = {"name": self.name, "gpu": self.gpu.name, "hosts": self.num_hosts,
                         "devices_per_host": self.devices_per_host}
    if self.intra_host_bytes_per_s != self.gpu.intra_host_bytes_per_s:
      d["intra_host_gbps"] = _clean(self.intra_host_bytes_per_s / GBPS)
    if self.nics:
      d["nics"] = [n.to_dict() for n in self.nics]
    return d


class DeviceInfo(NamedTuple):
  """Where a global device index lives."""
  subcluster: str
  host: int
  local: int


# ------------------------------------------------------------------------------------ cluster


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Ordered subclusters, link overrides and user-declared GPU types.

  Attributes:
    subclusters: in pipeline order (forward pass runs through them first to last).
    links: link overrides.
    gpus: user-declared GPU types (those used by subclusters but missing from the catalog are
      added automatically, so that the cluster saves and loads back).
    name: optional label.
  """
  subclusters: tuple[SubCluster, ...]
  links: tuple[LinkOverride, ...] = ()
  gpus: tuple[GPUType, ...] = ()
  name: str | None = None
  _by_name: dict = dataclasses.field(init=False, repr=False, compare=False)
  _offsets: tuple = dataclasses.field(init=False, repr=False, compare=False)
  _hosts: dict = dataclasses.field(init=False, repr=False, compare=False)
  _overrides: dict = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    subs = tuple(self.subclusters)
    if not subs or not all(isinstance(s, SubCluster) for s in subs):
      raise ClusterSpecError(f"Cluster.subclusters: expected a non-empty sequence of SubCluster, "
                             f"got {self.subclusters!r}")
    object.__setattr__(self, "subclusters", subs)
    by_name: dict[str, SubCluster] = {}
    for i, s in enumerate(subs):
      if s.name in by_name:
        raise ClusterSpecError(f"subclusters[{i}].name: duplicate subcluster name {s.name!r}")
      by_name[s.name] = s
    object.__setattr__(self, "_by_name", by_name)
    gpus = list(self.gpus)
    for i, g in enumerate(gpus):
      if not isinstance(g, GPUType):
        raise ClusterSpecError(f"Cluster.gpus[{i}]: expected a GPUType, got {g!r}")
    declared = {g.name.lower(): g for g in gpus}
    for s in subs:
      known = declared.get(s.gpu.name.lower(), GPU_CATALOG.get(s.gpu.name))
      if known is None:
        gpus.append(s.gpu)
        declared[s.gpu.name.lower()] = s.gpu
      elif known != s.gpu:
        raise ClusterSpecError(f"subcluster {s.name!r}: GPU type {s.gpu.name!r} differs from the "
                               f"GPU of that name declared or in the catalog; rename one of them")
    object.__setattr__(self, "gpus", tuple(gpus))
    overrides: dict[frozenset, LinkOverride] = {}
    for i, ov in enumerate(self.links):
      if not isinstance(ov, LinkOverride):
        raise ClusterSpecError(f"Cluster.links[{i}]: expected a LinkOverride, got {ov!r}")
      for x in ov.between:
        if x not in by_name:
          raise ClusterSpecError(f"links[{i}].between: unknown subcluster {x!r} "
                                 f"(known: {', '.join(by_name)})")
      key = frozenset(ov.between)
      if key in overrides:
        raise ClusterSpecError(f"links[{i}].between: a second override for {list(ov.between)}")
      overrides[key] = ov
    object.__setattr__(self, "links", tuple(self.links))
    object.__setattr__(self, "_overrides", overrides)
    offsets, hosts = [0], {}
    for s in subs:
      for h in s.hosts:
        hosts[h.name] = h
      offsets.append(offsets[-1] + s.num_devices)
    object.__setattr__(self, "_offsets", tuple(offsets))
    object.__setattr__(self, "_hosts", hosts)
    for s in subs:  # connectivity: hosts of a subcluster, then adjacent subclusters
      if s.num_hosts > 1:
        self._pair_link(s.name, s.name)
    for a, b in zip(subs, subs[1:]):
      self._pair_link(a.name, b.name)

  # ------------------------------------------------------------------ construction

  @classmethod
  def simple(cls, spec: Sequence[tuple[str, str | GPUType, int, int]], *,
             inter_gbps: float = 5.0, intra_gbps: float = 200.0,
             name: str | None = None) -> "Cluster":
    """A cluster with one RDMA fabric per subcluster and one Ethernet network between them.

    Args:
      spec: ``(name, gpu, hosts, devices_per_host)`` per subcluster, in order.
      inter_gbps: Ethernet bandwidth between subclusters (network ``"dc"``), Gbit/s.
      intra_gbps: RDMA bandwidth between hosts of a subcluster (network ``"<name>-fabric"``).
      name: optional cluster label.

    Returns:
      The cluster, e.g. ``Cluster.simple([("a100", "A100-40G", 2, 4), ("v100", "V100", 1, 8)])``.
    """
    subs = []
    for sname, gpu, hosts, per_host in spec:
      subs.append(SubCluster(sname, gpu, hosts, per_host, nics=(
          NIC("ib0", "rdma", intra_gbps, f"{sname}-fabric"),
          NIC("eth0", "ethernet", inter_gbps, "dc"))))
    return cls(tuple(subs), name=name)

  @classmethod
  def from_dict(cls, data: Any, source: str | None = None) -> "Cluster":
    """Builds a cluster from the parsed YAML structure (see ``docs/cluster.md``).

    Args:
      data: a mapping with ``subclusters`` and optional ``links``, ``gpus``, ``name``.
      source: file name prefixed to error messages.

    Raises:
      ClusterSpecError: a field is missing, unknown, of the wrong type or inconsistent; the
        message names the field path, e.g. ``subclusters[0].hosts``.
      UnknownGPUError: a GPU name is neither declared nor in the catalog.
    """
    try:
      return _cluster_from_dict(data)
    except ClusterSpecError as e:
      if source is None:
        raise
      raise type(e)(f"{source}: {e}") from None

  @classmethod
  def from_yaml(cls, path_or_text: str | os.PathLike) -> "Cluster":
    """Reads a cluster from a YAML file path or from YAML text.

    A ``PathLike``, or a one-line string that ends in ``.yaml``/``.yml`` or names an existing
    file, is read as a path; anything else is parsed as YAML text.

    Raises:
      ClusterSpecError: unreadable file, YAML syntax error (with line and column) or a malformed
        cluster (with the field path).
    """
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text
        and (path_or_text.strip().endswith((".yaml", ".yml")) or os.path.isfile(path_or_text))):
      return load_cluster(path_or_text)
    if not isinstance(path_or_text, str):
      raise ClusterSpecError(f"expected a path or YAML text, got {type(path_or_text).__name__}")
    data = _parse_yaml(path_or_text, "<cluster yaml>")
    if isinstance(data, str) and "\n" not in path_or_text:
      raise ClusterSpecError(f"{path_or_text!r} is neither an existing cluster file nor YAML text "
                             "with a 'subclusters' list")
    return cls.from_dict(data, "<cluster yaml>")

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Cluster":
    """Reads a cluster file; see :meth:`from_yaml`."""
    return load_cluster(path)

  def to_dict(self) -> dict:
    """The YAML structure; only non-default values are written, GPUs by catalog name."""
    d: dict[str, Any] = {}
    if self.name is not None:
      d["name"] = self.name
    if self.gpus:
      d["gpus"] = [g.to_dict() for g in self.gpus]
    d["subclusters"] = [s.to_dict() for s in self.subclusters]
    if self.links:
      d["links"] = [ov.to_dict() for ov in self.links]
    return d

  def to_yaml(self) -> str:
    """The cluster as YAML text; ``Cluster.from_yaml(c.to_yaml()) == c``."""
    d = self.to_dict()
    for key in ("gpus", "links"):
      if key in d:
        d[key] = [_FlowDict(x) for x in d[key]]
    for sub in d["subclusters"]:
      if "nics" in sub:
        sub["nics"] = [_FlowDict(x) for x in sub["nics"]]
    return yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      f.write(self.to_yaml())

  # ------------------------------------------------------------------ subclusters and order

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.subclusters)

  def subcluster(self, name: str) -> SubCluster:
    """The subcluster called ``name``; raises :class:`ClusterSpecError` if there is none."""
    try:
      return self._by_name[name]
    except (KeyError, TypeError):
      raise ClusterSpecError(f"unknown subcluster {name!r}{_did_you_mean(str(name), self.names)} "
                             f"(known: {', '.join(self.names)})") from None

  def index_of(self, name: str) -> int:
    """Position ``k`` of a subcluster in the cluster order."""
    return self.names.index(self.subcluster(name).name)

  def reordered(self, names: Sequence[str]) -> "Cluster":
    """The same cluster with its subclusters in the order ``names`` (each name exactly once)."""
    names = list(names)
    if sorted(names) != sorted(self.names):
      raise ClusterSpecError(f"reordered({names}): give each of {', '.join(self.names)} exactly "
                             "once")
    return dataclasses.replace(self, subclusters=tuple(self._by_name[n] for n in names))

  def ordered_by_memory_to_compute(self) -> "Cluster":
    """The subclusters sorted by device memory / peak FLOP/s, highest first (HARP §5.2.1).

    Earlier 1F1B stages hold more in-flight activations, so memory-rich subclusters go first.
    The sort is stable; the result must still be connected between adjacent subclusters.
    """
    order = sorted(self.subclusters, key=lambda s: -s.gpu.memory_to_compute)
    logger.debug("subcluster order by memory-to-compute: %s", [s.name for s in order])
    return self.reordered([s.name for s in order])

  # ------------------------------------------------------------------ devices

  @property
  def num_devices(self) -> int:
    return self._offsets[-1]

  @property
  def device_offsets(self) -> tuple[int, ...]:
    """``(O_0, ..., O_K)`` with ``O_0 = 0`` and ``O_k = sum_{j<=k} N_j * M_j`` (Eq. 13)."""
    return self._offsets

  @property
  def total_peak_flops(self) -> float:
    return sum(s.total_peak_flops for s in self.subclusters)

  @property
  def hosts(self) -> tuple[Host, ...]:
    """All hosts in cluster order."""
    return tuple(self._hosts.values())

  def host(self, name: str) -> Host:
    try:
      return self._hosts[name]
    except (KeyError, TypeError):
      raise ClusterSpecError(f"unknown host {name!r}{_did_you_mean(str(name), self._hosts)}; "
                             f"hosts are named <subcluster>-<index>, e.g. "
                             f"{self.hosts[0].name!r}") from None

  def devices_of(self, name: str) -> range:
    """Global device indices of a subcluster."""
    k = self.index_of(name)
    return range(self._offsets[k], self._offsets[k + 1])

  def devices_of_host(self, host: Host | str) -> range:
    """Global device indices of a host."""
    h = host if isinstance(host, Host) else self.host(host)
    start = self._offsets[self.index_of(h.subcluster)] + h.index * h.num_devices
    return range(start, start + h.num_devices)

  def device_info(self, i: int) -> DeviceInfo:
    """``(subcluster name, host index, local index)`` of global device ``i``."""
    try:
      i = operator.index(i)
    except TypeError:
      i = None
    if i is None or not 0 <= i < self.num_devices:
      raise PlanError(f"device index {i!r} out of range: the cluster has {self.num_devices} "
                      f"devices (0..{self.num_devices - 1})")
    k = bisect.bisect_right(self._offsets, i) - 1
    s = self.subclusters[k]
    host, local = divmod(i - self._offsets[k], s.devices_per_host)
    return DeviceInfo(s.name, host, local)

  def host_of_device(self, i: int) -> Host:
    info = self.device_info(i)
    return self._by_name[info.subcluster].hosts[info.host]

  def peak_flops_of_device(self, i: int) -> float:
    return self._by_name[self.device_info(i).subcluster].peak_flops

  def local_devices(self, jax_devices: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Maps the cluster's devices, in global order, onto local JAX devices.

    Args:
      jax_devices: devices to use; ``jax.devices()`` if None.

    Returns:
      ``[num_devices]`` JAX devices; entry ``i`` stands for global device ``i``.

    Raises:
      NotEnoughDevicesError: fewer local devices than cluster devices.
    """
    if jax_devices is None:
      import jax  # lazily: planning from files must not need JAX
      jax_devices = jax.devices()
    devices = list(jax_devices)
    need = self.num_devices
    if len(devices) < need:
      parts = ", ".join(f"{s.name}: {s.num_hosts}x{s.devices_per_host}" for s in self.subclusters)
      raise NotEnoughDevicesError(
          f"the cluster needs {need} devices ({parts}) but only {len(devices)} local JAX devices "
          f"are available; for fake CPU devices set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX is imported")
    if len(devices) > need:
      logger.info("cluster uses %d of %d local devices", need, len(devices))
    return tuple(devices[:need])

  # ------------------------------------------------------------------ links

  def link_between_hosts(self, host_a: Host | str, host_b: Host | str) -> Link:
    """The link from ``host_a`` to ``host_b`` (intra-host if they are the same host).

    Raises:
      ClusterSpecError: the hosts share no network and no override covers their subclusters.
    """
    a = host_a if isinstance(host_a, Host) else self.host(host_a)
    b = host_b if isinstance(host_b, Host) else self.host(host_b)
    if a.name == b.name:
      return a.intra_host_link
    return self._pair_link(a.subcluster, b.subcluster)

  def inter_subcluster_link(self, name_a: str, name_b: str) -> Link:
    """The link from a host of ``name_a`` to a host of ``name_b``.

    For ``name_a == name_b`` this is :meth:`intra_subcluster_link`.
    """
    if name_a == name_b:
      return self.intra_subcluster_link(name_a)
    return self._pair_link(self.subcluster(name_a).name, self.subcluster(name_b).name)

  def intra_subcluster_link(self, name: str) -> Link:
    """The link between two distinct hosts of a subcluster; intra-host if it has one host."""
    s = self.subcluster(name)
    if s.num_hosts == 1:
      return s.hosts[0].intra_host_link
    return self._pair_link(name, name)

  def link_between_devices(self, i: int, j: int) -> Link:
    """The link from global device ``i`` to ``j``; a free ``"local"`` link when ``i == j``."""
    if i == j:
      self.device_info(i)
      return Link(math.inf, 0.0, kind="local")
    return self.link_between_hosts(self.host_of_device(i), self.host_of_device(j))

  def _pair_link(self, a: str, b: str) -> Link:
    sa, sb = self._by_name[a], self._by_name[b]
    base = _nic_pair_link(sa.nics, sb.nics)
    ov = self._overrides.get(frozenset((a, b)))
    if ov is not None:
      kind = ov.kind or (base.kind if base else "ethernet")
      if ov.latency_s is not None:
        latency = ov.latency_s
      elif ov.kind is None and base is not None:
        latency = base.latency_s
      else:
        latency = NIC_LATENCY_S[kind]
      return Link(ov.bandwidth_bytes_per_s, latency, base and base.src_nic, base and base.dst_nic,
                  kind, overridden=True)
    if base is None:
      nics = lambda s: ", ".join(f"{n.name}@{n.network}" for n in s.nics) or "none"
      what = (f"the hosts of subcluster {a!r} share no network (NICs: {nics(sa)})" if a == b else
              f"subclusters {a!r} and {b!r} share no network ({a} NICs: {nics(sa)}; "
              f"{b} NICs: {nics(sb)})")
      raise ClusterSpecError(f"{what}; give them NICs on a common network or add a links entry "
                             f"{{between: [{a}, {b}], gbps: ...}}")
    return base

  # ------------------------------------------------------------------ submesh allocation

  def allocate_submeshes(
      self, requests: Sequence[tuple[str, tuple[int, int]]]) -> list[tuple[int, ...]]:
    """Assigns concrete, non-overlapping global devices to pipeline-stage submeshes.

    A ``(1, m)`` submesh with ``m < M`` takes ``m`` devices of one host; an ``(n, M)`` submesh
    takes ``n`` whole hosts. Larger requests are packed first (first-fit decreasing, which
    keeps partly used hosts full), with an exact search as fallback; hosts are then handed out
    in pipeline order so that devices ascend with the stages where possible.

    Args:
      requests: ``(subcluster name, (n, m))`` per stage, in pipeline order.

    Returns:
      per stage, its ``n * m`` global device indices (host-major).

    Raises:
      PlanError: unknown subcluster, shape not in ``submesh_shapes(all_sizes=True)``, or the
        submeshes do not fit; the message names the stage and what is left.
    """
    parsed: list[tuple[str, tuple[int, int]]] = []
    for i, req in enumerate(requests):
      try:
        name, (n, m) = req
        n, m = int(n), int(m)
      except (TypeError, ValueError):
        raise PlanError(f"stage {i}: expected (subcluster name, (n, m)), got {req!r}") from None
      if name not in self._by_name:
        raise PlanError(f"stage {i}: unknown subcluster {name!r} (known: {', '.join(self.names)})")
      s = self._by_name[name]
      if (n, m) not in s.submesh_shapes(all_sizes=True):
        raise PlanError(f"stage {i}: submesh ({n}, {m}) is not a submesh of subcluster {name!r} "
                        f"({s.num_hosts} hosts x {s.devices_per_host} devices); use (1, m) with "
                        f"m <= {s.devices_per_host} or (n, {s.devices_per_host}) with "
                        f"n <= {s.num_hosts}")
      parsed.append((name, (n, m)))
    out: list[tuple[int, ...]] = [()] * len(parsed)
    for k, s in enumerate(self.subclusters):
      mine = [(i, shape) for i, (name, shape) in enumerate(parsed) if name == s.name]
      if mine:
        for i, devs in _allocate_in_subcluster(s, mine).items():
          out[i] = tuple(self._offsets[k] + d for d in devs)
    return out

  def summary(self) -> str:
    """A short human-readable description: subclusters, devices and links."""
    lines = []
    for k, s in enumerate(self.subclusters):
      inner = self.intra_subcluster_link(s.name)
      lines.append(f"{s.name}: {s.num_hosts}x{s.devices_per_host} {s.gpu.name} "
                   f"(devices {self._offsets[k]}..{self._offsets[k + 1] - 1}, "
                   f"{s.peak_flops / TFLOPS:g} TFLOP/s, {s.memory_bytes / GIB:g} GiB each; "
                   f"intra-host {s.intra_host_bytes_per_s / GBPS:g} Gbps"
                   + (f", between hosts {inner.gbps:g} Gbps {inner.kind})" if s.num_hosts > 1
                      else ")"))
    for a, b in zip(self.subclusters, self.subclusters[1:]):
      link = self._pair_link(a.name, b.name)
      lines.append(f"{a.name} -> {b.name}: {link.gbps:g} Gbps {link.kind}, "
                   f"{link.latency_s * 1e6:g} us{' (override)' if link.overridden else ''}")
    return "\n".join(lines)


def load_cluster(path: str | os.PathLike) -> Cluster:
  """Reads a cluster YAML file.

  Raises:
    ClusterSpecError: missing file, YAML syntax error or malformed cluster; messages start with
      the file name.
  """
  fname = os.fspath(path)
  try:
    with open(fname) as f:
      text = f.read()
  except FileNotFoundError:
    raise ClusterSpecError(f"cluster file {fname!r} does not exist") from None
  except OSError as e:
    raise ClusterSpecError(f"cannot read cluster file {fname!r}: {e.strerror}") from None
  cluster = Cluster.from_dict(_parse_yaml(text, fname), fname)
  logger.debug("loaded cluster %s: %d subclusters, %d devices", fname, len(cluster.subclusters),
               cluster.num_devices)
  return cluster


# ------------------------------------------------------------------------------------ allocation


def _allocate_in_subcluster(s: SubCluster,
                            reqs: list[tuple[int, tuple[int, int]]]) -> dict[int, list[int]]:
  """Stage index -> device indices local to ``s`` for the requests on ``s``."""
  n_hosts, per_host = s.num_hosts, s.devices_per_host
  used = 0
  for i, (n, m) in reqs:
    used += n * m
    if used > s.num_devices:
      left = s.num_devices - used + n * m
      raise PlanError(f"stage {i}: submesh ({n}, {m}) does not fit on subcluster {s.name!r}: the "
                      f"stages before it already take {used - n * m} of its {s.num_devices} "
                      f"devices ({n_hosts} hosts x {per_host}), {left} left")
  whole = [(i, n) for i, (n, m) in reqs if m == per_host]
  part = [(i, m) for i, (n, m) in reqs if m < per_host]
  taken = sum(n for _, n in whole)  # <= n_hosts: the device count was checked above
  free_hosts = n_hosts - taken
  order = sorted(part, key=lambda r: (-r[1], r[0]))
  bins = _pack(order, free_hosts, per_host)
  if bins is None:
    free = [per_host] * free_hosts
    for i, m in order:  # replay first-fit decreasing to name the stage that does not fit
      fit = next((b for b, f in enumerate(free) if f >= m), None)
      if fit is None:
        raise PlanError(
            f"stage {i}: submesh (1, {m}) does not fit on subcluster {s.name!r} "
            f"({n_hosts} hosts x {per_host}): {taken} hosts go to whole-host stages and, with "
            f"the larger stages placed first, the other hosts have {free} devices free; "
            f"single-host submeshes cannot span hosts")
      free[fit] -= m
    raise PlanError(f"no packing of the stages on subcluster {s.name!r} was found within the "
                    "search limit; use fewer or larger single-host submeshes")
  units = [(i, "whole", n) for i, n in whole]
  units += [(min(i for i, _ in b), "bin", sorted(b)) for b in bins if b]
  out: dict[int, list[int]] = {}
  host = 0
  for first, kind, what in sorted(units, key=lambda u: u[0]):
    if kind == "whole":
      out[first] = list(range(host * per_host, (host + what) * per_host))
      host += what
    else:
      slot = 0
      for i, m in what:
        out[i] = list(range(host * per_host + slot, host * per_host + slot + m))
        slot += m
      host += 1
  return out


def _pack(items: list[tuple[int, int]], num_bins: int, capacity: int,
          max_nodes: int = 200_000) -> list[list[tuple[int, int]]] | None:
  """Packs ``(stage, size)`` items (sorted large first) into bins; None if impossible.

  Depth-first search whose first branch is first-fit decreasing (optimal for power-of-two
  sizes); bins with equal free space are tried once.
  """
  free = [capacity] * num_bins
  assign = [0] * len(items)
  nodes = 0

  def search(k: int) -> bool:
    nonlocal nodes
    if k == len(items):
      return True
    nodes += 1
    if nodes > max_nodes:
      return False
    size, tried = items[k][1], set()
    for b in range(num_bins):
      if free[b] >= size and free[b] not in tried:
        tried.add(free[b])
        free[b] -= size
        assign[k] = b
        if search(k + 1):
          return True
        free[b] += size
    return False

  if not search(0):
    if nodes > max_nodes:
      logger.warning("submesh packing gave up after %d search nodes", max_nodes)
    return None
  bins: list[list[tuple[int, int]]] = [[] for _ in range(num_bins)]
  for item, b in zip(items, assign):
    bins[b].append(item)
  return bins


# ------------------------------------------------------------------------------------ parsing


class _FlowDict(dict):
  """A mapping written on one line (``{name: ib0, kind: rdma, ...}``)."""


class _Dumper(yaml.SafeDumper):
  """Writes :class:`_FlowDict` and lists of scalars in flow style."""


_Dumper.add_representer(
    _FlowDict, lambda d, x: d.represent_mapping("tag:yaml.org,2002:map", x, flow_style=True))
_Dumper.add_representer(
    list, lambda d, x: d.represent_sequence(
        "tag:yaml.org,2002:seq", x, flow_style=all(not isinstance(v, (dict, list)) for v in x)))


class _UniqueKeyLoader(yaml.SafeLoader):
  """A SafeLoader that rejects duplicate mapping keys instead of keeping the last."""


def _construct_mapping(loader, node, deep=False):
  seen = set()
  for key_node, _ in node.value:
    key = loader.construct_object(key_node, deep=deep)
    if key in seen:
      raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                              key_node.start_mark)
    seen.add(key)
  return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_mapping)


def _parse_yaml(text: str, source: str) -> Any:
  try:
    data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ClusterSpecError(f"{source}{where}: invalid YAML: {problem}") from None
  if data is None:
    raise ClusterSpecError(f"{source}: the cluster file is empty; it needs a 'subclusters' list")
  return data


_TOP_KEYS = ("name", "gpus", "subclusters", "links")
_GPU_KEYS = ("name", "tflops", "memory_gb", "mem_bandwidth_gbs", "intra_host_gbps")
_SUB_KEYS = ("name", "gpu", "hosts", "devices_per_host", "intra_host_gbps", "nics")
_NIC_KEYS = ("name", "kind", "gbps", "network", "latency_us")
_LINK_KEYS = ("between", "gbps", "latency_us", "kind")
_DEFAULT_GPU_INTRA_HOST_GBPS = 512  # PCIe Gen4 x16, 64 GB/s


def _cluster_from_dict(data: Any) -> Cluster:
  _check_keys(data, "cluster", _TOP_KEYS, ("subclusters",))
  name = data.get("name")
  if name is not None:
    _check_str(name, "name")
  gpus: list[GPUType] = []
  for i, g in enumerate(_check_list(_or_empty(data.get("gpus")), "gpus")):
    w = f"gpus[{i}]"
    _check_keys(g, w, _GPU_KEYS, _GPU_KEYS[:4])
    _check_str(g["name"], f"{w}.name")
    if g["name"].lower() in [x.name.lower() for x in gpus]:
      raise ClusterSpecError(f"{w}.name: duplicate GPU {g['name']!r}")
    vals = [_check_pos_number(g[k], f"{w}.{k}") for k in _GPU_KEYS[1:4]]
    intra = _check_pos_number(g.get("intra_host_gbps", _DEFAULT_GPU_INTRA_HOST_GBPS),
                              f"{w}.intra_host_gbps")
    gpus.append(GPUType.from_units(g["name"], *vals, intra))
  subs_raw = _check_list(data["subclusters"], "subclusters")
  if not subs_raw:
    raise ClusterSpecError("subclusters: expected a non-empty list of subclusters")
  subs, seen = [], {}
  for i, s in enumerate(subs_raw):
    w = f"subclusters[{i}]"
    _check_keys(s, w, _SUB_KEYS, ("name", "gpu", "hosts", "devices_per_host"))
    _check_str(s["name"], f"{w}.name")
    if s["name"] in seen:
      raise ClusterSpecError(f"{w}.name: duplicate subcluster name {s['name']!r} "
                             f"(also subclusters[{seen[s['name']]}])")
    seen[s["name"]] = i
    _check_str(s["gpu"], f"{w}.gpu")
    gpu = lookup_gpu(s["gpu"], gpus, where=f"{w}.gpu")
    intra = s.get("intra_host_gbps")
    if intra is not None:
      intra = _check_pos_number(intra, f"{w}.intra_host_gbps") * GBPS
    subs.append(SubCluster(s["name"], gpu, _check_pos_int(s["hosts"], f"{w}.hosts"),
                           _check_pos_int(s["devices_per_host"], f"{w}.devices_per_host"),
                           _nics_from_list(_or_empty(s.get("nics")), f"{w}.nics"), intra))
  links = []
  for i, ln in enumerate(_check_list(_or_empty(data.get("links")), "links")):
    w = f"links[{i}]"
    _check_keys(ln, w, _LINK_KEYS, ("between", "gbps"))
    between = ln["between"]
    if not (isinstance(between, list) and len(between) == 2):
      raise ClusterSpecError(f"{w}.between: expected a list of two subcluster names, "
                             f"got {between!r}")
    for x in between:
      if x not in seen:
        raise ClusterSpecError(f"{w}.between: unknown subcluster {x!r}"
                               f"{_did_you_mean(str(x), seen)} (known: {', '.join(seen)})")
    lat = ln.get("latency_us")
    if lat is not None:
      lat = _check_number(lat, f"{w}.latency_us", minimum=0.0) / 1e6
    kind = _check_kind(ln["kind"], f"{w}.kind") if "kind" in ln else None
    links.append(LinkOverride(tuple(between), _check_pos_number(ln["gbps"], f"{w}.gbps"), lat,
                              kind))
  return Cluster(tuple(subs), tuple(links), tuple(gpus), name)


def _nics_from_list(raw: Any, where: str) -> tuple[NIC, ...]:
  nics: list[NIC] = []
  for j, n in enumerate(_check_list(raw, where)):
    w = f"{where}[{j}]"
    _check_keys(n, w, _NIC_KEYS, ("name", "kind", "gbps", "network"))
    _check_str(n["name"], f"{w}.name")
    if n["name"] in [x.name for x in nics]:
      raise ClusterSpecError(f"{w}.name: duplicate NIC name {n['name']!r}")
    _check_str(n["network"], f"{w}.network")
    lat = n.get("latency_us")
    if lat is not None:
      lat = _check_number(lat, f"{w}.latency_us", minimum=0.0) / 1e6
    nics.append(NIC(n["name"], _check_kind(n["kind"], f"{w}.kind"),
                    _check_pos_number(n["gbps"], f"{w}.gbps"), n["network"], lat))
  return tuple(nics)
