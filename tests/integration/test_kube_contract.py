"""Our peer (``simulator/apiserver.py``, what replay and ``--simulate`` run the collector against) checked against
the real kube-apiserver: the same sequence of pods gives the collector the same PodEvents from both, and the same
requests get the same answers (lists, paging, field selectors, watches, bookmarks, error Status objects).

The peer is fixed where they differ; what it does not model is listed in its module docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import uuid
from urllib.parse import quote

import aiohttp
import pytest
from kubernetes_asyncio import client

from gpumeter.clock import ManualClock
from schemas.devices import HAMI_RESOURCE
from schemas.records import PodEvent
from services.collector.podwatch import PodWatcher, make_api_client
from services.collector.simulation import pod_object
from simulator import dra as sim_dra
from simulator.apiserver import FakeApiServer, make_namespace_object, make_node_object
from simulator.scenario import load_scenario
from simulator.world import SimWorld
from tests.integration.kube_world import create_running_pod, delete_pod_now, new_namespace, pending_form

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WAIT_S = 30.0
START_MS = 1_795_000_000_000


async def eventually(predicate, timeout_s: float = WAIT_S, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def peer_server(**kwargs):
    peer = FakeApiServer(**kwargs)
    await peer.start()
    try:
        yield peer
    finally:
        await peer.stop()


@contextlib.asynccontextmanager
async def collecting(api: client.ApiClient, node: str):
    events: list[PodEvent] = []

    async def on_event(event: PodEvent) -> None:
        events.append(event)

    watcher = PodWatcher(api, node, "test", ManualClock(START_MS), on_event, backoff_initial_s=0.05,
                         backoff_max_s=0.2, rng=random.Random(5))
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: watcher.has_synced, what="first list")
        yield events
    finally:
        await watcher.stop()
        await task
        await api.close()


# --- the same pods, the same PodEvents ---------------------------------------------------------------------------


def _renamed(obj: dict, namespaces: dict[str, str], node: str) -> dict:
    obj = json.loads(json.dumps(obj))
    obj["metadata"]["namespace"] = namespaces[obj["metadata"]["namespace"]]
    obj["spec"]["nodeName"] = node
    return obj


def _comparable(event: PodEvent, uids: dict[str, str]) -> PodEvent:
    return dataclasses.replace(event, resource_version="", observed_at_unix_ms=0, uid=uids.get(event.uid, event.uid))


@pytest.mark.parametrize("scenario_name", ["churn", "statefulset_restart", "hami", "dra"])
async def test_a_scenarios_pods_give_the_same_pod_events_from_both_servers(kube_apiserver, scenario_name):
    """Every pod of the scenario's first node, as the simulation serves it to the peer, goes through both servers
    in the same order: created bound (Pending, as the server keeps a new pod), its status written by the kubelet
    (Running), deleted with gracePeriodSeconds=0 (at its end, or when the scenario ends: the real server marks it,
    MODIFIED, then removes it, DELETED; the peer is told both steps). The collector's pod watch on each publishes the
    same PodEvents (the real server's uids mapped to the scenario's)."""
    scenario = load_scenario(f"scenarios/{scenario_name}.yaml")
    spec_node = scenario.nodes[0]
    prefix = f"c{uuid.uuid4().hex[:6]}"
    node = f"{prefix}-{spec_node.name}"
    namespaces = {ns.name: f"{prefix}-{ns.name}" for ns in scenario.all_namespaces()}
    uids: dict[str, str] = {}  # the real server's uid -> the scenario's
    async with peer_server() as peer:
        for ns in scenario.all_namespaces():
            await asyncio.to_thread(new_namespace, kube_apiserver, ns.labels, name=namespaces[ns.name])
            peer.add_namespace(make_namespace_object(namespaces[ns.name], ns.labels))
        async with collecting(make_api_client(peer.url, None, None, True), node) as from_peer, \
                collecting(client.ApiClient(kube_apiserver.admin_configuration()), node) as from_real:
            world = SimWorld(scenario)
            served: dict[str, tuple[str, str]] = {}
            changes = 0
            ticks = [scenario.start_unix_ms + k * scenario.interval_ms
                     for k in range(int(scenario.duration_seconds * 1000 // scenario.interval_ms) + 1)]
            for now_ms in ticks:
                world.step(now_ms)
                current = {pod.uid: pod for pod in world.pods_at(now_ms, spec_node.name)}
                for uid in [u for u in served if u not in current]:
                    namespace, name = served.pop(uid)
                    await asyncio.to_thread(delete_pod_now, kube_apiserver, namespace, name)
                    peer.mark_pod_deleting(uid)
                    peer.delete_pod(uid)
                    changes += 2
                for uid, pod in current.items():
                    if uid in served:
                        continue
                    obj = _renamed(pod_object(pod), namespaces, node)
                    created, _ = await asyncio.to_thread(create_running_pod, kube_apiserver, obj)
                    uids[created["metadata"]["uid"]] = uid
                    peer.add_pod(pending_form(obj, {"status": {"phase": "Pending",
                                                               "qosClass": obj["status"]["qosClass"]}}))
                    peer.modify_pod(obj)
                    served[uid] = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                    changes += 2
            for uid, (namespace, name) in list(served.items()):
                await asyncio.to_thread(delete_pod_now, kube_apiserver, namespace, name)
                peer.mark_pod_deleting(uid)
                peer.delete_pod(uid)
                changes += 2
            assert changes >= 12, "the scenario should create and delete several pods on the node"
            await eventually(lambda: len(from_peer) >= changes and len(from_real) >= changes,
                             what=f"{changes} events from each server")
            await asyncio.sleep(0.5)  # nothing more may come
            real = [_comparable(e, uids) for e in from_real]
            ours = [_comparable(e, {}) for e in from_peer]
            assert len(real) == len(ours) == changes
            for index, (a, b) in enumerate(zip(real, ours)):
                assert a == b, f"event {index} differs:\nreal {a}\npeer {b}"
            if scenario_name == "hami":  # HAMi's allocation annotation, as HAMi writes it, read through both
                assert any(a.resource_name == HAMI_RESOURCE for e in real for c in e.containers
                           for a in c.assigned_devices)


# --- the same requests, the same answers ---------------------------------------------------------------------------


class Both:
    """The same state on both servers: what the test writes to the real one, the peer is given as stored."""

    def __init__(self, real, peer: FakeApiServer, session: aiohttp.ClientSession) -> None:
        self.real, self.peer, self.session = real, peer, session

    async def get(self, path: str, *, token: str | None = None) -> tuple[tuple[int, object], tuple[int, object]]:
        real = await asyncio.to_thread(self.real.request, "GET", path, token=token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.get(f"{self.peer.url}{path}", headers=headers) as response:
            peer = (response.status, await response.json(content_type=None))
        return real, peer

    async def watch(self, path: str, until, timeout_s: float = 15.0) -> tuple[list[dict], list[dict]]:
        """The events each server streams for ``path`` (a watch) until the stream ends or ``until(events)``."""
        async def read_real() -> list[dict]:
            context = self.real.ssl_context()
            events: list[dict] = []
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{self.real.url}{path}", ssl=context) as response:
                    async for line in response.content:
                        if line.strip():
                            events.append(json.loads(line))
                            if until(events):
                                break
            return events

        async def read_peer() -> list[dict]:
            events: list[dict] = []
            async with self.session.get(f"{self.peer.url}{path}") as response:
                async for line in response.content:
                    if line.strip():
                        events.append(json.loads(line))
                        if until(events):
                            break
            return events

        return tuple(await asyncio.wait_for(asyncio.gather(read_real(), read_peer()), timeout_s))  # type: ignore


@contextlib.asynccontextmanager
async def both_servers(kube_apiserver):
    async with peer_server() as peer, aiohttp.ClientSession() as session:
        yield Both(kube_apiserver, peer, session)


def _status(answer: tuple[int, object]) -> tuple[int, str, str, int]:
    code, body = answer
    assert isinstance(body, dict) and body.get("kind") == "Status", body
    return code, body["reason"], body["message"], body["code"]


def _names(answer: tuple[int, object]) -> list[str]:
    return [item["metadata"]["name"] for item in answer[1]["items"]]


async def _mirrored_cluster(kube_apiserver, peer: FakeApiServer) -> dict:
    """A namespace, three running pods on one node and one on another, the Node, a ResourceSlice and a
    ResourceClaim: on the real server, and as it stores them on the peer."""
    prefix = uuid.uuid4().hex[:6]
    node, other = f"n-{prefix}", f"m-{prefix}"
    namespace = await asyncio.to_thread(new_namespace, kube_apiserver, {"team": "a"})
    stored_ns = await asyncio.to_thread(kube_apiserver.must, "GET", f"/api/v1/namespaces/{namespace}")
    peer.add_namespace(stored_ns)
    from simulator.apiserver import make_pod_object

    for name, where in (("p-a", node), ("p-c", node), ("p-b", node), ("q-x", other)):
        obj = make_pod_object(namespace, name, f"uid-{name}", where, gpu_requests={"nvidia.com/gpu": 1})
        _, running = await asyncio.to_thread(create_running_pod, kube_apiserver, obj)
        peer.add_pod(running)
    node_obj = make_node_object(node, provider="aws", region="us-east-1", zone="us-east-1a",
                                instance_type="p5.48xlarge", price_model="spot",
                                provider_id="aws:///us-east-1a/i-0123")
    node_obj["metadata"].pop("uid")
    node_obj.pop("status")
    peer.put_node(await asyncio.to_thread(kube_apiserver.must, "POST", "/api/v1/nodes", node_obj))
    scenario = load_scenario("scenarios/dra.yaml")
    spec = dataclasses.replace(scenario.nodes[0], name=node)
    status, _ = await asyncio.to_thread(kube_apiserver.request, "GET",
                                        "/apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com")
    if status == 404:
        from tests.integration.test_kube_collector import DEVICE_CLASS

        await asyncio.to_thread(kube_apiserver.must, "POST", "/apis/resource.k8s.io/v1/deviceclasses", DEVICE_CLASS)
    slice_obj = sim_dra.resource_slices(spec)[0]
    slice_obj["metadata"] = {"name": f"{node}-gpu.nvidia.com"}
    peer.put_resource_slice(await asyncio.to_thread(kube_apiserver.must, "POST",
                                                    "/apis/resource.k8s.io/v1/resourceslices", slice_obj))
    claim = sim_dra.resource_claim(scenario.seed, spec, namespace, "claim-0", 0, None, [("p-a", "uid-p-a")])
    body = {k: v for k, v in claim.items() if k != "status"}
    body["metadata"] = {"name": "claim-0", "namespace": namespace}
    created = await asyncio.to_thread(kube_apiserver.must, "POST",
                                      f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", body)
    created["status"] = claim["status"]
    peer.put_resource_claim(await asyncio.to_thread(
        kube_apiserver.must, "PUT", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/claim-0/status",
        created))
    return {"namespace": namespace, "node": node, "other": other}


def q(selector: str) -> str:
    return quote(selector, safe="")


async def test_the_same_reads_get_the_same_answers(kube_apiserver):
    async with both_servers(kube_apiserver) as both:
        c = await _mirrored_cluster(kube_apiserver, both.peer)
        ns, node = c["namespace"], c["node"]

        # A node's pods, paged: etcd's key order, the continue token; items without apiVersion/kind (the list's
        # own name them); no remainingItemCount under a selector (the server cannot know it), one without.
        real, peer = await both.get(f"/api/v1/pods?fieldSelector={q('spec.nodeName=' + node)}&limit=2")
        for code, body in (real, peer):
            assert code == 200 and body["kind"] == "PodList" and body["apiVersion"] == "v1"
            assert body["metadata"]["continue"] and "remainingItemCount" not in body["metadata"]
            assert all("kind" not in item and "apiVersion" not in item for item in body["items"])
        unselected = await both.get(f"/api/v1/namespaces/{ns}/pods?limit=3")
        assert [body["metadata"]["remainingItemCount"] for _, body in unselected] == [1, 1]
        assert _names(unselected[0]) == _names(unselected[1]) == ["p-a", "p-b", "p-c"]
        assert _names(real) == _names(peer) == ["p-a", "p-b"]
        real2, peer2 = (await both.get(f"/api/v1/pods?fieldSelector={q('spec.nodeName=' + node)}&limit=2&continue="
                                       f"{q(real[1]['metadata']['continue'])}"))[0], \
            (await both.get(f"/api/v1/pods?fieldSelector={q('spec.nodeName=' + node)}&limit=2&continue="
                            f"{q(peer[1]['metadata']['continue'])}"))[1]
        assert _names(real2) == _names(peer2) == ["p-c"]
        assert "continue" not in real2[1]["metadata"] and "continue" not in peer2[1]["metadata"]

        for selector in (f"spec.nodeName={node},status.phase=Running", f"spec.nodeName!={node}",
                         f"metadata.namespace={ns},spec.nodeName=={node}"):
            real, peer = await both.get(f"/api/v1/namespaces/{ns}/pods?fieldSelector={q(selector)}")
            assert real[0] == peer[0] == 200 and _names(real) == _names(peer), selector

        # The Node, a Namespace, the node's ResourceSlices, a ResourceClaim: the objects the collector reads.
        real, peer = await both.get(f"/api/v1/nodes/{node}")
        assert real[0] == peer[0] == 200 and real[1]["metadata"]["labels"] == peer[1]["metadata"]["labels"]
        assert real[1]["spec"]["providerID"] == peer[1]["spec"]["providerID"]
        real, peer = await both.get(f"/api/v1/namespaces/{ns}")
        assert real[1]["metadata"]["labels"] == peer[1]["metadata"]["labels"] == {
            "kubernetes.io/metadata.name": ns, "team": "a"}
        real, peer = await both.get(f"/api/v1/namespaces?fieldSelector={q('metadata.name=' + ns)}")
        assert _names(real) == _names(peer) == [ns] and real[1]["kind"] == peer[1]["kind"] == "NamespaceList"
        real, peer = await both.get(f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector="
                                    f"{q('spec.nodeName=' + node)}")
        assert real[0] == peer[0] == 200 and _names(real) == _names(peer) == [f"{node}-gpu.nvidia.com"]
        assert (real[1]["kind"], real[1]["apiVersion"]) == (peer[1]["kind"], peer[1]["apiVersion"])
        assert real[1]["items"][0]["spec"] == peer[1]["items"][0]["spec"]
        real, peer = await both.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/claim-0")
        assert real[0] == peer[0] == 200 and real[1]["status"] == peer[1]["status"]


async def test_the_same_bad_requests_get_the_same_error_status(kube_apiserver):
    async with both_servers(kube_apiserver) as both:
        c = await _mirrored_cluster(kube_apiserver, both.peer)
        ns = c["namespace"]
        cases = [
            f"/api/v1/pods?fieldSelector={q('spec.bogus=x')}",
            f"/api/v1/namespaces?fieldSelector={q('spec.bogus=x')}",
            f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector={q('spec.bogus=x')}",
            "/api/v1/nodes/no-such-node",
            "/api/v1/namespaces/no-such-namespace",
            f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/no-such-claim",
            "/api/v1/pods?limit=1&continue=not-a-token",
        ]
        for path in cases:
            real, peer = await both.get(path)
            if "continue=" in path:  # the decoder's own words follow: "invalid continue token: <why>: <detail>"
                assert _status(real)[:2] == _status(peer)[:2]
                assert _status(real)[2].split(": ")[:2] == _status(peer)[2].split(": ")[:2] == [
                    "invalid continue token", "continue key is not valid"]
                continue
            assert _status(real) == _status(peer), path
        # A wrong token: 401 from both (the peer set up with a token of its own).
        async with peer_server(token="right") as guarded, aiohttp.ClientSession() as session:
            async with session.get(f"{guarded.url}/api/v1/pods",
                                   headers={"Authorization": "Bearer wrong"}) as response:
                peer = (response.status, await response.json(content_type=None))
        real = await asyncio.to_thread(kube_apiserver.request, "GET", "/api/v1/pods", token="wrong")
        assert _status(real) == _status(peer)


async def test_the_same_watches_stream_the_same_events(kube_apiserver):
    async with both_servers(kube_apiserver) as both:
        c = await _mirrored_cluster(kube_apiserver, both.peer)
        ns, node = c["namespace"], c["node"]
        selector = q("spec.nodeName=" + node)

        # From a resourceVersion older than the watch cache holds (the server restarted: its cache starts at the
        # current resourceVersion): one ERROR event with a 410 Expired Status, then the end.
        await asyncio.to_thread(kube_apiserver.restart_apiserver)
        real, peer = await both.watch(f"/api/v1/pods?watch=true&fieldSelector={selector}&resourceVersion=1",
                                      until=lambda events: False)
        assert [e["type"] for e in real] == [e["type"] for e in peer] == ["ERROR"]
        for event in (real[0], peer[0]):
            status = event["object"]
            assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
            assert re.fullmatch(r"too old resource version: 1 \(\d+\)", status["message"]), status

        # Without a resourceVersion: the node's pods as ADDED, in key order.
        real, peer = await both.watch(f"/api/v1/pods?watch=true&fieldSelector={selector}&timeoutSeconds=2",
                                      until=lambda events: len(events) >= 3)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in real] == \
               [(e["type"], e["object"]["metadata"]["name"]) for e in peer] == \
               [("ADDED", "p-a"), ("ADDED", "p-b"), ("ADDED", "p-c")]

        # From the list's resourceVersion with bookmarks and a timeout: the deletion (marked, then removed); a
        # change on another node; then a BOOKMARK before the server ends the watch (a zero-value Pod carrying the
        # newest resourceVersion; the real server may send two, a second after the first).
        real_rv = (await asyncio.to_thread(kube_apiserver.must, "GET", f"/api/v1/pods?fieldSelector={selector}"))[
            "metadata"]["resourceVersion"]
        peer_rv = both.peer.resource_version
        path = "/api/v1/pods?watch=true&fieldSelector={}&allowWatchBookmarks=true&timeoutSeconds=5&resourceVersion={}"
        from simulator.apiserver import make_pod_object

        async def change_soon():
            await asyncio.sleep(0.5)
            await asyncio.to_thread(delete_pod_now, kube_apiserver, ns, "p-b")
            uid = next(uid for uid, p in both.peer.pods().items() if p["metadata"]["name"] == "p-b")
            both.peer.mark_pod_deleting(uid)
            both.peer.delete_pod(uid)
            elsewhere = make_pod_object(ns, "q-y", "uid-q-y", c["other"])
            _, running = await asyncio.to_thread(create_running_pod, kube_apiserver, elsewhere)
            both.peer.add_pod(running)
            return int(running["metadata"]["resourceVersion"])

        changing = asyncio.create_task(change_soon())
        real_events, _ = await _watch_one(both, kube_apiserver, path.format(selector, real_rv), real=True)
        other_rv = await changing
        peer_events, _ = await _watch_one(both, kube_apiserver, path.format(selector, peer_rv), real=False)
        real_types = [t for i, t in enumerate(e["type"] for e in real_events)
                      if not (t == "BOOKMARK" and i > 0 and real_events[i - 1]["type"] == "BOOKMARK")]
        assert real_types == [e["type"] for e in peer_events] == ["MODIFIED", "DELETED", "BOOKMARK"]
        assert real_events[1]["object"]["metadata"]["name"] == peer_events[1]["object"]["metadata"]["name"] == "p-b"
        real_bookmark, peer_bookmark = real_events[2]["object"], peer_events[2]["object"]
        assert _shape(real_bookmark) == _shape(peer_bookmark)
        assert int(real_bookmark["metadata"]["resourceVersion"]) == other_rv
        assert int(peer_bookmark["metadata"]["resourceVersion"]) == int(both.peer.resource_version)


async def _watch_one(both: Both, kube_apiserver, path: str, *, real: bool) -> tuple[list[dict], float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    events: list[dict] = []
    if real:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{kube_apiserver.url}{path}", ssl=kube_apiserver.ssl_context()) as response:
                async for line in response.content:
                    if line.strip():
                        events.append(json.loads(line))
    else:
        async with both.session.get(f"{both.peer.url}{path}") as response:
            async for line in response.content:
                if line.strip():
                    events.append(json.loads(line))
    return events, loop.time() - started


def _shape(obj):
    """The keys of ``obj`` at every level, with the values of those that are not data (None, empty)."""
    if isinstance(obj, dict):
        return {k: _shape(v) if isinstance(v, (dict, list)) or v is None else type(v).__name__ for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return obj
