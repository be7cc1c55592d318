"""PodWatcher and NamespaceWatcher against the fake API server: list, watch, bookmarks, 410 Gone, outages, paging,
clients; the namespaces' labels on the pods' events."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError, InvalidMessage
from schemas.records import PodEvent, PodEventType
from services.collector.namespaces import NamespaceEvent
from services.collector.podwatch import (
    ERROR_EXPIRED,
    ERROR_REJECTED,
    NamespaceWatcher,
    PodWatcher,
    in_cluster_api_client,
    make_api_client,
)
from simulator.apiserver import FakeApiServer, make_namespace_object, make_pod_object

NODE = "gpu-node-a"
OTHER_NODE = "gpu-node-b"
CLUSTER = "test"
START_MS = 1_795_000_000_000
WAIT_S = 5.0

ADDED, MODIFIED, DELETED = PodEventType.ADDED, PodEventType.MODIFIED, PodEventType.DELETED


def gpu_pod(name: str, node: str = NODE, **kwargs) -> dict:
    return make_pod_object("ml", name, f"uid-{name}", node, gpu_requests={"nvidia.com/gpu": 1}, **kwargs)


@dataclass
class Harness:
    server: FakeApiServer
    watcher: PodWatcher
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    errors: list[str] = field(default_factory=list)
    relists: list[int] = field(default_factory=list)
    invalid: list[InvalidMessage] = field(default_factory=list)

    async def next(self, count: int = 1) -> list[tuple[PodEventType, str]]:
        """The next ``count`` events as (type, pod name)."""
        got = [await asyncio.wait_for(self.events.get(), WAIT_S) for _ in range(count)]
        return [(e.event_type, e.name) for e in got]

    async def next_event(self) -> PodEvent:
        return await asyncio.wait_for(self.events.get(), WAIT_S)

    def watch_requests(self):
        return [r for r in self.server.requests if r.is_watch]

    def list_requests(self):
        return [r for r in self.server.requests if not r.is_watch]


async def eventually(predicate, timeout_s: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def server():
    fake = FakeApiServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@contextlib.asynccontextmanager
async def watching(server: FakeApiServer, *, token: str | None = None, **kwargs):
    api = make_api_client(server.url, token, None, True)
    events: asyncio.Queue = asyncio.Queue()

    async def on_event(event: PodEvent) -> None:
        events.put_nowait(event)

    harness_errors: list[str] = []
    relists: list[int] = []
    invalid: list[InvalidMessage] = []
    watcher = PodWatcher(
        api,
        NODE,
        CLUSTER,
        ManualClock(START_MS),
        on_event,
        backoff_initial_s=0.02,
        backoff_max_s=0.1,
        rng=random.Random(7),
        on_relist=relists.append,
        on_watch_error=harness_errors.append,
        on_invalid_pod=invalid.append,
        **kwargs,
    )
    harness = Harness(server, watcher, events, harness_errors, relists, invalid)
    task = asyncio.create_task(watcher.run())
    try:
        yield harness
    finally:
        await watcher.stop()
        await task  # run() returns normally after stop(); an error inside it fails the test here
        await api.close()


@pytest.mark.network
async def test_initial_list_emits_this_nodes_pods_only(server):
    mine = [gpu_pod(f"mine-{i}") for i in range(3)]
    for obj in mine + [gpu_pod("theirs-0", OTHER_NODE), gpu_pod("theirs-1", OTHER_NODE)]:
        server.add_pod(obj)
    async with watching(server) as h:
        got = await h.next(3)
        assert sorted(got) == sorted((ADDED, o["metadata"]["name"]) for o in mine)
        assert h.watcher.has_synced
        assert set(h.watcher.pods()) == {o["metadata"]["uid"] for o in mine}
        assert h.list_requests()[0].query["fieldSelector"] == f"spec.nodeName={NODE}"

        # Pods landing on another node never show up: the next event is the one for this node.
        await server.wait_for_watches(1)
        server.add_pod(gpu_pod("theirs-2", OTHER_NODE))
        server.add_pod(gpu_pod("mine-3"))
        assert await h.next() == [(ADDED, "mine-3")]
        assert h.relists == [3]


@pytest.mark.network
async def test_added_modified_deleted_through_the_watch(server):
    async with watching(server) as h:
        await eventually(lambda: h.watcher.has_synced)
        await server.wait_for_watches(1)
        stored = server.add_pod(gpu_pod("trainer", labels={"team": "a"}))
        added = await h.next_event()
        assert (added.event_type, added.uid, added.resource_version) == (
            ADDED, stored["metadata"]["uid"], stored["metadata"]["resourceVersion"])
        assert added.observed_at_unix_ms == START_MS
        assert dict(added.gpu_requests) == {"nvidia.com/gpu": 1}

        changed = gpu_pod("trainer", labels={"team": "b"})
        stored = server.modify_pod(changed)
        modified = await h.next_event()
        assert modified.event_type == MODIFIED
        assert dict(modified.labels) == {"team": "b"}
        assert modified.resource_version == stored["metadata"]["resourceVersion"]
        assert h.watcher.pods()[modified.uid] == modified

        final = server.delete_pod(modified.uid)
        deleted = await h.next_event()
        assert (deleted.event_type, deleted.resource_version) == (DELETED, final["metadata"]["resourceVersion"])
        assert modified.uid not in h.watcher.pods()
        assert h.watcher.resource_version == final["metadata"]["resourceVersion"]


@pytest.mark.network
async def test_a_pod_bound_to_this_node_arrives_as_added(server):
    pending = gpu_pod("queued", node="", phase="Pending")
    server.add_pod(pending)
    async with watching(server) as h:
        await eventually(lambda: h.watcher.has_synced)
        await server.wait_for_watches(1)
        assert h.events.empty()
        bound = dict(pending, spec=dict(pending["spec"], nodeName=NODE))
        server.modify_pod(bound)
        assert await h.next() == [(ADDED, "queued")]
        moved = dict(bound, spec=dict(bound["spec"], nodeName=OTHER_NODE))
        server.modify_pod(moved)  # not something Kubernetes allows, but the selector semantics must hold
        assert await h.next() == [(DELETED, "queued")]


@pytest.mark.network
async def test_bookmarks_advance_the_resource_version_of_the_next_watch(server):
    async with watching(server) as h:
        await eventually(lambda: h.watcher.has_synced)
        await server.wait_for_watches(1)
        first = h.watch_requests()[0]
        assert first.query["allowWatchBookmarks"].lower() == "true"
        assert first.resource_version == server.resource_version == h.watcher.resource_version
        # Changes on another node move the global resourceVersion without any event for this watcher.
        for i in range(3):
            server.add_pod(gpu_pod(f"elsewhere-{i}", OTHER_NODE))
        bookmark_rv = server.send_bookmark()
        assert bookmark_rv != first.resource_version
        await eventually(lambda: h.watcher.resource_version == bookmark_rv)

        server.drop_connections()
        await eventually(lambda: len(h.watch_requests()) >= 2)
        assert h.watch_requests()[1].resource_version == bookmark_rv
        assert h.events.empty()
        assert h.relists == [0]


@pytest.mark.network
async def test_gone_relists_and_reports_pods_deleted_meanwhile(server):
    for name in ("a-gone", "b-changed", "d-same"):
        server.add_pod(gpu_pod(name))
    async with watching(server) as h:
        before = {e[1] for e in await h.next(3)}
        assert before == {"a-gone", "b-changed", "d-same"}
        await server.wait_for_watches(1)
        last_known_a = h.watcher.pods()["uid-a-gone"]

        await server.set_down(True)
        server.delete_pod("uid-a-gone")
        server.modify_pod(gpu_pod("b-changed", labels={"v": "2"}))
        server.add_pod(gpu_pod("c-new"))
        server.expire_history()
        await server.set_down(False)

        got = [await h.next_event() for _ in range(3)]
        assert [(e.event_type, e.name) for e in got] == [(DELETED, "a-gone"), (MODIFIED, "b-changed"), (ADDED, "c-new")]
        assert got[0].labels == last_known_a.labels and got[0].resource_version == last_known_a.resource_version
        assert ERROR_EXPIRED in h.errors
        assert h.relists == [3, 3]
        assert set(h.watcher.pods()) == {"uid-b-changed", "uid-c-new", "uid-d-same"}
        await server.wait_for_watches(1)
        assert h.watch_requests()[-1].resource_version == server.resource_version
        await asyncio.sleep(0.1)
        assert h.events.empty()  # the unchanged pod was not re-announced


@pytest.mark.network
async def test_gone_as_an_error_event_mid_session_relists(server):
    server.add_pod(gpu_pod("keep"))
    async with watching(server) as h:
        await h.next()
        await server.wait_for_watches(1)
        server.drop_connections()
        server.delete_pod("uid-keep")
        server.add_pod(gpu_pod("new"))
        server.expire_history()
        got = await h.next(2)
        assert got == [(DELETED, "keep"), (ADDED, "new")]
        assert ERROR_EXPIRED in h.errors


@pytest.mark.network
@pytest.mark.parametrize("relist", [False, True], ids=["watched", "relisted"])
async def test_a_pod_recreated_under_its_name_is_deleted_then_added_with_its_new_uid(server, relist):
    """A StatefulSet pod deleted and created again: the API server refuses the name while the old pod exists, and
    the watcher (from the watch, or relisting after a 410) ends the old uid before it announces the new one."""
    server.add_pod(gpu_pod("llm-0"))
    again = make_pod_object("ml", "llm-0", "uid-llm-0-again", NODE, gpu_requests={"nvidia.com/gpu": 1})
    async with watching(server) as h:
        await h.next()
        await server.wait_for_watches(1)
        with pytest.raises(ValueError, match="ml/llm-0 already exists"):
            server.add_pod(again)
        if relist:
            server.drop_connections()
        server.delete_pod("uid-llm-0")
        server.add_pod(again)
        if relist:
            server.expire_history()
        got = [await h.next_event() for _ in range(2)]
        assert [(e.event_type, e.uid) for e in got] == [(DELETED, "uid-llm-0"), (ADDED, "uid-llm-0-again")]
        assert set(h.watcher.pods()) == {"uid-llm-0-again"}


@pytest.mark.network
@pytest.mark.parametrize("refuse", [False, True], ids=["503", "refused"])
async def test_outage_then_resume_without_missing_events(server, refuse):
    server.add_pod(gpu_pod("a"))
    server.add_pod(gpu_pod("b"))
    async with watching(server) as h:
        await h.next(2)
        await server.wait_for_watches(1)
        rv_before = h.watcher.resource_version

        await server.set_down(True, refuse=refuse)
        server.add_pod(gpu_pod("c"))
        server.modify_pod(gpu_pod("b", labels={"v": "2"}))
        server.delete_pod("uid-a")
        await eventually(lambda: len(h.errors) >= 3)  # it keeps retrying while the server is down
        await server.set_down(False)

        assert await h.next(3) == [(ADDED, "c"), (MODIFIED, "b"), (DELETED, "a")]
        assert h.relists == [2]  # resumed from the resourceVersion, no relist
        # Every attempt, the one that succeeded included, resumed from where the first watch stood.
        assert len(h.watch_requests()) >= 2
        assert all(r.resource_version == rv_before for r in h.watch_requests())
        assert h.watcher.resource_version == server.resource_version


@pytest.mark.network
async def test_paging_with_a_small_limit(server):
    names = [f"p{i:02d}" for i in range(7)]
    for i, name in enumerate(names):
        server.add_pod(gpu_pod(name))
        server.add_pod(gpu_pod(f"other-{i}", OTHER_NODE))
    async with watching(server, page_size=2) as h:
        got = await h.next(len(names))
        assert sorted(n for _, n in got) == names
        lists = h.list_requests()
        assert len(lists) == 4
        assert all(r.query["limit"] == "2" for r in lists)
        assert "continue" not in lists[0].query and all(r.query.get("continue") for r in lists[1:])
        # The watch starts from the snapshot the pages came from.
        await server.wait_for_watches(1)
        assert h.watch_requests()[0].resource_version == server.resource_version


@pytest.mark.network
async def test_a_page_snapshot_is_consistent_while_pods_change(server):
    for i in range(4):
        server.add_pod(gpu_pod(f"p{i}"))
    api = make_api_client(server.url, None, None, True)
    try:
        core = client.CoreV1Api(api)
        first = await core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}", limit=2)
        server.delete_pod("uid-p3")
        server.add_pod(gpu_pod("p4"))
        rest = await core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={NODE}", limit=2, _continue=first.metadata._continue
        )
        assert [p.metadata.name for p in first.items + rest.items] == ["p0", "p1", "p2", "p3"]
        assert rest.metadata.resource_version == first.metadata.resource_version

        again = await core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}", limit=2)
        server.expire_history()
        with pytest.raises(ApiException) as raised:
            await core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={NODE}", limit=2, _continue=again.metadata._continue
            )
        assert raised.value.status == 410
    finally:
        await api.close()


@pytest.mark.network
async def test_the_watch_resumes_when_the_server_ends_it(server):
    async with watching(server, timeout_seconds=1) as h:
        await eventually(lambda: h.watcher.has_synced)
        await server.wait_for_watches(1)
        server.add_pod(gpu_pod("early"))
        assert await h.next() == [(ADDED, "early")]
        await eventually(lambda: len(h.watch_requests()) >= 2, timeout_s=4)
        server.add_pod(gpu_pod("late"))
        assert await h.next() == [(ADDED, "late")]
        assert h.watch_requests()[1].resource_version == h.watcher.pods()["uid-early"].resource_version
        assert h.relists == [0]


@pytest.mark.network
async def test_an_unreadable_pod_is_skipped_and_the_watch_goes_on(server):
    async with watching(server) as h:
        await eventually(lambda: h.watcher.has_synced)
        await server.wait_for_watches(1)
        broken = gpu_pod("broken")
        broken["metadata"]["labels"] = ["not", "a", "map"]
        server.add_pod(broken)
        server.add_pod(gpu_pod("fine"))
        assert await h.next() == [(ADDED, "fine")]
        assert [e.reason_code for e in h.invalid] == ["BAD_POD_OBJECT"]
        assert h.watcher.resource_version == server.resource_version


@pytest.mark.network
async def test_bearer_token_is_sent_and_a_wrong_one_is_retried_not_fatal():
    async with FakeApiServer(token="s3cret") as fake:
        fake.add_pod(gpu_pod("a"))
        async with watching(fake, token="wrong") as h:
            await eventually(lambda: len(h.errors) >= 2)
            assert set(h.errors) == {ERROR_REJECTED}
            assert not h.watcher.has_synced
        async with watching(fake, token="s3cret") as h:
            assert await h.next() == [(ADDED, "a")]
            assert h.list_requests()[-1].authorization == "Bearer s3cret"


@pytest.mark.network
async def test_an_on_event_failure_ends_run_and_a_rerun_delivers_the_event_again(server):
    server.add_pod(gpu_pod("a"))
    api = make_api_client(server.url, None, None, True)
    delivered: list[PodEvent] = []
    fail = [True]

    async def on_event(event: PodEvent) -> None:
        if fail[0]:
            raise RuntimeError("kafka is down")
        delivered.append(event)

    watcher = PodWatcher(api, NODE, CLUSTER, ManualClock(START_MS), on_event, backoff_initial_s=0.02)
    try:
        with pytest.raises(RuntimeError, match="kafka is down"):
            await asyncio.wait_for(watcher.run(), WAIT_S)
        assert watcher.pods() == {}
        fail[0] = False
        task = asyncio.create_task(watcher.run())
        await eventually(lambda: len(delivered) == 1)
        assert (delivered[0].event_type, delivered[0].name) == (ADDED, "a")
        await watcher.stop()
        await task
    finally:
        await api.close()


@pytest.mark.network
async def test_backoff_doubles_to_the_cap_with_seeded_jitter(server):
    await server.set_down(True, refuse=True)
    api = make_api_client(server.url, None, None, True)
    delays: list[float] = []

    async def record(delay_s: float) -> None:
        delays.append(delay_s)
        await asyncio.sleep(0)

    try:
        watcher = PodWatcher(
            api, NODE, CLUSTER, ManualClock(START_MS), _ignore,
            backoff_initial_s=0.5, backoff_max_s=4.0, rng=random.Random(42), sleep=record,
        )
        task = asyncio.create_task(watcher.run())
        await eventually(lambda: len(delays) >= 7)
        await watcher.stop()
        await task
    finally:
        await api.close()
    rng = random.Random(42)
    bases = [min(0.5 * 2**i, 4.0) for i in range(7)]
    assert delays[:7] == [base / 2 + rng.uniform(0, base / 2) for base in bases]
    assert all(base / 2 <= delay <= base for base, delay in zip(bases, delays))


@pytest.mark.network
async def test_cancelling_run_propagates(server):
    api = make_api_client(server.url, None, None, True)
    try:
        watcher = PodWatcher(api, NODE, CLUSTER, ManualClock(START_MS), _ignore)
        task = asyncio.create_task(watcher.run())
        await server.wait_for_watches(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await api.close()


async def _ignore(event: PodEvent) -> None:
    return None


# --- client construction (no network) ------------------------------------------------------------------------------


async def test_in_cluster_client_reads_the_service_account(tmp_path):
    token = tmp_path / "token"
    token.write_text("sa-token-1")
    ca = tmp_path / "ca.crt"
    ca.write_text(_SELF_SIGNED_CA)
    api = in_cluster_api_client(
        token_path=str(token),
        ca_path=str(ca),
        environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
    )
    try:
        assert api.configuration.host == "https://10.96.0.1:443"
        assert api.configuration.ssl_ca_cert == str(ca)
        assert await api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer sa-token-1"
    finally:
        await api.close()


async def test_in_cluster_client_outside_a_pod_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError):
        in_cluster_api_client(token_path=str(tmp_path / "none"), ca_path=str(tmp_path / "none"), environ={})
    with pytest.raises(ConfigError):
        in_cluster_api_client(
            token_path=str(tmp_path / "none"),
            ca_path=str(tmp_path / "none"),
            environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        )


async def test_make_api_client_settings(tmp_path):
    api = make_api_client("https://k8s.example:6443/", "tok", None, False)
    try:
        assert api.configuration.host == "https://k8s.example:6443"
        assert api.configuration.verify_ssl is False
        assert await api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer tok"
    finally:
        await api.close()
    with pytest.raises(ConfigError):
        make_api_client("k8s.example:6443", None, None, True)
    with pytest.raises(ConfigError):
        make_api_client("https://k8s.example:6443", None, str(tmp_path / "missing-ca.crt"), True)


def test_watcher_settings_are_checked():
    with pytest.raises(ConfigError):
        PodWatcher(None, "", CLUSTER, ManualClock(), _ignore)
    with pytest.raises(ConfigError):
        PodWatcher(None, NODE, CLUSTER, ManualClock(), _ignore, backoff_initial_s=5, backoff_max_s=1)


# A throwaway self-signed CA certificate (CN=gpumeter-test; its key was discarded), so loading it is a real parse.
_SELF_SIGNED_CA = """-----BEGIN CERTIFICATE-----
MIIBiDCCAS2gAwIBAgIUTx/wDu+7Ihce2FKASgXGO02rTlswCgYIKoZIzj0EAwIw
GDEWMBQGA1UEAwwNZ3B1bWV0ZXItdGVzdDAgFw0yNjExMjkxNzA5MDVaGA8yMTI2
MTEwNTE3MDkwNVowGDEWMBQGA1UEAwwNZ3B1bWV0ZXItdGVzdDBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABKQTJ9LLH2XZMOzDsQ0NegY6f1QRpfXK5puHu7GsWn6A
5Vf+ehD2QTzQoMGEZR6GHuTY01dsdc4M4EHFPj6ASSOjUzBRMB0GA1UdDgQWBBSC
dzEyg9Ozq53/CBXDlx24Ej9NKzAfBgNVHSMEGDAWgBSCdzEyg9Ozq53/CBXDlx24
Ej9NKzAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kAMEYCIQDJy2m7KsX5
IV2jo4jsaP9ut0ZVCa7yO0PuPPho3U/WuwIhAMvxV416MPbZiWXxbAuI4s7uTauv
Z4g234yTAbTxdm96
-----END CERTIFICATE-----
"""


# --- namespaces: their labels, which the platform writes, on the pods' events -----------------------------------


class _Offered:
    """The collector's publisher, keeping what it is offered (decoded pod events)."""

    def __init__(self) -> None:
        self.events: list[PodEvent] = []

    def offer(self, record) -> None:
        from schemas.typed import codec_for

        self.events.append(codec_for(PodEvent).decode(record.value))


@contextlib.asynccontextmanager
async def collecting(server: FakeApiServer):
    """A ``CollectorService`` (no kubelet) fed by a ``NamespaceWatcher`` and a ``PodWatcher`` on ``server``, as
    ``gpumeter collector`` wires them; yields (service, offered, namespace watcher)."""
    from schemas.catalog import TopicCatalog
    from services.collector.assemble import NodeFacts
    from services.collector.service import CollectorService

    api = make_api_client(server.url, None, None, True)
    offered = _Offered()
    clock = ManualClock(START_MS)
    service = CollectorService(facts=NodeFacts(CLUSTER, NODE, "aws", "r", "t", "on_demand"), interval_seconds=1.0,
                               clock=clock, backend=None, identities=None, publisher=offered,
                               catalog=TopicCatalog())
    settings = dict(backoff_initial_s=0.02, backoff_max_s=0.1, rng=random.Random(7))
    namespaces = NamespaceWatcher(api, clock, service.on_namespace_event, **settings)
    pods = PodWatcher(api, NODE, CLUSTER, clock, service.on_pod_event, **settings)
    tasks = [asyncio.create_task(namespaces.run())]
    await eventually(lambda: namespaces.has_synced)
    tasks.append(asyncio.create_task(pods.run()))
    await eventually(lambda: pods.has_synced)
    try:
        yield service, offered, namespaces
    finally:
        await pods.stop()
        await namespaces.stop()
        await asyncio.gather(*tasks)
        await api.close()


@pytest.mark.network
async def test_the_namespace_watcher_lists_and_watches_namespaces_and_their_labels(server):
    server.add_namespace(make_namespace_object("ml", {"team": "b"}))
    api = make_api_client(server.url, None, None, True)
    events: asyncio.Queue = asyncio.Queue()

    async def on_event(event: NamespaceEvent) -> None:
        events.put_nowait(event)

    watcher = NamespaceWatcher(api, ManualClock(START_MS), on_event, backoff_initial_s=0.02, backoff_max_s=0.1)
    task = asyncio.create_task(watcher.run())
    try:
        listed = await asyncio.wait_for(events.get(), WAIT_S)
        assert (listed.event_type, listed.name) == (ADDED, "ml")
        assert dict(listed.labels) == {"kubernetes.io/metadata.name": "ml", "team": "b"}
        await server.wait_for_watches(1)
        # A pod change does not reach a namespace watch, a namespace's does.
        server.add_pod(gpu_pod("trainer", labels={"team": "a"}))
        stored = server.modify_namespace(make_namespace_object("ml", {"team": "c"}))
        modified = await asyncio.wait_for(events.get(), WAIT_S)
        assert (modified.event_type, modified.resource_version, modified.labels["team"]) == (
            MODIFIED, stored["metadata"]["resourceVersion"], "c")
        server.delete_namespace(stored["metadata"]["uid"])
        assert (await asyncio.wait_for(events.get(), WAIT_S)).event_type == DELETED
        assert [r.path for r in server.requests] == ["/api/v1/namespaces"] * len(server.requests)
        # Bookmarks on a namespace watch move its resourceVersion as on a pod watch.
        server.add_pod(gpu_pod("elsewhere", OTHER_NODE))
        bookmark_rv = server.send_bookmark()
        await eventually(lambda: watcher.resource_version == bookmark_rv)
        assert events.empty() and watcher.namespaces() == {}
    finally:
        await watcher.stop()
        await task
        await api.close()


@pytest.mark.network
async def test_pod_events_carry_their_namespaces_labels_never_their_own(server):
    """A pod labelled team=a in a namespace labelled team=b: its event says team=b for the namespace (what the
    attributor reads with GPUMETER_GROUPING_LABEL_SOURCE=namespace) whatever the pod says of itself."""
    server.add_namespace(make_namespace_object("ml", {"team": "b"}))
    server.add_pod(gpu_pod("trainer", labels={"team": "a"}))
    async with collecting(server) as (service, offered, _namespaces):
        await eventually(lambda: len(offered.events) == 1)
        (event,) = offered.events
        assert dict(event.labels)["team"] == "a"
        assert dict(event.namespace_labels) == {"kubernetes.io/metadata.name": "ml", "team": "b"}

        # The pod relabels itself, even with what looks like its namespace's label: the namespace's stay.
        server.modify_pod(gpu_pod("trainer", labels={"team": "a", "kubernetes.io/metadata.name": "other"},
                                  annotations={"namespace_labels": "team=a"}))
        await eventually(lambda: len(offered.events) == 2)
        assert dict(offered.events[1].namespace_labels)["team"] == "b"


@pytest.mark.network
async def test_a_relabelled_namespace_republishes_its_pods_on_this_node(server):
    ml = server.add_namespace(make_namespace_object("ml", {"team": "b"}))
    server.add_namespace(make_namespace_object("other", {"team": "z"}))
    server.add_pod(gpu_pod("trainer"))
    async with collecting(server) as (service, offered, _namespaces):
        await eventually(lambda: len(offered.events) == 1)
        server.modify_namespace(make_namespace_object("other", {"team": "y"}))  # no pod of ours there
        server.modify_namespace(make_namespace_object("ml", {"team": "c"}, uid=ml["metadata"]["uid"]))
        await eventually(lambda: len(offered.events) == 2)
        republished = offered.events[1]
        assert (republished.event_type, republished.uid) == (MODIFIED, "uid-trainer")
        assert republished.namespace_labels["team"] == "c"
        # A change of other labels only (an annotation of the namespace) republishes nothing.
        unchanged = make_namespace_object("ml", {"team": "c"}, uid=ml["metadata"]["uid"])
        unchanged["metadata"]["annotations"] = {"note": "x"}
        server.modify_namespace(unchanged)
        server.delete_pod("uid-trainer")
        await eventually(lambda: len(offered.events) == 3)
        assert offered.events[2].event_type == DELETED and offered.events[2].namespace_labels["team"] == "c"


async def test_a_pods_deletion_read_after_its_namespaces_keeps_the_labels_last_published():
    from schemas.catalog import TopicCatalog
    from services.collector.assemble import NodeFacts
    from services.collector.namespaces import namespace_event_from_object
    from services.collector.pods import pod_event_from_object
    from services.collector.service import CollectorService

    offered = _Offered()
    service = CollectorService(facts=NodeFacts(CLUSTER, NODE, "aws", "r", "t", "on_demand"), interval_seconds=1.0,
                               clock=ManualClock(START_MS), backend=None, identities=None, publisher=offered,
                               catalog=TopicCatalog())
    namespace = make_namespace_object("ml", {"team": "b"})
    await service.on_namespace_event(namespace_event_from_object(namespace, ADDED, START_MS))
    pod = gpu_pod("trainer", labels={"team": "a"})
    await service.on_pod_event(pod_event_from_object(pod, ADDED, CLUSTER, START_MS))
    await service.on_namespace_event(namespace_event_from_object(namespace, DELETED, START_MS + 1))
    await service.on_pod_event(pod_event_from_object(pod, DELETED, CLUSTER, START_MS + 2))
    assert [dict(e.namespace_labels)["team"] for e in offered.events] == ["b", "b"]
    # A pod of a namespace never read has none (the attributor then falls back, or not, as configured).
    await service.on_pod_event(pod_event_from_object(gpu_pod("new"), ADDED, CLUSTER, START_MS + 3))
    assert dict(offered.events[-1].namespace_labels) == {}


def test_a_namespace_object_is_read_and_its_labels_cut_to_size():
    from services.collector.namespaces import BAD_NAMESPACE_OBJECT, namespace_event_from_object

    flood = {f"l-{i:05d}": "v" for i in range(1_000)}
    event = namespace_event_from_object(make_namespace_object("ml", flood), ADDED, START_MS)
    assert len(event.labels) == 128 and event.labels_dropped == 1_001 - 128
    for bad in (None, {}, {"metadata": {"name": "ml"}}, {"metadata": {"name": "ml", "uid": "u", "labels": [1]}}):
        with pytest.raises(InvalidMessage) as caught:
            namespace_event_from_object(bad, ADDED, START_MS)
        assert caught.value.reason_code == BAD_NAMESPACE_OBJECT
