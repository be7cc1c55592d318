"""A Kubernetes API server for pods that speaks the real list/watch protocol over HTTP.

It is a protocol peer, not a mock: the collector's ``PodWatcher`` (through kubernetes-asyncio) talks to it exactly as
to a real API server, and the collector's simulate mode runs a node's pods on it. What it implements, as the real
server does:

* ``GET /api/v1/nodes/{name}``: the Node object put with ``put_node`` (404 ``Status`` for another name), which
  the collector reads for its node's facts;
* ``GET /api/v1/namespaces`` (list and watch, as for pods below; ``fieldSelector`` over ``metadata.name`` and
  ``status.phase``) and ``GET /api/v1/namespaces/{name}``: the Namespace objects added with ``add_namespace``,
  whose labels the collector carries on its pods' events;
* ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods``: a ``PodList`` with ``metadata.resourceVersion``;
  ``fieldSelector`` (``=``, ``==``, ``!=`` over the pod fields the real server supports; others → 400),
  ``labelSelector`` accepted and ignored; ``limit``/``continue`` paging over a consistent snapshot, items ordered by
  ``<namespace>/<name>`` as etcd keys are, ``remainingItemCount``; an expired continue token → 410 ``Expired``.
* ``?watch=true|1``: a chunked stream of JSON lines ``{"type": ..., "object": ...}``. ``resourceVersion`` unset or
  ``"0"`` starts with synthetic ADDED events for the current pods; a version older than the retained history gets
  one ``ERROR`` event carrying a 410 ``Expired`` Status, then the stream ends. Objects that start or stop matching
  the field selector arrive as ADDED / DELETED. ``allowWatchBookmarks`` enables BOOKMARK events (a Pod with only
  ``metadata.resourceVersion``, as the real server sends), one of them 2 s before ``timeoutSeconds`` ends the
  stream cleanly when the resource changed since the watch's last event (as kube-apiserver's watch cache does).
* One global, monotonically increasing resourceVersion; every change gets the next one.
* Errors are ``Status`` objects (``kind: Status``, ``code``, ``reason``) with the matching HTTP status.

Driving it: ``add_pod``, ``modify_pod``, ``mark_pod_deleting``, ``delete_pod``, ``add_namespace``, ``modify_namespace``,
``delete_namespace``, ``send_bookmark``, ``expire_history`` (compaction),
``drop_connections`` (cut open watches mid-stream) and ``set_down`` (503 or connection refused).
Every request is recorded in ``requests`` for tests to inspect.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import hashlib
import json
import logging
import uuid
import weakref
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from aiohttp import web

logger = logging.getLogger(__name__)

DEFAULT_STARTED_AT_UNIX_MS = 1_767_225_600_000
"""2026-01-01T00:00:00Z: the start time ``make_pod_object`` gives pods when the caller names none."""

_SUPPORTED_FIELDS = (
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
_NAMESPACE_FIELDS = ("metadata.name", "status.phase")
_TRUE_VALUES = ("true", "1", "t")
PODS = "pods"
NAMESPACES = "namespaces"
_KINDS = {PODS: "Pod", NAMESPACES: "Namespace"}
_PRE_TIMEOUT_BOOKMARK_S = 2.0
_MAX_SNAPSHOTS = 16  # consistent snapshots kept for continue tokens; older tokens get 410 Expired


@dataclasses.dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One HTTP request the server answered (or refused with a Status while down)."""

    method: str
    path: str
    query: Mapping[str, str]
    authorization: str | None

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch", "").lower() in _TRUE_VALUES

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")


@dataclasses.dataclass(frozen=True, slots=True)
class _Change:
    resource_version: int
    type: str  # ADDED, MODIFIED or DELETED
    old: Mapping[str, Any] | None
    new: Mapping[str, Any]
    resource: str = PODS


@dataclasses.dataclass(frozen=True, slots=True)
class _Term:
    field: str
    value: str
    equal: bool


class _FieldSelector:
    def __init__(self, raw: str, supported: tuple[str, ...] = _SUPPORTED_FIELDS) -> None:
        self.terms: list[_Term] = []
        for part in filter(None, (p.strip() for p in raw.split(","))):
            if "!=" in part:
                field, value = part.split("!=", 1)
                equal = False
            elif "==" in part:
                field, value = part.split("==", 1)
                equal = True
            elif "=" in part:
                field, value = part.split("=", 1)
                equal = True
            else:
                raise ValueError(f"invalid field selector: {part!r}")
            field = field.strip()
            if field not in supported:
                raise ValueError(f'field label not supported: {field}')
            self.terms.append(_Term(field, value.strip(), equal))

    def matches(self, pod: Mapping[str, Any]) -> bool:
        for term in self.terms:
            section, key = term.field.split(".", 1)
            actual = (pod.get(section) or {}).get(key) or ""
            if (actual == term.value) != term.equal:
                return False
        return True


class _Watch:
    def __init__(self, selector: _FieldSelector, namespace: str | None, bookmarks: bool, transport: Any,
                 resource: str = PODS) -> None:
        self.resource = resource
        self.selector = selector
        self.namespace = namespace
        self.bookmarks = bookmarks
        self.transport = transport
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.dropped = False

    def matches(self, pod: Mapping[str, Any] | None) -> bool:
        if pod is None:
            return False
        if self.namespace is not None and pod["metadata"].get("namespace") != self.namespace:
            return False
        return self.selector.matches(pod)

    def event_for(self, change: _Change) -> dict[str, Any] | None:
        if change.resource != self.resource:
            return None
        new_matches = self.matches(change.new)
        if change.type == "ADDED":
            return _event("ADDED", change.new) if new_matches else None
        if change.type == "DELETED":
            return _event("DELETED", change.new) if new_matches else None
        old_matches = self.matches(change.old)
        if old_matches and new_matches:
            return _event("MODIFIED", change.new)
        if new_matches:
            return _event("ADDED", change.new)
        if old_matches:
            return _event("DELETED", change.new)
        return None

    def drop(self) -> None:
        self.dropped = True
        self.queue.put_nowait(None)


class FakeApiServer:
    """The pod list/watch API of a Kubernetes API server on ``http://host:port``.

    ``token``: when set, requests must carry ``Authorization: Bearer <token>`` (else 401), as with a service
    account. ``bookmark_interval_s``: when set, watches that asked for bookmarks get one this often (the real
    server sends them about once a minute). The driving methods are plain calls meant for the event loop the server
    runs on. ``history_limit``: how many changes are kept for watches to resume
    from; older ones are compacted away (a watch from before them gets 410 Gone), as etcd compaction does.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        bookmark_interval_s: float | None = None,
        initial_resource_version: int = 1000,
        history_limit: int = 10_000,
    ) -> None:
        if history_limit < 1:
            raise ValueError("history_limit must be at least 1")
        self._history_limit = history_limit
        self._host = host
        self._port = port
        self._token = token
        self._bookmark_interval_s = bookmark_interval_s
        self._resource_version = initial_resource_version
        self._compacted_resource_version = initial_resource_version
        self._pods: dict[str, dict[str, Any]] = {}
        self._namespaces: dict[str, dict[str, Any]] = {}  # by uid, as pods
        self._nodes: dict[str, dict[str, Any]] = {}
        self._resource_slices: dict[str, dict[str, Any]] = {}
        self._resource_claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[_Change] = []
        self._newest_rv: dict[str, int] = {}  # resource -> resourceVersion of its newest change
        self._snapshots: dict[int, list[dict[str, Any]]] = {}
        self._watches: set[_Watch] = set()
        self._transports: weakref.WeakSet[Any] = weakref.WeakSet()
        self._down = False
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._bookmark_task: asyncio.Task[None] | None = None
        self._watch_opened = asyncio.Condition()
        self.requests: list[RecordedRequest] = []

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on (host, port); port 0 picks a free one, which ``url`` then names."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/pods", self._handle_pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._handle_pods)
        app.router.add_get("/api/v1/nodes/{name}", self._handle_node)
        app.router.add_get("/api/v1/namespaces", self._handle_namespaces)
        app.router.add_get("/api/v1/namespaces/{name}", self._handle_namespace)
        app.router.add_get("/apis/resource.k8s.io/v1/resourceslices", self._handle_resource_slices)
        app.router.add_get("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
                           self._handle_resource_claim)
        app.router.add_route("*", "/{tail:.*}", self._handle_not_found)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await self._listen()
        if self._bookmark_interval_s:
            self._bookmark_task = asyncio.create_task(self._bookmark_loop(), name="fake-apiserver-bookmarks")

    async def stop(self) -> None:
        """Close every watch and stop listening."""
        if self._bookmark_task is not None:
            self._bookmark_task.cancel()
            await asyncio.gather(self._bookmark_task, return_exceptions=True)
            self._bookmark_task = None
        self.drop_connections()
        self._abort_transports()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    async def __aenter__(self) -> "FakeApiServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """``http://host:port`` of the listening server."""
        if self._runner is None:
            raise RuntimeError("the fake API server is not started")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    # --- driving ---------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The newest resourceVersion handed out."""
        return str(self._resource_version)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def pods(self) -> Mapping[str, Mapping[str, Any]]:
        """The current pods by uid (the stored objects; do not mutate them)."""
        return MappingProxyType(dict(self._pods))

    def add_pod(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a pod; returns the stored copy with its new resourceVersion. The uid must be new, and so must the
        name among the pods that exist (the real server answers 409 AlreadyExists): a pod recreated under its name,
        as a StatefulSet does, is deleted first and comes back with a new uid."""
        pod = copy.deepcopy(dict(obj))
        uid = _uid_of(pod)
        if uid in self._pods:
            raise ValueError(f"pod uid {uid} already exists")
        holder = next((other for other in self._pods.values() if _pod_key(other) == _pod_key(pod)), None)
        if holder is not None:
            raise ValueError(f"pod {_pod_key(pod)} already exists (uid {_uid_of(holder)}): delete it first")
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        self._record("ADDED", None, pod)
        self._pods[uid] = pod
        return pod

    def modify_pod(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an existing pod (matched by uid); returns the stored copy with its new resourceVersion."""
        return self._modify(self._pods, obj, "Pod", PODS)

    def mark_pod_deleting(self, uid: str, grace_period_seconds: int = 0, *, at_unix_ms: int | None = None
                          ) -> dict[str, Any]:
        """Mark a pod deleted (``metadata.deletionTimestamp``, ``at_unix_ms`` (default now) plus the grace period,
        and ``deletionGracePeriodSeconds``): the MODIFIED the real server sends before it removes a pod bound to a
        node, even for ``gracePeriodSeconds=0``. ``delete_pod`` is the removal alone; simulate mode does both."""
        old = self._pods.get(uid)
        if old is None:
            raise KeyError(f"no pod with uid {uid}")
        marked = copy.deepcopy(old)
        now_ms = int(datetime.now(timezone.utc).timestamp() * 1000) if at_unix_ms is None else at_unix_ms
        deletion_ms = now_ms + grace_period_seconds * 1000
        marked["metadata"]["deletionTimestamp"] = _rfc3339(deletion_ms)
        marked["metadata"]["deletionGracePeriodSeconds"] = grace_period_seconds
        return self.modify_pod(marked)

    def delete_pod(self, uid: str) -> dict[str, Any]:
        """Delete a pod; returns the final object (as the DELETED event carries it, with a new resourceVersion)."""
        return self._delete(self._pods, uid, "pod", PODS)

    def namespaces(self) -> Mapping[str, Mapping[str, Any]]:
        """The current namespaces by uid (the stored objects; do not mutate them)."""
        return MappingProxyType(dict(self._namespaces))

    def add_namespace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a Namespace (``make_namespace_object``); returns the stored copy with its new resourceVersion."""
        item = copy.deepcopy(dict(obj))
        uid = _uid_of(item)
        if uid in self._namespaces or any(n["metadata"]["name"] == item["metadata"]["name"]
                                          for n in self._namespaces.values()):
            raise ValueError(f"namespace {item['metadata'].get('name')} already exists")
        item.setdefault("apiVersion", "v1")
        item.setdefault("kind", "Namespace")
        self._record("ADDED", None, item, NAMESPACES)
        self._namespaces[uid] = item
        return item

    def modify_namespace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an existing Namespace (matched by uid), e.g. with other labels."""
        return self._modify(self._namespaces, obj, "Namespace", NAMESPACES)

    def delete_namespace(self, uid: str) -> dict[str, Any]:
        """Delete a Namespace; returns the final object."""
        return self._delete(self._namespaces, uid, "namespace", NAMESPACES)

    def _modify(self, store: dict[str, dict[str, Any]], obj: Mapping[str, Any], kind: str,
                resource: str) -> dict[str, Any]:
        item = copy.deepcopy(dict(obj))
        uid = _uid_of(item)
        old = store.get(uid)
        if old is None:
            raise KeyError(f"no {kind.lower()} with uid {uid}")
        item.setdefault("apiVersion", "v1")
        item.setdefault("kind", kind)
        self._record("MODIFIED", old, item, resource)
        store[uid] = item
        return item

    def _delete(self, store: dict[str, dict[str, Any]], uid: str, what: str, resource: str) -> dict[str, Any]:
        old = store.pop(uid, None)
        if old is None:
            raise KeyError(f"no {what} with uid {uid}")
        final = copy.deepcopy(old)
        self._record("DELETED", old, final, resource)
        return final

    def send_bookmark(self) -> str:
        """Send a BOOKMARK with the current resourceVersion to every watch that allowed bookmarks; returns it."""
        rv = str(self._resource_version)
        for watch in list(self._watches):
            if watch.bookmarks:
                watch.queue.put_nowait(_bookmark_event(rv, watch.resource))
        return rv

    def expire_history(self) -> None:
        """Compact: watches from any resourceVersion older than the current one now get 410 Gone, and
        outstanding continue tokens expire. Open watches carry on, as with the real server."""
        self._compacted_resource_version = self._resource_version
        self._history.clear()
        self._snapshots.clear()

    def drop_connections(self) -> None:
        """Cut every open watch mid-stream, as a network failure or an API server restart does."""
        for watch in list(self._watches):
            watch.drop()
            if watch.transport is not None:
                watch.transport.abort()
        self._watches.clear()

    async def set_down(self, down: bool, *, refuse: bool = False) -> None:
        """Take the server down or bring it back. Down cuts open watches and then either answers every request
        with 503 ServiceUnavailable (``refuse=False``) or stops listening so connections are refused."""
        if down:
            self._down = True
            self.drop_connections()
            if refuse and self._site is not None:
                await self._site.stop()
                self._site = None
                self._abort_transports()
        else:
            self._down = False
            if self._site is None and self._runner is not None:
                await self._listen()

    async def wait_for_watches(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until at least ``count`` watches are open (raises TimeoutError after ``timeout_s``)."""
        async with self._watch_opened:
            await asyncio.wait_for(self._watch_opened.wait_for(lambda: len(self._watches) >= count), timeout_s)

    # --- internals -------------------------------------------------------------------------------------------

    async def _listen(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp keeps the asyncio server here; the bound port is only on its sockets
        if self._port == 0 and server is not None and server.sockets:
            self._port = server.sockets[0].getsockname()[1]
        self._site = site

    def _abort_transports(self) -> None:
        for transport in list(self._transports):
            transport.abort()

    def _record(self, change_type: str, old: Mapping[str, Any] | None, new: dict[str, Any],
                resource: str = PODS) -> None:
        self._resource_version += 1
        new.setdefault("metadata", {})["resourceVersion"] = str(self._resource_version)
        change = _Change(self._resource_version, change_type, old, new, resource)
        self._newest_rv[resource] = self._resource_version
        self._history.append(change)
        if len(self._history) > self._history_limit:
            del self._history[: len(self._history) - self._history_limit]
            self._compacted_resource_version = self._history[0].resource_version - 1
        for watch in list(self._watches):
            event = watch.event_for(change)
            if event is not None:
                watch.queue.put_nowait(event)

    async def _bookmark_loop(self) -> None:
        assert self._bookmark_interval_s is not None
        while True:
            await asyncio.sleep(self._bookmark_interval_s)
            self.send_bookmark()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.transport is not None:
            self._transports.add(request.transport)
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=request.path,
                query=MappingProxyType({k: v for k, v in request.query.items()}),
                authorization=request.headers.get("Authorization"),
            )
        )
        if self._down:
            return _status_response(503, "ServiceUnavailable", "the server is currently unable to handle the request")
        if self._token is not None and request.headers.get("Authorization") != f"Bearer {self._token}":
            return _status_response(401, "Unauthorized", "Unauthorized")
        return await handler(request)

    async def _handle_not_found(self, request: web.Request) -> web.StreamResponse:
        return _status_response(404, "NotFound", "the server could not find the requested resource")

    async def _handle_node(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        node = self._nodes.get(name)
        if node is None:
            return _status_response(404, "NotFound", f'nodes "{name}" not found')
        return web.json_response(node)

    def put_node(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``obj`` (a Node object) at ``GET /api/v1/nodes/<its name>``, replacing one of the same name."""
        node = json.loads(json.dumps(obj))
        self._resource_version += 1
        node.setdefault("metadata", {})["resourceVersion"] = str(self._resource_version)
        self._nodes[node["metadata"]["name"]] = node
        return node

    # --- DRA (resource.k8s.io/v1): ResourceSlices (list, fieldSelector spec.nodeName / spec.driver) and
    # ResourceClaims (get). No watch: the collector lists slices and reads claims when it needs them.

    def put_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``obj`` (a ResourceSlice) in ``GET /apis/resource.k8s.io/v1/resourceslices``, replacing one of the
        same name."""
        item = json.loads(json.dumps(obj))
        self._resource_version += 1
        item.setdefault("metadata", {})["resourceVersion"] = str(self._resource_version)
        self._resource_slices[item["metadata"]["name"]] = item
        return item

    def put_resource_claim(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``obj`` (a ResourceClaim) at ``GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>``,
        replacing one of the same namespace and name."""
        item = json.loads(json.dumps(obj))
        self._resource_version += 1
        metadata = item.setdefault("metadata", {})
        metadata["resourceVersion"] = str(self._resource_version)
        self._resource_claims[(metadata["namespace"], metadata["name"])] = item
        return item

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        self._resource_claims.pop((namespace, name), None)

    async def _handle_resource_slices(self, request: web.Request) -> web.StreamResponse:
        terms = {}
        for part in filter(None, (p.strip() for p in request.query.get("fieldSelector", "").split(","))):
            field, _, value = part.replace("==", "=").partition("=")
            if field.strip() not in ("spec.nodeName", "spec.driver"):
                return _status_response(400, "BadRequest", "field label not supported for resource.k8s.io/v1, "
                                                           f"Kind=ResourceSlice: {field.strip()}")
            terms[field.strip().split(".", 1)[1]] = value.strip()
        items = [item for _, item in sorted(self._resource_slices.items())
                 if all((item.get("spec") or {}).get(k) == v for k, v in terms.items())]
        return web.json_response({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                                  "metadata": {"resourceVersion": str(self._resource_version)}, "items": items})

    async def _handle_resource_claim(self, request: web.Request) -> web.StreamResponse:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        claim = self._resource_claims.get((namespace, name))
        if claim is None:
            return _status_response(404, "NotFound", f'resourceclaims.resource.k8s.io "{name}" not found')
        return web.json_response(claim)

    async def _handle_pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        try:
            selector = _FieldSelector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return _status_response(400, "BadRequest", str(exc))
        if request.query.get("watch", "").lower() in _TRUE_VALUES:
            return await self._watch(request, selector, namespace)
        return self._list(request, selector, namespace)

    async def _handle_namespaces(self, request: web.Request) -> web.StreamResponse:
        try:
            selector = _FieldSelector(request.query.get("fieldSelector", ""), _NAMESPACE_FIELDS)
        except ValueError as exc:
            return _status_response(400, "BadRequest", str(exc))
        if request.query.get("watch", "").lower() in _TRUE_VALUES:
            return await self._watch(request, selector, None, NAMESPACES)
        return self._list(request, selector, None, NAMESPACES)

    async def _handle_namespace(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        for item in self._namespaces.values():
            if item["metadata"]["name"] == name:
                return web.json_response(item)
        return _status_response(404, "NotFound", f'namespaces "{name}" not found')

    def _objects(self, resource: str) -> dict[str, dict[str, Any]]:
        return self._namespaces if resource == NAMESPACES else self._pods

    def _list(self, request: web.Request, selector: _FieldSelector, namespace: str | None,
              resource: str = PODS) -> web.Response:
        try:
            limit = int(request.query.get("limit") or 0)
        except ValueError:
            return _status_response(400, "BadRequest", f"invalid limit: {request.query.get('limit')!r}")
        continue_token = request.query.get("continue") or ""
        if continue_token:
            try:
                snapshot_rv, start_key = _decode_continue(continue_token)
            except ValueError as exc:
                return _status_response(400, "BadRequest", f"invalid continue token: {exc}")
            snapshot = self._snapshots.get(snapshot_rv)
            if snapshot is None:
                return _status_response(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start "
                    "a new list without the continue parameter.",
                )
        else:
            snapshot_rv = self._resource_version
            snapshot = sorted(self._objects(resource).values(), key=_pod_key)
            start_key = ""
        watch = _Watch(selector, namespace, False, None, resource)
        matching = [p for p in snapshot if _pod_key(p) >= start_key and watch.matches(p)]
        page = matching[:limit] if limit > 0 else matching
        metadata: dict[str, Any] = {"resourceVersion": str(snapshot_rv)}
        if len(page) < len(matching):
            self._snapshots[snapshot_rv] = snapshot
            while len(self._snapshots) > _MAX_SNAPSHOTS:
                del self._snapshots[min(self._snapshots)]
            metadata["continue"] = _encode_continue(snapshot_rv, _pod_key(page[-1]) + "\x00")
            # As the real server: the count only when no selector narrows the list (it cannot know it then).
            if not selector.terms and not request.query.get("labelSelector"):
                metadata["remainingItemCount"] = len(matching) - len(page)
        body = {"kind": f"{_KINDS[resource]}List", "apiVersion": "v1", "metadata": metadata, "items": [_list_item(p) for p in page]}
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, selector: _FieldSelector, namespace: str | None, resource: str = PODS
    ) -> web.StreamResponse:
        rv_param = request.query.get("resourceVersion", "")
        timeout_param = request.query.get("timeoutSeconds")
        try:
            start_rv = int(rv_param) if rv_param not in ("", "0") else None
            timeout_s = float(timeout_param) if timeout_param else None
        except ValueError:
            return _status_response(400, "BadRequest", "invalid resourceVersion or timeoutSeconds")
        bookmarks = request.query.get("allowWatchBookmarks", "").lower() in _TRUE_VALUES
        watch = _Watch(selector, namespace, bookmarks, request.transport, resource)

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        if start_rv is not None and start_rv < self._compacted_resource_version:
            status = _status_object(
                410,
                "Expired",
                f"too old resource version: {start_rv} ({self._compacted_resource_version})",
            )
            await _write_line(response, {"type": "ERROR", "object": status})
            await response.write_eof()
            return response

        # Replay and registration happen with no await in between, so no change can fall in a gap.
        if start_rv is None:
            for pod in sorted(self._objects(resource).values(), key=_pod_key):
                if watch.matches(pod):
                    watch.queue.put_nowait(_event("ADDED", pod))
        else:
            for change in self._history:
                if change.resource_version > start_rv:
                    event = watch.event_for(change)
                    if event is not None:
                        watch.queue.put_nowait(event)
        self._watches.add(watch)
        async with self._watch_opened:
            self._watch_opened.notify_all()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        # kube-apiserver's watch cache sends a watch that allows bookmarks a BOOKMARK about 2 s before its timeout
        # ends it (when that is still ahead), carrying the resourceVersion of the newest change of the resource,
        # and only when there is one the watch has not been sent (measured on v1.37.2: no change, no bookmark).
        pre_timeout = deadline - _PRE_TIMEOUT_BOOKMARK_S if deadline is not None and bookmarks else None
        if pre_timeout is not None and pre_timeout <= loop.time():
            pre_timeout = None
        sent_rv = start_rv if start_rv is not None else self._newest_rv.get(resource, 0)
        try:
            while True:
                now = loop.time()
                if deadline is not None and deadline - now <= 0:
                    break
                if pre_timeout is not None and pre_timeout <= now:
                    pre_timeout = None
                    newest = self._newest_rv.get(resource, 0)
                    if newest > sent_rv:
                        watch.queue.put_nowait(_bookmark_event(str(newest), watch.resource))
                wake = pre_timeout if pre_timeout is not None else deadline
                try:
                    event = await asyncio.wait_for(watch.queue.get(), None if wake is None else wake - now)
                except TimeoutError:
                    continue
                if event is None:
                    break
                sent_rv = max(sent_rv, _event_resource_version(event))
                await _write_line(response, event)
            if not watch.dropped:
                await response.write_eof()
        except ConnectionError:
            logger.debug("watch client went away")
        finally:
            self._watches.discard(watch)
        return response


# --- protocol helpers -------------------------------------------------------------------------------------------


def _event(event_type: str, pod: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": event_type, "object": pod}


def _event_resource_version(event: Mapping[str, Any]) -> int:
    value = ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion")
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _bookmark_event(resource_version: str, resource: str = PODS) -> dict[str, Any]:
    # Byte for byte what kube-apiserver v1.37 sends for pods: a zero-value Pod but for the resourceVersion (a
    # zero-value Namespace for namespaces); no creationTimestamp (older servers sent it as null).
    if resource == NAMESPACES:
        obj: dict[str, Any] = {"kind": "Namespace", "apiVersion": "v1",
                               "metadata": {"resourceVersion": resource_version}, "spec": {}, "status": {}}
    else:
        obj = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"resourceVersion": resource_version}, "spec": {"containers": None}, "status": {}}
    return {"type": "BOOKMARK", "object": obj}


async def _write_line(response: web.StreamResponse, event: Mapping[str, Any]) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode("utf-8") + b"\n")


def _status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status_response(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status_object(code, reason, message), status=code)


def _list_item(pod: Mapping[str, Any]) -> dict[str, Any]:
    # Items of a list carry no apiVersion/kind: the list's own say it.
    return {k: v for k, v in pod.items() if k not in ("apiVersion", "kind")}


def _pod_key(pod: Mapping[str, Any]) -> str:
    metadata = pod["metadata"]
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _uid_of(pod: Mapping[str, Any]) -> str:
    uid = (pod.get("metadata") or {}).get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("a pod needs metadata.uid")
    return uid


def _encode_continue(resource_version: int, start_key: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": resource_version, "start": start_key}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(decoded["rv"]), str(decoded["start"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError("continue key is not valid") from exc


# --- realistic pod objects -------------------------------------------------------------------------------------

_OWNER_API_VERSIONS = {
    "ReplicaSet": "apps/v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1",
    "Job": "batch/v1",
    "CronJob": "batch/v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
    "RayCluster": "ray.io/v1",
    "PyTorchJob": "kubeflow.org/v1",
}
_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet Kubernetes uses for generated name suffixes


def make_pod_object(
    namespace: str,
    name: str,
    uid: str,
    node: str,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    gpu_requests: Mapping[str, int] = MappingProxyType({}),
    container_ids: Sequence[str] = (),
    env: Mapping[str, str] = MappingProxyType({}),
    owner: tuple[str, str] | None = None,
    phase: str = "Running",
    privileged: bool = False,
    containers: list[str] | None = None,
    started_at_unix_ms: int = DEFAULT_STARTED_AT_UNIX_MS,
    image: str = "nvcr.io/nvidia/pytorch:25.01-py3",
) -> dict[str, Any]:
    """A Pod as the API server serialises it (apiVersion v1, kind Pod), bound to ``node``.

    ``containers`` names the containers (default one, ``main``). ``gpu_requests`` (resource name → count, put in
    both requests and limits as the API requires), ``env`` and ``privileged`` apply to the first container; the
    others are plain sidecars. ``container_ids`` gives the runtime ids in container order (``containerd://`` is
    added to bare ids); containers without one get a stable 64-hex id derived from the uid and name, once past
    Pending. ``owner`` is ``(kind, name)`` of the controller: ``Deployment`` is expressed the way Kubernetes does
    it (a ReplicaSet ``<name>-<hash>`` plus the ``pod-template-hash`` label), ``CronJob`` as its Job
    ``<name>-<n>``; StatefulSet, DaemonSet and Job get their controllers' labels.
    """
    container_names = list(containers) if containers else ["main"]
    pod_labels = dict(labels or {})
    created_ms = started_at_unix_ms - 2_000
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "resourceVersion": "1",
        "creationTimestamp": _rfc3339(created_ms),
    }
    restart_policy = "Always"
    if owner is not None:
        kind, owner_name = owner
        controller_kind, controller_name = kind, owner_name
        if kind == "Deployment":
            template_hash = _short_hash(f"{namespace}/{owner_name}", 10)
            pod_labels.setdefault("pod-template-hash", template_hash)
            controller_kind, controller_name = "ReplicaSet", f"{owner_name}-{pod_labels['pod-template-hash']}"
        elif kind == "CronJob":
            controller_kind, controller_name = "Job", f"{owner_name}-{29_400_000 + int(_digest(owner_name)[:4], 16)}"
        elif kind in ("StatefulSet", "DaemonSet"):
            pod_labels.setdefault("controller-revision-hash", f"{owner_name}-{_short_hash(owner_name, 10)}")
            if kind == "StatefulSet":
                pod_labels.setdefault("statefulset.kubernetes.io/pod-name", name)
                ordinal = name.rsplit("-", 1)[-1]
                if ordinal.isdigit():
                    pod_labels.setdefault("apps.kubernetes.io/pod-index", ordinal)
            else:
                pod_labels.setdefault("pod-template-generation", "1")
        if controller_kind == "Job":
            restart_policy = "Never"
            job_uid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"Job/{namespace}/{controller_name}"))
            for key, value in (
                ("batch.kubernetes.io/controller-uid", job_uid),
                ("batch.kubernetes.io/job-name", controller_name),
                ("controller-uid", job_uid),
                ("job-name", controller_name),
            ):
                pod_labels.setdefault(key, value)
        metadata["generateName"] = f"{controller_name}-"
        metadata["ownerReferences"] = [
            {
                "apiVersion": _OWNER_API_VERSIONS.get(controller_kind, "v1"),
                "kind": controller_kind,
                "name": controller_name,
                "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{controller_kind}/{namespace}/{controller_name}")),
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    if pod_labels:
        metadata["labels"] = pod_labels
    if annotations:
        metadata["annotations"] = dict(annotations)

    spec_containers = []
    for index, container_name in enumerate(container_names):
        main = index == 0
        requests: dict[str, str] = {"cpu": "1", "memory": "4Gi"} if main else {"cpu": "100m", "memory": "128Mi"}
        limits: dict[str, str] = {"memory": requests["memory"]}
        if main:
            for resource_name, count in gpu_requests.items():
                requests[resource_name] = str(count)
                limits[resource_name] = str(count)
        container: dict[str, Any] = {
            "name": container_name,
            "image": image if main else "busybox:1.36",
            "resources": {"limits": limits, "requests": requests},
            "volumeMounts": [
                {
                    "name": "kube-api-access",
                    "readOnly": True,
                    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                }
            ],
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent",
        }
        if main and env:
            container["env"] = [{"name": key, "value": value} for key, value in env.items()]
        if main and privileged:
            container["securityContext"] = {"privileged": True}
        spec_containers.append(container)

    tolerations: list[dict[str, Any]] = [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        },
    ]
    # The ExtendedResourceToleration admission plugin adds one per requested extended resource.
    tolerations.extend(
        {"key": resource_name, "operator": "Exists", "effect": "NoSchedule"} for resource_name in sorted(gpu_requests)
    )
    spec = {
        "volumes": [
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 420,
                    "sources": [{"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}],
                },
            }
        ],
        "containers": spec_containers,
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "nodeName": node,
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": tolerations,
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }

    host_ip = _ip_from(f"node/{node}", "192.168")
    pod_ip = _ip_from(f"pod/{uid}", "10.244")
    started = _rfc3339(started_at_unix_ms)
    statuses = []
    for index, container_name in enumerate(container_names):
        given = container_ids[index] if index < len(container_ids) else None
        container_id = given or _digest(f"{uid}/{container_name}")
        if "://" not in container_id:
            container_id = f"containerd://{container_id}"
        container_image = spec_containers[index]["image"]
        container_status: dict[str, Any] = {
            "name": container_name,
            "image": container_image,
            "imageID": f"{container_image.split(':')[0]}@sha256:{_digest(container_image)}",
            "restartCount": 0,
        }
        if phase == "Pending":
            container_status.update(ready=False, started=False, state={"waiting": {"reason": "ContainerCreating"}})
        elif phase in ("Succeeded", "Failed"):
            exit_code = 0 if phase == "Succeeded" else 1
            container_status.update(
                containerID=container_id,
                ready=False,
                started=False,
                state={
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Completed" if exit_code == 0 else "Error",
                        "startedAt": started,
                        "finishedAt": _rfc3339(started_at_unix_ms + 60_000),
                        "containerID": container_id,
                    }
                },
            )
        else:
            container_status.update(
                containerID=container_id, ready=True, started=True, state={"running": {"startedAt": started}}
            )
        statuses.append(container_status)

    ready = "True" if phase == "Running" else "False"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {
                "type": "PodReadyToStartContainers",
                "status": "True" if phase != "Pending" else "False",
                "lastProbeTime": None,
                "lastTransitionTime": started,
            },
            {"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": started},
            {"type": "Ready", "status": ready, "lastProbeTime": None, "lastTransitionTime": started},
            {"type": "ContainersReady", "status": ready, "lastProbeTime": None, "lastTransitionTime": started},
            {
                "type": "PodScheduled",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": _rfc3339(created_ms),
            },
        ],
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": started,
        "containerStatuses": statuses,
        "qosClass": "Burstable",
    }
    if phase != "Pending":
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def _rfc3339(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms // 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _short_hash(text: str, length: int) -> str:
    value = int(_digest(text), 16)
    chars = []
    for _ in range(length):
        value, index = divmod(value, len(_HASH_ALPHABET))
        chars.append(_HASH_ALPHABET[index])
    return "".join(chars)


def _ip_from(text: str, prefix: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return f"{prefix}.{digest[0]}.{min(max(digest[1], 1), 254)}"


# The capacity-type labels each provider's node pools carry for a price model (see services/collector/nodefacts.py).
_CAPACITY_LABELS: Mapping[tuple[str, str], Mapping[str, str]] = {
    ("aws", "spot"): {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacityType": "SPOT"},
    ("aws", "on_demand"): {"karpenter.sh/capacity-type": "on-demand", "eks.amazonaws.com/capacityType": "ON_DEMAND"},
    ("aws", "committed"): {"karpenter.sh/capacity-type": "reserved"},
    ("gcp", "spot"): {"cloud.google.com/gke-spot": "true"},
    ("azure", "spot"): {"kubernetes.azure.com/scalesetpriority": "spot"},
}


def make_namespace_object(name: str, labels: Mapping[str, str] | None = None, *, uid: str | None = None,
                          phase: str = "Active") -> dict[str, Any]:
    """A Namespace object as the API server serialises it: ``kubernetes.io/metadata.name`` set as the API server
    sets it, then ``labels``; the uid derived from the name unless given."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "uid": uid or str(uuid.UUID(bytes=hashlib.sha256(f"namespace/{name}".encode()).digest()[:16], version=4)),
            "labels": {"kubernetes.io/metadata.name": name, **dict(labels or {})},
            "creationTimestamp": _rfc3339(DEFAULT_STARTED_AT_UNIX_MS),
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": phase},
    }


def make_node_object(
    name: str,
    *,
    provider: str,
    region: str,
    zone: str,
    instance_type: str,
    price_model: str,
    provider_id: str,
    labels: Mapping[str, str] = MappingProxyType({}),
) -> dict[str, Any]:
    """A Node object as a managed cluster of ``provider`` serialises it: the well-known topology and
    instance-type labels, the provider's capacity-type label for ``price_model`` (where it has one: GKE and AKS
    label spot only, Karpenter also reserved capacity), ``spec.providerID``, plus ``labels``."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": instance_type,
        "topology.kubernetes.io/region": region,
        "nvidia.com/gpu.present": "true",
    }
    if zone:
        node_labels["topology.kubernetes.io/zone"] = zone
    node_labels.update(_CAPACITY_LABELS.get((provider, price_model), {}))
    node_labels.update(labels)
    spec: dict[str, Any] = {}
    if provider_id:
        spec["providerID"] = provider_id
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.UUID(bytes=hashlib.sha256(name.encode()).digest()[:16])),
                     "labels": node_labels},
        "spec": spec,
        "status": {"nodeInfo": {"kubeletVersion": "v1.34.2", "containerRuntimeVersion": "containerd://2.1.4"}},
    }
