"""A node's pricing facts come from its own Node object (labels and providerID), the ConfigMap overriding.

The rules are pure (``node_facts_from_node``); the reader goes through the real Kubernetes client to our API
server peer, which serves the Node the way managed clusters label it. A spot node is priced as spot without anyone
writing a ConfigMap.
"""

from __future__ import annotations

import pytest

from gpumeter.provider_ids import instance_id_of, provider_of
from services.collector.main import _node_facts
from services.collector.nodefacts import (
    NodeFactOverrides,
    NodeReadError,
    node_facts_from_node,
    read_node_object,
)
from services.collector.podwatch import make_api_client
from simulator.apiserver import FakeApiServer, make_node_object
from simulator.scenario import load_scenario
from services.collector.simulation import SimulatedNode, node_facts, node_object

NO_OVERRIDES = NodeFactOverrides()


def node(labels: dict, provider_id: str = "") -> dict:
    return {"metadata": {"name": "n", "labels": labels}, "spec": {"providerID": provider_id} if provider_id else {}}


@pytest.mark.parametrize("labels,expected", [
    ({"karpenter.sh/capacity-type": "spot"}, "spot"),
    ({"karpenter.sh/capacity-type": "on-demand"}, "on_demand"),
    ({"karpenter.sh/capacity-type": "reserved"}, "committed"),
    ({"eks.amazonaws.com/capacityType": "SPOT"}, "spot"),
    ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, "on_demand"),
    ({"cloud.google.com/gke-spot": "true"}, "spot"),
    ({"cloud.google.com/gke-preemptible": "true"}, "spot"),
    ({"cloud.google.com/gke-spot": "false"}, "on_demand"),
    ({"kubernetes.azure.com/scalesetpriority": "spot"}, "spot"),
    ({}, "on_demand"),
])
def test_the_price_model_comes_from_the_capacity_type_labels(labels, expected):
    resolved = node_facts_from_node("c", "n", node(labels), NO_OVERRIDES)
    assert resolved.facts.price_model == expected and resolved.sources["price_model"] == "node"


@pytest.mark.parametrize("provider_id,provider,instance_id", [
    ("aws:///us-east-1a/i-0abc123def4567890", "aws", "i-0abc123def4567890"),
    ("gce://my-project/us-central1-a/gke-gpu-pool-1234", "gcp", "gke-gpu-pool-1234"),
    ("azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/vmss/"
     "virtualMachines/3", "azure", "3"),
    ("kind://docker/kind/kind-worker", "custom", "kind-worker"),
])
def test_the_provider_and_machine_id_come_from_the_provider_id(provider_id, provider, instance_id):
    resolved = node_facts_from_node("c", "n", node({}, provider_id), NO_OVERRIDES)
    assert (resolved.facts.cloud_provider, resolved.facts.provider_id) == (provider, provider_id)
    assert provider_of(provider_id) == provider and instance_id_of(provider_id) == instance_id


def test_topology_and_instance_type_labels_and_their_legacy_names():
    current = node({"topology.kubernetes.io/region": "us-east-1", "topology.kubernetes.io/zone": "us-east-1b",
                    "node.kubernetes.io/instance-type": "p5.48xlarge"})
    legacy = node({"failure-domain.beta.kubernetes.io/region": "us-east-1",
                   "failure-domain.beta.kubernetes.io/zone": "us-east-1b",
                   "beta.kubernetes.io/instance-type": "p5.48xlarge"})
    for obj in (current, legacy):
        facts = node_facts_from_node("c", "n", obj, NO_OVERRIDES).facts
        assert (facts.region, facts.zone, facts.instance_type) == ("us-east-1", "us-east-1b", "p5.48xlarge")


def test_a_configured_fact_overrides_the_nodes_and_says_so():
    obj = node({"topology.kubernetes.io/region": "us-east-1", "node.kubernetes.io/instance-type": "p5.48xlarge",
                "karpenter.sh/capacity-type": "on-demand"}, "aws:///us-east-1a/i-0abc")
    resolved = node_facts_from_node("c", "n", obj, NodeFactOverrides(price_model="committed", region="us-east-2"))
    facts = resolved.facts
    assert (facts.price_model, facts.region, facts.instance_type, facts.cloud_provider) == (
        "committed", "us-east-2", "p5.48xlarge", "aws")
    assert resolved.sources == {"cloud_provider": "node", "region": "config", "zone": "default",
                                "instance_type": "node", "price_model": "config", "provider_id": "node"}


def test_without_the_node_only_configuration_and_defaults_remain():
    resolved = node_facts_from_node("c", "n", None, NodeFactOverrides(instance_type="g6.xlarge"))
    facts = resolved.facts
    assert (facts.cloud_provider, facts.region, facts.instance_type, facts.price_model, facts.provider_id) == (
        "unknown", "unknown", "g6.xlarge", "on_demand", "")
    assert set(resolved.sources.values()) == {"config", "default"}


def test_every_scenario_nodes_facts_survive_the_node_object():
    # What the simulator serves and the collector derives back are the scenario's facts.
    for path in ("scenarios/demo.yaml", "scenarios/faults.yaml", "scenarios/two_nodes.yaml", "scenarios/churn.yaml"):
        scenario = load_scenario(path)
        for spec in scenario.nodes:
            facts = node_facts(scenario, spec)
            assert (facts.cloud_provider, facts.region, facts.instance_type, facts.price_model, facts.zone,
                    facts.provider_id) == (spec.cloud_provider, spec.region, spec.instance_type, spec.price_model,
                                           spec.zone, spec.provider_id), (path, spec.name)


SPOT_SCENARIO = """
cluster: sim-spot
start: "2026-07-01T00:00:00Z"
duration_seconds: 20
nodes:
  - name: gpu-spot-1
    cloud_provider: aws
    region: us-east-1
    zone: us-east-1c
    instance_type: g6.xlarge
    price_model: spot
    gpus: [{model: NVIDIA L4, memory_total_bytes: 24152899584}]
"""


@pytest.mark.network
async def test_the_collector_reads_a_spot_node_as_spot_through_the_api(tmp_path):
    scenario = load_scenario(SPOT_SCENARIO)
    simulated = SimulatedNode(scenario, "gpu-spot-1", 1.0, tmp_path)
    await simulated.start()
    try:
        api = make_api_client(simulated.apiserver.url, token=None, ca_file=None, verify_ssl=False)
        try:
            facts, read = await _node_facts(api, scenario.cluster, "gpu-spot-1", simulated.overrides)
        finally:
            await api.close()
    finally:
        await simulated.stop()
    assert read
    spec = scenario.node("gpu-spot-1")
    assert (facts.price_model, facts.zone, facts.instance_type, facts.region) == (
        "spot", "us-east-1c", "g6.xlarge", "us-east-1")
    assert facts.provider_id == spec.provider_id and facts.provider_id.startswith("aws:///us-east-1c/i-0")
    gets = [r for r in simulated.apiserver.requests if r.path == "/api/v1/nodes/gpu-spot-1"]
    assert len(gets) == 1 and gets[0].method == "GET"


@pytest.mark.network
async def test_an_unreadable_node_leaves_the_configured_facts_and_a_typed_error():
    async with FakeApiServer() as server:
        server.put_node(make_node_object("other", provider="aws", region="r", zone="z", instance_type="t",
                                         price_model="spot", provider_id="aws:///z/i-1"))
        api = make_api_client(server.url, token=None, ca_file=None, verify_ssl=False)
        try:
            with pytest.raises(NodeReadError, match="404"):
                await read_node_object(api, "missing-node")
            facts, read = await _node_facts(api, "c", "missing-node", NodeFactOverrides(instance_type="g6.xlarge"))
        finally:
            await api.close()
    assert not read
    assert (facts.instance_type, facts.price_model, facts.region) == ("g6.xlarge", "on_demand", "unknown")


def test_the_served_node_object_carries_the_managed_clusters_labels():
    spec = load_scenario(SPOT_SCENARIO).node("gpu-spot-1")
    labels = node_object(spec)["metadata"]["labels"]
    assert labels["karpenter.sh/capacity-type"] == "spot" and labels["eks.amazonaws.com/capacityType"] == "SPOT"
    assert labels["topology.kubernetes.io/zone"] == "us-east-1c"
