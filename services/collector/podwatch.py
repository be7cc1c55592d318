"""The collector's view of the pods on its node, and of the cluster's namespaces: list, then watch, with
kubernetes-asyncio.

``PodWatcher`` keeps a cache of this node's pods (by uid) and turns what the API server says into ``PodEvent``s;
``NamespaceWatcher`` does the same for every Namespace (``namespaces.NamespaceEvent``: their labels), by the same
rules (``_ListWatcher``):

* List (``fieldSelector=spec.nodeName=<node>``, paginated with ``limit``/``continue``) and compare with the cache:
  ADDED for new pods, MODIFIED for pods whose resourceVersion changed, DELETED for cached pods the list no longer
  has (deleted while the watcher was not watching), nothing for unchanged ones.
* Watch from the list's resourceVersion with bookmarks, keeping the newest resourceVersion from every event and
  BOOKMARK. When the server ends the stream (``timeoutSeconds``) the watch resumes from there.
* ``410 Gone`` (an HTTP 410, or an ERROR event carrying a Status with code 410) means the resourceVersion was
  compacted away: list again. Anything else that goes wrong (connection refused or cut, timeouts, 5xx, 429,
  garbled stream, even 401/403 while RBAC or a token is being fixed) is retried with jittered exponential backoff,
  resuming the watch from the last resourceVersion, so no change is missed as long as the history still has it.
* A pod object that cannot be read (``InvalidMessage``) is reported through ``on_invalid_pod`` and skipped.
* ``on_event`` is awaited for each event, in order; the cache changes only after it returns, and an exception
  from it ends ``run()`` (the caller decides; calling ``run()`` again resumes from the cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import ssl
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError, InvalidMessage
from schemas.records import PodEvent, PodEventType
from services.collector.namespaces import NamespaceEvent, namespace_event_from_object
from services.collector.pods import pod_event_from_object

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SERVICE_ACCOUNT_CA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

# Error kinds passed to on_watch_error (stable: they become metric label values).
ERROR_EXPIRED = "expired"
ERROR_CONNECTION = "connection"
ERROR_TIMEOUT = "timeout"
ERROR_SERVER = "server_error"
ERROR_REJECTED = "rejected"
ERROR_PROTOCOL = "protocol"

# A watch that ends cleanly sooner than this without delivering anything is treated as a failure, so a proxy that
# closes streams at once cannot make the watcher spin.
_MIN_HEALTHY_WATCH_S = 1.0


class _StreamFailure(Exception):
    """One list or watch attempt failed; ``kind`` is one of the ERROR_* kinds."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class _RawWatch(watch.Watch):
    """kubernetes-asyncio's Watch without the model deserialisation: events carry the API server's JSON dicts,
    which is what ``pod_event_from_object`` reads (and V1Pod models would be built only to be thrown away)."""

    def get_return_type(self, func: object) -> str:
        return ""


class _ListWatcher:
    """List, then watch, one kind of object, and report each change through ``on_event`` (the rules of the module
    docstring). A subclass says what to list (``_list_function``, ``_selector``) and how to read one object
    (``_read``, raising ``InvalidMessage``); what it reads has ``uid``, ``resource_version`` and ``event_type``
    (and is a dataclass: the event type is replaced to follow the cache).

    ``timeout_seconds`` is the server-side duration of one watch request; ``page_size`` the list ``limit``;
    ``request_timeout_s`` bounds connecting and each list request, and how long a watch may stay silent beyond
    ``timeout_seconds``. Backoff after failures starts at ``backoff_initial_s``, doubles up to ``backoff_max_s``,
    and each wait is drawn from [d/2, d] with ``rng`` (seed it for reproducible runs). Metric hooks:
    ``on_relist(count)`` after each complete list, ``on_watch_error(kind)`` on each failed list/watch attempt,
    ``on_invalid(error)`` for each object that could not be read, each logged as a warning. ``sleep`` waits out a
    backoff (replaceable so that simulations and tests control time).
    """

    _resource = "object"  # what the logs call one

    def __init__(
        self,
        api_client: client.ApiClient,
        where: str,
        clock: Clock,
        on_event: Callable[[Any], Awaitable[None]],
        *,
        timeout_seconds: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        page_size: int = 500,
        request_timeout_s: float = 60.0,
        rng: random.Random | None = None,
        on_relist: Callable[[int], None] | None = None,
        on_watch_error: Callable[[str], None] | None = None,
        on_invalid: Callable[[InvalidMessage], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if timeout_seconds <= 0 or page_size <= 0 or request_timeout_s <= 0:
            raise ConfigError("timeout_seconds, page_size and request_timeout_s must be positive")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ConfigError("backoff needs 0 < backoff_initial_s <= backoff_max_s")
        self._core = client.CoreV1Api(api_client)
        self._where = where
        self._clock = clock
        self._on_event = on_event
        self._timeout_seconds = int(timeout_seconds)
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._page_size = page_size
        self._request_timeout_s = request_timeout_s
        self._rng = rng if rng is not None else random.Random()
        self._on_relist = on_relist
        self._on_watch_error = on_watch_error
        self._on_invalid = on_invalid
        self._sleep = sleep

        self._items: dict[str, Any] = {}
        self._resource_version: str | None = None
        self._need_list = True
        self._synced = False
        self._next_backoff_s = backoff_initial_s
        self._inner: asyncio.Task[None] | None = None
        self._stop_requested = False

    # --- what a subclass says ----------------------------------------------------------------------------------

    def _list_function(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _selector(self) -> dict[str, str]:
        return {}

    def _read(self, raw: Mapping[str, Any], event_type: PodEventType, now_ms: int) -> Any:
        raise NotImplementedError

    # --- public ----------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> str | None:
        """The newest resourceVersion seen (list, event or bookmark); the next watch starts from it."""
        return self._resource_version

    @property
    def has_synced(self) -> bool:
        """True once a first complete list has been emitted: the cache then reflects the API server."""
        return self._synced

    async def run(self) -> None:
        """List and watch until cancelled or ``stop()``ped. Returns normally after ``stop()``; network and API
        errors never end it; an exception from ``on_event`` does (propagated), and a later ``run()`` carries on
        from the cache, re-emitting what was not delivered."""
        if self._inner is not None and not self._inner.done():
            raise RuntimeError(f"{type(self).__name__}.run() is already running")
        if self._stop_requested:
            return
        inner = asyncio.create_task(self._loop(), name=f"{self._resource}-watch-{self._where}")
        self._inner = inner
        try:
            await inner
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._stop_requested and inner.cancelled() and (current is None or current.cancelling() == 0):
                return
            raise

    async def stop(self) -> None:
        """Stop ``run()`` (also when it is waiting on the network or a backoff) and wait until it has."""
        self._stop_requested = True
        inner = self._inner
        if inner is not None and not inner.done():
            inner.cancel()
            await asyncio.wait([inner])

    # --- the loop --------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if self._need_list:
                try:
                    await self._list()
                except _StreamFailure as failure:
                    await self._after_failure("list", failure)
                    continue
                self._need_list = False
            started_s = self._clock.monotonic_s()
            try:
                delivered = await self._watch()
            except _StreamFailure as failure:
                if failure.kind == ERROR_EXPIRED:
                    self._need_list = True
                await self._after_failure("watch", failure)
                continue
            if delivered == 0 and self._clock.monotonic_s() - started_s < _MIN_HEALTHY_WATCH_S:
                await self._after_failure(
                    "watch", _StreamFailure(ERROR_PROTOCOL, "the watch ended at once with no events")
                )

    async def _after_failure(self, phase: str, failure: _StreamFailure) -> None:
        # 410 is routine (history compacted while the watch was away); 401/403/404 need a person.
        if failure.kind == ERROR_EXPIRED:
            log = logger.info
        elif failure.kind == ERROR_REJECTED:
            log = logger.error
        else:
            log = logger.warning
        log("%s %s %s failed (%s): %s", self._resource, phase, self._where, failure.kind, failure)
        if self._on_watch_error is not None:
            self._on_watch_error(failure.kind)
        delay_s = self._next_backoff_s
        self._next_backoff_s = min(delay_s * 2, self._backoff_max_s)
        await self._sleep(delay_s / 2 + self._rng.uniform(0, delay_s / 2))

    def _healthy(self) -> None:
        self._next_backoff_s = self._backoff_initial_s

    # --- list ------------------------------------------------------------------------------------------------

    async def _list(self) -> None:
        listed: dict[str, Any] = {}
        list_resource_version: str | None = None
        continue_token: str | None = None
        now_ms = self._clock.now_ms()
        while True:
            page = await self._list_page(continue_token)
            metadata = page.get("metadata")
            items = page.get("items")
            if items is None:
                items = []
            if not isinstance(metadata, Mapping) or not isinstance(items, list):
                raise _StreamFailure(ERROR_PROTOCOL, f"a {self._resource} list without metadata or items")
            if list_resource_version is None:
                list_resource_version = metadata.get("resourceVersion")
                if not isinstance(list_resource_version, str) or not list_resource_version:
                    raise _StreamFailure(ERROR_PROTOCOL, f"a {self._resource} list without metadata.resourceVersion")
            for item in items:
                try:
                    event = self._read(item, PodEventType.ADDED, now_ms)
                except InvalidMessage as exc:
                    self._invalid(exc)
                    continue
                listed[event.uid] = event
            continue_token = metadata.get("continue") or None
            if continue_token is None:
                break
            if not isinstance(continue_token, str):
                raise _StreamFailure(ERROR_PROTOCOL, f"a {self._resource} list whose metadata.continue is not a "
                                                     f"string")

        for uid in [uid for uid in self._items if uid not in listed]:
            gone = dataclasses.replace(self._items[uid], event_type=PodEventType.DELETED, observed_at_unix_ms=now_ms)
            await self._on_event(gone)
            del self._items[uid]
        for uid, event in listed.items():
            known = self._items.get(uid)
            if known is not None and known.resource_version == event.resource_version:
                continue
            if known is not None:
                event = dataclasses.replace(event, event_type=PodEventType.MODIFIED)
            await self._on_event(event)
            self._items[uid] = event
        self._resource_version = list_resource_version
        self._synced = True
        self._healthy()
        logger.info("listed %d %ss %s at resourceVersion %s", len(listed), self._resource, self._where,
                    list_resource_version)
        if self._on_relist is not None:
            self._on_relist(len(listed))

    async def _list_page(self, continue_token: str | None) -> Mapping[str, Any]:
        try:
            response = await self._list_function()(
                **self._selector(),
                limit=self._page_size,
                _continue=continue_token,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(total=self._request_timeout_s),
            )
            try:
                body = await response.read()
            finally:
                response.release()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client raises aiohttp, OS and its own errors; all are one failed attempt
            raise _StreamFailure(_error_kind(exc), _describe(exc)) from exc
        if not 200 <= response.status < 300:
            kind = _status_kind(response.status)
            raise _StreamFailure(kind, f"HTTP {response.status}: {_status_message(body)}")
        try:
            page = json.loads(body)
        except ValueError as exc:
            raise _StreamFailure(ERROR_PROTOCOL, f"{self._resource} list is not JSON: {exc}") from exc
        if not isinstance(page, Mapping):
            raise _StreamFailure(ERROR_PROTOCOL, f"{self._resource} list is not a JSON object")
        return page

    # --- watch -----------------------------------------------------------------------------------------------

    async def _watch(self) -> int:
        """One watch request; returns how many events it delivered when the server ends it cleanly."""
        delivered = 0
        raw_watch = _RawWatch()
        try:
            stream = raw_watch.stream(
                self._list_function(),
                **self._selector(),
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._timeout_seconds,
                _request_timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self._request_timeout_s,
                    sock_read=self._timeout_seconds + self._request_timeout_s,
                ),
            )
            while True:
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    return delivered
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # network, HTTP status, ERROR events and malformed lines alike
                    raise _StreamFailure(_error_kind(exc), _describe(exc)) from exc
                await self._handle(event)
                delivered += 1
                self._healthy()
        finally:
            await raw_watch.close()

    async def _handle(self, event: Any) -> None:
        if not isinstance(event, Mapping):
            raise _StreamFailure(ERROR_PROTOCOL, f"watch line is not a JSON event: {str(event)[:200]!r}")
        event_type = event.get("type")
        raw = event.get("raw_object", event.get("object"))
        if not isinstance(raw, Mapping):
            raise _StreamFailure(ERROR_PROTOCOL, f"{event_type} event without an object")
        resource_version = _resource_version_of(raw)
        if event_type == "BOOKMARK":
            if resource_version:
                self._resource_version = resource_version
            return
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            raise _StreamFailure(ERROR_PROTOCOL, f"unknown watch event type {event_type!r}")
        try:
            item = self._read(raw, PodEventType(event_type), self._clock.now_ms())
        except InvalidMessage as exc:
            self._invalid(exc)
        else:
            known = self._items.get(item.uid)
            if item.event_type == PodEventType.DELETED:
                await self._on_event(item)
                self._items.pop(item.uid, None)
            elif known is None or known.resource_version != item.resource_version:
                # An object that starts matching the selector arrives as ADDED, a replayed one may arrive as
                # either: what the consumer is told follows the cache, not the wire.
                kind = PodEventType.ADDED if known is None else PodEventType.MODIFIED
                if item.event_type != kind:
                    item = dataclasses.replace(item, event_type=kind)
                await self._on_event(item)
                self._items[item.uid] = item
        if resource_version:
            self._resource_version = resource_version

    def _invalid(self, exc: InvalidMessage) -> None:
        logger.warning("skipping a %s object %s: %s", self._resource, self._where, exc)
        if self._on_invalid is not None:
            self._on_invalid(exc)


class PodWatcher(_ListWatcher):
    """Lists and watches the pods of one node and reports them as ``PodEvent``s through ``on_event``.

    The settings and hooks are ``_ListWatcher``'s (``on_invalid_pod`` is its ``on_invalid``), and
    ``on_pod_warning(code)`` for each pod object read with a part left out (``pods.HAMI_ANNOTATION_IGNORED``),
    logged as a warning.
    """

    _resource = "pod"

    def __init__(
        self,
        api_client: client.ApiClient,
        node_name: str,
        cluster: str,
        clock: Clock,
        on_event: Callable[[PodEvent], Awaitable[None]],
        *,
        on_invalid_pod: Callable[[InvalidMessage], None] | None = None,
        on_pod_warning: Callable[[str], None] | None = None,
        **settings: Any,
    ) -> None:
        if not node_name:
            raise ConfigError("the pod watcher needs the node name (spec.nodeName of this node's pods)")
        super().__init__(api_client, f"on node {node_name}", clock, on_event, on_invalid=on_invalid_pod,
                         **settings)
        self._node_name = node_name
        self._cluster = cluster
        self._on_pod_warning = on_pod_warning
        self._field_selector = f"spec.nodeName={node_name}"

    def pods(self) -> Mapping[str, PodEvent]:
        """The current pods of the node by uid, as last emitted (a snapshot)."""
        return MappingProxyType(dict(self._items))

    def _list_function(self) -> Callable[..., Any]:
        return self._core.list_pod_for_all_namespaces

    def _selector(self) -> dict[str, str]:
        return {"field_selector": self._field_selector}

    def _read(self, raw: Mapping[str, Any], event_type: PodEventType, now_ms: int) -> PodEvent:
        return pod_event_from_object(raw, event_type, self._cluster, now_ms, on_warning=self._warning)

    def _warning(self, code: str, detail: str) -> None:
        logger.warning("pod object on node %s read in part: %s", self._node_name, detail)
        if self._on_pod_warning is not None:
            self._on_pod_warning(code)


class NamespaceWatcher(_ListWatcher):
    """Lists and watches the cluster's Namespaces and reports each change as a ``namespaces.NamespaceEvent``
    through ``on_event`` (the collector puts their labels on its pods' events). Needs ``get``, ``list`` and
    ``watch`` on ``namespaces``. The settings and hooks are ``_ListWatcher``'s."""

    _resource = "namespace"

    def __init__(self, api_client: client.ApiClient, clock: Clock,
                 on_event: Callable[[NamespaceEvent], Awaitable[None]], **settings: Any) -> None:
        super().__init__(api_client, "in the cluster", clock, on_event, **settings)

    def namespaces(self) -> Mapping[str, NamespaceEvent]:
        """The current namespaces by uid, as last emitted (a snapshot)."""
        return MappingProxyType(dict(self._items))

    def _list_function(self) -> Callable[..., Any]:
        return self._core.list_namespace

    def _read(self, raw: Mapping[str, Any], event_type: PodEventType, now_ms: int) -> NamespaceEvent:
        return namespace_event_from_object(raw, event_type, now_ms)


def _resource_version_of(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        value = metadata.get("resourceVersion")
        if isinstance(value, str) and value:
            return value
    return None


def _status_kind(status: int | None) -> str:
    if status == 410:
        return ERROR_EXPIRED
    if not status or status == 429 or status >= 500:
        return ERROR_SERVER
    return ERROR_REJECTED


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return _status_kind(exc.status)
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
        return ERROR_TIMEOUT
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return ERROR_CONNECTION
    return ERROR_PROTOCOL


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"[:500]


def _status_message(body: bytes) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", errors="replace")
    if isinstance(status, Mapping):
        return f"{status.get('reason')}: {status.get('message')}"
    return str(status)[:200]


# --- clients ------------------------------------------------------------------------------------------------------


def make_api_client(host: str, token: str | None, ca_file: str | None, verify_ssl: bool) -> client.ApiClient:
    """An ApiClient for ``host`` (``https://...`` or ``http://...``) with an optional bearer token and CA bundle.

    Call it from a coroutine: the aiohttp session binds to the running loop. Bad settings raise ``ConfigError``.
    """
    if not host.startswith(("https://", "http://")):
        raise ConfigError(f"Kubernetes API host {host!r} must start with https:// or http://")
    configuration = client.Configuration(host=host.rstrip("/"))
    if token:
        configuration.api_key["BearerToken"] = token
        configuration.api_key_prefix["BearerToken"] = "Bearer"
    configuration.ssl_ca_cert = ca_file
    configuration.verify_ssl = verify_ssl
    try:
        return client.ApiClient(configuration)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use CA file {ca_file!r}: {exc}") from exc


def in_cluster_api_client(
    *,
    token_path: str = SERVICE_ACCOUNT_TOKEN_PATH,
    ca_path: str = SERVICE_ACCOUNT_CA_PATH,
    environ: Mapping[str, str] | None = None,
) -> client.ApiClient:
    """An ApiClient from the pod's service account (KUBERNETES_SERVICE_HOST/PORT, token and CA files).

    The token file is re-read every minute, so rotated (bound) tokens keep working. Call it from a coroutine.
    Outside a pod, or with unreadable files, raises ``ConfigError``.
    """
    configuration = client.Configuration()
    try:
        config.load_incluster_config(
            client_configuration=configuration,
            token_filename=token_path,
            cert_filename=ca_path,
            environ=dict(os.environ if environ is None else environ),
        )
        return client.ApiClient(configuration)
    except config.ConfigException as exc:
        raise ConfigError(f"no in-cluster Kubernetes configuration: {exc}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot read the service account files: {exc}") from exc


# --- DRA: the node's ResourceSlices and the pods' ResourceClaims (resource.k8s.io/v1) ---------------------------


class DraApiReader:
    """Reads what ``services.collector.dra.DraResolver`` needs, as the API server serialises it (raw JSON, no
    models): ``list_slices()`` the ResourceSlices of this node (``fieldSelector=spec.nodeName=<node>``, paged),
    ``read_claim(namespace, name)`` one ResourceClaim (None when it does not exist). Other failures raise (the
    resolver keeps its last answer). Needs read-only ``list`` on ``resourceslices`` and ``get`` on
    ``resourceclaims`` of ``resource.k8s.io``."""

    def __init__(self, api_client: client.ApiClient, node_name: str, *, request_timeout_s: float = 10.0,
                 page_size: int = 500) -> None:
        self._resource = client.ResourceV1Api(api_client)
        self._node_name = node_name
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._page_size = page_size

    async def _json(self, response: Any) -> Any:
        try:
            body = await response.read()
        finally:
            response.release()
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=_status_message(body))
        return json.loads(body)

    async def list_slices(self) -> list[Mapping[str, Any]]:
        items: list[Mapping[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={self._node_name}", "limit": self._page_size}
            if token:
                kwargs["_continue"] = token
            page = await self._json(await self._resource.list_resource_slice(
                _preload_content=False, _request_timeout=self._timeout, **kwargs))
            items.extend(item for item in page.get("items") or () if isinstance(item, Mapping))
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def read_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            return await self._json(await self._resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self._timeout))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
