"""The cluster model: GPU types, hosts, NICs, subclusters, links, submeshes and the YAML file.

Modules, bottom up: :mod:`~harpjax.cluster.packing` (submesh shapes and the one exact packer of
submeshes onto hosts), :mod:`~harpjax.cluster.hardware` (units, the GPU catalog, NICs, links,
hosts, subclusters), :mod:`~harpjax.cluster.yaml_file` (the file format) and
:mod:`~harpjax.cluster.topology` (:class:`Cluster`: ordered subclusters, links between any two
hosts, device numbering and allocation). This module is the package's public surface.
"""

from harpjax.cluster.hardware import GBPS as GBPS
from harpjax.cluster.hardware import GBS as GBS
from harpjax.cluster.hardware import GIB as GIB
from harpjax.cluster.hardware import GPU_ALIASES as GPU_ALIASES
from harpjax.cluster.hardware import GPU_CATALOG as GPU_CATALOG
from harpjax.cluster.hardware import INTRA_HOST_LATENCY_S as INTRA_HOST_LATENCY_S
from harpjax.cluster.hardware import NIC as NIC
from harpjax.cluster.hardware import NIC_LATENCY_S as NIC_LATENCY_S
from harpjax.cluster.hardware import TFLOPS as TFLOPS
from harpjax.cluster.hardware import DeviceInfo as DeviceInfo
from harpjax.cluster.hardware import GPUType as GPUType
from harpjax.cluster.hardware import Host as Host
from harpjax.cluster.hardware import Link as Link
from harpjax.cluster.hardware import LinkOverride as LinkOverride
from harpjax.cluster.hardware import SubCluster as SubCluster
from harpjax.cluster.hardware import lookup_gpu as lookup_gpu
from harpjax.cluster.packing import allocate_submeshes as allocate_submeshes
from harpjax.cluster.packing import bin_pack as bin_pack
from harpjax.cluster.packing import is_divisibility_chain as is_divisibility_chain
from harpjax.cluster.packing import pack_submeshes as pack_submeshes
from harpjax.cluster.packing import paper_submeshes as paper_submeshes
from harpjax.cluster.packing import submesh_shapes as submesh_shapes
from harpjax.cluster.topology import Cluster as Cluster
from harpjax.cluster.topology import load_cluster as load_cluster

__all__ = [
    "Cluster", "DeviceInfo", "GBPS", "GBS", "GIB", "GPUType", "GPU_ALIASES", "GPU_CATALOG",
    "Host", "INTRA_HOST_LATENCY_S", "Link", "LinkOverride", "NIC", "NIC_LATENCY_S", "SubCluster",
    "TFLOPS", "allocate_submeshes", "bin_pack", "is_divisibility_chain", "load_cluster",
    "lookup_gpu", "pack_submeshes", "paper_submeshes", "submesh_shapes",
]
