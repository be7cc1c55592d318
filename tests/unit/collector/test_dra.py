"""GPUs allocated through DRA (NVIDIA's DRA driver, ResourceClaims) are attributed like device-plugin GPUs.

The kubelet lists a DRA pod's devices under ``dynamic_resources`` by claim and driver/pool/device name with
claim-scoped CDI ids that name no GPU; the collector maps each device to its uuid through the node's ResourceSlices
and decides sharing from the claim (``services.collector.dra``). Checked on the pure rules, through our kubelet
PodResources peer and our API server peer with the collector's real clients, and end to end by replaying
``scenarios/dra.yaml`` against the simulator's truth.
"""

from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

from gpumeter.clock import ManualClock
from pipeline.recordings import scenario_records
from pipeline.replay import read_jsonl, replay
from schemas.catalog import TopicCatalog
from schemas.records import DeviceAssignment, PodEvent, PodEventType, SharingMode
from schemas.typed import codec_for
from services.attributor.modes import UnitAssignment, UnitKind, decide_mode
from services.collector.assemble import NodeFacts
from services.collector.dra import (
    ClaimSharing,
    DraResolver,
    SliceDevice,
    claim_device_assignment,
    claim_sharing,
    claimed_sharing,
    NvmlMigDevice,
    parse_mig_device_name,
    resolve_claim_devices,
    slice_devices,
)
from services.collector.pods import pod_event_from_object
from services.collector.podresources.client import ContainerClaimDevice, PodResourcesClient
from services.collector.podwatch import DraApiReader, make_api_client
from services.collector.service import CollectorService
from services.collector.simulation import SimulatedNode, pod_object
from simulator import dra as sim_dra
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIO = REPO / "scenarios" / "dra.yaml"


def _slice(node="n1", generation=1, devices=(), driver="gpu.nvidia.com", pool=None):
    return {"spec": {"driver": driver, "nodeName": node, "pool": {"name": pool or node, "generation": generation,
                                                                   "resourceSliceCount": 1},
                     "devices": list(devices)}}


def _gpu(name, uuid, **extra):
    return {"name": name, "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid},
                                         **{k: {"string": v} for k, v in extra.items()}}}


def _mig(name, uuid, parent, profile):
    return {"name": name, "attributes": {"type": {"string": "mig"}, "uuid": {"string": uuid},
                                         "parentUUID": {"string": parent}, "profile": {"string": profile}}}


def _item(pod="p", claim="c", device="gpu-0", driver="gpu.nvidia.com", container="main", pool="n1"):
    return ContainerClaimDevice("ns", pod, container, "ns", claim, driver, pool, device,
                                (f"k8s.gpu.nvidia.com/claim=0b1c-{device}",))


def _claim(consumers=("p",), strategy=None, in_status=True, requests=None):
    config = []
    if strategy is not None:
        config = [{"requests": requests or [], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": strategy}}}}]
    claim = {"metadata": {"namespace": "ns", "name": "c"},
             "spec": {"devices": {"requests": [{"name": "gpu"}], "config": [] if in_status else config}},
             "status": {"allocation": {"devices": {
                 "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}],
                 "config": config if in_status else []}},
                 "reservedFor": [{"resource": "pods", "name": name, "uid": f"uid-{name}"} for name in consumers]}}
    return claim


# ---------------------------------------------------------------------------------------------------------------
# The pure rules


def test_a_slice_maps_device_names_to_uuids_of_gpus_and_mig_devices():
    devices = slice_devices([_slice(devices=[
        _gpu("gpu-0", "GPU-aaaa", productName="NVIDIA A100-SXM4-40GB"),
        _mig("gpu-1-mig-1g5gb-19-0", "MIG-bbbb", "GPU-cccc", "1g.5gb"),
        {"name": "gpu-2"},  # no attributes: known, but no uuid
        {"attributes": {}},  # no name: skipped
    ])], "n1")
    assert {k: d.uuid for k, d in devices.items()} == {
        ("gpu.nvidia.com", "n1", "gpu-0"): "GPU-aaaa",
        ("gpu.nvidia.com", "n1", "gpu-1-mig-1g5gb-19-0"): "MIG-bbbb",
        ("gpu.nvidia.com", "n1", "gpu-2"): None,
    }
    mig = devices[("gpu.nvidia.com", "n1", "gpu-1-mig-1g5gb-19-0")]
    assert (mig.device_type, mig.parent_uuid, mig.profile) == ("mig", "GPU-cccc", "1g.5gb")


def test_slices_of_other_nodes_and_stale_pool_generations_are_left_out():
    devices = slice_devices([
        _slice(generation=1, devices=[_gpu("gpu-0", "GPU-old")]),
        _slice(generation=2, devices=[_gpu("gpu-0", "GPU-new")]),
        _slice(node="n2", devices=[_gpu("gpu-9", "GPU-other")]),
        "not a slice",
        {"spec": {"driver": "gpu.nvidia.com"}},  # no pool
    ], "n1")
    assert {k: d.uuid for k, d in devices.items()} == {("gpu.nvidia.com", "n1", "gpu-0"): "GPU-new"}


def test_qualified_attribute_names_are_read_too():
    devices = slice_devices([_slice(devices=[{"name": "gpu-0", "attributes": {
        "gpu.nvidia.com/uuid": {"string": "GPU-q"}, "gpu.nvidia.com/type": {"string": "gpu"}}}])], "n1")
    assert devices[("gpu.nvidia.com", "n1", "gpu-0")].uuid == "GPU-q"


@pytest.mark.parametrize("name, parts", [
    ("gpu-0-mig-1g10gb-19-0", (0, "1g10gb", 19, 0)),
    ("gpu-3-mig-3g40gb-9-4", (3, "3g40gb", 9, 4)),
    ("gpu-0", None),
    ("gpu-0-mig-19-0", None),
])
def test_mig_device_names_are_parsed(name, parts):
    parsed = parse_mig_device_name(name)
    assert (None if parsed is None else (parsed.parent_minor, parsed.profile, parsed.profile_id,
                                         parsed.placement_start)) == parts


def test_the_claims_sharing_config_and_consumers_are_read():
    assert claim_sharing(_claim(strategy="TimeSlicing"), "gpu") == ClaimSharing("TimeSlicing", ("p",))
    assert claim_sharing(_claim(strategy="MPS", in_status=False), "gpu").strategy == "MPS"  # before allocation
    assert claim_sharing(_claim(strategy="MPS", requests=["other"]), "gpu").strategy is None  # another request's
    assert claim_sharing(_claim(consumers=("a", "b")), "gpu") == ClaimSharing(None, ("a", "b"))
    other_driver = _claim(strategy="MPS")
    other_driver["status"]["allocation"]["devices"]["config"][0]["opaque"]["driver"] = "example.com"
    assert claim_sharing(other_driver, "gpu").strategy is None
    assert claim_sharing(None) == ClaimSharing(None, ())
    assert claim_sharing({"status": "garbage"}) == ClaimSharing(None, ())


def test_a_claim_device_becomes_a_device_plugin_assignment():
    gpu = SliceDevice("gpu.nvidia.com", "n1", "gpu-0", "GPU-aaaa", "gpu", None, None)
    mig = SliceDevice("gpu.nvidia.com", "n1", "gpu-1-mig-2g10gb-14-2", "MIG-bbbb", "mig", "GPU-c", "2g.10gb")
    one = ClaimSharing(None, ("p",))
    # Every resolved device carries the claim that holds it alone: its pods pay it together.
    assert claim_device_assignment(_item(), gpu, one) == DeviceAssignment("nvidia.com/gpu", ("GPU-aaaa",), "ns/c")
    assert claim_device_assignment(_item(), mig, one) == DeviceAssignment(
        "nvidia.com/mig-2g.10gb", ("MIG-bbbb",), "ns/c")
    shared = ClaimSharing(None, ("q", "p"))
    assert claim_device_assignment(_item(pod="p"), gpu, shared) == DeviceAssignment(
        "nvidia.com/gpu.shared", ("GPU-aaaa::1",), "ns/c")
    configured = ClaimSharing("TimeSlicing", ("p",))
    assert claim_device_assignment(_item(), gpu, configured) == DeviceAssignment(
        "nvidia.com/gpu.shared", ("GPU-aaaa::0",), "ns/c")
    # A device shared across claims (consumable capacity) is no claim's: shared, even for one unconfigured pod.
    assert claim_device_assignment(_item(), gpu, one, across_claims=True) == DeviceAssignment(
        "nvidia.com/gpu.shared", ("GPU-aaaa::0",))
    assert claim_device_assignment(_item(pod="late"), gpu, shared).device_ids == ("GPU-aaaa::2",)
    # Unresolved: the CDI id, which names no unit.
    assert claim_device_assignment(_item(), None, one) == DeviceAssignment(
        "nvidia.com/gpu", ("k8s.gpu.nvidia.com/claim=0b1c-gpu-0",))


def test_a_mig_device_published_without_uuid_is_the_one_nvml_lists_with_its_parent_and_profile():
    # DynamicMIG: the driver announces the MIG devices it could create, with no uuid; NVML lists the one it made.
    name = "gpu-1-mig-1g5gb-19-0"
    published = {"name": name, "attributes": {"type": {"string": "mig"}, "parentUUID": {"string": "GPU-p"},
                                              "profile": {"string": "1g.5gb"}}}
    devices = slice_devices([_slice(devices=[published])], "n1")
    claims = {("ns", "c"): _claim()}
    migs = [NvmlMigDevice("MIG-one", "GPU-p", "1g.5gb"), NvmlMigDevice("MIG-big", "GPU-p", "3g.20gb"),
            NvmlMigDevice("MIG-else", "GPU-q", "1g.5gb")]
    grouped, unresolved = resolve_claim_devices([_item(device=name)], devices, claims, migs)
    assert grouped == {("ns", "p"): {"main": (DeviceAssignment("nvidia.com/mig-1g.5gb", ("MIG-one",), "ns/c"),)}}
    assert unresolved == ()
    # Two 1g.5gb instances on the parent: ambiguous (NVML placement is not read), so unresolved.
    grouped, unresolved = resolve_claim_devices([_item(device=name)], devices, claims,
                                                migs + [NvmlMigDevice("MIG-two", "GPU-p", "1g.5gb")])
    assert unresolved and grouped[("ns", "p")]["main"][0].device_ids == (f"k8s.gpu.nvidia.com/claim=0b1c-{name}",)
    grouped, unresolved = resolve_claim_devices([_item(device=name)], devices, claims)  # NVML not read yet
    assert unresolved


def test_shared_claims_configure_the_sharing_the_samples_report():
    devices = slice_devices([_slice(devices=[_gpu("gpu-0", "GPU-aaaa"), _gpu("gpu-1", "GPU-bbbb"),
                                             _mig("gpu-2-mig-1g5gb-19-0", "MIG-cccc", "GPU-d", "1g.5gb")])], "n1")
    mps = _claim(consumers=("p", "q", "r"), strategy="MPS")
    items = [_item(claim="mps"), _item(claim="one", device="gpu-1"), _item(claim="mig", device="gpu-2-mig-1g5gb-19-0")]
    claims = {("ns", "mps"): mps, ("ns", "one"): _claim(), ("ns", "mig"): _claim(consumers=("p", "q"))}
    # The MPS claim's GPU is MPS with a replica per pod; one pod's unconfigured claim and a MIG device say nothing.
    assert claimed_sharing(items, devices, claims) == {"GPU-aaaa": (SharingMode.MPS, 3)}


def test_a_device_the_platform_shares_across_claims_is_no_claims_and_a_claims_config_cannot_make_it_so():
    # KEP-5075 consumable capacity: the slice's device allows multiple allocations, and each claim's allocation
    # result names a shareID. Such a device is shared (by use), even for one unconfigured claim's one pod.
    multi = dict(_gpu("gpu-0", "GPU-aaaa"), allowMultipleAllocations=True)
    devices = slice_devices([_slice(devices=[multi, _gpu("gpu-1", "GPU-bbbb")])], "n1")
    assert devices[("gpu.nvidia.com", "n1", "gpu-0")].multiple_allocations
    assert not devices[("gpu.nvidia.com", "n1", "gpu-1")].multiple_allocations
    one, other = _claim(), _claim(consumers=("q",))
    items = [_item(claim="c"), _item(pod="q", claim="d")]
    grouped, _ = resolve_claim_devices(items, devices, {("ns", "c"): one, ("ns", "d"): other})
    assert grouped == {("ns", "p"): {"main": (DeviceAssignment("nvidia.com/gpu.shared", ("GPU-aaaa::0",)),)},
                       ("ns", "q"): {"main": (DeviceAssignment("nvidia.com/gpu.shared", ("GPU-aaaa::0",)),)}}
    # The two claims' pods: one replica each on the GPU the samples then call time-sliced.
    assert claimed_sharing(items, devices, {("ns", "c"): one, ("ns", "d"): other}) == {
        "GPU-aaaa": (SharingMode.TIME_SLICING, 2)}
    # A shareID in the allocation says the same, whatever the slice (one share of a multi-allocation device).
    share = _claim()
    share["status"]["allocation"]["devices"]["results"][0]["shareID"] = "3f6c1a52-2b1e-4c55-9d0a-0e7f4b8a1c22"
    single = slice_devices([_slice(devices=[_gpu("gpu-0", "GPU-aaaa")])], "n1")
    grouped, _ = resolve_claim_devices([_item()], single, {("ns", "c"): share})
    assert grouped[("ns", "p")]["main"] == (DeviceAssignment("nvidia.com/gpu.shared", ("GPU-aaaa::0",)),)
    # The claim's own config never says it: a tenant's MPS GpuConfig (with made-up sharing keys) leaves the GPU
    # the claim's, its one pod paying it whole.
    tenant = _claim(strategy="MPS")
    parameters = tenant["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]
    parameters["sharing"].update(allowMultipleAllocations=True, shareID="mine")
    grouped, _ = resolve_claim_devices([_item()], single, {("ns", "c"): tenant})
    assert grouped[("ns", "p")]["main"] == (DeviceAssignment("nvidia.com/gpu.shared", ("GPU-aaaa::0",), "ns/c"),)


def test_the_attributors_modes_read_dra_assignments_as_exclusive_time_sliced_and_mig():
    exclusive = UnitAssignment("pod-a", ("nvidia.com/gpu",), ("GPU-aaaa",))
    decision = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [exclusive])
    assert (decision.mode, decision.dedicated_owner, decision.conflict) == (SharingMode.EXCLUSIVE, "pod-a", False)
    shared = [UnitAssignment("pod-a", ("nvidia.com/gpu.shared",), ("GPU-aaaa::0",)),
              UnitAssignment("pod-b", ("nvidia.com/gpu.shared",), ("GPU-aaaa::1",))]
    decision = decide_mode(UnitKind.GPU, SharingMode.TIME_SLICING, 2, shared)
    assert (decision.mode, decision.dedicated_owner, decision.conflict) == (SharingMode.TIME_SLICING, None, False)
    assert decide_mode(UnitKind.GPU, SharingMode.MPS, 2, shared).mode is SharingMode.MPS
    mig = UnitAssignment("pod-c", ("nvidia.com/mig-2g.10gb",), ("MIG-bbbb",))
    decision = decide_mode(UnitKind.MIG_INSTANCE, SharingMode.MIG, 1, [mig])
    assert (decision.dedicated_owner, decision.conflict) == ("pod-c", False)
    mig_shared = [UnitAssignment(p, ("nvidia.com/mig-2g.10gb.shared",), (f"MIG-bbbb::{i}",))
                  for i, p in enumerate(("pod-c", "pod-d"))]
    decision = decide_mode(UnitKind.MIG_INSTANCE, SharingMode.MIG, 1, mig_shared)
    assert (decision.dedicated_owner, decision.conflict) == (None, False)


def test_the_attributors_modes_give_a_claims_device_to_the_claims_pods():
    def held(pod, ids, claim, resource="nvidia.com/gpu.shared"):
        return UnitAssignment(pod, (resource,), ids, (claim,) * len(ids))

    # One pod alone in a TimeSlicing claim, a claim's pods, an MPS claim's, a MIG device's: the claim's pods pay.
    for kind, mode, holders in (
        (UnitKind.GPU, SharingMode.TIME_SLICING, [held("pod-a", ("GPU-a::0",), "ns/c")]),
        (UnitKind.GPU, SharingMode.TIME_SLICING, [held(p, (f"GPU-a::{i}",), "ns/c") for i, p in
                                                  enumerate(("pod-a", "pod-b", "pod-c"))]),
        (UnitKind.GPU, SharingMode.MPS, [held(p, (f"GPU-a::{i}",), "ns/c") for i, p in enumerate(("pod-a", "pod-b"))]),
        (UnitKind.MIG_INSTANCE, SharingMode.MIG, [held(p, (f"MIG-b::{i}",), "ns/c", "nvidia.com/mig-1g.5gb.shared")
                                                  for i, p in enumerate(("pod-a", "pod-b"))]),
    ):
        decision = decide_mode(kind, mode, len(holders), holders)
        assert decision.claim_owners == tuple(sorted(a.pod_uid for a in holders)), (kind, mode)
        assert (decision.owning_claim, decision.dedicated_owner, decision.conflict) == ("ns/c", None, False)
        assert decision.mode is mode
    # One pod's plain id is still the exclusive owner's; replica ids of no claim (shared across claims) by use.
    decision = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [held("pod-a", ("GPU-a",), "ns/c",
                                                                         "nvidia.com/gpu")])
    assert (decision.mode, decision.dedicated_owner) == (SharingMode.EXCLUSIVE, "pod-a")
    across = [held("pod-a", ("GPU-a::0",), None), held("pod-b", ("GPU-a::0",), None)]
    decision = decide_mode(UnitKind.GPU, SharingMode.TIME_SLICING, 2, across)
    assert (decision.claim_owners, decision.dedicated_owner) == ((), None)


# ---------------------------------------------------------------------------------------------------------------
# The resolver: slices re-listed for unknown devices, other drivers dropped, failures survived


async def test_the_resolver_relists_slices_when_a_device_is_new_and_counts_what_it_cannot_resolve():
    slices = [[_slice(devices=[_gpu("gpu-0", "GPU-aaaa")])]]
    calls = []

    async def list_slices():
        calls.append("list")
        return slices[-1]

    async def read_claim(namespace, name):
        return _claim(consumers=("p",))

    resolver = DraResolver("n1", list_slices, read_claim)
    got = await resolver.assignments([_item()])
    assert got == {("ns", "p"): {"main": (DeviceAssignment("nvidia.com/gpu", ("GPU-aaaa",), "ns/c"),)}}
    await resolver.assignments([_item()])
    assert len(calls) == 1, "known devices need no new list"
    # A MIG device created since: not in the slices the resolver has, so it lists again and finds it.
    mig_name = "gpu-1-mig-1g5gb-19-0"
    slices.append([_slice(generation=2, devices=[_gpu("gpu-0", "GPU-aaaa"),
                                                 _mig(mig_name, "MIG-dddd", "GPU-e", "1g.5gb")])])
    got = await resolver.assignments([_item(device=mig_name)])
    assert got[("ns", "p")]["main"] == (DeviceAssignment("nvidia.com/mig-1g.5gb", ("MIG-dddd",), "ns/c"),)
    assert len(calls) == 2 and resolver.unresolved_total == 0
    # A device no slice has: published with its CDI id, counted; another driver's device: dropped, counted.
    got = await resolver.assignments([_item(device="gpu-7"), _item(driver="example.com/nic", container="side")])
    assert got == {("ns", "p"): {"main": (DeviceAssignment("nvidia.com/gpu",
                                                            ("k8s.gpu.nvidia.com/claim=0b1c-gpu-7",)),)}}
    assert (resolver.unresolved_total, resolver.foreign_total) == (1, 1)


async def test_the_resolver_keeps_its_last_answers_when_the_api_fails():
    state = {"fail": False}

    async def list_slices():
        if state["fail"]:
            raise OSError("API server down")
        return [_slice(devices=[_gpu("gpu-0", "GPU-aaaa")])]

    async def read_claim(namespace, name):
        if state["fail"]:
            raise OSError("API server down")
        return _claim(consumers=("p", "q"))

    resolver = DraResolver("n1", list_slices, read_claim)
    first = await resolver.assignments([_item()])
    state["fail"] = True
    assert await resolver.assignments([_item(), _item(device="gpu-5")]) == {("ns", "p"): {"main": (
        first[("ns", "p")]["main"][0],
        DeviceAssignment("nvidia.com/gpu", ("k8s.gpu.nvidia.com/claim=0b1c-gpu-5",)))}}
    assert first[("ns", "p")]["main"][0].device_ids == ("GPU-aaaa::0",)


# ---------------------------------------------------------------------------------------------------------------
# Through the peers: our kubelet (gRPC PodResources) and our API server, with the collector's own clients


def _expected(scenario):
    node = scenario.nodes[0]
    gpus = node.gpus
    return {
        "trainer-0": [DeviceAssignment("nvidia.com/gpu", (gpus[0].uuid,), "ml/trainer-gpu")],
        "chat-api-0": [DeviceAssignment("nvidia.com/gpu.shared", (f"{gpus[1].uuid}::0",), "chat/chat-shared-gpu")],
        "chat-api-1": [DeviceAssignment("nvidia.com/gpu.shared", (f"{gpus[1].uuid}::1",), "chat/chat-shared-gpu")],
        "embed-0": [DeviceAssignment("nvidia.com/mig-2g.10gb", (gpus[2].sharing.mig_instances[1].uuid,),
                                     "ml/embed-mig")],
    }


@pytest.mark.network
async def test_dra_pods_get_their_gpus_through_the_kubelet_peer_and_the_api_server():
    scenario = load_scenario(SCENARIO)
    node = scenario.nodes[0]
    workdir = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    sim = SimulatedNode(scenario, node.name, 1.0, workdir)
    await sim.start()
    now_ms = scenario.start_unix_ms + 30_000
    await sim.sync(now_ms)
    api = make_api_client(sim.apiserver.url, token=None, ca_file=None, verify_ssl=False)
    reader = DraApiReader(api, node.name)
    client = PodResourcesClient(sim.kubelet_socket, 2.0)
    offered = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    class _Backend:
        uuid_by_index: dict = {}
        claimed_sharing: dict = {}

    backend = _Backend()
    service = CollectorService(
        facts=NodeFacts(scenario.cluster, node.name, "aws", "us-east-1", "p4d.24xlarge", "on_demand"),
        interval_seconds=10.0, clock=ManualClock(now_ms), backend=backend, identities=None, publisher=_Publisher(),
        catalog=TopicCatalog(), kubelet=client,
        dra=DraResolver(node.name, reader.list_slices, reader.read_claim),
    )
    try:
        # The kubelet lists the DRA devices by claim, with claim-scoped CDI ids and no device-plugin devices.
        listed = await client.list()
        assert listed and all(isinstance(a, ContainerClaimDevice) for a in listed)
        assert all(a.cdi_ids[0].startswith("k8s.gpu.nvidia.com/claim=") for a in listed)
        for pod in sim.world.pods_at(now_ms, node.name):
            await service.on_pod_event(pod_event_from_object(pod_object(pod), PodEventType.ADDED, scenario.cluster,
                                                             now_ms))
        events = {e.name: e for e in (codec_for(PodEvent).decode(r.value) for r in offered)}
        got = {name: [a for c in e.containers for a in c.assigned_devices] for name, e in events.items()}
        assert got == _expected(scenario)
        assert service.dra.unresolved_total == 0 and service.dra.slice_lists_total == 1
        # The shared claim's TimeSlicing config is what the samples of its GPU will say (2 pods: 2 replicas).
        assert backend.claimed_sharing == {node.gpus[1].uuid: (SharingMode.TIME_SLICING, 2)}
        paths = [r.path for r in sim.apiserver.requests]
        assert "/apis/resource.k8s.io/v1/resourceslices" in paths
        assert "/apis/resource.k8s.io/v1/namespaces/chat/resourceclaims/chat-shared-gpu" in paths
        slice_queries = [r.query for r in sim.apiserver.requests if r.path.endswith("/resourceslices")]
        assert slice_queries[0]["fieldSelector"] == f"spec.nodeName={node.name}"
        # Nothing changed: a kubelet refresh republishes nothing.
        before = len(offered)
        await service.refresh_assignments()
        assert len(offered) == before
    finally:
        await client.close()
        await api.close()
        await sim.stop()


def test_the_replayed_collector_publishes_the_same_assignments():
    scenario = load_scenario(SCENARIO)
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    got = {e.name: [a for c in e.containers for a in c.assigned_devices]
           for e in events if e.event_type == PodEventType.ADDED}
    assert got == _expected(scenario)
    # The pods request no extended resource: their GPUs come from claims.
    assert all(not e.gpu_requests for e in events)


def test_the_simulated_driver_names_devices_as_nvidias_driver_does():
    scenario = load_scenario(SCENARIO)
    node = scenario.nodes[0]
    names = [d["name"] for d in sim_dra.resource_slices(node)[0]["spec"]["devices"]]
    assert names[:2] == ["gpu-0", "gpu-1"]
    migs = [n for n in names if parse_mig_device_name(n) is not None]
    assert len(migs) == 3 and all(parse_mig_device_name(n).parent_minor == 2 for n in migs)
    assert "gpu-2" not in names  # a MIG-enabled GPU is published as its MIG devices


# ---------------------------------------------------------------------------------------------------------------
# End to end: attribution of the replayed scenario against the simulator's truth


def test_the_dra_scenario_is_attributed_as_its_claims_say(tmp_path):
    scenario = load_scenario(SCENARIO)
    gpus = scenario.nodes[0].gpus
    summary = replay(SCENARIO, tmp_path)
    assert summary.dead_letters == {} and summary.share_rows > 0
    shares = read_jsonl(tmp_path / "shares.jsonl")
    truth = read_jsonl(tmp_path / "truth.jsonl")
    pods = {p.uid: p.name for p in scenario.pods}
    by_unit = defaultdict(list)
    for row in shares:
        by_unit[row["gpu_uuid"]].append(row)
    exclusive = by_unit[gpus[0].uuid]
    assert {pods.get(r["pod_uid"]) for r in exclusive if r["subject_kind"] == "pod"} == {"trainer-0"}
    assert all(r["method"] == "exclusive" for r in exclusive)
    shared = by_unit[gpus[1].uuid]
    assert {r["sharing_mode"] for r in shared} == {"time_slicing"}
    assert {pods[r["pod_uid"]] for r in shared if r["subject_kind"] == "pod"} == {"chat-api-0", "chat-api-1"}
    # Split by use, as the simulator's truth has it (within the per-process SM bound of test_replay).
    true_compute = {(r["window_start"], r["gpu_uuid"], r["pod_uid"]): r["true_compute_share"]
                    for r in truth if r["pod_uid"] is not None}
    split = [(r["compute_share"], true_compute[(r["window_start"], r["gpu_uuid"], r["pod_uid"])])
             for r in shared if r["subject_kind"] == "pod"]
    assert len({round(theirs, 3) for _, theirs in split}) > 1, "the two pods used the GPU differently"
    assert all(abs(ours - theirs) <= 0.03 for ours, theirs in split), split
    mig = by_unit[gpus[2].sharing.mig_instances[1].uuid]
    assert {pods.get(r["pod_uid"]) for r in mig if r["subject_kind"] == "pod"} == {"embed-0"}
    # Who pays: each claim's pods pay their device whole, every window -- chat-shared-gpu's two pods together,
    # split by use (memory, the default basis), nothing of it the platform's idle.
    for unit, payers in ((gpus[0].uuid, {"trainer-0"}), (gpus[1].uuid, {"chat-api-0", "chat-api-1"}),
                         (gpus[2].sharing.mig_instances[1].uuid, {"embed-0"})):
        for window, rows in _windows(by_unit[unit]).items():
            paid = {pods[r["pod_uid"]]: r["cost_share"] for r in rows if r["subject_kind"] == "pod"}
            assert set(paid) == payers
            assert math.fsum(paid.values()) == pytest.approx(1.0, abs=1e-9), (unit, window)
    for window, rows in _windows(shared).items():
        pod_rows = [r for r in rows if r["subject_kind"] == "pod"]
        used = math.fsum(r["memory_share"] for r in pod_rows)
        for r in pod_rows:
            assert r["cost_share"] == pytest.approx(r["memory_share"] / used, abs=1e-9), window
        idle = next(r for r in rows if r["subject_kind"] == "idle")
        assert idle["cost_share"] == 0.0 and idle["memory_share"] > 0.5  # its idle memory is still reported
    # Memory matches the simulator's truth for every pod on every unit.
    true_memory = {(r["window_start"], r["gpu_uuid"], r["pod_uid"]): r["true_memory_share"]
                   for r in truth if r["pod_uid"] is not None}
    ours = {(r["window_start"], r["gpu_uuid"], r["pod_uid"]): r["memory_share"]
            for r in shares if r["subject_kind"] == "pod"}
    assert true_memory and set(true_memory) == set(ours)
    for key, value in true_memory.items():
        assert abs(ours[key] - value) <= 1e-9, key


def _windows(rows):
    """window start -> the rows of one unit's window."""
    out = defaultdict(list)
    for row in rows:
        out[row["window_start"]].append(row)
    return out


def test_the_nvml_backend_reports_what_a_claim_configures_over_the_device_plugin_config():
    from services.collector.nvml_backend import NvmlBackend
    from simulator.nvml_driver import simulated_pynvml
    from simulator.world import SimWorld

    scenario = load_scenario(SCENARIO)
    node = scenario.nodes[0]
    clock = ManualClock(scenario.start_unix_ms + 30_000)
    world = SimWorld(scenario)
    world.step(clock.now_ms())
    backend = NvmlBackend(simulated_pynvml(world, clock, node.name), clock,
                          sharing_by_gpu_uuid={node.gpus[0].uuid: (SharingMode.EXCLUSIVE, 1)})
    modes = {d.uuid: (d.sharing_mode, d.replicas) for d in backend.read().devices}
    assert modes[node.gpus[0].uuid] == (SharingMode.EXCLUSIVE, 1)
    backend.claimed_sharing = {node.gpus[0].uuid: (SharingMode.TIME_SLICING, 3)}
    modes = {d.uuid: (d.sharing_mode, d.replicas) for d in backend.read().devices}
    assert modes[node.gpus[0].uuid] == (SharingMode.TIME_SLICING, 3)


# ---------------------------------------------------------------------------------------------------------------
# What a scenario may say about claims


def _dra_doc(**node):
    import yaml

    doc = yaml.safe_load(SCENARIO.read_text())
    doc["nodes"][0].update(node)
    return doc


def _load_doc(doc):
    import json

    return load_scenario(json.dumps(doc))  # JSON is YAML


def test_claims_are_only_for_dra_nodes_and_a_device_belongs_to_one_claim_at_a_time():
    from simulator.scenario import ScenarioError

    with pytest.raises(ScenarioError, match="device plugin: no claims"):
        _load_doc(_dra_doc(allocation="device_plugin"))
    doc = _dra_doc()
    doc["pods"][2]["containers"][0]["devices"][0]["claim"] = "another-claim"  # chat-api-1 on chat-api-0's GPU
    with pytest.raises(ScenarioError, match="at the same time"):
        _load_doc(doc)
    doc = _dra_doc()
    doc["pods"][0]["containers"][0]["requests"] = {"nvidia.com/gpu": 1}
    with pytest.raises(ScenarioError, match="requests"):
        _load_doc(doc)
    doc = _dra_doc()
    doc["pods"][3]["containers"][0]["devices"].append({"resource": "nvidia.com/gpu", "gpu": 3, "claim": "embed-mig"})
    with pytest.raises(ScenarioError, match="already holds another device"):
        _load_doc(doc)
    # Without a claim name, each device gets the pod's own claim.
    doc = _dra_doc()
    del doc["pods"][0]["containers"][0]["devices"][0]["claim"]
    trainer = next(p for p in _load_doc(doc).pods if p.name == "trainer-0")
    assert trainer.containers[0].devices[0].claim == "trainer-0-gpu0"


def test_a_pod_is_republished_when_its_claim_is_shared_differently():
    doc = _dra_doc()
    doc["pods"][1]["end_seconds"] = 60  # chat-api-0 leaves the shared claim; chat-api-1 becomes its first pod
    scenario = _load_doc(doc)
    gpu = scenario.nodes[0].gpus[1].uuid
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    chat1 = [(e.event_type, [d for c in e.containers for a in c.assigned_devices for d in a.device_ids])
             for e in events if e.name == "chat-api-1"]
    assert chat1 == [(PodEventType.ADDED, [f"{gpu}::1"]), (PodEventType.MODIFIED, [f"{gpu}::0"])]
    deleted = [e for e in events if e.name == "chat-api-0" and e.event_type == PodEventType.DELETED]
    assert [d for c in deleted[0].containers for a in c.assigned_devices for d in a.device_ids] == [f"{gpu}::0"]


async def test_unresolved_claim_devices_are_counted_in_the_collectors_metrics():
    from gpumeter.metrics import ServiceMetrics

    class _Kubelet:
        async def list(self):
            return (_item(device="gpu-9"), _item(pod="q", device="gpu-0"))

    async def list_slices():
        return [_slice(devices=[_gpu("gpu-0", "GPU-aaaa")])]

    async def read_claim(namespace, name):
        return None  # the claim is gone: nothing is shared

    metrics = ServiceMetrics("collector")

    class _Publisher:
        def offer(self, record):
            pass

    service = CollectorService(
        facts=NodeFacts("c", "n1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=ManualClock(0),
        backend=None, identities=None, publisher=_Publisher(), catalog=TopicCatalog(), kubelet=_Kubelet(),
        metrics=metrics, dra=DraResolver("n1", list_slices, read_claim))
    await service.refresh_assignments()
    await service.refresh_assignments()
    assert metrics.get("gpumeter_collector_dra_devices_unresolved_total")._value.get() == 2
    assert service._assignments[("ns", "q")]["main"] == (DeviceAssignment("nvidia.com/gpu", ("GPU-aaaa",), "ns/c"),)


# ---------------------------------------------------------------------------------------------------------------
# Who pays a claim's device: the claim's pods, together, whatever sharing config the claim's owner writes


def _replayed_units(tmp_path, doc):
    """unit uuid -> window start -> the unit's share rows, replaying ``doc``; and pod uid -> pod name."""
    import json

    path = tmp_path / "claims.yaml"
    path.write_text(json.dumps(doc))
    summary = replay(path, tmp_path / "out")
    assert summary.dead_letters == {}
    units = defaultdict(lambda: defaultdict(list))
    for row in read_jsonl(tmp_path / "out" / "shares.jsonl"):
        units[row["gpu_uuid"]][row["window_start"]].append(row)
    for unit, windows in units.items():
        for window, rows in windows.items():
            for field in ("memory_share", "compute_share", "cost_share"):
                assert math.fsum(r[field] for r in rows) == pytest.approx(1.0, abs=1e-9), (unit, window, field)
    return units, {p.uid: p.name for p in load_scenario(path).pods}


def _assert_claim_pays(windows, names, payers):
    """Every window: ``payers`` pay the unit whole together, split by their memory (the default basis)."""
    assert windows
    for window, rows in windows.items():
        pod_rows = [r for r in rows if r["subject_kind"] == "pod"]
        assert {names[r["pod_uid"]] for r in pod_rows} == payers, window
        assert math.fsum(r["cost_share"] for r in pod_rows) == pytest.approx(1.0, abs=1e-9), window
        used = math.fsum(r["memory_share"] for r in pod_rows)
        for r in pod_rows:
            assert r["cost_share"] == pytest.approx(r["memory_share"] / used, abs=1e-9), window
        buckets = {r["subject_kind"]: r for r in rows if r["subject_kind"] != "pod"}
        assert buckets["idle"]["cost_share"] == 0.0 and buckets["idle"]["memory_share"] > 0.0, window


def _pod(name, gpu, claim, memory, compute, **device):
    return {"namespace": "chat", "name": name, "node": "gpu-p4d-dra", "labels": {"team": "assistants"},
            "containers": [{"name": "vllm", "devices": [{"gpu": gpu, "claim": claim, **device}],
                            "processes": [{"name": "python3", "memory": {"bytes": memory}, "compute": compute}]}]}


def test_one_pod_alone_in_a_time_slicing_claim_pays_its_whole_gpu(tmp_path):
    doc = _dra_doc()
    del doc["pods"][2]  # chat-api-1: chat-api-0 is alone in chat-shared-gpu, whose GpuConfig says TimeSlicing
    units, names = _replayed_units(tmp_path, doc)
    windows = units[load_scenario(SCENARIO).nodes[0].gpus[1].uuid]
    _assert_claim_pays(windows, names, {"chat-api-0"})
    assert {r["sharing_mode"] for rows in windows.values() for r in rows} == {"time_slicing"}


def test_three_pods_sharing_one_claim_pay_its_gpu_together_split_by_use(tmp_path):
    doc = _dra_doc()
    doc["nodes"][0]["gpus"][1]["sharing"]["replicas"] = 3
    doc["pods"].append(_pod("chat-api-2", 1, "chat-shared-gpu", "3GiB", 0.1, resource="nvidia.com/gpu.shared",
                            replica=2))
    units, names = _replayed_units(tmp_path, doc)
    _assert_claim_pays(units[load_scenario(SCENARIO).nodes[0].gpus[1].uuid], names,
                       {"chat-api-0", "chat-api-1", "chat-api-2"})


def test_an_mps_claims_pods_pay_its_gpu_together(tmp_path):
    doc = _dra_doc()
    doc["nodes"][0]["gpus"][1]["sharing"] = {"mode": "mps", "replicas": 2}
    units, names = _replayed_units(tmp_path, doc)
    windows = units[load_scenario(SCENARIO).nodes[0].gpus[1].uuid]
    _assert_claim_pays(windows, names, {"chat-api-0", "chat-api-1"})
    assert {r["sharing_mode"] for rows in windows.values() for r in rows} == {"mps"}


def test_a_mig_device_in_one_claim_is_paid_by_the_claims_pods_together(tmp_path):
    doc = _dra_doc()
    doc["pods"].append({**_pod("embed-1", 2, "embed-mig", "2GiB", 0.2, resource="nvidia.com/mig-2g.10gb",
                               instance=1), "namespace": "ml"})
    units, names = _replayed_units(tmp_path, doc)
    _assert_claim_pays(units[load_scenario(SCENARIO).nodes[0].gpus[2].sharing.mig_instances[1].uuid], names,
                       {"embed-0", "embed-1"})
