"""The collector's Kubernetes side against a real kube-apiserver (etcd + kube-apiserver v1.37.2, the session's
``kube_apiserver``): the pod watch through a server restart, 410 Gone, an outage and bookmarks; Node facts from a
real Node; DRA ResourceSlices and ResourceClaims as NVIDIA's driver and the scheduler write them, through the
server's validation, resolved by the collector.

The test plays scheduler and kubelet: pods are created bound (``spec.nodeName``), their status is written as
the kubelet reports it, and they are deleted with ``gracePeriodSeconds=0`` (``tests/integration/kube_world.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import uuid

import pytest
from kubernetes_asyncio import client

from gpumeter.clock import ManualClock
from schemas.records import DeviceAssignment, PodEvent, PodEventType
from services.collector.dra import DraResolver, slice_devices
from services.collector.nodefacts import NodeFactOverrides, node_facts_from_node, read_node_object
from services.collector.podwatch import ERROR_EXPIRED, DraApiReader, PodWatcher
from simulator import dra as sim_dra
from simulator.apiserver import DEFAULT_STARTED_AT_UNIX_MS, make_node_object, make_pod_object
from simulator.scenario import load_scenario
from tests.integration.kube_world import TcpGate, create_running_pod, delete_pod_now

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ADDED, MODIFIED, DELETED = PodEventType.ADDED, PodEventType.MODIFIED, PodEventType.DELETED
WAIT_S = 20.0
START_MS = 1_795_000_000_000


def node_name() -> str:
    return f"gpu-node-{uuid.uuid4().hex[:8]}"


def gpu_pod(namespace: str, name: str, node: str, **kwargs) -> dict:
    return make_pod_object(namespace, name, f"uid-{name}", node, gpu_requests={"nvidia.com/gpu": 1}, **kwargs)


async def eventually(predicate, timeout_s: float = WAIT_S, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)


async def call(server, method: str, path: str, body=None):
    """An admin request off the event loop (the watcher under test runs on it)."""
    return await asyncio.to_thread(server.must, method, path, body)


class Watching:
    def __init__(self, watcher: PodWatcher, events: list[PodEvent], errors: list[str], relists: list[int]):
        self.watcher, self.events, self.errors, self.relists = watcher, events, errors, relists

    def seen(self, start: int = 0) -> list[tuple[PodEventType, str, str]]:
        return [(e.event_type, e.name, e.phase) for e in self.events[start:]]


@contextlib.asynccontextmanager
async def watching(server, node: str, *, port: int | None = None, **kwargs):
    configuration = server.admin_configuration()
    if port is not None:
        configuration.host = f"https://127.0.0.1:{port}"
    api = client.ApiClient(configuration)
    events: list[PodEvent] = []
    errors: list[str] = []
    relists: list[int] = []

    async def on_event(event: PodEvent) -> None:
        events.append(event)

    watcher = PodWatcher(api, node, "test", ManualClock(START_MS), on_event, backoff_initial_s=0.05,
                         backoff_max_s=0.2, rng=random.Random(3), on_relist=relists.append,
                         on_watch_error=errors.append, **kwargs)
    task = asyncio.create_task(watcher.run())
    try:
        yield Watching(watcher, events, errors, relists)
    finally:
        await watcher.stop()
        await task
        await api.close()


async def test_a_pods_life_arrives_as_the_kubelet_and_scheduler_write_it(kube_apiserver, kube_namespace):
    node = node_name()
    async with watching(kube_apiserver, node) as w:
        await eventually(lambda: w.watcher.has_synced, what="first list")
        obj = gpu_pod(kube_namespace, "train-0", node, labels={"team": "a"})
        await asyncio.to_thread(create_running_pod, kube_apiserver, obj)
        await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, "other", node_name()))
        await eventually(lambda: len(w.events) >= 2, what="ADDED and MODIFIED")
        # Graceful deletion first (what `kubectl delete` asks): the pod stays, marked (deletionTimestamp); the
        # kubelet's grace-0 delete then shortens the grace (marked again) and removes it.
        await call(kube_apiserver, "DELETE", f"/api/v1/namespaces/{kube_namespace}/pods/train-0")
        await eventually(lambda: len(w.events) >= 3, what="the graceful deletion's MODIFIED")
        assert w.watcher.pods()[w.events[2].uid].name == "train-0"
        await asyncio.to_thread(delete_pod_now, kube_apiserver, kube_namespace, "train-0")
        await eventually(lambda: len(w.events) >= 5, what="DELETED")
        assert w.seen() == [(ADDED, "train-0", "Pending"), (MODIFIED, "train-0", "Running"),
                            (MODIFIED, "train-0", "Running"), (MODIFIED, "train-0", "Running"),
                            (DELETED, "train-0", "Running")]
        running = w.events[1]
        runtime_id = obj["status"]["containerStatuses"][0]["containerID"]
        assert running.containers[0].container_id == runtime_id.removeprefix("containerd://")
        assert running.started_at_unix_ms == DEFAULT_STARTED_AT_UNIX_MS
        assert dict(running.gpu_requests) == {"nvidia.com/gpu": 1} and running.labels["team"] == "a"
        assert w.watcher.pods() == {}
        assert w.relists == [0] and w.errors == []


async def test_an_api_server_restart_mid_watch_relists_after_410_and_misses_nothing(kube_apiserver,
                                                                                   kube_namespace):
    """The collector reaches the server through a gate; with the gate closed the server restarts (its watch cache
    starts afresh) and pods change; the watch from the old resourceVersion then gets 410 Gone, and the relist
    reports what changed: the deleted pod DELETED, the relabelled one MODIFIED, the new one ADDED."""
    node = node_name()
    for name in ("a-gone", "b-changed", "d-same"):
        await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, name, node))
    gate = await TcpGate(kube_apiserver.port).start()
    try:
        async with watching(kube_apiserver, node, port=gate.port) as w:
            await eventually(lambda: w.watcher.has_synced, what="first list")
            assert sorted(w.seen()) == [(ADDED, "a-gone", "Running"), (ADDED, "b-changed", "Running"),
                                        (ADDED, "d-same", "Running")]
            rv_before = int(w.watcher.resource_version)
            gate.close()
            await asyncio.to_thread(kube_apiserver.restart_apiserver)
            await asyncio.to_thread(delete_pod_now, kube_apiserver, kube_namespace, "a-gone")
            await asyncio.to_thread(
                kube_apiserver.must, "PATCH", f"/api/v1/namespaces/{kube_namespace}/pods/b-changed",
                {"metadata": {"labels": {"v": "2"}}}, content_type="application/merge-patch+json")
            await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, "c-new", node))
            gate.open()
            await eventually(lambda: len(w.events) >= 6, what="the relist's events")
            assert sorted(w.seen(3)) == [(ADDED, "c-new", "Running"), (DELETED, "a-gone", "Running"),
                                         (MODIFIED, "b-changed", "Running")]
            assert ERROR_EXPIRED in w.errors
            assert w.relists == [3, 3]
            assert {p.name for p in w.watcher.pods().values()} == {"b-changed", "c-new", "d-same"}
            assert w.watcher.pods()[next(u for u, p in w.watcher.pods().items() if p.name == "b-changed")
                                    ].labels["v"] == "2"
            assert int(w.watcher.resource_version) > rv_before
            # And it watches on: a change after the restart arrives through the watch, no further relist.
            await asyncio.to_thread(delete_pod_now, kube_apiserver, kube_namespace, "d-same")
            await eventually(lambda: len(w.events) >= 8, what="DELETED through the new watch")
            # A bound pod is marked (deletionTimestamp) before it is removed, even with gracePeriodSeconds=0.
            assert w.seen(6) == [(MODIFIED, "d-same", "Running"), (DELETED, "d-same", "Running")]
            assert w.relists == [3, 3]
    finally:
        await gate.stop()


async def test_a_network_outage_resumes_the_watch_from_its_resource_version_without_a_relist(kube_apiserver,
                                                                                            kube_namespace):
    node = node_name()
    await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, "a", node))
    gate = await TcpGate(kube_apiserver.port).start()
    try:
        async with watching(kube_apiserver, node, port=gate.port) as w:
            await eventually(lambda: len(w.events) == 1, what="first list")
            gate.close()
            await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, "b", node))
            await asyncio.to_thread(delete_pod_now, kube_apiserver, kube_namespace, "a")
            await eventually(lambda: len(w.errors) >= 2, what="failed attempts while cut off")
            gate.open()
            await eventually(lambda: len(w.events) >= 5, what="the events missed while cut off")
            assert w.seen(1) == [(ADDED, "b", "Pending"), (MODIFIED, "b", "Running"), (MODIFIED, "a", "Running"),
                                 (DELETED, "a", "Running")]
            assert w.relists == [1] and ERROR_EXPIRED not in w.errors
    finally:
        await gate.stop()


async def test_bookmarks_carry_the_resource_version_past_other_nodes_changes(kube_apiserver, kube_namespace):
    """The real server sends a BOOKMARK before a watch's timeoutSeconds ends it (about 2 s before); changes on
    another node move the watcher's resourceVersion only through it, without an event."""
    node, elsewhere = node_name(), node_name()
    await asyncio.to_thread(create_running_pod, kube_apiserver, gpu_pod(kube_namespace, "mine", node))
    async with watching(kube_apiserver, node, timeout_seconds=5) as w:
        await eventually(lambda: len(w.events) == 1, what="first list")
        listed_rv = int(w.watcher.resource_version)
        _, other = await asyncio.to_thread(create_running_pod, kube_apiserver,
                                           gpu_pod(kube_namespace, "theirs", elsewhere))
        other_rv = int(other["metadata"]["resourceVersion"])
        assert other_rv > listed_rv
        await eventually(lambda: int(w.watcher.resource_version) >= other_rv, what="a bookmark past the change")
        assert len(w.events) == 1 and w.relists == [1] and w.errors == []


async def test_node_facts_from_a_real_node(kube_apiserver):
    """A Node as EKS with Karpenter registers it: the collector reads providerID, instance type, region, zone and
    capacity type from it."""
    name = node_name()
    node = make_node_object(name, provider="aws", region="us-east-1", zone="us-east-1a",
                            instance_type="p5.48xlarge", price_model="spot",
                            provider_id="aws:///us-east-1a/i-0abc1234def567890")
    body = {k: v for k, v in node.items() if k != "status"}
    body["metadata"] = {k: v for k, v in node["metadata"].items() if k != "uid"}
    await call(kube_apiserver, "POST", "/api/v1/nodes", body)
    api = client.ApiClient(kube_apiserver.admin_configuration())
    try:
        read = await read_node_object(api, name)
    finally:
        await api.close()
    resolved = node_facts_from_node("test", name, read, NodeFactOverrides())
    facts = resolved.facts
    assert (facts.cloud_provider, facts.region, facts.zone, facts.instance_type, facts.price_model,
            facts.provider_id) == ("aws", "us-east-1", "us-east-1a", "p5.48xlarge", "spot",
                                   "aws:///us-east-1a/i-0abc1234def567890")
    assert set(resolved.sources.values()) == {"node"}


# --- DRA ---------------------------------------------------------------------------------------------------------


def dra_node(node: str):
    """The dra scenario and its node renamed ``node`` (nodes are cluster-wide: each test has its own)."""
    scenario = load_scenario("scenarios/dra.yaml")
    return scenario, dataclasses.replace(scenario.nodes[0], name=node)


DEVICE_CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": "gpu.nvidia.com"},
                "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}}


async def test_dra_slices_and_claims_pass_the_servers_validation_and_resolve_as_against_the_peer(
        kube_apiserver, kube_namespace):
    from services.collector.podresources.client import ContainerClaimDevice
    from services.collector.dra import resolve_claim_devices

    status, _ = await asyncio.to_thread(kube_apiserver.request, "GET",
                                        "/apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com")
    if status == 404:
        await call(kube_apiserver, "POST", "/apis/resource.k8s.io/v1/deviceclasses", DEVICE_CLASS)
    node = node_name()
    scenario, spec = dra_node(node)
    slices = sim_dra.resource_slices(spec)
    for obj in slices:
        body = {k: v for k, v in obj.items()}
        body["metadata"] = {"name": f"{node}-gpu.nvidia.com"}
        await call(kube_apiserver, "POST", "/apis/resource.k8s.io/v1/resourceslices", body)

    # One claim per GPU of the node: a whole GPU, then (where the node has them) the MIG devices.
    claims = []
    devices = slice_devices(slices, node)
    for index, (driver, pool, device) in enumerate(sorted(devices)[:3]):
        name = f"claim-{index}"
        gpu, instance = _unit_of(spec, device)
        claim = sim_dra.resource_claim(scenario.seed, spec, kube_namespace, name, gpu, instance,
                                       [(f"pod-{index}", str(uuid.uuid4()))])
        create = {k: v for k, v in claim.items() if k != "status"}
        create["metadata"] = {"name": name, "namespace": kube_namespace}
        created = await call(kube_apiserver, "POST",
                             f"/apis/resource.k8s.io/v1/namespaces/{kube_namespace}/resourceclaims", create)
        created["status"] = claim["status"]
        await call(kube_apiserver, "PUT",
                   f"/apis/resource.k8s.io/v1/namespaces/{kube_namespace}/resourceclaims/{name}/status", created)
        claims.append((name, device, claim))

    items = [ContainerClaimDevice(kube_namespace, f"pod-{i}", "main", kube_namespace, name, "gpu.nvidia.com",
                                  node, device, (f"k8s.gpu.nvidia.com/claim=x-{device}",))
             for i, (name, device, _) in enumerate(claims)]
    api = client.ApiClient(kube_apiserver.admin_configuration())
    try:
        reader = DraApiReader(api, node)
        resolver = DraResolver(node, reader.list_slices, reader.read_claim)
        got = await resolver.assignments(items)
    finally:
        await api.close()
    expected, unresolved = resolve_claim_devices(items, devices, {(kube_namespace, name): claim
                                                                   for name, _, claim in claims})
    assert unresolved == () and resolver.unresolved_total == 0
    assert got == expected
    assert all(isinstance(a, DeviceAssignment) and a.device_ids[0].startswith(("GPU-", "MIG-"))
               for containers in got.values() for assignments in containers.values() for a in assignments)


def _unit_of(spec, device: str) -> tuple[int, int | None]:
    for gpu in spec.gpus:
        if sim_dra.device_name(gpu, None) == device:
            return gpu.index, None
        for i in range(len(gpu.sharing.mig_instances)):
            if sim_dra.device_name(gpu, i) == device:
                return gpu.index, i
    raise AssertionError(f"no unit named {device}")
