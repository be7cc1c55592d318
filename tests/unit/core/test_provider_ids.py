"""The provider id of a node and the resource id of a billing export name the same machine (one rule, shared by the
collector and billing)."""

from __future__ import annotations

import pytest

from gpumeter.provider_ids import instance_id_of, provider_of, resource_key, resource_matches

AWS = "aws:///us-east-1a/i-0abc123def4567890"
GCP = "gce://my-project/us-central1-a/gke-gpu-pool-1234"
AZURE = ("azure:///subscriptions/0b1c/resourceGroups/MC_rg/providers/Microsoft.Compute/virtualMachineScaleSets/"
         "aks-gpu-vmss/virtualMachines/3")


@pytest.mark.parametrize("provider_id,resource_id", [
    (AWS, "i-0abc123def4567890"),  # CUR line_item_resource_id, AWS FOCUS ResourceId
    (AWS, "arn:aws:ec2:us-east-1:123456789012:instance/i-0abc123def4567890"),
    ("aws://us-east-1a/i-0abc123def4567890", "I-0ABC123DEF4567890"),
    (GCP, "//compute.googleapis.com/projects/my-project/zones/us-central1-a/instances/gke-gpu-pool-1234"),
    (GCP, "gke-gpu-pool-1234"),
    (AZURE, "/subscriptions/0b1c/resourcegroups/mc_rg/providers/microsoft.compute/virtualmachinescalesets/"
            "aks-gpu-vmss/virtualmachines/3"),
])
def test_a_billing_resource_id_names_the_machine_of_the_provider_id(provider_id, resource_id):
    assert resource_matches(provider_id, resource_id)
    assert resource_key(resource_id) == instance_id_of(provider_id).lower()


@pytest.mark.parametrize("provider_id,resource_id", [
    (AWS, "i-0abc123def4567891"),
    (AWS, "vol-0abc123def4567890"),
    (AWS, ""),
    ("", "i-0abc123def4567890"),
    # An Azure scale-set index alone, or the same index in another scale set, is not the machine.
    (AZURE, "3"),
    (AZURE, "/subscriptions/0b1c/resourcegroups/mc_rg/providers/microsoft.compute/virtualmachinescalesets/"
            "aks-cpu-vmss/virtualmachines/3"),
    # The same instance name in another GCP project or zone is another machine.
    (GCP, "//compute.googleapis.com/projects/other-project/zones/us-central1-a/instances/gke-gpu-pool-1234"),
    (GCP, "//compute.googleapis.com/projects/my-project/zones/us-central1-b/instances/gke-gpu-pool-1234"),
])
def test_other_resources_do_not_match(provider_id, resource_id):
    assert not resource_matches(provider_id, resource_id)


def test_the_collector_and_billing_share_one_owner_of_the_rule():
    from services.collector import nodefacts

    assert nodefacts.provider_of is provider_of
    assert (provider_of(AWS), provider_of(GCP), provider_of(AZURE), provider_of("kind://x/y")) == (
        "aws", "gcp", "azure", "custom")
