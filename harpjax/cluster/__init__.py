"""The cluster model: GPU types, hosts, NICs, subclusters, links, submeshes and the YAML file.

Modules, bottom up: :mod:`~harpjax.cluster.packing` (submesh shapes and the one exact packer of
submeshes onto hosts), :mod:`~harpjax.cluster.hardware` (units, the GPU catalog, NICs, links,
hosts, subclusters), :mod:`~harpjax.cluster.yaml_file` (the file format) and
:mod:`~harpjax.cluster.topology` (:class:`Cluster`: ordered subclusters, links between any two
hosts, device numbering and allocation). This module is the package's public surface.
"""

from harpjax.cluster.hardware import (BandwidthCurve, BYTES_PER_GB, DeviceInfo, GBPS, GBPS_BOUNDS, GBS, GIB, GPU_ALIASES,
                                      GPU_CATALOG, GPUType, Host, INTRA_HOST_LATENCY_S, Link,
                                      LinkOverride, lookup_gpu, MAX_DEVICES,
                                      MAX_DEVICES_PER_HOST, MAX_HOSTS, MEMORY_GB_BOUNDS, NIC,
                                      NIC_LATENCY_S, SubCluster, TFLOPS, LINK_CLASSES,
                                      TransferFees)
from harpjax.cluster.packing import (allocate_submeshes, bin_pack, host_joins,
                                     is_divisibility_chain, pack_submeshes, paper_submeshes,
                                     place_stages, submesh_shapes)
from harpjax.cluster.topology import Cluster, load_cluster

__all__ = [
    "BandwidthCurve", "BYTES_PER_GB", "LINK_CLASSES", "TransferFees",
    "Cluster", "DeviceInfo", "GBPS", "GBPS_BOUNDS", "GBS", "GIB", "GPUType", "GPU_ALIASES",
    "GPU_CATALOG", "Host", "INTRA_HOST_LATENCY_S", "Link", "LinkOverride", "MAX_DEVICES",
    "MAX_DEVICES_PER_HOST", "MAX_HOSTS", "MEMORY_GB_BOUNDS", "NIC", "NIC_LATENCY_S", "SubCluster",
    "TFLOPS", "allocate_submeshes", "bin_pack", "host_joins", "is_divisibility_chain",
    "load_cluster", "lookup_gpu", "pack_submeshes", "paper_submeshes", "place_stages",
    "submesh_shapes",
]
