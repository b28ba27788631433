"""The cluster: ordered subclusters, the links between any two hosts, device numbering.

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
import logging
import math
import operator
import os
from typing import Any, Iterable, Sequence

from harpjax.cluster.hardware import (GBPS, GIB, NIC, NIC_LATENCY_S, TFLOPS, DeviceInfo, GPUType,
                                      GPU_CATALOG, Host, Link, LinkOverride, MAX_DEVICES,
                                      SubCluster, TransferFees, did_you_mean, nic_pair_link)
from harpjax.cluster.packing import allocate_submeshes
from harpjax.cluster.yaml_file import cluster_fields, dump_yaml, parse_yaml
from harpjax.errors import ClusterSpecError, NotEnoughDevicesError, PlanError

__all__ = ["Cluster", "load_cluster"]

logger = logging.getLogger(__name__)


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
    transfer_fees: the fee per GB sent over a link of each class (:meth:`link_class`);
      Sailor's defaults unless the cluster file's ``transfer_fee_per_gb`` overrides one.
  """
  subclusters: tuple[SubCluster, ...]
  links: tuple[LinkOverride, ...] = ()
  gpus: tuple[GPUType, ...] = ()
  name: str | None = None
  transfer_fees: TransferFees = TransferFees()
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
    total = sum(s.num_devices for s in subs)
    if total > MAX_DEVICES:
      sizes = ", ".join(f"{s.name}: {s.num_hosts} x {s.devices_per_host}" for s in subs)
      raise ClusterSpecError(f"subclusters: {total} devices in all ({sizes}) is more than the "
                             f"{MAX_DEVICES} harpjax supports; check hosts and devices_per_host")
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
    zones = {s.zone for s in subs if s.zone is not None}
    clash = zones & set(by_name)
    if clash:
      raise ClusterSpecError(f"zones {sorted(clash)} are also subcluster names; zones and "
                             "subclusters need different names")
    self._check_regions(subs)
    if not isinstance(self.transfer_fees, TransferFees):
      raise ClusterSpecError(f"Cluster.transfer_fees: expected a TransferFees, got "
                             f"{self.transfer_fees!r}")
    for i, ov in enumerate(self.links):
      if not isinstance(ov, LinkOverride):
        raise ClusterSpecError(f"Cluster.links[{i}]: expected a LinkOverride, got {ov!r}")
      for x in ov.between:
        if x not in by_name and x not in zones:
          raise ClusterSpecError(f"links[{i}].between: unknown subcluster or zone {x!r} "
                                 f"(known: {', '.join(list(by_name) + sorted(zones))})")
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

  @staticmethod
  def _check_regions(subs: Sequence[SubCluster]) -> None:
    """A zone lies in one region; regions are given for every zoned subcluster or none."""
    region_of: dict[str, tuple[str | None, str]] = {}
    for s in subs:
      if s.zone is None:
        continue
      seen = region_of.setdefault(s.zone, (s.region, s.name))
      if seen[0] != s.region:
        raise ClusterSpecError(
            f"subcluster {s.name!r}: zone {s.zone!r} is in region {s.region!r} here but in "
            f"{seen[0]!r} for subcluster {seen[1]!r}; a zone lies in one region: give both "
            "the same region")
    zoned = [s for s in subs if s.zone is not None]
    with_region = [s.name for s in zoned if s.region is not None]
    if with_region and len(with_region) != len(zoned):
      missing = [s.name for s in zoned if s.region is None]
      raise ClusterSpecError(
          f"subclusters {missing} have a zone but no region while {with_region} have one; give "
          "every zoned subcluster its region (or none: then every two zones are in one region)")
    if any(s.zone is None for s in subs) and zoned:
      missing = [s.name for s in subs if s.zone is None]
      raise ClusterSpecError(
          f"subclusters {missing} have no zone while {[s.name for s in zoned]} have one; the "
          "transfer fees of a link follow the zones of its ends: give every subcluster its zone")

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
      return Cluster(*cluster_fields(data))
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
    data = parse_yaml(path_or_text, "<cluster yaml>")
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
    fees = self.transfer_fees.to_dict()
    if fees:
      d["transfer_fee_per_gb"] = fees
    return d

  def to_yaml(self) -> str:
    """The cluster as YAML text; ``Cluster.from_yaml(c.to_yaml()) == c``."""
    return dump_yaml(self.to_dict())

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
      raise ClusterSpecError(f"unknown subcluster {name!r}{did_you_mean(str(name), self.names)} "
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

  def without_hosts(self, names: Iterable[str]) -> "Cluster":
    """The cluster after losing hosts ``names``: each subcluster keeps its other hosts (hosts
    are interchangeable, so they are renumbered), one that loses all of them is dropped with
    its link overrides.

    Raises:
      ClusterSpecError: an unknown host, or no host would be left.
    """
    lost: dict[str, int] = {}
    for name in names:
      host = self.host(name)
      lost[host.subcluster] = lost.get(host.subcluster, 0) + 1
    subs = []
    for sc in self.subclusters:
      left = sc.num_hosts - min(lost.get(sc.name, 0), sc.num_hosts)
      if left:
        subs.append(dataclasses.replace(sc, num_hosts=left))
    if not subs:
      raise ClusterSpecError("no host of the cluster would be left")
    kept = {sc.name for sc in subs}
    links = tuple(ov for ov in self.links if all(x in kept for x in ov.between))
    return dataclasses.replace(self, subclusters=tuple(subs), links=links)

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
      raise ClusterSpecError(f"unknown host {name!r}{did_you_mean(str(name), self._hosts)}; "
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

  def link_class(self, name_a: str, name_b: str) -> str:
    """The class of the link between subclusters ``name_a`` and ``name_b`` (one of
    :data:`~harpjax.cluster.LINK_CLASSES`): ``"same_zone"`` for one subcluster, two of one
    zone, or a cluster without zones; ``"other_region"`` for two zones whose regions differ;
    else ``"other_zone"``."""
    a, b = self.subcluster(name_a), self.subcluster(name_b)
    if a.zone == b.zone:
      return "same_zone"
    if a.region is not None and b.region is not None and a.region != b.region:
      return "other_region"
    return "other_zone"

  def transfer_fee_per_byte(self, name_a: str, name_b: str) -> float:
    """Fee per byte sent between subclusters ``name_a`` and ``name_b`` (:attr:`transfer_fees`
    of their :meth:`link_class`)."""
    return self.transfer_fees.per_byte(self.link_class(name_a, name_b))

  def _pair_link(self, a: str, b: str) -> Link:
    sa, sb = self._by_name[a], self._by_name[b]
    base = nic_pair_link(sa.nics, sb.nics)
    ov = self._overrides.get(frozenset((a, b)))
    if ov is None and a != b and sa.zone is not None and sb.zone is not None:
      ov = self._overrides.get(frozenset((sa.zone, sb.zone)))   # a link between zones
    if ov is not None:
      kind = ov.kind or (base.kind if base else "ethernet")
      if ov.latency_s is not None:
        latency = ov.latency_s
      elif ov.kind is None and base is not None:
        latency = base.latency_s
      else:
        latency = NIC_LATENCY_S[kind]
      return Link(ov.bandwidth_bytes_per_s, latency, base and base.src_nic, base and base.dst_nic,
                  kind, overridden=True, curve=ov.curve)
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
    takes ``n`` whole hosts. The single-host ones are packed exactly
    (:func:`~harpjax.cluster.packing.bin_pack`, the packer the planner asks too); hosts are
    then handed out in pipeline order so that devices ascend with the stages where possible.

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
        for i, devs in allocate_submeshes(s.name, s.num_hosts, s.devices_per_host,
                                          mine).items():
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
    with open(fname, "rb") as f:
      text = f.read().decode("utf-8")
  except FileNotFoundError:
    raise ClusterSpecError(f"cluster file {fname!r} does not exist") from None
  except OSError as e:
    raise ClusterSpecError(f"cannot read cluster file {fname!r}: {e.strerror}") from None
  except UnicodeDecodeError as e:
    line = e.object[:e.start].count(b"\n") + 1
    raise ClusterSpecError(f"cluster file {fname!r} is not UTF-8 text (byte {e.start}, line "
                           f"{line}: {e.object[e.start:e.start + 1]!r}); save it as UTF-8") \
        from None
  cluster = Cluster.from_dict(parse_yaml(text, fname), fname)
  logger.debug("loaded cluster %s: %d subclusters, %d devices", fname, len(cluster.subclusters),
               cluster.num_devices)
  return cluster
