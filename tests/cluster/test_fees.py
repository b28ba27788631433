"""Zones, regions and transfer fees in the cluster file (Sailor's link classes)."""

import pytest

from harpjax.cluster import Cluster, LINK_CLASSES, TransferFees
from harpjax.errors import ClusterSpecError

TWO_REGIONS = """
subclusters:
  - {name: a100a, gpu: A100-40G, hosts: 1, devices_per_host: 4, zone: us-central1-a,
     region: us-central1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: v100b, gpu: V100-16G, hosts: 1, devices_per_host: 4, zone: us-central1-b,
     region: us-central1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: a100w, gpu: A100-40G, hosts: 1, devices_per_host: 4, zone: us-west1-b,
     region: us-west1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: v100a, gpu: V100-16G, hosts: 1, devices_per_host: 4, zone: us-central1-a,
     region: us-central1, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
"""


def test_sailor_defaults_and_link_classes():
  c = Cluster.from_yaml(TWO_REGIONS)
  assert c.transfer_fees == TransferFees(0.0, 0.01, 0.02)
  assert c.link_class("a100a", "v100a") == "same_zone"
  assert c.link_class("a100a", "a100a") == "same_zone"
  assert c.link_class("a100a", "v100b") == "other_zone"
  assert c.link_class("v100b", "a100w") == "other_region"
  assert c.transfer_fee_per_byte("a100a", "v100b") == pytest.approx(0.01 / 1e9)
  assert c.transfer_fee_per_byte("a100w", "a100a") == pytest.approx(0.02 / 1e9)
  assert c.transfer_fee_per_byte("a100a", "v100a") == 0.0
  assert Cluster.from_yaml(c.to_yaml()) == c
  assert "transfer_fee_per_gb" not in c.to_dict()


def test_fee_override_round_trips():
  c = Cluster.from_yaml(TWO_REGIONS + "transfer_fee_per_gb: {other_region: 0.08}\n")
  assert c.transfer_fees.as_tuple() == (0.0, 0.01, 0.08)
  assert c.to_dict()["transfer_fee_per_gb"] == {"other_region": 0.08}
  assert Cluster.from_yaml(c.to_yaml()) == c


def test_without_zones_every_link_is_free():
  c = Cluster.simple([("a", "A100-40G", 1, 2), ("b", "V100-16G", 1, 2)])
  assert c.link_class("a", "b") == "same_zone"
  assert c.transfer_fee_per_byte("a", "b") == 0.0


def test_zones_without_regions_are_one_region():
  text = TWO_REGIONS.replace("region: us-central1, ", "").replace("region: us-west1, ", "")
  c = Cluster.from_yaml(text)
  assert c.link_class("v100b", "a100w") == "other_zone"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t + "transfer_fee_per_gb: {other_zon: 0.01}\n", "did you mean 'other_zone'"),
    (lambda t: t + "transfer_fee_per_gb: {other_zone: -1}\n",
     r"transfer_fee_per_gb.other_zone: expected a number >= 0"),
    (lambda t: t + "transfer_fee_per_gb: {other_zone: '0.01'}\n", "without quotes"),
    (lambda t: t.replace("zone: us-west1-b,\n", "\n", 1), r"needs a zone"),
    (lambda t: t.replace("region: us-west1", "region: us-central1").replace(
        "zone: us-west1-b", "zone: us-central1-b").replace(
        "zone: us-central1-b,\n     region: us-central1", "zone: us-central1-b,\n     region: x",
        1), "a zone lies in one region"),
    (lambda t: t.replace("region: us-west1, ", ""), "have a zone but no region"),
    (lambda t: t.replace("zone: us-west1-b,\n     region: us-west1, ", ""),
     "have no zone while"),
])
def test_named_errors(edit, match):
  with pytest.raises(ClusterSpecError, match=match):
    Cluster.from_yaml(edit(TWO_REGIONS))


def test_transfer_fees_type():
  with pytest.raises(ClusterSpecError, match="transfer_fee_per_gb.same_zone"):
    TransferFees(same_zone=float("nan"))
  with pytest.raises(ClusterSpecError, match="unknown link class"):
    TransferFees().per_gb("between_planets")
  assert LINK_CLASSES == ("same_zone", "other_zone", "other_region")
