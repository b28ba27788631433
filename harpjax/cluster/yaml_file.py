"""The cluster YAML file: parsing and checking it into cluster fields, and writing it back.

:func:`parse_yaml` reads YAML text (rejecting duplicate keys, reporting syntax errors with line
and column); :func:`cluster_fields` checks the parsed structure field by field (errors name the
field path, e.g. ``subclusters[0].hosts``) and builds the parts of a
:class:`~harpjax.cluster.Cluster`; :func:`dump_yaml` writes a ``Cluster.to_dict()`` with NICs,
GPUs and links one per line. See ``docs/cluster.md`` for the format.
"""

from __future__ import annotations

from typing import Any

import yaml

from harpjax.cluster.hardware import (
    BandwidthCurve, GBPS, GBPS_BOUNDS, GPUType, LinkOverride, MAX_DEVICES_PER_HOST, MAX_HOSTS, MEMORY_GB_BOUNDS,
    NIC, LINK_CLASSES, SubCluster, TransferFees, check_count, check_keys, check_kind, check_list, check_number,
    check_physical, check_pos_number, check_str, did_you_mean, or_empty, lookup_gpu)
from harpjax.errors import BandwidthCurveError, ClusterSpecError

__all__ = ["parse_yaml", "cluster_fields", "dump_yaml"]


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


def parse_yaml(text: str, source: str) -> Any:
  """Parses YAML text; ``source`` (a file name) prefixes the :class:`ClusterSpecError`."""
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


_TOP_KEYS = ("name", "gpus", "subclusters", "links", "transfer_fee_per_gb")
_GPU_KEYS = ("name", "tflops", "memory_gb", "mem_bandwidth_gbs", "intra_host_gbps")
_SUB_KEYS = ("name", "gpu", "hosts", "devices_per_host", "intra_host_gbps", "nics",
             "price_per_gpu_hour", "zone", "host_memory_gbps", "region")
_NIC_KEYS = ("name", "kind", "gbps", "network", "latency_us")
_LINK_KEYS = ("between", "gbps", "latency_us", "kind", "gbps_by_size")
_DEFAULT_GPU_INTRA_HOST_GBPS = 512  # PCIe Gen4 x16, 64 GB/s


def cluster_fields(data: Any) -> tuple[tuple[SubCluster, ...], tuple[LinkOverride, ...],
                                       tuple[GPUType, ...], str | None, TransferFees]:
  """Checks a parsed cluster file; returns ``(subclusters, links, gpus, name, transfer_fees)``
  for ``Cluster``."""
  check_keys(data, "cluster", _TOP_KEYS, ("subclusters",))
  name = data.get("name")
  if name is not None:
    check_str(name, "name")
  gpus: list[GPUType] = []
  for i, g in enumerate(check_list(or_empty(data.get("gpus")), "gpus")):
    w = f"gpus[{i}]"
    check_keys(g, w, _GPU_KEYS, _GPU_KEYS[:4])
    check_str(g["name"], f"{w}.name")
    if g["name"].lower() in [x.name.lower() for x in gpus]:
      raise ClusterSpecError(f"{w}.name: duplicate GPU {g['name']!r}")
    vals = [check_pos_number(g["tflops"], f"{w}.tflops"),
            check_physical(g["memory_gb"], f"{w}.memory_gb", MEMORY_GB_BOUNDS, "GiB"),
            check_physical(g["mem_bandwidth_gbs"], f"{w}.mem_bandwidth_gbs", GBPS_BOUNDS,
                           "GB/s")]
    intra = check_physical(g.get("intra_host_gbps", _DEFAULT_GPU_INTRA_HOST_GBPS),
                           f"{w}.intra_host_gbps", GBPS_BOUNDS, "Gbit/s")
    gpus.append(GPUType.from_units(g["name"], *vals, intra))
  subs_raw = check_list(data["subclusters"], "subclusters")
  if not subs_raw:
    raise ClusterSpecError("subclusters: expected a non-empty list of subclusters")
  subs, seen = [], {}
  for i, s in enumerate(subs_raw):
    w = f"subclusters[{i}]"
    check_keys(s, w, _SUB_KEYS, ("name", "gpu", "hosts", "devices_per_host"))
    check_str(s["name"], f"{w}.name")
    if s["name"] in seen:
      raise ClusterSpecError(f"{w}.name: duplicate subcluster name {s['name']!r} "
                             f"(also subclusters[{seen[s['name']]}])")
    seen[s["name"]] = i
    check_str(s["gpu"], f"{w}.gpu")
    gpu = lookup_gpu(s["gpu"], gpus, where=f"{w}.gpu")
    intra = s.get("intra_host_gbps")
    if intra is not None:
      intra = check_physical(intra, f"{w}.intra_host_gbps", GBPS_BOUNDS, "Gbit/s") * GBPS
    hosts = check_count(s["hosts"], f"{w}.hosts", MAX_HOSTS, "hosts per subcluster")
    per_host = check_count(s["devices_per_host"], f"{w}.devices_per_host",
                           MAX_DEVICES_PER_HOST, "devices per host")
    price = s.get("price_per_gpu_hour")
    if price is not None:
      price = check_number(price, f"{w}.price_per_gpu_hour", minimum=0.0)
    host_memory = s.get("host_memory_gbps")
    if host_memory is not None:
      host_memory = check_physical(host_memory, f"{w}.host_memory_gbps", GBPS_BOUNDS,
                                   "Gbit/s") * GBPS
    zone = s.get("zone")
    if zone is not None:
      check_str(zone, f"{w}.zone")
      if zone in seen:
        raise ClusterSpecError(f"{w}.zone: {zone!r} is also a subcluster name; zones and "
                               "subclusters need different names (links may name either)")
    region = s.get("region")
    if region is not None:
      check_str(region, f"{w}.region")
      if zone is None:
        raise ClusterSpecError(f"{w}.region: {region!r} needs a zone; give the subcluster a "
                               "zone label too (zone: ...), the zone it sits in inside the region")
    subs.append(SubCluster(s["name"], gpu, hosts, per_host,
                           _nics_from_list(or_empty(s.get("nics")), f"{w}.nics"), intra,
                           price_per_gpu_hour=price, zone=zone,
                           host_memory_bytes_per_s=host_memory, region=region))
  links = []
  for i, ln in enumerate(check_list(or_empty(data.get("links")), "links")):
    w = f"links[{i}]"
    check_keys(ln, w, _LINK_KEYS, ("between",))
    between = ln["between"]
    if not (isinstance(between, list) and len(between) == 2):
      raise ClusterSpecError(f"{w}.between: expected a list of two subcluster names, "
                             f"got {between!r}")
    zones = {sub.zone for sub in subs if sub.zone is not None}
    for x in between:
      if x not in seen and x not in zones:
        known = list(seen) + sorted(zones)
        raise ClusterSpecError(f"{w}.between: unknown subcluster or zone {x!r}"
                               f"{did_you_mean(str(x), known)} (known: {', '.join(known)})")
    lat = ln.get("latency_us")
    if lat is not None:
      lat = check_number(lat, f"{w}.latency_us", minimum=0.0) / 1e6
    kind = check_kind(ln["kind"], f"{w}.kind") if "kind" in ln else None
    curve = _curve(ln.get("gbps_by_size"), f"{w}.gbps_by_size")
    if "gbps" in ln:
      gbps = check_physical(ln["gbps"], f"{w}.gbps", GBPS_BOUNDS, "Gbit/s")
    elif curve is not None:   # where no message size is known: the largest message's
      gbps = curve.largest_bytes_per_s / GBPS
    else:
      raise ClusterSpecError(f"{w}: give gbps (the link's bandwidth) or gbps_by_size "
                             "([[bytes, gbps], ...], the bandwidth by message size)")
    links.append(LinkOverride(tuple(between), gbps, lat, kind, curve))
  return tuple(subs), tuple(links), tuple(gpus), name, _fees(data.get("transfer_fee_per_gb"))


def _curve(points: Any, where: str) -> BandwidthCurve | None:
  """A ``gbps_by_size`` list: ``[[bytes, gbps], ...]``, sizes strictly increasing."""
  if points is None:
    return None
  if not isinstance(points, list) or not points or not all(
      isinstance(p, list) and len(p) == 2 for p in points):
    raise BandwidthCurveError(f"{where}: expected a non-empty list of [bytes, gbps] pairs, "
                              f"got {points!r}")
  try:
    for i, (b, g) in enumerate(points):
      check_number(b, f"{where}[{i}][0] (bytes)", minimum=1.0)
      check_physical(g, f"{where}[{i}][1] (gbps)", GBPS_BOUNDS, "Gbit/s")
    return BandwidthCurve.from_gbps(points)
  except BandwidthCurveError as e:
    raise BandwidthCurveError(f"{where}: {e}") from None
  except ClusterSpecError as e:
    raise BandwidthCurveError(str(e)) from None


def _fees(raw: Any) -> TransferFees:
  """The ``transfer_fee_per_gb`` mapping: a fee per GB for any of the link classes, the
  others keep Sailor's defaults (:class:`~harpjax.cluster.TransferFees`)."""
  if raw is None:
    return TransferFees()
  w = "transfer_fee_per_gb"
  check_keys(raw, w, LINK_CLASSES, ())
  return TransferFees(**{c: check_number(v, f"{w}.{c}", minimum=0.0) for c, v in raw.items()})


def _nics_from_list(raw: Any, where: str) -> tuple[NIC, ...]:
  nics: list[NIC] = []
  for j, n in enumerate(check_list(raw, where)):
    w = f"{where}[{j}]"
    check_keys(n, w, _NIC_KEYS, ("name", "kind", "gbps", "network"))
    check_str(n["name"], f"{w}.name")
    if n["name"] in [x.name for x in nics]:
      raise ClusterSpecError(f"{w}.name: duplicate NIC name {n['name']!r}")
    check_str(n["network"], f"{w}.network")
    lat = n.get("latency_us")
    if lat is not None:
      lat = check_number(lat, f"{w}.latency_us", minimum=0.0) / 1e6
    nics.append(NIC(n["name"], check_kind(n["kind"], f"{w}.kind"),
                    check_physical(n["gbps"], f"{w}.gbps", GBPS_BOUNDS, "Gbit/s"),
                    n["network"], lat))
  return tuple(nics)


def dump_yaml(d: dict) -> str:
  """YAML text of a ``Cluster.to_dict()``: NICs, GPUs and links in flow style, one per line."""
  for key in ("gpus", "links"):
    if key in d:
      d[key] = [_FlowDict(x) for x in d[key]]
  for sub in d["subclusters"]:
    if "nics" in sub:
      sub["nics"] = [_FlowDict(x) for x in sub["nics"]]
  return yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
