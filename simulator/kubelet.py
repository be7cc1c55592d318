"""A kubelet PodResources v1 server on a unix socket: a real gRPC peer for tests and the collector's simulate mode.

``FakeKubelet`` serves the same proto as the kubelet (``services/collector/podresources/api.proto``) with
``grpc.aio`` and answers as the kubelet's ``server_v1.go`` does, including its error statuses:

* ``Get`` not served → UNIMPLEMENTED "unknown method Get for service v1.PodResourcesLister" (a kubelet older than
  the Get method), or with ``get_disabled`` → UNKNOWN "PodResources API Get method disabled" (KubeletPodResourcesGet
  feature gate off);
* ``Get`` of a pod it does not know → UNKNOWN "pod <name> in namespace <ns> not found";
* ``delay_s`` > 0 → every answer waits that long first (a slow kubelet);
* ``stop()`` → the socket goes away, as when the kubelet stops; with ``leave_stale_socket=True`` a socket file
  nobody listens on stays behind, as after a kubelet crash.

``serve_get``, ``get_disabled`` and ``delay_s`` are plain attributes and may be changed while serving.
The assignments provider is called on every request, so a simulation can change assignments between ticks.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

import grpc
import grpc.aio

from gpumeter.errors import ConfigError
from services.collector.podresources import api_pb2, api_pb2_grpc
from services.collector.podresources.client import MAX_UNIX_SOCKET_PATH_BYTES, ContainerClaimDevice

# (namespace, pod_name, container_name, resource_name, device_ids). Empty device_ids lists the container with no
# devices for that resource, as the kubelet lists every container of every active pod.
Assignment = tuple[str, str, str, str, tuple[str, ...]]
AssignmentsProvider = Callable[[], Iterable[Assignment]]
# (resource_name, device_ids) the node can allocate.
AllocatableProvider = Callable[[], Iterable[tuple[str, tuple[str, ...]]]]


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def build_pod_resources(assignments: Iterable[Assignment]) -> list[api_pb2.PodResources]:
    """Group flat assignments into PodResources messages, keeping first-seen order of pods and containers.

    An item may also be a DRA claim device (``ContainerClaimDevice``, the record the collector's client reads back
    from the same message): it is listed under the container's ``dynamic_resources``, one entry per claim, as the
    kubelet's DRA manager reports it."""
    pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
    claims: dict[tuple[str, str, str], dict[tuple[str, str], list]] = {}
    for item in assignments:
        if isinstance(item, ContainerClaimDevice):
            pods.setdefault((str(item.namespace), str(item.pod_name)), {}).setdefault(str(item.container_name), {})
            per_claim = claims.setdefault((str(item.namespace), str(item.pod_name), str(item.container_name)), {})
            per_claim.setdefault((str(item.claim_namespace), str(item.claim_name)), []).append(item)
            continue
        namespace, pod_name, container_name, resource_name, device_ids = item
        containers = pods.setdefault((str(namespace), str(pod_name)), {})
        resources = containers.setdefault(str(container_name), {})
        ids = [str(d) for d in device_ids]
        if ids:
            resources.setdefault(str(resource_name), []).extend(ids)
    out: list[api_pb2.PodResources] = []
    for (namespace, pod_name), containers in pods.items():
        pod = api_pb2.PodResources(name=pod_name, namespace=namespace)
        for container_name, resources in containers.items():
            container = pod.containers.add(name=container_name)
            for resource_name, ids in resources.items():
                container.devices.add(resource_name=resource_name, device_ids=ids)
            for (claim_namespace, claim_name), devices in claims.get((namespace, pod_name, container_name), {}).items():
                dynamic = container.dynamic_resources.add(claim_name=claim_name, claim_namespace=claim_namespace)
                for d in devices:
                    resource = dynamic.claim_resources.add(
                        driver_name=d.driver_name, pool_name=d.pool_name, device_name=d.device_name)
                    for cdi in d.cdi_ids:
                        resource.cdi_devices.add(name=cdi)
        out.append(pod)
    return out


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def List(self, request, context):  # noqa: N802, ANN001, ANN201 - gRPC method name and signature
        self._kubelet.calls["List"] += 1
        await self._kubelet._delay()
        return api_pb2.ListPodResourcesResponse(pod_resources=build_pod_resources(self._kubelet._assignments()))

    async def GetAllocatableResources(self, request, context):  # noqa: N802, ANN001, ANN201
        self._kubelet.calls["GetAllocatableResources"] += 1
        await self._kubelet._delay()
        response = api_pb2.AllocatableResourcesResponse()
        for resource_name, device_ids in self._kubelet._allocatable():
            response.devices.add(resource_name=resource_name, device_ids=list(device_ids))
        return response

    async def Get(self, request, context):  # noqa: N802, ANN001, ANN201
        self._kubelet.calls["Get"] += 1
        if not self._kubelet.serve_get:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method Get for service v1.PodResourcesLister")
        if self._kubelet.get_disabled:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        await self._kubelet._delay()
        for pod in build_pod_resources(self._kubelet._assignments()):
            if pod.namespace == request.pod_namespace and pod.name == request.pod_name:
                return api_pb2.GetPodResourcesResponse(pod_resources=pod)
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )


class FakeKubelet:
    """A PodResources v1 gRPC server on ``socket_path``, answering from ``assignments_provider``.

    ``allocatable_provider`` defaults to every device id the assignments name, per resource (a node with no free
    devices). ``calls`` counts requests per method, for tests that check which method a client used.
    """

    def __init__(
        self,
        socket_path: str | Path,
        assignments_provider: AssignmentsProvider,
        serve_get: bool = True,
        delay_s: float = 0.0,
        *,
        get_disabled: bool = False,
        allocatable_provider: AllocatableProvider | None = None,
    ) -> None:
        path = os.path.abspath(os.fspath(socket_path))
        if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH_BYTES:
            raise ConfigError(f"unix socket path longer than {MAX_UNIX_SOCKET_PATH_BYTES} bytes: {path}")
        if delay_s < 0:
            raise ConfigError(f"delay_s must not be negative, got {delay_s!r}")
        self._socket_path = path
        self._assignments_provider = assignments_provider
        self._allocatable_provider = allocatable_provider
        self.serve_get = serve_get
        self.get_disabled = get_disabled
        self.delay_s = delay_s
        self.calls: Counter[str] = Counter()
        self._server: grpc.aio.Server | None = None

    @property
    def socket_path(self) -> str:
        return self._socket_path

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Listen on the socket (creating its directory; replacing a stale socket file) and start serving."""
        if self._server is not None:
            raise RuntimeError("FakeKubelet already started")
        Path(self._socket_path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(self._socket_path):
            if not _is_socket(self._socket_path):
                raise ConfigError(f"{self._socket_path} exists and is not a unix socket; not replacing it")
            os.unlink(self._socket_path)
        server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        try:
            server.add_insecure_port(f"unix://{self._socket_path}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on unix socket {self._socket_path}: {exc}") from exc
        await server.start()
        self._server = server

    async def stop(self, grace_s: float = 0.0, *, leave_stale_socket: bool = False) -> None:
        """Stop serving; in-flight calls are cancelled after ``grace_s``. Idempotent.

        gRPC removes its socket file on shutdown, as a kubelet that stops cleanly does. ``leave_stale_socket``
        leaves a socket file nobody listens on, as a crashed kubelet does: connects to it are refused.
        """
        server, self._server = self._server, None
        if server is not None:
            # None aborts in-flight calls at once and waits for their handlers to end.
            await server.stop(grace_s if grace_s > 0 else None)
        if _is_socket(self._socket_path):
            os.unlink(self._socket_path)
        if leave_stale_socket:
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                stale.bind(self._socket_path)
            finally:
                stale.close()

    async def __aenter__(self) -> FakeKubelet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _delay(self) -> None:
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)

    def _assignments(self) -> list[Assignment]:
        return list(self._assignments_provider())

    def _allocatable(self) -> list[tuple[str, tuple[str, ...]]]:
        if self._allocatable_provider is not None:
            return [(str(name), tuple(ids)) for name, ids in self._allocatable_provider()]
        merged: dict[str, list[str]] = {}
        for item in self._assignments():
            if isinstance(item, ContainerClaimDevice):
                continue  # DRA devices are not the device manager's to allocate
            _namespace, _pod, _container, resource_name, device_ids = item
            known = merged.setdefault(resource_name, [])
            known.extend(d for d in device_ids if d not in known)
        return [(name, tuple(ids)) for name, ids in merged.items()]
