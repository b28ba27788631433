"""Cluster building blocks: units, field checks, GPU catalog, NICs, links, hosts, subclusters.

The bottom layer of the cluster model; :mod:`harpjax.cluster.topology` adds
:class:`~harpjax.cluster.Cluster` on top. Each type checks its fields in ``__post_init__`` with
the ``check_*`` helpers below, which the YAML parser (:mod:`harpjax.cluster.yaml_file`) shares
so that a field reads the same error either way. :class:`Link` is the one link type of
harpjax: the cluster's links, the cost tables' cuts and the emulated links are all ``Link`` s.

Units. Inside: seconds, bytes, bytes/s, FLOP/s. In the catalog and YAML: TFLOP/s, memory in
GiB, memory bandwidth in GB/s, link bandwidth in Gbps, latency in microseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from harpjax.cluster.packing import submesh_shapes
from harpjax.errors import BandwidthCurveError, ClusterSpecError, UnknownGPUError

__all__ = [
    "TFLOPS", "GIB", "GBS", "GBPS", "GPUType", "GPU_CATALOG", "GPU_ALIASES", "lookup_gpu", "NIC",
    "NIC_LATENCY_S", "INTRA_HOST_LATENCY_S", "Link", "LinkOverride", "Host", "SubCluster",
    "DeviceInfo", "MAX_HOSTS", "MAX_DEVICES_PER_HOST", "MAX_DEVICES", "MEMORY_GB_BOUNDS",
    "GBPS_BOUNDS", "check_physical", "LINK_CLASSES", "TransferFees", "BYTES_PER_GB",
]

TFLOPS = 1e12        # TFLOP/s -> FLOP/s
GIB = 2**30          # memory_gb (GiB) -> bytes
GBS = 1e9            # GB/s -> bytes/s
GBPS = 1e9 / 8       # Gbps -> bytes/s

NIC_LATENCY_S = {"rdma": 5e-6, "infiniband": 5e-6, "roce": 5e-6, "ethernet": 50e-6}
"""Default one-way latency of a NIC by ``kind`` (RDMA ~5 us, TCP over Ethernet ~50 us)."""

INTRA_HOST_LATENCY_S = 2e-6
"""Latency of a transfer between two devices of one host (NVLink/PCIe)."""

MAX_HOSTS = 100_000
"""Most hosts a subcluster may have (a sanity bound: larger numbers are typos)."""

MAX_DEVICES_PER_HOST = 1024
"""Most devices a host may have (servers hold 4-16 GPUs; a sanity bound)."""

MAX_DEVICES = 2**20
"""Most devices a whole cluster may have (1,048,576; a sanity bound)."""

MEMORY_GB_BOUNDS = (2.0**-20, 2.0**16)
"""Device memory, GiB: 1 KiB (toy devices of tests hold tens) to 64 TiB. Outside is a unit
mistake (bytes written as GiB, or a number that rounds to a few bytes)."""

GBPS_BOUNDS = (1e-3, 1e6)
"""Bandwidth of any link, NIC or memory bus, Gbit/s (GB/s for ``mem_bandwidth_gbs``): 1 Mbit/s
to 1 Pbit/s. Outside is a unit mistake."""


def _clean(x: float) -> int | float:
  """A YAML-unit value rounded to 12 significant digits; an int when integral."""
  v = float(f"{x:.12g}")
  return int(v) if v.is_integer() else v


# ------------------------------------------------------------------------------------ checks


def did_you_mean(word: str, choices: Iterable[str]) -> str:
  close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(d: Any, where: str, allowed: Sequence[str], required: Sequence[str]) -> None:
  if not isinstance(d, Mapping):
    raise ClusterSpecError(f"{where}: expected a mapping with keys {', '.join(required)}, "
                           f"got {d!r}")
  for k in d:
    if k not in allowed:
      raise ClusterSpecError(f"{where}: unknown key {k!r}{did_you_mean(str(k), allowed)}; "
                             f"allowed: {', '.join(allowed)}")
  for k in required:
    if k not in d:
      raise ClusterSpecError(f"{where}: missing field {k!r}")


def or_empty(x: Any) -> Any:
  """An optional list left empty in YAML (``nics:``) reads as None: treat it as ``[]``."""
  return [] if x is None else x


def check_list(x: Any, where: str) -> list:
  if not isinstance(x, list):
    raise ClusterSpecError(f"{where}: expected a list, got {x!r}")
  return x


def check_str(x: Any, where: str) -> str:
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


def check_pos_int(x: Any, where: str) -> int:
  if isinstance(x, bool) or not isinstance(x, int) or x < 1:
    raise ClusterSpecError(f"{where}: expected a positive integer, got {x!r}{_string_hint(x)}")
  return x


def check_count(x: Any, where: str, maximum: int, what: str) -> int:
  """A positive integer at most ``maximum`` (``what`` names the unit in the message)."""
  check_pos_int(x, where)
  if x > maximum:
    raise ClusterSpecError(f"{where}: {x} is more than the {maximum} {what} harpjax supports; "
                           "check the value (a typo?)")
  return x


def check_number(x: Any, where: str, minimum: float) -> float:
  if (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
      or x < minimum):
    raise ClusterSpecError(f"{where}: expected a number >= {minimum:g}, got {x!r}"
                           f"{_string_hint(x)}")
  return x


def check_pos_number(x: Any, where: str) -> float:
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
    raise ClusterSpecError(f"{where}: expected a positive number, got {x!r}{_string_hint(x)}")
  return x


def check_physical(x: Any, where: str, bounds: tuple[float, float], unit: str) -> float:
  """A positive number within ``bounds`` (:data:`MEMORY_GB_BOUNDS`, :data:`GBPS_BOUNDS`)."""
  check_pos_number(x, where)
  lo, hi = bounds
  if not lo <= x <= hi:
    raise ClusterSpecError(f"{where}: {x:g} {unit} is not a physical value ({lo:g} to {hi:g} "
                           f"{unit}); check the unit")
  return x


def check_kind(x: Any, where: str) -> str:
  if isinstance(x, str) and x.lower() in NIC_LATENCY_S:
    return x.lower()
  raise ClusterSpecError(f"{where}: unknown kind {x!r}{did_you_mean(str(x), NIC_LATENCY_S)}; "
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
    compute_capability: CUDA compute capability (``8.0`` for A100, ``7.0`` for V100), or
      ``None`` when unknown (user entries): then :attr:`fused_attention` is false.
  """
  name: str
  peak_flops: float
  memory_bytes: int
  mem_bandwidth_bytes_per_s: float
  intra_host_bytes_per_s: float
  compute_capability: float | None = None

  def __post_init__(self):
    where = f"GPUType {self.name!r}"
    check_str(self.name, f"{where}.name")
    for f in ("peak_flops", "memory_bytes", "mem_bandwidth_bytes_per_s", "intra_host_bytes_per_s"):
      check_pos_number(getattr(self, f), f"{where}.{f}")
    check_physical(self.memory_bytes / GIB, f"{where}.memory_bytes / 2**30", MEMORY_GB_BOUNDS,
                   "GiB")
    object.__setattr__(self, "memory_bytes", int(round(self.memory_bytes)))
    if self.compute_capability is not None:
      check_pos_number(self.compute_capability, f"{where}.compute_capability")

  @property
  def fused_attention(self) -> bool:
    """Whether cuDNN's fused (FlashAttention-2 style) attention kernel runs on this type:
    compute capability 8.0 or newer (Ampere, Ada, Hopper). ``jax.nn.dot_product_attention(...,
    implementation="cudnn")`` lowers to it there; V100 (7.0) and T4 (7.5) have none. The cost
    model charges an attention written that way as the fused kernel on these types and as the
    XLA composition (``S x S`` scores through memory) on the others (docs/cost_model.md)."""
    return self.compute_capability is not None and self.compute_capability >= 8.0

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


def _catalog_entry(name, tflops, memory_gib, mem_gbs, intra_host_gbs, cc) -> GPUType:
  return GPUType(name, tflops * TFLOPS, memory_gib * GIB, mem_gbs * GBS, intra_host_gbs * GBS,
                 cc)


# name, dense fp16/bf16 tensor TFLOP/s, memory GiB, memory GB/s, intra-host GB/s (spec sheet:
# NVLink total for SXM parts, PCIe Gen4 x16 = 64 GB/s, Gen3 x16 = 32 GB/s for PCIe parts),
# CUDA compute capability (NVIDIA's table; >= 8.0 runs cuDNN's fused attention).
GPU_CATALOG: dict[str, GPUType] = {g.name: g for g in (
    _catalog_entry("A100-40G", 312, 40, 1555, 600, 8.0),     # SXM4, NVLink 3
    _catalog_entry("A100-80G", 312, 80, 2039, 600, 8.0),     # SXM4, NVLink 3
    _catalog_entry("V100-16G", 125, 16, 900, 300, 7.0),      # SXM2, NVLink 2
    _catalog_entry("V100-32G", 125, 32, 900, 300, 7.0),      # SXM2, NVLink 2
    _catalog_entry("H100-80G", 989, 80, 3350, 900, 9.0),     # SXM5, NVLink 4
    _catalog_entry("H200", 989, 141, 4800, 900, 9.0),        # SXM, NVLink 4
    _catalog_entry("L40S", 362, 48, 864, 64, 8.9),           # PCIe Gen4
    _catalog_entry("A40", 149.7, 48, 696, 64, 8.6),          # PCIe Gen4 (GA102, GDDR6)
    _catalog_entry("A10G", 70, 24, 600, 64, 8.6),            # PCIe Gen4 (AWS g5)
    _catalog_entry("T4", 65, 16, 320, 32, 7.5),              # PCIe Gen3
    _catalog_entry("RTX-4090", 165.2, 24, 1008, 64, 8.9),    # PCIe Gen4, fp16 accumulate
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
  hint = did_you_mean(str(name), known + list(GPU_ALIASES))
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
    check_str(self.name, f"{where}.name")
    check_str(self.network, f"{where}.network")
    object.__setattr__(self, "kind", check_kind(self.kind, f"{where}.kind"))
    check_physical(self.gbps, f"{where}.gbps", GBPS_BOUNDS, "Gbit/s")
    if self.latency_s is None:
      object.__setattr__(self, "latency_s", NIC_LATENCY_S[self.kind])
    check_number(self.latency_s, f"{where}.latency_s", minimum=0.0)

  @property
  def bandwidth_bytes_per_s(self) -> float:
    return self.gbps * GBPS

  def to_dict(self) -> dict:
    d = {"name": self.name, "kind": self.kind, "gbps": _clean(self.gbps), "network": self.network}
    if self.latency_s != NIC_LATENCY_S[self.kind]:
      d["latency_us"] = _clean(self.latency_s * 1e6)
    return d


@dataclasses.dataclass(frozen=True)
class BandwidthCurve:
  """A link's bandwidth as a function of the message size, from measured points.

  A message of ``b`` bytes moves at :meth:`bandwidth_at` ``(b)``: linear in ``log2(b)``
  between the two points around ``b``, the first point's bandwidth below the first size and
  the last point's above the last (a message does not get faster than the largest one
  measured, nor slower than the smallest). Sailor fits a polynomial in ``log2(b)`` to the same
  kind of measurements (``tools/sailor.py``, ``send_time_s``); the points are the measurements
  themselves, so no fit can overshoot between or beyond them.

  Attributes:
    points: ``((bytes, bytes_per_s), ...)`` with sizes strictly increasing, both > 0 and
      finite.

  Raises:
    BandwidthCurveError: no point, a size or bandwidth not a finite number > 0, or sizes not
      strictly increasing.
  """
  points: tuple[tuple[float, float], ...]

  def __post_init__(self):
    try:
      pts = tuple((float(b), float(bw)) for b, bw in self.points)
    except (TypeError, ValueError):
      raise BandwidthCurveError(f"bandwidth points {self.points!r}: expected (bytes, "
                                "bandwidth) pairs") from None
    if not pts:
      raise BandwidthCurveError("bandwidth points: give at least one (bytes, bandwidth) pair")
    for b, bw in pts:
      if not (math.isfinite(b) and b > 0 and math.isfinite(bw) and bw > 0):
        raise BandwidthCurveError(f"bandwidth point ({b:g} bytes, {bw:g} bytes/s): size and "
                                  "bandwidth must be finite numbers > 0")
    for (b0, _), (b1, _) in zip(pts, pts[1:]):
      if not b1 > b0:
        raise BandwidthCurveError(f"bandwidth points: sizes must increase strictly "
                                  f"({b0:g} bytes is followed by {b1:g}); give each size once, "
                                  "smallest first")
    object.__setattr__(self, "points", pts)

  @classmethod
  def from_gbps(cls, points) -> "BandwidthCurve":
    """A curve from ``(bytes, Gbit/s)`` points (the cluster file's form)."""
    try:
      pts = tuple((b, float(g) * GBPS) for b, g in points)
    except (TypeError, ValueError):
      raise BandwidthCurveError(f"bandwidth points {points!r}: expected [bytes, gbps] pairs"
                                ) from None
    return cls(pts)

  def bandwidth_at(self, nbytes):
    """Bytes/s of a message of ``nbytes`` (a number, or an array: then so is the result)."""
    x = np.log2(np.maximum(np.asarray(nbytes, np.float64), self.points[0][0]))
    xs = np.log2([b for b, _ in self.points])
    out = np.interp(x, xs, [bw for _, bw in self.points])
    return float(out) if out.ndim == 0 else out

  @property
  def largest_bytes_per_s(self) -> float:
    """The bandwidth of the largest message measured."""
    return self.points[-1][1]

  def to_gbps(self) -> list[list[float]]:
    return [[_clean(b), _clean(bw / GBPS)] for b, bw in self.points]


@dataclasses.dataclass(frozen=True)
class Link:
  """A point-to-point link as one transfer sees it: the one link type of harpjax.

  Attributes:
    bandwidth_bytes_per_s: bytes/s (``inf`` for a device to itself, or a link that only has
      latency).
    latency_s: seconds per message.
    src_nic: the sender's NIC (``None`` inside a host or when no NIC pair exists).
    dst_nic: the receiver's NIC.
    kind: ``"intra_host"``, ``"local"`` (same device) or a NIC kind (``"rdma"``...).
    overridden: whether bandwidth and latency come from a ``links`` entry.
    curve: optional :class:`BandwidthCurve`: the bandwidth by message size (a ``links``
      entry's ``gbps_by_size``); then a message of ``b`` bytes moves at ``curve.bandwidth_at
      (b)`` and ``bandwidth_bytes_per_s`` is the bandwidth where no message size is known.
      ``None``: every message moves at ``bandwidth_bytes_per_s``.

  Raises:
    ClusterSpecError: bandwidth not > 0 or latency not a finite number >= 0.
  """
  bandwidth_bytes_per_s: float
  latency_s: float = 0.0
  src_nic: NIC | None = None
  dst_nic: NIC | None = None
  kind: str = "intra_host"
  overridden: bool = False
  curve: BandwidthCurve | None = None

  def __post_init__(self):
    bw, lat = self.bandwidth_bytes_per_s, self.latency_s
    if isinstance(bw, bool) or not isinstance(bw, numbers.Real) or not bw > 0:
      raise ClusterSpecError(f"Link.bandwidth_bytes_per_s={bw!r}: must be a number > 0")
    if isinstance(lat, bool) or not isinstance(lat, numbers.Real) or not (
        math.isfinite(lat) and lat >= 0):
      raise ClusterSpecError(f"Link.latency_s={lat!r}: must be a finite number >= 0")
    if self.curve is not None and not isinstance(self.curve, BandwidthCurve):
      raise ClusterSpecError(f"Link.curve={self.curve!r}: expected a BandwidthCurve or None")

  @classmethod
  def from_gbps(cls, gbps: float, latency_us: float = 0.0, **kwargs) -> "Link":
    """A link of ``gbps`` Gbit/s and ``latency_us`` microseconds."""
    return cls(gbps * GBPS, latency_us * 1e-6, **kwargs)

  def bandwidth_at(self, nbytes):
    """Bytes/s of one message of ``nbytes`` (a number or an array): :attr:`curve`'s where
    given, else :attr:`bandwidth_bytes_per_s`."""
    if self.curve is None:
      return (self.bandwidth_bytes_per_s if np.ndim(nbytes) == 0 else
              np.full(np.shape(nbytes), self.bandwidth_bytes_per_s))
    return self.curve.bandwidth_at(nbytes)

  def transfer_time_s(self, nbytes: float) -> float:
    """Seconds to send one message of ``nbytes``: ``latency_s + nbytes / bw(nbytes)``
    (:meth:`bandwidth_at`)."""
    return self.latency_s + nbytes / self.bandwidth_at(nbytes)

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
    curve: optional :class:`BandwidthCurve`, the bandwidth by message size (the file's
      ``gbps_by_size``).
  """
  between: tuple[str, str]
  gbps: float
  latency_s: float | None = None
  kind: str | None = None
  curve: BandwidthCurve | None = None

  def __post_init__(self):
    between = tuple(self.between) if isinstance(self.between, (list, tuple)) else ()
    if len(between) != 2 or not all(isinstance(x, str) and x for x in between):
      raise ClusterSpecError(f"LinkOverride.between={self.between!r}: expected two subcluster "
                             "names")
    object.__setattr__(self, "between", between)
    check_physical(self.gbps, f"link {list(between)}.gbps", GBPS_BOUNDS, "Gbit/s")
    if self.latency_s is not None:
      check_number(self.latency_s, f"link {list(between)}.latency_s", minimum=0.0)
    if self.kind is not None:
      object.__setattr__(self, "kind", check_kind(self.kind, f"link {list(between)}.kind"))
    if self.curve is not None and not isinstance(self.curve, BandwidthCurve):
      raise ClusterSpecError(f"link {list(between)}.curve={self.curve!r}: expected a "
                             "BandwidthCurve or None")

  @property
  def bandwidth_bytes_per_s(self) -> float:
    return self.gbps * GBPS

  def to_dict(self) -> dict:
    d: dict[str, Any] = {"between": list(self.between), "gbps": _clean(self.gbps)}
    if self.latency_s is not None:
      d["latency_us"] = _clean(self.latency_s * 1e6)
    if self.kind is not None:
      d["kind"] = self.kind
    if self.curve is not None:
      d["gbps_by_size"] = self.curve.to_gbps()
    return d


def nic_pair_link(src: Sequence[NIC], dst: Sequence[NIC]) -> Link | None:
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


# ------------------------------------------------------------------------------------ fees

LINK_CLASSES = ("same_zone", "other_zone", "other_region")
"""The classes of a link between two subclusters, by where they sit: one zone, two zones of
one region, two regions. Transfer fees are charged per class (:class:`TransferFees`)."""

BYTES_PER_GB = 1e9
"""Bytes of the GB transfer fees are quoted per (cloud providers bill decimal GB)."""


@dataclasses.dataclass(frozen=True)
class TransferFees:
  """Data-transfer fees per GB (1e9 bytes) sent over a link of each class, in the currency of
  the subclusters' ``price_per_gpu_hour``.

  The defaults are Sailor's (Strati et al., SOSP'25, §4.2.3: the cost per iteration is
  ``C_comp + C_comm``; the numbers are its ``sailor/providers/gcp/communication_cost.json``,
  eth-easl/sailor @ 37ded10, GCP's list prices in USD): nothing inside a zone, 0.01 per GB
  between two zones of one region, 0.02 per GB between regions.

  Attributes:
    same_zone: fee per GB between two subclusters of one zone (or inside a subcluster).
    other_zone: fee per GB between two zones of one region.
    other_region: fee per GB between two regions.

  Raises:
    ClusterSpecError: a fee that is not a finite number >= 0.
  """
  same_zone: float = 0.0
  other_zone: float = 0.01
  other_region: float = 0.02

  def __post_init__(self):
    for name in LINK_CLASSES:
      object.__setattr__(self, name, float(check_number(
          getattr(self, name), f"transfer_fee_per_gb.{name}", minimum=0.0)))

  def per_gb(self, link_class: str) -> float:
    """The fee per GB of a link class (one of :data:`LINK_CLASSES`)."""
    if link_class not in LINK_CLASSES:
      raise ClusterSpecError(f"unknown link class {link_class!r}; known: "
                             f"{', '.join(LINK_CLASSES)}")
    return getattr(self, link_class)

  def per_byte(self, link_class: str) -> float:
    """The fee per byte of a link class."""
    return self.per_gb(link_class) / BYTES_PER_GB

  def as_tuple(self) -> tuple[float, float, float]:
    """The fees per GB in the order of :data:`LINK_CLASSES`."""
    return tuple(getattr(self, c) for c in LINK_CLASSES)

  def to_dict(self) -> dict:
    """The classes whose fee differs from the default (what the cluster file needs)."""
    default = TransferFees()
    return {c: _clean(getattr(self, c)) for c in LINK_CLASSES
            if getattr(self, c) != getattr(default, c)}


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
    price_per_gpu_hour: optional price of one device per hour (any currency), for the
      planner's objectives with money.
    zone: optional zone label; a ``links`` entry between two zones sets the link between
      their subclusters, and the transfer fees of a link follow the zones (and regions) of
      its two ends (:meth:`~harpjax.cluster.Cluster.link_class`).
    region: optional region of the zone (needs ``zone``): two zones of one region are linked
      at the ``other_zone`` fee, of two regions at ``other_region``
      (:class:`TransferFees`).
    host_memory_bytes_per_s: optional bandwidth between a device and its host's memory, one
      direction (PCIe: ~12e9 for Gen3 x16, ~25e9 for Gen4); given for every subcluster, the
      planner may keep a stage's optimizer state, or its residuals between forward and
      backward, in host memory (YAML ``host_memory_gbps``).
    hosts: the ``N`` hosts (derived).
  """
  name: str
  gpu: GPUType
  num_hosts: int
  devices_per_host: int
  nics: tuple[NIC, ...] = ()
  intra_host_bytes_per_s: float | None = None
  price_per_gpu_hour: float | None = None
  zone: str | None = None
  host_memory_bytes_per_s: float | None = None
  region: str | None = None
  hosts: tuple[Host, ...] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    where = f"SubCluster {self.name!r}"
    check_str(self.name, f"{where}.name")
    if not isinstance(self.gpu, GPUType):
      object.__setattr__(self, "gpu", lookup_gpu(self.gpu, where=f"{where}.gpu"))
    check_count(self.num_hosts, f"{where}.num_hosts", MAX_HOSTS, "hosts per subcluster")
    check_count(self.devices_per_host, f"{where}.devices_per_host", MAX_DEVICES_PER_HOST,
                "devices per host")
    nics = tuple(self.nics)
    for i, nic in enumerate(nics):
      if not isinstance(nic, NIC):
        raise ClusterSpecError(f"{where}.nics[{i}]: expected a NIC, got {nic!r}")
      if nic.name in [n.name for n in nics[:i]]:
        raise ClusterSpecError(f"{where}.nics[{i}].name: duplicate NIC name {nic.name!r}")
    object.__setattr__(self, "nics", nics)
    if self.intra_host_bytes_per_s is None:
      object.__setattr__(self, "intra_host_bytes_per_s", self.gpu.intra_host_bytes_per_s)
    check_pos_number(self.intra_host_bytes_per_s, f"{where}.intra_host_bytes_per_s")
    if self.price_per_gpu_hour is not None:
      object.__setattr__(self, "price_per_gpu_hour", check_number(
          self.price_per_gpu_hour, f"{where}.price_per_gpu_hour", minimum=0.0))
    if self.zone is not None:
      check_str(self.zone, f"{where}.zone")
    if self.region is not None:
      check_str(self.region, f"{where}.region")
      if self.zone is None:
        raise ClusterSpecError(f"{where}.region: {self.region!r} needs a zone; give the "
                               "subcluster a zone label too (zone: ...)")
    if self.host_memory_bytes_per_s is not None:
      check_pos_number(self.host_memory_bytes_per_s, f"{where}.host_memory_bytes_per_s")
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
    sizes add up to at most ``N * M`` packs onto the hosts. For ``M`` a power of two this is
    ``1, 2, 4, ..., M``; for ``M = 6`` it is ``1, 2, 6`` (three ``(1, 4)`` would not pack on
    two hosts of 6). See :func:`harpjax.cluster.submesh_shapes`.

    Args:
      all_sizes: if True, ``m`` runs over every width ``1..M`` (what
        :meth:`~harpjax.cluster.Cluster.allocate_submeshes` accepts).

    Returns:
      ``[(1, 1), (1, 2), (1, 4), ..., (1, M), (2, M), ..., (N, M)]``.
    """
    return list(submesh_shapes(self.num_hosts, self.devices_per_host,
                               "all" if all_sizes else "chain"))

  def to_dict(self) -> dict:
    d: dict[str, Any] = {"name": self.name, "gpu": self.gpu.name, "hosts": self.num_hosts,
                         "devices_per_host": self.devices_per_host}
    if self.intra_host_bytes_per_s != self.gpu.intra_host_bytes_per_s:
      d["intra_host_gbps"] = _clean(self.intra_host_bytes_per_s / GBPS)
    if self.nics:
      d["nics"] = [n.to_dict() for n in self.nics]
    if self.price_per_gpu_hour is not None:
      d["price_per_gpu_hour"] = _clean(self.price_per_gpu_hour)
    if self.zone is not None:
      d["zone"] = self.zone
    if self.region is not None:
      d["region"] = self.region
    if self.host_memory_bytes_per_s is not None:
      d["host_memory_gbps"] = _clean(self.host_memory_bytes_per_s / GBPS)
    return d


class DeviceInfo(NamedTuple):
  """Where a global device index lives."""
  subcluster: str
  host: int
  local: int

