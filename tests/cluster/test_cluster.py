"""Tests of harpjax.cluster: catalog, YAML, links, submeshes, devices, allocation, errors."""

import copy
import itertools
import math
import os
import pathlib
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harpjax.cluster import (
    GPU_CATALOG, INTRA_HOST_LATENCY_S, NIC, NIC_LATENCY_S, Cluster, GPUType, Link, LinkOverride,
    SubCluster, lookup_gpu)
from harpjax.errors import ClusterSpecError, NotEnoughDevicesError, PlanError, UnknownGPUError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GIB = 2**30

EXAMPLE = """
subclusters:
  - name: a100
    gpu: A100-40G
    hosts: 2
    devices_per_host: 2
    intra_host_gbps: 2400
    nics:
      - {name: ib0, kind: rdma, gbps: 200, network: fabric-a}
      - {name: eth0, kind: ethernet, gbps: 10, network: dc}
  - name: v100
    gpu: V100-32G
    hosts: 1
    devices_per_host: 4
    nics:
      - {name: eth0, kind: ethernet, gbps: 10, network: dc}
"""
OVERRIDE = "links:\n  - {between: [a100, v100], gbps: 5, latency_us: 100}\n"


@pytest.fixture
def example():
  return Cluster.from_yaml(EXAMPLE)


# ------------------------------------------------------------------------------------ catalog


def test_catalog_has_required_gpus_with_spec_sheet_numbers():
  for name in ("A100-40G", "A100-80G", "V100-16G", "V100-32G", "H100-80G", "H200", "L40S",
               "A10G", "T4", "RTX-4090"):
    g = GPU_CATALOG[name]
    assert g.name == name and g.peak_flops > 1e13 and g.memory_bytes >= 16 * GIB
  expect = {  # name: (TFLOP/s, GiB, memory GB/s, intra-host GB/s)
      "A100-40G": (312, 40, 1555, 600), "A100-80G": (312, 80, 2039, 600),
      "V100-16G": (125, 16, 900, 300), "V100-32G": (125, 32, 900, 300),
      "H100-80G": (989, 80, 3350, 900), "H200": (989, 141, 4800, 900),
      "L40S": (362, 48, 864, 64), "A10G": (70, 24, 600, 64), "T4": (65, 16, 320, 32),
      "RTX-4090": (165.2, 24, 1008, 64)}
  for name, (tflops, gib, mem_gbs, intra_gbs) in expect.items():
    g = GPU_CATALOG[name]
    assert g.peak_flops == pytest.approx(tflops * 1e12)
    assert g.memory_bytes == gib * GIB
    assert g.mem_bandwidth_bytes_per_s == pytest.approx(mem_gbs * 1e9)
    assert g.intra_host_bytes_per_s == pytest.approx(intra_gbs * 1e9)


def test_lookup_is_case_insensitive_with_aliases():
  assert lookup_gpu("a100-40g") is GPU_CATALOG["A100-40G"]
  assert lookup_gpu("A100") is GPU_CATALOG["A100-40G"]
  assert lookup_gpu("v100") is GPU_CATALOG["V100-32G"]
  assert lookup_gpu("H100") is GPU_CATALOG["H100-80G"]
  assert lookup_gpu("rtx 4090") is GPU_CATALOG["RTX-4090"]
  mine = GPUType.from_units("A100", 100, 10, 100, 100)
  assert lookup_gpu("a100", [mine]) is mine  # user types shadow catalog and aliases
  with pytest.raises(UnknownGPUError, match=r"unknown GPU 'V200'.*did you mean 'V100'"):
    lookup_gpu("V200")


def test_gpu_type_units():
  g = GPUType.from_units("X", tflops=100, memory_gb=24, mem_bandwidth_gbs=500, intra_host_gbps=512)
  assert (g.peak_flops, g.memory_bytes) == (1e14, 24 * GIB)
  assert (g.mem_bandwidth_bytes_per_s, g.intra_host_bytes_per_s) == (5e11, 64e9)
  assert g.to_dict() == {"name": "X", "tflops": 100, "memory_gb": 24, "mem_bandwidth_gbs": 500,
                         "intra_host_gbps": 512}
  with pytest.raises(ClusterSpecError, match="peak_flops"):
    GPUType("Y", -1.0, GIB, 1e9, 1e9)


# ------------------------------------------------------------------------------------ YAML


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_and_round_trip(path):
  c = Cluster.load(path)
  text = c.to_yaml()
  assert Cluster.from_yaml(text) == c
  assert Cluster.from_yaml(text).to_yaml() == text


def test_example_config_contents():
  case = Cluster.load(CONFIGS / "case_study.yaml")
  assert [(s.name, s.gpu.name, s.shape) for s in case.subclusters] == [
      ("v100", "V100-32G", (1, 2)), ("a100", "A100-40G", (2, 2))]
  assert case.intra_subcluster_link("a100").gbps == pytest.approx(200)
  assert case.inter_subcluster_link("v100", "a100").gbps == pytest.approx(5)
  share = 2 * 125e12 / case.total_peak_flops  # 16.7%; the paper's Table 1 says "[16.8%]"
  assert share == pytest.approx(0.168, abs=0.002)
  h64 = Cluster.load(CONFIGS / "hetero_64.yaml")
  assert h64.num_devices == 64 and h64.device_offsets == (0, 32, 64)
  assert h64.inter_subcluster_link("a100", "v100").gbps == pytest.approx(5)
  assert h64.intra_subcluster_link("a100").gbps == pytest.approx(200)
  demo = Cluster.load(CONFIGS / "demo_local.yaml")
  assert demo.num_devices == 8 and demo.names == ("v100", "a100")
  link = demo.inter_subcluster_link("v100", "a100")
  assert link.overridden and link.gbps == pytest.approx(5) and link.kind == "ethernet"
  three = Cluster.load(CONFIGS / "three_clusters.yaml")
  assert [s.gpu.name for s in three.subclusters] == ["V100-16G", "V100-32G", "A100-40G"]
  assert three.inter_subcluster_link("v100", "v100e").gbps == pytest.approx(200)
  assert three.inter_subcluster_link("v100e", "a100").gbps == pytest.approx(5)
  assert three.inter_subcluster_link("v100", "a100").gbps == pytest.approx(5)


def test_round_trip_dict_file_and_user_gpus(tmp_path):
  data = {
      "name": "mixed",
      "gpus": [{"name": "V100e", "tflops": 70.3, "memory_gb": 31.5, "mem_bandwidth_gbs": 800,
                "intra_host_gbps": 1200}],
      "subclusters": [
          {"name": "a", "gpu": "V100e", "hosts": 2, "devices_per_host": 3, "intra_host_gbps": 100,
           "nics": [{"name": "ib0", "kind": "rdma", "gbps": 100, "network": "f"},
                    {"name": "eth0", "kind": "ethernet", "gbps": 2.5, "network": "dc",
                     "latency_us": 30}]},
          {"name": "b", "gpu": "T4", "hosts": 1, "devices_per_host": 1,
           "nics": [{"name": "eth0", "kind": "ethernet", "gbps": 10, "network": "dc"}]}],
      "links": [{"between": ["a", "b"], "gbps": 1.5, "latency_us": 120, "kind": "ethernet"},
                {"between": ["a", "a"], "gbps": 50}],
  }
  c = Cluster.from_dict(data)
  assert c.to_dict() == data
  c.save(tmp_path / "c.yaml")
  assert Cluster.load(tmp_path / "c.yaml") == c
  assert Cluster.from_yaml(str(tmp_path / "c.yaml")) == c
  assert Cluster.from_yaml(c.to_yaml()) == c
  assert c.subcluster("a").nics[1].latency_s == pytest.approx(30e-6)


def test_cluster_is_a_hashable_picklable_value(example):
  assert pickle.loads(pickle.dumps(example)) == example
  assert copy.deepcopy(example).link_between_devices(1, 2) == example.link_between_devices(1, 2)
  assert hash(Cluster.from_yaml(EXAMPLE)) == hash(example)
  assert example != Cluster.from_yaml(EXAMPLE + OVERRIDE)
  v100_nics = "    nics:\n      - {name: eth0, kind: ethernet, gbps: 10, network: dc}\n"
  assert EXAMPLE.endswith(v100_nics)
  empty_lists = Cluster.from_yaml(EXAMPLE.replace(v100_nics, "    nics:\n") +
                                  "gpus:\nlinks:\n  - {between: [a100, v100], gbps: 1}\n")
  assert empty_lists.subcluster("v100").nics == () and empty_lists.gpus == ()
  assert empty_lists.inter_subcluster_link("a100", "v100").src_nic is None


def test_python_built_cluster_round_trips_custom_gpu():
  gpu = GPUType.from_units("Custom", 123.4, 20, 700, 256)
  c = Cluster((SubCluster("x", gpu, 1, 2), SubCluster("y", "A100", 1, 2)),
              links=(LinkOverride(("x", "y"), 5.0),))
  assert c.gpus == (gpu,)
  back = Cluster.from_yaml(c.to_yaml())
  assert back == c and back.subcluster("x").gpu == gpu


def test_yaml_is_readable():
  text = Cluster.from_yaml(EXAMPLE + OVERRIDE).to_yaml()
  assert "- {name: ib0, kind: rdma, gbps: 200, network: fabric-a}" in text
  assert "- {between: [a100, v100], gbps: 5, latency_us: 100}" in text
  assert "intra_host_gbps: 2400" in text


# ------------------------------------------------------------------------------------ links


def test_link_choice_rdma_inside_ethernet_across(example):
  a0, a1, v0 = example.host("a100-0"), example.host("a100-1"), example.host("v100-0")
  inside = example.link_between_hosts(a0, a1)
  assert inside.kind == "rdma" and inside.src_nic.name == "ib0" and inside.dst_nic.name == "ib0"
  assert inside.bandwidth_bytes_per_s == pytest.approx(200e9 / 8)
  assert inside.latency_s == NIC_LATENCY_S["rdma"] == 5e-6
  across = example.link_between_hosts("a100-1", "v100-0")
  assert across.kind == "ethernet" and across.src_nic.network == "dc" and not across.overridden
  assert across.bandwidth_bytes_per_s == pytest.approx(10e9 / 8)
  assert across.latency_s == NIC_LATENCY_S["ethernet"] == 50e-6
  assert example.link_between_hosts(v0, v0).kind == "intra_host"
  assert example.intra_subcluster_link("a100") == inside
  assert example.inter_subcluster_link("v100", "a100") == example.link_between_hosts(v0, a0)


def test_link_between_devices(example):
  same_host = example.link_between_devices(0, 1)
  assert same_host.kind == "intra_host"
  assert same_host.bandwidth_bytes_per_s == pytest.approx(2400e9 / 8)  # intra_host_gbps
  assert same_host.latency_s == INTRA_HOST_LATENCY_S
  assert example.link_between_devices(4, 7).bandwidth_bytes_per_s == pytest.approx(300e9)
  assert example.link_between_devices(1, 2).kind == "rdma"
  assert example.link_between_devices(3, 5).kind == "ethernet"
  assert example.link_between_devices(2, 2).transfer_time_s(1e9) == 0.0
  assert example.intra_subcluster_link("v100").kind == "intra_host"  # single-host subcluster


def test_fastest_shared_nic_pair_uses_slower_nic():
  c = Cluster.from_dict({"subclusters": [
      {"name": "a", "gpu": "A100", "hosts": 1, "devices_per_host": 1,
       "nics": [{"name": "e0", "kind": "ethernet", "gbps": 100, "network": "n1"},
                {"name": "e1", "kind": "ethernet", "gbps": 25, "network": "n2"}]},
      {"name": "b", "gpu": "V100", "hosts": 1, "devices_per_host": 1,
       "nics": [{"name": "e0", "kind": "ethernet", "gbps": 10, "network": "n1"},
                {"name": "r0", "kind": "roce", "gbps": 40, "network": "n2"}]}]})
  link = c.inter_subcluster_link("a", "b")
  assert (link.src_nic.name, link.dst_nic.name) == ("e1", "r0")  # min(25, 40) > min(100, 10)
  assert link.gbps == pytest.approx(25) and link.latency_s == 50e-6 and link.kind == "ethernet"
  back = c.inter_subcluster_link("b", "a")
  assert (back.src_nic.name, back.dst_nic.name) == ("r0", "e1")


def test_overrides_and_latency(example):
  c = Cluster.from_yaml(EXAMPLE + OVERRIDE + "  - {between: [a100, a100], gbps: 100}\n")
  across = c.link_between_hosts("v100-0", "a100-1")
  assert across.overridden and across.gbps == pytest.approx(5) and across.latency_s == 100e-6
  assert across.src_nic.name == "eth0"  # the transport still knows which NIC to use
  assert across.transfer_time_s(0) == pytest.approx(100e-6)
  assert across.transfer_time_s(625e6) == pytest.approx(100e-6 + 1.0)  # 5 Gbps = 625 MB/s
  inside = c.intra_subcluster_link("a100")
  assert inside.overridden and inside.gbps == pytest.approx(100)
  assert inside.latency_s == 5e-6 and inside.kind == "rdma"  # from the NIC pair it replaces
  assert c.link_between_devices(0, 1).kind == "intra_host"  # same host: never overridden
  typed = Cluster.from_yaml(EXAMPLE + "links:\n  - {between: [v100, a100], gbps: 1, kind: rdma}\n")
  assert typed.inter_subcluster_link("a100", "v100").latency_s == 5e-6
  assert typed.inter_subcluster_link("a100", "v100").kind == "rdma"


def test_link_transfer_time():
  link = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-3)
  assert link.transfer_time_s(0) == 1e-3
  assert link.transfer_time_s(2e9) == pytest.approx(2.001)
  assert NIC("e", "ethernet", 8, "n").bandwidth_bytes_per_s == 1e9


def test_no_shared_network():
  base = ("subclusters:\n"
          "  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
          " nics: [{name: e, kind: ethernet, gbps: 1, network: x}]}\n"
          "  - {name: b, gpu: V100, hosts: 1, devices_per_host: 1,"
          " nics: [{name: e, kind: ethernet, gbps: 1, network: y}]}\n")
  with pytest.raises(ClusterSpecError, match=r"subclusters 'a' and 'b' share no network"):
    Cluster.from_yaml(base)
  ok = Cluster.from_yaml(base + "links:\n  - {between: [b, a], gbps: 2}\n")
  link = ok.inter_subcluster_link("a", "b")
  assert link.src_nic is None and link.kind == "ethernet" and link.latency_s == 50e-6
  # Non-adjacent pairs are checked when asked for.
  c = Cluster.simple([("a", "A100", 1, 1), ("b", "V100", 1, 1)])
  c3 = Cluster((c.subclusters[0], c.subclusters[1],
                SubCluster("c", "T4", 1, 1, nics=(NIC("e", "ethernet", 1, "other"),))),
               links=(LinkOverride(("b", "c"), 1),))
  with pytest.raises(ClusterSpecError, match="'a' and 'c' share no network"):
    c3.inter_subcluster_link("a", "c")
  with pytest.raises(ClusterSpecError, match="share no network"):
    c3.reordered(["a", "c", "b"])


# ------------------------------------------------------------------------------------ devices


def test_submesh_shapes():
  sub = SubCluster("s", "A100", 4, 8)
  assert sub.submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)]
  assert sub.submesh_shapes(all_sizes=True) == [(1, m) for m in range(1, 9)] + [
      (2, 8), (3, 8), (4, 8)]
  # Widths form a divisibility chain (three (1, 4) would not pack on two hosts of 6).
  assert SubCluster("s", "A100", 2, 6).submesh_shapes() == [(1, 1), (1, 2), (1, 6), (2, 6)]
  assert SubCluster("s", "A100", 1, 12).submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 12)]
  assert SubCluster("s", "A100", 1, 3).submesh_shapes() == [(1, 1), (1, 3)]
  for n_hosts, per_host in itertools.product((1, 2, 3), range(1, 13)):
    shapes = SubCluster("s", "A100", n_hosts, per_host).submesh_shapes()
    widths = sorted({m for n, m in shapes if n == 1})
    assert widths[-1] == per_host and all(b % a == 0 for a, b in zip(widths, widths[1:]))
  assert SubCluster("s", "A100", 3, 1).submesh_shapes() == [(1, 1), (2, 1), (3, 1)]
  assert SubCluster("s", "A100", 1, 2).submesh_shapes(all_sizes=True) == [(1, 1), (1, 2)]


def test_offsets_and_device_info(example):
  assert example.num_devices == 8
  assert example.device_offsets == (0, 4, 8)
  assert example.devices_of("a100") == range(0, 4)
  assert example.devices_of("v100") == range(4, 8)
  assert example.device_info(0) == ("a100", 0, 0)
  assert example.device_info(3) == ("a100", 1, 1)
  assert example.device_info(6) == ("v100", 0, 2)
  assert [h.name for h in example.hosts] == ["a100-0", "a100-1", "v100-0"]
  assert example.devices_of_host("a100-1") == range(2, 4)
  assert example.host_of_device(5).name == "v100-0"
  assert example.peak_flops_of_device(0) == 312e12
  assert example.peak_flops_of_device(7) == 125e12
  assert example.total_peak_flops == pytest.approx(4 * 312e12 + 4 * 125e12)
  a100 = example.subcluster("a100")
  assert a100.peak_flops == 312e12 and a100.total_peak_flops == 4 * 312e12
  assert a100.memory_bytes == 40 * GIB and a100.num_devices == 4
  with pytest.raises(PlanError, match="out of range"):
    example.device_info(8)
  with pytest.raises(ClusterSpecError, match="unknown subcluster 'a10'"):
    example.devices_of("a10")


def test_three_subcluster_offsets():
  c = Cluster.load(CONFIGS / "three_clusters.yaml")
  assert c.device_offsets == (0, 8, 10, 12)
  assert [c.device_info(i).subcluster for i in (7, 8, 9, 10, 11)] == [
      "v100", "v100e", "v100e", "a100", "a100"]


def test_local_devices_with_fake_cpu_devices():
  import jax
  assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 fake CPU devices"
  demo = Cluster.load(CONFIGS / "demo_local.yaml")
  assert demo.local_devices() == tuple(jax.devices()[:8])
  small = Cluster.simple([("a", "A100", 1, 2), ("b", "V100", 1, 2)])
  fake = ["d0", "d1", "d2", "d3", "d4"]
  assert small.local_devices(fake) == ("d0", "d1", "d2", "d3")
  big = Cluster.load(CONFIGS / "three_clusters.yaml")
  with pytest.raises(NotEnoughDevicesError,
                     match=r"needs 12 devices.*only 8 local.*"
                           r"XLA_FLAGS=--xla_force_host_platform_device_count=12"):
    big.local_devices(jax.devices()[:8])


# ------------------------------------------------------------------------------------ allocation


def _check_allocation(cluster, requests, result):
  assert len(result) == len(requests)
  flat = [d for devs in result for d in devs]
  assert len(flat) == len(set(flat)), "submeshes overlap"
  for (name, (n, m)), devs in zip(requests, result):
    assert len(devs) == n * m and set(devs) <= set(cluster.devices_of(name))
    hosts = [cluster.device_info(d).host for d in devs]
    assert len(set(hosts)) == n
    if n > 1 or m == cluster.subcluster(name).devices_per_host:
      assert sorted(devs) == list(devs)
      for h in set(hosts):
        assert hosts.count(h) == m


def test_allocate_in_pipeline_order(example):
  req = [("a100", (1, 1)), ("a100", (1, 1)), ("a100", (1, 2)), ("v100", (1, 4))]
  assert example.allocate_submeshes(req) == [(0,), (1,), (2, 3), (4, 5, 6, 7)]
  whole = [("a100", (2, 2)), ("v100", (1, 2)), ("v100", (1, 2))]
  assert example.allocate_submeshes(whole) == [(0, 1, 2, 3), (4, 5), (6, 7)]
  _check_allocation(example, req, example.allocate_submeshes(req))


def test_allocate_packs_larger_first_and_searches():
  c = Cluster.simple([("a", "A100", 2, 4)])
  req = [("a", (1, 1)), ("a", (1, 2)), ("a", (1, 2)), ("a", (1, 3))]  # in-order first-fit fails
  out = c.allocate_submeshes(req)
  _check_allocation(c, req, out)
  ten = Cluster.simple([("a", "A100", 2, 10)])
  req = [("a", (1, s)) for s in (4, 4, 3, 3, 3, 3)]  # first-fit decreasing fails, 4+3+3 twice fits
  _check_allocation(ten, req, ten.allocate_submeshes(req))
  mixed = Cluster.simple([("a", "A100", 3, 4), ("b", "V100", 1, 8)])
  req = [("b", (1, 4)), ("a", (1, 2)), ("b", (1, 2)), ("a", (2, 4)), ("a", (1, 2)),
         ("b", (1, 2))]
  out = mixed.allocate_submeshes(req)
  _check_allocation(mixed, req, out)
  assert out[1] == (0, 1) and out[4] == (2, 3) and out[3] == tuple(range(4, 12))


def test_allocate_failures(example):
  with pytest.raises(PlanError, match=r"stage 2: submesh \(1, 2\) does not fit on subcluster "
                                      r"'a100'.*3 of its 4 devices.*1 left"):
    example.allocate_submeshes([("a100", (1, 2)), ("a100", (1, 1)), ("a100", (1, 2))])
  c = Cluster.simple([("a", "A100", 2, 4)])
  with pytest.raises(PlanError, match=r"stage 2: submesh \(1, 2\) does not fit.*free"):
    c.allocate_submeshes([("a", (1, 3)), ("a", (1, 3)), ("a", (1, 2))])
  with pytest.raises(PlanError, match=r"stage 1: submesh \(2, 4\) does not fit.*4 left"):
    c.allocate_submeshes([("a", (1, 4)), ("a", (2, 4))])
  four = Cluster.simple([("a", "A100", 4, 4)])
  with pytest.raises(PlanError, match=r"stage 2: submesh \(1, 2\) does not fit.*2 hosts go to "
                                      r"whole-host stages.*\[1, 1\] devices free"):
    four.allocate_submeshes([("a", (1, 3)), ("a", (1, 3)), ("a", (1, 2)), ("a", (2, 4))])
  with pytest.raises(PlanError, match=r"stage 0: submesh \(2, 2\) is not a submesh"):
    c.allocate_submeshes([("a", (2, 2))])
  with pytest.raises(PlanError, match=r"stage 1: submesh \(1, 5\) is not a submesh"):
    c.allocate_submeshes([("a", (1, 1)), ("a", (1, 5))])
  with pytest.raises(PlanError, match=r"stage 0: submesh \(3, 4\) is not a submesh"):
    c.allocate_submeshes([("a", (3, 4))])
  with pytest.raises(PlanError, match="stage 0: unknown subcluster 'b'"):
    c.allocate_submeshes([("b", (1, 1))])


def _packing_exists(n_hosts, per_host, shapes):
  whole = sum(n for n, m in shapes if m == per_host)
  part = [m for n, m in shapes if m < per_host]
  if whole > n_hosts:
    return False
  loads = [0] * (n_hosts - whole)

  def place(k):  # every host for every single-host submesh, no cleverness
    if k == len(part):
      return True
    for b in range(len(loads)):
      if loads[b] + part[k] <= per_host:
        loads[b] += part[k]
        if place(k + 1):
          return True
        loads[b] -= part[k]
    return False

  return place(0)


@given(st.integers(1, 3), st.integers(1, 5), st.data())
def test_allocate_matches_brute_force(n_hosts, per_host, data):
  c = Cluster.simple([("s", "A100", n_hosts, per_host)])
  shapes = data.draw(st.lists(st.sampled_from(c.subcluster("s").submesh_shapes(all_sizes=True)),
                              min_size=1, max_size=5))
  req = [("s", shape) for shape in shapes]
  if _packing_exists(n_hosts, per_host, shapes):
    _check_allocation(c, req, c.allocate_submeshes(req))
  else:
    with pytest.raises(PlanError, match="stage"):
      c.allocate_submeshes(req)


@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_allocate_default_shapes_always_pack(n_hosts, per_host, data):
  c = Cluster.simple([("s", "A100", n_hosts, per_host)])
  shapes, free = [], n_hosts * per_host
  for shape in data.draw(st.lists(st.sampled_from(c.subcluster("s").submesh_shapes()),
                                  max_size=12)):
    if shape[0] * shape[1] <= free and (shape[1] < per_host or sum(
        n for n, m in shapes if m == per_host) + shape[0] <= n_hosts):
      shapes.append(shape)
      free -= shape[0] * shape[1]
  assert _packing_exists(n_hosts, per_host, shapes)  # divisibility chain: fits => packs
  req = [("s", s) for s in shapes]
  _check_allocation(c, req, c.allocate_submeshes(req))


# ------------------------------------------------------------------------------------ order


def test_ordered_by_memory_to_compute():
  c = Cluster.simple([("a100", "A100-40G", 1, 2), ("v100", "V100-32G", 1, 2),
                      ("t4", "T4", 1, 1), ("a100b", "A100-40G", 1, 1)])
  ordered = c.ordered_by_memory_to_compute()
  # GiB per TFLOP/s: V100-32G .256, T4 .246, A100-40G .128 (stable among the two A100s).
  assert ordered.names == ("v100", "t4", "a100", "a100b")
  assert ordered.device_offsets == (0, 2, 3, 5, 6)
  assert c.names == ("a100", "v100", "t4", "a100b")  # unchanged
  assert c.reordered(["t4", "a100", "a100b", "v100"]).names == ("t4", "a100", "a100b", "v100")
  assert ordered.reordered(c.names) == c
  with pytest.raises(ClusterSpecError, match="exactly once"):
    c.reordered(["a100", "v100"])


def test_simple_constructor():
  c = Cluster.simple([("a", "A100", 2, 4), ("b", "V100", 3, 2)], inter_gbps=1, intra_gbps=100)
  assert c.intra_subcluster_link("a").kind == "rdma"
  assert c.intra_subcluster_link("a").gbps == pytest.approx(100)
  assert c.inter_subcluster_link("a", "b").gbps == pytest.approx(1)
  assert c.inter_subcluster_link("a", "b").kind == "ethernet"
  assert c.num_devices == 14


# ------------------------------------------------------------------------------------ errors

_SUB = "  - {name: a, gpu: A100, hosts: 1, devices_per_host: 2}\n"
_MALFORMED = [
    ("subclusters:\n  - {name: a, gpu: V200, hosts: 1, devices_per_host: 1}\n", UnknownGPUError,
     r"subclusters\[0\]\.gpu: unknown GPU 'V200'.*known: A100-40G"),
    ("subclusters:\n" + _SUB + "  - {name: b, gpu: A100, devices_per_host: 1}\n",
     ClusterSpecError, r"subclusters\[1\]: missing field 'hosts'"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: two, devices_per_host: 1}\n",
     ClusterSpecError, r"subclusters\[0\]\.hosts: expected a positive integer, got 'two'"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 0, devices_per_host: 1}\n",
     ClusterSpecError, r"subclusters\[0\]\.hosts: expected a positive integer, got 0"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: true}\n",
     ClusterSpecError, r"subclusters\[0\]\.devices_per_host: expected a positive integer"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_hosts: 1}\n",
     ClusterSpecError, r"subclusters\[0\]: unknown key 'devices_per_hosts' "
                       r"\(did you mean 'devices_per_host'\?\)"),
    ("subclusters:\n" + _SUB + _SUB, ClusterSpecError,
     r"subclusters\[1\]\.name: duplicate subcluster name 'a'"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a, h100], gbps: 1}\n", ClusterSpecError,
     r"links\[0\]\.between: unknown subcluster or zone 'h100' \(known: a\)"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a], gbps: 1}\n", ClusterSpecError,
     r"links\[0\]\.between: expected a list of two"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a, a], gbps: '5'}\n", ClusterSpecError,
     r"links\[0\]\.gbps: expected a positive number, got '5'"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a, a], gbps: 5}\n"
     "  - {between: [a, a], gbps: 6}\n", ClusterSpecError, r"links\[1\]\.between: a second"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a, a], gbps: 5, latency: 3}\n",
     ClusterSpecError, r"links\[0\]: unknown key 'latency' \(did you mean 'latency_us'\?\)"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
     " nics: [{name: e, kind: rmda, gbps: 1, network: n}]}\n", ClusterSpecError,
     r"subclusters\[0\]\.nics\[0\]\.kind: unknown kind 'rmda' \(did you mean 'rdma'\?\)"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
     " nics: [{name: e, kind: rdma, gbps: 1}]}\n", ClusterSpecError,
     r"subclusters\[0\]\.nics\[0\]: missing field 'network'"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
     " nics: [{name: e, kind: rdma, gbps: -1, network: n}]}\n", ClusterSpecError,
     r"subclusters\[0\]\.nics\[0\]\.gbps: expected a positive number, got -1"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
     " intra_host_gbps: 1e3}\n", ClusterSpecError,
     r"subclusters\[0\]\.intra_host_gbps: expected a positive number, got '1e3' \(a string"),
    ("gpus:\n  - {name: X, tflops: 1, memory_gb: 1}\nsubclusters:\n" + _SUB, ClusterSpecError,
     r"gpus\[0\]: missing field 'mem_bandwidth_gbs'"),
    ("gpus:\n  - {name: X, tflops: 1, memory_gb: 1.0e-9, mem_bandwidth_gbs: 900}\n"
     "subclusters:\n" + _SUB, ClusterSpecError,
     r"gpus\[0\]\.memory_gb: 1e-09 GiB is not a physical value .*check the unit"),
    ("gpus:\n  - {name: X, tflops: 1, memory_gb: 80000000000, mem_bandwidth_gbs: 900}\n"
     "subclusters:\n" + _SUB, ClusterSpecError, r"gpus\[0\]\.memory_gb: 8e\+10 GiB is not"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 1, devices_per_host: 1,"
     " nics: [{name: e, kind: rdma, gbps: 100000000000, network: n}]}\n", ClusterSpecError,
     r"subclusters\[0\]\.nics\[0\]\.gbps: 1e\+11 Gbit/s is not a physical value"),
    ("subclusters:\n" + _SUB + "links:\n  - {between: [a, a], gbps: 1.0e-6}\n",
     ClusterSpecError, r"links\[0\]\.gbps: 1e-06 Gbit/s is not a physical value"),
    ("subclusters:\n" + _SUB + "colour: blue\n", ClusterSpecError,
     r"cluster: unknown key 'colour'"),
    ("subclusters: []\n", ClusterSpecError, r"subclusters: expected a non-empty list"),
    ("subclusters: {a: 1}\n", ClusterSpecError, r"subclusters: expected a list"),
    ("subclusters:\n  - a100\n", ClusterSpecError, r"subclusters\[0\]: expected a mapping"),
    ("- 1\n- 2\n", ClusterSpecError, r"cluster: expected a mapping"),
    ("links: []\n", ClusterSpecError, r"cluster: missing field 'subclusters'"),
    ("", ClusterSpecError, r"empty"),
    ("# only a comment\n", ClusterSpecError, r"empty"),
    ("subclusters:\n  - {name: a, gpu: A100, hosts: 2, devices_per_host: 1}\n", ClusterSpecError,
     r"the hosts of subcluster 'a' share no network.*links entry"),
    ("subclusters:\n  - {name: a, gpu: A100\n", ClusterSpecError, r"line \d+, column \d+"),
    ("subclusters:\n" + _SUB + "subclusters:\n" + _SUB, ClusterSpecError,
     r"line 3.*duplicate key 'subclusters'"),
]


@pytest.mark.parametrize("text,error,pattern", _MALFORMED)
def test_malformed_text(text, error, pattern):
  with pytest.raises(error, match=pattern) as info:
    Cluster.from_yaml(text)
  assert info.value.__cause__ is None or isinstance(info.value.__cause__, ClusterSpecError)


def test_malformed_file_names_file_and_line(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("subclusters:\n  - name: a\n    gpu: A100\n   hosts: 1\n")
  with pytest.raises(ClusterSpecError, match=r"bad\.yaml, line 4, column \d+: invalid YAML"):
    Cluster.load(bad)
  wrong = tmp_path / "wrong.yaml"
  wrong.write_text("subclusters:\n  - {name: a, gpu: V200, hosts: 1, devices_per_host: 1}\n")
  with pytest.raises(UnknownGPUError, match=r"wrong\.yaml: subclusters\[0\]\.gpu"):
    Cluster.from_yaml(wrong)
  empty = tmp_path / "empty.yaml"
  empty.write_text("")
  with pytest.raises(ClusterSpecError, match=r"empty\.yaml: the cluster file is empty"):
    Cluster.load(str(empty))
  with pytest.raises(ClusterSpecError, match=r"'missing\.yaml' does not exist"):
    Cluster.from_yaml("missing.yaml")
  latin = tmp_path / "latin.yaml"
  latin.write_bytes("# caf\u00e9\nsubclusters: []\n".encode("latin-1"))
  with pytest.raises(ClusterSpecError, match=r"latin\.yaml' is not UTF-8 text \(byte 5, line 1"):
    Cluster.load(latin)


def test_python_constructor_errors():
  with pytest.raises(ClusterSpecError, match=r"SubCluster 'x'\.num_hosts: expected a positive"):
    SubCluster("x", "A100", 0, 1)
  with pytest.raises(UnknownGPUError, match=r"SubCluster 'x'\.gpu: unknown GPU 'B200'"):
    SubCluster("x", "B200", 1, 1)
  with pytest.raises(ClusterSpecError, match="duplicate subcluster name 'x'"):
    Cluster((SubCluster("x", "A100", 1, 1), SubCluster("x", "A100", 1, 1)),
            links=(LinkOverride(("x", "x"), 1),))
  with pytest.raises(ClusterSpecError, match="duplicate NIC name 'e'"):
    SubCluster("x", "A100", 1, 1, nics=(NIC("e", "rdma", 1, "n"), NIC("e", "rdma", 1, "m")))
  with pytest.raises(ClusterSpecError, match=r"NIC 'e'\.kind: unknown kind 'wifi'"):
    NIC("e", "wifi", 1, "n")
  with pytest.raises(ClusterSpecError, match=r"between: unknown subcluster or zone 'y'"):
    Cluster((SubCluster("x", "A100", 1, 1),), links=(LinkOverride(("x", "y"), 1),))
  with pytest.raises(ClusterSpecError, match="differs from the GPU of that name"):
    Cluster((SubCluster("x", GPUType.from_units("A100-40G", 1, 1, 1, 1), 1, 1),))
  assert math.isinf(Cluster.simple([("x", "A100", 1, 2)]).link_between_devices(
      0, 0).bandwidth_bytes_per_s)
  assert os.environ.get("XLA_FLAGS")  # conftest ran


def test_prices_zones_and_links_between_zones():
  text = """
subclusters:
  - {name: a, gpu: A100-40G, hosts: 1, devices_per_host: 4, price_per_gpu_hour: 3.5,
     zone: east, nics: [{name: e, kind: ethernet, gbps: 100, network: dc}]}
  - {name: b, gpu: V100-32G, hosts: 2, devices_per_host: 4, price_per_gpu_hour: 2,
     zone: west, nics: [{name: e, kind: ethernet, gbps: 100, network: dc}]}
links:
  - {between: [east, west], gbps: 2}
"""
  c = Cluster.from_yaml(text)
  assert c.subcluster("a").price_per_gpu_hour == 3.5 and c.subcluster("b").zone == "west"
  assert c.inter_subcluster_link("a", "b").gbps == 2          # the zones' link
  assert c.intra_subcluster_link("b").gbps == 100             # not the zones' link
  assert Cluster.from_yaml(c.to_yaml()) == c
  with pytest.raises(ClusterSpecError, match="price_per_gpu_hour"):
    Cluster.from_yaml(text.replace("3.5", "-1"))
  with pytest.raises(ClusterSpecError, match="also a subcluster name"):
    Cluster.from_yaml(text.replace("zone: west", "zone: a"))


def test_host_memory_bandwidth_reaches_the_cost_tables():
  # host_memory_gbps on every subcluster: the automatic path's tables carry the offload
  # bandwidth (so the planner may keep a stage's optimizer state in host memory).
  from harpjax.compiler.profile import ProfileOptions, profile_step
  from harpjax.models import BUILTIN_MODELS
  text = """
subclusters:
  - {name: a, gpu: A100-40G, hosts: 1, devices_per_host: 2, host_memory_gbps: 200,
     nics: [{name: e, kind: ethernet, gbps: 100, network: dc}]}
  - {name: b, gpu: V100-32G, hosts: 1, devices_per_host: 2, host_memory_gbps: 100,
     nics: [{name: e, kind: ethernet, gbps: 100, network: dc}]}
"""
  c = Cluster.from_yaml(text)
  assert c.subcluster("a").host_memory_bytes_per_s == 25e9
  assert Cluster.from_yaml(c.to_yaml()) == c
  with pytest.raises(ClusterSpecError, match="host_memory_gbps"):
    Cluster.from_yaml(text.replace("200", "-3"))
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2)
  opts = ProfileOptions(progress=False, use_cache=False)
  res = profile_step(spec.step_fn, spec.args, c, num_microbatches=2, options=opts)
  assert res.tables.offload_bandwidth_bytes_per_s == (25e9, 12.5e9)
  res = profile_step(spec.step_fn, spec.args, Cluster.from_yaml(text.replace(
      ", host_memory_gbps: 100", "")), num_microbatches=2, options=opts)
  assert res.tables.offload_bandwidth_bytes_per_s is None
