"""Moving activations, gradients and state between stage workers, over the right NIC.

Choosing the link (HARP §6: "automatically selecting the fastest available NIC based on the
network topology"). For two stages the cluster model (:mod:`harpjax.cluster`) gives the link
between their hosts: the fastest NIC pair on a shared network, or a ``links`` override; inside a
host, the intra-host link. :func:`plan_routes` turns that into a :class:`Route` per communicating
pair of stages, with the transport that realises it:

* ``"local"``: both stages in one process; values move with ``jax.device_put``
  (:class:`~harpjax.runtime.channels.LocalChannel`);
* ``"tcp"``: a TCP connection whose socket is bound to the chosen NIC's address on the sender
  and which connects to the chosen NIC's address on the receiver (:class:`~.channels.TcpChannel`,
  :class:`~.channels.TcpListener`), so the bytes leave and enter through that interface;
* ``"object_store"``: the Ray object store (the fallback when a NIC has no known address, or
  when asked for); implemented in :mod:`harpjax.runtime.ray_runtime`, Ray staying there.

NIC addresses. A NIC of the cluster file is named like the interface (``ib0``, ``eth0``). Its
address on a host comes from, in order: the ``nic_addresses`` option (``{host: {nic: ip}}``),
the interface of that name on the host itself (each worker reports its interfaces,
:func:`interface_addresses`), or, when every worker runs on this machine, the loopback address.

Every sender runs in its own thread (:class:`~harpjax.runtime.channels.Sender`), one per
destination stage: a FIFO queue per link direction, so that the compute thread never blocks on
a send and the two directions of a link are independent (full duplex). An emulated link
(:mod:`harpjax.runtime.emulation`) makes the sender thread hold each message for
``latency + bytes / bandwidth``.

NCCL. The stage executables' own collectives (inside one stage's submesh) are XLA's; on GPUs XLA
runs them with NCCL, which picks its network from environment variables, not from this module.
:func:`nccl_env` gives the variables that make NCCL use the NIC this module would choose (see
``docs/runtime.md``); they are documented, not exercised, here: this machine has no GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import struct
from typing import Any, Callable, Mapping, Sequence

from harpjax.cluster import Cluster, Link
from harpjax.errors import ClusterSpecError

log = logging.getLogger(__name__)

__all__ = ["Route", "TRANSPORTS", "LOOPBACK", "plan_routes", "stage_hosts",
           "normalize_addresses", "interface_addresses", "nccl_env", "new_token"]

TRANSPORTS = ("auto", "tcp", "object_store")
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- routes


@dataclasses.dataclass(frozen=True)
class Route:
  """How messages go from one stage to another.

  Attributes:
    src, dst: stage indices.
    src_host, dst_host: cluster host names of the two stages.
    link: the cluster's link between the hosts (bandwidth, latency, NIC pair, kind).
    transport: ``"local"``, ``"tcp"`` or ``"object_store"``.
    src_address: IPv4 address the sender's socket binds to (``"tcp"`` only).
    dst_address: IPv4 address the receiver listens on (``"tcp"`` only).
    src_nic, dst_nic: names of the chosen NICs (``None`` inside a host).
    reason: why this transport was chosen (for logs and docs).
  """
  src: int
  dst: int
  src_host: str
  dst_host: str
  link: Link
  transport: str
  src_address: str | None = None
  dst_address: str | None = None
  src_nic: str | None = None
  dst_nic: str | None = None
  reason: str = ""

  def describe(self) -> str:
    nic = (f"{self.src_nic}->{self.dst_nic}" if self.src_nic else self.link.kind)
    where = (f" {self.src_address}->{self.dst_address}" if self.transport == "tcp" else "")
    return (f"stage {self.src} ({self.src_host}) -> stage {self.dst} ({self.dst_host}): "
            f"{self.link.gbps:g} Gbps {self.link.kind} via {nic}, {self.transport}{where}")


def stage_hosts(cluster: Cluster, stage_devices: Sequence[Sequence[int]]) -> list[str]:
  """The host of each stage: that of its first device (a stage's worker runs there)."""
  return [cluster.host_of_device(devs[0]).name for devs in stage_devices]


def normalize_addresses(addresses: Any) -> dict[tuple[str, str], str]:
  """``{host: {nic: ip}}``, ``{(host, nic): ip}`` or ``{"host/nic": ip}`` as
  ``{(host, nic): ip}``."""
  out: dict[tuple[str, str], str] = {}
  if not addresses:
    return out
  if not isinstance(addresses, Mapping):
    raise ClusterSpecError(f"nic_addresses must be a mapping, got {type(addresses).__name__}")
  for k, v in addresses.items():
    if isinstance(v, Mapping):
      for nic, ip in v.items():
        out[(str(k), str(nic))] = str(ip)
    elif isinstance(k, tuple) and len(k) == 2:
      out[(str(k[0]), str(k[1]))] = str(v)
    elif isinstance(k, str) and "/" in k:
      host, nic = k.split("/", 1)
      out[(host, nic)] = str(v)
    else:
      raise ClusterSpecError(f"nic_addresses entry {k!r}: expected host -> {{nic: ip}}, "
                             "(host, nic) -> ip or 'host/nic' -> ip")
  return out


def plan_routes(cluster: Cluster, hosts: Sequence[str], pairs, *,
                addresses: Mapping[tuple[str, str], str] | None = None,
                same_process: Callable[[int, int], bool] = lambda a, b: False,
                same_machine: Callable[[int, int], bool] = lambda a, b: True,
                single_machine: bool = False, transport: str = "auto") -> dict:
  """Chooses the link and the transport of every communicating pair of stages.

  Args:
    cluster: the cluster model.
    hosts: per stage, its host name (:func:`stage_hosts`).
    pairs: ``(src, dst)`` stage pairs that exchange messages.
    addresses: ``(host, nic) -> IPv4`` of the NICs (see the module docstring).
    same_process: whether two stages share a process (then ``"local"``).
    same_machine: whether two stages' workers run on one machine (two stages of one cluster
      host whose workers do not — actors not pinned to hosts — use the object store).
    single_machine: every worker runs on this machine: a NIC without an address uses the
      loopback address.
    transport: ``"auto"`` (TCP where both NIC addresses are known, else the object store),
      ``"tcp"`` (an unknown address is an error) or ``"object_store"``.

  Returns:
    ``{(src, dst): Route}``.

  Raises:
    ClusterSpecError: two hosts share no network, or ``transport="tcp"`` and a NIC has no
      address.
  """
  if transport not in TRANSPORTS:
    raise ClusterSpecError(f"transport={transport!r}; choose one of {TRANSPORTS}")
  addresses = dict(addresses or {})
  routes = {}
  for src, dst in sorted(pairs):
    a, b = hosts[src], hosts[dst]
    link = cluster.link_between_hosts(a, b)
    src_nic = link.src_nic.name if link.src_nic is not None else None
    dst_nic = link.dst_nic.name if link.dst_nic is not None else None
    if same_process(src, dst):
      routes[(src, dst)] = Route(src, dst, a, b, link, "local", src_nic=src_nic,
                                 dst_nic=dst_nic, reason="same process")
      continue
    if transport == "object_store":
      routes[(src, dst)] = Route(src, dst, a, b, link, "object_store", src_nic=src_nic,
                                 dst_nic=dst_nic, reason="transport='object_store'")
      continue
    if a == b and not same_machine(src, dst):
      routes[(src, dst)] = Route(src, dst, a, b, link, "object_store", reason=(
          f"the workers of host {a} run on different machines (not pinned to hosts)"))
      continue
    if a == b:   # two processes of one host: the loopback interface
      sa = addresses.get((a, "lo"), LOOPBACK)
      routes[(src, dst)] = Route(src, dst, a, b, link, "tcp", sa, sa, src_nic, dst_nic,
                                 reason="same host: loopback")
      continue
    sa = addresses.get((a, src_nic)) if src_nic else None
    da = addresses.get((b, dst_nic)) if dst_nic else None
    if sa is not None and da is not None:
      why = ""
    elif single_machine:
      sa, da = sa or LOOPBACK, da or LOOPBACK
      why = "one machine: the loopback interface stands for the NICs"
    elif src_nic is None:
      why = "the link is an override without a NIC pair"
    else:
      why = (f"no address for NIC {src_nic} of {a}" if sa is None else
             f"no address for NIC {dst_nic} of {b}")
    if sa is None or da is None:
      if transport == "tcp":
        raise ClusterSpecError(f"stage {src} -> stage {dst} ({a} -> {b}): {why}; give "
                               "nic_addresses={host: {nic: ip}} or use transport='auto'")
      routes[(src, dst)] = Route(src, dst, a, b, link, "object_store", src_nic=src_nic,
                                 dst_nic=dst_nic, reason=why + ": Ray object store")
      continue
    routes[(src, dst)] = Route(src, dst, a, b, link, "tcp", sa, da, src_nic, dst_nic,
                               reason=(f"NIC pair {src_nic}->{dst_nic}" if src_nic else
                                       "link override") + (f" ({why})" if why else ""))
  return routes


def interface_addresses() -> dict[str, str]:
  """IPv4 address of each network interface of this machine (Linux), by interface name."""
  out: dict[str, str] = {}
  try:
    import fcntl  # pylint: disable=import-outside-toplevel
    names = [name for _, name in socket.if_nameindex()]
  except (ImportError, OSError):
    return out
  siocgifaddr = 0x8915
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for name in names:
      try:
        packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
      except OSError:
        continue
      out[name] = socket.inet_ntoa(packed[20:24])
  return out


def nccl_env(link: Link, *, hca: str | None = None, bootstrap_nic: str | None = None
             ) -> dict[str, str]:
  """NCCL environment variables that make NCCL use ``link``'s NIC pair.

  For collectives inside a stage whose hosts talk over ``link`` (the subcluster's fabric):

  * RDMA/InfiniBand/RoCE: ``NCCL_IB_DISABLE=0`` and ``NCCL_IB_HCA`` set to the HCA behind the
    NIC (``hca``, e.g. ``mlx5_0``; the NIC name when not given); RoCE also
    ``NCCL_IB_GID_INDEX=3`` (RoCE v2 on the usual GID table). NCCL bootstraps over a socket
    interface: ``NCCL_SOCKET_IFNAME`` is ``bootstrap_nic`` if given.
  * Ethernet: ``NCCL_IB_DISABLE=1`` and ``NCCL_SOCKET_IFNAME`` set to the NIC.
  * Inside a host (no NIC): nothing; NCCL uses NVLink/PCIe peer to peer.

  Not exercised here (no GPU on this machine); see ``docs/runtime.md``.
  """
  nic = link.src_nic
  if nic is None:
    return {}
  env: dict[str, str] = {}
  if link.kind in ("rdma", "infiniband", "roce"):
    env["NCCL_IB_DISABLE"] = "0"
    env["NCCL_IB_HCA"] = hca or nic.name
    if link.kind == "roce":
      env["NCCL_IB_GID_INDEX"] = "3"
    if bootstrap_nic:
      env["NCCL_SOCKET_IFNAME"] = bootstrap_nic
  else:
    env["NCCL_IB_DISABLE"] = "1"
    env["NCCL_SOCKET_IFNAME"] = nic.name
  return env


def new_token() -> str:
  """A random secret a runner's connections present, so strangers are refused."""
  return secrets.token_hex(16)
